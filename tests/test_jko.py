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
from transformer_pde.solvers.jko import self_potential
from conftest import gen

F64 = torch.float64


def tokens(n, d, seed, dtype=F64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=F64).to(dtype)


def rand_heads(H, d, seed, scale=0.6, dtype=F64):
    return tp.Heads.random(H, d, generator=gen(seed), dtype=F64, scale=scale).to(dtype)


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
    traj = tp.jko(x, proc, tau=tau, steps=3, transport="identity")
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
    traj = tp.jko(x, heads, tau=0.05, steps=1, transport="emd", weights=w)
    torch.testing.assert_close(traj.x[-1], implicit_euler(x, heads, heads, 0.05, weights=w), rtol=0, atol=1e-9)
    torch.testing.assert_close(traj.weights, w)


def test_unit_mobility_is_implicit_euler_of_the_unnormalized_field():
    x = tokens(7, 3, 5)
    heads = rand_heads(2, 3, 6, scale=0.5)
    traj = tp.jko(x, heads, tau=0.05, steps=1, transport="identity", mobility="unit")
    torch.testing.assert_close(traj.x[-1], implicit_euler(x, heads, heads, 0.05, mobility="unit"), rtol=0, atol=1e-9)
    assert traj.normalization == "unnormalized"


def test_float32_step_agrees_with_float64():
    x = tokens(9, 3, 7)
    heads = rand_heads(3, 3, 8)
    y64 = tp.jko(x, heads, tau=0.05, steps=2, transport="emd").x[-1]
    traj32 = tp.jko(x.float(), heads.to(torch.float32), tau=0.05, steps=2, transport="emd")
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
    ref = tp.simulate(x0, proc, t1=t1, dt=2e-3, method="rk4", normalization="effective", diagnostics=False).x[-1]
    taus = [0.1, 0.05, 0.025]
    err, led = [], []
    for tau in taus:
        traj = tp.jko(x0, proc, tau=tau, steps=round(t1 / tau), transport="emd")
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
    ye = tp.jko(x, heads, tau=0.05, steps=1, transport="emd", cost="symmetric").x[-1]
    step = float((ye - x).abs().max())
    errs = []
    for eps in (2e-2, 1e-2, 3e-3):
        traj = tp.jko(x, heads, tau=0.05, steps=1, transport="sinkhorn", eps=eps)
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
        a = tp.jko(x, heads, tau=tau, steps=1, transport="identity").x[-1]
        b = tp.jko(x, heads, tau=tau, steps=1, transport="identity", cost="symmetric").x[-1]
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
    eul = tp.jko(None, proc, tau=0.05, steps=5, scheme="eulerian", grid=z, grid_weights=q, eps=(2 * h) ** 2)
    th = torch.linspace(-math.pi, math.pi, 20001, dtype=F64)[:-1]
    cdf = torch.cumsum(dens(th), 0)
    cdf = cdf / cdf[-1]
    errs = []
    for N in (16, 128):
        u = (torch.arange(N, dtype=F64) + 0.5) / N
        t = th[torch.searchsorted(cdf, u)]
        x0 = torch.stack([torch.cos(t), torch.sin(t)], -1)
        lag = tp.jko(x0, proc, tau=0.05, steps=5, transport="identity")
        errs.append(float(tp.distance(lag.x[-1], (z, eul.weights[-1]))))
    assert errs[1] < 0.25 * errs[0], errs
    assert errs[1] < 0.03, errs


# ---------------------------------------------------------------------------- stationary measures
@pytest.mark.parametrize("transport", ["identity", "emd", "sinkhorn"])
def test_uniform_circle_tokens_stay_put(transport):
    """The uniform grid measure on S¹ is stationary for scalar heads (rotation symmetry)."""
    x = tp.sphere.circle_grid(8, dtype=F64)
    heads = tp.Heads.scalar([1.0, 2.5], 2).to(F64)
    traj = tp.jko(x, heads, tau=0.1, steps=2, transport=transport, eps=1e-3)
    torch.testing.assert_close(traj.x[-1], x, rtol=0, atol=1e-12)


def test_single_token_stays_put():
    """One token with scalar heads: V = s P_x Σ λ_h x = 0 (a non-scalar A_h would move it along P_x A_h x)."""
    x = tokens(1, 3, 20)
    traj = tp.jko(x, tp.Heads.scalar([0.5, 2.0, 3.0], 3).to(F64), tau=0.2, steps=3, transport="emd")
    torch.testing.assert_close(traj.x[-1], x, rtol=1e-12, atol=1e-14)


def test_uniform_grid_weights_stay_uniform():
    m = 40
    z = tp.sphere.circle_grid(m, dtype=F64)
    q = torch.full((m,), 1 / m, dtype=F64)
    traj = tp.jko(None, tp.Heads.scalar([1.0, 2.0], 2).to(F64), tau=0.1, steps=3, scheme="eulerian", grid=z,
                  grid_weights=q, eps=0.02)
    torch.testing.assert_close(traj.weights[-1], q, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- weight paths, batches
def test_noisy_process_is_sampled_once_and_replayable():
    """A noisy OU process is sampled on the τ grid with the given seed; passing the stored path gives
    the same run, and the path is returned for the particle solver."""
    x = tokens(6, 3, 22)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 23), sigma=1.0)
    a = tp.jko(x, proc, tau=0.1, steps=3, transport="identity", seed=5)
    path = tp.sample_path(proc, t1=0.3, dt=0.1, seed=5)
    b = tp.jko(x, path, tau=0.1, steps=3, transport="identity")
    torch.testing.assert_close(a.x, b.x, rtol=0, atol=0)
    torch.testing.assert_close(a.path.scores, path.scores)
    # the partial term books the Θ-jumps exactly: E(μ_k, t_{k+1}) − E(μ_k, t_k)
    E = lambda xx, t: tp.energy(xx, path.heads_at(t))  # noqa: E731
    expected = E(a.x[0], 0.1) - E(a.x[0], 0.0) + E(a.x[1], 0.2) - E(a.x[1], 0.1)
    torch.testing.assert_close(a.ledger["partial"][2], expected)


