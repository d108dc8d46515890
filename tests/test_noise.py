"""Noisy tokens in the particle solver: dX = V dt + √(2T) ∘ dB on S^{d−1} (transformer_pde.dynamics.noise).

Oracles: for V = 0 the spherical heat kernel — E⟨X_t, x0⟩ = e^{−(d−1)T t} and, on S², the Legendre
moments E P_ℓ(⟨X_t, x0⟩) = e^{−ℓ(ℓ+1)T t} and the CDF of the Legendre series — with the weak order
fitted from Monte Carlo (tolerances from the standard error); the scheme's exact one-step factor
ρ(dt) = E(1 + 2T dt χ²_{d−1})^{−1/2}; the Laplacian of the energy against autograd; the energy ledger's
mean residual over paths at order 1; exact checkpoint/resume; the token stream apart from the weights'.
"""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.special import eval_legendre
from scipy.stats import chi2

import transformer_pde as tp
from problems import interrupt_and_resume
from transformer_pde.dynamics.noise import TokenNoise, energy_laplacian, token_seed

from conftest import gen


def _zero_value_heads(d, dtype, H=2):
    score = tp.Heads.random(H, d, generator=gen(5), dtype=dtype).score
    return tp.Heads(score, torch.zeros_like(score))


def _rho(T, dt, d):
    """E (1 + 2T dt χ²_{d−1})^{−1/2}: the scheme's exact contraction of ⟨x, e⟩ per step when V = 0."""
    k = d - 1
    return quad(lambda q: (1 + 2 * T * dt * q) ** -0.5 * chi2.pdf(q, k), 0, np.inf)[0]


def _slope(dts, errs):
    return float(np.polyfit(np.log(dts), np.log(np.abs(errs)), 1)[0])


def _samples(d, T, t1, dt, dtype, paths=4000, n=10, seed=0):
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=dtype)
    traj = tp.simulate(x0, _zero_value_heads(d, dtype, H=1), t1=t1, dt=dt, temperature=T, paths=paths, seed=seed,
                       diagnostics=False, record_every=round(t1 / dt))
    return (traj.final * x0).sum(-1).reshape(-1).double()  # u = ⟨X_t, x0⟩ per token and path


@pytest.mark.parametrize("d", [2, 3])
def test_weak_order_one_of_the_mean_cosine(d):
    """V = 0: E⟨X_t, x0⟩ = e^{−(d−1)T t}; the bias falls like dt (fitted slope ≈ 1); every run agrees with
    the scheme's exact factor ρ(dt)^K within its standard error."""
    T, t1 = 0.5, 1.0
    exact = math.exp(-(d - 1) * T * t1)
    dts = np.array([0.1, 0.05, 0.025])
    bias = []
    for dt in dts:
        u = _samples(d, T, t1, dt, torch.float64)
        mean, se = float(u.mean()), float(u.std() / math.sqrt(u.numel()))
        scheme = _rho(T, dt, d) ** round(t1 / dt)
        assert abs(mean - scheme) < 4.5 * se, (dt, mean, scheme, se)  # the solver realises the scheme
        bias.append(mean - exact)
    assert all(b > 0 for b in bias)  # the discrete walk mixes slower than the heat flow
    assert 0.5 < _slope(dts, bias) < 1.3, bias  # Monte-Carlo slope (se ≈ 0.004 against biases 0.015–0.06)
    # the scheme's exact bias ρ(dt)^K − e^{−(d−1)Tt}: weak order 1 in the asymptotic range
    fine = np.array([0.01, 0.005, 0.0025, 0.00125])
    exact_bias = [_rho(T, h, d) ** round(t1 / h) - exact for h in fine]
    assert abs(_slope(fine, exact_bias) - 1) < 0.05, exact_bias


