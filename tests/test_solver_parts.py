"""The solver parts (transformer_pde/solvers/parts.py) on their own: closed forms and invariants."""

import math

import pytest
import torch

from transformer_pde.solvers.parts import (Checkpointer, Ledger, Recorder, Stepper, ledger_from_series, ledger_terms,
                                           progress_bar)
from transformer_pde.solvers.particle import TABLEAUX


@pytest.mark.parametrize("method", ["euler", "heun", "rk4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flat_stepper_local_error_order(method, dtype):
    """ẋ = λx: one step's error against e^{λ dt} scales like dt^{p+1} (fitted slope)."""
    lam = -0.7
    x = torch.ones(1, 1, 1, dtype=torch.float64)
    step = Stepper(TABLEAUX[method], retract=False)
    dts = [0.2, 0.1, 0.05]
    errs = []
    for dt in dts:
        y, err = step.step(x, lam * x, dt, lambda xs, c: lam * xs)
        assert err == 0.0
        errs.append(abs(float(y) - math.exp(lam * dt)))
    slope = math.log(errs[0] / errs[-1]) / math.log(dts[0] / dts[-1])
    assert abs(slope - (TABLEAUX[method].order + 1)) < 0.3
    y32, _ = step.step(x.to(dtype), lam * x.to(dtype), 0.1, lambda xs, c: lam * xs)
    assert y32.dtype == dtype


def test_sphere_stepper_retracts_and_reports_the_defect():
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(4, 5, 3, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    y, err = Stepper(TABLEAUX["euler"]).step(x, v, 0.1, None)
    torch.testing.assert_close(y.norm(dim=-1), torch.ones(4, 5, dtype=torch.float64))
    want = float(((x + 0.1 * v).norm(dim=-1) - 1).abs().max())
    assert err == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(y, torch.nn.functional.normalize(x + 0.1 * v, dim=-1))


def test_stepper_stages_see_their_stage_times():
    seen = []
    Stepper(TABLEAUX["rk4"], retract=False).step(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), 0.1,
                                                 lambda xs, c: (seen.append(c), torch.zeros_like(xs))[1])
    assert seen == list(TABLEAUX["rk4"].c[1:])


@pytest.mark.parametrize("quadrature", ["left", "trapezoid"])
def test_ledger_quadrature_of_a_linear_density(quadrature):
    """∂_sE = s on [0, 1]: trapezoid is exact (1/2), the left rule gives Σ k dt · dt = (K−1)/(2K)."""
    K, dt = 10, 0.1
    led = Ledger(torch.tensor(0.0, dtype=torch.float64), sign=-1.0, quadrature=quadrature)
    for k in range(K):
        d0 = {key: torch.tensor(k * dt, dtype=torch.float64) for key in ("partial", "dissipation", "slope")}
        d1 = {key: torch.tensor((k + 1) * dt, dtype=torch.float64) for key in ("partial", "dissipation", "slope")}
        led.integrate(d0, d1, dt)
    want = 0.5 if quadrature == "trapezoid" else (K - 1) / (2 * K)
    for key in ("partial", "dissipation", "slope"):
        assert float(led.acc[key]) == pytest.approx(want, rel=1e-12)


def test_ledger_terms_close_and_causal_has_no_residual():
    E0, E1 = torch.tensor(2.0), torch.tensor(1.25)
    led = Ledger(E0, sign=-1.0)
    led.add("partial", torch.tensor(0.25))
    led.add("dissipation", torch.tensor(-1.0))
    led.add("slope", torch.tensor(1.0))
    t = led.terms(E1)
    assert float(t["dE"]) == -0.75 and float(t["residual"]) == 0.0 and float(t["residual_slope"]) == 0.0
    causal = ledger_terms(t["dE"], t["partial"], t["dissipation"], t["slope"], t["martingale"], sign=-1.0, causal=True)
    assert set(causal) == {"dE", "partial", "dissipation", "slope", "martingale"}


def test_ledger_from_series_trapezoid_and_ito_sums():
    times = torch.linspace(0, 1, 5, dtype=torch.float64)
    E = 1 + times ** 2
    P = 2 * times  # ∂_tE exactly: trapezoid of a linear density is exact
    M = [torch.tensor(0.1, dtype=torch.float64)] * 4
    led = ledger_from_series(E, P, -P, P, M, [], times, sign=-1.0)
    torch.testing.assert_close(led["partial"], E - E[0])
    torch.testing.assert_close(led["martingale"], torch.arange(5, dtype=torch.float64) * 0.1)
    torch.testing.assert_close(led["dissipation"], -(E - E[0]))
    torch.testing.assert_close(led["residual"], (E - E[0]) - led["martingale"])  # dE − dE − (−dE) − M


def test_recorder_keeps_every_kth_and_the_last():
    rec = Recorder(7, 3, diagnostics=False, observables={"m": lambda x, w: x.mean(-2)})
    assert rec.steps == [0, 3, 6, 7]
    for k in range(8):
        if rec.keeps(k):
            rec.record(torch.full((2, 3), float(k)))
    times, x, series, ledger, obs = rec.stacked(1.0, 0.5)
    torch.testing.assert_close(times, torch.tensor([1.0, 2.5, 4.0, 4.5], dtype=torch.float64))
    assert x.shape == (4, 2, 3) and series["energy"] is None and ledger == {}
    torch.testing.assert_close(obs["m"][:, 0], torch.tensor([0.0, 3.0, 6.0, 7.0]))


def test_recorder_refuses_a_bad_observable():
    rec = Recorder(1, 1, diagnostics=False, observables={"bad": lambda x, w: 1.0})
    with pytest.raises(TypeError, match="observables\\['bad'\\] returned float"):
        rec.record(torch.zeros(2, 3))


def test_checkpointer_saves_on_multiples_resumes_and_refuses_other_runs(tmp_path):
    path = tmp_path / "ck.pt"
    ck = Checkpointer(path, 2, 6, lambda: ("run", 1))
    assert ck.load("cpu") is None
    ck.after_step(1, lambda: {"x": 1})
    assert not path.exists()
    ck.after_step(4, lambda: {"x": torch.ones(2)})
    ck.after_step(6, lambda: pytest.fail("the last step is not checkpointed"))
    got = ck.load("cpu")
    assert got["k"] == 4 and torch.equal(got["x"], torch.ones(2))
    with pytest.raises(ValueError, match="belongs to a different run"):
        Checkpointer(path, 2, 6, lambda: ("run", 2)).load("cpu")
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupted or unreadable"):
        ck.load("cpu")
    assert Checkpointer(None, 2, 6, lambda: pytest.fail("no fingerprint without a path")).load("cpu") is None


def test_progress_bar_off_is_a_no_op():
    with progress_bar(False, 10, "x") as bar:
        bar.update(1)
