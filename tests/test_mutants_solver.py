"""Oracle tests for the survivors of the mutation pass (docs/MUTATION_REPORT.md) in the particle
solver (solvers/particle.py), its parts (solvers/parts.py) and the weight processes (processes.py):
closed forms written from docs/model.md, dense recomputations, autograd against formulas, and the
fixed-step solver as an independent implementation of the adaptive one."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy, oscillating_target_reference
from transformer_pde.solvers.parts import observe, process_signature

F64 = torch.float64


# ---------------------------------------------------------------------------- processes
def test_oscillating_target_defaults_one_head_and_shared_phase():
    """oscillating_target(t, d) is F(t) of docs/model.md for one head, (1, d, d); with num_heads = 3 and
    the default phase every head sees the same F(t) (the paper's shared phase), unlike "per_head"."""
    t = 0.7
    F = tp.oscillating_target(t, 3)
    assert F.shape == (1, 3, 3)
    assert_close(F[0], torch.tensor(oscillating_target_reference(t, 3)), rtol=1e-14, atol=1e-15)
    shared = tp.oscillating_target(t, 3, num_heads=3)
    for h in range(3):
        assert_close(shared[h], torch.tensor(oscillating_target_reference(t, 3)), rtol=1e-14, atol=1e-15)
    per = tp.oscillating_target(t, 3, num_heads=3, phase="per_head")
    assert_close(per[2], torch.tensor(oscillating_target_reference(t, 3, h=2, H=3, per_head=True)),
                 rtol=1e-14, atol=1e-15)


def test_sample_path_draws_from_the_given_generator():
    """sample_path(generator=g) draws the noise from g: equal seeds of g give equal paths, other
    seeds other paths, and g's state advances; a ``seed`` next to it is refused."""
    h = tp.Heads.random(2, 3, generator=gen(40), dtype=F64)
    proc = tp.OrnsteinUhlenbeck(h, rate=0.8, sigma=0.6)
    g1, g1b, g2 = gen(41), gen(41), gen(42)
    before = g1.get_state().clone()
    a = tp.sample_path(proc, t1=0.3, dt=0.1, generator=g1)
    b = tp.sample_path(proc, t1=0.3, dt=0.1, generator=g1b)
    with pytest.raises(ValueError, match="not both"):  # a seed next to the generator would be ignored: refused
        tp.sample_path(proc, t1=0.3, dt=0.1, generator=gen(41), seed=5)
    c = tp.sample_path(proc, t1=0.3, dt=0.1, generator=g2)
    assert not torch.equal(g1.get_state(), before)
    assert torch.equal(a.scores, b.scores)
    assert not torch.equal(a.scores[1:], c.scores[1:])
    # first exact OU step from g: Ā + e^{−κh}(A0 − Ā) + σ√((1 − e^{−2κh})/(2κ)) ½(Z + Zᵀ)
    Z = torch.randn(h.score.shape, generator=gen(41), dtype=F64)
    e = math.exp(-0.8 * 0.1)
    eye = torch.eye(3, dtype=F64)
    want = eye + e * (h.score - eye) + 0.6 * math.sqrt((1 - e ** 2) / 1.6) * 0.5 * (Z + Z.transpose(-1, -2))
    assert_close(a.scores[1], want, rtol=1e-12, atol=1e-14)


def test_custom_process_with_a_callable_diffusion():
    """Custom(diffusion=callable): σ(t) is the callable's value (and the process is noisy)."""
    h = tp.Heads.random(1, 3, generator=gen(43), dtype=F64)
    proc = tp.Custom(h, lambda t, A: -A, diffusion=lambda t: 0.25 + t)
    assert proc.noisy
    assert proc.sigma(0.5) == pytest.approx(0.75, abs=0)
    assert tp.Custom(h, lambda t, A: -A, diffusion=0.4).sigma(1.0) == 0.4


def test_layerwise_linear_interpolates_beta_values_and_weights():
    """interpolation="linear": at a fraction f of layer l, β, ω, A and V are (1 − f)·layer_l + f·layer_{l+1}
    (β a float 1.0 → 2.0 here; and a tensor β that requires grad gets its gradient through both layers)."""
    a = tp.Heads.random(2, 3, generator=gen(44), dtype=F64, symmetric=False, beta=1.0,
                        weights=torch.tensor([0.5, 1.5], dtype=F64))
    b = tp.Heads.random(2, 3, generator=gen(45), dtype=F64, symmetric=False, beta=2.0,
                        weights=torch.tensor([1.2, 0.3], dtype=F64))
    lw = tp.Layerwise([a, b], interpolation="linear", layer_time=0.5)
    f = 0.3
    hm = lw.heads_at(0.5 * f)
    assert float(hm.beta) == pytest.approx(1.0 + f * 1.0, rel=1e-14)
    assert_close(hm.weights, (1 - f) * a.weights + f * b.weights, rtol=1e-14, atol=0)
    assert_close(hm.score_matrix, (1 - f) * a.score_matrix + f * b.score_matrix, rtol=1e-13, atol=1e-15)
    assert_close(hm.value_matrix, (1 - f) * a.value_matrix + f * b.value_matrix, rtol=1e-13, atol=1e-15)
    # equal tensor β in both layers: still interpolated, so both layers' β receive gradient
    ba = torch.tensor(1.5, dtype=F64, requires_grad=True)
    bb = torch.tensor(1.5, dtype=F64, requires_grad=True)
    lw2 = tp.Layerwise([tp.Heads(a.score, a.value, a.weights, ba), tp.Heads(b.score, b.value, b.weights, bb)],
                       interpolation="linear", layer_time=0.5)
    ga, gb = torch.autograd.grad(lw2.heads_at(0.5 * f).beta_tensor(), (ba, bb), allow_unused=True)
    assert ga is not None and gb is not None
    assert float(ga) == pytest.approx(1 - f, rel=1e-14) and float(gb) == pytest.approx(f, rel=1e-14)


def test_ou_rate_as_a_tensor_is_differentiable_and_the_default_mean_has_the_heads_dtype():
    """A rate κ that requires grad: d/dκ of the mean Ā + e^{−κt}(A0 − Ā) is −t e^{−κt}(A0 − Ā)
    (autograd against the formula); the default Ā = I is a float64 tensor for float64 heads."""
    h = tp.Heads.random(2, 3, generator=gen(46), dtype=F64)
    kappa = torch.tensor(0.6, dtype=F64, requires_grad=True)
    proc = tp.OrnsteinUhlenbeck(h, rate=kappa, sigma=0.5)
    assert proc.mean.dtype == F64
    assert torch.equal(proc.mean, torch.eye(3, dtype=F64))
    t, M = 0.9, torch.randn(2, 3, 3, generator=gen(47), dtype=F64)
    mean, _ = proc.moments(t)
    g = torch.autograd.grad((mean * M).sum(), kappa)[0]
    want = (-t * math.exp(-0.6 * t) * (h.score - torch.eye(3, dtype=F64)) * M).sum()
    assert_close(g, want, rtol=1e-12, atol=0)


def test_weight_path_heads0_and_interpolation_between_grid_points():
    """A sampled WeightPath: heads0 is Θ(t0) (the process's initial scores, with the template's
    declared symmetry, as heads_at(t0) has it), and between grid points heads_at is the linear
    interpolation (1 − f)·A_k + f·A_{k+1}."""
    D = tp.Heads.random(2, 3, generator=gen(48), dtype=F64).score
    D = D + 1e-13 * torch.randn(D.shape, generator=gen(49), dtype=F64)  # symmetric to 1e-13: declared so
    h = tp.Heads.symmetric(D)
    assert h.is_symmetric
    path = tp.sample_path(tp.OrnsteinUhlenbeck(h, rate=0.7, sigma=0.8), t1=0.4, dt=0.1, seed=3)
    assert torch.equal(path.heads0.score_matrix, h.score_matrix)
    assert path.heads0.is_symmetric == path.heads_at(0.0).is_symmetric == h.is_symmetric
    for k, f in ((0, 0.25), (2, 0.6)):
        got = path.heads_at(0.1 * (k + f)).score_matrix
        assert_close(got, (1 - f) * path.scores[k] + f * path.scores[k + 1], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- parts
def test_observables_of_a_batch_may_return_a_vector_per_member():
    """observe accepts (*batch,) and (*batch, k) for tokens (*batch, n, d) (here batch = (2,)) and
    refuses other shapes; a simulate of a batch records (T, 2, d) for the weighted mean."""
    x = torch.stack([tp.sphere.sample_uniform(5, 3, generator=gen(s), dtype=F64) for s in (50, 51)])
    w = torch.rand(2, 5, generator=gen(52), dtype=F64) + 0.2
    w = w / w.sum(-1, keepdim=True)
    mean = lambda x, wt: (wt.unsqueeze(-1) * x).sum(-2)  # noqa: E731
    assert observe("mean", mean, x, w).shape == (2, 3)
    assert observe("first", lambda x, wt: x[..., 0, 0], x, w).shape == (2,)
    with pytest.raises(ValueError, match="returned shape"):
        observe("flat", lambda x, wt: x[0, 0], x, w)  # (d,) for a batch of 2
    heads = tp.Heads.random(1, 3, generator=gen(53), dtype=F64, beta=1.4)
    tr = tp.simulate(x, heads, t1=0.2, dt=0.1, weights=w, observables={"mean": mean}, diagnostics=False)
    assert tr.observables["mean"].shape == (3, 2, 3)
    assert_close(tr.observables["mean"], (w.unsqueeze(-1) * tr.x).sum(-2))


def test_process_signature_sees_every_layer_and_not_object_addresses():
    """The checkpoint fingerprint of a Layerwise process changes with the scores of any layer; that of
    a Custom process does not depend on which function object (address) carries the drift."""
    a = tp.Heads.random(1, 3, generator=gen(54), dtype=F64)
    b = tp.Heads.random(1, 3, generator=gen(55), dtype=F64)

    def sig(p):
        return repr([t.tolist() if isinstance(t, torch.Tensor) else t for t in process_signature(p)])

    base = sig(tp.Layerwise([a, b], layer_time=0.5))
    assert sig(tp.Layerwise([a, b], layer_time=0.5)) == base
    assert sig(tp.Layerwise([a, tp.Heads(b.score + 1e-6)], layer_time=0.5)) != base
    assert sig(tp.Custom(a, lambda t, A: -A)) == sig(tp.Custom(a, lambda t, A: -A))


# ---------------------------------------------------------------------------- adaptive solver: knots, scale
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
    tr = tp.simulate(x0, lw, t0=t0, t1=t1, dt=dt, method="adaptive", weights=w, rtol=1e-10, atol=1e-12)
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
                     rtol=1e-9, atol=1e-12)
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
                         adjoint=adjoint, diagnostics=False)
        return torch.autograd.grad((tr.x[-1] * M).sum(), S)[0]

    ga, gb = grad(True), grad(False)
    assert float(gb.abs().max()) > 0.1
    assert float((ga - gb).abs().max()) < 1e-3 * float(gb.abs().max())


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
    tr = tp.simulate(x0, lw, dt=1e-3, method="adaptive", rtol=rtol, atol=rtol * 1e-2, **kw)
    ref = tp.simulate(x0, lw, dt=1e-4, method="rk4", record_every=10, **kw)
    assert float((ref.x[-1] - x0).abs().max()) > 5e-3
    assert float((tr.x - ref.x).abs().max()) < tol


