"""The engines a benchmark compares: hetero's methods, transformers' float Llama, the naive NPU path, and the
peers a user would pick instead (OpenVINO GenAI, ONNX Runtime GenAI, llama.cpp: `bench.peer_engines`).

An engine is a factory `(model_path, threads, max_len) -> prefill(ids)`; hetero's own rows are methods
(`hetero.methods`). `ABLATION` lists mllm-NPU Fig. 17's steps as engines. Token ids come as a 1-D int64 numpy
array (`corpus.prompt_ids`); only the transformers engine imports torch (a hetero worker never does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bench.peer_engines import PEERS, open_session
from bench.peer_engines import prepare as prepare_peer
from hetero.methods import make_runtime, use_threads

PrefillFn = Callable[[np.ndarray], None]
EngineFactory = Callable[[str | None, int, int], PrefillFn]


def _method(method: str, **kw: Any) -> EngineFactory:
    def make(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
        from hetero.loader import load_model

        runtime = make_runtime(load_model(model_path), method, threads=threads, **kw)

        def prefill(ids: np.ndarray) -> None:
            int(runtime.prefill(ids).logits.argmax())

        return prefill

    return make


def _torch_float(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """transformers' own Llama (sdpa attention), whole prompt in one forward, logits of the last token."""
    import torch

    from hetero.adapters.hf import to_hf_model
    from hetero.loader import load_model

    use_threads(threads)
    hf = to_hf_model(load_model(model_path))

    @torch.inference_mode()
    def prefill(ids: np.ndarray) -> None:
        int(hf(torch.from_numpy(ids)[None], logits_to_keep=1, use_cache=True).logits[0, -1].argmax())

    return prefill


def _peer(engine: str) -> EngineFactory:
    """A peer runtime (`bench.peer_engines`) on its model built from the same GGUF; prefill = time to first token."""
    def make(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
        session = open_session(engine, model_path, threads, max_len)

        def prefill(ids: np.ndarray) -> None:
            session.prefill(ids.tolist())

        return prefill

    return make


def prepare(engine: str, model_path: str | None) -> None:
    """Build what `engine` needs before it is timed (a peer's model; nothing for hetero's own engines)."""
    if engine in PEERS:
        prepare_peer(engine, model_path)


def _naive_npu(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """mllm-NPU §2.3's naive offload: one INT8 graph set built for exactly this prompt length, every time
    (prompt lengths vary, so a real engine cannot reuse it); preparation is part of each prefill."""
    from hetero.loader import load_model
    from hetero.methods import quant_setup
    from hetero.npu.naive import naive_prefill

    model, plan = quant_setup(load_model(model_path), "cpu")  # the same model and plan as hetero's CPU-EP lane

    def prefill(ids: np.ndarray) -> None:
        int(naive_prefill(model, plan, ids, provider="cpu", intra_op_threads=threads).logits.argmax())

    return prefill


ENGINES: dict[str, EngineFactory] = {
    "hetero": _method("hetero"),
    "hetero_gqa": _method("hetero-gqa"),  # the same layout with ONNX Runtime's fp32 GroupQueryAttention
    "hetero_in_order": _method("hetero-inorder"),
    "hetero_lanes": _method("hetero-lanes"),  # §3.4's two lanes out of order, whatever this host's placement picks
    "naive_npu": _naive_npu,
    "torch_float": _torch_float,
    **{name: _peer(name) for name in PEERS},
    "hetero_float": _method("float"),
    # ablation steps (mllm-NPU Fig. 17): naive_npu → chunk sharing → + shadow outliers → + out-of-order
    "chunk_sharing": _method("hetero-noshadow", policy="in_order"),
    "chunk_shadow": _method("hetero-inorder"),
}
ABLATION = (("naive NPU", "naive_npu"), ("+ chunk sharing", "chunk_sharing"),
            ("+ shadow outliers", "chunk_shadow"), ("+ out-of-order", "hetero_lanes"))


