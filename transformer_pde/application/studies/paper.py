"""The paper's Section 6: Ornstein–Uhlenbeck vs oscillating heads (Massucco et al. 2026).

Kind ``ou_vs_oscillating``.  For every regime ("ou", "oscillating") and every head count H:

    tokens  x_i(0): tp.sphere.octahedral(n, d, seed=seed)  (the reference draws; or "clustered_circle", "uniform")
    heads   D_h(0) = Z + Zᵀ, Z i.i.d. N(0, 1) from torch.Generator().manual_seed(seed + H)  (reference seeds)
    OU      dD_h = κ(I − D_h)dt + σ dW_sym, σ² = 2, κ = 1, ``paths`` Monte-Carlo paths, noise seed noise_seed + H
    osc.    dD_h = (F(t) − D_h)dt, one shared F(t) (phase "shared", the paper) or F(t + 2πh/H) ("per_head"), 1 path
    tokens  ẋ_i = V[μ_t, Θ_t](x_i), direction "descent" (the reference code), ω_h = 1/H, β = 1
    dtype   the tokens' dtype; the weights are stepped in float64 from the same draws whatever it is
            (a float32 run follows the float64 run to rounding; docs/reproducing.md#float32-tokens)

Each (regime, H) pair is a *segment*: solved with :func:`transformer_pde.solve` (``tp.FixedStep(method)``),
checkpointed every ``checkpoint_every`` steps, and written atomically to the run directory
when done (``data/<regime>_H<H>.pt`` with the recorded tensors, ``series/<regime>_H<H>.csv``
with Monte-Carlo mean and std).  ``--resume`` skips finished segments and continues a partial
one from its checkpoint: the records are bit-for-bit those of an uninterrupted run.

Metrics: the time average of 𝒢² over t ≥ ``t_avg`` per path; per regime the least-squares fit
log ḡ(H) = log a + b log H of the Monte-Carlo means, with two intervals for b over the paths:
a percentile bootstrap (paths resampled independently at every H) and a t-interval over the
per-path fits (path p of every H fitted alone); the final EDI residuals (𝒟-based ``residual``
and 𝒢²-based ``residual_slope``), Monte-Carlo mean ± std.  The paper reports b ≈ −1 (OU) and
b ≈ 0 (oscillating, shared phase).

Figures (``figures = true``): snapshots at five evenly spaced recorded times, the energy
balance, 𝒢²(t) and the scaling plot, each with a caption line (also in ``metrics.json`` under
``figure_captions``).  ``animate = true`` or ``figures = "all"`` adds ``figures/tokens.gif``,
the OU (path 0) and oscillating token flows at the largest H side by side
(:func:`transformer_pde.application.animation.animate_tokens`).  Segment progress is logged at INFO
through ``logging.getLogger(__name__)``; the tqdm bar shows only on a terminal.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import transformer_pde as tp

from .. import plotting
from ...utils import threads
from ...model.normalization import NORMALIZATIONS
from . import (
    DEVICE, DTYPE, Option, at_least, check_device, check_record_every, check_whole_steps, device_of, fingerprint,
    load_segment, nonnegative, open_unit, positive, segment_bar, sphere_name, step_callback, study, unique_nonempty,
    weight_process, dtype_of, spawn_pool)

__all__ = ["OPTIONS", "run_ou_vs_oscillating", "fit_power_law", "power_law_intervals", "time_average",
           "initial_tokens", "initial_heads", "check_params"]

logger = logging.getLogger(__name__)

REGIMES = ("ou", "oscillating")
LEDGER_KEYS = ("dE", "partial", "dissipation", "slope", "martingale", "residual", "residual_slope")
SERIES_KEYS = ("energy", "slope", "dissipation")


# ---------------------------------------------------------------------------- options
def _head_list(v):
    if len(v) == 0:
        return "must list at least one head count, e.g. [1, 10, 100]"
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
        return "must be a list of integers, e.g. [1, 10, 100]"
    if any(h < 1 for h in v):
        return "head counts must be >= 1"
    if len(set(v)) != len(v):
        return "must not repeat a head count"
    return None


def _workers_value(v):
    if isinstance(v, bool) or (isinstance(v, str) and v != "auto") or (isinstance(v, int) and v < 1):
        raise ValueError(f"workers must be 'auto' or an integer >= 1, got {v!r}")


def _figures_value(v):
    return None if isinstance(v, bool) or v == "all" else 'must be true, false or "all" (figures and the animation)'


OPTIONS = {
    "regimes": Option(["ou", "oscillating"], (list,), "weight processes to run", choices=REGIMES,
                      check=unique_nonempty),
    "heads": Option([1, 10, 100], (list,), "head counts H", check=_head_list),
    "n": Option(200, (int,), "number of tokens", check=positive),
    "d": Option(3, (int,), "ambient dimension: tokens on S^{d-1}", check=at_least(2)),
    "init": Option("octahedral", (str,), "initial tokens: near ±e_k (reference), circle clusters (d = 2), uniform",
                   choices=("octahedral", "clustered_circle", "uniform")),
    "init_noise": Option(0.05, (float,), "std of the initial noise around the vertices / base angles",
                         check=nonnegative),
    "clusters": Option(5, (int,), "base angles of init = 'clustered_circle'", check=positive),
    "seed": Option(42, (int,), "token seed (numpy, reference draws) and head seed base: D_h(0) uses seed + H"),
    "noise_seed": Option(2000, (int,), "OU noise stream: torch seed noise_seed + H (reference: S² 2000, S¹ 1000, "
                                       "S^{d-1} 3000)"),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "t1": Option(20.0, (float,), "final time T", check=positive),
    "dt": Option(5e-3, (float,), "time step (t1/dt must be a whole number)", check=positive),
    "record_every": Option(5, (int,), "record every k-th step", check=positive),
    "t_avg": Option(2.5, (float,), "time average of 𝒢² over t >= t_avg", check=nonnegative),
    "paths": Option(10, (int,), "Monte-Carlo paths of the OU weights (oscillating runs are deterministic: 1 path)",
                    check=positive),
    "ou_rate": Option(1.0, (float,), "OU mean-reversion rate κ (mean I)", check=positive),
    "ou_sigma2": Option(2.0, (float,), "OU noise variance σ²", check=nonnegative),
    "phase": Option("shared", (str,), "oscillating target: one F(t) for all heads (the paper) or F(t + 2πh/H)",
                    choices=("shared", "per_head")),
    "direction": Option("descent", (str,), "token flow direction (the paper: descent)", choices=("descent", "ascent")),
    "normalization": Option("softmax", (str,), "attention normalisation", choices=NORMALIZATIONS),
    "method": Option("euler", (str,), "token integrator (checkpointable fixed-step methods)",
                     choices=("euler", "heun", "rk4")),
    "scheme": Option("exact", (str,), "weights: exact transition / closed form, or 'euler' to match the reference "
                                      "code step for step", choices=("exact", "euler")),
    "dtype": DTYPE,
    "device": DEVICE,
    "store_paths": Option(1, (int,), "OU paths whose token trajectories are kept (snapshots)", check=positive),
    "workers": Option("auto", (str, int), "worker processes of one thread each for the segments; the OU paths of the "
                                          "largest segments are split between them (same numbers whatever the split). "
                                          "'auto': the cores this process may use; 1: every segment in this process "
                                          "under the thread policy (docs/performance.md)", check=_workers_value),
    "checkpoint_every": Option(500, (int,), "steps between atomic checkpoints of a segment", check=positive),
    "bootstrap": Option(2000, (int,), "bootstrap resamples for the interval of b (0: none)", check=nonnegative),
    "ci_level": Option(0.95, (float,), "confidence level of the intervals", check=open_unit),
    "figures": Option(True, (bool, str), 'draw the figures (PNG + PDF); "all" also writes the animation',
                      check=_figures_value),
    "animate": Option(False, (bool,), "write figures/tokens.gif: OU (path 0) vs oscillating token flows at the "
                                      "largest H, side by side"),
    "animation_frames": Option(60, (int,), "frames of the animation (evenly spaced recorded times)",
                               check=at_least(2)),
}


def check_params(p: Dict) -> None:
    """Checks that involve several keys (the schema checks each key alone); raises ValueError."""
    check_whole_steps(p)
    if p["t_avg"] >= p["t1"]:
        raise ValueError(f"config key 't_avg' = {p['t_avg']} must be smaller than 't1' = {p['t1']} "
                         f"(the time average runs over t_avg <= t <= t1)")
    check_record_every(p, t_from=p["t_avg"], what="the time average of 𝒢² over t >= t_avg")
    if p["init"] == "clustered_circle" and p["d"] != 2:
        raise ValueError(f"config key 'init' = 'clustered_circle' needs d = 2 (got 'd' = {p['d']}); "
                         f"allowed values for d = {p['d']}: 'octahedral', 'uniform'")
    check_device(p)


# ---------------------------------------------------------------------------- setup
def initial_tokens(p: Dict, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """x(0), (n, d): the reference's octahedral draw (numpy seed), circle clusters, or uniform."""
    if p["init"] == "octahedral":
        x = tp.sphere.octahedral(p["n"], p["d"], noise=p["init_noise"], seed=p["seed"], dtype=torch.float64)
    elif p["init"] == "clustered_circle":
        x = tp.sphere.clustered_circle(p["n"], p["clusters"], noise=p["init_noise"], seed=p["seed"],
                                       dtype=torch.float64)
    else:
        x = tp.sphere.sample_uniform(p["n"], p["d"], generator=torch.Generator().manual_seed(p["seed"]),
                                     dtype=torch.float64)
    return x.to(dtype=dtype, device=device)


