"""OpenMP's wait policy for hetero's processes: ONNX Runtime's and torch's thread pools share the cores.

A hetero prefill alternates ONNX Runtime sessions (the NPU lane on the CPU EP) and torch ops (attention,
shadow outliers: the CPU lane, mllm-NPU §3.4). libgomp, torch's OpenMP, spin-waits after every parallel
region by default, so its idle threads burn the cores the next ORT run needs (ORT's own pools never spin:
`npu.providers.OrtCpuProvider`). The policy is read once, when torch loads libgomp: `hetero/__init__.py`
calls `passive_openmp()` before any module imports torch. Measured: docs/design.md "Measured facts".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

WAIT_POLICY = "OMP_WAIT_POLICY"
KEEP = "HETERO_OMP_WAIT_POLICY"  # "default": leave the libraries' default (a baseline engine's process)
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
