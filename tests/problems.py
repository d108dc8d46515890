"""Problems with exact answers (in the spirit of torchdiffeq's tests/problems.py).

Every closed form here is derived by hand in the docstring and computed independently of
the library (plain numpy / scipy), so the tests compare two implementations.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.integrate import solve_ivp


def integrate(rhs, y0, t_eval):
    """High-accuracy scalar/vector ODE solve (scipy DOP853, rtol 1e-12) as an oracle."""
    sol = solve_ivp(lambda t, y: rhs(t, y), (0.0, float(t_eval[-1])), np.atleast_1d(np.asarray(y0, float)),
                    t_eval=np.asarray(t_eval, float), method="DOP853", rtol=1e-12, atol=1e-14)
    assert sol.success
    return sol.y


def two_token_angle_rate(theta, lam, beta, normalization):
    """dθ/dt for two tokens at angle θ, one head A = V = λI, uniform weights, ascent.

    softmax: the field at x_1 is λ P_{x_1}(p_1 x_1 + p_2 x_2) = λ p_2 (x_2 − cos θ x_1), with
    p_2 = e^{βλ cos θ}/(e^{βλ} + e^{βλ cos θ}); |x_2 − cos θ x_1| = sin θ, and x_2 moves
    symmetrically, so θ' = −2 λ p_2 sin θ.
    unnormalized: f = λ (½ e^{βλ} x_1 + ½ e^{βλ cos θ} x_2): θ' = −λ e^{βλ cos θ} sin θ.
    relu: f = λ ½ (βλ x_1 + ReLU(βλ cos θ) x_2): θ' = −λ ReLU(βλ cos θ) sin θ.
    """
    c, s = math.cos(theta), math.sin(theta)
    if normalization == "softmax":
        p2 = math.exp(beta * lam * c) / (math.exp(beta * lam) + math.exp(beta * lam * c))
        return -2 * lam * p2 * s
    if normalization == "unnormalized":
        return -lam * math.exp(beta * lam * c) * s
    if normalization == "relu":
        return -lam * max(beta * lam * c, 0.0) * s
    raise ValueError(normalization)


def two_tokens(theta0, d=3, dtype=torch.float64):
    x = torch.zeros(2, d, dtype=dtype)
    x[0, 0] = 1.0
    x[1, 0] = math.cos(theta0)
    x[1, 1] = math.sin(theta0)
    return x


def equiangular_gamma_rate(gamma, lambdas, omegas, n, beta, normalization):
    """dγ/dt for n equiangular tokens (⟨x_i, x_j⟩ = γ), scalar heads λ_h I, weights ω_h, ascent.

    For head h the attention of token i on j ≠ i is q_h(γ) (softmax: e^{βλγ}/(e^{βλ} + (n−1)e^{βλγ});
    unnormalized: e^{βλγ}/n; relu: ReLU(βλγ)/n), and P_{x_i} f_h(x_i) = λ_h q_h Σ_{j≠i}(x_j − γ x_i).
    With Σ_{j≠i} ⟨x_j, x_k⟩ = 1 + (n−2)γ for k ≠ i: ⟨ẋ_i, x_k⟩ = Σ_h ω_h λ_h q_h (1 − γ)(1 + (n−1)γ),
    and γ' = 2⟨ẋ_i, x_k⟩ by symmetry.
    """
    tot = 0.0
    for lam, om in zip(lambdas, omegas):
        if normalization == "softmax":
            q = math.exp(beta * lam * gamma) / (math.exp(beta * lam) + (n - 1) * math.exp(beta * lam * gamma))
        elif normalization == "unnormalized":
            q = math.exp(beta * lam * gamma) / n
        elif normalization == "relu":
            q = max(beta * lam * gamma, 0.0) / n
        else:
            raise ValueError(normalization)
        tot += om * lam * q
    return 2 * tot * (1 - gamma) * (1 + (n - 1) * gamma)


def oscillating_target_reference(t, d, h=0, H=1, per_head=False):
    """F(t) written out entry by entry from docs/model.md (independent of the library's term tables)."""
    tt = t + (2 * math.pi * h / H if per_head else 0.0)
    if d == 2:
        return np.array([[2 + 1.5 * math.cos(tt), math.sin(2 * tt)], [math.sin(2 * tt), 2 - 1.5 * math.cos(tt)]])
    if d == 3:
        return np.array([
            [2 + 1.5 * math.cos(tt), math.sin(2 * tt), math.sin(tt)],
            [math.sin(2 * tt), 2 + 1.5 * math.sin(tt), math.cos(2 * tt)],
            [math.sin(tt), math.cos(2 * tt), 2 + 1.5 * math.cos(tt + math.pi / 4)],
        ])
    F = np.zeros((d, d))
    P = d * (d - 1) // 2
    p = 0
    for i in range(d):
        F[i, i] = 2 + 1.5 * math.cos(tt + 2 * math.pi * i / d)
    for i in range(d):
        for j in range(i + 1, d):
            F[i, j] = F[j, i] = math.sin(2 * tt + 2 * math.pi * p / P)
            p += 1
    return F


def random_sphere(*shape, dtype=torch.float64, seed=0):
    """Tokens of the given shape (..., n, d), normalised float64 Gaussians cast to ``dtype`` (the same points
    in every dtype)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=-1).to(dtype)


def fit_slope(xs, ys):
    """Least-squares slope of log ys against log xs."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def tokens_and_heads(dtype=torch.float64, n=6, d=3, H=2, seed=0):
    """A small problem: n uniform tokens on S^{d-1} (generator seeded ``seed``) and H random heads
    (generator seeded ``seed + 1``), both in ``dtype``."""
    import transformer_pde as tp

    x0 = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    heads = tp.Heads.random(H, d, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return x0, heads


def tolerances(f64=None, f32=None, *, ulps=None):
    """The ``assert_close`` tolerances of a comparison, as a function ``tol(dtype, scale=1.0)`` that
    returns ``dict(rtol=..., atol=...)``: the (rtol, atol) pair ``f64`` for float64 and ``f32`` for
    float32, or ``rtol = atol = ulps · eps(dtype)``; both times ``scale`` (a comparison whose
    rounding grows, e.g. with the number of steps)."""
    if (ulps is None) == (f64 is None or f32 is None):
        raise ValueError("tolerances: give either the pairs f64 and f32 or ulps")

    def tol(dtype, scale=1.0):
        if ulps is not None:
            rtol = atol = ulps * torch.finfo(dtype).eps
        else:
            rtol, atol = f64 if dtype == torch.float64 else f32
        return dict(rtol=rtol * scale, atol=atol * scale)

    return tol


def assert_replayed(actual, expected, what: str = "", *, ulps: int = 16):
    """``actual`` is ``expected`` computed again by the same operations (a resumed checkpoint, a replayed
    path, an option that must not change the numbers): equal in shape and dtype, and in value to ``ulps``
    units of rounding of the dtype relative to the largest magnitude (a replay on another CPU or thread
    count may round a reduction differently; an error of the computation is many orders larger).
    Nested dicts (and lists) of tensors are compared entry by entry; other values must be equal."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}: keys differ {set(actual) ^ set(expected)}"
        for k in expected:
            if k != "timing":
                assert_replayed(actual[k], expected[k], f"{what}.{k}", ulps=ulps)
    elif isinstance(expected, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in expected):
        assert len(actual) == len(expected), f"{what}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_replayed(a, e, f"{what}[{i}]", ulps=ulps)
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
        if not expected.is_floating_point() and not expected.is_complex():
            assert bool((actual == expected).all()), what  # integers and flags: exact, no rounding to allow
            return
        scale = float(expected.detach().abs().max()) if expected.numel() else 1.0
        tol = ulps * torch.finfo(expected.dtype).eps
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-300), equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------- dense naive formulas
# Written from docs/model.md with explicit einsums over all pairs (i, j) and heads h: no log-sum-exp,
# no shared kernel pass, no library helper.  Shapes: x (..., n, d), A and V (..., H, d, d),
# omega (H,), w (..., n) token weights (sum 1), beta a float.  Symmetric tied heads unless V is given.

def random_weights(shape, seed, floor):
    """Non-uniform token weights, float64, summing to one along the last axis: U(0, 1) + floor
    (the floor keeps every weight away from zero), normalised; drawn from a generator seeded ``seed``."""
    w = torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + floor
    return w / w.sum(-1, keepdim=True)


def naive_kernel(x, A, beta):
    """K_hij = exp(β ⟨x_i, A_h x_j⟩), (..., H, n, n)."""
    return torch.exp(beta * torch.einsum("...id,...hde,...je->...hij", x, A, x))


def naive_energy(x, A, omega, beta, w):
    """E = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}, (...,)."""
    K = naive_kernel(x, A, beta)
    ww = w.unsqueeze(-1) * w.unsqueeze(-2)
    return (omega / (2 * beta) * (K * ww.unsqueeze(-3)).sum((-1, -2))).sum(-1)


def naive_field(x, A, omega, beta, w, *, normalization="softmax", sign=1.0, V=None):
    """V(x_i) = s P_{x_i} Σ_h ω_h f_h(x_i) (softmax / unnormalized) or the effective field
    s (Σ_h ω̄_h / m_h(x_i)) P_{x_i} Σ_h ω_h m_h A_h ȳ_h, with ω̄ = ω / Σω.  Returns (V, m (..., H, n))."""
    V = A if V is None else V
    K = naive_kernel(x, A, beta) * w.unsqueeze(-2).unsqueeze(-3)  # w_j K_hij
    m = K.sum(-1)
    ybar = torch.einsum("...hij,...jd->...hid", K, x) / m.unsqueeze(-1)
    if normalization == "softmax":
        f = torch.einsum("...hde,...hie->...hid", V, ybar)
    elif normalization == "unnormalized":
        f = m.unsqueeze(-1) * torch.einsum("...hde,...hie->...hid", V, ybar)
    elif normalization == "effective":
        binv = (omega / omega.sum()).unsqueeze(-1).div(m).sum(-2)  # (..., n)
        g = (omega.unsqueeze(-1).unsqueeze(-1) * m.unsqueeze(-1) * torch.einsum("...hde,...hie->...hid", A, ybar)).sum(-3)
        out = binv.unsqueeze(-1) * g
        return sign * (out - (out * x).sum(-1, keepdim=True) * x), m
    else:
        raise ValueError(normalization)
    out = (omega.unsqueeze(-1).unsqueeze(-1) * f).sum(-3)
    return sign * (out - (out * x).sum(-1, keepdim=True) * x), m


def naive_slope(x, A, omega, beta, w, **kw):
    """𝒢² = Σ_i w_i b(x_i) |V(x_i)|², b = (Σ_h ω̄_h / m_h)^{-1} the harmonic mean, ω̄ = ω/Σω."""
    Vf, m = naive_field(x, A, omega, beta, w, **kw)
    b = 1.0 / ((omega / omega.sum()).unsqueeze(-1) / m).sum(-2)
    return (w * b * Vf.square().sum(-1)).sum(-1)


def naive_dissipation(x, A, omega, beta, w, **kw):
    """𝒟 = Σ_i ⟨∂E/∂x_i, V(x_i)⟩ by autograd of the naive energy (for symmetric heads
    ∂E/∂x_i = w_i ∇δE/δμ(x_i), and V is tangent, so this is Σ_i w_i ⟨∇_S δE/δμ(x_i), V(x_i)⟩)."""
    xr = x.detach().clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(naive_energy(xr, A.detach(), omega, beta, w).sum(), xr)
    Vf, _ = naive_field(x, A, omega, beta, w, **kw)
    return (gx * Vf).sum((-1, -2))


def naive_grad_A(x, A, omega, beta, w):
    """∂E/∂A_h (..., H, d, d) by autograd of the naive energy."""
    Ar = A.detach().clone().requires_grad_(True)
    (gA,) = torch.autograd.grad(naive_energy(x.detach(), Ar, omega, beta, w).sum(), Ar)
    return gA


def naive_pairing(x, A, omega, beta, w, M):
    """⟨∂_A E, M⟩ = Σ_h Σ_ab (∂E/∂A_h)_ab M_h,ab, (...,)."""
    return (naive_grad_A(x, A, omega, beta, w) * M).sum((-1, -2, -3))


def naive_ito(x, A, omega, beta, w, sigma):
    """Itô correction ½ E[∂²_A E [σ dW_sym, σ dW_sym]] / dt.

    ∂²_A E [M, M] = Σ_h ω_h (β/2) Σ_ij w_i w_j e^{β⟨x_i,A_h x_j⟩} ⟨x_i, M_h x_j⟩², and for
    dW_sym = ½(dB + dBᵀ): E⟨x, dW_sym y⟩² = dt (|x|²|y|² + ⟨x, y⟩²)/2.  Hence
    Σ_h ω_h (β σ²/8) Σ_ij w_i w_j e^{β⟨x_i,A_h x_j⟩} (1 + ⟨x_i, x_j⟩²)."""
    K = naive_kernel(x, A, beta)
    c2 = torch.einsum("...id,...jd->...ij", x, x).square()
    ww = w.unsqueeze(-1) * w.unsqueeze(-2)
    return (omega * beta * sigma ** 2 / 8 * (K * (ww * (1 + c2)).unsqueeze(-3)).sum((-1, -2))).sum(-1)


def log_sinkhorn_ot(C, a, b, eps, iters=1000):
    """OT_ε = min ⟨π, C⟩ + ε KL(π | a⊗b) by plain log-domain Sinkhorn (float64); at the fixed
    point the value is ⟨a, f⟩ + ⟨b, g⟩."""
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    for _ in range(iters):
        f = -eps * torch.logsumexp(torch.log(b)[None, :] + (g[None, :] - C) / eps, 1)
        g = -eps * torch.logsumexp(torch.log(a)[:, None] + (f[:, None] - C) / eps, 0)
    return float((a * f).sum() + (b * g).sum())


class Interrupted(Exception):
    """Raised by :func:`interrupt_and_resume`'s callback to stop a run mid-way."""


def stop_at_step(k_stop):
    """A solver callback ``(k, t, x)`` that raises :class:`Interrupted` at step ``k_stop`` (a kill, as the
    checkpoint/resume tests need it)."""
    def stop(k, t, x):
        if k == k_stop:
            raise Interrupted
    return stop


def interrupt_and_resume(x0, theta, checkpoint, *, stop_at, checkpoint_every=5, **kw):
    """Run ``tp.simulate`` with checkpoints, stop it at step ``stop_at`` (an exception from the
    callback, as a kill would), then resume from the checkpoint; returns the resumed Trajectory."""
    import pytest
    import transformer_pde as tp

    with pytest.raises(Interrupted):
        tp.simulate(x0, theta, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                    callback=stop_at_step(stop_at), **kw)
    assert checkpoint.exists(), "the interrupted run left no checkpoint"
    return tp.simulate(x0, theta, checkpoint=checkpoint, checkpoint_every=checkpoint_every, **kw)


class DiagnosticsCounter:
    """Counts a solve's field evaluations with diagnostics (``evaluate(..., diagnostics=True)`` as the
    solvers' evaluator calls it): ``diagnostic_calls``; those that ask the kernel for the second moment:
    ``second_moment_calls``."""

    def __init__(self, monkeypatch):
        import transformer_pde.solvers.particle.evaluator as evaluator_module

        self.diagnostic_calls = self.second_moment_calls = 0
        real = evaluator_module.evaluate

        def counted(*args, **kwargs):
            if kwargs.get("diagnostics"):
                self.diagnostic_calls += 1
            if kwargs.get("second_moment"):
                self.second_moment_calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(evaluator_module, "evaluate", counted)

