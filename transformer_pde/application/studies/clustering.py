"""Clustering studies: (β × t) phase diagrams from ensembles, and long-horizon metastability.

Kind ``phase_diagram``.  An ensemble of B independent systems per inverse temperature β, all in
one batched tensor (tokens (nβ, B, n, d)):

    tokens  x_i(0) i.i.d. uniform on S^{d-1}, member b's draw shared by every β (seed)
    heads   A_h(0) = I (``init_heads = "identity"``, all heads equal) or a random law of
            :mod:`transformer_pde.analysis.ensembles` (tied values V = A), H heads, ω_h = 1/H
    regimes "constant"     A_h(t) = A_h(0)
            "ou"           dA = κ(I − A)dt + σ dW_sym (σ² = ``ou_sigma2``), noise per member (the same
                           noise for every β: common random numbers across the β rows)
            "oscillating"  dA = (F(t) − A)dt, the reference target F (docs/model.md#processes), ``phase`` shared | per_head
    flow    ẋ_i = s V[μ, Θ_t](x_i), softmax, direction "ascent" by default (tokens cluster for A ≻ 0;
            the paper's reproductions use "descent")

Recorded: the cluster statistics of :mod:`transformer_pde.analysis.clustering` at chordal radius r
(pair fraction P_ε with ε = r²/2, single-linkage count, mean overlap γ̄, largest-cluster mass).
The maps show, over (β, t), the ensemble mean of P_ε and the ensemble median of the cluster count.
Clustering time of a member: the first time its mean overlap γ̄(t) reaches ``target`` (linear
interpolation between records).  Literature values marked and compared: the equiangular reduced
ODE of Pendharkar (2026) for one scalar head A = I (``th.hitting_time``, γ0 = the ensemble's median
γ̄(0), clamped at 0) and its linearisation (``th.linearized_clustering_time``), both exact for
equiangular tokens and constant identity heads (H equal heads with ω = 1/H act as one head);
Pendharkar's critical β*(H) of radial dominance (``th.critical_beta``, H ≥ 2, equal heads αI, α = 1).

On S¹ with identity heads the metastability study also checks Bruno–Pasqualotto–Agazzi's
metastable clusters: the count is the fastest Fourier mode ℓ* = argmax_ℓ ℓ² I_ℓ(β)/I_0(β) of the
T = 0 linearisation (3 at β = 5, 4 at β = 7) and the clusters sit at (φ + 2πk)/ℓ*, φ the phase of
the initial empirical ℓ*-th Fourier coefficient (``metrics["mode_theory"]``).

Kind ``metastability``.  Long horizon, low dimension, large β (Geshkovski et al.'s metastable
multi-cluster states): constant, OU and oscillating heads; the energy at the reference heads
E_ref(t) = (1/2β) ∫∫ e^{β⟨x, y⟩} dμ_t dμ_t (heads A = I: a function of the tokens alone, so that
the three regimes are comparable; for constant identity heads it is the flow's energy) and the
single-linkage cluster count, with the plateaus of both staircases detected by
:func:`transformer_pde.analysis.clustering.detect_plateaus` (thresholds in its docstring).

Each regime is a segment: simulated, checkpointed every ``checkpoint_every`` steps, written to
``data/<regime>.pt`` and ``series/<regime>.csv``; ``--resume`` skips finished segments.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Dict

import numpy as np
import torch

import transformer_pde as tp
import transformer_pde.analysis.theory as th

from . import (
    DEVICE, DTYPE, Option, at_least, check_device, check_record_every, check_whole_steps, device_of, fingerprint,
    load_segment, nonnegative, open_unit, panel, positive, save_captioned, segment_bar, step_callback, study,
    subplots, unique_nonempty, weight_process, dtype_of)

__all__ = ["PHASE_OPTIONS", "META_OPTIONS", "run_phase_diagram", "run_metastability"]

log = logging.getLogger(__name__)

REGIMES = ("constant", "ou", "oscillating")
COLORS = {"constant": "#2c3e50", "ou": "#27ae60", "oscillating": "#c0392b"}
LABELS = {"constant": "constant", "ou": "OU", "oscillating": "oscillating"}
STATS = ("pair_fraction", "clusters", "mean_overlap", "largest_mass")


def _betas(v):
    if len(v) == 0:
        return "must list at least one β, e.g. [1.0, 2.0, 4.0]"
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in v):
        return "must be a list of numbers > 0"
    if sorted(v) != list(v) or len(set(v)) != len(v):
        return "must be strictly increasing"
    return None


def _radius(v):
    return None if 0 < v <= 2 else "is a chordal distance in (0, 2]"


_COMMON = {
    "regimes": Option(["constant", "ou", "oscillating"], (list,), "head processes, side by side", choices=REGIMES,
                      check=unique_nonempty),
    "heads": Option(1, (int,), "number of heads H (ω_h = 1/H)", check=positive),
    "n": Option(16, (int,), "tokens per system", check=at_least(2)),
    "d": Option(8, (int,), "ambient dimension: tokens on S^{d-1}", check=at_least(2)),
    "systems": Option(64, (int,), "ensemble size B per β", check=positive),
    "init_heads": Option("identity", (str,), "A_h(0): I, or a random law (tied values)",
                         choices=("identity", "goe", "wigner", "gaussian")),
    "head_scale": Option(1.0, (float,), "σ of the random head law", check=positive),
    "ou_rate": Option(1.0, (float,), "OU mean-reversion rate κ (mean I)", check=positive),
    "ou_sigma2": Option(2.0, (float,), "OU noise variance σ² (the paper: 2)", check=nonnegative),
    "phase": Option("shared", (str,), "oscillating target: one F(t) for all heads, or F(t + 2πh/H)",
                    choices=("shared", "per_head")),
    "direction": Option("ascent", (str,), "token flow direction (ascent: clustering for A ≻ 0)",
                        choices=("ascent", "descent")),
    "radius": Option(0.1, (float,), "chordal linkage radius r (pair threshold ε = r²/2)", check=_radius),
    "pair_eps": Option(0.0, (float,), "pair threshold ε of the pair fraction (overlap > 1 − ε); 0: ε = r²/2 "
                       "(rotf: 1e-3)", check=lambda v: None if 0 <= v <= 2 else "must be in [0, 2]"),
    "count_eps": Option(0.0, (float,), "threshold of the cluster counts (overlap > 1 − ε); 0: ε = r²/2 "
                        "(rotf: 1e-4)", check=lambda v: None if 0 <= v <= 2 else "must be in [0, 2]"),
    "count": Option("single_linkage", (str,), "cluster count shown in the maps: single linkage, or the rank of the "
                    "thresholded Gram matrix (rotf's matrix_rank; both are recorded when 'gram_rank')",
                    choices=("single_linkage", "gram_rank")),
    "layer_norm": Option("none", (str,), "layer map: none (projected flow) | post (rotf/simuformer) | pre | peri | "
                         "ngpt (docs/layer_norms.md)", choices=("none", "post", "pre", "peri", "ngpt")),
    "seed": Option(0, (int,), "tokens from seed, random heads from seed + 1, OU noise from seed + 2"),
    "dt": Option(0.05, (float,), "time step (t1/dt must be a whole number)", check=positive),
    "record_every": Option(4, (int,), "record every k-th step", check=positive),
    "dtype": DTYPE,
    "device": DEVICE,
    "checkpoint_every": Option(200, (int,), "steps between atomic checkpoints of a segment", check=positive),
    "figures": Option(True, (bool,), "draw the figures (PNG + PDF)"),
}

PHASE_OPTIONS = {
    **_COMMON,
    "betas": Option([0.5, 1.0, 2.0, 4.0, 8.0], (list,), "inverse temperatures β (rows of the maps)", check=_betas),
    "t1": Option(30.0, (float,), "final time", check=positive),
    "target": Option(0.9, (float,), "clustering time: first time the mean overlap reaches this", check=open_unit),
}

META_OPTIONS = {
    **_COMMON,
    "n": Option(32, (int,), "tokens per system", check=at_least(2)),
    "d": Option(2, (int,), "ambient dimension (low: metastable multi-cluster states)", check=at_least(2)),
    "systems": Option(8, (int,), "ensemble size B", check=positive),
    "beta": Option(16.0, (float,), "inverse temperature β (large: long-lived plateaus)", check=positive),
    "t1": Option(200.0, (float,), "final time (long horizon)", check=positive),
    "dt": Option(0.1, (float,), "time step (t1/dt must be a whole number)", check=positive),
    "record_every": Option(5, (int,), "record every k-th step", check=positive),
    "slope_tol": Option(0.05, (float,), "plateau threshold: flat where |dy/dt| <= slope_tol · (range of y)/(horizon)",
                        check=nonnegative),
    "min_duration": Option(0.02, (float,), "shortest plateau, as a fraction of t1", check=open_unit),
}


def _check(p: Dict) -> None:
    check_whole_steps(p)
    check_record_every(p, what="the clustering statistics over time")
    check_device(p)


#: options added with the layer norms: they enter a segment's fingerprint only away from their default,
#: so that segments of earlier runs still resume
_LATER_DEFAULTS = {"pair_eps": 0.0, "count_eps": 0.0, "count": "single_linkage", "layer_norm": "none"}


def _seg_fingerprint(p: Dict, kind: str, regime: str) -> str:
    q = {k: v for k, v in p.items() if k not in _LATER_DEFAULTS or v != _LATER_DEFAULTS[k]}
    return fingerprint(q, _NOT_IN_SEGMENT, kind=kind, regime=regime)


def _stat_keys(p: Dict):
    return STATS + (("gram_rank",) if p.get("count") == "gram_rank" else ())


def _observables(p: Dict):
    """The recorded statistics: pair fraction at pair_eps (or r²/2), the counts at count_eps (or r²/2)."""
    pair = {"eps": p["pair_eps"]} if p.get("pair_eps", 0.0) > 0 else {"radius": p["radius"]}
    count = p.get("count_eps", 0.0) or None
    return tp.clustering.statistics_observables(**pair, keys=_stat_keys(p), stacked=True, count_eps=count)


# parameters that do not change a segment (analysis and output only)
_NOT_IN_SEGMENT = ("figures", "checkpoint_every", "slope_tol", "min_duration", "target")


def _initial(p: Dict, betas, *, dtype, device):
    """x0 (nβ, B, n, d) and heads0 with score (B, H, d, d), β (nβ, B)."""
    B, H, d = p["systems"], p["heads"], p["d"]
    x0 = tp.ensembles.random_tokens(B, p["n"], d, generator=torch.Generator().manual_seed(p["seed"]),
                                    dtype=torch.float64).to(dtype=dtype, device=device)
    if p["init_heads"] == "identity":
        A = torch.eye(d, dtype=dtype, device=device).expand(B, H, d, d).clone()
    else:
        A = tp.ensembles.random_matrices((B, H), d, law=p["init_heads"], scale=p["head_scale"],
                                         generator=torch.Generator().manual_seed(p["seed"] + 1),
                                         dtype=torch.float64).to(dtype=dtype, device=device)
        if p["init_heads"] == "gaussian":
            A = 0.5 * (A + A.transpose(-1, -2))  # symmetric heads: the flow stays a gradient flow
    nb = len(betas)
    beta = torch.as_tensor(betas, dtype=dtype, device=device)[:, None].expand(nb, B).contiguous()
    heads0 = tp.Heads(A, None, None, beta).assume_symmetric()
    return x0.expand(nb, *x0.shape), heads0


def _run_segment(kind: str, p: Dict, regime: str, betas, run, tag: str, *, dtype, device) -> Dict:
    x0, heads0 = _initial(p, betas, dtype=dtype, device=device)
    theta = weight_process(regime, heads0, rate=p["ou_rate"], sigma=math.sqrt(p["ou_sigma2"]), phase=p["phase"])
    t0 = time.perf_counter()
    model = tp.Model(theta, normalization="softmax", direction=p["direction"], layer_norm=p.get("layer_norm", "none"))
    traj = tp.solve(model, x0, tp.Euler(), t1=p["t1"], dt=p["dt"], seed=p["seed"] + 2,
                    saveat=tp.SaveAt(record_every=p["record_every"], observables=_observables(p)),
                    ledger=tp.LedgerOptions(diagnostics=False),
                    checkpoint=tp.Checkpointing(run.checkpoint_path(tag), p["checkpoint_every"]),
                    progress=tp.Progress(show=run.progress, callback=step_callback(run, tag)))
    wall = time.perf_counter() - t0
    x = traj.x.detach()
    st = traj.observables["cluster_statistics"].detach().cpu()  # (T, nβ, B, k), the statistics in order
    seg = {"kind": f"transformer_pde.{kind}.segment",
           "fingerprint": _seg_fingerprint(p, kind, regime),
           "regime": regime, "times": traj.times.detach().cpu(),
           **{k: (st[..., i].round().long() if k in ("clusters", "gram_rank") else st[..., i].clone())
              for i, k in enumerate(_stat_keys(p))},
           "timing": {"wall_time_s": wall, "steps": int(traj.stats["steps"]),
                      "systems_per_call": int(np.prod(x0.shape[:-2]))}}
    if kind == "metastability":
        ref = tp.Heads(torch.eye(p["d"], dtype=dtype, device=device).unsqueeze(0), None, None, float(betas[0]))
        seg["energy_ref"] = tp.energy(x, ref).detach().cpu()  # (T, 1, B)
        seg["x"] = x[:, 0, :min(4, p["systems"])].cpu().clone()  # a few members' trajectories
    return seg


def _segments(kind: str, params: Dict, betas, run):
    """The checked parameters and every regime's segment (data/<regime>.pt: loaded when finished, else run)."""
    p = dict(params)
    _check(p)
    dtype = dtype_of(p)
    device = device_of(p)
    out = {}
    with segment_bar(run, len(p["regimes"]), kind, "regime") as bar:
        for regime in p["regimes"]:
            seg = load_segment(run, regime, kind, _seg_fingerprint(p, kind, regime))
            if seg is None:
                log.info("[%s] %s: %d systems x %d steps", kind, regime, len(betas) * p["systems"],
                         round(p["t1"] / p["dt"]))
                seg = _run_segment(kind, p, regime, betas, run, regime, dtype=dtype, device=device)
                run.save_tensors(regime, seg)
                log.info("[%s] %s done in %.1f s", kind, regime, seg["timing"]["wall_time_s"])
            else:
                log.info("[%s] %s already complete, skipped", kind, regime)
            run.checkpoint_path(regime).unlink(missing_ok=True)
            out[regime] = seg
            bar.update(1)
    return p, out


