"""Lost in the middle: the retrieval profile of causal attention with positional decay, measured on the particle
system against the kinetic theory of Duerinckx, Geshkovski and Rossi (2026, arXiv 2605.09213),
docs/lost_in_the_middle.md.

The particle system is the paper's: n tokens θ_k on the circle, token j attends to the tokens k < j with the
positional weights e^{−(λ/n)(j − k)} normalised over the prefix, through the un-normalised kernel
−β sin(θ_j − θ_k) e^{β cos(θ_j − θ_k)} (:func:`~transformer_pde.application.studies.retrieval.paper_model`: ``tp.KineticDecay(λ, strict=True)``, the
"unnormalized" normalisation, value β·I, ascent), solved by :func:`transformer_pde.solve`.  Initial angles are
i.i.d. uniform; the token k sits at the source position s_k = (k + 1)/n.

What is measured (:func:`transformer_pde.application.studies.retrieval.retrieval_estimates`): the response of the last token's state at time t to the initial
state of the token at s, by autograd through the solve,

    R_t(s_k) = n · E[ ∂θ_N(t)/∂θ_k(0) · Σ_{m≤N_modes} ω_{m,M} cos(m (θ_N(t) − θ_k(0))) ],

the particle estimator of the kinetic profile S_t(s) (the linear response of the last token's law in Fourier mode
m to a mode-m perturbation of the source's law, mixed with the weights ω_{m,M}; the docs derive it).  Averages
are over random initial data; errors are percentile-bootstrap half-widths over the initial data (95 %).

Reported: the binned profile with bootstrap bands against the closed form averaged over the same tokens; the
U-shape (interior minimum's position and depth); the right-end slope (least-squares line through the estimates of
the tokens within ``window`` of s = 1) against t and the time t_crit at which it changes sign, against the same
window fit of the closed form and the closed-form t_crit; the convergence of the profile to the closed form as n
grows, as a fitted power of n; a small-β case within its band.  Where the particles leave the theory's linear
regime (the empirical Fourier amplitudes |ρ̂_m(t)| = |(1/n) Σ_k e^{i m θ_k(t)}| no longer small: a finite-n
effect, the uniform state being unstable at rates a_m) the study says so and shows it.
"""

from __future__ import annotations

import logging
import math
from typing import Dict

import numpy as np
import torch

from transformer_pde.analysis.theory import kinetic as kt

from . import Option, at_least, cached, dtype_of, open_unit, panel, positive, save_captioned, segment_bar, study, \
    subplots, unique_nonempty
from .claims import bootstrap_interval, claim
from .retrieval import (
    binned, first_order_control, paper_model, retrieval_estimates, time_step, token_bins, window_slope_weights,
)

__all__ = ["run_lost_in_the_middle"]

log = logging.getLogger(__name__)


def _fractions(v):
    return None if v and all(isinstance(x, (int, float)) and x > 0 for x in v) else "must be a non-empty list of numbers > 0"


def _sizes(v):
    if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 8 for x in v):
        return "must be a non-empty list of integers >= 8"
    return unique_nonempty(v)


