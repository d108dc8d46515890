"""Large β‖A‖: energies and ledgers on a common scale e^{c}.

E, 𝒢², 𝒟, ∂_tE, the Itô term and the martingale are linear in the kernel e^{β⟨x,Ay⟩}, which
overflows at β‖A‖ ≈ 88 (float32) / 709 (float64) while the softmax field stays finite.  The
solvers report them times e^{−c}, c = traj.stats["energy_log_scale"]; these tests check the
scale rule against an independent log-sum-exp, the scaled values against closed forms, the ledger's
order at β‖A‖ = 500 (float32) and 5000 (float64), and the error when the exponent outgrows c.
"""

import math
import re

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import fit_slope
from transformer_pde.model.energy import choose_log_scale

LARGE = {torch.float32: 500.0, torch.float64: 5000.0}


def _cap(n, angle, dtype, seed=0):
    """n tokens within ~angle of the north pole (close enough to interact at large β)."""
    v = torch.randn(n, 3, generator=gen(seed), dtype=torch.float64) * angle
    v[:, 2] = 1.0
    return (v / v.norm(dim=-1, keepdim=True)).to(dtype)


def _two_tokens(theta, dtype):
    x = torch.zeros(2, 3, dtype=torch.float64)
    x[0, 0] = 1.0
    x[1, 0], x[1, 1] = math.cos(theta), math.sin(theta)
    return x.to(dtype)


@pytest.mark.parametrize("method,order", [("euler", 1), ("heun", 2)])
def test_ledger_closes_at_its_order_at_large_beta(dtype, method, order):
    """Scalar heads λ_h I with β λ_max = 500 (float32) / 5000 (float64), tokens a few 1/√(βλ) apart,
    horizon 20/(βλ) (a few interaction times): every record finite, and the residual falls at the
    method's order over 4 step sizes (measured 1.17 / 2.00 in both dtypes)."""
    L = LARGE[dtype]
    heads = tp.Heads.scalar(torch.tensor([L, 0.6 * L], dtype=dtype), 3)
    x0 = _cap(5, 1.0 / math.sqrt(L), dtype)
    T = 20.0 / L
    dts = [T / 10, T / 20, T / 40, T / 80]
    res = []
    for dt in dts:
        tr = tp.simulate(x0, heads, t1=T, dt=dt, method=method, ledger=True, direction="descent")
        for v in (tr.energy, tr.slope, tr.dissipation, *tr.ledger.values()):
            assert torch.isfinite(v).all()
        res.append(abs(float(tr.ledger["residual"][-1])))
    assert tr.stats["energy_log_scale"] > L  # rescaled
    assert res[-1] < (0.2 if order == 1 else 0.01) * float(tr.ledger["dE"].abs().max())  # measured 0.09 / 0.008
    assert abs(fit_slope(dts, res) - order) < 0.3, res


def test_scale_rule_against_an_independent_logsumexp(dtype):
    """c = 0 while max log m_h ≤ R/2 (R = log finfo.max), else ⌈max log m_h + R/4⌉."""
    R = math.log(torch.finfo(dtype).max)
    x0 = tp.sphere.sample_uniform(7, 3, generator=gen(1), dtype=torch.float64)
    A = torch.randn(2, 3, 3, generator=gen(2), dtype=torch.float64)
    A = A + A.mT
    A = A / torch.linalg.matrix_norm(A, ord=2).max()
    for size in (0.25 * R, 3.0 * R):
        heads = tp.Heads((size * A).to(dtype), beta=1.0)
        tr = tp.simulate(x0.to(dtype), heads, t1=0.02, dt=0.01, ledger=True, direction="descent")
        S = size * torch.einsum("id,hde,je->hij", x0, A, x0)
        lmax = float((torch.logsumexp(S, -1) - math.log(7)).max())
        want = 0.0 if lmax <= R / 2 else math.ceil(lmax + R / 4)
        assert tr.stats["energy_log_scale"] == want
        assert tr.energy_log_scale == want