# ---------------------------------------------------------------------------- tableaux and error paths
def test_butcher_tableaux_of_order_two_and_three_are_accepted():
    """Consistent explicit tableaux are built (Ralston's order 2, Kutta's order 3: rows sum to c, Σb = 1,
    Σ b_i c_i = ½); the built-in ones have their stages; an inconsistent row is refused."""
    T = tp.solvers.particle.ButcherTableau
    ralston = T("ralston", 2, (0.0, 2 / 3), ((), (2 / 3,)), (0.25, 0.75))
    kutta = T("kutta3", 3, (0.0, 0.5, 1.0), ((), (0.5,), (-1.0, 2.0)), (1 / 6, 2 / 3, 1 / 6))
    assert (ralston.stages, kutta.stages) == (2, 3)
    assert [tp.solvers.particle.TABLEAUX[m].stages for m in ("euler", "heun", "rk4")] == [1, 2, 4]
    with pytest.raises(ValueError, match=r"c\[2\] must equal the sum of row 2"):
        T("bad", 3, (0.0, 0.5, 1.0), ((), (0.5,), (-1.0, 2.5)), (1 / 6, 2 / 3, 1 / 6))


def test_nonfinite_error_blames_overflow_only_where_the_squared_kernel_overflows():
    """nonfinite_error for the unnormalised and effective fields says the kernel e^{β⟨x,Ay⟩} overflows
    exactly when e^{2β·max|A|} (the kernel squared, as in 𝒢² and 𝒟) is not representable in the dtype
    (decided here by torch.exp in that dtype), and names β·max|A| over all heads and batch members."""
    from transformer_pde.solvers.particle import nonfinite_error

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


