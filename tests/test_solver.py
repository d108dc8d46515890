"""Particle solver: closed forms, convergence orders, invariants, dtypes."""


import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde import sphere
from conftest import gen
from problems import (equiangular_gamma_rate, fit_slope, integrate, interrupt_and_resume, two_token_angle_rate,
                      two_tokens)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_two_tokens_angle_closed_form(normalization):
    lam, beta, theta0, T = 1.3, 0.8, 2.0, 3.0
    times = np.linspace(0, T, 31)
    theta = integrate(lambda t, y: [two_token_angle_rate(y[0], lam, beta, normalization)], [theta0], times)[0]
    traj = tp.simulate(two_tokens(theta0), tp.Heads.scalar(torch.tensor([lam], dtype=torch.float64), 3, beta=beta),
                       t1=T, dt=0.01, method="rk4", direction="ascent", normalization=normalization, record_every=10)
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
                       direction="ascent", normalization=normalization, record_every=10)
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
    ref = tp.simulate(x0, theta, t1=1.0, dt=0.004, method="rk4", diagnostics=False).final
    dts = [0.2, 0.1, 0.05, 0.025] if method == "rk4" else [0.1, 0.05, 0.025, 0.0125]
    errs = [(tp.simulate(x0, theta, t1=1.0, dt=dt, method=method, diagnostics=False).final - ref).norm().item()
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
    ref = tp.simulate(x0, theta, t1=1.0, dt=2e-3, method="rk4")
    ad = tp.simulate(x0, theta, t1=1.0, dt=0.1, method="adaptive", rtol=1e-10, atol=1e-12)
    assert_close(ad.final, ref.final, atol=1e-8, rtol=0)
    assert_close(ad.energy[-1], ref.energy[-1], atol=1e-8, rtol=0)


def test_tokens_stay_on_sphere_float64():
    x0 = sphere.octahedral(50, dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(4, 3, generator=gen(5), dtype=torch.float64))
    for method in ("euler", "heun", "rk4"):
        tr = tp.simulate(x0, theta, t1=1.0, dt=0.01, method=method, paths=2)
        assert (tr.x.norm(dim=-1) - 1).abs().max() < 1e-12


def test_float32_follows_input_and_agrees():
    x0 = sphere.octahedral(30, dtype=torch.float64)
    heads = tp.Heads.random(3, 3, generator=gen(6), dtype=torch.float64)
    t64 = tp.simulate(x0, tp.Oscillating(heads), t1=1.0, dt=0.01)
    t32 = tp.simulate(x0.float(), tp.Oscillating(heads.to(torch.float32)), t1=1.0, dt=0.01)
    assert t32.x.dtype == torch.float32 and t32.energy.dtype == torch.float32
    assert_close(t32.x, t64.x.float(), atol=1e-4, rtol=0)
    assert_close(t32.ledger["residual"], t64.ledger["residual"].float(), atol=1e-4, rtol=0)


def test_record_every_and_shapes():
    x0 = sphere.sample_uniform(6, 3, batch_shape=(2,), generator=gen(7), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(8), dtype=torch.float64))
    tr = tp.simulate(x0, theta, t1=1.0, dt=0.1, paths=3, record_every=3)
    assert_close(tr.times, torch.tensor([0.0, 0.3, 0.6, 0.9, 1.0], dtype=torch.float64))
    assert tr.x.shape == (5, 3, 2, 6, 3)
    assert tr.energy.shape == (5, 3, 2)
    for v in tr.ledger.values():
        assert v.shape == (5, 3, 2)
    # records at the recorded steps equal an every-step run
    full = tp.simulate(x0, theta, t1=1.0, dt=0.1, paths=3, record_every=1)
    assert_close(full.x[[0, 3, 6, 9, 10]], tr.x)
    assert_close(full.ledger["residual"][[0, 3, 6, 9, 10]], tr.ledger["residual"])


def test_nonfinite_run_stops_with_time_step_and_quantity():
    x0 = sphere.sample_uniform(10, 3, generator=gen(9), dtype=torch.float64)
    heads = tp.Heads.scalar(torch.tensor([400.0], dtype=torch.float64), 3, beta=2.0)
    with pytest.raises(tp.NonFiniteError, match=r"at t = .* \(step \d+\).*β·max\|A_h\|"):
        tp.simulate(x0, heads, t1=1.0, dt=0.1, normalization="unnormalized")


def test_callback_and_progress_do_not_change_results():
    x0 = sphere.sample_uniform(6, 3, generator=gen(10), dtype=torch.float64)
    theta = tp.Oscillating(tp.Heads.random(2, 3, generator=gen(11), dtype=torch.float64))
    seen = []
    a = tp.simulate(x0, theta, t1=0.5, dt=0.1, callback=lambda k, t, x: seen.append(k), progress=True)
    b = tp.simulate(x0, theta, t1=0.5, dt=0.1)
    assert seen == [1, 2, 3, 4, 5]
    assert torch.equal(a.x, b.x)


def test_checkpoint_resume_is_bit_identical(tmp_path):
    x0 = sphere.sample_uniform(6, 3, generator=gen(12), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64))
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, record_every=3)
    full = tp.simulate(x0, theta, **kw)
    ck = tmp_path / "run.ckpt"

    resumed = interrupt_and_resume(x0, theta, ck, stop_at=13, **kw)
    assert torch.equal(resumed.times, full.times)
    assert torch.equal(resumed.x, full.x)
    for key in full.ledger:
        assert torch.equal(resumed.ledger[key], full.ledger[key]), key
    # a foreign checkpoint (other seed) and a corrupted one are refused
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, theta, checkpoint=ck, **{**kw, "seed": 4})
    # other weights (OU rate, σ, or β) with the same initial heads are another run too
    other = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64), rate=2.0)
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, other, checkpoint=ck, **kw)
    hb = tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64)
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, tp.OrnsteinUhlenbeck(tp.Heads(hb.score, beta=2.0)), checkpoint=ck, **kw)
    ck.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupted"):
        tp.simulate(x0, theta, checkpoint=ck, **kw)
