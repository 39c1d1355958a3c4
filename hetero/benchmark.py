"""End-to-end prefill benchmark (mllm-NPU §4.2-4.3 method, on this machine): engines side by side.

Each engine runs in its own subprocess (`python -m hetero.benchmark --worker ...`) so that its peak RSS
is its own and its thread settings cannot leak into the next engine. Within a worker: one warm-up
prefill per prompt length (graph preparation, allocator warm-up; the naive NPU engine is the
exception: preparing a graph per prompt length *is* its cost, §2.3, so its timed runs include it),
then `repeats` timed prefills; rows report the median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

PrefillFn = Callable[[torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class Row:
    """One engine × prompt length, medians of `runs_ms`."""

    engine: str
    prompt_len: int
    tokens_per_s: float
    ttft_ms: float  # prefill + choosing the first token: the time to first token
    peak_rss_mb: float  # the engine's whole process, model included
    simulated: bool = False
    runs_ms: list[float] = field(default_factory=list)
    note: str = ""


class EngineUnavailable(Exception):
    """The engine cannot run here (e.g. llama-cpp-python not installed): skipped with this message."""


# ------------------------------------------------------------------------------------------ engines


def _hetero_engine(backend: str, **kw: Any) -> Callable[[str | None, int, int], PrefillFn]:
    def make(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
        from hetero.engine import make_runtime
        from hetero.loader import load_model

        runtime = make_runtime(load_model(model_path), backend, threads=threads, **kw)

        def prefill(ids: torch.Tensor) -> None:
            int(runtime.prefill(ids).logits.argmax())

        return prefill

    return make


def _torch_float(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """transformers' own Llama (sdpa attention), whole prompt in one forward, logits of the last token."""
    from hetero.adapters.hf import to_hf_model
    from hetero.loader import load_model

    torch.set_num_threads(threads)
    hf = to_hf_model(load_model(model_path))

    @torch.inference_mode()
    def prefill(ids: torch.Tensor) -> None:
        int(hf(ids[None], logits_to_keep=1, use_cache=True).logits[0, -1].argmax())

    return prefill


