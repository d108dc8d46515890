"""A user's solver through the step protocol (examples/stochastic_heun.py): its weak order against the projected
Euler–Maruyama step of tp.Euler() on closed forms, and what the loop gives it (callbacks, checkpoints and resume,
records, lazy diagnostics, the energy ledger)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import transformer_pde as tp
from conftest import gen

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("_example_stochastic_heun", ROOT / "examples" / "stochastic_heun.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


StochasticHeun = _example().StochasticHeun


def _rotation(omega, T, dtype, d=3):
    """One token per system, value W skew (rotation at rate ω in the (e₁, e₂) plane) and token noise T: the field
    is V(x) = W x, and E[X_t] = e^{−(d−1)Tt} e^{Wt} x0 (the rotation commutes with the Laplacian)."""
    W = torch.zeros(1, d, d, dtype=dtype)
    W[0, 0, 1], W[0, 1, 0] = -omega, omega
    heads = tp.Heads(torch.zeros(1, d, d, dtype=dtype), W, torch.ones(1, dtype=dtype))
    x0 = torch.nn.functional.normalize(torch.tensor([1.0, 0.0, 1.0], dtype=dtype), dim=-1)
    exact = lambda t: math.exp(-(d - 1) * T * t) * (torch.linalg.matrix_exp(W[0].double() * t) @ x0.double())
    return tp.Model(heads, temperature=T), x0, exact


def _weak_errors(solver, model, x0, exact, dts, paths, t1=1.0):
    """|E[X_t1] − exact| from ``paths`` systems of one token at each dt, and its Monte-Carlo standard error."""
    out = []
    for dt in dts:
        traj = tp.solve(model, x0.expand(paths, 1, x0.shape[-1]).contiguous(), solver, t1=t1, dt=dt, seed=1,
                        saveat=tp.SaveAt(ends=True))
        X = traj.x[-1, :, 0].double()
        out.append((float((X.mean(0) - exact(t1)).norm()), float((X.std(0) / paths ** 0.5).norm())))
    return out


def _order(e1, e2):
    """The weak order between dt and dt/2 and its error bar (the standard errors propagated)."""
    (a, sa), (b, sb) = e1, e2
    return math.log2(a / b), math.hypot(sa / a, sb / b) / math.log(2)


def test_heun_is_second_order_where_the_drift_dominates_and_euler_maruyama_first(dtype):
    """Rotation ω = 4 with little noise (T = 0.05): the drift's error dominates; Euler–Maruyama halves its
    weak error with dt (order 1), the stochastic Heun takes second-order steps of the drift (order ≥ 1.5
    between dt = 1/4 and 1/8) and is far more accurate; the orders carry their Monte-Carlo error bars."""
    model, x0, exact = _rotation(4.0, 0.05, dtype)
    em = _weak_errors(tp.Euler(), model, x0, exact, (1 / 4, 1 / 8, 1 / 16), 20000)
    heun = _weak_errors(StochasticHeun(), model, x0, exact, (1 / 4, 1 / 8), 20000)
    for e1, e2 in zip(em, em[1:]):
        p, bar = _order(e1, e2)
        assert abs(p - 1.0) < 0.1 + 3 * bar, (p, bar, em)
    p, bar = _order(*heun)
    assert p - 3 * bar > 1.5, (p, bar, heun)
    assert heun[1][0] < em[1][0] / 5, (heun, em)


@pytest.mark.slow
def test_weak_order_one_of_both_on_brownian_motion_of_the_sphere(dtype):
    """No drift, T = 0.5: E[X_t] = e^{−2Tt} x0 on S².  The noise on the sphere is multiplicative (P_x ξ), so the
    stochastic Heun, like Euler–Maruyama, has weak order 1: over dt = 1/4 … 1/32 (10⁵ paths each) the order is
    between ½ and 3/2 (measured ≈ 0.8, rising: the local order between 1/16 and 1/32 is 1 within its error bar)."""
    model, x0, exact = _rotation(0.0, 0.5, dtype)
    dts = (1 / 4, 1 / 8, 1 / 16, 1 / 32)
    for solver in (tp.Euler(), StochasticHeun()):
        errs = _weak_errors(solver, model, x0, exact, dts, 100000)
        p_all, bar_all = (v / (len(dts) - 1) for v in _order(errs[0], errs[-1]))
        p_last, bar_last = _order(errs[-2], errs[-1])
        assert abs(p_last - 1.0) < 0.1 + 3 * bar_last, (type(solver).__name__, p_last, bar_last, errs)
        assert 0.5 < p_all - 3 * bar_all and p_all + 3 * bar_all < 1.5, (type(solver).__name__, p_all, bar_all, errs)


def _noisy_problem(dtype):
    x0 = tp.sphere.sample_uniform(6, 3, batch_shape=(4,), generator=gen(3), dtype=dtype)
    heads = tp.Heads.random(2, 3, generator=gen(4), dtype=dtype)
    return tp.Model(tp.OrnsteinUhlenbeck(heads, sigma=0.5), temperature=0.1), x0


class _Stop(Exception):
    pass


def test_the_loop_gives_a_users_solver_callbacks_checkpoints_records_and_the_ledger(dtype, tmp_path):
    """StochasticHeun defines step only: the callback sees every step, a run stopped after step 5 resumes from
    its step-4 checkpoint to the uninterrupted run's tokens and ledger, the lazy diagnostics equal the eager
    ones, and the ledger's residual is of order dt (not of the energy change)."""
    model, x0 = _noisy_problem(dtype)
    kw = dict(t1=0.4, dt=0.05, paths=3, seed=2, ledger=tp.LedgerOptions(ledger=True))
    ref = tp.solve(model, x0, StochasticHeun(), **kw)
    seen = []

    def stop(k, t, x):
        seen.append((k, round(t, 9), tuple(x.shape)))
        if k == 5:
            raise _Stop
    ck = tp.Checkpointing(tmp_path / "ck.pt", every=4)
    with pytest.raises(_Stop):
        tp.solve(model, x0, StochasticHeun(), checkpoint=ck, progress=tp.Progress(callback=stop), **kw)
    assert seen == [(k, round(0.05 * k, 9), (3, 4, 6, 3)) for k in range(1, 6)]
    resumed = tp.solve(model, x0, StochasticHeun(), checkpoint=ck, **kw)
    eps = torch.finfo(dtype).eps
    tol = dict(rtol=0.0, atol=1e3 * eps)
    torch.testing.assert_close(resumed.x, ref.x, **tol)
    for key, v in ref.ledger.items():
        torch.testing.assert_close(resumed.ledger[key], v, **tol, msg=lambda m: f"{key}: {m}")
    assert ref.method == "stochasticheun" and ref.stats["field_evaluations"] == 1 + 2 * 8
    lazy = tp.solve(model, x0, StochasticHeun(), **{**kw, "ledger": tp.LedgerOptions()})
    assert not hasattr(lazy, "ledger")
    torch.testing.assert_close(lazy.x, ref.x, **tol)
    torch.testing.assert_close(lazy.energy, ref.energy, rtol=1e2 * eps ** 0.5, atol=1e2 * eps ** 0.5)
    dE, res = ref.ledger["dE"][-1], ref.ledger["residual"][-1]
    assert float(res.abs().max()) < 0.25 * float(dE.abs().max()), (res, dE)


def test_a_users_solver_without_the_noise_increment_is_told_what_to_return():
    model, x0 = _noisy_problem(torch.float64)

    class NoInfo(StochasticHeun):
        def step(self, state, t, dt):
            return super().step(state, t, dt)[0], {}
    with pytest.raises(TypeError, match=r"info\['noise'\]"):
        tp.solve(model, x0, NoInfo(), t1=0.1, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
