"""The token-noise Itô term Σ_i Δ_{S,i} E from the softmax statistics (dynamics.noise.energy_laplacian_moments).

Oracles: the dense pair sum :func:`dense_laplacian` (an independent formula: every pair, every head, no
kernel statistics; what :func:`energy_laplacian` formed before it took the kernel's moments), a finite-difference Laplace–Beltrami of tp.energy along geodesics in each token, and a
noisy solve's booked Itô term against the dense sum at the recorded tokens.  Tolerances: rounding of the
kernel's moments, relative to the sum of the magnitudes of the terms (``_magnitude``), which bounds what
cancels in the sum.
"""

import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model.energy import choose_log_scale
from transformer_pde.model.softmax import softmax_statistics
from transformer_pde.dynamics.noise import TokenNoise, energy_laplacian, energy_laplacian_moments

from conftest import gen


def dense_laplacian(x, heads, weights=None, log_scale=0.0):
    """Σ_i Δ_{S,i} E · e^{−c} from the dense (..., H, n, n) block of pair terms (module docstring of
    transformer_pde.dynamics.noise): every ordered pair by the pair formula, the diagonal replaced by the
    Laplacian of x ↦ e^{β⟨x, A x⟩}."""
    A = heads.score_matrix
    n, d = x.shape[-2], x.shape[-1]
    beta = heads.beta_tensor().to(x.dtype)
    b = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
    xh = x.unsqueeze(-3)
    Ax, Atx = xh @ A.transpose(-1, -2), xh @ A
    s = xh @ Ax.transpose(-1, -2)
    K = torch.exp(b * s - log_scale)
    pair = b * b * ((Ax * Ax).sum(-1).unsqueeze(-2) + (Atx * Atx).sum(-1).unsqueeze(-1) - 2 * s * s) \
        - 2 * (d - 1) * b * s
    w = torch.full(x.shape[:-1], 1.0 / n, dtype=x.dtype) if weights is None else weights
    total = ((w.unsqueeze(-1) * w.unsqueeze(-2)).unsqueeze(-3) * K * pair).sum((-1, -2))
    S = 0.5 * (A + A.transpose(-1, -2))
    sii = s.diagonal(dim1=-2, dim2=-1)
    Sx = xh @ S
    trS = S.diagonal(dim1=-2, dim2=-1).sum(-1).unsqueeze(-1)
    bd = b.squeeze(-1) if beta.dim() else b
    own = 2 * bd * trS - 2 * bd * d * sii + 4 * bd * bd * ((Sx * Sx).sum(-1) - sii * sii)
    total = total + (w * w).unsqueeze(-2).mul(K.diagonal(dim1=-2, dim2=-1)
                                               * (own - pair.diagonal(dim1=-2, dim2=-1))).sum(-1)
    bh = beta.unsqueeze(-1) if beta.dim() else beta
    return (heads.weights * total / (2 * bh)).sum(-1)


def _magnitude(x, heads, weights, log_scale=0.0):
    """Σ_h |ω_h|/(2β) Σ_ij w_i w_j e^{β s_ij − c} (β²(|A x_j|² + |Aᵀx_i|² + 2 s_ij²) + 2(d−1)β|s_ij|) plus the
    diagonal terms' magnitudes: the scale the rounding of the sum is relative to, (...,)."""
    A = heads.score_matrix
    n, d = x.shape[-2], x.shape[-1]
    beta = heads.beta_tensor().to(x.dtype)
    b = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
    xh = x.unsqueeze(-3)
    s = xh @ (xh @ A.transpose(-1, -2)).transpose(-1, -2)
    K = torch.exp(b * s - log_scale)
    nA = (xh @ A.transpose(-1, -2)).square().sum(-1)
    nAt = (xh @ A).square().sum(-1)
    term = b * b * (nA.unsqueeze(-2) + nAt.unsqueeze(-1) + 2 * s * s) + 2 * (d - 1) * b * s.abs()
    trace = A.diagonal(dim1=-2, dim2=-1).abs().sum(-1)[..., None, None]
    term = term + torch.eye(n, dtype=x.dtype) * (2 * b * (trace + d * s.abs()) + 8 * b * b * (nA + nAt).unsqueeze(-1))
    w = torch.full(x.shape[:-1], 1.0 / n, dtype=x.dtype) if weights is None else weights
    ww = (w.unsqueeze(-1) * w.unsqueeze(-2)).unsqueeze(-3)
    bh = beta.unsqueeze(-1) if beta.dim() else beta
    return (heads.weights.abs() * (ww * K * term).sum((-1, -2)) / (2 * bh)).sum(-1)


