"""Attention normalisations as strategy objects: each states its own properties.

A normalisation turns the per-head kernel statistics into the per-head outputs f_h
(docs/model.md#fields).  The field, the mobility, the solvers, the JKO scheme and the theory
modules ask the object what it is instead of comparing strings:

    ``name``            the string users pass (``normalization="softmax"``)
    ``statistics``      the kernel statistics it needs: "softmax" (log-partition, first and
                        second moments, :func:`transformer_pde.softmax_statistics`) or "relu"
                        (:func:`transformer_pde.relu_statistics`)
    ``uses_value``      whether the output reads the value matrices V_h ("effective" uses the
                        scores only: it is the gradient of E)
    ``causal``          whether a causal (prefix) version exists
    ``overflow``        "none" (the output is a ratio of kernels; log-sum-exp keeps it finite at any
                        β‖A‖) or "kernel" (the output carries e^{β⟨x,Ay⟩} itself and overflows near
                        β‖A‖ ≈ log(max float))
    ``gradient_flow``   when the flow is the gradient flow of E, in words
    ``reduced``         whether the reduced equiangular ODE of :mod:`transformer_pde.analysis.theory` covers it
    ``jko_mobility``    the mobility of the JKO scheme that solves the same PDE ("effective": b_k,
                        "unit": b ≡ 1), or None
    ``head_outputs``    whether the field is Σ_h ω_h f_h of per-head outputs f_h (all but "effective",
                        whose field b^{-1} ∇_S δE/δμ has no per-head split)

Each object also owns its output rule: :meth:`Normalization.outputs` turns the kernel statistics
of one pass into the per-head outputs f_h, and :meth:`Normalization.field` into the un-projected
field Σ_h ω_h f_h, so that :func:`transformer_pde.model.field.evaluate` dispatches once.  The rules
receive the field's kernel pass (``kernel``, built by :mod:`transformer_pde.model.field`) and call only
its methods, so this module stays free of tensors:

    ``kernel.value_mean()``        V_h ȳ_h (softmax statistics of the pass)
    ``kernel.times_mass(f)``       m_h(x) f (m_h the kernel mass: the prefix sum under causal="sum")
    ``kernel.relu_values()``       V_h ∫ ReLU(β⟨x,A_h y⟩) y dμ (prefix sum under causal="sum")
    ``kernel.head_sum(f)``         Σ_h ω_h f_h
    ``kernel.value_field(mass)``   Σ_h ω_h V_h ȳ_h (times m_h when mass): one product of the fused
                                   kernel's output block, the per-head V_h ȳ_h never formed
    ``kernel.gradient_field()``    b^{-1} ∇ δE/δμ, un-projected (the gradient terms of the kernel)
    ``kernel.plan_mean(plan, **p)`` V_h Σ_j P_ij y_j for the plan P of the scores: ``plan`` a name of
                                   :data:`transformer_pde.model.plans.PLANS` ("sinkhorn", "hardmax") or a
                                   callable (scores, log key weights, log query weights) -> P

:func:`resolve` turns a name into the object once, at a public entry point (an object is returned
as it is: no registry lookup, no round trip through its name, so a user's own subclass works in
every function of the model layer); :func:`normalization` is the same without a predicate;
:data:`NORMALIZATIONS` is the tuple of the registered names.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

__all__ = ["Normalization", "Softmax", "Unnormalized", "ReLU", "Effective", "SinkhornAttention", "Hardmax",
           "normalization", "resolve", "NORMALIZATIONS", "names", "choose", "check_sinkhorn_rounds",
           "MAX_SINKHORN_ITERATIONS"]

#: the most column-and-row rounds a Sinkhorn plan takes (a fixed count above it is refused: use ``tol``)
MAX_SINKHORN_ITERATIONS = 100_000


@dataclass(frozen=True)
class Normalization:
    """Base class of the attention normalisations (module docstring for the attributes)."""

    name: ClassVar[str] = ""
    statistics: ClassVar[str] = "softmax"
    uses_value: ClassVar[bool] = True
    causal: ClassVar[bool] = True
    overflow: ClassVar[str] = "none"
    gradient_flow: ClassVar[str] = "no"
    reduced: ClassVar[bool] = True
    jko_mobility: ClassVar[Optional[str]] = None
    head_outputs: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.name

    @property
    def rule(self) -> Optional[str]:
        """The name of the registered rule this object computes, or None for a rule of its own.

        A registered class (:data:`NORMALIZATIONS`) computes its own rule; a subclass keeps it as long as it
        overrides neither :meth:`outputs`, :meth:`field` nor ``statistics``, and then shares the rule's fast
        paths (the fused kernels of :func:`~transformer_pde.model.field.evaluate`) and closed forms (the
        theory); a subclass that overrides one of them computes its own rule (None), which the fast paths
        and closed forms never replace."""
        cls = type(self)
        base = next((c for c in cls.__mro__ if _BY_NAME.get(c.__dict__.get("name")) is c), None)
        if base is None or cls.outputs is not base.outputs or cls.field is not base.field \
                or cls.statistics != base.statistics:
            return None
        return base.name

    @property
    def plain_softmax(self) -> bool:
        """True when the object computes the plain softmax rule (``rule == "softmax"``): the condition of the
        softmax fast paths."""
        return self.rule == "softmax"

    def outputs(self, kernel):
        """The per-head outputs f_h (..., H, n, d) from the kernel pass, or None (no per-head split).

        Parameters
        ----------
        kernel
            the field's kernel pass (module docstring for its methods).

        Returns
        -------
        torch.Tensor or None
            f_h, un-projected and unsigned."""
        raise NotImplementedError(f"{type(self).__name__} does not define its output rule")

    def field(self, kernel):
        """The un-projected, unsigned field Σ_h ω_h f_h(x) (..., n, d) from the kernel pass.

        Parameters
        ----------
        kernel
            the field's kernel pass (module docstring for its methods).

        Returns
        -------
        tuple
            (field, outputs): the field and the per-head outputs it sums (None without a per-head split,
            or a zero-argument callable giving them, when the field was formed without them; the
            :class:`~transformer_pde.model.field.FieldEval` calls it on first access)."""
        f = self.outputs(kernel)
        return kernel.head_sum(f), f


@dataclass(frozen=True)
class Softmax(Normalization):
    """f_h(x) = V_h ȳ_h(x): the softmax (self-attention) average of the values."""

    name: ClassVar[str] = "softmax"
    gradient_flow: ClassVar[str] = ("for one head with V = A = Aᵀ, in the metric ∫ b|v|² dμ (then it equals "
                                    "'effective'); several heads: no")
    jko_mobility: ClassVar[Optional[str]] = "effective"

    def outputs(self, kernel):
        """f_h = V_h ȳ_h (see :meth:`Normalization.outputs`)."""
        return kernel.value_mean()

    def field(self, kernel):
        """(Σ_h ω_h V_h ȳ_h, the outputs deferred) (see :meth:`Normalization.field`)."""
        return kernel.value_field(), functools.partial(self.outputs, kernel)


@dataclass(frozen=True)
class Unnormalized(Normalization):
    """f_h(x) = ∫ e^{β⟨x,A_h y⟩} V_h y dμ: the kernel sum without the partition function."""

    name: ClassVar[str] = "unnormalized"
    overflow: ClassVar[str] = "kernel"
    gradient_flow: ClassVar[str] = "with tied symmetric heads (V_h = A_h = A_hᵀ): the W2 gradient flow of E"
    jko_mobility: ClassVar[Optional[str]] = "unit"

    def outputs(self, kernel):
        """f_h = m_h V_h ȳ_h (see :meth:`Normalization.outputs`)."""
        return kernel.times_mass(kernel.value_mean())

    def field(self, kernel):
        """(Σ_h ω_h m_h V_h ȳ_h, the outputs deferred) (see :meth:`Normalization.field`)."""
        return kernel.value_field(mass=True), functools.partial(self.outputs, kernel)


@dataclass(frozen=True)
class ReLU(Normalization):
    """f_h(x) = ∫ ReLU(β⟨x,A_h y⟩) V_h y dμ."""

    name: ClassVar[str] = "relu"
    statistics: ClassVar[str] = "relu"

    def outputs(self, kernel):
        """f_h = V_h ∫ ReLU(β⟨x,A_h y⟩) y dμ (see :meth:`Normalization.outputs`)."""
        return kernel.relu_values()


@dataclass(frozen=True)
class Effective(Normalization):
    """V(x) = b(x)^{-1} ∇_S δE/δμ(x): the gradient of E in the metric ∫ b|v|² dμ (tied heads)."""

    name: ClassVar[str] = "effective"
    uses_value: ClassVar[bool] = False
    causal: ClassVar[bool] = False
    overflow: ClassVar[str] = "kernel"
    gradient_flow: ClassVar[str] = "always (tied heads): the gradient flow of E in the metric ∫ b|v|² dμ"
    reduced: ClassVar[bool] = False
    jko_mobility: ClassVar[Optional[str]] = "effective"
    head_outputs: ClassVar[bool] = False

    def outputs(self, kernel):
        """None: the effective field has no per-head split (see :meth:`Normalization.outputs`)."""
        return None

    def field(self, kernel):
        """(b^{-1} ∇ δE/δμ, None) (see :meth:`Normalization.field`)."""
        return kernel.gradient_field(), None


@dataclass(frozen=True)
class SinkhornAttention(Normalization):
    """f_h(x_i) = V_h Σ_j P_ij y_j with P the Sinkhorn (doubly stochastic) plan of the kernel (Sinkformers).

    In the log domain, with scores s_ij = β⟨x_i, A_h y_j⟩ and token weights w as both marginals:
    f_i ← −log Σ_j w_j e^{s_ij + g_j} (g = 0: the softmax rows), then rounds of
    g_j ← −log Σ_i w_i e^{s_ij + f_i} and the row update again; P_ij = e^{s_ij + f_i + g_j} w_j.  Every
    row sums to one (Σ_j P_ij = 1); the columns reach Σ_i w_i P_ij = w_j as the rounds go on.  By default
    (``iterations=None``, also the name ``"sinkhorn"``) the rounds stop once every column's log marginal error
    is at most ``tol`` (None: 10·ε^{2/3} of the dtype, :func:`transformer_pde.model.plans.sinkhorn_tolerance`),
    or after ``max_iterations`` rounds with a RuntimeWarning: the converged plan's field.  An int
    ``iterations=k`` takes exactly k rounds (at most
    :data:`MAX_SINKHORN_ITERATIONS`; ten rounds leave the field 0.2–3 % from the
    converged one at β ≈ 1–4): ``iterations=0`` is softmax; Sinkformers' ``n_it`` (normalisations counted
    singly) is 2·iterations + 1.
    With symmetric heads (V_h = A_h = A_hᵀ) the converged field is the W2 gradient flow of
    Σ_h ω_h ½ OT_{1/β}(μ, μ), the entropic transport cost of μ to itself with cost −⟨x, A_h y⟩
    (docs/model.md#sinkhorn-and-hardmax-attention).  Queries must be the tokens of μ (no ``keys=``);
    memory H·n·m per batch entry (the whole plan)."""

    name: ClassVar[str] = "sinkhorn"
    statistics: ClassVar[str] = "sinkhorn"
    causal: ClassVar[bool] = False
    gradient_flow: ClassVar[str] = ("with symmetric heads (V_h = A_h = A_hᵀ) at convergence: the W2 gradient flow of "
                                    "Σ_h ω_h ½ OT_{1/β}(μ, μ) with cost −⟨x, A_h y⟩ (not of E)")
    reduced: ClassVar[bool] = False
    iterations: Optional[int] = None
    tol: Optional[float] = None
    max_iterations: int = 1000

    def __post_init__(self):
        try:
            check_sinkhorn_rounds(self.iterations, self.tol, self.max_iterations)
        except ValueError as e:
            raise ValueError(f"SinkhornAttention(iterations={self.iterations!r}, tol={self.tol!r}, "
                             f"max_iterations={self.max_iterations!r}): {e}") from None

    def outputs(self, kernel):
        """f_h = V_h Σ_j P_ij y_j, P the Sinkhorn plan (see :meth:`Normalization.outputs`)."""
        return kernel.plan_mean("sinkhorn", iterations=self.iterations, tol=self.tol,
                                max_iterations=self.max_iterations)


def check_sinkhorn_rounds(iterations, tol, max_iterations) -> None:
    """Refuse a Sinkhorn schedule that is not a count, a tolerance or a cap (ValueError naming the fix).

    Parameters
    ----------
    iterations : int or None
        a fixed count (0 … :data:`MAX_SINKHORN_ITERATIONS`) or None (stop at ``tol``).
    tol : float or None
        a finite tolerance > 0 or None (dtype default); only with ``iterations`` None.
    max_iterations : int
        the cap with ``iterations`` None (1 … :data:`MAX_SINKHORN_ITERATIONS`).

    Raises
    ------
    ValueError
        anything else."""
    cap = MAX_SINKHORN_ITERATIONS
    if iterations is not None:
        if isinstance(iterations, bool) or not isinstance(iterations, int) or not 0 <= iterations <= cap:
            raise ValueError(f"Sinkhorn iterations must be None (stop at a tolerance) or an int in [0, {cap}] "
                             f"(column-and-row rounds after the first row normalisation), got {iterations!r}; for "
                             f"a converged plan leave iterations=None and set tol=")
        if tol is not None:
            raise ValueError("Sinkhorn attention takes either a fixed number of iterations or a tolerance tol, not "
                             "both; pass iterations=None with tol=")
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol)
                            or tol <= 0):
        raise ValueError(f"Sinkhorn tol must be a finite float > 0 (the columns' log marginal error), got {tol!r}")
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or not 1 <= max_iterations <= cap:
        raise ValueError(f"Sinkhorn max_iterations must be an int in [1, {cap}] (the cap on the rounds when "
                         f"stopping at tol), got {max_iterations!r}")


@dataclass(frozen=True)
class Hardmax(Normalization):
    """f_h(x_i) = V_h of the weighted average of the keys that maximise ⟨x_i, A_h y⟩ (ties split by weight).

    The limit β → ∞ of softmax (for β > 0): with a unique maximiser j* and the gap δ_i = s_ij* − s_ij' to the
    second-best score (s = ⟨x, A y⟩), the softmax average differs from it by O(e^{−β δ_i})."""

    name: ClassVar[str] = "hardmax"
    statistics: ClassVar[str] = "hardmax"
    reduced: ClassVar[bool] = False

    def outputs(self, kernel):
        """f_h = V_h Σ_{j ∈ argmax} w_j y_j / Σ_{j ∈ argmax} w_j (see :meth:`Normalization.outputs`)."""
        return kernel.plan_mean("hardmax")


_BY_NAME = {cls.name: cls for cls in (Softmax, Unnormalized, ReLU, Effective, SinkhornAttention, Hardmax)}

#: the names users pass as ``normalization=``
NORMALIZATIONS = tuple(_BY_NAME)


def normalization(value: Union[str, Normalization], name: str = "normalization") -> Normalization:
    """The strategy object for a name of :data:`NORMALIZATIONS` (or the object itself): :func:`resolve`
    without a requirement.

    Raises
    ------
    TypeError
        ``value`` is neither a string nor a :class:`Normalization` (or is the abstract base).
    ValueError
        an unknown name."""
    return resolve(value, name=name)


_INSTANCES = {k: cls() for k, cls in _BY_NAME.items()}


def resolve(value: Union[str, Normalization], where=None, *, name: str = "normalization",
            what: str = "") -> Normalization:
    """The strategy object for ``value``, resolved once at a public entry point.

    A :class:`Normalization` object is returned as it is (no registry lookup, no round trip through
    its ``name``: a user's own subclass works); a string is looked up among :data:`NORMALIZATIONS`.

    Parameters
    ----------
    value : str or Normalization
        what the user passed.
    where : callable or None
        a predicate on the object that this entry point needs (e.g. ``lambda n: n.head_outputs``).
    name : str
        the argument's name, for the messages.
    what : str
        what the predicate asks for, in words (for the message).

    Returns
    -------
    Normalization
        the strategy object.

    Raises
    ------
    TypeError
        neither a string nor a :class:`Normalization` (or the abstract base).
    ValueError
        an unknown name, or an object (or name) that fails ``where``."""
    if isinstance(value, Normalization):
        if type(value) is Normalization:
            raise TypeError(f"{name}=Normalization() is the abstract base; use one of {NORMALIZATIONS} or "
                            f"Softmax(), Unnormalized(), ReLU(), Effective(), SinkhornAttention(), Hardmax()")
        obj = value
    elif isinstance(value, str):
        obj = _INSTANCES.get(value)
        if obj is None or (where is not None and not where(obj)):
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, names(where)))}")
        return obj
    else:
        raise TypeError(f"{name} must be one of {NORMALIZATIONS} or a Normalization object, got "
                        f"{type(value).__name__}")
    if where is not None and not where(obj):
        label = obj.name or type(obj).__name__
        raise ValueError(f"{name}={label!r} is not covered here{' (' + what + ')' if what else ''}; choose one of "
                         f"{', '.join(map(repr, names(where)))}" + (" or an object that has it" if what else ""))
    return obj


def names(where=None) -> tuple:
    """The names of the normalisations whose object satisfies ``where`` (all when None), in
    :data:`NORMALIZATIONS` order: ``names(lambda n: n.reduced)`` are those the reduced ODE covers.

    Parameters
    ----------
    where : callable or None
        a predicate on :class:`Normalization` objects.

    Returns
    -------
    tuple
        names (str)."""
    return tuple(k for k, obj in _INSTANCES.items() if where is None or where(obj))


def choose(value, allowed: tuple, name: str = "normalization") -> Normalization:
    """The object for ``value`` (a name or an object), refused unless it computes one of the registered rules
    named in ``allowed`` (:attr:`Normalization.rule`: entry points with closed forms per rule; a subclass that
    overrides its rule is refused).

    Parameters
    ----------
    value : str or Normalization
        what the user passed.
    allowed : tuple
        the names this entry point covers (e.g. ``names(lambda n: n.reduced)``).
    name : str
        the argument's name, for the messages.

    Returns
    -------
    Normalization
        the strategy object.

    Raises
    ------
    TypeError
        neither a string nor a :class:`Normalization` (or the abstract base).
    ValueError
        an unknown name, or one that is not in ``allowed`` (the message lists those)."""
    # the object's rule, not its name or class: a subclass that keeps a registered rule is that rule, one that
    # overrides it carries its own
    return resolve(value, lambda obj: obj.rule in allowed, name=name)
