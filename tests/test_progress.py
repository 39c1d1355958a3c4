"""Set-up's progress bars (`hetero.progress`): drawn on a terminal's stderr only, never under `--json`."""

from __future__ import annotations

import io

import numpy as np

from hetero import progress
from hetero.tensorfile import LazyTensors


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_draw_on_a_terminal_only_and_never_under_json(monkeypatch, tmp_path, capsys) -> None:
    from hetero.cli import main

    monkeypatch.setattr(progress, "_quiet", False)  # an earlier in-process `--json` command leaves the process quiet
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not progress.shown()  # a pipe or a log: nothing drawn, tqdm not imported for it
    assert isinstance(progress.bar(3, "step"), progress._Hidden)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    b = progress.bar(4 << 20, "pack decode weights", "B")
    b.update(2 << 20)
    b.refresh()  # (a bar draws once its step has run for a second)
    b.close()
    assert "pack decode weights" in term.getvalue() and "2.00M/4.00M" in term.getvalue()
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    try:
        assert main(["cache", "verify", "--json"]) == 0
        assert not progress.shown() and isinstance(progress.bar(3, "step"), progress._Hidden)
        assert main(["cache", "verify"]) == 0
        assert progress.shown()
    finally:
        progress.quiet(False)


def test_tensors_made_count_their_bytes_on_the_bar(monkeypatch) -> None:
    counted: list[float] = []

    class Bar(progress._Hidden):
        def update(self, n: float = 1) -> None:
            counted.append(n)

    def bar(total: float, desc: str, unit: str = "it", enabled: bool = True) -> Bar:
        counted.append((total, desc, unit))
        return Bar()

    monkeypatch.setattr(progress, "bar", bar)
    shapes = {"a": (256, 1024), "b": (3,)}
    lazy = LazyTensors(shapes, lambda put: [put(name, np.ones(shape, np.float32)) for name, shape in shapes.items()],
                       what="rotate")
    assert lazy.arrays()["a"].sum() == 256 * 1024
    assert counted == [(4 * (256 * 1024 + 3), "rotate", "B"), 1 << 20, 12]
