"""Positional attention: causal attention whose keys carry a positional weight (ALiBi and its kin).

Token i (position p_i) attends to the tokens j ≤ i of the stored order (j < i with ``strict=True``),
each weighted by its token weight w_j and a positional weight e^{b_h(p_i, p_j)} of head h:

    π_ij^h = w_j e^{b_h(p_i, p_j)} / Π_i^h,      Π_i^h = Σ_{k ≤ i} w_k e^{b_h(p_i, p_k)}

is the **positional prefix measure** μ_i^h = Σ_j π_ij^h δ_{x_j} of query i, and every causal statistic is
that of μ_i^h (docs/model.md#positional-attention):

    log m_h(x_i) = log Σ_j π_ij^h e^{s_ij},     ȳ_h(x_i) = Σ_j π_ij^h e^{s_ij} y_j / m_h(x_i),
    s_ij = β⟨x_i, A_h x_j⟩.

So softmax attention sees the weights w_j e^{s_ij + b_h(p_i, p_j)} (the bias is one more term in the
score, as ALiBi adds it), and the un-normalised kernel is f_h(x_i) = Σ_j π_ij^h e^{s_ij} V_h x_j: the
positional weights normalised over the prefix, the interaction kernel not (``prefix="mean"``, the
default); ``prefix="sum"`` drops the division by Π_i^h (f_h = Σ_j w_j e^{b_h} e^{s_ij} V_h x_j).  With
b ≡ 0 both are the library's plain causal attention (``causal=True`` / ``causal="sum"``), and any bias
that depends on the query alone, b_h(p_i, p_j) = g(p_i), cancels in π and leaves the "mean" statistics
unchanged.

The biases (each a frozen object that ``causal=`` takes wherever it takes ``True``):

    ALiBi(slopes)            b_h = −m_h (p_i − p_j)        (Press, Smith, Lewis 2022; a slope per head)
    KineticDecay(lam)        b   = −(λ/L) (p_i − p_j)       (L = n: the weights e^{−(λ/n)(i−j)} of
                                                             Duerinckx, Geshkovski, Rossi 2026)
    PositionKernel(fn)       b   = log fn(p_i, p_j)         (a user's kernel of the positions)

Positions are the indices p_j = j (0, …, n−1) unless the object carries ``positions`` (..., n).

The kernel (:func:`positional_statistics`) runs over blocks of query rows [i0, i1) against the keys of
their prefix [0, i1) only: memory ~ ``chunk_elements`` scores per block, never n × n; the bias block is
formed inside the block.  With autograd the forward pass is the no-grad kernel's and the backward pass
recomputes one block at a time out of place and back-propagates through it (a checkpoint per block): memory
stays O(n·d) per evaluation plus one block, and gradients reach x, the heads, the token weights and the
bias's own tensors (slopes, λ, positions; a kernel's closure through ``torch.utils.checkpoint``).  Second
derivatives are not available (the backward pass is not itself differentiable).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch.autograd.function import once_differentiable

from .backends import causal_block_mask, check_chunk, flash_cpu_op, needs_grad, rows_per_chunk, sdpa_available
from .heads import Heads
from .moments import HeadStats
from .softmax import score_features

__all__ = ["PositionalBias", "ALiBi", "KineticDecay", "PositionKernel", "positional_statistics",
           "PositionalStats", "PREFIX_MODES"]

#: ``prefix=``: "mean" (positional weights normalised over the prefix) or "sum" (not normalised)
PREFIX_MODES = ("mean", "sum")


def _describe(v) -> str:
    """A stable description for ``repr`` (checkpoint fingerprints): tensors by shape, dtype and a hash of
    their values; callables by their qualified name."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        digest = hashlib.sha1(t.numpy().tobytes()).hexdigest()[:12] if t.numel() else "empty"
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, sha1={digest})"
    if callable(v):
        return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__name__)}"
    return repr(v)


