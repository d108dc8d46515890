"""Particle solver: N tokens moved by the multi-head attention field with time-dependent heads.

    ẋ_i = V[μ_t, Θ_t](x_i),   μ_t = Σ_i w_i δ_{x_i(t)},   x_i ∈ S^{d-1}

Fixed-step methods are explicit Runge–Kutta schemes in the ambient space with the projective
retraction x ↦ x/|x| after every stage ("euler" is the reference code's projected Euler);
"adaptive" is torchdiffeq's dopri5 on the projected field.  Along the way the solver keeps
the energy–dissipation ledger of DESIGN §2 (see :class:`Trajectory`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .. import threads
from .._validation import (
    NORMALIZATIONS,
    check_choice,
    check_int,
    check_positive,
    check_real,
    check_same,
    check_seed,
    check_tied_all,
    check_token_weights,
    check_tokens,
    direction_sign,
)
from ..attention import softmax_statistics
from ..energy import choose_log_scale, ito_correction, pairing
from ..energy import quadratic_variation as realised_qv_term
from ..field import FieldEval, evaluate
from ..mobility import scaled_diagnostics
from ..heads import Heads
from ..processes import Constant, Process, WeightDriver, WeightPath, grid_steps
from ..sphere import normalize

__all__ = ["simulate", "Trajectory", "ButcherTableau", "TABLEAUX", "METHODS", "NonFiniteError", "LEDGER_KEYS",
           "QUADRATIC_VARIATIONS", "PROGRESS_MIN_WORK"]

LEDGER_KEYS = ("dE", "partial", "dissipation", "slope", "martingale", "residual", "residual_slope")

#: the ways the ledger books the second-order (Itô) term of noisy weights (``quadratic_variation=``)
QUADRATIC_VARIATIONS = ("expected", "realised")

#: ``progress=None`` shows a bar (on a terminal only) when steps · stages · paths · H · n² reaches this
#: many kernel terms (a solve of several seconds on one core)
PROGRESS_MIN_WORK = 1e9

logger = logging.getLogger(__name__)

#: named internal API (not public), used by the sharded solver and the JKO scheme
__internal__ = ["nonfinite_error", "assemble_records"]

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
    if normalization in ("unnormalized", "effective") and bmax > R / 2:
        kind = ("the unnormalised field carries the kernel e^{β⟨x,Ay⟩} itself" if normalization == "unnormalized"
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
    return bool(torch.isfinite(t).all())


def _fingerprint(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
            h.update(str((tuple(p.shape), p.dtype)).encode())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


def _process_signature(process) -> list:
    """Everything that defines a process (type, scheme, rates, σ, means, phases, heads and β), flattened
    for the checkpoint fingerprint, so a checkpoint of a run with other weights is refused."""
    out = [type(process).__name__]

    def add(v, depth=0):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, Heads):
            for t in (v.score, v.value, v.weights, v.query, v.key):
                if t is not None:
                    out.append(t)
            out.append(v.beta if isinstance(v.beta, torch.Tensor) else repr(v.beta))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out.append(repr(v))
        elif isinstance(v, (list, tuple)) and depth < 2:
            for u in v:
                add(u, depth + 1)
        else:
            out.append(type(v).__name__)

    for key in sorted(vars(process)):
        out.append(key)
        add(vars(process)[key])
    return out


def _save_atomic(obj, path: Path):
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
    seed: int = 0,
    generator: Optional[torch.Generator] = None,
    record_every: int = 1,
    diagnostics: bool = True,
    quadrature: Optional[str] = None,
    rtol: float = 1e-7,
    atol: float = 1e-9,
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
) -> Trajectory:
    """Integrate the token ODE ẋ_i = V[μ_t, Θ_t](x_i) on S^{d-1} from t0 to t1.

    Args:
        x0: initial tokens (..., n, d) on the unit sphere (leading dims are an ensemble).
        theta: :class:`Heads` (constant in time), a :class:`~transformer_pde.processes.Process`
            (OU, oscillating, layerwise, custom) or a stored :class:`WeightPath` (replayed exactly).
        t1, dt: final time and step ((t1 − t0)/dt must be a whole number); for "adaptive",
            dt is the grid on which stochastic weights are sampled.
        method: "euler" (order 1, the reference code), "heun" (2), "rk4" (4), "adaptive" (dopri5).
        normalization: "softmax" | "unnormalized" | "relu" | "effective".
        direction: "descent" (default here, the reference code: x ← x − Δt·f) or "ascent".
        weights: token weights (..., n) or None (uniform).
        paths: number of Monte-Carlo paths of the weights (adds a leading axis to the results).
        seed / generator: the weights' random stream (tokens are not random here; sample x0
            with your own generator so the two streams stay separate).
        record_every: keep every k-th step (the first and last times are always kept).
        diagnostics: compute energy, 𝒢², 𝒟 and the ledger (False: tokens only, faster).
        quadrature: "left" (default for euler, the reference code) or "trapezoid" (default
            for the others) for the ledger's time integrals; the martingale is an Itô sum.
        adjoint: with method="adaptive", backpropagate by torchdiffeq's adjoint ODE
            (``odeint_adjoint``: memory independent of the number of steps, for long horizons)
            instead of through the solver's operations; gradients reach x0, the head tensors, β,
            the process parameters and the token weights (tensors a custom Process hides in
            closures are not seen: keep them as attributes).
        return_path: store the realised weight path in ``traj.path`` for replay.
        progress: True / False: show / hide a tqdm bar (it appears only on a terminal:
            ``disable=None``).  None (default): show it for long fixed-step solves, when
            steps · stages · paths · H · n² ≥ :data:`PROGRESS_MIN_WORK`.
        chunk_elements: memory cap of one score block (see :mod:`transformer_pde.attention`).
        checkpoint: file to checkpoint to (atomically, every ``checkpoint_every`` steps) and to
            resume from if it exists and matches this run; a foreign or corrupt file is refused.
        callback: called as callback(k, t, x) after every step (e.g. for early stopping hooks).
        causal: token i attends only to tokens j ≤ i (:func:`transformer_pde.evaluate`); not with
            "effective".  The energy, 𝒢², 𝒟 stay those of the whole measure, but the flow is no
            gradient flow: the ledger has no "residual"/"residual_slope" and
            ``traj.stats["gradient_flow"]`` is False.
        observables: mapping name -> callable(x, weights) returning a tensor of shape
            (*batch,) or (*batch, k) for tokens x of shape (*batch, n, d) (batch includes the
            paths axis); evaluated at every recorded time and stacked into
            ``traj.observables[name]`` of shape (T, *batch[, k]).
        quadratic_variation: how the ledger books the second-order term of noisy weights:
            "expected" (default) adds the Itô correction E[½ ∂²_A E[dN, dN]] (the ledger closes at
            order 1 in the mean over paths, one path like dt^{1/2}); "realised" books
            ½ ∂²_A E[ΔN, ΔN] of the realised noise increments ΔN per step (per record interval
            for "adaptive"), so that every single path closes at order 1 (costs one
            (paths, H, n, n) kernel block per step).  No effect on deterministic weights.
        energy_log_scale: the common scale c: energy, 𝒢², 𝒟 and the ledger are reported times
            e^{−c}.  None (default): chosen at t0 by
            :func:`transformer_pde.energy.choose_log_scale` (0 unless the largest log-partition
            exceeds half the dtype's exponent range, i.e. β‖A‖ ≳ 44 in float32, ≳ 354 in float64),
            so ordinary runs record the values themselves.  Stored in
            ``traj.stats["energy_log_scale"]``.

    Returns:
        :class:`Trajectory`.  dtype and device follow x0; the solve is differentiable with
        respect to x0, the head tensors, β, tensor process parameters (OU rate/sigma/mean,
        oscillating sigma) and the token weights when they require grad.

    Stage weights: Runge–Kutta stages see Θ at their own stage times when the process has a
    closed form (deterministic, scheme="exact"); on grid-sampled paths (noisy, or
    scheme="euler") they see the linear interpolation between the bracketing grid values,
    so a stochastic path limits every method to order 1 in dt.

    Raises:
        TypeError / ValueError for bad input (before any work); NonFiniteError when the run
        produces NaN/inf (with the time, step and quantity, and the fix: for a ledger term that
        outgrew the common scale, the ``energy_log_scale=`` to pass).

    Example:
        >>> import torch, transformer_pde as tp
        >>> x0 = tp.sphere.octahedral(20, dtype=torch.float64)
        >>> traj = tp.simulate(x0, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=1.0, dt=0.1)
        >>> traj.x.shape
        torch.Size([11, 20, 3])
    """
    # ---------------- validation (before any work)
    check_tokens(x0, "x0")
    check_choice(method, METHODS, "method")
    check_choice(normalization, NORMALIZATIONS, "normalization")
    sign = direction_sign(direction)
    dt = check_positive(dt, "dt")
    t1 = check_real(t1, "t1")
    t0 = check_real(t0, "t0")
    K = grid_steps(t0, t1, dt)
    record_every = check_int(record_every, "record_every")
    checkpoint_every = check_int(checkpoint_every, "checkpoint_every")
    if paths is not None:
        paths = check_int(paths, "paths")
    seed = check_seed(seed)
    if quadrature is None:
        quadrature = "left" if method == "euler" else "trapezoid"
    check_choice(quadrature, ("left", "trapezoid"), "quadrature")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}")
    if causal and normalization == "effective":
        raise ValueError("normalization='effective' is the gradient field b^{-1} ∇ δE/δμ and has no causal version; "
                         "use 'softmax', 'unnormalized' or 'relu' with causal=True")
    check_choice(quadratic_variation, QUADRATIC_VARIATIONS, "quadratic_variation")
    realised = quadratic_variation == "realised"
    obs = _check_observables(observables)
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
    check_same(x0, h0._ref, "x0", "theta's heads")
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
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError("generator must be a torch.Generator")
    if not isinstance(adjoint, bool):
        raise TypeError(f"adjoint must be True or False, got {type(adjoint).__name__}")
    if adjoint and method != "adaptive":
        raise ValueError(f"adjoint=True needs method='adaptive' (torchdiffeq's adjoint ODE); got method={method!r}. "
                         f"The fixed-step methods backpropagate through their steps: use adjoint=False")
    if method == "adaptive" and checkpoint is not None:
        raise ValueError("checkpointing is supported for the fixed-step methods; use euler, heun or rk4")

    start = time.perf_counter()
    x = x0 if paths is None else x0.unsqueeze(0).expand(paths, *x0.shape)
    w = weights
    drv = WeightDriver(process, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt,
                        store=return_path, batch_rank=len(bx))
    # tokens carry every batch axis of the heads (paths, replayed paths) from the start
    x = x.expand(*torch.broadcast_shapes(x.shape[:-2], drv.current.batch_shape), *x.shape[-2:])
    noisy = process.noisy
    causal_kw = {"causal": True} if causal else {}
    # the common scale c of the energy and the ledger (0: the values themselves); fixed at t0
    scale = {"c": 0.0 if energy_log_scale is None else energy_log_scale, "start_max": float("nan"),
             "given": energy_log_scale is not None}

    def ev(xk, heads, diag):
        """One field evaluation; with diag, the (non-causal) statistics and the diagnostics times e^{−c}."""
        c = scale["c"]
        if not diag or (c == 0.0 and not causal):  # ordinary runs: evaluate's own diagnostics, bit for bit
            return evaluate(xk, heads, w, normalization=normalization, sign=sign, diagnostics=diag,
                            second_moment=diag and noisy, chunk_elements=chunk_elements, **causal_kw)
        fe = evaluate(xk, heads, w, normalization=normalization, sign=sign, diagnostics=False,
                      second_moment=noisy and not causal, chunk_elements=chunk_elements, **causal_kw)
        full = (softmax_statistics(xk, heads, w, second_moment=noisy, chunk_elements=chunk_elements) if causal
                else fe.stats)
        E, G, D, g = scaled_diagnostics(xk, heads, w, fe.velocity, full, log_scale=c, chunk_elements=chunk_elements)
        return FieldEval(fe.velocity, full, fe.outputs, g, E, G, D)

    def fix_scale(evk) -> bool:
        """Fix c from the log-partitions of the first evaluation (unless given); True when c ≠ 0
        (the caller then evaluates again, at that scale)."""
        lp = evk.stats.log_partition.detach()
        scale["start_max"] = float(lp.max()) if lp.numel() else 0.0
        if energy_log_scale is None:
            scale["c"] = choose_log_scale(lp)
        if energy_log_scale is not None:
            return False  # the first evaluation already used the given scale
        if scale["c"] != 0.0:
            logger.info("energy and ledger reported times e^(-%.6g) (largest log-partition at t0: %.6g)",
                        scale["c"], scale["start_max"])
        return scale["c"] != 0.0

    work = float(math.prod(x.shape[:-2])) * h0.num_heads * x.shape[-2] ** 2

    if method == "adaptive":
        with threads.scope(work):
            return _simulate_adaptive(x, process, drv, ev, K=K, t0=t0, dt=dt, record_every=record_every,
                                      sign=sign, diagnostics=diagnostics, rtol=rtol, atol=atol, method=method,
                                      normalization=normalization, direction=direction, weights=w, start=start,
                                      return_path=return_path, adjoint=adjoint, chunk_elements=chunk_elements,
                                      causal=causal, obs=obs, realised=realised, scale=scale,
                                      fix_scale=fix_scale)

    tab = TABLEAUX[method]
    rec_k = sorted(set(range(0, K + 1, record_every)) | {K})
    rec_set = set(rec_k)
    records: Dict[str, List[torch.Tensor]] = {"x": []}
    if diagnostics:
        for key in ("energy", "slope", "dissipation", *("ledger." + k for k in LEDGER_KEYS)):
            records[key] = []
    for name in obs:
        records["obs." + name] = []
    nfe = 0
    max_sphere = 0.0
    acc = {}
    k_start = 0

    # ---------------- checkpoint / resume
    ckpt_path = None if checkpoint is None else Path(checkpoint)
    fp = None
    resumed = False
    if ckpt_path is not None:
        # options added later enter the fingerprint only when not at their default, so that
        # checkpoints of ordinary runs written before them still resume
        extra = ([("causal", True)] if causal else []) + ([("quadratic_variation", "realised")] if realised else []) \
            + ([("energy_log_scale", energy_log_scale)] if energy_log_scale is not None else []) \
            + ([("observables", tuple(sorted(obs)))] if obs else [])
        fp = _fingerprint(x0, *_process_signature(process), t0, t1, dt, method, normalization, direction,
                          paths, seed, record_every, quadrature, diagnostics, weights, *extra)
        if ckpt_path.exists():
            try:
                ck = torch.load(ckpt_path, map_location=x0.device, weights_only=False)
            except Exception as e:  # corrupt or unreadable
                raise ValueError(f"checkpoint {ckpt_path} is corrupted or unreadable ({type(e).__name__}: {e}); "
                                 f"delete it to start afresh") from None
            if not isinstance(ck, dict) or ck.get("kind") != "transformer_pde.simulate":
                raise ValueError(f"{ckpt_path} is not a transformer_pde simulate checkpoint; delete it or choose another path")
            if ck.get("fingerprint") != fp:
                raise ValueError(f"checkpoint {ckpt_path} belongs to a different run (config fingerprint "
                                 f"{ck.get('fingerprint')} != {fp}); delete it or use another path")
            k_start = ck["k"]
            x = ck["x"]
            drv.load_state(ck["driver"])
            records = ck["records"]
            acc = ck["acc"]
            nfe, max_sphere = ck["nfe"], ck["max_sphere"]
            scale.update(ck.get("scale", {"c": 0.0, "start_max": float("nan")}))
            resumed = True

    heads = drv.current
    cur = ev(x, heads, diagnostics)
    nfe += 1
    if not _check_finite(cur.velocity):
        raise nonfinite_error("the velocity field", drv.t, drv.k, heads, normalization)
    if diagnostics and not resumed and fix_scale(cur):
        cur = ev(x, heads, True)
    c_scale = scale["c"]

    def densities(xk, hk, evk, rate, sigma):
        if not diagnostics:
            return None
        pt = pairing(xk, hk, w, evk.stats, rate, log_scale=c_scale)
        if noisy and not realised:
            pt = pt + ito_correction(hk, w, evk.stats, sigma, log_scale=c_scale)
        return {"partial": pt, "dissipation": evk.dissipation, "slope": evk.slope}

    def check_ledger(evk, dens_k, t, k):
        for name, v in (("the energy", evk.energy), ("the dissipation 𝒟", evk.dissipation),
                        ("the metric slope 𝒢²", evk.slope), ("∂_tE (ledger 'partial')", dens_k["partial"])):
            if not _check_finite(v):
                raise _ledger_nonfinite(name, t, k, evk.stats.log_partition, c_scale, scale["start_max"],
                                        energy_log_scale is not None)

    dens = densities(x, heads, cur, drv.rate, drv.sigma)
    if diagnostics and k_start == 0:
        check_ledger(cur, dens, drv.t, drv.k)
        E0 = cur.energy
        zero = torch.zeros_like(E0)
        acc = {"E0": E0, "partial": zero, "dissipation": zero, "slope": zero, "martingale": zero}
    ledger_keys = LEDGER_KEYS if not causal else tuple(k for k in LEDGER_KEYS if not k.startswith("residual"))

    def record(xk, evk):
        records["x"].append(xk.detach() if not xk.requires_grad else xk)
        if diagnostics:
            dE = evk.energy - acc["E0"]
            led = {"dE": dE, "partial": acc["partial"], "dissipation": acc["dissipation"], "slope": acc["slope"],
                   "martingale": acc["martingale"],
                   "residual": dE - acc["partial"] - acc["dissipation"] - acc["martingale"],
                   "residual_slope": dE - acc["partial"] - sign * acc["slope"] - acc["martingale"]}
            for key in ("energy", "slope", "dissipation"):
                records[key].append(getattr(evk, key))
            for key in LEDGER_KEYS:
                records["ledger." + key].append(led[key])
        for name, fn in obs.items():
            records["obs." + name].append(_observe(name, fn, xk, w))

    # ledger "dissipation"/"slope" are running integrals; the series of the same names are instantaneous
    if k_start == 0:
        record(x, cur)

    show = progress if progress is not None else K * tab.stages * work >= PROGRESS_MIN_WORK
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=K, initial=k_start, desc=f"simulate ({method})", unit="step", leave=False, disable=None)
    try:
        with threads.scope(work) as pool:
            for k in range(k_start, K):
                t = drv.t
                noise = drv.prepare() if noisy else None
                # martingale increment (and the realised quadratic variation) at the left end (Itô)
                if diagnostics and noise is not None:
                    acc["martingale"] = acc["martingale"] + pairing(x, heads, w, cur.stats, noise, log_scale=c_scale)
                    if realised:
                        acc["partial"] = acc["partial"] + realised_qv_term(x, heads, w, cur.stats, noise,
                                                                              log_scale=c_scale)
                # token step with retraction at every stage
                ks = [cur.velocity]
                for i in range(1, tab.stages):
                    xs = x
                    for j, aij in enumerate(tab.a[i]):
                        if aij != 0.0:
                            xs = xs + (dt * aij) * ks[j]
                    xs = normalize(xs)
                    ks.append(ev(xs, drv.stage(tab.c[i]), False).velocity)
                    nfe += 1
                y = x
                for bi, ki in zip(tab.b, ks):
                    y = y + (dt * bi) * ki
                ny = y.detach().norm(dim=-1)
                max_sphere = max(max_sphere, float((ny - 1).abs().max()))
                x_new = y / ny.unsqueeze(-1) if not y.requires_grad else normalize(y)
                if not _check_finite(x_new):
                    raise nonfinite_error("the token positions", t + dt, k + 1, heads, normalization)
                jumps = drv.jumps()
                prev_heads = heads
                drv.advance()
                heads = drv.current
                nxt = ev(x_new, heads, diagnostics)
                nfe += 1
                if not _check_finite(nxt.velocity):
                    raise nonfinite_error("the velocity field", drv.t, drv.k, heads, normalization)
                if diagnostics:
                    dens_new = densities(x_new, heads, nxt, drv.rate, drv.sigma)
                    check_ledger(nxt, dens_new, drv.t, drv.k)
                    for key in ("partial", "dissipation", "slope"):
                        inc = dens[key] if quadrature == "left" else 0.5 * (dens[key] + dens_new[key])
                        acc[key] = acc[key] + dt * inc
                    if jumps:
                        before = ev(x_new, prev_heads, True).energy
                        acc["partial"] = acc["partial"] + (nxt.energy - before)
                    dens = dens_new
                x, cur = x_new, nxt
                if (k + 1) in rec_set:
                    record(x, cur)
                if callback is not None:
                    callback(k + 1, drv.t, x)
                if bar is not None:
                    bar.update(1)
                pool.refresh()
                if ckpt_path is not None and ((k + 1) % checkpoint_every == 0) and (k + 1) < K:
                    _save_atomic({"kind": "transformer_pde.simulate", "fingerprint": fp, "k": k + 1, "x": x.detach(),
                                  "driver": drv.state(), "records": records, "acc": acc, "nfe": nfe,
                                  "max_sphere": max_sphere, "scale": dict(scale)}, ckpt_path)
    finally:
        if bar is not None:
            bar.close()

    times, out_x, series, ledger = assemble_records(records, rec_k, t0, dt, diagnostics, ledger_keys)
    stats = {"steps": K, "field_evaluations": nfe, "max_sphere_error": max_sphere,
             "wall_time": time.perf_counter() - start, "order": tab.order,
             "energy_log_scale": c_scale, "gradient_flow": not causal}
    return Trajectory(times, out_x, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      method, normalization, direction, weights, drv.path() if return_path else None,
                      observables={name: torch.stack(records["obs." + name]) for name in obs})


def _check_observables(observables) -> Dict[str, Callable]:
    """``observables=`` as a dict of str -> callable (TypeError otherwise, before any work)."""
    if observables is None:
        return {}
    if not isinstance(observables, Mapping):
        raise TypeError(f"observables must be a mapping name -> callable(x, weights) (e.g. "
                        f"{{'mean': lambda x, w: x.mean(-2)}}), got {type(observables).__name__}")
    out = {}
    for name, fn in observables.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"observables: every name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"observables[{name!r}] must be a callable(x, weights) returning a tensor, "
                            f"got {type(fn).__name__}")
        out[name] = fn
    return out


def _observe(name: str, fn: Callable, x: torch.Tensor, weights) -> torch.Tensor:
    """One observable at one recorded time, checked: a tensor of shape (*batch,) or (*batch, k)."""
    v = fn(x, weights)
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"observables[{name!r}] returned {type(v).__name__}; it must return a tensor of shape "
                        f"(*batch,) or (*batch, k) for tokens of shape (*batch, n, d)")
    batch = tuple(x.shape[:-2])
    if tuple(v.shape[:len(batch)]) != batch or v.dim() not in (len(batch), len(batch) + 1):
        raise ValueError(f"observables[{name!r}] returned shape {tuple(v.shape)}; for tokens of shape "
                         f"{tuple(x.shape)} it must be {batch} or {batch + ('k',)}")
    return v.detach() if not v.requires_grad else v


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


def assemble_records(records, rec_k, t0, dt, diagnostics, ledger_keys=LEDGER_KEYS):
    """(times, x, series, ledger) stacked from the per-record lists of a fixed-step loop."""
    times = torch.tensor([t0 + k * dt for k in rec_k], dtype=torch.float64)
    out_x = torch.stack(records["x"])
    if diagnostics:
        ledger = {key: torch.stack(records["ledger." + key]) for key in ledger_keys}
        series = {key: torch.stack(records[key]) for key in ("energy", "slope", "dissipation")}
    else:
        ledger, series = {}, {"energy": None, "slope": None, "dissipation": None}
    return times, out_x, series, ledger


def _simulate_adaptive(x, process, drv, ev, *, K, t0, dt, record_every, sign, diagnostics, rtol, atol, method,
                       normalization, direction, weights, start, return_path, adjoint=False, chunk_elements=None,
                       causal=False, obs=None, realised=False, scale=None, fix_scale=None):
    """dopri5 through torchdiffeq on the projected field; ledger by the trapezoid rule on the record grid
    (the martingale, and with ``realised`` the quadratic variation, as Itô sums over the record intervals).

    With ``adjoint`` the solve goes through ``odeint_adjoint`` (gradients by the adjoint ODE)."""
    from torchdiffeq import odeint, odeint_adjoint

    obs = obs or {}
    scale = {"c": 0.0, "start_max": float("nan"), "given": False} if scale is None else scale
    w = weights
    # stochastic or grid-stepped weights: sample the whole path on the dt grid first
    if drv.mode != "closed":
        drv.store = True
        drv._scores, drv._rates, drv._sigmas, drv._noise = [], [], [], []
        drv._record_current()
        for _ in range(K):
            drv.advance()
        path = drv.path()
        heads_at = path.heads_at
    else:
        path = None
        heads_at = process.heads_at
    nfe = [0]

    def func(t, y):
        nfe[0] += 1
        return ev(normalize(y), heads_at(float(t.detach())), False).velocity

    rec_k = sorted(set(range(0, K + 1, record_every)) | {K})
    times = torch.tensor([t0 + k * dt for k in rec_k], dtype=torch.float64)
    grid = times.to(x.dtype).to(x.device)
    if adjoint:
        (source, w_c), params = _rebind_for_adjoint(path if path is not None else process, w)
        heads_at_c = source.heads_at
        causal_kw = {"causal": True} if causal else {}

        def afunc(t, y):
            nfe[0] += 1
            return evaluate(normalize(y), heads_at_c(float(t.detach())), w_c, normalization=normalization, sign=sign,
                            diagnostics=False, chunk_elements=chunk_elements, **causal_kw).velocity

        field_module = _AdjointField(afunc, params)
        ys = odeint_adjoint(field_module, x, grid, method="dopri5", rtol=rtol, atol=atol, adjoint_params=params)
    else:
        first = _initial_step(func, grid[0], x.detach(), rtol, atol)
        ys = odeint(func, x, grid, method="dopri5", rtol=rtol, atol=atol, options={"first_step": first})
    xs = normalize(ys)
    if not _check_finite(xs):
        bad = int((~torch.isfinite(xs.flatten(1)).all(-1)).nonzero()[0])
        raise nonfinite_error("the token positions", float(times[bad]), rec_k[bad], heads_at(float(times[bad])),
                         normalization)
    ledger, series = {}, {"energy": None, "slope": None, "dissipation": None}
    if diagnostics:
        E, G, D, P, M, Q = [], [], [], [], [], []
        for r, k in enumerate(rec_k):
            t = float(times[r])
            hk = heads_at(t)
            e = ev(xs[r], hk, True)
            if r == 0 and fix_scale is not None and fix_scale(e):
                e = ev(xs[r], hk, True)
            c = scale["c"]
            if path is not None:
                rate, sig = path.rates[k], path.sigmas[k]
            else:
                rate, sig = process.score_rate(t), 0.0
            pt = pairing(xs[r], hk, w, e.stats, rate, log_scale=c)
            if process.noisy:
                if not realised:
                    pt = pt + ito_correction(hk, w, e.stats, sig, log_scale=c)
                if r + 1 < len(rec_k):
                    dn = path.noise[k:rec_k[r + 1]].sum(0)
                    M.append(pairing(xs[r], hk, w, e.stats, dn, log_scale=c))
                    if realised:
                        Q.append(realised_qv_term(xs[r], hk, w, e.stats, dn, log_scale=c))
            for name, v in (("the energy", e.energy), ("the dissipation 𝒟", e.dissipation),
                            ("the metric slope 𝒢²", e.slope), ("∂_tE (ledger 'partial')", pt)):
                if not _check_finite(v):
                    raise _ledger_nonfinite(name, t, k, e.stats.log_partition, c, scale["start_max"],
                                            scale.get("given", False))
            E.append(e.energy)
            G.append(e.slope)
            D.append(e.dissipation)
            P.append(pt)
        E, G, D, P = map(torch.stack, (E, G, D, P))
        dts = (times[1:] - times[:-1]).to(E.dtype).reshape(-1, *([1] * (E.dim() - 1)))
        cum = lambda v: torch.cat([torch.zeros_like(v[:1]), torch.cumsum(dts * 0.5 * (v[1:] + v[:-1]), 0)])  # noqa: E731
        Mc = torch.zeros_like(E)
        if M:
            Mc = torch.cat([torch.zeros_like(E[:1]), torch.cumsum(torch.stack(M), 0)])
        partial = cum(P)
        if Q:
            partial = partial + torch.cat([torch.zeros_like(E[:1]), torch.cumsum(torch.stack(Q), 0)])
        dE = E - E[0]
        ledger = {"dE": dE, "partial": partial, "dissipation": cum(D), "slope": cum(G), "martingale": Mc}
        if not causal:
            ledger["residual"] = dE - ledger["partial"] - ledger["dissipation"] - Mc
            ledger["residual_slope"] = dE - ledger["partial"] - sign * ledger["slope"] - Mc
        series = {"energy": E, "slope": G, "dissipation": D}
    observed = {name: torch.stack([_observe(name, fn, xs[r], w) for r in range(len(rec_k))]) for name, fn in obs.items()}
    stats = {"steps": K, "field_evaluations": nfe[0], "max_sphere_error": float((ys.detach().norm(dim=-1) - 1).abs().max()),
             "wall_time": time.perf_counter() - start, "order": 5, "energy_log_scale": scale["c"],
             "gradient_flow": not causal}
    return Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      method, normalization, direction, weights, path if return_path else None,
                      observables=observed)
