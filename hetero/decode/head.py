"""The LM head of a decode step: float (exact, for the float reference) or INT8 on the INT8 lane.

A decode step reads every weight once per token, so the head's 49k×576 float matrix alone would cost
as much memory traffic as a third of the layers; on an INT8 runtime it runs as one ONNX Runtime
`DynamicQuantizeMatMul` graph (activations quantized per call, weights per output channel, symmetric).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from hetero import model as ref
from hetero.config import ModelConfig
from hetero.model import Weights


class FloatHead:
    """final RMSNorm + the float LM head (the reference)."""

    name = "float"

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg, self.weights = cfg, weights

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return ref.logits(self.cfg, self.weights, h)


def int8_head_graph(w: torch.Tensor) -> onnx.ModelProto:
    """[T, hidden] float → [T, vocab]: DynamicQuantizeMatMul over W^T quantized per output channel."""
    wt = w.detach().float().numpy().T  # [hidden, vocab]
    scale = np.maximum(np.abs(wt).max(axis=0), 1e-12) / 127.0
    wq = np.clip(np.round(wt / scale), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(wq, "w_q"), numpy_helper.from_array(scale.astype(np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(wt.shape[1], np.int8), "w_z")]
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "w_q", "w_s", "w_z"], ["logits"], domain="com.microsoft")
    graph = helper.make_graph([node], "lm_head_int8",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", wt.shape[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", wt.shape[1]])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


class Int8Head:
    """final RMSNorm (float, CPU lane) + the INT8 LM head graph (ONNX Runtime)."""

    name = "int8"

    def __init__(self, cfg: ModelConfig, weights: Weights, threads: int = 2):
        self.cfg, self.weights = cfg, weights
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        blob = int8_head_graph(weights.lm_head).SerializeToString()
        self.session = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = ref.rms_norm(h.reshape(-1, self.cfg.hidden), self.weights.norm, self.cfg.rms_eps)
        out = self.session.run(None, {"x": x.contiguous().numpy()})[0]
        return torch.from_numpy(out).reshape(*h.shape[:-1], -1)
