"""The entry of every benchmark: `python bench/<name>.py ...`, `python -m hetero.bench <name> ...` and
`hetero bench <name> ...` run module `hetero.bench.<name>`, which defines `HELP`, `add_args(parser)` and
`run(args) -> int`; parse, run, one-line errors. Also the benchmarks' result files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hetero.errors import HeteroError
from hetero.paths import atomic_path
from hetero.threads import passive_openmp

# each a module of hetero.bench; `bench/<name>.py` is its script
BENCHMARKS = ("prefill", "prefill_parts", "accuracy", "sched", "graph_cache", "htp_accuracy", "memory", "decode",
              "decode_step", "decode_accuracy", "decode_int4_probe", "fused_step", "service", "startup", "window_layout",
              "attention_kernel")


def benchmark(name: str) -> ModuleType:
    """The module of benchmark `name` (imported on demand: some need an extra, `hetero[serve]`)."""
    if name not in BENCHMARKS:
        raise SystemExit(f"hetero.bench: no benchmark {name!r}; one of {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"hetero.bench.{name}")


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


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero.bench <name> [args]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(f"usage: python -m hetero.bench {{{','.join(BENCHMARKS)}}} [args]", file=sys.stderr)
        return 2
    return bench_main(argv[0], argv[1:])


def write_json_md(out_dir: Path, name: str, result: dict[str, Any], md: str) -> list[Path]:
    """`<name>.json` and `<name>.md` under `out_dir` (made if missing), each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    for path, text in zip(paths, (json.dumps(result, indent=1) + "\n", md)):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return paths