def _q(v, q):
    """Quantile q of clustering times (inf = never reached) without interpolating across inf."""
    v = np.sort(np.asarray(v, dtype=float).reshape(-1))
    if v.size == 0:
        return math.nan
    return float(v[min(v.size - 1, int(math.floor(q * (v.size - 1) + 0.5)))])


# ---------------------------------------------------------------------------- phase diagram
@study("phase_diagram", PHASE_OPTIONS,
       "(β × t) maps of the pair fraction and the median cluster count over an ensemble; constant vs OU vs "
       "oscillating heads; clustering time vs β against the reduced-ODE theory", validate=_check)
def run_phase_diagram(params: Dict, run) -> Dict:
    betas = [float(b) for b in params["betas"]]
    p, segs = _segments("phase_diagram", params, betas, run)
    n, H = p["n"], p["heads"]
    metrics: Dict = {"regimes": {}, "betas": betas, "target": p["target"], "radius": p["radius"],
                     "eps": p["pair_eps"] or 0.5 * p["radius"] ** 2,
                     "count_eps": p["count_eps"] or 0.5 * p["radius"] ** 2, "count": p["count"],
                     "layer_norm": p["layer_norm"], "direction": p["direction"], "systems": p["systems"]}
    times = segs[p["regimes"][0]]["times"]
    gamma0 = float(segs[p["regimes"][0]]["mean_overlap"][0].double().median())
    g0 = max(gamma0, 0.0)
    kw = dict(n=n, gamma0=g0, target=p["target"])  # the times are 0 when γ̄(0) is already past the target
    theory = {"gamma0": gamma0,
              "hitting_time": [th.hitting_time([1.0], beta=b, **kw) if p["target"] > g0 else 0.0 for b in betas],
              "linearized": [th.linearized_clustering_time([1.0], beta=b, **kw) if p["target"] > g0 else 0.0
                             for b in betas],
              "beta_star": th.critical_beta(H, n, 1.0) if H >= 2 else math.inf}
    metrics["theory"] = theory
    summary = []
    for regime, seg in segs.items():
        T_clu = tp.clustering.crossing_time(times, seg["mean_overlap"].double().movedim(0, -1), p["target"])  # (nβ, B)
        T_pair = tp.clustering.crossing_time(times, seg["pair_fraction"].double().movedim(0, -1), 0.5)
        T_one = tp.clustering.crossing_time(times, -seg["clusters"].double().movedim(0, -1), -1.0)
        rows = []
        for i, b in enumerate(betas):
            r = {"beta": b,
                 "clustering_time_median": _q(T_clu[i], 0.5), "clustering_time_q25": _q(T_clu[i], 0.25),
                 "clustering_time_q75": _q(T_clu[i], 0.75),
                 "fraction_clustered": float(torch.isfinite(T_clu[i]).double().mean()),
                 "pair_half_time_median": _q(T_pair[i], 0.5), "one_cluster_time_median": _q(T_one[i], 0.5),
                 "final_pair_fraction_mean": float(seg["pair_fraction"][-1, i].double().mean()),
                 "final_clusters_median": float(seg["clusters"][-1, i].double().median())}
            if "gram_rank" in seg:
                r["final_gram_rank_median"] = float(seg["gram_rank"][-1, i].double().median())
            if regime == "constant" and p["init_heads"] == "identity":
                tt = theory["hitting_time"][i]
                r["theory_hitting_time"] = tt
                r["ratio_to_theory"] = r["clustering_time_median"] / tt if tt > 0 else None
            rows.append(r)
        metrics["regimes"][regime] = {"per_beta": rows, "timing": seg["timing"]}
        run.save_series(regime, _phase_columns(times, seg, betas))
        summary.append(f"{LABELS[regime]}: median clustering time (γ̄ ≥ {p['target']:g}) vs β = "
                       + ", ".join(f"{r['beta']:g}: {r['clustering_time_median']:.3g}" for r in rows))
    summary.append("theory (equiangular reduced ODE, A = I): " + ", ".join(
        f"{b:g}: {t:.3g}" for b, t in zip(betas, theory["hitting_time"])))
    metrics["summary"] = summary
    if p["figures"]:
        _phase_figures(p, segs, metrics, run)
    return metrics


