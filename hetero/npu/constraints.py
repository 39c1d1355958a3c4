"""What the QNN HTP backend (and the ORT CPU EP stand-in) accepts, one entry per constraint with the reason
(ExecuTorch `common_defs` style).

Measured on the HTP *simulator* shipped in the `onnxruntime-qnn` 2.7.0 Linux x86-64 wheel
(`session.disable_cpu_ep_fallback=1`, so a rejected node fails the session instead of silently
running on the CPU). "can't" entries are properties of the backend; "not yet" entries are hetero's
own choices that a later version may lift.
"""

from __future__ import annotations

# ---- can't ------------------------------------------------------------------------------------
QNN_CONSTRAINTS: dict[str, str] = {
    "simulator_o_ffn_c256_mem": "the onnxruntime-qnn 2.7 HTP simulator fails to finalize the o_ffn graph of SmolLM2 at C=256 with per-channel output scaling (QNN_COMMON_ERROR_MEM_ALLOC); C=64 and C=128 build. Use --chunk 128 with the qnn lane on the simulator.",
    "static_shapes": "HTP graphs are compiled for fixed tensor shapes; every dim of every input is a "
                     "constant (chunk length C), hence chunk-sharing graphs (mllm-NPU §3.2)",
    "per_tensor_act": "activations are quantized per tensor (uint8, zero point 128); per-channel "
                      "activation scales have no fast HTP kernel (mllm-NPU §2.3)",
    "int8_weights_symmetric": "weights are int8 with zero point 0 (DequantizeLinear before MatMul), the "
                              "form the QNN EP folds into a quantized MatMul; the default plan's 7-bit weights "
                              "(weight_qmax=63, `CPU_EP_CONSTRAINTS`) are int8 values in [-63, 63], the same form",
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
    "per_lane_weight_range": "HTP graphs take the plan's weights, 7-bit by default because of the CPU EP "
                             "(`CPU_EP_CONSTRAINTS`); HTP has no such saturation and could run 8-bit "
                             "(weight_qmax=127), but one plan serves both lanes and the reference",
}

# ---- ONNX Runtime CPU EP (the NPU stand-in, and the CPU lane) -----------------------------------
CPU_EP_CONSTRAINTS: dict[str, str] = {
    "u8s8_saturation_avx2": "ORT's u8·s8 MatMulInteger on AVX2 without VNNI multiplies with vpmaddubsw, which "
                            "sums two adjacent u8·s8 products into a saturating int16: with the raw u8 "
                            "activation in [0, 255] and 8-bit weights, 2·255·127 = 64770 > 32767, so int32 "
                            "results are wrong; with |q| <= 64, 2·255·64 = 32640 <= 32767 and u8·s8 is exact",
    "weights_7bit_default": "the plan's weights are 7-bit by default (weight_qmax=63, ONNX Runtime's "
                            "reduce_range): the CPU graphs run u8·s8 with s8 weights, zero point 0 "
                            "(`export.cpu_weight_form`), 1.3-1.6x faster per layer graph than u8·u8, and "
                            "the numpy reference uses the same weights, so they stay bit-exact",
    "u8u8_fallback": "weights wider than 7 bits (weight_qmax=127) are stored uint8 = q + 128 with zero point "
                     "128 and run u8·u8 (vpmaddwd, exact, slower): same int32 result",
    "u8_activations": "activations are uint8 with zero point 128: ORT's s8·s8 GEMM is 6.6x slower on AVX2",
}

# Ops hetero puts into an HTP graph (all verified on the simulator with CPU fallback disabled).
QNN_GRAPH_OPS = ("QuantizeLinear", "DequantizeLinear", "MatMul", "Mul", "Add", "Pow", "ReduceMean", "Sqrt",
                 "Div", "Sigmoid", "Slice", "Concat", "Reshape")
