"""Prefill timing harness: each engine in its own subprocess, one warm-up, medians of repeats.

A subprocess per engine (`python -m hetero.bench.harness --worker ENGINE`) keeps its peak RSS its own and
its thread settings from leaking into the next engine. The naive NPU engine's timed runs include graph
preparation: preparing a graph per prompt length *is* its cost (mllm-NPU §2.3).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from hetero.bench.engines import ENGINES, EngineUnavailable
from hetero.methods import use_threads
from hetero.threads import library_default_env, passive_env


BASELINES = ("torch_float", "llama_cpp")  # other engines (the rest are hetero's methods and its naive NPU path)


@dataclass(frozen=True, slots=True)
class Row:
    """One engine × prompt length, medians of `runs_ms`."""

    engine: str
    prompt_len: int
    tokens_per_s: float
    ttft_ms: float  # prefill + choosing the first token: the time to first token
    peak_rss_mb: float  # the engine's whole process, model included
    simulated: bool = False
    runs_ms: list[float] = field(default_factory=list)
    note: str = ""



def prompt_ids(model_path: str | None, n: int) -> torch.Tensor:
    """The first `n` tokens of held-out real text (the evaluation corpus), the same for every engine."""
    from hetero.loader import load_model
    from hetero.outliers.corpus import DEFAULT_EVALUATION, load_corpus

    tok = load_model(model_path).tokenizer
    text = load_corpus(DEFAULT_EVALUATION)
    ids = tok(text[: 8 * n + 1000])["input_ids"]
    if len(ids) < n:
        raise ValueError(f"evaluation corpus too short for {n} tokens")
    return torch.tensor(ids[:n])


def run_worker(engine: str, model_path: str | None, lens: list[int], repeats: int, threads: int) -> list[Row]:
    """Measure one engine in this process."""
    use_threads(threads)
    prompts = {n: prompt_ids(model_path, n) for n in lens}
    prefill = ENGINES[engine](model_path, threads, max(lens))
    rows = []
    for n in lens:
        ids = prompts[n]
        prefill(ids)  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(ids)
            runs.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(runs)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(Row(engine, n, round(n / (med / 1e3), 1), round(med, 2), round(rss_mb, 1), False,
                        [round(r, 2) for r in runs]))
    return rows


def run_engines(engines: list[str], lens: list[int], repeats: int, threads: int, model_path: str | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[list[Row], dict[str, str]]:
    """Each engine in a fresh subprocess; returns rows and {engine: why skipped}."""
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    for engine in engines:
        if progress:
            progress(engine)
        cmd = [sys.executable, "-m", "hetero.bench.harness", "--worker", engine, "--lens", ",".join(map(str, lens)),
               "--repeats", str(repeats), "--threads", str(threads)]
        if model_path:
            cmd += ["--model", model_path]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        # baselines as their users run them (OpenMP's default wait policy), hetero's engines as hetero runs
        env = library_default_env(env) if engine in BASELINES else passive_env(env)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 3:
            skipped[engine] = proc.stdout.strip() or proc.stderr.strip()
            continue
        if proc.returncode != 0:
            skipped[engine] = f"failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
            continue
        rows += [Row(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
    return rows, skipped


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=sorted(ENGINES))
    ap.add_argument("--lens", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model")
    a = ap.parse_args(argv)
    try:
        rows = run_worker(a.worker, a.model, [int(x) for x in a.lens.split(",")], a.repeats, a.threads)
    except EngineUnavailable as e:
        print(str(e))
        return 3
    print(json.dumps([asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    sys.exit(_worker_main(sys.argv[1:]))
