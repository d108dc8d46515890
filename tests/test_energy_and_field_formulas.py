"""The diagnostics of the flow (mobility, field, energy, metric slope, dissipation, first variation,
∂_tE, the Itô term) against independent dense formulas.

Every expected value here comes from a dense formula written in this file or in
tests/problems.py (einsums over all pairs, no library helper) or from autograd of that naive
energy.  The cases
use β ≠ 1, head weights ω that do not sum to 1 (ω = 1 per head, as
``Heads.from_multihead_attention`` gives) and non-uniform token weights, so that a dropped β,
ω in place of ω/Σω or a uniform-weight shortcut all change the numbers.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from transformer_pde.model.mobility import scaled_diagnostics
from problems import (
    naive_dissipation,
    naive_energy,
    naive_field,
    naive_ito,
    naive_pairing,
    naive_slope,
    tolerances,
)

BETA = 1.7


def _case(H=3, n=7, d=3, seed=0, omega="ones", dtype=torch.float64):
    """Tokens, symmetric tied heads with ω not summing to 1, β = 1.7, non-uniform token weights."""
    x = tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=torch.float64)
    om = torch.ones(H, dtype=torch.float64) if omega == "ones" else torch.linspace(0.3, 1.9, H, dtype=torch.float64)
    heads = tp.Heads.random(H, d, generator=gen(seed + 1), dtype=torch.float64, scale=0.6, beta=BETA, weights=om)
    w = torch.rand(n, generator=gen(seed + 2), dtype=torch.float64) + 0.1
    w = w / w.sum()
    return x.to(dtype), heads.to(dtype), w.to(dtype), om.to(dtype)


_tol = tolerances(f64=(1e-10, 1e-12), f32=(2e-4, 1e-5))


def test_multihead_attention_heads_have_unit_weights():
    """The conversion from torch.nn.MultiheadAttention gives ω_h = 1 (the sum convention), so ω
    does not sum to 1 in practice and every ω̄ = ω/Σω must be normalised explicitly."""
    mha = torch.nn.MultiheadAttention(4, 2, bias=False, dtype=torch.float64)
    heads = tp.Heads.from_multihead_attention(mha)
    assert_close(heads.weights, torch.ones(2, dtype=torch.float64))


# ---------------------------------------------------------------------------- mobility, field, slope, 𝒟
@pytest.mark.parametrize("omega", ["ones", "ramp"])
def test_harmonic_mobility_normalises_head_weights(dtype, omega):
    """b(x_i) = (Σ_h ω̄_h / m_h(x_i))^{-1}, ω̄ = ω/Σω, m_h(x_i) = Σ_j w_j e^{β⟨x_i, A_h x_j⟩}."""
    x, heads, w, om = _case(omega=omega, dtype=dtype)
    m, b = tp.mobility(x, heads, w)
    K = torch.exp(BETA * torch.einsum("id,hde,je->hij", x.double(), heads.score.double(), x.double()))
    m_ref = (K * w.double()).sum(-1)
    b_ref = 1.0 / ((om.double() / om.double().sum())[:, None] / m_ref).sum(0)
    assert_close(m, m_ref.to(dtype), **_tol(dtype))
    assert_close(b, b_ref.to(dtype), **_tol(dtype))
    # the harmonic mean lies between the smallest and the largest head mobility
    assert bool((b >= m.min(0).values * (1 - 1e-6)).all() and (b <= m.max(0).values * (1 + 1e-6)).all())


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "effective"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_field_energy_slope_dissipation_against_dense_formulas(normalization, sign):
    """One kernel pass of tp.evaluate against the dense formulas (field, E, 𝒢² with the
    harmonic-mean mobility, 𝒟 by autograd of the naive energy) at β = 1.7, ω = 1 per head,
    non-uniform token weights."""
    x, heads, w, om = _case()
    ev = tp.evaluate(x, heads, w, normalization=normalization, sign=sign, diagnostics=True)
    A = heads.score
    Vf, _ = naive_field(x, A, om, BETA, w, normalization=normalization, sign=sign)
    assert_close(ev.velocity, Vf, rtol=1e-10, atol=1e-12)
    assert_close(ev.energy, naive_energy(x, A, om, BETA, w), rtol=1e-12, atol=0)
    assert_close(ev.slope, naive_slope(x, A, om, BETA, w, normalization=normalization, sign=sign), rtol=1e-10, atol=1e-14)
    assert_close(ev.dissipation, naive_dissipation(x, A, om, BETA, w, normalization=normalization, sign=sign),
                 rtol=1e-10, atol=1e-14)
    if normalization == "effective":  # gradient flow of E for the harmonic metric: 𝒟 = s 𝒢²
        assert_close(ev.dissipation, sign * ev.slope, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("normalization,direction", [("softmax", "descent"), ("effective", "ascent")])
def test_slope_and_dissipation_at_a_log_scale_against_dense_formulas(normalization, direction):
    """tp.slope / tp.dissipation with log_scale=c (the scaled path the large-β runs use) are the
    dense 𝒢², 𝒟 times e^{−c}, with non-uniform token weights and ω = 1 per head."""
    x, heads, w, om = _case()
    c = 3.0
    sign = 1.0 if direction == "ascent" else -1.0
    for fn, naive in ((tp.slope, naive_slope), (tp.dissipation, naive_dissipation)):
        ref = naive(x, heads.score, om, BETA, w, normalization=normalization, sign=sign)
        got = fn(x, heads, w, normalization=normalization, direction=direction, log_scale=c)
        assert_close(got * math.exp(c), ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("c", [None, 1.0])
def test_scaled_diagnostics_against_dense_formulas(symmetric, c):
    """mobility.scaled_diagnostics (what the solvers use at a common scale c and for causal runs):
    E, 𝒢², 𝒟 and ∇_S δE/δμ times e^{−c} against the dense formulas and autograd of the naive
    energy, for a batch of two head sets with different ω per member, β = 1.7, non-uniform token
    weights (different per member) and an arbitrary tangent field V; symmetric and non-symmetric scores; c omitted
    (the default 0) and c = 1."""
    x = tp.sphere.sample_uniform(7, 3, generator=gen(20), dtype=torch.float64).expand(2, 7, 3).clone()
    x[1] = x[1].flip(0)
    A = 0.6 * torch.randn(2, 3, 3, 3, generator=gen(21), dtype=torch.float64)
    if symmetric:
        A = 0.5 * (A + A.transpose(-1, -2))
    om = torch.tensor([[1.0, 1.0, 1.0], [0.3, 1.1, 1.9]], dtype=torch.float64)
    heads = tp.Heads(A, weights=om, beta=BETA)
    w = torch.rand(2, 7, generator=gen(22), dtype=torch.float64) + 0.1  # token weights per batch member
    w = w / w.sum(-1, keepdim=True)
    V = torch.randn(2, 7, 3, generator=gen(23), dtype=torch.float64)
    V = V - (V * x).sum(-1, keepdim=True) * x
    stats = tp.softmax_statistics(x, heads, w)
    kw = {} if c is None else {"log_scale": c}
    E, G, D, g = scaled_diagnostics(x, heads, w, V, stats, **kw)
    scale = math.exp(0.0 if c is None else c)
    xr = x.clone().requires_grad_(True)
    (dEdx,) = torch.autograd.grad(naive_energy(xr, A, om, BETA, w).sum(), xr)
    grad = dEdx / w.unsqueeze(-1)  # ∂E/∂x_i = w_i ∇δE/δμ(x_i)
    grad = grad - (grad * x).sum(-1, keepdim=True) * x
    m = (torch.exp(BETA * torch.einsum("bid,bhde,bje->bhij", x, A, x)) * w[:, None, None, :]).sum(-1)  # m_h(x_i)
    b = 1.0 / ((om / om.sum(-1, keepdim=True)).unsqueeze(-1) / m).sum(-2)
    assert_close(E * scale, naive_energy(x, A, om, BETA, w), rtol=1e-12, atol=0)
    assert_close(g * scale, grad, rtol=1e-10, atol=1e-13)
    assert_close(G * scale, (w * b * V.square().sum(-1)).sum(-1), rtol=1e-12, atol=0)
    assert_close(D * scale, (dEdx * V).sum((-1, -2)), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("symmetric", [True, False])
def test_first_variation_and_log_energy_against_dense_formulas(symmetric):
    """δE/δμ(z) = Σ_h ω_h/(2β) Σ_j w_j (e^{β⟨z, A_h x_j⟩} + e^{β⟨x_j, A_h z⟩}) at points z off the
    tokens, and log E, for a batch of two members with their own β, ω and token weights (H = 3 ≠ 2,
    so a β or ω broadcast on the wrong axis fails); symmetric and non-symmetric scores."""
    x = tp.sphere.sample_uniform(7, 3, generator=gen(40), dtype=torch.float64)
    x = torch.stack([x, x.flip(0)])
    z = tp.sphere.sample_uniform(4, 3, generator=gen(41), dtype=torch.float64).expand(2, 4, 3)
    A = 0.6 * torch.randn(2, 3, 3, 3, generator=gen(42), dtype=torch.float64)
    if symmetric:
        A = 0.5 * (A + A.transpose(-1, -2))
    om = torch.tensor([[1.0, 1.0, 1.0], [0.3, 1.1, 1.9]], dtype=torch.float64)
    beta = torch.tensor([0.7, 1.7], dtype=torch.float64)
    w = torch.rand(2, 7, generator=gen(43), dtype=torch.float64) + 0.1
    w = w / w.sum(-1, keepdim=True)
    heads = tp.Heads(A, weights=om, beta=beta)
    b4 = beta[:, None, None, None]
    K = torch.exp(b4 * torch.einsum("bzd,bhde,bje->bhzj", z, A, x))   # e^{β⟨z, A x_j⟩}
    Kt = torch.exp(b4 * torch.einsum("bjd,bhde,bze->bhzj", x, A, z))  # e^{β⟨x_j, A z⟩}
    want = (om[:, :, None] / (2 * beta[:, None, None]) * ((K + Kt) * w[:, None, None, :]).sum(-1)).sum(-2)
    assert_close(tp.first_variation(x, heads, w, at=z), want, rtol=1e-12, atol=0)
    E = torch.stack([naive_energy(x[k], A[k], om[k], float(beta[k]), w[k]) for k in range(2)])
    assert_close(tp.log_energy(x, heads, w), torch.log(E), rtol=1e-12, atol=1e-14)
    Eu = torch.stack([naive_energy(x[k], A[k], om[k], float(beta[k]), torch.full((7,), 1 / 7, dtype=torch.float64))
                      for k in range(2)])
    assert_close(tp.log_energy(x, heads), torch.log(Eu), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batched", [False, True])
def test_realised_quadratic_variation_is_half_the_second_derivative(batched):
    """energy.quadratic_variation = ½ d²/dε² E(A + εΔN) at ε = 0, the second derivative taken by
    autograd of the naive energy; non-uniform token weights, ω = 1 per head, unbatched tokens
    (n ≠ d) or a batch of two members with their own β (H = 3 ≠ 2)."""
    from transformer_pde.model.energy import quadratic_variation

    x, heads, w, om = _case()
    A = heads.score
    dN = tp.processes.weights.symmetric_noise(A.shape, generator=gen(50), dtype=torch.float64)
    beta = BETA
    if batched:
        x, A, dN = torch.stack([x, x.flip(0)]), A.expand(2, *A.shape).clone(), torch.stack([dN, -0.5 * dN])
        beta = torch.tensor([0.7, 1.7], dtype=torch.float64)
        heads = tp.Heads(A, weights=om, beta=beta)
    stats = tp.softmax_statistics(x, heads, w)
    got = quadratic_variation(x, heads, w, stats, dN)

    def second(k):
        xk, Ak, Nk = (x[k], A[k], dN[k]) if batched else (x, A, dN)
        bk = float(beta[k]) if batched else beta
        eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(naive_energy(xk, Ak + eps * Nk, om, bk, w), eps, create_graph=True)
        (h,) = torch.autograd.grad(g, eps)
        return 0.5 * h

    want = torch.stack([second(k) for k in range(2)]) if batched else second(0)
    assert_close(got, want, rtol=1e-11, atol=1e-14)


# ---------------------------------------------------------------------------- ∂_tE and the Itô term
def test_energy_time_derivative_at_beta_and_weights():
    """⟨∂_A E, Ȧ⟩ against autograd of the naive energy; the Itô term against the dense formula."""
    x, heads, w, om = _case()
    rate = tp.processes.weights.symmetric_noise((3, 3, 3), generator=gen(9), dtype=torch.float64)
    got = tp.energy_time_derivative(x, heads, rate, w)
    assert_close(got, naive_pairing(x, heads.score, om, BETA, w, rate), rtol=1e-11, atol=1e-13)
    sigma = 0.8
    zero = torch.zeros_like(rate)
    ito = tp.energy_time_derivative(x, heads, zero, w, sigma=sigma)
    assert_close(ito, naive_ito(x, heads.score, om, BETA, w, sigma), rtol=1e-11, atol=0)
    # per-head σ_h broadcasting against (H,)
    sig_h = torch.tensor([0.2, 0.8, 1.3], dtype=torch.float64)
    ito_h = tp.energy_time_derivative(x, heads, zero, w, sigma=sig_h)
    ref_h = sum(naive_ito(x, heads.score[h:h + 1], om[h:h + 1], BETA, w, float(sig_h[h])) for h in range(3))
    assert_close(ito_h, ref_h, rtol=1e-11, atol=0)


def test_ito_term_is_half_the_expected_hessian():
    """The Itô term equals ½ σ² E[∂²_A E[W_sym, W_sym]] with the exact covariance of W_sym
    (diagonal entries variance 1, off-diagonal ones 1/2), the second derivatives taken by
    autograd (Hessian-vector products) of the naive energy: no Monte Carlo, no closed form."""
    x, heads, w, om = _case(H=2)
    sigma = 0.9
    A = heads.score.detach()
    H, d = A.shape[0], A.shape[-1]
    f = lambda a: naive_energy(x, a, om, BETA, w)  # noqa: E731
    total = torch.zeros((), dtype=torch.float64)
    for h in range(H):
        for i in range(d):
            for j in range(i, d):
                M = torch.zeros_like(A)
                M[h, i, j] = M[h, j, i] = 1.0
                _, hv = torch.autograd.functional.hvp(f, A, M)
                var = 1.0 if i == j else 0.5
                total = total + var * (hv * M).sum()
    expect = 0.5 * sigma ** 2 * total
    got = tp.energy_time_derivative(x, heads, torch.zeros_like(A), w, sigma=sigma)
    assert_close(got, expect, rtol=1e-10, atol=0)


def test_energy_entry_points_with_token_weights_and_tensor_beta():
    """tp.energy and tp.head_energies with token weights and a batch of β (tensor), against the
    dense formula per batch member (a dropped token weight or a β broadcast over the wrong axis changes them)."""
    x, heads, w, om = _case()
    assert_close(tp.energy(x, heads, w), naive_energy(x, heads.score, om, BETA, w), rtol=1e-12, atol=0)
    betas = torch.tensor([0.7, 1.7], dtype=torch.float64)
    A = heads.score.expand(2, *heads.score.shape).clone()
    xb = torch.stack([x, x.flip(0)])
    hb = tp.Heads(A, weights=om, beta=betas)
    got = tp.energy(xb, hb, w)
    ref = torch.stack([naive_energy(xb[k], A[k], om, float(betas[k]), w) for k in range(2)])
    assert_close(got, ref, rtol=1e-12, atol=0)
    per_head = tp.head_energies(xb, hb, w)
    ref_h = torch.stack([torch.stack([naive_energy(xb[k], A[k, h:h + 1], torch.ones(1, dtype=torch.float64),
                                                   float(betas[k]), w) for h in range(3)]) for k in range(2)])
    assert_close(per_head, ref_h, rtol=1e-12, atol=0)
    # the Itô term with a batch of β (its β must broadcast over the batch axis, not the heads')
    zero = torch.zeros_like(A)
    ito = tp.energy_time_derivative(xb, hb, zero, w, sigma=0.8)
    ref_ito = torch.stack([naive_ito(xb[k], A[k], om, float(betas[k]), w, 0.8) for k in range(2)])
    assert_close(ito, ref_ito, rtol=1e-11, atol=0)
