"""Energy–dissipation identity along the particle flow (DESIGN §2, issue 3)."""

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import fit_slope

DTS = [0.04, 0.02, 0.01, 0.005]


def _x0():
    return tp.sphere.sample_uniform(12, 3, generator=gen(0), dtype=torch.float64)


def _final_residual(theta, dt, key="residual", **kw):
    tr = tp.simulate(_x0(), theta, t1=1.0, dt=dt, **kw)
    return tr.ledger[key][-1]


@pytest.mark.parametrize("H,normalization", [(1, "softmax"), (4, "effective")])
@pytest.mark.parametrize("method,order", [("euler", 1), ("heun", 2)])
def test_edi_residual_order_oscillating(H, normalization, method, order):
    """Deterministic weights: the residual vanishes at the method's order (trapezoid ledger for heun)."""
    theta = tp.Oscillating(tp.Heads.random(H, 3, generator=gen(1), dtype=torch.float64))
    res = [abs(_final_residual(theta, dt, normalization=normalization, method=method).item()) for dt in DTS]
    assert abs(fit_slope(DTS, res) - order) < 0.25, res


@pytest.mark.parametrize("H,normalization", [(1, "softmax"), (4, "effective")])
@pytest.mark.parametrize("scheme", ["exact", pytest.param("euler", marks=pytest.mark.slow)])
def test_edi_residual_order_ou(H, normalization, scheme):
    """Noisy weights: the Itô ledger is unbiased to O(dt): the mean residual over 200 paths falls like dt.

    (One path's residual falls like dt^{1/2}: the realised quadratic variation of the weights
    is replaced by its expectation, the Itô correction.)  With 200 paths the standard error of
    the mean is ≲ 0.003 against means 0.005 … 0.05, measured on this seed."""
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(H, 3, generator=gen(2), dtype=torch.float64), scheme=scheme)
    means, abs_means = [], []
    for dt in DTS:
        r = _final_residual(theta, dt, normalization=normalization, paths=200, seed=0, diagnostics=True)
        means.append(abs(r.mean().item()))
        abs_means.append(r.abs().mean().item())
    assert abs(fit_slope(DTS, means) - 1) < 0.3, means
    assert 0.3 < fit_slope(DTS, abs_means) < 0.9, abs_means


def test_softmax_multihead_slope_differs_from_dissipation_but_ledger_closes():
    theta = tp.Oscillating(tp.Heads.random(6, 3, generator=gen(3), dtype=torch.float64))
    tr = tp.simulate(_x0(), theta, t1=1.0, dt=0.01, method="heun")
    # 𝒢² ≠ −𝒟 along the run (descent: s = −1): tens of percent apart at H = 6
    gap = (tr.slope + tr.dissipation).abs() / tr.slope.abs()
    assert gap.max() > 0.2
    res = tr.ledger["residual"][-1].abs()
    res_slope = tr.ledger["residual_slope"][-1].abs()
    assert res < 1e-3 * tr.ledger["dE"].abs().max()
    assert res_slope > 20 * res
    # halving dt quarters the 𝒟 residual (heun + trapezoid: order 2) but not the 𝒢² one,
    # which converges to a non-zero limit
    tr2 = tp.simulate(_x0(), theta, t1=1.0, dt=0.005, method="heun")
    assert tr2.ledger["residual"][-1].abs() < 0.35 * res
    assert_close(tr2.ledger["residual_slope"][-1], tr.ledger["residual_slope"][-1], rtol=0.05, atol=0)


def test_ledger_terms_definitions():
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(3, 3, generator=gen(4), dtype=torch.float64))
    tr = tp.simulate(_x0(), theta, t1=0.3, dt=0.01, paths=2, seed=1)
    L = tr.ledger
    assert_close(L["dE"], tr.energy - tr.energy[0])
    assert_close(L["residual"], L["dE"] - L["partial"] - L["dissipation"] - L["martingale"])
    assert_close(L["residual_slope"], L["dE"] - L["partial"] + L["slope"] - L["martingale"])
    # left-point rule with euler: the running integrals are cumulative sums of the recorded series
    assert_close(L["slope"][1:], torch.cumsum(tr.slope[:-1] * 0.01, 0))
    assert_close(L["dissipation"][1:], torch.cumsum(tr.dissipation[:-1] * 0.01, 0))
    assert (L["martingale"][-1] != 0).all()
    # constant heads: no partial, no martingale, and the residual is O(dt)
    const = tp.simulate(_x0(), tp.Heads.random(3, 3, generator=gen(5), dtype=torch.float64), t1=0.3, dt=0.01)
    assert torch.equal(const.ledger["partial"], torch.zeros_like(const.ledger["partial"]))
    assert torch.equal(const.ledger["martingale"], torch.zeros_like(const.ledger["martingale"]))


def test_energy_time_derivative_matches_finite_difference():
    """∂_tE = ⟨∂_A E, Ȧ⟩ against a central difference of E along the closed-form oscillating weights."""
    x = _x0()
    proc = tp.Oscillating(tp.Heads.random(3, 3, generator=gen(6), dtype=torch.float64), phase="per_head")
    t, h = 0.8, 1e-5
    fd = (tp.energy(x, proc.heads_at(t + h)) - tp.energy(x, proc.heads_at(t - h))) / (2 * h)
    got = tp.energy_time_derivative(x, proc.heads_at(t), proc.score_rate(t))
    assert_close(got, fd, rtol=1e-7, atol=1e-9)


def test_ito_correction_matches_second_derivative():
    """Itô term = ½ E[∂²_A E [σ dW_sym, σ dW_sym]]/dt, computed by Monte Carlo over symmetric noises
    with an exact second directional derivative (autograd)."""
    x = _x0()[:5]
    heads = tp.Heads.random(2, 3, generator=gen(7), dtype=torch.float64)
    sigma = 0.7
    zero = torch.zeros_like(heads.score)
    ito = tp.energy_time_derivative(x, heads, zero, sigma=sigma)
    N = 4000
    M = tp.processes.symmetric_noise((N, 2, 3, 3), generator=gen(8), dtype=torch.float64)
    # E(A + ε M) second derivative in ε at 0: (β/2)·Σ ω ∫∫ e^{β⟨x,Ay⟩}⟨x,My⟩² (β = 1)
    S = torch.einsum("id,hde,je->hij", x, heads.score, x)
    xMy = torch.einsum("id,nhde,je->nhij", x, M, x)
    second = 0.5 * (heads.weights[:, None, None] * torch.exp(S) * xMy ** 2).mean((-1, -2)).sum(-1)
    mc = 0.5 * sigma ** 2 * second
    assert_close(ito, mc.mean(), rtol=5 * (mc.std() / mc.mean() / N ** 0.5).item(), atol=0)
