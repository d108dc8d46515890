"""transformer_pde.analysis.theory.particles (``tp.diagnostics``): Pendharkar's particle diagnostics against
independent computations: dense per-batch-element sums, autograd of the naive energy, numpy norms, the
closed form of critical_beta, a Runge–Kutta loop written here and a reference tp.simulate run.
Parameters avoid the values at which a slip hides (β ≠ 1, ω not summing to 1, non-uniform token
weights, batched inputs, unbatched inputs where a negative axis matters); several of these tests kill
mutants of the module (docs/MUTATION_REPORT.md)."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy, naive_kernel, random_weights
from transformer_pde import diagnostics as dg
from transformer_pde import theory
from transformer_pde.analysis.clustering import mean_overlap
from transformer_pde.analysis.theory import particles as tparticles

F64 = torch.float64


# ---------------------------------------------------------------------------- dense helpers
def _heads_AV(H, d, seed, beta, omega, batch=()):
    """Non-symmetric scores A_h and values V_h ≠ A_h, ω given."""
    A = 0.4 * torch.randn(*batch, H, d, d, generator=gen(seed), dtype=F64)
    V = 0.4 * torch.randn(*batch, H, d, d, generator=gen(seed + 1), dtype=F64)
    return tp.Heads(A, V, omega, beta), A, V


def _outputs_dense(x, A, V, beta, w):
    """Unnormalized f_h(x_i) = Σ_j w_j e^{β⟨x_i, A_h x_j⟩} V_h x_j, (H, n, d), one unbatched x."""
    K = naive_kernel(x, A, beta) * w                       # (H, n, n): w_j K_hij
    return torch.einsum("hij,hde,je->hid", K, V, x)


def _grads_dense(x, A, beta, w):
    """G_h(x_i) = ½ Σ_j w_j [e^{s_ij} A_h x_j + e^{s_ji} A_hᵀ x_j], (H, n, d)."""
    K = naive_kernel(x, A, beta)                           # K_hij = e^{s_ij}
    t1 = torch.einsum("hij,j,hde,je->hid", K, w, A, x)
    t2 = torch.einsum("hji,j,hed,je->hid", K, w, A, x)
    return 0.5 * (t1 + t2)


def _directional_derivative(fun, x, v):
    """d/dε fun(x + εv) at ε = 0 by autograd, fun: tensor -> (k,) tensor."""
    x = x.detach().clone().requires_grad_(True)
    out = fun(x)
    rows = [torch.autograd.grad(out[k], x, retain_graph=True)[0] for k in range(out.shape[0])]
    return torch.stack([(r * v).sum() for r in rows])


# ---------------------------------------------------------------------------- energies, rates and margins
def test_flat_energies_at_beta_and_token_weights():
    """flat_head_energies and flat_flow's recorded energy at tokens off the sphere, β = 1.7,
    ω ≠ 1, non-uniform weights: E_h = Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}/(2β), E = Σ_h ω_h E_h."""
    x = 1.3 * torch.randn(6, 3, generator=gen(2), dtype=F64) / 3
    om = torch.tensor([0.4, 1.5], dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(3), dtype=F64, scale=0.5, beta=1.7, weights=om)
    w = torch.rand(6, generator=gen(4), dtype=F64) + 0.2
    w = w / w.sum()
    per = torch.stack([naive_energy(x, heads.score[h:h + 1], torch.ones(1, dtype=F64), 1.7, w) for h in range(2)])
    assert_close(dg.flat_head_energies(x, heads, w), per, rtol=1e-12, atol=0)
    tr = dg.flat_flow(x, heads, t1=0.02, dt=0.01, weights=w)
    assert tr.x.shape == (3, 6, 3)
    assert_close(tr.x[0], x)
    assert_close(tr.head_energies[0], per, rtol=1e-12, atol=0)
    assert_close(tr.energy[0], (om * per).sum(), rtol=1e-12, atol=0)


def test_energy_balance_against_dense_formulas():
    """rate = d/dt E along ẋ (autograd of the naive energy), kinetic = Σ w‖ẋ‖², defect = rate − s·kinetic,
    bound = Σ_i w_i‖ẋ_i‖ · Σ_h ω_h R e^{S_h}(‖A_h − V_h‖₂ + ½(1 + βR²‖A_h‖₂)‖A_h − A_hᵀ‖₂) with numpy norms.
    Batch of two token sets, non-symmetric A, V ≠ A, ω = (0.6, 1.7), β = 1.4, non-uniform weights;
    flat tokens off the sphere (R ≠ 1) and sphere tokens, both directions."""
    B, n, d, H, beta = 2, 5, 3, 2, 1.4
    omega = torch.tensor([0.6, 1.7], dtype=F64)
    heads, A, V = _heads_AV(H, d, 30, beta, omega)
    w = random_weights((B, n), 32, 0.2)
    for flat, direction in ((True, "ascent"), (False, "descent")):
        x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=gen(33), dtype=F64)
        if flat:
            x = x * (0.7 + 0.6 * torch.rand(B, n, 1, generator=gen(34), dtype=F64))
        s = 1.0 if direction == "ascent" else -1.0
        eb = dg.energy_balance(x, heads, w, flat=flat, direction=direction)
        for b in range(B):
            xb, wb = x[b], w[b]
            v = (omega[:, None, None] * _outputs_dense(xb, A, V, beta, wb)).sum(0)
            xdot = s * (v if flat else v - (v * xb).sum(-1, keepdim=True) * xb)
            rate = _directional_derivative(lambda y: naive_energy(y, A, omega, beta, wb).reshape(1), xb, xdot)[0]
            speed = xdot.norm(dim=-1)
            kinetic = (wb * speed ** 2).sum()
            R = float(xb.norm(dim=-1).max())
            Sh = (beta * torch.einsum("id,hde,je->hij", xb, A, xb)).amax((-1, -2))
            bound = 0.0
            for h in range(H):
                An, Vn = A[h].numpy(), V[h].numpy()
                bound += float(omega[h]) * R * math.exp(float(Sh[h])) * (
                    np.linalg.norm(An - Vn, 2) + 0.5 * (1 + beta * R * R * np.linalg.norm(An, 2)) * np.linalg.norm(An - An.T, 2))
            bound *= float((wb * speed).sum())
            assert_close(eb.rate[b], rate, rtol=1e-12, atol=0)
            assert_close(eb.kinetic[b], kinetic, rtol=1e-12, atol=0)
            assert_close(eb.defect[b], rate - s * kinetic, rtol=1e-10, atol=1e-13)
            assert_close(eb.bound[b], torch.tensor(bound, dtype=F64), rtol=1e-12, atol=0)
            assert abs(float(eb.defect[b])) <= float(eb.bound[b])


def test_head_energy_rates_with_a_given_velocity_on_unbatched_tokens():
    """dE_h/dt = d/dε E_h(x + εv) (autograd of the naive per-head energy, no ω) for an arbitrary
    velocity and unbatched tokens (n, d); non-symmetric heads, non-uniform weights, β = 0.8."""
    n, d, H, beta = 6, 4, 3, 0.8
    omega = torch.tensor([0.3, 1.1, 2.0], dtype=F64)
    heads, A, V = _heads_AV(H, d, 40, beta, omega)
    x = tp.sphere.sample_uniform(n, d, generator=gen(41), dtype=F64)
    w = random_weights((n,), 42, 0.2)
    vel = torch.randn(n, d, generator=gen(43), dtype=F64)
    one = torch.ones(1, dtype=F64)
    ref = torch.cat([_directional_derivative(
        lambda y, h=h: naive_energy(y, A[h:h + 1], one, beta, w).reshape(1), x, vel) for h in range(H)])
    assert_close(dg.head_energy_rates(x, heads, w, velocity=vel), ref, rtol=1e-12, atol=0)
    assert_close(dg.head_energy_rates(x, heads, w, velocity=vel, flat=True), ref, rtol=1e-12, atol=0)


def test_radial_decomposition_on_a_batch_against_dense_per_element_formulas():
    """Batch of three token sets (the sums over k and the diagonal must act on the head axes, not the
    batch axis): a = ⟨x, f_h⟩, aG = ⟨x, G_h⟩, C_hk = Σ_i w_i ω_k⟨G_h, f_k⟩, S_hk = Σ_i w_i ω_k aG_h a_k,
    flat_rates = Σ_k C_hk = dE_h/dt along the flat flow (autograd), sphere_rates = Σ_k(C − S) =
    dE_h/dt along the sphere flow (autograd), tangential = diag(C − S), and the per-token rates."""
    B, n, d, H, beta = 3, 5, 3, 2, 1.3
    omega = torch.tensor([0.45, 1.6], dtype=F64)
    heads, A, V = _heads_AV(H, d, 50, beta, omega)
    x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=gen(51), dtype=F64)
    # one weight vector (n,) shared by the batch (batched token weights (B, n): tests/test_theory.py::
    # test_per_head_diagnostics_take_a_batch_of_token_weights_on_the_batch_axis)
    w = random_weights((n,), 52, 0.2)
    rd = dg.radial_decomposition(x, heads, w)
    one = torch.ones(1, dtype=F64)
    for b in range(B):
        xb, wb = x[b], w
        f = _outputs_dense(xb, A, V, beta, wb)
        G = _grads_dense(xb, A, beta, wb)
        a = (f * xb).sum(-1)
        aG = (G * xb).sum(-1)
        inner = omega[None, :, None] * torch.einsum("hid,kid->hki", G, f)
        sh = omega[None, :, None] * aG[:, None, :] * a[None, :, :]
        C, S = (inner * wb).sum(-1), (sh * wb).sum(-1)
        assert_close(rd.shadows[b], a, rtol=1e-12, atol=1e-14)
        assert_close(rd.grad_shadows[b], aG, rtol=1e-12, atol=1e-14)
        assert_close(rd.coupling[b], C, rtol=1e-12, atol=1e-14)
        assert_close(rd.shadow[b], S, rtol=1e-12, atol=1e-14)
        assert_close(rd.flat_rates[b], C.sum(-1), rtol=1e-12, atol=1e-14)
        assert_close(rd.sphere_rates[b], (C - S).sum(-1), rtol=1e-12, atol=1e-14)
        assert_close(rd.tangential[b], torch.diagonal(C - S), rtol=1e-12, atol=1e-14)
        assert_close(rd.token_rates[b], (inner - sh).sum(1), rtol=1e-12, atol=1e-14)
        assert_close(rd.flat_token_rates[b], inner.sum(1), rtol=1e-12, atol=1e-14)
        # the rates are the energy derivatives along the two flows
        v = (omega[:, None, None] * f).sum(0)
        Pv = v - (v * xb).sum(-1, keepdim=True) * xb
        for vel, got in ((v, rd.flat_rates[b]), (Pv, rd.sphere_rates[b])):
            ref = torch.cat([_directional_derivative(
                lambda y, h=h: naive_energy(y, A[h:h + 1], one, beta, wb).reshape(1), xb, vel) for h in range(H)])
            assert_close(got, ref, rtol=1e-11, atol=1e-14)


def test_cross_head_coupling_defaults_to_unnormalized_outputs():
    """Default normalization: coupling ⟨f_h, f_k⟩ of the unnormalized outputs, bound δ_hk m_h m_k with
    δ_hk = ‖V_hᵀ V_k‖₂ (numpy) and m_h(x_i) = Σ_j w_j e^{s_ij}; inf on the diagonal."""
    n, d, H, beta = 5, 3, 3, 1.2
    omega = torch.tensor([0.5, 0.9, 1.4], dtype=F64)
    heads, A, V = _heads_AV(H, d, 60, beta, omega)
    x = tp.sphere.sample_uniform(n, d, generator=gen(61), dtype=F64)
    w = random_weights((n,), 62, 0.2)
    inner, bound = dg.cross_head_coupling(x, heads, w)
    f = _outputs_dense(x, A, V, beta, w)
    m = (naive_kernel(x, A, beta) * w).sum(-1)
    assert_close(inner, torch.einsum("hid,kid->hki", f, f), rtol=1e-12, atol=1e-14)
    for h in range(H):
        for k in range(H):
            if h == k:
                assert bool(torch.isinf(bound[h, h]).all())
            else:
                delta = np.linalg.norm(V[h].numpy().T @ V[k].numpy(), 2)
                assert_close(bound[h, k], delta * m[h] * m[k], rtol=1e-12, atol=0)
                assert bool((inner[h, k].abs() <= bound[h, k]).all())


def test_robust_margin_against_its_dense_formula():
    """robust_margin = ω_h‖P f_h‖² − a^h Σ_{k≠h} ω_k a^k − m_h Σ_{k≠h} ω_k δ_hk m_k (sphere) and
    ω_h‖f_h‖² − m_h Σ_{k≠h} ω_k δ_hk m_k (flat), f_h(x_i) = Σ_j w_j e^{β⟨x_i,A_h x_j⟩} A_h x_j,
    m_h the mass, a^h = ⟨x, f_h⟩, δ_hk = ‖A_h A_k‖₂; three non-orthogonal heads, ω ≠ 1, weights."""
    x = tp.sphere.sample_uniform(5, 3, generator=gen(5), dtype=F64)
    om = torch.tensor([0.5, 1.2, 2.0], dtype=F64)
    heads = tp.Heads.random(3, 3, generator=gen(6), dtype=F64, scale=0.6, beta=1.3, weights=om)
    w = torch.rand(5, generator=gen(7), dtype=F64) + 0.2
    w = w / w.sum()
    A = heads.score
    K = naive_kernel(x, A, 1.3) * w  # (H, n, n): w_j e^{β⟨x_i, A x_j⟩}
    m = K.sum(-1)
    f = torch.einsum("hij,hde,je->hid", K, A, x)
    a = (f * x).sum(-1)
    delta = torch.stack([torch.stack([torch.linalg.matrix_norm(A[h] @ A[k], ord=2) if h != k
                                      else torch.zeros((), dtype=F64) for k in range(3)]) for h in range(3)])
    cross = torch.stack([m[h] * sum(om[k] * delta[h, k] * m[k] for k in range(3) if k != h) for h in range(3)])
    others = torch.stack([sum(om[k] * a[k] for k in range(3) if k != h) for h in range(3)])
    Pf2 = f.square().sum(-1) - a.square()
    assert_close(dg.robust_margin(x, heads, w), om[:, None] * Pf2 - a * others - cross, rtol=1e-10, atol=1e-12)
    assert_close(dg.robust_margin(x, heads, w, flat=True), om[:, None] * f.square().sum(-1) - cross,
                 rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- heads, clusters, angles
def test_approximately_orthogonal_heads_weights_and_defect():
    """ω_h defaults to 1 (not the library's 1/H); given weights are kept; δ_hk = α² cos(angle)."""
    H, k, angle, alpha = 3, 2, 60.0, 1.5
    heads = dg.approximately_orthogonal_heads(H, k, angle, alpha=alpha, beta=0.7, dtype=F64)
    assert_close(heads.weights, torch.ones(H, dtype=F64))
    om = torch.tensor([0.2, 0.5, 1.3], dtype=F64)
    heads_w = dg.approximately_orthogonal_heads(H, k, angle, alpha=alpha, beta=0.7, weights=om, dtype=F64)
    assert_close(heads_w.weights, om)
    A = heads.score.numpy()
    for h in range(H):
        for g in range(H):
            if h != g:
                assert np.linalg.norm(A[h] @ A[g], 2) == pytest.approx(alpha ** 2 * math.cos(math.radians(angle)), rel=1e-12)


def test_cluster_count_links_tokens_closer_than_the_geodesic_radius():
    """Two unit tokens at angle θ are one cluster iff θ < radius (geodesic distance)."""
    for radius in (0.5, 1.2):
        for theta, count in ((0.98 * radius, 1), (1.02 * radius, 2)):
            x = torch.tensor([[1.0, 0.0, 0.0], [math.cos(theta), math.sin(theta), 0.0]], dtype=F64)
            assert int(tp.clustering.cluster_count(x, radius=radius, metric="geodesic")) == count, (radius, theta)


def test_principal_angle_errors_name_the_argument():
    M = torch.eye(3, dtype=F64)[:, :2]
    with pytest.raises(ValueError, match=r"^A must be a matrix"):
        dg.principal_angles(M.unsqueeze(0), M)
    with pytest.raises(ValueError, match=r"^B must be a matrix"):
        dg.principal_angles(M, M.unsqueeze(0))


# ---------------------------------------------------------------------------- the flat flow
def _rk4_flat(x, field, dt, K):
    out = [x]
    for _ in range(K):
        k1 = field(x)
        k2 = field(x + 0.5 * dt * k1)
        k3 = field(x + 0.5 * dt * k2)
        k4 = field(x + dt * k3)
        x = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        out.append(x)
    return torch.stack(out)


def test_flat_flow_against_a_hand_written_rk4_of_the_dense_field():
    """ẋ_i = Σ_h ω_h f_h(x_i) (unnormalized, no projection) by classical RK4 written here; the recorded
    tokens, per-head energies E_h = Σ_ij w_i w_j e^{s_ij}/(2β) (β = 1.6), E = Σ ω_h E_h and kinetic."""
    n, d, H, beta, dt, K = 5, 3, 2, 1.6, 0.01, 3
    omega = torch.tensor([0.4, 1.5], dtype=F64)
    A = 0.5 * torch.randn(H, d, d, generator=gen(70), dtype=F64)
    A = A + A.transpose(-1, -2)
    heads = tp.Heads.symmetric(A, beta=beta, weights=omega)
    x0 = 0.8 * tp.sphere.sample_uniform(n, d, generator=gen(71), dtype=F64)
    w = random_weights((n,), 72, 0.2)

    def field(y):
        return (omega[:, None, None] * _outputs_dense(y, A, A, beta, w)).sum(0)

    xs = _rk4_flat(x0, field, dt, K)
    tr = dg.flat_flow(x0, heads, t1=K * dt, dt=dt, weights=w)
    assert_close(tr.times, torch.arange(K + 1, dtype=F64) * dt)
    assert_close(tr.x, xs, rtol=1e-12, atol=1e-14)
    one = torch.ones(1, dtype=F64)
    Eh = torch.stack([torch.stack([naive_energy(xk, A[h:h + 1], one, beta, w) for h in range(H)]) for xk in xs])
    assert_close(tr.head_energies, Eh, rtol=1e-12, atol=0)
    assert_close(tr.energy, (omega * Eh).sum(-1), rtol=1e-12, atol=0)
    kin = torch.stack([(w * field(xk).square().sum(-1)).sum() for xk in xs])
    assert_close(tr.kinetic, kin, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------- radial dominance threshold
def test_radial_dominance_threshold_matches_the_closed_form_below_one():
    """Equal heads λI, orthogonal tokens: β* = (1/(2λ)) ln(c*²(n−1)/(1 − c*²)) (critical_beta), here
    ≈ 0.028 < 1.  The bisection must reach relative accuracy tol = 1e-6 (rtol 2e-6: the midpoint
    of the final bracket is within tol/2 of β*, plus the closed form's rounding)."""
    lam, n, tol = 20.0, 6, 1e-6
    c = (math.sqrt(1 + 4) - 1) / 2                     # c*(2), root of c² + c − 1 = 0
    ref = math.log(c * c * (n - 1) / (1 - c * c)) / (2 * lam)
    out = dg.radial_dominance_threshold(n, [lam, lam], tol=tol)
    assert_close(out, torch.full((2,), ref, dtype=F64), rtol=2e-6, atol=0)


def test_radial_dominance_threshold_stops_at_the_requested_tolerance(monkeypatch):
    """The bisection stops once the bracket is within tol: starting from [1e-9, 1] (β* ≈ 0.028 < 1),
    ⌈log2(1/(tol·β*))⌉ + 1 halvings suffice, plus three evaluations outside the loop (β → 0⁺ and the
    bracket's upper end twice)."""
    calls = {"n": 0}
    orig = tparticles.radial_dominance_margin

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(tparticles, "radial_dominance_margin", counting)
    lam, n, tol = 20.0, 6, 1e-3
    out = dg.radial_dominance_threshold(n, [lam, lam], tol=tol)
    ref = theory.critical_beta(2, n, lam)
    assert_close(out, torch.full((2,), ref, dtype=F64), rtol=tol, atol=0)
    assert calls["n"] <= 3 + math.ceil(math.log2(1 / (tol * ref))) + 1


def test_radial_dominance_threshold_at_the_regular_simplex():
    """γ = −1/(n−1): the tokens span n − 1 dimensions (still embedded in d = n); the closed form has
    r = 1, β* = 0, so the margin is negative for every β > 0: threshold −inf."""
    for n in (3, 5):
        assert theory.critical_beta(2, n, 1.3, gamma=-1 / (n - 1)) <= 0
        out = dg.radial_dominance_threshold(n, [1.3, 1.3], gamma=-1 / (n - 1))
        assert out.shape == (2,) and bool((out == -math.inf).all())


# ---------------------------------------------------------------------------- clustering hitting time
def _overlap(x):
    """γ̄ = mean over i ≠ j of ⟨x_i, x_j⟩ (:func:`mean_overlap`, the statistic the docstring names),
    evaluated in the tokens' dtype on one state (..., n, d), returned as float64."""
    return mean_overlap(x)[0].to(F64)


def test_clustering_hitting_time_interpolates_between_the_bracketing_steps():
    """The crossing time is the linear interpolation of γ̄ between the two steps that bracket the
    target, from a reference run of ``tp.simulate`` that records every step.  Two ensemble members
    crossing at different steps; float32 tokens (the interpolation itself is float64: rtol 1e-12)."""
    heads = tp.Heads.scalar(torch.tensor([1.0, 2.2]), 3, beta=1.3, weights=torch.tensor([0.7, 0.6]))
    x0 = tp.sphere.sample_uniform(6, 3, batch_shape=(2,), generator=gen(80), dtype=torch.float32)
    dt, K = 0.05, 40
    run = tp.simulate(x0, heads, t1=K * dt, dt=dt, method="rk4", normalization="softmax", direction="ascent",
                      diagnostics=False, record_every=1)
    g = torch.stack([_overlap(xk) for xk in run.x])         # (K+1, 2), step by step
    g0 = g[0]
    target = float(g0.max()) + 0.3 * float((g[K] - g0).min())
    expected = []
    for b in range(2):
        k = int(torch.nonzero(g[:, b] >= target)[0])
        assert k >= 2  # crossing after a few steps, so the interpolation runs from a recorded step
        expected.append((k - 1) * dt + (target - float(g[k - 1, b])) / float(g[k, b] - g[k - 1, b]) * dt)
    hit = dg.clustering_hitting_time(x0, heads, target=target, t_max=K * dt, dt=dt)
    assert hit.dtype == F64
    assert_close(hit, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


def test_clustering_hitting_time_in_the_first_step():
    """Crossing inside the first step: T = dt (target − γ̄0)/(γ̄1 − γ̄0)."""
    heads = tp.Heads.scalar(torch.tensor([1.5, 0.8], dtype=F64), 3, beta=0.9, weights=torch.tensor([1.0, 0.5], dtype=F64))
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(81), dtype=F64)
    dt = 0.1
    x1 = tp.simulate(x0, heads, t1=dt, dt=dt, method="rk4", normalization="softmax", direction="ascent",
                     diagnostics=False).x[-1]
    g0, g1 = float(_overlap(x0)), float(_overlap(x1))
    assert g1 > g0
    target = g0 + 0.4 * (g1 - g0)
    hit = dg.clustering_hitting_time(x0, heads, target=target, t_max=1.0, dt=dt)
    assert float(hit) == pytest.approx(0.4 * dt, rel=1e-10)
    # a target already reached at t = 0
    assert float(dg.clustering_hitting_time(x0, heads, target=g0 - 0.1, t_max=1.0, dt=dt)) == 0.0


def test_clustering_hitting_time_refuses_targets_outside_the_open_interval():
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(82), dtype=F64)
    heads = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), 3)
    for bad in (-1.0, 1.0, -1, 1.5):
        with pytest.raises(ValueError, match=r"target must be a number in \(-1, 1\)"):
            dg.clustering_hitting_time(x0, heads, target=bad, t_max=1.0, dt=0.1)


