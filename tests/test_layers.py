"""The import rules of docs/design.md#architecture, checked on every import in `hetero/`.

Every `import` / `from ... import` anywhere in a module counts: module level, inside functions (lazy
imports are still dependencies), under `if TYPE_CHECKING:` (a type named in a signature is a dependency
of the design too), and `importlib.import_module("hetero....")` with a literal name. `from a import b`
points at module `a.b` when that is a module, else at `a`; importing `a.b` is not counted as importing
the package `a` (its `__init__`).
Rules: a module imports only the layers its layer may import (`MAY_IMPORT`); no import cycle between
modules; no cycle between the subpackages of the techniques layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "hetero"

# First component under hetero/ -> layer. A new module or subpackage must be added here.
LAYER_OF = {
    **dict.fromkeys(("config", "errors", "paths", "model", "kv_cache", "chunking", "runtime", "loader",
                     "default_model", "data", "torch_backends", "dag", "schedule", "prompt", "extras", "threads", "sessions", "timing",
                     "tokenizer", "attention", "jitcache", "shipped", "rope", "weights", "tensorfile", "buffers", "cpu", "nodes",
                     "layerspec", "hostplan", "progress"), "core"),
    **dict.fromkeys(("outliers", "npu", "sched", "adapters", "decode", "serve", "native"), "techniques"),
    "methods": "composition",
    "": "api",  # hetero/__init__.py: the public API
    **dict.fromkeys(("cli", "__main__", "arguments"), "tools"),
}
MAY_IMPORT = {
    "core": {"core"},
    "techniques": {"core", "techniques"},
    "composition": {"core", "techniques", "composition"},
    "api": {"core", "composition"},
    "tools": {"core", "techniques", "composition", "api", "tools"},
}

# Violations still to be removed. Each entry must still occur: remove an
# entry when its import is gone (the test says so), never add one.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = ["hetero", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _targets(node: ast.AST, name: str, is_pkg: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if is_pkg else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def import_graph() -> nx.DiGraph:
    mods = modules()
    known = set(mods)
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
                if target.split(".")[0] != "hetero":
                    continue
                while target not in known:  # `import hetero.x.Name`-style or a deleted module: nearest module
                    target = target.rpartition(".")[0]
                if target != name:
                    g.add_edge(name, target)
    return g


def layer(module: str) -> str:
    first = module.split(".")[1] if "." in module else ""
    if first not in LAYER_OF:
        raise AssertionError(f"{module} has no layer: add {first!r} to LAYER_OF in tests/test_layers.py")
    return LAYER_OF[first]


def unit(module: str) -> str:
    """The subpackage (hetero.npu, ...) or module a module belongs to, for the techniques' cycle rule."""
    return ".".join(module.split(".")[:2])


def upward_imports(g: nx.DiGraph) -> set[tuple[str, str]]:
    return {(a, b) for a, b in g.edges if layer(b) not in MAY_IMPORT[layer(a)]}


def module_cycles(g: nx.DiGraph) -> set[frozenset[str]]:
    return {frozenset(c) for c in nx.strongly_connected_components(g) if len(c) > 1}


def test_every_module_has_a_layer() -> None:
    for m in modules():
        layer(m)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    found = upward_imports(import_graph())
    new = sorted(found - set(KNOWN_UPWARD))
    assert not new, "upward imports (" + ", ".join(f"{layer(a)} -> {layer(b)}" for a, b in new) + "):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in new)
    gone = sorted(set(KNOWN_UPWARD) - found)
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {gone}"


def test_no_import_cycle_between_modules() -> None:
    found = module_cycles(import_graph())
    new = [sorted(c) for c in found - set(KNOWN_CYCLES)]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - found]
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {gone}"


def test_no_cycle_between_technique_subpackages() -> None:
    g = import_graph()
    units = nx.DiGraph()
    for a, b in g.edges:
        if layer(a) == layer(b) == "techniques" and unit(a) != unit(b):
            units.add_edge(unit(a), unit(b))
    cycles = [sorted(c) for c in nx.strongly_connected_components(units) if len(c) > 1]
    allowed = {frozenset(unit(m) for m in c) for c in KNOWN_CYCLES}
    assert not [c for c in cycles if frozenset(c) not in allowed], f"cycles between technique subpackages: {cycles}"


def test_the_walk_sees_lazy_and_type_checking_imports() -> None:
    """The checker itself: relative, function-level and TYPE_CHECKING imports all become edges."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hetero.sched.profile import Profile\n"
           "def f():\n    from . import kv_cache\n    import importlib\n    importlib.import_module('hetero.npu.cache')\n")
    known = set(modules())
    got = [t for node in ast.walk(ast.parse(src)) for t in _targets(node, "hetero.runtime", False, known)]
    assert {"hetero.sched.profile", "hetero.kv_cache", "hetero.npu.cache"} <= set(got)
    assert upward_imports(nx.DiGraph([("hetero.runtime", "hetero.sched.profile")])) == {("hetero.runtime", "hetero.sched.profile")}


# A private attribute (one leading underscore) is its owner's: no module reads one of another object, so a rename
# inside npu/ (or any package) cannot break a reader that no test or type checker sees. The exception is
# a third-party object whose API offers nothing else.
KNOWN_PRIVATE_READS = {
    ("hetero.adapters.llamacpp", "_ctx"),  # llama-cpp-python's Llama exposes its context so only
    ("hetero.cli", "_exit"), ("hetero.cli", "_run_exitfuncs"),  # os._exit (documented); atexit's handler runner
}


def private_reads(tree: ast.AST, module: str) -> set[tuple[str, str, int]]:
    """(module, attribute, line) of each `x._name` whose receiver is not `self` or `cls`."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.add((module, node.attr, node.lineno))
    return out


def test_no_module_reads_another_objects_private_attributes() -> None:
    found = set()
    for module, path in modules().items():
        found |= private_reads(ast.parse(path.read_text()), module)
    bad = sorted((m, a, line) for m, a, line in found if (m, a) not in KNOWN_PRIVATE_READS)
    assert not bad, f"private attributes read from outside their object: {bad}"


def test_the_private_read_walk_sees_a_read() -> None:
    tree = ast.parse("def f(backend, self):\n    return backend._programs, self._ok, backend.__class__\n")
    assert {a for _, a, _ in private_reads(tree, "m")} == {"_programs"}