def test_heat_kernel_on_s2():
    """On S²: Legendre moments E P_ℓ(u) → e^{−ℓ(ℓ+1)T t} at order 1 (ℓ = 1, 2), and the Kolmogorov–Smirnov
    distance to the Legendre series of the heat kernel falls with dt down to the Monte-Carlo floor."""
    T, t1, d = 0.25, 1.0, 3
    dts = np.array([0.2, 0.1, 0.05, 0.025])
    L = np.arange(1, 40)
    decay = np.exp(-L * (L + 1) * T * t1)

    def cdf(u):  # ∫_{−1}^u Σ_ℓ (2ℓ+1)/2 e^{−ℓ(ℓ+1)Tt} P_ℓ = (u+1)/2 + Σ_{ℓ≥1} e^{…}(P_{ℓ+1} − P_{ℓ−1})/2
        u = np.asarray(u)[..., None]
        return (u[..., 0] + 1) / 2 + (decay * (eval_legendre(L + 1, u) - eval_legendre(L - 1, u)) / 2).sum(-1)

    errs, ks = {1: [], 2: []}, []
    for dt in dts:
        u = _samples(d, T, t1, dt, torch.float64, seed=1).numpy()
        for ell in (1, 2):
            P = eval_legendre(ell, u)
            se = P.std() / math.sqrt(u.size)
            errs[ell].append(P.mean() - math.exp(-ell * (ell + 1) * T * t1))
            if dt == dts[-1]:
                # the finest step still has bias ≈ c·dt; it must be small next to the coarse one
                assert abs(errs[ell][-1]) < abs(errs[ell][0]) / 4
        us = np.sort(u)
        F = cdf(us)
        emp = np.arange(1, us.size + 1) / us.size
        ks.append(float(np.max(np.abs(emp - F))))
    for ell in (1, 2):
        assert 0.75 < _slope(dts, errs[ell]) < 1.25, errs[ell]
    assert ks[-1] < ks[0] / 3 and ks == sorted(ks, reverse=True), ks
    assert ks[-1] < 0.025, ks  # Monte-Carlo floor 1.36/√(4e4) ≈ 0.007 plus the O(dt) bias


