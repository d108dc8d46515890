"""Particle solver: closed forms, convergence orders, invariants, dtypes."""


import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde import sphere
from conftest import gen
from problems import (assert_replayed, equiangular_gamma_rate, fit_slope, integrate, interrupt_and_resume, two_token_angle_rate,
                      two_tokens)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_two_tokens_angle_closed_form(normalization):
    lam, beta, theta0, T = 1.3, 0.8, 2.0, 3.0
    times = np.linspace(0, T, 31)
    theta = integrate(lambda t, y: [two_token_angle_rate(y[0], lam, beta, normalization)], [theta0], times)[0]
    traj = tp.simulate(two_tokens(theta0), tp.Heads.scalar(torch.tensor([lam], dtype=torch.float64), 3, beta=beta),
                       t1=T, dt=0.01, method="rk4", direction="ascent", normalization=normalization, record_every=10, ledger=True)
    x = traj.x
    got = torch.arccos((x[:, 0] * x[:, 1]).sum(-1).clamp(-1, 1))
    assert_close(got, torch.as_tensor(theta), atol=1e-8, rtol=0)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_equiangular_reduced_ode(normalization):
    n, g0, T = 5, 0.1, 2.0
    lambdas, omegas, beta = [0.7, 1.5], [0.4, 0.6], 1.2
    times = np.linspace(0, T, 21)
    gamma = integrate(lambda t, y: [equiangular_gamma_rate(y[0], lambdas, omegas, n, beta, normalization)], [g0],
                      times)[0]
    heads = tp.Heads.scalar(torch.tensor(lambdas, dtype=torch.float64), n, beta=beta,
                            weights=torch.tensor(omegas, dtype=torch.float64))
    traj = tp.simulate(sphere.equiangular(n, g0, n, dtype=torch.float64), heads, t1=T, dt=0.01, method="rk4",
                       direction="ascent", normalization=normalization, record_every=10, ledger=True)
    G = traj.x @ traj.x.transpose(-1, -2)
    off = G[:, ~torch.eye(n, dtype=torch.bool)]
    # the configuration stays equiangular, and γ follows the reduced ODE
    assert_close(off, off[:, :1].expand_as(off), atol=1e-10, rtol=0)
    assert_close(off[:, 0], torch.as_tensor(gamma), atol=1e-8, rtol=0)


def _order_problem(method, process=None):
    x0 = sphere.sample_uniform(8, 3, generator=gen(1), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(2), dtype=torch.float64, scale=0.7)
    theta = heads if process is None else process(heads)
    # rk4 at dt = 0.004 is ~(0.004/0.025)^4 ≈ 1e-3 of the finest error below: a clean reference
    ref = tp.simulate(x0, theta, t1=1.0, dt=0.004, method="rk4", diagnostics=False, direction="descent").final
    dts = [0.2, 0.1, 0.05, 0.025] if method == "rk4" else [0.1, 0.05, 0.025, 0.0125]
    errs = [(tp.simulate(x0, theta, t1=1.0, dt=dt, method=method, diagnostics=False, direction="descent").final - ref).norm().item()
            for dt in dts]
    return fit_slope(dts, errs)


@pytest.mark.parametrize("method,order", [("euler", 1), ("heun", 2), ("rk4", 4)])
def test_convergence_order_constant_heads(method, order):
    assert tp.TABLEAUX[method].order == order
    slope = _order_problem(method)
    assert abs(slope - order) < 0.25, slope


@pytest.mark.parametrize("method,order", [("heun", 2), ("rk4", 4)])
def test_convergence_order_with_closed_form_weights(method, order):
    """Stages see the oscillating weights at their own times: the order is kept."""
    slope = _order_problem(method, lambda h: tp.Oscillating(h))
    assert abs(slope - order) < 0.3, slope


