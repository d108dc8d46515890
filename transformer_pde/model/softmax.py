"""Softmax attention statistics: per-head log-partitions and softmax moments by log-sum-exp.

For queries x_i, keys y_j with weights w_j and head h, the scores are

    s_ij^h = β ⟨x_i, A_h y_j⟩          (or β ⟨Q_h x_i, K_h y_j⟩ when factors are kept)

and :func:`softmax_statistics` returns, for every head and query, log m_h(x_i), ȳ_h(x_i) and optionally
q_h(x_i) (:mod:`transformer_pde.model.moments`).  The per-head softmax output is then f_h = V_h ȳ_h: the
d×d value matrix is applied after the n×m reduction, so the (paths, heads, n, m) work is one score
product, one exp pass and one product with a few key columns, shared by all heads.

Kernels (the backend is chosen by :func:`transformer_pde.model.backends.select_backend`):

* ``"chunked"`` / ``"dense"`` — plain torch.  The token weights, the partition sum and the second
  moment are folded into one matrix product: with ``vals_j = w_j [1, y_j, (y_j ⊗ y_j)_{a≤b}]`` a single
  GEMM of e^{S} with ``vals`` gives m_h, m_h ȳ_h and m_h q_h.  The max-shift of log-sum-exp is skipped
  when it is provably unnecessary: |s_ij| ≤ |q_i| · max_j |k_j| (Cauchy–Schwarz), and when that bound
  is below ``½ log(finfo.max) − log m`` (≈ 350 in float64, ≈ 39 in float32 for m = 200) e^{s} can
  neither overflow nor underflow, so the exp runs directly on the scores (one pass instead of four).
  Otherwise the block falls back to the row-max shift.  "dense" is one block: the oracle.
* ``"sdpa"`` — torch's fused CPU flash-attention kernel, which also returns the log-sum-exp: the
  full statistics (partition, mean, second moment as extra value columns, token weights as an
  additive log-mask) in one fused, O(N)-memory, parallel pass, numerically safe for any β‖A‖ (online
  max).  The kernel needs q, k and v of one width, so q and k are zero-padded to the value width:
  with the second moment that is d + d(d+1)/2 − 1 (keys on the sphere, where the last diagonal column
  y_d² = 1 − Σ_{a<d} y_a² is implied; one more column otherwise), i.e. 8 for d = 3 — the width of one
  AVX-512 float64 vector, at which the kernel costs what it costs at width 3 (9 columns cost 1.2–1.5×
  more; docs/performance.md).  When every head sees the same keys (score matrices A_h, or one key
  factor), the heads are folded into the query axis: one kernel head with query rows (i, h), whose
  features are one product x @ [βA_1 … βA_H] (padded), and whose output comes back laid out
  (…, n, H, E) — so the field Σ_h ω_h V_h ȳ_h, ∇ δE/δμ and the ledger's per-head sums are single
  matrix products of that block (:func:`transformer_pde.model.moments.head_columns`), and ȳ_h is
  copied out per head only when asked for.
* ``"keops"`` — symbolic KeOps reductions (pykeops).

Causal attention (``causal=True``, decoder-only models): query i sees only the keys j ≤ i in the
stored order (the token axis), i.e. the prefix measure μ_i = Σ_{j≤i} w_j δ_{x_j} / W_i with
W_i = Σ_{j≤i} w_j (W_i = (i+1)/n for uniform weights).  Every statistic is that of μ_i:

    log m_h(x_i) = log Σ_{j≤i} w_j e^{s_ij} − log W_i,   p_ij = w_j e^{s_ij} / Σ_{k≤i} w_k e^{s_ik}  (j ≤ i)

so the first token attends only to itself (ȳ_h(x_0) = x_0, log m_h(x_0) = s_00).  Queries and
keys must be the same tokens (``keys=None``).  Every backend applies the mask without forming
the (n, m) mask for more than one score block: "chunked"/"dense" zero e^{s_ij} above the
diagonal block by block, "sdpa" passes ``is_causal=True`` to the fused kernel (which combines it
with the additive log-weight mask and returns the masked log-sum-exp), "keops" adds a
−∞-like step in the index difference, the autograd path masks with −∞ before ``logsumexp``.
A token whose prefix has zero total weight (W_i = 0) has no causal statistics (NaN).

With autograd (any input requires grad and grad mode is on) an out-of-place, chunked
``logsumexp``/``exp`` path is used whatever the backend, so that gradients flow to x, A, V, β
and the token weights; it agrees with the no-grad kernels to rounding.  Its forward pass is
chunked too, but autograd keeps every block for the backward pass (memory ~ n·m per head).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import torch

from .backends import (
    DEFAULT_CHUNK_ELEMENTS, bshape, causal_block_mask, causal_log_prefix_mass, check_backend, check_causal,
    check_chunk, flash_cpu_op, needs_grad, rows_per_chunk, select_backend,
)
from .heads import Heads
from .moments import (
    HeadStats, mean_columns, mean_from_merged, on_sphere, quadratic_form, quadratic_form_trace_free, second_columns,
    second_from_merged, sym_pairs,
)

__all__ = ["softmax_statistics"]
#: named internal API (not public): the score feature maps of the heads (the other kernels form scores alike)
__internal__ = ["score_features"]

#: second moments come from (y ⊗ y) key columns up to this dimension, from an explicit pass above it
_AUG_MAX_DIM = 8


def score_features(heads: Heads, transpose: bool = False):
    """(left, right) with scores s = β (x @ left)(y @ right)ᵀ; right None means identity."""
    beta = heads.beta
    if isinstance(beta, torch.Tensor) and beta.dim() > 0:
        beta = beta[..., None, None, None]
    if heads.score is not None:
        A = heads.score.transpose(-1, -2) if transpose else heads.score
        return beta * A, None
    Q, K = (heads.key, heads.query) if transpose else (heads.query, heads.key)
    return beta * Q.transpose(-1, -2), K.transpose(-1, -2)



def _exp_safe_limit(dtype: torch.dtype, m: int) -> float:
    """Largest score bound B for which e^{s}, |s| ≤ B, summed over m keys stays finite and normal."""
    return 0.5 * math.log(torch.finfo(dtype).max) - math.log(max(m, 1))



def softmax_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    keys: Optional[torch.Tensor] = None,
    second_moment: bool = False,
    transpose: bool = False,
    chunk_elements: Optional[int] = None,
    backend: str = "auto",
    causal: bool = False,
) -> HeadStats:
    """Log-partitions and softmax moments of every head at the queries ``x``.

        log m_h(x_i) = log Σ_j w_j e^{s_ij},  ȳ_h(x_i) = Σ_j p_ij y_j,  q_h(x_i) = Σ_j p_ij ⟨x_i, y_j⟩²

    Parameters
    ----------
    x : torch.Tensor
        queries (..., n, d).  keys: (..., m, d), default x (self-attention).
    heads : Heads
        the heads (batch dims broadcast against x's).
    weights : Optional[torch.Tensor]
        key weights (..., m) summing to 1, or None (uniform 1/m).
    second_moment : bool
        also return q_h(x_i) (Itô correction).
    transpose : bool
        use A_hᵀ instead of A_h (the other half of δE/δμ for non-symmetric A).
    chunk_elements : Optional[int]
        cap on the elements of one score block ("chunked"; memory ~ this, not n·m).
    backend : str
        "auto" | "dense" | "chunked" | "sdpa" | "keops" (module docstring).
    causal : bool
        query i sees only keys j ≤ i, statistics of the prefix measure
        Σ_{j≤i} w_j δ_{x_j} / Σ_{j≤i} w_j (module docstring); needs keys=None.

    Returns
    -------
    HeadStats
        :class:`HeadStats` with log_partition (..., H, n), mean (..., H, n, d), second (..., H, n) or None.

    Raises
    ------
    ValueError
        for an unknown backend, a bad chunk_elements or causal=True with keys=;
    TypeError
        for a non-bool causal; ImportError for
        backend="keops" without pykeops.  Tensors are not validated here (hot path); the
        public functions do it.
    """
    check_backend(backend)
    check_chunk(chunk_elements)
    check_causal(causal, keys)
    y = x if keys is None else keys
    left, right = score_features(heads, transpose)
    if needs_grad(x, y, left, right, weights):
        return _softmax_autograd(x, y, left, right, weights, second_moment, chunk_elements, causal)
    with torch.no_grad():
        # batch shapes of the query features x @ left and the key features y (@ right), before forming them
        qbatch = bshape(x.shape[:-2], left.shape[:-3])
        kbatch = y.shape[:-2] if right is None else bshape(y.shape[:-2], right.shape[:-3])
        batch = bshape(qbatch, kbatch, () if weights is None else weights.shape[:-1])
        H, n, m, d = left.shape[-3], x.shape[-2], y.shape[-2], y.shape[-1]
        elements = math.prod(batch) * H * n * m
        chosen = select_backend(backend, x.device, x.dtype, elements)
        if second_moment and d > _AUG_MAX_DIM and chosen != "keops":
            # (y ⊗ y) columns would cost O(d²) per pair: one explicit pass instead
            return _softmax_autograd(x, y, left, right, weights, second_moment, chunk_elements, causal)
        if chosen == "sdpa":
            try:
                return _softmax_sdpa(x, y, left, right, weights, second_moment, batch, causal)
            except RuntimeError:  # a layout or build the fused kernel refuses: same numbers, plain torch
                chosen = "chunked"
        qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
        kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right  # (..., 1|H, m, k)
        if chosen == "keops":
            return _softmax_keops(x, y, qf, kf, weights, second_moment, batch, causal)
        budget = None if chosen == "dense" else chunk_elements
        return _softmax_chunked(x, y, qf, kf, weights, second_moment, batch, budget, dense=chosen == "dense",
                                causal=causal)


def _key_columns(y, second_moment, iu):
    """Unweighted key columns [1, y_j, (y⊗y)_{a≤b}], (..., m, c)."""
    cols = [torch.ones_like(y[..., :1]), y]
    if second_moment:
        cols.append(second_columns(y, iu))
    return torch.cat(cols, -1)


def _softmax_chunked(x, y, qf, kf, weights, second_moment, batch, chunk_elements, dense=False, causal=False):
    """No-grad plain-torch kernel: blocks of S = Q Kᵀ, exp (shift-free when safe), one GEMM with
    vals_j = w_j [1, y_j, (y⊗y)_j] giving m_h, m_h ȳ_h and m_h q_h at once.  causal: e^{s_ij} of
    keys j > i is zeroed (or s_ij set to −∞ before the row-max shift), one block at a time."""
    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    dt, dev = x.dtype, x.device
    iu, coef = sym_pairs(d, dev, dt) if second_moment else (None, None)
    vals_u = _key_columns(y, second_moment, iu)  # (..., m, c) without token weights
    c = vals_u.shape[-1]
    G0 = math.prod(batch)
    shared = kf.shape[-3] == 1

    def per_group(t, last):  # (..., m, last) -> (G, m, last)
        t = t.expand(*batch, m, last).reshape(G0, m, last)
        return t if shared else t.unsqueeze(1).expand(G0, H, m, last).reshape(G0 * H, m, last)

    if shared:
        # keys shared by all heads: fold the heads into the rows of one GEMM per batch element
        G, R = G0, H * n
        K = kf.expand(*batch, 1, m, k).reshape(G, m, k)
    else:
        G, R = G0 * H, n
        K = kf.expand(*batch, H, m, k).reshape(G, m, k)
    Q = qf.expand(*batch, H, n, k).reshape(G, R, k)
    Vu = per_group(vals_u, c)
    if weights is None:
        Vw, logw = Vu, None
    else:
        w = per_group(weights.unsqueeze(-1), 1)  # (G, m, 1)
        Vw = Vu * w
        logw = torch.log(w).transpose(-1, -2)  # (G, 1, m)
    KT = K.transpose(-1, -2)
    # query index of every row (heads folded into the rows when the keys are shared)
    qidx = (torch.arange(R, device=dev) % n) if causal else None
    lognorm = causal_log_prefix_mass(weights, n, dtype=dt, device=dev) if causal else None
    # Cauchy–Schwarz bound on |s_ij| per row, for the shift-free exp
    bound = Q.norm(dim=-1) * K.norm(dim=-1).amax(-1, keepdim=True)  # (G, R)
    limit = _exp_safe_limit(dt, m)
    all_safe = float(bound.max()) <= limit
    if dense:
        rows, groups = R, G
    else:
        budget = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
        rows = max(1, min(R, budget // max(1, m)))
        groups = max(1, min(G, budget // max(1, rows * m)))
    if all_safe and rows == R and groups == G:
        # one block: S = Q Kᵀ, e^S in place, one GEMM (the common small/medium case)
        E = torch.bmm(Q, KT).exp_()
        if causal:
            E.masked_fill_(causal_block_mask(qidx, m), 0.0)
        M = torch.bmm(E, Vw).reshape(*batch, H, n, c)
        return _finish(x, M, None, weights is None, m, d, second_moment, iu, coef, lognorm)
    M = torch.empty(G, R, c, dtype=dt, device=dev)
    shift = None
    S_buf = torch.empty(groups * rows * m, dtype=dt, device=dev)
    for g0 in range(0, G, groups):
        g1 = min(G, g0 + groups)
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            S = S_buf[: (g1 - g0) * (r1 - r0) * m].view(g1 - g0, r1 - r0, m)
            torch.bmm(Q[g0:g1, r0:r1], KT[g0:g1], out=S)
            cmask = causal_block_mask(qidx[r0:r1], m) if causal else None
            if all_safe or float(bound[g0:g1, r0:r1].max()) <= limit:
                S.exp_()
                if causal:
                    S.masked_fill_(cmask, 0.0)
                M[g0:g1, r0:r1] = torch.bmm(S, Vw[g0:g1])
            else:
                # large scores: shift by the row max of s_ij + log w_j (zero-weight keys
                # cannot set the shift); the weights then live in the exponent
                if logw is not None:
                    S.add_(logw[g0:g1])
                if causal:
                    S.masked_fill_(cmask, float("-inf"))
                mx = torch.nan_to_num(S.amax(-1, keepdim=True), neginf=0.0)
                S.sub_(mx).exp_()
                M[g0:g1, r0:r1] = torch.bmm(S, Vu[g0:g1])
                if shift is None:
                    shift = torch.zeros(G, R, dtype=dt, device=dev)
                shift[g0:g1, r0:r1] = mx.squeeze(-1)
    M = M.reshape(*batch, H, n, c)
    return _finish(x, M, None if shift is None else shift.reshape(*batch, H, n), weights is None, m, d,
                   second_moment, iu, coef, lognorm)


def _finish(x, M, shift, uniform, m, d, second_moment, iu, coef, lognorm=None):
    """HeadStats from the moment block M = Σ_j e^{s_ij - shift_i} vals_j, (..., H, n, c).
    lognorm: causal log prefix masses log W_i ((n,) or (..., n)), or None."""
    Z = M[..., 0]
    lse = torch.log(Z)
    if shift is not None:
        lse = lse + shift
    if lognorm is not None:
        lse = lse - (lognorm + math.log(m) if uniform else lognorm).unsqueeze(-2)
    elif uniform:
        lse = lse - math.log(m)
    inv = torch.reciprocal(Z)
    mean = M[..., 1:1 + d] * inv.unsqueeze(-1)
    second = None
    if second_moment:
        second = quadratic_form(x, M[..., 1 + d:], iu, coef) * inv
    return HeadStats(lse, mean, second)


_PAIRS = {}


def _value_pairs(d: int, trace_free: bool, device):
    """Index pairs (a, b) into [1, y] whose products are the sdpa kernel's value columns: (0, 1 + j) for y_j,
    then (1 + lo, 1 + hi) for the (y ⊗ y)_{lo≤hi} of :func:`~transformer_pde.model.moments.sym_pairs`
    (without the last, y_d², when ``trace_free``); cached."""
    key = (d, trace_free, str(device))
    if key not in _PAIRS:
        (lo, hi), _ = sym_pairs(d, device)
        if trace_free:
            lo, hi = lo[:-1], hi[:-1]
        j = torch.arange(1, d + 1, device=device)
        _PAIRS[key] = (torch.cat([torch.zeros_like(j), 1 + lo]), torch.cat([j, 1 + hi]))
    return _PAIRS[key]


def _softmax_sdpa(x, y, left, right, weights, second_moment, batch, causal=False):
    """Fused CPU flash-attention kernel: output = softmax(Q Kᵀ + log w) [y, y⊗y], plus its logsumexp.
    The kernel needs q, k, v of one width E: the query and key feature maps (left, right) are
    zero-padded to E before they are applied, so Q and K are formed at width E in one product.
    causal: the kernel's own ``is_causal`` flag (top-left aligned, n = m), combined with the log-weight mask."""
    op = flash_cpu_op()
    H, n, k = left.shape[-3], x.shape[-2], left.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    iu, coef = sym_pairs(d, x.device, x.dtype) if second_moment else (None, None)
    # keys on the sphere: the last diagonal column y_d² = 1 − Σ_{a<d} y_a² is implied (one column
    # fewer: d = 3 gives the kernel width 8 instead of 9, one AVX-512 vector of float64)
    trace_free = second_moment and on_sphere(y)
    if second_moment:  # [y, (y ⊗ y)_{a≤b}] as products of the columns of [1, y]: one pass, no concatenation
        a, b = _value_pairs(d, trace_free, y.device)
        ye = torch.nn.functional.pad(y, (1, 0), value=1.0)
        v = ye.index_select(-1, a) * ye.index_select(-1, b)  # (..., m, c)
    else:
        v = y
    c = v.shape[-1]
    E = max(k, c)
    G = math.prod(batch)
    pad = torch.nn.functional.pad
    if k < E:  # pad the (small) feature maps, not the (batch, H, n, k) features
        left = pad(left, (0, E - k))
        right = None if right is None else pad(right, (0, E - k))
    if right is None:  # the keys themselves (k = d), zero-padded to E
        kf = (y if d == E else pad(y, (0, E - d))).unsqueeze(-3)  # (..., 1, m, E)
    else:
        kf = y.unsqueeze(-3) @ right  # (..., 1|H, m, E)
    Hk = kf.shape[-3]
    mask = None
    if weights is not None:
        mask = torch.log(weights).expand(*batch, m).reshape(G, 1, 1, m)
    v4 = v.unsqueeze(-3).expand(*batch, 1, m, c).reshape(G, 1, m, c)
    if c < E:
        v4 = pad(v4, (0, E - c))
    if Hk == 1 and not causal:
        return _softmax_sdpa_merged(op, x, left, kf, v4, mask, weights, batch, (iu, coef, trace_free, c))
    qf = x.unsqueeze(-3) @ left  # (..., H, n, E)
    q4 = qf.expand(*batch, H, n, E).reshape(G, H, n, E)
    k4 = kf.expand(*batch, Hk, m, E).reshape(G, Hk, m, E)
    k4 = k4.expand(G, H, m, E)
    v4 = v4.expand(G, H, m, E)
    out, lse = op(q4, k4, v4, is_causal=causal, attn_mask=mask, scale=1.0)
    out = out.reshape(*batch, H, n, E)
    # the kernel's logsumexp is laid out (G, n, H): products of e^{lse} with (..., H, n, ·) columns are
    # several times slower on that layout than on a contiguous (..., H, n) one
    lse = lse.reshape(*batch, H, n).to(x.dtype)
    if causal:
        lognorm = causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device)
        lse = lse - (lognorm + math.log(m) if weights is None else lognorm).unsqueeze(-2)
    elif weights is None:
        lse = lse - math.log(m)
    lse = lse.contiguous()
    if E == d:
        stats = HeadStats(lse, out.contiguous(), None)
    else:  # a slice of a wider output: copied out on first access (mean_applied reads the output itself)
        stats = HeadStats(lse, None, None)
        stats._mean_fn = functools.partial(mean_columns, out, d)
    if second_moment:
        cols = out[..., d:c]
        form = quadratic_form_trace_free if trace_free else quadratic_form
        stats._second_fn = functools.partial(form, x, cols, iu, coef)  # picklable, unlike a lambda
    if not causal:
        stats._columns = (x, out, d, c, trace_free, iu, coef)
    return stats


