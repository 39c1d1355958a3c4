"""The C API table is used only with the library of the Python module's own release; otherwise a decode step
runs its graphs whole with one warning, never a crash (another release's table may
lay out its functions otherwise)."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime
import pytest

from hetero.decode.twocore import ortc
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.errors import BackendUnavailable
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import tiny_plan


def test_the_loaded_library_reports_the_module_version():
    assert ortc.OrtC.get().version == onnxruntime.__version__


def test_a_library_of_another_release_is_refused():
    path = ortc.OrtC.get()._lib._name
    with pytest.raises(BackendUnavailable, match="is version"):
        ortc.OrtC(path, "0.0.0")


def test_without_the_c_api_a_step_runs_whole_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))

    def refuse() -> ortc.OrtC:
        raise BackendUnavailable("ONNX Runtime's C library x is version 0.0.0, the Python module 1.x")

    monkeypatch.setattr(ortc.OrtC, "get", staticmethod(refuse))
    ortc.run_fn.cache_clear()
    try:
        m = make_tiny_model()
        rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m), 16, provider="cpu",
                                                     options=GraphOptions(intra_op_threads=1)))
        with caplog.at_level(logging.WARNING):
            step = DecodeStep(rt, attention_threads=2, split_after=0)
            cache = rt.prefill(np.arange(1, 20)).cache
            logits = step.forward(cache, TokenTree([5], [-1]))
        assert step._bound[1].stages is None and np.isfinite(logits).all()
        assert caplog.text.count("run their graphs whole") == 1
        rt.close()
    finally:
        ortc.run_fn.cache_clear()
