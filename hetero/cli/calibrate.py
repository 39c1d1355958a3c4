"""`hetero calibrate`: profile activation outliers of a model on real text (mllm-NPU §3.3, offline)."""

from __future__ import annotations

import argparse
import json
import time

from hetero.cli import add_command
from hetero.arguments import add_model_arg, positive_float, positive_int
from hetero.outliers.calibration import CALIBRATION_ENV, DEFAULT_TOKENS, DEFAULT_WINDOW
from hetero.outliers.corpus import CORPORA, DEFAULT_CALIBRATION


def register(subparsers) -> None:
    p = add_command(subparsers, "calibrate")
    add_model_arg(p)
    p.add_argument("--corpus", default=DEFAULT_CALIBRATION,
                   help=f"shipped corpus ({', '.join(sorted(CORPORA))}) or a UTF-8 text file (default {DEFAULT_CALIBRATION})")
    p.add_argument("--tokens", type=positive_int, default=None, help=f"tokens to run (default {DEFAULT_TOKENS})")
    p.add_argument("--window", type=positive_int, default=None, help=f"tokens per forward (default {DEFAULT_WINDOW})")
    p.add_argument("--out", help=f"output .npz (default: the user calibration beside the model's cache entry, kept "
                                 f"apart from the shipped one; runs use it only with {CALIBRATION_ENV}=user)")
    p.add_argument("--method", default=None,
                   help="quantized method whose model is calibrated (default: hetero, the rotated model; with "
                        "--budget: hetero-search, whose per-site precision is then searched again)")
    p.add_argument("--budget", type=positive_float, default=None,
                   help="instead of calibrating, search the per-site precision again for this validation perplexity "
                        "budget in percent (e.g. 0.5), on the calibration in use; the result replaces the cached "
                        "plan that hetero-search runs")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.outliers.calibration import (calibrate, calibration_in_use, calibration_path, summary,
                                             user_calibration_chosen)
    from hetero.outliers.corpus import corpus_id, load_corpus
    from hetero.outliers.pruning import DEFAULT_PERCENTILE, kept_sites
    from hetero.paths import check_writable, keep

    from hetero.errors import ConfigError
    from hetero.methods import DEFAULT_METHOD, METHODS, quant_model
    from hetero.outliers.rotate import online_sites

    method = args.method or ("hetero-search" if args.budget is not None else DEFAULT_METHOD)
    spec = METHODS.get(method)
    if spec is None or spec.recipe is None:
        raise ConfigError(f"--method must be a quantized method, one of {sorted(k for k, m in METHODS.items() if m.recipe)}, "
                          f"got {method!r}")
    if args.budget is not None and (not spec.recipe.search or args.corpus != DEFAULT_CALIBRATION or args.out
                                    or args.tokens or args.window):
        raise ConfigError(f"--budget searches the precision of a searched method ({method!r} is "
                          f"{'one' if spec.recipe.search else 'not'}) on the calibration in use (no --corpus, --tokens, "
                          f"--window or --out)")
    text = load_corpus(args.corpus)
    if args.out:
        check_writable(args.out, "--out")  # before minutes of calibration, not after
    model = quant_model(load_model(args.model), spec.recipe)
    if args.budget is not None:
        return _search(model, spec, args.budget, calibration_in_use(model)["in use"], args.json)
    online = online_sites(model.config) if spec.recipe.rotate else {}
    t0 = time.perf_counter()
    stats = calibrate(model, text, args.tokens or DEFAULT_TOKENS, args.window or DEFAULT_WINDOW,
                      corpus_id(args.corpus, text), progress=not args.json, online=online)
    if args.out:
        path = stats.save(args.out)
    else:  # the user's cache entry, beside the default one, never over it (an unwritable cache: a warning)
        path = calibration_path(model, user=True)
        keep(path.parent, path.name, stats, lambda s, tmp: tmp.write_bytes(s.to_bytes()))
    rows = summary(stats, DEFAULT_PERCENTILE)
    keep = kept_sites(stats)
    top = sorted(rows, key=lambda r: -r["importance"])[:5]
    result = {"path": str(path), "model": model.name, "fingerprint": model.fingerprint, "corpus": stats.corpus,
              "tokens": stats.n_tokens, "seconds": round(time.perf_counter() - t0, 1), "shadow_sites": len(keep),
              "most_important": [{k: r[k] for k in ("layer", "site", "absmax", "scale", "importance")} for r in top],
              "calibration_in_use": calibration_in_use(model)["in use"]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"calibrated {model.name} on {stats.corpus} ({stats.n_tokens} tokens, {result['seconds']} s) -> {path}")
    print(f"outliers kept on {len(keep)} of {len(rows)} sites (a scale per row on the CPU EP, shadows on HTP); "
          f"most important (absmax / scale):")
    for r in top:
        print(f"  layer {r['layer']:2d} {r['site']:8s} absmax {r['absmax']:8.2f}  s {r['scale']:.4f}  importance {r['importance']:8.1f}")
    if not args.out:
        runs = "" if user_calibration_chosen() else f"; {CALIBRATION_ENV}=user runs this one"
        print(f"kept beside the default calibration, never over it{runs}. In use: {result['calibration_in_use']}")
    return 0


def _search(model, spec, budget: float, calibration: str, as_json: bool) -> int:
    """`hetero calibrate --budget`: the searched method's precision searched again on the calibration in use."""
    from hetero.methods import quant_plan

    t0 = time.perf_counter()
    plan = quant_plan(model, weight_form=None, recipe=spec.recipe, budget=budget)
    searched = {k: plan.meta[k] for k in ("budget_pct", "validation_ppl", "float_validation_ppl", "predicted_us", "met")}
    searched["sites"] = {kind: sum(1 for sq in plan.sites.values() if _kind(sq) == kind) for kind in ("a8", "a8s", "a8r", "a16")}
    result = {"model": model.name, "fingerprint": model.fingerprint, "calibration_in_use": calibration,
              "seconds": round(time.perf_counter() - t0, 1), "precision": searched}
    if as_json:
        print(json.dumps(result))
        return 0
    print(f"precision plan of {model.name} on the calibration in use ({calibration}): {searched['sites']} at validation "
          f"perplexity {searched['validation_ppl']:.4f} (float {searched['float_validation_ppl']:.4f}, budget "
          f"+{searched['budget_pct']:g}%, {'met' if searched['met'] else 'NOT met'}), predicted "
          f"{searched['predicted_us'] / 1e3:.1f} ms per chunk, {result['seconds']} s")
    return 0


def _kind(sq) -> str:
    return "a16" if sq.bits == 16 else "a8s" if sq.shadow else "a8r" if sq.per_row else "a8"
