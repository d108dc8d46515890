"""The one-block kernel of small n (transformer_pde.model.pair_block) against independent implementations.

Its row, column and causal-prefix statistics are checked against ``softmax_statistics`` (forward,
``transpose=True``, ``causal=True``) and against the definitions written out with einsum; the field and
the diagnostics of ``evaluate(diagnostics=True)`` through it against the same call with the kernel
switched off (``MAX_TOKENS = 0``: the log-sum-exp path with its transposed and whole-measure passes).
"""

from __future__ import annotations

import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model import pair_block
from transformer_pde.model.energy import choose_log_scale, energy_time_derivative, pairing
from transformer_pde.model.field import evaluate
from transformer_pde.model.softmax import softmax_statistics

DTYPES = [torch.float32, torch.float64]


def tol(dtype):
    """Sums of a few dozen exponentials and products of d×d matrices: a few hundred ulps."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=400 * eps, atol=400 * eps)


def safe_limit(dtype, n):
    """½ log(finfo.max) − log n: every e^{s} with |s| at most this, and any sum of n of them, is finite and normal
    (e^{limit}·n = finfo.max^{1/2}; 354.9 − log n in float64, 44.4 − log n in float32)."""
    return 0.5 * math.log(torch.finfo(dtype).max) - math.log(n)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def problem(dtype, *, B=3, n=7, d=4, H=3, shared=False, weighted=False, beta_tensor=False, seed=0,
            symmetric=False):
    """Tokens (B, n, d) on the sphere and non-symmetric heads (A_h ≠ A_hᵀ, V_h ≠ A_h), batched or shared."""
    g = gen(seed)
    x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=g, dtype=dtype)
    hb = () if shared else (B,)
    A = torch.randn(*hb, H, d, d, generator=g, dtype=dtype)
    if symmetric:
        A = A + A.transpose(-1, -2)
    V = torch.randn(*hb, H, d, d, generator=g, dtype=dtype)
    omega = torch.rand(H, generator=g, dtype=dtype) + 0.5
    beta = (torch.rand(B, generator=g, dtype=dtype) + 0.5) if beta_tensor else 0.8
    w = None
    if weighted:
        w = torch.rand(B, n, generator=g, dtype=dtype) + 0.1
        w = w / w.sum(-1, keepdim=True)
    return x, tp.Heads(A, V, weights=omega, beta=beta), w


def definitions(x, heads, w):
    """m_h ȳ_h from the rows and m̃_h ỹ_h from the columns of e^{β⟨x_i, A_h x_j⟩}, by einsum (the module docstring)."""
    n = x.shape[-2]
    beta = heads.beta_tensor()
    beta = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
    K = torch.exp(beta * torch.einsum("...ia,...hab,...jb->...hij", x, heads.score_matrix, x))
    wt = torch.full(x.shape[:-1], 1.0 / n, dtype=x.dtype) if w is None else w
    m = torch.einsum("...hij,...j->...hi", K, wt)
    mt = torch.einsum("...hij,...i->...hj", K, wt)
    mean = torch.einsum("...hij,...j,...jd->...hid", K, wt, x) / m.unsqueeze(-1)
    mean_t = torch.einsum("...hij,...i,...id->...hjd", K, wt, x) / mt.unsqueeze(-1)
    return torch.log(m), mean, torch.log(mt), mean_t


def assert_stats(a, b, dtype):
    torch.testing.assert_close(a.log_partition, b.log_partition, **tol(dtype))
    torch.testing.assert_close(a.mean, b.mean, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("beta_tensor", [False, True])
def test_block_statistics_are_softmax_statistics(dtype, shared, weighted, beta_tensor):
    """Forward rows, columns (A_hᵀ) and causal prefix of one block = the three kernel passes they replace."""
    x, heads, w = problem(dtype, shared=shared, weighted=weighted, beta_tensor=beta_tensor)
    blk = pair_block.pair_block(x, heads, w, causal=True)
    assert blk is not None
    assert_stats(blk.forward(), softmax_statistics(x, heads, w), dtype)
    assert_stats(blk.transposed(), softmax_statistics(x, heads, w, transpose=True), dtype)
    assert_stats(blk.causal(), softmax_statistics(x, heads, w, causal=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_columns_are_the_column_sums_not_the_rows(dtype):
    """A non-symmetric A whose row and column statistics differ: the columns match the definition
    Σ_i w_i e^{s_ij} [1, x_i] (einsum), and are not the rows (a swapped axis would fail here)."""
    x, heads, w = problem(dtype, weighted=True, seed=3)
    lse, mean, lse_t, mean_t = definitions(x, heads, w)
    assert float((lse - lse_t).abs().max()) > 0.1  # rows and columns differ for this A
    blk = pair_block.pair_block(x, heads, w)
    f, t = blk.forward(), blk.transposed()
    torch.testing.assert_close(f.log_partition, lse, **tol(dtype))
    torch.testing.assert_close(f.mean, mean, **tol(dtype))
    torch.testing.assert_close(t.log_partition, lse_t, **tol(dtype))
    torch.testing.assert_close(t.mean, mean_t, **tol(dtype))


def test_the_block_formed_without_columns_or_prefix_says_so():
    x, heads, w = problem(torch.float64)
    blk = pair_block.pair_block(x, heads, w, columns=False)
    with pytest.raises(ValueError, match="columns=True"):
        blk.transposed()
    with pytest.raises(ValueError, match="causal=True"):
        blk.causal()


FIELDS = ("velocity", "ambient", "grad_first_variation", "energy", "slope", "dissipation", "outputs")


def both_ways(monkeypatch, *args, **kw):
    """evaluate(diagnostics=True) through the one-block kernel (checked taken) and with it switched off; with
    ``diagnostics=False`` in ``kw`` the same for the block's field alone (``pair_field``)."""
    seen = []
    name = "pair_diagnostics" if kw.get("diagnostics", True) else "pair_field"
    real = getattr(pair_block, name)

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out is not None)
        return out

    import transformer_pde.model.field as field_module
    monkeypatch.setattr(field_module, name, spy)
    new = evaluate(*args, **kw)
    monkeypatch.setattr(pair_block, "MAX_TOKENS", 0)
    old = evaluate(*args, **kw)
    monkeypatch.setattr(pair_block, "MAX_TOKENS", 512)
    return new, old, seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True, "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_evaluate_through_the_block_is_the_lse_path(monkeypatch, dtype, causal, weighted, shared):
    """E, 𝒢², 𝒟, ∇_S δE/δμ, the field, the outputs and the whole-measure statistics, descent and at a scale c."""
    x, heads, w = problem(dtype, shared=shared, weighted=weighted, beta_tensor=not shared, seed=1)
    new, old, seen = both_ways(monkeypatch, x, heads, w, sign=-1.0, causal=causal, log_scale=0.7)
    assert seen == [True]
    for k in FIELDS:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    assert_stats(new.stats, old.stats, dtype)
    assert new.energy.shape == (x.shape[0],)


