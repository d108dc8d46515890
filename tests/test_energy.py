"""transformer_pde.model.energy: E, E_h, log E, δE/δμ, ∂_tE, the Itô term, the quadratic variation and the
overflow contract, against the formulas of docs/model.md#energy.

Every expected value is recomputed here with dense sums over all pairs of tokens, by autograd of the
dense energy or by finite differences, never from the code under test:

    E_h = 1/(2β) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩},      E = Σ_h ω_h E_h,
    m_h(z) = Σ_j w_j e^{β⟨z, A_h x_j⟩},                  δE/δμ(z) = Σ_h ω_h (m_h(z) + m̃_h(z))/(2β),
    ⟨∂_A E, M⟩ by autograd,
    ½ ∂²_A E[N, N] = Σ_h ω_h (β/4) Σ_ij w_i w_j e^{β⟨x_i,A_h x_j⟩} ⟨x_i, N_h x_j⟩².

The parameters are chosen so that slips hide nowhere (several of these tests kill mutants of the
module, docs/MUTATION_REPORT.md): β ≠ 1, a batch of β with TWO batch axes (2, 3) next to H = 2
heads and n = 5 tokens (no two axes of the same length), ω not summing to one and no ω_h equal to 1,
non-uniform token weights, non-symmetric scores and rates."""

import importlib
import math
import re

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy, naive_ito, naive_pairing, random_weights

en = importlib.import_module("transformer_pde.model.energy")  # the module: tp.energy is the function

F64 = torch.float64


# ---------------------------------------------------------------------------- dense helpers (from the formulas)
def dense_log_kernel(x, A, beta):
    """β⟨x_i, A_h x_j⟩, (..., H, n, n), for x (..., n, d), A (..., H, d, d), beta float or (...,)."""
    s = torch.einsum("...id,...hde,...je->...hij", x, A, x)
    b = beta if isinstance(beta, float) else beta[..., None, None, None]
    return b * s


def dense_head_energies(x, A, beta, w):
    """E_h (..., H) = Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩} / (2β)."""
    K = torch.exp(dense_log_kernel(x, A, beta))
    ww = (w.unsqueeze(-1) * w.unsqueeze(-2)).unsqueeze(-3)
    b = beta if isinstance(beta, float) else beta[..., None]
    return (K * ww).sum((-1, -2)) / (2 * b)


def dense_qv(x, A, omega, beta, w, N):
    """½ ∂²_A E[N, N] = Σ_h ω_h (β/4) Σ_ij w_i w_j e^{β⟨x_i,A_h x_j⟩} ⟨x_i, N_h x_j⟩², (...,)."""
    K = torch.exp(dense_log_kernel(x, A, beta))
    Q = torch.einsum("...id,...hde,...je->...hij", x, N, x).square()
    ww = (w.unsqueeze(-1) * w.unsqueeze(-2)).unsqueeze(-3)
    b = beta if isinstance(beta, float) else beta[..., None]
    return (omega * b / 4 * (K * Q * ww).sum((-1, -2))).sum(-1)


def _reported(err):
    """(logarithm, log_scale) printed in an OverflowError of overflow_check."""
    m = re.search(r"its logarithm is up to ([-+0-9.e]+), and minus log_scale = ([-+0-9.e]+)", str(err.value))
    assert m is not None, str(err.value)
    return float(m.group(1)), float(m.group(2))