def test_scaled_records_are_the_values_times_exp_minus_c():
    """Everything in the ledger is linear in the kernel: a run reported at c = 7.5 is the run at c = 0
    times e^{−7.5}, term by term (OU paths, realised and expected quadratic variation, weighted tokens)."""
    x0 = tp.sphere.sample_uniform(9, 3, generator=gen(3), dtype=torch.float64)
    w = torch.rand(9, generator=gen(4), dtype=torch.float64) + 0.1
    w = w / w.sum()
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(3, 3, generator=gen(5), dtype=torch.float64))
    for qv in ("expected", "realised"):
        kw = dict(t1=0.3, dt=0.01, paths=3, seed=2, weights=w, method="heun", quadratic_variation=qv, ledger=True)
        a = tp.simulate(x0, theta, **kw, direction="descent")
        b = tp.simulate(x0, theta, energy_log_scale=7.5, **kw, direction="descent")
        assert a.stats["energy_log_scale"] == 0.0 and b.stats["energy_log_scale"] == 7.5
        f = math.exp(7.5)
        assert_close(b.energy * f, a.energy, rtol=1e-12, atol=0)
        assert_close(b.slope * f, a.slope, rtol=1e-12, atol=0)
        assert_close(b.dissipation * f, a.dissipation, rtol=1e-12, atol=1e-14)
        for key in a.ledger:
            assert_close(b.ledger[key] * f, a.ledger[key], rtol=1e-9, atol=1e-13), key
        assert_close(b.log_energy(), torch.log(a.energy), rtol=1e-13, atol=0)


def test_energy_with_log_scale_against_the_two_token_closed_form(dtype):
    """Two tokens at angle θ, one head λI, β = 1: E = (e^{λ} + e^{λ cos θ})/4 (ω = 1, uniform weights),
    so E·e^{−λ} = (1 + e^{λ(cos θ − 1)})/4 — at λ = 500 / 5000, far beyond the dtype's exponent range."""
    lam, theta = LARGE[dtype], 0.02
    x = _two_tokens(theta, dtype)
    heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), 3)
    want = (1 + math.exp(lam * (math.cos(theta) - 1))) / 4
    rtol = 1e-12 * lam if dtype == torch.float64 else 1e-6 * lam
    got = tp.energy(x, heads, log_scale=lam)
    assert_close(got, torch.tensor(want, dtype=dtype), rtol=rtol, atol=0)
    assert_close(tp.head_energies(x, heads, log_scale=lam)[0], torch.tensor(want, dtype=dtype), rtol=rtol, atol=0)
    assert_close(tp.log_energy(x, heads), torch.tensor(lam + math.log(want), dtype=dtype), rtol=rtol, atol=0)
    with pytest.raises(OverflowError, match="log_energy"):
        tp.energy(x, heads)
    with pytest.raises(OverflowError, match="log_scale"):
        tp.head_energies(x, heads)
    # the solver's first record, through its own scale
    tr = tp.simulate(x, heads, t1=1e-4, dt=1e-4, ledger=True, direction="descent")
    assert_close(tr.log_energy()[0], torch.tensor(lam + math.log(want), dtype=dtype), rtol=rtol, atol=0)


