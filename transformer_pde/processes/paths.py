"""A realised weight path Θ on a time grid, stored for bit-for-bit replay by every solver (docs/model.md#processes).

:func:`transformer_pde.processes.driver.sample_path` samples one from any process; the solvers take it as ``theta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..model.heads import Heads
from ..utils.validation import check_horizon
from .weights import Process

__all__ = ["WeightPath"]



@dataclass
class WeightPath(Process):
    """A realised weight path on a time grid, replayable bit for bit by the solvers.

    times: (K+1,) grid; scores: (K+1, ..., H, d, d); rates: (K+1, ...) the drift used by the
    ledger at each grid point; noise: (K, ...) martingale increments (or None); sigma: the
    noise amplitude per grid point (list) for the Itô correction; template: Heads giving values
    (when not tied), head weights and β; points: None, or one Heads per grid point (K+1) whose values,
    head weights and β replace the template's at that point (a process whose values, head weights or β
    change along the grid, e.g. :class:`~transformer_pde.processes.weights.Layerwise` heads of a real
    network; the scores are always ``scores``).
    """

    times: torch.Tensor
    scores: torch.Tensor
    rates: torch.Tensor
    noise: Optional[torch.Tensor]
    sigmas: Sequence
    template: Heads
    points: Optional[Sequence[Heads]] = None

    def __post_init__(self):
        if self.points is not None and len(self.points) != len(self.times):
            raise ValueError(f"WeightPath.points must hold one Heads per grid point ({len(self.times)}), got "
                             f"{len(self.points)}")
        self.heads0 = self.at_point(0, self.scores[0])
        self.scheme = "euler"

    @property
    def noisy(self):
        return self.noise is not None

    @property
    def dt(self) -> float:
        return float(self.times[1] - self.times[0]) if len(self.times) > 1 else 0.0

    def index(self, t: float, dt: float) -> int:
        k = (t - float(self.times[0])) / dt
        return int(round(k))

    def heads_at(self, t: float) -> Heads:
        """Θ at time t: the stored value on a grid point, linear interpolation between."""
        t0, h = float(self.times[0]), self.dt
        K = len(self.times) - 1
        u = 0.0 if h == 0 else (t - t0) / h
        k = min(max(int(math.floor(u + 1e-9)), 0), K)
        frac = u - k
        if k == K or abs(frac) < 1e-9:
            A = self.scores[k]
        else:
            A = self.scores[k] + frac * (self.scores[k + 1] - self.scores[k])
        return self.at_point(k, A)

    def at_point(self, k: int, score: torch.Tensor) -> Heads:
        """The heads with scores ``score`` and the values, head weights and β of grid point k (of the
        template when the path stores none per point; between grid points those of the left one)."""
        tmpl = self.template if self.points is None else self.points[min(max(int(k), 0), len(self.points) - 1)]
        return tmpl.with_score(score, symmetric=tmpl.known_symmetric)

    def drift(self, score, t):  # pragma: no cover - replay uses stored rates
        raise TypeError("a WeightPath is replayed from its stored values")

    @property
    def horizon(self) -> float:
        """The last time of the stored grid."""
        return float(self.times[-1])

    def check_covers(self, t0: float, t1: float) -> None:
        """Raise ValueError (naming the horizon and the requested t1) unless [t0, t1] lies in the stored grid.

        The solvers call it before any work; replaying past the horizon would otherwise index past
        the stored scores."""
        check_horizon(self.times, t0, t1, "the stored weight path",
                      "sample the process again with tp.sample_path(process, t1=..., dt=...) up to the t1 you need, "
                      "or stop the run at the horizon")

