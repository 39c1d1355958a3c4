"""The naive alternatives to chunk-sharing graphs (mllm-NPU §3.2, Fig. 7a/b), kept runnable for comparison.

(a) prompt graph: one graph set for the exact prompt length T, rebuilt for every new T (§2.3);
(b) chunk graphs: a graph set per chunk position, each with its own weights;
(c) hetero: the static subgraphs of chunk length C, one set shared by every chunk.
`naive_prefill` runs (a) end to end: build a T-row graph set in a fresh folder, then one unchunked forward.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero.chunking import token_ids
from hetero.loader import Model


@dataclass(frozen=True, slots=True)
class NaiveResult:
    logits: np.ndarray  # [vocab] float32 of the last token
    prepare_s: float  # export + compile of the T-row graph set (paid for every new T)
    run_s: float
    n_graphs: int
    size_bytes: int


def naive_prefill(model: Model, plan, ids: object, provider="cpu", intra_op_threads: int = 2) -> NaiveResult:
    """Prefill `ids` (`chunking.token_ids`) through a graph set built for exactly T = len(ids) rows (no cache: a
    new T is new work); the forward around the graphs (embedding, attention, head) is the float reference's."""
    import torch

    from hetero import model as ref
    from hetero.npu.graph_backend import GraphOptions, NpuBackend

    ids = torch.from_numpy(token_ids(ids, model.config.vocab))
    t = int(ids.numel())
    with tempfile.TemporaryDirectory(prefix="hetero-naive-") as tmp:  # built fresh, as without a graph cache
        t0 = time.perf_counter()
        be = NpuBackend(model, plan, t, provider=provider,
                        options=GraphOptions(intra_op_threads=intra_op_threads, use_cache=False, graphs_root=Path(tmp)))
        prepare_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        with torch.inference_mode():
            logits, _, _ = ref.forward(model.config, model.weights, ids, backend=be)
        run_s = time.perf_counter() - t1
        return NaiveResult(logits[-1].numpy(), prepare_s, run_s, len(be.report.rows), be.report.size_bytes)


@dataclass(frozen=True, slots=True)
class GraphCount:
    """Graphs and their memory for one strategy (weights dominate: activations are per chunk)."""

    strategy: str
    prompt_len: int
    chunk: int
    n_graphs: int
    weight_bytes: int  # INT8 weights held by all graphs together
    builds: int  # graph builds needed to serve this prompt length from a cold start
    note: str


def graph_counts(model: Model, prompt_len: int, chunk: int) -> list[GraphCount]:
    """Count graphs and their INT8 weight memory for (a) prompt graph, (b) chunk graphs, (c) chunk-sharing.

    Static graphs per layer: 2 (qkv, o_ffn; more only where a shadow cuts o_ffn, not counted here).
    Weight bytes per layer = Σ out·in of the seven linears (one byte each, INT8).
    """
    cfg = model.config
    per_layer = cfg.q_dim * cfg.hidden + 2 * cfg.kv_dim * cfg.hidden + cfg.hidden * cfg.q_dim + 3 * cfg.ffn * cfg.hidden
    w = per_layer * cfg.n_layers
    n_chunks = -(-prompt_len // chunk)
    static = 2 * cfg.n_layers
    return [
        GraphCount("prompt_graph", prompt_len, prompt_len, static, w, static,
                   "one graph set of T rows; rebuilt for every new prompt length"),
        GraphCount("chunk_graphs", prompt_len, chunk, static * n_chunks, w * n_chunks, static * n_chunks,
                   "one graph set per chunk position (attention shapes differ), each with its own weights"),
        GraphCount("chunk_sharing", prompt_len, chunk, static, w, static,
                   "hetero: static graphs of C rows shared by every chunk; attention dynamic on CPU"),
    ]
