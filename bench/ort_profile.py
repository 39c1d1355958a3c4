"""ONNX Runtime's own per-op profile of the sessions a prefill ran (`$HETERO_ORT_PROFILE`, `threads.ORT_PROFILE`).

Every session made while the variable names a folder records each run's kernels (cat "Node") and each run
(`model_run`, cat "Session") with its start; `collect` ends the profiling of every live session and sums what
started inside a time window (one timed prefill, not its warm-up) per op type and per session role: the
attention kernel's sessions (GroupQueryAttention alone, the CPU lane) apart from the INT8 graphs (the NPU lane, or
whole-layer graphs with their attention inside).
"""

from __future__ import annotations

import gc
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field


INT8_OPS = {"MatMulIntegerToFloat", "MatMulInteger", "ConvInteger", "QLinearMatMul"}  # the static graphs' kernels
# What a node of hetero's graphs does, from the stem `npu.export` names it by (`GraphBuilder.op`: "<stem>_<n>_<Op>"; ONNX
# Runtime keeps it, with a fusion's suffix, in a fused node's name): an op type alone mixes them (a MatMul is a
# shadow's product or an online Hadamard, a Mul a norm, the SiLU·up product or a dequantization).
PART_OF_STEM = {
    "qkv3": "attention", "a": "attention",  # the [1, T, ·] reshapes around GroupQueryAttention
    "y": "int8 linears", "acc": "int8 linears",
    "shadow": "shadow (Eq. 1)", "r": "shadow (Eq. 1)", "r_c": "shadow (Eq. 1)", "w_rows": "shadow (Eq. 1)",
    "w_rows_f": "shadow (Eq. 1)", "w_rows_q": "shadow (Eq. 1)", "w_deq": "shadow (Eq. 1)", "abs": "shadow (Eq. 1)",
    "reducemax": "shadow (Eq. 1)", "clip": "shadow (Eq. 1)", "beyond": "shadow (Eq. 1)", "nonzero": "shadow (Eq. 1)",
    "channels": "shadow (Eq. 1)", "y_shadowed": "shadow (Eq. 1)", "shadow_q": "shadow (Eq. 1)",
    "xrot": "online Hadamard", "xblk": "online Hadamard",
    "silu": "activation", "m": "activation", "sigmoid": "activation",
    "h": "residual adds", "h1": "residual adds", "h_out": "residual adds",
}


def layer_part(op: str, node: str) -> str:
    """The part of a layer a profiled node (op type, node name) belongs to (`PART_OF_STEM`); an op of another
    graph (the attention kernel's own session, the LM head) by its op type."""
    if op == "GroupQueryAttention":
        return "attention"
    if op in ("SimplifiedLayerNormalization", "LayerNormalization"):  # ONNX Runtime's fusion of `export.rms_norm`
        return "RMSNorm"
    if op in ("QuantizeLinear", "DynamicQuantizeLinear"):
        return "quantize"
    stem = node.split("/")[0].rsplit("_", 1)[0]  # "<stem>_<n>" of "<stem>_<n>_<Op>[/Fusion...]"
    stem = stem.rsplit("_", 1)[0] if stem.rsplit("_", 1)[-1].isdigit() else stem
    part = PART_OF_STEM.get(stem)
    if part is None:
        return "int8 linears" if op in INT8_OPS else f"other ({op})"
    return part


@dataclass
class OrtProfile:
    """Microseconds inside ONNX Runtime during a window."""

    op_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # kernel time per op type
    part_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # kernel time per `layer_part`
    run_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # session runs per role
    kernel_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # kernels per role
    runs: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # session runs per role


def live_sessions() -> list:
    """Every ONNX Runtime session alive in this process."""
    import warnings

    import onnxruntime as ort

    with warnings.catch_warnings():  # isinstance on some of torch's deprecated objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, ort.InferenceSession)]


def collect(windows: list[tuple[int, int]], remove: bool = True) -> list[OrtProfile]:
    """End profiling on every live session; per window [t0_ns, t1_ns] (time.time_ns: ONNX Runtime's profile
    starts are wall-clock ns), the sums of the events that started inside it. The sessions keep running, unprofiled."""
    out = [OrtProfile() for _ in windows]
    for sess in live_sessions():
        start = sess.get_profiling_start_time_ns()
        if not start:
            continue
        path = sess.end_profiling()
        if not path or not os.path.isfile(path):
            continue
        with open(path) as f:
            events = [e for e in json.load(f) if e.get("ph") == "X"]
        if remove:
            os.remove(path)
        ops = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        kinds = {e["args"].get("op_name") for e in ops}  # a whole-layer graph holds both: it counts as graphs
        role = "attention" if "GroupQueryAttention" in kinds and not kinds & INT8_OPS else "graphs"
        for prof, (t0, t1) in zip(out, windows):
            for e in events:
                if not t0 <= start + 1000 * e["ts"] <= t1:
                    continue
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    op = e["args"].get("op_name", "?")
                    prof.op_us[op] += e["dur"]
                    prof.part_us[layer_part(op, e["name"][: -len("_kernel_time")])] += e["dur"]
                    prof.kernel_us[role] += e["dur"]
                elif e.get("cat") == "Session" and e["name"] == "model_run":
                    prof.run_us[role] += e["dur"]
                    prof.runs[role] += 1
    return out
