"""The particle solver objects run themselves: Euler/Heun/RK4 are FixedStep classes, FixedStep takes a
user's ButcherTableau, ``solver.run(model, x0, options)`` is what tp.solve calls, user-defined
normalisations and geometries outside the registries go through a solve, and the keyword front ends
name the keyword the user typed (docs/solve.md)."""

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen

F64 = torch.float64

#: Ralston's second-order method (c2 = 2/3, the minimum-error two-stage tableau): not built in
RALSTON = tp.ButcherTableau("ralston", 2, (0.0, 2 / 3), ((), (2 / 3,)), (0.25, 0.75))


def problem(dtype, n=6, d=3, H=2, seed=0):
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=dtype)
    heads = tp.Heads.random(H, d, generator=gen(seed + 1), dtype=dtype)
    return x0, heads


def ulps(dtype, k):
    """k rounding units of the dtype: two evaluations of the same arithmetic in another order."""
    return dict(rtol=k * torch.finfo(dtype).eps, atol=k * torch.finfo(dtype).eps)


# ---------------------------------------------------------------------------- the classes
def test_euler_heun_rk4_are_fixed_step_classes_equal_to_their_tableaux():
    for cls, name, order in ((tp.Euler, "euler", 1), (tp.Heun, "heun", 2), (tp.RK4, "rk4", 4)):
        s = cls()
        assert isinstance(s, tp.FixedStep) and isinstance(s, cls) and isinstance(s, tp.Solver)
        assert s == cls() == tp.FixedStep(name) == tp.FixedStep(tp.TABLEAUX[name])
        assert hash(s) == hash(tp.FixedStep(name)) and len({s, cls(), tp.FixedStep(name)}) == 1
        assert s.tableau is tp.TABLEAUX[name] and s.order == order and s.method == name
        assert repr(s) == f"{cls.__name__}()"
    assert repr(tp.FixedStep("heun")) == "FixedStep('heun')" and "ralston" in repr(tp.FixedStep(RALSTON))
    assert tp.Euler() != tp.Heun() and not isinstance(tp.Heun(), tp.Euler)
    assert tp.FixedStep(RALSTON).order == 2 and tp.FixedStep(RALSTON) != tp.Heun()
    with pytest.raises(TypeError, match="FixedStep.tableau must be a ButcherTableau"):
        tp.FixedStep(2)
    with pytest.raises(ValueError, match="unknown FixedStep.tableau 'midpoint'"):
        tp.FixedStep("midpoint")


def test_a_users_tableau_is_one_hand_written_step(dtype):
    """One step of FixedStep(Ralston) is x1 = R(x0 + dt(¼k1 + ¾k2)), k2 = v(R(x0 + ⅔dt·k1)), R = x/|x|,
    with v the projected field of tp.evaluate (descent: sign −1)."""
    x0, heads = problem(dtype, seed=3)
    dt = 0.1

    def v(x):
        return tp.evaluate(x, heads, sign=-1.0, diagnostics=False).velocity

    def unit(y):
        return y / y.norm(dim=-1, keepdim=True)

    k1 = v(x0)
    k2 = v(unit(x0 + (2 / 3) * dt * k1))
    x1 = unit(x0 + dt * (0.25 * k1 + 0.75 * k2))
    tr = tp.solve(tp.Model(heads, direction="descent"), x0, tp.FixedStep(RALSTON), t1=dt, dt=dt, ledger=tp.LedgerOptions(ledger=True))
    assert tr.method == "ralston" and tr.stats["order"] == 2 and tr.stats["field_evaluations"] == 3
    assert_close(tr.x[-1], x1, **ulps(dtype, 64))


