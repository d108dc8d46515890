"""One exponentiated score block per system: rows, columns and causal prefix of the softmax statistics.

For tokens x_i with weights w_i and head h, the scores s_ij^h = β ⟨x_i, A_h x_j⟩ form one (n, n) block
per head.  Its row sums give the statistics of the field, and for the transposed heads A_hᵀ the scores
are s̃_ij = β ⟨x_i, A_hᵀ x_j⟩ = s_ji: the transposed statistics are the COLUMN sums of the same block,

    m_h(x_i) ȳ_h(x_i) = Σ_j w_j e^{s_ij} x_j,      m_h(x_i) = Σ_j w_j e^{s_ij}          (rows)
    m̃_h(x_j) ỹ_h(x_j) = Σ_i w_i e^{s_ij} x_i,      m̃_h(x_j) = Σ_i w_i e^{s_ij}          (columns)

and the causal (prefix) statistics are the rows of its lower triangle j ≤ i, normalised by
W_i = Σ_{j≤i} w_j (:mod:`transformer_pde.model.softmax`).  :func:`pair_block` forms e^{S} once and takes
the three from it: one product of the tokens with the stacked [β A_1 … β A_H] (rows i·H + h), one
product with the tokens for the scores of every head (layout (i, h, j)), one exp2 in place (the stacked
matrices carry log₂e), one product
E (w x) and one sum for the rows, one product (w x)ᵀ E for the columns of every head at once (E read as
(i, (h, j))), and for causal attention the same two of the masked block.  The systems are taken in
blocks whose scores fill :func:`block_bytes` (a fraction of one core's L2 cache), so that the exp and
the products read the scores from the cache.

The exp runs on the scores directly (no max shift): |s_ij| ≤ β ‖A_h‖_F max_i |x_i|², and the block is
formed only when that bound is at most ½ log(finfo.max) − log n, where every e^{s_ij} and every sum of n
of them is a finite normal number.  Otherwise, and with autograd, :func:`pair_block` returns None and
the callers use :func:`transformer_pde.model.softmax.softmax_statistics`.

:func:`pair_diagnostics` computes in the same pass, block by block while the sums are in the cache,
the softmax field and the gradient of the first variation of :func:`transformer_pde.model.field.evaluate`
(docs/model.md#mobility),

    ∇δE/δμ(x_i) = Σ_h ½ ω_h [A_h (m_h ȳ_h)(x_i) + A_hᵀ (m̃_h ỹ_h)(x_i)]     (Σ_h ω_h A_h (m_h ȳ_h) if A_h = A_hᵀ)
    V(x_i) = s P_x Σ_h ω_h V_h ȳ_h(x_i)        (causal: the prefix means)

each head sum one product of the (n, H·d) row block (or of the (H·d, n) column block) with a stacked
matrix of the heads, and then

    E = Σ_h ω_h/(2β) Σ_i w_i m_h(x_i),   b_i = 1 / Σ_h ω̄_h / m_h(x_i),
    𝒢² = Σ_i w_i b_i |V_i|²,   𝒟 = Σ_i w_i ⟨P_x ∇δE/δμ(x_i), V_i⟩.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..utils import hardware
from .backends import DEFAULT_CHUNK_ELEMENTS, causal_log_prefix_mass, needs_grad
from .heads import Heads, broadcast_shapes
from .moments import HeadStats, deferred_mean_stats
from .softmax import softmax_statistics

__all__ = ["PairBlock", "pair_block", "pair_diagnostics", "PairDiagnostics", "pair_field", "PairField", "MAX_TOKENS",
           "BLOCK_FRACTION", "BLOCK_BYTES", "block_bytes", "exp_safe_limit", "takes", "scores_bounded"]

#: the largest token count n for which :func:`transformer_pde.model.field.evaluate` takes the one-block
#: kernel (its (n, n) blocks per head are formed whole; above it the fused O(n)-memory kernels are used).
#: Measured on one core (evaluate with diagnostics, d = 16, H = 8 non-symmetric heads per system, 8192 tokens in
#: all, float64, on an Intel Xeon with a 2 MiB L2; scripts/benchmark_pair_block.py): the one-block kernel takes 0.2× the time of the fused kernels' passes at
#: n = 32, 0.3× at n = 128, 0.55× at n = 512 and 1.0× at n = 1024 (1.25× at n = 2048)
MAX_TOKENS = 512
#: the scores of one block of systems, as a fraction of one core's L2 cache
BLOCK_FRACTION = 0.25
#: the score block in bytes when set (tests: several blocks on small inputs); None: from the cache size
BLOCK_BYTES: Optional[int] = None
#: the score block on devices other than the CPU (no CPU cache to fit; a bound on the scores' memory)
_DEVICE_BLOCK_BYTES = 2 ** 26
#: log₂ e and ln 2: the queries of the pass carry log₂ e (exp2 of the scores), the products that read them ln 2
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def block_bytes(device: torch.device) -> int:
    """Bytes of the scores of one block of systems: on the CPU :data:`BLOCK_FRACTION` of one core's L2
    cache (:func:`transformer_pde.utils.hardware.cache_sizes`), at least 64 KiB; elsewhere 64 MiB;
    :data:`BLOCK_BYTES` when set."""
    if BLOCK_BYTES is not None:
        return int(BLOCK_BYTES)
    if device.type != "cpu":
        return _DEVICE_BLOCK_BYTES
    return max(2 ** 16, int(BLOCK_FRACTION * hardware.cache_sizes().l2))


def takes(n: int, heads: int, chunk_elements: Optional[int] = None) -> bool:
    """True when :func:`transformer_pde.model.field.evaluate` uses the one-block kernel for n tokens and
    ``heads`` heads: n ≤ :data:`MAX_TOKENS` and one system's scores, heads · n², within the memory cap
    ``chunk_elements`` (default :data:`transformer_pde.model.backends.DEFAULT_CHUNK_ELEMENTS`)."""
    cap = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    return n <= MAX_TOKENS and heads * n * n <= cap


def scores_bounded(x: torch.Tensor, heads: Heads) -> bool:
    """True when β ‖A_h‖_F max_i |x_i|² ≤ ½ log(finfo.max) − log n: every score |s_ij| is below that bound, so
    every log-partition log m_h(x_i) ≤ max_j s_ij is too, and the solvers' common scale
    (:func:`transformer_pde.model.energy.choose_log_scale`) is 0 without a kernel pass.  False for
    non-finite input."""
    n = x.shape[-2]
    r2 = float(torch.linalg.vector_norm(x.detach(), dim=-1).max()) ** 2 if x.numel() else 0.0
    return _prepare(heads, x.dtype).bound * r2 <= exp_safe_limit(x.dtype, n)


def exp_safe_limit(dtype: torch.dtype, n: int) -> float:
    """½ log(finfo.max) − log n: scores of modulus at most this keep every e^{s} and every sum of n of them
    finite and normal."""
    return 0.5 * math.log(torch.finfo(dtype).max) - math.log(max(n, 1))


@dataclass
class PairBlock:
    """The row, column and causal-prefix sums of one exponentiated score block per system and head.

    Attributes
    ----------
    mass, rows : torch.Tensor
        (B, n, H) and (B, n, H, d): m_h(x_i) = Σ_j w_j e^{s_ij^h} and m_h ȳ_h(x_i) = Σ_j w_j e^{s_ij^h} x_j.
    col_mass, cols : torch.Tensor or None
        (B, H, n) and (B, d, H, n): m̃_h(x_j) = Σ_i w_i e^{s_ij^h} and m̃_h ỹ_h(x_j) = Σ_i w_i e^{s_ij^h} x_i;
        None when not asked.
    prefix_mass, prefix : torch.Tensor or None
        (B, n, H) and (B, n, H, d): the rows over j ≤ i only (causal attention); None when not asked.
    log_prefix : torch.Tensor or None
        log W_i = log Σ_{j≤i} w_j, (n,) or (B, n).
    batch : tuple
        the batch shape that B flattens.
    """

    mass: torch.Tensor
    rows: torch.Tensor
    col_mass: Optional[torch.Tensor]
    cols: Optional[torch.Tensor]
    prefix_mass: Optional[torch.Tensor]
    prefix: Optional[torch.Tensor]
    log_prefix: Optional[torch.Tensor]
    batch: Tuple[int, ...]

    def _shaped(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*self.batch, *t.shape[1:])

    def _row_stats(self, m, rows, lognorm=None) -> HeadStats:
        lse = torch.log(m)
        if lognorm is not None:  # (n,) or (B, n): log W_i of the prefix
            lse = lse - lognorm.unsqueeze(-1)
        mean = rows / m.unsqueeze(-1)
        return HeadStats(self._shaped(lse.transpose(-1, -2).contiguous()),
                         self._shaped(mean.transpose(-2, -3).contiguous()))

    def forward(self) -> HeadStats:
        """The statistics of the heads A_h at the tokens (as :func:`softmax_statistics`)."""
        return self._row_stats(self.mass, self.rows)

    def transposed(self) -> HeadStats:
        """The statistics of the heads A_hᵀ at the tokens (as ``softmax_statistics(..., transpose=True)``), from
        the columns; ValueError when the block was formed without them."""
        if self.cols is None:
            raise ValueError("this PairBlock was formed with columns=False; call pair_block(..., columns=True)")
        mean = self.cols / self.col_mass.unsqueeze(-3)  # (B, d, H, n)
        return HeadStats(self._shaped(torch.log(self.col_mass)), self._shaped(mean.permute(0, 2, 3, 1).contiguous()))

    def causal(self) -> HeadStats:
        """The causal statistics (as ``softmax_statistics(..., causal=True)``); ValueError when the block was
        formed without them."""
        if self.prefix is None:
            raise ValueError("this PairBlock was formed with causal=False; call pair_block(..., causal=True)")
        return self._row_stats(self.prefix_mass, self.prefix, self.log_prefix)


def _flat(t: torch.Tensor, batch, B: int) -> torch.Tensor:
    """(..., a, b) -> (B, a, b) over the broadcast batch shape (a view when no broadcast is needed)."""
    return t.expand(*batch, *t.shape[-2:]).reshape(B, *t.shape[-2:])


def _log_prefix(x: torch.Tensor, weights, batch, B: int) -> torch.Tensor:
    """log W_i = log Σ_{j≤i} w_j of the causal prefixes: (n,) for uniform weights, else (B, n) over the pass's
    flattened systems."""
    lp = causal_log_prefix_mass(weights, x.shape[-2], dtype=x.dtype, device=x.device)
    return lp if lp.dim() == 1 else _flat(lp.unsqueeze(-1), batch, B).squeeze(-1)


def _stacked_maps(M: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., H·d, d): row block h = scale_h M_hᵀ, so that (n, H·d) @ it = Σ_h scale_h M_h u_h."""
    Mt = scale[..., None, None] * M.transpose(-1, -2)
    return Mt.reshape(*Mt.shape[:-3], Mt.shape[-3] * Mt.shape[-2], Mt.shape[-1])


