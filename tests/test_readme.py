"""README matches the code: every `hetero ...` command it shows parses; the folder tables of README and
docs/design.md match the tree."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hetero.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("hetero ")]


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command: str) -> None:
    argv = shlex.split(command)[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on an unknown command or option
        pytest.fail(f"README command does not parse: {command!r} (exit {e.code})")


def test_readme_shows_commands() -> None:
    assert len(readme_commands()) >= 10


def folder_table(text: str) -> set[str]:
    """The paths in the first column of the `| folder | owns |` table."""
    table = text[text.index("| folder | owns |"):]
    rows = table.split("\n\n")[0]
    return set(re.findall(r"^\| `([^`]+)` ", rows, flags=re.M))


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_folder_table_matches_the_tree(doc: str) -> None:
    listed = folder_table((ROOT / doc).read_text())
    missing = sorted(p for p in listed if not (ROOT / p).exists())
    assert not missing, f"{doc} lists paths that do not exist: {missing}"
    packages = {f"hetero/{p.name}/" for p in (ROOT / "hetero").iterdir()
                if p.is_dir() and (p / "__init__.py").exists() and p.name != "data"}
    unlisted = sorted(packages - listed)
    assert not unlisted, f"{doc}'s folder table misses the packages {unlisted}"
