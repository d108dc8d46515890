"""Laws of the head processes against formulas solved independently: the noiseless
Ornstein–Uhlenbeck closed form and rate, and the Gaussian transition law of the noisy oscillating
heads (mean from a scipy ODE with the target written entry by entry in tests/problems.py,
variance from the Itô isometry)."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import integrate, oscillating_target_reference


def test_ou_noiseless_closed_form_and_rate():
    """σ = 0: A(t) = Ā + (A0 − Ā) e^{−κt} and Ȧ(t) = −κ (A0 − Ā) e^{−κt}, against the written
    formula and a central difference of heads_at."""
    A0 = tp.Heads.random(2, 3, generator=gen(3), dtype=torch.float64).score
    Abar = torch.tensor([[1.0, 0.3, 0.0], [0.3, 2.0, -0.5], [0.0, -0.5, 0.5]], dtype=torch.float64)
    kappa = 0.7
    proc = tp.OrnsteinUhlenbeck(tp.Heads(A0), mean=Abar, rate=kappa, sigma=0.0)
    assert proc.closed_form and not proc.noisy
    for t in (0.0, 0.4, 1.3):
        e = math.exp(-kappa * t)
        assert_close(proc.heads_at(t).score_matrix, Abar + (A0 - Abar) * e, rtol=1e-13, atol=1e-14)
        assert_close(proc.score_rate(t), -kappa * (A0 - Abar) * e, rtol=1e-13, atol=1e-14)
        h = 1e-5
        fd = (proc.heads_at(t + h).score_matrix - proc.heads_at(t - h).score_matrix) / (2 * h)
        assert_close(proc.score_rate(t), fd, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("phase", ["shared", "per_head"])
def test_noisy_oscillating_transition_law(phase):
    """σ > 0: A(t) is Gaussian with mean m(t), m' = F(t) − m, m(t0) = A(t0) (scipy ODE with the
    target written entry by entry in problems.py), and entrywise variance σ²(1 − e^{−2(t−t0)})/2 on
    the diagonal, half of it off the diagonal, uncorrelated entries (linear SDE, Itô isometry).

    20000 samples: the mean is checked to 5 standard errors, the variance to 5·√(2/N) relative."""
    H, d, N = 2, 3, 20000
    sigma = 0.9
    A0 = torch.diag(torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64)).expand(H, d, d).clone()
    A0[1, 0, 2] = A0[1, 2, 0] = 1.5
    proc = tp.Oscillating(tp.Heads(A0), phase=phase, sigma=sigma)
    t0, dt, steps = 0.3, 0.35, 2
    A = A0.expand(N, H, d, d).clone()
    g = gen(4)
    for k in range(steps):
        A, noise = proc.step(A, t0 + k * dt, dt, g)
    t1 = t0 + steps * dt
    s = t1 - t0
    v = sigma ** 2 * (1 - math.exp(-2 * s)) / 2
    var = torch.full((d, d), v / 2, dtype=torch.float64)
    var.fill_diagonal_(v)
    for h in range(H):
        rhs = lambda t, y, h=h: (oscillating_target_reference(t, d, h, H, phase == "per_head").ravel() - y)  # noqa: E731
        sol = integrate(lambda t, y: rhs(t + t0, y), A0[h].numpy().ravel(), [0.0, s])
        mean = torch.tensor(sol[:, -1].reshape(d, d))
        se = (var / N).sqrt()
        assert bool(((A[:, h].mean(0) - mean).abs() < 5 * se).all()), (A[:, h].mean(0), mean)
        assert_close(A[:, h].var(0), var, rtol=5 * math.sqrt(2 / N), atol=0)
    torch.testing.assert_close(A, A.transpose(-1, -2))
    c = torch.corrcoef(torch.stack([A[:, 0, 0, 0], A[:, 0, 0, 1], A[:, 1, 1, 2]]))
    assert bool((c - torch.eye(3, dtype=torch.float64)).abs().max() < 5 / math.sqrt(N))
