"""Decode benchmark (issue 13): hetero's own decoder vs HF generate vs llama.cpp, speculation by drafter.

    python bench/decode.py [--quick] [--repeats 3] [--threads 2] [--new 32]

One process, engines one after another on the same GGUF and the same context ids:
1. plain greedy decode tokens/s at context 256 / 1024 / 2048: hetero INT8 (`hetero` method: INT8 graphs
   at C = 1 on the ONNX Runtime lane, attention on the CPU lane, INT8 head), hetero float, HF generate
   (hetero's cache handed to transformers), llama.cpp (llama-cpp-python, Q4_1);
2. speculative speedup and acceptance by drafter (lookup, self, draft) on copy-heavy tasks (edit a
   shipped text) and on open chat, INT8, 128 tokens. Every run generates exactly 128 tokens (end-of-turn
   tokens do not stop it): the 1,400-character text's answer is a copy for all of them; the 700-character
   one's answer ends near token 60 and the model then writes a new chat turn, novel text, which the
   table keeps as a second row;
3. end to end: prefill 1,500 tokens + 128 generated tokens per engine.
Each number is the median of `--repeats` runs after a warm-up. Writes bench/results/decode.{json,md,png}.
The machine is shared: the load average is recorded beside every section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from hetero.decode import SamplingParams, generate
from hetero.decode.step import TREE_SIZES, DecodeStep
from hetero.loader import load_model
from hetero.methods import make_runtime, use_threads
from hetero.npu import isa
from hetero.paths import atomic_path

HELP = "hetero's decoder vs HF generate vs llama.cpp, plain and speculative, and prefill + decode end to end"
TEXT = Path(__file__).resolve().parents[1] / "data" / "austen_emma.txt"


def load() -> float:
    return round(os.getloadavg()[0], 2)


def median_time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def chat_ids(tok, text: str) -> list[int]:
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(s, add_special_tokens=False)["input_ids"]


class Engines:
    def __init__(self, model, threads: int):
        self.model, self.threads = model, threads
        self.rt = {m: make_runtime(model, m, chunk=256, threads=threads) for m in ("hetero", "float")}
        step = DecodeStep.of(self.rt["hetero"])
        step.split_after = 0  # the steady state: graphs split over both cores from the first step (SPLIT_AFTER_STEPS)
        for c in TREE_SIZES:
            step.prepare(c)  # decode graphs bound before timing
        self._hf = self._llm = None

    def hf(self):
        if self._hf is None:
            from hetero.adapters.hf import to_hf_model

            self._hf = to_hf_model(self.model)
        return self._hf

    def llm(self, n_ctx: int = 4096):
        if self._llm is None:
            try:
                from llama_cpp import Llama
            except ImportError:
                return None
            self._llm = Llama(model_path=str(self.model.path), n_ctx=n_ctx, n_batch=512, n_threads=self.threads,
                              n_threads_batch=self.threads, verbose=False)
        return self._llm

    def decode(self, engine: str, ids: list[int], n_new: int, repeats: int, speculate: str = "off") -> dict:
        """Median decode time of n_new greedy tokens after a prefill of ids (prefill not timed)."""
        stop = SamplingParams(max_new_tokens=n_new, stop_token_ids=())
        if engine in ("hetero", "float"):
            rt = self.rt[engine]
            runs = []
            for _ in range(repeats + 1):
                r = rt.prefill(ids)
                use_threads(1 if engine == "hetero" else self.threads)
                g = generate(rt, r, stop, speculate=speculate, context_ids=ids,
                             draft_runtime=rt if speculate == "draft" else None)
                runs.append(g)
            runs = runs[1:]
            ms = statistics.median(g.decode_ms for g in runs)
            g = runs[-1]
            return {"tokens_per_s": round(n_new / (ms / 1e3), 1), "decode_ms": round(ms, 1), "accepted": g.accepted,
                    "drafted": g.drafted, "target_steps": g.steps, "tokens": list(g.tokens)}
        if engine == "hf":
            use_threads(self.threads)
            r = self.rt["float"].prefill(ids)
            hf = self.hf()
            s, out = median_time(lambda: hf_generate_forced(hf, ids, r, n_new), repeats)
            return {"tokens_per_s": round(n_new / s, 1), "decode_ms": round(s * 1e3, 1), "tokens": out}
        if engine == "llama_cpp":
            llm = self.llm()
            if llm is None:
                return {"skipped": "llama-cpp-python is not installed (pip install 'hetero[bench]')"}

            def run():
                llm.reset()
                llm.eval(ids)
                t0 = time.perf_counter()
                out = llama_greedy(llm, n_new)
                return time.perf_counter() - t0, out

            run()
            res = [run() for _ in range(repeats)]
            s = statistics.median(r[0] for r in res)
            return {"tokens_per_s": round(n_new / s, 1), "decode_ms": round(s * 1e3, 1), "tokens": res[-1][1]}
        raise ValueError(engine)


def llama_greedy(llm, n_new: int) -> list[int]:
    """n_new greedy tokens from llama.cpp's state after an `eval` of the prompt (no EOS stop)."""
    from hetero.adapters.llamacpp import last_logits

    out = [int(np.argmax(last_logits(llm)))]
    while len(out) < n_new:
        llm.eval([out[-1]])
        out.append(int(np.argmax(last_logits(llm))))
    return out


