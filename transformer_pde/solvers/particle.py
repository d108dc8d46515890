"""Particle solver: N tokens moved by the multi-head attention field with time-dependent heads.

    ẋ_i = V[μ_t, Θ_t](x_i),   μ_t = Σ_i w_i δ_{x_i(t)},   x_i ∈ S^{d-1}

Fixed-step methods are explicit Runge–Kutta schemes in the ambient space with the projective
retraction x ↦ x/|x| after every stage ("euler" is the reference code's projected Euler);
"adaptive" is torchdiffeq's dopri5 on the projected field.  Along the way the solver keeps
the energy–dissipation ledger of docs/model.md#ledger (see :class:`Trajectory`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from .. import threads
from .._validation import (
    NORMALIZATIONS,
    check_bool,
    check_choice,
    check_every,
    check_int,
    check_limits,
    check_positive,
    check_real,
    check_same,
    check_seed_generator,
    check_tied_all,
    check_token_weights,
    check_tokens,
    direction_sign,
)
from ..attention import DEFAULT_CHUNK_ELEMENTS, softmax_statistics
from ..energy import check_scale_fits, choose_log_scale, pairing
from ..energy import quadratic_variation as realised_qv_term
from ..field import FieldEval, check_causal_mode, evaluate
from ..mobility import scaled_diagnostics
from ..normalization import normalization as as_normalization
from ..heads import Heads, broadcast_shapes
from ..processes import Constant, Process, WeightDriver, WeightPath, grid_steps, path_bytes
from ..sphere import normalize
from .layernorm import FusedUpdate, LayerNorm, check_layer_norm_method, layer_norm_scheme, scheme_densities
from .noise import TokenNoise, noise_martingale, token_noise
from .parts import (LEDGER_KEYS, Checkpointer, Ledger, Recorder, Stepper, callable_signature, check_observables,
                    ledger_from_series, partial_density, process_parts, progress_bar)

__all__ = ["simulate", "Trajectory", "ButcherTableau", "TABLEAUX", "METHODS", "NonFiniteError", "LEDGER_KEYS",
           "QUADRATIC_VARIATIONS", "PROGRESS_MIN_WORK"]

#: the ways the ledger books the second-order (Itô) term of noisy weights (``quadratic_variation=``)
QUADRATIC_VARIATIONS = ("expected", "realised")

#: ``progress=None`` shows a bar (on a terminal only) when steps · stages · paths · H · n² reaches this
#: many kernel terms (a solve of several seconds on one core)
PROGRESS_MIN_WORK = 1e9

logger = logging.getLogger(__name__)

#: named internal API (not public), used by the sharded solver and the JKO scheme
__internal__ = ["nonfinite_error"]

_WeightDriver = WeightDriver  # the old name, which tests monkeypatch


class NonFiniteError(FloatingPointError):
    """A solver produced NaN or inf; the message names the time, the step and the quantity."""


@dataclass(frozen=True)
class ButcherTableau:
    """Explicit Runge–Kutta coefficients (c, a, b) with the declared order; checked when built."""

    name: str
    order: int
    c: Tuple[float, ...]
    a: Tuple[Tuple[float, ...], ...]
    b: Tuple[float, ...]

    def __post_init__(self):
        s = len(self.b)
        if len(self.c) != s or len(self.a) != s:
            raise ValueError(f"tableau {self.name}: c, a and b must all have {s} stages")
        for i, row in enumerate(self.a):
            if len(row) != i:
                raise ValueError(f"tableau {self.name}: row {i} of a must have {i} entries (explicit scheme)")
            if abs(sum(row) - self.c[i]) > 1e-14:
                raise ValueError(f"tableau {self.name}: c[{i}] must equal the sum of row {i} of a")
        if abs(sum(self.b) - 1) > 1e-14:
            raise ValueError(f"tableau {self.name}: the weights b must sum to 1")
        if self.order >= 2 and abs(sum(bi * ci for bi, ci in zip(self.b, self.c)) - 0.5) > 1e-14:
            raise ValueError(f"tableau {self.name}: order >= 2 needs Σ b_i c_i = 1/2")

    @property
    def stages(self) -> int:
        return len(self.b)


TABLEAUX = {
    "euler": ButcherTableau("euler", 1, (0.0,), ((),), (1.0,)),
    "heun": ButcherTableau("heun", 2, (0.0, 1.0), ((), (1.0,)), (0.5, 0.5)),
    "rk4": ButcherTableau(
        "rk4", 4, (0.0, 0.5, 0.5, 1.0), ((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)), (1 / 6, 1 / 3, 1 / 3, 1 / 6)
    ),
}
METHODS = (*TABLEAUX, "adaptive")


# ---------------------------------------------------------------------------- trajectory
@dataclass
class Trajectory:
    """Result of :func:`simulate` (and :func:`transformer_pde.jko`).

    times: (T,) recorded times.   x: (T, [paths,] ..., n, d) tokens.
    energy, slope (𝒢²), dissipation (𝒟): (T, [paths,] ...).
    ledger: running terms, each (T, [paths,] ...): "dE" = E(t) − E(0), "partial" = ∫∂_sE (with
      the Itô correction for noisy weights, and the jumps of piecewise-constant weights),
      "dissipation" = ∫𝒟, "slope" = ∫𝒢², "martingale" = M_t,
      "residual" = dE − partial − dissipation − martingale,
      "residual_slope" = dE − partial − s·slope − martingale (the reference code's check).
    stats: step statistics (steps, field evaluations, max pre-retraction sphere error, wall time,
      order); from :func:`simulate` also "energy_log_scale" (below) and "gradient_flow" (False for
      causal attention: then the ledger has no "residual"/"residual_slope").
    weights: token weights (or None).  path: the weight path (WeightPath) when return_path=True.
    observables: name -> (T, ...) series of the ``observables=`` callables of :func:`simulate`.

    Common scale: energy, slope, dissipation and every ledger term are reported times e^{−c},
    c = ``stats["energy_log_scale"]`` (0 for ordinary runs: the values themselves).  The ledger is
    linear in them, so its identities hold at any scale; :meth:`log_energy` gives log E.
    """

    times: torch.Tensor
    x: torch.Tensor
    energy: Optional[torch.Tensor]
    slope: Optional[torch.Tensor]
    dissipation: Optional[torch.Tensor]
    ledger: Dict[str, torch.Tensor]
    stats: Dict[str, float]
    method: str
    normalization: str
    direction: str
    weights: Optional[torch.Tensor] = None
    path: Optional[WeightPath] = None
    extras: Dict[str, object] = field(default_factory=dict)
    observables: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def energy_log_scale(self) -> float:
        """c with energy, slope, dissipation and ledger reported times e^{−c} (0: unscaled)."""
        return float(self.stats.get("energy_log_scale", 0.0)) if isinstance(self.stats, dict) else 0.0

    def log_energy(self) -> torch.Tensor:
        """log E(t) = log(energy) + c, (T, ...): finite even where E itself overflows the dtype."""
        if self.energy is None:
            raise ValueError("this trajectory has no energy (it was run with diagnostics=False)")
        return torch.log(self.energy) + self.energy_log_scale

    def __repr__(self) -> str:
        def shape(v):
            if v is None:
                return "None"
            if isinstance(v, torch.Tensor):
                return f"{tuple(v.shape)}"
            return type(v).__name__

        parts = [f"method={self.method!r}", f"normalization={self.normalization!r}", f"direction={self.direction!r}"]
        t = self.times
        if isinstance(t, torch.Tensor) and t.numel():
            parts.append(f"times={t.numel()} in [{float(t[0]):.6g}, {float(t[-1]):.6g}]")
        else:
            parts.append(f"times={shape(t)}")
        x = self.x
        parts.append(f"x={shape(x)}" + (f" {str(x.dtype).replace('torch.', '')}" if isinstance(x, torch.Tensor) else ""))
        if self.energy is not None:
            parts.append(f"energy={shape(self.energy)}")
        if self.ledger:
            parts.append(f"ledger=[{', '.join(self.ledger)}]")
        if self.observables:
            parts.append(f"observables=[{', '.join(self.observables)}]")
        if self.weights is not None:
            parts.append(f"weights={shape(self.weights)}")
        if self.path is not None:
            parts.append("path=WeightPath")
        if isinstance(self.stats, dict) and self.stats:
            parts.append(f"stats=[{', '.join(map(str, self.stats))}]")
        return f"Trajectory({', '.join(parts)})"

    @property
    def final(self) -> torch.Tensor:
        """Tokens at the last recorded time, ([paths,] ..., n, d)."""
        return self.x[-1]

    def time_average(self, values: torch.Tensor, t_min: float = 0.0) -> torch.Tensor:
        """Trapezoid time average of a recorded series (T, ...) over times >= t_min."""
        keep = self.times >= t_min - 1e-12
        t, v = self.times[keep], values[keep]
        if len(t) < 2:
            return v[0]
        w = torch.zeros_like(t)
        dtv = t[1:] - t[:-1]
        w[1:] += dtv / 2
        w[:-1] += dtv / 2
        w = w / (t[-1] - t[0])
        return (w.reshape(-1, *([1] * (v.dim() - 1))) * v).sum(0)


# ---------------------------------------------------------------------------- helpers
def nonfinite_error(what: str, t: float, k: int, heads: Heads, normalization: Optional[str] = None) -> NonFiniteError:
    """NonFiniteError for a non-finite field or token step, with the fix that fits the normalisation."""
    A = heads.score_matrix.detach()
    bmax = (A.flatten(-2).abs().amax(-1).max() * (heads.beta if isinstance(heads.beta, float) else heads.beta.max())).item()
    R = math.log(torch.finfo(A.dtype).max) if A.is_floating_point() else float("inf")
    norm = None if normalization is None else as_normalization(normalization)
    if norm is not None and norm.overflow == "kernel" and bmax > R / 2:
        kind = ("the unnormalised field carries the kernel e^{β⟨x,Ay⟩} itself" if norm.uses_value
                else "the effective field scales like max_h m_h / min_k m_k")
        fix = (f"{kind}, which overflows {A.dtype} near β·‖A‖ ≈ {R:.3g}: use normalization='softmax', reduce beta or "
               f"the scale of the heads, or run in float64")
    elif normalization is None:
        fix = ("the exponential kernel overflowed or the step diverged: reduce beta or the scale of the heads, "
               "use a smaller dt, or normalization='softmax'")
    else:
        fix = "the step diverged (the softmax field itself cannot overflow): use a smaller dt or a higher-order method"
    return NonFiniteError(f"{what} became NaN/inf at t = {t:.6g} (step {k}); β·max|A_h| = {bmax:.3g}. {fix}")


def _ledger_nonfinite(what: str, t: float, k: int, log_partition: torch.Tensor, scale: float,
                      start_max: float, given: bool = False) -> NonFiniteError:
    """NonFiniteError for an energy or ledger term: says whether the kernel outgrew the common scale."""
    lp = log_partition.detach()
    R = math.log(torch.finfo(lp.dtype).max)
    now = float(lp.max()) if bool(torch.isfinite(lp).all()) else float("nan")
    head = (f"{what} became NaN/inf at t = {t:.6g} (step {k}); energy, 𝒢², 𝒟 and the ledger are reported times "
            f"e^(−c), c = energy_log_scale = {scale:.6g} ({'given' if given else 'chosen from the log-partitions at t0'}"
            f"; largest log-partition at t0 {start_max:.6g})")
    if math.isfinite(now) and now - scale > 0.75 * R:
        lo, hi = now - R + 8.0, start_max + R - 20.0  # scales that hold both the values at t0 and now
        if lo <= hi:
            suggest = math.ceil(min(hi, max(lo, now - R / 2)))
            fix = (f"pass energy_log_scale={suggest} to simulate (it holds both the values at t0 and the "
                   f"log-partition reached), or run in float64, or diagnostics=False (tokens only)")
        else:
            fix = (f"the exponent has grown by {now - start_max:.4g} since t0, more than {lp.dtype} can span at one "
                   f"scale: run in float64 (or diagnostics=False: tokens only)")
        return NonFiniteError(
            f"{head}; the largest log-partition is now {now:.6g}, {now - scale:.4g} above the scale, beyond "
            f"what {lp.dtype} holds (e^{R:.4g}). Fix: {fix}")
    return NonFiniteError(
        f"{head}; the kernel's exponent is in range (largest log-partition {now:.6g}), so the values themselves "
        f"diverged: use a smaller dt, check the weight process's rates and σ, or run in float64")


def _check_finite(t: torch.Tensor) -> bool:
    # a sum is finite only when every entry is (an inf or NaN entry makes it inf or NaN): one pass and
    # no bool tensor; a finite sum proves the check, an overflowing one falls back to the entrywise test
    if t.is_floating_point() and bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _check_ledger(e: FieldEval, pt: torch.Tensor, t: float, k: int, scale: Mapping):
    """NonFiniteError unless the energy, 𝒟, 𝒢² and ∂_tE of one evaluation are finite."""
    for name, v in (("the energy", e.energy), ("the dissipation 𝒟", e.dissipation),
                    ("the metric slope 𝒢²", e.slope), ("∂_tE (ledger 'partial')", pt)):
        if not _check_finite(v):
            raise _ledger_nonfinite(name, t, k, e.stats.log_partition, scale["c"], scale["start_max"],
                                    scale.get("given", False))


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
        :class:`Heads` (constant in time), a :class:`~transformer_pde.processes.Process`
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
        memory cap of one score block (see :mod:`transformer_pde.attention`).
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
        the prefix (simuformer's convention; :mod:`transformer_pde.field`).  The energy, 𝒢², 𝒟 stay those of the whole measure, but the flow is no
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
        :func:`transformer_pde.energy.choose_log_scale` (0 unless the largest log-partition
        exceeds half the dtype's exponent range, i.e. β‖A‖ ≳ 44 in float32, ≳ 354 in float64),
        so ordinary runs record the values themselves.  Stored in
        ``traj.stats["energy_log_scale"]``.  A given c so large that the values underflow at
        t0 (:func:`transformer_pde.energy.check_scale_fits`) is refused, with the value that fits.
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

    Stage weights: Runge–Kutta stages see Θ at their own stage times when the process has a
    closed form (deterministic, scheme="exact"); on grid-sampled paths (noisy, or
    scheme="euler") they see the linear interpolation between the bracketing grid values,
    so a stochastic path limits every method to order 1 in dt.

    Raises
    ------
    TypeError, ValueError
        for bad input (before any work); NonFiniteError when the run
        produces NaN/inf (with the time, step and quantity, and the fix: for a ledger term that
        outgrew the common scale, the ``energy_log_scale=`` to pass).

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
    (process, sign, t0, t1, dt, K, record_every, checkpoint_every, paths, seed, quadrature, obs,
     energy_log_scale) = _check_simulate_args(
        x0, theta, t1=t1, dt=dt, t0=t0, method=method, normalization=normalization, direction=direction,
        weights=weights, paths=paths, seed=seed, generator=generator, record_every=record_every,
        quadrature=quadrature, adjoint=adjoint, progress=progress, checkpoint=checkpoint,
        checkpoint_every=checkpoint_every, causal=causal, observables=observables,
        quadratic_variation=quadratic_variation, energy_log_scale=energy_log_scale, rtol=rtol, atol=atol,
        diagnostics=diagnostics, return_path=return_path, chunk_elements=chunk_elements, max_steps=max_steps,
        max_memory=max_memory)
    rtol, atol = (1e-7 if rtol is None else rtol), (1e-9 if atol is None else atol)
    scheme = layer_norm_scheme(layer_norm)
    check_layer_norm_method(scheme, method)
    noise = _check_temperature(temperature, method, adjoint, scheme)
    realised = quadratic_variation == "realised"
    start = time.perf_counter()
    x = x0 if paths is None else x0.unsqueeze(0).expand(paths, *x0.shape)
    drv = WeightDriver(process, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt,
                       store=return_path, batch_rank=x0.dim() - 2)
    # tokens carry every batch axis of the heads (paths, replayed paths) from the start
    x = x.expand(*broadcast_shapes(x.shape[:-2], drv.current.batch_shape), *x.shape[-2:])
    ev = _Evaluator(weights, normalization=normalization, sign=sign, noisy=process.noisy, causal=causal,
                    chunk_elements=chunk_elements, energy_log_scale=energy_log_scale)
    scale, fix_scale = ev.scale, ev.fix_scale
    if energy_log_scale is not None and diagnostics:  # the values at t0 must not underflow at the given scale
        with torch.no_grad():
            lp0 = softmax_statistics(x, drv.current, weights, chunk_elements=chunk_elements).log_partition
        check_scale_fits(lp0, energy_log_scale)
    if not scheme.projected and normalization == "softmax" and not causal and chunk_elements is None:
        ev.fused = FusedUpdate(weights, sign)  # the layer maps without diagnostics: one fused pass per step
    work = float(math.prod(x.shape[:-2])) * process.heads0.num_heads * x.shape[-2] ** 2
    common = dict(K=K, dt=dt, record_every=record_every, diagnostics=diagnostics, sign=sign, causal=causal,
                  realised=realised, obs=obs, weights=weights, normalization=normalization)
    if method == "adaptive":
        with threads.scope(work):
            return _simulate_adaptive(x, process, drv, ev, t0=t0, rtol=rtol, atol=atol, method=method,
                                      direction=direction, start=start, return_path=return_path, adjoint=adjoint,
                                      chunk_elements=chunk_elements, scale=scale, fix_scale=fix_scale, **common)

    show = progress if progress is not None else K * TABLEAUX[method].stages * work >= PROGRESS_MIN_WORK
    # options added later enter the checkpoint's fingerprint only when not at their default, so that
    # checkpoints of ordinary runs written before them still resume
    extra = ([("causal", causal)] if causal else []) + ([("quadratic_variation", "realised")] if realised else []) \
        + ([("energy_log_scale", energy_log_scale)] if energy_log_scale is not None else []) \
        + ([("observables", tuple(sorted(obs)))] if obs else []) \
        + ([("layer_norm", repr(scheme))] if not scheme.projected else []) \
        + ([("temperature", (noise.temperature, noise.seed))] if noise is not None else [])
    ckpt = Checkpointer(checkpoint, checkpoint_every, K, lambda: _fingerprint_parts(
        x0, process, generator, obs, t0, t1, dt, method, normalization, direction, paths, seed, record_every,
        quadrature, diagnostics, weights, extra))
    run = _FixedStepRun(x, drv, ev, fix_scale, scale, method=method, quadrature=quadrature, ckpt=ckpt,
                        layer_norm=scheme, noise=noise,
                        seed=seed if generator is None else generator.initial_seed(), **common)
    run.start()
    with threads.scope(work) as pool:
        run.solve(show, callback, pool)
    times, out_x, series, ledger, observed = run.rec.stacked(t0, dt)
    stats = {"steps": K, "field_evaluations": run.nfe, "max_sphere_error": run.max_sphere,
             "wall_time": time.perf_counter() - start, "order": TABLEAUX[method].order,
             "energy_log_scale": scale["c"], "gradient_flow": not causal,
             "temperature": 0.0 if noise is None else noise.temperature}
    extras = {}
    if not scheme.projected:
        stats["layer_norm"] = scheme.name
        if scheme.radius:
            extras["radius"] = torch.stack(run.radii)
    return Trajectory(times, out_x, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      method, normalization, direction, weights, drv.path() if return_path else None,
                      observables=observed, extras=extras)


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
                         return_path=False, chunk_elements=None, max_steps=None, max_memory=None):
    """Every check of :func:`simulate`, before any work; returns the arguments it normalises."""
    check_tokens(x0, "x0")
    check_choice(method, METHODS, "method")
    check_choice(normalization, NORMALIZATIONS, "normalization")
    sign = direction_sign(direction)
    dt = check_positive(dt, "dt")
    t1 = check_real(t1, "t1")
    t0 = check_real(t0, "t0")
    K = grid_steps(t0, t1, dt)
    record_every = check_every(record_every, "record_every", K,
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
    if causal and normalization == "effective":
        raise ValueError("normalization='effective' is the gradient field b^{-1} ∇ δE/δμ and has no causal version; "
                         "use 'softmax', 'unnormalized' or 'relu' with causal=True")
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
    if normalization == "effective":
        check_tied_all(process, "normalization='effective'")
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


class _Evaluator:
    """The field evaluation of a solve: ``ev(x, heads, diag)`` (a FieldEval; with diag the non-causal
    statistics and energy, 𝒢², 𝒟 times e^{−c}) and the common scale c (``scale``, fixed at t0 by
    :meth:`fix_scale` unless given)."""

    def __init__(self, weights, *, normalization, sign, noisy, causal, chunk_elements, energy_log_scale):
        self.w, self.normalization, self.sign, self.noisy = weights, normalization, sign, noisy
        self.causal, self.chunk, self.given = causal, chunk_elements, energy_log_scale
        self.causal_kw = {"causal": causal} if causal else {}
        self.scale = {"c": 0.0 if energy_log_scale is None else energy_log_scale, "start_max": float("nan"),
                      "given": energy_log_scale is not None}
        self.fused = None  # a layernorm.FusedUpdate for the tokens-only evaluations of a layer map

    def __call__(self, xk, heads, diag):
        if not diag and self.fused is not None:
            fe = self.fused(xk, heads)
            if fe is not None:
                return fe
        # one implementation of E, 𝒢², 𝒟 at the common scale e^{−c} (c = 0: the values), causal or not
        return evaluate(xk, heads, self.w, normalization=self.normalization, sign=self.sign, diagnostics=diag,
                        log_scale=self.scale["c"], second_moment=diag and self.noisy, chunk_elements=self.chunk,
                        **self.causal_kw)

    def fix_scale(self, evk) -> bool:
        """Fix c from the log-partitions of the first evaluation (unless given); True when c ≠ 0
        (the caller then evaluates again, at that scale)."""
        lp = evk.stats.log_partition.detach()
        self.scale["start_max"] = float(lp.max()) if lp.numel() else 0.0
        if self.given is not None:
            return False  # the first evaluation already used the given scale
        self.scale["c"] = choose_log_scale(lp)
        if self.scale["c"] != 0.0:
            logger.info("energy and ledger reported times e^(-%.6g) (largest log-partition at t0: %.6g)",
                        self.scale["c"], self.scale["start_max"])
        return self.scale["c"] != 0.0


class _FixedStepRun:
    """A fixed-step solve composed of the parts: the weight driver (Θ_t), the stepper (tableau +
    sphere retraction), the ledger, the recorder and the checkpointer; one :meth:`step` at a time."""

    def __init__(self, x, drv, ev, fix_scale, scale, *, K, dt, method, quadrature, record_every, diagnostics, sign,
                 causal, realised, obs, weights, normalization, ckpt, layer_norm="none", noise=None, seed=0):
        self.x, self.drv, self.ev, self.fix_scale, self.scale = x, drv, ev, fix_scale, scale
        self.K, self.dt, self.diagnostics, self.realised, self.w = K, dt, diagnostics, realised, weights
        self.normalization, self.ckpt, self.noisy, self.method = normalization, ckpt, drv.noisy, method
        self.stepper = Stepper(TABLEAUX[method], retract=True, layer_norm=layer_norm)
        self.scheme = self.stepper.layer_norm
        self.r, self.radii = self.scheme.initial_radius(x), []  # token radii (pre-/peri-LN), their records
        keys = LEDGER_KEYS if not causal else tuple(k for k in LEDGER_KEYS if not k.startswith("residual"))
        self.rec = Recorder(K, record_every, diagnostics=diagnostics, observables=obs, weights=weights,
                            ledger_keys=keys)
        self.ledger = Ledger(torch.zeros(()), sign=sign, quadrature=quadrature, causal=causal)
        self.k, self.nfe, self.max_sphere = 0, 0, 0.0
        self.noise = noise  # token noise (TokenNoise or None) and its own random stream
        self.token_gen = noise.generator(seed, x.device) if noise is not None else None

    def state(self) -> dict:
        st = {"x": self.x.detach(), "driver": self.drv.state(), "records": self.rec.records, "acc": self.ledger.acc,
              "nfe": self.nfe, "max_sphere": self.max_sphere, "scale": dict(self.scale),
              **({"r": self.r, "radii": self.radii} if self.r is not None else {})}
        if self.token_gen is not None:
            st["token_noise"] = self.token_gen.get_state()
        return st

    def _evaluate(self, x, heads):
        e = self.ev(x, heads, self.diagnostics)
        self.nfe += 1
        # a layer map adds the ambient update A (finite A gives a finite P_x A): check what the step reads
        if not _check_finite(e.velocity if self.scheme.projected or e.ambient is None else e.ambient):
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
        _check_ledger(e, pt, self.drv.t, self.drv.k, self.scale)
        if not self.scheme.projected:  # 𝒟 and 𝒢² along the scheme's velocity λ_i P_x A_i
            D, G = scheme_densities(self.scheme, e, heads, self.w, self.r, c)
            return {"partial": pt, "dissipation": D, "slope": G}
        return {"partial": pt, "dissipation": e.dissipation, "slope": e.slope}

    def _record(self):
        e = self.cur
        if self.r is not None:
            self.radii.append(self.r.detach())
        if self.diagnostics:
            G, D = (e.slope, e.dissipation) if self.scheme.projected else (self.dens["slope"], self.dens["dissipation"])
            self.rec.record(self.x, e.energy, G, D, self.ledger.terms(e.energy))
        else:
            self.rec.record(self.x)

    def start(self):
        """Resume from the checkpoint or start at t0: first evaluation, common scale, first record."""
        ck = self.ckpt.load(self.x.device)
        if ck is not None:
            self.k, self.x, self.nfe, self.max_sphere = ck["k"], ck["x"], ck["nfe"], ck["max_sphere"]
            self.drv.load_state(ck["driver"])
            self.rec.records, self.ledger.acc = ck["records"], ck["acc"]
            self.scale.update(ck.get("scale", {"c": 0.0, "start_max": float("nan")}))
            if self.r is not None:
                self.r, self.radii = ck["r"], ck["radii"]
            if self.token_gen is not None:
                self.token_gen.set_state(ck["token_noise"])
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
                    callback(self.k, self.drv.t, self.x)
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
        if not _check_finite(x_new):
            raise nonfinite_error("the token positions", drv.t + self.dt, self.k + 1, heads, self.normalization)
        if self.noise is not None:  # token noise after the deterministic step; Itô terms at the left end
            xi = self.noise.increment(x_new, self.dt, self.token_gen)
            if self.diagnostics:
                self.ledger.add("martingale", noise_martingale(cur.grad_first_variation, self.w, xi))
                self.ledger.add("partial", self.dt * self.noise.ito_correction(x, heads, self.w, log_scale=c))
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


class _AdjointField(torch.nn.Module):
    """The projected field as the nn.Module that torchdiffeq's adjoint needs; ``adjoint_params``
    are the tensors requiring grad that the field reads (see :func:`_rebind_for_adjoint`)."""

    def __init__(self, func: Callable, params: Tuple[torch.Tensor, ...]):
        super().__init__()
        self._func = func
        self.adjoint_params = params

    def forward(self, t, y):
        return self._func(t, y)


def _walk(o, fn, depth=0):
    """Rebuild o with every tensor replaced by fn(tensor), through Heads, Processes (shallow
    copies), lists, tuples and dicts; other objects are returned as they are."""
    if depth > 8:
        return o
    if isinstance(o, torch.Tensor):
        return fn(o)
    if isinstance(o, Heads):
        return o.map(fn)
    if isinstance(o, (list, tuple)):
        return type(o)(_walk(v, fn, depth + 1) for v in o)
    if isinstance(o, dict):
        return {k: _walk(v, fn, depth + 1) for k, v in o.items()}
    if isinstance(o, WeightPath):  # the field reads the scores and the template only
        new = copy.copy(o)
        new.scores, new.template = fn(o.scores), _walk(o.template, fn, depth + 1)
        return new
    if isinstance(o, Process):
        new = copy.copy(o)
        for k, v in vars(o).items():
            setattr(new, k, _walk(v, fn, depth + 1))
        return new
    return o


def _rebind_for_adjoint(*objs):
    """(copies of objs, params) for odeint_adjoint.

    Every tensor requiring grad that the objects hold (head tensors, β, process parameters, a
    sampled weight path, token weights) is replaced in the copies by a clone, and the clones are
    the adjoint parameters.  Clones, not the tensors themselves: the adjoint takes the gradient
    of the field with respect to all of its parameters at once, and a parameter that is a
    function of another (a sampled path of its initial heads, V = 2A, A = QᵀK next to Q) would
    be counted twice.  A clone is read by the field only, so each gets the field's direct
    dependence; autograd then carries the clones' gradients back to the originals."""
    clones: Dict[int, torch.Tensor] = {}

    def fn(t):
        if not t.requires_grad:
            return t
        if id(t) not in clones:
            clones[id(t)] = t.clone()
        return clones[id(t)]

    copies = tuple(_walk(o, fn) for o in objs)
    return copies, tuple(clones.values())


@torch.no_grad()
def _initial_step(func, t0: torch.Tensor, y0: torch.Tensor, rtol: float, atol: float, order: int = 5) -> float:
    """First step of an adaptive solve (Hairer, Nørsett & Wanner I, §II.4, the rule torchdiffeq
    uses), computed without autograd.  torchdiffeq's own choice is differentiable, so every node
    time of the solve would depend on the parameters through it; with a time-dependent field
    evaluated at float(t) that dependence is cut and backpropagated gradients come out wrong
    (by 1e-4 relative at rtol = 1e-11, 1e-2 at rtol = 1e-5).  A constant first step removes it."""
    scale = atol + y0.abs() * rtol
    rms = lambda v: float(v.square().mean().sqrt())  # noqa: E731
    f0 = func(t0, y0)
    d0, d1 = rms(y0 / scale), rms(f0 / scale)
    h0 = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    f1 = func(t0 + h0, y0 + h0 * f0)
    d2 = rms((f1 - f0) / scale) / h0
    h1 = max(1e-6, h0 * 1e-3) if max(d1, d2) <= 1e-15 else (0.01 / max(d1, d2)) ** (1.0 / order)
    return min(100 * h0, h1)


def _simulate_adaptive(x, process, drv, ev, *, K, t0, dt, record_every, sign, diagnostics, rtol, atol, method,
                       normalization, direction, weights, start, return_path, adjoint=False, chunk_elements=None,
                       causal=False, obs=None, realised=False, scale=None, fix_scale=None):
    """dopri5 through torchdiffeq on the projected field; ledger by the trapezoid rule on the record grid
    (the martingale, and with ``realised`` the quadratic variation, as Itô sums over the record intervals).
    A closed-form Θ with knots (layer starts) is solved piece by piece between them, and the ledger
    is sampled on both sides of each knot, so it books the jumps of Θ.

    With ``adjoint`` the solve goes through ``odeint_adjoint`` (gradients by the adjoint ODE)."""
    scale = {"c": 0.0, "start_max": float("nan"), "given": False} if scale is None else scale
    # stochastic or grid-stepped weights: sample the whole path on the dt grid first
    path = drv.sample_path(K) if drv.mode != "closed" else None
    source = path if path is not None else process
    rec = Recorder(K, record_every, diagnostics=False, observables=obs, weights=weights)
    times = rec.times(t0, dt)
    knots = [] if path is not None else process.knots(t0, float(times[-1]))
    grid, rows = _knot_grid(times, knots)
    ys, nfe = _dopri5(x, ev, source, grid.to(x.dtype).to(x.device), knots, weights=weights, rtol=rtol, atol=atol,
                      adjoint=adjoint, normalization=normalization, sign=sign, chunk_elements=chunk_elements,
                      causal=causal)
    xs = normalize(ys)
    if not _check_finite(xs):
        bad = int((~torch.isfinite(xs.flatten(1)).all(-1)).nonzero()[0])
        tb = float(grid[bad])
        raise nonfinite_error("the token positions", tb, round((tb - t0) / dt), source.heads_at(tb),
                              normalization)
    ledger, series = {}, {"energy": None, "slope": None, "dissipation": None}
    if diagnostics:
        ledger, series = _record_grid_ledger(xs, grid, rows, rec.steps, ev, path, process, knots, weights=weights,
                                             scale=scale, fix_scale=fix_scale, realised=realised, sign=sign,
                                             causal=causal)
    xs, ys = xs[rows], ys[rows]
    for r in range(len(rec.steps)):
        rec.record(xs[r])
    observed = rec.stacked(t0, dt)[4]
    stats = {"steps": K, "field_evaluations": nfe, "max_sphere_error": float((ys.detach().norm(dim=-1) - 1).abs().max()),
             "wall_time": time.perf_counter() - start, "order": 5, "energy_log_scale": scale["c"],
             "gradient_flow": not causal}
    return Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      method, normalization, direction, weights, path if return_path else None,
                      observables=observed)


