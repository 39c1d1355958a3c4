"""Every ONNX Runtime session hetero makes through the Python API, with one policy for their options.

A session runs on its own intra-op pool of `threads` that never spins (idle spinning threads would burn the
cores the other lane needs between two runs, mllm-NPU §3.4), keeps no per-session arena (each of ~100 graphs
would hold its high-water mark) but allocates from the process's one shared arena (`shared_arena`), and logs only
errors; in the shared pool mode (`threads.ExecutionPlan.ort_pool`)
it uses the process's one pool instead. The C API sessions of the decode step's second core are made in
`hetero.decode.twocore.ortc`, which that subpackage keeps to itself so that it can be deleted whole.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import onnxruntime as ort

from hetero.threads import ORT_PROFILE, shared_ort_pool

CPU = ["CPUExecutionProvider"]
_OPT = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
_shared_pool_made = False
_shared_arena_made = False
_arena_lock = threading.Lock()  # sessions are made on several threads at once (`npu.graph_backend`)
_profiled = itertools.count()  # one profile file per session (`session_options`)


def session_options(threads: int | None = None, pool: str | None = None, *, spin: bool = False,
                    arena: bool = True, inter_op_threads: int = 1, custom_ops: str | None = None) -> ort.SessionOptions:
    """Options of a session on `threads` intra-op threads (None: ONNX Runtime's default) or, when `pool` is
    "shared" (None: $HETERO_ORT_POOL's), on the process's one pool, made before the first session (ONNX Runtime
    reads it when it creates its environment, and warns once per session that names thread counts, so none are
    set then). spin: let idle pool threads spin (a probe of the alternative); arena: a per-session arena and memory
    pattern; custom_ops: a library of ops to register (`native.ort_ops.library_path`)."""
    global _shared_pool_made
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if (pool == "shared") if pool is not None else shared_ort_pool():
        if not _shared_pool_made:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(os.cpu_count() or 1, 1)
            _shared_pool_made = True
        so.use_per_session_threads = False
    elif threads is not None:
        so.intra_op_num_threads, so.inter_op_num_threads = threads, inter_op_threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.enable_cpu_mem_arena = arena
    if not arena:
        shared_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    # without an arena, no memory pattern either: a pattern's block of a run's intermediates stays with the binding
    # that ran it (~5.5 MB at 256 rows for an o→FFN graph, one per graph and lane thread), where plain allocations
    # come back to the process heap and the next graph reuses them (-130 MB peak; 0.97x a 256-token prefill, 0.99-1.04x
    # at 64 and 1024: docs/journal.md, "Issue 24 (session 16)")
    so.enable_mem_pattern = arena
    if custom_ops is not None:
        so.register_custom_ops_library(custom_ops)
    profile = os.environ.get(ORT_PROFILE)
    if profile:  # per-op kernel times of every run (the checkout's `bench/ort_profile.py`); costs a clock read per op
        so.enable_profiling = True
        # ONNX Runtime names the file <prefix>_<date>_<h-m-s>.json: sessions made in the same second with one
        # prefix would share (and garble) one file, so each gets its own prefix
        so.profile_file_prefix = os.path.join(profile, f"ort-{os.getpid()}-{next(_profiled)}")
    return so


def shared_arena() -> None:
    """Register the process's one CPU arena with ONNX Runtime's environment (once), which every session without an
    arena of its own allocates its intermediates from: one high-water mark of the activations of the graphs running
    at once, where plain allocations left glibc's heap fragmented (a 2,048-token prefill's whole-layer graphs grew it
    by ~240 MB of free but kept blocks of 0.5-2.3 MB: `hetero run`'s peak RSS 853 MB, 642 with this arena). Blocks of
    the size asked (kSameAsRequested), not the next power of two."""
    global _shared_arena_made
    with _arena_lock:
        if _shared_arena_made:
            return
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # (max bytes: no limit, extend strategy 1: kSameAsRequested, initial chunk and dead bytes: the defaults)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
        _shared_arena_made = True


def cpu_session(model: bytes | str | Path, threads: int | None, pool: str | None = None, *, optimize: str | None = None,
                save_optimized: Path | None = None, spin: bool = False, arena: bool = True,
                inter_op_threads: int = 1, custom_ops: str | None = None) -> ort.InferenceSession:
    """A CPU EP session of `model` (serialized bytes or a file). optimize: "all" or "none" (None: ONNX Runtime's
    default level); save_optimized: write the optimized model there (the graph cache's compiled artifact)."""
    so = session_options(threads, pool, spin=spin, arena=arena, inter_op_threads=inter_op_threads,
                         custom_ops=custom_ops)
    if optimize is not None:
        so.graph_optimization_level = _OPT[optimize]
    if save_optimized is not None:
        so.optimized_model_filepath = str(save_optimized)
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=CPU)


def ep_session(model: str | Path, so: ort.SessionOptions) -> ort.InferenceSession:
    """A session of a model file on the execution providers `so` names (`add_provider_for_devices`: QNN HTP)."""
    return ort.InferenceSession(str(model), so)
