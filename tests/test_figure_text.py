"""The figures' text as a reader sees it: no two pieces of text overlap (matplotlib reports every text's extent
once the figure is drawn), and no raw TeX (``S^{d-1}``, ``N^{-1/2}``) is left outside mathtext."""

from __future__ import annotations

import itertools
import re

import pytest

from transformer_pde.application import rundir, runs
from transformer_pde.application.rundir import RunDir
from transformer_pde.application.studies import sphere_name

_RAW_TEX = re.compile(r"[\^_]\{|\\[a-zA-Z]+")  # a caret or underscore with braces, or a backslash command


def _texts(fig):
    """(text, its display-space extent) of every text of ``fig`` that a draw shows: visible, not empty, and for
    tick labels only those of the ticks inside the view (matplotlib keeps labels of ticks outside it, undrawn)."""
    from matplotlib.axis import Axis
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = set()
    for axis in fig.findobj(Axis):
        off = not axis.get_visible() or not axis.axes.axison  # an axis switched off draws no tick label
        drawn = set() if off else set(map(id, axis._update_ticks()))  # the ticks it draws (inside its view)
        for tick in axis.get_major_ticks() + axis.get_minor_ticks():
            if id(tick) not in drawn:
                hidden |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and id(t) not in hidden:
            out.append((t, t.get_window_extent(renderer)))
    return out


def overlaps(fig, pad: float = 0.5):
    """The pairs of texts of ``fig`` whose extents overlap by more than ``pad`` pixels each way."""
    bad = []
    for (a, ea), (b, eb) in itertools.combinations(_texts(fig), 2):
        w = min(ea.x1, eb.x1) - max(ea.x0, eb.x0)
        h = min(ea.y1, eb.y1) - max(ea.y0, eb.y0)
        if w > pad and h > pad:
            bad.append((a.get_text()[:60], b.get_text()[:60]))
    return bad


def raw_tex(fig):
    """Texts that hold TeX markup outside $...$ (drawn literally by matplotlib)."""
    found = []
    for t, _ in _texts(fig):
        outside = re.sub(r"(?<!\\)\$.*?(?<!\\)\$", "", t.get_text())
        if _RAW_TEX.search(outside):
            found.append(t.get_text()[:80])
    return found


def test_the_checker_sees_an_overlap_and_raw_tex():
    from transformer_pde.application import plotting

    fig, ax = plotting.subplots(1, 1, (4, 3))
    ax.text(0.5, 0.5, "one label here", transform=ax.transAxes)
    ax.text(0.52, 0.5, "another label", transform=ax.transAxes)
    ax.set_title("tokens on S^{d-1}")
    assert overlaps(fig) and raw_tex(fig) == ["tokens on S^{d-1}"]
    ax.set_title(r"tokens on $S^{d-1}$")
    assert raw_tex(fig) == []


def test_sphere_names_are_plain_text():
    assert [sphere_name(d) for d in (2, 3, 4, 8, 17)] == ["S¹", "S²", "S³", "S⁷", "S¹⁶"]


@pytest.fixture
def figures(monkeypatch):
    """Every figure a run saves, inspected just before it is written."""
    seen = {}
    save = RunDir.save_figure

    def inspect(self, fig, name, *a, **kw):
        seen[name] = (overlaps(fig), raw_tex(fig))
        return save(self, fig, name, *a, **kw)

    monkeypatch.setattr(RunDir, "save_figure", inspect)
    return seen


CASES = {
    "layer_norm_rates": {"schemes": ["post", "pre"], "n": 6, "d": 4, "draws": 4, "t1": 4.0, "dt": 0.1,
                         "fit_high": 0.5},
    "demo": {"n": 12, "t1": 0.2, "dt": 0.05, "paths": 2},
    "ou_vs_oscillating": {"regimes": ["ou", "oscillating"], "heads": [1, 2], "n": 8, "t1": 0.2, "dt": 0.02,
                          "t_avg": 0.1, "paths": 2, "record_every": 1, "bootstrap": 0, "workers": 1},
}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[pytest.mark.slow] if k != "layer_norm_rates" else [])
                                  for k in sorted(CASES)])  # the paper's and the demo's figures take 10-40 s
def test_no_figure_text_overlaps_or_shows_raw_tex(tmp_path, figures, kind):
    runs.execute({"kind": kind, "name": "r", "params": CASES[kind]}, out_dir=tmp_path, progress=False)
    assert figures, "no figure was drawn"
    for name, (bad, tex) in figures.items():
        assert not bad, f"{kind}/{name}: overlapping text {bad}"
        assert not tex, f"{kind}/{name}: raw TeX {tex}"


def test_a_narrow_band_is_printed_with_the_digits_that_show_its_width(tmp_path):
    # post-LN with V = I: near consensus every draw contracts by (1 + dt)^-2 per layer, whatever the scores, so the
    # fitted rates agree to ~1e-4 around -2 ln(1 + dt)/dt; the summary shows two different ends and says why
    # (it printed "90 % band -1.951 … -1.951", a band that looked like a bug)
    import math

    p = {"schemes": ["post"], "n": 6, "d": 4, "draws": 6, "t1": 20.0, "dt": 0.05, "figures": False}
    path = runs.execute({"kind": "layer_norm_rates", "name": "r", "params": p}, out_dir=tmp_path, progress=False)
    m = rundir.RunDir(path).read_json("metrics.json")
    post = m["schemes"]["post"]
    assert post["rate_median"] == pytest.approx(-2 * math.log(1 + 0.05) / 0.05, rel=1e-3)
    assert post["theory_discrete"] == pytest.approx(-2 * math.log(1 + 0.05) / 0.05, rel=1e-12)
    line = next(s for s in m["summary"] if s.startswith("post"))
    if "same in all" not in line:  # a band of some width: its two printed ends differ
        lo, hi = re.search(r"band over 6 draws (\S+) … (\S+?)[ ;]", line).groups()
        assert lo != hi and "hardly depends on the random scores" in line, line
    assert "-1.952 for the map at dt = 0.05" in line
