"""Prebuilt-graph cache and chunk sharing, measured (mllm-NPU §3.2): `bench/graph_cache.py`.

1. Per provider (ORT CPU EP; QNN HTP simulator if installed): every static graph built into an empty cache
   vs loaded from it. 2. Graph count and INT8 weight memory: shared static graphs vs a prompt graph per
   prompt length vs chunk graphs. 3. One layer's `qkv` and `o_ffn` on the CPU EP vs torch float.

    python bench/graph_cache.py --json --out bench/results     # also writes graph_cache.json
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.entry import add_out_arg, out_dir, wrote
from hetero import model as ref
from hetero.arguments import positive_int
from hetero.loader import load_model
from hetero.methods import quant_plan, quant_setup, use_threads
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.cache import library_versions
from hetero.npu.naive import graph_counts
from hetero.paths import atomic_path

HELP = "prebuilt-graph cache: build vs load, graph counts and memory, one layer's latency"


# Every graph in the plain [C, K] form: the recorded equivalent shapes (`hetero npu shapes`) change compile
# times a lot on the HTP simulator, and this bench compares build vs load, not shapes.
SHAPE = "2d"


def build_vs_load(model, plan, chunk: int, provider_name: str, layers, threads: int) -> dict:
    """Build every graph into an empty graph cache, then load them from it (median of 3 loads)."""
    with tempfile.TemporaryDirectory(prefix="hetero-graphs-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        be = NpuBackend(model, plan, chunk, provider=provider_name, layers=layers,
                        options=GraphOptions(intra_op_threads=threads, shape=SHAPE, graphs_root=root))
        build_s = time.perf_counter() - t0
        assert not any(r[3] for r in be.report.rows)
        n, size = len(be.report.rows), be.report.size_bytes
        provider = be.provider.name
        del be
        loads = []
        for _ in range(3):
            t0 = time.perf_counter()
            be = NpuBackend(model, plan, chunk, provider=provider_name, layers=layers,
                            options=GraphOptions(intra_op_threads=threads, shape=SHAPE, graphs_root=root))
            loads.append(time.perf_counter() - t0)
            assert be.report.all_cached
            del be
        load_s = statistics.median(loads)
    return {"provider": provider, "chunk": chunk, "layers": len(list(layers)), "n_graphs": n,
            "cache_bytes": size, "build_s": round(build_s, 4), "load_s": round(load_s, 4),
            "speedup": round(build_s / load_s, 1)}


def _median_ms(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


@torch.inference_mode()
def layer_latency(model, plan, chunk: int, threads: int, repeats: int) -> dict:
    cfg, lw = model.config, model.weights.layers[0]
    be = NpuBackend(model, plan, chunk, provider="cpu", layers=[0],
                    options=GraphOptions(intra_op_threads=threads, shape=SHAPE))
    use_threads(threads)
    h = torch.randn(chunk, cfg.hidden)
    a = torch.randn(chunk, cfg.q_dim) * 0.3
    hn, an = h.numpy(), a.numpy()  # the NPU lane's backend takes numpy (the same memory)
    res = {"qkv": {"npu_cpu_ms": [], "torch_ms": []}, "o_ffn": {"npu_cpu_ms": [], "torch_ms": []}}
    for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
        res["qkv"]["npu_cpu_ms"].append(_median_ms(lambda: be.qkv(0, hn), 3))
        res["qkv"]["torch_ms"].append(_median_ms(lambda: ref.qkv(cfg, lw, h), 3))
        res["o_ffn"]["npu_cpu_ms"].append(_median_ms(lambda: be.o_ffn(0, an, hn), 3))
        res["o_ffn"]["torch_ms"].append(_median_ms(lambda: ref.o_ffn(cfg, lw, a, h), 3))
    out = {}
    for kind, d in res.items():
        npu, tf = statistics.median(d["npu_cpu_ms"]), statistics.median(d["torch_ms"])
        out[kind] = {"npu_cpu_ms": round(npu, 3), "torch_float_ms": round(tf, 3), "speedup": round(tf / npu, 2)}
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--chunk", type=positive_int, default=256)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--qnn-layers", type=positive_int, default=30, help="layers prepared on the (slow) HTP simulator")
    ap.add_argument("--qnn-chunk", type=positive_int, default=128,
                    help="C on the HTP simulator (its generic HTP fails to finalize the C=256 o_ffn graph: constraints)")
    ap.add_argument("--repeats", type=positive_int, default=7)
    add_out_arg(ap, "graph_cache.json (with --json)")
    ap.add_argument("--json", action="store_true", help="print JSON and write <out>/graph_cache.json")


def run(args: argparse.Namespace) -> int:
    json_out = None
    if args.json:  # the QNN simulator prints banners on fd 1: keep stdout for the JSON alone
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    model, plan = quant_setup(load_model(), "cpu")  # the model and plan the runtime uses
    cfg = model.config

    rows = [build_vs_load(model, plan, args.chunk, "cpu", range(cfg.n_layers), args.threads)]
    try:
        import onnxruntime_qnn  # noqa: F401

        rows.append(build_vs_load(model, quant_plan(model, "qnn"), args.qnn_chunk, "qnn",
                                  range(min(args.qnn_layers, cfg.n_layers)), args.threads))
    except ImportError:
        pass

    # the naive prompt graph: its whole graph set is rebuilt for every new prompt length T
    naive = []
    for t in (300, 1024):
        with tempfile.TemporaryDirectory(prefix="hetero-graphs-") as tmp:
            t0 = time.perf_counter()
            NpuBackend(model, plan, t, provider="cpu",
                       options=GraphOptions(intra_op_threads=args.threads, use_cache=False, shape=SHAPE, graphs_root=Path(tmp)))
            naive.append({"prompt_len": t, "prepare_s": round(time.perf_counter() - t0, 3)})

    counts = []
    for t in (256, 512, 1024, 2048):
        for g in graph_counts(model, t, args.chunk):
            counts.append({"strategy": g.strategy, "prompt_len": t, "chunk": g.chunk, "n_graphs": g.n_graphs,
                           "weight_mib": round(g.weight_bytes / 2**20, 1), "builds": g.builds, "note": g.note})

    lat = layer_latency(model, plan, args.chunk, args.threads, args.repeats)
    result = {
        "bench": "graph_cache", "model": model.name, "chunk": args.chunk, "threads": args.threads,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "versions": library_versions(),
        "note": "QNN rows run the HTP *simulator* of the onnxruntime-qnn x86-64 wheel (simulated, not a device). "
                "Graphs in the plain [C, K] shape. build = export + compile + store into an empty cache (sha256 of every file recorded); load = median "
                "of 3 loads from the cache (files checked against their recorded size and stat stamp, re-hashed "
                "when the stamp moved). The machine is shared: ratios, not absolute times, are meaningful.",
        "cache": rows, "naive_prompt_graph_prepare": naive, "graph_counts": counts, "layer_latency_C": lat,
    }
    if args.json:
        json_out.write(json.dumps(result, indent=1) + "\n")
        json_out.flush()
        out = out_dir(args.out)
        with atomic_path(out / "graph_cache.json") as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n")
        wrote([out / "graph_cache.json"])
    else:
        for r in rows:
            print(f"{r['provider']:8s} graphs={r['n_graphs']:3d} build {r['build_s']:.3f}s load {r['load_s']:.3f}s ×{r['speedup']}")
        print("naive prompt graph prepare:", naive)
        for c in counts:
            print(f"T={c['prompt_len']:5d} {c['strategy']:14s} graphs={c['n_graphs']:4d} weights={c['weight_mib']:7.1f} MiB")
        print("layer latency:", lat)
    return 0
