"""The energy's value at β = 0: the pole of (1/(2β)) ∫∫ e^{β⟨x, A_h y⟩} dμ dμ and its finite part.

E = Σ_h ω_h/(2β) ∫∫ e^{β⟨x, A_h y⟩} dμ dμ has a simple pole at β = 0 with a constant residue; there the
library reports the constant term of its Laurent series, ½ Σ_h ω_h ∫∫ ⟨x, A_h y⟩ dμ dμ (docs/model.md#energy).
"""

from __future__ import annotations

import math

import torch

from .heads import Heads

__all__ = []
#: named internal API: the energy's normalisation 1/(2β) with its finite part at β = 0 (field, energy, JKO)
__internal__ = ["zero_beta", "pair_mean_scores", "over_two_beta", "finite_part"]


def zero_beta(heads: Heads) -> bool:
    """True when β is 0 (for a tensor β: anywhere): the energy's 1/(2β) is then its finite part
    (:func:`over_two_beta`)."""
    b = heads.beta
    return bool((b == 0).any()) if isinstance(b, torch.Tensor) else b == 0.0


def pair_mean_scores(x, heads: Heads, weights, keys=None, key_weights=None) -> torch.Tensor:
    """Σ_i w_i ⟨x_i, A_h ȳ⟩ with ȳ = Σ_j w'_j y_j the mean of the keys (default: the tokens), (..., H): the
    score average Σ_ij w_i w'_j ⟨x_i, A_h y_j⟩ (no kernel; the β = 0 limit of the kernel averages)."""
    y, wy = (x, weights) if keys is None else (keys, key_weights)
    qs = x.mean(-2) if weights is None else (weights.unsqueeze(-1) * x).sum(-2)  # (..., d)
    ks = y.mean(-2) if wy is None else (wy.unsqueeze(-1) * y).sum(-2)
    if heads.query is not None and heads.score is None:  # ⟨Q q, K k⟩ from the factors
        Qq = (heads.query @ qs.unsqueeze(-2).unsqueeze(-1)).squeeze(-1)
        Kk = (heads.key @ ks.unsqueeze(-2).unsqueeze(-1)).squeeze(-1)
        return (Qq * Kk).sum(-1)
    return ((qs.unsqueeze(-2).unsqueeze(-2) @ heads.score_matrix).squeeze(-2) * ks.unsqueeze(-2)).sum(-1)


def over_two_beta(numerator: torch.Tensor, heads: Heads, finite_part) -> torch.Tensor:
    """numerator / (2β) (the energy's normalisation, docs/model.md#energy), with its finite part where β = 0.

    E = Σ_h ω_h/(2β) ∫∫ e^{β⟨x, A_h y⟩} dμ dμ has a simple pole at β = 0 (residue Σ_h ω_h/2, a constant of
    the tokens); there it is given the constant term of its Laurent series, ½ Σ_h ω_h ∫∫⟨x, A_h y⟩ dμ dμ:
    ``finite_part()`` (a zero-argument callable, called only when some β is 0), of the numerator's shape
    (...,).  For β ≠ 0 this is exactly ``numerator / (2 * heads.beta)``; β < 0 is divided like any β."""
    beta = heads.beta
    if isinstance(beta, torch.Tensor):
        if not bool((beta == 0).any()):
            return numerator / (2 * beta)
        zero = beta == 0
        safe = torch.where(zero, torch.ones_like(beta), beta)
        return torch.where(zero, finite_part(), numerator / (2 * safe))
    if beta != 0.0:
        return numerator / (2 * beta)
    return finite_part().expand_as(numerator) if isinstance(numerator, torch.Tensor) else finite_part()


def finite_part(x, heads, weights, keys, key_weights, c):
    """e^{−c} ½ Σ_h ω_h Σ_ij w_i w'_j ⟨x_i, A_h y_j⟩: the energy's value at β = 0 (:func:`over_two_beta`)."""
    return 0.5 * (heads.weights * pair_mean_scores(x, heads, weights, keys, key_weights)).sum(-1) * math.exp(-c)
