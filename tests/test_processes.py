"""Weight processes Θ_t: exact laws, closed forms, Euler–Maruyama convergence, replay."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import assert_replayed, fit_slope, integrate, oscillating_target_reference


def _ou_samples(scheme, dt, t1, N=20000, sigma=2 ** 0.5, rate=1.0, seed=0):
    d = 3
    A0 = torch.zeros(1, d, d, dtype=torch.float64) + torch.diag(torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64))
    proc = tp.OrnsteinUhlenbeck(tp.Heads(A0), rate=rate, sigma=sigma, scheme=scheme)
    A = A0.expand(N, 1, d, d).clone()
    g = gen(seed)
    for k in range(round(t1 / dt)):
        A, _ = proc.step(A, k * dt, dt, g)
    return proc, A


def test_ou_exact_transition_moments():
    """Mean Ā + e^{−κt}(A0 − Ā); variance σ²(1 − e^{−2κt})/(2κ) on the diagonal, half of it off it."""
    t1 = 0.7
    proc, A = _ou_samples("exact", 0.35, t1)
    mean, var = proc.moments(t1)
    N = A.shape[0]
    se_mean = (var / N).sqrt()
    assert ((A.mean(0) - mean).abs() < 5 * se_mean).all()
    emp_var = A.var(0)[0]
    assert_close(emp_var, var, rtol=5 * math.sqrt(2 / N), atol=0)
    # independent closed form of the variance (not taken from proc.moments)
    v = 2.0 * (1 - math.exp(-2 * t1)) / 2
    assert_close(var, torch.tensor([[v, v / 2, v / 2], [v / 2, v, v / 2], [v / 2, v / 2, v]], dtype=torch.float64))
    # symmetric noise keeps the matrices symmetric, and off-diagonal entries are uncorrelated with diagonal ones
    torch.testing.assert_close(A, A.transpose(-1, -2))
    c = torch.corrcoef(torch.stack([A[:, 0, 0, 0], A[:, 0, 0, 1]]))[0, 1]
    assert abs(c) < 5 / math.sqrt(N)


def test_ou_stationary_law_is_goe_type():
    """Stationary law: Var(A_ii) = σ²/(2κ), Var(A_ij) = σ²/(4κ) (i ≠ j): κ = 2, σ² = 3."""
    proc, A = _ou_samples("exact", 5.0, 20.0, rate=2.0, sigma=math.sqrt(3.0))
    N = A.shape[0]
    v = A.var(0)[0]
    expect = torch.full((3, 3), 3.0 / 8, dtype=torch.float64)
    expect.fill_diagonal_(3.0 / 4)
    assert_close(v, expect, rtol=5 * math.sqrt(2 / N), atol=0)
    assert_close(A.mean(0)[0], torch.eye(3, dtype=torch.float64), atol=5 * math.sqrt(0.75 / N), rtol=0)


def test_euler_maruyama_converges_to_exact_law_at_order_one():
    """EM stationary variance is σ²/(κ(2 − κh)) (linear recursion): bias ~ h against the exact σ²/(2κ) = 1.

    Variances are pooled over the 3 diagonal entries and (×2) the 3 off-diagonal ones of 20000
    samples: 120000 draws, standard error ≈ 0.004 against biases 0.25 … 0.05."""
    hs = [0.4, 0.2, 0.1]
    biases = []
    N = 20000
    se = math.sqrt(2 / (6 * N))
    for h in hs:
        _, A = _ou_samples("euler", h, 8.0, N=N, seed=1)
        A = A[:, 0]
        iu = torch.triu_indices(3, 3, 1)
        pooled = torch.cat([A.diagonal(dim1=-2, dim2=-1).var(0), 2 * A[:, iu[0], iu[1]].var(0)]).mean().item()
        em_law = 2.0 / (2 - h)
        assert abs(pooled - em_law) < 5 * se * em_law
        biases.append(pooled - 1.0)
    # the exact bias h/(2 − h) has log-log slope 1.12 over these h; allow sampling noise on top
    assert abs(fit_slope(hs, biases) - 1) < 0.3


@pytest.mark.parametrize("d", [2, 3, 4, 5])
def test_oscillating_target_matches_design(d):
    for t in (0.0, 0.37, 2.5):
        F = tp.oscillating_target(t, d, 3, "per_head")
        for h in range(3):
            assert_close(F[h], torch.as_tensor(oscillating_target_reference(t, d, h, 3, True)))
        Fs = tp.oscillating_target(t, d, 3, "shared")
        for h in range(3):
            assert_close(Fs[h], torch.as_tensor(oscillating_target_reference(t, d)))


@pytest.mark.parametrize("phase", ["shared", "per_head"])
def test_oscillating_closed_form_solves_the_linear_ode(phase):
    d, H = 3, 2
    A0 = tp.Heads.random(H, d, generator=gen(2), dtype=torch.float64)
    proc = tp.Oscillating(A0, phase=phase)
    times = np.linspace(0, 4, 9)

    def rhs(t, y):
        A = y.reshape(H, d, d)
        F = np.stack([oscillating_target_reference(t, d, h, H, phase == "per_head") for h in range(H)])
        return (F - A).ravel()

    sol = integrate(rhs, A0.score.numpy().ravel(), times)
    for i, t in enumerate(times):
        assert_close(proc.heads_at(float(t)).score, torch.as_tensor(sol[:, i].reshape(H, d, d)), atol=1e-9, rtol=0)
        # the rate is the drift F − A
        assert_close(proc.score_rate(float(t)), torch.as_tensor(rhs(t, sol[:, i]).reshape(H, d, d)), atol=1e-8, rtol=0)


def test_euler_scheme_matches_reference_recursion():
    """scheme="euler" steps A ← A + dt (F(t) − A), as the reference code does."""
    A0 = tp.Heads.random(2, 3, generator=gen(3), dtype=torch.float64)
    x0 = tp.sphere.octahedral(10, dtype=torch.float64)
    tr = tp.simulate(x0, tp.Oscillating(A0, scheme="euler"), t1=0.5, dt=0.1, return_path=True, ledger=True)
    A = A0.score.clone()
    for k in range(5):
        F = torch.stack([torch.as_tensor(oscillating_target_reference(0.1 * k, 3))] * 2)
        A = A + 0.1 * (F - A)
    assert_close(tr.path.scores[-1], A)


def test_layerwise_constant_and_linear():
    layers = [tp.Heads.scalar(torch.tensor([float(l + 1)], dtype=torch.float64), 3) for l in range(3)]
    c = tp.Layerwise(layers, interpolation="constant", layer_time=0.5)
    assert c.heads_at(0.0) is layers[0] and c.heads_at(0.74) is layers[1] and c.heads_at(5.0) is layers[2]
    assert c.jumps(0.4, 0.6) == [0.5]
    lin = tp.Layerwise(layers, interpolation="linear", layer_time=0.5)
    assert_close(lin.heads_at(0.25).score, 1.5 * torch.eye(3, dtype=torch.float64)[None])
    assert_close(lin.score_rate(0.25), 2.0 * torch.eye(3, dtype=torch.float64)[None])
    # the ledger books the jumps: the energy balance closes on a piecewise-constant path
    x0 = tp.sphere.sample_uniform(12, 3, generator=gen(4), dtype=torch.float64)
    tr = tp.simulate(x0, c, t1=1.5, dt=0.005, normalization="effective", ledger=True)
    assert tr.ledger["residual"][-1].abs() < 5e-3 * tr.ledger["dE"].abs().max()
    assert tr.ledger["partial"][-1].abs() > 0.1  # the jumps are really there


def test_custom_process_euler():
    heads = tp.Heads.random(2, 3, generator=gen(5), dtype=torch.float64)
    proc = tp.Custom(heads, drift=lambda t, A: -A)  # A(t) = e^{-t} A0 exactly; Euler: (1 − dt)^k A0
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(6), dtype=torch.float64)
    tr = tp.simulate(x0, proc, t1=1.0, dt=0.01, return_path=True, ledger=True)
    assert_close(tr.path.scores[-1], (0.99 ** 100) * heads.score)
    noisy = tp.Custom(heads, drift=lambda t, A: -A, diffusion=0.3)
    tr2 = tp.simulate(x0, noisy, t1=0.2, dt=0.01, paths=3, seed=1, ledger=True)
    assert tr2.x.shape[1] == 3


def test_replay_reproduces_the_run_and_seeds_differ():
    heads = tp.Heads.random(3, 3, generator=gen(7), dtype=torch.float64)
    x0 = tp.sphere.octahedral(20, dtype=torch.float64)
    proc = tp.OrnsteinUhlenbeck(heads)
    for method in ("euler", "rk4"):
        run = tp.simulate(x0, proc, t1=0.5, dt=0.05, paths=2, seed=11, return_path=True, method=method, ledger=True)
        rep = tp.simulate(x0, run.path, t1=0.5, dt=0.05, method=method, ledger=True)
        assert_replayed(rep.x, run.x, f"{method} x")
        assert_replayed(rep.ledger, run.ledger, f"{method} ledger")
    # sample_path gives the same path as a run with the same seed
    path = tp.sample_path(proc, t1=0.5, dt=0.05, paths=2, seed=11)
    assert_replayed(path.scores, run.path.scores, "scores")
    other = tp.sample_path(proc, t1=0.5, dt=0.05, paths=2, seed=12)
    assert not torch.equal(other.scores, path.scores)
    # the paths of one run differ from each other
    assert not torch.equal(path.scores[-1, 0], path.scores[-1, 1])
    # token and weight streams are separate: the tokens are not consumed by the weights' generator
    with pytest.raises(ValueError, match="same t0 and dt"):
        tp.simulate(x0, path, t1=0.5, dt=0.025, ledger=True)


def test_bad_process_parameters():
    heads = tp.Heads.random(2, 3, generator=gen(8), dtype=torch.float64)
    with pytest.raises(ValueError, match="rate"):
        tp.OrnsteinUhlenbeck(heads, rate=0.0)
    with pytest.raises(ValueError, match="rate"):
        tp.OrnsteinUhlenbeck(heads, rate=-1.0)
    with pytest.raises(ValueError, match="sigma"):
        tp.OrnsteinUhlenbeck(heads, sigma=-0.1)
    with pytest.raises(ValueError, match="mean must have shape"):
        tp.OrnsteinUhlenbeck(heads, mean=torch.eye(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not broadcast"):
        tp.OrnsteinUhlenbeck(heads, mean=torch.eye(3, dtype=torch.float64).expand(5, 3, 3))
    with pytest.raises(TypeError, match="dtype"):
        tp.OrnsteinUhlenbeck(heads, mean=torch.eye(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="scheme"):
        tp.OrnsteinUhlenbeck(heads, scheme="milstein")
    with pytest.raises(ValueError, match="phase"):
        tp.Oscillating(heads, phase="random")
    with pytest.raises(ValueError, match="sigma"):
        tp.Oscillating(heads, sigma=-1.0)
    with pytest.raises(ValueError, match="all layers must agree"):
        tp.Layerwise([heads, tp.Heads.random(3, 3, generator=gen(9), dtype=torch.float64)])
    with pytest.raises(ValueError, match="interpolation"):
        tp.Layerwise([heads], interpolation="cubic")
    with pytest.raises(TypeError, match="drift must be a callable"):
        tp.Custom(heads, drift=1.0)
    with pytest.raises(TypeError, match="heads0 must be"):
        tp.OrnsteinUhlenbeck([1, 2, 3])


@pytest.mark.parametrize("method,order", [("heun", 2), ("rk4", 4)])
def test_piecewise_constant_layers_keep_the_method_order(method, order):
    """Steps that end on a layer boundary integrate one smooth piece (stages use the left limit)."""
    layers = [tp.Heads.random(2, 3, generator=gen(20 + l), dtype=torch.float64) for l in range(3)]
    theta = tp.Layerwise(layers, layer_time=0.5)
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(30), dtype=torch.float64)
    ref = tp.simulate(x0, theta, t1=1.5, dt=0.5 / 64, method="rk4", diagnostics=False).final
    dts = [0.5 / 4, 0.5 / 8, 0.5 / 16] if method == "rk4" else [0.5 / 8, 0.5 / 16, 0.5 / 32]
    errs = [(tp.simulate(x0, theta, t1=1.5, dt=dt, method=method, diagnostics=False).final - ref).norm().item()
            for dt in dts]
    assert abs(fit_slope(dts, errs) - order) < 0.35, errs


def test_layerwise_knots_and_left_limits_against_the_layers():
    """Knots are the layer starts inside (t0, t1]; at a knot the left limits are the layer (or
    segment) that ends there, the plain values the one that starts there."""
    dt = torch.float64
    layers = [tp.Heads(torch.full((1, 2, 2), float(v), dtype=dt)) for v in (1.0, 3.0, 4.0)]
    const = tp.Layerwise(layers, "constant", layer_time=0.5)
    lin = tp.Layerwise(layers, "linear", layer_time=0.5)
    for p in (const, lin):
        assert p.knots(0.0, 1.0) == [0.5, 1.0]
        assert p.knots(0.5, 0.9) == []
    assert const.jumps(0.0, 1.0) == [0.5, 1.0] and lin.jumps(0.0, 1.0) == []
    A = lambda h: float(h.score_matrix[0, 0, 0])  # noqa: E731
    assert (A(const.left_heads_at(0.5)), A(const.heads_at(0.5))) == (1.0, 3.0)
    assert (A(const.left_heads_at(0.7)), A(const.heads_at(0.7))) == (3.0, 3.0)
    assert A(lin.left_heads_at(0.5)) == A(lin.heads_at(0.5)) == 3.0
    # rates: 0 for constant; (3 − 1)/0.5 then (4 − 3)/0.5, then 0 after the last layer start
    assert float(const.left_score_rate(0.5).abs().max()) == 0.0
    assert float(lin.left_score_rate(0.5)[0, 0, 0]) == 4.0 and float(lin.score_rate(0.5)[0, 0, 0]) == 2.0
    assert float(lin.left_score_rate(1.0)[0, 0, 0]) == 2.0 and float(lin.score_rate(1.0)[0, 0, 0]) == 0.0
    assert float(lin.left_score_rate(0.25)[0, 0, 0]) == float(lin.score_rate(0.25)[0, 0, 0]) == 4.0
    # a process without knots: left limits are the plain values
    ou = tp.OrnsteinUhlenbeck(layers[0], sigma=0.0)
    assert ou.knots(0.0, 1.0) == [] and torch.equal(ou.left_score_rate(0.3), ou.score_rate(0.3))


# ==================================================================================================
# Defaults, generators, callable diffusions, interpolation of layers and weight paths, moments at κ ≠ 1,
# against the formulas of docs/model.md#processes.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
F64 = torch.float64
EPS = torch.finfo(F64).eps


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_oscillating_target_has_the_requested_dtype(dtype):
    """F(t) is built in float64 and returned in the requested dtype: 2I + Σ_k cos(ω_k t + φ_k) M_k,
    so at any t it stays within the float32 rounding of the float64 value."""
    F = tp.processes.weights.oscillating_target(0.7, 3, 2, dtype=dtype)
    assert F.dtype == dtype and F.shape == (2, 3, 3)
    ref = tp.processes.weights.oscillating_target(0.7, 3, 2, dtype=torch.float64)
    assert_close(F.double(), ref, rtol=1e-6, atol=1e-6)


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


def test_ou_rate_as_a_tensor_is_differentiable_and_the_default_mean_has_the_heads_dtype():
    """A rate κ that requires grad: d/dκ of the mean Ā + e^{−κt}(A0 − Ā) is −t e^{−κt}(A0 − Ā)
    (autograd against the formula); the default Ā = I is a float64 tensor for float64 heads."""
    h = tp.Heads.random(2, 3, generator=gen(46), dtype=F64)
    kappa = torch.tensor(0.6, dtype=F64, requires_grad=True)
    proc = tp.OrnsteinUhlenbeck(h, rate=kappa, sigma=0.5)
    assert proc.mean.dtype == F64
    assert_close(proc.mean, torch.eye(3, dtype=F64), rtol=4 * EPS, atol=4 * EPS)
    t, M = 0.9, torch.randn(2, 3, 3, generator=gen(47), dtype=F64)
    mean, _ = proc.moments(t)
    g = torch.autograd.grad((mean * M).sum(), kappa)[0]
    want = (-t * math.exp(-0.6 * t) * (h.score - torch.eye(3, dtype=F64)) * M).sum()
    assert_close(g, want, rtol=1e-12, atol=0)


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
    assert bytes(g1.get_state().numpy()) != bytes(before.numpy())  # the generator's state (bytes) moved on
    scale = float(a.scores.abs().max())
    assert_close(a.scores, b.scores, rtol=4 * EPS, atol=4 * EPS * scale)  # equal seeds: the same path
    assert float((a.scores[1:] - c.scores[1:]).abs().max()) > 1e-3 * scale  # other seed: another path
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


def test_euler_step_of_a_custom_process_uses_sigma_at_the_step_time():
    """Euler–Maruyama: noise = σ(t)·√dt·Z with Z the symmetric Gaussian of the generator, σ evaluated at
    the step's own time t (here σ(t) = 0.25 + t at t = 1.5, so 1.75), and A(t+dt) = A + dt·drift + noise."""
    from transformer_pde.processes.weights import symmetric_noise
    h = tp.Heads.random(2, 3, generator=gen(82), dtype=F64)
    proc = tp.Custom(h, lambda t, A: -A, diffusion=lambda t: 0.25 + t)
    A = h.score_matrix
    nxt, noise = proc.step(A, 1.5, 0.01, generator=gen(83))
    Z = symmetric_noise(A.shape, generator=gen(83), dtype=F64)
    assert_close(noise, 1.75 * 0.1 * Z, rtol=1e-15, atol=0)
    assert_close(nxt, A - 0.01 * A + noise, rtol=1e-15, atol=1e-16)


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


