"""Attention kernels: per-head partition functions and attention-weighted moments.

For queries x_i, keys y_j with weights w_j and head h, the scores are

    s_ij^h = β ⟨x_i, A_h y_j⟩          (or β ⟨Q_h x_i, K_h y_j⟩ when factors are kept)

and the kernels return, for every head and query,

    log m_h(x_i) = log Σ_j w_j e^{s_ij^h}                       (log-partition)
    ȳ_h(x_i)    = Σ_j p_ij^h y_j,    p_ij^h = w_j e^{s_ij^h} / m_h(x_i)   (softmax mean of keys)
    q_h(x_i)    = Σ_j p_ij^h ⟨x_i, y_j⟩²                        (optional second moment)

The per-head softmax output is then f_h = V_h ȳ_h: the d×d value matrix is applied after
the n×m reduction, so the (paths, heads, n, m) work is one score product, one exp pass and
one product with a few key columns, shared by all heads.

Backends (``backend=``; all return the same numbers to rounding, see tests/test_attention.py):

* ``"chunked"`` — plain torch.  The score block is formed ``chunk_elements`` entries at a time
  (``batch · H · rows · m`` ≤ ``DEFAULT_CHUNK_ELEMENTS`` by default), so memory grows like
  N, not N².  The token weights, the partition sum and the second moment are folded into one
  matrix product: with ``vals_j = w_j [1, y_j, (y_j ⊗ y_j)_{a≤b}]`` a single GEMM of e^{S} with
  ``vals`` gives m_h, m_h ȳ_h and m_h q_h.  The max-shift of log-sum-exp is skipped when it is
  provably unnecessary: |s_ij| ≤ |q_i| · max_j |k_j| (Cauchy–Schwarz), and when that bound is
  below ``½ log(finfo.max) − log m`` (≈ 350 in float64, ≈ 39 in float32 for m = 200) e^{s}
  can neither overflow nor underflow, so the exp runs directly on the scores (one pass instead
  of four).  Otherwise the block falls back to the row-max shift.
* ``"dense"`` — the same code with a single block (memory ``batch · H · n · m``): the oracle.
* ``"sdpa"`` — torch's fused scaled-dot-product-attention kernel.  On CPU this is the flash
  kernel (``aten._scaled_dot_product_flash_attention_for_cpu``), which also returns the
  log-sum-exp, so it gives the full statistics (partition, mean, second moment as extra value
  columns, token weights as an additive log-mask) in one fused, O(N)-memory, parallel pass; it
  is numerically safe for any β‖A‖ (online max).  The kernel needs q, k and v of one width, so
  q and k are zero-padded to the value width: with the second moment that is d + d(d+1)/2 − 1
  (keys on the sphere, where the last diagonal column y_d² = 1 − Σ_{a<d} y_a² is implied; one
  more column otherwise), i.e. 8 for d = 3 — the width of one AVX-512 float64 vector, at which
  the kernel costs what it costs at width 3 (9 columns cost 1.2–1.5× more; docs/performance.md).
  When every head sees the same keys (score matrices A_h, or one key factor), the heads are folded
  into the query axis: one kernel head with query rows (i, h), whose features are one product
  x @ [βA_1 … βA_H] (padded), and whose output comes back laid out (…, n, H, E) — so the field
  Σ_h ω_h V_h ȳ_h, ∇ δE/δμ and the ledger's per-head sums are single matrix products of that
  block (:func:`head_columns`), and ȳ_h is copied out per head only when asked for.
  Where that kernel does not apply (CUDA and other devices, dtypes other than float32/float64,
  a torch without it) it falls back to ``"chunked"``.
* ``"keops"`` — symbolic KeOps reductions (``pykeops``, optional dependency, CUDA only in
  practice); raises ``ImportError`` with an install hint when pykeops is missing.
* ``"auto"`` (default) — autograd path when an input requires grad; otherwise ``"sdpa"`` on
  CPU (float32/float64) when the fused kernel is available, KeOps on CUDA for large problems
  when pykeops is importable, ``"chunked"`` elsewhere.  Never KeOps on CPU.

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

Value-factored heads (query/key factors Q_h, K_h and value factors V_h = O_h W_{V,h}, W_{V,h}: k_v × d):
:func:`softmax_values` averages the k_v-dimensional values u_hj = W_{V,h} y_j instead of the keys,

    ū_h(x_i) = Σ_j p_ij^h W_{V,h} y_j,   f_h(x_i) = V_h ȳ_h(x_i) = O_h ū_h(x_i),

at cost H·n·m·k_v instead of H·n·m·d (what a transformer's attention layer does with its per-head
values), with the log-partitions of :func:`softmax_statistics`; the field uses it when only the field
is needed (:func:`transformer_pde.model.field.evaluate` without diagnostics).  Its kernels: the fused
CPU flash op (a backend resolving to "sdpa", no autograd; token weights as an additive log-mask, zero
weights −∞, the causal flag; q, k, u zero-padded to one width), else plain torch over query-row blocks
of at most ``chunk_elements`` scores (out of place with autograd).  A query none of whose keys has
positive weight (a causal prefix of zero weight) gets NaN statistics from both, as in the plain kernels
of :func:`softmax_statistics` (the fused op itself would return zeros).

Memory of the no-grad backends ("chunked", "sdpa", "keops"): O(batch · H · (n + m) · c) for
the inputs and outputs plus one block — never the (batch, H, n, m) tensor (tests/test_attention.py
measures the peak; scripts/benchmark_field.py prints it).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .heads import Heads

__all__ = [
    "HeadStats",
    "softmax_statistics",
    "relu_statistics",
    "DEFAULT_CHUNK_ELEMENTS",
    "BACKENDS",
    "select_backend",
    "keops_available",
    "sdpa_available",
    "kernel_backend",
    "causal_log_prefix_mass",
]
#: named internal API (not public): the per-head token sums of the fused kernel's columns (energy ledger)
__internal__ = ["head_moment_sums", "mean_applied", "scaled_partition", "head_columns", "head_columns_mass",
                "head_columns_width", "per_head_map", "head_moment_sums_along", "head_columns_products",
                "softmax_values", "values_first_applies", "deferred_mean_stats"]

#: elements of one score block (batch · H · rows · m); 2^22 float64 = 32 MiB
DEFAULT_CHUNK_ELEMENTS = 1 << 22

#: kernel backends accepted by ``backend=`` (module docstring)
BACKENDS = ("auto", "dense", "chunked", "sdpa", "keops")

#: second moments come from (y ⊗ y) key columns up to this dimension, from an explicit pass above it
_AUG_MAX_DIM = 8

#: problems with at least this many score entries (batch · H · n · m) use KeOps under "auto" on CUDA
KEOPS_AUTO_MIN_ELEMENTS = 1 << 26


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


def _mean_columns(out: torch.Tensor, d: int) -> torch.Tensor:
    """The mean columns of a fused-kernel output (..., H, n, E), contiguous (downstream products on a
    strided view are several times slower)."""
    return out[..., :d].contiguous()


def mean_applied(stats: HeadStats, M: torch.Tensor) -> torch.Tensor:
    """M_h ȳ_h(x_i) for M (..., H, d, d), (..., H, n, d).

    For the fused kernel's wide output (mean not yet copied out) this is one product of the output
    (..., H, n, E) with Mᵀ padded by zero rows to (E, d): the kernel's output is read once and the
    mean is never formed; otherwise ȳ_h Mᵀ_h."""
    fn = stats.__dict__.get("_mean_fn")
    if (fn is not None and fn.func is _mean_columns and stats.__dict__.get("_mean") is None
            and not _needs_grad(M)):
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


# ---------------------------------------------------------------------------- backend choice
def keops_available() -> bool:
    """True when ``pykeops`` can be imported (it is not a hard dependency)."""
    try:
        import pykeops.torch  # noqa: F401
    except Exception:  # ImportError, or a broken compiler setup raising at import
        return False
    return True


_FLASH_CPU = None


def _flash_cpu_op():
    """torch's CPU flash-attention op returning (output, logsumexp), or None if this torch lacks it."""
    global _FLASH_CPU
    if _FLASH_CPU is None:
        try:
            _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        except (AttributeError, RuntimeError):
            _FLASH_CPU = False
    return _FLASH_CPU or None


