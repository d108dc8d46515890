"""tp.nn.MeanFieldAttention: a training loop that trains, its forward against an explicit loop of
residual steps with the heads of a real MultiheadAttention, gradients against finite differences
(float64), the adjoint against backpropagation, the kinetic term against a recomputation from the
recorded states, repeated backward passes, both dtypes, and the refusals."""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_field, naive_slope

F64 = torch.float64


def _tokens(B, n, d, *, seed=0, dtype=F64):
    x = torch.randn(B, n, d, generator=gen(seed), dtype=F64)
    return (x / x.norm(dim=-1, keepdim=True)).to(dtype)


def _mha_of_layer(m, layer):
    """A bias-free torch MultiheadAttention holding the module's projections of one layer."""
    d, H, k = m.dim, m.num_heads, m.head_dim
    mha = torch.nn.MultiheadAttention(d, H, bias=False, dtype=m.query.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([m.query[layer].reshape(H * k, d), m.key[layer].reshape(H * k, d),
                                            m.value[layer].reshape(H * k, d)]))
        mha.out_proj.weight.copy_(m.output[layer].permute(1, 0, 2).reshape(d, H * k))
    return mha


def _loop(m, x):
    """Projected Euler x ← (x + dt v)/|x + dt v|, v = P_x MHA(r x)/r with the torch module of each layer
    (r = ‖token‖ chosen so that MHA's 1/√k scaling times r² is the module's β), then the feed-forward step."""
    r = math.sqrt(m.beta * math.sqrt(m.head_dim))
    dt = m.t1 / (m.layers * m.steps)
    for layer in range(m.layers):
        mha = _mha_of_layer(m, layer)
        for _ in range(m.steps):
            out = mha(r * x.transpose(0, 1), r * x.transpose(0, 1), r * x.transpose(0, 1),
                      need_weights=False)[0].transpose(0, 1) / r
            v = out - (out * x).sum(-1, keepdim=True) * x
            y = x + dt * v
            x = y / y.norm(dim=-1, keepdim=True)
        if m.feedforward:
            h = torch.nn.functional.gelu(x @ m.ff_in[layer].T + m.ff_bias[layer])
            y = x + (m.t1 / m.layers) * (h @ m.ff_out[layer].T)
            x = y / y.norm(dim=-1, keepdim=True)
    return x