def test_ledger_error_with_a_nonfinite_log_partition_is_a_nonfinite_error():
    """A ledger term that is NaN together with the log-partitions themselves still gives a NonFiniteError
    (no scale to suggest: the values diverged), naming the quantity, time and step."""
    from transformer_pde.solvers.particle import _ledger_nonfinite

    lp = torch.tensor([[1.0, float("nan")], [2.0, 3.0]], dtype=F64)
    err = _ledger_nonfinite("the energy", 0.5, 7, lp, 0.0, 2.0)
    assert isinstance(err, tp.NonFiniteError)
    assert "the energy became NaN/inf at t = 0.5 (step 7)" in str(err)
    assert "largest log-partition nan" in str(err)


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
    tr = tp.simulate(x0, lw, dt=1e-2, method="adaptive", rtol=1e-8, atol=1e-10, **kw)
    ref = tp.simulate(x0, lw, dt=1e-3, method="rk4", record_every=10, **kw)
    assert float((ref.x[-1] - x0).abs().max()) > 0.01
    assert float((tr.x - ref.x).abs().max()) < 1e-7


# ---------------------------------------------------------------------------- survivors of the 5 % run on the final tree
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_oscillating_target_has_the_requested_dtype(dtype):
    """F(t) is built in float64 and returned in the requested dtype: 2I + Σ_k cos(ω_k t + φ_k) M_k,
    so at any t it stays within the float32 rounding of the float64 value."""
    F = tp.processes.oscillating_target(0.7, 3, 2, dtype=dtype)
    assert F.dtype == dtype and F.shape == (2, 3, 3)
    ref = tp.processes.oscillating_target(0.7, 3, 2, dtype=torch.float64)
    assert_close(F.double(), ref, rtol=1e-6, atol=1e-6)


