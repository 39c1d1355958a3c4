"""The demo's end-to-end time from a warm cache, beside llama.cpp in the same run (issue 28).

Each round runs, in their own processes, `hetero run PROMPT -n 8` and llama.cpp (llama-cpp-python) answering the
same chat question from the same GGUF on the same threads; a round's order alternates. Every hetero run reports its
phases (`hetero -v run --json`: imports, load, calibrate, build, prefill (the process's first: `hetero run` does no
warm-up prefill), decode set-up, decode); what the wall time has beyond them is the interpreter's start before its
clock starts, and the exit. Medians of the rounds, after one warm-up run
of each engine (the warm cache). Each round also times two processes that only import (started and ended as `hetero`
is): what hetero's default path imports now that its containers are numpy (`FLOORS["floor"]`: numpy, numba, ONNX
Runtime, its tokenizer, chat template and cache checks; no torch), a floor under hetero's wall time on this machine;
and what it imported before (`FLOORS["floor with torch"]`: torch, numba, ONNX Runtime; docs/design.md,
"The host plan, threads and process state", its start-up items). One more, untimed, run under `python -X importtime`
checks that the warm run indeed imports no torch (`imports_torch` in the result).

    python bench/startup.py --out bench/results       # writes startup.{json,md}
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
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.conditions import load_avg
from bench.entry import exit_reason, write_json_md
from hetero.errors import ConfigError

HELP = "a warm `hetero run` end to end, beside llama.cpp (issue 28)"
PROMPT = "What is the capital of France? Answer in one sentence."
NEW_TOKENS = 8
# processes that only import: what the default path imports (its kernels: numba, ONNX Runtime; its tokenizer and chat
# template: tokenizers, jinja2; its cache checks), and its heavy imports before its containers were numpy (issue 28)
FLOORS = {"floor": ("numpy", "numba", "onnxruntime", "tokenizers", "jinja2", "safetensors", "xxhash", "filelock"),
          "floor with torch": ("torch", "numba", "onnxruntime")}

_LLAMA = """
import sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[3]}], max_tokens=int(sys.argv[4]),
                                 temperature=0.0)
print(out["choices"][0]["message"]["content"].strip())
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5), after one warm-up of each engine")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=None, help="write startup.{json,md} into this folder")
    p.add_argument("--no-llama", action="store_true", help="time hetero alone (llama-cpp-python absent)")


def _timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise ConfigError(f"{cmd[0]} ... {exit_reason(done.returncode)}: {done.stderr.strip()[-400:]}")
    return wall, done.stdout


def hetero_run(threads: int) -> dict[str, Any]:
    wall, out = _timed([sys.executable, "-m", "hetero", "-v", "run", PROMPT, "-n", str(NEW_TOKENS), "--json",
                        "--threads", str(threads)])
    res = json.loads(out.strip().splitlines()[-1])
    phases = res.get("seconds", {})
    return {"wall_s": wall, "text": res["text"], "phases_s": phases,
            "start_imports_exit_s": max(0.0, wall - sum(phases.values()))}


