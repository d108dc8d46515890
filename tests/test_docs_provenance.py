"""Published tables come from a run of today's code: docs tables carry a ``table-source`` marker with the
fingerprint of the code their run used (application.studies.provenance), and this test recomputes it.

Covered: docs/pretrained.md (scripts/pretrained_probe_table.py) and the first training table of
docs/training.md (scripts/training_table.py).  Not covered: docs/theorems.md and docs/noisy_tokens.md (their
claim tables are rendered by scripts/render_claims.py without a marker), and the kinetic-displacement table of
docs/training.md, which says that it comes from an earlier version of the code."""

import pathlib

import pytest

from transformer_pde.application.studies import provenance

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_marked_table_comes_from_todays_code(page):
    stale = provenance.stale_tables((DOCS / page).read_text(encoding="utf-8"))
    assert not stale, f"docs/{page}: " + "; ".join(stale)


def test_the_regenerated_pages_carry_markers():
    for page, kind in (("pretrained.md", "pretrained_probe"), ("training.md", "train_digits")):
        kinds = [m["kind"] for m in provenance.read_markers((DOCS / page).read_text(encoding="utf-8"))]
        assert kind in kinds, (page, kinds)


def test_fingerprint_follows_code_not_comments(tmp_path):
    """The fingerprint ignores docstrings, comments and blank lines, and changes with any change of code; a page
    whose marker holds another fingerprint is reported stale."""
    mod = tmp_path / "m.py"
    cfg = tmp_path / "c.toml"
    mod.write_text('"""doc"""\nimport math\n\n\ndef f(x):\n    """doc"""\n    return math.sin(x)  # c\n')
    cfg.write_text("# comment\nn = 3\n")
    files = ("m.py", "c.toml")
    a = provenance.code_fingerprint("x", tmp_path, files)
    mod.write_text('"""other doc"""\nimport math\n\n# a comment\ndef f(x):\n    return math.sin(x)\n')
    cfg.write_text("# another comment\n\nn = 3\n")
    assert provenance.code_fingerprint("x", tmp_path, files) == a
    mod.write_text('import math\n\n\ndef f(x):\n    return math.cos(x)\n')
    b = provenance.code_fingerprint("x", tmp_path, files)
    assert b != a and len(b) == 16
    cfg.write_text("n = 4\n")
    assert provenance.code_fingerprint("x", tmp_path, files) not in (a, b)
    assert provenance.code_fingerprint("x", tmp_path, ("missing.py",)) == "unknown"
    with pytest.raises(ValueError, match="no table sources"):
        provenance.code_fingerprint("nonexistent_kind")
    now = provenance.code_fingerprint("train_digits")
    page = f"text\n{provenance.marker('train_digits', now, 'run1')}\n| a |\n"
    assert provenance.stale_tables(page) == []
    old = page.replace(now, "0123456789abcdef")
    stale = provenance.stale_tables(old)
    assert len(stale) == 1 and "line 2" in stale[0] and "0123456789abcdef" in stale[0]
    assert provenance.read_markers(page)[0] == {"kind": "train_digits", "code": now, "run": "run1", "line": 2}