def hf_generate_forced(hf, ids: list[int], r, n_new: int) -> list[int]:
    """HF generate continuing hetero's float prefill for exactly n_new tokens (no EOS stop)."""
    from hetero.adapters.hf import to_dynamic_cache

    first = int(r.logits.argmax())
    x = torch.tensor([ids + [first]])
    with torch.inference_mode():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                          past_key_values=to_dynamic_cache(r.cache, hf.config), max_new_tokens=n_new - 1,
                          min_new_tokens=n_new - 1, do_sample=False, pad_token_id=hf.config.eos_token_id)
    return out[0, len(ids):].tolist()


def e2e(eng: Engines, ids: list[int], n_new: int, repeats: int) -> list[dict]:
    rows = []
    params = SamplingParams(max_new_tokens=n_new, stop_token_ids=())
    for name, speculate in (("hetero", "lookup"), ("hetero", "off")):
        rt = eng.rt["hetero"]

        def run():
            use_threads(max(1, eng.threads // 2))  # as make_runtime sets it for the overlapped lanes
            rt_t0 = time.perf_counter()
            r = rt.prefill(ids)
            t1 = time.perf_counter()
            use_threads(1)
            g = generate(rt, r, params, speculate=speculate, context_ids=ids)
            return (t1 - rt_t0) * 1e3, g.decode_ms, g.tokens

        run()
        res = sorted((run() for _ in range(repeats)), key=lambda x: x[0] + x[1])[repeats // 2]
        rows.append({"engine": f"hetero (INT8, speculate {speculate})", "prefill_ms": round(res[0], 1),
                     "decode_ms": round(res[1], 1), "total_ms": round(res[0] + res[1], 1), "load": load()})
    llm = eng.llm()
    if llm is not None:
        def run_llama():
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            t1 = time.perf_counter()
            llama_greedy(llm, n_new)
            return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

        run_llama()
        res = sorted((run_llama() for _ in range(repeats)), key=lambda x: x[0] + x[1])[repeats // 2]
        rows.append({"engine": "llama.cpp (Q4_1)", "prefill_ms": round(res[0], 1), "decode_ms": round(res[1], 1),
                     "total_ms": round(res[0] + res[1], 1), "load": load()})
    hf = eng.hf()
    use_threads(eng.threads)

    def run_hf():
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                        do_sample=False, pad_token_id=hf.config.eos_token_id)
            return (time.perf_counter() - t0) * 1e3

    ms = statistics.median([run_hf() for _ in range(max(1, repeats - 1))])
    rows.append({"engine": "HF transformers generate (float, prefill + decode)", "prefill_ms": None,
                 "decode_ms": None, "total_ms": round(ms, 1), "load": load()})
    return rows


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="context 256 only, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="tokens per plain-decode measurement")
    ap.add_argument("--out", default="bench/results", help="directory for decode.json/.md/.png")


def run(args: argparse.Namespace) -> int:
    repeats = 1 if args.quick else args.repeats
    model = load_model()
    tok = model.tokenizer
    eng = Engines(model, args.threads)
    text_ids = tok(TEXT.read_text())["input_ids"]
    result: dict = {"model": model.name, "threads": args.threads, "repeats": repeats, "cpu_count": os.cpu_count(),
                    "isa": isa.machine(), "plain": [], "speculative": [], "e2e": []}
    lens = (256,) if args.quick else (256, 1024, 2048)
    for n in lens:
        ids = text_ids[5000 : 5000 + n]
        row: dict = {"context": n, "load_before": load()}
        # Rounds interleave the engines (each call: a warm-up run, then one timed run), so that a slow stretch of
        # the shared machine touches every engine alike; hetero vs llama.cpp is also taken round by round.
        rounds: dict[str, list] = {e: [] for e in ("hetero", "float", "hf", "llama_cpp")}
        for _ in range(repeats):
            for engine, got in rounds.items():
                n_new = args.new if engine != "float" else max(8, args.new // 2)
                d = eng.decode(engine, ids, n_new, 1)
                got.append(d.get("tokens_per_s", d.get("skipped")))
        for engine, got in rounds.items():
            row[engine] = statistics.median(got) if all(isinstance(x, float) for x in got) else got[0]
            print(f"context {n} {engine}: {row[engine]} tokens/s, rounds {got} (load {load()})", flush=True)
        row["rounds"] = rounds
        if all(isinstance(x, float) for x in rounds["llama_cpp"]):
            row["hetero_over_llama_cpp"] = round(statistics.median(h / c for h, c in zip(rounds["hetero"],
                                                                                           rounds["llama_cpp"])), 2)
        row["load_after"] = load()
        result["plain"].append(row)
    emma = TEXT.read_text()
    start = emma.index("Emma Woodhouse, handsome")
    edit = ("Rewrite the following text, replacing the name Emma with Anne and keeping everything else exactly "
            "the same:\n\n")
    tasks = {  # the long text's answer is a copy for all the generated tokens; the short one's ends near token 60
        "copy-heavy (edit a 1,400-character shipped text)": edit + emma[start : start + 1400],
        "copy-heavy, short (edit 700 characters; past its end of turn)": edit + emma[start : start + 700],
        "open chat": "Write a short story about a lighthouse keeper who befriends a seagull.",
    }
    n_spec = 32 if args.quick else 128
    for task, prompt in tasks.items():
        ids = chat_ids(tok, prompt)
        base = eng.decode("hetero", ids, n_spec, repeats)
        row = {"task": task, "prompt_tokens": len(ids), "plain_tokens_per_s": base["tokens_per_s"], "load": load()}
        for spec in ("lookup", "self", "draft"):
            d = eng.decode("hetero", ids, n_spec, repeats, speculate=spec)
            same = d["tokens"] == base["tokens"]
            row[spec] = {"tokens_per_s": d["tokens_per_s"], "speedup": round(d["tokens_per_s"] / base["tokens_per_s"], 2),
                         "acceptance": round(d["accepted"] / d["drafted"], 3) if d["drafted"] else 0.0,
                         "target_steps": d["target_steps"], "same_tokens_as_plain": same}
            print(f"{task} {spec}: {row[spec]} (plain {base['tokens_per_s']})", flush=True)
        result["speculative"].append(row)
    lc = tok(emma[20000:])["input_ids"][:1500]
    result["e2e"] = e2e(eng, lc, 32 if args.quick else 128, repeats)
    for r in result["e2e"]:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode_quick" if args.quick else "decode"
    with atomic_path(out / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    write_md(result, out / f"{name}.md")
    plot(result, out / f"{name}.png")
    return 0


def write_md(r: dict, path: Path) -> None:
    lines = [f"# Decode benchmark ({r['model']}, {r['threads']} threads, median of {r['repeats']})", "",
             "Reproduce: `python bench/decode.py`. The development machine is shared by several jobs: "
             "`load` is the 1-minute load average (2 cores) when measured. "
             f"Machine: {r.get('isa', {}).get('machine', '?')}, ISA {', '.join(r.get('isa', {}).get('isa', [])) or '?'}.", "",
             "## Plain greedy decode, tokens/s", "",
             "Median of rounds that interleave the engines; the ratio is the median of the rounds' hetero INT8 / "
             "llama.cpp.", "",
             "| context | hetero INT8 | hetero float | HF generate | llama.cpp | hetero INT8 / llama.cpp | hetero INT8 rounds "
             "| llama.cpp rounds | load |",
             "|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for row in r["plain"]:
        rounds = row.get("rounds", {})
        lines.append(f"| {row['context']} | {row['hetero']} | {row['float']} | {row['hf']} | {row['llama_cpp']} | "
                     f"{row.get('hetero_over_llama_cpp', '')} | {rounds.get('hetero', '')} | {rounds.get('llama_cpp', '')} | "
                     f"{row['load_before']}–{row['load_after']} |")
    lines += ["", "## Token-tree speculation (INT8, greedy; output identical to plain)", "",
              "| task | plain tok/s | drafter | tok/s | speedup | acceptance | target passes | same tokens |",
              "|---|---:|---|---:|---:|---:|---:|---|"]
    for row in r["speculative"]:
        for spec in ("lookup", "self", "draft"):
            d = row[spec]
            lines.append(f"| {row['task']} | {row['plain_tokens_per_s']} | {spec} | {d['tokens_per_s']} | "
                         f"{d['speedup']}× | {d['acceptance']} | {d['target_steps']} | {d['same_tokens_as_plain']} |")
    lines += ["", "`draft` uses the target model itself as the draft model (the only model here sharing its "
              "tokenizer): acceptance is an upper bound, its cost equals the target's, so it cannot pay.",
              "Every run generates 128 tokens (end-of-turn tokens do not stop it). The 1,400-character text's answer "
              "is a copy for all of them; the 700-character text's answer ends near token 60, after which the model "
              "writes a new chat turn of novel text (kept as its own row).", "",
              "## End to end: prefill 1,500 tokens + generated tokens", "", "| engine | prefill ms | decode ms | total ms | load |",
              "|---|---:|---:|---:|---|"]
    for row in r["e2e"]:
        lines.append(f"| {row['engine']} | {row['prefill_ms']} | {row['decode_ms']} | {row['total_ms']} | {row['load']} |")
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ctx = [row["context"] for row in r["plain"]]
    for key, label in (("hetero", "hetero INT8"), ("float", "hetero float"), ("hf", "HF generate"), ("llama_cpp", "llama.cpp")):
        vals = [row[key] if isinstance(row[key], (int, float)) else np.nan for row in r["plain"]]
        ax[0].plot(ctx, vals, marker="o", label=label)
    ax[0].set_xlabel("context tokens")
    ax[0].set_ylabel("decode tokens/s")
    ax[0].set_title("plain greedy decode")
    ax[0].legend()
    labels, vals = [], []
    for row in r["speculative"]:
        for spec in ("lookup", "self", "draft"):
            labels.append(f"{row['task'].split(' (')[0]}\n{spec}")
            vals.append(row[spec]["speedup"])
    ax[1].bar(range(len(vals)), vals)
    ax[1].axhline(1.0, color="k", lw=0.8)
    ax[1].set_xticks(range(len(vals)), labels, fontsize=7)
    ax[1].set_ylabel("speedup over plain decode")
    ax[1].set_title("token-tree speculation (INT8)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")

