"""Methods: named ways to run a prefill (layer ops + dispatch policy), and `make_runtime` to build one.

The composition layer: the only module that picks techniques (`outliers/`, `npu/`, `sched/`) and wires
them into a core `Runtime`. Quantized methods need
the model's calibration (mllm-NPU §3.3, offline): the first use computes and caches it.
The table of methods is in docs/design.md; the measured thread split in docs/journal.md, "Measured facts".
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetero.errors import ConfigError
from hetero.layerspec import FLOAT, INT8, ROTATION, LayerSpec, refusal
from hetero.loader import Model
from hetero.runtime import Runtime
from hetero.threads import ExecutionPlan, set_torch_threads

if TYPE_CHECKING:
    import numpy as np

    from hetero.config import ModelConfig
    from hetero.model import LayerBackend
    from hetero.npu.placement import PrefillLayout
    from hetero.outliers.plan import QuantPlan
    from hetero.outliers.pruning import PlanOptions
    from hetero.outliers.search import SiteCosts
    from hetero.serve.service import Service
    from hetero.serve.store import StoreConfig

log = logging.getLogger(__name__)

SITES_ALL = ("attn_in", "o_in", "ffn_in", "down_in")


def use_threads(threads: int | None) -> int:
    """At a process's edge: the calling thread's share of the cores and torch's intra-op thread count (None: all
    cores); returns the count. A process that has not imported torch gets it in OMP_NUM_THREADS, which torch
    reads if a float path imports it later."""
    n = threads or os.cpu_count() or 1
    if "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(n)
    set_torch_threads(n)
    return n


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a quantized method builds its plan: offline rotation, W8A16 sites, shadow pruning, or the
    per-site precision search."""

    rotate: bool = False  # `outliers.rotate`: rotated residual stream + online Hadamards on o_in / down_in
    a16: tuple[str, ...] = ()  # sites that run W8A16 in every layer (`outliers.a16`)
    prune_fraction: float = 0.85  # share of the 8-bit sites whose shadow is dropped (§3.3)
    search: bool = False  # every site's precision from `outliers.search` (a16 / prune_fraction unused)
    # sites (of `weights.SITES`) where the ones pruning keeps take a scale per row at run time instead of shadow
    # outliers (`outliers.rowscale`): what the CPU EP's graphs can do and HTP's static graphs cannot
    row_scales: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.search and (self.a16 or self.prune_fraction != 0.85):
            raise ConfigError("a searched recipe chooses every site itself: give neither a16 nor prune_fraction")

    def for_config(self, cfg: "ModelConfig") -> "Recipe":
        """The recipe a model of `cfg` runs for this one: the rotated plan (`ROTATED`, `ROTATED_ROWS`) on a site-rotated model (Gemma 3's
        post-norms, `outliers.rotate.site_rotated`) is `SITE_ROTATED`, W8A16 on attn_in and down_in: site rotation
        alone leaves Gemma 3 270M at +3.5% perplexity, +1.2% with W8A16 down_in, +0.36% with both (docs/design.md,
        "Outliers")."""
        from hetero.outliers.rotate import site_rotated

        return SITE_ROTATED if self in (ROTATED, ROTATED_ROWS) and site_rotated(cfg) else self


W8A8 = Recipe()  # mllm-NPU's plan: W8A8 per tensor, shadow outliers on the 15% most important sites
ROTATED = Recipe(rotate=True)  # the same plan on the rotated model (bench/results/accuracy.md)
# the default on the CPU EP: the rotated plan, its kept down_in sites with a scale per row, its kept o_in sites with
# shadows (per row there too moved a sure answer of tests/test_accuracy.py: docs/journal.md, "Issue 39 item 2: moved
# from docs/design.md")
ROTATED_ROWS = Recipe(rotate=True, row_scales=("down_in",))
ROT_A16_DOWN = Recipe(rotate=True, a16=("down_in",))
SITE_ROTATED = Recipe(rotate=True, a16=("attn_in", "down_in"))  # the default of a site-rotated model (`for_config`)
SEARCHED = Recipe(rotate=True, search=True)  # rotation + the searched precision of every site
DEFAULT_RECIPE = ROTATED_ROWS


