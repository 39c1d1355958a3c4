"""Progress bars for the set-up steps that take more than a few seconds on a cold cache (reading a GGUF, rotation,
calibration, quantization, the graph build, packing the decode weights: minutes at 1B width).

tqdm on stderr (stdout is a command's answer), shown only where stderr is a terminal and the command has not asked
for machine-readable output (`quiet`: `hetero run --json`, `hetero calibrate --json`), so logs and pipes get none.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

_quiet = False


def quiet(on: bool = True) -> None:
    """No bar from now on in this process (a command whose output is read by a program)."""
    global _quiet
    _quiet = on


def shown() -> bool:
    """Whether a bar made now is drawn."""
    return not _quiet and sys.stderr.isatty()


def bar(total: int, desc: str, unit: str = "it", enabled: bool = True) -> "tqdm":
    """A bar of `total` steps for set-up step `desc` (a disabled one, which costs nothing per update, unless
    `shown()` and `enabled`); it disappears when closed, leaving the command's own lines."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not (enabled and shown()))
