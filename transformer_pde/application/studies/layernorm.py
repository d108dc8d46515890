"""Clustering rates under layer normalisation (kind ``layer_norm_rates``; docs/layer_norms.md).

Karagodin, Ge, Polyanskiy, Rigollet (2025, "Normalization in attention dynamics") write every
normalisation scheme as the attention direction times a per-token speed factor; near consensus
the speed fixes the rate at which the tokens collapse.  With value V = I the linearisation at a
single cluster gives, for the average cosine ρ(t) = Σ_{i≠j} ⟨x_i, x_j⟩ / (n(n − 1)),

    post-LN (speed 1):              1 − ρ(t) ~ e^{−2t}
    pre-LN  (speed 1/r, ṙ ≈ 1):     1 − ρ(t) ~ 1/t²      (the radius grows like t)

Setting.  B independent draws of the weights (one system each, batched): tokens i.i.d. uniform
on S^{d-1}, scores A_h = I + σ G_h with G_h a GOE matrix of variance 1/d (``head_scale`` σ),
values V_h = I, ω_h = 1/H, softmax, β, direction "ascent", each scheme's discrete layer map
(:func:`transformer_pde.simulate` with ``layer_norm=``) with step dt.  Recorded: ρ(t) per draw.
Reported: the median and the 90 % band (5 % and 95 % quantiles over the draws) of 1 − ρ(t), and
per draw the fitted late rate on the window where 1 − ρ lies in [``fit_low``, ``fit_high``]: the
slope of log(1 − ρ) against t (post-LN, "none", nGPT: an exponential rate, theory −2 for the
first two) and against log t (pre-LN, peri-LN: a power, theory −2 for pre-LN).
"""

from __future__ import annotations

import logging
import math
from typing import Dict

import numpy as np
import torch

import transformer_pde as tp

from . import (Option, at_least, cached, dtype_of, open_unit, panel, positive, save_captioned, sphere_name, study,
               subplots)

log = logging.getLogger(__name__)

SCHEMES = ("none", "post", "pre", "peri", "ngpt")
#: the late-time law of each scheme: ("exp", rate of 1 − ρ in t) or ("power", exponent in t); None: no theory
THEORY = {"none": ("exp", -2.0), "post": ("exp", -2.0), "pre": ("power", -2.0), "peri": ("power", None),
          "ngpt": ("exp", None)}


def _schemes(v):
    if not v or len(set(v)) != len(v):
        return "must list distinct schemes, e.g. ['post', 'pre']"
    return None


OPTIONS = {
    "schemes": Option(["post", "pre"], (list,), "layer-normalisation schemes side by side", choices=SCHEMES,
                      check=_schemes),
    "n": Option(32, (int,), "tokens per system", check=at_least(2)),
    "d": Option(8, (int,), "ambient dimension: tokens on S^{d-1}", check=at_least(2)),
    "heads": Option(1, (int,), "heads H (ω_h = 1/H)", check=positive),
    "draws": Option(64, (int,), "random weight draws B (the band is over them)", check=at_least(2)),
    "head_scale": Option(0.5, (float,), "σ of A_h = I + σ·GOE/√d", check=lambda v: None if v >= 0 else "must be >= 0"),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "t1": Option(20.0, (float,), "final time", check=positive),
    "dt": Option(0.05, (float,), "layer step (t1/dt must be a whole number)", check=positive),
    "record_every": Option(4, (int,), "record every k-th step", check=positive),
    "fit_low": Option(1e-10, (float,), "fit window: 1 − ρ >= fit_low", check=open_unit),
    "fit_high": Option(1e-2, (float,), "fit window: 1 − ρ <= fit_high", check=open_unit),
    "seed": Option(0, (int,), "tokens from seed, weights from seed + 1"),
    "figures": Option(True, (bool,), "draw the figure"),
}


def _validate(p):
    if not p["fit_low"] < p["fit_high"]:
        raise ValueError(f"fit_low = {p['fit_low']} must be below fit_high = {p['fit_high']}")
    floor = 1e3 * torch.finfo(dtype_of(p)).eps  # 1 − ρ is a difference of numbers near 1: rounding below this
    if p["fit_low"] < floor:
        raise ValueError(f"config key 'fit_low' = {p['fit_low']:g} is below what dtype = '{p['dtype']}' resolves in "
                         f"1 − ρ (≈ {floor:.1g}: a difference of numbers near 1); the fit window would hold rounding "
                         f"noise: take fit_low >= {floor:.1g}")
    steps = p["t1"] / p["dt"]
    if abs(steps - round(steps)) > 1e-9 * max(1.0, steps):
        raise ValueError(f"t1/dt = {steps} must be a whole number")


