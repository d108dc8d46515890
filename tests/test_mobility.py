"""transformer_pde.model.mobility: the mobilities m_h, b, the metric slope 𝒢², the dissipation 𝒟 and
scaled_diagnostics against the dense formulas of docs/model.md#mobility, and their overflow errors
(several of these tests kill mutants of the module, docs/MUTATION_REPORT.md):

    m_h(x_i) = Σ_j w_j e^{β⟨x_i, A_h x_j⟩},      b(x_i) = (Σ_h ω̄_h / m_h(x_i))^{-1},  ω̄ = ω/Σω,
    𝒢² = Σ_i w_i b(x_i) |v_i|²,                  𝒟 = Σ_i ⟨∂E/∂x_i, v_i⟩ = Σ_i w_i ⟨∇_S δE/δμ(x_i), v_i⟩,

for the field v = V(x_i) of the chosen normalization (or any tangent field given to
scaled_diagnostics), with ∂E/∂x_i by autograd of the dense energy.  For H = 1, for heads of equal
mobility and for normalization="effective", 𝒟 = s·𝒢²; for softmax heads with H > 1 they differ."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy
from transformer_pde.model.mobility import scaled_diagnostics

F64 = torch.float64


# ---------------------------------------------------------------------------- scaled diagnostics
def test_scaled_diagnostics_with_two_batch_axes():
    """scaled_diagnostics for symmetric heads of batch shape (2, 2) (H = 2, d = 3: no axis length
    repeats), β = 1.3, ω = (0.4, 1.5), per-member token weights and an arbitrary tangent field V,
    at c = 0: E, 𝒢², 𝒟 and ∇_S δE/δμ of every member against the dense formulas, with ∇ δE/δμ from
    autograd of the naive energy (∂E/∂x_i = w_i ∇ δE/δμ(x_i))."""
    beta = 1.3
    om = torch.tensor([0.4, 1.5], dtype=F64)
    x = tp.sphere.sample_uniform(2 * 2 * 5, 3, generator=gen(80), dtype=F64).reshape(2, 2, 5, 3)
    A = 0.7 * torch.randn(2, 2, 2, 3, 3, generator=gen(81), dtype=F64)
    A = 0.5 * (A + A.transpose(-1, -2))
    heads = tp.Heads(A, weights=om, beta=beta)
    w = torch.rand(2, 2, 5, generator=gen(82), dtype=F64) + 0.1
    w = w / w.sum(-1, keepdim=True)
    V = torch.randn(2, 2, 5, 3, generator=gen(83), dtype=F64)
    V = V - (V * x).sum(-1, keepdim=True) * x
    stats = tp.softmax_statistics(x, heads, w)
    E, G, D, g = scaled_diagnostics(x, heads, w, V, stats)
    for a in range(2):
        for b in range(2):
            xk, Ak, wk, Vk = x[a, b], A[a, b], w[a, b], V[a, b]
            xr = xk.clone().requires_grad_(True)
            (dEdx,) = torch.autograd.grad(naive_energy(xr, Ak, om, beta, wk), xr)
            grad = dEdx / wk.unsqueeze(-1)
            grad = grad - (grad * xk).sum(-1, keepdim=True) * xk
            m = (torch.exp(beta * torch.einsum("id,hde,je->hij", xk, Ak, xk)) * wk).sum(-1)  # m_h(x_i)
            bmob = 1.0 / ((om / om.sum()).unsqueeze(-1) / m).sum(-2)
            assert_close(E[a, b], naive_energy(xk, Ak, om, beta, wk), rtol=1e-12, atol=0)
            assert_close(g[a, b], grad, rtol=1e-10, atol=1e-13)
            assert_close(G[a, b], (wk * bmob * Vk.square().sum(-1)).sum(), rtol=1e-12, atol=0)
            assert_close(D[a, b], (dEdx * Vk).sum(), rtol=1e-10, atol=1e-13)


def test_scaled_diagnostics_match_evaluate_to_a_few_ulps_for_nearly_symmetric_heads():
    """Heads.symmetric accepts D with |D − Dᵀ| ≤ 1e-10·max|D| and flags the heads symmetric, so
    A_h ≠ A_hᵀ in the last bits.  scaled_diagnostics at c = 0 is documented to give evaluate's
    diagnostics bit for bit for symmetric heads: both must apply the same matrix A_h to ȳ_h
    (A_hᵀ ȳ_h differs here by ~1e-11 relative, far above float64 rounding); asserted here to 8 ulps of
    each quantity's magnitude, whatever the kernels' reduction order (1e-11 relative is ~5·10⁴ ulps).
    Also the dense formula ∇_S δE/δμ(x_i) = P_{x_i} Σ_h ω_h Σ_j w_j e^{β⟨x_i, A_h x_j⟩} A_h x_j, to 1e-13 relative
    (sums of 7 positive terms in float64), β = 1.3, ω = (0.4, 1.5, 0.8), non-uniform token weights."""
    beta = 1.3
    om = torch.tensor([0.4, 1.5, 0.8], dtype=F64)
    x = tp.sphere.sample_uniform(7, 3, generator=gen(100), dtype=F64)
    D0 = torch.randn(3, 3, 3, generator=gen(101), dtype=F64)
    D0 = D0 + D0.transpose(-1, -2)
    skew = torch.randn(3, 3, 3, generator=gen(102), dtype=F64)
    skew = (skew - skew.transpose(-1, -2)) / (skew - skew.transpose(-1, -2)).abs().max()  # max |entry| = 1
    D = D0 + 2e-11 * D0.abs().max() * skew  # |D − Dᵀ| = 4e-11 max|D0|: accepted (< 1e-10 max|D|)
    heads = tp.Heads.symmetric(D, beta=beta, weights=om)
    eps = torch.finfo(F64).eps
    assert heads.is_symmetric and float((D - D.transpose(-1, -2)).abs().max()) > 1e3 * eps * float(D.abs().max())
    w = torch.rand(7, generator=gen(103), dtype=F64) + 0.1
    w = w / w.sum()
    ev = tp.evaluate(x, heads, w)
    E, G, Dm, g = scaled_diagnostics(x, heads, w, ev.velocity, ev.stats)
    for got, ref in ((g, ev.grad_first_variation), (E, ev.energy), (G, ev.slope), (Dm, ev.dissipation)):
        assert_close(got, ref, rtol=8 * eps, atol=8 * eps * float(ref.abs().max()))
    K = torch.exp(beta * torch.einsum("id,hde,je->hij", x, D, x)) * w  # w_j e^{β⟨x_i, A_h x_j⟩}
    u = (om[:, None, None] * torch.einsum("hij,hde,je->hid", K, D, x)).sum(0)
    want = u - (u * x).sum(-1, keepdim=True) * x
    assert_close(g, want, rtol=1e-13, atol=1e-14)
    ut = (om[:, None, None] * torch.einsum("hij,hed,je->hid", K, D, x)).sum(0)  # with A_hᵀ: must differ
    assert (ut - u).abs().max() > 100 * (1e-13 * u.abs().max() + 1e-14)


# ---------------------------------------------------------------------------- overflow messages
_REPORT = r"overflows {dtype}: its logarithm is up to ([-+0-9.e]+), and minus log_scale = ([-+0-9.e]+) that exceeds"


def _reported(err, what, dtype):
    """(log value, log_scale) reported by an OverflowError whose message must START with ``what``."""
    m = re.match(re.escape(what) + " " + _REPORT.format(dtype=re.escape(str(dtype))), str(err.value))
    assert m is not None, str(err.value)
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("c", [0.0, -5.0])
def test_slope_and_dissipation_overflow_errors_name_their_quantity(c):
    """At β‖A‖ where m_h still fits float64 (max log m_h ≈ 707.7 < 709.78) but 𝒢² and 𝒟 do not
    (≈ e^711.7), tp.slope and tp.dissipation raise OverflowError naming their own quantity, with the
    matching hint (the result is 𝒢²·e^(−c) / 𝒟·e^(−c)), and report the largest log m_h — computed
    here densely by log-sum-exp — and the log_scale passed (0: the diagnostics pass; −5: the
    scaled path).  With log_scale = 700 both are finite."""
    th, beta = 0.05, 2.0
    x = torch.tensor([[1.0, 0.0, 0.0], [math.cos(th), math.sin(th), 0.0], [math.cos(th), 0.0, math.sin(th)]],
                     dtype=F64)
    lam = torch.tensor([354.0, 353.7], dtype=F64)  # scores β λ_h cos θ ≈ 707
    A = lam[:, None, None] * torch.eye(3, dtype=F64)
    heads = tp.Heads(A, weights=torch.tensor([0.3, 1.4], dtype=F64), beta=beta)
    w = torch.tensor([0.5, 0.2, 0.3], dtype=F64)
    log_m = torch.logsumexp(beta * torch.einsum("id,hde,je->hij", x, A, x) + torch.log(w), -1)
    cases = [(tp.slope, "the metric slope 𝒢²", "(the result is 𝒢²·e^(−c))"),
             (tp.dissipation, "the dissipation 𝒟", "(the result is 𝒟·e^(−c))")]
    for fn, what, hint in cases:
        with pytest.raises(OverflowError) as err:
            fn(x, heads, w, log_scale=c)
        got, scale = _reported(err, what, F64)
        assert hint in str(err.value)
        assert scale == c
        assert abs(got - float(log_m.max())) <= 6e-4  # printed with 6 significant digits (707.652)
        assert bool(torch.isfinite(fn(x, heads, w, log_scale=700.0)))


def test_mobility_overflow_errors_name_m_and_b():
    """tp.mobility raises OverflowError naming the quantity that overflows, with the log_mobility
    hint and the logarithm reached.
    (1) m_h: float32, β = 130, ‖A_h‖ ≈ 1: max log m_h (dense float64 log-sum-exp) ≈ 130 > 88.7.
    (2) b: b = (Σ_h ω̄_h/m_h)^{-1} ≤ max_h m_h, yet in float32 log b can round one ulp above
    max_h log m_h.  One token x = e₁, two heads with A_h = (L/β)·I, where L is the largest float32
    whose exp is finite: log m_h = L exactly, m_h = e^L is finite, while the computed log b is L + 1 ulp
    for these ω, so only b overflows: the message must name b (not m_h) and report log b ≈ L."""
    x64 = tp.sphere.sample_uniform(6, 3, generator=gen(90), dtype=F64)
    A = 0.3 * torch.randn(3, 3, 3, generator=gen(91), dtype=F64) + torch.eye(3, dtype=F64)
    om = torch.tensor([0.7, 1.6, 1.0], dtype=F64)
    beta = 130.0
    log_m = torch.logsumexp(beta * torch.einsum("id,hde,je->hij", x64, A, x64), -1) - math.log(6)
    heads = tp.Heads(A, weights=om, beta=beta).to(torch.float32)
    with pytest.raises(OverflowError) as err:
        tp.mobility(x64.float(), heads)
    got, scale = _reported(err, "the per-head mobility m_h", torch.float32)
    assert scale == 0.0 and "tp.log_mobility" in str(err.value)
    assert abs(got - float(log_m.max())) <= 1e-4 * float(log_m.max())  # float32 log-partition

    f32 = torch.float32
    L = torch.tensor(math.log(torch.finfo(f32).max), dtype=f32)
    while not bool(torch.isfinite(torch.exp(L))):
        L = torch.nextafter(L, torch.zeros((), dtype=f32))
    beta = 2.0  # L / 2 is exact: β·A_h = L·I
    heads = tp.Heads((L / beta) * torch.eye(3, dtype=f32).expand(2, 3, 3),
                     weights=torch.tensor([0.0008836332126520574, 0.6595015525817871], dtype=f32), beta=beta)
    x = torch.tensor([[1.0, 0.0, 0.0]], dtype=f32)
    lm, lb = tp.log_mobility(x, heads)
    if bool(torch.isfinite(torch.exp(lb)).all()) or not bool(torch.isfinite(torch.exp(lm)).all()):
        pytest.skip("this torch rounds log b to max log m_h: b's overflow is not reached")  # pragma: no cover
    with pytest.raises(OverflowError) as err:
        tp.mobility(x, heads)
    got, scale = _reported(err, "the effective mobility b", f32)
    assert scale == 0.0 and "tp.log_mobility" in str(err.value)
    # log b = L exactly (equal m_h): printed with 6 significant digits
    assert abs(got - float(L)) <= 1e-4


# ---------------------------------------------------------------------------- m, b, 𝒢², 𝒟 against the dense formulas
def _problem(dtype, seed, H=3, n=6, d=3, scale=0.6):
    x = tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=torch.float64)
    A = scale * torch.randn(H, d, d, generator=gen(seed + 1), dtype=torch.float64)
    A = 0.5 * (A + A.transpose(-1, -2))
    om = torch.rand(H, generator=gen(seed + 2), dtype=torch.float64) + 0.3
    w = torch.rand(n, generator=gen(seed + 3), dtype=torch.float64) + 0.2
    w = w / w.sum()
    return x, A, om, w, tp.Heads(A, weights=om, beta=1.6).to(dtype)


def test_mobilities_against_the_dense_formula(dtype):
    """m_h(x_i) = Σ_j w_j e^{β⟨x_i, A_h x_j⟩}, b = (Σ_h ω̄_h/m_h)^{-1} (float64 dense sums), in both dtypes
    (sums of n = 6 positive terms: 16 u relative); log_mobility is their logarithm; the harmonic mean
    b lies between min_h m_h and max_h m_h."""
    x, A, om, w, heads = _problem(dtype, 10)
    m = (torch.exp(1.6 * torch.einsum("id,hde,je->hij", x, A, x)) * w).sum(-1)
    b = 1.0 / ((om / om.sum())[:, None] / m).sum(0)
    tol = 16 * torch.finfo(dtype).eps
    gm, gb = tp.mobility(x.to(dtype), heads, w.to(dtype))
    assert gm.dtype == gb.dtype == dtype and gm.shape == (3, 6) and gb.shape == (6,)
    assert_close(gm.double(), m, rtol=tol, atol=0)
    assert_close(gb.double(), b, rtol=tol, atol=0)
    lm, lb = tp.log_mobility(x.to(dtype), heads, w.to(dtype))
    assert_close(lm.double(), torch.log(m), rtol=0, atol=tol)
    assert_close(lb.double(), torch.log(b), rtol=0, atol=tol)
    assert bool((b >= m.min(0).values * (1 - 1e-12)).all() and (b <= m.max(0).values * (1 + 1e-12)).all())


@pytest.mark.parametrize("normalization", ["softmax", "effective", "unnormalized"])
def test_dissipation_is_the_rate_of_change_of_the_energy_along_the_field(normalization):
    """𝒟 = Σ_i ⟨∂E/∂x_i, v_i⟩ with ∂E/∂x_i by autograd of the dense energy and v = tp.velocity (same
    normalization and direction), and 𝒢² = Σ_i w_i b(x_i)|v_i|² with b from the dense formula."""
    x, A, om, w, heads = _problem(torch.float64, 20)
    for direction in ("ascent", "descent"):
        v = tp.velocity(x, heads, w, normalization=normalization, direction=direction)
        xg = x.clone().requires_grad_(True)
        (dEdx,) = torch.autograd.grad(naive_energy(xg, A, om, 1.6, w), xg)
        m = (torch.exp(1.6 * torch.einsum("id,hde,je->hij", x, A, x)) * w).sum(-1)
        b = 1.0 / ((om / om.sum())[:, None] / m).sum(0)
        D = tp.dissipation(x, heads, w, normalization, direction)
        G = tp.slope(x, heads, w, normalization, direction)
        assert_close(D, (dEdx * v).sum(), rtol=1e-12, atol=1e-14)
        assert_close(G, (w * b * v.square().sum(-1)).sum(), rtol=1e-12, atol=0)


def test_dissipation_equals_signed_slope_where_the_docs_say_and_only_there():
    """𝒟 = s·𝒢² (s = +1 ascent, −1 descent) for one head and for normalization="effective"; for H = 3
    softmax heads of different mobilities they differ (docs/model.md#mobility)."""
    x, A, om, w, heads = _problem(torch.float64, 30)
    one = tp.Heads(A[:1], weights=om[:1], beta=1.6)
    for h, norm in ((one, "softmax"), (heads, "effective")):
        for direction, s in (("ascent", 1.0), ("descent", -1.0)):
            G = tp.slope(x, h, w, norm, direction)
            assert float(G) > 0
            assert_close(tp.dissipation(x, h, w, norm, direction), s * G, rtol=1e-12, atol=0)
    G, D = tp.slope(x, heads, w), tp.dissipation(x, heads, w)
    assert float((D - G).abs()) > 1e-3 * float(G)


def test_log_scale_divides_slope_and_dissipation_by_e_to_the_c(dtype):
    """log_scale = c returns 𝒢²·e^{−c} and 𝒟·e^{−c} (the scaled path) for c ≠ 0: against the unscaled
    values to the dtype's rounding (the scaled path sums other roundings: 64 u)."""
    x, A, om, w, heads = _problem(dtype, 40)
    xd, wd = x.to(dtype), w.to(dtype)
    tol = 64 * torch.finfo(dtype).eps
    for c in (3.0, -2.0):
        assert_close(tp.slope(xd, heads, wd, log_scale=c), tp.slope(xd, heads, wd) * math.exp(-c), rtol=tol, atol=0)
        assert_close(tp.dissipation(xd, heads, wd, log_scale=c), tp.dissipation(xd, heads, wd) * math.exp(-c),
                     rtol=tol, atol=0)
