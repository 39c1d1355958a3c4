"""Synthetic models at the shapes devices run: a Hugging Face folder and a GGUF of the same seeded weights.

No 1–8B trained weights can be fetched here, so this writes, for a named shape (`SHAPES`: Llama-3.2-1B/3B,
Llama-3.1-8B, Qwen2.5-1.5B, Qwen3-1.7B, Gemma-3-1B, each with its real checkpoint's config.json), weights that
measure speed and memory, never accuracy (vLLM's `--load-format dummy` is the precedent). Every model written
says so: `hetero_synthetic` in config.json, "hetero.synthetic" and "general.description" in the GGUF; hetero
prints one line about it (`hetero.loader.synthetic_line`).

    python bench/synth_model.py llama-3.2-1b [--seed 0] [--out DIR] [--layers N] [--no-gguf]
    -> DIR/llama-3.2-1b-s0/ (config.json, model-*.safetensors + index, tokenizer files) and DIR/llama-3.2-1b-s0.gguf

The recipe (`reference_stats`, `Plan`): the statistics of a trained model, the embedded default
(SmolLM2-135M, `hetero.default_model`), measured when this runs, scaled to the new shape:
- each linear kind (q, k, v, o, gate, up, down): its std at each depth of the default model, interpolated to the
  new layer's relative depth (so each layer has its own scale), times sqrt(reference fan-in / new fan-in);
  each output row scaled by exp(N(0, s)) with s the spread of log row stds measured for that kind and depth
  (trained rows differ in norm; this also gives the heavier tails trained weights have); mean 0;
- RMSNorm weights: N(mean, std) of that norm at that depth (the default model's attn/ffn norms; Gemma's post
  norms take the attn/ffn norm's; Gemma stores w with its norm computing 1 + w); QK-norms, which the default has
  not, N(1, 0.1); Qwen2's QKV biases N(0, 0.1);
- the embedding: the default's std times sqrt(576 / hidden) (a tied head keeps its logits' scale), columns
  scaled as the rows above; an untied head the same;
- massive activations, as trained LLMs have them (Sun et al., 2024): 2–4 seeded hidden channels carry a large
  constant (20–40 embedding stds, seeded sign) in every token's embedding, the down_proj rows writing them in
  the first two layers are 16× larger, and every RMSNorm weight on them is near zero (|N(0, 0.003)|, as the
  default model's layer-1 norm has them), so the residual stream has a few channels far above the rest (unlike
  the trained ones, in every token, not only the first): at llama-3.2-1b's width, after its second layer, a mean
  |x| of 63–116 on them against 5.7 for the median channel.
Every tensor is drawn from its own generator, seeded by (seed, tensor name): the same seed gives the same bytes,
and the model is generated and written a layer at a time (one layer's float32 in memory, besides the embedding).

The tokenizer: no real one can be downloaded. It is the default model's (byte-level BPE, 49,152 tokens, read
from its GGUF), extended with filler tokens `<filler_N>` (unreachable by the merges) up to the shape's vocab, so
the embeddings have the real shape; bos/eos/pad ids in config.json are that tokenizer's (the one field that
differs from the real config). The folder holds tokenizer.json and a PreTrainedTokenizerFast config (what
transformers' AutoTokenizer, and the exporters built on it, read); the GGUF carries llama.cpp's "tokenizer.ggml.*"
fields copied from the default GGUF, extended the same way (llama.cpp reads them). Weights: bf16 as the real
checkpoints ship; the GGUF holds the same bf16 bits (BF16; 1-D norms F32 as llama.cpp's converter writes them;
Llama's Q/K rows permuted and Gemma's norms stored as 1 + w, as that converter does; Llama 3's RoPE scaling as
`rope_freqs`).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.config import ModelConfig
from hetero.errors import ConfigError

HELP = "write a synthetic model (HF folder + GGUF, seeded weights) at a real architecture's shape"

NOTE = "speed and memory only, never accuracy"

_LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
                hidden_act="silu", initializer_range=0.02, intermediate_size=8192, max_position_embeddings=131072,
                mlp_bias=False, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
                rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
                vocab_size=128256)
_QWEN = dict(attention_dropout=0.0, hidden_act="silu", initializer_range=0.02, max_window_layers=28,
             rms_norm_eps=1e-06, rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
             use_cache=True, use_sliding_window=False, vocab_size=151936, num_hidden_layers=28)
# config.json of each real checkpoint (its bos/eos/pad ids replaced by the tokenizer's, `_config`)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_LLAMA32, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "head_dim": 64},
    "llama-3.2-3b": {**_LLAMA32, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "head_dim": 128},
    "llama-3.1-8b": {**_LLAMA32, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "head_dim": 128, "intermediate_size": 14336, "tie_word_embeddings": False,
                     "rope_scaling": {**_LLAMA32["rope_scaling"], "factor": 8.0}},
    "qwen2.5-1.5b": {**_QWEN, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                     "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "sliding_window": 32768},
    "qwen3-1.7b": {**_QWEN, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                   "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "max_position_embeddings": 40960, "rope_scaling": None, "sliding_window": None},
    "gemma-3-1b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
                       attention_dropout=0.0, attn_logit_softcapping=None, cache_implementation="hybrid",
                       final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                       hidden_size=1152, initializer_range=0.02, intermediate_size=6912, max_position_embeddings=32768,
                       num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1, query_pre_attn_scalar=256,
                       rms_norm_eps=1e-06, rope_local_base_freq=10000.0, rope_scaling=None, rope_theta=1000000.0,
                       sliding_window=512, sliding_window_pattern=6, tie_word_embeddings=True,
                       torch_dtype="bfloat16", use_cache=True, vocab_size=262144),
}
# test-only shapes (seconds to write and load): the same architectures, tiny; vocab just above the tokenizer's
TINY: dict[str, dict[str, Any]] = {
    "tiny-llama": {**SHAPES["llama-3.2-1b"], "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 49216},
    "tiny-qwen2": {**SHAPES["qwen2.5-1.5b"], "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 49216, "max_window_layers": 2},
    "tiny-gemma3": {**SHAPES["gemma-3-1b"], "hidden_size": 128, "num_hidden_layers": 6, "num_attention_heads": 2,
                    "head_dim": 64, "query_pre_attn_scalar": 64, "intermediate_size": 256, "vocab_size": 49216,
                    "sliding_window": 16},
}
ALL_SHAPES = {**SHAPES, **TINY}
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

MASSIVE_DOWN = 16.0  # how much larger the down_proj rows writing a massive channel are, in the first two layers
MASSIVE_NORM_STD = 0.003  # RMSNorm weights on a massive channel: |N(0, this)| (the default model's layer 1)
QK_NORM = (1.0, 0.1)  # mean, std of QK-norm weights (the default model has none to measure)
BIAS_STD = 0.1  # Qwen2's QKV biases (the default model has none)
_FAN_IN = {"wq": "hidden", "wk": "hidden", "wv": "hidden", "w_gate": "hidden", "w_up": "hidden", "wo": "q_dim",
           "w_down": "ffn"}
_LINEARS = tuple(_FAN_IN)


@dataclasses.dataclass
class Stats:
    """A trained model's weight statistics (`reference_stats`): per kind, one value per layer (depth order)."""

    n_layers: int
    fan_in: dict[str, int]  # "hidden", "q_dim", "ffn" of the reference
    std: dict[str, np.ndarray]  # linear kind -> std per layer
    row_logsd: dict[str, np.ndarray]  # linear kind -> std of log(row std) per layer
    norm_mean: dict[str, np.ndarray]  # attn_norm, ffn_norm -> mean per layer
    norm_std: dict[str, np.ndarray]
    emb_std: float
    emb_col_logsd: float
    final_norm: tuple[float, float]  # mean, std

    def at(self, table: dict[str, np.ndarray], kind: str, depth: float) -> float:
        """The statistic at relative depth `depth` in [0, 1], interpolated between the reference's layers."""
        return float(np.interp(depth, np.linspace(0, 1, self.n_layers), table[kind]))


