"""The fixed-step particle solve: explicit Runge–Kutta steps with the geometry's retraction, or the
model's layer map, the token noise, the energy ledger, records and checkpoints (docs/model.md#solvers).

:func:`solve_fixed_step` runs one solve of a checked problem (model, solver, options) from prepared
parts (weight driver, evaluator, checkpointer): the step's geometry is ``model.geometry`` (its retraction in
the Runge–Kutta stages, or its layer map through :meth:`~.parts.Stepper.layer_step`) and the
token noise is ``model.noise``.  With ``LedgerOptions(ledger=True)`` the energy, 𝒢², 𝒟 and the
ledger are evaluated at every step (eager); with the default (diagnostics, no ledger) the solve keeps
the heads (and radii) of each record and the three series are computed from the records on their
first read (:class:`~transformer_pde.solvers.recorded.RecordedDiagnostics`).  The entry points are :func:`transformer_pde.solve` and
:meth:`transformer_pde.FixedStep.run`; this is a named internal API.
"""

from __future__ import annotations

import time

import torch

from ..utils import threads
from ..model.energy import pairing
from ..model.energy import quadratic_variation as realised_qv_term
from .layernorm import geometry_densities
from .noise import noise_martingale
from .parts import LEDGER_KEYS, Ledger, Recorder, Stepper, partial_density, progress_bar
from .recorded import RecordedDiagnostics, RecordedHeads
from .trajectory import Trajectory, check_finite, check_ledger, lazy_series, nonfinite_error

__all__: list = []
__internal__ = ["FixedStepRun", "solve_fixed_step"]


def _tree(o, fn):
    """o with fn applied to every tensor in nested dicts and lists (checkpoint states)."""
    if isinstance(o, dict):
        return {k: _tree(v, fn) for k, v in o.items()}
    if isinstance(o, list):
        return [_tree(v, fn) for v in o]
    return fn(o) if isinstance(o, torch.Tensor) else o


