"""Decode steps over the GGUF's own Q4_1 / Q8_0 blocks (`decode.gguf_blocks`): the kernels equal the file's
dequantized weights, and a step beside a rotated prefill equals the file's float model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hetero import buffers
from hetero.errors import ConfigError
from hetero.native import gemv, gguf_forms
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf

pytestmark = pytest.mark.skipif(gemv.unavailable(make_tiny_model().config) is not None,
                                reason="hetero's GEMVs cannot run on this host")
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels quantize it: int8 per block of 32, amax / 127 (`gemv_vnni.c`), dequantized."""
    blocks = x.reshape(x.shape[0], -1, gemv.AB).astype(np.float32)
    s = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    q = np.clip(np.rint(blocks / np.where(s > 0, s, 1)), -127, 127)
    return (q * s).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_the_block_kernels_equal_the_files_dequantized_weights(form) -> None:
    """Repacking changes no weight (the layout dequantizes to gguf's own dequantization, bit for bit); the kernel's
    product equals the quantized activations times those weights to float rounding, and each row of a 3-row job
    equals its one-row job bit for bit (a token tree's rows are the one-row steps)."""
    rng = np.random.default_rng(0)
    qt = gguf.GGMLQuantizationType[form.upper()]
    k, n = 320, 200  # n not a multiple of the tile: padding columns
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt)
    p = gemv.pack_blocks(raw, form, k)
    w = gemv.dequantized(p)
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, qt).T)
    x = buffers.zeros((3, k))
    x[...] = rng.standard_normal((3, k))
    out = buffers.zeros((3, n))
    gemv.run(gemv.bind(p, x, out, gemv.Scratch(3, k)))
    want = _activations(x) @ w.astype(np.float64)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()
    for r in range(3):
        one = buffers.zeros((1, n))
        gemv.run(gemv.bind(p, np.ascontiguousarray(x[r : r + 1]), one, gemv.Scratch(1, k)))
        np.testing.assert_array_equal(one[0], out[r])


def test_pack_blocks_refuses_rows_of_another_shape() -> None:
    with pytest.raises(ConfigError, match="q4_1 rows of K = 64"):
        gemv.pack_blocks(np.zeros((4, 30), np.uint8), "q4_1", 64)
    with pytest.raises(ConfigError, match="no block form 'q5_0'"):
        gemv.pack_blocks(np.zeros((4, 44), np.uint8), "q5_0", 64)


def _block_model(tmp_path, monkeypatch, qtypes: dict[str, str], arch: str = "llama"):
    from hetero.loader import load_model
    from tests.test_architectures import _qk_norm_tiny

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    tiny = _qk_norm_tiny() if arch == "qwen3" else make_tiny_model(arch)  # qwen3: QK-norm
    return load_model(write_gguf(tiny, tmp_path / "tiny.gguf", qtypes))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: QK-norm
def test_a_step_beside_a_rotated_prefill_equals_the_files_float_model(tmp_path, monkeypatch, arch) -> None:
    """The default path: a rotated INT8 prefill, then the steps and the head on the file's blocks in the model's own
    space (the prefill's last hidden row unrotated before the head): logits near the float model of the same file,
    and the prefill's first logits too (a hidden row left rotated misses them by far)."""
    from hetero import model as ref
    from hetero.decode.step import DecodeStep, step_logits
    from hetero.decode.tree import TokenTree
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.placement import decode_placement
    from hetero.outliers.rotate import rotate_model
    from hetero.runtime import Runtime
    from tests.npu.conftest import tiny_plan

    m = _block_model(tmp_path, monkeypatch, {**{f: "Q4_1" for f in LINEARS}, "": "Q8_0"}, arch)
    assert gguf_forms.unavailable(m) is None and m.config.qkv_bias == (arch == "qwen2")
    assert m.config.qk_norm == (arch == "qwen3")
    rot = rotate_model(m, cache=False)
    be = NpuBackend(rot, tiny_plan(rot, scale=0.05), 16, provider="cpu")
    rt = Runtime(rot, chunk=16, backend=be, decode=decode_placement(be), head=step_logits)  # as `make_runtime`
    assert rt.decode.small_kernel == "blocks" and "own Q4_1 / Q8_0 blocks" in rt.decode.describe()
    step = DecodeStep.of(rt)  # the runtime's own: its head gives the prefill's first logits
    assert step.kernel == "blocks" and step.row_unexact() is None and step._unrotate is not None
    prompt = list(np.arange(3, 40) * 5 % m.config.vocab)
    pre = rt.prefill(prompt)
    got = step.forward(pre.cache, TokenTree([7], [-1]))[0]
    with torch.inference_mode():
        want = ref.forward(m.config, m.weights, torch.tensor([*prompt, 7]))[0].numpy()
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    assert rel(got, want[-1]) < 0.05
    assert rel(pre.logits, want[-2]) < 0.05
    step._unrotate = None  # the prefill's hidden row left in the rotated space
    assert rel(rt.prefill(prompt).logits, want[-2]) > 0.2


