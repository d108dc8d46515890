"""JKO vs particles: the minimizing-movement and the particle solution of the same PDE converge.

Kind ``jko_vs_particles``.  One weight path Θ_t is sampled once (``tp.sample_path`` on the
grid ``ref_dt``) and replayed by every solver, so all comparisons are path-wise:

    tokens   n tokens uniform on S^{d-1} (token seed ``seed + 1``), weights uniform
    heads    H random symmetric heads, A_h(0) = scale·(Z + Zᵀ) (seed ``seed``), β = 1, ω = 1/H
    Θ_t      "ou" (dA = (I − A)dt + σ dW_sym), "oscillating" (dA = (F(t) − A)dt, shared phase)
             or "constant"; noise seed ``seed + 2``
    particle ẋ = V_eff[μ_t, Θ_t](x) (normalization "effective": the flow whose JKO scheme this is),
             RK4 with dt = ref_dt (Θ linear between grid values), direction as configured
    JKO      tp.jko with transport "identity", "emd", "sinkhorn" (ε = ``eps``) at every τ in ``taus``

Panels (figure ``jko_vs_particles``, series in ``series/``):

(a) W2(JKO(τ_min), particles)(t) for every transport;
(b) convergence in τ: W2 at t1 for identity and emd, fitted slope (expected 1);
(c) convergence in N on S¹: the Lagrangian JKO (identity coupling) of N quantile tokens of a
    smooth density ρ0 and the particle ODE, both against the Eulerian JKO density (grid of
    ``grid`` points, ε = (grid_eps_factor · spacing)²) on the same Θ path and the same τ;
    the JKO-vs-Eulerian W2 falls like 1/N down to the grid floor (fitted slope reported), the
    particle-vs-Eulerian one levels off at the O(τ) time-discretisation error;
(d) convergence in ε: W2(Sinkhorn-JKO(ε), emd-JKO) at t1 with the same symmetric cost.

Metrics (``metrics.json``): fitted slopes, the errors behind them, the largest discrete energy
defect (must be ≤ 0), the De Giorgi ledger residuals, inner iterations, wall times.  Every
finished piece is stored in ``data/`` and skipped on ``--resume``.  All figures use direction
"descent" unless the config says otherwise.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Dict, List

import numpy as np
import torch

import transformer_pde as tp

from . import (
    DTYPE, Option, at_least, cached, log_ticks, nonnegative, panel, positive, save_captioned, sphere_name, study,
    subplots, unique_nonempty, weight_process, dtype_of)

__all__ = ["OPTIONS", "run_jko_vs_particles", "fit_slope", "quantile_tokens"]

logger = logging.getLogger(__name__)


def _positive_list(v):
    if len(v) and not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v):
        return "must be a list of positive numbers"
    return unique_nonempty(v)


def _int_list(v):
    return _positive_list(v) or (None if all(isinstance(x, int) for x in v) else "must be a list of integers")


def _transports(v):
    allowed = ("identity", "emd", "sinkhorn")
    if len(v) == 0 or any(t not in allowed for t in v):
        return f"must be a non-empty list drawn from {list(allowed)}"
    return None


OPTIONS = {
    "d": Option(3, (int,), "ambient dimension of the token comparison (S^{d-1})", check=at_least(2)),
    "n": Option(32, (int,), "number of tokens of the τ / ε comparisons", check=positive),
    "heads": Option(3, (int,), "number of heads H", check=positive),
    "head_scale": Option(0.5, (float,), "A_h(0) = scale·(Z + Zᵀ)", check=positive),
    "process": Option("oscillating", (str,), "weight process", choices=("ou", "oscillating", "constant")),
    "sigma": Option(2 ** 0.5, (float,), "OU noise σ (σ² = 2 in the paper)", check=nonnegative),
    "direction": Option("descent", (str,), "descent (the reference code) or ascent", choices=("descent", "ascent")),
    "t1": Option(1.0, (float,), "final time", check=positive),
    "taus": Option([0.2, 0.1, 0.05, 0.025], (list,), "JKO steps τ (multiples of ref_dt dividing t1)",
                   check=_positive_list),
    "transports": Option(["identity", "emd", "sinkhorn"], (list,), "Lagrangian transports compared",
                         check=_transports),
    "eps": Option(1e-3, (float,), "ε of the Sinkhorn transport in panel (a)", check=positive),
    "eps_sweep": Option([0.01, 0.005, 0.002, 0.001], (list,), "ε values of panel (d)", check=_positive_list),
    "eps_tau": Option(0.05, (float,), "τ of the ε sweep", check=positive),
    "ref_dt": Option(0.0025, (float,), "particle RK4 step = weight-path grid", check=positive),
    "n_sweep": Option([16, 32, 64, 128, 256, 512], (list,), "token counts N of panel (c) (S¹)", check=_int_list),
    "grid": Option(512, (int,), "Eulerian grid points on S¹", check=at_least(8)),
    "grid_eps_factor": Option(2.0, (float,), "Eulerian ε = (factor · 2π/grid)²", check=positive),
    "n_tau": Option(0.05, (float,), "τ of panel (c)", check=positive),
    "n_t1": Option(0.5, (float,), "final time of panel (c)", check=positive),
    "seed": Option(0, (int,), "seed of the heads (tokens seed + 1, weights noise seed + 2)"),
    "dtype": DTYPE,
    "figures": Option(True, (bool,), "write the figure"),
}


def fit_slope(h, e) -> float:
    """Least-squares slope of log e against log h (NaN when fewer than two positive points)."""
    h, e = np.asarray(h, float), np.asarray(e, float)
    keep = (h > 0) & (e > 0) & np.isfinite(e)
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(h[keep]), np.log(e[keep]), 1)[0])


def _density(theta: torch.Tensor) -> torch.Tensor:
    """ρ0 on S¹ (unnormalised): two von Mises bumps — smooth and strictly positive."""
    return torch.exp(1.5 * torch.cos(theta - 0.5)) + 0.5 * torch.exp(2.0 * torch.cos(theta + 2.0))


def quantile_tokens(N: int, *, dtype=torch.float64) -> torch.Tensor:
    """N tokens on S¹ at the quantiles (i + ½)/N of ρ0 (W2 to ρ0 of order 1/N, no sampling noise)."""
    M = 200_000
    th = torch.linspace(-math.pi, math.pi, M + 1, dtype=torch.float64)[:-1] + math.pi / M
    cdf = torch.cumsum(_density(th), 0)
    cdf = cdf / cdf[-1]
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    t = th[torch.searchsorted(cdf, u).clamp(max=M - 1)]
    return torch.stack([torch.cos(t), torch.sin(t)], -1).to(dtype)


def _whole(x: float, dt: float, what: str) -> int:
    k = round(x / dt)
    if k < 1 or abs(k * dt - x) > 1e-9 * max(1.0, x):
        raise ValueError(f"{what} = {x} must be a positive multiple of ref_dt = {dt}")
    return k


def check_params(p) -> None:
    for tau in p["taus"]:
        _whole(tau, p["ref_dt"], "every tau")
        _whole(p["t1"], tau, "t1 / tau: t1")
    _whole(p["eps_tau"], p["ref_dt"], "eps_tau")
    _whole(p["t1"], p["eps_tau"], "t1 / eps_tau: t1")
    _whole(p["n_tau"], p["ref_dt"], "n_tau")
    _whole(p["n_t1"], p["n_tau"], "n_t1 / n_tau: n_t1")
    if p["n_t1"] > p["t1"] + 1e-12:
        raise ValueError(f"n_t1 = {p['n_t1']} must not exceed t1 = {p['t1']}")


def _jko_piece(run, p, x0, path, transport: str, tau: float, **kw):
    """The JKO solution with this transport and step on the shared weight path (cached in data/)."""
    def go():
        with warnings.catch_warnings():
            # unconverged inner solves (geomloss' accuracy limit at larger ε) are counted in the metrics
            warnings.simplefilter("ignore", RuntimeWarning)
            tr = tp.jko(x0, path, tau=tau, steps=_whole(p["t1"], tau, "t1"), transport=transport,
                        direction=p["direction"], progress=run.progress, **kw)
        return {"times": tr.times, "x": tr.x, "ledger_residual": tr.ledger["residual"][-1],
                "ledger_residual_slope": tr.ledger["residual_slope"][-1], "max_defect": tr.stats["max_defect"],
                "mean_iterations": tr.stats["mean_iterations"], "max_residual": tr.stats["max_residual"],
                "nonconverged": tr.stats["nonconverged_steps"]}
    tag = f"jko_{transport}_tau{tau:g}" + "".join(f"_{k}{v:g}" if isinstance(v, float) else f"_{k}{v}"
                                                  for k, v in sorted(kw.items()))
    return cached(run, tag, go, logger, timed=True)


@study("jko_vs_particles", OPTIONS,
       "JKO (Lagrangian emd/Sinkhorn/identity, Eulerian) vs particles: convergence in τ, N and ε")
def run_jko_vs_particles(params, run) -> Dict[str, object]:
    p = dict(params)
    check_params(p)
    dtype = dtype_of(p)
    d, n, H, t1, dt = p["d"], p["n"], p["heads"], p["t1"], p["ref_dt"]
    taus = sorted(p["taus"], reverse=True)
    walls: Dict[str, float] = {}
    metrics: Dict[str, object] = {"direction": p["direction"]}

    # ---------------- shared weight path and particle reference (S^{d-1})
    heads = tp.Heads.random(H, d, scale=p["head_scale"], generator=torch.Generator().manual_seed(p["seed"]),
                            dtype=torch.float64).to(dtype)
    x0 = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(p["seed"] + 1),
                                  dtype=torch.float64).to(dtype)
    path = tp.sample_path(weight_process(p["process"], heads, sigma=p["sigma"]), t1=t1, dt=dt, seed=p["seed"] + 2)

    def particle_reference():
        tr = tp.solve(tp.Model(path, normalization="effective", direction=p["direction"]), x0, tp.RK4(), t1=t1, dt=dt,
                      saveat=tp.SaveAt(record_every=_whole(taus[-1], dt, "tau")), progress=run.progress)
        return {"times": tr.times, "x": tr.x, "energy": tr.energy}

    ref = cached(run, "particles", particle_reference, logger, timed=True)
    walls["particles"] = ref["wall"]
    fig_data = {"taus": taus, **_tau_convergence(run, p, x0, path, ref["x"], taus, metrics, walls),
                **_eps_convergence(run, p, x0, path, ref["x"], metrics, walls),
                **_n_convergence(run, p, dtype, metrics, walls)}
    metrics["wall_times_s"] = walls
    if p["figures"]:
        _figure(run, p, fig_data, metrics)
    return metrics


def _tau_convergence(run, p, x0, path, ref_x, taus, metrics, walls) -> Dict:
    """(a) + (b): W2(JKO, particles) over time at the smallest τ, and at t1 against τ."""
    tau_min = taus[-1]
    curves: Dict[str, List[float]] = {}
    times_min = {}  # the JKO times at tau_min
    tau_err: Dict[str, List[float]] = {}
    ledger_res: Dict[str, List[float]] = {}
    max_defect = -float("inf")
    for tr_name in p["transports"]:
        kw = {"eps": p["eps"]} if tr_name == "sinkhorn" else {}
        for tau in (taus if tr_name != "sinkhorn" else [tau_min]):
            res = _jko_piece(run, p, x0, path, tr_name, tau, **kw)
            walls[f"jko_{tr_name}_tau{tau:g}"] = res["wall"]
            max_defect = max(max_defect, res["max_defect"])
            # the particle reference is recorded every tau_min
            w2 = tp.distance(res["x"], ref_x[[int(round(float(t) / tau_min)) for t in res["times"]]]).double()
            if tau == tau_min:
                curves[tr_name], times_min[tr_name] = w2.tolist(), res["times"]
                metrics[f"w2_max_{tr_name}"] = float(w2.max())
                metrics[f"mean_iterations_{tr_name}"] = res["mean_iterations"]
                metrics[f"nonconverged_steps_{tr_name}"] = res["nonconverged"]
            tau_err.setdefault(tr_name, []).append(float(w2[-1]))
            ledger_res.setdefault(tr_name, []).append(abs(float(res["ledger_residual"])))
    t_curve = [float(t) for t in times_min[p["transports"][0]]]
    run.save_series("w2_vs_time", {"t": t_curve, **{f"w2_{k}": v for k, v in curves.items()}})
    tau_cols = {"tau": taus}
    for k, v in tau_err.items():
        if len(v) == len(taus):
            tau_cols[f"w2_{k}"] = v
            tau_cols[f"ledger_residual_{k}"] = ledger_res[k]
            metrics[f"tau_slope_{k}"] = fit_slope(taus, v)
            metrics[f"ledger_residual_slope_{k}"] = fit_slope(taus, ledger_res[k])
            metrics[f"w2_t1_{k}"] = dict(zip([f"{t:g}" for t in taus], v))
    run.save_series("tau_convergence", tau_cols)
    metrics["max_energy_defect"] = max_defect
    return {"t_curve": t_curve, "curves": curves, "tau_err": tau_err}


def _eps_convergence(run, p, x0, path, ref_x, metrics, walls) -> Dict:
    """(d): W2(Sinkhorn-JKO(ε), emd-JKO) at t1, the same symmetric cost."""
    eps_vals = sorted(p["eps_sweep"], reverse=True)
    emd_sym = _jko_piece(run, p, x0, path, "emd", p["eps_tau"], cost="symmetric")
    eps_err, eps_part, eps_bad = [], [], []
    for eps in eps_vals:
        res = _jko_piece(run, p, x0, path, "sinkhorn", p["eps_tau"], eps=eps)
        walls[f"jko_sinkhorn_eps{eps:g}"] = res["wall"]
        eps_bad.append(res["nonconverged"])
        eps_err.append(float(tp.distance(res["x"][-1], emd_sym["x"][-1])))
        eps_part.append(float(tp.distance(res["x"][-1], ref_x[-1])))
    run.save_series("eps_convergence", {"eps": eps_vals, "w2_sinkhorn_vs_emd": eps_err,
                                        "w2_sinkhorn_vs_particles": eps_part})
    metrics["eps_w2_vs_emd"] = dict(zip([f"{e:g}" for e in eps_vals], eps_err))
    metrics["eps_nonconverged_steps"] = dict(zip([f"{e:g}" for e in eps_vals], eps_bad))
    return {"eps_vals": eps_vals, "eps_err": eps_err}


def _n_convergence(run, p, dtype, metrics, walls) -> Dict:
    """(c): N quantile tokens on S¹ (Lagrangian JKO and particles) against the Eulerian density."""
    m, nt, dt = p["grid"], p["n_tau"], p["ref_dt"]
    heads2 = tp.Heads.random(p["heads"], 2, scale=p["head_scale"],
                             generator=torch.Generator().manual_seed(p["seed"] + 3), dtype=torch.float64).to(dtype)
    path2 = tp.sample_path(weight_process(p["process"], heads2, sigma=p["sigma"]), t1=p["n_t1"], dt=dt,
                           seed=p["seed"] + 4)
    z = tp.sphere.circle_grid(m, dtype=dtype)
    q0 = _density(torch.atan2(z[:, 1], z[:, 0]).double()).to(dtype)
    q0 = q0 / q0.sum()
    eps_grid = (p["grid_eps_factor"] * 2 * math.pi / m) ** 2
    steps2 = _whole(p["n_t1"], nt, "n_t1")

    def eulerian():
        tr = tp.jko(None, path2, tau=nt, steps=steps2, scheme="eulerian", grid=z, grid_weights=q0, eps=eps_grid,
                    direction=p["direction"], progress=run.progress)
        return {"w": tr.weights[-1], "mass_error": float((tr.weights.sum(-1) - 1).abs().max()),
                "min_weight": float(tr.weights.min()), "max_defect": tr.stats["max_defect"],
                "max_residual": tr.stats["max_residual"]}

    eul = cached(run, "eulerian", eulerian, logger, timed=True)
    walls["eulerian"] = eul["wall"]
    metrics.update(eulerian_mass_error=eul["mass_error"], eulerian_min_weight=eul["min_weight"],
                   eulerian_max_defect=eul["max_defect"], eulerian_eps=eps_grid)
    Ns = sorted(p["n_sweep"])
    w2_jko, w2_part = [], []
    for N in Ns:
        def piece(N=N):
            xN = quantile_tokens(N, dtype=dtype)
            t = time.perf_counter()
            lag = tp.jko(xN, path2, tau=nt, steps=steps2, transport="identity", direction=p["direction"]).x[-1]
            t_l = time.perf_counter() - t
            part = tp.solve(tp.Model(path2, normalization="effective", direction=p["direction"]), xN, tp.RK4(),
                            t1=p["n_t1"], dt=dt, ledger=tp.LedgerOptions(diagnostics=False)).x[-1]
            return {"jko": lag, "particles": part, "wall": t_l}
        res = cached(run, f"n_sweep_N{N}", piece, logger)
        walls[f"n_sweep_N{N}"] = res["wall"]
        w2_jko.append(float(tp.distance(res["jko"], (z, eul["w"]))))
        w2_part.append(float(tp.distance(res["particles"], (z, eul["w"]))))
    run.save_series("n_convergence", {"N": Ns, "w2_jko_vs_eulerian": w2_jko, "w2_particles_vs_eulerian": w2_part})
    metrics["n_slope_jko_vs_eulerian"] = fit_slope(Ns, w2_jko)
    metrics["w2_jko_vs_eulerian"] = dict(zip([str(N) for N in Ns], w2_jko))
    metrics["w2_particles_vs_eulerian"] = dict(zip([str(N) for N in Ns], w2_part))
    return {"Ns": Ns, "w2_jko": w2_jko, "w2_part": w2_part}


def _figure(run, p, data: Dict, metrics) -> None:
    """The four-panel figure of the series in ``data``; its caption (drawn under it) goes to
    metrics["figure_captions"]."""
    space = sphere_name(p["d"])
    taus, tau_err, Ns, w2_jko = data["taus"], data["tau_err"], data["Ns"], data["w2_jko"]
    fig, ax = subplots(2, 2, (11.5, 8.8), gridspec_kw={"hspace": 0.72, "wspace": 0.28})
    panel_style = dict(legend=dict(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False, ncol=2),
                       title_size=10)  # of every panel
    styles = {"identity": ("-", "o", 2.4), "emd": ("--", "s", 1.4), "sinkhorn": (":", "^", 1.4)}
    a = ax[0, 0]
    for k, v in data["curves"].items():
        ls, _, lw = styles.get(k, ("-", "o", 1.4))
        a.plot(data["t_curve"], v, ls=ls, lw=lw, label=f"{k} transport")
    panel(a, "t", "$W_2$(JKO, particles)", f"(a) {space}, n = {p['n']}: JKO with τ = {min(taus):g} vs particles",
          **panel_style)
    a = ax[0, 1]
    for k, v in tau_err.items():
        if len(v) == len(taus):
            ls, mk, lw = styles.get(k, ("-", "o", 1.4))
            a.loglog(taus, v, ls=ls, marker=mk, lw=lw,
                     label=f"{k}: slope {metrics.get(f'tau_slope_{k}', float('nan')):.2f}")
    a.loglog(taus, [tau_err[next(iter(tau_err))][-1] * t / taus[-1] for t in taus], "k:", label="order 1 (∝ τ)")
    log_ticks(a, taus)
    panel(a, "JKO step τ", f"$W_2$(JKO, particles) at t = {p['t1']:g}", f"(b) {space}: convergence in τ", **panel_style)
    a = ax[1, 0]
    a.loglog(Ns, w2_jko, "o-", label=f"Lagrangian JKO: slope {metrics['n_slope_jko_vs_eulerian']:.2f}")
    a.loglog(Ns, data["w2_part"], "s--", label="particle ODE")
    a.loglog(Ns, [w2_jko[0] * Ns[0] / N for N in Ns], "k:", label="∝ 1/N")
    log_ticks(a, Ns)
    panel(a, "N tokens (quantiles of a smooth ρ₀ on S¹)", f"$W_2$(·, Eulerian JKO) at t = {p['n_t1']:g}",
          f"(c) S¹: N tokens vs the Eulerian density (grid {p['grid']})", **panel_style)
    a = ax[1, 1]
    a.loglog(data["eps_vals"], data["eps_err"], "o-", label="Sinkhorn JKO vs emd JKO (symmetric cost)")
    log_ticks(a, data["eps_vals"])
    panel(a, "Sinkhorn ε", f"$W_2$(Sinkhorn JKO, emd JKO) at t = {p['t1']:g}",
          f"(d) {space}: convergence in ε (τ = {p['eps_tau']:g})", **panel_style)
    fig.suptitle(f"JKO vs particles: one {p['process']} weight path Θ replayed by every solver, H = {p['heads']}, "
                 f"{p['direction']}", fontsize=11)
    caption = (f"One weight path Θ ({p['process']}), deterministic solvers: no bands or error bars. (a) W₂ between the "
               f"token measures of the JKO scheme (τ = {min(taus):g}) and of the particle ODE (RK4, dt = "
               f"{p['ref_dt']:g}) over time; the three transports give nearly the same tokens (the curves overlap). "
               f"(b) the same W₂ at t = {p['t1']:g} against τ (dotted: order 1). (c) on S¹: N quantile tokens of a "
               f"smooth density, Lagrangian JKO (identity) and particle ODE, W₂ to the Eulerian JKO density on "
               f"{p['grid']} grid points (same Θ path, τ = {p['n_tau']:g}; dotted: 1/N). (d) W₂ at t = {p['t1']:g} "
               f"between the Sinkhorn JKO at ε and the emd JKO with the same symmetric cost.")
    save_captioned(run, fig, "jko_vs_particles", caption, metrics)