# ---------------------------------------------------------------------------- defaults of the public helpers
def test_public_helpers_default_to_no_rescaling():
    """scaled_exp, pairing, ito_correction and quadratic_variation called without log_scale return
    the unscaled quantity (the documented default c = 0), and c = 1 divides by e exactly once."""
    t = torch.tensor([-1.5, 0.0, 0.3, 2.0], dtype=F64)
    assert torch.equal(en.scaled_exp(t), torch.exp(t))  # "exactly torch.exp when log_scale == 0"
    # e^{t − 1} vs e^t / e: one rounding each side, so a few ulps
    assert_close(en.scaled_exp(t, 1.0), torch.exp(t) / math.e, rtol=1e-15, atol=0)
    assert_close(en.scaled_exp(t, -2.0), torch.exp(t) * math.e ** 2, rtol=1e-15, atol=0)

    x = tp.sphere.sample_uniform(5, 3, generator=gen(1), dtype=F64)
    om = torch.tensor([0.4, 1.7], dtype=F64)
    A = 0.6 * torch.randn(2, 3, 3, generator=gen(2), dtype=F64)
    A = 0.5 * (A + A.transpose(-1, -2))
    beta = 1.3
    heads = tp.Heads(A, weights=om, beta=beta)
    w = random_weights((5,), 3, 0.1)
    stats = tp.softmax_statistics(x, heads, w, second_moment=True)
    M = torch.randn(2, 3, 3, generator=gen(4), dtype=F64)
    # float64 dense sums over 25 pairs agree to ~1e-14 relative; a wrong default scale is off by a factor e
    assert_close(en.pairing(x, heads, w, stats, M), naive_pairing(x, A, om, beta, w, M), rtol=1e-11, atol=1e-14)
    assert_close(en.ito_correction(heads, w, stats, 0.7), naive_ito(x, A, om, beta, w, 0.7), rtol=1e-11, atol=0)
    N = tp.processes.weights.symmetric_noise(A.shape, generator=gen(5), dtype=F64)
    assert_close(en.quadratic_variation(x, heads, w, stats, N), dense_qv(x, A, om, beta, w, N), rtol=1e-11, atol=0)


# ---------------------------------------------------------------------------- a batch of β with two axes
def _two_axis_batch(symmetric=True):
    """Tokens (2, 3, 5, 3), H = 2 heads shared by the batch, β of shape (2, 3), weights per member."""
    x = tp.sphere.sample_uniform(30, 3, generator=gen(10), dtype=F64).reshape(2, 3, 5, 3)
    A = 0.6 * torch.randn(2, 3, 3, generator=gen(11), dtype=F64)
    if symmetric:
        A = 0.5 * (A + A.transpose(-1, -2))
    om = torch.tensor([0.4, 1.7], dtype=F64)
    beta = torch.tensor([[0.6, 1.3, 2.1], [0.9, 1.7, 0.45]], dtype=F64)
    w = random_weights((2, 3, 5), 12, 0.1)
    return x, A, om, beta, w, tp.Heads(A, weights=om, beta=beta)


