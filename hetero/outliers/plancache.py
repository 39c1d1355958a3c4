"""The quantization plan derived from a model's calibration, kept beside it: a warm start reads the plan's site
table instead of loading the calibration (361 compressed arrays, ~70 ms) and deriving it (~40 ms).

The plan is a pure function of the calibration's content, the `PlanOptions` and the code that derives it, so its
file is named by a digest of all three: the calibration's content hash as its entry's record holds it, the options,
and the source of the modules that compute a plan (an edit to them is a new name, never a stale plan). The file is
a cache entry like the others (`paths`: written atomically under the entry's lock with a content record, checked
at first use); the INT8 weights are not in it (`QuantPlan.from_dict` reads them from `weightcache`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from pathlib import Path

from hetero import shipped
from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.outliers import a16, calibration, plan, pruning, quantize
from hetero.outliers.calibration import calibration_path, ensure_calibration
from hetero.outliers.plan import QuantPlan
from hetero.outliers.pruning import PlanOptions, plan_from_calibration
from hetero.paths import keep, read_record, verify

log = logging.getLogger(__name__)

PLANCACHE_VERSION = 1  # bump when the file's layout changes (what derives a plan is in `_code_digest`)


@functools.cache
def _code_digest() -> str:
    """sha256 of the source of the modules a plan is derived with (calibration statistics, pruning, the plan)."""
    h = hashlib.sha256()
    for mod in (calibration, pruning, plan, quantize, a16):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _recorded_hash(path: Path) -> str | None:
    """The content hash that `path`'s entry records for it (None: unrecorded, or an unreadable record)."""
    try:
        rec = read_record(path.parent).get(path.name)
    except ValueError:
        return None
    return rec.get("xxh3") if isinstance(rec, dict) else None


def _plan_name(model, options: PlanOptions, calib_hash: str) -> str:
    text = json.dumps({"version": PLANCACHE_VERSION, "model": model.fingerprint, "calibration": calib_hash,
                       "options": dataclasses.asdict(options), "code": _code_digest()}, sort_keys=True, default=list)
    return f"plan-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def _in_site_order(p: QuantPlan) -> QuantPlan:
    """`p` with its sites in the order a derived plan has them (layer by layer, `SITES` within a layer)."""
    order = sorted(p.sites, key=lambda k: (k[0], SITES.index(k[1])))
    return dataclasses.replace(p, sites={k: p.sites[k] for k in order})


def _read_plan(path: Path, model) -> QuantPlan:
    return _in_site_order(QuantPlan.from_dict(json.loads(path.read_text()), model))


def _save(d: dict, tmp: Path) -> None:
    tmp.write_text(json.dumps(d, sort_keys=True))


def cached_plan(model, options: PlanOptions, progress: bool = False) -> QuantPlan:
    """`plan_from_calibration(model, ensure_calibration(model), options)`, read from its file beside the model's
    calibration when one is recorded for that calibration's content, else from the package when it ships that
    file (`hetero.shipped`: the default model's, checked by content hash), else derived; kept there either way."""
    path = plan_file(model, options)
    if path is not None and path.is_file():
        bad = verify(path.parent, [path.name])
        if not bad:
            try:
                return _read_plan(path, model)
            except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
                log.warning("quantization plan %s cannot be read (%s: %s); deriving it again", path,
                            type(e).__name__, e)
        else:
            log.warning("quantization plan %s %s; deriving it again", path, "; ".join(d.why for d in bad))
    calib = ensure_calibration(model, progress=progress, online=dict(options.online or {}))
    path = plan_file(model, options)  # named by what ensure_calibration checked (or wrote) the file against
    if path is None:  # an unwritable cache: derived again next time
        return plan_from_calibration(model, calib, options)
    shipped_entry = shipped.manifest("plans").get(path.name)
    where = shipped.verified("plans", shipped_entry) if shipped_entry is not None else None
    if where is not None:
        log.info("quantization plan of %s from the package (%s)", model.name, path.name)
        derived = _read_plan(where, model)
    else:
        derived = plan_from_calibration(model, calib, options)
    keep(path.parent, path.name, derived.to_dict(), _save)
    return derived


def plan_file(model, options: PlanOptions) -> Path | None:
    """The cache file that holds `options`' plan of `model` for its current calibration (None before the
    calibration is cached); what `hetero.methods.ship_default_plans` copies into the package."""
    path = calibration_path(model)
    if path.name == calibration.DEFAULT_FILE:
        calibration.restore_shipped(model)  # never a plan of a calibration written over the package's
    calib_hash = _recorded_hash(path)
    return None if calib_hash is None else path.parent / _plan_name(model, options, calib_hash)
