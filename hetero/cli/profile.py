"""`hetero profile` (time every subgraph kind on the lanes present) and `hetero timeline` (a Gantt chart)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from hetero.cli import add_command
from hetero.arguments import add_method_arg, add_model_arg, int_list, positive_int
from hetero.cli.npu import add_hub_profile_args, run_hub_profile
from hetero.errors import ConfigError
from hetero.sched.policy import POLICIES

CLI_POLICIES = sorted(p for p in POLICIES if p != "random")  # random exists for tests only


def register(sub: Any) -> None:
    prof = add_command(sub, "profile")
    add_model_arg(prof)
    add_method_arg(prof)
    prof.add_argument("--out", help="output path (default: $HETERO_CACHE or ~/.cache/hetero, profiles/<host>.json)")
    prof.add_argument("--repeats", type=positive_int, default=5)
    prof.add_argument("--chunks", default="32,64,128,256,512", help="chunk lengths C to profile")
    prof.add_argument("--kv-lens", default="256,1024,2048,4096", help="KV lengths for attention")
    prof.add_argument("--layer", type=int, default=0, help="which decoder layer to time (all layers share shapes)")
    prof.add_argument("--threads", type=positive_int, default=None, help="threads, as for `hetero run` (default: all cores)")
    add_hub_profile_args(prof)  # --hub, --device, --hub-chunks, --hub-out
    prof.set_defaults(func=cmd_profile)

    tl = add_command(sub, "timeline")
    tl.add_argument("--profile", help="profile JSON for a simulated schedule (default: the derived 8 Gen 3 profile)")
    tl.add_argument("--prompt-len", type=positive_int, default=1024)
    tl.add_argument("--chunk", type=positive_int, default=256)
    tl.add_argument("--policy", choices=CLI_POLICIES, default="rank")
    tl.add_argument("--out", default="timeline.png")
    tl.add_argument("--real", action="store_true", help="run a real prefill of the default model and draw it")
    add_model_arg(tl)
    add_method_arg(tl)
    tl.set_defaults(func=cmd_timeline)


def subgraph_runner(runtimes: dict[int, Any], layer: int = 0) -> Callable[[str, str, int, int], None]:
    """A `run_subgraph(kind, lane, C, kv_len)` timing the real subgraphs of one layer; `runtimes[C]` holds
    the graphs prepared for chunk length C (static subgraphs have fixed shapes, mllm-NPU §3.2): the generic
    layer's (qkv, attn, o_ffn) or a fused backend's whole layer (layer, or its halves layer_attn, layer_ffn)."""
    import numpy as np

    from hetero.sched.measure import NotMeasured

    any_rt = next(iter(runtimes.values()))
    cfg = any_rt.cfg
    k_cache = np.zeros((cfg.n_kv_heads, cfg.context_length + 512, cfg.head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    inputs: dict[int, tuple[np.ndarray, ...]] = {}
    lanes = dict(any_rt.placement)

    def run(kind: str, lane: str, c: int, kv_len: int) -> None:
        if lanes.get(kind) != lane or c not in runtimes:
            raise NotMeasured  # this runtime places `kind` on another lane, or has no graphs for C
        rt = runtimes[c]
        if c not in inputs:
            g = np.random.default_rng(c)
            inputs[c] = tuple(g.standard_normal((c, n), dtype=np.float32)
                              for n in (cfg.hidden, cfg.q_dim, cfg.q_dim + 2 * cfg.kv_dim)) + (
                np.empty((c, cfg.q_dim), np.float32), np.empty((c, cfg.hidden), np.float32))
        h, a, qkv, out, h_out = inputs[c]
        start = max(0, min(kv_len, cfg.context_length) - c)  # a chunk that ends at kv_len keys
        if kind in ("qkv", "o_ffn") and getattr(rt.backend, "tensors", "numpy") == "torch":
            import torch  # a torch backend (float methods): torch views of the same inputs

            with torch.inference_mode():
                h, a = torch.from_numpy(h), torch.from_numpy(a)
                rt.backend.qkv(layer, h) if kind == "qkv" else rt.backend.o_ffn(layer, a, h)
        elif kind == "qkv":
            rt.backend.qkv(layer, h)
        elif kind == "o_ffn":
            rt.backend.o_ffn(layer, a, h)
        elif kind == "attn":  # the runtime's own kernel (`hetero.attention`), as a prefill runs it
            rt.attention(qkv, k_cache, v_cache, start, out, layer)
        elif kind == "layer":  # a fused backend's whole layer (`NpuBackend.layer`), as `runtime.PrefillJob` runs it
            rt.backend.layer(layer, h, k_cache, v_cache, start, rt.attention.tables(layer), h_out,
                             rt.attention.qk_norm(layer))
        elif kind == "layer_attn":
            rt.backend.layer_attn(layer, h, k_cache, v_cache, start, rt.attention.tables(layer), qkv, out,
                                  rt.attention.qk_norm(layer))
        elif kind == "layer_ffn":
            rt.backend.layer_ffn(layer, a, h, h_out)
        else:
            raise NotMeasured

    return run


def cmd_profile(args: argparse.Namespace) -> int:
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.sched.measure import profile_command

    if args.hub:
        return run_hub_profile(args)
    chunk_lens = int_list(args.chunks, "--chunks")
    kv_lens = int_list(args.kv_lens, "--kv-lens")
    model = load_model(args.model)
    if not 0 <= args.layer < model.config.n_layers:
        raise ConfigError(f"--layer must be in [0, {model.config.n_layers}), got {args.layer}")
    runtimes = {c: make_runtime(model, args.method, chunk=c, threads=args.threads,
                                weight_form=args.weight_form) for c in chunk_lens}
    placement = runtimes[chunk_lens[0]].placement  # the method's subgraphs (e.g. the default's whole-layer halves)
    profile_command(
        args.out, subgraph_runner(runtimes, args.layer), kinds=tuple(dict.fromkeys(kind for kind, _ in placement)),
        lanes=tuple(dict.fromkeys(lane for _, lane in placement)), chunk_lens=chunk_lens, kv_lens=kv_lens,
        repeats=args.repeats, n_layers=model.config.n_layers, layer_subgraphs=placement,
        metadata={"model": {"name": model.name, "fingerprint": model.fingerprint}, "method": args.method,
                  "threads": {"total": args.threads or os.cpu_count(),
                              "note": "each lane on its make_runtime share (half each when lanes overlap)"}},
    )
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from hetero.sched.timeline import plot_timeline, summary_text, timeline_command

    if not args.real:
        s = timeline_command(args.profile, args.prompt_len, args.chunk, args.policy, args.out)
        print(f"wrote {args.out}: {args.prompt_len} tokens, {summary_text(s)}")
        return 0
    from hetero.outliers.corpus import prompt_ids
    from hetero.loader import load_model
    from hetero.methods import make_runtime

    model = load_model(args.model)
    runtime = make_runtime(model, args.method, chunk=args.chunk, policy=args.policy,
                           weight_form=args.weight_form)
    ids = prompt_ids(args.model, args.prompt_len)
    runtime.prefill(ids)  # warm-up
    result = runtime.prefill(ids)
    if result.schedule is None:
        raise ConfigError(f"method {args.method!r} ran without the out-of-order executor: nothing to draw")
    plot_timeline(result.schedule, args.out, f"real run: {model.name}, {args.prompt_len} tokens, C={args.chunk}, {args.policy}")
    print(f"wrote {args.out}: {args.prompt_len} tokens in {result.total_ms:.0f} ms ({result.tokens_per_s:.0f} tokens/s), "
          f"{summary_text(result.schedule)}")
    return 0