def test_energies_and_log_energy_with_a_two_axis_batch_of_beta():
    """E_h, E and log E (with and without token weights) for every member of a (2, 3) batch of β."""
    x, A, om, beta, w, heads = _two_axis_batch()
    Eh = dense_head_energies(x, A, beta, w)  # (2, 3, H)
    # float64, sums of 25 positive terms: relative agreement ~1e-15; log E is O(1), so atol 1e-14
    assert_close(tp.head_energies(x, heads, w), Eh, rtol=1e-12, atol=0)
    assert_close(tp.energy(x, heads, w), (om * Eh).sum(-1), rtol=1e-12, atol=0)
    assert_close(tp.log_energy(x, heads, w), torch.log((om * Eh).sum(-1)), rtol=1e-12, atol=1e-14)
    u = torch.full((2, 3, 5), 0.2, dtype=F64)
    Eu = dense_head_energies(x, A, beta, u)
    assert_close(tp.head_energies(x, heads), Eu, rtol=1e-12, atol=0)
    # log n must be taken in the tokens' dtype: log 5 in float32 is off by 3e-8, far above 1e-12
    assert_close(tp.log_energy(x, heads), torch.log((om * Eu).sum(-1)), rtol=1e-12, atol=1e-14)
    # one member alone, tokens (5, 3) and weights (5,): the weights' axis is counted from the end
    one = tp.Heads(A, weights=om, beta=float(beta[1, 2]))
    assert_close(tp.log_energy(x[1, 2], one, w[1, 2]), torch.log((om * Eh[1, 2]).sum()), rtol=1e-12, atol=1e-14)
    # a one-element β tensor (stored 0-dimensional) is the float β
    h0 = tp.Heads(A, weights=om, beta=torch.tensor([1.3], dtype=F64))
    assert_close(tp.head_energies(x, h0, w), dense_head_energies(x, A, 1.3, w), rtol=1e-12, atol=0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_first_variation_with_a_two_axis_batch_of_beta(symmetric):
    """δE/δμ(z) = Σ_h ω_h/(2β) Σ_j w_j (e^{β⟨z, A_h x_j⟩} + e^{β⟨x_j, A_h z⟩}) at 4 points z per member."""
    x, A, om, beta, w, heads = _two_axis_batch(symmetric)
    z = tp.sphere.sample_uniform(24, 3, generator=gen(13), dtype=F64).reshape(2, 3, 4, 3)
    b4 = beta[..., None, None, None]
    K = torch.exp(b4 * torch.einsum("...zd,hde,...je->...hzj", z, A, x))
    Kt = torch.exp(b4 * torch.einsum("...jd,hde,...ze->...hzj", x, A, z))
    want = (om[:, None] / (2 * beta[..., None, None]) * ((K + Kt) * w.unsqueeze(-2).unsqueeze(-2)).sum(-1)).sum(-2)
    assert_close(tp.first_variation(x, heads, w, at=z), want, rtol=1e-12, atol=0)
    # at the tokens themselves, without weights (uniform 1/5)
    K = torch.exp(dense_log_kernel(x, A, beta))
    want_x = (om[:, None] / (2 * beta[..., None, None]) * ((K + K.transpose(-1, -2)) * 0.2).sum(-1)).sum(-2)
    assert_close(tp.first_variation(x, heads), want_x, rtol=1e-12, atol=0)


def test_ito_and_quadratic_variation_with_a_two_axis_batch_of_beta():
    """The Itô term (via ∂_tE with zero rate) and the realised quadratic variation per member of a
    (2, 3) batch of β, against the dense double sums."""
    x, A, om, beta, w, heads = _two_axis_batch()
    sigma = 0.8
    zero = torch.zeros(2, 3, 3, dtype=F64)
    ito = tp.energy_time_derivative(x, heads, zero, w, sigma=sigma)
    ref = torch.stack([torch.stack([naive_ito(x[a, b], A, om, float(beta[a, b]), w[a, b], sigma) for b in range(3)])
                       for a in range(2)])
    assert_close(ito, ref, rtol=1e-11, atol=0)
    stats = tp.softmax_statistics(x, heads, w, second_moment=True)
    assert_close(en.ito_correction(heads, w, stats, sigma, log_scale=0.5), ref * math.exp(-0.5), rtol=1e-11, atol=0)
    N = tp.processes.weights.symmetric_noise((2, 3, 2, 3, 3), generator=gen(14), dtype=F64)
    got = en.quadratic_variation(x, heads, w, stats, N)
    assert_close(got, dense_qv(x, A, om, beta, w, N), rtol=1e-11, atol=0)
    # a batch of β with one axis (size 2 ≠ H = 3 ≠ n = 5) and no token weights
    x1 = x[:, 0]
    A3 = 0.6 * torch.randn(3, 3, 3, generator=gen(15), dtype=F64)
    A3 = 0.5 * (A3 + A3.transpose(-1, -2))
    om3 = torch.tensor([0.4, 1.7, 2.5], dtype=F64)
    b1 = torch.tensor([0.7, 1.9], dtype=F64)
    h1 = tp.Heads(A3, weights=om3, beta=b1)
    N1 = tp.processes.weights.symmetric_noise((2, 3, 3, 3), generator=gen(16), dtype=F64)
    st1 = tp.softmax_statistics(x1, h1, None)
    u = torch.full((2, 5), 0.2, dtype=F64)
    assert_close(en.quadratic_variation(x1, h1, None, st1, N1), dense_qv(x1, A3, om3, b1, u, N1), rtol=1e-11, atol=0)


# ---------------------------------------------------------------------------- the Itô term and the pairing with non-symmetric scores
def test_energy_time_derivative_at_unit_sigma():
    """σ = 1.0 exactly (a float): the Itô term σ²β/8 Σ ω Σ w w e^{β⟨x,Ax⟩}(1 + ⟨x_i, x_j⟩²) is added."""
    from problems import naive_ito

    x = tp.sphere.sample_uniform(6, 3, generator=gen(17), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(18), dtype=F64, beta=1.3)
    got = tp.energy_time_derivative(x, heads, torch.zeros(2, 3, 3, dtype=F64), sigma=1.0)
    want = naive_ito(x, heads.score, heads.weights, 1.3, torch.full((6,), 1 / 6, dtype=F64), 1.0)
    assert float(want) > 0
    assert_close(got, want, rtol=1e-11, atol=0)


def test_time_derivative_with_non_symmetric_scores_and_rate():
    """⟨∂_A E, Ȧ⟩ against autograd of the dense energy when neither A nor Ȧ is symmetric (for a
    symmetric A or Ȧ, ⟨T, Ȧ⟩ = ⟨Tᵀ, Ȧ⟩ and a transposition slip is invisible)."""
    x = tp.sphere.sample_uniform(5, 3, generator=gen(20), dtype=F64)
    A = 0.6 * torch.randn(2, 3, 3, generator=gen(21), dtype=F64)
    om = torch.tensor([0.4, 1.7], dtype=F64)
    heads = tp.Heads(A, weights=om, beta=1.3)
    assert not heads.is_symmetric
    w = random_weights((5,), 22, 0.1)
    rate = torch.randn(2, 3, 3, generator=gen(23), dtype=F64)
    want = naive_pairing(x, A, om, 1.3, w, rate)
    assert_close(tp.energy_time_derivative(x, heads, rate, w), want, rtol=1e-11, atol=1e-14)
    assert_close(tp.energy_time_derivative(x, heads, rate, w, log_scale=2.0), want * math.exp(-2.0),
                 rtol=1e-11, atol=1e-14)


# ---------------------------------------------------------------------------- log_scale: validation, choose_log_scale's rule, overflow_check's contract
@pytest.mark.parametrize("bad", [True, "1.0", torch.tensor(1.0)])
def test_log_scale_must_be_a_plain_real_number(bad):
    """A bool, a string or a tensor is refused with TypeError (not silently converted by float())."""
    x = tp.sphere.sample_uniform(4, 3, generator=gen(30), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(31), dtype=F64)
    with pytest.raises(TypeError, match="log_scale must be a float"):
        tp.energy(x, heads, log_scale=bad)


def test_choose_log_scale_rule_at_its_edges():
    """c = 0 for an empty input and whenever L ≤ R/2 (boundary included), else c = ⌈L + R/4⌉,
    R = log(finfo.max); a single entry is a valid input like any other."""
    R = math.log(torch.finfo(F64).max)
    assert en.choose_log_scale(torch.empty(0, dtype=F64)) == 0.0
    assert en.choose_log_scale(torch.empty(2, 0, dtype=F64)) == 0.0
    half = torch.tensor([R / 2], dtype=F64)  # float(half) == R/2 exactly: float64 holds the double
    assert float(half) == R / 2
    assert en.choose_log_scale(half) == 0.0
    assert en.choose_log_scale(torch.tensor([[1.0, R / 2], [-3.0, 0.0]], dtype=F64)) == 0.0
    above = torch.nextafter(half, torch.tensor(math.inf, dtype=F64))
    for lp in (above, torch.tensor([500.0], dtype=F64), torch.tensor(500.0, dtype=F64)):
        c = en.choose_log_scale(lp)
        L = float(lp.max())
        assert c == int(c) and R / 4 <= c - L < R / 4 + 1, (c, L)  # the integer ⌈L + R/4⌉


def test_overflow_check_refuses_only_an_overflow_of_a_finite_logarithm():
    """overflow_check returns the value when it is finite or when its logarithm (a tensor, a callable
    or None) is not finite — bad input, nothing to rescale — and raises OverflowError reporting the
    logarithm otherwise, whether the logarithm is given as a tensor or a callable."""
    inf = torch.tensor([1.0, math.inf], dtype=torch.float32)
    for lv in (None, torch.tensor([0.0, math.inf]), lambda: torch.tensor([math.nan, 1.0]), lambda: None):
        assert en.overflow_check(inf, "q", lv, 0.0, "fix") is inf
    for lv in (torch.tensor([0.0, 123.5]), lambda: torch.tensor([0.0, 123.5])):
        with pytest.raises(OverflowError, match=r"^q overflows torch\.float32: its logarithm is up to 123\.5,") as err:
            en.overflow_check(inf, "q", lv, 2.0, "the fix")
        assert _reported(err) == (123.5, 2.0)
        assert str(err.value).endswith("the fix")
    # the public path that passes a tensor logarithm: tp.mobility in float32 at β = 150
    x = tp.sphere.sample_uniform(4, 3, generator=gen(40), dtype=F64)
    heads = tp.Heads(torch.eye(3, dtype=F64).expand(2, 3, 3).clone(), beta=150.0)
    lm = 150.0 * (x @ x.T)  # log m_h(x_i) ≥ 150 + log(1/4): the diagonal term alone
    want = float(torch.logsumexp(lm - math.log(4), -1).max())
    with pytest.raises(OverflowError, match=r"^the per-head mobility m_h overflows torch\.float32") as err:
        tp.mobility(x.float(), heads.to(torch.float32))
    got, _ = _reported(err)
    assert abs(got - want) <= 1e-4 * want  # float32 log-sum-exp of O(150) exponents: ~1e-5 relative


# ---------------------------------------------------------------------------- the overflow errors' reported logarithm
def _overflow_case(kind):
    """Float64 tokens, scores, ω and β large enough that the float32 kernel overflows."""
    if kind == "two_axis":
        x, A, om, beta, w, _ = _two_axis_batch()
        beta = 90.0 * beta + 60.0  # β ∈ [100, 250]
        A = A + torch.eye(3, dtype=F64)
    else:
        x = tp.sphere.sample_uniform(6, 3, generator=gen(50), dtype=F64)
        A = 0.3 * torch.randn(3, 3, 3, generator=gen(51), dtype=F64)
        A = 0.5 * (A + A.transpose(-1, -2)) + torch.eye(3, dtype=F64)
        om = torch.tensor([0.5, 2.0, 3.0], dtype=F64)  # no ω_h = 1: a sign slip on log ω shows
        if kind.startswith("one_axis"):
            x = torch.stack([x, x.flip(0)])
            beta = torch.tensor([120.0, 150.0], dtype=F64)
            w = random_weights((2, 6), 52, 0.1) if kind == "one_axis" else None
        else:
            beta = 130.0
            w = None
    return x, A, om, beta, w


def _dense_logs(x, A, om, beta, w, z=None):
    """float64 log m_h(z) (against the tokens), max_h log E_h, log E (per member), from the kernel's logs."""
    n = x.shape[-2]
    lw = torch.full(x.shape[:-1], -math.log(n), dtype=F64) if w is None else torch.log(w)
    lK = dense_log_kernel(x, A, beta)  # (..., H, n, n)
    log_m = torch.logsumexp(lK + lw.unsqueeze(-2).unsqueeze(-3), -1)  # (..., H, n)
    b = torch.as_tensor(beta, dtype=F64)
    b = b.unsqueeze(-1) if b.dim() else b
    log_Eh = torch.logsumexp(log_m + lw.unsqueeze(-2), -1) - torch.log(2 * b)
    log_E = torch.logsumexp(log_Eh + torch.log(om), -1)
    return log_m, log_Eh, log_E


@pytest.mark.parametrize("kind", ["unbatched", "one_axis", "one_axis_uniform", "two_axis"])
def test_overflow_errors_name_the_quantity_and_report_its_dense_logarithm(kind):
    """E, E_h, δE/δμ and ∂_tE in float32 at β ≥ 100: OverflowError whose message starts with the
    quantity's name, ends with the fix, and reports the float64 dense logarithm (log E,
    max_h log E_h, max log m_h) to 1e-4 relative (float32 log-sum-exps of exponents ~ 10², printed
    to 6 digits); without token weights (n = 6 ≠ H = 3), with a batch of β with and without
    weights per member, and with a (2, 3) batch of β."""
    x, A, om, beta, w = _overflow_case(kind)
    log_m, log_Eh, log_E = _dense_logs(x, A, om, beta, w)
    heads = tp.Heads(A, weights=om, beta=beta).to(torch.float32)
    x32 = x.float()
    w32 = None if w is None else w.float()
    rate = torch.randn(A.shape, generator=gen(53), dtype=torch.float32)
    cases = [
        (lambda: tp.energy(x32, heads, w32), "the energy E", en._ENERGY_FIX, log_E.max()),
        (lambda: tp.head_energies(x32, heads, w32), "the head energy E_h", en._ENERGY_FIX, log_Eh.max()),
        (lambda: tp.first_variation(x32, heads, w32), "the first variation δE/δμ",
         "Pass log_scale=c (the result is δE/δμ·e^(−c))", log_m.max()),
        (lambda: tp.energy_time_derivative(x32, heads, rate, w32), "∂_tE",
         "Pass log_scale=c (the result is ∂_tE·e^(−c))", log_m.max()),
    ]
    for fn, what, fix, want in cases:
        with pytest.raises(OverflowError, match="^" + re.escape(what) + r" overflows torch\.float32: ") as err:
            fn()
        msg = str(err.value)
        assert msg.endswith(fix) or fix in msg, (what, msg)
        got, scale = _reported(err)
        assert scale == 0.0
        assert abs(got - float(want)) <= 1e-4 * abs(float(want)), (what, got, float(want))


# ---------------------------------------------------------------------------- E, δE/δμ and ∂_tE by independent routes
def _random_problem(dtype, seed, H=3, n=7, d=4, symmetric=False):
    x = tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=torch.float64)
    A = 0.5 * torch.randn(H, d, d, generator=gen(seed + 1), dtype=torch.float64)
    if symmetric:
        A = 0.5 * (A + A.transpose(-1, -2))
    om = torch.rand(H, generator=gen(seed + 2), dtype=torch.float64) + 0.3
    w = random_weights((n,), seed + 3, 0.2)
    heads = tp.Heads(A, weights=om, beta=1.4).to(dtype)
    return x, A, om, w, heads


