import networkx as nx
import pytest

from hetero.errors import ConfigError, ScheduleError
from hetero.sched.costs import build_dag, compile_dag, validate_dag


def test_edges_follow_eq3_and_kv_dependency(layer):
    g = build_dag(3, layer, 2)
    per_chunk = 6
    assert g.number_of_nodes() == 18
    for i in range(3):
        for j in range(1, per_chunk):  # Eq. 3: G[i][j] <- G[i][j-1]
            assert g.has_edge(i * per_chunk + j - 1, i * per_chunk + j)
    # attn of chunk i waits for attn (the K/V writer) of chunk i-1, same layer; nothing else crosses chunks
    cross = {(u, v) for u, v in g.edges if g.nodes[u]["chunk"] != g.nodes[v]["chunk"]}
    assert cross == {(1, 7), (4, 10), (7, 13), (10, 16)}
    for u, v in cross:
        assert g.nodes[u]["kind"] == g.nodes[v]["kind"] == "attn" and g.nodes[u]["layer"] == g.nodes[v]["layer"]
    # transitively, attn of chunk 2 waits for the K/V of chunks 0 and 1 (Eq. 2's "0..i-1")
    assert nx.has_path(g, 1, 13) and nx.has_path(g, 7, 13)


def test_literal_eq2_edges(layer):
    g = build_dag(3, layer, 1, kv_source="eq2")
    # Eq. 2: G[2][attn] <- G[0][qkv], G[1][qkv], G[2][qkv]
    assert {u for u in g.predecessors(7)} == {0, 3, 6}


def test_build_is_cached_and_validated(layer):
    assert build_dag(4, layer, 2) is build_dag(4, [list(x) for x in layer], 2)
    with pytest.raises(ConfigError):
        build_dag(0, layer, 2)
    with pytest.raises(ConfigError):
        build_dag(2, (("qkv", "tpu"),), 1)


def test_cycle_is_rejected():
    g = nx.DiGraph()
    g.add_nodes_from([(0, {"lane": "npu", "kind": "qkv"}), (1, {"lane": "cpu", "kind": "attn"})])
    g.add_edges_from([(0, 1), (1, 0)])
    with pytest.raises(ScheduleError, match="cycle"):
        validate_dag(g)


def test_compiled_arrays_match_graph(layer, toy_profile):
    prof = toy_profile()
    g = build_dag(3, layer, 2)
    d = compile_dag(g, prof, 2)
    assert d.n_nodes == 18 and d.lanes == ("npu", "cpu") and d.per_chunk == 6
    for v in g.nodes:
        assert set(d.successors(v)) == set(g.successors(v))
        assert set(d.predecessors(v)) == set(g.predecessors(v))
        assert d.indeg[v] == g.in_degree(v)
        i, layer, kind = d.node_info(v)
        assert (i, layer, kind) == (g.nodes[v]["chunk"], g.nodes[v]["layer"], g.nodes[v]["kind"])
        assert d.node_id(i, d.j[v]) == v
    # attn cost at kv_len = (i+1)*C: chunk 2 of C=2 attends over 6 keys
    assert d.cost_us[d.node_id(2, 1)] == pytest.approx(prof.cost_us("attn", "cpu", 2, 6))


def test_lower_bound_is_valid_and_at_least_lane_work_and_critical_path(make_dag):
    d = make_dag(1)
    # one chunk: a chain, the critical path is everything
    assert d.lower_bound_us() == pytest.approx(sum(d.cost_us)) == pytest.approx(d.critical_path_us())
    d = make_dag(6)
    assert d.lower_bound_us() >= max(*d.work_us().values(), d.critical_path_us())
    # the CPU cannot start before the first qkv nor finish after the last o_ffn: head + work + tail
    cpu = d.work_us()["cpu"] + d.cost_us[0] + d.cost_us[-1]
    assert d.lower_bound_us() >= cpu - 1e-9


@pytest.mark.parametrize("kv_source", ["reader", "eq2"])
def test_flat_prefill_dag_is_its_graph_flattened(layer, kv_source):
    """The runtime's DAG (`prefill_dag`, built flat without networkx) is what `compile_graph` makes of its graph."""
    from hetero.dag import compile_graph, prefill_dag

    for n_chunks in (1, 3):
        assert prefill_dag(n_chunks, layer, 2, kv_source, reads_kv={"attn"}) == compile_graph(
            build_dag(n_chunks, layer, 2, kv_source), 0)
