"""`hetero bench scale` / `bench/scale.py`: prefill, decode, peak RSS and cold set-up by model size, beside the
peers, at the shapes devices run (synthetic weights: speed and memory only).

Per shape of `bench.synth_model.SHAPES` (its HF folder and BF16 GGUF written first when missing), on this machine:
- `setup`: hetero's cold set-up, `hetero -v run` in a fresh process on an empty cache for the shape
  ($HETERO_CACHE = <work>/<shape>, emptied but for the peers): wall time, its phases, the process's peak RSS,
  and the cache's bytes per weight form;
- `peers`: the peers' models built from the GGUF by their own tools (`bench.peers`, into the same cache);
- `measure`: prefill tokens/s at --lens, every engine in its own process, interleaved rounds, medians, each
  process's peak RSS (`bench.harness.run_engines`, as `bench/prefill.py`); plain decode at context 1024
  (`bench/decode.py --plain-only --baselines none`, peers in their own processes); the machine bound
  (`bench.machine_bound`); a probe process that prefills 2,048 tokens and decodes 64 (issue 41's run-time
  figure: its peak RSS, its resident memory by mapping, the KV cache's bytes); and where the prefill's time goes
  at 1024 (`bench/prefill_parts.py`).
Each step merges its part into --out's scale.json (other shapes are kept), so the steps can run apart: set-up
and builds under a big-memory lock, the timed step under the bench lock. A shape that cannot run here gets a
one-line reason instead (`refusal`).

    python bench/scale.py --shapes llama-3.2-1b --out bench/results            # every step, one shape
    python bench/scale.py --shapes llama-3.2-1b --steps setup,peers --out bench/results
    python bench/scale.py --shapes llama-3.2-1b --steps measure --clean --out bench/results
    python bench/scale.py --report --out bench/results                         # rewrite md/png from the json
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
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.conditions import load_avg, peak_rss_mb
from bench.entry import add_out_arg, child_env, exit_reason, out_dir, write_json_md, wrote
from hetero.arguments import int_list, positive_int
from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.npu.placement import DECODE_FORMS

HELP = "prefill, decode, peak RSS and cold set-up by model size (synthetic shapes) beside the peers"
SYNTHETIC = "synthetic weights: speed and memory only"
# the peers at their fastest configurations (`bench.peer_engines`); llama.cpp's BF16 GGUF as written is not one
PEERS = ("openvino_genai", "openvino_genai_int4", "ort_genai", "llama_cpp_q4_0", "llama_cpp_q4_0_fa",
         "llama_cpp_q8_0", "llama_cpp_q8_0_fa")
STEPS = ("setup", "peers", "measure")
DECODE_CONTEXT = 1024
# hetero's opt-in decode forms (`hetero run --decode-form`): a row and a memory probe each beside the default's
OPT_IN_FORMS = DECODE_FORMS[1:]
RSS_POLL_S = 0.05  # how often a measured process's VmHWM is read (a peak in its last 50 ms would be missed)
PROBE_PROMPT, PROBE_NEW = 2048, 64  # issue 41's run-time memory figure: a process that prefills 2,048, decodes 64
SETUP_PROMPT = "What is the capital of France? Answer in one sentence."
# Targets (issue 41 item 5): prefill over the fastest peer, fraction of the machine bound at 1024, decode over it.
TARGETS = {"prefill_over_best_peer": 1.1, "bound_fraction_1024": 0.6, "decode_over_best_peer": 1.0}
# What a shape needs, per parameter, measured at llama-3.2-1b (docs/journal.md, issue 41 items 1-2): the peers'
# exporters (transformers under optimum-intel and ONNX Runtime GenAI's builder) hold the model in float32 whole;
# disk: the synthetic folder + GGUF (4 B), hetero's cache (the rotated float32 copy and the INT8 forms: ~7 B, 22 GB at
# llama-3.2-3b), peers (~4 B).
EXPORT_BYTES_PER_PARAM = 4
DISK_BYTES_PER_PARAM = 15
# Peak RSS of a peer's build per parameter, measured at llama-3.2-1b (1.236 B): OpenVINO's (transformers' GGUF
# loader, then optimum-cli) 8.07 GB, ONNX Runtime GenAI's builder 13.0 GB; llama.cpp's quantizer streams.
PEER_BUILD_BYTES_PER_PARAM = {"openvino_genai": 6.5, "openvino_genai_int4": 6.5, "ort_genai": 10.5}


def param_count(cfg: ModelConfig) -> int:
    """Weights of a model: every static linear, the embedding and an untied head (norms are noise)."""
    from bench.machine_bound import linear_ops_per_token

    return int(linear_ops_per_token(cfg) // 2 + cfg.vocab * cfg.hidden * (1 if cfg.tie_embeddings else 2))


def shape_config(shape: str) -> ModelConfig:
    """The ModelConfig of a synthetic shape (`synth_model.ALL_SHAPES`), without writing it."""
    from bench.synth_model import ALL_SHAPES

    if shape not in ALL_SHAPES:
        raise ConfigError(f"no shape {shape!r}; one of {', '.join(ALL_SHAPES)}")
    return ModelConfig.from_hf(dict(ALL_SHAPES[shape]))


def refusal(params: int, ram_bytes: int, disk_free_bytes: int) -> str | None:
    """Why a shape of `params` weights cannot run on a machine with this memory and free disk, or None."""
    fp32, disk = EXPORT_BYTES_PER_PARAM * params, DISK_BYTES_PER_PARAM * params
    if fp32 > ram_bytes:
        return (f"its float32 weights ({fp32 / 1e9:.0f} GB) exceed this machine's {ram_bytes / 1e9:.0f} GB of memory: "
                "the peers' exporters (transformers under optimum-intel, ONNX Runtime GenAI's builder) hold them whole")
    if disk > disk_free_bytes:
        return (f"it needs ~{disk / 1e9:.0f} GB of disk (synthetic files, hetero's cache, the peers' models), "
                f"{disk_free_bytes / 1e9:.0f} GB free")
    return None


def peer_refusal(peer: str, params: int, ram_bytes: int) -> str | None:
    """Why peer `peer`'s model cannot be built here for a shape of `params` weights (its builder's memory), or None."""
    need = PEER_BUILD_BYTES_PER_PARAM.get(peer, 0) * params
    if need <= ram_bytes:
        return None
    return (f"its builder would need ~{need / 1e9:.0f} GB ({PEER_BUILD_BYTES_PER_PARAM[peer]} bytes per parameter, "
            f"measured at llama-3.2-1b), more than this machine's {ram_bytes / 1e9:.0f} GB")


def machine_room(path: Path) -> tuple[int, int]:
    """(physical memory, free disk at `path`) in bytes."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram, shutil.disk_usage(path).free