def _mean_cosine(x, w):
    """ρ = Σ_{i≠j} ⟨x_i, x_j⟩ / (n(n − 1)), (...,), computed as (|Σ x|² − n)/(n(n − 1))."""
    n = x.shape[-2]
    s = x.sum(-2)
    return ((s * s).sum(-1) - (x * x).sum((-1, -2))) / (n * (n - 1))


def _setup(p, dtype):
    B, H, d, n = p["draws"], p["heads"], p["d"], p["n"]
    x0 = tp.ensembles.random_tokens(B, n, d, generator=torch.Generator().manual_seed(p["seed"]), dtype=torch.float64)
    G = tp.ensembles.random_matrices((B, H), d, law="goe", scale=1.0,
                                     generator=torch.Generator().manual_seed(p["seed"] + 1), dtype=torch.float64)
    A = torch.eye(d, dtype=torch.float64) + p["head_scale"] * G / math.sqrt(d)
    V = torch.eye(d, dtype=torch.float64).expand(B, H, d, d)
    return x0.to(dtype), tp.Heads(A.to(dtype), V.to(dtype), beta=p["beta"])


def fit_late_rate(t, gap, low, high, kind):
    """Least-squares slope of log(gap) against t ("exp") or log t ("power") on the points with
    low <= gap <= high, per draw; gap (T, B).  NaN where fewer than 3 points fall in the window."""
    t = np.asarray(t, dtype=float)
    g = np.asarray(gap, dtype=float)
    out = np.full(g.shape[1], math.nan)
    for b in range(g.shape[1]):
        ok = (g[:, b] >= low) & (g[:, b] <= high) & (t > 0)
        if ok.sum() < 3:
            continue
        xs = t[ok] if kind == "exp" else np.log(t[ok])
        out[b] = np.polyfit(xs, np.log(g[ok, b]), 1)[0]
    return out


@study("layer_norm_rates", OPTIONS,
       "late clustering rates under post-, pre-, peri-LN and nGPT (Karagodin et al. 2025): 1 − ρ(t) with a 90 % "
       "band over random weights, fitted exponential / power rates against e^(−2t) and 1/t²", validate=_validate)