@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_causal_heads_take_the_block_and_the_merged_path_does_not(monkeypatch, dtype):
    """Causal attention with symmetric A_h (no column term) through the block; non-causal symmetric heads keep
    the merged fused kernel (the block is not asked)."""
    x, heads, w = problem(dtype, symmetric=True, seed=2)
    new, old, seen = both_ways(monkeypatch, x, heads, w, causal=True)
    assert seen == [True]
    for k in FIELDS:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    new, old, seen = both_ways(monkeypatch, x, heads, w)
    assert seen == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_energy_and_slope_against_their_definitions(dtype):
    """E = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{s_ij}, 𝒢² = Σ_i w_i b_i |V_i|² with b_i = 1/Σ_h ω̄_h/m_h, and
    𝒟 = Σ_i w_i ⟨P_x ∇δE/δμ, V_i⟩ with ∇δE/δμ = Σ_h ½ω_h (m_h A_h ȳ_h + m̃_h A_hᵀ ỹ_h), from einsum."""
    x, heads, w = problem(dtype, weighted=True, seed=4)
    e = evaluate(x, heads, w, sign=1.0)
    lse, mean, lse_t, mean_t = definitions(x, heads, w)
    m, mt = torch.exp(lse), torch.exp(lse_t)
    om, beta, A, V = heads.weights, heads.beta, heads.score_matrix, heads.value_matrix
    E = (om * torch.einsum("bhi,bi->bh", m, w)).sum(-1) / (2 * beta)
    f = torch.einsum("h,bhde,bhie->bid", om, V, mean)
    Vel = f - (f * x).sum(-1, keepdim=True) * x
    b = 1.0 / torch.einsum("h,bhi->bi", om / om.sum(), 1.0 / m)
    G = (w * b * Vel.square().sum(-1)).sum(-1)
    grad = 0.5 * (torch.einsum("h,bhi,bhde,bhie->bid", om, m, A, mean)
                  + torch.einsum("h,bhi,bhed,bhie->bid", om, mt, A, mean_t))
    grad = grad - (grad * x).sum(-1, keepdim=True) * x
    D = (w * (grad * Vel).sum(-1)).sum(-1)
    for got, want in ((e.energy, E), (e.velocity, Vel), (e.slope, G), (e.grad_first_variation, grad),
                      (e.dissipation, D)):
        torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("weighted", [False, True])
