"""The feed-forward rung (transformer_pde.analysis.pretrained_drift): the continuous rung with the network's
feed-forward as a per-layer drift, through tp.solve with tp.DriftEuler.
Oracles: the ladder's "continuous" rung (a zero feed-forward gives it back), the network's own feed-forward
modules applied by hand (transformers' BertIntermediate and the dense layer of BertOutput), Euler's order 1."""

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.analysis.pretrained_drift import continuous_feedforward, feedforward_drift
from test_pretrained import _inputs, _tiny, _tol, minilm, minilm_folder, needs_transformers  # noqa: F401 (fixtures)


def _zero_ff(net):
    """The network with every feed-forward's output weights and bias zero (F_l ≡ 0)."""
    layers = [dataclasses.replace(lw, ff_out=torch.zeros_like(lw.ff_out), ff_out_bias=torch.zeros_like(lw.ff_out_bias))
              for lw in net.layers]
    return dataclasses.replace(net, layers=layers)


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_zero_feedforward_gives_the_continuous_rung(dtype):
    net = tp.pretrained.load(_tiny("bert"), dtype=dtype)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", dtype))
    ref = tp.pretrained.ladder(net, states, mask, rungs=["continuous"], dt=1 / 4)["continuous"]
    got = continuous_feedforward(_zero_ff(net), states, mask, dt=1 / 4)
    m = mask[None, ..., None]
    assert got.shape == states.shape and got.dtype == dtype
    assert_close(got * m, ref * m, **_tol(ref))
    full = continuous_feedforward(net, states, mask, dt=1 / 4)  # the feed-forward moves the tokens
    assert float(((full - ref) * m).abs().max()) > 0.05 * float(ref.abs().max())
    assert_close(full.norm(dim=-1), torch.full_like(full[..., 0], math.sqrt(net.dim)), **_tol(ref))


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_drift_is_the_networks_feedforward_by_hand(dtype):
    """drift(t, x) = F_l(r x)/r, F_l = BertOutput.dense ∘ BertIntermediate of block l = ⌊t⌋ (clamped)."""
    net = tp.pretrained.load(_tiny("bert"), dtype=dtype)
    x = torch.nn.functional.normalize(torch.randn(3, 5, net.dim, generator=torch.Generator().manual_seed(0),
                                                  dtype=dtype), dim=-1)
    r = math.sqrt(net.dim)
    drift = feedforward_drift(net)
    blocks = net.model.encoder.layer
    with torch.no_grad():
        for t, l in ((0.0, 0), (0.75, 0), (1.0, 1), (1.5, 1), (2.0, 1)):
            by_hand = blocks[l].output.dense(blocks[l].intermediate(r * x)) / r
            assert_close(drift(t, x), by_hand, **_tol(by_hand))
    affine = feedforward_drift(net, ff_input="affine")  # the input with the first LayerNorm's gain and bias
    with torch.no_grad():
        for t, l in ((0.5, 0), (1.25, 1)):
            ln = blocks[l].attention.output.LayerNorm
            by_hand = blocks[l].output.dense(blocks[l].intermediate(ln.weight * (r * x) + ln.bias)) / r
            assert_close(affine(t, x), by_hand, **_tol(by_hand))


@needs_transformers
def test_the_rung_converges_at_order_one_in_dt():
    net = tp.pretrained.load(_tiny("bert"), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", torch.float64))
    m = mask[None, ..., None]
    ref = continuous_feedforward(net, states, mask, dt=1 / 512)  # the tiny network's fields are large: small dt
    errs = [float(((continuous_feedforward(net, states, mask, dt=h) - ref) * m).norm()) for h in (1 / 16, 1 / 32)]
    assert 1.6 < errs[0] / errs[1] < 2.6, errs


@needs_transformers
def test_refusals():
    gpt = tp.pretrained.load(_tiny("gpt2"))
    with pytest.raises(ValueError, match="post-LN"):
        feedforward_drift(gpt)
    net = tp.pretrained.load(_tiny("bert"))
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert"))
    with pytest.raises(ValueError, match="1/N"):
        continuous_feedforward(net, states, mask, dt=0.3)
    with pytest.raises(ValueError, match="states must be"):
        continuous_feedforward(net, states[1:], mask)
    with pytest.raises(ValueError, match="ff_input"):
        continuous_feedforward(net, states, mask, ff_input="layernorm")
    with pytest.raises(ValueError, match="layer_time"):
        feedforward_drift(net, layer_time=0.0)


@needs_transformers
def test_on_minilm_a_zero_feedforward_gives_the_continuous_rung(minilm):
    """The packaged all-MiniLM-L6-v2 on four short sentences (float32): the rung without its feed-forward is the
    ladder's "continuous" rung to rounding."""
    texts = ["The cat sat on the mat.", "Tokens move on a sphere.", "Attention is all you need.", "Hello world"]
    states, mask = tp.pretrained.hidden_states(minilm, texts)
    ref = tp.pretrained.ladder(minilm, states, mask, rungs=["continuous"], dt=1 / 4)["continuous"]
    got = continuous_feedforward(_zero_ff(minilm), states, mask, dt=1 / 4)
    m = mask[None, ..., None]
    assert_close(got * m, ref * m, **_tol(ref))