@dataclass(frozen=True, eq=False, repr=False)
class PositionalBias:
    """Base class of the positional biases b_h(p_i, p_j) (module docstring); ``causal=`` takes any subclass.

    Parameters
    ----------
    positions : torch.Tensor or None
        the tokens' positions p (..., n), any real dtype; None: the indices 0, …, n−1.
    strict : bool
        token i attends to j < i only (the first token then attends to nothing: its outputs are zero,
        it does not move); False: j ≤ i, as ``causal=True``.
    prefix : str
        "mean" (positional weights normalised over the prefix) or "sum" (module docstring).

    Subclasses define :meth:`log_weights`; ``num_heads`` (None: one bias for every head)."""

    positions: Optional[torch.Tensor] = field(default=None, kw_only=True)
    strict: bool = field(default=False, kw_only=True)
    prefix: str = field(default="mean", kw_only=True)

    def __post_init__(self):
        if type(self) is PositionalBias:
            raise TypeError("PositionalBias is the abstract base; use ALiBi(slopes), KineticDecay(lam) or "
                            "PositionKernel(fn)")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be True or False, got {type(self.strict).__name__} {self.strict!r}")
        if not isinstance(self.prefix, str) or self.prefix not in PREFIX_MODES:
            raise ValueError(f"prefix must be 'mean' (positional weights normalised over the prefix) or 'sum', "
                             f"got {self.prefix!r}")
        p = self.positions
        if p is not None:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"positions must be a tensor (..., n) or None (the indices), got {type(p).__name__}")
            if p.dim() < 1 or p.is_complex():
                raise ValueError(f"positions must be a real tensor of shape (..., n), got shape {tuple(p.shape)} "
                                 f"and dtype {p.dtype}")
            if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
                raise ValueError("positions must be finite; found NaN or inf")

    # -------------------------------------------------------------- what subclasses define
    @property
    def num_heads(self) -> Optional[int]:
        """The number of heads the bias is given for, or None when one bias serves every head."""
        return None

    def log_weights(self, qpos: torch.Tensor, kpos: torch.Tensor, n: int) -> torch.Tensor:
        """b(p_i, p_j) for query positions ``qpos`` (..., r, 1) and key positions ``kpos`` (..., 1, m):
        (..., 1, r, m) (one bias for all heads) or (..., H, r, m); ``n`` is the sequence length.

        Parameters
        ----------
        qpos, kpos : torch.Tensor
            positions, broadcasting to (..., r, m).
        n : int
            the number of tokens.

        Returns
        -------
        torch.Tensor
            the log positional weights, −inf for weight zero."""
        raise NotImplementedError

    def separable(self, pos: torch.Tensor, n: int):
        """(row, col) with b_h(p_i, p_j) = row_i + col_j, each (..., H|1, n), when the bias is a sum of a query
        and a key term (ALiBi, the kinetic decay), else None.  The kernel then reweights the keys by e^{col_j}
        instead of forming a bias block (the query term cancels in the normalised prefix measure).

        Parameters
        ----------
        pos : torch.Tensor
            the positions (..., n).
        n : int
            the number of tokens.

        Returns
        -------
        tuple or None
            (row, col)."""
        return None

    def _tensors(self) -> dict:
        """The tensors the bias holds besides positions (for the device check)."""
        return {}

    # -------------------------------------------------------------- shared
    def token_positions(self, n: int, ref: torch.Tensor) -> torch.Tensor:
        """The positions p (..., n) (or (n,)) in the dtype and on the device of ``ref``.

        Raises
        ------
        ValueError
            the carried positions do not have n entries on their last axis."""
        if self.positions is None:
            return torch.arange(n, dtype=ref.dtype, device=ref.device)
        if self.positions.shape[-1] != n:
            raise ValueError(f"the positional bias carries positions for {self.positions.shape[-1]} tokens but the "
                             f"sequence has n = {n}; give positions of shape (..., {n}) or None (the indices)")
        return self.positions.to(ref.dtype)

    def check(self, x: torch.Tensor, heads: Heads) -> None:
        """Refuse what does not fit the tokens ``x`` (..., n, d) and ``heads`` before any work.

        Raises
        ------
        ValueError
            positions of another length; a per-head bias for another number of heads.
        TypeError
            tensors on another device than x."""
        n = x.shape[-2]
        for name, t in (("positions", self.positions), *self._tensors().items()):
            if t is not None and t.device != x.device:
                raise TypeError(f"the positional bias's {name} are on {t.device} but x is on {x.device}; move them "
                                f"with .to(x.device)")
        self.token_positions(n, x)
        H = self.num_heads
        if H is not None and H != heads.num_heads:
            raise ValueError(f"the positional bias has {H} per-head entries but the heads are H = {heads.num_heads}; "
                             f"give one entry per head (or a single one for all heads)")

    def __repr__(self) -> str:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return f"{type(self).__name__}(" + ", ".join(f"{k}={_describe(v)}" for k, v in fields.items()) + ")"


def _slopes(value, name: str) -> Union[float, torch.Tensor]:
    """A finite real number, or a 1-D floating tensor of per-head values (Python sequences become float64)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {value.dtype}; use {name}.double()")
        if value.dim() == 0:
            return value
        if value.dim() != 1 or value.numel() < 1:
            raise ValueError(f"{name} must be a number or a 1-D tensor (H,) of per-head values, got shape "
                             f"{tuple(value.shape)}")
        if not bool(torch.isfinite(value.detach()).all()):
            raise ValueError(f"{name} must be finite; found NaN or inf")
        return value
    if isinstance(value, (list, tuple)):
        try:
            t = torch.tensor([float(v) for v in value], dtype=torch.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a number or a sequence of numbers, got {value!r}") from None
        return _slopes(t, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, a sequence of per-head numbers or a tensor (H,), got "
                        f"{type(value).__name__} {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _per_head(value, ref: torch.Tensor) -> torch.Tensor:
    """(H, 1, 1) (or (1, 1, 1) for one number) in ref's dtype: slopes broadcasting against (..., H, r, m)."""
    if isinstance(value, torch.Tensor):
        return value.to(ref.dtype).reshape(-1, 1, 1)
    return torch.tensor(value, dtype=ref.dtype, device=ref.device).reshape(1, 1, 1)