def test_paths_axis_and_batch_equal_separate_runs():
    x = tokens(12, 3, 24).reshape(2, 6, 3)
    heads = rand_heads(2, 3, 25)
    both = tp.jko(x, heads, tau=0.05, steps=2, transport="emd")
    assert both.x.shape == (3, 2, 6, 3) and both.energy.shape == (3, 2)
    for i in range(2):
        one = tp.jko(x[i], heads, tau=0.05, steps=2, transport="emd")
        torch.testing.assert_close(both.x[:, i], one.x, rtol=0, atol=1e-12)
    proc = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    many = tp.jko(x[0], proc, tau=0.05, steps=2, transport="identity", paths=3, seed=1)
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
        tp.jko(2 * x, heads, **ok)
    with pytest.raises(ValueError, match="needs the initial tokens"):
        tp.jko(None, heads, **ok)
    with pytest.raises(TypeError, match="theta must be"):
        tp.jko(x, torch.eye(3), **ok)
    with pytest.raises(ValueError, match="d = 3"):
        tp.jko(tokens(5, 2, 28), heads, **ok)
    z4 = tp.sphere.sample_uniform(30, 4, generator=gen(29), dtype=F64)
    with pytest.raises(ValueError, match="only understood on S"):
        tp.jko(z4[:5], rand_heads(2, 4, 30), scheme="eulerian", grid=30, **ok)
    with pytest.raises(ValueError, match="not both"):
        tp.jko(x, heads, scheme="eulerian", grid=30, grid_weights=torch.full((30,), 1 / 30, dtype=F64), **ok)
    path = tp.sample_path(tp.OrnsteinUhlenbeck(heads), t1=0.1, dt=0.05)
    with pytest.raises(ValueError, match="covers"):
        tp.jko(x, path, **ok)
    with pytest.raises(ValueError, match="must divide tau"):
        tp.jko(x, tp.OrnsteinUhlenbeck(heads), path_dt=0.03, **ok)


def test_unconverged_step_warns_and_strict_raises():
    x = tokens(8, 3, 31)
    heads = rand_heads(2, 3, 32)
    with pytest.warns(RuntimeWarning, match="did not reach the inner tolerance"):
        traj = tp.jko(x, heads, tau=0.2, steps=2, transport="identity", max_iter=1, tol=1e-14)
    assert not bool(traj.stats["converged"].all()) and traj.stats["nonconverged_steps"] == 2
    with pytest.raises(tp.JKOConvergenceError, match="did not converge"):
        tp.jko(x, heads, tau=0.2, steps=2, transport="identity", max_iter=1, tol=1e-14, strict=True)


def test_overflow_stops_with_time_step_and_quantity():
    x = tokens(6, 3, 33)
    heads = tp.Heads.scalar([900.0], 3).to(F64)
    # E ~ e^{900} overflows float64: energies and ledger are reported times e^{−c} (issue 12)
    traj = tp.jko(x, heads, tau=0.1, steps=2)
    c = traj.energy_log_scale
    assert c > 0 and bool(torch.isfinite(traj.energy).all())
    lm, _ = tp.log_mobility(x, heads)  # independent: log E = log Σ_h ω_h/(2β) mean_i m_h(x_i)
    log_e0 = float(torch.logsumexp(lm[0], -1) - math.log(6) - math.log(2 * 1.0))
    assert float(traj.log_energy()[0]) == pytest.approx(log_e0, rel=1e-12)
    assert float(traj.stats["defect"].max()) <= 1e-9 * float(traj.energy.abs().max())
    proc = tp.Layerwise([tp.Heads.scalar([1.0], 3).to(F64), heads], layer_time=0.15)
    with pytest.raises(tp.NonFiniteError, match=r"t = 0.2 \(step 2\)"):
        tp.jko(x, proc, tau=0.1, steps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = tokens(10, 3, 34)
    heads = rand_heads(2, 3, 35)
    for kw in (dict(transport="emd"), dict(transport="sinkhorn", eps=1e-3), dict(scheme="eulerian", grid=80, eps=0.05)):
        cpu = tp.jko(x, heads, tau=0.05, steps=2, **kw)
        gpu = tp.jko(x.cuda(), heads.to("cuda"), tau=0.05, steps=2, **kw)
        assert gpu.x.device.type == "cuda"
        torch.testing.assert_close(gpu.x.cpu(), cpu.x, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------- the study
TINY = {"kind": "jko_vs_particles", "name": "tiny", "params": {
    "n": 6, "heads": 1, "t1": 0.1, "taus": [0.05, 0.025], "transports": ["identity", "emd", "sinkhorn"],
    "eps_sweep": [0.002], "eps_tau": 0.025, "ref_dt": 0.0125, "n_sweep": [8, 16], "grid": 32, "n_tau": 0.025,
    "n_t1": 0.05}}


def test_study_writes_series_metrics_figure_and_resumes(tmp_path, monkeypatch):
    from transformer_pde.runs import execute
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
    from transformer_pde.runs import execute

    bad = {**TINY, "params": {**TINY["params"], "taus": [0.03]}}
    with pytest.raises(ValueError, match="multiple of ref_dt"):
        execute(bad, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="process"):
        execute({**TINY, "params": {**TINY["params"], "process": "brownian"}}, out_dir=tmp_path, progress=False)
