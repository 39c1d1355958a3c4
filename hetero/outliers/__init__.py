"""Shadow outlier execution (mllm-NPU §3.3): calibration, per-tensor INT8, float outliers, pruning.

In pipeline order: `corpus` (shipped text), `calibrate` (statistics per site), `quantize` (INT8 math and
its numpy reference), `plan` (`QuantPlan`), `pruning` (`plan_from_calibration`), `shadow` (Eq. 1,
`QuantizedBackend`), `hotstore` (hot rows in RAM, the rest on disk), `baselines` (Table 5).
"""
