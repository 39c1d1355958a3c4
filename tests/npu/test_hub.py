"""AI Hub client against a fake service (the qai_hub module's functions are replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest

qai_hub = pytest.importorskip("qai_hub")

from hetero.errors import BackendUnavailable  # noqa: E402
from hetero.cli.npu import hub_profile  # noqa: E402
from hetero.npu import hub  # noqa: E402
from tests.npu.conftest import tiny_plan  # noqa: E402


class _Target:
    def download(self, filename):
        Path(filename).write_bytes(b"QNN-CONTEXT")
        return filename


class _Job:
    job_id = "j1"

    def get_target_model(self):
        return _Target()

    def download_profile(self):
        return {"execution_summary": {"estimated_inference_time": 1234, "all_inference_times": [1000, 1200, 1100]}}


def test_compile_and_profile_with_fake_service(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(qai_hub, "upload_model", lambda path: calls.append(("upload", path)) or object())
    monkeypatch.setattr(qai_hub, "submit_compile_job", lambda **kw: calls.append(("compile", kw["options"])) or _Job())
    monkeypatch.setattr(qai_hub, "submit_profile_job", lambda **kw: calls.append(("profile",)) or _Job())
    plan = tiny_plan(tiny)
    graphs = hub.compile_on_hub(tiny, plan, 16, "Samsung Galaxy S24", layers=[0])
    assert [g.kind for g in graphs] == ["qkv", "o_ffn"] and graphs[0].binary.read_bytes() == b"QNN-CONTEXT"
    assert ("compile", hub.COMPILE_OPTIONS) in calls
    n = len(calls)
    hub.compile_on_hub(tiny, plan, 16, "Samsung Galaxy S24", layers=[0])  # cached: no new job
    assert len(calls) == n
    measured = hub.measure_on_hub(tiny, plan, [16], "Samsung Galaxy S24")
    assert set(measured.costs_us) == {("qkv", 16), ("o_ffn", 16)}
    prof = hub_profile(measured)
    assert prof.cost_us("o_ffn", "npu", 16) == 1100 and not prof.simulated


def test_missing_token_is_one_clear_error(tiny, monkeypatch):
    def no_token(path):
        raise qai_hub.client.UserError("Failed to load client configuration file.\n...")

    monkeypatch.setattr(qai_hub, "upload_model", no_token)
    with pytest.raises(BackendUnavailable, match="token"):
        hub.compile_on_hub(tiny, tiny_plan(tiny), 16, "Samsung Galaxy S24", layers=[0])