def test_models_without_the_blocks_keep_the_int8_gemvs(tmp_path, monkeypatch) -> None:
    """A file with a linear in F32 (or a site mixing forms, or a non-GGUF model) is named, and its placement keeps
    the INT8 GEMVs; asking for the blocks is refused with the reason."""
    from hetero.decode.step import DecodeStep
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.placement import decode_placement
    from hetero.runtime import Runtime
    from tests.npu.conftest import tiny_plan

    assert "not a GGUF file" in gguf_forms.unavailable(make_tiny_model())
    m = _block_model(tmp_path, monkeypatch, {**{f: "Q4_1" for f in LINEARS}, "wk": "Q8_0", "": "Q8_0"})
    assert "blk.0.attn_q.weight and its site's linears are q4_1, q8_0" in gguf_forms.unavailable(m)
    m = _block_model(tmp_path, monkeypatch, {f: "Q4_1" for f in LINEARS})
    assert gguf_forms.unavailable(m) == "its head token_embd.weight is f32, not one of ('q4_1', 'q8_0')"
    be = NpuBackend(m, tiny_plan(m), 16, provider="cpu")
    rt = Runtime(m, chunk=16, backend=be, decode=decode_placement(be))
    assert rt.decode.small_kernel == "gemv" and "not the GGUF's own blocks: its head" in rt.decode.small_form
    with pytest.raises(ConfigError, match="GEMVs over the GGUF's own blocks cannot run here: its head"):
        DecodeStep(rt, kernel="blocks")
    with pytest.raises(ConfigError, match="a blocks head cannot read the gemv steps' hidden rows"):
        DecodeStep(rt, head="blocks")


@pytest.mark.parametrize("arch, made", [("llama", "q4_1"), ("qwen2", "q4_1"), ("llama", "q4_1-all")])
def test_blocks_made_from_a_float_file_are_the_blocks_a_q4_1_file_holds(tmp_path, monkeypatch, arch, made) -> None:
    """`--decode-form q4_1` on a float file: every linear's GEMV weights equal, bit for bit, those of the same weights
    written as a Q4_1 file (head Q8_0; "q4_1-all": Q4_1), gguf's own quantizer both times (Llama's Q/K rows permuted
    by the writer and back by the reader); the default still keeps such a file off the blocks, and the placement
    names the choice."""
    from hetero.decode.gguf_blocks import BlockWeights
    from hetero.decode.gemv_step import step_names
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.placement import decode_placement
    from tests.npu.conftest import tiny_plan

    (tmp_path / "f32").mkdir(), (tmp_path / "q41").mkdir()
    flt = _block_model(tmp_path / "f32", monkeypatch, {}, arch)
    head = gguf_forms.MADE[made][1].upper()
    q41 = _block_model(tmp_path / "q41", monkeypatch, {**{f: "Q4_1" for f in LINEARS}, "": head}, arch)
    assert gguf_forms.unavailable(flt) is not None and gguf_forms.unavailable(flt, made) is None
    got, own = BlockWeights(flt, made), BlockWeights(q41)
    assert got.linears["head"].fmt == head.lower()
    for name in step_names(flt.config):
        np.testing.assert_array_equal(gemv.dequantized(got.linears[name]), gemv.dequantized(own.linears[name]))
    be = NpuBackend(flt, tiny_plan(flt), 16, provider="cpu")
    assert decode_placement(be).small_kernel == "gemv"
    placed = decode_placement(be, made)
    assert placed.small_kernel == "blocks" and placed.made == made and "made from the file's float" in placed.small_form
    assert f"(head {head})" in placed.small_form
    assert decode_placement(NpuBackend(q41, tiny_plan(q41), 16, provider="cpu"), made).made is None  # its own