def _softmax_sdpa_merged(op, x, left, kf, v4, mask, weights, batch, columns):
    """The fused kernel with the heads folded into the query axis (keys and values shared by every head).

    Query row i·H + h is the feature q_h(x_i) = x_i A_h (padded to E), so the (..., n, H·E) block of all
    query features is one product x (..., n, d) @ L (..., d, H·E), and the kernel's output and log-sum-exp
    come back laid out (..., n, H, E) and (..., n, H): every contraction over the heads (the field
    Σ_h ω_h V_h ȳ_h, ∇ δE/δμ) or over the tokens (the ledger's sums) is then a single matrix product
    of that contiguous block, without a copy or a per-head product (:func:`transformer_pde.model.moments.head_columns`).

    ``left`` (..., H, d, E) is the query map padded to the kernel width E; ``columns`` = (iu, coef, trace_free, c):
    the second-moment columns (None, None, False, d without them) and the width c of the values before padding."""
    iu, coef, trace_free, c = columns
    H, E = left.shape[-3], left.shape[-1]
    n, d, m = x.shape[-2], x.shape[-1], kf.shape[-2]
    G = math.prod(batch)
    L = left.transpose(-2, -3)  # (..., d, H, E)
    L = L.reshape(*L.shape[:-2], H * E)
    qshape = (*bshape(x.shape[:-2], L.shape[:-2]), n, H * E)
    if math.prod(qshape[:-2]) == G:  # no broadcast left: write the features into the reused buffer
        q4 = torch.matmul(x, L, out=_workspace("q", (G, 1, n * H, E), x).view(qshape)).view(G, 1, n * H, E)
    else:
        qf = x @ L  # (..., n, H·E): row i holds q_h(x_i) for every head h
        q4 = qf.expand(*batch, n, H * E).reshape(G, 1, n * H, E)
    k4 = kf.expand(*batch, 1, m, E).reshape(G, 1, m, E)
    out, lse = op(q4, k4, v4, attn_mask=mask, scale=1.0)
    out = out.reshape(*batch, n, H, E)
    lse_nh = lse.reshape(*batch, n, H).to(x.dtype)
    if weights is None:
        lse_nh = lse_nh - math.log(m)
    stats = HeadStats(lse_nh.transpose(-1, -2).contiguous(), None, None)
    stats._mean_fn = functools.partial(mean_from_merged, out, d)
    if c > d:
        form = quadratic_form_trace_free if trace_free else quadratic_form
        stats._second_fn = functools.partial(second_from_merged, form, x, out, d, c, iu, coef)
    stats._merged = (x, out, lse_nh, d, c, trace_free, iu, coef)
    return stats



