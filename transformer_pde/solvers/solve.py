"""``tp.solve(model, x0, solver, t1=..., ...)``: the one entry point of every solver.

    traj = tp.solve(tp.Model(tp.OrnsteinUhlenbeck(heads)), x0, tp.Euler(), t1=20.0, dt=5e-3,
                    paths=10, seed=0, saveat=tp.SaveAt(record_every=5))

The model (:class:`~transformer_pde.Model`) says what moves the tokens; the solver object
(:mod:`transformer_pde.solvers.solver`) how it is discretised, with its own settings; the options
objects (:mod:`transformer_pde.solvers.options`) what is saved, how the ledger is kept, where to
checkpoint, how progress is shown and which limits hold.  An option the solver does not accept is
refused (TypeError) before any work.  The result is a :class:`~transformer_pde.Trajectory`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..dynamics.model import Model
from .solver import Solver
from .options import Checkpointing, LedgerOptions, Limits, Progress, SaveAt, SolveOptions
from .trajectory import Trajectory

__all__ = ["solve"]

_OPTION_TYPES = {"saveat": SaveAt, "ledger": LedgerOptions, "checkpoint": Checkpointing, "progress": Progress,
                 "limits": Limits}


def _check_options(solver: Solver, given: dict) -> dict:
    """The options objects, type-checked, with the defaults filled in; TypeError for one the solver
    does not accept."""
    out = {}
    for key, cls in _OPTION_TYPES.items():
        value = given[key]
        if value is None:
            out[key] = None if key == "checkpoint" else cls()
            continue
        if key == "progress" and isinstance(value, bool):
            value = Progress(show=value)
        if not isinstance(value, cls):
            raise TypeError(f"{key}= must be a {cls.__name__}, got {type(value).__name__}")
        if key not in solver.accepts:
            raise TypeError(f"{type(solver).__name__} does not take {key}= (it accepts "
                            f"{', '.join(sorted(solver.accepts))}); drop it or choose a solver that does")
        default = cls() if key != "checkpoint" else None
        for name in solver.unsupported.get(key, ()):
            if getattr(value, name) != getattr(default, name):
                raise TypeError(f"{type(solver).__name__} does not implement {cls.__name__}.{name} (got "
                                f"{getattr(value, name)!r}); leave it at its default {getattr(default, name)!r} "
                                f"or choose a solver that implements it")
        out[key] = value
    return out


def solve(model: Model, x0: Optional[torch.Tensor], solver: Solver, *, t1: float, dt: float, t0: float = 0.0,
          paths: Optional[int] = None, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
          saveat: Optional[SaveAt] = None, ledger: Optional[LedgerOptions] = None,
          checkpoint: Optional[Checkpointing] = None, progress=None, limits: Optional[Limits] = None):
    """Solve ``model`` from ``x0`` at time t0 to t1 with ``solver``.

    Parameters
    ----------
    model : Model
        the dynamics (weight process, normalisation, direction, layer norm, token noise, token weights,
        causality).
    x0 : torch.Tensor or None
        tokens (..., n, d) on the unit sphere (None only for an Eulerian JKO given grid weights).
    solver : Solver
        ``Euler()``, ``Heun()``, ``RK4()``, ``Dopri5(...)``, ``ShardedEuler(...)``, ``LagrangianJKO(...)``,
        ``EulerianJKO(...)``.
    t1, dt, t0
        final time, step (the fixed step; Dopri5: the weights' sampling grid; JKO: τ) and start.
    paths, seed, generator
        Monte-Carlo paths of the weights (a leading axis of the results) and their random stream
        (seed xor generator).
    saveat, ledger, checkpoint, progress, limits
        options objects (module docstring); ``progress`` may also be True / False.

    Returns
    -------
    Trajectory
        the type :func:`transformer_pde.simulate` and :func:`transformer_pde.jko` return.

    Raises
    ------
    TypeError, ValueError
        bad input or an option the solver does not take, before any work; TypeError naming the solver
        when its ``run`` returns something other than a Trajectory.
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must be a tp.Model, got {type(model).__name__}; build one with "
                        f"tp.Model(theta, normalization=..., direction=...)")
    if not isinstance(solver, Solver) or type(solver) is Solver:
        raise TypeError(f"solver must be a solver object (tp.Euler(), tp.Heun(), tp.RK4(), tp.Dopri5(), "
                        f"tp.ShardedEuler(), tp.LagrangianJKO(), tp.EulerianJKO()), got {type(solver).__name__}")
    o = _check_options(solver, dict(saveat=saveat, ledger=ledger, checkpoint=checkpoint, progress=progress,
                                    limits=limits))
    options = SolveOptions(t1=t1, dt=dt, t0=t0, paths=paths, seed=seed, generator=generator, **o)
    if type(solver).run is Solver.run and type(solver).init is Solver.init:
        raise TypeError(f"{type(solver).__name__} does not define run(model, x0, options); a Solver subclass must")
    traj = solver.run(_at_context(model, x0), x0, options)
    if not isinstance(traj, Trajectory):
        raise TypeError(f"{type(solver).__name__}.run returned {type(traj).__name__}, not a Trajectory: a solver's "
                        f"run(model, x0, options) must return the tp.Trajectory of its solve")
    return traj


def _at_context(model: Model, x0) -> Model:
    """The model with the heads' rules β_n of the context length resolved once, at n = x0.shape[-2]."""
    theta = model.process
    if theta.resolved:
        return model
    if x0 is None:
        raise ValueError("the heads' β is a rule of the context length n, which needs tokens x0 (..., n, d); a solve "
                         "without tokens (the Eulerian JKO on grid weights) has no n: give the heads a fixed β "
                         "(heads.at_context(n) resolves the rule at an n of your choice)")
    if not isinstance(x0, torch.Tensor) or x0.dim() < 2:
        return model  # the solver refuses x0 with its own message
    return dataclasses.replace(model, theta=theta.at_context(x0.shape[-2]), temperature=model.noise or 0.0)