def sdpa_available(device, dtype) -> bool:
    """True when the fused "sdpa" statistics kernel runs for this device and dtype (CPU, float32/64)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.float64)
        and _flash_cpu_op() is not None
    )


_DEFAULT_BACKEND = ["auto"]


class kernel_backend:
    """Set the backend that ``backend="auto"`` resolves to, for code that does not pass one
    (``tp.energy``, ``tp.simulate``, ...); use as a context manager or call ``.set()``.

        >>> import transformer_pde as tp
        >>> with tp.attention.kernel_backend("chunked"):
        ...     pass  # every kernel called here with backend="auto" runs "chunked"
    """

    def __init__(self, name: str):
        self.name = _check_backend(name)
        self._saved = None

    def set(self) -> "kernel_backend":
        _DEFAULT_BACKEND[0] = self.name
        return self

    def __enter__(self):
        self._saved = _DEFAULT_BACKEND[0]
        _DEFAULT_BACKEND[0] = self.name
        return self

    def __exit__(self, *exc):
        _DEFAULT_BACKEND[0] = self._saved
        return False


def _check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def select_backend(backend: str, device, dtype, elements: int) -> str:
    """The backend that ``backend`` resolves to for a problem of ``elements`` = batch·H·n·m scores.

    "auto": "sdpa" on CPU (float32/float64, fused kernel present), "keops" on CUDA when pykeops
    is importable and ``elements >= KEOPS_AUTO_MIN_ELEMENTS``, else "chunked".  An explicit
    "keops" raises ImportError when pykeops is missing; an explicit "sdpa" falls back to
    "chunked" where the fused kernel does not apply.
    """
    _check_backend(backend)
    dev = torch.device(device)
    if backend == "auto" and _DEFAULT_BACKEND[0] != "auto":
        backend = _DEFAULT_BACKEND[0]
    if backend == "auto":
        if sdpa_available(dev, dtype):
            return "sdpa"
        if dev.type == "cuda" and elements >= KEOPS_AUTO_MIN_ELEMENTS and keops_available():
            return "keops"
        return "chunked"
    if backend == "keops":
        if not keops_available():
            raise ImportError(
                "backend='keops' needs pykeops, which is not importable here; install it with "
                "`pip install pykeops` (it compiles kernels with a C++/CUDA toolchain), "
                "or use backend='auto' / 'chunked'"
            )
        return "keops"
    if backend == "sdpa" and not sdpa_available(dev, dtype):
        return "chunked"
    return backend


# ---------------------------------------------------------------------------- helpers
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


def _check_chunk(chunk_elements):
    if chunk_elements is None:
        return None
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int (elements of one score block), got {chunk_elements!r}")
    return chunk_elements


_SYM_PAIRS = {}


def _sym_pairs(d: int, device, dtype=torch.float64):
    """Upper-triangle index pairs (a ≤ b) and the weights (1 on the diagonal, 2 off it), cached."""
    key = (d, str(device), dtype)
    if key not in _SYM_PAIRS:
        iu = torch.triu_indices(d, d, device=device)
        _SYM_PAIRS[key] = ((iu[0].contiguous(), iu[1].contiguous()), torch.where(iu[0] == iu[1], 1.0, 2.0).to(dtype))
    return _SYM_PAIRS[key]


def _bshape(*shapes) -> tuple:
    """torch.broadcast_shapes for plain tuples, without its overhead (hot path)."""
    r = max(len(s) for s in shapes)
    out = [1] * r
    for s in shapes:
        for i, v in enumerate(s, r - len(s)):
            if v != 1:
                if out[i] != 1 and out[i] != v:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                out[i] = v
    return tuple(out)


def _second_columns(y: torch.Tensor, iu) -> torch.Tensor:
    """(y ⊗ y)_{a≤b}, (..., m, d(d+1)/2)."""
    return y.index_select(-1, iu[0]) * y.index_select(-1, iu[1])


def _quadratic_form(x: torch.Tensor, cols: torch.Tensor, iu, coef) -> torch.Tensor:
    """Σ_{a≤b} coef_ab x_a x_b cols_ab: x (..., n, d), cols (..., H, n, d(d+1)/2) -> (..., H, n)."""
    xx = (_second_columns(x, iu) * coef).unsqueeze(-3)
    return (cols * xx).sum(-1)


def _on_sphere(y: torch.Tensor) -> bool:
    """True when every key has |y_j|² = 1 to within 16 ulp (then Σ_j p_ij |y_j|² = 1 to rounding)."""
    dev = (y.square().sum(-1) - 1.0).abs()
    return dev.numel() == 0 or float(dev.max()) <= 16 * torch.finfo(y.dtype).eps


def _quadratic_form_trace_free(x: torch.Tensor, cols: torch.Tensor, iu, coef) -> torch.Tensor:
    """:func:`_quadratic_form` from the columns without the last one, C_dd = Σ_j p_ij y_jd², for keys on
    the sphere: C_dd = 1 − Σ_{a<d} C_aa, so q = x_d² + Σ_{(a,b)≠(d,d)} (coef_ab x_a x_b − [a=b] x_d²) C_ab.
    x (..., n, d), cols (..., H, n, d(d+1)/2 − 1) -> (..., H, n)."""
    xx = _second_columns(x, iu) * coef  # (..., n, P)
    xd2 = xx[..., -1:]
    diag = (iu[0] == iu[1])[:-1].to(x.dtype)
    xx = xx[..., :-1] - diag * xd2
    return (cols * xx.unsqueeze(-3)).sum(-1) + xd2.squeeze(-1).unsqueeze(-2)


def _check_causal(causal, keys):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}")
    if causal and keys is not None:
        raise ValueError("causal=True needs queries = keys (token i attends to tokens j <= i of the same "
                         "sequence); call without keys=, or with causal=False")


def causal_log_prefix_mass(weights: Optional[torch.Tensor], n: int, *, dtype=None, device=None) -> torch.Tensor:
    """log W_i, the log total weight of the causal prefix j ≤ i: (..., n) from token weights
    (..., n) (log of their cumulative sum), or (n,) = log((i+1)/n) for uniform weights (None)."""
    if weights is None:
        return torch.log(torch.arange(1, n + 1, dtype=dtype, device=device) / n)
    return torch.log(torch.cumsum(weights, -1))


def _causal_block_mask(qidx: torch.Tensor, m: int) -> torch.Tensor:
    """(rows, m) boolean mask, True where key j > query index qidx[r] (masked out)."""
    return torch.arange(m, device=qidx.device).unsqueeze(0) > qidx.unsqueeze(-1)


def _exp_safe_limit(dtype: torch.dtype, m: int) -> float:
    """Largest score bound B for which e^{s}, |s| ≤ B, summed over m keys stays finite and normal."""
    return 0.5 * math.log(torch.finfo(dtype).max) - math.log(max(m, 1))


# ---------------------------------------------------------------------------- softmax
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
    _check_backend(backend)
    _check_chunk(chunk_elements)
    _check_causal(causal, keys)
    y = x if keys is None else keys
    left, right = _features(heads, transpose)
    if _needs_grad(x, y, left, right, weights):
        return _softmax_autograd(x, y, left, right, weights, second_moment, chunk_elements, causal)
    with torch.no_grad():
        # batch shapes of the query features x @ left and the key features y (@ right), before forming them
        qbatch = _bshape(x.shape[:-2], left.shape[:-3])
        kbatch = y.shape[:-2] if right is None else _bshape(y.shape[:-2], right.shape[:-3])
        batch = _bshape(qbatch, kbatch, () if weights is None else weights.shape[:-1])
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
        cols.append(_second_columns(y, iu))
    return torch.cat(cols, -1)


def _softmax_chunked(x, y, qf, kf, weights, second_moment, batch, chunk_elements, dense=False, causal=False):
    """No-grad plain-torch kernel: blocks of S = Q Kᵀ, exp (shift-free when safe), one GEMM with
    vals_j = w_j [1, y_j, (y⊗y)_j] giving m_h, m_h ȳ_h and m_h q_h at once.  causal: e^{s_ij} of
    keys j > i is zeroed (or s_ij set to −∞ before the row-max shift), one block at a time."""
    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    dt, dev = x.dtype, x.device
    iu, coef = _sym_pairs(d, dev, dt) if second_moment else (None, None)
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
            E.masked_fill_(_causal_block_mask(qidx, m), 0.0)
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
            cmask = _causal_block_mask(qidx[r0:r1], m) if causal else None
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
        second = _quadratic_form(x, M[..., 1 + d:], iu, coef) * inv
    return HeadStats(lse, mean, second)


def _softmax_sdpa(x, y, left, right, weights, second_moment, batch, causal=False):
    """Fused CPU flash-attention kernel: output = softmax(Q Kᵀ + log w) [y, y⊗y], plus its logsumexp.
    The kernel needs q, k, v of one width E: the query and key feature maps (left, right) are
    zero-padded to E before they are applied, so Q and K are formed at width E in one product.
    causal: the kernel's own ``is_causal`` flag (top-left aligned, n = m), combined with the log-weight mask."""
    op = _flash_cpu_op()
    H, n, k = left.shape[-3], x.shape[-2], left.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    iu, coef = _sym_pairs(d, x.device, x.dtype) if second_moment else (None, None)
    # keys on the sphere: the last diagonal column y_d² = 1 − Σ_{a<d} y_a² is implied (one column
    # fewer: d = 3 gives the kernel width 8 instead of 9, one AVX-512 vector of float64)
    trace_free = second_moment and _on_sphere(y)
    if second_moment:
        sec = _second_columns(y, iu)
        v = torch.cat([y, sec[..., :-1] if trace_free else sec], -1)  # (..., m, c)
    else:
        v = y
    c = v.shape[-1]
    E = max(k, c)
    G = math.prod(batch)
    pad = torch.nn.functional.pad
    if k < E:  # pad the (small) feature maps, not the (batch, H, n, k) features
        left = pad(left, (0, E - k))
        right = pad(torch.eye(d, dtype=y.dtype, device=y.device), (0, E - d)) if right is None else pad(right, (0, E - k))
    kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right  # (..., 1|H, m, E)
    Hk = kf.shape[-3]
    mask = None
    if weights is not None:
        mask = torch.log(weights).expand(*batch, m).reshape(G, 1, 1, m)
    v4 = v.unsqueeze(-3).expand(*batch, 1, m, c).reshape(G, 1, m, c)
    if c < E:
        v4 = pad(v4, (0, E - c))
    if Hk == 1 and not causal:
        return _softmax_sdpa_merged(op, x, left, kf, v4, mask, weights, batch, iu, coef, trace_free, H, n, m, d, c, E)
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
        stats._mean_fn = functools.partial(_mean_columns, out, d)
    if second_moment:
        cols = out[..., d:c]
        form = _quadratic_form_trace_free if trace_free else _quadratic_form
        stats._second_fn = functools.partial(form, x, cols, iu, coef)  # picklable, unlike a lambda
    if not causal:
        stats._columns = (x, out, d, c, trace_free, iu, coef)
    return stats


