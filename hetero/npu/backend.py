"""`NpuBackend`: the static subgraphs of every layer as prebuilt INT8 graphs on a provider (mllm-NPU §3.2).

Each layer's segments (`segments.layer_segments`) are fixed-shape graphs of chunk length C, built once or
loaded from the graph cache and shared by every chunk; where the plan keeps a shadow (Eq. 1) the graph is
cut after that linear and `QuantizedBackend.shadow_delta` is added in place on the CPU. Which device runs
which graph comes from a `Placement` (NPU memory budget, §4); by default the given provider runs all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from hetero.chunking import check_chunk
from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.model import SITES
from hetero.npu import segments
from hetero.npu.providers import Graph, OrtCpuProvider, Provider, make_provider, prepare_graph

log = logging.getLogger(__name__)

_CUT_SITE = {"o": "o_in", "gu": "ffn_in", "act": "down_in"}  # a segment ending here corrects this site next


@dataclass(slots=True)
class PreparedLayer:
    graphs: list[Graph]  # segments in execution order; graphs[0] is qkv
    shadow_sites: frozenset[str]


@dataclass(slots=True)
class PrepareReport:
    """How the graph set was obtained: per graph (layer, kind, provider, cached, seconds, bytes)."""

    rows: list[tuple[int, str, str, bool, float, int]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r[4] for r in self.rows)

    @property
    def size_bytes(self) -> int:
        return sum(r[5] for r in self.rows)

    @property
    def all_cached(self) -> bool:
        return all(r[3] for r in self.rows)


def _shadow_only(plan):
    """`plan` with the INT8 weights of shadowed sites only (what the CPU dequantizes for outliers)."""
    from hetero.model import SITE_LINEARS

    keep = {(layer, n) for (layer, site), sq in plan.sites.items() if sq.shadow for n in SITE_LINEARS[site]}
    return dataclasses.replace(plan, weights={k: w for k, w in plan.weights.items() if k in keep})


def graph_memory_bytes(cfg, chunk: int, n_layers: int) -> int:
    """An estimate of what the prepared graphs of `n_layers` layers hold at chunk length C: each ONNX
    Runtime session keeps its own arena, sized by its largest activations ([C, ffn] gate/up/act and
    their INT8 copies, [C, hidden] residuals), so the total grows with C times the graph count."""
    per_row = 4 * (3 * cfg.ffn + 4 * cfg.hidden + cfg.q_dim + 2 * cfg.kv_dim)
    return 2 * n_layers * chunk * per_row  # two graphs (qkv, o_ffn) per layer


def check_graph_memory(cfg, chunk: int, n_layers: int) -> None:
    """ConfigError when the graphs of chunk length C would not fit in the memory available now."""
    import psutil

    need, free = graph_memory_bytes(cfg, chunk, n_layers), psutil.virtual_memory().available
    if need > free // 2:  # leave half for the weights, the KV cache and everything else
        raise ConfigError(f"chunk {chunk} needs about {need / 2**30:.1f} GiB of graph buffers ({2 * n_layers} "
                          f"graphs), more than half of the {free / 2**30:.1f} GiB available: use a smaller chunk")


class NpuBackend:
    """A `LayerBackend` running prebuilt chunk-sharing INT8 graphs (`Runtime(model, chunk=C, backend=...)`).

    plan: a `hetero.outliers.plan.QuantPlan`. provider: "cpu", "qnn" (falls back to CPU with a warning) or a
    `providers.Provider`. placement: optional `placement.Placement`; its "cpu" decisions run on the CPU EP.
    shape: "auto" (default: the winner `hetero npu shapes` recorded for this host, provider, kind and C; "2d"
    when none is recorded), or "2d", "3d:a", "conv:a" for every graph (§4, optimisation 1).
    layers: prepare only these layers (e.g. range(2) for a quick test); the others raise on use.
    graphs_root: the graph cache folder (default: under the user cache).
    dynamic_rows: one graph set for every chunk length (rows symbolic), where the provider allows it (the
    CPU EP); None (default): when every graph runs on the CPU EP with shape "auto" or "2d". Then `any_rows` is
    True and a runtime may run chunks of any length up to C without padding.
    """

    name = "npu"

    def __init__(self, model: Model, plan, chunk: int, provider: "str | Provider" = "cpu", *, placement=None,
                 shape: str = "auto", layers=None, intra_op_threads: int = 2, use_cache: bool = True, rows=None,
                 graphs_root=None, dynamic_rows: bool | None = None):
        from hetero.outliers.shadow import QuantizedBackend

        model.config.check_quantizable("the NPU backend")
        check_chunk(chunk, model.config.context_length)
        check_graph_memory(model.config, chunk, model.config.n_layers if layers is None else len(layers))
        self.model, self.cfg, self.plan, self.chunk = model, model.config, plan, chunk
        self.provider = make_provider(provider, intra_op_threads) if isinstance(provider, str) else provider
        self.name = f"npu[{self.provider.name}]"
        self.reference = QuantizedBackend(self.cfg, model.weights, plan, rows)  # its shadow_correction
        self.placement = placement
        self._cpu_provider = self.provider if isinstance(self.provider, OrtCpuProvider) else None
        self._intra = intra_op_threads
        self.shape = shape
        self._graphs_root = graphs_root
        # On the CPU EP a recorded 3-D winner is a few percent; padding a short prompt to C costs up to C/rows.
        can = isinstance(self.provider, OrtCpuProvider) and placement is None and shape in ("auto", "2d")
        if dynamic_rows and not can:
            raise ConfigError("dynamic_rows needs the CPU EP provider, no placement and shape 'auto' or '2d'")
        self.any_rows = can if dynamic_rows is None else dynamic_rows
        self.layers: dict[int, PreparedLayer] = {}
        self.report = PrepareReport()
        t0 = time.perf_counter()
        for layer in (range(self.cfg.n_layers) if layers is None else layers):
            self.layers[layer] = self._prepare_layer(layer, use_cache)
        self._share_buffers()
        self._kw = dict(provider=self.provider, placement=placement, shape=shape, intra_op_threads=intra_op_threads,
                        use_cache=use_cache, graphs_root=graphs_root)
        self._weights_dropped = layers is None and rows is None
        if self._weights_dropped:  # the graphs hold the INT8 weights now: keep only the shadows' (§3.3)
            self.plan = _shadow_only(plan)
            self.reference = QuantizedBackend(self.cfg, model.weights, self.plan)
        self.prepare_s = time.perf_counter() - t0

    def at_chunk(self, chunk: int, intra_op_threads: int | None = None) -> "NpuBackend":
        """The same plan's graphs at another chunk length (decode steps: C = 1 and the tree sizes). The INT8
        weights this backend dropped are recomputed from the model (`QuantPlan.from_dict`), then dropped again.
        intra_op_threads: the new sessions' thread count when it differs from this backend's (CPU EP only:
        another provider keeps its own; the graph cache does not depend on it)."""
        from hetero.outliers.plan import QuantPlan

        plan = QuantPlan.from_dict(self.plan.to_dict(), self.model) if self._weights_dropped else self.plan
        kw = dict(self._kw)
        if intra_op_threads is not None and intra_op_threads != self._intra and isinstance(self.provider, OrtCpuProvider):
            kw.update(provider=OrtCpuProvider(intra_op_threads), intra_op_threads=intra_op_threads)
        return NpuBackend(self.model, plan, chunk, **kw)

    def _share_buffers(self) -> None:
        """The graphs at one position of every layer (qkv, then the o_ffn segments) share the buffers of the
        outputs a caller does not supply: a lane runs one subgraph at a time and every kind runs on one lane,
        so one layer's set serves them all (5.8 instead of 47 MB at C=256), and a layer's segments never alias."""
        shared: dict[int, dict[str, torch.Tensor]] = {}
        for pl in self.layers.values():
            for position, g in enumerate(pl.graphs):
                g.buffers = shared.setdefault(position, {})

    def _provider_for(self, layer: int, kind: str) -> Provider:
        if self.placement is None or self.placement.device_of(layer, kind) == "npu":
            return self.provider
        if self._cpu_provider is None:
            self._cpu_provider = OrtCpuProvider(self._intra)
        return self._cpu_provider

    def _shape_for(self, provider: Provider, kind: str) -> str:
        if self.any_rows:
            return "2d"
        if self.shape != "auto":
            return self.shape
        from hetero.npu.shapes import recorded_shape

        return recorded_shape(provider.name, kind, self.chunk)

    def _prepare_layer(self, layer: int, use_cache: bool) -> PreparedLayer:
        shadow = frozenset(s for s in SITES if self.plan.sites[(layer, s)].shadow)
        lq = segments.layer_q(self.cfg, self.model.weights.layers[layer], self.plan, layer)
        digest = segments.layer_digest(lq)
        graphs = []
        for spec0 in segments.layer_segments(layer, set(shadow), self.chunk, "cpu"):
            provider = self._provider_for(layer, "qkv" if spec0.kind == "qkv" else "o_ffn")
            rows = segments.DYNAMIC_ROWS if self.any_rows else self.chunk
            spec = segments.SegmentSpec(layer, spec0.kind, spec0.pieces, rows, provider.flavor,
                                        self._shape_for(provider, spec0.kind), spec0.emit_x)
            g, info = prepare_graph(spec, lq, self.model.fingerprint, provider, use_cache, digest, self._graphs_root)
            graphs.append(g)
            self.report.rows.append((layer, spec.kind, provider.name, info.cached, info.seconds, info.size_bytes))
        return PreparedLayer(graphs, shadow)

    def _layer(self, layer: int) -> PreparedLayer:
        pl = self.layers.get(layer)
        if pl is None:
            raise ConfigError(f"layer {layer} was not prepared (prepared: {sorted(self.layers)})")
        return pl

    # --------------------------------------------------------------------------- LayerBackend
    def qkv(self, layer: int, h: torch.Tensor, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pl = self._layer(layer)
        if out is None:
            out = torch.empty(h.shape[0], self.cfg.q_dim + 2 * self.cfg.kv_dim)
        res = pl.graphs[0].run({"h": h}, {"qkv": out})  # [C, q_dim + 2·kv_dim]; q/k/v are views
        if "attn_in" in pl.shadow_sites:
            extra = self.reference.shadow_delta(layer, "attn_in", res["x"])
            if extra is not None:
                out += extra
        qd, kd = self.cfg.q_dim, self.cfg.kv_dim
        return out[:, :qd], out[:, qd : qd + kd], out[:, qd + kd :]

    def cut_correction(self, layer: int, last: str, env: dict[str, torch.Tensor], per_row: bool = False
                       ) -> torch.Tensor | None:
        """The shadow (Eq. 1) of the site after a segment ending with piece `last`, from the segment's outputs
        in `env`: added in place to env["o"] / env["gu"]; down_in's is returned (the caller adds it to d
        before the residual, the reference's order). per_row: each row's alone (`shadow_delta_rows`, the
        rows of a decode token tree)."""
        if last == "down":
            return None
        site = _CUT_SITE[last]
        x = env["a"] if site == "o_in" else env["x"] if site == "ffn_in" else env["m"]
        delta = self.reference.shadow_delta_rows if per_row else self.reference.shadow_delta
        extra = delta(layer, site, x)
        if extra is None or site == "down_in":
            return extra
        env["o" if site == "o_in" else "gu"] += extra
        return None

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        pl = self._layer(layer)
        if out is None:
            out = torch.empty(h.shape[0], self.cfg.hidden)
        env = {"a": a, "h": h}
        d_extra = None
        for g in pl.graphs[1:]:
            env.update(g.run(env, {"h_out": out}))
            extra = self.cut_correction(layer, g.spec.pieces[-1], env)
            if extra is not None:  # down_in's, added to d below
                d_extra = extra
        if "d" in env:  # a separate down graph: h1 + (d + shadow), the reference's order
            d = env["d"] if d_extra is None else env["d"].add_(d_extra)
            return torch.add(env["h1"], d, out=out)
        return out