def _phase_columns(times, seg, betas):
    cols = {"t": times}
    for i, b in enumerate(betas):
        cols[f"pair_fraction_mean_beta{b:g}"] = seg["pair_fraction"][:, i].double().mean(-1)
        cols[f"clusters_median_beta{b:g}"] = seg["clusters"][:, i].double().median(-1).values
        cols[f"mean_overlap_mean_beta{b:g}"] = seg["mean_overlap"][:, i].double().mean(-1)
        cols[f"largest_mass_mean_beta{b:g}"] = seg["largest_mass"][:, i].double().mean(-1)
        if "gram_rank" in seg:
            cols[f"gram_rank_median_beta{b:g}"] = seg["gram_rank"][:, i].double().median(-1).values
    return cols


def _phase_figures(p, segs, metrics, run) -> None:
    """The phase diagram and the clustering time against β; their captions go to metrics["figure_captions"]."""
    betas = metrics["betas"]
    regimes = list(segs)
    times = segs[regimes[0]]["times"].numpy()
    R = len(regimes)
    theory = metrics["theory"]
    bstar = theory["beta_star"]
    tt = np.array(theory["hitting_time"], dtype=float)
    space = f"$S^{{{p['d'] - 1}}}$"
    fig, axes = subplots(2, R, (4.2 * R + 1.2, 6.4), squeeze=False, sharex=True, sharey=True)
    extent = [times[0], times[-1], -0.5, len(betas) - 0.5]
    for j, regime in enumerate(regimes):
        seg = segs[regime]
        pf = seg["pair_fraction"].double().mean(-1).numpy().T  # (nβ, T)
        rank = p.get("count") == "gram_rank"
        cl = seg["gram_rank" if rank else "clusters"].double().median(-1).values.numpy().T
        for row, (img, cmap, vmin, vmax, name) in enumerate(
                [(pf, "viridis", 0, 1, r"mean pair fraction $P_\varepsilon$"),
                 (cl, "magma_r", 1, p["n"], "median Gram-rank count" if rank else "median cluster count")]):
            ax = axes[row, j]
            im = ax.imshow(img, origin="lower", aspect="auto", extent=extent, cmap=cmap, vmin=vmin, vmax=vmax,
                           interpolation="nearest")
            if regime == "constant" and p["init_heads"] == "identity":
                ok = np.isfinite(tt) & (tt <= times[-1])
                ax.plot(tt[ok], np.arange(len(betas))[ok], "w^", ms=6, mec="k", label="theory: reduced-ODE time")
                ax.legend(fontsize=7, loc="upper right")
            if math.isfinite(bstar) and betas[0] <= bstar <= betas[-1]:
                yb = float(np.interp(bstar, betas, np.arange(len(betas))))
                ax.axhline(yb, color="w", ls="--", lw=1)
                ax.text(times[-1], yb, r" $\beta^*$", color="w", va="bottom", ha="right", fontsize=8)
            ax.set_yticks(range(len(betas)))
            ax.set_yticklabels([f"{b:g}" for b in betas])
            panel(ax, "time t" if row == 1 else None, r"inverse temperature $\beta$" if j == 0 else None,
                  f"{LABELS[regime]} heads: {name}", title_size=9)
            if j == R - 1:  # one colour bar per row (same scale in every column)
                fig.colorbar(im, ax=list(axes[row]), label=name, shrink=0.9, pad=0.02)
    fig.suptitle(f"{space}: clustering phase diagram, n = {p['n']}, H = {p['heads']}, B = {p['systems']} systems "
                 f"per β ({p['direction']})", fontsize=10)
    cap = (f"Colour: ensemble mean over B = {p['systems']} systems of the fraction of token pairs with overlap > 1 − ε "
           f"(ε = r²/2, r = {p['radius']:g}) (top) and ensemble median of the single-linkage cluster count at chordal "
           f"radius r (bottom); triangles: clustering time of the equiangular reduced ODE (Pendharkar), A = I; "
           + ("dashed line: critical β* (radial dominance)." if math.isfinite(bstar) else "β* is infinite for H = 1."))
    save_captioned(run, fig, "phase_diagram", cap, metrics)
    # clustering time vs β
    fig, ax = subplots(1, 1, (6.4, 4.2))
    for k, regime in enumerate(regimes):
        rows = metrics["regimes"][regime]["per_beta"]
        med, lo, hi = (np.array([r[f"clustering_time_{q}"] for r in rows], dtype=float)
                       for q in ("median", "q25", "q75"))
        x = np.array(betas) * (1 + 0.03 * (k - 1))
        ok = np.isfinite(med)
        hi = np.where(np.isfinite(hi), hi, med)
        yerr = np.vstack([med[ok] - lo[ok], hi[ok] - med[ok]])
        ax.errorbar(x[ok], med[ok], yerr=yerr, fmt="o-", color=COLORS[regime], capsize=3,
                    label=f"{LABELS[regime]} heads (median, IQR)")
        if (~ok).any():
            ax.plot(x[~ok], np.full((~ok).sum(), times[-1]), "v", color=COLORS[regime], ms=7)
    tl = np.array(theory["linearized"], dtype=float)
    ax.plot(betas, tt, "k--", label="theory: reduced ODE (A = I)")
    ax.plot(betas, tl, "k:", label="theory: linearised")
    ax.axhline(times[-1], color="0.6", lw=0.8)
    if math.isfinite(bstar):
        ax.axvline(bstar, color="0.3", ls="-.", lw=1, label=r"$\beta^*$ (radial dominance)")
    ax.set_yscale("log")
    ax.set_ylim(top=max(times[-1] * 2, np.nanmax(np.where(np.isfinite(tt), tt, 0)) * 1.2))
    panel(ax, r"inverse temperature $\beta$", rf"clustering time: $\bar\gamma(t) \geq {p['target']:g}$",
          f"clustering time vs β (n = {p['n']}, d = {p['d']}, H = {p['heads']}, {p['direction']})", title_size=9,
          legend=dict(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5)))
    cap = (f"Markers: median over B = {p['systems']} systems of the first time the mean overlap reaches "
           f"{p['target']:g}; bars: interquartile range; down-triangles at the grey line: the median member did not "
           f"cluster by t1 = {p['t1']:g}; dashed/dotted: Pendharkar's equiangular reduced ODE and its linearisation "
           f"from γ0 = {theory['gamma0']:.3f}.")
    save_captioned(run, fig, "clustering_time", cap, metrics)


