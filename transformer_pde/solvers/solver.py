"""The base class of the solver objects of :func:`transformer_pde.solve`.

A solver object carries its own settings and runs itself: ``solver.run(model, x0, options)``, the loop of
:mod:`transformer_pde.solvers.loop` over ``solver.init(model, x0, options)`` (a started run) and
``solver.step(state, t, dt)`` (one step).  The
built-in ones: fixed step (projected explicit Runge–Kutta with retraction, or the model's layer
map) ``Euler()``, ``Heun()``, ``RK4()`` or ``FixedStep(tableau)`` and adaptive ``Dopri5(rtol,
atol, adjoint)`` (:mod:`transformer_pde.solvers.particle.methods`); sharded ``ShardedEuler(group, backend,
gather_x)``, the projected Euler step with the tokens sharded over the ranks of a
``torch.distributed`` process group (:mod:`transformer_pde.solvers.particle.sharded`); minimizing movement
``LagrangianJKO(transport, inner)`` with a transport object (``EMD()``, ``SinkhornTransport(eps)``,
``Identity()``) and an inner optimiser (``RiemannianLBFGS()``) of :mod:`transformer_pde.solvers.jko.transport`,
and ``EulerianJKO(grid)`` (:mod:`transformer_pde.solvers.jko.methods`).

``Solver.accepts`` names the options objects of :func:`~transformer_pde.solve` the solver takes
("saveat", "ledger", "checkpoint", "progress", "limits"); the others are refused before any work.
``Solver.unsupported`` names, per accepted options object, the fields the solver does not implement:
they must stay at their defaults (TypeError naming the field otherwise, before any work).
"""

from __future__ import annotations

from typing import Any, ClassVar, FrozenSet, Mapping, Optional, Tuple

import torch

from .loop import Run, drive

__all__ = ["Solver"]

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

    A particle solver subclasses :class:`~transformer_pde.solvers.particle.methods.ParticleSolver`, whose ``init``
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
                                  f"solver subclasses transformer_pde.solvers.particle.methods.ParticleSolver, which does")

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
