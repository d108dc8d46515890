"""The values-first softmax field of value-factored heads (transformer_pde.model.values.softmax_values): the field,
per-head outputs and log-partitions equal those of the moments-first order (the same heads with dense score and
value matrices, and the dense einsum of tests/problems.py), torch.nn.MultiheadAttention's output, autograd
gradients of the moments-first path; and the order is taken only for the field without diagnostics.  The kernel
itself (every backend, the fused CPU kernel on its own, broadcast batch axes, gradients in each input) is checked
against the all-pairs products written out below."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_field, random_sphere, tolerances
from transformer_pde.model import field, values
from transformer_pde.model.values import softmax_values
from transformer_pde.model.field import evaluate

H, D, K, KV, N = 3, 6, 2, 4, 7


# (rtol, atol factor): sums of ≤ N·H products of O(1) terms, several roundings each
_tol = tolerances(f64=(1e-12, 1e-12), f32=(2e-5, 2e-5))


def _close(a, b, dtype):
    t = _tol(dtype)
    assert_close(a, b, rtol=t["rtol"], atol=t["atol"] * float(b.abs().max()))


def _factored(dtype, seed=0, batch=(), kv=KV, beta=1.3):
    g = gen(seed)
    Q, Kf = (torch.randn(*batch, H, K, D, generator=g, dtype=torch.float64) for _ in range(2))
    Wv = torch.randn(*batch, H, kv, D, generator=g, dtype=torch.float64)
    O = torch.randn(*batch, H, D, kv, generator=g, dtype=torch.float64)
    om = torch.rand(H, generator=g, dtype=torch.float64) + 0.2
    c = lambda t: t.to(dtype)  # noqa: E731
    return tp.Heads(None, None, c(om), beta, query=c(Q), key=c(Kf), value_in=c(Wv), value_out=c(O))


def _dense(h):
    """The same heads with the d×d score and value matrices (the moments-first order)."""
    return tp.Heads(h.query.transpose(-1, -2) @ h.key, h.value_out @ h.value_in, h.weights, h.beta)


def _padded_weights(shape, dtype, seed=1):
    """Token weights with zero-weight (padding) tokens in the middle and at the end, never at the start."""
    w = torch.rand(*shape, N, generator=gen(seed), dtype=torch.float64) + 0.1
    w[..., 2] = 0.0
    w[..., -1] = 0.0
    return (w / w.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
@pytest.mark.parametrize("causal", [False, True, "sum"])
@pytest.mark.parametrize("normalization", ["softmax", "unnormalized"])
def test_values_first_field_equals_the_moments_first_field(dtype, backend, causal, normalization):
    """Field, per-head outputs, log-partitions and the (deferred) means agree with the dense-value heads, with
    and without token weights, over batch axes of the heads (paths) and of the tokens (sentences)."""
    h = _factored(dtype, batch=(2, 1))
    x = random_sphere(3, N, D, dtype=dtype, seed=2)
    for w in (None, _padded_weights((3,), dtype)):
        new = evaluate(x, h, w, normalization=normalization, diagnostics=False, causal=causal, backend=backend)
        old = evaluate(x, _dense(h), w, normalization=normalization, diagnostics=False, causal=causal,
                       backend=backend)
        assert new.velocity.shape == (2, 3, N, D)
        _close(new.velocity, old.velocity, dtype)
        _close(new.ambient, old.ambient, dtype)
        _close(new.outputs, old.outputs, dtype)
        rtol, atol = _tol(dtype).values()
        assert_close(new.stats.log_partition, old.stats.log_partition, rtol=rtol, atol=10 * atol)
        _close(new.stats.mean, old.stats.mean, dtype)


def test_values_first_field_equals_the_dense_einsum(dtype):
    """Against the all-pairs einsum of tests/problems.py (non-causal softmax, weighted, V_h = O_h W_{V,h})."""
    h = _factored(dtype, seed=3, kv=5)
    x = random_sphere(N, D, dtype=dtype, seed=4)
    w = _padded_weights((), dtype)
    A = h.beta * h.query.transpose(-1, -2) @ h.key
    want, _ = naive_field(x.double(), A.double(), h.weights.double(), 1.0, w.double(),
                          V=(h.value_out @ h.value_in).double())
    got = evaluate(x, h, w, diagnostics=False).velocity
    _close(got, want.to(dtype), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_the_head_sum_is_torch_multihead_attention(dtype, causal):
    """Σ_h O_h ū_h (ω_h = 1, β = 1/√k, uniform weights on the real tokens) is MultiheadAttention's output with the
    same projections (bias-free), key padding and, causal, its causal mask."""
    Hm, k, d, n = 2, 3, 6, 5
    mha = torch.nn.MultiheadAttention(d, Hm, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.randn(3 * Hm * k, d, generator=gen(5)))
        mha.out_proj.weight.copy_(torch.randn(d, Hm * k, generator=gen(6)))
    mha = mha.to(dtype)
    Wq, Wk, Wv = mha.in_proj_weight.detach().reshape(3, Hm, k, d)
    O = mha.out_proj.weight.detach().reshape(d, Hm, k).transpose(0, 1)
    heads = tp.Heads(None, None, torch.ones(Hm, dtype=dtype), 1 / math.sqrt(k), query=Wq, key=Wk, value_in=Wv,
                     value_out=O)
    x = random_sphere(2, n, d, dtype=dtype, seed=7)
    real = torch.tensor([[True] * n, [True] * (n - 2) + [False] * 2])
    w = real.to(dtype) / real.sum(-1, keepdim=True)
    with torch.no_grad():
        mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None  # True: not attended
        want = mha(x, x, x, key_padding_mask=~real, attn_mask=mask, need_weights=False)[0]
    got = evaluate(x, heads, w, diagnostics=False, causal=causal).ambient
    _close(got, want, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradients_through_the_values_first_path_equal_the_moments_first_ones(causal, weighted):
    """float64 autograd gradients of ⟨c, V⟩ in x, the four factors, β and the token weights agree with those of
    the moments-first path (the same heads with diagnostics, which keep that path)."""
    dtype = torch.float64
    h0 = _factored(dtype, seed=8)
    c = torch.randn(N, D, generator=gen(9), dtype=dtype)
    w0 = torch.rand(N, generator=gen(10), dtype=dtype) + 0.1

    def grads(diagnostics):
        leaves = [random_sphere(N, D, dtype=dtype, seed=11).requires_grad_()]
        leaves += [t.clone().requires_grad_() for t in (h0.query, h0.key, h0.value_in, h0.value_out)]
        leaves.append(torch.tensor(1.3, dtype=dtype, requires_grad=True))
        if weighted:
            leaves.append(w0.clone().requires_grad_())
        x, Q, Kf, Wv, O, beta = leaves[:6]
        w = leaves[6] / leaves[6].sum() if weighted else None
        h = tp.Heads(None, None, h0.weights, beta, query=Q, key=Kf, value_in=Wv, value_out=O)
        v = evaluate(x, h, w, diagnostics=diagnostics, causal=causal).velocity
        return torch.autograd.grad((v * c).sum(), leaves)

    for a, b in zip(grads(False), grads(True)):
        assert_close(a, b, rtol=1e-10, atol=1e-11 * float(b.abs().max()))


def test_gradcheck_of_the_values_first_kernel():
    """torch.autograd.gradcheck of (log m_h, ū_h) in the queries, factors and weights (float64, causal)."""
    h = _factored(torch.float64, seed=12, beta=0.7)
    x = random_sphere(4, D, seed=13).requires_grad_()
    Q, Wv = h.query.clone().requires_grad_(), h.value_in.clone().requires_grad_()
    w = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64, requires_grad=True)

    def fn(x, Q, Wv, w):
        hh = tp.Heads(None, None, None, 0.7, query=Q, key=h.key, value_in=Wv, value_out=h.value_out)
        return softmax_values(x, hh, w, causal=True)

    assert torch.autograd.gradcheck(fn, (x, Q, Wv, w))


def test_a_causal_prefix_of_zero_weight_has_no_statistics_in_both_kernels():
    """A left-padded causal row (no key of positive weight) is NaN, as in softmax_statistics' plain path; the other
    rows agree between the fused and the plain kernels."""
    h = _factored(torch.float64, seed=14)
    x = random_sphere(N, D, seed=15)
    w = torch.tensor([0.0, 0.0, 0.2, 0.3, 0.1, 0.25, 0.15], dtype=torch.float64)
    ref = tp.softmax_statistics(x, _dense(h), w, causal=True, backend="chunked")
    for backend in ("sdpa", "chunked"):
        lse, u = softmax_values(x, h, w, causal=True, backend=backend)
        assert bool(torch.isnan(lse[:, :2]).all()) and bool(torch.isnan(u[:, :2]).all())
        assert bool(torch.isnan(ref.log_partition[:, :2]).all())
        assert_close(lse[:, 2:], ref.log_partition[:, 2:], rtol=1e-12, atol=1e-12)
        assert_close(u[:, 2:] @ h.value_out.transpose(-1, -2),
                     (ref.mean @ (h.value_out @ h.value_in).transpose(-1, -2))[:, 2:], rtol=1e-12, atol=1e-12)


def _spy(monkeypatch):
    """Counts of the values-first kernel and of the d-dimensional moments' kernel as the field module calls them."""
    calls = {"values": 0, "moments": 0}

    def values(*a, **kw):
        calls["values"] += 1
        return softmax_values(*a, **kw)

    def moments(*a, **kw):
        calls["moments"] += 1
        return tp.softmax_statistics(*a, **kw)

    monkeypatch.setattr(field, "softmax_values", values)
    monkeypatch.setattr(field, "softmax_statistics", moments)
    return calls


