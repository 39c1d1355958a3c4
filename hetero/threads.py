"""OpenMP's wait policy for hetero's processes: ONNX Runtime's and torch's thread pools share the cores; and
ONNX Runtime's pool mode (one pool per session, or one shared by the process).

A hetero prefill alternates ONNX Runtime sessions (the NPU lane on the CPU EP) and torch ops (attention,
shadow outliers: the CPU lane, mllm-NPU §3.4). libgomp, torch's OpenMP, spin-waits after every parallel
region by default, so its idle threads burn the cores the next ORT run needs (ORT's own pools never spin:
`npu.providers.OrtCpuProvider`). libgomp reads its policy once, from the environment, when torch loads it,
and has no call to change it later. So the edges of a process choose it before torch loads (`passive_openmp`:
the `hetero` command, a benchmark's entry, the tests), a child process is given it in its environment
(`passive_env`), and the library only reads it (`passive_in_effect`): importing hetero changes no
environment variable. Measured: docs/journal.md, "Measured facts".

ONNX Runtime: by default each session has its own intra-op pool that never spins. $HETERO_ORT_POOL=shared
gives the process one pool of every core, shared by all of hetero's sessions, spinning between runs
(ONNX Runtime's default): a decode step's ~80 small graph runs then split across the cores without a wake-up
each (docs/journal.md, "Decoding"); the sessions' own thread counts no longer apply. Every session hetero makes
takes its options from `hetero.sessions.session_options`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from hetero.errors import ConfigError

log = logging.getLogger(__name__)

WAIT_POLICY = "OMP_WAIT_POLICY"
KEEP = "HETERO_OMP_WAIT_POLICY"  # "default": leave the libraries' default (a baseline engine's process)
ORT_POOL = "HETERO_ORT_POOL"  # "session" (default): a pool per session; "shared": one for the process
ORT_PROFILE = "HETERO_ORT_PROFILE"  # a folder: every session made after it is set records ONNX Runtime's profile
USER_WAIT_POLICY = os.environ.get(WAIT_POLICY)  # as the user started the process (read, never written here)


def passive_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with OMP_WAIT_POLICY=PASSIVE, unless it names a policy or $HETERO_OMP_WAIT_POLICY is "default":
    the environment of a process that runs hetero."""
    out = dict(env)
    if WAIT_POLICY not in out and out.get(KEEP) != "default":
        out[WAIT_POLICY] = "PASSIVE"
    return out


def passive_openmp() -> bool:
    """For an entry point, before torch loads: this process's OpenMP threads wait passively (`passive_env`).
    Once torch is loaded libgomp has read its policy, so nothing is set then. Returns `passive_in_effect()`."""
    if "torch" not in sys.modules:
        os.environ.update(passive_env(os.environ))
    return passive_in_effect()


def passive_in_effect() -> bool:
    """Whether torch's OpenMP threads sleep when idle: the policy in the environment, which libgomp reads when
    torch loads (an entry point sets it before). If not, a torch op on more threads than its lane's share
    spins on cores that ONNX Runtime needs."""
    return os.environ.get(WAIT_POLICY, "").strip().upper() == "PASSIVE"


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


def shared_ort_pool() -> bool:
    """Whether $HETERO_ORT_POOL asks for one process-wide ONNX Runtime pool ("shared"; "session" or unset: no)."""
    mode = os.environ.get(ORT_POOL, "session").strip().lower() or "session"
    if mode not in ("session", "shared"):
        raise ConfigError(f"{ORT_POOL} must be 'session' or 'shared', got {os.environ[ORT_POOL]!r}")
    return mode == "shared"


_LANE = threading.local()  # the calling thread's share of the cores (`set_torch_threads`)


def set_torch_threads(n: int) -> None:
    """The calling thread's share of the cores (the one place hetero sets it): what its ONNX Runtime calls use
    (`lane_threads`) and, once torch is loaded, torch's intra-op thread count for its OpenMP team (a process
    whose INT8 path never imports torch sets only the first)."""
    _LANE.n = n
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def lane_threads() -> int:
    """The calling thread's share of the cores (`set_torch_threads`; by default torch's thread count once it is
    loaded, else every usable core)."""
    n = getattr(_LANE, "n", None)
    if n is not None:
        return n
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else usable_cores()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The calling thread's share of the cores set to n for the block, then restored (`set_torch_threads`)."""
    before = lane_threads()
    set_torch_threads(n)
    try:
        yield
    finally:
        set_torch_threads(before)


_SPIN_WARNED = False


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """How a runtime uses the host, chosen once at the edge (`methods.make_runtime`) from its arguments and the
    environment, then passed down: the runtime, its sessions and its decode step read it, not the environment.

    When lanes overlap (mllm-NPU §3.4) each gets half the cores so they do not oversubscribe them: the NPU lane's
    sessions always, torch on the CPU lane while another lane runs (all of them while it runs alone, if OpenMP's
    threads sleep when idle: `passive_in_effect`). In program order everything gets all of them."""

    threads: int  # cores the runtime uses
    lane_threads: int  # a lane's share while lanes overlap (the NPU lane's sessions, torch beside another lane)
    alone_threads: int  # torch's threads for a lane running alone
    ort_pool: str  # "session": a non-spinning pool per ONNX Runtime session; "shared": one spinning pool
    decode_helper: bool  # a decode step's second thread (`decode.twocore.attnpool`)

    @classmethod
    def for_host(cls, threads: int | None = None, overlapped: bool = True) -> "ExecutionPlan":
        """The plan on `threads` cores (None: all of them) for lanes that overlap or not."""
        global _SPIN_WARNED
        n = threads or os.cpu_count() or 1
        if n < 1:
            raise ConfigError(f"threads must be >= 1, got {n}")
        pool = "shared" if shared_ort_pool() else "session"
        lane = max(1, n // 2) if overlapped else n
        alone = n
        # torch's OpenMP threads spin (only a loaded torch has them: a warm INT8 start imports none): keep
        # them to a lane's share
        if lane != n and "torch" in sys.modules and not passive_in_effect():
            alone = lane
            if not _SPIN_WARNED:
                _SPIN_WARNED = True
                log.warning("torch's OpenMP threads spin-wait (torch was imported before hetero set OMP_WAIT_POLICY) "
                            "and would compete with ONNX Runtime's: set OMP_WAIT_POLICY=PASSIVE before importing "
                            "torch; torch keeps %d thread(s) per lane", lane)
        # the helper spins while a step runs: not beside a shared pool, whose threads spin too (docs/journal.md,
        # "Decoding": 14.2 vs 10.3 ms a step), nor on one core
        return cls(n, lane, alone, pool, pool == "session" and usable_cores() >= 2)