def quant_model(model: Model, recipe: Recipe) -> Model:
    """The model a recipe quantizes: the rotated copy (cached) when it rotates, else `model` itself."""
    from hetero.outliers.rotate import rotate_model

    model.config.check_quantizable(f"method recipe {recipe}")
    return rotate_model(model) if recipe.rotate else model


def site_costs(model: Model, chunk: int = 256) -> "SiteCosts":
    """The precision search's cost model on this host: INT8 µs per MAC from the host's profile (`qkv` +
    `o_ffn` of one layer on the npu lane at `chunk`), the shadow path's costs measured now."""
    from hetero.outliers.search import SiteCosts, measure_shadow_costs
    from hetero.sched.measure import host_profile

    cfg, prof = model.config, host_profile((("qkv", "npu"), ("o_ffn", "npu")))
    macs = chunk * (cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + 3 * cfg.hidden * cfg.ffn)
    c = min(prof.chunk_lens, key=lambda n: abs(n - chunk))
    int8 = (prof.cost_us("qkv", "npu", c) + prof.cost_us("o_ffn", "npu", c)) * (chunk / c) / macs
    float_mac, extract = measure_shadow_costs(cfg.ffn, cfg.hidden, chunk=chunk)
    return SiteCosts(int8, float_mac, extract, chunk=chunk)


def quant_plan(model: Model, provider: str = "cpu", prune_fraction: float | None = None,
               weight_form: str | None = None, recipe: Recipe = DEFAULT_RECIPE,
               budget: float | None = None) -> "QuantPlan":
    """The quantization plan of `model` (already `quant_model(model, recipe)`) for a provider ("cpu" or
    "qnn"): calibrated scales, shadow sites, 16-bit sites, online transforms, INT8 weights.

    weight_form (`hetero.outliers.quantize.WEIGHT_FORMS`): None picks this CPU's exact and fast form on the
    CPU EP (`hetero.npu.isa`: 8-bit weights u8·s8 with VNNI, u8·u8 on AVX2); an NPU (QNN HTP) runs the
    paper's 8-bit weights. prune_fraction overrides the recipe's. A searched recipe uses the model's cached
    precision plan (`outliers.search.ensure_precision`); `budget` (percent) searches a new one.
    """
    from hetero.npu.isa import resolve_weight_form
    from hetero.outliers.plancache import cached_plan
    from hetero.outliers.rotate import online_sites

    model.config.check_quantizable("quantization")
    recipe = recipe.for_config(model.config)
    if recipe.rotate != model.rotated:
        raise ConfigError(f"quant_plan: the recipe {'rotates' if recipe.rotate else 'does not rotate'} but the model "
                          f"{'is not' if recipe.rotate else 'is'} rotated; use quant_setup(model, ...)")
    form = resolve_weight_form(weight_form, provider)
    online = online_sites(model.config) if recipe.rotate else {}
    if recipe.search:
        from hetero.outliers.calibration import ensure_calibration
        from hetero.outliers.search import ensure_precision, plan_of

        calib = ensure_calibration(model, progress=True, online=online)
        precision = ensure_precision(model, calib, lambda: site_costs(model), form, online, budget,
                                     progress=True)
        return plan_of(model, calib, precision, form, online)
    # derived once per calibration and options, then read (`outliers.plancache`: ~0.1 s of a warm start)
    return cached_plan(model, plan_options(model, recipe, form, prune_fraction), progress=True)


def plan_options(model: Model, recipe: Recipe, weight_form: str, prune_fraction: float | None = None) -> "PlanOptions":
    """The `PlanOptions` of a (not searched) recipe's plan of `model` in `weight_form`."""
    from hetero.outliers.pruning import PlanOptions
    from hetero.outliers.rotate import online_sites

    recipe = recipe.for_config(model.config)
    a16 = [(layer, site) for layer in range(model.config.n_layers) for site in recipe.a16]
    pf = recipe.prune_fraction if prune_fraction is None else prune_fraction
    online = online_sites(model.config) if recipe.rotate else {}
    return PlanOptions(prune_fraction=pf, weight_form=weight_form, a16=a16, online=online, row_scales=recipe.row_scales)


