"""Attention field, energy, mobilities: identities, symmetries and independent formulas."""


import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde import sphere
from conftest import gen
from problems import tolerances

NORMS = ["softmax", "unnormalized", "relu", "effective"]


def dense_field(x, A, V, omega, beta, normalization, w=None):
    """Straightforward dense implementation of docs/model.md (ascent), an independent oracle."""
    n = x.shape[-2]
    w = torch.full((n,), 1.0 / n, dtype=x.dtype) if w is None else w
    S = beta * torch.einsum("id,hde,je->hij", x, A, x)  # (H, n, n)
    K = torch.exp(S) * w
    Vy = torch.einsum("hde,je->hjd", V, x)  # (H, n, d): V_h y_j
    if normalization == "softmax":
        f = torch.einsum("hij,hjd->hid", K / K.sum(-1, keepdim=True), Vy)
    elif normalization == "unnormalized":
        f = torch.einsum("hij,hjd->hid", K, Vy)
    elif normalization == "relu":
        f = torch.einsum("hij,hjd->hid", torch.relu(S) * w, Vy)
    F = (omega[:, None, None] * f).sum(0)
    return F - (F * x).sum(-1, keepdim=True) * x


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_field_matches_dense_oracle(normalization, dtype):
    x = sphere.sample_uniform(9, 4, generator=gen(0), dtype=torch.float64)
    A = torch.randn(3, 4, 4, generator=gen(1), dtype=torch.float64)
    V = torch.randn(3, 4, 4, generator=gen(2), dtype=torch.float64)
    om = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    w = torch.softmax(torch.randn(9, generator=gen(3), dtype=torch.float64), 0)
    expect = dense_field(x, A, V, om, 0.7, normalization, w)
    heads = tp.Heads(A.to(dtype), V.to(dtype), om.to(dtype), beta=0.7)
    got = tp.velocity(x.to(dtype), heads, w.to(dtype), normalization=normalization)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-10)
    assert got.dtype == dtype
    assert_close(got, expect.to(dtype), **tol)
    assert_close(tp.velocity(x.to(dtype), heads, w.to(dtype), normalization=normalization, direction="descent"),
                 -got)


def test_factored_heads_equal_full_scores():
    d, k, H = 6, 2, 3
    Q = torch.randn(H, k, d, generator=gen(4), dtype=torch.float64)
    K = torch.randn(H, k, d, generator=gen(5), dtype=torch.float64)
    V = torch.randn(H, d, d, generator=gen(6), dtype=torch.float64)
    x = sphere.sample_uniform(11, d, generator=gen(7), dtype=torch.float64)
    fac = tp.Heads(None, V, query=Q, key=K, beta=1.3)
    full = tp.Heads(Q.transpose(-1, -2) @ K, V, beta=1.3)
    for norm in NORMS:
        if norm == "effective":  # the gradient field of E depends on A only: untied V is refused, tied V = A is not
            with pytest.raises(ValueError, match="V_h ≠ A_h"):
                tp.velocity(x, fac, normalization=norm)
            fac_t, full_t = tp.Heads(None, None, query=Q, key=K, beta=1.3), tp.Heads(Q.transpose(-1, -2) @ K, beta=1.3)
            assert_close(tp.velocity(x, fac_t, normalization=norm), tp.velocity(x, full_t, normalization=norm))
            continue
        assert_close(tp.velocity(x, fac, normalization=norm), tp.velocity(x, full, normalization=norm))


def test_autograd_gradient_of_energy_equals_field_formula():
    """∂E/∂x_i = w_i ∇δE/δμ(x_i); for symmetric V = A the unnormalized field is its projection."""
    x = sphere.sample_uniform(7, 3, generator=gen(8), dtype=torch.float64).requires_grad_(True)
    w = torch.softmax(torch.randn(7, generator=gen(9), dtype=torch.float64), 0)
    for A in (tp.Heads.random(3, 3, generator=gen(10), dtype=torch.float64).score,
              torch.randn(3, 3, 3, generator=gen(11), dtype=torch.float64)):  # symmetric, then general
        heads = tp.Heads(A, None, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), beta=0.8)
        (g,) = torch.autograd.grad(tp.energy(x, heads, w), x)
        riem = sphere.tangent_projection(x, g) / w[:, None]
        ev = tp.evaluate(x.detach(), heads, w, diagnostics=True)
        assert_close(ev.grad_first_variation, riem.detach())
    # symmetric heads with V = A: the unnormalized velocity IS the Riemannian gradient
    heads = tp.Heads.symmetric(tp.Heads.random(2, 3, generator=gen(12), dtype=torch.float64).score)
    (g,) = torch.autograd.grad(tp.energy(x, heads, w), x)
    assert_close(tp.velocity(x.detach(), heads, w, normalization="unnormalized"),
                 (sphere.tangent_projection(x, g) / w[:, None]).detach())