def _knot_grid(times, knots):
    """(the record times with the knots added, float64; the index of each record time in it).

    A knot within 1e-9 of the span of a record time takes that record time's place, so that Θ is
    sampled on both sides of the knot itself: sampled at the record time, both sides could fall in
    the same layer and the jump would be lost."""
    if not knots:
        return times, list(range(len(times)))
    tol = 1e-9 * float(times[-1] - times[0])
    grid, extra = times.clone(), []
    for tj in knots:
        i = int((times - tj).abs().argmin())
        if abs(float(times[i]) - tj) > tol:
            extra.append(tj)
        else:
            grid[i] = tj
    grid = torch.sort(torch.cat([grid, torch.tensor(extra, dtype=torch.float64)])).values
    return grid, [int((grid - t).abs().argmin()) for t in times]


def _pieces(grid, knots):
    """Index ranges [i, j] of the grid between consecutive knots (each knot ends one piece, starts the next)."""
    tol = 1e-9 * float(grid[-1] - grid[0])
    cuts = [0] + [int((grid - tj).abs().argmin()) for tj in knots if abs(float(grid[-1]) - tj) > tol] + [len(grid) - 1]
    return list(zip(cuts[:-1], cuts[1:]))


def _piece_heads(source, a: float, b: float, closed: bool):
    """Θ on the piece [a, b]: its right limit at a, its left limit at b (the piece's own layer),
    whatever the rounding of the solver's time; the plain ``heads_at`` without knots."""
    if not closed:
        return source.heads_at
    tol = 1e-6 * (b - a)

    def heads(t):
        return source.heads_at(a) if t <= a + tol else source.left_heads_at(min(t, b))
    return heads