def test_energy_and_head_energies_against_the_double_sum(dtype):
    """E = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩} (problems.naive_energy, float64) in both dtypes;
    E_h sums to E with the weights ω; log E is its logarithm.  Tolerance: sums of n² = 49 terms of O(1)
    in the tokens' dtype, 64 u relative."""
    x, A, om, w, heads = _random_problem(dtype, 40)
    want = naive_energy(x, A, om, 1.4, w)
    tol = 64 * torch.finfo(dtype).eps
    got = tp.energy(x.to(dtype), heads, w.to(dtype))
    assert got.dtype == dtype
    assert_close(got.double(), want, rtol=tol, atol=0)
    Eh = tp.head_energies(x.to(dtype), heads, w.to(dtype))
    assert_close((om * Eh.double()).sum(-1), want, rtol=tol, atol=0)
    assert_close(tp.log_energy(x.to(dtype), heads, w.to(dtype)).double(), torch.log(want), rtol=0, atol=tol)


@pytest.mark.parametrize("symmetric", [True, False])
def test_first_variation_is_the_derivative_of_the_energy_along_added_mass(symmetric):
    """δE/δμ(z) = d/dε E(μ + ε δ_z) at ε = 0, by autograd of the dense energy with the weight of an
    extra token z (the weights are not renormalised: E is quadratic in μ); at the tokens
    themselves it is ∂E/∂w_i.  Non-symmetric A: both kernels e^{β⟨z,Ay⟩} and e^{β⟨y,Az⟩} matter."""
    x, A, om, w, heads = _random_problem(torch.float64, 50, symmetric=symmetric)
    z = tp.sphere.sample_uniform(3, 4, generator=gen(55), dtype=torch.float64)
    want = []
    for zk in z:
        eps = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        E = naive_energy(torch.cat([x, zk[None]]), A, om, 1.4, torch.cat([w, eps]))
        want.append(torch.autograd.grad(E, eps)[0][0])
    assert_close(tp.first_variation(x, heads, w, at=z), torch.stack(want), rtol=1e-12, atol=0)
    wg = w.clone().requires_grad_(True)
    (dEdw,) = torch.autograd.grad(naive_energy(x, A, om, 1.4, wg), wg)
    assert_close(tp.first_variation(x, heads, w), dEdw, rtol=1e-12, atol=0)


