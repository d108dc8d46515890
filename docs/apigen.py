"""Write the API reference sources (``docs/api/``) from the package's ``__all__`` lists.

Run by ``docs/conf.py`` at the start of every build, so that a new public name or module appears
in the reference without editing the docs:

* ``docs/api/index.rst``: one autosummary table of every non-module name in
  ``transformer_pde.__all__`` (one page each, ``api/generated/transformer_pde.NAME``), and a list
  of every public module;
* ``docs/api/<module>.rst``: one page per public module (no path component starting with ``_``),
  ``automodule`` with ``:members:`` — which documents exactly the module's ``__all__`` when it
  has one (re-exported names included), else its public members.

``python docs/apigen.py`` writes the files without building (``tests/test_docs.py`` checks the
coverage of every ``__all__``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import shutil
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "transformer_pde"


def public_modules(package: str = PACKAGE) -> list[str]:
    """Every importable public module of the package (the package itself first), sorted."""
    pkg = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return [names[0]] + sorted(names[1:])


def top_level_names(package: str = PACKAGE) -> tuple[list[str], list[str]]:
    """``__all__`` of the package split into (objects, modules)."""
    pkg = importlib.import_module(package)
    objects, modules = [], []
    for name in pkg.__all__:
        value = getattr(pkg, name)
        (modules if isinstance(value, types.ModuleType) else objects).append(name)
    return objects, modules


def _title(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


def module_members(modname: str) -> list[str]:
    """The names a module's page covers: its ``__all__``, else its public functions and classes."""
    mod = importlib.import_module(modname)
    if hasattr(mod, "__all__"):
        return [n for n in mod.__all__ if hasattr(mod, n)]
    return [n for n, v in vars(mod).items() if not n.startswith("_")
            and (inspect.isfunction(v) or inspect.isclass(v)) and getattr(v, "__module__", None) == modname]


def _page_order() -> list[str]:
    """Modules in the order that decides where a re-exported object is documented: the package,
    then the modules of ``tp.__all__`` (``tp.diagnostics`` before ``tp.theory.particles``), then
    the defining modules."""
    _, re_exported = top_level_names()
    pkg = importlib.import_module(PACKAGE)
    first = [getattr(pkg, m).__name__ for m in re_exported]
    first = [m for m in first if m in public_modules()]
    return [PACKAGE] + first + [m for m in public_modules()[1:] if m not in first]


