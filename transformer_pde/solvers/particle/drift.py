"""A token-wise drift added to the attention field: projected Euler of

    ẋ_i = V[μ_t, Θ_t](x_i) + P_{x_i} b(t, x_i),   x_i ∈ S^{d-1}

with b a user's vector field (e.g. a network's feed-forward read on the sphere,
:mod:`transformer_pde.analysis.pretrained_drift`).  :class:`DriftEuler` defines ``step`` only
(:class:`~transformer_pde.solvers.particle.methods.ParticleSolver`); the loop gives it progress, callbacks,
checkpoints and resume, records and the diagnostics.  The energy–dissipation ledger accounts for the attention
field only: the drift's work on the energy shows in its residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...model.sphere import tangent_projection
from .methods import ParticleSolver

__all__ = ["DriftEuler"]


@dataclass(frozen=True, eq=False)
class DriftEuler(ParticleSolver):
    """Projected Euler with a token-wise drift: x ← R(x + dt·(V(x) + P_x b(t, x))), R the retraction x/|x|.

    ``drift(t, x)`` reads the left end t of the step (a float) and the tokens x (paths, ..., n, d) on the unit
    sphere and returns a vector field of the same shape (its normal part is dropped by P_x); it is evaluated
    once per step, in x's dtype and device.  With ``drift`` ≡ 0 the step is :class:`~transformer_pde.Euler`'s.
    Order 1.  The projected geometry only (``layer_norm="none"``); token noise, when the model has it, is
    added after the step as :class:`~transformer_pde.Euler` does (projected Euler–Maruyama).

    Parameters
    ----------
    drift : callable
        ``drift(t, x) -> tensor`` of x's shape.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> W = torch.tensor([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    >>> x0 = torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64)
    >>> model = tp.Model(tp.Heads.scalar([0.0], 3).to(torch.float64))
    >>> traj = tp.solve(model, x0, tp.DriftEuler(lambda t, x: x @ W.T), t1=1.0, dt=1e-3)
    >>> round(float(traj.x[-1, 0, 0, 1]), 2)  # rotated by ~1 rad: sin 1 = 0.84
    0.84
    """

    drift: Callable[[float, torch.Tensor], torch.Tensor]
    order = 1
    stages = 1

    def __post_init__(self):
        if not callable(self.drift):
            raise TypeError(f"DriftEuler.drift must be a callable drift(t, x) -> tensor of x's shape (..., n, d), got "
                            f"{type(self.drift).__name__}")

    @property
    def method(self) -> str:
        """``Trajectory.method``: "drift_euler"."""
        return "drift_euler"

    def init(self, model, x0, options):
        """As :meth:`ParticleSolver.init`, after refusing a geometry other than the projected flow.

        Parameters
        ----------
        model : Model
            the dynamics (``layer_norm="none"``).
        x0 : torch.Tensor
            the initial tokens (..., n, d).
        options : SolveOptions
            the grid, the random stream and the options objects.

        Returns
        -------
        FixedStepRun
            the started run.

        Raises
        ------
        ValueError
            a layer-map geometry (post-, pre-, peri-LN, nGPT).
        """
        geometry = getattr(model, "layer_norm", None)
        if geometry is not None and not getattr(geometry, "projected", True):
            raise ValueError(f"DriftEuler integrates the projected flow on the sphere (layer_norm='none'), got "
                             f"layer_norm={getattr(geometry, 'name', geometry)!r}; a drift inside a layer map is not "
                             f"defined here")
        return super().init(model, x0, options)

    def step(self, state, t: float, dt: float):
        """One projected Euler step of the attention field plus the drift's tangent part at the left end t.

        Parameters
        ----------
        state : ParticleState
            the tokens and the field at t, the geometry, the token noise.
        t : float
            the left end.
        dt : float
            the step.

        Returns
        -------
        tuple
            (the new tokens, {"sphere_error", and "noise": the token-noise increment when there is one}).

        Raises
        ------
        ValueError
            the drift returns something that is not a tensor of x's shape.
        """
        x = state.x
        b = self.drift(t, x)
        if not isinstance(b, torch.Tensor) or b.shape != x.shape:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"DriftEuler.drift(t, x) must return a tensor of x's shape {tuple(x.shape)} (paths, ..., "
                             f"n, d), got {got}; make the drift act token-wise on the last axis")
        b = b.to(dtype=x.dtype, device=x.device)
        x_new, err = state.geometry.retract_step(x + dt * (state.velocity + tangent_projection(x, b)))
        info = {"sphere_error": err}
        if state.noise is not None:
            info["noise"] = xi = state.noise.increment(x_new, dt, state.generator)
            x_new = state.noise.apply(x_new, xi)
        return x_new, info
