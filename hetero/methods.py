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
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetero.chunking import ChunkRule
from hetero.errors import ConfigError
from hetero.hostplan import Choice, DecodePlacement, HostPlan, PrefillLayout
from hetero.layerspec import FLOAT, INT8, ROTATION, LayerSpec, refusal
from hetero.loader import Model
from hetero.runtime import PrefillExecutor, Runtime
from hetero.threads import ExecutionPlan, set_torch_threads

if TYPE_CHECKING:
    import numpy as np

    from hetero.config import ModelConfig
    from hetero.model import LayerBackend
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
    a8r: tuple[str, ...] = ()  # sites that run W8A8 with a scale per row in every layer (`outliers.rowscale`)

    def __post_init__(self) -> None:
        if self.search and (self.a16 or self.a8r or self.prune_fraction != 0.85):
            raise ConfigError("a searched recipe chooses every site itself: give neither a16, a8r nor prune_fraction")

    def for_config(self, cfg: "ModelConfig") -> "Recipe":
        """The recipe a model of `cfg` runs for this one: the rotated plan (`ROTATED`, `ROTATED_ROWS`) on a site-rotated model (Gemma 3's
        post-norms, `outliers.rotate.site_rotated`) is `SITE_ROTATED`, a scale per row at attn_in and down_in in every
        layer: site rotation alone leaves Gemma 3 270M at +3.5% perplexity (a static scale per tensor there), +1.2%
        with W8A16 down_in; W8A16 at both sites and a scale per row at both give the same perplexity, and the rows
        cost one u8 pass where W8A16 costs two (docs/journal.md, "Issue 41 item 4: a scale per row on Gemma 3")."""
        from hetero.outliers.rotate import site_rotated

        return SITE_ROTATED if self in (ROTATED, ROTATED_ROWS) and site_rotated(cfg) else self


W8A8 = Recipe()  # mllm-NPU's plan: W8A8 per tensor, shadow outliers on the 15% most important sites
ROTATED = Recipe(rotate=True)  # the same plan on the rotated model (bench/results/accuracy.md)
# the default on the CPU EP: the rotated plan, its kept down_in sites with a scale per row, its kept o_in sites with
# shadows (per row there too moved a sure answer of tests/test_accuracy.py: docs/journal.md, "Issue 39 item 2: moved
# from docs/design.md")
ROTATED_ROWS = Recipe(rotate=True, row_scales=("down_in",))
ROT_A16_DOWN = Recipe(rotate=True, a16=("down_in",))
SITE_ROTATED = Recipe(rotate=True, a8r=("attn_in", "down_in"))  # the default of a site-rotated model (`for_config`)
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
    a16, a8r = ([(layer, site) for layer in range(model.config.n_layers) for site in sites]
                for sites in (recipe.a16, recipe.a8r))
    pf = recipe.prune_fraction if prune_fraction is None else prune_fraction
    online = online_sites(model.config) if recipe.rotate else {}
    return PlanOptions(prune_fraction=pf, weight_form=weight_form, a16=a16, online=online, row_scales=recipe.row_scales,
                       a8r=a8r)


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


MakeBackend = Callable[[Model, HostPlan], "LayerBackend"]


def _float(model: Model, plan: HostPlan) -> "LayerBackend":
    from hetero.torch_backends import FloatBackend

    return FloatBackend(model.config, model.weights)


def _npu(provider: str, recipe: Recipe = DEFAULT_RECIPE) -> MakeBackend:
    def make(model: Model, plan: HostPlan) -> "LayerBackend":
        """The INT8 graphs as the host plan decided them: its C, provider, weight form, layout, attention kernel, float
        glue and thread shares (the backend decides none of them)."""
        from hetero.npu.graph_backend import GraphOptions, NpuBackend

        quant = quant_plan(model, provider, weight_form=plan.weight_form, recipe=recipe)
        fused, e = plan.layout is not None and plan.layout.mode == "layers", plan.execution
        options = GraphOptions(intra_op_threads=e.lane_threads, ort_pool=e.ort_pool, fused=fused,
                               **({"attention": plan.attention.value, "native_ops": plan.glue.value == "native"}
                                  if fused else {}))
        return NpuBackend(model, quant, chunk=plan.chunk, provider=plan.npu.value, options=options)

    return make


