"""The attention normalisations (transformer_pde.model.normalization): every property an object states is
checked against what the field, the solvers and the theory modules do with it.

    overflow      "kernel" ⇔ the field overflows float32 at β‖A‖ = 200 while "none" stays finite
    causal        ⇔ causal evaluation is accepted (else ValueError, before any work)
    uses_value    ⇔ the field changes when the value matrices change
    statistics    "relu" ⇔ the field is positively homogeneous of degree 1 in β (ReLU kernel)
    head_outputs  ⇔ head_outputs() exists and Σ_h ω_h f_h is the field
    gradient_flow the identities it claims: D = s·𝒢² (effective, any heads); V = s ∇_S δE/δμ, the W2
                  gradient (unnormalized, tied symmetric heads); softmax = effective for one tied head;
                  and the identities fail where no claim is made
    reduced       ⇔ the reduced equiangular ODE accepts it, and then its γ̇ is the particles' γ̇
    jko_mobility  ⇔ the JKO scheme with that mobility follows the particles of that normalisation
"""

import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from transformer_pde.model import normalization as N
from transformer_pde.model.field import evaluate

F64 = torch.float64
FOUR = [N.Softmax(), N.Unnormalized(), N.ReLU(), N.Effective()]
ALL = FOUR + [N.SinkhornAttention(), N.Hardmax()]
IDS = [n.name for n in ALL]


def _tokens(n=7, d=3, seed=0, dtype=F64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=dtype)


def _sym_heads(H=2, d=3, seed=1, scale=0.8, dtype=F64):
    A = scale * torch.randn(H, d, d, generator=gen(seed), dtype=dtype)
    return tp.Heads(0.5 * (A + A.transpose(-1, -2)), weights=torch.tensor([0.7, 1.3][:H], dtype=dtype))


def _field(x, heads, norm, **kw):
    return evaluate(x, heads, normalization=norm, diagnostics=False, **kw).velocity


