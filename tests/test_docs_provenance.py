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
    for page, kind in (("pretrained.md", "pretrained_probe"), ("training.md", "train_digits"),
                       ("pretrained.md", "probe_ff_drift")):
        kinds = [m["kind"] for m in provenance.read_markers((DOCS / page).read_text(encoding="utf-8"))]
        assert kind in kinds, (page, kinds)


def test_fingerprint_follows_code_not_comments(tmp_path):
    """The fingerprint ignores docstrings, comments, blank lines and import statements, and changes with any change of code; a page
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
    # the same code with its names imported from elsewhere (a module moved), inside a function too
    mod.write_text('from math import sin\nimport os\n\n\ndef f(x):\n    return math.sin(x)\n')
    assert provenance.code_fingerprint("x", tmp_path, files) == a
    mod.write_text('import math\n\n\ndef f(x):\n    import math\n    return math.cos(x)\n')
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


def _summary(values):
    import statistics

    return {"mean": statistics.fmean(values), "sem": statistics.stdev(values) / len(values) ** 0.5,
            "seeds": list(values)}


def test_training_table_script_renders_the_run_with_its_marker(tmp_path):
    """scripts/training_table.py: the run's fingerprint in the marker, the paired differences and the counts of
    seeds read off the per-seed values, the time ratio per seed, and only the marked section replaced."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import training_table

    acc = {"flow": [0.96, 0.97, 0.95], "transformer": [0.97, 0.97, 0.96], "flow_kinetic_0.1": [0.95, 0.96, 0.94]}
    loss = {"flow": [0.2, 0.1, 0.3], "transformer": [0.1, 0.2, 0.2], "flow_kinetic_0.1": [0.3, 0.2, 0.4]}
    sec = {"flow": [2.0, 4.0, 3.0], "transformer": [0.5, 1.0, 1.0], "flow_kinetic_0.1": [2.0, 2.0, 2.0]}
    m = {"code_fingerprint": "0123456789abcdef", "kinetic": "metric",
         "test_accuracy": {k: _summary(v) for k, v in acc.items()},
         "test_loss": {k: _summary(v) for k, v in loss.items()},
         "seconds_per_epoch": {k: _summary(v) for k, v in sec.items()},
         "parameters": {"flow": 100, "transformer": 101, "flow_kinetic_0.1": 100},
         "test_kinetic": {"flow": _summary([5.0, 6.0, 7.0]), "flow_kinetic_0.1": _summary([1.0, 1.0, 1.0])},
         "kinetic_tradeoff": {n: {"accuracy_minus_flow": _summary([a - b for a, b in zip(acc[n], acc["flow"])]),
                                  "loss_minus_flow": _summary([a - b for a, b in zip(loss[n], loss["flow"])])}
                              for n in ("flow_kinetic_0.1", "transformer")}}
    text = training_table.render(m, "r1")
    assert text.startswith("<!-- table-source: kind=train_digits code=0123456789abcdef run=r1 -->")
    assert "transformer − flow = +0.67 ± 0.33 points" in text
    assert "lower on 2 of 3 seeds" in text  # transformer − flow loss: -0.1, +0.1, -0.1
    assert "takes 3.7 ± 0.3× less time per epoch" in text  # ratios 4, 4, 3
    assert "| transformer | +0.67 ± 0.33 | -0.0333 ± 0.0667 | 2 of 3 |" in text
    page = tmp_path / "p.md"
    page.write_text("a\n<!-- training-results:x:start -->\nold\n<!-- training-results:x:end -->\nb\n")
    training_table.write(page, "x", text)
    assert page.read_text() == f"a\n<!-- training-results:x:start -->\n{text}<!-- training-results:x:end -->\nb\n"
    with pytest.raises(ValueError, match="no '<!-- training-results:y:start -->'"):
        training_table.write(page, "y", text)