def test_the_values_first_kernel_runs_exactly_when_only_the_field_is_needed(monkeypatch):
    calls = _spy(monkeypatch)
    h = _factored(torch.float64, seed=16)
    x = random_sphere(2, N, D, seed=17)
    tp.velocity(x, h)
    evaluate(x, h, normalization="unnormalized", diagnostics=False, causal=True)
    assert calls == {"values": 2, "moments": 0}
    evaluate(x, h, diagnostics=True)  # E, 𝒢², 𝒟 need the moments of y
    evaluate(x, h, diagnostics=False, second_moment=True)
    evaluate(x, h, normalization="relu", diagnostics=False)
    evaluate(x, _dense(h), diagnostics=False)
    assert calls["values"] == 2 and calls["moments"] >= 2


def test_a_solve_without_diagnostics_takes_the_values_first_path(monkeypatch):
    """tp.solve of value-factored heads with LedgerOptions(diagnostics=False): no d-dimensional moments, and the
    tokens equal those of the dense-value heads."""
    calls = _spy(monkeypatch)
    h = _factored(torch.float64, seed=18, beta=0.5)
    x0 = random_sphere(2, N, D, seed=19)
    w = _padded_weights((2,), torch.float64)

    def run(heads):
        model = tp.Model(tp.Constant(heads), normalization="softmax", direction="ascent", weights=w)
        return tp.solve(model, x0, tp.Euler(), t1=0.3, dt=0.1, saveat=tp.SaveAt(record_every=3),
                        ledger=tp.LedgerOptions(diagnostics=False), progress=False).x[-1]

    got = run(h)
    assert calls["values"] == 4 and calls["moments"] == 0
    assert_close(got, run(_dense(h)), rtol=1e-12, atol=1e-12)