@pytest.mark.parametrize("qtype", ["Q8_0", "BF16"])
def test_the_block_step_reads_its_embedding_norms_and_biases_from_the_file(tmp_path, monkeypatch, qtype) -> None:
    """The embedding rows a step takes, its norms and biases come from the GGUF (`FileRows`, kept beside the blocks):
    the loader's float32 values, bit for bit, and the model's unrotated float32 weights file is never written for
    them (4.9 GB at 1B width)."""
    from hetero.decode.gguf_blocks import BlockWeights, FileRows
    from hetero.paths import cache_dir

    m = _block_model(tmp_path, monkeypatch, {**{f: "Q4_1" for f in LINEARS}, "": qtype}, "qwen2")
    made = None if qtype == "Q8_0" else "q4_1"
    w = BlockWeights(m, made)
    assert not (cache_dir() / "models" / m.fingerprint / "weights.safetensors").exists()
    again = BlockWeights(m, made)  # from the cache
    assert isinstance(w.arrays["tok_emb"], FileRows) and w.biases.keys() == again.biases.keys() != set()
    ids = [0, 7, 7, m.config.vocab - 1]
    rows = np.zeros((len(ids), m.config.hidden), np.float32)
    w.arrays["tok_emb"].take(ids, axis=0, out=rows)
    arrays = m.arrays()  # the loader's float32 weights (now written)
    np.testing.assert_array_equal(rows, arrays["tok_emb"][ids])
    for name, norm in again.norms.items():
        np.testing.assert_array_equal(norm, arrays[name])
    np.testing.assert_array_equal(again.biases["0.attn_in"],
                                  np.concatenate([arrays["layers.0.bq"], arrays["layers.0.bk"], arrays["layers.0.bv"]]))


def test_a_decode_form_that_cannot_run_is_refused(tmp_path, monkeypatch) -> None:
    """Asked for where it cannot run: a site mixing forms, a float method, an unknown form: one line, never the
    INT8 GEMVs in its place."""
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.placement import decode_placement, decode_placement_of
    from tests.npu.conftest import tiny_plan

    m = _block_model(tmp_path, monkeypatch, {"wk": "Q8_0"})
    be = NpuBackend(m, tiny_plan(m), 16, provider="cpu")
    with pytest.raises(ConfigError, match="--decode-form q4_1: q4_1 blocks cannot decode this model: blk.0.attn_q"):
        decode_placement(be, "q4_1")
    with pytest.raises(ConfigError, match="--decode-form q4_1: the float layers decode in torch"):
        decode_placement_of(None, None, None, "float", decode_form="q4_1")
    with pytest.raises(ConfigError, match="decode form must be one of auto, q4_1, q4_1-all, got 'q4_0'"):
        decode_placement(be, "q4_0")



def test_a_decode_form_beside_a_runtime_shares_its_prefill(tmp_path, monkeypatch) -> None:
    """`with_decode_form`: the form's runtime prefills on the same backend (one set of sessions, the bench's
    several forms in one process) and decodes as `make_runtime(..., decode_form=)` does: the same placement and the
    same greedy tokens; a float runtime has no decode forms and is refused."""
    import hetero.methods as methods
    from hetero.decode.generate import SamplingParams, generate
    from hetero.methods import make_runtime, with_decode_form
    from tests.npu.conftest import tiny_plan

    m = _block_model(tmp_path, monkeypatch, {})  # float file: q4_1 blocks are made from it
    monkeypatch.setattr(methods, "quant_plan", lambda model, *a, **k: tiny_plan(model, scale=0.03))  # no tokenizer:
    monkeypatch.setattr(methods, "quant_model", lambda model, recipe: model)  # no calibration text, no rotation
    rt = make_runtime(m, "hetero", chunk=16, threads=1)
    shared = with_decode_form(rt, "q4_1")
    own = make_runtime(m, "hetero", chunk=16, threads=1, decode_form="q4_1")
    assert shared.backend is rt.backend and own.backend is not rt.backend
    assert shared.decode == own.decode and shared.decode.small_kernel == "blocks" != rt.decode.small_kernel
    prompt = list(np.arange(3, 40) * 5 % m.config.vocab)
    stop = SamplingParams(max_new_tokens=6, stop_token_ids=())
    tokens = [generate(r, r.prefill(prompt), stop, speculate="off").tokens for r in (shared, own)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    shared.close()
    assert rt.prefill(prompt).logits.shape == (m.config.vocab,)  # the shared backend outlives the form's runtime
    with pytest.raises(ConfigError, match="a decode form is an INT8 runtime's; this one's method is 'float'"):
        with_decode_form(make_runtime(m, "float", chunk=16, threads=1), "q4_1")
