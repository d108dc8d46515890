"""The run shared by the two JKO variants (docs/model.md#jko): the batch layout, the proximal steps, the
diagnostics in the scheme's metric, the discrete energy ledger and the records.

:func:`run_jko` solves a checked :class:`~transformer_pde.solvers.jko.problem.JKOProblem` step by step with
:class:`JKORun` (the steps themselves in :mod:`~transformer_pde.solvers.jko.lagrangian` and
:mod:`~transformer_pde.solvers.jko.eulerian`; Θ_t from :mod:`~transformer_pde.solvers.jko.theta`), under a progress
bar, and returns the :class:`~transformer_pde.Trajectory` of :func:`transformer_pde.jko`'s docstring.

Batch axes: the run always carries a leading paths axis (size ``paths``, or 1) in front of the broadcast batch
of the measure and the heads, and drops it once at the end when ``paths=None``.

The discrete energy ledger (the keys of :func:`transformer_pde.simulate` and "jko_defect", reported times e^{−c}
with one common scale c per run) is that of :mod:`transformer_pde.solvers.jko.front`'s docstring.
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from ...model.softmax import softmax_statistics
from ...model.energy import choose_log_scale
from ...model.field import FieldEval, evaluate, log_inverse_mobility, token_mean
from ...model.heads import Heads
from ..loop import Run, drive
from ..parts import LEDGER_KEYS as STEP_LEDGER_KEYS, Ledger, Recorder
from ..trajectory import NonFiniteError, Trajectory, nonfinite_error
from .eulerian import entropy, eulerian_step
from .lagrangian import lagrangian_step, scaled_energy
from .problem import JKOProblem
from .theta import ThetaSource, flatten_heads

__all__ = ["JKOConvergenceError"]
__internal__ = ["JKORun", "run_jko", "LEDGER_KEYS"]

#: the ledger keys of a JKO run: those of the particle solves and the running sum of the step defects
LEDGER_KEYS = (*STEP_LEDGER_KEYS, "jko_defect")


class JKOConvergenceError(RuntimeError):
    """An inner JKO solve did not reach its tolerance (raised with ``strict=True``)."""


def run_jko(problem: JKOProblem, solver) -> Trajectory:
    """Solve a checked JKO problem with the loop of :mod:`~transformer_pde.solvers.loop`: the steps under a
    progress bar (``options.progress``), the callback after every step, one warning for the steps that did not
    converge; the :class:`~transformer_pde.Trajectory`."""
    return drive(JKORun(problem, solver), problem.options.progress.callback)


class JKORun(Run):
    """One JKO solve: the batch layout (flattened to B), the proximal steps (the solver's
    ``step(run, t, dt)``, which calls :meth:`proximal`: Lagrangian or Eulerian), the diagnostics in the scheme's
    metric, the ledger (:class:`~.parts.Ledger` with the extra ``jko_defect`` term) and the recorder; stepped
    by :func:`~transformer_pde.solvers.loop.drive` (the callback sees ``(k, t_k, the flat state)``).

    The state is the tokens (B, n, d) (Lagrangian) or the grid weights (B, m) (Eulerian); :meth:`measure`
    gives the points and weights of the measure it stands for.  Energies, 𝒢², 𝒟 and the ledger are
    reported times e^{−c}, c = ``self.c`` the common scale chosen at t0."""

    def __init__(self, problem: JKOProblem, solver):
        p = problem
        self.p, self.lagrangian, self.c, self.solver = p, p.lagrangian, 0.0, solver
        self.start, self.steps, self.k, self.show = time.perf_counter(), p.steps, 0, p.options.progress.show
        self.desc = f"jko ({p.variant}, {p.transport})"
        self.norm = p.metric
        self.theta = ThetaSource(p.model.theta, t0=p.t0, tau=p.tau, paths=p.paths, seed=p.seed,
                                 generator=p.options.generator, path_dt=p.path_dt, batch_rank=len(p.batch))
        self.rec = Recorder(p.steps, p.record_every, diagnostics=True, ledger_keys=LEDGER_KEYS,
                            extra=("w", "ledger.jko_defect"))
        self.S = {k: [] for k in ("residual", "iterations", "converged", "defect", "prox", "plan_updates")}
        self.bad_steps, self.bad_residuals = [], []
        self._layout()
        self._start()

    def _layout(self):
        """The batch layout: a paths axis (``paths``, or 1) in front of the broadcast batch of the measure and the
        heads (``problem.batch``), flattened to one axis of size B."""
        p, weights = self.p, self.p.model.weights
        state = p.initial.detach()
        event = tuple(state.shape[-2:] if self.lagrangian else state.shape[-1:])  # (n, d) or (m,)
        batch = (p.paths or 1, *p.batch)
        self.out_batch = batch if p.paths is not None else batch[1:]  # the paths axis is dropped at the end
        B, n = math.prod(batch), event[0]
        self.batch, self.B, self.n, self.warm = batch, B, n, None
        self.f = dict(dtype=state.dtype, device=state.device)
        self.state = state.expand(*batch, *event).reshape(B, *event)
        if self.lagrangian:
            self.w = None if weights is None else weights.detach().expand(*batch, n).reshape(B, n)
            self.wt = torch.full((B, n), 1.0 / n, **self.f) if self.w is None else self.w
        else:
            self.pts = p.grid.expand(B, *p.grid.shape)

    def measure(self, state):
        """(points, weights) of the measure: the tokens and token weights, or the grid and the state."""
        return (state, self.w) if self.lagrangian else (self.pts, state)

    def flat(self, k: int) -> Heads:
        """Θ at t_k, flattened to the batch axis B."""
        return flatten_heads(self.theta.heads(k), self.batch, self.B)

    # ------------------------------------------------------------------ diagnostics in the scheme's metric
    def entropy_term(self, p) -> torch.Tensor:
        """s'·T Σ_b p_b log(m p_b) · e^{−c} (B,): the entropy part of Ẽ = E + s'T∫ρ log ρ (0 at T = 0)."""
        return entropy(p, 0.0 if self.lagrangian else self.p.temperature, self.p.step.sgn, self.c)

    def evaluate(self, points, wts, heads) -> FieldEval:
        """The field, energy, 𝒢² and 𝒟 of the measure (points, wts), times e^{−c} (with temperature: Ẽ)."""
        ev = self._evaluate(points, wts, heads)
        if self.p.temperature > 0 and not self.lagrangian:
            ev = ev.replace(energy=ev.energy + self.entropy_term(wts))
        return ev

    def _evaluate(self, points, wts, heads) -> FieldEval:
        ev = evaluate(points, heads, wts, normalization=self.norm, sign=self.p.sign, diagnostics=True, log_scale=self.c)
        # the scheme's field is the gradient flow V = s g / b (b ≡ 1 for "unit"): 𝒢² = Σ w b|V|² = Σ w |g|²/b
        # and 𝒟 = Σ w ⟨g, V⟩ = s 𝒢², formed from g b^{-1/2} (no |V|² ~ e^{2β‖A‖} in between)
        G = self.metric_slope(ev.grad_first_variation, ev.stats.log_partition, heads, wts)
        return ev.replace(slope=G, dissipation=self.p.sign * G, ambient=None)

    def metric_slope(self, g, log_partition, heads, wts):
        """|∂E|² e^{−c} in the scheme's metric: Σ w |∇δE|²/b (effective) or Σ w |∇δE|² (unit); g = ∇_S δE/δμ e^{−c}."""
        # |g|²/b · e^{−c} = |g e^{−c} · (e^{c}/b)^{1/2}|², scaled before squaring (finite whenever the result is)
        lbinv = torch.zeros_like(g[..., 0]) if self.p.unit else log_inverse_mobility(heads, log_partition)
        g = g * torch.exp(0.5 * (lbinv + self.c)).unsqueeze(-1)
        return token_mean(g.square().sum(-1), wts)

    def check(self, ev, t, k, heads):
        """NonFiniteError unless the energy (and, with diagnostics, 𝒢² and 𝒟) are finite."""
        if not bool(torch.isfinite(ev.energy).all()):
            raise nonfinite_error("the energy", t, k, heads)
        if self.p.diagnostics:
            for name, v in (("the metric slope 𝒢²", ev.slope), ("the dissipation 𝒟", ev.dissipation)):
                if not bool(torch.isfinite(v).all()):
                    err = nonfinite_error(name, t, k, heads, self.norm)
                    raise NonFiniteError(f"{err} (the JKO step itself does not need it: diagnostics=False)")

    # ------------------------------------------------------------------ steps
    def _start(self):
        """Θ at t0, the common scale, the first evaluation and record."""
        t0, (pts, w) = self.p.t0, self.measure(self.state)
        self.heads_cur = self.flat(0)
        with torch.no_grad():
            self.c = choose_log_scale(softmax_statistics(pts, self.heads_cur, w).log_partition)
        ev = self.evaluate(pts, w, self.heads_cur)
        self.check(ev, t0, 0, self.heads_cur)
        self.log_c = torch.full((self.B,), self.c, **self.f)
        self.work = float(self.B) * self.heads_cur.num_heads * self.n * self.n
        self.ledger = Ledger(ev.energy, sign=self.p.sign, extra=("jko_defect",))
        self._accept(self.state, ev, record=True)

    def _accept(self, state, ev, record: bool):
        """Move to the new state, evaluated in ``ev``: the mobility and energy of the next step, the record."""
        self.state, self.E_prev = state, ev.energy
        lse = ev.stats.log_partition  # log b ("unit": 0)
        self.lb = torch.zeros_like(lse[..., 0, :]) if self.p.unit else -log_inverse_mobility(self.heads_cur, lse)
        if record:
            self.rec.record(self.measure(state)[0], ev.energy, ev.slope, ev.dissipation,
                            {**self.ledger.terms(ev.energy), "jko_defect": self.ledger.acc["jko_defect"]})
            self.rec.records["w"].append(state)

    def _proximal(self, heads_new, t_new, k):
        """The JKO step's minimiser (the new state) and the inner solve's info."""
        if self.lagrangian:
            new, info = lagrangian_step(self.state, self.w, self.wt, self.heads_cur, heads_new, self.lb, self.p.step,
                                        out_log_scale=self.c)
            if new is None:
                raise nonfinite_error("the JKO objective", t_new, k + 1, heads_new)
        else:
            with torch.no_grad():
                new, info, self.warm = eulerian_step(self.p.grid, self.state, self.heads_cur, heads_new, self.lb,
                                                     self.p.step, warm=self.warm)
                if self.c != 0.0:
                    info["prox"] = info["prox"] * math.exp(-self.c)
        if not bool(torch.isfinite(info["residual"]).all()):  # the velocity error itself overflows the dtype
            raise nonfinite_error("the inner residual (velocity error |P(y − x)/τ − V|)", t_new, k + 1, heads_new,
                                  self.norm)
        if not bool(torch.isfinite(new).all()):
            raise nonfinite_error("the token positions" if self.lagrangian else "the grid weights",
                                  t_new, k + 1, heads_new)
        return new, info

    @property
    def t(self) -> float:
        """The time of the current step."""
        return self.p.t0 + self.k * self.p.tau

    def view(self) -> torch.Tensor:
        """The flat state (B, n, d) or (B, m) (the callback's x)."""
        return self.state

    def proximal(self, t_new: float):
        """The proximal step to ``t_new`` from the current state: (the minimiser, the inner solve's info)."""
        return self._proximal(self.heads_new, t_new, self.k)

    def step(self):
        """JKO step k → k + 1 with its ledger terms (the minimiser: ``solver.step(self, t_k, τ)``)."""
        p, tau, k = self.p, self.p.tau, self.k
        t_new = p.t0 + (k + 1) * tau
        self.heads_new = heads_new = self.flat(k + 1)
        pts, w = self.measure(self.state)
        with torch.no_grad():
            E_cross = scaled_energy(pts, heads_new, w, self.log_c) + (0.0 if self.lagrangian else self.entropy_term(w))
        if not bool(torch.isfinite(E_cross).all()):
            raise nonfinite_error("the energy", t_new, k + 1, heads_new)
        new_state, info = self.solver.step(self, t_new - tau, tau)
        new_pts, new_w = self.measure(new_state)
        with torch.no_grad():
            self.heads_cur = heads_new
            ev = self.evaluate(new_pts, new_w, self.heads_cur)
        self.check(ev, t_new, k + 1, self.heads_cur)
        prox = info["prox"]
        defect = p.step.sgn * (ev.energy - E_cross) + prox / (2 * tau)
        led = self.ledger
        led.add("partial", E_cross - self.E_prev)
        led.add("slope", prox / tau)
        if p.temperature > 0:  # the discrete slope W²/τ² in place of |∂F|² (docstring of jko)
            led.add("dissipation", p.sign * prox / tau)
        else:
            led.add("dissipation", p.sign * (prox / (2 * tau) + 0.5 * tau * self.metric_slope(
                ev.grad_first_variation, ev.stats.log_partition, self.heads_cur, new_w)))
        led.add("jko_defect", defect)
        for key in ("partial", "slope", "dissipation", "jko_defect"):
            if not bool(torch.isfinite(led.acc[key]).all()):
                raise nonfinite_error(f"the ledger term {key!r}", t_new, k + 1, self.heads_cur)
        for key in self.S:
            self.S[key].append(defect if key == "defect" else info[key])
        if not bool(info["converged"].all()):
            self._not_converged(k, t_new, info)
        self._accept(new_state, ev, record=self.rec.keeps(k + 1))
        self.k = k + 1

    def _not_converged(self, k, t_new, info):
        """Note a step whose inner solve missed its tolerance (warned at the end); JKOConvergenceError if strict."""
        self.bad_steps.append(k + 1)
        self.bad_residuals.append(float(info["residual"][~info["converged"]].max()))
        if not self.p.strict:
            return
        what = (f" (velocity error in L²(μ); {float(info['r0'].max()):.3e} at the start)" if "r0" in info
                else " (‖T(p) − p‖₁)")
        sinkhorn = self.lagrangian and self.p.transport == "sinkhorn"
        raise JKOConvergenceError(
            f"JKO step {k + 1} (t = {t_new:.6g}) did not converge in {self.p.step.max_iter} inner iterations: residual "
            f"{self.bad_residuals[-1]:.3e}{what}; raise max_iter, loosen tol, or reduce tau"
            + (" (with transport='sinkhorn': raise sinkhorn_scaling towards 1 or lower eps)" if sinkhorn else ""))

    def warn_nonconverged(self):
        """One RuntimeWarning for the steps whose inner solve missed its tolerance."""
        if self.bad_steps:
            b, r = self.bad_steps, self.bad_residuals
            warnings.warn(f"{len(b)} of {self.p.steps} JKO steps did not reach the inner tolerance (first: step "
                          f"{b[0]}, t = {self.p.t0 + b[0] * self.p.tau:.6g}, residual {r[0]:.3e}; largest "
                          f"residual {max(r):.3e}); see traj.stats['residual'] — raise max_iter, loosen tol, "
                          f"or reduce tau (strict=True raises instead)", RuntimeWarning, stacklevel=6)

    def finish(self) -> Trajectory:
        """One warning for the steps that did not converge; the records and per-step statistics, from the flat
        batch axis to the batch shape."""
        self.warn_nonconverged()
        start, p, batch, T = self.start, self.p, self.out_batch, len(self.rec.steps)
        times, xs, series, ledger, _ = self.rec.stacked(p.t0, p.tau)
        xs = xs.reshape(T, *batch, *xs.shape[2:])
        ledger = {key: v.reshape(T, *batch) for key, v in ledger.items()}
        series = {key: v.reshape(T, *batch) if p.diagnostics else None for key, v in series.items()}
        st = {key: torch.stack([v.reshape(batch) for v in vals]) for key, vals in self.S.items()}
        stats = {**st, "steps": p.steps, "wall_time": time.perf_counter() - start,
                 "max_defect": float(st["defect"].max()), "max_residual": float(st["residual"].max()),
                 "mean_iterations": float(st["iterations"].double().mean()), "nonconverged_steps": len(self.bad_steps),
                 "energy_log_scale": self.c, "order": 1}
        extras = {"scheme": p.variant, "transport": p.transport, "tau": p.tau, "mobility": p.metric.jko_mobility,
                  "cost": p.cost, "eps": p.eps, "grid": p.grid}
        if self.lagrangian:  # the token weights; Eulerian: the grid weights of every record
            weights = None if self.w is None else self.wt.reshape(*batch, self.n)
        else:
            weights = torch.stack([v.reshape(*batch, self.n) for v in self.rec.records["w"]])
        return Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                          f"jko-{p.variant}-{p.transport}", self.norm.name, p.model.direction, weights,
                          self.theta.path(), extras, paths=p.paths)
