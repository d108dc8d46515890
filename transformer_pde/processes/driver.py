"""The Θ_t driver of every solver: Θ moved along the grid t_k = t0 + k·dt, and ``sample_path``.

:class:`WeightDriver` gives the solvers the heads at a stage, dA/dt and σ for the ledger, the noise
increment, and ``sample_path(K)`` (a :class:`~transformer_pde.processes.paths.WeightPath`) for the solvers
that need Θ off the grid; :func:`grid_steps`, :func:`path_bytes` and :func:`lift_paths` are the grid and
resource helpers the solvers share.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..model.heads import Heads
from ..utils.validation import check_int, check_limits, check_positive, check_real, check_seed_generator
from .paths import WeightPath
from .weights import Process

#: named internal API (not public), used by the solvers' resource guards
__internal__ = ["path_bytes", "grid_steps", "WeightDriver", "lift_paths"]

__all__ = ["sample_path"]


def sample_path(process: Process, *, t1: float, dt: float, t0: float = 0.0, paths: Optional[int] = None,
                seed: Optional[int] = None, generator=None, max_steps: Optional[int] = None,
                max_memory: Optional[float] = None) -> WeightPath:
    """Sample a process on the grid t0, t0 + dt, ..., t1 and store it for replay.

    The same path can then be given to :func:`simulate` (same dt) and to :func:`jko`
    (any τ that is a multiple of dt, or linear interpolation in between).

    seed / generator: the random stream (seed None means 0; giving both is refused).
    max_steps / max_memory: limits checked before anything is sampled (defaults: 10⁷ steps, 3/4
    of the machine's memory): the path holds (K+1) × paths × H × d² scores, rates and noise.
    """

    if not isinstance(process, Process):
        raise TypeError(f"process must be a transformer_pde Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom, "
                        f"Constant), got {type(process).__name__}")
    if isinstance(process, WeightPath):
        raise TypeError("process is already a sampled WeightPath: replay it directly (simulate / jko take it as theta)")
    t1 = check_real(t1, "t1")
    t0 = check_real(t0, "t0")
    dt = check_positive(dt, "dt")
    if paths is not None:
        paths = check_int(paths, "paths")
    seed = check_seed_generator(seed, generator)
    K = grid_steps(t0, t1, dt)
    check_limits(f"sample_path on [{t0:.6g}, {t1:.6g}] with dt = {dt:.6g}", steps=K,
                 memory={"the stored path": path_bytes(process.heads0, K, paths, process.noisy)},
                 max_steps=max_steps, max_memory=max_memory, device=process.heads0.device,
                 fix="use fewer paths or a larger dt")
    return WeightDriver(process, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt).sample_path(K)


def path_bytes(heads0: Heads, K: int, paths: Optional[int], noisy: bool, batch: int = 1) -> float:
    """Estimated bytes of a stored weight path of K steps: the scores and rates at K + 1 grid points and
    the K noise increments, (paths ×) batch × H × d × d each."""
    A = heads0.score_matrix
    per = float(A.numel()) * A.element_size() * (paths or 1) * batch
    return per * ((K + 1) * 2 + (K if noisy else 0))


# ---------------------------------------------------------------------------- weights driver
def grid_steps(t0: float, t1: float, dt: float) -> int:
    """The number K of steps dt from t0 to t1; ValueError unless t1 > t0 and (t1 − t0)/dt is whole."""
    span = t1 - t0
    if not span > 0:
        raise ValueError(f"t1 must be larger than t0 (got t0 = {t0}, t1 = {t1})")
    K = round(span / dt)
    if K < 1 or abs(K * dt - span) > 1e-9 * max(1.0, abs(span)):
        raise ValueError(
            f"(t1 - t0) / dt = {span / dt:.6g} is not a whole number of steps; choose dt = {span / max(K, 1):.6g} "
            f"or another dt that divides t1 - t0"
        )
    return K


def lift_paths(score: torch.Tensor, paths: Optional[int], batch_rank: int, n_head_dims: int = 3) -> torch.Tensor:
    """Prepend singleton dims so the heads' batch rank matches the tokens', then a paths axis."""
    if paths is None:
        return score
    extra = batch_rank - (score.dim() - n_head_dims)
    if extra > 0:
        score = score.reshape((1,) * extra + tuple(score.shape))
    return score.unsqueeze(0).expand(paths, *score.shape).clone()


def _varying(points: List[Heads], template: Heads) -> Optional[List[Heads]]:
    """``points`` when the values, head weights or β of any of them differ from the template's (a closed-form
    process such as Layerwise), else None (the template alone replays the path)."""
    def same(a, b):
        if a is b:
            return True
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.shape == b.shape and bool(torch.equal(a, b))
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b

    for h in points:
        if h.tied != template.tied or not (same(h.weights, template.weights) and same(h.beta, template.beta)):
            return points
        if not h.tied and not (same(h.value_in, template.value_in) and same(h.value_out, template.value_out)
                               and same(h.value_matrix, template.value_matrix)):
            return points
    return None


class WeightDriver:
    """Moves Θ along a solver's time grid t_k = t0 + k·dt: closed form, grid sampling, or replay of a
    WeightPath.  Shared by every solver (simulate, simulate_sharded, sample_path); the solver asks for
    the heads at stage c ∈ [0, 1] of the current step (:meth:`stage`), the rate dA/dt and σ at t_k for
    the ledger, the noise increment (:meth:`prepare`) and moves on (:meth:`advance`)."""

    def __init__(self, process: Process, *, paths, generator, seed, t0, dt, store=False, batch_rank=None, device=None):
        self.p = process
        self.t0, self.dt, self.k = float(t0), float(dt), 0
        h0 = process.heads0
        self.batch_rank = len(h0.batch_shape) if batch_rank is None else batch_rank
        if generator is None:
            generator = torch.Generator(device=h0.device)
            generator.manual_seed(int(seed))
        self.gen = generator
        self.replay = isinstance(process, WeightPath)
        self.mode = "replay" if self.replay else ("closed" if process.closed_form else "stepped")
        self.store = store
        self._scores: List[torch.Tensor] = []
        self._rates: List[torch.Tensor] = []
        self._noise: List[torch.Tensor] = []
        self._sigmas: List = []
        self._points: List[Heads] = []
        if self.replay:
            if abs(process.dt - dt) > 1e-12 * max(1.0, dt) or abs(float(process.times[0]) - t0) > 1e-12:
                raise ValueError(
                    f"the stored weight path has t0 = {float(process.times[0])}, dt = {process.dt}; "
                    f"replay it with the same t0 and dt (got t0 = {t0}, dt = {dt})"
                )
            self.A = process.scores[0]
        elif self.mode == "stepped":
            self.A = lift_paths(h0.score_matrix, paths, self.batch_rank)
        else:
            self.A = None
        self._next = None
        self._cur_heads = self._heads(0.0)
        self._record_current()

    @property
    def t(self) -> float:
        return self.t0 + self.k * self.dt

    def _heads(self, c: float) -> Heads:
        if self.mode == "closed":
            if c > 0.0:  # stages inside (t_k, t_{k+1}]: left limits
                return self.p.left_heads_at(self.t + c * self.dt)
            return self.p.heads_at(self.t + c * self.dt)
        if c == 0.0:
            A = self.A
        else:
            A = self.A + c * (self._next[0] - self.A)
        if self.replay:  # the values, head weights and β of the step's left grid point
            return self.p.at_point(self.k, A)
        return self.p.heads0.with_score(A, symmetric=self.p.heads0.known_symmetric)

    @property
    def current(self) -> Heads:
        return self._cur_heads

    @property
    def rate_is_zero(self) -> bool:
        """True when dA/dt is 0 at every grid point (a closed-form, piecewise-constant process: its jumps are
        booked apart), so the ledger's ∂_tE is 0 without forming the rate."""
        return self.mode == "closed" and self.p.piecewise_constant

    @property
    def rate(self) -> torch.Tensor:
        """dA/dt used by the ledger at the current grid point."""
        if self.mode == "replay":
            return self.p.rates[self.k]
        if self.mode == "closed":
            return self.p.score_rate(self.t)
        return self.p.drift(self.A, self.t)

    @property
    def sigma(self):
        if self.mode == "replay":
            return self.p.sigmas[self.k]
        return self.p.sigma(self.t) if self.p.noisy else 0.0

    @property
    def noisy(self) -> bool:
        return self.p.noisy

    def prepare(self):
        """Sample (or read) the weights of the next grid point; returns the noise increment."""
        if self.mode == "closed" or self._next is not None:
            return None if self._next is None else self._next[1]
        if self.mode == "replay":
            noise = None if self.p.noise is None else self.p.noise[self.k]
            self._next = (self.p.scores[self.k + 1], noise)
        else:
            self._next = self.p.step(self.A, self.t, self.dt, self.gen)
        return self._next[1]

    def stage(self, c: float) -> Heads:
        if c == 0.0:
            return self._cur_heads
        self.prepare()
        return self._heads(c)

    def jumps(self) -> List[float]:
        return [] if self.mode != "closed" else self.p.jumps(self.t, self.t + self.dt)

    def left_limit(self):
        """(Θ(t_k−), Ȧ(t_k−)) when Θ or Ȧ is discontinuous at the current grid point, else None: the
        trapezoid rule of the step that ends here takes its right end point from the left limits."""
        if self.mode != "closed" or not any(abs(tj - self.t) <= 1e-9 * self.dt for tj in self.p.knots(
                self.t - self.dt, self.t)):
            return None
        return self.p.left_heads_at(self.t), self.p.left_score_rate(self.t)

    def advance(self):
        noise = self.prepare()
        if self.store and self.mode != "closed":
            self._noise.append(noise)
        if self.mode != "closed":
            self.A = self._next[0]
        self._next = None
        self.k += 1
        self._cur_heads = self._heads(0.0)
        self._record_current()

    def sample_path(self, K: int) -> WeightPath:
        """Sample (or read) the next K grid steps at once and return them, from the current point, as a
        WeightPath (for solvers that need Θ off the grid: "adaptive", JKO)."""
        self.store = True
        self._scores, self._rates, self._sigmas, self._noise, self._points = [], [], [], [], []
        self._record_current()
        for _ in range(K):
            self.advance()
        return self.path()

    def _record_current(self):
        if self.store:
            if self.mode == "closed":  # the values, head weights and β may change along the grid (Layerwise)
                self._points.append(self._cur_heads)
            self._scores.append(self._cur_heads.score_matrix)
            self._rates.append(self.rate)
            self._sigmas.append(self.sigma)

    def path(self) -> WeightPath:
        times = self.t0 + self.dt * torch.arange(self.k + 1, dtype=torch.float64)
        noise = None
        if self.p.noisy and self._noise:
            noise = torch.stack(self._noise)
        tmpl = self.p.template if self.replay else self.p.heads0
        points = self.p.points if self.replay else _varying(self._points, tmpl)
        return WeightPath(times, torch.stack(self._scores), torch.stack(self._rates), noise, list(self._sigmas), tmpl,
                          points)

    # checkpoint support
    def state(self):
        return {"k": self.k, "A": self.A, "gen": self.gen.get_state()}

    def load_state(self, st):
        self.k = st["k"]
        self.A = st["A"]
        self.gen.set_state(st["gen"])
        self._next = None
        self._cur_heads = self._heads(0.0)