def test_softmax_values_refuses_heads_without_factors():
    h = _factored(torch.float64)
    assert values.values_first_applies(h) and not values.values_first_applies(_dense(h))
    with pytest.raises(ValueError, match="query/key factors and value factors"):
        softmax_values(random_sphere(N, D), _dense(h))


def test_a_query_shard_against_the_whole_measure(dtype):
    """keys=: the field at a shard of the queries from the measure of all tokens, as the dense-value heads give."""
    h = _factored(dtype, seed=20)
    x = random_sphere(2, N, D, dtype=dtype, seed=21)
    w = _padded_weights((2,), dtype)
    new = evaluate(x[:, :3], h, None, diagnostics=False, keys=x, key_weights=w)
    old = evaluate(x[:, :3], _dense(h), None, diagnostics=False, keys=x, key_weights=w)
    _close(new.velocity, old.velocity, dtype)
    rtol, atol = _tol(dtype).values()
    assert_close(new.stats.log_partition, old.stats.log_partition, rtol=rtol, atol=10 * atol)


def test_a_layer_map_solve_takes_the_values_first_path(monkeypatch):
    """geometry="post" (the layer maps' fused pass for dense heads): value-factored heads go through the
    values-first kernel and give the tokens of the dense-value heads."""
    calls = _spy(monkeypatch)
    h = _factored(torch.float64, seed=22, beta=0.5)
    x0 = random_sphere(2, N, D, seed=23)
    w = _padded_weights((2,), torch.float64)

    def run(heads):
        model = tp.Model(tp.Constant(heads), normalization="softmax", direction="ascent", layer_norm="post",
                         weights=w)
        return tp.solve(model, x0, tp.Euler(), t1=2.0, dt=1.0, saveat=tp.SaveAt(record_every=1),
                        ledger=tp.LedgerOptions(diagnostics=False), progress=False).x

    got = run(h)
    assert calls["values"] == 3 and calls["moments"] == 0
    assert_close(got, run(_dense(h)), rtol=1e-12, atol=1e-12)


