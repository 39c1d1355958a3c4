"""`hetero run` (prefill a chat prompt, then decode) and `hetero info` (the model and what this machine runs)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from hetero.cli import add_command
from hetero.arguments import add_method_arg, add_model_arg, positive_int
from hetero.errors import ConfigError


def register(sub: Any) -> None:
    run = add_command(sub, "run")
    run.add_argument("prompt", nargs="?", help="the prompt; `-` reads it from standard input")
    run.add_argument("-f", "--file", help="read the prompt from this UTF-8 text file")
    run.add_argument("--system", help="system message (through the model's chat template)")
    add_model_arg(run)
    run.add_argument("--chunk", type=positive_int, default=None,
                     help="chunk length C (default: the method's, 256; hetero-qnn 128)")
    run.add_argument("-n", "--max-new-tokens", type=int, default=64, help="tokens to decode at most (default 64; "
                     "fewer when the context is full)")
    run.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                     help="say where the time went (imports, load, calibrate, build, prefill, decode "
                     "set-up, decode) and what hetero decides")
    run.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    run.add_argument("--raw", action="store_true", help="do not apply the chat template")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    add_method_arg(run)
    add_decode_args(run)
    run.set_defaults(func=cmd_run)

    info = add_command(sub, "info")
    add_model_arg(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)


class Timing:
    """Wall seconds per step of `hetero run`, in the order measured (`-v`; the JSON's `seconds`): imports
    (the process's start until the command ran: Python, imports, the parser; only when the process is the
    command), load, calibrate (the runtime's set-up besides its graphs: the rotated copy, the plan), build (its
    graphs loaded or built, and its decode step's LM head and compiled kernels), prefill (the process's first: it
    includes one-time set-up), decode set-up (the decode graphs loaded or built and bound, a draft model, step
    costs measured), decode (the tokens)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = time.perf_counter() - t0

    def split(self, step: str, first: str, second: str, second_s: float) -> None:
        """Replace `step` by two steps: `second` took `second_s` of it, `first` the rest."""
        total = self.seconds.pop(step)
        self.seconds[first], self.seconds[second] = max(0.0, total - second_s), min(second_s, total)

    def line(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """How `hetero run` decodes after the prefill (`hetero.decode`)."""
    from hetero.decode import SPECULATE
    from hetero.npu.placement import DECODE_FORMS

    p.add_argument("--decoder", choices=("hetero", "hf"), default="hetero",
                   help="hetero: decode on hetero's cache (default); hf: hand the cache to transformers generate()")
    p.add_argument("--speculate", choices=SPECULATE, default="auto",
                   help="token-tree drafter (LLMCad): auto = lookup where verifying a tree is exactly one-row steps "
                        "(default), lookup = n-grams of the context, draft = --draft-model, self = the model's first "
                        "layers, off")
    p.add_argument("--draft-model", help="draft model for --speculate draft (GGUF or HF directory, same tokenizer)")
    p.add_argument("--decode-form", choices=DECODE_FORMS, default="auto",
                   help="decode weights: auto = the GGUF's own Q4_1 / Q8_0 blocks where it has them, else INT8 "
                        "(default); q4_1 = Q4_1 blocks made from a float file's weights (head Q8_0), as a 4-bit "
                        "peer reads (fewer bytes a token, a second rounding); q4_1-all = the head in Q4_1 too")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> Any:
    """The decode options, checked before anything is loaded."""
    from hetero.decode import SamplingParams

    if args.speculate == "draft" and not args.draft_model:
        raise ConfigError("--speculate draft needs --draft-model PATH (a model sharing the tokenizer)")
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def _decode_hetero(args: argparse.Namespace, model: Any, runtime: Any, prompt: Any, result: Any,
                   timing: Timing) -> dict[str, Any]:
    from hetero.decode import Decoding
    from hetero.decode.step import DecodeStep
    from hetero.loader import load_model
    from hetero.methods import make_runtime

    from hetero.cli import start_up_done

    params = sampling_params(args)
    start_up_done()  # the decode loop makes garbage; what was built so far lives until exit
    with timing("decode set-up"):
        draft = None
        if args.speculate == "draft":
            draft = make_runtime(load_model(args.draft_model), args.method, chunk=args.chunk, threads=args.threads)
        # the one-row decode graphs bound; Decoding reads (or measures once) the step costs of the tree sizes
        DecodeStep.of(runtime).prepare(1)  # a tree size is bound at its first use, its cost stored (`stepcosts`)
        d = Decoding(runtime, result, params, args.speculate, prompt.tolist(), draft)
    with timing("decode"):
        for ev in d:
            if not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        if not args.json:
            sys.stdout.write("\n")
    g = d.result()
    return {"text": g.text.strip(), "new_tokens": len(g.tokens), "decode_tokens_per_s": round(g.tokens_per_s, 1),
            "finish_reason": g.finish_reason, "speculate": d.speculate, "accepted": g.accepted,
            "drafted": g.drafted, "acceptance_rate": round(g.acceptance_rate, 3), "target_steps": g.steps}


def _make_decode_step(runtime: Any) -> float:
    """Make the runtime's decode step now, before the prefill, whose last logits its LM head gives on an INT8
    runtime (`methods.make_runtime`): its head and compiled kernels load as part of "build", not of the prefill.
    Returns the seconds it took."""
    from hetero.decode.step import DecodeStep

    t0 = time.perf_counter()
    DecodeStep.of(runtime)  # its graphs bind at their first use ("decode set-up")
    return time.perf_counter() - t0


def cmd_run(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.methods import METHODS, make_runtime, use_threads

    from hetero.prompt import encode_prompt, new_token_budget, read_prompt

    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    args.chunk = args.chunk or METHODS[args.method].chunk
    text_in = read_prompt(args.prompt, args.file)
    if args.decoder == "hetero":
        sampling_params(args)
    elif args.decode_form != "auto":
        raise ConfigError(f"--decode-form {args.decode_form} is hetero's decoder's; --decoder hf decodes in float")
    use_threads(args.threads)
    timing = Timing()
    if getattr(args, "startup_s", None) is not None:
        timing.seconds["imports"] = args.startup_s
    with timing("load"):
        model = load_model(args.model)
    tok = model.tokenizer
    if tok is None:
        raise ConfigError(f"model {model.path} has no tokenizer: `hetero run` needs one to encode the prompt")
    ids = encode_prompt(tok, text_in, system=args.system, raw=args.raw)
    with timing("calibrate + build"):
        runtime = make_runtime(model, args.method, chunk=args.chunk, threads=args.threads,
                               weight_form=args.weight_form,
                               decode_form=args.decode_form if args.decoder == "hetero" else None)
        step_s = _make_decode_step(runtime) if args.decoder == "hetero" else 0.0
    timing.split("calibrate + build", "calibrate", "build", getattr(runtime.backend, "prepare_s", 0.0) + step_s)
    prompt = runtime.check_ids(ids)
    budget = new_token_budget(prompt.size, args.max_new_tokens, runtime.max_context)  # before the prefill
    # no warm-up prefill: the answer's wall time is what a user waits for, and a warm-up is a second prefill
    # (the graphs are [C, ·]: even one token costs a whole chunk). So this prefill is the process's first and
    # pays the one-time costs (numba's kernels loaded, first-run allocations); `hetero bench prefill` and
    # `hetero serve` (its warm-up) time warm ones.
    result = runtime.prefill(prompt)
    timing.seconds["prefill"] = result.total_ms / 1e3
    out: dict[str, Any] = {
        "prompt_tokens": result.n_tokens,
        "prefill_ms": round(result.total_ms, 2),  # the process's first prefill (see above)
        "prefill_tokens_per_s": round(result.tokens_per_s, 1),
        "method": args.method,
        "weight_form": getattr(getattr(runtime.backend, "plan", None), "weight_form", None),
        "chunk": args.chunk,
        "model": model.name,
        "decoder": args.decoder,
        "synthetic": model.synthetic,  # "<shape>, seed N" of generated weights, else None
    }
    if model.synthetic is not None:  # every output of such a model says what it cannot measure
        from hetero.loader import synthetic_line

        print(f"hetero: {synthetic_line(model)}", file=sys.stderr)
    verbose = getattr(args, "verbose", False)
    if args.decoder == "hetero":
        out["decode_on"] = dataclasses.asdict(runtime.decode)  # -v logs it (`methods.make_runtime`)
        args.max_new_tokens = budget
        out.update(_decode_hetero(args, model, runtime, prompt, result, timing))
    else:
        from hetero.adapters.hf import generate, to_hf_model
        from hetero.cli import start_up_done

        start_up_done()
        with timing("decode set-up"):
            hf = to_hf_model(model)
        with timing("decode"):
            new = generate(hf, prompt, result, budget)
        decode_s = timing.seconds["decode"]
        out.update(text=tok.decode(new, skip_special_tokens=True).strip(), new_tokens=len(new),
                   decode_tokens_per_s=round(len(new) / decode_s, 1) if new and decode_s > 0 else 0.0)
        if not args.json:
            print(out["text"])
    if verbose:
        out["seconds"] = {k: round(v, 3) for k, v in timing.seconds.items()}
        print(f"hetero: time: {timing.line()}; {out['new_tokens']} new tokens", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    else:  # the stats on stderr: stdout is the answer alone (`hetero run ... > answer.txt`)
        spec = (f", speculate {out['speculate']}: {out['accepted']}/{out['drafted']} drafted tokens accepted "
                f"({100 * out['acceptance_rate']:.0f}%)") if out.get("speculate", "off") != "off" else ""
        print(
            f"[{out['prompt_tokens']} prompt tokens, first prefill {out['prefill_ms']:.1f} ms "
            f"({out['prefill_tokens_per_s']:.0f} tokens/s, one-time set-up included; method {args.method}, "
            f"C={args.chunk}); "
            f"decode {out['decode_tokens_per_s']:.1f} tokens/s ({args.decoder}{spec})]", file=sys.stderr
        )
    return 0


def platform_info() -> dict[str, Any]:
    """What this machine can run: torch and its device, ONNX Runtime providers, QNN HTP."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "torch_device": "cuda" if torch.cuda.is_available() else "cpu",
                            "cpu_count": os.cpu_count()}
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except ImportError:
        info["onnxruntime"] = None
    from hetero.errors import BackendUnavailable
    from hetero.npu.providers import qnn_devices

    try:
        devices = qnn_devices()
        info["qnn_htp"] = f"available ({len(devices)} device(s); on x86-64 Linux this is the HTP simulator)"
    except BackendUnavailable as e:
        info["qnn_htp"] = f"absent: {e}"
    return info


def cmd_info(args: argparse.Namespace) -> int:
    from hetero.loader import load_model, synthetic_line
    from hetero.methods import DEFAULT_METHOD, host_plan

    model = load_model(args.model)
    if model.synthetic is not None:
        print(f"hetero: {synthetic_line(model)}", file=sys.stderr)
    threads = os.cpu_count() or 1
    plan = host_plan(model, DEFAULT_METHOD, threads=threads)  # what `hetero run` would run here
    out = {"model": model.name, "path": str(model.path), "fingerprint": model.fingerprint,
           "synthetic": model.synthetic,
           "config": model.config.to_dict(), "platform": platform_info(), "placement": placement_info(plan, threads),
           "host_plan": plan.to_dict(), "calibration": calibration_info(model)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"model        {out['model']}  ({out['path']}, fingerprint {out['fingerprint']})")
    for section in ("config", "platform", "placement", "host_plan", "calibration"):
        if section != "config":
            print(section.replace("_", " "))
        if section == "host_plan":  # each decision and its reason
            print("\n".join(f"  {line}" for line in plan.lines()))
            continue
        width = max(15, *(len(k) + 1 for k in out[section]))  # a space after the longest name ("local_rope_theta")
        for k, v in out[section].items():
            print(f"  {k:<{width}}{v}")
    return 0


def calibration_info(model) -> dict[str, str]:
    """Which calibration the default method runs (the shipped one unless HETERO_CALIBRATION=user) and where the
    user's is (`outliers.calibration.calibration_in_use`)."""
    from hetero.methods import DEFAULT_METHOD, METHODS, quant_model
    from hetero.outliers.calibration import calibration_in_use

    if model.config.quantized_unsupported() is not None:
        return {"in use": "none (the default runs this model in float)"}
    return calibration_in_use(quant_model(model, METHODS[DEFAULT_METHOD].recipe))


def placement_info(plan: Any, threads: int) -> dict[str, str]:
    """How the default method's host plan (`methods.host_plan`) lays out a prefill on this host, and why."""
    if plan.layout is None:
        return {"prefill": f"float ({plan.method.reason})"}
    return {"prefill": plan.layout.describe(), "method": f"{plan.method.value} (C={plan.chunk}, {threads} threads)"}