def test_weight_path_heads0_and_interpolation_between_grid_points():
    """A sampled WeightPath: heads0 is Θ(t0) (the process's initial scores, with the template's
    declared symmetry, as heads_at(t0) has it), and between grid points heads_at is the linear
    interpolation (1 − f)·A_k + f·A_{k+1}."""
    D = tp.Heads.random(2, 3, generator=gen(48), dtype=F64).score
    D = D + 1e-13 * torch.randn(D.shape, generator=gen(49), dtype=F64)  # symmetric to 1e-13: declared so
    h = tp.Heads.symmetric(D)
    assert h.is_symmetric
    path = tp.sample_path(tp.OrnsteinUhlenbeck(h, rate=0.7, sigma=0.8), t1=0.4, dt=0.1, seed=3)
    assert_close(path.heads0.score_matrix, h.score_matrix, rtol=4 * EPS,
                 atol=4 * EPS * float(h.score_matrix.abs().max()))
    assert path.heads0.is_symmetric == path.heads_at(0.0).is_symmetric == h.is_symmetric
    for k, f in ((0, 0.25), (2, 0.6)):
        got = path.heads_at(0.1 * (k + f)).score_matrix
        assert_close(got, (1 - f) * path.scores[k] + f * path.scores[k + 1], rtol=1e-12, atol=1e-14)


