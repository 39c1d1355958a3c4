"""`Service`: hetero as a shared LLM service with persistent contexts (LLMS §2, API of Table 1).

A context (`create_context` → `chat` … → `delete_context`) keeps its messages and its K/V across calls;
a per-client limit bounds how many are active. Every request (a context's turn, a stateless chat or a
completion) first looks its token ids up in the prefix index (Pensieve §4.1), restores the matched K/V
and prefills only the rest; decoded tokens are written into the same cache, and the sequence is committed
back as blocks. By default (`StoreConfig.exact`) only K/V that a cold prefill computes bit for bit are reused,
so a reply does not depend on the cache's state: earlier prompts' rows, uncompressed (whole segments where the
prefill depends on the cut, `store.SEGMENT`); with exact=False every cached token is, and the next turn
re-prefills nothing of this one. The HTTP layer
(`hetero.serve.http`) is a thin shell over this class.

A request's prefill is one plan (`Runtime.prefill_steps`), stepped in slices by the engine. Context ids
are 128-bit random (`ctx-` + 32 hex digits): knowing one is the capability to use it. With a state folder,
contexts and their K/V are saved (`save_context`, and all of them at `close`) and restored at start
(`hetero.serve.persist`).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import ConfigError, HeteroError
from hetero.kv_cache import KVCache
from hetero.runtime import PrefillResult, Runtime
from hetero.schedule import Schedule
from hetero.serve import persist
from hetero.serve.disk import payload_kv, read_block
from hetero.serve.engine import Engine, Job, Sink
from hetero.serve.metrics import ServeMetrics
from hetero.serve.quant import dequantize
from hetero.serve.restore import CostModel, RestoreReport, restore
from hetero.serve.store import SEGMENT, ChunkStore, StoreConfig, cut_invariant, exact_end, exact_match, segment_cuts

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


log = logging.getLogger(__name__)


class Service:
    """Contexts, prefix reuse and the chunk KV store around one `Runtime` (and `hetero.decode`).

    state_dir: where contexts are saved and restored from (None: they live as long as the process);
    state_key: what their K/V is valid for (e.g. the model fingerprint and the method): saved contexts of
    another key are not restored.
    """

    def __init__(self, runtime: Runtime, store: StoreConfig | None = None, *, max_contexts_per_client: int = 8,
                 max_active: int = 4, max_queue: int = 16, model_name: str | None = None,
                 state_dir: Path | None = None, state_key: dict | None = None):
        if max_contexts_per_client <= 0:
            raise ConfigError(f"max_contexts_per_client must be > 0, got {max_contexts_per_client}")
        self.runtime = runtime
        self.model = runtime.model
        self.tokenizer = runtime.model.tokenizer
        self.model_name = model_name or runtime.model.name
        self.store = ChunkStore(store or StoreConfig())
        # exact reuse: the prefill segments of a runtime whose numbers depend on where a prompt is cut (`store.SEGMENT`)
        self.segment = SEGMENT if self.store.config.exact and not cut_invariant(runtime) else None
        self.cost = CostModel()
        self.max_contexts_per_client = max_contexts_per_client
        self.engine = Engine(max_active=max_active, max_queue=max_queue)
        self.metrics = ServeMetrics(self.engine.load)
        self._contexts: dict[str, Context] = {}
        self._lock = threading.Lock()
        self.requests = 0
        self.last_prefill: dict | None = None  # the timeline of the last prefill (`timeline_json`)
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.state_key = state_key or {"model": runtime.model.fingerprint}
        self._closed = False
        if self.state_dir is not None:
            self._restore_saved()
        self.metrics.publish_store(self.store.stats(), len(self._contexts))

    # --- contexts (LLMS Table 1: newLLMCtx / callLLM / delLLMCtx) -----------------------------
    def create_context(self, system: str | None = None, client: str = "default") -> str:
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"system must be a string or null, got {type(system).__name__}")
        with self._lock:
            held = sum(c.client == client for c in self._contexts.values())
            if held >= self.max_contexts_per_client:
                raise ContextLimit(f"client {client!r} holds {held} active contexts (limit "
                                   f"{self.max_contexts_per_client}): delete one first")
            cid = f"ctx-{secrets.token_hex(16)}"
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
            if self.state_dir is not None:
                persist.remove(self.state_dir, cid)
            return
            yield

        self.engine.submit(Job(release, lambda kind, payload: None, key=cid, bounded=False))

    def warm_up(self) -> float:
        """Pay the first-call costs before the first request does (as `hetero run` warms up before it times
        its prefill): a one-chunk prefill and a two-token decode, which builds the decode step's graphs.
        Touches neither the store nor the metrics; returns the seconds it took."""
        from hetero.decode import SamplingParams, generate

        rt, t0 = self.runtime, time.perf_counter()
        n = min(rt.chunk, rt.max_context - 4)
        ids = [t % rt.cfg.vocab for t in range(100, 100 + n)]
        generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=2))
        return time.perf_counter() - t0

    # --- persistence and flush (run on the engine thread: it owns the store) ------------------------
    def save_context(self, cid: str, client: str | None = None) -> dict:
        """Save one context (messages, ids, K/V) to the state folder now; returns what was saved."""
        if self.state_dir is None:
            raise ConfigError("this server has no state folder (--state-dir): contexts cannot be saved")
        ctx = self.context(cid, client)
        return self.engine.submit_control(lambda: self._save(ctx), key=cid)

    def _save(self, ctx: Context) -> dict:
        k, v = self._gather(ctx.path)
        persist.save(self.state_dir, self.state_key, persist.SavedContext(
            ctx.id, ctx.client, ctx.system, ctx.messages, ctx.ids, ctx.created, k, v))
        return {"id": ctx.id, "saved": True, "tokens": len(ctx.ids), "kv_tokens": 0 if k is None else int(k.shape[2])}

    def _gather(self, path: list) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The K/V of a context's blocks, in order, up to the first dropped one (a prefix of its ids)."""
        ks, vs = [], []
        for node in path:
            if node.k is not None:
                k, v = node.k, node.v
            elif node.qk is not None:
                k, v = dequantize(node.qk), dequantize(node.qv)
            elif node.disk is not None and node.disk.exists():
                k, v = payload_kv(read_block(node.disk)[0])
            else:
                break
            ks.append(k)
            vs.append(v)
        if not ks:
            return None, None
        return np.concatenate(ks, 2), np.concatenate(vs, 2)

    def _restore_saved(self) -> None:
        """Contexts saved by an earlier run with this state key: their blocks go into the store, held."""
        n = 0
        for saved in persist.load_all(self.state_dir, self.state_key):
            ctx = Context(saved.id, saved.client, saved.system, list(saved.messages), list(saved.ids),
                          created=saved.created)
            if saved.k is not None:
                cache = KVCache(self.runtime.cfg, max(1, saved.k.shape[2]), full_history=True)
                cache.write_span(0, saved.k, saved.v)
                ctx.path = self.store.commit(saved.ids, cache)
                self.store.hold(ctx.path)
                n += 1
            self._contexts[ctx.id] = ctx
        self.store.rebalance()
        if self._contexts:
            log.info("restored %d saved context(s), %d with their K/V", len(self._contexts), n)

    def save_all(self) -> int:
        """Save every context (at shutdown, on the calling thread once the engine has stopped)."""
        if self.state_dir is None:
            return 0
        for ctx in list(self._contexts.values()):
            self._save(ctx)
        return len(self._contexts)

    def flush(self) -> dict:
        """Drop the K/V of every block no running request pins (vLLM's prefix-cache reset): the prefix cache
        is empty afterwards, and contexts keep their ids (their next turn recomputes the K/V)."""
        def run() -> dict:
            before = self.store.stats()
            dropped = self.store.flush()
            self.metrics.flushes.inc()
            self.metrics.publish_store(self.store.stats(), len(self._contexts))
            return {"flushed": True, "blocks_dropped": dropped, "bytes_before": before["bytes"]}

        return self.engine.submit_control(run)

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
        estimate = max(1, len(self.encode_chat(ctx.messages + messages)) - len(ctx.ids))  # for SRPF admission

        def start(job: Job) -> Generator[None, None, None]:  # built when admitted: sees the previous turn
            if self._contexts.get(ctx.id) is not ctx:
                raise UnknownContext(f"context {ctx.id!r} was deleted before this request ran")
            convo = ctx.messages + messages
            ids = self.encode_chat(convo)

            def on_done(reply: Reply) -> None:
                ctx.messages = convo + [{"role": "assistant", "content": reply.text}]

            return self._turn(job, ctx, ids, params, on_done)

        return self.engine.submit(Job(start, self._counted(sink), key=ctx.id, remaining=estimate))

    def submit_completion(self, prompt: str | list[int], params: "SamplingParams", sink: Sink) -> Job:
        return self._submit(None, self.encode_text(prompt), params, sink, on_done=None)

    def _submit(self, ctx: Context | None, ids: list[int], params: "SamplingParams", sink: Sink,
                on_done: Callable[[Reply], None] | None) -> Job:
        self.runtime.check_ids(ids)
        return self.engine.submit(Job(lambda job: self._turn(job, ctx, ids, params, on_done), self._counted(sink),
                                      remaining=len(ids)))

    def _counted(self, sink: Sink) -> Sink:
        """`sink`, counting the requests that end in an error (by its class) in the metrics."""
        def counted(kind: str, payload: object) -> None:
            if kind == "error":
                self.metrics.requests.labels(type(payload).__name__).inc()
            sink(kind, payload)

        return counted

    def _turn(self, job: Job, ctx: Context | None, ids: list[int], params: "SamplingParams",
              on_done: Callable[[Reply], None] | None) -> Generator[None, None, None]:
        rt, store = self.runtime, self.store
        t_admit = time.perf_counter()
        self.runtime.check_ids(ids)
        budget = rt.max_context - len(ids)
        max_new = min(params.max_new_tokens, budget)
        match = store.match(ids, limit=len(ids) - 1)  # at least one token is prefilled: it gives the logits
        if store.config.exact:
            match = exact_match(match, self.segment)
        pinned = [n for n, _ in match.nodes()]
        store.pin(pinned)
        new = ids[match.n_tokens:]
        job.remaining = len(new)
        try:
            # every position of every layer: the prefix store may branch anywhere, and a branch at P needs a
            # windowed layer's positions P - W + 1..P - 1
            cache = rt.new_cache(min(rt.max_context, len(ids) + max_new + 1), full_history=True)
            # segments: a swapped block is read back, never recomputed (a recomputed span would cut other chunks)
            mode = "swap" if self.segment is not None else store.config.restore
            report: RestoreReport = yield from restore(store, rt, match, cache, self.cost, mode)
            t0 = time.perf_counter()
            # exact reuse: the prefill in segments at multiples of `store.SEGMENT`, as a cold prefill runs them
            cuts = segment_cuts(cache.length, len(new), self.segment)
            done_to = 0
            for cut in cuts:
                steps = rt.prefill_steps(new[done_to:cut], cache=cache,  # pauses only when someone waits (or this
                                         contended=lambda: self.engine.contended() or job.cancelled.is_set())  # job ends)
                while True:  # one plan, stepped: the engine runs other requests between its slices
                    try:
                        job.remaining = next(steps) + len(new) - cut
                    except StopIteration as done:
                        result: PrefillResult = done.value
                        break
                    yield
                done_to = cut
            job.remaining = 0
            prefill_ms = (time.perf_counter() - t0) * 1e3
            self.last_prefill = timeline_json(result, prefill_ms)
            tokens: list[int] = []
            pieces: list[str] = []
            t_first = t_last = None
            if max_new > 0:
                from hetero.decode import stream

                events = stream(rt, result, _with_max(params, max_new))
                try:
                    for ev in events:
                        now = time.perf_counter()
                        if t_first is None:
                            t_first = now
                        else:
                            self.metrics.itl.observe(now - t_last)
                        t_last = now
                        tokens.append(int(ev.token_id))  # a plain int: ids are JSON in saved contexts
                        pieces.append(ev.text)
                        job.sink("token", ev)
                        yield
                finally:
                    events.close()
            t_first = t_first or time.perf_counter()
            path = store.commit(ids + tokens, cache, exact_end(len(ids), self.segment) if store.config.exact else None)
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
        m = self.metrics
        m.prefix_queries.inc(len(ids))
        m.prefix_hits.inc(cached)
        m.prompt_tokens.inc(len(ids))
        m.prefill_tokens.inc(len(new))
        m.generation_tokens.inc(len(tokens))
        m.ttft.observe(t_first - job.submitted)
        m.prefill_tps.observe(len(new) / max(prefill_ms / 1e3, 1e-6))
        m.requests.labels("ok").inc()
        m.publish_store(store.stats(), len(self._contexts))
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
        """Stop the engine, save every context (with a state folder), remove the swap folder."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        try:
            n = self.save_all()
            if n:
                log.info("saved %d context(s) to %s", n, self.state_dir)
        finally:
            self.store.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timeline_json(result: PrefillResult, wall_ms: float) -> dict:
    """A prefill's schedule as plain data for the page: per subgraph its chunk, layer, kind, lane, start and
    end (ms from the prefill's start)."""
    s: Schedule | None = result.schedule
    nodes = []
    if s is not None:
        dag = s.dag
        for v in range(dag.n_nodes):
            chunk, layer, kind = dag.node_info(v)
            nodes.append([chunk, layer, kind, dag.lane_of(v), round(s.start_us[v] / 1e3, 3),
                          round(s.end_us[v] / 1e3, 3)])
    return {"tokens": result.n_tokens, "start": result.start, "chunks": len(result.chunk_ms),
            "wall_ms": round(wall_ms, 2), "tokens_per_s": round(result.n_tokens / max(wall_ms / 1e3, 1e-9), 1),
            "policy": s.policy if s is not None else None, "lanes": list(s.dag.lanes) if s is not None else [],
            "busy_ms": {k: round(b / 1e3, 2) for k, b in s.busy_us.items()} if s is not None else {},
            "nodes": nodes}


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