# --- hetero's cold set-up -------------------------------------------------------------------------------------


def form_of(rel: str) -> str:
    """The weight form a file of hetero's cache holds, by its path under the cache root."""
    name = Path(rel).name
    if rel.startswith("graphs/"):
        return "ONNX graphs (ONNX Runtime's files)"
    if not rel.startswith("models/"):
        return "other"
    if name == "weights.safetensors":
        return "rotated float32 copy" if re.search(r"-rot[^/]*/", rel) else "float32 weights (from the GGUF)"
    for prefix, form in (("gemv8-", "INT8 GEMV weights (decode)"), ("head-int8-", "INT8 head"),
                         ("int8-", "INT8 graph weights (prefill)"), ("shadow_rows-", "shadow rows (float)")):
        if name.startswith(prefix):
            return form
    return "other"


def form_bytes(cache: Path) -> dict[str, int]:
    """Bytes of each weight form in hetero's cache (the peers' models excluded)."""
    out: dict[str, int] = {}
    for p in cache.rglob("*"):
        rel = p.relative_to(cache).as_posix()
        if p.is_file() and not p.is_symlink() and not rel.startswith(("peers/", "bench/")):
            form = form_of(rel)
            out[form] = out.get(form, 0) + p.stat().st_size
    return dict(sorted(out.items()))


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, the process's peak RSS in MB, its stdout) of `cmd` in a fresh process; ConfigError on failure. The
    peak is its VmHWM read every RSS_POLL_S until it exits (`conditions.peak_rss_mb`: its `ru_maxrss` would carry
    this process's own high-water mark)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, peak_rss_mb(proc.pid) or 0.0)
            time.sleep(RSS_POLL_S)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise ConfigError(f"{' '.join(cmd[:4])} ... {exit_reason(proc.returncode)}: "
                              + " | ".join(err.read().strip().splitlines()[-3:]))
        return wall, peak, out.read()


def cold_setup(gguf: Path, cache: Path, threads: int) -> dict[str, Any]:
    """hetero's cold set-up: `hetero -v run` on the GGUF in a fresh process, the shape's cache emptied first (the
    peers' models kept: they are not hetero's); wall time, phases, peak RSS, the cache's bytes per weight form."""
    cache.mkdir(parents=True, exist_ok=True)
    for p in cache.iterdir():
        if p.name != "peers":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    cmd = [sys.executable, "-m", "hetero", "-v", "run", "--model", str(gguf), SETUP_PROMPT, "-n", "8", "--json",
           "--threads", str(threads)]
    wall, rss, out = run_measured(cmd, child_env({**os.environ, "HETERO_CACHE": str(cache)}))
    res = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(rss), "phases_s": res.get("seconds", {}),
            "cache_bytes": form_bytes(cache), "loadavg_1m": round(load_avg(), 2),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# --- the probe: a process that prefills 2,048 tokens and decodes 64 ---------------------------------------------


def mapping_kind(path: str) -> str:
    """What a /proc/self/smaps mapping holds, by its path."""
    name = path.rsplit("/", 1)[-1]
    for prefix, kind in (("gemv8-", "INT8 GEMV weights file"), ("head-int8-", "INT8 head file"),
                         ("int8-", "INT8 graph weights file"), ("shadow_rows-", "shadow rows file")):
        if name.startswith(prefix):
            return kind
    if name == "weights.safetensors":
        return "float32 weights file"
    if name.endswith(".gguf"):
        return "GGUF"
    if name in ("model.data", "compiled.onnx", "model.onnx"):
        return "ONNX graph files"
    if ".so" in name:
        return "libraries"
    if path in ("[heap]", ""):
        return "heap" if path else "anonymous"
    return path if path.startswith("/dev/") else "other"


def resident_by_kind(smaps: str) -> dict[str, int]:
    """Resident bytes per `mapping_kind` from the text of /proc/<pid>/smaps."""
    out: dict[str, int] = {}
    kind = "anonymous"
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
            kind = mapping_kind(head[5].strip() if len(head) > 5 else "")
        elif line.startswith("Rss:"):
            out[kind] = out.get(kind, 0) + int(line.split()[1]) * 1024
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def probe(model_path: str, threads: int, decode_form: str | None = None) -> dict[str, Any]:
    """In this (fresh) process: hetero's runtime (decoding in `decode_form`, `hetero run --decode-form`), a 2,048-token
    prefill and 64 decoded tokens; the peak RSS after each, resident bytes by mapping at the end, the KV cache's bytes
    and the INT8 weights the CPU keeps."""
    from hetero.decode import SamplingParams, generate
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.outliers.corpus import prompt_ids

    def peak() -> float:
        return round(peak_rss_mb(), 1)

    ids = prompt_ids(model_path, PROBE_PROMPT, 1)
    rt = make_runtime(load_model(model_path), "hetero", threads=threads, decode_form=decode_form)
    after = {"runtime": peak()}
    r = rt.prefill(ids)
    after[f"prefill {PROBE_PROMPT}"] = peak()
    generate(rt, r, SamplingParams(max_new_tokens=PROBE_NEW, stop_token_ids=()), context_ids=ids.tolist())
    after[f"decode {PROBE_NEW}"] = peak()
    plan = getattr(rt.backend, "plan", None)
    with open("/proc/self/smaps") as f:
        resident = resident_by_kind(f.read())
    return {"decode_form": decode_form or "auto", "decode_weights_bytes": _decode_bytes(rt),
            "peak_rss_mb": after, "resident_bytes": resident, "kv_cache_bytes": r.cache.nbytes(),
            "kv_cache_tokens": PROBE_PROMPT + PROBE_NEW,
            "int8_weights_kept_on_cpu_bytes": sum(w.q.nbytes for w in plan.weights.values()) if plan else 0}


def _decode_bytes(rt) -> int:
    """Bytes of the decode GEMVs' weights a runtime placed (its arenas: the head and, after a step, the layers)."""
    from hetero.decode.step import DecodeStep

    step = DecodeStep.of(rt)
    return step._gemv_weights().nbytes if step.kernel in ("gemv", "blocks") else 0


# --- the measured step ------------------------------------------------------------------------------------------


def run_module(args: list[str]) -> str:
    """stdout of `python -m bench <args>` in a process of its own; ConfigError naming its last lines on failure."""
    proc = subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise ConfigError(f"bench {args[0]} {exit_reason(proc.returncode)}: "
                          + (" | ".join(proc.stderr.strip().splitlines()[-3:]) or "no message"))
    return proc.stdout


def where_time_goes(gguf: Path, threads: int, n: int = 1024) -> dict[str, Any]:
    """`bench/prefill_parts.py`'s breakdown of hetero's prefill at `n` tokens (its row), in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="hetero-scale-") as tmp:
        run_module(["prefill_parts", "--model", str(gguf), "--lens", str(n), "--repeats", "1",
                    "--threads", str(threads), "--out", tmp])
        return json.loads((Path(tmp) / "prefill_parts.json").read_text())["rows"][0]


def decode_rows(gguf: Path, peers: tuple[str, ...], repeats: int, threads: int, new: int,
                forms: tuple[str, ...] = OPT_IN_FORMS) -> dict[str, Any]:
    """Plain decode tokens/s at DECODE_CONTEXT: hetero INT8, its opt-in `forms` and the peers (`bench/decode.py
    --plain-only`). The forms' runtimes share the default's process and its prefill (`methods.with_decode_form`;
    each with prefill sessions of its own, llama-3.2-3b's process was killed for memory at 16.4 GB anonymous). A run
    that still fails with forms is run again without them, and why is recorded."""
    try:
        with tempfile.TemporaryDirectory(prefix="hetero-scale-") as tmp:
            run_module(["decode", "--plain-only", "--model", str(gguf), "--baselines", "none",
                        "--decode-forms", ",".join(forms), "--contexts",
                        str(DECODE_CONTEXT), "--peers", ",".join(peers) or "none", "--repeats", str(repeats),
                        "--threads", str(threads), "--new", str(new), "--out", tmp])
            got = json.loads((Path(tmp) / "decode_plain.json").read_text())
    except ConfigError as e:
        if not forms:
            raise
        left = decode_rows(gguf, peers, repeats, threads, new, ())
        return {**left, "skipped": {**left["skipped"], **{f"hetero_{f}": f"left out: with it {e}" for f in forms}}}
    return {"row": got["plain"][0], "skipped": got["skipped"]}


def measure(gguf: Path, cfg: ModelConfig, lens: list[int], repeats: int, threads: int, peers: tuple[str, ...],
            new: int) -> dict[str, Any]:
    """The timed step of one shape (its caches warm: `setup` and `peers` ran)."""
    from bench.harness import run_engines
    from bench.machine_bound import machine_bound

    load_before = load_avg()
    rows, skipped = run_engines(["hetero", *peers], lens, repeats, threads, str(gguf))
    bound = machine_bound(cfg, lens, threads)
    try:  # a failed decode keeps the prefill rounds (a shape's timed step takes an hour at 3B)
        decode = decode_rows(gguf, peers, repeats, threads, new)
    except ConfigError as e:
        decode = {"row": {}, "skipped": {"hetero": str(e)}}
    probes = {}
    for form in ("auto", *OPT_IN_FORMS):
        try:
            wall, rss, out = run_measured([sys.executable, "-m", "bench", "scale", "--probe", "--model", str(gguf),
                                           "--threads", str(threads), "--decode-form", form], child_env())
            probes[form] = {**json.loads(out.strip().splitlines()[-1]), "process_peak_rss_mb": round(rss)}
        except ConfigError as e:
            if form == "auto":
                raise
            probes[form] = {"skipped": str(e)}
    parts = where_time_goes(gguf, threads)
    return {"rows": [asdict(r) for r in rows], "skipped": skipped, "bound": bound, "decode": decode,
            "probe": probes.pop("auto"), "probe_opt_in": probes,
            "prefill_parts_1024": parts, "repeats": repeats, "threads": threads,
            "loadavg_1m_start": round(load_before, 2), "loadavg_1m_end": round(load_avg(), 2),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# --- pure: the summary per shape, the tables -------------------------------------------------------------------


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    """Ratios and targets of one measured shape: hetero over the fastest peer per prompt length, the fraction of
    the machine bound, decode over the fastest peer, each engine's peak RSS, which targets are met."""
    from bench.harness import Row
    from bench.report import best_peer_fraction, fraction_of_bound, vs_best_peer

    rows = [Row(**r) for r in entry["rows"]]
    best = vs_best_peer(rows, PEERS)
    # on a shared machine another job only slows a round: each engine's fastest round beside the medians
    fastest = vs_best_peer([replace(r, tokens_per_s=round(r.prompt_len / (min(r.runs_ms) / 1e3), 1)) for r in rows
                            if r.runs_ms], PEERS)
    bound = fraction_of_bound(rows, entry["bound"])
    drow = entry["decode"]["row"]
    dpeers = {p: drow[p] for p in PEERS if isinstance(drow.get(p), (int, float))}
    dbest = max(dpeers, key=dpeers.get) if dpeers else None
    hetero_decode = drow.get("hetero") if isinstance(drow.get("hetero"), (int, float)) else None
    rss = {r.engine: r.peak_rss_mb for r in rows}
    at_1024 = next((b["fraction"] for b in bound if b["prompt_len"] == 1024), None)
    decode_over = round(hetero_decode / dpeers[dbest], 3) if dbest and hetero_decode else None
    met = {"prefill_over_best_peer": bool(best) and all(b["hetero_over"] >= TARGETS["prefill_over_best_peer"]
                                                        for b in best),
           "bound_fraction_1024": at_1024 is not None and at_1024 >= TARGETS["bound_fraction_1024"],
           "decode_over_best_peer": decode_over is not None and decode_over >= TARGETS["decode_over_best_peer"]}
    opt_in = {}  # hetero's opt-in decode forms: beside the default, never in its targets
    for form in OPT_IN_FORMS:
        tps = drow.get(f"hetero_{form}")
        if isinstance(tps, (int, float)):
            probe = entry.get("probe_opt_in", {}).get(form, {})
            opt_in[form] = {"tokens_per_s": tps, "over_best_peer": round(tps / dpeers[dbest], 3) if dbest else None,
                            "probe_peak_rss_mb": probe.get("process_peak_rss_mb")}
    return {"vs_best_peer": best, "vs_best_peer_fastest_round": fastest, "hetero_bound_fraction": bound,
            "best_peer_bound_fraction": best_peer_fraction(best, entry["bound"]),
            "decode": {"context": DECODE_CONTEXT, "hetero_tokens_per_s": hetero_decode, "best_peer": dbest,
                       "peer_tokens_per_s": dpeers.get(dbest) if dbest else None, "hetero_over": decode_over,
                       "opt_in": opt_in},
            "peak_rss_mb": rss, "targets_met": met}


def _gb(b: float | None) -> str:
    return "—" if b is None else f"{b / 1e9:.2f}"


def _cell(x: Any, fmt: str = "{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(result: dict[str, Any]) -> str:
    """scale.md: the machine and the conditions, one table row per shape, then each shape's engines."""
    c = result["conditions"]
    shapes = result["shapes"]
    lines = [f"# Scale: prefill, decode, peak RSS and cold set-up by model size ({SYNTHETIC})", "",
             f"CPU: {c['machine']}. {c['threads']} threads. {c['note']}", "",
             "Every model here is synthetic (`bench/synth_model.py`: seeded weights at the real checkpoints' "
             f"configs): {SYNTHETIC}, never accuracy. Each engine runs in its own process; prefill tokens/s are "
             "medians of interleaved rounds (`bench.harness`), decode the median of rounds at context "
             f"{DECODE_CONTEXT} (`bench/decode.py --plain-only`). Reproduce: `python bench/scale.py --shapes "
             f"{','.join(n for n, e in shapes.items() if 'skipped' not in e)} --out bench/results` (every step; the "
             f"last command was `{c['command']}`).", "",
             "## Per shape: hetero beside the fastest peer", "",
             "| shape | params (B) | prefill 256: hetero / best peer | 1024 | 2048 | hetero / machine bound at 1024 "
             "| decode at 1024: hetero / best peer (tok/s) | peak RSS hetero / lowest peer (MB) "
             "| cold set-up (s, peak RSS MB) | load |",
             "|---|---:|---|---|---|---:|---|---|---|---|"]
    for name, e in shapes.items():
        if "skipped" in e:
            continue
        s = e.get("summary")
        setup = e.get("setup", {})
        cold = f"{setup['wall_s']:.0f}, {setup['peak_rss_mb']:.0f}" if setup else "—"
        if not s:
            lines.append(f"| {name} | {e['params'] / 1e9:.2f} | not measured: {e.get('not_run', 'not yet')} | | | | | | "
                         f"{cold} | |")
            continue
        by = {b["prompt_len"]: b for b in s["vs_best_peer"]}

        def pre(n: int) -> str:
            b = by.get(n)
            return "—" if b is None else (f"{b['hetero_tokens_per_s']:.0f} / {b['peer_tokens_per_s']:.0f} "
                                          f"({b['best_peer']}): **{b['hetero_over']:.2f}×**")
        frac = next((b["fraction"] for b in s["hetero_bound_fraction"] if b["prompt_len"] == 1024), None)
        d = s["decode"]
        dec = (f"{_cell(d['hetero_tokens_per_s'], '{:.1f}')} / {_cell(d['peer_tokens_per_s'], '{:.1f}')} "
               f"({d['best_peer']}): **{_cell(d['hetero_over'], '{:.2f}')}×**"
               + "".join(f"; opted into {f}: {o['tokens_per_s']:.1f}, **{_cell(o['over_best_peer'], '{:.2f}')}×**"
                         for f, o in d.get("opt_in", {}).items()))
        peer_rss = {k: v for k, v in s["peak_rss_mb"].items() if k != "hetero"}
        low = min(peer_rss, key=peer_rss.get) if peer_rss else None
        rss = (f"{_cell(s['peak_rss_mb'].get('hetero'))} / "
               + (f"{peer_rss[low]:.0f} ({low})" if low else "—"))
        m = e["measure"]
        lines.append(f"| {name} | {e['params'] / 1e9:.2f} | {pre(256)} | {pre(1024)} | {pre(2048)} | "
                     f"{_cell(frac, '{:.2f}')} | {dec} | {rss} | {cold} | "
                     f"{m['loadavg_1m_start']}–{m['loadavg_1m_end']} |")
    fast = [(n, b) for n, e in shapes.items() if e.get("summary") for b in e["summary"]["vs_best_peer_fastest_round"]]
    if fast:
        lines += ["", "Each engine's fastest round instead of its median (another job on the shared cores only slows a "
                  "round): hetero / the fastest peer " + "; ".join(
                      f"{n} at {b['prompt_len']}: {b['hetero_tokens_per_s']:.0f} / {b['peer_tokens_per_s']:.0f} "
                      f"({b['best_peer']}) = {b['hetero_over']:.2f}×" for n, b in fast) + "."]
    lines += ["", f"Targets (issue 41 item 5): prefill ≥ {TARGETS['prefill_over_best_peer']}× the fastest peer at "
              f"every length, ≥ {TARGETS['bound_fraction_1024']} of the machine bound at 1024, decode ≥ the fastest "
              "peer. Peak RSS here is each prefill process's (the model and prompts of 256–2,048 tokens)."]
    for name, e in shapes.items():
        if "skipped" in e:
            lines += ["", f"## {name}: not run", "", f"{e['skipped']}."]
            continue
        lines += ["", f"## {name} ({e['params'] / 1e9:.2f} B parameters, {SYNTHETIC})", ""]
        if "setup" in e:
            st = e["setup"]
            phases = ", ".join(f"{k} {v:.0f}" for k, v in st["phases_s"].items())
            lines += [f"Cold set-up (a fresh `hetero -v run` on an empty cache): {st['wall_s']:.0f} s, peak RSS "
                      f"{st['peak_rss_mb']:.0f} MB (phases, s: {phases}; load {st['loadavg_1m']}). Cache bytes per "
                      "weight form (GB): " + ", ".join(f"{k} {_gb(v)}" for k, v in st["cache_bytes"].items()) + ".", ""]
        if "peer_builds_s" in e:
            lines += ["Peer builds (s, from the GGUF by their own tools; one already cached is not timed again): "
                      + ", ".join(f"{k} {v}" for k, v in e["peer_builds_s"].items()) + ".", ""]
        if "measure" not in e:
            continue
        m, s = e["measure"], e["summary"]
        lines += [f"Measured {m['date']}, {m['repeats']} interleaved rounds, load {m['loadavg_1m_start']}–"
                  f"{m['loadavg_1m_end']}.", "",
                  "| engine | " + " | ".join(f"prefill {n} tok/s" for n in sorted({r['prompt_len'] for r in m['rows']}))
                  + f" | decode {DECODE_CONTEXT} tok/s | peak RSS MB |",
                  "|---|" + "---:|" * (len({r['prompt_len'] for r in m['rows']}) + 2)]
        drow = m["decode"]["row"]
        for engine in dict.fromkeys(r["engine"] for r in m["rows"]):
            rs = sorted((r for r in m["rows"] if r["engine"] == engine), key=lambda r: r["prompt_len"])
            dv = drow.get(engine)
            lines.append(f"| {engine} | " + " | ".join(f"{r['tokens_per_s']:.1f}" for r in rs)
                         + f" | {dv if isinstance(dv, (int, float)) else '—'} | {rs[-1]['peak_rss_mb']:.0f} |")
        skipped = {**e.get("peers_refused", {}), **m["skipped"], **m["decode"]["skipped"]}
        if skipped:
            lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "."]
        b = m["bound"]
        lines += ["", "Machine bound (`bench/machine_bound.py`, measured in this run): "
                  + ", ".join(f"{p['prompt_len']}: {p['bound_tokens_per_s']:.0f} tok/s" for p in b["per_len"])
                  + f" ({b['linear_precision']} linears at {b['linear_ops_per_s'] / 1e9:.0f} Gop/s, attention "
                  f"{b['attention_precision']} at {b['attention_flop_per_s'] / 1e9:.0f} GFLOP/s); hetero's fraction "
                  + ", ".join(f"{x['prompt_len']}: {x['fraction']:.2f}" for x in s["hetero_bound_fraction"])
                  + "; the fastest peer's " + ", ".join(f"{x['prompt_len']}: {x['fraction']:.2f}"
                                                        for x in s["best_peer_bound_fraction"]) + "."]
        p = m["probe"]
        lines += ["", f"Run-time memory (a process that prefills {PROBE_PROMPT} tokens and decodes {PROBE_NEW}): "
                  f"peak RSS {p['process_peak_rss_mb']} MB (after the runtime, prefill, decode: "
                  + ", ".join(f"{v:.0f}" for v in p["peak_rss_mb"].values())
                  + f" MB); KV cache {_gb(p['kv_cache_bytes'])} GB at {p['kv_cache_tokens']} tokens; INT8 weights the "
                  f"CPU keeps {_gb(p['int8_weights_kept_on_cpu_bytes'])} GB; resident at the end (GB): "
                  + ", ".join(f"{k} {_gb(v)}" for k, v in list(p["resident_bytes"].items())[:8]) + "."]
        for form, o in s["decode"].get("opt_in", {}).items():
            q = m.get("probe_opt_in", {}).get(form, {})
            lines += ["", f"Opted into, `--decode-form {form}` ({form.upper()} blocks made from the file's float weights, "
                      f"a 4-bit re-rounding as the 4-bit peers'): decode at {DECODE_CONTEXT} {o['tokens_per_s']} "
                      f"tokens/s, {_cell(o['over_best_peer'], '{:.2f}')}× the fastest peer; the same run-time process "
                      f"peaks at {_cell(q.get('process_peak_rss_mb'), '{}')} MB (decode weights "
                      f"{_gb(q.get('decode_weights_bytes'))} GB against the default's "
                      f"{_gb(p.get('decode_weights_bytes'))} GB)."]
        if any(x["fraction"] > 1 for x in s["hetero_bound_fraction"]):
            lines += ["", "hetero runs above the bound: its int8 rate is the best of ONNX Runtime's `MatMulInteger` "
                      "measured in this run, which hetero's own graphs beat at this width (and a loaded machine "
                      "lowers it), so here it is no upper bound."]
        missed = [k for k, ok in s["targets_met"].items() if not ok]
        if missed:
            lines += ["", f"Targets missed: {', '.join(missed)}. " + where_md(m["prefill_parts_1024"])]
        gemv = e.get("setup", {}).get("cache_bytes", {}).get("INT8 GEMV weights (decode)")
        if "decode_over_best_peer" in missed and gemv and s["decode"]["hetero_tokens_per_s"]:
            tps = s["decode"]["hetero_tokens_per_s"]
            lines += ["", f"Decode streams every weight once per token: hetero's INT8 GEMV weights are {_gb(gemv)} GB, "
                      f"so {tps} tokens/s reads {gemv * tps / 1e9:.0f} GB/s; a 4-bit peer reads about half the bytes "
                      "per token."]
    return "\n".join(lines) + "\n"


def where_md(parts: dict[str, Any]) -> str:
    """One sentence from `bench/prefill_parts.py`'s row: hetero's prefill time per subgraph kind in program order,
    and the out-of-order makespan with its critical lane."""
    kinds = parts["kinds_ms"]
    total = sum(kinds.values()) or 1.0
    top = sorted(kinds.items(), key=lambda kv: -kv[1])
    return (f"Where hetero's prefill time goes at {parts['prompt_len']} tokens (`bench/prefill_parts.py`): in program "
            f"order {parts['in_order_ms']:.0f} ms, of which " + ", ".join(f"{k} {v:.0f} ({v / total:.0%})" for k, v in top)
            + f"; out of order {parts['out_of_order_ms']:.0f} ms, critical lane {parts['critical_lane']}.")


def plot(result: dict[str, Any], path: Path) -> None:
    """Prefill tokens/s at 1024, decode tokens/s and peak RSS by parameter count, one line per engine."""
    from hetero.extras import require

    require("plots", "the benchmark's figures")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import engine_style
    from hetero.paths import atomic_path

    measured = {n: e for n, e in result["shapes"].items() if "measure" in e}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    engines = dict.fromkeys(r["engine"] for e in measured.values() for r in e["measure"]["rows"])
    for engine in engines:
        colour, label = engine_style(engine)
        pts = []
        for name, e in sorted(measured.items(), key=lambda kv: kv[1]["params"]):
            r = next((r for r in e["measure"]["rows"] if r["engine"] == engine and r["prompt_len"] == 1024), None)
            d = e["measure"]["decode"]["row"].get(engine)
            pts.append((e["params"] / 1e9, r["tokens_per_s"] if r else None,
                        d if isinstance(d, (int, float)) else None, r["peak_rss_mb"] if r else None))
        for ax, k in zip(axes, (1, 2, 3)):
            xs = [p[0] for p in pts if p[k] is not None]
            ax.plot(xs, [p[k] for p in pts if p[k] is not None], marker="o", color=colour, label=label,
                    lw=2.5 if engine == "hetero" else 1.2)
    for ax, title in zip(axes, ("prefill tokens/s at 1024", f"decode tokens/s at context {DECODE_CONTEXT}",
                                "peak RSS of the prefill process (MB)")):
        ax.set_xlabel("parameters (B)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"{result['conditions']['machine']}: {SYNTHETIC}", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


# --- the command ------------------------------------------------------------------------------------------------


def conditions(args: argparse.Namespace) -> dict[str, Any]:
    from bench.host import describe, host

    return {"machine": describe(host()), "host": host(), "threads": args.threads,
            "note": (f"The 1-minute load average is recorded per step (above the CPU count, other jobs shared the "
                     f"cores: timings are noisy then, peak RSS is not). {SYNTHETIC}."),
            "command": "python bench/scale.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "loadavg_1m": round(load_avg(), 2)}


def load_result(path: Path) -> dict[str, Any]:
    """The scale.json written before (its shapes are kept), or an empty result."""
    if path.is_file():
        return json.loads(path.read_text())
    return {"shapes": {}}


def write(result: dict[str, Any], out: Path) -> list[Path]:
    for e in result["shapes"].values():
        if "measure" in e:
            e["summary"] = summarize(e["measure"])
    paths = write_json_md(out, "scale", result, markdown(result))
    if any("measure" in e for e in result["shapes"].values()):
        plot(result, out / "scale.png")
        paths.append(out / "scale.png")
    return paths


def add_args(p: argparse.ArgumentParser) -> None:
    from bench.synth_model import SHAPES

    p.add_argument("--shapes", default="llama-3.2-1b", help=f"shapes to run, of {', '.join(SHAPES)}, or all")
    p.add_argument("--steps", default=",".join(STEPS), help=f"steps to run, of {', '.join(STEPS)}")
    p.add_argument("--lens", default="256,1024,2048", help="prefill prompt lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--new", type=positive_int, default=32, help="tokens per decode measurement")
    p.add_argument("--peers", default=",".join(PEERS), help=f"peers to run, of {', '.join(PEERS)}")
    p.add_argument("--work", type=Path, default=None,
                   help="folder of each shape's hetero + peers cache (default: <cache>/scale/<shape>)")
    p.add_argument("--clean", action="store_true",
                   help="after a shape's measure step, delete its cache folder and its synthetic files")
    p.add_argument("--report", action="store_true", help="rewrite scale.md/png from --out's scale.json only")
    p.add_argument("--not-run", metavar="WHY", default=None,
                   help="record WHY for each of --shapes not measured (kept: what its steps measured before)")
    add_out_arg(p, "scale.json/.md/.png")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the run-time memory process, on --model
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--decode-form", default=None, help=argparse.SUPPRESS)  # the probe's (`hetero run --decode-form`)


def run(args: argparse.Namespace) -> int:
    from bench.synth_model import SHAPES, generate, model_name
    from hetero.paths import cache_dir

    if args.probe:
        if not args.model:
            raise ConfigError("--probe needs --model")
        print(json.dumps(probe(args.model, args.threads, args.decode_form)))
        return 0
    out = out_dir(args.out)
    result = load_result(out / "scale.json")
    if args.report:
        wrote(write(result, out))
        return 0
    shapes = list(SHAPES) if args.shapes == "all" else [s.strip() for s in args.shapes.split(",") if s.strip()]
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    lens = int_list(args.lens, "--lens")
    for what, got, allowed in (("--shapes", shapes, SHAPES), ("--steps", steps, STEPS), ("--peers", peers, PEERS)):
        if not got or any(x not in allowed for x in got):
            raise ConfigError(f"{what} must name some of {', '.join(allowed)}, got {','.join(got)!r}")
    if args.not_run:
        for shape in shapes:
            entry = result["shapes"].setdefault(shape, {"params": param_count(shape_config(shape)), "synthetic": SYNTHETIC})
            if "measure" not in entry:
                entry["not_run" if "setup" in entry else "skipped"] = args.not_run
        wrote(write(result, out))
        return 0
    work = args.work or cache_dir() / "scale"
    synth = cache_dir() / "synth"
    result["conditions"] = conditions(args)
    for shape in shapes:
        cfg = shape_config(shape)
        entry = result["shapes"].get(shape, {})
        entry = {k: v for k, v in entry.items() if k != "skipped"}
        entry.update(params=param_count(cfg), synthetic=SYNTHETIC)
        result["shapes"][shape] = entry
        folder, gguf = synth / model_name(shape, 0), synth / f"{model_name(shape, 0)}.gguf"
        # every engine runs from the GGUF (the peers are built from it): the folder may be gone once they are built
        why = None if gguf.is_file() else refusal(entry["params"], *machine_room(cache_dir()))
        if why:
            result["shapes"][shape] = {"params": entry["params"], "synthetic": SYNTHETIC, "skipped": why}
            print(f"scale: {shape}: not run: {why}", file=sys.stderr)
            write(result, out)
            continue
        if not gguf.is_file():
            generate(shape, synth)
        cache = work / shape
        ram = machine_room(cache_dir())[0]
        refused = {p: why for p in peers if (why := peer_refusal(p, entry["params"], ram))}
        entry["peers_refused"] = refused
        shape_peers = tuple(p for p in peers if p not in refused)
        os.environ["HETERO_CACHE"] = str(cache)  # hetero's and the peers' caches for this shape, apart from others
        if "setup" in steps:
            print(f"scale: {shape}: hetero's cold set-up", file=sys.stderr)
            entry["setup"] = cold_setup(gguf, cache, args.threads)
            write(result, out)
        if "peers" in steps:
            from bench.peer_engines import MODEL_KIND, prepare
            from bench.peers import cached

            builds = entry.setdefault("peer_builds_s", {})
            for peer in shape_peers:
                kind = MODEL_KIND[peer]
                was = kind is None or cached(gguf, kind) is not None
                t0 = time.perf_counter()
                try:
                    prepare(peer, str(gguf))
                except Exception as e:  # the measure step skips it with its reason
                    print(f"scale: {shape}: {peer} not built: {e}", file=sys.stderr)
                    continue
                if not was:  # a cached model's time would be its check's
                    builds[peer] = round(time.perf_counter() - t0, 1)
            write(result, out)
        if "measure" in steps:
            print(f"scale: {shape}: measuring", file=sys.stderr)
            entry["measure"] = measure(gguf, cfg, lens, args.repeats, args.threads, shape_peers, args.new)
            wrote(write(result, out))
            if args.clean:
                for p in (cache, folder):
                    shutil.rmtree(p, ignore_errors=True)
                gguf.unlink(missing_ok=True)
    wrote(write(result, out))
    return 0