@functools.cache
def reference_stats() -> tuple[Stats, Any]:
    """The default model's statistics (measured now from its weights) and the model (its tokenizer is reused)."""
    from hetero.loader import load_model

    ref = load_model()
    a, cfg = ref.arrays(), ref.config
    layer = [{f: a[f"layers.{i}.{f}"].astype(np.float64) for f in (*_LINEARS, "attn_norm", "ffn_norm")}
             for i in range(cfg.n_layers)]
    per = lambda fn, f: np.array([fn(lw[f]) for lw in layer])  # noqa: E731 (one statistic over the layers)
    emb = a["tok_emb"].astype(np.float64)
    final = a["norm"].astype(np.float64)
    stats = Stats(cfg.n_layers, {"hidden": cfg.hidden, "q_dim": cfg.q_dim, "ffn": cfg.ffn},
                  {f: per(np.std, f) for f in _LINEARS},
                  {f: per(lambda w: np.log(w.std(axis=1)).std(), f) for f in _LINEARS},
                  {f: per(np.mean, f) for f in ("attn_norm", "ffn_norm")},
                  {f: per(np.std, f) for f in ("attn_norm", "ffn_norm")},
                  float(emb.std()), float(np.log(emb.std(axis=0)).std()), (float(final.mean()), float(final.std())))
    return stats, ref


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """torch's generator of one tensor: seeded by (seed, tensor name), so no tensor depends on another's draw."""
    h = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & (2**63 - 1))


