"""The base class of the solver objects of :func:`transformer_pde.solve`, and the JKO solver objects.

A solver object carries its own settings and runs itself: ``solver.run(model, x0, options)``.  The
built-in ones: fixed step (projected explicit Runge–Kutta with retraction, or the model's layer
map) ``Euler()``, ``Heun()``, ``RK4()`` or ``FixedStep(tableau)`` and adaptive ``Dopri5(rtol,
atol, adjoint)`` (:mod:`transformer_pde.solvers.particle`); sharded ``ShardedEuler(group, backend,
gather_x)``, the projected Euler step with the tokens sharded over the ranks of a
``torch.distributed`` process group (:mod:`transformer_pde.solvers.sharded`); minimizing movement
``LagrangianJKO(transport, inner)`` with a transport object (``EMD()``, ``Sinkhorn(eps)``,
``Identity()``) and an inner optimiser (``RiemannianLBFGS()``), and ``EulerianJKO(grid)`` (below).

``Solver.accepts`` names the options objects of :func:`~transformer_pde.solve` the solver takes
("saveat", "ledger", "checkpoint", "progress", "limits"); the others are refused before any work.
``Solver.unsupported`` names, per accepted options object, the fields the solver does not implement:
they must stay at their defaults (TypeError naming the field otherwise, before any work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, FrozenSet, Mapping, Optional, Tuple, Union

import torch

from ..utils.validation import check_bool, check_choice, check_int, check_positive

__all__ = ["Solver", "Transport", "EMD", "Sinkhorn", "Identity", "RiemannianLBFGS", "LagrangianJKO", "EulerianJKO"]

_ALL = frozenset({"saveat", "ledger", "checkpoint", "progress", "limits"})


class Solver:
    """Base class of the solver objects.  ``accepts``: the options objects it takes; ``unsupported``:
    per options object, the fields it does not implement.

    A solver implements ``run(self, model, x0, options)`` returning a
    :class:`~transformer_pde.Trajectory`, where ``options`` is a
    :class:`~transformer_pde.SolveOptions` (the grid t0, t1, dt and ``steps``; paths, seed, generator;
    the options objects ``saveat``, ``ledger``, ``checkpoint`` (None unless given), ``progress``,
    ``limits``).  :func:`transformer_pde.solve` checks the options against ``accepts`` /
    ``unsupported``, fills in the defaults and calls it.  Compose it from the solver parts
    (docs/solve.md, "A solver of your own"; ARCHITECTURE.md, "Where to add")."""

    accepts: ClassVar[FrozenSet[str]] = _ALL
    #: options object -> its fields this solver does not implement (they must keep their defaults)
    unsupported: ClassVar[Mapping[str, Tuple[str, ...]]] = {}

    def run(self, model, x0: Optional[torch.Tensor], options) -> Any:
        """Solve ``model`` from ``x0`` with ``options`` (a :class:`~transformer_pde.SolveOptions`).

        Parameters
        ----------
        model : Model
            the dynamics.
        x0 : torch.Tensor or None
            the initial tokens.
        options : SolveOptions
            the grid, the random stream and the options objects, checked against ``accepts``.

        Returns
        -------
        Trajectory
            the solution.
        """
        raise NotImplementedError(f"{type(self).__name__} must define run(model, x0, options)")


# ---------------------------------------------------------------------------- JKO
class Transport:
    """The transport term W_b(μ, μ_k)² of a Lagrangian JKO step (base class)."""

    name: ClassVar[str] = ""


@dataclass(frozen=True)
class EMD(Transport):
    """The exact plan (POT's emd); ``cost`` "source" (b_k(x)|x − y|²) or "symmetric"."""

    cost: str = "source"
    name: ClassVar[str] = "emd"

    def __post_init__(self):
        check_choice(self.cost, ("source", "symmetric"), "EMD.cost")


@dataclass(frozen=True)
class Sinkhorn(Transport):
    """The debiased Sinkhorn divergence (geomloss) at blur ε (cost units), ε-scaling ratio ``scaling``."""

    eps: float = 1e-3
    scaling: float = 0.95
    name: ClassVar[str] = "sinkhorn"

    def __post_init__(self):
        object.__setattr__(self, "eps", check_positive(self.eps, "Sinkhorn.eps"))
        s = self.scaling
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < 1:
            raise ValueError(f"Sinkhorn.scaling must be in (0, 1), got {s!r}")


@dataclass(frozen=True)
class Identity(Transport):
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


@dataclass(frozen=True)
class LagrangianJKO(Solver):
    """Minimizing movement of the tokens with step τ = ``dt``:
    μ_{k+1} ∈ argmin s'E(μ, Θ_{t_{k+1}}) + W_{b_k}(μ, μ_k)²/(2τ).

    The mobility follows the model's normalisation ("effective": b_k; "unnormalized": b ≡ 1).
    ``path_dt``: the grid of sampled noisy weights (None: τ).  ``strict``: raise on a step that does
    not converge.  No checkpoints."""

    transport: Transport = field(default_factory=EMD)
    inner: RiemannianLBFGS = field(default_factory=RiemannianLBFGS)
    path_dt: Optional[float] = None
    strict: bool = False
    accepts: ClassVar[FrozenSet[str]] = frozenset({"saveat", "ledger", "progress", "limits"})
    kind: ClassVar[str] = "jko"
    scheme: ClassVar[str] = "lagrangian"

    def __post_init__(self):
        if not isinstance(self.transport, Transport) or type(self.transport) is Transport:
            raise TypeError(f"LagrangianJKO.transport must be EMD(), Sinkhorn(eps) or Identity(), got "
                            f"{type(self.transport).__name__}")
        if not isinstance(self.inner, RiemannianLBFGS):
            raise TypeError(f"LagrangianJKO.inner must be a RiemannianLBFGS, got {type(self.inner).__name__}")
        if self.path_dt is not None:
            object.__setattr__(self, "path_dt", check_positive(self.path_dt, "LagrangianJKO.path_dt"))
        check_bool(self.strict, "LagrangianJKO.strict")


@dataclass(frozen=True)
class EulerianJKO(Solver):
    """Minimizing movement of weights on a fixed grid of the sphere (S¹ or S²), step τ = ``dt``, with
    the entropic transport at blur ``eps`` (ε ≳ grid spacing²).  ``grid``: a tensor (m, d) on the
    sphere or a number of points; ``grid_weights``: the initial weights (..., m) (None: x0
    deposited on the grid with ``bandwidth``).  The model's token noise adds T∫ρ log ρ (the
    Fokker–Planck JKO).  No checkpoints."""

    grid: Union[int, torch.Tensor, None] = None
    grid_weights: Optional[torch.Tensor] = None
    bandwidth: Optional[float] = None
    eps: float = 1e-3
    tol: Optional[float] = None
    max_iter: int = 200
    path_dt: Optional[float] = None
    strict: bool = False
    accepts: ClassVar[FrozenSet[str]] = frozenset({"saveat", "ledger", "progress", "limits"})
    kind: ClassVar[str] = "jko"
    scheme: ClassVar[str] = "eulerian"

    def __post_init__(self):
        object.__setattr__(self, "eps", check_positive(self.eps, "EulerianJKO.eps"))
        if self.tol is not None:
            object.__setattr__(self, "tol", check_positive(self.tol, "EulerianJKO.tol"))
        object.__setattr__(self, "max_iter", check_int(self.max_iter, "EulerianJKO.max_iter"))
        if self.path_dt is not None:
            object.__setattr__(self, "path_dt", check_positive(self.path_dt, "EulerianJKO.path_dt"))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", check_positive(self.bandwidth, "EulerianJKO.bandwidth"))
        check_bool(self.strict, "EulerianJKO.strict")
        if self.grid is not None and not isinstance(self.grid, (int, torch.Tensor)) or isinstance(self.grid, bool):
            raise TypeError(f"EulerianJKO.grid must be a tensor (m, d) on the sphere or a number of points, got "
                            f"{type(self.grid).__name__}")

