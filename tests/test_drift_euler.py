"""tp.DriftEuler: projected Euler of the attention field plus a token-wise drift.  With the drift ≡ 0 it is
tp.Euler(); on a closed form (a constant drift a on S², no attention: tan(θ/2) = tan(θ₀/2)·e^{−|a|t}, θ the
angle to a) its measured order is 1; bad drifts are refused at the first step; the loop's checkpoints resume."""

import math

import pytest
import torch

import transformer_pde as tp
from conftest import gen


def _tokens(n, d, dtype, seed=0):
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen(seed), dtype=dtype), dim=-1)


def test_zero_drift_is_euler(dtype):
    x0 = _tokens(6, 3, dtype)
    heads = tp.Heads.random(2, 3, generator=gen(1), dtype=dtype)
    model = tp.Model(tp.Constant(heads))
    kw = dict(t1=0.5, dt=0.05)
    ref = tp.solve(model, x0, tp.Euler(), **kw)
    out = tp.solve(model, x0, tp.DriftEuler(lambda t, x: torch.zeros_like(x)), **kw)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.x, ref.x, rtol=1e2 * eps, atol=1e2 * eps)
    assert out.method == "drift_euler" and out.x.dtype == dtype
    # the step reports how far it left the sphere before the retraction, as Euler does (O(dt²) per step)
    assert 0 < out.stats["max_sphere_error"] < 1e-2
    assert out.stats["max_sphere_error"] == pytest.approx(ref.stats["max_sphere_error"], rel=1e2 * eps, abs=1e2 * eps)


def _exact(x0, a, t):
    """The flow of ẋ = P_x a on S^{d-1}: x = cos θ e + sin θ u, tan(θ/2) = tan(θ₀/2) e^{−|a|t}."""
    e = a / a.norm()
    c0 = (x0 * e).sum(-1, keepdim=True)
    u = torch.nn.functional.normalize(x0 - c0 * e, dim=-1)
    th = 2 * torch.atan(torch.tan(torch.arccos(c0) / 2) * math.exp(-float(a.norm()) * t))
    return torch.cos(th) * e + torch.sin(th) * u


def test_constant_drift_converges_at_order_one(dtype):
    """No attention (scalar head 0); the error at t = 1 against the closed form over dt = 0.1/2^k: the
    least-squares slope of log error against log dt is 1 within its standard error (deterministic)."""
    x0 = _tokens(5, 3, dtype, seed=3)
    a = torch.tensor([0.3, -0.5, 1.2], dtype=dtype)
    model = tp.Model(tp.Heads.scalar([0.0], 3).to(dtype))
    exact = _exact(x0.to(torch.float64), a.to(torch.float64), 1.0)
    dts = [0.1 / 2 ** k for k in range(4)]
    errs = []
    for dt in dts:
        traj = tp.solve(model, x0, tp.DriftEuler(lambda t, x: a.expand_as(x)), t1=1.0, dt=dt,
                        saveat=tp.SaveAt(ends=True))
        assert traj.x.dtype == dtype
        errs.append(float((traj.x[-1].to(torch.float64) - exact).norm(dim=-1).max()))
    lx, ly = torch.log(torch.tensor(dts, dtype=torch.float64)), torch.log(torch.tensor(errs, dtype=torch.float64))
    xm, ym = lx - lx.mean(), ly - ly.mean()
    slope = float((xm * ym).sum() / (xm * xm).sum())
    resid = ym - slope * xm
    se = float((resid.pow(2).sum() / (len(dts) - 2) / (xm * xm).sum()).sqrt())
    assert 0.9 < slope < 1.1 and se < 0.05, (slope, se, errs)
    assert errs[-1] > 1e3 * torch.finfo(dtype).eps  # the error measured is the method's, not rounding


def test_drift_reads_the_left_end_time(dtype):
    """A drift switched on at t ≥ 0.5 only: the tokens stay put up to the step that starts at 0.5."""
    x0 = _tokens(4, 3, dtype)
    a = torch.tensor([0.0, 0.0, 1.0], dtype=dtype)
    model = tp.Model(tp.Heads.scalar([0.0], 3).to(dtype))
    traj = tp.solve(model, x0, tp.DriftEuler(lambda t, x: a.expand_as(x) * float(t >= 0.5 - 1e-9)), t1=1.0,
                    dt=0.25)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(traj.x[2], traj.x[0].expand_as(traj.x[2]), rtol=0.0, atol=10 * eps)
    assert float((traj.x[3] - traj.x[2]).abs().max()) > 0.01


class _Stop(Exception):
    pass


def test_refusals_before_any_step():
    x0 = _tokens(4, 3, torch.float64)
    model = tp.Model(tp.Heads.scalar([1.0], 3).to(torch.float64))
    with pytest.raises(TypeError, match="callable"):
        tp.DriftEuler(3.0)
    steps = []
    cb = tp.Progress(callback=lambda k, t, x: steps.append(k))
    with pytest.raises(ValueError, match=r"x's shape \(1, 4, 3\).*got \(1, 4, 2\)"):
        tp.solve(model, x0, tp.DriftEuler(lambda t, x: x[..., :2]), t1=0.5, dt=0.1, progress=cb)
    with pytest.raises(ValueError, match="shape.*got NoneType"):
        tp.solve(model, x0, tp.DriftEuler(lambda t, x: None), t1=0.5, dt=0.1, progress=cb)
    with pytest.raises(ValueError, match="shape.*got float"):
        tp.solve(model, x0, tp.DriftEuler(lambda t, x: 0.5), t1=0.5, dt=0.1, progress=cb)
    assert steps == []
    for layer_norm in ("post", "pre"):  # DriftEuler's own refusal, naming the geometry it was given
        with pytest.raises(ValueError, match=f"DriftEuler integrates the projected flow.*layer_norm='{layer_norm}'"):
            tp.solve(tp.Model(tp.Heads.scalar([1.0], 3).to(torch.float64), layer_norm=layer_norm), x0,
                     tp.DriftEuler(lambda t, x: x), t1=0.5, dt=0.1)


def test_checkpoint_resume_through_the_loop(dtype, tmp_path):
    x0 = _tokens(5, 3, dtype)
    heads = tp.Heads.random(2, 3, generator=gen(2), dtype=dtype)
    model = tp.Model(tp.Constant(heads))
    W = torch.tensor([[0.0, -1.0, 0.5], [1.0, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=dtype)
    solver = tp.DriftEuler(lambda t, x: (1 + t) * x @ W.T)
    kw = dict(t1=0.4, dt=0.05)
    ref = tp.solve(model, x0, solver, **kw)

    def stop(k, t, x):
        if k == 5:
            raise _Stop
    ck = tp.Checkpointing(tmp_path / "ck.pt", every=4)
    with pytest.raises(_Stop):
        tp.solve(model, x0, solver, checkpoint=ck, progress=tp.Progress(callback=stop), **kw)
    resumed = tp.solve(model, x0, solver, checkpoint=ck, **kw)
    tol = 1e2 * torch.finfo(dtype).eps
    torch.testing.assert_close(resumed.x, ref.x, rtol=tol, atol=tol)
