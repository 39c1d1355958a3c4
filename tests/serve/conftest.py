"""A real `hetero serve` on 127.0.0.1 (free port, in a thread) for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import hetero
from hetero.serve import Service, StoreConfig
from hetero.serve.server import BackgroundServer, free_port


class RunningServer(BackgroundServer):
    def __init__(self, service: Service, api_keys: tuple[str, ...] = ()):
        super().__init__(service, free_port(), api_keys=api_keys)

    @property
    def model(self) -> str:
        return self.service.model_name

    def openai(self, **kw: object) -> "object":
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", **{"api_key": "unused", "timeout": 120, "max_retries": 0, **kw})

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)


@pytest.fixture(scope="module")
def server(default_model: hetero.Model) -> Iterator[RunningServer]:
    """The float runtime (exact reference) with small chunks: short test prompts pay for little padding; every cached
    token reused (`exact=False`: these tests count what earlier turns leave for later ones)."""
    service = Service(hetero.Runtime(default_model, chunk=32), StoreConfig(block=16, exact=False), max_active=2, max_queue=2,
                      max_contexts_per_client=2)
    running = RunningServer(service)
    yield running
    running.stop()
