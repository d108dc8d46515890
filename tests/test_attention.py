"""Attention kernels: every backend against an independent dense oracle, memory, backend choice.

The oracle below forms the full (..., H, n, m) score tensor and uses torch.logsumexp /
torch.softmax — the textbook formulas, sharing no code with the kernels of transformer_pde.model.
"""

import itertools
import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model import backends, moments, softmax
from transformer_pde.model.energy import ito_correction, pairing
from transformer_pde.model.field import evaluate
from conftest import gen
from problems import random_sphere, tolerances

NO_GRAD_BACKENDS = ["dense", "chunked", "sdpa"]


def oracle(x, A, weights=None, keys=None, beta=1.0):
    """Dense float64 reference: log m_h, ȳ_h, q_h with the full score tensor.

    x (..., n, d), A (..., H, d, d), weights (..., m) or None, beta float or tensor (...)."""
    x = x.double()
    y = x if keys is None else keys.double()
    A = A.double()
    if isinstance(beta, torch.Tensor):
        beta = beta.double()[..., None, None, None]
    S = beta * torch.einsum("...ia,...hab,...jb->...hij", x, A, y)
    m = y.shape[-2]
    logw = torch.full((m,), -math.log(m), dtype=torch.float64) if weights is None else torch.log(weights.double())
    S = S + logw.unsqueeze(-2).unsqueeze(-2)
    lse = torch.logsumexp(S, -1)
    P = torch.softmax(S, -1)
    mean = P @ y.unsqueeze(-3)
    second = (P * (x @ y.transpose(-1, -2)).square().unsqueeze(-3)).sum(-1)
    return lse, mean, second


_tol = tolerances(f64=(1e-11, 1e-11), f32=(2e-5, 2e-5))


def _assert_stats(st, ref, dtype, scale=1.0):
    tol = _tol(dtype, scale)
    torch.testing.assert_close(st.log_partition.double(), ref[0], **tol)
    torch.testing.assert_close(st.mean.double(), ref[1], **tol)
    if st.second is not None:
        torch.testing.assert_close(st.second.double(), ref[2], **tol)


# ---------------------------------------------------------------------------- agreement
CASES = ["plain", "weights", "zero_weight", "batch_broadcast", "beta_tensor", "keys", "factors"]


def _case(case, dtype, d=3):
    x = random_sphere(2, 9, d, dtype=dtype, seed=1)
    A = torch.randn(2, 4, d, d, generator=gen(2), dtype=torch.float64).to(dtype)
    kw, ref_kw = {}, {}
    heads = tp.Heads(A)
    if case in ("weights", "zero_weight"):
        w = torch.rand(2, 9, generator=gen(3), dtype=torch.float64)
        if case == "zero_weight":
            w[:, 4] = 0.0
        w = (w / w.sum(-1, keepdim=True)).to(dtype)
        kw["weights"] = w
    elif case == "batch_broadcast":
        x = random_sphere(3, 2, 9, d, dtype=dtype, seed=4)  # heads (2, H) broadcast against x (3, 2)
    elif case == "beta_tensor":
        beta = torch.tensor([0.5, 3.0], dtype=dtype)
        heads = tp.Heads(A, beta=beta)
        ref_kw["beta"] = beta
    elif case == "keys":
        y = random_sphere(2, 13, d, dtype=dtype, seed=5)
        kw["keys"] = ref_kw["keys"] = y
    elif case == "factors":
        Q = torch.randn(2, 4, 2, d, generator=gen(6), dtype=torch.float64).to(dtype)
        K = torch.randn(2, 4, 2, d, generator=gen(7), dtype=torch.float64).to(dtype)
        heads = tp.Heads(None, A, query=Q, key=K)
        A = Q.transpose(-1, -2) @ K
    return x, heads, A, kw, ref_kw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", NO_GRAD_BACKENDS + ["auto"])
