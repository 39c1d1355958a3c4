"""The engines a benchmark compares: hetero's methods, transformers' float Llama, llama.cpp, the naive NPU path.

An engine is a factory `(model_path, threads, max_len) -> prefill(ids)`; hetero's own rows are methods
(`hetero.methods`). `ABLATION` lists mllm-NPU Fig. 17's steps as engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetero.methods import make_runtime, use_threads

PrefillFn = Callable[[torch.Tensor], None]
EngineFactory = Callable[[str | None, int, int], PrefillFn]


class EngineUnavailable(Exception):
    """The engine cannot run here (e.g. llama-cpp-python not installed): skipped with this message."""


def _method(method: str, **kw: Any) -> EngineFactory:
    def make(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
        from hetero.loader import load_model

        runtime = make_runtime(load_model(model_path), method, threads=threads, **kw)

        def prefill(ids: torch.Tensor) -> None:
            int(runtime.prefill(ids).logits.argmax())

        return prefill

    return make


def _torch_float(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """transformers' own Llama (sdpa attention), whole prompt in one forward, logits of the last token."""
    from hetero.adapters.hf import to_hf_model
    from hetero.loader import load_model

    use_threads(threads)
    hf = to_hf_model(load_model(model_path))

    @torch.inference_mode()
    def prefill(ids: torch.Tensor) -> None:
        int(hf(ids[None], logits_to_keep=1, use_cache=True).logits[0, -1].argmax())

    return prefill


def _llama_cpp(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """llama.cpp on the same GGUF file (llama-cpp-python), n_batch 512."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
    from hetero.default_model import default_model_path
    from hetero.loader import load_model

    path = str(load_model(model_path).path if model_path else default_model_path())
    if not path.endswith(".gguf"):
        raise EngineUnavailable("llama.cpp needs a GGUF model")
    llm = Llama(model_path=path, n_ctx=max_len + 8, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill(ids: torch.Tensor) -> None:
        llm.reset()
        llm.eval(ids.tolist())

    return prefill


def _naive_npu(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """mllm-NPU §2.3's naive offload: one INT8 graph set built for exactly this prompt length, every time
    (prompt lengths vary, so a real engine cannot reuse it); preparation is part of each prefill."""
    from hetero.loader import load_model
    from hetero.methods import quant_setup
    from hetero.npu.naive import naive_prefill

    model, plan = quant_setup(load_model(model_path), "cpu")  # the same model and plan as hetero's CPU-EP lane

    def prefill(ids: torch.Tensor) -> None:
        int(naive_prefill(model, plan, ids, provider="cpu", intra_op_threads=threads).logits.argmax())

    return prefill


ENGINES: dict[str, EngineFactory] = {
    "hetero": _method("hetero"),
    "hetero_in_order": _method("hetero-inorder"),
    "naive_npu": _naive_npu,
    "torch_float": _torch_float,
    "llama_cpp": _llama_cpp,
    "hetero_float": _method("float"),
    # ablation steps (mllm-NPU Fig. 17): naive_npu → chunk sharing → + shadow outliers → + out-of-order
    "chunk_sharing": _method("hetero-noshadow", policy="in_order"),
    "chunk_shadow": _method("hetero-inorder"),
}
ABLATION = (("naive NPU", "naive_npu"), ("+ chunk sharing", "chunk_sharing"),
            ("+ shadow outliers", "chunk_shadow"), ("+ out-of-order", "hetero"))