def test_adaptive_causal_run_matches_fine_rk4_and_has_no_residual():
    """Causal attention is not a gradient flow: the adaptive ledger, like the fixed-step one, has no
    residual entries.  The adaptive tokens agree with rk4 at dt = 0.005 (error ~ dt⁴ ≈ 1e-9 plus the
    dopri5 tolerance) at every record time."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(80), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(81), dtype=F64, beta=1.3, scale=0.6,
                            weights=torch.tensor([0.4, 1.3], dtype=F64))
    kw = dict(t1=0.4, causal=True, normalization="softmax")
    ad = tp.simulate(x0, heads, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12, **kw)
    # the adjoint path has its own field closure (with the causal mask too)
    adj = tp.simulate(x0.clone().requires_grad_(True), heads, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12,
                      adjoint=True, **kw)
    rk = tp.simulate(x0, heads, dt=0.005, method="rk4", record_every=20, **kw)
    assert_close(ad.x, rk.x, rtol=0, atol=1e-8)
    assert_close(adj.x.detach(), ad.x, rtol=0, atol=1e-12)
    for tr in (ad, rk):
        assert "residual" not in tr.ledger and "residual_slope" not in tr.ledger


def test_euler_step_of_a_custom_process_uses_sigma_at_the_step_time():
    """Euler–Maruyama: noise = σ(t)·√dt·Z with Z the symmetric Gaussian of the generator, σ evaluated at
    the step's own time t (here σ(t) = 0.25 + t at t = 1.5, so 1.75), and A(t+dt) = A + dt·drift + noise."""
    from transformer_pde.processes import symmetric_noise
    h = tp.Heads.random(2, 3, generator=gen(82), dtype=F64)
    proc = tp.Custom(h, lambda t, A: -A, diffusion=lambda t: 0.25 + t)
    A = h.score_matrix
    nxt, noise = proc.step(A, 1.5, 0.01, generator=gen(83))
    Z = symmetric_noise(A.shape, generator=gen(83), dtype=F64)
    assert_close(noise, 1.75 * 0.1 * Z, rtol=1e-15, atol=0)
    assert_close(nxt, A - 0.01 * A + noise, rtol=1e-15, atol=1e-16)