@dataclass(frozen=True, eq=False, repr=False)
class ALiBi(PositionalBias):
    """Attention with linear biases: b_h(p_i, p_j) = −m_h (p_i − p_j), a slope m_h per head.

    Parameters
    ----------
    slopes : float, sequence or torch.Tensor
        one slope for every head, or one per head (H,); a tensor may require grad.  m = 0 is plain causal
        attention.  :meth:`geometric` gives the slopes of Press, Smith and Lewis (2022).
    positions, strict, prefix
        as :class:`PositionalBias`.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.sample_uniform(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> heads = tp.Heads.scalar([1.0, 2.0], 3).to(torch.float64)
    >>> v = tp.velocity(x, heads, causal=tp.ALiBi.geometric(2))
    >>> v.shape
    torch.Size([6, 3])
    """

    slopes: Union[float, torch.Tensor] = 0.0

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "slopes", _slopes(self.slopes, "ALiBi slopes"))

    @classmethod
    def geometric(cls, num_heads: int, **kwargs) -> "ALiBi":
        """The slopes m_h = 2^{−8h/H}, h = 1, …, H (Press, Smith and Lewis 2022, for any H).

        Parameters
        ----------
        num_heads : int
            H.
        **kwargs
            positions, strict, prefix.

        Returns
        -------
        ALiBi
            the bias."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        h = torch.arange(1, num_heads + 1, dtype=torch.float64)
        return cls(torch.exp2(-8.0 * h / num_heads), **kwargs)

    @property
    def num_heads(self) -> Optional[int]:
        """H of per-head slopes, None for one slope."""
        s = self.slopes
        return int(s.shape[0]) if isinstance(s, torch.Tensor) and s.dim() == 1 else None

    def _tensors(self) -> dict:
        return {"slopes": self.slopes} if isinstance(self.slopes, torch.Tensor) else {}

    def log_weights(self, qpos, kpos, n):
        """−m_h (p_i − p_j), (..., H|1, r, m) (see :meth:`PositionalBias.log_weights`)."""
        return -_per_head(self.slopes, qpos) * (qpos - kpos).unsqueeze(-3)

    def separable(self, pos, n):
        """(−m_h p_i, m_h p_j) (see :meth:`PositionalBias.separable`)."""
        a = _per_head(self.slopes, pos).squeeze(-1)  # (H|1, 1)
        col = a * pos.unsqueeze(-2)
        return -col, col


@dataclass(frozen=True, eq=False, repr=False)
class KineticDecay(PositionalBias):
    """The weights e^{−(λ/L)(p_i − p_j)} of the kinetic theory of causal attention (L = n by default).

    With the index positions and L = n these are the weights e^{−(λ/n)(j − k)} of Duerinckx, Geshkovski and
    Rossi (2026): in the kinetic limit token i sits at s = (i + 1)/n ∈ (0, 1] and attends to s' < s with
    density λ e^{λ s'} / (e^{λ s} − 1).  Their particle model is ``KineticDecay(lam, strict=True)`` with the
    "unnormalized" normalisation (docs/lost_in_the_middle.md).

    Parameters
    ----------
    lam : float or torch.Tensor
        λ ≥ 0 (one for every head, or (H,) per head); λ = 0 is plain causal attention.
    length : float or None
        L; None: the number of tokens n of each evaluation.
    positions, strict, prefix
        as :class:`PositionalBias`.
    """

    lam: Union[float, torch.Tensor] = 1.0
    length: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        lam = _slopes(self.lam, "KineticDecay lam")
        low = float(lam.detach().min()) if isinstance(lam, torch.Tensor) else lam
        if low < 0:
            raise ValueError(f"KineticDecay lam must be >= 0 (a decay; a negative λ favours distant tokens: use "
                             f"ALiBi with a negative slope for that), got {low}")
        object.__setattr__(self, "lam", lam)
        if self.length is not None:
            if isinstance(self.length, bool) or not isinstance(self.length, (int, float)) \
                    or not math.isfinite(self.length) or self.length <= 0:
                raise ValueError(f"KineticDecay length must be a finite number > 0 or None (the number of tokens), "
                                 f"got {self.length!r}")

    @property
    def num_heads(self) -> Optional[int]:
        """H of per-head λ, None for one λ."""
        s = self.lam
        return int(s.shape[0]) if isinstance(s, torch.Tensor) and s.dim() == 1 else None

    def _tensors(self) -> dict:
        return {"lam": self.lam} if isinstance(self.lam, torch.Tensor) else {}

    def log_weights(self, qpos, kpos, n):
        """−(λ/L)(p_i − p_j), (..., H|1, r, m) (see :meth:`PositionalBias.log_weights`)."""
        L = float(n) if self.length is None else float(self.length)
        return -(_per_head(self.lam, qpos) / L) * (qpos - kpos).unsqueeze(-3)

    def separable(self, pos, n):
        """(−(λ/L) p_i, (λ/L) p_j) (see :meth:`PositionalBias.separable`)."""
        L = float(n) if self.length is None else float(self.length)
        col = (_per_head(self.lam, pos).squeeze(-1) / L) * pos.unsqueeze(-2)
        return -col, col


@dataclass(frozen=True, eq=False, repr=False)
class PositionKernel(PositionalBias):
    """A user's position kernel: b(p_i, p_j) = log fn(p_i, p_j) (or fn itself with ``log=True``).

    Parameters
    ----------
    fn : callable
        ``fn(qpos, kpos)`` with query positions qpos (..., r, 1) and key positions kpos (..., r, m) returns the
        weights (..., r, m) ≥ 0 (one kernel for every head) or, with ``per_head=True``, (..., H, r, m).  It is
        called on blocks of query rows against the keys of their prefix; where a key lies beyond a query (masked:
        weight zero) kpos holds the query's own position, so fn only ever sees pairs p_j ≤ p_i of the causal
        order (a kernel of p_i − p_j ≥ 0 needs no care for negative distances).  Tensors it closes over may
        require grad.
    log : bool
        fn returns log-weights (−inf for zero) instead of weights.
    per_head : bool
        fn returns one kernel per head.
    positions, strict, prefix
        as :class:`PositionalBias`.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> power = tp.PositionKernel(lambda p, q: (1.0 + p - q) ** -1.5)   # a power-law decay in the distance
    >>> x = tp.sphere.sample_uniform(5, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> tp.velocity(x, tp.Heads.scalar([1.0], 2).to(torch.float64), causal=power).shape
    torch.Size([5, 2])
    """

    fn: Optional[Callable] = None
    log: bool = False
    per_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not callable(self.fn):
            raise TypeError(f"PositionKernel needs a callable fn(qpos, kpos) -> weights, got "
                            f"{type(self.fn).__name__}")
        for name in ("log", "per_head"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PositionKernel {name} must be True or False, got {getattr(self, name)!r}")

    def log_weights(self, qpos, kpos, n):
        """log fn(p_i, p_j), (..., H|1, r, m) (see :meth:`PositionalBias.log_weights`).

        Raises
        ------
        TypeError, ValueError
            fn returns no tensor, a tensor of another shape, negative weights or NaN."""
        out = self.fn(qpos, kpos)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the position kernel must return a tensor, got {type(out).__name__}")
        want = torch.broadcast_shapes(qpos.shape, kpos.shape)
        got = out.shape[:-3] + out.shape[-2:] if self.per_head else out.shape
        try:
            ok = torch.broadcast_shapes(got, want) == torch.Size(want) and out.shape[-2:] == want[-2:]
        except RuntimeError:
            ok = False
        if not ok:
            lead = "(..., H, r, m)" if self.per_head else "(..., r, m)"
            raise ValueError(f"the position kernel returned shape {tuple(out.shape)} for {want[-2]} query and "
                             f"{want[-1]} key positions; return {lead}")
        out = out.to(qpos.dtype)
        if torch.isnan(out.detach()).any():
            raise ValueError("the position kernel returned NaN")
        if not self.log:
            if bool((out.detach() < 0).any()):
                raise ValueError("the position kernel returned negative weights; weights must be >= 0 (or pass "
                                 "log=True and return log-weights)")
            out = torch.log(out)
        elif bool((out.detach() == float("inf")).any()):
            raise ValueError("the position kernel returned a log-weight +inf")
        return out if self.per_head else out.unsqueeze(-3)


# ----------------------------------------------------------------------------------------------- kernel
@dataclass
class PositionalStats:
    """The statistics of the positional prefix measures (module docstring), batch shape ``...``.

    stats:      :class:`~transformer_pde.model.moments.HeadStats` (softmax kind: log m_h, ȳ_h, optional
                second moment), or None.
    log_prefix: (..., H|1, n) log Π_i^h, the log total positional weight of the prefix (−inf: an empty prefix).
    relu:       (mass (..., H, n), first (..., H, n, d)) of the ReLU kind: Σ_j π_ij ReLU(s_ij) [1, y_j], or None.
    plan:       (..., H, n, d) Σ_j P_ij y_j of a plan kind, or None.
    """

    stats: Optional[HeadStats]
    log_prefix: torch.Tensor
    relu: Optional[tuple] = None
    plan: Optional[torch.Tensor] = None


def _log_token_weights(weights, n, ref):
    if weights is None:
        return torch.full((n,), -math.log(n), dtype=ref.dtype, device=ref.device)
    return torch.log(weights)


@dataclass(frozen=True)
class _Blocks:
    """What every block of query rows shares: the query and key features (..., H, n, k), (..., 1|H, n, k),
    the tokens y (..., n, d), positions (..., n), log token weights (..., n), the bias, n and strictness."""

    qf: torch.Tensor
    kf: torch.Tensor
    y: torch.Tensor
    pos: torch.Tensor
    logw: torch.Tensor
    bias: PositionalBias
    strict: bool
    #: the no-grad kernel's shortcuts: the score bound B (|s_ij| <= B); ½ log(max float) (no overflow of a
    #: sum of e^{s}) and log(eps/tiny) (weights below tiny change a row by less than one ulp); for a separable
    #: bias (row, g, G, L) with g_j = col_j + log w_j, G its running max and L its running log-sum-exp (..., H|1, n)
    bound: float = math.inf
    overflow: float = 0.0
    precision: float = 0.0
    sep: Optional[tuple] = None

    def log_weights(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """Log positional weights of the rows [i0, i1) over the keys [0, m), masked: (..., H|1, r, m)."""
        qpos = self.pos[..., i0:i1].unsqueeze(-1)
        kpos = self.pos[..., :m].unsqueeze(-2)
        qidx = torch.arange(i0, i1, device=self.pos.device)
        mask = causal_block_mask(qidx - 1 if self.strict else qidx, m)  # True: key j > i (strict: j >= i)
        if isinstance(self.bias, PositionKernel):  # a user's kernel sees only pairs of the prefix
            kpos = torch.where(mask, qpos, kpos)
        lw = self.bias.log_weights(qpos, kpos, self.y.shape[-2]) + self.logw[..., :m].unsqueeze(-2).unsqueeze(-3)
        return lw.masked_fill(mask, float("-inf"))

    def scores(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """s_ij of the rows [i0, i1) and the keys [0, m): (..., H, r, m)."""
        return torch.matmul(self.qf[..., i0:i1, :], self.kf[..., :m, :].transpose(-1, -2))

    def gram(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """⟨x_i, x_j⟩ of the rows [i0, i1) and the keys [0, m): (..., 1, r, m)."""
        return (self.y[..., i0:i1, :] @ self.y[..., :m, :].transpose(-1, -2)).unsqueeze(-3)


def _softmax_block(b: _Blocks, i0, i1, m, second):
    """(log m, log Π, ȳ, q or None) of the rows [i0, i1): out of place (autograd)."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    T = b.scores(i0, i1, m) + lw
    lse = torch.logsumexp(T, -1)
    P = torch.exp(T - lse.unsqueeze(-1))
    mean = P @ b.y[..., :m, :].unsqueeze(-3)
    q = (P * b.gram(i0, i1, m).square()).sum(-1) if second else None
    return lse - lp, lp, mean, q


def _moments(S, b: _Blocks, i0, i1, m, second, key_scale=None):
    """M = S @ [1, y] (times key_scale (..., H|1, m) on the keys), Z = M[..., 0], ȳ, q (or None)."""
    yk = b.y[..., :m, :]
    cols = torch.cat([torch.ones_like(yk[..., :1]), yk], -1).unsqueeze(-3)
    if key_scale is not None:
        cols = cols * key_scale.unsqueeze(-1)
    M = S @ cols
    Z = M[..., 0]
    mean = M[..., 1:] / Z.unsqueeze(-1)
    q = None
    if second:
        G = b.gram(i0, i1, m).square()
        q = ((S * G) if key_scale is None else (S * G * key_scale.unsqueeze(-2))).sum(-1) / Z
    return Z, mean, q


def _softmax_block_inplace(b: _Blocks, i0, i1, m, second):
    """The same without autograd, in place.  Where the scores are bounded, |s_ij| <= B, with 2B + log m within
    log(eps/tiny) (any positional weight below the dtype's tiny then changes the row by less than one ulp), the
    exp runs without a shift: on a separable bias the keys are reweighted by e^{g_j − C} (g_j = col_j + log w_j,
    C the block's max of g), only the block's diagonal square is masked, and log Π comes from the running
    log-sum-exp of g (O(n), no bias block); on any other bias by the positional weights e^{lw − max} of the block.
    Otherwise the block is shifted by its row max.  The partition and the mean come from one product with the
    columns [1, y]."""
    logm = math.log(max(m, 1))
    if b.bound + logm <= b.overflow and 2 * b.bound + logm <= b.precision:
        S = b.scores(i0, i1, m).exp_()
        qidx = torch.arange(i0, i1, device=S.device)
        if b.sep is not None:
            row, g, G, L = b.sep
            C = G[..., m - 1:m]  # (..., H|1, 1)
            first = i0 - 1 if b.strict else i0  # the last key of the block's first row
            if float((C - G[..., first:first + 1]).max()) + 2 * b.bound + logm <= b.precision:
                mask = causal_block_mask(qidx - i0 - (1 if b.strict else 0), m - i0)
                S[..., i0:m].masked_fill_(mask, 0.0)
                Z, mean, q = _moments(S, b, i0, i1, m, second, torch.exp(g[..., :m] - C))
                # L_i = log Σ_{j ≤ i} e^{g_j} (strict: j < i), so log Π_i = row_i + L_i
                Li = L[..., i0 - 1:i1 - 1] if b.strict else L[..., i0:i1]
                return torch.log(Z) + C - Li, row[..., i0:i1] + Li, mean, q
        lw = b.log_weights(i0, i1, m)
        c = lw.amax(-1, keepdim=True)
        W = torch.exp(lw - c)
        lp = c.squeeze(-1) + torch.log(W.sum(-1))
        S = S.mul_(W) if S.shape == torch.broadcast_shapes(S.shape, W.shape) else S * W
        Z, mean, q = _moments(S, b, i0, i1, m, second)
        return torch.log(Z) + c.squeeze(-1) - lp, lp, mean, q
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    S = b.scores(i0, i1, m)
    S = S.add_(lw) if S.shape == torch.broadcast_shapes(S.shape, lw.shape) else S + lw
    mx = S.amax(-1, keepdim=True)
    S.sub_(mx).exp_()
    Z, mean, q = _moments(S, b, i0, i1, m, second)
    return torch.log(Z) + mx.squeeze(-1) - lp, lp, mean, q


def _relu_block(b: _Blocks, i0, i1, m):
    """(Σ_j π_ij ReLU(s_ij), Σ_j π_ij ReLU(s_ij) y_j, log Π) of the rows [i0, i1)."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    R = torch.relu(b.scores(i0, i1, m)) * torch.exp(lw - lp.unsqueeze(-1))
    return R.sum(-1), R @ b.y[..., :m, :].unsqueeze(-3), lp


def _plan_block(b: _Blocks, i0, i1, m, fn, params):
    """(Σ_j P_ij y_j, log Π) for the plan ``fn`` of the masked scores with the key weights π_ij of the rows."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    logpi = lw - lp.unsqueeze(-1)
    S = b.scores(i0, i1, m).masked_fill(torch.isneginf(logpi), float("-inf"))
    return fn(S, logpi, None, **params) @ b.y[..., :m, :].unsqueeze(-3), lp


def _flash_separable(x, qf, kf, sep, strict):
    """Softmax statistics of a separable bias by torch's fused CPU flash-attention kernel, (log m, log Π, ȳ):
    the key terms g_j = col_j + log w_j are its additive (..., H|1, 1, n) log-weight mask, ``is_causal`` its
    prefix (strict: the queries 1..n−1 against the keys 0..n−2), and log m = lse − log Σ_{j≤i} e^{g_j}
    (the query term cancels).  O(n) memory, the kernel's online max (any range of g and of the scores);
    None where the kernel refuses the layout."""
    op = flash_cpu_op()
    row, g, _, L = sep
    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    d = x.shape[-1]
    E = max(k, d)
    pad = torch.nn.functional.pad
    lo = 1 if strict else 0
    r = n - lo  # query rows (and keys) of the kernel
    batch = torch.broadcast_shapes(qf.shape[:-3], kf.shape[:-3], x.shape[:-2], g.shape[:-2])
    G = math.prod(batch)
    q = pad(qf[..., lo:, :], (0, E - k)).expand(*batch, H, r, E).reshape(G, H, r, E)
    kk = pad(kf[..., :r, :], (0, E - k)).expand(*batch, H, r, E).reshape(G, H, r, E)
    v = pad(x[..., :r, :], (0, E - d)).unsqueeze(-3).expand(*batch, H, r, E).reshape(G, H, r, E)
    mask = g[..., :r].unsqueeze(-2).expand(*batch, g.shape[-2], 1, r).reshape(G, g.shape[-2], 1, r)
    try:
        out, lse = op(q, kk, v, is_causal=True, attn_mask=mask, scale=1.0)
    except RuntimeError:
        return None
    lse = lse.reshape(*batch, H, r).to(x.dtype)
    Li = L[..., :r]  # log Σ_{j ≤ i − lo} e^{g_j}
    return lse - Li, row[..., lo:] + Li, out.reshape(*batch, H, r, E)[..., :d]


def positional_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor],
    bias: PositionalBias,
    *,
    kind: str = "softmax",
    second_moment: bool = False,
    chunk_elements: Optional[int] = None,
    plan=None,
    plan_params: Optional[dict] = None,
) -> PositionalStats:
    """The statistics of the positional prefix measures μ_i^h of every head at the tokens (module docstring).

        softmax:  log m_h(x_i) = log Σ_j π_ij^h e^{s_ij},  ȳ_h(x_i) = Σ_j p_ij y_j,  p_ij ∝ w_j e^{s_ij + b_h(p_i, p_j)}
        relu:     Σ_j π_ij^h ReLU(s_ij) [1, y_j]
        plan:     Σ_j P_ij y_j, P = plan(scores, log π, None)   (e.g. the hardmax plan weighted by π)

    over j ≤ i (j < i when ``bias.strict``), s_ij = β⟨x_i, A_h x_j⟩.

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) (queries and keys: the sequence).
    heads : Heads
        the heads (batch dims broadcast against x's).
    weights : torch.Tensor or None
        token weights (..., n), None for uniform.
    bias : PositionalBias
        the positional bias.
    kind : str
        "softmax", "relu" or "plan".
    second_moment : bool
        softmax: also q_h(x_i) = Σ_j p_ij ⟨x_i, x_j⟩².
    chunk_elements : int or None
        cap on the scores of one block of query rows (memory ~ this, not n²).
    plan : callable or None
        kind "plan": ``plan(scores, log_key_weights, None, **plan_params)`` -> P (..., H, r, m) row by row.
    plan_params : dict or None
        passed to the plan.

    Returns
    -------
    PositionalStats
        the statistics; the rows of an empty prefix (the first token when strict) have m_h = 0 (log −inf),
        zero means and zero ReLU moments.

    Raises
    ------
    ValueError, TypeError
        a bias that does not fit x or the heads (:meth:`PositionalBias.check`), a bad chunk_elements or kind.
    """
    check_chunk(chunk_elements)
    if not isinstance(bias, PositionalBias):
        raise TypeError(f"bias must be a PositionalBias (ALiBi, KineticDecay, PositionKernel), got {type(bias).__name__}")
    if kind not in ("softmax", "relu", "plan"):
        raise ValueError(f"kind must be 'softmax', 'relu' or 'plan', got {kind!r}")
    bias.check(x, heads)
    n = x.shape[-2]
    left, right = score_features(heads)
    pos = bias.token_positions(n, x)
    named = bias._tensors()
    grad = needs_grad(x, left, right, weights, pos, *named.values())
    hidden = False  # a kernel closing over tensors that require grad: ask it once, on one pair of positions
    if isinstance(bias, PositionKernel) and torch.is_grad_enabled():
        hidden = bias.log_weights(pos[..., :1].unsqueeze(-1), pos[..., :1].unsqueeze(-1), n).requires_grad
    with torch.enable_grad() if (grad or hidden) else torch.no_grad():
        qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
        kf = x.unsqueeze(-3) if right is None else x.unsqueeze(-3) @ right  # (..., 1|H, n, k)
        logw = _log_token_weights(weights, n, x)
    H = qf.shape[-3]
    batch = math.prod(torch.broadcast_shapes(qf.shape[:-3], kf.shape[:-3], pos.shape[:-1], logw.shape[:-1]))
    spec = _Spec(bias, tuple(named), kind, second_moment, rows_per_chunk(batch * H, n, n, chunk_elements), plan,
                 plan_params or {})
    if hidden:  # gradients to tensors the kernel closes over: torch's own checkpoints see them
        return _checkpointed(spec, qf, kf, x, pos, logw)
    if grad:  # the statistics of the no-grad kernels, their gradients from blocks recomputed one at a time
        flat = _PositionalGrad.apply(spec, qf, kf, x, pos, logw, *named.values())
        return _unflatten(spec, flat)
    with torch.no_grad():
        return _statistics(spec, qf, kf, x, pos, logw)


