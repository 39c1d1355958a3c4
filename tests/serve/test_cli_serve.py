"""`hetero serve` from the command line: argument errors, and a real process that stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hetero.cli import main
from hetero.errors import ConfigError
from hetero.cli.serve import parse_bytes
from hetero.serve.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_parse_bytes() -> None:
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("2G") == 2 << 30 and parse_bytes("4096") == 4096
    assert parse_bytes("none") is None
    with pytest.raises(ConfigError, match="--kv-budget"):
        parse_bytes("lots")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--kv-budget", "lots"]) == 2
    assert "--kv-budget" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2


def test_a_busy_port_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """Before the model loads: no "serving ... on http://..." line, then uvicorn's bind error and exit 3."""
    import socket

    monkeypatch.setattr("hetero.loader.load_model", lambda *a: pytest.fail("loaded the model for a busy port"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in err


def test_exposure_warning_names_the_risk() -> None:
    from hetero.serve.server import exposure_warning

    assert exposure_warning("127.0.0.1", ()) is None and exposure_warning("localhost", ()) is None
    w = exposure_warning("0.0.0.0", ())
    assert "0.0.0.0" in w and "every machine" in w and "no --api-key" in w
    assert "TLS" in exposure_warning("192.168.1.5", ("k",))


def test_bad_api_key_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--api-key", "two words"]) == 2
    assert "--api-key" in capsys.readouterr().err


class ServeProcess:
    """`hetero serve` in a subprocess on a free port; `stop()` sends SIGTERM and returns its exit status."""

    def __init__(self, *args: str):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--method", "float", "--chunk", "32",
                                      "--reuse", "any", "--port", str(self.port), *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                assert self.http.get("/health").json()["status"] == "ok"
                return
            except httpx.TransportError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stdout.read()
                time.sleep(0.3)

    def stop(self) -> tuple[int, str]:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60), self.proc.stdout.read()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.mark.slow
def test_serve_process_answers_and_stops_on_sigterm() -> None:
    server = ServeProcess("--state-dir", "none")
    r = server.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.stop()[0] == 0


@pytest.mark.slow
def test_a_keyed_context_survives_a_restart(tmp_path: Path) -> None:
    """--api-key and --state-dir through the command line: 401 without the key; a context's next turn after a
    SIGTERM and a restart reuses its whole history (its K/V was saved at shutdown and restored at start)."""
    from openai import AuthenticationError, OpenAI

    auth = {"Authorization": "Bearer sesame"}
    server = ServeProcess("--api-key", "sesame", "--state-dir", str(tmp_path))
    try:
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0).models.list()
        cid = server.http.post("/v1/contexts", json={"system": "Be brief."}, headers=auth).json()["id"]
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sesame", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for q in ("Name a colour.", "Name a fruit."):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=5,
                                               extra_body={"context_id": cid})
        tokens = server.http.get(f"/v1/contexts/{cid}", headers=auth).json()["tokens"]
    finally:
        status, out = server.stop()
    assert status == 0 and "Traceback" not in out, out
    server = ServeProcess("--api-key", "sesame", "--state-dir", str(tmp_path))
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sesame", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a city."}],
                                           max_tokens=5, extra_body={"context_id": cid})
        assert r.usage.prompt_tokens_details.cached_tokens >= tokens - 1
    finally:
        assert server.stop()[0] == 0
