"""The run loop of every stepping solver: one loop for progress, callbacks, checkpoints and the thread policy.

A solver (:class:`~transformer_pde.solvers.solver.Solver`) answers two calls: ``init(model, x0, options)``
builds a :class:`Run` (the state of a solve between steps: resumed from a checkpoint or evaluated at t0, its
records, ledger and statistics), and ``step(state, t, dt)`` makes one numerical step.  :func:`drive` steps a
run from its current step (0, or the resumed one) to the last: after every step it calls
``callback(k, t, x)``, advances the progress bar, follows the thread policy and saves a checkpoint when one is
due; at the end it returns ``run.finish()``, the :class:`~transformer_pde.Trajectory`.  ``Solver.run`` is this
loop: ``drive(solver.init(model, x0, options), options.progress.callback)``.

The runs: :class:`~transformer_pde.solvers.particle.fixed_step.FixedStepRun` (every particle solver, built-in or a
user's: the Runge–Kutta steps of ``FixedStep`` and a user's ``step`` get the same records, ledger,
checkpoints and resume), the sharded run (:mod:`~transformer_pde.solvers.particle.sharded`) and the JKO run
(:mod:`~transformer_pde.solvers.jko.run`).  The loop has a fixed grid: ``Dopri5`` keeps torchdiffeq's own
loop (its docstring says why).

:class:`ParticleState` is what a particle solver's ``step`` reads: the tokens, the field at the left end and
at the stages, the geometry, the token noise and its random stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from ..utils import threads
from .parts import progress_bar

__all__ = ["Run", "ParticleState", "drive"]


class Run:
    """The state of one solve between steps, driven by :func:`drive` (base class of the runs).

    A run sets ``steps`` (the number of steps K), ``k`` (the steps done: 0, or the resumed step), ``desc``
    (the progress bar's label), ``show`` (whether to show the bar), ``work`` (the thread policy's measure of
    one step, or None for no thread scope) and ``checkpointer`` (a
    :class:`~transformer_pde.solvers.parts.Checkpointer`, or None), and defines :meth:`step`, :attr:`t`,
    :meth:`view`, :meth:`finish` and, with a checkpointer, :meth:`state`."""

    steps: int = 0
    k: int = 0
    desc: str = "solve"
    show: bool = False
    work: Optional[float] = None
    checkpointer: Optional[Any] = None

    @property
    def t(self) -> float:
        """The time of the current step."""
        raise NotImplementedError(f"{type(self).__name__} must define t")

    def step(self) -> None:
        """One step k → k + 1 (the solver's ``step`` and the run's bookkeeping)."""
        raise NotImplementedError(f"{type(self).__name__} must define step()")

    def view(self) -> torch.Tensor:
        """The state as the callback sees it (the caller's batch convention)."""
        raise NotImplementedError(f"{type(self).__name__} must define view()")

    def state(self) -> dict:
        """The run's state for a checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoints")

    def finish(self) -> Any:
        """The result (a :class:`~transformer_pde.Trajectory`) once the last step is done."""
        raise NotImplementedError(f"{type(self).__name__} must define finish()")


class ParticleState:
    """What a particle solver's ``step(state, t, dt)`` reads at the left end t of a step.

    x : torch.Tensor
        the tokens (paths, ..., n, d) (the paths axis is always there).
    velocity : torch.Tensor
        the field V[μ_t, Θ_t](x), evaluated once per grid point by the run.  The run may hand over a
        zero-argument callable instead; it is called when ``velocity`` is first read (a layer map reads
        ``ambient`` only, and never pays for the projection).
    field : callable
        ``field(x_stage, c)``: the field at the tokens ``x_stage`` and the weights at t + c·dt (one evaluation,
        counted in ``stats["field_evaluations"]``).
    geometry : LayerNorm
        the model's geometry: ``geometry.retract`` for the projected flow, ``geometry.step`` for a layer map.
    noise : TokenNoise or None
        the model's token noise; its increments are drawn from ``generator``.
    generator : torch.Generator or None
        the token noise's own random stream (saved in checkpoints).
    radius : torch.Tensor or None
        the token radii of a layer map that keeps them.
    ambient : torch.Tensor or None
        the un-projected attention update at x (a layer map's input).
    scratch : callable or None
        ``scratch()``: a tensor shaped like x that nothing else uses, which the step may write its new tokens
        into (memory of earlier states the run has let go of: no fresh pages per step); None: allocate.
    """

    __slots__ = ("x", "_velocity", "field", "geometry", "noise", "generator", "radius", "ambient", "scratch")

    def __init__(self, x: torch.Tensor, velocity, field: Optional[Callable], geometry: Any, noise: Any = None,
                 generator: Optional[torch.Generator] = None, radius: Optional[torch.Tensor] = None,
                 ambient: Optional[torch.Tensor] = None, scratch: Optional[Callable[[], torch.Tensor]] = None):
        self.x, self._velocity, self.field, self.geometry = x, velocity, field, geometry
        self.noise, self.generator, self.radius, self.ambient = noise, generator, radius, ambient
        self.scratch = scratch

    @property
    def velocity(self) -> torch.Tensor:
        """V[μ_t, Θ_t](x) (..., n, d), computed on first read when the run handed over a callable."""
        if callable(self._velocity):
            self._velocity = self._velocity()
        return self._velocity

    def __repr__(self) -> str:
        return f"ParticleState(x={tuple(self.x.shape)}, geometry={self.geometry!r})"


def drive(run: Run, callback: Optional[Callable] = None):
    """Step ``run`` to its last step and return ``run.finish()``.

    Parameters
    ----------
    run : Run
        a started run (at step 0, or at the step of the checkpoint it resumed).
    callback : callable or None
        ``callback(k, t, x)`` after every step (x: :meth:`Run.view`).

    Returns
    -------
    Trajectory
        ``run.finish()``.
    """
    scope = threads.scope(run.work) if run.work is not None else contextlib.nullcontext(None)
    ckpt = run.checkpointer
    with progress_bar(run.show, run.steps, run.desc, initial=run.k) as bar, scope as pool:
        while run.k < run.steps:
            run.step()
            if callback is not None:
                callback(run.k, run.t, run.view())
            bar.update(1)
            if pool is not None:
                pool.refresh()
            if ckpt is not None:
                ckpt.after_step(run.k, run.state)
    return run.finish()
