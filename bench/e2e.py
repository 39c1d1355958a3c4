"""End-to-end workloads (mllm-NPU Table 4's shape): prefill + greedy decoding of a real prompt, per engine."""

from __future__ import annotations

import time
from typing import Any

from bench.workers import EngineUnavailable
from hetero.methods import use_threads


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
    import torch

    from hetero.adapters.hf import to_hf_model
    from hetero.methods import make_runtime
    from hetero.loader import load_model

    use_threads(threads)
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
                prefill_ms, decode_ms, out = _e2e_one(engine, model, hf, ids, threads, max_new_tokens, make_runtime)
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


def _e2e_one(engine, model, hf, ids, threads, n_new, make_runtime) -> tuple[float, float, list[int]]:
    if engine == "hetero":  # as `hetero run`: hetero's prefill, then its own greedy decoder on the same cache
        from hetero.decode import SamplingParams, generate as decode

        rt = make_runtime(model, "hetero", threads=threads)
        decode(rt, rt.prefill(ids), SamplingParams(max_new_tokens=n_new))  # warm-up: graphs, decode graphs
        t0 = time.perf_counter()
        result = rt.prefill(ids)
        t1 = time.perf_counter()
        use_threads(threads)  # the runtime split the cores between lanes; decoding uses them all
        out = list(decode(rt, result, SamplingParams(max_new_tokens=n_new)).tokens)
        rt.close()
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, out
    if engine == "torch_float":
        import torch

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
    if engine == "llama_cpp":  # the GGUF as shipped, in this process (`peer_engines.LlamaCppSession`)
        from bench.peer_engines import LlamaCppSession, source_gguf
        from hetero.decode.generate import end_tokens

        session = LlamaCppSession(source_gguf(str(model.path)), threads, ids.numel() + n_new + 8, flash_attn=False)
        toks = ids.tolist()
        session.prefill(toks)  # warm-up
        t0 = time.perf_counter()
        session.prefill(toks)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        stop = frozenset({model.config.eos_token_id} - {None}) | end_tokens(model.tokenizer)  # as hetero's decoder
        seconds, out = session.decode(toks, n_new, stop)  # greedy; timed after its own prefill
        return prefill_ms, seconds * 1e3, out
    raise ValueError(engine)
