"""`hetero calibrate`: profile activation outliers of a model on real text (mllm-NPU §3.3, offline)."""

from __future__ import annotations

import argparse
import json
import time

from hetero.cli.args import add_model_arg, positive_int
from hetero.outliers.calibrate import DEFAULT_TOKENS, DEFAULT_WINDOW
from hetero.outliers.corpus import CORPORA, DEFAULT_CALIBRATION


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="record activation statistics (scales, outliers, importance)")
    add_model_arg(p)
    p.add_argument("--corpus", default=DEFAULT_CALIBRATION,
                   help=f"shipped corpus ({', '.join(sorted(CORPORA))}) or a UTF-8 text file (default {DEFAULT_CALIBRATION})")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS, help=f"tokens to run (default {DEFAULT_TOKENS})")
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW, help=f"tokens per forward (default {DEFAULT_WINDOW})")
    p.add_argument("--out", help="output .npz (default: next to the model's cache entry)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.outliers.calibrate import calibrate, calibration_path, summary
    from hetero.outliers.corpus import corpus_id, load_corpus
    from hetero.outliers.pruning import DEFAULT_PERCENTILE, kept_sites
    from hetero.paths import check_writable

    text = load_corpus(args.corpus)
    if args.out:
        check_writable(args.out, "--out")  # before minutes of calibration, not after
    model = load_model(args.model)
    t0 = time.perf_counter()
    stats = calibrate(model, text, args.tokens, args.window, corpus_id(args.corpus, text), progress=not args.json)
    path = stats.save(args.out or calibration_path(model))
    rows = summary(stats, DEFAULT_PERCENTILE)
    keep = kept_sites(stats)
    top = sorted(rows, key=lambda r: -r["importance"])[:5]
    result = {"path": str(path), "model": model.name, "fingerprint": model.fingerprint, "corpus": stats.corpus,
              "tokens": stats.n_tokens, "seconds": round(time.perf_counter() - t0, 1), "shadow_sites": len(keep),
              "most_important": [{k: r[k] for k in ("layer", "site", "absmax", "scale", "importance")} for r in top]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"calibrated {model.name} on {stats.corpus} ({stats.n_tokens} tokens, {result['seconds']} s) -> {path}")
        print(f"shadow kept on {len(keep)} of {len(rows)} sites; most important (absmax / scale):")
        for r in top:
            print(f"  layer {r['layer']:2d} {r['site']:8s} absmax {r['absmax']:8.2f}  s {r['scale']:.4f}  importance {r['importance']:8.1f}")
    return 0
