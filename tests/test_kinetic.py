"""The kinetic term ∫𝒢² dt of ``LedgerOptions(kinetic=True)``, accumulated from each step's own field:
equal to the energy ledger's "slope" (Euler and Heun, constant, OU and layerwise weights, the projected
flow, post- and pre-LN (the speed λ = 1/r), token weights or none, batch and paths axes, causal attention); equal to the quadrature
of a naive 𝒢² (tests/problems.py) over the recorded states, with the right end of a step at the left
limit of piecewise-constant weights (and not shifted by one step); its gradient equal to the gradient
through the ledger; resumed from a checkpoint; the refusals."""

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_slope, random_sphere, random_weights

F64 = torch.float64
T1, DT = 1.0, 0.1


def _heads(dtype, H=2, d=4, seed=3):
    A = torch.randn(H, d, d, generator=gen(seed), dtype=F64) / 2
    V = torch.randn(H, d, d, generator=gen(seed + 1), dtype=F64) / 2
    return A.to(dtype), V.to(dtype)


def _tol(dtype, scale):
    """Two computations of the same sums of K·n products (the ledger's kernel and the step's): a few ulps."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=64 * eps, atol=64 * eps * scale)


def _theta(kind, dtype):
    A, V = _heads(dtype)
    if kind == "constant":
        return tp.Heads(A, V)
    if kind == "ou":  # noisy symmetric weights, one path each
        return tp.OrnsteinUhlenbeck(tp.Heads(A + A.transpose(-1, -2)), mean=torch.eye(4, dtype=dtype), sigma=0.5)
    return tp.Layerwise([tp.Heads(A, V), tp.Heads(V, A)], layer_time=0.5)  # a knot at t = 0.5


@pytest.mark.parametrize("method,geometry", [("euler", "none"), ("heun", "none"), ("euler", "post"), ("euler", "pre")])
@pytest.mark.parametrize("kind", ["constant", "ou", "layerwise"])
@pytest.mark.parametrize("weighted", [False, True])
def test_kinetic_term_is_the_ledger_slope(dtype, method, geometry, kind, weighted):
    x0 = random_sphere(3, 6, 4, dtype=dtype, seed=1)
    w = random_weights((3, 6), seed=2, floor=0.2).to(dtype) if weighted else None
    solver = tp.Euler() if method == "euler" else tp.Heun()
    model = tp.Model(_theta(kind, dtype), layer_norm=geometry, direction="ascent", weights=w)
    kw = dict(t1=T1, dt=DT, paths=2, seed=4, progress=False)
    led = tp.solve(model, x0, solver, ledger=tp.LedgerOptions(ledger=True), **kw)
    kin = tp.solve(model, x0, solver, ledger=tp.LedgerOptions(diagnostics=False, kinetic=True), **kw)
    assert kin.kinetic.shape == (11, 2, 3) and kin.kinetic.dtype == dtype
    assert float(kin.kinetic[-1].min()) > 0.01  # a flow that moves: the comparison is not of zeros
    assert_close(kin.kinetic, led.ledger["slope"], **_tol(dtype, float(led.ledger["slope"].abs().max())))
    assert_close(kin.x, led.x)  # the same solve (the same weight paths)


def test_kinetic_term_under_causal_attention_is_of_the_whole_measure(dtype):
    """𝒢² = Σ_i w_i b(x_i)|V_causal|² with the mobility b of the whole measure, as the ledger has it (the
    step's own pass is of the prefixes: the kinetic term adds the non-causal one)."""
    x0 = random_sphere(2, 7, 4, dtype=dtype, seed=5)
    A, V = _heads(dtype)
    model = tp.Model(tp.Heads(A, V), causal=True, direction="ascent")
    kw = dict(t1=T1, dt=DT, progress=False)
    led = tp.solve(model, x0, tp.Heun(), ledger=tp.LedgerOptions(ledger=True), **kw)
    kin = tp.solve(model, x0, tp.Heun(), ledger=tp.LedgerOptions(diagnostics=False, kinetic=True), **kw)
    assert kin.kinetic.shape == (11, 2)
    assert_close(kin.kinetic, led.ledger["slope"], **_tol(dtype, float(led.ledger["slope"].abs().max())))
    # the prefix mobility would give another number
    prefix = tp.solve(tp.Model(tp.Heads(A, V), direction="ascent"), x0, tp.Heun(),
                      ledger=tp.LedgerOptions(diagnostics=False, kinetic=True), **kw)
    assert float((prefix.kinetic[-1] - kin.kinetic[-1]).abs().max()) > 1e-3


def _naive_G(x, A, V, w):
    """𝒢² of tests/problems.py (dense einsums, no library helper) at tokens x (..., n, d), heads 1/H."""
    H = A.shape[-3]
    omega = torch.full((H,), 1.0 / H, dtype=x.dtype)
    ww = torch.full(x.shape[:-1], 1.0 / x.shape[-2], dtype=x.dtype) if w is None else w
    return naive_slope(x, A, omega, 1.0, ww, V=V)


@pytest.mark.parametrize("weighted", [False, True])
def test_kinetic_term_is_the_quadrature_of_the_naive_slope_over_the_steps(dtype, weighted):
    """Euler: Σ_k dt 𝒢²(x_k, Θ_k) (left point, k = 0..K−1); Heun: Σ_k dt/2 [𝒢²(x_k, Θ_k) + 𝒢²(x_{k+1}, Θ(t_{k+1}−))]
    with layerwise weights (the right end of the step that ends at the knot t = 0.5 keeps the first layer).
    The same sums shifted by one step (or with the right-continuous Θ at the knot) are far outside the tolerance."""
    x0 = random_sphere(3, 6, 4, dtype=dtype, seed=6)
    w = random_weights((3, 6), seed=7, floor=0.2).to(dtype) if weighted else None
    A, V = _heads(dtype)
    layer = [(A, V), (V, A)]
    theta = tp.Layerwise([tp.Heads(*layer[0]), tp.Heads(*layer[1])], layer_time=0.5)
    K = round(T1 / DT)
    kw = dict(t1=T1, dt=DT, saveat=tp.SaveAt(record_every=1), progress=False)
    opts = tp.LedgerOptions(diagnostics=False, kinetic=True)
    eps = torch.finfo(dtype).eps
    for solver in (tp.Euler(), tp.Heun()):
        tr = tp.solve(tp.Model(theta, direction="ascent", weights=w), x0, solver, ledger=opts, **kw)
        xs = tr.x  # (K + 1, 3, 6, 4): every step recorded
        lay = [min(int(k * DT / 0.5 + 1e-9), 1) for k in range(K + 1)]  # the layer of t_k (right-continuous)
        left = torch.stack([_naive_G(xs[k], *layer[lay[k]], w) for k in range(K)])
        # the right end of step k at Θ(t_{k+1}−): the layer of t_k
        right = torch.stack([_naive_G(xs[k + 1], *layer[lay[k]], w) for k in range(K)])
        right_cont = torch.stack([_naive_G(xs[k + 1], *layer[lay[k + 1]], w) for k in range(K)])
        if solver.method == "euler":
            want = torch.cumsum(DT * left, 0)
            wrong = [torch.cumsum(DT * right_cont, 0)]  # the left point rule shifted by one step
        else:
            want = torch.cumsum(DT * 0.5 * (left + right), 0)
            wrong = [torch.cumsum(DT * 0.5 * (left + right_cont), 0), torch.cumsum(DT * left, 0)]
        tol = dict(rtol=256 * eps, atol=256 * eps * float(want.abs().max()))
        assert_close(tr.kinetic[1:], want, **tol)
        assert_close(tr.kinetic[0], torch.zeros_like(tr.kinetic[0]), **tol)
        for bad in wrong:
            assert float((bad[-1] - want[-1]).abs().min()) > 30 * tol["atol"]


@pytest.mark.parametrize("method,geometry", [("euler", "none"), ("heun", "none"), ("euler", "post")])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradient_of_the_kinetic_term_is_the_gradient_through_the_ledger(dtype, method, geometry, weighted):
    """The module's kinetic term (accumulated from the steps' own field) and the ledger's "slope" of the same
    solve (the diagnostics' kernel passes): the same value, and the same gradient in every parameter."""
    torch.manual_seed(0)
    m = tp.nn.MeanFieldAttention(6, 2, layers=2, steps=3, method=method, layer_norm=geometry, dtype=dtype)
    x = random_sphere(3, 5, 6, dtype=dtype, seed=8)
    w = random_weights((3, 5), seed=9, floor=0.2).to(dtype) if weighted else None
    params = list(m.parameters())
    _, kin = m(x, weights=w, kinetic=True)
    g_kin = torch.autograd.grad((kin * torch.arange(1, 4, dtype=dtype)).sum(), params)
    model = tp.Model(m.theta(), layer_norm=geometry, direction=m.direction, weights=w)
    led = tp.solve(model, x, tp.Euler() if method == "euler" else tp.Heun(), t1=m.t1, dt=m.t1 / (2 * 3),
                   saveat=tp.SaveAt(ends=True), ledger=tp.LedgerOptions(ledger=True, energy_log_scale=0.0),
                   progress=False).ledger["slope"][-1]
    g_led = torch.autograd.grad((led * torch.arange(1, 4, dtype=dtype)).sum(), params)
    eps = torch.finfo(dtype).eps
    assert_close(kin, led, rtol=64 * eps, atol=64 * eps * float(led.detach().abs().max()))
    scale = max(float(g.abs().max()) for g in g_led)
    assert scale > 1e-3
    for a, b in zip(g_kin, g_led):
        assert_close(a, b, rtol=256 * eps, atol=256 * eps * scale)


def test_kinetic_term_resumes_from_a_checkpoint_without_double_count(tmp_path, dtype):
    """Interrupted after step 7 with checkpoints every 5 steps: the resumed run redoes steps 6, 7 from the
    checkpoint's integral and records, and ends with the uninterrupted run's series."""
    x0 = random_sphere(2, 6, 4, dtype=dtype, seed=10)
    model = tp.Model(_theta("ou", dtype), direction="ascent")
    opts = tp.LedgerOptions(diagnostics=False, kinetic=True)
    kw = dict(t1=T1, dt=DT, paths=2, seed=11, saveat=tp.SaveAt(record_every=2))
    full = tp.solve(model, x0, tp.Heun(), ledger=opts, progress=False, **kw)
    ck = tp.Checkpointing(tmp_path / "kin.pt", every=5)

    class Stop(Exception):
        pass

    def stop(k, t, x):
        if k == 7:
            raise Stop
    with pytest.raises(Stop):
        tp.solve(model, x0, tp.Heun(), ledger=opts, checkpoint=ck, progress=tp.Progress(False, stop), **kw)
    resumed = tp.solve(model, x0, tp.Heun(), ledger=opts, checkpoint=ck, progress=False, **kw)
    assert_close(resumed.times, full.times)
    assert_close(resumed.kinetic, full.kinetic, **_tol(dtype, float(full.kinetic.abs().max())))
    # a checkpoint of a run without the kinetic term holds no integral of its first steps: refused
    plain = tp.Checkpointing(tmp_path / "plain.pt", every=5)
    with pytest.raises(Stop):
        tp.solve(model, x0, tp.Heun(), ledger=tp.LedgerOptions(diagnostics=False), checkpoint=plain,
                 progress=tp.Progress(False, stop), **kw)
    with pytest.raises(ValueError, match="without the kinetic term"):
        tp.solve(model, x0, tp.Heun(), ledger=opts, checkpoint=plain, progress=False, **kw)


def test_kinetic_term_options_and_where_it_is_read():
    x0 = random_sphere(6, 4, seed=12)
    A, V = _heads(F64)
    model = tp.Model(tp.Heads(A, V), direction="ascent")
    kw = dict(t1=T1, dt=DT, progress=False)
    # the quadrature is the kinetic term's too: Euler with the trapezoid rule is the ledger's trapezoid
    trap = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(kinetic=True, quadrature="trapezoid"), **kw)
    led = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(ledger=True, quadrature="trapezoid"), **kw)
    left = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(ledger=True), **kw)
    assert_close(trap.kinetic, led.ledger["slope"], **_tol(F64, 1.0))
    assert float((trap.kinetic[-1] - left.ledger["slope"][-1]).abs()) > 1e-4
    # with the ledger the kinetic term is its "slope"; with lazy diagnostics the records' E, 𝒢², 𝒟 are there
    both = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(ledger=True, kinetic=True), **kw)
    assert "kinetic" not in both.extras
    assert_close(both.kinetic, left.ledger["slope"])
    lazy = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(kinetic=True), **kw)
    assert_close(lazy.kinetic, left.ledger["slope"], **_tol(F64, 1.0))
    assert_close(lazy.slope, left.slope)
    assert not lazy.has_ledger and lazy.with_paths().kinetic.shape == (11, 1)
    plain = tp.solve(model, x0, tp.Euler(), **kw)
    with pytest.raises(ValueError, match=r"LedgerOptions\(kinetic=True\)"):
        plain.kinetic


