"""Attention plans other than the softmax rows: the per-head averages of the keys under another plan.

For queries x_i, keys y_j with weights w_j and head h (scores s_ij^h = β ⟨x_i, A_h y_j⟩), each kernel here
returns the key averages Σ_j P_ij^h y_j of its plan P^h, from which the normalisation's output is
f_h = V_h Σ_j P_ij^h y_j (:mod:`transformer_pde.model.normalization`):

    ReLU      P_ij = w_j ReLU(s_ij)           (not normalised: :func:`relu_statistics` returns the mass too)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backends import (
    bshape, causal_block_mask, causal_log_prefix_mass, check_backend, check_causal, check_chunk, needs_grad,
    rows_per_chunk, select_backend,
)
from .heads import Heads
from .softmax import score_features

__all__ = ["relu_statistics"]



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

