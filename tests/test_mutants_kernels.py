"""Oracle tests for the survivors of the mutation pass in attention, field and mobility
(docs/MUTATION_REPORT.md, verdicts in docs/mutation/verdicts/kernels.json).  Each test checks the
library against a dense formula written here from docs/model.md, or checks the exact wording and the
reported logarithm of an overflow error, at parameters where a slip cannot hide: β ≠ 1, head
weights ω not summing to 1, non-uniform token weights, batch axes of their own length."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_energy
from transformer_pde.mobility import scaled_diagnostics

F64 = torch.float64


# ---------------------------------------------------------------------------- causal softmax kernel
def _naive_causal_stats(x, scores, w):
    """Prefix-measure statistics from the dense scores s_hij (..., H, n, n) and token weights
    w (..., n): log m_h(x_i) = log Σ_{j≤i} w_j e^{s_ij} − log Σ_{j≤i} w_j, ȳ_h(x_i) = Σ_{j≤i} p_ij x_j."""
    n = x.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()  # j <= i
    K = torch.where(keep, torch.exp(scores), torch.zeros((), dtype=x.dtype)) * w.unsqueeze(-2).unsqueeze(-3)
    W = torch.where(keep, w.unsqueeze(-2), torch.zeros((), dtype=x.dtype)).sum(-1)  # (..., n) prefix mass
    Z = K.sum(-1)
    return torch.log(Z) - torch.log(W).unsqueeze(-2), torch.einsum("...hij,...jd->...hid", K, x) / Z.unsqueeze(-1)


@pytest.mark.parametrize("scale", [1.0, 160.0], ids=["shift-free", "max-shift"])
@pytest.mark.parametrize("weighted", [True, False])
def test_causal_chunked_statistics_over_several_blocks(scale, weighted):
    """backend="chunked" with a small chunk_elements (two query rows per score block) and
    causal=True: the per-block causal mask and the prefix-mass normalisation log W_i against the
    dense prefix formulas, for a batch of two members (own tokens, own token weights), H = 3 ≠ 2
    heads, β = 1.7.  scale = 160 puts |s_ij| (≤ β‖A‖ ≈ 400) above the shift-free bound
    (½ log finfo.max − log n ≈ 353), so the blocks take the max-shift branch; the dense exp is
    still finite in float64 (scores < 709)."""
    beta = 1.7
    x = tp.sphere.sample_uniform(6, 3, generator=gen(60), dtype=F64)
    x = torch.stack([x, tp.sphere.sample_uniform(6, 3, generator=gen(61), dtype=F64)])
    A = torch.randn(3, 3, 3, generator=gen(62), dtype=F64)
    A = scale * A / torch.linalg.matrix_norm(A, ord=2).unsqueeze(-1).unsqueeze(-1)  # ‖A_h‖₂ = scale
    heads = tp.Heads(A, beta=beta)
    if weighted:
        w = torch.rand(2, 6, generator=gen(63), dtype=F64) + 0.1
        w = w / w.sum(-1, keepdim=True)
    else:
        w = None
    scores = beta * torch.einsum("bid,hde,bje->bhij", x, A, x)
    want_lse, want_mean = _naive_causal_stats(x, scores, torch.full((2, 6), 1 / 6, dtype=F64) if w is None else w)
    got = tp.attention.softmax_statistics(x, heads, w, backend="chunked", chunk_elements=2 * 6, causal=True)
    # float64 sums of ≤ 6 positive terms: relative error ~1e-15 of log m (≤ 700 in the max-shift case)
    assert_close(got.log_partition, want_lse, rtol=1e-12, atol=1e-12)
    assert_close(got.mean, want_mean, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- causal ReLU gradients
def test_causal_relu_statistics_differentiate_to_the_key_factor_alone():
    """Factored heads (β⟨Q_h x_i, K_h x_j⟩) where only the key factor K requires grad, causal=True:
    mass_h(x_i) = Σ_{j≤i} w_j ReLU(s_ij)/W_i and first_h(x_i) = Σ_{j≤i} w_j ReLU(s_ij) x_j/W_i, and
    the gradient of a loss of both with respect to K, against autograd of the dense formula."""
    beta = 1.3
    x = tp.sphere.sample_uniform(5, 3, generator=gen(70), dtype=F64)
    Q = torch.randn(2, 2, 3, generator=gen(71), dtype=F64)
    K0 = torch.randn(2, 2, 3, generator=gen(72), dtype=F64)
    Vv = torch.randn(2, 3, 3, generator=gen(73), dtype=F64)
    w = torch.rand(5, generator=gen(74), dtype=F64) + 0.1
    w = w / w.sum()
    R1 = torch.randn(2, 5, generator=gen(75), dtype=F64)  # arbitrary loss weights
    R2 = torch.randn(2, 5, 3, generator=gen(76), dtype=F64)

    def loss(mass, first):
        return (R1 * mass).sum() + (R2 * first).sum()

    K = K0.clone().requires_grad_(True)
    heads = tp.Heads(None, Vv, beta=beta, query=Q, key=K)
    mass, first = tp.attention.relu_statistics(x, heads, w, causal=True)
    (gK,) = torch.autograd.grad(loss(mass, first), K)

    Kr = K0.clone().requires_grad_(True)
    s = beta * torch.einsum("hkd,id,hke,je->hij", Q, x, Kr, x)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    Rl = torch.where(keep, torch.relu(s), torch.zeros((), dtype=F64)) * w
    W = torch.cumsum(w, 0)  # prefix masses W_i = Σ_{j≤i} w_j
    want_mass = Rl.sum(-1) / W
    want_first = torch.einsum("hij,jd->hid", Rl, x) / W.unsqueeze(-1)
    (want_gK,) = torch.autograd.grad(loss(want_mass, want_first), Kr)
    assert_close(mass.detach(), want_mass.detach(), rtol=1e-12, atol=1e-14)
    assert_close(first.detach(), want_first.detach(), rtol=1e-12, atol=1e-14)
    assert_close(gK, want_gK, rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------- scaled diagnostics
def test_scaled_diagnostics_with_two_batch_axes():
    """scaled_diagnostics for symmetric heads of batch shape (2, 2) (H = 2, d = 3: no axis length
    repeats), β = 1.3, ω = (0.4, 1.5), per-member token weights and an arbitrary tangent field V,
    at c = 0: E, 𝒢², 𝒟 and ∇_S δE/δμ of every member against the dense formulas, with ∇ δE/δμ from
    autograd of the naive energy (∂E/∂x_i = w_i ∇ δE/δμ(x_i))."""
    beta = 1.3
    om = torch.tensor([0.4, 1.5], dtype=F64)
    x = tp.sphere.sample_uniform(2 * 2 * 5, 3, generator=gen(80), dtype=F64).reshape(2, 2, 5, 3)
    A = 0.7 * torch.randn(2, 2, 2, 3, 3, generator=gen(81), dtype=F64)
    A = 0.5 * (A + A.transpose(-1, -2))
    heads = tp.Heads(A, weights=om, beta=beta)
    w = torch.rand(2, 2, 5, generator=gen(82), dtype=F64) + 0.1
    w = w / w.sum(-1, keepdim=True)
    V = torch.randn(2, 2, 5, 3, generator=gen(83), dtype=F64)
    V = V - (V * x).sum(-1, keepdim=True) * x
    stats = tp.attention.softmax_statistics(x, heads, w)
    E, G, D, g = scaled_diagnostics(x, heads, w, V, stats)
    for a in range(2):
        for b in range(2):
            xk, Ak, wk, Vk = x[a, b], A[a, b], w[a, b], V[a, b]
            xr = xk.clone().requires_grad_(True)
            (dEdx,) = torch.autograd.grad(naive_energy(xr, Ak, om, beta, wk), xr)
            grad = dEdx / wk.unsqueeze(-1)
            grad = grad - (grad * xk).sum(-1, keepdim=True) * xk
            m = (torch.exp(beta * torch.einsum("id,hde,je->hij", xk, Ak, xk)) * wk).sum(-1)  # m_h(x_i)
            bmob = 1.0 / ((om / om.sum()).unsqueeze(-1) / m).sum(-2)
            assert_close(E[a, b], naive_energy(xk, Ak, om, beta, wk), rtol=1e-12, atol=0)
            assert_close(g[a, b], grad, rtol=1e-10, atol=1e-13)
            assert_close(G[a, b], (wk * bmob * Vk.square().sum(-1)).sum(), rtol=1e-12, atol=0)
            assert_close(D[a, b], (dEdx * Vk).sum(), rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------- overflow messages
_REPORT = r"overflows {dtype}: its logarithm is up to ([-+0-9.e]+), and minus log_scale = ([-+0-9.e]+) that exceeds"


def _reported(err, what, dtype):
    """(log value, log_scale) reported by an OverflowError whose message must START with ``what``."""
    m = re.match(re.escape(what) + " " + _REPORT.format(dtype=re.escape(str(dtype))), str(err.value))
    assert m is not None, str(err.value)
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("c", [0.0, -5.0])
def test_slope_and_dissipation_overflow_errors_name_their_quantity(c):
    """At β‖A‖ where m_h still fits float64 (max log m_h ≈ 707.7 < 709.78) but 𝒢² and 𝒟 do not
    (≈ e^711.7), tp.slope and tp.dissipation raise OverflowError naming their own quantity, with the
    matching hint (the result is 𝒢²·e^(−c) / 𝒟·e^(−c)), and report the largest log m_h — computed
    here densely by log-sum-exp — and the log_scale passed (0: the diagnostics pass; −5: the
    scaled path).  With log_scale = 700 both are finite."""
    th, beta = 0.05, 2.0
    x = torch.tensor([[1.0, 0.0, 0.0], [math.cos(th), math.sin(th), 0.0], [math.cos(th), 0.0, math.sin(th)]],
                     dtype=F64)
    lam = torch.tensor([354.0, 353.7], dtype=F64)  # scores β λ_h cos θ ≈ 707
    A = lam[:, None, None] * torch.eye(3, dtype=F64)
    heads = tp.Heads(A, weights=torch.tensor([0.3, 1.4], dtype=F64), beta=beta)
    w = torch.tensor([0.5, 0.2, 0.3], dtype=F64)
    log_m = torch.logsumexp(beta * torch.einsum("id,hde,je->hij", x, A, x) + torch.log(w), -1)
    cases = [(tp.slope, "the metric slope 𝒢²", "(the result is 𝒢²·e^(−c))"),
             (tp.dissipation, "the dissipation 𝒟", "(the result is 𝒟·e^(−c))")]
    for fn, what, hint in cases:
        with pytest.raises(OverflowError) as err:
            fn(x, heads, w, log_scale=c)
        got, scale = _reported(err, what, F64)
        assert hint in str(err.value)
        assert scale == c
        assert abs(got - float(log_m.max())) <= 6e-4  # printed with 6 significant digits (707.652)
        assert bool(torch.isfinite(fn(x, heads, w, log_scale=700.0)))


def test_mobility_overflow_errors_name_m_and_b():
    """tp.mobility raises OverflowError naming the quantity that overflows, with the log_mobility
    hint and the logarithm reached.
    (1) m_h: float32, β = 130, ‖A_h‖ ≈ 1: max log m_h (dense float64 log-sum-exp) ≈ 130 > 88.7.
    (2) b: b = (Σ_h ω̄_h/m_h)^{-1} ≤ max_h m_h, yet in float32 log b can round one ulp above
    max_h log m_h.  One token x = e₁, two heads with A_h = (L/β)·I, where L is the largest float32
    whose exp is finite: log m_h = L exactly, m_h = e^L is finite, while the computed log b is L + 1 ulp
    for these ω, so only b overflows: the message must name b (not m_h) and report log b ≈ L."""
    x64 = tp.sphere.sample_uniform(6, 3, generator=gen(90), dtype=F64)
    A = 0.3 * torch.randn(3, 3, 3, generator=gen(91), dtype=F64) + torch.eye(3, dtype=F64)
    om = torch.tensor([0.7, 1.6, 1.0], dtype=F64)
    beta = 130.0
    log_m = torch.logsumexp(beta * torch.einsum("id,hde,je->hij", x64, A, x64), -1) - math.log(6)
    heads = tp.Heads(A, weights=om, beta=beta).to(torch.float32)
    with pytest.raises(OverflowError) as err:
        tp.mobility(x64.float(), heads)
    got, scale = _reported(err, "the per-head mobility m_h", torch.float32)
    assert scale == 0.0 and "tp.log_mobility" in str(err.value)
    assert abs(got - float(log_m.max())) <= 1e-4 * float(log_m.max())  # float32 log-partition

    f32 = torch.float32
    L = torch.tensor(math.log(torch.finfo(f32).max), dtype=f32)
    while not bool(torch.isfinite(torch.exp(L))):
        L = torch.nextafter(L, torch.zeros((), dtype=f32))
    beta = 2.0  # L / 2 is exact: β·A_h = L·I
    heads = tp.Heads((L / beta) * torch.eye(3, dtype=f32).expand(2, 3, 3),
                     weights=torch.tensor([0.0008836332126520574, 0.6595015525817871], dtype=f32), beta=beta)
    x = torch.tensor([[1.0, 0.0, 0.0]], dtype=f32)
    lm, lb = tp.log_mobility(x, heads)
    if bool(torch.isfinite(torch.exp(lb)).all()) or not bool(torch.isfinite(torch.exp(lm)).all()):
        pytest.skip("this torch rounds log b to max log m_h: b's overflow is not reached")  # pragma: no cover
    with pytest.raises(OverflowError) as err:
        tp.mobility(x, heads)
    got, scale = _reported(err, "the effective mobility b", f32)
    assert scale == 0.0 and "tp.log_mobility" in str(err.value)
    # log b = L exactly (equal m_h): printed with 6 significant digits
    assert abs(got - float(L)) <= 1e-4


def test_scaled_diagnostics_match_evaluate_bit_for_bit_for_nearly_symmetric_heads():
    """Heads.symmetric accepts D with |D − Dᵀ| ≤ 1e-10·max|D| and flags the heads symmetric, so
    A_h ≠ A_hᵀ in the last bits.  scaled_diagnostics at c = 0 is documented to give evaluate's
    diagnostics bit for bit for symmetric heads: both must apply the same matrix A_h to ȳ_h
    (A_hᵀ ȳ_h differs here by ~1e-11 relative, far above float64 rounding).  Also the dense
    formula ∇_S δE/δμ(x_i) = P_{x_i} Σ_h ω_h Σ_j w_j e^{β⟨x_i, A_h x_j⟩} A_h x_j, to 1e-13 relative
    (sums of 7 positive terms in float64), β = 1.3, ω = (0.4, 1.5, 0.8), non-uniform token weights."""
    beta = 1.3
    om = torch.tensor([0.4, 1.5, 0.8], dtype=F64)
    x = tp.sphere.sample_uniform(7, 3, generator=gen(100), dtype=F64)
    D0 = torch.randn(3, 3, 3, generator=gen(101), dtype=F64)
    D0 = D0 + D0.transpose(-1, -2)
    skew = torch.randn(3, 3, 3, generator=gen(102), dtype=F64)
    skew = (skew - skew.transpose(-1, -2)) / (skew - skew.transpose(-1, -2)).abs().max()  # max |entry| = 1
    D = D0 + 2e-11 * D0.abs().max() * skew  # |D − Dᵀ| = 4e-11 max|D0|: accepted (< 1e-10 max|D|)
    heads = tp.Heads.symmetric(D, beta=beta, weights=om)
    assert heads.is_symmetric and not torch.equal(D, D.transpose(-1, -2))
    w = torch.rand(7, generator=gen(103), dtype=F64) + 0.1
    w = w / w.sum()
    ev = tp.field.evaluate(x, heads, w)
    E, G, Dm, g = scaled_diagnostics(x, heads, w, ev.velocity, ev.stats)
    assert torch.equal(g, ev.grad_first_variation)
    assert torch.equal(E, ev.energy) and torch.equal(G, ev.slope) and torch.equal(Dm, ev.dissipation)
    K = torch.exp(beta * torch.einsum("id,hde,je->hij", x, D, x)) * w  # w_j e^{β⟨x_i, A_h x_j⟩}
    u = (om[:, None, None] * torch.einsum("hij,hde,je->hid", K, D, x)).sum(0)
    want = u - (u * x).sum(-1, keepdim=True) * x
    assert_close(g, want, rtol=1e-13, atol=1e-14)
    ut = (om[:, None, None] * torch.einsum("hij,hed,je->hid", K, D, x)).sum(0)  # with A_hᵀ: must differ
    assert (ut - u).abs().max() > 100 * (1e-13 * u.abs().max() + 1e-14)


def test_differentiable_second_moment_over_several_row_chunks_against_the_dense_formula():
    """q_h(x_i) = Σ_j p_ij ⟨x_i, y_j⟩² from the differentiable path (x requires grad) with row chunks
    of 2 queries (chunk_elements = 2·m per head and batch), batch of 2, token weights, β ≠ 1: the
    chunks must be joined along the query axis.  Dense oracle: p_ij = w_j e^{s_ij} / Σ_l w_l e^{s_il}."""
    g = gen(90)
    x = tp.sphere.sample_uniform(7, 3, batch_shape=(2,), generator=g, dtype=torch.float64).requires_grad_(True)
    heads = tp.Heads.random(2, 3, generator=g, dtype=torch.float64, beta=1.7)
    w = torch.rand(2, 7, generator=g, dtype=torch.float64) + 0.2
    w = w / w.sum(-1, keepdim=True)
    st = tp.attention.softmax_statistics(x, heads, w, second_moment=True, chunk_elements=2 * 7)
    xd = x.detach()
    S = heads.beta * torch.einsum("bid,hde,bje->bhij", xd, heads.score_matrix, xd)
    P = torch.softmax(S + torch.log(w)[:, None, None, :], -1)
    q = (P * (xd @ xd.transpose(-1, -2)).square()[:, None]).sum(-1)
    assert_close(st.second.detach(), q, rtol=1e-12, atol=1e-14)


def _spy_samples_loss(monkeypatch, key):
    """Record kw[key] of every geomloss.SamplesLoss built from now on (the real object is returned)."""
    import geomloss
    seen, real = [], geomloss.SamplesLoss

    def spy(*args, **kw):
        seen.append(kw.get(key))
        return real(*args, **kw)

    monkeypatch.setattr(geomloss, "SamplesLoss", spy)
    return seen


def test_a_user_cost_is_handed_to_geomloss_with_the_tensorized_backend(monkeypatch):
    """A callable cost only works with geomloss' tensorized backend: its "auto" switches to the online
    (KeOps formula) one above 5000² point pairs, where a Python callable fails.  So the request must name
    "tensorized" explicitly; the value is unchanged (checked against the unpatched call)."""
    from transformer_pde import transport
    g = gen(91)
    x = tp.sphere.sample_uniform(6, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    y = tp.sphere.sample_uniform(5, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    a, b = torch.full((1, 6), 1 / 6, dtype=torch.float64), torch.full((1, 5), 1 / 5, dtype=torch.float64)
    cost = lambda X, Y: 0.5 * torch.cdist(X, Y).square()  # noqa: E731
    ref = transport.sinkhorn_divergence(x, a, y, b, eps=0.1, cost=cost, diameter=2.0)
    seen = _spy_samples_loss(monkeypatch, "backend")
    val = transport.sinkhorn_divergence(x, a, y, b, eps=0.1, cost=cost, diameter=2.0)
    assert seen == ["tensorized"]
    assert_close(val, ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------- survivors of the 5 % run on the final tree
def _dense_lse(x, heads, w=None):
    """log Σ_j w_j e^{β⟨x_i, A_h x_j⟩}, (..., H, n), by torch.logsumexp over the dense scores."""
    S = heads.beta * torch.einsum("...id,hde,...je->...hij", x, heads.score_matrix, x)
    logw = -math.log(x.shape[-2]) if w is None else torch.log(w)[..., None, None, :]
    return torch.logsumexp(S + logw, -1)


def test_chunked_bound_uses_each_key_norm_so_large_scores_take_the_shifted_path():
    """All tokens near one direction in d = 32 with A = a·I and β·a = 800: the scores (≈ 800) overflow
    e^s in float64, so the chunked kernel must take its max-shifted branch.  It decides by the bound
    ‖q_i‖·max_j ‖k_j‖; a bound from the column norms of the keys (√(2/32) of it here) would wrongly
    allow the unshifted sum and return inf.  Dense oracle: logsumexp of the scores."""
    d = 32
    base = torch.ones(d, dtype=torch.float64) / math.sqrt(d)
    x = tp.sphere.normalize(base + 1e-3 * torch.randn(2, d, generator=gen(92), dtype=torch.float64))
    heads = tp.Heads(torch.eye(d, dtype=torch.float64)[None], beta=800.0)
    st = tp.attention.softmax_statistics(x, heads, backend="chunked")
    assert bool(torch.isfinite(st.log_partition).all())
    assert_close(st.log_partition, _dense_lse(x, heads), rtol=1e-13, atol=0)


def test_chunked_second_moment_keeps_float32():
    """The (y ⊗ y) pair weights follow the input dtype: a float32 run stays float32."""
    x = tp.sphere.sample_uniform(6, 3, generator=gen(93), dtype=torch.float32)
    heads = tp.Heads.random(2, 3, generator=gen(94), dtype=torch.float32, beta=1.3)
    st = tp.attention.softmax_statistics(x, heads, second_moment=True, backend="chunked")
    assert st.second.dtype == torch.float32
    xd = x.double()
    S = 1.3 * torch.einsum("id,hde,je->hij", xd, heads.score_matrix.double(), xd)
    q = (torch.softmax(S, -1) * (xd @ xd.T).square()).sum(-1)
    assert_close(st.second.double(), q, rtol=1e-5, atol=1e-6)


def test_relu_statistics_over_two_row_chunks_against_the_dense_formula():
    """Two row chunks (chunk_elements = 3 rows × m keys × H heads): both must be joined.  Dense oracle:
    Σ_j w_j relu(β⟨x_i, A_h x_j⟩) (1, x_j), the ReLU kernel's mass and first moment."""
    x = tp.sphere.sample_uniform(6, 3, generator=gen(95), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(96), dtype=torch.float64, beta=1.3)
    full = tp.attention.relu_statistics(x, heads, backend="dense")
    two = tp.attention.relu_statistics(x, heads, chunk_elements=3 * 6 * 2, backend="chunked")
    R = torch.relu(1.3 * torch.einsum("id,hde,je->hij", x, heads.score_matrix, x)) / 6
    for mass, first in (full, two):
        assert_close(mass, R.sum(-1), rtol=1e-13, atol=1e-15)
        assert_close(first, R @ x, rtol=1e-13, atol=1e-15)


