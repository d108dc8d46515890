"""The settings of a Lagrangian JKO step: its transport term W_b(μ, μ_k)² (:class:`TransportTerm`:
:class:`EMD`, :class:`SinkhornTransport`, :class:`Identity`) and its inner optimiser
(:class:`RiemannianLBFGS`); :class:`~transformer_pde.LagrangianJKO` takes one of each.

:class:`SinkhornTransport` is the transport term (a debiased Sinkhorn divergence between token clouds);
the attention normalisation of the same name is :class:`~transformer_pde.SinkhornAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ...utils.validation import check_choice, check_int, check_positive

__all__ = ["TransportTerm", "EMD", "SinkhornTransport", "Identity", "RiemannianLBFGS"]


class TransportTerm:
    """The transport term W_b(μ, μ_k)² of a Lagrangian JKO step (base class of :class:`EMD`,
    :class:`SinkhornTransport`, :class:`Identity`; :class:`~transformer_pde.LagrangianJKO` takes one)."""

    name: ClassVar[str] = ""


@dataclass(frozen=True)
class EMD(TransportTerm):
    """The exact plan (POT's emd); ``cost`` "source" (b_k(x)|x − y|²) or "symmetric"."""

    cost: str = "source"
    name: ClassVar[str] = "emd"

    def __post_init__(self):
        check_choice(self.cost, ("source", "symmetric"), "EMD.cost")


@dataclass(frozen=True)
class SinkhornTransport(TransportTerm):
    """The debiased Sinkhorn divergence (geomloss) at blur ε (cost units), ε-scaling ratio ``scaling``."""

    eps: float = 1e-3
    scaling: float = 0.95
    name: ClassVar[str] = "sinkhorn"

    def __post_init__(self):
        object.__setattr__(self, "eps", check_positive(self.eps, "SinkhornTransport.eps"))
        s = self.scaling
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < 1:
            raise ValueError(f"SinkhornTransport.scaling must be in (0, 1), got {s!r}")


@dataclass(frozen=True)
class Identity(TransportTerm):
    """The identity plan: the implicit Euler step of the particles."""

    cost: str = "source"
    name: ClassVar[str] = "identity"

    def __post_init__(self):
        check_choice(self.cost, ("source", "symmetric"), "Identity.cost")


@dataclass(frozen=True)
class RiemannianLBFGS:
    """The inner optimiser of a JKO step: L-BFGS on the product of spheres with a trust region.

    tol : relative tolerance (None: 1e-9 in float64, 1e-4 in float32; 1e-6 / 1e-4 with Sinkhorn);
    max_iter : inner iterations per solve; max_plan_updates : emd plan recomputations per step."""

    tol: Optional[float] = None
    max_iter: int = 200
    max_plan_updates: int = 20

    def __post_init__(self):
        if self.tol is not None:
            object.__setattr__(self, "tol", check_positive(self.tol, "RiemannianLBFGS.tol"))
        object.__setattr__(self, "max_iter", check_int(self.max_iter, "RiemannianLBFGS.max_iter"))
        object.__setattr__(self, "max_plan_updates",
                           check_int(self.max_plan_updates, "RiemannianLBFGS.max_plan_updates"))
