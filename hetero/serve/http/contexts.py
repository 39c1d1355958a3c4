"""The contexts of LLMS's API, each its client's: POST/GET /v1/contexts, GET/DELETE /v1/contexts/{id},
POST /v1/contexts/{id}/save (to disk now); and POST /v1/cache/flush (the prefix cache emptied)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from hetero.serve.http.incoming import client_of, json_body, service_of

router = APIRouter()


def context_json(ctx: object) -> dict:
    return {"id": ctx.id, "object": "context", "client": ctx.client, "system": ctx.system, "created": int(ctx.created),
            "turns": sum(m["role"] == "assistant" for m in ctx.messages), "tokens": len(ctx.ids),
            "messages": ctx.messages}


@router.post("/v1/contexts")
async def create_context(request: Request) -> dict:
    service = service_of(request)
    body = await json_body(request)
    cid = service.create_context(body.get("system"), client_of(request, body))
    return context_json(service.context(cid))


@router.get("/v1/contexts")
async def list_contexts(request: Request) -> dict:
    return {"object": "list", "data": [context_json(c) for c in service_of(request).list_contexts(client_of(request))]}


@router.get("/v1/contexts/{cid}")
async def get_context(cid: str, request: Request) -> dict:
    return context_json(service_of(request).context(cid, client_of(request)))


@router.delete("/v1/contexts/{cid}")
async def delete_context(cid: str, request: Request) -> dict:
    service_of(request).delete_context(cid, client_of(request))
    return {"id": cid, "object": "context", "deleted": True}


@router.post("/v1/contexts/{cid}/save")
async def save_context(cid: str, request: Request) -> dict:
    client = client_of(request)
    return await asyncio.to_thread(service_of(request).save_context, cid, client)


@router.post("/v1/cache/flush")
async def flush(request: Request) -> dict:
    return await asyncio.to_thread(service_of(request).flush)
