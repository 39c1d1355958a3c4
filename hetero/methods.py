"""Methods: named ways to run a prefill (layer ops + dispatch policy), and `make_runtime` to build one.

The composition layer: the only module that picks techniques (`outliers/`, `npu/`, `sched/`) and wires
them into a core `Runtime`, and the one place that sets torch's thread count. Quantized methods need
the model's calibration (mllm-NPU §3.3, offline): the first use computes and caches it.
The table of methods and the measured thread split are in docs/design.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetero.backend import FloatBackend, LayerBackend
from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.runtime import Runtime
from hetero.serve.service import Service
from hetero.serve.store import StoreConfig

if TYPE_CHECKING:
    from hetero.outliers.plan import QuantPlan
    from hetero.outliers.search import SiteCosts

log = logging.getLogger(__name__)

SITES_ALL = ("attn_in", "o_in", "ffn_in", "down_in")


def use_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (None: all cores); returns the count set."""
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a quantized method builds its plan: offline rotation, W8A16 sites, shadow pruning, or the
    per-site precision search (issue 10)."""

    rotate: bool = False  # `outliers.rotate`: rotated residual stream + online Hadamards on o_in / down_in
    a16: tuple[str, ...] = ()  # sites that run W8A16 in every layer (`outliers.a16`)
    prune_fraction: float = 0.85  # share of the 8-bit sites whose shadow is dropped (§3.3)
    search: bool = False  # every site's precision from `outliers.search` (a16 / prune_fraction unused)

    def __post_init__(self) -> None:
        if self.search and (self.a16 or self.prune_fraction != 0.85):
            raise ConfigError("a searched recipe chooses every site itself: give neither a16 nor prune_fraction")


W8A8 = Recipe()  # mllm-NPU's plan: W8A8 per tensor, shadow outliers on the 15% most important sites
ROTATED = Recipe(rotate=True)  # the default: the same plan on the rotated model (docs/design.md, "Accuracy")
ROT_A16_DOWN = Recipe(rotate=True, a16=("down_in",))
SEARCHED = Recipe(rotate=True, search=True)  # rotation + the searched precision of every site
DEFAULT_RECIPE = ROTATED


def quant_model(model: Model, recipe: Recipe) -> Model:
    """The model a recipe quantizes: the rotated copy (cached) when it rotates, else `model` itself."""
    from hetero.outliers.rotate import rotate_model

    return rotate_model(model) if recipe.rotate else model


def site_costs(model: Model, chunk: int = 256) -> "SiteCosts":
    """The precision search's cost model on this host: INT8 µs per MAC from the host's profile (`qkv` +
    `o_ffn` of one layer on the npu lane at `chunk`), the shadow path's costs measured now."""
    from hetero.outliers.search import SiteCosts, measure_shadow_costs
    from hetero.sched.measure import host_profile

    cfg, prof = model.config, host_profile()
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
    from hetero.outliers.calibrate import ensure_calibration
    from hetero.outliers.pruning import plan_from_calibration
    from hetero.outliers.rotate import is_rotated, online_sites

    if recipe.rotate != is_rotated(model):
        raise ConfigError(f"quant_plan: the recipe {'rotates' if recipe.rotate else 'does not rotate'} but the model "
                          f"{'is not' if recipe.rotate else 'is'} rotated; use quant_setup(model, ...)")
    form = resolve_weight_form(weight_form, provider)
    online = online_sites(model.config) if recipe.rotate else {}
    calib = ensure_calibration(model, progress=True, online=online)
    if recipe.search:
        from hetero.outliers.search import ensure_precision, plan_of

        precision = ensure_precision(model, calib, lambda: site_costs(model), form, online, budget,
                                     progress=True)
        return plan_of(model, calib, precision, form, online)
    a16 = [(layer, site) for layer in range(model.config.n_layers) for site in recipe.a16]
    pf = recipe.prune_fraction if prune_fraction is None else prune_fraction
    return plan_from_calibration(model, calib, prune_fraction=pf, weight_form=form, a16=a16, online=online)


def quant_setup(model: Model, provider: str = "cpu", weight_form: str | None = None,
                recipe: Recipe = DEFAULT_RECIPE) -> "tuple[Model, QuantPlan]":
    """(the model the recipe quantizes, its plan): what a quantized method runs (`quant_model`, `quant_plan`)."""
    qm = quant_model(model, recipe)
    return qm, quant_plan(qm, provider, weight_form=weight_form, recipe=recipe)