def _softmax_sdpa_merged(op, x, left, kf, v4, mask, weights, batch, iu, coef, trace_free, H, n, m, d, c, E):
    """The fused kernel with the heads folded into the query axis (keys and values shared by every head).

    Query row i·H + h is the feature q_h(x_i) = x_i A_h (padded to E), so the (..., n, H·E) block of all
    query features is one product x (..., n, d) @ L (..., d, H·E), and the kernel's output and log-sum-exp
    come back laid out (..., n, H, E) and (..., n, H): every contraction over the heads (the field
    Σ_h ω_h V_h ȳ_h, ∇ δE/δμ) or over the tokens (the ledger's sums) is then a single matrix product
    of that contiguous block, without a copy or a per-head product (:func:`head_columns`)."""
    G = math.prod(batch)
    L = left.transpose(-2, -3)  # (..., d, H, E)
    L = L.reshape(*L.shape[:-2], H * E)
    qshape = (*_bshape(x.shape[:-2], L.shape[:-2]), n, H * E)
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
    stats._mean_fn = functools.partial(_mean_from_merged, out, d)
    if c > d:
        form = _quadratic_form_trace_free if trace_free else _quadratic_form
        stats._second_fn = functools.partial(_second_from_merged, form, x, out, d, c, iu, coef)
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


