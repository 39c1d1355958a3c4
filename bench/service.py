"""`hetero serve` under a multi-turn chat workload (issue 12; LLMS + Pensieve), through the `openai` client.

1. Sequential (the reuse ratio): one client, turn-major over `--ratio-conversations` conversations (turn 1 of
   each, then turn 2 of each, ...), each request sent to a re-prefill-everything server and to a reuse
   server back to back (the order alternates), so both see the same load and the same conversations.
   Each turn is a passage of about `--turn-chars` characters and a question (stateless chat: the whole
   history each turn, as the openai client sends it; the history holds the reuse server's replies).
   Then the same conversations, same order, on a reuse server whose budget holds `--budgets` of the K/V
   (lossless tiers: its replies must equal the all-fit ones). TTFT per turn at the client (first
   streamed token) and at the server (admission to first token, from the reply's usage).
2. Concurrent (throughput, memory): `--conversations` conversations on `--clients` threads at once,
   all-fit then each budget (optionally INT8/INT4 compressed), and re-prefill on `--baseline-conversations`.
3. Context-switch latency by restore path (in RAM, compressed, swap-in, recompute, pipelined).
4. Accuracy cost of KV compression: teacher-forced top-1 agreement and perplexity on held-out text.
5. RSS of a `hetero serve` subprocess over `--rss-requests` requests from 8 concurrent clients.
6. Cold TTFT (`ttft`): a cold `--ttft-tokens` prompt's time to first token at the server vs `hetero run`'s
   prefill of the same prompt (a subprocess per repeat, as a user runs it), same method and C, interleaved.

Every phase runs `--method` (default: the default method, at C = 256 as it ships; float at C = 64, the
exact reference).

    python bench/service.py --out bench/results                  # the default method: service.{json,md}
    python bench/service.py --out bench/results --method float   # service_float.{json,md}
    python bench/service.py --quick           # a few minutes: 2 + 4 conversations, phases 1 and 2: <cache>/bench/
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import hetero
from bench.entry import add_out_arg, child_env, out_dir
from hetero.paths import atomic_path
from hetero.serve import Service, StoreConfig
from hetero.serve.server import BackgroundServer, free_port
from hetero.threads import set_torch_threads

HELP = "`hetero serve` under a multi-turn chat workload: reuse vs re-prefill, K/V budgets, restore paths, RSS"
DATA = Path(hetero.__file__).resolve().parent / "data"
QUESTION = "In a few words, what is this passage about?"


def passages(chars: int) -> list[str]:
    """Consecutive paragraphs of both shipped texts joined until about `chars` characters (cut at a word)."""
    out = []
    for name in ("austen_emma.txt", "sotu_2016_2021.txt"):
        buf = ""
        for para in (DATA / name).read_text().split("\n\n"):
            buf = f"{buf} {' '.join(para.split())}".strip()
            if len(buf) >= chars:
                out.append(buf[:chars].rsplit(" ", 1)[0])
                buf = ""
    return out


def conversations(n: int, turns: int, chars: int) -> list[list[str]]:
    """n conversations x `turns` user messages, no passage used twice while the texts last."""
    ps = passages(chars)
    return [[f"Passage:\n{ps[(c * turns + t) % len(ps)]}\n\n{QUESTION}" for t in range(turns)] for c in range(n)]


_RUNTIMES: dict[tuple, hetero.Runtime] = {}


def runtime_of(model: hetero.Model, args: argparse.Namespace) -> hetero.Runtime:
    """The method's runtime, built once and shared by the endpoints (they run one after another)."""
    from hetero.methods import make_runtime

    key = (model.fingerprint, args.method, args.chunk, args.threads)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = make_runtime(model, args.method, chunk=args.chunk, threads=args.threads)
    return _RUNTIMES[key]