def test_energy_time_derivative_is_the_finite_difference_of_the_energy_along_the_rate():
    """σ = 0: ∂_tE = d/dt E(x, A + t Ȧ) at t = 0, by the central difference [E(A + hȦ) − E(A − hȦ)]/(2h),
    h = 1e-4 (truncation h²/6·E‴ ~ 1e-9 relative, round-off u/h ~ 1e-12), float64."""
    x, A, om, w, heads = _random_problem(torch.float64, 60)
    rate = torch.randn(A.shape, generator=gen(65), dtype=torch.float64)
    h = 1e-4
    fd = (naive_energy(x, A + h * rate, om, 1.4, w) - naive_energy(x, A - h * rate, om, 1.4, w)) / (2 * h)
    got = tp.energy_time_derivative(x, heads, rate, w)
    assert abs(float(got)) > 1e-2
    assert_close(got, fd, rtol=1e-7, atol=0)


def test_ito_term_is_half_sigma_squared_times_the_hessian_traced_with_the_noise_covariance():
    """The Itô term of ∂_tE for dA = σ dW_sym (N = ½(Z + Zᵀ), Cov(N_ab, N_cd) = ½(δ_ac δ_bd + δ_ad δ_bc)):
    σ²/2 Σ_h Σ_abcd Cov_{ab,cd} ∂²E/∂A_ab∂A_cd, with the Hessian of the dense energy by autograd
    (torch.autograd.functional.hessian), against energy_time_derivative with a zero rate."""
    x, A, om, w, heads = _random_problem(torch.float64, 70, H=2, n=5, d=3, symmetric=True)
    sigma = 0.6
    Hs = torch.autograd.functional.hessian(lambda a: naive_energy(x, a, om, 1.4, w), A)  # (H, d, d, H, d, d)
    d = 3
    eye = torch.eye(d, dtype=torch.float64)
    cov = 0.5 * (torch.einsum("ac,bd->abcd", eye, eye) + torch.einsum("ad,bc->abcd", eye, eye))
    want = 0.5 * sigma ** 2 * sum(torch.einsum("abcd,abcd->", cov, Hs[h, :, :, h]) for h in range(2))
    got = tp.energy_time_derivative(x, heads, torch.zeros_like(A), w, sigma=sigma)
    assert float(want) > 0
    assert_close(got, want, rtol=1e-11, atol=0)


def test_check_scale_fits_refuses_scales_past_the_underflow_floor(dtype):
    """floor = log(tiny/eps) of the dtype (−672.3 in float64, −71.4 in float32): a common scale c with
    L − c < floor (L the largest log-partition) is refused, one with L − c above it is not."""
    fi = torch.finfo(dtype)
    floor = math.log(fi.tiny / fi.eps)
    assert -673 < floor < -672 if dtype == torch.float64 else -72 < floor < -71
    for L in (0.0, 37.5):
        lp = torch.tensor([[L - 3.0, L], [L - 1.0, L - 10.0]], dtype=dtype)
        en.check_scale_fits(lp, L - floor - 1.0)  # fits
        en.check_scale_fits(lp, 0.0)
        with pytest.raises(ValueError, match="energy_log_scale = .* is too large for these tokens and heads"):
            en.check_scale_fits(lp, L - floor + 1.0)
        with pytest.raises(ValueError, match="my_scale = "):
            en.check_scale_fits(lp, 1e4, "my_scale")
    # non-finite or empty log-partitions are left to the caller's non-finite report
    en.check_scale_fits(torch.tensor([float("nan")], dtype=dtype), 1e4)
    en.check_scale_fits(torch.empty(0, dtype=dtype), 1e4)
