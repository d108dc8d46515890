"""``LedgerOptions(records="step")``: E, 𝒢², 𝒟 at the recorded times from the recorded steps' own field
evaluations, during the solve.

Checked: the values equal those of the default lazy run (computed from the records after the solve) for every
model option that changes them; the evaluations with diagnostics are made at the record steps only (counted:
one per record, so the count fails both when the steps skip them and when every step makes them); the
refusals (with the ledger, without diagnostics, an unknown mode, the solvers without steps of their own); a
run killed mid-way resumes to the uninterrupted run, and a checkpoint of a lazy run is refused; a non-finite
recorded value stops the run with its time and step."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
import transformer_pde.solvers.particle.evaluator as evaluator_module
from conftest import gen
from problems import DiagnosticsCounter, Interrupted, assert_replayed, stop_at_step

SERIES = ("energy", "slope", "dissipation")
T1, DT = 0.6, 0.05
K = round(T1 / DT)
STEP = tp.LedgerOptions(records="step")


def problem(dtype, batched=False):
    x0 = tp.sphere.sample_uniform(6, 3, batch_shape=(2,), generator=gen(0), dtype=dtype)
    if batched:  # non-symmetric heads per system (the one-block kernel)
        A = torch.randn(2, 2, 3, 3, generator=gen(1), dtype=dtype)
        return x0, tp.Heads(A, torch.randn(2, 2, 3, 3, generator=gen(2), dtype=dtype))
    return x0, tp.Heads.random(2, 3, generator=gen(1), dtype=dtype)


CASES = {
    "constant heads, euler": dict(),
    "OU with paths, heun, every 3": dict(process="ou", solver=tp.Heun(), paths=3, every=3),
    "oscillating, rk4, every 4": dict(process="osc", solver=tp.RK4(), every=4),
    "post-LN, non-symmetric heads": dict(batched=True, model=dict(layer_norm="post", direction="ascent")),
    "pre-LN (radii), every 5": dict(model=dict(layer_norm="pre"), every=5),
    "causal": dict(batched=True, model=dict(causal=True)),
    "token noise": dict(model=dict(temperature=0.1), seed=1),
    "given energy scale": dict(ledger=dict(energy_log_scale=1.5)),
}


def solve_case(case, dtype, ledger):
    c = CASES[case]
    x0, heads = problem(dtype, c.get("batched", False))
    theta = {"ou": lambda h: tp.OrnsteinUhlenbeck(h, sigma=0.7), "osc": tp.Oscillating}.get(c.get("process"),
                                                                                            lambda h: h)(heads)
    model = tp.Model(theta, **c.get("model", {}))
    book = tp.LedgerOptions(**{**c.get("ledger", {}), **ledger})
    return tp.solve(model, x0, c.get("solver", tp.Euler()), t1=T1, dt=DT, paths=c.get("paths"),
                    seed=c.get("seed", 2), saveat=tp.SaveAt(record_every=c.get("every", 1)), ledger=book)


@pytest.mark.parametrize("case", list(CASES))
def test_the_record_steps_give_the_lazy_values_with_one_diagnostics_evaluation_per_record(case, dtype, monkeypatch):
    count = DiagnosticsCounter(monkeypatch)
    lazy = solve_case(case, dtype, {})
    lazy_calls = count.diagnostic_calls  # 0 during the solve
    for key in SERIES:
        getattr(lazy, key)  # the lazy values: one evaluation per chunk of records
    count.diagnostic_calls = 0
    step = solve_case(case, dtype, {"records": "step"})
    records = step.times.shape[0]
    # one evaluation with diagnostics per record (and one more at t0 when a scale c ≠ 0 is chosen there)
    assert count.diagnostic_calls in (records, records + 1), (count.diagnostic_calls, records)
    assert lazy_calls == 0
    assert count.second_moment_calls == 0  # only the ledger's Itô terms read it
    assert not step.has_ledger and not step.lazy
    # the steps evaluate the same field with or without diagnostics (other kernels, the same numbers to
    # rounding): a few ulps of the largest value per step, adding like a random walk over the steps
    eps = torch.finfo(dtype).eps
    for key in SERIES:
        a, b = getattr(step, key), getattr(lazy, key)
        assert a.shape == b.shape
        tol = 32 * eps * math.sqrt(K + 1) * max(float(b.abs().max()), 1e-30)
        assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, key=key: f"{key}: {m}")
    assert step.stats["energy_log_scale"] == lazy.stats["energy_log_scale"]
    with pytest.raises(ValueError, match=r"LedgerOptions\(ledger=True\)"):
        step.ledger


def test_only_the_ledger_of_token_noise_asks_the_kernel_for_the_second_moment(monkeypatch):
    """The Itô term T Σ_i Δ_{S,i}E of the ledger reads the kernel's second moment at every step; the same
    noisy run with its E, 𝒢², 𝒟 recorded by the steps reads none (checked for the records above)."""
    count = DiagnosticsCounter(monkeypatch)
    tr = solve_case("token noise", torch.float64, {"ledger": True})
    assert count.second_moment_calls == count.diagnostic_calls == K + 1
    assert bool((tr.ledger["partial"][-1] != 0).all())  # the Itô term was booked
    solve_case("constant heads, euler", torch.float64, {"ledger": True})  # no noise: no Itô term to read it
    assert count.second_moment_calls == K + 1 and count.diagnostic_calls == 2 * (K + 1)


def test_simulate_records_keyword_is_the_solve_option(monkeypatch):
    """tp.simulate(records="step") is tp.solve with LedgerOptions(records="step"): one diagnostics evaluation per
    record, the lazy values to rounding; its refusals name simulate's keywords, before any work."""
    x0, heads = problem(torch.float64)
    kw = dict(t1=T1, dt=DT, record_every=3, direction="descent")
    count = DiagnosticsCounter(monkeypatch)
    step = tp.simulate(x0, heads, records="step", **kw)
    assert count.diagnostic_calls == step.times.shape[0] and not step.lazy
    lazy = tp.simulate(x0, heads, **kw)
    assert lazy.lazy
    eps = torch.finfo(torch.float64).eps
    for key in SERIES:
        b = getattr(lazy, key)
        tol = 32 * eps * math.sqrt(K + 1) * float(b.abs().max())
        assert_close(getattr(step, key), b, rtol=tol, atol=tol)
    for bad, match in ((dict(ledger=True), r"records='step'.*ledger=True"),
                       (dict(method="adaptive"), r"records='step'.*method='adaptive' records on torchdiffeq")):
        count.diagnostic_calls = 0
        with pytest.raises((ValueError, TypeError), match=match):
            tp.simulate(x0, heads, records="step", **kw, **bad)
        assert count.diagnostic_calls == 0
    with pytest.raises(ValueError, match="records"):
        tp.simulate(x0, heads, records="every", **kw)


