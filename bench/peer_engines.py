"""The runtimes a user would pick instead of hetero, as the benchmarks run them (issue 24): OpenVINO GenAI,
ONNX Runtime GenAI and llama.cpp, each on a model built from hetero's own GGUF (`bench.peers`), fed the same
token ids as hetero, greedy, on `threads` threads.

A session runs a prompt's prefill (the time to the first token, `prefill`) or a prefill and then `n_new`
greedy tokens with no stop on end of turn (`decode`, timing the tokens after the prefill).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from bench.workers import EngineUnavailable, WorkerProcess, answer_pipe, worker_env

# The peers: the runtimes a user would pick instead, each at its fastest configurations on CPU (issue 24).
# `llama_cpp` runs the GGUF as shipped; the others run models their own tools built from it (`bench.peers`).
PEERS = ("openvino_genai", "ort_genai", "llama_cpp", "llama_cpp_q4_0", "llama_cpp_q4_0_fa", "llama_cpp_q8_0",
         "llama_cpp_q8_0_fa")


class PeerSession(Protocol):
    def prefill(self, ids: list[int]) -> int:
        """Prefill `ids` from an empty cache; the first token (argmax)."""

    def decode(self, ids: list[int], n_new: int) -> tuple[float, list[int]]:
        """Prefill `ids`, then `n_new` greedy tokens; (seconds after the prefill, the tokens)."""


@dataclass(frozen=True, slots=True)
class LlamaCppConfig:
    """How llama.cpp runs: the GGUF's format (as shipped or re-quantized by llama.cpp) and flash attention."""

    kind: str | None  # `peers.KINDS` entry, None: the GGUF as shipped
    flash_attn: bool

    @property
    def label(self) -> str:
        fmt = self.kind.removeprefix("gguf-").upper() if self.kind else "as shipped"
        return f"llama.cpp {fmt}, flash attention {'on' if self.flash_attn else 'off'}"


class LlamaCppSession:
    """llama-cpp-python: n_batch 2048 (a whole prompt per call up to 2048), n_ubatch 512, as its docs advise
    for prompt processing on CPU."""

    def __init__(self, gguf: Path, threads: int, max_len: int, flash_attn: bool):
        try:
            import llama_cpp
        except ImportError:
            raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max_len + 256, n_batch=min(2048, max_len + 256),
                                   n_ubatch=512, n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                                   verbose=False)

    def prefill(self, ids: list[int]) -> int:
        from hetero.adapters.llamacpp import last_logits

        self.llm.reset()
        self.llm.eval(ids)
        return int(np.argmax(last_logits(self.llm)))

    def decode(self, ids: list[int], n_new: int, stop: frozenset[int] = frozenset()) -> tuple[float, list[int]]:
        """As `PeerSession.decode`; `stop`: ids that end it early (kept as the last token)."""
        from hetero.adapters.llamacpp import last_logits

        out = [self.prefill(ids)]
        t0 = time.perf_counter()
        while len(out) < n_new and out[-1] not in stop:
            self.llm.eval([out[-1]])
            out.append(int(np.argmax(last_logits(self.llm))))
        return time.perf_counter() - t0, out


class OpenVinoSession:
    """OpenVINO GenAI's LLMPipeline on the CPU: INT8 weights (optimum-intel's export), INFERENCE_NUM_THREADS
    = threads, prefix caching off (each prompt computed whole), greedy."""

    def __init__(self, folder: Path, threads: int, max_len: int):
        try:
            import openvino as ov
            import openvino_genai as ov_genai
        except ImportError:
            raise EngineUnavailable("openvino-genai is not installed (pip install 'hetero[bench]')") from None
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = False
        sched.max_num_batched_tokens = max(max_len, sched.max_num_batched_tokens)  # a prompt in one step
        self.ov = ov
        self.pipe = ov_genai.LLMPipeline(str(folder), "CPU", scheduler_config=sched, INFERENCE_NUM_THREADS=threads)

    def _run(self, ids: list[int], n_new: int):
        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos, cfg.do_sample = n_new, n_new, True, False
        return self.pipe.generate(self.ov.Tensor(np.asarray([ids], dtype=np.int64)), cfg)

    def prefill(self, ids: list[int]) -> int:
        return int(self._run(ids, 1).tokens[0][0])

    def decode(self, ids: list[int], n_new: int) -> tuple[float, list[int]]:
        res = self._run(ids, n_new)
        m = res.perf_metrics
        return (m.get_generate_duration().mean - m.get_ttft().mean) / 1e3, [int(t) for t in res.tokens[0]]


class OrtGenAiSession:
    """ONNX Runtime GenAI on the CPU: the builder's int4 model (accuracy level 4: int8 activations), intra-op
    threads = threads, a KV buffer of the prompt's length, greedy."""

    def __init__(self, folder: Path, threads: int, max_len: int):
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise EngineUnavailable("onnxruntime-genai is not installed (pip install 'hetero[bench]')") from None
        cfg = og.Config(str(folder))
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                            "inter_op_num_threads": 1}}}}))
        self.og, self.model = og, og.Model(cfg)

    def _generator(self, ids: list[int], n_new: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + n_new, min_length=len(ids) + n_new, do_sample=False)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        return gen

    def prefill(self, ids: list[int]) -> int:
        gen = self._generator(ids, 1)
        return int(np.argmax(gen.get_logits()[0, -1]))

    def decode(self, ids: list[int], n_new: int) -> tuple[float, list[int]]:
        gen = self._generator(ids, n_new)
        t0 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        s = time.perf_counter() - t0
        return s, [int(t) for t in gen.get_sequence(0)[len(ids):]]


