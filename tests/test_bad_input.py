"""Each bad input gives one clear error naming the problem; the CLI exits 2 without a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from hetero.cli import main
from hetero.config import ModelConfig
from hetero.errors import ConfigError, ModelFormatError
from hetero.loader import load_model
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    return write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")


def test_empty_prompt(tiny_model) -> None:
    with pytest.raises(ConfigError, match="empty"):
        Runtime(tiny_model).prefill([])


def test_prompt_longer_than_context(tiny_model) -> None:
    with pytest.raises(ConfigError, match="exceeds the context length 512"):
        Runtime(tiny_model).prefill(torch.zeros(513, dtype=torch.long))


def test_continuation_past_context(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=64)
    r = rt.prefill(torch.zeros(500, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"\+500 cached"):
        rt.prefill(torch.zeros(13, dtype=torch.long), cache=r.cache)
    assert r.cache.length == 500


@pytest.mark.parametrize("bad", [[1, 2, 256], [-1], [3, 1000]])
def test_token_id_out_of_range(tiny_model, bad) -> None:
    with pytest.raises(ConfigError, match=r"out of range \[0, 256\)"):
        Runtime(tiny_model).prefill(bad)


def test_ids_wrong_type_or_shape(tiny_model) -> None:
    with pytest.raises(ConfigError, match="integers"):
        Runtime(tiny_model).prefill(torch.tensor([0.5, 1.0]))
    with pytest.raises(ConfigError, match="1-D"):
        Runtime(tiny_model).prefill(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("chunk", [0, -4])
def test_chunk_not_positive(tiny_model, chunk) -> None:
    with pytest.raises(ConfigError, match="chunk must be a positive integer"):
        Runtime(tiny_model, chunk=chunk)


def test_missing_path(tmp_path) -> None:
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_truncated_gguf(tiny_gguf) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        load_model(tiny_gguf)


def test_corrupt_gguf_magic(tiny_gguf) -> None:
    tiny_gguf.write_bytes(b"NOPE" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(tiny_gguf)


def test_corrupt_gguf_header(tiny_gguf) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and metadata counts become absurd
    tiny_gguf.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        load_model(tiny_gguf)


def test_unsupported_architecture_gguf(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(make_tiny_model(), tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt2'"):
        load_model(path)


def test_unsupported_architecture_hf(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt_neox'"):
        load_model(tmp_path)


def test_directory_without_model(tmp_path) -> None:
    with pytest.raises(ModelFormatError, match="not a Hugging Face model directory"):
        load_model(tmp_path)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ModelFormatError, match="n_layers must be > 0"):
        ModelConfig("llama", 0, 64, 4, 2, 128, 256, 512, 1e-5, 1e4)


# ------------------------------------------------------------------------------------------- CLI


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def test_cli_missing_model(tmp_path, capsys) -> None:
    code, err = run_cli(["run", "hi", "--model", str(tmp_path / "x.gguf")], capsys)
    assert code == 2 and "does not exist" in err


def test_cli_empty_prompt(capsys) -> None:
    code, err = run_cli(["run", "  "], capsys)
    assert code == 2 and "prompt is empty" in err


def test_cli_chunk_zero(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["run", "hi", "--chunk", "0"])
    assert e.value.code == 2 and "positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--chunk", "0"], "argument --chunk: expected a positive integer, got 0"),
    (["--threads", "0"], "argument --threads: expected a positive integer, got 0"),
    (["--method", "nope"], "argument --method: invalid choice: 'nope'"),
    (["--decode-form", "q4_0"], "argument --decode-form: invalid choice: 'q4_0'"),
])
def test_cli_usage_errors_are_one_line(args, says, capsys) -> None:
    """argparse's errors too: one line naming the argument and what it expected, not its usage block."""
    with pytest.raises(SystemExit) as e:
        main(["run", "hi", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def test_cli_decode_form_beside_the_hf_decoder(capsys) -> None:
    code, err = run_cli(["run", "hi", "--decoder", "hf", "--decode-form", "q4_1"], capsys)
    assert code == 2 and "--decode-form q4_1 is hetero's decoder's; --decoder hf decodes in float" in err


def test_cli_corrupt_gguf(tiny_gguf, capsys) -> None:
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:100])
    code, err = run_cli(["info", "--model", str(tiny_gguf)], capsys)
    assert code == 2 and "truncated or corrupt" in err


def test_cli_prompt_too_long(default_model, capsys) -> None:
    code, err = run_cli(["run", "word " * 9000, "--max-new-tokens", "1"], capsys)
    assert code == 2 and "exceeds the context length 8192" in err


@pytest.mark.parametrize("args, says", [
    (["calibrate", "--budget", "0.5", "--method", "hetero"], "searched method"),
    (["calibrate", "--method", "float"], "quantized method"),
])
def test_cli_calibrate_budget_needs_a_searched_method(args, says, capsys) -> None:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err


def test_cli_calibrate_budget_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["calibrate", "--budget", "-1"])
    assert e.value.code == 2 and "expected a positive number" in capsys.readouterr().err
