"""Normalisations beyond the registered four: a user's own subclass, Sinkhorn (doubly stochastic) attention and
hardmax.

* a user-defined :class:`Normalization` that is not in the registry runs through every public function of the
  model layer, against the field, slope and dissipation written out by hand here;
* Sinkhorn: the plan against POT's log-domain Sinkhorn (an independent implementation), row sums one and the
  weighted column marginals at large iteration counts (not at zero: that is softmax), and the gradient-flow
  property of Sinkformers: with symmetric heads (V = A = Aᵀ) the converged field (ascent) is
  V(x_i) = −(1/w_i) P_{x_i} ∂F/∂x_i with F = Σ_h ω_h ½ OT_{1/β}(μ, μ), cost −⟨x, A_h y⟩, F computed here by
  its own unrolled Sinkhorn loop and differentiated by autograd; the softmax field is not that gradient;
* hardmax: ties split by weight, and softmax at growing β converges to it at the rate e^{−β δ_i}, δ_i the gap
  between the best and second-best score of token i;
* both through ``tp.solve`` with the Euler solver against a loop of projected Euler steps.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import ot
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from transformer_pde.model import normalization as N
from transformer_pde.model.field import evaluate
from transformer_pde.model.plans import hardmax_plan, plan_average, sinkhorn_plan

F64, F32 = torch.float64, torch.float32
TOL = {F64: dict(rtol=1e-10, atol=1e-12), F32: dict(rtol=2e-4, atol=2e-5)}


def _tokens(n=7, d=3, seed=0, dtype=F64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=dtype)


def _weights(n, seed=3, dtype=F64):
    w = torch.rand(n, generator=gen(seed), dtype=F64) + 0.3
    return (w / w.sum()).to(dtype)


def _sym(H=2, d=3, seed=1, scale=0.8, dtype=F64):
    A = scale * torch.randn(H, d, d, generator=gen(seed), dtype=F64)
    return (0.5 * (A + A.transpose(-1, -2))).to(dtype)


def _proj(x, v):
    return v - (v * x).sum(-1, keepdim=True) * x


@dataclass(frozen=True)
class TemperedSoftmax(N.Normalization):
    """A user's normalisation: softmax at temperature T, p_ij ∝ w_j e^{β⟨x_i, A_h x_j⟩ / T}."""

    name: ClassVar[str] = "tempered"
    temperature: float = 2.0

    def outputs(self, kernel):
        T = self.temperature
        return kernel.plan_mean(lambda S, logw, logq: torch.softmax(S / T + logw, -1))