def test_unnormalized_velocity_that_overflows_raises_with_the_fix():
    x = tp.sphere.sample_uniform(5, 3, generator=gen(97), dtype=torch.float32)
    heads = tp.Heads(torch.eye(3, dtype=torch.float32)[None], beta=200.0)
    with pytest.raises(OverflowError, match="'unnormalized' field overflows torch.float32.*use normalization='softmax'"):
        tp.velocity(x, heads, normalization="unnormalized")


@pytest.mark.parametrize("diameter", [None, 2.5])
def test_geodesic_sinkhorn_hands_geomloss_the_diameter(monkeypatch, diameter):
    """The geodesic cost's diameter for geomloss' ε-scaling: π (the sphere's) by default, the given one
    otherwise."""
    from transformer_pde import transport
    g = gen(98)
    x = tp.sphere.sample_uniform(6, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    a = torch.full((1, 6), 1 / 6, dtype=torch.float64)
    seen = _spy_samples_loss(monkeypatch, "diameter")
    transport.sinkhorn_divergence(x, a, x.flip(-2), a, eps=0.1, metric="geodesic", diameter=diameter)
    assert seen == [math.pi if diameter is None else diameter]


def test_one_row_per_chunk_at_the_smallest_memory_cap():
    """chunk_elements=4 with a batch of 4 × 2 heads and m = 5 keys (far below one row of scores, 40
    elements): one query row per block, the same sums as dense.  Covers the row sizing of the ReLU
    kernel and of the differentiable softmax path."""
    x = tp.sphere.sample_uniform(5, 3, batch_shape=(4,), generator=gen(99), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(100), dtype=torch.float64, beta=1.3)
    R = torch.relu(1.3 * torch.einsum("bid,hde,bje->bhij", x, heads.score_matrix, x)) / 5
    mass, first = tp.attention.relu_statistics(x, heads, chunk_elements=4, backend="chunked")
    assert_close(mass, R.sum(-1), rtol=1e-13, atol=1e-15)
    assert_close(first, R @ x.unsqueeze(-3), rtol=1e-13, atol=1e-15)
    xg = x.clone().requires_grad_(True)
    st = tp.attention.softmax_statistics(xg, heads, chunk_elements=4)
    assert_close(st.log_partition.detach(), _dense_lse(x, heads), rtol=1e-13, atol=1e-15)


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


def test_gradient_reaches_the_keys_when_only_the_keys_require_it():
    """keys= requiring grad, queries not: the differentiable path must be taken (∂/∂y of Σ log m_h(x_i)
    equals the dense log-sum-exp's autograd gradient)."""
    x = tp.sphere.sample_uniform(4, 3, generator=gen(104), dtype=torch.float64)
    y = tp.sphere.sample_uniform(6, 3, generator=gen(105), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(106), dtype=torch.float64, beta=1.3)
    yg, yd = y.clone().requires_grad_(True), y.clone().requires_grad_(True)
    tp.attention.softmax_statistics(x, heads, keys=yg).log_partition.sum().backward()
    S = 1.3 * torch.einsum("id,hde,je->hij", x, heads.score_matrix, yd)
    (torch.logsumexp(S, -1) - math.log(6)).sum().backward()
    assert yg.grad is not None
    assert_close(yg.grad, yd.grad, rtol=1e-12, atol=1e-14)
