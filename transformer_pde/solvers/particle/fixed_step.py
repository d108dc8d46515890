"""The fixed-step particle solve: explicit Runge–Kutta steps with the geometry's retraction, or the
model's layer map, the token noise, the energy ledger, records and checkpoints (docs/model.md#solvers).

:class:`FixedStepRun` is one solve of a checked problem (model, solver, options) from prepared parts
(weight driver, evaluator, checkpointer, the checkpoint it resumes), stepped by the loop of
:mod:`~transformer_pde.solvers.loop`; the step itself is the solver's ``step(state, t, dt)``.  The step's geometry is ``model.layer_norm`` (its retraction in
the Runge–Kutta stages, or its layer map through :meth:`~.parts.Stepper.layer_step`) and the
token noise is ``model.noise``.  With ``LedgerOptions(ledger=True)`` the energy, 𝒢², 𝒟 and the
ledger are evaluated at every step (eager); with the default (diagnostics, no ledger) the solve keeps
the heads (and radii) of each record and the three series are computed from the records on their
first read (:class:`~transformer_pde.solvers.recorded.RecordedDiagnostics`).  With
``LedgerOptions(kinetic=True)`` and no ledger, the kinetic term ∫𝒢² dt is accumulated from each grid
point's own field evaluation (its velocity and log-partitions), with the ledger's quadrature.  The entry points are :func:`transformer_pde.solve` and
:meth:`transformer_pde.FixedStep.run` (the run of every
:class:`~transformer_pde.solvers.particle.methods.ParticleSolver`); this is a named internal API.
"""

from __future__ import annotations

import math
import time

import torch

from ...model.energy import check_scale_fits, choose_log_scale, pairing
from ...model.energy import quadratic_variation as realised_qv_term
from ...model.field import log_inverse_mobility, token_mean
from ...model.softmax import softmax_statistics
from ...model.heads import broadcast_shapes
from ...model.normalization import NORMALIZATIONS, normalization as as_normalization
from ...processes.driver import WeightDriver
from ...dynamics.layernorm import FusedUpdate, geometry_densities
from ...dynamics.noise import noise_martingale
from ...utils.recycle import Recycler
from ..loop import ParticleState, Run
from ..parts import LEDGER_KEYS, Ledger, Recorder, callable_signature, partial_density, process_parts
from ..tableaux import TABLEAUX, ButcherTableau
from ..recorded import RecordedDiagnostics, RecordedHeads
from ..trajectory import PathsAxis, Trajectory, check_finite, check_ledger, lazy_series, ledger_nonfinite, nonfinite_error
from .evaluator import Evaluator, RunParts

__all__: list = []
__internal__ = ["FixedStepRun", "prepare_parts", "fingerprint_parts"]


def _tree(o, fn):
    """o with fn applied to every tensor in nested dicts and lists (checkpoint states)."""
    if isinstance(o, dict):
        return {k: _tree(v, fn) for k, v in o.items()}
    if isinstance(o, list):
        return [_tree(v, fn) for v in o]
    return fn(o) if isinstance(o, torch.Tensor) else o