def test_a_users_tableau_converges_at_its_order():
    """Ralston's error against a fine RK4 solution falls like dt² (measured order in [1.8, 2.2])."""
    x0, heads = problem(F64, seed=5)
    model = tp.Model(heads, direction="descent")
    t1 = 0.8
    ref = tp.solve(model, x0, tp.RK4(), t1=t1, dt=t1 / 800, saveat=tp.SaveAt(ends=True), ledger=tp.LedgerOptions(ledger=True)).x[-1]
    errs = [float((tp.solve(model, x0, tp.FixedStep(RALSTON), t1=t1, dt=t1 / k,
                            saveat=tp.SaveAt(ends=True), ledger=tp.LedgerOptions(ledger=True)).x[-1] - ref).norm()) for k in (10, 20, 40)]
    orders = [math.log2(errs[i] / errs[i + 1]) for i in range(2)]
    assert all(1.8 < p < 2.2 for p in orders), (errs, orders)


def test_run_is_the_solve(dtype):
    """tp.solve fills in the options and calls solver.run; calling run with the same SolveOptions is the
    same solve, for the fixed-step, adaptive and sharded solvers."""
    x0, heads = problem(dtype, seed=7)
    model = tp.Model(tp.OrnsteinUhlenbeck(heads, sigma=0.3), direction="descent")
    for solver, accepted in ((tp.Heun(), {}), (tp.Dopri5(rtol=1e-6, atol=1e-8), {}), (tp.ShardedEuler(), {})):
        a = tp.solve(model, x0, solver, t1=0.3, dt=0.05, paths=2, seed=4, saveat=tp.SaveAt(record_every=2),
                     ledger=tp.LedgerOptions(ledger=True))
        b = solver.run(model, x0, tp.SolveOptions(t1=0.3, dt=0.05, paths=2, seed=4, saveat=tp.SaveAt(record_every=2),
                                                  ledger=tp.LedgerOptions(ledger=True), **accepted))
        assert a.method == b.method == solver.method
        assert_close(a.x, b.x, **ulps(dtype, 16))
        assert_close(a.ledger["residual"], b.ledger["residual"], **ulps(dtype, 16))


# ---------------------------------------------------------------------------- objects outside the registries
@dataclass(frozen=True)
class DoubledSoftmax(tp.Normalization):
    """A user's normalisation (not in the registry): twice the softmax output."""

    name: ClassVar[str] = "doubled-softmax"

    def outputs(self, kernel):
        return 2 * kernel.value_mean()


