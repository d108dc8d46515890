"""ARCHITECTURE.md against the package: what it calls public is public, and what it names exists.

Read statically (``ast``, no imports of the package's modules besides ``transformer_pde`` itself):

* every part ARCHITECTURE.md marks public (set in bold, or named right after the word "public", or listed
  under the "Public" paragraph of the solver parts) is in ``tp.__all__`` or in the ``__all__`` of a module;
* every ``tp.name`` (``tp.distributed.shard_tokens``) resolves on the package;
* every ``module.name`` whose module is a module of the package (``field.evaluate``) is defined there;
* every module of the table of layers and every file path it names exists.
"""

import ast
import re
from pathlib import Path

import pytest

import transformer_pde as tp

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "transformer_pde"
DOC = ROOT / "ARCHITECTURE.md"
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def _modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _top_level(path: Path):
    """(names defined at the top level, the names of ``__all__``) of a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined, exported = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defined.add(n.id)
                if isinstance(t, ast.Name) and t.id == "__all__" and node.value is not None:
                    try:
                        exported |= {v for v in ast.literal_eval(node.value) if isinstance(v, str)}
                    except ValueError:
                        pass
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return defined, exported


TOP = {name: _top_level(path) for name, path in MODULES.items()}
PUBLIC = set(tp.__all__).union(*(exported for _, exported in TOP.values()))
#: module basenames that name one module of the package only (``field`` → transformer_pde.model.field)
BASENAMES = {}
for _name in MODULES:
    BASENAMES.setdefault(_name.rsplit(".", 1)[-1], []).append(_name)


def _text():
    return DOC.read_text(encoding="utf-8")


def public_claims(text: str):
    """The names the document marks public: bold names, the name right after "public", and the first name of
    each bullet of the "Public" paragraph."""
    names = set()
    for m in re.finditer(r"\*\*`?(?:tp\.)?(" + IDENT + r")(?:\([^*]*\))?`?\*\*", text):  # a bold name, not a phrase
        names.add(m.group(1))
    for m in re.finditer(r"\bpublic\s+`(?:tp\.)?(" + IDENT + r")", text, flags=re.IGNORECASE):
        names.add(m.group(1))
    block = re.search(r"^Public \(.*?\n\n(.*?)\n\n", text, flags=re.MULTILINE | re.DOTALL)
    if block:
        for m in re.finditer(r"^\* `(?:[a-z_]+\.)*(" + IDENT + r")", block.group(1), flags=re.MULTILINE):
            names.add(m.group(1))
    return names


def tp_references(text: str):
    """Every backticked ``tp.a.b`` (call arguments dropped)."""
    out = set()
    for code in re.findall(r"`([^`]+)`", text):
        for m in re.finditer(r"(?<![A-Za-z0-9_.])tp((?:\." + IDENT + r")+)", code):
            out.add(m.group(1)[1:])
    return out


def module_references(text: str):
    """Every backticked ``module.name`` whose module is one module of the package (by its basename)."""
    out = set()
    for code in re.findall(r"`([^`]+)`", text):
        for m in re.finditer(r"(?<![A-Za-z0-9_.])(" + IDENT + r")\.(" + IDENT + r")", code):
            mod, name = m.groups()
            if len(BASENAMES.get(mod, ())) == 1 and name != "py" and mod not in ("tp", "self", "model", "solver"):
                out.add((BASENAMES[mod][0], name))
    return out


def layer_modules(text: str):
    """(sub-package, module) of the table of layers."""
    out, package = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 3 or set(cells[0]) <= {"-", " "} and cells[0] and not cells[1]:
            continue
        if cells[0] == "sub-package" or set(cells[1]) <= {"-", " "}:
            continue
        if cells[0]:
            package = cells[0].strip("`")
        if package == "facade":
            continue
        for m in re.finditer(r"`([a-z_.*/]+)`", cells[1]):
            if not m.group(1).startswith("tp."):
                out.append((package, m.group(1)))
    return out


def test_what_the_document_calls_public_is_public():
    missing = sorted(n for n in public_claims(_text()) if n not in PUBLIC)
    assert not missing, f"ARCHITECTURE.md calls these public, but no __all__ lists them: {missing}"


def test_every_tp_name_of_the_document_exists():
    missing = []
    for ref in sorted(tp_references(_text())):
        obj = tp
        for part in ref.split("."):
            if not hasattr(obj, part):
                missing.append(f"tp.{ref}")
                break
            obj = getattr(obj, part)
    assert not missing, f"ARCHITECTURE.md names calls that do not exist: {missing}"


def test_every_module_attribute_of_the_document_exists():
    missing = sorted(f"{mod}.{name}" for mod, name in module_references(_text())
                     if name not in TOP[mod][0] and f"{mod}.{name}" not in MODULES)
    assert not missing, f"ARCHITECTURE.md names functions or classes that its modules do not define: {missing}"


def test_every_module_and_file_of_the_document_exists():
    text = _text()
    absent = []
    for package, module in layer_modules(text):
        if "*" in module:
            continue
        dotted = f"transformer_pde.{package}.{module}".replace("/", ".")
        if package == "application" and module.startswith("studies"):
            continue
        if dotted not in MODULES:
            absent.append(dotted)
    for path in set(re.findall(r"`((?:transformer_pde|dynamics|solvers|model|processes|analysis|tests|docs)/[\w/.]+\.\w+)`",
                               text)):
        if not (ROOT / path).exists() and not (PKG / path).exists():
            absent.append(path)
    assert not absent, f"ARCHITECTURE.md names modules or files that do not exist: {sorted(absent)}"


@pytest.mark.parametrize("bad, test", [
    ("**`SecretThing`** is internal", test_what_the_document_calls_public_is_public),
    ("see `tp.no_such_function(x)`", test_every_tp_name_of_the_document_exists),
    ("the messages (`options.keyword_names`)", test_every_module_attribute_of_the_document_exists),
    ("in `solvers/no_such_module.py`", test_every_module_and_file_of_the_document_exists),
])
def test_the_checks_catch_a_wrong_document(monkeypatch, bad, test):
    """Each check fails on a document with one wrong line added (the checks can fail)."""
    text = _text() + "\n" + bad + "\n"
    monkeypatch.setattr(__import__(__name__), "_text", lambda: text)
    with pytest.raises(AssertionError):
        test()
