"""Attention heads Θ = Σ_h ω_h δ_{θ_h}, θ_h = (A_h, V_h), at one instant.

Shapes: score ``A`` and value ``V`` are ``(..., H, d, d)``; head weights ``ω`` are
``(..., H)``; the inverse temperature ``β`` is a real float or a tensor that
broadcasts against the batch shape ``(...)`` (β sweeps), or a rule of the context length n
(:class:`BetaRule`: β_n = γ log n, c·n^p, or a callable), resolved once per call or solve from the
number of tokens (:meth:`Heads.at_context`).  β < 0 (attention weights favouring distant keys) and
β = 0 (uniform averaging) are allowed.  Leading dims are batches (Monte-Carlo paths, ensembles) and
broadcast against the tokens' batch dims.

Conventions (docs/model.md#heads): ``value=None`` ties V_h to A_h (the gradient-flow case, the
reference code's single matrix D_h); ``weights=None`` is the mean ω_h = 1/H; Pendharkar's
sum convention is ``weights=torch.ones(H)``.  When heads come as low-rank factors
(Q_h, K_h of shape (k, d), A_h = Q_hᵀ K_h) the factors are kept so that the kernels can
compute scores as ⟨Q_h x, K_h y⟩ at cost O(k) instead of O(d²).  Likewise a value map given as
factors V_h = O_h W_{V,h} (W_{V,h}: (k, d), O_h: (d, k)) is kept as ``value_in`` / ``value_out``
and applied as O_h (W_{V,h} y) at cost O(k d); the dense V_h (``value`` / ``value_matrix``) is
formed only when a caller asks for it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Mapping, Optional, Union

import torch

from ..utils.validation import broadcast_shapes, check_choice, check_positive, check_same, check_tensor
from .factors import check_dense, check_value_factors, fits_in_memory
from .scaling import BetaRule, LogScaling, PowerScaling, real_beta, resolve_beta  # noqa: F401  (re-exported)

__all__ = ["Heads"]
#: named internal API (not public): the MultiheadAttention inside a module, for :mod:`transformer_pde.processes.nn`
#: and ``broadcast_shapes``, the cheap shape broadcast of the solvers' setup
__internal__ = ["heads_from_multihead_attention", "mha_module", "broadcast_shapes"]

Beta = Union[float, torch.Tensor, BetaRule, Callable]


class Heads:
    """A batch of H attention heads (A_h, V_h) with weights ω_h and inverse temperature β.

    Parameters
    ----------
    score
        A, ``(..., H, d, d)``; or None when ``query`` and ``key`` are given.
    value
        V, ``(..., H, d, d)``; None means V = A ("symmetric heads" when A = Aᵀ).
    weights
        ω, ``(..., H)``, non-negative; None means 1/H.
    beta
        β, a real float (any sign: β < 0 weights distant keys most, β = 0 averages uniformly) or a
        tensor broadcasting against the batch shape; or a rule of the context length n
        (:class:`BetaRule`, e.g. ``LogScaling(gamma)`` for β_n = γ log n, or a plain callable
        n ↦ β_n), resolved once per call or solve from n = x.shape[-2] (:meth:`at_context`).
    query, key
        optional factors Q, K of shape ``(..., H, k, d)`` with A = QᵀK.
    value_in, value_out
        optional value factors W_V ``(..., H, k_v, d)`` and O ``(..., H, d, k_v)`` with V = O W_V
        (instead of ``value``); ``value`` then forms V on access, the fields apply the factors.

    Raises
    ------
    TypeError
        non-tensor or integer inputs, mixed dtypes.
    ValueError
        wrong shapes, non-finite entries (β included), negative weights, mixed devices.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> heads = tp.Heads(torch.eye(3).expand(2, 3, 3))
    >>> heads.num_heads, heads.dim
    (2, 3)
    """

    __slots__ = ("score", "_value", "weights", "_beta", "_rule", "_context", "query", "key", "value_in", "value_out",
                 "_symmetric")

    def __init__(self, score=None, value=None, weights=None, beta: Beta = 1.0, *, query=None, key=None,
                 value_in=None, value_out=None):
        if score is None and (query is None or key is None):
            raise ValueError("give the score matrices A (..., H, d, d), or both query and key factors (..., H, k, d)")
        if score is not None and (query is not None or key is not None):
            raise ValueError("give either score or (query, key), not both")
        if score is None:
            check_tensor(query, "query", min_dim=3)
            check_tensor(key, "key", min_dim=3)
            check_same(query, key, "query", "key")
            if query.shape[-3:] != key.shape[-3:]:
                raise ValueError(
                    f"query and key must both be (..., H, k, d); got {tuple(query.shape)} and {tuple(key.shape)}"
                )
            ref = query
            H, d = query.shape[-3], query.shape[-1]
        else:
            check_tensor(score, "score", min_dim=3)
            if score.shape[-1] != score.shape[-2]:
                raise ValueError(f"score must have shape (..., H, d, d), got {tuple(score.shape)}")
            ref = score
            H, d = score.shape[-3], score.shape[-1]
        if H < 1 or d < 2:
            raise ValueError(f"need H >= 1 heads and dimension d >= 2, got H = {H}, d = {d}")
        if value is not None:
            check_tensor(value, "value", min_dim=3)
            check_same(ref, value, "score", "value")
            if value.shape[-3:] != (H, d, d):
                raise ValueError(f"value must have shape (..., {H}, {d}, {d}) like the scores, got {tuple(value.shape)}")
        check_value_factors(ref, value, value_in, value_out, H, d)
        if weights is None:
            weights = torch.full((H,), 1.0 / H, dtype=ref.dtype, device=ref.device)
        else:
            check_tensor(weights, "weights", min_dim=1)
            check_same(ref, weights, "score", "weights")
            if weights.shape[-1] != H:
                raise ValueError(f"head weights must have shape (..., H) with H = {H}, got {tuple(weights.shape)}")
            if bool((weights < 0).any()):
                raise ValueError("head weights must be >= 0 (use the sign of A, or direction=, to flip a head)")
            if not bool((weights.sum(-1) > 0).all()):
                raise ValueError("head weights must not all be zero")
        rule = None
        if callable(beta) and not isinstance(beta, torch.Tensor):
            rule = beta if isinstance(beta, BetaRule) else BetaRule(beta)
            for t in rule.tensors:
                check_same(ref, t, "score", f"the tensor parameter of {rule!r}")
            beta = None
        elif isinstance(beta, torch.Tensor) and beta.numel() != 1:
            real_beta(beta, "beta")
            check_tensor(beta, "beta")
            check_same(ref, beta, "score", "beta")
        elif isinstance(beta, torch.Tensor):
            real_beta(beta, "beta")
            if beta.dim() > 0:
                beta = beta.reshape(())
        else:
            beta = real_beta(beta, "beta")
        self.score = score
        self._value = value
        self.weights = weights
        self._beta = beta
        self._rule = rule
        self._context = None
        self.query = query
        self.key = key
        self.value_in = value_in
        self.value_out = value_out
        self._symmetric = None
        try:
            self.batch_shape
        except RuntimeError:
            raise ValueError("the batch shapes of score/value/weights/beta do not broadcast together") from None

    # ------------------------------------------------------------------ builders
    @classmethod
    def symmetric(cls, D, beta: Beta = 1.0, weights=None) -> "Heads":
        """Symmetric heads A_h = V_h = D_h (the reference code's matrices D_h), D: (..., H, d, d).

        Raises ValueError when D is not symmetric (to 1e-10 relative)."""
        check_tensor(D, "D", min_dim=3)
        err = (D - D.transpose(-1, -2)).abs().max().item()
        if err > 1e-10 * max(1.0, D.abs().max().item()) * (1e6 if D.dtype == torch.float32 else 1.0):
            raise ValueError(f"D is not symmetric (max |D - Dᵀ| = {err:.2e}); use (D + D.mT) / 2")
        h = cls(D, None, weights, beta)
        h._symmetric = True
        return h

    @classmethod
    def scalar(cls, lambdas, dim: int, beta: Beta = 1.0, weights=None) -> "Heads":
        """Scalar heads A_h = V_h = λ_h I_d; lambdas: (..., H)."""
        if not isinstance(lambdas, torch.Tensor):
            lambdas = torch.as_tensor(lambdas, dtype=torch.get_default_dtype())
        check_tensor(lambdas, "lambdas", min_dim=1)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an int >= 2, got {dim!r}")
        eye = torch.eye(dim, dtype=lambdas.dtype, device=lambdas.device)
        h = cls(lambdas[..., None, None] * eye, None, weights, beta)
        h._symmetric = True
        return h

    @classmethod
    def random(cls, num_heads: int, dim: int, *, symmetric: bool = True, scale: float = 1.0,
               batch_shape=(), beta: Beta = 1.0, weights=None, generator=None, dtype=None, device=None) -> "Heads":
        """Random heads.  symmetric=True: A_h = V_h = scale·(Z + Zᵀ), Z i.i.d. N(0, 1) (the
        reference code's D_h(0)); symmetric=False: independent A_h, V_h with i.i.d.
        N(0, scale²) entries."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an int >= 2, got {dim!r}")
        f = dict(dtype=dtype or torch.get_default_dtype(), device=device, generator=generator)
        shape = (*batch_shape, num_heads, dim, dim)
        Z = torch.randn(shape, **f)
        if symmetric:
            h = cls(scale * (Z + Z.transpose(-1, -2)), None, weights, beta)
            h._symmetric = True
            return h
        return cls(scale * Z, scale * torch.randn(shape, **f), weights, beta)

    @classmethod
    def from_qkv(cls, query, key, value, output=None, *, beta: Beta = 1.0, weights=None,
                 keep_factors: bool = True) -> "Heads":
        """Heads from per-head projections: query, key (..., H, k, d); value (..., H, k_v, d);
        output (..., H, d, k_v) or None.  A_h = Q_hᵀ K_h, V_h = O_h W_{V,h} (V_h = W_{V,h}
        when output is None and k_v = d).  With keep_factors the scores are computed from the
        factors (cheaper when k < d), and so is the value map O_h (W_{V,h} y) when k_v < d."""
        check_tensor(value, "value", min_dim=3)
        if output is None:
            if value.shape[-2] != value.shape[-1]:
                raise ValueError("value is (..., H, k_v, d) with k_v != d: pass the output projection (..., H, d, k_v)")
            V = value
        else:
            check_tensor(output, "output", min_dim=3)
            if output.shape[-1] != value.shape[-2] or output.shape[-2] != value.shape[-1]:
                raise ValueError(
                    f"output must be (..., H, d, k_v) to match value (..., H, k_v, d); got {tuple(output.shape)} and {tuple(value.shape)}"
                )
            if keep_factors and value.shape[-2] < value.shape[-1]:
                return cls(None, None, weights, beta, query=query, key=key, value_in=value, value_out=output)
            V = output @ value
        if keep_factors:
            return cls(None, V, weights, beta, query=query, key=key)
        check_tensor(query, "query", min_dim=3)
        check_tensor(key, "key", min_dim=3)
        return cls(query.transpose(-1, -2) @ key, V, weights, beta)

    @classmethod
    def from_multihead_attention(
        cls,
        module,
        *,
        head_weights: Union[str, torch.Tensor] = "sum",
        beta: Optional[Union[float, torch.Tensor]] = None,
        token_norm: float = 1.0,
        keep_factors: Optional[bool] = None,
        bias: str = "warn",
        detach: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> "Heads":
        """Heads of a ``torch.nn.MultiheadAttention`` (or a layer's ``self_attn``, or a dict of per-head
        query/key/value/output tensors): A_h = W_{Q,h}ᵀ W_{K,h}, V_h = W_{O,h} W_{V,h}, β = r²/√k,
        ω_h = 1, factors kept when k < d.

        The heads hold tensors computed from the module's parameters: in a training loop build them
        again after every optimizer step (inside the forward), never once before the loop.  The
        options, and what the conversion keeps and drops (``bias="warn"`` drops non-zero query,
        value and output biases with a UserWarning; "drop" drops them silently; "error" refuses):
        :func:`transformer_pde.model.heads.heads_from_multihead_attention`.

        Returns
        -------
        Heads
            the heads of the module."""
        return heads_from_multihead_attention(module, head_weights=head_weights, beta=beta, token_norm=token_norm,
                                              keep_factors=keep_factors, bias=bias, detach=detach, dtype=dtype,
                                              device=device)

    # ------------------------------------------------------------------ properties
    @property
    def reference(self) -> torch.Tensor:
        """The tensor that fixes the heads' dtype, device, H and d: A_h, or the query factors."""
        return self.score if self.score is not None else self.query

    @property
    def known_symmetric(self) -> Optional[bool]:
        """Whether every A_h = A_hᵀ, if already known (True / False), else None (not yet checked;
        :attr:`is_symmetric` checks and caches)."""
        return self._symmetric

    def assume_symmetric(self, symmetric: Optional[bool] = True) -> "Heads":
        """The same heads (same tensors) with the symmetry of A_h declared: True for heads built
        symmetric (skips the exact check of :attr:`is_symmetric`), None to check again."""
        new = self.map(lambda t: t)
        new._symmetric = symmetric
        return new

    def replace(self, *, symmetric: Optional[bool] = None, **fields) -> "Heads":
        """The heads with some of score, value, weights, beta, query, key replaced, unchecked (for the
        solvers' reshapes); ``symmetric`` declares the symmetry of the new A_h (None: unknown)."""
        unknown = set(fields) - {"score", "value", "weights", "beta", "query", "key", "value_in", "value_out"}
        if unknown:
            raise TypeError(f"Heads.replace got unknown fields {sorted(unknown)}")
        new = self.map(lambda t: t)
        for k, v in fields.items():  # a dense value first: it drops the factors, which may come next
            if k == "value":
                new.value = v
        if "value_in" in fields and "value" not in fields:  # new factors replace a dense value
            new._value = None
        for k, v in fields.items():
            if k != "value":
                setattr(new, k, v)
        new._symmetric = symmetric
        return new

    @property
    def num_heads(self) -> int:
        return self.reference.shape[-3]

    @property
    def dim(self) -> int:
        return self.reference.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.reference.dtype

    @property
    def device(self) -> torch.device:
        return self.reference.device

    @property
    def value(self) -> Optional[torch.Tensor]:
        """V, ``(..., H, d, d)``, or None for tied heads (V = A); formed from the value factors when
        the heads hold them (each access forms it: prefer :meth:`apply_value`)."""
        if self._value is None and self.value_in is not None:
            check_dense(self.value_out, self.value_in, self.num_heads, self.dim, "value matrices V_h = O_h W_{V,h}",
                              "apply them with heads.apply_value(v) instead, which forms no d × d matrix")
            return self.value_out @ self.value_in
        return self._value

    @value.setter
    def value(self, value: Optional[torch.Tensor]) -> None:
        # a new dense value replaces the factors (they would no longer describe it)
        self._value = value
        self.value_in = self.value_out = None

    @property
    def value_factored(self) -> bool:
        """True when V_h is held as factors O_h W_{V,h} (``value_in``, ``value_out``)."""
        return self.value_in is not None

    def apply_value(self, v: torch.Tensor) -> torch.Tensor:
        """V_h v_hi for per-head vectors v ``(..., H, n, d)`` -> ``(..., H, n, d)``: O_h (W_{V,h} v) from
        the factors when held (cost O(k d) per vector, no d×d matrix), else v V_hᵀ."""
        if self.value_in is not None:
            return (v @ self.value_in.transpose(-1, -2)) @ self.value_out.transpose(-1, -2)
        return v @ self.value_matrix.transpose(-1, -2)

    @property
    def beta(self) -> Union[float, torch.Tensor]:
        """β: a float, or a tensor broadcasting against the batch shape.

        Raises
        ------
        ValueError
            the heads hold a rule of the context length not resolved yet (:meth:`at_context`)."""
        b = self._beta
        if b is None:
            raise ValueError(
                f"these heads' β is a rule of the context length n ({self._rule!r}) and has not been resolved: "
                f"call heads.at_context(n) with the number of tokens n (the public functions and tp.solve do this "
                f"from x.shape[-2])")
        return b

    @beta.setter
    def beta(self, value) -> None:
        # a new β replaces the rule (it no longer describes it)
        self._beta, self._rule, self._context = value, None, None

    beta_rule = property(lambda self: self._rule, doc="The rule β_n these heads were built with, or None.")
    context = property(lambda self: self._context, doc="The n at which the rule was resolved, or None.")
    resolved = property(lambda self: self._beta is not None, doc="True when β is a value (fixed, or resolved).")

    def at_context(self, n: int) -> "Heads":
        """These heads with β resolved at the context length n: β = rule(n) for a :class:`BetaRule`.

        Heads with a fixed β, and heads resolved already, are returned as they are (a rule is resolved once:
        a solve resolves it from x0 and keeps that β for every step).

        Parameters
        ----------
        n : int
            the number of tokens (keys) of the measure, >= 1.

        Returns
        -------
        Heads
            the same tensors with β = rule(n) (``context`` = n, ``beta_rule`` kept).

        Examples
        --------
        >>> import math, torch, transformer_pde as tp
        >>> h = tp.Heads(torch.eye(2)[None], beta=tp.LogScaling(1.0))
        >>> round(h.at_context(100).beta, 6) == round(math.log(100), 6)
        True
        """
        if self._beta is not None:
            return self
        new = self.map(lambda t: t)
        beta = self._rule(n)
        if isinstance(beta, torch.Tensor):
            check_same(self.reference, beta, "score", f"{self._rule!r} at n = {n}")
            if beta.numel() == 1 and beta.dim() > 0:
                beta = beta.reshape(())
        new._beta, new._context = beta, int(n)
        return new

    @property
    def batch_shape(self) -> torch.Size:
        shapes = [self.reference.shape[:-3], self.weights.shape[:-1]]
        if self._value is not None:
            shapes.append(self._value.shape[:-3])
        if self.value_in is not None:
            shapes += [self.value_in.shape[:-3], self.value_out.shape[:-3]]
        if self.key is not None:
            shapes.append(self.key.shape[:-3])
        if isinstance(self._beta, torch.Tensor):
            shapes.append(self._beta.shape)
        elif self._beta is None:
            shapes.append(self._rule.shape)
        return broadcast_shapes(*shapes)

    @property
    def tied(self) -> bool:
        """True when V_h = A_h (no value matrix and no value factors)."""
        return self._value is None and self.value_in is None

    @property
    def score_matrix(self) -> torch.Tensor:
        """A_h, (..., H, d, d) (formed from the factors when needed)."""
        if self.score is not None:
            return self.score
        check_dense(self.query, self.key, self.num_heads, self.dim, "score matrices A_h = Q_hᵀK_h",
                          "give value factors (value_in/value_out) so that no d × d matrix is needed, or a smaller d")
        return self.query.transpose(-1, -2) @ self.key

    @property
    def value_matrix(self) -> torch.Tensor:
        """V_h, (..., H, d, d)."""
        return self.score_matrix if self.value is None else self.value

    @property
    def normalized_weights(self) -> torch.Tensor:
        """ω̄ = ω / Σ_h ω_h, (..., H)."""
        return self.weights / self.weights.sum(-1, keepdim=True)

    @property
    def is_symmetric(self) -> bool:
        """True when every A_h = A_hᵀ (exactly); then the first variation needs one kernel."""
        if self._symmetric is None:
            if self.score is None and (self.query is self.key or torch.equal(self.query, self.key)):
                self._symmetric = True  # A_h = Q_hᵀQ_h
            elif self.score is None and not fits_in_memory(self.query, self.key, self.num_heads, self.dim):
                self._symmetric = False  # not decided without d × d matrices; the general kernels are exact for any A
            else:
                A = self.score_matrix
                self._symmetric = bool(torch.equal(A, A.transpose(-1, -2)))
        return self._symmetric

    def beta_tensor(self) -> torch.Tensor:
        """β as a tensor of shape batch_shape-broadcastable (...,) (0-dim for a float)."""
        if isinstance(self.beta, torch.Tensor):
            return self.beta
        return torch.tensor(self.beta, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ transforms
    def with_score(self, score: torch.Tensor, *, symmetric: Optional[bool] = None) -> "Heads":
        """Same heads with new score matrices (values stay tied if they were).  No checks:
        used by the processes in the hot loop."""
        new = object.__new__(Heads)
        new.score, new._value, new.weights, new._beta = score, self._value, self.weights, self._beta
        new._rule, new._context = self._rule, self._context
        new.value_in, new.value_out = self.value_in, self.value_out
        new.query = new.key = None
        new._symmetric = symmetric
        return new

    def map(self, fn) -> "Heads":
        """Apply fn to every tensor (e.g. ``lambda t: t.to(device)``)."""
        new = object.__new__(Heads)
        g = lambda t: None if t is None else fn(t)  # noqa: E731
        new.score, new._value, new.weights = g(self.score), g(self._value), g(self.weights)
        new.query, new.key = g(self.query), g(self.key)
        new.value_in, new.value_out = g(self.value_in), g(self.value_out)
        new._beta = fn(self._beta) if isinstance(self._beta, torch.Tensor) else self._beta
        new._rule, new._context = self._rule, self._context
        new._symmetric = self._symmetric
        return new

    def to(self, *args, **kwargs) -> "Heads":
        return self.map(lambda t: t.to(*args, **kwargs))

    def detach(self) -> "Heads":
        return self.map(lambda t: t.detach())

    def __repr__(self) -> str:
        b = self._beta
        beta = repr(self._rule) if b is None else (f"{b:.4g}" if isinstance(b, float) else f"tensor{tuple(b.shape)}")
        if b is not None and self._rule is not None:
            beta += f" ({self._rule!r} at n = {self._context})"
        return (
            f"Heads(H={self.num_heads}, d={self.dim}, batch_shape={tuple(self.batch_shape)}, beta={beta}, "
            f"tied={self.tied}, factors={self.query is not None}, value_factors={self.value_in is not None}, dtype={self.dtype}, device={self.device})"
        )


# ---------------------------------------------------------------------------- torch.nn.MultiheadAttention → Heads
# (here, not in nn, so that Heads.from_multihead_attention needs nothing above heads; the public spelling is the classmethod)

_KEYS = {
    "query": ("query", "q", "w_q", "wq"),
    "key": ("key", "k", "w_k", "wk"),
    "value": ("value", "v", "w_v", "wv"),
    "output": ("output", "o", "w_o", "wo", "out"),
}


def mha_module(module):
    """The MultiheadAttention inside ``module`` (itself, or a layer's ``self_attn``)."""
    if isinstance(module, torch.nn.MultiheadAttention):
        return module
    inner = getattr(module, "self_attn", None)
    if isinstance(inner, torch.nn.MultiheadAttention):
        return inner
    return None


def _head_weights(head_weights, H, ref: torch.Tensor):
    if isinstance(head_weights, str):
        check_choice(head_weights, ("sum", "mean"), "head_weights")
        return torch.ones(H, dtype=ref.dtype, device=ref.device) if head_weights == "sum" else None
    if isinstance(head_weights, torch.Tensor):
        return head_weights
    raise TypeError(f"head_weights must be 'sum', 'mean' or a tensor (..., H), got {type(head_weights).__name__}")


def _beta(beta, token_norm, k):
    if beta is None:
        r = check_positive(token_norm, "token_norm")
        return r * r / math.sqrt(k)
    if isinstance(beta, torch.Tensor):
        return beta
    return real_beta(beta, "beta")


def _split_mha(mha: torch.nn.MultiheadAttention, bias: str):
    """Per-head factors (Q, K, W_V: (H, k, d); O: (H, d, k)) of a MultiheadAttention."""
    E, H = mha.embed_dim, mha.num_heads
    k = E // H
    if mha.kdim != E or mha.vdim != E:
        raise ValueError(
            f"this MultiheadAttention has kdim = {mha.kdim}, vdim = {mha.vdim} != embed_dim = {E}: its keys and values "
            f"live in another space (cross-attention), which is not a self-attention flow of tokens in R^{E}"
        )
    if mha.in_proj_weight is not None:
        Wq, Wk, Wv = mha.in_proj_weight.split(E, dim=0)
    else:
        Wq, Wk, Wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    Wo = mha.out_proj.weight
    if bias != "drop":
        found = []
        if mha.in_proj_bias is not None:
            bq, _bk, bv = mha.in_proj_bias.split(E)
            if bool((bq != 0).any()):
                found.append("query bias (in_proj_bias[:E])")
            if bool((bv != 0).any()):
                found.append("value bias (in_proj_bias[2E:])")
        if mha.out_proj.bias is not None and bool((mha.out_proj.bias != 0).any()):
            found.append("output bias (out_proj.bias)")
        if mha.bias_k is not None or mha.bias_v is not None:
            found.append("add_bias_kv (bias_k, bias_v)")
        if mha.add_zero_attn:
            found.append("add_zero_attn")
        if found and bias == "error":
            raise ValueError(
                "the module has terms the model cannot represent: " + ", ".join(found)
                + "; zero them, or pass bias='drop' to drop them (the key bias is always exact)"
            )
        if found:
            warnings.warn(
                "Heads.from_multihead_attention drops terms the model cannot represent: " + ", ".join(found)
                + "; the heads then differ from the module by them.  Build the module with bias=False (or zero "
                "them) to keep the conversion exact, pass bias='drop' to drop them knowingly without this "
                "warning, or bias='error' to refuse such modules (the key bias is always exact)",
                UserWarning, stacklevel=3)
    Q = Wq.reshape(H, k, E)
    K = Wk.reshape(H, k, E)
    V = Wv.reshape(H, k, E)
    O = Wo.reshape(E, H, k).permute(1, 0, 2)  # (H, E, k): columns hk … (h+1)k − 1 of W_O
    return Q, K, V, O


def _from_dict(d: Mapping):
    found = {}
    lower = {str(key).lower(): key for key in d}
    for role, names in _KEYS.items():
        for name in names:
            if name in lower:
                found[role] = d[lower[name]]
                break
    unknown = set(lower) - {n for names in _KEYS.values() for n in names}
    if unknown:
        raise ValueError(
            f"unknown keys {sorted(unknown)} in the dict of heads; use 'query', 'key', 'value' and optionally 'output' "
            f"(or q, k, v, o)"
        )
    missing = [r for r in ("query", "key", "value") if r not in found]
    if missing:
        raise ValueError(f"the dict of heads lacks {missing}; give per-head tensors query, key (H, k, d), value (H, k_v, d)"
                         f" and optionally output (H, d, k_v)")
    for role, t in found.items():
        check_tensor(t, role, min_dim=3)
    Q, K, V, O = found["query"], found["key"], found["value"], found.get("output")
    if Q.shape != K.shape:
        raise ValueError(f"query and key must have the same shape (..., H, k, d); got {tuple(Q.shape)} and {tuple(K.shape)}")
    if V.shape[-1] != Q.shape[-1] or V.shape[-3] != Q.shape[-3]:
        raise ValueError(f"value must have shape (..., H, k_v, d) with H = {Q.shape[-3]}, d = {Q.shape[-1]}; got {tuple(V.shape)}")
    return Q, K, V, O


def heads_from_multihead_attention(
    module,
    *,
    head_weights: Union[str, torch.Tensor] = "sum",
    beta: Optional[Union[float, torch.Tensor]] = None,
    token_norm: float = 1.0,
    keep_factors: Optional[bool] = None,
    bias: str = "warn",
    detach: bool = False,
    dtype: Optional[torch.dtype] = None,
    device=None,
) -> Heads:
    """Heads (A_h = Q_hᵀK_h, V_h = O_h W_{V,h}, β = r²/√k) of a real attention layer (module docstring).

    Parameters
    ----------
    module
        a ``torch.nn.MultiheadAttention`` (packed ``in_proj_weight`` or separate
        ``q/k/v_proj_weight``), a layer holding one as ``self_attn``
        (``TransformerEncoderLayer``, ``TransformerDecoderLayer``: its self-attention), or a
        dict of per-head tensors ``query``, ``key`` (..., H, k, d), ``value`` (..., H, k_v, d) and
        optionally ``output`` (..., H, d, k_v) (keys q, k, v, o accepted; V_h = O_h W_{V,h},
        or V_h = value when output is absent and k_v = d).
    head_weights : Union[str, torch.Tensor]
        "sum" (ω_h = 1: MHA(x) = Σ_h f_h exactly), "mean" (ω_h = 1/H) or a tensor (..., H).
    beta : Optional[Union[float, torch.Tensor]]
        inverse temperature; None means r²/√k with r = ``token_norm`` (the module's 1/√k scaling).
    token_norm : float
        r, the norm of the tokens the module sees (1 on the unit sphere, √d after a
        LayerNorm without affine parameters).
    keep_factors : Optional[bool]
        keep Q_h, K_h (k×d) instead of forming A_h; None means "when k < d".
    bias : str
        what to do with non-zero query/value/output biases, ``bias_k``/``bias_v`` and
        ``add_zero_attn``, which the model cannot represent: "warn" (default: drop them with a
        UserWarning that names them), "drop" (drop them silently) or "error" (refuse the module).
        The key bias is always exact (it cancels in the softmax).  A module built with
        ``bias=False`` has none of these; the biases of a fresh module start at zero, so the warning
        appears once training has moved them.
    detach : bool
        cut the autograd link to the module's parameters.
    dtype, device
        convert the tensors (e.g. ``dtype=torch.float64``).

    Returns
    -------
    Heads
        :class:`~transformer_pde.Heads` with batch shape () for a module, (...) for a batched dict.

    Raises
    ------
    TypeError
        an unsupported module type or head_weights.
    ValueError
        cross-attention (kdim/vdim != embed_dim), unknown/missing dict keys, bad shapes,
        non-zero biases with ``bias="error"``, unknown options.
    """
    check_choice(bias, ("warn", "drop", "error"), "bias")
    if isinstance(module, Mapping):
        Q, K, Wv, O = _from_dict(module)
    else:
        mha = mha_module(module)
        if mha is None:
            raise TypeError(
                f"expected a torch.nn.MultiheadAttention, a layer with a .self_attn MultiheadAttention "
                f"(TransformerEncoderLayer) or a dict of per-head query/key/value/output tensors; got {type(module).__name__}"
            )
        Q, K, Wv, O = _split_mha(mha, bias)
    tensors = [Q, K, Wv, O]
    if detach:
        tensors = [None if t is None else t.detach() for t in tensors]
    if dtype is not None or device is not None:
        tensors = [None if t is None else t.to(dtype=dtype, device=device) for t in tensors]
    Q, K, Wv, O = tensors
    H, k, d = Q.shape[-3], Q.shape[-2], Q.shape[-1]
    if keep_factors is None:
        keep_factors = k < d
    w = _head_weights(head_weights, H, Q)
    b = _beta(beta, token_norm, k)
    return Heads.from_qkv(Q, K, Wv, O, beta=b, weights=w, keep_factors=bool(keep_factors))
