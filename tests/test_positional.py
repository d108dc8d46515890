"""Positional attention (``causal=`` an ALiBi, KineticDecay or PositionKernel object).

The oracle below forms the full (..., H, n, n) score and bias tensors, masks them above the diagonal and
normalises with torch.logsumexp — loop-free, sharing no code with transformer_pde.model.positional; the
paper's particle model is checked against a loop over the tokens written from its definition.
"""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.model.field import evaluate
from transformer_pde.model.positional_kernel import positional_statistics
from conftest import gen
from problems import interrupt_and_resume, random_sphere, tolerances

F64 = torch.float64
_tol = tolerances(f64=(1e-11, 1e-11), f32=(5e-5, 5e-5))
CAUSAL_NORMS = ["softmax", "unnormalized", "relu", "hardmax"]


def _weights(*shape, seed=1):
    w = torch.rand(*shape, generator=gen(seed), dtype=F64) + 0.1
    return w / w.sum(-1, keepdim=True)


def _heads(H=3, d=3, seed=2):
    A = torch.randn(H, d, d, generator=gen(seed), dtype=F64) / 2
    V = torch.randn(H, d, d, generator=gen(seed + 1), dtype=F64) / 2
    return tp.Heads(A, V, beta=1.3)


def oracle(x, heads, bias_block, weights=None, *, strict=False, prefix="mean"):
    """Float64 (log m, ȳ, log Π, unnormalised field Σ_h ω_h f_h) of the positional prefix measures.

    bias_block: (H|1, n, n) log positional weights b_h(i, j) for every pair (the mask is applied here)."""
    x = x.double()
    A, V = heads.score_matrix.double(), heads.value_matrix.double()
    n = x.shape[-2]
    S = heads.beta * torch.einsum("...ia,hab,...jb->...hij", x, A, x)
    w = torch.full((n,), 1.0 / n, dtype=F64) if weights is None else weights.double()
    masked = torch.ones(n, n, dtype=torch.bool).triu(0 if strict else 1)
    LW = (bias_block.double() + torch.log(w).unsqueeze(-2).unsqueeze(-3)).masked_fill(masked, float("-inf"))
    LP = torch.logsumexp(LW, -1)
    T = S + LW
    lse = torch.logsumexp(T, -1)
    P = torch.exp(T - lse.unsqueeze(-1)).nan_to_num(0.0)
    mean = P @ x.unsqueeze(-3)
    logm = lse - LP
    mass = torch.exp(lse if prefix == "sum" else logm)  # Σ_j (π_ij or w_j e^{b_ij}) e^{s_ij}
    mass = torch.where(torch.isneginf(LP), torch.zeros_like(mass), mass)  # an empty prefix: no mass
    f = mass.unsqueeze(-1) * (mean @ V.transpose(-1, -2))
    field = (heads.weights.double().unsqueeze(-1).unsqueeze(-1) * f).sum(-3)
    return logm, mean, LP, field


def _alibi_block(slopes, pos):
    return -torch.as_tensor(slopes, dtype=F64).reshape(-1, 1, 1) * (pos.unsqueeze(-1) - pos.unsqueeze(-2))


