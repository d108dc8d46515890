"""transformer_pde.processes.nn: attention_matrix against the dense softmax formula (factors, key weights, other
keys, a batch of β), attention_modules' traversal of torch models, residual_attention_step's
normalised residual, and their refusals.  The comparisons with torch.nn.MultiheadAttention itself are in
tests/test_training.py."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen


def _dense_probabilities(x, A, beta, y, w):
    """p_hij = w_j e^{β⟨x_i, A_h y_j⟩} / Σ_l w_l e^{β⟨x_i, A_h y_l⟩}, float64 exp of shifted scores."""
    S = beta * torch.einsum("id,hde,je->hij", x, A, y)
    K = torch.exp(S - S.amax(-1, keepdim=True)) * w
    return K / K.sum(-1, keepdim=True)


def test_attention_matrix_against_the_dense_softmax():
    g = gen(1)
    x = tp.sphere.sample_uniform(4, 3, generator=g, dtype=torch.float64)
    y = tp.sphere.sample_uniform(6, 3, generator=g, dtype=torch.float64)
    Q = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    K = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    w = torch.rand(6, generator=g, dtype=torch.float64) + 0.2
    w = w / w.sum()
    A = Q.transpose(-1, -2) @ K
    for heads in (tp.Heads(None, None, None, 1.7, query=Q, key=K), tp.Heads(A, beta=1.7)):
        P = tp.nn.attention_matrix(x, heads, w, keys=y)
        assert P.shape == (2, 4, 6)
        assert_close(P, _dense_probabilities(x, A, 1.7, y, w), rtol=1e-13, atol=1e-15)
        assert_close(P.sum(-1), torch.ones(2, 4, dtype=torch.float64), rtol=0, atol=1e-15)
    # without weights and keys: the plain softmax over the tokens themselves
    P = tp.attention_matrix(x, tp.Heads(A, beta=1.7))
    assert_close(P, _dense_probabilities(x, A, 1.7, x, torch.full((4,), 0.25, dtype=torch.float64)),
                 rtol=1e-13, atol=1e-15)


def test_attention_matrix_with_a_batch_of_beta_and_float32():
    x = tp.sphere.sample_uniform(5, 3, generator=gen(2), dtype=torch.float32)
    A = torch.randn(1, 3, 3, generator=gen(3), dtype=torch.float32)
    beta = torch.tensor([0.5, 2.0], dtype=torch.float32)
    P = tp.attention_matrix(x, tp.Heads(A, beta=beta))
    assert P.shape == (2, 1, 5, 5) and P.dtype == torch.float32
    for b in range(2):
        want = _dense_probabilities(x.double(), A.double(), float(beta[b]), x.double(),
                                    torch.full((5,), 0.2, dtype=torch.float64))
        assert_close(P[b].double(), want, rtol=1e-5, atol=1e-7)


def test_attention_modules_in_order_of_depth():
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0) for _ in range(3)]
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0),
                                      num_layers=2, enable_nested_tensor=False)
    assert tp.nn.attention_modules(layers) == layers
    assert tp.nn.attention_modules(enc) == list(enc.layers)
    mha = torch.nn.MultiheadAttention(4, 2)
    assert tp.nn.attention_modules(mha) == [mha]
    theta = tp.layerwise_from_transformer(layers, layer_time=0.25, t0=1.0)
    assert len(theta.layers) == 3
    for k, layer in enumerate(layers):  # layer k holds on [1 + k/4, 1 + (k+1)/4)
        expect = tp.Heads.from_multihead_attention(layer)
        got = theta.heads_at(1.0 + 0.25 * k + 0.1)
        assert_close(got.score_matrix, expect.score_matrix, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="layer 1 is a Linear"):
        tp.nn.attention_modules([mha, torch.nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="holds no attention layers"):
        tp.nn.attention_modules([])


def test_residual_attention_step_is_the_normalised_residual_of_the_module():
    """x ← (x + α·MHA(r x)/r)/|·| with the module's own output; α = 0 keeps the tokens."""
    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(4, 2, bias=False).double()
    x = tp.sphere.sample_uniform(5, 4, generator=gen(4), dtype=torch.float64)
    r = math.sqrt(4)
    out = tp.residual_attention_step(mha, x, step=0.3, token_norm=r)
    y = x + 0.3 * mha(r * x, r * x, r * x, need_weights=False)[0] / r
    assert_close(out, y / y.norm(dim=-1, keepdim=True), rtol=1e-13, atol=1e-15)
    assert_close(out.norm(dim=-1), torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-15)
    assert_close(tp.residual_attention_step(mha, x, step=0.0), x, rtol=0, atol=1e-15)
    with pytest.raises(TypeError, match="expected a MultiheadAttention"):
        tp.residual_attention_step(torch.nn.Linear(4, 4), x)
    with pytest.raises(ValueError, match=r"x must be \(n, d\) or \(B, n, d\)"):
        tp.residual_attention_step(mha, x.expand(2, 2, 5, 4))