@pytest.mark.parametrize("feedforward", [0, 6])
def test_forward_is_the_residual_loop_of_real_attention_layers(dtype, feedforward):
    torch.manual_seed(0)
    m = tp.nn.MeanFieldAttention(4, 2, layers=3, t1=1.5, steps=2, feedforward=feedforward, dtype=dtype)
    x = _tokens(2, 5, 4, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == x.shape
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        assert_close(y.detach(), _loop(m, x), **tol)
    assert_close(y.norm(dim=-1), torch.ones(2, 5, dtype=dtype), **tol)


def test_float32_and_float64_agree():
    torch.manual_seed(1)
    m64 = tp.nn.MeanFieldAttention(6, 3, layers=2, t1=1.0, steps=3, feedforward=4, dtype=F64)
    m32 = tp.nn.MeanFieldAttention(6, 3, layers=2, t1=1.0, steps=3, feedforward=4, dtype=torch.float32)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    x = _tokens(3, 4, 6)
    y64, k64 = m64(x, kinetic=True)
    y32, k32 = m32(x.float(), kinetic=True)
    assert y32.dtype == torch.float32 and k32.dtype == torch.float32
    assert_close(y32.double(), y64, rtol=1e-5, atol=1e-5)
    assert_close(k32.double(), k64, rtol=1e-4, atol=1e-6)


def test_a_training_loop_reduces_the_loss_and_survives_many_backward_passes(dtype):
    torch.manual_seed(2)
    m = tp.nn.MeanFieldAttention(4, 2, layers=2, t1=1.0, steps=2, dtype=dtype)
    x = _tokens(8, 6, 4, seed=3, dtype=dtype)
    target = torch.zeros(4, dtype=dtype)
    target[0] = 1.0
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    losses = []
    for _ in range(8):  # eight backward() calls through eight solves: the heads are rebuilt in every forward
        y, kin = m(x, kinetic=True)
        loss = (1 - y.mean(-2) @ target).mean() + 1e-3 * kin.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


def test_heads_built_once_cannot_be_reused_after_backward():
    """The rule the module follows: heads are tensors computed from the parameters; built once with a dense
    score, a second backward() meets the freed graph; built again in the loop (or kept as factors) it works."""
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(4, 2, bias=False, dtype=F64)
    x = _tokens(1, 5, 4)[0]
    # dense scores A_h = Q_hᵀK_h are a product formed once: its graph is freed by the first backward
    heads = tp.Heads.from_multihead_attention(mha, keep_factors=False)
    tp.simulate(x, heads, t1=0.2, dt=0.1, direction="ascent").final.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tp.simulate(x, heads, t1=0.2, dt=0.1, direction="ascent").final.sum().backward()
    # kept as factors (views of the parameters, multiplied inside every solve) they can be reused
    heads = tp.Heads.from_multihead_attention(mha, keep_factors=True)
    for _ in range(2):
        tp.simulate(x, heads, t1=0.2, dt=0.1, direction="ascent").final.sum().backward()
    for _ in range(2):
        heads = tp.Heads.from_multihead_attention(mha)
        tp.simulate(x, heads, t1=0.2, dt=0.1, direction="ascent").final.sum().backward()
    assert mha.in_proj_weight.grad is not None and bool(torch.isfinite(mha.in_proj_weight.grad).all())


def test_gradients_against_finite_differences_float64():
    torch.manual_seed(4)
    m = tp.nn.MeanFieldAttention(3, 1, layers=2, t1=0.6, steps=2, feedforward=2, layer_norm="post", dtype=F64)
    x = _tokens(2, 3, 3, seed=5)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]

    def f(*ps):
        out = torch.func.functional_call(m, dict(zip(names, ps)), (x,), {"kinetic": True})
        return out[0][..., 0].sum() + out[1].sum()

    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_adjoint_gradients_equal_backpropagation():
    torch.manual_seed(5)
    kw = dict(layers=2, t1=1.0, steps=2, method="adaptive", rtol=1e-9, atol=1e-11, dtype=F64)
    back = tp.nn.MeanFieldAttention(4, 2, **kw)
    adj = tp.nn.MeanFieldAttention(4, 2, adjoint=True, **kw)
    adj.load_state_dict(back.state_dict())
    x = _tokens(2, 5, 4, seed=6)
    w = torch.randn(4, dtype=F64, generator=gen(7))
    grads = []
    for m in (back, adj):
        (m(x) @ w).square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for gb, ga in zip(*grads):
        # both solve to rtol 1e-9; the adjoint's backward ODE carries its own tolerance error
        assert_close(ga, gb, rtol=1e-6, atol=1e-8)
    # and the adaptive solve agrees with fine Euler steps (first order): the same flow
    euler = tp.nn.MeanFieldAttention(4, 2, layers=2, t1=1.0, steps=400, dtype=F64)
    euler.load_state_dict(back.state_dict())
    with torch.no_grad():
        assert_close(euler(x), back(x), rtol=0.0, atol=5e-3)


def test_kinetic_term_is_the_slope_integral_of_the_recorded_states():
    """∫𝒢² dt from the solver's ledger = Σ_k dt 𝒢²(x_k) by the left rule over the Euler grid, with 𝒢²
    recomputed from the recorded tokens by an independent dense implementation."""
    torch.manual_seed(6)
    m = tp.nn.MeanFieldAttention(4, 2, layers=2, t1=1.0, steps=3, dtype=F64)
    x = _tokens(2, 5, 4, seed=8)
    _, kin = m(x, kinetic=True)
    tr = m.trajectory(x)
    assert_close(tr["kinetic"], kin, rtol=1e-12, atol=1e-14)
    dt = m.t1 / (m.layers * m.steps)
    times = tr["times"]
    total, action = torch.zeros(2, dtype=F64), torch.zeros(2, dtype=F64)
    n = x.shape[-2]
    omega, w = torch.ones(2, dtype=F64), torch.full((n,), 1 / n, dtype=F64)
    for k in range(len(times) - 1):
        layer = min(int(times[k] / (m.t1 / m.layers) + 1e-9), m.layers - 1)
        A = (m.query[layer].transpose(-1, -2) @ m.key[layer]).detach()
        V = (m.output[layer] @ m.value[layer]).detach()
        xs = tr["x"][k].detach()
        total = total + dt * torch.stack([naive_slope(xs[b], A, omega, m.beta, w, V=V) for b in range(2)])
        # the projected Euler step moves token i by |x_{k+1} − x_k|² = 2 − 2/√(1 + Δt²|v|²) exactly
        v2 = torch.stack([naive_field(xs[b], A, omega, m.beta, w, V=V)[0] for b in range(2)]).square().sum(-1)
        action = action + ((2 - 2 / torch.sqrt(1 + dt ** 2 * v2)) * w).sum(-1) / dt
    assert_close(kin.detach(), total, rtol=1e-10, atol=1e-12)
    _, disp = m(x, kinetic="displacement")
    assert_close(disp.detach(), action, rtol=1e-9, atol=1e-12)
    assert_close(tr["displacement"].detach(), action, rtol=1e-9, atol=1e-12)
    assert_close(dt * tr["slope"][:-1].sum(0), kin, rtol=1e-12, atol=1e-14)  # the recorded 𝒢², left rule
    assert bool((kin > 0).all())