@dataclass(frozen=True, slots=True)
class Method:
    # (model, host plan) -> the layer ops; `model` is already `quant_model(model, recipe)`
    make: MakeBackend
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str
    recipe: Recipe | None = None  # quantized methods: how the plan is built
    chunk: int = 256  # the chunk length C a command uses when not told (`hetero run --chunk`)
    provider: str | None = None  # the static graphs' provider ("cpu": the CPU EP; "qnn"); None: torch
    layout: str = "lanes"  # "auto": the host's placement picks "layers" or "lanes" (`prefill_layout`); "lanes"
    attention: str = "auto"  # whole-layer graphs' attention (`npu.graph_backend.attention_kernel`'s mode)

    @property
    def writings(self) -> tuple[str, ...]:
        """The writings of the layer's math this method runs (`hetero.layerspec`), from its kind: what it refuses
        for a model derives from what they register."""
        if self.recipe is None:
            return FLOAT
        return (*INT8, ROTATION) if self.recipe.rotate else INT8


def _hetero(provider: str, policy: str, doc: str, recipe: Recipe = DEFAULT_RECIPE, chunk: int = 256,
            layout: str = "lanes", attention: str = "auto") -> Method:
    return Method(_npu(provider, recipe), policy, doc, recipe, chunk, provider, layout, attention)


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
                      layout: str | None) -> PrefillLayout | None:
    """The prefill layout of a runtime of `spec` (None: float layers, no graphs): `layout` when given, the
    lanes when the method or an explicit `policy` dispatches lanes, else this host's (`npu.placement`)."""
    from hetero.npu.placement import LAYOUTS, layout_key, prefill_layout, recorded_layout

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
    return prefill_layout(model.config, device, threads, recorded_layout(layout_key(model, chunk, threads)),
                          spec.attention)


def method_of(model: Model, method: str) -> tuple[Choice, Method]:
    """The method that runs `model` when `method` is asked for, and why: the default runs what computes this model
    (float where the INT8 path lacks one of its features). What a method lacks for a model derives from what the
    writings it runs register (`hetero.layerspec`); a method that lacks one is refused naming the feature."""
    spec = METHODS.get(method)
    if spec is None:
        raise ConfigError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    layer = LayerSpec.of(model.config)
    bad = refusal(layer, spec.writings)
    chosen = Choice(method, "the default" if method == DEFAULT_METHOD else "asked for")
    if method == DEFAULT_METHOD and bad is not None:  # the default runs what computes this model: float
        chosen = Choice("float", f"the INT8 path does not implement {bad} of this {model.config.arch} model yet")
        spec = METHODS["float"]
        bad = refusal(layer, spec.writings)
    if bad is not None:
        hint = ": run it with --method float" if spec.recipe is not None and refusal(layer, FLOAT) is None else ""
        raise ConfigError(f"method {chosen.value!r} does not implement {bad} of this {model.config.arch} model{hint}")
    return chosen, spec


def _resolve(model: Model, chosen: Choice, spec: Method, chunk: int, threads: int | None, policy: str | None,
             weight_form: str | None, layout: str | None, decode_form: str | None = None) -> HostPlan:
    """The host plan of `spec` over `model` (already `quant_model`'s): each technique asked once, here."""
    n = threads or os.cpu_count() or 1
    placed = prefill_layout_of(model, spec, chunk, n, policy, layout)
    fused = placed is not None and placed.mode == "layers"
    policy = None if fused else policy or spec.policy
    lanes = 2 if fused and n >= 2 else 1  # whole layers on two lanes of half the cores each, as a wavefront
    overlapped = lanes > 1 or (policy is not None and spec.provider is not None)
    execution = ExecutionPlan.for_host(threads, overlapped=overlapped)
    why_threads = ("lanes overlap: each gets a share of the cores so they do not oversubscribe them (the NPU lane's "
                   "sessions always, torch while another lane runs)" if overlapped else
                   "in program order: everything gets every core")
    npu, weights, decode = _graphs(model, spec, execution, weight_form, decode_form)
    attention, glue = _layer_ops(model.config, spec, fused)
    rule = ChunkRule(chunk)
    if fused and lanes > 1:  # chunk i on lane i mod 2 (`sched.wavefront`: no op split over cores, no pool wake-ups)
        from hetero.sched.wavefront import ATTENTION_PER_KEY

        rule = ChunkRule(chunk, lanes, ATTENTION_PER_KEY[attention.value])  # chunks of equal work
        executor = Choice("wavefront", f"whole layers, chunk i on lane i mod {lanes} of {execution.lane_threads} "
                          f"core(s): no op split over cores, no pool wake-ups (`sched.wavefront`)"
                          + (", each layer as its two halves around the kernel: the next chunk waits for this "
                             "one's attention only" if attention.value == "bf16" else ""))
    elif fused:
        executor = Choice("in-order", "one core: a whole layer per subgraph, in program order")
    elif policy is not None:
        executor = Choice("out-of-order", "the lanes of mllm-NPU §3.4, " +
                          ("the method's dispatch policy" if policy == spec.policy else "the policy asked for"))
    else:
        executor = Choice("in-order", "the method's: program order on the calling thread")
    return HostPlan(chosen, rule, placed, npu, executor, attention, glue, weights, decode, execution, why_threads,
                    policy)


