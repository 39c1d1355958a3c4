"""A call through a C function pointer from numba code (no GIL): how a compiled loop runs an ONNX Runtime graph.

The decode step's helper thread spins in compiled code without the GIL (`attnpool`); to run its half of a
split graph (`halves`) it calls ONNX Runtime's C API `RunWithBinding` (`ortc`) directly. Numba can call a
ctypes function only at an address frozen into the compiled code, which `cache=True` would carry into
another process; here the address is an ordinary int64 argument.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def call3(typingctx, fn, a, b, c):
    """fn(a, b, c) for a C function `void* fn(void*, void*, void*)` at address fn; all int64, returns the result
    as int64 (ONNX Runtime: an OrtStatus*, 0 on success)."""
    if not all(isinstance(t, types.Integer) for t in (fn, a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ptr, [ptr, ptr, ptr])
        cast = [context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args)]
        callee = builder.inttoptr(cast[0], fnty.as_pointer())
        res = builder.call(callee, [builder.inttoptr(v, ptr) for v in cast[1:]])
        return builder.ptrtoint(res, ir.IntType(64))

    return types.int64(fn, a, b, c), codegen


@intrinsic
def pointer(typingctx, addr, dtype):
    """The address addr (int64) as a pointer to `dtype` (a numpy scalar type: `np.float32`), for
    `numba.carray`: how a compiled C entry (`rowattn.attend`) sees the arrays its argument record names."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.DType | types.NumberClass):
        return None
    target = dtype.dtype if isinstance(dtype, types.DType) else dtype.instance_type
    ptr_type = types.CPointer(target)

    def codegen(context, builder, sig, args):
        as_int = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.inttoptr(as_int, context.get_value_type(ptr_type))

    return ptr_type(addr, dtype), codegen


@intrinsic
def float_of_bits(typingctx, bits):
    """The float64 whose bit pattern is the int64 bits (`np.float64(x).view(np.int64)` undone)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int64), ir.DoubleType())

    return types.float64(bits), codegen