def test_a_users_normalization_goes_through_solve(dtype):
    """Twice the softmax field is the softmax flow at twice the speed: Euler with dt/2 on 2v is Euler
    with dt on v step for step (the tokens to rounding); the energy depends on the tokens only, so it
    matches too."""
    x0, heads = problem(dtype, seed=11)
    a = tp.solve(tp.Model(heads, normalization=DoubledSoftmax(), direction="descent"), x0, tp.Euler(), t1=0.5, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    b = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=1.0, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    assert a.normalization == "doubled-softmax"
    assert_close(a.x, b.x, **ulps(dtype, 256))
    assert_close(a.energy, b.energy, **ulps(dtype, 1024))


def test_a_users_normalization_goes_through_dopri5():
    """The same ODE through dopri5 (float64, rtol 1e-9): the two solutions agree to the tolerance."""
    x0, heads = problem(F64, seed=11)
    solver = tp.Dopri5(rtol=1e-9, atol=1e-11)
    a = tp.solve(tp.Model(heads, normalization=DoubledSoftmax(), direction="descent"), x0, solver, t1=0.5, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    b = tp.solve(tp.Model(heads, direction="descent"), x0, solver, t1=1.0, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    assert_close(a.x, b.x, rtol=1e-7, atol=1e-7)
    assert_close(a.energy, b.energy, rtol=1e-7, atol=1e-7)


@dataclass(frozen=True)
class HalfPostLN(tp.PostLN):
    """A user's layer map (not in the registry): post-LN of half the update, x ← (x + ½dt·A)/|x + ½dt·A|."""

    name: ClassVar[str] = "half-post"

    def step(self, x, r, update, dt):
        return super().step(x, r, 0.5 * update, dt)


def test_a_users_layer_norm_goes_through_solve(dtype):
    """The layer map of a user's LayerNormScheme subclass is the step: a hand loop of
    x ← normalize(x + ½dt·A(x)), A the signed un-projected update of tp.evaluate."""
    x0, heads = problem(dtype, seed=13)
    tr = tp.solve(tp.Model(heads, layer_norm=HalfPostLN(), direction="descent"), x0, tp.Euler(), t1=0.4, dt=0.1,
                  ledger=tp.LedgerOptions(diagnostics=False))
    x = x0
    for _ in range(4):
        a = tp.evaluate(x, heads, sign=-1.0, diagnostics=False).ambient
        y = x + 0.05 * a
        x = y / y.norm(dim=-1, keepdim=True)
    assert tr.stats["layer_norm"] == "half-post"
    assert_close(tr.x[-1], x, **ulps(dtype, 64))


# ---------------------------------------------------------------------------- the keyword front ends
def test_the_front_ends_name_the_keyword_the_user_typed():
    x0, heads = problem(F64, seed=17)
    kw = dict(t1=0.5, dt=0.1)
    cases = [
        (dict(record_every=20), ValueError, r"^record_every = 20 is larger than the number of steps"),
        (dict(record_every=0), ValueError, r"^record_every must be"),
        (dict(checkpoint_every=1.5), TypeError, r"^checkpoint_every must be an int"),
        (dict(chunk_elements=0), ValueError, r"^chunk_elements must be"),
        (dict(direction="up"), ValueError, r"^unknown direction 'up'"),
        (dict(quadratic_variation="both"), ValueError, r"^unknown quadratic_variation 'both'"),
        (dict(method="adaptive", rtol=-1.0), ValueError, r"^rtol must be"),
        (dict(temperature=0.5, layer_norm="post"), ValueError, r"layer_norm='post' with token noise"),
    ]
    for extra, err, msg in cases:
        with pytest.raises(err, match=msg) as info:
            tp.simulate(x0, heads, **kw, **extra)
        assert "SaveAt" not in str(info.value) and "Model." not in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"^record_every = 20 is larger"):
        tp.ensembles.simulate(x0.expand(2, *x0.shape), heads, **kw, record_every=20, direction="descent")
    with pytest.raises(ValueError, match=r"^record_every = 20 is larger"):
        tp.distributed.simulate_sharded(x0, heads, **kw, record_every=20, direction="descent")
    # the composable API names the objects' fields
    with pytest.raises(ValueError, match=r"^SaveAt.record_every = 20 is larger"):
        tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), **kw, saveat=tp.SaveAt(record_every=20))


# ---------------------------------------------------------------------------- a solver from the public parts
from transformer_pde.processes.driver import WeightDriver  # noqa: E402
from transformer_pde.solvers.particle.evaluator import Evaluator  # noqa: E402
from transformer_pde.solvers.parts import Ledger, Recorder, Stepper, partial_density, progress_bar  # noqa: E402