def _mean_from_merged(out: torch.Tensor, d: int) -> torch.Tensor:
    """ȳ (..., H, n, d), contiguous, from the merged kernel output (..., n, H, E)."""
    return out[..., :d].transpose(-2, -3).contiguous()


def _second_from_merged(form, x, out, d, c, iu, coef):
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


def head_moment_sums_along(stats: HeadStats, weights, log_scale: float, x, extra):
    """(T_h, ito_h, R_h) of :func:`_merged_moment_sums` with the token columns ``extra``, or None where the
    statistics are not merged (the T_h, ito_h are kept for :func:`head_moment_sums`)."""
    merged = stats.__dict__.get("_merged")
    if merged is None:
        return None
    return _merged_moment_sums(stats, merged, weights, log_scale, x, extra)


def head_columns_width(stats: HeadStats) -> int:
    """E, the columns per head of :func:`head_columns`."""
    return stats.__dict__["_merged"][1].shape[-1]


def per_head_map(weights: torch.Tensor, M: torch.Tensor, E: int) -> torch.Tensor:
    """The (..., H·E, d) matrix W with (block @ W)_i = Σ_h ω_h M_h ȳ_h(x_i) for a :func:`head_columns` block:
    W[h·E + b, a] = ω_h M_h[a, b] for b < d, 0 for the second-moment columns."""
    d = M.shape[-1]
    W = (weights.unsqueeze(-1).unsqueeze(-1) * M).transpose(-1, -2)  # (..., H, d, d): [b, a]
    W = torch.nn.functional.pad(W, (0, 0, 0, E - d))  # (..., H, E, d)
    return W.reshape(*W.shape[:-3], W.shape[-3] * E, d)


