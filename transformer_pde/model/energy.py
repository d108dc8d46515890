"""Interaction energy of symmetric heads and its derivatives (docs/model.md#energy).

    E(μ, Θ) = Σ_h ω_h (1/(2β)) ∫∫ e^{β⟨x, A_h y⟩} dμ(x) dμ(y) = Σ_h ω_h/(2β) ∫ m_h dμ
    E_h     = (1/(2β)) ∫∫ e^{β⟨x, A_h y⟩} dμ dμ                 (per head, without ω_h)
    δE/δμ(x) = Σ_h ω_h m_h(x)/β                                   (symmetric A_h)
    ∂_t E   = Σ_h ω_h ½ ∫∫ e^{β⟨x,A_h y⟩} ⟨x, Ȧ_h y⟩ dμ dμ = Σ_h ω_h ½ ∫ m_h ⟨x, Ȧ_h ȳ_h⟩ dμ

For Itô weights dA_h = f_h dt + σ_h dW_sym (dW_sym = ½(dB + dBᵀ)) the energy gains the Itô
correction Σ_h ω_h ½ (β σ_h²/4) ∫∫ e^{β⟨x,A_h y⟩}(1 + ⟨x,y⟩²) dμ dμ per unit time and the
martingale increment Σ_h ω_h ½ ∫∫ e^{β⟨x,A_h y⟩} ⟨x, σ_h dW_h y⟩ dμ dμ.  With β = 1 and
ω = 1/H these are the reference code's terms.  The Itô correction is the expectation of the
realised second-order term ½ ∂²_A E[ΔN, ΔN] of a noise increment ΔN (:func:`quadratic_variation`),

    ∂²_A E[M, M] = Σ_h ω_h (β/2) ∫∫ e^{β⟨x,A_h y⟩} ⟨x, M_h y⟩² dμ dμ.

β ≤ 0 and the pole at β = 0 (docs/model.md#energy).  The formulas hold for any real β ≠ 0 (E < 0 for
β < 0).  E has a simple pole at β = 0 with a constant residue, E = Σ_h ω_h/(2β) + E_c(β), where the
**centred energy**

    E_c(β) = Σ_h ω_h (1/(2β)) ∫∫ (e^{β⟨x, A_h y⟩} − 1) dμ dμ = ½ Σ_h ω_h ∫∫ s φ₁(βs) dμ dμ,  φ₁(z) = (e^z − 1)/z,

s = ⟨x, A_h y⟩, is analytic in β, with E_c(0) = ½ Σ_h ω_h ∫∫ s dμ dμ (``centered=True``, computed pairwise
with a stable φ₁, no cancellation near β = 0).  E and E_c differ by a constant of the tokens: the same first
variation up to a constant, the same gradient, field, 𝒟 and energy ledger.  At β = 0 itself :func:`energy`
reports the constant term of the Laurent series, E(0) := E_c(0) (the finite part), and
:func:`first_variation` likewise; the β ≠ 0 values are the reference convention unchanged.

Common scale.  Every quantity here is linear in the kernel e^{β⟨x,A y⟩}, so it overflows with
it (at β‖A‖ ≈ 88 in float32, ≈ 709 in float64) while the softmax field, a ratio, stays finite.
The keyword ``log_scale=c`` returns the quantity times e^{−c}, computed from the log-partitions
(e^{log m_h − c}) so that nothing overflows on the way; :func:`log_energy` gives log E itself
and :func:`choose_log_scale` the scale the solvers use.  Without a scale, a result that
overflows raises OverflowError instead of returning inf.
"""

from __future__ import annotations

import math

import torch

from .moments import HeadStats, head_moment_sums
from .softmax import softmax_statistics
from .backends import DEFAULT_CHUNK_ELEMENTS
from .field import check_inputs, head_token_mean, scaled_exp
from .finite_part import over_two_beta, pair_mean_scores, zero_beta
from .heads import Heads

__all__ = ["energy", "head_energies", "first_variation", "energy_time_derivative",
           "pairing", "ito_correction", "quadratic_variation", "log_energy", "choose_log_scale",
           "scaled_exp"]


def check_log_scale(log_scale) -> float:
    """The ``log_scale=`` argument as a finite float (TypeError / ValueError otherwise); internal, shared with mobility."""
    if isinstance(log_scale, bool) or not isinstance(log_scale, (int, float)):
        raise TypeError(f"log_scale must be a float (results are returned times e^(-log_scale)), "
                        f"got {type(log_scale).__name__}")
    c = float(log_scale)
    if not math.isfinite(c):
        raise ValueError(f"log_scale must be finite, got {log_scale!r}")
    return c


