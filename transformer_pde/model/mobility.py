"""Mobilities, metric slope 𝒢² and dissipation 𝒟 (docs/model.md#mobility).

    m_h(x) = ∫ e^{β⟨x, A_h y⟩} dμ(y)                 per-head mobility (partition function)
    b(x)   = ( Σ_h ω̄_h / m_h(x) )^{-1}               effective (harmonic-mean) mobility, ω̄ = ω/Σω
    𝒢²     = ∫ b |V|² dμ ≥ 0                          metric slope (the reference code's G²)
    𝒟      = ∫ ⟨∇_S δE/δμ, V⟩ dμ                      dissipation, signed: dE/dt = ∂_tE + 𝒟

For H = 1, for heads of equal mobility and for normalization="effective", 𝒟 = s·𝒢²; for
softmax heads with H > 1 they differ, and only 𝒟 closes the energy balance.

Like the energy, 𝒢² and 𝒟 are linear in the kernel e^{β⟨x,A y⟩} (through b and ∇_S δE/δμ) for
a given field V: ``log_scale=c`` returns them times e^{−c}, computed from e^{log m_h − c}
(:func:`transformer_pde.model.field.diagnostics_along`, the one implementation that
:func:`transformer_pde.evaluate`, the solvers and :func:`scaled_diagnostics` share).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..utils.validation import DEFAULT_DIRECTION
from ..utils.validation import check_tied, direction_sign
from .moments import HeadStats
from .softmax import softmax_statistics
from .energy import check_log_scale, overflow_check
from .field import check_inputs, diagnostics_along, evaluate, log_inverse_mobility
from .heads import Heads
from .normalization import resolve

__all__ = ["mobility", "log_mobility", "slope", "dissipation", "scaled_diagnostics"]


def scaled_diagnostics(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor], velocity: torch.Tensor,
                       stats: HeadStats, *, log_scale: float = 0.0, chunk_elements: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E, 𝒢², 𝒟, ∇_S δE/δμ) · e^{−c} of the whole measure μ = Σ_i w_i δ_{x_i} along a given field.

    The same code as :func:`transformer_pde.evaluate`'s diagnostics (one implementation,
    :func:`transformer_pde.model.field.diagnostics_along`; its docstring has the formulas).

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d).  heads: :class:`Heads`.  weights: token weights (..., n) or None.
    velocity : torch.Tensor
        the signed field V at the tokens (..., n, d) (any normalisation, causal or not).
    stats : HeadStats
        the non-causal softmax statistics of x under the heads (log_partition, mean).
    log_scale : float
        c.  chunk_elements: memory cap of the transposed kernel pass (non-symmetric heads).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
        (energy (...,), slope (...,), dissipation (...,), grad_first_variation (..., n, d)), all times e^{−c}.
    """
    return diagnostics_along(x, heads, weights, velocity, stats, log_scale=log_scale, chunk_elements=chunk_elements)


def log_mobility(x, heads: Heads, weights=None):
    """(log m (..., H, n), log b (..., n)), finite for any β‖A‖."""
    heads = check_inputs(x, heads, weights)
    lse = softmax_statistics(x, heads, weights).log_partition
    return lse, -log_inverse_mobility(heads, lse)


def mobility(x, heads: Heads, weights=None):
    """(m (..., H, n), b (..., n)): per-head and effective mobilities at the tokens."""
    lm, lb = log_mobility(x, heads, weights)
    fix = "use tp.log_mobility(x, heads, weights), which returns (log m, log b) and stays finite"
    m = overflow_check(torch.exp(lm), "the per-head mobility m_h", lm, 0.0, fix)
    return m, overflow_check(torch.exp(lb), "the effective mobility b", lb, 0.0, fix)


def _scaled(x, heads, weights, normalization, direction, log_scale, which):
    c = check_log_scale(log_scale)
    norm = resolve(normalization)
    sign = direction_sign(direction)
    heads = check_inputs(x, heads, weights)
    if not norm.uses_value:
        check_tied(heads, f"normalization={norm.name!r}")
    ev = evaluate(x, heads, weights, normalization=norm, sign=sign, diagnostics=True, log_scale=c)
    out = getattr(ev, which)
    name = "the metric slope 𝒢²" if which == "slope" else "the dissipation 𝒟"
    return overflow_check(out, name, lambda: ev.stats.log_partition, c,
                           f"Pass log_scale=c (the result is {name.split()[-1]}·e^(−c)) with c near the largest "
                           f"log-partition (tp.log_mobility)")


def slope(x, heads: Heads, weights=None, normalization="softmax", direction=DEFAULT_DIRECTION, *, log_scale: float = 0.0):
    """Metric slope 𝒢² · e^{−log_scale}, 𝒢² = Σ_i w_i b(x_i) |V(x_i)|², (...,).

    Raises
    ------
    OverflowError
        the result overflows the dtype (large β‖A‖); pass ``log_scale=``."""
    return _scaled(x, heads, weights, normalization, direction, log_scale, "slope")


def dissipation(x, heads: Heads, weights=None, normalization="softmax", direction=DEFAULT_DIRECTION, *,
                log_scale: float = 0.0):
    """Dissipation 𝒟 · e^{−log_scale}, 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i), V(x_i)⟩, (...,) (sign follows direction).

    Raises
    ------
    OverflowError
        the result overflows the dtype (large β‖A‖); pass ``log_scale=``."""
    return _scaled(x, heads, weights, normalization, direction, log_scale, "dissipation")