def plan() -> dict[str, dict[str, str]]:
    """For every public module, each name of its page -> the fully qualified name it is documented
    under.  A function or class is documented once (first page in :func:`_page_order`); the other
    modules that export it link there."""
    objects, _ = top_level_names()
    pkg = importlib.import_module(PACKAGE)
    home: dict[int, str] = {}
    for name in objects:
        value = getattr(pkg, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            home.setdefault(id(value), f"{PACKAGE}.{name}")
    out: dict[str, dict[str, str]] = {PACKAGE: {n: f"{PACKAGE}.{n}" for n in objects}}
    for modname in _page_order()[1:]:
        mod = importlib.import_module(modname)
        names = {}
        for n in module_members(modname):
            value = getattr(mod, n)
            if isinstance(value, types.ModuleType):
                continue
            if inspect.isfunction(value) or inspect.isclass(value):
                names[n] = home.setdefault(id(value), f"{modname}.{n}")
            else:
                names[n] = f"{modname}.{n}"
        out[modname] = names
    return out


def _clashes() -> set[str]:
    """Modules whose name is also a documented object (``transformer_pde.model.energy`` the module and
    ``tp.energy`` the function): their page is not entered in the index as a module."""
    objects, _ = top_level_names()
    return {f"{PACKAGE}.{n}" for n in objects}


def module_page(modname: str, names: dict[str, str]) -> str:
    out = [f".. _api-{modname}:\n", _title(f"``{modname}``")]
    noindex = "   :no-index:\n" if modname in _clashes() else ""
    if modname == PACKAGE:
        out.append(f".. automodule:: {modname}\n   :no-members:\n")
        out.append("Every name of ``transformer_pde.__all__`` has its own page: :ref:`api`.\n")
        return "\n".join(out)
    own = [n for n, q in names.items() if q == f"{modname}.{n}"]
    if own:
        out.append(f".. automodule:: {modname}\n   :members: {', '.join(own)}\n   :undoc-members:\n"
                   f"   :show-inheritance:\n   :member-order: bysource\n{noindex}")
    else:
        out.append(f".. automodule:: {modname}\n   :no-members:\n{noindex}")
    linked = {n: q for n, q in names.items() if q != f"{modname}.{n}"}
    if linked:
        out.append(".. rubric:: Also exported here (documented elsewhere)\n")
        out += [f"* ``{n}``: :py:obj:`{q}`" for n, q in linked.items()]
        out.append("")
    return "\n".join(out)


def _directive(value) -> str:
    if inspect.isclass(value):
        return "autoclass" if not issubclass(value, BaseException) else "autoexception"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return "autofunction"
    return "autodata"


def object_page(name: str) -> str:
    """The page of one top-level name, ``api/generated/transformer_pde.NAME.rst``."""
    pkg = importlib.import_module(PACKAGE)
    value = getattr(pkg, name)
    kind = _directive(value)
    opts = "   :members:\n   :undoc-members:\n   :show-inheritance:\n   :member-order: bysource\n" \
        if kind in ("autoclass", "autoexception") else ""
    if kind == "autodata":
        opts = "   :annotation:\n"
    return _title(f"tp.{name}") + f"\n.. currentmodule:: {PACKAGE}\n\n.. {kind}:: {name}\n{opts}"


def _data_comment(name: str) -> str:
    """The ``#:`` comment above ``name = ...`` in the public module that defines it (what autodoc shows for data)."""
    import re

    pattern = re.compile(rf"((?:^[ \t]*#:.*\n)+)^{re.escape(name)}\s*[:=]", re.M)
    for modname in public_modules():
        try:
            m = pattern.search(inspect.getsource(importlib.import_module(modname)))
        except (OSError, TypeError):
            continue
        if m:
            return " ".join(ln.strip()[2:].strip() for ln in m.group(1).splitlines())
    return ""


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph (the lines joined; cut after the first ". " or at the
    end of the paragraph), never a line cut mid-sentence."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    for k in range(len(para) - 1):
        if para[k] == "." and para[k + 1] == " " and not para[max(0, k - 3):k + 1].endswith(("e.g.", "i.e.", "etc.")):
            return para[:k + 1]
    return para


def _summary(value, name: str = "") -> str:
    """The API index's line for ``value``: its first sentence, reStructuredText-safe, TeX powers as math."""
    import re

    doc = inspect.getdoc(value) if (inspect.isclass(value) or callable(value)) else _data_comment(name)
    text = first_sentence(doc).replace("|", "\\|").replace("*", "\\*")
    return re.sub(r"(?<![\w\\`])([A-Za-z]\w*)\^\{([^{}|*`]+)\}",
                  lambda m: f"\\ :math:`{m.group(1)}^{{{m.group(2).replace('−', '-')}}}`\\ ", text)


#: the names the API index lists first: the entry points a reader looks for, then the rest in ``__all__`` order
FIRST = ("simulate", "solve", "Model", "jko", "Trajectory", "Heads", "OrnsteinUhlenbeck", "Oscillating", "Layerwise")


def index_order(objects: list[str]) -> list[str]:
    """``objects`` with the entry points of :data:`FIRST` first."""
    first = [n for n in FIRST if n in objects]
    return first + [n for n in objects if n not in first]


def index_page() -> str:
    objects, modules = top_level_names()
    pkg = importlib.import_module(PACKAGE)
    mods = public_modules()
    lines = [".. _api:\n", _title("API reference"),
             "Generated from the docstrings at every build (``docs/apigen.py``): every name of "
             "``transformer_pde.__all__`` has its own page, and every public module a page "
             "documenting its ``__all__``.  Conventions and formulas: :doc:`/model`.\n",
             _title("Top level: ``import transformer_pde as tp``", "-"),
             ".. list-table::\n   :widths: 30 70\n"]
    for name in index_order(objects):
        lines.append(f"   * - :doc:`tp.{name} <generated/{PACKAGE}.{name}>`\n     - {_summary(getattr(pkg, name), name)}")
    lines.append("")
    lines.append(".. toctree::\n   :hidden:\n")
    lines += [f"   generated/{PACKAGE}.{name}" for name in index_order(objects)]  # the sidebar in the same order
    lines.append("")
    lines.append(_title("Modules", "-"))
    lines.append("Sub-modules re-exported as ``tp.<name>``: "
                 + ", ".join(f":ref:`tp.{m} <api-{getattr(pkg, m).__name__}>`" for m in modules) + ".\n")
    lines.append(".. toctree::\n   :maxdepth: 1\n")
    lines += [f"   {m}" for m in mods]
    lines.append("")
    return "\n".join(lines)


def write(out: Path = HERE / "api") -> list[Path]:
    """(Re)write ``out`` (removing pages of modules that no longer exist); return the files."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files = [out / "index.rst"]
    files[0].write_text(index_page())
    (out / "generated").mkdir()
    for name in top_level_names()[0]:
        p = out / "generated" / f"{PACKAGE}.{name}.rst"
        p.write_text(object_page(name))
        files.append(p)
    for m, names in plan().items():
        p = out / f"{m}.rst"
        p.write_text(module_page(m, names))
        files.append(p)
    return files


if __name__ == "__main__":
    for f in write():
        print(f)
