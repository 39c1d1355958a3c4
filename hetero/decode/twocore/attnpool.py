"""A second core for a decode step: each layer's attention heads and its graphs' matmul halves shared with a
spinning helper thread.

A decode step streams the whole KV cache (47 MB at context 1024 on the default model) and ~106 MB of INT8
weights once per token; the step's ~80 graph runs stay on one thread of ONNX Runtime's own because a sleeping
pool pays a wake-up on every run (`step.DECODE_THREADS`). Here a helper thread is woken once per step
(`begin`), then spins in compiled code, without the GIL, on a small control array until the step ends
(`end`). Each layer's attention is published there as a job; both threads claim its KV heads one at a time
(compare-and-swap) and the main thread returns once every head is done. A stage of a split graph
(`halves`, `run_stages`) is a job too: the helper runs its column half through ONNX Runtime's C API (`ortc`,
`native.call3`) while the main thread runs the other; so is a column half of hetero's own GEMVs (`native.gemv`),
whose C entry has RunWithBinding's signature: the stage names the function the helper calls.

A head's output is computed by the same machine code, the C entry `rowattn.attend` calls over [h, h + 1),
whichever thread claims it and as the one-thread step does (an inlined copy of the kernel rounded differently), and a split graph's outputs are the
whole graph's: the result is bit for bit the one-thread step's (tested), so plain and speculative decoding
stay equal. If the helper is late (it has not woken yet, or the OS preempted it) the main thread claims the
heads and takes the graph halves back itself: nothing waits on the helper but work it is already running.
Measured: docs/journal.md, "Decoding".
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hetero import jitcache
from hetero.config import ModelConfig
from hetero.decode.twocore import atomics, native
from hetero.decode.rowattn import RowLayout, _rope_rows, attend, entry

# Control fields (int64), each on its own 64-byte cache line. SEQ is even when a job is published and odd
# while the main thread writes one (a seqlock); CLAIM and DONE count heads over all jobs and never go back,
# so a helper holding an old job can never claim a head of a newer one. A graph half (`run_stages`) is one
# job at a time: GSTATE 1 published (the function to call in GFN, its OrtSession* and OrtIoBinding* in GSESS and
# GBIND), 2 claimed by the helper, 3 done (its OrtStatus* in GSTATUS), 0 none or taken back by the main thread.
(_SEQ, _STOP, _CLAIM, _DONE, _LAYER, _PREFIX, _LIMIT, _HELPED, _GSTATE, _GSESS, _GBIND, _GSTATUS,
 _GHELPED, _WINDOW, _OFF, _GFN) = (8 * i for i in range(16))
_FIELDS = 16
# Longest wait at `begin` for the helper to report the last step done (it needs the GIL for that): past it the step
# runs on one thread.
IDLE_WAIT_S = 0.005


@dataclass(frozen=True, slots=True)
class StageTable:
    """A step's split graphs as the compiled loops see them (`bound_step.BoundStep`): stage i's own half (or tail) runs
    as session ms[i] with binding mb[i], its other half as hs[i] / hb[i] (0: none), through the C function at
    run_fn (ONNX Runtime's RunWithBinding, or `native.gemv`'s part: job, 0, part); raise_for(status) raises a failed
    run's error."""

    run_fn: int
    ms: np.ndarray
    mb: np.ndarray
    hs: np.ndarray
    hb: np.ndarray
    raise_for: Callable[[int], None]

    def run_here(self, first: int, last: int) -> None:
        """Stages first..last-1 on this thread: with no helper on a control array of its own, the main side of
        `_run_stages` takes every half back."""
        status, _ = _run_stages(np.zeros(8 * _FIELDS, np.int64), self.run_fn, self.ms, self.mb, self.hs, self.hb,
                                first, last)
        if status:
            self.raise_for(status)



