"""The prefill DAG G[i][j]: chunk i, subgraph j (mllm-NPU §3.4, Eq. 2-3).

A prompt of N chunks runs each chunk through L decoder layers of M subgraphs, a chain of L*M
subgraphs with a flat index j = layer*M + m. Node G[i][j] has id ``i * (L*M) + j``.

    chunk 0:  qkv0 ─► attn0 ─► o_ffn0 ─► qkv1 ─► attn1 ─► ...        (Eq. 3, intra-chunk)
                        │                         │
                        ▼                         ▼
    chunk 1:  qkv0 ─► attn0 ─► o_ffn0 ─► qkv1 ─► attn1 ─► ...        (cross-chunk, K/V)

Cross-chunk edges, and how they differ from Eq. 2 as printed. Eq. 2 reads
G[i][j] ← G[0][j-1], ..., G[i][j-1]: attention of chunk i waits for the QKV subgraphs of chunks 0..i,
because in mllm the K/V come out of QKV. In hetero the `attn` subgraph applies RoPE and *writes* its
chunk's K/V into the cache, then attends over the K/V of chunks 0..i. So the K/V of chunk i' < i exist
only once G[i'][j_attn] has run, and the correct edge is G[i'][j_attn] → G[i][j_attn] for every
i' < i. We add only the i' = i-1 edge: the chain of attn nodes of a layer implies the rest
transitively, and keeps the edge count O(N·L) instead of O(N²·L). `kv_source="qkv"` builds the literal
Eq. 2 edges instead, for an implementation whose QKV subgraph writes the cache; it is less constrained
(attn of chunk i may run before attn of chunk i-1) and is offered for simulation only.

networkx builds and validates the graph once per (N, layer, L) (cached); `compile_dag` flattens it,
with costs from a `Profile`, into the integer arrays the dispatch loop reads (CSR successor and
predecessor lists, in-degrees, lanes, costs), so that no decision walks networkx objects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import networkx as nx

from hetero.errors import ConfigError, ScheduleError
from hetero.sched.profile import LANES, Profile

CROSS_CHUNK_KINDS = ("attn",)  # kinds that read the K/V of earlier chunks of their layer


def _layer_key(layer_subgraphs: Sequence[Sequence[str]]) -> tuple[tuple[str, str], ...]:
    key = tuple((str(k), str(lane)) for k, lane in layer_subgraphs)
    if not key:
        raise ConfigError("layer_subgraphs must list at least one (kind, lane), got none")
    for kind, lane in key:
        if lane not in LANES:
            raise ConfigError(f"lane of subgraph {kind!r} must be one of {LANES}, got {lane!r}")
    return key


def build_dag(n_chunks: int, layer_subgraphs: Sequence[Sequence[str]], n_layers: int,
              kv_source: str = "attn") -> nx.DiGraph:
    """The DAG of a prefill of `n_chunks` chunks (Eq. 2-3), validated acyclic; cached, do not mutate.

    Node id ``i * (n_layers * M) + j``; attributes ``chunk``, ``j``, ``layer``, ``kind``, ``lane``.
    """
    if n_chunks <= 0 or n_layers <= 0:
        raise ConfigError(f"n_chunks and n_layers must be > 0, got {n_chunks} and {n_layers}")
    if kv_source not in ("attn", "qkv"):
        raise ConfigError(f"kv_source must be 'attn' or 'qkv', got {kv_source!r}")
    return _build_dag(n_chunks, _layer_key(layer_subgraphs), n_layers, kv_source)


@functools.lru_cache(maxsize=64)
def _build_dag(n_chunks: int, layer: tuple[tuple[str, str], ...], n_layers: int, kv_source: str) -> nx.DiGraph:
    m = len(layer)
    per_chunk = n_layers * m
    g = nx.DiGraph(n_chunks=n_chunks, n_layers=n_layers, layer_subgraphs=layer, kv_source=kv_source)
    for i in range(n_chunks):
        for j in range(per_chunk):
            kind, lane = layer[j % m]
            g.add_node(i * per_chunk + j, chunk=i, j=j, layer=j // m, kind=kind, lane=lane)
    for i in range(n_chunks):
        base = i * per_chunk
        for j in range(1, per_chunk):
            g.add_edge(base + j - 1, base + j)  # Eq. 3
        if i == 0:
            continue
        for j in range(per_chunk):
            if layer[j % m][0] not in CROSS_CHUNK_KINDS:
                continue
            if kv_source == "attn":
                g.add_edge(base - per_chunk + j, base + j)  # K/V of chunk i-1 (and, transitively, 0..i-2)
            elif j > 0:
                for i2 in range(i):  # Eq. 2 as printed
                    g.add_edge(i2 * per_chunk + j - 1, base + j)
    validate_dag(g)
    return g


def validate_dag(g: nx.DiGraph) -> None:
    """Raise ScheduleError if `g` has a cycle (a schedule would deadlock) or a node lacks lane/kind."""
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise ScheduleError(f"prefill DAG has a cycle (a schedule would deadlock): {cycle[:6]}")
    for n, attrs in g.nodes(data=True):
        if "lane" not in attrs or "kind" not in attrs:
            raise ScheduleError(f"DAG node {n} lacks a 'lane' or 'kind' attribute: {attrs}")


@dataclass(frozen=True, slots=True)
class CompiledDag:
    """A DAG flattened for the hot loop: per-node arrays indexed by node id (0..n-1).

    Invariants: ``succ_idx[succ_ptr[v]:succ_ptr[v+1]]`` are v's successors, likewise preds;
    ``indeg[v] == pred_ptr[v+1] - pred_ptr[v]``; ``lanes[lane[v]]`` is the lane name of v;
    node ids are in program order (chunk-major), i.e. ``v == chunk[v] * per_chunk + j[v]``.
    Tuples, not numpy arrays: indexing a tuple from Python is ~3× cheaper than a numpy scalar.
    """

    n_chunks: int
    n_layers: int
    layer_subgraphs: tuple[tuple[str, str], ...]
    chunk_len: int  # C
    lanes: tuple[str, ...]  # lane names; lane index -> name
    kinds: tuple[str, ...]  # kind index -> name
    lane: tuple[int, ...]  # node -> lane index
    kind: tuple[int, ...]  # node -> kind index
    chunk: tuple[int, ...]  # node -> i
    j: tuple[int, ...]  # node -> j (flat subgraph index in the chunk)
    cost_us: tuple[float, ...]  # node -> profiled latency
    succ_ptr: tuple[int, ...]
    succ_idx: tuple[int, ...]
    pred_ptr: tuple[int, ...]
    pred_idx: tuple[int, ...]
    indeg: tuple[int, ...]
    profile_name: str = ""

    @property
    def n_nodes(self) -> int:
        return len(self.lane)

    @property
    def per_chunk(self) -> int:
        return self.n_layers * len(self.layer_subgraphs)

    def node_id(self, chunk: int, j: int) -> int:
        return chunk * self.per_chunk + j

    def node_info(self, node: int) -> tuple[int, int, str]:
        """(chunk i, decoder layer, kind) of a node: what the runtime executes for it."""
        return self.chunk[node], self.j[node] // len(self.layer_subgraphs), self.kinds[self.kind[node]]

    def lane_of(self, node: int) -> str:
        return self.lanes[self.lane[node]]

    def successors(self, node: int) -> tuple[int, ...]:
        return self.succ_idx[self.succ_ptr[node]:self.succ_ptr[node + 1]]

    def predecessors(self, node: int) -> tuple[int, ...]:
        return self.pred_idx[self.pred_ptr[node]:self.pred_ptr[node + 1]]

    def work_us(self) -> dict[str, float]:
        """Total profiled work per lane."""
        work = dict.fromkeys(self.lanes, 0.0)
        for v, c in enumerate(self.cost_us):
            work[self.lanes[self.lane[v]]] += c
        return work

    def heads_us(self) -> list[float]:
        """Earliest possible start of each node: longest cost-weighted path into it (ids are topological)."""
        head = [0.0] * self.n_nodes
        for v in range(self.n_nodes):
            head[v] = max((head[p] + self.cost_us[p] for p in self.predecessors(v)), default=0.0)
        return head

    def upward_rank_us(self) -> list[float]:
        """rank(v) = T(v) + max over successors of rank: the longest path from v to the end, v included."""
        rank = [0.0] * self.n_nodes
        for v in range(self.n_nodes - 1, -1, -1):
            rank[v] = self.cost_us[v] + max((rank[s] for s in self.successors(v)), default=0.0)
        return rank

    def critical_path_us(self) -> float:
        """Longest cost-weighted path through the DAG."""
        return max(self.upward_rank_us(), default=0.0)

    def lower_bound_us(self) -> float:
        """No schedule can finish earlier (Eq. 2-4). At least max(each lane's work, critical path), and
        tighter: a lane cannot start before its earliest node can (head) and has work left after its
        last node that it cannot overlap (tail), so LB_lane = min head + work + min tail over its nodes.
        """
        head, rank = self.heads_us(), self.upward_rank_us()
        lb = max(rank, default=0.0)
        for li in range(len(self.lanes)):
            nodes = [v for v in range(self.n_nodes) if self.lane[v] == li]
            if nodes:
                work = sum(self.cost_us[v] for v in nodes)
                lb = max(lb, min(head[v] for v in nodes) + work + min(rank[v] - self.cost_us[v] for v in nodes))
        return lb


def compile_dag(graph: nx.DiGraph, profile: Profile | None, chunk_len: int,
                costs: Sequence[float] | None = None) -> CompiledDag:
    """Flatten `graph` into a CompiledDag with costs from `profile` (or explicit per-node `costs`).

    The cost of attn G[i][j] is taken at kv_len = (i+1)*C (it attends over chunks 0..i, §3.2).
    """
    n = graph.number_of_nodes()
    if sorted(graph.nodes) != list(range(n)):
        raise ScheduleError("DAG node ids must be 0..n-1 (build it with build_dag)")
    attrs = graph.nodes
    lanes = tuple(ln for ln in LANES if any(attrs[v]["lane"] == ln for v in range(n)))
    kinds = tuple(dict.fromkeys(attrs[v]["kind"] for v in range(n)))
    if costs is None:
        if profile is None:
            raise ConfigError("compile_dag needs a profile or explicit costs, got neither")
        costs = [profile.cost_us(attrs[v]["kind"], attrs[v]["lane"], chunk_len, (attrs[v]["chunk"] + 1) * chunk_len)
                 for v in range(n)]
    elif len(costs) != n:
        raise ConfigError(f"costs must have one entry per node ({n}), got {len(costs)}")
    succ_ptr, succ_idx, pred_ptr, pred_idx = [0], [], [0], []
    for v in range(n):
        succ_idx.extend(sorted(graph.successors(v)))
        succ_ptr.append(len(succ_idx))
        pred_idx.extend(sorted(graph.predecessors(v)))
        pred_ptr.append(len(pred_idx))
        if any(p >= v for p in graph.predecessors(v)):
            raise ScheduleError(f"node {v} has a predecessor with a larger id: ids must be a topological order")
    return CompiledDag(
        n_chunks=graph.graph.get("n_chunks", 1), n_layers=graph.graph.get("n_layers", 1),
        layer_subgraphs=tuple(graph.graph.get("layer_subgraphs", ())), chunk_len=chunk_len,
        lanes=lanes, kinds=kinds,
        lane=tuple(lanes.index(attrs[v]["lane"]) for v in range(n)),
        kind=tuple(kinds.index(attrs[v]["kind"]) for v in range(n)),
        chunk=tuple(attrs[v].get("chunk", 0) for v in range(n)),
        j=tuple(attrs[v].get("j", v) for v in range(n)),
        cost_us=tuple(float(c) for c in costs),
        succ_ptr=tuple(succ_ptr), succ_idx=tuple(succ_idx), pred_ptr=tuple(pred_ptr), pred_idx=tuple(pred_idx),
        indeg=tuple(pred_ptr[v + 1] - pred_ptr[v] for v in range(n)),
        profile_name=profile.name if profile is not None else "",
    )


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
