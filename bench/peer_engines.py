"""The runtimes a user would pick instead of hetero, as the benchmarks run them (issue 24): OpenVINO GenAI,
ONNX Runtime GenAI and llama.cpp, each on a model built from hetero's own GGUF (`bench.peers`), fed the same
token ids as hetero, greedy, on `threads` threads.

A session runs a prompt's prefill (the time to the first token, `prefill`) or a prefill and then `n_new`
greedy tokens with no stop on end of turn (`decode`, timing the tokens after the prefill). `open_logits` gives
every position's logits of a window through the peer's own API (`bench.peer_accuracy`: perplexity and top-1
agreement with float, beside the speed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from bench.workers import EngineUnavailable, WorkerProcess, answer_pipe, worker_env
from hetero.errors import ConfigError

# The peers: the runtimes a user would pick instead, each at its fastest configurations on CPU (issue 24).
# `llama_cpp` runs the GGUF as shipped; the others run models their own tools built from it (`bench.peers`).
PEERS = ("openvino_genai", "openvino_genai_int4", "ort_genai", "llama_cpp", "llama_cpp_q4_0", "llama_cpp_q4_0_fa",
         "llama_cpp_q8_0", "llama_cpp_q8_0_fa")


LogitsFn = Callable[[list[int]], np.ndarray]  # ids -> [len(ids), vocab] float32 logits, from an empty cache


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

    def __init__(self, gguf: Path, threads: int, max_len: int, flash_attn: bool, logits_all: bool = False):
        try:
            import llama_cpp
        except ImportError:
            raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
        # logits_all: every position's logits kept (`logits`), which costs the head on every row: never when timed
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max_len + 256, n_batch=min(2048, max_len + 256),
                                   n_ubatch=512, n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                                   logits_all=logits_all, verbose=False)
        self.logits_all = logits_all

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

    def logits(self, ids: list[int]) -> np.ndarray:
        """Every position's logits of `ids` from an empty cache (`Llama.scores`; a session made with logits_all)."""
        if not self.logits_all:
            raise ConfigError("llama.cpp keeps every position's logits only in a session made with logits_all=True")
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)


class OpenVinoSession:
    """OpenVINO GenAI's LLMPipeline on the CPU: INT8 or INT4 weights (optimum-intel's exports),
    INFERENCE_NUM_THREADS = threads, prefix caching off (each prompt computed whole), greedy."""

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


