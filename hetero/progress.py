"""Progress bars for the set-up steps that take more than a few seconds on a cold cache (reading a GGUF, rotation,
calibration, quantization, the graph build, packing the decode weights: minutes at 1B width).

tqdm on stderr (stdout is a command's answer), drawn only where stderr is a terminal and the command has not asked
for machine-readable output (`quiet`: `--json`), and only once a step has run for a second (a warm start's steps
draw nothing); logs and pipes get none, and where no bar can be drawn tqdm is not even imported.
"""

from __future__ import annotations

import sys
from typing import Any

_quiet = False


def quiet(on: bool = True) -> None:
    """No bar from now on in this process (a command whose output a program reads)."""
    global _quiet
    _quiet = on


def shown() -> bool:
    """Whether a bar made now is drawn."""
    return not _quiet and sys.stderr.isatty()


class _Hidden:
    """A bar that draws nothing (tqdm's interface, what set-up steps call)."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Hidden":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def bar(total: float, desc: str, unit: str = "it", enabled: bool = True) -> Any:
    """A bar of `total` units for set-up step `desc` (unit "B": bytes, drawn as kB/MB/GB), or one that draws
    nothing unless `shown()` and `enabled`; it disappears when closed, leaving the command's own lines."""
    if not (enabled and shown()):
        return _Hidden()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, leave=False, dynamic_ncols=True, delay=1.0)
