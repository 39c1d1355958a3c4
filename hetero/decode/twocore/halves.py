"""A one-row decode graph cut at its INT8 matmuls into stages whose matmuls run as two column halves.

A plain decode step streams ~106 MB of INT8 weights through ~80 small graphs on one core (~26 GB/s here),
while the other core mostly idles; both cores together stream ~42 GB/s. A graph cannot be handed to the
second core whole (each layer's graphs depend on the one before), but each of its matmuls can be shared by
output columns: stage k holds the nodes between matmul k-1 and matmul k (norms, quantizers, activations,
online Hadamards: small, so both threads compute them) and matmul k, whose weight, scales and bias are cut
into column halves, one graph per half (`Halves.stages[k]`); the halves write the two halves of one [1, N]
output, so the next stage reads it whole. Nodes after the last matmul (a residual add) form a tail that one
thread runs. A column of `MatMulIntegerToFloat` is the same integer sum and the same scaling whichever
columns come with it, so a split graph computes its outputs bit for bit as the whole graph (tested).

Only row counts of one are split (the halves of a [C, N] output are not contiguous for C > 1), and only
`MatMulIntegerToFloat` (the CPU EP's INT8 matmul) and `MatMulNBits` (`npu.nbits`: each column is its own blocks
of weights against the row's per-block int8 activations, whichever columns come with it) with constant weights;
a graph without one stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from hetero.sessions import cpu_session

SPLIT_OP = "MatMulIntegerToFloat"  # inputs: A, B, a_scale, b_scale[, a_zero_point, b_zero_point, bias]
NBITS_OP = "MatMulNBits"  # inputs: A, B [N, blocks, blob], scales [N·blocks], zero_points[, g_idx, bias]; attribute N


@dataclass
class Stage:
    """One stage of a split graph: `halves[h]` computes column half h (`columns`) of each of its matmuls' outputs;
    half 0 also the stage's other outputs. A tail (no matmul) has one graph."""

    halves: list[onnx.ModelProto]
    inputs: list[str]  # tensors it reads: graph inputs or earlier stages' outputs
    outputs: list[str]  # tensors later stages or the caller read
    split: dict[str, int] = field(default_factory=dict)  # matmul output → its width N (halves [0, N/2), [N/2, N))


@dataclass
class Halves:
    stages: list[Stage]
    widths: dict[str, int]  # every tensor a stage reads or writes → its width ([1, width] float32)