def _tol(x, heads):
    """atol per unit magnitude: e^{βs} (or e^{log m − c}) carries the relative error eps·β|s| of its exponent,
    |s| ≤ ‖A‖₂; a few ulp on top for the products and sums (measured: below 0.2·eps·(1 + β‖A‖₂))."""
    beta = heads.beta_tensor().to(x.dtype)
    norms = torch.linalg.matrix_norm(heads.score_matrix.to(x.dtype), 2)  # (..., H)
    bound = float((beta.unsqueeze(-1) * norms if beta.dim() else beta * norms).max())
    return 4 * (1 + bound) * torch.finfo(x.dtype).eps


def _heads(kind, d, dtype, batch=()):
    g = gen(11)
    if kind == "scalar":
        return tp.Heads.scalar(torch.tensor([0.5, 1.0, 2.0], dtype=dtype), d, weights=torch.tensor([0.2, 0.3, 0.5],
                                                                                                 dtype=dtype))
    if kind == "symmetric":
        return tp.Heads.random(3, d, symmetric=True, scale=0.5, batch_shape=batch, generator=g, dtype=dtype, beta=1.3)
    if kind == "general":
        return tp.Heads.random(3, d, symmetric=False, batch_shape=batch, generator=g, dtype=dtype, beta=0.8,
                               weights=torch.tensor([0.5, 0.25, 1.0], dtype=dtype))
    if kind == "factors":  # a key factor per head: the unmerged kernel layout (..., H, n, E)
        Q = torch.randn(*batch, 3, 2, d, generator=g, dtype=dtype)
        K = torch.randn(*batch, 3, 2, d, generator=g, dtype=dtype)
        return tp.Heads(None, torch.randn(*batch, 3, d, d, generator=g, dtype=dtype), None, 0.9, query=Q, key=K)
    raise ValueError(kind)


def _check(x, heads, weights, log_scale=0.0):
    stats = softmax_statistics(x, heads, weights, second_moment=True)
    got = energy_laplacian_moments(x, heads, weights, stats, log_scale=log_scale)
    assert got is not None  # the fused kernel's columns were there
    want = dense_laplacian(x, heads, weights, log_scale=log_scale)
    atol = _tol(x, heads) * _magnitude(x, heads, weights, log_scale)
    torch.testing.assert_close(got, want, rtol=_tol(x, heads), atol=float(atol.max()))
    return got


@pytest.mark.parametrize("kind", ["scalar", "symmetric", "general", "factors"])
@pytest.mark.parametrize("weighted", [False, True])
def test_moments_equal_the_dense_pair_sum(kind, weighted, dtype):
    """Scalar, symmetric, non-symmetric and factored heads (the merged and the per-head kernel layouts), uniform
    and given token weights, a batch of token sets, d = 3."""
    d = 3
    x = tp.sphere.sample_uniform(9, d, batch_shape=(2,), generator=gen(1), dtype=dtype)
    w = torch.softmax(torch.randn(2, 9, generator=gen(2), dtype=dtype), -1) if weighted else None
    _check(x, _heads(kind, d, dtype), w)


@pytest.mark.parametrize("kind", ["general", "factors"])
def test_one_token_set_at_a_given_scale(kind, dtype):
    """No batch axis (the per-head kernel layout (H, n, E) of factored heads) and results times e^{−c} for a
    given c = 1."""
    x = tp.sphere.sample_uniform(8, 3, generator=gen(17), dtype=dtype)
    w = torch.softmax(torch.randn(8, generator=gen(18), dtype=dtype), -1)
    _check(x, _heads(kind, 3, dtype), w, log_scale=1.0)


def test_two_batch_axes_with_a_beta_per_entry(dtype):
    """Tokens and heads with two batch axes, a β per batch entry of both."""
    x = tp.sphere.sample_uniform(6, 3, batch_shape=(2, 3), generator=gen(23), dtype=dtype)
    beta = torch.linspace(0.5, 2.0, 6, dtype=dtype).reshape(2, 3)
    heads = tp.Heads.random(2, 3, symmetric=False, batch_shape=(2, 3), generator=gen(24), dtype=dtype, beta=beta)
    _check(x, heads, None)


