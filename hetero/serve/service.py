"""`Service`: hetero as a shared LLM service with persistent contexts (LLMS §2, API of Table 1).

A context (`create_context` → `chat` … → `delete_context`) keeps its messages and its K/V across calls;
a per-client limit bounds how many are active. Every request (a context's turn, a stateless chat or a
completion) first looks its token ids up in the prefix index (Pensieve §4.1), restores the matched K/V
and prefills only the rest; decoded tokens are written into the same cache, and the whole sequence is
committed back as blocks, so the next turn re-prefills nothing of this one. The HTTP layer
(`hetero.serve.http`) is a thin shell over this class.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetero.errors import ConfigError, HeteroError
from hetero.runtime import Runtime
from hetero.serve.engine import Engine, Job, Sink
from hetero.serve.restore import CostModel, RestoreReport, restore
from hetero.serve.store import ChunkStore, StoreConfig

if TYPE_CHECKING:
    from hetero.decode import SamplingParams, TokenEvent


class UnknownContext(HeteroError, KeyError):
    """No context with this id (never created, deleted, or of another client)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ContextLimit(HeteroError):
    """The client already holds its maximum number of active contexts."""


@dataclass
class Context:
    id: str
    client: str
    system: str | None
    messages: list[dict] = field(default_factory=list)  # the conversation so far, replies included
    ids: list[int] = field(default_factory=list)  # token ids so far (K/V of all but the last are kept)
    path: list = field(default_factory=list)  # its blocks in the store (held: never pruned)
    created: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the store without recomputation
    completion_tokens: int
    recomputed_tokens: int
    restore: dict  # restore path -> tokens (ram, compressed, disk, recompute)
    restore_ms: float
    prefill_ms: float
    ttft_ms: float  # from submission to the first token (or to the end of prefill if none)
    queue_ms: float


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    usage: Usage
    context_id: str | None


