"""The peers' models, built from hetero's own GGUF by the peers' own tools, cached and verified (issue 24).

A user who would pick another runtime starts from the same file. Every peer's model is derived from it,
nothing converted by hand:
- `hf`: Hugging Face safetensors through transformers' GGUF loader (dequantized to float32);
- `openvino-int8`: `optimum-cli export openvino --weight-format int8` of `hf` (optimum-intel);
- `openvino-int4`: the same with `--weight-format int4 --sym --group-size 64 --ratio 1.0` (every linear in 4-bit
  symmetric groups of 64; the exporter refuses groups of 128 for this model), OpenVINO's fastest at short prompts;
- `ort-genai-int4`: `onnxruntime_genai.models.builder -p int4 --extra_options int4_accuracy_level=4` of the HF
  folder that the builder's own Python's transformers loads from the GGUF (as `hf`);
- `gguf-q4_0`, `gguf-q8_0`: the GGUF re-quantized by llama.cpp's own quantizer (`llama_model_quantize`).

Each entry lives in `cache_dir()/peers/<GGUF fingerprint>/<kind>/`, built in a temp folder and renamed into
place whole, under the entry's lock; its `record.json` names the tool versions and every file's size and
content hash (`paths.file_record`), checked before each use. The peers' tools pin their own transformers, so
each may live in a venv of its own (the Makefile's `bench` target makes both):
- `$HETERO_OPTIMUM_CLI` names optimum-intel's `optimum-cli`: optimum-intel 2.2 exports Gemma 3 only under
  transformers <= 5.0 ("Maximum required is 5.0"), Llama under 5.0 too;
- `$HETERO_ORT_GENAI_PYTHON` names a Python with ONNX Runtime GenAI's builder: its Gemma 3 builder reads
  transformers 4's Gemma 3 config (`rope_local_base_freq`, one `rope_parameters` set; transformers 5 nests them
  per layer type: KeyError 'rope_type'), and builder 0.14+ imports transformers 5's classes, so Gemma 3 builds
  with builder 0.13.2 under transformers 4.57 (its model runs on the bench's own onnxruntime-genai: checked
  against hetero's float logits, max abs 1.7e-3 at 1024 tokens in fp32).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from bench.entry import exit_reason
from bench.workers import EngineUnavailable
from hetero.paths import cache_dir, file_fingerprint, file_record, verify_files

OPTIMUM_CLI = "HETERO_OPTIMUM_CLI"
ORT_GENAI_PYTHON = "HETERO_ORT_GENAI_PYTHON"
RECORD = "record.json"
_LLAMA_FTYPES = {"gguf-q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "gguf-q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _run(cmd: list[str], what: str, timeout_s: float = 1800) -> None:
    """Run a peer's own tool; its last lines of output name the failure. A tool that cannot convert the model
    (optimum-intel refusing Gemma 3 under the transformers it has) makes the peer unavailable for it: the bench
    skips it with that line, and the other engines still run."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise EngineUnavailable(f"{what} {exit_reason(proc.returncode)}: {tail}")


# transformers' GGUF loader, dequantized to float32, saved as safetensors: `python -c _HF_FROM_GGUF GGUF OUT` in the
# Python whose transformers the next tool reads with (transformers 5: `GgufConfig(dequantize=True)`; 4: always)
_HF_FROM_GGUF = """
import sys
from pathlib import Path
import torch
import transformers as T
gguf, out = Path(sys.argv[1]), sys.argv[2]
q = {"quantization_config": T.GgufConfig(gguf_file=gguf.name, dequantize=True)} if hasattr(T, "GgufConfig") else {}
d = {"dtype": torch.float32} if int(T.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
T.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **d, **q).save_pretrained(out)
T.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
"""


def _hf_from_gguf(python: str, gguf: Path, out: Path) -> None:
    _run([python, "-c", _HF_FROM_GGUF, str(gguf), str(out)], "transformers' GGUF loader")


def _versions(python: str, *dists: str) -> dict[str, str]:
    """The versions of `dists` installed for `python`."""
    code = "import sys, importlib.metadata as m; print(' '.join(m.version(d) for d in sys.argv[1:]))"
    got = subprocess.run([python, "-c", code, *dists], capture_output=True, text=True).stdout.split()
    return dict(zip(dists, got)) if len(got) == len(dists) else {d: "unknown" for d in dists}


def _build_hf(gguf: Path, out: Path) -> dict[str, str]:
    _hf_from_gguf(sys.executable, gguf, out)
    return {"transformers": _version("transformers")}


def optimum_cli() -> str:
    """`optimum-cli` of optimum-intel: `$HETERO_OPTIMUM_CLI`, else beside this Python, else on PATH."""
    env = os.environ.get(OPTIMUM_CLI)
    if env:
        if not os.access(env, os.X_OK):
            raise EngineUnavailable(f"{OPTIMUM_CLI}={env!r} is not an executable optimum-cli")
        return env
    beside = Path(sys.executable).parent / "optimum-cli"
    found = str(beside) if beside.is_file() else shutil.which("optimum-cli")
    if not found:
        raise EngineUnavailable("optimum-intel's optimum-cli is not installed (Gemma 3 needs transformers<=5.0: "
                                "`pip install 'optimum-intel[openvino,nncf]==2.2.0' transformers==5.0.0` in a venv of "
                                f"its own, then set {OPTIMUM_CLI} to its bin/optimum-cli; `make bench` does)")
    return found


