"""The solver parts (transformer_pde/solvers/parts.py) on their own: closed forms and invariants."""

import math

import pytest
import torch

from transformer_pde.solvers.parts import (Checkpointer, Ledger, Recorder, Stepper, ledger_from_series, ledger_terms,
                                           progress_bar)
from transformer_pde.solvers.tableaux import TABLEAUX


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


# ==================================================================================================
# Observables of a batch, the checkpoint fingerprint of a process, the stepper's sphere error.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
from torch.testing import assert_close  # noqa: E402

import transformer_pde as tp  # noqa: E402
from conftest import gen  # noqa: E402
from transformer_pde.solvers.parts import observe, process_signature  # noqa: E402

F64 = torch.float64


def test_observables_of_a_batch_may_return_a_vector_per_member():
    """observe accepts (*batch,) and (*batch, k) for tokens (*batch, n, d) (here batch = (2,)) and
    refuses other shapes; a simulate of a batch records (T, 2, d) for the weighted mean."""
    x = torch.stack([tp.sphere.sample_uniform(5, 3, generator=gen(s), dtype=F64) for s in (50, 51)])
    w = torch.rand(2, 5, generator=gen(52), dtype=F64) + 0.2
    w = w / w.sum(-1, keepdim=True)
    mean = lambda x, wt: (wt.unsqueeze(-1) * x).sum(-2)  # noqa: E731
    assert observe("mean", mean, x, w).shape == (2, 3)
    assert observe("first", lambda x, wt: x[..., 0, 0], x, w).shape == (2,)
    with pytest.raises(ValueError, match="returned shape"):
        observe("flat", lambda x, wt: x[0, 0], x, w)  # (d,) for a batch of 2
    heads = tp.Heads.random(1, 3, generator=gen(53), dtype=F64, beta=1.4)
    tr = tp.simulate(x, heads, t1=0.2, dt=0.1, weights=w, observables={"mean": mean}, diagnostics=False)
    assert tr.observables["mean"].shape == (3, 2, 3)
    assert_close(tr.observables["mean"], (w.unsqueeze(-1) * tr.x).sum(-2))


def test_process_signature_changes_with_every_head_tensor_and_beta():
    """The checkpoint fingerprint sees the heads' scores, values, weights and β: changing any
    one of them changes the signature (so a checkpoint of other weights is refused)."""
    h = tp.Heads.random(2, 3, generator=gen(10), dtype=F64, beta=1.3, weights=torch.tensor([1.0, 2.0], dtype=F64))

    def sig(heads):
        return repr([t.tolist() if isinstance(t, torch.Tensor) else t for t in process_signature(
            tp.OrnsteinUhlenbeck(heads, sigma=0.5))])

    base = sig(h)
    assert sig(tp.Heads(h.score + 1e-3, weights=h.weights, beta=1.3)) != base
    assert sig(tp.Heads(h.score, weights=h.weights * 2, beta=1.3)) != base
    assert sig(tp.Heads(h.score, weights=h.weights, beta=1.4)) != base
    assert sig(tp.Heads(h.score, weights=h.weights, beta=1.3)) == base


def test_process_signature_sees_every_layer_and_not_object_addresses():
    """The checkpoint fingerprint of a Layerwise process changes with the scores of any layer; that of
    a Custom process does not depend on which function object (address) carries the drift."""
    a = tp.Heads.random(1, 3, generator=gen(54), dtype=F64)
    b = tp.Heads.random(1, 3, generator=gen(55), dtype=F64)

    def sig(p):
        return repr([t.tolist() if isinstance(t, torch.Tensor) else t for t in process_signature(p)])

    base = sig(tp.Layerwise([a, b], layer_time=0.5))
    assert sig(tp.Layerwise([a, b], layer_time=0.5)) == base
    assert sig(tp.Layerwise([a, tp.Heads(b.score + 1e-6)], layer_time=0.5)) != base
    assert sig(tp.Custom(a, lambda t, A: -A)) == sig(tp.Custom(a, lambda t, A: -A))