def ship_default_plans() -> list[str]:
    """Write the default method's plans of the default model into the package (`hetero/data/plans/`, replacing
    the shipped ones), one per weight form the default runs (`SHIPPED_FORMS`), so that a first run reads its
    plan instead of deriving it. `make ship` runs it after an edit to the code a plan is derived
    with: the plans' names digest that code (`outliers.plancache`), so a stale shipped plan is never read, and
    `tests/outliers/test_plancache.py` fails until the plans are shipped again."""
    from hetero import shipped
    from hetero.loader import load_model
    from hetero.outliers.plancache import cached_plan, plan_file

    model = quant_model(load_model(), DEFAULT_RECIPE)
    names: list[str] = []
    for form in SHIPPED_FORMS:
        options = plan_options(model, DEFAULT_RECIPE, form)
        cached_plan(model, options)  # kept in the cache under `plan_file`'s name
        path = plan_file(model, options)
        shipped.ship("plans", path.name, path, keep=set(names), model=model.name, weight_form=form)
        names.append(path.name)
    return names


SHIPPED_FORMS = ("w8-u8s8", "w8-u8u8")  # the default's weight forms: VNNI CPUs; AVX2 CPUs and NPUs (`npu.isa`)


def quant_setup(model: Model, provider: str = "cpu", weight_form: str | None = None,
                recipe: Recipe = DEFAULT_RECIPE) -> "tuple[Model, QuantPlan]":
    """(the model the recipe quantizes, its plan): what a quantized method runs (`quant_model`, `quant_plan`)."""
    qm = quant_model(model, recipe)
    return qm, quant_plan(qm, provider, weight_form=weight_form, recipe=recipe)


MakeBackend = Callable[[Model, int, ExecutionPlan, "str | None", bool], "LayerBackend"]


def _float(model: Model, chunk: int, execution: ExecutionPlan, weight_form: str | None, fused: bool) -> "LayerBackend":
    from hetero.torch_backends import FloatBackend

    return FloatBackend(model.config, model.weights)


def _npu(provider: str, recipe: Recipe = DEFAULT_RECIPE, attention: str = "auto") -> MakeBackend:
    def make(model: Model, chunk: int, execution: ExecutionPlan, weight_form: str | None, fused: bool) -> "LayerBackend":
        from hetero.npu.graph_backend import GraphOptions, NpuBackend

        plan = quant_plan(model, provider, weight_form=weight_form, recipe=recipe)
        return NpuBackend(model, plan, chunk=chunk, provider=provider,
                          options=GraphOptions(intra_op_threads=execution.lane_threads, ort_pool=execution.ort_pool,
                                               fused=fused, attention=attention))

    return make


@dataclass(frozen=True, slots=True)
class Method:
    # (model, chunk, threads, weight_form, fused) -> the layer ops; `model` is already `quant_model(model, recipe)`;
    # fused: whole-layer graphs (the "layers" layout, `npu.placement.prefill_layout`)
    make: MakeBackend
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str
    recipe: Recipe | None = None  # quantized methods: how the plan is built
    chunk: int = 256  # the chunk length C a command uses when not told (`hetero run --chunk`)
    provider: str | None = None  # the static graphs' provider ("cpu": the CPU EP; "qnn"); None: torch
    layout: str = "lanes"  # "auto": the host's placement picks "layers" or "lanes" (`prefill_layout`); "lanes"

    @property
    def writings(self) -> tuple[str, ...]:
        """The writings of the layer's math this method runs (`hetero.layerspec`), from its kind: what it refuses
        for a model derives from what they register."""
        if self.recipe is None:
            return FLOAT
        return (*INT8, ROTATION) if self.recipe.rotate else INT8


def _hetero(provider: str, policy: str, doc: str, recipe: Recipe = DEFAULT_RECIPE, chunk: int = 256,
            layout: str = "lanes", attention: str = "auto") -> Method:
    return Method(_npu(provider, recipe, attention), policy, doc, recipe, chunk, provider, layout)


