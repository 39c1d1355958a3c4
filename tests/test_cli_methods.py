"""Every method in `hetero.METHODS` answers from the command line: `hetero run -n 2` as a user runs
it, in its own process, on the real default model; stdout holds hetero's JSON and nothing else (no third-party
banner).

The prompt is raw text whose next token float is sure of (" Paris" 0.77, then " the" 0.07), so a method that
does not answer Paris is wrong, not unlucky; a method that gives accuracy up on purpose is only required to
answer (`ANSWER_ONLY`). All but the default and float are slow (they still run in CI): each is a process that
loads the model, and some calibrate, search or build graphs on a first run, or prefill on the HTP simulator.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hetero import METHODS
from hetero.methods import DEFAULT_METHOD
from hetero.npu import isa

PROMPT = "The capital of France is"
# Methods that trade accuracy away on purpose answer, but need not answer Paris (docs/design.md, "Rotation"):
ANSWER_ONLY = {
    "hetero-noshadow": "an ablation: W8A8 clipped at every site (it once answered 'Le Grand Paris is ...')",
    "hetero-w8a8": "mllm-NPU's plan on the model as trained: without rotation it answers ' Le Chat' here",
}
FAST = {DEFAULT_METHOD, "float"}  # the demo's paths
EXTRA_ARGS = {"hetero-qnn": ["--chunk", "8"]}  # one chunk of 8 rows on the simulator (the prompt is 5 tokens)
SECONDS = ["load", "calibrate", "build", "prefill", "decode set-up", "decode"]


def run_method(method: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hetero", "-v", "run", PROMPT, "--raw", "-n", "2", "--json", "--method", method,
           *EXTRA_ARGS.get(method, [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ))


@pytest.mark.parametrize("method", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_every_method_answers_from_the_command_line(method, default_model):
    r = run_method(method)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)  # the whole of stdout: one JSON object, no banner around it
    assert out["method"] == method and out["new_tokens"] > 0 and out["text"].strip()
    if method not in ANSWER_ONLY:
        assert "Paris" in out["text"]
    if method == "hetero-qnn":  # the NPU's 8-bit form on any CPU, with no --weight-form (it failed on "auto")
        assert out["weight_form"] == isa.FORM_NPU
    assert list(out["seconds"]) == ["imports", *SECONDS]  # the process is the command: its start-up counts
    assert all(v >= 0 for v in out["seconds"].values())
    assert out["decode_on"]["device"] == "cpu"  # decode runs on the CPU, whatever prefills (mllm-NPU)
    # -v prints the host plan, a line per decision: where decode runs, and how an INT8 prefill is laid out here
    for name in ("method", "chunks", "layout", "npu", "executor", "attention", "glue", "weights", "decode", "threads"):
        assert re.search(rf"host plan \| {name} +\S.*; why: \S", r.stderr), name
    assert re.search(r"host plan \| decode +cpu, ", r.stderr)
    if METHODS[method].provider is not None:
        assert re.search(r"host plan \| layout +(layers|lanes); why: ", r.stderr)