@jitcache.njit(nogil=True)
def _claim_heads(ctrl: np.ndarray, limit: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix: int,
                 extra: np.ndarray, n_extra: np.ndarray, scale: float, out: np.ndarray,
                 helper: bool, window: int, off: int, entry: int) -> None:  # pragma: no cover - compiled
    """Claim the job's heads (head numbers limit - n_kv .. limit - 1) one at a time and attend each through the
    one compiled kernel at `entry` (`rowattn.attend`); the helper counts its heads (`AttentionPool.helped`)."""
    base = limit - k.shape[0]
    while True:
        c = atomics.load(ctrl, _CLAIM)
        if c >= limit:
            return
        if atomics.cas(ctrl, _CLAIM, c, c + 1):
            attend(entry, q, k, v, prefix, extra, n_extra, scale, out, c - base, c - base + 1, window, off)
            if helper:
                atomics.add(ctrl, _HELPED, 1)
            atomics.add(ctrl, _DONE, 1)


@jitcache.njit(nogil=True)
def _attend_shared(ctrl: np.ndarray, layer: int, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int,
                   k_all: np.ndarray, v_all: np.ndarray, q: np.ndarray, prefix: int, extra: np.ndarray,
                   n_extra: np.ndarray, scale: float, out: np.ndarray, window: int,
                   off: int, entry: int) -> int:  # pragma: no cover
    """The main thread's side of one layer: RoPE of the rows (`rowattn.rope_rows`, their K/V into cache rows
    prefix..), publish the job (the layer's sliding window and the position its row 0 holds with it), claim heads,
    wait until all are done; returns the spins it waited for the helper's last head."""
    n_kv, d = k_all.shape[1], k_all.shape[3]
    _rope_rows(qkv, cos, sin, n_heads, n_kv, d, k_all[layer], v_all[layer], prefix,
               q.reshape((q.shape[0], n_heads, d)))
    limit = atomics.load(ctrl, _CLAIM) + n_kv
    seq = atomics.load(ctrl, _SEQ)
    atomics.store(ctrl, _SEQ, seq + 1)
    atomics.store(ctrl, _LAYER, layer)
    atomics.store(ctrl, _PREFIX, prefix)
    atomics.store(ctrl, _LIMIT, limit)
    atomics.store(ctrl, _WINDOW, window)
    atomics.store(ctrl, _OFF, off)
    atomics.store(ctrl, _SEQ, seq + 2)
    _claim_heads(ctrl, limit, q, k_all[layer], v_all[layer], prefix, extra, n_extra, scale, out, False, window, off,
                 entry)
    spins = 0
    while atomics.load(ctrl, _DONE) < limit:
        atomics.pause()
        spins += 1
    return spins


@jitcache.njit(nogil=True)
def _helper_loop(ctrl: np.ndarray, seen: int, k_all: np.ndarray, v_all: np.ndarray, q: np.ndarray,
                 extra: np.ndarray, n_extra: np.ndarray, scale: float, out: np.ndarray,
                 entry: int) -> None:  # pragma: no cover
    """The helper's side of a step, until STOP is set: run the graph halves published to it (`_run_stages`,
    through the C function it names) and claim heads of every attention job published after `seen`."""
    while atomics.load(ctrl, _STOP) == 0:
        if atomics.load(ctrl, _GSTATE) == 1 and atomics.cas(ctrl, _GSTATE, 1, 2):
            status = native.call3(atomics.load(ctrl, _GFN), atomics.load(ctrl, _GSESS), 0, atomics.load(ctrl, _GBIND))
            atomics.store(ctrl, _GSTATUS, status)
            atomics.add(ctrl, _GHELPED, 1)
            atomics.store(ctrl, _GSTATE, 3)
            continue
        seq = atomics.load(ctrl, _SEQ)
        if seq == seen or seq % 2 == 1:
            atomics.pause()
            continue
        layer = atomics.load(ctrl, _LAYER)
        prefix = atomics.load(ctrl, _PREFIX)
        limit = atomics.load(ctrl, _LIMIT)
        window = atomics.load(ctrl, _WINDOW)
        off = atomics.load(ctrl, _OFF)
        if atomics.load(ctrl, _SEQ) != seq:  # a newer job was written meanwhile: read that one
            continue
        seen = seq
        _claim_heads(ctrl, limit, q, k_all[layer], v_all[layer], prefix, extra, n_extra, scale, out, True, window, off,
                     entry)


