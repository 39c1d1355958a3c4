"""One generation request answered over HTTP: the engine's events for the job, as one JSON reply or as
server-sent events; a client that disconnects cancels the job, which frees the engine at its next step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetero.serve import openai_api as oa
from hetero.serve.engine import Job
from hetero.serve.http.errors import error_response, sse_error

POLL_S = 0.5  # how often a waiting reply checks that its client is still connected


class Chunks(Protocol):
    """A streamed reply's pieces: the events (dicts, sent as `data:` lines) or raw lines of a token and of the end."""

    def token(self, event: object) -> list: ...

    def done(self, reply: object) -> list: ...


async def respond(request: Request, submit: Callable, stream: bool, chunks: Chunks) -> object:
    """Submit the job (`submit(sink)`) and answer: a `StreamingResponse` of `chunks` when streaming, else the
    finished `Reply` (an error response when it failed, 499 when the client left)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    job: Job = submit(lambda kind, payload: loop.call_soon_threadsafe(q.put_nowait, (kind, payload)))
    events = _events(request, q, job)
    if stream:
        return StreamingResponse(_sse(events, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for kind, payload in events:
        if kind == "done":
            return payload
        if kind == "error":
            return error_response(payload)
    return JSONResponse(oa.error_body("client disconnected", "cancelled"), status_code=499)


async def _events(request: Request, q: asyncio.Queue, job: Job) -> AsyncIterator[tuple[str, object]]:
    """The job's events up to its end, or until the client disconnects."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(q.get(), timeout=POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield kind, payload
            if kind in ("done", "error"):
                return
    finally:
        job.cancel()  # a no-op when it finished; frees the engine when the client left


async def _sse(events: AsyncIterator[tuple[str, object]], chunks: Chunks) -> AsyncIterator[str]:
    async for kind, payload in events:
        piece = chunks.token(payload) if kind == "token" else chunks.done(payload) if kind == "done" \
            else sse_error(payload)
        for obj in piece:
            yield obj if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n"
