"""Docstrings: one style (numpydoc sections) and examples that run.

* every public docstring of the package passes ``scripts/numpydoc_style.py --check`` (the modules
  of its ``PENDING_CONVERSION`` list excepted until they are converted);
* the converter turns Google-style sections into numpydoc ones without losing text;
* every docstring example (``>>>``) of every module runs and prints what it says (doctest).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import transformer_pde

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import numpydoc_style  # noqa: E402


def _modules():
    names = ["transformer_pde"]
    names += [m.name for m in pkgutil.walk_packages(transformer_pde.__path__, "transformer_pde.")]
    return sorted(names)


def test_public_docstrings_are_numpydoc():
    files = numpydoc_style.module_files()
    assert len(files) >= 10
    found = [msg for f in files for msg in numpydoc_style.check_file(f)]
    assert not found, "docstrings not in numpydoc style (python scripts/numpydoc_style.py --fix FILE):\n" + "\n".join(found)


def test_pending_list_names_real_or_announced_modules():
    # the list only shrinks: it names modules of the package (or ones announced for this round)
    for rel in numpydoc_style.PENDING_CONVERSION:
        assert rel.startswith("transformer_pde/") and rel.endswith(".py"), rel
    assert len(set(numpydoc_style.PENDING_CONVERSION)) == len(numpydoc_style.PENDING_CONVERSION)


GOOGLE = '''f(x) = |x|² (the formula first).

    Args:
        x (Tensor): tokens (..., n, d)
            on the sphere.
        seed / generator: the random stream.
        weights: token weights (..., n) or None.

    Returns:
        (..., n), the values.

    Raises:
        TypeError / ValueError: bad shapes.
        OverflowError for β‖A‖ too large.

    Example:
        >>> 1 + 1
        2
    '''


def test_converter_google_to_numpydoc():
    text = numpydoc_style.convert(GOOGLE.replace("\n    ", "\n"), returns="torch.Tensor", params={"weights": "Optional[Tensor]"})
    assert numpydoc_style.problems(GOOGLE.replace("\n    ", "\n"))          # the input is flagged ...
    assert not numpydoc_style.problems(text), numpydoc_style.problems(text)  # ... the output is not
    expected_lines = [
        "Parameters", "----------", "x : Tensor", "    tokens (..., n, d)", "    on the sphere.",
        "seed, generator", "    the random stream.", "weights : Optional[Tensor]",
        "Returns", "-------", "torch.Tensor", "    (..., n), the values.",
        "Raises", "------", "TypeError, ValueError", "    bad shapes.", "OverflowError", "    for β‖A‖ too large.",
        "Examples", "--------", ">>> 1 + 1", "2",
    ]
    lines = text.split("\n")
    pos = [lines.index(e) for e in expected_lines]
    assert pos == sorted(pos), text
    assert lines[0] == "f(x) = |x|² (the formula first)."
    # idempotent: a numpydoc docstring is left as it is
    assert numpydoc_style.convert(text) == text


def test_fix_source_rewrites_only_docstrings(tmp_path):
    src = ('def f(x: "torch.Tensor") -> "torch.Tensor":\n'
           '    """Square: x ↦ x² (β‖A‖ in the text).\n\n    Args:\n        x: values.\n\n    Returns:\n        the squares.\n    """\n'
           '    return x * x\n\n\nclass _Hidden:\n    """Args:\n        y: private, not checked."""\n')
    new, count = numpydoc_style.fix_source(src)
    assert count == 1
    assert "    Parameters\n    ----------\n    x : torch.Tensor\n        values.\n" in new
    assert "    Returns\n    -------\n    torch.Tensor\n        the squares.\n    \"\"\"\n    return x * x" in new
    assert "class _Hidden:\n    \"\"\"Args:" in new  # private: untouched
    f = tmp_path / "m.py"
    f.write_text(new)
    assert numpydoc_style.check_file(f) == []
    f.write_text(src)
    assert len(numpydoc_style.check_file(f)) == 2  # f's Args and Returns


def test_check_flags_bad_underline(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('def g():\n    """G.\n\n    Returns\n    ----\n    int\n        one.\n    """\n')
    (msg,) = numpydoc_style.check_file(f)
    assert "underlined with 4 dashes, needs 7" in msg


def _doctests(modname):
    mod = importlib.import_module(modname)
    return [t for t in doctest.DocTestFinder(exclude_empty=True).find(mod, modname) if t.examples]


_WITH_EXAMPLES = [m for m in _modules() if _doctests(m)]


def test_doctests_are_collected():
    # the examples exist where the docs promise them (the package docstring, the sphere, nn, ...)
    for m in ("transformer_pde", "transformer_pde.model.sphere", "transformer_pde.processes.nn", "transformer_pde.analysis.theory"):
        assert m in _WITH_EXAMPLES, m


@pytest.mark.parametrize("modname", _WITH_EXAMPLES)
def test_docstring_examples_run(modname):
    tests = _doctests(modname)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    import io

    out = io.StringIO()
    for t in tests:
        runner.run(t, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()
