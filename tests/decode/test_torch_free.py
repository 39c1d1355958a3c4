"""The default INT8 decode path imports no torch (its import is ~0.9 s) beyond what `hetero run`'s greedy lookup
decode covers (`tests/test_cli_lazy.py`): sampling, self-speculation, and a one-row step split over both cores
(`BoundStep.split`, the MatMulNBits head's halves) run on numpy alone."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from hetero.decode import SamplingParams, generate
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.loader import load_model
from hetero.methods import make_runtime

m = load_model()
rt = make_runtime(m, "hetero")
step = DecodeStep.of(rt)
step.split_after = 1
ids = m.tokenizer("The capital of France is")["input_ids"]
cache = rt.prefill(ids).cache
logits = [step.forward(cache, TokenTree([5], [-1])) for _ in range(3)]
split = step.pool is None or step._bound[1].split()
same = bool((logits[0] == logits[2]).all() and (logits[1] == logits[2]).all())  # the same row: whole or split
texts = [generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3),
                  speculate=s, context_ids=ids).text for s in ("lookup", "self")]
rt.close()
print(split, same, all(texts), "torch" in sys.modules)
"""


def test_sampled_self_speculative_and_split_decode_import_no_torch(default_model):
    """Run twice: the first run builds what a cold cache lacks (graph builds read the float weights in torch); the
    second, warm whatever ran before, must not import torch."""
    first = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert first.stdout.split()[:3] == ["True", "True", "True"], first.stdout + first.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True", "True", "False"], done.stdout + done.stderr[-2000:]
