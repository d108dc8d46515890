"""The noisy_transition study end to end on a tiny configuration: claims a program can read (value, error, seeds,
reference, verdict), the stationary mean-field references of the hysteresis loop, and figures whose titles do
not overlap (docs/noisy_tokens.md)."""

import json
import math

import numpy as np
import pytest

import transformer_pde as tp
from transformer_pde.application.studies.claims import bootstrap_interval, claim, ensemble, render_table

SMALL = ["ns=[60]", "ns_high_d=[40]", "dims=[2]", "ratios=[0.5, 2.0]", "paths=8", "t1=2.0", "sus_n=60",
         "sus_ratios=[2.0]", "sus_t1=2.0", "sus_paths=8", "rate_n=200", "rate_t1=0.5", "rate_paths=8",
         "hyst_ratios=[0.9, 1.05, 1.3]", "hyst_ns=[30]", "hyst_paths=2", "hyst_stage_min=0.5",
         "hyst_stage_max=0.5", "hyst_dt=0.1", "weights_n=50", "weights_paths=2", "weights_t1=2.0", "eulerian=false"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from transformer_pde.application.cli import main as cli_main

    out = tmp_path_factory.mktemp("noisy")
    args = ["run", "experiments/noisy_transition_quick.toml", "--out", str(out), "--name", "n", "--no-progress", "-qq"]
    for o in SMALL:
        args += ["--override", o]
    assert cli_main(args) == 0
    return out / "n", json.loads((out / "n" / "metrics.json").read_text())


def test_study_writes_claims_with_error_bars(tiny_run):
    """Every quoted number is a claim with its error and seed count; the β = 4 spinodal on S¹ is among them and
    equals the continuation's fold (1.0589, independent of the stage lengths); the control (β = 1) is compared
    with a stationary mean-field loop of area 0."""
    path, m = tiny_run
    claims = m["claims"]
    for c in claims:
        assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
        assert c["seeds"] >= 2 or c["error"] is not None and c["seeds"] == 0, c  # 0 seeds: deterministic
    sp = [c for c in claims if "spinodal" in c["name"] and "S^1" in c["name"]]
    assert len(sp) == 1 and 1.058 < sp[0]["value"] < 1.06 and sp[0]["error"] < 1e-8
    ctrl = [c for c in claims if "loop area, beta=1," in c["name"]]
    assert len(ctrl) == 1 and ctrl[0]["reference"] == 0.0
    rates = [c for c in claims if "growth rate" in c["name"]]
    assert len(rates) == 2 and all(c["error"] > 0 and c["seeds"] == 8 for c in rates)
    h = m["hysteresis_beta4_n30"]
    assert h["first_order"] and not m["hysteresis_beta1_n30"]["first_order"] and len(h["up"]) == 3
    assert h["area"] == pytest.approx(np.trapezoid(np.subtract(h["up"], h["down"]), h["ratios"]), rel=1e-9, abs=1e-12)
    # the stationary mean-field loop: clustered up to the spinodal (1.05 < 1.0589), uniform above it
    assert h["mean_field_up"][1] > 0.5 and h["mean_field_up"][2] == 0.0 and h["mean_field_down"][1] == 0.0
    for name in ("abs_m", "susceptibility_rates", "hysteresis", "weights"):
        assert (path / "figures" / f"{name}.png").exists() and name in m["figure_captions"]


class _Keep:
    """A stand-in run directory that keeps the figure instead of writing it."""

    def save_figure(self, fig, name):
        self.fig = fig


def _loop_record(beta, ratios):
    """A hysteresis record as the study writes it, with the stationary mean-field loop as the 'measured' sweeps."""
    from transformer_pde.analysis.theory import continuation as tc

    lp = tc.mean_field_loop(beta, 2, ratios, modes=24, steps=60)
    z = [0.01] * len(ratios)
    return {"ratios": ratios, "up": lp["up"], "down": lp["down"], "up_stderr": z, "down_stderr": z,
            "mean_field_up": lp["up"], "mean_field_down": lp["down"], "first_order": lp["spinodal"]["first_order"],
            "spinodal": lp["spinodal"], "area": lp["area_stages"], "area_stderr": 0.01,
            "area_mean_field": lp["area_stages"], "area_finite_stage": lp["area_stages"]}


def test_hysteresis_figure_titles_and_labels_do_not_overlap():
    """The panels' titles and axis labels have disjoint extents on the canvas (the quick figure's two long titles
    used to overlap); labels use mathtext ($T/T_c$).  The check itself is shown to fail on two narrow panels
    carrying the old long titles."""
    from transformer_pde.application.studies.noisy_hysteresis import hysteresis_figure

    ratios = [0.9, 1.05, 1.3]
    hyst = {(1.0, 30): _loop_record(1.0, ratios), (4.0, 30): _loop_record(4.0, ratios),
            (4.0, 60): _loop_record(4.0, ratios)}
    p = {"hyst_paths": 2, "hyst_dt": 0.1, "hyst_efolds": 2.0, "hyst_stage_min": 0.5, "hyst_stage_max": 0.5}
    keep = _Keep()
    hysteresis_figure(p, hyst, keep, {})
    texts = _texts(keep.fig)
    assert not _overlapping(texts)
    assert any("$T/T_c$" == s for s, _ in texts)
    from transformer_pde.application.studies import subplots
    fig, axs = subplots(1, 2, (10, 3.8))
    for ax, b in zip(axs, (1, 4)):
        ax.set_title(f"unnormalised, S¹, β = {b} (first order: True): area 0.1437 ± 0.0203")
    assert _overlapping(_texts(fig))


def _texts(fig):
    r = fig.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(r)) for ax in fig.axes
            for t in (ax.title, ax.xaxis.label, ax.yaxis.label) if t.get_text()]


def _overlapping(texts):
    return [(a[0], b[0]) for i, a in enumerate(texts) for b in texts[i + 1:] if a[1].overlaps(b[1])]


def test_claim_helpers():
    """ensemble: the standard error of the mean; bootstrap_interval: about 1.96 standard errors for a mean of
    Gaussian data; claims turn non-finite numbers into null; the table shows every claim."""
    v, e, k = ensemble([1.0, 2.0, 3.0, 4.0])
    assert v == 2.5 and k == 4 and e == pytest.approx(math.sqrt(5 / 3) / 2, rel=1e-12)
    x = np.random.default_rng(0).normal(size=400)
    mean, half = bootstrap_interval(x, np.mean, resamples=4000, seed=1)
    assert mean == pytest.approx(x.mean()) and half == pytest.approx(1.96 * x.std(ddof=1) / 20, rel=0.1)
    c = claim("a", float("nan"), 0.1, 8, reference=1.0, holds=True)
    assert c["value"] is None and c["holds"] is None  # an undefined value has no verdict
    table = render_table([c, claim("b", 1.0, 0.0, 0, holds=None)])
    assert table.count("\n") == 3 and "| b | 1 ± 0 | 0 | — | — |" in table
    with pytest.raises(ValueError):
        ensemble([])
    assert tp  # the package imports