def _softmax_keops(x, y, qf, kf, weights, second_moment, batch, causal=False):  # pragma: no cover - needs pykeops
    """KeOps symbolic reductions: log Σ_j w_j e^{s_ij} and Σ_j softmax_ij [y_j, (y⊗y)_j].
    causal: s_ij − L·step(j − i − ½) with L = finfo.max/4 (e^{…} = 0 for j > i; the diagonal key
    always survives, so the row max is finite)."""
    from pykeops.torch import LazyTensor

    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    m, d = y.shape[-2], y.shape[-1]
    G = math.prod(batch)
    Hk = kf.shape[-3]
    iu, coef = _sym_pairs(d, x.device, x.dtype) if second_moment else (None, None)
    v = torch.cat([y, _second_columns(y, iu)], -1) if second_moment else y
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
    second = _quadratic_form(x, mom[..., d:], iu, coef) if second_moment else None
    return HeadStats(lse, mean, second)


def _softmax_autograd(x, y, left, right, weights, second_moment, chunk_elements, causal=False):
    """Differentiable path: out-of-place log-sum-exp over query-row chunks (causal: −∞ above the diagonal)."""
    qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
    n, m, d = x.shape[-2], y.shape[-2], y.shape[-1]
    H = qf.shape[-3]
    logw = None if weights is None else torch.log(weights).unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, m)
    kT = (y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right).transpose(-1, -2)  # (..., 1|H, k, m)
    batch = torch.broadcast_shapes(qf.shape[:-3], kT.shape[:-3])
    rows = _rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
    yv = y.unsqueeze(-3)
    lses, means, seconds = [], [], []
    for i0 in range(0, n, rows):
        S = qf[..., i0:i0 + rows, :] @ kT  # (..., H, c, m)
        if logw is not None:
            S = S + logw
        if causal:
            qidx = torch.arange(i0, min(n, i0 + rows), device=x.device)
            S = S.masked_fill(_causal_block_mask(qidx, m), float("-inf"))
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
    cols = stats.__dict__.get("_columns")
    if cols is None:
        return None
    xq, out, d, c, trace_free, iu, coef = cols
    if (x is not None and x is not xq) or _needs_grad(xq, weights):
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
        xx = _second_columns(xq, iu) * coef
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


