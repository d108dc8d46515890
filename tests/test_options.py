"""transformer_pde.solvers.options: each options object validates itself when built and does what it
says in a solve (record times, observables, the stored path, the ledger, checkpoints, progress, limits)."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from problems import tokens_and_heads

EPS = torch.finfo(torch.float64).eps  # the problems are float64 unit vectors (scale 1)


@pytest.fixture
def problem():
    return tokens_and_heads(n=5)


@pytest.mark.parametrize("make,err,msg", [
    (lambda: tp.SaveAt(record_every=1.5), TypeError, "SaveAt.record_every"),
    (lambda: tp.SaveAt(record_every=0), ValueError, "SaveAt.record_every"),
    (lambda: tp.SaveAt(record_every=2, ends=True), ValueError, "ends=True"),
    (lambda: tp.SaveAt(ends="yes"), TypeError, "SaveAt.ends"),
    (lambda: tp.SaveAt(observables=[len]), TypeError, "SaveAt.observables"),
    (lambda: tp.LedgerOptions(ledger=True, quadrature="simpson"), ValueError, "simpson"),
    (lambda: tp.LedgerOptions(ledger=True, quadratic_variation="both"), ValueError, "both"),
    (lambda: tp.LedgerOptions(energy_log_scale=True), TypeError, "energy_log_scale"),
    (lambda: tp.LedgerOptions(energy_log_scale=math.inf), ValueError, "finite"),
    (lambda: tp.Checkpointing(3), TypeError, "Checkpointing.path"),
    (lambda: tp.Checkpointing("ck.pt", every=0), ValueError, "Checkpointing.every"),
    (lambda: tp.Progress(show="auto"), TypeError, "Progress.show"),
    (lambda: tp.Progress(callback=3), TypeError, "Progress.callback"),
    (lambda: tp.Limits(max_steps=-1), ValueError, "Limits.max_steps"),
    (lambda: tp.Limits(max_memory=0), ValueError, "Limits.max_memory"),
])
def test_options_refuse_bad_fields_when_built(make, err, msg):
    with pytest.raises(err, match=msg):
        make()


def test_saveat_chooses_the_record_times(problem):
    x0, heads = problem
    assert tp.SaveAt(record_every=3).stride(10) == 3 and tp.SaveAt(ends=True).stride(10) == 10
    traj = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=1.0, dt=0.1, saveat=tp.SaveAt(record_every=3), ledger=tp.LedgerOptions(ledger=True))
    assert traj.times.tolist() == pytest.approx([0.0, 0.3, 0.6, 0.9, 1.0])
    with pytest.raises(ValueError, match="SaveAt.record_every"):  # a stride longer than the run
        tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=1.0, dt=0.1, saveat=tp.SaveAt(record_every=11), ledger=tp.LedgerOptions(ledger=True))


def test_saveat_observables_and_the_stored_path_replay(problem):
    x0, heads = problem
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    save = tp.SaveAt(record_every=2, observables={"first": lambda x, w: x[..., 0, :]}, path=True)
    traj = tp.solve(tp.Model(theta, direction="descent"), x0, tp.Heun(), t1=0.4, dt=0.05, seed=9, saveat=save, ledger=tp.LedgerOptions(ledger=True))
    assert_close(traj.observables["first"], traj.x[:, 0], rtol=4 * EPS, atol=4 * EPS)  # x[..., 0, :] recorded
    again = tp.solve(tp.Model(traj.path, direction="descent"), x0, tp.Heun(), t1=0.4, dt=0.05, saveat=tp.SaveAt(record_every=2), ledger=tp.LedgerOptions(ledger=True))
    assert_close(again.x, traj.x, rtol=4 * EPS, atol=1e-14)


def test_ledger_options_are_the_ledger_of_the_solve(problem):
    x0, heads = problem
    quiet = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, ledger=tp.LedgerOptions(diagnostics=False))
    assert quiet.energy is None and quiet.ledger == {}
    left = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    trap = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05,
                    ledger=tp.LedgerOptions(ledger=True, quadrature="trapezoid"))
    # the same tokens, the same energy; the integral of 𝒟 by two rules: the trapezoid one from the same values
    assert_close(trap.x, left.x, rtol=4 * EPS, atol=4 * EPS)
    D, dt = left.dissipation, 0.05
    assert_close(left.ledger["dissipation"][-1], dt * D[:-1].sum(), rtol=1e-13, atol=0)
    assert_close(trap.ledger["dissipation"][-1], dt * (D[:-1] + D[1:]).sum() / 2, rtol=1e-13, atol=0)
    scaled = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, ledger=tp.LedgerOptions(energy_log_scale=2.0))
    assert scaled.energy_log_scale == 2.0
    assert_close(scaled.energy * math.exp(2.0), left.energy, rtol=1e-13, atol=0)
    assert_close(scaled.log_energy(), torch.log(left.energy), rtol=1e-13, atol=1e-13)


def test_checkpointing_resumes_and_refuses_another_run(problem, tmp_path):
    x0, heads = problem
    ck = tmp_path / "run.pt"
    opts = dict(t1=0.5, dt=0.05, checkpoint=tp.Checkpointing(ck, every=4))
    first = tp.solve(tp.Model(heads, direction="descent"), x0, tp.RK4(), **opts)
    assert ck.exists()  # the checkpoint of step 8 stays on disk
    resumed = tp.solve(tp.Model(heads, direction="descent"), x0, tp.RK4(), **opts)
    assert_close(resumed.x, first.x, rtol=4 * EPS, atol=1e-15)
    # resumed at step 8, not rerun: the count of the checkpoint plus the evaluation at the resumed point
    # (a rerun from t0 would count the first run's 1 + 4·10 again)
    assert first.stats["field_evaluations"] == 1 + 4 * 10
    assert resumed.stats["field_evaluations"] == first.stats["field_evaluations"] + 1
    with pytest.raises(ValueError, match="different run"):
        tp.solve(tp.Model(heads, direction="ascent"), x0, tp.RK4(), **opts)


def test_progress_callback_sees_every_step(problem):
    x0, heads = problem
    seen = []
    tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05,
             progress=tp.Progress(callback=lambda k, t, x: seen.append((k, round(t, 12), tuple(x.shape)))), ledger=tp.LedgerOptions(ledger=True))
    assert seen == [(k, round(0.05 * k, 12), (5, 3)) for k in range(1, 5)]
    tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, progress=False, ledger=tp.LedgerOptions(ledger=True))  # a bool is Progress(show=...)


def test_limits_refuse_before_work_and_chunking_keeps_the_numbers(problem):
    x0, heads = problem
    with pytest.raises(ValueError, match="max_steps"):
        tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=1.0, dt=0.01, limits=tp.Limits(max_steps=50), ledger=tp.LedgerOptions(ledger=True))
    with pytest.raises(ValueError, match="max_memory"):
        tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=1.0, dt=0.01, limits=tp.Limits(max_memory=10.0), ledger=tp.LedgerOptions(ledger=True))
    whole = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    chunked = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.2, dt=0.05, limits=tp.Limits(chunk_elements=8), ledger=tp.LedgerOptions(ledger=True))
    assert_close(chunked.x, whole.x, rtol=4 * EPS, atol=1e-13)
    assert_close(chunked.energy, whole.energy, rtol=1e-12, atol=0)