@dataclass
class _Prep:
    """The prepared head matrices of one set of heads: the stacked β log₂e A_h (d, H·d) (the pass takes exp2
    of the scores, 2^{log₂e·s} = e^{s}: torch's exp2 is 1.7–2.8× faster than its exp on the CPU), the score
    bound max_h β‖A_h‖_F, and (for the diagnostics) the maps of :func:`pair_diagnostics`."""

    qa: torch.Tensor
    bound: float
    maps: Optional[tuple] = None


class _PrepCache(threading.local):
    """The prepared matrices of the last heads seen by this thread (a solve often passes the same head
    tensors at every step).  The key holds the tensors themselves (their storage cannot be reused while
    cached) and their in-place versions."""

    entry = None


_PREP = _PrepCache()


def _prepare(heads: Heads, dtype, diagnostics: Optional[tuple] = None) -> _Prep:
    """The :class:`_Prep` of these heads, cached; with ``diagnostics`` = (symmetric, s) also the diagnostics'
    maps (the field's sign s in the value map)."""
    A, beta = heads.score_matrix, heads.beta
    ts = (A, heads.value_matrix, heads.weights) + ((beta,) if isinstance(beta, torch.Tensor) else ())
    key = (tuple(t._version for t in ts), None if isinstance(beta, torch.Tensor) else float(beta), dtype, diagnostics)
    entry = _PREP.entry
    if (entry is not None and len(entry[0]) == len(ts) and all(a is b for a, b in zip(entry[0], ts))
            and entry[1] == key):
        return entry[2]
    H, d = A.shape[-3], A.shape[-1]
    bt = heads.beta_tensor().to(dtype)
    qa = (bt.reshape(*bt.shape, 1, 1, 1) if bt.dim() else bt) * A
    bound = float(qa.detach().flatten(-2).norm(dim=-1).max()) if qa.numel() else 0.0
    qa = qa * _LOG2E  # the pass exponentiates by exp2: 2^{log₂e · s} = e^{s}
    prep = _Prep(qa.movedim(-3, -2).reshape(*qa.shape[:-3], d, H * d), bound)
    if diagnostics is not None:
        symmetric, sign = diagnostics
        # (Σ_h ½ω_h A_h stacked, ½ω_h/β for the column term (None: symmetric), Σ_h ω_h V_h stacked, ω, β)
        omega = heads.weights
        half = omega if symmetric else 0.5 * omega
        col = None if symmetric else half / (bt.unsqueeze(-1) if bt.dim() else bt)
        if col is not None and col.dim() == 1 and col.numel() and not col.requires_grad and bool((col == col[0]).all()):
            col = float(col[0])  # one ½ω/β for every head and system: the column product's alpha (no pass over Q)
        prep.maps = (_stacked_maps(A, half), col, _stacked_maps(heads.value_matrix, float(sign) * omega), omega, bt)
    if not any(t.requires_grad for t in ts):
        _PREP.entry = (ts, key, prep)
    return prep


