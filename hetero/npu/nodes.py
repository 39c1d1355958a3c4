"""The DAG nodes of `NpuBackend` (`hetero.nodes`): the generic layer's three kinds, and a whole layer as one node
(`layer`, `LAYER_PLACEMENT`) or as two halves around the attention kernel (`layer_attn`, `layer_ffn`,
`HALF_PLACEMENT`), with the bind hook that checks a prompt's buffers once for the halves (`HalvesAt`).

A layer's halves: a later chunk's layer waits for the earlier chunk's attention only, not for its o→FFN graph too
(mllm-NPU §3.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetero import nodes
from hetero.buffers import f32_address
from hetero.errors import ConfigError
from hetero.nodes import Job, LayerNodes, NodeKind

if TYPE_CHECKING:
    from hetero.kv_cache import KVCache

LAYER = NodeKind("layer", reads_kv=True)  # the whole layer in one graph, or two around the kernel (`NpuBackend.layer`)
LAYER_ATTN = NodeKind("layer_attn", reads_kv=True)  # the q|k|v graph and the attention kernel (`NpuBackend.layer_attn`)
LAYER_FFN = NodeKind("layer_ffn")  # the o→FFN graph (`NpuBackend.layer_ffn`)
KINDS = {**nodes.KINDS, **{k.name: k for k in (LAYER, LAYER_ATTN, LAYER_FFN)}}  # what `NpuBackend` runs
LAYER_PLACEMENT = ((LAYER.name, "npu"),)  # a whole layer as one node (`placement.prefill_layout`: "layers")
HALF_PLACEMENT = ((LAYER_ATTN.name, "npu"), (LAYER_FFN.name, "npu"))  # a whole layer as its two halves
WHOLE_LAYER_KINDS = (LAYER.name, LAYER_ATTN.name, LAYER_FFN.name)  # the kinds of LAYER_PLACEMENT and HALF_PLACEMENT


@dataclass(slots=True)
class HalvesAt:
    """The addresses a prefill's `layer_attn` / `layer_ffn` nodes run on (`NpuBackend.layer_attn_at`), each buffer
    checked once per prompt here instead of per layer and chunk. Per chunk: its two residual buffers and which holds
    its stream (`cur`), its q|k|v and attention rows; the cache's K/V at layer 0 (a layer is `layer_bytes` on) and the
    RoPE tables' row 0. Only for a cache whose layers keep every position (a windowed layer moves its rows)."""

    h: list[tuple[int, int]]
    cur: list[int]
    qkv: list[int]
    attn: list[int]
    k: int
    v: int
    layer_bytes: int
    capacity: int
    cos: int
    sin: int
    kv: tuple[np.ndarray, np.ndarray]  # the cache's arrays at these addresses (`check`: still the cache's at commit)

    @classmethod
    def of(cls, backend, job: Job) -> "HalvesAt | None":
        """The addresses of `job`'s buffers; None where the halves cannot run on addresses (no attention kernel, a
        windowed layer, or layers that differ in their RoPE table or QK-norm weights: the checked calls pass them)."""
        cache, bufs, chunks = job.cache, job.bufs, job.chunks
        if any(cache.windows) or backend.attention is None or backend.cfg.local_rope_theta or backend.cfg.qk_norm:
            return None
        end = chunks[-1].start + chunks[-1].n_valid
        cos, sin = job.attention.cos, job.attention.sin
        if end > cos.shape[0]:
            raise ConfigError(f"chunk rows up to {end} exceed the RoPE table ({cos.shape[0]} positions)")
        for layer in range(backend.cfg.n_layers):  # every chunk's rows at once (the cache checks its capacity)
            cache.place(layer, job.start, end - job.start)
        h = [tuple(f32_address(t, "a chunk's residual rows") for t in bufs.h[c.index]) for c in chunks]
        start = [f32_address(job.h[i], "a chunk's first residual rows") for i in range(len(chunks))]
        return cls(h, [pair.index(s) for pair, s in zip(h, start)],
                   [f32_address(bufs.qkv[c.index], "a chunk's q|k|v rows") for c in chunks],
                   [f32_address(bufs.attn[c.index], "a chunk's attention rows") for c in chunks],
                   f32_address(cache.k, "the K cache"), f32_address(cache.v, "the V cache"), cache.k[0].nbytes,
                   cache.capacity, f32_address(cos, "the RoPE cos table"), f32_address(sin, "the RoPE sin table"),
                   (cache.k, cache.v))

    def check(self, cache: KVCache) -> None:
        """The nodes wrote into `cache`'s arrays: none replaced them (a `reserve` between two slices of the plan)."""
        if cache.k is not self.kv[0] or cache.v is not self.kv[1]:
            raise ConfigError("the KV cache was reallocated during its prefill: a cache must not grow while a prefill "
                              "writes it")


