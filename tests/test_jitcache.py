"""hetero's numba kernels are cached in a folder named by their sources' content (`hetero.jitcache`)."""

from __future__ import annotations

import ast
import shutil

import numba

from hetero import jitcache


def _compiles_numba(path) -> bool:
    """Imports numba, or hetero's `jitcache`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "numba" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0] == "numba" or (
                node.module == "hetero" and any(a.name == "jitcache" for a in node.names))):
            return True
    return False


def test_every_module_that_compiles_numba_code_is_in_the_digest() -> None:
    users = {p.relative_to(jitcache.ROOT).as_posix() for p in jitcache.ROOT.rglob("*.py") if _compiles_numba(p)}
    assert users - {"jitcache.py"} == set(jitcache.KERNEL_SOURCES)
    for p in jitcache.ROOT.rglob("*.py"):  # no kernel caches by numba's file stamps alone
        assert p.name == "jitcache.py" or "@numba.njit(cache=True" not in p.read_text(), p


def test_an_edit_to_any_kernel_source_names_a_new_cache_folder(tmp_path) -> None:
    # the case numba misses: attnpool's kernels compile rowattn's functions in, numba checks attnpool.py's stamp
    for rel in jitcache.KERNEL_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(jitcache.ROOT / rel, tmp_path / rel)
    assert jitcache.digest(tmp_path) == jitcache.DIGEST
    (tmp_path / "decode/rowattn.py").write_text((tmp_path / "decode/rowattn.py").read_text() + "\n# edited\n")
    assert jitcache.digest(tmp_path) != jitcache.DIGEST


def test_kernels_cache_under_the_digest_and_leave_numbas_setting_alone(monkeypatch, tmp_path) -> None:
    from hetero.decode import rowattn
    from hetero.decode.twocore import attnpool

    for kernel in (rowattn._attend_rows, rowattn.attend_entry(), attnpool._attend_shared):
        assert kernel._cache._cache_path.startswith(jitcache.cache_dir())
    assert jitcache.DIGEST in jitcache.cache_dir()
    before = numba.config.CACHE_DIR
    f = jitcache.njit(nogil=True)(lambda x: x + 1)
    assert numba.config.CACHE_DIR == before and f._cache._cache_path.startswith(jitcache.cache_dir())
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))  # the user's folder: hetero's kernels in a digest folder
    assert jitcache.cache_dir() == str(tmp_path / f"hetero-{jitcache.DIGEST}")
    g = jitcache.njit(nogil=True)(lambda x: x + 2)
    assert g._cache._cache_path.startswith(str(tmp_path / f"hetero-{jitcache.DIGEST}")) and g(1) == 3