def _build_openvino(*weight_args: str) -> Callable[[Path, Path], dict[str, str]]:
    """optimum-cli's export of the `hf` folder with these weight-compression options."""
    def build(hf: Path, out: Path) -> dict[str, str]:
        cli = optimum_cli()
        _run([cli, "export", "openvino", "-m", str(hf), "--task", "text-generation-with-past", *weight_args, str(out)],
             "optimum-cli export openvino")
        ver = subprocess.run([str(Path(cli).parent / "python"), "-c",
                              "import optimum.intel.version as v; print(v.__version__)"], capture_output=True, text=True)
        return {"optimum-intel": ver.stdout.strip() or "unknown", "optimum-cli": cli, "options": " ".join(weight_args)}

    return build


def _build_ort_genai(gguf: Path, out: Path) -> dict[str, str]:
    """The builder's int4 model of the HF folder its own Python's transformers loads from the GGUF ($HETERO_ORT_GENAI_PYTHON,
    else this Python)."""
    python = os.environ.get(ORT_GENAI_PYTHON)
    if python and not os.access(python, os.X_OK):
        raise EngineUnavailable(f"{ORT_GENAI_PYTHON}={python!r} is not an executable Python")
    if not python:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            raise EngineUnavailable("onnxruntime-genai is not installed (pip install 'hetero[bench]')") from None
        python = sys.executable
    work = out.parent / f".{out.name}.work"
    shutil.rmtree(work, ignore_errors=True)
    try:
        _hf_from_gguf(python, gguf, work / "hf")
        _run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(work / "hf"), "-o", str(out), "-p", "int4",
              "-e", "cpu", "-c", str(work / "cache"), "--extra_options", "int4_accuracy_level=4"],
             "onnxruntime_genai.models.builder")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**_versions(python, "onnxruntime-genai", "transformers"), "python": python}


def _build_llama_quant(kind: str) -> Callable[[Path, Path], dict[str, str]]:
    def build(gguf: Path, out: Path) -> dict[str, str]:
        llama_cpp = _llama_cpp()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, _LLAMA_FTYPES[kind])
        params.nthread = os.cpu_count() or 1
        params.allow_requantize = True  # the shipped GGUF is already quantized (Q4_1)
        out.mkdir(parents=True, exist_ok=True)
        target = out / "model.gguf"
        rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(target).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed (return {rc})")
        return {"llama-cpp-python": _version("llama_cpp_python")}

    return build


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
    return llama_cpp


# kind -> (what it is built from: "gguf" or another kind, builder)
KINDS: dict[str, tuple[str, Callable[[Path, Path], dict[str, str]]]] = {
    "hf": ("gguf", _build_hf),
    "openvino-int8": ("hf", _build_openvino("--weight-format", "int8")),
    "openvino-int4": ("hf", _build_openvino("--weight-format", "int4", "--sym", "--group-size", "64",
                                            "--ratio", "1.0")),
    "ort-genai-int4": ("gguf", _build_ort_genai),
    "gguf-q4_0": ("gguf", _build_llama_quant("gguf-q4_0")),
    "gguf-q8_0": ("gguf", _build_llama_quant("gguf-q8_0")),
}


def peers_root(gguf: Path) -> Path:
    """`cache_dir()/peers/<fingerprint of the GGUF>`: a different file never meets another's peers."""
    return cache_dir() / "peers" / file_fingerprint(gguf)


def verify(entry: Path) -> str | None:
    """Why `entry` cannot be used (missing, unfinished, a file changed), or None when it checks out."""
    rec_path = entry / RECORD
    if not rec_path.is_file():
        return "not built"
    try:
        record = json.loads(rec_path.read_text())
        bad = verify_files(entry, record["files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable record: {e}"
    return "; ".join(str(d) for d in bad) or None


def cached(gguf: str | os.PathLike, kind: str) -> Path | None:
    """The folder of peer model `kind` of `gguf` when it is built and checks out (`verify`), else None: a cached,
    verified peer needs neither its converter nor the models it was built from."""
    entry = peers_root(Path(gguf)) / kind
    return entry if verify(entry) is None else None


def build(gguf: str | os.PathLike, kind: str) -> Path:
    """The folder of peer model `kind` built from `gguf`, building it (and what it needs) once."""
    if kind not in KINDS:
        raise ValueError(f"unknown peer model kind {kind!r} (of {', '.join(KINDS)})")
    gguf = Path(gguf)
    if gguf.suffix != ".gguf":
        raise EngineUnavailable(f"the peers are built from a GGUF model, got {gguf.name}")
    done = cached(gguf, kind)
    if done is not None:  # its sources (the safetensors of the OpenVINO peer) may be gone: not needed
        return done
    source_kind, builder = KINDS[kind]
    source = gguf if source_kind == "gguf" else build(gguf, source_kind)
    root = peers_root(gguf)
    entry = root / kind
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{kind}.lock"), timeout=3 * 3600):
        if verify(entry) is None:
            return entry
        for old in root.glob(f".{kind}.*.build"):  # builds killed half-way (the lock is ours: none runs)
            shutil.rmtree(old, ignore_errors=True)
        tmp = root / f".{kind}.{os.getpid()}.build"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tools = builder(source, tmp)
            files = {str(p.relative_to(tmp)): file_record(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            record = {"kind": kind, "source": str(source), "gguf_fingerprint": file_fingerprint(gguf),
                      "tools": tools, "files": files}
            (tmp / RECORD).write_text(json.dumps(record, indent=1))
            if entry.exists():
                shutil.rmtree(entry)  # it failed `verify`: corrupt or unfinished
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry

