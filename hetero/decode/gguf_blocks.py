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

All of it comes from the GGUF: the embedding rows a step needs are dequantized from the file as it asks for them
(`FileRows`) and the norms and biases are kept beside the blocks, so decoding never writes the model's unrotated
float32 weights (4.9 GB at 1B width, with a BF16 file) nor hashes them at each start.
"""

from __future__ import annotations

import hashlib
import re
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import ConfigError
from hetero.native import gemv
from hetero.native.gguf_forms import (GgufTable, Tensor, block_forms, gguf_table, head_tensor, site_tensors,
                                      unavailable)
from hetero.weights import SITE_BIASES, SITE_LINEARS

if TYPE_CHECKING:
    from hetero.loader import Model

NORM = "norm."  # the cached arrays' prefix of the model's norm weights, kept beside the blocks
MADE_ROWS = 4096  # rows of a float tensor quantized at a time (a float32 slab of 32 MB at 2,048 columns)


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


class FileRows:
    """Rows of a vocabulary tensor of a GGUF file (the embedding), dequantized from the file as they are taken: the
    `ndarray.take` a step's start makes (`bound_step.start_rows`), the same float32 values as the loader's."""

    def __init__(self, path: Path, tensor: Tensor):
        import gguf

        width, n = tensor.shape[:2]
        self.qtype = gguf.GGMLQuantizationType(tensor.type)
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        self._raw = np.memmap(path, np.uint8, mode="r", offset=tensor.offset, shape=(n, width // block * size))

    def take(self, indices, axis: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        import gguf

        if axis != 0:
            raise ValueError("a GGUF tensor's rows are taken along axis 0")
        rows = np.asarray(gguf.quants.dequantize(self._raw[np.asarray(indices, np.int64)], self.qtype), np.float32)
        if out is None:
            return rows
        out[...] = rows
        return out


def file_digest(path: Path, table: GgufTable, names: list[str]) -> str:
    """A cheap digest of tensors `names` of a GGUF file (the first and last 256 bytes of each), beside its
    fingerprint, as `weightcache`'s float guard is for float weights: blocks made from one file never pass for
    another's."""
    import gguf

    data = np.memmap(path, np.uint8, mode="r")
    h = hashlib.sha256()
    for name in names:
        t = table.tensors[name]
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type)]
        end = t.offset + int(np.prod(t.shape)) // block * size
        h.update(bytes(data[t.offset : t.offset + 256]))
        h.update(bytes(data[max(t.offset, end - 256) : end]))
    return h.hexdigest()[:24]


class BlockWeights:
    """Every layer's linears and the LM head in the GGUF's own block forms (`native.gemv.pack_blocks`), their bytes
    in arenas in step order as `gemv_step.GemvWeights` (the same interface: cfg, online, linears, biases, norms,
    arrays), repacked once and kept beside the model's cache entry (`outliers.weightcache.cached_arrays`).
    The step runs in the model's own space (module docstring): `arrays` are the unrotated model's (the embedding's
    rows read from the file, norms, biases), `online` is empty, and `unrotate` takes a rotated prefill's hidden rows
    to it (None: the same)."""

    def __init__(self, model: "Model", made: str | None = None):
        """made: blocks of `gguf_forms.MADE` ("q4_1", "q4_1-all") made from the file's float tensors where it has none
        (`hetero run --decode-form`): a second rounding of those weights, opted into, never the default."""
        import gguf

        from hetero.decode.gemv_step import StepLinears, step_norms
        from hetero.loader import _unpermute, load_model
        from hetero.outliers.weightcache import cached_arrays

        why = unavailable(model, made) or gemv.config_unsupported(model.config)
        if why is not None:
            raise ConfigError(f"the GGUF's blocks cannot decode this model: {why}")
        cfg = model.config
        self.cfg, self.online = cfg, {}
        path = Path(model.path)
        table = gguf_table(path)
        made_forms = block_forms(table, made)
        base = load_model(path) if model.rotated else model  # the model's own space (read from the file)
        head = head_tensor(table)

        def rows(name: str) -> tuple[np.ndarray, str, int]:
            """The tensor's rows [N, K/32 · block bytes] in its GEMV's form (the file's, mapped; or made from its
            float rows, `made_forms`), that form, K."""
            t = table.tensors[name]
            form, (k, n) = table.form(name), t.shape[:2]
            qtype = gguf.GGMLQuantizationType(t.type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.memmap(path, np.uint8, mode="r", offset=t.offset, shape=(n, k // block * size))
            if form != made_forms[name]:  # a float tensor: its blocks made a slab of rows at a time
                want = gguf.GGMLQuantizationType[made_forms[name].upper()]
                raw = np.concatenate([gguf.quants.quantize(gguf.quants.dequantize(raw[lo : lo + MADE_ROWS], qtype)
                                                           .astype(np.float32), want)
                                      for lo in range(0, n, MADE_ROWS)])
                form = made_forms[name]
            if table.arch in ("llama", "mistral") and (".attn_q." in name or ".attn_k." in name):  # as the loader
                raw = _unpermute(np.asarray(raw), cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads)
            return raw, form, k

        def compute() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for layer in range(cfg.n_layers):
                for site, names in site_tensors(cfg, layer).items():
                    parts = [rows(n) for n in names]
                    p = gemv.pack_blocks(np.concatenate([r for r, _, _ in parts]), parts[0][1], parts[0][2])
                    out[f"{layer}.{site}.w"] = p.w
            raw, form, k = rows(head)
            out["head.w"] = gemv.pack_blocks(np.asarray(raw), form, k).w
            floats = base.float_tensors()  # the norms (one axis) and the sites' biases, as the loader reads them
            out |= {f"{NORM}{name}": np.ascontiguousarray(floats.get(name, None), np.float32)
                    for name, shape in floats.shapes.items() if len(shape) == 1 and "norm" in name}
            for layer in range(cfg.n_layers):
                for site, fields in SITE_LINEARS.items():
                    names = [f"layers.{layer}.{b}" for b in SITE_BIASES[site]]
                    if any(n in floats.shapes for n in names):  # side by side, zeros for a linear without one
                        out[f"{layer}.{site}.bias"] = np.concatenate(
                            [floats.get(n, None).astype(np.float32) if n in floats.shapes else
                             np.zeros(floats.shapes[f"layers.{layer}.{f}"][0], np.float32)
                             for n, f in zip(names, fields)])
            return out

        read = {f"{layer}.{s}": ns for layer in range(cfg.n_layers) for s, ns in site_tensors(cfg, layer).items()}
        read["head"] = [head]
        forms = {name: made_forms[names[0]] for name, names in read.items()}
        key = {"blocks": gemv.BLOCKS_VERSION, "forms": sorted(set(forms.values())), "with": "norms, biases"}
        if any(made_forms[n] != table.form(n) for names in read.values() for n in names):  # gguf's quantizer makes them
            key |= {"made": made, "gguf": version("gguf")}
        source = file_digest(path, table, sorted({n for names in read.values() for n in names} | {"token_embd.weight"}))
        found = cached_arrays(base, "gguf-blocks", key, compute, source=source)
        # copies, not views of the cache file's mapping (`gemv_step.place_linears`)
        self.arrays: dict[str, np.ndarray | FileRows] = {
            name[len(NORM):]: np.array(found[name]) for name in found if name.startswith(NORM)}
        self.arrays["tok_emb"] = FileRows(path, table.tensors["token_embd.weight"])
        self.biases = {name: np.array(found[f"{name}.bias"], np.float32) for name in read if f"{name}.bias" in found}
        self.linears = StepLinears(cfg, found, forms)
        self.norms = step_norms(cfg, self.arrays)
        q = rotation_of(model)
        self.unrotate = None if q is None else np.ascontiguousarray(q.T)
        if q is not None:  # the seed read from the fingerprint must be the rotation the prefill's embedding carries
            ids = np.arange(0, cfg.vocab, max(1, cfg.vocab // 16))
            want = np.asarray(model.arrays()["tok_emb"][ids], np.float64)
            got = np.asarray(self.arrays["tok_emb"].take(ids), np.float64) @ q.astype(np.float64)
            if np.abs(got - want).max() > 1e-4 * max(1.0, np.abs(want).max()):
                raise ConfigError(f"the rotation of {model.fingerprint} is not residual_rotation of its seed")

    @property
    def nbytes(self) -> int:
        return self.linears.nbytes

    def close(self) -> None:
        """Nothing to release beyond memory (a runtime's owned object): the arena goes with the last step."""
