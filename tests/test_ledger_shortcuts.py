"""The shortcuts of the ledger step against independent computations.

* 𝒟 of the merged fused kernel, from ∇_S δE/δμ when that is formed first (the noisy-token step) or from
  the per-head moment sums otherwise, both against Σ_i ⟨∂E/∂x_i, V_i⟩ by autograd of the energy;
* the noisy-token ledger's "partial" (no ∂_tE for constant weights, the tokens' Itô term booked) and
  "dissipation" against the dense Laplacian and the autograd 𝒟 at the recorded tokens;
* with noisy weights as well, "partial" still books ∂_tE and the weights' Itô term
  (:func:`transformer_pde.energy_time_derivative` with σ) along the stored weight path;
* the finiteness test of the ledger's densities (one test of a sum, then each), the ledger's
  quadrature with a density that is 0 (None), and the per-head maps kept over a run.
"""

import math
import warnings

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model import moments
from transformer_pde.model.field import evaluate
from transformer_pde.dynamics.noise import energy_laplacian
from transformer_pde.solvers.parts import Ledger
from transformer_pde.solvers.trajectory import NonFiniteError, check_finite, check_ledger

from conftest import gen

DTYPES = [torch.float32, torch.float64]


def _tol(dtype):
    return (2e-4, 2e-5) if dtype == torch.float32 else (1e-10, 1e-12)


def _autograd_dissipation(x, heads, weights, V):
    """Σ_i ⟨∂E/∂x_i, V_i⟩ = Σ_i w_i ⟨∇ δE/δμ(x_i), V_i⟩ (V tangent), by autograd of the energy."""
    xg = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(tp.energy(xg, heads, weights).sum(), xg)
    return (grad * V).sum((-1, -2))


