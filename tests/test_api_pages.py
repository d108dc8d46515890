"""The API reference as it renders: the docstrings parsed the way the site parses them (napoleon with the site's
settings, in the fast run) and, in the slow run, the built HTML of ``tp.simulate``'s page and of the index."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import transformer_pde as tp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import apigen  # noqa: E402


def _napoleon_settings() -> dict:
    """The ``napoleon_*`` assignments of docs/conf.py (read, not imported: importing it writes docs/api)."""
    tree = ast.parse((ROOT / "docs" / "conf.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id.startswith("napoleon_"):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def _rendered(obj) -> str:
    napoleon = pytest.importorskip("sphinx.ext.napoleon")
    from sphinx.ext.napoleon.docstring import NumpyDocstring

    return str(NumpyDocstring(inspect.getdoc(obj), napoleon.Config(**_napoleon_settings()), what="function"))


def _field(text: str, name: str) -> str:
    """The body of the field ``:name:`` of a rendered docstring (up to the next field at column 0)."""
    m = re.search(rf"^:{name}:(.*?)(?=^:\w|\Z)", text, re.S | re.M)
    assert m, f"no :{name}: field in\n{text}"
    return m.group(1)


def test_simulate_returns_one_value():
    returns = _field(_rendered(tp.simulate), "returns")
    assert "Stage weights" not in returns  # a paragraph after Returns was read as a second return value
    assert not re.findall(r"(?m)^\s*\* ", returns) and "Trajectory" in returns  # one value: no bullet list


def test_grouped_parameters_keep_their_sentence_once():
    text = _rendered(tp.solve)
    for sentence in ("final time, step", "options objects"):
        assert text.count(sentence) == 1, text
    assert re.search(r"\*\*t1, dt, t0\*\*", text), text


def test_index_summaries_are_whole_sentences_and_the_entry_points_come_first():
    objects, _ = apigen.top_level_names()
    order = apigen.index_order(objects)
    assert order[:2] == ["simulate", "solve"]
    for name in objects:
        summary = apigen._summary(getattr(tp, name), name)
        assert summary, f"tp.{name} has no summary in the API index"
        doc = inspect.getdoc(getattr(tp, name)) if callable(getattr(tp, name)) else None
        if doc and "\n" in doc.split("\n\n")[0]:  # a first paragraph over several lines is not cut at a line end
            assert summary.rstrip().endswith((".", ":", ")", "]")) or summary == " ".join(doc.split("\n\n")[0].split()), \
                (name, summary)
    assert "layer_norm" in apigen._summary(tp.LAYER_NORMS, "LAYER_NORMS")
    assert ":math:`S^{d-1}`" in apigen._summary(tp.simulate, "simulate")  # not the raw "S^{d-1}"


def test_first_sentence():
    assert apigen.first_sentence("One line\ngoes on here. Second sentence.\n\nNext paragraph.") == \
        "One line goes on here."
    assert apigen.first_sentence("Uses e.g. this. Then more.") == "Uses e.g. this."
    assert apigen.first_sentence("No full stop at all\n\nmore") == "No full stop at all"


def test_tex_powers_in_plain_docstrings_become_math():
    conf = pytest.importorskip("sphinx") and _conf_module()
    out = conf._escape_plain("tokens on S^{d-1}, weights e^{−log_scale} and |x|")
    assert ":math:`S^{d-1}`" in out and ":math:`e^{-log_scale}`" in out and "\\|x\\|" in out


def _conf_module():
    """docs/conf.py's docstring helpers, without running its apigen.write() (the source up to the helpers)."""
    src = (ROOT / "docs" / "conf.py").read_text()
    start = src.index("# -- docstrings as rendered")
    ns: dict = {"__name__": "conf_helpers", "ROOT": ROOT, "sys": sys}
    exec(compile(src[start:], "docs/conf.py", "exec"), ns)
    return type("Conf", (), {k: staticmethod(v) if callable(v) else v for k, v in ns.items()
                             if not k.startswith("__")})


@pytest.mark.slow
def test_built_simulate_page_and_index(tmp_path):
    pytest.importorskip("sphinx")
    out = tmp_path / "html"
    r = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-D", "plot_gallery=0",
                        str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    page = (out / "api" / "generated" / "transformer_pde.simulate.html").read_text()
    returns = re.search(r"Returns.*?</dd>", page, re.S).group(0)
    assert "Stage weights" not in returns and returns.count("<li>") == 0, returns
    assert "Stage weights" in page  # still on the page, under Notes
    solve = (out / "api" / "generated" / "transformer_pde.solve.html").read_text()
    assert solve.count("final time, step") == 1
    index = (out / "api" / "index.html").read_text()
    assert index.index("tp.simulate") < index.index("tp.PeriLN")