class NpuNodes(LayerNodes):
    """`NpuBackend`'s nodes bound to one prefill (`NpuBackend.bind`): the generic three, and the whole layer and its
    halves; where the job's DAG runs the halves and the backend's attention kernel can, on the addresses of
    `HalvesAt`."""

    __slots__ = ("at",)

    def __init__(self, backend, job: Job):
        super().__init__(backend, job)
        self.at = HalvesAt.of(backend, job) if LAYER_ATTN.name in job.kinds else None

    @property
    def runs(self) -> dict[str, nodes.NodeRun]:
        """The generic three, the whole layer, and its halves on checked addresses where `HalvesAt` could make them."""
        fast = self.at is not None
        return {**super().runs, LAYER.name: self.layer,
                LAYER_ATTN.name: self.layer_attn_at if fast else self.layer_attn,
                LAYER_FFN.name: self.layer_ffn_at if fast else self.layer_ffn}

    def check(self) -> None:
        """The nodes wrote into the cache's own arrays (`HalvesAt.check`)."""
        if self.at is not None:
            self.at.check(self.job.cache)

    def layer(self, i: int, layer: int) -> None:
        """The whole layer (`NpuBackend.layer`) on the chunk's real rows."""
        job = self.job
        c, cache, attention = job.chunks[i], job.cache, job.attention
        n, out = c.n_valid, job.spare_h(i)
        base = cache.place(layer, c.start, n)
        k_cache, v_cache = cache.layer(layer)
        # from `base` on: the rows are positions - base, the RoPE table's rows start at base
        cos, sin = attention.tables(layer)
        self.backend.layer(layer, job.h[i][:n], k_cache, v_cache, c.start - base, (cos[base:], sin[base:]), out[:n],
                           attention.qk_norm(layer))
        job.h[i] = out

    def layer_attn(self, i: int, layer: int) -> None:
        """The q|k|v graph and the attention kernel (`NpuBackend.layer_attn`), every buffer checked."""
        job = self.job
        c, cache, bufs, attention = job.chunks[i], job.cache, job.bufs, job.attention
        n = c.n_valid
        base = cache.place(layer, c.start, n)
        k_cache, v_cache = cache.layer(layer)
        cos, sin = attention.tables(layer)
        self.backend.layer_attn(layer, job.h[i][:n], k_cache, v_cache, c.start - base, (cos[base:], sin[base:]),
                                bufs.qkv[i][:n], bufs.attn[i][:n], attention.qk_norm(layer))

    def layer_ffn(self, i: int, layer: int) -> None:
        """The o→FFN graph (`NpuBackend.layer_ffn`)."""
        job = self.job
        n, out = job.chunks[i].n_valid, job.spare_h(i)
        self.backend.layer_ffn(layer, job.bufs.attn[i][:n], job.h[i][:n], out[:n])
        job.h[i] = out

    def layer_attn_at(self, i: int, layer: int) -> None:
        """`layer_attn` on the addresses checked once (`NpuBackend.layer_attn_at`)."""
        at, c = self.at, self.job.chunks[i]
        self.backend.layer_attn_at(layer, c.n_valid, at.h[i][at.cur[i]], at.qkv[i], at.attn[i],
                                   at.k + layer * at.layer_bytes, at.v + layer * at.layer_bytes, at.capacity, c.start,
                                   at.cos, at.sin)

    def layer_ffn_at(self, i: int, layer: int) -> None:
        """`layer_ffn` on the addresses checked once (`NpuBackend.layer_ffn_at`)."""
        at, job = self.at, self.job
        cur = at.cur[i]
        self.backend.layer_ffn_at(layer, job.chunks[i].n_valid, at.attn[i], at.h[i][cur], at.h[i][1 - cur])
        at.cur[i] = 1 - cur
        job.h[i] = job.spare_h(i)
