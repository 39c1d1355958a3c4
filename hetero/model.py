"""The float reference: Llama-family weights and the decoder layer, readable top to bottom (gpt-fast style).

A layer is three subgraphs (mllm-NPU §3.2): `qkv` and `o_ffn` are static (NPU), `attention` is dynamic.
Every linear is reached through one callable, `linear(layer, site, x)`: the linear(s) reading activation
site `site` (`SITE_LINEARS`). Float, INT8 + shadow, calibration observers and rotations are such callables,
so this file is the only place the layer's math is written. Shapes: batch 1; `h` is [T, hidden].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hetero.config import ModelConfig

# Activation sites of a layer: the input shared by one group of linears (it is quantized once).
#   h ─► RMSNorm ─► [attn_in] ─► wq, wk, wv                                    (qkv)
#   a ─► [o_in] ─► wo (─► RMSNorm) ─► +h ─► RMSNorm ─► [ffn_in] ─► w_gate, w_up
#        act(gate)·up ─► [down_in] ─► w_down (─► RMSNorm) ─► +h                (o_ffn)
# (the norms in brackets: Gemma 3's post-norms; QK-norm sits in `attention`, before RoPE)
SITES = ("attn_in", "o_in", "ffn_in", "down_in")
SITE_LINEARS: dict[str, tuple[str, ...]] = {  # LayerWeights fields of the linears reading each site
    "attn_in": ("wq", "wk", "wv"),
    "o_in": ("wo",),
    "ffn_in": ("w_gate", "w_up"),
    "down_in": ("w_down",),
}
SITE_BIASES: dict[str, tuple[str, ...]] = {  # LayerWeights field of each linear's bias (None when it has none)
    "attn_in": ("bq", "bk", "bv"),
    "o_in": ("bo",),
    "ffn_in": ("b_gate", "b_up"),
    "down_in": ("b_down",),
}

# linear(layer, site, x): x [T, in] at `site` of `layer` -> one [T, out] per name in SITE_LINEARS[site]
SiteLinear = Callable[[int, str, torch.Tensor], Sequence[torch.Tensor]]
Observer = Callable[[int, str, torch.Tensor], None]  # observe(layer, site, x), e.g. calibration statistics
# row_attention(cfg, q [H, 1, D] roped, k_cache, v_cache [n_kv, capacity, D], length, window=W) -> [H, 1, D]: one
# decode row over cache rows [0, length), the last W of them when W > 0 (default: `one_row_attention` on the views;
# decode steps pass `decode.rowattn`'s kernel)
RowAttention = Callable[["ModelConfig", torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; linear weights are [out, in] like `nn.Linear`."""

    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [n_heads*D, hidden]
    wk: torch.Tensor  # [n_kv*D, hidden]
    wv: torch.Tensor  # [n_kv*D, hidden]
    wo: torch.Tensor  # [hidden, n_heads*D]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [ffn, hidden]
    w_up: torch.Tensor  # [ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]
    bq: torch.Tensor | None = None  # [n_heads*D] (cfg.qkv_bias)
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # [hidden] (cfg.o_bias)
    b_gate: torch.Tensor | None = None  # [ffn] (cfg.mlp_bias)
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D] (cfg.qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [hidden] (cfg.post_norms)
    post_ffn_norm: torch.Tensor | None = None


@dataclass(slots=True)
class Weights:
    tok_emb: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as tok_emb when tied
    embed_scale: float = 1.0  # cfg.embed_scale: the embedding rows are multiplied by it (Gemma 3)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; Gemma's (1 + w) form is this with w + 1 folded in at load."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def activation(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The gate's activation, as transformers maps `hidden_act` (`config.ACTIVATIONS`)."""
    if cfg.act == "silu":
        return F.silu(x)
    if cfg.act == "gelu":
        return F.gelu(x)
    if cfg.act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if cfg.act == "relu":
        return F.relu(x)
    raise ValueError(f"activation {cfg.act!r} is not implemented")


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE frequencies of the rotated dims (cfg.rotary_dim) with the model's theta and scaling ("linear",
    Llama 3.1's "llama3", Phi-3's "longrope", GGUF's per-frequency divisors "freqs"); local: those of the
    windowed layers with their own base (Gemma 3), unscaled."""
    d = cfg.rotary_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = {} if local else cfg.rope_scaling
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "longrope":  # Phi-3's, in its short regime (`config.longrope`)
        inv = inv / torch.tensor(sc["short_factor"], dtype=torch.float64)
    elif kind == "freqs":  # llama.cpp's rope_freqs (Llama 3.x GGUF): one divisor per frequency
        factors = torch.tensor(sc["factors"], dtype=torch.float64)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv.numel()} frequencies")
        inv = inv / factors
    return inv.float()


class RopeTable:
    """cos/sin for every position up to `max_len`, computed once (rotate-half layout, as HF Llama); a model
    whose windowed layers have their own base (Gemma 3) has a second table for them (`local_cos/sin`)."""

    def __init__(self, cfg: ModelConfig, max_len: int):
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg))  # [max_len, R/2]: both halves share these angles
        self.cos, self.sin = freqs.cos(), freqs.sin()
        attention = cfg.rope_scaling.get("attention_factor", 1.0)  # longrope scales cos/sin (as transformers)
        if attention != 1.0:
            self.cos, self.sin = self.cos * attention, self.sin * attention
        self.local_cos = self.local_sin = None
        if cfg.local_rope_theta:
            local = torch.outer(pos, rope_inv_freq(cfg, local=True))
            self.local_cos, self.local_sin = local.cos(), local.sin()
        self.cfg = cfg

    def tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_len, R/2] of layer `layer`."""
        if self.cfg.local_rope(layer):
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def apply(self, x: torch.Tensor, start: int, positions: torch.Tensor | None = None, layer: int = 0) -> torch.Tensor:
        """x: [H, T, D] at positions start..start+T-1 (or at `positions` [T]) → x·cos + rotate_half(x)·sin on
        the first cfg.rotary_dim dims (the rest pass, Phi's partial rotary), term for term as HF."""
        cos, sin = self.tables(layer)
        t = x.shape[1]
        if positions is None:
            cos, sin = cos[start : start + t], sin[start : start + t]
        else:
            cos, sin = cos[positions], sin[positions]
        half = cos.shape[-1]
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        rot = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return torch.cat(rot if 2 * half == x.shape[-1] else rot + [x[..., 2 * half :]], dim=-1)


def embed(w: Weights, ids: torch.Tensor) -> torch.Tensor:
    h = w.tok_emb[ids]
    return h if w.embed_scale == 1.0 else h * w.embed_scale


def float_site(lw: LayerWeights, site: str, x: torch.Tensor) -> list[torch.Tensor]:
    """The float linears reading `site` of one layer: F.linear with its weights (and biases)."""
    return [F.linear(x, getattr(lw, n), getattr(lw, b)) for n, b in zip(SITE_LINEARS[site], SITE_BIASES[site])]


class FloatLinear:
    """The model's float linears as a `SiteLinear`."""

    def __init__(self, w: Weights):
        self.layers = w.layers

    def __call__(self, layer: int, site: str, x: torch.Tensor) -> list[torch.Tensor]:
        return float_site(self.layers[layer], site, x)


def observed(linear: SiteLinear, observe: Observer) -> SiteLinear:
    """`linear` that first calls observe(layer, site, x) on every site input."""

    def run(layer: int, site: str, x: torch.Tensor) -> Sequence[torch.Tensor]:
        observe(layer, site, x)
        return linear(layer, site, x)

    return run


def qkv(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, linear: SiteLinear | None = None,
        layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Subgraph `qkv` (NPU in hetero): RMSNorm, then the Q/K/V projections. Returns [T, out] each.

    `linear` runs the linears of each site (default: the float ones of `lw`); `layer` is passed to it.
    """
    x = rms_norm(h, lw.attn_norm, cfg.rms_eps)
    q, k, v = linear(layer, "attn_in", x) if linear is not None else float_site(lw, "attn_in", x)
    return q, k, v


def attention(
    cfg: ModelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: RopeTable,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    n_valid: int,
    positions: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
    row_attention: RowAttention | None = None,
    *,
    layer: int = 0,
    lw: LayerWeights | None = None,
    base: int = 0,
) -> torch.Tensor:
    """Subgraph `attn` (CPU/GPU): RoPE, write this chunk's K/V in place, causal attention over [0, start+T).

    q/k/v: [T, out] rows at positions start..start+T-1, of which the first `n_valid` are real tokens and
    the rest padding (mllm-NPU §3.2: the last chunk is padded to C). k_cache/v_cache: [n_kv, capacity, D]
    views of one layer of the preallocated cache (Transformer-Lite §2.4): only the real rows are written,
    so padding never reaches the cache. Padded query rows see every real key and are discarded later.
    Decode rows (`positions` [T] given; siblings of a token tree share a position, LLMCad §3.2): `tree`
    [T, T] (bool, row i sees row j; None = a chain) replaces the causal mask; see `_row_attention`, whose
    rows run `row_attention` (default `one_row_attention`). Returns [T, n_heads*D].
    The layer's variants (`layer`, its weights `lw`): QK-norm of each head before RoPE, its RoPE table, its
    sliding window (a query at p sees keys p-W+1..p, as transformers' sliding mask), the model's softmax scale.
    `base`: the position the caches' row 0 holds (a windowed layer keeping only its window, `KVCache.place`).
    """
    t, d = q.shape[0], cfg.head_dim
    q, k = q.view(t, cfg.n_heads, d), k.view(t, cfg.n_kv_heads, d)
    if cfg.qk_norm:
        if lw is None or lw.q_norm is None:
            raise ValueError("a QK-norm model's attention needs its layer's weights (lw)")
        q, k = rms_norm(q, lw.q_norm, cfg.rms_eps), rms_norm(k, lw.k_norm, cfg.rms_eps)
    q = rope.apply(q.transpose(0, 1), start, positions, layer)
    k = rope.apply(k.transpose(0, 1), start, positions, layer)
    v = v.view(t, cfg.n_kv_heads, d).transpose(0, 1)
    end = start + n_valid
    k_cache[:, start - base : end - base] = k[:, :n_valid]
    v_cache[:, start - base : end - base] = v[:, :n_valid]
    window = cfg.window(layer)
    if positions is not None:
        return _row_attention(cfg, q, k, v, k_cache, v_cache, start - base, n_valid, tree, row_attention, window)
    keys, values = k_cache[:, : end - base], v_cache[:, : end - base]
    q_pos = torch.arange(start, start + t).clamp(max=end - 1).unsqueeze(1)  # padded rows: as the last real one
    k_pos = torch.arange(base, end).unsqueeze(0)
    mask = k_pos <= q_pos  # [T, end]
    if window:
        mask &= k_pos > q_pos - window
    # A batch dimension of 1 selects PyTorch's fused CPU attention kernel (3x faster than the 3-D path).
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True,
                                         scale=cfg.scale)[0]
    return out.transpose(0, 1).reshape(t, cfg.q_dim)


def one_row_attention(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of one roped query row q [H, 1, D] over keys/values [n_kv, L, D] (cache views, no copy):
    the query heads of a KV group as the rows of two matmuls, so every cached K/V byte is read once
    (grouped-query SDPA's CPU kernel reads it per query head and costs ~1.5x at C = 1). Returns [H, 1, D]."""
    g = cfg.n_heads // cfg.n_kv_heads
    s = torch.matmul(q.reshape(cfg.n_kv_heads, g, cfg.head_dim), keys.transpose(1, 2))  # [n_kv, g, L]
    p = torch.softmax(s.mul_(cfg.scale), dim=-1)
    return torch.matmul(p, values).view(cfg.n_heads, 1, cfg.head_dim)


def _row_attention(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, start: int, n_valid: int, tree: torch.Tensor | None,
                   row_attention: RowAttention | None = None, window: int = 0) -> torch.Tensor:
    """Each decode row attends alone, over cache rows [0, its position] holding its own path: so a row's
    output is bit for bit that of plain one-token decoding (float kernels are not row-count invariant,
    and INT8 rounding would amplify the difference), and greedy speculation equals plain greedy.
    q/k/v are roped [H, T, D]; the rows' K/V are already in slots start.. (tree order). A windowed layer's
    row reads its last `window` rows (the path's slots are its positions in order) with `one_row_attention`."""
    t = q.shape[1]
    out = torch.zeros(cfg.n_heads, t, cfg.head_dim)
    for i in range(n_valid):
        path = list(range(i + 1)) if tree is None else tree[i, :n_valid].nonzero().flatten().tolist()
        lead = path == list(range(len(path)))
        if not lead:  # a side branch: put its path in the slots after the prefix for this row only
            k_cache[:, start : start + len(path)] = k[:, path]
            v_cache[:, start : start + len(path)] = v[:, path]
        end = start + len(path)
        lo = max(0, end - window) if window else 0
        if row_attention is None:
            out[:, i : i + 1] = one_row_attention(cfg, q[:, i : i + 1], k_cache[:, lo:end], v_cache[:, lo:end])
        else:
            out[:, i : i + 1] = row_attention(cfg, q[:, i : i + 1], k_cache, v_cache, end, window=window)
        if not lead:
            k_cache[:, start : start + len(path)] = k[:, : len(path)]
            v_cache[:, start : start + len(path)] = v[:, : len(path)]
    return out.transpose(0, 1).reshape(t, cfg.q_dim)


def o_ffn(cfg: ModelConfig, lw: LayerWeights, a: torch.Tensor, h: torch.Tensor,
          linear: SiteLinear | None = None, layer: int = 0) -> torch.Tensor:
    """Subgraph `o_ffn` (NPU): O projection, (post-norm,) residual, RMSNorm, gated FFN, (post-norm,) residual."""
    def lin(site: str, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return linear(layer, site, x) if linear is not None else float_site(lw, site, x)

    (o,) = lin("o_in", a)
    if cfg.post_norms:
        o = rms_norm(o, lw.post_attn_norm, cfg.rms_eps)
    h = h + o
    x = rms_norm(h, lw.ffn_norm, cfg.rms_eps)
    gate, up = lin("ffn_in", x)
    (down,) = lin("down_in", activation(cfg, gate) * up)
    if cfg.post_norms:
        down = rms_norm(down, lw.post_ffn_norm, cfg.rms_eps)
    return h + down


def logits(cfg: ModelConfig, w: Weights, h: torch.Tensor) -> torch.Tensor:
    return F.linear(rms_norm(h, w.norm, cfg.rms_eps), w.lm_head)


class LayerBackend(Protocol):
    """What runs the static subgraphs of a layer (float, INT8 reference, NPU graphs); attention stays
    float on the CPU/GPU. `out`, when given, is a buffer of the result's shape: `qkv` writes its result
    there packed (q|k|v per row, the returned tensors are views of it: the CPU lane's attention reads the
    packed rows); `o_ffn` may write there; the returned tensors are the result either way."""

    name: str
    any_rows: bool  # takes chunks of any row count ≤ C (else exactly C rows: fixed-shape graphs)

    def qkv(self, layer: int, h: torch.Tensor, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [C, hidden] → q [C, n_heads*D], k, v [C, n_kv*D] (out: [C, q_dim + 2·kv_dim])."""
        ...

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """a: attention output [C, n_heads*D], h: residual [C, hidden] → next h [C, hidden] (out: same)."""
        ...


@torch.inference_mode()
def run_layers(cfg: ModelConfig, w: Weights, ids: torch.Tensor, backend: LayerBackend | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every layer over the whole prompt in one pass (no chunking): h [T, hidden] and K/V [L, n_kv, T, D].

    `backend` replaces the static subgraphs (e.g. a quantized path for perplexity); None is float.
    """
    return layer_stack(cfg, w, embed(w, ids), backend)


def layer_stack(cfg: ModelConfig, w: Weights, h: torch.Tensor, backend: LayerBackend | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`run_layers` from the embedded prompt h [T, hidden], outside inference mode: autograd can run
    through it (`outliers.search` takes the loss gradient at every site)."""
    t = h.shape[0]
    rope = RopeTable(cfg, t)
    # one K/V buffer per layer (not views of one tensor: autograd must not see later layers write into it)
    k_all = [torch.empty(cfg.n_kv_heads, t, cfg.head_dim) for _ in w.layers]
    v_all = [torch.empty(cfg.n_kv_heads, t, cfg.head_dim) for _ in w.layers]
    for layer, lw in enumerate(w.layers):
        q, k, v = backend.qkv(layer, h) if backend is not None else qkv(cfg, lw, h)
        a = attention(cfg, q, k, v, rope, k_all[layer], v_all[layer], 0, t, layer=layer, lw=lw)
        h = backend.o_ffn(layer, a, h) if backend is not None else o_ffn(cfg, lw, a, h)
    return h, torch.stack(k_all), torch.stack(v_all)


@torch.inference_mode()
def forward(cfg: ModelConfig, w: Weights, ids: torch.Tensor, backend: LayerBackend | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference the chunked runtime must equal: logits [T, vocab] and K/V [L, n_kv, T, D]."""
    h, k_all, v_all = run_layers(cfg, w, ids, backend)
    return logits(cfg, w, h), k_all, v_all
