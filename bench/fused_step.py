"""`hetero bench fused_step`: what a decode step would cost as ONE ONNX Runtime run (a design probe, issue 13).

hetero's INT8 decode step is ~80 graph runs with attention and shadow corrections between them
(`decode.bound_step`), so it runs on one core: a two-thread pool that sleeps between runs costs a wake-up per
run. This builds the whole step of a model's shapes as one graph (per layer: RMSNorm, per-tensor
QuantizeLinear + `MatMulIntegerToFloat` for qkv, o, gate|up and down, QuickGelu·up, residual adds;
attention as `com.microsoft.GroupQueryAttention` with RoPE and the KV cache bound in place; the final norm
and the LM head) with SYNTHETIC INT8 weights (random, the real shapes: the time does not depend on the
values) and times it at given contexts on 1 thread, on 2 threads, and on 2 threads whose pool spins while
the run lasts. No shadow corrections, no online transforms: a lower bound for such a design, not hetero's
decode. Why hetero does not decode this way yet (GroupQueryAttention has no tree mask and its rows are not
the same at S = 1 and S = k, so tree verification would not stay exact): docs/journal.md, "Decoding".

    python bench/fused_step.py                          # contexts 256, 1024, 2048; prints a table
    python bench/fused_step.py --out bench/results      # also writes fused_step.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from bench.entry import write_json_md
from hetero.arguments import add_model_arg, int_list, positive_int
from hetero.config import ModelConfig

HELP = "a design probe: a whole decode step of the model's shapes as one ONNX Runtime graph (synthetic INT8 weights)"
# (intra-op threads, pool spins while a run lasts) and their column names
POOLS = ((1, False), (2, False), (2, True))
COLUMNS = [f"{t} thread{'s' if t > 1 else ''}{', spinning' if spin else ''}" for t, spin in POOLS]


def step_graph(cfg: ModelConfig, capacity: int, seed: int = 0) -> bytes:
    """The graph: inputs h0 [1, hidden], seqlens_k [1], total_len [], cos/sin [capacity, D/2], per layer past K/V
    [1, n_kv, capacity, D]; outputs logits [1, vocab] and per layer present K/V (bound to the past buffers)."""
    rng = np.random.default_rng(seed)
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    hid, d, qkv_w = cfg.hidden, cfg.head_dim, cfg.q_dim + 2 * cfg.kv_dim
    nodes, inits = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def int8_linear(x: str, k: int, n: int, out: str) -> None:
        w = const(out + "_w", rng.integers(-127, 128, (k, n), dtype=np.int8))
        nodes.append(helper.make_node("QuantizeLinear", [x, "a_scale", "a_zero"], [out + "_xq"]))
        nodes.append(helper.make_node("MatMulIntegerToFloat", [out + "_xq", w, "a_scale",
                                                               const(out + "_ws", np.full(n, 1e-3, np.float32)), "a_zero"],
                                      [out], domain="com.microsoft"))

    def norm(x: str, out: str) -> None:
        nodes.append(helper.make_node("SimplifiedLayerNormalization", [x, const(out + "_g", np.ones(hid, np.float32))],
                                      [out], axis=-1, epsilon=cfg.rms_eps))

    const("a_scale", np.float32(0.05))
    const("a_zero", np.uint8(128))
    cache = [1, cfg.n_kv_heads, capacity, d]
    inputs = [helper.make_tensor_value_info("h0", f32, [1, hid]), helper.make_tensor_value_info("seqlens_k", i32, [1]),
              helper.make_tensor_value_info("total_len", i32, []),
              helper.make_tensor_value_info("cos", f32, [capacity, d // 2]),
              helper.make_tensor_value_info("sin", f32, [capacity, d // 2])]
    outputs = [helper.make_tensor_value_info("logits", f32, [1, cfg.vocab])]
    h = "h0"
    for layer in range(cfg.n_layers):
        p = f"l{layer}_"
        norm(h, p + "x")
        int8_linear(p + "x", hid, qkv_w, p + "qkv")
        nodes.append(helper.make_node("Reshape", [p + "qkv", const(p + "s3", np.array([1, 1, qkv_w], np.int64))], [p + "qkv3"]))
        inputs += [helper.make_tensor_value_info(p + "past_k", f32, cache), helper.make_tensor_value_info(p + "past_v", f32, cache)]
        outputs += [helper.make_tensor_value_info(p + "k", f32, cache), helper.make_tensor_value_info(p + "v", f32, cache)]
        nodes.append(helper.make_node(
            "GroupQueryAttention", [p + "qkv3", "", "", p + "past_k", p + "past_v", "seqlens_k", "total_len", "cos", "sin"],
            [p + "a3", p + "k", p + "v"], domain="com.microsoft", num_heads=cfg.n_heads, kv_num_heads=cfg.n_kv_heads,
            do_rotary=1, rotary_interleaved=0, scale=float(d) ** -0.5))
        nodes.append(helper.make_node("Reshape", [p + "a3", const(p + "s2", np.array([1, cfg.q_dim], np.int64))], [p + "a"]))
        int8_linear(p + "a", cfg.q_dim, hid, p + "o")
        nodes.append(helper.make_node("Add", [h, p + "o"], [p + "h1"]))
        norm(p + "h1", p + "x2")
        int8_linear(p + "x2", hid, 2 * cfg.ffn, p + "gu")
        nodes.append(helper.make_node("Split", [p + "gu"], [p + "gate", p + "up"], axis=-1, num_outputs=2))
        nodes.append(helper.make_node("QuickGelu", [p + "gate"], [p + "act"], domain="com.microsoft", alpha=1.0))
        nodes.append(helper.make_node("Mul", [p + "act", p + "up"], [p + "m"]))
        int8_linear(p + "m", cfg.ffn, hid, p + "d")
        nodes.append(helper.make_node("Add", [p + "h1", p + "d"], [p + "h2"]))
        h = p + "h2"
    norm(h, "xf")
    int8_linear("xf", hid, cfg.vocab, "logits")
    graph = helper.make_graph(nodes, "fused_decode_step", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def time_step(cfg: ModelConfig, graph: bytes, capacity: int, context: int, threads: int, spin: bool, steps: int,
              gap_ms: float = 1.0) -> float:
    """Median ms of one run at `context` cached tokens; `gap_ms` idle between runs, as a decode's sampling and Python
    between steps (a pool that does not spin sleeps in it)."""

    from hetero.sessions import cpu_session

    session = cpu_session(graph, threads, spin=spin)
    rng = np.random.default_rng(1)
    shape = (1, cfg.n_kv_heads, capacity, cfg.head_dim)
    caches = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2 * cfg.n_layers)]
    cos = rng.random((capacity, cfg.head_dim // 2), dtype=np.float32)
    sin = rng.random((capacity, cfg.head_dim // 2), dtype=np.float32)
    logits = np.empty((1, cfg.vocab), np.float32)
    b = session.io_binding()
    b.bind_cpu_input("h0", rng.standard_normal((1, cfg.hidden), dtype=np.float32))
    b.bind_cpu_input("seqlens_k", np.array([context], np.int32))
    b.bind_cpu_input("total_len", np.array(context + 1, np.int32))
    b.bind_cpu_input("cos", cos)
    b.bind_cpu_input("sin", sin)
    for layer in range(cfg.n_layers):
        for j, kv in enumerate(("k", "v")):
            buf = caches[2 * layer + j]
            b.bind_input(f"l{layer}_past_{kv}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
            b.bind_output(f"l{layer}_{kv}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)  # in place
    b.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    for _ in range(3):
        session.run_with_iobinding(b)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        session.run_with_iobinding(b)
        times.append((time.perf_counter() - t0) * 1e3)
        time.sleep(gap_ms / 1e3)
    return statistics.median(times)


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# A decode step as one ONNX Runtime run ({r['model']} shapes, SYNTHETIC INT8 weights)", "",
             f"Reproduce: `{r['command']}`. ISA: {r['isa']}. A design probe, not hetero's decode: no shadow "
             "corrections, no online transforms; attention is ONNX Runtime's GroupQueryAttention. Median ms of a "
             "step (30 layers + LM head) after a warm-up, 1 ms idle between steps. hetero's own step: "
             "`bench/results/decode_step.md`.", "",
             "| context | " + " | ".join(COLUMNS) + " | load |", "|---:|" + "---:|" * len(COLUMNS) + "---|"]
    for row in r["rows"]:
        lines.append(f"| {row['context']} | " + " | ".join(str(row["ms"][c]) for c in COLUMNS) + f" | {row['load']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--contexts", default="256,1024,2048", help="cached tokens before the step")
    p.add_argument("--steps", type=positive_int, default=30, help="timed steps per context and pool")
    p.add_argument("--out", default=None, help="directory for fused_step.{json,md} (default: print only)")


def run(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.npu import isa

    contexts = int_list(args.contexts, "--contexts")
    model = load_model(args.model)
    cfg = model.config
    capacity = max(contexts) + 16
    graph = step_graph(cfg, capacity)
    rows = [{"context": c, "ms": {col: round(time_step(cfg, graph, capacity, c, t, spin, args.steps), 2)
                                  for col, (t, spin) in zip(COLUMNS, POOLS)}, "load": round(os.getloadavg()[0], 2)}
            for c in contexts]
    result = {"model": model.name, "isa": isa.machine(), "command": "python bench/fused_step.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    if args.out:
        write_json_md(Path(args.out), "fused_step", result, markdown(result))
    print(markdown(result))
    return 0
