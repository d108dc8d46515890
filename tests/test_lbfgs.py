"""Riemannian L-BFGS on a product of spheres (transformer_pde.solvers.jko.lbfgs.minimize).

Oracles are closed forms: the minimum of the Rayleigh quotient yᵀMy over S^{d-1} is the smallest eigenvalue,
reached at its eigenvector (torch.linalg.eigh of a matrix built here from chosen eigenvalues); a linear
⟨a_i, y_i⟩ per token is minimised at −a_i/|a_i|.  Error bounds follow from the stopping rule of the module
docstring (r ≤ tol·r₀ + 100·u·(1/τ + r₀)) and the curvature of each problem, with r₀ recomputed here.
"""

import math

import pytest
import torch

from transformer_pde.dynamics.layernorm import Projected
from transformer_pde.solvers.jko.lbfgs import TRUST_RADIUS, minimize
from transformer_pde.model.sphere import normalize, sample_uniform, tangent_projection
from conftest import gen

DTYPES = [torch.float32, torch.float64]


def default_tol(dtype):
    return 1e-9 if dtype == torch.float64 else 1e-4


def threshold(r0, tol, dtype, tau=1.0):
    """The stopping bound of the module docstring."""
    u = torch.finfo(dtype).eps
    return tol * r0 + 100 * u * (1 / tau + r0)


