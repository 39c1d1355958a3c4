"""The LM head of a decode step: float (exact, for the float reference) or INT8 on the INT8 lane.

A decode step reads every weight once per token, so the head's 49k×576 float matrix alone would cost
as much memory traffic as a third of the layers; on an INT8 runtime it runs as one ONNX Runtime
`MatMulInteger` graph: weights symmetric per output channel, activations symmetric per ROW (so a row's
logits do not depend on the other rows of a token tree: speculation stays exact), rescaled in torch.
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
from hetero.outliers.quantize import W_QMAX_U8S8
from hetero.threads import ort_session_options


class FloatHead:
    """final RMSNorm + the float LM head (the reference)."""

    name = "float"

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg, self.weights = cfg, weights

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return ref.logits(self.cfg, self.weights, h)


def int8_head_graph(w: torch.Tensor) -> tuple[onnx.ModelProto, torch.Tensor]:
    """[T, hidden] uint8 (zero point 128) → [T, vocab] int32 (MatMulInteger over W^T quantized per output channel), and
    the weight scales [vocab]."""
    wt = w.detach().float().numpy().T  # [hidden, vocab]
    # 7-bit weights: u8·s8 pairs cannot saturate AVX2's 16-bit intermediate (as the layer graphs' plan)
    scale = np.maximum(np.abs(wt).max(axis=0), 1e-12) / W_QMAX_U8S8
    wq = np.clip(np.round(wt / scale), -W_QMAX_U8S8, W_QMAX_U8S8).astype(np.int8)
    # u8·s8 (activations shifted by 128, a zero point) is ONNX Runtime's fast integer kernel
    node = helper.make_node("MatMulInteger", ["x_q", "w_q", "x_z"], ["acc"])
    graph = helper.make_graph([node], "lm_head_int8",
                              [helper.make_tensor_value_info("x_q", TensorProto.UINT8, ["T", wt.shape[0]])],
                              [helper.make_tensor_value_info("acc", TensorProto.INT32, ["T", wt.shape[1]])],
                              [numpy_helper.from_array(wq, "w_q"), numpy_helper.from_array(np.uint8(128), "x_z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), torch.from_numpy(scale.astype(np.float32))


class Int8Head:
    """final RMSNorm (float, CPU lane) + the INT8 LM head graph (ONNX Runtime)."""

    name = "int8"

    def __init__(self, cfg: ModelConfig, weights: Weights, threads: int = 2):
        self.cfg, self.weights = cfg, weights
        so = ort_session_options()
        so.log_severity_level = 3
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        graph, self.w_scale = int8_head_graph(weights.lm_head)
        self.session = ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.numel() == 0:  # a step that only writes K/V (a drafter catching up) asks for no logits
            return h.new_empty(*h.shape[:-1], self.cfg.vocab)
        x = ref.rms_norm(h.reshape(-1, self.cfg.hidden), self.weights.norm, self.cfg.rms_eps)
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # per row
        xq = (torch.round(x / s).clamp(-127, 127) + 128).to(torch.uint8)
        acc = torch.from_numpy(self.session.run(None, {"x_q": xq.numpy()})[0])
        return (acc.float() * s * self.w_scale).reshape(*h.shape[:-1], -1)