def _graphs(model: Model, spec: Method, execution: ExecutionPlan,
            weight_form: str | None, decode_form: str | None = None) -> tuple[Choice, Choice, DecodePlacement]:
    """Where the static graphs run (the provider, QNN HTP falling back to the CPU EP where it is absent), their
    weights' form and the decode placement."""
    from hetero.npu.placement import decode_placement_of

    if spec.provider is None:
        return (Choice("none", "float layers in torch: no static graphs"), Choice("float", "no INT8 weights"),
                decode_placement_of(None, None, None, "float", decode_form=decode_form))
    from hetero.npu.isa import resolve_weight_form
    from hetero.npu.providers import make_provider

    provider = make_provider(spec.provider, execution.lane_threads, execution.ort_pool)
    if provider.device == "cpu" and spec.provider != "cpu":
        npu = Choice("ort-cpu", "QNN HTP is absent here (`hetero info`: qnn_htp): the ONNX Runtime CPU EP runs the "
                                "same graphs")
    elif provider.device == "cpu":
        npu = Choice("ort-cpu", "the method's provider: the ONNX Runtime CPU EP stands in for the NPU")
    else:
        npu = Choice(provider.name.split("-soc")[0], f"the method's provider: {provider.name} (on x86-64 its simulator), "
                     f"every static graph on it (no NPU memory budget given: `npu.placement.place`)")
    form = resolve_weight_form(weight_form, spec.provider)
    weights = Choice(form, "as asked" if weight_form not in (None, "auto") else
                     "this CPU's exact and fast form (`npu.isa`)" if spec.provider == "cpu" else
                     "the NPU's 8-bit form (`npu.isa.FORM_NPU`)")
    return npu, weights, decode_placement_of(model.config, provider, form, model=model, decode_form=decode_form)


def _layer_ops(cfg: "ModelConfig", spec: Method, fused: bool) -> tuple[Choice, Choice]:
    """The attention and the float glue between the INT8 linears: whole-layer graphs ask this host
    (`npu.graph_backend.attention_kernel`, `native_ops_why`); segments and float layers have one way each."""
    if spec.provider is None:
        return (Choice("chunk", "`attention.ChunkAttention` of each chunk between the float layers"),
                Choice("torch", "the float reference's ops"))
    if not fused:
        return (Choice("chunk", "the `attn` subgraph of each chunk on the CPU lane (`attention.ChunkAttention`), "
                                "between the INT8 graphs"),
                Choice("onnx", "ONNX Runtime nodes in each segment graph; the CPU corrects the shadowed sites"))
    from hetero.npu.graph_backend import attention_kernel, native_ops_why
    from hetero.outliers.rotate import online_sites

    kernel, why = attention_kernel(cfg, spec.attention)
    attention = Choice("bf16" if kernel is not None else "gqa", why)
    # the recipe's online transforms: what its quantization plan will hold (`plan_options`)
    native, why = native_ops_why(cfg, online_sites(cfg) if spec.recipe.rotate else {}, kernel, None)
    return attention, Choice("native" if native else "onnx", why)


def host_plan(model: Model, method: str = DEFAULT_METHOD, chunk: int | None = None, threads: int | None = None,
              policy: str | None = None, weight_form: str | None = None, layout: str | None = None,
              decode_form: str | None = None) -> HostPlan:
    """What a runtime of `method` would run on this host, each decision with its reason (`make_runtime`'s arguments;
    chunk None: the method's), without making it: `hetero info`."""
    chosen, spec = method_of(model, method)
    if spec.recipe is not None:
        model = quant_model(model, spec.recipe)
    return _resolve(model, chosen, spec, chunk or spec.chunk, threads, policy, weight_form, layout, decode_form)


