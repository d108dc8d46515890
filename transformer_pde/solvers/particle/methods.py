"""The particle solvers (their keyword front end ``tp.simulate`` is :mod:`~transformer_pde.solvers.particle.front`).

    ẋ_i = V[μ_t, Θ_t](x_i),   μ_t = Σ_i w_i δ_{x_i(t)},   x_i ∈ S^{d-1}

The solver objects :class:`FixedStep` (explicit Runge–Kutta of a :class:`ButcherTableau`, with
the named :class:`Euler`, :class:`Heun`, :class:`RK4`) and :class:`Dopri5` (torchdiffeq's adaptive
dopri5) run themselves: ``solver.run(model, x0, options)`` checks the problem once
(:class:`ParticleProblem`, before any work), prepares the weight driver and the evaluator, and
calls the solve of :mod:`~transformer_pde.solvers.particle.fixed_step` (the geometry's retraction or layer
map, "euler" is the reference code's projected Euler) or :mod:`~transformer_pde.solvers.particle.adaptive`.
:func:`transformer_pde.solve` calls ``run``; :func:`simulate` turns its keywords into a
:class:`~transformer_pde.Model`, a solver and the options objects and calls
:func:`transformer_pde.solve`; it checks each keyword in its own name before it builds anything.  The result
and the errors live in :mod:`~transformer_pde.solvers.trajectory`, the tableaux in
:mod:`~transformer_pde.solvers.tableaux`.  Along the way the
solver keeps the energy–dissipation ledger of docs/model.md#ledger (see :class:`Trajectory`).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, FrozenSet, Mapping, Optional, Tuple, Union

import torch

from ...utils import threads
from ...utils.validation import (
    check_bool, check_choice, check_every, check_limits, check_positive, check_same,
    check_tied_all, check_token_weights, check_tokens,
)
from ...model.backends import DEFAULT_CHUNK_ELEMENTS
from ...model.field import check_causal_mode, evaluate  # noqa: F401  (evaluate: the name tests patch to see no work ran)
from ...model.heads import broadcast_shapes
from ...processes.driver import path_bytes
from ...processes.paths import WeightPath
from ...processes.weights import Constant, Process
from ...dynamics.layernorm import check_layer_norm_method
from ...dynamics.model import Model
from ..solver import Solver
from ..options import (
    SolveOptions,
)
from ..parts import Checkpointer, Stepper, check_observables
from ..tableaux import ADAPTIVE_ATOL, ADAPTIVE_RTOL, TABLEAUX, ButcherTableau
from ..trajectory import (
    Trajectory,
)
from .adaptive import dopri5, solve_adaptive
from .fixed_step import FixedStepRun, fingerprint_parts, prepare_parts

__all__ = ["ParticleSolver", "FixedStep", "Euler", "Heun", "RK4", "Dopri5", "PROGRESS_MIN_WORK"]

#: ``progress=None`` shows a bar (on a terminal only) when steps · stages · paths · H · n² reaches this
#: many kernel terms (a solve of several seconds on one core)
PROGRESS_MIN_WORK = 1e9

#: named internal API (not public): the checked problem of a particle solve; the non-finite error
__internal__ = ["ParticleProblem", "check_adaptive_tolerance"]

_dopri5 = dopri5  # the dopri5 driver the adaptive solve calls (read here at every call, so it can be patched)

# ---------------------------------------------------------------------------- the solver objects
class ParticleSolver(Solver):
    """Base class of the particle solvers: define ``step(state, t, dt) -> (x_new, info)`` and get the rest.

    :meth:`init` checks the problem (:class:`ParticleProblem`, before any work), reads the checkpoint it
    resumes, prepares the weight driver and the evaluator and starts the particle run
    (:class:`~transformer_pde.solvers.particle.fixed_step.FixedStepRun`: the first evaluation, the common scale, the
    first record); ``run`` (the base class's) steps it with the loop of :mod:`~transformer_pde.solvers.loop`:
    progress, callbacks, checkpoints and resume, records, observables, the lazy diagnostics and the energy
    ledger come from there.  ``step`` reads a :class:`~transformer_pde.solvers.loop.ParticleState` (the tokens,
    the field at the left end and ``state.field(x, c)`` at the stages, the geometry, the token noise and its
    generator) and returns the new tokens and a dict: ``"noise"`` the token-noise increment ξ at the left end
    when the model has token noise (the ledger's martingale), optionally ``"sphere_error"``.

    ``method`` (``Trajectory.method``; default the class name in lower case), ``order`` (``stats["order"]``)
    and ``stages`` (field evaluations per step, for the memory estimate and the progress rule) describe it."""

    order: ClassVar[Optional[int]] = None
    stages: ClassVar[int] = 1

    @property
    def method(self) -> str:
        """``Trajectory.method``: the class name in lower case unless a subclass says otherwise."""
        return type(self).__name__.lower()

    def init(self, model: Model, x0: torch.Tensor, options: SolveOptions):
        """The checked problem's run at t0, or at the step of the checkpoint it resumes.

        Parameters
        ----------
        model : Model
            the dynamics.
        x0 : torch.Tensor
            the initial tokens (..., n, d).
        options : SolveOptions
            the grid, the random stream and the options objects.

        Returns
        -------
        FixedStepRun
            the started run.
        """
        return _start_particle(ParticleProblem.check(model, x0, self, options))


@dataclass(frozen=True, eq=False)
class FixedStep(ParticleSolver):
    """An explicit Runge–Kutta method of fixed step ``dt`` (given to :func:`~transformer_pde.solve`):
    the stages of ``tableau`` (a :class:`~transformer_pde.ButcherTableau`, or a name of ``TABLEAUX``),
    each retracted to the sphere by the model's geometry (or, Euler only, the geometry's layer map).

    Two FixedStep solvers are equal when their tableaux are (``Euler() == FixedStep("euler")``)."""

    tableau: Union[str, ButcherTableau] = "euler"

    def __post_init__(self):
        t = self.tableau
        if isinstance(t, str):
            check_choice(t, tuple(TABLEAUX), "FixedStep.tableau")
            t = TABLEAUX[t]
        elif not isinstance(t, ButcherTableau):
            raise TypeError(f"FixedStep.tableau must be a ButcherTableau or one of {tuple(TABLEAUX)}, got "
                            f"{type(t).__name__}")
        object.__setattr__(self, "tableau", t)

    @property
    def method(self) -> str:
        """The tableau's name (``Trajectory.method``)."""
        return self.tableau.name

    @property
    def order(self) -> int:
        """The tableau's order."""
        return self.tableau.order

    def __eq__(self, other):
        if not isinstance(other, FixedStep):
            return NotImplemented
        return self.tableau == other.tableau

    def __hash__(self):
        return hash((FixedStep, self.tableau))

    def __repr__(self):
        t = self.tableau
        return f"FixedStep({t.name!r})" if TABLEAUX.get(t.name) == t else f"FixedStep({t!r})"

    @property
    def stages(self) -> int:
        """The tableau's stages (field evaluations per step)."""
        return self.tableau.stages

    def step(self, state, t: float, dt: float):
        """The tableau's Runge–Kutta step with the geometry's retraction (or its layer map), then the token noise.

        Parameters
        ----------
        state : ParticleState
            the tokens and the field at t, the stage field, the geometry, the token noise.
        t : float
            the left end.
        dt : float
            the step.

        Returns
        -------
        tuple
            (the new tokens, {"sphere_error", "radius", and "noise": the token-noise increment when there is one}).
        """
        g, radius = state.geometry, state.radius
        if g.projected:
            x_new, err = _stepper(self.tableau, g).step(state.x, state.velocity, dt, state.field)
        else:  # a layer map (post-, pre-, peri-LN, nGPT) of the signed, un-projected attention update
            tracked = torch.is_grad_enabled() and (state.x.requires_grad or state.ambient.requires_grad)
            if state.scratch is not None and not tracked and _step_takes_out(type(g)):
                x_new, radius, err = g.step(state.x, radius, state.ambient, dt, out=state.scratch())
            else:
                x_new, radius, err = g.step(state.x, radius, state.ambient, dt)
        info = {"sphere_error": err, "radius": radius}
        if state.noise is not None:  # projected Euler–Maruyama after the deterministic step (weak order 1)
            info["noise"] = xi = state.noise.increment(x_new, dt, state.generator)
            x_new = state.noise.apply(x_new, xi)
        return x_new, info


@functools.lru_cache(maxsize=None)
def _step_takes_out(cls) -> bool:
    """Whether the layer map's ``step`` of ``cls`` takes ``out=`` (memory for the new tokens); a user's
    override without it is called as before."""
    try:
        return "out" in inspect.signature(cls.step).parameters
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=64)
def _cached_stepper(tableau: ButcherTableau, geometry) -> Stepper:
    return Stepper(tableau, retract=True, geometry=geometry)