def choose_log_scale(log_partition: torch.Tensor) -> float:
    """The common scale c (a float) the solvers report energies and ledgers in, from the log-partitions.

    With L = max log m_h(x_i) over every batch entry, head and token (a log-sum-exp, finite for any
    β‖A‖) and R = log(finfo(dtype).max) (88.7 in float32, 709.8 in float64):

        c = 0             when L ≤ R/2   (no rescaling: values up to e^{R/2}, room to grow by R/2)
        c = ⌈L + R/4⌉     otherwise      (the largest kernel value starts at ≈ e^{−R/4}: room to grow
                                          by 5R/4 before overflow, while values 1/eps below the
                                          largest stay normal numbers)

    Returns 0.0 for an empty or non-finite input (the caller reports the non-finite field)."""
    lp = log_partition.detach()
    if lp.numel() == 0:
        return 0.0
    L = float(lp.max())
    if not math.isfinite(L):
        return 0.0
    R = math.log(torch.finfo(lp.dtype).max)
    return 0.0 if L <= R / 2 else float(math.ceil(L + R / 4))


def check_scale_fits(log_partition: torch.Tensor, log_scale: float, name: str = "energy_log_scale") -> None:
    """ValueError when a given common scale c makes the scaled values underflow at t0.

    With L = max log m_h(x_i) the largest log-partition, the largest scaled kernel value is e^{L − c}.
    When L − c < log(tiny/eps) (tiny the smallest normal number: −672 in float64, −71.4 in float32),
    every value within a factor 1/eps of the largest is subnormal or 0: the energy, 𝒢², 𝒟 and the
    ledger lose their digits (at c = 1e4 they are all exactly 0, and so is the residual).  The
    message gives the automatic scale (:func:`choose_log_scale`) and the largest c that fits."""
    lp = log_partition.detach()
    if lp.numel() == 0 or not bool(torch.isfinite(lp).all()):
        return  # the caller reports the non-finite field
    L = float(lp.max())
    fi = torch.finfo(lp.dtype)
    floor = math.log(fi.tiny / fi.eps)
    if L - log_scale < floor:
        raise ValueError(
            f"{name} = {log_scale:.6g} is too large for these tokens and heads: the values are reported times "
            f"e^(−{log_scale:.6g}) and the largest log-partition at t0 is {L:.6g}, so every kernel value is below "
            f"e^({L - log_scale:.4g}) < tiny/eps = e^({floor:.4g}) of {lp.dtype}: the energy, 𝒢², 𝒟 and the "
            f"ledger "
            f"would underflow to 0 (and the ledger residual with them).  Pass {name}=None (automatic: "
            f"c = {choose_log_scale(lp):.6g} here), or a value <= {math.floor(L - floor)}")


def overflow_check(value: torch.Tensor, what: str, log_value, log_scale: float, fix: str) -> torch.Tensor:
    """``value``, or OverflowError when it is not finite although its logarithm ``log_value`` (a tensor or a
    callable returning one) is: an overflow of the kernel, not bad input.  Internal, shared with mobility."""
    if bool(torch.isfinite(value.detach()).all()):
        return value
    lv = log_value() if callable(log_value) else log_value
    if lv is None or not bool(torch.isfinite(lv.detach()).all()):
        return value  # the inputs themselves are not finite: nothing to rescale
    big = float(lv.detach().max())
    R = math.log(torch.finfo(value.dtype).max)
    raise OverflowError(
        f"{what} overflows {value.dtype}: its logarithm is up to {big:.6g}, and minus log_scale = {log_scale:.6g} "
        f"that exceeds log(finfo.max) = {R:.4g}. {fix}"
    )


def _head_energies(x, heads: Heads, weights, log_scale: float):
    stats = softmax_statistics(x, heads, weights)
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    num = head_token_mean(scaled_exp(stats.log_partition, log_scale), weights)
    if not zero_beta(heads):
        return num / (2 * beta), stats
    # β = 0: the finite part ½ ∫∫⟨x, A_h y⟩ per head (module docstring)
    fp = lambda: 0.5 * pair_mean_scores(x, heads, weights) * math.exp(-log_scale)  # noqa: E731
    return over_two_beta(num, _head_beta(heads), fp), stats


def _head_beta(heads: Heads) -> Heads:
    """The heads with β shaped (..., 1) against per-head values (..., H)."""
    b = heads.beta
    return heads if not isinstance(b, torch.Tensor) or b.dim() == 0 else heads.replace(beta=b.unsqueeze(-1))


