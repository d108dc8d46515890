"""Attention kernels: per-head partition functions and attention-weighted moments.

For queries x_i, keys y_j with weights w_j and head h, the scores are

    s_ij^h = β ⟨x_i, A_h y_j⟩          (or β ⟨Q_h x_i, K_h y_j⟩ when factors are kept)

and the kernels return, for every head and query,

    log m_h(x_i) = log Σ_j w_j e^{s_ij^h}                       (log-partition, by log-sum-exp)
    ȳ_h(x_i)    = Σ_j p_ij^h y_j,    p_ij^h = w_j e^{s_ij^h} / m_h(x_i)   (softmax mean of keys)
    q_h(x_i)    = Σ_j p_ij^h ⟨x_i, y_j⟩²                        (optional second moment)

The per-head softmax output is then f_h = V_h ȳ_h: the d×d value matrix is applied after
the n×m reduction, so the (paths, heads, n, m) work is one score matmul, one exp pass and
one matmul with the d-column key matrix, shared by all heads.

Memory: the score block is formed ``chunk`` query rows at a time, so the peak extra memory
is ``batch · H · chunk · m`` elements (``DEFAULT_CHUNK_ELEMENTS`` by default) instead of
``batch · H · n · m``.  Without autograd the block is exponentiated in place.  With autograd
(any input requires grad) an out-of-place ``logsumexp``/``exp`` path is used so that
gradients flow to x, A, V, β and the token weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .heads import Heads

__all__ = ["HeadStats", "softmax_statistics", "relu_statistics", "DEFAULT_CHUNK_ELEMENTS"]

#: elements of one score block (batch · H · rows · m); 2^22 float64 = 32 MiB
DEFAULT_CHUNK_ELEMENTS = 1 << 22


@dataclass
class HeadStats:
    """Per-head kernel statistics at the queries.

    log_partition: (..., H, n)  log m_h(x_i)
    mean:          (..., H, n, d)  ȳ_h(x_i)
    second:        (..., H, n) or None  Σ_j p_ij ⟨x_i, y_j⟩²
    """

    log_partition: torch.Tensor
    mean: torch.Tensor
    second: Optional[torch.Tensor] = None


def _features(heads: Heads, transpose: bool = False):
    """(left, right) with scores s = β (x @ left)(y @ right)ᵀ; right None means identity."""
    beta = heads.beta
    if isinstance(beta, torch.Tensor) and beta.dim() > 0:
        beta = beta[..., None, None, None]
    if heads.score is not None:
        A = heads.score.transpose(-1, -2) if transpose else heads.score
        return beta * A, None
    Q, K = (heads.key, heads.query) if transpose else (heads.query, heads.key)
    return beta * Q.transpose(-1, -2), K.transpose(-1, -2)


def _rows_per_chunk(batch_numel: int, n: int, m: int, chunk_elements: Optional[int]) -> int:
    budget = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    return max(1, min(n, budget // max(1, batch_numel * m)))


def _needs_grad(*ts) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def softmax_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    keys: Optional[torch.Tensor] = None,
    second_moment: bool = False,
    transpose: bool = False,
    chunk_elements: Optional[int] = None,
) -> HeadStats:
    """Log-partitions and softmax moments of every head at the queries ``x``.

    Args:
        x: queries (..., n, d).  keys: (..., m, d), default x (self-attention).
        heads: the heads (batch dims broadcast against x's).
        weights: key weights (..., m) summing to 1, or None (uniform 1/m).
        second_moment: also return q_h(x_i) = Σ_j p_ij ⟨x_i, y_j⟩² (Itô correction).
        transpose: use A_hᵀ instead of A_h (the other half of δE/δμ for non-symmetric A).
        chunk_elements: cap on the elements of one score block (memory ~ this, not n·m).

    Inputs are not validated here (this is the hot path); the public functions do it.
    """
    y = x if keys is None else keys
    left, right = _features(heads, transpose)
    qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
    H, n, m, d = qf.shape[-3], x.shape[-2], y.shape[-2], y.shape[-1]
    logw = None if weights is None else torch.log(weights).unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, m)
    grad = _needs_grad(x, y, left, right, weights)
    # values the softmax averages: y, and y ⊗ y for the second moment when d is small
    aug = second_moment and d * d <= 64
    vals = y
    if aug:
        vals = torch.cat([y, (y.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)], -1)  # (..., m, d + d²)
    if right is None:
        # keys shared by all heads: fold the heads into the rows of one GEMM per batch
        kT = y.transpose(-1, -2).unsqueeze(-3)  # (..., 1, k, m)
    else:
        kT = (y.unsqueeze(-3) @ right).transpose(-1, -2)  # (..., H, k, m)
    batch = torch.broadcast_shapes(qf.shape[:-3], kT.shape[:-3])
    rows = _rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
    vals_b = vals.unsqueeze(-3)  # (..., 1, m, c)

    def gemm(a, b):
        """a (..., H, c, k) @ b (..., 1|H, k, m), with the heads folded into rows when b is shared."""
        if b.shape[-3] == 1 and a.shape[-3] > 1:
            c = a.shape[-2]
            out = a.reshape(*a.shape[:-3], a.shape[-3] * c, a.shape[-1]) @ b.squeeze(-3)
            return out.reshape(*out.shape[:-2], a.shape[-3], c, out.shape[-1])
        return a @ b

    lses, means, seconds = [], [], []
    for i0 in range(0, n, rows):
        S = gemm(qf[..., i0:i0 + rows, :], kT)  # (..., H, c, m)
        if logw is not None:
            S = S + logw if grad else S.add_(logw)
        if grad:
            lse = torch.logsumexp(S, -1)
            P = torch.exp(S - lse.unsqueeze(-1))
            Z = None
        else:
            mx = S.amax(-1, keepdim=True)
            # rows whose keys all have weight zero would give -inf - -inf; keep them finite
            mx = torch.nan_to_num(mx, neginf=0.0) if logw is not None else mx
            P = S.sub_(mx).exp_()
            Z = P.sum(-1)
            lse = mx.squeeze(-1) + torch.log(Z)
        mom = gemm(P, vals_b)  # (..., H, c, d[+d²])
        if Z is not None:
            mom = mom / Z.unsqueeze(-1)
        means.append(mom[..., :d])
        if second_moment:
            xc = x[..., i0:i0 + rows, :]
            if aug:
                xx = (xc.unsqueeze(-1) * xc.unsqueeze(-2)).flatten(-2).unsqueeze(-3)  # (..., 1, c, d²)
                seconds.append((mom[..., d:] * xx).sum(-1))
            else:
                q = (xc @ y.transpose(-1, -2)).square().unsqueeze(-3)  # (..., 1, c, m)
                sec = (P * q).sum(-1)
                seconds.append(sec if Z is None else sec / Z)
        lses.append(lse)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, -1)
    mean = means[0] if len(means) == 1 else torch.cat(means, -2)
    if weights is None:
        lse = lse - math.log(m)
    second = None
    if second_moment:
        second = seconds[0] if len(seconds) == 1 else torch.cat(seconds, -1)
    return HeadStats(lse, mean, second)


def relu_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    keys: Optional[torch.Tensor] = None,
    chunk_elements: Optional[int] = None,
):
    """ReLU attention moments: mass_h(x_i) = Σ_j w_j ReLU(s_ij), first_h(x_i) = Σ_j w_j ReLU(s_ij) y_j.

    Returns (mass (..., H, n), first (..., H, n, d)).  The ReLU head output is f_h = V_h first_h.
    """
    y = x if keys is None else keys
    left, right = _features(heads)
    qf = x.unsqueeze(-3) @ left
    kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right
    kfT = kf.transpose(-1, -2)
    yv = y.unsqueeze(-3)
    n, m = x.shape[-2], y.shape[-2]
    wv = None if weights is None else weights.unsqueeze(-2).unsqueeze(-2)
    batch = torch.broadcast_shapes(qf.shape[:-2], kfT.shape[:-2])
    rows = _rows_per_chunk(math.prod(batch), n, m, chunk_elements)
    masses, firsts = [], []
    for i0 in range(0, n, rows):
        R = torch.relu(qf[..., i0:i0 + rows, :] @ kfT)
        R = R / m if wv is None else R * wv
        masses.append(R.sum(-1))
        firsts.append(R @ yv)
    mass = masses[0] if len(masses) == 1 else torch.cat(masses, -1)
    first = firsts[0] if len(firsts) == 1 else torch.cat(firsts, -2)
    return mass, first
