"""The decode step's second core: everything a step needs to use two cores, and nothing else does.

- `attnpool`: a helper thread, woken once per step, that spins in compiled code without the GIL on an atomic
  control array (`atomics`) and claims jobs by compare-and-swap: a layer's KV heads, the LM head's vocabulary
  halves, split graphs' stages; the main thread takes back what it has not claimed.
- `halves` + `stages`: a one-row graph cut after each INT8 matmul into stages whose matmul runs as two column
  halves; `ortc` + `native`: the helper runs its half through ONNX Runtime's C API (a second runtime in the
  process, checked to be the Python module's own release) from the spin loop.

One switch: a runtime's `threads.ExecutionPlan.decode_helper` (or `DecodeStep(..., attention_threads=1)`); off,
a step runs on one thread with the whole graphs, bit for bit the same logits. The rest of `hetero.decode` reaches
this package only from `step.py` (the pool), `bound_step.py` (the split stages) and `head.py` (the head's halves).
"""