def _tempered_by_hand(x, A, V, omega, beta, w, T):
    """Σ_h ω_h V_h Σ_j p_ij x_j with p_ij = softmax_j(β⟨x_i, A_h x_j⟩/T + log w_j), per head and summed."""
    S = torch.einsum("ia,hab,jb->hij", x, A, x) * beta / T
    p = torch.softmax(S + torch.log(w), -1)
    f = torch.einsum("hij,jb,hab->hia", p, x, V)
    return f, (omega[:, None, None] * f).sum(0)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_a_user_subclass_outside_the_registry_runs_in_every_public_function(dtype):
    x, w = _tokens(dtype=dtype), _weights(7, dtype=dtype)
    A = _sym(dtype=dtype)
    omega = torch.tensor([0.7, 1.3], dtype=dtype)
    beta, T = 1.4, 2.5
    heads = tp.Heads(A, weights=omega, beta=beta)
    norm = TemperedSoftmax(T)
    with pytest.raises(ValueError, match="unknown normalization 'tempered'"):
        N.normalization("tempered")  # not registered: every function below must use the object itself
    f, amb = _tempered_by_hand(x, A, A, omega, beta, w, T)
    want = _proj(x, amb)
    assert_close(tp.velocity(x, heads, w, normalization=norm), want, **TOL[dtype])
    assert_close(tp.velocity(x, heads, w, normalization=norm, direction="descent"), -want, **TOL[dtype])
    assert_close(evaluate(x, heads, w, normalization=norm, diagnostics=False).velocity, want, **TOL[dtype])
    assert_close(tp.head_outputs(x, heads, w, normalization=norm), f, **TOL[dtype])
    # softmax at temperature T is softmax at β/T: a second, independent expectation
    assert_close(tp.velocity(x, tp.Heads(A, weights=omega, beta=beta / T), w), want, **TOL[dtype])
    # 𝒢² = Σ_i w_i b(x_i)|V_i|², 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i), V_i⟩ written out (symmetric heads)
    K = torch.exp(beta * torch.einsum("ia,hab,jb->hij", x, A, x))  # (H, n, n)
    m = (K * w).sum(-1)  # m_h(x_i)
    wbar = omega / omega.sum()
    b = 1.0 / (wbar[:, None] / m).sum(0)
    grad = _proj(x, torch.einsum("h,hij,j,jb,hab->ia", omega, K, w, x, A))
    assert_close(tp.slope(x, heads, w, normalization=norm), (w * b * want.square().sum(-1)).sum(), **TOL[dtype])
    assert_close(tp.dissipation(x, heads, w, normalization=norm), (w * (grad * want).sum(-1)).sum(), **TOL[dtype])
    ev = evaluate(x, heads, w, normalization=norm, diagnostics=True)
    assert_close(ev.slope, (w * b * want.square().sum(-1)).sum(), **TOL[dtype])


def test_a_user_subclass_is_refused_where_its_property_is_missing():
    @dataclass(frozen=True)
    class Gradient(N.Normalization):
        name: ClassVar[str] = "mine"
        head_outputs: ClassVar[bool] = False
        causal: ClassVar[bool] = False

        def field(self, kernel):
            return kernel.gradient_field(), None

    x, heads = _tokens(), tp.Heads(_sym())
    with pytest.raises(ValueError, match="'mine' is not covered here .no per-head split."):
        tp.head_outputs(x, heads, normalization=Gradient())
    with pytest.raises(ValueError, match="no causal version"):
        tp.velocity(x, heads, normalization=Gradient(), causal=True)
    # the object is used as it is: its field is the effective one, which it returns
    assert_close(tp.velocity(x, heads, normalization=Gradient()), tp.velocity(x, heads, normalization="effective"),
                 rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_sinkhorn_plan_is_pots_and_has_the_weighted_marginals(dtype):
    n = 9
    x, w = _tokens(n, seed=2, dtype=dtype), _weights(n, dtype=dtype)
    A = _sym(1, dtype=dtype)[0]
    beta = 1.7
    S = beta * x @ A @ x.T
    logw = torch.log(w)
    P = sinkhorn_plan(S[None], logw[None, None, :], logw[None, :, None], iterations=300)[0]
    gamma = ot.sinkhorn(w.double(), w.double(), -S.double(), reg=1.0, method="sinkhorn_log", numItermax=100000,
                        stopThr=1e-15)
    assert_close(w[:, None] * P, gamma.to(dtype), **TOL[dtype])
    assert_close(P.sum(-1), torch.ones(n, dtype=dtype), **TOL[dtype])
    assert_close((w[:, None] * P).sum(0), w, **TOL[dtype])
    P0 = sinkhorn_plan(S[None], logw[None, None, :], logw[None, :, None], iterations=0)[0]
    assert float(((w[:, None] * P0).sum(0) - w).abs().max()) > 1e-3  # softmax rows: columns not balanced
    # the field: V(x_i) = P_x Σ_h ω_h V_h Σ_j (γ_ij / w_i) x_j with POT's plan
    V = _sym(1, seed=8, dtype=dtype)[0]
    heads = tp.Heads(A[None], V[None], beta=beta)
    want = _proj(x, ((gamma.to(dtype) / w[:, None]) @ x) @ V.T)
    got = tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=300))
    assert_close(got, want, **TOL[dtype])


