"""β as a rule of the context length, and β ≤ 0 (docs/model.md#heads, docs/model.md#energy).

Every expected value is computed here from the formulas, independently of the code under test:

* a rule β_n (``tp.LogScaling(γ)``, ``tp.PowerScaling``, a callable) gives, at every n, the same field, energy,
  mobility and solve as heads with the fixed β = β_n written out by hand;
* the β → 0 limits against their series: the softmax field V(β) = P_x Σ_h ω_h V_h [x̄ + β Cov_w(y, s_h) + O(β²)]
  (Cov_w(y, s) = (Σ_j w_j y_j y_jᵀ − x̄x̄ᵀ) A_hᵀ x), the un-normalised field V_h[x̄ + β Σ_j w_j s_j y_j + O(β²)],
  and the centred energy E_c(β) = ½ Σ_h ω_h Σ_k β^{k−1} M_k/k!, M_k = Σ_ij w_i w_j s_ij^k (dense moments);
* the reference energy E(β) − Σ_h ω_h/(2β) = E_c(β) at moderate β of both signs (log-sum-exp against pairwise
  expm1), and E(0) = E_c(0) = ½ Σ_h ω_h M_1 (the finite part);
* a synchronising case (β = 1 on S¹: Criscitiello–Rebjock–McRae–Boumal) and a non-synchronising one (β = −1 on
  S¹: the equilateral triangle is a strict local maximum of E, checked by the Hessian of the dense energy and by a
  run from a perturbed triangle);
* the refusals, in float32 and float64.
"""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen

F64 = torch.float64
DTYPES = [torch.float32, torch.float64]


def _setup(dtype, n=6, d=3, H=2, seed=0, weights=True):
    g = gen(seed)
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=F64)
    A = torch.randn(H, d, d, generator=g, dtype=F64)
    V = torch.randn(H, d, d, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) + 0.2 if weights else None
    w = None if w is None else w / w.sum()
    omega = torch.tensor([0.7, 0.45], dtype=F64)[:H]
    c = (lambda t: None if t is None else t.to(dtype))
    return c(x), c(A), c(V), c(w), c(omega)


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------------------- rules of the context length
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_scaling_equals_the_fixed_beta_at_each_n(dtype):
    """β_n = γ log n gives, at n = 3, 17, 64, the field, energy, mobility and 𝒟 of heads with β = γ log n."""
    gamma = 0.6
    for n in (3, 17, 64):
        x, A, V, w, om = _setup(dtype, n=n, seed=n)
        ruled = tp.Heads(A, V, om, beta=tp.LogScaling(gamma))
        fixed = tp.Heads(A, V, om, beta=gamma * math.log(n))
        for norm in ("softmax", "unnormalized", "relu"):
            assert_close(tp.velocity(x, ruled, w, norm), tp.velocity(x, fixed, w, norm), **_tol(dtype))
        sym = tp.Heads(A + A.mT, None, om, beta=tp.LogScaling(gamma))
        symf = tp.Heads(A + A.mT, None, om, beta=gamma * math.log(n))
        assert_close(tp.energy(x, sym, w), tp.energy(x, symf, w), **_tol(dtype))
        assert_close(tp.mobility(x, sym, w)[1], tp.mobility(x, symf, w)[1], **_tol(dtype))
        assert_close(tp.dissipation(x, sym, w), tp.dissipation(x, symf, w), **_tol(dtype))
        assert ruled.at_context(n).beta == pytest.approx(gamma * math.log(n), rel=1e-15)
        assert ruled.at_context(n).context == n and isinstance(ruled.at_context(n).beta_rule, tp.LogScaling)


def test_power_scaling_and_callables_and_tensor_sweeps():
    """c·n^{2/(d−1)}, a plain callable, and a γ tensor (a sweep: β_n gets its shape) resolve as written."""
    n, d = 40, 3
    x, A, _, _, _ = _setup(F64, n=n, d=d, H=1)
    rule = tp.PowerScaling.uniform_keys(d, c=0.05)
    assert rule.exponent == 1.0 and rule(n) == pytest.approx(0.05 * n)
    assert tp.PowerScaling.uniform_keys(5, c=0.3)(n) == pytest.approx(0.3 * n ** 0.5, rel=1e-14)
    assert_close(tp.velocity(x, tp.Heads(A, beta=rule)), tp.velocity(x, tp.Heads(A, beta=0.05 * n)))
    assert_close(tp.velocity(x, tp.Heads(A, beta=lambda m: math.sqrt(m))), tp.velocity(x, tp.Heads(A, beta=n ** 0.5)))
    gam = torch.tensor([0.2, -0.3, 0.9], dtype=F64)
    sweep = tp.Heads(A, beta=tp.LogScaling(gam))
    assert tuple(sweep.batch_shape) == (3,)
    v = tp.velocity(x, sweep)
    for k in range(3):
        assert_close(v[k], tp.velocity(x, tp.Heads(A, beta=float(gam[k]) * math.log(n))))


def test_a_solve_resolves_the_rule_once_from_x0():
    """tp.simulate / tp.solve resolve β_n at n = x0.shape[-2]: the same trajectory and energies as the fixed β,
    for a constant head and for an OU process started from rule heads."""
    n = 12
    x, A, _, _, _ = _setup(F64, n=n, H=1)
    S = A + A.mT
    fixed = tp.simulate(x, tp.Heads(S, beta=0.8 * math.log(n)), t1=0.2, dt=0.05, ledger=True)
    ruled = tp.simulate(x, tp.Heads(S, beta=tp.LogScaling(0.8)), t1=0.2, dt=0.05, ledger=True)
    assert_close(ruled.x, fixed.x)
    assert_close(ruled.energy, fixed.energy)
    ou_f = tp.simulate(x, tp.OrnsteinUhlenbeck(tp.Heads(S, beta=0.8 * math.log(n))), t1=0.2, dt=0.05, seed=3)
    ou_r = tp.simulate(x, tp.OrnsteinUhlenbeck(tp.Heads(S, beta=tp.LogScaling(0.8))), t1=0.2, dt=0.05, seed=3)
    assert_close(ou_r.x, ou_f.x)
    # a rule needs tokens: the Eulerian JKO on grid weights has no n
    z = tp.sphere.circle_grid(16, dtype=F64)
    with pytest.raises(ValueError, match="rule of the context length"):
        tp.jko(None, tp.Heads.scalar([1.0], 2, beta=tp.LogScaling(1.0)).to(F64), tau=0.1, steps=1,
               scheme="eulerian", grid=z, grid_weights=torch.full((16,), 1 / 16, dtype=F64))


def test_unresolved_rules_and_bad_rules_are_refused():
    A = torch.eye(2, dtype=F64)[None]
    h = tp.Heads(A, beta=tp.LogScaling(1.0))
    with pytest.raises(ValueError, match="has not been resolved.*at_context"):
        h.beta
    with pytest.raises(ValueError, match="finite"):
        tp.Heads(A, beta=lambda n: float("nan")).at_context(5)
    with pytest.raises(ValueError, match="finite"):
        tp.Heads(A, beta=lambda n: torch.tensor([1.0, float("inf")], dtype=F64)).at_context(5)
    with pytest.raises(ValueError, match="n \\(the number of tokens\\)"):
        h.at_context(0)
    with pytest.raises(TypeError, match="gamma"):
        tp.LogScaling("1")
    with pytest.raises(TypeError, match="exponent"):
        tp.PowerScaling(1.0, float("inf"))
    with pytest.raises(TypeError, match="tensor parameter"):
        tp.Heads(A, beta=tp.LogScaling(torch.tensor([1.0, 2.0])))  # float32 γ for float64 heads
    with pytest.raises(TypeError, match="rule must be a callable"):
        tp.BetaRule(3.0)


# ---------------------------------------------------------------------------- β → 0: field and energy series
def _cov_series(x, A, V, w, om, beta, norm):
    """P_x Σ_h ω_h V_h [x̄ + β (C − x̄x̄ᵀ) A_hᵀ x] (softmax) or V_h [x̄ + β C A_hᵀ x] (unnormalised), C = Σ w y yᵀ."""
    xbar = (w[:, None] * x).sum(0)
    C = torch.einsum("j,jd,je->de", w, x, x)
    K = C - torch.outer(xbar, xbar) if norm == "softmax" else C
    first = torch.einsum("de,hfe,if->hid", K, A, x)  # K A_hᵀ x_i, (H, n, d)
    f = xbar + beta * first
    out = torch.einsum("h,hde,hie->id", om, V, f)
    return out - (out * x).sum(-1, keepdim=True) * x


