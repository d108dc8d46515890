"""The checked JKO problem (docs/model.md#jko): every check of a JKO solve, before any work, and the
:class:`JKOProblem` they produce.

:func:`check_problem` reads the :class:`~transformer_pde.Model` (its resolved objects: the normalisation's
``jko_mobility``, the geometry's retraction, the token noise, the token weights), the solver object
(:class:`~transformer_pde.LagrangianJKO` with its transport term and inner optimiser, or
:class:`~transformer_pde.EulerianJKO` with its grid) and the :class:`~transformer_pde.SolveOptions` (the grid
t0, τ = dt, t1; paths and the random stream; the options objects).  It refuses what the JKO schemes do not solve
or take, checks the initial measure (tokens and token weights, or the grid and its weights), resolves the
defaults (the inner tolerance), estimates the memory of the run against the limits and checks Θ_t's grid
(:mod:`~transformer_pde.solvers.jko.theta`).  The result is frozen: the run
(:mod:`~transformer_pde.solvers.jko.run`) only reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ...utils.validation import (
    broadcast_shapes, check_every, check_limits, check_same, check_seed_generator, check_tied_all,
    check_token_weights, check_tokens, direction_sign,
)
from ...model.heads import Heads
from ...model.normalization import Effective, Normalization, Unnormalized
from ...processes.driver import path_bytes
from ...processes.paths import WeightPath
from ...processes.weights import Process
from ...dynamics.model import Model
from ..options import SolveOptions
from .eulerian import EulerianStep, resolve_grid, to_grid
from .lagrangian import LagrangianStep
from .theta import check_theta_grid

__all__ = []  # the JKO solve's parts; users call tp.jko / tp.solve(..., tp.LagrangianJKO(...))
__internal__ = ["JKOProblem", "check_problem", "VARIANTS"]

#: the two JKO variants: the tokens move, or weights on a fixed grid move
VARIANTS = ("lagrangian", "eulerian")


@dataclass(frozen=True, eq=False)
class JKOProblem:
    """A JKO solve, checked (module docstring).

    model, options : the :class:`~transformer_pde.Model` and :class:`~transformer_pde.SolveOptions` solved.
    variant : "lagrangian" or "eulerian".
    transport, cost : the transport term's name ("emd", "sinkhorn", "identity") and cost ("source", "symmetric").
    step : the settings of one step (:class:`~.lagrangian.LagrangianStep` or
        :class:`~.eulerian.EulerianStep`).
    metric : the normalisation whose field is the scheme's gradient flow ("effective": mobility b_k;
        "unnormalized": b ≡ 1), the one its energies, 𝒢² and 𝒟 are reported in.
    steps, record_every : the number of steps and the record stride.
    seed : the weights' seed (None when a generator draws them).
    path_dt, strict : the sampling grid of noisy weights (None: τ); raise on an unconverged step.
    initial : the initial state, tokens x0 (..., n, d) (Lagrangian) or grid weights q0 (..., m) (Eulerian).
    grid : the grid z (m, d) (Eulerian; None otherwise).
    batch : the batch shape of the measure broadcast against the heads' (without a paths axis).
    """

    model: Model
    options: SolveOptions
    variant: str
    transport: str
    cost: str
    step: Union[LagrangianStep, EulerianStep]
    metric: Normalization
    steps: int
    record_every: int
    seed: Optional[int]
    path_dt: Optional[float]
    strict: bool
    initial: torch.Tensor
    grid: Optional[torch.Tensor]
    batch: tuple

    @property
    def lagrangian(self) -> bool:
        return self.variant == "lagrangian"

    @property
    def tau(self) -> float:
        return self.options.dt

    @property
    def t0(self) -> float:
        return self.options.t0

    @property
    def paths(self) -> Optional[int]:
        return self.options.paths

    @property
    def sign(self) -> float:
        """+1 ascent, −1 descent (the sign of the field); the step minimises s'E with s' = −sign."""
        return -self.step.sgn

    @property
    def unit(self) -> bool:
        """Unit mobility b ≡ 1 (the plain W2 flow)."""
        return self.metric.jko_mobility == "unit"

    @property
    def diagnostics(self) -> bool:
        return self.options.ledger.diagnostics

    @property
    def temperature(self) -> float:
        """T of the token noise (Eulerian: the entropy T∫ρ log ρ; 0 without)."""
        return self.model.temperature

    @property
    def eps(self) -> Optional[float]:
        """ε of the entropic transport (None without one)."""
        return self.step.eps if self.transport == "sinkhorn" else None


def _check_model(model: Model, solver, options: SolveOptions) -> None:
    """Refuse a model, or an option, the JKO schemes do not solve or take (before any work)."""
    name = type(solver).__name__
    if not isinstance(model, Model):
        raise TypeError(f"model must be a tp.Model, got {type(model).__name__}")
    if not isinstance(options, SolveOptions):
        raise TypeError(f"options must be a tp.SolveOptions, got {type(options).__name__}")
    if options.checkpoint is not None:
        raise TypeError(f"{name} has no checkpoints: drop checkpoint=")
    norm = model.normalization
    if norm.jko_mobility is None:
        raise ValueError(f"{name} solves the gradient flow of E: model.normalization must be 'effective' (mobility "
                         f"b_k) or 'unnormalized' (b ≡ 1), got {norm.name!r} (softmax equals 'effective' for one head)")
    ledger, saveat = options.ledger, options.saveat
    if ledger.quadrature is not None or ledger.quadratic_variation != "expected" or \
            ledger.energy_log_scale is not None:
        raise TypeError(f"{name} keeps its own ledger: LedgerOptions takes only diagnostics= and ledger= here (the ledger is always kept)")
    if saveat.observables is not None or saveat.path:
        raise TypeError(f"{name} records no observables and always returns a sampled noisy path: use "
                        f"SaveAt(record_every=...) or SaveAt(ends=True)")
    if not model.layer_norm.projected or model.causal:
        raise ValueError(f"{name} solves the projected, non-causal model only")
    if options.limits.chunk_elements is not None:
        raise TypeError(f"{name} has no chunked kernel: drop Limits(chunk_elements=)")
    if solver.variant == "lagrangian" and model.noise is not None:
        raise ValueError("token noise with a JKO solver needs EulerianJKO (the entropy of a density on a grid)")
    if solver.variant == "eulerian" and model.weights is not None:
        raise ValueError("EulerianJKO carries its weights on the grid: give EulerianJKO(grid_weights=...) instead "
                         "of Model(weights=...)")


def _check_x0(x0, h_ref: Heads):
    check_tokens(x0, "x0")
    check_same(x0, h_ref.reference, "x0", "theta's heads")
    if x0.shape[-1] != h_ref.dim:
        raise ValueError(f"the heads act on d = {h_ref.dim} but x0 has d = {x0.shape[-1]}")


def _check_measure(model: Model, x0, solver):
    """The checks of the initial measure: tokens x0 and their weights (Lagrangian), or the grid z and its weights
    q0 (given, or x0 deposited with :func:`to_grid`) (Eulerian).  Returns (initial state, grid z or None)."""
    h_ref = model.theta.heads0
    check_tied_all(model.theta, "jko")
    if solver.variant == "lagrangian":
        if x0 is None:
            raise ValueError("the Lagrangian scheme needs the initial tokens x0 (..., n, d)")
        _check_x0(x0, h_ref)
        check_token_weights(model.weights, x0, "weights", "x0")
        return x0, None
    z = resolve_grid(solver.grid, h_ref.dim, h_ref.dtype, h_ref.device)
    check_same(z, h_ref.reference, "grid", "theta's heads")
    if solver.grid_weights is None:
        if x0 is None:
            raise ValueError("the Eulerian scheme needs grid_weights= (..., m) or tokens x0 to deposit on the grid")
        _check_x0(x0, h_ref)
        return to_grid(x0, z, bandwidth=solver.bandwidth), z
    if x0 is not None:
        raise ValueError("give either tokens x0 or grid_weights for the Eulerian scheme, not both")
    check_token_weights(solver.grid_weights, z, "grid_weights", "grid")
    return solver.grid_weights, z


def _measure_batch(initial: torch.Tensor, model: Model, lagrangian: bool) -> tuple:
    """The batch shape of the initial measure broadcast against the heads' (without a paths axis)."""
    xb = tuple(initial.shape[:-2] if lagrangian else initial.shape[:-1])
    if lagrangian and model.weights is not None:
        xb = tuple(broadcast_shapes(xb, model.weights.shape[:-1]))
    hb = tuple(model.theta.heads0.batch_shape)
    try:
        return tuple(broadcast_shapes(xb, hb))
    except RuntimeError:
        raise ValueError(f"the batch shape of the initial measure {xb} does not broadcast against the heads' "
                         f"batch shape {hb}") from None