class Endpoint:
    """A `Service` with a given store behind a real HTTP server in this process, and an `openai` client."""

    def __init__(self, model: hetero.Model, store: StoreConfig, args: argparse.Namespace, clients: int = 1):
        from openai import OpenAI

        self.service = Service(runtime_of(model, args), store, max_active=clients, max_queue=4 * clients)
        self.server = BackgroundServer(self.service, free_port())
        self.client = OpenAI(base_url=self.server.url + "/v1", api_key="unused", timeout=1800, max_retries=0)
        self.turn([{"role": "user", "content": "Hello."}], 2)  # warm-up: first-call costs out of turn 1

    def turn(self, messages: list[dict], max_tokens: int) -> dict:
        """One streamed chat request: TTFT at the client and the server's own account from the usage."""
        t0 = time.perf_counter()
        ttft, pieces, usage = None, [], None
        for chunk in self.client.chat.completions.create(model=self.service.model_name, messages=messages,
                                                         max_tokens=max_tokens,
                                                         stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        h = usage.model_extra.get("hetero", {}) if usage.model_extra else {}
        return {"ttft_ms": round((ttft or time.perf_counter() - t0) * 1e3, 1),
                "server_ttft_ms": round(h["ttft_ms"] - h["queue_ms"], 1), "queue_ms": h["queue_ms"],
                "restore_ms": h["restore_ms"], "prefill_ms": h["prefill_ms"], "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "recomputed_tokens": h["recomputed_tokens"], "restore": h["restore"], "reply": "".join(pieces)}

    def close(self) -> dict:
        stats = self.service.stats()
        self.server.stop()
        return stats


def first_messages(cid: int) -> list[dict]:
    return [{"role": "system", "content": f"You are reading assistant {cid}. Answer briefly."}]


def sequential(model: hetero.Model, convs: list[list[str]], args: argparse.Namespace) -> dict:
    """Phase 1: the reuse ratio, one request at a time, re-prefill and reuse paired on every turn."""
    turns = len(convs[0])
    out: dict = {"load_before": os.getloadavg()}
    pair = {"reprefill": Endpoint(model, StoreConfig(reuse=False, disk=False), args),
            "reuse_all_fit": Endpoint(model, StoreConfig(), args)}
    records: dict[str, list[dict]] = {name: [] for name in pair}
    history = [first_messages(c) for c in range(len(convs))]
    t0 = time.perf_counter()
    try:
        for t in range(turns):
            for c, conv in enumerate(convs):
                history[c].append({"role": "user", "content": conv[t]})
                order = list(pair) if (t * len(convs) + c) % 2 == 0 else list(reversed(pair))
                for name in order:
                    r = pair[name].turn(history[c], args.max_tokens)
                    records[name].append({"conversation": c, "turn": t + 1, **r})
                history[c].append({"role": "assistant", "content": records["reuse_all_fit"][-1]["reply"]})
        stats = {name: ep.close() for name, ep in pair.items()}
    finally:
        for ep in pair.values():
            ep.server.stop()
    out["paired_wall_s"] = round(time.perf_counter() - t0, 1)
    need = sum(stats["reuse_all_fit"]["bytes"][k] for k in ("ram_float", "ram_compressed"))
    out["kv_bytes_all_fit"] = need
    for frac in [float(f) for f in args.budgets.split(",") if f]:
        name = f"reuse_{frac:g}_lossless"
        ep = Endpoint(model, StoreConfig(budget_bytes=int(need * frac), compress="off"), args)
        records[name] = []
        try:
            for t in range(turns):
                for c in range(len(convs)):
                    msgs = history[c][: 2 + 2 * t]  # system, then t user/assistant pairs and this turn's user
                    records[name].append({"conversation": c, "turn": t + 1, **ep.turn(msgs, args.max_tokens)})
            stats[name] = ep.close()
        finally:
            ep.server.stop()
    out["load_after"] = os.getloadavg()
    out["configs"] = {name: summarize(rs, stats[name], records["reuse_all_fit"]) for name, rs in records.items()}
    out["ratio"] = ratios(records["reprefill"], records["reuse_all_fit"], turns)
    out["turns"] = records
    return out


def concurrent(model: hetero.Model, convs: list[list[str]], args: argparse.Namespace) -> dict:
    """Phase 2: `--clients` conversations at once (each its own thread), per config; throughput and equality."""
    def run(store: StoreConfig, cs: list[list[str]]) -> tuple[list[dict], dict, float]:
        ep = Endpoint(model, store, args, clients=args.clients)

        def one(c: int) -> list[dict]:
            msgs, out = first_messages(c), []
            for t, text in enumerate(cs[c]):
                msgs.append({"role": "user", "content": text})
                r = ep.turn(msgs, args.max_tokens)
                out.append({"conversation": c, "turn": t + 1, **r})
                msgs.append({"role": "assistant", "content": r["reply"]})
            return out

        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(args.clients) as pool:
                rs = [r for rec in pool.map(one, range(len(cs))) for r in rec]
            return rs, ep.close(), round(time.perf_counter() - t0, 1)
        finally:
            ep.server.stop()

    out: dict = {"load_before": os.getloadavg()}
    runs = {"reuse_all_fit": run(StoreConfig(), convs)}
    need = sum(runs["reuse_all_fit"][1]["bytes"][k] for k in ("ram_float", "ram_compressed"))
    out["kv_bytes_all_fit"] = need
    for frac in [float(f) for f in args.budgets.split(",") if f]:
        runs[f"reuse_{frac:g}_lossless"] = run(StoreConfig(budget_bytes=int(need * frac), compress="off"), convs)
    if args.compressed_run:
        runs["reuse_0.1_compressed"] = run(StoreConfig(budget_bytes=int(need * 0.1), compress="auto",
                                                       tolerance=args.tolerance), convs)
    if args.baseline_conversations:
        runs["reprefill"] = run(StoreConfig(reuse=False, disk=False), convs[: args.baseline_conversations])
    out["load_after"] = os.getloadavg()
    base = runs["reuse_all_fit"][0]
    out["configs"] = {name: {**summarize(rs, stats, base), "wall_s": wall,
                             "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in rs) / wall, 1)}
                      for name, (rs, stats, wall) in runs.items()}
    out["turns"] = {name: rs for name, (rs, _, _) in runs.items()}
    return out


def per_turn(records: list[dict], key: str) -> list[float]:
    n = max(r["turn"] for r in records)
    return [round(statistics.median(r[key] for r in records if r["turn"] == k), 1) for k in range(1, n + 1)]


def summarize(records: list[dict], stats: dict, base: list[dict]) -> dict:
    """Medians per turn, replies equal to `base`'s (same conversation and turn), the store's counters."""
    ref = {(r["conversation"], r["turn"]): r["reply"] for r in base}
    for r in records:
        r["new_tokens"] = r["prompt_tokens"] - r["cached_tokens"]
        # the server's TTFT less restore and prefill: prefix lookup, cache allocation, the first token
        r["other_ms"] = round(r["server_ttft_ms"] - r["restore_ms"] - r["prefill_ms"], 1)
        # the client's TTFT less the server's: HTTP, chat template and tokenization, the engine's queue
        r["outside_ms"] = round(r["ttft_ms"] - r["server_ttft_ms"], 1)
    keys = ("ttft_ms", "server_ttft_ms", "queue_ms", "restore_ms", "prefill_ms", "other_ms", "outside_ms",
            "prompt_tokens", "cached_tokens", "new_tokens")
    return {key: per_turn(records, key) for key in keys} | {
        "conversations": len({r["conversation"] for r in records}), "replies": len(records),
        "replies_equal_all_fit": sum(r["reply"] == ref.get((r["conversation"], r["turn"])) for r in records),
        "counts": stats["counts"], "bytes": stats["bytes"], "compression_ratio": stats["compression_ratio"]}


def ratios(reprefill: list[dict], reuse: list[dict], turns: int) -> dict:
    """Re-prefill / reuse TTFT on the last turn: ratio of the medians and the median of paired ratios."""
    out = {}
    for key in ("ttft_ms", "server_ttft_ms"):
        a = {r["conversation"]: r[key] for r in reprefill if r["turn"] == turns}
        b = {r["conversation"]: r[key] for r in reuse if r["turn"] == turns}
        out[key] = {"ratio_of_medians": round(statistics.median(a.values()) / statistics.median(b.values()), 2),
                    "median_paired": round(statistics.median(a[c] / b[c] for c in a), 2),
                    "min_paired": round(min(a[c] / b[c] for c in a), 2)}
    return out


def restore_paths(model: hetero.Model, text_ids: list[int], args: argparse.Namespace) -> dict:
    """Median ms to restore one context of `len(text_ids)` tokens through each path."""
    from hetero.serve.restore import CostModel, restore
    from hetero.serve.store import ChunkStore

    rt = runtime_of(model, args)
    ids = text_ids[: args.switch_tokens]
    out, cost = {}, CostModel()
    for path in ("ram", "compressed", "swap", "recompute", "pipelined"):
        compress = "auto" if path == "compressed" else "off"
        budget = None if path == "ram" else 0
        store = ChunkStore(StoreConfig(budget_bytes=budget, compress=compress, reserve=0.0,
                                       tolerance=float("inf"), disk=path != "compressed"))
        cache = rt.new_cache(len(ids) + 1, full_history=True)  # as the service's: its store reads every position
        rt.prefill(ids, cache=cache)
        path_nodes = store.commit(ids, cache)
        store.hold(path_nodes)
        if path == "compressed":
            store.config = StoreConfig(budget_bytes=sum(n.ram_bytes() for n in path_nodes) // 5, compress="auto",
                                       reserve=0.0, tolerance=float("inf"), disk=False)
        store.rebalance()
        mode = {"swap": "swap", "recompute": "recompute"}.get(path, "auto")
        times = []
        for _ in range(args.repeats):
            match = store.match(ids + [0])
            target = rt.new_cache(len(ids) + 1, full_history=True)
            gen = restore(store, rt, match, target, cost, mode)
            t0 = time.perf_counter()
            try:
                while True:
                    next(gen)
            except StopIteration as stop:
                report = stop.value
            times.append((time.perf_counter() - t0) * 1e3)
        out[path] = {"ms": round(statistics.median(times), 1), "tokens": dict(report.tokens),
                     "tiers": store.stats()["blocks"]}
        store.close()
    out["cost_model"] = {"recompute_ms_per_token": round(cost.recompute_ms_per_token, 3),
                         "io_ms_per_mb": round(cost.io_ms_per_mb, 3)}
    return out


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of each token, from float32 logits [vocab] (in float64: a measurement)."""
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _torch_threads() -> int | None:
    """torch's thread count in this process, or None when nothing here has loaded torch (the default method)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_num_threads()


def compression_accuracy(model: hetero.Model, text_ids: list[int], args: argparse.Namespace) -> dict:
    """Teacher-forced next tokens after a prefix whose K/V blocks are stored at each level."""
    from hetero.serve.quant import compress, dequantize

    rt = hetero.Runtime(model, chunk=args.chunk)
    step = hetero.Runtime(model, chunk=1)
    prefix, cont = text_ids[: args.eval_prefix], text_ids[args.eval_prefix : args.eval_prefix + args.eval_tokens]
    base = rt.new_cache(len(prefix) + len(cont) + 1, full_history=True)
    rt.prefill(prefix, cache=base)
    results, ref_top = {}, None
    for level, tol in (("float", None), ("int8", 0.0), ("auto", args.tolerance), ("int4", float("inf"))):
        cache = rt.new_cache(base.capacity, full_history=True)
        k, v = base.read_span(0, len(prefix))
        errors, levels = [], []
        for a in range(0, len(prefix), 16):
            kb, vb = k[:, :, a : a + 16], v[:, :, a : a + 16]
            if tol is not None:
                qk, qv, err = compress(kb, vb, tol)
                kb, vb = dequantize(qk), dequantize(qv)
                errors.append(err)
                levels.append(qk.level)
            cache.write_span(a, kb, vb)
        nll, top = 0.0, []
        cache.truncate(len(prefix) - 1)  # re-run the last prefix token to get its logits over this cache
        logits = step.prefill(prefix[-1:], cache=cache).logits
        for tok in cont:
            nll -= _log_softmax(logits)[tok]
            top.append(int(logits.argmax()))
            logits = step.prefill([tok], cache=cache).logits
        ref_top = ref_top or top
        results[level] = {"ppl": round(math.exp(nll / len(cont)), 3),
                          "top1_agreement_vs_float": round(sum(a == b for a, b in zip(top, ref_top)) / len(top), 4),
                          "int4_blocks": levels.count("int4"), "int8_blocks": levels.count("int8"),
                          "mean_attention_error": round(statistics.fmean(errors), 5) if errors else 0.0}
    return results


def exactness(model: hetero.Model, text_ids: list[int], args: argparse.Namespace) -> dict:
    """Logits of a prefill that reuses a cached prefix vs prefilling everything, per backend.

    Reuse at a multiple of C keeps every chunk on the from-scratch grid (same rows, same key lengths);
    elsewhere the chunks move, attention sums in another order and the logits differ by rounding.
    """
    from hetero.methods import make_runtime

    out = {}
    ids = text_ids[: 3 * args.chunk + 17]
    for backend in ("float", "hetero"):
        rt = make_runtime(model, backend, chunk=args.chunk)
        scratch = rt.prefill(ids).logits
        for name, cut in (("aligned", 2 * args.chunk), ("unaligned", 2 * args.chunk - 23)):
            cache = rt.new_cache(len(ids) + 1, full_history=True)  # the service's caches
            rt.prefill(ids[:cut], cache=cache)
            reuse = rt.prefill(ids[cut:], cache=cache).logits
            out[f"{backend}_{name}"] = {
                "reused_tokens": cut, "bitwise_equal": bool(np.array_equal(reuse, scratch)),
                "max_abs_diff": float(np.abs(reuse - scratch).max()),
                "rel_l2": float(np.linalg.norm(reuse - scratch) / np.linalg.norm(scratch)),
                "same_top1": int(reuse.argmax()) == int(scratch.argmax())}
        rt.close()
    return out


def rss_run(args: argparse.Namespace, convs: list[list[str]]) -> dict:
    """A `hetero serve` subprocess; 8 clients send short chats; RSS after warm-up vs at the end."""
    import psutil
    from openai import OpenAI

    port = free_port()
    env = child_env()
    cmd = [sys.executable, "-m", "hetero", "serve", "--method", args.method, "--chunk", str(args.chunk), "--port",
           str(port), "--kv-budget", "8M", "--max-active", "8", "--max-queue", "64", "--state-dir", "none"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc.stdout.readline()  # "hetero: serving ..."
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=20)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        served = client.models.list().data[0].id
        ps = psutil.Process(proc.pid)
        lock, done, samples = threading.Lock(), [0], []
        texts = [t[:200] for c in convs for t in c]

        def one(i: int) -> None:
            msgs = [{"role": "user", "content": texts[i % len(texts)]}]
            client.chat.completions.create(model=served, messages=msgs, max_tokens=4)
            with lock:
                done[0] += 1
                if done[0] % 10 == 0:
                    samples.append((done[0], ps.memory_info().rss))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(args.rss_requests)))
        warm = [s for n, s in samples if n == args.rss_warmup][0]
        end = samples[-1][1]
        return {"requests": args.rss_requests, "clients": 8, "warmup_requests": args.rss_warmup,
                "rss_after_warmup_mb": round(warm / 2**20, 1), "rss_end_mb": round(end / 2**20, 1),
                "growth_pct": round(100 * (end - warm) / warm, 2),
                "samples_mb": [(n, round(s / 2**20, 1)) for n, s in samples]}
    finally:
        proc.terminate()  # SIGTERM: the clean shutdown path
        proc.wait(60)


def prompt_of_tokens(model: hetero.Model, text: str, n: int) -> str:
    """The longest prefix of `text` (cut at a word) that the tokenizer makes at most `n` tokens (raw, as
    `hetero run --raw` and a completion request encode it)."""
    words = text.split()
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(model.tokenizer(" ".join(words[:mid]))["input_ids"]) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def cold_ttft(model: hetero.Model, args: argparse.Namespace) -> dict:
    """Phase 6: a cold prompt's TTFT at the server vs `hetero run`'s prefill (same method, C and prompt).

    The server (in this process, its engine thread) gets a warm-up chat first (as `hetero run` warms up
    with one chunk), then one distinct prompt per repeat as a completion with max_tokens 1, its prefix cache
    flushed first (cold: not even a shared first token is reused); its TTFT is the reply's own account
    (submission to first token: prefill, lm_head, first token), and the client's (HTTP and tokenization
    included). `hetero run --raw -n 1 --json` runs beside each server request, before it on even repeats and
    after it on odd ones, so both see the same load."""
    from openai import OpenAI

    ps = passages(args.ttft_tokens * 6)
    prompts = [prompt_of_tokens(model, ps[i], args.ttft_tokens) for i in range(args.repeats)]
    ep = Endpoint(model, StoreConfig(), args)
    client = OpenAI(base_url=ep.server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    env = child_env()
    rows = []
    try:
        for i, prompt in enumerate(prompts):
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(prompt)
            cmd = [sys.executable, "-m", "hetero", "run", "--raw", "-f", f.name, "-n", "1", "--json", "--method",
                   args.method, "--chunk", str(args.chunk)] + (["--threads", str(args.threads)] if args.threads else [])

            def hetero_run() -> dict:
                return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)

            run = hetero_run() if i % 2 == 0 else None
            ep.service.flush()
            t0 = time.perf_counter()
            r = client.completions.create(model=ep.service.model_name, prompt=prompt, max_tokens=1)
            client_ms = (time.perf_counter() - t0) * 1e3
            run = run or hetero_run()
            os.unlink(f.name)
            h = r.usage.model_extra["hetero"]
            assert r.usage.prompt_tokens == run["prompt_tokens"] and r.usage.prompt_tokens_details.cached_tokens == 0
            rows.append({"prompt_tokens": r.usage.prompt_tokens, "run_prefill_ms": run["prefill_ms"],
                         "server_ttft_ms": h["ttft_ms"], "server_prefill_ms": h["prefill_ms"],
                         "server_queue_ms": h["queue_ms"], "client_ms": round(client_ms, 1)})
            print("ttft:", json.dumps(rows[-1]), flush=True)
    finally:
        ep.close()
        ep.server.stop()
    med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0] if k != "prompt_tokens"}
    paired = statistics.median(r["server_ttft_ms"] / r["run_prefill_ms"] for r in rows)
    return {"method": args.method, "chunk": args.chunk, "prompt_tokens": rows[0]["prompt_tokens"], "rows": rows,
            "median": med, "server_ttft_over_run_prefill": round(med["server_ttft_ms"] / med["run_prefill_ms"], 3),
            "paired_median_ratio": round(paired, 3), "cpu": _cpu()}


