"""Noisy tokens: the phase transition of the uniform state (docs/noisy_tokens.md).

Tokens follow dX = V dt + √(2T) ∘ dB on S^{d−1} with one isotropic head A = V = λI (ascent, so tokens
attract).  :func:`transformer_pde.analysis.theory.critical_temperature` predicts the temperature T_c below which
the uniform measure is linearly unstable.  The study measures, against the closed forms:

* |m| at stationarity (m = (1/N)Σ_i x_i, time average over the second half of the run) across T/T_c, for
  particle ensembles of several N, on S¹ and S² — and, when ``eulerian`` is on, the stationary |m| of the
  Fokker–Planck JKO (``tp.jko(..., scheme="eulerian", temperature=T)``) on a circle grid;
* N·E|m|² above T_c against T/(T − T_c) (:func:`transformer_pde.analysis.theory.susceptibility`);
* the growth rate of ⟨m⟩ from a slightly tilted uniform start, above and below T_c, against
  r_1 = (d−1)(T_c − T) (:func:`transformer_pde.analysis.theory.mode_growth_rates`);
* a T sweep up and down for the unnormalised head at β above
  :func:`transformer_pde.analysis.theory.first_order_beta` (first-order transition: hysteresis) and below it
  (continuous: none): stages of length ∝ 1/|r_1(T)| (capped), from the stationary states, averaged over
  seeds, with the loop area against the mean-field loop of a spectral Fokker–Planck branch;
* constant vs OU vs oscillating β_t at T slightly above T_c(β̄): the time-averaged rate of
  :func:`transformer_pde.analysis.theory.noise.ou_averaged_growth_rate` / ``oscillating_averaged_growth_rate``
  decides whether the uniform state survives.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import noise as tn
from transformer_pde.analysis.theory.circle import (  # noqa: F401  (re-exported: the study's public tools)
    MF_DT_MAX, MF_MODES, calibrated_temperature, circle_cell_masses, circle_quantile, circle_turns, circle_w2,
    fokker_planck_circle, fokker_planck_stable_dt)

from . import Option, at_least, cached, nonnegative, panel, positive, save_captioned, sphere_name, study, subplots, dtype_of
from .claims import bootstrap_interval, claim, ensemble
from .noisy_hysteresis import hysteresis, hysteresis_claims, hysteresis_figure

__all__ = ["run_noisy", "calibrated_temperature", "fokker_planck_stable_dt", "fokker_planck_circle",
           "circle_cell_masses", "circle_turns", "circle_quantile", "circle_w2"]

log = logging.getLogger(__name__)

OPTIONS = {
    "dims": Option([2, 3], (list,), "ambient dimensions d (tokens on S^{d-1})", check=lambda v: None if v and all(
        isinstance(k, int) and k >= 2 for k in v) else "must be a non-empty list of ints >= 2"),
    "beta": Option(1.0, (float,), "inverse temperature β of the softmax head λI", check=positive),
    "lam": Option(1.0, (float,), "head strength λ (A = V = λI)", check=positive),
    "ns": Option([500, 2000, 8000], (list,), "token counts N of the |m| sweep on S¹", check=positive),
    "ns_high_d": Option([500, 2000], (list,), "token counts N of the |m| sweep for d >= 3", check=positive),
    "ratios": Option([0.5, 0.75, 0.9, 1.1, 1.5, 2.0], (list,), "temperatures T/T_c of the |m| sweep",
                     check=positive),
    "t1": Option(20.0, (float,), "horizon of the |m| sweep (average over t >= t1/2)", check=positive),
    "dt": Option(0.05, (float,), "time step (Euler–Maruyama)", check=positive),
    "paths": Option(2, (int,), "noise paths per (N, T) of the |m| sweep", check=positive),
    "sus_n": Option(500, (int,), "N of the susceptibility runs", check=positive),
    "sus_ratios": Option([1.5, 2.0, 4.0], (list,), "T/T_c (> 1) of the susceptibility runs", check=positive),
    "sus_t1": Option(40.0, (float,), "horizon of the susceptibility runs (average over t >= sus_t1/4)",
                     check=positive),
    "sus_paths": Option(24, (int,), "paths of the susceptibility runs", check=positive),
    "sus_dt": Option(0.0, (float,), "time step of the susceptibility runs (0: dt); the scheme's weak bias lowers "
                     "the effective temperature by O(T·dt), which N·E|m|² near T_c amplifies", check=nonnegative),
    "rate_n": Option(4000, (int,), "N of the growth-rate runs", check=positive),
    "rate_ratios": Option([0.5, 1.5], (list,), "T/T_c of the growth-rate runs", check=positive),
    "rate_t1": Option(2.0, (float,), "fit window [0, rate_t1] of log⟨m⟩", check=positive),
    "rate_eps": Option(0.1, (float,), "tilt of the initial uniform tokens (x ↦ (u + εe)/|u + εe|)",
                       check=positive),
    "rate_paths": Option(32, (int,), "paths of the growth-rate runs (bootstrap over them)", check=at_least(8)),
    "hyst_betas": Option([1.0, 4.0], (list,), "β of the unnormalised hysteresis sweeps (d = 2)", check=positive),
    "hyst_ratios": Option([0.85, 0.95, 1.03, 1.06, 1.1, 1.25], (list,), "T/T_c stages of the sweep (increasing)",
                          check=positive),
    "hyst_n": Option(200, (int,), "N of the hysteresis sweeps (when hyst_ns is empty)", check=positive),
    "hyst_ns": Option([], (list,), "several N of the hysteresis sweeps (empty: [hyst_n])", check=lambda v: None if all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 2 for k in v) and len(set(v)) == len(v) else
        "must be a list of distinct integers >= 2"),
    "hyst_paths": Option(8, (int,), "independent sweeps (seeds) per direction and β", check=at_least(2)),
    "hyst_efolds": Option(2.0, (float,), "stage length = hyst_efolds / |r_1(T)| (mode_growth_rates), clipped",
                          check=positive),
    "hyst_stage_min": Option(6.0, (float,), "shortest stage, in units of 1/T_c", check=positive),
    "hyst_stage_max": Option(20.0, (float,), "longest stage (near T_c), in units of 1/T_c", check=positive),
    "hyst_dt": Option(0.05, (float,), "time step of the sweeps in units of 1/T_c (Heun; calibrated temperature)",
                      check=positive),
    "weights_n": Option(1000, (int,), "N of the constant / OU / oscillating β_t runs", check=positive),
    "weights_t1": Option(40.0, (float,), "horizon of the β_t runs", check=positive),
    "weights_ratio": Option(1.05, (float,), "T / T_c(β̄) of the β_t runs", check=positive),
    "weights_amplitude": Option(1.5, (float,), "amplitude of the oscillating β_t = β̄ + a sin t", check=nonnegative),
    "weights_sigma": Option(1.5, (float,), "σ of the OU β_t (rate 1, mean β̄)", check=nonnegative),
    "weights_beta": Option(2.0, (float,), "β̄ of the β_t runs", check=positive),
    "weights_paths": Option(8, (int,), "token-noise paths of the β_t runs (one β_t path)", check=positive),
    "eulerian": Option(True, (bool,), "also run the Fokker–Planck JKO on a circle grid (S¹)"),
    "grid": Option(48, (int,), "circle grid size of the Eulerian JKO", check=at_least(16)),
    "jko_eps": Option(0.02, (float,), "entropic ε of the Eulerian JKO (≳ grid spacing²)", check=positive),
    "tau": Option(0.1, (float,), "JKO step τ", check=positive),
    "jko_steps": Option(100, (int,), "JKO steps", check=positive),
    "seed": Option(0, (int,), "seed (tokens use seed + 1, token noise a stream derived from the seed)"),
    "figures": Option(True, (bool,), "write the figures"),
}


def _m(x, w):
    return x.mean(-2)


def _uniform(n, d, dtype, seed):
    if d == 2:
        return tp.sphere.circle_grid(n, dtype=dtype)
    if d == 3:
        return tp.sphere.fibonacci_sphere(n, dtype=dtype)
    return tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _ascent(theta, T) -> tp.Model:
    """The noisy ascent flow of the study: softmax heads ``theta`` at temperature T."""
    return tp.Model(theta, normalization="softmax", direction="ascent", temperature=T)


def _stationary(p, model, shape, *, t1, paths, tag, run, x0=None, dt=None):
    """time series of |m| (T, paths) and N·|m|² for one (d, N, T) ensemble, cached; ``shape`` = (N, d, dtype) of
    the uniform initial tokens (unless ``x0`` is given)."""
    def compute():
        x = _uniform(*shape, p["seed"] + 1) if x0 is None else x0
        tr = tp.solve(model, x, tp.Euler(), t1=t1, dt=dt or p["dt"], paths=paths, seed=p["seed"],
                      saveat=tp.SaveAt(record_every=max(1, round(0.25 / (dt or p["dt"]))), observables={"m": _m}),
                      ledger=tp.LedgerOptions(diagnostics=False))
        m = tr.observables["m"].double()
        return {"t": tr.times.double(), "m": m, "x_final": tr.final}

    return cached(run, tag, compute, log)


def _time_mean(t, v, t_min):
    keep = t >= t_min - 1e-12
    return v[keep].mean(0)


@study("noisy_transition", OPTIONS, "noisy tokens: |m| across T_c, susceptibility, growth rates, hysteresis, β_t")
def run_noisy(params, run):
    p = params
    dtype = dtype_of(p)
    metrics, figs, claims = {"closed_forms": {}}, {}, []
    lam, beta = p["lam"], p["beta"]

    # ---- |m| across T_c ------------------------------------------------------------------------------------
    sweep, sweep_se = {}, {}
    for d in p["dims"]:
        Tc = tp.theory.critical_temperature(beta, d, lambdas=(lam,))
        metrics["closed_forms"][f"Tc_d{d}"] = Tc
        heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), d, beta=beta)
        for n in (p["ns"] if d == 2 else p["ns_high_d"]):
            row = []
            for r in p["ratios"]:
                res = _stationary(p, _ascent(heads, r * Tc), (n, d, dtype), t1=p["t1"], paths=p["paths"],
                                  tag=f"m_d{d}_n{n}_r{r:g}", run=run)
                am = _time_mean(res["t"], res["m"].norm(dim=-1), p["t1"] / 2)
                row.append(float(am.mean()))
                v, e, k = ensemble(am.tolist()) if am.numel() > 1 else (float(am), float("nan"), 1)
                sweep_se.setdefault((d, n), []).append(e)
                claims.append(claim(f"|m| stationary, {sphere_name(d)}, N={n}, T/T_c={r:g}", v, e, k))
            sweep[(d, n)] = row
            metrics[f"abs_m_d{d}_n{n}"] = dict(zip([f"{r:g}" for r in p["ratios"]], row))
    if p["eulerian"] and 2 in p["dims"]:
        metrics["abs_m_eulerian_d2"] = _eulerian_sweep(p, dtype, run, metrics)

    # ---- susceptibility ---------------------------------------------------------------------------------------
    sus = {}
    for d in p["dims"]:
        Tc = metrics["closed_forms"][f"Tc_d{d}"]
        heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), d, beta=beta)
        rows = []
        for r in p["sus_ratios"]:
            sdt = p["sus_dt"] or p["dt"]
            res = _stationary(p, _ascent(heads, r * Tc), (p["sus_n"], d, dtype), t1=p["sus_t1"], paths=p["sus_paths"],
                              tag=f"sus_d{d}_r{r:g}" + (f"_dt{sdt:g}" if p["sus_dt"] else ""), run=run, dt=sdt)
            m2 = p["sus_n"] * (res["m"] ** 2).sum(-1)  # (T, paths)
            per_path = _time_mean(res["t"], m2, p["sus_t1"] / 4)
            meas, se = float(per_path.mean()), float(per_path.std() / math.sqrt(per_path.numel()))
            want = tp.theory.susceptibility(beta, d, r * Tc, lambdas=(lam,)) if r > 1 else float("nan")
            rows.append((r, meas, se, want))
            claims.append(claim(f"N E|m|^2, {sphere_name(d)}, N={p['sus_n']}, T/T_c={r:g}", meas, se, per_path.numel(),
                                reference=want, holds=None if r <= 1 else bool(abs(meas - want) <= 2 * se)))
        sus[d] = rows
        metrics[f"susceptibility_d{d}"] = [{"T_over_Tc": r, "measured": m, "stderr": s, "closed_form": w}
                                           for r, m, s, w in rows]

    # ---- growth rate of the first mode ------------------------------------------------------------------------
    rates = {}
    for d in p["dims"]:
        Tc = metrics["closed_forms"][f"Tc_d{d}"]
        heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), d, beta=beta)
        e = torch.zeros(d, dtype=dtype)
        e[0] = 1.0
        x0 = tp.sphere.normalize(_uniform(p["rate_n"], d, dtype, p["seed"] + 1) + p["rate_eps"] * e)
        rows = []
        for r in p["rate_ratios"]:
            T = r * Tc
            res = _stationary(p, _ascent(heads, T), (p["rate_n"], d, dtype), t1=p["rate_t1"], paths=p["rate_paths"],
                              tag=f"rate_d{d}_r{r:g}", run=run, x0=x0, dt=min(p["dt"], 0.02))
            tt = res["t"].numpy()
            proj = res["m"][..., 0].T.numpy()  # (paths, times): m·e per path

            def fit(v, tt=tt):  # log-linear fit of the path-mean ⟨m·e⟩
                me = v.mean(0)
                return float(np.polyfit(tt, np.log(np.abs(me)), 1)[0]) if (me > 0).all() else float("nan")

            slope, half = bootstrap_interval(proj, fit, seed=p["seed"])
            want = float(tn.mode_growth_rates(beta, d, T, 1, lambdas=(lam,))[1])
            rows.append((r, slope, want, half))
            claims.append(claim(f"mode-1 growth rate, {sphere_name(d)}, N={p['rate_n']}, T/T_c={r:g}", slope, half,
                                proj.shape[0], reference=want, holds=bool(abs(slope - want) <= half)))
        rates[d] = rows
        metrics[f"mode1_rate_d{d}"] = [{"T_over_Tc": r, "measured": s, "closed_form": w, "ci95_half_width": h}
                                       for r, s, w, h in rows]

    # ---- hysteresis (unnormalised, S¹) --------------------------------------------------------------------------
    hyst = {}
    for hb in p["hyst_betas"]:
        for n in (p["hyst_ns"] or [p["hyst_n"]]):
            hyst[(hb, n)] = hysteresis(p, hb, n, dtype, run)
            metrics[f"hysteresis_beta{hb:g}_n{n}"] = hyst[(hb, n)]
    claims.extend(hysteresis_claims(hyst))
    metrics["closed_forms"]["first_order_beta_d2"] = tn.first_order_beta(2)
    metrics["closed_forms"]["first_order_beta_d3"] = tn.first_order_beta(3)

    # ---- constant vs OU vs oscillating β_t -------------------------------------------------------------------
    metrics["weights"], wseries = _weights(p, dtype, run)

    # ---- summary ---------------------------------------------------------------------------------------------
    summ = []
    for d in p["dims"]:
        ns = p["ns"] if d == 2 else p["ns_high_d"]
        summ.append(f"d={d}: T_c = {metrics['closed_forms'][f'Tc_d{d}']:.4f}; |m| at T/T_c = "
                    + ", ".join(f"{r:g}: " + "/".join(f"{sweep[(d, n)][i]:.3f}" for n in ns)
                                for i, r in enumerate(p["ratios"])) + f" (N = {'/'.join(map(str, ns))})")
        summ.append(f"d={d}: N·E|m|² " + ", ".join(f"T/T_c={r:g}: {m:.3f} ± {s:.3f} (closed form {w:.3f})"
                                                  for r, m, s, w in sus[d]))
        summ.append(f"d={d}: mode-1 rate " + ", ".join(f"T/T_c={r:g}: {s:+.4f} ± {h:.4f} (95 % bootstrap; closed form "
                                                      f"{w:+.4f})" for r, s, w, h in rates[d]))
    for (hb, n), h in sorted(hyst.items()):
        summ.append(f"hysteresis β={hb:g}, N={n} (unnormalised, S¹, first order: {h['first_order']}): loop area "
                    f"{h['area']:.4f} ± {h['area_stderr']:.4f} over {h['paths']} seeds (stationary mean field "
                    f"{h['area_mean_field']:.4f}, finite-stage mean field {h['area_finite_stage']:.4f})")
    for c in claims:
        if "spinodal" in c["name"] or "contrast" in c["name"]:
            summ.append(f"{c['name']}: {c['value']:.4f} ± {c['error']:.2g}")
    for k, v in metrics["weights"].items():
        summ.append(f"β_t {k}: |m| = {v['abs_m']:.3f} ± {v['abs_m_stderr']:.3f} ({v['paths']} paths), time-averaged "
                    f"mode-1 rate {v['averaged_rate']:+.4f}")
        claims.append(claim(f"beta_t {k}: stationary |m| at T = {p['weights_ratio']:g} T_c(mean beta)", v["abs_m"],
                            v["abs_m_stderr"], v["paths"], reference=None, holds=None,
                            averaged_rate=v["averaged_rate"]))
    metrics["claims"] = claims
    metrics["summary"] = summ
    if p["figures"]:
        _figures(p, metrics, (sweep, sweep_se), sus, rates, hyst, wseries, run)
    return metrics


def _weights(p, dtype, run):
    """Constant, OU and oscillating β_t (A = I) at T = ratio·T_c(β̄) on S¹: measured |m| and averaged rate."""
    d, bbar, n = 2, p["weights_beta"], p["weights_n"]
    Tc = tp.theory.critical_temperature(bbar, d)
    T = p["weights_ratio"] * Tc
    dt, t1 = p["dt"], p["weights_t1"]
    K = round(t1 / dt)
    t = torch.arange(K + 1, dtype=torch.float64) * dt
    g = torch.Generator().manual_seed(p["seed"] + 7)
    # OU β_t: exact transitions, stationary start
    kappa, sig = 1.0, p["weights_sigma"]
    sd = sig / math.sqrt(2 * kappa)
    ou = torch.empty(K + 1, dtype=torch.float64)
    ou[0] = bbar + sd * torch.randn((), generator=g, dtype=torch.float64)
    a = math.exp(-kappa * dt)
    for k in range(K):
        ou[k + 1] = bbar + a * (ou[k] - bbar) + sd * math.sqrt(1 - a * a) * torch.randn((), generator=g,
                                                                                       dtype=torch.float64)
    # the study's weights model attractive attention (β > 0); the library accepts any real β (the repulsive
    # study), but here the rare excursions below 1e-3 are clipped and their fraction recorded
    ou_clipped = ou.clamp_min(1e-3)
    osc = bbar + p["weights_amplitude"] * torch.sin(t)
    osc = osc.clamp_min(1e-3)
    series = {"constant": torch.full_like(t, bbar), "ou": ou_clipped, "oscillating": osc}
    predicted = {"constant": float(tn.mode_growth_rates(bbar, d, T, 1)[1]),
                 "ou": tn.averaged_growth_rate(ou_clipped.numpy(), d, T, times=t.numpy()),
                 "oscillating": tn.averaged_growth_rate(osc.numpy(), d, T, times=t.numpy())}
    stationary_theory = {"ou": tn.ou_averaged_growth_rate(bbar, sig, kappa, d, T),
                         "oscillating": tn.oscillating_averaged_growth_rate(bbar, p["weights_amplitude"], d, T)}
    out = {}
    for name, b in series.items():
        layers = [tp.Heads.scalar(torch.ones(1, dtype=dtype), d, beta=float(bk)) for bk in b]
        proc = tp.Layerwise(layers, interpolation="linear", layer_time=dt)
        res = _stationary(p, _ascent(proc, T), (n, d, dtype), t1=t1, paths=p["weights_paths"], tag=f"weights_{name}",
                          run=run)
        per_path = _time_mean(res["t"], res["m"].norm(dim=-1), t1 / 2)
        am, am_se, _ = ensemble(per_path.tolist()) if per_path.numel() > 1 else (float(per_path), float("nan"), 1)
        out[name] = {"abs_m": am, "abs_m_stderr": am_se, "paths": int(per_path.numel()), "averaged_rate": predicted[name], "T": T, "Tc_mean_beta": Tc,
                     "stationary_law_rate": stationary_theory.get(name, predicted[name]),
                     "beta_clipped_fraction": float((b <= 1e-3).double().mean()),
                     "t": res["t"], "abs_m_series": res["m"].norm(dim=-1)[:, 0]}
    summary = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, torch.Tensor)} for k, v in out.items()}
    return summary, {k: (v["t"], v["abs_m_series"]) for k, v in out.items()}


def _eulerian_sweep(p, dtype, run, metrics):
    """Stationary |m| of the Fokker–Planck JKO on a circle grid, per T/T_c (unit mobility = unnormalised)."""
    d, dtype = 2, torch.float64  # the grid is small; the inner fixed point wants float64 tolerances
    # the Eulerian JKO is the W2 gradient flow of F = −E + T∫ρ log ρ: the unnormalised model
    Tc = tp.theory.critical_temperature(p["beta"], d, lambdas=(p["lam"],), normalization="unnormalized")
    metrics["closed_forms"]["Tc_unnormalized_d2"] = Tc
    z = tp.sphere.circle_grid(p["grid"], dtype=dtype)
    th = torch.atan2(z[:, 1], z[:, 0])
    q0 = 1 + 0.2 * torch.cos(th)
    q0 = q0 / q0.sum()
    heads = tp.Heads.scalar(torch.tensor([p["lam"]], dtype=dtype), d, beta=p["beta"])
    out = {}
    for r in p["ratios"]:
        def compute(r=r):
            tr = tp.jko(None, heads, tau=p["tau"], steps=p["jko_steps"], scheme="eulerian", grid=z, grid_weights=q0,
                        direction="ascent", mobility="unit", temperature=r * Tc, eps=p["jko_eps"], tol=1e-7,
                        max_iter=3000)
            w = tr.weights[-1]
            return {"m": (w.unsqueeze(-1) * z).sum(-2)}

        res = cached(run, f"eulerian_r{r:g}", compute, log)
        out[f"{r:g}"] = float(res["m"].norm())
    return out



def _figures(p, metrics, sweeps, sus, rates, hyst, ser, run):
    dims = p["dims"]
    sweep, sweep_se = sweeps
    fig, axs = subplots(1, len(dims), (5 * len(dims), 3.8), squeeze=False)
    for j, d in enumerate(dims):
        ax = axs[0, j]
        for n in (p["ns"] if d == 2 else p["ns_high_d"]):
            ax.errorbar(p["ratios"], sweep[(d, n)], yerr=[2 * e for e in sweep_se[(d, n)]], fmt="o-", capsize=2,
                        label=f"particles $N$ = {n}")
        if d == 2 and "abs_m_eulerian_d2" in metrics:
            e = metrics["abs_m_eulerian_d2"]
            ax.plot(p["ratios"], [e[f"{r:g}"] for r in p["ratios"]], "k*--",
                    label="Eulerian JKO (unnormalised, T/T_c of that model)")
        ax.axvline(1.0, color="0.5", ls=":")
        panel(ax, "$T/T_c$", "stationary $|m|$", rf"$S^{{{d - 1}}}$, "
              rf"softmax, $\beta$ = {p['beta']:g}, $\lambda$ = {p['lam']:g}", legend={"fontsize": 8})
    save_captioned(run, fig, "abs_m", f"Order parameter |m| = |(1/N)Σx_i| averaged over the second half of the run ({p['paths']} paths, "
                   "bars: 2 standard errors), against T/T_c with T_c = Σω A_d(βλ)/β (critical_temperature). Above T_c |m| ~ N^{-1/2}; "
                   "below it the tokens cluster.", metrics)

    fig, axs = subplots(1, 2, (10, 3.8), squeeze=False)
    for d in dims:
        r, m, s, w = zip(*sus[d])
        axs[0, 0].errorbar(r, m, yerr=[2 * x for x in s], fmt="o", label=f"measured {sphere_name(d)}")
        axs[0, 0].plot(r, w, "x--", label=f"$T/(T - T_c)$ {sphere_name(d)}")
        rr, meas, want, half = zip(*rates[d])
        axs[0, 1].errorbar(rr, meas, yerr=half, fmt="o", capsize=2, label=f"measured {sphere_name(d)}")
        axs[0, 1].plot(rr, want, "x--", label=f"$(d-1)(T_c - T)$ {sphere_name(d)}")
    panel(axs[0, 0], "$T/T_c$", r"$N\,\mathbb{E}|m|^2$", f"susceptibility, $N$ = {p['sus_n']}", legend={"fontsize": 8})
    panel(axs[0, 1], "$T/T_c$", r"growth rate of $\langle m \rangle$", f"mode 1, $N$ = {p['rate_n']}",
          legend={"fontsize": 8})
    save_captioned(run, fig, "susceptibility_rates", "Left: N·E|m|² at stationarity (2 standard errors) against "
                   "the closed form T/(T − T_c). Right: the fitted growth rate of the path-mean of m from a tilted "
                   f"uniform start ({p['rate_paths']} paths; bars: 95 % bootstrap interval over paths) against "
                   "r_1 = (d−1)(T_c − T).", metrics)

    hysteresis_figure(p, hyst, run, metrics)

    fig, axs = subplots(1, 1, (6, 3.6), squeeze=False)
    for name, (t, am) in ser.items():
        axs[0, 0].plot(t.numpy(), am.numpy(),
                       label=rf"{name} $\beta_t$ (avg rate {metrics['weights'][name]['averaged_rate']:+.3f})")
    panel(axs[0, 0], "time $t$", "$|m|$ (path 0)", rf"$S^1$, $T$ = {p['weights_ratio']:g} $T_c(\bar\beta$ = "
          rf"{p['weights_beta']:g}), $N$ = {p['weights_n']}", legend={"fontsize": 8})
    save_captioned(run, fig, "weights", "Constant vs OU vs oscillating β_t (A = I, softmax): the time-averaged "
                   "mode-1 rate (theory.noise.averaged_growth_rate of the realised β_t) decides whether the uniform "
                   "state survives.", metrics)
