"""`hetero bench decode_int4_probe`: what a one-row decode step's layer graphs would cost with 4-bit weights (a design
probe, issue 24 item 3).

Decode is weight-bandwidth bound: a plain step streams every INT8 weight (~106 MB on the default model) once per
token, and the fastest peers read 4-bit weights (ONNX Runtime GenAI's int4 through ONNX Runtime's `MatMulNBits`,
llama.cpp's Q4_0). This builds each layer's two C = 1 graphs the way hetero cuts a layer (`qkv`: RMSNorm + the
fused q|k|v projection; `o_ffn`: o, residual, RMSNorm, gate|up, SiLU·up, down, residual) from the FLOAT weights,
quantizes their MatMuls with ONNX Runtime's own tool (`MatMulNBitsQuantizer`, round-to-nearest, block 32 or 128,
accuracy level 0 = float activations or 4 = int8 activations) and times them beside hetero's INT8 graphs as a
one-row `BoundStep` runs them (bound once, back to back, no attention or shadow corrections between them), on 1 and
2 intra-op threads. Accuracy: each layer's graph outputs vs the float graph on the float model's own activations,
and greedy tokens of the reference forward whose layers are each variant's graphs (in ONNX Runtime) vs the
float model's. Not hetero's decode: no shadow corrections, no rotation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from onnx import ModelProto, TensorProto, helper, numpy_helper

from hetero import model as ref
from hetero.arguments import add_model_arg, positive_int
from hetero.bench.entry import write_json_md
from hetero.config import ModelConfig
from hetero.errors import ConfigError

HELP = ("a design probe: a one-row decode step's layer graphs with ONNX Runtime's 4-bit MatMulNBits weights vs "
        "hetero's INT8 graphs (time, bytes, accuracy)")
BLOCKS = (32, 128)
LEVELS = (0, 4)  # MatMulNBits accuracy_level: 0 = float activations, 4 = int8 activations (CPU)
THREADS = (1, 2)
TREE_ROWS = (2, 4, 8)
GRID = "q4_1 grid b32"  # the weights' own GGUF Q4_1 blocks in MatMulNBits (`on_grid`)
# the MatMul inputs of a layer's graphs -> the site they read (`weights.SITE_LINEARS`)
SITES = {"x": "attn_in", "a": "o_in", "x2": "ffn_in", "m": "down_in"}
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a hash table is in one sentence.", "List three fruits.")


def layer_graphs(cfg: ModelConfig, lw: ref.LayerWeights) -> tuple[ModelProto, ModelProto]:
    """The float `qkv` and `o_ffn` graphs of one layer (rows a free dimension), as hetero cuts a layer."""
    unsupported = [v for v, on in (("biases", lw.bq is not None or lw.bo is not None or lw.b_gate is not None),
                                   ("post_norms", cfg.post_norms), ("act", cfg.act != "silu")) if on]
    if unsupported:
        raise ConfigError(f"decode_int4_probe builds llama-shaped layers only; this model has {', '.join(unsupported)}")
    f32 = TensorProto.FLOAT

    def t(name: str, x: torch.Tensor) -> Any:
        return numpy_helper.from_array(np.ascontiguousarray(x.detach().float().numpy()), name)

    def io(name: str, width: int) -> Any:
        return helper.make_tensor_value_info(name, f32, ["rows", width])

    def norm(x: str, w: str, out: str) -> Any:
        return helper.make_node("SimplifiedLayerNormalization", [x, w], [out], axis=-1, epsilon=cfg.rms_eps)

    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    w_qkv = torch.cat([lw.wq, lw.wk, lw.wv]).T
    qkv = helper.make_graph(
        [norm("h", "attn_norm", "x"), helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"], name="qkv")], "qkv",
        [io("h", cfg.hidden)], [io("qkv", w_qkv.shape[1])], [t("attn_norm", lw.attn_norm), t("w_qkv", w_qkv)])
    nodes = [helper.make_node("MatMul", ["a", "w_o"], ["o"], name="o"), helper.make_node("Add", ["h", "o"], ["h1"]),
             norm("h1", "ffn_norm", "x2"), helper.make_node("MatMul", ["x2", "w_gu"], ["gu"], name="gate_up"),
             helper.make_node("Split", ["gu"], ["gate", "up"], axis=-1, num_outputs=2),
             helper.make_node("Sigmoid", ["gate"], ["sg"]), helper.make_node("Mul", ["gate", "sg"], ["act"]),
             helper.make_node("Mul", ["act", "up"], ["m"]), helper.make_node("MatMul", ["m", "w_d"], ["d"], name="down"),
             helper.make_node("Add", ["h1", "d"], ["out"])]
    o_ffn = helper.make_graph(
        nodes, "o_ffn", [io("a", cfg.q_dim), io("h", cfg.hidden)], [io("out", cfg.hidden)],
        [t("w_o", lw.wo.T), t("ffn_norm", lw.ffn_norm), t("w_gu", torch.cat([lw.w_gate, lw.w_up]).T),
         t("w_d", lw.w_down.T)])
    return tuple(helper.make_model(g, opset_imports=opsets, ir_version=10) for g in (qkv, o_ffn))  # type: ignore[return-value]


def quantize(graph: ModelProto, block: int, level: int) -> ModelProto:
    """`graph` with every MatMul a 4-bit `MatMulNBits` (ONNX Runtime's quantizer, round-to-nearest, its defaults)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    copy = ModelProto()
    copy.CopyFrom(graph)  # the quantizer rewrites the model it is given
    q = MatMulNBitsQuantizer(copy, bits=4, block_size=block, accuracy_level=level)
    q.process()
    out = q.model.model
    if sum(n.op_type == "MatMulNBits" for n in out.graph.node) != sum(n.op_type == "MatMul" for n in graph.graph.node):
        raise RuntimeError(f"MatMulNBitsQuantizer left a MatMul of {graph.graph.name} unquantized")
    return out


def grid_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """w [out, in] read as the 4-bit grid of a GGUF Q4_1 tensor (per `block` inputs of a row: w = d·q + m, q in 0..15,
    m the block's least value): q [out, in] uint8, d and m [out, in/block], and max |d·q + m − w| / max |w| (≈ 0
    when w was dequantized from Q4_1, as the default model's weights are)."""
    n, k = w.shape
    b = w.reshape(n, k // block, block).astype(np.float64)
    m, top = b.min(-1), b.max(-1)
    d = np.where(top > m, (top - m) / 15, 1.0)
    q = np.clip(np.rint((b - m[..., None]) / d[..., None]), 0, 15)
    err = np.abs(q * d[..., None] + m[..., None] - b).max() / np.abs(w).max()
    return q.astype(np.uint8).reshape(n, k), d.astype(np.float32), m.astype(np.float32), float(err)


def on_grid(graph: ModelProto, level: int, block: int = 32) -> tuple[ModelProto, float]:
    """`graph` with every MatMul x·W the weights' own Q4_1 grid (`grid_blocks`, w = d·q + m), exactly: a 4-bit
    `MatMulNBits` with no zero points (it computes (q − 8)·d) plus the blocks' offsets, x's block sums [rows, K/block]
    times c = m + 8·d [K/block, N] (a float MatMul 1/32 the size of W); and the largest grid error. ONNX Runtime's
    quantizer cannot keep a GGUF's blocks (it rounds again, to integer zero points), and MatMulNBits with float zero
    points runs ~30× slower (a dequantizing path, measured on 2 layers), so the nibbles are packed here as
    MatMulNBits lays them: [N, K/block, block/2] bytes, element 2i in the low nibble of byte i."""
    out = ModelProto()
    out.CopyFrom(graph)
    inits = {i.name: i for i in out.graph.initializer}
    worst = 0.0
    for node in [n for n in out.graph.node if n.op_type == "MatMul"]:
        x, wname = node.input
        w = numpy_helper.to_array(inits[wname]).T  # [N, K]
        q, d, m, err = grid_blocks(w, block)
        worst = max(worst, err)
        n, k = w.shape
        q = q.reshape(n, k // block, block)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        p = node.name or wname
        out.graph.initializer.remove(inits[wname])
        out.graph.initializer.extend([
            numpy_helper.from_array(packed, p + "_q4"), numpy_helper.from_array(d.reshape(-1), p + "_d"),
            numpy_helper.from_array((m + 8 * d).T.copy(), p + "_c"),
            numpy_helper.from_array(np.array([0, k // block, block], np.int64), p + "_blocks"),
            numpy_helper.from_array(np.array([-1], np.int64), p + "_last")])
        y = node.output[0]
        new = [helper.make_node("MatMulNBits", [x, p + "_q4", p + "_d"], [p + "_qy"], name=p + "_grid",
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=level),
               helper.make_node("Reshape", [x, p + "_blocks"], [p + "_xb"]),
               helper.make_node("ReduceSum", [p + "_xb", p + "_last"], [p + "_xs"], keepdims=0),
               helper.make_node("MatMul", [p + "_xs", p + "_c"], [p + "_off"]),
               helper.make_node("Add", [p + "_qy", p + "_off"], [y])]
        i = list(out.graph.node).index(node)
        out.graph.node.remove(node)
        for j, nn in enumerate(new):
            out.graph.node.insert(i + j, nn)
    return out, worst


def with_level(graph: ModelProto, level: int) -> ModelProto:
    """A copy of a quantized graph whose MatMulNBits nodes run at `level` (the weights do not depend on it)."""
    out = ModelProto()
    out.CopyFrom(graph)
    for n in out.graph.node:
        if n.op_type == "MatMulNBits":
            for a in n.attribute:
                if a.name == "accuracy_level":
                    a.i = level
                    break
            else:
                n.attribute.append(helper.make_attribute("accuracy_level", level))
    return out


def weight_bytes(graph: ModelProto) -> int:
    """Bytes of the graph's weights (its initializers) a run reads."""
    return sum(numpy_helper.to_array(i).nbytes for i in graph.graph.initializer)


def bound_runs(graph: ModelProto, threads: int, rows: int = 1) -> tuple[Any, Callable[[], None], dict[str, np.ndarray]]:
    """A session of `graph` bound once to fixed buffers of `rows` rows (as `BoundStep` binds hetero's graphs) and its
    run."""
    from hetero.sessions import cpu_session

    s = cpu_session(graph.SerializeToString(), threads)
    b = s.io_binding()
    bufs = {}
    for v in list(graph.graph.input) + list(graph.graph.output):
        width = v.type.tensor_type.shape.dim[1].dim_value
        bufs[v.name] = np.random.default_rng(len(bufs)).standard_normal((rows, width), dtype=np.float32)
    for v in graph.graph.input:
        b.bind_input(v.name, "cpu", 0, np.float32, bufs[v.name].shape, bufs[v.name].ctypes.data)
    for v in graph.graph.output:
        b.bind_output(v.name, "cpu", 0, np.float32, bufs[v.name].shape, bufs[v.name].ctypes.data)
    return s, (lambda: s.run_with_iobinding(b)), bufs


def int8_runs(model, threads: int, rows: int = 1) -> tuple[list[list[Callable[[], None]]], list[int]]:
    """hetero's INT8 graphs of a one-row decode step, per layer, as its `BoundStep` runs them (default method), and
    the sizes of each layer's graphs' external data files (their INT8 weights, scales and shadow cuts' rows)."""
    from hetero.decode.step import DecodeStep
    from hetero.methods import make_runtime

    rt = make_runtime(model, threads=2)
    bound = DecodeStep(rt, threads=threads, attention_threads=1, split_after=None, small_rows=0).prepare(rows)
    sizes = [sum(f.stat().st_size for r in layer if r.graph.source is not None for f in r.graph.source.parent.glob("*.data"))
             for layer in bound.runs]
    return [[(lambda r=r: r.graph.run_bound(r.binding)) for r in layer] for layer in bound.runs], sizes


def time_variants(variants: dict[str, list[list[Callable[[], None]]]], repeats: int) -> dict[str, dict[str, float]]:
    """Median ms of layer 0's graphs and of all layers' graphs back to back, per variant, the variants interleaved
    (a slow stretch of a shared machine touches each alike)."""
    for layers in variants.values():  # warm-up: first-run allocations, pages
        for _ in range(3):
            for runs in layers:
                for run in runs:
                    run()
    one: dict[str, list[float]] = {k: [] for k in variants}
    all_: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, layers in variants.items():
            for _ in range(5):
                t0 = time.perf_counter()
                for run in layers[0]:
                    run()
                one[name].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            for runs in layers:
                for run in runs:
                    run()
            all_[name].append((time.perf_counter() - t0) * 1e3)
    return {k: {"layer0_ms": round(statistics.median(one[k]), 4), "all_layers_ms": round(statistics.median(all_[k]), 3)}
            for k in variants}


class _Capture:
    """A float `LayerBackend` that keeps each layer's graph inputs (h before qkv; a and h before o_ffn)."""

    name, tensors, any_rows = "capture", "torch", True

    def __init__(self, cfg: ModelConfig, w: ref.Weights):
        self.cfg, self.w, self.inputs = cfg, w, {}

    def qkv(self, layer: int, h: torch.Tensor, out: torch.Tensor | None = None):
        self.inputs[layer] = {"h": h.clone()}
        return ref.qkv(self.cfg, self.w.layers[layer], h)

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.inputs[layer]["a"], self.inputs[layer]["h1"] = a.clone(), h.clone()
        return ref.o_ffn(self.cfg, self.w.layers[layer], a, h)


def rel_errors(y: np.ndarray, ref_y: np.ndarray) -> dict[str, float]:
    """max |y − y_f| / max |y_f| and mean |y − y_f| / mean |y_f|."""
    d = np.abs(y - ref_y)
    return {"max": float(d.max() / np.abs(ref_y).max()), "mean": float(d.mean() / np.abs(ref_y).mean())}


def graph_errors(floats: list[tuple[ModelProto, ModelProto]], quants: list[tuple[ModelProto, ModelProto]],
                 inputs: dict[int, dict[str, torch.Tensor]]) -> list[dict[str, dict[str, float]]]:
    """Per layer: the errors of the quantized graphs' linear outputs vs the float graphs' on the float model's own
    activations: qkv's output, and o_ffn's update (out − h, what the residual adds)."""
    import onnxruntime as ort

    def run(g: ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    rows = []
    for layer, ((fq, fo), (qq, qo)) in enumerate(zip(floats, quants)):
        x = {k: v.numpy() for k, v in inputs[layer].items()}
        feeds_o = {"a": x["a"], "h": x["h1"]}
        rows.append({"qkv": rel_errors(run(qq, {"h": x["h"]}), run(fq, {"h": x["h"]})),
                     "o_ffn": rel_errors(run(qo, feeds_o) - x["h1"], run(fo, feeds_o) - x["h1"])})
    return rows


class GraphLayers:
    """A `LayerBackend` running each layer's `qkv` and `o_ffn` graphs (any row count) in ONNX Runtime: the float
    reference's layers with these graphs' weights and kernels (their activation rounding included). Numpy in and
    out, as the NPU lane's backends (`model.layer_stack` adapts it to the reference's tensors)."""

    name, tensors, any_rows = "graphs", "numpy", True

    def __init__(self, cfg: ModelConfig, graphs: list[tuple[ModelProto, ModelProto]]):
        from hetero.sessions import cpu_session

        self.cfg = cfg
        self.sessions = [tuple(cpu_session(g.SerializeToString(), 1) for g in pair) for pair in graphs]

    def qkv(self, layer: int, h: np.ndarray, out: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        y = self.sessions[layer][0].run(None, {"h": np.ascontiguousarray(h)})[0]
        q, k, v = np.split(y, [self.cfg.q_dim, self.cfg.q_dim + self.cfg.kv_dim], axis=1)
        return q, k, v

    def o_ffn(self, layer: int, a: np.ndarray, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return self.sessions[layer][1].run(None, {"a": np.ascontiguousarray(a), "h": np.ascontiguousarray(h)})[0]


def greedy(cfg: ModelConfig, w: ref.Weights, ids: list[int], n: int, backend: ref.LayerBackend | None = None
           ) -> list[int]:
    """n greedy tokens after `ids` (the reference forward with `backend`'s layers, recomputed per token)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        logits, _, _ = ref.forward(cfg, w, torch.tensor(ids), backend)
        out.append(int(logits[-1].argmax()))
        ids.append(out[-1])
    return out


def hetero_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt from hetero's default method (its INT8 prefill and decode, no stop tokens):
    the product's own distance from the float model, beside the 4-bit variants'."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.methods import make_runtime

    rt = make_runtime(model, threads=2)
    params = SamplingParams(max_new_tokens=n, stop_token_ids=())
    return [list(generate(rt, rt.prefill(ids), params).tokens) for ids in prompts]


def agreement(a: list[int], b: list[int]) -> dict[str, int]:
    """Tokens equal before the first difference, and equal positions."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {"prefix": first, "equal": sum(x == y for x, y in zip(a, b)), "of": len(a)}


def markdown(r: dict[str, Any]) -> str:
    t = r["timing"]
    lines = [f"# A one-row decode step's layer graphs with 4-bit weights ({r['model']}, a design probe)", "",
             f"Reproduce: `{r['command']}`. CPU: {r['cpu']}. {r['note']}", "",
             "Median ms of layer 0's graphs (qkv + o_ffn; hetero's INT8 program may cut more graphs) and of all "
             f"{r['layers']} layers' graphs back to back, one row, bound once; {r['repeats']} interleaved repeats. "
             "`int4 bB aL`: ONNX Runtime `MatMulNBits`, block B, accuracy level L (0: float activations, "
             f"4: int8 activations), ONNX Runtime's quantizer (round-to-nearest, its defaults). `{GRID}`: the "
             "weights' own Q4_1 blocks (the default model's float weights are its GGUF's Q4_1 dequantized; largest "
             f"grid error {r.get('grid_error', '?')}) as MatMulNBits without zero points plus the blocks' offsets (x's block "
             "sums times m + 8·d, a small float MatMul), no second rounding.", "",
             "| variant | threads | weight MB (all layers) | layer 0 ms | all layers ms | vs INT8 (same threads) |",
             "|---|---:|---:|---:|---:|---:|"]
    for th in map(str, r["threads"]):
        base = t[th]["int8"]["all_layers_ms"]
        for name, row in t[th].items():
            mb = r["weight_mb"].get(name.split(" a")[0], "")
            lines.append(f"| {name} | {th} | {mb} | {row['layer0_ms']} | {row['all_layers_ms']} | "
                         f"{row['all_layers_ms'] / base:.2f}× |")
    lines += ["", "## Accuracy: the 4-bit graphs' linear outputs vs the float graphs' on the float model's activations",
              "", f"{r['accuracy_tokens']} tokens of held-out text. qkv: the q|k|v output; o_ffn: its update (out − h). "
              "Relative error: max |Δ| / max |y|, and mean |Δ| / mean |y|; worst and median layer.", "",
              "| variant | qkv max (worst layer) | qkv mean (median layer) | o_ffn max (worst layer) | "
              "o_ffn mean (median layer) |", "|---|---:|---:|---:|---:|"]
    for name, rows in r["errors"].items():
        cell = {g: (max(x[g]["max"] for x in rows), statistics.median(x[g]["mean"] for x in rows)) for g in ("qkv", "o_ffn")}
        lines.append(f"| {name} | {cell['qkv'][0]:.4f} | {cell['qkv'][1]:.4f} | {cell['o_ffn'][0]:.4f} | "
                     f"{cell['o_ffn'][1]:.4f} |")
    if r.get("rows"):
        names = list(next(iter(r["rows"].values())))
        lines += ["", "## All layers' graphs at C rows (a tree step's sizes), 1 thread, ms (C = 1: the table above)", "",
                  "| C | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for c, row in r["rows"].items():
            lines.append(f"| {c} | " + " | ".join(str(row[k]) for k in names) + " |")
    if r.get("greedy"):
        lines += ["", f"## Greedy tokens: the reference forward with each variant's layer graphs vs float "
                  f"({r['greedy_tokens']} tokens, chat prompts; float: {r['greedy_float_check']})", "",
                  "| variant | prompt | equal prefix | equal positions |", "|---|---|---:|---:|"]
        for name, rows in r["greedy"].items():
            for p, a in zip(PROMPTS, rows):
                lines.append(f"| {name} | {p} | {a['prefix']} | {a['equal']} of {a['of']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--repeats", type=positive_int, default=40, help="interleaved timing repeats per variant")
    p.add_argument("--greedy-tokens", type=int, default=16, help="greedy tokens per chat prompt (0: skip)")
    p.add_argument("--accuracy-tokens", type=positive_int, default=128, help="tokens of held-out text for the errors")
    p.add_argument("--layers", type=int, default=0, help="the first N layers only (0: all)")
    p.add_argument("--no-int8", action="store_true", help="skip hetero's INT8 graphs (no runtime to build)")
    p.add_argument("--out", default=None, help="directory for decode_int4_probe.json/.md (default: print only)")


def run(args: argparse.Namespace) -> int:
    from hetero.bench.harness import prompt_ids
    from hetero.loader import load_model
    from hetero.npu import isa
    from hetero.prompt import encode_prompt

    model = load_model(args.model)
    cfg, w = model.config, model.weights
    n = args.layers or cfg.n_layers
    floats = [layer_graphs(cfg, lw) for lw in w.layers[:n]]
    quants = {f"int4 b{b}": [tuple(quantize(g, b, 0) for g in pair) for pair in floats] for b in BLOCKS}
    grid = [tuple(on_grid(g, 0) for g in pair) for pair in floats]
    quants[GRID] = [tuple(g for g, _ in pair) for pair in grid]
    grid_error = max(e for pair in grid for _, e in pair)
    weight_mb = {name: round(sum(weight_bytes(g) for pair in qs for g in pair) / 1e6, 1) for name, qs in quants.items()}
    weight_mb["float"] = round(sum(weight_bytes(g) for pair in floats for g in pair) / 1e6, 1)
    timing: dict[str, Any] = {}
    keep = []  # sessions stay alive while their runs are timed
    for th in THREADS:
        variants: dict[str, list[list[Callable[[], None]]]] = {}
        if not args.no_int8:
            runs, sizes = int8_runs(model, th)
            variants["int8"] = runs[:n]
            weight_mb["int8"] = round(sum(sizes[:n]) / 1e6, 1)
        made = [bound_runs(g, th) for pair in floats for g in pair]
        keep.append(made)
        variants["float"] = [[m[1] for m in made[i : i + 2]] for i in range(0, len(made), 2)]
        for form, qs in quants.items():
            for lv in LEVELS:
                layers = []
                for pair in qs:
                    made = [bound_runs(with_level(g, lv), th) for g in pair]
                    keep.append(made)
                    layers.append([m[1] for m in made])
                variants[f"{form} a{lv}"] = layers
        timing[str(th)] = time_variants(variants, args.repeats)
        keep.clear()
    # a tree step's rows (C = 2, 4, 8: `decode.step.TREE_SIZES`), one thread, the level-4 forms
    by_rows: dict[str, Any] = {}
    for c in TREE_ROWS:
        variants = {}
        if not args.no_int8:
            variants["int8"] = int8_runs(model, 1, c)[0][:n]
        for form, qs in quants.items():
            made = [[bound_runs(with_level(g, 4), 1, c) for g in pair] for pair in qs]
            keep.append(made)
            variants[f"{form} a4"] = [[m[1] for m in pair] for pair in made]
        by_rows[str(c)] = {k: v["all_layers_ms"] for k, v in time_variants(variants, max(5, args.repeats // 4)).items()}
        keep.clear()
    # accuracy
    cap = _Capture(cfg, w)
    ref.run_layers(cfg, w, prompt_ids(args.model, args.accuracy_tokens), cap)
    errors = {f"{form} a{lv}": graph_errors(floats, [tuple(with_level(g, lv) for g in p) for p in qs], cap.inputs)
              for form, qs in quants.items() for lv in LEVELS}
    greedy_rows: dict[str, list[dict[str, int]]] = {}
    float_check: list[dict[str, int]] = []
    if args.greedy_tokens > 0 and n == cfg.n_layers and model.tokenizer is not None:
        prompts = [encode_prompt(model.tokenizer, p) for p in PROMPTS]
        base = [greedy(cfg, w, ids, args.greedy_tokens) for ids in prompts]
        floats_run = GraphLayers(cfg, floats)  # the float graphs in ONNX Runtime: the harness's own agreement
        float_check = [agreement(x, greedy(cfg, w, ids, args.greedy_tokens, floats_run)) for x, ids in zip(base, prompts)]
        if not args.no_int8:
            greedy_rows["int8 (hetero, default method)"] = [
                agreement(x, y) for x, y in zip(base, hetero_greedy(model, prompts, args.greedy_tokens))]
        for form, qs in quants.items():
            for lv in LEVELS:
                layers = GraphLayers(cfg, [tuple(with_level(g, lv) for g in pair) for pair in qs])
                greedy_rows[f"{form} a{lv}"] = [agreement(x, greedy(cfg, w, ids, args.greedy_tokens, layers))
                                                for x, ids in zip(base, prompts)]
    cpu = isa.machine()
    result = {"model": model.name, "layers": n, "threads": list(THREADS), "repeats": args.repeats,
              "cpu": cpu, "load": round(os.getloadavg()[0], 2), "weight_mb": weight_mb, "timing": timing,
              "errors": errors, "rows": by_rows, "grid_error": grid_error, "accuracy_tokens": args.accuracy_tokens, "greedy": greedy_rows,
              "greedy_tokens": args.greedy_tokens,
              "greedy_float_check": ("its graphs in ONNX Runtime equal the torch reference on "
                                     f"{sum(a['equal'] for a in float_check)} of {sum(a['of'] for a in float_check)} tokens"),
              "note": (f"Load average at the end {os.getloadavg()[0]:.2f}. INT8: hetero's default method's one-row "
                       "graphs (weight MB: their graph cache data files: INT8 weights, scales, the shadow cuts' float rows); "
                       "float: the 4-bit variants' graphs with float32 MatMuls."),
              "command": "python bench/decode_int4_probe.py " + " ".join(sys.argv[1:])}
    if args.out:
        write_json_md(Path(args.out), "decode_int4_probe", result, markdown(result))
    print(markdown(result))
    return 0
