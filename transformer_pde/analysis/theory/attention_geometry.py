"""Attention entropy and approximately orthogonal heads, measured on the particle system (docs/model.md#theory).

Pendharkar's items 6 and 7: the entropy of the attention rows and its rate dH/dt = −Cov(s, ṡ); principal
angles between head subspaces, heads at a prescribed angle, and the cross-head coupling they leave.  The
notation is that of :mod:`.particles`; re-exported by :mod:`transformer_pde.analysis.diagnostics`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_int, check_positive, check_same, check_tensor, direction_sign
from ...model.softmax import softmax_statistics
from ...model.field import evaluate
from ...model.heads import Heads
from ...model.normalization import NORMALIZATIONS, choose as choose_normalization
from .particles import (OUTPUT_NORMALIZATIONS, beta_factor, check_any, dense_scores, head_outputs_of, log_weights,
                        orthogonality_defect)

__all__ = ["attention_probabilities", "attention_entropy", "entropy_rate", "principal_angles",
           "approximately_orthogonal_heads", "cross_head_coupling"]


# ---------------------------------------------------------------------------- attention entropy
def attention_probabilities(x, heads: Heads, weights=None):
    """p_ij^h = w_j e^{s_ij^h} / Σ_l w_l e^{s_il^h} (softmax by log-sum-exp), (..., H, n, n), dense."""
    heads = check_any(x, heads, weights, on_sphere=True)
    L = dense_scores(x, heads) + log_weights(x, weights).unsqueeze(-2).unsqueeze(-2)
    return torch.softmax(L, dim=-1)


def attention_entropy(x, heads: Heads, weights=None):
    """Attention entropy H_i^h = −Σ_j p_ij^h ln p_ij^h of every head and query, (..., H, n).

    Softmax heads; 0 ≤ H_i^h ≤ ln(#tokens of positive weight) (= ln n, uniform attention)."""
    heads = check_any(x, heads, weights, on_sphere=True)
    L = dense_scores(x, heads) + log_weights(x, weights).unsqueeze(-2).unsqueeze(-2)
    logp = L - torch.logsumexp(L, -1, keepdim=True)
    p = torch.exp(logp)
    # zero-weight tokens: p = 0, ln p = −inf; mask before multiplying (finite values and gradients)
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def entropy_rate(x, heads: Heads, weights=None, *, velocity: Optional[torch.Tensor] = None,
                 normalization: str = "softmax", direction: str = DEFAULT_DIRECTION,
                 score_rate: Optional[torch.Tensor] = None):
    """Entropy production dH_i^h/dt = −Cov_{p_i^h}(s_i·^h, ṡ_i·^h), (..., H, n).

    ṡ_ij^h = β(⟨ẋ_i, A_h x_j⟩ + ⟨x_i, A_h ẋ_j⟩ + ⟨x_i, Ȧ_h x_j⟩) and Cov_p(a, b) = Σ_j p_j a_j b_j −
    (Σ_j p_j a_j)(Σ_j p_j b_j).  (With non-uniform token weights the first argument is
    s_ij + ln w_j; both follow from H = −Σ p ln p and ṗ_j = p_j(ṡ_j − Σ_l p_l ṡ_l).)  The identity
    holds for any heads and any motion: ẋ is ``velocity`` when given, else the library's field
    of ``normalization``/``direction``; ``score_rate`` Ȧ_h (..., H, d, d) for moving heads.

    Returns
    -------
    result
        (..., H, n); dtype and device follow x.

    Raises
    ------
    TypeError, ValueError
        for bad tokens, heads, weights, velocity or score_rate shapes.
    """
    normalization = choose_normalization(normalization, NORMALIZATIONS)
    direction_sign(direction)
    heads = check_any(x, heads, weights, on_sphere=True)
    if velocity is None:
        velocity = evaluate(x, heads, weights, normalization=normalization, sign=direction_sign(direction),
                            diagnostics=False).velocity
    else:
        check_tensor(velocity, "velocity")
        check_same(x, velocity, "x", "velocity")
        if velocity.shape[-2:] != x.shape[-2:]:
            raise ValueError(f"velocity must have the shape (..., n, d) of x, got {tuple(velocity.shape)}")
    A = heads.score_matrix
    xs, vs = x.unsqueeze(-3), velocity.unsqueeze(-3)
    sdot = vs @ A @ xs.transpose(-1, -2) + xs @ A @ vs.transpose(-1, -2)
    if score_rate is not None:
        check_tensor(score_rate, "score_rate", min_dim=3)
        if score_rate.shape[-3:] != A.shape[-3:]:
            raise ValueError(f"score_rate must have shape (..., H, d, d) = (..., {A.shape[-3]}, {A.shape[-1]}, "
                             f"{A.shape[-1]}), got {tuple(score_rate.shape)}")
        sdot = sdot + xs @ score_rate @ xs.transpose(-1, -2)
    sdot = beta_factor(heads, 3) * sdot
    L = dense_scores(x, heads) + log_weights(x, weights).unsqueeze(-2).unsqueeze(-2)
    p = torch.softmax(L, dim=-1)
    Lm = torch.where(p > 0, L, torch.zeros_like(L))  # zero-weight tokens (L = −inf) carry p = 0
    Lc = Lm - (p * Lm).sum(-1, keepdim=True)
    sc = sdot - (p * sdot).sum(-1, keepdim=True)
    return -(p * Lc * sc).sum(-1)


# ---------------------------------------------------------------------------- orthogonality
def principal_angles(A: torch.Tensor, B: torch.Tensor, *, rank_tol: float = 1e-8) -> torch.Tensor:
    """Principal angles (radians, ascending) between the column spaces of A (d, p) and B (d, q).

    Orthonormal bases from the SVD (singular values above rank_tol·σ_max), then
    cos θ_k = the singular values of U_Aᵀ U_B.  For symmetric heads pass A_h and A_k: the angles
    between their ranges; ‖P_A P_B‖₂ = cos θ_min."""
    for t, nm in ((A, "A"), (B, "B")):
        check_tensor(t, nm, min_dim=2)
        if t.dim() != 2:
            raise ValueError(f"{nm} must be a matrix (d, p), got shape {tuple(t.shape)}")
    check_same(A, B, "A", "B")
    if A.shape[0] != B.shape[0]:
        raise ValueError(f"A and B must have the same number of rows d, got {A.shape[0]} and {B.shape[0]}")

    def basis(M):
        U, S, _ = torch.linalg.svd(M, full_matrices=False)
        r = int((S > rank_tol * S.max().clamp_min(torch.finfo(M.dtype).tiny)).sum())
        if r == 0:
            raise ValueError("a matrix with zero column space has no principal angles")
        return U[:, :r]

    c = torch.linalg.svdvals(basis(A).T @ basis(B)).clamp(-1.0, 1.0)
    return torch.sort(torch.arccos(c)).values


def approximately_orthogonal_heads(H: int, k: int, angle: float, *, alpha: float = 1.0, beta: float = 1.0,
                                   weights=None, dtype=None, device=None) -> Heads:
    """H symmetric heads A_h = V_h = α U_h U_hᵀ on k-dimensional subspaces with all pairwise
    principal angles equal to ``angle`` (degrees, in (0, 90]); d = (H + 1) k.

    U_h = cos θ B_h + sin θ C with disjoint coordinate blocks B_h, a shared block C and
    sin²θ = cos(angle), so U_hᵀ U_k = cos(angle) I (h ≠ k) and δ = ‖A_h A_k‖₂ = α² cos(angle)
    (angle = 90°: exactly orthogonal heads).  Head weights default to ω_h = 1 (Pendharkar)."""
    H = check_int(H, "H")
    k = check_int(k, "k")
    angle = check_positive(angle, "angle")
    if angle > 90:
        raise ValueError(f"angle must be in (0, 90] degrees, got {angle}")
    alpha = check_positive(alpha, "alpha")
    dtype = dtype or torch.get_default_dtype()
    d = (H + 1) * k
    c = math.cos(math.radians(angle))
    theta = math.asin(math.sqrt(max(c, 0.0)))
    U = torch.zeros(H, d, k, dtype=dtype, device=device)
    eye = torch.eye(k, dtype=dtype, device=device)
    for h in range(H):  # builder, not hot code
        U[h, h * k:(h + 1) * k] = math.cos(theta) * eye
        U[h, H * k:] = math.sin(theta) * eye
    A = alpha * (U @ U.transpose(-1, -2))
    A = 0.5 * (A + A.transpose(-1, -2))
    if weights is None:
        weights = torch.ones(H, dtype=dtype, device=device)
    return Heads.symmetric(A, beta=beta, weights=weights)


def cross_head_coupling(x, heads: Heads, weights=None, *, normalization: str = "unnormalized"):
    """Cross-head coupling ⟨f_h(x_i), f_k(x_i)⟩ and its orthogonality bound, each (..., H, H, n).

        |⟨f_h, f_k⟩| ≤ δ_hk · mass_h(x_i) · mass_k(x_i),   δ_hk = ‖V_hᵀ V_k‖₂,

    with mass = m_h (unnormalized), 1 (softmax) or Σ_j w_j ReLU(s_ij) (relu), because
    f_h = Σ_j w_j κ_ij V_h x_j with κ ≥ 0 and unit x_j.  The diagonal h = k is ‖f_h‖² (bound
    set to inf there).  Returns (coupling, bound)."""
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    heads = check_any(x, heads, weights, on_sphere=True)
    f = head_outputs_of(x, heads, weights, normalization)
    inner = (f.unsqueeze(-3) * f.unsqueeze(-4)).sum(-1)
    if normalization.rule == "unnormalized":
        mass = torch.exp(softmax_statistics(x, heads, weights).log_partition)
    elif normalization.plain_softmax:
        mass = torch.ones(f.shape[:-1], dtype=x.dtype, device=x.device)
    else:
        S = dense_scores(x, heads)
        w = torch.exp(log_weights(x, weights)).unsqueeze(-2).unsqueeze(-2)
        mass = (torch.relu(S) * w).sum(-1)
    delta = orthogonality_defect(heads)
    bound = delta.unsqueeze(-1) * mass.unsqueeze(-2) * mass.unsqueeze(-3)
    H = f.shape[-3]
    eye = torch.eye(H, dtype=torch.bool, device=x.device).unsqueeze(-1)
    return inner, bound.masked_fill(eye, math.inf)


