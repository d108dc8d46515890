"""``tp.simulate``: the particle solvers' keyword front end.

It checks each keyword in its own name before it builds anything, turns the keywords into a
:class:`~transformer_pde.Model`, a solver of :mod:`~transformer_pde.solvers.particle.methods` and the options
objects, and calls :func:`transformer_pde.solve`; errors raised during the run reach the caller as raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch

from ...utils.validation import DEFAULT_DIRECTION, DIRECTIONS
from ...utils.validation import (
    check_bool, check_choice, check_every, check_int, check_output_file, check_positive, check_real,
    check_tokens,
)
from ...model.normalization import normalization as as_normalization
from ...model.field import check_causal_mode
from ...model.heads import Heads
from ...processes.driver import grid_steps
from ...processes.weights import Process
from ...dynamics.layernorm import LayerNormScheme, as_geometry
from ...dynamics.model import Model
from ...dynamics.noise import TokenNoise, token_noise
from ..options import (
    Checkpointing, LedgerOptions, Limits, Progress, SaveAt, check_ledger_choices, check_observables_mapping,
)
from ..solve import solve
from ..tableaux import ADAPTIVE_ATOL, ADAPTIVE_RTOL, METHODS
from ..trajectory import (
    Trajectory,
)

from .methods import Dopri5, FixedStep

__all__ = ["simulate"]


def simulate(
    x0: torch.Tensor,
    theta: Union[Heads, Process],
    *,
    t1: float,
    dt: float,
    t0: float = 0.0,
    method: str = "euler",
    normalization: str = "softmax",
    direction: str = DEFAULT_DIRECTION,
    weights: Optional[torch.Tensor] = None,
    paths: Optional[int] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    record_every: int = 1,
    diagnostics: bool = True,
    ledger: bool = False,
    records: str = "lazy",
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
    layer_norm: Union[str, LayerNormScheme] = "none",
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
        "ascent" (the default of every function here: x + Δt·f, the residual transformer) or "descent"
        (the paper's reference code: x ← x − Δt·f; its reproductions pass it explicitly).
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
        energy, 𝒢², 𝒟 at the recorded times (False: tokens only).  Computed as ``records`` says.
    ledger : bool
        also keep the energy ledger ``traj.ledger`` (:class:`~transformer_pde.LedgerOptions`):
        the diagnostics are then evaluated at every step (and, for the trapezoid rule and the jumps,
        at every right end): measured 1.6–1.7× the tokens-only solve on the peers' post-LN workload and
        1.15–1.17× on the paper's H = 100 OU step (float64, :class:`~transformer_pde.LedgerOptions`,
        scripts/benchmark_diagnostics.py).  Without it ``traj.ledger`` raises a ValueError.
        Needs diagnostics=True.
    records : str
        "lazy" (default): the diagnostics of the records are computed from the recorded tokens, heads and
        radii on the first read of ``traj.energy``/``slope``/``dissipation``, once, vectorised over the
        records (the solve evaluates the field only: free when never read).  "step": by the recorded
        steps' own field evaluations during the solve (cheaper when the records are dense and read;
        the same values to rounding; fixed-step methods, without the ledger).
        :class:`~transformer_pde.LedgerOptions` gives the measured costs of both.
    quadrature : Optional[str]
        "left" (default for euler, the reference code) or "trapezoid" (default
        for the others) for the ledger's time integrals; the martingale is an Itô sum.
        Needs ledger=True.
    rtol, atol
        the relative and absolute tolerances of method="adaptive" (positive finite
        floats; default 1e-7 and 1e-9, those of :class:`Dopri5`); refused with a fixed-step method, which has
        none, and an rtol below the round-off of x0's dtype (eps/2) is refused before any step.
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
        order 1 in the mean over paths, one path like dt^{1/2}); "realised" (needs ledger=True) books
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
    layer_norm : Union[str, LayerNormScheme]
        how a layer maps the tokens (:mod:`transformer_pde.dynamics.layernorm`,
        ``docs/layer_norms.md``): "none" (default, the projected flow with retraction),
        "post" (x ← normalize(x + dt·A), the reference simulators' map), "pre" (radius r_i
        evolves, ẋ = P_x A/r), "peri", "ngpt", or a scheme object (e.g.
        ``PreLN(rule="simuformer")``).  The layer maps need method="euler"; the ledger then
        books 𝒟 and 𝒢² along the scheme's velocity λ_i P_x A_i, the radii are in
        ``traj.extras["radius"]`` (T, ..., n) and ``traj.stats["layer_norm"]`` names the scheme.
    temperature : Union[float, TokenNoise]
        T ≥ 0 (or a :class:`~transformer_pde.dynamics.noise.TokenNoise`): noisy tokens,
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
    check_tokens(x0, "x0")
    check_choice(method, METHODS, "method")
    adaptive = method == "adaptive"
    _check_method_keywords(method, rtol, atol, adjoint, checkpoint, checkpoint_every)
    model = _model_of_keywords(theta, normalization, direction, layer_norm, temperature, weights, causal)
    if adaptive and model.noise is not None:
        raise ValueError(f"temperature = {model.temperature} (token noise) needs a fixed-step method (euler, heun, "
                         f"rk4): method='adaptive' integrates an ODE and cannot take token noise")
    check_every(record_every, "record_every", grid_steps(check_real(t0, "t0"), check_real(t1, "t1"),
                                                         check_positive(dt, "dt")),
                f"t0 = {t0:.6g} to t1 = {t1:.6g} in steps dt = {dt:.6g}")
    check_observables_mapping(observables, "observables")
    check_bool(return_path, "return_path")
    c = check_ledger_choices(diagnostics, ledger, quadrature, quadratic_variation, energy_log_scale, records)
    if adaptive and records != "lazy":
        raise ValueError(f"records={records!r} computes the diagnostics at the fixed steps' record steps; "
                         f"method='adaptive' records on torchdiffeq's output grid: leave records='lazy' or use a "
                         f"fixed-step method")
    check_bool(progress, "progress", allow_none=True)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable(k, t, x), got {type(callback).__name__}")
    limits = _limits_of_keywords(max_steps, max_memory, chunk_elements)
    solver = Dopri5(ADAPTIVE_RTOL if rtol is None else rtol, ADAPTIVE_ATOL if atol is None else atol, adjoint) \
        if adaptive else FixedStep(method)
    ckpt = None if checkpoint is None else Checkpointing(check_output_file(checkpoint), checkpoint_every)
    show = None if adaptive else Progress(progress, callback)  # dopri5 has no steps to show (nor callback)
    return solve(model, x0, solver, t1=t1, dt=dt, t0=t0, paths=paths, seed=seed, generator=generator,
                 saveat=SaveAt(record_every, observables=observables, path=return_path),
                 ledger=LedgerOptions(diagnostics, ledger, None if adaptive else quadrature, quadratic_variation, c,
                                      records=records),
                 checkpoint=ckpt, progress=show, limits=limits)


def _check_method_keywords(method, rtol, atol, adjoint, checkpoint, checkpoint_every) -> None:
    """simulate's keywords that depend on the method (tolerances, adjoint, checkpoints), in their own names."""
    adaptive = method == "adaptive"
    check_bool(adjoint, "adjoint")
    if not adaptive and (rtol is not None or atol is not None):
        given = ", ".join(f"{k}={v!r}" for k, v in (("rtol", rtol), ("atol", atol)) if v is not None)
        raise ValueError(f"{given}: rtol and atol are the tolerances of method='adaptive'; the fixed-step method "
                         f"{method!r} has none (its error is set by dt): drop them, or use method='adaptive'")
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if value is not None:
            check_positive(value, name)
    if adjoint and not adaptive:
        raise ValueError(f"adjoint=True needs method='adaptive' (torchdiffeq's adjoint ODE); got method={method!r}. "
                         f"The fixed-step methods backpropagate through their steps: use adjoint=False")
    if adaptive and checkpoint is not None:
        raise ValueError("checkpointing is supported for the fixed-step methods; use euler, heun or rk4")
    if checkpoint is not None and not isinstance(checkpoint, (str, Path)):
        raise TypeError(f"checkpoint must be a str or Path (the file), got {type(checkpoint).__name__}")
    check_int(checkpoint_every, "checkpoint_every")


