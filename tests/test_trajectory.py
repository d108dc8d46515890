"""transformer_pde.solvers.trajectory: the Trajectory (time averages, log-energy at a scale, the paths
axis convention) and the non-finite errors."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from transformer_pde.solvers.trajectory import (PathsAxis, check_finite, drop_paths, ledger_nonfinite,
                                                nonfinite_error)


def made(T=5, batch=(2,), dtype=torch.float64, paths=None, stats=None):
    """A Trajectory built by hand, series (T, *batch, ...) of known values."""
    times = torch.linspace(0.0, 1.0, T, dtype=torch.float64)
    x = tp.sphere.sample_uniform(4, 3, batch_shape=(T, *batch), generator=gen(1), dtype=dtype)
    e = torch.arange(T * math.prod(batch), dtype=dtype).reshape(T, *batch) + 1.0
    return tp.Trajectory(times, x, e, 2 * e, 3 * e, {"dE": e - e[0]}, stats or {}, "euler", "softmax", "descent",
                         observables={"m": x.mean(-2)}, extras={"radius": x.norm(dim=-1), "grid": torch.ones(T, 3)},
                         paths=paths)


def test_with_paths_adds_the_axis_after_time_and_leaves_other_fields(dtype):
    traj = made(dtype=dtype)
    b = traj.with_paths()
    assert b.paths == 1 and b.num_paths == 1 and traj.paths is None and traj.num_paths == 1
    assert b.x.shape == (5, 1, 2, 4, 3) and b.energy.shape == (5, 1, 2) and b.ledger["dE"].shape == (5, 1, 2)
    assert b.observables["m"].shape == (5, 1, 2, 3) and b.extras["radius"].shape == (5, 1, 2, 4)
    assert b.extras["grid"].shape == (5, 3)  # not a series of the batch: left as it is
    eps = torch.finfo(dtype).eps  # the slope series, a view with a new axis: equal to a few ulps of its size
    assert_close(b.slope[:, 0], traj.slope, rtol=4 * eps, atol=4 * eps * float(traj.slope.abs().max()))
    assert b.times is traj.times
    with_axis = made(dtype=dtype, paths=2)
    assert with_axis.with_paths() is with_axis and with_axis.num_paths == 2


def test_drop_paths_is_the_inverse_of_the_lift():
    traj = made()
    lifted = traj.with_paths()
    back = drop_paths(lifted, None)
    assert back.paths is None and back.x.shape == traj.x.shape and back.energy.shape == traj.energy.shape
    kept = drop_paths(lifted, 1)
    assert kept.paths == 1 and kept.x.shape == lifted.x.shape
    # an axis of length > 1 that the caller did not ask for came from a replayed path: it is kept and counted
    wide = made(batch=(3,))
    assert drop_paths(wide, None).paths == 3


def test_paths_axis_views_for_the_caller():
    axis = PathsAxis(None)
    x = torch.randn(4, 3, generator=gen(2))
    state = axis.lift(x)
    assert state.shape == (1, 4, 3) and axis.view(state).shape == (4, 3)
    assert axis.unview(axis.view(state)).shape == (1, 4, 3)
    seen = []
    obs = axis.observable(lambda y, w: seen.append(y.shape) or y.sum(-1))
    assert obs(state, None).shape == (1, 4) and seen == [(4, 3)]
    five = PathsAxis(5)
    assert five.lift(x).shape == (5, 4, 3) and five.view(five.lift(x)).shape == (5, 4, 3)


def test_time_average_is_the_trapezoid_rule(dtype):
    """Values t² on a non-uniform grid: the trapezoid mean computed here by hand."""
    times = torch.tensor([0.0, 0.1, 0.4, 1.0], dtype=torch.float64)
    v = (times ** 2).to(dtype)
    traj = tp.Trajectory(times, torch.zeros(4, 1, 3, dtype=dtype), None, None, None, {}, {}, "euler", "softmax",
                         "descent")
    want = (0.1 * (0 + 0.01) / 2 + 0.3 * (0.01 + 0.16) / 2 + 0.6 * (0.16 + 1.0) / 2) / 1.0
    assert float(traj.time_average(v)) == pytest.approx(want, rel=10 * torch.finfo(dtype).eps)
    want_late = (0.6 * (0.16 + 1.0) / 2) / 0.6
    assert float(traj.time_average(v, t_min=0.4)) == pytest.approx(want_late, rel=10 * torch.finfo(dtype).eps)
    assert float(traj.time_average(v, t_min=1.0)) == pytest.approx(1.0)


def test_log_energy_adds_the_common_scale_back():
    traj = made(stats={"energy_log_scale": 700.0})
    assert traj.energy_log_scale == 700.0
    assert_close(traj.log_energy(), torch.log(traj.energy) + 700.0, rtol=1e-15, atol=0)
    quiet = tp.Trajectory(traj.times, traj.x, None, None, None, {}, {}, "euler", "softmax", "descent")
    with pytest.raises(ValueError, match="diagnostics=False"):
        quiet.log_energy()
    assert "paths" not in repr(quiet) and "x=(5, 2, 4, 3)" in repr(quiet)


def test_nonfinite_errors_name_time_step_and_fix():
    heads = tp.Heads.scalar([400.0], 3).to(torch.float32)
    err = nonfinite_error("the velocity field", 0.25, 5, heads, "unnormalized")
    assert isinstance(err, tp.NonFiniteError) and isinstance(err, FloatingPointError)
    msg = str(err)
    assert "t = 0.25" in msg and "(step 5)" in msg and "normalization='softmax'" in msg
    # e^{β‖A‖} with β‖A‖ = 400 overflows float32 (log max ≈ 88.7): the message blames the kernel
    assert "e^{β⟨x,Ay⟩}" in msg
    soft = str(nonfinite_error("the token positions", 1.0, 2, heads, "softmax"))
    assert "smaller dt" in soft and "cannot overflow" in soft
    lp = torch.tensor([80.0, 85.0])
    msg = str(ledger_nonfinite("the energy", 0.5, 3, lp, 0.0, 1.0))
    assert "energy_log_scale=" in msg and "(step 3)" in msg  # the scale to pass instead


def test_check_finite_catches_every_non_finite_entry(dtype):
    v = torch.ones(100, dtype=dtype)
    assert check_finite(v)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = v.clone()
        w[37] = bad
        assert not check_finite(w)
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # the sum overflows, the entries are finite
    assert check_finite(big)


def test_a_solved_trajectory_has_the_documented_paths_attribute(dtype):
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(3), dtype=dtype)
    heads = tp.Heads.random(1, 3, generator=gen(4), dtype=dtype)
    assert tp.simulate(x0, heads, t1=0.1, dt=0.05, ledger=True).paths is None
    assert tp.simulate(x0, tp.OrnsteinUhlenbeck(heads), t1=0.1, dt=0.05, paths=2, ledger=True).paths == 2


def test_repr_shows_the_tokens_dtype_without_the_torch_prefix(dtype):
    """repr names the method, the tokens' shape and their dtype as "float32"/"float64" (not
    "torch.float32"), and leaves the dtype out for tokens that are not a tensor."""
    traj = made(dtype=dtype)
    name = {torch.float32: "float32", torch.float64: "float64"}[dtype]
    r = repr(traj)
    assert f"x=(5, 2, 4, 3) {name}, " in r, r
    assert "torch." not in r and "method='euler'" in r, r
    other = tp.Trajectory(traj.times, None, None, None, None, {}, {}, "euler", "softmax", "descent")
    assert repr(other).endswith("x=None)") and name not in repr(other)


def test_hasattr_ledger_is_false_without_a_ledger_and_reading_it_names_the_option(dtype):
    """Without a ledger: hasattr/getattr tell without raising, the read is a ValueError naming ledger=True,
    the repr shows ledger=None; with one, all three see it."""
    times = torch.linspace(0.0, 1.0, 3, dtype=torch.float64)
    x = tp.sphere.sample_uniform(4, 3, batch_shape=(3,), generator=gen(2), dtype=dtype)
    bare = tp.Trajectory(times, x, None, None, None, None, {}, "euler", "softmax", "descent")
    assert not hasattr(bare, "ledger") and getattr(bare, "ledger", None) is None and not bare.has_ledger
    with pytest.raises(ValueError, match="ledger=True"):
        bare.ledger
    assert "ledger=None" in repr(bare)
    full = made(dtype=dtype)
    assert hasattr(full, "ledger") and full.has_ledger and "ledger=[dE]" in repr(full)