def initial_heads(p: Dict, H: int, *, dtype=torch.float64, device=None):
    """Symmetric heads D_h(0) = Z + Zᵀ (Z drawn in float64 from seed + H, as the reference), ω = 1/H."""
    D = tp.Heads.random(H, p["d"], generator=torch.Generator().manual_seed(p["seed"] + H),
                        dtype=torch.float64).score_matrix
    return tp.Heads.symmetric(D.to(dtype=dtype, device=device), beta=p["beta"])


# parameters that do not change a segment (analysis and output only)
_NOT_IN_SEGMENT = ("figures", "animate", "animation_frames", "bootstrap", "ci_level", "t_avg", "checkpoint_every",
                   "workers")


# ---------------------------------------------------------------------------- statistics
def time_average(times, values, t_min: float = 0.0) -> np.ndarray:
    """Trapezoid time average (1/(t_end − t_min)) ∫_{t_min}^{t_end} v dt over the recorded times >= t_min.

    times: (T,); values: (T, ...).  Returns (...)."""
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = t >= t_min - 1e-9
    t, v = t[keep], v[keep]
    if len(t) < 2:
        return v[0]
    w = np.zeros_like(t)
    dtv = np.diff(t)
    w[1:] += dtv / 2
    w[:-1] += dtv / 2
    w /= t[-1] - t[0]
    return np.tensordot(w, v, axes=(0, 0))


