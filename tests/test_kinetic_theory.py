"""The kinetic theory's closed forms (transformer_pde.analysis.theory.kinetic) against independent evaluations:
the Bessel rates against quadrature and scipy, ψ against its power series, the profile against a pure-Python
series (the defining sums, no Bessel function) and against a discretised Volterra equation (no change of
variables, no series), t_crit against the root of the series profile's slope and the paper's numbers."""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.sparse.linalg import expm_multiply
from scipy.optimize import brentq
from scipy.special import iv

import transformer_pde as tp
from transformer_pde.analysis.theory import kinetic as K


# ------------------------------------------------------------------------ independent evaluations
def series_bessel(n, x, terms=300):
    """I_n(x) = Σ_k (x/2)^{2k+n} / (k! (k+n)!), term by term."""
    term = (x / 2) ** n / math.factorial(n)
    parts = []
    for k in range(terms):
        parts.append(term)
        term *= (x * x / 4) / ((k + 1) * (k + n + 1))
    return math.fsum(parts)


def series_psi(c, y, terms=400):
    """ψ_c(y) = Σ_k c^{k+1} y^k / (k! (k+1)!), term by term."""
    total, term = 0.0, c
    for k in range(terms):
        total += term
        term *= c * y / ((k + 1) * (k + 2))
    return total


def series_profile(s, t, beta, lam, M, N):
    """S_t(s) from the defining sums (the Bessel function and ψ as series)."""
    y = math.log(1 / s) if lam == 0 else math.log(math.expm1(lam) / math.expm1(lam * s))
    coef = 1.0 if lam == 0 else lam * math.exp(lam * s) / math.expm1(lam)
    return coef * math.fsum(math.exp(-0.5 * (math.pi * n / M) ** 2) * series_psi(n * n * series_bessel(n, beta) * t, y)
                            for n in range(1, N + 1))


def volterra_green(a, t, lam, sources, cells=1500):
    """G_{at}(1; s) from the linear kinetic equation ∂_t g(σ) = a ∫_0^σ π(σ, σ') g(σ') dσ', π(σ, σ') =
    λ e^{λσ'}/(e^{λσ} − 1), discretised on midpoint cells (a Nyström matrix) and exponentiated: the response at
    σ = 1 to unit mass at the cell of s, without the identity (the δ at s = 1)."""
    h = 1.0 / cells
    sig = (np.arange(cells) + 0.5) * h
    nodes = np.append(sig, 1.0)
    if lam == 0:
        pi = 1.0 / nodes[:, None] * np.ones((1, cells))
    else:
        pi = lam * np.exp(lam * sig)[None, :] / np.expm1(lam * nodes)[:, None]
    P = np.zeros((cells + 1, cells + 1))
    P[:, :cells] = np.where(sig[None, :] < nodes[:, None] - 1e-12, pi * h, 0.0)
    P[np.arange(cells), np.arange(cells)] = 0.5 * (pi * h)[np.arange(cells), np.arange(cells)]  # half cell
    last = np.zeros(cells + 1)
    last[-1] = 1.0
    row = expm_multiply(a * t * P.T, last)  # the last row of exp(a t P)
    cols = np.minimum((np.asarray(sources) / h).astype(int), cells - 1)
    return row[cols] / h  # the identity contributes only at the last node


# ------------------------------------------------------------------------ the pieces
@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("beta", [0.05, 1.0, 3.0, 12.0, 40.0])
def test_mode_rates_against_quadrature_and_scipy(beta):
    a = K.mode_rates(beta, 12).numpy()
    for n in range(1, 13):
        # quadrature of an O(e^β) integrand: its error is absolute, ~1e-13 e^β
        ref = n * n * quad(lambda u: math.exp(beta * math.cos(u)) * math.cos(n * u), 0, math.pi,
                           epsabs=1e-14 * math.exp(beta), epsrel=1e-13, limit=200)[0] / math.pi
        assert a[n - 1] == pytest.approx(ref, rel=1e-10, abs=1e-12 * n * n * math.exp(beta))
        assert a[n - 1] == pytest.approx(n * n * iv(n, beta), rel=1e-12)
    if beta <= 3:  # the small coefficients to full relative precision
        for n in (1, 3, 9):
            assert a[n - 1] == pytest.approx(n * n * series_bessel(n, beta), rel=1e-12)


def test_mode_weights_are_the_gaussian_modes():
    assert K.mode_weights(8.0).shape == (20,) and K.mode_rates(1.0).shape == (20,)  # N = 20 by default
    w = K.mode_weights(8.0, 5).numpy()
    for n in range(1, 6):
        assert w[n - 1] == pytest.approx(math.exp(-(math.pi * n) ** 2 / 128), rel=1e-14)


@pytest.mark.parametrize("c,y", [(0.0, 1.0), (1e-4, 0.3), (0.5, 0.0), (0.5, 1e-9), (0.5, 4.9e-7), (0.5, 5.1e-7),
                                 (1.0, 2.0), (7.0, 3.0), (40.0, 5.0)])