def _estimate_memory(p: JKOProblem) -> dict:
    """Estimated bytes of the large arrays of a JKO solve (name -> bytes), before any of them exists."""
    state, theta = p.initial, p.model.theta
    item = state.element_size()
    h0 = theta.heads0
    H, d = h0.num_heads, h0.dim
    n = state.shape[-2] if p.lagrangian else p.grid.shape[-2]
    xb = tuple(state.shape[:-2] if p.lagrangian else state.shape[:-1])
    B = float(math.prod(xb)) * float(math.prod(tuple(h0.batch_shape)) or 1) * (p.paths or 1)
    T = p.steps // p.record_every + 2
    out = {"the recorded measures": T * B * n * (d + 1) * item, "the kernel blocks": B * H * n * n * item * 4,
           "the transport plans and costs": B * n * n * item * 4}
    if isinstance(theta, Process) and not isinstance(theta, WeightPath) and not theta.closed_form:
        dt = p.tau if p.path_dt is None else p.path_dt
        K = max(1, round(p.steps * p.tau / dt))
        out["the sampled weight path"] = path_bytes(h0, K, p.paths, theta.noisy)
    return out


def _step_settings(model: Model, solver, initial: torch.Tensor, sgn: float, tau: float):
    """(transport, cost, step settings) of the solver, with the default inner tolerance resolved."""
    float64 = initial.dtype == torch.float64
    unit = model.normalization.jko_mobility == "unit"
    if solver.variant == "eulerian":
        tol = solver.tol if solver.tol is not None else (1e-9 if float64 else 1e-4)
        return "sinkhorn", "symmetric", EulerianStep(tau, sgn, solver.eps, tol, solver.max_iter, model.temperature)
    tr, inner = solver.transport, solver.inner
    sinkhorn = tr.name == "sinkhorn"
    tol = inner.tol if inner.tol is not None else ((1e-6 if sinkhorn else 1e-9) if float64 else 1e-4)
    cost = "symmetric" if sinkhorn else tr.cost
    step = LagrangianStep(tau, sgn, tr.name, cost == "symmetric", unit, tr.eps if sinkhorn else 1e-3,
                          tr.scaling if sinkhorn else 0.95, tol, inner.max_iter, inner.max_plan_updates,
                          model.layer_norm.retract)
    return tr.name, cost, step