def test_oscillating_exact_noisy_step_draws_its_noise_in_the_score_dtype(dtype):
    """σ > 0, scheme="exact": A(t+h) = A_p(t+h) + e^{−h}(A(t) − A_p(t)) + σ√((1 − e^{−2h})/2) W_sym.  The mean
    part is the ODE dA = (F − A) ds solved from A(t) (DOP853 on the entry-by-entry F of docs/model.md), so
    (A(t+h) − mean)/sd must be ½(Z + Zᵀ) with Z the generator's standard normals in the score's dtype:
    a float64 step whose noise were drawn in float32 would be off by ~1e-8 (and not the same draw)."""
    d, H, t, h, sigma = 3, 2, 0.7, 0.2, 0.5
    A0 = tp.Heads.random(H, d, generator=gen(11), dtype=dtype)
    proc = tp.Oscillating(A0, sigma=sigma)
    score = A0.score
    nxt, _ = proc.step(score, t, h, generator=gen(12))
    assert nxt.dtype == dtype

    def rhs(s, y):
        F = np.stack([oscillating_target_reference(t + s, d)] * H)
        return (F - y.reshape(H, d, d)).ravel()

    mean = torch.as_tensor(integrate(rhs, score.double().numpy().ravel(), [0.0, h])[:, -1].reshape(H, d, d))
    sd = sigma * math.sqrt(-math.expm1(-2 * h) / 2)
    Z = torch.randn(score.shape, generator=gen(12), dtype=dtype).double()
    tol = 1e-9 if dtype == torch.float64 else 2e-5 / sd
    assert_close((nxt.double() - mean) / sd, 0.5 * (Z + Z.transpose(-1, -2)), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_returned_path_of_layerwise_heads_replays_their_values_weights_and_beta(dtype):
    """Layers whose values, head weights and β differ: the returned path carries them per grid point, so
    replaying it gives the run's tokens and energies (the template alone would replay layer 0's values)."""
    g = torch.Generator().manual_seed(21)
    layers = [tp.Heads(torch.randn(2, 3, 3, generator=g, dtype=dtype), torch.randn(2, 3, 3, generator=g, dtype=dtype),
                       weights=torch.tensor(w, dtype=dtype), beta=b)
              for w, b in (([0.7, 0.3], 1.0), ([0.2, 0.8], 2.5), ([0.5, 0.5], 0.5))]
    proc = tp.Layerwise(layers, layer_time=0.2)
    x0 = tp.sphere.sample_uniform(7, 3, generator=g, dtype=dtype)
    run = tp.simulate(x0, proc, t1=0.6, dt=0.05, return_path=True, direction="ascent")
    assert run.path.points is not None and len(run.path.points) == len(run.path.times)
    rep = tp.simulate(x0, run.path, t1=0.6, dt=0.05, direction="ascent")
    assert_replayed(rep.x, run.x, "x", ulps=64)
    assert_replayed(rep.energy, run.energy, "energy", ulps=64)
    # what the path held before: layer 0's values, weights and β with later scores — another trajectory
    flat = tp.WeightPath(run.path.times, run.path.scores, run.path.rates, None, run.path.sigmas, run.path.template)
    wrong = tp.simulate(x0, flat, t1=0.6, dt=0.05, direction="ascent")
    assert (wrong.x[-1] - run.x[-1]).abs().max() > 1e-3
    # a process with fixed values keeps the template alone
    ou = tp.simulate(x0, tp.OrnsteinUhlenbeck(layers[0], sigma=0.0), t1=0.2, dt=0.05, return_path=True)
    assert ou.path.points is None


def test_weight_path_points_must_match_the_grid():
    heads = tp.Heads.random(2, 3, generator=gen(3), dtype=torch.float64)
    times = torch.arange(3, dtype=torch.float64) * 0.1
    scores = heads.score_matrix.expand(3, 2, 3, 3)
    with pytest.raises(ValueError, match="one Heads per grid point"):
        tp.WeightPath(times, scores, torch.zeros_like(scores), None, [0.0] * 3, heads, [heads, heads])


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
def test_ledger_of_layers_closes_with_the_zero_rate_skipped_only_between_jumps(interpolation):
    """Piecewise-constant layers book ∂_tE = 0 without pairing (the jumps apart); linear layers pair ∂_A E with
    their non-zero rate. The ledger closes at order dt in both, and linear layers' ∂_tE is not zero."""
    g = torch.Generator().manual_seed(31)
    layers = [tp.Heads(torch.randn(2, 3, 3, generator=g, dtype=torch.float64)) for _ in range(3)]
    proc = tp.Layerwise(layers, interpolation=interpolation, layer_time=0.25)
    assert proc.piecewise_constant == (interpolation == "constant")
    x0 = tp.sphere.sample_uniform(9, 3, generator=g, dtype=torch.float64)
    res = []
    for dt in (0.01, 0.005):
        tr = tp.simulate(x0, proc, t1=0.75, dt=dt, method="heun", ledger=True, direction="descent")
        res.append(float(tr.ledger["residual"][-1].abs()))
        partial = tr.ledger["partial"][-1]
        if interpolation == "linear":
            assert float(partial.abs()) > 1e-3  # the rate is paired
    assert res[1] < 0.3 * res[0]  # Heun: second order, halving dt divides the residual by about 4
    assert res[0] < 1e-3


def test_zero_rate_is_not_paired(monkeypatch):
    """Constant heads book ∂_tE = 0 without pairing ∂_A E with a zero rate; moving heads pair at every point."""
    from transformer_pde.solvers.particle import fixed_step

    calls = []
    real = fixed_step.partial_density
    monkeypatch.setattr(fixed_step, "partial_density", lambda *a, **k: calls.append(1) or real(*a, **k))
    heads = tp.Heads.random(2, 3, generator=gen(41), dtype=torch.float64)
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(42), dtype=torch.float64)
    const = tp.simulate(x0, heads, t1=0.1, dt=0.05, ledger=True, direction="descent")
    assert calls == [] and float(const.ledger["partial"].abs().max()) == 0.0
    tp.simulate(x0, tp.Oscillating(heads), t1=0.1, dt=0.05, ledger=True, direction="descent")
    assert len(calls) == 3  # t0 and the two steps' right ends


def test_a_jump_inside_a_step_is_booked_at_the_steps_end():
    """Layers switching at t = 0.125, inside the step [0.10, 0.15] (not on the grid, so no left limit there):
    the ledger's ∂_tE books the jump E(x(0.15), Θ_1) − E(x(0.15), Θ_0), evaluated here independently with
    tp.energy at the recorded tokens, and nothing at the other steps (constant layers)."""
    dtype = torch.float64
    h0, h1 = (tp.Heads.random(2, 3, generator=gen(s), dtype=dtype) for s in (43, 44))
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(45), dtype=dtype)
    tr = tp.simulate(x0, tp.Layerwise([h0, h1], layer_time=0.125), t1=0.25, dt=0.05, ledger=True,
                     direction="descent")
    jump = float(tp.energy(tr.x[3], h1) - tp.energy(tr.x[3], h0))
    increments = torch.diff(tr.ledger["partial"])
    want = torch.zeros_like(increments)
    want[2] = jump
    assert abs(jump) > 1e-3
    assert_close(increments, want, rtol=1e-12, atol=1e-12 * abs(jump))
