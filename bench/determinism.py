"""The same question gets the same answer (issue 40): decoding, the prefill's cuts and serve's cache, measured.

1. decode: 9 chat prompts (the issue's poem first), each decoded greedily 40 tokens `--repeats` times with
   speculation lookup, self and off, and sampled with seed 1 (lookup and off), while another process keeps one
   core busy; and the poem through the real CLI (`hetero run ... --json`), lookup / self / off. Counts the distinct
   texts per prompt: 1 everywhere is the claim.
2. prefill: how far a prompt's logits and K/V move when it is prefilled cut at P (P tokens, then the rest on the
   cache) against cold, per method: the bound serve's exact reuse exists for (`serve.store`).
3. serve: 8 prompts (> one segment) greedy 32 tokens cold, with a partial cached prefix, again and after a flush, with
   `--reuse exact` (the default) and `any`: how many replies equal the cold one.

    python bench/determinism.py --out bench/results    # writes determinism.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import hashlib
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bench.entry import add_out_arg, out_dir, write_json_md, wrote
from bench.host import describe, host
from hetero.arguments import positive_int

HELP = "the same question gets the same answer: decoding under load, the prefill's cuts, serve's cache (issue 40)"
PROMPTS = ("Write a short poem about the sea.", "What is the capital of France? Answer in one sentence.",
           "Explain what a prime number is.", "List three uses of copper.", "Why is the sky blue?",
           "Translate 'good morning' into Spanish and French.", "Give me a recipe for pancakes.",
           "What causes the seasons on Earth?", "Describe a cat to someone who has never seen one.")
ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning on one core meanwhile."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def _digest(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()[:8]


def decode_runs(model, repeats: int) -> list[dict[str, Any]]:
    """Distinct texts per prompt and mode over `repeats` in-process decodes of the default method."""
    from hetero.decode import SamplingParams, generate
    from hetero.methods import make_runtime

    rt = make_runtime(model)
    tok = model.tokenizer
    modes = {"greedy lookup": ("lookup", None), "greedy self": ("self", None), "greedy off": ("off", None),
             "seed 1 lookup": ("lookup", 1), "seed 1 off": ("off", 1)}
    rows = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        row: dict[str, Any] = {"prompt": prompt}
        for name, (spec, seed) in modes.items():
            params = SamplingParams(max_new_tokens=40, temperature=0.0 if seed is None else 0.8, seed=seed)
            texts = [generate(rt, rt.prefill(ids), params, speculate=spec, context_ids=ids).text for _ in range(repeats)]
            row[name] = sorted({_digest(t) for t in texts})
        greedy = {d for name in modes if name.startswith("greedy") for d in row[name]}
        sampled = {d for name in modes if name.startswith("seed") for d in row[name]}
        row["greedy texts"], row["seed 1 texts"] = len(greedy), len(sampled)
        rows.append(row)
        print(f"decode | {prompt[:40]:40s} | greedy texts {len(greedy)} | seed 1 texts {len(sampled)}", file=sys.stderr)
    return rows


def cli_runs(repeats: int) -> dict[str, list[str]]:
    """The issue's check itself: `hetero run` of the poem, 40 tokens, per speculation mode."""
    out: dict[str, list[str]] = {}
    for spec in ("lookup", "self", "off"):
        texts = []
        for _ in range(repeats):
            got = subprocess.run([sys.executable, "-m", "hetero", "run", PROMPTS[0], "-n", "40", "--json",
                                  "--speculate", spec], capture_output=True, text=True, check=True, cwd=ROOT)
            texts.append(_digest(json.loads(got.stdout)["text"]))
        out[spec] = texts
        print(f"cli | {spec} | {sorted(set(texts))}", file=sys.stderr)
    return out


def prefill_cuts(model, methods: list[str]) -> list[dict[str, Any]]:
    """Cold against cut-and-continued prefills of 700 tokens of Austen, per method and cut."""
    from hetero.methods import make_runtime
    from hetero.outliers.corpus import prompt_ids

    ids = prompt_ids(None, 700).tolist()
    rows = []
    for method in methods:
        rt = make_runtime(model, method)
        cold = rt.prefill(ids)
        for cut in (16, 256, 300, 512):
            part = rt.prefill(ids[:cut])
            rest = rt.prefill(ids[cut:], cache=part.cache)
            n = len(ids)
            dk = float(max(np.abs(rest.cache.k[i, :, :n] - cold.cache.k[i, :, :n]).max() for i in range(model.config.n_layers)))
            rows.append({"method": method, "cut": cut, "max_abs_logits": float(np.abs(rest.logits - cold.logits).max()),
                         "max_abs_k": dk, "same_top1": int(np.argmax(rest.logits)) == int(np.argmax(cold.logits))})
            print(f"prefill | {method} | cut {cut} | {rows[-1]}", file=sys.stderr)
        rt.close()
    return rows