def test_adaptive_matches_rk4_reference():
    x0 = sphere.sample_uniform(8, 3, generator=gen(3), dtype=torch.float64)
    theta = tp.Oscillating(tp.Heads.random(3, 3, generator=gen(4), dtype=torch.float64))
    ref = tp.simulate(x0, theta, t1=1.0, dt=2e-3, method="rk4", ledger=True, direction="descent")
    ad = tp.simulate(x0, theta, t1=1.0, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12, ledger=True, direction="descent")
    assert_close(ad.final, ref.final, atol=1e-8, rtol=0)
    assert_close(ad.energy[-1], ref.energy[-1], atol=1e-8, rtol=0)


def test_tokens_stay_on_sphere_float64():
    x0 = sphere.octahedral(50, dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(4, 3, generator=gen(5), dtype=torch.float64))
    for method in ("euler", "heun", "rk4"):
        tr = tp.simulate(x0, theta, t1=1.0, dt=0.01, method=method, paths=2, ledger=True, direction="descent")
        assert (tr.x.norm(dim=-1) - 1).abs().max() < 1e-12


def test_float32_follows_input_and_agrees():
    x0 = sphere.octahedral(30, dtype=torch.float64)
    heads = tp.Heads.random(3, 3, generator=gen(6), dtype=torch.float64)
    t64 = tp.simulate(x0, tp.Oscillating(heads), t1=1.0, dt=0.01, ledger=True, direction="descent")
    t32 = tp.simulate(x0.float(), tp.Oscillating(heads.to(torch.float32)), t1=1.0, dt=0.01, ledger=True, direction="descent")
    assert t32.x.dtype == torch.float32 and t32.energy.dtype == torch.float32
    assert_close(t32.x, t64.x.float(), atol=1e-4, rtol=0)
    assert_close(t32.ledger["residual"], t64.ledger["residual"].float(), atol=1e-4, rtol=0)


def test_record_every_and_shapes():
    x0 = sphere.sample_uniform(6, 3, batch_shape=(2,), generator=gen(7), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(8), dtype=torch.float64))
    tr = tp.simulate(x0, theta, t1=1.0, dt=0.1, paths=3, record_every=3, ledger=True, direction="descent")
    assert_close(tr.times, torch.tensor([0.0, 0.3, 0.6, 0.9, 1.0], dtype=torch.float64))
    assert tr.x.shape == (5, 3, 2, 6, 3)
    assert tr.energy.shape == (5, 3, 2)
    for v in tr.ledger.values():
        assert v.shape == (5, 3, 2)
    # records at the recorded steps equal an every-step run
    full = tp.simulate(x0, theta, t1=1.0, dt=0.1, paths=3, record_every=1, ledger=True, direction="descent")
    assert_close(full.x[[0, 3, 6, 9, 10]], tr.x)
    assert_close(full.ledger["residual"][[0, 3, 6, 9, 10]], tr.ledger["residual"])


def test_nonfinite_run_stops_with_time_step_and_quantity():
    x0 = sphere.sample_uniform(10, 3, generator=gen(9), dtype=torch.float64)
    heads = tp.Heads.scalar(torch.tensor([400.0], dtype=torch.float64), 3, beta=2.0)
    with pytest.raises(tp.NonFiniteError, match=r"at t = .* \(step \d+\).*β·max\|A_h\|"):
        tp.simulate(x0, heads, t1=1.0, dt=0.1, normalization="unnormalized", ledger=True, direction="descent")


def test_callback_and_progress_do_not_change_results():
    x0 = sphere.sample_uniform(6, 3, generator=gen(10), dtype=torch.float64)
    theta = tp.Oscillating(tp.Heads.random(2, 3, generator=gen(11), dtype=torch.float64))
    seen = []
    a = tp.simulate(x0, theta, t1=0.5, dt=0.1, callback=lambda k, t, x: seen.append(k), progress=True, ledger=True, direction="descent")
    b = tp.simulate(x0, theta, t1=0.5, dt=0.1, ledger=True, direction="descent")
    assert seen == [1, 2, 3, 4, 5]
    assert_replayed(a.x, b.x, "x")