def test_sinkhorn_with_no_iterations_is_softmax_and_refuses_bad_counts():
    x, w = _tokens(), _weights(7)
    heads = tp.Heads(_sym(), torch.randn(2, 3, 3, generator=gen(4), dtype=F64), beta=1.2)
    assert_close(tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=0)), tp.velocity(x, heads, w),
                 rtol=1e-12, atol=1e-14)
    # one round already moves the field away from softmax (the columns get balanced)
    v1 = tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=1))
    assert float((v1 - tp.velocity(x, heads, w)).abs().max()) > 1e-4
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="iterations"):
            tp.SinkhornAttention(iterations=bad)
    with pytest.raises(ValueError, match="keys="):
        evaluate(x, heads, w, normalization=tp.SinkhornAttention(), keys=x, key_weights=w, diagnostics=False)


def _half_self_transport(x, A, beta, w, iterations=400):
    """½ OT_ε(μ, μ), ε = 1/β, cost c(x, y) = −⟨x, A y⟩, μ = Σ w_i δ_{x_i}: the dual objective of the converged
    potentials (f, g) of a log-domain Sinkhorn loop written here (autograd runs through the loop)."""
    eps = 1.0 / beta
    C = -(x @ A @ x.T)
    logw = torch.log(w)
    g = torch.zeros_like(w)
    for _ in range(iterations):
        f = -eps * torch.logsumexp((g[None, :] - C) / eps + logw[None, :], dim=1)
        g = -eps * torch.logsumexp((f[:, None] - C) / eps + logw[:, None], dim=0)
    mass = (w[:, None] * w[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)).sum()
    return 0.5 * (w @ f + w @ g - eps * (mass - 1.0))


def test_symmetric_sinkhorn_is_the_wasserstein_gradient_flow_of_the_self_transport_cost():
    """Sinkformers: V(x_i) = −(1/w_i) P_{x_i} ∂F/∂x_i, F = Σ_h ω_h ½ OT_{1/β}(μ, μ) (direction "ascent");
    the softmax field of the same heads is not that gradient (the control)."""
    n = 7
    x, w = _tokens(n, seed=6), _weights(n, seed=7)
    A = _sym(2, seed=5, scale=1.0)
    omega, beta = torch.tensor([0.4, 0.6], dtype=F64), 1.3
    xg = x.clone().requires_grad_(True)
    F = sum(omega[h] * _half_self_transport(xg, A[h], beta, w) for h in range(2))
    (grad,) = torch.autograd.grad(F, xg)
    want = -_proj(x, grad) / w[:, None]
    heads = tp.Heads(A, weights=omega, beta=beta)
    got = tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=400), direction="ascent")
    assert_close(got, want, rtol=1e-8, atol=1e-10)
    soft = tp.velocity(x, heads, w, direction="ascent")
    assert float((soft - want).norm()) > 0.05 * float(want.norm())


