"""Lane selection: QNN requested but absent → one warning, CPU EP."""

from __future__ import annotations

import logging

from hetero.errors import BackendUnavailable
from hetero.npu import lanes


def test_qnn_absent_falls_back_to_cpu_with_one_warning(monkeypatch, caplog):
    def absent():
        raise BackendUnavailable("QNN EP unavailable: test")

    monkeypatch.setattr(lanes, "qnn_devices", absent)
    monkeypatch.setattr(lanes, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        first, second = lanes.make_lane("qnn"), lanes.make_lane("qnn")
    assert isinstance(first, lanes.OrtCpuLane) and isinstance(second, lanes.OrtCpuLane)
    assert caplog.text.count("falling back to the ONNX Runtime CPU EP") == 1