def test_checkpoint_resume_replays_the_run(tmp_path):
    x0 = sphere.sample_uniform(6, 3, generator=gen(12), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64))
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, record_every=3, ledger=True)
    full = tp.simulate(x0, theta, **kw)
    ck = tmp_path / "run.ckpt"

    resumed = interrupt_and_resume(x0, theta, ck, stop_at=13, **kw)
    assert_replayed(resumed.times, full.times, "times")
    assert_replayed(resumed.x, full.x, "x")
    assert_replayed(resumed.ledger, full.ledger, "ledger")
    # a foreign checkpoint (other seed) and a corrupted one are refused
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, theta, checkpoint=ck, **{**kw, "seed": 4}, direction="descent")
    # other weights (OU rate, σ, or β) with the same initial heads are another run too
    other = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64), rate=2.0)
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, other, checkpoint=ck, **kw, direction="descent")
    hb = tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64)
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, tp.OrnsteinUhlenbeck(tp.Heads(hb.score, beta=2.0)), checkpoint=ck, **kw, direction="descent")
    ck.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupted"):
        tp.simulate(x0, theta, checkpoint=ck, **kw, direction="descent")


# ==================================================================================================
# The adaptive solver against fine RK4 and the adjoint, layer knots met up to rounding, energy scales at
# large β, tableaux, stats, paths, progress and the error messages of the particle solver.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
import math  # noqa: E402

from problems import naive_energy  # noqa: E402

F64 = torch.float64


# ---------------------------------------------------------------------------- adaptive solver: knots, scales, gradients
@pytest.mark.parametrize("t0,t1,dt,layer_start,layer_time,k", [
    (-0.3, 0.3, 0.1, -0.3, 0.3, 3),  # record time −0.3 + 3·0.1 = 5.6e-17, the knot 0.0 (a span symmetric about 0)
    (999999.98, 1000000.18, 0.01, 0.0, 1000000.06, 8),  # record time = the knot − 1.2e-10 (one ulp at 1e6)
    (-0.9, 0.3, 0.1, -0.9, 0.6, 6),  # t0 + t1 < 0: record time −0.29999999999999993, the knot −0.30000000000000004
], ids=["symmetric-span", "large-t", "negative-sum"])
def test_adaptive_ledger_books_a_layer_jump_at_a_record_time_equal_to_the_knot_up_to_rounding(
        t0, t1, dt, layer_start, layer_time, k):
    """Piecewise-constant Layerwise heads whose layer start equals a record time only up to rounding:
    the adaptive ledger books the jump E(x, Θ_1) − E(x, Θ_0) once, at that time (∂_tE = 0 inside the
    layers, so "partial" is exactly the dense jump at the recorded tokens), and the ledger closes
    (the trapezoid residual, ~1e-4 here, is far below the jump, ~0.4)."""
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(60), dtype=F64)
    w = torch.rand(6, generator=gen(61), dtype=F64) + 0.2
    w = w / w.sum()
    om = torch.tensor([0.6, 1.7], dtype=F64)
    a = tp.Heads.random(2, 3, generator=gen(62), dtype=F64, beta=1.3, weights=om, scale=0.1)
    b = tp.Heads(a.score + 0.8 * torch.eye(3, dtype=F64), weights=om, beta=1.3)
    lw = tp.Layerwise([a, b], layer_time=layer_time, t0=layer_start)
    (knot,) = lw.knots(t0, t1)
    tk = float(t0 + k * dt)
    assert tk != knot and abs(tk - knot) < 1e-9 * (t1 - t0)  # the case under test
    tr = tp.simulate(x0, lw, t0=t0, t1=t1, dt=dt, method="adaptive", weights=w, rtol=1e-10, atol=1e-12, ledger=True, direction="descent")
    xk = tr.x[k]
    jump = naive_energy(xk, b.score, om, 1.3, w) - naive_energy(xk, a.score, om, 1.3, w)
    assert float(jump) > 0.1
    assert_close(tr.ledger["partial"][k:], jump.expand(len(tr.times) - k), rtol=1e-10, atol=0)
    assert_close(tr.ledger["partial"][:k], torch.zeros(k, dtype=F64), rtol=0, atol=0)
    assert float(tr.ledger["residual"].abs().max()) < 1e-3 * float(jump)