@pytest.mark.parametrize("d", [2, 4, 5])
def test_other_dimensions_and_batched_heads(d, dtype):
    """The column maps for d ≠ 3 (d(d+1)/2 − 1 second-moment columns), heads with a batch axis of their own,
    a β per batch entry."""
    x = tp.sphere.sample_uniform(7, d, batch_shape=(3,), generator=gen(3), dtype=dtype)
    beta = torch.tensor([0.5, 1.0, 1.7], dtype=dtype)
    heads = tp.Heads.random(2, d, symmetric=False, batch_shape=(3,), generator=gen(4), dtype=dtype, beta=beta)
    _check(x, heads, None)
    _check(x, _heads("factors", d, dtype, batch=(3,)), torch.softmax(torch.randn(3, 7, generator=gen(5), dtype=dtype), -1))


def test_keys_off_the_sphere_use_every_column(dtype):
    """Tokens off the sphere by more than rounding: the kernel keeps the last diagonal column C_dd (no
    trace-free reduction) and both formulas, algebraic in x, still agree."""
    x = tp.sphere.sample_uniform(8, 3, generator=gen(6), dtype=dtype) * (1 + 1e-3)
    heads = _heads("general", 3, dtype)
    stats = softmax_statistics(x, heads, None, second_moment=True)
    assert stats._merged[5] is False  # not trace-free
    _check(x, heads, None)


@pytest.mark.parametrize("beta", [60.0, 800.0])
def test_large_beta_at_a_common_scale(beta, dtype):
    """β‖A‖ past the overflow of e^{βs} (float32 from ≈ 88, float64 from ≈ 709): both formulas times e^{−c}
    at the solvers' scale c agree, and are finite."""
    if dtype == torch.float64 and beta < 700:
        beta = 750.0
    x = tp.sphere.sample_uniform(6, 3, generator=gen(7), dtype=dtype)
    heads = tp.Heads.random(2, 3, symmetric=False, scale=0.6, generator=gen(8), dtype=dtype, beta=beta)
    c = choose_log_scale(softmax_statistics(x, heads, None).log_partition)
    assert c > 0
    got = _check(x, heads, None, log_scale=c)
    assert bool(torch.isfinite(got).all())


def test_against_a_finite_difference_laplace_beltrami():
    """Σ_i Δ_{S,i} E by central second differences of tp.energy along the geodesics x_i cos t + e sin t of an
    orthonormal tangent basis e of each token (the Laplace–Beltrami operator is the sum of the second
    derivatives along them).  n = 3, non-symmetric heads, weights: the diagonal terms (weight w_i²) and the
    Aᵀ term matter, by far more than the tolerance (checked)."""
    d, n, h = 3, 3, 1e-3
    f64 = torch.float64
    x = tp.sphere.sample_uniform(n, d, generator=gen(9), dtype=f64)
    heads = tp.Heads.random(2, d, symmetric=False, generator=gen(10), dtype=f64, beta=1.2,
                            weights=torch.tensor([0.7, 0.4], dtype=f64))
    w = torch.tensor([0.5, 0.3, 0.2], dtype=f64)
    E0 = tp.energy(x, heads, w)
    fd = torch.zeros((), dtype=f64)
    for i in range(n):
        # tangent basis at x_i: the last d − 1 right singular vectors of x_i as a row
        basis = torch.linalg.svd(x[i].unsqueeze(0)).Vh[1:]
        for e in basis:
            for t in (h, -h):
                y = x.clone()
                y[i] = x[i] * math.cos(t) + e * math.sin(t)
                fd = fd + tp.energy(y, heads, w)
            fd = fd - 2 * E0
    fd = fd / h ** 2
    got = TokenNoise(1.0).ito_correction(x, heads, w, stats=softmax_statistics(x, heads, w, second_moment=True))
    scale = float(_magnitude(x, heads, w))
    # truncation O(h²) of smooth terms of size ≈ scale, plus the rounding eps·E/h²
    tol = h * h * scale + 100 * torch.finfo(f64).eps * float(E0.abs()) / h ** 2
    torch.testing.assert_close(got, fd, rtol=h * h, atol=tol)
    # what the check resolves: the pair formula over every (i, j) without the diagonal correction, or with
    # |A x_i|² in place of |Aᵀx_i|², misses the finite difference by far more than the tolerance
    A, b = heads.score_matrix, heads.beta
    s = x @ A @ x.T  # (H, n, n): s_ij = ⟨x_i, A x_j⟩
    K = torch.exp(b * s) * (w[:, None] * w[None, :])
    nA, nAt = (x @ A.transpose(-1, -2)).square().sum(-1), (x @ A).square().sum(-1)  # |A x_j|², |Aᵀx_j|²

    def pair_sum(second):
        bracket = b * b * (nA.unsqueeze(-2) + second.unsqueeze(-1) - 2 * s * s) - 2 * (d - 1) * b * s
        return (heads.weights / (2 * b) * (K * bracket).sum((-1, -2))).sum()

    assert abs(float(pair_sum(nAt)) - float(fd)) > 100 * tol  # the diagonal correction matters
    assert abs(float(pair_sum(nA)) - float(pair_sum(nAt))) > 100 * tol  # and so does Aᵀ


