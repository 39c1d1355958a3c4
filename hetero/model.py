"""The float reference: Llama-family weights and the decoder layer, readable top to bottom (gpt-fast style).

A layer is three subgraphs (mllm-NPU §3.2): `qkv` and `o_ffn` are static (NPU), `attention` is dynamic.
Every linear is reached through one callable, `linear(layer, site, x)`: the linear(s) reading activation
site `site` (`SITE_LINEARS`). Float, INT8 + shadow, calibration observers and rotations are such callables,
so this file is the only place the layer's math is written. Shapes: batch 1; `h` is [T, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hetero.config import ModelConfig
from hetero.rope import RopeTable
from hetero.weights import SITE_BIASES, SITE_LINEARS, LayerWeights, Weights

if TYPE_CHECKING:
    from hetero.nodes import BoundNodes, Job, NodeKind

# linear(layer, site, x): x [T, in] at `site` of `layer` -> one [T, out] per name in SITE_LINEARS[site]
SiteLinear = Callable[[int, str, torch.Tensor], Sequence[torch.Tensor]]
Observer = Callable[[int, str, torch.Tensor], None]  # observe(layer, site, x), e.g. calibration statistics
# row_attention(cfg, q [H, 1, D] roped, k_cache, v_cache [n_kv, capacity, D], length, window=W) -> [H, 1, D]: one
# decode row over cache rows [0, length), the last W of them when W > 0 (default: `one_row_attention` on the views;
# decode steps pass `decode.rowattn`'s kernel)
RowAttention = Callable[["ModelConfig", torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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
    """What runs a layer's subgraphs (float, INT8 reference, NPU graphs). `qkv` and `o_ffn` are the static ones;
    the generic layer's attention is the runtime's, float on the CPU (`nodes.LayerNodes`). `out`, when given, is a
    buffer of the result's shape: `qkv` writes its result there packed (q|k|v per row, the returned arrays are views
    of it: the CPU lane's attention reads the packed rows); `o_ffn` may write there; the returned arrays are the result
    either way.

    In a prefill the backend owns its DAG nodes (`hetero.nodes`): `node_kinds` names the kinds it runs (and which of
    them read earlier chunks' K/V), `default_placement` is the (kind, lane) of one layer where no executor says
    otherwise, and `bind(job)` binds its nodes to one prefill in flight (`nodes.Job`), preparing what it keeps per
    prompt; the runtime then calls `runs[kind](i, layer)` per node and `check()` before the commit.

    `tensors` says what it computes on: "numpy" (the NPU lane's graphs: numpy arrays in and out, the runtime's
    buffers) or "torch" (`torch_backends`: torch tensors, and the runtime's numpy buffers through views)."""

    name: str
    tensors: str  # "numpy" or "torch"
    any_rows: bool  # takes chunks of any row count (else exactly `chunk` rows: fixed-shape graphs)
    chunk: int  # the rows its fixed-shape graphs take (read where any_rows is False: the runtime's C must equal it)
    node_kinds: Mapping[str, NodeKind]  # the DAG node kinds it runs, by name
    default_placement: tuple[tuple[str, str], ...]  # (kind, lane) of one layer's nodes when no executor says

    def bind(self, job: Job) -> BoundNodes:
        """Its nodes bound to the prefill `job`: runs[kind](i, layer) for every kind of `job.kinds`."""
        ...

    def qkv(self, layer: int, h: np.ndarray, out: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """h: [C, hidden] → q [C, n_heads*D], k, v [C, n_kv*D] (out: [C, q_dim + 2·kv_dim])."""
        ...

    def o_ffn(self, layer: int, a: np.ndarray, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """a: attention output [C, n_heads*D], h: residual [C, hidden] → next h [C, hidden] (out: same)."""
        ...


def on_tensors(backend: LayerBackend) -> LayerBackend:
    """`backend` as the float reference calls it, with torch tensors: a torch backend as it is, a numpy backend (the
    NPU lane's graphs) through `_OnTensors`."""
    return _OnTensors(backend) if getattr(backend, "tensors", "numpy") == "numpy" else backend


class _OnTensors:
    """A numpy backend (the NPU lane's graphs) called with the reference's torch tensors: numpy views in,
    torch views of its results out (no copies but for non-contiguous inputs)."""

    def __init__(self, backend: LayerBackend):
        self.backend = backend

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.backend.qkv(layer, np.ascontiguousarray(h.numpy()))
        return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.backend.o_ffn(layer, np.ascontiguousarray(a.numpy()), np.ascontiguousarray(h.numpy())))


@torch.inference_mode()
def run_layers(cfg: ModelConfig, w: Weights, ids: torch.Tensor, backend: LayerBackend | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every layer over the whole prompt in one pass (no chunking): h [T, hidden] and K/V [L, n_kv, T, D].

    `backend` replaces the static subgraphs (e.g. a quantized path for perplexity); None is float.
    """
    return layer_stack(cfg, w, embed(w, ids), backend)


def layer_stack(cfg: ModelConfig, w: Weights, h: torch.Tensor, backend: LayerBackend | None = None,
                layers: range | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`run_layers` from the embedded prompt h [T, hidden], outside inference mode: autograd can run
    through it (`outliers.search` takes the loss gradient at every site). `layers`: only those (h is then the
    first one's input; calibration runs a model one layer at a time over all its windows), K/V theirs."""
    t = h.shape[0]
    rope = RopeTable(cfg, t)
    if backend is not None:
        backend = on_tensors(backend)
    layers = range(len(w.layers)) if layers is None else layers
    # one K/V buffer per layer (not views of one tensor: autograd must not see later layers write into it)
    k_all = [torch.empty(cfg.n_kv_heads, t, cfg.head_dim) for _ in layers]
    v_all = [torch.empty(cfg.n_kv_heads, t, cfg.head_dim) for _ in layers]
    for j, layer in enumerate(layers):
        lw = w.layers[layer]
        q, k, v = backend.qkv(layer, h) if backend is not None else qkv(cfg, lw, h)
        a = attention(cfg, q, k, v, rope, k_all[j], v_all[j], 0, t, layer=layer, lw=lw)
        h = backend.o_ffn(layer, a, h) if backend is not None else o_ffn(cfg, lw, a, h)
    return h, torch.stack(k_all), torch.stack(v_all)


@torch.inference_mode()
def forward(cfg: ModelConfig, w: Weights, ids: torch.Tensor, backend: LayerBackend | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference the chunked runtime must equal: logits [T, vocab] and K/V [L, n_kv, T, D]."""
    h, k_all, v_all = run_layers(cfg, w, ids, backend)
    return logits(cfg, w, h), k_all, v_all