def _log_head_energies(x, heads: Heads, weights, stats) -> torch.Tensor:
    """log |E_h| by log-sum-exp, (..., H) (for the overflow messages; β = 0 is never reached there)."""
    lse = stats.log_partition
    if weights is None:
        per = torch.logsumexp(lse, -1) - math.log(x.shape[-2])
    else:
        per = torch.logsumexp(lse + torch.log(weights).unsqueeze(-2), -1)
    beta = heads.beta_tensor().abs()
    return per - torch.log(2 * (beta.unsqueeze(-1) if beta.dim() else beta))


def _phi1(z: torch.Tensor, log_scale: float) -> torch.Tensor:
    """e^{−c} φ₁(z) = e^{−c} (e^z − 1)/z, c = log_scale, without cancellation or overflow on the way:
    a Taylor polynomial for |z| < 10⁻³ (error < z⁶/5040), e^{z−c}(1 − e^{−z})/z for z > 0 and
    e^{−c} expm1(z)/z for z < 0."""
    small = z.abs() < 1e-3
    zs = torch.where(small, torch.ones_like(z), z)
    big = torch.where(zs > 0, torch.exp(zs - log_scale) * -torch.expm1(-zs), math.exp(-log_scale) * torch.expm1(zs))
    poly = 1 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z / 720))))
    return torch.where(small, math.exp(-log_scale) * poly, big / zs)


def _centered_head_energies(x, heads: Heads, weights, log_scale: float) -> torch.Tensor:
    """E_c,h e^{−c} = ½ Σ_ij w_i w_j s_ij e^{−c} φ₁(β s_ij), s_ij = ⟨x_i, A_h x_j⟩, (..., H): pairwise, the
    queries in chunks of about ``DEFAULT_CHUNK_ELEMENTS`` scores (memory O(n) per chunk row)."""
    A = heads.score_matrix
    beta = heads.beta_tensor().to(x.dtype)
    b = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
    n = x.shape[-2]
    batch = torch.broadcast_shapes(x.shape[:-2], A.shape[:-3], b.shape[:-3] if beta.dim() else ())
    H = A.shape[-3]
    rows = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, n * H * max(1, math.prod(batch))))
    wq = None if weights is None else weights.unsqueeze(-2)  # (..., 1, n)
    Ay = x.unsqueeze(-3) @ A.transpose(-1, -2)  # (..., H, n, d): rows A x_j
    total = 0.0
    for i0 in range(0, n, rows):
        xi = x[..., i0:i0 + rows, :].unsqueeze(-3)  # (..., 1, r, d)
        s = xi @ Ay.transpose(-1, -2)  # (..., H, r, n)
        t = s * _phi1(b * s, log_scale)
        inner = t.mean(-1) if weights is None else (t * wq.unsqueeze(-2)).sum(-1)  # (..., H, r)
        outer = inner.sum(-1) / n if weights is None else (inner * weights[..., i0:i0 + rows].unsqueeze(-2)).sum(-1)
        total = total + outer
    return 0.5 * total


_ENERGY_FIX = ("Use tp.log_energy(x, heads) (log E, finite for any β‖A‖) or pass log_scale=c with c ≥ that "
               "logarithm − 80, which returns E·e^(−c)")


def head_energies(x, heads: Heads, weights=None, *, log_scale: float = 0.0, centered: bool = False):
    """E_h · e^{−log_scale} with E_h = (1/(2β)) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}, (..., H) (no head weight ω_h).

    ``centered=True``: E_c,h = (1/(2β)) Σ_ij w_i w_j (e^{β s_ij} − 1), analytic in β (module docstring).  At
    β = 0 the reference form gives its finite part ½ Σ_ij w_i w_j ⟨x_i, A_h x_j⟩ (= E_c,h(0)).

    Raises
    ------
    OverflowError
        E_h e^{−log_scale} does not fit the dtype (the message gives log E_h and the fix)."""
    heads = check_inputs(x, heads, weights)
    c = check_log_scale(log_scale)
    _check_centered(centered)
    if centered:
        return _overflow_centered(_centered_head_energies(x, heads, weights, c), x, heads, weights, c)
    out, stats = _head_energies(x, heads, weights, c)
    return overflow_check(out, "the head energy E_h", lambda: _log_head_energies(x, heads, weights, stats), c,
                           _ENERGY_FIX)


