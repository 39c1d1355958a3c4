"""OpenAI request bodies → hetero calls, and hetero replies → OpenAI response objects.

Only what hetero supports is accepted; anything else is a `ConfigError` naming the field (HTTP 400).
Extensions: `context_id` (a chat request appends to that context), `top_k`; usage carries a `hetero`
object (restore paths, recomputed tokens, time to first token).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hetero.decode import SamplingParams
from hetero.errors import ConfigError
from hetero.serve.service import Reply


def _number(body: dict, name: str, default: Any, kind: type) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    return value


def sampling_params(body: dict, default_max: int) -> SamplingParams:
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    n = _number(body, "n", 1, int)
    if n != 1:
        raise ConfigError(f"n must be 1 (one choice per request), got {n}")
    max_new = body.get("max_completion_tokens", body.get("max_tokens"))
    max_new = default_max if max_new is None else _number({"max_tokens": max_new}, "max_tokens", default_max, int)
    if max_new < 0:
        raise ConfigError(f"max_tokens must be >= 0, got {max_new}")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
    return SamplingParams(max_new_tokens=max_new, temperature=float(_number(body, "temperature", 0.0, float)),
                          top_p=float(_number(body, "top_p", 1.0, float)), top_k=_number(body, "top_k", 0, int),
                          seed=_number(body, "seed", None, int), stop=tuple(stop))


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), each a JSON boolean or absent."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ConfigError(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"stream_options must be an object like {{\"include_usage\": true}}, got {options!r}")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ConfigError(f"stream_options.include_usage must be true or false, got {usage!r}")
    return bool(stream), bool(usage)


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages[{i}] must be an object, got {m!r}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text", ""), str)
                   for p in content):
                raise ConfigError(f"messages[{i}].content: only text parts {{type: text, text: string}} are supported")
            content = "".join(p.get("text", "") for p in content)
        out.append({"role": m.get("role"), "content": content})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ConfigError("prompt must be a non-empty string or a non-empty list of token ids")


def usage(reply: Reply) -> dict:
    u = reply.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "hetero": {"recomputed_tokens": u.recomputed_tokens, "restore": u.restore, "restore_ms": u.restore_ms,
                       "prefill_ms": u.prefill_ms, "ttft_ms": u.ttft_ms, "queue_ms": u.queue_ms,
                       "context_id": reply.context_id}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_response(rid: str, model: str, reply: Reply) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                         "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage(reply), "context_id": reply.context_id}


def _chunk(rid: str, model: str, obj: str, choice: dict, use: dict | None) -> dict:
    """One server-sent event of a stream; the last one (`use` given) carries the usage and no choice."""
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        out["choices"], out["usage"] = [], use
    return out


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return _chunk(rid, model, "chat.completion.chunk", choice, use)


def completion_response(rid: str, model: str, reply: Reply) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage(reply)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return _chunk(rid, model, "text_completion", choice, use)


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