def _scaled_rows(g: torch.Generator, rows: int, cols: int, std: float, logsd: float) -> torch.Tensor:
    """[rows, cols] float32 N(0, std²) with each row scaled by exp(N(0, logsd²)), rescaled to keep the std."""
    w = torch.randn(rows, cols, generator=g)
    r = torch.exp(logsd * torch.randn(rows, 1, generator=g))
    return w.mul_(r * (std / float(r.pow(2).mean().sqrt())))


@dataclasses.dataclass
class Plan:
    """What one generation draws: the shape's config (hetero's and transformers'), the statistics, the channels."""

    hf: dict[str, Any]
    cfg: ModelConfig
    stats: Stats
    seed: int
    massive: dict[int, float]  # hidden channel -> its constant in the embedding

    def depth(self, i: int) -> float:
        return i / max(1, self.cfg.n_layers - 1)

    def norm(self, name: str, n: int, mean: float, std: float, layered: bool = True) -> torch.Tensor:
        """RMSNorm weight [n] float32 as the model computes it (1 + w for Gemma: the caller stores w)."""
        g = tensor_generator(self.seed, name)
        w = mean + std * torch.randn(n, generator=g)
        if layered:  # a hidden-sized norm: near zero on the massive channels
            tiny = torch.randn(len(self.massive), generator=g).abs_() * MASSIVE_NORM_STD
            w[list(self.massive)] = tiny
        return w

    def embedding(self, name: str, massive: bool) -> torch.Tensor:
        """[vocab, hidden] float32: the reference's std scaled to this hidden size, columns scaled, the massive
        channels' constant added (massive: the input embedding)."""
        s = self.stats
        std = s.emb_std * (s.fan_in["hidden"] / self.cfg.hidden) ** 0.5
        e = _scaled_rows(tensor_generator(self.seed, name), self.cfg.hidden, self.cfg.vocab, std, s.emb_col_logsd)
        e = e.t().contiguous()
        if massive:  # Gemma scales every input channel alike (sqrt(hidden)): the same constant, relatively
            for c, v in self.massive.items():
                e[:, c] += v * std
        return e

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's fields (`hetero.loader.fields_used`) as float32 tensors, norms as the model computes them."""
        from hetero.loader import fields_used

        cfg, s, t = self.cfg, self.stats, self.depth(i)
        dims = {"hidden": cfg.hidden, "q_dim": cfg.q_dim, "ffn": cfg.ffn}
        out: dict[str, Any] = {}
        for f in fields_used(cfg):
            name = f"layers.{i}.{f}"
            if f in _LINEARS:
                fan = _FAN_IN[f]
                std = s.at(s.std, f, t) * (s.fan_in[fan] / dims[fan]) ** 0.5
                w = _scaled_rows(tensor_generator(self.seed, name), *plan_shape(cfg, f), std, s.at(s.row_logsd, f, t))
                if f == "w_down" and i < 2:
                    w[list(self.massive)] *= MASSIVE_DOWN
                out[f] = w
            elif f in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"):
                kind = "ffn_norm" if "ffn" in f else "attn_norm"
                out[f] = self.norm(name, cfg.hidden, s.at(s.norm_mean, kind, t), s.at(s.norm_std, kind, t),
                                   layered=not f.startswith("post"))
            elif f in ("q_norm", "k_norm"):
                out[f] = self.norm(name, cfg.head_dim, *QK_NORM, layered=False)
            elif f in ("bq", "bk", "bv"):
                n = cfg.q_dim if f == "bq" else cfg.kv_dim
                out[f] = BIAS_STD * torch.randn(n, generator=tensor_generator(self.seed, name))
            else:
                raise ConfigError(f"synth_model: no recipe for the {cfg.arch} layer field {f!r}")
        return out