def fit_power_law(heads, values) -> Dict[str, Optional[float]]:
    """Least squares log y = log a + b log H.  heads, values: (K,), values > 0.

    Returns {"a", "b", "b_se"}: the OLS standard error of b (None when K < 3); a and b are
    None when fewer than two distinct H are given or a value is not positive.
    """
    H = np.asarray(heads, dtype=float)
    y = np.asarray(values, dtype=float)
    if len(np.unique(H)) < 2 or np.any(~np.isfinite(y)) or np.any(y <= 0):
        return {"a": None, "b": None, "b_se": None}
    X, Y = np.log(H), np.log(y)
    xm, ym = X.mean(), Y.mean()
    sxx = ((X - xm) ** 2).sum()
    b = ((X - xm) * (Y - ym)).sum() / sxx
    c = ym - b * xm
    se = None
    if len(X) > 2:
        res = Y - (c + b * X)
        se = float(math.sqrt((res ** 2).sum() / (len(X) - 2) / sxx))
    return {"a": float(math.exp(c)), "b": float(b), "b_se": se}


def _slopes(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """OLS slopes of the rows of Y (R, K) against X (K,)."""
    xc = X - X.mean()
    return (Y - Y.mean(-1, keepdims=True)) @ xc / (xc ** 2).sum()


def power_law_intervals(heads, per_path: Sequence, *, level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> Dict:
    """Fit a·H^b to the path means and give two intervals for b over the Monte-Carlo paths.

    Parameters
    ----------
    heads
        (K,) head counts.  per_path: K arrays, the per-path time averages at each H.
    level : float
        confidence level.  resamples: bootstrap resamples (0: skip).  seed: bootstrap RNG.

    Returns a dict with the fit of the means ("a", "b", "b_se") and
        "b_ci": percentile bootstrap interval — at each H the paths are resampled with
            replacement (independently across H: the runs at different H are independent),
            the means refitted; None with a single path or resamples = 0;
        "b_paths_mean", "b_ci_paths": mean of the per-path fits (path p of every H fitted
            alone) and its Student-t interval, mean ± t_{P−1} s/√P; None unless every H has
            the same P >= 2 paths.
    """
    from scipy.special import stdtrit  # Student-t quantile (lighter import than scipy.stats)

    H = np.asarray(heads, dtype=float)
    per = [np.asarray(v, dtype=float).reshape(-1) for v in per_path]
    means = np.array([v.mean() for v in per])
    out = dict(fit_power_law(H, means))
    out.update({"b_ci": None, "b_paths_mean": None, "b_ci_paths": None, "level": level,
                "paths": [len(v) for v in per]})
    if out["b"] is None:
        return out
    X = np.log(H)
    alpha = 1 - level
    if resamples > 0 and all(len(v) >= 2 for v in per):
        rng = np.random.default_rng(seed)
        boot = np.empty((resamples, len(per)))
        for k, v in enumerate(per):
            idx = rng.integers(0, len(v), size=(resamples, len(v)))
            boot[:, k] = v[idx].mean(-1)
        ok = (boot > 0).all(-1)
        bs = _slopes(X, np.log(boot[ok]))
        lo, hi = np.quantile(bs, [alpha / 2, 1 - alpha / 2])
        out["b_ci"] = [float(lo), float(hi)]
    P = {len(v) for v in per}
    if len(P) == 1 and min(P) >= 2 and all((v > 0).all() for v in per):
        Pn = min(P)
        bp = _slopes(X, np.log(np.stack(per, -1)))  # (P,)
        m, s = float(bp.mean()), float(bp.std(ddof=1))
        q = float(stdtrit(Pn - 1, 1 - alpha / 2))
        out["b_paths_mean"] = m
        out["b_ci_paths"] = [m - q * s / math.sqrt(Pn), m + q * s / math.sqrt(Pn)]
    return out


# ---------------------------------------------------------------------------- one segment
def _as_paths(v: torch.Tensor) -> torch.Tensor:
    """A series (T, P, ...) of ``traj.with_paths()`` on the CPU, with its own storage."""
    return v.detach().cpu().clone()


class _PathSlice:
    """Paths lo:hi of a grid-sampled process with ``total`` paths: every grid step draws the noise of all
    ``total`` paths from the generator (the other paths' states are zeros) and keeps rows lo:hi, so a
    chunk of paths sees exactly the draws and the arithmetic it has in the full run (elementwise
    transition), whatever the split.  The transition is computed in float64 (where the device has it) whatever
    the tokens' dtype: a float32 run draws the float64 run's noise (torch draws other normals in float32) and
    rounds each A(t + dt) to float32, so it differs from the float64 run by rounding, not by another noise."""

    @staticmethod
    def wrap(theta, lo: int, hi: int, total: Optional[int]):
        """``theta`` stepped on paths lo:hi of ``total`` (None: a process without a paths axis), in float64."""
        A0 = theta.heads0.score_matrix
        work = A0.dtype if A0.device.type == "mps" else torch.promote_types(A0.dtype, torch.float64)  # MPS: no f64
        sliced = total is not None and (lo, hi) != (0, total)
        if not sliced and work == A0.dtype:
            return theta
        base = type(theta)

        def step(self, score, t, dt, generator=None):
            if sliced:
                full = score.new_zeros((total,) + tuple(score.shape[1:]), dtype=work)
                full[lo:hi] = score
            else:
                full = score.to(work)
            nxt, noise = base.step(self, full, t, dt, generator)
            rows = slice(lo, hi) if sliced else slice(None)
            return nxt[rows].to(score.dtype), None if noise is None else noise[rows].to(score.dtype)

        out = copy.copy(theta)
        out.__class__ = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
        return out


def _chunk_tag(tag: str, lo: int, hi: int, total: int) -> str:
    return tag if (lo, hi) == (0, total) else f"{tag}_paths{lo}-{hi}"


def _simulate_chunk(p: Dict, regime: str, H: int, x0: torch.Tensor, lo: int, hi: int, ckpt, *, dtype, device,
                    progress: bool = False, callback=None) -> Dict:
    """Paths lo:hi of the segment (regime, H) (the whole segment: lo = 0, hi = paths), as plain tensors."""
    heads0 = initial_heads(p, H, dtype=dtype, device=device)
    theta = weight_process(regime, heads0, rate=p["ou_rate"], sigma=math.sqrt(p["ou_sigma2"]), phase=p["phase"],
                           scheme=p["scheme"])
    total = p["paths"] if regime == "ou" else None
    theta = _PathSlice.wrap(theta, lo, hi, total)
    seed = p["noise_seed"] + H if regime == "ou" else 0
    start_step = 0
    if ckpt.exists():
        try:
            start_step = int(torch.load(ckpt, map_location="cpu", weights_only=False).get("k", 0))
        except Exception:  # the solver refuses it below with the full message
            start_step = 0
    t0 = time.perf_counter()
    model = tp.Model(theta, normalization=p["normalization"], direction=p["direction"])
    traj = tp.solve(model, x0, tp.FixedStep(p["method"]), t1=p["t1"], dt=p["dt"],
                    paths=None if total is None else hi - lo, seed=seed, saveat=tp.SaveAt(record_every=p["record_every"]),
                    ledger=tp.LedgerOptions(ledger=True),
                    checkpoint=tp.Checkpointing(ckpt, every=p["checkpoint_every"]),
                    progress=tp.Progress(show=progress, callback=callback))
    wall = time.perf_counter() - t0
    traj = traj.with_paths()  # (T, P, ...) whether or not the run had paths (P = 1 for the oscillating runs)
    k_keep = 1 if total is None else max(0, min(p["store_paths"], hi) - lo)  # the deterministic run: its one path
    # clone: a slice saved by torch.save would carry the storage of every path
    x = traj.x.detach().cpu()[:, :k_keep].clone()
    return {"lo": lo, "hi": hi, "times": traj.times.detach().cpu(),
            **{k: _as_paths(getattr(traj, k)) for k in SERIES_KEYS},
            "ledger": {k: _as_paths(v) for k, v in traj.ledger.items()}, "x": x,
            "wall": wall, "steps": int(traj.stats["steps"]), "start_step": start_step,
            "max_sphere_error": float(traj.stats["max_sphere_error"]), "threads": torch.get_num_threads()}


def _merge_chunks(p: Dict, regime: str, H: int, chunks: Sequence[Dict]) -> Dict:
    """The segment record from its path chunks (in path order): series and ledger concatenated over paths."""
    chunks = sorted(chunks, key=lambda c: c["lo"])
    cat = lambda key: torch.cat([c[key] for c in chunks], 1)  # noqa: E731
    steps = chunks[0]["steps"]
    wall = sum(c["wall"] for c in chunks)  # core-seconds: what one thread would have spent
    start = min(c["start_step"] for c in chunks)
    timing = {"wall_time_s": wall, "steps": steps, "resumed_from_step": start,
              "per_step_s": wall / max(1, steps - start),
              "max_sphere_error": max(c["max_sphere_error"] for c in chunks)}
    if len(chunks) > 1:
        timing["chunks"] = [{"paths": [c["lo"], c["hi"]], "wall_time_s": c["wall"], "threads": c["threads"]}
                            for c in chunks]
    return {
        "kind": "transformer_pde.ou_vs_oscillating.segment",
        "fingerprint": fingerprint(p, _NOT_IN_SEGMENT, regime=regime, H=H),
        "regime": regime, "H": H, "paths": p["paths"] if regime == "ou" else 1,
        "times": chunks[0]["times"],
        **{k: cat(k) for k in SERIES_KEYS},
        "ledger": {k: torch.cat([c["ledger"][k] for c in chunks], 1) for k in chunks[0]["ledger"]},
        "x": torch.cat([c["x"] for c in chunks], 1),
        "timing": timing,
    }


def _run_segment(p: Dict, regime: str, H: int, x0: torch.Tensor, run, tag: str, *, dtype, device,
                 callback=None) -> Dict:
    """The whole segment in this process (thread policy as set: the CLI's ``--threads auto``); ``callback``: the
    solver's step callback (default: the run's, :func:`step_callback`)."""
    total = p["paths"] if regime == "ou" else 1
    chunk = _simulate_chunk(p, regime, H, x0, 0, total, run.checkpoint_path(tag), dtype=dtype, device=device,
                            progress=run.progress, callback=callback or step_callback(run, tag))
    return _merge_chunks(p, regime, H, [chunk])


def plan_chunks(p: Dict, segments: Sequence[Tuple[str, int]], workers: int) -> List[Tuple[str, int, int, int]]:
    """The jobs (regime, H, lo, hi) for ``workers`` single-thread processes, largest first.

    A segment costs about paths·H·n² per step; one whose cost is above the total over ``workers`` is
    split into that many chunks of paths (OU only: the paths are independent), so that greedy
    largest-first scheduling keeps every worker busy until the end.  The split never changes the
    numbers (:class:`_PathSlice`)."""
    cost = {s: (p["paths"] if s[0] == "ou" else 1) * s[1] for s in segments}
    total = sum(cost.values())
    jobs = []
    for (regime, H) in segments:
        P = p["paths"] if regime == "ou" else 1
        k = 1 if workers < 2 or regime != "ou" else min(P, max(1, math.ceil(cost[(regime, H)] * workers / total)))
        bounds = [round(i * P / k) for i in range(k + 1)]
        jobs += [(regime, H, bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]
    return sorted(jobs, key=lambda j: -(j[3] - j[2]) * j[1])


def _worker_init():
    torch.set_num_threads(1)
    threads.policy(1)


def _worker_job(args):
    """One chunk in a worker process (spawned: its own torch, one thread)."""
    i, p, regime, H, x0, lo, hi, ckpt = args
    dtype = dtype_of(p)
    return i, _simulate_chunk(p, regime, H, x0, lo, hi, ckpt, dtype=dtype, device="cpu")


#: "auto" starts worker processes only for runs of at least this many kernel terms (Σ steps·paths·H·n²;
#: the full paper configuration has 2·10¹¹, its quick variant 3·10⁸): a spawned worker imports torch
#: again (seconds), which a short run does not win back
WORKERS_MIN_WORK = 1e10


def segment_work(p: Dict, segments: Sequence[Tuple[str, int]]) -> float:
    """Σ over the segments of steps · paths · H · n² (the kernel terms of the run)."""
    steps = round((p["t1"]) / p["dt"])
    return float(sum(steps * (p["paths"] if r == "ou" else 1) * H * p["n"] ** 2 for r, H in segments))


def resolve_workers(p: Dict, device, segments: Sequence[Tuple[str, int]] = ()) -> int:
    """Worker processes for the segments: ``p["workers"]``; 'auto': the cores this process may use
    (:func:`threads.cpu_budget`, capped by OMP_NUM_THREADS), or N under an explicit ``--threads N``;
    1 on a GPU (one device) and, under 'auto', for runs below :data:`WORKERS_MIN_WORK` kernel terms."""
    if torch.device(device).type != "cpu":
        return 1
    w = p.get("workers", "auto")
    if w != "auto":
        return int(w)
    if segment_work(p, segments) < WORKERS_MIN_WORK:
        return 1
    mode, cap = threads.current(), threads.omp_cap()
    n = mode if isinstance(mode, int) else threads.cpu_budget()  # an explicit --threads N means N cores
    return max(1, n if cap is None else min(n, cap))


def _run_in_workers(p: Dict, todo: Sequence[Tuple[str, int]], x0, run, workers: int, bar) -> Dict:
    """Every segment of ``todo`` on a pool of ``workers`` spawned one-thread processes; finished segments
    are saved as they complete (resume skips them; a chunk resumes from its own checkpoint)."""
    jobs = plan_chunks(p, todo, workers)
    need = {s: sum(1 for j in jobs if j[:2] == s) for s in todo}
    parts: Dict = {s: [] for s in todo}
    done: Dict = {}
    logger.info("%d segments as %d jobs on %d worker processes of one thread", len(todo), len(jobs), workers)
    args = []
    for regime, H, lo, hi in jobs:
        tag = f"{regime}_H{H}"
        total = p["paths"] if regime == "ou" else 1
        args.append((len(args), p, regime, H, x0.cpu(), lo, hi, run.checkpoint_path(_chunk_tag(tag, lo, hi, total))))
    with spawn_pool(min(workers, len(jobs)), _worker_init) as pool:  # Ctrl-C is left to this process
        # largest jobs first, one at a time to whichever worker is free; a segment is saved once all its chunks are back
        for i, chunk in pool.imap_unordered(_worker_job, args):
            job = jobs[i]
            regime, H = job[:2]
            parts[(regime, H)].append(chunk)
            threads.note(list(job[2:]), chunk["threads"], label=f"{regime}_H{H}", policy="worker")
            if len(parts[(regime, H)]) == need[(regime, H)]:
                tag = f"{regime}_H{H}"
                seg = _merge_chunks(p, regime, H, parts[(regime, H)])
                run.save_series(tag, _series_columns(seg))
                run.save_tensors(tag, seg)
                for c in parts[(regime, H)]:
                    run.checkpoint_path(_chunk_tag(tag, c["lo"], c["hi"], seg["paths"])).unlink(missing_ok=True)
                tm = seg["timing"]
                logger.info("[%s] done: %.1f core-s in %d chunk(s) (%.1f ms/step on one core)", tag,
                            tm["wall_time_s"], need[(regime, H)], tm["per_step_s"] * 1e3)
                done[(regime, H)] = seg
                bar.update(key=(regime, H))
    return done


def _series_columns(seg: Dict) -> Dict[str, torch.Tensor]:
    cols = {"t": seg["times"]}
    for k, v in [(k, seg[k]) for k in SERIES_KEYS] + [(f"ledger_{k}", seg["ledger"][k]) for k in LEDGER_KEYS]:
        cols[f"{k}_mean"] = v.mean(-1)
        cols[f"{k}_std"] = v.std(-1, unbiased=False)
    return cols


# ---------------------------------------------------------------------------- the study
@study("ou_vs_oscillating", OPTIONS,
       "the paper's Section 6: time-averaged 𝒢² vs H for OU and oscillating heads, energy balance, snapshots",
       validate=check_params)
def run_ou_vs_oscillating(params: Dict, run) -> Dict:
    """Run every (regime, H) segment (skipping finished ones on resume), then fit, summarise, plot."""
    p = dict(params)
    check_params(p)
    dtype = dtype_of(p)
    device = device_of(p)
    x0 = initial_tokens(p, dtype=dtype, device=device)
    segments = [(r, H) for r in p["regimes"] for H in p["heads"]]
    results: Dict = {}
    todo = [(r, H) for r, H in segments if load_segment(
        run, f"{r}_H{H}", "ou_vs_oscillating", fingerprint(p, _NOT_IN_SEGMENT, regime=r, H=H)) is None]
    workers = resolve_workers(p, device, todo)
    work = {s: segment_work(p, [s]) for s in segments}  # the bar's ETA follows the work, not the segment count
    with segment_bar(run, len(segments), "ou_vs_oscillating", "segment", work=work, log=logger) as bar:
        if workers > 1:
            if len(plan_chunks(p, todo, workers)) > 1:  # one job: run it here, with its progress bar
                results.update(_run_in_workers(p, todo, x0, run, workers, bar))
        for i, (regime, H) in enumerate(segments):
            if (regime, H) in results:
                continue
            tag = f"{regime}_H{H}"
            seg = load_segment(run, tag, "ou_vs_oscillating", fingerprint(p, _NOT_IN_SEGMENT, regime=regime, H=H),
                               required=("times", "x", "timing", *SERIES_KEYS, *(f"ledger.{k}" for k in LEDGER_KEYS)))
            if seg is None:
                logger.info("[%s] segment %d/%d running: H = %d, paths = %d, %d steps", tag, i + 1, len(segments), H,
                            p["paths"] if regime == "ou" else 1, round(p["t1"] / p["dt"]))
                seg = _run_segment(p, regime, H, x0, run, tag, dtype=dtype, device=device,
                                   callback=bar.steps(tag, round(p["t1"] / p["dt"]), key=(regime, H)))
                run.save_series(tag, _series_columns(seg))
                run.save_tensors(tag, seg)
                run.checkpoint_path(tag).unlink(missing_ok=True)
                tm = seg["timing"]
                logger.info("[%s] done in %.1f s (%.1f ms/step)", tag, tm["wall_time_s"], tm["per_step_s"] * 1e3)
            else:
                run.checkpoint_path(tag).unlink(missing_ok=True)  # killed between the two writes above
                logger.info("[%s] segment %d/%d already complete, skipped", tag, i + 1, len(segments))
            results[(regime, H)] = seg
            bar.update(key=(regime, H))
    metrics = _analyse(p, results, device)
    if p["figures"]:
        t0 = time.perf_counter()
        logger.info("drawing the figures (snapshots, energy balance, slope, scaling; seconds each)")
        metrics["figure_captions"] = _figures(p, results, metrics, run)
        logger.info("figures written in %.1f s", time.perf_counter() - t0)
    if (p["animate"] or p["figures"] == "all") and len(p["regimes"]) > 0:
        t0 = time.perf_counter()
        metrics["animation"] = _animation(p, results, run)
        logger.info("animation %s written in %.1f s", metrics["animation"]["file"], time.perf_counter() - t0)
    return metrics


def _analyse(p: Dict, results: Dict, device) -> Dict:
    sign = -1.0 if p["direction"] == "descent" else 1.0
    tavg: Dict = {}
    fits: Dict = {}
    resid: Dict = {}
    timing: Dict = {}
    summary: List[str] = []
    level = p["ci_level"]
    for regime in p["regimes"]:
        per_path, tavg[regime], resid[regime] = [], {}, {}
        for H in p["heads"]:
            seg = results[(regime, H)]
            t = seg["times"].numpy()
            g = time_average(t, seg["slope"].double().numpy(), p["t_avg"])  # (P,)
            dabs = time_average(t, seg["dissipation"].double().abs().numpy(), p["t_avg"])
            per_path.append(g)
            tavg[regime][str(H)] = {"mean": float(g.mean()), "std": float(g.std()), "per_path": g.tolist(),
                                    "abs_dissipation_over_slope": float(dabs.mean() / g.mean()) if g.mean() > 0
                                    else None}
            led = seg["ledger"]
            r = {}
            for key in ("residual", "residual_slope"):
                v = led[key].double()
                r[key] = {"final_mean": float(v[-1].mean()), "final_std": float(v[-1].std(unbiased=False)),
                          "max_abs": float(v.abs().max())}
            r["dE_final_mean"] = float(led["dE"][-1].double().mean())
            resid[regime][str(H)] = r
            timing[f"{regime}_H{H}"] = seg["timing"]
        fits[regime] = power_law_intervals(p["heads"], per_path, level=level, resamples=p["bootstrap"],
                                           seed=p["seed"])
        f = fits[regime]
        fits[regime]["ci_method"] = (
            f"b_ci: percentile bootstrap over the Monte-Carlo paths ({p['bootstrap']} resamples, paths resampled "
            f"independently at each H); b_ci_paths: mean of per-path fits ± Student-t, level {level}")
        name = "OU" if regime == "ou" else f"oscillating ({p['phase']} phase)"
        if f["b"] is None:
            summary.append(f"{name}: no fit (needs two or more head counts)")
        else:
            line = f"{name}: time-averaged 𝒢² (t >= {p['t_avg']:g}) ≈ a·H^b with a = {f['a']:.4g}, b = {f['b']:.4f}"
            if f["b_ci"] is not None:
                line += f", {100 * level:g}% CI [{f['b_ci'][0]:.4f}, {f['b_ci'][1]:.4f}] (bootstrap over paths)"
            if f["b_ci_paths"] is not None:
                line += f"; per-path fits {f['b_paths_mean']:.4f} [{f['b_ci_paths'][0]:.4f}, {f['b_ci_paths'][1]:.4f}]"
            if f["b_ci"] is None and f["b_ci_paths"] is None:
                se = f" (OLS s.e. {f['b_se']:.3g})" if f["b_se"] is not None else ""
                line += f", single path: no interval over paths{se}"
            summary.append(line)
        for H in p["heads"]:
            r = resid[regime][str(H)]
            one = results[(regime, H)]["paths"] == 1  # a deterministic run: no spread over paths to quote

            def spread(key):
                return " (one path: no spread)" if one else f" ± {r[key]['final_std']:.2e}"

            summary.append(
                f"  {regime} H={H}: mean 𝒢² = {tavg[regime][str(H)]['mean']:.4g}; residual at T: "
                f"𝒟-based {r['residual']['final_mean']:.3e}{spread('residual')}, "
                f"𝒢²-based {r['residual_slope']['final_mean']:.3e}{spread('residual_slope')}")
    metrics = {
        "fit": fits,
        "time_average_slope": tavg,
        "residuals": resid,
        "timing": timing,
        "device": str(device),
        "direction": p["direction"],
        "sign": sign,
        "seeds": {"tokens": p["seed"], "heads": {str(H): p["seed"] + H for H in p["heads"]},
                  "ou_noise": {str(H): p["noise_seed"] + H for H in p["heads"]} if "ou" in p["regimes"] else {},
                  "bootstrap": p["seed"]},
        "summary": summary,
    }
    for regime in p["regimes"]:
        f = fits[regime]
        metrics[f"b_{regime}"] = f["b"]
        metrics[f"a_{regime}"] = f["a"]
        if f["b_ci"] is not None:
            metrics[f"b_{regime}_ci_low"], metrics[f"b_{regime}_ci_high"] = f["b_ci"]
    return metrics


def _figures(p: Dict, results: Dict, metrics: Dict, run) -> Dict[str, str]:
    """Write the six figures; returns {figure name: caption} (also drawn under each figure)."""
    regimes, heads = p["regimes"], p["heads"]
    d = p["d"]
    dirn = p["direction"]
    space = sphere_name(d)
    phase = f", {p['phase']} phase" if "oscillating" in regimes else ""
    times = results[(regimes[0], heads[0])]["times"].numpy()
    label = plotting.REGIME_LABELS
    captions: Dict[str, str] = {}

    def save(fig, name):
        captions[name] = plotting.figure_caption(fig)
        run.save_figure(fig, name)

    def which(regime):
        P = results[(regime, heads[0])]["paths"]
        return f"Monte-Carlo path 0 of {P}" if regime == "ou" else "the deterministic run, one path"

    columns = 5
    shown = times[plotting.snapshot_indices(times, columns)]
    # snapshots: one figure per regime (rows H), and the comparison at the largest H
    for regime in regimes:
        rows = [(f"H = {H}", results[(regime, H)]["x"][:, 0]) for H in heads]
        cap = (f"{label[regime]} heads, rows: H = {', '.join(map(str, heads))}; tokens of {which(regime)}. "
               + plotting.snapshot_caption(d, shown) + " Same x(0) in every row.")
        fig = plotting.sphere_snapshots(rows, times, columns, colors=plotting.head_colors(len(heads)),
                                        title=f"{space}, {label[regime]} heads: tokens ({dirn})", caption=cap)
        save(fig, f"snapshots_{regime}")
    if len(regimes) > 1:
        Hm = max(heads)
        rows = [(f"{label[r]}, H = {Hm}", results[(r, Hm)]["x"][:, 0]) for r in regimes]
        cap = ("Rows: " + "; ".join(f"{label[r]} heads ({which(r)})" for r in regimes) + f", H = {Hm}. "
               + plotting.snapshot_caption(d, shown))
        fig = plotting.sphere_snapshots(rows, times, columns, colors=[plotting.REGIME_COLORS[r] for r in regimes],
                                        title=f"{space}: OU vs oscillating heads{phase}, H = {Hm} ({dirn})",
                                        caption=cap)
        save(fig, "snapshots_comparison")
    # energy balance: one panel per (regime, H); the panel titles say mean ± std of P paths / one path
    panels = [(f"{label[r]}, H = {H}", results[(r, H)]["ledger"]) for r in regimes for H in heads]
    fig = plotting.energy_balance(panels, times, sign=metrics["sign"], ncols=len(heads),
                                  title=f"{space}: energy balance ({dirn}{phase})")
    save(fig, "energy_balance")
    # 𝒢²(t) for every H
    fig = plotting.slope_series([(label[r], {H: results[(r, H)]["slope"] for H in heads}) for r in regimes], times,
                                t_avg=p["t_avg"], title=f"{space}: metric slope $\\mathscr{{G}}^2(t)$ ({dirn}{phase})")
    save(fig, "slope")
    # time-averaged 𝒢² vs H with the fit
    entries = [{"label": label[r], "color": plotting.REGIME_COLORS[r], "heads": heads,
                "per_path": [metrics["time_average_slope"][r][str(H)]["per_path"] for H in heads],
                "fit": metrics["fit"][r]} for r in regimes]
    fig = plotting.slope_scaling(entries, t_avg=p["t_avg"],
                                 title=f"{space}: time-averaged $\\mathscr{{G}}^2$ vs H ({dirn}{phase})")
    save(fig, "scaling")
    return captions


def _animation(p: Dict, results: Dict, run) -> Dict:
    """figures/tokens.gif: the regimes side by side at the largest H (OU path 0); returns its description."""
    from ..animation import animate_tokens

    Hm = max(p["heads"])
    trajs = [(results[(r, Hm)]["times"], results[(r, Hm)]["x"][:, 0]) for r in p["regimes"]]
    titles = [("OU heads, path 0" if r == "ou" else f"oscillating heads ({p['phase']} phase)") for r in p["regimes"]]
    path = run.path / "figures" / "tokens.gif"
    animate_tokens(trajs, titles, path, frames=p["animation_frames"], overwrite=True,
                   suptitle=f"{sphere_name(p['d'])}, H = {Hm}, n = {p['n']} ({p['direction']}): "
                            "colours = initial group")
    from PIL import Image

    with Image.open(path) as im:
        frames = int(getattr(im, "n_frames", 1))
    return {"file": "figures/tokens.gif", "frames": frames, "bytes": path.stat().st_size,
            "caption": f"Token flows at H = {Hm}, " + " vs ".join(titles) + ", at evenly spaced recorded times; "
                       "tokens coloured by their initial vertex ±e_k (at most 150 drawn)."}
