"""Lane selection: QNN requested but absent → one warning, CPU EP; QNN options from the environment."""

from __future__ import annotations

import logging

import pytest

from hetero.errors import BackendUnavailable, ConfigError
from hetero import paths
from hetero.npu import providers


def test_qnn_absent_falls_back_to_cpu_with_one_warning(monkeypatch, caplog):
    def absent():
        raise BackendUnavailable("QNN EP unavailable: test")

    monkeypatch.setattr(providers, "qnn_devices", absent)
    monkeypatch.setattr(paths, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        first, second = providers.make_provider("qnn"), providers.make_provider("qnn")
    assert isinstance(first, providers.OrtCpuProvider) and isinstance(second, providers.OrtCpuProvider)
    assert caplog.text.count("falling back to the ONNX Runtime CPU EP") == 1


def test_qnn_options_from_the_environment(monkeypatch):
    env_qnn_options = providers.env_qnn_options
    monkeypatch.setenv("HETERO_QNN_OPTIONS", " soc_model=60, htp_performance_mode=burst ")
    assert env_qnn_options() == {"soc_model": "60", "htp_performance_mode": "burst"}
    monkeypatch.setenv("HETERO_QNN_OPTIONS", "")
    assert env_qnn_options() == {}
    monkeypatch.setenv("HETERO_QNN_OPTIONS", "soc_model")
    with pytest.raises(ConfigError, match="HETERO_QNN_OPTIONS"):
        env_qnn_options()
