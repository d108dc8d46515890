"""JKO solver: implicit-Euler identity, order-1 convergence to the particle ODE, the discrete
energy ledger, Eulerian mass, stationary measures, shared weight paths, bad input.

Oracles are independent of the solver: the implicit Euler step is computed here by fixed-point
iteration from tp.velocity / tp.mobility (the solver minimises an autograd energy with L-BFGS),
the particle reference is tp.simulate with RK4, the self-transport potential is checked
against POT's sinkhorn_log.
"""

import math

import numpy as np
import pytest
import torch

import transformer_pde as tp
from transformer_pde.solvers.jko.front import self_potential
from conftest import gen

F64 = torch.float64
EPS = torch.finfo(F64).eps  # float64 unit round-off; the tokens are unit vectors (scale 1)


def tokens(n, d, seed, dtype=F64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=F64).to(dtype)


def rand_heads(H, d, seed, scale=0.6, dtype=F64, **kw):
    return tp.Heads.random(H, d, generator=gen(seed), dtype=F64, scale=scale, **kw).to(dtype)


def implicit_euler(x, heads_old, heads_new, tau, *, direction="descent", mobility="effective", weights=None):
    """y = (x + τ V(y)) / |x + τ V(y)|, V(y) = s ∇_S δE[μ_y, Θ_new](y) / b[μ_x, Θ_old](x), by fixed point.

    ∇_S δE is read off the library's "effective" field times b (ascent sign), or, for unit mobility
    and tied symmetric heads, is the "unnormalized" field."""
    s = 1.0 if direction == "ascent" else -1.0
    if mobility == "effective":
        b_old = tp.mobility(x, heads_old, weights)[1].unsqueeze(-1)
    else:
        b_old = torch.ones_like(x[..., :1])
    y = x.clone()
    for _ in range(500):
        if mobility == "effective":
            grad = (tp.velocity(y, heads_new, weights, normalization="effective", direction="ascent")
                    * tp.mobility(y, heads_new, weights)[1].unsqueeze(-1))
        else:
            grad = tp.velocity(y, heads_new, weights, normalization="unnormalized", direction="ascent")
        y_new = tp.sphere.normalize(x + tau * s * grad / b_old)
        if float((y_new - y).abs().max()) < 1e-15:
            return y_new
        y = y_new
    return y


def slope_fit(h, e):
    return float(np.polyfit(np.log(h), np.log(e), 1)[0])


# ---------------------------------------------------------------------------- implicit Euler identity
@pytest.mark.parametrize("direction", ["descent", "ascent"])
def test_identity_coupling_is_implicit_euler_with_frozen_mobility(direction):
    """One identity-coupling JKO step = the projected implicit Euler step of ẋ = s b_k^{-1} ∇_S δE,
    with b_k at the old positions — to the inner tolerance.  The mobility enters as b, not 1/b:
    with 1/b the difference would be O(τ |V| |b − 1/b|) ≈ 1e-2 here."""
    x = tokens(9, 3, 1)
    heads = rand_heads(3, 3, 2, scale=0.7)
    b = tp.mobility(x, heads)[1]
    assert float((b - 1 / b).abs().max()) > 0.3  # the test can tell b from 1/b
    tau = 0.05
    traj = tp.jko(x, heads, tau=tau, steps=1, transport="identity", direction=direction)
    y_ref = implicit_euler(x, heads, heads, tau, direction=direction)
    torch.testing.assert_close(traj.x[-1], y_ref, rtol=0, atol=1e-9)
    assert float((y_ref - x).abs().max()) > 1e-2  # the step actually moves
    assert traj.stats["converged"].all()


def test_identity_coupling_time_dependent_heads_three_steps():
    """E is taken at t_{k+1} and b_k at (μ_k, Θ_{t_k}): three steps along the oscillating process
    match the implicit Euler sequence built with exactly these times."""
    x = tokens(8, 3, 3)
    proc = tp.Oscillating(rand_heads(2, 3, 4, scale=0.5), phase="per_head")
    tau = 0.1
    traj = tp.jko(x, proc, tau=tau, steps=3, transport="identity", direction="descent")
    y = x
    for k in range(3):
        y = implicit_euler(y, proc.heads_at(k * tau), proc.heads_at((k + 1) * tau), tau)
        torch.testing.assert_close(traj.x[k + 1], y, rtol=0, atol=1e-9)


def test_weighted_tokens_emd_step_is_implicit_euler():
    """Non-uniform token weights: the emd plan between (w, y) and (w, x) stays diag(w) for a small
    step, and the step is the weighted implicit Euler step."""
    x = tokens(7, 3, 36)
    w = torch.rand(7, generator=gen(37), dtype=F64) + 0.2
    w = w / w.sum()
    heads = rand_heads(2, 3, 38)
    traj = tp.jko(x, heads, tau=0.05, steps=1, transport="emd", weights=w, direction="descent")
    torch.testing.assert_close(traj.x[-1], implicit_euler(x, heads, heads, 0.05, weights=w), rtol=0, atol=1e-9)
    torch.testing.assert_close(traj.weights, w)


def test_unit_mobility_is_implicit_euler_of_the_unnormalized_field():
    x = tokens(7, 3, 5)
    heads = rand_heads(2, 3, 6, scale=0.5)
    traj = tp.jko(x, heads, tau=0.05, steps=1, transport="identity", mobility="unit", direction="descent")
    torch.testing.assert_close(traj.x[-1], implicit_euler(x, heads, heads, 0.05, mobility="unit"), rtol=0, atol=1e-9)
    assert traj.normalization == "unnormalized"