def test_one_token_and_the_statistics_it_needs(dtype):
    """One token under A = λI: E is constant on the sphere, so the Laplacian vanishes (only with the diagonal
    correction: the pair formula alone gives −2(d−1)βλ e^{βλ}·ω/(2β)).  Statistics without the fused kernel's
    columns (the plain-torch kernel, no second moment, other queries) give None, and the Itô term then
    falls back to the dense sum or its own kernel pass."""
    d = 3
    one = tp.sphere.sample_uniform(1, d, generator=gen(12), dtype=dtype)
    iso = tp.Heads.scalar(torch.tensor([1.5, 0.5], dtype=dtype), d)
    stats = softmax_statistics(one, iso, None, second_moment=True)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(energy_laplacian_moments(one, iso, None, stats), torch.zeros((), dtype=dtype),
                               rtol=eps, atol=float(_tol(one, iso) * _magnitude(one, iso, None)))
    x = tp.sphere.sample_uniform(6, d, generator=gen(13), dtype=dtype)
    heads = _heads("general", d, dtype)
    assert energy_laplacian_moments(x, heads, None, softmax_statistics(x, heads, None, backend="chunked",
                                                                       second_moment=True)) is None
    assert energy_laplacian_moments(x, heads, None, softmax_statistics(x, heads, None)) is None
    assert energy_laplacian_moments(x.clone(), heads, None, softmax_statistics(x, heads, None,
                                                                               second_moment=True)) is None
    noise, w = TokenNoise(0.3), torch.softmax(torch.randn(6, generator=gen(19), dtype=dtype), -1)
    want = 0.3 * dense_laplacian(x, heads, w, log_scale=1.0)
    tol = dict(rtol=_tol(x, heads), atol=float(0.3 * _tol(x, heads) * _magnitude(x, heads, w, 1.0)))
    for stats in (None, softmax_statistics(x, heads, w, second_moment=True),
                  softmax_statistics(x, heads, w, backend="chunked", second_moment=True)):
        torch.testing.assert_close(noise.ito_correction(x, heads, w, log_scale=1.0, stats=stats), want, **tol)
    # autograd: the dense sum, differentiable in the tokens
    xg = x.clone().requires_grad_(True)
    out = noise.ito_correction(xg, heads, w, log_scale=1.0)
    torch.testing.assert_close(out.detach(), want, **tol)
    assert out.requires_grad


def test_the_ito_term_reads_the_statistics_it_is_given(monkeypatch):
    """With the caller's statistics (the solver step's), no kernel pass and no dense block of its own; without
    them, one fused kernel pass with second moments (where the CPU's fused kernel exists) and no dense block."""
    from transformer_pde.dynamics import noise as module

    x = tp.sphere.sample_uniform(6, 3, generator=gen(20), dtype=torch.float64)
    heads = _heads("general", 3, torch.float64)
    stats = softmax_statistics(x, heads, None, second_moment=True)
    if stats.__dict__.get("_merged") is None:
        pytest.skip("no fused kernel on this build")
    want = dense_laplacian(x, heads, None)

    def refuse(*args, **kwargs):
        raise AssertionError("not expected on this path")

    monkeypatch.setattr(module, "energy_laplacian", refuse)
    tol = dict(rtol=_tol(x, heads), atol=float(_tol(x, heads) * _magnitude(x, heads, None)))
    torch.testing.assert_close(TokenNoise(1.0).ito_correction(x, heads, stats=stats), want, **tol)
    seen = []

    def kernel(*args, **kwargs):
        seen.append(kwargs.get("second_moment"))
        return softmax_statistics(*args, **kwargs)

    monkeypatch.setattr(module, "softmax_statistics", kernel)
    torch.testing.assert_close(TokenNoise(1.0).ito_correction(x, heads, stats=stats), want, **tol)
    assert seen == []
    torch.testing.assert_close(TokenNoise(1.0).ito_correction(x, heads), want, **tol)
    assert seen == [True]