def test_cross_head_coupling_relu_mass_weights_the_keys_of_unbatched_tokens(dtype):
    """normalization="relu", one unbatched x (n, d) and non-uniform weights: the bound is δ_hk M_h M_k with
    M_h(x_i) = Σ_j w_j ReLU(β⟨x_i, A_h x_j⟩) — the weight of the key j, not of the query i — and
    δ_hk = ‖V_hᵀ V_k‖₂ (numpy)."""
    n, d, H, beta = 6, 3, 3, 1.3
    heads, A, V = _heads_AV(H, d, 70, beta, torch.tensor([0.5, 0.9, 1.4], dtype=F64))
    x = tp.sphere.sample_uniform(n, d, generator=gen(71), dtype=F64)
    w = random_weights((n,), 72, 0.1)
    _, bound = dg.cross_head_coupling(x.to(dtype), heads.to(dtype), w.to(dtype), normalization="relu")
    assert bound.shape == (H, H, n) and bound.dtype == dtype
    S = beta * torch.einsum("id,hde,je->hij", x, A, x)
    M = (torch.relu(S) * w).sum(-1)  # (H, n): Σ_j w_j ReLU(s_ij)
    tol = 1e-12 if dtype == F64 else 1e-5
    for h in range(H):
        assert bool(torch.isinf(bound[h, h]).all())
        for k in range(H):
            if h != k:
                delta = np.linalg.norm(V[h].numpy().T @ V[k].numpy(), 2)
                assert_close(bound[h, k].double(), delta * M[h] * M[k], rtol=tol, atol=0)