def serve_runs(model) -> list[dict[str, Any]]:
    """8 prompts cold, after a prompt sharing a partial prefix, and after a flush, per reuse mode."""
    from hetero.decode import SamplingParams
    from hetero.methods import make_runtime
    from hetero.outliers.corpus import prompt_ids
    from hetero.serve import Service, StoreConfig
    from hetero.serve.store import SEGMENT

    rt = make_runtime(model)
    book = prompt_ids(None, SEGMENT + 8 * 40 + 100).tolist()
    prompts = [book[: SEGMENT + 60 + 40 * i] for i in range(8)]  # each holds the one before it: a partial prefix
    greedy = SamplingParams(max_new_tokens=32)
    rows = []
    for exact in (True, False):
        same = {"partial prefix": 0, "again": 0, "after flush": 0}
        cold = []
        for p in prompts:  # each prompt cold in a service of its own
            with Service(rt, StoreConfig(exact=exact)) as s:
                cold.append(s.complete(p, greedy).tokens)
        with Service(rt, StoreConfig(exact=exact)) as s:
            s.complete(book[: SEGMENT + 30], greedy)  # a partial prefix of prompt 0
            for i, p in enumerate(prompts):
                same["partial prefix"] += s.complete(p, greedy).tokens == cold[i]  # prompt i - 1 cached
            for i, p in enumerate(prompts):
                same["again"] += s.complete(p, greedy).tokens == cold[i]
            s.flush()
            for i, p in enumerate(prompts):
                same["after flush"] += s.complete(p, greedy).tokens == cold[i]
        rows.append({"reuse": "exact" if exact else "any", **{k: f"{v} of 8" for k, v in same.items()}})
        print(f"serve | {rows[-1]}", file=sys.stderr)
    rt.close()
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Determinism (issue 40)", "", f"{result['host']}; {result['date']}; `{result['command']}`", "",
             f"## Decoding: distinct texts over {result['repeats']} runs per mode, 40 tokens, one core kept busy", "",
             "| prompt | greedy lookup | greedy self | greedy off | greedy texts | seed 1 lookup | seed 1 off | "
             "seed 1 texts |", "|---|---|---|---|---|---|---|---|"]
    for r in result["decode"]:
        lines.append(f"| {r['prompt']} | {' '.join(r['greedy lookup'])} | {' '.join(r['greedy self'])} | "
                     f"{' '.join(r['greedy off'])} | {r['greedy texts']} | {' '.join(r['seed 1 lookup'])} | "
                     f"{' '.join(r['seed 1 off'])} | {r['seed 1 texts']} |")
    lines += ["", f"`hetero run` (the poem, 40 tokens, {result['cli_repeats']} processes per mode, one core busy): "
              + "; ".join(f"{k}: {' '.join(sorted(set(v)))}" for k, v in result["cli"].items()), "",
              "## Prefill: a prompt cut at P and continued against cold (700 tokens of Austen)", "",
              "| method | cut | max abs logits | max abs K | same top-1 |", "|---|---|---|---|---|"]
    for r in result["prefill"]:
        lines.append(f"| {r['method']} | {r['cut']} | {r['max_abs_logits']:.3g} | {r['max_abs_k']:.3g} | "
                     f"{r['same_top1']} |")
    lines += ["", "## Serve: 8 prompts of 572-852 tokens, greedy 32, replies equal to the prompt's cold reply", "",
              "| reuse | partial prefix | again | after flush |", "|---|---|---|---|"]
    for r in result["serve"]:
        lines.append(f"| {r['reuse']} | {r['partial prefix']} | {r['again']} | {r['after flush']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive_int, default=10, help="in-process decodes per prompt and mode")
    p.add_argument("--cli-repeats", type=positive_int, default=10, help="`hetero run` processes per mode")
    p.add_argument("--methods", default="hetero,hetero-lanes,float", help="methods whose prefill cuts are measured")
    add_out_arg(p, "determinism.{json,md}")


def run(args: argparse.Namespace) -> int:
    from hetero.loader import load_model

    model = load_model()
    with busy_core():
        decode = decode_runs(model, args.repeats)
        cli = cli_runs(args.cli_repeats)
    result = {"host": describe(host()), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python bench/determinism.py " + " ".join(sys.argv[1:]), "repeats": args.repeats,
              "cli_repeats": args.cli_repeats, "decode": decode, "cli": cli,
              "prefill": prefill_cuts(model, [m for m in args.methods.split(",") if m]), "serve": serve_runs(model)}
    wrote(write_json_md(out_dir(args.out), "determinism", result, markdown(result)))
    print(markdown(result))
    return 0