_WORKSPACE = threading.local()


def _workspace(name: str, shape, like: torch.Tensor) -> torch.Tensor:
    """A buffer of this shape, dtype and device, reused by this thread's next call with the same name.

    The query features of the merged kernel (13 MB in float64 for the H = 100 reference step) are
    written anew at every evaluation; allocated fresh each time, glibc maps and zero-fills new pages
    for them (a page fault per 4 KiB, milliseconds per step on a virtual machine).  One buffer per
    thread, replaced when the shape changes; its contents never outlive the call that fills it."""
    bufs = getattr(_WORKSPACE, "bufs", None)
    if bufs is None:
        bufs = _WORKSPACE.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.shape != tuple(shape) or buf.dtype != like.dtype or buf.device != like.device:
        buf = bufs[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buf


def _softmax_keops(x, y, qf, kf, weights, second_moment, batch, causal=False):  # pragma: no cover - needs pykeops
    """KeOps symbolic reductions: log Σ_j w_j e^{s_ij} and Σ_j softmax_ij [y_j, (y⊗y)_j].
    causal: s_ij − L·step(j − i − ½) with L = finfo.max/4 (e^{…} = 0 for j > i; the diagonal key
    always survives, so the row max is finite)."""
    from pykeops.torch import LazyTensor

    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    G = math.prod(batch)
    Hk = kf.shape[-3]
    iu, coef = sym_pairs(d, x.device, x.dtype) if second_moment else (None, None)
    v = torch.cat([y, second_columns(y, iu)], -1) if second_moment else y
    c = v.shape[-1]
    q = qf.expand(*batch, H, n, k).reshape(G, H, n, 1, k).contiguous()
    kk = kf.expand(*batch, Hk, m, k).reshape(G, Hk, 1, m, k).expand(G, H, 1, m, k).contiguous()
    vv = v.unsqueeze(-3).expand(*batch, H, m, c).reshape(G, H, 1, m, c).contiguous()
    S = LazyTensor(q) | LazyTensor(kk)  # (G, H, n, m) symbolic
    if weights is not None:
        lw = torch.log(weights).expand(*batch, m).reshape(G, 1, 1, m, 1).expand(G, H, 1, m, 1).contiguous()
        S = S + LazyTensor(lw)
    if causal:
        ii = torch.arange(n, dtype=x.dtype, device=x.device).reshape(1, 1, n, 1, 1)
        jj = torch.arange(m, dtype=x.dtype, device=x.device).reshape(1, 1, 1, m, 1)
        big = 0.25 * torch.finfo(x.dtype).max
        S = S - big * (LazyTensor(jj) - LazyTensor(ii) - 0.5).step()
    lse = S.logsumexp(dim=3).reshape(*batch, H, n)
    mom = S.sumsoftmaxweight(LazyTensor(vv), dim=3).reshape(*batch, H, n, c)
    if causal:
        lognorm = causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device)
        lse = lse - (lognorm + math.log(m) if weights is None else lognorm).unsqueeze(-2)
    elif weights is None:
        lse = lse - math.log(m)
    mean = mom[..., :d]
    second = quadratic_form(x, mom[..., d:], iu, coef) if second_moment else None
    return HeadStats(lse, mean, second)


