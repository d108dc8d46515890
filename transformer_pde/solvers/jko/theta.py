"""Θ_t at the times of a JKO solve (docs/model.md#jko): the heads read through the
:class:`~transformer_pde.processes.weights.WeightDriver` (as :func:`transformer_pde.simulate` reads them),
flattened to the run's batch axis, and the checks of their grid.

* a closed-form process (and constant heads) is read on the driver's grid of step τ;
* a noisy or Euler-scheme process is sampled on the grid of step ``path_dt`` (τ / path_dt whole) as the steps
  go, the driver storing the path (``traj.path``: the WeightPath that ``sample_path`` with the same seed gives);
* a stored :class:`~transformer_pde.WeightPath` is replayed, linearly interpolated between its grid values
  where τ (or t0) is off its grid (warned).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ...utils.validation import check_limits
from ...model.heads import Heads
from ...processes.driver import WeightDriver, path_bytes
from ...processes.paths import WeightPath
from ...processes.weights import Process
from ..options import Limits

__all__ = []  # the JKO solve's parts; users call tp.jko / tp.solve(..., tp.LagrangianJKO(...))
__internal__ = ["flatten_heads", "ThetaSource", "check_theta_grid"]


def flatten_heads(h: Heads, batch: tuple, B: int) -> Heads:
    """Heads broadcast to the batch shape and flattened to one batch axis of size B."""
    if len(h.batch_shape) == 0:
        return h

    def fl(t, tail):
        if t is None:
            return None
        t = t.expand(*batch, *t.shape[t.dim() - tail:])
        return t.reshape(B, *t.shape[len(batch):])

    beta = fl(h.beta, 0) if isinstance(h.beta, torch.Tensor) and h.beta.dim() > 0 else h.beta
    return h.replace(score=fl(h.score, 3), value=fl(h.value, 3), weights=fl(h.weights, 1), query=fl(h.query, 3),
                     key=fl(h.key, 3), beta=beta, symmetric=h.known_symmetric)


class ThetaSource:
    """Θ_t at the JKO times t_k = t0 + kτ, read through :class:`~transformer_pde.processes.weights.WeightDriver`, the
    driver :func:`transformer_pde.simulate` reads it with.

    A closed-form process (and constant heads) is read on the driver's grid of step τ; a noisy or Euler-scheme
    process is sampled on the grid of step ``path_dt`` (τ / path_dt whole) as the steps go, the driver storing
    the path (``traj.path``: the WeightPath that ``sample_path`` with the same seed gives); a stored WeightPath is
    replayed, linearly interpolated between its grid values where τ (or t0) is off its grid."""

    def __init__(self, theta: Process, *, t0, tau, paths, seed, generator, path_dt, batch_rank):
        self.t0, self.tau = t0, tau
        self.given = theta if isinstance(theta, WeightPath) else None
        self.sampled = self.given is None and not theta.closed_form
        if self.given is not None:
            self.origin, self.dt, self.last = float(theta.times[0]), theta.dt, len(theta.times) - 1
            self.drv = WeightDriver(theta, paths=None, generator=None, seed=0, t0=self.origin, dt=theta.dt)
        else:
            dt = path_dt if self.sampled and path_dt is not None else tau
            self.ratio = round(tau / dt)
            self.drv = WeightDriver(theta, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt,
                                    store=self.sampled, batch_rank=batch_rank)

    def heads(self, k: int) -> Heads:
        """Θ at t_k (k = 0, 1, ... in increasing order: the driver only moves forward)."""
        if self.given is None:
            while self.drv.k < k * self.ratio:
                self.drv.advance()
            return self.drv.current
        u = (self.t0 + k * self.tau - self.origin) / self.dt  # WeightPath.heads_at's reading of its grid
        j = min(max(int(math.floor(u + 1e-9)), 0), self.last)
        frac = u - j
        while self.drv.k < j:
            self.drv.advance()
        if j == self.last or abs(frac) < 1e-9:
            return self.drv.current
        return self.drv.stage(frac)

    def path(self) -> Optional[WeightPath]:
        """The weight path the run saw: the stored one, the sampled one, or None (closed form)."""
        if self.given is not None:
            return self.given
        return self.drv.path() if self.sampled else None


def check_theta_grid(theta: Process, *, t0: float, tau: float, steps: int, paths: Optional[int],
                     path_dt: Optional[float], limits: Limits) -> None:
    """The checks of Θ_t's grid for a JKO solve of ``steps`` steps τ from t0, before any work (theta and path_dt
    already checked): a stored path covers the run (warned when τ or t0 is off its grid; paths refused next to
    it); a sampled process' path_dt divides τ and its stored path fits the limits."""
    t_end = t0 + steps * tau
    if isinstance(theta, WeightPath):
        if paths is not None:
            raise ValueError("a stored WeightPath already carries its paths axis; call jko without paths=")
        theta.check_covers(t0, t_end)
        if theta.dt > 0:
            ratio, offset = tau / theta.dt, (t0 - float(theta.times[0])) / theta.dt
            if abs(ratio - round(ratio)) > 1e-6 * max(1.0, ratio) or abs(offset - round(offset)) > 1e-6:
                warnings.warn(
                    f"tau = {tau:.6g} (or t0) is not a multiple of the weight path's dt = {theta.dt:.6g}: the JKO "
                    f"steps see the path linearly interpolated between its grid values", stacklevel=6)
    elif not theta.closed_form:
        dt = tau if path_dt is None else path_dt
        ratio = tau / dt
        if abs(ratio - round(ratio)) > 1e-9 * max(1.0, ratio) or round(ratio) < 1:
            raise ValueError(f"path_dt = {dt:.6g} must divide tau = {tau:.6g} (tau / path_dt = {ratio:.6g} is not a "
                             f"whole number); choose path_dt = tau / k")
        K = steps * round(ratio)  # the limits of sample_path on the same grid
        check_limits(f"sample_path on [{t0:.6g}, {t_end:.6g}] with dt = {dt:.6g}", steps=K,
                     memory={"the stored path": path_bytes(theta.heads0, K, paths, theta.noisy)},
                     max_steps=limits.max_steps, max_memory=limits.max_memory, device=theta.heads0.device,
                     fix="use fewer paths or a larger dt")
