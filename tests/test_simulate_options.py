"""simulate's keywords: causal, observables, quadratic_variation, energy_log_scale, progress, the thread
scope, and the Trajectory repr."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import assert_replayed, fit_slope, integrate, interrupt_and_resume, two_token_angle_rate, two_tokens
from transformer_pde.solvers.particle import methods as particle


# ---------------------------------------------------------------------------- causal
def test_causal_two_tokens_closed_form(dtype):
    """Causal softmax, one head λI, ascent: token 0 sees only itself and stays put; token 1 sees the
    prefix {x_0, x_1} with weights ½, ½, so only it moves and θ' is half the two-token rate of
    tests/problems.py (where both tokens move)."""
    lam, beta, th0, T = 1.3, 0.8, 2.0, 2.0
    times = np.linspace(0, T, 21)
    theta = integrate(lambda t, y: [0.5 * two_token_angle_rate(y[0], lam, beta, "softmax")], [th0], times)[0]
    heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), 3, beta=beta)
    x0 = two_tokens(th0, dtype=dtype)
    tr = tp.simulate(x0, heads, t1=T, dt=0.02, method="rk4", direction="ascent", causal=True, record_every=5,
                     diagnostics=False)
    got = torch.arccos((tr.x[:, 0] * tr.x[:, 1]).sum(-1).clamp(-1, 1))
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    assert_close(got.double(), torch.as_tensor(theta), atol=tol, rtol=0)
    assert_close(tr.x[:, 0], x0[0].expand_as(tr.x[:, 0]), atol=tol, rtol=0)
    tr = tp.simulate(x0, heads, t1=0.2, dt=0.1, direction="ascent", causal=True, ledger=True)
    assert tr.stats["gradient_flow"] is False
    assert "residual" not in tr.ledger and "residual_slope" not in tr.ledger
    assert set(tr.ledger) == {"dE", "partial", "dissipation", "slope", "martingale"}


def test_causal_ledger_still_balances_by_the_chain_rule():
    """Not a gradient flow, but 𝒟 = ∫⟨∇δE/δμ, V_causal⟩ is still dE/dt − ∂_tE: the balance
    dE − partial − dissipation − martingale (computed here from the entries) vanishes at order 1 (euler)."""
    x0 = tp.sphere.sample_uniform(8, 3, generator=gen(1), dtype=torch.float64)
    theta = tp.Oscillating(tp.Heads.random(2, 3, generator=gen(2), dtype=torch.float64))
    dts = [0.04, 0.02, 0.01, 0.005]
    res = []
    for dt in dts:
        L = tp.simulate(x0, theta, t1=0.4, dt=dt, causal=True, ledger=True).ledger
        res.append(abs(float((L["dE"] - L["partial"] - L["dissipation"] - L["martingale"])[-1])))
    assert abs(fit_slope(dts, res) - 1) < 0.25, res
    # the causal flow differs from the full one
    full = tp.simulate(x0, theta, t1=0.8, dt=0.04, ledger=True)
    cau = tp.simulate(x0, theta, t1=0.8, dt=0.04, causal=True, ledger=True)
    assert (full.x[-1] - cau.x[-1]).abs().max() > 1e-3
    assert full.stats["gradient_flow"] is True and "residual" in full.ledger


def test_causal_adaptive_and_noisy_paths():
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(3), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(4), dtype=torch.float64))
    tr = tp.simulate(x0, theta, t1=0.2, dt=0.05, paths=2, method="adaptive", causal=True, ledger=True)
    assert "residual" not in tr.ledger and tr.stats["gradient_flow"] is False
    eu = tp.simulate(x0, theta, t1=0.2, dt=0.05, paths=2, causal=True, quadratic_variation="realised", ledger=True)
    assert set(eu.ledger) == set(tr.ledger)
    for v in eu.ledger.values():
        assert torch.isfinite(v).all()


# ---------------------------------------------------------------------------- observables
@pytest.mark.parametrize("method", ["euler", "adaptive"])
def test_observables_are_recorded_at_every_record_time(method):
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(5), dtype=torch.float64)
    w = torch.rand(5, generator=gen(6), dtype=torch.float64) + 0.1
    w = w / w.sum()
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(7), dtype=torch.float64))
    obs = {"mean": lambda x, wt: (wt[:, None] * x).sum(-2),  # (paths, 3)
           "gamma01": lambda x, wt: (x[..., 0, :] * x[..., 1, :]).sum(-1)}  # (paths,)
    tr = tp.simulate(x0, theta, t1=0.5, dt=0.05, paths=2, seed=1, weights=w, record_every=3, method=method,
                     observables=obs, ledger=True)
    T = len(tr.times)
    assert tr.observables["mean"].shape == (T, 2, 3) and tr.observables["gamma01"].shape == (T, 2)
    # independent recomputation from the recorded tokens: the weighted mean and one Gram entry
    assert_close(tr.observables["mean"], torch.einsum("n,tpnd->tpd", w, tr.x))
    assert_close(tr.observables["gamma01"], torch.einsum("tpd,tpd->tp", tr.x[:, :, 0], tr.x[:, :, 1]))
    assert tp.simulate(x0, theta, t1=0.1, dt=0.05, ledger=True).observables == {}


@pytest.mark.parametrize("bad,err,match", [
    ([("a", lambda x, w: x)], TypeError, "mapping"),
    ({1: lambda x, w: x}, TypeError, "string"),
    ({"a": 3}, TypeError, "callable"),
    ({"a": lambda x, w: [1.0]}, TypeError, "must return a tensor"),
    ({"a": lambda x, w: x}, ValueError, "shape"),
])
def test_observables_validation(bad, err, match):
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(8), dtype=torch.float64)
    with pytest.raises(err, match=match):
        tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=0.1, dt=0.05, observables=bad, ledger=True)


@pytest.mark.parametrize("kw,err,match", [
    (dict(quadratic_variation="pathwise"), ValueError, "quadratic_variation"),
    (dict(energy_log_scale="big"), TypeError, "energy_log_scale"),
    (dict(energy_log_scale=float("inf")), ValueError, "energy_log_scale"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(causal=True, normalization="effective"), ValueError, "effective"),
    (dict(progress="yes"), TypeError, "progress"),
])
def test_option_validation(kw, err, match):
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(9), dtype=torch.float64)
    with pytest.raises(err, match=match):
        tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=0.1, dt=0.05, **kw)


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_resume_with_new_options_replays_the_run(tmp_path):
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(10), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(11), dtype=torch.float64))
    obs = {"g": lambda x, w: (x[..., 0, :] * x[..., 1, :]).sum(-1)}
    kw = dict(t1=0.5, dt=0.05, paths=2, seed=3, quadratic_variation="realised", observables=obs, ledger=True)
    full = tp.simulate(x0, theta, **kw)
    ck = tmp_path / "run.ckpt"

    resumed = interrupt_and_resume(x0, theta, ck, stop_at=7, checkpoint_every=3, **kw)
    assert_replayed(resumed.x, full.x, "x")
    assert_replayed(resumed.observables["g"], full.observables["g"], "observable g")
    assert_replayed(resumed.ledger, full.ledger, "ledger")
    with pytest.raises(ValueError, match="different run"):
        tp.simulate(x0, theta, checkpoint=ck, **{**kw, "quadratic_variation": "expected"})


# ---------------------------------------------------------------------------- repr, progress, threads
def test_trajectory_repr_is_short():
    x0 = tp.sphere.octahedral(50, dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(12), dtype=torch.float64))
    tr = tp.simulate(x0, theta, t1=1.0, dt=0.1, paths=2, observables={"m": lambda x, w: x.mean(-2)}, ledger=True)
    r = repr(tr)
    assert "tensor(" not in r and len(r) < 600, r
    for part in ("x=(11, 2, 50, 3) float64", "times=11 in [0, 1]", "residual", "observables=[m]",
                 "energy_log_scale", "method='euler'"):
        assert part in r, (part, r)
    assert "tensor(" not in repr(tp.simulate(x0, theta, t1=0.2, dt=0.1, diagnostics=False))


class _Bar:
    made = []

    def __init__(self, *a, **k):
        _Bar.made.append(k)

    def update(self, n):
        pass

    def close(self):
        pass


def test_progress_rule_and_terminal_only(monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(13), dtype=torch.float64)
    heads = tp.Heads.scalar([1.0], 3).to(torch.float64)
    run = lambda **k: tp.simulate(x0, heads, t1=0.2, dt=0.05, **k)  # noqa: E731
    _Bar.made.clear()
    run()  # small: no bar
    run(progress=False)
    assert _Bar.made == []
    monkeypatch.setattr(particle, "PROGRESS_MIN_WORK", 0.0)
    run()  # long by the rule: a bar, shown on terminals only
    run(progress=False)
    run(progress=True)
    assert len(_Bar.made) == 2 and all(k.get("disable", False) is None for k in _Bar.made)


def test_progress_bar_writes_nothing_off_a_terminal(capfd):
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(14), dtype=torch.float64)
    tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=0.2, dt=0.05, progress=True, ledger=True)
    assert capfd.readouterr().err == ""


def test_step_loop_runs_in_a_thread_scope(monkeypatch):
    import contextlib

    seen = []

    @contextlib.contextmanager
    def scope(work):
        seen.append(work)

        class P:
            def refresh(self, force=False):
                return 1

        yield P()

    monkeypatch.setattr(particle.threads, "scope", scope)
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(15), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(16), dtype=torch.float64))
    tp.simulate(x0, theta, t1=0.1, dt=0.05, paths=3, ledger=True)
    tp.simulate(x0, theta, t1=0.1, dt=0.05, paths=3, method="adaptive", ledger=True)
    assert seen == [3 * 2 * 5 * 5] * 2  # paths · H · n²


def test_adaptive_with_layer_boundaries_adjoint_gradient_equals_backprop():
    """Layer weights whose boundary (0.15) falls inside a record interval: the adaptive solve is
    split there; the gradient through odeint_adjoint equals autograd through the solve."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    second = tp.Heads.random(1, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    A0 = tp.Heads.random(1, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64).score
    A0 = A0.clone().requires_grad_(True)

    def grad(adjoint):
        theta = tp.Layerwise([tp.Heads(A0), second], "constant", layer_time=0.15)
        tr = tp.simulate(x0, theta, t1=0.3, dt=0.1, method="adaptive", adjoint=adjoint, diagnostics=False,
                         rtol=1e-10, atol=1e-12)
        assert tr.x.shape[0] == 4  # the record times only
        return torch.autograd.grad(tr.x[-1].sum(), A0)[0]

    ga, gb = grad(True), grad(False)
    assert float(ga.abs().max()) > 1e-3
    torch.testing.assert_close(ga, gb, rtol=1e-7, atol=1e-9)


