"""Causal attention: token i attends to tokens j <= i (the prefix measure), every backend.

The oracle below forms the full (..., H, n, n) score tensor, masks it with -inf above the
diagonal and renormalises the token weights over the prefix with torch.logsumexp /
torch.softmax — loop-free, sharing no code with the kernels of transformer_pde.model.
"""

import json
import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model.field import evaluate
from conftest import gen
from problems import random_sphere, tolerances

BACKENDS = ["dense", "chunked", "sdpa"]


def _weights(*shape, dtype=torch.float64, seed=1):
    w = torch.rand(*shape, generator=gen(seed), dtype=torch.float64) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(dtype)


def causal_oracle(x, A, weights=None, beta=1.0):
    """Float64 reference (log m_h, ȳ_h, q_h, relu mass, relu first) of the prefix measures."""
    x = x.double()
    A = A.double()
    n = x.shape[-2]
    S = beta * torch.einsum("...ia,...hab,...jb->...hij", x, A, x)
    w = torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None else weights.double()
    W = torch.cumsum(w, -1)  # prefix masses W_i
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    L = (S + torch.log(w).unsqueeze(-2).unsqueeze(-2)).masked_fill(upper, float("-inf"))
    lse = torch.logsumexp(L, -1) - torch.log(W).unsqueeze(-2)
    P = torch.softmax(L, -1)
    mean = P @ x.unsqueeze(-3)
    second = (P * (x @ x.transpose(-1, -2)).square().unsqueeze(-3)).sum(-1)
    R = torch.relu(S).masked_fill(upper, 0.0) * w.unsqueeze(-2).unsqueeze(-2) / W.unsqueeze(-1).unsqueeze(-3)
    return lse, mean, second, R.sum(-1), R @ x.unsqueeze(-3)