def _llama_cpp(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """llama.cpp on the same GGUF file (llama-cpp-python), n_batch 512."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
    from hetero.default_model import default_model_path
    from hetero.loader import load_model

    path = str(load_model(model_path).path if model_path else default_model_path())
    if not path.endswith(".gguf"):
        raise EngineUnavailable("llama.cpp needs a GGUF model")
    llm = Llama(model_path=path, n_ctx=max_len + 8, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill(ids: torch.Tensor) -> None:
        llm.reset()
        llm.eval(ids.tolist())

    return prefill


def _naive_npu(model_path: str | None, threads: int, max_len: int) -> PrefillFn:
    """mllm-NPU §2.3's naive offload: one INT8 graph set built for exactly this prompt length, every time
    (prompt lengths vary, so a real engine cannot reuse it); preparation is part of each prefill."""
    from hetero.engine import quant_plan
    from hetero.loader import load_model
    from hetero.npu.naive import naive_prefill

    model = load_model(model_path)
    plan = quant_plan(model, "cpu")  # the same plan as hetero's CPU-EP lane

    def prefill(ids: torch.Tensor) -> None:
        int(naive_prefill(model, plan, ids, provider="cpu", intra_op_threads=threads).logits.argmax())

    return prefill


ENGINES: dict[str, Callable[[str | None, int, int], PrefillFn]] = {
    "hetero": _hetero_engine("hetero"),
    "hetero_in_order": _hetero_engine("hetero-inorder"),
    "naive_npu": _naive_npu,
    "torch_float": _torch_float,
    "llama_cpp": _llama_cpp,
    "hetero_float": _hetero_engine("float"),
    # ablation steps (mllm-NPU Fig. 17): naive_npu → chunk sharing → + shadow outliers → + out-of-order
    "chunk_sharing": _hetero_engine("hetero-noshadow", policy="in_order"),
    "chunk_shadow": _hetero_engine("hetero-inorder"),
}
ABLATION = (("naive NPU", "naive_npu"), ("+ chunk sharing", "chunk_sharing"),
            ("+ shadow outliers", "chunk_shadow"), ("+ out-of-order", "hetero"))


# ------------------------------------------------------------------------------------------ prompts


def prompt_ids(model_path: str | None, n: int) -> torch.Tensor:
    """The first `n` tokens of held-out real text (the evaluation corpus), the same for every engine."""
    from hetero.loader import load_model
    from hetero.outliers.corpus import DEFAULT_EVALUATION, load_corpus

    tok = load_model(model_path).tokenizer
    text = load_corpus(DEFAULT_EVALUATION)
    ids = tok(text[: 8 * n + 1000])["input_ids"]
    if len(ids) < n:
        raise ValueError(f"evaluation corpus too short for {n} tokens")
    return torch.tensor(ids[:n])


# ------------------------------------------------------------------------------------------ workers


def run_worker(engine: str, model_path: str | None, lens: list[int], repeats: int, threads: int) -> list[Row]:
    """Measure one engine in this process."""
    torch.set_num_threads(threads)
    prompts = {n: prompt_ids(model_path, n) for n in lens}
    prefill = ENGINES[engine](model_path, threads, max(lens))
    rows = []
    for n in lens:
        ids = prompts[n]
        prefill(ids)  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(ids)
            runs.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(runs)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(Row(engine, n, round(n / (med / 1e3), 1), round(med, 2), round(rss_mb, 1), False,
                        [round(r, 2) for r in runs]))
    return rows


def run_engines(engines: list[str], lens: list[int], repeats: int, threads: int, model_path: str | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[list[Row], dict[str, str]]:
    """Each engine in a fresh subprocess; returns rows and {engine: why skipped}."""
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    for engine in engines:
        if progress:
            progress(engine)
        cmd = [sys.executable, "-m", "hetero.benchmark", "--worker", engine, "--lens", ",".join(map(str, lens)),
               "--repeats", str(repeats), "--threads", str(threads)]
        if model_path:
            cmd += ["--model", model_path]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 3:
            skipped[engine] = proc.stdout.strip() or proc.stderr.strip()
            continue
        if proc.returncode != 0:
            skipped[engine] = f"failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
            continue
        rows += [Row(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
    return rows, skipped


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=sorted(ENGINES))
    ap.add_argument("--lens", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model")
    a = ap.parse_args(argv)
    try:
        rows = run_worker(a.worker, a.model, [int(x) for x in a.lens.split(",")], a.repeats, a.threads)
    except EngineUnavailable as e:
        print(str(e))
        return 3
    print(json.dumps([asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    sys.exit(_worker_main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------- simulated

# mllm-NPU §2.3: building a QNN graph for Gemma-2B takes 360 ms and optimizing it 11.54 s; the naive
# engine pays this for every new prompt length. (Gemma-2B's figure stands in for Qwen1.5-1.8B's.)
NAIVE_PREPARE_S = 0.36 + 11.54


def simulated_rows(profile_path: str | None, lens: list[int], chunk: int = 256) -> list[Row]:
    """hetero (rank) and hetero in-order on a device profile: discrete-event simulation, labelled."""
    from hetero.sched.dag import compiled_prefill_dag
    from hetero.sched.simulate import simulate

    profile = _profile(profile_path)
    rows = []
    for n in lens:
        for engine, policy in (("hetero", "rank"), ("hetero_in_order", "in_order"), ("hetero_eq6", "eq6")):
            s = simulate(compiled_prefill_dag(profile, n, chunk), policy)
            ms = s.makespan_us / 1e3
            rows.append(Row(engine, n, round(n / (ms / 1e3), 1), round(ms, 2), 0.0, True, [],
                            f"simulated, profile {profile.name}"))
    return rows


def simulated_ablation(profile_path: str | None, n: int = 512, chunk: int = 256) -> list[dict[str, Any]]:
    """Fig. 17's steps on a device profile (simulated): naive → chunk sharing → + shadow → + out-of-order."""
    from hetero.sched.dag import build_dag, compile_dag
    from hetero.sched.simulate import simulate

    profile = _profile(profile_path)
    base = profile.layer_subgraphs
    with_shadow = tuple(x for pair in base for x in ([pair, ("shadow", "cpu")] if pair[0] == "qkv" else [pair]))
    c_max = max(profile.chunk_lens)
    # naive: one graph of T rows (per-token cost of the largest profiled C), no overlap, + preparation
    per_layer_ms = sum(profile.cost_us(k, lane, c_max, n) for k, lane in base) * n / c_max / 1e3
    naive_ms = NAIVE_PREPARE_S * 1e3 + per_layer_ms * profile.n_layers
    steps = [("naive NPU", naive_ms)]
    n_chunks = -(-n // chunk)
    for label, layer, policy in (("+ chunk sharing", base, "in_order"), ("+ shadow outliers", with_shadow, "in_order"),
                                 ("+ out-of-order", with_shadow, "rank")):
        dag = compile_dag(build_dag(n_chunks, layer, profile.n_layers), profile, chunk)
        steps.append((label, simulate(dag, policy).makespan_us / 1e3))
    return [{"step": s, "prefill_ms": round(ms, 2), "tokens_per_s": round(n / (ms / 1e3), 1), "simulated": True,
             "profile": profile.name, "prompt_len": n} for s, ms in steps]


def _profile(path: str | None):
    from hetero.sched.profile import load_profile
    from hetero.paths import PROFILES_DIR

    return load_profile(path or PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json")


# -------------------------------------------------------------------------------------- end to end


def ui_automation_prompt(n_nodes: int = 5) -> str:
    """An Android view hierarchy (uiautomator dump format) of a settings screen + an instruction (Table 4's
    UI-automation task shape: the screen as XML, then what to do)."""
    items = ["Network & internet", "Connected devices", "Apps", "Notifications", "Battery", "Storage", "Sound & vibration",
             "Display", "Wallpaper & style", "Accessibility", "Security & privacy", "Location", "Safety & emergency",
             "Passwords & accounts", "Digital Wellbeing", "Google", "System", "About phone", "Tips & support",
             "Wi-Fi", "Bluetooth", "Airplane mode", "Hotspot", "Data saver"]
    nodes = []
    for i, label in enumerate(items[:n_nodes]):
        y = 220 + 140 * i
        rid = label.lower().replace(" & ", "_").replace(" ", "_").replace("-", "")
        nodes.append(
            f'<node index="{i}" text="{label}" resource-id="com.android.settings:id/{rid}" class="android.widget.LinearLayout" '
            f'package="com.android.settings" content-desc="" checkable="false" checked="false" clickable="true" '
            f'enabled="true" focusable="true" scrollable="false" bounds="[0,{y}][1080,{y + 140}]" />'
        )
    xml = ('<?xml version="1.0" encoding="UTF-8"?><hierarchy rotation="0"><node index="0" class="android.widget.FrameLayout" '
           'package="com.android.settings" bounds="[0,0][1080,2400]"><node class="androidx.recyclerview.widget.RecyclerView" '
           'resource-id="com.android.settings:id/recycler_view" scrollable="true" bounds="[0,200][1080,2400]">'
           + "".join(nodes) + "</node></node></hierarchy>")
    return (f"Screen:\n{xml}\n\nInstruction: turn on Bluetooth. Which element should be clicked first? "
            "Answer with its resource-id.")


def long_context_prompt(model_path: str | None, n_tokens: int = 1500) -> str:
    """~n_tokens of held-out real text (an e-mail-length context) followed by a question about it."""
    from hetero.loader import load_model
    from hetero.outliers.corpus import DEFAULT_EVALUATION, load_corpus

    tok = load_model(model_path).tokenizer
    ids = tok(load_corpus(DEFAULT_EVALUATION)[: 8 * n_tokens])["input_ids"][:n_tokens]
    return tok.decode(ids) + "\n\nQuestion: who is the main character of this text, and what is she like?"


def run_e2e(model_path: str | None, threads: int, max_new_tokens: int = 32, engines: tuple[str, ...] = ("hetero", "torch_float", "llama_cpp")) -> list[dict[str, Any]]:
    """Table 4's end-to-end shape: prefill + `max_new_tokens` greedy tokens, per workload and engine."""
    from hetero.adapters.hf import generate, to_hf_model
    from hetero.engine import make_runtime
    from hetero.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(model_path)
    tok = model.tokenizer
    workloads = {"long_context_qa": long_context_prompt(model_path), "ui_automation": ui_automation_prompt()}
    hf = to_hf_model(model)
    rows: list[dict[str, Any]] = []
    for wname, text in workloads.items():
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor(tok(chat, add_special_tokens=False)["input_ids"])
        for engine in engines:
            try:
                prefill_ms, decode_ms, out = _e2e_one(engine, model, hf, ids, threads, max_new_tokens, make_runtime, generate)
            except EngineUnavailable as e:
                rows.append({"workload": wname, "engine": engine, "skipped": str(e)})
                continue
            except Exception as e:  # noqa: BLE001 - one engine failing must not lose the other rows
                rows.append({"workload": wname, "engine": engine, "skipped": f"failed: {type(e).__name__}: {e}"})
                continue
            rows.append({"workload": wname, "engine": engine, "prompt_len": ids.numel(), "prefill_ms": round(prefill_ms, 1),
                         "decode_ms": round(decode_ms, 1), "total_ms": round(prefill_ms + decode_ms, 1),
                         "new_tokens": len(out), "answer": tok.decode(out, skip_special_tokens=True)[:120],
                         "simulated": False})
    return rows


def _e2e_one(engine, model, hf, ids, threads, n_new, make_runtime, generate) -> tuple[float, float, list[int]]:
    if engine == "hetero":
        rt = make_runtime(model, "hetero", threads=threads)
        rt.prefill(ids)  # warm-up (graphs prepared/loaded from the cache)
        t0 = time.perf_counter()
        result = rt.prefill(ids)
        t1 = time.perf_counter()
        out = generate(hf, ids, result, n_new)
        rt.close()
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, out
    if engine == "torch_float":
        with torch.inference_mode():
            hf(ids[None], logits_to_keep=1)  # warm-up
            t0 = time.perf_counter()
            out = hf(ids[None], logits_to_keep=1, use_cache=True)
            t1 = time.perf_counter()
            first = int(out.logits[0, -1].argmax())
            full = hf.generate(input_ids=torch.cat([ids, torch.tensor([first])])[None], past_key_values=out.past_key_values,
                               attention_mask=torch.ones(1, ids.numel() + 1, dtype=torch.long),
                               max_new_tokens=n_new - 1, do_sample=False, pad_token_id=hf.config.eos_token_id)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, full[0, ids.numel():].tolist()
    if engine == "llama_cpp":
        try:
            from llama_cpp import Llama
        except ImportError:
            raise EngineUnavailable("llama-cpp-python is not installed (pip install 'hetero[bench]')") from None
        llm = Llama(model_path=str(model.path), n_ctx=ids.numel() + n_new + 8, n_batch=512, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        toks = ids.tolist()
        llm.eval(toks)  # warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        t1 = time.perf_counter()
        # the prompt is already in llama.cpp's cache: create_completion only decodes (greedy)
        out = llm.create_completion(prompt=toks, max_tokens=n_new, temperature=0.0)
        text_ids = model.tokenizer(out["choices"][0]["text"], add_special_tokens=False)["input_ids"]
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, text_ids
    raise ValueError(engine)