@dataclass(frozen=True)
class _Spec:
    """What a positional pass computes: the bias (and the names of its own tensors), the kind, the second moment,
    the rows of a block, the plan and its parameters."""

    bias: PositionalBias
    names: tuple
    kind: str
    second: bool
    rows: int
    plan: object
    params: dict

    def blocks(self, i0: int, n: int):
        """(i1, m) of the block of query rows starting at i0: its end and the keys of its prefix."""
        i1 = min(n, i0 + self.rows)
        return i1, (i1 - 1 if self.bias.strict else i1)

    def starts(self, n: int) -> range:
        return range(1 if self.bias.strict else 0, n, self.rows)

    def function(self, grad: bool):
        """(block function, its extra arguments)."""
        if self.kind == "softmax":
            return (_softmax_block if grad else _softmax_block_inplace), (self.second,)
        if self.kind == "relu":
            return _relu_block, ()
        return _plan_block, (self.plan, self.params)

    def with_tensors(self, tensors) -> PositionalBias:
        """The bias holding ``tensors`` in place of its own (the leaves of a recomputation)."""
        return dataclasses.replace(self.bias, **dict(zip(self.names, tensors))) if self.names else self.bias


def _statistics(spec: _Spec, qf, kf, x, pos, logw) -> PositionalStats:
    """The statistics without autograd: the flash kernel for a separable bias (softmax, no second moment), else
    the in-place blocks with their shortcuts."""
    bias, n, d = spec.bias, x.shape[-2], x.shape[-1]
    strict = bias.strict
    blocks = _Blocks(qf, kf, x, pos, logw, bias, strict)
    if spec.kind == "softmax":
        fi = torch.finfo(x.dtype)
        sep = bias.separable(pos, n)
        if sep is not None:
            row, col = sep
            g = col + logw.unsqueeze(-2)
            sep = (row, g, torch.cummax(g, -1).values, torch.logcumsumexp(g, -1))
            if not spec.second and n > (1 if strict else 0) and sdpa_available(x.device, x.dtype):
                flash = _flash_separable(x, qf, kf, sep, strict)
                if flash is not None:
                    return _assemble([(*flash, None)], spec.kind, strict, qf, spec.second, d)
        blocks = _Blocks(qf, kf, x, pos, logw, bias, strict,
                         bound=float(qf.norm(dim=-1).amax()) * float(kf.norm(dim=-1).amax()),
                         overflow=0.5 * math.log(fi.max), precision=math.log(fi.eps / fi.tiny), sep=sep)
    fn, args = spec.function(grad=False)
    parts = [fn(blocks, i0, *spec.blocks(i0, n), *args) for i0 in spec.starts(n)]
    return _assemble(parts, spec.kind, strict, qf, spec.second, d)