def test_names_objects_and_validation_agree():
    assert N.NORMALIZATIONS == tuple(n.name for n in ALL)
    for obj in ALL:
        assert N.normalization(obj.name) == obj and N.normalization(obj) is obj and str(obj) == obj.name
    with pytest.raises(ValueError, match=r"unknown normalization 'sofmax'; choose one of 'softmax'"):
        N.normalization("sofmax")
    with pytest.raises(TypeError, match="abstract base"):
        N.normalization(N.Normalization())
    with pytest.raises(TypeError, match="a Normalization object"):
        N.normalization(3)
    with pytest.raises(ValueError, match="'effective' is not covered here"):
        N.choose(N.Effective(), ("softmax",))


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_strings_and_objects_give_the_same_numbers(norm):
    x, heads = _tokens(), _sym_heads()
    tied = tp.Heads(heads.score, weights=heads.weights)
    for fn in (lambda v: tp.velocity(x, tied, normalization=v),
               lambda v: tp.slope(x, tied, normalization=v, log_scale=0.5),
               lambda v: tp.dissipation(x, tied, normalization=v)):
        assert_close(fn(norm), fn(norm.name), rtol=0, atol=0)
    if norm.head_outputs:
        assert_close(tp.head_outputs(x, tied, normalization=norm), tp.head_outputs(x, tied, normalization=norm.name),
                     rtol=0, atol=0)


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_overflow_property_is_what_float32_does_at_large_beta(norm):
    """β‖A‖ = 200 > log(float32 max) = 88.7, two heads of opposite sign (mobilities up to e^{200}): a field that
    carries the kernel itself (unnormalized) or a ratio of mobilities (effective) overflows; the
    ratios (softmax) and the linear ReLU kernel do not.  velocity() says so with OverflowError."""
    x = _tokens(9, 3, seed=4, dtype=torch.float32)
    heads = tp.Heads.scalar([200.0, -200.0], 3).to(torch.float32)
    v = _field(x, heads, norm)
    assert bool(torch.isfinite(v).all()) == (norm.overflow == "none"), norm
    if norm.overflow == "kernel":
        with pytest.raises(OverflowError, match="overflows torch.float32"):
            tp.velocity(x, heads, normalization=norm)
        # in float64 the same heads are finite: the overflow is the dtype's, not a bad input
        assert bool(torch.isfinite(_field(x.double(), heads.to(F64), norm)).all())
    else:
        tp.velocity(x, heads, normalization=norm)


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_causal_property_is_whether_causal_evaluation_is_accepted(norm):
    x, heads = _tokens(), _sym_heads()
    if norm.causal:
        v = tp.velocity(x, heads, normalization=norm, causal=True)
        # causal: the first token sees only itself, so its field is the one of the measure δ_{x_0}
        assert_close(v[0], tp.velocity(x[:1], heads, normalization=norm)[0], rtol=1e-12, atol=1e-14)
        assert_close(v[-1], tp.velocity(x, heads, normalization=norm)[-1], rtol=1e-12, atol=1e-14) \
            if norm.statistics == "softmax" and norm.name == "softmax" else None
    else:
        with pytest.raises(ValueError, match="no causal version"):
            tp.velocity(x, heads, normalization=norm, causal=True)
        with pytest.raises(ValueError, match="no causal version"):
            evaluate(x, heads, normalization=norm, causal=True)


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_uses_value_is_whether_the_field_reads_the_values(norm):
    x, heads = _tokens(), _sym_heads()
    V2 = heads.score + 0.3 * torch.randn(heads.score.shape, generator=gen(9), dtype=F64)
    v1 = _field(x, tp.Heads(heads.score, heads.score, heads.weights), norm)
    v2 = _field(x, tp.Heads(heads.score, V2, heads.weights), norm)
    changed = float((v1 - v2).abs().max()) > 1e-6 * float(v1.abs().max())
    assert changed == norm.uses_value


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_relu_statistics_is_a_positively_homogeneous_kernel(norm):
    """ReLU(2βs) = 2 ReLU(βs): the relu field doubles with β; the exponential kernels do not scale so."""
    x, heads = _tokens(), _sym_heads()
    h2 = tp.Heads(heads.score, weights=heads.weights, beta=2.0)
    v1, v2 = _field(x, heads, norm), _field(x, h2, norm)
    homogeneous = bool(torch.allclose(v2, 2 * v1, rtol=1e-12, atol=1e-14))
    assert homogeneous == (norm.statistics == "relu")


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_head_outputs_sum_to_the_field(norm):
    x, heads = _tokens(), _sym_heads()
    if not norm.head_outputs:
        assert evaluate(x, heads, normalization=norm, diagnostics=False).outputs is None
        with pytest.raises(ValueError, match="not covered here"):
            tp.head_outputs(x, heads, normalization=norm)
        with pytest.raises(ValueError, match="unknown normalization"):
            tp.head_outputs(x, heads, normalization=norm.name)
        return
    f = tp.head_outputs(x, heads, normalization=norm)
    amb = (heads.weights[:, None, None] * f).sum(0)
    want = amb - (amb * x).sum(-1, keepdim=True) * x
    assert_close(tp.velocity(x, heads, normalization=norm), want, rtol=1e-12, atol=1e-14)