@dataclass(frozen=True)
class PartsEuler(tp.Solver):
    """Projected Euler with the left-point ledger, composed of the public parts (docs/solve.md):
    deterministic weights, no token noise, the projected flow."""

    accepts: ClassVar[frozenset] = frozenset({"saveat", "ledger", "progress"})
    unsupported: ClassVar[dict] = {"saveat": ("observables", "path"),
                                   "ledger": ("quadrature", "quadratic_variation", "energy_log_scale"),
                                   "progress": ("callback",)}

    def run(self, model, x0, options):
        o, K = options, options.steps
        if model.process.noisy or model.noise is not None or not model.layer_norm.projected:
            raise ValueError("PartsEuler takes deterministic weights, no token noise and the projected flow")
        drv = WeightDriver(model.process, paths=None, generator=o.generator, seed=o.weight_seed, t0=o.t0, dt=o.dt)
        ev = Evaluator(model.weights, normalization=model.normalization, sign=model.sign, noisy=False,
                       causal=model.causal, chunk_elements=None, energy_log_scale=None)
        stepper = Stepper(tp.TABLEAUX["euler"], geometry=model.layer_norm)
        rec = Recorder(K, o.saveat.stride(K), diagnostics=True, weights=model.weights)

        def densities(x, e):
            return {"partial": partial_density(x, drv.current, model.weights, e.stats, drv.rate, drv.sigma,
                                               ito=False),
                    "dissipation": e.dissipation, "slope": e.slope}

        x, e = x0, ev(x0, drv.current, True)
        ledger = Ledger(e.energy, sign=model.sign, quadrature="left")
        rec.record(x, e.energy, e.slope, e.dissipation, ledger.terms(e.energy))
        with progress_bar(bool(o.progress.show), K, "parts-euler") as bar:
            for k in range(1, K + 1):
                dens = densities(x, e)
                x, _ = stepper.step(x, e.velocity, o.dt, None)
                drv.advance()
                e = ev(x, drv.current, True)
                ledger.integrate(dens, None, o.dt)
                if rec.keeps(k):
                    rec.record(x, e.energy, e.slope, e.dissipation, ledger.terms(e.energy))
                bar.update(1)
        times, xs, series, led, _ = rec.stacked(o.t0, o.dt)
        return tp.Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], led,
                             {"steps": K}, "parts-euler", model.normalization.name, model.direction,
                             model.weights)


def test_a_solver_composed_of_the_public_parts_is_euler(dtype):
    """The docs' parts-built solver gives tp.Euler()'s tokens, energy and ledger (closed-form
    time-dependent weights: the ledger's ∂_tE term is exercised)."""
    x0, heads = problem(dtype, seed=23)
    model = tp.Model(tp.Oscillating(heads), direction="descent")
    kw = dict(t1=0.4, dt=0.05, saveat=tp.SaveAt(record_every=2), ledger=tp.LedgerOptions(ledger=True))
    mine = tp.solve(model, x0, PartsEuler(), **kw)
    ref = tp.solve(model, x0, tp.Euler(), **kw)
    assert_close(mine.times, ref.times, rtol=1e-15, atol=1e-15)
    assert_close(mine.x, ref.x, **ulps(dtype, 64))
    assert_close(mine.energy, ref.energy, **ulps(dtype, 64))
    for key in ("partial", "dissipation", "residual"):
        assert_close(mine.ledger[key], ref.ledger[key], **ulps(dtype, 256))
    with pytest.raises(ValueError, match="deterministic weights"):
        tp.solve(tp.Model(tp.OrnsteinUhlenbeck(heads, sigma=0.1), direction="descent"), x0, PartsEuler(), t1=0.1, dt=0.05, ledger=tp.LedgerOptions(ledger=True))


# ------------------------------------------------------------------ the step's state: the velocity on demand
from transformer_pde.solvers.loop import ParticleState  # noqa: E402


def test_particle_state_computes_a_handed_velocity_once_and_only_when_read():
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    calls = []

    def velocity():
        calls.append(1)
        return 2 * x

    state = ParticleState(x, velocity, None, None)
    assert calls == []
    eps = torch.finfo(x.dtype).eps
    assert_close(state.velocity, 2 * x, rtol=eps, atol=eps)
    assert state.velocity is state.velocity  # computed once, then kept
    assert calls == [1]
    given = ParticleState(x, 3 * x, None, None)  # a tensor is kept as it is
    assert given.velocity is given.velocity


