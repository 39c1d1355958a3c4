"""Every file, module, symbol and section that the docs name exists.

Checked: README.md, docs/*.md and the package's READMEs, and every docstring in hetero/ and bench/ (module,
class, function). Not docs/journal.md: it is a dated record, and names what existed then. What counts as a name:
- a path in backticks or a Markdown link (`npu/graph_backend.py`, `bench/results/decode.md`,
  `tests/npu/test_export.py::test_name`), resolved from the text's folder, the repository or `hetero/`;
  a bare `name.py` or `name.md` anywhere in the text must be a file of the repository;
- a dotted name in backticks: `hetero.decode.step.DecodeStep`, `decode.bound_step.BoundStep`, `rowattn.AttentionPool`
  (the tail of a module's name), `AttentionPool.run_stages` (a class of hetero); where the head is also
  a variable named after its class, its attributes count (`cache.length`: `KVCache`). A dotted name whose
  head is no module or class of hetero (`torch.sum`, `session.run`) is not ours;
- a section: `docs/design.md, "Decoding"` (a title of that file starts with it) or `docs/design.md#anchor`.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hetero"
BENCH = ROOT / "bench"  # the benchmarks: the checkout's package `bench`, not part of hetero's wheel
RECORDS = {ROOT / "docs" / "journal.md"}  # names as they were: not checked


@dataclass(frozen=True)
class Text:
    origin: str  # "README.md", "hetero/decode/step.py:DecodeStep"
    text: str
    folder: Path  # where relative paths start


def doc_files() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PKG.rglob("README.md"))]
    return [p for p in docs if p not in RECORDS]


def docstrings(path: Path) -> list[Text]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                where = "" if isinstance(node, ast.Module) else f":{node.name}"
                out.append(Text(f"{path.relative_to(ROOT)}{where}", doc, path.parent))
    return out


def texts() -> list[Text]:
    docs = [Text(str(p.relative_to(ROOT)), p.read_text(), p.parent) for p in doc_files()]
    return docs + [t for p in sorted([*PKG.rglob("*.py"), *BENCH.glob("*.py")]) for t in docstrings(p)]


# --- the package: modules, classes, attributes -----------------------------------------------------------

@functools.cache
def modules() -> dict[str, Path]:
    """Dotted name → file of every module of hetero and of bench."""
    out = {}
    for p in [*PKG.rglob("*.py"), *BENCH.glob("*.py")]:
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


@functools.cache
def classes() -> dict[str, list[str]]:
    """Class name → modules that define it at top level."""
    out: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(name)
    return out


def class_attribute(cls: type, attr: str) -> bool:
    """Whether instances of cls have attr: a class attribute, a field, or `self.attr = ...` in a method."""
    if hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}) or attr in getattr(klass, "__slots__", ()):
            return True
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == attr
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
    return False


def resolve_in(obj: object, chain: list[str]) -> bool:
    """Whether the attribute chain exists on obj (a module or class); past an instance attribute, unchecked."""
    for i, attr in enumerate(chain):
        if inspect.isclass(obj):
            if not class_attribute(obj, attr):
                return False
            if not hasattr(obj, attr):
                return True  # an instance attribute: its type is not known here
        elif inspect.ismodule(obj) and f"{obj.__name__}.{attr}" in modules():
            obj = importlib.import_module(f"{obj.__name__}.{attr}")  # a submodule, imported or not
            continue
        elif not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
        if not (inspect.ismodule(obj) or inspect.isclass(obj)):
            return True  # a function or a value: what follows (`.cache`, a call's result) is not a name of ours
    return True


def resolve_module(module: str, chain: list[str]) -> bool:
    return resolve_in(importlib.import_module(module), chain)


def dotted_exists(name: str) -> bool | None:
    """Whether a dotted name of hetero (or bench) exists; None when it names nothing of ours (`torch.sum`)."""
    parts = name.split(".")
    mods = modules()
    if parts[0] in ("hetero", "bench"):
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in mods:
                return resolve_module(".".join(parts[:k]), parts[k:])
        return False
    candidates = []  # (module, rest of the chain): `decode.bound_step.BoundStep`, `rowattn.decode_rows`
    for k in range(len(parts) - 1, 0, -1):
        tail = "." + ".".join(parts[:k])
        candidates += [(m, parts[k:]) for m in mods if m.endswith(tail)]
        if candidates:
            break
    candidates += [(m, parts) for m in classes().get(parts[0], [])]  # `AttentionPool.run_stages`
    # a variable named after its class: `cache.length` (KVCache), `model.tokenizer` (Model)
    named = [(m, [c, *parts[1:]]) for c, ms in classes().items() for m in ms
             if c.lower() == parts[0] or (c.lower().endswith(parts[0]) and len(parts[0]) >= 4)]
    if not candidates:  # a head that is no module or class of hetero (`session.run`, `torch.sum`): not ours
        return None
    return any(resolve_module(m, chain) for m, chain in candidates + named)


def callables(name: str) -> list[object]:
    """What a call's name can mean in hetero: `DecodeStep` (a class of hetero), `hetero.methods.make_runtime`,
    `rowattn.decode_rows` (a module's tail); [] when it is none of these."""
    parts = name.split(".")
    found = []
    for m, chain in [(m, parts[1:]) for m in classes().get(parts[0], [])] + [
            (m, parts[k:]) for k in range(len(parts) - 1, 0, -1) for m in modules()
            if m == ".".join(parts[:k]) or m.endswith("." + ".".join(parts[:k]))]:
        obj = getattr(importlib.import_module(m), parts[0]) if chain == parts[1:] and parts[0] in classes() \
            else importlib.import_module(m)
        for attr in chain:
            obj = getattr(obj, attr, None)
        if callable(obj):
            found.append(obj)
    return found


def top_keywords(args: str) -> list[str]:
    """The `name=` arguments of a call's argument text, not those of calls nested in it."""
    depth, flat = 0, []
    for c in args:
        depth += (c in "([{") - (c in ")]}")
        flat.append(c if depth == 0 else " ")
    return re.findall(r"(?:^|,)\s*(\w+)=(?!=)", "".join(flat))


def takes_keywords(obj: object, keywords: list[str]) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return True  # no signature to check (a builtin)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    return all(k in params for k in keywords)


# --- files and sections ----------------------------------------------------------------------------------

TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
SUBPACKAGES = {p.name for p in PKG.iterdir() if p.is_dir()}


@functools.cache
def repo_files() -> frozenset[str]:
    skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
    return frozenset(p.name for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts))


