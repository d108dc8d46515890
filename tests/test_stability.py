"""transformer_pde.analysis.theory.stability: gronwall_factor's trapezoid integral (exact for piecewise-linear
rates, second order for smooth ones, batched), and the refusals of the stability helpers.  The
Lipschitz bounds and the fast-weights coefficients are checked against measured ratios and Monte Carlo
in tests/test_theorems.py."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import fit_slope

st = tp.theory


def test_gronwall_factor_is_exact_for_piecewise_linear_rates():
    """L(t) = 1 + 2t on a non-uniform grid: ∫_0^t L = t + t², exactly what the trapezoid rule gives."""
    t = torch.tensor([0.0, 0.1, 0.35, 0.4, 1.0], dtype=torch.float64)
    L = 1 + 2 * t
    assert_close(st.gronwall_factor(t, L, log=True), t + t ** 2, rtol=1e-15, atol=1e-16)
    assert_close(st.gronwall_factor(t, L), torch.exp(t + t ** 2), rtol=1e-15, atol=0)


def test_gronwall_factor_converges_at_second_order_for_a_smooth_rate():
    """L(t) = 2 + cos 3t: ∫_0^1 L = 2 + sin(3)/3; the trapezoid error ~ h² (fitted slope 2 ± 0.05)."""
    exact = 2 + math.sin(3) / 3
    hs, errs = [], []
    for K in (10, 20, 40, 80):
        t = torch.linspace(0, 1, K + 1, dtype=torch.float64)
        errs.append(abs(float(st.gronwall_factor(t, 2 + torch.cos(3 * t), log=True)[-1]) - exact))
        hs.append(1 / K)
    assert abs(fit_slope(hs, errs) - 2) < 0.05


def test_gronwall_factor_keeps_the_trailing_axes_of_the_rates(dtype):
    t = torch.linspace(0, 2, 5, dtype=torch.float64)
    rates = torch.rand(5, 2, 3, generator=gen(1), dtype=torch.float64).to(dtype)
    out = st.gronwall_factor(t, rates, log=True)
    assert out.shape == (5, 2, 3) and out.dtype == dtype
    for a in range(2):
        for b in range(3):
            want = torch.cat([torch.zeros(1, dtype=torch.float64),
                              torch.cumsum(0.25 * (rates[1:, a, b] + rates[:-1, a, b]).double(), 0)])
            assert_close(out[:, a, b].double(), want, rtol=8 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("times,rates,match", [
    (torch.tensor([0.0, 1.0]), torch.ones(3), r"times must be \(T,\) and rates \(T, \.\.\.\)"),
    (torch.tensor([0.0, 1.0, 1.0]), torch.ones(3), "strictly increasing"),
    (torch.tensor([0.0, 1.0]), torch.tensor([1.0, -0.5]), "rates must be >= 0"),
])
def test_gronwall_factor_refuses_bad_grids(times, rates, match):
    with pytest.raises(ValueError, match=match):
        st.gronwall_factor(times, rates)


def test_fast_weights_coefficients_refuse_batches_and_bad_noise():
    x = tp.sphere.sample_uniform(4, 3, generator=gen(2), dtype=torch.float64)
    heads = tp.Heads.random(1, 3, generator=gen(3), dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be \\(n, d\\) and heads unbatched"):
        st.fast_weights_coefficients(x.expand(2, 4, 3), heads, 0.1)
    with pytest.raises(ValueError, match="value_std"):
        st.fast_weights_coefficients(x, heads, 0.0)
    out = st.fast_weights_coefficients(x, heads, 0.1)
    # C_ij = C_jiᵀ (a covariance of the stacked token noises), and the closed form equals Σ_k g_k g_kᵀ
    C = out["covariance"]
    assert_close(C, C.transpose(0, 1).transpose(-1, -2), rtol=1e-14, atol=1e-16)
    assert_close(C, out["basis_covariance"], rtol=1e-12, atol=1e-14)