def test_backends_match_dense_oracle(backend, case, dtype):
    x, heads, A, kw, ref_kw = _case(case, dtype)
    weights = kw.pop("weights", None)
    ref = oracle(x, A, weights, **ref_kw)  # noqa: the oracle shares no code with the kernels
    st = tp.softmax_statistics(x, heads, weights, second_moment=True, backend=backend, **kw)
    assert st.log_partition.dtype == dtype and st.mean.dtype == dtype
    _assert_stats(st, ref, dtype)


@pytest.mark.parametrize("backend", ["chunked", "dense"])
def test_chunked_blocks_of_any_size_agree(backend):
    """Block boundaries must not matter: tiny blocks, blocks over groups, one block."""
    x, heads, A, kw, _ = _case("weights", torch.float64)
    ref = oracle(x, A, kw["weights"])
    for chunk in (1, 7, 9 * 4 * 9, 10**9):
        st = tp.softmax_statistics(x, heads, kw["weights"], second_moment=True, backend=backend, chunk_elements=chunk)
        _assert_stats(st, ref, torch.float64)


def test_transpose_flag_uses_A_transposed():
    x, heads, A, _, _ = _case("plain", torch.float64)
    ref = oracle(x, A.transpose(-1, -2))
    for backend in NO_GRAD_BACKENDS:
        st = tp.softmax_statistics(x, heads, transpose=True, second_moment=True, backend=backend)
        _assert_stats(st, ref, torch.float64)


