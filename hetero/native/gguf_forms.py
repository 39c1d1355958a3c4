"""Which of a GGUF file's tensors are in the small block forms hetero's GEMVs read (Q4_1, Q8_0), from the file's header
alone: the host plan asks it before any weight is read (`npu.placement.decode_placement_of`), and the decode step's
block weights read their tensors' offsets from it (`decode.gguf_blocks`). The header's tokenizer arrays are skipped
without decoding them (11 ms for SmolLM2's; gguf's reader parses them all: 0.8-2.8 s).
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero import layerspec
from hetero.errors import ConfigError
from hetero.weights import SITE_LINEARS

if TYPE_CHECKING:
    from hetero.loader import Model

FORMS = {2: "q4_0", 3: "q4_1", 8: "q8_0"}  # GGML type ids of the small block forms (q4_0: named, not computed)
COMPUTED = ("q4_1", "q8_0")  # the forms the kernels read (`native.gemv.pack_blocks`)
FLOATS = {0: "f32", 1: "f16", 30: "bf16"}  # GGML type ids of the float forms blocks may be made from
# `--decode-form`: the forms hetero may make from a file's float tensors, (its linears', its head's). "q4_1" keeps the
# head in Q8_0, as the default model's file and OpenVINO's INT4 export do (the head is read once a token); "q4_1-all"
# rounds the head to Q4_1 too, as ONNX Runtime GenAI's int4 builder does (MatMulNBits, 4 bits, block 32): ~13% fewer
# bytes a step at 1B width (the head is 0.28 of them), at +7.3% decode perplexity on the default model's weights
# against q4_1's +0.16% (bench/results/decode_accuracy_float_copy.md; that file's linears are Q4_1 already, so q4_1's
# cost on float linears is not measured: neither real model here is float)
MADE = {"q4_1": ("q4_1", "q8_0"), "q4_1-all": ("q4_1", "q4_1")}
ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # a tensor per linear (phi3 fuses q|k|v: not here)
_TENSOR = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
           "w_up": "ffn_up", "w_down": "ffn_down"}  # a linear's GGUF tensor in blk.N


@dataclass(frozen=True, slots=True)
class Tensor:
    """A GGUF tensor's entry: GGML type id, shape (ne0 = K first), byte offset in the file."""

    type: int
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class GgufTable:
    """A GGUF file's architecture and tensor entries, read from its header alone."""

    arch: str
    tensors: dict[str, Tensor]

    def form(self, name: str) -> str:
        """The block form of tensor `name` ("q4_1", ...), or its GGML type id as text."""
        t = self.tensors[name].type
        return FORMS.get(t) or FLOATS.get(t) or f"type {t}"


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@functools.lru_cache(maxsize=8)
def _table(path: str, stamp: tuple[int, int]) -> GgufTable:
    """`gguf_table` of one version (`stamp`: mtime, size) of a file."""
    data = np.memmap(path, np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file")
    _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

    def value(kind: int) -> object:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub in _SCALAR:  # skipped: the header's arrays are the tokenizer's
                pos += count * struct.calcsize("<" + _SCALAR[sub])
            elif sub == 8:  # strings: lengths only, nothing decoded
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            else:
                for _ in range(count):
                    value(sub)
            return None
        fmt = "<" + _SCALAR[kind]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(kind)
    entries = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        entries.append((name, kind, shape, offset))
    align = int(meta.get("general.alignment") or 32)
    start = -(-pos // align) * align
    return GgufTable(str(meta.get("general.architecture", "")),
                     {n: Tensor(k, tuple(int(d) for d in s), start + o) for n, k, s, o in entries})


def gguf_table(path: Path) -> GgufTable:
    """The header of GGUF file `path` (its tensor entries; the tokenizer's arrays skipped), once per file version."""
    st = os.stat(path)
    return _table(str(path), (st.st_mtime_ns, st.st_size))


def site_tensors(cfg, layer: int) -> dict[str, list[str]]:
    """site → the GGUF tensors of its linears, in the step's order (`SITE_LINEARS`)."""
    return {site: [f"blk.{layer}.{_TENSOR[f]}.weight" for f in fields] for site, fields in SITE_LINEARS.items()}


def head_tensor(table: GgufTable) -> str:
    """The head's tensor: its own, else the tied embedding."""
    return "output.weight" if "output.weight" in table.tensors else "token_embd.weight"


def unavailable(model: "Model", made: str | None = None) -> str | None:
    """None when `model`'s decode linears and head can run on its GGUF's blocks, else why not (one line): the file,
    its architecture, every linear's and the head's form (one form per site: a job reads one). `made` ("q4_1"): blocks
    hetero makes from the file's float tensors (`MADE`) stand in for those the file lacks."""
    if made is not None and made not in MADE:
        raise ConfigError(f"decode form must be one of {', '.join(MADE)}, got {made!r}")
    path = Path(model.path)
    if not path.is_file() or path.suffix.lower() != ".gguf":
        return f"the model is not a GGUF file ({path.name})"
    try:
        table = gguf_table(path)
    except (OSError, ValueError, struct.error, ConfigError) as e:
        return f"its GGUF header does not read ({e})"
    if table.arch not in ARCHS:
        return f"its architecture {table.arch!r} is not one of {', '.join(ARCHS)}"
    cfg = model.config
    lacks = layerspec.lacks(layerspec.LayerSpec.of(cfg), "decode GGUF blocks")
    if lacks:
        return f"its layers have {lacks}"
    readable = set(COMPUTED) | (set(FLOATS.values()) if made else set())
    which = f"one of {COMPUTED}" + (f" or a float form ({', '.join(FLOATS.values())})" if made else "")
    for layer in range(cfg.n_layers):
        for site, names in site_tensors(cfg, layer).items():
            forms = {table.form(n) for n in names if n in table.tensors}
            if len(forms) != 1 or not forms <= readable:
                return f"{names[0]} and its site's linears are {', '.join(sorted(forms))}, not {which}"
    head = head_tensor(table)
    if table.form(head) not in readable:
        return f"its head {head} is {table.form(head)}, not {which}"
    return None


def block_forms(table: GgufTable, made: str | None) -> dict[str, str]:
    """The form each tensor's GEMV reads: the file's block form, or for a float tensor `made`'s (`MADE`: the linears'
    form, the head's)."""
    head = head_tensor(table)
    out = {}
    for name in table.tensors:
        form = table.form(name)
        if form in FLOATS.values() and made is not None:
            form = MADE[made][1] if name == head else MADE[made][0]
        out[name] = form
    return out


def describe(made: str | None = None) -> str:
    """The decode form in words (`hostplan.DecodePlacement.small_form`)."""
    if made is not None:
        linears, head = (f.upper() for f in MADE[made])
        return (f"hetero's GEMVs over {linears} blocks (head {head}) made from the file's float "
                f"weights (AVX-512 VNNI; a 4-bit re-rounding, as the 4-bit peers': fewer bytes a step than the INT8 "
                f"form, less exact); the file's own blocks where it has them; int8 activations per block of 32")
    return ("hetero's GEMVs over the GGUF's own Q4_1 / Q8_0 blocks (AVX-512 VNNI): the file's weights, not rounded "
            "again; int8 activations per block of 32")
