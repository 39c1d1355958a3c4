"""How the HTTP front answers an error: OpenAI-style JSON with its status (429 + Retry-After when the queue is
full, 404 `model_not_found` for a model this server does not serve), and the same as a server-sent event."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from hetero.errors import ConfigError, HeteroError
from hetero.serve import openai_api as oa
from hetero.serve.engine import QueueFull, ShuttingDown
from hetero.serve.service import ContextLimit, UnknownContext

log = logging.getLogger("hetero.serve.http")


class UnknownModel(HeteroError):
    """A request named a model this server does not serve (OpenAI: 404 `model_not_found`)."""


def status_of(e: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error code of an exception."""
    if isinstance(e, ShuttingDown):
        return 503, "server_shutting_down"
    if isinstance(e, UnknownModel):
        return 404, "model_not_found"
    if isinstance(e, QueueFull):
        return 429, "rate_limit_exceeded"
    if isinstance(e, UnknownContext):
        return 404, "not_found"
    if isinstance(e, ContextLimit):
        return 409, "context_limit"
    if isinstance(e, (ConfigError, ValueError)):
        return 400, "invalid_request_error"
    return 500, "server_error"


def error_response(e: Exception) -> JSONResponse:
    status, kind = status_of(e)
    headers = {"Retry-After": str(int(e.retry_after + 0.999))} if isinstance(e, QueueFull) else None
    param = "model" if isinstance(e, UnknownModel) else None
    kind_ = "invalid_request_error" if status in (400, 404) else kind
    return JSONResponse(oa.error_body(str(e) or type(e).__name__, kind_, code=kind, param=param), status_code=status,
                        headers=headers)


def sse_error(e: Exception) -> list:
    """A streamed reply's error: the error event, then the end of the stream."""
    status, kind = status_of(e)
    return [oa.error_body(str(e), kind, code=kind), "data: [DONE]\n\n"]


async def _hetero_error(request: Request, e: HeteroError) -> JSONResponse:
    return error_response(e)


async def _invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(ConfigError(str(e)))


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error")
    return error_response(e)


def add_error_handlers(app: FastAPI) -> None:
    """Every error a route raises becomes `error_response`: hetero's own, FastAPI's validation, the unexpected."""
    app.add_exception_handler(HeteroError, _hetero_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _unexpected)