def test_stepper_returns_the_pre_retraction_sphere_error_and_zero_for_flat_dynamics():
    """Euler: y = x + dt·k1; on the sphere the step returns y/‖y‖ and max_i |‖y_i‖ − 1| (computed here),
    without retraction y itself and 0.0."""
    from transformer_pde.solvers.parts import Stepper
    x = tp.sphere.sample_uniform(4, 3, generator=gen(86), dtype=F64)
    k1 = torch.randn(4, 3, generator=gen(87), dtype=F64)
    y = x + 0.1 * k1
    out, err = Stepper(tp.TABLEAUX["euler"], retract=True).step(x, k1, 0.1, lambda xs, c: None)
    assert_close(out, y / y.norm(dim=-1, keepdim=True), rtol=1e-15, atol=0)
    assert err == pytest.approx(float((y.norm(dim=-1) - 1).abs().max()), rel=1e-14)
    out, err = Stepper(tp.TABLEAUX["euler"], retract=False).step(x, k1, 0.1, lambda xs, c: None)
    eps = torch.finfo(F64).eps
    assert_close(out, y, rtol=4 * eps, atol=4 * eps * float(y.abs().max())) and err == 0.0


# ---------------------------------------------------------------------------- what a refused checkpoint names
def _drift_minus(t, A):
    return -A


def _drift_minus_twice(t, A):
    return -2.0 * A


def _interrupted_checkpoint(path, x0, theta, **kw):
    """A checkpoint left by a run stopped after step 3 (written after step 2)."""
    from problems import Interrupted

    def stop(k, t, x):
        if k == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        tp.simulate(x0, theta, checkpoint=path, checkpoint_every=2, callback=stop, **kw)
    assert path.exists()


def test_a_refused_checkpoint_names_exactly_the_inputs_that_differ(tmp_path):
    """Resuming with another method, another start time (t0 and t1 shifted together) or another Custom
    drift is refused, and the message lists those inputs by their labels and no others; the same run
    resumes."""
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(60), dtype=F64)
    a = tp.Heads.random(1, 3, generator=gen(61), dtype=F64)
    kw = dict(t1=0.4, dt=0.05, method="euler", quadrature="trapezoid", ledger=True)  # (the default quadrature follows the method)
    ck = tmp_path / "heads.ckpt"
    _interrupted_checkpoint(ck, x0, a, **kw)
    with pytest.raises(ValueError, match=r"these inputs differ: method\)"):
        tp.simulate(x0, a, checkpoint=ck, checkpoint_every=2, **{**kw, "method": "heun"})
    with pytest.raises(ValueError, match=r"these inputs differ: t0, t1\)"):
        tp.simulate(x0, a, checkpoint=ck, checkpoint_every=2, **{**kw, "t0": 1.0, "t1": 1.4})
    ck = tmp_path / "custom.ckpt"
    _interrupted_checkpoint(ck, x0, tp.Custom(a, _drift_minus), **kw)
    with pytest.raises(ValueError, match=r"these inputs differ: theta\.drift\)"):
        tp.simulate(x0, tp.Custom(a, _drift_minus_twice), checkpoint=ck, checkpoint_every=2, **kw)
    full = tp.simulate(x0, tp.Custom(a, _drift_minus), **kw)
    resumed = tp.simulate(x0, tp.Custom(a, _drift_minus), checkpoint=ck, checkpoint_every=2, **kw)
    assert_close(resumed.x, full.x, rtol=4 * torch.finfo(F64).eps, atol=4 * torch.finfo(F64).eps)


def _drift_with_rate(rate):
    def drift(t, A, *, rate=rate):
        return -rate * A
    return drift


def test_process_signature_sees_keyword_only_defaults_of_the_drift():
    """Two drifts with the same source and bytecode that differ only in a keyword-only default
    (``rate=``) have different signatures; equal defaults give equal ones."""
    a = tp.Heads.random(1, 3, generator=gen(62), dtype=F64)

    def sig(p):
        return repr([t.tolist() if isinstance(t, torch.Tensor) else t for t in process_signature(p)])

    one, two = _drift_with_rate(1.0), _drift_with_rate(2.0)
    assert one.__kwdefaults__ == {"rate": 1.0} and one.__code__.co_code == two.__code__.co_code
    assert sig(tp.Custom(a, one)) == sig(tp.Custom(a, _drift_with_rate(1.0)))
    assert sig(tp.Custom(a, one)) != sig(tp.Custom(a, two))


