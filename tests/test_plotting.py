"""transformer_pde.application.plotting: what a reader of each figure is told.

What is checked, and against what:
* snapshot columns are evenly spaced recorded times (against np.linspace and the nearest
  record, computed here), repeats dropped, bad counts refused;
* every data axes has an x and a y label; the legend of every figure lies outside all data
  axes (rendered window extents do not intersect); the caption lies below every axes and
  says what the bands / bars are;
* the energy-balance legend covers every ledger term present in *any* panel (the martingale
  only exists in noisy panels), and panel titles say "one path" or "mean ± std of P paths"
  from the data's shape;
* the slope and scaling figures label a single-path series "one path" (not a mean over
  paths), the scaling figure ticks H at the head counts;
* plot_ledger uses readable labels (never the raw ledger keys), works without residuals
  (causal runs have none) and refuses unknown keys naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest

from transformer_pde.application import plotting

RAW_KEYS = ("dE", "partial", "dissipation", "slope", "martingale", "residual", "residual_slope")


def _renderer(fig):
    return fig.canvas.get_renderer()


def _data_axes(fig):
    return [ax for ax in fig.axes if ax.lines or ax.collections or ax.images]


def _legends(fig):
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def _assert_legends_outside(fig):
    r = _renderer(fig)
    legs = _legends(fig)
    assert legs, "the figure has no legend"
    for leg in legs:
        lb = leg.get_window_extent(r)
        for ax in _data_axes(fig):
            ab = ax.get_window_extent(r)
            assert not lb.overlaps(ab), f"legend {lb} overlaps axes {ax.get_title()!r} {ab}"


def _caption_text(fig):
    texts = [t for t in fig.texts if t.get_gid() == "transformer_pde.caption"]
    assert len(texts) == 1
    return texts[0]


def _assert_caption_below(fig, *needles):
    cap = plotting.figure_caption(fig)
    assert cap is not None
    for n in needles:
        assert n in cap, (n, cap)
    r = _renderer(fig)
    top = _caption_text(fig).get_window_extent(r).y1
    for ax in fig.axes:
        assert top <= ax.get_tightbbox(r).y0 + 1e-6, "the caption overlaps an axes"


def _assert_labelled(fig):
    for ax in _data_axes(fig):
        if ax.name == "3d":
            continue
        assert ax.get_ylabel().strip(), f"axes {ax.get_title()!r} has no y label"
        shares_x = any(o is not ax and ax in o.get_shared_x_axes().get_siblings(o) for o in fig.axes)
        assert ax.get_xlabel().strip() or shares_x, f"axes {ax.get_title()!r} has no x label"


def _ledger(T, P, rng, *, martingale=True, residuals=True):
    led = {k: rng.normal(size=(T, P)).cumsum(0) * 0.01 for k in ("dE", "partial", "dissipation", "slope")}
    if martingale:
        led["martingale"] = rng.normal(size=(T, P)).cumsum(0) * 0.01
    if residuals:
        led["residual"] = rng.normal(size=(T, P)) * 1e-3
        led["residual_slope"] = rng.normal(size=(T, P)) * 1e-3
    return led


# ---------------------------------------------------------------------------- snapshot times
def test_snapshot_indices_are_evenly_spaced_records():
    t = np.arange(121) * 0.05  # 0 .. 6
    idx = plotting.snapshot_indices(t, 5)
    np.testing.assert_allclose(t[idx], np.linspace(0, 6, 5), atol=1e-12)
    tu = np.sort(np.random.default_rng(0).uniform(0, 10, 37))
    idx = plotting.snapshot_indices(tu, 4)
    want = [int(np.argmin(np.abs(tu - s))) for s in np.linspace(tu[0], tu[-1], 4)]
    assert idx == want and idx[0] == 0 and idx[-1] == 36
    assert plotting.snapshot_indices(np.arange(3.0), 10) == [0, 1, 2]  # fewer records: no repeats
    with pytest.raises(ValueError, match="count"):
        plotting.snapshot_indices(t, 0)


def test_sphere_snapshots_columns_and_caption():
    rng = np.random.default_rng(1)
    t = np.arange(121) * 0.05
    x = rng.normal(size=(121, 10, 3))
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    fig = plotting.sphere_snapshots([("a", x), ("b", x)], t, 4, title="demo")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["t = 0", "t = 2", "t = 4", "t = 6"]
    _assert_caption_below(fig, "evenly spaced", "grey")
    with pytest.raises(ValueError, match="shape"):
        plotting.sphere_snapshots([("a", x[:, :, None])], t, 4)


# ---------------------------------------------------------------------------- energy balance
def test_energy_balance_labels_legend_and_caption():
    rng = np.random.default_rng(2)
    t = np.linspace(0, 1, 30)
    panels = [("oscillating, H = 1", _ledger(30, 1, rng, martingale=False)), ("OU, H = 4", _ledger(30, 3, rng))]
    fig = plotting.energy_balance(panels, t, sign=-1.0, ncols=2)
    _assert_labelled(fig)
    _assert_legends_outside(fig)
    labels = [tx.get_text() for tx in fig.legends[0].get_texts()]
    assert labels == [plotting.LEDGER_LABELS[k] for k in RAW_KEYS]  # the martingale of the OU panel included
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["oscillating, H = 1 (one path)", "OU, H = 4 (mean ± std of 3 paths)"]
    _assert_caption_below(fig, "± 1 std over the paths", "single-path")


def test_plot_ledger_readable_labels_and_errors():
    rng = np.random.default_rng(3)
    t = np.linspace(0, 1, 20)
    led = _ledger(20, 4, rng)
    fig = plotting.plot_ledger(t, led, keys=["dE", "partial", "dissipation", "martingale", "residual"],
                               title="demo")
    labels = [tx.get_text() for tx in fig.legends[0].get_texts()]
    assert len(labels) == 5 and not set(labels) & set(RAW_KEYS)
    _assert_labelled(fig)
    _assert_legends_outside(fig)
    _assert_caption_below(fig, "± 1 std")
    causal = {k: led[k] for k in ("dE", "partial", "dissipation")}  # no residuals: not a gradient flow
    fig = plotting.plot_ledger(t, causal)
    assert len(_data_axes(fig)) == 1
    _assert_labelled(fig)
    with pytest.raises(ValueError, match="keys"):
        plotting.plot_ledger(t, led, keys=["energy"])
    with pytest.raises(ValueError, match="keys"):
        plotting.plot_ledger(t, causal, keys=["residual"])


# ---------------------------------------------------------------------------- slope figures
def test_slope_series_says_one_path_and_explains_t_avg():
    rng = np.random.default_rng(4)
    t = np.linspace(0, 3, 40)
    ou = {H: np.exp(rng.normal(size=(40, 5))) / H for H in (1, 4)}
    osc = {H: np.exp(rng.normal(size=(40, 1))) for H in (1, 4)}
    fig = plotting.slope_series([("OU", ou), ("oscillating", osc)], t, t_avg=1.0)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["OU (mean of 5 paths, 16–84 % band)", "oscillating (one path)"]
    labels = [tx.get_text() for tx in fig.legends[0].get_texts()]
    assert labels[:2] == ["H = 1", "H = 4"] and any("time average" in s for s in labels)
    _assert_labelled(fig)
    _assert_legends_outside(fig)
    _assert_caption_below(fig, "16–84 %", "Dotted")


def test_slope_scaling_labels_per_regime_and_ticks_at_heads():
    rng = np.random.default_rng(5)
    heads = [1, 4, 16]
    entries = [
        {"label": "OU", "color": "g", "heads": heads, "per_path": [np.exp(rng.normal(size=4)) / H for H in heads],
         "fit": {"a": 1.0, "b": -1.0, "b_ci": [-1.1, -0.9], "level": 0.95}},
        {"label": "oscillating", "color": "r", "heads": heads, "per_path": [np.array([0.4]) for _ in heads],
         "fit": {"a": 0.4, "b": 0.0}},
    ]
    fig = plotting.slope_scaling(entries, t_avg=2.5)
    labels = [tx.get_text() for tx in fig.axes[0].get_legend().get_texts()]
    assert "OU: mean ± std of 4 paths" in labels and "oscillating: one path" in labels
    assert not any("oscillating: mean" in s for s in labels)
    np.testing.assert_allclose(fig.axes[0].get_xticks(), heads)
    _assert_labelled(fig)
    _assert_legends_outside(fig)
    _assert_caption_below(fig, "error bars", "95 % percentile bootstrap")


def test_finish_figure_moves_legends_out_and_captions():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots(1, 2)
    t = np.linspace(0, 0.02, 50)  # long tick labels (0.0025 …) that used to collide
    for a in ax:
        a.plot(t, t ** 2, label="a")
        a.plot(t, t, label="b")
        a.set_xlabel("t")
        a.set_ylabel("value")
        a.legend(loc="best")
    plotting.finish_figure(fig, "Lines: a and b, one deterministic run (no bands).")
    _assert_legends_outside(fig)
    _assert_caption_below(fig, "no bands")
    assert all(len(a.get_xticks()) <= 7 for a in ax)