_tol = tolerances(f64=(1e-11, 1e-11), f32=(3e-5, 3e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_backends_match_oracle(dtype, backend, weighted):
    # batch dims (2, 3), 4 heads, d = 3, n = 9; chunk_elements forces several blocks in "chunked"
    x = random_sphere(2, 3, 9, 3, dtype=dtype)
    heads = tp.Heads.random(4, 3, batch_shape=(3,), generator=gen(2), dtype=dtype, scale=0.7)
    w = _weights(2, 3, 9, dtype=dtype) if weighted else None
    ref = causal_oracle(x, heads.score, w)
    st = tp.softmax_statistics(x, heads, w, second_moment=True, backend=backend, causal=True, chunk_elements=40)
    tol = _tol(dtype)
    torch.testing.assert_close(st.log_partition.double(), ref[0], **tol)
    torch.testing.assert_close(st.mean.double(), ref[1], **tol)
    torch.testing.assert_close(st.second.double(), ref[2], **tol)
    mass, first = tp.relu_statistics(x, heads, w, backend=backend, causal=True, chunk_elements=40)
    torch.testing.assert_close(mass.double(), ref[3], **tol)
    torch.testing.assert_close(first.double(), ref[4], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_scores_use_the_shift(dtype, backend):
    # β‖A‖ ≈ 400: e^{s} overflows float32 and float64 without the log-sum-exp shift
    x = random_sphere(12, 3, dtype=dtype, seed=3)
    heads = tp.Heads.random(2, 3, generator=gen(4), dtype=dtype, beta=200.0)
    w = _weights(12, dtype=dtype)
    ref = causal_oracle(x, heads.score, w, beta=200.0)
    st = tp.softmax_statistics(x, heads, w, backend=backend, causal=True, chunk_elements=30)
    assert torch.isfinite(st.log_partition).all()
    scale = 1e3 if dtype == torch.float32 else 1e2  # |log m| ~ 400: relative rounding of the scores
    torch.testing.assert_close(st.log_partition.double(), ref[0], **_tol(dtype, scale))
    torch.testing.assert_close(st.mean.double(), ref[1], **_tol(dtype, scale))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_with_each_other_on_factored_heads(backend):
    # query/key factors (unshared keys per head) go through the other branch of the kernels
    dt = torch.float64
    Q = torch.randn(3, 2, 3, generator=gen(5), dtype=dt)
    K = torch.randn(3, 2, 3, generator=gen(6), dtype=dt)
    heads = tp.Heads(query=Q, key=K, value=torch.randn(3, 3, 3, generator=gen(7), dtype=dt))
    x = random_sphere(4, 11, 3, seed=8)
    ref = tp.softmax_statistics(x, heads, causal=True, backend="dense")
    st = tp.softmax_statistics(x, heads, causal=True, backend=backend, chunk_elements=25)
    torch.testing.assert_close(st.log_partition, ref.log_partition, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.mean, ref.mean, rtol=1e-12, atol=1e-12)
    # and the dense one against the oracle with A = QᵀK
    o = causal_oracle(x, Q.transpose(-1, -2) @ K)
    torch.testing.assert_close(ref.log_partition, o[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_and_first_token(backend):
    dt = torch.float64
    heads = tp.Heads.random(3, 4, symmetric=False, generator=gen(9), dtype=dt)
    # one token: the causal field is the non-causal one, V x_0 per head
    x1 = random_sphere(2, 1, 4, seed=10)
    st = tp.softmax_statistics(x1, heads, causal=True, backend=backend)
    torch.testing.assert_close(st.mean, x1.unsqueeze(-3).expand(2, 3, 1, 4))
    s00 = torch.einsum("bia,hac,bic->bhi", x1, heads.score, x1)
    torch.testing.assert_close(st.log_partition, s00)
    # n tokens: the first one attends only to itself, its softmax output is V_h x_0 exactly
    x = random_sphere(7, 4, seed=11)
    out = tp.head_outputs(x, heads, causal=True)
    torch.testing.assert_close(out[:, 0], x[0] @ heads.value.transpose(-1, -2), rtol=1e-14, atol=1e-14)
    # ...whatever the later tokens are
    y = x.clone()
    y[1:] = random_sphere(6, 4, seed=12)
    torch.testing.assert_close(tp.head_outputs(y, heads, causal=True)[:, 0], out[:, 0], rtol=0, atol=0)
    # and token i's output does not depend on tokens after it (changing the last token)
    z = x.clone()
    z[-1] = random_sphere(4, seed=13)
    torch.testing.assert_close(tp.head_outputs(z, heads, causal=True)[:, :-1], out[:, :-1], rtol=1e-13, atol=1e-13)


def test_two_tokens_closed_form():
    # n = 2, one head: p_10 = w0 e^{s10} / (w0 e^{s10} + w1 e^{s11}), log m(x_1) = log(w0 e^{s10} + w1 e^{s11}) - log(w0 + w1)
    dt = torch.float64
    a, b = 0.3, 1.1
    x = torch.tensor([[math.cos(a), math.sin(a)], [math.cos(b), math.sin(b)]], dtype=dt)
    beta, lam = 1.7, 0.8
    heads = tp.Heads.scalar(torch.tensor([lam], dtype=dt), 2, beta=beta)
    w = torch.tensor([0.25, 0.75], dtype=dt)
    s10, s11, s00 = beta * lam * math.cos(a - b), beta * lam, beta * lam
    p10 = 0.25 * math.exp(s10) / (0.25 * math.exp(s10) + 0.75 * math.exp(s11))
    st = tp.softmax_statistics(x, heads, w, causal=True)
    want_mean = torch.stack([x[0], p10 * x[0] + (1 - p10) * x[1]])
    torch.testing.assert_close(st.mean[0], want_mean, rtol=1e-14, atol=1e-14)
    want_lse = torch.tensor([s00, math.log(0.25 * math.exp(s10) + 0.75 * math.exp(s11))], dtype=dt)
    torch.testing.assert_close(st.log_partition[0], want_lse, rtol=1e-14, atol=1e-14)
    # the velocity: V = P_x(λ ȳ): zero at the first token (it sees only itself), tangent at the second
    v = tp.velocity(x, heads, w, causal=True)
    torch.testing.assert_close(v[0], torch.zeros(2, dtype=dt), rtol=0, atol=1e-15)
    m1 = lam * want_mean[1]
    torch.testing.assert_close(v[1], m1 - (m1 @ x[1]) * x[1], rtol=1e-14, atol=1e-14)


def test_causal_differs_and_reduces_to_full_for_last_token():
    # the last token sees every token: its causal statistics are the non-causal ones
    x = random_sphere(3, 8, 3, seed=14)
    heads = tp.Heads.random(2, 3, generator=gen(15), dtype=torch.float64)
    w = _weights(3, 8)
    c = tp.softmax_statistics(x, heads, w, causal=True)
    f = tp.softmax_statistics(x, heads, w)
    torch.testing.assert_close(c.mean[..., -1, :], f.mean[..., -1, :], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(c.log_partition[..., -1], f.log_partition[..., -1], rtol=1e-13, atol=1e-13)
    assert (c.mean[..., :-1, :] - f.mean[..., :-1, :]).abs().max() > 1e-3


def test_gradcheck():
    dt = torch.float64
    x = random_sphere(5, 3, seed=16).requires_grad_(True)
    A = torch.randn(2, 3, 3, generator=gen(17), dtype=dt).requires_grad_(True)
    w0 = _weights(5)
    wr = w0.clone().requires_grad_(True)

    def f(x, A, w):
        h = tp.Heads(A)
        st = tp.softmax_statistics(x, h, w, causal=True, second_moment=True, chunk_elements=6)
        mass, first = tp.relu_statistics(x, h, w, causal=True)
        return st.log_partition, st.mean, st.second, mass, first

    assert torch.autograd.gradcheck(f, (x, A, wr))
    # the autograd path agrees with the no-grad kernels
    with torch.no_grad():
        ref = f(x, A, w0)
    for a, b in zip(f(x, A, w0), ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


def test_evaluate_diagnostics_are_those_of_the_whole_measure():
    # E and ∇δE/δμ do not depend on the mask; the dissipation pairs ∇δE/δμ with the causal field
    x = random_sphere(2, 10, 3, seed=18)
    heads = tp.Heads.random(3, 3, symmetric=False, generator=gen(19), dtype=torch.float64)
    w = _weights(2, 10)
    full = evaluate(x, heads, w)
    cau = evaluate(x, heads, w, causal=True)
    torch.testing.assert_close(cau.energy, full.energy)
    torch.testing.assert_close(cau.grad_first_variation, full.grad_first_variation)
    want = (w * (full.grad_first_variation * cau.velocity).sum(-1)).sum(-1)
    torch.testing.assert_close(cau.dissipation, want)
    torch.testing.assert_close(cau.velocity, tp.velocity(x, heads, w, causal=True))
    # the chain rule: d/dt E(x + t V_causal) at t = 0 is the dissipation (central difference)
    h = 1e-5
    xp = torch.nn.functional.normalize(x + h * cau.velocity, dim=-1)
    xm = torch.nn.functional.normalize(x - h * cau.velocity, dim=-1)
    fd = (tp.energy(xp, heads, w) - tp.energy(xm, heads, w)) / (2 * h)
    torch.testing.assert_close(fd, cau.dissipation, rtol=1e-6, atol=1e-8)


def test_bad_input():
    x = random_sphere(4, 3)
    heads = tp.Heads.random(1, 3, generator=gen(0), dtype=torch.float64)
    with pytest.raises(ValueError, match="keys"):
        tp.softmax_statistics(x, heads, keys=x.clone(), causal=True)
    with pytest.raises(ValueError, match="keys"):
        tp.relu_statistics(x, heads, keys=x.clone(), causal=True)
    with pytest.raises(ValueError, match="keys"):
        evaluate(x, heads, keys=x.clone(), causal=True)
    with pytest.raises(ValueError, match="effective"):
        tp.velocity(x, heads, normalization="effective", causal=True)
    with pytest.raises(TypeError, match="causal"):
        tp.velocity(x, heads, causal="yes")
    with pytest.raises(TypeError, match="causal"):
        tp.softmax_statistics(x, heads, causal=1)


# ---------------------------------------------------------------------------- the study
def test_merge_times_and_spearman_against_independent_code():
    from transformer_pde.application.studies import causal as cs

    e = torch.eye(3, dtype=torch.float64)
    far = torch.nn.functional.normalize(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), dim=0)
    # 4 tokens, 3 recorded times: tokens 0,1 meet at t = 1, token 2 joins them at t = 2, token 3 never
    x = torch.stack([
        torch.stack([e[0], e[1], e[2], -far]),
        torch.stack([e[0], e[0], e[2], -far]),
        torch.stack([e[0], e[0], e[0], -far]),
    ]).unsqueeze(1)  # (T, paths = 1, n, d)
    tau = cs._merge_times(torch.tensor([0.0, 1.0, 2.0]), x, radius=0.1)
    torch.testing.assert_close(tau, torch.tensor([[1.0, 1.0, 2.0, 2.0]], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, generator=g, dtype=torch.float64), torch.randint(0, 5, (20,), generator=g).double()

    def avg_rank(v):  # rank = #smaller + (#equal - 1)/2, the textbook mid-rank
        return ((v[None, :] < v[:, None]).sum(1) + ((v[None, :] == v[:, None]).sum(1) - 1) / 2).double()

    ra, rb = avg_rank(a), avg_rank(b)
    want = float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])
    assert abs(cs._spearman(a, b) - want) < 1e-12
    assert cs._spearman(a, a.exp()) == pytest.approx(1.0)


def test_causal_study_runs_and_resumes(tmp_path):
    from transformer_pde.application.runs import execute

    cfg = {"kind": "causal_clustering", "name": "c",
           "params": {"n": 6, "heads": 1, "t1": 0.4, "dt": 0.1, "paths": 2, "regimes": ["ou"], "figures": False,
                      "record_every": 1}}
    steps = []
    path = execute(cfg, out_dir=tmp_path, progress=False, step_callback=lambda tag, k, t: steps.append(tag))
    met = json.loads((path / "metrics.json").read_text())
    assert steps.count("ou_full") == 4 and steps.count("ou_causal") == 4
    for key in ("ou_full", "ou_causal"):
        m = met[key]
        assert 0.0 <= m["pair_fraction_final"] <= 1.0 and 0.0 < m["largest_mass_final"] <= 1.0
        assert (path / "series" / f"{key}.csv").exists()
    assert len(met["summary"]) == 1
    # resume: both pieces are loaded from data/, nothing is simulated again, same metrics
    (path / "status.json").write_text(json.dumps({"state": "interrupted"}))
    steps.clear()
    path = execute(cfg, out_dir=tmp_path, progress=False, resume=True,
                   step_callback=lambda tag, k, t: steps.append(tag))
    assert steps == []
    met2 = json.loads((path / "metrics.json").read_text())
    assert met2["ou_causal"] == met["ou_causal"]
    with pytest.raises(ValueError, match="whole number"):
        execute({**cfg, "params": {**cfg["params"], "dt": 0.3}}, out_dir=tmp_path, name="bad", progress=False)
