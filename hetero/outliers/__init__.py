"""Shadow outlier execution (mllm-NPU §3.3): calibration, per-tensor INT8, float outliers, pruning."""