def _merged_moment_sums(stats, merged, weights, log_scale, x, extra=None):
    """:func:`head_moment_sums` of merged statistics: one product U_wᵀ (c × n) @ Y (n × H·E) per batch entry,
    Y the kernel's output (:func:`head_columns`) times m_h e^{−c}.

    ``extra`` (..., n, d), optional: more token columns in the same product; then a third result
    R_h = Σ_i w_i m_h(x_i) e^{−c} extra_i ȳ_h(x_i)ᵀ (..., H, d, d) (the dissipation's per-head sums)."""
    xq, out, lse_nh, d, c, trace_free, iu, coef = merged
    if (x is not None and x is not xq) or _needs_grad(xq, weights, extra):
        return None
    key = (None if weights is None else weights._version, lse_nh._version, out._version, xq._version, float(log_scale))
    cache = stats.__dict__.get("_moment_sums")
    if cache is not None and cache[0] is weights and cache[1] == key and extra is None:
        return cache[2]
    H, E = out.shape[-2], out.shape[-1]
    mc = head_columns_mass(stats, log_scale)  # (..., n, H)
    U, wb = _token_columns(xq, weights, d, c, trace_free, iu, coef)
    if extra is not None:
        ev = extra / extra.shape[-2] if weights is None else extra * weights.unsqueeze(-1)
        U = torch.cat([U, ev.expand(*U.shape[:-1], d)], -1)
    MU = _weighted_block_products(out, mc, U.transpose(-1, -2))  # (..., c (+d), H·E)
    MU = MU.reshape(*MU.shape[:-1], H, E).transpose(-2, -3)  # (..., H, c (+d), E)
    T = MU[..., :d, :d].transpose(-1, -2)
    ito = None
    if c > d:
        ito = MU[..., d:c, d:c].diagonal(dim1=-2, dim2=-1).sum(-1) + (wb.unsqueeze(-2) @ mc).squeeze(-2)
    stats._moment_sums = (weights, key, (T, ito))
    if extra is None:
        return T, ito
    return T, ito, MU[..., c:, :d]