def energy(x, heads: Heads, weights=None, *, log_scale: float = 0.0, centered: bool = False):
    """E(μ, Θ) · e^{−log_scale} with E = Σ_h ω_h E_h = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}, shape (...,).

    Parameters
    ----------
    x
        tokens (..., n, d).  heads: :class:`Heads` (any real β; β < 0 gives E < 0).  weights: token
        weights (..., n) or None.
    log_scale : float
        c; the result is E·e^{−c}, computed without forming E (finite whenever
        log E − c fits the dtype).  Default 0: E itself.
    centered : bool
        False (default): the reference convention above (docs/model.md#energy); at β = 0, where it has a
        pole, its finite part ½ Σ_h ω_h Σ_ij w_i w_j ⟨x_i, A_h x_j⟩.  True: the centred energy
        E_c = E − Σ_h ω_h/(2β) = Σ_h ω_h/(2β) Σ_ij w_i w_j (e^{β s_ij} − 1), analytic in β, computed pairwise
        with a stable (e^z − 1)/z (no loss of digits as β → 0; O(n²) work, O(n) memory per chunk row).

    Raises
    ------
    OverflowError
        E·e^{−c} overflows the dtype (β‖A‖ above ≈ 88 in float32, ≈ 709 in float64
        with c = 0); the message gives log E and suggests :func:`log_energy` or ``log_scale=``.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    >>> float(tp.energy(x, tp.Heads.scalar([1.0], 2).to(torch.float64)))  # (e + 1) / 2 / 2
    0.9295704571147613
    >>> E = tp.energy(x, tp.Heads.scalar([1000.0], 2).to(torch.float64), log_scale=1000.0)
    >>> round(float(E), 9)  # ((e^1000 + 1)/2)/2 · e^-1000
    0.25
    >>> float(tp.energy(x, tp.Heads.scalar([1.0], 2, beta=0.0).to(torch.float64)))  # ½ · mean of ⟨x_i, x_j⟩
    0.25
    """
    heads = check_inputs(x, heads, weights)
    c = check_log_scale(log_scale)
    _check_centered(centered)
    if centered:
        out = (heads.weights * _centered_head_energies(x, heads, weights, c)).sum(-1)
        return _overflow_centered(out, x, heads, weights, c)
    per, stats = _head_energies(x, heads, weights, c)
    out = (heads.weights * per).sum(-1)
    return overflow_check(out, "the energy E", lambda: _log_energy(x, heads, weights, stats), c, _ENERGY_FIX)


def _check_centered(centered) -> None:
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be True or False, got {type(centered).__name__}")


def _overflow_centered(out, x, heads, weights, c):
    return overflow_check(out, "the centred energy E_c", lambda: _log_energy(x, heads, weights,
                                                                            softmax_statistics(x, heads, weights)),
                          c, _ENERGY_FIX.replace("tp.log_energy(x, heads) (log E, finite for any β‖A‖) or ", ""))


def _log_energy(x, heads, weights, stats):
    return torch.logsumexp(_log_head_energies(x, heads, weights, stats) + torch.log(heads.weights), -1)


def log_energy(x, heads: Heads, weights=None):
    """log E, computed by log-sum-exp (finite where E itself overflows), (...,).

    Raises
    ------
    ValueError
        β ≤ 0 anywhere: E < 0 for β < 0 and E(0) is a finite part of either sign, so log E is not defined
        (use :func:`energy`, with ``log_scale=`` for large |β|‖A‖)."""
    heads = check_inputs(x, heads, weights)
    b = heads.beta
    if bool((b <= 0).any()) if isinstance(b, torch.Tensor) else b <= 0:
        raise ValueError("log_energy needs β > 0 (then E > 0); for β ≤ 0 the energy is negative (β < 0) or its "
                         "finite part at β = 0, of either sign: use tp.energy(x, heads, log_scale=c) instead")
    stats = softmax_statistics(x, heads, weights)
    lse = stats.log_partition
    logw_tok = 0.0 if weights is None else torch.log(weights).unsqueeze(-2)
    n = x.shape[-2]
    per_head = torch.logsumexp(lse + logw_tok, -1) - (torch.log(torch.tensor(float(n), dtype=x.dtype)) if weights is None else 0.0)
    beta = heads.beta_tensor()
    return torch.logsumexp(per_head + torch.log(heads.weights), -1) - torch.log(2 * beta)


