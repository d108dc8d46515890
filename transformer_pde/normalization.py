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
    ``reduced``         whether the reduced equiangular ODE of :mod:`transformer_pde.theory` covers it
    ``jko_mobility``    the mobility of the JKO scheme that solves the same PDE ("effective": b_k,
                        "unit": b ≡ 1), or None

:func:`normalization` turns a name (or an object) into the object; :data:`NORMALIZATIONS` is the
tuple of names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

__all__ = ["Normalization", "Softmax", "Unnormalized", "ReLU", "Effective", "normalization", "NORMALIZATIONS"]


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

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Softmax(Normalization):
    """f_h(x) = V_h ȳ_h(x): the softmax (self-attention) average of the values."""

    name: ClassVar[str] = "softmax"
    gradient_flow: ClassVar[str] = ("for one head with V = A = Aᵀ, in the metric ∫ b|v|² dμ (then it equals "
                                    "'effective'); several heads: no")
    jko_mobility: ClassVar[Optional[str]] = "effective"


@dataclass(frozen=True)
class Unnormalized(Normalization):
    """f_h(x) = ∫ e^{β⟨x,A_h y⟩} V_h y dμ: the kernel sum without the partition function."""

    name: ClassVar[str] = "unnormalized"
    overflow: ClassVar[str] = "kernel"
    gradient_flow: ClassVar[str] = "with tied symmetric heads (V_h = A_h = A_hᵀ): the W2 gradient flow of E"
    jko_mobility: ClassVar[Optional[str]] = "unit"


@dataclass(frozen=True)
class ReLU(Normalization):
    """f_h(x) = ∫ ReLU(β⟨x,A_h y⟩) V_h y dμ."""

    name: ClassVar[str] = "relu"
    statistics: ClassVar[str] = "relu"


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


_BY_NAME = {cls.name: cls for cls in (Softmax, Unnormalized, ReLU, Effective)}

#: the names users pass as ``normalization=``
NORMALIZATIONS = tuple(_BY_NAME)


def normalization(value: Union[str, Normalization], name: str = "normalization") -> Normalization:
    """The strategy object for a name of :data:`NORMALIZATIONS` (or the object itself).

    Raises
    ------
    TypeError
        ``value`` is neither a string nor a :class:`Normalization` (or is the abstract base).
    ValueError
        an unknown name."""
    if isinstance(value, Normalization):
        if type(value) is Normalization:
            raise TypeError(f"{name}=Normalization() is the abstract base; use one of {NORMALIZATIONS} or "
                            f"Softmax(), Unnormalized(), ReLU(), Effective()")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {NORMALIZATIONS} or a Normalization object, got "
                        f"{type(value).__name__}")
    if value not in _BY_NAME:
        raise ValueError(f"{name} must be one of {NORMALIZATIONS}, got {value!r}")
    return _BY_NAME[value]()
