"""Linear stability of the uniform measure for noisy tokens (docs/noisy_tokens.md).

Model: isotropic heads A_h = V_h = λ_h I (``tp.Heads.scalar``), head weights ω_h (default 1/H),
inverse temperature β, direction sign s (+1 "ascent", −1 "descent"), temperature T ≥ 0:

    ∂_t ρ = −div_S(ρ V[ρ]) + T Δ_S ρ        on S^{d−1},  d ≥ 2.

**Funk–Hecke.**  For a zonal kernel K(⟨x, y⟩) and a spherical harmonic Y_ℓ of degree ℓ,
∫ K(⟨x,y⟩) Y_ℓ(y) dσ(y) = κ_ℓ[K] Y_ℓ(x) (σ the normalised surface measure).  For the attention
kernel K(t) = e^{a t}, a = βλ_h,

    κ_ℓ(a) = Γ(d/2) (2/a)^{d/2−1} I_{ℓ+d/2−1}(a),      κ_ℓ(−a) = (−1)^ℓ κ_ℓ(a),

(I_ν the modified Bessel function; d = 2 gives I_ℓ(a), d = 3 the modified spherical Bessel
i_ℓ(a)).  The ratio κ_1/κ_0 = I_{d/2}(a)/I_{d/2−1}(a) = A_d(a) is the mean resultant length of
the von Mises–Fisher law on S^{d−1} with concentration a.

**Linearisation.**  With Φ_h(x) = ∫ e^{a_h⟨x,y⟩} dρ(y) the per-head partition function,
P_x f_h = (1/β) ∇_S log Φ_h (softmax) or (1/β) ∇_S Φ_h (unnormalised); the uniform measure is
stationary (Φ_h is constant on the sphere).  A perturbation ρ = 1 + ε Y_ℓ gives δΦ_h = ε κ_ℓ Y_ℓ,
and since Δ_S Y_ℓ = −ℓ(ℓ+d−2) Y_ℓ, every mode grows or decays on its own at the rate

    r_ℓ = ℓ(ℓ+d−2) (s c_ℓ − T),
    c_ℓ = Σ_h ω_h κ_ℓ(a_h) / (β κ_0(a_h))                 softmax
    c_ℓ = Σ_h ω_h κ_ℓ(a_h) / β                            unnormalised
    c_ℓ = (Σ_k ω̄_k / κ_0(a_k)) Σ_h ω_h κ_ℓ(a_h) / β      effective (ω̄ = ω/Σω)

The uniform measure is linearly stable iff T > T_c = max(0, max_{ℓ≥1} s c_ℓ); for λ_h > 0 the
coefficients decrease in ℓ, so the mode that goes unstable first is ℓ = 1 and, for softmax,
T_c = Σ_h ω_h A_d(βλ_h)/β (→ Σ_h ω_h λ_h / d as β → 0: the noisy Kuramoto threshold on S¹).
Everything here holds for any real β (β < 0: κ_ℓ(−a) = (−1)^ℓ κ_ℓ(a), so c_1 > 0 still and the
even modes are damped; β = 0 is the limit, taken exactly); :func:`landau_coefficient` needs β > 0.
At T = 0 the fastest mode argmax_ℓ ℓ(ℓ+d−2) c_ℓ is the number of metastable clusters that form
from a near-uniform start (Bruno–Pasqualotto–Agazzi 2025: 3 at β = 5, 4 at β = 7 on S¹).

**Order parameter.**  m = (1/N) Σ_i x_i is the ℓ = 1 projection of the empirical measure.  Near
the uniform state dm = −(d−1)(T − s c_1) m dt + √(2T(d−1)/(dN)) dW, so for T > s c_1

    N · E|m|² → T / (T − s c_1)          (N → ∞; = 1 for independent tokens).

**Time-dependent β_t.**  The modes are eigenfunctions for every β, so a mode amplitude obeys
a' = r_ℓ(β_t) a: its stability is decided by the time average ⟨r_ℓ⟩ (an OU β_t: the average
under its stationary Gaussian law, by ergodicity).

**First-order transitions** (unnormalised heads, a W2 gradient flow of F = −E + T∫ρ log ρ):
a Landau expansion of the self-consistency ρ ∝ e^{δE/δμ / T} at T_c = c_1 gives, along the
bifurcating branch, 1/T = (1/T_c)(1 + δ₂ ε² + …) with

    δ₂ = (1 − (d−1) r/(1 − r)) / (d(d+2)),     r = c_2/c_1 = I_{d/2+1}(β)/I_{d/2}(β),

so the branch bends back (subcritical, first order, hysteresis) iff r > 1/d, i.e. β above the
root of I_{d/2+1}(β)/I_{d/2}(β) = 1/d (Mun–Rosenzweig 2026): :func:`first_order_beta`.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_int, check_positive, check_real, direction_sign
from ...model.normalization import choose as choose_normalization, names

__all__ = [
    "NOISE_NORMALIZATIONS",
    "funk_hecke_exponential",
    "mode_coefficients",
    "mode_growth_rates",
    "most_unstable_mode",
    "critical_temperature",
    "critical_mode",
    "susceptibility",
    "averaged_growth_rate",
    "ou_averaged_growth_rate",
    "oscillating_averaged_growth_rate",
    "first_order_beta",
    "landau_coefficient",
]

#: normalisations with a closed-form linearisation around the uniform measure
NOISE_NORMALIZATIONS = names(lambda n: n.statistics == "softmax")  # the exponential kernels


def _dim(d) -> int:
    return check_int(d, "d", minimum=2)


def _heads(lambdas, weights):
    """(λ (H,), ω (H,)) as float64 numpy arrays; ω = 1/H by default (as tp.Heads)."""
    if isinstance(lambdas, torch.Tensor):
        lam = lambdas.detach().cpu().double().numpy().reshape(-1)
    else:
        if isinstance(lambdas, (int, float)) and not isinstance(lambdas, bool):
            lambdas = [lambdas]
        try:
            lam = np.asarray(lambdas, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise TypeError(f"lambdas must be a number, a sequence of numbers or a tensor (H,), got {lambdas!r}") from None
    if lam.size < 1 or not np.isfinite(lam).all():
        raise ValueError(f"lambdas must hold at least one finite head strength, got {lam.tolist()}")
    if weights is None:
        w = np.full(lam.shape, 1.0 / lam.size)
    else:
        if isinstance(weights, torch.Tensor):
            weights = weights.detach().cpu().double().numpy()
        try:
            w = np.asarray(weights, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise TypeError(f"weights must be a sequence of numbers or a tensor (H,), got {weights!r}") from None
        if w.shape != lam.shape:
            raise ValueError(f"weights must have one entry per head ({lam.size}), got shape {w.shape}")
        if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all zero, got {w.tolist()}")
    return lam, w


def _log_kappa(a: np.ndarray, ell: np.ndarray, d: int):
    """log|κ_ℓ(a)| and sign, for a ≠ 0 (broadcast over a and ℓ)."""
    from scipy.special import gammaln, ive  # scipy on first use: `import transformer_pde` stays light
    nu0 = d / 2 - 1
    aa = np.abs(a)
    with np.errstate(divide="ignore"):
        logk = gammaln(d / 2) + nu0 * np.log(2 / aa) + np.log(ive(ell + nu0, aa)) + aa
    sign = np.where((a < 0) & (ell % 2 == 1), -1.0, 1.0)
    return logk, sign


def funk_hecke_exponential(a, d: int, ell) -> np.ndarray:
    """κ_ℓ(a) = Γ(d/2)(2/a)^{d/2−1} I_{ℓ+d/2−1}(a): the Funk–Hecke coefficient of t ↦ e^{a t} on
    S^{d−1} (w.r.t. the normalised surface measure); a and ℓ broadcast (numpy float64).
    At a = 0: 1 for ℓ = 0 and 0 otherwise.  May overflow to inf for |a| ≳ 700."""
    d = _dim(d)
    a = np.asarray(a, dtype=np.float64)
    ell = np.asarray(ell, dtype=np.int64)
    a, ell = np.broadcast_arrays(a, ell)
    out = np.where(ell == 0, 1.0, 0.0).astype(np.float64)
    nz = a != 0
    if nz.any():
        logk, sign = _log_kappa(a[nz], ell[nz], d)
        with np.errstate(over="ignore"):
            out[nz] = sign * np.exp(logk)
    return out


def _ratio(a: np.ndarray, ell: np.ndarray, d: int) -> np.ndarray:
    """κ_ℓ(a)/(a κ_0(a)) (finite at a = 0), broadcast."""
    from scipy.special import ive  # scipy on first use: `import transformer_pde` stays light
    nu0 = d / 2 - 1
    a, ell = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(ell, dtype=np.int64))
    aa = np.abs(a)
    out = np.empty(a.shape)
    small = aa < 1e-8
    # series: κ_ℓ(a)/κ_0(a) ≈ Γ(d/2) (a/2)^ℓ / Γ(ℓ + d/2)
    ls = ell[small]
    out[small] = np.where(ls == 0, 1.0 / np.where(a[small] == 0, np.inf, a[small]), 0.0)
    out[small & (ell == 1)] = 1.0 / d
    big = ~small
    if big.any():
        ab, lb = aa[big], ell[big]
        r = ive(lb + nu0, ab) / ive(nu0, ab)
        sign = np.where((a[big] < 0) & (lb % 2 == 1), -1.0, 1.0)
        out[big] = sign * r / a[big]
    return out


def mode_coefficients(beta, d: int, ell, *, lambdas=(1.0,), weights=None, normalization: str = "softmax"):
    """c_ℓ of the module docstring (float64 numpy array, shape of ``ell``): the rate r_ℓ is
    ℓ(ℓ+d−2)(s c_ℓ − T).  ``beta`` is any real number (a negative β too, e.g. for the time averages of a
    β_t that changes sign; at β = 0 the limit, c_ℓ = Σ_h ω_h λ_h/d for ℓ = 1 and 0 for ℓ ≥ 2)."""
    d = _dim(d)
    beta = check_real(beta, "beta")
    normalization = choose_normalization(normalization, NOISE_NORMALIZATIONS)
    lam, w = _heads(lambdas, weights)
    ell = np.asarray(ell, dtype=np.int64)
    if (ell < 0).any():
        raise ValueError(f"ell must be >= 0, got {ell.tolist()}")
    a = beta * lam  # (H,)
    L = ell[..., None]
    if normalization.plain_softmax:
        # κ_ℓ/(β κ_0) = λ · κ_ℓ/(a κ_0)
        return (w * lam * _ratio(a, L, d)).sum(-1)
    if beta == 0:  # the limit β → 0: κ_ℓ(a)/β = λ κ_0(a) · κ_ℓ(a)/(a κ_0(a)), κ_0(0) = 1
        limit = (w * lam * _ratio(a, L, d)).sum(-1)
        return limit if normalization.rule == "unnormalized" else (w / w.sum()).sum() * limit
    kl = funk_hecke_exponential(a, d, L)
    if normalization.rule == "unnormalized":
        return (w * kl).sum(-1) / beta
    k0 = funk_hecke_exponential(a, d, 0)
    wbar = w / w.sum()
    return (wbar / k0).sum() * (w * kl).sum(-1) / beta


def mode_growth_rates(beta, d: int, T: float = 0.0, ell_max: int = 8, *, lambdas=(1.0,), weights=None,
                      normalization: str = "softmax", direction: str = DEFAULT_DIRECTION) -> torch.Tensor:
    """Growth rates r_ℓ = ℓ(ℓ+d−2)(s c_ℓ − T) of the spherical-harmonic modes ℓ = 0, …, ell_max of a
    perturbation of the uniform measure (module docstring); a float64 tensor (ell_max + 1,) indexed
    by ℓ (r_0 = 0: mass is conserved).  Positive = unstable.

    >>> r = mode_growth_rates(5.0, 2, 0.0, 8)
    >>> int(r.argmax())
    3
    """
    d = _dim(d)
    beta = check_real(beta, "beta")
    T = check_positive(T, "T", allow_zero=True)
    ell_max = check_int(ell_max, "ell_max", minimum=1)
    if ell_max > 10**6:  # checked before allocating: the coefficients hold several float64 arrays of ell_max + 1
        raise ValueError(f"ell_max = {ell_max} would allocate about {8 * 4 * (ell_max + 1) / 2**30:.3g} GiB; the "
                         f"rates beyond ℓ of order β·max|λ| are ≈ −T·ℓ(ℓ+d−2) (c_ℓ decays faster than any power): "
                         f"give ell_max <= 1000000")
    s = direction_sign(direction)
    ell = np.arange(ell_max + 1)
    c = mode_coefficients(beta, d, ell, lambdas=lambdas, weights=weights, normalization=normalization)
    r = ell * (ell + d - 2) * (s * c - T)
    return torch.as_tensor(r, dtype=torch.float64)


def _default_ell_max(beta: float, lambdas) -> int:
    lam, _ = _heads(lambdas, None)
    return int(max(16, 4 * math.ceil(math.sqrt(abs(beta) * float(np.abs(lam).max()) + 1)) + 8))


def most_unstable_mode(beta, d: int, T: float = 0.0, *, lambdas=(1.0,), weights=None, normalization: str = "softmax",
                       direction: str = DEFAULT_DIRECTION, ell_max: Optional[int] = None) -> int:
    """argmax_{ℓ ≥ 1} r_ℓ: the fastest-growing mode of the uniform measure (at T = 0 the number of
    metastable clusters a near-uniform start forms on S¹); 0 when no mode grows (r_ℓ ≤ 0 for all ℓ).

    >>> most_unstable_mode(5.0, 2), most_unstable_mode(7.0, 2)
    (3, 4)
    """
    if ell_max is None:
        ell_max = _default_ell_max(check_real(beta, "beta"), lambdas)
    r = mode_growth_rates(beta, d, T, ell_max, lambdas=lambdas, weights=weights, normalization=normalization,
                          direction=direction)
    k = int(r[1:].argmax()) + 1
    return k if float(r[k]) > 0 else 0


def critical_mode(beta, d: int, *, lambdas=(1.0,), weights=None, normalization: str = "softmax",
                  direction: str = DEFAULT_DIRECTION, ell_max: Optional[int] = None) -> int:
    """The mode that loses stability first as T decreases through T_c: argmax_{ℓ≥1} s c_ℓ."""
    if ell_max is None:
        ell_max = _default_ell_max(check_real(beta, "beta"), lambdas)
    ell = np.arange(1, check_int(ell_max, "ell_max") + 1)
    c = direction_sign(direction) * mode_coefficients(check_real(beta, "beta"), d, ell, lambdas=lambdas,
                                                      weights=weights, normalization=normalization)
    return int(ell[np.argmax(c)])


def critical_temperature(beta, d: int, lambdas=(1.0,), weights=None, normalization: str = "softmax", *,
                         direction: str = DEFAULT_DIRECTION, ell_max: Optional[int] = None) -> float:
    """T_c = max(0, max_{ℓ≥1} s c_ℓ): the temperature below which the uniform measure on S^{d−1} is
    linearly unstable, for isotropic heads A_h = V_h = λ_h I with head weights ω_h (default 1/H).

    softmax (λ_h > 0, ascent): T_c = Σ_h ω_h A_d(βλ_h)/β with A_d(a) = I_{d/2}(a)/I_{d/2−1}(a) the
    von Mises–Fisher mean resultant length; unnormalised: T_c = Σ_h ω_h Γ(d/2)(2/(βλ_h))^{d/2−1}
    I_{d/2}(βλ_h)/β.  Derivation: module docstring and docs/noisy_tokens.md.

    Parameters
    ----------
    beta
        inverse temperature of the attention, any real (β < 0: T_c = Σ_h ω_h A_d(|β|λ_h)/|β| for softmax).
    d : int
        ambient dimension (tokens on S^{d−1}), ≥ 2.
    lambdas
        head strengths λ_h (sequence or tensor (H,)).
    weights
        head weights ω_h (H,), None = 1/H.
    normalization : str
        "softmax" | "unnormalized" | "effective".
    direction : str
        "ascent" (tokens attract for λ > 0) or "descent" (then T_c = 0 for λ > 0).
    ell_max : Optional[int]
        modes searched (default grows like √(β max|λ|)).

    >>> round(critical_temperature(1e-9, 2), 6)   # small β: the noisy Kuramoto threshold λ/d
    0.5
    """
    beta = check_real(beta, "beta")
    d = _dim(d)
    if ell_max is None:
        ell_max = _default_ell_max(beta, lambdas)
    ell = np.arange(1, check_int(ell_max, "ell_max") + 1)
    c = direction_sign(direction) * mode_coefficients(beta, d, ell, lambdas=lambdas, weights=weights,
                                                      normalization=normalization)
    return float(max(0.0, c.max()))


def susceptibility(beta, d: int, T: float, *, lambdas=(1.0,), weights=None, normalization: str = "softmax",
                   direction: str = DEFAULT_DIRECTION) -> float:
    """N·E|m|² at stationarity for m = (1/N)Σ_i x_i, to leading order in N, when the ℓ = 1 mode of the
    uniform measure is stable (T > s c_1):  T / (T − s c_1).  Raises ValueError otherwise."""
    beta = check_real(beta, "beta")
    T = check_positive(T, "T")
    c1 = direction_sign(direction) * float(mode_coefficients(beta, d, 1, lambdas=lambdas, weights=weights,
                                                             normalization=normalization))
    if T <= c1:
        raise ValueError(f"the uniform measure is unstable at T = {T} <= s·c_1 = {c1}: no stationary "
                         "fluctuations around it; take T above critical_temperature(...)")
    return T / (T - c1)


def averaged_growth_rate(betas, d: int, T: float, ell: int = 1, *, times=None, lambdas=(1.0,), weights=None,
                         normalization: str = "softmax", direction: str = DEFAULT_DIRECTION) -> float:
    """⟨r_ℓ⟩ = (1/(t_K − t_0)) ∫ r_ℓ(β_t) dt for samples β_k on a grid (trapezoid; ``times`` None =
    a uniform grid).  The mode ℓ of the uniform measure grows iff ⟨r_ℓ⟩ > 0 over long horizons."""
    b = np.asarray(betas.detach().cpu().double() if isinstance(betas, torch.Tensor) else betas, dtype=np.float64)
    if b.ndim != 1 or b.size < 2 or not np.isfinite(b).all():
        raise ValueError(f"betas must be a finite 1-d sequence of at least 2 samples, got shape {b.shape}")
    T = check_positive(T, "T", allow_zero=True)
    ell = check_int(ell, "ell")
    s = direction_sign(direction)
    c = np.array([mode_coefficients(bk, d, ell, lambdas=lambdas, weights=weights, normalization=normalization)
                  for bk in b])
    r = ell * (ell + d - 2) * (s * c - T)
    t = np.arange(b.size, dtype=np.float64) if times is None else np.asarray(times, dtype=np.float64)
    if t.shape != b.shape or not (np.diff(t) > 0).all():
        raise ValueError("times must be increasing with one entry per beta sample")
    return float(np.trapezoid(r, t) / (t[-1] - t[0]))


def ou_averaged_growth_rate(mean: float, sigma: float, rate: float, d: int, T: float, ell: int = 1, *,
                            lambdas=(1.0,), weights=None, normalization: str = "softmax",
                            direction: str = DEFAULT_DIRECTION, nodes: int = 64) -> float:
    """Long-time average of r_ℓ(β_t) along an OU process dβ = rate(mean − β)dt + σ dW: by ergodicity
    E r_ℓ(β) under the stationary law N(mean, σ²/(2·rate)) (Gauss–Hermite with ``nodes`` nodes)."""
    mean = check_real(mean, "mean")
    sigma = check_positive(sigma, "sigma", allow_zero=True)
    rate = check_positive(rate, "rate")
    T = check_positive(T, "T", allow_zero=True)
    ell = check_int(ell, "ell")
    s = direction_sign(direction)
    z, wq = np.polynomial.hermite_e.hermegauss(check_int(nodes, "nodes"))
    sd = sigma / math.sqrt(2 * rate)
    c = np.array([mode_coefficients(mean + sd * zk, d, ell, lambdas=lambdas, weights=weights,
                                    normalization=normalization) for zk in z])
    return float(ell * (ell + d - 2) * (s * (wq * c).sum() / wq.sum() - T))


def oscillating_averaged_growth_rate(beta0: float, amplitude: float, d: int, T: float, ell: int = 1, *,
                                     lambdas=(1.0,), weights=None, normalization: str = "softmax",
                                     direction: str = DEFAULT_DIRECTION, nodes: int = 64) -> float:
    """Average of r_ℓ(β_t) over a period of β_t = β0 + amplitude·sin(ωt) (independent of ω):
    the periodic trapezoid rule with ``nodes`` phases (spectrally accurate)."""
    beta0 = check_real(beta0, "beta0")
    amplitude = check_real(amplitude, "amplitude")
    n = check_int(nodes, "nodes")
    phi = 2 * math.pi * np.arange(n) / n
    b = beta0 + amplitude * np.sin(phi)
    T = check_positive(T, "T", allow_zero=True)
    ell = check_int(ell, "ell")
    s = direction_sign(direction)
    c = np.array([mode_coefficients(bk, d, ell, lambdas=lambdas, weights=weights, normalization=normalization)
                  for bk in b])
    return float(ell * (ell + d - 2) * (s * c.mean() - T))


def landau_coefficient(beta, d: int) -> float:
    """δ₂ of the module docstring for one unnormalised head λ = 1 (ascent): > 0 the transition at T_c is
    continuous (supercritical), < 0 it is first order (subcritical, hysteresis).  The expansion is derived
    for β > 0 (ValueError otherwise)."""
    from scipy.special import ive  # scipy on first use: `import transformer_pde` stays light
    if check_real(beta, "beta") <= 0:
        raise ValueError(f"landau_coefficient is derived for β > 0 (the Bessel ratio r = I_(d/2+1)(β)/I_(d/2)(β) of "
                         f"the attracting head), got beta = {beta}")
    beta = float(beta)
    d = _dim(d)
    r = float(ive(d / 2 + 1, beta) / ive(d / 2, beta))
    return (1 - (d - 1) * r / (1 - r)) / (d * (d + 2))


def first_order_beta(d: int) -> float:
    """The root β of I_{d/2+1}(β)/I_{d/2}(β) = 1/d: above it the unnormalised noisy transformer's
    transition at T_c is first order (Mun–Rosenzweig 2026; :func:`landau_coefficient` changes sign)."""
    from scipy.optimize import brentq
    from scipy.special import ive  # scipy on first use: `import transformer_pde` stays light
    d = _dim(d)
    f = lambda b: ive(d / 2 + 1, b) / ive(d / 2, b) - 1 / d  # noqa: E731
    hi = 1.0
    while f(hi) < 0:
        hi *= 2
    return float(brentq(f, 1e-12, hi, xtol=1e-14, rtol=1e-14))