def test_hardmax_splits_ties_by_weight():
    """Query e_3, keys at equal scores ⟨e_3, y_1⟩ = ⟨e_3, y_2⟩ = cos a (exactly) and a third lower one:
    the output is (w_1 y_1 + w_2 y_2)/(w_1 + w_2); a zero-weight key of a higher score is not in μ."""
    a = 0.6
    s, c = math.sin(a), math.cos(a)
    keys = torch.tensor([[s, 0.0, c], [-s, 0.0, c], [0.0, 0.8, 0.6], [0.0, 0.0, 1.0]], dtype=F64)
    kw = torch.tensor([0.2, 0.5, 0.3, 0.0], dtype=F64)
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    heads = tp.Heads(torch.eye(3, dtype=F64)[None], beta=3.0)
    f = evaluate(q, heads, None, normalization=tp.Hardmax(), keys=keys, key_weights=kw, diagnostics=False).outputs
    assert_close(f[0, 0], (0.2 * keys[0] + 0.5 * keys[1]) / 0.7, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_hardmax_is_the_best_key_of_every_head(dtype):
    x, w = _tokens(8, seed=9, dtype=dtype), _weights(8, dtype=dtype)
    A = torch.randn(2, 3, 3, generator=gen(10), dtype=F64).to(dtype)
    V = torch.randn(2, 3, 3, generator=gen(11), dtype=F64).to(dtype)
    omega = torch.tensor([0.3, 0.7], dtype=dtype)
    S = torch.einsum("ia,hab,jb->hij", x, A, x)
    best = x[S.argmax(-1)]  # (H, n, d): y_{j*(i, h)}
    want = _proj(x, torch.einsum("h,hia,hba->ib", omega, best, V))
    for beta in (0.5, 4.0):  # any β > 0: the limit does not depend on it
        got = tp.velocity(x, tp.Heads(A, V, weights=omega, beta=beta), w, normalization="hardmax")
        assert_close(got, want, **TOL[dtype])


def test_softmax_converges_to_hardmax_at_the_rate_of_the_score_gap():
    """|V_β(x_i) − V_∞(x_i)| ~ C_i e^{−β δ_i}, δ_i = s_i(1) − s_i(2) the gap of the two best scores
    s_ij = ⟨x_i, A x_j⟩: the slope of log error in β is −δ_i (tokens whose third score is far enough below
    that the next term is e^{−5} of the first at the smallest β)."""
    n = 8
    x, w = _tokens(n, seed=12), _weights(n, seed=13)
    A = _sym(1, seed=14, scale=1.5)
    V = torch.randn(1, 3, 3, generator=gen(15), dtype=F64)
    S = (x @ A[0] @ x.T).sort(-1, descending=True).values
    gap, gap2 = S[:, 0] - S[:, 1], S[:, 0] - S[:, 2]
    hard = tp.velocity(x, tp.Heads(A, V), w, normalization=tp.Hardmax())
    checked = 0
    for i in range(n):
        if gap[i] < 0.05 or gap2[i] < 1.5 * gap[i]:
            continue
        ks = torch.tensor([10.0, 14.0, 18.0], dtype=F64)
        betas = ks / gap[i]
        err = torch.stack([(tp.velocity(x, tp.Heads(A, V, beta=float(b)), w)[i] - hard[i]).norm() for b in betas])
        slope = (torch.log(err[-1]) - torch.log(err[0])) / (betas[-1] - betas[0])
        assert_close(slope, -gap[i], rtol=2e-2, atol=0.0)
        checked += 1
    assert checked >= 2, "the configuration has too few tokens with a clear second score"


@pytest.mark.parametrize("norm", [tp.SinkhornAttention(), tp.Hardmax(), tp.SinkhornAttention(iterations=0),
                                  TemperedSoftmax(2.0)], ids=["sinkhorn", "hardmax", "sinkhorn0", "user"])
def test_plans_run_through_solve(norm):
    """tp.solve with Euler equals a loop of x ← (x + dt V(x)) / |x + dt V(x)| with the model's normalisation
    object itself: its parameters (iterations=0) and an unregistered subclass reach the solver's field."""
    x0 = _tokens(6, seed=16)
    heads = tp.Heads(_sym(2, seed=17), beta=1.5)
    dt, steps = 0.02, 5
    traj = tp.solve(tp.Model(heads, normalization=norm, direction="ascent"), x0, tp.Euler(), t1=dt * steps, dt=dt,
                    progress=False)
    x = x0
    for _ in range(steps):
        y = x + dt * tp.velocity(x, heads, normalization=norm)
        x = y / y.norm(dim=-1, keepdim=True)
    assert_close(traj.x[-1], x, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("norm", [tp.SinkhornAttention(iterations=5), tp.Hardmax()], ids=["sinkhorn", "hardmax"])
def test_plans_broadcast_over_batch_axes(norm):
    """Tokens (3, n, d) with their own weights (3, n) and heads with a batch axis of 3: each batch entry is
    the field of its own configuration."""
    x = torch.stack([_tokens(6, seed=20 + b) for b in range(3)])
    w = torch.stack([_weights(6, seed=30 + b) for b in range(3)])
    A = torch.stack([_sym(2, seed=40 + b) for b in range(3)])
    got = tp.velocity(x, tp.Heads(A, beta=1.2), w, normalization=norm)
    for b in range(3):
        assert_close(got[b], tp.velocity(x[b], tp.Heads(A[b], beta=1.2), w[b], normalization=norm),
                     rtol=1e-12, atol=1e-14)


def test_choose_compares_classes_not_names():
    """Entry points with closed forms per registered class (tp.theory) refuse a subclass even when it borrows a
    registered name: its output rule is not the registered one."""

    @dataclass(frozen=True)
    class Impostor(N.Softmax):
        name: ClassVar[str] = "softmax"

        def outputs(self, kernel):
            return 2 * kernel.value_mean()

        def field(self, kernel):
            return N.Normalization.field(self, kernel)

    assert N.choose(N.Softmax(), ("softmax",)) == N.Softmax()
    with pytest.raises(ValueError, match="'softmax' is not covered here"):
        N.choose(Impostor(), ("softmax",))
    with pytest.raises(ValueError, match="not covered here"):
        tp.theory.gamma_velocity(0.3, [1.0], beta=1.0, n=4, normalization=Impostor())
    x, heads = _tokens(), tp.Heads(_sym())
    assert_close(tp.velocity(x, heads, normalization=Impostor()), 2 * tp.velocity(x, heads), rtol=1e-12, atol=1e-14)


def test_hardmax_in_row_blocks_is_the_one_block_plan():
    """Row blocks of 2·m scores (causal and not) give the plan of one block: every row is independent."""
    x, w = _tokens(9, seed=21), _weights(9, seed=22)
    heads = tp.Heads(torch.randn(2, 3, 3, generator=gen(23), dtype=F64))
    for causal in (False, True):
        one = evaluate(x, heads, w, normalization="hardmax", diagnostics=False, causal=causal).velocity
        blocks = evaluate(x, heads, w, normalization="hardmax", diagnostics=False, causal=causal,
                          chunk_elements=2 * 2 * 9).velocity
        assert_close(blocks, one, rtol=1e-13, atol=1e-15)


def test_sinkhorn_field_is_differentiable():
    """gradcheck (float64 finite differences) of the Sinkhorn field in the tokens, the scores and β."""
    x = _tokens(5, seed=24).requires_grad_(True)
    A = _sym(2, seed=25).requires_grad_(True)
    beta = torch.tensor(1.1, dtype=F64, requires_grad=True)
    w = _weights(5, seed=26)

    def field(x, A, beta):
        return evaluate(x, tp.Heads(A, beta=beta), w, normalization=tp.SinkhornAttention(iterations=3),
                        diagnostics=False).velocity

    assert torch.autograd.gradcheck(field, (x, A, beta), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_hardmax_ties_are_within_16_ulp_of_the_rows_own_largest_score(dtype):
    """Scores s with max_j |s_ij| = 1 in rows 0-2: a gap of 15.5 ulp(1) is a tie (split by weight), 16.5 and 100
    ulp are not; the row of score 10⁶ below does not widen the ties of the others."""
    e = torch.finfo(dtype).eps
    S = torch.tensor([[[1.0, 1.0 - 15.5 * e], [1.0, 1.0 - 16.5 * e], [1.0, 1.0 - 100 * e], [0.0, 1e6]]], dtype=dtype)
    w = torch.tensor([0.3, 0.7], dtype=dtype)
    want = torch.tensor([[[0.3, 0.7], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]], dtype=dtype)
    assert_close(hardmax_plan(S, torch.log(w)[None, None, :]), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32])
def test_hardmax_average_with_query_key_factors_and_two_batch_axes(dtype):
    """Low-rank heads s_ij = β⟨Q x_i, K y_j⟩ (Q, K (H, 2, 3)) and tokens with two batch axes (2, 3, n, d), in
    row blocks of one row: the key of the best score, written out with einsum and argmax."""
    x = torch.stack([torch.stack([_tokens(5, seed=50 + 3 * a + b, dtype=dtype) for b in range(3)]) for a in range(2)])
    Q = torch.randn(2, 2, 3, generator=gen(60), dtype=F64).to(dtype)
    K = torch.randn(2, 2, 3, generator=gen(61), dtype=F64).to(dtype)
    A = torch.randn(2, 3, 3, generator=gen(62), dtype=F64).to(dtype)
    for heads, S in ((tp.Heads(query=Q, key=K, beta=1.3), 1.3 * torch.einsum("...ia,hka,hkb,...jb->...hij", x, Q, K, x)),
                     (tp.Heads(A, beta=0.7), 0.7 * torch.einsum("...ia,hab,...jb->...hij", x, A, x))):
        want = torch.take_along_dim(x.unsqueeze(-3).expand(2, 3, 2, 5, 3), S.argmax(-1).unsqueeze(-1), -2)
        for chunk in (None, 2 * 5):
            got = plan_average(x, heads, None, "hardmax", chunk_elements=chunk)
            assert_close(got, want, **TOL[dtype])
    # one configuration, no batch axes: the same rule
    got = plan_average(x[1, 2], tp.Heads(query=Q, key=K), None, "hardmax")
    S = torch.einsum("ia,hka,hkb,jb->hij", x[1, 2], Q, K, x[1, 2])
    assert_close(got, x[1, 2][S.argmax(-1)], **TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32])
def test_sinkhorn_average_ignores_the_row_block_cap(dtype):
    """The Sinkhorn plan couples all rows: with chunk_elements of one row it is still POT's plan, Σ_j γ_ij/w_i y_j."""
    n = 8
    x, w = _tokens(n, seed=63, dtype=dtype), _weights(n, seed=64, dtype=dtype)
    A = _sym(1, seed=65, dtype=dtype)
    S = 1.5 * x @ A[0] @ x.T
    gamma = ot.sinkhorn(w.double(), w.double(), -S.double(), reg=1.0, method="sinkhorn_log", numItermax=100000,
                        stopThr=1e-15).to(dtype)
    want = (gamma / w[:, None]) @ x
    for chunk in (None, n):
        got = plan_average(x, tp.Heads(A, beta=1.5), w, "sinkhorn", chunk_elements=chunk, iterations=300)
        assert_close(got[0], want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32])
def test_a_callable_plan_gets_the_log_weights_in_the_tokens_dtype(dtype):
    """The plan P_ij = w_j (taken from the log-weights it is given) averages the keys: Σ_j w_j y_j for every query,
    1/m each without weights; the log-weights come in the tokens' dtype."""
    x, w = _tokens(6, seed=66, dtype=dtype), _weights(6, seed=67, dtype=dtype)
    heads = tp.Heads(_sym(2, seed=68, dtype=dtype))
    seen = []

    def mean_plan(S, logk, logq):
        seen.append((logk.dtype, logq.dtype))
        return torch.exp(logk).expand(S.shape)

    for weights, mean in ((None, x.mean(0)), (w, w @ x)):
        got = plan_average(x, heads, weights, mean_plan)
        assert_close(got, mean.expand(2, 6, 3), **TOL[dtype])
    assert seen == [(dtype, dtype)] * 2


def test_plan_average_refuses_an_unknown_or_uncallable_plan():
    x, heads = _tokens(), tp.Heads(_sym())
    for bad in ("softmax", 3, None):
        with pytest.raises(ValueError, match="unknown plan"):
            plan_average(x, heads, None, bad)