def _dopri5(x, ev, source, grid, knots, *, weights, rtol, atol, adjoint, normalization, sign, chunk_elements,
            causal):
    """torchdiffeq's dopri5 on the projected field through the grid, one solve per piece between knots;
    (ys, field evaluations)."""
    from torchdiffeq import odeint, odeint_adjoint

    nfe = [0]
    pieces = _pieces(grid, knots) if knots else [(0, len(grid) - 1)]
    if adjoint:
        (source, w_c), params = _rebind_for_adjoint(source, weights)
        causal_kw = {"causal": causal} if causal else {}
    out, y = [x[None]], x
    for i, j in pieces:
        heads_at = _piece_heads(source, float(grid[i]), float(grid[j]), bool(knots))
        if adjoint:
            def afunc(t, y, heads_at=heads_at):
                nfe[0] += 1
                return evaluate(normalize(y), heads_at(float(t.detach())), w_c, normalization=normalization,
                                sign=sign, diagnostics=False, chunk_elements=chunk_elements, **causal_kw).velocity

            ys = odeint_adjoint(_AdjointField(afunc, params), y, grid[i:j + 1], method="dopri5", rtol=rtol,
                                atol=atol, adjoint_params=params)
        else:
            def func(t, y, heads_at=heads_at):
                nfe[0] += 1
                return ev(normalize(y), heads_at(float(t.detach())), False).velocity

            first = _initial_step(func, grid[i], y.detach(), rtol, atol)
            ys = odeint(func, y, grid[i:j + 1], method="dopri5", rtol=rtol, atol=atol, options={"first_step": first})
        out.append(ys[1:])
        y = ys[-1]
    return (torch.cat(out) if len(out) > 2 else ys), nfe[0]