@jitcache.njit(nogil=True)
def _run_stages(ctrl: np.ndarray, run_fn: int, ms: np.ndarray, mb: np.ndarray, hs: np.ndarray, hb: np.ndarray,
                first: int, last: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """The main thread's side of stages first..last-1 of split graphs (`halves`): publish the helper's half of a
    stage (hs[i] != 0), run its own (session ms[i], binding mb[i]; a tail has no helper half), then take the
    helper's half back if it was not claimed, or wait for it. Returns (the first non-zero OrtStatus*, or 0;
    the spins it waited)."""
    spins = 0
    for i in range(first, last):
        shared = hs[i] != 0
        if shared:
            atomics.store(ctrl, _GFN, run_fn)
            atomics.store(ctrl, _GSESS, hs[i])
            atomics.store(ctrl, _GBIND, hb[i])
            atomics.store(ctrl, _GSTATE, 1)
        status = native.call3(run_fn, ms[i], 0, mb[i])
        if shared:
            if atomics.cas(ctrl, _GSTATE, 1, 0):
                other = native.call3(run_fn, hs[i], 0, hb[i])
            else:
                while atomics.load(ctrl, _GSTATE) != 3:
                    atomics.pause()
                    spins += 1
                other = atomics.load(ctrl, _GSTATUS)
                atomics.store(ctrl, _GSTATE, 0)
            if status == 0:
                status = other
        if status != 0:
            return status, spins
    return 0, spins


@jitcache.njit(nogil=True)
def _set(ctrl: np.ndarray, field: int, value: int) -> None:  # pragma: no cover - compiled
    atomics.store(ctrl, field, value)


@jitcache.njit(nogil=True)
def _spin(n: int) -> None:  # pragma: no cover - compiled
    for _ in range(n):
        atomics.pause()


@functools.cache
def _spin_seconds() -> float:
    """Seconds one wait-loop spin takes on this machine (the least of three timings of 20,000)."""
    _spin(10)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _spin(20_000)
        best = min(best, time.perf_counter() - t0)
    return best / 20_000


class AttentionPool:
    """A helper thread that shares each layer's attention heads and graph halves during a decode step (module
    docstring).

    `begin(...)` at the start of a step (False: the helper is still leaving the last step, so this step runs on
    one thread), `attend(layer, prefix)` per layer, `end()` when the step's last attention is done.
    """

    def __init__(self) -> None:
        self.ctrl = np.zeros(8 * _FIELDS, np.int64)
        self._go, self._idle = threading.Event(), threading.Event()
        self._idle.set()
        self._args: tuple | None = None
        self._step: tuple | None = None  # the arrays of the step in progress (main thread's side)
        self._closed = False
        self._thread: threading.Thread | None = None
        # Contention guard: the helper only pays when it has a core of its own. A step in which it attended under
        # a fifth of the heads (it could not run: another process has the cores, and its spinning took CPU time
        # from the main thread) or the main thread waited on it for over half of the attention and head time
        # (it was descheduled holding a head) turns the helper off for `_backoff` steps, doubling while it
        # recurs (at most 256); a good step resets it.
        self._spin_s = _spin_seconds()
        self._off = 0
        self._backoff = 1
        self._wait_spins = 0
        self._attend_s = 0.0
        self._heads = 0  # heads published this step
        self._helped_before = 0
        self.skipped = 0  # steps run on one thread by the guard

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._closed:
                break
            args, self._args = self._args, None
            if args is not None:
                _helper_loop(self.ctrl, *args)
            self._idle.set()
        self._idle.set()

    def begin(self, k_all: np.ndarray, v_all: np.ndarray, q: np.ndarray, extra: np.ndarray, n_extra: np.ndarray,
              scale: float, out: np.ndarray) -> bool:
        """Wake the helper for a step over these arrays (kept until `end`): the whole cache's K/V
        [layers, n_kv, capacity, D], the rows' roped queries [n, n_kv, g, D] (written before each `attend`),
        their paths (`rowattn.RowLayout`) and the output [n, n_kv, g, D]."""
        # The helper leaves the last step's loop at `end` without the GIL, then needs it for a few bytecodes to report
        # idle; a caller that runs Python between steps (`generate`: sampling, text) holds the GIL until its switch
        # interval (5 ms), so a bare check found the helper busy every other step and that step ran on one thread
        # (context 1024: 12.6 instead of 10.0 ms). Waiting releases the GIL: the helper reports within ~0.1 ms (two
        # thread wake-ups, measured in `generate`) unless it has no core.
        if self._closed or not self._idle.wait(IDLE_WAIT_S):
            return False
        if self._off > 0:
            self._off -= 1
            self.skipped += 1
            return False
        if self._thread is None or not self._thread.is_alive():  # first step, or a child after fork()
            self._go.clear()
            self._thread = threading.Thread(target=self._run, name="hetero-decode-attention", daemon=True)
            self._thread.start()
        self._idle.clear()
        _set(self.ctrl, _STOP, 0)
        self._step = (k_all, v_all, q, extra, n_extra, float(scale), out)
        self._helped_before = self.helped
        self._args = (int(self.ctrl[_SEQ]),) + self._step + (entry(),)
        self._go.set()
        return True

    def attend(self, cfg: ModelConfig, layer: int, qkv: np.ndarray, layout: RowLayout, base: int = 0) -> None:
        """`rowattn.decode_rows` of one layer on both threads, in one compiled call: RoPE of the rows' qkv
        [>= n, q_dim + 2·kv_dim] (contiguous; their K/V into the layer's cache rows layout.slot - base..), then their
        attention over cache rows [0, layout.slot - base) and their paths into the step's output; `base`: the
        position the layer's row 0 holds (`KVCache.place`)."""
        k_all, v_all, q, extra, n_extra, scale, out = self._step
        n = len(layout)
        if layout.slot - base + n > k_all.shape[2]:
            raise ValueError(f"rows {layout.slot}..{layout.slot + n - 1} must lie in the cache (capacity {k_all.shape[2]})")
        t0 = time.perf_counter()
        cos, sin = layout.rope(cfg, layer)
        self._wait_spins += _attend_shared(self.ctrl, layer, qkv[:n], cos, sin, cfg.n_heads,
                                           k_all, v_all, q, layout.slot - base, extra, n_extra, scale, out,
                                           cfg.window(layer), base, entry())
        self._attend_s += time.perf_counter() - t0
        self._heads += k_all.shape[1]

    def run_stages(self, st: StageTable, first: int, last: int) -> None:
        """Stages first..last-1 of split graphs (`halves`; the LM head's vocabulary halves too) on both threads
        when a step with the helper is in progress (`active`), else on this one: each stage's two halves at once,
        a tail on this thread; raises ONNX Runtime's error if a run fails."""
        if not self.active:
            st.run_here(first, last)
            return
        t0 = time.perf_counter()
        status, spins = _run_stages(self.ctrl, st.run_fn, st.ms, st.mb, st.hs, st.hb, first, last)
        self._attend_s += time.perf_counter() - t0
        self._wait_spins += spins
        if status:
            st.raise_for(status)

    @property
    def graph_halves(self) -> int:
        """Graph halves the helper has run so far (all steps)."""
        return int(self.ctrl[_GHELPED])

    @property
    def helped(self) -> int:
        """KV heads the helper has attended so far (all steps)."""
        return int(self.ctrl[_HELPED])

    @property
    def active(self) -> bool:
        """A step with the helper is in progress (`begin` returned True, `end` not called yet)."""
        return self._step is not None

    def end(self) -> None:
        """The step's attention is done: the helper stops spinning and goes back to sleep."""
        _set(self.ctrl, _STOP, 1)
        if self._step is not None and self._heads >= 6:
            waited = self._wait_spins * self._spin_s
            away = self.helped - self._helped_before < 0.2 * self._heads
            if away or (waited > 0.5 * self._attend_s and waited > 1e-4):
                self._off, self._backoff = self._backoff, min(2 * self._backoff, 256)
            else:
                self._backoff = 1
        self._step = None
        self._wait_spins, self._attend_s, self._heads = 0, 0.0, 0

    def close(self) -> None:
        """Stop the helper thread and wait for it to end. At interpreter exit (`weakref.finalize`'s atexit) this
        matters: a daemon thread still inside the compiled loop when finalization starts is killed by
        pthread_exit while it retakes the GIL in numba's C++ dispatcher, which aborts the process."""
        self._closed = True
        _set(self.ctrl, _STOP, 1)
        self._go.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10.0)