def test_coefficients_follow_the_heads(dtype):
    """The per-head coefficients are kept while the heads are unchanged: other heads, the same heads changed in
    place, another β or other head weights all give their own Laplacian."""
    x = tp.sphere.sample_uniform(7, 3, generator=gen(14), dtype=dtype)
    stats_of = {}

    def check(heads):
        key = id(heads.score_matrix), heads.score_matrix._version
        stats_of[key] = softmax_statistics(x, heads, None, second_moment=True)
        got = energy_laplacian_moments(x, heads, None, stats_of[key])
        tol = _tol(x, heads)
        torch.testing.assert_close(got, dense_laplacian(x, heads, None), rtol=tol,
                                   atol=float(tol * _magnitude(x, heads, None)))

    a = _heads("general", 3, dtype)
    check(a)
    check(_heads("symmetric", 3, dtype))
    check(a)
    a.score.mul_(-0.7)  # in place: a new version of the same tensor
    check(a)
    check(a.replace(beta=2.5))
    check(a.replace(weights=torch.tensor([1.0, 0.1, 0.3], dtype=dtype)))
    xb = tp.sphere.sample_uniform(7, 3, batch_shape=(2,), generator=gen(21), dtype=dtype)
    batched = a.replace(beta=torch.tensor([0.6, 1.4], dtype=dtype))
    for _ in range(2):  # a β tensor changed in place between two calls
        stats = softmax_statistics(xb, batched, None, second_moment=True)
        tol = _tol(xb, batched)
        torch.testing.assert_close(energy_laplacian_moments(xb, batched, None, stats),
                                   dense_laplacian(xb, batched, None), rtol=tol,
                                   atol=float(tol * _magnitude(xb, batched, None).max()))
        batched.beta.mul_(1.5)


@pytest.mark.parametrize("causal", [False, True])
def test_a_noisy_solve_books_the_dense_ito_term(causal, dtype, monkeypatch):
    """The fixed-step solve books dt·T·Σ_i Δ_{S,i} E at the left end of every step: with constant heads
    (∂_tE = 0, Euler: left quadrature) each step's increment of ledger["partial"] equals dt·T times the dense
    sum at the recorded tokens (also for causal attention, whose ledger reads the whole measure's statistics;
    token weights, paths).  The solve reads its own step's statistics: no kernel pass of the Itô term's own
    and no dense block."""
    from transformer_pde.dynamics import noise as module

    def refuse(*args, **kwargs):
        raise AssertionError("the solve's Itô term must come from the step's statistics")

    monkeypatch.setattr(module, "energy_laplacian", refuse)
    monkeypatch.setattr(module, "softmax_statistics", refuse)
    n, d, T, dt = 6, 3, 0.4, 0.05
    x0 = tp.sphere.sample_uniform(n, d, batch_shape=(2,), generator=gen(15), dtype=dtype)
    heads = _heads("general", d, dtype)
    w = torch.softmax(torch.randn(2, n, generator=gen(16), dtype=dtype), -1)
    model = tp.Model(heads, temperature=T, weights=w, causal=causal, direction="ascent")
    tr = tp.solve(model, x0, tp.Euler(), t1=3 * dt, dt=dt, paths=2, seed=4, ledger=tp.LedgerOptions(ledger=True),
                  progress=False)
    c = tr.stats["energy_log_scale"]
    step = tr.ledger["partial"].diff(dim=0)  # (steps, paths, 2)
    want = dt * T * dense_laplacian(tr.x[:-1], heads, w, log_scale=c)
    atol = float(dt * T * _tol(x0, heads) * _magnitude(tr.x[:-1], heads, w, c).max())
    torch.testing.assert_close(step, want, rtol=_tol(x0, heads), atol=atol)
    assert float(want.abs().max()) > 1000 * atol