def test_pairing_reads_the_token_moment_of_the_block(monkeypatch, weighted):
    """The ledger's ∂_tE pairing from the block's token moment equals the one from the statistics' means,
    at c = 0 and at a scale c; another weights object or an in-place change of x is not served from it."""
    dtype = torch.float64
    x, heads, w = problem(dtype, weighted=weighted, seed=5)
    M = torch.randn(3, 3, 4, 4, generator=gen(9), dtype=dtype)
    new, old, _ = both_ways(monkeypatch, x, heads, w)
    sums = new.stats.__dict__["_pair_sums"]
    assert sums(w, 0.0) is not None and sums(w, 0.0, x) is not None  # the block's own tokens and weights
    for c in (0.0, 1.0, 1.3):
        torch.testing.assert_close(pairing(x, heads, w, new.stats, M, log_scale=c),
                                   pairing(x, heads, w, old.stats, M, log_scale=c), **tol(dtype))
    if w is not None:
        assert sums(w.clone(), 0.0) is None
    assert sums(w, 0.0, x.clone()) is None
    y = x.clone()
    e = evaluate(y, heads, w)
    y.mul_(1.0)  # an in-place change: the moment is not that of these tokens any more
    assert e.stats.__dict__["_pair_sums"](w, 0.0) is None
    torch.testing.assert_close(energy_time_derivative(x, heads, M, w), pairing(x, heads, w, old.stats, M),
                               **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_fall_back_and_stay_correct(monkeypatch, dtype):
    """β‖A‖ above ½ log(finfo.max) − log n: the block declines (the shift-free exp could overflow) and the
    log-sum-exp path gives finite values at the solvers' common scale, the same as with the block switched off."""
    x, heads, w = problem(dtype, seed=6)
    big = heads.replace(beta=float(2 * safe_limit(dtype, x.shape[-2])))
    assert pair_block.pair_block(x, big, w) is None
    c = choose_log_scale(softmax_statistics(x, big, w).log_partition)  # the solvers' common scale
    new, old, seen = both_ways(monkeypatch, x, big, w, causal=True, log_scale=c)
    assert seen == [False]
    for k in ("velocity", "grad_first_variation", "dissipation"):
        assert bool(torch.isfinite(getattr(new, k)).all())
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    # the bound itself: just below it the block is taken, and every value is finite
    limit = safe_limit(dtype, x.shape[-2])
    A = heads.score_matrix
    edge = heads.replace(beta=0.999 * limit / float(A.flatten(-2).norm(dim=-1).max()))
    blk = pair_block.pair_block(x, edge, w, causal=True)
    assert blk is not None and all(bool(torch.isfinite(t).all()) for t in (blk.mass, blk.rows, blk.cols))


def test_autograd_a_negative_scale_and_explicit_backends_take_the_lse_path(monkeypatch):
    """Inputs that require grad (the training path), c < 0 and an explicit backend: not through the block, and
    the gradients still flow."""
    dtype = torch.float64
    x, heads, w = problem(dtype, seed=7)
    xr = x.clone().requires_grad_(True)
    new, old, seen = both_ways(monkeypatch, xr, heads, w)
    assert seen == [False]
    new.energy.sum().backward()
    assert xr.grad is not None and bool(torch.isfinite(xr.grad).all())
    A = heads.score_matrix.clone().requires_grad_(True)  # the heads require grad, the tokens do not
    new, old, seen = both_ways(monkeypatch, x, heads.replace(score=A), w, causal=True)
    assert seen == [False]
    new.dissipation.sum().backward()
    assert A.grad is not None and bool(torch.isfinite(A.grad).all())
    _, _, seen = both_ways(monkeypatch, x, heads, w, log_scale=-1.0)
    assert seen == [False]
    _, _, seen = both_ways(monkeypatch, x, heads, w, backend="chunked")
    assert seen == []
    x, heads, w = problem(dtype, weighted=True, seed=8)  # token weights that require grad: the gradient of E in them
    wr = w.clone().requires_grad_(True)
    new, _, seen = both_ways(monkeypatch, x, heads, wr)
    assert seen == [False]
    grad, = torch.autograd.grad(new.energy.sum(), wr)
    lse, _, _, _ = definitions(x, heads, w)  # ∂E/∂w_i = 2 Σ_h ω_h/(2β) m̄_h(x_i) for E = Σ_h ω_h/(2β) Σ_ij w_i w_j K_ij
    sym = 0.5 * (torch.exp(lse) + torch.exp(definitions(x, heads.replace(score=heads.score_matrix.transpose(-1, -2)),
                                                        w)[0]))
    torch.testing.assert_close(grad, torch.einsum("h,bhi->bi", heads.weights, sym) / heads.beta, **tol(dtype))


def test_many_blocks_and_records_with_heads_per_system(monkeypatch):
    """One system per block, and tokens (T, B, n, d) of T records with heads (B, ...) per system (repeated
    over the records, not copied): the same values as the lse path."""
    dtype = torch.float64
    g = gen(8)
    T, B, n, d, H = 4, 3, 6, 4, 2
    x = tp.sphere.sample_uniform(n, d, batch_shape=(T, B), generator=g, dtype=dtype)
    heads = tp.Heads(torch.randn(B, H, d, d, generator=g, dtype=dtype), torch.randn(B, H, d, d, generator=g,
                                                                                    dtype=dtype))
    for block in (1, None):
        monkeypatch.setattr(pair_block, "BLOCK_BYTES", block)
        for causal in (False, True):
            new, old, seen = both_ways(monkeypatch, x, heads, None, causal=causal)
            assert seen == [True]
            for k in FIELDS:
                torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))