def test_energy_laplacian_against_autograd(dtype):
    """Σ_i Δ_{S,i} E equals the ambient Laplacian of the 0-homogeneous extension E(x/|x|) (autograd
    Hessian), for symmetric and general heads, a batch of β, token weights or uniform; the diagonal
    (self-interaction) term matters at small n."""
    d, n = 3, 4
    x = tp.sphere.sample_uniform(n, d, batch_shape=(2,), generator=gen(1), dtype=torch.float64)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    for sym, weights, beta in ((True, w, 1.3), (False, None, torch.tensor([0.7, 1.9], dtype=torch.float64))):
        h = tp.Heads.random(2, d, symmetric=sym, generator=gen(2), dtype=torch.float64, beta=beta,
                            weights=torch.tensor([0.3, 0.9], dtype=torch.float64))
        want = []
        for b in range(2):
            hb = h if sym else tp.Heads(h.score, h.value, h.weights, beta[b])

            def E(X):
                return tp.energy(X / X.norm(dim=-1, keepdim=True), hb, weights)

            Hs = torch.autograd.functional.hessian(E, x[b])
            want.append(sum(Hs[i, :, i, :].diagonal().sum() for i in range(n)))
        want = torch.stack(want)
        xd, hd = x.to(dtype), h.to(dtype)
        got = energy_laplacian(xd, hd, None if weights is None else weights.to(dtype))
        tol = 1e-10 if dtype == torch.float64 else 2e-4
        torch.testing.assert_close(got, want.to(dtype), rtol=tol, atol=tol)
    # the diagonal term: for A = λI the pair formula alone would not vanish on one token (E constant)
    one = tp.sphere.sample_uniform(1, d, generator=gen(3), dtype=torch.float64)
    torch.testing.assert_close(energy_laplacian(one, tp.Heads.scalar(torch.tensor([1.5], dtype=torch.float64), d)),
                               torch.tensor(0.0, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("process", ["constant", pytest.param("ou", marks=pytest.mark.slow)])
def test_ledger_closes_in_mean_at_order_one(process):
    """The noisy ledger dE − ∫∂_sE − T∫Σ_iΔ_{S,i}E − ∫𝒟 − M: its mean over paths → 0 like dt (n = 4 tokens,
    so the diagonal terms count); without the noise terms the mean would be T-sized."""
    d, n, T, t1 = 3, 4, 0.4, 0.4
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(7), dtype=torch.float64)
    h = tp.Heads.random(2, d, generator=gen(8), dtype=torch.float64, scale=0.5)
    theta = h if process == "constant" else tp.OrnsteinUhlenbeck(h, sigma=0.5)
    dts = np.array([0.04, 0.02, 0.01])
    res, partial = [], []
    for dt in dts:
        tr = tp.simulate(x0, theta, t1=t1, dt=dt, temperature=T, paths=2000, seed=11, method="heun",
                         direction="ascent", record_every=round(t1 / dt), ledger=True)
        r = tr.ledger["residual"][-1]
        res.append(float(r.mean()))
        assert abs(res[-1]) > 4 * float(r.std() / math.sqrt(r.numel()))  # the bias, not the Monte-Carlo error
        partial.append(float(tr.ledger["partial"][-1].mean()))
    assert 0.8 < _slope(dts, res) < 1.2, res
    # the noise terms booked (Itô correction in "partial") are much larger than what is left over
    tr0 = tp.simulate(x0, theta, t1=t1, dt=dts[-1], paths=2000, seed=11, method="heun", direction="ascent",
                      record_every=round(t1 / dts[-1]), ledger=True)
    assert abs(partial[-1] - float(tr0.ledger["partial"][-1].mean())) > 10 * abs(res[-1])


def test_streams_checkpoint_and_options(tmp_path):
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(12), dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(13), dtype=torch.float64))
    kw = dict(t1=1.0, dt=0.05, paths=2, seed=3, record_every=3, temperature=0.2, ledger=True)
    full = tp.simulate(x0, theta, return_path=True, **kw)
    # the weights' stream is untouched by the token noise: same weight path as without noise
    quiet = tp.simulate(x0, theta, return_path=True, **{**kw, "temperature": 0.0})
    torch.testing.assert_close(full.path.scores, quiet.path.scores)
    assert not torch.allclose(full.x[-1], quiet.x[-1])
    # T = 0 is the noiseless model to rounding (a few ulp): a T = 0 run that still took a different step (an
    # Euler–Maruyama step in place of the solver's, an extra retraction) differs by O(dt²) ≈ 1e-3 here
    plain = tp.simulate(x0, theta, **{k: v for k, v in kw.items() if k != "temperature"})
    eps = torch.finfo(plain.x.dtype).eps
    torch.testing.assert_close(plain.x, quiet.x, rtol=8 * eps, atol=8 * eps)
    # reproducible, and a TokenNoise with a seed of its own changes only the token stream
    again = tp.simulate(x0, theta, **kw)
    torch.testing.assert_close(again.x, full.x)
    own = tp.simulate(x0, theta, **{**kw, "temperature": TokenNoise(0.2, seed=token_seed(3))})
    torch.testing.assert_close(own.x, full.x)
    other = tp.simulate(x0, theta, **{**kw, "temperature": TokenNoise(0.2, seed=1)})
    assert float((other.x - full.x).abs().max()) > 1e-6  # another token stream
    assert full.stats["temperature"] == 0.2
    # checkpoint / resume: the token generator's state travels with the checkpoint
    ck = tmp_path / "run.ckpt"

    resumed = interrupt_and_resume(x0, theta, ck, stop_at=13, **kw)
    torch.testing.assert_close(resumed.x, full.x)
    for key in full.ledger:
        torch.testing.assert_close(resumed.ledger[key], full.ledger[key], msg=key)
    # a checkpoint of another temperature is refused
    with pytest.raises(ValueError):
        tp.simulate(x0, theta, checkpoint=ck, **{**kw, "temperature": 0.3})


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu", "effective"])
def test_every_normalisation_dtype_and_causal(normalization, dtype):
    x0 = tp.sphere.sample_uniform(8, 3, batch_shape=(2,), generator=gen(4), dtype=dtype)
    h = tp.Heads.random(2, 3, generator=gen(5), dtype=dtype)
    for causal in ((False, True) if normalization != "effective" else (False,)):
        tr = tp.simulate(x0, tp.Oscillating(h), t1=0.3, dt=0.05, temperature=0.5, paths=3,
                         normalization=normalization, causal=causal, method="rk4", ledger=True)
        assert tr.x.dtype == dtype and tr.x.shape == (7, 3, 2, 8, 3)
        torch.testing.assert_close(tr.x.norm(dim=-1), torch.ones(tr.x.shape[:-1], dtype=dtype),
                                   rtol=1e-12, atol=10 * torch.finfo(dtype).eps)
        # paths and ensemble members get independent noise
        assert not torch.allclose(tr.x[-1, 0], tr.x[-1, 1]) and not torch.allclose(tr.x[-1, :, 0], tr.x[-1, :, 1])
        assert ("residual" in tr.ledger) == (not causal)


def test_bad_temperature():
    x0 = tp.sphere.sample_uniform(4, 3, generator=gen(0), dtype=torch.float64)
    h = tp.Heads.random(1, 3, generator=gen(1), dtype=torch.float64)
    for bad, err in ((-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError),
                     (True, TypeError)):
        with pytest.raises(err, match="temperature"):
            tp.simulate(x0, h, t1=0.1, dt=0.05, temperature=bad, ledger=True)
    with pytest.raises(ValueError, match="fixed-step"):
        tp.simulate(x0, h, t1=0.1, dt=0.05, temperature=0.1, method="adaptive", ledger=True)
    with pytest.raises(ValueError, match="fixed-step|adjoint"):
        tp.simulate(x0, h, t1=0.1, dt=0.05, temperature=0.1, method="adaptive", adjoint=True, ledger=True)
    with pytest.raises(ValueError, match="TokenNoise.seed"):
        TokenNoise(0.1, seed=-1)
    # adaptive with T = 0 still works
    tp.simulate(x0, h, t1=0.1, dt=0.05, temperature=0.0, method="adaptive", ledger=True)