def test_displacement_action_converges_to_the_kinetic_energy():
    """Σ_k Σ_i w_i |x_{k+1} − x_k|²/Δt → ∫∫|v|² dμ dt at order 1 in Δt (the Euler path converges at order 1)."""
    torch.manual_seed(8)
    ref = tp.nn.MeanFieldAttention(4, 2, layers=1, t1=1.0, steps=1, dtype=F64)
    x = _tokens(2, 6, 4, seed=10)
    errs, fine = [], None
    for steps in (512, 8, 16, 32):
        m = tp.nn.MeanFieldAttention(4, 2, layers=1, t1=1.0, steps=steps, dtype=F64)
        m.load_state_dict(ref.state_dict())
        with torch.no_grad():
            a = m(x, kinetic="displacement")[1]
        if fine is None:
            fine = a
        else:
            errs.append(float((a - fine).abs().max()))
    orders = [math.log2(errs[i] / errs[i + 1]) for i in range(2)]
    assert all(0.7 < o < 1.4 for o in orders), (errs, orders)


def test_trajectory_records_the_depth_and_the_energy_ledger():
    torch.manual_seed(7)
    m = tp.nn.MeanFieldAttention(4, 2, layers=2, t1=1.0, steps=4, feedforward=3, dtype=F64)
    x = _tokens(3, 5, 4, seed=9)
    with torch.no_grad():
        tr = m.trajectory(x)
        y = m(x)
    assert tr["x"].shape == (2 * (4 + 1), 3, 5, 4)  # two pieces of 4 steps, each boundary recorded twice
    assert tr["energy"].shape == tr["slope"].shape == (10, 3)
    assert_close(tr["times"][[0, 4, 5, 9]], torch.tensor([0.0, 0.5, 0.5, 1.0], dtype=F64))
    # the last record is before the last feed-forward step: applying it gives the forward's output
    assert_close(m._feedforward(tr["x"][-1], 1), y, rtol=1e-12, atol=1e-12)


