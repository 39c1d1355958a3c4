"""The OpenAI API: POST /v1/chat/completions (also on a context: /v1/contexts/{id}/chat/completions),
POST /v1/completions, both also as server-sent events with `stream: true`, and GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hetero.errors import ConfigError
from hetero.serve import openai_api as oa
from hetero.serve.http.errors import UnknownModel
from hetero.serve.http.incoming import client_of, json_body, service_of
from hetero.serve.http.stream import respond
from hetero.serve.service import Reply

DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}  # OpenAI's completion default is 16

router = APIRouter()


def check_model(body: dict, model: str) -> None:
    """OpenAI answers 404 for a model it does not serve; so does hetero (a missing `model` means this one)."""
    name = body.get("model")
    if name is not None and name != model:
        raise UnknownModel(f"The model {name!r} does not exist: this server serves {model!r} (GET /v1/models)")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    model = service_of(request).model_name
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "hetero"}]}


class ChatChunks:
    """A streamed chat reply's chunks: the first names the assistant's role; the last the finish reason, then
    the usage where asked, then [DONE]."""

    def __init__(self, rid: str, model: str, include_usage: bool):
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.first = True

    def token(self, ev: object) -> list:
        delta = {"content": ev.text}
        if self.first:
            delta["role"], self.first = "assistant", False
        return [oa.chat_chunk(self.rid, self.model, delta)] if ev.text or delta.get("role") else []

    def done(self, reply: Reply) -> list:
        out = [oa.chat_chunk(self.rid, self.model, {} if not self.first else {"role": "assistant", "content": ""},
                             reply.finish_reason)]
        if self.include_usage:
            out.append(oa.chat_chunk(self.rid, self.model, {}, use=oa.usage(reply)))
        return out + ["data: [DONE]\n\n"]


class CompletionChunks:
    """A streamed completion's chunks: one per token with text; the finish reason, the usage where asked, [DONE]."""

    def __init__(self, rid: str, model: str, include_usage: bool):
        self.rid, self.model, self.include_usage = rid, model, include_usage

    def token(self, ev: object) -> list:
        return [oa.completion_chunk(self.rid, self.model, ev.text)] if ev.text else []

    def done(self, reply: Reply) -> list:
        out = [oa.completion_chunk(self.rid, self.model, "", reply.finish_reason)]
        if self.include_usage:
            out.append(oa.completion_chunk(self.rid, self.model, "", use=oa.usage(reply)))
        return out + ["data: [DONE]\n\n"]


@router.post("/v1/chat/completions")
async def chat(request: Request) -> object:
    body = await json_body(request)
    return await chat_request(request, body, body.get("context_id"))


@router.post("/v1/contexts/{cid}/chat/completions")
async def context_chat(cid: str, request: Request) -> object:
    return await chat_request(request, await json_body(request), cid)


async def chat_request(request: Request, body: dict, cid: str | None) -> object:
    """A chat completion, on context `cid` where given (its messages continue the context's)."""
    service = service_of(request)
    model = service.model_name
    check_model(body, model)
    params = oa.sampling_params(body, DEFAULT_MAX_TOKENS["chat"])
    messages = oa.chat_messages(body)
    client = client_of(request, body) if cid is not None else None
    if cid is not None and not isinstance(cid, str):
        raise ConfigError(f"context_id must be a string, got {cid!r}")
    rid, (stream, include_usage) = oa.new_id("chatcmpl"), oa.stream_flags(body)
    result = await respond(request, lambda sink: service.submit_chat(messages, params, sink, cid, client), stream,
                           ChatChunks(rid, model, include_usage))
    return oa.chat_response(rid, model, result) if isinstance(result, Reply) else result


@router.post("/v1/completions")
async def completions(request: Request) -> object:
    service = service_of(request)
    model = service.model_name
    body = await json_body(request)
    check_model(body, model)
    params = oa.sampling_params(body, DEFAULT_MAX_TOKENS["completion"])
    prompt = oa.completion_prompt(body)
    rid, (stream, include_usage) = oa.new_id("cmpl"), oa.stream_flags(body)
    result = await respond(request, lambda sink: service.submit_completion(prompt, params, sink), stream,
                           CompletionChunks(rid, model, include_usage))
    return oa.completion_response(rid, model, result) if isinstance(result, Reply) else result