# ---------------------------------------------------------------------------- relu
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
    _check_backend(backend)
    _check_chunk(chunk_elements)
    _check_causal(causal, keys)
    y = x if keys is None else keys
    left, right = _features(heads)
    qf = x.unsqueeze(-3) @ left
    kf = y.unsqueeze(-3) if right is None else y.unsqueeze(-3) @ right
    n, m, d = x.shape[-2], y.shape[-2], y.shape[-1]
    H = qf.shape[-3]
    batch = _bshape(qf.shape[:-3], kf.shape[:-3], () if weights is None else weights.shape[:-1])
    # "keops" raises the install hint when pykeops is missing; ReLU sums then run chunked
    chosen = select_backend(backend, x.device, x.dtype, math.prod(batch) * H * n * m)
    vals = torch.cat([torch.ones_like(y[..., :1]), y], -1)  # (..., m, 1 + d)
    vals = vals / m if weights is None else vals * weights.unsqueeze(-1)
    vT = vals.unsqueeze(-3)  # (..., 1, m, 1 + d)
    kfT = kf.transpose(-1, -2)
    grad = _needs_grad(x, y, left, right, weights)
    if chosen == "dense":
        rows = n
    else:
        rows = _rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
    outs = []
    for i0 in range(0, n, rows):
        S = qf[..., i0:i0 + rows, :] @ kfT
        R = torch.relu(S) if grad else S.relu_()
        if causal:
            cmask = _causal_block_mask(torch.arange(i0, min(n, i0 + rows), device=x.device), m)
            R = R.masked_fill(cmask, 0.0) if grad else R.masked_fill_(cmask, 0.0)
        outs.append(R @ vT)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -2)
    if causal:  # divide by the prefix mass W_i
        inv_mass = torch.exp(-causal_log_prefix_mass(weights, n, dtype=x.dtype, device=x.device))
        out = out * inv_mass.unsqueeze(-1).unsqueeze(-3)
    return out[..., 0], out[..., 1:]


