"""Closed forms of Pendharkar's multi-head theory (2026, arXiv 2605.04279), docs/model.md#theory.

Everything here is a formula or the solution of a scalar ODE; :mod:`transformer_pde.analysis.diagnostics`
measures the same quantities on the full particle system, and the tests compare the two.

Conventions (Pendharkar's, unless a function says otherwise): H heads with symmetric score
matrices and tied values, here **scalar heads** A_h = V_h = λ_h I (``tp.Heads.scalar``) with
head weights ω_h = 1 (the sum convention, ``weights=torch.ones(H)``), inverse temperature β,
n tokens with uniform weights, direction "ascent" (ẋ = +P_x v: tokens cluster for λ_h > 0).
Equiangular tokens have ⟨x_i, x_j⟩ = γ for all i ≠ j; this set is invariant under the flow of
scalar heads, and γ(t) obeys a scalar ODE

    γ̇ = s · F(γ),   F(γ) = 2 (1 − γ)(1 + (n−1)γ) Σ_h λ_h k_h(γ)

with the off-diagonal attention weight of head h

    softmax:       k_h = 1 / (e^{βλ_h(1−γ)} + n − 1)           (per-head normalisation)
    unnormalized:  k_h = e^{βλ_h γ} / n                          (library's f_h = (1/n)Σ_j …)
    relu:          k_h = ReLU(βλ_h γ) / n.

Consequences (softmax, ascent): the early rate γ̇(0) = Σ_h φ(λ_h) with
φ(λ) = 2λ / (e^{λβ} + n − 1), maximised at λ* = (1 + W((n−1)/e))/β (W = Lambert W) where
φ(λ*) = 2 W((n−1)/e) / ((n−1)β); the late decay 1 − γ ~ C e^{−2Λt} with Λ = Σ_h λ_h.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_choice, check_int, check_positive
from ...model.normalization import choose as choose_normalization, names
from ...model.normalization import normalization as as_normalization
from ...model.scaling import real_beta, resolve_beta

__all__ = [
    "REDUCED_NORMALIZATIONS",
    "critical_cosine",
    "critical_beta",
    "equiangular_cosine",
    "early_rate",
    "lambert_w",
    "optimal_head_strength",
    "rate_inflection",
    "late_rate",
    "gamma_velocity",
    "gamma_ode",
    "hitting_time",
    "linearized_clustering_time",
    "typical_overlap",
    "superadditivity",
    "equiangular_entropy",
]

#: normalisations for which the equiangular reduction is implemented
REDUCED_NORMALIZATIONS = names(lambda n: n.reduced)  # the normalisations the reduced ODE covers

Number = Union[float, int]


# ---------------------------------------------------------------------------- input helpers
def _lambdas(lambdas, name: str = "lambdas") -> torch.Tensor:
    """(..., H) float tensor of head strengths (float64 for Python input)."""
    if isinstance(lambdas, torch.Tensor):
        lam = lambdas
        if not lam.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {lam.dtype}; use {name}.double()")
    else:
        if isinstance(lambdas, (int, float)) and not isinstance(lambdas, bool):
            lambdas = [lambdas]
        try:
            lam = torch.as_tensor(lambdas, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a sequence of numbers or a tensor (..., H), got {lambdas!r}") from None
    if lam.dim() == 0:
        lam = lam.reshape(1)
    if lam.shape[-1] < 1:
        raise ValueError(f"{name} must hold at least one head strength, got shape {tuple(lam.shape)}")
    if not bool(torch.isfinite(lam).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return lam


def _n(n) -> int:
    return check_int(n, "n", minimum=2)


def _gamma(gamma, n: int, name: str = "gamma") -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(gamma).__name__}")
    gamma = float(gamma)
    lo = -1.0 / (n - 1)
    if not (lo <= gamma < 1.0) or not math.isfinite(gamma):
        raise ValueError(f"{name} must lie in [-1/(n-1), 1) = [{lo:.4g}, 1) for n = {n}, got {gamma}")
    return gamma


def _beta(beta, n: int) -> float:
    """β as a float: any finite real; a rule of the context length (tp.LogScaling, ...) resolved at n."""
    b = real_beta(resolve_beta(beta, n), "beta")
    if isinstance(b, torch.Tensor):
        if b.numel() != 1:
            raise TypeError(f"beta must be one real number here, got a tensor of shape {tuple(b.shape)}")
        b = float(b)
    return b


def _positive_beta(beta, n: int, what: str) -> float:
    """:func:`_beta`, refused with a ValueError unless > 0 (``what``: why the closed form needs it)."""
    b = _beta(beta, n)
    if not b > 0:
        raise ValueError(f"beta must be > 0 here, got {b}: {what}")
    return b


def _sign(direction: str) -> float:
    check_choice(direction, ("ascent", "descent"), "direction")
    return 1.0 if direction == "ascent" else -1.0


# ---------------------------------------------------------------------------- radial dominance
def critical_cosine(H: int, *, form: str = "token") -> float:
    """Critical cosine of the angle between a token and its head output, for H equal heads.

    form="token" (Pendharkar's per-token margin ‖P_x f^h‖² − Σ_{k≠h} |a^k| ‖f^h‖ = ‖f‖²(1 − c² − (H−1)c)):
        c*(H) = (√((H−1)² + 4) − (H−1)) / 2,   the positive root of c² + (H−1)c − 1 = 0;
        c*(1) = 1, c*(2) = 1/golden ratio = 0.618…
    form="pairwise" (‖P_x f^h‖² − a^h Σ_{k≠h} a^k = ‖f‖²(1 − H c²)):  c = 1/√H.

    Returns
    -------
    float
        float in (0, 1].

    Raises
    ------
    TypeError, ValueError
        H not an int >= 1, unknown form.
    """
    H = check_int(H, "H", minimum=1)
    check_choice(form, ("token", "pairwise"), "form")
    if form == "pairwise":
        return 1.0 / math.sqrt(H)
    return (math.sqrt((H - 1) ** 2 + 4) - (H - 1)) / 2


def critical_beta(H: int, n: int, alpha: float = 1.0, *, gamma: float = 0.0, form: str = "token") -> float:
    """Critical inverse temperature β* of radial dominance, H equal scalar softmax heads αI.

    Tokens equiangular with overlap γ (γ = 0: orthogonal tokens, Pendharkar's regime), n tokens.
    The margin of every head and token is ≥ 0 for β ≤ β* and < 0 for β > β* (radial shadows
    dominate).  For γ = 0:

        β* = (1/(2α)) ln( c*(H)² (n−1) / (1 − c*(H)²) )          (c* from :func:`critical_cosine`)

    and for general γ (our extension: solve cos∠(x_i, f_i) = c* for r = e^{αβ(1−γ)}, a quadratic)

        β* = ln( −(n−1)γ + c* √((n−1)(1−γ)(1+(n−1)γ) / (1−c*²)) ) / (α(1−γ)).

    form="pairwise" uses c = 1/√H (then β* = (1/(2α)) ln((n−1)/(H−1)) at γ = 0).

    Returns
    -------
    float
        float; ``inf`` for H = 1 (one head is never radially dominated); a value ≤ 0 (or −inf)
        means the margin is negative for every β > 0 (e.g. n = 2, H ≥ 2).

    Raises
    ------
    TypeError, ValueError
        for H < 1, n < 2, α <= 0, γ outside [−1/(n−1), 1), unknown form.

    Examples
    --------
    >>> round(critical_beta(2, 10, 1.0), 6)   # ln(9 · 0.618…)/2
    0.858006
    """
    c = critical_cosine(H, form=form)
    n = _n(n)
    alpha = check_positive(alpha, "alpha")
    gamma = _gamma(gamma, n)
    if c >= 1.0:
        return math.inf
    N = n - 1
    r = -N * gamma + c * math.sqrt(N * (1 - gamma) * (1 + N * gamma) / (1 - c * c))
    if r <= 0:
        return -math.inf
    return math.log(r) / (alpha * (1 - gamma))


def equiangular_cosine(gamma, alpha, beta, n: int):
    """cos∠(x_i, f_i) for one scalar softmax head αI on equiangular tokens (overlap γ):

        r = e^{αβ(1−γ)},  cos² = (r + (n−1)γ)² / (r² + 2r(n−1)γ + (n−1)(1 + (n−2)γ)).

    Inputs broadcast (floats or tensors); returns the same kind.  Used to check the margins."""
    n = _n(n)
    N = n - 1
    as_t = any(isinstance(v, torch.Tensor) for v in (gamma, alpha, beta))
    g, a, b = (torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor) else v
               for v in (gamma, alpha, beta))
    r = torch.exp(a * b * (1 - g))
    num = r + N * g
    den = torch.sqrt(r * r + 2 * r * N * g + N * (1 + (N - 1) * g))
    out = num / den
    return out if as_t else float(out)


# ---------------------------------------------------------------------------- rates
def early_rate(lam, beta: float, n: int):
    """Early-time clustering rate of one scalar softmax head λI at orthogonal tokens:

        φ(λ) = 2λ / (e^{λβ} + n − 1)          (= γ̇(0) for H = 1; Σ_h φ(λ_h) for H heads)

    computed as 2λ e^{−logaddexp(λβ, ln(n−1))} (no overflow for large λβ).
    lam: float or tensor (any shape); returns the same kind (dtype/device follow lam).

    β: any real (β ≤ 0: e^{λβ} ≤ 1 and φ grows without bound in λ > 0), or a rule of n (``tp.LogScaling``).

    Raises
    ------
    ValueError
        β not finite or n < 2.
    """
    n = _n(n)
    beta = _beta(beta, n)
    is_t = isinstance(lam, torch.Tensor)
    x = lam if is_t else torch.tensor(float(lam), dtype=torch.float64)
    logN = torch.full_like(x, math.log(n - 1))
    out = 2 * x * torch.exp(-torch.logaddexp(x * beta, logN))
    return out if is_t else float(out)


def lambert_w(z, *, iterations: int = 40):
    """Principal branch W₀(z) of the Lambert W function (w e^w = z) for z ≥ 0, by Halley's method
    in torch (vectorised; dtype/device follow z).  scipy.special.lambertw is the independent
    check used in the tests.

    Raises ValueError for z < 0 (the branch point −1/e is not needed here)."""
    is_t = isinstance(z, torch.Tensor)
    zt = z if is_t else torch.tensor(float(z), dtype=torch.float64)
    if bool((zt < 0).any()) or not bool(torch.isfinite(zt).all()):
        raise ValueError("lambert_w is implemented for finite z >= 0 (principal branch)")
    w = torch.log1p(zt)  # within a factor ~2 of W for all z >= 0; Halley converges cubically
    for _ in range(iterations):
        ew = torch.exp(w)
        f = w * ew - zt
        wp1 = w + 1
        w = w - f / (ew * wp1 - (w + 2) * f / (2 * wp1))
    return w if is_t else float(w)


def optimal_head_strength(beta: float, n: int):
    """Maximiser of the early rate φ(λ) = 2λ/(e^{λβ} + n − 1) over λ > 0.

    φ'(λ) = 0 ⇔ e^{λβ}(λβ − 1) = n − 1 ⇔ λ* = (1 + W((n−1)/e)) / β, and φ(λ*) = 2W((n−1)/e)/((n−1)β)
    (W = principal Lambert W).

    Returns
    -------
    result
        (λ*, φ(λ*)) as floats.

    Raises
    ------
    ValueError
        β <= 0 (φ then increases without bound: no maximiser) or n < 2.

    Examples
    --------
    >>> lam, phi = optimal_head_strength(1.0, 8)
    >>> round(lam, 4), round(phi, 4), round(early_rate(lam, 1.0, 8), 4)
    (1.9731, 0.278, 0.278)
    """
    n = _n(n)
    beta = _positive_beta(beta, n, "for β ≤ 0, φ(λ) = 2λ/(e^{λβ} + n − 1) ≥ 2λ/n increases without bound, so "
                                   "there is no optimal head strength")
    W = lambert_w((n - 1) / math.e)
    return (1 + W) / beta, 2 * W / ((n - 1) * beta)


def rate_inflection(beta: float, n: int) -> float:
    """Inflection point λ_c of φ: φ is concave on (0, λ_c) and convex on (λ_c, ∞).

    With u = βλ, φ''(λ) ∝ e^u [(u − 2)e^u − (n−1)(u + 2)], so u_c > 2 is the root of
    ln(u − 2) − ln(u + 2) + u − ln(n − 1) = 0 (increasing in u; solved by bisection), λ_c = u_c/β.

    Returns
    -------
    float
        λ_c (float).

    Raises
    ------
    ValueError
        β <= 0 (the bisection above u = 2 is the β > 0 branch) or n < 2.
    """
    n = _n(n)
    beta = _positive_beta(beta, n, "the inflection point is computed on the branch u = βλ > 2 of β > 0 (for β < 0 "
                                   "the convex and concave ranges of φ swap)")
    logN = math.log(n - 1)

    def h(u):
        return math.log(u - 2) - math.log(u + 2) + u - logN

    lo, hi = 2.0, max(4.0, logN + 10.0)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid == lo or mid == hi:
            break
        if mid <= 2.0 or h(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi) / beta


def late_rate(lambdas, beta: float = 1.0, *, normalization: str = "softmax"):
    """Late-time rate Λ of 1 − γ(t) ~ C e^{−2Λt} (equiangular scalar heads, ascent, λ_h > 0):

        softmax:       Λ = Σ_h λ_h
        unnormalized:  Λ = Σ_h λ_h e^{βλ_h}
        relu:          Λ = Σ_h λ_h ReLU(βλ_h)            (= β Σ_h λ_h² for β > 0)

    (linearise γ̇ = F(γ) at γ = 1: F(γ) ≈ 2Λ(1 − γ)); any real β.  lambdas: (..., H); returns (...,) tensor.

    Raises
    ------
    TypeError, ValueError
        non-numeric or non-finite lambdas or β, unknown normalization.
    """
    normalization = choose_normalization(normalization, REDUCED_NORMALIZATIONS)
    beta = _beta(beta, 2)
    lam = _lambdas(lambdas)
    if normalization.plain_softmax:
        return lam.sum(-1)
    if normalization.rule == "unnormalized":
        return (lam * torch.exp(beta * lam)).sum(-1)
    return (lam * torch.relu(beta * lam)).sum(-1)


def _kernel_weights(gamma: torch.Tensor, lam: torch.Tensor, beta: float, n: int, normalization: str):
    """k_h(γ), (..., H) broadcast with γ (...,)."""
    g = gamma.unsqueeze(-1)
    normalization = as_normalization(normalization)
    if normalization.plain_softmax:
        a = beta * lam * (1 - g)
        return torch.exp(-torch.logaddexp(a, torch.full_like(a, math.log(n - 1))))
    if normalization.rule == "unnormalized":
        return torch.exp(beta * lam * g) / n
    return torch.relu(beta * lam * g) / n


def gamma_velocity(gamma, lambdas, *, beta: float = 1.0, n: int, normalization: str = "softmax",
                   direction: str = DEFAULT_DIRECTION):
    """Reduced vector field of equiangular tokens, γ̇ = s · 2(1 − γ)(1 + (n−1)γ) Σ_h λ_h k_h(γ)
    (module docstring; k_h depends on the normalisation).  Scalar heads λ_h I, ω_h = 1.

    gamma: float or tensor (...,); lambdas: (H,) or (..., H).  Returns (...,) (a float for float γ
    and 1-D lambdas).

    β: any real, or a rule of n (``tp.LogScaling``).

    Raises
    ------
    TypeError, ValueError
        bad lambdas or β, n < 2, unknown normalization or direction.
    """
    normalization = choose_normalization(normalization, REDUCED_NORMALIZATIONS)
    s = _sign(direction)
    n = _n(n)
    beta = _beta(beta, n)
    lam = _lambdas(lambdas)
    is_t = isinstance(gamma, torch.Tensor)
    g = gamma if is_t else torch.tensor(float(gamma), dtype=lam.dtype, device=lam.device)
    out = _reduced_field(g, lam, beta, n, normalization, s)
    return out if (is_t or out.dim() > 0) else float(out)


def _reduced_field(g, lam, beta, n, normalization, s):
    k = _kernel_weights(g, lam, beta, n, normalization)
    return s * 2 * (1 - g) * (1 + (n - 1) * g) * (lam * k).sum(-1)


def gamma_ode(times, lambdas, *, beta: float = 1.0, n: int, gamma0: float, normalization: str = "softmax",
              direction: str = DEFAULT_DIRECTION, rtol: float = 1e-11, atol: float = 1e-13):
    """Solve the equiangular reduced ODE γ̇ = s F(γ) (see :func:`gamma_velocity`) at ``times``.

    Integrated in ℓ = ln(1 − γ), ℓ̇ = −s F(γ)/(1 − γ) (the factor 1 − γ cancels), with torchdiffeq's
    dopri5, so that 1 − γ stays accurate down to e^{−700} (late-rate fits).

    Parameters
    ----------
    times
        (T,) increasing tensor or sequence, times[0] = initial time.
    lambdas
        (H,) head strengths.  gamma0: initial overlap in [−1/(n−1), 1).

    Returns
    -------
    result
        (gamma (T,), gap (T,)) with gap = 1 − γ; dtype/device follow ``times`` when it is a tensor
        (float64 otherwise).

    Raises
    ------
    TypeError, ValueError
        bad lambdas (or more than one set), γ0 outside [−1/(n−1), 1),
        times not 1-D increasing, β not finite, unknown normalization or direction.

    Examples
    --------
    >>> g, gap = gamma_ode([0.0, 1.0, 2.0], [0.5, 1.5], n=8, gamma0=0.0)
    >>> [round(v, 4) for v in g.tolist()]
    [0.0, 0.7881, 0.9951]
    """
    from torchdiffeq import odeint

    normalization = choose_normalization(normalization, REDUCED_NORMALIZATIONS)
    s = _sign(direction)
    n = _n(n)
    beta = _beta(beta, n)
    gamma0 = _gamma(gamma0, n, "gamma0")
    lam = _lambdas(lambdas)
    if lam.dim() != 1:
        raise ValueError(f"gamma_ode takes one set of head strengths (H,), got shape {tuple(lam.shape)}")
    t = times if isinstance(times, torch.Tensor) else torch.as_tensor(times, dtype=torch.float64)
    if t.dim() != 1 or len(t) < 1 or not t.is_floating_point():
        raise ValueError("times must be a 1-D float sequence of at least one time")
    if len(t) > 1 and not bool((t[1:] > t[:-1]).all()):
        raise ValueError("times must be strictly increasing")
    lam = lam.to(dtype=t.dtype, device=t.device)
    N = n - 1

    def rhs(_t, ell):
        g = -torch.expm1(ell)
        k = _kernel_weights(g, lam, beta, n, normalization)
        return -s * 2 * (1 + N * g) * (lam * k).sum(-1)

    ell0 = torch.tensor(math.log1p(-gamma0), dtype=t.dtype, device=t.device)
    ell = odeint(rhs, ell0, t, method="dopri5", rtol=rtol, atol=atol)
    return -torch.expm1(ell), torch.exp(ell)


def _time_args(lambdas, beta, n, gamma0, target, normalization):
    """Checked (λ, β, n, γ0, target) of the clustering-time functions."""
    normalization = choose_normalization(normalization, REDUCED_NORMALIZATIONS)
    n = _n(n)
    beta = _beta(beta, n)
    gamma0 = _gamma(gamma0, n, "gamma0")
    target = _gamma(target, n, "target")
    if not target > gamma0:
        raise ValueError(f"target must be larger than gamma0 (got gamma0 = {gamma0}, target = {target})")
    return _lambdas(lambdas).to(torch.float64), beta, n, gamma0, target


def hitting_time(lambdas, *, beta: float = 1.0, n: int, gamma0: float, target: float,
                 normalization: str = "softmax") -> float:
    """Time for the reduced ODE (ascent) to take γ from γ0 to ``target``:

        T = ∫_{γ0}^{target} dγ / F(γ)

    by adaptive quadrature (scipy.integrate.quad; in ln γ when γ0 > 0, which makes the
    1/γ-type integrand of ReLU heads smooth).  Returns ``inf`` when F ≤ 0 somewhere on the
    interval (the target is never reached).

    Raises
    ------
    ValueError
        target <= γ0, either outside [−1/(n−1), 1), bad lambdas, β not finite, unknown normalization.
    """
    from scipy.integrate import quad

    lam, beta, n, gamma0, target = _time_args(lambdas, beta, n, gamma0, target, normalization)
    if lam.dim() != 1:
        raise ValueError(f"hitting_time takes one set of head strengths (H,), got shape {tuple(lam.shape)}")

    def F(g):
        return float(_reduced_field(torch.tensor(g, dtype=torch.float64), lam, beta, n, normalization, 1.0))

    grid = torch.linspace(gamma0, target, 257, dtype=torch.float64)
    if bool((_reduced_field(grid, lam, beta, n, normalization, 1.0) <= 0).any()):
        return math.inf
    if gamma0 > 0:
        val, _ = quad(lambda u: math.exp(u) / F(math.exp(u)), math.log(gamma0), math.log(target),
                      epsabs=0.0, epsrel=1e-11, limit=400)
    else:
        val, _ = quad(lambda g: 1.0 / F(g), gamma0, target, epsabs=0.0, epsrel=1e-11, limit=400)
    return float(val)


def linearized_clustering_time(lambdas, *, beta: float = 1.0, n: int, gamma0: float, target: float,
                               normalization: str = "softmax") -> float:
    """Clustering time of the reduced ODE linearised at γ = 0 (its leading Taylor term):

        softmax:       γ̇ ≈ F(0) = Σ_h φ(λ_h)                 ⇒ T = (target − γ0) / Σ_h φ(λ_h)       = Θ(n)
        unnormalized:  γ̇ ≈ F(0) = (2/n) Σ_h λ_h                ⇒ T = (target − γ0) n / (2 Σ_h λ_h)     = Θ(n)
        relu:          F(0) = 0, γ̇ ≈ F'(0⁺) γ = (2/n) Σ_h λ_h ReLU(βλ_h) γ
                                                              ⇒ T = n ln(target/γ0) / (2 Σ λ_h ReLU(βλ_h))

    for γ0 = 1/√d (:func:`typical_overlap`).  This is Pendharkar's separation; the full nonlinear
    reduced ODE (:func:`hitting_time`) and the particle system depart from it once (n−1)γ is not
    small (see the README).  Returns ``inf`` when the leading rate is ≤ 0.

    Raises
    ------
    ValueError
        target <= γ0, γ0 <= 0 for relu (γ = 0 is a fixed point), bad lambdas, β not finite.
    """
    lam, beta, n, gamma0, target = _time_args(lambdas, beta, n, gamma0, target, normalization)
    if as_normalization(normalization).statistics == "softmax":  # exponential kernels: F(0) > 0
        F0 = float(_reduced_field(torch.tensor(0.0, dtype=torch.float64), lam, beta, n, normalization, 1.0).sum())
        return (target - gamma0) / F0 if F0 > 0 else math.inf
    if gamma0 <= 0:
        raise ValueError("the linearised ReLU dynamics start at gamma0 > 0 (γ = 0 is a fixed point)")
    slope = 2 / n * float((lam * torch.relu(beta * lam)).sum())
    return math.log(target / gamma0) / slope if slope > 0 else math.inf


def typical_overlap(d: int) -> float:
    """1/√d: the root-mean-square overlap ⟨x, y⟩ of two independent uniform points of S^{d-1}
    (E⟨x, y⟩² = 1/d), the initial γ0 of random tokens in the ReLU clustering time."""
    d = check_int(d, "d", minimum=2)
    return 1.0 / math.sqrt(d)


def superadditivity(lambdas, *, beta: float = 1.0, n: int) -> dict:
    """Early rates of heterogeneous heads against equal heads and one merged head (softmax, γ = 0):

        heterogeneous = Σ_h φ(λ_h),  equal = H φ(Λ/H),  merged = φ(Λ),  Λ = Σ_h λ_h
        gain = heterogeneous − equal   (> 0 when all λ_h lie where φ is convex, λ_h > λ_c;
                                        < 0 when all lie where it is concave, λ_h < λ_c — Jensen)
        split_gain = heterogeneous − merged

    The late rate Λ is the same for all three (:func:`late_rate`).

    Returns
    -------
    dict
        dict of floats (lambdas 1-D) with "regime" ∈ {"convex", "concave", "mixed"} and "inflection" λ_c.

    Raises
    ------
    ValueError
        lambdas not one 1-D set, β <= 0 (the regimes are those of φ for β > 0), n < 2.
    """
    n = _n(n)
    beta = _positive_beta(beta, n, "the convex and concave regimes of φ are those of β > 0 (rate_inflection)")
    lam = _lambdas(lambdas).to(torch.float64)
    if lam.dim() != 1:
        raise ValueError(f"superadditivity takes one set of head strengths (H,), got shape {tuple(lam.shape)}")
    H = lam.shape[-1]
    Lam = float(lam.sum())
    het = float(early_rate(lam, beta, n).sum())
    eq = H * early_rate(Lam / H, beta, n)
    merged = early_rate(Lam, beta, n)
    lc = rate_inflection(beta, n)
    regime = "convex" if bool((lam >= lc).all()) else ("concave" if bool((lam <= lc).all()) else "mixed")
    return {"heterogeneous": het, "equal": eq, "merged": merged, "gain": het - eq, "split_gain": het - merged,
            "total": Lam, "inflection": lc, "regime": regime}


def equiangular_entropy(gamma, lam, beta: float, n: int):
    """Attention entropy of one scalar softmax head λI on equiangular tokens (overlap γ):

        ρ = e^{βλ(1−γ)},  H(γ) = ln(ρ + n − 1) − ρ ln ρ / (ρ + n − 1),

    increasing in γ for λ > 0 (dH/dρ = −(n−1) ln ρ/(ρ + n − 1)²), with H(1) = ln n.
    Inputs broadcast (floats or tensors); returns the same kind.  Any real β (β < 0: ρ < 1 for λ > 0)."""
    n = _n(n)
    beta = _beta(beta, n)
    as_t = isinstance(gamma, torch.Tensor) or isinstance(lam, torch.Tensor)
    g = gamma if isinstance(gamma, torch.Tensor) else torch.tensor(float(gamma), dtype=torch.float64)
    la = lam if isinstance(lam, torch.Tensor) else torch.tensor(float(lam), dtype=g.dtype, device=g.device)
    logrho = beta * la * (1 - g)
    logden = torch.logaddexp(logrho, torch.full_like(logrho, math.log(n - 1)))
    out = logden - logrho * torch.exp(logrho - logden)
    return out if as_t else float(out)


# the stability theorems' constants (docs/theorems.md): Lipschitz bounds, Grönwall factor, fast-weights limit
from .stability import (
    LIPSCHITZ_NORMALIZATIONS, fast_weights_coefficients, gronwall_factor, lipschitz_bound, lipschitz_constants,
)

__all__ += ["LIPSCHITZ_NORMALIZATIONS", "lipschitz_constants", "lipschitz_bound", "gronwall_factor",
            "fast_weights_coefficients"]

from . import noise  # noqa: E402  (the noisy-token stability theory: docs/noisy_tokens.md)
from .noise import critical_temperature, first_order_beta, mode_growth_rates, most_unstable_mode, susceptibility

__all__ += ["noise", "critical_temperature", "mode_growth_rates", "most_unstable_mode", "susceptibility",
            "first_order_beta"]

# worst-case flow sensitivity and trajectory bounds (docs/theorems.md); stationary mean-field branches
from .sensitivity import duhamel_bound, field_jacobian_rates, flow_sensitivity, tangent_frames  # noqa: E402
from . import continuation  # noqa: E402  (docs/noisy_tokens.md: stationary Fokker–Planck branches)

__all__ += ["flow_sensitivity", "field_jacobian_rates", "duhamel_bound", "tangent_frames", "continuation"]

# the kinetic theory of causal attention with positional decay: the lost-in-the-middle profile
# (docs/lost_in_the_middle.md)
from . import kinetic  # noqa: E402
from .kinetic import critical_time, mixture_profile, retrieval_profile, right_end_slope  # noqa: E402

__all__ += ["kinetic", "retrieval_profile", "mixture_profile", "right_end_slope", "critical_time"]
from . import homogenized  # noqa: E402  (random layers' common-noise limit: docs/homogenized.md)
from .homogenized import homogenized_coefficients, homogenized_sde  # noqa: E402

__all__ += ["homogenized", "homogenized_coefficients", "homogenized_sde"]