OPTIONS = {
    "n": Option(256, (int,), "tokens of the profile and t_crit runs", check=at_least(8)),
    "betas": Option([1.0, 2.0, 3.0], (list,), "β of the t_crit measurements (the first also gives the profile figure)",
                    check=lambda v: _fractions(v) or unique_nonempty(v)),
    "lam": Option(1.0, (float,), "positional decay λ (weights e^{−(λ/n)(j−k)})", check=positive),
    "M": Option(8.0, (float,), "width parameter M of the mode weights ω_{m,M} = exp(−π²m²/(2M²))", check=positive),
    "modes": Option(20, (int,), "Fourier modes N of the profile (the readout and the closed form)", check=at_least(1)),
    "samples": Option(64, (int,), "random initial conditions (the bootstrap's units) per β", check=at_least(8)),
    "times": Option([0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5], (list,),
                    "measurement times as fractions of the closed-form t_crit(β) (the profile figure and the "
                    "right-end slope's sign change)", check=_fractions),
    "bins": Option(16, (int,), "position bins of the profile (and its bands)", check=at_least(2)),
    "window": Option(0.5, (float,), "right-end window: the slope is the least-squares line through the estimates "
                     "of the tokens with s >= 1 − window", check=open_unit),
    "method": Option("heun", (str,), "Runge–Kutta method of the solve (the paper's trajectory code uses rk4)",
                     choices=("euler", "heun", "rk4")),
    "dt_max": Option(0.05, (float,), "largest time step", check=positive),
    "courant": Option(0.25, (float,), "time step = min(dt_max, courant / (β e^β)) (β e^β bounds the force)",
                      check=positive),
    "convergence_ns": Option([64, 128, 256, 512], (list,), "token counts of the convergence in n", check=_sizes),
    "convergence_beta": Option(1.0, (float,), "β of the convergence in n", check=positive),
    "convergence_time": Option(1.0, (float,), "time of the convergence in n, as a fraction of t_crit(β)",
                               check=positive),
    "convergence_budget": Option(16384, (int,), "samples × tokens per size of the convergence (samples = budget/n, "
                                 "at least convergence_min_samples)", check=at_least(8)),
    "convergence_min_samples": Option(8, (int,), "fewest samples per size", check=at_least(4)),
    "linear_beta": Option(0.5, (float,), "β of the small-β (linear) check", check=positive),
    "linear_time": Option(1.0, (float,), "time of the small-β check (absolute)", check=positive),
    "linear_n": Option(128, (int,), "tokens of the small-β check", check=at_least(8)),
    "control_variate": Option(True, (bool,), "subtract the estimator's first-order term minus its exact mean "
                              "(first_order_control: unbiased, a smaller variance)"),
    "resamples": Option(1000, (int,), "bootstrap resamples", check=at_least(100)),
    "seed": Option(0, (int,), "seed of the initial angles (each piece derives its own)"),
    "figures": Option(True, (bool,), "write the figures"),
}


def _validate(p):
    if p["bins"] > p["n"] // 2:
        raise ValueError(f"config key 'bins' = {p['bins']} leaves fewer than two tokens per bin at n = {p['n']}; "
                         f"choose bins <= {p['n'] // 2}")
    if round(p["window"] * p["n"]) < 4:
        raise ValueError(f"config key 'window' = {p['window']} holds fewer than 4 tokens at n = {p['n']}; choose "
                         f"window >= {4 / p['n']:.3g}")
    if min(p["convergence_ns"]) < 2 * p["bins"]:
        raise ValueError(f"config key 'convergence_ns' has {min(p['convergence_ns'])} tokens, fewer than two per "
                         f"bin (bins = {p['bins']}); give sizes >= {2 * p['bins']}")


def _theory_tokens(times, n, beta, p):
    s = (np.arange(n - 1) + 1) / n
    return kt.retrieval_profile(s, np.asarray(times), beta, p["lam"], p["M"], p["modes"]).reshape(len(times), n - 1)


def _piece(p, run, tag, beta, n, R, times_abs, seed, bar, dtype):
    """One measurement (cached on resume): binned estimates, right-end slopes, amplitudes and their theory."""
    dt = time_step(beta, max(times_abs), dt_max=p["dt_max"], courant=p["courant"])
    times = [max(1, round(t / dt)) * dt for t in times_abs]
    total = round(max(times) / dt) + sum(round(t / dt) for t in times)

    def compute():
        g = torch.Generator().manual_seed(seed)
        theta0 = (torch.rand(R, n, generator=g, dtype=torch.float64) * 2 * math.pi).to(dtype)
        res = retrieval_estimates(paper_model(beta, p["lam"], dtype=dtype), theta0, times, dt=dt, M=p["M"],
                                  modes=p["modes"], method=p["method"], callback=bar.steps(tag, total, key=tag))
        control = first_order_control(theta0.double(), res["t"].tolist(), beta, p["lam"], M=p["M"], modes=p["modes"])
        return {"t": res["t"], "dt": torch.tensor(dt), "est": res["est"], "control": control,
                "amplitude": res["amplitude"]}

    out = cached(run, tag, compute, log)
    bar.update(key=tag)
    return _reduce(p, out, beta, n)