def columns(width: int, half: int) -> tuple[int, int]:
    """The columns [lo, hi) of column half `half` (0 or 1) of a width-N output."""
    return (0, width // 2) if half == 0 else (width // 2, width)


def _splittable(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    return node.op_type in (SPLIT_OP, NBITS_OP) and node.domain == "com.microsoft" and node.input[1] in inits


def _width(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> int:
    """N of a splittable matmul: its B's columns ([K, N]), or MatMulNBits' attribute."""
    if node.op_type == NBITS_OP:
        return next(int(a.i) for a in node.attribute if a.name == "N")
    return int(inits[node.input[1]].dims[1])


def _needed(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes (in order) that `outputs` depend on."""
    want, keep = set(outputs), []
    for n in reversed(nodes):
        if want.intersection(n.output):
            keep.append(n)
            want.update(n.input)
    return keep[::-1]


def split_graph(model: onnx.ModelProto) -> Halves | None:
    """The graph as stages cut after each splittable matmul (module docstring); None when it has none."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    graph_inputs = [i.name for i in g.input if i.name not in inits]
    graph_outputs = [o.name for o in g.output]
    level: dict[str, int] = {name: 0 for name in graph_inputs}
    stage_of: list[int] = []
    for n in g.node:
        s = max((level[i] for i in n.input if i in level), default=0)
        stage_of.append(s)
        for o in n.output:
            level[o] = s + 1 if _splittable(n, inits) else s
    if not any(_splittable(n, inits) for n in g.node):
        return None
    n_stages = max(stage_of) + 1
    consumers: dict[str, set[int]] = {}
    for n, s in zip(g.node, stage_of):
        for i in n.input:
            consumers.setdefault(i, set()).add(s)
    stages = []
    for s in range(n_stages):
        nodes = [n for n, k in zip(g.node, stage_of) if k == s]
        produced = {o for n in nodes for o in n.output}
        outputs = [o for o in produced if o in graph_outputs or any(k > s for k in consumers.get(o, ()))]
        inputs = sorted({i for n in nodes for i in n.input if i and i not in produced and i not in inits})
        matmuls = [n for n in nodes if _splittable(n, inits)]
        if not matmuls:
            stages.append(Stage([_subgraph(model, nodes, inputs, outputs, {}, 0)], inputs, sorted(outputs)))
            continue
        split = {n.output[0]: _width(n, inits) for n in matmuls}
        halves = []
        for h in (0, 1):
            outs = outputs if h == 0 else [o for o in outputs if o in split]
            part = _needed(nodes, set(outs))
            ins = sorted({i for n in part for i in n.input if i and i not in {o for m in part for o in m.output}
                          and i not in inits})
            halves.append(_subgraph(model, part, ins, outs, split, h))
        stages.append(Stage(halves, inputs, sorted(outputs), split))
    return Halves(stages, _widths(model, graph_inputs, {t for st in stages for t in st.inputs + st.outputs}))


def _subgraph(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
              split: dict[str, int], half: int) -> onnx.ModelProto:
    """A model of `nodes` reading `inputs` and writing `outputs`, with the matmuls writing `split` outputs cut to
    column half `half` (their outputs keep their names, [1, N/2])."""
    g = model.graph
    used = {i for n in nodes for i in n.input}
    by_name = {t.name: t for t in g.initializer}
    inits = [t for t in g.initializer if t.name in used]
    new_nodes, new_inits = [], []
    for n in nodes:
        n2 = onnx.NodeProto()
        n2.CopyFrom(n)
        if n.output and n.output[0] in split and n.op_type == NBITS_OP:
            new_inits += _nbits_half(n2, by_name, split[n.output[0]], half)
        elif n.output and n.output[0] in split:
            lo, hi = columns(split[n.output[0]], half)
            # B [K, N], b_scale and b_zero_point [N] or [1], bias [N]: each sliced to the half's columns under a new name
            for slot in (1, 3, 5, 6):
                if slot >= len(n.input) or not n.input[slot]:
                    continue
                t = by_name[n.input[slot]]
                a = numpy_helper.to_array(t)
                if a.ndim == 0 or a.shape[-1] == 1:
                    continue  # a per-tensor scale applies to every column
                name = f"{t.name}__cols{half}"
                new_inits.append(numpy_helper.from_array(np.ascontiguousarray(a[..., lo:hi]), name))
                n2.input[slot] = name
        new_nodes.append(n2)
    elem = onnx.TensorProto.FLOAT
    graph = helper.make_graph(new_nodes, f"{g.name}_stage", [helper.make_tensor_value_info(i, elem, None) for i in inputs],
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                              inits + new_inits)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)


def _nbits_half(node: onnx.NodeProto, by_name: dict[str, onnx.TensorProto], n: int, half: int) -> list[onnx.TensorProto]:
    """Cut a MatMulNBits node (a copy, changed in place) to column half `half` of its n outputs: B's, the scales' and
    the zero points' rows of those columns (each laid out column by column), the bias's entries, attribute N;
    returns the new initializers."""
    lo, hi = columns(n, half)
    out = []
    for slot in (1, 2, 3, 5):  # B, scales, zero_points, bias (4: g_idx, per K: whole)
        if slot >= len(node.input) or not node.input[slot]:
            continue
        t = by_name[node.input[slot]]
        a = numpy_helper.to_array(t)
        cut = a.reshape(n, -1)[lo:hi].reshape((hi - lo, *a.shape[1:]) if a.ndim > 1 else -1)
        name = f"{t.name}__cols{half}"
        out.append(numpy_helper.from_array(np.ascontiguousarray(cut), name))
        node.input[slot] = name
    for a in node.attribute:
        if a.name == "N":
            a.i = hi - lo
    return out


def _widths(model: onnx.ModelProto, graph_inputs: list[str], names: set[str]) -> dict[str, int]:
    """Each tensor's width, from one run of the whole graph on zeros with those tensors as extra outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                          for t in sorted(names - have - set(graph_inputs)))
    sess = cpu_session(m.SerializeToString(), 1, "session", optimize="none")
    feeds = {i.name: np.zeros([1 if not isinstance(d, int) else d for d in i.shape], np.float32)
             for i in sess.get_inputs()}
    outs = sess.run(None, feeds)
    return {o.name: int(v.shape[-1]) for o, v in zip(sess.get_outputs(), outs) if o.name in names} | {
        name: int(feeds[name].shape[-1]) for name in graph_inputs if name in names}
