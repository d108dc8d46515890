"""The linear stability theory of the uniform measure for noisy tokens (transformer_pde.analysis.theory.noise).

Oracles: scipy.integrate.quad of the Funk–Hecke integral; the library's own velocity field on a
quadrature grid carrying a perturbed uniform density (an independent computation of the
linearised advection); Gauss–Hermite / periodic averages against quad; the Landau coefficient's
sign change at the Bessel-ratio root.
"""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.special import eval_gegenbauer, iv

import transformer_pde as tp
from transformer_pde.analysis.theory import noise as tn


def _fh_quad(a, d, ell):
    """κ_ℓ(a) by quadrature: ∫_0^π e^{a cos θ} P_ℓ(cos θ) sin^{d−2}θ dθ / ∫_0^π sin^{d−2}θ dθ."""
    if d == 2:
        P = lambda th: math.cos(ell * th)  # noqa: E731
    else:
        al = d / 2 - 1
        P = lambda th: eval_gegenbauer(ell, al, math.cos(th)) / eval_gegenbauer(ell, al, 1.0)  # noqa: E731
    num = quad(lambda th: math.exp(a * math.cos(th)) * P(th) * math.sin(th) ** (d - 2), 0, math.pi, limit=200)[0]
    den = quad(lambda th: math.sin(th) ** (d - 2), 0, math.pi)[0]
    return num / den


@pytest.mark.parametrize("d", [2, 3, 4, 7])
@pytest.mark.parametrize("a", [0.3, 2.0, -3.5, 9.0])
def test_funk_hecke_coefficients_against_quadrature(d, a):
    ells = np.arange(0, 7)
    got = tn.funk_hecke_exponential(a, d, ells)
    want = np.array([_fh_quad(a, d, int(l)) for l in ells])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * math.exp(abs(a)))


def test_funk_hecke_closed_forms():
    # d = 2: I_ℓ(a); d = 3, ℓ = 0: sinh(a)/a; a = 0: δ_{ℓ0}
    np.testing.assert_allclose(tn.funk_hecke_exponential(1.7, 2, np.arange(5)), iv(np.arange(5), 1.7), rtol=1e-12)
    np.testing.assert_allclose(tn.funk_hecke_exponential(1.7, 3, 0), math.sinh(1.7) / 1.7, rtol=1e-12)
    np.testing.assert_allclose(tn.funk_hecke_exponential(0.0, 5, np.arange(3)), [1.0, 0.0, 0.0])


def _grid(d, dtype):
    """Quadrature grid on S^{d−1} (d = 2: uniform angles; d = 3: Gauss–Legendre in z × uniform φ)."""
    if d == 2:
        n = 256
        th = 2 * math.pi * torch.arange(n, dtype=dtype) / n
        return torch.stack([th.cos(), th.sin()], -1), torch.full((n,), 1.0 / n, dtype=dtype)
    z, wz = np.polynomial.legendre.leggauss(32)
    nphi = 64
    phi = 2 * np.pi * np.arange(nphi) / nphi
    Z, PHI = np.meshgrid(z, phi, indexing="ij")
    R = np.sqrt(1 - Z ** 2)
    x = np.stack([R * np.cos(PHI), R * np.sin(PHI), Z], -1).reshape(-1, 3)
    w = (wz[:, None] / 2 / nphi * np.ones((1, nphi))).reshape(-1)
    return torch.tensor(x, dtype=dtype), torch.tensor(w, dtype=dtype)


def _zonal(d, ell, t):
    if d == 2:
        return np.cos(ell * np.arccos(np.clip(t, -1, 1)))
    return eval_gegenbauer(ell, d / 2 - 1, t) / eval_gegenbauer(ell, d / 2 - 1, 1.0)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "effective"])