def run_layer_norm_rates(params: Dict, run) -> Dict:
    p = params
    _validate(p)
    dtype = dtype_of(p)
    x0, heads = _setup(p, dtype)
    metrics: Dict = {"schemes": {}, "draws": p["draws"], "n": p["n"], "d": p["d"], "heads": p["heads"]}
    results, summary = {}, []
    for scheme in p["schemes"]:
        def compute(scheme=scheme):
            traj = tp.solve(tp.Model(heads, normalization="softmax", direction="ascent", layer_norm=scheme), x0,
                            tp.Euler(), t1=p["t1"], dt=p["dt"],
                            saveat=tp.SaveAt(record_every=p["record_every"], observables={"rho": _mean_cosine}),
                            ledger=tp.LedgerOptions(diagnostics=False), progress=run.progress)
            return {"t": traj.times.detach().cpu(), "rho": traj.observables["rho"].detach().cpu().double()}

        res = cached(run, f"rates_{scheme}", compute, log)
        t, gap = res["t"].numpy(), (1.0 - res["rho"]).clamp_min(0.0).numpy()
        law, theory = THEORY[scheme]
        kind = law
        rates = fit_late_rate(t, gap, p["fit_low"], p["fit_high"], kind)
        q = np.nanquantile(rates, [0.05, 0.5, 0.95]) if np.isfinite(rates).any() else [math.nan] * 3
        results[scheme] = (t, gap)
        fitted = int(np.isfinite(rates).sum())
        metrics["schemes"][scheme] = {
            "law": "exponential: d log(1−ρ)/dt" if kind == "exp" else "power: d log(1−ρ)/d log t",
            "theory": theory, "rate_median": float(q[1]), "rate_q05": float(q[0]), "rate_q95": float(q[2]),
            "fitted_draws": fitted,
            "final_gap_median": float(np.median(gap[-1]))}
        if scheme == "post":  # near consensus with V = I the map x ← normalize(x + dt·A) shrinks 1 − ρ by (1 + dt)⁻²
            metrics["schemes"][scheme]["theory_discrete"] = -2.0 * math.log1p(p["dt"]) / p["dt"]
        band = np.quantile(gap, [0.05, 0.5, 0.95], axis=1)
        run.save_series(scheme, {"t": res["t"], "gap_q05": torch.as_tensor(band[0]),
                                 "gap_median": torch.as_tensor(band[1]), "gap_q95": torch.as_tensor(band[2])})
        what = "rate" if kind == "exp" else "exponent"
        theory_text = "—" if theory is None else f"{theory:g}"
        if scheme == "post":
            theory_text += (f" as dt → 0; −2·ln(1 + dt)/dt = {metrics['schemes'][scheme]['theory_discrete']:.3f} "
                            f"for the map at dt = {p['dt']:g}")
        spread = float(q[2] - q[0])
        if fitted >= 2 and spread <= 1e-6 * max(1.0, abs(float(q[1]))):
            # not a failed band: near consensus this scheme's rate does not depend on the random scores
            summary.append(f"{scheme}: fitted {what} {q[1]:.3f}, the same in all {fitted} fitted draws (spread "
                           f"{spread:.1e}: near consensus the {what} does not depend on the random scores; theory "
                           f"{theory_text})")
        else:  # enough digits that the two ends of a narrow band differ on the page
            k = 3 if not spread > 0 else min(8, max(3, math.ceil(-math.log10(spread)) + 1))
            narrow = (" — narrow: near consensus the rate hardly depends on the random scores"
                      if 0 < spread < 1e-2 * abs(float(q[1])) else "")
            summary.append(f"{scheme}: fitted {what} {q[1]:.{k}f} (90 % band over {fitted} draws {q[0]:.{k}f} … "
                           f"{q[2]:.{k}f}{narrow}; theory {theory_text})")
    metrics["summary"] = summary
    if p["figures"]:
        _figure(p, results, metrics, run)
    return metrics


def _figure(p, results, metrics, run):
    fig, axes = subplots(1, 2, (10.5, 4.0), squeeze=False)
    for k, (scheme, (t, gap)) in enumerate(results.items()):
        lo, med, hi = np.quantile(gap, [0.05, 0.5, 0.95], axis=1)
        for ax in axes[0]:
            ax.fill_between(t[1:], np.maximum(lo[1:], 1e-18), np.maximum(hi[1:], 1e-18), color=f"C{k}", alpha=0.2)
            ax.plot(t[1:], np.maximum(med[1:], 1e-18), color=f"C{k}", label=f"{scheme}-LN (median, 90 % band)")
    t = next(iter(results.values()))[0][1:]
    ref = np.median([np.median(g[1]) for _, g in results.values()])
    for ax, xscale in zip(axes[0], ("linear", "log")):
        ax.plot(t, ref * np.exp(-2 * (t - t[0])), "k--", lw=1, label=r"$\propto e^{-2t}$")
        ax.plot(t, ref * (t[0] / t) ** 2, "k:", lw=1, label=r"$\propto 1/t^2$")
        ax.set_yscale("log")
        ax.set_xscale(xscale)
        ax.set_ylim(1e-16, 2)
        if xscale == "log":  # a decade or two of t: the minor labels (2×10⁻¹, 3×10⁻¹, ...) would run into each other
            from matplotlib.ticker import NullFormatter

            ax.xaxis.set_minor_formatter(NullFormatter())
        panel(ax, "time t" + (" (log)" if xscale == "log" else ""), r"$1 - \rho(t)$", None,
              legend=dict(fontsize=7))
    cap = (f"Average cosine ρ(t) of n = {p['n']} tokens on {sphere_name(p['d'])}, {p['draws']} random weight draws "
           f"(A = I + {p['head_scale']:g}·GOE/√d, V = I, H = {p['heads']}, β = {p['beta']:g}, dt = {p['dt']:g}); "
           f"line: median over the draws, band: 5–95 %. " + "; ".join(metrics["summary"]) + ".")
    save_captioned(run, fig, "layer_norm_rates", cap, metrics)
