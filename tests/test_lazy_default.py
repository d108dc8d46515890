"""The default solve is the tokens-only solve: E, 𝒢², 𝒟 at the recorded times are computed from the
records on their first read, and the energy ledger is an explicit option (``ledger=True``).

Checked: a default ``tp.simulate`` evaluates no diagnostics during the solve (the evaluator's
``diagnostics=True`` calls are counted; a ``ledger=True`` run makes them, so the counter can fail);
its energy, slope, dissipation equal those of the eager ``ledger=True`` run for every model option
that changes them; the refusals of ledger options without the ledger; the checkpoints of a lazy run
(kill and resume, and a checkpoint of the eager run that earlier versions made by default)."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import DiagnosticsCounter, interrupt_and_resume

SERIES = ("energy", "slope", "dissipation")
T1, DT = 0.6, 0.05
K = round(T1 / DT)


def problem(dtype):
    x0 = tp.sphere.sample_uniform(6, 3, batch_shape=(2,), generator=gen(0), dtype=dtype)
    heads = tp.Heads.random(2, 3, generator=gen(1), dtype=dtype)
    return x0, heads


def close_to_eager(lazy, eager, dtype, steps=K):
    """The lazy and eager runs step through other code (a layer map's tokens-only step is the fused pass; the
    diagnostics are evaluated in another batch layout): their values differ by rounding, a few ulps of the
    largest value per step, adding like a random walk over the steps: 16 · eps · sqrt(K + 1) · max|value|."""
    eps = torch.finfo(dtype).eps
    for key in SERIES:
        a, b = getattr(lazy, key), getattr(eager, key)
        tol = 16 * eps * math.sqrt(steps + 1) * max(float(b.abs().max()), 1e-30)
        assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, key=key: f"{key}: {m}")
    tol = 16 * torch.finfo(dtype).eps * math.sqrt(steps + 1)
    assert_close(lazy.x, eager.x, rtol=tol, atol=tol)


def _ou(h):
    return tp.OrnsteinUhlenbeck(h, sigma=0.7)


def _osc(h):
    return tp.Oscillating(h)


CASES = {
    "constant heads": (None, {}),
    "OU with paths": (_ou, dict(paths=3, seed=2)),
    "post-LN ascent": (None, dict(layer_norm="post", direction="ascent")),
    "pre-LN (radii)": (None, dict(layer_norm="pre")),
    "causal": (None, dict(causal=True)),
    "token noise": (None, dict(temperature=0.1, seed=1)),
    "record_every=3, heun": (_osc, dict(record_every=3, method="heun")),
    "dopri5, OU paths": (_ou, dict(method="adaptive", paths=2, seed=1)),
    "given energy scale, effective": (None, dict(energy_log_scale=1.5, normalization="effective")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_default_run_evaluates_no_diagnostics_and_equals_the_ledger_run(case, dtype, monkeypatch):
    build, kw = CASES[case]
    x0, heads = problem(dtype)
    theta = heads if build is None else build(heads)
    count = DiagnosticsCounter(monkeypatch)
    lazy = tp.simulate(x0, theta, t1=T1, dt=DT, **kw)
    assert count.diagnostic_calls == 0, "the default solve evaluated diagnostics during the solve"
    assert lazy.lazy and not lazy.has_ledger
    eager = tp.simulate(x0, theta, t1=T1, dt=DT, ledger=True, **kw)
    assert count.diagnostic_calls >= K, "the counter does not see the eager solve's diagnostics"
    assert eager.has_ledger and not eager.lazy
    close_to_eager(lazy, eager, dtype)
    assert lazy.stats["energy_log_scale"] == eager.stats["energy_log_scale"]


def test_solve_default_is_lazy_and_ledger_options_keep_the_ledger(dtype, monkeypatch):
    x0, heads = problem(dtype)
    model = tp.Model(_ou(heads))
    count = DiagnosticsCounter(monkeypatch)
    lazy = tp.solve(model, x0, tp.Heun(), t1=T1, dt=DT, paths=2, seed=3)
    assert count.diagnostic_calls == 0
    eager = tp.solve(model, x0, tp.Heun(), t1=T1, dt=DT, paths=2, seed=3, ledger=tp.LedgerOptions(ledger=True))
    assert count.diagnostic_calls > 0 and set(eager.ledger) >= {"dE", "residual"}
    close_to_eager(lazy, eager, dtype)
    with pytest.raises(ValueError, match=r"LedgerOptions\(ledger=True\)"):
        lazy.ledger


@pytest.mark.parametrize("kw,names", [
    (dict(ledger=True, diagnostics=False), ("ledger=True needs diagnostics=True",)),
    (dict(quadrature="trapezoid"), ("quadrature='trapezoid'", "ledger=True")),
    (dict(quadratic_variation="realised"), ("quadratic_variation='realised'", "ledger=True")),
])
def test_ledger_options_without_the_ledger_are_refused_before_any_work(kw, names, monkeypatch):
    x0, heads = problem(torch.float64)

    def refuse(*a, **k):
        raise AssertionError("the run started")
    monkeypatch.setattr(tp.processes.driver.WeightDriver, "__init__", refuse)
    with pytest.raises(ValueError) as err:  # simulate's message names its keywords
        tp.simulate(x0, _ou(heads), t1=T1, dt=DT, **kw)
    for name in names:
        assert name in str(err.value)
    assert "LedgerOptions" not in str(err.value)
    with pytest.raises(ValueError, match="LedgerOptions.ledger"):  # the object's message names its fields
        tp.LedgerOptions(**kw)
    tp.LedgerOptions(**{**kw, "ledger": True, "diagnostics": True})  # with the ledger: accepted


def test_lazy_checkpoint_resumes_to_the_uninterrupted_run(dtype, tmp_path):
    """A default (lazy) run with noisy weights killed mid-way and resumed from its checkpoint (which stores
    the heads of the records) gives the uninterrupted run's tokens and recorded E, 𝒢², 𝒟."""
    x0, heads = problem(dtype)
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, record_every=3)
    full = tp.simulate(x0, _ou(heads), **kw)
    ck = tmp_path / "lazy.pt"
    resumed = interrupt_and_resume(x0, _ou(heads), ck, stop_at=13, **kw)
    assert "heads" in torch.load(ck, weights_only=False)  # the recorded heads were checkpointed
    assert resumed.lazy and not resumed.has_ledger
    eps = torch.finfo(dtype).eps
    assert_close(resumed.times, full.times, rtol=1e-15, atol=1e-15)
    assert_close(resumed.x, full.x, rtol=4 * eps, atol=4 * eps)
    for key in SERIES:
        a, b = getattr(resumed, key), getattr(full, key)
        assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(b.abs().max()))


