"""A decode step's weights straight from the model's GGUF blocks (Q4_1, Q8_0): the file's own numbers, repacked for
the GEMV kernels (`native.gemv.pack_blocks`), nothing dequantized or rounded again.

The INT8 form (`gemv_step.GemvWeights`) dequantizes the file, rotates it and rounds it again to 8 bits in blocks of
128: ~1.03 bytes a weight per step, and the file's weights plus a second rounding. The default model's file holds
every linear in Q4_1 (0.625 bytes a weight) and its tied head in Q8_0: decoding from those blocks reads ~40% fewer
linear bytes and computes with exactly the model's weights.

Why the unrotated weights may decode beside a rotated prefill's KV cache: the rotation (`outliers.rotate`) is
Q on the residual stream (readers W·diag(g)·Q, writers Qᵀ·W, the embedding E·Q), which cancels in every linear
that reads it: q, k and v of the rotated model equal the model's for the same token, so K/V are the same vectors
(up to each form's rounding). The online block Hadamards (o_in per head, down_in) act on a linear's input and its
weights together (x·T, W·T) and never reach K/V. A step runs its layers from its own token's embedding, so it can
run wholly in the model's space: the file's embedding, norms and linears, no online transforms. Only a hidden row
of the rotated prefill (its last token's, for the first logits) is taken back with Qᵀ before the head
(`BlockWeights.unrotate`).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero import layerspec
from hetero.errors import ConfigError
from hetero.native import gemv
from hetero.weights import SITE_BIASES, SITE_LINEARS

if TYPE_CHECKING:
    from hetero.loader import Model

FORMS = {2: "q4_0", 3: "q4_1", 8: "q8_0"}  # GGML type ids of the small block forms (q4_0: named, not computed)
COMPUTED = ("q4_1", "q8_0")  # the forms the kernels read (`native.gemv.pack_blocks`)
ARCHS = ("llama", "mistral", "qwen2")  # a tensor per linear (phi3 fuses q|k|v: not here)
_TENSOR = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
           "w_up": "ffn_up", "w_down": "ffn_down"}  # a linear's GGUF tensor in blk.N
_ROWBYTES = {"q4_1": 20, "q8_0": 34}  # bytes of a block of 32 values in the file


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
        return FORMS.get(t, f"type {t}")


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


def _site_tensors(cfg, layer: int) -> dict[str, list[str]]:
    """site → the GGUF tensors of its linears, in the step's order (`SITE_LINEARS`)."""
    return {site: [f"blk.{layer}.{_TENSOR[f]}.weight" for f in fields] for site, fields in SITE_LINEARS.items()}


def _head_tensor(table: GgufTable) -> str:
    return "output.weight" if "output.weight" in table.tensors else "token_embd.weight"


def unavailable(model: "Model") -> str | None:
    """None when `model`'s decode linears and head can run on its GGUF's own blocks, else why not (one line):
    the file, its architecture, every linear's and the head's form (one form per site: a job reads one)."""
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
    for layer in range(cfg.n_layers):
        for site, names in _site_tensors(cfg, layer).items():
            forms = {table.form(n) for n in names if n in table.tensors}
            if len(forms) != 1 or not forms <= set(COMPUTED):
                return f"{names[0]} and its site's linears are {', '.join(sorted(forms))}, not one of {COMPUTED}"
    head = _head_tensor(table)
    if table.form(head) not in COMPUTED:
        return f"its head {head} is {table.form(head)}, not one of {COMPUTED}"
    return None


def describe() -> str:
    """The decode form in words (`hostplan.DecodePlacement.small_form`)."""
    return ("hetero's GEMVs over the GGUF's own Q4_1 / Q8_0 blocks (AVX-512 VNNI): the file's weights, not rounded "
            "again; int8 activations per block of 32")


def rotation_of(model: "Model") -> np.ndarray | None:
    """Q [hidden, hidden] of a model rotated in its residual stream (`outliers.rotate.rotate_model`, its seed read from
    the fingerprint), made once (torch) and kept beside the rotated model's cache entry, so a warm start reads it;
    None for a model that is not."""
    from hetero.outliers.rotate import ROTATION_VERSION, residual_rotation, site_rotated
    from hetero.outliers.weightcache import cached_arrays

    if not model.rotated or site_rotated(model.config):
        return None
    m = re.search(r"-rot\d+s(\d+)$", model.fingerprint)
    if m is None:
        raise ConfigError(f"the rotated model {model.fingerprint} names no rotation seed")
    seed = int(m.group(1))
    found = cached_arrays(model, "rotation", {"rotation": ROTATION_VERSION, "seed": seed},
                          lambda: {"q": residual_rotation(model.config.hidden, seed).float().numpy()})
    return np.array(found["q"], np.float32)