def test_a_chosen_scale_is_fixed_at_t0_as_the_lazy_run_fixes_it():
    """Scores large enough that the energy is reported at a common scale c ≠ 0: the same c, the same values."""
    dtype = torch.float64
    x0, heads = problem(dtype)
    model = tp.Model(heads.replace(beta=400.0))
    kw = dict(t1=0.2, dt=0.05, seed=0)
    lazy = tp.solve(model, x0, tp.Euler(), **kw)
    step = tp.solve(model, x0, tp.Euler(), ledger=STEP, **kw)
    assert step.stats["energy_log_scale"] == lazy.stats["energy_log_scale"] > 0
    for key in SERIES:
        a, b = getattr(step, key), getattr(lazy, key)
        assert_close(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max()))


@pytest.mark.parametrize("kw,match", [
    (dict(records="step", ledger=True), "every step already"),
    (dict(records="step", diagnostics=False), "diagnostics=False"),
    (dict(records="eager"), "records"),
])
def test_records_step_with_the_ledger_or_without_diagnostics_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        tp.LedgerOptions(**kw)


@pytest.mark.parametrize("solver", [tp.Dopri5(), tp.ShardedEuler(), tp.LagrangianJKO()])
def test_solvers_without_steps_of_their_own_refuse_records_step_before_any_work(solver):
    x0, heads = problem(torch.float64)
    with pytest.raises(TypeError, match="records"):
        tp.solve(tp.Model(heads), x0, solver, t1=0.1, dt=0.05, ledger=STEP)


def test_a_killed_run_resumes_to_the_uninterrupted_run_and_a_lazy_checkpoint_is_refused(tmp_path):
    dtype = torch.float64
    x0, heads = problem(dtype)
    model = tp.Model(tp.OrnsteinUhlenbeck(heads, sigma=0.7))
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, saveat=tp.SaveAt(record_every=3))
    full = tp.solve(model, x0, tp.Euler(), ledger=STEP, **kw)
    ck = tmp_path / "step.pt"
    with pytest.raises(Interrupted):
        tp.solve(model, x0, tp.Euler(), ledger=STEP, checkpoint=tp.Checkpointing(ck, every=5),
                 progress=tp.Progress(callback=stop_at_step(13)), **kw)
    resumed = tp.solve(model, x0, tp.Euler(), ledger=STEP, checkpoint=tp.Checkpointing(ck, every=5), **kw)
    for key in ("times", "x") + SERIES:
        assert_replayed(getattr(resumed, key), getattr(full, key), key)
    lazy_ck = tmp_path / "lazy.pt"
    with pytest.raises(Interrupted):
        tp.solve(model, x0, tp.Euler(), checkpoint=tp.Checkpointing(lazy_ck, every=5),
                 progress=tp.Progress(callback=stop_at_step(13)), **kw)
    with pytest.raises(ValueError, match="different run .*records"):  # the fingerprint holds the mode
        tp.solve(model, x0, tp.Euler(), ledger=STEP, checkpoint=tp.Checkpointing(lazy_ck, every=5), **kw)


@pytest.mark.parametrize("field,name", [("energy", "the energy"), ("dissipation", "the dissipation 𝒟"),
                                        ("slope", "the metric slope 𝒢²")])
def test_a_non_finite_recorded_value_names_its_time_and_step(monkeypatch, field, name):
    """One quantity at the record of step 6 made NaN: the run stops there, naming the quantity, t and k."""
    dtype = torch.float64
    x0, heads = problem(dtype)
    real = evaluator_module.Evaluator.__call__
    calls = {"n": 0}

    def poisoned(self, xk, h, diag):
        e = real(self, xk, h, diag)
        if diag:
            calls["n"] += 1
            if calls["n"] == 4:  # t0, steps 2, 4, then the record of step 6
                setattr(e, field, torch.full_like(getattr(e, field), float("nan")))
        return e
    monkeypatch.setattr(evaluator_module.Evaluator, "__call__", poisoned)
    with pytest.raises(tp.NonFiniteError) as err:
        tp.solve(tp.Model(heads), x0, tp.Euler(), t1=T1, dt=DT, saveat=tp.SaveAt(record_every=2), ledger=STEP)
    msg = str(err.value)
    assert f"{name} at the recorded time" in msg and "step 6" in msg and "0.3" in msg