@pytest.mark.parametrize("method,stages", [("euler", 1), ("heun", 2), ("rk4", 4)])
def test_fixed_step_stats_count_field_evaluations_and_the_sphere_error(method, stages):
    """field_evaluations = 1 (at t0) + K·stages (the end point of a step is the next step's first stage),
    with the energy scale chosen (c = 0 here) or given; max_sphere_error is the largest |‖y‖ − 1| of the
    un-retracted steps: ≤ the O(dt²) drift of one step, and > 0."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(84), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(85), dtype=F64, beta=1.3)
    for kw in ({}, {"energy_log_scale": 0.5}):
        tr = tp.simulate(x0, heads, dt=0.05, t1=0.2, method=method, **kw)
        assert tr.stats["field_evaluations"] == 1 + 4 * stages, kw
        assert 0.0 < tr.stats["max_sphere_error"] < 0.05 ** 2 * 10


def test_stepper_returns_the_pre_retraction_sphere_error_and_zero_for_flat_dynamics():
    """Euler: y = x + dt·k1; on the sphere the step returns y/‖y‖ and max_i |‖y_i‖ − 1| (computed here),
    without retraction y itself and 0.0."""
    from transformer_pde.solvers.parts import Stepper
    x = tp.sphere.sample_uniform(4, 3, generator=gen(86), dtype=F64)
    k1 = torch.randn(4, 3, generator=gen(87), dtype=F64)
    y = x + 0.1 * k1
    out, err = Stepper(tp.TABLEAUX["euler"], retract=True).step(x, k1, 0.1, lambda xs, c: None)
    assert_close(out, y / y.norm(dim=-1, keepdim=True), rtol=1e-15, atol=0)
    assert err == pytest.approx(float((y.norm(dim=-1) - 1).abs().max()), rel=1e-14)
    out, err = Stepper(tp.TABLEAUX["euler"], retract=False).step(x, k1, 0.1, lambda xs, c: None)
    assert torch.equal(out, y) and err == 0.0


def test_ledger_check_names_the_energy_when_it_is_not_finite():
    from types import SimpleNamespace
    from transformer_pde.solvers.particle import _check_ledger
    one = torch.ones(2, dtype=F64)
    e = SimpleNamespace(energy=torch.tensor([1.0, float("inf")], dtype=F64), dissipation=one, slope=one,
                        stats=SimpleNamespace(log_partition=torch.zeros(2, 3, dtype=F64)))
    with pytest.raises(tp.NonFiniteError, match=r"^the energy became NaN/inf at t = 0.25 \(step 5\)"):
        _check_ledger(e, one, 0.25, 5, {"c": 0.0, "start_max": 0.0})


def test_a_closed_form_process_returns_a_replayable_path():
    """return_path=True with a closed-form process (σ = 0 OU, exact): the returned path has the grid's
    times and no noise, and replaying it gives the same tokens."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(88), dtype=F64)
    heads = tp.Heads.random(2, 3, generator=gen(89), dtype=F64)
    tr = tp.simulate(x0, tp.OrnsteinUhlenbeck(heads, sigma=0.0), dt=0.05, t1=0.2, return_path=True)
    assert_close(tr.path.times, torch.linspace(0, 0.2, 5, dtype=F64), rtol=0, atol=1e-15)
    assert tr.path.noise is None
    assert torch.equal(tp.simulate(x0, tr.path, dt=0.05, t1=0.2).x, tr.x)


def test_progress_bar_appears_by_itself_once_the_work_passes_the_threshold(monkeypatch):
    """progress=None: a bar when steps · stages · paths · H · n² ≥ PROGRESS_MIN_WORK (documented), lowered
    here to 100 so that a run of 4 euler steps, H = 2, n = 5 (work 200) shows one, and 40 does not."""
    import tqdm.auto
    from transformer_pde.solvers import particle
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
        tp.simulate(x0, heads, dt=0.05, t1=0.2, method="euler")
        assert len(bars) == shown, threshold


def test_paths_with_a_heads_batch_equal_to_the_tokens_batch():
    """paths= with heads batched like x0 (B = 2) runs, one OU path per member and Monte-Carlo path;
    a heads batch that differs from x0's is refused before any work."""
    x0 = tp.sphere.sample_uniform(5, 3, batch_shape=(2,), generator=gen(95), dtype=F64)
    A = torch.stack([tp.Heads.random(2, 3, generator=gen(96 + b), dtype=F64).score for b in range(2)])
    ou = tp.OrnsteinUhlenbeck(tp.Heads(A), sigma=0.3)
    tr = tp.simulate(x0, ou, dt=0.05, t1=0.1, paths=3, seed=0)
    assert tr.x.shape == (3, 3, 2, 5, 3)
    A3 = torch.stack([tp.Heads.random(2, 3, generator=gen(98 + b), dtype=F64).score for b in range(3)])
    with pytest.raises(ValueError, match=r"with paths=, the heads' batch shape \(3,\) must be empty or equal"):
        tp.simulate(x0, tp.OrnsteinUhlenbeck(tp.Heads(A3), sigma=0.3), dt=0.05, t1=0.1, paths=3)