def _cpu() -> str:
    """The CPU model and the ISA flags that matter for INT8 (lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    return f"{name} ({', '.join(f for f in ('avx512_vnni', 'avx512_bf16', 'amx_tile') if f in flags) or 'no VNNI/AMX'})"


def ttft_tables(configs: dict, n: int) -> list[str]:
    """Per config: client and server TTFT per turn (medians, ms), tokens of the last turn, equal replies."""
    head = " | ".join(f"turn {k}" for k in range(1, n + 1))
    lines = [f"| config | side | {head} | prefilled / cached tokens, turn {n} | replies equal to all-fit | wall s |",
             "|---|---|" + "---:|" * (n + 3)]
    for name, v in configs.items():
        for side, key in (("client", "ttft_ms"), ("server", "server_ttft_ms")):
            tail = (f" | {v['new_tokens'][-1]:.0f} / {v['cached_tokens'][-1]:.0f} | {v['replies_equal_all_fit']}/"
                    f"{v['replies']} | {v.get('wall_s', '')} |") if side == "client" else " | | | |"
            lines.append(f"| {name} | {side} | " + " | ".join(f"{x:.0f}" for x in v[key]) + tail)
    lines += ["", "| config | swap-ins | recomputed blocks | compressed int8/int4 | compression ratio | AoT writes |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, v in configs.items():
        c = v["counts"]
        lines.append(f"| {name} | {c.get('swap_in_blocks', 0)} | {c.get('recomputed_blocks', 0)} | "
                     f"{c.get('compressed_int8', 0)}/{c.get('compressed_int4', 0)} | {v['compression_ratio']} | "
                     f"{c.get('aot_writes', 0)} |")
    return lines + [""]


def write_md(r: dict, path: Path) -> None:
    """The committed summary table of a run (`--md-only` rewrites it from the JSON)."""
    a = r["args"]
    lines = ["# `hetero serve`: multi-turn chat workload (bench/service.py)", "",
             f"Model {r.get('model')}, method {a.get('method', 'float')}"
             f"{' (the exact reference)' if a.get('method', 'float') == 'float' else ''}, C={a.get('chunk')}, "
             f"{a.get('turns')} turns "
             f"per conversation, each a passage of ~{a.get('turn_chars')} characters and a question; "
             f"{a.get('max_tokens')} tokens a reply, through the `openai` client (streaming). "
             + (f"torch threads {r['torch_threads']}" if r.get("torch_threads") is not None else
                f"threads {a.get('threads') if a.get('threads') not in (None, 'None') else 'default'} "
                "(torch not loaded)")
             + f" on {r.get('cpus')} CPUs. Load average (1/5/15 min) before/after: "
             f"{_load(r.get('load_before'))} / {_load(r.get('load_after'))}. Client TTFT: request sent to first "
             "streamed token; server TTFT: admission by the engine to first token (the reply's usage).", "",
             f"Command: `{r.get('command', 'python bench/service.py')}`", ""]
    if "sequential" in r:
        q = r["sequential"]
        n = int(a.get("turns"))
        rc, rs = q["ratio"]["ttft_ms"], q["ratio"]["server_ttft_ms"]
        lines += [f"## Reuse vs re-prefilling everything: one request at a time ({a.get('ratio_conversations')} "
                  "conversations, turn-major, each request sent to both servers back to back)", "",
                  f"Load before/after: {_load(q['load_before'])} / {_load(q['load_after'])}. "
                  f"Turn {n}, re-prefill / reuse TTFT: **{rc['ratio_of_medians']}x** at the client (paired per "
                  f"conversation: median {rc['median_paired']}x, min {rc['min_paired']}x), {rs['ratio_of_medians']}x "
                  f"at the server (paired median {rs['median_paired']}x, min {rs['min_paired']}x). "
                  f"The budget configs hold that fraction of the {q['kv_bytes_all_fit'] / 2**20:.1f} MiB of K/V "
                  "the conversations need (run after the pair, same requests).", ""]
        lines += ttft_tables(q["configs"], n)
        lines += [f"Where turn {n}'s time goes (medians, ms): server TTFT = restore + prefill of the new tokens + "
                  "other (prefix lookup, cache allocation, first token); outside = client TTFT - server TTFT (HTTP, "
                  "chat template and tokenization, the engine's queue).", "",
                  "| config | client TTFT | server TTFT | restore | prefill | other | outside | prefilled tokens | "
                  "prefill ms / token |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, v in q["configs"].items():
            lines.append(f"| {name} | " + " | ".join(f"{v[k][-1]:.0f}" for k in (
                "ttft_ms", "server_ttft_ms", "restore_ms", "prefill_ms", "other_ms", "outside_ms", "new_tokens")) +
                f" | {v['prefill_ms'][-1] / max(v['new_tokens'][-1], 1):.2f} |")
        lines.append("")
    if "concurrent" in r:
        c = r["concurrent"]
        lines += [f"## Concurrent clients ({a.get('conversations')} conversations, {a.get('clients')} clients; "
                  f"re-prefill on {a.get('baseline_conversations')})", "",
                  f"Load before/after: {_load(c['load_before'])} / {_load(c['load_after'])}. TTFT here includes "
                  "waiting behind the other clients' work (one engine thread interleaves them by chunk). K/V of all "
                  f"conversations (all fit): {c['kv_bytes_all_fit'] / 2**20:.1f} MiB. Prompt tokens served per "
                  "second: " + ", ".join(f"{k} {v['prompt_tokens_per_s']}" for k, v in c["configs"].items()) + ".", ""]
        lines += ttft_tables(c["configs"], int(a.get("turns")))
    if "cold_ttft" in r:
        t = r["cold_ttft"]
        m = t["median"]
        lines += [f"## Cold prompt: TTFT at the server vs `hetero run`'s prefill ({t['prompt_tokens']} tokens, "
                  f"{t['method']}, C={t['chunk']}, median of {len(t['rows'])} interleaved repeats)", "",
                  f"Server TTFT / `hetero run` prefill: **{t['server_ttft_over_run_prefill']}** (ratio of medians; "
                  f"median of the paired ratios {t.get('paired_median_ratio')}), on {t.get('cpu')}. The server prefills "
                  "the prompt as one plan through the out-of-order executor, stepped in slices (between which "
                  "the engine serves other requests).", "",
                  "| `hetero run` prefill ms | server TTFT ms | server prefill ms | server queue ms | client ms |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {m['run_prefill_ms']} | {m['server_ttft_ms']} | {m['server_prefill_ms']} | {m['server_queue_ms']} "
                  f"| {m['client_ms']} |", "",
                  "Per repeat, `hetero run` prefill / server TTFT (ms): " + ", ".join(
                      f"{r['run_prefill_ms']:.0f} / {r['server_ttft_ms']:.0f}" for r in t["rows"]) +
                  ". A shared machine: the spread is other processes' load, which both sides see alike.", ""]
    if "switch_latency" in r:
        s = r["switch_latency"]
        lines += [f"## Context-switch latency by restore path ({r['args'].get('switch_tokens')} tokens, median ms)", "",
                  "| path | ms | tokens by path |", "|---|---:|---|"]
        lines += [f"| {k} | {v['ms']} | {v['tokens']} |" for k, v in s.items() if k != "cost_model"]
        lines += ["", f"Cost model after the runs: {s['cost_model']}. Swap-in reads hit the OS page cache after "
                  "the first repeat.", ""]
    if "compression_accuracy" in r:
        lines += ["## Accuracy cost of K/V compression (teacher-forced, held-out Austen text)", "",
                  "| K/V blocks | perplexity | top-1 agreement with float | INT8 / INT4 blocks | mean attention error |",
                  "|---|---:|---:|---:|---:|"]
        for k, v in r["compression_accuracy"].items():
            lines.append(f"| {k} | {v['ppl']} | {v['top1_agreement_vs_float']} | {v['int8_blocks']} / "
                         f"{v['int4_blocks']} | {v['mean_attention_error']} |")
        lines.append("")
    if "exactness" in r:
        lines += ["## Reuse vs prefilling everything (logits of the last token)", "",
                  "| backend, reuse boundary | reused tokens | bitwise equal | max abs diff | relative L2 | same top-1 |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {k} | {v['reused_tokens']} | {v['bitwise_equal']} | {v['max_abs_diff']:.3g} | {v['rel_l2']:.3g} | "
                  f"{v['same_top1']} |" for k, v in r["exactness"].items()]
        lines.append("")
    if "rss" in r:
        v = r["rss"]
        lines += ["## Memory under load (`hetero serve` subprocess, --kv-budget 8M)", "",
                  f"{v['requests']} requests from {v['clients']} concurrent clients: RSS {v['rss_after_warmup_mb']} MiB "
                  f"after {v['warmup_requests']} warm-up requests, {v['rss_end_mb']} MiB at the end: "
                  f"**{v['growth_pct']}%** growth.", ""]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines))


def _load(load: list[float] | None) -> str:
    return "?" if load is None else "/".join(f"{x:.1f}" for x in load)


LEGACY_KEYS = ("workload", "workload_turns", "turn5_ttft_ratio_reprefill_over_reuse", "kv_bytes_all_fit")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=20, help="conversations of the concurrent phase")
    p.add_argument("--ratio-conversations", type=int, default=6, help="conversations of the sequential phase")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-chars", type=int, default=1000, help="characters of a turn's passage (~4 a token)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--method", default=None, help="the method served (default: the default method)")
    p.add_argument("--chunk", type=int, default=None, help="C (default: 256, as it ships; 64 for float)")
    p.add_argument("--ttft-tokens", type=int, default=1024, help="the cold prompt of the ttft phase")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budgets", default="0.1", help="fractions of the all-fits K/V bytes (lossless tiers)")
    p.add_argument("--baseline-conversations", type=int, default=4,
                   help="conversations of the concurrent re-prefill run (0: none)")
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--compressed-run", action="store_true", help="also run the workload at 10%% with INT8/INT4 blocks")
    p.add_argument("--switch-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-prefix", type=int, default=448)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--rss-requests", type=int, default=200)
    p.add_argument("--rss-warmup", type=int, default=40)
    p.add_argument("--phases", default="sequential,concurrent,exactness,switch,accuracy,rss,ttft")
    p.add_argument("--quick", action="store_true",
                   help="2 sequential + 4 concurrent conversations (no concurrent re-prefill), phases 1-2, written as "
                        "service*_quick.{json,md}")
    add_out_arg(p, "service[_<method>][_quick].{json,md}")
    p.add_argument("--md-only", action="store_true", help="rewrite the .md from the committed .json")


def run(args: argparse.Namespace) -> int:
    from hetero.methods import DEFAULT_METHOD

    args.method = args.method or DEFAULT_METHOD
    if args.chunk is None:
        args.chunk = 64 if args.method == "float" else 256
    if args.quick:
        args.conversations, args.ratio_conversations, args.baseline_conversations = 4, 2, 0
        args.phases = "sequential,concurrent"
    name = ("service" if args.method == DEFAULT_METHOD else f"service_{args.method}") + ("_quick" if args.quick else "")
    args.out = out_dir(args.out) / name  # the results' prefix: <out>/<name>.{json,md}
    if args.md_only:
        write_md(json.loads(args.out.with_suffix(".json").read_text()), args.out.with_suffix(".md"))
        return 0
    if args.threads is not None:
        set_torch_threads(args.threads)
    phases = set(args.phases.split(","))
    model = hetero.load_model()
    text_ids = model.tokenizer((DATA / "austen_emma.txt").read_text()[20000:40000])["input_ids"]
    result: dict = {"load_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
                    "command": " ".join(["python bench/service.py"] + sys.argv[1:]),
                    "model": model.name, "torch_threads": _torch_threads(), "cpus": os.cpu_count()}
    if "sequential" in phases:
        result["sequential"] = sequential(model, conversations(args.ratio_conversations, args.turns, args.turn_chars),
                                          args)
        print("sequential:", json.dumps(result["sequential"]["ratio"]), flush=True)
    convs = conversations(args.conversations, args.turns, args.turn_chars)
    if "concurrent" in phases:
        result["concurrent"] = concurrent(model, convs, args)
    if "exactness" in phases:
        result["exactness"] = exactness(model, text_ids, args)
    if "switch" in phases:
        result["switch_latency"] = restore_paths(model, text_ids, args)
    if "accuracy" in phases:
        result["compression_accuracy"] = compression_accuracy(model, text_ids, args)
    if "rss" in phases:
        result["rss"] = rss_run(args, convs)
    if "ttft" in phases:
        result["cold_ttft"] = cold_ttft(model, args)
    result["load_after"] = os.getloadavg()
    json_path = args.out.with_suffix(".json")
    prev = json.loads(json_path.read_text()) if json_path.exists() else {}
    for key in LEGACY_KEYS:
        prev.pop(key, None)
    prev.update(result)
    with atomic_path(json_path) as tmp:
        tmp.write_text(json.dumps(prev, indent=1))
    write_md(prev, args.out.with_suffix(".md"))
    brief = {k: v for k, v in prev.items() if k not in ("sequential", "concurrent")}
    brief["ratio"] = prev.get("sequential", {}).get("ratio")
    print(json.dumps(brief, indent=1))
    print(f"results: {json_path} and {args.out.with_suffix('.md')}")
    return 0
