"""`hetero bench decode_accuracy`: how far each decode form's tokens are from the float model's (issue 24 item 3).

`bench/accuracy.py` measures the prefill's graphs; a decode step runs other graphs (`decode.step.DecodeStep`: the
INT8 graphs at decode sizes with their shadow corrections, or the MatMulNBits graphs of `npu.nbits`, and the INT8
LM head). Here each form decodes held-out text teacher-forced, one token a step: after a prefill of the window's
first `--prefix` tokens, every later token is fed to a one-row step whose logits score the next one. Reported per
text: the perplexity of the tokens the steps predicted, its change vs the float model's decode, and the share
of positions whose argmax equals float's. Then greedy agreement on chat prompts (tokens before the first
difference from float's greedy decode). Forms: `float` (the float method's step), `int8` (the default method's
decode with its INT8 graphs and INT8 head, the form before `npu.nbits`), `nbits` (its MatMulNBits graphs and head)
`gemv` (hetero's int8 GEMVs over the same 8-bit weights, `native.gemv`, where the CPU has AVX-512 VNNI) and `blocks`
(the default method's decode as its placement runs it where the model's GGUF holds Q4_1 / Q8_0 blocks: the same
kernels over the file's own blocks, `decode.gguf_blocks`); each left out where it cannot run. `--decode-forms`
adds the opt-in forms (`hetero run --decode-form q4_1`, `q4_1-all`: blocks made from a float file's tensors);
`--float-copy` runs every form on a float32 copy of the GGUF (its tensors dequantized, the same weights), so that the
made forms have float tensors to round and can be set beside the file's own blocks on a real model.

    python bench/decode_accuracy.py --texts austen,FILE.txt    # prints a table
    python bench/decode_accuracy.py --out bench/results        # also writes decode_accuracy.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.arguments import add_model_arg, opt_in_decode_forms, positive_int
from bench.entry import write_json_md
from bench.host import describe, host

HELP = ("teacher-forced decode perplexity and greedy agreement of the decode forms (float, INT8, MatMulNBits, GEMV, "
        "GGUF blocks)")
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a hash table is in one sentence.", "List three fruits.",
           "Why is the sky blue?", "Give me a short tip for learning to cook.",
           "Translate 'good morning' into Spanish.", "What does a compiler do?")
TEXT_CHARS = 400_000  # of each text, from its --offset character on: enough for the windows, quick to tokenize


def text_windows(tokenizer, text: str, windows: int, length: int) -> list[list[int]]:
    """`windows` windows of `length` token ids spread evenly over the text (each its own stretch of it)."""
    from hetero.errors import ConfigError

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < windows * length:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than {windows} windows of {length}")
    stride = len(ids) // windows
    return [ids[i * stride : i * stride + length] for i in range(windows)]


@torch.inference_mode()
def teacher_forced(runtime, step, window: list[int], prefix: int) -> tuple[list[float], list[int]]:
    """(the negative log-likelihood of each token after the first decode step's, the argmax before it) over one
    window: a prefill of its first `prefix` tokens, then one token a step."""
    from hetero.decode.tree import TokenTree

    cache = runtime.prefill(window[:prefix]).cache
    nll, top = [], []
    for i in range(prefix, len(window) - 1):
        logits = torch.from_numpy(step.forward(cache, TokenTree.chain([window[i]]))[0])  # numpy float32 [vocab]
        cache.accept_path([0])
        nll.append(float(-torch.log_softmax(logits, -1)[window[i + 1]]))
        top.append(int(logits.argmax()))
    return nll, top


@torch.inference_mode()
def greedy(runtime, step, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`: the prefill's last logits, then one-row steps of `step`."""
    from hetero.decode.tree import TokenTree

    r = runtime.prefill(ids)
    cache, out = r.cache, [int(r.logits.argmax())]
    for _ in range(n - 1):
        logits = step.forward(cache, TokenTree.chain([out[-1]]))[0]
        cache.accept_path([0])
        out.append(int(logits.argmax()))
    return out


# what a float copy cannot measure: the copy's floats are the file's own values, so re-rounding them to their own form
FLOAT_COPY_CAVEAT = ("; a made form that re-rounds tensors the file kept in that form (this file's Q4_1 linears) "
                     "lands back on their grid: its row measures only the tensors the file kept finer (the Q8_0 head)")


def float_copy(path: Path, out: Path) -> Path:
    """A GGUF of the same model with every tensor dequantized to float32 (metadata and tokenizer copied), written
    once to `out` (atomically): the same float weights as `path`'s, in a file the made decode forms can round."""
    import gguf

    from hetero.paths import atomic_path

    if out.is_file():
        return out
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue  # the writer's own
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        for t in reader.tensors:
            writer.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def prefix_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def markdown(r: dict[str, Any]) -> str:
    forms = r["forms"]
    lines = [f"# Decode accuracy by form ({r['model']})", "",
             f"Reproduce: `{r['command']}`. CPU: {r['cpu']}. {r['note']}", "",
             f"Teacher-forced decode: {r['windows']} windows of {r['length']} tokens per text, a prefill of the first "
             f"{r['prefix']}, then one-row decode steps; perplexity of the {r['scored_per_text']} tokens per text the "
             "steps predicted (the prefill's own prediction not counted); top-1 = float: positions whose argmax equals "
             "the float decode's.", "",
             "| text | " + " | ".join(f"{f} ppl" for f in forms) + " | "
             + " | ".join(f"{f} Δ vs float" for f in forms if f != "float") + " | "
             + " | ".join(f"{f} top-1 = float" for f in forms if f != "float") + " |",
             "|---|" + "---:|" * (3 * len(forms) - 2)]
    for name, row in list(r["texts"].items()) + [("all", r["all"])]:
        lines.append(f"| {name} | " + " | ".join(f"{row['ppl'][f]:.4f}" for f in forms) + " | "
                     + " | ".join(f"{row['delta_pct'][f]:+.2f}%" for f in forms if f != "float") + " | "
                     + " | ".join(f"{100 * row['top1'][f]:.1f}%" for f in forms if f != "float") + " |")
    if r.get("greedy"):
        lines += ["", f"## Greedy decode vs float's ({r['greedy_tokens']} tokens, chat prompts): tokens before the "
                  "first difference", "", "| prompt | " + " | ".join(f for f in forms if f != "float") + " |",
                  "|---|" + "---:|" * (len(forms) - 1)]
        for p, row in r["greedy"].items():
            lines.append(f"| {p} | " + " | ".join(str(row[f]) for f in forms if f != "float") + " |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    from hetero.npu.placement import DECODE_FORMS

    add_model_arg(p)
    p.add_argument("--texts", default="austen",
                   help="comma-separated held-out texts: shipped corpus names or UTF-8 files (not the calibration text)")
    p.add_argument("--offset", type=int, default=0, help="character offset into each text")
    p.add_argument("--windows", type=positive_int, default=3, help="windows per text")
    p.add_argument("--length", type=positive_int, default=160, help="tokens per window")
    p.add_argument("--prefix", type=positive_int, default=32, help="tokens of a window prefilled before decoding")
    p.add_argument("--greedy-tokens", type=int, default=24, help="greedy tokens per chat prompt (0: skip)")
    p.add_argument("--out", default=None, help="directory for decode_accuracy.json/.md (decode_accuracy_<model>.* "
                                                 "with --model; default: print only)")
    p.add_argument("--decode-forms", default="",
                   help=f"opt-in decode forms to add (`hetero run --decode-form`), comma-separated: some of "
                        f"{', '.join(DECODE_FORMS[1:])}")
    p.add_argument("--float-copy", action="store_true",
                   help="run on a float32 copy of the GGUF (the same weights; the made forms need float tensors), "
                        "written to <cache>/bench/ once; results in decode_accuracy_float_copy.json/.md")


def run(args: argparse.Namespace) -> int:
    from hetero.decode.step import DecodeStep
    from hetero.errors import ConfigError
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.outliers.corpus import load_corpus
    from hetero.paths import cache_dir, file_fingerprint
    from hetero.prompt import encode_prompt

    if not 1 < args.prefix < args.length - 1:
        raise ConfigError(f"--prefix must lie in 2..{args.length - 2} (--length {args.length})")
    made = opt_in_decode_forms(args.decode_forms)
    model = load_model(args.model)
    if args.float_copy:
        if Path(model.path).suffix.lower() != ".gguf":
            raise ConfigError(f"--float-copy copies a GGUF file; {model.path} is not one")
        src = Path(model.path)
        model = load_model(float_copy(src, cache_dir() / "bench" / f"{src.stem}-{file_fingerprint(src)}.f32.gguf"))
    tok = model.tokenizer
    from hetero.npu.nbits import DEFAULT_FORM

    from hetero.native import gemv

    runtimes = {"float": make_runtime(model, "float"), "int8": make_runtime(model), "nbits": make_runtime(model),
                "gemv": make_runtime(model), "blocks": make_runtime(model)}
    # today's INT8 decode before the MatMulNBits form: its steps and its prefill's last logits (the runtime's own
    # step's head) on the INT8 graphs and head; the MatMulNBits graphs and head where the placement runs the GEMVs
    def placed(rt, **changes) -> None:  # a runtime's decode placement changed (the host plan it reads it from)
        rt.host_plan = dataclasses.replace(rt.host_plan, decode=dataclasses.replace(rt.decode, **changes))

    placed(runtimes["int8"], small_rows=0, small_form="")
    placed(runtimes["nbits"], small_kernel="nbits", small_form=DEFAULT_FORM.describe())
    if runtimes["blocks"].decode.small_kernel != "blocks":  # a model without those blocks: its placement's GEMVs
        del runtimes["blocks"]
    if runtimes["gemv"].decode.small_kernel == "nbits":  # this CPU or model: the placement runs the graphs
        del runtimes["gemv"]
    else:
        placed(runtimes["gemv"], small_kernel="gemv", small_form=gemv.describe())
    for f in made:
        try:
            runtimes[f] = make_runtime(model, decode_form=f)
        except ConfigError as e:
            print(f"{f} left out: {e}", file=sys.stderr)
    steps = {f: DecodeStep.of(rt) for f, rt in runtimes.items()}
    if steps["nbits"].small_rows == 0:
        raise ConfigError("this runtime's decode placement runs no MatMulNBits graphs: nothing to compare")
    forms = list(steps)
    texts: dict[str, Any] = {}
    total: dict[str, list[float]] = {f: [] for f in forms}
    agree_all: dict[str, list[bool]] = {f: [] for f in forms}
    t0 = time.perf_counter()
    for name in [t.strip() for t in args.texts.split(",") if t.strip()]:
        text = load_corpus(name)[args.offset : args.offset + TEXT_CHARS]
        windows = text_windows(tok, text, args.windows, args.length)
        nll: dict[str, list[float]] = {f: [] for f in forms}
        top: dict[str, list[int]] = {f: [] for f in forms}
        for w in windows:
            for f in forms:
                a, b = teacher_forced(runtimes[f], steps[f], w, args.prefix)
                nll[f] += a
                top[f] += b
        agree = {f: [x == y for x, y in zip(top[f], top["float"])] for f in forms}
        for f in forms:
            total[f] += nll[f]
            agree_all[f] += agree[f]
        texts[Path(name).name] = _row(nll, agree)
        print(f"{name}: " + ", ".join(f"{f} {texts[Path(name).name]['ppl'][f]:.3f}" for f in forms), flush=True)
    greedy_rows: dict[str, dict[str, int]] = {}
    if args.greedy_tokens > 0:
        for p in PROMPTS:
            ids = encode_prompt(tok, p)
            ref = greedy(runtimes["float"], steps["float"], ids, args.greedy_tokens)
            greedy_rows[p] = {f: prefix_equal(ref, greedy(runtimes[f], steps[f], ids, args.greedy_tokens))
                              for f in forms if f != "float"}
    scored = len(total["float"]) // max(1, len(texts))
    result = {"model": model.name, "forms": forms, "texts": texts, "all": _row(total, agree_all),
              "windows": args.windows, "length": args.length, "prefix": args.prefix, "scored_per_text": scored,
              "greedy": greedy_rows, "greedy_tokens": args.greedy_tokens, "cpu": describe(host()),
              "nbits_form": steps["nbits"].backend(1).form.describe(), "heads": {f: s.head.name for f, s in steps.items()},
              "note": (f"nbits: {steps['nbits'].backend(1).form.describe()}"
                       + (f"; gemv: {runtimes['gemv'].decode.small_form}" if "gemv" in steps else "")
                       + (f"; blocks: {runtimes['blocks'].decode.small_form}" if "blocks" in steps else "")
                       + "".join(f"; {f}: {runtimes[f].decode.small_form}" for f in made if f in steps)
                       + (f"; every form on a float32 copy of the GGUF (its tensors dequantized: the same weights){FLOAT_COPY_CAVEAT}"
                          if args.float_copy else "")
                       + f"; {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.2f}."),
              "command": "python bench/decode_accuracy.py " + " ".join(sys.argv[1:])}
    if args.out:
        write_json_md(Path(args.out), "decode_accuracy" + ("_float_copy" if args.float_copy else "")
                      + (f"_{Path(args.model).stem}" if args.model else ""), result, markdown(result))
    print(markdown(result))
    return 0


def _row(nll: dict[str, list[float]], agree: dict[str, list[bool]]) -> dict[str, Any]:
    ppl = {f: math.exp(sum(v) / len(v)) for f, v in nll.items()}
    return {"ppl": ppl, "delta_pct": {f: 100 * (ppl[f] / ppl["float"] - 1) for f in ppl},
            "top1": {f: sum(v) / len(v) for f, v in agree.items()}, "tokens": len(nll["float"])}