METHODS: dict[str, Method] = {
    "hetero": _hetero("cpu", "rank", "INT8 graphs (ORT CPU EP as NPU lane), rotation, on the 15% of the sites with "
                      "the largest outliers a scale per row (down_in) or shadow outliers; each layer one graph on every "
                      "core, or two lanes out of order, as this host's placement decides", layout="auto"),
    "hetero-gqa": _hetero("cpu", "rank", "as hetero, attention always ONNX Runtime's fp32 GroupQueryAttention "
                          "(not hetero's BF16 kernel)", layout="auto", attention="gqa"),
    "hetero-lanes": _hetero("cpu", "rank", "as hetero, always on two lanes out of order (mllm-NPU §3.4)"),
    "hetero-shadow": _hetero("cpu", "rank", "as hetero, every kept site's outliers as shadows (mllm-NPU Eq. 1), none "
                             "with a scale per row", ROTATED, layout="auto"),
    # C=128: the simulator's generic HTP cannot finalize the o_ffn graph at 256 (`npu.constraints`); HTP's static
    # graphs take no scale per row, so its kept sites run shadows
    "hetero-qnn": _hetero("qnn", "rank", "as hetero-shadow, INT8 QDQ graphs on QNN HTP (simulator on x86), decode on "
                          "the CPU", ROTATED, chunk=128),
    "hetero-inorder": _hetero("cpu", "in_order", "as hetero, dispatched in order"),
    "hetero-w8a8": _hetero("cpu", "rank", "mllm-NPU's plan: W8A8, shadow outliers on 15% of the sites, no rotation",
                           W8A8),
    "hetero-noshadow": _hetero("cpu", "rank", "rotation, W8A8 clipped at every site (no shadow)",
                               Recipe(rotate=True, prune_fraction=1.0)),
    "hetero-search": _hetero("cpu", "rank", "rotation, each site's precision searched for a perplexity budget "
                             "(`hetero calibrate --budget`)", SEARCHED),
    "hetero-rot-a16down": _hetero("cpu", "rank", "rotation, W8A16 on down_in, W8A8 + shadow elsewhere",
                                  ROT_A16_DOWN),
    "hetero-rot-a16": _hetero("cpu", "rank", "rotation, W8A16 at every site", Recipe(rotate=True, a16=SITES_ALL)),
    "float": Method(_float, None, "float reference, in program order"),
    "float-ooo": Method(_float, "rank", "float reference, out of order"),
}
DEFAULT_METHOD = "hetero"


def prefill_layout_of(model: Model, spec: Method, chunk: int, threads: int, policy: str | None,
                      layout: str | None) -> "PrefillLayout | None":
    """The prefill layout of a runtime of `spec` (None: float layers, no graphs): `layout` when given, the
    lanes when the method or an explicit `policy` dispatches lanes, else this host's (`npu.placement`)."""
    from hetero.npu.placement import LAYOUTS, PrefillLayout, layout_key, prefill_layout, recorded_layout

    if spec.provider is None:
        if layout not in (None, "auto"):
            raise ConfigError(f"layout {layout!r} applies to the INT8 methods only")
        return None
    if layout not in (None, "auto", *LAYOUTS):
        raise ConfigError(f"layout must be 'auto' or one of {LAYOUTS}, got {layout!r}")
    if layout in LAYOUTS:
        return PrefillLayout(layout, "asked for")
    if spec.layout != "auto":
        return PrefillLayout("lanes", "the method's")
    if policy is not None:
        return PrefillLayout("lanes", f"the dispatch policy {policy!r} was given, which orders lanes")
    device = "cpu" if spec.provider == "cpu" else "npu"
    return prefill_layout(model.config, device, threads, recorded_layout(layout_key(model, chunk, threads)))


