"""Shadow outlier execution (mllm-NPU §3.3): calibration, per-tensor INT8, float outliers, pruning.

One module per technique, in pipeline order:

- `corpus.py`     real text shipped in `hetero/data/` (calibration: `sotu`, evaluation: `austen`)
- `calibrate.py`  activation statistics per (layer, site) → one versioned .npz in the model's cache entry
- `quantize.py`   INT8 per-tensor math and the numpy reference of a quantized linear (the NPU contract)
- `plan.py`       `QuantPlan`: per-site scales + shadow channels, INT8 weights (what backends consume)
- `pruning.py`    importance ranking and `plan_from_calibration` (prune the shadow of the least important sites)
- `shadow.py`     Eq. 1: NPU part + CPU shadow part; `QuantizedBackend`, the reference the NPU matches
- `hotstore.py`   hot-channel weight rows in RAM, the others memory-mapped from disk
- `baselines.py`  SmoothQuant, LLM.int8(), per-group: fake-quantized baselines of Table 5
- `cli.py`        `hetero calibrate`

For the default model, one call gives the runtime its backend:

    plan = hetero.outliers.pruning.plan_from_calibration(model)          # cached calibration (computed on first use)
    backend = hetero.outliers.shadow.QuantizedBackend(model.config, model.weights, plan)
"""