def _executor(model: Model, plan: HostPlan) -> PrefillExecutor | None:
    """The executor the plan names (None: the runtime's default, in program order)."""
    n_layers, e = model.config.n_layers, plan.execution
    if plan.executor.value == "wavefront":
        from hetero.npu.nodes import HALF_PLACEMENT, LAYER_PLACEMENT
        from hetero.sched.wavefront import WavefrontExecutor

        # with the kernel, each layer as its two halves around it
        return WavefrontExecutor(n_layers, HALF_PLACEMENT if plan.attention.value == "bf16" else LAYER_PLACEMENT,
                                 plan.chunks.lanes)
    if plan.layout is not None and plan.layout.mode == "layers":  # one lane: a whole layer per subgraph
        from hetero.npu.nodes import LAYER_PLACEMENT
        from hetero.runtime import SerialExecutor

        return SerialExecutor(n_layers, LAYER_PLACEMENT)
    if plan.executor.value == "out-of-order":
        from hetero.sched.executor import OutOfOrderExecutor

        return OutOfOrderExecutor(n_layers, plan.chunk, plan.policy, torch_threads=(e.lane_threads, e.alone_threads),
                                  learn_key=f"{model.name}-{model.fingerprint[:12]}-{plan.method.value}-C{plan.chunk}-"
                                            f"{e.threads}t")
    return None


def make_runtime(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None, weight_form: str | None = None, layout: str | None = None,
                 decode_form: str | None = None) -> Runtime:
    """A runtime for `method`; `policy` overrides the method's default dispatch policy; `weight_form` forces
    the INT8 weight form of the quantized methods (None or "auto": this CPU's, `hetero.npu.isa`); `layout`
    forces the prefill layout of the INT8 methods ("layers" or "lanes"; None or "auto": the method's, and for
    `hetero` this host's placement, `npu.placement.prefill_layout`, in `Runtime.layout`); `decode_form` "q4_1" lets
    decode read Q4_1 blocks made from a file's float weights (`npu.placement.decode_placement_of`).

    Everything that runs is decided first, in the host plan (`Runtime.host_plan`, logged with -v), then made from it.
    Threads (default: all cores): when lanes overlap, each lane gets half of them so the lanes do not
    oversubscribe the cores: the provider's ONNX Runtime sessions (the npu lane) always, torch and the
    attention kernel (the cpu lane) while another lane runs and all of them while it runs alone
    (`sched.executor.LaneWorkers`). In program order everything gets all of them.
    """
    chosen, spec = method_of(model, method)
    if chosen.value != method:
        print(f"hetero: {chosen.reason}; running --method {chosen.value}", file=sys.stderr)
    if spec.recipe is not None:
        model = quant_model(model, spec.recipe)  # the rotated copy: its embedding and lm_head run the prefill
    plan = _resolve(model, chosen, spec, chunk, threads, policy, weight_form, layout, decode_form)
    for line in plan.lines():  # (`hetero -v run` prints them on stderr, before the answer)
        log.info("host plan | %s", line)
    return runtime_of(model, plan)


def runtime_of(model: Model, plan: HostPlan) -> Runtime:
    """The runtime a host plan describes, made from it: its backend, executor and head as the plan decided (`model`:
    the one its method runs, `quant_model`'s for a quantized method)."""
    spec = METHODS.get(plan.method.value)
    if spec is None:
        raise ConfigError(f"the host plan's method {plan.method.value!r} is not one of {sorted(METHODS)}")
    # the NPU lane's sessions get the lane's share (`_npu`): their thread count is fixed per session, and a pool on
    # every core beside attention's preempts it (docs/journal.md, "Measured facts": thread split)
    backend = spec.make(model, plan)
    head = None
    if spec.provider is not None:  # an INT8 runtime: the last token's logits through its decode step's INT8 head, the
        # one head of the runtime (its quantized graphs loaded and its sessions made once: ~0.1 s of a start)
        from hetero.decode.step import step_logits

        head = step_logits
    return Runtime(model, backend=backend, executor=_executor(model, plan), head=head, host_plan=plan)


def with_decode_form(runtime: Runtime, decode_form: str) -> Runtime:
    """A runtime that prefills on `runtime`'s backend (its graphs and sessions, not a second set) and decodes in
    `decode_form` (`make_runtime`'s): a bench that times several decode forms in one process holds one prefill, not
    one per form (at llama-3.2-3b each set is 2.8 GB). Its steps are its own; closing it leaves `runtime`'s backend.
    The two runtimes' locks are their own: prefill on one of them at a time."""
    plan = runtime.host_plan
    spec = METHODS.get(plan.method.value)
    if spec is None or spec.provider is None:
        raise ConfigError(f"a decode form is an INT8 runtime's; this one's method is {plan.method.value!r}")
    *_, decode = _graphs(runtime.model, spec, plan.execution, plan.weights.value, decode_form)
    plan = dataclasses.replace(plan, decode=decode)
    return Runtime(runtime.model, backend=runtime.backend, executor=_executor(runtime.model, plan), head=runtime.head,
                   host_plan=plan)


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
