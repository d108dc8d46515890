"""The keyword front ends check their keywords in their own names before any work, the objects carry the same
names, no message is rewritten (an error of the run reaches the user as raised), and ``tp.solve`` refuses a
solver whose ``run`` returns no Trajectory."""

import dataclasses
import inspect

import pytest
import torch

import transformer_pde as tp
from transformer_pde.solvers.particle import methods as particle


def _problem(dtype=torch.float64):
    x0 = tp.sphere.octahedral(6, dtype=dtype)
    return x0, tp.Heads.scalar([1.0, 0.5], 3).to(dtype)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a solve starts (the refusals come before any work)."""
    def refuse(*a, **k):
        raise AssertionError("the solve started")
    monkeypatch.setattr(tp.processes.driver.WeightDriver, "__init__", refuse)


@pytest.mark.parametrize("kw, err, match", [
    (dict(record_every=2.5), TypeError, "^record_every"),
    (dict(record_every=50), ValueError, "^record_every = 50 is larger"),
    (dict(layer_norm="rms"), ValueError, "layer_norm"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(normalization="nope"), ValueError, "unknown normalization"),
    (dict(direction="up"), ValueError, "direction"),
    (dict(ledger=True, diagnostics=False), ValueError, "^ledger=True needs diagnostics=True"),
    (dict(quadrature="simpson"), ValueError, "quadrature"),
    (dict(quadrature="left"), ValueError, "^quadrature='left' .* pass ledger=True"),
    (dict(records="step", ledger=True), ValueError, "^records='step'"),
    (dict(energy_log_scale="big"), TypeError, "^energy_log_scale"),
    (dict(checkpoint_every=0), ValueError, "checkpoint_every"),
    (dict(progress="yes"), TypeError, "progress"),
    (dict(callback=3), TypeError, "^callback"),
    (dict(max_steps=1.5), TypeError, "^max_steps"),
    (dict(max_memory=-1.0), ValueError, "^max_memory"),
    (dict(chunk_elements=0), ValueError, "chunk_elements"),
    (dict(method="adaptive", rtol=-1.0), ValueError, "^rtol"),
    (dict(method="adaptive", temperature=0.1), ValueError, "temperature = 0.1 .*method='adaptive'"),
    (dict(method="adaptive", records="step"), ValueError, "^records='step'.*method='adaptive'"),
    (dict(observables=[1]), TypeError, "^observables"),
])
def test_simulate_names_the_keyword_the_user_typed(no_work, kw, err, match):
    x0, heads = _problem()
    with pytest.raises(err, match=match) as info:
        tp.simulate(x0, heads, t1=1.0, dt=0.1, **kw)
    for field in ("SaveAt.", "LedgerOptions.", "Model.", "Limits.", "Checkpointing.", "Progress.", "Dopri5."):
        assert field not in str(info.value)  # the keyword, not the object field it becomes


def test_the_objects_carry_the_keywords_names():
    """One word per concept: the fields of Model, SaveAt and LedgerOptions that a keyword fills carry its name."""
    sim = set(inspect.signature(tp.simulate).parameters)
    for cls in (tp.Model, tp.SaveAt, tp.LedgerOptions, tp.Limits):
        shared = {f.name for f in dataclasses.fields(cls) if f.init} & sim
        assert shared, cls
    assert {"layer_norm", "temperature"} <= {f.name for f in dataclasses.fields(tp.Model)}
    assert "record_every" in {f.name for f in dataclasses.fields(tp.SaveAt)}
    mfa = inspect.signature(tp.nn.MeanFieldAttention).parameters
    assert {"method", "layer_norm", "rtol", "atol"} <= set(mfa) and not {"solver", "geometry"} & set(mfa)
    # one default tolerance of the adaptive solver
    assert (tp.Dopri5().rtol, tp.Dopri5().atol) == (mfa["rtol"].default, mfa["atol"].default)
    for old in ("keyword_names",):
        assert not hasattr(tp.solvers.options, old)
    assert not hasattr(particle, "SIMULATE_KEYWORDS") and not hasattr(tp.solvers.particle.sharded, "SHARDED_KEYWORDS")


def test_simulate_sharded_and_jko_name_their_keywords(no_work):
    x0, heads = _problem()
    with pytest.raises(ValueError, match="^record_every = 50 is larger"):
        tp.distributed.simulate_sharded(x0, heads, t1=1.0, dt=0.1, record_every=50)
    with pytest.raises(ValueError, match="^ledger=True needs diagnostics=True"):
        tp.distributed.simulate_sharded(x0, heads, t1=1.0, dt=0.1, ledger=True, diagnostics=False)
    with pytest.raises(TypeError, match="^gather_x"):
        tp.distributed.simulate_sharded(x0, heads, t1=1.0, dt=0.1, gather_x="all")
    with pytest.raises(TypeError, match="unexpected keyword argument 'geometry'"):  # Python checks the signature
        tp.simulate(x0, heads, t1=1.0, dt=0.1, geometry="post")
    with pytest.raises(TypeError, match="unexpected keyword argument 'noise'"):
        tp.jko(x0, heads, tau=0.1, steps=2, noise=0.1)


def test_an_error_of_the_run_is_not_rewritten(monkeypatch):
    """A ValueError raised during the solve reaches the user as raised, object field names and all."""
    x0, heads = _problem()
    message = "SaveAt.record_every and Model.layer_norm as the run wrote them"

    def fail(*a, **k):
        raise ValueError(message)
    monkeypatch.setattr(tp.FixedStep, "step", fail)  # raised by the first step of the run
    with pytest.raises(ValueError) as info:
        tp.simulate(x0, heads, t1=0.2, dt=0.1, record_every=1, layer_norm="none")
    assert str(info.value) == message


@pytest.mark.parametrize("beta", [1.0, tp.LogScaling(0.5)])
def test_model_keeps_a_token_noise_seed_through_the_solve(beta):
    """A TokenNoise with a seed of its own: the tokens' stream is its own whatever the run's seed, also when the
    solve rebuilds the model to resolve a β rule of the context length."""
    x0 = tp.sphere.octahedral(6, dtype=torch.float64)
    heads = tp.Heads.scalar([1.0, 0.5], 3, beta=beta).to(torch.float64)
    model = tp.Model(heads, temperature=tp.TokenNoise(0.2, seed=7))
    assert model.temperature == 0.2 and model.noise.seed == 7
    assert tp.Model(heads, temperature=0.0).noise is None
    a = tp.solve(model, x0, tp.Euler(), t1=0.2, dt=0.1, seed=1)
    b = tp.solve(model, x0, tp.Euler(), t1=0.2, dt=0.1, seed=2)
    tol = 1e1 * torch.finfo(torch.float64).eps  # the same stream: equal to rounding
    torch.testing.assert_close(a.x, b.x, rtol=tol, atol=tol)
    c = tp.solve(tp.Model(heads, temperature=0.2), x0, tp.Euler(), t1=0.2, dt=0.1, seed=1)  # the run's stream
    assert (a.x[-1] - c.x[-1]).abs().max() > 1e-3


class _ReturnsNothing(tp.Solver):
    def run(self, model, x0, options):
        return None


class _ReturnsTensor(tp.Solver):
    def run(self, model, x0, options):
        return x0


@pytest.mark.parametrize("solver, got", [(_ReturnsNothing(), "NoneType"), (_ReturnsTensor(), "Tensor")])
def test_solve_refuses_a_run_that_returns_no_trajectory(solver, got):
    x0, heads = _problem()
    name = type(solver).__name__
    with pytest.raises(TypeError, match=f"^{name}.run returned {got}, not a Trajectory"):
        tp.solve(tp.Model(heads), x0, solver, t1=0.2, dt=0.1)