def _softmax_autograd(x, y, left, right, weights, second_moment, chunk_elements, causal=False):
    """Differentiable path: out-of-place log-sum-exp over query-row chunks (causal: −∞ above the diagonal)."""
    qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
    n, m, d = x.shape[-2], y.shape[-2], y.shape[-1]
    H = qf.shape[-3]
    logw = None if weights is None else torch.log(weights).unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, m)
    kT = (y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right).transpose(-1, -2)  # (..., 1|H, k, m)
    batch = torch.broadcast_shapes(qf.shape[:-3], kT.shape[:-3])
    rows = rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
    yv = y.unsqueeze(-3)
    lses, means, seconds = [], [], []
    for i0 in range(0, n, rows):
        S = qf[..., i0:i0 + rows, :] @ kT  # (..., H, c, m)
        if logw is not None:
            S = S + logw
        if causal:
            qidx = torch.arange(i0, min(n, i0 + rows), device=x.device)
            S = S.masked_fill(causal_block_mask(qidx, m), float("-inf"))
        lse = torch.logsumexp(S, -1)
        P = torch.exp(S - lse.unsqueeze(-1))
        means.append(P @ yv)
        if second_moment:
            xc = x[..., i0:i0 + rows, :]
            q = (xc @ y.transpose(-1, -2)).square().unsqueeze(-3)  # (..., 1, c, m)
            seconds.append((P * q).sum(-1))
        lses.append(lse)
    lse = torch.cat(lses, -1)
    if causal:
        lognorm = causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device)
        lse = lse - (lognorm + math.log(m) if weights is None else lognorm).unsqueeze(-2)
    elif weights is None:
        lse = lse - math.log(m)
    mean = torch.cat(means, -2)
    second = torch.cat(seconds, -1) if second_moment else None
    return HeadStats(lse, mean, second)

