"""Use in training research: heads from torch.nn attention, differentiable solves, examples.

Oracles: the torch module itself (attention weights and outputs are exact where the model is),
weights read independently from in_proj_weight/out_proj.weight, dense vs factorised kernels,
torch.autograd.gradcheck in float64, central finite differences, adjoint vs backpropagation
vs a fine fixed-step solve, and the O(α²) step error of the residual block fitted as a slope.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.autograd import gradcheck
from torch.testing import assert_close

import transformer_pde as tp

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def _tokens(n, d, seed=0, dtype=F64, batch_shape=()):
    return tp.sphere.sample_uniform(n, d, batch_shape=batch_shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _mha(E=6, H=3, *, seed=0, dtype=F64, gain=2.0, bias=True, batch_first=False, zero_bias=True):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(gain)
        if bias and zero_bias:
            m.in_proj_bias.zero_()
            m.out_proj.bias.zero_()
    return m


def _per_head(m):
    """Per-head Q, K, W_V (H, k, d) and O (H, d, k), read with explicit loops (independent of nn.py)."""
    E, H = m.embed_dim, m.num_heads
    k = E // H
    W = m.in_proj_weight.detach()
    Q = torch.stack([W[h * k:(h + 1) * k] for h in range(H)])
    K = torch.stack([W[E + h * k:E + (h + 1) * k] for h in range(H)])
    V = torch.stack([W[2 * E + h * k:2 * E + (h + 1) * k] for h in range(H)])
    O = torch.stack([m.out_proj.weight.detach()[:, h * k:(h + 1) * k] for h in range(H)])
    return Q, K, V, O


# =============================================================================== conversion
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("batch_first", [False, True])
def test_attention_weights_and_outputs_match_module(dtype, batch_first):
    m = _mha(dtype=dtype, batch_first=batch_first)
    x = _tokens(7, 6, dtype=dtype, batch_shape=(2,))
    heads = tp.Heads.from_multihead_attention(m)
    xin = x if batch_first else x.transpose(0, 1)
    out, attn = m(xin, xin, xin, need_weights=True, average_attn_weights=False)
    out = out if batch_first else out.transpose(0, 1)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    assert_close(tp.attention_matrix(x, heads), attn.detach(), **tol)
    # MHA(x) = Σ_h f_h(x) (sum convention), and the ascent velocity is its tangent part
    assert_close(tp.head_outputs(x, heads).sum(-3), out.detach(), **tol)
    v = tp.velocity(x, heads, direction="ascent")
    out = out.detach()
    assert_close(v, out - (out * x).sum(-1, keepdim=True) * x, **tol)
    # "mean" head weights: the same field divided by H
    mean_heads = tp.Heads.from_multihead_attention(m, head_weights="mean")
    assert_close(tp.velocity(x, mean_heads, direction="ascent"), v / 3, **tol)


def test_weights_read_independently_and_low_rank_factors_kept():
    m = _mha(E=6, H=2)
    Q, K, V, O = _per_head(m)
    heads = tp.Heads.from_multihead_attention(m)
    assert heads.score is None and heads.query is not None  # k = 3 < d = 6: factors kept
    assert tuple(heads.query.shape) == (2, 3, 6) and tuple(heads.key.shape) == (2, 3, 6)
    assert_close(heads.query.detach(), Q, rtol=0, atol=0)
    assert_close(heads.score_matrix.detach(), Q.transpose(-1, -2) @ K)
    assert_close(heads.value_matrix.detach(), O @ V)
    assert heads.beta == pytest.approx(1 / math.sqrt(3))
    assert_close(heads.weights, torch.ones(2, dtype=F64))
    # dense kernel (A formed) vs factorised kernel: same field
    dense = tp.Heads.from_multihead_attention(m, keep_factors=False)
    assert dense.score is not None and dense.query is None
    x = _tokens(9, 6, seed=3)
    assert_close(tp.velocity(x, heads), tp.velocity(x, dense), rtol=1e-12, atol=1e-13)
    # one head of full size: k = d, no factors by default
    assert tp.Heads.from_multihead_attention(_mha(E=4, H=1)).query is None


def test_token_norm_folds_into_beta():
    m = _mha()
    x = _tokens(5, 6, seed=1)
    r = 2.5
    heads = tp.Heads.from_multihead_attention(m, token_norm=r)
    assert heads.beta == pytest.approx(r * r / math.sqrt(2))
    out = m(r * x, r * x, r * x, need_weights=False)[0].detach() / r
    assert_close(tp.head_outputs(x, heads).sum(-3), out, rtol=1e-12, atol=1e-12)


def test_separate_projection_weights():
    E, H = 6, 2
    torch.manual_seed(1)
    m = torch.nn.MultiheadAttention(E, H, kdim=E + 1, vdim=E + 1, bias=False, dtype=F64)
    # turn the cross-attention module into a self-attention one with separate q/k/v weights
    with torch.no_grad():
        m.k_proj_weight = torch.nn.Parameter(torch.randn(E, E, dtype=F64))
        m.v_proj_weight = torch.nn.Parameter(torch.randn(E, E, dtype=F64))
    m.kdim = m.vdim = E
    assert m.in_proj_weight is None
    x = _tokens(5, E, seed=2)
    heads = tp.Heads.from_multihead_attention(m)
    out, attn = m(x, x, x, need_weights=True, average_attn_weights=False)
    assert_close(tp.attention_matrix(x, heads), attn.detach())
    assert_close(tp.head_outputs(x, heads).sum(-3), out.detach())


def test_biases_key_bias_exact_others_dropped_or_refused():
    m = _mha(zero_bias=True)
    E = m.embed_dim
    x = _tokens(6, E, seed=4)
    with torch.no_grad():
        m.in_proj_bias[E:2 * E].normal_()  # key bias: cancels in the softmax
    heads = tp.Heads.from_multihead_attention(m, bias="error")
    out = m(x, x, x, need_weights=False)[0].detach()
    assert_close(tp.head_outputs(x, heads).sum(-3), out)
    # value and output biases: the module adds the constant c = Σ_h O_h b_V,h + b_O, which the model drops
    with torch.no_grad():
        m.in_proj_bias[2 * E:].normal_()
        m.out_proj.bias.normal_()
    c = m.out_proj.weight.detach() @ m.in_proj_bias[2 * E:].detach() + m.out_proj.bias.detach()
    out = m(x, x, x, need_weights=False)[0].detach()
    with pytest.warns(UserWarning, match=r"value bias .*output bias.*bias='error'"):
        dropped = tp.Heads.from_multihead_attention(m)  # bias="warn" (default): dropped, with a warning
    assert_close(out - tp.head_outputs(x, dropped).sum(-3), c.expand_as(out))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bias="drop": the same heads, knowingly, without a warning
        silent = tp.Heads.from_multihead_attention(m, bias="drop")
    assert_close(tp.head_outputs(x, silent).sum(-3), tp.head_outputs(x, dropped).sum(-3))
    with pytest.raises(ValueError, match="value bias"):
        tp.Heads.from_multihead_attention(m, bias="error")
    with torch.no_grad():
        m.in_proj_bias.zero_()
        m.in_proj_bias[:E].normal_()
    with pytest.raises(ValueError, match="query bias"):
        tp.Heads.from_multihead_attention(m, bias="error")
    kv = torch.nn.MultiheadAttention(4, 2, add_bias_kv=True, dtype=F64)
    with pytest.raises(ValueError, match="add_bias_kv"):
        tp.Heads.from_multihead_attention(kv, bias="error")


def test_dict_of_per_head_tensors_and_batched_dict():
    m = _mha(E=6, H=2)
    Q, K, V, O = _per_head(m)
    from_dict = tp.Heads.from_multihead_attention({"Q": Q, "K": K, "V": V, "O": O})
    from_module = tp.Heads.from_multihead_attention(m)
    assert_close(from_dict.score_matrix, from_module.score_matrix.detach())
    assert_close(from_dict.value_matrix, from_module.value_matrix.detach())
    assert from_dict.beta == pytest.approx(from_module.beta)
    # batched dict (an ensemble of 3 models), full value matrices without an output projection
    g = torch.Generator().manual_seed(0)
    Qb, Kb = torch.randn(3, 2, 2, 4, generator=g, dtype=F64), torch.randn(3, 2, 2, 4, generator=g, dtype=F64)
    Vb = torch.randn(3, 2, 4, 4, generator=g, dtype=F64)
    hb = tp.Heads.from_multihead_attention({"query": Qb, "key": Kb, "value": Vb}, beta=1.0)
    assert tuple(hb.batch_shape) == (3,)
    assert_close(hb.score_matrix, Qb.transpose(-1, -2) @ Kb)
    assert_close(hb.value_matrix, Vb)


def test_encoder_layers_become_layerwise():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=F64)
    enc = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    assert len(tp.nn.attention_modules(enc)) == 3
    theta = tp.layerwise_from_transformer(enc, token_norm=math.sqrt(8), layer_time=0.5)
    assert isinstance(theta, tp.Layerwise) and len(theta.layers) == 3
    for l, lay in enumerate(enc.layers):
        expect = tp.Heads.from_multihead_attention(lay.self_attn, token_norm=math.sqrt(8))
        got = theta.heads_at(0.5 * l + 0.25)
        assert_close(got.score_matrix, expect.score_matrix)
        assert_close(got.value_matrix, expect.value_matrix)
        assert got.beta == pytest.approx(8 / 2)
    lin = tp.layerwise_from_transformer(list(enc.layers), interpolation="linear")
    mid = 0.5 * (lin.layers[0].score_matrix + lin.layers[1].score_matrix)
    assert_close(lin.heads_at(0.5).score_matrix, mid)
    # a single layer is accepted by the Heads builder (its self-attention)
    assert_close(tp.Heads.from_multihead_attention(enc.layers[1]).score_matrix, theta.layers[1].score_matrix)


def test_residual_block_is_an_euler_step_up_to_second_order():
    """normalise(x + α MHA(x)) vs one projected-Euler step of length α: error ∝ α² (fitted slope)."""
    m = _mha(E=6, H=2, gain=3.0)
    heads = tp.Heads.from_multihead_attention(m, detach=True)
    x = _tokens(8, 6, seed=5)
    alphas = [0.2, 0.1, 0.05, 0.025]
    errs = []
    with torch.no_grad():
        for a in alphas:
            block = tp.residual_attention_step(m, x, step=a)
            step = tp.simulate(x, heads, t1=a, dt=a, method="euler", direction="ascent", diagnostics=False).final
            errs.append(float((block - step).norm(dim=-1).max()))
    lx, ly = torch.log(torch.tensor(alphas)), torch.log(torch.tensor(errs))
    order = float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())
    assert 1.8 < order < 2.2, (order, errs)
    assert errs[0] > 1e-6  # the difference is real, not zero


def test_conversion_is_differentiable_wrt_module_parameters():
    m = _mha(E=4, H=2, gain=1.5)
    x0 = _tokens(6, 4, seed=6)

    def loss():
        heads = tp.Heads.from_multihead_attention(m)
        return tp.simulate(x0, heads, t1=0.5, dt=0.1, method="rk4", direction="ascent", ledger=True).final[:, 0].sum()

    (g,) = torch.autograd.grad(loss(), m.in_proj_weight)
    W = m.in_proj_weight
    h = 1e-6
    for idx in [(0, 1), (5, 2), (10, 3)]:
        with torch.no_grad():
            W[idx] += h
            lp = loss()
            W[idx] -= 2 * h
            lm = loss()
            W[idx] += h
        assert_close(g[idx], (lp - lm) / (2 * h), rtol=1e-6, atol=1e-9)
    assert tp.Heads.from_multihead_attention(m, detach=True).query.requires_grad is False


def test_conversion_input_errors():
    with pytest.raises(TypeError, match="MultiheadAttention"):
        tp.Heads.from_multihead_attention(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="kdim"):
        tp.Heads.from_multihead_attention(torch.nn.MultiheadAttention(4, 2, kdim=3, vdim=3))
    m = _mha()
    with pytest.raises(ValueError, match="head_weights"):
        tp.Heads.from_multihead_attention(m, head_weights="max")
    with pytest.raises(TypeError, match="head_weights"):
        tp.Heads.from_multihead_attention(m, head_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="bias"):
        tp.Heads.from_multihead_attention(m, bias="fold")
    with pytest.raises(ValueError, match="token_norm"):
        tp.Heads.from_multihead_attention(m, token_norm=0.0)
    with pytest.raises(ValueError, match="beta"):
        tp.Heads.from_multihead_attention(m, beta=float("nan"))
    assert tp.Heads.from_multihead_attention(m, beta=-1.0).beta == -1.0  # β < 0 is a valid (repulsive) head
    with pytest.raises(ValueError, match="unknown keys"):
        tp.Heads.from_multihead_attention({"q": torch.ones(1, 2, 3), "k": torch.ones(1, 2, 3), "v": torch.ones(1, 3, 3), "x": 1})
    with pytest.raises(ValueError, match="lacks"):
        tp.Heads.from_multihead_attention({"q": torch.ones(1, 2, 3), "k": torch.ones(1, 2, 3)})
    with pytest.raises(ValueError, match="same shape"):
        tp.Heads.from_multihead_attention({"q": torch.ones(1, 2, 3), "k": torch.ones(1, 1, 3), "v": torch.ones(1, 3, 3)})
    with pytest.raises(TypeError, match="layer 1"):
        tp.nn.attention_modules([m, torch.nn.ReLU()])
    with pytest.raises(TypeError, match="cannot find"):
        tp.layerwise_from_transformer(torch.nn.Linear(3, 3))
    x = _tokens(4, 6)
    with pytest.raises(ValueError, match="unit sphere"):
        tp.residual_attention_step(m, 2 * x)
    with pytest.raises(ValueError, match=r"\(n, d\) or \(B, n, d\)"):
        tp.residual_attention_step(m, x.expand(2, 2, 4, 6))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        tp.residual_attention_step(torch.nn.Linear(6, 6), x)


# =============================================================================== gradients
def _small(seed=0, n=3, d=3, H=2):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=F64)
    A = 0.7 * torch.randn(H, d, d, generator=g, dtype=F64)
    V = 0.7 * torch.randn(H, d, d, generator=g, dtype=F64)
    return z, A, V


@pytest.mark.parametrize("method", ["euler", "heun", "rk4"])
def test_gradcheck_tokens_heads_beta(method):
    z, A, V = _small()
    beta = torch.tensor(1.3, dtype=F64)

    def f(z, A, V, beta):
        heads = tp.Heads(A, V, beta=beta)
        tr = tp.simulate(tp.sphere.normalize(z), heads, t1=0.3, dt=0.1, method=method, direction="ascent", ledger=True)
        return tr.final, tr.energy[-1], tr.ledger["slope"][-1], tr.ledger["dissipation"][-1]

    inputs = tuple(t.clone().requires_grad_() for t in (z, A, V, beta))
    # the full Jacobian for Euler; random projections of it (gradcheck's fast mode) for the others
    assert gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=method != "euler")


def test_gradcheck_factor_heads_and_head_weights():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 3, generator=g, dtype=F64)
    Q, K = torch.randn(2, 2, 3, generator=g, dtype=F64), torch.randn(2, 2, 3, generator=g, dtype=F64)
    V = torch.randn(2, 3, 3, generator=g, dtype=F64)
    w = torch.tensor([0.7, 1.4], dtype=F64)

    def f(z, Q, K, V, w):
        heads = tp.Heads(query=Q, key=K, value=V, weights=w)
        return tp.simulate(tp.sphere.normalize(z), heads, t1=0.2, dt=0.1, method="heun", diagnostics=False).final

    assert gradcheck(f, tuple(t.clone().requires_grad_() for t in (z, Q, K, V, w)), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("scheme", ["exact", "euler"])
def test_gradcheck_ou_parameters(scheme):
    """rate, sigma, mean and the initial heads of a noisy OU path (fixed seed: a deterministic map)."""
    z, A, _ = _small(seed=2)
    A = 0.5 * (A + A.transpose(-1, -2))
    mean = torch.eye(3, dtype=F64) + 0.1 * torch.ones(3, 3, dtype=F64)

    def f(z, A, rate, sigma, mean):
        proc = tp.OrnsteinUhlenbeck(tp.Heads(A), mean=mean, rate=rate, sigma=sigma, scheme=scheme)
        tr = tp.simulate(tp.sphere.normalize(z), proc, t1=0.3, dt=0.1, method="heun", seed=5, ledger=True)
        return tr.final, tr.energy[-1], tr.ledger["partial"][-1], tr.ledger["martingale"][-1]

    inputs = (z, A, torch.tensor(0.8, dtype=F64), torch.tensor(0.6, dtype=F64), mean)
    assert gradcheck(f, tuple(t.clone().requires_grad_() for t in inputs), eps=1e-6, atol=1e-6, rtol=1e-5,
                     fast_mode=scheme == "euler")


def test_gradcheck_ou_closed_form_and_oscillating():
    z, A, _ = _small(seed=3)
    A = 0.5 * (A + A.transpose(-1, -2))

    def f_ou(z, A, rate):
        proc = tp.OrnsteinUhlenbeck(tp.Heads(A), rate=rate, sigma=0.0)
        assert proc.closed_form
        return tp.simulate(tp.sphere.normalize(z), proc, t1=0.3, dt=0.1, method="rk4", ledger=True).final

    def f_osc(z, A, sigma):
        proc = tp.Oscillating(tp.Heads(A), phase="per_head", sigma=sigma)
        tr = tp.simulate(tp.sphere.normalize(z), proc, t1=0.3, dt=0.1, method="euler", seed=1, ledger=True)
        return tr.final, tr.energy[-1]

    assert gradcheck(f_ou, (z.clone().requires_grad_(), A.clone().requires_grad_(),
                            torch.tensor(0.9, dtype=F64, requires_grad=True)), eps=1e-6, atol=1e-6, fast_mode=True)
    assert gradcheck(f_osc, (z.clone().requires_grad_(), A.clone().requires_grad_(),
                             torch.tensor(0.4, dtype=F64, requires_grad=True)), eps=1e-6, atol=1e-6, fast_mode=True)


def test_gradcheck_layerwise_linear():
    z, A, V = _small(seed=4, n=4)

    def f(z, A, V):
        theta = tp.Layerwise([tp.Heads(A, V), tp.Heads(V, A)], interpolation="linear", layer_time=0.2)
        return tp.simulate(tp.sphere.normalize(z), theta, t1=0.4, dt=0.1, method="rk4", diagnostics=False).final

    assert gradcheck(f, tuple(t.clone().requires_grad_() for t in (z, A, V)), eps=1e-6, atol=1e-6, fast_mode=True)


def test_gradient_against_finite_differences_larger_problem():
    """n = 40, H = 4, d = 5, RK4: directional derivatives of a scalar loss, autograd vs central FD."""
    g = torch.Generator().manual_seed(7)
    n, d, H = 40, 5, 4
    x0 = tp.sphere.sample_uniform(n, d, generator=g, dtype=F64)
    A = 0.5 * torch.randn(H, d, d, generator=g, dtype=F64)
    V = 0.5 * torch.randn(H, d, d, generator=g, dtype=F64)
    beta = torch.tensor(2.0, dtype=F64)
    target = tp.sphere.sample_uniform(1, d, generator=g, dtype=F64)[0]

    def loss(x0, A, V, beta):
        tr = tp.simulate(x0, tp.Heads(A, V, beta=beta), t1=1.0, dt=0.05, method="rk4", direction="ascent", ledger=True)
        return (tr.final @ target).mean() + tr.ledger["slope"][-1]

    params = [t.clone().requires_grad_() for t in (A, V, beta)]
    xg = x0.clone().requires_grad_()
    grads = torch.autograd.grad(loss(xg, *params), [xg, *params])
    h = 1e-5
    for i, p in enumerate([x0, A, V, beta]):
        dirn = torch.randn(p.shape, generator=g, dtype=F64)
        if i == 0:
            dirn = dirn - (dirn * x0).sum(-1, keepdim=True) * x0  # tangent direction; retract below

        def shifted(s):
            args = [x0, A, V, beta]
            q = args[i] + s * dirn
            args[i] = tp.sphere.normalize(q) if i == 0 else q
            with torch.no_grad():
                return loss(*args)

        fd = (shifted(h) - shifted(-h)) / (2 * h)
        assert_close((grads[i] * dirn).sum(), fd, rtol=1e-6, atol=1e-9)


def test_float32_gradients_follow_float64():
    z, A, V = _small(seed=8, n=6)

    def grads(dtype):
        At, Vt = A.to(dtype).requires_grad_(), V.to(dtype).requires_grad_()
        x0 = tp.sphere.normalize(z.to(dtype))
        tr = tp.simulate(x0, tp.Heads(At, Vt), t1=0.5, dt=0.05, method="rk4", diagnostics=False)
        return [g.to(F64) for g in torch.autograd.grad(tr.final[:, 0].sum(), (At, Vt))]

    for g32, g64 in zip(grads(torch.float32), grads(F64)):
        assert g32.dtype == F64
        assert_close(g32, g64, rtol=1e-4, atol=1e-5)


# =============================================================================== adjoint
def _adaptive_grads(make, params, x0, *, adjoint, rtol=1e-9, w=None):
    ps = [p.clone().requires_grad_() for p in params]
    wt = None if w is None else w.clone().requires_grad_()
    tr = tp.simulate(x0, make(*ps), t1=1.0, dt=0.5, method="adaptive", adjoint=adjoint, rtol=rtol, atol=rtol * 1e-2,
                     direction="ascent", weights=wt, seed=3, ledger=True)
    loss = (tr.final[..., 0] ** 2).sum() + tr.energy[-1].sum()
    return torch.autograd.grad(loss, ps + ([wt] if wt is not None else []))


@pytest.mark.parametrize("case", ["constant", "ou_closed", "ou_noisy", "tied_values", "factors"])
def test_adjoint_equals_backprop(case):
    g = torch.Generator().manual_seed(11)
    x0 = tp.sphere.sample_uniform(5, 3, generator=g, dtype=F64)
    A = 0.8 * torch.randn(2, 3, 3, generator=g, dtype=F64)
    A = 0.5 * (A + A.transpose(-1, -2))
    w = None
    if case == "constant":
        make, params = (lambda A, beta: tp.Heads(A, beta=beta)), [A, torch.tensor(1.2, dtype=F64)]
        w = torch.full((5,), 0.2, dtype=F64)
    elif case == "ou_closed":  # time-dependent closed form: needs the detached first step of backprop
        make, params = (lambda A, rate: tp.OrnsteinUhlenbeck(tp.Heads(A), rate=rate, sigma=0.0)), [A, torch.tensor(0.7, dtype=F64)]
    elif case == "ou_noisy":  # a sampled path: the path is a function of A, rate and sigma
        make = lambda A, rate, sigma: tp.OrnsteinUhlenbeck(tp.Heads(A), rate=rate, sigma=sigma)  # noqa: E731
        params = [A, torch.tensor(0.7, dtype=F64), torch.tensor(0.5, dtype=F64)]
    elif case == "tied_values":  # V = 2A: a parameter that is a function of another one
        make, params = (lambda A: tp.Heads(A, 2 * A)), [A]
    else:
        Q = torch.randn(2, 2, 3, generator=g, dtype=F64)
        make, params = (lambda Q, V: tp.Heads(query=Q, key=2 * Q, value=V)), [Q, A]
    back = _adaptive_grads(make, params, x0, adjoint=False, w=w)
    adj = _adaptive_grads(make, params, x0, adjoint=True, w=w)
    for b, a in zip(back, adj):
        assert_close(a, b, rtol=1e-6, atol=1e-8)
    if case in ("ou_closed", "tied_values"):  # and both equal the gradient of a fine RK4 solve
        ps = [p.clone().requires_grad_() for p in params]
        tr = tp.simulate(x0, make(*ps), t1=1.0, dt=0.01, method="rk4", direction="ascent", ledger=True)
        ref = torch.autograd.grad((tr.final[..., 0] ** 2).sum() + tr.energy[-1].sum(), ps)
        for r, a in zip(ref, adj):
            assert_close(a, r, rtol=1e-6, atol=1e-8)


def test_adjoint_options_are_validated():
    x0 = _tokens(4, 3)
    heads = tp.Heads.scalar([1.0], 3).to(F64)
    with pytest.raises(ValueError, match="adaptive"):
        tp.simulate(x0, heads, t1=1.0, dt=0.5, method="rk4", adjoint=True, ledger=True)
    with pytest.raises(TypeError, match="adjoint"):
        tp.simulate(x0, heads, t1=1.0, dt=0.5, method="adaptive", adjoint="yes", ledger=True)


def test_process_parameters_tensor_or_float():
    heads = tp.Heads.scalar([1.0, 2.0], 3).to(F64)
    ou = tp.OrnsteinUhlenbeck(heads, rate=torch.tensor(0.5, dtype=F64), sigma=torch.tensor(1.0, dtype=F64))
    assert isinstance(ou.rate, float) and isinstance(ou.sigma_value, float)  # no grad: floats, as before
    r = torch.tensor([0.5], dtype=F64, requires_grad=True)
    ou = tp.OrnsteinUhlenbeck(heads, rate=r)
    assert isinstance(ou.rate, torch.Tensor) and ou.rate.dim() == 0 and ou.rate.requires_grad
    mean, var = ou.moments(0.5)
    assert_close(mean, torch.eye(3, dtype=F64) + math.exp(-0.25) * (heads.score - torch.eye(3, dtype=F64)))
    assert_close(var[0, 0], torch.tensor(2 * (1 - math.exp(-0.5)) / 1.0, dtype=F64))
    with pytest.raises(ValueError, match="scalar"):
        tp.OrnsteinUhlenbeck(heads, rate=torch.ones(2, dtype=F64, requires_grad=True))
    with pytest.raises(ValueError, match="rate"):
        tp.OrnsteinUhlenbeck(heads, rate=torch.tensor(-1.0, dtype=F64, requires_grad=True))
    with pytest.raises(TypeError, match="dtype"):
        tp.OrnsteinUhlenbeck(heads, sigma=torch.tensor(1.0, dtype=torch.float32, requires_grad=True))
    with pytest.raises(ValueError, match="sigma"):
        tp.Oscillating(heads, sigma=torch.tensor(-0.1, dtype=F64, requires_grad=True))


# =============================================================================== examples and README
def _load_example(name):
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_example_compare_real_transformer(tmp_path):
    ex = _load_example("compare_real_transformer")
    m = ex.run(quick=True, out=tmp_path, verbose=False)
    refined = m["refined_block_vs_flow"]
    assert all(a > b for a, b in zip(refined, refined[1:])), refined
    assert 0.6 < m["refinement_order"] < 1.4, m["refinement_order"]
    assert m["final_euler_vs_block"] < m["final_block_vs_flow"]
    assert m["final_moved"] > 2 * m["final_block_vs_flow"]
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "figures" / "compare_real_transformer.png").exists()


def test_example_learn_clustering(tmp_path):
    ex = _load_example("learn_clustering")
    m = ex.run(quick=True, iters=8, batch=4, n=12, lr=0.1, out=tmp_path, progress=False, verbose=False)
    assert m["test_loss_final"] < 0.75 * m["test_loss_initial"], m
    assert (tmp_path / "series" / "training.csv").exists()


def test_example_energy_regularizer(tmp_path):
    ex = _load_example("energy_regularizer")
    m = ex.run(quick=True, iters=4, batch=8, n=8, test_size=16, out=tmp_path, progress=False, verbose=False)
    r0, r1 = m["results"]["0"], m["results"]["1"]
    assert r1["kinetic"] < 0.5 * r0["kinetic"], m
    with pytest.raises(ValueError, match="regularizer"):
        ex.run(quick=True, regularizer_kind="entropy", out=None)


def test_readme_training_snippet_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- section:training -->", 1)[1].split("<!-- section:", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the training section has no python snippet"
    exec(compile(code.group(1), "README.md[training]", "exec"), {})
