"""`hetero bench prefill` / `bench/prefill.py`: engines side by side, Fig. 17's ablation, simulated rows and
end-to-end workloads in one run; real rows are measured here, simulated rows name their profile.

    python bench/prefill.py [--quick] [--json] [--lens 64,256,1024,2048] [--repeats 3] [--threads 2]
    python bench/prefill.py --out bench/results     # the committed prefill.{json,md}, prefill_*.png

The peers (`bench.peer_engines.PEERS`, OpenVINO GenAI on its INT8 and INT4 exports among them; a peer's best
configuration is its fastest measured one, `report.vs_best_peer`) need the `bench` extra; OpenVINO's models are
exported by optimum-intel's optimum-cli, named by $HETERO_OPTIMUM_CLI, ONNX Runtime GenAI's builder by the
Python $HETERO_ORT_GENAI_PYTHON names (`make bench` makes both venvs). A missing peer is skipped with the reason
in the results.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from bench.entry import add_out_arg, out_dir
from bench.machine_bound import machine_bound
from bench.conditions import load_avg, trust_warnings
from bench.e2e import run_e2e
from bench.engines import ABLATION, PEERS
from bench.host import describe, host
from bench.peer_engines import LABELS
from bench.harness import run_engines
from bench.report import best_peer_fraction, fraction_of_bound, ratios, vs_best_peer, write_outputs
from bench.simulated import simulated_ablation, simulated_rows
from hetero.errors import ConfigError
from hetero.arguments import add_model_arg, int_list, positive_int
from hetero.loader import load_model

HELP = "prefill speed, memory, ablation and end-to-end runs against other engines"

REAL_ENGINES = ("hetero", "hetero_gqa", "hetero_lanes", "hetero_in_order", "naive_npu", "torch_float", *PEERS)


def run_prefill_bench(lens: list[int], repeats: int, threads: int, model_path: str | None = None,
                      engines: tuple[str, ...] = REAL_ENGINES, ablation_len: int = 512, e2e: bool = True,
                      profile_path: str | None = None, progress: bool = True, ablation: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(engines) + len(ABLATION) + 2, desc="hetero bench", disable=not progress)
    load_before = load_avg()

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    rows, skipped = run_engines(list(engines), lens, repeats, threads, model_path, progress=step)
    bound = machine_bound(load_model(model_path).config, lens, threads)
    ablation_engines = [e for _, e in ABLATION]
    ab_rows, ab_skipped = run_engines(ablation_engines, [ablation_len], repeats, threads, model_path,
                                      progress=step) if ablation else ([], {})
    by_engine = {r.engine: r for r in ab_rows}
    ablation_real = [{"step": label, "engine": e, "prompt_len": ablation_len, "prefill_ms": by_engine[e].ttft_ms,
                      "tokens_per_s": by_engine[e].tokens_per_s, "simulated": False}
                     for label, e in ABLATION if e in by_engine]
    sim = simulated_rows(profile_path, lens)
    ablation_sim = simulated_ablation(profile_path, ablation_len) if ablation else []
    step("simulated")
    e2e_rows = run_e2e(model_path, threads) if e2e else []
    step("end-to-end")
    bar.close()
    best = vs_best_peer(rows, PEERS)
    warnings = trust_warnings([asdict(r) for r in rows + ab_rows], load_before, load_avg())
    return {
        "warnings": warnings,
        "conditions": {"model": model_path or "SmolLM2-135M-Instruct (Q4_1 GGUF, default)", "threads": threads,
                       "repeats": repeats, "statistic": "median after 1 warm-up", "chunk": 256,
                       "machine": describe(host()), "host": host(),
                       "loadavg_1m": round(load_avg(), 2), "loadavg_1m_start": round(load_before, 2),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "rows": [asdict(r) for r in rows + sim],
        "ratios": ratios(rows),
        "vs_best_peer": best,
        "peers": {e: LABELS[e] for e in engines if e in LABELS},
        "bound": {**bound, "hetero_fraction": fraction_of_bound(rows, bound),
                  "best_peer_fraction": best_peer_fraction(best, bound)},
        "ablation": {"real": ablation_real, "simulated": ablation_sim},
        "e2e": e2e_rows,
        "skipped": {**skipped, **ab_skipped},
    }




def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--quick", action="store_true", help="prompt lengths 64,256, one repeat, no end-to-end runs")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end workloads")
    p.add_argument("--engines", default=",".join(REAL_ENGINES), help=f"engines to compare (of {', '.join(REAL_ENGINES)})")
    p.add_argument("--no-ablation", action="store_true", help="skip the ablation (mllm-NPU Fig. 17 steps)")
    add_out_arg(p, "prefill*.json/.md/.png")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    lens = int_list(args.lens, "--lens")
    if args.quick:
        lens, args.repeats = [64, 256], 1
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    bad = [e for e in engines if e not in REAL_ENGINES]
    if bad or not engines:
        raise ConfigError(f"--engines must name engines of {', '.join(REAL_ENGINES)}, got {args.engines!r}")
    result = run_prefill_bench(lens, args.repeats, args.threads, args.model, engines=engines,
                               e2e=not (args.quick or args.no_e2e), ablation_len=256 if args.quick else 512,
                               ablation=not args.no_ablation)
    # another model's run goes beside the default model's committed one (prefill_<model>.*)
    paths = write_outputs(result, out_dir(args.out), "prefill" + (f"_{Path(args.model).stem}" if args.model else ""))
    for w in result["warnings"]:
        print(f"hetero bench: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(paths[1].read_text())
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0
