"""The multi-head attention velocity field V[μ, Θ] and the diagnostics that share its kernel.

Per-head outputs at a query x (docs/model.md#fields), with s = +1 ("ascent") or −1 ("descent"):

    softmax:       f_h(x) = V_h ȳ_h(x),           ȳ_h = ∫ e^{β⟨x,A_h y⟩} y dμ / m_h(x)
    unnormalized:  f_h(x) = m_h(x) V_h ȳ_h(x)   = ∫ e^{β⟨x,A_h y⟩} V_h y dμ
    relu:          f_h(x) = ∫ ReLU(β⟨x,A_h y⟩) V_h y dμ
    sinkhorn:      f_h(x_i) = V_h Σ_j P_ij y_j,   P the Sinkhorn (doubly stochastic) plan of the kernel
    hardmax:       f_h(x_i) = V_h (weighted average of the keys maximising ⟨x_i, A_h y⟩)
    V[μ,Θ](x) = s · P_x Σ_h ω_h f_h(x)

    effective:     V(x) = s · b(x)^{-1} ∇_S δE/δμ(x),  b^{-1} = Σ_h ω̄_h / m_h

where ∇_S δE/δμ(x) = Σ_h ω_h m_h(x) P_x A_h ȳ_h(x) for symmetric A_h (the general case adds
the transposed kernel, ½ Σ_h ω_h [m_h P_x A_h ȳ_h + m̃_h P_x A_hᵀ ỹ_h]).  The effective field
uses the scores only (it is the gradient of E, whatever V_h is).

:func:`evaluate` computes the field and, from the same kernel pass, the energy, the metric
slope 𝒢² = ∫ b |V|² dμ and the dissipation 𝒟 = ∫ ⟨∇_S δE/δμ, V⟩ dμ; the solvers call it once
per stage.

Causal attention (``causal=True``): token i sees only the tokens j ≤ i in the stored order, so
its field is that of the prefix measure μ_i = Σ_{j≤i} w_j δ_{x_j} / Σ_{j≤i} w_j
(:mod:`transformer_pde.model.softmax`).  The causal field is NOT a gradient flow of E: it is not
b^{-1} ∇_S δE/δμ of any interaction energy, so "effective" (the gradient of E) has no causal
version and is refused.  The diagnostics keep their definitions for the whole measure μ,
from a second, non-causal kernel pass: E(μ), ∇_S δE/δμ, b, the dissipation
𝒟 = ∫ ⟨∇_S δE/δμ, V_causal⟩ dμ (still the chain-rule rate dE/dt − ∂_tE along the causal flow)
and 𝒢² = ∫ b |V_causal|² dμ, which no longer equals ±𝒟 — there is no gradient-flow identity
to check (the solvers' ledger reports "not a gradient flow").

Positional attention (``causal=`` a :class:`~transformer_pde.model.positional.PositionalBias`: ALiBi, the
kinetic decay e^{−(λ/n)(i−j)}, a user's position kernel): the prefix measure is weighted by positional
weights, μ_i^h = Σ_{j≤i} w_j e^{b_h(p_i,p_j)} δ_{x_j} / Σ_{j≤i} w_j e^{b_h(p_i,p_j)}, and every statistic is
that of μ_i^h (its own block kernel, :func:`~transformer_pde.model.positional_kernel.positional_statistics`);
b ≡ 0 is ``causal=True``.

Two conventions for the un-normalised causal kernels (``causal="mean" | "sum"``; ``True`` is "mean"):

    "mean" (default):  f_h(x_i) = Σ_{j≤i} w_j e^{β⟨x_i,A_h x_j⟩} V_h x_j / W_i,   W_i = Σ_{j≤i} w_j
    "sum":             f_h(x_i) = Σ_{j≤i} w_j e^{β⟨x_i,A_h x_j⟩} V_h x_j

("relu" likewise, with ReLU(β⟨x_i, A_h x_j⟩) for the exponential).  The prefix mean is the
field of the normalised prefix measure μ_i (uniform weights: a factor 1/(i+1) for 1/n); the
prefix sum is the restriction of the full measure's sum to j ≤ i, so the last token sees the
non-causal field.  Softmax does not depend on the choice.  simuformer's causal un-normalised
attention Σ_{j≤i} e^{s_ij} V x_j (unit weights) is "sum" with uniform weights w_j = 1/n and
V_h scaled by n.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..utils.validation import DEFAULT_DIRECTION
from ..utils.validation import (
    check_same, check_tensor, check_tied, check_token_weights, check_tokens, direction_sign,
)
from .backends import causal_log_prefix_mass, needs_grad
from .moments import (
    HeadStats, deferred_mean_stats, head_columns, head_columns_mass, head_columns_products, head_columns_width,
    mean_applied, per_head_map, scaled_partition,
)
from .pair_block import pair_diagnostics, pair_field, takes as pair_takes
from .plans import PLANS, plan_average, relu_statistics
from .positional import PositionalBias
from .finite_part import finite_part, over_two_beta
from .positional_kernel import positional_statistics
from .softmax import softmax_statistics
from .values import softmax_values, values_first_applies
from .heads import Heads, broadcast_shapes
from .normalization import names, resolve
from .sphere import tangent_projection

__all__ = ["FieldEval", "evaluate", "velocity", "head_outputs", "radial_shadows"]
#: named internal API (not public): the shared input checks and token/head means of the energy,
#: mobility, diagnostics and nn modules
__internal__ = ["check_causal_mode", "check_inputs", "token_mean", "head_token_mean", "log_inverse_mobility",
                "grad_first_variation_terms", "diagnostics_along", "scaled_exp"]


@dataclass
class FieldEval:
    """Everything one kernel pass gives at a token configuration (batch shape ``...``).

    velocity: (..., n, d) the signed field V[μ, Θ] at the tokens.
    stats:    HeadStats (log-partitions, softmax means, optional second moments).
    outputs:  (..., H, n, d) per-head outputs f_h of the chosen normalisation (formed on first access
        where the field was one product of the fused kernel's output).
    grad_first_variation: (..., n, d) ∇_S δE/δμ at the tokens, or None (formed on first access where
        the diagnostics did not need it: the merged fused kernel).
    energy, slope, dissipation: (...,) or None (when diagnostics=False).
    ambient:  (..., n, d) the signed field before the tangent projection, s · Σ_h ω_h f_h (what a
        layer-normalisation scheme adds to the residual stream, :mod:`transformer_pde.dynamics.layernorm`).
    """

    velocity: torch.Tensor
    stats: HeadStats
    outputs: Optional[torch.Tensor]
    grad_first_variation: Optional[torch.Tensor] = None
    energy: Optional[torch.Tensor] = None
    slope: Optional[torch.Tensor] = None
    dissipation: Optional[torch.Tensor] = None
    ambient: Optional[torch.Tensor] = None

    def replace(self, **changes) -> "FieldEval":
        """A copy with the given fields changed; per-head outputs not formed yet stay deferred."""
        new = copy.copy(self)
        for k, v in changes.items():
            if k not in self.__dataclass_fields__:
                raise TypeError(f"FieldEval has no field {k!r}")
            setattr(new, k, v)
        return new


def _deferred(name: str) -> property:
    """A FieldEval field that may be given as a zero-argument callable: called on first access, then kept."""
    key = f"_{name}"

    def get(self):
        v = self.__dict__.get(key)
        if callable(v):  # deferred: the solvers' step never reads it
            v = v()
            self.__dict__[key] = v
        return v

    def set(self, value):
        self.__dict__[key] = value

    return property(get, set)


# the per-head outputs (a normalisation whose field is one product of the fused kernel's output block,
# :meth:`_KernelPass.value_field`), ∇δE/δμ and 𝒟 (the merged kernel's diagnostics) may be deferred
FieldEval.outputs = _deferred("outputs")
FieldEval.grad_first_variation = _deferred("grad_first_variation")
FieldEval.dissipation = _deferred("dissipation")


def token_mean(values: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Σ_i w_i values_i over the last axis (mean when weights is None)."""
    return values.mean(-1) if weights is None else (values * weights).sum(-1)


def head_token_mean(values: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Σ_i w_i values_hi for per-head values (..., H, n) and token weights (..., n) -> (..., H)."""
    return values.mean(-1) if weights is None else (values * weights.unsqueeze(-2)).sum(-1)


def log_inverse_mobility(heads: Heads, lse: torch.Tensor) -> torch.Tensor:
    """log b^{-1}(x_i) = log Σ_h ω̄_h e^{-log m_h(x_i)}, (..., n)."""
    logw = torch.log(heads.normalized_weights).unsqueeze(-1)  # (..., H, 1)
    return torch.logsumexp(logw - lse, dim=-2)


def scaled_mobility(heads: Heads, lse: torch.Tensor, m: torch.Tensor, log_scale: float) -> torch.Tensor:
    """b(x_i) e^{−c} = 1 / Σ_h ω̄_h e^{c − log m_h(x_i)}, (..., n), from lse and m = e^{lse − c} (..., H, n).

    With every m_h e^{−c} a normal number of full precision (≥ tiny/eps of the dtype) this is
    1 / (ω̄ᵀ (1/m)), one matrix-vector product over the heads (m may be a transposed view of masses laid
    out (..., n, H), as the merged fused kernel keeps them); otherwise (values rescaled into the
    subnormal range, or not finite) the log-sum-exp :func:`log_inverse_mobility`."""
    fi = torch.finfo(m.dtype)
    # amin is NaN (and the test False) when any m is; m = inf gives 1/m = 0, the log-sum-exp's limit too
    if m.numel() and not m.requires_grad and float(m.amin()) >= fi.tiny / fi.eps:
        wbar = heads.normalized_weights.unsqueeze(-2)  # (..., 1, H)
        return torch.reciprocal((wbar @ torch.reciprocal(m)).squeeze(-2))
    return torch.exp(-log_inverse_mobility(heads, lse) - log_scale)


def grad_first_variation_terms(x, heads: Heads, weights, stats: HeadStats, chunk_elements=None, backend="auto",
                                applied=None, keys=None):
    """Per-head un-projected terms c_h(x_i) with ∇ δE/δμ(x_i) = Σ_h ω_h c_h(x_i), as
    (log-scale, direction): c_h = e^{lse_h} u_h.  Returns list of (lse, u) pairs.
    ``applied``: A_h ȳ_h when the caller already has it (tied symmetric heads).
    ``weights`` are the key weights; ``keys`` the support of μ (default x)."""
    A = heads.score_matrix
    if heads.is_symmetric:
        return [(stats.log_partition, mean_applied(stats, A) if applied is None else applied)]
    tstats = softmax_statistics(x, heads, weights, keys=keys, transpose=True, chunk_elements=chunk_elements,
                                backend=backend)
    At = A.transpose(-1, -2)
    half = torch.log(torch.tensor(0.5, dtype=x.dtype, device=x.device))
    return [
        (stats.log_partition + half, mean_applied(stats, A)),
        (tstats.log_partition + half, mean_applied(tstats, At)),
    ]


class _KernelPass:
    """The kernel statistics of one field evaluation and the products the output rules of
    :mod:`transformer_pde.model.normalization` ask for (each formed once, on first use)."""

    def __init__(self, x, heads, key_weights, stats, keys, causal, prefix_sum, chunk_elements, backend, measure,
                 positional=None):
        self.x, self.heads, self.w, self.stats, self.keys = x, heads, key_weights, stats, keys
        self.causal, self.prefix_sum, self.chunk, self.backend = causal, prefix_sum, chunk_elements, backend
        self.measure = measure  # callable: the (non-causal) statistics of the whole measure
        # (bias, log Π (..., H|1, n)) of positional attention (:mod:`transformer_pde.model.positional`), or None
        self.positional = positional
        self._value_mean = self._terms = None
        self.values = None  # ū_h = Σ_j p_ij W_{V,h} y_j (..., H, n, k_v) of the values-first kernel, or None

    def value_mean(self):
        """V_h ȳ_h, (..., H, n, d)."""
        if self._value_mean is None:
            if self.values is not None:  # O_h ū_h: the averages of the values W_{V,h} y_j
                self._value_mean = self.values @ self.heads.value_out.transpose(-1, -2)
            elif self.heads.value_factored:  # O_h (W_{V,h} ȳ_h): no d×d matrix is formed
                self._value_mean = self.heads.apply_value(self.stats.mean)
            else:
                self._value_mean = mean_applied(self.stats, self.heads.value_matrix)
        return self._value_mean

    def value_field(self, mass: bool = False):
        """Σ_h ω_h V_h ȳ_h (mass=True: Σ_h ω_h m_h V_h ȳ_h, the un-normalised kernel), (..., n, d).

        From the merged fused kernel (:func:`transformer_pde.model.moments.head_columns`) this is one
        product of its (..., n, H·E) output block with a (H·E, d) matrix, and the per-head V_h ȳ_h are
        never formed; from the values-first kernel one product of the (..., n, H·k_v) averages ū_h with the
        stacked ω_h O_h; otherwise the head sum of :meth:`value_mean` (times the mass)."""
        if self.values is not None:
            u, out = self.values, self.heads.value_out  # (..., H, n, k_v), (..., H, d, k_v)
            if mass:
                u = u * self.mass().unsqueeze(-1)
            H, d, kv = out.shape[-3:]
            W = (self.heads.weights.unsqueeze(-1).unsqueeze(-1) * out).transpose(-1, -2)  # (..., H, k_v, d)
            block = u.transpose(-3, -2)
            return block.reshape(*block.shape[:-2], H * kv) @ W.reshape(*W.shape[:-3], H * kv, d)
        if not (mass and self.prefix_sum) and head_columns(self.stats) is not None and not self.heads.value_factored:
            W = per_head_map(self.heads.weights, self.heads.value_matrix, head_columns_width(self.stats))
            if mass:
                return head_columns_products(self.stats, 0.0, W)
            return head_columns(self.stats) @ W
        f = self.value_mean()
        return self.head_sum(self.times_mass(f) if mass else f)

    def _log_prefix_mass(self):
        """log W_i = log Σ_{j≤i} w_j (positional: log Π_i^h = log Σ_j w_j e^{b_h(p_i, p_j)}), (..., 1|H, n)."""
        if self.positional is not None:
            return self.positional[1]
        return causal_log_prefix_mass(self.w, self.x.shape[-2], dtype=self.x.dtype, device=self.x.device).unsqueeze(-2)

    def mass(self):
        """m_h, the kernel mass of the pass (Σ_{j≤i} under causal="sum"), (..., H, n)."""
        lp = self.stats.log_partition
        if self.prefix_sum:  # Σ_{j≤i} w_j e^{s_ij} = W_i × the prefix mean
            lp = lp + self._log_prefix_mass()
        return torch.exp(lp)

    def times_mass(self, f):
        """m_h f, with m_h the kernel mass of the pass (Σ_{j≤i} under causal="sum")."""
        return self.mass().unsqueeze(-1) * f

    def relu_values(self):
        """V_h ∫ ReLU(β⟨x, A_h y⟩) y dμ (prefix sum under causal="sum")."""
        if self.positional is not None:
            _, first = positional_statistics(self.x, self.heads, self.w, self.positional[0], kind="relu",
                                             chunk_elements=self.chunk).relu
        else:
            _, first = relu_statistics(self.x, self.heads, self.w, keys=self.keys, chunk_elements=self.chunk,
                                       backend=self.backend, causal=self.causal)
        if self.prefix_sum:
            first = first * torch.exp(self._log_prefix_mass()).unsqueeze(-1)
        return self.heads.apply_value(first)

    def plan_mean(self, plan, **params):
        """V_h Σ_j P_ij y_j for a plan of :func:`transformer_pde.model.plans.plan_average` (a name of its
        ``PLANS`` or a callable), (..., H, n, d).  Positional attention: the plan of the scores with the key
        weights π_ij, row block by row block (the plan's rows must be independent, as hardmax's are)."""
        if self.positional is not None:
            fn = PLANS.get(plan) if isinstance(plan, str) else plan
            return self.heads.apply_value(positional_statistics(
                self.x, self.heads, self.w, self.positional[0], kind="plan", chunk_elements=self.chunk, plan=fn,
                plan_params=params).plan)
        return self.heads.apply_value(plan_average(self.x, self.heads, self.w, plan, keys=self.keys,
                                                   causal=self.causal, chunk_elements=self.chunk, **params))

    def head_sum(self, f):
        """Σ_h ω_h f_h, (..., n, d); f (..., H, n, d) is checked first (a user's output rule may return anything:
        a wrong shape would broadcast into a wrong field without an error)."""
        want = (self.heads.num_heads, *self.x.shape[-2:])
        if not isinstance(f, torch.Tensor):
            raise TypeError(f"the per-head outputs of the normalisation are {type(f).__name__}, not a tensor: its "
                            f"outputs(kernel) must return f_h of shape (..., H, n, d) = (..., {', '.join(map(str, want))}) "
                            f"(or override field(kernel) when it has no per-head split)")
        if f.dim() < 3 or tuple(f.shape[-3:]) != want:
            raise ValueError(f"the per-head outputs of the normalisation have shape {tuple(f.shape)}; its "
                             f"outputs(kernel) must return f_h of shape (..., H, n, d) = (..., "
                             f"{', '.join(map(str, want))})")
        return (self.heads.weights.unsqueeze(-1).unsqueeze(-1) * f).sum(-3)

    def gradient_terms(self):
        """The per-head terms (log-scale, direction) of ∇ δE/δμ (:func:`grad_first_variation_terms`)."""
        if self._terms is None:
            full = self.measure()
            reuse = (self._value_mean if (self._value_mean is not None and self.heads.tied and self.heads.is_symmetric
                                          and full is self.stats) else None)
            self._terms = grad_first_variation_terms(self.x, self.heads, self.w, full, self.chunk, self.backend,
                                                     applied=reuse, keys=self.keys)
        return self._terms

    def gradient_field(self):
        """b^{-1} ∇ δE/δμ, un-projected, (..., n, d)."""
        omega = self.heads.weights.unsqueeze(-1).unsqueeze(-1)
        log_binv = log_inverse_mobility(self.heads, self.measure().log_partition).unsqueeze(-2)  # (..., 1, n)
        return sum((omega * torch.exp(l + log_binv).unsqueeze(-1) * u).sum(-3) for l, u in self.gradient_terms())


def scaled_exp(log_values: torch.Tensor, log_scale: float = 0.0) -> torch.Tensor:
    """e^{log_values − log_scale}; exactly ``torch.exp(log_values)`` when log_scale == 0."""
    return torch.exp(log_values) if log_scale == 0.0 else torch.exp(log_values - log_scale)


def _fused_diagnostics(x, heads, weights, velocity, stats, c, lazy_gradient):
    """:func:`diagnostics_along` from the merged kernel's block (symmetric heads, keys = queries).

    E = Σ_h ω_h/(2β) Σ_i w_i m_h e^{−c}; b from the (..., n, H) masses, contiguous in the heads; ∇_S δE/δμ
    = P_x (Y @ W) (:func:`transformer_pde.model.moments.per_head_map`) and 𝒟 = Σ_i w_i ⟨∇_S δE/δμ(x_i),
    V(x_i)⟩ from it: one product of the block for both.  With ``lazy_gradient`` both are returned as
    zero-argument callables, formed on first use (the solvers' step reads the gradient only with token noise
    or a layer map)."""
    m = head_columns_mass(stats, c)  # (..., n, H)
    mean_m = m.mean(-2) if weights is None else (weights.unsqueeze(-2) @ m).squeeze(-2)  # (..., H)
    energy = over_two_beta(torch.linalg.vecdot(heads.weights, mean_m), heads,
                           lambda: finite_part(x, heads, weights, None, None, c))
    b = scaled_mobility(heads, stats.log_partition, m.transpose(-1, -2), c)
    slope = token_mean(b * torch.linalg.vecdot(velocity, velocity), weights)
    formed = []

    def gradient():
        if not formed:
            W = per_head_map(heads.weights, heads.score_matrix, head_columns_width(stats))
            formed.append(tangent_projection(x, head_columns_products(stats, c, W)))
        return formed[0]

    def dissipation():  # projected: off the sphere (the flat dynamics) V is not orthogonal to x
        return token_mean(torch.linalg.vecdot(gradient(), velocity), weights)

    if lazy_gradient:
        return energy, slope, dissipation, gradient
    return energy, slope, dissipation(), gradient()


def diagnostics_along(x, heads: Heads, weights, velocity, stats: HeadStats, *, log_scale: float = 0.0,
                      chunk_elements=None, backend="auto", keys=None, key_weights=None, terms=None,
                      lazy_gradient: bool = False):
    """(E, 𝒢², 𝒟, ∇_S δE/δμ) · e^{−c} of the measure μ along a given field V: the one implementation.

        E e^{−c}   = Σ_h ω_h/(2β) Σ_i w_i e^{log m_h(x_i) − c}
        g e^{−c}   = P_x Σ_h ω_h e^{log m_h − c} A_h ȳ_h         (symmetric A_h; else the mean with A_hᵀ)
        𝒢² e^{−c}  = Σ_i w_i e^{−log b^{-1}(x_i) − c} |V(x_i)|²
        𝒟 e^{−c}   = Σ_i w_i ⟨g(x_i) e^{−c}, V(x_i)⟩

    (docs/model.md#mobility); c = 0 gives the values themselves.  Finite whenever log m_h − c fits
    the dtype: with c from :func:`transformer_pde.model.energy.choose_log_scale`, for any β‖A‖ at which
    the field is finite.

    Parameters
    ----------
    x : torch.Tensor
        queries (..., n, d).  heads: :class:`Heads`.  weights: query weights (..., n) or None.
    velocity : torch.Tensor
        the signed field V at the queries (..., n, d) (any normalisation, causal or not).
    stats : HeadStats
        the non-causal softmax statistics of the queries under the heads (log_partition, mean).
    log_scale : float
        c.
    chunk_elements, backend, keys, key_weights
        the transposed kernel pass of non-symmetric heads (as :func:`evaluate`).
    terms : list or None
        the per-head terms of ∇ δE/δμ when the caller has them (:func:`grad_first_variation_terms`).
    lazy_gradient : bool
        return ∇_S δE/δμ and 𝒟 as zero-argument callables where they come from products of the merged
        fused kernel's block (𝒟 then from the gradient when that is formed first); tensors otherwise.

    Returns
    -------
    tuple
        (energy (...,), slope (...,), dissipation (...,), grad_first_variation (..., n, d)), all times e^{−c}.
    """
    c = float(log_scale)
    if keys is None and heads.is_symmetric:
        # the merged fused kernel: E, b, 𝒟 (and the ledger's sums) from products of its output block
        merged = stats.__dict__.get("_merged")
        if merged is not None and merged[0] is x and not needs_grad(x, weights, velocity):
            return _fused_diagnostics(x, heads, weights, velocity, stats, c, lazy_gradient)
    if terms is None:
        terms = grad_first_variation_terms(x, heads, weights if keys is None else key_weights, stats, chunk_elements,
                                           backend, keys=keys)
    lse = stats.log_partition
    m = scaled_partition(stats, c)  # m_h(x_i) e^{−c}, shared by ∇_S δE/δμ, E, b and the ledger
    wts = heads.weights.unsqueeze(-1)  # (..., H, 1)
    g = tangent_projection(x, sum(((wts * (m if l is lse else scaled_exp(l, c))).unsqueeze(-1) * u).sum(-3)
                                  for l, u in terms))
    energy = over_two_beta((heads.weights * head_token_mean(m, weights)).sum(-1), heads,
                           lambda: finite_part(x, heads, weights, keys, key_weights, c))
    b = scaled_mobility(heads, lse, m, c)
    slope = token_mean(b * velocity.square().sum(-1), weights)
    dissipation = token_mean((g * velocity).sum(-1), weights)
    return energy, slope, dissipation, g


def _values_first(norm, heads: Heads) -> bool:
    """True when the field of this normalisation is read off the softmax averages of the values W_{V,h} y_j
    (:func:`transformer_pde.model.values.softmax_values`): softmax statistics used through V_h
    ("softmax", "unnormalized"), heads with query/key and value factors."""
    return norm.statistics == "softmax" and norm.uses_value and values_first_applies(heads)


def _softmax_mean(x, heads, weights, keys, chunk_elements, backend, causal):
    """ȳ_h of :func:`softmax_statistics` (the deferred mean of a values-first evaluation)."""
    return softmax_statistics(x, heads, weights, keys=keys, chunk_elements=chunk_elements, backend=backend,
                              causal=causal).mean


def evaluate(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    normalization="softmax",
    sign: float = 1.0,
    diagnostics: bool = True,
    log_scale: float = 0.0,
    second_moment: bool = False,
    chunk_elements: Optional[int] = None,
    backend: str = "auto",
    keys: Optional[torch.Tensor] = None,
    key_weights: Optional[torch.Tensor] = None,
    causal=False,
    ledger_moment: bool = True,
) -> FieldEval:
    """Field and diagnostics from one kernel pass.  No tensor validation (hot path):
    call :func:`velocity` / :func:`transformer_pde.model.energy` for checked entry points.

    ``normalization``: a name of :data:`transformer_pde.model.normalization.NORMALIZATIONS` or a
    :class:`~transformer_pde.model.normalization.Normalization` (used as it is, resolved once by
    :func:`~transformer_pde.model.normalization.resolve`); its output rule gives the field.

    ``log_scale=c``: the diagnostics (energy, slope, dissipation, grad_first_variation) are
    returned times e^{−c} (:func:`diagnostics_along`, the common scale of the solvers at large
    β‖A‖); c = 0 gives the values themselves.  The field never is rescaled.

    ``backend`` and ``chunk_elements`` select the attention kernel
    (:func:`transformer_pde.model.softmax.softmax_statistics`: "auto" | "dense" | "chunked" |
    "sdpa" | "keops"); every backend gives the same numbers to rounding.

    ``keys`` (..., m, d) and ``key_weights`` (..., m) or None: evaluate at the queries ``x`` the
    field of the measure μ = Σ_j key_weights_j δ_{keys_j} (default: μ = Σ_i weights_i δ_{x_i}).
    The diagnostics are then the partial sums Σ_i weights_i (...) over these queries, which add
    up over a partition of μ's support into query shards (:mod:`transformer_pde.solvers.particle.sharded`, ``tp.distributed``);
    pass the shard's share of the global token weights as ``weights``.

    ``causal``: token i attends only to tokens j ≤ i (the field of the prefix measure; module
    docstring).  Needs ``keys=None`` and a normalization with a causal version (ValueError).
    With diagnostics, a second non-causal pass gives E, ∇_S δE/δμ, b of the whole μ: the
    dissipation is then the rate of E along the causal field and the slope ∫ b|V|² dμ is
    reported but is no gradient-flow quantity (causal dynamics is not a gradient flow); the
    returned ``stats`` are then those of the whole measure (what the energy ledger pairs with),
    with the second moment when ``second_moment``.
    ``causal="sum"``: the un-normalised kernels sum over the prefix instead of averaging (module
    docstring); ``True`` and ``"mean"`` are the prefix mean.  ``causal=`` a positional bias (module
    docstring): the statistics of the positional prefix measures, from their own block kernel (the one-block
    and values-first kernels do not apply).

    With diagnostics, no second moment, ``backend="auto"``, the "softmax" normalization, non-symmetric or causal
    heads and few tokens (:func:`transformer_pde.model.pair_block.takes`: n ≤ 512 and H·n² within the chunk
    budget), the field, E, 𝒢², 𝒟 and ∇_S δE/δμ come from one exponentiated score block per system
    (:func:`transformer_pde.model.pair_block.pair_diagnostics`: the transposed statistics are the columns of
    the same block, the causal ones its lower triangle), where its shift-free exp is safe and no input
    requires grad; the returned ``stats`` then form their ``mean`` on first access.  That pass also forms the
    energy ledger's token moment T_h (:func:`transformer_pde.model.moments.head_moment_sums`) unless
    ``ledger_moment=False`` (a caller that pairs no rate of the heads with the statistics: one product per
    block less; a later pairing forms T_h from the statistics instead).  Without diagnostics the same heads and
    sizes (not values-first, not ``causal="sum"``) take the block's field alone
    (:func:`transformer_pde.model.pair_block.pair_field`: 0.25–0.9× the time of the log-sum-exp kernels' field
    for n = 16–512, docs/performance.md); its ``stats`` are those of the field's measure (causal: the prefixes).

    Heads with query/key factors and value factors V_h = O_h W_{V,h}, ``diagnostics=False`` and no second
    moment: a "softmax" or "unnormalized" field is computed values first, f_h = O_h Σ_j p_ij W_{V,h} y_j
    (:func:`transformer_pde.model.values.softmax_values`, H·n·m·k_v work instead of H·n·m·d); the
    returned ``stats`` then hold the log-partitions, and their ``mean`` ȳ_h is computed on first access."""
    norm = resolve(normalization)
    positional = causal if isinstance(causal, PositionalBias) else None
    prefix_sum = (isinstance(causal, str) and causal == "sum") or (positional is not None and positional.prefix == "sum")
    causal = bool(causal)
    if causal:
        if keys is not None:
            raise ValueError("causal=True needs queries = keys (token i attends to tokens j <= i of the same "
                             "sequence); call without keys=, or with causal=False")
        if not norm.causal:
            raise ValueError(f"normalization={norm.name!r} has no causal version (the gradient field b^{{-1}} "
                             f"∇ δE/δμ); use one of {names(lambda n: n.causal)} with causal=True")
    if keys is None:
        key_weights = weights
        if (diagnostics and not second_moment and backend == "auto" and norm.plain_softmax and positional is None
                and (causal or not heads.is_symmetric) and pair_takes(x.shape[-2], heads.num_heads, chunk_elements)):
            # small n, non-symmetric or causal heads: field and diagnostics from one exp'd score block
            pd = pair_diagnostics(x, heads, weights, sign=sign, causal=causal, log_scale=log_scale,
                                  token_moment=ledger_moment)
            if pd is not None:
                return FieldEval(pd.velocity, pd.stats, pd.outputs, pd.grad_first_variation, pd.energy, pd.slope,
                                 pd.dissipation, ambient=pd.ambient)
        if (not diagnostics and not second_moment and backend == "auto" and norm.plain_softmax and not prefix_sum
                and positional is None
                and (causal or not heads.is_symmetric) and not _values_first(norm, heads)
                and pair_takes(x.shape[-2], heads.num_heads, chunk_elements)):
            # the field alone, small n, non-symmetric or causal heads: the same block without the diagnostics
            pf = pair_field(x, heads, weights, sign=sign, causal=causal)
            if pf is not None:
                return FieldEval(pf.velocity, pf.stats, pf.outputs, ambient=pf.ambient)
    values = pos_prefix = None
    if positional is not None:
        # the positional prefix measures: their own block kernel (the whole measure's pass below, as causal)
        ps = positional_statistics(x, heads, key_weights, positional, second_moment=second_moment and not diagnostics,
                                   chunk_elements=chunk_elements)
        stats, pos_prefix = ps.stats, (positional, ps.log_prefix)
    elif not diagnostics and not second_moment and _values_first(norm, heads):
        # the field only: softmax averages of the k_v-dimensional values W_{V,h} y_j, the moments ȳ_h
        # (d-dimensional) formed only if a caller reads stats.mean
        lse, values = softmax_values(x, heads, key_weights, keys=keys, chunk_elements=chunk_elements,
                                     backend=backend, causal=causal)
        stats = deferred_mean_stats(lse, functools.partial(_softmax_mean, x, heads, key_weights, keys, chunk_elements,
                                                           backend, causal))
    else:
        # under causality the diagnostics belong to the whole measure: its own, unmasked pass
        stats = softmax_statistics(x, heads, key_weights, keys=keys, second_moment=second_moment and not
                                   (causal and diagnostics), chunk_elements=chunk_elements, backend=backend,
                                   causal=causal)
    measure = [None if causal else stats]

    def whole():
        if measure[0] is None:
            measure[0] = softmax_statistics(x, heads, key_weights, second_moment=second_moment,
                                            chunk_elements=chunk_elements, backend=backend)
        return measure[0]

    kern = _KernelPass(x, heads, key_weights, stats, keys, causal, prefix_sum, chunk_elements, backend, whole,
                       pos_prefix)
    kern.values = values
    field, outputs = norm.field(kern)
    if not isinstance(field, torch.Tensor) or field.shape[-2:] != x.shape[-2:] or field.dtype != x.dtype:
        got = (f"{tuple(field.shape)} {field.dtype}" if isinstance(field, torch.Tensor) else type(field).__name__)
        raise (ValueError if isinstance(field, torch.Tensor) else TypeError)(
            f"the normalisation {type(norm).__name__} returned a field of {got} from field(kernel); it must return "
            f"(field, outputs) with the un-projected field of shape (..., n, d) = (..., {x.shape[-2]}, {x.shape[-1]}) "
            f"in {x.dtype}, like the tokens")
    V = sign * tangent_projection(x, field)
    if not diagnostics:
        return FieldEval(V, stats, outputs, ambient=field if sign == 1.0 else sign * field)
    full = whole()
    fused = keys is None and heads.is_symmetric and head_columns(full) is not None
    E, G, D, g = diagnostics_along(x, heads, weights, V, full, log_scale=log_scale, keys=keys, key_weights=key_weights,
                                   terms=None if fused else kern.gradient_terms(), lazy_gradient=True)
    return FieldEval(V, full, outputs, g, E, G, D, ambient=field if sign == 1.0 else sign * field)


# ---------------------------------------------------------------------- checked entry points
def check_inputs(x, heads, weights, *, on_sphere: bool = True) -> Heads:
    """The checks of every public entry point; on_sphere=False admits tokens of any non-zero norm
    (the flat, unprojected dynamics of :mod:`transformer_pde.analysis.diagnostics`).  Returns the heads with
    β resolved at the context length n = x.shape[-2] (:meth:`Heads.at_context`; the heads themselves for a
    fixed β): callers use the returned heads."""
    if on_sphere:
        check_tokens(x, "x")
    else:
        check_tensor(x, "x", min_dim=2)
        if x.shape[-1] < 2 or x.shape[-2] < 1:
            raise ValueError(f"x must have shape (..., n, d) with n >= 1, d >= 2, got {tuple(x.shape)}")
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}; build one with tp.Heads(A)")
    check_same(x, heads.reference, "x", "heads")
    if heads.dim != x.shape[-1]:
        raise ValueError(f"heads act on dimension d = {heads.dim} but x has d = {x.shape[-1]}")
    try:
        broadcast_shapes(x.shape[:-2], heads.batch_shape)
    except RuntimeError:
        raise ValueError(
            f"the batch shape of x {tuple(x.shape[:-2])} does not broadcast against the heads' batch shape "
            f"{tuple(heads.batch_shape)}"
        ) from None
    check_token_weights(weights, x)
    return heads.at_context(x.shape[-2])


#: the values of ``causal=``: False, True (= "mean"), "mean" (prefix mean), "sum" (prefix sum); or a
#: :class:`~transformer_pde.model.positional.PositionalBias` (positional attention)
CAUSAL_MODES = (False, True, "mean", "sum")


def check_causal_mode(causal):
    """TypeError unless ``causal`` is one of :data:`CAUSAL_MODES` or a positional bias (an unknown option is a
    TypeError)."""
    if isinstance(causal, PositionalBias):
        return
    if isinstance(causal, str):
        if causal not in ("mean", "sum"):
            raise TypeError(f"causal must be False, True, 'mean' (prefix mean, = True) or 'sum' (prefix sum), "
                             f"got {causal!r}")
    elif not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False (or 'mean' / 'sum', or a positional bias such as "
                        f"tp.ALiBi(slopes)), got {type(causal).__name__}")


def _check_causal_flag(causal, norm):
    check_causal_mode(causal)
    if causal and not norm.causal:
        raise ValueError(f"normalization={norm.name!r} is the gradient field b^{{-1}} ∇ δE/δμ and has no causal "
                         f"version; use one of {', '.join(map(repr, names(lambda n: n.causal)))} with causal=True")


def velocity(x, heads, weights=None, normalization="softmax", direction=DEFAULT_DIRECTION, *, causal=False):
    """V[μ, Θ](x_i) = s · P_{x_i} Σ_h ω_h f_h(x_i) at the tokens of μ = Σ_i w_i δ_{x_i}.

    Parameters
    ----------
    x
        tokens (..., n, d) on the sphere.  heads: :class:`Heads`.
    weights
        token weights (..., n) or None (uniform).
    normalization
        "softmax" | "unnormalized" | "relu" | "effective" | "sinkhorn" | "hardmax" (module docstring), or a
        :class:`~transformer_pde.model.normalization.Normalization` object, used as it is (parameters such as
        ``tp.SinkhornAttention(iterations=50)``, or a subclass of your own).
    direction
        "ascent" (s = +1, x + attention(x)) or "descent" (s = −1, reference code).
    causal
        token i attends only to tokens j ≤ i in the stored order (decoder-only masking);
        True / "mean": the field of the prefix measure Σ_{j≤i} w_j δ_{x_j} / Σ_{j≤i} w_j;
        "sum": the un-normalised kernels sum over the prefix (module docstring); a positional bias
        (``tp.ALiBi``, ``tp.KineticDecay``, ``tp.PositionKernel``): the prefix weighted by positional weights
        e^{b_h(p_i, p_j)} (:mod:`transformer_pde.model.positional`).  Not "effective".

    Returns
    -------
    result
        (..., n, d) tangent vectors; dtype and device follow x.

    Raises
    ------
    TypeError, ValueError
        for tokens off the sphere, bad shapes, mixed devices, unknown names,
        causal=True with normalization="effective"; OverflowError when an "unnormalized" or "effective"
        field overflows the dtype (the softmax field never does).

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> tp.velocity(x, tp.Heads.scalar([1.0], 3).to(torch.float64)).shape
    torch.Size([5, 3])
    """
    norm = resolve(normalization)
    sign = direction_sign(direction)
    _check_causal_flag(causal, norm)
    heads = check_inputs(x, heads, weights)
    if not norm.uses_value:  # the gradient of E: V_h plays no part, so it must be A_h
        check_tied(heads, f"normalization={norm.name!r}")
    v = evaluate(x, heads, weights, normalization=norm, sign=sign, diagnostics=False, causal=causal).velocity
    if norm.overflow == "kernel" and not bool(torch.isfinite(v.detach()).all()) and bool(torch.isfinite(x).all()):
        raise OverflowError(
            f"the {norm.name!r} field overflows {v.dtype} at these heads (β·‖A‖ too large for an unnormalised "
            f"kernel e^(β⟨x, A y⟩)); use normalization='softmax' (finite for any β‖A‖), float64, or a smaller β·‖A‖")
    return v


def head_outputs(x, heads, weights=None, normalization="softmax", *, causal=False):
    """Per-head outputs f_h(x_i), (..., H, n, d), un-projected and unsigned (module docstring).

    Defined for "softmax", "unnormalized" and "relu"; the "effective" field has no per-head split.
    causal: token i attends only to tokens j ≤ i (see :func:`velocity`)."""
    norm = resolve(normalization, lambda n: n.head_outputs, what="no per-head split")
    _check_causal_flag(causal, norm)
    heads = check_inputs(x, heads, weights)
    return evaluate(x, heads, weights, normalization=norm, diagnostics=False, causal=causal).outputs


def radial_shadows(x, heads, weights=None, normalization="unnormalized"):
    """Radial shadows a_i^h = ⟨x_i, f_h(x_i)⟩, (..., H, n) (Pendharkar; unnormalised heads by default)."""
    f = head_outputs(x, heads, weights, normalization)
    return (f * x.unsqueeze(-3)).sum(-1)