def test_the_given_generator_draws_the_weight_noise():
    """generator= is the weights' random stream: the same generator state gives the same noisy run, another
    state another run (the draws do not fall back to the default seed)."""
    x0 = tp.sphere.sample_uniform(8, 4, generator=gen(40), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 4, generator=gen(41), dtype=torch.float64), sigma=0.5)
    kw = dict(t1=0.5, dt=0.1, diagnostics=False)
    first = tp.simulate(x0, theta, generator=gen(5), **kw).x
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(tp.simulate(x0, theta, generator=gen(5), **kw).x, first, rtol=16 * eps, atol=16 * eps)
    assert float((tp.simulate(x0, theta, generator=gen(6), **kw).x - first).abs().max()) > 1e-3
    assert float((tp.simulate(x0, theta, **kw).x - first).abs().max()) > 1e-3


@pytest.mark.parametrize("flag", ["diagnostics", "ledger", "adjoint", "return_path"])
def test_a_flag_that_is_not_a_bool_is_refused_by_its_name(flag):
    x0 = tp.sphere.octahedral(6, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"^{flag} must be True or False, got str 'yes'"):
        tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=0.2, dt=0.1, **{flag: "yes"})


def test_the_weight_path_is_stored_only_when_asked():
    """return_path=False (the default) keeps no weight path, return_path=True the sampled one."""
    x0 = tp.sphere.octahedral(6, dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.scalar([1.0], 3).to(torch.float64), sigma=0.3)
    assert tp.simulate(x0, theta, t1=0.2, dt=0.1).path is None
    assert tp.simulate(x0, theta, t1=0.2, dt=0.1, return_path=True).path.scores.shape[0] == 3


def test_tolerances_with_a_fixed_step_method_are_refused_naming_each():
    x0 = tp.sphere.octahedral(6, dtype=torch.float64)
    h = tp.Heads.scalar([1.0], 3).to(torch.float64)
    with pytest.raises(ValueError, match=r"^rtol=1e-06, atol=1e-08: rtol and atol are the tolerances"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, method="heun", rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match=r"^atol=1e-08: rtol and atol"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, atol=1e-8)