def test_psi_against_its_power_series(c, y):
    """Including both sides of the switch to the three-term series (2√(cy) = 1e-3, c = 0.5, y ≈ 5e-7)."""
    assert K.psi(c, y) == pytest.approx(series_psi(c, y), rel=2e-15 if c * y < 1e-6 else 1e-12, abs=1e-300)


def test_psi_and_the_position_map_vectorised():
    c = torch.tensor([0.1, 1.0, 4.0])
    out = K.psi(c, 2.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.shape == (3,)
    for i in range(3):
        assert float(out[i]) == pytest.approx(series_psi(float(c[i]), 2.0), rel=1e-12)
    Y = K.position_map(np.array([0.1, 0.5, 1.0]), 2.0)
    assert float(Y[-1]) == 0.0
    assert float(Y[0]) == pytest.approx(math.log(math.expm1(2.0) / math.expm1(0.2)), rel=1e-14)
    # λ → 0: Y_λ(s) → log(1/s), continuously
    assert K.position_map(0.3, 1e-7) == pytest.approx(K.position_map(0.3, 0.0), rel=1e-6)


# ------------------------------------------------------------------------ the profile
CASES = [(1.0, 1.0, 8.0), (2.0, 1.0, 8.0), (3.0, 2.0, 4.0), (0.5, 0.0, 8.0), (1.5, 3.0, 20.0)]


@pytest.mark.parametrize("beta,lam,M", CASES)
def test_profile_against_the_defining_series(beta, lam, M):
    s = [0.02, 0.1, 0.37, 0.5, 0.81, 1.0]
    t = [0.0, 0.25, 1.0, 2.5]
    S = K.retrieval_profile(s, t, beta, lam, M, 20)
    assert S.shape == (4, 6)
    for i, tt in enumerate(t):
        for j, ss in enumerate(s):
            assert float(S[i, j]) == pytest.approx(series_profile(ss, tt, beta, lam, M, 20), rel=1e-11, abs=1e-300)
    assert float(S[0].abs().max()) == 0.0  # no response at t = 0 (the δ at s = 1 is not part of S)


@pytest.mark.parametrize("lam", [0.0, 1.0, 3.0])
def test_the_mode_greens_function_solves_the_volterra_equation(lam):
    """λe^{λs}/(e^λ − 1) ψ_{at}(Y_λ(s)) is the response at σ = 1 of the linear kinetic equation: a Nyström
    discretisation (midpoint cells, half weight on the diagonal cell) converges to it at second order in the
    cell size."""
    a, t = 1.3, 1.2
    sources = np.array([0.05, 0.3, 0.6, 0.9])
    err = {}
    for cells in (500, 1000):
        c = (np.minimum((sources * cells).astype(int), cells - 1) + 0.5) / cells
        ref = K._coefficient(c, lam) * K._psi(a * t, K._position_map(c, lam))
        err[cells] = np.abs(volterra_green(a, t, lam, sources, cells) - ref).max() / np.abs(ref).max()
    assert err[1000] < 1e-4
    assert err[1000] < 0.35 * err[500]  # converging at second order, not a coincidence


def test_critical_time_reproduces_the_papers_numbers():
    """λ = 1, M = 8, 20 modes: t_crit = 2.4575, 0.6007, 0.1740 at β = 1, 2, 3 (the paper's data script)."""
    for beta, ref in ((1.0, 2.4575), (2.0, 0.6007), (3.0, 0.1740)):
        assert tp.theory.critical_time(beta, 1.0, 8.0, 20) == pytest.approx(ref, abs=6e-5)


@pytest.mark.parametrize("beta,lam,M,N", [c + (20,) for c in CASES if c[1] > 0] + [(2.0, 1.0, 8.0, 2), (3.0, 0.5, 5.0, 6)])
def test_critical_time_is_where_the_series_profile_turns_at_the_end(beta, lam, M, N):
    """The root in t of the series profile's one-sided slope at s = 1 (finite differences of the defining
    sums, N modes) is t_crit; the closed-form slope agrees with those finite differences."""
    h = 1e-5

    def slope(t):
        return (series_profile(1.0, t, beta, lam, M, N) - series_profile(1.0 - h, t, beta, lam, M, N)) / h

    tc = K.critical_time(beta, lam, M, N)
    root = brentq(slope, 0.2 * tc, 3 * tc, xtol=1e-12)
    assert root == pytest.approx(tc, rel=5e-4)
    for t in (0.5 * tc, tc, 2 * tc):
        assert K.right_end_slope(t, beta, lam, M, N) == pytest.approx(slope(t), rel=2e-3, abs=2e-3 * abs(slope(0.5 * tc)))
    assert K.right_end_slope(0.5 * tc, beta, lam, M, N) > 0 > K.right_end_slope(1.5 * tc, beta, lam, M, N)


def test_the_defaults_are_the_papers_setting():
    """λ = 1, M = 8, 20 modes unless given."""
    for beta in (0.7, 2.0):
        assert K.critical_time(beta) == K.critical_time(beta, 1.0, 8.0, 20)
        assert K.right_end_slope(0.3, beta) == K.right_end_slope(0.3, beta, 1.0, 8.0, 20)
        assert K.retrieval_profile(0.4, 0.3, beta) == K.retrieval_profile(0.4, 0.3, beta, 1.0, 8.0, 20)
    assert K.critical_time(2.0, 1.0, 8.0, 5) != K.critical_time(2.0, 1.0, 8.0, 20)


@pytest.mark.parametrize("beta", [1.0, 2.0, 3.0])
def test_the_u_shape_exists_before_t_crit_and_not_after(beta):
    tc = K.critical_time(beta)
    for t in (0.3 * tc, 0.7 * tc, 0.95 * tc):
        s_star, depth = K.profile_minimum(t, beta)
        assert 0.02 < s_star < 1.0
        ends = K.retrieval_profile([0.02, 1.0], t, beta)
        assert depth < float(ends[1]) and depth <= float(ends[0])
    for t in (1.05 * tc, 2 * tc):
        assert K.profile_minimum(t, beta)[0] == 1.0


def test_the_common_M_mixture_and_its_double_well():
    s = np.linspace(0.02, 0.98, 400)
    mix = K.mixture_profile(s, 1.5, K.DOUBLE_WELL_EXAMPLE)
    manual = sum(c * K.retrieval_profile(s, 1.5, b, l) for c, b, l in K.DOUBLE_WELL_EXAMPLE)
    torch.testing.assert_close(mix, manual, rtol=1e-13, atol=1e-13)
    for j in (0, 150, 399):
        ref = math.fsum(c * series_profile(float(s[j]), 1.5, b, l, 8.0, 20) for c, b, l in K.DOUBLE_WELL_EXAMPLE)
        assert float(mix[j]) == pytest.approx(ref, rel=1e-9)
    d = np.sign(np.diff(mix.numpy()))
    minima = int(((d[:-1] < 0) & (d[1:] > 0)).sum())
    assert minima == 2  # the double well
    one = K.mixture_profile(s, 1.5, [(1.0, 1.0, 1.0)])
    assert int(((np.sign(np.diff(one.numpy()))[:-1] < 0) & (np.sign(np.diff(one.numpy()))[1:] > 0)).sum()) == 1


# ------------------------------------------------------------------------ domains
@pytest.mark.parametrize("call,err,text", [
    (lambda: K.retrieval_profile(0.0, 1.0, 1.0), ValueError, r"\(0, 1\]"),
    (lambda: K.retrieval_profile(1.2, 1.0, 1.0), ValueError, r"\(0, 1\]"),
    (lambda: K.retrieval_profile([0.5, float("nan")], 1.0, 1.0), ValueError, "finite"),
    (lambda: K.retrieval_profile(0.5, -1.0, 1.0), ValueError, "t must be >= 0"),
    (lambda: K.retrieval_profile(0.5, 1.0, 0.0), ValueError, "beta must be > 0"),
    (lambda: K.retrieval_profile(0.5, 1.0, -2.0), ValueError, "beta must be > 0"),
    (lambda: K.retrieval_profile(0.5, 1.0, 1.0, lam=-0.1), ValueError, "lam must be >= 0"),
    (lambda: K.retrieval_profile(0.5, 1.0, 1.0, M=0.0), ValueError, "M must be > 0"),
    (lambda: K.retrieval_profile(0.5, 1.0, 1.0, modes=0), ValueError, "modes must be >= 1"),
    (lambda: K.retrieval_profile(0.5, 1.0, 1.0, modes=2.5), TypeError, "modes must be an int"),
    (lambda: K.retrieval_profile(0.5, 1.0, 1.0, modes=True), TypeError, "modes must be an int"),
    (lambda: K.retrieval_profile("0.5", 1.0, 1.0), TypeError, "s must be"),
    (lambda: K.critical_time("2", 1.0), TypeError, "beta must be a real number"),
    (lambda: K.critical_time(float("inf")), ValueError, "finite"),
    (lambda: K.right_end_slope(1.0, 1.0, lam=0.0), ValueError, "lam > 0"),
    (lambda: K.psi(-1.0, 1.0), ValueError, "c >= 0"),
    (lambda: K.mixture_profile(0.5, 1.0, []), ValueError, "non-empty"),
    (lambda: K.mixture_profile(0.5, 1.0, [(1.0, 2.0)]), ValueError, "triple"),
    (lambda: K.profile_minimum(1.0, 1.0, s_min=0.0), ValueError, "s_min"),
])
def test_arguments_outside_the_domain_are_refused(call, err, text):
    with pytest.raises(err, match=text):
        call()


def test_scalar_and_tensor_inputs():
    assert isinstance(K.retrieval_profile(0.5, 1.0, 1.0), float)
    out = K.retrieval_profile(torch.tensor([0.2, 0.4], dtype=torch.float32), torch.tensor(1.0), 1.0)
    assert isinstance(out, torch.Tensor) and out.shape == (2,) and out.dtype == torch.float64
    assert K.retrieval_profile(0.5, [0.5, 1.0], 1.0).shape == (2,)
    assert K.critical_time(1.0, 0.0) == 0.0  # no decay: no recency peak to lose
