"""Sphinx configuration of the transformer_pde documentation.

Build (one command, warnings are errors): ``python scripts/build_docs.py`` (which runs
``python -m sphinx -W --keep-going -b html docs docs/_build/html`` and then checks every local
link and image of the HTML).

Why Sphinx + sphinx-gallery + MyST: the libraries our users already read (POT, geomloss) use
Sphinx with autodoc and an executed sphinx-gallery, so the API pages and example pages look and
cross-link the way they expect (intersphinx to torch/numpy/POT works the same way); MyST lets
the long-form pages stay Markdown; napoleon renders the numpydoc docstring sections.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))   # the checkout's package, not an installed copy
sys.path.insert(0, str(DOCS))

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import apigen  # noqa: E402
import transformer_pde  # noqa: E402

apigen.write()

project = "transformer_pde"
author = "The transformer_pde authors"
copyright = "2026, The transformer_pde authors"
release = version = transformer_pde.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

# MathJax shipped with the site (sphinx-mathjax-offline, in the docs extra) so that formulas render
# without a network, in the screenshots too; without the package the CDN copy is used.
try:
    importlib.import_module("sphinx-mathjax-offline")
    extensions.append("sphinx-mathjax-offline")
except ImportError:  # pragma: no cover
    pass

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "mutation/verdicts/**", "gallery/**", "**.ipynb_checkpoints", "sg_execution_times.rst"]
templates_path = ["_templates"]

# -- autodoc / autosummary / napoleon (numpydoc sections) -------------------------------------
autosummary_generate = False  # docs/apigen.py writes the pages
autosummary_imported_members = True
autosummary_ignore_module_all = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # types only for the parameters a docstring lists
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# one field list per section: "t1, dt, t0 : ..." stays one entry with its sentence once (with
# napoleon_use_param = True it becomes three :param: fields repeating the same sentence)
napoleon_use_param = False
napoleon_use_ivar = True
add_module_names = False
python_use_unqualified_type_names = True

# -- MyST --------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# -- sphinx-gallery: every docs/gallery/plot_*.py is executed -----------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "gallery",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"__init__\.py",
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "download_all_examples": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    "min_reported_time": 0,
    "show_memory": False,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "reset_modules": ("matplotlib",),
    "capture_repr": (),
}

# -- HTML --------------------------------------------------------------------------------------
try:
    import furo  # noqa: F401

    html_theme = "furo"
except ImportError:  # pragma: no cover - the docs extra installs furo
    html_theme = "alabaster"
html_title = f"transformer_pde {release}"
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False

nitpicky = False
suppress_warnings = ["config.cache", "myst.header"]  # docs/mutation/*.md are generated reports


# -- docstrings as rendered ----------------------------------------------------------------------
# The docstrings are written to be read with help() as well: formulas in plain Unicode, with |x|
# for norms and * for products.  In reStructuredText |...| is a substitution and a lone * starts
# emphasis, so both are escaped outside literals and roles before rendering.  Docstrings still in
# the older Google style (scripts/numpydoc_style.py PENDING_CONVERSION) are converted on the fly
# by the same function that converts the files.
sys.path.insert(0, str(ROOT / "scripts"))
import numpydoc_style  # noqa: E402
import re  # noqa: E402

_LITERAL = re.compile(r"(``.+?``|:[\w:]+:`[^`]+`|`[^`]+`_?|\$[^$]+\$)")
_EMPHASIS = re.compile(r"(?<![\w*\\])(\*\*?)(?=\S)([^*]*?\S)\1(?![\w*])")


# a power written in TeX in a plain docstring (S^{d-1}, e^{−c}, N^{-1/2}): rendered as math, like the narrative pages
_POWER = re.compile(r"(?<![\w\\`])([A-Za-z]\w*)\^\{([^{}|*`]+)\}")


def _math_power(m) -> str:
    # "\ " on both sides: an escaped, invisible space, so that the role may touch the text around it ("e^{λβ}(λβ − 1)")
    return f"\\ :math:`{m.group(1)}^{{{m.group(2).replace('−', '-')}}}`\\ "


def _escape_plain(segment: str) -> str:
    bullet = re.match(r"^\s*[*+-] ", segment)  # a list item's marker stays a marker
    lead, segment = (segment[:bullet.end()], segment[bullet.end():]) if bullet else ("", segment)
    kept = {}

    def keep(m, text=None):
        kept[len(kept)] = m.group(0) if text is None else text
        return f"\0{len(kept) - 1}\0"

    segment = _POWER.sub(lambda m: keep(m, _math_power(m)), segment)
    segment = re.sub(r"(?<!\\)\|", r"\\|", segment)
    segment = _EMPHASIS.sub(keep, segment)
    segment = re.sub(r"(?<!\\)\*", r"\\*", segment)
    return lead + re.sub(r"\0(\d+)\0", lambda m: kept[int(m.group(1))], segment)


def _render_safe(lines):
    out, code_indent = [], None  # code_indent: inside a literal block (after "::") indented past it
    for ln in lines:
        s, ind = ln.strip(), len(ln) - len(ln.lstrip())
        if code_indent is not None and s and ind < code_indent:
            code_indent = None
        if code_indent is not None or not s or s.startswith((">>>", "...")):
            out.append(ln)
            continue
        parts = _LITERAL.split(ln)
        out.append("".join(p if k % 2 else _escape_plain(p) for k, p in enumerate(parts)))
        if s.endswith("::"):
            code_indent = ind + 1
    return out


_BULLET = re.compile(r"^\s*([-*+•]|\d+[.)]|\(\w+\)|\.\.|>>>)\s")
_SECTION_UNDERLINE = re.compile(r"^\s*-{3,}\s*$")


def _plain_layout(lines):
    """Indented plain-text blocks as the help() reader sees them: a block after a blank line or a
    line ending with ":" is preformatted (a literal block); a hanging indent continues its
    paragraph.  Only the text before the first numpydoc section is touched (napoleon reads the
    sections), and bullet lists, directives and doctests are left to reStructuredText."""
    end = next((k for k in range(1, len(lines)) if _SECTION_UNDERLINE.match(lines[k])
                and lines[k - 1].strip() in numpydoc_style.NUMPY_SECTIONS), len(lines))
    head, tail = lines[:end - 1] if end < len(lines) else lines, lines[end - 1:] if end < len(lines) else []
    out, k = [], 0
    while k < len(head):
        ln = head[k]
        ind = len(ln) - len(ln.lstrip())
        prev = next((x for x in reversed(out) if x.strip()), None)
        prev_ind = len(prev) - len(prev.lstrip()) if prev is not None else 0
        if not ln.strip() or prev is None or ind <= prev_ind or prev.rstrip().endswith("::") \
                or _BULLET.match(prev) or ln.lstrip().startswith(">>>"):
            out.append(ln)
            k += 1
            continue
        # an indented block starting at k: up to the next line at (or left of) prev's indentation
        j = k
        while j < len(head) and (not head[j].strip() or len(head[j]) - len(head[j].lstrip()) > prev_ind):
            j += 1
        while j > k and not head[j - 1].strip():
            j -= 1
        block = head[k:j]
        after_blank = not out[-1].strip()
        if after_blank or prev.rstrip().endswith(":"):
            if prev.rstrip().endswith(":") and not after_blank:
                out[-1] = out[-1].rstrip() + ":"
                out.append("")
            elif prev.rstrip().endswith(":"):
                idx = max(i for i, x in enumerate(out) if x.strip())
                out[idx] = out[idx].rstrip() + ":"
            else:
                out += [" " * prev_ind + "::", ""]
            out += block + [""]
        else:  # hanging indent: the same paragraph
            out += [" " * prev_ind + x.strip() if x.strip() else "" for x in block]
        k = j
    return out + tail


def _process_docstring(app, what, name, obj, options, lines):
    text = "\n".join(lines)
    if numpydoc_style.problems(text):
        ann = getattr(obj, "__annotations__", {}) if callable(obj) else {}
        ret = ann.get("return") if isinstance(ann, dict) else None
        params = {k: v if isinstance(v, str) else getattr(v, "__name__", str(v))
                  for k, v in ann.items() if k != "return"} if isinstance(ann, dict) else {}
        ret = ret if isinstance(ret, str) or ret is None else getattr(ret, "__name__", str(ret))
        text = numpydoc_style.convert(text, ret, params)
    lines[:] = _render_safe(_plain_layout(text.split("\n")))


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring, priority=400)