def test_slope_dissipation_and_derivatives_take_a_log_scale(dtype):
    """At moderate β: the scaled functions are e^{−c} times the plain ones; at β‖A‖ beyond the dtype's
    range they are finite with a scale and raise OverflowError without one."""
    x = tp.sphere.sample_uniform(6, 3, generator=gen(6), dtype=torch.float64).to(dtype)
    h = tp.Heads.random(2, 3, generator=gen(7), dtype=torch.float64, symmetric=False).to(dtype)
    rate = torch.randn(2, 3, 3, generator=gen(8), dtype=torch.float64).to(dtype)
    c = 4.0
    f = math.exp(-c)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-7)
    for norm in ("softmax", "relu", "unnormalized"):
        assert_close(tp.slope(x, h, normalization=norm, log_scale=c), tp.slope(x, h, normalization=norm) * f, **tol)
        assert_close(tp.dissipation(x, h, normalization=norm, log_scale=c),
                     tp.dissipation(x, h, normalization=norm) * f, **tol)
    assert_close(tp.first_variation(x, h, log_scale=c), tp.first_variation(x, h) * f, **tol)
    assert_close(tp.energy_time_derivative(x, h, rate, sigma=0.5, log_scale=c),
                 tp.energy_time_derivative(x, h, rate, sigma=0.5) * f, **tol)
    big = tp.Heads(h.score * (LARGE[dtype] / float(torch.linalg.matrix_norm(h.score.double(), ord=2).max())))
    cb = choose_log_scale(tp.log_mobility(x, big)[0])
    assert cb > 0
    for fn in (lambda **k: tp.slope(x, big, **k), lambda **k: tp.dissipation(x, big, **k),
               lambda **k: tp.first_variation(x, big, **k),
               lambda **k: tp.energy_time_derivative(x, big, rate, sigma=0.5, **k)):
        assert torch.isfinite(fn(log_scale=cb)).all()
        with pytest.raises(OverflowError, match="log_scale"):
            fn()


@pytest.mark.parametrize("dtype,a0,g,t1,dt", [(torch.float32, 40.0, 100.0, 0.6, 2e-3),
                                             pytest.param(torch.float64, 354.0, 1000.0, 0.6, 5e-4,
                                                          marks=pytest.mark.slow)])
def test_exponent_outgrowing_the_scale_raises_with_a_fix_that_works(dtype, a0, g, t1, dt):
    """Heads A(t) = (a0 + g t) I start below the rescaling threshold (c = 0) and overflow the dtype
    (log E ≈ a0 + g t > log finfo.max) before t1: NonFiniteError names the time, step and quantity and
    suggests an energy_log_scale; rerun with it, the same run completes and its ledger closes
    (heun: relative residual ≈ (g dt)²/12, 0.3 % in float32 and 2 % in float64 here)."""
    heads = tp.Heads.scalar(torch.tensor([a0], dtype=dtype), 3)
    theta = tp.Custom(heads, lambda t, A: g * torch.eye(3, dtype=dtype).expand_as(A))
    x0 = _cap(4, 0.1, dtype, seed=9)
    with pytest.raises(tp.NonFiniteError, match=r"at t = .* \(step \d+\).*energy_log_scale=\d+") as err:
        tp.simulate(x0, theta, t1=t1, dt=dt, method="heun", ledger=True, direction="descent")
    c = int(re.search(r"energy_log_scale=(\d+)", str(err.value)).group(1))
    tr = tp.simulate(x0, theta, t1=t1, dt=dt, method="heun", energy_log_scale=c, ledger=True, direction="descent")
    assert tr.stats["energy_log_scale"] == c
    for v in (tr.energy, *tr.ledger.values()):
        assert torch.isfinite(v).all()
    assert abs(float(tr.ledger["residual"][-1])) < (g * dt) ** 2 / 4 * float(tr.ledger["dE"].abs().max())


