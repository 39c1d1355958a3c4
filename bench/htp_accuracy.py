"""The QNN HTP path against the INT8 reference (mllm-NPU §3.2-§3.3): `bench/htp_accuracy.py`.

Per output of layers 0-1 at C=64, the largest HTP - `QuantizedBackend` difference in output quantization
steps; with `--e2e`, a greedy answer from a 30-layer HTP prefill. Each QNN configuration (generic simulator,
soc_model 60) runs in its own process: the simulator keeps state across sessions of one process.
All numbers are *simulated* (the x86-64 HTP simulator of onnxruntime-qnn).

    python bench/htp_accuracy.py [--e2e] --json --out bench/results     # also writes htp_accuracy.json
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import json
import os
import subprocess
import sys
import time

from bench.entry import CHECKOUT, add_out_arg, child_env, out_dir, wrote
from hetero.errors import HeteroError
from hetero.npu.cache import library_versions
from hetero.paths import atomic_path

ROOT = CHECKOUT  # the source checkout: tests/data/sample.txt is the prompt text
HELP = "QNN HTP graphs vs the INT8 reference in quantization steps (simulated); --e2e: a 30-layer answer"

CONFIGS = {"generic": "", "soc60": "soc_model=60"}  # HETERO_QNN_OPTIONS of each configuration
E2E = {"generic": 128, "soc60": 256}  # chunk: the generic simulator cannot finalize C=256 (constraints)
PROMPT = "What is the capital of France?"


def layer_steps() -> dict:
    """In this process (provider options from $HETERO_QNN_OPTIONS): steps per output of layers 0-1 at C=64."""
    import numpy as np
    import torch

    from hetero import model as ref
    from hetero.loader import load_model
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.npu.providers import QnnHtpProvider
    from hetero.npu.quickplan import absmax_plan
    from hetero.outliers.shadow import QuantizedBackend

    model = load_model()
    ids = torch.tensor(model.tokenizer((ROOT / "tests" / "data" / "sample.txt").read_text())["input_ids"])
    plan = absmax_plan(model, ids[:128])
    provider = QnnHtpProvider()
    be = NpuBackend(model, plan, 64, provider=provider, layers=[0, 1], options=GraphOptions(shape="2d"))
    rb = QuantizedBackend(model.config, model.weights, plan)
    h = ref.embed(model.weights, ids[:64])
    a = torch.randn(64, model.config.q_dim, generator=torch.Generator().manual_seed(0)) * 0.2

    def steps(got, want) -> float:  # got: the NPU lane's numpy result, want: the torch reference's
        got = torch.from_numpy(got)
        return round(float((got - want).abs().max()) / (float(want.abs().max()) / 127), 2)

    def np_(t: torch.Tensor):
        return np.ascontiguousarray(t.numpy())

    out = {"provider": provider.name, "flavor": provider.flavor, "layers": {}}
    for layer in (0, 1):
        q, k, v = (steps(g, w) for g, w in zip(be.qkv(layer, np_(h)), rb.qkv(layer, h)))
        out["layers"][str(layer)] = {"q": q, "k": k, "v": v,
                                     "o_ffn": steps(be.o_ffn(layer, np_(a), np_(h)), rb.o_ffn(layer, a, h))}
        h = rb.o_ffn(layer, a, h)
    return out


def _child(config: str, what: str) -> dict:
    env = child_env({**os.environ, "HETERO_QNN_OPTIONS": CONFIGS[config]})
    if what == "steps":
        cmd = [sys.executable, "-m", "bench", "htp_accuracy", "--child-steps"]
    else:
        cmd = [sys.executable, "-m", "hetero", "run", PROMPT, "--method", "hetero-qnn", "--chunk",
               str(E2E[config]), "--max-new-tokens", "8", "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise HeteroError(f"{config} {what} failed:\n{res.stderr[-2000:]}")
    obj = json.loads(res.stdout[res.stdout.index("{"):])  # the simulator prints banners before the JSON
    obj["wall_s"] = round(time.perf_counter() - t0, 1)
    return obj


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--e2e", action="store_true", help="also a greedy answer from a 30-layer HTP prefill (minutes)")
    add_out_arg(ap, "htp_accuracy.json (with --json)")
    ap.add_argument("--json", action="store_true", help="print JSON and write <out>/htp_accuracy.json")
    ap.add_argument("--child-steps", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child_steps:
        print(json.dumps(layer_steps()))
        return 0
    result = {"bench": "htp_accuracy", "simulated": True, "versions": library_versions(),
              "note": "x86-64 HTP simulator of onnxruntime-qnn (simulated, not a device). steps = max |HTP - "
                      "INT8 reference| / (absmax(reference) / 127), layers 0-1 at C=64; the goal is <= 1.",
              "configs": {}}
    for config in CONFIGS:
        row = {"qnn_options": CONFIGS[config], "steps": _child(config, "steps")}
        if args.e2e:
            r = _child(config, "e2e")
            row["e2e"] = {"prompt": PROMPT, "chunk": E2E[config], "text": r["text"],
                          "prefill_ms": r["prefill_ms"], "wall_s": r["wall_s"]}
        result["configs"][config] = row
        print(f"{config}: {row['steps']['layers']}" + (f" | {row['e2e']['text']!r}" if args.e2e else ""),
              file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
        out = out_dir(args.out)
        with atomic_path(out / "htp_accuracy.json") as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n")
        wrote([out / "htp_accuracy.json"])
    return 0