class Service:
    """Contexts, prefix reuse and the chunk KV store around one `Runtime` (and `hetero.decode`)."""

    def __init__(self, runtime: Runtime, store: StoreConfig | None = None, *, max_contexts_per_client: int = 8,
                 max_active: int = 4, max_queue: int = 16, model_name: str | None = None):
        if max_contexts_per_client <= 0:
            raise ConfigError(f"max_contexts_per_client must be > 0, got {max_contexts_per_client}")
        self.runtime = runtime
        self.model = runtime.model
        self.tokenizer = runtime.model.tokenizer
        self.model_name = model_name or runtime.model.name
        self.store = ChunkStore(store or StoreConfig())
        self.cost = CostModel()
        self.max_contexts_per_client = max_contexts_per_client
        self.engine = Engine(max_active=max_active, max_queue=max_queue)
        self._contexts: dict[str, Context] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.requests = 0

    # --- contexts (LLMS Table 1: newLLMCtx / callLLM / delLLMCtx) -----------------------------
    def create_context(self, system: str | None = None, client: str = "default") -> str:
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"system must be a string or null, got {type(system).__name__}")
        with self._lock:
            held = sum(c.client == client for c in self._contexts.values())
            if held >= self.max_contexts_per_client:
                raise ContextLimit(f"client {client!r} holds {held} active contexts (limit "
                                   f"{self.max_contexts_per_client}): delete one first")
            cid = f"ctx-{next(self._ids)}"
            ctx = Context(cid, client, system, [{"role": "system", "content": system}] if system else [])
            self._contexts[cid] = ctx
        return cid

    def context(self, cid: str, client: str | None = None) -> Context:
        with self._lock:
            ctx = self._contexts.get(cid)
        if ctx is None or (client is not None and ctx.client != client):
            raise UnknownContext(f"context {cid!r} does not exist (deleted, or never created)")
        return ctx

    def list_contexts(self, client: str | None = None) -> list[Context]:
        with self._lock:
            return [c for c in self._contexts.values() if client is None or c.client == client]

    def delete_context(self, cid: str, client: str | None = None) -> None:
        ctx = self.context(cid, client)
        with self._lock:
            self._contexts.pop(cid, None)

        def release(job: Job) -> Generator[None, None, None]:
            self.store.release(ctx.path)
            ctx.path = []
            return
            yield

        self.engine.submit(Job(release, lambda kind, payload: None, key=cid, bounded=False))

    # --- requests -------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this model has no tokenizer with a chat template: use completions with token ids")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer: give the prompt as a list of token ids")
        return list(self.tokenizer(prompt)["input_ids"])

    def submit_chat(self, messages: list[dict], params: "SamplingParams", sink: Sink, context_id: str | None = None,
                    client: str | None = None) -> Job:
        """Append `messages` to a context (or run them stateless) and generate; events go to `sink`."""
        _check_messages(messages)
        if context_id is None:
            ids = self.encode_chat(messages)
            return self._submit(None, ids, params, sink, on_done=None)
        ctx = self.context(context_id, client)

        def start(job: Job) -> Generator[None, None, None]:  # built when admitted: sees the previous turn
            if self._contexts.get(ctx.id) is not ctx:
                raise UnknownContext(f"context {ctx.id!r} was deleted before this request ran")
            convo = ctx.messages + messages
            ids = self.encode_chat(convo)

            def on_done(reply: Reply) -> None:
                ctx.messages = convo + [{"role": "assistant", "content": reply.text}]

            return self._turn(job, ctx, ids, params, on_done)

        return self.engine.submit(Job(start, sink, key=ctx.id))

    def submit_completion(self, prompt: str | list[int], params: "SamplingParams", sink: Sink) -> Job:
        return self._submit(None, self.encode_text(prompt), params, sink, on_done=None)

    def _submit(self, ctx: Context | None, ids: list[int], params: "SamplingParams", sink: Sink,
                on_done: Callable[[Reply], None] | None) -> Job:
        self.runtime.check_ids(ids)
        return self.engine.submit(Job(lambda job: self._turn(job, ctx, ids, params, on_done), sink))

    def _turn(self, job: Job, ctx: Context | None, ids: list[int], params: "SamplingParams",
              on_done: Callable[[Reply], None] | None) -> Generator[None, None, None]:
        rt, store = self.runtime, self.store
        t_admit = time.perf_counter()
        self.runtime.check_ids(ids)
        budget = rt.max_context - len(ids)
        max_new = min(params.max_new_tokens, budget)
        match = store.match(ids, limit=len(ids) - 1)  # at least one token is prefilled: it gives the logits
        pinned = [n for n, _ in match.nodes()]
        store.pin(pinned)
        try:
            cache = rt.new_cache(min(rt.max_context, len(ids) + max_new + 1))
            report: RestoreReport = yield from restore(store, rt, match, cache, self.cost, store.config.restore)
            t0 = time.perf_counter()
            new = ids[match.n_tokens:]
            for a in range(0, len(new), rt.chunk):
                result = rt.prefill(new[a : a + rt.chunk], cache=cache)
                yield
            prefill_ms = (time.perf_counter() - t0) * 1e3
            tokens: list[int] = []
            pieces: list[str] = []
            t_first = None
            if max_new > 0:
                from hetero.decode import stream

                events = stream(rt, result, _with_max(params, max_new))
                try:
                    for ev in events:
                        if t_first is None:
                            t_first = time.perf_counter()
                        tokens.append(ev.token_id)
                        pieces.append(ev.text)
                        job.sink("token", ev)
                        yield
                finally:
                    events.close()
            t_first = t_first or time.perf_counter()
            path = store.commit(ids + tokens, cache)
            store.hold(path)
            if ctx is not None:
                store.release(ctx.path)
                ctx.path, ctx.ids = path, ids + tokens
            else:
                store.release(path)  # a stateless request keeps its prefix only as an unheld cache entry
        finally:
            store.pin(pinned, -1)
        store.rebalance()
        self.requests += 1
        cached = match.n_tokens - report.tokens["recompute"]
        store.counts["requests"] += 1
        store.counts["hits"] += cached > 0
        store.counts["cached_tokens"] += cached
        store.counts["prefilled_tokens"] += len(new)
        finish = "length" if len(tokens) >= max_new else "stop"
        usage = Usage(len(ids), cached, len(tokens), report.tokens["recompute"], dict(report.tokens),
                      round(report.ms, 2), round(prefill_ms, 2), round((t_first - job.submitted) * 1e3, 2),
                      round((t_admit - job.submitted) * 1e3, 2))
        reply = Reply("".join(pieces), tuple(tokens), finish, usage, ctx.id if ctx else None)
        if on_done is not None:
            on_done(reply)
        job.sink("done", reply)

    # --- blocking convenience API (Python, no HTTP) ---------------------------------------------
    def chat(self, messages: list[dict] | str, params: "SamplingParams | None" = None,
             context_id: str | None = None) -> Reply:
        return _last(self.chat_stream(messages, params, context_id))

    def chat_stream(self, messages: list[dict] | str, params: "SamplingParams | None" = None,
                    context_id: str | None = None) -> Iterator["TokenEvent | Reply"]:
        """Token events, then the `Reply`."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        q: queue.Queue = queue.Queue()
        job = self.submit_chat(messages, _params(params), lambda k, p: q.put((k, p)), context_id)
        return _drain(q, job)

    def complete(self, prompt: str | list[int], params: "SamplingParams | None" = None) -> Reply:
        q: queue.Queue = queue.Queue()
        job = self.submit_completion(prompt, _params(params), lambda k, p: q.put((k, p)))
        return _last(_drain(q, job))

    def stats(self) -> dict:
        out = self.store.stats()
        out["engine"] = self.engine.load()
        out["contexts"] = len(self._contexts)
        out["cost_model"] = {"recompute_ms_per_token": round(self.cost.recompute_ms_per_token, 3),
                             "io_ms_per_mb": round(self.cost.io_ms_per_mb, 3)}
        return out

    def close(self) -> None:
        self.engine.close()
        self.store.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _params(params: "SamplingParams | None") -> "SamplingParams":
    from hetero.decode import SamplingParams

    return SamplingParams() if params is None else params


def _with_max(params: "SamplingParams", max_new: int) -> "SamplingParams":
    import dataclasses

    return params if params.max_new_tokens == max_new else dataclasses.replace(params, max_new_tokens=max_new)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}] must be {{role: system|user|assistant, content: string}}, got {m!r}")


def _drain(q: queue.Queue, job: Job) -> Iterator[object]:
    try:
        while True:
            kind, payload = q.get()
            if kind == "error":
                raise payload
            yield payload
            if kind == "done":
                return
    finally:
        job.cancel()


def _last(events: Iterator[object]) -> Reply:
    out = None
    for out in events:
        pass
    return out