def first_variation(x, heads: Heads, weights=None, *, at=None, log_scale: float = 0.0):
    """δE/δμ · e^{−log_scale} at the points ``at`` (default: the tokens), (..., m).

    Symmetric heads: Σ_h ω_h m_h(z)/β.  General A_h: Σ_h ω_h (m_h(z) + m̃_h(z))/(2β), with m̃
    the partition function of A_hᵀ.

    Raises
    ------
    OverflowError
        the result overflows the dtype; pass ``log_scale=`` (it is e^{−c} times δE/δμ).
    """
    heads = check_inputs(x, heads, weights)
    c = check_log_scale(log_scale)
    z = x if at is None else at
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    omega = heads.weights.unsqueeze(-1)
    lses = []

    def part(transpose):
        s = softmax_statistics(z, heads, weights, keys=x, transpose=transpose)
        lses.append(s.log_partition)
        return (omega * scaled_exp(s.log_partition, c)).sum(-2)

    if zero_beta(heads):  # the finite part at β = 0: Σ_h ω_h ⟨z, ½(A_h + A_hᵀ) x̄⟩ (module docstring)
        sym = heads.score_matrix
        xbar = x.mean(-2) if weights is None else (weights.unsqueeze(-1) * x).sum(-2)
        Ab = 0.5 * (xbar.unsqueeze(-2).unsqueeze(-2) @ (sym + sym.transpose(-1, -2))).squeeze(-2)  # (..., H, d)
        fp = lambda: (omega * (z.unsqueeze(-3) @ Ab.unsqueeze(-1)).squeeze(-1)).sum(-2) * math.exp(-c)  # noqa: E731
        num = part(False) if heads.is_symmetric else 0.5 * (part(False) + part(True))
        out = over_two_beta(2 * num, _head_beta(heads), fp)
    elif heads.is_symmetric:
        out = part(False) / beta
    else:
        out = (part(False) + part(True)) / (2 * beta)
    return overflow_check(out, "the first variation δE/δμ", lambda: torch.stack([l.amax(-2) for l in lses]), c,
                           "Pass log_scale=c (the result is δE/δμ·e^(−c)) with c near the log-partition reached")


def pairing(x, heads: Heads, weights, stats: HeadStats, M: torch.Tensor, *, log_scale: float = 0.0) -> torch.Tensor:
    """e^{−c} Σ_h ω_h ½ Σ_i w_i m_h(x_i) ⟨x_i, M_h ȳ_h(x_i)⟩ = e^{−c} ⟨∂_A E, M⟩, (...,), c = log_scale.

    With M = Ȧ this is ∂_tE; with M = σ ΔW_sym it is the martingale increment.  ``stats`` are the
    (non-causal) kernel statistics of the tokens x under the heads; M (..., H, d, d)."""
    # T_h = Σ_i w_i m_h(x_i) x_i ȳ_hiᵀ (d×d per head), then ⟨M_h, T_h⟩_F: O(H n d²) in one
    # batched product instead of forming M_hᵀ x_i for every token
    # T depends on (x, weights, c) and the statistics only: a solver step pairs the same statistics
    # with Ȧ (∂_tE) and with the noise (martingale), so T is kept on the statistics for the next call
    # the fused kernel's statistics give T (and the Itô sums) in one product of its value columns
    sums = head_moment_sums(stats, weights, log_scale, x)
    if sums is not None:
        T = sums[0]
    else:
        key = (x._version, None if weights is None else weights._version, stats.log_partition._version,
               stats.mean._version, float(log_scale))
        cached = getattr(stats, "_pairing_moment", None)
        T = cached[3] if cached is not None and cached[0] is x and cached[1] is weights and cached[2] == key else None
    if T is None:
        mw = scaled_exp(stats.log_partition, log_scale)  # (..., H, n)
        mw = mw / x.shape[-2] if weights is None else mw * weights.unsqueeze(-2)
        T = (mw.unsqueeze(-1) * stats.mean).transpose(-1, -2) @ x.unsqueeze(-3)  # (..., H, d, d): T_ba
        if not T.requires_grad:
            stats._pairing_moment = (x, weights, key, T)
    per_head = (T.transpose(-1, -2) * M).sum((-1, -2))
    return 0.5 * (heads.weights * per_head).sum(-1)