def _stepper(tableau: ButcherTableau, geometry) -> Stepper:
    """The Runge–Kutta step of ``tableau`` with the retraction of ``geometry`` (built once per hashable pair)."""
    try:
        return _cached_stepper(tableau, geometry)
    except TypeError:  # an unhashable geometry of the user's
        return Stepper(tableau, retract=True, geometry=geometry)


class Euler(FixedStep):
    """Projected Euler (order 1, the reference code's step): ``FixedStep("euler")``."""

    def __init__(self):
        super().__init__("euler")

    def __repr__(self):
        return "Euler()"


class Heun(FixedStep):
    """Projected Heun (order 2): ``FixedStep("heun")``."""

    def __init__(self):
        super().__init__("heun")

    def __repr__(self):
        return "Heun()"


class RK4(FixedStep):
    """Projected classical Runge–Kutta (order 4): ``FixedStep("rk4")``."""

    def __init__(self):
        super().__init__("rk4")

    def __repr__(self):
        return "RK4()"


@dataclass(frozen=True)
class Dopri5(Solver):
    """torchdiffeq's adaptive dopri5 on the projected field; ``dt`` of :func:`~transformer_pde.solve` is
    the grid on which stochastic weights are sampled.  ``adjoint=True`` backpropagates by the
    adjoint ODE (memory independent of the number of steps).  No checkpoints, no token noise.

    It keeps torchdiffeq's own loop instead of the step protocol of :mod:`~transformer_pde.solvers.loop`:
    its steps are accepted or rejected inside ``odeint``, its outputs are interpolated onto the record grid,
    and the adjoint integrates the backward ODE with the same loop; taking its steps one by one through
    the loop would give up ``odeint_adjoint`` (memory independent of the number of steps) and its dense
    output.  So it overrides ``run``."""

    rtol: float = ADAPTIVE_RTOL
    atol: float = ADAPTIVE_ATOL
    adjoint: bool = False
    accepts: ClassVar[FrozenSet[str]] = frozenset({"saveat", "ledger", "limits"})
    #: the ledger is the trapezoid rule on the record grid: there is no quadrature to choose; its records are on
    #: torchdiffeq's output grid, not steps of its own (no diagnostics at the record steps)
    unsupported: ClassVar[Mapping[str, Tuple[str, ...]]] = {"ledger": ("quadrature", "records")}
    #: ``Trajectory.method`` and the ``method=`` of :func:`simulate`
    method: ClassVar[str] = "adaptive"

    def __post_init__(self):
        object.__setattr__(self, "rtol", check_positive(self.rtol, "Dopri5.rtol"))
        object.__setattr__(self, "atol", check_positive(self.atol, "Dopri5.atol"))
        check_bool(self.adjoint, "Dopri5.adjoint")

    def run(self, model: Model, x0: torch.Tensor, options: SolveOptions) -> Trajectory:
        """The adaptive solve (:meth:`transformer_pde.solvers.solver.Solver.run`).

        Parameters
        ----------
        model : Model
            the dynamics (no token noise).
        x0 : torch.Tensor
            the initial tokens (..., n, d).
        options : SolveOptions
            the grid (dt: where stochastic weights are sampled), the random stream, the options.

        Returns
        -------
        Trajectory
            the solution on the record grid.
        """
        problem = ParticleProblem.check(model, x0, self, options)
        x, parts = prepare_parts(problem, integrate=_dopri5)
        with threads.scope(parts.work):
            traj = solve_adaptive(x, problem, parts)
        return parts.axis.finish(traj)


