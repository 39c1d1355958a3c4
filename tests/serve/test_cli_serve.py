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


@pytest.mark.slow
def test_serve_process_answers_and_stops_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--method", "float", "--chunk", "32",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            while True:
                try:
                    assert http.get("/health").json()["status"] == "ok"
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                    time.sleep(0.3)
            r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