# ---------------------------------------------------------------------------- values first
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
    left, right = _features(heads)  # β Q_hᵀ, K_hᵀ: (..., H, d, k)
    vin = heads.value_in.transpose(-1, -2)  # (..., H, d, k_v)
    if pad_to is not None:
        pad = torch.nn.functional.pad
        left, right, vin = (t if t.shape[-1] == pad_to else pad(t, (0, pad_to - t.shape[-1]))
                            for t in (left, right, vin))
    widths = (left.shape[-1], right.shape[-1], vin.shape[-1])
    if y is x:  # one product for queries, keys and values
        shape = _bshape(left.shape[:-3], right.shape[:-3], vin.shape[:-3])
        maps = torch.cat([t.expand(*shape, *t.shape[-3:]) for t in (left, right, vin)], -1)
        return torch.split(_project(x, maps), widths, -1)
    shape = _bshape(right.shape[:-3], vin.shape[:-3])
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
            S = S + logw if grad else S.add_(logw)
        if causal:
            cmask = _causal_block_mask(torch.arange(i0, min(n, i0 + rows), device=q.device), m)
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
        as :func:`~transformer_pde.model.attention.softmax_statistics`; "sdpa" (and "auto" on CPU) is the
        fused kernel without autograd, every other choice the plain path.
    causal : bool
        query i sees only keys j ≤ i (prefix measures); needs keys=None.

    Returns
    -------
    tuple
        (log_partition (..., H, n), values (..., H, n, k_v)), as the statistics of
        :func:`~transformer_pde.model.attention.softmax_statistics` (causal: of the prefix measures).

    Raises
    ------
    ValueError
        for an unknown backend, a bad chunk_elements, causal=True with keys=, or heads without the factors.
    """
    _check_backend(backend)
    _check_chunk(chunk_elements)
    _check_causal(causal, keys)
    if not values_first_applies(heads):
        raise ValueError("softmax_values needs heads with query/key factors and value factors "
                         "(tp.Heads(query=, key=, value_in=, value_out=)); use softmax_statistics otherwise")
    y = x if keys is None else keys
    H, n, m = heads.num_heads, x.shape[-2], y.shape[-2]
    k, kv = heads.query.shape[-2], heads.value_in.shape[-2]
    grad = _needs_grad(x, y, heads.query, heads.key, heads.value_in, heads.beta, weights)
    batch = _bshape(x.shape[:-2], y.shape[:-2], heads.batch_shape, () if weights is None else weights.shape[:-1])
    chosen = "chunked" if grad else select_backend(backend, x.device, x.dtype, math.prod(batch) * H * n * m)
    lse = None
    if chosen == "sdpa":
        with torch.no_grad():
            q, kf, u = _features_values(x, y, heads, max(k, kv))
            try:
                lse, out = _fused(_flash_cpu_op(), q, kf, u, weights, causal, batch)
                out = out[..., :kv]
            except RuntimeError:  # a layout or build the fused kernel refuses: same numbers, plain torch
                lse = None
    if lse is None:
        with torch.set_grad_enabled(grad):
            q, kf, u = _features_values(x, y, heads, None)
            logw = None if weights is None else torch.log(weights).unsqueeze(-2).unsqueeze(-2)
            rows = n if chosen == "dense" else _rows_per_chunk(math.prod(batch) * H, n, m, chunk_elements)
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


def deferred_mean_stats(log_partition: torch.Tensor, mean_fn) -> HeadStats:
    """HeadStats with the given log-partitions whose mean ȳ_h is ``mean_fn()`` (a ``functools.partial``),
    formed on first access (the statistics of a values-first evaluation, :func:`softmax_values`)."""
    stats = HeadStats(log_partition, None, None)
    stats._mean_fn = mean_fn
    return stats
