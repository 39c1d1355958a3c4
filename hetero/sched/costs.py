"""Costs on the prefill DAG: `compile_dag` takes each node's latency from a `Profile` (mllm-NPU §3.4).

The DAG itself (Eq. 2-3) and its flat form `CompiledDag` are core (`hetero.dag`), because every prefill
runs one; this module adds what only the scheduler needs: profiled costs.
"""

from __future__ import annotations

import functools
from typing import Sequence

import networkx as nx

from hetero.dag import CompiledDag, build_dag, compile_graph, validate_dag
from hetero.errors import ConfigError
from hetero.sched.profile import Profile

__all__ = ["CompiledDag", "build_dag", "compile_dag", "compiled_prefill_dag", "validate_dag"]


def compile_dag(graph: nx.DiGraph, profile: Profile | None, chunk_len: int,
                costs: Sequence[float] | None = None) -> CompiledDag:
    """Flatten `graph` into a CompiledDag with costs from `profile` (or explicit per-node `costs`).

    The cost of attn G[i][j] is taken at kv_len = (i+1)*C (it attends over chunks 0..i, §3.2).
    """
    if costs is None:
        if profile is None:
            raise ConfigError("compile_dag needs a profile or explicit costs, got neither")
        attrs = graph.nodes
        costs = [profile.cost_us(attrs[v]["kind"], attrs[v]["lane"], chunk_len, (attrs[v]["chunk"] + 1) * chunk_len)
                 for v in sorted(graph.nodes)]
    return compile_graph(graph, chunk_len, costs, profile.name if profile is not None else "")


@functools.lru_cache(maxsize=64)
def compiled_prefill_dag(profile: Profile, n_tokens: int, chunk_len: int,
                         layer_subgraphs: tuple[tuple[str, str], ...] | None = None,
                         n_layers: int | None = None) -> CompiledDag:
    """The compiled DAG of a prompt of `n_tokens` (ceil(n/C) chunks), cached per arguments.

    Defaults to the profile's placement and layer count. This is what Runtime and the bench call.
    """
    if n_tokens <= 0 or chunk_len <= 0:
        raise ConfigError(f"n_tokens and chunk_len must be > 0, got {n_tokens} and {chunk_len}")
    n_chunks = -(-n_tokens // chunk_len)
    layer = layer_subgraphs or profile.layer_subgraphs
    graph = build_dag(n_chunks, layer, n_layers or profile.n_layers)
    return compile_dag(graph, profile, chunk_len)