# ---------------------------------------------------------------------------- the checked problem
@dataclass(frozen=True)
class ParticleProblem:
    """A particle solve's inputs, checked once before any work (:meth:`check`), with what the checks
    resolve: the weight process, the direction's sign, the number of steps, the record stride, the
    ledger's quadrature, the observables and the seed of the weights' stream."""

    model: Model
    x0: torch.Tensor
    solver: Solver
    options: SolveOptions
    process: Process
    sign: float
    steps: int
    record_every: int
    quadrature: str
    observables: Dict[str, Callable]
    seed: int

    @classmethod
    def check(cls, model: Model, x0: torch.Tensor, solver: Solver, options: SolveOptions) -> "ParticleProblem":
        """Every check of a particle solve that needs x0 (the model and the options objects checked
        themselves when built); TypeError / ValueError before any work."""
        check_tokens(x0, "x0")
        o, method, adaptive = options, solver.method, isinstance(solver, Dopri5)
        K, t0, t1, dt = o.steps, o.t0, o.t1, o.dt
        record_every = check_every(o.saveat.stride(K), "SaveAt.record_every", K,
                                   f"t0 = {t0:.6g} to t1 = {t1:.6g} in steps dt = {dt:.6g}")
        check_layer_norm_method(model.layer_norm, method)
        if adaptive:
            check_adaptive_tolerance(solver.rtol, x0.dtype)
        if adaptive and model.noise is not None:
            raise ValueError(f"temperature = {model.noise.temperature} (token noise) needs a fixed-step solver "
                             f"(tp.Euler(), tp.Heun(), tp.RK4()): Dopri5 integrates an ODE and cannot take token noise")
        if adaptive and o.ledger.kinetic_only:
            raise ValueError("LedgerOptions(kinetic=True) accumulates ∫𝒢² dt over fixed steps (tp.Euler(), tp.Heun(), "
                             "tp.RK4()); Dopri5's steps are torchdiffeq's own: ask it for the ledger instead "
                             "(LedgerOptions(ledger=True) with SaveAt(record_every=1): the trapezoid rule of 𝒢² on the "
                             "record grid, traj.kinetic) or use a fixed-step solver")
        quadrature = o.ledger.quadrature or ("left" if method == "euler" else "trapezoid")
        obs = check_observables(o.saveat.observables)
        process, norm = model.process, model.normalization
        h0 = process.heads0
        check_same(x0, h0.reference, "x0", "theta's heads")
        if not norm.uses_value:  # the gradient of E: defined for tied heads (V_h = A_h)
            check_tied_all(process, f"normalization={norm.name!r}")
        if h0.dim != x0.shape[-1]:
            raise ValueError(f"the heads act on d = {h0.dim} but x0 has d = {x0.shape[-1]}")
        bx, bh = tuple(x0.shape[:-2]), tuple(h0.batch_shape)
        if isinstance(process, WeightPath):
            process.check_covers(t0, t1)
            bh = tuple(process.scores.shape[1:-3])
            if o.paths is not None:
                raise ValueError("a stored WeightPath already carries its paths axis; call simulate without paths=")
        if o.paths is None and not isinstance(process, WeightPath) and bh and bh != bx[len(bx) - len(bh):]:
            raise ValueError(f"the heads' batch shape {bh} must be empty or a suffix of x0's batch shape {bx}")
        if o.paths is not None and bh and bh != bx:
            raise ValueError(f"with paths=, the heads' batch shape {bh} must be empty or equal to x0's batch shape "
                             f"{bx}")
        check_token_weights(model.weights, x0, "weights", "x0")
        lim = o.limits
        check_limits(f"simulate from t0 = {t0:.6g} to t1 = {t1:.6g} with dt = {dt:.6g}", steps=K,
                     memory=_estimate_memory(x0, process, K=K, record_every=record_every, paths=o.paths,
                                             method="adaptive" if adaptive else getattr(solver, "tableau",
                                                                                         solver.stages),
                                             diagnostics=(o.ledger.diagnostics, o.ledger.lazy), return_path=o.saveat.path,
                                             chunk_elements=lim.chunk_elements, noisy=process.noisy, obs=obs),
                     max_steps=lim.max_steps, max_memory=lim.max_memory, device=x0.device,
                     fix="record fewer steps (record_every=), use fewer paths, a larger dt or chunk_elements=")
        return cls(model, x0, solver, options, process, model.sign, K, record_every, quadrature, obs,
                   o.weight_seed)