def imports_torch(threads: int) -> bool:
    """Whether a warm `hetero run` imports torch (`python -X importtime` lists every module a process imports)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hetero", "run", PROMPT, "-n", str(NEW_TOKENS),
                           "--threads", str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"hetero run {exit_reason(done.returncode)}: {done.stderr.strip()[-400:]}")
    return any(ln.startswith("import time:") and ln.rsplit("|", 1)[-1].strip() == "torch"
               for ln in done.stderr.splitlines())


def llama_run(gguf: str, threads: int) -> dict[str, Any]:
    wall, out = _timed([sys.executable, "-c", _LLAMA, gguf, str(threads), PROMPT, str(NEW_TOKENS)])
    return {"wall_s": wall, "text": out.strip()}


def floor_run(imports: tuple[str, ...]) -> dict[str, Any]:
    # as the `hetero` command starts and ends: the cyclic GC off (`cli.start_up_done`; on, it doubles torch's import),
    # and no teardown of torch's and numba's state at exit (`cli._end_process`: ~0.35 s)
    wall, _ = _timed([sys.executable, "-c", f"import gc, os; gc.disable(); import {', '.join(imports)}; os._exit(0)"])
    return {"wall_s": wall, "text": ""}


def run(args: argparse.Namespace) -> int:
    from hetero.default_model import default_model_path
    from hetero.sched.measure import host_metadata

    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    if not args.no_llama:
        try:
            import llama_cpp  # noqa: F401  (only whether it is installed)
        except ImportError as e:
            raise ConfigError("llama.cpp is the reference here: pip install 'hetero[bench]' (or --no-llama)") from e
    gguf = str(default_model_path())
    load0 = load_avg()
    engines = {"hetero": lambda: hetero_run(args.threads)}
    if not args.no_llama:
        engines["llama.cpp"] = lambda: llama_run(gguf, args.threads)
    for name, imports in FLOORS.items():
        engines[name] = lambda imports=imports: floor_run(imports)
    for fn in engines.values():  # warm-up: the caches of both are warm from here on
        fn()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            runs[name].append(engines[name]())
    rows = []
    for name, rs in runs.items():
        row = {"engine": name, "wall_s": round(statistics.median(x["wall_s"] for x in rs), 3),
               "runs_s": [round(x["wall_s"], 3) for x in rs], "text": rs[-1]["text"]}
        if name == "hetero":
            keys = list(rs[-1]["phases_s"]) + ["start_imports_exit_s"]
            row["phases_s"] = {k: round(statistics.median(x["phases_s"].get(k, 0.0) if k != "start_imports_exit_s"
                                                          else x[k] for x in rs), 3) for k in keys}
        rows.append(row)
    result: dict[str, Any] = {"prompt": PROMPT, "new_tokens": NEW_TOKENS, "threads": args.threads,
                              "rounds": args.rounds, "host": host_metadata(), "cpu_flags": _isa_flags(),
                              "load_avg": [round(load0, 2), round(load_avg(), 2)], "rows": rows,
                              "imports_torch": imports_torch(args.threads)}
    result["floors"] = []
    for name, imports in FLOORS.items():
        floor = next(row for row in rows if row["engine"] == name)
        rows.remove(floor)
        result["floors"].append({"name": name, "imports": list(imports), "wall_s": floor["wall_s"],
                                 "runs_s": floor["runs_s"]})
    if len(rows) == 2:
        result["hetero_over_llama_cpp"] = round(rows[0]["wall_s"] / rows[1]["wall_s"], 2)
    md = render_md(result)
    print(md)
    if args.out is not None:
        write_json_md(args.out, "startup", result, md)
    return 0


def _isa_flags() -> list[str]:
    """The CPU flags that decide hetero's and its peers' kernels (VNNI, BF16, AMX)."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return [platform.machine()]
    want = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return [f for f in want if f in flags]


def _floor_what(imports: list[str]) -> str:
    return ("what hetero's default path imported before its containers were numpy" if "torch" in imports
            else "what hetero's default path imports, without torch")


def render_md(r: dict[str, Any]) -> str:
    lines = ["# A warm `hetero run` beside llama.cpp (issue 28)", "",
             f"`{r['prompt']}`, {r['new_tokens']} new tokens, {r['threads']} threads, median of {r['rounds']} rounds "
             f"(engines alternate). CPU: {r['host']['device']}; flags {', '.join(r['cpu_flags'])}; load "
             f"{r['load_avg'][0]} → {r['load_avg'][1]}.", "",
             "| engine | wall s | runs | answer |", "|---|---:|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['engine']} | {row['wall_s']:.2f} | {', '.join(f'{x:.2f}' for x in row['runs_s'])} | "
                     f"{row['text']} |")
    if "hetero_over_llama_cpp" in r:
        lines += ["", f"hetero / llama.cpp: **{r['hetero_over_llama_cpp']:.2f}×** the wall time."]
    if "imports_torch" in r:
        lines += ["", f"The warm `hetero run` {'imports' if r['imports_torch'] else 'does not import'} torch "
                  "(`python -X importtime`, one more run)."]
    for floor in r.get("floors", []):
        lines += ["", f"A process that only imports {', '.join(floor['imports'])} ({_floor_what(floor['imports'])}): "
                  f"{floor['wall_s']:.2f} s (median; runs {', '.join(f'{x:.2f}' for x in floor['runs_s'])})."]
    het = next(row for row in r["rows"] if row["engine"] == "hetero")
    lines += ["", "hetero's phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in het["phases_s"].items()), ""]
    return "\n".join(lines)
