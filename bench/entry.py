"""The entry of every benchmark: `python bench/<name>.py ...`, `python -m bench <name> ...` and
`hetero bench <name> ...` run module `bench.<name>`, which defines `HELP`, `add_args(parser)` and
`run(args) -> int`; parse, run, one-line errors. Also where the benchmarks write (`out_dir`) and the
environment of the processes they start (`child_env`).

`bench/` is the checkout's, not the installed package's: a wheel of hetero holds none of it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hetero.errors import HeteroError
from hetero.paths import atomic_path, cache_dir
from hetero.threads import passive_openmp

CHECKOUT = Path(__file__).resolve().parents[1]  # the source checkout that holds bench/ (and hetero/)

# each a module of bench; `python bench/<name>.py` runs it
BENCHMARKS = ("prefill", "prefill_parts", "accuracy", "sched", "graph_cache", "htp_accuracy", "memory", "decode",
              "decode_step", "decode_accuracy", "fused_step", "service", "startup", "window_layout", "determinism",
               "attention_kernel", "peer_accuracy", "synth_model", "scale", "gemv_forms")


def benchmark(name: str) -> ModuleType:
    """The module of benchmark `name` (imported on demand: some need an extra, `hetero[serve]`)."""
    if name not in BENCHMARKS:
        raise SystemExit(f"bench: no benchmark {name!r}; one of {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"bench.{name}")


def bench_main(name: str, argv: list[str] | None = None) -> int:
    """A benchmark's process: OpenMP's wait policy before torch loads (an entry point, `hetero.threads`), then
    the same arguments and run as `hetero bench <name>`."""
    passive_openmp()
    module = benchmark(name)
    parser = argparse.ArgumentParser(prog=name, description=module.HELP)
    module.add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(module.run(args) or 0)
    except HeteroError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


def script(path: str) -> int:
    """`python bench/<name>.py [args]`: the benchmark of that file, run as module `bench.<name>` (its
    `if __name__ == "__main__"` block puts the checkout on the path and calls this before its own imports)."""
    return bench_main(Path(path).stem, sys.argv[1:])


def main(argv: list[str] | None = None) -> int:
    """`python -m bench <name> [args]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(f"usage: python -m bench {{{','.join(BENCHMARKS)}}} [args]", file=sys.stderr)
        return 2
    return bench_main(argv[0], argv[1:])


def default_out() -> Path:
    """Where a benchmark writes when no `--out` is given: `<cache>/bench/` ($HETERO_CACHE or ~/.cache/hetero),
    never the committed `bench/results/`."""
    return cache_dir() / "bench"


def out_dir(out: str | os.PathLike | None) -> Path:
    """The folder a benchmark writes its result files to: `--out` where given, else `default_out()`."""
    return Path(out) if out else default_out()


def add_out_arg(p: argparse.ArgumentParser, files: str) -> None:
    """`--out DIR` for a benchmark that always writes `files`: default `<cache>/bench/`."""
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for {files} (default: <cache>/bench/; the committed results: --out bench/results)")


def wrote(paths: list[Path]) -> None:
    """Say where the result files went (stderr: stdout may be a result)."""
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)


def write_json_md(out_dir: Path, name: str, result: dict[str, Any], md: str) -> list[Path]:
    """`<name>.json` and `<name>.md` under `out_dir` (made if missing), each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    for path, text in zip(paths, (json.dumps(result, indent=1) + "\n", md)):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return paths


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the checkout first on PYTHONPATH: a process the benchmark starts
    (`python -m bench.harness`, `python -m hetero`) imports this checkout's bench and hetero from any folder."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def exit_reason(code: int) -> str:
    """How a child process ended, in words: a negative code is the signal that killed it (SIGKILL with no message of
    its own is most often the kernel's OOM killer: llama-3.2-3b's decode process, `dmesg`, docs/journal.md)."""
    if code >= 0:
        return f"failed (exit {code})"
    sig = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return f"was killed by {sig}" + (" (most often the kernel's OOM killer)" if sig == "SIGKILL" else "")