def _checkpointed(spec: _Spec, qf, kf, x, pos, logw) -> PositionalStats:
    """The out-of-place blocks under ``torch.utils.checkpoint`` (a kernel whose closure requires grad)."""
    from torch.utils.checkpoint import checkpoint

    n = x.shape[-2]
    blocks = _Blocks(qf, kf, x, pos, logw, spec.bias, spec.bias.strict)
    fn, args = spec.function(grad=True)
    parts = [checkpoint(fn, blocks, i0, *spec.blocks(i0, n), *args, use_reentrant=False) for i0 in spec.starts(n)]
    return _assemble(parts, spec.kind, spec.bias.strict, qf, spec.second, x.shape[-1])


#: the outputs of each kind, in order, with the axis of their query rows
_OUTPUTS = {"softmax": ((-1, "log_partition"), (-1, "log_prefix"), (-2, "mean"), (-1, "second")),
            "relu": ((-1, "mass"), (-2, "first"), (-1, "log_prefix")), "plan": ((-2, "mean"), (-1, "log_prefix"))}


def _flatten(spec: _Spec, st: PositionalStats) -> tuple:
    if spec.kind == "softmax":
        return (st.stats.log_partition, st.log_prefix, st.stats.mean) + ((st.stats.second,) if spec.second else ())
    if spec.kind == "relu":
        return (*st.relu, st.log_prefix)
    return st.plan, st.log_prefix


