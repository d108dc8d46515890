"""Ledger-closure matrix (issue 13): {euler, heun, rk4, adaptive} × {softmax, effective,
unnormalized} × {descent, ascent} × {uniform, weighted tokens} × {constant, OU (σ > 0),
oscillating (σ > 0), layerwise constant, layerwise linear}.

The residual dE − ∫∂_sE − ∫𝒟 − M of the energy ledger must vanish as dt → 0 at the order
the ledger actually has.  What that order is, per case (measured, then asserted):

* Euler books its integrals by the left-point rule: order 1.
* heun, rk4 and adaptive book them by the trapezoid rule on the step (record) grid, and the
  tokens are at least second-order accurate, so the ledger is order 2 — not 4 for rk4 or 5
  for dopri5: the quadrature, not the integrator, limits it.
* Layerwise weights are only piecewise smooth in t.  "constant": Θ jumps at the layer
  boundaries; the fixed-step solvers book each jump exactly, but the trapezoid's right end
  point of the step that ends on a boundary uses the densities of the new layer, so heun and
  rk4 close at order 1 only.  "linear": Ȧ jumps at the layer starts (a kink), and the same
  right-end-point evaluation gives order 1 for every method (order 2 on a stretch without a
  kink).  The adaptive ledger does not book the jumps of piecewise-constant weights at all,
  so its residual tends to the sum of the energy jumps: marked xfail(strict) (a reported bug
  in solvers/particle.py; the test turns green when it is fixed).
* Noisy weights (OU, Oscillating with σ > 0) are sampled on the grid and the stages see
  their linear interpolation, so every method is order 1.  With the realised quadratic
  variation booked (quadratic_variation="realised") every single path closes at order 1: we
  fit the slope of the median over paths of |residual| (the median, not the mean: with
  unnormalized ascent and oscillating σ > 0 weights a few paths reach energies ~20 where the
  error constant is large, and the mean of |residual| is those few paths' noise).  With the default expected quadratic
  variation (the Itô correction) the mean over paths is O(dt) and a single path only
  O(dt^{1/2}); where Euler's O(dt) bias dominates the Monte-Carlo error (mean > 4 standard
  errors at the coarsest step) its slope is fitted; otherwise (the trapezoid methods, bias
  ≲ 3e-3 here, and Euler with unnormalized ascent, whose few high-energy paths inflate the
  error) we assert that the mean is zero within 5 standard errors at the finest step.

Tolerances: slopes are least-squares fits over 3 step sizes (factor 2 apart).  The measured
slopes of the deterministic cases lie in [order − 0.1, order + 1.4] (higher when a leading error
term nearly cancels); we assert slope ≥ order − 0.3, or a residual below 2e-4 of the ledger's
scale at every step size (a near-cancelled error constant, seen in a few cases of the slow
product, makes the slope of tiny numbers meaningless).  The pathwise noisy slopes (medians
over 48 paths) measured 1.0–1.35; we assert slope ≥ 0.7.

Everything runs at n = 6 tokens, d = 3, H = 2 heads with ω = 1 per head and β = 1.3, t1 = 0.4,
so a case costs ~1 s (adaptive with noisy weights ~50 s, slow only).  The default run takes a covering
subset in which every level of every factor appears; ``-m slow`` runs the whole product.
"""

import itertools

import numpy as np
import pytest
import torch

import transformer_pde as tp
from conftest import gen
from problems import fit_slope

METHODS = ("euler", "heun", "rk4", "adaptive")
NORMALIZATIONS = ("softmax", "effective", "unnormalized")
DIRECTIONS = ("descent", "ascent")
TOKENS = ("uniform", "weighted")
PROCESSES = ("constant", "ou", "oscillating", "layer_constant", "layer_linear")
NOISY = ("ou", "oscillating")

T1 = 0.4
DTS_DET = (0.025, 0.0125, 0.00625)
DTS_NOISY = (0.05, 0.025, 0.0125)
# layer_constant: the residual changes sign between dt = 0.025 and 0.0125 in some cases (two
# error terms of opposite sign), so its fit starts after the crossing and uses 4 step sizes
DTS_LAYER_CONSTANT = (0.0125, 0.00625, 0.003125, 0.0015625)
PATHS = 48

# Every level of every factor appears at least once, every process with a trapezoid method and
# every normalization ascending; adaptive × noisy weights (~50 s a case: dopri5 restarts at every
# kink of the interpolated path) runs in the slow product only.
DEFAULT = {
    ("euler", "softmax", "descent", "uniform", "constant"),
    ("heun", "effective", "ascent", "weighted", "constant"),
    ("adaptive", "effective", "descent", "weighted", "constant"),
    ("rk4", "unnormalized", "descent", "weighted", "layer_constant"),
    ("heun", "unnormalized", "ascent", "uniform", "layer_constant"),
    ("adaptive", "softmax", "ascent", "uniform", "layer_linear"),
    ("euler", "effective", "ascent", "uniform", "layer_linear"),
    ("euler", "unnormalized", "ascent", "weighted", "ou"),
    ("rk4", "effective", "descent", "uniform", "ou"),
    ("heun", "softmax", "descent", "uniform", "oscillating"),
    ("rk4", "unnormalized", "descent", "weighted", "oscillating"),
}


