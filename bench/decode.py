"""Decode benchmark (issues 13, 24): hetero's own decoder vs HF generate vs the peers, speculation by drafter.

    python bench/decode.py [--quick] [--repeats 3] [--threads 2] [--new 32] [--peers all|none|a,b]
    python bench/decode.py --plain-only --contexts 1024     # table 1 only, at 1024: decode_plain.{json,md,png}
    python bench/decode.py --plain-only --model X.gguf --baselines none   # another model, hetero INT8 beside the peers

hetero's engines in this process, each peer in a process of its own, on the same GGUF and the same context ids:
1. plain greedy decode tokens/s at context 256 / 1024 / 2048: hetero INT8 (`hetero` method: its decode
   placement's form at C = 1: hetero's int8 GEMVs for the layers and head where the CPU has AVX-512 VNNI
   (`native.gemv`), else MatMulNBits graphs (`npu.nbits`); attention on the CPU lane), hetero float, HF generate
   (hetero's cache handed to transformers), and the peers (`bench.peer_engines`: OpenVINO GenAI on its INT8
   and INT4 exports, ONNX Runtime GenAI, llama.cpp as shipped and at Q4_0 / Q8_0 with and without flash
   attention);
2. speculative speedup and acceptance by drafter (lookup, self, draft) on copy-heavy tasks (edit a
   shipped text) and on open chat, INT8, 128 tokens. Every run generates exactly 128 tokens (end-of-turn
   tokens do not stop it): the 1,400-character text's answer is a copy for all of them; the 700-character
   one's answer ends near token 60 and the model then writes a new chat turn, novel text, which the
   table keeps as a second row;
3. end to end: prefill 1,500 tokens + 128 generated tokens per engine.
Each number is the median of `--repeats` runs after a warm-up. Writes decode.{json,md,png} into `--out`
(`bench/results` for the committed ones; default `<cache>/bench/`).
The machine is shared: the load average is recorded beside every section.
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
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import hetero
from bench.entry import add_out_arg, out_dir, wrote
from bench.host import describe, host
from bench.peer_engines import LABELS, PEERS, LlamaCppSession, PeerProcess, source_gguf
from bench.workers import EngineUnavailable
from hetero.decode import SamplingParams, generate
from hetero.decode.step import TREE_SIZES, DecodeStep
from hetero.arguments import add_model_arg, opt_in_decode_forms
from hetero.errors import ConfigError
from hetero.loader import load_model
from hetero.methods import make_runtime, use_threads, with_decode_form
from hetero.npu.placement import DECODE_FORMS
from hetero.npu import isa
from hetero.paths import atomic_path

HELP = "hetero's decoder vs HF generate vs llama.cpp, plain and speculative, and prefill + decode end to end"
TEXT = Path(hetero.__file__).resolve().parent / "data" / "austen_emma.txt"
BASELINES = ("float", "hf")  # hetero's float method and HF generate: the rows beside hetero INT8 besides the peers


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
    def __init__(self, model, threads: int, peers: tuple[str, ...] = PEERS, max_len: int = 2048 + 256,
                 model_path: str | None = None, methods: tuple[str, ...] = ("hetero", "float"),
                 decode_forms: tuple[str, ...] = ()):
        """`methods`: hetero's runtimes to make (float only where its rows or HF's are asked: at 1B and up a float
        runtime costs gigabytes); `model_path`: the model the peers are built from (None: the default);
        `decode_forms`: more hetero runtimes, "hetero_<form>", that decode in `make_runtime`'s `decode_form` over the
        default's prefill (`with_decode_form`: one set of prefill sessions; one form refused for this model is skipped
        with its reason)."""
        self.model, self.threads, self.max_len = model, threads, max_len
        self.rt = {m: make_runtime(model, m, chunk=256, threads=threads) for m in methods}
        self.skipped: dict[str, str] = {}
        for form in decode_forms:
            try:
                self.rt[f"hetero_{form}"] = with_decode_form(self.rt["hetero"], form)
            except ConfigError as e:
                self.skipped[f"hetero_{form}"] = str(e)
                print(f"hetero_{form} skipped: {e}", flush=True)
        for name in [m for m in self.rt if m.startswith("hetero")]:
            step = DecodeStep.of(self.rt[name])
            step.split_after = 0  # the steady state: graphs split over both cores from the first step (SPLIT_AFTER_STEPS)
            for c in TREE_SIZES:
                step.prepare(c)  # decode graphs bound before timing
        self._hf = self._llm = None
        self.peers: dict[str, PeerProcess] = {}
        for name in peers:  # each in its own process, loaded before any timing
            try:
                self.peers[name] = PeerProcess(name, threads, max_len, model_path)
            except (EngineUnavailable, RuntimeError) as e:
                self.skipped[name] = str(e)
                print(f"peer {name} skipped: {e}", flush=True)

    def close(self) -> None:
        for p in self.peers.values():
            p.close()

    def hf(self):
        if self._hf is None:
            from hetero.adapters.hf import to_hf_model

            self._hf = to_hf_model(self.model)
        return self._hf

    def llm(self) -> LlamaCppSession | None:
        """llama.cpp in this process on the GGUF as shipped (the end-to-end rows)."""
        if self._llm is None:
            try:
                self._llm = LlamaCppSession(source_gguf(str(self.model.path)), self.threads, self.max_len, False)
            except EngineUnavailable:
                return None
        return self._llm

    def decode(self, engine: str, ids: list[int], n_new: int, repeats: int, speculate: str = "off") -> dict:
        """Median decode time of n_new greedy tokens after a prefill of ids (prefill not timed)."""
        stop = SamplingParams(max_new_tokens=n_new, stop_token_ids=())
        if engine.startswith("hetero_") and engine not in self.rt:
            return {"skipped": self.skipped.get(engine, "not run")}
        if engine in self.rt:
            rt = self.rt[engine]
            runs = []
            for _ in range(repeats + 1):
                r = rt.prefill(ids)
                use_threads(self.threads if engine == "float" else 1)
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
        if engine in PEERS:
            peer = self.peers.get(engine)
            if peer is None:
                return {"skipped": self.skipped.get(engine, "not run")}
            runs = [peer.decode(ids, n_new) for _ in range(repeats)]  # the worker warms up each length first
            sec = statistics.median(r[0] for r in runs)
            return {"tokens_per_s": round(n_new / sec, 1), "decode_ms": round(sec * 1e3, 1), "tokens": runs[-1][1]}
        raise ValueError(engine)


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
            t0 = time.perf_counter()
            llm.prefill(ids)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            return prefill_ms, llm.decode(ids, n_new)[0] * 1e3

        run_llama()
        res = sorted((run_llama() for _ in range(repeats)), key=lambda x: x[0] + x[1])[repeats // 2]
        rows.append({"engine": "llama.cpp (the GGUF as shipped, Q4_1)", "prefill_ms": round(res[0], 1), "decode_ms": round(res[1], 1),
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
    add_model_arg(ap)
    ap.add_argument("--quick", action="store_true", help="context 256 only, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="tokens per plain-decode measurement")
    ap.add_argument("--peers", default="all", help=f"peers to run: all, none, or some of {', '.join(PEERS)}")
    ap.add_argument("--contexts", default="256,1024,2048", help="context lengths of the plain-decode rows")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help=f"rows beside hetero INT8 and the peers: some of {', '.join(BASELINES)}, or none")
    ap.add_argument("--plain-only", action="store_true",
                    help="only the plain-decode rows (no speculation, no end to end), written as decode_plain.*")
    ap.add_argument("--decode-forms", default="",
                    help=f"more hetero rows in the plain rounds, hetero_<form> (`hetero run --decode-form`): some "
                         f"of {', '.join(DECODE_FORMS[1:])}")
    add_out_arg(ap, "decode*.json/.md/.png")


def run(args: argparse.Namespace) -> int:
    peers = PEERS if args.peers == "all" else () if args.peers == "none" else tuple(
        p.strip() for p in args.peers.split(",") if p.strip())
    if any(p not in PEERS for p in peers):
        raise ConfigError(f"--peers must name peers of {', '.join(PEERS)}, got {args.peers!r}")
    repeats = 1 if args.quick else args.repeats
    try:
        lens = (256,) if args.quick else tuple(int(x) for x in args.contexts.split(","))
    except ValueError:
        lens = ()
    if not lens or any(n < 1 or n > 4096 for n in lens):
        raise ConfigError(f"--contexts must be comma-separated lengths in 1..4096, got {args.contexts!r}")
    baselines = () if args.baselines == "none" else tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    if any(b not in BASELINES for b in baselines):
        raise ConfigError(f"--baselines must name some of {', '.join(BASELINES)} or none, got {args.baselines!r}")
    if not args.plain_only and baselines != BASELINES:
        raise ConfigError("the speculative and end-to-end rows run every baseline: --baselines needs --plain-only")
    model = load_model(args.model)
    tok = model.tokenizer
    methods = ("hetero", "float") if baselines else ("hetero",)  # HF generate continues the float prefill
    forms = opt_in_decode_forms(args.decode_forms)
    if forms and not args.plain_only:
        raise ConfigError("--decode-forms adds plain rows: it needs --plain-only")
    eng = Engines(model, args.threads, peers, model_path=args.model, methods=methods, decode_forms=forms)
    text_ids = tok(TEXT.read_text())["input_ids"]
    result: dict = {"model": model.name, "command": "python bench/decode.py " + " ".join(sys.argv[1:]), "threads": args.threads, "repeats": repeats, "cpu_count": os.cpu_count(),
                    "isa": isa.machine(), "host": host(), "machine": describe(host()),
                    "peers": {p: LABELS[p] for p in peers}, "skipped": eng.skipped, "plain": [], "speculative": [], "e2e": []}
    for n in lens:
        ids = text_ids[5000 : 5000 + n]
        row: dict = {"context": n, "load_before": load()}
        # Rounds interleave the engines (each call: a warm-up run, then one timed run), so that a slow stretch of
        # the shared machine touches every engine alike; hetero vs llama.cpp is also taken round by round.
        rounds: dict[str, list] = {e: [] for e in ("hetero", *(f"hetero_{f}" for f in forms), *baselines, *peers)}
        for _ in range(repeats):
            for engine, got in rounds.items():
                n_new = args.new if engine != "float" else max(8, args.new // 2)
                d = eng.decode(engine, ids, n_new, 1)
                got.append(d.get("tokens_per_s", d.get("skipped")))
        for engine, got in rounds.items():
            row[engine] = statistics.median(got) if all(isinstance(x, float) for x in got) else got[0]
            print(f"context {n} {engine}: {row[engine]} tokens/s, rounds {got} (load {load()})", flush=True)
        row["rounds"] = rounds
        ran = [p for p in peers if isinstance(row[p], float)]
        if ran:  # the fastest peer by its median; hetero over it round by round
            best = max(ran, key=lambda p: row[p])
            row["best_peer"] = best
            for h in [e for e in rounds if e.startswith("hetero") and isinstance(row[e], float)]:
                row[f"{h}_over_best_peer"] = round(statistics.median(x / c for x, c in zip(rounds[h], rounds[best])), 2)
        row["load_after"] = load()
        result["plain"].append(row)
    if not args.plain_only:
        speculative_and_e2e(eng, tok, repeats, args.quick, result)
    eng.close()
    out = out_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode_quick" if args.quick else "decode_plain" if args.plain_only else "decode"
    with atomic_path(out / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    write_md(result, out / f"{name}.md")
    plot(result, out / f"{name}.png")
    wrote([out / f"{name}.{ext}" for ext in ("json", "md", "png")])
    return 0


def speculative_and_e2e(eng: Engines, tok, repeats: int, quick: bool, result: dict) -> None:
    """The token-tree speculation rows and the end-to-end rows, into `result`."""
    emma = TEXT.read_text()
    start = emma.index("Emma Woodhouse, handsome")
    edit = ("Rewrite the following text, replacing the name Emma with Anne and keeping everything else exactly "
            "the same:\n\n")
    tasks = {  # the long text's answer is a copy for all the generated tokens; the short one's ends near token 60
        "copy-heavy (edit a 1,400-character shipped text)": edit + emma[start : start + 1400],
        "copy-heavy, short (edit 700 characters; past its end of turn)": edit + emma[start : start + 700],
        "open chat": "Write a short story about a lighthouse keeper who befriends a seagull.",
    }
    n_spec = 32 if quick else 128
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
    result["e2e"] = e2e(eng, lc, 32 if quick else 128, repeats)
    for r in result["e2e"]:
        print(r, flush=True)


def write_md(r: dict, path: Path) -> None:
    lines = [f"# Decode benchmark ({r['model']}, {r['threads']} threads, median of {r['repeats']})", "",
             f"Reproduce: `{r.get('command', 'python bench/decode.py')}`. `load` is the 1-minute load average when measured. "
             f"CPU: {r.get('machine', '?')}.", "",
             "## Plain greedy decode, tokens/s", "",
             "Median of rounds that interleave the engines (each peer in a process of its own); the ratio is the "
             "median of the rounds' hetero / the fastest peer. `hetero` is the default method; its decode GEMVs read "
             "the GGUF's own Q4_1 / Q8_0 blocks where the file holds them, else hetero's INT8 form "
             "(`hetero info` says which).", "",
             "| context | hetero | hetero float | HF generate | fastest peer | its tokens/s | hetero / fastest peer "
             "| hetero rounds | fastest peer rounds | load |",
             "|---:|---:|---:|---:|---|---:|---:|---|---|---|"]
    for row in r["plain"]:
        rounds, best = row.get("rounds", {}), row.get("best_peer")
        lines.append(f"| {row['context']} | {row['hetero']} | {row.get('float', '—')} | {row.get('hf', '—')} | {best or '—'} | "
                     f"{row[best] if best else ''} | {row.get('hetero_over_best_peer', '')} | {rounds.get('hetero', '')} | "
                     f"{rounds.get(best, '') if best else ''} | {row['load_before']}–{row['load_after']} |")
    made = [k for k in r["plain"][0] if k.startswith("hetero_") and not k.endswith("_over_best_peer")] if r["plain"] else []
    if made:  # hetero's opt-in decode forms (`hetero run --decode-form`)
        lines += ["", "### hetero with `--decode-form` (opted into: blocks made from the file's float weights)", "",
                  "| context | " + " | ".join(f"{m} | {m} / fastest peer" for m in made) + " |",
                  "|---:|" + "---:|---:|" * len(made)]
        lines += [f"| {row['context']} | " + " | ".join(f"{row.get(m, '')} | {row.get(f'{m}_over_best_peer', '')}"
                                                      for m in made) + " |" for row in r["plain"]]
    peers = list(r.get("peers", {}))
    if peers:
        lines += ["", "### Every peer, tokens/s (median of the rounds)", "",
                  "| context | " + " | ".join(peers) + " |", "|---:|" + "---:|" * len(peers)]
        lines += [f"| {row['context']} | " + " | ".join(str(row.get(p, '')) for p in peers) + " |" for row in r["plain"]]
        lines += ["", "; ".join(f"`{k}`: {v}" for k, v in r["peers"].items()) + "."]
    if r.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items())]
    if not r["speculative"] and not r["e2e"]:  # --plain-only
        with atomic_path(path) as tmp:
            tmp.write_text("\n".join(lines) + "\n")
        return
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
    for key, label in (("hetero", "hetero"), ("float", "hetero float"), ("hf", "HF generate"),
                       *((p, p.replace("_", " ")) for p in r.get("peers", {}))):
        vals = [row.get(key) if isinstance(row.get(key), (int, float)) else np.nan for row in r["plain"]]
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