def test_takes_small_n_within_the_memory_cap():
    assert pair_block.takes(32, 8) and pair_block.takes(pair_block.MAX_TOKENS, 1)
    assert not pair_block.takes(pair_block.MAX_TOKENS + 1, 1)
    assert not pair_block.takes(256, 8, chunk_elements=256 * 256 * 8 - 1)
    assert pair_block.takes(256, 8, chunk_elements=256 * 256 * 8)


@pytest.mark.parametrize("geometry,causal", [("post", False), ("none", True)])
def test_ledger_of_a_solve_is_that_of_the_lse_path(monkeypatch, geometry, causal):
    """A post-LN solve with non-symmetric A_h, V_h per system and a causal solve, energy ledger at every step:
    the same energies, densities and ledger entries as with the block switched off, and the chain-rule
    residual dE − ∫∂_sE − ∫𝒟 falls like dt (order 1)."""
    dtype = torch.float64
    g = gen(10)
    B, n, d, H = 4, 8, 5, 3
    x0 = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=g, dtype=dtype)
    A = torch.randn(B, H, d, d, generator=g, dtype=dtype) / d ** 0.5
    V = torch.randn(B, H, d, d, generator=g, dtype=dtype) / d ** 0.5
    model = tp.Model(tp.Heads(A, V), layer_norm=geometry, causal=causal, direction="ascent")

    def run(dt):
        return tp.solve(model, x0, tp.Euler(), t1=0.4, dt=dt, ledger=tp.LedgerOptions(ledger=True), progress=False)

    new = run(0.02)
    monkeypatch.setattr(pair_block, "MAX_TOKENS", 0)
    old = run(0.02)
    monkeypatch.setattr(pair_block, "MAX_TOKENS", 512)
    torch.testing.assert_close(new.x, old.x, **tol(dtype))
    for k in ("energy", "slope", "dissipation"):
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    for k in old.ledger:
        torch.testing.assert_close(new.ledger[k], old.ledger[k], **tol(dtype))
    chain = new.ledger["dE"] - new.ledger["partial"] - new.ledger["dissipation"] - new.ledger["martingale"]
    half = run(0.01).ledger
    chain2 = half["dE"] - half["partial"] - half["dissipation"] - half["martingale"]
    r1, r2 = float(chain[-1].abs().max()), float(chain2[-1].abs().max())
    assert r1 > 0 and 1.5 < r1 / r2 < 2.6, (r1, r2)
    assert r1 < 0.05 * float(new.ledger["dE"][-1].abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_bounded_scores_mean_a_zero_common_scale(dtype):
    """Where β‖A_h‖_F max|x_i|² is below ½ log(finfo.max) − log n every log-partition is too, and the solvers'
    common scale is 0 (what the lazy diagnostics use instead of a kernel pass); not so above it or for NaN."""
    x, heads, w = problem(dtype, seed=11)
    limit = safe_limit(dtype, x.shape[-2])
    assert pair_block.scores_bounded(x, heads)
    lse = softmax_statistics(x, heads, w).log_partition
    assert float(lse.max()) <= limit and choose_log_scale(lse) == 0.0
    bound = float(heads.score_matrix.flatten(-2).norm(dim=-1).max())
    edge = heads.replace(beta=0.999 * limit / bound)
    assert pair_block.scores_bounded(x, edge)
    assert not pair_block.scores_bounded(x, heads.replace(beta=1.001 * limit / bound))
    y = x.clone()
    y[0, 0, 0] = float("nan")
    assert not pair_block.scores_bounded(y, heads)


def assert_same(new, old, dtype):
    """The fields of two evaluations (values that do not depend on a batch dim may be unbroadcast in ``old``)."""
    for k in FIELDS:
        a, b = getattr(new, k), getattr(old, k)
        torch.testing.assert_close(a, b.expand_as(a), **tol(dtype))


@pytest.mark.filterwarnings("error")  # an ``out=`` tensor of the wrong shape (resized by torch) fails here
@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_batches_and_partial_blocks(monkeypatch, causal):
    """Batch shapes that broadcast in every way the kernel flattens: heads varying over the leading batch dim
    (2, 1) against tokens (2, 3); heads with a batch of one; shared heads over a batch not divisible by the
    block size (blocks of 2 systems for 5); weights batched while tokens and heads are shared; values batched
    while tokens and scores are shared; an empty batch."""
    dtype = torch.float64
    g = gen(12)
    n, d, H = 5, 4, 2

    def heads_of(*shape, values=None):
        return tp.Heads(torch.randn(*shape, H, d, d, generator=g, dtype=dtype),
                        torch.randn(*(shape if values is None else values), H, d, d, generator=g, dtype=dtype))

    per_system = n * H * max(n, d) * 8
    cases = [
        (tp.sphere.sample_uniform(n, d, batch_shape=(2, 3), generator=g, dtype=dtype), heads_of(2, 1), None, None),
        (tp.sphere.sample_uniform(n, d, batch_shape=(5,), generator=g, dtype=dtype), heads_of(1), None, 2),
        (tp.sphere.sample_uniform(n, d, batch_shape=(5,), generator=g, dtype=dtype), heads_of(), None, 2),
        (tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype), heads_of(),
         torch.softmax(torch.randn(2, 3, n, generator=g, dtype=dtype), -1), None),
        (tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype), heads_of(values=(3,)), None, None),
        (torch.empty(0, n, d, dtype=dtype), heads_of(), None, None),
        (torch.empty(0, n, d, dtype=dtype), heads_of(0), None, None),
    ]
    for x, heads, w, blocks in cases:
        monkeypatch.setattr(pair_block, "BLOCK_BYTES", None if blocks is None else blocks * per_system)
        new, old, seen = both_ways(monkeypatch, x, heads, w, causal=causal)
        # (heads with an empty batch are symmetric, vacuously: without causality the merged path takes them)
        assert seen == ([] if heads.score_matrix.numel() == 0 and not causal else [True])
        assert_same(new, old, dtype)
        blk = pair_block.pair_block(x, heads, w, causal=True)
        assert_stats(blk.forward(), softmax_statistics(x, heads, w), dtype)
        assert_stats(blk.causal(), softmax_statistics(x, heads, w, causal=True), dtype)
    x = tp.sphere.sample_uniform(n, d, batch_shape=(2, 3), generator=g, dtype=dtype)  # batched weights, causal
    w = torch.softmax(torch.randn(2, 3, n, generator=g, dtype=dtype), -1)
    h = heads_of()
    assert_stats(pair_block.pair_block(x, h, w, causal=True).causal(), softmax_statistics(x, h, w, causal=True), dtype)


