"""What the server shows about itself: the page at /, GET /health, GET /v1/stats, GET /metrics (Prometheus) and
GET /v1/prefill/last (the last prefill's timeline)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from hetero.serve.http.incoming import service_of
from hetero.serve.metrics import CONTENT_TYPE_LATEST

router = APIRouter()
PAGE_HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"}


def page_text() -> str:
    """The page (package data), read once per app (`create_app` keeps it in the app's state)."""
    return resources.files("hetero.serve").joinpath("page.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse)
async def index(request: Request) -> HTMLResponse:
    return HTMLResponse(request.app.state.page, headers=PAGE_HEADERS)


@router.get("/health")
async def health(request: Request) -> dict:
    service = service_of(request)
    return {"status": "ok", "model": service.model_name, **service.engine.load()}


@router.get("/v1/stats")
async def stats(request: Request) -> dict:
    return service_of(request).stats()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(service_of(request).metrics.text(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/prefill/last")
async def last_prefill(request: Request) -> dict:
    return service_of(request).last_prefill or {"tokens": 0, "nodes": [], "lanes": []}
