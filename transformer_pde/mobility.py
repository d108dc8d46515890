"""Mobilities, metric slope 𝒢² and dissipation 𝒟 (DESIGN §2).

    m_h(x) = ∫ e^{β⟨x, A_h y⟩} dμ(y)                 per-head mobility (partition function)
    b(x)   = ( Σ_h ω̄_h / m_h(x) )^{-1}               effective (harmonic-mean) mobility, ω̄ = ω/Σω
    𝒢²     = ∫ b |V|² dμ ≥ 0                          metric slope (the reference code's G²)
    𝒟      = ∫ ⟨∇_S δE/δμ, V⟩ dμ                      dissipation, signed: dE/dt = ∂_tE + 𝒟

For H = 1, for heads of equal mobility and for normalization="effective", 𝒟 = s·𝒢²; for
softmax heads with H > 1 they differ, and only 𝒟 closes the energy balance.
"""

from __future__ import annotations

import torch

from ._validation import NORMALIZATIONS, check_choice, direction_sign
from .attention import softmax_statistics
from .field import _check_inputs, _log_inverse_mobility, evaluate
from .heads import Heads

__all__ = ["mobility", "log_mobility", "slope", "dissipation"]


def log_mobility(x, heads: Heads, weights=None):
    """(log m (..., H, n), log b (..., n)), finite for any β‖A‖."""
    _check_inputs(x, heads, weights)
    lse = softmax_statistics(x, heads, weights).log_partition
    return lse, -_log_inverse_mobility(heads, lse)


def mobility(x, heads: Heads, weights=None):
    """(m (..., H, n), b (..., n)): per-head and effective mobilities at the tokens."""
    lm, lb = log_mobility(x, heads, weights)
    return torch.exp(lm), torch.exp(lb)


def _diag(x, heads, weights, normalization, direction):
    check_choice(normalization, NORMALIZATIONS, "normalization")
    sign = direction_sign(direction)
    _check_inputs(x, heads, weights)
    return evaluate(x, heads, weights, normalization=normalization, sign=sign, diagnostics=True)


def slope(x, heads: Heads, weights=None, normalization="softmax", direction="ascent"):
    """Metric slope 𝒢² = Σ_i w_i b(x_i) |V(x_i)|², (...,)."""
    return _diag(x, heads, weights, normalization, direction).slope


def dissipation(x, heads: Heads, weights=None, normalization="softmax", direction="ascent"):
    """Dissipation 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i), V(x_i)⟩, (...,) (sign follows direction)."""
    return _diag(x, heads, weights, normalization, direction).dissipation