def test_checkpoint_of_the_eager_run_resumes_a_default_run_eagerly(tmp_path):
    """The checkpoint fingerprint does not cover ``ledger``: a checkpoint of an eager run (what earlier versions
    wrote by default) resumes a default run, which continues eagerly and returns the ledger; an eager run
    refuses a lazy checkpoint (it holds no ledger of the steps before)."""
    dtype = torch.float64
    x0, heads = problem(dtype)
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, record_every=3)
    eager_full = tp.simulate(x0, _ou(heads), ledger=True, **kw)
    ck = tmp_path / "eager.pt"

    def stop(k, t, x):
        if k == 13:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tp.simulate(x0, _ou(heads), ledger=True, checkpoint=ck, checkpoint_every=5, callback=stop, **kw)
    resumed = tp.simulate(x0, _ou(heads), checkpoint=ck, checkpoint_every=5, **kw)  # the default: no ledger asked
    assert resumed.has_ledger
    eps = torch.finfo(dtype).eps
    assert_close(resumed.ledger["residual"], eager_full.ledger["residual"], rtol=4 * eps,
                 atol=4 * eps * float(eager_full.ledger["dE"].abs().max()))
    assert_close(resumed.energy, eager_full.energy, rtol=4 * eps, atol=4 * eps)
    lazy_ck = tmp_path / "lazy.pt"
    with pytest.raises(KeyboardInterrupt):
        tp.simulate(x0, _ou(heads), checkpoint=lazy_ck, checkpoint_every=5, callback=stop, **kw)
    with pytest.raises(ValueError, match="without the energy ledger"):
        tp.simulate(x0, _ou(heads), ledger=True, checkpoint=lazy_ck, checkpoint_every=5, **kw)