class FixedStepRun(Run):
    """A particle solve composed of the parts: the weight driver (Θ_t), the solver's step (a
    :class:`~transformer_pde.FixedStep`'s tableau with the geometry's retraction or its layer map, or a
    user's ``step``), the token noise, the ledger, the recorder and the checkpointer; one :meth:`step` at a
    time, driven by :func:`~transformer_pde.solvers.loop.drive`.  The state carries the paths axis (``axis``).
    ``parts`` is complete when the run is built: whether it resumes (``parts.resume``), books the ledger at
    every step (``parts.eager``) or from the records (``parts.lazy``) was decided before."""

    def __init__(self, x, problem, parts, show: bool = False):
        model, o = problem.model, problem.options
        self.x, self.drv, self.ev, self.axis = x, parts.driver, parts.evaluator, parts.axis
        self.fix_scale, self.scale, self.checkpointer = self.ev.fix_scale, self.ev.scale, parts.checkpointer
        self.parts, self.solver, self.problem, self.show, self.work = parts, problem.solver, problem, show, parts.work
        # diagnostics: evaluated at every step (the ledger); lazy: from the records after the solve
        self.K, self.dt, self.w = problem.steps, o.dt, model.weights
        self.steps, self.desc = self.K, f"simulate ({problem.solver.method})"
        self.diagnostics, self.lazy = parts.eager, parts.lazy
        self.at_records = o.ledger.at_record_steps  # E, 𝒢², 𝒟 from the recorded steps' own evaluations
        self.heads_rec = RecordedHeads() if self.lazy else None  # Θ at each record (lazy)
        self.realised = o.ledger.quadratic_variation == "realised"
        self.normalization, self.noisy, self.method = model.normalization, self.drv.noisy, problem.solver.method
        self.causal = causal = model.causal
        # the kinetic term ∫𝒢² dt from the step's own field (without the ledger, whose "slope" it equals)
        self.kinetic, self.quadrature = o.ledger.kinetic_only, problem.quadrature
        self.kin, self.kin_dens, self.kin_rec = None, None, []  # running ∫𝒢², 𝒢² at the grid point, records
        self.geometry = model.layer_norm
        self._states = Recycler(2)  # the tokens' memory: the current state and the one before it
        self.r, self.radii = self.geometry.initial_radius(x), []  # token radii (pre-/peri-LN), their records
        keys = LEDGER_KEYS if not causal else tuple(k for k in LEDGER_KEYS if not k.startswith("residual"))
        ck, u = parts.resume, self.axis.unview
        self.rec = Recorder(self.K, problem.record_every, diagnostics=self.diagnostics or self.at_records,
                            observables={k: self.axis.observable(f) for k, f in problem.observables.items()},
                            weights=model.weights, ledger_keys=keys if self.diagnostics else (),
                            records=None if ck is None else _tree(ck["records"], u))
        self.ledger_keys = keys
        self.ledger = Ledger(torch.zeros(()), sign=problem.sign, quadrature=problem.quadrature, causal=causal,
                             acc=None if ck is None else _tree(ck["acc"], u))  # (a fresh run's: at the first evaluation)
        self.k, self.nfe, self.max_sphere = 0, 0, 0.0
        self.noise = model.noise  # token noise (TokenNoise or None) and its own random stream
        seed = problem.seed if o.generator is None else o.generator.initial_seed()
        self.token_gen = self.noise.generator(seed, x.device) if self.noise is not None else None
        self._start()  # complete when built: resumed, or evaluated and recorded at t0

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
        if self.kinetic:
            st["kinetic"] = {"acc": v(self.kin.detach()), "records": [v(t.detach()) for t in self.kin_rec]}
        return st

    def _evaluate(self, x, heads, diag=None):
        e = self.ev(x, heads, self.diagnostics if diag is None else diag)
        self.nfe += 1
        # a layer map adds the ambient update A (finite A gives a finite P_x A): check what the step reads
        if not check_finite(e.velocity if self.geometry.projected or e.ambient is None else e.ambient):
            raise nonfinite_error("the velocity field", self.drv.t, self.drv.k, heads, self.normalization)
        return e

    def _densities(self, x, heads, e, rate=None):
        """The ledger's densities at the current grid point (rate: Ȧ there, default the driver's),
        checked finite; the density ∂_tE is None where it is 0."""
        if not self.diagnostics:
            return None
        c = self.scale["c"]
        ito = self.noisy and not self.realised
        if self.noise is not None:  # the next step's martingale reads ∇_S δE/δμ: formed first, 𝒟 reuses it
            e.grad_first_variation
        if not self.ev.pairing:  # Θ constant between its jumps (no Itô term): ∂_tE = ⟨∂_A E, 0⟩ = 0
            pt = None
        else:
            pt = partial_density(x, heads, self.w, e.stats, self.drv.rate if rate is None else rate, self.drv.sigma,
                                 ito=ito, log_scale=c)
        check_ledger(e, pt, self.drv.t, self.drv.k, self.scale)
        if not self.geometry.projected:  # 𝒟 and 𝒢² along the geometry's velocity λ_i P_x A_i
            D, G = geometry_densities(self.geometry, e, heads, self.w, self.r, c)
            return {"partial": pt, "dissipation": D, "slope": G}
        return {"partial": pt, "dissipation": e.dissipation, "slope": e.slope}

    def _kinetic_log_partition(self, x, heads, e):
        """log m_h(x_i) of the whole measure at a grid point: the evaluation's own, or (causal attention,
        whose pass is of the prefixes; a fused layer-map pass, which keeps none) one non-causal pass."""
        if e.stats is not None and not self.causal:
            return e.stats.log_partition
        return softmax_statistics(x, heads, self.w, chunk_elements=self.ev.chunk).log_partition

    def _kinetic_density(self, x, heads, e, lse=None):
        """𝒢² e^{−c} = Σ_i w_i b(x_i) e^{−c} |V_i|² at a grid point from its field evaluation ``e`` (along a
        layer map: Σ_i w_i λ_i b_i e^{−c} |V_i|², the ledger's density), checked finite."""
        lse = self._kinetic_log_partition(x, heads, e) if lse is None else lse
        c = self.scale["c"]
        b = torch.exp(-log_inverse_mobility(heads, lse) - c)
        V = e.velocity
        lam_v = None if self.geometry.projected else self.geometry.speed_times(None, self.r, e.ambient, V)
        G = token_mean(b * (V * (V if lam_v is None else lam_v)).sum(-1), self.w)
        if not check_finite(G):
            raise ledger_nonfinite("the metric slope 𝒢² (kinetic term)", self.drv.t, self.drv.k, lse, c,
                                   self.scale["start_max"], self.scale.get("given", False))
        return G

    def _kinetic_start(self, fresh: bool):
        """𝒢² at the first grid point; on a fresh start also the common scale c (the ledger's rule, from
        the log-partitions at t0, unless given) and the zero integral."""
        lse = self._kinetic_log_partition(self.x, self.drv.current, self.cur)
        if fresh:
            lp = lse.detach()
            self.scale["start_max"] = float(lp.max()) if lp.numel() else 0.0
            if self.scale.get("given", False):
                check_scale_fits(lp, self.scale["c"])
            else:
                self.scale["c"] = choose_log_scale(lp)
        self.kin_dens = self._kinetic_density(self.x, self.drv.current, self.cur, lse)
        if fresh:
            self.kin = torch.zeros_like(self.kin_dens.detach())

    def _kinetic_step(self, x_new, nxt):
        """Add dt × (𝒢² at the left end, or the mean of both ends; where Θ jumps at t_{k+1} the right end
        is taken at Θ(t_{k+1}−), as the ledger does) and keep 𝒢² at t_{k+1} for the next step."""
        drv, last = self.drv, self.k + 1 == self.K
        if self.quadrature == "left":
            inc = self.kin_dens
            self.kin_dens = None if last else self._kinetic_density(x_new, drv.current, nxt)
        else:
            right = self._kinetic_density(x_new, drv.current, nxt)
            left = drv.left_limit()
            end = right if left is None else self._kinetic_density(x_new, left[0], self._evaluate(x_new, left[0]))
            inc = 0.5 * (self.kin_dens + end)
            self.kin_dens = right
        self.kin = self.kin + self.dt * inc

    def _record(self):
        e = self.cur
        if self.kinetic:
            self.kin_rec.append(self.kin)
        if self.r is not None:
            self.radii.append(self.r.detach())
        if self.lazy:
            self.heads_rec.append(self.drv.current)
        if self.diagnostics:
            G, D = (e.slope, e.dissipation) if self.geometry.projected else (self.dens["slope"], self.dens["dissipation"])
            self.rec.record(self.x, e.energy, G, D, self.ledger.terms(e.energy))
        elif self.at_records:
            self.rec.record(self.x, e.energy, *self._record_densities(e), {})
        else:
            self.rec.record(self.x)

    def _record_densities(self, e):
        """(𝒢², 𝒟) of a recorded step's evaluation with diagnostics (along a layer map: λ-weighted, as the
        ledger books them), E, 𝒢², 𝒟 checked finite."""
        c = self.scale["c"]
        if self.geometry.projected:
            G, D = e.slope, e.dissipation
        else:
            D, G = geometry_densities(self.geometry, e, self.drv.current, self.w, self.r, c)
        for name, v in (("the energy", e.energy), ("the dissipation 𝒟", D), ("the metric slope 𝒢²", G)):
            if not check_finite(v):
                raise ledger_nonfinite(f"{name} at the recorded time", self.drv.t, self.k, e.stats.log_partition, c,
                                       self.scale["start_max"], self.scale.get("given", False))
        return G, D

    def _start(self):
        """Resume from the checkpoint or start at t0: first evaluation, common scale, first record."""
        ck = self.parts.resume
        if ck is not None:
            u = self.axis.unview
            self.k, self.x, self.nfe, self.max_sphere = ck["k"], u(ck["x"]), ck["nfe"], ck["max_sphere"]
            self.drv.load_state(ck["driver"])
            if self.r is not None:
                self.r, self.radii = u(ck["r"]), _tree(ck["radii"], u)
            if self.token_gen is not None:
                self.token_gen.set_state(ck["token_noise"])
            if self.kinetic and "kinetic" not in ck:
                raise ValueError(f"the checkpoint {self.checkpointer.path} was written by a run without the kinetic "
                                 f"term (LedgerOptions.kinetic=False): it holds no ∫𝒢² dt of the steps before step "
                                 f"{ck['k']}. Resume it without kinetic=True, or delete it to start again")
            if self.kinetic:
                self.kin, self.kin_rec = u(ck["kinetic"]["acc"]), _tree(ck["kinetic"]["records"], u)
            if self.diagnostics and "heads" in ck:
                raise ValueError(f"the checkpoint {self.checkpointer.path} was written by a run without the energy "
                                 f"ledger (ledger=False): it holds no ledger of the steps before step {ck['k']}. Resume it "
                                 f"with ledger=False, or delete it to start again with ledger=True")
            if self.lazy:  # (a checkpoint of an eager run, the default of earlier versions, made the run eager)
                self.heads_rec = RecordedHeads(ck["heads"])
        self.cur = self._evaluate(self.x, self.drv.current, self.diagnostics or self.at_records)
        if (self.diagnostics or self.at_records) and ck is None and self.fix_scale(self.cur):
            self.cur = self.ev(self.x, self.drv.current, True)
        self.dens = self._densities(self.x, self.drv.current, self.cur)
        if self.kinetic and (ck is None or self.k < self.K):
            self._kinetic_start(ck is None)
        if ck is None:
            if self.diagnostics:
                self.ledger = Ledger(self.cur.energy, sign=self.ledger.sign, quadrature=self.ledger.quadrature,
                                     causal=self.ledger.causal)
            self._record()

    @property
    def t(self) -> float:
        """The time of the current step."""
        return self.drv.t

    def view(self) -> torch.Tensor:
        """The tokens in the caller's batch convention (the callback's x)."""
        return self.axis.view(self.x)

    def _scratch(self) -> torch.Tensor:
        """Memory for the next tokens that nothing holds any more: the state before the current one when
        its holders (records copy, callbacks may keep it) have let go, else new (ParticleState.scratch)."""
        return self._states.take(self.x.shape, self.x)

    def _stage(self, xs, ci):
        """The field at the stage tokens xs and Θ at t + ci·dt (a solver's stage; counted)."""
        self.nfe += 1
        return self.ev(xs, self.drv.stage(ci), False).velocity

    def step(self):
        """One step t_k → t_{k+1}: Itô terms at the left end, the solver's step (``solver.step(state, t,
        dt)``: for FixedStep the Runge–Kutta step with retraction, or the layer map, then the token noise), the
        ledger's quadrature and jumps, the record."""
        drv, x, heads, cur, c = self.drv, self.x, self.drv.current, self.cur, self.scale["c"]
        noise = drv.prepare() if self.noisy else None
        if self.diagnostics and noise is not None:  # martingale (and realised QV) at the left end (Itô)
            self.ledger.add("martingale", pairing(x, heads, self.w, cur.stats, noise, log_scale=c))
            if self.realised:
                self.ledger.add("partial", realised_qv_term(x, heads, self.w, cur.stats, noise, log_scale=c))

        state = ParticleState(x, lambda: cur.velocity, self._stage, self.geometry, self.noise, self.token_gen, self.r,
                              cur.ambient, self._scratch)
        x_new, info = self.solver.step(state, drv.t, self.dt)
        self.max_sphere = max(self.max_sphere, info.get("sphere_error", 0.0))
        if self.r is not None:
            self.r = info["radius"]
        if not check_finite(x_new):
            raise nonfinite_error("the token positions", drv.t + self.dt, self.k + 1, heads, self.normalization)
        if self.noise is not None and self.diagnostics:  # Itô terms of the token noise at the left end
            xi = info.get("noise")
            if not isinstance(xi, torch.Tensor):
                raise TypeError(f"{type(self.solver).__name__}.step must return info['noise'], the token-noise "
                                f"increment ξ at the left end (for the ledger's martingale Σ w_i⟨∇δE/δμ(x_i), ξ_i⟩)")
            self.ledger.add("martingale", noise_martingale(cur.grad_first_variation, self.w, xi))
            self.ledger.add("partial", self.dt * self.noise.ito_correction(x, heads, self.w, log_scale=c,
                                                                           stats=cur.stats))
        jumps = drv.jumps()
        drv.advance()
        nxt = self._evaluate(x_new, drv.current, self.diagnostics or (self.at_records and self.rec.keeps(self.k + 1)))
        if self.diagnostics:
            dens_new = self._densities(x_new, drv.current, nxt)
            left = drv.left_limit()  # Θ or Ȧ discontinuous at t_{k+1}: the step's right end is the left limit
            e_left = self.ev(x_new, heads if left is None else left[0], True) if jumps or left else None
            right = dens_new if left is None else self._densities(x_new, left[0], e_left, rate=left[1])
            self.ledger.integrate(self.dens, right, self.dt)
            if jumps:
                self.ledger.add("partial", nxt.energy - e_left.energy)
            self.dens = dens_new
        if self.kinetic:
            self._kinetic_step(x_new, nxt)
        self.x, self.cur, self.k = x_new, nxt, self.k + 1
        if self.rec.keeps(self.k):
            self._record()

    def finish(self) -> Trajectory:
        """The Trajectory of the records, without the paths axis when none was asked."""
        model, o, ev, drv, problem = self.problem.model, self.problem.options, self.ev, self.drv, self.problem
        times, out_x, series, ledger, observed = self.rec.stacked(o.t0, o.dt)
        noise, geometry = model.noise, self.geometry
        stats = {"steps": problem.steps, "field_evaluations": self.nfe, "max_sphere_error": self.max_sphere,
                 "wall_time": time.perf_counter() - self.parts.start, "order": getattr(problem.solver, "order", None),
                 "energy_log_scale": ev.scale["c"], "gradient_flow": not model.causal,
                 "temperature": 0.0 if noise is None else noise.temperature}
        extras = {}
        if not geometry.projected:
            stats["layer_norm"] = geometry.name
            if geometry.radius:
                extras["radius"] = torch.stack(self.radii)
        if self.kinetic:  # the running ∫𝒢² dt at the records, at the run's common scale
            extras["kinetic"] = torch.stack(self.kin_rec)
        if self.at_records:  # E, 𝒢², 𝒟 recorded by the steps themselves; no ledger
            ledger = None
        if self.lazy:  # E, 𝒢², 𝒟 from the records, on first read; no ledger (at the kinetic term's scale, if any)
            c = ev.scale["c"] if self.kinetic else o.ledger.energy_log_scale
            src = RecordedDiagnostics(model, out_x, self.heads_rec, log_scale=c,
                                      radius=extras.get("radius"), times=times, steps=self.rec.steps,
                                      chunk_elements=o.limits.chunk_elements)
            stats["energy_log_scale"] = src.log_scale
            series, ledger = dict(zip(("energy", "slope", "dissipation"), lazy_series(src))), None
        traj = Trajectory(times, out_x, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                          problem.solver.method, model.normalization.name, model.direction, model.weights,
                          drv.path() if o.saveat.path else None, observables=observed, extras=extras)
        return self.axis.finish(traj)


