"""`hetero run` decodes with hetero by default and reports decode speed and acceptance."""

from __future__ import annotations

import json

from hetero.cli import main


def test_run_json_reports_decode_and_acceptance(capsys) -> None:
    rc = main(["run", "Repeat exactly: red green blue red green blue", "--method", "float", "--chunk", "64",
               "--max-new-tokens", "3", "--speculate", "lookup", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["decoder"] == "hetero" and out["speculate"] == "lookup"
    assert 0 < out["new_tokens"] <= 3 and isinstance(out["decode_tokens_per_s"], float)  # speed: bench/decode.py
    assert 0.0 <= out["acceptance_rate"] <= 1.0 and out["text"]


def test_draft_without_a_draft_model_is_one_line_error(capsys) -> None:
    rc = main(["run", "Hi", "--method", "float", "--chunk", "16", "--max-new-tokens", "2", "--speculate", "draft"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--draft-model" in err and "Traceback" not in err


def test_bad_sampling_option_is_one_line_error(capsys) -> None:
    rc = main(["run", "Hi", "--method", "float", "--chunk", "16", "--top-p", "0"])
    assert rc == 2
    assert "top_p" in capsys.readouterr().err