def test_float32_step_agrees_with_float64():
    x = tokens(9, 3, 7)
    heads = rand_heads(3, 3, 8)
    y64 = tp.jko(x, heads, tau=0.05, steps=2, transport="emd", direction="descent").x[-1]
    traj32 = tp.jko(x.float(), heads.to(torch.float32), tau=0.05, steps=2, transport="emd", direction="descent")
    assert traj32.x.dtype == torch.float32 and traj32.energy.dtype == torch.float32
    # float32 stops at the round-off floor of the residual, 100u(1/τ + r0) ≈ 3e-4 (velocity), i.e.
    # ≈ τ·3e-4 ≈ 1.5e-5 in position per step
    torch.testing.assert_close(traj32.x[-1].double(), y64, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------- convergence in τ
def test_jko_converges_to_particles_at_order_one():
    """W2(JKO(τ), particles) at t = 0.4 shrinks like τ: fitted slope in [0.85, 1.15].  The
    particle reference is RK4 with the effective field (its error ~1e-10 is far below the JKO
    error ~1e-3).  The energy-ledger residual (De Giorgi form) closes at order 1 as well, and
    every step satisfies the discrete energy inequality."""
    x0 = tokens(12, 3, 9)
    proc = tp.Oscillating(rand_heads(2, 3, 10, scale=0.5))
    t1 = 0.4
    ref = tp.simulate(x0, proc, t1=t1, dt=2e-3, method="rk4", normalization="effective", diagnostics=False, direction="descent").x[-1]
    taus = [0.1, 0.05, 0.025]
    err, led = [], []
    for tau in taus:
        traj = tp.jko(x0, proc, tau=tau, steps=round(t1 / tau), transport="emd", direction="descent")
        err.append(float(tp.distance(traj.x[-1], ref)))
        led.append(abs(float(traj.ledger["residual"][-1])))
        assert traj.stats["max_defect"] <= 1e-12
        assert float(traj.ledger["jko_defect"][-1]) < 0
    assert 0.85 <= slope_fit(taus, err) <= 1.15, err
    assert 0.8 <= slope_fit(taus, led) <= 1.3, led


# ---------------------------------------------------------------------------- emd vs Sinkhorn
def test_emd_and_sinkhorn_agree_within_the_eps_bias():
    """With the same (symmetric) cost, the Sinkhorn JKO step tends to the emd step as ε → 0.  For
    well-separated tokens the bias of the debiased divergence is exponentially small in
    spacing²/ε (entropic plans of nearby discrete measures are permutations up to e^{−gap/ε}):
    measured 2e-4 at ε = 0.02, 2e-6 at 0.01, at the inner tolerance (1e-8) from 3e-3 on.  We
    assert the ordering, a faster-than-ε³ drop between 0.02 and 0.01, and agreement at ε = 3e-3
    to 1e-7 (the Sinkhorn solve's default inner tolerance, 1e-6 relative, times τ·|V|)."""
    x = tokens(8, 3, 11)
    heads = rand_heads(2, 3, 12)
    ye = tp.jko(x, heads, tau=0.05, steps=1, transport="emd", cost="symmetric", direction="descent").x[-1]
    step = float((ye - x).abs().max())
    errs = []
    for eps in (2e-2, 1e-2, 3e-3):
        traj = tp.jko(x, heads, tau=0.05, steps=1, transport="sinkhorn", eps=eps, direction="descent")
        assert traj.stats["converged"].all()
        errs.append(float((traj.x[-1] - ye).abs().max()))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[1] < errs[0] / 8, errs
    assert errs[0] < 0.05 * step and errs[2] < 1e-7, errs


def test_source_and_symmetric_costs_differ_at_second_order():
    """c = b(x)|x−y|² vs ½(b(x)+b(y))|x−y|²: the steps differ by O(τ²)."""
    x = tokens(8, 3, 13)
    heads = rand_heads(2, 3, 14)
    diffs = []
    for tau in (0.04, 0.02):
        a = tp.jko(x, heads, tau=tau, steps=1, transport="identity", direction="descent").x[-1]
        b = tp.jko(x, heads, tau=tau, steps=1, transport="identity", cost="symmetric", direction="descent").x[-1]
        diffs.append(float((a - b).abs().max()))
    assert 1.6 <= math.log(diffs[0] / diffs[1], 2) <= 2.4, diffs


# ---------------------------------------------------------------------------- Eulerian scheme
@pytest.mark.parametrize("d,direction", [(2, "descent"), (3, "ascent")])
def test_eulerian_mass_stays_one_and_nonnegative(dtype, d, direction):
    grid = 48 if d == 2 else 120
    x0 = tokens(30, d, 15, dtype)
    heads = rand_heads(2, d, 16, scale=0.8, dtype=dtype)
    traj = tp.jko(x0, heads, tau=0.05, steps=4, scheme="eulerian", grid=grid, eps=0.05, direction=direction)
    w = traj.weights
    assert w.shape == (5, traj.x.shape[-2]) and w.dtype == dtype
    assert float(w.min()) >= 0
    torch.testing.assert_close(w.sum(-1), torch.ones(5, dtype=dtype), rtol=0, atol=1e-12 if dtype == F64 else 1e-5)
    assert float((w[-1] - w[0]).abs().sum()) > 1e-3  # the density moves
    assert traj.stats["max_defect"] <= (1e-12 if dtype == F64 else 1e-5)


def test_self_potential_matches_pot_sinkhorn():
    """The averaged symmetric iteration gives the entropic self-transport of POT's sinkhorn_log:
    the plan q_a q_b e^{(f_a + f_b − C_ab)/ε} equals POT's plan."""
    import ot

    z = tp.sphere.fibonacci_sphere(40, dtype=F64)
    q = torch.rand(40, generator=gen(17), dtype=F64) + 0.1
    q = q / q.sum()
    bz = 1 + torch.rand(40, generator=gen(18), dtype=F64)
    C = 0.5 * (bz[:, None] + bz[None, :]) * ((z[:, None] - z[None]) ** 2).sum(-1)
    eps = 0.2
    f, it, err = self_potential(q[None], C[None], eps)
    assert err <= 1e-13 and it < 200
    P = q[:, None] * q[None, :] * torch.exp((f[0][:, None] + f[0][None, :] - C) / eps)
    P_pot = ot.bregman.sinkhorn_log(q, q, C, eps, numItermax=20000, stopThr=1e-13)
    torch.testing.assert_close(P, P_pot, rtol=1e-7, atol=1e-12)


def test_eulerian_tracks_the_lagrangian_jko():
    """The Eulerian density (m = 256 on S¹) and the Lagrangian JKO of N quantile tokens of the same
    initial density agree in W2 up to the discretisation (grid and token spacing) after 5 steps,
    and the agreement improves from N = 16 to N = 128 (O(1/N))."""
    m = 256
    z = tp.sphere.circle_grid(m, dtype=F64)
    dens = lambda th: torch.exp(1.5 * torch.cos(th - 0.5)) + 0.5 * torch.exp(2 * torch.cos(th + 2))  # noqa: E731
    q = dens(torch.atan2(z[:, 1], z[:, 0]))
    q = q / q.sum()
    proc = tp.Oscillating(rand_heads(2, 2, 19, scale=0.5))
    h = 2 * math.pi / m
    eul = tp.jko(None, proc, tau=0.05, steps=5, scheme="eulerian", grid=z, grid_weights=q, eps=(2 * h) ** 2, direction="descent")
    th = torch.linspace(-math.pi, math.pi, 20001, dtype=F64)[:-1]
    cdf = torch.cumsum(dens(th), 0)
    cdf = cdf / cdf[-1]
    errs = []
    for N in (16, 128):
        u = (torch.arange(N, dtype=F64) + 0.5) / N
        t = th[torch.searchsorted(cdf, u)]
        x0 = torch.stack([torch.cos(t), torch.sin(t)], -1)
        lag = tp.jko(x0, proc, tau=0.05, steps=5, transport="identity", direction="descent")
        errs.append(float(tp.distance(lag.x[-1], (z, eul.weights[-1]))))
    assert errs[1] < 0.25 * errs[0], errs
    assert errs[1] < 0.03, errs


# ---------------------------------------------------------------------------- stationary measures
@pytest.mark.parametrize("transport", ["identity", "emd", "sinkhorn"])
def test_uniform_circle_tokens_stay_put(transport):
    """The uniform grid measure on S¹ is stationary for scalar heads (rotation symmetry)."""
    x = tp.sphere.circle_grid(8, dtype=F64)
    heads = tp.Heads.scalar([1.0, 2.5], 2).to(F64)
    traj = tp.jko(x, heads, tau=0.1, steps=2, transport=transport, eps=1e-3, direction="descent")
    torch.testing.assert_close(traj.x[-1], x, rtol=0, atol=1e-12)


def test_single_token_stays_put():
    """One token with scalar heads: V = s P_x Σ λ_h x = 0 (a non-scalar A_h would move it along P_x A_h x)."""
    x = tokens(1, 3, 20)
    traj = tp.jko(x, tp.Heads.scalar([0.5, 2.0, 3.0], 3).to(F64), tau=0.2, steps=3, transport="emd", direction="descent")
    torch.testing.assert_close(traj.x[-1], x, rtol=1e-12, atol=1e-14)


def test_uniform_grid_weights_stay_uniform():
    m = 40
    z = tp.sphere.circle_grid(m, dtype=F64)
    q = torch.full((m,), 1 / m, dtype=F64)
    traj = tp.jko(None, tp.Heads.scalar([1.0, 2.0], 2).to(F64), tau=0.1, steps=3, scheme="eulerian", grid=z,
                  grid_weights=q, eps=0.02, direction="descent")
    torch.testing.assert_close(traj.weights[-1], q, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- weight paths, batches
def test_noisy_process_is_sampled_once_and_replayable():
    """A noisy OU process is sampled on the τ grid with the given seed; passing the stored path gives
    the same run, and the path is returned for the particle solver."""
    x = tokens(6, 3, 22)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 23), sigma=1.0)
    a = tp.jko(x, proc, tau=0.1, steps=3, transport="identity", seed=5, direction="descent")
    path = tp.sample_path(proc, t1=0.3, dt=0.1, seed=5)
    b = tp.jko(x, path, tau=0.1, steps=3, transport="identity", direction="descent")
    torch.testing.assert_close(a.x, b.x, rtol=0, atol=0)
    torch.testing.assert_close(a.path.scores, path.scores)
    # the partial term books the Θ-jumps exactly: E(μ_k, t_{k+1}) − E(μ_k, t_k)
    E = lambda xx, t: tp.energy(xx, path.heads_at(t))  # noqa: E731
    expected = E(a.x[0], 0.1) - E(a.x[0], 0.0) + E(a.x[1], 0.2) - E(a.x[1], 0.1)
    torch.testing.assert_close(a.ledger["partial"][2], expected)


def test_paths_axis_and_batch_equal_separate_runs():
    x = tokens(12, 3, 24).reshape(2, 6, 3)
    heads = rand_heads(2, 3, 25)
    both = tp.jko(x, heads, tau=0.05, steps=2, transport="emd", direction="descent")
    assert both.x.shape == (3, 2, 6, 3) and both.energy.shape == (3, 2)
    for i in range(2):
        one = tp.jko(x[i], heads, tau=0.05, steps=2, transport="emd", direction="descent")
        torch.testing.assert_close(both.x[:, i], one.x, rtol=0, atol=1e-12)
    proc = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    many = tp.jko(x[0], proc, tau=0.05, steps=2, transport="identity", paths=3, seed=1, direction="descent")
    assert many.x.shape == (3, 3, 6, 3) and many.path.scores.shape[1] == 3
    assert float((many.x[-1, 0] - many.x[-1, 1]).abs().max()) > 0  # the paths differ


