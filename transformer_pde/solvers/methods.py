"""The base class of the solver objects of :func:`transformer_pde.solve`, and the JKO's transport terms and
inner optimiser.

A solver object carries its own settings and runs itself: ``solver.run(model, x0, options)``, the loop of
:mod:`transformer_pde.solvers.loop` over ``solver.init(model, x0, options)`` (a started run) and
``solver.step(state, t, dt)`` (one step).  The
built-in ones: fixed step (projected explicit Runge–Kutta with retraction, or the model's layer
map) ``Euler()``, ``Heun()``, ``RK4()`` or ``FixedStep(tableau)`` and adaptive ``Dopri5(rtol,
atol, adjoint)`` (:mod:`transformer_pde.solvers.particle`); sharded ``ShardedEuler(group, backend,
gather_x)``, the projected Euler step with the tokens sharded over the ranks of a
``torch.distributed`` process group (:mod:`transformer_pde.solvers.sharded`); minimizing movement
``LagrangianJKO(transport, inner)`` with a transport object (``EMD()``, ``Sinkhorn(eps)``,
``Identity()``, below) and an inner optimiser (``RiemannianLBFGS()``, below), and ``EulerianJKO(grid)``
(:mod:`transformer_pde.solvers.jko_methods`).

``Solver.accepts`` names the options objects of :func:`~transformer_pde.solve` the solver takes
("saveat", "ledger", "checkpoint", "progress", "limits"); the others are refused before any work.
``Solver.unsupported`` names, per accepted options object, the fields the solver does not implement:
they must stay at their defaults (TypeError naming the field otherwise, before any work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, FrozenSet, Mapping, Optional, Tuple

import torch

from ..utils.validation import check_choice, check_int, check_positive
from .loop import Run, drive

__all__ = ["Solver", "TransportTerm", "EMD", "Sinkhorn", "Identity", "RiemannianLBFGS"]

_ALL = frozenset({"saveat", "ledger", "checkpoint", "progress", "limits"})


class Solver:
    """Base class of the solver objects.  ``accepts``: the options objects it takes; ``unsupported``:
    per options object, the fields it does not implement.

    The step protocol: ``init(model, x0, options)`` builds a :class:`~transformer_pde.solvers.loop.Run` (the
    solve's state between steps, started at t0 or resumed from a checkpoint), ``step(state, t, dt)`` makes one
    step and returns ``(new state, info)``; ``run(model, x0, options)`` is the one loop of
    :func:`~transformer_pde.solvers.loop.drive` over them (progress, callbacks, checkpoints) and returns a
    :class:`~transformer_pde.Trajectory`.  ``options`` is a :class:`~transformer_pde.SolveOptions` (the grid
    t0, t1, dt and ``steps``; paths, seed, generator; the options objects ``saveat``, ``ledger``,
    ``checkpoint`` (None unless given), ``progress``, ``limits``).  :func:`transformer_pde.solve` checks the
    options against ``accepts`` / ``unsupported``, fills in the defaults and calls ``run``.

    A particle solver subclasses :class:`~transformer_pde.solvers.particle.ParticleSolver`, whose ``init``
    builds the particle run (records, ledger, checkpoints and resume), and defines ``step`` only
    (docs/solve.md, "A solver of your own"; ARCHITECTURE.md, "Where to add")."""

    accepts: ClassVar[FrozenSet[str]] = _ALL
    #: options object -> its fields this solver does not implement (they must keep their defaults)
    unsupported: ClassVar[Mapping[str, Tuple[str, ...]]] = {}

    def init(self, model, x0: Optional[torch.Tensor], options) -> Run:
        """The solve's state at its first step: checked, resumed or evaluated at t0.

        Parameters
        ----------
        model : Model
            the dynamics.
        x0 : torch.Tensor or None
            the initial tokens.
        options : SolveOptions
            the grid, the random stream and the options objects.

        Returns
        -------
        Run
            the started run that :func:`~transformer_pde.solvers.loop.drive` steps.
        """
        raise NotImplementedError(f"{type(self).__name__} must define init(model, x0, options) (or run); a particle "
                                  f"solver subclasses transformer_pde.solvers.particle.ParticleSolver, which does")

    def step(self, state, t: float, dt: float) -> Tuple[Any, dict]:
        """One step from ``state`` at time t to t + dt.

        Parameters
        ----------
        state
            the solver's state at t (a particle solver: a :class:`~transformer_pde.solvers.loop.ParticleState`).
        t : float
            the time of the left end.
        dt : float
            the step.

        Returns
        -------
        tuple
            (the new state, info: a dict of what the run books, e.g. ``"noise"``, the token-noise increment).
        """
        raise NotImplementedError(f"{type(self).__name__} must define step(state, t, dt)")

    def run(self, model, x0: Optional[torch.Tensor], options) -> Any:
        """Solve ``model`` from ``x0`` with ``options``: the loop over :meth:`init`'s run.

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
        progress = getattr(options, "progress", None)
        return drive(self.init(model, x0, options), None if progress is None else progress.callback)


# ---------------------------------------------------------------------------- JKO
class TransportTerm:
    """The transport term W_b(μ, μ_k)² of a Lagrangian JKO step (base class of :class:`EMD`,
    :class:`Sinkhorn`, :class:`Identity`; :class:`~transformer_pde.LagrangianJKO` takes one)."""

    name: ClassVar[str] = ""


@dataclass(frozen=True)
class EMD(TransportTerm):
    """The exact plan (POT's emd); ``cost`` "source" (b_k(x)|x − y|²) or "symmetric"."""

    cost: str = "source"
    name: ClassVar[str] = "emd"

    def __post_init__(self):
        check_choice(self.cost, ("source", "symmetric"), "EMD.cost")


@dataclass(frozen=True)
class Sinkhorn(TransportTerm):
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
