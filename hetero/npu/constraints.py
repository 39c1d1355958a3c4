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
    "simulator_generic_soc_mem": "without soc_model (the default, `providers.QNN_DEFAULT_OPTIONS`) the simulator models a "
                                 "generic HTP that fails to finalize the SmolLM2 o_ffn graph at C=256 and both "
                                 "graphs at C=32 (QNN_COMMON_ERROR_MEM_ALLOC; also with vtcm_mb=8, "
                                 "htp_graph_finalization_optimization_mode=3, htp_arch=75, "
                                 "enable_htp_spill_fill_buffer=1, shape 3d:4, or split into o+gu / act+down), and "
                                 "the 3d:8/16/32 and conv:16 shapes at C=64/128; C=64 and C=128 build. With "
                                 "soc_model=60 C=32...512 all build, but see soc_model_fp16. Use --chunk 128 with "
                                 "the qnn lane on the simulator",
    "static_shapes": "HTP graphs are compiled for fixed tensor shapes; every dim of every input is a "
                     "constant (chunk length C), hence chunk-sharing graphs (mllm-NPU §3.2)",
    "per_tensor_act": "activations are quantized per tensor (uint8, zero point 128); per-channel "
                      "activation scales have no fast HTP kernel (mllm-NPU §2.3)",
    "int8_weights_symmetric": "weights are int8 with zero point 0 (DequantizeLinear before MatMul); the QNN "
                              "lane's plan has 8-bit weights (`methods.quant_plan(model, 'qnn')`, weight_qmax=127), "
                              "the CPU EP lane's 7-bit ones ([-63, 63], `CPU_EP_CONSTRAINTS`) are the same form",
    "no_per_axis_matmul_weight": "a per-axis DequantizeLinear feeding MatMul (or Gemm) is rejected by the "
                                 "QNN EP (onnxruntime-qnn 2.7.0, axis 0/1/-1, rank 2/3, 16-bit activations): "
                                 "per-output-channel weight scales are applied by a float Mul after the "
                                 "MatMul (weight DequantizeLinear with scale 1), `export.QNN_PER_AXIS_DQ`",
    "qdq_act_folded": "a QuantizeLinear→DequantizeLinear pair on an activation that feeds a float MatMul is "
                      "made standalone Quantize/Dequantize ops, which HTP (simulator) folds into a no-op: x reaches "
                      "the MatMul unrounded, 1.6-3.0 output steps from the INT8 reference on SmolLM2 layer 0 "
                      "(C=64). A second pair re-expressing the u8 grid in u16 becomes a u8→u16 Convert and keeps "
                      "the rounding (`export._linears`): q/k/v then within 0.6-0.7 steps",
    "no_int32_matmul_output": "the QNN EP forms a quantized FullyConnected (int32 accumulation) only for u8 in/u8 "
                              "out or u16 in/u16 out: the raw MatMul output is requantized to the activation's "
                              "width. u8 out at a calibrated per-tensor scale (true W8A8, 5x faster on the "
                              "simulator) costs 1.2-1.7 output steps on q/k/v and 8.7 on o_ffn vs the INT8 "
                              "reference (per-channel weight scales are folded after the MatMul, so one per-tensor "
                              "output scale serves columns of different weight scales); the simulator's a16w8 "
                              "FullyConnected is off by 1.4-4.3 steps. Hence the float MatMul on integer operands",
    "simulator_float_ops": "HTP's RMSNorm/SiLU round a few values differently from torch: ~37 of 36,864 qkv "
                           "activations land one INT8 step away (the error left on q/k/v), and through "
                           "RMSNorm→gate/up→SiLU·mul→down they leave o_ffn 1.9 output steps from the reference "
                           "(SmolLM2 layer 0, C=64)",
    "soc_model_fp16": "with soc_model set (60 = 8 Gen 3) the simulator runs float ops in fp16, as a device does. "
                      "SmolLM2's residual stream reaches |h| = 274 after layer 1 and 24,886 after layer 11: the "
                      "textbook RMSNorm's x² overflows fp16 (max 65,504) and a 30-layer prefill decoded garbage. "
                      "The qnn-fp16 graphs normalise x / max|x| first (`export.rms_norm`); the 30-layer prefill "
                      "then answers 'The capital of France is indeed called Paris' (C=256), but layer 1's qkv "
                      "is thousands of steps off at C=64: on one row (max|h| 34.7) HTP's RMSNorm returns 19,952 "
                      "instead of 4.17, as if mean((x/m)²) = 0.0053 came out ~0; not yet understood "
                      "(bench/results/htp_accuracy.json). fp16 also made the old weight form (DequantizeLinear "
                      "at scale 1, integer-valued weights) overflow (o_ffn 188 steps off): weights are "
                      "dequantized at their largest channel scale (`export._linears`)",
    "no_matmulinteger": "MatMulInteger/ConvInteger are not QNN ops: on HTP the linear is written as "
                        "QuantizeLinear/DequantizeLinear pairs around a float MatMul (QDQ)",
    "no_dynamic_attention": "attention depends on the chunk's position (KV length): dynamic, so it stays "
                            "on the CPU (mllm-NPU §3.2, Fig. 7c)",
    "no_shadow": "the beyond-scale outlier part is a sparse, data-dependent float matmul: CPU only (§3.3)",
}

# ---- not yet ----------------------------------------------------------------------------------
QNN_NOT_YET: dict[str, str] = {
    "fused_qkv_weights": "Q/K/V (and gate/up) keep separate MatMuls on HTP: their per-tensor weight "
                         "scales differ and a fused weight would need per-channel DequantizeLinear",
}

# ---- ONNX Runtime CPU EP (the NPU stand-in, and the CPU lane) -----------------------------------
CPU_EP_CONSTRAINTS: dict[str, str] = {
    "u8s8_saturation_avx2": "ORT's u8·s8 MatMulInteger on AVX2 without VNNI multiplies with vpmaddubsw, which "
                            "sums two adjacent u8·s8 products into a saturating int16: with the raw u8 "
                            "activation in [0, 255] and 8-bit weights, 2·255·127 = 64770 > 32767, so int32 "
                            "results are wrong; with |q| <= 64, 2·255·64 = 32640 <= 32767 and u8·s8 is exact",
    "weight_form_by_isa": "the plan records its weight form (`quantize.WEIGHT_FORMS`), chosen at run time by "
                          "`hetero.npu.isa`: with VNNI (avx512_vnni, avx_vnni, amx_int8) 8-bit weights run "
                          "u8·s8 (exact, fastest); on AVX2 without VNNI 8-bit weights run u8·u8 (stored q + 128, "
                          "zero point 128, vpmaddwd: exact, same int32 result, slower) or 7-bit weights u8·s8 "
                          "(`export.cpu_kernel`); `--weight-form` forces one",
    "u8_activations": "activations are uint8 with zero point 128: ORT's s8·s8 GEMM is 6.6x slower on AVX2",
}

# Ops hetero puts into an HTP graph (all verified on the simulator with CPU fallback disabled).
QNN_GRAPH_OPS = ("QuantizeLinear", "DequantizeLinear", "MatMul", "Conv", "Mul", "Add", "Pow", "ReduceMean",
                 "ReduceMax", "Abs", "Sqrt", "Div", "Sigmoid", "Slice", "Concat", "Reshape", "Transpose", "Squeeze",
                 "Unsqueeze")
