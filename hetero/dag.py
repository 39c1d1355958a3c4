"""The prefill DAG G[i][j] (mllm-NPU §3.4, Eq. 2-3): chunk i, subgraph j of the chain of L layers × M kinds.

Node G[i][j] has id ``i * (L*M) + j``, so ids are program order (chunk-major). Edges: Eq. 3 within a
chunk, and from chunk i-1's node to chunk i's node of each kind that reads the K/V earlier chunks wrote (the
attention; docs/design.md, "Scheduler", says why this differs from Eq. 2 as printed). The kinds, and which of them
read K/V, are the backend's (`nodes.NodeKind`): this module names none. `prefill_dag` builds it straight into the
integer tuples the dispatch loop reads (`CompiledDag`), so no decision walks graph objects and a prefill imports no
graph library (networkx: 0.15 s of a start); `build_dag` is its networkx view (analysis, tests),
`compile_graph` flattens any such graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Sequence

from hetero.errors import ConfigError, ScheduleError

LANES = ("npu", "cpu", "gpu")  # scheduler lane ids; a lane runs one subgraph at a time (Eq. 4)
KV_SOURCES = ("reader", "eq2")  # the cross-chunk edges: see `prefill_dag`

if TYPE_CHECKING:
    import networkx as nx


def _layer_key(layer_subgraphs: Sequence[Sequence[str]]) -> tuple[tuple[str, str], ...]:
    key = tuple((str(k), str(lane)) for k, lane in layer_subgraphs)
    if not key:
        raise ConfigError("layer_subgraphs must list at least one (kind, lane), got none")
    for kind, lane in key:
        if lane not in LANES:
            raise ConfigError(f"lane of subgraph {kind!r} must be one of {LANES}, got {lane!r}")
    return key


def prefill_dag(n_chunks: int, layer_subgraphs: Sequence[Sequence[str]], n_layers: int, kv_source: str = "reader",
                chunk_len: int = 0, *, reads_kv: Collection[str]) -> CompiledDag:
    """The DAG of a prefill of `n_chunks` chunks (Eq. 2-3), flat (`CompiledDag`, costs 0); cached.

    Node id ``i * (n_layers * M) + j``. Every edge goes from a smaller id to a larger one, so it is acyclic and
    ids are a topological order. `reads_kv`: the kinds of `layer_subgraphs` that read the K/V of earlier chunks
    (`nodes.NodeKind.reads_kv`, as the backend defines them). kv_source "reader": such a node of chunk i-1 → the same
    node of chunk i (chunk i-1's K/V, and transitively every earlier chunk's); "eq2": Eq. 2 as printed
    (G[i2][j-1] → G[i][j] for every earlier chunk i2).
    """
    if n_chunks <= 0 or n_layers <= 0:
        raise ConfigError(f"n_chunks and n_layers must be > 0, got {n_chunks} and {n_layers}")
    if kv_source not in KV_SOURCES:
        raise ConfigError(f"kv_source must be one of {KV_SOURCES}, got {kv_source!r}")
    return _prefill_dag(n_chunks, _layer_key(layer_subgraphs), n_layers, kv_source, chunk_len, frozenset(reads_kv))


@functools.lru_cache(maxsize=64)
def _prefill_dag(n_chunks: int, layer: tuple[tuple[str, str], ...], n_layers: int, kv_source: str,
                 chunk_len: int, reads_kv: frozenset[str]) -> CompiledDag:
    m = len(layer)
    per_chunk = n_layers * m
    n = n_chunks * per_chunk
    preds: list[list[int]] = [[] for _ in range(n)]
    for i in range(n_chunks):
        base = i * per_chunk
        for j in range(per_chunk):
            v = base + j
            if j > 0:
                preds[v].append(v - 1)  # Eq. 3
            if i == 0 or layer[j % m][0] not in reads_kv:
                continue
            if kv_source == "reader":
                preds[v].append(v - per_chunk)  # K/V of chunk i-1 (and, transitively, 0..i-2)
            elif j > 0:
                preds[v].extend(i2 * per_chunk + j - 1 for i2 in range(i))  # Eq. 2 as printed
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        preds[v] = sorted(set(preds[v]))
        for u in preds[v]:
            succs[u].append(v)  # v ascending: each list comes out sorted
    lanes = tuple(ln for ln in LANES if any(lane == ln for _, lane in layer))
    kinds = tuple(dict.fromkeys(kind for kind, _ in layer))
    succ_ptr, succ_idx, pred_ptr, pred_idx = [0], [], [0], []
    for v in range(n):
        succ_idx.extend(succs[v])
        succ_ptr.append(len(succ_idx))
        pred_idx.extend(preds[v])
        pred_ptr.append(len(pred_idx))
    return CompiledDag(
        n_chunks=n_chunks, n_layers=n_layers, layer_subgraphs=layer, chunk_len=chunk_len, lanes=lanes, kinds=kinds,
        lane=tuple(lanes.index(layer[v % per_chunk % m][1]) for v in range(n)),
        kind=tuple(kinds.index(layer[v % per_chunk % m][0]) for v in range(n)),
        chunk=tuple(v // per_chunk for v in range(n)), j=tuple(v % per_chunk for v in range(n)),
        cost_us=(0.0,) * n, succ_ptr=tuple(succ_ptr), succ_idx=tuple(succ_idx), pred_ptr=tuple(pred_ptr),
        pred_idx=tuple(pred_idx), indeg=tuple(len(p) for p in preds))


def build_dag(n_chunks: int, layer_subgraphs: Sequence[Sequence[str]], n_layers: int,
              kv_source: str = "reader", *, reads_kv: Collection[str]) -> "nx.DiGraph":
    """`prefill_dag` as a networkx graph, validated acyclic; cached, do not mutate.

    Node attributes ``chunk``, ``j``, ``layer``, ``kind``, ``lane``; graph attributes ``n_chunks``, ``n_layers``,
    ``layer_subgraphs``, ``kv_source``.
    """
    return _build_dag(prefill_dag(n_chunks, layer_subgraphs, n_layers, kv_source, reads_kv=reads_kv), kv_source)


@functools.lru_cache(maxsize=64)
def _build_dag(dag: CompiledDag, kv_source: str) -> "nx.DiGraph":
    import networkx as nx

    m = len(dag.layer_subgraphs)
    g = nx.DiGraph(n_chunks=dag.n_chunks, n_layers=dag.n_layers, layer_subgraphs=dag.layer_subgraphs,
                   kv_source=kv_source)
    for v in range(dag.n_nodes):
        g.add_node(v, chunk=dag.chunk[v], j=dag.j[v], layer=dag.j[v] // m, kind=dag.kinds[dag.kind[v]],
                   lane=dag.lanes[dag.lane[v]])
    g.add_edges_from((u, v) for u in range(dag.n_nodes) for v in dag.successors(u))
    validate_dag(g)
    return g


def validate_dag(g: "nx.DiGraph") -> None:
    """Raise ScheduleError if `g` has a cycle (a schedule would deadlock) or a node lacks lane/kind."""
    import networkx as nx

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


def compile_graph(graph: "nx.DiGraph", chunk_len: int, costs: Sequence[float] | None = None,
                  profile_name: str = "") -> CompiledDag:
    """Flatten `graph` (from `build_dag`) into a CompiledDag; `costs` per node in µs (default 0)."""
    n = graph.number_of_nodes()
    if sorted(graph.nodes) != list(range(n)):
        raise ScheduleError("DAG node ids must be 0..n-1 (build it with build_dag)")
    attrs = graph.nodes
    lanes = tuple(ln for ln in LANES if any(attrs[v]["lane"] == ln for v in range(n)))
    kinds = tuple(dict.fromkeys(attrs[v]["kind"] for v in range(n)))
    if costs is None:
        costs = [0.0] * n
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
        profile_name=profile_name,
    )
