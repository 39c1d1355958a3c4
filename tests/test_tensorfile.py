"""`hetero.tensorfile` maps safetensors files as the library reads them; `hetero.buffers` are aligned; a cached
model's float weights at rest are its mapped file, reached without torch (its import is ~0.9 s)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hetero import buffers
from hetero.errors import ModelFormatError
from hetero.tensorfile import drop_pages, map_tensors, read_only


def test_mapped_tensors_equal_the_librarys_and_writes_stay_in_the_process(tmp_path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((5, 7), dtype=np.float32), "q": rng.integers(-128, 127, (3, 4), dtype=np.int8),
              "s": np.array(2.5), "empty": np.zeros((0, 3), np.float32),
              "i": np.arange(6, dtype=np.int64)}
    path = tmp_path / "a.safetensors"
    save_file(arrays, str(path), metadata={"form": "x"})
    got, meta = map_tensors(path)
    want = load_file(str(path))
    assert meta == {"form": "x"} and set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape and np.array_equal(got[name], a), name
    got["w"][0, 0] = 123.0  # copy on write: the file keeps its bytes
    assert load_file(str(path))["w"][0, 0] == arrays["w"][0, 0]


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("RssFile"))


def test_a_read_only_view_maps_the_same_bytes_and_gives_its_pages_back(tmp_path) -> None:
    """`read_only`: a tensor's bytes through a mapping of its own that nothing writes, whose pages `drop_pages` hands
    back (out of the RSS) and a later read faults in again, the same values; an array that maps no file is itself."""
    rows = np.random.default_rng(1).standard_normal((4096, 512), dtype=np.float32)  # 8 MB
    path = tmp_path / "e.safetensors"
    save_file({"pad": np.zeros(3, np.int8), "emb": rows}, str(path))  # "emb" starts off a page boundary
    mapped = map_tensors(path)[0]["emb"]
    view = read_only(mapped)
    assert not view.flags.writeable and np.array_equal(view, rows)
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1.0
    resident = _rss_file_kb()  # every page was read: resident
    drop_pages(view)
    assert resident - _rss_file_kb() > 6 << 10
    assert np.array_equal(view, rows)  # faulted in again from the file
    plain = rows.copy()
    assert read_only(plain) is plain
    drop_pages(plain)  # nothing to give back
    assert np.array_equal(plain, rows)
    mapped[0, :4] = 7.0  # a written page of the copy-on-write mapping: never dropped, even through a read-only view
    frozen = mapped[:8]
    frozen.flags.writeable = False
    drop_pages(frozen)
    assert (mapped[0, :4] == 7.0).all()


@pytest.mark.parametrize("damage", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", b"\xff" * 8])
def test_a_file_that_is_not_safetensors_is_a_model_format_error(tmp_path, damage) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(damage)
    with pytest.raises(ModelFormatError, match="not a readable safetensors file"):
        map_tensors(path)


@pytest.mark.parametrize("shape", [(3,), (17, 5), (600, 1024)])  # the last: a mapping of its own (2.4 MB)
def test_buffers_are_aligned_writable_and_sized(shape) -> None:
    a = buffers.empty(shape)
    assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % buffers.ALIGN == 0
    a[...] = 1.5
    assert float(a.sum()) == 1.5 * a.size
    z = buffers.zeros(shape, np.int32)
    assert z.ctypes.data % buffers.ALIGN == 0 and not z.any()
    odd = np.arange(10, dtype=np.float32)[1:]  # 4 bytes past an aligned start
    assert buffers.aligned(odd).ctypes.data % buffers.ALIGN == 0 and np.array_equal(buffers.aligned(odd), odd)


def test_a_cached_models_arrays_are_its_weights_without_torch(default_model) -> None:
    """The arrays of the cached default model map its file; its torch weights are views of the same memory."""
    code = ("import sys; from hetero.loader import load_model; m = load_model(); a = m.arrays(); "
            "print('torch' in sys.modules, a['tok_emb'].shape, sorted(a)[:2])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"
    arrays = default_model.arrays()
    w = default_model.weights
    assert np.shares_memory(arrays["tok_emb"], w.tok_emb.numpy())
    assert np.array_equal(arrays["layers.3.wq"], w.layers[3].wq.numpy())
    assert w.lm_head is w.tok_emb  # tied: one tensor


def test_write_tensors_writes_the_librarys_bytes_one_tensor_at_a_time(tmp_path) -> None:
    import gc
    import weakref

    from hetero.tensorfile import LazyTensors, write_tensors

    rng = np.random.default_rng(1)
    arrays = {"layers.10.wq": rng.standard_normal((3, 5), dtype=np.float32), "layers.2.bo": rng.standard_normal(7,
              dtype=np.float32), "tok_emb": rng.standard_normal((4, 2), dtype=np.float32),
              "s": np.array(1.5, np.float32), "empty": np.zeros((0, 3), np.float32)}
    alive: list[weakref.ref] = []

    def pieces(put) -> None:  # a fresh copy each time: the writer must have let go of the last one
        for name in arrays:
            gc.collect()
            assert sum(r() is not None for r in alive) == 0
            a = arrays[name].copy()
            alive.append(weakref.ref(a))
            put(name, a)
            del a

    save_file(arrays, str(tmp_path / "lib.safetensors"))
    write_tensors(LazyTensors({k: v.shape for k, v in arrays.items()}, pieces), tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert len(alive) == len(arrays)


def test_write_tensors_refuses_a_tensor_unlike_its_header(tmp_path) -> None:
    from hetero.tensorfile import LazyTensors, write_tensors

    with pytest.raises(ModelFormatError, match=r"a piece of w has shape \(2, 3\) \(float32\), past or unlike the "
                                               r"file's \(3, 2\) \(float32\)"):
        write_tensors(LazyTensors({"w": (3, 2)}, lambda put: put("w", np.zeros((2, 3), np.float32))), tmp_path / "a")
    with pytest.raises(ModelFormatError, match=r"float64"):
        write_tensors(LazyTensors({"w": (3,)}, lambda put: put("w", np.zeros(3))), tmp_path / "a.st")


def test_tensors_handed_over_in_pieces_write_the_librarys_bytes_of_every_dtype(tmp_path) -> None:
    from hetero.tensorfile import _DTYPES, LazyTensors, write_tensors

    rng = np.random.default_rng(2)
    arrays = {f"t.{np.dtype(t).name}": (rng.standard_normal((6, 3)) * 50).astype(t) for t in _DTYPES.values()}
    arrays |= {"a.w": rng.integers(0, 255, (8, 5), dtype=np.uint8), "a.ws": rng.standard_normal((4, 2),
               dtype=np.float32), "s": np.array(2.5, np.float64), "empty": np.zeros((0, 4), np.int8)}

    def pieces(put) -> None:  # two rows at a time, the tensors interleaved (as a packed weight beside its scales)
        for lo in range(0, 8, 2):
            for name, a in arrays.items():
                if a.ndim and lo < len(a):
                    put(name, a[lo : lo + 2])
        put("s", arrays["s"])

    lazy = LazyTensors({k: v.shape for k, v in arrays.items()}, dtypes={k: v.dtype for k, v in arrays.items()},
                       pieces=pieces)
    save_file(arrays, str(tmp_path / "lib.safetensors"), metadata={"form": "x"})
    write_tensors(lazy, tmp_path / "ours.safetensors", {"form": "x"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    made = lazy.arrays()
    assert all(made[k].dtype == v.dtype and np.array_equal(made[k], v) for k, v in arrays.items())


def test_pieces_unlike_their_tensor_or_short_of_it_are_refused(tmp_path) -> None:
    from hetero.tensorfile import LazyTensors, write_tensors

    def lazy(pieces) -> LazyTensors:
        return LazyTensors({"w": (4, 2)}, dtypes={"w": np.uint8}, pieces=pieces)

    with pytest.raises(ModelFormatError, match=r"w was handed 4 of its 8 bytes"):
        write_tensors(lazy(lambda put: put("w", np.zeros((2, 2), np.uint8))), tmp_path / "a.st")
    with pytest.raises(ModelFormatError, match=r"a piece of w has shape \(2, 3\) \(uint8\)"):
        lazy(lambda put: put("w", np.zeros((2, 3), np.uint8))).arrays()
    with pytest.raises(ModelFormatError, match=r"a piece of w .* after 8 bytes"):
        lazy(lambda put: [put("w", np.zeros((4, 2), np.uint8)), put("w", np.zeros((1, 2), np.uint8))]).arrays()
    with pytest.raises(ModelFormatError, match=r"v is not one of the file's tensors"):
        lazy(lambda put: put("v", np.zeros((4, 2), np.uint8))).arrays()
    with pytest.raises(ValueError, match="safetensors has no dtype complex64"):
        LazyTensors({"w": (1,)}, lambda put: None, {"w": np.complex64})