def _model_of_keywords(theta, normalization, direction, layer_norm, temperature, weights, causal) -> Model:
    """The :class:`Model` of simulate's keywords, each checked in its own name first."""
    if not isinstance(theta, (Heads, Process)):
        raise TypeError(f"theta must be a Heads, a Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom) or a "
                        f"WeightPath, got {type(theta).__name__}")
    norm = as_normalization(normalization, "normalization")
    check_choice(direction, DIRECTIONS, "direction")
    geometry = as_geometry(layer_norm)  # its messages name layer_norm
    noise = token_noise(temperature)  # TokenNoise's messages name temperature
    if weights is not None and not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a tensor (..., n) or None, got {type(weights).__name__}")
    check_causal_mode(causal)
    return Model(theta, norm, direction, geometry, temperature if noise is None else noise, weights, causal)


def _limits_of_keywords(max_steps, max_memory, chunk_elements) -> Limits:
    """The :class:`Limits` of simulate's keywords, each checked in its own name first."""
    for value, name in ((max_steps, "max_steps"), (chunk_elements, "chunk_elements")):
        if value is not None:
            check_int(value, name)
    m = max_memory
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0):
        raise ValueError(f"max_memory must be a positive number of bytes (or inf), got {m!r}")
    return Limits(max_steps, max_memory, chunk_elements)
