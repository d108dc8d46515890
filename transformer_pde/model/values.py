"""The values-first softmax kernel of value-factored heads.

Value-factored heads (query/key factors Q_h, K_h and value factors V_h = O_h W_{V,h}, W_{V,h}: k_v × d):
:func:`softmax_values` averages the k_v-dimensional values u_hj = W_{V,h} y_j instead of the keys,

    ū_h(x_i) = Σ_j p_ij^h W_{V,h} y_j,   f_h(x_i) = V_h ȳ_h(x_i) = O_h ū_h(x_i),

at cost H·n·m·k_v instead of H·n·m·d (what a transformer's attention layer does with its per-head
values), with the log-partitions of :func:`transformer_pde.model.softmax.softmax_statistics`; the field
uses it when only the field is needed (:func:`transformer_pde.model.field.evaluate` without diagnostics).
Its kernels: the fused CPU flash op (a backend resolving to "sdpa", no autograd; token weights as an
additive log-mask, zero weights −∞, the causal flag; q, k, u zero-padded to one width), else plain torch
over query-row blocks of at most ``chunk_elements`` scores (out of place with autograd).  A query none of
whose keys has positive weight (a causal prefix of zero weight) gets NaN statistics from both, as in the
plain kernels of :func:`~transformer_pde.model.softmax.softmax_statistics` (the fused op itself would
return zeros).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .backends import (
    bshape, causal_block_mask, causal_log_prefix_mass, check_backend, check_causal, check_chunk, flash_cpu_op,
    needs_grad, rows_per_chunk, select_backend,
)
from .heads import Heads
from .softmax import score_features

__all__ = ["softmax_values", "values_first_applies"]



def values_first_applies(heads: Heads) -> bool:
    """True when the heads hold query/key factors and value factors (the kernel of this module applies)."""
    return heads.score is None and heads.value_factored


def _project(x: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """x @ M_h for every head as one product: maps (..., H, d, c), x (..., n, d) -> (..., H, n, c) (a view
    of a (..., n, H, c) block, the layout of a transformer's projections)."""
    H, d, c = maps.shape[-3:]
    L = maps.transpose(-3, -2).reshape(*maps.shape[:-3], d, H * c)
    out = x @ L
    return out.view(*out.shape[:-1], H, c).transpose(-3, -2)


def _features_values(x, y, heads: Heads, pad_to: Optional[int]):
    """(q (..., H, n, E), k (..., H, m, E), u (..., H, m, E_v)): β Q_h x_i, K_h y_j, W_{V,h} y_j; with
    ``pad_to`` every map is zero-padded to that width first (the fused kernel needs one width)."""
    left, right = score_features(heads)  # β Q_hᵀ, K_hᵀ: (..., H, d, k)
    vin = heads.value_in.transpose(-1, -2)  # (..., H, d, k_v)
    if pad_to is not None:
        pad = torch.nn.functional.pad
        left, right, vin = (t if t.shape[-1] == pad_to else pad(t, (0, pad_to - t.shape[-1]))
                            for t in (left, right, vin))
    widths = (left.shape[-1], right.shape[-1], vin.shape[-1])
    if y is x:  # one product for queries, keys and values
        shape = bshape(left.shape[:-3], right.shape[:-3], vin.shape[:-3])
        maps = torch.cat([t.expand(*shape, *t.shape[-3:]) for t in (left, right, vin)], -1)
        return torch.split(_project(x, maps), widths, -1)
    shape = bshape(right.shape[:-3], vin.shape[:-3])
    kv = torch.cat([t.expand(*shape, *t.shape[-3:]) for t in (right, vin)], -1)
    k, u = torch.split(_project(y, kv), widths[1:], -1)
    return _project(x, left), k, u


def _plain(q, k, u, logw, causal, rows, grad):
    """(lse (..., H, n), ū (..., H, n, k_v)) over query-row blocks: S = q kᵀ + log w (−∞ above the diagonal
    when causal), lse = logsumexp S, ū = e^{S − lse} u; in place without autograd."""
    n, m = q.shape[-2], k.shape[-2]
    kT = k.transpose(-1, -2)
    lses, outs = [], []
    for i0 in range(0, n, rows):
        S = q[..., i0:i0 + rows, :] @ kT  # (..., H, r, m)
        if logw is not None:
            # in place only when the sum keeps S's shape (the weights may carry batch axes S lacks)
            inplace = not grad and torch.broadcast_shapes(S.shape, logw.shape) == S.shape
            S = S.add_(logw) if inplace else S + logw
        if causal:
            cmask = causal_block_mask(torch.arange(i0, min(n, i0 + rows), device=q.device), m)
            S = S.masked_fill(cmask, float("-inf")) if grad else S.masked_fill_(cmask, float("-inf"))
        lse = torch.logsumexp(S, -1)
        P = torch.exp(S - lse.unsqueeze(-1)) if grad else S.sub_(lse.unsqueeze(-1)).exp_()
        outs.append(P @ u)
        lses.append(lse)
    if len(outs) == 1:
        return lses[0], outs[0]
    return torch.cat(lses, -1), torch.cat(outs, -2)


def _fused(op, q, k, u, weights, causal, batch):
    """(lse, ū) from the CPU flash-attention op; the log-weights as an additive mask (zero weight: −∞).
    A row whose keys are all masked comes back as zeros with log-sum-exp 0 (set to NaN by the caller)."""
    H, n, E = q.shape[-3:]
    m = k.shape[-2]
    G = math.prod(batch)

    def four(t, rows):
        return t.expand(*batch, H, rows, E).reshape(G, H, rows, E)

    mask = None if weights is None else torch.log(weights).expand(*batch, m).reshape(G, 1, 1, m)
    out, lse = op(four(q, n), four(k, m), four(u, m), is_causal=causal, attn_mask=mask, scale=1.0)
    return lse.reshape(*batch, H, n).to(q.dtype), out.reshape(*batch, H, n, E)


def softmax_values(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    keys: Optional[torch.Tensor] = None,
    chunk_elements: Optional[int] = None,
    backend: str = "auto",
    causal: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-partitions and softmax averages of the per-head values, log m_h(x_i) and ū_h(x_i) = Σ_j p_ij u_hj.

        log m_h(x_i) = log Σ_j w_j e^{s_ij},   ū_h(x_i) = Σ_j w_j e^{s_ij} W_{V,h} y_j / m_h(x_i)

    (module docstring, "Value-factored heads"); O_h ū_h(x_i) = V_h ȳ_h(x_i), the softmax head output.

    Parameters
    ----------
    x : torch.Tensor
        queries (..., n, d).
    heads : Heads
        heads with query/key factors and value factors (:func:`values_first_applies`).
    weights : Optional[torch.Tensor]
        key weights (..., m), or None (uniform 1/m).
    keys : Optional[torch.Tensor]
        keys (..., m, d), default x.
    chunk_elements : Optional[int]
        cap on the scores of one block of the plain path.
    backend : str
        as :func:`~transformer_pde.model.softmax.softmax_statistics`; "sdpa" (and "auto" on CPU) is the
        fused kernel without autograd, every other choice the plain path.
    causal : bool
        query i sees only keys j ≤ i (prefix measures); needs keys=None.

    Returns
    -------
    tuple
        (log_partition (..., H, n), values (..., H, n, k_v)), as the statistics of
        :func:`~transformer_pde.model.softmax.softmax_statistics` (causal: of the prefix measures).

    Raises
    ------
    ValueError
        for an unknown backend, a bad chunk_elements, causal=True with keys=, or heads without the factors.
    """
    check_backend(backend)
    check_chunk(chunk_elements)
    check_causal(causal, keys)
    if not values_first_applies(heads):
        raise ValueError("softmax_values needs heads with query/key factors and value factors "
                         "(tp.Heads(query=, key=, value_in=, value_out=)); use softmax_statistics otherwise")
    y = x if keys is None else keys
    H, n, m = heads.num_heads, x.shape[-2], y.shape[-2]
    k, kv = heads.query.shape[-2], heads.value_in.shape[-2]
    grad = needs_grad(x, y, heads.query, heads.key, heads.value_in, heads.beta, weights)
    batch = bshape(x.shape[:-2], y.shape[:-2], heads.batch_shape, () if weights is None else weights.shape[:-1])
    chosen = "chunked" if grad else select_backend(backend, x.device, x.dtype, math.prod(batch) * H * n * m)
    lse = None
    if chosen == "sdpa":
        with torch.no_grad():
            q, kf, u = _features_values(x, y, heads, max(k, kv))
            try:
                lse, out = _fused(flash_cpu_op(), q, kf, u, weights, causal, batch)
                out = out[..., :kv]
            except RuntimeError:  # a layout or build the fused kernel refuses: same numbers, plain torch
                lse = None
    if lse is None:
        with torch.set_grad_enabled(grad):
            q, kf, u = _features_values(x, y, heads, None)
            logw = None if weights is None else torch.log(weights).unsqueeze(-2).unsqueeze(-2)
            rows = n if chosen == "dense" else rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
            lse, out = _plain(q, kf, u, logw, causal, rows, grad)
    if causal:
        lognorm = causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device)
        lse = lse - (lognorm + math.log(m) if weights is None else lognorm).unsqueeze(-2)
        if weights is not None and chosen == "sdpa":  # a prefix of zero weight: no statistics (NaN)
            dead = torch.isneginf(lognorm).unsqueeze(-2)
            lse = lse.masked_fill(dead, float("nan"))
            out = out.masked_fill(dead.unsqueeze(-1), float("nan"))
    elif weights is None:
        lse = lse - math.log(m)
    return lse, out