def test_defaults_are_ascent_at_no_scale():
    """pair_diagnostics without sign= and log_scale=: s = +1 and c = 0."""
    x, heads, w = problem(torch.float64, seed=13)
    pd, e = pair_block.pair_diagnostics(x, heads, w), evaluate(x, heads, w, sign=1.0, log_scale=0.0)
    torch.testing.assert_close(pd.velocity, e.velocity, **tol(torch.float64))
    torch.testing.assert_close(pd.energy, e.energy, **tol(torch.float64))


def test_block_bytes_from_the_cache_size(monkeypatch):
    """A quarter of the L2 cache on the CPU, at least 64 KiB; 64 MiB on other devices; BLOCK_BYTES when set."""
    from transformer_pde.utils import hardware
    cpu = torch.device("cpu")
    for l2, want in ((2 ** 21, 2 ** 19), (2 ** 10, 2 ** 16)):
        monkeypatch.setattr(hardware, "cache_sizes", lambda l2=l2: hardware.CacheSizes(2 ** 15, l2, None, "test"))
        assert pair_block.block_bytes(cpu) == want
    assert pair_block.block_bytes(torch.device("meta")) == 2 ** 26
    monkeypatch.setattr(pair_block, "BLOCK_BYTES", 1000)
    assert pair_block.block_bytes(cpu) == 1000