# ---------------------------------------------------------------------------- the parts of a particle run
def prepare_parts(problem, integrate=None, *, eager: bool = True, lazy: bool = False,
             checkpointer=None, resume=None):
    """The state (with its paths axis, expanded over the heads' batch axes) and the parts of a
    particle solve: the weight driver, the evaluator (with the fused layer-map pass where it applies);
    ``eager``/``lazy``: how the diagnostics are booked, ``checkpointer`` and ``resume`` (the checkpoint read
    before, or None) for a fixed-step run.  Every part is complete when built."""
    model, o, x0, process = problem.model, problem.options, problem.x0, problem.process
    chunk, c, weights = o.limits.chunk_elements, o.ledger.energy_log_scale, model.weights
    start = time.perf_counter()
    axis = PathsAxis(o.paths)  # the state always has the paths axis (P = 1 without paths=)
    x = axis.lift(x0)
    drv = WeightDriver(process, paths=o.paths, generator=o.generator, seed=problem.seed, t0=o.t0, dt=o.dt,
                       store=o.saveat.path, batch_rank=x0.dim() - 2)
    # tokens carry every batch axis of the heads (paths, replayed paths) from the start
    x = x.expand(*broadcast_shapes(x.shape[:-2], drv.current.batch_shape), *x.shape[-2:])
    fused = None  # the layer maps without diagnostics: one fused pass per step
    if not model.layer_norm.projected and model.normalization.plain_softmax and not model.causal and chunk is None:
        fused = FusedUpdate(weights, problem.sign)
    realised = o.ledger.quadratic_variation == "realised"
    # ∂_tE is paired with the statistics unless Θ is piecewise constant and carries no Itô term
    pairing = integrate is not None or not (drv.rate_is_zero and not (drv.noisy and not realised))
    scale = None if resume is None else resume.get("scale")  # (checkpoints of old: none, the defaults)
    # the second moment for the Itô terms of noisy weights and of noisy tokens (the Laplacian of E), with the ledger
    ev = Evaluator(weights, normalization=model.normalization, sign=problem.sign,
                   noisy=process.noisy or model.noise is not None, causal=model.causal, chunk_elements=chunk,
                   energy_log_scale=c, fused=fused, ledger=eager or integrate is not None, pairing=pairing,
                   scale=scale)
    if c is not None and o.ledger.diagnostics:  # the values at t0 must not underflow at the given scale
        with torch.no_grad():
            lp0 = softmax_statistics(x, drv.current, weights, chunk_elements=chunk).log_partition
        check_scale_fits(lp0, c)
    work = float(math.prod(x.shape[:-2])) * process.heads0.num_heads * x.shape[-2] ** 2
    return x, RunParts(drv, ev, axis, start, work, checkpointer=checkpointer, integrate=integrate, resume=resume,
                       eager=eager, lazy=lazy)


