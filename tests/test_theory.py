"""Pendharkar's multi-head theory: closed forms (tp.theory) against the full particle system
and finite differences (tp.diagnostics), identities on random configurations, and their failure when
the hypotheses are broken."""

import math

import pytest
import scipy.special
import torch
from conftest import gen
from problems import equiangular_gamma_rate, fit_slope

import transformer_pde as tp
from transformer_pde import diagnostics as dg
from transformer_pde import theory as th

F64 = torch.float64


def ones(H, dtype=F64):
    return torch.ones(H, dtype=dtype)


def offdiag(n):
    return ~torch.eye(n, dtype=torch.bool)


def fd(fun, eps):
    """Central difference of fun(s) at s = 0: error O(eps²) (smooth fun) + O(rounding/eps)."""
    return (fun(eps) - fun(-eps)) / (2 * eps)


# ============================================================================ item 3: radial dominance, β*
def test_critical_cosine_is_the_root_and_golden_ratio():
    for H in range(1, 9):
        c = th.critical_cosine(H)
        assert 0 < c <= 1
        assert abs(c * c + (H - 1) * c - 1) < 1e-14
        assert abs(th.critical_cosine(H, form="pairwise") - H ** -0.5) < 1e-15
    assert abs(th.critical_cosine(2) - 2 / (1 + math.sqrt(5))) < 1e-15
    assert th.critical_beta(1, 10) == math.inf


@pytest.mark.parametrize("H", [1, 2, 3, 4, 5])
def test_critical_beta_matches_the_particle_margin(H):
    # Thresholds are located by bisection (relative tolerance 1e-12) on the margin computed from the
    # library's softmax field; the margin crosses zero transversally, so the located root agrees
    # with the closed form to ~1e-12 relative.  1e-9 leaves room for rounding in the margins.
    alpha = 1.3
    for n in (3, 5, 10, 20, 50):
        num = dg.radial_dominance_threshold(n, [alpha] * H)
        cf = th.critical_beta(H, n, alpha)
        assert num.shape == (H,)
        assert torch.equal(num, num[:1].expand(H))  # equal heads, one threshold
        if H == 1:
            assert cf == math.inf and float(num[0]) == math.inf
        elif cf <= 0:  # already radially dominated at β → 0⁺
            assert float(num[0]) == -math.inf
        else:
            assert abs(float(num[0]) / cf - 1) < 1e-9, (H, n, float(num[0]), cf)


def test_pairwise_margin_has_a_different_threshold():
    # the pairwise form changes sign at cos²∠(x, f) = 1/H: β = (1/2α) ln((n−1)/(H−1)), not at β*
    for H, n in ((2, 10), (3, 20), (4, 50)):
        num = float(dg.radial_dominance_threshold(n, [1.0] * H, form="pairwise")[0])
        expected = 0.5 * math.log((n - 1) / (H - 1))
        assert abs(num / expected - 1) < 1e-9
        assert abs(th.critical_beta(H, n, form="pairwise") / expected - 1) < 1e-14
        assert abs(num - th.critical_beta(H, n)) > 0.05


def test_critical_beta_equiangular_extension_and_shift():
    # γ > 0: the γ = 0 formula no longer holds; the extended closed form does
    for gamma in (0.02, 0.1):
        for H, n in ((2, 20), (3, 50)):
            num = float(dg.radial_dominance_threshold(n, [1.0] * H, gamma=gamma)[0])
            ext = th.critical_beta(H, n, gamma=gamma)
            assert abs(num / ext - 1) < 1e-9
            assert abs(num / th.critical_beta(H, n) - 1) > 0.02  # the idealised formula is off
    # the margin's cosine closed form against the particle field
    n, a, b, g = 7, 0.8, 1.7, 0.15
    x = tp.sphere.equiangular(n, g, n, dtype=F64)
    f = tp.head_outputs(x, tp.Heads.scalar(torch.tensor([a], dtype=F64), n, beta=b))[0]
    cos = (f * x).sum(-1) / f.norm(dim=-1)
    torch.testing.assert_close(cos, torch.full_like(cos, th.equiangular_cosine(g, a, b, n)), rtol=1e-13, atol=0)


def test_margin_sign_around_beta_star_float32():
    H, n, alpha = 2, 10, 1.0
    b = th.critical_beta(H, n, alpha)
    x = torch.eye(n, dtype=torch.float32)
    for factor, sign in ((0.95, 1), (1.05, -1)):
        heads = tp.Heads.scalar(torch.full((H,), alpha), n, beta=factor * b, weights=ones(H, torch.float32))
        m = dg.radial_dominance_margin(x, heads)
        assert m.dtype == torch.float32 and m.shape == (H, n)
        assert bool((sign * m > 0).all())


# ============================================================================ item 4: rates
def test_lambert_w_against_scipy(dtype):
    z = torch.cat([torch.zeros(1), torch.logspace(-8, 6, 200)]).to(dtype)
    w = th.lambert_w(z)
    assert w.dtype == dtype
    ref = torch.as_tensor(scipy.special.lambertw(z.double().numpy()).real, dtype=dtype)
    tol = 1e-13 if dtype == F64 else 2e-6
    torch.testing.assert_close(w, ref, rtol=tol, atol=tol)


def test_optimal_head_strength_is_the_maximiser():
    for beta, n in ((1.0, 2), (1.0, 8), (0.5, 32), (3.0, 128)):
        ls, ps = th.optimal_head_strength(beta, n)
        lam = torch.tensor(ls, dtype=F64, requires_grad=True)
        phi = th.early_rate(lam, beta, n)
        (g,) = torch.autograd.grad(phi, lam)
        assert abs(float(g)) < 1e-12  # stationary (autograd, independent of the Lambert-W algebra)
        assert abs(float(phi.detach()) - ps) < 1e-14
        grid = torch.linspace(1e-3, 20 / beta, 20001, dtype=F64)
        assert float(th.early_rate(grid, beta, n).max()) <= ps + 1e-15


def test_rate_inflection_separates_concave_and_convex():
    for beta, n in ((1.0, 2), (1.0, 8), (2.0, 100)):
        lc = th.rate_inflection(beta, n)

        def second(l):
            lam = torch.tensor(l, dtype=F64, requires_grad=True)
            (g,) = torch.autograd.grad(th.early_rate(lam, beta, n), lam, create_graph=True)
            (h,) = torch.autograd.grad(g, lam)
            return float(h)

        assert second(lc * 0.99) < 0 < second(lc * 1.01)
        assert abs(second(lc)) < 1e-10


def test_reduced_field_against_independent_formula():
    # problems.equiangular_gamma_rate is written independently from the same derivation
    lam = [0.3, 1.1, 2.0]
    for norm in th.REDUCED_NORMALIZATIONS:
        for n in (2, 5, 40):
            for g in (-0.5 / (n - 1), 0.0, 0.3, 0.9):
                ours = th.gamma_velocity(g, lam, beta=1.4, n=n, normalization=norm)
                ref = equiangular_gamma_rate(g, lam, [1.0] * 3, n, 1.4, norm)
                assert abs(ours - ref) <= 1e-13 * max(1.0, abs(ref))
    assert th.gamma_velocity(0.3, lam, n=5, direction="descent") == -th.gamma_velocity(0.3, lam, n=5)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_gamma_ode_matches_equiangular_particles(normalization):
    # RK4 on the particles has global error C·dt⁴; at dt = 0.025 over t ≤ 2 it is ≤ 5e-7 here (the
    # order is asserted below for softmax), so 2e-6 separates agreement from any model mismatch.
    n, lam, g0 = 5, [0.5, 1.5], 0.05
    x0 = tp.sphere.equiangular(n, g0, n, dtype=F64)
    heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, weights=ones(2))
    tr = tp.simulate(x0, heads, t1=2.0, dt=0.025, method="rk4", normalization=normalization, direction="ascent",
                     diagnostics=False, record_every=8)
    G = (tr.x @ tr.x.transpose(-1, -2))[:, offdiag(n)]
    g, gap = th.gamma_ode(tr.times, lam, n=n, gamma0=g0, normalization=normalization)
    assert float((G - g[:, None]).abs().max()) < 2e-6
    assert float((G.amax(-1) - G.amin(-1)).max()) < 1e-12  # the flow keeps tokens equiangular
    torch.testing.assert_close(gap, 1 - g, rtol=1e-9, atol=1e-15)


def test_gamma_ode_is_the_particle_limit_at_order_four():
    n, lam, g0 = 5, [0.5, 1.5], 0.05
    x0 = tp.sphere.equiangular(n, g0, n, dtype=F64)
    heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, weights=ones(2))
    errs, steps = [], [0.2, 0.1]
    for h in steps:
        tr = tp.simulate(x0, heads, t1=2.0, dt=h, method="rk4", direction="ascent", diagnostics=False,
                         record_every=round(0.2 / h))
        g, _ = th.gamma_ode(tr.times, lam, n=n, gamma0=g0)
        errs.append(float(((tr.x @ tr.x.transpose(-1, -2))[:, offdiag(n)] - g[:, None]).abs().max()))
    assert 3.5 < fit_slope(steps, errs) < 4.5


def test_early_rate_is_the_particle_slope_at_orthogonal_tokens():
    n = 7
    x = torch.eye(n, dtype=F64)
    for lam in ([1.0], [0.5, 1.5], [0.2, 2.0, 4.0]):
        for beta in (0.5, 2.0):
            heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, beta=beta, weights=ones(len(lam)))
            for norm in th.REDUCED_NORMALIZATIONS:
                V = tp.velocity(x, heads, normalization=norm)
                slope = (V @ x.T + x @ V.T)[offdiag(n)]
                expected = th.gamma_velocity(0.0, lam, beta=beta, n=n, normalization=norm)
                torch.testing.assert_close(slope, torch.full_like(slope, expected), rtol=1e-13, atol=1e-15)
            phi = float(th.early_rate(torch.tensor(lam, dtype=F64), beta, n).sum())
            assert abs(th.gamma_velocity(0.0, lam, beta=beta, n=n) - phi) < 1e-15


def test_late_rate_from_the_particle_system():
    # 1 − γ ~ C e^{−2Λt}, Λ = Σλ_h (softmax); corrections are O(1 − γ), so over a window where
    # 1 − γ < 1e-5 the fitted slope matches −2Λ to ~1e-4 relative.  1 − γ = ‖x_i − x_j‖²/2 stays
    # accurate far below the float64 resolution of ⟨x_i, x_j⟩.
    n, lam = 4, [0.5, 1.5]
    x0 = tp.sphere.equiangular(n, 0.1, n, dtype=F64)
    heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, weights=ones(2))
    tr = tp.simulate(x0, heads, t1=8.0, dt=0.04, method="rk4", direction="ascent", diagnostics=False, record_every=5)
    _, gap = dg.mean_overlap(tr.x)
    sel = (gap < 1e-5) & (gap > 1e-14)
    assert int(sel.sum()) >= 5
    t, lg = tr.times[sel], gap[sel].log()
    slope = float(((t - t.mean()) * (lg - lg.mean())).sum() / ((t - t.mean()) ** 2).sum())
    Lam = float(th.late_rate(lam))
    assert abs(slope / (-2 * Lam) - 1) < 1e-3
    # the reduced ODE resolves the same gap
    _, gap_ode = th.gamma_ode(tr.times, lam, n=n, gamma0=0.1)
    assert float(((gap - gap_ode).abs() / gap_ode)[tr.times > 2].max()) < 1e-4
    torch.testing.assert_close(th.late_rate(lam, 2.0, normalization="unnormalized"),
                               torch.tensor(0.5 * math.exp(1.0) + 1.5 * math.exp(3.0), dtype=F64))
    torch.testing.assert_close(th.late_rate(lam, 2.0, normalization="relu"), torch.tensor(2.0 * 2.5, dtype=F64))


def test_hitting_time_quadrature_agrees_with_the_ode():
    for norm, g0 in (("softmax", 0.0), ("unnormalized", -0.1), ("relu", 0.02)):
        lam, n, target = [0.7, 1.3], 6, 0.6
        T = th.hitting_time(lam, n=n, gamma0=g0, target=target, normalization=norm)
        g, _ = th.gamma_ode(torch.tensor([0.0, T], dtype=F64), lam, n=n, gamma0=g0, normalization=norm)
        assert abs(float(g[-1]) - target) < 1e-8
    # descent/negative strengths never reach a larger overlap
    assert th.hitting_time([-1.0], n=4, gamma0=0.0, target=0.5) == math.inf


def test_linearized_times_limits_and_scaling():
    # the linearisation is the small-γ limit: relative error → 0 linearly in the target overlap
    lam, beta, n = [1.0], 1.0, 16
    errs = {}
    for norm in ("softmax", "relu"):
        targets = [1e-3, 1e-4]
        e = []
        for tg in targets:
            g0 = 0.0 if norm == "softmax" else tg / 50  # ReLU: fixed ratio target/γ0, so only γ* shrinks
            lin = th.linearized_clustering_time(lam, beta=beta, n=n, gamma0=g0, target=tg, normalization=norm)
            full = th.hitting_time(lam, beta=beta, n=n, gamma0=g0, target=tg, normalization=norm)
            e.append(abs(full / lin - 1))
        errs[norm] = e
        assert e[1] < e[0] < 10 * n * targets[0]
        assert 0.8 < fit_slope(targets, e) < 1.2
    # Θ(n) (softmax) and Θ(n log d) (relu), checked against the formulas written out here
    for n in (8, 64):
        for d in (16, 4096):
            g0 = 1 / math.sqrt(d)
            relu = th.linearized_clustering_time([2.0], beta=0.5, n=n, gamma0=g0, target=0.5, normalization="relu")
            assert abs(relu - n * math.log(0.5 * math.sqrt(d)) / (2 * 0.5 * 4.0)) < 1e-12 * relu
            soft = th.linearized_clustering_time([2.0], beta=0.5, n=n, gamma0=0.0, target=0.5)
            assert abs(soft - 0.5 * (math.exp(1.0) + n - 1) / 4.0) < 1e-12 * soft


def test_superadditivity_jensen_regimes_on_the_particle_field():
    n, beta = 8, 1.0
    lc = th.rate_inflection(beta, n)
    x = torch.eye(n, dtype=F64)

    def particle_rate(lam):
        heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, beta=beta, weights=ones(len(lam)))
        V = tp.velocity(x, heads)
        return float((V @ x.T + x @ V.T)[offdiag(n)].mean())

    for lam, regime, sign in (([lc + 1, lc + 5], "convex", 1), ([0.2, 1.5], "concave", -1)):
        r = th.superadditivity(lam, beta=beta, n=n)
        assert r["regime"] == regime
        assert sign * r["gain"] > 0
        Lh = sum(lam) / 2
        measured = particle_rate(lam) - particle_rate([Lh, Lh])
        assert abs(measured - r["gain"]) < 1e-13
        # merged single head of the same total strength
        assert abs(particle_rate([sum(lam)]) - r["merged"]) < 1e-13
    mixed = th.superadditivity([0.5, lc + 2], beta=beta, n=n)
    assert mixed["regime"] == "mixed"
    # heterogeneous convex heads also cluster faster in time (reduced ODE, validated against particles above)
    het = th.hitting_time([12.0, 4.0], n=n, gamma0=0.0, target=0.05)
    eq = th.hitting_time([8.0, 8.0], n=n, gamma0=0.0, target=0.05)
    assert het < 0.2 * eq


# ============================================================================ items 1–2: energies
def _random_setup(seed, n=9, d=4, H=3, dtype=F64, omega=None):
    g = gen(seed)
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    w = omega if omega is not None else ones(H, dtype)
    heads = tp.Heads.random(H, d, generator=g, scale=0.4, weights=w, dtype=dtype)
    return x, heads, g


def test_energy_identity_sphere_and_flat(dtype):
    x, heads, g = _random_setup(1, dtype=dtype)
    tol = 1e-12 if dtype == F64 else 2e-5
    for flat in (False, True):
        eb = dg.energy_balance(x, heads, flat=flat)
        torch.testing.assert_close(eb.rate, eb.kinetic, rtol=tol, atol=tol)
        assert abs(float(eb.defect)) <= tol * float(eb.kinetic)
        assert float(eb.bound) <= tol  # A = Aᵀ and V = A: the bound vanishes
    # independent oracle: central differences of the energy along the motion (float64)
    x, heads, _ = _random_setup(2, omega=torch.tensor([1.0, 0.3, 2.0], dtype=F64))
    v = tp.velocity(x, heads, normalization="unnormalized")
    rate = fd(lambda s: tp.energy(tp.sphere.normalize(x + s * v), heads), 1e-5)
    eb = dg.energy_balance(x, heads)
    assert abs(float(rate - eb.kinetic)) < 1e-8 * float(eb.kinetic)  # O(ε²) = 1e-10 relative
    vf = dg.flat_velocity(x, heads)
    Ef = lambda s: (heads.weights * dg.flat_head_energies(x + s * vf, heads)).sum()  # noqa: E731
    ebf = dg.energy_balance(x, heads, flat=True)
    assert abs(float(fd(Ef, 1e-5) - ebf.kinetic)) < 1e-8 * float(ebf.kinetic)
    # descent: dE/dt = −Σ w‖ẋ‖²
    ebd = dg.energy_balance(x, heads, direction="descent")
    torch.testing.assert_close(ebd.rate, -ebd.kinetic, rtol=1e-12, atol=0)


def test_energy_defect_when_symmetry_or_value_alignment_breaks():
    x, heads, g = _random_setup(5, n=10, d=3, H=2)
    A = heads.score_matrix
    K = torch.randn(2, 3, 3, generator=g, dtype=F64)
    K = K - K.transpose(-1, -2)
    N = torch.randn(2, 3, 3, generator=g, dtype=F64)
    for make in (lambda e: tp.Heads(A + e * K, None, ones(2)), lambda e: tp.Heads(A, A + e * N, ones(2))):
        eps, defects = [1e-3, 1e-2], []
        for e in eps:
            h = make(e)
            for flat in (False, True):
                eb = dg.energy_balance(x, h, flat=flat)
                assert abs(float(eb.defect)) <= float(eb.bound)
            eb = dg.energy_balance(x, h)
            # the exact rate is the derivative of the energy along the motion (finite differences)
            v = tp.velocity(x, h, normalization="unnormalized")
            rate = fd(lambda s: tp.energy(tp.sphere.normalize(x + s * v), h), 1e-5)
            assert abs(float(rate - eb.rate)) < 1e-8 * float(eb.kinetic)
            defects.append(abs(float(eb.defect)))
        assert defects[0] > 1e-4  # monotonicity identity fails ...
        assert 0.9 < fit_slope(eps, defects) < 1.1  # ... at first order in the perturbation


def test_energy_monotone_along_the_sphere_and_flat_runs():
    x, heads, _ = _random_setup(3, n=12, d=3, H=2)
    tr = tp.simulate(x, heads, t1=1.0, dt=0.02, method="rk4", normalization="unnormalized", direction="ascent")
    assert float((tr.energy[1:] - tr.energy[:-1]).min()) > 0
    kin = dg.energy_balance(tr.x, heads).kinetic
    ft = dg.flat_flow(x, heads, t1=0.02, dt=0.0005)
    assert float((ft.energy[1:] - ft.energy[:-1]).min()) > 0
    assert float(ft.norms[-1]) > 1.0  # tokens left the sphere
    for t, E, K in ((tr.times, tr.energy, kin), (ft.times, ft.energy, ft.kinetic)):
        # E(t) − E(0) = ∫ kinetic; trapezoid on the step grid: error O(dt²) ≪ 1e-3 of the gain
        dtk = (t[1:] - t[:-1]).to(E.dtype)
        integral = torch.cumsum(0.5 * dtk * (K[1:] + K[:-1]), 0)
        assert float((E[1:] - E[0] - integral).abs().max()) < 1e-3 * float(E[-1] - E[0])


def test_head_energy_rates_and_radial_decomposition():
    g = gen(7)
    n, d, H = 8, 4, 3
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) + 0.2
    w = w / w.sum()
    general = tp.Heads(torch.randn(H, d, d, generator=g, dtype=F64) * 0.5,
                       torch.randn(H, d, d, generator=g, dtype=F64) * 0.5,
                       torch.tensor([1.0, 0.5, 2.0], dtype=F64))
    sym = tp.Heads.random(H, d, generator=g, scale=0.4, weights=torch.tensor([1.0, 0.5, 2.0], dtype=F64), dtype=F64)
    for heads in (general, sym):
        for norm in ("unnormalized", "softmax"):
            v = tp.velocity(x, heads, w, normalization=norm)
            ours = dg.head_energy_rates(x, heads, w, normalization=norm)
            ref = fd(lambda s: tp.head_energies(tp.sphere.normalize(x + s * v), heads, w), 1e-5)
            torch.testing.assert_close(ours, ref, rtol=1e-8, atol=1e-10)
            vf = dg.flat_velocity(x, heads, w, normalization=norm)
            ours_f = dg.head_energy_rates(x, heads, w, normalization=norm, flat=True)
            ref_f = fd(lambda s: dg.flat_head_energies(x + s * vf, heads, w), 1e-5)
            torch.testing.assert_close(ours_f, ref_f, rtol=1e-8, atol=1e-10)
            rd = dg.radial_decomposition(x, heads, w, normalization=norm)
            torch.testing.assert_close(rd.sphere_rates, ours, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(rd.flat_rates, ours_f, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close((rd.token_rates * w).sum(-1), rd.sphere_rates, rtol=1e-12, atol=1e-14)
    # unnormalized tied symmetric heads: G_h = f_h, shadows agree with tp.radial_shadows, tangential ≥ 0
    rd = dg.radial_decomposition(x, sym, w)
    torch.testing.assert_close(rd.shadows, tp.radial_shadows(x, sym, w), rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(rd.grad_shadows, rd.shadows, rtol=1e-13, atol=1e-14)
    f = tp.head_outputs(x, sym, w, normalization="unnormalized")
    Pf2 = (f - (f * x).sum(-1, keepdim=True) * x).square().sum(-1)
    torch.testing.assert_close(rd.tangential, sym.weights * (Pf2 * w).sum(-1), rtol=1e-12, atol=1e-14)


def test_orthogonal_heads_per_head_energy_falls_on_the_sphere_not_in_flat_space():
    n = 16
    g = gen(3)
    th0 = math.radians(60)
    x = tp.sphere.normalize(torch.tensor([math.cos(th0), math.sin(th0)], dtype=F64)
                            + 0.1 * torch.randn(n, 2, generator=g, dtype=F64))
    A = torch.zeros(2, 2, 2, dtype=F64)
    A[0, 0, 0] = A[1, 1, 1] = 1.0
    heads = tp.Heads.symmetric(A, weights=ones(2))
    assert float(dg.orthogonality_defect(heads).max()) == 0.0
    rd = dg.radial_decomposition(x, heads)
    assert float(rd.coupling[0, 1]) == 0.0 and float(rd.coupling[1, 0]) == 0.0  # exactly orthogonal
    assert float(rd.shadow[0, 1]) > 0  # ... but the radial shadows still couple the heads
    assert float(rd.sphere_rates[0]) < 0 < float(rd.flat_rates[0])
    # along both dynamics (independently of the decomposition)
    tr = tp.simulate(x, heads, t1=0.5, dt=0.01, method="rk4", normalization="unnormalized", direction="ascent")
    E1 = tp.head_energies(tr.x, heads)[:, 0]
    assert float((E1[1:] - E1[:-1]).max()) < 0
    ft = dg.flat_flow(x, heads, t1=0.05, dt=0.001)
    assert float((ft.head_energies[1:, 0] - ft.head_energies[:-1, 0]).min()) > 0
    # per-token: with orthogonal heads the pairwise margin is the exact contribution, the token form a lower bound
    pair = dg.radial_dominance_margin(x, heads, normalization="unnormalized", form="pairwise")
    tok = dg.radial_dominance_margin(x, heads, normalization="unnormalized", form="token")
    torch.testing.assert_close(rd.token_rates, pair, rtol=1e-12, atol=1e-14)
    assert bool((tok <= pair + 1e-14).all())
    # breaking orthogonality brings back a cross coupling
    R = torch.tensor([[math.cos(0.3), -math.sin(0.3)], [math.sin(0.3), math.cos(0.3)]], dtype=F64)
    A2 = A.clone()
    A2[1] = R @ A[1] @ R.T
    rd2 = dg.radial_decomposition(x, tp.Heads.symmetric(A2, weights=ones(2)))
    assert abs(float(rd2.coupling[0, 1])) > 1e-3


# ============================================================================ item 6: entropy
def test_entropy_identity_on_random_configurations(dtype):
    g = gen(11)
    B, n, d, H = 3, 7, 4, 3
    x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=g, dtype=F64)
    A = torch.randn(B, H, d, d, generator=g, dtype=F64)
    V = torch.randn(B, H, d, d, generator=g, dtype=F64)
    Ad = torch.randn(B, H, d, d, generator=g, dtype=F64)
    om = torch.rand(B, H, generator=g, dtype=F64)
    w = torch.rand(B, n, generator=g, dtype=F64) + 0.1
    w[0, 2] = 0.0  # a token with zero weight
    w = w / w.sum(-1, keepdim=True)
    x, A, V, Ad, om, w = (t.to(dtype) for t in (x, A, V, Ad, om, w))
    heads = tp.Heads(A, V, om)
    xd = tp.velocity(x, heads, w)
    ours = dg.entropy_rate(x, heads, w, velocity=xd, score_rate=Ad)
    assert ours.shape == (B, H, n) and ours.dtype == dtype

    def H_of(s):
        return dg.attention_entropy(tp.sphere.normalize(x + s * xd), tp.Heads(A + s * Ad, V, om), w)

    # autograd directional derivative (exact to rounding) as the oracle
    s0 = torch.zeros((), dtype=dtype, requires_grad=True)
    (jac,) = torch.autograd.grad(H_of(s0).sum(), s0)  # sum over entries: check the total first
    tol = 1e-10 if dtype == F64 else 2e-4
    assert abs(float(jac) - float(ours.sum())) < tol * max(1.0, float(ours.abs().sum()))
    if dtype == F64:
        # entrywise against central differences: O(ε²) ≈ 1e-10 plus rounding 1e-16/ε
        torch.testing.assert_close(ours, fd(H_of, 1e-5), rtol=1e-7, atol=1e-8)
    # default velocity = the library's field
    torch.testing.assert_close(dg.entropy_rate(x, heads, w), dg.entropy_rate(x, heads, w, velocity=xd))


def test_entropy_rises_monotonically_to_log_n_for_equiangular_tokens():
    n, lam, beta = 6, 1.0, 2.0
    x0 = torch.eye(n, dtype=F64)
    heads = tp.Heads.scalar(torch.tensor([lam], dtype=F64), n, beta=beta, weights=ones(1))
    tr = tp.simulate(x0, heads, t1=6.0, dt=0.05, method="rk4", direction="ascent", diagnostics=False, record_every=2)
    Ht = dg.attention_entropy(tr.x, heads)[:, 0]
    assert float((Ht.amax(-1) - Ht.amin(-1)).max()) < 1e-12
    Hm = Ht.mean(-1)
    assert float((Hm[1:] - Hm[:-1]).min()) > 0
    assert float(dg.entropy_rate(tr.x, heads).min()) > 0
    assert 0 < math.log(n) - float(Hm[-1]) < 1e-4
    gbar, _ = dg.mean_overlap(tr.x)
    torch.testing.assert_close(Hm, th.equiangular_entropy(gbar, lam, beta, n), rtol=1e-12, atol=1e-13)
    assert abs(th.equiangular_entropy(1.0 - 1e-15, lam, beta, n) - math.log(n)) < 1e-12
    # ... and falls when the heads repel (descent): the monotone rise needs clustering
    tr2 = tp.simulate(tp.sphere.equiangular(n, 0.5, n, dtype=F64), heads, t1=1.0, dt=0.05, method="rk4",
                      direction="descent", diagnostics=False)
    H2 = dg.attention_entropy(tr2.x, heads)[:, 0].mean(-1)
    assert float((H2[1:] - H2[:-1]).max()) < 0


# ============================================================================ item 7: approximate orthogonality
def test_approximately_orthogonal_heads_and_coupling_bound():
    g = gen(13)
    for angle in (70.0, 80.0, 90.0):
        heads = dg.approximately_orthogonal_heads(3, 2, angle, alpha=1.5, dtype=F64)
        delta = dg.orthogonality_defect(heads)
        off = offdiag(3)
        expected = 1.5 ** 2 * math.cos(math.radians(angle))
        torch.testing.assert_close(delta[off], torch.full((6,), expected, dtype=F64), rtol=1e-12, atol=1e-14)
        ang = torch.rad2deg(dg.principal_angles(heads.score_matrix[0], heads.score_matrix[2]))
        torch.testing.assert_close(ang, torch.full((2,), angle, dtype=F64), rtol=0, atol=1e-6)
        x = tp.sphere.normalize(torch.ones(heads.dim, dtype=F64)
                                + 0.5 * torch.randn(10, heads.dim, generator=g, dtype=F64))
        for norm in ("unnormalized", "softmax", "relu"):
            c, b = dg.cross_head_coupling(x, heads, normalization=norm)
            assert bool((c.abs() <= b * (1 + 1e-12) + 1e-15).all())
        rd = dg.radial_decomposition(x, heads)
        assert bool((dg.robust_margin(x, heads) <= rd.token_rates + 1e-12).all())
        assert bool((dg.robust_margin(x, heads, flat=True) <= rd.flat_token_rates + 1e-12).all())
        if angle == 90.0:  # exact orthogonality: the robust margin is the exact pairwise margin
            pair = dg.radial_dominance_margin(x, heads, normalization="unnormalized", form="pairwise")
            torch.testing.assert_close(dg.robust_margin(x, heads), pair, rtol=1e-12, atol=1e-14)
    # principal angles of two lines at a known angle
    a = torch.tensor([[1.0], [0.0], [0.0]], dtype=F64)
    b = torch.tensor([[math.cos(0.4)], [math.sin(0.4)], [0.0]], dtype=F64)
    assert abs(float(dg.principal_angles(a, b)[0]) - 0.4) < 1e-12


# ============================================================================ clustering statistics
def test_mean_overlap_cluster_count_and_hitting_time():
    g = gen(17)
    centres = tp.sphere.normalize(torch.randn(4, 5, generator=g, dtype=F64))
    x = tp.sphere.normalize(centres.repeat_interleave(6, 0) + 1e-4 * torch.randn(24, 5, generator=g, dtype=F64))
    assert int(tp.clustering.cluster_count(x, radius=1e-2, metric="geodesic")) == 4
    assert tp.clustering.cluster_count(x.expand(2, 24, 5), radius=1e-2, metric="geodesic").tolist() == [4, 4]
    gbar, gap = dg.mean_overlap(x)
    Gm = x @ x.T
    assert abs(float(gbar) - float(Gm[offdiag(24)].mean())) < 1e-14
    assert abs(float(gap) - float((1 - Gm)[offdiag(24)].mean())) < 1e-12
    # nearly coincident tokens: the gap survives where 1 − ⟨x, y⟩ rounds to 0
    y = tp.sphere.normalize(torch.tensor([[1.0, 0.0], [1.0, 1e-10]], dtype=F64))
    assert abs(float(dg.mean_overlap(y)[1]) / 5e-21 - 1) < 1e-6
    # hitting time of the particles = quadrature of the reduced ODE (interpolation error O(dt²))
    n, lam = 5, [1.0]
    x0 = tp.sphere.equiangular(n, 0.0, n, dtype=F64).expand(2, n, n)
    heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, weights=ones(1))
    T = dg.clustering_hitting_time(x0, heads, target=0.5, t_max=5.0, dt=0.01)
    Tq = th.hitting_time(lam, n=n, gamma0=0.0, target=0.5)
    assert T.shape == (2,)
    torch.testing.assert_close(T, torch.full((2,), Tq, dtype=F64), rtol=1e-4, atol=0)
    assert float(dg.clustering_hitting_time(x0[0], heads, target=0.5, t_max=0.1, dt=0.01)) == math.inf


# ============================================================================ validation
def test_bad_input_is_refused():
    x = tp.sphere.sample_uniform(5, 3, generator=gen(0), dtype=F64)
    heads = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), 3, weights=ones(1))
    cases = [
        (ValueError, lambda: th.critical_cosine(0)),
        (TypeError, lambda: th.critical_cosine(2.0)),
        (ValueError, lambda: th.critical_cosine(2, form="cross")),
        (ValueError, lambda: th.critical_beta(2, 1)),
        (ValueError, lambda: th.critical_beta(2, 5, -1.0)),
        (ValueError, lambda: th.critical_beta(2, 5, gamma=1.0)),
        (TypeError, lambda: th.critical_beta(2, 5, gamma="0")),
        (ValueError, lambda: th.early_rate(1.0, float("nan"), 5)),
        (ValueError, lambda: th.optimal_head_strength(0.0, 5)),
        (ValueError, lambda: th.rate_inflection(-1.0, 5)),
        (ValueError, lambda: th.superadditivity([1.0, 2.0], beta=0.0, n=5)),
        (ValueError, lambda: th.lambert_w(-0.1)),
        (ValueError, lambda: th.gamma_velocity(0.0, [1.0], n=5, normalization="effective")),
        (ValueError, lambda: th.gamma_velocity(0.0, [1.0], n=5, direction="up")),
        (ValueError, lambda: th.gamma_velocity(0.0, [float("nan")], n=5)),
        (TypeError, lambda: th.gamma_velocity(0.0, "abc", n=5)),
        (ValueError, lambda: th.gamma_ode([0.0, 1.0], [1.0], n=5, gamma0=-0.5)),
        (ValueError, lambda: th.gamma_ode([0.0, 1.0, 0.5], [1.0], n=5, gamma0=0.0)),
        (ValueError, lambda: th.hitting_time([1.0], n=5, gamma0=0.5, target=0.2)),
        (ValueError, lambda: th.linearized_clustering_time([1.0], n=5, gamma0=0.0, target=0.5, normalization="relu")),
        (ValueError, lambda: th.superadditivity([[1.0, 2.0]], n=5)),
        (ValueError, lambda: dg.energy_balance(2 * x, heads)),
        (TypeError, lambda: dg.energy_balance(x, "heads")),
        (ValueError, lambda: dg.energy_balance(x, heads, direction="sideways")),
        (TypeError, lambda: dg.flat_velocity(x.int(), heads)),
        (ValueError, lambda: dg.head_energy_rates(x, heads, normalization="effective")),
        (ValueError, lambda: dg.head_energy_rates(x, heads, velocity=x[:3])),
        (ValueError, lambda: dg.radial_dominance_margin(x, heads, form="cross")),
        (ValueError, lambda: dg.radial_dominance_threshold(5, [1.0, -1.0])),
        (ValueError, lambda: dg.radial_dominance_threshold(1, [1.0])),
        (ValueError, lambda: dg.entropy_rate(x, heads, velocity=x[:2])),
        (ValueError, lambda: dg.entropy_rate(x, heads, score_rate=torch.zeros(2, 3, 3, dtype=F64))),
        (ValueError, lambda: dg.attention_entropy(x, heads, weights=torch.ones(5, dtype=F64))),
        (ValueError, lambda: dg.approximately_orthogonal_heads(2, 2, 100.0)),
        (ValueError, lambda: dg.principal_angles(torch.eye(3, dtype=F64), torch.eye(4, dtype=F64))),
        (TypeError, lambda: dg.orthogonality_defect(torch.eye(3))),
        (ValueError, lambda: tp.clustering.cluster_count(x, radius=0.0, metric="geodesic")),
        (ValueError, lambda: dg.mean_overlap(x[:1])),
        (ValueError, lambda: dg.flat_flow(x, heads, t1=1.0, dt=0.0)),
        (ValueError, lambda: dg.flat_flow(x, heads, t1=1.0, dt=0.3)),
        (ValueError, lambda: dg.flat_flow(x, heads, t1=1.0, dt=0.1, method="dopri5")),
        (ValueError, lambda: dg.clustering_hitting_time(x, heads, target=1.5, t_max=1.0, dt=0.1)),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()


def test_flat_blow_up_names_time_and_step():
    x = tp.sphere.sample_uniform(6, 3, generator=gen(0), dtype=F64)
    heads = tp.Heads.scalar(torch.tensor([30.0], dtype=F64), 3, weights=ones(1))
    with pytest.raises(tp.NonFiniteError, match=r"t = .*step \d+"):
        dg.flat_flow(x, heads, t1=10.0, dt=0.01)


# ============================================================================ studies (CLI path)
STUDY_OVERRIDES = {
    "theory_energy": ["n=8", "t1=0.2", "dt=0.02", "flat_t1=0.02", "flat_dt=0.002", "epsilons=[0.05, 0.1]"],
    "theory_radial": ["heads=[1, 2]", "n=[3, 10]", "gammas=[0.05]", "hetero=[0.5, 1.0]", "hetero_n=10"],
    "theory_rates": ["n=4", "t1=1.0", "dt=0.05", "phi_n=[2, 8]", "total=[2.0]", "targets=[0.1]"],
    "theory_relu_softmax": ["n=[4, 8]", "d=[16, 64]", "random_n=[]", "dt=0.05"],
    "theory_entropy": ["n=6", "configs=2", "equi_n=4", "t1=1.0", "dt=0.05"],
    "theory_orthogonality": ["angles=[80.0, 90.0]", "n=8", "flat_t1=0.01", "flat_dt=0.002"],
}


# figures dominate the cost of a study (seconds each); two kinds run by default, the others with -m slow
_SLOW_STUDIES = {"theory_energy", "theory_rates", "theory_relu_softmax", "theory_orthogonality"}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in _SLOW_STUDIES else k
                                  for k in STUDY_OVERRIDES])
def test_theory_studies_run_through_the_cli(kind, tmp_path):
    import json
    from pathlib import Path

    from transformer_pde.application.runs import execute

    root = Path(__file__).resolve().parent.parent / "experiments"
    cfg = root / f"{kind}.toml"
    assert cfg.exists(), cfg
    path = execute(cfg, overrides=STUDY_OVERRIDES[kind], out_dir=tmp_path, progress=False)
    metrics = json.loads((path / "metrics.json").read_text())
    figs = sorted(p.suffix for p in (path / "figures").iterdir())
    assert ".png" in figs and ".pdf" in figs, kind
    assert any((path / "series").iterdir())
    assert metrics["wall_time_s"] > 0
    if kind == "theory_radial":
        assert metrics["max_rel_error_token_gamma0"] < 1e-9
        assert metrics["max_rel_error_pairwise_gamma0"] < 1e-9
        with pytest.raises(ValueError, match="must be"):
            execute(cfg, overrides=["heads=[0]"], out_dir=tmp_path, progress=False, name="bad")
    if kind == "theory_rates":
        assert metrics["early_rate_rel_error"] < 1e-12
        assert metrics["softmax_max_abs_error_particles_vs_ode"] < 1e-5
        with pytest.raises(ValueError, match="allowed keys"):
            execute(cfg, overrides=["lambda=[1.0]"], out_dir=tmp_path, progress=False, name="bad")
    if kind == "theory_entropy":
        assert metrics["identity_max_rel_error_vs_fd"] < 1e-6
        assert metrics["equiangular_min_entropy_increment"] > 0
    if kind == "theory_energy":
        assert metrics["orth_rate_head1_sphere"] < 0 < metrics["orth_rate_head1_flat"]
        assert metrics["sphere_identity_rel_residual"] < 1e-2
    if kind == "theory_relu_softmax":
        assert metrics["relu_particles_vs_ode_max_rel_error"] < 1e-3
    if kind == "theory_orthogonality":
        assert metrics["max_coupling_over_bound"] <= 1.0


# ============================================================================ slow: sweeps
@pytest.mark.slow
def test_relu_vs_softmax_sweep_on_particles():
    # equiangular particles (exact reduction) against the reduced ODE over n and d, and the scaling of
    # linearised vs nonlinear times
    rows = []
    for norm in ("softmax", "relu"):
        for n in (4, 8, 16):
            for d in (16, 256):
                g0 = th.typical_overlap(d)
                to = th.hitting_time([1.0], n=n, gamma0=g0, target=0.5, normalization=norm)
                x0 = tp.sphere.equiangular(n, g0, n, dtype=F64)
                heads = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), n, weights=ones(1))
                T = float(dg.clustering_hitting_time(x0, heads, target=0.5, t_max=1.5 * to + 1, dt=min(0.05, to / 100),
                                                     normalization=norm))
                assert abs(T / to - 1) < 1e-4
                tl = th.linearized_clustering_time([1.0], n=n, gamma0=g0, target=0.5, normalization=norm)
                rows.append((norm, n, d, tl, to))
    lin = {(nm, n, d): tl for nm, n, d, tl, _ in rows}
    ode = {(nm, n, d): to for nm, n, d, _, to in rows}
    # linearised: Θ(n) for both (slope → 1 for softmax as n ≫ e^{βλ}), ReLU ∝ ln(√d γ*)
    assert 0.7 < fit_slope([4, 8, 16], [lin["softmax", n, 16] for n in (4, 8, 16)]) < 1.0
    assert abs(fit_slope([4, 8, 16], [lin["relu", n, 256] for n in (4, 8, 16)]) - 1) < 1e-12
    assert lin["relu", 16, 256] / lin["relu", 16, 16] == pytest.approx(math.log(8) / math.log(2), rel=1e-12)
    # nonlinear: softmax grows far slower than n, ReLU is still increasing with d
    assert fit_slope([4, 8, 16], [ode["softmax", n, 16] for n in (4, 8, 16)]) < 0.3
    assert ode["relu", 16, 256] > ode["relu", 16, 16]


@pytest.mark.slow
def test_superadditivity_in_time_on_particles():
    n = 8
    x0 = torch.eye(n, dtype=F64)
    times = {}
    for tag, lam in (("het", [12.0, 4.0]), ("eq", [8.0, 8.0]), ("het_c", [1.5, 0.5]), ("eq_c", [1.0, 1.0])):
        heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), n, weights=ones(2))
        Tq = th.hitting_time(lam, n=n, gamma0=0.0, target=0.05)
        T = float(dg.clustering_hitting_time(x0, heads, target=0.05, t_max=1.5 * Tq + 1, dt=min(0.01, Tq / 100)))
        assert abs(T / Tq - 1) < 1e-4
        times[tag] = T
    assert times["het"] < times["eq"]  # convex regime: heterogeneous heads cluster first
    assert times["het_c"] > times["eq_c"]  # concave regime: equal heads do


@pytest.mark.gpu
def test_diagnostics_follow_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, heads, _ = _random_setup(1)
    xc, hc = x.cuda(), heads.to("cuda")
    for fn in (lambda a, h: dg.energy_balance(a, h).rate, lambda a, h: dg.entropy_rate(a, h),
               lambda a, h: dg.radial_dominance_margin(a, h)):
        out = fn(xc, hc)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), fn(x, heads), rtol=1e-10, atol=1e-12)


def test_per_head_diagnostics_take_a_batch_of_token_weights_on_the_batch_axis():
    """Token weights of shape (B, n) belong to the batch axis, also when B equals H (a former bug
    paired them with the head axis: silently wrong for B = H, a shape error otherwise).  Oracle: each
    batch element computed on its own with its (n,) weights."""
    g = torch.Generator().manual_seed(7)
    for B, H in ((2, 2), (3, 2)):
        x = tp.sphere.sample_uniform(5, 3, batch_shape=(B,), generator=g, dtype=torch.float64)
        heads = tp.Heads.random(H, 3, generator=g, dtype=torch.float64, beta=1.3, scale=0.3,
                                weights=torch.tensor([0.3, 1.1], dtype=torch.float64))
        w = torch.rand(B, 5, generator=g, dtype=torch.float64) + 0.2
        w = w / w.sum(-1, keepdim=True)
        one = [(x[b], w[b]) for b in range(B)]
        torch.testing.assert_close(dg.flat_head_energies(x, heads, w),
                                   torch.stack([dg.flat_head_energies(xb, heads, wb) for xb, wb in one]))
        torch.testing.assert_close(dg.head_energy_rates(x, heads, w),
                                   torch.stack([dg.head_energy_rates(xb, heads, wb) for xb, wb in one]))
        rd = dg.radial_decomposition(x, heads, w)
        for name in ("coupling", "shadow", "flat_rates", "sphere_rates", "tangential"):
            torch.testing.assert_close(getattr(rd, name), torch.stack(
                [getattr(dg.radial_decomposition(xb, heads, wb), name) for xb, wb in one]), msg=name)
        run = dg.flat_flow(x, heads, t1=0.02, dt=0.01, weights=w)
        torch.testing.assert_close(run.head_energies[-1], torch.stack(
            [dg.flat_flow(xb, heads, t1=0.02, dt=0.01, weights=wb).head_energies[-1] for xb, wb in one]))


def test_radial_dominance_threshold_stops_at_overflow_and_respects_beta_max():
    """Unnormalized outputs overflow float64 near β = 710/λ: the search used to read the NaN margin
    as "not ≥ 0" and return the overflow point (512) for one head, whose margin is ≥ 0 at every β
    (no other head casts a shadow), so the answer is inf."""
    with pytest.raises(OverflowError, match=r"not finite at beta = 512.*beta_max < 512"):
        dg.radial_dominance_threshold(2, [1.0], normalization="unnormalized")
    assert dg.radial_dominance_threshold(2, [1.0], normalization="unnormalized", beta_max=300).item() == math.inf
    # the bracket never reaches past beta_max: a threshold above it reads as inf, below it is found
    # (three orthogonal tokens, two equal heads: both thresholds finite, about 0.106)
    both = dg.radial_dominance_threshold(3, [1.0, 1.0])
    assert bool(torch.isfinite(both).all())
    capped = dg.radial_dominance_threshold(3, [1.0, 1.0], beta_max=0.5 * both.min().item())
    assert bool((capped == math.inf).all())
    torch.testing.assert_close(dg.radial_dominance_threshold(3, [1.0, 1.0], beta_max=2 * both.max().item()), both)


# ==================================================================================================
# Closed forms of tp.theory against high-precision quadrature (mpmath), scipy's Lambert W and the
# partial-fraction integrals written here.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
import warnings  # noqa: E402

import mpmath  # noqa: E402
from scipy.special import lambertw  # noqa: E402
from torch.testing import assert_close  # noqa: E402


def test_lambert_w_converges_cubically_from_its_start():
    """Halley's iteration is third order: from w0 = log1p(z) (relative error ≤ 1e-2 at z = 1, 3)
    one step gives ~1e-6…1e-3, the next ~1e-10, the third is at rounding level.  A second-order
    variant (another correction term) is still ~1e-9…1e-5 after three steps."""
    for z in (1.0, 3.0):
        ref = float(lambertw(z).real)
        assert abs(th.lambert_w(z, iterations=3) - ref) <= 1e-13 * ref  # ~ 4 ulp of slack
        zt = torch.tensor([z, 2 * z], dtype=F64)
        out = th.lambert_w(zt, iterations=3)
        assert_close(out, torch.tensor([ref, float(lambertw(2 * z).real)], dtype=F64), rtol=1e-13, atol=0)
        # the converged fixed point solves w e^w = z
        w = th.lambert_w(z)
        assert abs(w * math.exp(w) - z) <= 1e-14 * z


def _mp_field(g, lams, beta, n, normalization):
    """F(γ) = 2(1 − γ)(1 + (n−1)γ) Σ_h λ_h k_h(γ), module docstring of theory, in mpmath."""
    g = mpmath.mpf(g)
    tot = mpmath.mpf(0)
    for lam in lams:
        lam = mpmath.mpf(lam)
        if normalization == "softmax":
            k = 1 / (mpmath.exp(beta * lam * (1 - g)) + n - 1)
        elif normalization == "unnormalized":
            k = mpmath.exp(beta * lam * g) / n
        else:
            k = max(beta * lam * g, 0) / n
        tot += lam * k
    return 2 * (1 - g) * (1 + (n - 1) * g) * tot


def _mp_hitting_time(lams, beta, n, g0, target, normalization):
    with mpmath.workdps(30):
        pts = [g0, 0.5 * (g0 + target), target]
        return float(mpmath.quad(lambda g: 1 / _mp_field(g, lams, beta, n, normalization), pts))


def test_hitting_time_against_high_precision_quadrature():
    """T = ∫ dγ / F(γ) against mpmath at 30 digits.  The function asks scipy for epsrel = 1e-11;
    the integrands are analytic on the interval, so 1e-10 (1e-9 near γ = 1, where 1 − γ loses
    digits in float64) is a safe bound; an integrand evaluated at float32-rounded γ is off by ~1e-7."""
    cases = [([0.5, 1.7], 1.3, 7, 0.0, 0.9, "softmax", 1e-10),          # γ0 ≤ 0 branch
             ([0.8, 2.5], 0.7, 12, -0.05, 0.999, "unnormalized", 1e-10),
             ([0.8, -0.3], 0.7, 12, 0.1, 0.99999, "unnormalized", 1e-10),  # γ0 > 0 branch (in ln γ)
             ([3.0], 2.0, 50, 0.01, 1 - 1e-9, "softmax", 1e-9)]           # target 1e-9 below 1
    for lams, beta, n, g0, target, norm, rtol in cases:
        ref = _mp_hitting_time(lams, beta, n, g0, target, norm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quad reports round-off in the last case (1 − γ ~ 1e-9); checked here
            got = th.hitting_time(lams, beta=beta, n=n, gamma0=g0, target=target, normalization=norm)
        assert abs(got - ref) <= rtol * ref, (norm, g0, target, got, ref)


def test_hitting_time_of_relu_heads_against_its_closed_form():
    """ReLU heads, γ > 0: F = 2β Σλ_h⁺² γ(1 − γ)(1 + Nγ)/n, N = n − 1, and partial fractions give
    ∫ dγ/F = n/(2βΣλ²) [ln γ − ln(1 − γ)/n − (N/n) ln(1 + Nγ)]."""
    lams, beta, n, g0, target = [0.63, 1.29, 2.5, -0.4], 1.77, 11, 0.018, 0.997201
    N, S = n - 1, sum(v * v for v in lams if v > 0)

    def P(g):
        return math.log(g) - math.log1p(-g) / n - N / n * math.log1p(N * g)

    ref = n / (2 * beta * S) * (P(target) - P(g0))
    got = th.hitting_time(lams, beta=beta, n=n, gamma0=g0, target=target, normalization="relu")
    assert abs(got - ref) <= 1e-11 * ref


def test_hitting_time_is_infinite_from_a_fixed_point():
    """F(γ0) = 0 exactly: the overlap never moves, so the target is never reached.
    (a) λ = (1, −1), unnormalized: Σ_h λ_h e^{βλ_h·0}/n = 0 at γ0 = 0 (and F > 0 for γ > 0);
    (b) the regular simplex γ0 = −1/(n−1) (n = 3: γ0 = −0.5 exactly), where 1 + (n−1)γ0 = 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mutant would integrate a divergent 1/F
        assert th.hitting_time([1.0, -1.0], beta=1.4, n=5, gamma0=0.0, target=0.5,
                                   normalization="unnormalized") == math.inf
        assert th.hitting_time([0.7, 1.9], beta=1.4, n=3, gamma0=-0.5, target=0.5) == math.inf
    # and just above the fixed point the time is finite
    assert math.isfinite(th.hitting_time([1.0, -1.0], beta=1.4, n=5, gamma0=0.01, target=0.5,
                                             normalization="unnormalized"))


def test_clustering_time_errors_name_the_target():
    with pytest.raises(ValueError, match=r"^target must lie in \[-1/\(n-1\), 1\)"):
        th.hitting_time([1.0], n=5, gamma0=0.1, target=1.2)
    with pytest.raises(ValueError, match=r"^target must lie in"):
        th.linearized_clustering_time([1.0], n=5, gamma0=0.1, target=-0.5)
    with pytest.raises(ValueError, match=r"^gamma0 must lie in"):
        th.hitting_time([1.0], n=5, gamma0=-0.5, target=0.5)


def test_linearized_clustering_time_defaults_to_beta_one():
    """β defaults to 1: relu T = n ln(target/γ0)/(2β Σλ²); softmax T = (target − γ0)/Σ_h φ(λ_h) with
    φ(λ) = 2λ/(e^{λβ} + n − 1); unnormalized T = (target − γ0) n/(2Σλ)."""
    lams, n, g0, target = [0.6, 1.7], 9, 0.05, 0.4
    relu = n * math.log(target / g0) / (2 * sum(v * v for v in lams))
    soft = (target - g0) / sum(2 * v / (math.exp(v) + n - 1) for v in lams)
    unn = (target - g0) * n / (2 * sum(lams))
    assert th.linearized_clustering_time(lams, n=n, gamma0=g0, target=target, normalization="relu") \
        == pytest.approx(relu, rel=1e-14)
    assert th.linearized_clustering_time(lams, n=n, gamma0=g0, target=target) == pytest.approx(soft, rel=1e-14)
    assert th.linearized_clustering_time(lams, n=n, gamma0=g0, target=target, normalization="unnormalized") \
        == pytest.approx(unn, rel=1e-14)
    # and β enters as documented
    assert th.linearized_clustering_time(lams, beta=2.5, n=n, gamma0=g0, target=target,
                                             normalization="relu") == pytest.approx(relu / 2.5, rel=1e-14)


def test_equiangular_entropy_with_tensor_strengths_and_float_input():
    """H(γ) = ln(ρ + n − 1) − ρ ln ρ/(ρ + n − 1), ρ = e^{βλ(1−γ)}, elementwise for a tensor of λ;
    plain floats in, a plain float out; H(γ → 1) = ln n."""
    gamma, beta, n = 0.3, 1.6, 7
    lam = torch.tensor([0.4, 1.1, 2.5], dtype=F64)

    def H(lv):
        rho = math.exp(beta * lv * (1 - gamma))
        return math.log(rho + n - 1) - rho * math.log(rho) / (rho + n - 1)

    out = th.equiangular_entropy(gamma, lam, beta, n)
    assert isinstance(out, torch.Tensor) and out.shape == (3,)
    assert_close(out, torch.tensor([H(v) for v in lam.tolist()], dtype=F64), rtol=1e-13, atol=0)
    f = th.equiangular_entropy(gamma, 1.1, beta, n)
    assert type(f) is float and f == pytest.approx(H(1.1), rel=1e-13)
    assert th.equiangular_entropy(1 - 1e-12, 1.1, beta, n) == pytest.approx(math.log(n), rel=1e-9)


def _softmax_reduced_field(g, lams, beta, n):
    """F(γ) = 2(1 − γ)(1 + (n−1)γ) Σ_h λ_h / (e^{βλ_h(1−γ)} + n − 1), written out in math (softmax heads)."""
    return 2 * (1 - g) * (1 + (n - 1) * g) * sum(v / (math.exp(beta * v * (1 - g)) + n - 1) for v in lams)


def test_gamma_velocity_default_beta_is_one():
    """The documented default β = 1: the call without beta is the closed form at β = 1 (and not at β = 2)."""
    lam, n = [0.4, 1.3, 2.2], 6
    for g in (-0.1, 0.0, 0.35, 0.8):
        ref = _softmax_reduced_field(g, lam, 1.0, n)
        assert abs(th.gamma_velocity(g, lam, n=n) - ref) <= 1e-14 * abs(ref)
        assert abs(_softmax_reduced_field(g, lam, 2.0, n) - ref) > 1e-3 * abs(ref)  # the default is visible


def test_gamma_velocity_of_a_float_gamma_and_batched_lambdas_is_a_tensor(dtype):
    """γ a float, lambdas (B, H): one velocity per set of head strengths, a (B,) tensor in their dtype (only
    1-D lambdas with a float γ give a float); B = 1 keeps its axis too."""
    lam = torch.tensor([[0.5, 1.5], [2.0, 0.25], [1.0, 1.0]], dtype=dtype)
    tol = 1e-14 if dtype == F64 else 2e-6
    for rows in (lam, lam[:1]):
        out = th.gamma_velocity(0.3, rows, beta=1.4, n=5)
        assert isinstance(out, torch.Tensor) and out.shape == (len(rows),) and out.dtype == dtype
        ref = torch.tensor([_softmax_reduced_field(0.3, r, 1.4, 5) for r in rows.double().tolist()], dtype=F64)
        assert_close(out.double(), ref, rtol=tol, atol=0)
    assert isinstance(th.gamma_velocity(0.3, [0.5, 1.5], beta=1.4, n=5), float)


def test_lambert_w_of_a_float_is_a_float():
    """A Python float in, a Python float out (W(e) = 1, W(0) = 0, W(1) = Ω = 0.5671432904097838…);
    optimal_head_strength, built on it, returns floats as documented."""
    for z, ref in ((math.e, 1.0), (0.0, 0.0), (1.0, 0.5671432904097838)):
        w = th.lambert_w(z)
        assert type(w) is float and abs(w - ref) <= 4e-16
    lam, phi = th.optimal_head_strength(1.0, 8)
    assert type(lam) is float and type(phi) is float