def test_empty_tokens_have_bounded_scores():
    """No tokens, no scores: bounded whatever the heads (and the common scale is 0)."""
    x, heads, _ = problem(torch.float64, seed=14)
    big = heads.replace(beta=1e6)
    assert pair_block.scores_bounded(x[:0], big)
    assert not pair_block.scores_bounded(x, big)


def test_heads_of_two_systems_a_two_dim_beta_and_weights_over_records(monkeypatch):
    """Per-system heads of two systems; β with a two-dimensional batch; causal statistics of tokens (T, B, n, d)
    with weights (B, n) shared by the records."""
    dtype = torch.float64
    x, heads, w = problem(dtype, B=2, seed=15)
    new, old, seen = both_ways(monkeypatch, x, heads, w, causal=True)
    assert seen == [True]
    assert_same(new, old, dtype)
    g = gen(16)
    y = tp.sphere.sample_uniform(6, 4, batch_shape=(2, 3), generator=g, dtype=dtype)
    beta = torch.rand(2, 3, generator=g, dtype=dtype) + 0.5
    hb = tp.Heads(torch.randn(2, 4, 4, generator=g, dtype=dtype), torch.randn(2, 4, 4, generator=g, dtype=dtype),
                  beta=beta)
    new, old, seen = both_ways(monkeypatch, y, hb, None)
    assert seen == [True]
    assert_same(new, old, dtype)
    wr = torch.softmax(torch.randn(3, 6, generator=g, dtype=dtype), -1)
    assert_stats(pair_block.pair_block(y, hb, wr, causal=True).causal(), softmax_statistics(y, hb, wr, causal=True),
                 dtype)


def test_prepared_heads_follow_a_new_or_changed_beta(monkeypatch):
    """The prepared head matrices are kept for the same tensors: a new β tensor with the same A, V, ω, or β changed
    in place, is prepared again."""
    dtype = torch.float64
    x, heads, w = problem(dtype, beta_tensor=True, seed=17)
    first = evaluate(x, heads, w)
    other = heads.replace(beta=heads.beta * 1.7)
    new, old, seen = both_ways(monkeypatch, x, other, w)
    assert seen == [True]
    assert_same(new, old, dtype)
    assert float((new.energy - first.energy).abs().max()) > 1e-3
    heads.beta.mul_(0.5)
    new, old, _ = both_ways(monkeypatch, x, heads, w)
    assert_same(new, old, dtype)


def test_score_bound_uses_the_token_norms():
    """Tokens of norm 2 (off the sphere: the flat dynamics): the scores are bounded by β‖A‖_F · 4."""
    x, heads, _ = problem(torch.float64, seed=18)
    limit = safe_limit(torch.float64, x.shape[-2])
    bound = float(heads.score_matrix.flatten(-2).norm(dim=-1).max())
    assert pair_block.scores_bounded(2 * x, heads.replace(beta=0.99 * limit / (4 * bound)))
    assert not pair_block.scores_bounded(2 * x, heads.replace(beta=1.01 * limit / (4 * bound)))