def make_runtime(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None, weight_form: str | None = None, layout: str | None = None) -> Runtime:
    """A runtime for `method`; `policy` overrides the method's default dispatch policy; `weight_form` forces
    the INT8 weight form of the quantized methods (None or "auto": this CPU's, `hetero.npu.isa`); `layout`
    forces the prefill layout of the INT8 methods ("layers" or "lanes"; None or "auto": the method's, and for
    `hetero` this host's placement, `npu.placement.prefill_layout`, in `Runtime.layout`).

    Threads (default: all cores): when lanes overlap, each lane gets half of them so the lanes do not
    oversubscribe the cores: the provider's ONNX Runtime sessions (the npu lane) always, torch and the
    attention kernel (the cpu lane) while another lane runs and all of them while it runs alone
    (`sched.executor.LaneWorkers`). In program order everything gets all of them.
    """
    spec = METHODS.get(method)
    if spec is None:
        raise ConfigError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    layer = LayerSpec.of(model.config)
    bad = refusal(layer, spec.writings)
    if method == DEFAULT_METHOD and bad is not None:  # the default runs what computes this model: float
        print(f"hetero: the INT8 path does not implement {bad} of this {model.config.arch} model yet; "
              f"running --method float", file=sys.stderr)
        spec = METHODS["float"]
        bad = refusal(layer, spec.writings)
    if bad is not None:
        hint = ": run it with --method float" if spec.recipe is not None and refusal(layer, FLOAT) is None else ""
        raise ConfigError(f"method {method!r} does not implement {bad} of this {model.config.arch} model{hint}")
    if spec.recipe is not None:
        model = quant_model(model, spec.recipe)  # the rotated copy: its embedding and lm_head run the prefill
    n = threads or os.cpu_count() or 1
    placed = prefill_layout_of(model, spec, chunk, n, policy, layout)
    fused = placed is not None and placed.mode == "layers"
    if placed is not None:
        log.info("placement | %s", placed.describe())
    policy = None if fused else policy or spec.policy
    lanes = 2 if fused and n >= 2 else 1  # whole layers on two lanes of half the cores each, as a wavefront
    plan = ExecutionPlan.for_host(threads, overlapped=lanes > 1 or (policy is not None and spec.make is not _float))
    executor = None
    backend = spec.make(model, chunk, plan, weight_form, fused)
    if fused and lanes > 1:  # chunk i on lane i mod 2 (`sched.wavefront`: no op split over cores, no pool wake-ups),
        from hetero.npu.nodes import HALF_PLACEMENT, LAYER_PLACEMENT
        from hetero.sched.wavefront import ATTENTION_PER_KEY, WavefrontExecutor  # chunks of equal work

        kernel = "bf16" if getattr(backend, "attention", None) is not None else "gqa"
        # with the kernel, each layer as its two halves around it: the next chunk waits for this one's attention only
        executor = WavefrontExecutor(model.config.n_layers, HALF_PLACEMENT if kernel == "bf16" else LAYER_PLACEMENT,
                                     lanes, ATTENTION_PER_KEY[kernel])
    elif fused:  # one lane: a whole layer per subgraph, in program order on every core
        from hetero.npu.nodes import LAYER_PLACEMENT
        from hetero.runtime import SerialExecutor

        executor = SerialExecutor(model.config.n_layers, LAYER_PLACEMENT)
    elif policy is not None:
        from hetero.sched.executor import OutOfOrderExecutor

        executor = OutOfOrderExecutor(model.config.n_layers, chunk, policy,
                                      torch_threads=(plan.lane_threads, plan.alone_threads),
                                      learn_key=f"{model.name}-{model.fingerprint[:12]}-{method}-C{chunk}-{plan.threads}t")
    # the NPU lane's sessions get the lane's share too (`backend` above): their thread count is fixed per session, and
    # a pool on every core beside attention's preempts it (docs/journal.md, "Measured facts": thread split)
    from hetero.npu.placement import decode_placement

    decode = decode_placement(backend)  # where decode steps run (the CPU, as mllm-NPU)
    log.info("placement | %s", decode.describe())
    head = None
    if placed is not None:  # an INT8 runtime: the last token's logits through its decode step's INT8 head, the one
        # head of the runtime (its quantized graphs loaded and its sessions made once: ~0.1 s of a start)
        from hetero.decode.step import DecodeStep

        def head(h: "np.ndarray") -> "np.ndarray":
            return DecodeStep.of(runtime).logits(h)

    runtime = Runtime(model, chunk=chunk, backend=backend, executor=executor, execution=plan, decode=decode,
                      layout=placed, head=head)
    return runtime


def make_service(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 store: "StoreConfig | None" = None, **options: int) -> "Service":
    """A `hetero.serve.Service` (contexts, prefix reuse, the chunk K/V store) over a runtime for `method`.

    `options`: max_contexts_per_client, max_active, max_queue (see `Service`).
    """
    from hetero.serve.service import Service

    return Service(make_runtime(model, method, chunk, threads), store, **options)


def __getattr__(name: str) -> object:
    """`Service` (the public API's `hetero.Service`), imported at first use: `hetero run` serves nothing (50 ms)."""
    if name == "Service":
        from hetero.serve.service import Service

        return Service
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