def test_first_variation_by_perturbation():
    """δE/δμ(z): E(μ + ε(δ_z − μ)) − E(μ) ≈ ε ∫ δE/δμ d(δ_z − μ)."""
    x = sphere.sample_uniform(6, 3, generator=gen(13), dtype=torch.float64)
    z = sphere.sample_uniform(1, 3, generator=gen(14), dtype=torch.float64)
    A = torch.randn(2, 3, 3, generator=gen(15), dtype=torch.float64)
    heads = tp.Heads(A, beta=0.9)
    eps = 1e-6
    xz = torch.cat([x, z])
    w0 = torch.cat([torch.full((6,), 1 / 6, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    w1 = (1 - eps) * w0
    w1[-1] = eps
    fd = (tp.energy(xz, heads, w1) - tp.energy(xz, heads, w0)) / eps
    fv = tp.first_variation(x, heads, at=xz)
    expect = fv[-1] - fv[:-1].mean()
    assert_close(fd, expect, rtol=1e-5, atol=1e-6)


def test_unnormalized_dissipation_is_kinetic_energy():
    """Unnormalized symmetric heads: V = ∇_S δE/δμ so 𝒟 = ∫|V|² dμ = dE/dt (time finite difference)."""
    x = sphere.sample_uniform(10, 3, generator=gen(16), dtype=torch.float64)
    heads = tp.Heads.random(3, 3, generator=gen(17), dtype=torch.float64)
    V = tp.velocity(x, heads, normalization="unnormalized")
    D = tp.dissipation(x, heads, normalization="unnormalized")
    assert_close(D, V.square().sum(-1).mean())
    h = 1e-5
    Ep = tp.energy(sphere.exp_map(x, h * V), heads)
    Em = tp.energy(sphere.exp_map(x, -h * V), heads)
    assert_close((Ep - Em) / (2 * h), D, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("direction", ["ascent", "descent"])
def test_dissipation_vs_slope(direction):
    s = 1.0 if direction == "ascent" else -1.0
    x = sphere.sample_uniform(12, 3, generator=gen(18), dtype=torch.float64)
    one = tp.Heads.random(1, 3, generator=gen(19), dtype=torch.float64)
    assert_close(tp.dissipation(x, one, direction=direction), s * tp.slope(x, one, direction=direction))
    many = tp.Heads.random(5, 3, generator=gen(20), dtype=torch.float64)
    eff_D = tp.dissipation(x, many, normalization="effective", direction=direction)
    assert_close(eff_D, s * tp.slope(x, many, normalization="effective", direction=direction))
    # softmax with H > 1: the two differ (the paper's 30–45 % gap at large H)
    D = tp.dissipation(x, many, direction=direction)
    G = tp.slope(x, many, direction=direction)
    assert (s * D - G).abs() > 1e-3 * G.abs()
    # heads with equal mobilities (identical heads) close again
    same = tp.Heads(one.score.expand(4, 3, 3))
    assert_close(tp.dissipation(x, same, direction=direction), s * tp.slope(x, same, direction=direction))


def test_effective_equals_softmax_for_one_head_or_equal_mobilities():
    x = sphere.sample_uniform(8, 3, generator=gen(21), dtype=torch.float64)
    one = tp.Heads.random(1, 3, generator=gen(22), dtype=torch.float64)
    assert_close(tp.velocity(x, one, normalization="effective"), tp.velocity(x, one))
    same = tp.Heads(one.score.expand(3, 3, 3), weights=torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    assert_close(tp.velocity(x, same, normalization="effective"), tp.velocity(x, same))


def test_mobility_and_energy_closed_forms():
    x = sphere.sample_uniform(5, 3, generator=gen(23), dtype=torch.float64)
    A = torch.randn(2, 3, 3, generator=gen(24), dtype=torch.float64)
    A = A + A.mT
    om = torch.tensor([0.3, 0.7], dtype=torch.float64)
    heads = tp.Heads(A, weights=om, beta=1.5)
    K = torch.exp(1.5 * torch.einsum("id,hde,je->hij", x, A, x))
    m, b = tp.mobility(x, heads)
    assert_close(m, K.mean(-1))
    assert_close(b, 1 / ((om / om.sum())[:, None] / K.mean(-1)).sum(0))
    assert_close(tp.energy(x, heads), (om * K.mean((-1, -2))).sum() / 3.0)
    assert_close(tp.head_energies(x, heads), K.mean((-1, -2)) / 3.0)
    assert_close(tp.log_energy(x, heads), torch.log(tp.energy(x, heads)))


def test_large_beta_softmax_is_finite():
    # (the "effective" field itself scales like max_h m_h / min_k m_k, which is e^{hundreds} here:
    # that is the field, not an overflow of the kernel, so it is not part of this check)
    x = sphere.sample_uniform(30, 3, generator=gen(25), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(26), dtype=torch.float64, scale=1.0)
    big = tp.Heads(heads.score * 100.0, beta=5.0)  # β‖A‖ ~ several hundred to a thousand
    for dt in (torch.float64, torch.float32):
        v = tp.velocity(x.to(dt), big.to(dt))
        assert torch.isfinite(v).all()
        lm, lb = tp.log_mobility(x.to(dt), big.to(dt))
        assert torch.isfinite(lm).all() and torch.isfinite(lb).all()
    assert torch.isfinite(tp.log_energy(x, big))
    # against torch.softmax (an independent, max-shifted implementation) in float64
    S = 5.0 * torch.einsum("id,hde,je->hij", x, big.score, x)
    P = torch.softmax(S, -1)
    f = torch.einsum("hij,hde,je->hid", P, big.score, x)
    F = f.mean(0)
    expect = F - (F * x).sum(-1, keepdim=True) * x
    assert_close(tp.velocity(x, big), expect, atol=1e-9, rtol=1e-9)
    assert_close(tp.velocity(x.float(), big.to(torch.float32)), expect.float(), atol=2e-2, rtol=1e-3)


def test_uniform_measure_is_stationary():
    # the uniform grid on S¹ with a rotation-invariant score, and the octahedron on S²
    x1 = sphere.circle_grid(16, dtype=torch.float64)
    for norm in NORMS:
        v = tp.velocity(x1, tp.Heads.scalar(torch.tensor([1.3, -0.4], dtype=torch.float64), 2), normalization=norm)
        assert_close(v, torch.zeros_like(v), atol=1e-13, rtol=0)
    oct_ = torch.cat([torch.eye(3), -torch.eye(3)]).double()
    A = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))[None]  # symmetric under x ↦ −x and axis flips
    for norm in NORMS:
        v = tp.velocity(oct_, tp.Heads(A), normalization=norm)
        assert_close(v, torch.zeros_like(v), atol=1e-13, rtol=0)


def test_rotation_and_permutation_equivariance():
    x = sphere.sample_uniform(10, 3, generator=gen(27), dtype=torch.float64)
    A = torch.randn(2, 3, 3, generator=gen(28), dtype=torch.float64)
    V = torch.randn(2, 3, 3, generator=gen(29), dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=gen(30), dtype=torch.float64))
    w = torch.softmax(torch.randn(10, generator=gen(31), dtype=torch.float64), 0)
    perm = torch.randperm(10, generator=gen(32))
    for norm in NORMS:
        tied = norm == "effective"  # the effective field needs V = A (untied values are refused)
        h = tp.Heads(A, None if tied else V)
        hr = tp.Heads(Q @ A @ Q.T, None if tied else Q @ V @ Q.T)
        v = tp.velocity(x, h, w, normalization=norm)
        assert_close(tp.velocity(x @ Q.T, hr, w, normalization=norm), v @ Q.T)
        assert_close(tp.velocity(x[perm], h, w[perm], normalization=norm), v[perm])
    assert_close(tp.energy(x @ Q.T, tp.Heads(Q @ A @ Q.T), w), tp.energy(x, tp.Heads(A), w))


def test_weighted_equals_repeated_tokens():
    x = sphere.sample_uniform(3, 3, generator=gen(33), dtype=torch.float64)
    w = torch.tensor([0.4, 0.2, 0.4], dtype=torch.float64)
    rep = x[[0, 0, 1, 2, 2]]
    heads = tp.Heads.random(2, 3, generator=gen(34), dtype=torch.float64)
    for norm in NORMS:
        assert_close(tp.velocity(x, heads, w, normalization=norm), tp.velocity(rep, heads, normalization=norm)[[0, 2, 3]])
        assert_close(tp.slope(x, heads, w, normalization=norm), tp.slope(rep, heads, normalization=norm))
        assert_close(tp.dissipation(x, heads, w, normalization=norm), tp.dissipation(rep, heads, normalization=norm))
    assert_close(tp.energy(x, heads, w), tp.energy(rep, heads))


def test_batched_tokens_heads_and_beta():
    x = sphere.sample_uniform(6, 3, batch_shape=(4,), generator=gen(35), dtype=torch.float64)
    A = tp.Heads.random(2, 3, batch_shape=(4,), generator=gen(36), dtype=torch.float64).score
    betas = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    batched = tp.velocity(x, tp.Heads(A, beta=betas))
    for b in range(4):
        assert_close(batched[b], tp.velocity(x[b], tp.Heads(A[b], beta=float(betas[b]))))
    E = tp.energy(x, tp.Heads(A, beta=betas))
    assert E.shape == (4,)
    assert_close(E[2], tp.energy(x[2], tp.Heads(A[2], beta=2.0)))


def test_radial_shadows_definition():
    x = sphere.sample_uniform(5, 3, generator=gen(37), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(38), dtype=torch.float64)
    f = tp.head_outputs(x, heads, normalization="unnormalized")
    a = tp.radial_shadows(x, heads)
    assert_close(a, (f * x).sum(-1))
    # the projected head output is the output minus its radial shadow
    assert_close(sphere.tangent_projection(x, f), f - a[..., None] * x)


def test_pairing_reuses_its_moment_only_for_the_same_tokens_and_statistics():
    """⟨∂_A E, M⟩ is linear in M through T_h = Σ_i w_i m_h(x_i) x_i ȳ_hiᵀ, which pairing keeps on the
    statistics for the solver's second call (Ȧ and the noise of one step).  Checked against the
    dense double sum ½ Σ_h ω_h Σ_ij w_i w_j e^{s_ij} ⟨x_i, M_h x_j⟩, for two M on the same statistics,
    after the tokens change in place (the kept moment must not be used) and on other weights."""
    import importlib

    energy_mod = importlib.import_module("transformer_pde.model.energy")
    x = sphere.sample_uniform(9, 3, generator=gen(11), dtype=torch.float64)
    A = torch.randn(4, 3, 3, generator=gen(12), dtype=torch.float64)
    A = A + A.transpose(-1, -2)
    heads = tp.Heads(A, weights=torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))
    w = torch.rand(9, generator=gen(13), dtype=torch.float64)
    w = w / w.sum()

    def dense(x, w, M):
        S = torch.einsum("ia,hab,jb->hij", x, A, x)
        Mx = torch.einsum("ia,hab,jb->hij", x, M, x)
        return 0.5 * (heads.weights * (torch.exp(S) * Mx * w[:, None] * w[None, :]).sum((-1, -2))).sum()

    M1, M2 = (torch.randn(4, 3, 3, generator=gen(s), dtype=torch.float64) for s in (14, 15))
    stats = tp.softmax_statistics(x, heads, w)
    for M in (M1, M2, M1):
        assert_close(energy_mod.pairing(x, heads, w, stats, M), dense(x, w, M), rtol=1e-13, atol=1e-14)
    # the moment was kept: per-token T (plain kernels) or the fused kernel's per-head sums ("sdpa")
    assert getattr(stats, "_pairing_moment", None) is not None or getattr(stats, "_moment_sums", None) is not None
    u = torch.full_like(w, 1.0 / 9)
    assert_close(energy_mod.pairing(x, heads, None, tp.softmax_statistics(x, heads), M2), dense(x, u, M2),
                 rtol=1e-13, atol=1e-14)
    # tokens moved in place: the kept T belongs to the old tokens and must be recomputed
    old = energy_mod.pairing(x, heads, w, stats, M2)
    x.mul_(-1.0)  # statistics unchanged (stale on purpose), so only the x factor of T flips sign
    assert_close(energy_mod.pairing(x, heads, w, stats, M2), -old, rtol=1e-13, atol=1e-14)


_FIRST_STEP = (
    "import sys, torch, transformer_pde as tp\n"
    "x0 = tp.sphere.octahedral(12, 3, dtype=torch.float64)\n"
    "h = tp.Heads.random(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)\n"
    "tp.simulate(x0, tp.OrnsteinUhlenbeck(h, rate=1.0, sigma=1.0), t1=0.02, dt=0.01, paths=2, seed=0, progress=False)\n"
    "tp.simulate(x0, h, t1=0.02, dt=0.01, method='heun', progress=False)\n"
    "tp.energy(x0, h); tp.velocity(x0, h)\n"
    "w = torch.full((12,), 1 / 12, dtype=torch.float64)\n"
    "tp.simulate(x0, tp.OrnsteinUhlenbeck(h, mean=torch.eye(3, dtype=torch.float64)), t1=0.02, dt=0.01, weights=w,\n"
    "            progress=False)\n"
    "tp.clustering.cluster_statistics(x0, w, gram_rank=False)\n"
    "print(sorted(m for m in ('sympy', 'scipy', 'matplotlib') if m in sys.modules))\n"
)


def test_first_heads_and_step_import_no_sympy():
    """The way to the first step imports nothing heavy: torch.broadcast_shapes imports sympy on its
    first call (through torch._refs' symbolic-shape guards, 0.4–2.5 s), so Heads and the solver setup use
    _validation.broadcast_shapes (token weights, OU means and the cluster statistics too); scipy and matplotlib are imported only by the functions that need them."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(__import__("os").environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _FIRST_STEP], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_broadcast_shapes_matches_torch():
    from transformer_pde.model.heads import broadcast_shapes

    for shapes in [((2, 1), (1, 3)), ((), (4,)), ((5, 1, 3), (2, 1)), ((0,), (1,)), (torch.Size([3, 1]), (3, 4)), ()]:
        assert broadcast_shapes(*shapes) == torch.broadcast_shapes(*shapes)
    for shapes in [((2,), (3,)), ((0,), (2,)), ((4, 2), (3, 1))]:
        with pytest.raises(RuntimeError):
            torch.broadcast_shapes(*shapes)
        with pytest.raises(RuntimeError):
            broadcast_shapes(*shapes)


# ==================================================================================================
# Causal fields against the prefix measure, the causal run's diagnostics against the whole measure, and
# the unnormalized field's overflow error.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
F64 = torch.float64


def test_velocity_passes_causal_through():
    """tp.velocity(causal=True) is the prefix-measure field: token i sees tokens j ≤ i only."""
    x = tp.sphere.sample_uniform(5, 3, generator=gen(8), dtype=F64)
    heads = tp.Heads.random(1, 3, generator=gen(9), dtype=F64)
    v = tp.velocity(x, heads, causal=True)
    for i in range(5):  # the i-th token's field from the prefix x[:i+1] alone, without causal
        vi = tp.velocity(x[: i + 1], heads)[i]
        assert_close(v[i], vi, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(v, tp.velocity(x, heads))


def test_causal_run_diagnostics_use_the_whole_measure():
    """Causal attention moves the tokens with the prefix kernel, but the energy belongs to the whole
    measure: 𝒟 = Σ_i ⟨∂E/∂x_i, v_i⟩ with ∂E/∂x_i by autograd of the dense energy (all pairs), for tied
    symmetric heads (where the library reuses V ȳ between the field and the first variation — only
    without causality) and token weights."""
    from problems import naive_energy
    x = tp.sphere.sample_uniform(6, 3, generator=gen(101), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(102), dtype=torch.float64, beta=1.3,
                            weights=torch.tensor([0.4, 1.2], dtype=torch.float64))
    assert heads.tied and heads.is_symmetric
    w = torch.rand(6, generator=gen(103), dtype=torch.float64) + 0.2
    w = w / w.sum()
    ev = tp.evaluate(x, heads, w, normalization="softmax", causal=True)
    xg = x.clone().requires_grad_(True)
    naive_energy(xg, heads.score_matrix, heads.weights, 1.3, w).backward()
    assert_close(ev.dissipation, (xg.grad * ev.velocity).sum(), rtol=1e-12, atol=1e-14)


def test_unnormalized_velocity_that_overflows_raises_with_the_fix():
    x = tp.sphere.sample_uniform(5, 3, generator=gen(97), dtype=torch.float32)
    heads = tp.Heads(torch.eye(3, dtype=torch.float32)[None], beta=200.0)
    with pytest.raises(OverflowError, match="'unnormalized' field overflows torch.float32.*use normalization='softmax'"):
        tp.velocity(x, heads, normalization="unnormalized")


# ---------------------------------------------------------------------------- the merged fused kernel
# With keys shared by the heads the fused CPU kernel runs with the heads folded into the query axis: its output
# comes back (..., n, H, E), the field, E, b, 𝒟 and the ledger's sums are products of that block, and the per-head
# arrays (ȳ_h, V_h ȳ_h, ∇δE/δμ) are formed only on request.  Each check is against the dense backend, whose
# numbers come from explicit (..., H, n, n) score tensors.
from transformer_pde.model import backends as _backends, moments as _moments, softmax as _softmax  # noqa: E402
from transformer_pde.model import field as _field  # noqa: E402
from transformer_pde.model.energy import ito_correction, pairing  # noqa: E402

_HAS_SDPA = _backends.sdpa_available("cpu", torch.float64)


_tol = tolerances(ulps=50.0)


@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("normalization", ["softmax", "unnormalized"])
def test_merged_kernel_diagnostics_match_dense(dtype, d, weighted, normalization):
    """Every output of a diagnostics evaluation from the merged layout equals the dense backend's, with the
    heads unbatched against batched tokens (the broadcast of the query features' product); the per-head
    arrays are not formed by the evaluation and the ledger's reads, and are right when asked for."""
    x = sphere.sample_uniform(13, d, generator=gen(40), dtype=torch.float64).expand(3, 13, d) * 1.0
    x = sphere.normalize(x + 0.3 * torch.randn(3, 13, d, generator=gen(41), dtype=torch.float64))
    A = torch.randn(5, d, d, generator=gen(42), dtype=torch.float64)
    om = torch.softmax(torch.randn(5, generator=gen(43), dtype=torch.float64), 0)
    heads = tp.Heads((A + A.transpose(-1, -2)).to(dtype), weights=om.to(dtype), beta=0.8)
    x = x.to(dtype)
    w = torch.softmax(torch.randn(3, 13, generator=gen(44), dtype=torch.float64), -1).to(dtype) if weighted else None
    M = torch.randn(5, d, d, generator=gen(45), dtype=torch.float64).to(dtype)
    kw = dict(normalization=normalization, sign=-1.0, second_moment=True, log_scale=0.5)
    fast = _field.evaluate(x, heads, w, backend="sdpa", **kw)
    slow = _field.evaluate(x, heads, w, backend="dense", **kw)
    assert "_merged" in fast.stats.__dict__
    p_fast, i_fast = pairing(x, heads, w, fast.stats, M, log_scale=0.5), ito_correction(heads, w, fast.stats, 0.7,
                                                                                         log_scale=0.5)
    # nothing per head was formed on the way (the solvers' step reads exactly these)
    assert fast.stats.__dict__.get("_mean") is None and fast.stats.__dict__.get("_second") is None
    assert callable(fast.__dict__["_outputs"]) and callable(fast.__dict__["_grad_first_variation"])
    tol = _tol(dtype)
    for key in ("velocity", "energy", "slope", "dissipation", "ambient", "grad_first_variation", "outputs"):
        assert_close(getattr(fast, key), getattr(slow, key), **tol)
    assert_close(fast.stats.mean, slow.stats.mean, **tol)
    assert_close(fast.stats.second, slow.stats.second, **tol)
    assert_close(fast.stats.log_partition, slow.stats.log_partition, **tol)
    assert_close(p_fast, pairing(x, heads, w, slow.stats, M, log_scale=0.5), **tol)
    assert_close(i_fast, ito_correction(heads, w, slow.stats, 0.7, log_scale=0.5), **tol)


@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("gradient_first", [False, True])
def test_merged_dissipation_of_tokens_off_the_sphere(gradient_first):
    """Tokens of norm 1.5 (the flat dynamics): V = P_x f is not orthogonal to x there, so 𝒟 must pair V with
    the projected gradient P_x ∇δE/δμ, whichever of 𝒟 and ∇_S δE/δμ is read first: the dense backend's."""
    x = 1.5 * sphere.sample_uniform(11, 3, batch_shape=(2,), generator=gen(46), dtype=torch.float64)
    A = torch.randn(4, 3, 3, generator=gen(47), dtype=torch.float64)
    heads = tp.Heads(A + A.transpose(-1, -2), beta=0.6)
    fast = _field.evaluate(x, heads, None, backend="sdpa")
    slow = _field.evaluate(x, heads, None, backend="dense")
    assert "_merged" in fast.stats.__dict__
    if gradient_first:
        fast.grad_first_variation
    assert_close(fast.dissipation, slow.dissipation, **_tol(torch.float64))
    assert_close(fast.grad_first_variation, slow.grad_first_variation, **_tol(torch.float64))


@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
def test_block_products_do_not_depend_on_the_block_size(monkeypatch):
    """The m-weighted products of the merged block, formed a block of tokens at a time, against one einsum of
    the whole (..., n, H, E) block: one-token blocks, blocks that do not divide n, and one block."""
    g = gen(50)
    out = torch.randn(2, 3, 17, 4, 8, generator=g, dtype=torch.float64)
    mc = torch.rand(2, 3, 17, 4, generator=g, dtype=torch.float64)
    left = torch.randn(3, 11, 17, generator=g, dtype=torch.float64)  # broadcast over the first batch axis
    right = torch.randn(2, 3, 32, 3, generator=g, dtype=torch.float64)
    Y = (out * mc.unsqueeze(-1)).reshape(2, 3, 17, 32)
    want_l, want_r = left @ Y, Y @ right
    for block in (1, 5 * 32 * 8 * 6, 1 << 30):
        monkeypatch.setattr(_moments, "_BLOCK_BYTES", block)
        got_l, got_r = _moments._weighted_block_products(out, mc, left, right)
        assert_close(got_l, want_l, rtol=1e-13, atol=1e-13)
        assert_close(got_r, want_r, rtol=1e-13, atol=1e-13)
        assert_close(_moments._weighted_block_products(out, mc, left=left), want_l, rtol=1e-13, atol=1e-13)
        assert_close(_moments._weighted_block_products(out, mc, right=right), want_r, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mobility_from_masses_and_its_log_sum_exp_fallback(dtype):
    """b e^{−c} = 1/Σ_h ω̄_h e^{c − log m_h}: the matrix-vector form for normal masses, and the log-sum-exp
    where a mass is below tiny/eps (full precision lost) or NaN — against an independent float64 formula."""
    fi = torch.finfo(dtype)
    heads = tp.Heads(torch.eye(2, dtype=dtype).expand(3, 2, 2), weights=torch.tensor([0.5, 0.3, 0.2], dtype=dtype))
    for logm in ([[0.1, -2.0, 3.0], [1.0, 1.0, 1.0]],
                 [[math.log(fi.tiny) - 3.0, 0.0, 1.0], [math.log(fi.tiny) + 2.0, -1.0, 0.5]]):
        m = torch.exp(torch.tensor(logm, dtype=torch.float64)).to(dtype)  # (n = 2, H = 3); subnormal entries
        logw = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
        want = torch.exp(-torch.logsumexp(logw - torch.log(m.double()), -1))  # of the masses as given
        got = _field.scaled_mobility(heads, torch.log(m).transpose(-1, -2), m.transpose(-1, -2), 0.0)
        # e^{−L} from a log L rounded in the dtype: relative error |L|·eps (|L| ≈ 90 in float32 below tiny)
        rtol = 4 * fi.eps * (2 + float(torch.log(want).abs().max()))
        assert_close(got.double(), want, rtol=rtol, atol=0.0)
    m_nan = torch.tensor([[1.0], [float("nan")], [1.0]], dtype=dtype)  # (H = 3, n = 1)
    nan = _field.scaled_mobility(heads, torch.log(m_nan), m_nan, 0.0)
    assert torch.isnan(nan).all()


def test_field_eval_replace_keeps_deferred_fields():
    x = sphere.sample_uniform(7, 3, generator=gen(60), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(61), dtype=torch.float64)
    ev = _field.evaluate(x, heads, diagnostics=True)
    new = ev.replace(energy=ev.energy + 1.0)
    assert_close(new.energy, ev.energy + 1.0)
    assert new.velocity is ev.velocity
    if _HAS_SDPA:
        assert callable(new.__dict__["_outputs"])
    assert_close(new.outputs, tp.head_outputs(x, heads))
    with pytest.raises(TypeError, match="no field 'energie'"):
        ev.replace(energie=1.0)


def test_query_workspace_is_reused_per_thread_and_shape():
    """The merged kernel's query features go into one buffer per thread (no fresh 13 MB allocation per step):
    the same buffer for the same shape and dtype, a new one when either changes, another in another thread —
    and consecutive calls on different tokens still give their own statistics."""
    import threading
    a = _softmax._workspace("t", (2, 3), torch.zeros(1, dtype=torch.float64))
    assert _softmax._workspace("t", (2, 3), torch.zeros(1, dtype=torch.float64)) is a
    assert _softmax._workspace("t", (2, 4), torch.zeros(1, dtype=torch.float64)) is not a
    assert _softmax._workspace("t", (2, 4), torch.zeros(1, dtype=torch.float32)).dtype == torch.float32
    other = []
    th = threading.Thread(target=lambda: other.append(_softmax._workspace("t", (2, 4), torch.zeros(1))))
    th.start()
    th.join()
    assert other[0] is not _softmax._workspace("t", (2, 4), torch.zeros(1))
    heads = tp.Heads.random(4, 3, generator=gen(70), dtype=torch.float64)
    x1 = sphere.sample_uniform(9, 3, generator=gen(71), dtype=torch.float64).expand(2, 9, 3).contiguous()
    x2 = sphere.sample_uniform(9, 3, generator=gen(72), dtype=torch.float64).expand(2, 9, 3).contiguous()
    s1 = tp.softmax_statistics(x1, heads, second_moment=True, backend="auto")
    s2 = tp.softmax_statistics(x2, heads, second_moment=True, backend="auto")
    for x, s in ((x1, s1), (x2, s2)):
        ref = tp.softmax_statistics(x, heads, second_moment=True, backend="dense")
        assert_close(s.mean, ref.mean, **_tol(torch.float64))
        assert_close(s.log_partition, ref.log_partition, **_tol(torch.float64))


def test_deferred_fields_are_formed_once():
    """The deferred per-head arrays are formed on first access and then kept: the same tensor on every
    later access (FieldEval.outputs, FieldEval.grad_first_variation, HeadStats.mean), and equal to the dense
    backend's."""
    x = sphere.sample_uniform(8, 3, generator=gen(80), dtype=torch.float64).expand(2, 8, 3).contiguous()
    heads = tp.Heads.random(3, 3, generator=gen(81), dtype=torch.float64)
    ev = _field.evaluate(x, heads, diagnostics=True, second_moment=True)
    ref = _field.evaluate(x, heads, diagnostics=True, second_moment=True, backend="dense")
    for get in (lambda e: e.outputs, lambda e: e.grad_first_variation, lambda e: e.stats.mean):
        first = get(ev)
        assert first is not None and get(ev) is first
        assert_close(first, get(ref), **_tol(torch.float64))
    # the field itself keeps what it formed: a deferred value is computed once, however often it is read
    calls = []

    def make():
        calls.append(1)
        return torch.zeros(2, 8, 3, dtype=torch.float64)

    fe = tp.FieldEval(ev.velocity, ev.stats, make, make, dissipation=make)
    for _ in range(3):
        fe.outputs, fe.grad_first_variation, fe.dissipation
    assert len(calls) == 3


def test_scaled_partition_is_kept_per_scale():
    """m_h e^{−c} of the statistics: e^{log m − c} to rounding, the same tensor for the same c (the diagnostics,
    the pairing and the Itô sums share it), another one for another c or after the log-partition changed."""
    x = sphere.sample_uniform(6, 3, generator=gen(82), dtype=torch.float64)
    stats = tp.softmax_statistics(x, tp.Heads.random(2, 3, generator=gen(83), dtype=torch.float64))
    a = _moments.scaled_partition(stats, 1.5)
    assert_close(a, torch.exp(stats.log_partition - 1.5), rtol=4 * torch.finfo(torch.float64).eps, atol=0.0)
    assert _moments.scaled_partition(stats, 1.5) is a
    b = _moments.scaled_partition(stats, 0.0)
    assert b is not a and _moments.scaled_partition(stats, 0.0) is b
    assert_close(b, torch.exp(stats.log_partition), rtol=4 * torch.finfo(torch.float64).eps, atol=0.0)
    stats.log_partition.add_(1.0)  # an in-place change: not the kept value any more
    assert_close(_moments.scaled_partition(stats, 0.0), torch.exp(stats.log_partition),
                 rtol=4 * torch.finfo(torch.float64).eps, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("c", [0.0, 3.5])
def test_scaled_mobility_against_the_log_sum_exp(dtype, c):
    """b e^{−c} from the (..., H, n) and the (..., n, H) masses, in the normal range (matrix-vector form) and
    with masses below tiny/eps (log-sum-exp), at c = 0 and c ≠ 0, against exp(−logsumexp(log ω̄ − lse) − c)."""
    fi = torch.finfo(dtype)
    w = torch.tensor([0.5, 0.3, 0.2], dtype=dtype)
    heads = tp.Heads(torch.eye(2, dtype=dtype).expand(3, 2, 2), weights=w)
    for lse in ([[0.1, 1.0], [-2.0, 1.0], [3.0, 1.0]],
                [[c + math.log(fi.tiny) - 3.0, c + 0.5], [c, c + math.log(fi.tiny) + 1.0], [c + 1.0, c - 1.0]]):
        lse = torch.tensor(lse, dtype=dtype)  # (H = 3, n = 2)
        m = torch.exp(lse - c)
        want = torch.exp(-torch.logsumexp(torch.log(w.double()).unsqueeze(-1) - lse.double(), -2) - c)
        rtol = 4 * fi.eps * (2 + float(torch.log(want).abs().max()))
        assert_close(_field.scaled_mobility(heads, lse, m, c).double(), want, rtol=rtol, atol=0.0)
        m_nh = m.transpose(-1, -2).contiguous().transpose(-1, -2)  # (H, n) view of (n, H) masses, as merged
        assert_close(_field.scaled_mobility(heads, lse, m_nh, c).double(), want, rtol=rtol, atol=0.0)


@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_head_keys_keep_the_per_head_layout(dtype):
    """Heads with their own key factors K_h cannot share the query axis: the fused kernel runs one kernel head
    per head, the mean is copied out of its wider output on first use (M_h ȳ_h from the output itself before),
    and every output of a diagnostics evaluation equals the dense backend's."""
    g = gen(90)
    Q = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).to(dtype)
    K = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).to(dtype)
    x = sphere.sample_uniform(11, 3, generator=gen(91), dtype=torch.float64).expand(2, 11, 3).contiguous().to(dtype)
    for heads in (tp.Heads(query=Q, key=Q), tp.Heads(query=Q, key=K)):
        fast = _field.evaluate(x, heads, diagnostics=True, second_moment=True, backend="sdpa", log_scale=0.7)
        assert "_columns" in fast.stats.__dict__ and "_merged" not in fast.stats.__dict__
        slow = _field.evaluate(x, heads, diagnostics=True, second_moment=True, backend="dense", log_scale=0.7)
        for key in ("velocity", "energy", "slope", "dissipation", "grad_first_variation", "outputs"):
            assert_close(getattr(fast, key), getattr(slow, key), **_tol(dtype))
        stats = tp.softmax_statistics(x, heads, second_moment=True, backend="sdpa")
        assert stats.__dict__.get("_mean") is None
        applied = _moments.mean_applied(stats, V)  # from the wide output, the mean not formed
        assert stats.__dict__.get("_mean") is None
        ref = tp.softmax_statistics(x, heads, second_moment=True, backend="dense")
        assert_close(applied, ref.mean @ V.transpose(-1, -2), **_tol(dtype))
        assert_close(_moments.mean_applied(ref, V), ref.mean @ V.transpose(-1, -2), **_tol(dtype))


@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
@pytest.mark.skipif(not _HAS_SDPA, reason="no fused CPU kernel in this torch")
def test_merged_sums_are_kept_per_weights_and_declined_under_autograd():
    """head_moment_sums of merged statistics: the same tensors on a second call with the same weights (kept on
    the statistics), formed again for another weights tensor (equal values: the same numbers), None for weights
    that require grad (the caller's per-token path differentiates), and no Itô sum without the second moment."""
    x = sphere.sample_uniform(9, 3, batch_shape=(2,), generator=gen(105), dtype=torch.float64)
    A = torch.randn(3, 3, 3, generator=gen(106), dtype=torch.float64)
    heads = tp.Heads(A + A.transpose(-1, -2))
    w = torch.softmax(torch.randn(2, 9, generator=gen(107), dtype=torch.float64), -1)
    stats = tp.softmax_statistics(x, heads, w)
    assert "_merged" in stats.__dict__
    T, ito = _moments.head_moment_sums(stats, w)
    assert ito is None
    assert _moments.head_moment_sums(stats, w)[0] is T
    other = w.clone()
    T2 = _moments.head_moment_sums(stats, other)[0]
    assert T2 is not T
    assert_close(T2, T, **_tol(torch.float64))
    assert _moments.head_moment_sums(stats, other.clone().requires_grad_()) is None


def test_merged_sums_only_for_their_own_tokens_and_weights():
    """The merged kernel's per-head sums belong to the queries and token weights they were formed with: paired
    with other tokens, the pairing uses those tokens (the per-token path); after an in-place change of the
    weights, the kept sums are not reused."""
    x = sphere.sample_uniform(9, 3, generator=gen(100), dtype=torch.float64).expand(2, 9, 3).contiguous()
    heads = tp.Heads.random(3, 3, generator=gen(101), dtype=torch.float64)
    M = torch.randn(3, 3, 3, generator=gen(102), dtype=torch.float64)
    w = torch.softmax(torch.randn(2, 9, generator=gen(103), dtype=torch.float64), -1)
    stats = tp.softmax_statistics(x, heads, w, second_moment=True)
    assert "_merged" in stats.__dict__
    other = sphere.normalize(x + 0.1)  # other queries paired with these statistics
    mw = torch.exp(stats.log_partition) * w.unsqueeze(-2)
    want = 0.5 * (heads.weights * ((mw.unsqueeze(-1) * stats.mean).transpose(-1, -2) @ other.unsqueeze(-3)
                                   ).transpose(-1, -2).mul(M).sum((-1, -2))).sum(-1)
    assert_close(pairing(other, heads, w, stats, M), want, **_tol(torch.float64))
    first = pairing(x, heads, w, stats, M)
    w2 = torch.softmax(torch.randn(2, 9, generator=gen(104), dtype=torch.float64), -1)
    w.copy_(w2)  # same tensor, new values: the weights' version changed
    mw2 = torch.exp(stats.log_partition) * w2.unsqueeze(-2)  # stats' kernel masses, the new token weights
    want2 = 0.5 * (heads.weights * ((mw2.unsqueeze(-1) * stats.mean).transpose(-1, -2) @ x.unsqueeze(-3)
                                    ).transpose(-1, -2).mul(M).sum((-1, -2))).sum(-1)
    got2 = pairing(x, heads, w, stats, M)
    assert not torch.allclose(got2, first)
    assert_close(got2, want2, **_tol(torch.float64))