def _record_grid_ledger(xs, grid, rows, rec_k, ev, path, process, knots, *, weights, scale, fix_scale, realised,
                        sign, causal):
    """Energy, 𝒢², 𝒟 and the ledger (:func:`~.parts.ledger_from_series`) at the tokens xs on the grid
    (record times and knots); at a knot a left-limit sample first, and the jump E(Θ) − E(Θ−) booked."""
    w, tol = weights, 1e-9 * float(grid[-1] - grid[0])
    samples, step_of = [], dict(zip(rows, rec_k))  # (t, x, heads, rate, σ, record step or None)
    for g in range(len(grid)):
        t, k = float(grid[g]), step_of.get(g)
        if any(abs(t - tj) <= tol for tj in knots):
            samples.append((t, xs[g], process.left_heads_at(t), process.left_score_rate(t), 0.0, None))
        if path is not None:
            samples.append((t, xs[g], path.heads_at(t), path.rates[k], path.sigmas[k], k))
        else:
            samples.append((t, xs[g], process.heads_at(t), process.score_rate(t), 0.0, k))
    E, G, D, P, M, Q = [], [], [], [], [], []
    for r, (t, x, hk, rate, sig, k) in enumerate(samples):
        e = ev(x, hk, True)
        if r == 0 and fix_scale is not None and fix_scale(e):
            e = ev(x, hk, True)
        c = scale["c"]
        pt = partial_density(x, hk, w, e.stats, rate, sig, ito=process.noisy and not realised, log_scale=c)
        if process.noisy and r + 1 < len(samples):
            dn = path.noise[k:samples[r + 1][5]].sum(0)
            M.append(pairing(x, hk, w, e.stats, dn, log_scale=c))
            if realised:
                Q.append(realised_qv_term(x, hk, w, e.stats, dn, log_scale=c))
        elif knots and r > 0:  # the jump of Θ between a left-limit sample and the next (0 elsewhere)
            Q.append(e.energy - E[-1] if samples[r - 1][0] == t else torch.zeros_like(e.energy))
        _check_ledger(e, pt, t, -1 if k is None else k, scale)
        E.append(e.energy)
        G.append(e.slope)
        D.append(e.dissipation)
        P.append(pt)
    keep = [r for r, smp in enumerate(samples) if smp[5] is not None]
    E, G, D, P = map(torch.stack, (E, G, D, P))
    times = torch.tensor([smp[0] for smp in samples], dtype=torch.float64)
    ledger = ledger_from_series(E, G, D, P, M, Q, times, sign=sign, causal=causal)
    return {key: v[keep] for key, v in ledger.items()}, {"energy": E[keep], "slope": G[keep], "dissipation": D[keep]}