def test_principal_angles_of_a_subspace_with_itself_are_zero(dtype):
    """θ(A, A) = 0 and θ(A, A R) = 0 (R invertible: the same column space), finite although the computed
    cosines of U_Aᵀ U_A round up to 1 + ulp in most draws: arccos(1 − ε) ≈ √(2ε), so a few √eps at most."""
    tol = 50 * math.sqrt(torch.finfo(dtype).eps)
    for seed in range(8):
        A = torch.randn(6, 3, generator=gen(80 + seed), dtype=F64)
        R = torch.randn(3, 3, generator=gen(90 + seed), dtype=F64) + 3 * torch.eye(3, dtype=F64)
        for B in (A, A @ R):
            th_ = dg.principal_angles(A.to(dtype), B.to(dtype))
            assert th_.shape == (3,) and th_.dtype == dtype
            assert bool(torch.isfinite(th_).all()) and float(th_.abs().max()) <= tol, (seed, th_)


@pytest.mark.parametrize("lambdas", [[], [float("inf")], [1.0, float("inf")], [float("nan")], [1.0, 0.0], [-1.0]])
def test_radial_dominance_threshold_refuses_bad_head_strengths(lambdas):
    """Each refusal before any field evaluation: no strengths, an infinite, NaN, zero or negative one."""
    with pytest.raises(ValueError, match="lambdas must be one or more finite positive head strengths"):
        dg.radial_dominance_threshold(4, lambdas)