def asserted_order(method, process):
    if process in NOISY or process == "layer_linear" or method == "euler":
        return 1
    if process == "layer_constant":
        return 1  # heun, rk4: right end point of the step ending on a jump (module docstring)
    return 2  # trapezoid ledger (heun, rk4, adaptive)


def _setup(process, tokens):
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(0), dtype=torch.float64)
    w = None
    if tokens == "weighted":
        w = torch.rand(6, generator=gen(1), dtype=torch.float64) + 0.2
        w = w / w.sum()
    om = torch.ones(2, dtype=torch.float64)
    heads = [tp.Heads.random(2, 3, generator=gen(s), dtype=torch.float64, scale=0.5, beta=1.3, weights=om)
             for s in (2, 3, 4)]
    theta = {
        "constant": lambda: heads[0],
        "ou": lambda: tp.OrnsteinUhlenbeck(heads[0], sigma=1.0),
        "oscillating": lambda: tp.Oscillating(heads[0], sigma=1.0, phase="per_head"),
        # layer boundaries at t = 0.2 and 0.4 = t1, on every grid
        "layer_constant": lambda: tp.Layerwise(heads, "constant", layer_time=0.2),
        "layer_linear": lambda: tp.Layerwise(heads, "linear", layer_time=0.2),
    }[process]()
    return x0, w, theta


def _cases():
    for case in itertools.product(METHODS, NORMALIZATIONS, DIRECTIONS, TOKENS, PROCESSES):
        marks = [] if case in DEFAULT else [pytest.mark.slow]
        if case[0] == "adaptive" and case[4] == "layer_constant":
            marks.append(pytest.mark.xfail(strict=True, reason="the adaptive ledger does not book the jumps of "
                                                                "piecewise-constant weights (solvers/particle.py)"))
        yield pytest.param(*case, marks=marks, id="-".join(case))


@pytest.mark.parametrize("method,normalization,direction,tokens,process", list(_cases()))
def test_ledger_closes_at_the_asserted_order(method, normalization, direction, tokens, process):
    x0, w, theta = _setup(process, tokens)
    order = asserted_order(method, process)
    kw = dict(t1=T1, method=method, normalization=normalization, direction=direction, weights=w)
    if process not in NOISY:
        res, scale = [], 0.0
        dts = DTS_LAYER_CONSTANT if process == "layer_constant" else DTS_DET
        for dt in dts:
            tr = tp.simulate(x0, theta, dt=dt, **kw)
            res.append(abs(tr.ledger["residual"][-1].item()))
            scale = max(scale, tr.ledger["dissipation"].abs().max().item() + tr.ledger["partial"].abs().max().item())
        slope = fit_slope(dts, res)
        # layer_constant with heun / rk4: the O(dt) jump term and an O(dt²) term of opposite sign
        # nearly cancel for unnormalized heads (measured slope 0.62 on the 4 steps): 0.5 there
        tol = 0.5 if process == "layer_constant" else 0.3
        assert slope >= order - tol or max(res) <= 2e-4 * scale, (res, slope, scale)
        return
    # noisy weights: every path closes at order 1 with the realised quadratic variation
    pathwise = []
    for dt in DTS_NOISY:
        tr = tp.simulate(x0, theta, dt=dt, paths=PATHS, seed=0, quadratic_variation="realised", **kw)
        pathwise.append(tr.ledger["residual"][-1].abs().median().item())
    slope = fit_slope(DTS_NOISY, pathwise)
    assert slope >= order - 0.3, (pathwise, slope)
    # expected quadratic variation (the default): unbiased to O(dt) in the mean over paths
    means, ses = [], []
    for dt in DTS_NOISY:
        r = tp.simulate(x0, theta, dt=dt, paths=4 * PATHS, seed=1, **kw).ledger["residual"][-1]
        means.append(r.mean().item())
        ses.append(r.std().item() / r.numel() ** 0.5)
    if method == "euler" and abs(means[0]) > 4 * ses[0]:  # the bias is resolved: fit its order
        assert fit_slope(DTS_NOISY, np.abs(means)) >= order - 0.3, (means, ses)
    else:  # bias below the Monte-Carlo error: the mean is zero within 5 standard errors
        assert abs(means[-1]) <= 5 * ses[-1], (means, ses)