@pytest.mark.parametrize("backend", NO_GRAD_BACKENDS)
def test_second_moment_in_higher_dimension(backend):
    """d = 10 uses the explicit second-moment pass instead of (y ⊗ y) columns."""
    x, heads, A, _, _ = _case("plain", torch.float64, d=10)
    ref = oracle(x, A)
    _assert_stats(tp.softmax_statistics(x, heads, second_moment=True, backend=backend), ref, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", NO_GRAD_BACKENDS)
def test_large_beta_norm_stays_finite(backend, dtype):
    """β‖A‖ ≈ 500: e^{s} overflows in both dtypes, the kernels must shift (and agree with the oracle)."""
    x = random_sphere(2, 12, 3, dtype=dtype, seed=8)
    A = torch.randn(3, 3, 3, generator=gen(9), dtype=torch.float64)
    A = (500.0 * A / torch.linalg.matrix_norm(A, ord=2)[..., None, None]).to(dtype)
    w = torch.rand(12, generator=gen(10), dtype=torch.float64)
    w[0] = 0.0
    w = (w / w.sum()).to(dtype)
    st = tp.softmax_statistics(x, tp.Heads(A), w, second_moment=True, backend=backend)
    assert torch.isfinite(st.log_partition).all() and torch.isfinite(st.mean).all()
    assert torch.isfinite(st.second).all()
    ref = oracle(x, A, w)
    # float32 scores of size 500 carry absolute rounding ~500·eps in the exponent
    scale = 1.0 if dtype == torch.float64 else 50.0
    _assert_stats(st, ref, dtype, scale)
    V = tp.velocity(x, tp.Heads(A), w, direction="descent")
    assert torch.isfinite(V).all()


def test_shift_free_and_shifted_paths_agree(monkeypatch):
    """Force the row-max fallback everywhere and compare with the shift-free exp."""
    x, heads, A, kw, _ = _case("zero_weight", torch.float64)
    fast = tp.softmax_statistics(x, heads, kw["weights"], second_moment=True, backend="chunked")
    monkeypatch.setattr(softmax, "_exp_safe_limit", lambda dtype, m: -1.0)
    slow = tp.softmax_statistics(x, heads, kw["weights"], second_moment=True, backend="chunked")
    for a, b in zip((fast.log_partition, fast.mean, fast.second), (slow.log_partition, slow.mean, slow.second)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_shift_free_limit_is_safe():
    """At the bound itself, e^{±B} summed over m keys is finite and normal in both dtypes."""
    for dtype in (torch.float32, torch.float64):
        for m in (1, 200, 10**6):
            B = softmax._exp_safe_limit(dtype, m)
            fi = torch.finfo(dtype)
            assert B > 0
            assert math.exp(B) * m < fi.max
            assert math.exp(-B) > fi.tiny


# ---------------------------------------------------------------------------- autograd path
def test_autograd_path_matches_no_grad_kernels():
    x, heads, A, kw, _ = _case("weights", torch.float64)
    xg = x.clone().requires_grad_(True)
    st = tp.softmax_statistics(xg, heads, kw["weights"], second_moment=True)
    assert st.log_partition.requires_grad
    for backend in NO_GRAD_BACKENDS:
        ref = tp.softmax_statistics(x, heads, kw["weights"], second_moment=True, backend=backend)
        torch.testing.assert_close(st.log_partition.detach(), ref.log_partition, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.mean.detach(), ref.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.second.detach(), ref.second, rtol=1e-12, atol=1e-12)


def test_autograd_gradcheck_through_kernel():
    x = random_sphere(5, 3, seed=11).requires_grad_(True)
    A = torch.randn(2, 3, 3, generator=gen(12), dtype=torch.float64, requires_grad=True)

    def f(x, A):
        st = tp.softmax_statistics(x, tp.Heads(A), second_moment=True, chunk_elements=8)
        return st.log_partition, st.mean, st.second

    assert torch.autograd.gradcheck(f, (x, A))


# ---------------------------------------------------------------------------- field and relu
@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu", "effective"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_evaluate_identical_across_backends(normalization, symmetric):
    x = random_sphere(2, 11, 3, seed=13)
    if symmetric:
        heads = tp.Heads.random(3, 3, batch_shape=(2,), generator=gen(14), dtype=torch.float64)
    else:
        heads = tp.Heads.random(3, 3, symmetric=False, batch_shape=(2,), generator=gen(14), dtype=torch.float64)
    w = torch.rand(2, 11, generator=gen(15), dtype=torch.float64)
    w = w / w.sum(-1, keepdim=True)
    outs = [evaluate(x, heads, w, normalization=normalization, sign=-1.0, second_moment=True, backend=b,
                     chunk_elements=16) for b in NO_GRAD_BACKENDS]
    for o in outs[1:]:
        for key in ("velocity", "energy", "slope", "dissipation", "grad_first_variation"):
            torch.testing.assert_close(getattr(o, key), getattr(outs[0], key), rtol=1e-11, atol=1e-12)


def test_relu_statistics_against_oracle():
    x = random_sphere(2, 10, 3, seed=16)
    A = torch.randn(2, 3, 3, 3, generator=gen(17), dtype=torch.float64)
    w = torch.rand(2, 10, generator=gen(18), dtype=torch.float64)
    w = w / w.sum(-1, keepdim=True)
    R = torch.relu(torch.einsum("...ia,...hab,...jb->...hij", x, A, x)) * w.unsqueeze(-2).unsqueeze(-2)
    for backend, chunk in (("chunked", 5), ("dense", None), ("auto", None)):
        mass, first = tp.relu_statistics(x, tp.Heads(A), w, backend=backend, chunk_elements=chunk)
        torch.testing.assert_close(mass, R.sum(-1))
        torch.testing.assert_close(first, R @ x.unsqueeze(-3))
    xg = x.clone().requires_grad_(True)
    mass, first = tp.relu_statistics(xg, tp.Heads(A), w)
    first.sum().backward()
    assert torch.isfinite(xg.grad).all()


# ---------------------------------------------------------------------------- backend choice
def test_unknown_backend_and_bad_chunk_are_refused():
    x, heads, _, _, _ = _case("plain", torch.float64)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        tp.softmax_statistics(x, heads, backend="cuda-magic")
    with pytest.raises(ValueError, match="chunk_elements must be a positive int"):
        tp.softmax_statistics(x, heads, chunk_elements=0)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        backends.kernel_backend("fast")


@pytest.mark.skipif(backends.keops_available(), reason="pykeops is installed here")
def test_keops_missing_raises_install_hint():
    x, heads, _, _, _ = _case("plain", torch.float64)
    with pytest.raises(ImportError, match="pip install pykeops"):
        tp.softmax_statistics(x, heads, backend="keops")
    with pytest.raises(ImportError, match="pip install pykeops"):
        tp.relu_statistics(x, heads, backend="keops")


def test_auto_never_picks_keops_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "keops_available", lambda: True)
    for dtype in (torch.float32, torch.float64):
        assert backends.select_backend("auto", "cpu", dtype, 10**12) != "keops"


def test_auto_on_cpu_and_sdpa_fallback(monkeypatch):
    if backends.sdpa_available("cpu", torch.float64):
        assert backends.select_backend("auto", "cpu", torch.float64, 100) == "sdpa"
    monkeypatch.setattr(backends, "_FLASH_CPU", False)
    assert not backends.sdpa_available("cpu", torch.float64)
    assert backends.select_backend("auto", "cpu", torch.float64, 100) == "chunked"
    assert backends.select_backend("sdpa", "cpu", torch.float64, 100) == "chunked"
    x, heads, A, _, _ = _case("plain", torch.float64)
    _assert_stats(tp.softmax_statistics(x, heads, second_moment=True, backend="sdpa"), oracle(x, A), torch.float64)


@pytest.mark.skipif(not backends.sdpa_available("cpu", torch.float64), reason="no fused CPU kernel in this torch")
def test_sdpa_runtime_refusal_falls_back_to_chunked(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("layout not supported")

    monkeypatch.setattr(backends, "_FLASH_CPU", refuse)
    x, heads, A, _, _ = _case("plain", torch.float64)
    _assert_stats(tp.softmax_statistics(x, heads, second_moment=True, backend="sdpa"), oracle(x, A), torch.float64)


def _spy_flash_widths(monkeypatch):
    """Record the (q, k, v) widths every call of the fused CPU kernel receives."""
    widths = []
    real = backends.flash_cpu_op()

    def spy(q, k, v, **kw):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(backends, "_FLASH_CPU", spy)
    return widths


@pytest.mark.skipif(not backends.sdpa_available("cpu", torch.float64), reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", [2, 3, 4])
def test_sdpa_second_moment_on_the_sphere_drops_the_last_diagonal_column(monkeypatch, dtype, d):
    """Keys on S^{d-1}: y_d² = 1 − Σ_{a<d} y_a² is implied, so the kernel width is d + d(d+1)/2 − 1
    (8 for d = 3), and the second moment still equals the oracle's Σ_j p_ij ⟨x_i, y_j⟩²."""
    widths = _spy_flash_widths(monkeypatch)
    x = random_sphere(2, 17, d, dtype=dtype, seed=3)
    keys = random_sphere(2, 23, d, dtype=dtype, seed=4)
    A = torch.randn(2, 5, d, d, generator=gen(5), dtype=torch.float64).to(dtype)
    w = torch.rand(2, 23, generator=gen(6), dtype=torch.float64)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    st = tp.softmax_statistics(x, tp.Heads(A), w, keys=keys, second_moment=True, backend="sdpa")
    assert widths == [(d + d * (d + 1) // 2 - 1,) * 3]
    _assert_stats(st, oracle(x, A, w, keys), dtype)
    # and the causal kernel (prefix measures) of the same tokens
    widths.clear()
    st = tp.softmax_statistics(x, tp.Heads(A), second_moment=True, backend="sdpa", causal=True)
    assert widths == [(d + d * (d + 1) // 2 - 1,) * 3]
    ref = tp.softmax_statistics(x, tp.Heads(A), second_moment=True, backend="chunked", causal=True)
    _assert_stats(st, (ref.log_partition.double(), ref.mean.double(), ref.second.double()), dtype)


@pytest.mark.skipif(not backends.sdpa_available("cpu", torch.float64), reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("radius", [1.0 + 1e-9, 0.5, 3.0])
def test_sdpa_second_moment_off_the_sphere_keeps_every_column(monkeypatch, radius):
    """Keys off the sphere (flat dynamics, |y| ≠ 1 beyond rounding): Σ_j p_ij |y_j|² ≠ 1, so the
    trace-free shortcut would be wrong; the kernel gets all d(d+1)/2 columns and matches the oracle."""
    widths = _spy_flash_widths(monkeypatch)
    d = 3
    x = random_sphere(2, 13, d, seed=7)
    keys = radius * random_sphere(2, 11, d, seed=8)
    keys[..., 0, :] /= radius  # one key on the sphere, the others off it
    A = torch.randn(2, 4, d, d, generator=gen(9), dtype=torch.float64)
    st = tp.softmax_statistics(x, tp.Heads(A), keys=keys, second_moment=True, backend="sdpa")
    assert widths == [(d + d * (d + 1) // 2,) * 3]
    _assert_stats(st, oracle(x, A, keys=keys), torch.float64)


def test_kernel_backend_context_sets_and_restores(monkeypatch):
    calls = []
    real = softmax._softmax_chunked

    def spy(*a, **k):
        calls.append(k.get("dense", False))
        return real(*a, **k)

    monkeypatch.setattr(softmax, "_softmax_chunked", spy)
    x, heads, _, _, _ = _case("plain", torch.float64)
    with backends.kernel_backend("dense"):
        assert backends.select_backend("auto", "cpu", torch.float64, 1) == "dense"
        tp.energy(x, heads)
    assert calls == [True]
    assert backends._DEFAULT_BACKEND[0] == "auto"


# ---------------------------------------------------------------------------- memory ~ N
def _largest_allocation_mib(x, heads, backend):
    """The largest block one operator allocates during a kernel call (torch profiler, CPU memory):
    deterministic, unlike process RSS, and it is exactly the score block of a dense kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        st = tp.softmax_statistics(x, heads, second_moment=True, backend=backend, chunk_elements=1 << 18)
    assert torch.isfinite(st.mean).all()
    return max(e.cpu_memory_usage for e in prof.events()) / 2**20


def test_peak_memory_grows_like_n():
    """float32, H = 1: a dense score block is n² · 4 B (15 MiB at n = 2000, 61 MiB at 4000); the O(N)
    kernels ("chunked" with 2^18-element blocks, "sdpa") allocate blocks that do not grow like n²
    (the dense backend shows that the probe sees the block)."""
    g = torch.Generator().manual_seed(0)
    heads = tp.Heads(torch.randn(1, 3, 3, generator=g))
    sizes = {}
    for n in (2000, 4000):
        x = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=-1)
        sizes[n] = {b: _largest_allocation_mib(x, heads, b) for b in ("chunked", "sdpa", "dense")}
    dense_mib = 4000 * 4000 * 4 / 2**20
    assert sizes[4000]["dense"] > 0.9 * dense_mib, sizes
    for backend in ("chunked", "sdpa"):
        assert sizes[4000][backend] < dense_mib / 20, (backend, sizes)
        # linear, not quadratic, growth from n = 2000 to 4000 (allow a small constant)
        assert sizes[4000][backend] < 2.5 * sizes[2000][backend] + 0.5, (backend, sizes)


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_cuda_backends_match_cpu_oracle(case, dtype):
    x, heads, A, kw, ref_kw = _case(case, dtype)
    weights = kw.pop("weights", None)
    ref = oracle(x, A, weights, **ref_kw)
    dev = torch.device("cuda")
    move = lambda t: None if t is None else t.to(dev)  # noqa: E731
    hc = heads.to(dev)
    for backend in ("auto", "chunked", "dense", "sdpa"):
        st = tp.softmax_statistics(move(x), hc, move(weights), second_moment=True, backend=backend,
                                   **{k: move(v) for k, v in kw.items()})
        assert st.mean.device.type == "cuda" and st.mean.dtype == dtype
        _assert_stats(type(st)(st.log_partition.cpu(), st.mean.cpu(), st.second.cpu()), ref, dtype, 10.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_field_and_large_beta():
    x = random_sphere(2, 12, 3, seed=8)
    A = torch.randn(3, 3, 3, generator=gen(9), dtype=torch.float64)
    A = 500.0 * A / torch.linalg.matrix_norm(A, ord=2)[..., None, None]
    cpu = evaluate(x, tp.Heads(A), sign=-1.0, second_moment=True)
    gpu = evaluate(x.cuda(), tp.Heads(A.cuda()), sign=-1.0, second_moment=True)
    for key in ("velocity", "energy", "slope", "dissipation"):
        torch.testing.assert_close(getattr(gpu, key).cpu(), getattr(cpu, key), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- per-head token sums (the ledger)
def _dense_head_sums(x, A, key_weights, query_weights, keys, log_scale):
    """T_h = e^{−c} Σ_ij w_i w_j e^{⟨x_i, A_h y_j⟩} y_j x_iᵀ (as T[a, b] = Σ … y_ja x_ib) and
    ito_h = e^{−c} Σ_ij w_i w_j e^{⟨x_i, A_h y_j⟩} (1 + ⟨x_i, y_j⟩²): the double sums, in float64."""
    x, A = x.double(), A.double()
    y = x if keys is None else keys.double()
    n, m = x.shape[-2], y.shape[-2]
    wk = torch.full((m,), 1.0 / m, dtype=torch.float64) if key_weights is None else key_weights.double()
    wq = torch.full((n,), 1.0 / n, dtype=torch.float64) if query_weights is None else query_weights.double()
    S = torch.einsum("...ia,...hab,...jb->...hij", x, A, y)
    K = torch.exp(S - log_scale) * wk.unsqueeze(-2).unsqueeze(-2) * wq.unsqueeze(-1).unsqueeze(-3)
    T = torch.einsum("...hij,...ja,...ib->...hab", K, y, x)
    ito = (K * (1 + (x @ y.transpose(-1, -2)).square()).unsqueeze(-3)).sum((-1, -2))
    return T, ito


@pytest.mark.skipif(not backends.sdpa_available("cpu", torch.float64), reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("case", ["uniform", "weighted", "off_sphere_keys", "scaled"])
def test_head_moment_sums_match_the_dense_double_sums(dtype, d, case):
    """The per-head sums the ledger reads (pairing's T_h and the Itô correction's Σ_i w_i m_h (1 + q_h))
    come from one product of the fused kernel's value columns, without the per-token second moment;
    they equal the dense double sums over (i, j), on and off the sphere (trace-free columns or all
    of them), with and without token weights and at a common scale e^{−c}."""
    x = random_sphere(2, 17, d, dtype=dtype, seed=11)
    A = (0.7 * torch.randn(2, 5, d, d, generator=gen(12), dtype=torch.float64)).to(dtype)
    keys = key_w = query_w = None
    c = 0.0
    if case == "weighted":
        key_w = torch.rand(2, 17, generator=gen(13), dtype=torch.float64) + 0.1
        key_w = (key_w / key_w.sum(-1, keepdim=True)).to(dtype)
        key_w[1, 3] = 0.0  # a zero-weight token
        query_w = key_w
    elif case == "off_sphere_keys":
        keys = 1.7 * random_sphere(2, 13, d, dtype=dtype, seed=14)
    elif case == "scaled":
        A = A * 30.0
        c = 25.0
    st = tp.softmax_statistics(x, tp.Heads(A), key_w, keys=keys, second_moment=True, backend="sdpa")
    sums = moments.head_moment_sums(st, query_w, c, x)
    assert sums is not None
    assert st.__dict__.get("_second") is None  # the per-token quadratic form was not formed
    T_ref, ito_ref = _dense_head_sums(x, A, key_w, query_w, keys, c)
    tol = _tol(dtype, 10.0 if case == "scaled" else 1.0)
    scale_T = float(T_ref.abs().max())
    torch.testing.assert_close(sums[0].double(), T_ref, rtol=tol["rtol"], atol=tol["atol"] * scale_T)
    torch.testing.assert_close(sums[1].double(), ito_ref, rtol=tol["rtol"], atol=tol["atol"] * float(ito_ref.abs().max()))
    # the lazily formed second moment is still the oracle's
    torch.testing.assert_close(st.second.double(), oracle(x, A, key_w, keys)[2], **_tol(dtype))
    # without the second moment: T alone
    st1 = tp.softmax_statistics(x, tp.Heads(A), key_w, keys=keys, backend="sdpa")
    T1, ito1 = moments.head_moment_sums(st1, query_w, c, x)
    assert ito1 is None
    torch.testing.assert_close(T1.double(), T_ref, rtol=tol["rtol"], atol=tol["atol"] * scale_T)


@pytest.mark.skipif(not backends.sdpa_available("cpu", torch.float64), reason="no fused CPU kernel in this torch")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pairing_and_ito_correction_agree_across_backends(dtype):
    """energy.pairing and energy.ito_correction read the fused kernel's per-head sums ("sdpa") or form
    the per-token terms ("chunked", no columns kept): the same numbers, and the sums are cached
    (the second pairing of a step reuses them, also after the weights' identity check).  Both layouts
    of the fused kernel: the heads folded into the query axis (keys shared by the heads, "_merged") and
    one kernel head per head (per-head key factors K_h, "_columns")."""
    x = random_sphere(3, 19, 3, dtype=dtype, seed=21)
    A = torch.randn(3, 6, 3, 3, generator=gen(22), dtype=torch.float64)
    Q = torch.randn(3, 6, 3, 3, generator=gen(26), dtype=torch.float64).to(dtype)
    M = torch.randn(3, 6, 3, 3, generator=gen(23), dtype=torch.float64).to(dtype)
    w = torch.rand(3, 19, generator=gen(24), dtype=torch.float64)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    sigma = torch.rand(3, 6, generator=gen(25), dtype=torch.float64).to(dtype)
    layouts = [(tp.Heads((A + A.transpose(-1, -2)).to(dtype)), "_merged"),
               (tp.Heads(query=Q, key=Q), "_columns")]  # A_h = Q_hᵀ Q_h symmetric, keys K_h x per head
    for (heads, layout), weights in itertools.product(layouts, (None, w)):
        fast = tp.softmax_statistics(x, heads, weights, second_moment=True, backend="sdpa")
        slow = tp.softmax_statistics(x, heads, weights, second_moment=True, backend="chunked")
        assert layout in fast.__dict__ and not {"_merged", "_columns"} & set(slow.__dict__)
        for c in (0.0, 2.5):
            p_fast = pairing(x, heads, weights, fast, M, log_scale=c)
            p_slow = pairing(x, heads, weights, slow, M, log_scale=c)
            torch.testing.assert_close(p_fast, p_slow, **_tol(dtype, 10.0))
            i_fast = ito_correction(heads, weights, fast, sigma, log_scale=c)
            i_slow = ito_correction(heads, weights, slow, sigma, log_scale=c)
            torch.testing.assert_close(i_fast, i_slow, **_tol(dtype, 10.0))
            cached = fast._moment_sums[2][0]
            pairing(x, heads, weights, fast, 2 * M, log_scale=c)
            assert fast._moment_sums[2][0] is cached
        assert fast.__dict__.get("_second") is None


# ==================================================================================================
# Causal and chunked kernels against dense prefix formulas, the chunk sizing at small memory caps,
# dtypes, and gradients through the differentiable path.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
from torch.testing import assert_close  # noqa: E402

F64 = torch.float64


# ---------------------------------------------------------------------------- causal kernels
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
    got = tp.softmax_statistics(x, heads, w, backend="chunked", chunk_elements=2 * 6, causal=True)
    # float64 sums of ≤ 6 positive terms: relative error ~1e-15 of log m (≤ 700 in the max-shift case)
    assert_close(got.log_partition, want_lse, rtol=1e-12, atol=1e-12)
    assert_close(got.mean, want_mean, rtol=1e-10, atol=1e-12)


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
    mass, first = tp.relu_statistics(x, heads, w, causal=True)
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


# ---------------------------------------------------------------------------- row chunks, bounds and dtypes
def test_differentiable_second_moment_over_several_row_chunks_against_the_dense_formula():
    """q_h(x_i) = Σ_j p_ij ⟨x_i, y_j⟩² from the differentiable path (x requires grad) with row chunks
    of 2 queries (chunk_elements = 2·m per head and batch), batch of 2, token weights, β ≠ 1: the
    chunks must be joined along the query axis.  Dense oracle: p_ij = w_j e^{s_ij} / Σ_l w_l e^{s_il}."""
    g = gen(90)
    x = tp.sphere.sample_uniform(7, 3, batch_shape=(2,), generator=g, dtype=torch.float64).requires_grad_(True)
    heads = tp.Heads.random(2, 3, generator=g, dtype=torch.float64, beta=1.7)
    w = torch.rand(2, 7, generator=g, dtype=torch.float64) + 0.2
    w = w / w.sum(-1, keepdim=True)
    st = tp.softmax_statistics(x, heads, w, second_moment=True, chunk_elements=2 * 7)
    xd = x.detach()
    S = heads.beta * torch.einsum("bid,hde,bje->bhij", xd, heads.score_matrix, xd)
    P = torch.softmax(S + torch.log(w)[:, None, None, :], -1)
    q = (P * (xd @ xd.transpose(-1, -2)).square()[:, None]).sum(-1)
    assert_close(st.second.detach(), q, rtol=1e-12, atol=1e-14)


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
    st = tp.softmax_statistics(x, heads, backend="chunked")
    assert bool(torch.isfinite(st.log_partition).all())
    assert_close(st.log_partition, _dense_lse(x, heads), rtol=1e-13, atol=0)


def test_chunked_second_moment_keeps_float32():
    """The (y ⊗ y) pair weights follow the input dtype: a float32 run stays float32."""
    x = tp.sphere.sample_uniform(6, 3, generator=gen(93), dtype=torch.float32)
    heads = tp.Heads.random(2, 3, generator=gen(94), dtype=torch.float32, beta=1.3)
    st = tp.softmax_statistics(x, heads, second_moment=True, backend="chunked")
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
    full = tp.relu_statistics(x, heads, backend="dense")
    two = tp.relu_statistics(x, heads, chunk_elements=3 * 6 * 2, backend="chunked")
    R = torch.relu(1.3 * torch.einsum("id,hde,je->hij", x, heads.score_matrix, x)) / 6
    for mass, first in (full, two):
        assert_close(mass, R.sum(-1), rtol=1e-13, atol=1e-15)
        assert_close(first, R @ x, rtol=1e-13, atol=1e-15)


def test_one_row_per_chunk_at_the_smallest_memory_cap():
    """chunk_elements=4 with a batch of 4 × 2 heads and m = 5 keys (far below one row of scores, 40
    elements): one query row per block, the same sums as dense.  Covers the row sizing of the ReLU
    kernel and of the differentiable softmax path."""
    x = tp.sphere.sample_uniform(5, 3, batch_shape=(4,), generator=gen(99), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(100), dtype=torch.float64, beta=1.3)
    R = torch.relu(1.3 * torch.einsum("bid,hde,bje->bhij", x, heads.score_matrix, x)) / 5
    mass, first = tp.relu_statistics(x, heads, chunk_elements=4, backend="chunked")
    assert_close(mass, R.sum(-1), rtol=1e-13, atol=1e-15)
    assert_close(first, R @ x.unsqueeze(-3), rtol=1e-13, atol=1e-15)
    xg = x.clone().requires_grad_(True)
    st = tp.softmax_statistics(xg, heads, chunk_elements=4)
    assert_close(st.log_partition.detach(), _dense_lse(x, heads), rtol=1e-13, atol=1e-15)


def test_gradient_reaches_the_keys_when_only_the_keys_require_it():
    """keys= requiring grad, queries not: the differentiable path must be taken (∂/∂y of Σ log m_h(x_i)
    equals the dense log-sum-exp's autograd gradient)."""
    x = tp.sphere.sample_uniform(4, 3, generator=gen(104), dtype=torch.float64)
    y = tp.sphere.sample_uniform(6, 3, generator=gen(105), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=gen(106), dtype=torch.float64, beta=1.3)
    yg, yd = y.clone().requires_grad_(True), y.clone().requires_grad_(True)
    tp.softmax_statistics(x, heads, keys=yg).log_partition.sum().backward()
    S = 1.3 * torch.einsum("id,hde,je->hij", x, heads.score_matrix, yd)
    (torch.logsumexp(S, -1) - math.log(6)).sum().backward()
    assert yg.grad is not None
    assert_close(yg.grad, yd.grad, rtol=1e-12, atol=1e-14)