# engine name (`engines.PEERS`) -> (the `peers.KINDS` model it runs, None: the GGUF as shipped; its session)
_LLAMA = {"llama_cpp": LlamaCppConfig(None, False),
          "llama_cpp_q4_0": LlamaCppConfig("gguf-q4_0", False), "llama_cpp_q4_0_fa": LlamaCppConfig("gguf-q4_0", True),
          "llama_cpp_q8_0": LlamaCppConfig("gguf-q8_0", False), "llama_cpp_q8_0_fa": LlamaCppConfig("gguf-q8_0", True)}
MODEL_KIND: dict[str, str | None] = {"openvino_genai": "openvino-int8", "ort_genai": "ort-genai-int4",
                                     **{name: c.kind for name, c in _LLAMA.items()}}
LABELS: dict[str, str] = {"openvino_genai": "OpenVINO GenAI, INT8 weights (optimum-intel export)",
                          "ort_genai": "ONNX Runtime GenAI, int4 (accuracy level 4)",
                          **{name: c.label for name, c in _LLAMA.items()}}


def source_gguf(model_path: str | None) -> Path:
    """The GGUF every peer is built from: `model_path` (a file, or a name of `default_model.WHEEL_MODELS`), or
    hetero's default model."""
    from hetero.default_model import WHEEL_MODELS, default_model_path, wheel_model_path

    if model_path in WHEEL_MODELS and not Path(model_path).exists():
        path = wheel_model_path(WHEEL_MODELS[model_path])
    else:
        path = Path(model_path) if model_path else default_model_path()
    if path.suffix != ".gguf" or not path.is_file():
        raise EngineUnavailable(f"the peers run a GGUF model file, got {str(path)!r}")
    return path


def check_installed(engine: str, gguf: Path | None = None) -> None:
    """EngineUnavailable naming what to install when `engine`'s runtime (or the tool that builds its model) is
    missing: checked before any model is built. The converter is needed only while `gguf`'s peer model is not
    cached (`peers.cached`; gguf None: assume it must be built)."""
    import importlib.util

    module = {"openvino_genai": "openvino_genai", "ort_genai": "onnxruntime_genai"}.get(engine, "llama_cpp")
    if importlib.util.find_spec(module) is None:
        dist = {"openvino_genai": "openvino-genai", "onnxruntime_genai": "onnxruntime-genai"}.get(module, "llama-cpp-python")
        raise EngineUnavailable(f"{dist} is not installed (pip install 'hetero[bench]')")
    if engine == "openvino_genai":
        from bench.peers import cached, optimum_cli

        if gguf is None or cached(gguf, MODEL_KIND[engine]) is None:
            optimum_cli()


def prepare(engine: str, model_path: str | None) -> Path:
    """Build (once, cached: `peers.build`) the model `engine` runs; its path."""
    from bench import peers

    gguf = source_gguf(model_path)
    check_installed(engine, gguf)
    kind = MODEL_KIND[engine]
    return gguf if kind is None else peers.build(gguf, kind)


def open_session(engine: str, model_path: str | None, threads: int, max_len: int) -> PeerSession:
    """A ready session of peer `engine` (its model built first if needed)."""
    path = prepare(engine, model_path)
    if engine in _LLAMA:
        return LlamaCppSession(path if path.suffix == ".gguf" else path / "model.gguf", threads, max_len,
                               _LLAMA[engine].flash_attn)
    if engine == "openvino_genai":
        return OpenVinoSession(path, threads, max_len)
    if engine == "ort_genai":
        return OrtGenAiSession(path, threads, max_len)
    raise ValueError(f"not a peer engine: {engine!r}")


class PeerProcess:
    """Peer `engine` in a process of its own (`python -m bench.peer_engines`), asked for decodes of given
    ids: the first request for a context length is preceded by an untimed warm-up of that length."""

    def __init__(self, engine: str, threads: int, max_len: int, model_path: str | None = None):
        import sys

        prepare(engine, model_path)  # built here, not in the timed process
        cmd = [sys.executable, "-m", "bench.peer_engines", engine, "--threads", str(threads),
               "--max-len", str(max_len)] + (["--model", model_path] if model_path else [])
        self.worker = WorkerProcess(engine, cmd, worker_env(threads, own=False))
        got = self.worker.ask()
        if "ready" not in got:
            self.worker.close()
            raise EngineUnavailable(got.get("unavailable") or got["failed"])

    def decode(self, ids: list[int], n_new: int) -> tuple[float, list[int]]:
        """(seconds of the n_new greedy tokens after the prefill of ids, the tokens)."""
        got = self.worker.ask({"ids": list(ids), "n_new": n_new})
        if "failed" in got:
            raise RuntimeError(f"{self.worker.engine}: {got['failed']}")
        return got["seconds"], got["tokens"]

    def close(self) -> None:
        self.worker.close()


def _serve(argv: list[str]) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(MODEL_KIND))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, required=True)
    ap.add_argument("--model")
    a = ap.parse_args(argv)
    reply = answer_pipe()
    try:
        session = open_session(a.engine, a.model, a.threads, a.max_len)
    except EngineUnavailable as e:
        reply({"unavailable": str(e)})
        return 3
    reply({"ready": True})
    warm: set[int] = set()
    for line in sys.stdin:
        req = json.loads(line)
        if len(req["ids"]) not in warm:
            session.decode(req["ids"], req["n_new"])
            warm.add(len(req["ids"]))
        seconds, tokens = session.decode(req["ids"], req["n_new"])
        reply({"seconds": seconds, "tokens": [int(t) for t in tokens]})
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_serve(sys.argv[1:]))
