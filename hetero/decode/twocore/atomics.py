"""Atomic loads, stores, compare-and-swap and a spin-wait pause on int64 arrays, callable from numba code.

Two threads that share a decode step's attention (`attnpool.AttentionPool`) hand work over through a small
int64 control array while both run compiled code without the GIL. Plain numba loads in a wait loop may be
hoisted out of it by the compiler, and a work claim needs compare-and-swap: these emit LLVM's atomic
instructions (acquire / release / sequentially consistent) and x86's `pause` in a spin.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _slot(context, builder, aryty, ary_val, idx_val, idx_ty):
    ary = context.make_array(aryty)(context, builder, ary_val)
    return builder.gep(ary.data, [context.cast(builder, idx_val, idx_ty, types.intp)])


def _value_slot(context, builder, sig, args):
    """(val as int64, the address of arr[idx]) of an intrinsic called as (arr, idx, val)."""
    return (context.cast(builder, args[2], sig.args[2], types.int64),
            _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]))


def _check(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.layout == "C"


@intrinsic
def load(typingctx, arr, idx):
    """arr[idx] read with acquire ordering (arr: C-contiguous int64)."""
    if not _check(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def store(typingctx, arr, idx, val):
    """arr[idx] = val with release ordering."""
    if not _check(arr):
        return None

    def codegen(context, builder, sig, args):
        builder.store_atomic(*_value_slot(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent); returns the old value."""
    if not _check(arr):
        return None

    def codegen(context, builder, sig, args):
        v, slot = _value_slot(context, builder, sig, args)
        return builder.atomic_rmw("add", slot, v, "seq_cst")

    return types.int64(arr, idx, val), codegen


@intrinsic
def cas(typingctx, arr, idx, expected, new):
    """Set arr[idx] = new if it holds `expected` (sequentially consistent); True when it did."""
    if not _check(arr):
        return None

    def codegen(context, builder, sig, args):
        e = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        res = builder.cmpxchg(_slot(context, builder, sig.args[0], args[0], args[1], sig.args[1]), e, n,
                              "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)

    return types.boolean(arr, idx, expected, new), codegen


@intrinsic
def pause(typingctx):
    """A spin-wait hint (x86 `pause`; nothing elsewhere): the waiting core yields pipeline resources."""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen
