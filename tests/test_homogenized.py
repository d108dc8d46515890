"""Random layers (values drawn afresh per layer and head), their homogenized common-noise limit and the study
(docs/homogenized.md)."""

import json
import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import homogenized as hz

DTYPES = [torch.float32, torch.float64]


def _tol(dtype, scale=1.0):
    return scale * (1e-5 if dtype == torch.float32 else 1e-12)


def _pair(rho, d, dtype=torch.float64):
    x = torch.zeros(2, d, dtype=dtype)
    x[0, 0] = 1.0
    x[1, 0] = rho
    x[1, 1] = math.sqrt(1 - rho * rho)
    return x


# ------------------------------------------------------------------------------------------ the process
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_values_have_the_stated_mean_and_covariance(dtype):
    """V_{l,h} − V̄_h has i.i.d. entries of variance σ_h²/Δ: its 9×9 covariance is (σ_h²/Δ)·I per head, and it is
    uncorrelated across heads and across layers (5 standard errors of the sample moments)."""
    N, H, d, dt = 20000, 2, 3, 0.04
    g = torch.Generator().manual_seed(3)
    Vbar = torch.randn(H, d, d, generator=g, dtype=torch.float64).to(dtype)
    sigma = torch.tensor([0.5, 1.5], dtype=dtype)
    proc = tp.RandomLayers(tp.Heads(torch.eye(d, dtype=dtype).expand(H, d, d), Vbar), sigma, layer_time=dt,
                           batch_shape=(N,), seed=11)
    a = (proc.layer(3).value_matrix - Vbar).reshape(N, H, d * d).double()
    b = (proc.layer(4).value_matrix - Vbar).reshape(N, H, d * d).double()
    assert torch.allclose(proc.noise_std().double(), sigma.double() / math.sqrt(dt))
    for h in range(H):
        v = float(sigma[h]) ** 2 / dt
        assert a[:, h].mean(0).abs().max() < 5 * math.sqrt(v / N)
        C = torch.cov(a[:, h].T)
        assert (C.diagonal() - v).abs().max() < 5 * v * math.sqrt(2 / N)
        assert (C - torch.diag(C.diagonal())).abs().max() < 5 * v / math.sqrt(N)
    cross_head = (a[:, 0, :, None] * a[:, 1, None, :]).mean(0) / (float(sigma[0] * sigma[1]) / dt)
    cross_layer = (a[:, 1, :, None] * b[:, 1, None, :]).mean(0) / (float(sigma[1]) ** 2 / dt)
    assert cross_head.abs().max() < 5 / math.sqrt(N)
    assert cross_layer.abs().max() < 5 / math.sqrt(N)
    assert proc.layer(3).value_matrix.dtype == dtype


def test_layers_are_reproducible_indexed_by_time_and_jump_at_layer_starts():
    A = torch.eye(3, dtype=torch.float64)[None]
    h = tp.Heads(A, torch.zeros_like(A), beta=0.5)
    p = tp.RandomLayers(h, 1.0, layer_time=0.25, batch_shape=(4,), seed=5)
    q = tp.RandomLayers(h, 1.0, layer_time=0.25, batch_shape=(4,), seed=5)
    r = tp.RandomLayers(h, 1.0, layer_time=0.25, batch_shape=(4,), seed=6)
    tol = dict(rtol=_tol(torch.float64), atol=_tol(torch.float64))  # the same draws, up to the arithmetic around them

    def same(a, b):
        torch.testing.assert_close(a, b, **tol)

    def apart(a, b):  # independent N(0, σ²/Δ) draws: entries differ by O(1), far beyond rounding
        assert float((a - b).abs().max()) > 1e-3

    same(p.layer(7).value_matrix, q.layer(7).value_matrix)
    apart(p.layer(7).value_matrix, r.layer(7).value_matrix)
    apart(p.layer(7).value_matrix, p.layer(8).value_matrix)
    V2 = p.layer(2).value_matrix
    same(p.heads_at(0.5).value_matrix, V2)
    same(p.heads_at(0.7).value_matrix, V2)
    same(p.left_heads_at(0.75).value_matrix, V2)
    same(p.heads_at(0.75).value_matrix, p.layer(3).value_matrix)
    apart(p.heads_at(0.75).value_matrix, V2)  # the jump at the layer start
    assert p.knots(0.0, 0.75) == pytest.approx([0.25, 0.5, 0.75])
    assert p.jumps(0.3, 0.6) == pytest.approx([0.5])
    assert p.closed_form and p.piecewise_constant and p.heads_at(0.1).beta == 0.5
    assert tp.RandomLayers(h, 1.0, layer_time=0.25).layer(0).value_matrix.shape == (1, 3, 3)
    with pytest.raises(ValueError):
        p.layer(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_simulate_steps_one_residual_layer_per_step(dtype):
    """tp.simulate with the process and dt = Δ is the residual network x ← (x + Δ P_x Σ_h ω_h V_{l,h} ȳ_h)/|·|,
    ȳ_h the softmax average written out here."""
    P, n, d, H, dt = 5, 4, 3, 2, 0.1
    g = torch.Generator().manual_seed(0)
    A = torch.randn(H, d, d, generator=g, dtype=torch.float64).to(dtype)
    x0 = tp.sphere.sample_uniform(P * n, d, generator=g, dtype=torch.float64).reshape(P, n, d).to(dtype)
    heads = tp.Heads(A, 0.3 * A, beta=0.7)
    proc = tp.RandomLayers(heads, 0.8, layer_time=dt, batch_shape=(P,), seed=2)
    tr = tp.simulate(x0, proc, t1=2 * dt, dt=dt, diagnostics=False, progress=False)
    x = x0
    for l in range(2):
        V = proc.layer(l).value_matrix  # (P, H, d, d)
        s = 0.7 * torch.einsum("pid,hde,pje->phij", x, A, x)
        w = torch.softmax(s, -1)
        y = torch.einsum("phij,pjd->phid", w, x)
        f = torch.einsum("phde,phie->pid", V / H, y)
        f = f - (f * x).sum(-1, keepdim=True) * x
        x = x + dt * f
        x = x / x.norm(dim=-1, keepdim=True)
    assert (tr.x[-1] - x).abs().max() < _tol(dtype, 10)


def test_random_layers_refuse_bad_input():
    A = torch.eye(3)[None]
    h = tp.Heads(A, torch.zeros_like(A))
    with pytest.raises(TypeError, match="Heads"):
        tp.RandomLayers(A, 1.0, layer_time=0.1)
    with pytest.raises(ValueError, match="sigma"):
        tp.RandomLayers(h, -1.0, layer_time=0.1)
    with pytest.raises(ValueError, match="per head"):
        tp.RandomLayers(h, torch.ones(2), layer_time=0.1)
    with pytest.raises(ValueError, match="layer_time"):
        tp.RandomLayers(h, 1.0, layer_time=0.0)
    with pytest.raises(TypeError, match="batch_shape"):
        tp.RandomLayers(h, 1.0, layer_time=0.1, batch_shape=5)
    with pytest.raises(ValueError):
        tp.RandomLayers(h, 1.0, layer_time=0.1, batch_shape=(0,))
    with pytest.raises((TypeError, ValueError)):
        tp.RandomLayers(h, 1.0, layer_time=0.1, seed=-1)


# ------------------------------------------------------------------------------------------ the limit SDE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta,d,sigma,alpha", [(0.0, 3, 1.0, 0.0), (1.3, 4, 0.7, 0.4), (-0.8, 2, 1.5, -0.3)])
def test_two_token_coefficients_from_the_vector_sde(dtype, beta, d, sigma, alpha):
    """Itô's formula for ρ = ⟨x₁, x₂⟩ from the tensor coefficients (drift, K) — ⟨b₁, x₂⟩ + ⟨x₁, b₂⟩ + tr(P₁P₂)K₁₂
    and K₁₁|P₁x₂|² + K₂₂|P₂x₁|² + 2K₁₂⟨P₁x₂, P₂x₁⟩ — equals the scalar (b, a²) written by hand."""
    rhos = [-0.9, -0.3, 0.0, 0.5, 0.95]
    x = torch.stack([_pair(r, d) for r in rhos]).to(dtype)
    A = torch.eye(d, dtype=dtype)[None]
    heads = tp.Heads(A, alpha * A, beta=beta)
    drift, K, _ = hz.homogenized_coefficients(x, heads, sigma)
    x1, x2 = x[:, 0], x[:, 1]
    rho = (x1 * x2).sum(-1)
    P1 = torch.eye(d, dtype=dtype) - x1[:, :, None] * x1[:, None, :]
    P2 = torch.eye(d, dtype=dtype) - x2[:, :, None] * x2[:, None, :]
    u, v = torch.einsum("pij,pj->pi", P1, x2), torch.einsum("pij,pj->pi", P2, x1)
    b = (drift[:, 0] * x2).sum(-1) + (x1 * drift[:, 1]).sum(-1) + torch.einsum("pij,pji->p", P1, P2) * K[:, 0, 1]
    a2 = K[:, 0, 0] * (u * u).sum(-1) + K[:, 1, 1] * (v * v).sum(-1) + 2 * K[:, 0, 1] * (u * v).sum(-1)
    b_ref, a2_ref = hz.two_token_coefficients(rho.double(), beta, d, sigma, alpha)
    assert (b.double() - b_ref).abs().max() < _tol(dtype, 100)
    assert (a2.double() - a2_ref).abs().max() < _tol(dtype, 100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ito_correction_is_half_the_laplacian_of_the_retraction(dtype):
    """drift − (mean field) = ½ K_ii Δ(x/|x|) at |x| = 1 (the Laplacian by autograd), for every token."""
    n, d, H = 4, 5, 2
    g = torch.Generator().manual_seed(1)
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=torch.float64).to(dtype)
    A = torch.randn(H, d, d, generator=g, dtype=torch.float64).to(dtype)
    heads = tp.Heads(A, torch.randn(H, d, d, generator=g, dtype=torch.float64).to(dtype), beta=0.9)
    drift, K, _ = hz.homogenized_coefficients(x, heads, torch.tensor([0.6, 1.1], dtype=dtype))
    corr = drift - tp.velocity(x, heads)
    for i in range(n):
        lap = torch.stack([torch.autograd.functional.hessian(lambda z, k=k: z[k] / z.norm(), x[i].double()).trace()
                           for k in range(d)])  # Δ of N_k(z) = z_k/|z| at z = x_i
        assert (corr[i].double() - 0.5 * K[i, i].double() * lap).abs().max() < _tol(dtype, 100)


def test_boundary_exponents_match_the_linearised_coefficients():
    """λ₋ = b'(−1) − ½ lim a²/(1+ρ)², λ₊ = −b'(1)·(−1) − ½ lim a²/(1−ρ)², by finite differences of (b, a²)."""
    for beta, d, sigma, alpha in [(0.0, 3, 1.0, 0.0), (0.7, 5, 1.3, 0.2), (-1.5, 2, 0.5, -0.4)]:
        w = 1e-6
        r = torch.tensor([-1 + w, 1 - w], dtype=torch.float64)
        b, a2 = hz.two_token_coefficients(r, beta, d, sigma, alpha)
        lam_m = float(b[0]) / w - 0.5 * float(a2[0]) / w ** 2
        lam_p = -float(b[1]) / w - 0.5 * float(a2[1]) / w ** 2
        ref = hz.boundary_exponents(beta, d, sigma, alpha)
        assert lam_m == pytest.approx(ref[0], abs=1e-4) and lam_p == pytest.approx(ref[1], abs=1e-4)
    for beta in (0.0, 0.5, 1.0):
        dc = hz.critical_dimension(beta)
        assert (dc - 1) / math.cosh(beta) ** 2 == pytest.approx(2.0)
        assert hz.boundary_exponents(beta, 2, 1.0)[0] < 0
    assert hz.critical_dimension(0.0) == 3.0


def test_antipodal_probability_closed_forms():
    """β = 0, d = 2: P = 1/2 − asin(ρ₀)/π (scale function sech u); d = 2, ρ₀ = 0: 1/2 for every β (the u-drift is
    odd); 0 at and above d_c; and P(ρ) (scale-function quadrature) is harmonic for the two-token diffusion:
    E P(ρ_t) = P(ρ₀) by the backward Kolmogorov solver, an independent computation."""
    r0 = torch.tensor([-0.8, -0.2, 0.0, 0.4, 0.9], dtype=torch.float64)
    assert torch.allclose(hz.antipodal_probability(r0, 0.0, 2), 0.5 - torch.asin(r0) / math.pi, atol=1e-6)
    for beta in (0.3, 1.0, 2.5):
        assert float(hz.antipodal_probability(0.0, beta, 2, 0.7)) == pytest.approx(0.5, abs=1e-6)
    assert float(hz.antipodal_probability(0.3, 0.0, 3)) == 0.0
    assert float(hz.antipodal_probability(0.3, 1.0, 6)) == 0.0
    for beta, d in ((1.0, 4), (2.0, 6)):
        P = lambda r: hz.antipodal_probability(r.clamp(-1 + 1e-15, 1 - 1e-15), beta, d)  # noqa: E731
        start = torch.tensor([-0.5, 0.0, 0.2], dtype=torch.float64)
        assert float(P(start).min()) > 0.02  # not a trivial constant
        assert torch.allclose(hz.two_token_expectation(P, start, 1.0, beta, d), P(start), atol=2e-4)


def test_two_token_expectation_is_the_semigroup_of_the_generator():
    """t = 0: f(ρ₀); small t: (E f(ρ_t) − f(ρ₀))/t → b f' + ½a² f''; β = 0, d = 2: the harmonic function
    1/2 − asin(ρ)/π is conserved; the Chebyshev degrees 256 and 384 agree."""
    f = lambda r: r * r + 0.3 * r  # noqa: E731
    r0 = torch.tensor([-0.6, 0.1, 0.7], dtype=torch.float64)
    assert torch.allclose(hz.two_token_expectation(f, r0, 0.0, 1.2, 3), f(r0), atol=1e-10)
    t = 3e-3
    b, a2 = hz.two_token_coefficients(r0, 1.2, 3, 0.8)
    gen = b * (2 * r0 + 0.3) + a2
    e1, e2 = ((hz.two_token_expectation(f, r0, s, 1.2, 3, 0.8) - f(r0)) / s for s in (t, 2 * t))
    assert torch.allclose(2 * e1 - e2, gen, atol=2e-4)  # Richardson: the O(t) term removed
    assert not torch.allclose(e1, gen, atol=2e-4)  # ... and it was there
    h = lambda r: 0.5 - torch.asin(r.clamp(-1, 1)) / math.pi  # noqa: E731
    assert torch.allclose(hz.two_token_expectation(h, r0, 1.0, 0.0, 2), h(r0), atol=1e-6)
    e256 = hz.two_token_expectation(f, r0, 1.0, 1.0, 3, nodes=256)
    e384 = hz.two_token_expectation(f, r0, 1.0, 1.0, 3, nodes=384)
    assert (e256 - e384).abs().max() < 1e-6


def test_network_weak_error_decreases_at_order_one():
    """E ρ_T² of the random-layer network (tp.simulate) against the exact limit: the error is well resolved at
    L = 4 and shrinks by a factor 2^p with p ∈ [0.6, 1.4] from L = 4 to 16 (measured p ≈ 0.8 there, → 1)."""
    from transformer_pde.application.studies.homogenized import network_inner_products

    d, beta, T = 3, 1.0, 1.0
    exact = float(hz.two_token_expectation(lambda r: r * r, 0.0, T, beta, d))
    errs, ses = [], []
    for L in (4, 16):
        r = network_inner_products(0.0, d, beta, 1.0, t1=T, layers=L, paths=60000, seed=L)
        errs.append(float((r * r).mean()) - exact)
        ses.append(float((r * r).std()) / math.sqrt(r.numel()))
    assert abs(errs[0]) > 20 * ses[0]
    p = math.log(errs[0] / errs[1]) / math.log(4)
    assert 0.6 <= p <= 1.4, (errs, ses, p)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ito", "projected"])
def test_sde_integrator_converges_to_the_exact_limit(scheme):
    """The limit SDE's integrator: E ρ_T² at dt = 1/4 and 1/16 against the exact limit, order in [0.6, 1.5]."""
    d, beta, T = 3, 1.0, 1.0
    A = torch.eye(d, dtype=torch.float64)[None]
    heads = tp.Heads(A, torch.zeros_like(A), beta=beta)
    exact = float(hz.two_token_expectation(lambda r: r * r, 0.0, T, beta, d))
    errs = []
    for k in (4, 16):
        X = hz.homogenized_sde(_pair(0.0, d), heads, 1.0, t1=T, dt=T / k, paths=100000, record_every=k,
                               scheme=scheme, seed=k)
        r = (X[-1, :, 0] * X[-1, :, 1]).sum(-1)
        errs.append(float((r * r).mean()) - exact)
    p = math.log(errs[0] / errs[1]) / math.log(4)
    assert 0.6 <= p <= 1.5, (errs, p)


def test_sde_shapes_dtype_and_refusals():
    A = torch.eye(3, dtype=torch.float32)[None]
    heads = tp.Heads(A, torch.zeros_like(A))
    x0 = _pair(0.2, 3, torch.float32)
    X = hz.homogenized_sde(x0, heads, 1.0, t1=0.5, dt=0.1, paths=7, record_every=2, seed=0)
    assert X.shape == (4, 7, 2, 3) and X.dtype == torch.float32
    assert torch.allclose(X.norm(dim=-1), torch.ones(()), atol=1e-5)
    again = hz.homogenized_sde(x0, heads, 1.0, t1=0.5, dt=0.1, paths=7, record_every=2, seed=0)
    torch.testing.assert_close(again, X, rtol=_tol(torch.float32), atol=_tol(torch.float32))  # the seed fixes the paths
    with pytest.raises(ValueError, match="unit sphere"):
        hz.homogenized_sde(2 * x0, heads, 1.0, t1=0.5, dt=0.1, paths=3)
    with pytest.raises(ValueError, match="whole number"):
        hz.homogenized_sde(x0, heads, 1.0, t1=0.5, dt=0.3, paths=3)
    with pytest.raises(ValueError, match="paths"):
        hz.homogenized_sde(x0, heads, 1.0, t1=0.5, dt=0.1)
    with pytest.raises(ValueError, match="scheme"):
        hz.homogenized_sde(x0, heads, 1.0, t1=0.5, dt=0.1, paths=3, scheme="milstein")
    with pytest.raises(ValueError, match="unbatched"):
        hz.homogenized_sde(x0, tp.Heads(A.expand(2, 1, 3, 3)), 1.0, t1=0.5, dt=0.1, paths=3)
    with pytest.raises(ValueError, match="sigma"):
        hz.homogenized_coefficients(x0, heads, -1.0)
    with pytest.raises(ValueError, match="rho0"):
        hz.antipodal_probability(1.0, 0.0, 2)
    with pytest.raises(TypeError, match="callable"):
        hz.two_token_expectation(3.0, 0.0, 1.0, 0.0, 3)
    with pytest.raises(ValueError, match="t must be"):
        hz.two_token_expectation(lambda r: r, 0.0, -1.0, 0.0, 3)


@pytest.mark.parametrize("every", [2, 3])
def test_sde_records_every_kth_step_of_the_same_path(every):
    """record_every = k keeps the steps 0, k, 2k, … and the last of the very path an every-step run takes (same
    stream), not other steps."""
    A = torch.eye(3, dtype=torch.float64)[None]
    heads = tp.Heads(A, 0.5 * A)
    x0 = _pair(0.3, 3)
    full = hz.homogenized_sde(x0, heads, 1.0, t1=0.7, dt=0.1, paths=4, seed=5)
    kept = hz.homogenized_sde(x0, heads, 1.0, t1=0.7, dt=0.1, paths=4, seed=5, record_every=every)
    steps = sorted(set(range(0, 8, every)) | {7})
    assert kept.shape[0] == len(steps)
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(kept, full[steps], rtol=64 * eps, atol=64 * eps)


@pytest.mark.parametrize("beta", [400.0, -400.0, 360.0])
def test_boundary_exponents_for_huge_beta_are_the_limits(beta):
    """|β| beyond exp's range: the exponents are their limits (no overflow), λ₋ = 4sα(1 − p₋) − 2σ² with
    1 − p₋ = 0 (β → +∞) or 1 (β → −∞), λ₊ = −2sα − σ²(d − 1)."""
    sigma, alpha, d = 0.7, 0.3, 4
    lam_minus, lam_plus = hz.boundary_exponents(beta, d, sigma, alpha, direction="ascent")
    q = 0.0 if beta > 0 else 1.0
    assert lam_minus == pytest.approx(4 * alpha * q - 2 * sigma ** 2, rel=1e-12)
    assert lam_plus == pytest.approx(-2 * alpha - sigma ** 2 * (d - 1), rel=1e-12)


def test_antipodal_probability_defaults_and_refusal():
    """σ defaults to 1 (with a mean value α ≠ 0 the probability depends on σ, so the default is visible); σ = 0
    is refused by name."""
    p = hz.antipodal_probability(0.3, 0.5, 3, alpha=0.2)
    assert float(p) == pytest.approx(float(hz.antipodal_probability(0.3, 0.5, 3, sigma=1.0, alpha=0.2)), abs=1e-15)
    assert float(p) != pytest.approx(float(hz.antipodal_probability(0.3, 0.5, 3, sigma=2.0, alpha=0.2)), abs=1e-6)
    with pytest.raises(ValueError, match=r"^sigma must be finite and > 0, got 0\.0"):
        hz.antipodal_probability(0.3, 0.5, 3, sigma=0.0)


@pytest.mark.parametrize("end", [-1.0, 1.0])
def test_two_token_expectation_stays_at_an_absorbing_end(end):
    """ρ = ±1 are fixed points (the coefficients carry 1 − ρ²): E f(ρ_t) = f(±1) from there, finite."""
    f = lambda r: r ** 3 + 2 * r  # noqa: E731
    v = hz.two_token_expectation(f, torch.tensor([end], dtype=torch.float64), 0.5, 1.0, 3)
    torch.testing.assert_close(v, f(torch.tensor([end], dtype=torch.float64)), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ the study
def test_wilson_interval():
    from transformer_pde.application.studies.homogenized import wilson_interval

    lo, hi = wilson_interval(0, 100, 1.96)
    assert lo == 0.0 and hi == pytest.approx(0.0370, abs=1e-4)
    lo, hi = wilson_interval(50, 100, 1.96)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)


def test_quick_config_through_the_command_line(tmp_path):
    """The quick config, made smaller, runs through the CLI: claims with value, error, seeds, reference and holds;
    the antipodal fractions agree with the limit's absorption probability; the figure is written."""
    from transformer_pde.application.cli import main as cli_main

    over = ["depths=[2, 4]", "sde_depths=[2]", "paths=600", "seeds=3", "pairs=150", "dims=[2, 4]", "betas=[0.0]",
            "t_pairs=4.0"]
    args = ["run", "experiments/homogenized_quick.toml", "--out", str(tmp_path), "--name", "h", "--no-progress", "-qq"]
    for o in over:
        args += ["--override", o]
    assert cli_main(args) == 0
    m = json.loads((tmp_path / "h" / "metrics.json").read_text())
    for c in m["claims"]:
        assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
    anti = [c for c in m["claims"] if c["name"].startswith("fraction antipodal")]
    assert len(anti) == 2 and all(c["holds"] for c in anti) and all(c["seeds"] == 150 for c in anti)
    assert [c["holds"] for c in m["claims"] if c["name"].startswith("critical dimension")] == [None]
    assert (tmp_path / "h" / "figures" / "homogenized.png").exists()
