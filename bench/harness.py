"""Prefill timing harness: each engine in its own process, rounds interleaved, medians of the rounds.

A worker process per engine (`python -m bench.harness --worker ENGINE`) keeps its peak RSS its own and
its thread settings from leaking into the next engine. All workers load first; then each round asks every
engine, in turn, for a warm-up and a timed prefill of the same token ids: a slow stretch of a shared machine
touches every engine alike. Round r times window r of the held-out text, a different prompt each round (the
warm-up reads window 0), so no engine's prefix cache can hit. The naive NPU engine's timed runs include graph preparation: preparing a graph
per prompt length *is* its cost (mllm-NPU §2.3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.conditions import peak_rss_mb
from bench.engines import ENGINES, PEERS, prepare
from bench.workers import EngineUnavailable, WorkerProcess, answer_pipe, worker_env
from hetero.methods import use_threads
from hetero.outliers.corpus import prompt_ids


BASELINES = ("torch_float", *PEERS)  # other engines (the rest are hetero's methods and its naive NPU path)
SETTLE_S = 0.2  # pause between two engines' runs: the last one's spinning threads go idle first


@dataclass(frozen=True, slots=True)
class Row:
    """One engine × prompt length, medians of `runs_ms` (one run per round)."""

    engine: str
    prompt_len: int
    tokens_per_s: float
    ttft_ms: float  # prefill + choosing the first token: the time to first token
    peak_rss_mb: float  # the engine's whole process, model included
    simulated: bool = False
    runs_ms: list[float] = field(default_factory=list)
    note: str = ""


def run_worker(engine: str, model_path: str | None, lens: list[int], threads: int,
               requests, reply: Callable[[dict], None]) -> None:
    """Serve one engine in this process: load, then per request {"n", "window"} an untimed warm-up prefill of
    n tokens (window 0: caches, pages and thread pools hot again after the other engines ran) and the timed
    prefill of the window, answered with {"ms", "rss_mb"}."""
    use_threads(threads)
    prefill = ENGINES[engine](model_path, threads, max(lens))
    prefill(prompt_ids(model_path, min(lens), 0))  # a first run: lazy set-up happens before any timing
    reply({"ready": True})
    for line in requests:
        req = json.loads(line)
        prefill(prompt_ids(model_path, req["n"], 0))  # warm-up
        ids = prompt_ids(model_path, req["n"], req["window"])
        t0 = time.perf_counter()
        prefill(ids)
        ms = (time.perf_counter() - t0) * 1e3
        reply({"ms": ms, "rss_mb": peak_rss_mb()})


def engine_env(engine: str, threads: int) -> dict[str, str]:
    """The environment of an engine's process (`workers.worker_env`): the other engines as their users run them."""
    return worker_env(threads, own=engine not in BASELINES)


def run_engines(engines: list[str], lens: list[int], repeats: int, threads: int, model_path: str | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[list[Row], dict[str, str]]:
    """Each engine in its own process, `repeats` interleaved rounds; returns rows and {engine: why skipped}."""
    skipped: dict[str, str] = {}
    workers: list[WorkerProcess] = []
    try:
        for engine in engines:  # one at a time: loading and warming up never overlaps another engine
            if progress:
                progress(engine)
            try:
                prepare(engine, model_path)  # peers' models are built (once, cached) outside the timed processes
            except EngineUnavailable as e:
                skipped[engine] = str(e)
                continue
            cmd = [sys.executable, "-m", "bench.harness", "--worker", engine, "--lens", ",".join(map(str, lens)),
                   "--threads", str(threads)] + (["--model", model_path] if model_path else [])
            w = WorkerProcess(engine, cmd, engine_env(engine, threads))
            got = w.ask()
            if "ready" in got:
                workers.append(w)
                continue
            skipped[engine] = got.get("unavailable") or got["failed"]
            w.close()
        runs: dict[tuple[str, int], list[float]] = {}
        rss: dict[str, float] = {}
        for r in range(repeats):
            order = workers[r % len(workers):] + workers[: r % len(workers)] if workers else []
            for n in lens:
                for w in order:
                    if w.engine in skipped:
                        continue
                    time.sleep(SETTLE_S)
                    got = w.ask({"n": n, "window": r + 1})
                    if "failed" in got:
                        skipped[w.engine] = got["failed"]
                        continue
                    runs.setdefault((w.engine, n), []).append(got["ms"])
                    rss[w.engine] = got["rss_mb"]
    finally:
        for w in workers:
            w.close()
    rows = []
    for engine in engines:
        for n in lens:
            times = runs.get((engine, n))
            if engine in skipped or not times:
                continue
            med = statistics.median(times)
            rows.append(Row(engine, n, round(n / (med / 1e3), 1), round(med, 2), round(rss[engine], 1), False,
                            [round(t, 2) for t in times]))
    return rows, skipped


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=sorted(ENGINES))
    ap.add_argument("--lens", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model")
    a = ap.parse_args(argv)

    reply = answer_pipe()
    try:
        run_worker(a.worker, a.model, [int(x) for x in a.lens.split(",")], a.threads, sys.stdin, reply)
    except EngineUnavailable as e:
        reply({"unavailable": str(e)})
        return 3
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
