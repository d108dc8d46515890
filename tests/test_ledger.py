"""Energy–dissipation identity along the particle flow (docs/model.md)."""

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import fit_slope, naive_dissipation, naive_energy, naive_field, naive_ito, naive_pairing, naive_slope

DTS = [0.04, 0.02, 0.01, 0.005]


def _x0():
    return tp.sphere.sample_uniform(12, 3, generator=gen(0), dtype=torch.float64)


def _final_residual(theta, dt, key="residual", **kw):
    tr = tp.simulate(_x0(), theta, t1=1.0, dt=dt, ledger=True, **kw, direction="descent")
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
    tr = tp.simulate(_x0(), theta, t1=1.0, dt=0.01, method="heun", ledger=True, direction="descent")
    # 𝒢² ≠ −𝒟 along the run (descent: s = −1): tens of percent apart at H = 6
    gap = (tr.slope + tr.dissipation).abs() / tr.slope.abs()
    assert gap.max() > 0.2
    res = tr.ledger["residual"][-1].abs()
    res_slope = tr.ledger["residual_slope"][-1].abs()
    assert res < 1e-3 * tr.ledger["dE"].abs().max()
    assert res_slope > 20 * res
    # halving dt quarters the 𝒟 residual (heun + trapezoid: order 2) but not the 𝒢² one,
    # which converges to a non-zero limit
    tr2 = tp.simulate(_x0(), theta, t1=1.0, dt=0.005, method="heun", ledger=True, direction="descent")
    assert tr2.ledger["residual"][-1].abs() < 0.35 * res
    assert_close(tr2.ledger["residual_slope"][-1], tr.ledger["residual_slope"][-1], rtol=0.05, atol=0)


def _noisy_case(method, record_every=1, t1=0.2, dt=0.02):
    """OU weights (κ = 1.2, σ = 0.8, Ā = I) on H = 2 heads with ω = 1 per head and β = 1.3,
    non-uniform token weights, 2 paths; returns (traj, ω, β, w, κ, σ, dt)."""
    om = torch.ones(2, dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(4), dtype=torch.float64, scale=0.5, beta=1.3, weights=om)
    w = torch.rand(12, generator=gen(40), dtype=torch.float64) + 0.2
    w = w / w.sum()
    kappa, sigma = 1.2, 0.8
    proc = tp.OrnsteinUhlenbeck(heads, rate=kappa, sigma=sigma)
    tr = tp.simulate(_x0(), proc, t1=t1, dt=dt, paths=2, seed=1, weights=w, method=method,
                     record_every=record_every, return_path=True, ledger=True, direction="descent")
    return tr, om, 1.3, w, kappa, sigma, dt


def _increments(A, kappa, dt):
    """Drift κ(I − A_k) and martingale increments A_{k+1} − A_k − dt·κ(I − A_k) of the exact OU
    transition, recomputed from the stored scores alone."""
    rate = kappa * (torch.eye(3, dtype=A.dtype) - A)
    return rate, A[1:] - A[:-1] - dt * rate[:-1]