def check_problem(model: Model, x0: Optional[torch.Tensor], solver, options: SolveOptions) -> JKOProblem:
    """Every check of a JKO solve, before any work (module docstring); the :class:`JKOProblem`.

    Parameters
    ----------
    model : Model
        the dynamics (projected, non-causal; normalisation with a JKO mobility).
    x0 : torch.Tensor or None
        the initial tokens (Eulerian: None when the solver carries grid weights).
    solver : LagrangianJKO or EulerianJKO
        the scheme with its settings (read: ``variant``, ``path_dt``, ``strict`` and the variant's fields).
    options : SolveOptions
        the grid, the random stream and the options objects.

    Returns
    -------
    JKOProblem
        the checked problem.
    """
    _check_model(model, solver, options)
    steps, tau = options.steps, options.dt
    sign = direction_sign(model.direction)
    seed = check_seed_generator(options.seed, options.generator)
    if options.generator is not None:
        seed = None  # the draws come from the generator (sample_path refuses a seed next to it)
    record_every = check_every(options.saveat.stride(steps), "record_every", steps,
                               f"steps = {steps} of tau = {tau:.6g}")
    initial, z = _check_measure(model, x0, solver)
    transport, cost, step = _step_settings(model, solver, initial, -sign, tau)
    metric = Unnormalized() if model.normalization.jko_mobility == "unit" else Effective()
    p = JKOProblem(model, options, solver.variant, transport, cost, step, metric, steps, record_every, seed,
                   solver.path_dt, solver.strict, initial, z, _measure_batch(initial, model, solver.variant ==
                                                                            "lagrangian"))
    limits = options.limits
    check_limits(f"jko with {steps} steps of tau = {tau:.6g}", steps=steps, memory=_estimate_memory(p),
                 max_steps=limits.max_steps, max_memory=limits.max_memory, device=initial.device,
                 fix="record fewer steps (record_every=), use fewer paths or a coarser path_dt")
    check_theta_grid(model.theta, t0=options.t0, tau=tau, steps=steps, paths=options.paths, path_dt=p.path_dt,
                     limits=limits)
    return p