def _config(shape: str, layers: int | None, seed: int, tok: Any) -> dict[str, Any]:
    """config.json of `shape` (`layers` fewer layers), with the tokenizer's special ids and the synthetic marker."""
    if shape not in ALL_SHAPES:
        raise ConfigError(f"synth_model: no shape {shape!r}; one of {', '.join(ALL_SHAPES)}")
    hf = dict(ALL_SHAPES[shape])
    if layers is not None:
        if not 1 <= layers <= hf["num_hidden_layers"]:
            raise ConfigError(f"synth_model: --layers must be 1..{hf['num_hidden_layers']} for {shape}, got {layers}")
        hf["num_hidden_layers"] = layers
    if hf["model_type"] == "gemma3_text":  # stated as newer checkpoints do, beside sliding_window_pattern
        k = hf["sliding_window_pattern"]
        hf["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "sliding_attention"
                             for i in range(hf["num_hidden_layers"])]
    ids = {f"{k}_token_id": tok.backend.token_to_id(tok.special[f"{k}_token"]) for k in ("bos", "eos", "pad")}
    hf.update(ids if hf["model_type"] == "gemma3_text" else {k: v for k, v in ids.items() if k != "pad_token_id"})
    hf["hetero_synthetic"] = {"seed": seed, "shape": shape, "layers": hf["num_hidden_layers"], "note": NOTE}
    return dict(sorted(hf.items()))


def model_name(shape: str, seed: int, layers: int | None = None) -> str:
    """The folder (and GGUF stem) name of a generated model."""
    return f"{shape}{f'-L{layers}' if layers is not None else ''}-s{seed}"


def _filler_vocab(tok: Any, vocab: int) -> tuple[dict[str, Any], list[str]]:
    """tokenizer.json of the default tokenizer extended to `vocab` tokens, and the filler tokens' strings."""
    d = json.loads(tok.backend.to_str())
    v = d["model"]["vocab"]
    n = max(v.values()) + 1
    if vocab < n:
        raise ConfigError(f"synth_model: vocab {vocab} is below the tokenizer's {n} tokens")
    fillers = [f"<filler_{i}>" for i in range(n, vocab)]
    v.update({s: n + k for k, s in enumerate(fillers)})
    return d, fillers


def write_tokenizer(folder: Path, tok: Any, vocab: int, context: int) -> list[str]:
    """The folder's tokenizer files (PreTrainedTokenizerFast); returns the filler tokens added."""
    from hetero.paths import atomic_path

    d, fillers = _filler_vocab(tok, vocab)
    special = dict(sorted(tok.special.items()))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
           "clean_up_tokenization_spaces": False, "model_max_length": context}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    for name, obj in (("tokenizer.json", d), ("tokenizer_config.json", cfg), ("special_tokens_map.json", special)):
        with atomic_path(folder / name) as tmp:
            tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return fillers


@functools.cache
def _default_gguf_tokenizer() -> tuple[tuple[str, Any, Any, Any], ...]:
    """llama.cpp's tokenizer.* fields of the default GGUF (key, value, type, sub type), read once a process."""
    import gguf

    from hetero.default_model import default_model_path
    from hetero.loader import _reader

    fields = _reader(gguf, default_model_path()).fields.items()
    return tuple((key, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for key, f in fields if key.startswith("tokenizer."))


def _gguf_tokenizer_fields(fillers: list[str]) -> list[tuple[str, Any, Any, Any]]:
    """The default GGUF's tokenizer fields, its tokens extended with `fillers` (normal tokens)."""
    import gguf

    out = []
    for key, value, vtype, sub in _default_gguf_tokenizer():
        if key == "tokenizer.ggml.tokens":
            value = [*value, *fillers]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *[int(gguf.TokenType.NORMAL)] * len(fillers)]
        out.append((key, value, vtype, sub))
    return out