# ---------------------------------------------------------------------------- metastability
@study("metastability", META_OPTIONS,
       "long-horizon metastability: energy and cluster-count staircases with detected plateaus, constant vs OU vs "
       "oscillating heads", validate=_check)
def run_metastability(params: Dict, run) -> Dict:
    p, segs = _segments("metastability", params, [params["beta"]], run)
    metrics: Dict = {"regimes": {}, "beta": p["beta"], "radius": p["radius"], "slope_tol": p["slope_tol"],
                     "min_duration": p["min_duration"] * p["t1"], "direction": p["direction"]}
    summary = []
    for regime, seg in segs.items():
        t = seg["times"]
        E = seg["energy_ref"][:, 0].double().T  # (B, T)
        C = seg["clusters"][:, 0].double().T
        sE = tp.clustering.detect_plateaus(t, E, slope_tol=p["slope_tol"], min_duration=p["min_duration"] * p["t1"])
        sC = tp.clustering.detect_plateaus(t, C, slope_tol=p["slope_tol"], min_duration=p["min_duration"] * p["t1"])
        durC = sC.duration[sC.valid].numpy()
        m = {"energy_plateaus_median": float(sE.count.double().median()),
             "cluster_plateaus_median": float(sC.count.double().median()),
             "cluster_plateau_duration_median": float(np.median(durC)) if durC.size else None,
             "cluster_plateau_duration_max": float(durC.max()) if durC.size else None,
             "final_clusters_median": float(seg["clusters"][-1, 0].double().median()),
             "initial_clusters_median": float(seg["clusters"][0, 0].double().median()),
             "member0": {"energy": sE.as_rows(0), "clusters": sC.as_rows(0)},
             "timing": seg["timing"]}
        metrics["regimes"][regime] = m
        cols = {"t": t, "energy_ref_mean": E.mean(0), "clusters_median": C.median(0).values,
                "energy_ref_member0": E[0], "clusters_member0": C[0],
                "pair_fraction_mean": seg["pair_fraction"][:, 0].double().mean(-1)}
        run.save_series(regime, cols)
        seg["_stairs"] = (sE, sC)
        summary.append(f"{LABELS[regime]}: clusters {m['initial_clusters_median']:g} -> {m['final_clusters_median']:g} "
                       f"(median); plateaus per member (median): energy {m['energy_plateaus_median']:g}, "
                       f"cluster count {m['cluster_plateaus_median']:g}; longest cluster plateau "
                       f"{m['cluster_plateau_duration_max']}")
    if p["d"] == 2 and p["init_heads"] == "identity" and "constant" in segs:
        metrics["mode_theory"] = _s1_mode_check(p, segs["constant"])
        mt = metrics["mode_theory"]
        summary.append(f"S¹ mode theory (T = 0, Funk–Hecke): fastest mode ℓ* = {mt['predicted_clusters']} at "
                       f"β = {p['beta']:g}; clusters formed (stored members) {mt['formed_clusters']}, at t1 (median "
                       f"over members) {mt['final_clusters_median']:g}; distance of a formed cluster from the predicted "
                       f"positions (Fourier phase at t0): median {mt['position_error_median']:.3g}, max "
                       f"{mt['position_error_max']:.3g} rad")
    metrics["summary"] = summary
    if p["figures"]:
        _meta_figures(p, segs, metrics, run)
    for seg in segs.values():
        seg.pop("_stairs", None)
    return metrics


