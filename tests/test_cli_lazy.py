"""The CLI imports only what its command uses (each import is start time): `hetero run` pulls in no benchmark or
server."""

from __future__ import annotations

import subprocess
import sys

from hetero.cli import COMMANDS, build_parser


def test_every_command_is_mapped_to_the_module_that_registers_it():
    full = build_parser([])  # no command given: every command is listed by its help line
    sub = next(a for a in full._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)
    for command, group in COMMANDS.items():
        one = build_parser([command])
        assert command in next(a for a in one._actions if a.dest == "command").choices, group


def test_version_and_help_import_no_torch_numba_nor_onnxruntime():
    """They list the commands by their help lines (`COMMANDS`) without registering their arguments: 0.1 s, not the
    1.8 s that importing every command's module took."""
    for flag in ("--version", "--help"):
        code = (f"import sys; from hetero.cli import main\ntry: main([{flag!r}])\nexcept SystemExit: pass\n"
                "print(sorted(m for m in ('torch', 'numba', 'onnxruntime', 'transformers') if m in sys.modules))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert done.stdout.strip().splitlines()[-1] == "[]", flag


def test_run_imports_no_benchmark_nor_server():
    code = ("import sys; from hetero.cli import build_parser; build_parser(['run', 'hi']).parse_args(['run', 'hi']); "
            "print(sorted(m for m in sys.modules if m.startswith(('bench', 'hetero.serve.http', 'fastapi', "
            "'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_warm_run_imports_no_torch_transformers_nor_onnx(default_model):
    """The default model's tokenizer and chat template come from `tokenizers` + jinja2 (`hetero.tokenizer`):
    transformers (~1 s of imports) is not on a warm `hetero run`'s path; nor torch (~0.9 s: the default INT8 path's
    containers are numpy, its float weights a mapped file, `loader.Model.arrays`), nor networkx (0.15 s: a
    prefill's DAG is built flat, `dag.prefill_dag`), nor the server, nor onnx (~0.1 s: a warm start loads its
    graphs, the INT8 head's serialized, and builds none)."""
    warm = [sys.executable, "-m", "hetero", "run", "hi", "-n", "1"]
    subprocess.run(warm, capture_output=True, check=True)  # the cache warm whatever ran before (a cold one builds graphs)
    done = subprocess.run([sys.executable, "-X", "importtime", *warm[1:]], capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "tokenizers" in imported and "hetero.decode.step" in imported
    assert "onnxruntime" in imported and "hetero.npu.graph_backend" in imported
    assert not imported & {"torch", "transformers", "networkx", "hetero.serve.service", "onnx", "hetero.npu.export"}