def test_a_layer_map_step_never_projects_the_field(monkeypatch):
    """The post-LN map reads the un-projected update only: the run hands the velocity over on demand, so
    the projection P_x A is not formed at every step (it was, for every step of every layer map)."""
    from transformer_pde.dynamics import layernorm
    g = gen(3)
    x0 = torch.nn.functional.normalize(torch.randn(4, 6, 5, generator=g, dtype=torch.float64), dim=-1)
    heads = tp.Heads(torch.randn(2, 5, 5, generator=g, dtype=torch.float64) / 3, beta=1.0)
    reads = []
    original = layernorm._AmbientEval.velocity

    def counted(self):
        reads.append(1)
        return original.fget(self)

    monkeypatch.setattr(layernorm._AmbientEval, "velocity", property(counted, original.fset))
    traj = tp.simulate(x0, heads, t1=1.0, dt=0.1, layer_norm="post", diagnostics=False, progress=False)
    assert reads == []
    assert torch.isfinite(traj.final).all()


# ---------------------------------------------------------------------------- recycled memory
def test_a_recycler_hands_memory_back_only_when_nothing_holds_it():
    from transformer_pde.utils.recycle import Recycler
    like = torch.zeros((), dtype=torch.float64)
    ring = Recycler(2)
    a = ring.take((3, 4), like)
    b = ring.take((3, 4), like)                     # a is held here: new memory
    assert a.data_ptr() != b.data_ptr()
    view = a[1:]                                    # a view holds a's memory too
    pa = a.data_ptr()
    del a
    c = ring.take((3, 4), like)
    assert c.data_ptr() not in (pa, b.data_ptr())   # a's view and b still hold theirs
    del view, c
    d = ring.take((3, 4), like)                     # the ring keeps the newest two (b, c): c is free
    assert d.data_ptr() != b.data_ptr() and d.shape == (3, 4)
    del b
    e = ring.take((3, 4), like)
    assert e.data_ptr() != d.data_ptr()
    pe = e.data_ptr()
    detached = e.detach()                           # another tensor on e's memory, no reference to e itself
    del e
    f = ring.take((3, 4), like)
    assert f.data_ptr() not in (pe, d.data_ptr())
    pf = f.data_ptr()
    del detached, f
    assert ring.take((3, 4), like).data_ptr() == pf   # the ring now keeps d (held) and f (free)
    assert ring.take((2, 4), like).shape == (2, 4)  # another shape: new memory
    assert ring.take((3, 4), torch.zeros((), dtype=torch.float32)).dtype == torch.float32
    with pytest.raises(ValueError, match="keep"):
        Recycler(0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_post_ln_run_recycles_the_states_it_let_go_and_never_one_that_is_held(dtype):
    """The post-LN run writes each new state into the memory of one it has let go of (two buffers in turn,
    not fresh memory per step), and never into memory a caller still holds: the states a callback keeps
    (no copy) are those of a run that keeps nothing, and of a hand loop of x ← normalize(x + Δt·A(x))."""
    g = gen(21)
    x0 = torch.nn.functional.normalize(torch.randn(3, 5, 4, generator=g, dtype=dtype), dim=-1)
    heads = tp.Heads(torch.randn(2, 4, 4, generator=g, dtype=dtype) / 2, torch.randn(2, 4, 4, generator=g, dtype=dtype) / 2)
    kw = dict(t1=1.0, dt=0.1, layer_norm="post", diagnostics=False, progress=False, record_every=10)
    seen = []
    tp.simulate(x0, heads, callback=lambda k, t, x: seen.append(x.data_ptr()), **kw)
    assert len(seen) == 10 and len(set(seen)) == 2           # two memories in turn, not one per step
    kept = []
    held = tp.simulate(x0, heads, callback=lambda k, t, x: kept.append(x), **kw)
    assert len({x.data_ptr() for x in kept}) == 10           # held states are never written over
    x = x0
    tol = dict(rtol=64 * torch.finfo(dtype).eps, atol=64 * torch.finfo(dtype).eps)
    for k in range(10):
        y = x + 0.1 * tp.evaluate(x, heads, diagnostics=False).ambient
        x = y / y.norm(dim=-1, keepdim=True)
        assert_close(kept[k], x, **tol)
    assert_close(held.final, x, **tol)


def test_the_fused_update_writes_a_result_only_into_memory_no_one_holds():
    from transformer_pde.dynamics.layernorm import FusedUpdate
    g = gen(22)
    x = torch.nn.functional.normalize(torch.randn(4, 6, 5, generator=g, dtype=torch.float64), dim=-1)
    heads = tp.Heads(torch.randn(4, 2, 5, 5, generator=g, dtype=torch.float64) / 3)
    fused = FusedUpdate(None, 1.0)
    first = fused(x, heads).ambient
    want = first.clone()
    second = fused(-x, heads).ambient                     # first is held: other memory
    third = fused(x.flip(-2), heads).ambient
    assert len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3
    eps = torch.finfo(x.dtype).eps
    assert_close(first, want, rtol=8 * eps, atol=8 * eps)    # untouched: another call's result differs by O(1)
    assert float((second - want).abs().max()) > 1e-3
    ptr = second.data_ptr()
    del second
    assert fused(x, heads).ambient.data_ptr() == ptr      # let go: its memory comes back
    assert_close(fused(x, heads).ambient, want, rtol=8 * eps, atol=8 * eps)


def test_a_post_ln_run_with_autograd_takes_no_recycled_memory_and_differentiates_like_a_hand_loop():
    """With gradients tracked the step writes new memory (a recycled buffer would be written over while
    autograd still needs it): the gradient of a loss of the final tokens is the hand loop's."""
    g = gen(23)
    x0 = torch.nn.functional.normalize(torch.randn(2, 5, 4, generator=g, dtype=F64), dim=-1)
    heads = tp.Heads(torch.randn(2, 4, 4, generator=g, dtype=F64) / 2, torch.randn(2, 4, 4, generator=g, dtype=F64) / 2)
    probe = torch.randn(2, 5, 4, generator=g, dtype=F64)
    from transformer_pde.utils import recycle
    taken = []
    real_take = recycle.Recycler.take
    xa = x0.clone().requires_grad_()
    try:
        recycle.Recycler.take = lambda self, *a, **k: taken.append(1) or real_take(self, *a, **k)
        tr = tp.simulate(xa, heads, t1=0.5, dt=0.1, layer_norm="post", diagnostics=False, progress=False)
    finally:
        recycle.Recycler.take = real_take
    assert taken == []  # no memory is asked for under autograd
    (ga,) = torch.autograd.grad((tr.final * probe).sum(), xa)
    xb = x0.clone().requires_grad_()
    x = xb
    for _ in range(5):
        y = x + 0.1 * tp.evaluate(x, heads, diagnostics=False).ambient
        x = y / y.norm(dim=-1, keepdim=True)
    (gb,) = torch.autograd.grad((x * probe).sum(), xb)
    assert_close(ga, gb, **ulps(F64, 256))
    assert float(gb.abs().max()) > 1e-3


def test_the_post_ln_step_given_memory_under_autograd_makes_new_memory():
    """``PostLN.step(..., out=)`` called with tracked tensors ignores ``out`` (autograd cannot record a write
    into it): the same value, a gradient, and ``out`` untouched."""
    g = gen(24)
    x = torch.nn.functional.normalize(torch.randn(3, 4, generator=g, dtype=F64), dim=-1).requires_grad_()
    a = torch.randn(3, 4, generator=g, dtype=F64)
    out = torch.zeros(3, 4, dtype=F64)
    y, _, _ = tp.PostLN().step(x, None, a, 0.1, out=out)
    want = (x + 0.1 * a) / (x + 0.1 * a).norm(dim=-1, keepdim=True)
    assert_close(y, want, **ulps(F64, 8))
    assert y.requires_grad and float(out.abs().max()) == 0.0
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(gx).all()
    with torch.no_grad():
        z, _, _ = tp.PostLN().step(x, None, a, 0.1, out=out)
    assert z.data_ptr() == out.data_ptr()
    assert_close(out, want.detach(), **ulps(F64, 8))