def _all_pairs(x, y, h, w):
    """(log-partition, ū) by the all-pairs products: s_hij = β⟨Q_h x_i, K_h y_j⟩, log m = logsumexp_j(s + log w_j)
    (w_j = 1/m without weights), ū_h(x_i) = Σ_j e^{s_ij + log w_j − log m} W_{V,h} y_j."""
    q = h.beta * (x.unsqueeze(-3) @ h.query.transpose(-1, -2))  # (..., H, n, k)
    k = y.unsqueeze(-3) @ h.key.transpose(-1, -2)  # (..., H, m, k)
    u = y.unsqueeze(-3) @ h.value_in.transpose(-1, -2)  # (..., H, m, k_v)
    logw = -math.log(y.shape[-2]) if w is None else torch.log(w).unsqueeze(-2).unsqueeze(-2)
    s = q @ k.transpose(-1, -2) + logw
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ u
    return lse.expand(out.shape[:-1]), out  # batch axes of value_in only: the same log-partitions


def _weights(shape, m, dtype, seed):
    w = torch.rand(*shape, m, generator=gen(seed), dtype=torch.float64) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(dtype)


def _broadcast_cases(dtype):
    """(x, keys or None, heads, weights): batch axes carried by the queries only, the keys only, the weights
    only, one head factor only (key, value_in), every factor; a value width equal to d (the widest map)."""
    x3 = random_sphere(3, N, D, dtype=dtype, seed=11)
    x1 = random_sphere(N, D, dtype=dtype, seed=12)
    y1 = random_sphere(N - 2, D, dtype=dtype, seed=13)
    y3 = random_sphere(3, N - 2, D, dtype=dtype, seed=14)
    h = _factored(dtype, seed=15)
    hb = _factored(dtype, seed=16, batch=(3,))
    key_only = tp.Heads(None, None, h.weights, h.beta, query=h.query, key=hb.key, value_in=h.value_in,
                        value_out=h.value_out)
    value_only = tp.Heads(None, None, h.weights, h.beta, query=h.query, key=h.key, value_in=hb.value_in,
                          value_out=hb.value_out)
    return [(x3, y1, h, None), (x1, y3, h, None), (x1, y1, h, _weights((3,), N - 2, dtype, 17)),
            (x1, None, key_only, None), (x1, None, value_only, None), (x1, y3, hb, _weights((), N - 2, dtype, 18)),
            (x3, None, _factored(dtype, seed=19, kv=D), _weights((), N, dtype, 20))]


def _check_against_all_pairs(dtype, cases=None, **kw):
    for x, y, h, w in _broadcast_cases(dtype) if cases is None else cases:
        lse, u = softmax_values(x, h, w, keys=y, **kw)
        ref_lse, ref_u = _all_pairs(x, x if y is None else y, h, w)
        assert lse.shape == ref_lse.shape and u.shape == ref_u.shape
        rtol, atol = _tol(dtype).values()
        assert_close(lse, ref_lse, rtol=rtol, atol=10 * atol)
        _close(u, ref_u, dtype)


@pytest.mark.parametrize("backend,chunk", [("chunked", None), ("chunked", 5), ("dense", None), ("sdpa", None)])
def test_softmax_values_over_broadcast_batch_axes_equal_the_all_pairs_products(dtype, backend, chunk):
    """Every backend, and the plain path in blocks of a few query rows, against the all-pairs products when the
    batch axes sit on the queries, the keys, the weights or a single head factor."""
    cases = _broadcast_cases(dtype)
    if backend != "sdpa":  # weights with batch axes of their own: test_the_plain_path_with_weights_...
        del cases[2]
    _check_against_all_pairs(dtype, cases, backend=backend, chunk_elements=chunk)


def test_the_plain_path_with_weights_carrying_their_own_batch_axes():
    """Weights (3, m) for unbatched queries, keys and heads: the plain path's values against the all-pairs ones."""
    _check_against_all_pairs(torch.float64, [_broadcast_cases(torch.float64)[2]], backend="chunked")