def test_a_drift_without_source_is_refused_by_its_attribute_name():
    """A Custom drift defined by exec (no readable source) and no tag: a checkpointed run refuses it
    before any step, naming it as "theta's drift" (the attribute without its underscore, as in the
    fingerprint's labels), and suggests a tag; with a tag its signature is built."""
    ns = {}
    exec("def drift(t, A):\n    return -A\n", ns)
    a = tp.Heads.random(1, 3, generator=gen(63), dtype=F64)
    with pytest.raises(ValueError, match=r"^theta's drift \(.*has no readable source.*tag"):
        process_signature(tp.Custom(a, ns["drift"]))
    assert "tag='v1'" in process_signature(tp.Custom(a, ns["drift"], tag="v1"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recorder_keeps_copies_in_one_buffer_and_stacks_them(dtype):
    """The recorded states are copies (a later in-place change of the state does not reach them), the
    stacked tokens equal the states recorded, and a recorder restored with earlier records (a resumed
    run) or given a state of another shape still stacks every record in order."""
    g = torch.Generator().manual_seed(5)
    states = [torch.randn(2, 4, 3, generator=g, dtype=dtype) for _ in range(5)]
    rec = Recorder(4, 1, diagnostics=False)
    x = torch.empty(2, 4, 3, dtype=dtype)
    for s in states:
        x.copy_(s)  # one state tensor changed in place, as a solver's buffer would be
        rec.record(x)
    _, xs, _, _, _ = rec.stacked(0.0, 0.1)
    assert_close(xs, torch.stack(states))  # copies: equal to the dtype's default tolerance
    resumed = Recorder(4, 1, diagnostics=False)
    resumed.records["x"] = [s.clone() for s in states[:2]]  # restored from a checkpoint
    for s in states[2:]:
        resumed.record(s)
    assert_close(resumed.stacked(0.0, 0.1)[1], torch.stack(states))
    odd = Recorder(1, 1, diagnostics=False)
    odd.record(states[0])
    odd.record(states[1][:, :2])  # another shape than the buffer's: kept as it is
    assert odd.records["x"][1].shape == (2, 2, 3)
    odd.record(states[2])  # more records than the buffer has slots: kept as it is
    assert_close(odd.records["x"][2], states[2])
    other = torch.float64 if dtype == torch.float32 else torch.float32
    mixed = Recorder(2, 1, diagnostics=False)
    mixed.record(states[0])
    mixed.record(states[1].to(other))  # another dtype than the buffer's: kept in its own dtype
    assert mixed.records["x"][1].dtype == other


def test_recorder_returns_its_buffer_without_a_copy():
    """When the buffer holds every record, the stacked tokens are that buffer (no copy of the trajectory at
    the end: the point of the buffer); a recorder restored with earlier records copies them into a new tensor."""
    g = torch.Generator().manual_seed(6)
    states = [torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(4)]
    rec = Recorder(3, 1, diagnostics=False)
    for s in states:
        rec.record(s)
    xs = rec.stacked(0.0, 0.5)[1]
    assert all(xs[i].data_ptr() == rec.records["x"][i].data_ptr() for i in range(4))
    resumed = Recorder(3, 1, diagnostics=False)
    resumed.records["x"] = [states[0].clone()]
    for s in states[1:]:
        resumed.record(s)
    ys = resumed.stacked(0.0, 0.5)[1]
    assert ys.data_ptr() not in {v.data_ptr() for v in resumed.records["x"]}
    assert_close(ys, torch.stack(states))
    partial = Recorder(3, 1, diagnostics=False)  # stacked before every record is in: only the records so far
    for s in states[:2]:
        partial.record(s)
    assert_close(partial.stacked(0.0, 0.5)[1], torch.stack(states[:2]))
    graph = Recorder(1, 1, diagnostics=False)  # states that carry a graph are kept as they are, never buffered
    leaf = states[0].clone().requires_grad_()
    graph.record(leaf * 2)
    graph.record(leaf * 3)
    stacked = graph.stacked(0.0, 1.0)[1]
    assert stacked.requires_grad
    assert_close(stacked.detach(), torch.stack([states[0] * 2, states[0] * 3]))