def path_exists(path: str, folder: Path) -> bool | None:
    """Whether a path named in a text exists; None when it is not a path of the repository."""
    if any(c in path for c in "<>{}~$") or path.startswith(("/", "http")):
        return None
    path = path.split("::")[0].split("#")[0].rstrip(".,:;")
    rel = path[3:] if path.startswith("../") else path
    if "/" not in rel:
        if not rel.endswith((".py", ".md")):
            return None
        return rel in repo_files()
    if rel.split("/")[0] not in TOP | SUBPACKAGES and not path.startswith("../"):
        return None  # `capi/libonnxruntime.so.*`: a path inside another package
    for base in (folder, ROOT, PKG):
        if any(True for _ in base.glob(path)) if "*" in path else (base / path).exists():
            return True
    return False


def pytest_node_exists(spec: str, folder: Path) -> bool:
    """`tests/x.py::test_name[param]`: the file defines test_name."""
    file, _, test = spec.partition("::")
    test = test.split("[")[0]
    for base in (folder, ROOT):
        if (base / file).exists():
            return re.search(rf"^\s*def {re.escape(test)}\(", (base / file).read_text(), re.M) is not None
    return False


def slug(title: str) -> str:
    """GitHub's anchor of a Markdown title."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@functools.cache
def titles(doc: str) -> tuple[str, ...]:
    path = ROOT / doc
    if not path.exists():
        return ()
    return tuple(re.sub(r"`", "", m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M))


# --- what a text names -----------------------------------------------------------------------------------

SPAN = re.compile(r"``(.+?)``|`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE_FILE = re.compile(r"(?<![\w/.`-])([A-Za-z_][\w-]*\.(?:md|py))\b")
SECTION = re.compile(r"(docs/[\w-]+\.md)(?:#([\w-]+)|,?\s+[\"“]([^\"”]+)[\"”])")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
PATHLIKE = re.compile(r"(?:\.\./)?[\w.*-]+(?:/[\w.*\[\]:-]*)+|[\w-]+\.(?:py|md)(?:::\w+)?")


def problems(t: Text) -> list[str]:
    """The names in one text that do not exist, each as "origin: name (what is wrong)"."""
    bad = []
    text = re.sub(r"```.*?```", "", t.text, flags=re.S)  # code blocks: tested by running them
    for m in SECTION.finditer(text):
        doc, anchor, title = m.groups()
        if not (ROOT / doc).exists():
            bad.append(f"{doc} (no such file)")
        elif anchor and anchor not in {slug(x) for x in titles(doc)}:
            bad.append(f"{doc}#{anchor} (no such section)")
        elif title and not any(x.startswith(title) for x in titles(doc)):
            bad.append(f'{doc}, "{title}" (no such section)')
    for m in LINK.finditer(text):
        target = m.group(1)
        if target.startswith("#"):
            if t.origin.endswith(".md") and target[1:] not in {slug(x) for x in titles(t.origin)}:
                bad.append(f"{target} (no such section)")
        elif not target.startswith("http") and path_exists(target, t.folder) is False:
            bad.append(f"{target} (no such file)")
    spans = [a or b for a, b in SPAN.findall(text)]
    prose = SPAN.sub(" ", text)
    for name in BARE_FILE.findall(prose):
        if path_exists(name, t.folder) is False:
            bad.append(f"{name} (no such file)")
    for span in spans:
        for token in span.split():
            if not PATHLIKE.fullmatch(token) and not token.endswith((".py", ".md")):
                continue
            if "::" in token and path_exists(token, t.folder):
                if not pytest_node_exists(token, t.folder):
                    bad.append(f"{token} (no such test)")
            elif PATHLIKE.fullmatch(token) and path_exists(token, t.folder) is False:
                bad.append(f"{token} (no such file)")
        call = re.fullmatch(r"([\w.]+)\((.*)\)", span.strip())
        keywords = top_keywords(call.group(2)) if call else []
        if keywords:  # `DecodeStep(..., attention_threads=1)`: the keywords are the callable's parameters
            found = callables(call.group(1))
            if found and not any(takes_keywords(f, keywords) for f in found):
                bad.append(f"{span} (no such parameter)")
        name = span.split("(")[0].strip()
        if DOTTED.fullmatch(name) and not re.search(r"\.(py|md|json|onnx|bin|npz|png|txt|gguf|so)$", name):
            if dotted_exists(name) is False:
                bad.append(f"{name} (no such module or symbol)")
    return [f"{t.origin}: {b}" for b in bad]


def test_docs_name_only_what_exists() -> None:
    bad = [p for t in texts() for p in problems(t)]
    assert not bad, "the docs name what does not exist:\n" + "\n".join(bad)


GOOD = """`hetero.decode.step.DecodeStep`, `decode.bound_step.BoundStep`, `attnpool.AttentionPool.run_stages`,
`AttentionPool.end`, `cache.length`, `torch.sum`, `npu/graph_backend.py`, `bench/results/decode.md`, `model.py`,
`tests/npu/test_export.py::test_linear_outputs_bit_exact_same_float_input`, [design](docs/design.md),
docs/design.md, "Decoding"; `DecodeStep(..., attention_threads=1)`, `<cache>/profiles/`, `capi/lib.so.*`."""

BAD = {
    "`hetero.decode.step.NoSuchStep`": "hetero.decode.step.NoSuchStep",
    "`rowattn.AttentionPool`": "rowattn.AttentionPool",
    "`AttentionPool.no_such_method`": "AttentionPool.no_such_method",
    "`cache.lenght`": "cache.lenght",
    "`hetero.no_such_module`": "hetero.no_such_module",
    "`npu/no_such.py`": "npu/no_such.py",
    "(notes: NO_SUCH_NOTES.md)": "NO_SUCH_NOTES.md",
    "[results](bench/results/no_such.md)": "bench/results/no_such.md",
    "`tests/npu/test_export.py::test_no_such_test`": "test_no_such_test",
    'docs/design.md, "No such section"': "No such section",
    "docs/design.md#no-such-anchor": "no-such-anchor",
    "`DecodeStep(..., attention_thread=1)`": "attention_thread",
}


def test_the_check_passes_good_names() -> None:
    assert problems(Text("planted", GOOD, ROOT)) == []


@pytest.mark.parametrize("planted", sorted(BAD))
def test_the_check_fails_on_a_planted_bad_name(planted: str) -> None:
    found = problems(Text("planted", f"Good: {GOOD}\nBad: {planted}.", ROOT))
    assert len(found) == 1 and BAD[planted] in found[0], found


def test_the_layer_table_is_the_layer_test():
    """docs/design.md's table of layers lists what `tests/test_layers.py` enforces, no more, no less."""
    from tests.test_layers import LAYER_OF

    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| layer | modules | may import |"):].split("\n\n")[0]
    rows = {r.split("|")[1].strip(): r.split("|")[2] for r in table.splitlines()[2:]}
    for layer in ("core", "techniques", "composition", "tools"):
        listed = {name.strip("/") for name in re.findall(r"`([^`]+)`", rows[layer])}
        enforced = {name for name, of in LAYER_OF.items() if of == layer}
        assert listed == enforced, f"layer {layer}: design.md lists {sorted(listed - enforced)} that the test does " \
                                   f"not, and misses {sorted(enforced - listed)}"