def s1_mode_rates(beta: float, ell_max: int) -> np.ndarray:
    """Growth rates r_ℓ = ℓ² I_ℓ(β)/(β I_0(β)), ℓ = 0 … ell_max, of the Fourier modes of a perturbation of
    the uniform measure on S¹ under one softmax head A = V = I, ascent, no noise (the Funk–Hecke
    coefficient of e^{β cos} on the circle is I_ℓ(β)); computed here for S¹ only (the general
    spherical-harmonic version belongs to the noisy-tokens theory)."""
    from scipy.special import ive

    ell = np.arange(ell_max + 1)
    return ell ** 2 * ive(ell, beta) / (beta * ive(0, beta))


def _s1_mode_check(p, seg) -> Dict:
    """Bruno–Pasqualotto–Agazzi's metastable clusters on S¹: the number ℓ* = argmax_ℓ r_ℓ of clusters a
    near-uniform start forms, and their positions θ_k = (φ + 2πk)/ℓ* from the phase φ of the ℓ*-th
    empirical Fourier coefficient Σ_j e^{iℓ*θ_j(0)}, against the stored members at their formation time:
    the first record at which every single-linkage cluster is tight (geodesic spread below the linkage
    radius) and those holding ≥ 5 % of the tokens hold ≥ 95 % of them together (the clusters then drift
    and merge on the slow metastable time scale)."""
    rates = s1_mode_rates(p["beta"], max(16, int(4 * math.sqrt(p["beta"] + 1)) + 8))
    ell = int(np.argmax(rates[1:])) + 1
    x = seg["x"].double()  # (T, members, n, 2)
    times = seg["times"].double()
    n = x.shape[-2]
    formed, errs, t_form = [], [], []
    for b in range(x.shape[1]):
        th0 = torch.atan2(x[0, b, :, 1], x[0, b, :, 0])
        phi = float(torch.angle(torch.exp(1j * ell * th0.to(torch.complex128)).sum()))
        pred = (phi + 2 * math.pi * np.arange(ell)) / ell
        for k in range(1, x.shape[0]):
            labels = tp.clustering.cluster_labels(x[k, b], radius=p["radius"])
            sizes = torch.bincount(labels, minlength=n)
            big = (sizes >= 0.05 * n).nonzero().flatten()
            tight = float(tp.clustering.cluster_radius(x[k, b], radius=p["radius"])) < p["radius"]
            if (tight and sizes[big].sum() >= 0.95 * n) or k == x.shape[0] - 1:
                break
        formed.append(int(big.numel()))
        t_form.append(float(times[k]))
        for lab in big.tolist():
            c = x[k, b][labels == lab].mean(0)
            ang = math.atan2(float(c[1]), float(c[0]))
            errs.append(float(np.min(np.abs(np.angle(np.exp(1j * (ang - pred)))))))
    return {"predicted_clusters": ell, "rates": [float(r) for r in rates[:ell + 3]],
            "formed_clusters": formed, "formation_time": t_form,
            "final_clusters_median": float(seg["clusters"][-1, 0].double().median()),
            "final_clusters": [int(c) for c in seg["clusters"][-1, 0].tolist()],
            "position_error_median": float(np.median(errs)) if errs else math.nan,
            "position_error_max": float(max(errs)) if errs else math.nan, "members_checked": int(x.shape[1])}


