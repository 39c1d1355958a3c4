"""The hand-off: transformers' `generate()` continuing from hetero's prefill gives the same greedy text."""

from __future__ import annotations

import torch

from hetero.adapters.hf import generate, to_dynamic_cache, to_hf_model
from hetero.runtime import Runtime


def test_greedy_continuation_equals_transformers(default_model) -> None:
    tok = default_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    hf = to_hf_model(default_model)
    result = Runtime(default_model, chunk=16).prefill(ids)
    ours = generate(hf, ids, result, 12)
    ref = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                      max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.numel():].tolist()
    assert ours == ref
    assert "Paris" in tok.decode(ours)


def test_dynamic_cache_holds_exactly_the_valid_positions(tiny_model) -> None:
    r = Runtime(tiny_model, chunk=16).prefill(torch.arange(21))
    dc = to_dynamic_cache(r.cache)
    assert dc.get_seq_length() == 21
    k0, _ = r.cache.keys_values(0)
    torch.testing.assert_close(dc.layers[0].keys[0], torch.from_numpy(k0))


def test_importing_the_adapter_loads_no_torch(default_model) -> None:
    """The README's snippet imports the adapter before it makes its runtime: torch loaded then (at the adapter's
    import, before any entry point chose OpenMP's wait policy) made make_runtime warn that torch's OpenMP threads
    spin. The adapter loads torch and transformers when its functions run."""
    import subprocess
    import sys

    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "import hetero\nfrom hetero.adapters.hf import generate, to_hf_model\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "hetero.make_runtime(hetero.load_model()).close()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "OpenMP" not in done.stderr, done.stderr
