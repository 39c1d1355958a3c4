"""Native libraries' banners kept out of a command's output: file descriptor 1 pointed at 2 for a block.

The QNN HTP simulator prints `LIBNATIVE: No alternate configuration present…` to file descriptor 1 from
native code when the process creates its first QNN session, where Python's `sys.stdout` cannot catch it;
`hetero run --json` and every pipe reading hetero's answers would get it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_depth = 0  # blocks inside `stdout_to_stderr` now, in every thread
_saved: int | None = None  # a duplicate of the real stdout while redirected


def _flush_c_stdio() -> None:
    """What the C library buffered for its stdout, written now (to where fd 1 points)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to load by name (not POSIX)
        pass


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 points at 2 for the block; then it is the real stdout again.

    Nothing of hetero's own output is lost: Python's pending stdout text is flushed to the real stdout
    before, and what Python writes during the block stays in `sys.stdout`'s buffer until after; a flush
    forced meanwhile (a full buffer, a terminal's newline, PYTHONUNBUFFERED) moves it to stderr. Callers keep
    the blocks short (a session's creation) and hetero prints nothing while it creates sessions. Threads share one
    redirection, counted: it ends when the last block does; blocks run concurrently, not one at a time.
    Where a descriptor cannot be duplicated the block runs unredirected.
    """
    global _depth, _saved
    with _LOCK:
        if _depth == 0:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stdout.flush()
            _flush_c_stdio()
            try:
                saved = os.dup(1)
            except OSError:
                saved = None
            else:
                try:
                    os.dup2(2, 1)
                except OSError:
                    os.close(saved)
                    saved = None
            _saved = saved
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                _flush_c_stdio()  # a banner the C library buffered goes to stderr, not to the restored stdout
                os.dup2(_saved, 1)
                os.close(_saved)
                _saved = None
