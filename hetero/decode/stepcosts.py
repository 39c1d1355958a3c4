"""Measured decode step costs, kept per host, model and backend so that a warm start does not measure again.

The tree controller (LLMCad §3.3, `adapt`) needs what a step of each chunk size costs on this machine:
measuring them took 28 steps and ~1.3 s at every `hetero run`. They are a property of the
host, the model and its prepared graphs, like the prefill's learned costs (`sched.learned`), so they are
written once (atomically, under a lock) beside them and read at the next start; running decodes keep
refining them (`Decoding` folds the steps it timed back in).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from filelock import FileLock

from hetero.paths import atomic_path, user_profiles_dir
from hetero.sched.measure import host_slug

log = logging.getLogger(__name__)

FORMAT = 1


def costs_path(key: str) -> Path:
    """`<cache>/profiles/decode/<host>--<key>.json`."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in key)
    return user_profiles_dir() / "decode" / f"{host_slug()}--{safe}.json"


def load_costs(key: str) -> dict[int, float]:
    """The stored step costs (chunk size → ms) of `key`; {} when none, or when the file is not a valid record."""
    path = costs_path(key)
    try:
        rec = json.loads(path.read_text())
        if rec.get("format") != FORMAT or rec.get("key") != key:
            raise ValueError("another format or key")
        costs = {int(c): float(ms) for c, ms in rec["step_ms"].items()}
        if not all(c > 0 and math.isfinite(ms) and ms > 0 for c, ms in costs.items()):
            raise ValueError("a size or cost out of range")
        return costs
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring stored decode step costs %s (%s); measuring them again", path, e)
        return {}


def save_costs(key: str, costs: dict[int, float]) -> None:
    """Write `costs` for `key`; a cache that cannot be written only costs the next start a measurement."""
    path = costs_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_suffix(".lock")), timeout=60):
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps({"format": FORMAT, "key": key,
                                           "step_ms": {str(c): round(ms, 4) for c, ms in sorted(costs.items())}}))
    except OSError as e:
        log.warning("cannot store decode step costs in %s (%s)", path.parent, e.strerror or e)