# ---------------------------------------------------------------------------- errors and warnings
def test_bad_input_raises_clear_errors():
    x = tokens(5, 3, 26)
    heads = rand_heads(2, 3, 27)
    ok = dict(tau=0.1, steps=2)
    cases = [
        (dict(tau=0.0), ValueError, "tau must be finite and > 0"),
        (dict(tau=-1.0), ValueError, "tau"),
        (dict(steps=0), ValueError, "steps must be >= 1"),
        (dict(steps=1.5), TypeError, "steps must be an int"),
        (dict(transport="w2"), ValueError, "unknown transport"),
        (dict(scheme="grid"), ValueError, "unknown scheme"),
        (dict(direction="up"), ValueError, "unknown direction"),
        (dict(mobility="harmonic"), ValueError, "unknown mobility"),
        (dict(cost="geodesic"), ValueError, "unknown cost"),
        (dict(transport="sinkhorn", eps=0.0), ValueError, "eps must be finite and > 0"),
        (dict(transport="sinkhorn", cost="source"), ValueError, "symmetric cost"),
        (dict(scheme="eulerian", transport="emd", grid=20), ValueError, "transport='sinkhorn'"),
        (dict(scheme="eulerian"), ValueError, "needs grid="),
        (dict(scheme="eulerian", grid=2), ValueError, "m >= 3"),
        (dict(scheme="eulerian", grid=2 * tp.sphere.fibonacci_sphere(20, dtype=F64)), ValueError, "not on the unit sphere"),
        (dict(scheme="eulerian", grid=tp.sphere.circle_grid(20, dtype=F64)), ValueError, "d = 2"),
        (dict(scheme="eulerian", grid="fine"), TypeError, "grid must be a tensor"),
        (dict(max_iter=0), ValueError, "max_iter"),
        (dict(tol=-1e-3), ValueError, "tol"),
        (dict(sinkhorn_scaling=1.5), ValueError, "sinkhorn_scaling"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tp.jko(x, heads, **{**ok, **kw})
    with pytest.raises(ValueError, match="not on the unit sphere"):
        tp.jko(2 * x, heads, **ok, direction="descent")
    with pytest.raises(ValueError, match="needs the initial tokens"):
        tp.jko(None, heads, **ok, direction="descent")
    with pytest.raises(TypeError, match="theta must be"):
        tp.jko(x, torch.eye(3), **ok, direction="descent")
    with pytest.raises(ValueError, match="d = 3"):
        tp.jko(tokens(5, 2, 28), heads, **ok, direction="descent")
    z4 = tp.sphere.sample_uniform(30, 4, generator=gen(29), dtype=F64)
    with pytest.raises(ValueError, match="only understood on S"):
        tp.jko(z4[:5], rand_heads(2, 4, 30), scheme="eulerian", grid=30, **ok, direction="descent")
    with pytest.raises(ValueError, match="not both"):
        tp.jko(x, heads, scheme="eulerian", grid=30, grid_weights=torch.full((30,), 1 / 30, dtype=F64), **ok, direction="descent")
    path = tp.sample_path(tp.OrnsteinUhlenbeck(heads), t1=0.1, dt=0.05)
    with pytest.raises(ValueError, match="covers"):
        tp.jko(x, path, **ok, direction="descent")
    with pytest.raises(ValueError, match="must divide tau"):
        tp.jko(x, tp.OrnsteinUhlenbeck(heads), path_dt=0.03, **ok, direction="descent")


def test_unconverged_step_warns_and_strict_raises():
    x = tokens(8, 3, 31)
    heads = rand_heads(2, 3, 32)
    with pytest.warns(RuntimeWarning, match="did not reach the inner tolerance"):
        traj = tp.jko(x, heads, tau=0.2, steps=2, transport="identity", max_iter=1, tol=1e-14, direction="descent")
    assert not bool(traj.stats["converged"].all()) and traj.stats["nonconverged_steps"] == 2
    with pytest.raises(tp.JKOConvergenceError, match="did not converge"):
        tp.jko(x, heads, tau=0.2, steps=2, transport="identity", max_iter=1, tol=1e-14, strict=True, direction="descent")


def test_overflow_stops_with_time_step_and_quantity():
    x = tokens(6, 3, 33)
    heads = tp.Heads.scalar([900.0], 3).to(F64)
    # E ~ e^{900} overflows float64: energies and ledger are reported times e^{−c}
    traj = tp.jko(x, heads, tau=0.1, steps=2, direction="descent")
    c = traj.energy_log_scale
    assert c > 0 and bool(torch.isfinite(traj.energy).all())
    lm, _ = tp.log_mobility(x, heads)  # independent: log E = log Σ_h ω_h/(2β) mean_i m_h(x_i)
    log_e0 = float(torch.logsumexp(lm[0], -1) - math.log(6) - math.log(2 * 1.0))
    assert float(traj.log_energy()[0]) == pytest.approx(log_e0, rel=1e-12)
    assert float(traj.stats["defect"].max()) <= 1e-9 * float(traj.energy.abs().max())
    proc = tp.Layerwise([tp.Heads.scalar([1.0], 3).to(F64), heads], layer_time=0.15)
    with pytest.raises(tp.NonFiniteError, match=r"t = 0.2 \(step 2\)"):
        tp.jko(x, proc, tau=0.1, steps=3, direction="descent")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = tokens(10, 3, 34)
    heads = rand_heads(2, 3, 35)
    for kw in (dict(transport="emd"), dict(transport="sinkhorn", eps=1e-3), dict(scheme="eulerian", grid=80, eps=0.05)):
        cpu = tp.jko(x, heads, tau=0.05, steps=2, **kw, direction="descent")
        gpu = tp.jko(x.cuda(), heads.to("cuda"), tau=0.05, steps=2, **kw, direction="descent")
        assert gpu.x.device.type == "cuda"
        torch.testing.assert_close(gpu.x.cpu(), cpu.x, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------- the study
TINY = {"kind": "jko_vs_particles", "name": "tiny", "params": {
    "n": 6, "heads": 1, "t1": 0.1, "taus": [0.05, 0.025], "transports": ["identity", "emd", "sinkhorn"],
    "eps_sweep": [0.002], "eps_tau": 0.025, "ref_dt": 0.0125, "n_sweep": [8, 16], "grid": 32, "n_tau": 0.025,
    "n_t1": 0.05}}


def test_study_writes_series_metrics_figure_and_resumes(tmp_path, monkeypatch):
    from transformer_pde.application.runs import execute
    import json

    path = execute(TINY, out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    for key in ("tau_slope_emd", "tau_slope_identity", "n_slope_jko_vs_eulerian", "max_energy_defect",
                "eulerian_mass_error", "eps_w2_vs_emd", "wall_times_s"):
        assert key in m, key
    assert m["max_energy_defect"] <= 0 and m["eulerian_mass_error"] < 1e-12
    for name in ("w2_vs_time", "tau_convergence", "n_convergence", "eps_convergence"):
        assert (path / "series" / f"{name}.csv").exists()
    assert (path / "figures" / "jko_vs_particles.png").exists() and (path / "figures" / "jko_vs_particles.pdf").exists()
    def boom(*a, **k):
        raise AssertionError("a finished piece was recomputed on --resume")

    monkeypatch.setattr(tp, "jko", boom)
    monkeypatch.setattr(tp, "simulate", boom)
    again = execute(TINY, out_dir=tmp_path, progress=False, resume=True)  # every piece is reused
    m2 = json.loads((again / "metrics.json").read_text())
    assert m2["tau_slope_emd"] == m["tau_slope_emd"] and m2["w2_jko_vs_eulerian"] == m["w2_jko_vs_eulerian"]


def test_study_refuses_inconsistent_steps(tmp_path):
    from transformer_pde.application.runs import execute

    bad = {**TINY, "params": {**TINY["params"], "taus": [0.03]}}
    with pytest.raises(ValueError, match="multiple of ref_dt"):
        execute(bad, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="process"):
        execute({**TINY, "params": {**TINY["params"], "process": "brownian"}}, out_dir=tmp_path, progress=False)


# ==================================================================================================
# Batched runs against separate runs, closed forms (von Mises–Fisher deposit, entropic proximal value,
# optimal assignment, the velocity error of the implicit Euler step), the documented rules of the inner
# solver and the settings a run reports.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
import itertools  # noqa: E402
import warnings  # noqa: E402

from scipy.optimize import linear_sum_assignment  # noqa: E402
from torch.testing import assert_close  # noqa: E402

from problems import random_weights  # noqa: E402
from transformer_pde.solvers.jko import front as J  # noqa: E402


# ---------------------------------------------------------------------------- what a run reports
def test_extras_echo_the_settings_of_the_run():
    """extras = {"scheme", "transport", "tau", "mobility", "cost", "eps", "grid"}: the inputs, resolved."""
    x = tokens(5, 3, 1)
    heads = rand_heads(2, 3, 2)
    tr = tp.jko(x, heads, tau=0.05, steps=1, mobility="unit", transport="identity", direction="descent")
    assert tr.extras == {"scheme": "lagrangian", "transport": "identity", "tau": 0.05, "mobility": "unit",
                         "cost": "source", "eps": None, "grid": None}
    z = tp.sphere.fibonacci_sphere(30, dtype=F64)
    tr = tp.jko(x, heads, tau=0.05, steps=1, scheme="eulerian", grid=z, eps=0.05, tol=1e-6, direction="descent")
    ex = dict(tr.extras)
    assert ex.pop("grid") is z
    assert ex == {"scheme": "eulerian", "transport": "sinkhorn", "tau": 0.05, "mobility": "effective",
                  "cost": "symmetric", "eps": 0.05}


def test_stats_report_the_wall_time():
    tr = tp.jko(tokens(5, 3, 27), rand_heads(2, 3, 28), tau=0.05, steps=1, transport="identity", direction="descent")
    assert tr.stats["steps"] == 1 and tr.stats["wall_time"] > 0


def test_a_grid_of_the_wrong_type_is_named_in_the_error():
    x = tokens(5, 3, 3)
    heads = rand_heads(2, 3, 4)
    with pytest.raises(TypeError, match="got a bool"):
        tp.jko(x, heads, tau=0.1, steps=1, scheme="eulerian", grid=True, direction="descent")
    with pytest.raises(TypeError, match="got str"):
        tp.jko(x, heads, tau=0.1, steps=1, scheme="eulerian", grid="fine", direction="descent")
    with pytest.raises(TypeError, match="got float"):
        tp.jko(x, heads, tau=0.1, steps=1, scheme="eulerian", grid=20.0, direction="descent")


@pytest.mark.parametrize("name", ["record_every", "max_plan_updates"])
def test_a_bad_count_option_is_named_in_the_error(name):
    x, heads = tokens(5, 3, 11), rand_heads(2, 3, 12)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        tp.jko(x, heads, tau=0.1, steps=1, transport="identity", **{name: 0}, direction="descent")


def test_a_stored_path_off_the_step_grid_warns():
    """tau = 0.1 on a path of dt = 0.03 (ratio 3.33, offset 0): the steps see an interpolated path."""
    x = tokens(5, 3, 5)
    heads = rand_heads(2, 3, 6)
    path = tp.sample_path(tp.OrnsteinUhlenbeck(heads, sigma=0.3), t1=0.3, dt=0.03, seed=1)
    with pytest.warns(UserWarning, match="not a multiple of the weight path's dt"):
        tp.jko(x, path, tau=0.1, steps=2, transport="identity", direction="descent")
    # offset only: t0 = 0.01 is between grid points although tau = 0.06 is a multiple of dt
    with pytest.warns(UserWarning, match="not a multiple of the weight path's dt"):
        tp.jko(x, path, tau=0.06, steps=2, t0=0.01, transport="identity", direction="descent")
    # on the grid: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.jko(x, path, tau=0.06, steps=2, t0=0.03, transport="identity", direction="descent")


def test_progress_bar_counts_the_steps_and_names_the_scheme(monkeypatch):
    """progress=True opens one tqdm bar with total = steps and a description naming scheme and
    transport, and advances it once per step."""
    import tqdm.auto
    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n = kw, 0
            bars.append(self)

        def update(self, k=1):
            self.n += k

        def close(self):
            pass

        def __getattr__(self, name):  # set_postfix and friends: accepted, ignored
            return lambda *a, **k: None

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    tp.jko(tokens(5, 3, 19), rand_heads(2, 3, 20), tau=0.05, steps=3, transport="identity", progress=True, direction="descent")
    assert len(bars) == 1
    assert bars[0].kw["total"] == 3 and bars[0].n == 3
    assert bars[0].kw["desc"] == "jko (lagrangian, identity)"


def test_strict_lagrangian_sinkhorn_error_adds_the_sinkhorn_hint():
    """strict=True and a step that cannot converge (max_iter=1): the error names the step and, for the
    Lagrangian sinkhorn transport only, how to tune it."""
    x, heads = tokens(5, 3, 21), rand_heads(2, 3, 22)
    with pytest.raises(tp.JKOConvergenceError, match=r"JKO step 1 .*raise sinkhorn_scaling towards 1 or lower eps"):
        tp.jko(x, heads, tau=0.2, steps=1, transport="sinkhorn", max_iter=1, strict=True, direction="descent")
    with pytest.raises(tp.JKOConvergenceError, match=r"reduce tau$"):
        tp.jko(x, heads, tau=0.2, steps=1, transport="identity", max_iter=1, strict=True, direction="descent")


def test_lagrangian_sinkhorn_default_tolerance_is_the_documented_1e_6():
    """Docstring: tol defaults to 1e-6 with transport="sinkhorn" in float64 (1e-9 otherwise).  The
    default run equals the tol=1e-6 run to a few ulps (it is the same computation) and differs from the
    tol=1e-9 one by far more than rounding (observed: 1.9e-8)."""
    x, heads = tokens(5, 3, 13), rand_heads(2, 3, 14)

    def run(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tp.jko(x, heads, tau=0.05, steps=2, transport="sinkhorn", **kw, direction="descent").x
    default = run()
    assert_close(run(tol=1e-6), default, rtol=4 * EPS, atol=4 * EPS)
    assert float((default - run(tol=1e-9)).abs().max()) > 1e4 * EPS


def test_the_generator_drives_the_weight_paths_of_a_noisy_process():
    x, heads = tokens(5, 3, 15), rand_heads(2, 3, 16)
    ou = tp.OrnsteinUhlenbeck(heads, sigma=0.5)

    def run(s):
        return tp.jko(x, ou, tau=0.05, steps=2, transport="identity", generator=torch.Generator().manual_seed(s), direction="descent").x
    assert_close(run(1), run(1), rtol=4 * EPS, atol=4 * EPS)  # the same seed: the same paths
    assert float((run(1) - run(2)).abs().max()) > 1e-4  # another seed: other paths (observed: 1.3e-2)


# ---------------------------------------------------------------------------- to_grid: the von Mises–Fisher deposit
def test_to_grid_with_a_given_bandwidth_against_the_von_mises_fisher_formula():
    """q_a ∝ Σ_i w_i exp((⟨z_a, x_i⟩ − 1)/h²), Σ q = 1, written out with a loop (batch of 2, weights)."""
    x = tokens(10, 3, 7).reshape(2, 5, 3)
    w = torch.stack([random_weights((5,), 8, 0.3), random_weights((5,), 9, 0.3)])
    z = tp.sphere.fibonacci_sphere(25, dtype=F64)
    h = 0.7
    q = tp.to_grid(x, z, weights=w, bandwidth=h)
    ref = torch.zeros(2, 25, dtype=F64)
    for b in range(2):
        for a in range(25):
            ref[b, a] = sum(float(w[b, i]) * math.exp((float(z[a] @ x[b, i]) - 1) / h ** 2) for i in range(5))
    ref = ref / ref.sum(-1, keepdim=True)
    assert_close(q, ref, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="bandwidth must be finite and > 0"):
        J.to_grid(x, z, bandwidth=-1.0)


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


def test_eulerian_deposit_uses_the_given_bandwidth():
    """The initial grid weights are to_grid(x0, z, bandwidth=h) for the given h (not the default)."""
    x, heads = tokens(5, 3, 17), rand_heads(2, 3, 18)
    z = tp.sphere.fibonacci_sphere(30, dtype=F64)
    tr = tp.jko(x, heads, tau=0.05, steps=1, scheme="eulerian", grid=z, eps=0.05, tol=1e-6, bandwidth=0.4, direction="descent")
    assert_close(tr.weights[0], tp.to_grid(x, z, bandwidth=0.4), rtol=1e-12, atol=0)
    assert not torch.allclose(tr.weights[0], tp.to_grid(x, z))


# ---------------------------------------------------------------------------- batch layout: a batched run equals separate runs
def _item_heads(Q, K, beta, j):
    return tp.Heads(None, None, None, beta[j], query=Q[j], key=K[j])


def test_batched_factored_heads_with_tensor_beta_equal_separate_runs():
    """Tokens (3, 1, n, d) against factored heads (2, H, k, d) with a tensor β (2,): the batch (3, 2) is
    flattened to 6 items; each equals the run of its own tokens and heads (β ≠ 1, two dims of batch)."""
    Q = 0.5 * torch.randn(2, 2, 2, 3, generator=gen(10), dtype=F64)
    K = 0.5 * torch.randn(2, 2, 2, 3, generator=gen(11), dtype=F64)
    beta = torch.tensor([0.7, 1.6], dtype=F64)
    heads = tp.Heads(None, None, None, beta, query=Q, key=K)
    x = tokens(15, 3, 12).reshape(3, 1, 5, 3)
    both = tp.jko(x, heads, tau=0.1, steps=1, transport="identity", direction="descent")
    assert both.x.shape == (2, 3, 2, 5, 3) and both.energy.shape == (2, 3, 2)
    for i, j in itertools.product(range(3), range(2)):
        one = tp.jko(x[i, 0], _item_heads(Q, K, beta, j), tau=0.1, steps=1, transport="identity", direction="descent")
        # same arithmetic up to the batched reductions: the solves agree to their tolerance (1e-9 relative)
        assert_close(both.x[:, i, j], one.x, rtol=4 * EPS, atol=1e-10)
        assert_close(both.energy[:, i, j], one.energy, rtol=1e-10, atol=0)
        assert_close(both.stats["prox"][:, i, j], one.stats["prox"], rtol=1e-7, atol=1e-14)


def test_batched_tokens_with_shared_token_weights_equal_separate_runs():
    """Tokens (2, n, d) with one weight vector (n,) for both items (the weights' batch is () and must be
    broadcast against the tokens' batch)."""
    x = tokens(12, 3, 13).reshape(2, 6, 3)
    w = random_weights((6,), 14, 0.3)
    heads = rand_heads(2, 3, 15, weights=torch.tensor([0.3, 1.4], dtype=F64), beta=1.5)
    both = tp.jko(x, heads, tau=0.1, steps=1, transport="identity", weights=w, direction="descent")
    assert both.x.shape == (2, 2, 6, 3)
    for i in range(2):
        one = tp.jko(x[i], heads, tau=0.1, steps=1, transport="identity", weights=w, direction="descent")
        assert_close(both.x[:, i], one.x, rtol=4 * EPS, atol=1e-10)
        assert_close(both.energy[:, i], one.energy, rtol=1e-10, atol=0)


def test_a_batch_of_token_weights_on_shared_tokens_equals_separate_runs():
    """Tokens (n, d) with token weights (2, n): the batch comes from the weights alone."""
    x = tokens(6, 3, 23)
    w = torch.stack([random_weights((6,), 24, 0.3), random_weights((6,), 25, 0.3)])
    heads = rand_heads(2, 3, 26, weights=torch.tensor([0.3, 1.4], dtype=F64), beta=1.5)
    both = tp.jko(x, heads, tau=0.1, steps=1, transport="identity", weights=w, direction="descent")
    assert both.x.shape == (2, 2, 6, 3)
    for i in range(2):
        one = tp.jko(x, heads, tau=0.1, steps=1, transport="identity", weights=w[i], direction="descent")
        assert_close(both.x[:, i], one.x, rtol=4 * EPS, atol=1e-10)


def test_eulerian_batch_equals_separate_runs_and_counts_are_integers():
    """Grid weights (2, m) on S¹ (each needs damped iterations): the batched Eulerian run equals the two
    runs, its weights record is (T, 2, m), and iterations / plan_updates are integer counts like the
    Lagrangian scheme's."""
    z = tp.sphere.circle_grid(24, dtype=F64)
    x = tokens(8, 2, 16).reshape(2, 4, 2)
    q0 = torch.stack([tp.to_grid(x[i], z, bandwidth=0.5) for i in range(2)])
    heads = rand_heads(2, 2, 17, scale=1.0, beta=1.3)
    kw = dict(scheme="eulerian", grid=z, grid_weights=q0, tau=0.2, steps=2, eps=0.02, tol=1e-10)
    both = tp.jko(None, heads, **kw, direction="descent")
    assert both.weights.shape == (3, 2, 24) and both.x.shape == (3, 2, 24, 2)
    assert bool((both.stats["iterations"] > 0).all())
    for i in range(2):
        one = tp.jko(None, heads, **{**kw, "grid_weights": q0[i]}, direction="descent")
        assert_close(both.weights[:, i], one.weights, rtol=4 * EPS, atol=1e-13)
        assert_close(both.stats["prox"][:, i], one.stats["prox"], rtol=1e-9, atol=1e-15)
    lag = tp.jko(x, heads, tau=0.2, steps=1, transport="identity", direction="descent")
    for key in ("iterations", "plan_updates"):
        assert lag.stats[key].dtype == torch.long
        assert both.stats[key].dtype == torch.long, key


# ---------------------------------------------------------------------------- Eulerian proximal value
def _log_sinkhorn(logK, a, b, iters=20000):
    """The entropic projection of the kernel e^{logK} on Π(a, b): log π = logK + u_a + v_b (plain
    alternating Sinkhorn in the log domain, until the row marginals are right to 1e-15 in ℓ¹)."""
    u, v = torch.zeros_like(a), torch.zeros_like(b)
    for it in range(iters):
        u = a.log() - torch.logsumexp(logK + v[None, :], 1)
        v = b.log() - torch.logsumexp(logK + u[:, None], 0)
        if it % 50 == 0 and float((torch.logsumexp(logK + u[:, None] + v[None, :], 1).exp() - a).abs().sum()) < 1e-15:
            break
    return logK + u[:, None] + v[None, :]


def test_eulerian_proximal_value_is_the_entropic_kl_to_the_self_transport_plan():
    """stats["prox"] of an Eulerian step = D_ε(p | q) = ε KL(π* | π^ε_qq), with π^ε_qq the entropic
    self-transport plan of q (Sinkhorn projection of q⊗q e^{−C/ε} on Π(q, q)) and π* the projection of
    π^ε_qq on Π(q, p), C_ab = ½(b(z_a) + b(z_b))|z_a − z_b|², b the mobility of q under Θ (module
    docstring).  Recomputed here with a plain log-domain Sinkhorn in numpy from the returned q and p."""
    z = tp.sphere.circle_grid(24, dtype=F64)
    x = tokens(4, 2, 18)
    om = torch.tensor([0.4, 1.3], dtype=F64)
    heads = rand_heads(2, 2, 19, scale=0.5, beta=1.3, weights=om)
    q0 = tp.to_grid(x, z, weights=random_weights((4,), 20, 0.3), bandwidth=0.5)
    eps, tau = 0.2, 0.05
    tr = tp.jko(None, heads, scheme="eulerian", grid=z, grid_weights=q0, tau=tau, steps=1, eps=eps, tol=1e-12, direction="descent")
    assert tr.energy_log_scale == 0.0
    q, p = tr.weights[0], tr.weights[1]
    assert float((p - q).abs().sum()) > 1e-2  # the step moves mass
    b = tp.mobility(z, heads, q)[1]
    C = 0.5 * (b[:, None] + b[None, :]) * ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    log_pi0 = _log_sinkhorn(q.log()[:, None] + q.log()[None, :] - C / eps, q, q)
    log_pis = _log_sinkhorn(log_pi0, q, p)
    prox = eps * float((log_pis.exp() * (log_pis - log_pi0)).sum())
    assert prox > 1e-3
    # both sides solve their marginals to ~1e-13 or better (self_potential's tolerance): observed agreement
    # ~1e-14 relative; 1e-9 leaves room for other BLAS orders
    assert float(tr.stats["prox"][0]) == pytest.approx(prox, rel=1e-9)


def test_eulerian_step_with_a_tolerance_below_round_off_converges_at_the_round_off_floor():
    """tol = 1e-300 cannot be met: the damped fixed point stops at the round-off floor of ‖T(p) − p‖₁ (a sum
    of m weights ~1/m, each with relative error ~u, so ~u; the stopping bound is 100·u·m) and reports
    convergence, without warning, in a few dozen iterations (observed 24 of max_iter = 100)."""
    m = 60
    z = tp.sphere.circle_grid(m, dtype=F64)
    q0 = tp.to_grid(tokens(4, 2, 18), z, bandwidth=0.5)
    heads = rand_heads(2, 2, 19, scale=0.5, beta=1.3, weights=torch.tensor([0.4, 1.3], dtype=F64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = tp.jko(None, heads, scheme="eulerian", grid=z, grid_weights=q0, tau=0.05, steps=1, eps=0.05, tol=1e-300,
                    max_iter=100, direction="descent")
    assert tr.stats["converged"].tolist() == [True] and int(tr.stats["iterations"][0]) < 100
    p = tr.weights[1]
    assert float(tr.stats["residual"][0]) <= 100 * torch.finfo(F64).eps * m
    assert float((p - q0).abs().sum()) > 1e-3 and float(p.min()) >= 0 and abs(float(p.sum()) - 1) < 1e-14


# ---------------------------------------------------------------------------- the inner solve: residual, emd plan, stiff steps
def _velocity_error(x, y, heads, tau, w, direction="descent"):
    """G_i = P_{y_i}(y_i − x_i)/τ − V(y_i), V(y) = s ∇_S δE[μ_y](y) / b[μ_x](x_i) (module docstring), with
    ∇_S δE read off the library's effective field times the mobility at y (ascent sign)."""
    s = 1.0 if direction == "ascent" else -1.0
    grad = (tp.velocity(y, heads, w, normalization="effective", direction="ascent")
            * tp.mobility(y, heads, w)[1].unsqueeze(-1))
    b_old = tp.mobility(x, heads, w)[1].unsqueeze(-1)
    return tp.sphere.tangent_projection(y, y - x) / tau - s * grad / b_old


def test_reported_residual_is_the_velocity_error_in_l2_of_the_measure():
    """One inner iteration (max_iter=1, unconverged): stats["residual"] = (Σ_i w_i |G_i|²)^{1/2} at the
    returned tokens, non-symmetric heads, token weights, β ≠ 1, ω ≠ 1, both directions."""
    x = tokens(6, 3, 21)
    w = random_weights((6,), 22, 0.3)
    A = 0.6 * torch.randn(2, 3, 3, generator=gen(23), dtype=F64)  # tied, not symmetric
    heads = tp.Heads(A, None, torch.tensor([0.6, 1.7], dtype=F64), 1.4)
    for direction in ("descent", "ascent"):
        with pytest.warns(RuntimeWarning, match="did not reach the inner tolerance"):
            tr = tp.jko(x, heads, tau=0.3, steps=1, transport="identity", max_iter=1, tol=1e-14, weights=w,
                        direction=direction)
        y = tr.x[1]
        assert float((y - x).norm(dim=-1).max()) > 1e-3  # it moved
        G = _velocity_error(x, y, heads, 0.3, w, direction)
        r = float((w * G.square().sum(-1)).sum().sqrt())
        assert r > 1e-6  # one iteration does not solve it
        # G of O(1) formed from O(1) terms: agreement to ~1e-12 relative (round-off of the two evaluations)
        assert float(tr.stats["residual"][0]) == pytest.approx(r, rel=1e-9)


def test_emd_step_at_small_tau_keeps_the_identity_plan_and_converges():
    """For a small step the identity coupling stays optimal: no plan update, converged, no warning, and the
    reported W² is the identity-plan cost Σ_i w_i b_k(x_i)|y_i − x_i|² of the returned tokens."""
    x = tokens(6, 3, 30)
    w = random_weights((6,), 35, 0.3)
    heads = rand_heads(2, 3, 40, scale=1.0, beta=1.5, weights=torch.tensor([0.5, 1.5], dtype=F64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = tp.jko(x, heads, tau=0.05, steps=1, transport="emd", weights=w, direction="descent")
    assert tr.stats["plan_updates"].tolist() == [0] and tr.stats["converged"].tolist() == [True]
    b = tp.mobility(x, heads, w)[1]
    w2 = float((w * b * (tr.x[1] - x).square().sum(-1)).sum())
    assert float(tr.stats["prox"][0]) == pytest.approx(w2, rel=1e-12)


def test_stiff_batch_equals_separate_runs_including_which_items_converge():
    """Stiff steps (τ|V| ≫ ½: the objective is divided by K = τ max_i|G_i|/½ per batch item) for a batch
    of two β (tensor β), with max_iter between the two items' needs: the batched run equals the separate
    runs, the easy item converged and the hard one did not (one item's unconverged tokens do not make
    the other item unconverged)."""
    x = tokens(6, 3, 30)
    A = rand_heads(2, 3, 40, scale=1.0).score
    om = torch.tensor([0.5, 1.5], dtype=F64)
    kw = dict(tau=1.0, steps=1, transport="identity", max_iter=30)
    beta = torch.tensor([0.5, 3.0], dtype=F64)
    with pytest.warns(RuntimeWarning, match="did not reach the inner tolerance"):
        both = tp.jko(x, tp.Heads(A, None, om, beta), **kw, direction="descent")
    one = tp.jko(x, tp.Heads(A, None, om, 0.5), **kw, direction="descent")  # converges in 23 iterations (no warning)
    assert bool(one.stats["converged"][0]) and int(one.stats["iterations"][0]) < 30
    assert both.stats["converged"][0].tolist() == [True, False]
    assert both.stats["iterations"][0].tolist() == [int(one.stats["iterations"][0]), 30]
    assert_close(both.x[1, 0], one.x[1], rtol=4 * EPS, atol=1e-10)


def test_stiff_step_converges_token_by_token():
    """A stiff step (τ max_i|V(x_i)| > ½) whose tokens' velocities span two orders of magnitude: every
    token meets the documented bound with its own velocity error and start, |G_i| ≤ tol·|G_i(x)| +
    100u(1/τ + |G_i(x)|), G_i = P(y_i − x_i)/τ − V(y_i) recomputed here from tp.velocity / tp.mobility
    (not only the L²(μ) total, which the fast tokens dominate).  Observed: ≤ 0.35 of the bound."""
    x = tokens(6, 3, 105)
    A = torch.randn(2, 3, 3, generator=gen(205), dtype=F64)
    A = 0.5 * (A + A.transpose(-1, -2)) * torch.tensor([3.0, 0.3], dtype=F64)[:, None, None]
    heads = tp.Heads(A, None, torch.tensor([0.5, 1.5], dtype=F64), 2.0)
    tau, tol = 0.5, 1e-9
    tr = tp.jko(x, heads, tau=tau, steps=1, transport="identity", tol=tol, direction="descent")
    assert bool(tr.stats["converged"][0])
    w = torch.full((6,), 1 / 6, dtype=F64)
    r0 = _velocity_error(x, x, heads, tau, w).norm(dim=-1)
    assert tau * float(r0.max()) > 0.5 and float(r0.max() / r0.min()) > 100  # stiff, scales spread
    G = _velocity_error(x, tr.x[1], heads, tau, w).norm(dim=-1)
    u = torch.finfo(F64).eps
    assert bool((G <= tol * r0 + 100 * u * (1 / tau + r0)).all())


# ---------------------------------------------------------------------------- large β: scales and refusals
def test_a_token_whose_mobility_underflows_the_scale_is_held_and_reported_unconverged():
    """A = −1000·I: the antipodal pair ±e1 has log b ≈ 999, the third token (almost orthogonal to e1)
    log b ≈ 49, so b_3/c = e^{−950} underflows: that token cannot move (it stays put) and the step is
    reported unconverged (module docstring), although its own velocity error is not even seen (0)."""
    e = torch.eye(3, dtype=F64)
    x = torch.stack([e[0], -e[0], tp.sphere.normalize(e[1] + 0.05 * e[0] + 0.03 * e[2])])
    heads = tp.Heads(-1000.0 * torch.eye(3, dtype=F64)[None], None, None, 1.0)
    lb = tp.log_mobility(x, heads)[1]
    assert float(lb.max() - lb.min()) > math.log(1 / torch.finfo(F64).tiny) + 50  # the premise
    with pytest.warns(RuntimeWarning, match="did not reach the inner tolerance"):
        tr = tp.jko(x, heads, tau=0.01, steps=1, transport="identity", direction="descent")
    assert tr.stats["converged"].tolist() == [False]
    assert_close(tr.x[1, 2], x[2], rtol=4 * EPS, atol=4 * EPS)  # held where it was


def test_energy_log_scale_is_chosen_from_the_weighted_log_partitions():
    """c = ⌈L + R/4⌉, L = max_i log m(x_i), m(x) = Σ_j w_j e^{β⟨x, A x_j⟩} with the token weights (dense
    logsumexp here), R = log(float64 max); the weights move L by log(max w / (1/n)) > 1 here."""
    x = tokens(6, 3, 36)
    w = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=F64)
    heads = tp.Heads.scalar([900.0], 3).to(F64)
    with warnings.catch_warnings():  # only the scale is checked here (the step itself stops at ~1e-7)
        warnings.simplefilter("ignore", RuntimeWarning)
        tr = tp.jko(x, heads, tau=0.05, steps=1, transport="identity", weights=w, direction="descent")
    L = float(torch.logsumexp(900.0 * x @ x.T + w.log()[None, :], -1).max())
    R = math.log(torch.finfo(F64).max)
    assert tr.energy_log_scale == math.ceil(L + R / 4)
    assert math.ceil(L + R / 4) != math.ceil(L - math.log(0.5 * 6) + R / 4)  # uniform weights would differ


def test_an_overflowing_metric_slope_is_named_with_its_step():
    """float32, unit mobility.  β‖A‖ = 40 at t0 (c = 0): E ~ e^{38} and the scheme's metric slope
    𝒢² = Σ w|∇δE|² are finite, and 𝒢² is that of the unit metric (|∇δE|² = |V|², V the unnormalised
    field of these tied heads; not Σ w b|V|², which overflows).  A Layerwise process that switches to
    β‖A‖ = 60 after one step, with c fixed at t0: 𝒢² overflows, named with its step (2)."""
    x = tokens(5, 3, 3, dtype=torch.float32)
    big = tp.Heads.scalar([20.0], 3, beta=2.0).to(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tr = tp.jko(x, big, tau=0.01, steps=1, mobility="unit", direction="descent")
    assert tr.energy_log_scale == 0.0
    V = tp.velocity(x, big, normalization="unnormalized")
    assert_close(tr.slope[0], V.double().square().sum(-1).mean().float(), rtol=1e-5, atol=0)
    proc = tp.Layerwise([tp.Heads.scalar([0.5], 3, beta=2.0).to(torch.float32),
                         tp.Heads.scalar([30.0], 3, beta=2.0).to(torch.float32)], layer_time=0.015)
    with pytest.raises(tp.NonFiniteError, match=r"the metric slope 𝒢² became NaN/inf at t = 0.02 \(step 2\)"):
        tp.jko(x, proc, tau=0.01, steps=3, mobility="unit", direction="descent")


@pytest.mark.parametrize("transport,beta1,eps", [("identity", 900.0, 1e-3), ("sinkhorn", 12.0, 0.1)])
def test_batch_items_of_very_different_mobility_scales_equal_separate_runs(transport, beta1, eps):
    """A = I with a tensor β = (1, β₁): the items' mobilities differ by e^{β₁−1}.  Each item's objective is
    divided by its own scale (identity / emd: per item, so that e^{−899} does not underflow the β = 1
    item to a standstill; sinkhorn: one scale, with ε divided by the same one, OT_ε(cC) = c·OT_{ε/c}(C)),
    so every item equals its separate run (observed: to the last bit; asserted to 1e-12).  ε = 0.1 (in units
    of the cost b|x − y|² ~ e^{10}) is negligible for the β = 12 item, but would not be at the β = 1 item's scale."""
    x = tokens(5, 3, 37)
    A = torch.eye(3, dtype=F64)[None]
    beta = torch.tensor([1.0, beta1], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the β = 900 item stops at its round-off floor
        both = tp.jko(x, tp.Heads(A, None, None, beta), tau=0.1, steps=1, transport=transport, eps=eps, direction="descent")
    j = 0 if transport == "identity" else 1  # the item the wrong scale would hurt
    one = tp.jko(x, tp.Heads(A, None, None, float(beta[j])), tau=0.1, steps=1, transport=transport, eps=eps, direction="descent")
    assert float((one.x[1] - x).abs().max()) > 1e-3  # it moves
    assert_close(both.x[1, j], one.x[1], rtol=4 * EPS, atol=1e-12)
    if both.energy_log_scale == 0.0:  # (β = 900: "prox" is reported times e^{−c}, c ≈ 1077, and underflows)
        assert_close(both.stats["prox"][0, j], one.stats["prox"][0], rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------- parts of the inner solver
# The parts of the inner solver, by their named internal API (solvers.jko.lbfgs, solvers.jko.lagrangian).
from transformer_pde.solvers.jko import lagrangian as JL, lbfgs as LB  # noqa: E402
def _linear(a):
    """f(y) = Σ_i ⟨a, y_i⟩ per batch item, (B,)."""
    return lambda y: (y * a).sum((-1, -2))


def test_line_search_takes_the_first_armijo_step_of_the_halving_sequence():
    """Armijo backtracking a = 1, ½, ¼, ...: the accepted point is the FIRST normalize(y + a d) with
    f ≤ f(y) + 1e-4·a·⟨∇f, d⟩ (recomputed here by brute force), so F decreases; an inactive item is left
    alone.  Tokens start 20° from the minimiser −a of a linear f and d = −10·P∇f overshoots at a = 1."""
    a = torch.tensor([0.3, -0.5, 0.8], dtype=F64)
    a_hat = a / a.norm()
    e = torch.linalg.cross(a_hat, torch.tensor([1.0, 0.0, 0.0], dtype=F64))
    e = e / e.norm()
    th = torch.tensor([0.35, 0.2, 0.5], dtype=F64)[:, None]  # angles from −a
    y = torch.stack([-torch.cos(th) * a_hat + torch.sin(th) * e] * 2)  # (2, 3, 3)
    f_obj = _linear(a)
    f, g = LB.value_and_grad(f_obj, y)
    d = -10 * tp.sphere.tangent_projection(y, g)
    gd = LB.dot(g, d)
    active = torch.tensor([True, False])
    y_new, f_new, g_new, done = LB.line_search(f_obj, y, f, g, d, gd, active)
    assert done.tolist() == [True, True]
    for k in range(20):
        step = 0.5 ** k
        cand = tp.sphere.normalize(y[0] + step * d[0])
        if float(f_obj(cand[None])[0]) <= float(f[0]) + 1e-4 * step * float(gd[0]):
            break
    assert k > 0  # a = 1 overshoots: the test exercises the backtracking
    assert_close(y_new[0], cand, rtol=4 * EPS, atol=1e-15)
    assert float(f_new[0]) < float(f[0])
    assert_close(g_new[0], a.expand(3, 3), rtol=0, atol=0)
    assert_close(y_new[1], y[1], rtol=4 * EPS, atol=4 * EPS)  # the inactive item is left alone
    assert_close(f_new[1], f[1], rtol=4 * EPS, atol=4 * EPS * float(f[1].abs()))


def test_lbfgs_direction_masks_a_negative_curvature_pair_and_matches_dense_bfgs():
    """Two-loop recursion (module docstring of _descend): a pair with ⟨s, z⟩ < 0 is ignored (γ = 1, the
    preconditioned gradient −pre·rg, a descent direction, not flagged); a pair with ⟨s, z⟩ > 0 gives
    −P H rg with the dense BFGS inverse H = (I − ρ s zᵀ) γ Pre (I − ρ z sᵀ) + ρ s sᵀ,
    γ = ⟨s, z⟩/⟨z, Pre z⟩."""
    y = tokens(4, 3, 24)[None]
    P = lambda v: tp.sphere.tangent_projection(y, v)  # noqa: E731
    rg = P(torch.randn(1, 4, 3, generator=gen(25), dtype=F64))
    pre = (torch.rand(1, 4, 1, generator=gen(26), dtype=F64) + 0.5)
    s = P(torch.randn(1, 4, 3, generator=gen(27), dtype=F64))
    d, bad = LB.lbfgs_direction(y, rg, pre, [(s, -2.0 * s)])  # ⟨s, z⟩ = −2|s|² < 0
    assert not bool(bad.any())
    assert_close(d, -pre * rg, rtol=1e-14, atol=0)
    z = P(s + 0.3 * torch.randn(1, 4, 3, generator=gen(28), dtype=F64))
    assert float(LB.dot(s, z)) > 0
    d, bad = LB.lbfgs_direction(y, rg, pre, [(s, z)])
    sv, zv, Pre = s.reshape(-1), z.reshape(-1), torch.diag(pre.expand(1, 4, 3).reshape(-1))
    rho = 1 / float(sv @ zv)
    gamma = float(sv @ zv) / float(zv @ Pre @ zv)
    I = torch.eye(12, dtype=F64)
    H = (I - rho * torch.outer(sv, zv)) @ (gamma * Pre) @ (I - rho * torch.outer(zv, sv)) + rho * torch.outer(sv, sv)
    ref = P(-(H @ rg.reshape(-1)).reshape(1, 4, 3))
    assert not bool(bad.any())
    assert_close(d, ref, rtol=1e-12, atol=1e-15)


def test_inner_solve_stops_after_12_iterations_without_halving_the_residual():
    """The stagnation rule of _descend ("no halving of the residual in 12 iterations"): an inexact objective
    whose value drops at every evaluation (every line search succeeds at a = 1) but whose Riemannian
    gradient J y (a rotation on S¹, |J y| = 1) never shrinks: the solve makes exactly 12 moves, unconverged."""
    calls = [0]

    def objective(y):
        calls[0] += 1
        Jy = torch.stack([-y[..., 1], y[..., 0]], -1).detach()
        lin = (Jy * y).sum((-1, -2))
        return lin - lin.detach() - 1e3 * calls[0]  # value −1000·calls, gradient J y

    y0 = tokens(8, 2, 29).reshape(2, 4, 2)
    wt = torch.full((2, 4), 0.25, dtype=F64)
    tau = 0.01
    pre = (tau / wt).unsqueeze(-1)
    y, info = LB.descend(objective, y0, pre, wt, tau=tau, tol=1e-9, max_iter=50)
    assert info["iterations"].tolist() == [12, 12]
    assert not bool(info["converged"].any())
    # |G_i| = (pre_i/τ)|J y_i| = 4 for every token: r = (Σ_i ¼ · 16)^{1/2} = 4, as at the start
    assert_close(info["residual"], torch.full((2,), 4.0, dtype=F64), rtol=1e-12, atol=0)
    assert_close(info["r0"], torch.full((2,), 4.0, dtype=F64), rtol=1e-12, atol=0)


def test_emd_plan_is_recomputed_until_it_is_optimal_at_the_solution():
    """Block-coordinate descent in (y, π) (_plan_descent): an inner "solve" that sends token i to x_σ(i)
    (σ a fixed permutation) makes the identity plan suboptimal; the plan is recomputed once, to the optimal
    assignment of the cost at y (scipy's linear_sum_assignment here), the next solve keeps it, and the step
    counts one plan update and is converged.  A solve that barely moves keeps the identity plan."""
    x = tokens(5, 3, 31)[None]
    wt = torch.full((1, 5), 0.2, dtype=F64)
    sigma = [2, 0, 1, 4, 3]
    b = torch.rand(1, 5, generator=gen(32), dtype=F64) + 0.5

    def cost_rows(y):  # b(x_j)|y_i − x_j|²
        return b.unsqueeze(-2) * (y.unsqueeze(-2) - x.unsqueeze(-3)).square().sum(-1)

    def make_solve(target):
        def solve_at(P, y0):
            return target, dict(residual=torch.zeros(1, dtype=F64), iterations=torch.ones(1, dtype=torch.long),
                                converged=torch.ones(1, dtype=torch.bool), r0=torch.ones(1, dtype=F64))
        return solve_at

    y_sw = tp.sphere.normalize(x[:, sigma] + 0.01 * torch.randn(1, 5, 3, generator=gen(33), dtype=F64))
    y, info, P = JL.plan_descent(make_solve(y_sw), cost_rows, x, wt, 20)
    M = cost_rows(y_sw)[0]
    rows, cols = linear_sum_assignment(M.numpy())
    assert list(cols) == sigma  # the optimal assignment is σ, not the identity
    ref = torch.zeros(5, 5, dtype=F64)
    ref[rows, cols] = 0.2
    assert_close(P[0], ref, rtol=4 * EPS, atol=1e-15)
    assert info["plan_updates"].tolist() == [1] and info["iterations"].tolist() == [2]
    assert info["converged"].tolist() == [True]
    y_small = tp.sphere.normalize(x + 0.01 * torch.randn(1, 5, 3, generator=gen(34), dtype=F64))
    y, info, P = JL.plan_descent(make_solve(y_small), cost_rows, x, wt, 20)
    assert_close(P[0], 0.2 * torch.eye(5, dtype=F64), rtol=0, atol=0)
    assert info["plan_updates"].tolist() == [0] and info["iterations"].tolist() == [1]
    assert info["converged"].tolist() == [True]


# ---------------------------------------------------------------------------- Eulerian: a batch of β, the stopping rule
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_eulerian_batch_of_tensor_beta_equals_separate_runs(dtype):
    """Heads (2, H, d, d) with a tensor β (2,) on one grid: the batched Eulerian step (δE/δμ divided by
    each item's own β) equals the two runs with a float β, to round-off."""
    z = tp.sphere.circle_grid(24, dtype=F64)
    A = torch.randn(2, 1, 2, 2, generator=gen(70), dtype=F64) * 0.5
    beta = torch.tensor([0.7, 1.6], dtype=F64)
    q0 = tp.to_grid(tokens(5, 2, 71), z, bandwidth=0.5)
    kw = dict(scheme="eulerian", grid=z.to(dtype), grid_weights=q0.to(dtype), tau=0.1, steps=1, eps=0.05)
    both = tp.jko(None, tp.Heads(A.to(dtype), None, None, beta.to(dtype)), **kw, direction="descent")
    assert both.weights.shape == (2, 2, 24)
    u = torch.finfo(dtype).eps
    for j in range(2):
        one = tp.jko(None, tp.Heads(A[j].to(dtype), None, None, float(beta[j])), **kw, direction="descent")
        assert float((one.weights[1] - q0.to(dtype)).abs().sum()) > 1e-3  # the step moves mass
        # the same operations up to round-off, amplified by the damped iterations (observed 1.3e-15 in float64)
        assert_close(both.weights[:, j], one.weights, rtol=8 * u, atol=1000 * u / 24)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("tol", [1e-2, 1e-3])
def test_eulerian_step_stops_by_the_relative_rule(dtype, tol):
    """tol is relative to the step: the damped fixed point stops once ‖T(p) − p‖₁ ≤ tol·‖T(p) − q‖₁ + 100·u·m
    (the recorded residual, p the returned weights), not at an absolute ‖T(p) − p‖₁ ~ tol.  Against a
    float64 solve at tol = 1e-13, the weights are then within tol·‖p* − q‖₁ in ℓ¹ (observed ≤ 0.26·tol)."""
    m = 24
    z = tp.sphere.circle_grid(m, dtype=F64)
    q0 = tp.to_grid(tokens(4, 2, 16), z, bandwidth=0.5)
    heads = rand_heads(2, 2, 17, scale=1.0, beta=1.3)
    kw = dict(scheme="eulerian", grid=z, grid_weights=q0, tau=0.2, steps=1, eps=0.02)
    ref = tp.jko(None, heads, **kw, tol=1e-13, max_iter=5000, direction="descent").weights[1]
    step = float((ref - q0).abs().sum())
    assert step > 0.1
    kw.update(grid=z.to(dtype), grid_weights=q0.to(dtype))
    tr = tp.jko(None, heads.to(dtype), **kw, tol=tol, direction="descent")
    q, p = tr.weights[0], tr.weights[1]
    u = torch.finfo(dtype).eps
    assert tr.stats["converged"].tolist() == [True]
    assert float(tr.stats["residual"][0]) <= tol * float((p - q).abs().sum()) + 100 * u * m
    assert float((p.to(F64) - ref).abs().sum()) <= tol * step + 100 * u


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_identity_step_with_the_symmetric_cost_reports_its_proximal_value(dtype):
    """transport="identity", cost="symmetric": stats["prox"] = Σ_i w_i ½(b_k(y_i) + b_k(x_i))|y_i − x_i|², with
    b_k the mobility field of μ_k = Σ_j w_j δ_{x_j} under Θ, b_k(q) = (Σ_h ω̄_h / Σ_j w_j e^{β⟨q, A_h x_j⟩})^{-1}
    (docs/model.md#mobility), evaluated here densely at the returned tokens y."""
    x = tokens(6, 3, 72)
    w = random_weights((6,), 73, 0.3)
    om = torch.tensor([0.5, 1.5], dtype=F64)
    heads = rand_heads(2, 3, 74, scale=1.0, beta=1.5, weights=om)
    tr = tp.jko(x.to(dtype), heads.to(dtype), tau=0.1, steps=1, transport="identity", cost="symmetric",
                weights=w.to(dtype), direction="descent")
    y = tr.x[1].to(F64)
    x, w = x.to(dtype).to(F64), w.to(dtype).to(F64)  # the run's inputs, in float64

    def b(q):
        A = heads.score.to(dtype).to(F64)
        m = (w * torch.exp(1.5 * torch.einsum("qd,hde,je->hqj", q, A, x))).sum(-1)  # (H, N)
        return 1.0 / ((om / om.sum())[:, None] / m).sum(0)

    assert_close(b(x), tp.mobility(x, heads.to(dtype).to(F64), w)[1], rtol=1e-13, atol=0)  # the library's b at x
    move = (y - x).square().sum(-1)
    assert float(move.max()) > 1e-4  # the tokens move
    want = float((w * 0.5 * (b(y) + b(x)) * move).sum())
    u = torch.finfo(dtype).eps
    assert float(tr.stats["prox"][0]) == pytest.approx(want, rel=100 * u)


# ---------------------------------------------------------------------------- token weights, limits, callback
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("scale, what", [(2.0, "sum to 1"), (-1.0, "negative entries")])
def test_token_weights_that_are_not_a_probability_vector_are_refused_before_any_step(dtype, scale, what):
    """weights= must be a probability vector over the tokens (module docstring of jko): weights summing
    to 2, or with a negative entry, are refused with ValueError by both front ends (jko and tp.solve)."""
    x, heads = tokens(4, 3, 60, dtype), rand_heads(1, 3, 61, dtype=dtype)
    w = torch.full((4,), 0.25, dtype=dtype) * scale if scale > 0 else torch.tensor([0.75, 0.75, -0.25, -0.25],
                                                                                   dtype=dtype)
    with pytest.raises(ValueError, match=what):
        tp.jko(x, heads, tau=0.1, steps=1, transport="identity", weights=w, direction="descent")
    with pytest.raises(ValueError, match=what):
        tp.solve(tp.Model(heads, weights=w, direction="descent"), x, tp.LagrangianJKO(tp.Identity()), t1=0.1, dt=0.1, ledger=tp.LedgerOptions(ledger=True))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_run_whose_attention_kernel_alone_exceeds_max_memory_is_refused(dtype):
    """The memory limit counts the kernel blocks (docstring of jko): every step holds at least the H
    attention matrices n × n of the dtype, so max_memory below H·n²·itemsize is refused before any step."""
    n, H = 40, 16
    x = tokens(n, 3, 62, dtype)
    heads = tp.Heads.scalar([1.0] * H, 3).to(dtype)
    kernel = H * n * n * torch.finfo(dtype).bits // 8
    with pytest.raises(ValueError, match="max_memory"):
        tp.jko(x, heads, tau=0.1, steps=1, transport="identity", max_memory=0.99 * kernel, direction="descent")


def _listed_bytes(message: str, name: str) -> float:
    """The size listed for ``name`` in a check_limits refusal ("name 1.23 KiB")."""
    import re

    m = re.search(re.escape(name) + r" ([0-9.e+]+) (B|KiB|MiB|GiB)", message)
    assert m is not None, message
    return float(m.group(1)) * 1024 ** ("B", "KiB", "MiB", "GiB").index(m.group(2))


def test_the_memory_estimate_counts_the_sampled_path_on_the_path_dt_grid():
    """A noisy process sampled with path_dt = τ/10 stores 10× the grid points of path_dt = τ (the scores,
    rates and noise increments of each of its K steps): the jko refusal lists "the sampled weight path"
    ≈ 10× larger (3K + 2 entries per head matrix: ratio (3·10K + 2)/(3K + 2), K = steps·τ/path_dt)."""
    x = tokens(5, 3, 63)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 64), sigma=1.0)
    sizes = {}
    for path_dt in (0.1, 0.01):
        with pytest.raises(ValueError, match="jko with 20 steps") as err:
            tp.jko(x, proc, tau=0.1, steps=20, transport="identity", path_dt=path_dt, max_memory=1.0, direction="descent")
        sizes[path_dt] = _listed_bytes(str(err.value), "the sampled weight path")
    K = 20
    expected = (3 * 10 * K + 2) / (3 * K + 2)
    assert sizes[0.01] / sizes[0.1] == pytest.approx(expected, rel=1e-2)  # 3 significant digits listed
    # and in bytes: (K + 1) scores and rates and K noise increments of H × d × d float64 each (K = 200)
    assert sizes[0.01] == pytest.approx((3 * 200 + 2) * 2 * 3 * 3 * 8, rel=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_jko_calls_the_callback_after_every_step_with_the_new_state(dtype):
    """callback(k, t, state) after every step k = 1..steps, t = t0 + kτ, state the new tokens (those
    recorded in traj.x with record_every=1)."""
    x, heads = tokens(5, 3, 65, dtype), rand_heads(2, 3, 66, dtype=dtype)
    calls = []
    traj = tp.jko(x, heads, tau=0.1, steps=3, t0=0.5, transport="identity",
                  callback=lambda k, t, s: calls.append((k, t, s.clone())), direction="descent")
    assert [c[0] for c in calls] == [1, 2, 3]
    assert [c[1] for c in calls] == pytest.approx([0.6, 0.7, 0.8], abs=1e-12)
    tol = 10 * torch.finfo(dtype).eps
    for k, _, s in calls:
        torch.testing.assert_close(s.reshape(traj.x[k].shape), traj.x[k], rtol=tol, atol=tol)


def test_jko_refuses_more_steps_than_max_steps_before_any_step():
    """max_steps= is a limit checked before any work (docstring of jko): 3 steps with max_steps=2 are refused."""
    x, heads = tokens(4, 3, 67), rand_heads(1, 3, 68)
    with pytest.raises(ValueError, match="more than max_steps = 2"):
        tp.jko(x, heads, tau=0.1, steps=3, transport="identity", max_steps=2, direction="descent")