@pytest.mark.parametrize("d", [2, 3])
def test_linearised_field_matches_the_library_velocity(d, normalization):
    """ρ = 1 + ε Y_ℓ on a quadrature grid: tp.velocity equals ε s c_ℓ ∇_S Y_ℓ to O(ε²) (two heads)."""
    dtype = torch.float64
    x, w0 = _grid(d, dtype)
    e = torch.zeros(d, dtype=dtype)
    e[-1 if d == 3 else 0] = 1.0
    t = (x @ e).numpy()
    lambdas, weights, beta = [1.3, 0.6], [0.7, 0.5], 2.5
    heads = tp.Heads.scalar(torch.tensor(lambdas, dtype=dtype), d, beta=beta, weights=torch.tensor(weights, dtype=dtype))
    for ell in (1, 2, 3):
        eps = 1e-5
        Y = torch.tensor(_zonal(d, ell, t), dtype=dtype)
        # ∇_S Y = Y'(t) (e − t x), Y' by a centred difference of the zonal function (interior points)
        h = 1e-6
        tp_, tm_ = np.clip(t + h, -1, 1), np.clip(t - h, -1, 1)
        dY = torch.tensor((_zonal(d, ell, tp_) - _zonal(d, ell, tm_)) / (tp_ - tm_), dtype=dtype)
        grad = dY[:, None] * (e - (x @ e)[:, None] * x)
        for direction, s in (("ascent", 1.0), ("descent", -1.0)):
            vp = tp.velocity(x, heads, w0 * (1 + eps * Y), normalization=normalization, direction=direction)
            vm = tp.velocity(x, heads, w0 * (1 - eps * Y), normalization=normalization, direction=direction)
            lin = (vp - vm) / (2 * eps)
            c = float(tn.mode_coefficients(beta, d, ell, lambdas=lambdas, weights=weights, normalization=normalization))
            torch.testing.assert_close(lin, s * c * grad, rtol=1e-12, atol=2e-6 * max(1.0, abs(c)) * ell ** 2)


def test_rates_thresholds_and_modes():
    # most unstable mode at T = 0 on S¹ (Bruno–Pasqualotto–Agazzi 2025): 3 at β = 5, 4 at β = 7
    assert tn.most_unstable_mode(5.0, 2) == 3
    assert tn.most_unstable_mode(7.0, 2) == 4
    r = tn.mode_growth_rates(5.0, 2, 0.0, 10)
    assert r.shape == (11,) and r.dtype == torch.float64 and float(r[0]) == 0.0
    # the rate formula by hand: ℓ² I_ℓ(5)/(5 I_0(5)) on S¹
    torch.testing.assert_close(r, torch.tensor([l * l * iv(l, 5.0) / (5 * iv(0, 5.0)) for l in range(11)],
                                               dtype=torch.float64), rtol=1e-10, atol=0)
    # at T_c the first mode is marginal and every mode decays above it
    for norm in ("softmax", "unnormalized"):
        for d in (2, 3, 5):
            Tc = tp.theory.critical_temperature(3.0, d, lambdas=(1.0, 0.4), weights=(0.5, 0.5), normalization=norm)
            rc = tn.mode_growth_rates(3.0, d, Tc, 12, lambdas=(1.0, 0.4), weights=(0.5, 0.5), normalization=norm)
            assert abs(float(rc[1])) < 1e-12 and float(rc[2:].max()) < 0
            assert float(tn.mode_growth_rates(3.0, d, 0.99 * Tc, 3, lambdas=(1.0, 0.4), weights=(0.5, 0.5),
                                              normalization=norm)[1]) > 0
    # softmax: the von Mises–Fisher mean resultant length A_d(β)/β; small β: λ/d (noisy Kuramoto on S¹: K/2)
    for d in (2, 3, 6):
        np.testing.assert_allclose(tp.theory.critical_temperature(2.0, d), iv(d / 2, 2.0) / iv(d / 2 - 1, 2.0) / 2.0,
                                   rtol=1e-12)
        np.testing.assert_allclose(tp.theory.critical_temperature(1e-6, d, lambdas=(2.0,)), 2.0 / d, rtol=1e-5)
    # descent with attracting heads: never unstable
    assert tp.theory.critical_temperature(2.0, 3, direction="descent") == 0.0
    assert tn.critical_mode(2.0, 3) == 1