def test_adaptive_run_at_large_beta_reports_log_energy_at_one_common_scale():
    """β = 420, ‖A‖ ≈ 1 in float64: the largest log-partition (≈ 420) exceeds half the exponent range, so
    the energy is reported times e^{−c}, c fixed once at t0.  log E(t) = log(energy) + c equals the dense
    log Σ_h ω_h Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}/(2β) (log-sum-exp) at every recorded time, the first
    included (agreement to 1e-12 absolute on log E ≈ 420: a few ulps), and the ledger closes."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(70), dtype=F64)
    w = torch.rand(5, generator=gen(71), dtype=F64) + 0.2
    w = w / w.sum()
    om = torch.tensor([0.7, 1.6], dtype=F64)
    A = tp.Heads.random(2, 3, generator=gen(72), dtype=F64, scale=0.05).score + torch.eye(3, dtype=F64)
    beta = 420.0
    tr = tp.simulate(x0, tp.Heads(A, weights=om, beta=beta), t1=0.02, dt=0.005, method="adaptive", weights=w,
                     rtol=1e-9, atol=1e-12, ledger=True, direction="descent")
    assert tr.stats["energy_log_scale"] > 300
    logK = beta * torch.einsum("tid,hde,tje->thij", tr.x, A, tr.x)
    logE = torch.logsumexp(logK + torch.log(w)[:, None] + torch.log(w)[None, :] + torch.log(om)[:, None, None],
                           (-1, -2, -3)) - math.log(2 * beta)
    assert_close(tr.log_energy(), logE, rtol=0, atol=1e-12)
    # trapezoid residual ≈ (Δt)²/12 × the energy's curvature: 1e-5 of |dE| here
    assert float(tr.ledger["residual"].abs().max()) < 1e-4 * float(tr.ledger["dE"].abs().max())


def test_adaptive_backprop_gradient_through_time_dependent_heads_matches_the_adjoint():
    """Oscillating heads (per-head phase, Θ depends on t): the gradient of ⟨M, x(t1)⟩ with respect to the
    initial scores by backpropagation through the dopri5 solve equals the adjoint-ODE gradient.  The solve's
    first step must not depend on the parameters (the field is evaluated at float(t), so a differentiable
    step-size choice would leave a spurious term, 1 % here); both gradients agree to ~1e-5 relative at
    rtol = 1e-5 (measured 3e-5), far below that."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(80), dtype=F64)
    w = torch.rand(5, generator=gen(81), dtype=F64) + 0.2
    w = w / w.sum()
    S = tp.Heads.random(2, 3, generator=gen(82), dtype=F64, scale=0.5).score.clone().requires_grad_(True)
    M = torch.randn(5, 3, generator=gen(83), dtype=F64)

    def grad(adjoint):
        proc = tp.Oscillating(tp.Heads(S, beta=1.3, weights=torch.tensor([0.6, 1.5], dtype=F64)), phase="per_head")
        tr = tp.simulate(x0, proc, t1=0.6, dt=0.2, method="adaptive", weights=w, rtol=1e-5, atol=1e-7,
                         adjoint=adjoint, diagnostics=False, direction="descent")
        return torch.autograd.grad((tr.x[-1] * M).sum(), S)[0]

    ga, gb = grad(True), grad(False)
    assert float(gb.abs().max()) > 0.1
    assert float((ga - gb).abs().max()) < 1e-3 * float(gb.abs().max())


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
                           observables=obs, rtol=1e-10, atol=1e-12, diagnostics=False, direction="descent")

    tr = run(False)
    assert tr.weights is w
    assert_close(tr.observables["mean"], (w.unsqueeze(-1) * tr.x).sum(-2).detach())
    assert 0.0 <= tr.stats["max_sphere_error"] < 1e-6
    ga = torch.autograd.grad(run(True).x[-1][:, 0].sum(), A)[0]
    gb = torch.autograd.grad(tr.x[-1][:, 0].sum(), A)[0]
    assert float(gb.abs().max()) > 1e-3
    assert_close(ga, gb, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("interpolation,t0,rtol,tol", [
    ("constant", 0.0, 1e-6, 1e-7),  # measured 9e-9: each layer is a smooth piece for dopri5
    ("linear", 1000.0, 1e-7, 1e-4),  # measured 1.5e-6 (Ȧ jumps at the layer starts), tokens move 8e-3
])
def test_adaptive_layerwise_solve_against_fine_rk4(interpolation, t0, rtol, tol):
    """Layers 1e-3 long (three of them, Θ jumping or Ȧ jumping at the layer starts, which are record times):
    the adaptive solve, one dopri5 piece per layer seeing that layer's own Θ up to its end (the left limit
    there), agrees with rk4 at dt = 1e-4 (steps ending on the layer starts; its error ~dt⁴ is negligible).
    Freezing Θ over a piece, or reading the next layer at a piece's end, errs by 2e-3 / 3e-5."""
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(90), dtype=F64)
    w = torch.rand(6, generator=gen(91), dtype=F64) + 0.2
    w = w / w.sum()
    om = torch.tensor([0.6, 1.7], dtype=F64)
    layers = [tp.Heads.random(2, 3, generator=gen(92 + l), dtype=F64, beta=1.3, weights=om) for l in range(3)]
    lw = tp.Layerwise(layers, interpolation=interpolation, layer_time=1e-3, t0=t0)
    kw = dict(t0=t0, t1=t0 + 3e-3, weights=w, diagnostics=False)
    tr = tp.simulate(x0, lw, dt=1e-3, method="adaptive", rtol=rtol, atol=rtol * 1e-2, **kw, direction="descent")
    ref = tp.simulate(x0, lw, dt=1e-4, method="rk4", record_every=10, **kw, direction="descent")
    assert float((ref.x[-1] - x0).abs().max()) > 5e-3
    assert float((tr.x - ref.x).abs().max()) < tol


