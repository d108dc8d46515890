"""Oracle tests written for the gaps the mutation pass (docs/MUTATION_REPORT.md) found: each
checks a formula against an independent dense computation, at parameters where a plausible
slip (β or κ = 1, ω = 1, unit token weights, an unbatched input) would hide it."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy, naive_kernel
from transformer_pde import diagnostics as dg
from transformer_pde.solvers.parts import process_signature

F64 = torch.float64


def test_ou_moments_at_a_rate_other_than_one():
    """κ = 0.5 (at κ = 1, 2κ = 2/κ): variance σ²(1 − e^{−2κt})/(2κ) on the diagonal, half off it;
    mean Ā + e^{−κt}(A0 − Ā)."""
    h = tp.Heads.random(2, 3, generator=gen(1), dtype=F64)
    kappa, sigma, t = 0.5, 0.7, 1.3
    proc = tp.OrnsteinUhlenbeck(h, rate=kappa, sigma=sigma)
    mean, var = proc.moments(t)
    v = sigma ** 2 * (1 - math.exp(-2 * kappa * t)) / (2 * kappa)
    assert_close(var.diagonal(), torch.full((3,), v, dtype=F64), rtol=1e-14, atol=0)
    assert_close(var[0, 1], torch.tensor(v / 2, dtype=F64), rtol=1e-14, atol=0)
    Abar = proc.mean
    assert_close(mean, Abar + math.exp(-kappa * t) * (h.score - Abar), rtol=1e-14, atol=1e-15)


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


def test_velocity_passes_causal_through():
    """tp.velocity(causal=True) is the prefix-measure field: token i sees tokens j ≤ i only."""
    x = tp.sphere.sample_uniform(5, 3, generator=gen(8), dtype=F64)
    heads = tp.Heads.random(1, 3, generator=gen(9), dtype=F64)
    v = tp.velocity(x, heads, causal=True)
    for i in range(5):  # the i-th token's field from the prefix x[:i+1] alone, without causal
        vi = tp.velocity(x[: i + 1], heads)[i]
        assert_close(v[i], vi, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(v, tp.velocity(x, heads))


def test_butcher_tableau_refuses_inconsistent_coefficients():
    """A tableau whose rows do not sum to c, or that claims order 2 without Σ b_i c_i = ½, is refused."""
    T = tp.solvers.particle.ButcherTableau
    with pytest.raises(ValueError, match="c\\[1\\] must equal the sum of row 1"):
        T("bad", 2, (0.0, 0.5), ((), (0.7,)), (0.0, 1.0))  # row sum 0.7 ≠ c_2 = 0.5
    with pytest.raises(ValueError, match="order >= 2 needs"):
        T("bad", 2, (0.0, 1.0), ((), (1.0,)), (0.0, 1.0))  # Σ b c = 1 ≠ ½
    with pytest.raises(ValueError, match="order >= 2 needs"):
        T("bad", 2, (0.0, 0.25), ((), (0.25,)), (0.0, 1.0))  # Σ b c = ¼ (and −¼ − ½ ≠ 0 either)
    T("midpoint", 2, (0.0, 0.5), ((), (0.5,)), (0.0, 1.0))  # the midpoint rule is accepted


def test_process_signature_changes_with_every_head_tensor_and_beta():
    """The checkpoint fingerprint sees the heads' scores, values, weights and β: changing any
    one of them changes the signature (so a checkpoint of other weights is refused)."""
    h = tp.Heads.random(2, 3, generator=gen(10), dtype=F64, beta=1.3, weights=torch.tensor([1.0, 2.0], dtype=F64))

    def sig(heads):
        return repr([t.tolist() if isinstance(t, torch.Tensor) else t for t in process_signature(
            tp.OrnsteinUhlenbeck(heads, sigma=0.5))])

    base = sig(h)
    assert sig(tp.Heads(h.score + 1e-3, weights=h.weights, beta=1.3)) != base
    assert sig(tp.Heads(h.score, weights=h.weights * 2, beta=1.3)) != base
    assert sig(tp.Heads(h.score, weights=h.weights, beta=1.4)) != base
    assert sig(tp.Heads(h.score, weights=h.weights, beta=1.3)) == base


def test_adaptive_records_weighted_observables_and_adjoint_sees_token_weights():
    """method="adaptive" with token weights: the observables are evaluated with those weights at
    the recorded tokens, the Trajectory keeps them, the sphere error is reported, and the adjoint
    gradient (which rebinds the weights) equals backprop through the solve."""
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(11), dtype=F64)
    w = torch.rand(6, generator=gen(12), dtype=F64) + 0.2
    w = w / w.sum()
    A = tp.Heads.random(2, 3, generator=gen(13), dtype=F64).score.clone().requires_grad_(True)
    obs = {"mean": lambda x, wt: (wt.unsqueeze(-1) * x).sum(-2)}

    def run(adjoint):
        return tp.simulate(x0, tp.Heads(A), t1=0.3, dt=0.1, method="adaptive", weights=w, adjoint=adjoint,
                           observables=obs, rtol=1e-10, atol=1e-12, diagnostics=False)

    tr = run(False)
    assert tr.weights is w
    assert_close(tr.observables["mean"], (w.unsqueeze(-1) * tr.x).sum(-2).detach())
    assert 0.0 <= tr.stats["max_sphere_error"] < 1e-6
    ga = torch.autograd.grad(run(True).x[-1][:, 0].sum(), A)[0]
    gb = torch.autograd.grad(tr.x[-1][:, 0].sum(), A)[0]
    assert float(gb.abs().max()) > 1e-3
    assert_close(ga, gb, rtol=1e-7, atol=1e-9)


def test_to_grid_against_the_kernel_density_batched_and_default_bandwidth():
    """to_grid: q_a ∝ Σ_i w_i exp((⟨z_a, x_i⟩ − 1)/h²), Σ_a q_a = 1, for a batch of two token sets
    with their own weights (2 ≠ m), and the default h = 2 × the grid's mean nearest-neighbour
    (chordal) distance computed here independently."""
    grid = tp.sphere.fibonacci_sphere(30, dtype=F64)
    x = torch.stack([tp.sphere.sample_uniform(7, 3, generator=gen(s), dtype=F64) for s in (14, 15)])
    w = torch.rand(2, 7, generator=gen(16), dtype=F64) + 0.2
    w = w / w.sum(-1, keepdim=True)
    dist = torch.cdist(grid, grid) + torch.diag(torch.full((30,), float("inf"), dtype=F64))
    h = 2 * float(dist.min(-1).values.mean())
    dense = (w.unsqueeze(-1) * torch.exp((x @ grid.T - 1) / h ** 2)).sum(-2)
    dense = dense / dense.sum(-1, keepdim=True)
    assert_close(tp.to_grid(x, grid, weights=w, bandwidth=h), dense, rtol=1e-12, atol=1e-15)
    assert_close(tp.to_grid(x, grid, weights=w), dense, rtol=1e-10, atol=1e-15)


def test_energy_time_derivative_at_unit_sigma():
    """σ = 1.0 exactly (a float): the Itô term σ²β/8 Σ ω Σ w w e^{β⟨x,Ax⟩}(1 + ⟨x_i, x_j⟩²) is added."""
    from problems import naive_ito

    x = tp.sphere.sample_uniform(6, 3, generator=gen(17), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(18), dtype=F64, beta=1.3)
    got = tp.energy_time_derivative(x, heads, torch.zeros(2, 3, 3, dtype=F64), sigma=1.0)
    want = naive_ito(x, heads.score, heads.weights, 1.3, torch.full((6,), 1 / 6, dtype=F64), 1.0)
    assert float(want) > 0
    assert_close(got, want, rtol=1e-11, atol=0)


def test_adaptive_nonfinite_error_names_the_solver_step_not_the_grid_row(monkeypatch):
    """With layer starts added to the adaptive grid and record_every > 1, a non-finite token is
    reported at its time and solver step k = (t − t0)/dt (not its row in the internal grid)."""
    from transformer_pde.solvers import particle

    real = particle._dopri5

    def nan_at_row_2(*args, **kwargs):
        ys, nfe = real(*args, **kwargs)
        ys = ys.clone()
        ys[2] = float("nan")  # grid [0, 0.15, 0.2, 0.3, 0.4]: row 2 is t = 0.2, step 4 of dt = 0.05
        return ys, nfe

    monkeypatch.setattr(particle, "_dopri5", nan_at_row_2)
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(19), dtype=F64)
    layers = [tp.Heads.random(1, 3, generator=gen(s), dtype=F64) for s in (20, 21, 22)]
    with pytest.raises(tp.NonFiniteError, match=r"t = 0\.2\b.*\(step 4\)"):
        tp.simulate(x0, tp.Layerwise(layers, layer_time=0.15), t1=0.4, dt=0.05, method="adaptive",
                    record_every=4)