def _unflatten(spec: _Spec, flat) -> PositionalStats:
    if spec.kind == "softmax":
        return PositionalStats(HeadStats(flat[0], flat[2], flat[3] if spec.second else None), flat[1])
    if spec.kind == "relu":
        return PositionalStats(None, flat[2], relu=(flat[0], flat[1]))
    return PositionalStats(None, flat[1], plan=flat[0])


class _PositionalGrad(torch.autograd.Function):
    """The positional statistics with gradients: the forward pass is the no-grad kernel's (the flash path of
    separable biases included), the backward pass recomputes one block of query rows at a time out of place and
    back-propagates through it, so memory stays one block (O(n) per query block) whatever n is."""

    @staticmethod
    def forward(ctx, spec, qf, kf, x, pos, logw, *bias_tensors):
        ctx.spec = spec
        with torch.no_grad():
            flat = _flatten(spec, _statistics(spec, qf, kf, x, pos, logw))
        ctx.save_for_backward(qf, kf, x, pos, logw, *bias_tensors, flat[0], flat[1])
        return flat

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        spec = ctx.spec
        *saved, out0, out1 = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        if spec.kind == "softmax" and not spec.second and not any(need[3:]):
            return (None, *_softmax_backward(spec, *saved[:5], out0 + out1, grads[0], grads[2], need))
        leaves = [t.detach().requires_grad_(bool(r) and t.is_floating_point()) for t, r in zip(saved, need)]
        qf, kf, x, pos, logw, *bt = leaves
        bias = spec.with_tensors(bt)
        n = x.shape[-2]
        blocks = _Blocks(qf, kf, x, pos, logw, bias, bias.strict)
        fn, args = spec.function(grad=True)
        wanted = [t for t in leaves if t.requires_grad]
        total = [None] * len(wanted)
        axes = [a for a, _ in _OUTPUTS[spec.kind]][:len(grads)]
        for i0 in spec.starts(n):
            i1, m = spec.blocks(i0, n)
            if not any(g is not None for g in grads) or not wanted:
                break
            with torch.enable_grad():
                outs = fn(blocks, i0, i1, m, *args)
            pairs = []
            for o, g, axis in zip(outs, grads, axes):
                if o is None or g is None or not o.requires_grad:
                    continue
                gs = g.narrow(axis, i0, i1 - i0)
                pairs.append((o, gs if gs.shape == o.shape else gs.sum_to_size(o.shape)))
            if not pairs:
                continue
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            total = [a if b is None else (b if a is None else a + b) for a, b in zip(total, got)]
        it = iter(total)
        out = [next(it) if t.requires_grad else None for t in leaves]
        return (None, *out)