class FixedStepRun:
    """A fixed-step solve composed of the parts: the weight driver (Θ_t), the stepper (tableau + the
    geometry's retraction, or its layer map), the token noise, the ledger, the recorder and the
    checkpointer; one :meth:`step` at a time.  The state carries the paths axis (``axis``)."""

    def __init__(self, x, problem, parts):
        model, o = problem.model, problem.options
        self.x, self.drv, self.ev, self.axis = x, parts.driver, parts.evaluator, parts.axis
        self.fix_scale, self.scale, self.ckpt = self.ev.fix_scale, self.ev.scale, parts.checkpointer
        # diagnostics: evaluated at every step (the ledger); lazy: from the records after the solve
        self.K, self.dt, self.w = problem.steps, o.dt, model.weights
        self.diagnostics, self.lazy = o.ledger.diagnostics and o.ledger.ledger, o.ledger.lazy
        self.heads_rec = RecordedHeads() if self.lazy else None  # Θ at each record (lazy)
        self.realised = o.ledger.quadratic_variation == "realised"
        self.normalization, self.noisy, self.method = model.normalization, self.drv.noisy, problem.solver.method
        causal = model.causal
        self.stepper = Stepper(problem.solver.tableau, retract=True, geometry=model.geometry)
        self.geometry = self.stepper.geometry
        self.r, self.radii = self.geometry.initial_radius(x), []  # token radii (pre-/peri-LN), their records
        keys = LEDGER_KEYS if not causal else tuple(k for k in LEDGER_KEYS if not k.startswith("residual"))
        self.rec = Recorder(self.K, problem.record_every, diagnostics=self.diagnostics,
                            observables={k: self.axis.observable(f) for k, f in problem.observables.items()},
                            weights=model.weights, ledger_keys=keys)
        self.ledger = Ledger(torch.zeros(()), sign=problem.sign, quadrature=problem.quadrature, causal=causal)
        self.k, self.nfe, self.max_sphere = 0, 0, 0.0
        self.noise = model.noise  # token noise (TokenNoise or None) and its own random stream
        seed = problem.seed if o.generator is None else o.generator.initial_seed()
        self.token_gen = self.noise.generator(seed, x.device) if self.noise is not None else None

    def state(self) -> dict:
        """The solver state for a checkpoint, in the caller's batch convention (the file format of old)."""
        v = self.axis.view
        st = {"x": v(self.x.detach()), "driver": self.drv.state(), "records": _tree(self.rec.records, lambda t: v(t).clone()),  # the records, not their whole buffer
              "acc": _tree(self.ledger.acc, v), "nfe": self.nfe, "max_sphere": self.max_sphere,
              "scale": dict(self.scale),
              **({"r": v(self.r), "radii": _tree(self.radii, v)} if self.r is not None else {})}
        if self.token_gen is not None:
            st["token_noise"] = self.token_gen.get_state()
        if self.lazy:
            st["heads"] = self.heads_rec.state()
        return st

    def _evaluate(self, x, heads):
        e = self.ev(x, heads, self.diagnostics)
        self.nfe += 1
        # a layer map adds the ambient update A (finite A gives a finite P_x A): check what the step reads
        if not check_finite(e.velocity if self.geometry.projected or e.ambient is None else e.ambient):
            raise nonfinite_error("the velocity field", self.drv.t, self.drv.k, heads, self.normalization)
        return e

    def _densities(self, x, heads, e, rate=None):
        """The ledger's densities at the current grid point (rate: Ȧ there, default the driver's),
        checked finite."""
        if not self.diagnostics:
            return None
        c = self.scale["c"]
        pt = partial_density(x, heads, self.w, e.stats, self.drv.rate if rate is None else rate, self.drv.sigma,
                             ito=self.noisy and not self.realised, log_scale=c)
        check_ledger(e, pt, self.drv.t, self.drv.k, self.scale)
        if not self.geometry.projected:  # 𝒟 and 𝒢² along the geometry's velocity λ_i P_x A_i
            D, G = geometry_densities(self.geometry, e, heads, self.w, self.r, c)
            return {"partial": pt, "dissipation": D, "slope": G}
        return {"partial": pt, "dissipation": e.dissipation, "slope": e.slope}

    def _record(self):
        e = self.cur
        if self.r is not None:
            self.radii.append(self.r.detach())
        if self.lazy:
            self.heads_rec.append(self.drv.current)
        if self.diagnostics:
            G, D = (e.slope, e.dissipation) if self.geometry.projected else (self.dens["slope"], self.dens["dissipation"])
            self.rec.record(self.x, e.energy, G, D, self.ledger.terms(e.energy))
        else:
            self.rec.record(self.x)

    def start(self):
        """Resume from the checkpoint or start at t0: first evaluation, common scale, first record."""
        ck = self.ckpt.load(self.x.device)
        if ck is not None:
            u = self.axis.unview
            self.k, self.x, self.nfe, self.max_sphere = ck["k"], u(ck["x"]), ck["nfe"], ck["max_sphere"]
            self.drv.load_state(ck["driver"])
            self.rec.records, self.ledger.acc = _tree(ck["records"], u), _tree(ck["acc"], u)
            self.scale.update(ck.get("scale", {"c": 0.0, "start_max": float("nan")}))
            if self.r is not None:
                self.r, self.radii = u(ck["r"]), _tree(ck["radii"], u)
            if self.token_gen is not None:
                self.token_gen.set_state(ck["token_noise"])
            if self.diagnostics and "heads" in ck:
                raise ValueError(f"the checkpoint {self.ckpt.path} was written by a run without the energy ledger "
                                 f"(ledger=False): it holds no ledger of the steps before step {ck['k']}. Resume it "
                                 f"with ledger=False, or delete it to start again with ledger=True")
            if self.lazy and "heads" in ck:
                self.heads_rec = RecordedHeads(ck["heads"])
            elif self.lazy:  # written by an eager run (the default of earlier versions): continue it eagerly
                self.lazy, self.heads_rec, self.diagnostics = False, None, True
                self.rec.diagnostics = True
        self.cur = self._evaluate(self.x, self.drv.current)
        if self.diagnostics and ck is None and self.fix_scale(self.cur):
            self.cur = self.ev(self.x, self.drv.current, True)
        self.dens = self._densities(self.x, self.drv.current, self.cur)
        if ck is None:
            if self.diagnostics:
                self.ledger = Ledger(self.cur.energy, sign=self.ledger.sign, quadrature=self.ledger.quadrature,
                                     causal=self.ledger.causal)
            self._record()

    def solve(self, show: bool, callback, pool):
        """Step from the start (or the resumed step) to t1: progress bar, ``callback(k, t, x)``, checkpoints."""
        with progress_bar(show, self.K, f"simulate ({self.method})", initial=self.k) as bar:
            while self.k < self.K:
                self.step()
                if callback is not None:
                    callback(self.k, self.drv.t, self.axis.view(self.x))
                bar.update(1)
                pool.refresh()
                self.ckpt.after_step(self.k, self.state)

    def step(self):
        """One step t_k → t_{k+1}: Itô terms at the left end, the Runge–Kutta step with retraction, the
        ledger's quadrature and jumps, the record."""
        drv, x, heads, cur, c = self.drv, self.x, self.drv.current, self.cur, self.scale["c"]
        noise = drv.prepare() if self.noisy else None
        if self.diagnostics and noise is not None:  # martingale (and realised QV) at the left end (Itô)
            self.ledger.add("martingale", pairing(x, heads, self.w, cur.stats, noise, log_scale=c))
            if self.realised:
                self.ledger.add("partial", realised_qv_term(x, heads, self.w, cur.stats, noise, log_scale=c))

        def stage(xs, ci):
            self.nfe += 1
            return self.ev(xs, drv.stage(ci), False).velocity

        if self.stepper.projected:
            x_new, err = self.stepper.step(x, cur.velocity, self.dt, stage)
        else:  # a layer map (post-, pre-, peri-LN, nGPT) of the signed, un-projected attention update
            x_new, self.r, err = self.stepper.layer_step(x, self.r, cur.ambient, self.dt)
        self.max_sphere = max(self.max_sphere, err)
        if not check_finite(x_new):
            raise nonfinite_error("the token positions", drv.t + self.dt, self.k + 1, heads, self.normalization)
        if self.noise is not None:  # token noise after the deterministic step; Itô terms at the left end
            xi = self.noise.increment(x_new, self.dt, self.token_gen)
            if self.diagnostics:
                self.ledger.add("martingale", noise_martingale(cur.grad_first_variation, self.w, xi))
                self.ledger.add("partial", self.dt * self.noise.ito_correction(x, heads, self.w, log_scale=c,
                                                                               stats=cur.stats))
            x_new = self.noise.apply(x_new, xi)
        jumps = drv.jumps()
        drv.advance()
        nxt = self._evaluate(x_new, drv.current)
        if self.diagnostics:
            dens_new = self._densities(x_new, drv.current, nxt)
            left = drv.left_limit()  # Θ or Ȧ discontinuous at t_{k+1}: the step's right end is the left limit
            e_left = self.ev(x_new, heads if left is None else left[0], True) if jumps or left else None
            right = dens_new if left is None else self._densities(x_new, left[0], e_left, rate=left[1])
            self.ledger.integrate(self.dens, right, self.dt)
            if jumps:
                self.ledger.add("partial", nxt.energy - e_left.energy)
            self.dens = dens_new
        self.x, self.cur, self.k = x_new, nxt, self.k + 1
        if self.rec.keeps(self.k):
            self._record()