def rayleigh_problem(B, d, seed):
    """B symmetric matrices Q diag(λ) Qᵀ with known, distinct eigenvalues (float64)."""
    g = gen(seed)
    Q, _ = torch.linalg.qr(torch.randn(B, d, d, generator=g, dtype=torch.float64))
    lam = torch.sort(torch.rand(B, d, generator=g, dtype=torch.float64) * 4 - 2, dim=-1).values
    lam[:, 1:] = lam[:, 1:] + 0.3 * torch.arange(1, d, dtype=torch.float64)  # gaps >= 0.3
    M = Q @ torch.diag_embed(lam) @ Q.transpose(-1, -2)
    return 0.5 * (M + M.transpose(-1, -2)), lam, Q[..., :, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rayleigh_quotient_reaches_the_eigenvector_of_the_smallest_eigenvalue(dtype):
    """min_{|y| = 1} yᵀMy = λ_1 at ±v_1.  Near v_1, |P_y ∇(yᵀMy)| = 2|(M − f)y| ≥ 2·gap·sin θ (gap = λ_2 − λ_1,
    θ the angle to ±v_1), so a converged solve has sin θ ≤ r/(2 gap) up to second order."""
    B, d = 3, 5
    M64, lam, v1 = rayleigh_problem(B, d, 1)
    M = M64.to(dtype)
    y0 = sample_uniform(B, d, generator=gen(2), dtype=torch.float64).to(dtype).unsqueeze(1)  # (B, 1, d)

    def objective(y):
        return ((y @ M) * y).sum((-1, -2))

    tol = default_tol(dtype)
    y, info = minimize(objective, y0)
    assert bool(info["converged"].all())
    y64 = y.double()[:, 0]
    assert_on_sphere(y, dtype)
    x0 = y0.double()[:, 0]
    f0 = (matvec(M64, x0) * x0).sum(-1, keepdim=True)
    r0 = (2 * tangent_projection(x0, matvec(M64, x0))).norm(dim=-1)  # τ = 1, pre = 1, w = 1
    torch.testing.assert_close(info["r0"].double(), r0, rtol=100 * torch.finfo(dtype).eps, atol=0)
    assert (f0.squeeze(-1) > lam[:, 0]).all()
    gap = lam[:, 1] - lam[:, 0]
    sin = (y64 - (y64 * v1).sum(-1, keepdim=True) * v1).norm(dim=-1)
    bound = threshold(r0, tol, dtype) / (2 * gap) * 1.5 + 10 * torch.finfo(dtype).eps
    assert (sin <= bound).all(), (sin, bound)
    f = (matvec(M64, y64) * y64).sum(-1)
    spread = lam[:, -1] - lam[:, 0]
    assert (f - lam[:, 0] >= -10 * torch.finfo(dtype).eps * spread).all()
    assert (f - lam[:, 0] <= spread * bound ** 2 + 10 * torch.finfo(dtype).eps * spread).all()


def matvec(M, y):
    """M y for a batch of matrices (B, d, d) and vectors (B, d)."""
    return (M @ y.unsqueeze(-1)).squeeze(-1)


def assert_on_sphere(y, dtype):
    err = float((y.double().norm(dim=-1) - 1).abs().max())
    assert err <= 10 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sum_of_per_token_objectives_reaches_each_tokens_minimiser(dtype):
    """F(y) = Σ_i ⟨a_i, y_i⟩ with |a_i| spanning 10⁻² ... 10² and token weights w_i: each token goes to
    −a_i/|a_i|.  With pre_i = 1/(w_i|a_i|), G_i = pre_i |a_i| sin θ_i = sin θ_i / w_i, so a converged solve has
    sin θ_i ≤ r / (w_i^{1/2} · 1/w_i) = r·w_i^{1/2}."""
    B, n, d = 2, 6, 3
    g = gen(3)
    a = torch.randn(B, n, d, generator=g, dtype=torch.float64)
    a = a * torch.logspace(-2, 2, n, dtype=torch.float64)[None, :, None] / a.norm(dim=-1, keepdim=True)
    w = torch.softmax(torch.randn(B, n, generator=g, dtype=torch.float64), -1)
    y0 = sample_uniform(B * n, d, generator=gen(4), dtype=torch.float64).reshape(B, n, d)
    target = -a / a.norm(dim=-1, keepdim=True)
    pre = (1 / (w * a.norm(dim=-1))).unsqueeze(-1)
    A = a.to(dtype)

    def objective(y):
        return (A * y).sum((-1, -2))

    y, info = minimize(objective, y0.to(dtype), preconditioner=pre.to(dtype), weights=w.to(dtype), max_iter=500)
    assert bool(info["converged"].all())
    assert_on_sphere(y, dtype)
    y64 = y.double()
    G0 = tangent_projection(y0, a) * pre
    r0 = ((G0.square().sum(-1) * w).sum(-1)).sqrt()
    torch.testing.assert_close(info["r0"].double(), r0, rtol=1e3 * torch.finfo(dtype).eps, atol=0)
    cos = (y64 * target).sum(-1)
    assert (cos > 0).all()  # the minimiser, not the maximiser +a/|a| (also a critical point)
    sin = (y64 - cos.unsqueeze(-1) * target).norm(dim=-1)
    bound = 1.5 * threshold(r0, default_tol(dtype), dtype).unsqueeze(-1) * w.sqrt() + 10 * torch.finfo(dtype).eps
    assert (sin <= bound).all(), (sin, bound)


def test_the_residual_meets_each_tolerance_and_tighter_tolerances_take_more_iterations():
    """The returned residual is the velocity error recomputed here from y (|P_y ∇F|, τ = 1, pre = 1, w = 1/n),
    it is below tol·r₀ + 100u(1 + r₀) for every tol, and the iteration counts do not decrease as tol shrinks."""
    M, lam, _ = rayleigh_problem(4, 6, 5)
    y0 = sample_uniform(4, 6, generator=gen(6), dtype=torch.float64).unsqueeze(1)

    def objective(y):
        return ((y @ M) * y).sum((-1, -2))

    iters = []
    for tol in (1e-2, 1e-5, 1e-8, 1e-11):
        y, info = minimize(objective, y0, tol=tol)
        assert bool(info["converged"].all())
        r = (2 * tangent_projection(y[:, 0], matvec(M, y[:, 0]))).norm(dim=-1)
        torch.testing.assert_close(info["residual"], r, rtol=1e-10, atol=1e-14)
        assert (r <= threshold(info["r0"], tol, torch.float64)).all()
        iters.append(info["iterations"])
    for a, b in zip(iters, iters[1:]):
        assert (b >= a).all()
    assert (iters[-1] > iters[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rho", [0.1, TRUST_RADIUS])
def test_the_trust_region_caps_every_move_and_a_long_way_takes_at_least_distance_over_rho_iterations(dtype, rho):
    """F = Σ_i ⟨a_i, y_i⟩ with |a_i| = 10³ (a stiff objective) from tokens 80° away from their minimisers:
    every point the line search tries is within ρ (chordal, every token) of the iterate it starts from — one of
    the points evaluated before — so reaching the minimiser takes at least chord(y0, y*)/ρ iterations."""
    n, d = 3, 3
    a = 1e3 * normalize(torch.randn(1, n, d, generator=gen(7), dtype=torch.float64))
    target = -normalize(a)
    e = normalize(tangent_projection(target, torch.randn(1, n, d, generator=gen(8), dtype=torch.float64)))
    th = math.radians(80)  # (from farther, |P∇F| grows for the first moves: see the stagnation rule)
    y0 = (math.cos(th) * target + math.sin(th) * e).to(dtype)
    A = a.to(dtype)
    seen = []

    def objective(y):
        seen.append(y.detach().double().clone())
        return (A * y).sum((-1, -2))

    y, info = minimize(objective, y0, trust_radius=rho, max_iter=400)
    assert bool(info["converged"].all())
    assert float((y.double() - target).norm(dim=-1).max()) < 1e-3
    slack = 1 + 1e3 * torch.finfo(dtype).eps
    for k in range(1, len(seen)):
        moves = torch.stack([(seen[k] - p).norm(dim=-1).amax() for p in seen[:k]])
        assert float(moves.min()) <= rho * slack, (k, float(moves.min()))
    chord = float((y0.double() - target).norm(dim=-1).max())
    assert int(info["iterations"][0]) >= math.floor(chord / rho)


def test_tokens_with_zero_preconditioner_stay_and_the_others_converge():
    """pre_i = 0: token i is held (the JKO's massless tokens); the others reach −a_i/|a_i|."""
    a = torch.randn(1, 4, 3, generator=gen(9), dtype=torch.float64)
    y0 = sample_uniform(4, 3, generator=gen(10), dtype=torch.float64)[None]
    pre = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64).reshape(1, 4, 1)
    w = torch.tensor([[0.5, 0.0, 0.5, 0.0]], dtype=torch.float64)
    y, info = minimize(lambda y: (a * y).sum((-1, -2)), y0, preconditioner=pre, weights=w)
    assert bool(info["converged"].all())
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(y[0, [1, 3]], y0[0, [1, 3]], rtol=4 * eps, atol=10 * eps)
    torch.testing.assert_close(y[0, [0, 2]], -normalize(a)[0, [0, 2]], rtol=0, atol=1e-7)


def test_the_retraction_is_the_callers_and_a_layer_norms_retract_fits():
    """The line search steps by ``retract`` (the geometry seam): a counting retraction is called, and
    Projected().retract (x/|x|) gives the default's result to round-off."""
    M, _, _ = rayleigh_problem(2, 4, 11)
    y0 = sample_uniform(2, 4, generator=gen(12), dtype=torch.float64).unsqueeze(1)
    calls = [0]

    def counting(x):
        calls[0] += 1
        return normalize(x)

    def objective(y):
        return ((y @ M) * y).sum((-1, -2))

    y_default, _ = minimize(objective, y0)
    y_count, _ = minimize(objective, y0, retract=counting)
    y_ln, _ = minimize(objective, y0, retract=Projected().retract)
    assert calls[0] > 1  # the start check and the line search's candidates
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(y_count, y_default, rtol=4 * eps, atol=10 * eps)
    torch.testing.assert_close(y_ln, y_default, rtol=4 * eps, atol=10 * eps)


def test_a_non_finite_objective_at_the_start_returns_no_info():
    y0 = normalize(torch.ones(1, 2, 3, dtype=torch.float64))
    y, info = minimize(lambda y: (y * float("nan")).sum((-1, -2)), y0)
    assert info is None
    eps = torch.finfo(torch.float64).eps  # y0 returned unchanged (unit vectors)
    torch.testing.assert_close(y, y0, rtol=4 * eps, atol=4 * eps)


def test_bad_input_is_refused_before_the_objective_is_evaluated():
    calls = [0]

    def objective(y):
        calls[0] += 1
        return y.sum((-1, -2))

    y0 = normalize(torch.ones(2, 3, 4, dtype=torch.float64))
    cases = [
        (dict(objective=5), TypeError, "objective must be callable"),
        (dict(y0=[[1.0, 0.0]]), TypeError, "y0 must be a torch.Tensor"),
        (dict(y0=torch.ones(1, 1, 2, dtype=torch.int64)), TypeError, "float32 or float64"),
        (dict(y0=y0[0]), ValueError, r"shape \(B, n, d\)"),
        (dict(y0=2 * y0), ValueError, "not on the manifold"),
        (dict(y0=y0 * float("nan")), ValueError, "NaN"),
        (dict(retract="normalize"), TypeError, "retract must be callable"),
        (dict(preconditioner=torch.ones(2, 3, dtype=torch.float64)), ValueError, "preconditioner must have shape"),
        (dict(preconditioner=-torch.ones(2, 3, 1, dtype=torch.float64)), ValueError, ">= 0"),
        (dict(preconditioner=torch.ones(2, 3, 1)), TypeError, "dtype and device"),
        (dict(weights=torch.ones(2, 4, dtype=torch.float64)), ValueError, "weights must have shape"),
        (dict(weights=[0.5, 0.5]), TypeError, "weights must be a torch.Tensor"),
        (dict(tau=0.0), ValueError, "tau"),
        (dict(tol=-1e-3), ValueError, "tol"),
        (dict(max_iter=0), ValueError, "max_iter"),
        (dict(max_iter=2.5), TypeError, "max_iter"),
        (dict(memory=0), ValueError, "memory"),
        (dict(trust_radius=float("inf")), ValueError, "trust_radius"),
    ]
    for bad, exc, match in cases:
        kw = dict(objective=objective, y0=y0)
        kw.update(bad)
        with pytest.raises(exc, match=match):
            minimize(kw.pop("objective"), kw.pop("y0"), **kw)
    assert calls[0] == 0


# ---------------------------------------------------------------------------- the two-loop recursion and the line search at their boundaries
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pair_of_zero_curvature_is_masked_and_leaves_gamma_one(dtype):
    """Memory [(s₁, z₁) with ⟨s₁, z₁⟩ > 0, (s₂, z₂) with ⟨s₂, z₂⟩ = 0 exactly] (s₂ and z₂ live on disjoint
    tokens): the newest pair is masked out (only ⟨s, z⟩ > 0 counts), so γ stays 1 and the direction is −P H rg
    with the dense BFGS inverse of the older pair alone, H = (I − ρ s₁z₁ᵀ) Pre (I − ρ z₁s₁ᵀ) + ρ s₁s₁ᵀ."""
    from transformer_pde.solvers.jko.lbfgs import dot, lbfgs_direction

    y = sample_uniform(4, 3, generator=gen(80), dtype=torch.float64)[None]
    P = lambda v: tangent_projection(y, v)  # noqa: E731
    g = gen(81)
    rg = P(torch.randn(1, 4, 3, generator=g, dtype=torch.float64))
    pre = torch.rand(1, 4, 1, generator=g, dtype=torch.float64) + 0.5
    s1 = P(torch.randn(1, 4, 3, generator=g, dtype=torch.float64))
    z1 = P(s1 + 0.3 * torch.randn(1, 4, 3, generator=g, dtype=torch.float64))
    on = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)[None, :, None]
    s2 = P(torch.randn(1, 4, 3, generator=g, dtype=torch.float64)) * on
    z2 = P(torch.randn(1, 4, 3, generator=g, dtype=torch.float64)) * (1 - on)
    y, rg, pre, s1, z1, s2, z2 = (v.to(dtype) for v in (y, rg, pre, s1, z1, s2, z2))
    assert float(dot(s2, z2)) == 0.0 and float(dot(z2, pre * z2)) > 0 and float(dot(s1, z1)) > 0
    d, bad = lbfgs_direction(y, rg, pre, [(s1, z1), (s2, z2)])
    sv, zv = s1.double().reshape(-1), z1.double().reshape(-1)
    Pre = torch.diag(pre.double().expand(1, 4, 3).reshape(-1))
    rho = 1 / float(sv @ zv)
    I = torch.eye(12, dtype=torch.float64)
    H = (I - rho * torch.outer(sv, zv)) @ Pre @ (I - rho * torch.outer(zv, sv)) + rho * torch.outer(sv, sv)
    ref = tangent_projection(y.double(), -(H @ rg.double().reshape(-1)).reshape(1, 4, 3))
    u = torch.finfo(dtype).eps
    assert not bool(bad.any())
    torch.testing.assert_close(d.double(), ref, rtol=1000 * u, atol=1000 * u * float(ref.abs().max()))


def test_the_line_search_accepts_a_step_that_meets_the_armijo_bound_with_equality():
    """Armijo's test is f(y + a d) ≤ f(y) + 1e-4·a·⟨g, d⟩ (+ 10u|f| slack), not '<': on a flat objective
    with f = 0 and ⟨g, d⟩ = 0 the first trial a = 1 meets it with equality and is taken."""
    from transformer_pde.solvers.jko.lbfgs import line_search, value_and_grad

    y = sample_uniform(3, 3, generator=gen(82), dtype=torch.float64)[None]
    objective = lambda v: (0.0 * v).sum((-1, -2))  # noqa: E731
    f, g = value_and_grad(objective, y)
    d = tangent_projection(y, torch.randn(1, 3, 3, generator=gen(83), dtype=torch.float64))
    gd = (g * d).sum((-1, -2))
    assert float(f) == 0.0 and float(gd) == 0.0
    y_new, f_new, g_new, done = line_search(objective, y, f, g, d, gd, torch.tensor([True]))
    assert done.tolist() == [True]
    torch.testing.assert_close(y_new, normalize(y + d), rtol=4 * torch.finfo(torch.float64).eps, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_test_is_inclusive_and_a_stiff_tokens_floor_grows_with_its_start(dtype):
    """The stopping rule r ≤ tol·r₀ + 100·u·(1/τ + r₀) (module docstring) holds with equality (r = bound is
    converged, the next float above is not); for a stiff item (K > 1) every token must also meet
    |G_i| ≤ tol·|G_i(x)| + 100·u·(1/τ + |G_i(x)|): at tol = 0 and |G_i(x)| = 8/τ, tokens at half that
    round-off floor (450·u) are converged."""
    from transformer_pde.solvers.jko.lbfgs import Residual

    u = torch.finfo(dtype).eps
    e = torch.tensor([0.0, 0.6, 0.8], dtype=dtype)  # a unit vector
    rg = e.expand(1, 3, 3).clone()  # |rg_i| = 1
    inv, wt = torch.ones(1, 3, 1, dtype=dtype), torch.full((1, 3), 1 / 3, dtype=dtype)
    res = Residual(rg, inv, wt, torch.tensor([1.0], dtype=dtype), tau=1.0, tol=0.5)
    bound = 0.5 * 1.0 + 100 * u * (1.0 + 1.0)  # r₀ = (Σ w |G_i|²)^{1/2} = 1
    assert float(res.thresh[0]) == pytest.approx(bound, rel=4 * u)
    assert res.unconverged(rg, res.thresh).tolist() == [False]
    assert res.unconverged(rg, torch.nextafter(res.thresh, torch.full_like(res.thresh, 2.0))).tolist() == [True]
    K = torch.tensor([8.0], dtype=dtype)  # stiff: |G_i(x)| = K |rg_i| = 8
    stiff = Residual(rg, inv, wt, K, tau=1.0, tol=0.0)
    small = rg * (450 * u / 8)  # |G_i| = 450 u ≤ 100 u (1 + 8) = 900 u
    r = stiff.total(small)
    assert float(r[0]) == pytest.approx(450 * u, rel=1e-3)
    assert stiff.unconverged(small, r).tolist() == [False]
    assert stiff.unconverged(rg * (1800 * u / 8), stiff.total(rg * (1800 * u / 8))).tolist() == [True]