class _Workspace(threading.local):
    """Buffers of this thread reused by the next call (the scores and queries of one block of systems:
    no allocation, and no fresh pages to fault in, per call).  Each holds one block: about
    :func:`block_bytes`, or one system's H·n² scores where they are larger (at most the chunk budget of
    :func:`takes`), and is kept until a larger block, another dtype or device replaces it."""

    bufs = None

    def get(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        if self.bufs is None:
            self.bufs = {}
        size = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.bufs[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf[:size].view(shape)


_WS = _Workspace()


@dataclass
class _Sweep:
    """What one pass over the blocks of systems writes (the outputs :func:`_sweep` was asked for)."""

    mass: torch.Tensor
    rows: Optional[torch.Tensor]
    x: torch.Tensor
    xw: torch.Tensor
    wf: Optional[torch.Tensor]
    batch: tuple
    col_mass: Optional[torch.Tensor] = None
    cols: Optional[torch.Tensor] = None
    prefix_mass: Optional[torch.Tensor] = None
    prefix: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    field: Optional[torch.Tensor] = None
    moment: Optional[torch.Tensor] = None


def _forward_mode() -> bool:
    """True inside a functorch transform (``torch.func.jacfwd``, ``jvp``, ``vmap``) or a forward-AD dual level,
    where the pass's ``out=`` products raise (tensors there may carry tangents or batch dims the buffers lack)."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.maybe_current_level() is not None:
        return True
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _sweep(x, weights, prep: _Prep, what: dict) -> Optional[_Sweep]:
    """The pass of :func:`pair_block` over the blocks of systems; ``what``: columns (bool), causal (bool),
    maps (the diagnostics' head maps of :func:`_prepare`, or None), moment and grad (bools, with maps; grad
    False: the field alone, and for causal attention the prefix rows only).  With maps the
    gradient and the field (and, with moment, the ledger's token moment) are formed block by block, and
    the row, column and prefix sums are not kept (the column term of the gradient is one product Eᵀ Y with
    Y_ih = ½ω_h w_i A_hᵀ x_i, the query features rescaled, or Eᵀ Q times one number when ½ω_h w_i/β is
    the same for every head, token and system: no column sums are formed).  None where the score bound
    fails, autograd is on, or forward-mode differentiation or a functorch transform is (the pass writes
    into buffers through ``out=`` products, which forward mode does not support)."""
    n, d = x.shape[-2:]
    qa = prep.qa
    H = qa.shape[-1] // d
    if needs_grad(x, qa, weights) or _forward_mode():
        return None
    r2 = float(torch.linalg.vector_norm(x.detach(), dim=-1).max()) ** 2 if x.numel() else 0.0
    if not prep.bound * r2 <= exp_safe_limit(x.dtype, n):  # also False for NaN
        return None
    maps, columns, causal = what["maps"], what["columns"], what["causal"]
    keep = maps is None  # the sums themselves (PairBlock), or the diagnostics' products
    parts = [x, qa] + ([] if weights is None else [weights.unsqueeze(-1)]) + \
        ([] if keep else [maps[0], maps[2]] + ([maps[1].unsqueeze(-1)] if isinstance(maps[1], torch.Tensor) else []))
    batch = tuple(broadcast_shapes(*(t.shape[:-2] for t in parts)))
    B = math.prod(batch)
    dev, dt = x.device, x.dtype

    def new(*shape):
        return torch.empty(*shape, dtype=dt, device=dev)

    with torch.no_grad():
        xf = _flat(x, batch, B)
        wf = None if weights is None else _flat(weights.unsqueeze(-1), batch, B)  # (B, n, 1)
        # uniform weights on the diagnostics' path: the sums over j are left n times larger (no pass over the
        # tokens or the masses to divide them), and the products that read them are scaled by 1/n
        unit = 1.0 / n if (wf is None and not keep) else 1.0
        xw = xf if unit != 1.0 else (xf / n if wf is None else xf * wf)
        out = _Sweep(new(B, n * H, 1), new(B, n * H, d) if keep else None, xf, xw, wf, batch)
        if keep and columns:
            out.col_mass, out.cols = new(B, 1, H * n), new(B, d, H * n)
        if keep and causal:
            out.prefix_mass, out.prefix = new(B, n * H, 1), new(B, n * H, d)
        coef, alpha = None, None
        grad = keep or what.get("grad", True)  # False: the field alone (no gradient, no moment)
        whole = grad or not causal  # the rows of the whole measure (a causal field alone needs the prefix only)
        if not keep:
            out.grad, out.field = new(B, n, d) if grad else None, new(B, n, d)
            out.moment = new(B, d, H * d) if grad and what.get("moment", True) else None
            if grad and isinstance(maps[1], float) and wf is None:  # Eᵀ Y = (½ω/(nβ)) Eᵀ Q (Q carries log₂e)
                alpha = maps[1] / n * _LN2
            elif grad and maps[1] is not None:  # ½ω_h w_i / β: Y_ih = coef_ih Q_ih, (B, n | 1, H, 1)
                cf = (torch.full((B, 1, 1, 1), maps[1], dtype=dt, device=dev) if isinstance(maps[1], float)
                      else maps[1].expand(*batch, H).reshape(B, 1, H, 1))
                coef = (cf * (_LN2 / n)) if wf is None else cf * (_LN2 * wf.unsqueeze(-1))  # Q carries log₂e
        size = max(1, min(B, block_bytes(dev) // max(n * H * max(n, d) * x.element_size(), 1)))
        heads_flat, sizes, reps = _head_layout(batch, [qa] + ([] if keep else [maps[0], maps[2]]), size)
        qf, GA, VS = heads_flat + [None] * (3 - len(heads_flat))
        ws = {k: _WS.get(k, (size, *shape), x) for k, shape in
              (("q", (n, H * d)), ("e", (n * H, n)), ("y", (n, H * d)), ("pm", (n * H, 1)), ("pr", (n * H, d)),
               ("r", (n * H, d)))}
        ones = (torch.full((B, 1, n), 1.0 / n, dtype=dt, device=dev) if wf is None else wf.transpose(1, 2)) \
            if keep and columns else None
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1).unsqueeze(1) if causal else None

        count = len(sizes) * reps

        def per_system(t):  # the blocks' views of a per-system tensor; None for every block when absent
            return t.split(sizes * reps) if t is not None else [None] * count

        def per_heads(t):  # the blocks' views of a head tensor, the same for every repetition; shared as it is
            return [t] * count if t is None or t.dim() == 2 else list(t.split(sizes)) * reps

        blocks = zip(*(per_system(t) for t in (xf, xw, wf, out.mass, out.rows, ones, out.col_mass, out.cols,
                                               out.prefix_mass, out.prefix, out.grad, out.field, out.moment, coef)),
                     *(per_heads(t) for t in (qf, GA, VS)))
        for xb, xwb, wb, mb, rb, ob, cmb, cb, pmb, prb, gb, fb, tb, cfb, qb, ga, vs in blocks:
            b = xb.shape[0]
            buf = ws if b == size else {k: v[:b] for k, v in ws.items()}
            Q, E = buf["q"], buf["e"]
            if qb.dim() == 2:  # heads shared by all systems
                torch.mm(xb.reshape(b * n, d), qb, out=Q.view(b * n, H * d))
            else:
                torch.bmm(xb, qb, out=Q)  # Q[i, h] = β log₂e A_hᵀ x_i
            torch.bmm(Q.view(b, n * H, d), xb.transpose(1, 2), out=E)  # E[i·H + h, j] = log₂e s_ij^h
            E.exp2_()  # e^{s_ij^h}
            rb = buf["r"] if rb is None else rb
            if whole:
                _row_sums(E, xwb, wb, mb, rb, unit == 1.0)
            if keep and columns:  # Σ_i w_i e^{s_ij^h} [1, x_i] for every (h, j): products over i
                E3 = E.view(b, n, H * n)
                torch.bmm(xwb.transpose(1, 2), E3, out=cb)
                torch.bmm(ob, E3, out=cmb)
            if not keep and grad:
                if tb is not None:  # Σ_i w_i x_i (m_h ȳ_h)(x_i)ᵀ (beta=0: tb's contents are not read)
                    tb.baddbmm_(xwb.transpose(1, 2), rb.view(b, n, H * d), beta=0.0, alpha=unit * unit)
                _times(rb.view(b, n, H * d), ga, gb, unit)  # Σ_h ½ω_h A_h (m_h ȳ_h)(x_i)
                if cfb is not None:  # + Σ_h ½ω_h A_hᵀ (m̃_h ỹ_h)(x_j) = Σ_{i,h} E[(i,h), j] Y_ih
                    Y = torch.mul(Q.view(b, n, H, d), cfb, out=buf["y"].view(b, n, H, d))
                    gb.baddbmm_(E.transpose(1, 2), Y.view(b, n * H, d))
                elif alpha is not None:  # the same with Y = alpha · Q
                    gb.baddbmm_(E.transpose(1, 2), Q.view(b, n * H, d), alpha=alpha)
            if causal:
                E.view(b, n, H, n).masked_fill_(mask, 0.0)
                # the diagnostics keep the whole rows apart; a causal field alone writes the prefix into them
                pmb, prb = (pmb, prb) if keep else ((buf["pm"], buf["pr"]) if whole else (mb, rb))
                _row_sums(E, xwb, wb, pmb, prb, unit == 1.0)
            if not keep:
                means = prb.div_(pmb) if causal else rb.div_(mb)
                _times(means.view(b, n, H * d), vs, fb)  # Σ_h ω_h V_h ȳ_h
        return out


def _head_layout(batch, heads, size: int):
    """(head tensors, block sizes, repetitions): the head tensors (..., a, b) as (a, b) when they have no
    batch (shared by every system), else as (inner, a, b), where the heads vary over the trailing batch
    dims from the first one where any of them is not 1 (``inner`` systems) and repeat over the leading ones
    (the records of a lazy diagnostics pass), which are then not copied; the blocks of systems (at most
    ``size`` each) of one repetition, which the caller takes ``repetitions`` times."""
    B = math.prod(batch)
    if B == 0:  # no systems: no blocks
        return list(heads), [], 1
    hb = broadcast_shapes(*(t.shape[:-2] for t in heads))
    hb = (1,) * (len(batch) - len(hb)) + tuple(hb)
    k = next((i for i, v in enumerate(hb) if v != 1), len(batch))
    inner = math.prod(batch[k:])
    if inner == 1:
        return [t.reshape(t.shape[-2:]) for t in heads], [min(size, B - s) for s in range(0, B, size)], 1
    if inner < size and inner < B:  # few systems per repetition: copy the heads to every system instead
        k, inner = 0, B
    flat = [t.expand(*batch[k:], *t.shape[-2:]).reshape(inner, *t.shape[-2:]) for t in heads]
    return flat, [min(size, inner - s) for s in range(0, inner, size)], B // inner


def _times(u: torch.Tensor, M: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> None:
    """out = alpha · u @ M for a block u (b, n, k); M (k, d) shared by the systems or (b, k, d) (out's contents
    are not read)."""
    b, n, k = u.shape
    if M.dim() == 2:
        out.view(b * n, -1).addmm_(u.reshape(b * n, k), M, beta=0.0, alpha=alpha)
    else:
        out.baddbmm_(u, M, beta=0.0, alpha=alpha)


def _row_sums(E, xwb, wb, mass, rows, divide: bool):
    """m = Σ_j w_j E_ij (uniform weights: the sum over j, divided by n when ``divide``) and Σ_j E_ij xw_j of one
    block (xw_j = w_j x_j, or x_j when the uniform sums are left undivided)."""
    if wb is None:
        torch.sum(E, -1, keepdim=True, out=mass)
        if divide:
            mass.div_(E.shape[-1])
    else:
        torch.bmm(E, wb, out=mass)
    torch.bmm(E, xwb, out=rows)


def pair_block(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor] = None, *, columns: bool = True,
               causal: bool = False) -> Optional[PairBlock]:
    """The rows, columns and causal prefix of the exponentiated score blocks of every system and head.

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) (queries and keys alike).
    heads : Heads
        the heads (batch dims broadcast against x's); their score matrices A_h are used.
    weights : torch.Tensor or None
        token weights (..., n) summing to 1, or None (uniform 1/n).
    columns : bool
        also form the column sums (the statistics of A_hᵀ).
    causal : bool
        also form the causal prefix rows (j ≤ i).

    Returns
    -------
    PairBlock or None
        None when the score bound β‖A_h‖_F max|x_i|² exceeds ½ log(finfo.max) − log n (the shift-free exp
        could overflow), when it is not finite, or when autograd would need the result (any input requires
        grad): the caller then uses :func:`transformer_pde.model.softmax.softmax_statistics`.
    """
    sw = _sweep(x, weights, _prepare(heads, x.dtype), {"columns": columns, "causal": causal, "maps": None})
    if sw is None:
        return None
    B = sw.rows.shape[0]
    n, d = x.shape[-2:]
    H = sw.rows.shape[1] // n
    lp = None
    if causal:
        lp = _log_prefix(x, weights, sw.batch, B)

    def rowsh(m, r):
        return (None, None) if r is None else (m.view(B, n, H), r.view(B, n, H, d))

    return PairBlock(*rowsh(sw.mass, sw.rows),
                     None if sw.cols is None else sw.col_mass.view(B, H, n),
                     None if sw.cols is None else sw.cols.view(B, d, H, n),
                     *rowsh(sw.prefix_mass, sw.prefix), lp, sw.batch)


@dataclass
class PairDiagnostics:
    """The softmax field and diagnostics of one :func:`pair_diagnostics` call (batch shape ``...``).

    velocity, ambient: (..., n, d) s·P_x Σ_h ω_h V_h ȳ_h and s·Σ_h ω_h V_h ȳ_h (causal: the prefix means).
    stats: the whole measure's HeadStats (mean formed on first access).
    outputs: zero-argument callable giving the per-head V_h ȳ_h (..., H, n, d) (causal: the prefix means).
    grad_first_variation: zero-argument callable giving P_x ∇δE/δμ · e^{−c} (..., n, d).
    energy, slope, dissipation: (...,) · e^{−c}.
    """

    velocity: torch.Tensor
    ambient: torch.Tensor
    stats: HeadStats
    outputs: object
    grad_first_variation: object
    energy: torch.Tensor
    slope: torch.Tensor
    dissipation: torch.Tensor


def _scaled(g: torch.Tensor, scale: float, batch, own) -> torch.Tensor:
    """g · scale as (*own, n, d) (∇_S δE/δμ at the common scale, formed on first access)."""
    g = _own_batch(g, batch, own)
    return g if scale == 1.0 else g * scale


def _value_outputs(mean_fn, V: torch.Tensor) -> torch.Tensor:
    """V_h ȳ_h (..., H, n, d), the per-head outputs of the softmax field, from ``mean_fn()`` = ȳ_h."""
    return mean_fn() @ V.transpose(-1, -2)


def _statistics_mean(x, heads, weights, causal: bool) -> torch.Tensor:
    """ȳ_h of :func:`softmax_statistics` (the means a diagnostics pass does not keep, on request)."""
    return softmax_statistics(x, heads, weights, causal=causal).mean


def pair_diagnostics(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor], *, sign: float = 1.0,
                     causal: bool = False, log_scale: float = 0.0, token_moment: bool = True
                     ) -> Optional[PairDiagnostics]:
    """The softmax field and E, 𝒢², 𝒟, ∇δE/δμ from one exponentiated score block (module docstring).

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d).  heads: :class:`Heads`.  weights: token weights (..., n) or None.
    sign : float
        s of the field (+1 ascent, −1 descent).
    causal : bool
        the field of the prefix measures; the diagnostics stay those of the whole measure.
    log_scale : float
        c: the diagnostics are returned times e^{−c} (:func:`transformer_pde.model.field.diagnostics_along`).
    token_moment : bool
        also form the energy ledger's token moment T_h in the pass (attached to the statistics, read by
        :func:`transformer_pde.model.moments.head_moment_sums`); False: not formed (one product of each
        block less; a pairing then forms it from the statistics).

    Returns
    -------
    PairDiagnostics or None
        None where :func:`pair_block` declines, where e^{−c} is not a normal number, or where β = 0 (the
        caller then uses the log-sum-exp path).
    """
    c = float(log_scale)
    if not (c >= 0.0 and math.exp(-c) >= torch.finfo(x.dtype).tiny):
        return None
    b = heads.beta
    if bool((b == 0).any()) if isinstance(b, torch.Tensor) else b == 0.0:
        return None  # β = 0: the block's queries βA x carry no A x to divide back out; the log-sum-exp path
    symmetric = heads.is_symmetric
    prep = _prepare(heads, x.dtype, (symmetric, float(sign)))
    sw = _sweep(x, weights, prep, {"columns": False, "causal": causal, "maps": prep.maps, "moment": token_moment})
    if sw is None:
        return None
    batch = sw.batch
    B, n, d = sw.field.shape
    H = sw.mass.shape[1] // n
    omega, beta = prep.maps[3], prep.maps[4]
    scale = math.exp(-c)
    with torch.no_grad():
        field = sw.field  # (B, n, d), s Σ_h ω_h V_h ȳ_h (the sign is in the stacked V map)
        xf = sw.x
        V = torch.addcmul(field, torch.linalg.vecdot(xf, field).unsqueeze(-1), xf, value=-1.0)  # P_x
        # P_x ∇δE/δμ (unscaled; e^{−c} applied on request).  𝒟 pairs it, projected: off the sphere (the flat
        # dynamics) v − ⟨x, v⟩x is not orthogonal to x, so ⟨g, V⟩ is not ⟨P_x g, V⟩
        g = sw.grad.addcmul_(torch.linalg.vecdot(xf, sw.grad).unsqueeze(-1), xf, value=-1.0)
        m = sw.mass.view(B, n, H)  # m_h(x_i)
        if weights is None:  # the sums of uniform weights were left n times larger
            m = m / n
        om = omega.expand(*batch, H).reshape(B, H)
        binv = torch.reciprocal(m) @ (om / om.sum(-1, keepdim=True)).unsqueeze(-1)  # (B, n, 1): Σ_h ω̄_h / m_h
        dens = torch.stack([torch.linalg.vecdot(V, V) / binv.squeeze(-1), torch.linalg.vecdot(g, V)], -1)
        if sw.wf is None:
            wm, sums = m.mean(1), dens.mean(1)
        else:
            wt = sw.wf.transpose(1, 2)  # (B, 1, n)
            wm, sums = (wt @ m).squeeze(1), (wt @ dens).squeeze(1)
        energy = (wm * om).sum(-1) / (2 * beta.expand(batch).reshape(B))
        lse = torch.log(m).transpose(-1, -2).reshape(*batch, H, n)
        # ȳ_h and the per-head outputs are not kept by the pass: formed again on request (rarely read)
        mean_fn = functools.partial(_statistics_mean, x, heads, weights, False)
        stats = deferred_mean_stats(lse, mean_fn)
        if sw.moment is not None:
            stats._pair_sums = _TokenMoment(x, weights, sw.moment, batch)
        outputs = functools.partial(_value_outputs, functools.partial(_statistics_mean, x, heads, weights, True)
                                    if causal else mean_fn, heads.value_matrix)
        own = tuple(broadcast_shapes(x.shape[:-2], heads.score_matrix.shape[:-3], heads.weights.shape[:-1],
                                     heads.beta_tensor().shape, () if weights is None else weights.shape[:-1]))
        grad = functools.partial(_scaled, g, scale, batch, own)
        return PairDiagnostics(V.view(*batch, n, d), field.view(*batch, n, d), stats, outputs, grad,
                               _own_batch(energy * scale, batch, own),
                               (sums[:, 0] * scale).reshape(batch), (sums[:, 1] * scale).reshape(batch))


@dataclass
class PairField:
    """The softmax field of one :func:`pair_field` call (batch shape ``...``).

    velocity, ambient: (..., n, d) s·P_x Σ_h ω_h V_h ȳ_h and s·Σ_h ω_h V_h ȳ_h (causal: the prefix means).
    stats: the HeadStats of the field's measure (causal: the prefix statistics), the mean formed on first access.
    outputs: zero-argument callable giving the per-head V_h ȳ_h (..., H, n, d).
    """

    velocity: torch.Tensor
    ambient: torch.Tensor
    stats: HeadStats
    outputs: object


def pair_field(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor], *, sign: float = 1.0,
               causal: bool = False) -> Optional[PairField]:
    """The softmax field alone (no diagnostics) from one exponentiated score block per system.

    The pass of :func:`pair_diagnostics` without the gradient of the first variation: the queries, the scores,
    one exp2, the row sums (causal: of the masked block only) and one product of the means with the stacked
    value maps.  The statistics returned are those of the field's measure (the whole one, or the prefixes),
    as :func:`transformer_pde.model.softmax.softmax_statistics` gives them.

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d).  heads: :class:`Heads`.  weights: token weights (..., n) or None.
    sign : float
        s of the field (+1 ascent, −1 descent).
    causal : bool
        the field of the prefix measures (j ≤ i).

    Returns
    -------
    PairField or None
        None where :func:`pair_block` declines (the caller then uses the log-sum-exp path).
    """
    prep = _prepare(heads, x.dtype, (heads.is_symmetric, float(sign)))
    sw = _sweep(x, weights, prep, {"columns": False, "causal": causal, "maps": prep.maps, "moment": False,
                                   "grad": False})
    if sw is None:
        return None
    batch = sw.batch
    B, n, d = sw.field.shape
    H = sw.mass.shape[1] // n
    with torch.no_grad():
        field, xf = sw.field, sw.x
        V = torch.addcmul(field, torch.linalg.vecdot(xf, field).unsqueeze(-1), xf, value=-1.0)  # P_x
        lse = torch.log(sw.mass.view(B, n, H))
        if weights is None:  # the sums of uniform weights were left n times larger
            lse = lse - math.log(n)
        if causal:  # log of the prefix masses normalised by W_i = Σ_{j≤i} w_j
            lse = lse - _log_prefix(x, weights, batch, B).unsqueeze(-1)
        lse = lse.transpose(-1, -2).reshape(*batch, H, n)
        mean_fn = functools.partial(_statistics_mean, x, heads, weights, causal)
        return PairField(V.view(*batch, n, d), field.view(*batch, n, d), deferred_mean_stats(lse, mean_fn),
                         functools.partial(_value_outputs, mean_fn, heads.value_matrix))


def _own_batch(t: torch.Tensor, batch, own) -> torch.Tensor:
    """t (B, *rest) of the pass over ``batch`` as (*own, *rest), ``own`` the batch of the tokens, the score
    matrices, ω, β and the token weights (as the log-sum-exp path): the value matrices' batch axes, which
    E and ∇δE/δμ do not depend on, are dropped (their entries are equal)."""
    rest = tuple(t.shape[1:])
    t = t.reshape(tuple(batch) + rest)
    if own == tuple(batch):
        return t
    padded = (1,) * (len(batch) - len(own)) + own
    return t[tuple(slice(None) if o != 1 else slice(0, 1) for o in padded)].reshape(own + rest)


class _TokenMoment:
    """T_h = Σ_i w_i m_h(x_i) e^{−c} ȳ_h(x_i) x_iᵀ (..., H, d, d) of the energy ledger's pairing
    (:func:`transformer_pde.model.moments.head_moment_sums`), from the pass's products
    P[a, (h, b)] = Σ_i w_i x_ia (m_h ȳ_h)(x_i)_b, (B, d, H·d); None for other tokens or weights than the
    pass's, or after an in-place change of them."""

    def __init__(self, x, weights, moment, batch):
        self.x, self.w, self.P, self.batch = x, weights, moment, batch
        self.versions = (x._version, None if weights is None else weights._version)
        self.T = None

    def __call__(self, weights, log_scale: float, x=None):
        """(T e^{−c}, None) (no second-moment sums), or None (the class docstring)."""
        if ((x is not None and x is not self.x) or weights is not self.w
                or self.versions != (self.x._version, None if weights is None else weights._version)):
            return None
        if self.T is None:
            B, d, Hd = self.P.shape
            H = Hd // d
            self.T = self.P.view(B, d, H, d).permute(0, 2, 3, 1).reshape(*self.batch, H, d, d)
        c = float(log_scale)
        return (self.T if c == 0.0 else self.T * math.exp(-c)), None