class GGUFStream:
    """A GGUF written as its tensors come: the header (every tensor's name, shape, type) first, then each
    tensor's bytes in that order, so the model never is in memory whole."""

    def __init__(self, path: Path, plan: Plan, fillers: list[str]):
        import gguf

        cfg, hf = plan.cfg, plan.hf
        self.arch = _GGUF_ARCH[cfg.arch]
        self.path, self.plan = path, plan
        w = self.writer = gguf.GGUFWriter(str(path), self.arch)
        marker = hf["hetero_synthetic"]
        w.add_name(f"synthetic {marker['shape']} (seed {marker['seed']})")
        w.add_description(f"hetero synthetic weights ({marker['shape']}, seed {marker['seed']}): {NOTE}")
        w.add_string("hetero.synthetic", json.dumps(marker, sort_keys=True))
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_BF16))
        w.add_context_length(cfg.context_length)
        w.add_embedding_length(cfg.hidden)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.ffn)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_eps)
        w.add_vocab_size(cfg.vocab)
        if cfg.arch == "gemma3":
            w.add_sliding_window(int(hf["sliding_window"]))
        for key, value, vtype, sub in _gguf_tokenizer_fields(fillers):
            w.add_key_value(key, value, vtype, sub_type=sub)
        self.order: list[tuple[str, tuple[int, ...], bool]] = []  # name, numpy shape, bf16 (else F32)
        self._info("token_embd.weight", (cfg.vocab, cfg.hidden), True)
        if cfg.rope_scaling.get("rope_type") == "llama3":
            self._info("rope_freqs.weight", (cfg.head_dim // 2,), False)
        from hetero.loader import _GGUF_NAMES, fields_used

        for i in range(cfg.n_layers):
            for f in fields_used(cfg):
                shape = tuple(plan_shape(cfg, f))
                self._info(f"blk.{i}.{_GGUF_NAMES[f]}", shape, len(shape) == 2)
        self._info("output_norm.weight", (cfg.hidden,), False)
        if not cfg.tie_embeddings:
            self._info("output.weight", (cfg.vocab, cfg.hidden), True)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.next = 0

    def _info(self, name: str, shape: tuple[int, ...], bf16: bool) -> None:
        import gguf

        self.order.append((name, shape, bf16))
        n = int(np.prod(shape))
        if bf16:
            self.writer.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * n,
                                        raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            self.writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * n)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Tensor `name` (a bf16 torch tensor; float32 for F32 entries), in header order."""
        want, shape, bf16 = self.order[self.next]
        if name != want or tuple(t.shape) != shape:
            raise ConfigError(f"synth_model: GGUF tensor {name} {tuple(t.shape)} out of order "
                              f"(expected {want} {shape})")
        arr = t.contiguous().view(torch.int16).numpy().view(np.uint16) if bf16 else t.float().numpy()
        self.writer.write_tensor_data(np.ascontiguousarray(arr))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise ConfigError(f"synth_model: GGUF closed after {self.next} of {len(self.order)} tensors")
        self.writer.close()


def plan_shape(cfg: Any, f: str) -> tuple[int, ...]:
    """The [out, in] (or [n]) shape of LayerWeights field `f` under `cfg`."""
    return {"wq": (cfg.q_dim, cfg.hidden), "wk": (cfg.kv_dim, cfg.hidden), "wv": (cfg.kv_dim, cfg.hidden),
            "wo": (cfg.hidden, cfg.q_dim), "w_gate": (cfg.ffn, cfg.hidden), "w_up": (cfg.ffn, cfg.hidden),
            "w_down": (cfg.hidden, cfg.ffn), "bq": (cfg.q_dim,), "bk": (cfg.kv_dim,), "bv": (cfg.kv_dim,),
            "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}.get(f, (cfg.hidden,))


def _massive_channels(seed: int, hidden: int) -> dict[int, float]:
    """2–4 seeded hidden channels -> their constant in embedding stds (20–40, seeded sign)."""
    rng = np.random.default_rng(seed)
    chans = sorted(int(c) for c in rng.choice(hidden, size=int(rng.integers(2, 5)), replace=False))
    return {c: float(rng.uniform(20, 40) * rng.choice((-1.0, 1.0))) for c in chans}


def generate(shape: str, out: Path, seed: int = 0, layers: int | None = None, gguf: bool = True,
             ) -> tuple[Path, Path | None]:
    """Write `shape`'s folder (and GGUF) under `out`, a layer at a time; returns their paths."""
    from safetensors.torch import save_file

    from hetero.loader import _GGUF_NAMES, _HF_GEMMA3_NAMES, _HF_NAMES, _NORMS, permute
    from hetero.paths import atomic_path
    from hetero.rope import rope_inv_freq

    stats, ref = reference_stats()
    hf = _config(shape, layers, seed, ref.tokenizer)
    cfg = ModelConfig.from_hf(hf)
    plan = Plan(hf, cfg, stats, seed, _massive_channels(seed, cfg.hidden))
    name = model_name(shape, seed, layers)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)  # written last: a folder without it is unfinished
    fillers = write_tokenizer(folder, ref.tokenizer, cfg.vocab, cfg.context_length)
    gemma = cfg.arch == "gemma3"
    names = _HF_GEMMA3_NAMES if gemma else _HF_NAMES
    n_shards = cfg.n_layers + 2
    weight_map: dict[str, str] = {}
    total = 0
    tty = sys.stderr.isatty()

    def shard(k: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        with atomic_path(folder / fname) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()

    gguf_path = out / f"{name}.gguf"
    with atomic_path(gguf_path) if gguf else contextlib.nullcontext() as tmp:
        stream = GGUFStream(tmp, plan, fillers) if tmp else None
        emb = plan.embedding("tok_emb", massive=True).to(torch.bfloat16)
        shard(1, {"model.embed_tokens.weight": emb})
        if stream:
            stream.write("token_embd.weight", emb)
            if cfg.rope_scaling.get("rope_type") == "llama3":  # llama.cpp's form: one divisor per frequency
                plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling={}))
                stream.write("rope_freqs.weight", torch.from_numpy(plain / rope_inv_freq(cfg)))
        del emb

        for i in range(cfg.n_layers):
            tensors = {}
            for f, t in plan.layer(i).items():
                stored = (t - 1 if gemma and f in _NORMS else t).to(torch.bfloat16)  # Gemma's norm is 1 + w
                tensors[f"model.layers.{i}.{names[f]}"] = stored
                if stream:
                    g = stored.float() + 1 if gemma and f in _NORMS else stored  # llama.cpp stores 1 + w
                    if cfg.arch == "llama" and f in ("wq", "wk"):  # llama.cpp's rotary pairs
                        g = permute(g, cfg.n_heads if f == "wq" else cfg.n_kv_heads)
                    stream.write(f"blk.{i}.{_GGUF_NAMES[f]}", g)
            shard(2 + i, tensors)
            if tty:
                print(f"\rsynth_model: {name}: layer {i + 1}/{cfg.n_layers}", end="", file=sys.stderr, flush=True)
        if tty:
            print(file=sys.stderr)
        norm = plan.norm("norm", cfg.hidden, *stats.final_norm).to(torch.bfloat16)
        last = {"model.norm.weight": (norm.float() - 1).to(torch.bfloat16) if gemma else norm}
        if stream:
            stream.write("output_norm.weight", last["model.norm.weight"].float() + 1 if gemma else norm)
        if not cfg.tie_embeddings:
            last["lm_head.weight"] = plan.embedding("lm_head", massive=False).to(torch.bfloat16)
            if stream:
                stream.write("output.weight", last["lm_head.weight"])
        shard(n_shards, last)
        if stream:
            stream.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    for fname, obj in (("model.safetensors.index.json", index), ("generation_config.json", gen),
                       ("config.json", hf)):
        with atomic_path(folder / fname) as tmp:
            tmp.write_text(json.dumps(obj, indent=2) + "\n")
    return folder, gguf_path if gguf else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("shape", choices=list(ALL_SHAPES), help="the architecture and size (tiny-*: test shapes)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (same seed, same bytes)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the real model (a quick look)")
    p.add_argument("--out", type=Path, default=None, help="directory to write into (default: <cache>/synth/)")
    p.add_argument("--no-gguf", action="store_true", help="write the Hugging Face folder only")


def run(args: argparse.Namespace) -> int:
    from hetero.paths import cache_dir

    out = args.out or cache_dir() / "synth"
    t0 = time.perf_counter()
    folder, gguf_path = generate(args.shape, out, args.seed, args.layers, gguf=not args.no_gguf)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    n = index["metadata"]["total_size"] // 2
    print(f"synth_model: {model_name(args.shape, args.seed, args.layers)}: {n / 1e9:.3f} B parameters (bf16), "
          f"{time.perf_counter() - t0:.1f} s; synthetic: {NOTE}", file=sys.stderr)
    from bench.entry import wrote

    wrote([folder] + ([gguf_path] if gguf_path else []))
    return 0
