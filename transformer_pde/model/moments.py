"""The moment algebra of the attention statistics: :class:`HeadStats` and what is formed from it.

For queries x_i, keys y_j with weights w_j and head h (scores s_ij^h = β ⟨x_i, A_h y_j⟩), the kernels of
:mod:`transformer_pde.model.softmax` return, for every head and query,

    log m_h(x_i) = log Σ_j w_j e^{s_ij^h}                       (log-partition)
    ȳ_h(x_i)    = Σ_j p_ij^h y_j,    p_ij^h = w_j e^{s_ij^h} / m_h(x_i)   (softmax mean of keys)
    q_h(x_i)    = Σ_j p_ij^h ⟨x_i, y_j⟩²                        (optional second moment)

as a :class:`HeadStats`.  This module holds the algebra on those statistics that does not depend on
which kernel produced them: the second moment as a quadratic form of the (y ⊗ y) key columns
(:func:`quadratic_form`, its trace-free version for keys on the sphere), M_h ȳ_h (:func:`mean_applied`),
the scaled partitions m_h e^{−c} (:func:`scaled_partition`), and the products of the fused kernel's
output block: the field Σ_h ω_h M_h ȳ_h and the gradient of the energy as one product with
:func:`per_head_map` each, and the per-head token sums of the energy ledger (:func:`head_moment_sums`),
formed a block of tokens at a time.

The fused "sdpa" kernel with the heads folded into the query axis keeps its output laid out
(…, n, H, E) on the statistics (``_merged``): :func:`head_columns` is that block as (…, n, H·E), head h
in columns h·E … h·E + E − 1 (the mean ȳ_h first, then the second-moment columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .backends import needs_grad

__all__ = ["HeadStats"]
#: named internal API (not public): the algebra the kernels, the field, the energy and the solvers' ledger share
__internal__ = ["mean_columns", "mean_applied", "scaled_partition", "sym_pairs", "second_columns", "quadratic_form",
                "on_sphere", "quadratic_form_trace_free", "mean_from_merged", "second_from_merged", "head_columns",
                "head_columns_mass", "head_columns_products", "head_columns_width",
                "per_head_map", "head_moment_sums", "deferred_mean_stats", "second_moment_columns"]



@dataclass
class HeadStats:
    """Per-head kernel statistics at the queries.

    log_partition: (..., H, n)  log m_h(x_i)
    mean:          (..., H, n, d)  ȳ_h(x_i)
    second:        (..., H, n) or None  Σ_j p_ij ⟨x_i, y_j⟩²

    The fused "sdpa" kernel keeps its value columns on the statistics (``_columns``): ``second`` is
    then formed from them on first access, and :func:`head_moment_sums` contracts them over the
    tokens without forming it (what the solvers' ledger needs).  When the kernel's output is wider
    than d (the second-moment columns), ``mean`` is a strided slice of it, copied out on first
    access only: :func:`mean_applied` gives M_h ȳ_h from the output itself.
    """

    log_partition: torch.Tensor
    mean: torch.Tensor
    second: Optional[torch.Tensor] = None


def _deferred(name: str) -> property:
    """A HeadStats field formed on first access from ``_<name>_fn`` (a zero-argument callable the kernel
    leaves on the statistics), then kept; assigning a value replaces both."""
    value_key, fn_key = f"_{name}", f"_{name}_fn"

    def get(self):
        fn = self.__dict__.get(fn_key)
        if self.__dict__.get(value_key) is None and fn is not None:
            self.__dict__[value_key] = fn()
            self.__dict__[fn_key] = None
        return self.__dict__.get(value_key)

    def set(self, value):
        self.__dict__[value_key] = value
        self.__dict__[fn_key] = None

    return property(get, set)


# ``second`` of the fused kernel is computed lazily (a per-token quadratic form the solvers never read);
# ``mean`` of a wide fused-kernel output is copied out of it lazily (the solvers' step reads it through
# :func:`mean_applied` and the merged block only)
HeadStats.second = _deferred("second")
HeadStats.mean = _deferred("mean")


def mean_columns(out: torch.Tensor, d: int) -> torch.Tensor:
    """The mean columns of a fused-kernel output (..., H, n, E), contiguous (downstream products on a
    strided view are several times slower)."""
    return out[..., :d].contiguous()


def mean_applied(stats: HeadStats, M: torch.Tensor) -> torch.Tensor:
    """M_h ȳ_h(x_i) for M (..., H, d, d), (..., H, n, d).

    For the fused kernel's wide output (mean not yet copied out) this is one product of the output
    (..., H, n, E) with Mᵀ padded by zero rows to (E, d): the kernel's output is read once and the
    mean is never formed; otherwise ȳ_h Mᵀ_h."""
    fn = stats.__dict__.get("_mean_fn")
    if (fn is not None and fn.func is mean_columns and stats.__dict__.get("_mean") is None
            and not needs_grad(M)):
        out, d = fn.args
        Mt = M.transpose(-1, -2)
        return out @ torch.nn.functional.pad(Mt, (0, 0, 0, out.shape[-1] - d))
    return stats.mean @ M.transpose(-1, -2)


def scaled_partition(stats: HeadStats, log_scale: float = 0.0) -> torch.Tensor:
    """m_h(x_i) e^{−c} = e^{log m_h(x_i) − c}, (..., H, n); kept on ``stats`` for the next caller with the
    same c (the diagnostics, the ledger's pairing and Itô sums all read it)."""
    lse = stats.log_partition
    c = float(log_scale)
    key = (lse._version, c)
    cache = stats.__dict__.get("_scaled_partition")
    if cache is not None and cache[0] == key and cache[1] is lse:
        return cache[2]
    m = torch.exp(lse) if c == 0.0 else torch.exp(lse - c)
    if not m.requires_grad:
        stats.__dict__["_scaled_partition"] = (key, lse, m)
    return m



_SYM_PAIRS = {}


def sym_pairs(d: int, device, dtype=torch.float64):
    """Upper-triangle index pairs (a ≤ b) and the weights (1 on the diagonal, 2 off it), cached."""
    key = (d, str(device), dtype)
    if key not in _SYM_PAIRS:
        iu = torch.triu_indices(d, d, device=device)
        _SYM_PAIRS[key] = ((iu[0].contiguous(), iu[1].contiguous()), torch.where(iu[0] == iu[1], 1.0, 2.0).to(dtype))
    return _SYM_PAIRS[key]




def second_columns(y: torch.Tensor, iu) -> torch.Tensor:
    """(y ⊗ y)_{a≤b}, (..., m, d(d+1)/2)."""
    return y.index_select(-1, iu[0]) * y.index_select(-1, iu[1])


def quadratic_form(x: torch.Tensor, cols: torch.Tensor, iu, coef) -> torch.Tensor:
    """Σ_{a≤b} coef_ab x_a x_b cols_ab: x (..., n, d), cols (..., H, n, d(d+1)/2) -> (..., H, n)."""
    xx = (second_columns(x, iu) * coef).unsqueeze(-3)
    return (cols * xx).sum(-1)


def on_sphere(y: torch.Tensor) -> bool:
    """True when every key has |y_j|² = 1 to within 16 ulp (then Σ_j p_ij |y_j|² = 1 to rounding)."""
    if y.shape[-2] == 0 or y.numel() == 0:
        return True
    lo, hi = torch.aminmax(torch.linalg.vecdot(y, y))  # max |y_j|² − 1 = max(hi − 1, 1 − lo)
    return max(float(hi) - 1.0, 1.0 - float(lo)) <= 16 * torch.finfo(y.dtype).eps


def quadratic_form_trace_free(x: torch.Tensor, cols: torch.Tensor, iu, coef) -> torch.Tensor:
    """:func:`quadratic_form` from the columns without the last one, C_dd = Σ_j p_ij y_jd², for keys on
    the sphere: C_dd = 1 − Σ_{a<d} C_aa, so q = x_d² + Σ_{(a,b)≠(d,d)} (coef_ab x_a x_b − [a=b] x_d²) C_ab.
    x (..., n, d), cols (..., H, n, d(d+1)/2 − 1) -> (..., H, n)."""
    xx = second_columns(x, iu) * coef  # (..., n, P)
    xd2 = xx[..., -1:]
    diag = (iu[0] == iu[1])[:-1].to(x.dtype)
    xx = xx[..., :-1] - diag * xd2
    return (cols * xx.unsqueeze(-3)).sum(-1) + xd2.squeeze(-1).unsqueeze(-2)



def mean_from_merged(out: torch.Tensor, d: int) -> torch.Tensor:
    """ȳ (..., H, n, d), contiguous, from the merged kernel output (..., n, H, E)."""
    return out[..., :d].transpose(-2, -3).contiguous()


def second_from_merged(form, x, out, d, c, iu, coef):
    return form(x, out[..., d:c].transpose(-2, -3), iu, coef)


#: bytes of one token block of :func:`_weighted_block_products` (half the L2 cache of a core)
_BLOCK_BYTES = 1 << 20


def _weighted_block_products(out, mc, left=None, right=None):
    """Products with Y = out · m (the merged kernel's output times the masses) without forming Y.

    out (..., n, H, E), mc (..., n, H); left (..., k, n) gives left @ Y (..., k, H·E) (a contraction over the
    tokens), right (..., H·E, d) gives Y @ right (..., n, d) (a contraction over the heads).  Y is formed a
    block of tokens at a time in one reused buffer of about ``_BLOCK_BYTES``: a (..., n, H·E) temporary
    would be written to memory and read back (in float64 at n = 200, H = 100, 10 paths that is 12.8 MB
    per use, the largest cost of the diagnostics after the kernel)."""
    batch, (n, H, E) = out.shape[:-3], out.shape[-3:]
    G = math.prod(batch)
    if G * n * H * E * out.element_size() <= _BLOCK_BYTES:  # one block: Y itself, a small temporary
        Y = (out * mc.unsqueeze(-1)).flatten(-2)  # (..., n, H·E)
        out_l = None if left is None else left @ Y
        out_r = None if right is None else Y @ right
        return out_l if right is None else (out_r if left is None else (out_l, out_r))
    o = out.reshape(G, n, H, E)
    m = mc.reshape(G, n, H, 1)
    lt = None if left is None else left.expand(*batch, *left.shape[-2:]).reshape(G, left.shape[-2], n)
    rt = None if right is None else right.expand(*batch, *right.shape[-2:]).reshape(G, H * E, right.shape[-1])
    rows = max(1, min(n, _BLOCK_BYTES // max(1, G * H * E * out.element_size())))
    buf = out.new_empty(G, rows, H, E)
    acc = None if lt is None else out.new_zeros(G, lt.shape[-2], H * E)
    res = None if rt is None else out.new_empty(G, n, rt.shape[-1])
    for i0 in range(0, n, rows):
        r = min(rows, n - i0)
        Yb = torch.mul(o[:, i0:i0 + r], m[:, i0:i0 + r], out=buf[:, :r]).view(G, r, H * E)
        if acc is not None:
            acc.baddbmm_(lt[:, :, i0:i0 + r], Yb)
        if res is not None:
            res[:, i0:i0 + r] = torch.bmm(Yb, rt)
    out_l = None if acc is None else acc.reshape(*batch, *acc.shape[-2:])
    out_r = None if res is None else res.reshape(*batch, n, res.shape[-1])
    return out_l if right is None else (out_r if left is None else (out_l, out_r))


def head_columns(stats: HeadStats):
    """The merged fused kernel's output as a (..., n, H·E) block (a view), or None for other statistics:
    ȳ_h(x_i) and the second-moment columns, head h in columns h·E … h·E + E − 1 (E: ``head_columns_width``).
    Its products with the masses m_h(x_i) e^{−c} are :func:`head_columns_products`."""
    merged = stats.__dict__.get("_merged")
    if merged is None:
        return None
    out = merged[1]
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])


def head_columns_mass(stats: HeadStats, log_scale: float):
    """m_h(x_i) e^{−c} laid out (..., n, H) (contiguous in the heads) for merged statistics, else None;
    kept on ``stats`` per c."""
    merged = stats.__dict__.get("_merged")
    if merged is None:
        return None
    lse_nh = merged[2]
    c = float(log_scale)
    key = (lse_nh._version, c)
    cache = stats.__dict__.get("_merged_mass")
    if cache is not None and cache[0] == key:
        return cache[1]
    mc = torch.exp(lse_nh) if c == 0.0 else torch.exp(lse_nh - c)  # (..., n, H)
    stats.__dict__["_merged_mass"] = (key, mc)
    return mc


def head_columns_products(stats: HeadStats, log_scale: float, right: torch.Tensor) -> torch.Tensor:
    """(m_h e^{−c} · head_columns(stats)) @ right (..., n, d), without forming the weighted block
    (:func:`_weighted_block_products`)."""
    return _weighted_block_products(stats.__dict__["_merged"][1], head_columns_mass(stats, log_scale), right=right)


def second_moment_columns(stats: HeadStats, x, log_scale: float):
    """The fused kernel's value columns with the second moment, for the queries ``x``: (out, mass, c, trace_free)
    with out (..., n, H, E) (a view) holding ȳ_h(x_i) in columns :d and C_ab = Σ_j p_ij y_ja y_jb (a ≤ b,
    :func:`sym_pairs` order) in columns d:c, the last pair (C_dd) left out when ``trace_free`` (keys on the
    sphere: C_dd = 1 − Σ_{a<d} C_aa), and mass = m_h(x_i) e^{−c} (..., n, H).  None where the statistics
    lack those columns (another kernel, no second moment, causal), belong to other queries, or autograd is on."""
    merged = stats.__dict__.get("_merged")
    if merged is not None:
        xq, out, _, d, c, trace_free, _, _ = merged
    else:
        cols = stats.__dict__.get("_columns")
        if cols is None:
            return None
        xq, out, d, c, trace_free, _, _ = cols
    if c == d or xq is not x or needs_grad(x):
        return None
    if merged is not None:
        return out, head_columns_mass(stats, log_scale), c, trace_free
    return out.transpose(-2, -3), scaled_partition(stats, log_scale).transpose(-1, -2), c, trace_free


def head_columns_width(stats: HeadStats) -> int:
    """E, the columns per head of :func:`head_columns`."""
    return stats.__dict__["_merged"][1].shape[-1]


#: the last maps of :func:`per_head_map` (the field's and the gradient's; the heads are fixed over a run)
_MAPS = {}


def per_head_map(weights: torch.Tensor, M: torch.Tensor, E: int) -> torch.Tensor:
    """The (..., H·E, d) matrix W with (block @ W)_i = Σ_h ω_h M_h ȳ_h(x_i) for a :func:`head_columns` block:
    W[h·E + b, a] = ω_h M_h[a, b] for b < d, 0 for the second-moment columns.  Kept for the next call with
    the same (unchanged) tensors, unless they require grad."""
    key = (id(weights), id(M), E)
    hit = _MAPS.get(key)
    if hit is not None and hit[0] is weights and hit[1] is M and hit[2] == (weights._version, M._version):
        return hit[3]
    d = M.shape[-1]
    W = (weights.unsqueeze(-1).unsqueeze(-1) * M).transpose(-1, -2)  # (..., H, d, d): [b, a]
    W = torch.nn.functional.pad(W, (0, 0, 0, E - d))  # (..., H, E, d)
    W = W.reshape(*W.shape[:-3], W.shape[-3] * E, d)
    if not W.requires_grad:
        if len(_MAPS) >= 4:
            _MAPS.clear()
        _MAPS[key] = (weights, M, (weights._version, M._version), W)
    return W



def head_moment_sums(stats: HeadStats, weights: Optional[torch.Tensor], log_scale: float = 0.0, x=None):
    """Per-head token sums of the fused kernel's value columns, or None where the statistics lack them.

    With m_h(x_i) e^{−c} = e^{log m_h(x_i) − c} and w_i the token weights (1/n when None):

        T_h    = Σ_i w_i m_h(x_i) e^{−c} ȳ_h(x_i) x_iᵀ                      (..., H, d, d)
        ito_h  = Σ_i w_i m_h(x_i) e^{−c} (1 + q_h(x_i))                       (..., H), None without
                                                                              the second moment

    (q_h the second moment of :func:`softmax_statistics`).  Both come from one batched product of
    the kernel's value columns [ȳ, C] (C: the columns of (y ⊗ y)) with w_i m_h(x_i) [x_i, x_i ⊗ x_i]:
    q_h(x_i) = Σ_ab c_ab x_ia x_ib C_ab is linear in the columns, so its token sum is the trace of a
    (columns × columns) block, and the (..., H, n) quadratic form is never formed.  Available for the
    non-causal "sdpa" statistics without autograd; ``x`` (optional): the queries the caller pairs
    with, None when they differ from the kernel's.  Cached on ``stats`` (keyed on the weights and
    the in-place versions)."""
    merged = stats.__dict__.get("_merged")
    if merged is not None:
        return _merged_moment_sums(stats, merged, weights, log_scale, x)
    pair = stats.__dict__.get("_pair_sums")  # the one-block kernel's T (transformer_pde.model.pair_block)
    if pair is not None:
        return pair(weights, log_scale, x)
    cols = stats.__dict__.get("_columns")
    if cols is None:
        return None
    xq, out, d, c, trace_free, iu, coef = cols
    if (x is not None and x is not xq) or needs_grad(xq, weights):
        return None  # other queries, or a caller differentiating through the sums: the per-token path
    lse = stats.log_partition
    key = (None if weights is None else weights._version, lse._version, out._version, xq._version, float(log_scale))
    cache = stats.__dict__.get("_moment_sums")
    if cache is not None and cache[0] is weights and cache[1] == key:
        return cache[2]
    mc = scaled_partition(stats, log_scale)  # (..., H, n)
    U, wb = _token_columns(xq, weights, d, c, trace_free, iu, coef)  # U (..., n, c)
    vals = out if out.shape[-1] == c else out[..., :c]
    # (U_i w_i m_h(x_i))ᵀ as (..., H, c, n): the token axis innermost in both factors of the product
    mU = U.transpose(-1, -2).unsqueeze(-3) * mc.unsqueeze(-2)
    MU = mU @ vals  # (..., H, c, c): MU[k, l] = Σ_i w_i m_h(x_i) U_ik vals_il
    T = MU[..., :d, :d].transpose(-1, -2)
    ito = None
    if c > d:
        ito = MU[..., d:, d:].diagonal(dim1=-2, dim2=-1).sum(-1) + (mc * wb.unsqueeze(-2)).sum(-1)
    stats._moment_sums = (weights, key, (T, ito))
    return T, ito


def _token_columns(xq, weights, d, c, trace_free, iu, coef):
    """U_i w_i with U = [x, c_ab x_a x_b (trace-free on the sphere)] (..., n, c) and the base term
    w_i (1 + x_d²-part) (..., n) of the Itô sum (module docstring of :func:`head_moment_sums`)."""
    n = xq.shape[-2]
    base = None
    if c > d:
        xx = second_columns(xq, iu) * coef
        if trace_free:
            xd2 = xx[..., -1:]
            xx = xx[..., :-1] - (iu[0] == iu[1])[:-1].to(xq.dtype) * xd2
            base = 1.0 + xd2.squeeze(-1)
        U = torch.cat([xq, xx], -1)
    else:
        U = xq
    U = U / n if weights is None else U * weights.unsqueeze(-1)
    wb = None
    if c > d:
        wb = torch.ones_like(xq[..., 0]) if base is None else base
        wb = wb / n if weights is None else wb * weights
    return U, wb


def _merged_moment_sums(stats, merged, weights, log_scale, x):
    """:func:`head_moment_sums` of merged statistics: one product U_wᵀ (c × n) @ Y (n × H·E) per batch entry,
    Y the kernel's output (:func:`head_columns`) times m_h e^{−c}."""
    xq, out, lse_nh, d, c, trace_free, iu, coef = merged
    if (x is not None and x is not xq) or needs_grad(xq, weights):
        return None
    key = (None if weights is None else weights._version, lse_nh._version, out._version, xq._version, float(log_scale))
    cache = stats.__dict__.get("_moment_sums")
    if cache is not None and cache[0] is weights and cache[1] == key:
        return cache[2]
    H, E = out.shape[-2], out.shape[-1]
    mc = head_columns_mass(stats, log_scale)  # (..., n, H)
    U, wb = _token_columns(xq, weights, d, c, trace_free, iu, coef)
    MU = _weighted_block_products(out, mc, U.transpose(-1, -2))  # (..., c, H·E)
    MU = MU.reshape(*MU.shape[:-1], H, E).transpose(-2, -3)  # (..., H, c, E)
    T = MU[..., :d, :d].transpose(-1, -2)
    ito = None
    if c > d:
        ito = MU[..., d:c, d:c].diagonal(dim1=-2, dim2=-1).sum(-1) + (wb.unsqueeze(-2) @ mc).squeeze(-2)
    stats._moment_sums = (weights, key, (T, ito))
    return T, ito



def deferred_mean_stats(log_partition: torch.Tensor, mean_fn) -> HeadStats:
    """HeadStats with the given log-partitions whose mean ȳ_h is ``mean_fn()`` (a ``functools.partial``),
    formed on first access (the statistics of a values-first evaluation, :func:`softmax_values`)."""
    stats = HeadStats(log_partition, None, None)
    stats._mean_fn = mean_fn
    return stats