def openvino_logits(folder: Path, threads: int) -> LogitsFn:
    """Every position's logits of the exported IR (`openvino_model.xml`, stateful: its KV cache is a state, reset
    per window) compiled by `openvino.Core` on the CPU with GenAI's hint (INFERENCE_NUM_THREADS) and the plugin's
    default precision, as the pipeline runs it: LLMPipeline itself returns tokens, never logits."""
    try:
        import openvino as ov
    except ImportError:
        raise EngineUnavailable("openvino is not installed (pip install 'hetero[bench]')") from None
    core = ov.Core()
    model = core.read_model(str(folder / "openvino_model.xml"))
    names = {i.get_any_name() for i in model.inputs}
    need = {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    if not need <= names:
        raise ConfigError(f"{folder}: the OpenVINO IR has inputs {sorted(names)}, not the stateful "
                          f"text-generation-with-past export's {sorted(need)}")
    request = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads}).create_infer_request()

    def logits(ids: list[int]) -> np.ndarray:
        n = len(ids)
        request.reset_state()
        request.infer({"input_ids": np.asarray([ids], dtype=np.int64), "attention_mask": np.ones((1, n), np.int64),
                       "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)})
        out = request.get_tensor("logits").data
        if out.shape[1] != n:
            raise ConfigError(f"{folder}: the OpenVINO IR returns logits of {out.shape[1]} positions, not all {n}")
        return np.array(out[0], dtype=np.float32)

    return logits


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

    def logits(self, ids: list[int]) -> np.ndarray:
        """Every position's logits of `ids` from an empty cache: the model's own `logits` output of the prompt's
        step (`get_logits` keeps only the last position's)."""
        out = np.asarray(self._generator(ids, 1).get_output("logits"))
        if out.ndim != 3 or out.shape[1] != len(ids):
            raise ConfigError(f"ONNX Runtime GenAI's logits output has shape {out.shape}, not [1, {len(ids)}, vocab]")
        return out[0].astype(np.float32)

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
_OPENVINO = {"openvino_genai": "openvino-int8", "openvino_genai_int4": "openvino-int4"}
MODEL_KIND: dict[str, str | None] = {**_OPENVINO, "ort_genai": "ort-genai-int4",
                                     **{name: c.kind for name, c in _LLAMA.items()}}
LABELS: dict[str, str] = {"openvino_genai": "OpenVINO GenAI, INT8 weights (optimum-intel export)",
                          "openvino_genai_int4": "OpenVINO GenAI, INT4 weights (optimum-intel export: every "
                                                 "linear 4-bit symmetric in groups of 64, the embedding 8-bit)",
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

    module = "openvino_genai" if engine in _OPENVINO else {"ort_genai": "onnxruntime_genai"}.get(engine, "llama_cpp")
    if importlib.util.find_spec(module) is None:
        dist = {"openvino_genai": "openvino-genai", "onnxruntime_genai": "onnxruntime-genai"}.get(module, "llama-cpp-python")
        raise EngineUnavailable(f"{dist} is not installed (pip install 'hetero[bench]')")
    if engine in _OPENVINO:
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
    if engine in _OPENVINO:
        return OpenVinoSession(path, threads, max_len)
    if engine == "ort_genai":
        return OrtGenAiSession(path, threads, max_len)
    raise ValueError(f"not a peer engine: {engine!r}")


def open_logits(engine: str, model_path: str | None, threads: int, max_len: int) -> LogitsFn:
    """Every position's logits of a window through peer `engine`'s own API (its model built first if needed):
    llama.cpp with logits_all, the OpenVINO IR through `openvino.Core`, ONNX Runtime GenAI's logits output."""
    path = prepare(engine, model_path)
    if engine in _LLAMA:
        return LlamaCppSession(path if path.suffix == ".gguf" else path / "model.gguf", threads, max_len,
                               _LLAMA[engine].flash_attn, logits_all=True).logits
    if engine in _OPENVINO:
        return openvino_logits(path, threads)
    if engine == "ort_genai":
        return OrtGenAiSession(path, threads, max_len).logits
    raise ValueError(f"not a peer engine: {engine!r}")


def window_score(logits: np.ndarray, ids: list[int]) -> tuple[float, list[int]]:
    """(the summed negative log-likelihood of ids[1:] under logits[:-1], in float64; each position's argmax):
    what perplexity and top-1 agreement are made of, the same for every engine."""
    lg = np.asarray(logits, dtype=np.float64)
    if lg.ndim != 2 or lg.shape[0] != len(ids):
        raise ConfigError(f"logits of shape {lg.shape} for a window of {len(ids)} ids")
    head = lg[:-1]
    top = head.max(-1)
    lse = top + np.log(np.exp(head - top[:, None]).sum(-1))
    nll = float((lse - head[np.arange(len(ids) - 1), ids[1:]]).sum())
    return nll, [int(i) for i in lg.argmax(-1)]


class PeerProcess:
    """Peer `engine` in a process of its own (`python -m bench.peer_engines`), asked for decodes of given
    ids: the first request for a context length is preceded by an untimed warm-up of that length. With
    `logits`, asked for windows' scores instead (`score`), never timed."""

    def __init__(self, engine: str, threads: int, max_len: int, model_path: str | None = None, logits: bool = False):
        import sys

        prepare(engine, model_path)  # built here, not in the timed process
        cmd = [sys.executable, "-m", "bench.peer_engines", engine, "--threads", str(threads), "--max-len", str(max_len),
               *(["--model", model_path] if model_path else []), *(["--logits"] if logits else [])]
        self.logits = logits
        self.worker = WorkerProcess(engine, cmd, worker_env(threads, own=False))
        got = self.worker.ask()
        if "ready" not in got:
            self.worker.close()
            raise EngineUnavailable(got.get("unavailable") or got["failed"])

    def decode(self, ids: list[int], n_new: int) -> tuple[float, list[int]]:
        """(seconds of the n_new greedy tokens after the prefill of ids, the tokens)."""
        if self.logits:
            raise ConfigError(f"{self.worker.engine}'s process was started for logits, not decodes")
        got = self.worker.ask({"ids": list(ids), "n_new": n_new})
        if "failed" in got:
            raise RuntimeError(f"{self.worker.engine}: {got['failed']}")
        return got["seconds"], got["tokens"]

    def score(self, ids: list[int]) -> tuple[float, list[int]]:
        """`window_score` of the peer's logits of ids: (summed next-token NLL, each position's argmax)."""
        if not self.logits:
            raise ConfigError(f"{self.worker.engine}'s process was started for decodes, not logits")
        got = self.worker.ask({"ids": list(ids)})
        if "failed" in got:
            raise RuntimeError(f"{self.worker.engine}: {got['failed']}")
        return got["nll"], got["top1"]

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
    ap.add_argument("--logits", action="store_true",
                    help="answer {ids} with the window's {nll, top1} (`open_logits`, `window_score`), not decodes")
    a = ap.parse_args(argv)
    reply = answer_pipe()
    try:
        if a.logits:
            logits = open_logits(a.engine, a.model, a.threads, a.max_len)
        else:
            session = open_session(a.engine, a.model, a.threads, a.max_len)
    except EngineUnavailable as e:
        reply({"unavailable": str(e)})
        return 3
    reply({"ready": True})
    if a.logits:
        for line in sys.stdin:
            ids = json.loads(line)["ids"]
            nll, top1 = window_score(logits(ids), ids)
            reply({"nll": nll, "top1": top1})
        return 0
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