# ---------------------------------------------------------------------------- Fokker–Planck JKO
@pytest.mark.parametrize("taus", [(0.2,), pytest.param((0.2, 0.1), marks=pytest.mark.slow)])
def test_fokker_planck_jko_mode_rate_ledger_and_mass(taus):
    """Eulerian JKO with the entropy T∫ρ log ρ on S¹ (unnormalised head, unit mobility = the W2 gradient flow
    of −E + T∫ρ log ρ): the first Fourier mode grows at the implicit-Euler rate log(1/(1 − τ r_1))/τ of the
    closed form r_1 = (T_c − T) (it converges to r_1 like τ); mass 1 and positivity by construction; the
    free-energy ledger's residual → 0 like τ; the discrete energy inequality holds (defect ≤ 0)."""
    F64 = torch.float64
    z = tp.sphere.circle_grid(48, dtype=F64)  # spacing² ≈ 0.017 < ε
    th = torch.atan2(z[:, 1], z[:, 0])
    q0 = 1 + 0.1 * torch.cos(th)
    q0 = q0 / q0.sum()
    h = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), 2, beta=1.0)
    Tc = tp.theory.critical_temperature(1.0, 2, normalization="unnormalized")
    T, t1 = 0.5 * Tc, 0.6
    r1 = float(tp.theory.mode_growth_rates(1.0, 2, T, 1, normalization="unnormalized")[1])
    res, gap = [], []
    for tau in taus:
        tr = tp.jko(None, h, tau=tau, steps=round(t1 / tau), scheme="eulerian", grid=z, grid_weights=q0,
                    direction="ascent", mobility="unit", temperature=T, eps=0.02, tol=1e-9, max_iter=3000)
        w = tr.weights
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[0], dtype=F64), rtol=1e-12, atol=1e-13)
        assert bool((w > 0).all()) and tr.stats["max_defect"] <= 1e-12 and tr.stats["nonconverged_steps"] == 0
        m = (w.unsqueeze(-1) * z).sum(-2).norm(dim=-1)
        rate = math.log(m[-1] / m[0]) / t1
        implicit = math.log(1 / (1 - tau * r1)) / tau
        assert abs(rate - implicit) < 0.01 * abs(r1), (rate, implicit)
        gap.append(abs(rate - r1))
        res.append(float(tr.ledger["residual"][-1]))
        assert abs(res[-1]) < 0.1 * abs(float(tr.ledger["dE"][-1])), (res, float(tr.ledger["dE"][-1]))
        torch.testing.assert_close(tr.ledger["residual"], tr.ledger["residual_slope"], rtol=1e-12, atol=1e-15)
    if len(taus) == 2:
        assert 1.6 < gap[0] / gap[1] < 2.6 and 1.6 < res[0] / res[1] < 2.6, (gap, res)


def test_jko_temperature_validation():
    F64 = torch.float64
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(0), dtype=F64)
    h = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), 3)
    with pytest.raises(ValueError, match="scheme='eulerian'"):
        tp.jko(x0, h, tau=0.1, steps=1, temperature=0.1)
    with pytest.raises(ValueError, match="temperature"):
        tp.jko(None, h, tau=0.1, steps=1, scheme="eulerian", grid=20, temperature=-1.0,
               grid_weights=torch.full((20,), 0.05, dtype=F64))


def test_token_noise_with_a_layer_map_is_refused():
    """Token noise is defined for the projected flow; a layer map with T > 0 is refused before any work."""
    x0 = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = tp.Heads.scalar([1.0], 3).to(torch.float64)
    with pytest.raises(ValueError, match="layer_norm='post' with token noise"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, temperature=0.5, layer_norm="post", ledger=True)


def test_token_stream_follows_the_generator():
    """With generator= (and no seed=), the token stream is derived from the generator's seed: two
    generators seeded differently give different noisy paths, equal seeds the same path."""
    x0 = tp.sphere.sample_uniform(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = tp.Heads.scalar([1.0], 3).to(torch.float64)
    theta = tp.OrnsteinUhlenbeck(h, rate=1.0, sigma=0.0)

    def run(s):
        return tp.simulate(x0, theta, t1=0.3, dt=0.1, temperature=0.5, diagnostics=False,
                           generator=torch.Generator().manual_seed(s)).x[-1]

    a, b, c = run(1), run(2), run(1)
    torch.testing.assert_close(a, c)
    assert (a - b).abs().max() > 1e-3
