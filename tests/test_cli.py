"""`hetero info` and `hetero run` on real inputs (the bad-input paths are in test_bad_input.py)."""

from __future__ import annotations

import json
import re

from hetero.cli import main
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf


def test_info_json_lists_model_and_platform(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")
    assert main(["info", "--model", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["n_layers"] == 2 and out["config"]["arch"] == "llama"
    assert {"torch", "onnxruntime", "qnn_htp", "ort_providers"} <= set(out["platform"])
    assert out["placement"]["prefill"].startswith("prefill as layers: the NPU lane is this CPU's cores")
    assert out["calibration"]["in use"].startswith("computed at first use")  # no calibration ships for it
    assert "HETERO_CALIBRATION=user runs it" in out["calibration"]["user"]


def test_info_text_separates_every_name_from_its_value(tmp_path, monkeypatch, capsys) -> None:
    """`local_rope_theta`, longer than the others, ran into its value ("local_rope_theta0.0")."""
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")
    assert main(["info", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    for key in make_tiny_model().config.to_dict():
        assert re.search(rf"^  {key} +\S", text, flags=re.M), f"{key} runs into its value"
    assert re.search(r"^calibration\n  in use +computed at first use", text, flags=re.M)


def test_run_prints_the_answer_alone_on_stdout(default_model, capsys) -> None:
    """`hetero run ... > answer.txt` holds the answer alone: the stats line goes to stderr, not into the file."""
    assert main(["run", "Say hi.", "--method", "float", "--chunk", "64", "-n", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tokens/s" not in out
    assert "prompt tokens, first prefill" in err


def test_run_json_answers_paris_on_the_float_path(default_model, capsys) -> None:
    assert main(["run", "What is the capital of France?", "--method", "float", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"] and out["prompt_tokens"] > 0
    assert isinstance(out["prefill_tokens_per_s"], float)  # a number; speed itself is measured in bench/
    assert set(out) >= {"text", "prompt_tokens", "prefill_ms", "prefill_tokens_per_s", "decode_tokens_per_s"}


def test_run_on_the_default_hetero_path_uses_this_cpus_weight_form(default_model, capsys) -> None:
    """INT8 graphs + shadow outliers + out-of-order dispatch (first use calibrates, ~30 s, then cached).

    The answer's text is not asserted: float's first token is a near-tie ('The' 0.152 vs 'L' 0.140), so a
    greedy answer of the quantized path would pass or fail by luck; tests/test_accuracy.py checks the
    quantized top-1 where float is sure."""
    from hetero.npu.isa import default_weight_form

    assert main(["run", "What is the capital of France?", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "hetero" and out["weight_form"] == default_weight_form() and out["new_tokens"] > 0