class BlockWeights:
    """Every layer's linears and the LM head in the GGUF's own block forms (`native.gemv.pack_blocks`), their bytes
    in one arena in step order as `gemv_step.GemvWeights` (the same interface: cfg, online, linears, biases, norms,
    arrays), repacked once and kept beside the model's cache entry (`outliers.weightcache.cached_arrays`).
    The step runs in the model's own space (module docstring): `arrays` are the unrotated model's (embedding,
    QK norms), `online` is empty, and `unrotate` takes a rotated prefill's hidden rows to it (None: the same)."""

    def __init__(self, model: "Model"):
        from hetero.decode.gemv_step import place_linears, step_norms
        from hetero.loader import _unpermute, load_model
        from hetero.outliers.weightcache import cached_arrays

        why = unavailable(model) or gemv.config_unsupported(model.config)
        if why is not None:
            raise ConfigError(f"the GGUF's blocks cannot decode this model: {why}")
        cfg = model.config
        self.cfg, self.online = cfg, {}
        path = Path(model.path)
        table = gguf_table(path)
        base = load_model(path) if model.rotated else model  # the model's own space (cached: a mapped file)
        self.arrays = base.arrays()
        head = _head_tensor(table)

        def rows(name: str) -> tuple[np.ndarray, str, int]:
            """The tensor's rows [N, K/32 · block bytes] (mapped), its form, K."""
            t = table.tensors[name]
            form, (k, n) = table.form(name), t.shape[:2]
            raw = np.memmap(path, np.uint8, mode="r", offset=t.offset, shape=(n, k // 32 * _ROWBYTES[form]))
            if table.arch in ("llama", "mistral") and (".attn_q." in name or ".attn_k." in name):  # as the loader
                raw = _unpermute(np.asarray(raw), cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads)
            return raw, form, k

        def compute() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for layer in range(cfg.n_layers):
                for site, names in _site_tensors(cfg, layer).items():
                    parts = [rows(n) for n in names]
                    p = gemv.pack_blocks(np.concatenate([r for r, _, _ in parts]), parts[0][1], parts[0][2])
                    out[f"{layer}.{site}.w"] = p.w
            raw, form, k = rows(head)
            out["head.w"] = gemv.pack_blocks(np.asarray(raw), form, k).w
            return out

        forms = {name: table.form(names[0]) for layer in range(cfg.n_layers)
                 for name, names in ((f"{layer}.{s}", ns) for s, ns in _site_tensors(cfg, layer).items())}
        forms["head"] = table.form(head)
        found = cached_arrays(base, "gguf-blocks", {"blocks": gemv.BLOCKS_VERSION, "forms": sorted(set(forms.values()))},
                              compute)
        self.arena, self.linears = place_linears(cfg, found, forms)
        self.biases: dict[str, np.ndarray] = {}
        for layer in range(cfg.n_layers):
            for site, fields in SITE_LINEARS.items():
                got = [self.arrays.get(f"layers.{layer}.{b}") for b in SITE_BIASES[site]]
                if any(b is not None for b in got):
                    widths = [self.arrays[f"layers.{layer}.{f}"].shape[0] for f in fields]
                    self.biases[f"{layer}.{site}"] = np.concatenate(
                        [np.asarray(b, np.float32) if b is not None else np.zeros(w, np.float32)
                         for b, w in zip(got, widths)])
        self.norms = step_norms(cfg, self.arrays)
        q = rotation_of(model)
        self.unrotate = None if q is None else np.ascontiguousarray(q.T)
        if q is not None:  # the seed read from the fingerprint must be the rotation the prefill's embedding carries
            ids = np.arange(0, cfg.vocab, max(1, cfg.vocab // 16))
            want = np.asarray(model.arrays()["tok_emb"][ids], np.float64)
            got = np.asarray(self.arrays["tok_emb"][ids], np.float64) @ q.astype(np.float64)
            if np.abs(got - want).max() > 1e-4 * max(1.0, np.abs(want).max()):
                raise ConfigError(f"the rotation of {model.fingerprint} is not residual_rotation of its seed")

    @property
    def nbytes(self) -> int:
        return int(self.arena.nbytes)

    def close(self) -> None:
        """Nothing to release beyond memory (a runtime's owned object): the arena goes with the last step."""