def test_safe_limit_closed_form():
    assert pair_block.exp_safe_limit(torch.float64, 1) == pytest.approx(354.8913, abs=1e-4)
    assert pair_block.exp_safe_limit(torch.float32, 32) == pytest.approx(44.3614 - math.log(32), abs=1e-4)


def test_tokens_off_the_sphere_take_the_block_below_the_bound(monkeypatch):
    """Tokens of norm 2 (the flat dynamics) with β‖A‖_F · 4 just below the limit: the block is taken."""
    x, heads, w = problem(torch.float64, seed=19)
    bound = float(heads.score_matrix.flatten(-2).norm(dim=-1).max())
    near = heads.replace(beta=0.99 * safe_limit(torch.float64, x.shape[-2]) / (4 * bound))
    new, old, seen = both_ways(monkeypatch, 2 * x, near, w, causal=True, log_scale=choose_log_scale(
        softmax_statistics(2 * x, near, w).log_partition))
    assert seen == [True]
    assert_same(new, old, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("moment", [True, False])
def test_equal_head_weights_and_a_pass_without_the_token_moment(monkeypatch, dtype, weighted, moment):
    """Equal ω_h and one β (one ½ω/β for the column product of every head) give the lse path's field and
    diagnostics, with and without token weights; ``ledger_moment=False`` leaves the values as they are, attaches no
    token moment, and the ledger's pairing then forms it from the statistics: the same ∂_tE."""
    x, heads, w = problem(dtype, weighted=weighted, seed=11)
    H = heads.num_heads
    heads = heads.replace(weights=torch.full((H,), 1.0 / H, dtype=dtype), beta=0.8)
    new, old, seen = both_ways(monkeypatch, x, heads, w, sign=1.0, log_scale=0.4, ledger_moment=moment)
    assert seen == [True]
    for k in FIELDS:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    assert ("_pair_sums" in new.stats.__dict__) is moment
    M = torch.randn(H, x.shape[-1], x.shape[-1], generator=gen(12), dtype=dtype)
    torch.testing.assert_close(pairing(x, heads, w, new.stats, M, log_scale=0.4),
                               pairing(x, heads, w, old.stats, M, log_scale=0.4), **tol(dtype))



@pytest.mark.parametrize("shared_x", [True, False])
@pytest.mark.parametrize("batched", ["values", "omega", "beta"])
def test_energy_keeps_the_batch_of_what_it_depends_on(monkeypatch, shared_x, batched):
    """E depends on the tokens, A_h, ω, β and the token weights, not on V_h: value matrices with a batch axis of
    their own leave E's shape that of the log-sum-exp path (and 𝒢², 𝒟, which do depend on V_h, batched)."""
    dtype = torch.float64
    g = gen(21)
    x = tp.sphere.sample_uniform(6, 4, batch_shape=() if shared_x else (2, 1), generator=g, dtype=dtype)
    heads = tp.Heads(torch.randn(3, 4, 4, generator=g, dtype=dtype), torch.randn(5, 3, 4, 4, generator=g, dtype=dtype))
    own = ()  # the batch E has of its own: that of ω or β when they carry one (the values always do here)
    if batched == "omega":
        heads = heads.replace(weights=torch.softmax(torch.randn(5, 3, generator=g, dtype=dtype), -1))
        own = (5,)
    elif batched == "beta":
        heads = heads.replace(beta=torch.rand(5, generator=g, dtype=dtype) + 0.5)
        own = (5,)
    new, old, seen = both_ways(monkeypatch, x, heads, None)
    assert seen == [True]
    want = own if shared_x else torch.broadcast_shapes((2, 1), own)
    assert new.energy.shape == old.energy.shape == want
    assert new.dissipation.shape == old.dissipation.shape == ((5,) if shared_x else (2, 5))
    for k in FIELDS:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))


FIELD_ONLY = ("velocity", "ambient", "outputs")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_field_alone_through_the_block_is_the_lse_path(monkeypatch, dtype, causal, weighted, shared, sign):
    """The field, its projection, the per-head outputs and the statistics of the field's measure (causal: the
    prefixes) without diagnostics, against the log-sum-exp kernels."""
    x, heads, w = problem(dtype, shared=shared, weighted=weighted, beta_tensor=not shared, seed=31)
    new, old, seen = both_ways(monkeypatch, x, heads, w, sign=sign, causal=causal, diagnostics=False)
    assert seen == [True]
    for k in FIELD_ONLY:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    assert_stats(new.stats, old.stats, dtype)
    assert new.energy is None and new.dissipation is None