def solve_fixed_step(x, problem, parts, show: bool) -> Trajectory:
    """One fixed-step solve of a checked problem (a :class:`~transformer_pde.solvers.particle.ParticleProblem`:
    model, FixedStep solver, options, steps, record stride, quadrature, observables) from the state x
    (with the paths axis) and the prepared ``parts`` (:class:`~transformer_pde.solvers.evaluator.RunParts`);
    ``show``: the progress bar.  The Trajectory still carries the paths axis (the caller drops it:
    ``parts.axis.finish``)."""
    model, o, ev, drv = problem.model, problem.options, parts.evaluator, parts.driver
    run = FixedStepRun(x, problem, parts)
    run.start()
    with threads.scope(parts.work) as pool:
        run.solve(show, o.progress.callback, pool)
    times, out_x, series, ledger, observed = run.rec.stacked(o.t0, o.dt)
    noise, geometry = model.noise, run.geometry
    stats = {"steps": problem.steps, "field_evaluations": run.nfe, "max_sphere_error": run.max_sphere,
             "wall_time": time.perf_counter() - parts.start, "order": problem.solver.order,
             "energy_log_scale": ev.scale["c"], "gradient_flow": not model.causal,
             "temperature": 0.0 if noise is None else noise.temperature}
    extras = {}
    if not geometry.projected:
        stats["layer_norm"] = geometry.name
        if geometry.radius:
            extras["radius"] = torch.stack(run.radii)
    if run.lazy:  # E, 𝒢², 𝒟 from the records, on first read; no ledger
        src = RecordedDiagnostics(model, out_x, run.heads_rec, log_scale=o.ledger.energy_log_scale,
                                  radius=extras.get("radius"), times=times, steps=run.rec.steps,
                                  chunk_elements=o.limits.chunk_elements)
        stats["energy_log_scale"] = src.log_scale
        series, ledger = dict(zip(("energy", "slope", "dissipation"), lazy_series(src))), None
    return Trajectory(times, out_x, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      problem.solver.method, model.normalization.name, model.direction, model.weights,
                      drv.path() if o.saveat.path else None, observables=observed, extras=extras)