@pytest.mark.parametrize("norm", ["softmax", "unnormalized"])
def test_field_beta_to_zero_against_its_series(norm):
    """V(0) is exactly the average field; |V(β) − series(β)| falls like β² for β → 0 of either sign."""
    x, A, V, w, om = _setup(F64)
    v0 = tp.velocity(x, tp.Heads(A, V, om, beta=0.0), w, norm)
    assert_close(v0, _cov_series(x, A, V, w, om, 0.0, norm), rtol=1e-13, atol=1e-14)
    errs = []
    for b in (1e-2, 5e-3, -5e-3, 2.5e-3):
        v = tp.velocity(x, tp.Heads(A, V, om, beta=b), w, norm)
        errs.append((abs(b), float((v - _cov_series(x, A, V, w, om, b, norm)).abs().max())))
    for (b1, e1), (b2, e2) in zip(errs, errs[1:]):
        assert e1 > 0 and e2 > 0
    # order 2: the error ratio between β = 1e-2 and 2.5e-3 is 16 (within 15 %)
    assert errs[0][1] / errs[3][1] == pytest.approx(16.0, rel=0.15)


def _moments(x, A, w, K):
    s = torch.einsum("id,hde,je->hij", x, A, x)
    ww = torch.outer(w, w)
    return [(ww * s ** k).sum((-1, -2)) for k in range(1, K + 1)]  # (H,) each


@pytest.mark.parametrize("dtype", DTYPES)
def test_centred_energy_against_its_series_and_the_reference_form(dtype):
    """E_c(β) = ½ Σ_h ω_h Σ_{k≤8} β^{k−1} M_k/k! for |β| ≤ 0.05; E − Σω/(2β) = E_c at β = 0.7 and −0.4 (log-sum-exp
    against pairwise expm1); E(0) = E_c(0) = ½ Σ_h ω_h M_1 (the finite part, no division by zero)."""
    x, A, _, w, om = _setup(dtype)
    S = A + A.mT
    M = _moments(x.double(), S.double(), w.double(), 8)
    tol = _tol(dtype)
    for b in (0.05, 1e-3, 1e-7, 0.0, -1e-4, -0.05):
        series = 0.5 * sum(om.double() * b ** (k - 1) * M[k - 1] / math.factorial(k) for k in range(1, 9)).sum()
        h = tp.Heads(S, None, om, beta=b)
        assert_close(tp.energy(x, h, w, centered=True).double(), series, **tol)
        if b == 0.0:
            assert_close(tp.energy(x, h, w).double(), series, **tol)  # the finite part
            assert_close(tp.head_energies(x, h, w).double(), 0.5 * M[0], **tol)
    for b in (0.7, -0.4):
        h = tp.Heads(S, None, om, beta=b)
        assert_close(tp.energy(x, h, w) - om.sum() / (2 * b), tp.energy(x, h, w, centered=True), **tol)
        assert_close(tp.head_energies(x, h, w) - 1 / (2 * b), tp.head_energies(x, h, w, centered=True), **tol)
    # uniform token weights (the other branch of the pairwise sum)
    Mu = _moments(x.double(), S.double(), torch.full((x.shape[0],), 1 / x.shape[0], dtype=F64), 8)
    for b in (0.02, 0.0):
        series = 0.5 * sum(om.double() * b ** (k - 1) * Mu[k - 1] / math.factorial(k) for k in range(1, 9)).sum()
        assert_close(tp.energy(x, tp.Heads(S, None, om, beta=b), centered=True).double(), series, **tol)
    # a β sweep through 0, with a common scale
    hb = tp.Heads(S.expand(3, *S.shape), None, om, beta=torch.tensor([0.5, 0.0, -0.5], dtype=dtype))
    E = tp.energy(x, hb, w)
    assert_close(E[1].double(), 0.5 * (om.double() * M[0]).sum(), **tol)
    assert_close(tp.energy(x, hb, w, log_scale=3.0), E * math.exp(-3.0), **tol)


