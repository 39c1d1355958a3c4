"""The OpenAI-compatible HTTP front of `Service` (FastAPI + uvicorn), bound to 127.0.0.1 by default.

Routes: POST /v1/chat/completions, POST /v1/completions (both also as server-sent events with
`stream: true`), GET /v1/models, GET /health, GET /v1/stats, GET /metrics (Prometheus), the contexts of
LLMS's API under /v1/contexts (and POST /v1/contexts/{id}/save), POST /v1/cache/flush, GET
/v1/prefill/last (the last prefill's timeline) and the page at /. Errors are OpenAI-style JSON with a 4xx
status (429 + Retry-After when the queue is full, 404 `model_not_found` for a model this server does not
serve); a client that disconnects cancels its request, which frees the engine at its next step.
`hetero.serve.access` checks Host, Content-Type and the API key first.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from hetero.errors import ConfigError, HeteroError
from hetero.serve import openai_api as oa
from hetero.serve.access import OWNER, AccessMiddleware
from hetero.serve.engine import Job, QueueFull, ShuttingDown
from hetero.serve.metrics import CONTENT_TYPE_LATEST
from hetero.serve.service import ContextLimit, Reply, Service, UnknownContext

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}  # OpenAI's completion default is 16


class UnknownModel(HeteroError):
    """A request named a model this server does not serve (OpenAI: 404 `model_not_found`)."""


def _status(e: Exception) -> tuple[int, str]:
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
    status, kind = _status(e)
    headers = {"Retry-After": str(int(e.retry_after + 0.999))} if isinstance(e, QueueFull) else None
    param = "model" if isinstance(e, UnknownModel) else None
    kind_ = "invalid_request_error" if status in (400, 404) else kind
    return JSONResponse(oa.error_body(str(e) or type(e).__name__, kind_, code=kind, param=param), status_code=status,
                        headers=headers)


def client_of(request: Request, body: dict | None = None) -> str:
    """Who owns the contexts of this request: the API key when the server has keys (never a header the
    caller chooses), else the X-Client-Id header or `user` (trusted: without keys every local caller is)."""
    owner = request.scope.get(OWNER)
    if owner is not None:
        return owner
    name = request.headers.get("x-client-id") or (body or {}).get("user") or "default"
    if not isinstance(name, str) or len(name) > 128:
        raise ConfigError("client id (X-Client-Id header or `user`) must be a string of at most 128 characters")
    return name


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError("the request body must be valid JSON") from None
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    return body


def check_model(body: dict, model: str) -> None:
    """OpenAI answers 404 for a model it does not serve; so does hetero (a missing `model` means this one)."""
    name = body.get("model")
    if name is not None and name != model:
        raise UnknownModel(f"The model {name!r} does not exist: this server serves {model!r} (GET /v1/models)")


def create_app(service: Service, host: str = "127.0.0.1", api_keys: tuple[str, ...] = (),
               allow_hosts: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="hetero", description="OpenAI-compatible hetero service", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(AccessMiddleware, host=host, api_keys=api_keys, allow_hosts=allow_hosts)
    model = service.model_name
    page = resources.files("hetero.serve").joinpath("page.html").read_text(encoding="utf-8")

    @app.exception_handler(HeteroError)
    async def _hetero_error(request: Request, e: HeteroError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(ConfigError(str(e)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(e)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model, **service.engine.load()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "hetero"}]}

    @app.get("/v1/stats")
    async def stats() -> dict:
        return service.stats()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                                           "Content-Security-Policy": "default-src 'self'; "
                                           "script-src 'unsafe-inline'; style-src 'unsafe-inline'"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/prefill/last")
    async def last_prefill() -> dict:
        return service.last_prefill or {"tokens": 0, "nodes": [], "lanes": []}

    @app.post("/v1/cache/flush")
    async def flush() -> dict:
        return await asyncio.to_thread(service.flush)

    @app.post("/v1/contexts/{cid}/save")
    async def save_context(cid: str, request: Request) -> dict:
        client = client_of(request)
        return await asyncio.to_thread(service.save_context, cid, client)

    async def run(request: Request, submit: Callable, stream: bool, on_token: Callable, on_done: Callable,
                  on_error: Callable) -> object:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        job: Job = submit(lambda kind, payload: loop.call_soon_threadsafe(q.put_nowait, (kind, payload)))

        async def events() -> AsyncIterator[tuple[str, object]]:
            try:
                while True:
                    try:
                        kind, payload = await asyncio.wait_for(q.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                    yield kind, payload
                    if kind in ("done", "error"):
                        return
            finally:
                job.cancel()  # a no-op when it finished; frees the engine when the client left

        if stream:
            async def sse() -> AsyncIterator[str]:
                async for kind, payload in events():
                    if kind == "token":
                        piece = on_token(payload)
                    elif kind == "done":
                        piece = on_done(payload)
                    else:
                        piece = on_error(payload)
                    for obj in piece:
                        yield obj if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for kind, payload in events():
            if kind == "done":
                return payload
            if kind == "error":
                return error_response(payload)
        return JSONResponse(oa.error_body("client disconnected", "cancelled"), status_code=499)

    def sse_error(e: Exception) -> list:
        status, kind = _status(e)
        return [oa.error_body(str(e), kind, code=kind), "data: [DONE]\n\n"]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> object:
        body = await json_body(request)
        return await chat_request(request, body, body.get("context_id"))

    @app.post("/v1/contexts/{cid}/chat/completions")
    async def context_chat(cid: str, request: Request) -> object:
        return await chat_request(request, await json_body(request), cid)

    async def chat_request(request: Request, body: dict, cid: str | None) -> object:
        check_model(body, model)
        params = oa.sampling_params(body, DEFAULT_MAX_TOKENS["chat"])
        messages = oa.chat_messages(body)
        client = client_of(request, body) if cid is not None else None
        if cid is not None and not isinstance(cid, str):
            raise ConfigError(f"context_id must be a string, got {cid!r}")
        rid, (stream, include_usage) = oa.new_id("chatcmpl"), oa.stream_flags(body)
        first = [True]

        def on_token(ev: object) -> list:
            delta = {"content": ev.text}
            if first[0]:
                delta["role"], first[0] = "assistant", False
            return [oa.chat_chunk(rid, model, delta)] if ev.text or delta.get("role") else []

        def on_done(reply: Reply) -> list:
            out = [oa.chat_chunk(rid, model, {} if not first[0] else {"role": "assistant", "content": ""},
                                 reply.finish_reason)]
            if include_usage:
                out.append(oa.chat_chunk(rid, model, {}, use=oa.usage(reply)))
            return out + ["data: [DONE]\n\n"]

        result = await run(request, lambda sink: service.submit_chat(messages, params, sink, cid, client), stream,
                           on_token, on_done, sse_error)
        return oa.chat_response(rid, model, result) if isinstance(result, Reply) else result

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await json_body(request)
        check_model(body, model)
        params = oa.sampling_params(body, DEFAULT_MAX_TOKENS["completion"])
        prompt = oa.completion_prompt(body)
        rid, (stream, include_usage) = oa.new_id("cmpl"), oa.stream_flags(body)

        def on_done(reply: Reply) -> list:
            out = [oa.completion_chunk(rid, model, "", reply.finish_reason)]
            if include_usage:
                out.append(oa.completion_chunk(rid, model, "", use=oa.usage(reply)))
            return out + ["data: [DONE]\n\n"]

        result = await run(request, lambda sink: service.submit_completion(prompt, params, sink), stream,
                           lambda ev: [oa.completion_chunk(rid, model, ev.text)] if ev.text else [], on_done, sse_error)
        return oa.completion_response(rid, model, result) if isinstance(result, Reply) else result

    @app.post("/v1/contexts")
    async def create_context(request: Request) -> dict:
        body = await json_body(request)
        cid = service.create_context(body.get("system"), client_of(request, body))
        return context_json(service.context(cid))

    @app.get("/v1/contexts")
    async def list_contexts(request: Request) -> dict:
        return {"object": "list", "data": [context_json(c) for c in service.list_contexts(client_of(request))]}

    @app.get("/v1/contexts/{cid}")
    async def get_context(cid: str, request: Request) -> dict:
        return context_json(service.context(cid, client_of(request)))

    @app.delete("/v1/contexts/{cid}")
    async def delete_context(cid: str, request: Request) -> dict:
        service.delete_context(cid, client_of(request))
        return {"id": cid, "object": "context", "deleted": True}

    return app


def context_json(ctx: object) -> dict:
    return {"id": ctx.id, "object": "context", "client": ctx.client, "system": ctx.system, "created": int(ctx.created),
            "turns": sum(m["role"] == "assistant" for m in ctx.messages), "tokens": len(ctx.ids),
            "messages": ctx.messages}