def _softmax_backward(spec: _Spec, qf, kf, x, pos, logw, lse, g_lse, g_mean, need):
    """The gradients (qf, kf, x, None, None, ...) of the softmax statistics (log m, ȳ) by their closed form, one
    block of query rows at a time (the bias and the token weights carry no gradient here):

        P_ij = e^{s_ij + lw_ij − lse_i},   ∂L/∂s_ij = P_ij (g_i + ⟨G_i, y_j⟩ − ⟨G_i, ȳ_i⟩),   ∂L/∂y_j ∋ Σ_i P_ij G_i,

    with g = ∂L/∂log m, G = ∂L/∂ȳ (autograd materialises the gradient of an unused output as zeros), lse =
    log Σ_j e^{s_ij + lw_ij} (the forward pass's log m + log Π)."""
    n = x.shape[-2]
    b = _Blocks(qf, kf, x, pos, logw, spec.bias, spec.bias.strict)
    dq = torch.zeros_like(qf) if need[0] else None
    dk = torch.zeros_like(kf) if need[1] else None
    dy = torch.zeros_like(x) if need[2] else None
    for i0 in spec.starts(n):
        i1, m = spec.blocks(i0, n)
        P = b.scores(i0, i1, m)
        lw = b.log_weights(i0, i1, m)
        P = P.add_(lw) if P.shape == torch.broadcast_shapes(P.shape, lw.shape) else P + lw
        P = P.sub_(lse[..., i0:i1].unsqueeze(-1)).exp_()  # (..., H, r, m)
        yk = x[..., :m, :].unsqueeze(-3)
        Gm = g_mean[..., i0:i1, :]  # (..., H, r, d)
        dT = Gm @ yk.transpose(-1, -2)  # ⟨G_i, y_j⟩
        D = (P * dT).sum(-1, keepdim=True)  # ⟨G_i, ȳ_i⟩
        dT = (dT - D + g_lse[..., i0:i1].unsqueeze(-1)) * P
        if dy is not None:
            dy[..., :m, :] += (P.transpose(-1, -2) @ Gm).sum(-3).sum_to_size(dy[..., :m, :].shape)
        if dq is not None:
            dq[..., i0:i1, :] += (dT @ kf[..., :m, :]).sum_to_size(dq[..., i0:i1, :].shape)
        if dk is not None:
            dk[..., :m, :] += (dT.transpose(-1, -2) @ qf[..., i0:i1, :]).sum_to_size(dk[..., :m, :].shape)
    return (dq, dk, dy) + (None,) * (len(need) - 3)


