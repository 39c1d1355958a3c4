"""OpenMP's wait policy for hetero's processes: ONNX Runtime's and torch's thread pools share the cores; and
ONNX Runtime's pool mode (one pool per session, or one shared by the process).

A hetero prefill alternates ONNX Runtime sessions (the NPU lane on the CPU EP) and torch ops (attention,
shadow outliers: the CPU lane, mllm-NPU §3.4). libgomp, torch's OpenMP, spin-waits after every parallel
region by default, so its idle threads burn the cores the next ORT run needs (ORT's own pools never spin:
`npu.providers.OrtCpuProvider`). The policy is read once, when torch loads libgomp: `hetero/__init__.py`
calls `passive_openmp()` before any module imports torch. Measured: docs/design.md "Measured facts".

ONNX Runtime: by default each session has its own intra-op pool that never spins. $HETERO_ORT_POOL=shared
gives the process one pool of every core, shared by all of hetero's sessions, spinning between runs
(ONNX Runtime's default): a decode step's ~80 small graph runs then split across the cores without a wake-up
each (docs/design.md, "Decoding"); the sessions' own thread counts no longer apply. Every session hetero makes
takes its options from `ort_session_options()`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from hetero.errors import ConfigError

WAIT_POLICY = "OMP_WAIT_POLICY"
KEEP = "HETERO_OMP_WAIT_POLICY"  # "default": leave the libraries' default (a baseline engine's process)
ORT_POOL = "HETERO_ORT_POOL"  # "session" (default): a pool per session; "shared": one for the process
ORT_PROFILE = "HETERO_ORT_PROFILE"  # a folder: every session made after it is set records ONNX Runtime's profile
USER_WAIT_POLICY = os.environ.get(WAIT_POLICY)  # as the user started the process, before passive_openmp()
TORCH_FIRST = "torch" in sys.modules  # torch loaded before hetero: libgomp has read its policy already


def passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user set a policy or $HETERO_OMP_WAIT_POLICY is "default"."""
    if USER_WAIT_POLICY is None and os.environ.get(KEEP) != "default":
        os.environ[WAIT_POLICY] = "PASSIVE"


def passive_in_effect() -> bool:
    """Whether torch's OpenMP threads sleep when idle: the policy libgomp read when torch loaded. If not,
    a torch op on more threads than its lane's share spins on cores that ONNX Runtime needs."""
    if USER_WAIT_POLICY is not None:
        return USER_WAIT_POLICY.strip().upper() == "PASSIVE"
    return not TORCH_FIRST and os.environ.get(KEEP) != "default"


def library_default_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child process that runs another engine as its users run it: OpenMP's wait policy as the
    user gave it (libgomp's default when none), not hetero's."""
    out = {k: v for k, v in env.items() if k != WAIT_POLICY}
    if USER_WAIT_POLICY is not None:
        out[WAIT_POLICY] = USER_WAIT_POLICY
    out[KEEP] = "default"
    return out


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all of them where the OS has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_shared_pool_made = False


def shared_ort_pool() -> bool:
    """Whether $HETERO_ORT_POOL asks for one process-wide ONNX Runtime pool ("shared"; "session" or unset: no)."""
    mode = os.environ.get(ORT_POOL, "session").strip().lower() or "session"
    if mode not in ("session", "shared"):
        raise ConfigError(f"{ORT_POOL} must be 'session' or 'shared', got {os.environ[ORT_POOL]!r}")
    return mode == "shared"


def ort_session_options(intra_op_threads: int | None = None, inter_op_threads: int = 1):
    """A fresh `onnxruntime.SessionOptions` for a session of hetero on `intra_op_threads` (None: ONNX Runtime's
    default); in the shared mode, the process's pool instead (made on first use, before any session: ONNX
    Runtime reads it when it creates its environment; it warns once per session whose options name thread
    counts, so none are set then)."""
    import onnxruntime as ort

    global _shared_pool_made
    so = ort.SessionOptions()
    if shared_ort_pool():
        if not _shared_pool_made:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(os.cpu_count() or 1, 1)
            _shared_pool_made = True
        so.use_per_session_threads = False
    elif intra_op_threads is not None:
        so.intra_op_num_threads, so.inter_op_num_threads = intra_op_threads, inter_op_threads
    profile = os.environ.get(ORT_PROFILE)
    if profile:  # per-op kernel times of every run (`hetero.bench.ort_profile`); costs a clock read per op
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile, "ort")
    return so