def ito_correction(heads: Heads, weights, stats: HeadStats, sigma, *, log_scale: float = 0.0) -> torch.Tensor:
    """e^{−c} Σ_h ω_h ½ (β σ_h²/4) Σ_i w_i m_h(x_i) (1 + q_h(x_i)), (...,); needs stats.second.

    sigma: float, or tensor broadcasting against (..., H).  It is E[½ ∂²_A E[σ dW_sym, σ dW_sym]]/dt
    (the expectation of :func:`quadratic_variation` per unit time)."""
    sums = head_moment_sums(stats, weights, log_scale)
    if sums is not None and sums[1] is not None:  # the fused kernel's columns: no per-token quadratic form
        per_head = sums[1]
    else:
        per_head = head_token_mean(scaled_exp(stats.log_partition, log_scale) * (1 + stats.second), weights)
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    sig2 = sigma * sigma
    return (heads.weights * 0.5 * beta * sig2 / 4 * per_head).sum(-1)


def quadratic_variation(x, heads: Heads, weights, stats: HeadStats, increment: torch.Tensor, *,
                        log_scale: float = 0.0, causal: bool = False) -> torch.Tensor:
    """The realised second-order term ½ ∂²_A E[ΔN, ΔN] · e^{−c} of a weight increment ΔN, (...,).

        ½ ∂²_A E[ΔN, ΔN] = Σ_h ω_h (β/4) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩} ⟨x_i, ΔN_h x_j⟩²
                         = Σ_h ω_h (β/4) Σ_i w_i m_h(x_i) Σ_j p_ij^h ⟨x_i, ΔN_h x_j⟩²

    (p^h the softmax weights of head h).  Booked per step instead of the Itô correction, it makes a
    single noisy path's energy ledger close at order 1 in dt (the Itô correction is its expectation
    given the state, so one path's residual only falls like dt^{1/2}).  For E of the whole measure
    ``causal`` is False; with True the inner sum runs over j ≤ i (the prefix measures).

    Parameters
    ----------
    x
        tokens (..., n, d).  heads: the heads at the left end of the step.
    weights
        token weights (..., n) or None.  stats: their kernel statistics (log-partitions used).
    increment : torch.Tensor
        ΔN (..., H, d, d), the martingale part of the weights' increment.
    log_scale : float
        c; the result is multiplied by e^{−c} (see the module docstring).

    Memory: one (..., H, n, n) block (forms the pairwise kernel; used by the ledger only)."""
    A = heads.score_matrix
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.unsqueeze(-1)
    beta4 = beta if isinstance(beta, float) else beta.unsqueeze(-1).unsqueeze(-1)  # (..., 1, 1, 1)
    xs = x.unsqueeze(-3)  # (..., 1, n, d)
    S = (xs @ A) @ xs.transpose(-1, -2)  # (..., H, n, n): ⟨x_i, A_h x_j⟩
    logp = beta4 * S - stats.log_partition.unsqueeze(-1)
    n = x.shape[-2]
    if weights is not None:
        logp = logp + torch.log(weights).unsqueeze(-2).unsqueeze(-3)
    else:
        logp = logp - math.log(n)
    if causal:
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        logp = logp.masked_fill(mask, float("-inf"))
    Q = ((xs @ increment) @ xs.transpose(-1, -2)).square()  # ⟨x_i, ΔN_h x_j⟩²
    inner = (torch.exp(logp) * Q).sum(-1)  # (..., H, n)
    per_head = head_token_mean(scaled_exp(stats.log_partition, log_scale) * inner, weights)
    return (heads.weights * (beta / 4) * per_head).sum(-1)


def energy_time_derivative(x, heads: Heads, score_rate: torch.Tensor, weights=None, *, sigma=0.0,
                           log_scale: float = 0.0):
    """∂_tE · e^{−log_scale} along deterministic weights with Ȧ_h = score_rate (..., H, d, d), plus the
    Itô correction when sigma > 0 (noise σ dW_sym on every A_h).  Shape (...,).

    Raises
    ------
    OverflowError
        the result overflows the dtype; pass ``log_scale=``."""
    heads = check_inputs(x, heads, weights)
    c = check_log_scale(log_scale)
    if not isinstance(score_rate, torch.Tensor) or score_rate.shape[-3:] != heads.score_matrix.shape[-3:]:
        raise ValueError("score_rate must be a tensor of shape (..., H, d, d) like the heads' scores")
    noisy = not (isinstance(sigma, (int, float)) and sigma == 0)
    stats = softmax_statistics(x, heads, weights, second_moment=noisy)
    out = pairing(x, heads, weights, stats, score_rate, log_scale=c)
    if noisy:
        out = out + ito_correction(heads, weights, stats, sigma, log_scale=c)
    return overflow_check(out, "∂_tE", lambda: stats.log_partition, c,
                           "Pass log_scale=c (the result is ∂_tE·e^(−c)) with c near the log-partition reached")