def _empty_rows(ref, kind, qf, d, second):
    """The statistics of the first query when strict: an empty prefix (no key to attend to), shaped like one
    row of the block ``ref`` (or, for n = 1, from the query features)."""
    if ref is None:
        lse = torch.full((*qf.shape[:-2], 1), float("-inf"), dtype=qf.dtype, device=qf.device)
        lp = lse[..., :1, :]
        mean = qf.new_zeros(*qf.shape[:-2], 1, d)
        return {"softmax": (lse, lp, mean, torch.zeros_like(lse) if second else None),
                "relu": (torch.zeros_like(lse), mean, lp), "plan": (mean, lp)}[kind]

    if kind == "softmax":
        lse, lp, mean, q = ref
        return (torch.full_like(lse[..., :1], float("-inf")), torch.full_like(lp[..., :1], float("-inf")),
                torch.zeros_like(mean[..., :1, :]), None if q is None else torch.zeros_like(q[..., :1]))
    if kind == "relu":
        mass, first, lp = ref
        return (torch.zeros_like(mass[..., :1]), torch.zeros_like(first[..., :1, :]),
                torch.full_like(lp[..., :1], float("-inf")))
    mean, lp = ref
    return torch.zeros_like(mean[..., :1, :]), torch.full_like(lp[..., :1], float("-inf"))


def _assemble(parts, kind, strict, qf, second, d):
    """Concatenate the blocks' statistics along the query axis (the empty first row when strict)."""
    if strict:
        parts.insert(0, _empty_rows(parts[0] if parts else None, kind, qf, d, second))

    def cat(i, axis):
        ts = [p[i] for p in parts]
        return ts[0] if len(ts) == 1 else torch.cat(ts, axis)

    if kind == "softmax":
        return PositionalStats(HeadStats(cat(0, -1), cat(2, -2), cat(3, -1) if second else None), cat(1, -1))
    if kind == "relu":
        return PositionalStats(None, cat(2, -1), relu=(cat(0, -1), cat(1, -2)))
    return PositionalStats(None, cat(1, -1), plan=cat(0, -2))