def test_the_fused_kernel_alone_gives_the_values(dtype, monkeypatch):
    """With the plain path switched off, the CPU fused kernel (backend "auto" and "sdpa" without autograd) gives
    the all-pairs values itself over the same broadcast batch axes (it never needs the plain fallback)."""
    def refuse(*args):
        raise AssertionError("the plain path ran where the fused kernel applies")

    monkeypatch.setattr(values, "_plain", refuse)
    for backend in ("auto", "sdpa"):
        _check_against_all_pairs(dtype, backend=backend)


@pytest.mark.parametrize("leaf", ["x", "keys", "query", "key", "value_in", "beta", "weights"])
def test_softmax_values_gradient_in_each_input_equals_autograd_of_the_all_pairs_products(leaf):
    """Only one input requires grad (backend "auto"): the gradient of a random linear functional of (log m, ū)
    equals autograd through the all-pairs products, float64."""
    dt = torch.float64
    h = _factored(dt, seed=21)
    leaves = {"x": random_sphere(N, D, dtype=dt, seed=22), "keys": random_sphere(N - 1, D, dtype=dt, seed=23),
              "query": h.query, "key": h.key, "value_in": h.value_in, "beta": torch.tensor(1.3, dtype=dt),
              "weights": _weights((), N - 1, dt, 24)}
    r1 = torch.randn(H, N, generator=gen(25), dtype=dt)
    r2 = torch.randn(H, N, KV, generator=gen(26), dtype=dt)

    def grad(fn):
        t = {name: v.detach().clone().requires_grad_(name == leaf) for name, v in leaves.items()}
        hh = tp.Heads(None, None, h.weights, t["beta"], query=t["query"], key=t["key"], value_in=t["value_in"],
                      value_out=h.value_out)
        lse, u = fn(t["x"], t["keys"], hh, t["weights"])
        return torch.autograd.grad((lse * r1).sum() + (u * r2).sum(), t[leaf])[0]

    got = grad(lambda x, y, hh, w: softmax_values(x, hh, w, keys=y))
    assert_close(got, grad(_all_pairs), rtol=1e-10, atol=1e-10 * float(got.abs().max()))


def _relu_field(x, y, h, w, causal):
    """Σ_h ω_h O_h W_{V,h} Σ_j w_j ReLU(β⟨Q_h x_i, K_h y_j⟩) y_j, causal: over j ≤ i with the weights of the prefix
    renormalised to mass one (uniform: 1/(i+1))."""
    m = y.shape[-2]
    w = torch.full((m,), 1.0 / m, dtype=x.dtype) if w is None else w
    s = h.beta * (x.unsqueeze(-3) @ h.query.transpose(-1, -2)) @ (y.unsqueeze(-3) @ h.key.transpose(-1, -2)).transpose(-1, -2)
    K = torch.relu(s) * w
    if causal:
        K = torch.tril(K) / torch.cumsum(w, -1).unsqueeze(-1)
    f = (K @ y.unsqueeze(-3)) @ (h.value_out @ h.value_in).transpose(-1, -2)  # (..., H, n, d)
    return (h.weights.unsqueeze(-1).unsqueeze(-1) * f).sum(-3)


def test_fields_with_separate_keys_and_causal_relu_fields_equal_the_all_pairs_sums(dtype):
    """The values-first field's deferred means ȳ_h with keys= (the measure of the keys, not of the queries), and
    the ReLU field of factored heads with keys= and causal (prefix mean), against the all-pairs sums."""
    h = _factored(dtype, seed=27)
    x = random_sphere(N, D, dtype=dtype, seed=28)
    y = random_sphere(N - 2, D, dtype=dtype, seed=29)
    wy = _weights((), N - 2, dtype, 30)
    got = evaluate(x, h, None, keys=y, key_weights=wy, diagnostics=False)
    q = h.beta * (x.unsqueeze(-3) @ h.query.transpose(-1, -2))
    p = torch.softmax(q @ (y.unsqueeze(-3) @ h.key.transpose(-1, -2)).transpose(-1, -2) + torch.log(wy), -1)
    _close(got.stats.mean, p @ y, dtype)
    relu = evaluate(x, h, None, keys=y, key_weights=wy, normalization="relu", diagnostics=False)
    _close(relu.ambient, _relu_field(x, y, h, wy, False), dtype)
    for w in (None, _weights((), N, dtype, 31)):
        relu = evaluate(x, h, w, normalization="relu", diagnostics=False, causal=True)
        _close(relu.ambient, _relu_field(x, x, h, w, True), dtype)
