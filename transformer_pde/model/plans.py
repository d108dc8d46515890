"""Attention plans other than the softmax rows: the per-head averages of the keys under another plan.

For queries x_i, keys y_j with weights w_j and head h (scores s_ij^h = β ⟨x_i, A_h y_j⟩), each kernel here
returns the key averages Σ_j P_ij^h y_j of its plan P^h, from which the normalisation's output is
f_h = V_h Σ_j P_ij^h y_j (:mod:`transformer_pde.model.normalization`):

    ReLU      P_ij = w_j ReLU(s_ij)           (not normalised: :func:`relu_statistics` returns the mass too)
    Sinkhorn  P_ij = w_j e^{s_ij + f_i + g_j}  (doubly stochastic: Σ_j P_ij = 1, Σ_i w_i P_ij → w_j; :func:`sinkhorn_plan`)
    hardmax   P_ij = w_j 1[s_ij = max_k s_ik] / Σ_{k: s_ik = max} w_k   (β → ∞ of softmax; :func:`hardmax_plan`)

:func:`plan_average` forms the scores of every head at once, (..., H, n, m) (memory H·n·m per batch
entry: the Sinkhorn plan couples all rows; the plans of :data:`ROWWISE` in blocks of query rows of at most
``chunk_elements`` scores), masks the keys above the diagonal when causal, applies a plan of :data:`PLANS`
(or a callable with the same signature) and returns Σ_j P_ij y_j.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from .backends import (
    bshape, causal_block_mask, causal_log_prefix_mass, check_backend, check_causal, check_chunk, needs_grad,
    rows_per_chunk, select_backend,
)
from .heads import Heads
from .normalization import check_sinkhorn_rounds
from .softmax import score_features

__all__ = ["relu_statistics", "plan_average", "sinkhorn_plan", "sinkhorn_tolerance", "hardmax_plan", "PLANS",
           "ROWWISE"]



def relu_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    keys: Optional[torch.Tensor] = None,
    chunk_elements: Optional[int] = None,
    backend: str = "auto",
    causal: bool = False,
):
    """ReLU attention moments: mass_h(x_i) = Σ_j w_j ReLU(s_ij), first_h(x_i) = Σ_j w_j ReLU(s_ij) y_j.

    Returns (mass (..., H, n), first (..., H, n, d)).  The ReLU head output is f_h = V_h first_h.
    Memory ~ chunk_elements; "dense" uses one block; "sdpa" does not apply (no softmax) and
    means "chunked"; "keops" needs pykeops.  With autograd an out-of-place path is used.
    causal: the moments of the prefix measure, Σ_{j≤i} w_j ReLU(s_ij) [1, y_j] / Σ_{j≤i} w_j
    (module docstring); needs keys=None.
    """
    check_backend(backend)
    check_chunk(chunk_elements)
    check_causal(causal, keys)
    y = x if keys is None else keys
    left, right = score_features(heads)
    qf = x.unsqueeze(-3) @ left
    kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right
    n, m, d = x.shape[-2], y.shape[-2], y.shape[-1]
    H = qf.shape[-3]
    batch = bshape(qf.shape[:-3], kf.shape[:-3], () if weights is None else weights.shape[:-1])
    # "keops" raises the install hint when pykeops is missing; ReLU sums then run chunked
    chosen = select_backend(backend, x.device, x.dtype, math.prod(batch) * H * n * m)
    vals = torch.cat([torch.ones_like(y[..., :1]), y], -1)  # (..., m, 1 + d)
    vals = vals / m if weights is None else vals * weights.unsqueeze(-1)
    vT = vals.unsqueeze(-3)  # (..., 1, m, 1 + d)
    kfT = kf.transpose(-1, -2)
    grad = needs_grad(x, y, left, right, weights)
    if chosen == "dense":
        rows = n
    else:
        rows = rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
    outs = []
    for i0 in range(0, n, rows):
        S = qf[..., i0:i0 + rows, :] @ kfT
        R = torch.relu(S) if grad else S.relu_()
        if causal:
            cmask = causal_block_mask(torch.arange(i0, min(n, i0 + rows), device=x.device), m)
            R = R.masked_fill(cmask, 0.0) if grad else R.masked_fill_(cmask, 0.0)
        outs.append(R @ vT)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -2)
    if causal:  # divide by the prefix mass W_i
        inv_mass = torch.exp(-causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device))
        out = out * inv_mass.unsqueeze(-1).unsqueeze(-3)
    return out[..., 0], out[..., 1:]



def sinkhorn_tolerance(dtype: torch.dtype) -> float:
    """The default stopping tolerance of :func:`sinkhorn_plan`: 10·ε^{2/3} of the dtype (3.7e-10 in float64,
    3.8e-5 in float32), above the rounding of the log-sum-exps (about n·ε) and far below the 0.2–3 % that
    ten fixed rounds leave at moderate β."""
    return 10.0 * torch.finfo(dtype).eps ** (2.0 / 3.0)


def sinkhorn_plan(scores: torch.Tensor, log_key_weights: torch.Tensor, log_query_weights: Optional[torch.Tensor],
                  *, iterations: Optional[int] = None, tol: Optional[float] = None,
                  max_iterations: int = 1000) -> torch.Tensor:
    """The row-normalised Sinkhorn plan P_ij = e^{s_ij + f_i + g_j} w_j, (..., H, n, m), in the log domain.

        f_i ← −log Σ_j w_j e^{s_ij + g_j}   (g = 0 first: the softmax rows), then rounds of
        g_j ← −log Σ_i w_i e^{s_ij + f_i},   f_i ← −log Σ_j w_j e^{s_ij + g_j}

    Rows sum to one; Σ_i w_i P_ij = w_j up to the convergence of the rounds.  With ``iterations`` None the
    rounds stop once every column is within ``tol`` of its marginal (max_j |log(Σ_i w_i P_ij / w_j)| ≤ tol,
    checked before each round, over every system and head), or after ``max_iterations`` rounds, with a
    warning; with an int ``iterations`` exactly that many rounds are taken (0: softmax).

    Parameters
    ----------
    scores : torch.Tensor
        s_ij (..., H, n, m).
    log_key_weights : torch.Tensor
        log w_j, broadcasting as (..., 1, 1, m).
    log_query_weights : torch.Tensor or None
        log w_i, broadcasting as (..., 1, n, 1); None when the queries are not the tokens of μ.
    iterations : int or None
        a fixed number of column-and-row rounds after the first row normalisation (at most
        :data:`transformer_pde.model.normalization.MAX_SINKHORN_ITERATIONS`), or None: until ``tol``.
    tol : float or None
        the stopping tolerance on the columns' log marginal error (None: :func:`sinkhorn_tolerance` of the
        scores' dtype); only with ``iterations`` None.
    max_iterations : int
        the cap on the rounds with ``iterations`` None.

    Returns
    -------
    torch.Tensor
        P (..., H, n, m).

    Raises
    ------
    ValueError
        without query weights (the plan needs the queries' marginal: call without ``keys=``), or bad
        ``iterations``, ``tol`` or ``max_iterations`` (:func:`transformer_pde.model.normalization.check_sinkhorn_rounds`).
    """
    if log_query_weights is None:
        raise ValueError("Sinkhorn attention needs the queries to be the tokens of the measure (both marginals are "
                         "the token weights); call without keys=")
    check_sinkhorn_rounds(iterations, tol, max_iterations)
    tol = sinkhorn_tolerance(scores.dtype) if tol is None else float(tol)
    g = 0.0
    f = -torch.logsumexp(scores + log_key_weights, -1, keepdim=True)
    rounds = max_iterations if iterations is None else iterations
    for k in range(rounds + (iterations is None)):
        g_new = -torch.logsumexp(scores + f + log_query_weights, -2, keepdim=True)
        if iterations is None:
            # the columns of the current plan are e^{g − g_new} times their marginals; rows without a finite
            # sum (no key of positive weight) have no column error to reduce
            gap = (g - g_new).detach()
            gap = torch.where(torch.isfinite(gap), gap.abs(), torch.zeros_like(gap))
            if not gap.numel() or float(gap.max()) <= tol:
                break
            if k == rounds:
                warnings.warn(f"Sinkhorn attention: the columns are still {float(gap.max()):.3g} (log) from their "
                              f"marginals after max_iterations={rounds} rounds (tol {tol:.3g}); raise "
                              f"SinkhornAttention(max_iterations=...) or lower β", RuntimeWarning, stacklevel=2)
                break
        g = g_new
        f = -torch.logsumexp(scores + g + log_key_weights, -1, keepdim=True)
    return torch.exp(scores + f + g + log_key_weights)



def hardmax_plan(scores: torch.Tensor, log_key_weights: torch.Tensor, log_query_weights=None) -> torch.Tensor:
    """The hardmax plan P_ij = w_j 1[j ∈ M_i] / Σ_{k ∈ M_i} w_k, M_i the keys of positive weight whose score is
    the row maximum (ties: within 16 ulp of the row's largest |s_ij|), (..., H, n, m).

    Parameters
    ----------
    scores : torch.Tensor
        s_ij (..., H, n, m) (−∞ for masked keys).
    log_key_weights : torch.Tensor
        log w_j, broadcasting as (..., 1, 1, m).
    log_query_weights
        unused (the plan is row by row).

    Returns
    -------
    torch.Tensor
        P (..., H, n, m)."""
    s = scores.masked_fill(torch.isneginf(log_key_weights), float("-inf"))
    finite = torch.isfinite(s)
    top = s.amax(-1, keepdim=True)
    scale = torch.where(finite, s.abs(), torch.zeros_like(s)).amax(-1, keepdim=True)
    tie = finite & (s >= top - 16 * torch.finfo(s.dtype).eps * scale)
    mass = torch.where(tie, torch.exp(log_key_weights), torch.zeros_like(s))
    return mass / mass.sum(-1, keepdim=True)


#: the plans :func:`plan_average` applies by name (the ``statistics`` of their normalisations)
PLANS = {"sinkhorn": sinkhorn_plan, "hardmax": hardmax_plan}

#: the plans whose rows are independent of each other: :func:`plan_average` forms their scores in row blocks
ROWWISE = frozenset({"hardmax"})


def plan_average(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor], plan, *,
                 keys: Optional[torch.Tensor] = None, causal: bool = False, chunk_elements: Optional[int] = None,
                 **params) -> torch.Tensor:
    """Σ_j P_ij^h y_j for the plan P^h of the scores s_ij^h = β⟨x_i, A_h y_j⟩ of every head, (..., H, n, d).

    Parameters
    ----------
    x : torch.Tensor
        queries (..., n, d).
    heads : Heads
        the heads.
    weights : torch.Tensor or None
        key weights (..., m) (uniform 1/m when None); also the query weights when ``keys`` is None.
    plan : str or callable
        a name of :data:`PLANS`, or ``plan(scores, log_key_weights, log_query_weights, **params)`` returning
        P (..., H, n, m) (log_query_weights None when ``keys`` are given).
    keys : torch.Tensor or None
        keys (..., m, d), default x.
    causal : bool
        scores of keys j > i are −∞ (needs keys=None).
    chunk_elements : int or None
        cap on the scores of one block for the plans of :data:`ROWWISE` (the others need every row at once).
    **params
        passed to the plan (e.g. ``iterations``).

    Returns
    -------
    torch.Tensor
        (..., H, n, d).

    Raises
    ------
    ValueError
        an unknown plan name, or causal=True with keys=."""
    check_causal(causal, keys)
    check_chunk(chunk_elements)
    fn = PLANS.get(plan) if isinstance(plan, str) else plan
    if fn is None or not callable(fn):
        raise ValueError(f"unknown plan {plan!r}; choose one of {', '.join(map(repr, PLANS))} or pass a callable")
    y = x if keys is None else keys
    left, right = score_features(heads)
    qf = x.unsqueeze(-3) @ left
    kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right
    kT = kf.transpose(-1, -2)
    n, m = x.shape[-2], y.shape[-2]
    if weights is None:
        logw = torch.full((m,), -math.log(m), dtype=x.dtype, device=x.device)
    else:
        logw = torch.log(weights)
    logk = logw.unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, m)
    logq = None if keys is not None else logw.unsqueeze(-1).unsqueeze(-3)  # (..., 1, n, 1)
    rows = n
    if isinstance(plan, str) and plan in ROWWISE:
        rows = rows_per_chunk(math.prod(bshape(qf.shape[:-2], kT.shape[:-2])), n, m, chunk_elements)
    yv = y.unsqueeze(-3)
    outs = []
    for i0 in range(0, n, rows):
        S = qf[..., i0:i0 + rows, :] @ kT  # (..., H, r, m)
        if causal:
            S = S.masked_fill(causal_block_mask(torch.arange(i0, min(n, i0 + rows), device=x.device), m),
                              float("-inf"))
        lq = None if logq is None else logq[..., i0:i0 + rows, :]
        outs.append(fn(S, logk, lq, **params) @ yv)
    return outs[0] if len(outs) == 1 else torch.cat(outs, -2)
