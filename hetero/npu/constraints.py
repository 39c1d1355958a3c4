"""What the QNN HTP backend accepts, one entry per constraint with the reason (ExecuTorch `common_defs` style).

Measured on the HTP *simulator* shipped in the `onnxruntime-qnn` 2.7.0 Linux x86-64 wheel
(`session.disable_cpu_ep_fallback=1`, so a rejected node fails the session instead of silently
running on the CPU). "can't" entries are properties of the backend; "not yet" entries are hetero's
own choices that a later version may lift.
"""

from __future__ import annotations

# ---- can't ------------------------------------------------------------------------------------
QNN_CONSTRAINTS: dict[str, str] = {
    "static_shapes": "HTP graphs are compiled for fixed tensor shapes; every dim of every input is a "
                     "constant (chunk length C), hence chunk-sharing graphs (mllm-NPU §3.2)",
    "per_tensor_act": "activations are quantized per tensor (uint8, zero point 128); per-channel "
                      "activation scales have no fast HTP kernel (mllm-NPU §2.3)",
    "int8_weights_symmetric": "weights are int8 with zero point 0 (DequantizeLinear before MatMul), the "
                              "form the QNN EP folds into a quantized MatMul",
    "no_per_axis_matmul_weight": "a per-axis DequantizeLinear feeding MatMul (or Gemm) is rejected by the "
                                 "QNN EP (onnxruntime-qnn 2.7.0, axis 0/1/-1, rank 2/3, 16-bit activations): "
                                 "per-output-channel weight scales are applied by a float Mul after the "
                                 "MatMul (weight DequantizeLinear with scale 1), `export.QNN_PER_AXIS_DQ`",
    "no_matmulinteger": "MatMulInteger/ConvInteger are not QNN ops: on HTP the linear is written as "
                        "QuantizeLinear/DequantizeLinear pairs around a float MatMul (QDQ)",
    "no_fp16_without_soc": "enable_htp_fp16_precision=1 requires soc_model; without it the float ops "
                           "(RMSNorm, SiLU, residual adds) still compile with the default settings",
    "min_rows_hidden576": "the simulator fails to finalize a [32, 576]×[576, 960] QDQ graph "
                          "(QNN_COMMON_ERROR_MEM_ALLOC, onnxruntime-qnn 2.7.0); C=64 and C=256 compile",
    "no_dynamic_attention": "attention depends on the chunk's position (KV length): dynamic, so it stays "
                            "on the CPU (mllm-NPU §3.2, Fig. 7c)",
    "no_shadow": "the beyond-scale outlier part is a sparse, data-dependent float matmul: CPU only (§3.3)",
}

# ---- not yet ----------------------------------------------------------------------------------
QNN_NOT_YET: dict[str, str] = {
    "fused_qkv_weights": "Q/K/V (and gate/up) keep separate MatMuls on HTP: their per-tensor weight "
                         "scales differ and a fused weight would need per-channel DequantizeLinear",
    "conv1x1_shape": "the 1x1 Conv2d equivalent shape (§4) is profiled only as reshaped MatMuls",
}

# Ops hetero puts into an HTP graph (all verified on the simulator with CPU fallback disabled).
QNN_GRAPH_OPS = ("QuantizeLinear", "DequantizeLinear", "MatMul", "Mul", "Add", "Pow", "ReduceMean", "Sqrt",
                 "Div", "Sigmoid", "Slice", "Concat", "Reshape")