# --------------------------------------------------------------------------- the two identities
@pytest.mark.parametrize("norm", CAUSAL_NORMS)
@pytest.mark.parametrize("mode", ["mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_zero_bias_is_plain_causal_attention(norm, mode, weighted, dtype):
    """λ = 0 (and slope 0): every causal normalisation equals causal=True / "sum", both dtypes, token weights."""
    x = random_sphere(2, 11, 3, dtype=dtype, seed=4)
    heads = _heads().to(dtype)
    w = _weights(2, 11).to(dtype) if weighted else None
    want = tp.velocity(x, heads, w, normalization=norm, causal=mode)
    for bias in (tp.KineticDecay(0.0, prefix=mode), tp.ALiBi(0.0, prefix=mode), tp.ALiBi([0.0, 0.0, 0.0], prefix=mode)):
        got = tp.velocity(x, heads, w, normalization=norm, causal=bias)
        assert got.dtype == dtype
        assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("norm", ["softmax", "unnormalized", "relu"])
def test_a_bias_constant_in_the_key_position_leaves_attention_unchanged(norm, dtype):
    """b(p_i, p_j) = g(p_i) (any function of the query alone, here with per-head values) cancels in the
    normalised prefix measure: softmax, and the prefix mean of the un-normalised kernels, are unchanged; under
    prefix="sum" a constant bias c multiplies the un-normalised field by e^c (the bias is applied)."""
    x = random_sphere(13, 3, dtype=dtype, seed=5)
    heads = _heads().to(dtype)
    want = tp.velocity(x, heads, normalization=norm, causal=True)
    row_only = tp.PositionKernel(lambda p, q: torch.exp(torch.sin(3.0 * p) + 2.0) + 0 * q)
    per_head = tp.PositionKernel(lambda p, q: (torch.tensor([0.5, -4.0, 7.0], dtype=p.dtype).reshape(3, 1, 1)
                                               * p + 0 * q).expand(3, *torch.broadcast_shapes(p.shape, q.shape)),
                                 log=True, per_head=True)
    for bias in (row_only, per_head, tp.PositionKernel(lambda p, q: torch.full_like(q, 5.0))):
        assert_close(tp.velocity(x, heads, normalization=norm, causal=bias), want, **_tol(dtype))
    if norm != "softmax":
        c = 0.7
        scaled = tp.velocity(x, heads, normalization=norm, causal=tp.PositionKernel(
            lambda p, q: torch.full_like(q, c), log=True, prefix="sum"))
        assert_close(scaled, math.exp(c) * tp.velocity(x, heads, normalization=norm, causal="sum"), **_tol(dtype))


# --------------------------------------------------------------------------- against the dense oracle
def _cases(n, dtype):
    pos = torch.cumsum(torch.rand(n, generator=gen(9), dtype=F64) + 0.2, 0)  # given, increasing positions
    idx = torch.arange(n, dtype=F64)
    slopes = [0.05, 0.4, 1.5]
    yield tp.ALiBi(slopes), _alibi_block(slopes, idx), False
    yield tp.ALiBi(0.3, positions=pos.to(dtype), strict=True), _alibi_block([0.3], pos), True
    yield tp.KineticDecay(2.5, strict=True), _alibi_block([2.5 / n], idx), True
    yield tp.KineticDecay(torch.tensor([0.0, 1.0, 4.0], dtype=dtype)), _alibi_block([0.0, 1.0 / n, 4.0 / n], idx), False
    power = lambda p, q: (1.0 + p - q) ** -1.5  # noqa: E731
    yield tp.PositionKernel(power), torch.log(power(idx.unsqueeze(-1), idx.unsqueeze(-2)).clamp_min(0)).unsqueeze(0), \
        False
    yield tp.PositionKernel(power, prefix="sum", strict=True), \
        torch.log(power(idx.unsqueeze(-1), idx.unsqueeze(-2)).clamp_min(0)).unsqueeze(0), True


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [None, 150])
@pytest.mark.parametrize("grad", [False, True])
def test_statistics_and_field_against_the_dense_oracle(weighted, chunk, grad, dtype):
    """Per-head slopes, given positions, the kinetic decay, a power-law kernel, strict prefixes, prefix sums,
    token weights, a batch axis; one block or many (chunk_elements); the no-grad kernels (the flash path of
    separable biases, the bias blocks of the others) and the checkpointed autograd blocks."""
    n = 17
    x = random_sphere(2, n, 3, dtype=dtype, seed=6)
    heads = _heads().to(dtype)
    w = _weights(2, n).to(dtype) if weighted else None
    for bias, block, strict in _cases(n, dtype):
        logm, mean, LP, field = oracle(x, heads, block, w, strict=strict, prefix=bias.prefix)
        xin = x.clone().requires_grad_(grad)
        ps = positional_statistics(xin, heads, w, bias, chunk_elements=chunk)
        first = 1 if strict else 0
        assert_close(ps.stats.log_partition[..., first:].detach(), logm[..., first:].to(dtype), **_tol(dtype))
        assert_close(ps.stats.mean.detach(), mean.to(dtype), **_tol(dtype))
        assert_close(ps.log_prefix.detach().expand_as(LP)[..., first:], LP[..., first:].to(dtype), **_tol(dtype))
        if strict:  # the first token has an empty prefix: no mass, zero mean
            assert bool(torch.isneginf(ps.stats.log_partition[..., 0]).all())
            assert float(ps.stats.mean[..., 0, :].detach().abs().max()) == 0.0
        V = evaluate(xin, heads, w, normalization="unnormalized", causal=bias, diagnostics=False,
                     chunk_elements=chunk).ambient
        assert_close(V.detach(), field.to(dtype), **_tol(dtype))


def test_second_moment_and_relu_against_the_oracle():
    """The second moment Σ_j p_ij ⟨x_i, x_j⟩² and the ReLU moments Σ_j π_ij ReLU(s_ij) [1, x_j] (float64)."""
    n = 12
    x = random_sphere(n, 3, seed=7)
    heads = _heads()
    slopes = [0.1, 0.7, 2.0]
    bias = tp.ALiBi(slopes, strict=True)
    block = _alibi_block(slopes, torch.arange(n, dtype=F64))
    masked = torch.ones(n, n, dtype=torch.bool).triu(0)
    S = heads.beta * torch.einsum("ia,hab,jb->hij", x, heads.score_matrix, x)
    LW = (block - math.log(n)).masked_fill(masked, float("-inf"))
    P = torch.softmax(S + LW, -1).nan_to_num(0.0)
    pi = torch.softmax(LW, -1).nan_to_num(0.0)
    q = (P * (x @ x.T).square()).sum(-1)
    kern = tp.PositionKernel(lambda p, q: torch.exp(-torch.tensor(slopes, dtype=p.dtype).reshape(3, 1, 1) * (p - q)),
                             per_head=True, strict=True)  # the same weights, not separable: the bias-block path
    for chunk in (None, 40):
        for b in (bias, kern):
            ps = positional_statistics(x, heads, None, b, second_moment=True, chunk_elements=chunk)
            assert_close(ps.stats.second[..., 1:], q[..., 1:], rtol=1e-12, atol=1e-12)
        relu = positional_statistics(x, heads, None, bias, kind="relu", chunk_elements=chunk).relu
        R = torch.relu(S) * pi
        assert_close(relu[0], R.sum(-1), rtol=1e-12, atol=1e-12)
        assert_close(relu[1], R @ x, rtol=1e-12, atol=1e-12)


def test_extreme_positional_weights_leave_the_shortcuts_for_the_shifted_blocks():
    """Positions that jump by 800 at a block start (ALiBi slopes 1–2: key weights spanning e^800, beyond
    log(eps/tiny) ≈ 672 in float64): the separable blocks' shift-free path must fall back to the row-max shift,
    or the first row after the jump loses every key of its prefix to underflow.  Blocks of 3 rows, strict
    prefixes, the second moment (so that the block path runs, not the flash kernel), against the oracle."""
    n = 12
    x = random_sphere(n, 3, seed=32)
    heads = _heads()
    pos = torch.where(torch.arange(n) < 7, 0.0, 800.0).double() + torch.arange(n, dtype=F64)
    slopes = [1.0, 1.5, 2.0]
    bias = tp.ALiBi(slopes, positions=pos, strict=True)
    logm, mean, LP, _ = oracle(x, heads, _alibi_block(slopes, pos), None, strict=True)
    ps = positional_statistics(x, heads, None, bias, second_moment=True, chunk_elements=3 * 3 * n)
    assert bool(torch.isfinite(ps.stats.log_partition[..., 1:]).all())
    assert_close(ps.stats.mean, mean, rtol=1e-10, atol=1e-10)
    assert_close(ps.stats.log_partition[..., 1:], logm[..., 1:], rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- the paper's particle model
def _paper_force(theta, beta, lam):
    """dθ_j/dt = Σ_{k<j} π_jk (−β sin(θ_j − θ_k) e^{β cos(θ_j − θ_k)}), π_jk ∝ e^{−(λ/n)(j − k)} over k < j."""
    n = theta.shape[-1]
    out = torch.zeros_like(theta)
    for j in range(1, n):
        k = torch.arange(j, dtype=theta.dtype)
        c = torch.exp(-(lam / n) * (j - k))
        diff = theta[..., j:j + 1] - theta[..., :j]
        out[..., j] = ((c / c.sum()) * (-beta * torch.sin(diff) * torch.exp(beta * torch.cos(diff)))).sum(-1)
    return out


def paper_model(beta, lam, dtype=F64):
    """The library's form of the paper's model: unnormalised kernel e^{β⟨x, y⟩}, value β·I, ascent, the
    kinetic decay normalised over the strict prefix."""
    I = torch.eye(2, dtype=dtype).unsqueeze(0)
    return tp.Heads(I, beta * I, beta=beta), tp.KineticDecay(lam, strict=True)


@pytest.mark.parametrize("beta,lam", [(1.0, 1.0), (3.0, 0.0), (0.4, 5.0)])
def test_the_papers_particle_field_is_expressible(beta, lam):
    n = 19
    theta = torch.rand(3, n, generator=gen(11), dtype=F64) * 2 * math.pi
    x = torch.stack([theta.cos(), theta.sin()], -1)
    heads, bias = paper_model(beta, lam)
    v = tp.velocity(x, heads, normalization="unnormalized", direction="ascent", causal=bias)
    tangent = torch.stack([-theta.sin(), theta.cos()], -1)
    assert_close((v * tangent).sum(-1), _paper_force(theta, beta, lam), rtol=1e-12, atol=1e-12)
    assert float((v * x).sum(-1).abs().max()) < 1e-13  # tangent to the circle
    assert float(v[..., 0, :].abs().max()) == 0.0  # the first token attends to nothing


def test_a_solve_of_the_papers_model_matches_their_rk4_in_angles():
    """tp.solve(Model(causal=KineticDecay(λ, strict=True)), RK4) on the circle against RK4 in the angles
    with the paper's force: the two schemes differ by the retraction only, O(dt^5) per step."""
    n, beta, lam, dt, steps = 24, 1.0, 1.0, 0.05, 20
    theta0 = torch.rand(n, generator=gen(12), dtype=F64) * 2 * math.pi
    th = theta0.clone()
    for _ in range(steps):
        k1 = _paper_force(th, beta, lam)
        k2 = _paper_force(th + 0.5 * dt * k1, beta, lam)
        k3 = _paper_force(th + 0.5 * dt * k2, beta, lam)
        k4 = _paper_force(th + dt * k3, beta, lam)
        th = th + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    heads, bias = paper_model(beta, lam)
    x0 = torch.stack([theta0.cos(), theta0.sin()], -1)
    traj = tp.solve(tp.Model(heads, normalization="unnormalized", direction="ascent", causal=bias), x0, tp.RK4(),
                    t1=dt * steps, dt=dt)
    xT = traj.x[-1]
    angle = torch.atan2(xT[..., 1], xT[..., 0])
    err = torch.remainder(angle - th + math.pi, 2 * math.pi) - math.pi
    assert float(err.abs().max()) < 1e-6


# --------------------------------------------------------------------------- gradients and memory
def test_gradcheck_through_the_bias_and_the_tokens():
    n = 7
    x = random_sphere(n, 3, seed=13).requires_grad_(True)
    heads = _heads()
    slopes = torch.tensor([0.2, 0.9, 1.7], dtype=F64, requires_grad=True)
    lam = torch.tensor(1.3, dtype=F64, requires_grad=True)
    scale = torch.tensor(0.8, dtype=F64, requires_grad=True)
    w = _weights(n).requires_grad_(True)

    def field(x, s, lam, scale, w):
        out = []
        for bias in (tp.ALiBi(s, strict=True), tp.KineticDecay(lam),
                     tp.PositionKernel(lambda p, q: torch.exp(-scale * (p - q) ** 2))):
            for norm in ("softmax", "unnormalized", "relu"):
                out.append(evaluate(x, heads, w, normalization=norm, causal=bias, diagnostics=False,
                                    chunk_elements=30).velocity)
        # three random projections of each field: few outputs, so few backward passes
        return torch.einsum("knd,rnd->kr", torch.stack(out), R)

    R = torch.randn(3, n, 3, generator=gen(22), dtype=F64)
    assert torch.autograd.gradcheck(field, (x, slopes, lam, scale, w), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("strict", [False, True])
def test_gradcheck_of_the_closed_form_backward(strict):
    """Gradients to the tokens and the heads only (the bias and the weights constant): the backward pass is the
    closed form of the softmax statistics' derivative, block by block; checked by finite differences and
    against the recomputed-graph backward (the one taken when the slopes require grad)."""
    n = 9
    x = random_sphere(n, 3, seed=23).requires_grad_(True)
    A = (torch.randn(2, 3, 3, generator=gen(24), dtype=F64) / 2).requires_grad_(True)
    V = (torch.randn(2, 3, 3, generator=gen(25), dtype=F64) / 2).requires_grad_(True)
    w = _weights(n)
    R = torch.randn(n, 3, generator=gen(26), dtype=F64)

    def field(x, A, V, slopes=torch.tensor([0.3, 1.1], dtype=F64)):
        heads = tp.Heads(A, V, beta=1.2)
        out = 0
        for bias in (tp.ALiBi(slopes, strict=strict), tp.PositionKernel(_power_kernel, strict=strict)):
            for norm in ("softmax", "unnormalized"):
                out = out + (evaluate(x, heads, w, normalization=norm, causal=bias, diagnostics=False,
                                      chunk_elements=40).velocity * R).sum()
        return out

    assert torch.autograd.gradcheck(field, (x, A, V), eps=1e-6, atol=1e-8, rtol=1e-6)
    closed = torch.autograd.grad(field(x, A, V), (x, A, V))
    generic = torch.autograd.grad(field(x, A, V, torch.tensor([0.3, 1.1], dtype=F64, requires_grad=True)), (x, A, V))
    for a, b in zip(closed, generic):
        assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradients_to_one_factor_and_batched_weights():
    """Only the query factor requires grad (the tokens do not): the closed-form backward gives the query features'
    gradient alone; token weights with a batch axis the tokens lack.  Against the recomputed-graph backward."""
    n, d, k = 8, 3, 2
    x = random_sphere(n, d, seed=27)
    Q = torch.randn(2, k, d, generator=gen(28), dtype=F64).requires_grad_(True)
    K = torch.randn(2, k, d, generator=gen(29), dtype=F64)
    w = _weights(3, n)  # (3, n): three weightings of one sequence
    R = torch.randn(3, n, d, generator=gen(30), dtype=F64)

    def loss(slopes):
        heads = tp.Heads(query=Q, key=K, value=torch.eye(d, dtype=F64).expand(2, d, d))
        v = evaluate(x, heads, w, normalization="unnormalized", causal=tp.ALiBi(slopes, strict=True),
                     diagnostics=False, chunk_elements=20).velocity
        return (v * R).sum()

    closed, = torch.autograd.grad(loss(torch.tensor([0.2, 0.7], dtype=F64)), Q)
    generic, = torch.autograd.grad(loss(torch.tensor([0.2, 0.7], dtype=F64, requires_grad=True)), Q)
    assert_close(closed, generic, rtol=1e-12, atol=1e-12)
    assert float(closed.abs().max()) > 0


def test_the_kinetic_decay_with_a_given_length_is_alibi():
    """KineticDecay(λ, length=L) is ALiBi with the slope λ/L, whatever n is; with length None, L = n (the flash
    path of separable biases for softmax and unnormalized, the bias blocks for relu)."""
    x = random_sphere(2, 9, 3, seed=31)
    heads = _heads()
    for norm in ("softmax", "unnormalized", "relu"):
        a = tp.velocity(x, heads, normalization=norm, causal=tp.KineticDecay(3.0, length=4.0))
        b = tp.velocity(x, heads, normalization=norm, causal=tp.ALiBi(0.75))
        assert_close(a, b, rtol=1e-13, atol=1e-13)
        c = tp.velocity(x, heads, normalization=norm, causal=tp.KineticDecay(3.0))
        assert_close(c, tp.velocity(x, heads, normalization=norm, causal=tp.ALiBi(3.0 / 9)), rtol=1e-13, atol=1e-13)


def _saved_bytes(n):
    """Bytes autograd saves (outside the checkpointed blocks) for the gradient of one positional field."""
    x = random_sphere(n, 2, seed=14).requires_grad_(True)
    heads, bias = paper_model(1.0, 1.0)
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        v = tp.velocity(x, heads, normalization="unnormalized", causal=bias)
    v.sum().backward()
    return total[0], x.grad


def test_autograd_memory_grows_linearly_in_n():
    """Under autograd the blocks are checkpointed: what is kept for the backward pass grows like n, not n²
    (without the checkpoints the score blocks alone are n²/2 entries: 16 MiB at n = 1024)."""
    small, _ = _saved_bytes(256)
    large, grad = _saved_bytes(1024)
    assert large < 6 * small  # quadratic storage would give 16x
    assert large < 1024 * 1024 * 8 / 4
    assert bool(torch.isfinite(grad).all())


# --------------------------------------------------------------------------- solvers take it
@pytest.mark.parametrize("solver", [tp.Euler(), tp.Heun(), tp.RK4(), tp.Dopri5(rtol=1e-7, atol=1e-9)])
def test_every_particle_solver_takes_a_positional_bias(solver):
    """tp.solve with each particle solver: a zero slope equals causal=True; a positive slope differs."""
    x0 = random_sphere(2, 9, 3, seed=15)
    heads = _heads()
    runs = {}
    for key, causal in (("plain", True), ("zero", tp.ALiBi(0.0)), ("alibi", tp.ALiBi.geometric(3))):
        traj = tp.solve(tp.Model(heads, normalization="softmax", direction="ascent", causal=causal), x0, solver,
                        t1=0.5, dt=0.05)
        runs[key] = traj.x[-1]
    assert_close(runs["zero"], runs["plain"], rtol=1e-9, atol=1e-9)
    assert float((runs["alibi"] - runs["plain"]).abs().max()) > 1e-3


def test_simulate_and_the_ledger_with_a_positional_bias():
    """tp.simulate(causal=bias) with ledger=True: E and 𝒟 of the whole measure, no gradient-flow residual;
    the energy equals tp.energy of the recorded states (the ledger's pass is the whole measure's)."""
    x0 = random_sphere(10, 3, seed=16)
    heads = tp.Heads.symmetric(_heads().score_matrix + _heads().score_matrix.transpose(-1, -2))
    traj = tp.simulate(x0, heads, t1=0.3, dt=0.05, causal=tp.KineticDecay(2.0), ledger=True, direction="ascent")
    assert "residual" not in traj.ledger and not traj.stats["gradient_flow"]
    assert_close(traj.energy, tp.energy(traj.x, heads), rtol=1e-10, atol=1e-12)
    # dE = ∫𝒟 (constant weights: no ∂_tE, no martingale) to the order of the left-point rule
    gap = float((traj.ledger["dE"][-1] - traj.ledger["dissipation"][-1]).abs())
    assert gap < 0.05 * float(traj.ledger["dE"][-1].abs()) + 1e-6


def test_checkpoint_resume_with_a_positional_bias(tmp_path):
    """The checkpoint's fingerprint reads the bias's repr: stable (no memory address), so a run resumes."""
    x0 = random_sphere(8, 3, seed=17)
    heads = _heads()
    bias = tp.ALiBi(torch.tensor([0.1, 0.2, 0.3], dtype=F64), strict=True)
    assert "0x" not in repr(bias) and "sha1=" in repr(bias)
    assert repr(bias) == repr(tp.ALiBi(torch.tensor([0.1, 0.2, 0.3], dtype=F64), strict=True))
    kern = tp.PositionKernel(_power_kernel)
    assert "0x" not in repr(kern) and "_power_kernel" in repr(kern)
    kw = dict(t1=1.0, dt=0.05, direction="ascent", causal=bias)
    full = tp.simulate(x0, heads, **kw)
    resumed = interrupt_and_resume(x0, heads, tmp_path / "ck.pt", stop_at=12, **kw)
    assert_close(resumed.x, full.x, rtol=1e-12, atol=1e-12)


def _power_kernel(p, q):
    return (1.0 + p - q) ** -1.0


def test_solvers_without_a_causal_version_refuse_it():
    x0 = random_sphere(6, 3, seed=18)
    heads = tp.Heads.symmetric(torch.eye(3, dtype=F64).expand(2, 3, 3))
    with pytest.raises(ValueError, match="non-causal"):
        tp.solve(tp.Model(heads, causal=tp.ALiBi(0.5)), x0, tp.LagrangianJKO(), t1=0.1, dt=0.05)
    with pytest.raises(ValueError, match="causal"):
        tp.solve(tp.Model(heads, causal=tp.ALiBi(0.5)), x0, tp.ShardedEuler(), t1=0.1, dt=0.05)
    with pytest.raises(ValueError, match="causal"):
        tp.Model(heads, normalization="effective", causal=tp.KineticDecay(1.0))
    with pytest.raises(ValueError, match="keys"):
        evaluate(x0, heads, causal=tp.ALiBi(0.1), keys=x0)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("make,err,text", [
    (lambda: tp.ALiBi("steep"), TypeError, "slopes"),
    (lambda: tp.ALiBi(float("nan")), ValueError, "finite"),
    (lambda: tp.ALiBi(torch.ones(2, 2)), ValueError, "1-D"),
    (lambda: tp.ALiBi([0.1, float("inf")]), ValueError, "finite"),
    (lambda: tp.ALiBi(0.1, strict="yes"), TypeError, "strict"),
    (lambda: tp.ALiBi(0.1, prefix="max"), ValueError, "prefix"),
    (lambda: tp.ALiBi(0.1, positions=[0, 1, 2]), TypeError, "positions"),
    (lambda: tp.ALiBi(0.1, positions=torch.tensor([0.0, float("nan")])), ValueError, "finite"),
    (lambda: tp.KineticDecay(-1.0), ValueError, ">= 0"),
    (lambda: tp.KineticDecay(1.0, length=0), ValueError, "length"),
    (lambda: tp.PositionKernel(3.0), TypeError, "callable"),
    (lambda: tp.PositionKernel(_power_kernel, log="no"), TypeError, "log"),
    (lambda: tp.PositionalBias(), TypeError, "abstract"),
    (lambda: tp.ALiBi.geometric(0), ValueError, "num_heads"),
])
def test_bad_biases_are_refused_when_built(make, err, text):
    with pytest.raises(err, match=text):
        make()


def test_biases_that_do_not_fit_the_tokens_are_refused_before_any_work():
    x = random_sphere(5, 3, seed=19)
    heads = _heads()  # H = 3
    cases = [
        (tp.ALiBi([0.1, 0.2]), ValueError, "per-head"),
        (tp.ALiBi(0.1, positions=torch.arange(4.0)), ValueError, "positions for 4 tokens"),
        (tp.PositionKernel(lambda p, q: -(p - q) - 1.0), ValueError, "negative"),
        (tp.PositionKernel(lambda p, q: 1.0), TypeError, "tensor"),
        (tp.PositionKernel(lambda p, q: torch.ones(3)), ValueError, "shape"),
        (tp.PositionKernel(lambda p, q: (p - q) * float("nan")), ValueError, "NaN"),
        (tp.PositionKernel(lambda p, q: torch.full_like(p - q, float("inf")), log=True), ValueError, "inf"),
    ]
    for bias, err, text in cases:
        with pytest.raises(err, match=text):
            tp.velocity(x, heads, causal=bias)
    with pytest.raises(TypeError, match="positional bias"):
        tp.velocity(x, heads, causal=0.5)
    with pytest.raises(TypeError, match="causal"):
        tp.Model(heads, causal="alibi")


def test_the_first_token_of_a_strict_prefix_stays_put_and_one_token_is_allowed(dtype):
    x = random_sphere(1, 3, dtype=dtype, seed=20)
    heads = _heads().to(dtype)
    for norm in ("softmax", "unnormalized", "relu", "hardmax"):
        v = tp.velocity(x, heads, normalization=norm, causal=tp.ALiBi(0.3, strict=True))
        assert v.shape == (1, 3) and float(v.abs().max()) == 0.0
    xg = random_sphere(6, 3, dtype=dtype, seed=21).requires_grad_(True)
    v = tp.velocity(xg, heads, normalization="unnormalized", causal=tp.KineticDecay(1.0, strict=True))
    v.sum().backward()
    assert bool(torch.isfinite(xg.grad).all())
