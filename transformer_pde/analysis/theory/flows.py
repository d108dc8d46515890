"""The flat (unprojected) flow and clustering hitting times of the particle system (docs/model.md#theory).

:func:`flat_flow` integrates ẋ_i = s Σ_h ω_h f_h(x_i) in R^d with the solvers' own stepper (``Stepper`` with
``retract=False``), recorder and loop (:func:`~transformer_pde.solvers.loop.drive`; it has no model or sphere,
so it is a small run of its own, not a solver); :func:`clustering_hitting_time` runs the library's solver until the mean
overlap reaches a target.  The notation is that of :mod:`.particles`; re-exported by
:mod:`transformer_pde.analysis.diagnostics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_choice, check_int, check_positive, direction_sign
from ...model.softmax import softmax_statistics
from ...model.field import head_token_mean, token_mean
from ...model.heads import Heads
from ...model.normalization import choose as choose_normalization
from ...processes.driver import grid_steps
from ...solvers.particle.methods import FixedStep
from ...dynamics.model import Model
from ...solvers.loop import Run, drive
from ...solvers.options import LedgerOptions, Progress, SaveAt
from ...solvers.parts import Recorder, Stepper
from ...solvers.solve import solve
from ...solvers.tableaux import TABLEAUX
from ...solvers.trajectory import NonFiniteError
from ..clustering import mean_overlap
from .particles import OUTPUT_NORMALIZATIONS, beta_factor, check_any, head_outputs_of

__all__ = ["FlatTrajectory", "flat_flow", "clustering_hitting_time"]


@dataclass
class FlatTrajectory:
    """Result of :func:`flat_flow`.

    times (T,), x (T, ..., n, d) (off the sphere), energy (T, ...) E = Σ_h ω_h E_h,
    head_energies (T, ..., H), kinetic (T, ...) Σ_i w_i ‖ẋ_i‖², norms (T, ...) max_i ‖x_i‖.
    """

    times: torch.Tensor
    x: torch.Tensor
    energy: torch.Tensor
    head_energies: torch.Tensor
    kinetic: torch.Tensor
    norms: torch.Tensor
    method: str


def flat_flow(x0, heads: Heads, *, t1: float, dt: float, weights=None, normalization: str = "unnormalized",
              direction: str = DEFAULT_DIRECTION, method: str = "rk4", record_every: int = 1) -> FlatTrajectory:
    """Integrate the flat (unprojected) dynamics ẋ_i = s Σ_h ω_h f_h(x_i) in R^d from x0 (..., n, d).

    Explicit Runge–Kutta (``tp.TABLEAUX``: "euler", "heun", "rk4") without retraction; heads
    constant.  The scores grow like β‖A‖‖x‖², so flat runs blow up in finite time: keep t1 short.

    Returns
    -------
    FlatTrajectory
        :class:`FlatTrajectory`.

    Raises
    ------
    TypeError, ValueError
        for bad input; ``tp.NonFiniteError`` with the time, step and quantity
        when the tokens or energies overflow.
    """
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    s = direction_sign(direction)
    check_choice(method, tuple(TABLEAUX), "method")
    check_any(x0, heads, weights, on_sphere=False)
    dt = check_positive(dt, "dt")
    record_every = check_int(record_every, "record_every")
    K = grid_steps(0.0, float(t1), dt)
    omega = heads.weights[..., None, None]

    def field(x):
        return s * (omega * head_outputs_of(x, heads, weights, normalization)).sum(-3)

    def energies(x):
        lse = softmax_statistics(x, heads, weights).log_partition
        return head_token_mean(torch.exp(lse), weights) / (2 * beta_factor(heads, 1))

    run = _FlatRun(x0, dt, K, field, TABLEAUX[method])
    rec = Recorder(K, record_every, diagnostics=False, weights=weights, observables={
        "head_energies": lambda xk, w: energies(xk),
        "kinetic": lambda xk, w: token_mean(run.v.square().sum(-1), w),
        "norms": lambda xk, w: xk.norm(dim=-1).amax(-1)})
    times, xs, obs = drive(run.start(rec))
    H = obs["head_energies"]
    E = (heads.weights * H).sum(-1)
    return FlatTrajectory(times, xs, E, H, obs["kinetic"], obs["norms"], method)


class _FlatRun(Run):
    """The flat flow's run, stepped by the solvers' loop (:func:`~transformer_pde.solvers.loop.drive`): the
    Runge–Kutta step without retraction, the field at the new tokens (``v``, read by the kinetic observable),
    the overflow checks, the records."""

    def __init__(self, x0, dt, K, field, tableau):
        self.x, self.dt, self.steps, self.k, self.field = x0, dt, K, 0, field
        self.stepper, self.v, self.rec = Stepper(tableau, retract=False), field(x0), None

    def start(self, rec):
        """The first record; the run itself."""
        self.rec = rec
        rec.record(self.x)
        return self

    @property
    def t(self) -> float:
        """The time of the current step."""
        return self.k * self.dt

    def view(self):
        """The tokens."""
        return self.x

    def step(self):
        """One Runge–Kutta step, the field there, the checks and the record."""
        k, dt = self.k, self.dt
        self.x, _ = self.stepper.step(self.x, self.v, dt, lambda xi, c: self.field(xi))
        self.v, self.k = self.field(self.x), k + 1
        if not (bool(torch.isfinite(self.x).all()) and bool(torch.isfinite(self.v).all())):
            raise NonFiniteError(
                f"the flat dynamics overflowed at t = {(k + 1) * dt:.6g} (step {k + 1}): token norms grow and the "
                f"scores β⟨x, A x⟩ with them; use a shorter t1, smaller heads or a smaller beta")
        if self.rec.keeps(k + 1):
            self.rec.record(self.x)
            if not bool(torch.isfinite(self.rec.records["obs.head_energies"][-1]).all()):
                raise NonFiniteError(f"the flat energy became inf at t = {(k + 1) * dt:.6g} (step {k + 1}); "
                                     f"use a shorter t1")

    def finish(self):
        """(times, tokens, observables) of the records."""
        times, xs, _, _, obs = self.rec.stacked(0.0, self.dt)
        return times, xs, obs


class _Reached(Exception):
    pass


def clustering_hitting_time(x0, heads: Heads, *, target: float, t_max: float, dt: float,
                            normalization: str = "softmax", direction: str = DEFAULT_DIRECTION, method: str = "rk4",
                            weights=None, progress: bool = False) -> torch.Tensor:
    """First time the mean pairwise overlap γ̄(t) (:func:`mean_overlap`) of the particle system reaches
    ``target``, (...,) float64 (``inf`` if not reached by t_max).

    Runs ``tp.solve`` with the fixed-step solver ``method`` ("euler", "heun", "rk4"; constant heads) and
    stops early through its progress callback once every ensemble member has crossed; the crossing time is
    interpolated linearly between the two steps that bracket it (error O(dt²) on top of the solver's)."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not (-1 < float(target) < 1):
        raise ValueError(f"target must be a number in (-1, 1), got {target!r}")
    t_max = check_positive(t_max, "t_max")
    dt = check_positive(dt, "dt")
    check_any(x0, heads, weights, on_sphere=True)
    target = float(target)
    g0 = mean_overlap(x0)[0].to(torch.float64)
    hit = torch.where(g0 >= target, torch.zeros_like(g0), torch.full_like(g0, math.inf))
    if bool(torch.isfinite(hit).all()):
        return hit
    state = {"t": 0.0, "g": g0, "hit": hit}

    def cb(k, t, x):
        g = mean_overlap(x.detach())[0].to(torch.float64)
        new = (~torch.isfinite(state["hit"])) & (g >= target)
        if bool(new.any()):
            frac = (target - state["g"]) / (g - state["g"]).clamp_min(1e-300)
            state["hit"] = torch.where(new, state["t"] + frac * (t - state["t"]), state["hit"])
        state["t"], state["g"] = t, g
        if bool(torch.isfinite(state["hit"]).all()):
            raise _Reached

    K = max(1, math.ceil(t_max / dt))
    try:
        solve(Model(heads, normalization=normalization, direction=direction, weights=weights), x0, FixedStep(method),
              t1=K * dt, dt=dt, saveat=SaveAt(ends=True), ledger=LedgerOptions(diagnostics=False),
              progress=Progress(show=progress, callback=cb))
    except _Reached:
        pass
    return state["hit"]
