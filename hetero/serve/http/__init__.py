"""The OpenAI-compatible HTTP front of `Service` (FastAPI + uvicorn), bound to 127.0.0.1 by default.

`create_app` assembles it by concern: `hetero.serve.access` checks Host, Content-Type and the API key first;
`http.completions` is the OpenAI API (POST /v1/chat/completions, POST /v1/completions, both also as server-sent
events with `stream: true`, GET /v1/models), answered through `http.stream`; `http.contexts` the contexts of
LLMS's API under /v1/contexts (and POST /v1/contexts/{id}/save) and POST /v1/cache/flush; `http.status` the
page at /, GET /health, GET /v1/stats, GET /metrics (Prometheus) and GET /v1/prefill/last (the last prefill's
timeline). Errors are OpenAI-style JSON with a 4xx status (`http.errors`: 429 + Retry-After when the queue is
full, 404 `model_not_found` for a model this server does not serve); a client that disconnects cancels its
request, which frees the engine at its next step.
"""

from __future__ import annotations

from fastapi import FastAPI

from hetero.serve.access import AccessMiddleware
from hetero.serve.http import completions, contexts, status
from hetero.serve.http.errors import add_error_handlers
from hetero.serve.service import Service

__all__ = ["create_app"]


def create_app(service: Service, host: str = "127.0.0.1", api_keys: tuple[str, ...] = (),
               allow_hosts: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="hetero", description="OpenAI-compatible hetero service", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service  # what every route serves (`incoming.service_of`)
    app.state.page = status.page_text()
    app.add_middleware(AccessMiddleware, host=host, api_keys=api_keys, allow_hosts=allow_hosts)
    add_error_handlers(app)
    for concern in (status, completions, contexts):
        app.include_router(concern.router)
    return app