def test_euler_ledger_terms_against_dense_recomputation():
    """Every ledger term of an Euler run with noisy weights, rebuilt from the recorded tokens and
    the stored scores with the dense formulas of problems.py (energy, autograd ∂_A E and ∂_x E,
    harmonic-mean slope, Itô term βσ²/8 Σ ww e^{β⟨x,Ay⟩}(1 + ⟨x,y⟩²)), left-point sums; and the
    token update x_{k+1} = (x_k + dt V_k)/|·| with the dense descent field."""
    tr, om, beta, w, kappa, sigma, dt = _noisy_case("euler")
    x, A = tr.x, tr.path.scores  # (T, paths, n, d), (T, paths, H, d, d)
    rate, noise = _increments(A, kappa, dt)
    kw = dict(normalization="softmax", sign=-1.0)
    E = naive_energy(x, A, om, beta, w)
    Vf, _ = naive_field(x, A, om, beta, w, **kw)
    step = x[:-1] + dt * Vf[:-1]
    assert_close(x[1:], step / step.norm(dim=-1, keepdim=True), rtol=1e-12, atol=1e-13)
    D = naive_dissipation(x, A, om, beta, w, **kw)
    G = naive_slope(x, A, om, beta, w, **kw)
    P = naive_pairing(x, A, om, beta, w, rate) + naive_ito(x, A, om, beta, w, sigma)
    Mk = naive_pairing(x[:-1], A[:-1], om, beta, w, noise)
    cum = lambda v: torch.cat([torch.zeros_like(v[:1]), torch.cumsum(v, 0)])  # noqa: E731
    L = tr.ledger
    tol = dict(rtol=1e-10, atol=1e-12)
    assert_close(L["dE"], E - E[0], **tol)
    assert_close(L["dissipation"], cum(dt * D[:-1]), **tol)
    assert_close(L["slope"], cum(dt * G[:-1]), **tol)
    assert_close(L["partial"], cum(dt * P[:-1]), **tol)
    assert_close(L["martingale"], cum(Mk), **tol)
    assert_close(L["residual"], E - E[0] - cum(dt * (P + D)[:-1]) - cum(Mk), **tol)
    assert_close(L["residual_slope"], E - E[0] - cum(dt * (P - G)[:-1]) - cum(Mk), **tol)
    # constant heads: no partial, no martingale
    const = tp.simulate(_x0(), tp.Heads.random(3, 3, generator=gen(5), dtype=torch.float64), t1=0.3, dt=0.01, ledger=True, direction="descent")
    assert torch.equal(const.ledger["partial"], torch.zeros_like(const.ledger["partial"]))
    assert torch.equal(const.ledger["martingale"], torch.zeros_like(const.ledger["martingale"]))


def test_adaptive_ledger_terms_against_dense_recomputation():
    """The dopri5 ledger (trapezoid on the record grid, Itô term, martingale summed between
    records) rebuilt from the recorded tokens and the stored scores with the dense formulas."""
    tr, om, beta, w, kappa, sigma, dt = _noisy_case("adaptive", record_every=2)
    A_all = tr.path.scores
    rate_all, noise = _increments(A_all, kappa, dt)
    ks = list(range(0, A_all.shape[0], 2))
    x, A, rate = tr.x, A_all[ks], rate_all[ks]
    kw = dict(normalization="softmax", sign=-1.0)
    E = naive_energy(x, A, om, beta, w)
    D = naive_dissipation(x, A, om, beta, w, **kw)
    G = naive_slope(x, A, om, beta, w, **kw)
    P = naive_pairing(x, A, om, beta, w, rate) + naive_ito(x, A, om, beta, w, sigma)
    dn = noise.reshape(len(ks) - 1, 2, *noise.shape[1:]).sum(1)
    Mk = naive_pairing(x[:-1], A[:-1], om, beta, w, dn)
    h = 2 * dt
    cum = lambda v: torch.cat([torch.zeros_like(v[:1]), torch.cumsum(v, 0)])  # noqa: E731
    trap = lambda v: cum(h * 0.5 * (v[1:] + v[:-1]))  # noqa: E731
    L = tr.ledger
    tol = dict(rtol=1e-9, atol=1e-11)
    assert_close(L["dE"], E - E[0], **tol)
    assert_close(L["dissipation"], trap(D), **tol)
    assert_close(L["slope"], trap(G), **tol)
    assert_close(L["partial"], trap(P), **tol)
    assert_close(L["martingale"], cum(Mk), **tol)
    assert_close(L["residual"], E - E[0] - trap(P + D) - cum(Mk), **tol)


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
    M = tp.processes.weights.symmetric_noise((N, 2, 3, 3), generator=gen(8), dtype=torch.float64)
    # E(A + ε M) second derivative in ε at 0: (β/2)·Σ ω ∫∫ e^{β⟨x,Ay⟩}⟨x,My⟩² (β = 1)
    S = torch.einsum("id,hde,je->hij", x, heads.score, x)
    xMy = torch.einsum("id,nhde,je->nhij", x, M, x)
    second = 0.5 * (heads.weights[:, None, None] * torch.exp(S) * xMy ** 2).mean((-1, -2)).sum(-1)
    mc = 0.5 * sigma ** 2 * second
    assert_close(ito, mc.mean(), rtol=5 * (mc.std() / mc.mean() / N ** 0.5).item(), atol=0)