def _reduce(p, piece, beta, n):
    """The reductions of a stored piece: per-sample bins (T, R, B) and window slopes (T, R) of the estimates (the
    control variate subtracted when ``control_variate``), the sample means per token, and the closed form's."""
    est = piece["est"] - piece["control"] if p["control_variate"] else piece["est"]
    idx = token_bins(n, p["bins"])
    c = window_slope_weights(n, p["window"])
    theory = _theory_tokens(piece["t"].tolist(), n, beta, p)  # (T, n − 1)
    return {"t": piece["t"], "bins": binned(est, idx, p["bins"]), "slope": est @ c, "slope_raw": piece["est"] @ c,
            "tokens": est.mean(1),
            "amplitude": piece["amplitude"], "theory_bins": binned(theory, idx, p["bins"]),
            "theory_slope": theory @ c, "theory_tokens": theory}


# ------------------------------------------------------------------------------------------- statistics
def _boot(values: torch.Tensor, stat, p, seed=0):
    """(statistic, 95 % bootstrap half-width) over the samples (axis 0 of ``values``)."""
    return bootstrap_interval(values.numpy(), stat, resamples=p["resamples"], seed=seed)


def _crossing(t, slope_mean):
    """The first time the mean slope turns from > 0 to <= 0, by linear interpolation; NaN when it does not."""
    for i in range(len(t) - 1):
        a, b = slope_mean[i], slope_mean[i + 1]
        if a > 0 >= b:
            return t[i] + (t[i + 1] - t[i]) * a / (a - b)
    return float("nan")


def _minimum(profile, centres):
    """The minimum of a binned profile: a parabola through the lowest bin and its neighbours (the lowest bin
    itself at the ends): (position, value)."""
    k = int(np.argmin(profile))
    if 0 < k < len(profile) - 1:
        y0, y1, y2 = profile[k - 1], profile[k], profile[k + 1]
        h = centres[1] - centres[0]
        den = y0 - 2 * y1 + y2
        if den > 0:
            off = 0.5 * (y0 - y2) / den
            return centres[k] + off * h, y1 - 0.25 * (y0 - y2) * off
    return centres[k], profile[k]


def _window_tcrit(beta, n, p, tc):
    """The closed form's t_crit seen through the same right-end window fit as the particles."""
    from scipy.optimize import brentq

    s = (np.arange(n - 1) + 1) / n
    c = window_slope_weights(n, p["window"]).numpy()

    def f(t):
        return float(c @ kt.retrieval_profile(s, t, beta, p["lam"], p["M"], p["modes"]).numpy())

    try:
        return brentq(f, 0.05 * tc, 5 * tc, xtol=1e-10)
    except ValueError:
        return float("nan")


@study("lost_in_the_middle", OPTIONS,
       "lost in the middle: the retrieval profile of causal attention with positional decay, particles vs kinetic "
       "theory (U-shape, t_crit(β), convergence in n)", validate=_validate)
