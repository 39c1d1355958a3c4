"""`hetero run` as llama.cpp / transformers users expect: prompt from stdin (`-`) or a file (`-f`),
`--system`, `-n`, `-v` timing, `--version`; `hetero timeline` prints a readable summary."""

from __future__ import annotations

import io
import json
import sys

import pytest

from hetero.cli import main
from hetero.errors import ConfigError
from hetero.prompt import read_prompt


def test_read_prompt_sources(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("from a file\n")
    assert read_prompt(None, str(f)) == "from a file\n"
    assert read_prompt("-", stdin=io.BytesIO("from stdin é".encode())) == "from stdin é"
    assert read_prompt("plain") == "plain"
    with pytest.raises(ConfigError, match="not both"):
        read_prompt("x", str(f))
    with pytest.raises(ConfigError, match="no prompt"):
        read_prompt(None)
    with pytest.raises(ConfigError, match="cannot read the prompt file"):
        read_prompt(None, str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match=r"standard input is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_prompt("-", stdin=io.BytesIO(b"caf\xe9"))
    with pytest.raises(ConfigError, match="empty"):
        read_prompt("-", stdin=io.BytesIO(b"  \n"))


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hetero 0.")


def test_run_from_stdin_with_system_n_and_timing(default_model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"What is the capital of France?")))
    assert main(["run", "-", "--system", "You answer in one short sentence.", "-n", "12", "-v", "--method", "float",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "Paris" in out["text"] and out["new_tokens"] <= 12
    # in-process (argv given): no "imports", the process was not started for this command
    assert list(out["seconds"]) == ["load", "calibrate", "build", "prefill", "decode set-up", "decode"]
    assert out["decode_on"]["engine"] == "torch" and out["chunk"] == 256  # no --chunk: the method's C
    assert "hetero: time: load" in captured.err


def test_timeline_prints_a_readable_summary(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["timeline", "--prompt-len", "512", "--chunk", "256", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.stat().st_size > 0
    assert "simulated on profile snapdragon_8gen3_qwen1.5-1.8b, policy rank: 2 chunk(s) of C=256" in text
    assert "x the lower bound" in text and "critical" in text and "{" not in text  # not a Python dict