def _symmetric_heads(H, d, dtype, seed):
    Z = torch.randn(H, d, d, generator=gen(seed), dtype=torch.float64)
    w = torch.rand(H, generator=gen(seed + 1), dtype=torch.float64) + 0.5
    return tp.Heads((Z + Z.transpose(-1, -2)) / 2, weights=w / w.sum(), beta=1.3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_dissipation_from_the_gradient_and_from_the_moment_sums(dtype, weighted):
    d, n = 3, 30
    x = tp.sphere.sample_uniform(n, d, batch_shape=(2,), generator=gen(1), dtype=dtype)
    heads = _symmetric_heads(3, d, dtype, 2)
    w = None
    if weighted:
        w = torch.rand(2, n, generator=gen(4), dtype=torch.float64).to(dtype) + 0.2
        w = w / w.sum(-1, keepdim=True)
    kw = dict(normalization="softmax", sign=1.0, diagnostics=True, second_moment=True)
    first_d = evaluate(x, heads, w, **kw)  # 𝒟 read first: from the moment sums
    D_sums = first_d.dissipation
    first_g = evaluate(x, heads, w, **kw)
    g = first_g.grad_first_variation  # formed first: 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i), V_i⟩
    D_grad = first_g.dissipation
    want = _autograd_dissipation(x, heads, w, first_g.velocity)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(D_sums, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(D_grad, want, rtol=rtol, atol=atol)
    # the gradient is tangent and is ∂E/∂x_i / w_i projected
    torch.testing.assert_close((g * x).sum(-1), torch.zeros_like(g[..., 0]), rtol=rtol, atol=10 * atol)
    # the lazy fields are formed once and kept
    assert first_g.dissipation is D_grad and first_g.grad_first_variation is g
    # at a common scale c every diagnostic is the value times e^{-c}
    scaled = evaluate(x, heads, w, **kw, log_scale=2.0)
    scaled.grad_first_variation
    torch.testing.assert_close(scaled.dissipation, want * math.exp(-2.0), rtol=rtol, atol=atol)


def _noisy_run(theta, x0, T, dt, K, seed=3, weights=None):
    model = tp.Model(theta, temperature=T, direction="ascent", weights=weights)
    return tp.solve(model, x0, tp.Euler(), t1=K * dt, dt=dt, seed=seed, progress=False,
                    saveat=tp.SaveAt(path=True), ledger=tp.LedgerOptions(ledger=True, quadrature="left"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_noisy_token_ledger_against_dense_sums(dtype, weighted):
    """Constant weights, noisy tokens: "partial" is the left sum of T Σ_i Δ_{S,i} E (no ∂_tE), and
    "dissipation" the left sum of 𝒟 at the recorded tokens; with token weights, the weighted sums."""
    d, n, T, dt, K = 3, 12, 0.3, 0.02, 6
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(5), dtype=dtype)
    heads = _symmetric_heads(2, d, dtype, 6)
    w = torch.softmax(torch.randn(n, generator=gen(7), dtype=torch.float64), -1).to(dtype) if weighted else None
    tr = _noisy_run(heads, x0, T, dt, K, weights=w)
    assert tr.x.shape[0] == K + 1
    lap = torch.stack([T * energy_laplacian(tr.x[k], heads, w) for k in range(K)])
    V = [tp.velocity(tr.x[k], heads, w, direction="ascent") for k in range(K)]
    D = torch.stack([_autograd_dissipation(tr.x[k], heads, w, V[k]) for k in range(K)])
    zero = torch.zeros((1,), dtype=dtype)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(tr.ledger["partial"], torch.cat([zero, torch.cumsum(dt * lap, 0)]), rtol=rtol,
                               atol=10 * atol)
    torch.testing.assert_close(tr.ledger["dissipation"], torch.cat([zero, torch.cumsum(dt * D, 0)]), rtol=rtol,
                               atol=10 * atol)
    assert float(tr.ledger["partial"][-1].abs()) > 100 * atol  # the Itô term is there, not rounding


def test_noisy_token_step_forms_no_moment_sums(monkeypatch):
    """Constant weights and noisy tokens: the step forms ∇_S δE/δμ (the martingale reads it) and takes 𝒟 from it,
    so the per-head moment sums of the kernel's block (∂_tE's and the weights' Itô term's) are never formed;
    with noisy weights they are (∂_tE pairs them with Ȧ)."""
    calls = []
    real_sums = moments._merged_moment_sums
    monkeypatch.setattr(moments, "_merged_moment_sums", lambda *a, **k: calls.append(2) or real_sums(*a, **k))
    dtype = torch.float64
    x0 = tp.sphere.sample_uniform(8, 3, generator=gen(11), dtype=dtype)
    heads = _symmetric_heads(2, 3, dtype, 12)
    tr = _noisy_run(heads, x0, 0.2, 0.02, 3)
    assert calls == [] and tr.ledger["dissipation"].shape == (4,)
    _noisy_run(tp.OrnsteinUhlenbeck(heads, sigma=0.5), x0, 0.2, 0.02, 3)
    assert 2 in calls


def test_noisy_weights_and_tokens_book_both_terms():
    """Noisy weights (OU) and noisy tokens: "partial" is the left sum of ∂_tE plus the weights' Itô term
    (energy_time_derivative with σ) plus the tokens' Itô term, along the stored weight path."""
    dtype = torch.float64
    d, n, T, dt, K = 3, 10, 0.2, 0.02, 5
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(7), dtype=dtype)
    h0 = _symmetric_heads(2, d, dtype, 8)
    theta = tp.OrnsteinUhlenbeck(h0, mean=torch.eye(d, dtype=dtype), sigma=0.7, scheme="euler")
    tr = _noisy_run(theta, x0, T, dt, K)
    p = tr.path
    dens = []
    for k in range(K):
        hk = h0.with_score(p.scores[k])
        dens.append(tp.energy_time_derivative(tr.x[k], hk, p.rates[k], sigma=p.sigmas[k])
                    + T * energy_laplacian(tr.x[k], hk))
    want = torch.cat([torch.zeros((1,), dtype=dtype), torch.cumsum(dt * torch.stack(dens), 0)])
    torch.testing.assert_close(tr.ledger["partial"], want, rtol=1e-10, atol=1e-12)
    # leaving out the weights' Itô term would be seen: it is far above the tolerance
    ito_w = sum(float(tp.energy_time_derivative(tr.x[k], h0.with_score(p.scores[k]), p.rates[k], sigma=p.sigmas[k])
                      - tp.energy_time_derivative(tr.x[k], h0.with_score(p.scores[k]), p.rates[k]))
                for k in range(K))
    assert abs(dt * ito_w) > 1e-6


class _Eval:
    """The fields of a FieldEval that check_ledger reads."""

    def __init__(self, energy, dissipation, slope, lse):
        self.energy, self.dissipation, self.slope = energy, dissipation, slope
        self.stats = type("S", (), {"log_partition": lse})()


@pytest.mark.parametrize("dtype", DTYPES)
def test_check_ledger_one_sum_then_each(dtype):
    big = torch.finfo(dtype).max
    lse = torch.zeros(2, 3, dtype=dtype)
    scale = {"c": 0.0, "start_max": 0.0}
    one = torch.ones(2, dtype=dtype)
    check_ledger(_Eval(one, one, one, lse), None, 0.1, 1, scale)  # ∂_tE None: 0
    # finite values whose sum overflows are finite: no error
    check_ledger(_Eval(torch.full((2,), big, dtype=dtype), torch.full((2,), big, dtype=dtype), one, lse),
                 one, 0.1, 1, scale)
    # +inf and −inf in two quantities (the sum is NaN) and a NaN in the last one are each named
    for e, pt, name in [(_Eval(one, torch.tensor([1.0, math.inf], dtype=dtype),
                               torch.tensor([-math.inf, 1.0], dtype=dtype), lse), one, "the dissipation 𝒟 became"),
                        (_Eval(one, one, one, lse), torch.tensor([0.0, math.nan], dtype=dtype), "∂_tE"),
                        (_Eval(torch.tensor([math.nan], dtype=dtype), one[:1], one[:1], lse), None,
                         "^the energy became"),
                        (_Eval(one[:1], one[:1], torch.tensor([math.inf], dtype=dtype), lse), None,
                         "^the metric slope 𝒢² became")]:
        with pytest.raises(NonFiniteError, match=name):
            check_ledger(e, pt, 0.1, 1, scale)
    # one entry, 0-d, and a tensor that requires grad (read without autograd's warning)
    assert check_finite(torch.tensor([2.0], dtype=dtype)) and not check_finite(torch.tensor([math.inf], dtype=dtype))
    assert not check_finite(torch.tensor(math.nan, dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_finite(torch.ones(3, dtype=dtype, requires_grad=True).sum())
        assert check_finite(torch.ones(1, dtype=dtype, requires_grad=True))
    assert check_finite(torch.full((4,), big, dtype=dtype))  # the sum overflows, every entry is finite


@pytest.mark.parametrize("quadrature", ["left", "trapezoid"])
def test_ledger_integrates_a_density_that_is_zero(quadrature):
    dtype = torch.float64
    led = Ledger(torch.zeros(2, dtype=dtype), sign=1.0, quadrature=quadrature)
    a = {"partial": None, "dissipation": torch.tensor([1.0, 2.0], dtype=dtype), "slope": torch.ones(2, dtype=dtype)}
    b = {"partial": None, "dissipation": torch.tensor([3.0, 4.0], dtype=dtype), "slope": torch.ones(2, dtype=dtype)}
    led.integrate(a, b, 0.5)
    want_D = a["dissipation"] * 0.5 if quadrature == "left" else 0.25 * (a["dissipation"] + b["dissipation"])
    torch.testing.assert_close(led.acc["dissipation"], want_D, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(led.acc["partial"], torch.zeros(2, dtype=dtype), rtol=1e-15, atol=1e-15)
    # one end 0 (None), the other not: the mean of both ends, or the left value
    c = {**b, "partial": torch.tensor([2.0, -2.0], dtype=dtype)}
    led.integrate(a, c, 0.5)
    want_P = torch.zeros(2, dtype=dtype) if quadrature == "left" else 0.25 * c["partial"]
    torch.testing.assert_close(led.acc["partial"], want_P, rtol=1e-15, atol=1e-15)
    led.integrate(c, a, 0.5)
    want_P = want_P + (0.5 * c["partial"] if quadrature == "left" else 0.25 * c["partial"])
    torch.testing.assert_close(led.acc["partial"], want_P, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_map_follows_the_heads(dtype):
    """The kept map is the map of the tensors given: an in-place change of the weights or the matrices,
    or other tensors, give a new one (against the entries W[h·E + b, a] = ω_h M_h[a, b])."""
    H, d, E = 3, 3, 5
    w = torch.rand(H, generator=gen(9), dtype=torch.float64).to(dtype)
    M = torch.randn(H, d, d, generator=gen(10), dtype=torch.float64).to(dtype)

    def want():
        W = torch.zeros(H, E, d, dtype=dtype)
        for h in range(H):
            W[h, :d, :] = w[h] * M[h].T
        return W.reshape(H * E, d)

    first = moments.per_head_map(w, M, E)
    torch.testing.assert_close(first, want(), rtol=1e-6, atol=1e-7)
    assert moments.per_head_map(w, M, E) is first  # kept
    w.mul_(2.0)
    torch.testing.assert_close(moments.per_head_map(w, M, E), want(), rtol=1e-6, atol=1e-7)
    M[1].add_(1.0)
    torch.testing.assert_close(moments.per_head_map(w, M, E), want(), rtol=1e-6, atol=1e-7)
    before = moments.per_head_map(w, M, E)
    M = M.clone() * 3  # another tensor
    torch.testing.assert_close(moments.per_head_map(w, M, E), want(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(before * 3, want(), rtol=1e-6, atol=1e-7)
    # with autograd nothing is kept: the map carries the graph of the tensors given
    wg = w.clone().requires_grad_(True)
    Wg = moments.per_head_map(wg, M, E)
    assert Wg.requires_grad and moments.per_head_map(wg, M, E) is not Wg


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_slope_at_a_scale_that_puts_the_masses_below_full_precision(dtype):
    """The merged kernel's 𝒢² at a common scale c where every m_h e^{−c} is below tiny/eps (the log-sum-exp
    mobility, not 1/(ω̄ᵀ(1/m))): the value at c = 0 times e^{−c}."""
    x = tp.sphere.sample_uniform(20, 3, generator=gen(13), dtype=dtype)
    heads = _symmetric_heads(3, 3, dtype, 14)
    fi = torch.finfo(dtype)
    c = float(math.ceil(-math.log(fi.tiny / fi.eps))) + 5.0  # m ~ 1: m e^{-c} < tiny/eps
    kw = dict(normalization="softmax", diagnostics=True, second_moment=True)
    plain, scaled = evaluate(x, heads, None, **kw), evaluate(x, heads, None, **kw, log_scale=c)
    assert float(moments.head_columns_mass(scaled.stats, c).amax()) < fi.tiny / fi.eps
    rtol = 1e-4 if dtype == torch.float32 else 1e-11
    torch.testing.assert_close(scaled.slope * math.exp(c / 2) * math.exp(c / 2), plain.slope, rtol=rtol, atol=0.0)
    torch.testing.assert_close(scaled.energy * math.exp(c / 2) * math.exp(c / 2), plain.energy, rtol=rtol, atol=0.0)