def test_kinetic_term_refusals_before_any_work(monkeypatch):
    with pytest.raises(TypeError, match="LedgerOptions.kinetic"):
        tp.LedgerOptions(kinetic="yes")
    with pytest.raises(ValueError, match="quadratic_variation='realised'.*ledger=True"):
        tp.LedgerOptions(kinetic=True, quadratic_variation="realised")
    with pytest.raises(ValueError, match="LedgerOptions.ledger"):
        tp.LedgerOptions(quadrature="left")  # without the kinetic term or the ledger there is nothing to integrate
    x0 = random_sphere(6, 4, seed=13)
    A, V = _heads(F64)
    model = tp.Model(tp.Heads(A, V), direction="ascent")

    def refuse(*a, **k):
        raise AssertionError("the run started")
    monkeypatch.setattr(tp.processes.driver.WeightDriver, "__init__", refuse)
    opts = tp.LedgerOptions(kinetic=True)
    with pytest.raises(ValueError, match=r"Dopri5.*ledger=True.*SaveAt\(record_every=1\)"):
        tp.solve(model, x0, tp.Dopri5(), t1=T1, dt=DT, ledger=opts)
    for solver in (tp.ShardedEuler(), tp.LagrangianJKO()):
        with pytest.raises(TypeError, match="LedgerOptions.kinetic"):
            tp.solve(model, x0, solver, t1=T1, dt=DT, ledger=opts)