@pytest.mark.parametrize("weighted", [False, True])
def test_the_causal_log_partitions_of_the_field_alone_against_their_definition(weighted):
    """log m_h(x_i) = log Σ_{j≤i} w_j e^{s_ij} − log Σ_{j≤i} w_j, by einsum with a lower-triangular mask."""
    dtype = torch.float64
    x, heads, w = problem(dtype, weighted=weighted, seed=32)
    pf = pair_block.pair_field(x, heads, w, causal=True)
    n = x.shape[-2]
    wt = torch.full(x.shape[:-1], 1.0 / n, dtype=dtype) if w is None else w
    K = torch.exp(heads.beta * torch.einsum("bia,bhac,bjc->bhij", x, heads.score_matrix, x))
    K = K * torch.ones(n, n, dtype=dtype).tril()
    lse = torch.log(torch.einsum("bhij,bj->bhi", K, wt)) - torch.log(torch.cumsum(wt, -1)).unsqueeze(-2)
    torch.testing.assert_close(pf.stats.log_partition, lse, **tol(dtype))


def test_the_field_alone_is_not_taken_where_other_kernels_serve(monkeypatch):
    """Symmetric heads without causality (the merged kernel), value-factored heads (values first), causal="sum",
    a second moment and an explicit backend do not take it; inputs that require grad fall back with gradients."""
    dtype = torch.float64
    x, heads, w = problem(dtype, symmetric=True, seed=33)
    assert both_ways(monkeypatch, x, heads, w, diagnostics=False)[2] == []
    assert both_ways(monkeypatch, x, heads, w, causal=True, diagnostics=False)[2] == [True]
    assert both_ways(monkeypatch, x, heads, w, causal="sum", diagnostics=False)[2] == []
    x, heads, w = problem(dtype, seed=33)
    assert both_ways(monkeypatch, x, heads, w, second_moment=True, diagnostics=False)[2] == []
    assert both_ways(monkeypatch, x, heads, w, backend="chunked", diagnostics=False)[2] == []
    g = gen(34)
    H, d, k = 2, x.shape[-1], 2
    factored = tp.Heads(None, None, torch.ones(H, dtype=dtype), 0.7,
                        query=torch.randn(H, k, d, generator=g, dtype=dtype),
                        key=torch.randn(H, k, d, generator=g, dtype=dtype),
                        value_in=torch.randn(H, k, d, generator=g, dtype=dtype),
                        value_out=torch.randn(H, d, k, generator=g, dtype=dtype))
    new, old, seen = both_ways(monkeypatch, x, factored, w, diagnostics=False)
    assert seen == []
    torch.testing.assert_close(new.velocity, old.velocity, **tol(dtype))
    xr = x.clone().requires_grad_(True)
    new, old, seen = both_ways(monkeypatch, xr, heads, w, causal=True, diagnostics=False)
    assert seen == [False]
    new.velocity.square().sum().backward()
    assert xr.grad is not None and bool(torch.isfinite(xr.grad).all())


@pytest.mark.parametrize("weights_shape", [(3,), (2, 3), (1, 3)])
def test_the_causal_field_alone_with_token_weights_broadcast_over_two_batch_dims(monkeypatch, weights_shape):
    """Tokens (2, 3, n, d) with token weights of their own batch shape: the prefix log-partitions are normalised
    by the prefix weights of each system's own weights (the log-sum-exp path's values and shapes)."""
    dtype = torch.float64
    g = gen(35)
    n, d = 6, 4
    x = tp.sphere.sample_uniform(n, d, batch_shape=(2, 3), generator=g, dtype=dtype)
    heads = tp.Heads(torch.randn(2, d, d, generator=g, dtype=dtype), torch.randn(2, d, d, generator=g, dtype=dtype))
    w = torch.softmax(torch.randn(*weights_shape, n, generator=g, dtype=dtype), -1)
    new, old, seen = both_ways(monkeypatch, x, heads, w, causal=True, diagnostics=False)
    assert seen == [True]
    for k in FIELD_ONLY:
        torch.testing.assert_close(getattr(new, k), getattr(old, k), **tol(dtype))
    assert_stats(new.stats, old.stats, dtype)
