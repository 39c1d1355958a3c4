"""The standalone entry of a benchmark module (`bench/<name>.py`): parse, run, one-line errors; its result files."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError
from hetero.paths import atomic_path


def bench_main(prog: str, description: str, add_args: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """`python bench/<prog>.py ...`: the same arguments and run as `hetero bench <prog>`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(run(args) or 0)
    except HeteroError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def write_json_md(out_dir: Path, name: str, result: dict[str, Any], md: str) -> list[Path]:
    """`<name>.json` and `<name>.md` under `out_dir` (made if missing), each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    for path, text in zip(paths, (json.dumps(result, indent=1) + "\n", md)):
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return paths