def _label(obj, known) -> str:
    """A fingerprint's label of a tableau or a normalisation: its name when it is the built-in one of
    that name, else its class and value (a user's object never passes for a built-in one)."""
    return obj.name if known.get(obj.name) == obj else f"{type(obj).__module__}.{type(obj).__qualname__}:{obj!r}"


def fingerprint_parts(problem, extra) -> list:
    """The checkpoint fingerprint's (label, values) pairs: the values in the order of the fingerprints of
    earlier versions (so ordinary checkpoints written before the labels still resume), then the inputs
    covered since: the device (when not the CPU), the generator's state, the observables' callables."""
    m, o, x0 = problem.model, problem.options, problem.x0
    norms = {name: as_normalization(name) for name in NORMALIZATIONS}
    parts = [("x0 (values, shape, dtype)", [x0]), *process_parts(problem.process)]
    solver = problem.solver
    method = _label(solver.tableau, TABLEAUX) if isinstance(getattr(solver, "tableau", None), ButcherTableau) else \
        f"{type(solver).__module__}.{type(solver).__qualname__}:{solver!r}"
    for label, v in (("t0", o.t0), ("t1", o.t1), ("dt", o.dt), ("method", method),
                     ("normalization", _label(m.normalization, norms)), ("direction", m.direction),
                     ("paths", o.paths), ("seed", problem.seed), ("record_every", problem.record_every),
                     ("quadrature", problem.quadrature), ("diagnostics", o.ledger.diagnostics)):
        parts.append((label, [v]))
    parts.append(("weights", [m.weights]))
    for key, v in extra:
        parts.append((key, [(key, v)]))
    if x0.device.type != "cpu":
        parts.append(("device", [str(x0.device)]))
    if o.generator is not None:
        parts.append(("generator (its state at the start)", [o.generator.get_state()]))
    for name, fn in problem.observables.items():
        parts.append((f"observables[{name!r}]", callable_signature(fn, f"observables[{name!r}]")))
    return parts
