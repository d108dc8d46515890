"""tp.solve(model, x0, solver, ..., ledger=tp.LedgerOptions(ledger=True)) — the composable entry point — against the keyword front ends
(tp.simulate, tp.distributed.simulate_sharded), the options a solver refuses, SaveAt(ends=True),
the geometry seam and the batch-axis convention (docs/solve.md)."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import tokens_and_heads as problem
from transformer_pde import processes


def tol(dtype, scale=1.0):
    """Two runs of the same arithmetic in a different call order: a few ulps per step, summed."""
    return dict(rtol=0, atol=200 * torch.finfo(dtype).eps * scale)


def same_run(a, b, dtype, scale=1.0):
    assert a.x.shape == b.x.shape and a.paths == b.paths
    assert_close(a.times, b.times, rtol=4 * torch.finfo(a.times.dtype).eps, atol=1e-12)
    assert_close(a.x, b.x, **tol(dtype, scale))
    for key in ("energy", "slope", "dissipation"):
        va, vb = getattr(a, key), getattr(b, key)
        assert (va is None) == (vb is None)
        if va is not None:
            assert_close(va, vb, **tol(dtype, scale))
    assert set(a.ledger) == set(b.ledger)
    for key in a.ledger:
        assert_close(a.ledger[key], b.ledger[key], **tol(dtype, scale))


# ---------------------------------------------------------------------------- solve = simulate
@pytest.mark.parametrize("method,solver", [("euler", tp.Euler()), ("heun", tp.Heun()), ("rk4", tp.RK4()),
                                           ("adaptive", tp.Dopri5(rtol=1e-6, atol=1e-8))])
def test_solve_and_simulate_agree_for_every_particle_solver(method, solver, dtype):
    """OU weights on 3 paths, ascent, non-uniform token weights: every model field and option changes the
    numbers, so a field that solve dropped on the way would show."""
    x0, heads = problem(dtype)
    w = torch.softmax(torch.randn(6, generator=gen(5), dtype=dtype), -1)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.3)
    kw = dict(t1=0.4, dt=0.05, paths=3, seed=7)
    a = tp.simulate(x0, theta, method=method, direction="ascent", weights=w, record_every=2, ledger=True,
                    **({"rtol": 1e-6, "atol": 1e-8} if method == "adaptive" else {}), **kw)
    b = tp.solve(tp.Model(theta, direction="ascent", weights=w), x0, solver, saveat=tp.SaveAt(record_every=2),
                 ledger=tp.LedgerOptions(ledger=True), **kw)
    same_run(a, b, dtype)
    assert a.x.shape == (5, 3, 6, 3) and b.paths == 3
    c = tp.simulate(x0, theta, method=method, record_every=2, ledger=True,
                    **({"rtol": 1e-6, "atol": 1e-8} if method == "adaptive" else {}), **kw)
    assert float((c.x - b.x).abs().max()) > 1e-3  # the direction and the weights do change the run


@pytest.mark.parametrize("geometry", ["post", "pre", "ngpt"])
def test_solve_with_a_layer_norm_geometry_is_simulate_with_layer_norm(geometry, dtype):
    x0, heads = problem(dtype, seed=10)
    a = tp.simulate(x0, heads, t1=0.3, dt=0.05, layer_norm=geometry, ledger=True)
    b = tp.solve(tp.Model(heads, layer_norm=geometry), x0, tp.Euler(), t1=0.3, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, dtype)
    assert b.stats["layer_norm"] == geometry


def test_solve_with_token_noise_and_causal_attention_is_simulate(dtype):
    x0, heads = problem(dtype, seed=20)
    a = tp.simulate(x0, heads, t1=0.3, dt=0.05, temperature=0.2, seed=3, method="heun", ledger=True)
    b = tp.solve(tp.Model(heads, temperature=0.2), x0, tp.Heun(), t1=0.3, dt=0.05, seed=3, ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, dtype)
    assert b.stats["temperature"] == 0.2
    quiet = tp.solve(tp.Model(heads), x0, tp.Heun(), t1=0.3, dt=0.05, seed=3, ledger=tp.LedgerOptions(ledger=True))
    assert float((quiet.x - b.x).abs().max()) > 1e-3  # the noise is in the model, and it moves the tokens
    c = tp.simulate(x0, heads, t1=0.3, dt=0.05, causal="sum", ledger=True)
    d = tp.solve(tp.Model(heads, causal="sum"), x0, tp.Euler(), t1=0.3, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    same_run(c, d, dtype)
    assert "residual" not in d.ledger and d.stats["gradient_flow"] is False


def test_solve_with_sharded_euler_is_simulate_sharded_and_euler(dtype):
    """One process: ShardedEuler is projected Euler (to rounding) and simulate_sharded builds the same solve."""
    x0, heads = problem(dtype, seed=30)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.2)
    a = tp.distributed.simulate_sharded(x0, theta, t1=0.3, dt=0.05, paths=2, seed=4)
    b = tp.solve(tp.Model(theta), x0, tp.ShardedEuler(), t1=0.3, dt=0.05, paths=2, seed=4, ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, dtype)
    c = tp.simulate(x0, theta, t1=0.3, dt=0.05, paths=2, seed=4, ledger=True)
    assert_close(b.x, c.x, **tol(dtype, 10))
    assert_close(b.ledger["residual"], c.ledger["residual"], **tol(dtype, 10))


# ---------------------------------------------------------------------------- options a solver refuses
@pytest.fixture
def no_work(monkeypatch):
    """Fail as soon as a solver builds its weight driver (the first thing a run does)."""
    def refuse(*a, **k):
        raise AssertionError("the run started: the option must be refused before any work")
    monkeypatch.setattr(processes.driver.WeightDriver, "__init__", refuse)


@pytest.mark.parametrize("solver,options,name", [
    (tp.Dopri5(), dict(checkpoint=tp.Checkpointing("ck.pt")), "checkpoint"),
    (tp.Dopri5(), dict(progress=tp.Progress(show=True)), "progress"),
    (tp.Dopri5(), dict(ledger=tp.LedgerOptions(ledger=True, quadrature="left")), "LedgerOptions.quadrature"),
    (tp.ShardedEuler(), dict(saveat=tp.SaveAt(observables={"m": lambda x, w: x.mean(-2)})), "SaveAt.observables"),
    (tp.ShardedEuler(), dict(saveat=tp.SaveAt(path=True)), "SaveAt.path"),
    (tp.ShardedEuler(), dict(ledger=tp.LedgerOptions(ledger=True, quadratic_variation="realised")),
     "LedgerOptions.quadratic_variation"),
    (tp.ShardedEuler(), dict(ledger=tp.LedgerOptions(energy_log_scale=3.0)), "LedgerOptions.energy_log_scale"),
    (tp.ShardedEuler(), dict(limits=tp.Limits(max_steps=10)), "Limits.max_steps"),
    (tp.LagrangianJKO(), dict(checkpoint=tp.Checkpointing("ck.pt")), "checkpoint"),
])
def test_an_option_the_solver_does_not_implement_is_refused_before_any_work(solver, options, name, no_work):
    x0, heads = problem(torch.float64)
    with pytest.raises(TypeError, match=name.replace(".", r"\.")):
        tp.solve(tp.Model(heads), x0, solver, t1=0.2, dt=0.1, **options)


def test_solver_settings_live_on_the_solver_that_has_them(no_work):
    with pytest.raises(TypeError, match="rtol"):
        tp.FixedStep("euler", rtol=1e-3)
    with pytest.raises(ValueError, match="Dopri5.rtol"):
        tp.Dopri5(rtol=-1.0)
    with pytest.raises(ValueError, match="FixedStep.tableau"):
        tp.FixedStep("adaptive")
    x0, heads = problem(torch.float64)
    with pytest.raises(ValueError, match="rtol and atol are the tolerances"):  # the keyword front end as before
        tp.simulate(x0, heads, t1=0.2, dt=0.1, rtol=1e-3, ledger=True)
    with pytest.raises(ValueError, match="temperature = 0.1 .token noise. needs a fixed-step solver"):
        tp.solve(tp.Model(heads, temperature=0.1), x0, tp.Dopri5(), t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(ValueError, match="Model.layer_norm"):
        tp.solve(tp.Model(heads, layer_norm="post"), x0, tp.ShardedEuler(), t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(ValueError, match="euler"):  # the layer maps are Euler-type maps
        tp.solve(tp.Model(heads, layer_norm="pre"), x0, tp.RK4(), t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(TypeError, match="model must be a tp.Model"):
        tp.solve(heads, x0, tp.Euler(), t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(TypeError, match="solver must be a solver object"):
        tp.solve(tp.Model(heads), x0, "euler", t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(TypeError, match="saveat= must be a SaveAt"):
        tp.solve(tp.Model(heads), x0, tp.Euler(), t1=0.2, dt=0.1, saveat=2, ledger=tp.LedgerOptions(ledger=True))


# ---------------------------------------------------------------------------- SaveAt(ends=True)
@pytest.mark.parametrize("solver", [tp.Euler(), tp.RK4(), tp.Dopri5(rtol=1e-9, atol=1e-11)])
def test_saveat_ends_records_t0_and_t1_only(solver, dtype):
    x0, heads = problem(dtype, seed=40)
    if isinstance(solver, tp.Dopri5) and solver.rtol < torch.finfo(dtype).eps / 2:
        solver = tp.Dopri5(rtol=1e-7, atol=1e-9)  # a finer relative tolerance than the dtype holds is refused
    full = tp.solve(tp.Model(heads), x0, solver, t1=0.5, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    ends = tp.solve(tp.Model(heads), x0, solver, t1=0.5, dt=0.05, saveat=tp.SaveAt(ends=True), ledger=tp.LedgerOptions(ledger=True))
    assert ends.times.tolist() == pytest.approx([0.0, 0.5]) and ends.x.shape == (2, 6, 3)
    assert_close(ends.x[0], x0, **tol(dtype))  # (dopri5 records the retracted solution)
    # dopri5 interpolates its dense output at other record times: the solve's tolerance, not rounding
    scale = 1e4 if isinstance(solver, tp.Dopri5) else 1.0
    assert_close(ends.x[-1], full.x[-1], **tol(dtype, scale))
    assert_close(ends.energy, full.energy[[0, -1]], **tol(dtype, scale))
    if not isinstance(solver, tp.Dopri5):  # the fixed-step ledger accumulates every step, recorded or not
        for key in full.ledger:
            assert_close(ends.ledger[key][-1], full.ledger[key][-1], **tol(dtype))


def test_saveat_ends_refuses_a_stride():
    with pytest.raises(ValueError, match="drop record_every=3"):
        tp.SaveAt(record_every=3, ends=True)


# ---------------------------------------------------------------------------- the geometry seam
@dataclass(frozen=True)
class CountingProjected(tp.Projected):
    """The projected flow with its retraction written another way, counting its calls."""

    calls: ClassVar[list] = []

    def retract(self, x):
        CountingProjected.calls.append(tuple(x.shape))
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True))


@pytest.mark.parametrize("solver,per_step", [(tp.Heun(), 1), (tp.RK4(), 3)])
def test_the_solvers_retract_through_the_models_geometry(solver, per_step, dtype):
    """A geometry object with its own retraction is what the Runge–Kutta stages use (stages − 1 calls per
    step; the end of the step goes through ``retract_step``), and it changes the numbers only by rounding."""
    x0, heads = problem(dtype, seed=50)
    CountingProjected.calls.clear()
    a = tp.solve(tp.Model(heads, layer_norm=CountingProjected()), x0, solver, t1=0.3, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    assert len(CountingProjected.calls) == 6 * per_step
    b = tp.solve(tp.Model(heads), x0, solver, t1=0.3, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    assert_close(a.x, b.x, **tol(dtype, 10))
    CountingProjected.calls.clear()
    c = tp.solve(tp.Model(heads, layer_norm=CountingProjected()), x0, tp.Dopri5(), t1=0.3, dt=0.05,
                 ledger=tp.LedgerOptions(diagnostics=False))
    assert len(CountingProjected.calls) >= c.stats["field_evaluations"]  # the field and the solution
    d = tp.solve(tp.Model(heads), x0, tp.Dopri5(), t1=0.3, dt=0.05, ledger=tp.LedgerOptions(diagnostics=False))
    assert_close(c.x, d.x, **tol(dtype, 1e3))


# ---------------------------------------------------------------------------- batch axes
def test_paths_none_and_paths_one_are_the_same_numbers_with_and_without_the_axis(dtype):
    """OU noise drawn for one path either way: paths=1 has the axis, paths=None not; with_paths() of the
    latter is the former."""
    x0, heads = problem(dtype, seed=60)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.4)
    obs = {"mean": lambda x, w: x.mean(-2)}
    seen = []
    none = tp.simulate(x0, theta, t1=0.3, dt=0.05, seed=2, observables=obs, return_path=True,
                       callback=lambda k, t, x: seen.append(tuple(x.shape)), ledger=True)
    one = tp.simulate(x0, theta, t1=0.3, dt=0.05, seed=2, paths=1, observables=obs, ledger=True)
    assert none.paths is None and one.paths == 1
    assert none.x.shape == (7, 6, 3) and one.x.shape == (7, 1, 6, 3)
    assert none.energy.shape == (7,) and one.energy.shape == (7, 1)
    assert none.observables["mean"].shape == (7, 3) and one.observables["mean"].shape == (7, 1, 3)
    assert seen == [(6, 3)] * 6  # the callback sees the caller's convention
    assert none.path.scores.shape == (7, 2, 3, 3)  # the stored path too (no paths axis)
    batched = none.with_paths()
    assert batched.paths == 1 and batched.num_paths == 1 and none.paths is None
    same_run(batched, one, dtype)
    assert_close(batched.observables["mean"], one.observables["mean"], **tol(dtype))
    assert one.with_paths() is one


def test_with_paths_lets_a_consumer_index_paths_without_branching(dtype):
    x0, heads = problem(dtype, seed=70)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.4)
    for paths in (None, 1, 3):
        traj = tp.solve(tp.Model(theta), x0, tp.Euler(), t1=0.2, dt=0.05, paths=paths, seed=1, ledger=tp.LedgerOptions(ledger=True)).with_paths()
        P = traj.num_paths
        assert P == (paths or 1)
        assert traj.x.shape == (5, P, 6, 3) and traj.energy.shape == (5, P)
        assert all(v.shape == (5, P) for v in traj.ledger.values())
        mean_path = traj.energy.mean(1)  # the Monte-Carlo mean over paths, the same code for every run
        assert mean_path.shape == (5,)


def test_an_ensemble_keeps_its_axis_after_the_paths_axis(dtype):
    x0 = tp.ensembles.random_tokens(4, 5, 3, generator=gen(80), dtype=dtype)
    heads = tp.ensembles.random_heads(4, 2, 3, generator=gen(81), dtype=dtype)
    one = tp.ensembles.simulate(x0, heads, t1=0.2, dt=0.05, ledger=True)
    paths = tp.ensembles.simulate(x0, tp.Constant(heads), t1=0.2, dt=0.05, paths=2, ledger=True)
    assert one.x.shape == (5, 4, 5, 3) and one.with_paths().x.shape == (5, 1, 4, 5, 3)
    assert paths.x.shape == (5, 2, 4, 5, 3)
    assert_close(paths.x[:, 1], one.x, **tol(dtype, 10))  # constant heads: every path is the same run


# ---------------------------------------------------------------------------- a solver of one's own
@dataclasses.dataclass(frozen=True)
class _LoopEuler(tp.Solver):
    """A user's solver: projected Euler written as a plain loop over tp.velocity (the way the docs'
    "Where to add a solver" says: a Solver subclass with ``run``)."""

    accepts = frozenset({"saveat"})
    calls: list = dataclasses.field(default_factory=list, compare=False)

    def run(self, model, x0, options):
        self.calls.append((options.saveat.record_every, options.ledger, options.checkpoint))
        t0, dt, saveat = options.t0, options.dt, options.saveat
        heads = model.theta.heads_at(t0)
        K = options.steps
        xs, x = [x0], x0
        for _ in range(K):
            v = tp.velocity(x, heads, model.weights, normalization=model.normalization,
                            direction=model.direction)
            x = tp.sphere.normalize(x + dt * v)
            xs.append(x)
        keep = list(range(0, K + 1, saveat.record_every))
        times = torch.tensor([t0 + k * dt for k in keep], dtype=torch.float64)  # as the built-in solvers
        E = torch.stack([tp.energy(xs[k], heads, model.weights) for k in keep])
        return tp.Trajectory(times, torch.stack([xs[k] for k in keep]), E, None, None, {}, {"steps": K}, "loop-euler",
                             model.normalization.name, model.direction)


def test_a_solver_subclass_with_run_plugs_into_solve(dtype):
    x0, heads = problem(dtype, seed=90)
    model = tp.Model(heads, normalization="softmax")
    mine = _LoopEuler()
    ours = tp.solve(model, x0, mine, t1=0.5, dt=0.05, saveat=tp.SaveAt(record_every=2))
    ref = tp.solve(model, x0, tp.Euler(), t1=0.5, dt=0.05, saveat=tp.SaveAt(record_every=2), ledger=tp.LedgerOptions(ledger=True))
    assert mine.calls == [(2, tp.LedgerOptions(), None)]  # the options it does not accept arrive at their defaults
    assert_close(ours.times, ref.times, **tol(dtype))
    assert_close(ours.x, ref.x, **tol(dtype, 100))
    assert_close(ours.energy, ref.energy, **tol(dtype, 100))
    with pytest.raises(TypeError, match="_LoopEuler does not take ledger="):
        tp.solve(model, x0, mine, t1=0.5, dt=0.05, ledger=tp.LedgerOptions(diagnostics=False))
    assert len(mine.calls) == 1  # refused before run