def _diag(x, heads, norm, sign):
    ev = evaluate(x, heads, normalization=norm, sign=sign, diagnostics=True)
    return ev.velocity, ev.grad_first_variation, ev.slope, ev.dissipation


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_flow_claims(sign):
    """effective: D = s 𝒢² for any tied heads (and V = s b^{-1} ∇_S δE/δμ); unnormalized with tied symmetric
    heads: V = s ∇_S δE/δμ, the W2 gradient (D = s Σ w|V|²); softmax with one tied head equals effective.
    Where no claim is made the identity fails (softmax with two heads of unequal mobility; relu)."""
    x = _tokens(8, 3, seed=5)
    heads = _sym_heads(2, scale=1.5)
    eps = 1e-12
    V, g, G, D = _diag(x, heads, N.Effective(), sign)
    assert_close(D, sign * G, rtol=eps, atol=0)
    Vu, gu, _, Du = _diag(x, heads, N.Unnormalized(), sign)
    assert_close(Vu, sign * gu, rtol=eps, atol=eps)
    assert_close(Du, sign * Vu.square().sum(-1).mean(), rtol=eps, atol=0)
    one = tp.Heads(heads.score[:1])
    assert_close(_field(x, one, N.Softmax(), sign=sign), _field(x, one, N.Effective(), sign=sign), rtol=eps, atol=eps)
    for norm in (N.Softmax(), N.ReLU()):
        _, _, Gs, Ds = _diag(x, heads, norm, sign)
        assert abs(float(Ds - sign * Gs)) > 1e-4 * abs(float(Gs)), norm
    assert N.Effective.gradient_flow.startswith("always") and "W2" in N.Unnormalized.gradient_flow
    assert N.ReLU.gradient_flow == "no" and "one head" in N.Softmax.gradient_flow


@pytest.mark.parametrize("norm", ALL, ids=IDS)
def test_reduced_property_is_the_equiangular_ode(norm):
    """Equiangular tokens ⟨x_i, x_j⟩ = γ under scalar heads λ_h I (ω_h = 1): the particles' γ̇ = 2⟨v_0, x_1⟩
    equals the reduced field of theory.gamma_velocity exactly when the object says it is covered."""
    n, gamma, lam = 5, 0.3, [0.7, 1.3]
    x = tp.sphere.equiangular(n, gamma, dtype=F64)
    heads = tp.Heads.scalar(torch.tensor(lam, dtype=F64), x.shape[-1], beta=1.5, weights=torch.ones(2, dtype=F64))
    if not norm.reduced:
        with pytest.raises(ValueError, match="normalization"):
            tp.theory.gamma_velocity(gamma, lam, beta=1.5, n=n, normalization=norm)
        return
    v = tp.velocity(x, heads, normalization=norm)
    want = float(tp.theory.gamma_velocity(gamma, lam, beta=1.5, n=n, normalization=norm))
    assert math.isclose(2 * float(v[0] @ x[1]), want, rel_tol=1e-12, abs_tol=1e-14)
    assert math.isclose(2 * float(v[2] @ x[3]), want, rel_tol=1e-12, abs_tol=1e-14)


def _run_both(norm, mobility):
    x0 = _tokens(6, 3, seed=11)
    heads = tp.Heads.scalar([1.5], 3).to(F64)
    tau, steps = 2e-3, 10
    jk = tp.jko(x0, heads, tau=tau, steps=steps, mobility=mobility, direction="ascent", transport="identity",
                tol=1e-13, progress=False)
    pt = tp.simulate(x0, heads, t1=tau * steps, dt=tau / 4, method="rk4", normalization=norm.name,
                     direction="ascent", progress=False)
    travel = float((pt.x[-1] - x0).norm(dim=-1).max())
    return float((jk.x[-1] - pt.x[-1]).norm(dim=-1).max()), travel


@pytest.mark.parametrize("norm", FOUR, ids=IDS[:4])
def test_jko_mobility_follows_the_particles(norm):
    """JKO (implicit Euler in the metric of the mobility, τ = 2e-3, 10 steps, identity transport: the
    particles' own coupling) against RK4 particles of the normalisation: the gap is O(τ) of the travel
    (here < 2 %) for the stated mobility and of the order of the travel itself for the other one."""
    stated = norm.jko_mobility
    for mob in ("effective", "unit"):
        gap, travel = _run_both(norm, mob)
        assert travel > 1e-3
        if mob == stated:
            assert gap < 0.02 * travel, (norm, mob, gap, travel)
        else:
            assert gap > 0.1 * travel, (norm, mob, gap, travel)