def test_first_variation_and_solver_energies_at_beta_zero():
    """δE/δμ at β = 0 is the finite part Σ_h ω_h ⟨z, ½(A_h + A_hᵀ) x̄⟩ (= the limit of δE/δμ − Σω/β); a solve at β = 0
    and at β = −0.5 reports finite energies whose ledger closes at order 1 in dt (Euler)."""
    x, A, _, w, om = _setup(F64)
    h0 = tp.Heads(A, None, om, beta=0.0)
    xbar = (w[:, None] * x).sum(0)
    want = torch.einsum("h,id,hde,e->i", om, x, 0.5 * (A + A.mT), xbar)
    assert_close(tp.first_variation(x, h0, w), want)
    hs = tp.Heads(A, None, om, beta=1e-6)
    assert_close(tp.first_variation(x, hs, w) - om.sum() / 1e-6, want, rtol=0, atol=1e-5)  # + O(β) + O(eps/β)
    S = A + A.mT
    for b in (0.0, -0.5):
        res = []
        for dt in (0.02, 0.01):
            tr = tp.simulate(x, tp.Heads(S, None, om, beta=b), t1=0.4, dt=dt, weights=w, ledger=True)
            assert bool(torch.isfinite(tr.energy).all())
            res.append(abs(float(tr.ledger["residual"][-1])))
        assert res[0] / res[1] == pytest.approx(2.0, rel=0.25), (b, res)


# ---------------------------------------------------------------------------- synchronisation on the circle
def _circle(theta):
    return torch.stack([torch.cos(theta), torch.sin(theta)], -1)


def _energy_angles(theta, beta):
    """E(θ) = Σ_ij e^{β cos(θ_i − θ_j)}/(2β n²) (one head A = I), differentiable in θ."""
    c = torch.cos(theta[:, None] - theta[None, :])
    return torch.exp(beta * c).mean() / (2 * beta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_beta_one_synchronises_on_the_circle(dtype):
    """β = 1 (in (0, 1], synchronisation proved by Criscitiello et al.): 32 random starts of n = 8 tokens all
    reach one point (order parameter |x̄| > 1 − 1e-4) under the ascent flow."""
    g = gen(4)
    x0 = _circle(2 * math.pi * torch.rand(32, 8, generator=g, dtype=F64)).to(dtype)
    heads = tp.Heads.scalar(torch.ones(1, dtype=dtype), 2, beta=1.0)
    tr = tp.simulate(x0, heads, t1=60.0, dt=0.1, direction="ascent", diagnostics=False, record_every=600)
    R = tr.x[-1].mean(-2).norm(dim=-1)
    assert bool((R > 1 - 1e-4).all()), R.min()


@pytest.mark.parametrize("dtype", DTYPES)
def test_beta_minus_one_keeps_a_stable_triangle(dtype):
    """β = −1 < −2/3 on S¹: the equilateral triangle is a critical point whose Hessian (autograd of the dense
    energy) has, besides the rotation's zero, only negative eigenvalues (∝ β sin²(2π/3) − cos(2π/3) = 3β/4 + 1/2)
    — a strict local maximum of E, so the ascent flow from a perturbed triangle returns to it and never
    synchronises.  At β = −0.5 the same triangle is a local minimum along both directions (3β/4 + 1/2 > 0)."""
    th = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=F64)
    for beta, stable in ((-1.0, True), (-0.5, False)):
        Hm = torch.autograd.functional.hessian(lambda t: _energy_angles(t, beta), th)
        ev = torch.linalg.eigvalsh(Hm)
        # one zero eigenvalue (rotation); the other two have the sign that decides stability
        assert abs(float(ev.abs().min())) < 1e-12
        rest = ev[ev.abs() > 1e-10]
        assert bool((rest < 0).all()) == stable and bool((rest > 0).all()) == (not stable), (beta, ev)
    g = gen(7)
    pert = th + 0.05 * torch.randn(16, 3, generator=g, dtype=F64)  # inside the basin (0.15 can reach the sync state)
    heads = tp.Heads.scalar(torch.ones(1, dtype=dtype), 2, beta=-1.0)
    tr = tp.simulate(_circle(pert).to(dtype), heads, t1=80.0, dt=0.1, direction="ascent", diagnostics=False,
                     record_every=800)
    xf = tr.x[-1].double()
    gaps = torch.sort(torch.atan2(xf[..., 1], xf[..., 0]) % (2 * math.pi), -1).values.diff(dim=-1)
    assert_close(gaps, torch.full_like(gaps, 2 * math.pi / 3), atol=1e-3 if dtype == torch.float32 else 1e-6,
                 rtol=0)
    v = tp.velocity(tr.x[-1], heads)
    assert float(v.abs().max()) < (1e-3 if dtype == torch.float32 else 1e-8)


