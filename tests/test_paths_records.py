"""Content records of cache entries (`hetero.paths`): what `verify` reports, that a hash is remembered only
for files unchanged long enough (never across a rewrite that kept the mtime), and `cached`/`keep`."""

from __future__ import annotations

import logging
import os
import time

import pytest

from hetero import paths
from hetero.paths import cached, content_hash, forget, keep, read_record, verify, write_record


def _write(entry, name, data: bytes):
    entry.mkdir(parents=True, exist_ok=True)
    (entry / name).write_bytes(data)
    return entry / name


def test_verify_names_what_is_wrong(tmp_path):
    e = tmp_path / "entry"
    _write(e, "a.bin", b"a" * 1000)
    _write(e, "b.bin", b"b" * 1000)
    write_record(e, ["a.bin", "b.bin"])
    assert verify(e) == [] and verify(e, ["a.bin"]) == []
    _write(e, "c.bin", b"c")
    assert [str(d) for d in verify(e, ["c.bin"])] == ["c.bin has no content record"]
    (e / "a.bin").write_bytes(b"a" * 999)
    (e / "b.bin").unlink()
    assert sorted(str(d) for d in verify(e)) == ["a.bin has 999 bytes, its record 1000 (truncated or replaced)",
                                                 "b.bin is missing"]
    (e / paths.RECORD).write_text("{ not json")
    assert "cannot be checked" in verify(e, ["a.bin"])[0].why
    forget(e, ["a.bin"])
    assert not (e / "a.bin").exists()


def test_a_rewrite_that_keeps_the_mtime_is_hashed_again(tmp_path, monkeypatch):
    p = _write(tmp_path, "w.bin", os.urandom(1 << 16))
    old = time.time_ns() - 10 * paths._RACY_NS
    os.utime(p, ns=(old, old))
    monkeypatch.setattr(paths, "_RACY_NS", 0)  # every read remembered: the stat identity alone must tell
    first = content_hash(p)
    assert content_hash(p) == first  # remembered (same stat identity)
    time.sleep(0.05)  # past a coarse clock's tick (why `_RACY_NS` exists)
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))
    os.utime(p, ns=(old, old))  # same size and mtime; the ctime moved
    assert content_hash(p) != first


def test_a_file_changed_just_before_its_hash_is_not_remembered(tmp_path):
    p = _write(tmp_path, "young.bin", b"x" * 100)
    content_hash(p)
    st = p.stat()
    assert not any(k[1] == st.st_ino for k in paths._HASHED)  # a coarse clock could hide a second change


def test_cached_builds_once_and_loads_what_verifies(tmp_path, caplog):
    e, builds = tmp_path / "entry", []

    def build():
        builds.append(1)
        return b"payload"

    def get():
        return cached(e, "x.bin", lambda p: p.read_bytes(), build, lambda v, tmp: tmp.write_bytes(v), "test artifact")

    assert get() == b"payload" and get() == b"payload" and len(builds) == 1
    assert set(read_record(e)) == {"x.bin"}
    (e / "x.bin").write_bytes(b"PAYLOAD")
    with caplog.at_level(logging.WARNING):
        assert get() == b"payload"
    assert len(builds) == 2 and caplog.text.count("fails its content hash (corrupt); rebuilding it") == 1


def test_keep_leaves_nothing_when_the_save_fails(tmp_path, caplog):
    e = tmp_path / "entry"

    def failing(value, tmp):
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING):
        assert keep(e, "x.bin", b"v", failing) is False
    assert "No space left on device" in caplog.text and "running uncached" in caplog.text
    assert not e.exists()  # neither the file, a temp file, its record nor the folder


def test_entry_lock_is_reentrant_in_a_thread(tmp_path):
    e = tmp_path / "entry"
    with paths.entry_lock(e), paths.entry_lock(e):  # cached() inside a build of the same entry
        assert paths.entry_lock(e).is_locked


@pytest.mark.parametrize("bad", ["a.bin", "b.bin"])
def test_verify_reports_only_the_damaged_file(tmp_path, bad):
    e = tmp_path / "entry"
    for n in ("a.bin", "b.bin"):
        _write(e, n, n.encode() * 100)
    write_record(e, ["a.bin", "b.bin"])
    st = (e / bad).stat()
    (e / bad).write_bytes(b"z" * st.st_size)
    os.utime(e / bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [d.name for d in verify(e)] == [bad]


@pytest.mark.parametrize("size", [0, 1, 4096, 3 * 4096 + 5])
def test_content_hash_maps_a_window_at_a_time_and_hashes_the_whole_file(tmp_path, monkeypatch, size) -> None:
    """A window of the file is mapped at a time (a whole mapped file counts in resident memory while mapped):
    windows much smaller than the file give the hash of every byte, in order."""
    import mmap

    import xxhash

    monkeypatch.setattr(paths, "_MAP_WINDOW", mmap.ALLOCATIONGRANULARITY)
    data = os.urandom(size)
    p = _write(tmp_path, "f.bin", data)
    assert content_hash(p) == xxhash.xxh3_128(data).hexdigest()