def test_susceptibility_closed_form():
    Tc = tp.theory.critical_temperature(2.0, 3)
    np.testing.assert_allclose(tn.susceptibility(2.0, 3, 2 * Tc), 2.0, rtol=1e-12)
    np.testing.assert_allclose(tn.susceptibility(2.0, 3, 0.3, direction="descent"), 0.3 / (0.3 + Tc), rtol=1e-12)
    with pytest.raises(ValueError, match="unstable"):
        tn.susceptibility(2.0, 3, 0.9 * Tc)


def test_time_averaged_rates_against_quadrature():
    d, T = 3, 0.2
    g = lambda b: float(tn.mode_coefficients(b, d, 1))  # noqa: E731
    mean, sigma, rate = 2.0, 1.5, 1.0
    sd = sigma / math.sqrt(2 * rate)
    want = 2 * (quad(lambda b: g(b) * math.exp(-((b - mean) / sd) ** 2 / 2) / (sd * math.sqrt(2 * math.pi)),
                     mean - 12 * sd, mean + 12 * sd, limit=200)[0] - T)
    np.testing.assert_allclose(tn.ou_averaged_growth_rate(mean, sigma, rate, d, T), want, rtol=1e-8)
    want = 2 * (quad(lambda p: g(2.0 + 1.2 * math.sin(p)), 0, 2 * math.pi)[0] / (2 * math.pi) - T)
    np.testing.assert_allclose(tn.oscillating_averaged_growth_rate(2.0, 1.2, d, T), want, rtol=1e-10)
    # a sampled path: the trapezoid average of a fine periodic sample agrees
    tt = np.linspace(0, 4 * math.pi, 4001)
    np.testing.assert_allclose(tn.averaged_growth_rate(2.0 + 1.2 * np.sin(tt), d, T, times=tt), want, rtol=1e-6)
    # g is even in β (softmax ℓ = 1), finite at β = 0 (= λ/d)
    np.testing.assert_allclose(g(-1.3), g(1.3), rtol=1e-14)
    np.testing.assert_allclose(g(0.0), 1 / 3, rtol=1e-14)


def test_first_order_threshold():
    for d in (2, 3, 4):
        b = tn.first_order_beta(d)
        np.testing.assert_allclose(iv(d / 2 + 1, b) / iv(d / 2, b), 1 / d, rtol=1e-10)
        # the sign change of landau_coefficient is checked against the computed stationary branch (an
        # independent oracle) in tests/test_continuation.py
        # r = c_2/c_1 of the unnormalised coefficients
        c = tn.mode_coefficients(b, d, [1, 2], normalization="unnormalized")
        np.testing.assert_allclose(c[1] / c[0], 1 / d, rtol=1e-10)


def test_bad_input():
    with pytest.raises(ValueError, match="beta"):
        tp.theory.critical_temperature(float("nan"), 3)
    with pytest.raises(ValueError, match="derived for β > 0"):
        tn.landau_coefficient(-1.0, 2)
    with pytest.raises(ValueError, match="d must be"):
        tp.theory.critical_temperature(1.0, 1)
    with pytest.raises(ValueError, match="normalization"):
        tp.theory.critical_temperature(1.0, 3, normalization="relu")
    with pytest.raises(ValueError, match="weights"):
        tp.theory.critical_temperature(1.0, 3, lambdas=(1.0, 2.0), weights=(1.0,))
    with pytest.raises(TypeError, match="lambdas"):
        tp.theory.critical_temperature(1.0, 3, lambdas="x")
    with pytest.raises(ValueError, match="T must"):
        tn.mode_growth_rates(1.0, 3, -0.1)