def test_adaptive_solve_with_a_layer_start_just_before_t1_at_large_t():
    """t ≈ 1e6, a layer start 1e-3 before t1 (a piece of its own, however large t is): the adaptive solve
    (rtol 1e-8; measured 3e-9) agrees with rk4 at dt = 1e-3 (steps end on the layer start; dt = 5e-4
    changes it by 1e-12).  Integrating across the jump inside one dopri5 step instead errs by 2e-6."""
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(90), dtype=F64)
    w = torch.rand(6, generator=gen(91), dtype=F64) + 0.2
    w = w / w.sum()
    om = torch.tensor([0.6, 1.7], dtype=F64)
    layers = [tp.Heads.random(2, 3, generator=gen(92 + l), dtype=F64, beta=1.3, weights=om) for l in range(2)]
    t0 = 1e6
    lw = tp.Layerwise(layers, layer_time=1000000.019)
    assert lw.knots(t0, t0 + 0.02) == [1000000.019]
    kw = dict(t0=t0, t1=t0 + 0.02, weights=w, diagnostics=False)
    tr = tp.simulate(x0, lw, dt=1e-2, method="adaptive", rtol=1e-8, atol=1e-10, **kw, direction="descent")
    ref = tp.simulate(x0, lw, dt=1e-3, method="rk4", record_every=10, **kw, direction="descent")
    assert float((ref.x[-1] - x0).abs().max()) > 0.01
    assert float((tr.x - ref.x).abs().max()) < 1e-7