# ---------------------------------------------------------------------------- refusals
def test_refusals_where_the_closed_forms_need_positive_beta():
    x, A, _, w, om = _setup(F64)
    h = tp.Heads(A + A.mT, None, om, beta=-0.5)
    with pytest.raises(ValueError, match="log_energy needs β > 0"):
        tp.log_energy(x, h, w)
    with pytest.raises(ValueError, match="log_energy needs β > 0"):
        tp.log_energy(x, tp.Heads(A + A.mT, None, om, beta=0.0), w)
    with pytest.raises(ValueError, match="log_energy needs β > 0"):
        tp.log_energy(x, tp.Heads(A + A.mT, None, om, beta=torch.tensor([1.0, 0.0], dtype=F64)[:, None]), w)
    with pytest.raises(ValueError, match="increases without bound"):
        tp.theory.optimal_head_strength(-1.0, 8)
    with pytest.raises(ValueError, match="β > 0"):
        tp.theory.rate_inflection(0.0, 8)
    with pytest.raises(TypeError, match="centered must be True or False"):
        tp.energy(x, h, w, centered="yes")
    # accepted where the mathematics allows it
    assert math.isfinite(tp.theory.critical_temperature(-1.0, 2))
    assert tp.theory.critical_temperature(0.0, 2) == pytest.approx(0.5, rel=1e-12)  # λ/d at β = 0
    assert tp.theory.early_rate(1.0, -1.0, 5) == pytest.approx(2 / (math.exp(-1.0) + 4))
    assert tp.theory.early_rate(1.0, tp.LogScaling(0.5), 5) == pytest.approx(2 / (math.exp(0.5 * math.log(5)) + 4))


def test_jko_runs_at_beta_zero_and_below():
    """The Lagrangian JKO (descent) lowers E step by step at β = 0 (its finite part) and β = −0.5, and its energy
    is tp.energy at the final tokens; the Eulerian JKO (ascent, unit mobility) raises it."""
    x = tp.sphere.sample_uniform(8, 3, generator=gen(0), dtype=F64)
    for b in (0.0, -0.5):
        h = tp.Heads.scalar(torch.ones(1, dtype=F64), 3, beta=b)
        tr = tp.jko(x, h, tau=0.1, steps=4, transport="identity", direction="descent")
        assert bool(torch.isfinite(tr.energy).all()) and bool((tr.energy.diff() < 0).all()), (b, tr.energy)
        assert_close(tr.energy[-1], tp.energy(tr.x[-1], h))
        z = tp.sphere.circle_grid(32, dtype=F64)
        q = 1 + 0.3 * torch.cos(torch.atan2(z[:, 1], z[:, 0]))
        h2 = tp.Heads.scalar(torch.ones(1, dtype=F64), 2, beta=b)
        tr = tp.jko(None, h2, tau=0.1, steps=3, scheme="eulerian", grid=z, grid_weights=q / q.sum(),
                    direction="ascent", mobility="unit", eps=0.02)
        assert bool(torch.isfinite(tr.energy).all()) and bool((tr.energy.diff() > 0).all()), (b, tr.energy)


def test_negative_beta_overflow_is_reported_and_bounds_use_its_magnitude():
    """β = −200 on antipodal tokens overflows float32 through e^{β⟨x, y⟩} = e^{200}: tp.energy raises an
    OverflowError naming the logarithm (|E|) instead of returning inf; the Lipschitz constants of the theory use
    |β| (β = −0.5 gives those of β = 0.5)."""
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    with pytest.raises(OverflowError, match="logarithm is up to"):
        tp.energy(x, tp.Heads.scalar([1.0], 2, beta=-200.0))
    h = tp.Heads.random(2, 3, generator=gen(1), dtype=F64)
    for key in ("space", "measure"):
        assert_close(tp.theory.lipschitz_constants(h.replace(beta=-0.5))[key],
                     tp.theory.lipschitz_constants(h.replace(beta=0.5))[key])