def _start_particle(problem: ParticleProblem):
    """The started run of a checked problem: the checkpointer and the checkpoint it resumes first (which
    decide how the diagnostics are booked), then the parts, the progress rule, the first evaluation."""
    model, o, solver = problem.model, problem.options, problem.solver
    noise, geometry, obs, c = model.noise, model.layer_norm, problem.observables, o.ledger.energy_log_scale
    # options added later enter the checkpoint's fingerprint only when not at their default, so that
    # checkpoints of ordinary runs written before them still resume
    realised = o.ledger.quadratic_variation == "realised"
    extra = ([("causal", model.causal)] if model.causal else []) \
        + ([("quadratic_variation", "realised")] if realised else []) \
        + ([("energy_log_scale", c)] if c is not None else []) \
        + ([("observables", tuple(sorted(obs)))] if obs else []) \
        + ([("layer_norm", repr(geometry))] if not geometry.projected else []) \
        + ([("temperature", (noise.temperature, noise.seed))] if noise is not None else []) \
        + ([("records", o.ledger.records)] if o.ledger.at_record_steps else [])
    ck = o.checkpoint
    ckpt = Checkpointer(None if ck is None else ck.path, 200 if ck is None else ck.every,
                        problem.steps, lambda: fingerprint_parts(problem, extra))
    resume = ckpt.load(problem.x0.device)
    eager, lazy = o.ledger.diagnostics and o.ledger.ledger, o.ledger.lazy
    if lazy and resume is not None and "heads" not in resume:
        # written by an eager run (the default of earlier versions): continue it eagerly
        eager, lazy = True, False
    x, parts = prepare_parts(problem, eager=eager, lazy=lazy, checkpointer=ckpt, resume=resume)
    show = o.progress.show if o.progress.show is not None else \
        problem.steps * solver.stages * parts.work >= PROGRESS_MIN_WORK
    return FixedStepRun(x, problem, parts, show)