def test_adaptive_causal_run_matches_fine_rk4_and_has_no_residual():
    """Causal attention is not a gradient flow: the adaptive ledger, like the fixed-step one, has no
    residual entries.  The adaptive tokens agree with rk4 at dt = 0.005 (error ~ dt⁴ ≈ 1e-9 plus the
    dopri5 tolerance) at every record time."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(80), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(81), dtype=F64, beta=1.3, scale=0.6,
                            weights=torch.tensor([0.4, 1.3], dtype=F64))
    kw = dict(t1=0.4, causal=True, normalization="softmax", ledger=True)
    ad = tp.simulate(x0, heads, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12, **kw, direction="descent")
    # the adjoint path has its own field closure (with the causal mask too)
    adj = tp.simulate(x0.clone().requires_grad_(True), heads, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12,
                      adjoint=True, **kw, direction="descent")
    rk = tp.simulate(x0, heads, dt=0.005, method="rk4", record_every=20, **kw, direction="descent")
    assert_close(ad.x, rk.x, rtol=4 * torch.finfo(F64).eps, atol=1e-8)
    assert_close(adj.x.detach(), ad.x, rtol=0, atol=1e-12)
    for tr in (ad, rk):
        assert "residual" not in tr.ledger and "residual_slope" not in tr.ledger


# ---------------------------------------------------------------------------- tableaux, stats, paths, progress
def test_butcher_tableaux_of_order_two_and_three_are_accepted():
    """Consistent explicit tableaux are built (Ralston's order 2, Kutta's order 3: rows sum to c, Σb = 1,
    Σ b_i c_i = ½); the built-in ones have their stages; an inconsistent row is refused."""
    T = tp.solvers.tableaux.ButcherTableau
    ralston = T("ralston", 2, (0.0, 2 / 3), ((), (2 / 3,)), (0.25, 0.75))
    kutta = T("kutta3", 3, (0.0, 0.5, 1.0), ((), (0.5,), (-1.0, 2.0)), (1 / 6, 2 / 3, 1 / 6))
    assert (ralston.stages, kutta.stages) == (2, 3)
    assert [tp.solvers.tableaux.TABLEAUX[m].stages for m in ("euler", "heun", "rk4")] == [1, 2, 4]
    with pytest.raises(ValueError, match=r"c\[2\] must equal the sum of row 2"):
        T("bad", 3, (0.0, 0.5, 1.0), ((), (0.5,), (-1.0, 2.5)), (1 / 6, 2 / 3, 1 / 6))


def test_butcher_tableau_refuses_inconsistent_coefficients():
    """A tableau whose rows do not sum to c, or that claims order 2 without Σ b_i c_i = ½, is refused."""
    T = tp.solvers.tableaux.ButcherTableau
    with pytest.raises(ValueError, match="c\\[1\\] must equal the sum of row 1"):
        T("bad", 2, (0.0, 0.5), ((), (0.7,)), (0.0, 1.0))  # row sum 0.7 ≠ c_2 = 0.5
    with pytest.raises(ValueError, match="order >= 2 needs"):
        T("bad", 2, (0.0, 1.0), ((), (1.0,)), (0.0, 1.0))  # Σ b c = 1 ≠ ½
    with pytest.raises(ValueError, match="order >= 2 needs"):
        T("bad", 2, (0.0, 0.25), ((), (0.25,)), (0.0, 1.0))  # Σ b c = ¼ (and −¼ − ½ ≠ 0 either)
    T("midpoint", 2, (0.0, 0.5), ((), (0.5,)), (0.0, 1.0))  # the midpoint rule is accepted


@pytest.mark.parametrize("method,stages", [("euler", 1), ("heun", 2), ("rk4", 4)])
def test_fixed_step_stats_count_field_evaluations_and_the_sphere_error(method, stages):
    """field_evaluations = 1 (at t0) + K·stages (the end point of a step is the next step's first stage),
    with the energy scale chosen (c = 0 here) or given; max_sphere_error is the largest |‖y‖ − 1| of the
    un-retracted steps: ≤ the O(dt²) drift of one step, and > 0."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(84), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(85), dtype=F64, beta=1.3)
    for kw in ({}, {"energy_log_scale": 0.5}):
        tr = tp.simulate(x0, heads, dt=0.05, t1=0.2, method=method, **kw, direction="descent")
        assert tr.stats["field_evaluations"] == 1 + 4 * stages, kw
        assert 0.0 < tr.stats["max_sphere_error"] < 0.05 ** 2 * 10


def test_a_closed_form_process_returns_a_replayable_path():
    """return_path=True with a closed-form process (σ = 0 OU, exact): the returned path has the grid's
    times and no noise, and replaying it gives the same tokens."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(88), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(89), dtype=F64)
    tr = tp.simulate(x0, tp.OrnsteinUhlenbeck(heads, sigma=0.0), dt=0.05, t1=0.2, return_path=True, ledger=True, direction="descent")
    assert_close(tr.path.times, torch.linspace(0, 0.2, 5, dtype=F64), rtol=0, atol=1e-15)
    assert tr.path.noise is None
    eps = torch.finfo(F64).eps  # the same computation again (unit vectors)
    assert_close(tp.simulate(x0, tr.path, dt=0.05, t1=0.2, ledger=True, direction="descent").x, tr.x, rtol=4 * eps, atol=4 * eps)


def test_progress_bar_appears_by_itself_once_the_work_passes_the_threshold(monkeypatch):
    """progress=None: a bar when steps · stages · paths · H · n² ≥ PROGRESS_MIN_WORK (documented), lowered
    here to 100 so that a run of 4 euler steps, H = 2, n = 5 (work 200) shows one, and 40 does not."""
    import tqdm.auto
    from transformer_pde.solvers.particle import methods as particle
    bars = []

    class Bar:
        def __init__(self, **kw):
            bars.append(kw)

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(93), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(94), dtype=F64)
    for threshold, shown in ((100, 1), (201, 0)):
        bars.clear()
        monkeypatch.setattr(particle, "PROGRESS_MIN_WORK", threshold)
        tp.simulate(x0, heads, dt=0.05, t1=0.2, method="euler", ledger=True, direction="descent")
        assert len(bars) == shown, threshold


def test_paths_with_a_heads_batch_equal_to_the_tokens_batch():
    """paths= with heads batched like x0 (B = 2) runs, one OU path per member and Monte-Carlo path;
    a heads batch that differs from x0's is refused before any work."""
    x0 = tp.sphere.sample_uniform(5, 3, batch_shape=(2,), generator=gen(95), dtype=F64)
    A = torch.stack([tp.Heads.random(2, 3, generator=gen(96 + b), dtype=F64).score for b in range(2)])
    ou = tp.OrnsteinUhlenbeck(tp.Heads(A), sigma=0.3)
    tr = tp.simulate(x0, ou, dt=0.05, t1=0.1, paths=3, seed=0, ledger=True, direction="descent")
    assert tr.x.shape == (3, 3, 2, 5, 3)
    A3 = torch.stack([tp.Heads.random(2, 3, generator=gen(98 + b), dtype=F64).score for b in range(3)])
    with pytest.raises(ValueError, match=r"with paths=, the heads' batch shape \(3,\) must be empty or equal"):
        tp.simulate(x0, tp.OrnsteinUhlenbeck(tp.Heads(A3), sigma=0.3), dt=0.05, t1=0.1, paths=3, ledger=True, direction="descent")


def test_nonfinite_error_blames_overflow_only_where_the_squared_kernel_overflows():
    """nonfinite_error for the unnormalised and effective fields says the kernel e^{β⟨x,Ay⟩} overflows
    exactly when e^{2β·max|A|} (the kernel squared, as in 𝒢² and 𝒟) is not representable in the dtype
    (decided here by torch.exp in that dtype), and names β·max|A| over all heads and batch members."""
    from transformer_pde.solvers.trajectory import nonfinite_error

    R64 = math.log(torch.finfo(F64).max)
    for dtype, bmax in ((torch.float32, 35.0), (torch.float32, 50.0), (F64, R64 / 2), (F64, 400.0)):
        A = torch.zeros(2, 2, 3, 3, dtype=dtype)  # a batch of 2 × H = 2 heads; the largest entry in member 1, head 0
        A[1, 0, 2, 1] = -bmax / 2  # exact: β·max|A| = bmax to the last bit (R/2 itself is a case)
        A[0, 1, 0, 0] = 0.5
        heads = tp.Heads(A, beta=2.0)
        overflows = bool(torch.isinf(torch.exp(torch.tensor(2 * bmax, dtype=dtype))))
        for norm in ("unnormalized", "effective"):
            msg = str(nonfinite_error("the velocity field", 0.25, 3, heads, norm))
            assert f"β·max|A_h| = {bmax:.3g}" in msg
            assert ("overflows" in msg) == overflows, (dtype, bmax, msg)
            if overflows and norm == "unnormalized":
                assert "the kernel e^{β⟨x,Ay⟩} itself" in msg
        assert "the step diverged" in str(nonfinite_error("the velocity field", 0.25, 3, heads, "softmax"))


# ---------------------------------------------------------------------------- private helpers of the particle solver
# These reach into private names of solvers/particle/methods.py (_ledger_nonfinite, _check_ledger, _dopri5):
# repoint them when the solver's internals move.
def test_ledger_error_with_a_nonfinite_log_partition_is_a_nonfinite_error():
    """A ledger term that is NaN together with the log-partitions themselves still gives a NonFiniteError
    (no scale to suggest: the values diverged), naming the quantity, time and step."""
    from transformer_pde.solvers.trajectory import ledger_nonfinite as _ledger_nonfinite

    lp = torch.tensor([[1.0, float("nan")], [2.0, 3.0]], dtype=F64)
    err = _ledger_nonfinite("the energy", 0.5, 7, lp, 0.0, 2.0)
    assert isinstance(err, tp.NonFiniteError)
    assert "the energy became NaN/inf at t = 0.5 (step 7)" in str(err)
    assert "largest log-partition nan" in str(err)


def test_ledger_check_names_the_energy_when_it_is_not_finite():
    from types import SimpleNamespace
    from transformer_pde.solvers.trajectory import check_ledger as _check_ledger
    one = torch.ones(2, dtype=F64)
    e = SimpleNamespace(energy=torch.tensor([1.0, float("inf")], dtype=F64), dissipation=one, slope=one,
                        stats=SimpleNamespace(log_partition=torch.zeros(2, 3, dtype=F64)))
    with pytest.raises(tp.NonFiniteError, match=r"^the energy became NaN/inf at t = 0.25 \(step 5\)"):
        _check_ledger(e, one, 0.25, 5, {"c": 0.0, "start_max": 0.0})


def test_adaptive_nonfinite_error_names_the_solver_step_not_the_grid_row(monkeypatch):
    """With layer starts added to the adaptive grid and record_every > 1, a non-finite token is
    reported at its time and solver step k = (t − t0)/dt (not its row in the internal grid)."""
    from transformer_pde.solvers.particle import methods as particle

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
                    record_every=4, ledger=True, direction="descent")


def test_adaptive_trajectory_records_its_method(dtype):
    """A method="adaptive" run reports method "adaptive" (in the field and in the repr), like the
    fixed-step methods report theirs."""
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(23), dtype=dtype)
    heads = tp.Heads.random(1, 3, generator=gen(24), dtype=dtype)
    for method in ("adaptive", "rk4"):
        tr = tp.simulate(x0, heads, t1=0.2, dt=0.1, method=method, ledger=True, direction="descent")
        assert tr.method == method and f"method='{method}'" in repr(tr)
