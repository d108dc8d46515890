"""Published tables come from a run of today's code: docs tables carry a ``table-source`` marker with the
fingerprint of the code their run used (application.studies.provenance), and this test recomputes it.

Covered: docs/pretrained.md (scripts/pretrained_probe_table.py), the first training table of docs/training.md
(scripts/training_table.py), and the claim tables of docs/theorems.md, docs/noisy_tokens.md and the frontier pages
that scripts/render_claims.py --write puts between ``<!-- claims:NAME:start/end -->`` comments.  Not covered: the
kinetic-displacement table of docs/training.md, which says that it comes from an earlier version of the code."""

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
                       ("pretrained.md", "probe_ff_drift"), ("theorems.md", "theorem_stability_data"),
                       ("theorems.md", "theorem_stability_weights"), ("theorems.md", "theorem_omega_limit"),
                       ("theorems.md", "theorem_fast_weights"), ("noisy_tokens.md", "noisy_transition"),
                       ("homogenized.md", "homogenized"), ("critical_scaling.md", "critical_scaling"),
                       ("repulsive.md", "repulsive"), ("lost_in_the_middle.md", "lost_in_the_middle")):
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


def _claims_run(folder, *, code="0123456789abcdef", kind="theorem_fast_weights"):
    import json

    folder.mkdir()
    claims = [{"name": "rate | slope", "value": 1.0, "error": 0.01, "seeds": 4, "reference": 1.0, "holds": True},
              {"name": "bound", "value": 2.5, "error": None, "seeds": 1, "reference": None, "holds": None}]
    metrics = {"claims": claims, **({"code_fingerprint": code} if code else {})}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.json").write_text(json.dumps({"kind": kind, "name": folder.name, "params": {}}))
    return folder


def test_render_claims_writes_the_marked_section_only(tmp_path, capsys):
    """scripts/render_claims.py --write: the run's fingerprint and kind in the marker, then its table, between
    the section's comments; nothing else of the page changes; a run without a fingerprint, a page without the
    section and --write without --section are refused."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import render_claims

    run = _claims_run(tmp_path / "r1")
    page = tmp_path / "p.md"
    page.write_text("intro\n<!-- claims:fast:start -->\nold table\n<!-- claims:fast:end -->\noutro\n")
    assert render_claims.main([str(run), "--write", str(page), "--section", "fast"]) == 0
    text = page.read_text()
    head, body = text.split("<!-- claims:fast:start -->\n")
    assert head == "intro\n" and body.endswith("<!-- claims:fast:end -->\noutro\n")
    assert provenance.read_markers(text) == [{"kind": "theorem_fast_weights", "code": "0123456789abcdef",
                                              "run": "r1", "line": 3}]
    assert "| rate \\| slope | 1 ± 0.01 | 4 | 1 | yes |" in text and "| bound | 2.5 ± — | 1 | — | — |" in text
    assert "old table" not in text
    assert len(provenance.stale_tables(text)) == 1  # a made-up fingerprint is not today's code
    old = _claims_run(tmp_path / "r0", code=None)
    assert render_claims.main([str(old), "--write", str(page), "--section", "fast"]) == 2
    assert "no code_fingerprint" in capsys.readouterr().err
    assert render_claims.main([str(run), "--write", str(page), "--section", "other"]) == 2
    assert "no '<!-- claims:other:start -->'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        render_claims.main([str(run), "--write", str(page)])


def test_a_run_of_a_published_kind_records_the_code_it_ran(tmp_path, monkeypatch):
    """runs.execute puts code_fingerprint in metrics.json for every kind of TABLE_SOURCES (taken when the run
    starts), and only for those."""
    import json

    from transformer_pde.application import runs

    cfg = {"kind": "demo", "name": "d", "params": {"n": 8, "t1": 0.1, "dt": 0.05, "paths": 1}}
    plain = runs.execute(cfg, out_dir=tmp_path, progress=False)
    assert "code_fingerprint" not in json.loads((plain / "metrics.json").read_text())
    monkeypatch.setitem(provenance.TABLE_SOURCES, "demo", ("transformer_pde/application/studies/demo.py",))
    cfg["name"] = "e"
    published = runs.execute(cfg, out_dir=tmp_path, progress=False)
    recorded = json.loads((published / "metrics.json").read_text())["code_fingerprint"]
    assert recorded == provenance.code_fingerprint("demo") and len(recorded) == 16
    assert provenance.code_fingerprint("demo") != provenance.code_fingerprint("train_digits")


def test_write_section_replaces_only_between_its_comments(tmp_path):
    """The one section writer of the table scripts: the contents between the comments change, nothing else;
    a page without the section, or with the closing comment only before the opening one, is refused."""
    page = tmp_path / "p.md"
    page.write_text("a\n<!-- s -->\nold\n<!-- e -->\nb\n<!-- e -->\n")
    provenance.write_section(page, "<!-- s -->", "<!-- e -->", "new\n")
    assert page.read_text() == "a\n<!-- s -->\nnew\n<!-- e -->\nb\n<!-- e -->\n"
    for text in ("no markers\n", "<!-- e -->\n<!-- s -->\n"):
        page.write_text(text)
        with pytest.raises(ValueError, match="section to replace"):
            provenance.write_section(page, "<!-- s -->", "<!-- e -->", "x\n")
        assert page.read_text() == text
