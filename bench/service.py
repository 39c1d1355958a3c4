"""`hetero serve` under a multi-turn chat workload (issue 12; LLMS + Pensieve), through the `openai` client.

1. Workload: conversations × turns built from the shipped texts (hetero/data), each turn a passage and a
   question; `--clients` threads run conversations concurrently (stateless chat: the full history each
   turn, as the openai client sends it). TTFT per turn is measured at the client (first streamed token).
   Configs, one server each, same run: re-prefill everything (no reuse), reuse with everything fitting,
   then reuse under budgets down to 10% of the K/V the conversations need (float, lossless tiers; the
   replies must equal the all-fits run's), and 10% with INT8/INT4 compression.
2. Context-switch latency by restore path (in RAM, compressed, swap-in, recompute, pipelined).
3. Accuracy cost of KV compression: teacher-forced top-1 agreement and perplexity on held-out text.
4. RSS of a `hetero serve` subprocess over `--rss-requests` requests from 8 concurrent clients.

    python bench/service.py            # writes bench/results/service.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402
from hetero.serve import Service, StoreConfig  # noqa: E402
from hetero.serve.server import BackgroundServer, free_port  # noqa: E402

DATA = ROOT / "hetero" / "data"
QUESTION = "In a few words, what is this passage about?"


def passages(chars: int) -> list[str]:
    """Paragraphs of both shipped texts, cut at a word boundary near `chars` characters."""
    out = []
    for name in ("austen_emma.txt", "sotu_2016_2021.txt"):
        for para in (DATA / name).read_text().split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= chars:
                out.append(para[:chars].rsplit(" ", 1)[0])
    return out


def conversations(n: int, turns: int, chars: int) -> list[list[str]]:
    ps = passages(chars)
    step = max(1, len(ps) // (n * turns))
    return [[f"Passage:\n{ps[(c * turns + t) * step % len(ps)]}\n\n{QUESTION}" for t in range(turns)] for c in range(n)]


def run_conversation(client: object, cid: int, turns: list[str], max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": f"You are reading assistant {cid}. Answer briefly."}]
    out = []
    for t, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        ttft, pieces, usage = None, [], None
        for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        reply = "".join(pieces)
        messages.append({"role": "assistant", "content": reply})
        extra = usage.model_extra.get("hetero", {}) if usage.model_extra else {}
        out.append({"conversation": cid, "turn": t + 1, "ttft_ms": round((ttft or time.perf_counter() - t0) * 1e3, 1),
                    "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                    "recomputed_tokens": extra.get("recomputed_tokens"), "restore": extra.get("restore"),
                    "restore_ms": extra.get("restore_ms"), "reply": reply})
    return out


def workload(model: hetero.Model, store: StoreConfig, convs: list[list[str]], args: argparse.Namespace) -> dict:
    from openai import OpenAI

    service = Service(hetero.Runtime(model, chunk=args.chunk), store, max_active=args.clients,
                      max_queue=4 * args.clients)
    server = BackgroundServer(service, free_port())
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=1800, max_retries=0)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            turns = [r for rs in pool.map(lambda c: run_conversation(client, c[0], c[1], args.max_tokens),
                                          enumerate(convs)) for r in rs]
        stats = service.stats()
    finally:
        server.stop()
    return {"wall_s": round(time.perf_counter() - t0, 1), "turns": turns, "stats": stats}


def per_turn(turns: list[dict], key: str) -> list[float]:
    n = max(t["turn"] for t in turns)
    return [round(statistics.median(t[key] for t in turns if t["turn"] == k), 1) for k in range(1, n + 1)]


def restore_paths(model: hetero.Model, text_ids: list[int], args: argparse.Namespace) -> dict:
    """Median ms to restore one context of `len(text_ids)` tokens through each path."""
    from hetero.serve.restore import CostModel, restore
    from hetero.serve.store import ChunkStore

    rt = hetero.Runtime(model, chunk=args.chunk)
    ids = text_ids[: args.switch_tokens]
    out, cost = {}, CostModel()
    for path in ("ram", "compressed", "swap", "recompute", "pipelined"):
        compress = "auto" if path == "compressed" else "off"
        budget = None if path == "ram" else 0
        store = ChunkStore(StoreConfig(budget_bytes=budget, compress=compress, reserve=0.0,
                                       tolerance=float("inf"), disk=path != "compressed"))
        cache = rt.new_cache(len(ids) + 1)
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
            target = rt.new_cache(len(ids) + 1)
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


def compression_accuracy(model: hetero.Model, text_ids: list[int], args: argparse.Namespace) -> dict:
    """Teacher-forced next tokens after a prefix whose K/V blocks are stored at each level."""
    from hetero.serve.quant import compress, dequantize
    from hetero.serve.store import read_span, write_span

    rt = hetero.Runtime(model, chunk=args.chunk)
    step = hetero.Runtime(model, chunk=1)
    prefix, cont = text_ids[: args.eval_prefix], text_ids[args.eval_prefix : args.eval_prefix + args.eval_tokens]
    base = rt.new_cache(len(prefix) + len(cont) + 1)
    rt.prefill(prefix, cache=base)
    results, ref_top = {}, None
    for level, tol in (("float", None), ("int8", 0.0), ("auto", args.tolerance), ("int4", float("inf"))):
        cache = rt.new_cache(base.capacity)
        k, v = read_span(base, 0, len(prefix))
        errors, levels = [], []
        for a in range(0, len(prefix), 16):
            kb, vb = k[:, :, a : a + 16], v[:, :, a : a + 16]
            if tol is not None:
                qk, qv, err = compress(kb, vb, tol)
                kb, vb = dequantize(qk), dequantize(qv)
                errors.append(err)
                levels.append(qk.level)
            write_span(cache, a, kb, vb)
        cache.length = len(prefix)
        nll, top = 0.0, []
        with torch.inference_mode():
            cache.length = len(prefix) - 1  # re-run the last prefix token to get its logits over this cache
            logits = step.prefill(prefix[-1:], cache=cache).logits
            for tok in cont:
                nll -= float(torch.log_softmax(logits, -1)[tok])
                top.append(int(logits.argmax()))
                logits = step.prefill([tok], cache=cache).logits
        ref_top = ref_top or top
        results[level] = {"ppl": round(float(torch.exp(torch.tensor(nll / len(cont)))), 3),
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
            cache = rt.new_cache(len(ids) + 1)
            rt.prefill(ids[:cut], cache=cache)
            reuse = rt.prefill(ids[cut:], cache=cache).logits
            out[f"{backend}_{name}"] = {
                "reused_tokens": cut, "bitwise_equal": bool(torch.equal(reuse, scratch)),
                "max_abs_diff": float((reuse - scratch).abs().max()),
                "rel_l2": float((reuse - scratch).norm() / scratch.norm()),
                "same_top1": int(reuse.argmax()) == int(scratch.argmax())}
        rt.close()
    return out


def rss_run(args: argparse.Namespace, convs: list[list[str]]) -> dict:
    """A `hetero serve` subprocess; 8 clients send short chats; RSS after warm-up vs at the end."""
    import psutil
    from openai import OpenAI

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hetero", "serve", "--method", "float", "--chunk", str(args.chunk), "--port", str(port),
           "--kv-budget", "8M", "--max-active", "8", "--max-queue", "64"]
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
        ps = psutil.Process(proc.pid)
        lock, done, samples = threading.Lock(), [0], []
        texts = [t[:200] for c in convs for t in c]

        def one(i: int) -> None:
            msgs = [{"role": "user", "content": texts[i % len(texts)]}]
            client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
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


def write_md(r: dict, path: Path) -> None:
    """The committed summary table of a run (`--md-only` rewrites it from the JSON)."""
    w = r.get("workload", {})
    lines = ["# `hetero serve`: multi-turn chat workload (bench/service.py)", "",
             f"Model {r.get('model')}, float runtime (exact reference), C={r['args'].get('chunk')}, "
             f"{r['args'].get('conversations')} conversations x {r['args'].get('turns')} turns, "
             f"{r['args'].get('clients')} concurrent `openai` clients (streaming), {r['args'].get('max_tokens')} "
             f"tokens a reply. Load average before/after: {r.get('load_before')} / {r.get('load_after')} "
             "(a shared 2-core machine: absolute times are noisy; ratios come from one run).", ""]
    if w:
        n = len(next(iter(w.values()))["ttft_ms_per_turn"])
        lines += ["## Time to first token per turn (median over conversations, ms, client side)", "",
                  "| config | " + " | ".join(f"turn {k}" for k in range(1, n + 1)) +
                  " | cached tokens, last turn | conversations | replies equal to all-fit | wall s |",
                  "|---|" + "---:|" * (n + 4)]
        for name, v in w.items():
            lines.append(f"| {name} | " + " | ".join(f"{x:.0f}" for x in v["ttft_ms_per_turn"]) +
                         f" | {v['cached_tokens_per_turn'][-1]:.0f} of {v['prompt_tokens_per_turn'][-1]:.0f}"
                         f" | {v['conversations']} | {v['replies_equal_all_fit']}/{v['replies']} | {v['wall_s']} |")
        lines += ["", f"Last turn, re-prefill / reuse TTFT: **{r.get('turn5_ttft_ratio_reprefill_over_reuse')}x**. "
                  f"K/V of all conversations (all fit): {r.get('kv_bytes_all_fit', 0) / 2**20:.1f} MiB.", ""]
        lines += ["| config | swap-ins | recomputed blocks | compressed int8/int4 | compression ratio | AoT writes |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, v in w.items():
            c = v["counts"]
            lines.append(f"| {name} | {c.get('swap_in_blocks', 0)} | {c.get('recomputed_blocks', 0)} | "
                         f"{c.get('compressed_int8', 0)}/{c.get('compressed_int4', 0)} | {v['compression_ratio']} | "
                         f"{c.get('aot_writes', 0)} |")
        lines.append("")
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
    path.write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--passage-chars", type=int, default=160)
    p.add_argument("--budgets", default="0.1", help="fractions of the all-fits K/V bytes (lossless tiers)")
    p.add_argument("--baseline-conversations", type=int, default=4,
                   help="conversations of the re-prefill run (at least --clients: the same concurrency)")
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--compressed-run", action="store_true", help="also run the workload at 10%% with INT8/INT4 blocks")
    p.add_argument("--switch-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-prefix", type=int, default=448)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--rss-requests", type=int, default=200)
    p.add_argument("--rss-warmup", type=int, default=40)
    p.add_argument("--phases", default="workload,exactness,switch,accuracy,rss")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "service")
    p.add_argument("--md-only", action="store_true", help="rewrite the .md from the committed .json")
    args = p.parse_args()
    if args.md_only:
        write_md(json.loads(args.out.with_suffix(".json").read_text()), args.out.with_suffix(".md"))
        return
    phases = set(args.phases.split(","))
    model = hetero.load_model()
    convs = conversations(args.conversations, args.turns, args.passage_chars)
    text_ids = model.tokenizer((DATA / "austen_emma.txt").read_text()[20000:40000])["input_ids"]
    result: dict = {"load_before": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
                    "model": model.name, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if "workload" in phases:
        # the stateless baseline re-prefills every turn: on a subset of the conversations (its TTFT per turn
        # does not depend on how many conversations run, only on the concurrency)
        runs = {"reprefill": workload(model, StoreConfig(reuse=False, disk=False),
                                      convs[: args.baseline_conversations], args)}
        runs["reuse_all_fit"] = workload(model, StoreConfig(), convs, args)
        need = sum(runs["reuse_all_fit"]["stats"]["bytes"][k] for k in ("ram_float", "ram_compressed"))
        for frac in [float(f) for f in args.budgets.split(",") if f]:
            runs[f"reuse_{frac:g}_lossless"] = workload(model, StoreConfig(budget_bytes=int(need * frac), compress="off"),
                                                          convs, args)
        if args.compressed_run:
            runs["reuse_0.1_compressed"] = workload(model, StoreConfig(budget_bytes=int(need * 0.1), compress="auto",
                                                                       tolerance=args.tolerance), convs, args)
        base = {(t["conversation"], t["turn"]): t["reply"] for t in runs["reuse_all_fit"]["turns"]}
        summary = {}
        for name, run in runs.items():
            replies = [t["reply"] for t in run["turns"]]
            summary[name] = {"ttft_ms_per_turn": per_turn(run["turns"], "ttft_ms"),
                             "cached_tokens_per_turn": per_turn(run["turns"], "cached_tokens"),
                             "prompt_tokens_per_turn": per_turn(run["turns"], "prompt_tokens"),
                             "wall_s": run["wall_s"],
                             "replies_equal_all_fit": sum(t["reply"] == base[t["conversation"], t["turn"]]
                                                          for t in run["turns"]),
                             "conversations": len({t["conversation"] for t in run["turns"]}),
                             "replies": len(replies), "counts": run["stats"]["counts"],
                             "bytes": run["stats"]["bytes"], "compression_ratio": run["stats"]["compression_ratio"]}
        result["kv_bytes_all_fit"] = need
        result["workload"] = summary
        last = args.turns - 1
        result["turn5_ttft_ratio_reprefill_over_reuse"] = round(
            summary["reprefill"]["ttft_ms_per_turn"][last] / summary["reuse_all_fit"]["ttft_ms_per_turn"][last], 2)
        result["workload_turns"] = {k: v["turns"] for k, v in runs.items()}
    if "exactness" in phases:
        result["exactness"] = exactness(model, text_ids, args)
    if "switch" in phases:
        result["switch_latency"] = restore_paths(model, text_ids, args)
    if "accuracy" in phases:
        result["compression_accuracy"] = compression_accuracy(model, text_ids, args)
    if "rss" in phases:
        result["rss"] = rss_run(args, convs)
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(args.out.with_suffix(".json").read_text()) if args.out.with_suffix(".json").exists() else {}
    prev.update(result)
    args.out.with_suffix(".json").write_text(json.dumps(prev, indent=1))
    write_md(prev, args.out.with_suffix(".md"))
    print(json.dumps({k: v for k, v in prev.items() if k not in ("workload_turns",)}, indent=1))


if __name__ == "__main__":
    main()
