"""The `hetero` command line: run, info, and the subcommands each subpackage registers.

Every deliberate error (`HeteroError`) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from typing import Any

from hetero.errors import ConfigError, HeteroError

# Subpackages add their own subcommands: module path -> `register(subparsers)`.
_PLUGINS = ("hetero.outliers.cli", "hetero.npu.cli", "hetero.sched.cli", "hetero.bench_cli")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: $HETERO_MODEL or SmolLM2-135M-Instruct)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero", description="Fast LLM prefill on NPU + CPU/GPU (mllm-NPU).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hetero decides")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="prefill a chat prompt with hetero, then decode the answer")
    run.add_argument("prompt")
    add_model_arg(run)
    run.add_argument("--chunk", type=positive_int, default=256, help="chunk length C (default 256)")
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    run.add_argument("--raw", action="store_true", help="do not apply the chat template")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    add_backend_args(run)
    run.set_defaults(func=cmd_run)

    info = sub.add_parser("info", help="show the model, its config and the backends present")
    add_model_arg(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Backend selection shared by `run` and the benchmarks (see `hetero.engine`)."""
    from hetero.engine import BACKENDS, DEFAULT_BACKEND

    from hetero.outliers.quantize import WEIGHT_FORMS

    p.add_argument("--backend", choices=sorted(BACKENDS), default=DEFAULT_BACKEND,
                   help=f"how static subgraphs run (default {DEFAULT_BACKEND})")
    p.add_argument("--weight-form", choices=["auto", *WEIGHT_FORMS], default="auto",
                   help="INT8 weight form on the CPU EP (default auto: w8-u8s8 with VNNI, w8-u8u8 on AVX2)")


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from hetero.adapters.hf import generate, to_hf_model
    from hetero.engine import make_runtime
    from hetero.loader import load_model

    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ConfigError("prompt is empty: give the text to answer, e.g. hetero run \"What is the capital of France?\"")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = model.tokenizer
    if tok is None:
        raise ConfigError(f"model {model.path} has no tokenizer: `hetero run` needs one to encode the prompt")
    if args.raw or not getattr(tok, "chat_template", None):
        ids = tok(args.prompt)["input_ids"]
    else:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    runtime = make_runtime(model, args.backend, chunk=args.chunk, threads=args.threads, weight_form=args.weight_form)
    prompt = runtime.check_ids(ids)
    runtime.prefill(prompt[: min(prompt.numel(), args.chunk)])  # warm-up: first-call allocations, lazy inits
    result = runtime.prefill(prompt)
    hf = to_hf_model(model)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)  # the runtime may have split cores between lanes
    t0 = time.perf_counter()
    new = generate(hf, prompt, result, args.max_new_tokens)
    decode_s = time.perf_counter() - t0
    text = tok.decode(new, skip_special_tokens=True).strip()
    out: dict[str, Any] = {
        "text": text,
        "prompt_tokens": result.n_tokens,
        "prefill_ms": round(result.total_ms, 2),
        "prefill_tokens_per_s": round(result.tokens_per_s, 1),
        "decode_tokens_per_s": round(len(new) / decode_s, 1) if new and decode_s > 0 else 0.0,
        "new_tokens": len(new),
        "backend": args.backend,
        "weight_form": getattr(getattr(runtime.backend, "plan", None), "weight_form", None),
        "chunk": args.chunk,
        "model": model.name,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(text)
        print(
            f"[{out['prompt_tokens']} prompt tokens, prefill {out['prefill_ms']:.1f} ms "
            f"({out['prefill_tokens_per_s']:.0f} tokens/s, backend {args.backend}, C={args.chunk}); "
            f"decode {out['decode_tokens_per_s']:.1f} tokens/s]"
        )
    return 0


def backends_present() -> dict[str, Any]:
    """What this machine can run: ONNX Runtime providers, QNN HTP, torch devices."""
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
    from hetero.npu.lanes import qnn_devices

    try:
        devices = qnn_devices()
        info["qnn_htp"] = f"available ({len(devices)} device(s); on x86-64 Linux this is the HTP simulator)"
    except BackendUnavailable as e:
        info["qnn_htp"] = f"absent: {e}"
    return info


def cmd_info(args: argparse.Namespace) -> int:
    from hetero.loader import load_model

    model = load_model(args.model)
    out = {"model": model.name, "path": str(model.path), "fingerprint": model.fingerprint,
           "config": model.config.to_dict(), "backends": backends_present()}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"model        {out['model']}  ({out['path']}, fingerprint {out['fingerprint']})")
    for k, v in out["config"].items():
        print(f"  {k:<15}{v}")
    print("backends")
    for k, v in out["backends"].items():
        print(f"  {k:<15}{v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        return int(args.func(args) or 0)
    except HeteroError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
