"""Mobilities, metric slope 𝒢² and dissipation 𝒟 (docs/model.md#mobility).

    m_h(x) = ∫ e^{β⟨x, A_h y⟩} dμ(y)                 per-head mobility (partition function)
    b(x)   = ( Σ_h ω̄_h / m_h(x) )^{-1}               effective (harmonic-mean) mobility, ω̄ = ω/Σω
    𝒢²     = ∫ b |V|² dμ ≥ 0                          metric slope (the reference code's G²)
    𝒟      = ∫ ⟨∇_S δE/δμ, V⟩ dμ                      dissipation, signed: dE/dt = ∂_tE + 𝒟

For H = 1, for heads of equal mobility and for normalization="effective", 𝒟 = s·𝒢²; for
softmax heads with H > 1 they differ, and only 𝒟 closes the energy balance.

Like the energy, 𝒢² and 𝒟 are linear in the kernel e^{β⟨x,A y⟩} (through b and ∇_S δE/δμ) for
a given field V: ``log_scale=c`` returns them times e^{−c}, computed from e^{log m_h − c}
(:func:`scaled_diagnostics`, what the solvers use at large β‖A‖).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._validation import NORMALIZATIONS, check_choice, check_tied, direction_sign
from .attention import HeadStats, softmax_statistics
from .energy import check_log_scale, overflow_check, scaled_exp
from .field import check_inputs, log_inverse_mobility, evaluate
from .heads import Heads
from .sphere import tangent_projection

__all__ = ["mobility", "log_mobility", "slope", "dissipation", "scaled_diagnostics"]


def scaled_diagnostics(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor], velocity: torch.Tensor,
                       stats: HeadStats, *, log_scale: float = 0.0, chunk_elements: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E, 𝒢², 𝒟, ∇_S δE/δμ) · e^{−c} of the whole measure μ = Σ_i w_i δ_{x_i} along a given field.

        E e^{−c}   = Σ_h ω_h/(2β) Σ_i w_i e^{log m_h(x_i) − c}
        g e^{−c}   = P_x Σ_h ω_h e^{log m_h − c} A_h ȳ_h         (symmetric A_h; else the mean with A_hᵀ)
        𝒢² e^{−c}  = Σ_i w_i e^{−log b^{-1}(x_i) − c} |V(x_i)|²
        𝒟 e^{−c}   = Σ_i w_i ⟨g(x_i) e^{−c}, V(x_i)⟩

    The same formulas as :func:`transformer_pde.evaluate`'s diagnostics (bit for bit at c = 0, for
    symmetric heads), finite whenever log m_h − c fits the dtype — with c from
    :func:`transformer_pde.energy.choose_log_scale`, for any β‖A‖ at which the field is finite.

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
    def token_mean(v, per_head=False):  # Σ_i w_i v_i over the last axis, v (..., n) or (..., H, n)
        if weights is None:
            return v.mean(-1)
        return (v * (weights.unsqueeze(-2) if per_head else weights)).sum(-1)

    c = float(log_scale)
    A = heads.score_matrix
    omega = heads.weights.unsqueeze(-1).unsqueeze(-1)
    lse = stats.log_partition
    if heads.is_symmetric:
        terms = [(lse, stats.mean @ A.transpose(-1, -2))]
    else:
        tst = softmax_statistics(x, heads, weights, transpose=True, chunk_elements=chunk_elements)
        half = torch.log(torch.tensor(0.5, dtype=x.dtype, device=x.device))
        terms = [(lse + half, stats.mean @ A.transpose(-1, -2)), (tst.log_partition + half, tst.mean @ A)]
    g = tangent_projection(x, sum((omega * scaled_exp(l, c).unsqueeze(-1) * u).sum(-3) for l, u in terms))
    beta = heads.beta
    energy = (heads.weights * token_mean(scaled_exp(lse, c), per_head=True)).sum(-1) / (2 * beta)
    b = torch.exp(-log_inverse_mobility(heads, lse) - c) if c != 0.0 else torch.exp(-log_inverse_mobility(heads, lse))
    slope = token_mean(b * velocity.square().sum(-1))
    diss = token_mean((g * velocity).sum(-1))
    return energy, slope, diss, g


def log_mobility(x, heads: Heads, weights=None):
    """(log m (..., H, n), log b (..., n)), finite for any β‖A‖."""
    check_inputs(x, heads, weights)
    lse = softmax_statistics(x, heads, weights).log_partition
    return lse, -log_inverse_mobility(heads, lse)


def mobility(x, heads: Heads, weights=None):
    """(m (..., H, n), b (..., n)): per-head and effective mobilities at the tokens."""
    lm, lb = log_mobility(x, heads, weights)
    fix = "use tp.log_mobility(x, heads, weights), which returns (log m, log b) and stays finite"
    m = overflow_check(torch.exp(lm), "the per-head mobility m_h", lm, 0.0, fix)
    return m, overflow_check(torch.exp(lb), "the effective mobility b", lb, 0.0, fix)


def _diag(x, heads, weights, normalization, direction):
    check_choice(normalization, NORMALIZATIONS, "normalization")
    sign = direction_sign(direction)
    check_inputs(x, heads, weights)
    if normalization == "effective":
        check_tied(heads, "normalization='effective'")
    return evaluate(x, heads, weights, normalization=normalization, sign=sign, diagnostics=True)


def _scaled(x, heads, weights, normalization, direction, log_scale, which):
    c = check_log_scale(log_scale)
    if c == 0.0:
        ev = _diag(x, heads, weights, normalization, direction)
        out = getattr(ev, which)
        stats = ev.stats
    else:
        check_choice(normalization, NORMALIZATIONS, "normalization")
        sign = direction_sign(direction)
        check_inputs(x, heads, weights)
        ev = evaluate(x, heads, weights, normalization=normalization, sign=sign, diagnostics=False)
        stats = ev.stats
        E, G, D, _ = scaled_diagnostics(x, heads, weights, ev.velocity, stats, log_scale=c)
        out = G if which == "slope" else D
    name = "the metric slope 𝒢²" if which == "slope" else "the dissipation 𝒟"
    return overflow_check(out, name, lambda: stats.log_partition, c,
                           f"Pass log_scale=c (the result is {name.split()[-1]}·e^(−c)) with c near the largest "
                           f"log-partition (tp.log_mobility)")


def slope(x, heads: Heads, weights=None, normalization="softmax", direction="ascent", *, log_scale: float = 0.0):
    """Metric slope 𝒢² · e^{−log_scale}, 𝒢² = Σ_i w_i b(x_i) |V(x_i)|², (...,).

    Raises
    ------
    OverflowError
        the result overflows the dtype (large β‖A‖); pass ``log_scale=``."""
    return _scaled(x, heads, weights, normalization, direction, log_scale, "slope")


def dissipation(x, heads: Heads, weights=None, normalization="softmax", direction="ascent", *,
                log_scale: float = 0.0):
    """Dissipation 𝒟 · e^{−log_scale}, 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i), V(x_i)⟩, (...,) (sign follows direction).

    Raises
    ------
    OverflowError
        the result overflows the dtype (large β‖A‖); pass ``log_scale=``."""
    return _scaled(x, heads, weights, normalization, direction, log_scale, "dissipation")