def test_diagnostics_of_non_symmetric_heads_at_beta_zero():
    """Non-symmetric heads at β = 0 (the one-block kernel declines there): 𝒟 and 𝒢² are the limits of β = ±1e-7,
    and the energy is the finite part ½ Σ_h ω_h Σ_ij w_i w_j ⟨x_i, A_h x_j⟩."""
    x, A, V, w, om = _setup(F64)
    h0 = tp.Heads(A, None, om, beta=0.0)
    for f in (tp.dissipation, tp.slope):
        lim = 0.5 * (f(x, tp.Heads(A, None, om, beta=1e-7), w) + f(x, tp.Heads(A, None, om, beta=-1e-7), w))
        assert_close(f(x, h0, w), lim, rtol=1e-9, atol=1e-12)
    from transformer_pde.model.field import evaluate
    E = evaluate(x, h0, w, diagnostics=True).energy
    M1 = _moments(x, A, w, 1)[0]
    assert_close(E, 0.5 * (om * M1).sum())
    assert_close(evaluate(x, h0, w, diagnostics=True, log_scale=2.0).energy, 0.5 * (om * M1).sum() * math.exp(-2.0))
    # queries against other keys (a shard of the tokens): Σ_i w_i ⟨x_i, A_h ȳ⟩ with ȳ the mean of the keys
    keys = tp.sphere.sample_uniform(5, 3, generator=gen(9), dtype=F64)
    kw = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=F64)
    Ek = evaluate(x, h0, w, diagnostics=True, keys=keys, key_weights=kw).energy
    want = 0.5 * torch.einsum("h,i,id,hde,e->", om, w, x, A, (kw[:, None] * keys).sum(0))
    assert_close(Ek, want)


def test_theory_functions_at_beta_zero_and_below():
    """critical_temperature at β = 0 is the β → 0 limit Σ ω λ/d for softmax, unnormalised and effective heads;
    late_rate and linearized_clustering_time of ReLU heads use ReLU(βλ) (β < 0 turns the positive heads off);
    the flat head energies at β = 0 are their finite part."""
    for norm in ("softmax", "unnormalized", "effective"):
        t0 = tp.theory.critical_temperature(0.0, 3, lambdas=(1.0, 2.0), normalization=norm)
        assert t0 == pytest.approx(tp.theory.critical_temperature(1e-7, 3, lambdas=(1.0, 2.0), normalization=norm),
                                   rel=1e-6)
        assert t0 == pytest.approx(1.5 / 3, rel=1e-12)
    lam = [1.0, -2.0]
    assert float(tp.theory.late_rate(lam, beta=-0.5, normalization="relu")) == pytest.approx(-2.0 * 1.0)
    assert float(tp.theory.late_rate(lam, beta=0.5, normalization="relu")) == pytest.approx(0.5)
    t = tp.theory.linearized_clustering_time([1.0, 2.0], beta=-1.0, n=8, gamma0=0.1, target=0.5,
                                             normalization="relu")
    assert t == math.inf  # ReLU(βλ) = 0 for every head: no growth
    t = tp.theory.linearized_clustering_time([-1.0, 2.0], beta=-1.0, n=8, gamma0=0.1, target=0.5,
                                             normalization="relu")
    assert t == math.inf  # Σ λ ReLU(βλ) = λ²β < 0 for the only active head: the overlap does not grow
    t = tp.theory.linearized_clustering_time([-1.0, 2.0], beta=0.5, n=8, gamma0=0.1, target=0.5, normalization="relu")
    assert t == pytest.approx(8 * math.log(5) / (2 * 2.0 * 1.0))  # β > 0: Σ λ ReLU(βλ) = 2 · 1
    x, A, _, w, _ = _setup(F64)
    from transformer_pde.analysis.theory.particles import flat_head_energies
    assert_close(flat_head_energies(x, tp.Heads(A, beta=0.0), w), 0.5 * _moments(x, A, w, 1)[0])