def _reported_log(err) -> float:
    m = re.search(r"its logarithm is up to ([-+0-9.e]+), and minus log_scale = ([-+0-9.e]+)", str(err.value))
    assert m is not None, str(err.value)
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("batched", [False, True])
def test_overflow_errors_report_the_logarithm_to_rescale_by(batched):
    """Float32 quantities that overflow raise OverflowError naming the quantity, the fix and the
    logarithm reached — and that logarithm is the float64 dense value (the number a user picks
    log_scale from): log E, max_h log E_h, max log m_h, with a batch of β and per-member token
    weights when ``batched``.  (b ≤ max_h m_h, so m_h overflows first; only a one-ulp rounding of
    log b in float32 reaches b's own message: tests/test_mobility.py checks that case.)"""
    x64 = tp.sphere.sample_uniform(6, 3, generator=gen(30), dtype=torch.float64)
    A = tp.Heads.random(3, 3, generator=gen(31), dtype=torch.float64, scale=0.3).score + torch.eye(3, dtype=torch.float64)
    om = torch.tensor([0.7, 1.6, 1.0], dtype=torch.float64)  # H = 3 heads, a batch of 2: axes cannot be confused
    if batched:
        x64 = torch.stack([x64, x64.flip(0)])
        A = A.expand(2, 3, 3, 3).clone()
        om = om.expand(2, 3).clone()
        beta = torch.tensor([120.0, 150.0], dtype=torch.float64)
        w = torch.rand(2, 6, generator=gen(32), dtype=torch.float64) + 0.2
        w = w / w.sum(-1, keepdim=True)
    else:
        beta, w = 130.0, torch.full((6,), 1 / 6, dtype=torch.float64)
    b = beta.unsqueeze(-1) if batched else torch.tensor(beta, dtype=torch.float64)
    logK = (b.unsqueeze(-1).unsqueeze(-1) if batched else b) * torch.einsum("...id,...hde,...je->...hij", x64, A, x64)
    log_m = torch.logsumexp(logK + torch.log(w).unsqueeze(-2).unsqueeze(-3), -1)  # (..., H, n)
    log_Eh = torch.logsumexp(log_m + torch.log(w).unsqueeze(-2), -1) - torch.log(2 * b)  # (..., H)
    log_E = torch.logsumexp(log_Eh + torch.log(om), -1)
    heads = tp.Heads(A, weights=om, beta=beta).to(torch.float32)
    x, w32 = x64.float(), (None if not batched else w.float())
    cases = [
        (lambda: tp.energy(x, heads, w32), "the energy E", "log_energy", log_E.max()),
        (lambda: tp.head_energies(x, heads, w32), "the head energy E_h", "log_scale", log_Eh.max()),
        (lambda: tp.mobility(x, heads, w32)[0], "the per-head mobility m_h", "log_mobility", log_m.max()),
        (lambda: tp.first_variation(x, heads, w32), "the first variation", "log_scale", log_m.max()),
    ]
    for fn, what, fix, want in cases:
        with pytest.raises(OverflowError, match=what) as err:
            fn()
        assert fix in str(err.value)
        got, scale = _reported_log(err)
        assert scale == 0.0
        assert abs(got - float(want)) <= 1e-4 * abs(float(want)), (what, got, float(want))


@pytest.mark.parametrize("geometry", ["post", "pre"])
def test_scaled_layer_map_ledger_is_the_values_times_exp_minus_c(geometry):
    """Along a layer map the ledger's 𝒟 and 𝒢² are taken along the geometry's velocity (λ_i P_x A_i, with
    the pre-LN radii): a run reported at c = 7.5 is the run at c = 0 times e^{−7.5}, term by term."""
    x0 = tp.sphere.sample_uniform(9, 3, generator=gen(13), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(3, 3, generator=gen(14), dtype=torch.float64))
    kw = dict(t1=0.3, dt=0.02, paths=2, seed=4, method="euler", layer_norm=geometry, ledger=True,
              direction="ascent")
    a = tp.simulate(x0, theta, **kw)
    b = tp.simulate(x0, theta, energy_log_scale=7.5, **kw)
    assert a.stats["energy_log_scale"] == 0.0 and b.stats["energy_log_scale"] == 7.5
    f = math.exp(7.5)
    for key in ("dissipation", "slope", "partial", "dE", "residual"):
        scale = float(a.ledger[key].abs().max())
        assert_close(b.ledger[key] * f, a.ledger[key], rtol=1e-9, atol=1e-12 * max(scale, 1.0)), key
