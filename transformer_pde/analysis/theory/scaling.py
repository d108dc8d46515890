"""Closed forms of the critical attention scaling β_n = γ log n (docs/critical_scaling.md).

**Simplex tokens** (Chen, Lin, Polyanskiy, Rigollet, arXiv 2510.05554): one softmax head A = V = I with scores
β_n⟨y_i, y_j⟩ on unit tokens of pairwise inner product ⟨y_i, y_j⟩ = ρ (i ≠ j).  Token i gives itself the weight

    a_n(γ) = e^{β_n} / (e^{β_n} + (n − 1) e^{β_n ρ}) = 1 / (1 + (n − 1) n^{−γ(1−ρ)}),     β_n = γ log n,

which tends to 0 for γ < γ_c = 1/(1 − ρ) (attention averages: the tokens collapse), to 1 for γ > γ_c (attention
is the identity) and to 1/2 at γ = γ_c.

**Almost-simplex tokens** (the study's configuration): y_j = √ρ e + √(1 − ρ) z_j with z_j i.i.d. uniform on the
unit sphere S^{d−2} of e^⊥ in R^d.  Then ⟨y_i, y_j⟩ = ρ + (1 − ρ) ζ_ij, and ζ = ⟨z_i, z_j⟩ has the law of 2B − 1,
B ~ Beta((d−2)/2, (d−2)/2) (the first coordinate of a uniform point of S^{d−2}), with E e^{aζ} = κ_0(a; d − 1),
κ_0(a; k) = Γ(k/2)(2/a)^{k/2−1} I_{k/2−1}(a) (the Funk–Hecke coefficient of e^{at} on S^{k−1},
:func:`transformer_pde.analysis.theory.noise.funk_hecke_exponential`).  Replacing the sum over the other keys by
its mean (the annealed approximation, exact as d → ∞ at fixed n) gives

    a_n(γ) ≈ 1 / (1 + (n − 1) e^{−u L} κ_0(u L; d − 1)),      u = γ(1 − ρ), L = log n,

and, since log κ_0(a; k) = a²/(2k) + O(a⁴/k³), the self weight crosses 1/2 at u* ≈ 1 + L/(2(d − 1)): the
transition moves to larger γ and widens when log n is not small against d (the paper's "middle phase"); it
sharpens at γ_c = 1/(1 − ρ) as d → ∞.  The self weight depends on ρ only through u.

**Uniform keys** (arXiv 2605.08505): a fixed query and n i.i.d. keys uniform on S^{d−1}.  The distance to the
nearest key is of order n^{−1/(d−1)}, so selectivity (the nearest key keeping a macroscopic weight) sets in at
β*_n ≍ n^{2/(d−1)}: :func:`uniform_key_exponent`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...utils.validation import check_int, check_real
from ...model.sphere import normalize
from .noise import funk_hecke_exponential

__all__ = ["critical_gamma", "simplex_self_weight", "annealed_self_weight", "annealed_critical_gamma",
           "almost_simplex", "almost_simplex_scores", "uniform_key_exponent"]


def _rho(rho) -> float:
    rho = check_real(rho, "rho")
    if not -1.0 < rho < 1.0:
        raise ValueError(f"rho (the pairwise inner product of the tokens) must lie in (-1, 1), got {rho}")
    return rho


def critical_gamma(rho) -> float:
    """γ_c = 1/(1 − ρ): the critical scale β_n = γ_c log n of simplex tokens with pairwise inner product ρ.

    >>> critical_gamma(0.5)
    2.0
    """
    return 1.0 / (1.0 - _rho(rho))


def simplex_self_weight(gamma, rho, n):
    """a_n(γ) = 1/(1 + (n − 1) n^{−γ(1−ρ)}) (module docstring), computed as a logistic function of
    γ(1 − ρ) log n − log(n − 1) (no overflow).  gamma: float or tensor; returns the same kind.

    >>> round(simplex_self_weight(2.0, 0.5, 10**6), 4)  # at γ_c: (n − 1)/n ≈ 1, so ≈ 1/2
    0.5
    """
    rho = _rho(rho)
    n = check_int(n, "n", minimum=2)
    g = gamma if isinstance(gamma, torch.Tensor) else torch.tensor(float(gamma), dtype=torch.float64)
    out = torch.sigmoid(g * (1 - rho) * math.log(n) - math.log(n - 1))
    return out if isinstance(gamma, torch.Tensor) else float(out)


def _log_kappa0(a: np.ndarray, k: int) -> np.ndarray:
    """log E e^{aζ} for ζ the inner product of two uniform points of S^{k−1} (k ≥ 2): κ_0(a; k) =
    ₀F₁(; k/2; a²/4) (the series of Γ(k/2)(2/a)^{k/2−1} I_{k/2−1}(a), no underflow at large k), and from the
    Bessel form (:func:`funk_hecke_exponential`, log-scaled) where the hypergeometric value overflows."""
    from scipy.special import hyp0f1

    a = np.asarray(a, dtype=np.float64)
    with np.errstate(over="ignore"):
        v = hyp0f1(k / 2, a * a / 4)
    out = np.log(np.where(np.isfinite(v), v, 1.0))
    bad = ~np.isfinite(v)
    if bad.any():
        out = np.where(bad, np.log(funk_hecke_exponential(np.where(bad, a, 0.0), k, 0)), out)
    return out


def annealed_self_weight(gamma, rho, n, d):
    """The annealed self weight 1/(1 + (n − 1) e^{−uL} κ_0(uL; d − 1)), u = γ(1 − ρ), L = log n, of almost-simplex
    tokens in R^d (module docstring); gamma: float or 1-D sequence (a numpy array is returned for a sequence).

    Raises
    ------
    ValueError
        ρ outside (−1, 1), n < 2, d < 3 (the sphere S^{d−2} of the fluctuations needs d ≥ 3)."""
    rho = _rho(rho)
    n = check_int(n, "n", minimum=2)
    d = check_int(d, "d", minimum=3)
    g = np.atleast_1d(np.asarray(gamma, dtype=np.float64))
    a = g * (1 - rho) * math.log(n)
    logit = a - math.log(n - 1) - _log_kappa0(a, d - 1)
    out = 1.0 / (1.0 + np.exp(-logit))
    return float(out[0]) if np.ndim(gamma) == 0 else out


def annealed_critical_gamma(rho, n, d) -> float:
    """The γ at which :func:`annealed_self_weight` equals 1/2 (Brent's method); → 1/(1 − ρ) as d → ∞.

    >>> round(annealed_critical_gamma(0.0, 10**6, 10**6), 4)
    1.0
    """
    from scipy.optimize import brentq

    rho = _rho(rho)
    n = check_int(n, "n", minimum=2)
    d = check_int(d, "d", minimum=3)
    L, k = math.log(n), d - 1

    def f(u):
        a = u * L
        return a - math.log(n - 1) - float(_log_kappa0(np.array(a), k))

    hi = 2.0
    while f(hi) < 0:
        hi *= 2
        if hi > 1e6:
            raise ValueError(f"no crossing of the annealed self weight below u = 1e6 (n = {n}, d = {d})")
    return brentq(f, 0.0, hi, xtol=1e-13, rtol=1e-13) / (1 - rho)


def almost_simplex(n: int, d: int, rho, *, generator=None, dtype=torch.float64, device=None) -> torch.Tensor:
    """n almost-simplex tokens y_j = √ρ e_0 + √(1 − ρ) z_j in R^d, z_j i.i.d. uniform on the unit sphere of e_0^⊥
    (module docstring), (n, d); built in blocks (memory: the result and one block of normals)."""
    rho = _rho(rho)
    n = check_int(n, "n", minimum=1)
    d = check_int(d, "d", minimum=3)
    if rho < 0:
        raise ValueError("almost_simplex needs rho >= 0 (y = √ρ e + √(1 − ρ) z); for rho < 0 use the scores directly")
    out = torch.empty(n, d, dtype=dtype, device=device)
    out[:, 0] = math.sqrt(rho)
    block = max(1, (1 << 22) // d)
    for i in range(0, n, block):
        z = torch.randn(min(block, n - i), d - 1, generator=generator, dtype=dtype, device=device)
        out[i:i + block, 1:] = math.sqrt(1 - rho) * normalize(z)
    return out


def almost_simplex_scores(n: int, d: int, rho, *, seed: int = 0) -> torch.Tensor:
    """The scores ⟨y_0, y_j⟩ of one almost-simplex token against all n tokens, sampled from their exact law
    (module docstring): s_0 = 1 (the token itself), s_j = ρ + (1 − ρ)(2B_j − 1), B_j ~ Beta((d−2)/2, (d−2)/2)
    i.i.d.; float64 (n,).  O(n) work and memory at any d (numpy's generator, seeded by ``seed``)."""
    rho = _rho(rho)
    n = check_int(n, "n", minimum=1)
    d = check_int(d, "d", minimum=3)
    rng = np.random.default_rng(check_int(seed, "seed", minimum=0))
    a = (d - 2) / 2
    s = np.empty(n)
    s[0] = 1.0
    s[1:] = rho + (1 - rho) * (2 * rng.beta(a, a, size=n - 1) - 1)
    return torch.from_numpy(s)


def uniform_key_exponent(d: int) -> float:
    """2/(d − 1): the exponent of the critical scale β*_n ≍ n^{2/(d−1)} of n i.i.d. uniform keys on S^{d−1}.

    >>> uniform_key_exponent(3), uniform_key_exponent(5)
    (1.0, 0.5)
    """
    return 2.0 / (check_int(d, "d", minimum=2) - 1)
