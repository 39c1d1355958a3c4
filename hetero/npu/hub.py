"""Qualcomm AI Hub client: compile hetero's exported graphs to QNN context binaries and measure them on real
Snapdragon devices (`qai_hub`: upload_model → submit_compile_job → submit_profile_job).

Only the `qai_hub` calls here talk to the network; without a token (`~/.qai_hub/client.ini` or
`QAI_HUB_API_TOKEN`) the first call fails with one `BackendUnavailable`. Binaries are cached beside the
local graphs (`graphs/hub-<device>/<key>/`); a measurement is the median on-device time per (kind, C).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hetero.errors import BackendUnavailable
from hetero.weights import SITES
from hetero.npu import export, segments
from hetero.npu.cache import entry_key, graphs_root, library_versions
from hetero.paths import atomic_path

log = logging.getLogger(__name__)

COMPILE_OPTIONS = "--target_runtime qnn_context_binary"


def _hub():
    try:
        import qai_hub
    except ImportError as e:
        raise BackendUnavailable("Qualcomm AI Hub client unavailable: pip install qai-hub") from e
    token = os.environ.get("QAI_HUB_API_TOKEN")
    if token:
        qai_hub.set_session_token(token)
    return qai_hub


def _call(what: str, fn, *args, **kwargs):
    """Call a qai_hub function; a missing/invalid token or a service error becomes one clear error."""
    import qai_hub

    try:
        return fn(*args, **kwargs)
    except qai_hub.client.UserError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BackendUnavailable(
            f"Qualcomm AI Hub: {what} failed: {msg} (configure a token with `qai-hub configure --api_token ...` "
            f"or set QAI_HUB_API_TOKEN)") from e
    except qai_hub.client.Error as e:
        raise BackendUnavailable(f"Qualcomm AI Hub: {what} failed: {e}") from e


def _slug(device: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-").lower()


@dataclass(frozen=True, slots=True)
class HubGraph:
    layer: int
    kind: str
    chunk: int
    key: str
    binary: Path  # the QNN context binary from the compile job
    job_id: str


def _upload_dir(spec: segments.SegmentSpec, lq: segments.LayerQ, tmp: Path) -> Path:
    """AI Hub takes an ONNX model with external weights as a directory named *.onnx holding both."""
    d = tmp / f"L{spec.layer}_{spec.kind}_C{spec.chunk}.onnx"
    d.mkdir(parents=True)
    export.save_onnx(export.build_segment(spec, lq), d / "model.onnx")
    return d


def compile_on_hub(model, plan, chunk: int, device: str, layers=None, kinds=("qkv", "o_ffn")) -> list[HubGraph]:
    """Upload each static graph (QDQ "qnn-fp16" flavour: a device runs HTP float ops in fp16), compile it for
    `device`, store the context binary."""
    hub = _hub()
    dev = hub.Device(device)
    out = []
    cfg = model.config
    with tempfile.TemporaryDirectory(prefix="hetero-hub-") as tmp:
        for layer in (range(cfg.n_layers) if layers is None else layers):
            lq = segments.layer_q(cfg, model.arrays(), plan, layer)
            shadow = {s for s in SITES if plan.sites[(layer, s)].shadow}
            for spec in segments.layer_segments(layer, shadow, chunk, "qnn-fp16"):
                if spec.kind not in kinds and not (spec.kind != "qkv" and "o_ffn" in kinds):
                    continue
                key = entry_key("hub", segments.EXPORT_VERSION, device, spec.kind, spec.pieces, chunk, spec.shape,
                                segments.layer_digest(lq), model.fingerprint, library_versions()["onnx"])
                root = graphs_root() / f"hub-{_slug(device)}" / key
                binary = root / "compiled.bin"
                meta_path = root / "meta.json"
                if binary.exists() and meta_path.exists():
                    meta = json.loads(meta_path.read_text())
                    out.append(HubGraph(layer, spec.kind, chunk, key, binary, meta.get("job_id", "")))
                    continue
                src = _upload_dir(spec, lq, Path(tmp))
                uploaded = _call("upload_model", hub.upload_model, str(src))
                job = _call("submit_compile_job", hub.submit_compile_job, model=uploaded, device=dev,
                            name=f"hetero L{layer} {spec.kind} C{chunk}", options=COMPILE_OPTIONS)
                target = _call("compile job", job.get_target_model)
                if target is None:
                    raise BackendUnavailable(f"Qualcomm AI Hub: compile job {getattr(job, 'job_id', '?')} for layer "
                                             f"{layer} {spec.kind} on {device!r} failed (no target model)")
                root.mkdir(parents=True, exist_ok=True)
                with atomic_path(binary) as t:
                    got = _call("download", target.download, str(t))
                    if got and Path(got) != t and Path(got).exists():
                        shutil.move(got, t)
                with atomic_path(meta_path) as t:
                    t.write_text(json.dumps({"key": key, "device": device, "job_id": getattr(job, "job_id", ""),
                                             "layer": layer, "kind": spec.kind, "chunk": chunk}))
                out.append(HubGraph(layer, spec.kind, chunk, key, binary, getattr(job, "job_id", "")))
                log.info("hub | compiled layer %d %s C=%d for %s (job %s)", layer, spec.kind, chunk, device,
                         getattr(job, "job_id", "?"))
    return out


def _profile_us(prof: dict) -> float:
    """On-device latency in µs from a profile job's result (median of all inference times if listed)."""
    summ = prof.get("execution_summary", {})
    times = summ.get("all_inference_times")
    if times:
        return float(statistics.median(times))
    return float(summ["estimated_inference_time"])


@dataclass(frozen=True, slots=True)
class HubMeasurement:
    """On-device latencies of one layer's static graphs: (kind, C) -> µs on the NPU, plus conditions."""

    name: str
    device: str
    costs_us: dict[tuple[str, int], float]
    n_layers: int
    metadata: dict


def measure_on_hub(model, plan, chunks, device: str, layer: int = 0, name: str | None = None) -> HubMeasurement:
    """Compile + profile layer `layer`'s `qkv` and `o_ffn` at each C on `device` (median inference times)."""
    hub = _hub()
    dev = hub.Device(device)
    costs: dict[tuple[str, int], float] = {}
    for c in chunks:
        for g in compile_on_hub(model, plan, c, device, layers=[layer]):
            uploaded = _call("upload_model", hub.upload_model, str(g.binary))
            job = _call("submit_profile_job", hub.submit_profile_job, model=uploaded, device=dev,
                        name=f"hetero L{layer} {g.kind} C{c}")
            prof = _call("profile job", job.download_profile)
            kind = "qkv" if g.kind == "qkv" else "o_ffn"
            costs[(kind, c)] = costs.get((kind, c), 0.0) + _profile_us(prof)  # a shadow-cut o_ffn: segments add up
    cfg = model.config
    meta = {"device": device, "provider": {"npu": "qnn-htp (Qualcomm AI Hub)"}, "versions": library_versions(),
            "model": {"name": model.name, "hidden": cfg.hidden, "ffn": cfg.ffn},
            "notes": f"AI Hub profile jobs of layer {layer}'s static graphs; attention is not profiled on the NPU"}
    return HubMeasurement(name or f"hub-{_slug(device)}-{model.name}", device, costs, cfg.n_layers, meta)