def test_refusals_before_any_work():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        tp.nn.MeanFieldAttention(5, 2)
    with pytest.raises(ValueError, match="method=.adaptive."):
        tp.nn.MeanFieldAttention(4, 2, adjoint=True)
    with pytest.raises(ValueError, match="method='euler'"):
        tp.nn.MeanFieldAttention(4, 2, method="rk4", layer_norm="post")
    with pytest.raises(ValueError, match="layer_norm"):
        tp.nn.MeanFieldAttention(4, 2, layer_norm="sphere")
    with pytest.raises(ValueError, match="pre"):
        tp.nn.MeanFieldAttention(4, 2, layer_norm="pre", feedforward=3)
    with pytest.raises(TypeError, match="layers"):
        tp.nn.MeanFieldAttention(4, 2, layers=2.0)
    m = tp.nn.MeanFieldAttention(4, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"\(\.\.\., n, 4\)"):
        m(_tokens(2, 3, 5))
    with pytest.raises(ValueError, match="module.to"):
        m(_tokens(2, 3, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="sphere"):
        m(2 * _tokens(2, 3, 4))
    with pytest.raises(ValueError, match="displacement"):
        m(_tokens(2, 3, 4), kinetic="kinetic")
    with pytest.raises(ValueError, match="method='adaptive'"):
        tp.nn.MeanFieldAttention(4, 2, method="adaptive", dtype=F64)(_tokens(2, 3, 4), kinetic="displacement")


def test_integer_tokens_are_refused_with_the_fix():
    """Integer tokens cannot lie on the sphere: a TypeError naming the dtype and the conversion, before any work."""
    m = tp.nn.MeanFieldAttention(4, 2, dtype=F64)
    for dtype in (torch.int64, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=f"floating-point.*{str(dtype).split('.')[-1]}.*convert"):
            m(torch.ones(2, 3, 4, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_adaptive_tolerance_below_round_off_is_refused(dtype):
    """rtol under the dtype's round-off eps/2: a ValueError naming rtol and eps before any step (the solve would
    shrink its steps towards underflow); at eps/2 itself the forward runs."""
    eps = torch.finfo(dtype).eps
    m = tp.nn.MeanFieldAttention(4, 2, method="adaptive", rtol=eps / 4, dtype=dtype)
    with pytest.raises(ValueError, match=f"rtol = {eps / 4:g} .*eps = {eps:g}"):
        m(_tokens(2, 3, 4, dtype=dtype))
    x0, heads = _tokens(2, 3, 4, dtype=dtype), tp.Heads.scalar([1.0], 4).to(dtype)
    for adjoint in (False, True):
        with pytest.raises(ValueError, match=f"rtol = {eps / 4:g} .*{dtype}"):
            tp.simulate(x0, heads, t1=0.2, dt=0.1, method="adaptive", rtol=eps / 4, adjoint=adjoint)
    traj = tp.simulate(x0, heads, t1=0.1, dt=0.1, method="adaptive", rtol=max(eps / 2, 1e-9), atol=1e-9)
    assert torch.isfinite(traj.x).all()


def test_converters_keep_their_names_under_tp_nn():
    mha = torch.nn.MultiheadAttention(4, 2, bias=False, dtype=F64)
    # one spelling of the conversion of a MultiheadAttention: tp.Heads.from_multihead_attention
    assert not hasattr(tp.nn, "heads_from_multihead_attention") and not hasattr(tp, "heads_from_multihead_attention")
    assert tp.nn.layerwise_from_transformer is tp.layerwise_from_transformer
    assert tp.MeanFieldAttention is tp.nn.MeanFieldAttention
    x = _tokens(1, 4, 4)[0]
    assert_close(tp.nn.attention_matrix(x, tp.Heads.from_multihead_attention(mha)).sum(-1),
                 torch.ones(2, 4, dtype=F64))


def test_transformer_flow_trains_a_torch_encoder_over_many_steps():
    """The wrapped encoder's heads are read again in every forward: a loop of optimizer steps works, the
    forward is tp.simulate on tp.layerwise_from_transformer of the current weights, gradients reach them."""
    torch.manual_seed(9)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True, dtype=F64)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    flow = tp.nn.TransformerFlow(encoder, layer_time=0.5, steps=3, token_norm=2.0, bias="drop")
    x = _tokens(3, 5, 4, seed=11)
    opt = torch.optim.SGD(flow.parameters(), lr=0.5)
    for _ in range(3):
        y = flow(x)
        opt.zero_grad()
        y[..., 0].mean().backward()
        opt.step()
    assert encoder.layers[1].self_attn.in_proj_weight.grad.abs().sum() > 0
    with torch.no_grad():
        theta = tp.layerwise_from_transformer(encoder, layer_time=0.5, token_norm=2.0, bias="drop")
        ref = tp.simulate(x, theta, t1=1.0, dt=0.5 / 3, method="euler", direction="ascent", diagnostics=False).final
        assert_close(flow(x), ref, rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in flow.parameters()) == sum(p.numel() for p in encoder.parameters())
    with pytest.raises(TypeError, match="torch modules"):
        tp.nn.TransformerFlow([{"query": torch.ones(1, 2, 4), "key": torch.ones(1, 2, 4), "value": torch.eye(4)[None]}])


@pytest.mark.parametrize("beta", [-0.5, 0.0])
def test_repulsive_and_zero_beta_follow_the_residual_loop(beta):
    """β ≤ 0 (repulsive, or uniform attention at β = 0) is accepted: the forward is the same residual loop of
    attention layers as for β > 0, and the gradients are finite."""
    torch.manual_seed(1)
    m = tp.nn.MeanFieldAttention(4, 2, layers=2, t1=1.0, steps=2, beta=beta, dtype=F64)
    x = _tokens(2, 5, 4, dtype=F64)
    y = m(x)
    with torch.no_grad():  # β cannot be a token scale r² here: the torch layers' query weights carry β√k instead
        dt, d, k = m.t1 / (m.layers * m.steps), m.dim, m.head_dim
        z = x
        for layer in range(m.layers):
            mha = _mha_of_layer(m, layer)
            mha.in_proj_weight[:d] *= beta * math.sqrt(k)
            for _ in range(m.steps):
                out = mha(z.transpose(0, 1), z.transpose(0, 1), z.transpose(0, 1), need_weights=False)[0].transpose(0, 1)
                w = z + dt * (out - (out * z).sum(-1, keepdim=True) * z)
                z = w / w.norm(dim=-1, keepdim=True)
        assert_close(y.detach(), z, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.requires_grad)