def _estimate_memory(x0, process, *, K, record_every, paths, method, diagnostics, return_path, chunk_elements, noisy,
                     obs):
    """Estimated bytes of the large arrays of a solve (name -> bytes), before any of them exists; ``method``:
    "adaptive", a tableau or its name; ``diagnostics``: (diagnostics, lazy) of the LedgerOptions, or a bool
    (the diagnostics, booked at every step)."""
    diagnostics, lazy = diagnostics if isinstance(diagnostics, tuple) else (diagnostics, False)
    item = x0.element_size()
    n, d = x0.shape[-2], x0.shape[-1]
    h0 = process.heads0
    H = h0.num_heads
    hb = tuple(process.scores.shape[1:-3]) if isinstance(process, WeightPath) else tuple(h0.batch_shape)
    try:
        batch = tuple(broadcast_shapes(tuple(x0.shape[:-2]), hb))
    except RuntimeError:
        batch = tuple(x0.shape[:-2])
    B = float(math.prod(batch)) * (paths or 1)
    T = K // record_every + 2
    out = {"the recorded tokens": T * B * n * d * item}
    if diagnostics:
        out["the recorded energy, 𝒢², 𝒟 and ledger"] = T * B * 10 * item
    if obs:
        out["the observables"] = T * B * d * len(obs) * item
    if lazy and not isinstance(process, Constant):  # the heads of every record, for the diagnostics on first read
        out["the recorded heads"] = path_bytes(h0, T, paths, False) / 2  # Θ of each record (the heads' own batch)
    block = B * H * n * n
    cap = chunk_elements if chunk_elements is not None else DEFAULT_CHUNK_ELEMENTS
    out["the kernel blocks"] = min(block, max(cap, B * H * n)) * item * 4
    stages = 7 if method == "adaptive" else method if isinstance(method, int) else \
        (method if isinstance(method, ButcherTableau) else TABLEAUX[method]).stages
    out["the field and its stages"] = B * H * n * (d * d if noisy else d) * item * 2 + (stages + 2) * B * n * d * item
    stored = return_path or (method == "adaptive" and not process.closed_form and not isinstance(process, WeightPath))
    if stored or not process.closed_form and not isinstance(process, WeightPath):
        # the path has the heads' own batch axes (in h0's element count), not the tokens' (Θ is shared by them)
        out["the weight path"] = path_bytes(h0, K if stored else 1, paths, noisy)
    if method == "adaptive":
        out["the adaptive solution on the record grid"] = T * B * n * d * item * 2
    return out



# ---------------------------------------------------------------------------- simulate


def check_adaptive_tolerance(rtol: float, dtype: torch.dtype) -> None:
    """ValueError when the relative tolerance ``rtol`` of the adaptive solver (and of its adjoint ODE) lies below the
    round-off of ``dtype``, u = eps/2: the tokens hold no more digits, so the error test cannot pass and the steps
    shrink until they underflow."""
    eps = torch.finfo(dtype).eps
    if rtol < eps / 2:
        raise ValueError(f"rtol = {rtol:g} is below the round-off of {dtype} (eps = {eps:g}, eps/2 = {eps / 2:g}): the "
                         f"adaptive solver cannot meet a relative tolerance finer than the dtype holds and its steps "
                         f"would shrink until they underflow; use rtol >= {eps / 2:g} or float64 tokens")