def _meta_figures(p, segs, metrics, run) -> None:
    """The energy and cluster-count staircases; the caption goes to metrics["figure_captions"]."""
    regimes = list(segs)
    R = len(regimes)
    fig, axes = subplots(2, R, (4.6 * R, 5.6), squeeze=False, sharex=True)
    fig.subplots_adjust(wspace=0.45)
    for j, regime in enumerate(regimes):
        seg = segs[regime]
        t = seg["times"].numpy()
        sE, sC = seg["_stairs"]
        E = seg["energy_ref"][:, 0].double().numpy()  # (T, B)
        C = seg["clusters"][:, 0].double().numpy()
        for row, (Y, st, name) in enumerate([(E, sE, r"energy $\mathcal{E}_{ref}$ (A = I)"),
                                             (C, sC, "cluster count")]):
            ax = axes[row, j]
            for b in range(min(Y.shape[1], 4)):
                ax.plot(t, Y[:, b], lw=0.9, alpha=0.45 if b else 1.0, color=COLORS[regime] if b == 0 else "0.5")
            for s, e, lv in zip(st.start[0], st.end[0], st.level[0]):
                if np.isfinite(float(s)):
                    ax.hlines(float(lv), float(s), float(e), color="k", lw=2.2)
            panel(ax, "time t" if row == 1 else None, name, f"{LABELS[regime]} heads", title_size=9)
    fig.suptitle(f"$S^{{{p['d'] - 1}}}$: metastability, β = {p['beta']:g}, n = {p['n']}, H = {p['heads']} "
                 f"({p['direction']})", fontsize=10)
    cap = (f"Coloured line: member 0; grey: members 1–3; black bars: plateaus of member 0 detected where "
           f"|dy/dt| <= {p['slope_tol']:g} × (range of y)/t1 for at least {p['min_duration'] * p['t1']:g} time units, "
           f"at their time-averaged level; energy at the reference heads A = I; clusters: single linkage at chordal "
           f"radius {p['radius']:g}.")
    save_captioned(run, fig, "staircases", cap, metrics)
