"""``tp.simulate``: the keyword front end of the particle solvers, and their argument checks.

    ẋ_i = V[μ_t, Θ_t](x_i),   μ_t = Σ_i w_i δ_{x_i(t)},   x_i ∈ S^{d-1}

:func:`simulate` turns its keywords into the objects of the composable API — a
:class:`~transformer_pde.Model`, a solver (:class:`~transformer_pde.FixedStep` or
:class:`~transformer_pde.Dopri5`) and the options objects (:class:`~transformer_pde.SaveAt`,
:class:`~transformer_pde.LedgerOptions`, :class:`~transformer_pde.Checkpointing`,
:class:`~transformer_pde.Progress`, :class:`~transformer_pde.Limits`) — and runs the code that
:func:`transformer_pde.solve` runs (:func:`solve_particles`).  The solves themselves live in
:mod:`~transformer_pde.solvers.fixed_step` (explicit Runge–Kutta with the geometry's retraction,
"euler" is the reference code's projected Euler) and :mod:`~transformer_pde.solvers.adaptive`
(torchdiffeq's dopri5 on the projected field); the result and the errors in
:mod:`~transformer_pde.solvers.trajectory`, the tableaux in :mod:`~transformer_pde.solvers.tableaux`
(re-exported here for old imports).  Along the way the solver keeps the energy–dissipation ledger
of docs/model.md#ledger (see :class:`Trajectory`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch

from ..utils import threads
from ..utils.validation import (
    check_bool, check_choice, check_output_file, check_every, check_int, check_limits, check_positive, check_real,
    check_same, check_seed_generator, check_tied_all, check_token_weights, check_tokens, direction_sign,
)
from ..model.normalization import NORMALIZATIONS
from ..model.backends import DEFAULT_CHUNK_ELEMENTS
from ..model.softmax import softmax_statistics
from ..model.energy import check_scale_fits
from ..model.normalization import choose as choose_normalization, names
from ..model.field import check_causal_mode, evaluate  # noqa: F401  (evaluate: the name tests patch to see no work ran)
from ..model.heads import Heads, broadcast_shapes
from ..processes.driver import WeightDriver, grid_steps, path_bytes
from ..processes.paths import WeightPath
from ..processes.weights import Constant, Process
from .adaptive import dopri5, solve_adaptive
from .evaluator import Evaluator
from .fixed_step import solve_fixed_step
from .layernorm import FusedUpdate, LayerNorm, check_layer_norm_method, layer_norm_scheme
from .methods import Dopri5, FixedStep
from .model import Model
from .noise import TokenNoise, token_noise
from .options import QUADRATIC_VARIATIONS, Checkpointing, LedgerOptions, Limits, Progress, SaveAt
from .parts import LEDGER_KEYS, Checkpointer, callable_signature, check_observables, process_parts
from .tableaux import METHODS, TABLEAUX, ButcherTableau
from .trajectory import (
    NonFiniteError, PathsAxis, Trajectory, check_finite, check_ledger, ledger_nonfinite, nonfinite_error,
)

__all__ = ["simulate", "Trajectory", "ButcherTableau", "TABLEAUX", "METHODS", "NonFiniteError", "LEDGER_KEYS",
           "QUADRATIC_VARIATIONS", "PROGRESS_MIN_WORK"]

#: ``progress=None`` shows a bar (on a terminal only) when steps · stages · paths · H · n² reaches this
#: many kernel terms (a solve of several seconds on one core)
PROGRESS_MIN_WORK = 1e9

#: named internal API (not public), used by tp.solve, the sharded solver and the JKO scheme
__internal__ = ["nonfinite_error", "solve_particles"]

# the old private names of this module (tests and scripts import or patch them here)
_WeightDriver = WeightDriver
_Evaluator = Evaluator
_ledger_nonfinite, _check_finite, _check_ledger = ledger_nonfinite, check_finite, check_ledger
_dopri5 = dopri5  # the dopri5 driver the adaptive solve calls (read here at every call, so it can be patched)


# ---------------------------------------------------------------------------- simulate
def simulate(
    x0: torch.Tensor,
    theta: Union[Heads, Process],
    *,
    t1: float,
    dt: float,
    t0: float = 0.0,
    method: str = "euler",
    normalization: str = "softmax",
    direction: str = "descent",
    weights: Optional[torch.Tensor] = None,
    paths: Optional[int] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    record_every: int = 1,
    diagnostics: bool = True,
    quadrature: Optional[str] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    adjoint: bool = False,
    return_path: bool = False,
    progress: Optional[bool] = None,
    chunk_elements: Optional[int] = None,
    checkpoint: Optional[Union[str, Path]] = None,
    checkpoint_every: int = 200,
    callback: Optional[Callable] = None,
    causal: bool = False,
    observables: Optional[Mapping[str, Callable]] = None,
    quadratic_variation: str = "expected",
    energy_log_scale: Optional[float] = None,
    max_steps: Optional[int] = None,
    max_memory: Optional[float] = None,
    layer_norm: Union[str, LayerNorm] = "none",
    temperature: Union[float, TokenNoise] = 0.0,
) -> Trajectory:
    """Integrate the token ODE ẋ_i = V[μ_t, Θ_t](x_i) on S^{d-1} from t0 to t1.

    Parameters
    ----------
    x0 : torch.Tensor
        initial tokens (..., n, d) on the unit sphere (leading dims are an ensemble).
    theta : Union[Heads, Process]
        :class:`Heads` (constant in time), a :class:`~transformer_pde.processes.weights.Process`
        (OU, oscillating, layerwise, custom) or a stored :class:`WeightPath` (replayed exactly).
    t1, dt
        final time and step ((t1 − t0)/dt must be a whole number); for "adaptive",
        dt is the grid on which stochastic weights are sampled.
    method : str
        "euler" (order 1, the reference code), "heun" (2), "rk4" (4), "adaptive" (dopri5).
    normalization : str
        "softmax" | "unnormalized" | "relu" | "effective".
    direction : str
        "descent" (default here, the reference code: x ← x − Δt·f) or "ascent".
    weights : Optional[torch.Tensor]
        token weights (..., n) or None (uniform).
    paths : Optional[int]
        number of Monte-Carlo paths of the weights (adds a leading axis to the results).
    seed, generator
        the weights' random stream (tokens are not random here; sample x0
        with your own generator so the two streams stay separate).  seed=None means 0;
        giving both is refused (the generator's state would silently decide the draws).
    record_every : int
        keep every k-th step (the first and last times are always kept); at most
        the number of steps.
    diagnostics : bool
        compute energy, 𝒢², 𝒟 and the ledger (False: tokens only, faster).
    quadrature : Optional[str]
        "left" (default for euler, the reference code) or "trapezoid" (default
        for the others) for the ledger's time integrals; the martingale is an Itô sum.
    rtol, atol
        the relative and absolute tolerances of method="adaptive" (positive finite
        floats; default 1e-7 and 1e-9); refused with a fixed-step method, which has none.
    adjoint : bool
        with method="adaptive", backpropagate by torchdiffeq's adjoint ODE
        (``odeint_adjoint``: memory independent of the number of steps, for long horizons)
        instead of through the solver's operations; gradients reach x0, the head tensors, β,
        the process parameters and the token weights (tensors a custom Process hides in
        closures are not seen: keep them as attributes).
    return_path : bool
        store the realised weight path in ``traj.path`` for replay.
    progress : Optional[bool]
        True / False: show / hide a tqdm bar (it appears only on a terminal:
        ``disable=None``).  None (default): show it for long fixed-step solves, when
        steps · stages · paths · H · n² ≥ :data:`PROGRESS_MIN_WORK`.
    chunk_elements : Optional[int]
        memory cap of one score block (see :mod:`transformer_pde.model.backends`).
    checkpoint : Optional[Union[str, Path]]
        file to checkpoint to (atomically, every ``checkpoint_every`` steps) and to
        resume from if it exists and matches this run; a foreign, corrupt or non-finite file
        is refused.  The match covers every input that changes the numbers: x0 (values, dtype),
        the device, the weight process (heads, parameters, and callables such as a Custom
        drift by qualified name and source hash, or its ``tag``), the generator's state at the
        start, the grid, the options and the observables (by name and source); a mismatch
        names what differs.  The callback is not covered: it must not change x in place.
    callback : Optional[Callable]
        called as callback(k, t, x) after every step (e.g. for early stopping hooks).
    causal : bool
        token i attends only to tokens j ≤ i (:func:`transformer_pde.evaluate`); not with
        "effective".  True / "mean": the prefix mean, "sum": the un-normalised kernels sum over
        the prefix (simuformer's convention; :mod:`transformer_pde.model.field`).  The energy, 𝒢², 𝒟 stay those of the whole measure, but the flow is no
        gradient flow: the ledger has no "residual"/"residual_slope" and
        ``traj.stats["gradient_flow"]`` is False.
    observables : Optional[Mapping[str, Callable]]
        mapping name -> callable(x, weights) returning a tensor of shape
        (*batch,) or (*batch, k) for tokens x of shape (*batch, n, d) (batch includes the
        paths axis); evaluated at every recorded time and stacked into
        ``traj.observables[name]`` of shape (T, *batch[, k]).
    quadratic_variation : str
        how the ledger books the second-order term of noisy weights:
        "expected" (default) adds the Itô correction E[½ ∂²_A E[dN, dN]] (the ledger closes at
        order 1 in the mean over paths, one path like dt^{1/2}); "realised" books
        ½ ∂²_A E[ΔN, ΔN] of the realised noise increments ΔN per step (per record interval
        for "adaptive"), so that every single path closes at order 1 (costs one
        (paths, H, n, n) kernel block per step).  No effect on deterministic weights.
    energy_log_scale : Optional[float]
        the common scale c: energy, 𝒢², 𝒟 and the ledger are reported times
        e^{−c}.  None (default): chosen at t0 by
        :func:`transformer_pde.model.energy.choose_log_scale` (0 unless the largest log-partition
        exceeds half the dtype's exponent range, i.e. β‖A‖ ≳ 44 in float32, ≳ 354 in float64),
        so ordinary runs record the values themselves.  Stored in
        ``traj.stats["energy_log_scale"]``.  A given c so large that the values underflow at
        t0 (:func:`transformer_pde.model.energy.check_scale_fits`) is refused, with the value that fits.
    max_steps, max_memory
        limits checked before any allocation: the number of steps (default
        10⁷) and the estimated memory of the trajectory, the kernel blocks and a stored weight
        path in bytes (default 3/4 of the machine's memory, the GPU's for CUDA tensors; inf: none); a run
        above either is refused with the estimate and the fix.
    layer_norm : Union[str, LayerNorm]
        how a layer maps the tokens (:mod:`transformer_pde.solvers.layernorm`,
        ``docs/layer_norms.md``): "none" (default, the projected flow with retraction),
        "post" (x ← normalize(x + dt·A), the reference simulators' map), "pre" (radius r_i
        evolves, ẋ = P_x A/r), "peri", "ngpt", or a scheme object (e.g.
        ``PreLN(rule="simuformer")``).  The layer maps need method="euler"; the ledger then
        books 𝒟 and 𝒢² along the scheme's velocity λ_i P_x A_i, the radii are in
        ``traj.extras["radius"]`` (T, ..., n) and ``traj.stats["layer_norm"]`` names the scheme.
    temperature : Union[float, TokenNoise]
        T ≥ 0 (or a :class:`~transformer_pde.solvers.noise.TokenNoise`): noisy tokens,
        dX = V dt + √(2T) ∘ dB on the sphere (generator T·Δ_S), by the deterministic step followed by
        a projected Euler–Maruyama increment with retraction (weak order 1; the token stream is a
        generator of its own derived from ``seed``, independent of the weights' noise).  The
        ledger's "partial" gains T Σ_i Δ_{S,i}E and its "martingale" Σ_i w_i⟨∇_S δE/δμ(x_i), ξ_i⟩
        (docs/noisy_tokens.md).  Fixed-step methods only.

    Returns
    -------
    Trajectory
        :class:`Trajectory`.  dtype and device follow x0; the solve is differentiable with
        respect to x0, the head tensors, β, tensor process parameters (OU rate/sigma/mean,
        oscillating sigma) and the token weights when they require grad.

    Raises
    ------
    TypeError, ValueError
        for bad input (before any work); NonFiniteError when the run
        produces NaN/inf (with the time, step and quantity, and the fix: for a ledger term that
        outgrew the common scale, the ``energy_log_scale=`` to pass).

    Notes
    -----
    Stage weights: Runge–Kutta stages see Θ at their own stage times when the process has a
    closed form (deterministic, scheme="exact"); on grid-sampled paths (noisy, or
    scheme="euler") they see the linear interpolation between the bracketing grid values,
    so a stochastic path limits every method to order 1 in dt.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x0 = tp.sphere.octahedral(20, dtype=torch.float64)
    >>> traj = tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=1.0, dt=0.1)
    >>> traj.x.shape
    torch.Size([11, 20, 3])
    """
    for flag, flag_name in ((diagnostics, "diagnostics"), (adjoint, "adjoint"), (return_path, "return_path")):
        check_bool(flag, flag_name)
    checked = _check_simulate_args(
        x0, theta, t1=t1, dt=dt, t0=t0, method=method, normalization=normalization, direction=direction,
        weights=weights, paths=paths, seed=seed, generator=generator, record_every=record_every,
        quadrature=quadrature, adjoint=adjoint, progress=progress, checkpoint=checkpoint,
        checkpoint_every=checkpoint_every, causal=causal, observables=observables,
        quadratic_variation=quadratic_variation, energy_log_scale=energy_log_scale, rtol=rtol, atol=atol,
        diagnostics=diagnostics, return_path=return_path, chunk_elements=chunk_elements, max_steps=max_steps,
        max_memory=max_memory)
    scheme = layer_norm_scheme(layer_norm)
    check_layer_norm_method(scheme, method)
    noise = _check_temperature(temperature, method, adjoint, scheme)
    # the objects of tp.solve (every value is checked above, with the keyword's name in the message)
    process = checked[0]
    model = Model(process, normalization, direction, geometry=scheme, noise=noise, weights=weights, causal=causal)
    adaptive = method == "adaptive"
    solver = (Dopri5(1e-7 if rtol is None else rtol, 1e-9 if atol is None else atol, adjoint) if adaptive
              else FixedStep(method))
    saveat = SaveAt(every=checked[6], observables=observables, path=return_path)
    ledger = LedgerOptions(diagnostics, None if adaptive else quadrature, quadratic_variation, energy_log_scale)
    ckpt = None if checkpoint is None else Checkpointing(checkpoint, checked[7])
    if ckpt is not None:
        check_output_file(ckpt.path)  # a missing folder is refused now, not at the first save
    show = None if adaptive else Progress(progress, callback)  # dopri5 has no steps to show (nor callback)
    limits = Limits(max_steps, max_memory, chunk_elements)
    return _run(model, x0, solver, checked, generator=generator, saveat=saveat, ledger=ledger, checkpoint=ckpt,
                progress=show, limits=limits)


def solve_particles(model: Model, x0: torch.Tensor, solver, *, t1, dt, t0, paths, seed, generator, saveat: SaveAt,
                    ledger: LedgerOptions, checkpoint: Optional[Checkpointing], progress: Optional[Progress],
                    limits: Limits) -> Trajectory:
    """:func:`transformer_pde.solve` for a FixedStep or Dopri5 solver (the options already type-checked
    against the solver): the checks of :func:`simulate`, then the same solve.

    Returns
    -------
    Trajectory
        as :func:`simulate` with the equivalent keywords.

    Raises
    ------
    TypeError, ValueError
        bad input, before any work (as :func:`simulate`).
    """
    adaptive = isinstance(solver, Dopri5)
    method = solver.method
    check_tokens(x0, "x0")
    steps = grid_steps(check_real(t0, "t0"), check_real(t1, "t1"), check_positive(dt, "dt"))
    check_layer_norm_method(model.geometry, method)
    if adaptive and model.noise is not None:
        raise ValueError(f"Model.noise (token noise, T = {model.noise.temperature}) needs a fixed-step solver "
                         f"(tp.Euler(), tp.Heun(), tp.RK4()): Dopri5 integrates an ODE and cannot take token noise")
    checked = _check_simulate_args(
        x0, model.theta, t1=t1, dt=dt, t0=t0, method=method, normalization=model.normalization.name,
        direction=model.direction, weights=model.weights, paths=paths, seed=seed, generator=generator,
        record_every=saveat.record_every(steps), quadrature=ledger.quadrature,
        adjoint=solver.adjoint if adaptive else False, progress=None if progress is None else progress.show,
        checkpoint=None if checkpoint is None else checkpoint.path,
        checkpoint_every=200 if checkpoint is None else checkpoint.every, causal=model.causal,
        observables=saveat.observables, quadratic_variation=ledger.quadratic_variation,
        energy_log_scale=ledger.energy_log_scale, rtol=solver.rtol if adaptive else None,
        atol=solver.atol if adaptive else None, diagnostics=ledger.diagnostics, return_path=saveat.path,
        chunk_elements=limits.chunk_elements, max_steps=limits.max_steps, max_memory=limits.max_memory,
        every_name="SaveAt.every")
    return _run(model, x0, solver, checked, generator=generator, saveat=saveat, ledger=ledger, checkpoint=checkpoint,
                progress=progress, limits=limits)


def _run(model: Model, x0, solver, checked, *, generator, saveat, ledger, checkpoint, progress, limits) -> Trajectory:
    """The particle solve of checked arguments: the state with its paths axis, the weight driver, the
    evaluator, then the fixed-step run or dopri5; the paths axis dropped once at the end."""
    (process, sign, t0, t1, dt, K, record_every, checkpoint_every, paths, seed, quadrature, obs,
     energy_log_scale) = checked
    method, adaptive = solver.method, isinstance(solver, Dopri5)
    diagnostics, return_path, chunk = ledger.diagnostics, saveat.path, limits.chunk_elements
    normalization, weights, causal, scheme = model.normalization.name, model.weights, model.causal, model.geometry
    realised = ledger.quadratic_variation == "realised"
    start = time.perf_counter()
    axis = PathsAxis(paths)  # the state always has the paths axis (P = 1 without paths=)
    x = axis.lift(x0)
    drv = WeightDriver(process, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt,
                       store=return_path, batch_rank=x0.dim() - 2)
    # tokens carry every batch axis of the heads (paths, replayed paths) from the start
    x = x.expand(*broadcast_shapes(x.shape[:-2], drv.current.batch_shape), *x.shape[-2:])
    ev = Evaluator(weights, normalization=normalization, sign=sign, noisy=process.noisy, causal=causal,
                   chunk_elements=chunk, energy_log_scale=energy_log_scale)
    if energy_log_scale is not None and diagnostics:  # the values at t0 must not underflow at the given scale
        with torch.no_grad():
            lp0 = softmax_statistics(x, drv.current, weights, chunk_elements=chunk).log_partition
        check_scale_fits(lp0, energy_log_scale)
    if not scheme.projected and normalization == "softmax" and not causal and chunk is None:
        ev.fused = FusedUpdate(weights, sign)  # the layer maps without diagnostics: one fused pass per step
    work = float(math.prod(x.shape[:-2])) * process.heads0.num_heads * x.shape[-2] ** 2
    observed = {name: axis.observable(fn) for name, fn in obs.items()}
    if adaptive:
        with threads.scope(work):
            traj = solve_adaptive(x, process, drv, ev, K=K, t0=t0, dt=dt, record_every=record_every, sign=sign,
                                  diagnostics=diagnostics, rtol=solver.rtol, atol=solver.atol, method=method,
                                  normalization=normalization, direction=model.direction, weights=weights,
                                  start=start, return_path=return_path, adjoint=solver.adjoint,
                                  chunk_elements=chunk, causal=causal, obs=observed, realised=realised,
                                  scale=ev.scale, fix_scale=ev.fix_scale, geometry=scheme, integrate=_dopri5)
        return axis.finish(traj)

    progress = Progress() if progress is None else progress
    show = progress.show if progress.show is not None else \
        K * TABLEAUX[method].stages * work >= PROGRESS_MIN_WORK
    noise = model.noise
    # options added later enter the checkpoint's fingerprint only when not at their default, so that
    # checkpoints of ordinary runs written before them still resume
    extra = ([("causal", causal)] if causal else []) + ([("quadratic_variation", "realised")] if realised else []) \
        + ([("energy_log_scale", energy_log_scale)] if energy_log_scale is not None else []) \
        + ([("observables", tuple(sorted(obs)))] if obs else []) \
        + ([("layer_norm", repr(scheme))] if not scheme.projected else []) \
        + ([("temperature", (noise.temperature, noise.seed))] if noise is not None else [])
    ckpt = Checkpointer(None if checkpoint is None else checkpoint.path, checkpoint_every, K,
                        lambda: _fingerprint_parts(x0, process, generator, obs, t0, t1, dt, method, normalization,
                                                   model.direction, paths, seed, record_every, quadrature,
                                                   diagnostics, weights, extra))
    traj = solve_fixed_step(x, drv, ev, model=model, axis=axis, method=method, K=K, t0=t0, dt=dt,
                            record_every=record_every, diagnostics=diagnostics, sign=sign, realised=realised,
                            obs=obs, quadrature=quadrature, ckpt=ckpt,
                            seed=seed if generator is None else generator.initial_seed(), show=show,
                            callback=progress.callback, pool_scope=lambda: threads.scope(work), start=start,
                            return_path=return_path, direction=model.direction)
    return axis.finish(traj)


def _fingerprint_parts(x0, process, generator, obs, t0, t1, dt, method, normalization, direction, paths, seed,
                       record_every, quadrature, diagnostics, weights, extra):
    """The checkpoint fingerprint's (label, values) pairs: the values in the order of the fingerprints of
    earlier versions (so ordinary checkpoints written before the labels still resume), then the inputs
    covered since: the device (when not the CPU), the generator's state, the observables' callables."""
    parts = [("x0 (values, shape, dtype)", [x0]), *process_parts(process)]
    for label, v in (("t0", t0), ("t1", t1), ("dt", dt), ("method", method), ("normalization", normalization),
                     ("direction", direction), ("paths", paths), ("seed", seed), ("record_every", record_every),
                     ("quadrature", quadrature), ("diagnostics", diagnostics)):
        parts.append((label, [v]))
    parts.append(("weights", [weights]))
    for key, v in extra:
        parts.append((key, [(key, v)]))
    if x0.device.type != "cpu":
        parts.append(("device", [str(x0.device)]))
    if generator is not None:
        parts.append(("generator (its state at the start)", [generator.get_state()]))
    for name, fn in obs.items():
        parts.append((f"observables[{name!r}]", callable_signature(fn, f"observables[{name!r}]")))
    return parts


def _estimate_memory(x0, process, *, K, record_every, paths, method, diagnostics, return_path, chunk_elements, noisy,
                     obs):
    """Estimated bytes of the large arrays of a solve (name -> bytes), before any of them exists."""
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
    block = B * H * n * n
    cap = chunk_elements if chunk_elements is not None else DEFAULT_CHUNK_ELEMENTS
    out["the kernel blocks"] = min(block, max(cap, B * H * n)) * item * 4
    stages = 7 if method == "adaptive" else TABLEAUX[method].stages
    out["the field and its stages"] = B * H * n * (d * d if noisy else d) * item * 2 + (stages + 2) * B * n * d * item
    stored = return_path or (method == "adaptive" and not process.closed_form and not isinstance(process, WeightPath))
    if stored or not process.closed_form and not isinstance(process, WeightPath):
        b_heads = float(math.prod(batch)) if hb else 1.0
        out["the weight path"] = path_bytes(h0, K if stored else 1, paths, noisy, batch=b_heads)
    if method == "adaptive":
        out["the adaptive solution on the record grid"] = T * B * n * d * item * 2
    return out


def _check_simulate_args(x0, theta, *, t1, dt, t0, method, normalization, direction, weights, paths, seed, generator,
                         record_every, quadrature, adjoint, progress, checkpoint, checkpoint_every, causal,
                         observables, quadratic_variation, energy_log_scale, rtol=None, atol=None, diagnostics=True,
                         return_path=False, chunk_elements=None, max_steps=None, max_memory=None,
                         every_name="record_every"):
    """Every check of :func:`simulate`, before any work; returns the arguments it normalises."""
    check_tokens(x0, "x0")
    check_choice(method, METHODS, "method")
    norm = choose_normalization(normalization, NORMALIZATIONS)  # a name or a Normalization object
    sign = direction_sign(direction)
    dt = check_positive(dt, "dt")
    t1 = check_real(t1, "t1")
    t0 = check_real(t0, "t0")
    K = grid_steps(t0, t1, dt)
    record_every = check_every(record_every, every_name, K,
                               f"t0 = {t0:.6g} to t1 = {t1:.6g} in steps dt = {dt:.6g}")
    checkpoint_every = check_int(checkpoint_every, "checkpoint_every")
    if paths is not None:
        paths = check_int(paths, "paths")
    seed = check_seed_generator(seed, generator)
    if method == "adaptive":
        rtol = 1e-7 if rtol is None else check_positive(rtol, "rtol")
        atol = 1e-9 if atol is None else check_positive(atol, "atol")
    elif rtol is not None or atol is not None:
        given = ", ".join(f"{k}={v!r}" for k, v in (("rtol", rtol), ("atol", atol)) if v is not None)
        raise ValueError(f"{given}: rtol and atol are the tolerances of method='adaptive'; the fixed-step method "
                         f"{method!r} has none (its error is set by dt): drop them, or use method='adaptive'")
    if quadrature is None:
        quadrature = "left" if method == "euler" else "trapezoid"
    check_choice(quadrature, ("left", "trapezoid"), "quadrature")
    check_causal_mode(causal)
    if causal and not norm.causal:
        raise ValueError(f"normalization={norm.name!r} has no causal version ({norm.gradient_flow}); use one of "
                         f"{names(lambda n: n.causal)} with causal=True")
    check_choice(quadratic_variation, QUADRATIC_VARIATIONS, "quadratic_variation")
    obs = check_observables(observables)
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (automatic), got {type(progress).__name__}")
    if energy_log_scale is not None:
        if isinstance(energy_log_scale, bool) or not isinstance(energy_log_scale, (int, float)):
            raise TypeError(f"energy_log_scale must be None (automatic) or a float, got "
                            f"{type(energy_log_scale).__name__}")
        energy_log_scale = float(energy_log_scale)
        if not math.isfinite(energy_log_scale):
            raise ValueError(f"energy_log_scale must be finite (the ledger is reported times e^(-c)), got "
                             f"{energy_log_scale!r}")
    if isinstance(theta, Heads):
        process: Process = Constant(theta)
    elif isinstance(theta, Process):
        process = theta
    else:
        raise TypeError(
            f"theta must be a Heads, a Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom) or a WeightPath, "
            f"got {type(theta).__name__}"
        )
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
        if paths is not None:
            raise ValueError("a stored WeightPath already carries its paths axis; call simulate without paths=")
    if paths is None and not isinstance(process, WeightPath) and bh and bh != bx[len(bx) - len(bh):]:
        raise ValueError(f"the heads' batch shape {bh} must be empty or a suffix of x0's batch shape {bx}")
    if paths is not None and bh and bh != bx:
        raise ValueError(f"with paths=, the heads' batch shape {bh} must be empty or equal to x0's batch shape {bx}")
    check_token_weights(weights, x0, "weights", "x0")
    if not isinstance(adjoint, bool):
        raise TypeError(f"adjoint must be True or False, got {type(adjoint).__name__}")
    if adjoint and method != "adaptive":
        raise ValueError(f"adjoint=True needs method='adaptive' (torchdiffeq's adjoint ODE); got method={method!r}. "
                         f"The fixed-step methods backpropagate through their steps: use adjoint=False")
    if method == "adaptive" and checkpoint is not None:
        raise ValueError("checkpointing is supported for the fixed-step methods; use euler, heun or rk4")
    check_limits(f"simulate from t0 = {t0:.6g} to t1 = {t1:.6g} with dt = {dt:.6g}", steps=K,
                 memory=_estimate_memory(x0, process, K=K, record_every=record_every, paths=paths, method=method,
                                         diagnostics=diagnostics, return_path=return_path,
                                         chunk_elements=chunk_elements, noisy=process.noisy, obs=obs),
                 max_steps=max_steps, max_memory=max_memory, device=x0.device,
                 fix="record fewer steps (record_every=), use fewer paths, a larger dt or chunk_elements=")

    return (process, sign, t0, t1, dt, K, record_every, checkpoint_every, paths, seed, quadrature, obs,
            energy_log_scale)


def _check_temperature(temperature, method: str, adjoint: bool, scheme) -> Optional[TokenNoise]:
    """``temperature=`` as a TokenNoise (None for T = 0); the solvers that cannot take noise refuse it."""
    noise = token_noise(temperature)
    if noise is not None and (method == "adaptive" or adjoint):
        raise ValueError(f"temperature={noise.temperature} > 0 needs a fixed-step method (euler, heun or rk4): "
                         f"method='adaptive' (dopri5) and the adjoint integrate an ODE and cannot take token noise")
    if noise is not None and not scheme.projected:
        raise ValueError(f"temperature={noise.temperature} > 0 is defined for the projected flow only; "
                         f"layer_norm={scheme.name!r} with token noise is not implemented: use layer_norm='none'")
    return noise


