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

The kernel (:func:`transformer_pde.model.positional_kernel.positional_statistics`) runs over blocks of query rows
[i0, i1) against the keys of their prefix [0, i1) only: memory ~ ``chunk_elements`` scores per block, never n × n; the bias block is
formed inside the block.  With autograd the forward pass is the no-grad kernel's and the backward pass
recomputes one block at a time out of place and back-propagates through it (a checkpoint per block): memory
stays O(n·d) per evaluation plus one block, and gradients reach x, the heads, the token weights and the
bias's own tensors (slopes, λ, positions; a kernel's closure through ``torch.utils.checkpoint``).  Second
derivatives are not available (the backward pass is not itself differentiable).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from .heads import Heads

__all__ = ["PositionalBias", "ALiBi", "KineticDecay", "PositionKernel", "PREFIX_MODES"]

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

    def tensors(self) -> dict:
        """The tensors the bias holds besides its positions, by field name (the device check; the kernel's
        gradients to them).

        Returns
        -------
        dict
            name -> tensor."""
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
        for name, t in (("positions", self.positions), *self.tensors().items()):
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

    def tensors(self) -> dict:
        """The slopes when they are a tensor (see :meth:`PositionalBias.tensors`)."""
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

    def tensors(self) -> dict:
        """λ when it is a tensor (see :meth:`PositionalBias.tensors`)."""
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
