"""Interaction energy of symmetric heads and its derivatives (DESIGN §2).

    E(μ, Θ) = Σ_h ω_h (1/(2β)) ∫∫ e^{β⟨x, A_h y⟩} dμ(x) dμ(y) = Σ_h ω_h/(2β) ∫ m_h dμ
    E_h     = (1/(2β)) ∫∫ e^{β⟨x, A_h y⟩} dμ dμ                 (per head, without ω_h)
    δE/δμ(x) = Σ_h ω_h m_h(x)/β                                   (symmetric A_h)
    ∂_t E   = Σ_h ω_h ½ ∫∫ e^{β⟨x,A_h y⟩} ⟨x, Ȧ_h y⟩ dμ dμ = Σ_h ω_h ½ ∫ m_h ⟨x, Ȧ_h ȳ_h⟩ dμ

For Itô weights dA_h = f_h dt + σ_h dW_sym (dW_sym = ½(dB + dBᵀ)) the energy gains the Itô
correction Σ_h ω_h ½ (β σ_h²/4) ∫∫ e^{β⟨x,A_h y⟩}(1 + ⟨x,y⟩²) dμ dμ per unit time and the
martingale increment Σ_h ω_h ½ ∫∫ e^{β⟨x,A_h y⟩} ⟨x, σ_h dW_h y⟩ dμ dμ.  With β = 1 and
ω = 1/H these are the reference code's terms.
"""

from __future__ import annotations



import torch

from .attention import HeadStats, softmax_statistics
from .field import _check_inputs, _head_token_mean
from .heads import Heads

__all__ = ["energy", "head_energies", "first_variation", "energy_time_derivative",
           "pairing", "ito_correction", "log_energy"]


def head_energies(x, heads: Heads, weights=None):
    """E_h = (1/(2β)) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}, (..., H) (no head weight ω_h)."""
    _check_inputs(x, heads, weights)
    stats = softmax_statistics(x, heads, weights)
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    return _head_token_mean(torch.exp(stats.log_partition), weights) / (2 * beta)


def energy(x, heads: Heads, weights=None):
    """E(μ, Θ) = Σ_h ω_h E_h, shape (...,).

    Example:
        >>> import torch, transformer_pde as tp
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> float(tp.energy(x, tp.Heads.scalar([1.0], 2).to(torch.float64)))  # (e + 1) / 2 / 2
        0.9295704571147613
    """
    return (heads.weights * head_energies(x, heads, weights)).sum(-1)


def log_energy(x, heads: Heads, weights=None):
    """log E, computed by log-sum-exp (finite where E itself overflows), (...,)."""
    _check_inputs(x, heads, weights)
    stats = softmax_statistics(x, heads, weights)
    lse = stats.log_partition
    logw_tok = 0.0 if weights is None else torch.log(weights).unsqueeze(-2)
    n = x.shape[-2]
    per_head = torch.logsumexp(lse + logw_tok, -1) - (torch.log(torch.tensor(float(n), dtype=x.dtype)) if weights is None else 0.0)
    beta = heads.beta_tensor()
    return torch.logsumexp(per_head + torch.log(heads.weights), -1) - torch.log(2 * beta)


def first_variation(x, heads: Heads, weights=None, *, at=None):
    """δE/δμ at the points ``at`` (default: the tokens), (..., m).

    Symmetric heads: Σ_h ω_h m_h(z)/β.  General A_h: Σ_h ω_h (m_h(z) + m̃_h(z))/(2β), with m̃
    the partition function of A_hᵀ.
    """
    _check_inputs(x, heads, weights)
    z = x if at is None else at
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    omega = heads.weights.unsqueeze(-1)

    def part(transpose):
        s = softmax_statistics(z, heads, weights, keys=x, transpose=transpose)
        return (omega * torch.exp(s.log_partition)).sum(-2)

    if heads.is_symmetric:
        return part(False) / beta
    return (part(False) + part(True)) / (2 * beta)


def pairing(x, heads: Heads, weights, stats: HeadStats, M: torch.Tensor) -> torch.Tensor:
    """Σ_h ω_h ½ Σ_i w_i m_h(x_i) ⟨x_i, M_h ȳ_h(x_i)⟩ = ⟨∂_A E, M⟩, (...,).

    With M = Ȧ this is ∂_tE; with M = σ ΔW_sym it is the martingale increment."""
    # T_h = Σ_i w_i m_h(x_i) x_i ȳ_hiᵀ (d×d per head), then ⟨M_h, T_h⟩_F: O(H n d²) in one
    # batched product instead of forming M_hᵀ x_i for every token
    mw = torch.exp(stats.log_partition)  # (..., H, n)
    mw = mw / x.shape[-2] if weights is None else mw * weights.unsqueeze(-2)
    T = (mw.unsqueeze(-1) * stats.mean).transpose(-1, -2) @ x.unsqueeze(-3)  # (..., H, d, d): T_ba
    per_head = (T.transpose(-1, -2) * M).sum((-1, -2))
    return 0.5 * (heads.weights * per_head).sum(-1)


def ito_correction(heads: Heads, weights, stats: HeadStats, sigma) -> torch.Tensor:
    """Σ_h ω_h ½ (β σ_h²/4) Σ_i w_i m_h(x_i) (1 + q_h(x_i)), (...,); needs stats.second.

    sigma: float, or tensor broadcasting against (..., H)."""
    per_head = _head_token_mean(torch.exp(stats.log_partition) * (1 + stats.second), weights)
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    sig2 = sigma * sigma
    return (heads.weights * 0.5 * beta * sig2 / 4 * per_head).sum(-1)


def energy_time_derivative(x, heads: Heads, score_rate: torch.Tensor, weights=None, *, sigma=0.0):
    """∂_tE along deterministic weights with Ȧ_h = score_rate (..., H, d, d), plus the Itô
    correction when sigma > 0 (noise σ dW_sym on every A_h).  Shape (...,)."""
    _check_inputs(x, heads, weights)
    if not isinstance(score_rate, torch.Tensor) or score_rate.shape[-3:] != heads.score_matrix.shape[-3:]:
        raise ValueError("score_rate must be a tensor of shape (..., H, d, d) like the heads' scores")
    noisy = not (isinstance(sigma, (int, float)) and sigma == 0)
    stats = softmax_statistics(x, heads, weights, second_moment=noisy)
    out = pairing(x, heads, weights, stats, score_rate)
    if noisy:
        out = out + ito_correction(heads, weights, stats, sigma)
    return out
