"""A real `hetero serve` on 127.0.0.1 (free port, in a thread) for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

import hetero
from hetero.serve import Service, StoreConfig
from hetero.serve.server import make_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, service: Service):
        self.service = service
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(service, self.port, grace_s=2.0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def openai(self, **kw: object) -> "object":
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, max_retries=0, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(default_model: hetero.Model) -> Iterator[RunningServer]:
    """The float runtime (exact reference) with small chunks: short test prompts pay for little padding."""
    service = Service(hetero.Runtime(default_model, chunk=32), StoreConfig(block=16), max_active=2, max_queue=2,
                      max_contexts_per_client=2)
    running = RunningServer(service)
    yield running
    running.stop()
