"""Costs on the prefill DAG: `compile_dag` takes each node's latency from a `Profile` (mllm-NPU §3.4).

The DAG itself (Eq. 2-3) and its flat form `CompiledDag` are core (`hetero.dag`), because every prefill
runs one; this module adds what only the scheduler needs: profiled costs. A profile costs the generic layer's kinds
and the shadow correction (`profile.NODE_KINDS`): the DAGs built here take which kinds read K/V from there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

from hetero import dag
from hetero.dag import CompiledDag, compile_graph, prefill_dag, validate_dag
from hetero.errors import ConfigError
from hetero.nodes import reads_kv
from hetero.sched.profile import NODE_KINDS, Profile

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["CompiledDag", "build_dag", "compile_dag", "compiled_prefill_dag", "prefill_dag", "validate_dag",
           "with_costs"]


def build_dag(n_chunks: int, layer_subgraphs: Sequence[Sequence[str]], n_layers: int,
              kv_source: str = "reader") -> "nx.DiGraph":
    """`dag.build_dag` of a placement of the kinds profiles cost (`profile.NODE_KINDS`)."""
    return dag.build_dag(n_chunks, layer_subgraphs, n_layers, kv_source,
                         reads_kv=reads_kv(layer_subgraphs, NODE_KINDS))


def with_costs(dag: CompiledDag, profile: Profile, chunk_len: int) -> CompiledDag:
    """`dag` with each node's latency from `profile` at chunk length `chunk_len`.

    The cost of attn G[i][j] is taken at kv_len = (i+1)*C (it attends over chunks 0..i, §3.2).
    """
    costs = tuple(float(profile.cost_us(dag.kinds[dag.kind[v]], dag.lanes[dag.lane[v]], chunk_len,
                                        (dag.chunk[v] + 1) * chunk_len)) for v in range(dag.n_nodes))
    return dataclasses.replace(dag, chunk_len=chunk_len, cost_us=costs, profile_name=profile.name)


def compile_dag(graph: "nx.DiGraph", profile: Profile | None, chunk_len: int,
                costs: Sequence[float] | None = None) -> CompiledDag:
    """Flatten `graph` into a CompiledDag with costs from `profile` (`with_costs`) or explicit per-node `costs`."""
    if costs is not None:
        return compile_graph(graph, chunk_len, costs, profile.name if profile is not None else "")
    if profile is None:
        raise ConfigError("compile_dag needs a profile or explicit costs, got neither")
    return with_costs(compile_graph(graph, chunk_len), profile, chunk_len)


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
    flat = prefill_dag(n_chunks, layer, n_layers or profile.n_layers, reads_kv=reads_kv(layer, NODE_KINDS))
    return with_costs(flat, profile, chunk_len)