@pytest.mark.parametrize("leaf", ["score", "weights", "beta", "token weights"])
def test_gradients_through_the_heads(leaf):
    """A score matrix, head weights, β or token weights that require grad: the statistics are constants to
    autograd, so the moment form steps aside (None) and the Itô term's gradient is the dense sum's."""
    x = tp.sphere.sample_uniform(5, 3, generator=gen(22), dtype=torch.float64)
    heads = _heads("general", 3, torch.float64).replace(beta=torch.tensor(0.8, dtype=torch.float64))
    w = torch.softmax(torch.randn(5, generator=gen(25), dtype=torch.float64), -1)
    with torch.no_grad():
        stats = softmax_statistics(x, heads, w, second_moment=True)
    if leaf == "token weights":
        w = leaf_tensor = w.clone().requires_grad_(True)
    else:
        leaf_tensor = getattr(heads, leaf).clone().requires_grad_(True)
        heads = heads.replace(**{leaf: leaf_tensor})
    assert energy_laplacian_moments(x, heads, w, stats) is None
    (got,) = torch.autograd.grad(TokenNoise(0.5).ito_correction(x, heads, w, stats=stats), leaf_tensor)
    (want,) = torch.autograd.grad(0.5 * dense_laplacian(x, heads, w), leaf_tensor)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert float(want.abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["scalar", "symmetric", "general", "factors"])
def test_energy_laplacian_takes_the_kernel_moments(kind, dtype, monkeypatch):
    """The public pair sum against the dense block: several heads, uniform and weighted tokens (a zero weight
    among them), a batch of systems, a common scale; it comes from one kernel pass with second moments (no
    (H, n, n) block of its own), and with autograd on it is the dense sum, differentiable."""
    from transformer_pde.dynamics import noise as module

    d = 3
    x = tp.sphere.sample_uniform(7, d, batch_shape=(2,), generator=gen(31), dtype=dtype)
    heads = _heads(kind, d, dtype)
    w = torch.softmax(torch.randn(2, 7, generator=gen(32), dtype=dtype), -1)
    w[1, 3] = 0.0
    w = w / w.sum(-1, keepdim=True)
    # where this build's fused kernel gives the second-moment columns, the sum must come from them
    has_columns = energy_laplacian_moments(x, heads, w, softmax_statistics(x, heads, w, second_moment=True)) is not None
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs.get("second_moment"))
        return softmax_statistics(*args, **kwargs)

    returned = []

    def moments(*args, **kwargs):
        returned.append(energy_laplacian_moments(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(module, "softmax_statistics", kernel)
    monkeypatch.setattr(module, "energy_laplacian_moments", moments)
    for weights, c in ((None, 0.0), (w, 0.0), (w, 1.5)):
        got = energy_laplacian(x, heads, weights, log_scale=c)
        if has_columns:  # the moments' sum itself is returned (no dense block formed after it)
            assert returned and returned[-1] is got
        want = dense_laplacian(x, heads, weights, log_scale=c)
        tol = _tol(x, heads)
        torch.testing.assert_close(got, want, rtol=tol, atol=float(tol * _magnitude(x, heads, weights, c).max()))
        assert float(want.abs().min()) > 100 * float(tol * _magnitude(x, heads, weights, c).max())  # not all rounding
    if has_columns:
        assert calls == [True] * 3  # one kernel pass with second moments per call
    xg = x.clone().requires_grad_(True)
    out = energy_laplacian(xg, heads, w)
    assert out.requires_grad
    torch.testing.assert_close(out.detach(), dense_laplacian(x, heads, w), rtol=_tol(x, heads),
                               atol=float(_tol(x, heads) * _magnitude(x, heads, w).max()))
    # the gradient in the tokens is the dense sum's (the kernel's statistics are constants to autograd)
    (got_grad,) = torch.autograd.grad(out.sum(), xg)
    xd = x.clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad(dense_laplacian(xd, heads, w).sum(), xd)
    scale = float(want_grad.abs().max())
    torch.testing.assert_close(got_grad, want_grad, rtol=100 * _tol(x, heads), atol=100 * _tol(x, heads) * scale)