def run_lost_in_the_middle(params, run):
    p = params
    _validate(p)
    dtype = dtype_of(p)
    betas, ns = p["betas"], p["convergence_ns"]
    tcs = {b: kt.critical_time(b, p["lam"], p["M"], p["modes"]) for b in betas + [p["convergence_beta"]]}
    tc_conv = tcs[p["convergence_beta"]]
    rn = {n: max(p["convergence_min_samples"], p["convergence_budget"] // n) for n in ns}
    work = {f"beta{b:g}": p["samples"] * p["n"] ** 2 * max(p["times"]) * tcs[b] * b * math.exp(b) for b in betas}
    work.update({f"conv_n{n}": rn[n] * n * n * p["convergence_time"] * tc_conv * p["convergence_beta"]
                 * math.exp(p["convergence_beta"]) for n in ns})
    work["linear"] = p["samples"] * p["linear_n"] ** 2 * p["linear_time"] * p["linear_beta"] * math.exp(p["linear_beta"])
    metrics: Dict = {"closed_form": {}, "claims": []}
    pieces = {}
    with segment_bar(run, len(work), "lost in the middle", "piece", work=work, log=log) as bar:
        for i, b in enumerate(betas):
            pieces[b] = _piece(p, run, f"beta{b:g}", b, p["n"], p["samples"], [f * tcs[b] for f in p["times"]],
                               p["seed"] + 101 * i, bar, dtype)
        conv = {n: _piece(p, run, f"conv_n{n}", p["convergence_beta"], n, rn[n], [p["convergence_time"] * tc_conv],
                          p["seed"] + 7919 + n, bar, dtype) for n in ns}
        lin = _piece(p, run, "linear", p["linear_beta"], p["linear_n"], p["samples"], [p["linear_time"]],
                     p["seed"] + 31337, bar, dtype)
    _closed_form_claims(p, tcs, metrics)
    _tcrit_claims(p, betas, tcs, pieces, metrics, run)
    _ushape_claims(p, betas[0], tcs[betas[0]], pieces[betas[0]], metrics)
    _convergence_claims(p, ns, rn, conv, metrics, run)
    _linear_claims(p, lin, metrics)
    metrics["summary"] = _summary(metrics)
    if p["figures"]:
        _figures(p, betas, tcs, pieces, conv, lin, metrics, run)
    return metrics


def _closed_form_claims(p, tcs, metrics):
    paper = {1.0: 2.4575, 2.0: 0.6007, 3.0: 0.1740}  # the paper's data script, λ = 1, M = 8, 20 modes
    for b, tc in tcs.items():
        metrics["closed_form"][f"t_crit(beta={b:g})"] = tc
    if p["lam"] == 1.0 and p["M"] == 8.0 and p["modes"] == 20:
        for b, ref in paper.items():
            tc = kt.critical_time(b, 1.0, 8.0, 20)
            metrics["claims"].append(claim(f"closed-form t_crit, β={b:g} (λ=1, M=8, 20 modes) vs the paper's number",
                                           tc, 0.0, 0, ref, abs(tc - ref) <= 5e-5))


def _tcrit_claims(p, betas, tcs, pieces, metrics, run):
    out = metrics.setdefault("t_crit", {})
    for b in betas:
        pc = pieces[b]
        t = pc["t"].numpy()
        slopes = pc["slope"]  # (T, R)
        theory_window = _window_tcrit(b, p["n"], p, tcs[b])
        value, half = _boot(slopes.T, lambda v: _crossing(t, v.mean(0)), p, seed=int(1000 * b))
        amp = pc["amplitude"].mean(1)  # (T, 3)
        at = int(np.argmin(np.abs(t - tcs[b])))
        gain = (pc["slope_raw"].std(1) / slopes.std(1)).tolist()  # the control variate's reduction of the se
        out[f"beta={b:g}"] = {"measured": value, "error": half, "closed_form": tcs[b], "window_closed_form": theory_window,
                              "amplitude_at_t_crit": float(amp[at].max()), "n": p["n"], "samples": p["samples"],
                              "times": t.tolist(), "control_gain": gain}
        holds = None if not math.isfinite(value) else abs(value - theory_window) <= half
        metrics["claims"].append(claim(
            f"t_crit measured, β={b:g}, n={p['n']} (window {p['window']:g}; reference: the same window fit of the "
            f"closed form; exact t_crit {tcs[b]:.4f})", value, half, p["samples"], theory_window, holds))
        run.save_series(f"slope_beta{b:g}", {"t": t, "slope_mean": slopes.mean(1),
                                            "slope_se": slopes.std(1) / math.sqrt(slopes.shape[1]),
                                            "theory_window_slope": pc["theory_slope"],
                                            "amplitude_max": pc["amplitude"].mean(1).amax(-1)})


def _ushape_claims(p, beta, tc, pc, metrics):
    B = p["bins"]
    n = p["n"]
    idx = token_bins(n, B)
    s = (torch.arange(n - 1, dtype=torch.float64) + 1) / n
    centres = (binned(s, idx, B)).numpy()
    out = metrics.setdefault("u_shape", {})
    for m, t in enumerate(pc["t"].tolist()):
        if t > tc * 1.001:
            continue
        bins = pc["bins"][m]  # (R, B)
        th = pc["theory_bins"][m].numpy()
        loc, loc_e = _boot(bins, lambda v: _minimum(v.mean(0), centres)[0], p, seed=m)
        depth, depth_e = _boot(bins, lambda v: v.mean(0)[-1] - _minimum(v.mean(0), centres)[1], p, seed=m + 50)
        th_loc, th_min = _minimum(th, centres)
        th_depth = th[-1] - th_min
        exact = kt.profile_minimum(t, beta, p["lam"], p["M"], p["modes"], s_min=float(centres[0]))
        out[f"t={t:.4g}"] = {"min_position": loc, "min_position_error": loc_e, "depth": depth, "depth_error": depth_e,
                             "theory_min_position": th_loc, "theory_depth": th_depth, "exact_min_position": exact[0]}
        metrics["claims"].append(claim(f"U-shape β={beta:g}, t={t / tc:.2f} t_crit: interior minimum position "
                                       f"(binned; exact closed form {exact[0]:.3f})", loc, loc_e, p["samples"], th_loc,
                                       abs(loc - th_loc) <= loc_e))
        metrics["claims"].append(claim(f"U-shape β={beta:g}, t={t / tc:.2f} t_crit: depth S(last bin) − S(min)",
                                       depth, depth_e, p["samples"], th_depth, abs(depth - th_depth) <= depth_e))


def _gap2(bins_rb, theory_b):
    """(g², var(g²)): g² = mean_b [(mean_r bins − theory)² − se_b²], the squared RMS gap over bins with the sampling
    noise removed (unbiased; it may come out negative when the gap is below the noise), and its variance
    (1/B²) Σ_b (4 δ_b² se_b² + 2 se_b⁴)."""
    R = bins_rb.shape[0]
    mean = bins_rb.mean(0)
    se2 = bins_rb.var(0, ddof=1) / R
    d2 = (mean - theory_b) ** 2
    g2 = float(np.mean(d2 - se2))
    var = float(np.sum(4 * np.maximum(d2 - se2, 0) * se2 + 2 * se2 ** 2)) / len(se2) ** 2
    return g2, var


def _rate_fit(ns, g2, var):
    """The exponent p and amplitude C of g² = C n^{−2p} by weighted least squares (weights 1/var), over p on a
    grid of [0, 3] (C >= 0 in closed form for each p): negative g² (a gap below the noise) count as data."""
    n = np.asarray(ns, dtype=np.float64)
    y, w = np.asarray(g2), 1.0 / np.maximum(np.asarray(var), 1e-300)
    best = (np.inf, float("nan"), 0.0)
    for pp in np.linspace(0.0, 3.0, 601):
        f = n ** (-2 * pp)
        C = max(float((w * f * y).sum() / (w * f * f).sum()), 0.0)
        chi = float((w * (y - C * f) ** 2).sum())
        if chi < best[0]:
            best = (chi, float(pp), C)
    return best[1], best[2]


def _convergence_claims(p, ns, rn, conv, metrics, run):
    out = metrics.setdefault("convergence", {})
    thy = {n: conv[n]["theory_bins"][0].numpy() for n in ns}
    base = {n: conv[n]["bins"][0].numpy() for n in ns}
    g2, var, gaps, errs, rel = [], [], [], [], []
    for n in ns:
        a, v = _gap2(base[n], thy[n])
        scale = float(np.sqrt(np.mean(thy[n] ** 2)))
        g2.append(a)
        var.append(v)
        gaps.append(math.sqrt(max(a, 0.0)))
        errs.append(math.sqrt(v) / (2 * max(gaps[-1], math.sqrt(math.sqrt(v)))))  # δg ≈ δ(g²)/(2g), capped
        rel.append(gaps[-1] / scale)
        out[f"n={n}"] = {"gap": gaps[-1], "error": errs[-1], "gap2": a, "gap2_se": math.sqrt(v),
                         "relative": rel[-1], "samples": rn[n], "amplitude": float(conv[n]["amplitude"][0].mean(0).max())}
    run.save_series("convergence", {"n": ns, "gap": gaps, "gap_error": errs, "gap2": g2, "gap2_se": np.sqrt(var),
                                    "relative_gap": rel, "samples": [rn[k] for k in ns]})
    value, C = _rate_fit(ns, g2, var)
    rng = np.random.default_rng(0)
    boots = []
    for _ in range(p["resamples"]):
        res = [_gap2(base[n][rng.integers(0, base[n].shape[0], base[n].shape[0])], thy[n]) for n in ns]
        boots.append(_rate_fit(ns, [r[0] for r in res], [r[1] for r in res])[0])
    lo, hi = np.quantile(np.asarray(boots), [0.025, 0.975])
    half = float((hi - lo) / 2)
    out["rate"] = {"value": float(value), "error": half, "amplitude": C}
    b, t = p["convergence_beta"], p["convergence_time"]
    metrics["claims"].append(claim(f"convergence rate of the profile in n (RMS gap ∝ n^-rate), β={b:g}, t={t:g} "
                                   f"t_crit, n={ns[0]}..{ns[-1]}", value, half, sum(rn.values()), None, None))
    metrics["claims"].append(claim(f"relative RMS profile gap at n={ns[-1]} (β={b:g}, t={t:g} t_crit)", rel[-1],
                                   errs[-1] / max(gaps[-1], 1e-300) * rel[-1] if gaps[-1] > 0 else float("nan"),
                                   rn[ns[-1]], None, None))


def _linear_claims(p, lin, metrics):
    bins, th = lin["bins"][0], lin["theory_bins"][0]
    R = bins.shape[0]
    mean, se = bins.mean(0), bins.std(0, unbiased=True) / math.sqrt(R)
    z = ((mean - th) / se).numpy()
    chi2 = float(np.mean(z ** 2))
    B = len(z)
    out = {"chi2_per_bin": chi2, "max_abs_z": float(np.abs(z).max()), "bins": B, "samples": R,
           "amplitude": float(lin["amplitude"][0].mean(0).max())}
    metrics["linear"] = out
    metrics["claims"].append(claim(f"small-β profile vs closed form: χ²/bin over {B} bins (β={p['linear_beta']:g}, "
                                   f"t={p['linear_time']:g}, n={p['linear_n']})", chi2, math.sqrt(2.0 / B), R, 1.0,
                                   abs(chi2 - 1.0) <= 3 * math.sqrt(2.0 / B)))


def _summary(metrics):
    lines = []
    for k, v in metrics.get("t_crit", {}).items():
        meas = (f"{v['measured']:.4g} ± {v['error']:.2g}" if math.isfinite(v["measured"])
                else "no sign change of the mean slope at the measured times")
        verdict = ""
        if math.isfinite(v["measured"]) and abs(v["measured"] - v["window_closed_form"]) > v["error"]:
            verdict = (f" — they disagree beyond the error: at n = {v['n']} the uniform state's Fourier amplitude has "
                       f"grown to {v['amplitude_at_t_crit']:.2f} by t_crit (outside the linear regime of the theory)")
        lines.append(f"t_crit {k}: particles {meas} vs closed form (window) {v['window_closed_form']:.4g}, exact "
                     f"{v['closed_form']:.4g}; Fourier amplitude at t_crit {v['amplitude_at_t_crit']:.2f}{verdict}")
    if "rate" in metrics.get("convergence", {}):
        r = metrics["convergence"]["rate"]
        lines.append(f"convergence in n: gap ∝ n^-{r['value']:.2f} ± {r['error']:.2f}")
    if "linear" in metrics:
        lines.append(f"small β: χ²/bin {metrics['linear']['chi2_per_bin']:.2f} (max |z| "
                     f"{metrics['linear']['max_abs_z']:.2f})")
    return lines


# ------------------------------------------------------------------------------------------- figures
def _figures(p, betas, tcs, pieces, conv, lin, metrics, run):
    B, n = p["bins"], p["n"]
    idx = token_bins(n, B)
    s_tok = (torch.arange(n - 1, dtype=torch.float64) + 1) / n
    centres = binned(s_tok, idx, B).numpy()
    base = (f"Particles: n = {n} tokens on the circle, λ = {p['lam']:g}, M = {p['M']:g}, {p['modes']} modes, "
            f"{p['samples']} random initial conditions, {p['method']} (the paper's model: causal kinetic decay over "
            f"the strict prefix, un-normalised kernel, direction ascent); bands: 95 % bootstrap over initial "
            f"conditions.")
    # 1. the profile against s at several t (first β): at most four times, nearest to 1/4, 1/2, 1 and 3/2 t_crit
    b0 = betas[0]
    pc = pieces[b0]
    frac = pc["t"].numpy() / tcs[b0]
    shown = sorted({int(np.argmin(np.abs(frac - f))) for f in (0.25, 0.5, 1.0, 1.5)})
    fig, axs = subplots(1, 2, (11, 4.4))
    s_fine = np.linspace(max(centres[0], 0.02), 1.0, 400)
    for j, m in enumerate(shown):
        t = float(pc["t"][m])
        color = f"C{j}"
        bins = pc["bins"][m]
        mean = bins.mean(0).numpy()
        lo, hi = np.quantile(np.stack([bins[np.random.default_rng(k).integers(0, bins.shape[0], bins.shape[0])]
                                       .mean(0).numpy() for k in range(200)]), [0.025, 0.975], axis=0)
        th_bins = pc["theory_bins"][m].numpy()
        for ax, norm in ((axs[0], 1.0), (axs[1], float(th_bins[-1]))):
            ax.fill_between(centres, lo / norm, hi / norm, color=color, alpha=0.2)
            ax.plot(centres, mean / norm, "o", color=color, ms=4, label=f"t = {t / tcs[b0]:.2f} t_crit")
            ax.plot(centres, th_bins / norm, "x", color=color, ms=5)
            ax.plot(s_fine, kt.retrieval_profile(s_fine, t, b0, p["lam"], p["M"], p["modes"]).numpy() / norm, "-",
                    color=color, lw=0.8)
    axs[0].set_yscale("log")
    axs[1].set_ylim(0.0, 2.5)
    panel(axs[0], "source position s", "retrieval profile S_t(s) (log)", f"β = {b0:g}: particles vs closed form",
          legend={"fontsize": 8})
    panel(axs[1], "source position s", "S_t(s) / closed form's last bin", "normalised at the end (clipped at 2.5)")
    save_captioned(run, fig, "profiles", base + f" β = {b0:g}, t_crit = {tcs[b0]:.4g}. Dots and bands: the particle "
                   f"estimate n·E[∂θ_N(t)/∂θ_k(0) w(θ_N(t) − θ_k(0))] averaged over the tokens of {B} position bins; "
                   f"crosses: the closed form averaged over the same tokens; lines: the closed form S_t(s). The U-shape "
                   f"(an interior minimum) flattens into a profile that falls towards the end after t_crit; at the "
                   f"later times the particles fall below the closed form at the start of the prompt (finite n: the "
                   f"uniform state's fluctuations have grown).", metrics)

    # 2. t_crit(β): closed form and particles
    fig, axs = subplots(1, 2, (11, 4.2))
    grid = np.linspace(0.1, 4.8, 48)
    axs[0].plot(grid, [kt.critical_time(b, p["lam"], p["M"], p["modes"]) for b in grid], "-", color="k",
                label="closed form t_crit(β)")
    for k, b in enumerate(betas):
        v = metrics["t_crit"][f"beta={b:g}"]
        axs[0].errorbar([b], [v["measured"]], yerr=[v["error"]], fmt="o", color="C3", capsize=3,
                        label="particles (window fit)" if k == 0 else None)
        axs[0].plot([b], [v["window_closed_form"]], "x", color="C0", label="closed form, same window" if k == 0
                    else None)
        pcb = pieces[b]
        t = pcb["t"].numpy() / tcs[b]
        sl = pcb["slope"]
        mean, se = sl.mean(1).numpy(), (sl.std(1) / math.sqrt(sl.shape[1])).numpy()
        scale = float(pcb["theory_slope"].abs().max())
        axs[1].errorbar(t, mean / scale, yerr=2 * se / scale, fmt="o", ms=3, color=f"C{k}", capsize=2,
                        label=f"β = {b:g}")
        axs[1].plot(t, pcb["theory_slope"].numpy() / scale, "-", color=f"C{k}", lw=1)
    axs[0].set_yscale("log")
    axs[1].axhline(0.0, color="gray", lw=0.6)
    panel(axs[0], "β", "t_crit", "the sign change of the right-end slope", legend={"fontsize": 8})
    panel(axs[1], "t / t_crit(β)", "right-end slope (scaled)", "window slope vs t: particles (±2 se), closed form",
          legend={"fontsize": 8})
    save_captioned(run, fig, "t_crit", base + f" Right-end slope: least-squares line through the estimates of the "
                   f"tokens with s >= {1 - p['window']:g}; t_crit measured where its mean over initial conditions "
                   f"changes sign (linear interpolation), error: 95 % bootstrap. The closed-form line is 2(1 − e^−λ) "
                   f"S₁/S₂; crosses: the closed form seen through the same window.", metrics)

    # 3. convergence in n
    ns = p["convergence_ns"]
    c = metrics["convergence"]
    fig, axs = subplots(1, 2, (11, 4.2))
    gap = np.array([c[f"n={k}"]["gap"] for k in ns])
    err = np.array([c[f"n={k}"]["error"] for k in ns])
    noise = np.array([c[f"n={k}"]["gap2_se"] for k in ns]) ** 0.5
    axs[0].errorbar(ns, gap, yerr=err, fmt="o", capsize=3, color="C3", label="particles − closed form (RMS gap)")
    axs[0].plot(ns, noise, ":", color="gray", label="noise floor √se(g²)")
    rate = c["rate"]["value"]
    if math.isfinite(rate) and c["rate"]["amplitude"] > 0:
        axs[0].plot(ns, np.sqrt(c["rate"]["amplitude"]) * np.asarray(ns, dtype=float) ** -rate, "--", color="k",
                    label=f"fit n^-{rate:.2f} ± {c['rate']['error']:.2f}")
    axs[0].set_xscale("log")
    axs[0].set_yscale("log")
    tconv = p["convergence_time"] * kt.critical_time(p["convergence_beta"], p["lam"], p["M"], p["modes"])
    for k, nn in enumerate(ns):
        idn = token_bins(nn, B)
        cen = binned((torch.arange(nn - 1, dtype=torch.float64) + 1) / nn, idn, B).numpy()
        axs[1].plot(cen, conv[nn]["bins"][0].mean(0).numpy(), "o-", ms=3, lw=0.8, color=f"C{k}", label=f"n = {nn}")
    axs[1].plot(s_fine, kt.retrieval_profile(s_fine, tconv, p["convergence_beta"], p["lam"], p["M"],
                                             p["modes"]).numpy(), "-", color="k", lw=1.5, label="closed form")
    panel(axs[0], "tokens n", "RMS gap over bins (noise removed)", "convergence to the kinetic profile",
          legend={"fontsize": 8})
    panel(axs[1], "source position s", "S_t(s)", f"β = {p['convergence_beta']:g}, t = {tconv:.3g}",
          legend={"fontsize": 8})
    save_captioned(run, fig, "convergence", f"The binned particle profile at β = {p['convergence_beta']:g}, t = "
                   f"{p['convergence_time']:g} t_crit against the closed form averaged over the same tokens, for n = "
                   f"{ns[0]}..{ns[-1]} ({', '.join(str(metrics['convergence'][f'n={k}']['samples']) for k in ns)} "
                   f"initial conditions). The gap is √(mean over bins of (mean − closed form)² − se²) (the sampling "
                   f"noise removed; a gap below the noise floor plots at 0); the rate: weighted least squares of "
                   f"g² = C n^(−2 rate), its error a 95 % bootstrap over each size's initial conditions.", metrics)