def _float(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
    return FloatBackend(model.config, model.weights)


def _npu(provider: str, recipe: Recipe = DEFAULT_RECIPE) -> Callable[[Model, int, int | None, str | None], LayerBackend]:
    def make(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
        from hetero.npu.backend import NpuBackend

        plan = quant_plan(model, provider, weight_form=weight_form, recipe=recipe)
        return NpuBackend(model, plan, chunk=chunk, provider=provider, intra_op_threads=threads or 2)

    return make


@dataclass(frozen=True, slots=True)
class Method:
    # (model, chunk, threads, weight_form) -> the layer ops; `model` is already `quant_model(model, recipe)`
    make: Callable[[Model, int, int | None, str | None], LayerBackend]
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str
    recipe: Recipe | None = None  # quantized methods: how the plan is built
    chunk: int = 256  # the chunk length C a command uses when not told (`hetero run --chunk`)


def _hetero(provider: str, policy: str, doc: str, recipe: Recipe = DEFAULT_RECIPE, chunk: int = 256) -> Method:
    return Method(_npu(provider, recipe), policy, doc, recipe, chunk)


METHODS: dict[str, Method] = {
    "hetero": _hetero("cpu", "rank", "INT8 graphs (ORT CPU EP as NPU lane), rotation, shadow outliers on 15% of "
                      "the sites, out of order"),
    # C=128: the simulator's generic HTP cannot finalize the o_ffn graph at 256 (`npu.constraints`)
    "hetero-qnn": _hetero("qnn", "rank", "as hetero, INT8 QDQ graphs on QNN HTP (simulator on x86), decode on the CPU",
                          chunk=128),
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


_SPIN_WARNED = False


def _alone_threads(shared: int, threads: int) -> int:
    """torch's threads for a lane running alone (attention at long prompts): every core, unless torch's
    OpenMP threads spin when idle (torch imported before hetero), which starves ONNX Runtime's."""
    from hetero.threads import passive_in_effect

    global _SPIN_WARNED
    if shared == threads or passive_in_effect():
        return threads
    if not _SPIN_WARNED:
        _SPIN_WARNED = True
        log.warning("torch was imported before hetero, so its OpenMP threads spin-wait and compete with ONNX "
                    "Runtime's: import hetero first or set OMP_WAIT_POLICY=PASSIVE; torch keeps %d thread(s) per "
                    "lane", shared)
    return shared


def make_runtime(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None, weight_form: str | None = None) -> Runtime:
    """A runtime for `method`; `policy` overrides the method's default dispatch policy; `weight_form` forces
    the INT8 weight form of the quantized methods (None or "auto": this CPU's, `hetero.npu.isa`).

    Threads (default: all cores): when lanes overlap, each lane gets half of them so the lanes do not
    oversubscribe the cores: the provider's ONNX Runtime sessions (the npu lane) always, torch and the
    attention kernel (the cpu lane) while another lane runs and all of them while it runs alone
    (`sched.executor.LaneWorkers`). In program order everything gets all of them.
    """
    spec = METHODS.get(method)
    if spec is None:
        raise ConfigError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    if spec.recipe is not None:
        model = quant_model(model, spec.recipe)  # the rotated copy: its embedding and lm_head run the prefill
    threads = threads or os.cpu_count() or 1
    policy = policy or spec.policy
    overlapped = policy is not None and spec.make is not _float
    shared = max(1, threads // 2) if overlapped else threads
    use_threads(shared)
    executor = None
    if policy is not None:
        from hetero.sched.executor import OutOfOrderExecutor

        executor = OutOfOrderExecutor(model.config.n_layers, chunk, policy,
                                      torch_threads=(shared, _alone_threads(shared, threads)),
                                      learn_key=f"{model.name}-{model.fingerprint[:12]}-{method}-C{chunk}-{threads}t")
    # the NPU lane's sessions get the lane's share too: their thread count is fixed per session, and a pool
    # on every core beside attention's preempts it (docs/design.md, "Measured facts": thread split)
    backend = spec.make(model, chunk, shared, weight_form)
    from hetero.npu.placement import decode_placement

    decode = decode_placement(backend)  # where decode steps run (the CPU, as mllm-NPU; issue 28)
    log.info("placement | %s", decode.describe())
    return Runtime(model, chunk=chunk, backend=backend, executor=executor, attention_threads=threads, decode=decode)


def make_service(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 store: StoreConfig | None = None, **options: int) -> Service:
    """A `hetero.serve.Service` (contexts, prefix reuse, the chunk K/V store) over a runtime for `method`.

    `options`: max_contexts_per_client, max_active, max_queue (see `Service`).
    """
    return Service(make_runtime(model, method, chunk, threads), store, **options)
