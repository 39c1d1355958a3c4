"""Graph pieces of rotated and 16-bit sites: the online block Hadamard and W8A16 on the CPU EP.

- `online_hadamard`: x·T with T = diag(H_b, …) (`hetero.outliers.rotate.block_hadamard`), as Reshape →
  MatMul(H_b) → Reshape: a fixed float matmul in front of the site's quantization, inside the static graph.
- `a16_bytes` (CPU EP): q = QuantizeLinear(x, s, int16) split into bytes hi = floor(q/256) (u8, zero point
  128) and lo = q - 256·hi (u8, zero point 0), two u8 products with the same weights, combined in float32 as
  `hetero.outliers.a16.a16_combine` does (bit-exact with it).
- `row_scaled` (CPU EP): each row's absmax m, q = QuantizeLinear(x · (127 / m)) at scale 1, and the row scale
  m · (1/127) the product is multiplied by, as `hetero.outliers.rowscale` computes them (bit-exact with it).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from hetero.outliers.rotate import hadamard
from hetero.outliers.rowscale import ROW_INV_QMAX, ROW_QMAX, ROW_TINY


def online_hadamard(g, x: str, lead: list[int], width: int, block: int) -> str:
    """x [*lead, width] → x·T, T block-diagonal with `block`×`block` Hadamards."""
    h = hadamard(block).numpy().astype(np.float32)
    xb = g.op("Reshape", [x, g.const(np.array([*lead, width // block, block], np.int64))], "xblk")
    y = g.op("MatMul", [xb, g.const(h, "hadamard")], "xrot")
    return g.op("Reshape", [y, g.const(np.array([*lead, width], np.int64))], "xrot")


def a16_bytes(g, x: str, s_x: np.float32) -> tuple[str, str]:
    """(u_hi, u_lo) uint8 tensors of q = clip(rint(x/s), -32768, 32767) = 256·(u_hi - 128) + u_lo: q + 32768 as a
    uint16 (QuantizeLinear at zero point 32768, the same rounding and clip), its high byte (a shift) and its low byte
    (a narrowing Cast keeps q mod 256, as 32768 is a multiple of 256). Integer ops on the [T, K] input: the float
    floor/subtract form took nine passes over it."""
    u = g.op("QuantizeLinear", [x, g.const(np.array(s_x, np.float32), "act16_s"),
                                g.const(np.array(32768, np.uint16), "act16_zp")], "xq16")
    shifted = g.op("BitShift", [u, g.const(np.array(8, np.uint16), "c8")], "xq16_hi", direction="RIGHT")
    return (g.op("Cast", [shifted], "u_hi", to=TensorProto.UINT8), g.op("Cast", [u], "u_lo", to=TensorProto.UINT8))


def a16_combine(g, acc_hi: str, acc_lo: str, k_hi: np.ndarray, k_lo: np.ndarray) -> str:
    """float32 acc_hi·k_hi + acc_lo·k_lo (k_hi = 256·s·s_w, k_lo = s·s_w) of two int32 products (the 1×1 Conv form;
    the 2-D graphs scale each product in its GEMM's epilogue, `export._linears`)."""
    f_hi = g.op("Cast", [acc_hi], to=TensorProto.FLOAT)
    f_lo = g.op("Cast", [acc_lo], to=TensorProto.FLOAT)
    return g.op("Add", [g.op("Mul", [f_hi, g.const(k_hi, "acc_s_hi")]), g.op("Mul", [f_lo, g.const(k_lo, "acc_s_lo")])], "y")


def row_scaled(g, x: str, zp: str) -> tuple[str, str]:
    """(xq, row_s): x [T, K] quantized to u8 (zero point `zp`, 128) with each row's own scale m / 127, m its
    absmax (at least `ROW_TINY`), and row_s = m · (1/127) [T, 1] to multiply the integer product's float32 by."""
    m = g.op("ReduceMax", [g.op("Abs", [x], "xabs"), g.const(np.array([-1], np.int64))], "rowmax", keepdims=1)
    m = g.op("Max", [m, g.const(np.array(ROW_TINY, np.float32), "row_tiny")], "rowmax")
    xs = g.op("Mul", [x, g.op("Div", [g.const(np.array(ROW_QMAX, np.float32), "c127"), m], "row_r")], "xs")
    xq = g.op("QuantizeLinear", [xs, g.const(np.array(1.0, np.float32), "one"), zp], "xq")
    return xq, g.op("Mul", [m, g.const(np.array(ROW_INV_QMAX, np.float32), "inv127")], "row_s")
