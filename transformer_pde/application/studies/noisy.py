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

import functools
import logging
import math

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import noise as tn

from . import Option, at_least, cached, nonnegative, panel, positive, save_captioned, sphere_name, study, subplots, dtype_of

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
    "rate_paths": Option(8, (int,), "paths of the growth-rate runs", check=positive),
    "hyst_betas": Option([1.0, 4.0], (list,), "β of the unnormalised hysteresis sweeps (d = 2)", check=positive),
    "hyst_ratios": Option([0.85, 0.95, 1.03, 1.06, 1.1, 1.25], (list,), "T/T_c stages of the sweep (increasing)",
                          check=positive),
    "hyst_n": Option(200, (int,), "N of the hysteresis sweeps", check=positive),
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


def _stationary(p, d, n, T, dtype, *, heads, t1, paths, tag, run, x0=None, normalization="softmax", dt=None):
    """time series of |m| (T, paths) and N·|m|² for one (d, N, T) ensemble, cached."""
    def compute():
        x = _uniform(n, d, dtype, p["seed"] + 1) if x0 is None else x0
        tr = tp.simulate(x, heads, t1=t1, dt=dt or p["dt"], temperature=T, paths=paths, seed=p["seed"],
                         direction="ascent", normalization=normalization, diagnostics=False,
                         observables={"m": _m}, record_every=max(1, round(0.25 / (dt or p["dt"]))))
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
    metrics, figs = {"closed_forms": {}}, {}
    lam, beta = p["lam"], p["beta"]

    # ---- |m| across T_c ------------------------------------------------------------------------------------
    sweep = {}
    for d in p["dims"]:
        Tc = tp.theory.critical_temperature(beta, d, lambdas=(lam,))
        metrics["closed_forms"][f"Tc_d{d}"] = Tc
        heads = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), d, beta=beta)
        for n in (p["ns"] if d == 2 else p["ns_high_d"]):
            row = []
            for r in p["ratios"]:
                res = _stationary(p, d, n, r * Tc, dtype, heads=heads, t1=p["t1"], paths=p["paths"],
                                  tag=f"m_d{d}_n{n}_r{r:g}", run=run)
                am = _time_mean(res["t"], res["m"].norm(dim=-1), p["t1"] / 2)
                row.append(float(am.mean()))
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
            res = _stationary(p, d, p["sus_n"], r * Tc, dtype, heads=heads, t1=p["sus_t1"], paths=p["sus_paths"],
                              tag=f"sus_d{d}_r{r:g}" + (f"_dt{sdt:g}" if p["sus_dt"] else ""), run=run, dt=sdt)
            m2 = p["sus_n"] * (res["m"] ** 2).sum(-1)  # (T, paths)
            per_path = _time_mean(res["t"], m2, p["sus_t1"] / 4)
            meas, se = float(per_path.mean()), float(per_path.std() / math.sqrt(per_path.numel()))
            want = tp.theory.susceptibility(beta, d, r * Tc, lambdas=(lam,)) if r > 1 else float("nan")
            rows.append((r, meas, se, want))
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
            res = _stationary(p, d, p["rate_n"], T, dtype, heads=heads, t1=p["rate_t1"], paths=p["rate_paths"],
                              tag=f"rate_d{d}_r{r:g}", run=run, x0=x0, dt=min(p["dt"], 0.02))
            me = res["m"][..., 0].mean(-1)  # ⟨m·e⟩ over paths
            slope = float(np.polyfit(res["t"].numpy(), np.log(np.abs(me.numpy())), 1)[0])
            want = float(tn.mode_growth_rates(beta, d, T, 1, lambdas=(lam,))[1])
            rows.append((r, slope, want))
        rates[d] = rows
        metrics[f"mode1_rate_d{d}"] = [{"T_over_Tc": r, "measured": s, "closed_form": w} for r, s, w in rows]

    # ---- hysteresis (unnormalised, S¹) --------------------------------------------------------------------------
    hyst = {}
    for hb in p["hyst_betas"]:
        hyst[hb] = _hysteresis(p, hb, dtype, run)
        metrics[f"hysteresis_beta{hb:g}"] = {k: v for k, v in hyst[hb].items() if k not in ("up_paths", "down_paths")}
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
        summ.append(f"d={d}: mode-1 rate " + ", ".join(f"T/T_c={r:g}: {s:+.4f} (closed form {w:+.4f})"
                                                      for r, s, w in rates[d]))
    for hb, h in hyst.items():
        summ.append(f"hysteresis β={hb:g} (unnormalised, S¹, first order: {h['first_order']}): loop area "
                    f"∫(|m|_up − |m|_down) d(T/T_c) = {h['area']:.4f} ± {h['area_stderr']:.4f} over {h['paths']} "
                    f"seeds (mean field {h['area_mean_field']:.4f}); largest gap {max(h['gap']):.3f}")
    if len(hyst) >= 2:
        (b0, h0), (b1, h1) = sorted(hyst.items())[0], sorted(hyst.items())[-1]
        se = math.hypot(h0["area_stderr"], h1["area_stderr"])
        metrics["hysteresis_contrast"] = {"betas": [b0, b1], "area_difference": h1["area"] - h0["area"],
                                          "stderr": se, "z": (h1["area"] - h0["area"]) / max(se, 1e-300)}
        summ.append(f"hysteresis contrast: area(β={b1:g}) − area(β={b0:g}) = {h1['area'] - h0['area']:.4f} ± "
                    f"{se:.4f} ({(h1['area'] - h0['area']) / max(se, 1e-300):.1f} standard errors)")
    for k, v in metrics["weights"].items():
        summ.append(f"β_t {k}: |m| = {v['abs_m']:.3f}, time-averaged mode-1 rate {v['averaged_rate']:+.4f}")
    metrics["summary"] = summ
    if p["figures"]:
        _figures(p, metrics, sweep, sus, rates, hyst, wseries, run)
    return metrics


def calibrated_temperature(T: float, dt: float) -> float:
    """The temperature T' at which the S¹ noise step of ``tp.simulate`` (angle increment atan(√(2T'dt) z),
    z ~ N(0, 1): the projective retraction of docs/noisy_tokens.md) has the variance 2T·dt of the exact
    Brownian increment.  Removes the O(T·dt) lowering of the effective temperature (Gauss–Hermite, 80 nodes).

    Parameters
    ----------
    T : float
        target temperature, > 0.
    dt : float
        time step, > 0.

    Returns
    -------
    float
        T' ≥ T.
    """
    from scipy.optimize import brentq
    z, w = np.polynomial.hermite_e.hermegauss(80)
    w = w / w.sum()

    def gap(tp_):
        return float((w * np.arctan(math.sqrt(2 * tp_ * dt) * z) ** 2).sum()) - 2 * T * dt

    hi = 2 * T
    while gap(hi) < 0:
        if hi > 1e6 * T:
            raise ValueError(f"2·T·dt = {2 * T * dt} is too large for the noise step (its variance is < π²/4); "
                             "take a smaller dt")
        hi *= 2
    return float(brentq(gap, T, hi, xtol=1e-14 * T))


#: Fourier grid of the mean-field Fokker–Planck reference of the hysteresis loop, and its largest step
_MF_MODES, _MF_DT_MAX = 128, 0.02


def fokker_planck_stable_dt(beta: float, lam: float, modes: int, dt_max: float, safety: float = 0.5) -> float:
    """A step of :func:`fokker_planck_circle` inside the stability region of its RK4 stages.

    The drift is bounded by v_max = (1/β) max_u βλ sin u e^{βλ cos u} = λ sin u* e^{βλ cos u*} with
    cos u* = (√(1 + 4a²) − 1)/(2a), a = βλ (the kernel's derivative is largest there, whatever ρ is), and
    the advection of the highest kept mode k_c = M/3 has eigenvalues up to i k_c v_max; RK4 is stable
    on the imaginary axis up to 2√2.  Returns min(dt_max, safety · 2√2 / (k_c v_max)) (the diffusion is
    integrated exactly by the integrating factor and sets no limit)."""
    a = beta * lam
    cu = (math.sqrt(1 + 4 * a * a) - 1) / (2 * a) if a > 0 else 0.0
    vmax = abs(lam) * math.sqrt(max(0.0, 1 - cu * cu)) * math.exp(a * cu)
    kc = (2 * int(modes)) // 6
    return min(dt_max, safety * 2 * math.sqrt(2) / max(kc * vmax, 1e-300))


def _mf_grid(hb, Tc):
    """(step, horizon 60/T_c rounded to a multiple of it) of the mean-field reference at β = hb."""
    dt = fokker_planck_stable_dt(hb, 1.0, _MF_MODES, _MF_DT_MAX)
    return dt, round(60 / Tc / dt) * dt


@functools.lru_cache(maxsize=16)
def _cluster_density_cached(hb, Tc, ratio):
    dt, t = _mf_grid(hb, Tc)
    out = fokker_planck_circle(lambda th: np.exp(8 * np.cos(th)), [t], beta=hb, lam=1.0, T=ratio * Tc,
                               modes=_MF_MODES, dt=dt)[t]
    out.setflags(write=False)
    return out


def _cluster_density(hb, Tc, ratio):
    """Mean-field stationary clustered density (Fourier coefficients) at T = ratio·T_c: the spectral
    Fokker–Planck solution from a tight cluster after 60/T_c (computed once per process and argument)."""
    return _cluster_density_cached(float(hb), float(Tc), float(ratio)).copy()


def _sample_density(coef, shape, rng):
    """iid angles (radians) from the density Σ c_k e^{ikθ} (4096 exact cells, uniform within a cell)."""
    m = 4096
    cdf = np.cumsum(circle_cell_masses(coef, m))
    cdf = cdf / cdf[-1]
    u = rng.random(shape)
    return 2 * math.pi * (np.searchsorted(cdf, u).clip(max=m - 1) + rng.random(shape) - 0.5) / m


def _hysteresis(p, hb, dtype, run):
    """T/T_c swept up (from the stationary cluster) and down (from iid uniform tokens), hyst_paths seeds each.

    Stage k lasts clip(hyst_efolds/|r_1(T_k)|, hyst_stage_min/T_c, hyst_stage_max/T_c) (critical slowing down:
    longer near T_c); |m| is averaged over its second half.  Loop area = trapezoid ∫(|m|_up − |m|_down) d(T/T_c)
    per seed; the mean-field loop comes from the spectral Fokker–Planck branch (up: continued from the cluster;
    down: uniform above T_c, the cluster below)."""
    d, n, P = 2, p["hyst_n"], p["hyst_paths"]
    Tc = tp.theory.critical_temperature(hb, d, lambdas=(1.0,), normalization="unnormalized")
    ratios = sorted(p["hyst_ratios"])
    heads = tp.Heads.scalar(torch.tensor([1.0], dtype=dtype), d, beta=hb)
    dt = p["hyst_dt"] / Tc
    lengths = []
    for r in ratios:
        rate = abs(float(tn.mode_growth_rates(hb, d, r * Tc, 1, lambdas=(1.0,), normalization="unnormalized")[1]))
        L = min(max(p["hyst_efolds"] / max(rate, 1e-300), p["hyst_stage_min"] / Tc), p["hyst_stage_max"] / Tc)
        lengths.append(max(2, round(L / dt)) * dt)

    def compute():
        rng = np.random.default_rng(p["seed"] + 11)
        start = {"up": _sample_density(_cluster_density(hb, Tc, ratios[0]), (P, n), rng),
                 "down": rng.random((P, n)) * 2 * math.pi}
        out = {}
        for j, direction in enumerate(("up", "down")):
            a = start[direction]
            x = torch.tensor(np.stack([np.cos(a), np.sin(a)], -1), dtype=dtype)
            order = range(len(ratios)) if direction == "up" else range(len(ratios) - 1, -1, -1)
            vals = {}
            for k in order:
                T = ratios[k] * Tc
                tr = tp.simulate(x, heads, t1=lengths[k], dt=dt, temperature=calibrated_temperature(T, dt),
                                 seed=p["seed"] + 1000 * (j + 1) + k, method="heun", direction="ascent",
                                 normalization="unnormalized", diagnostics=False, observables={"m": _m},
                                 record_every=max(1, round(0.5 / Tc / dt)))
                x = tr.final
                am = tr.observables["m"].double().norm(dim=-1)  # (times, P)
                vals[k] = _time_mean(tr.times.double(), am, lengths[k] / 2)
            out[direction] = torch.stack([vals[k] for k in range(len(ratios))], -1)  # (P, K)
        return out

    res = cached(run, f"hyst2_b{hb:g}", compute, log)
    up, down = res["up"].numpy(), res["down"].numpy()
    areas = np.trapezoid(up - down, ratios, axis=-1)  # (P,)
    # mean field: the clustered branch continued upwards; the uniform branch is exactly stationary above T_c
    (dt_mf, t_mf), mf_up, coef = _mf_grid(hb, Tc), [], None
    for r in ratios:
        coef = _cluster_density(hb, Tc, r) if coef is None else fokker_planck_circle(
            coef, [t_mf], beta=hb, lam=1.0, T=r * Tc, modes=_MF_MODES, dt=dt_mf)[t_mf]
        mf_up.append(float(2 * math.pi * abs(coef[1])))
    mf_down = [0.0 if r > 1 else u for r, u in zip(ratios, mf_up)]
    return {"Tc": Tc, "first_order": bool(tn.landau_coefficient(hb, 2) < 0), "ratios": ratios,
            "stage_lengths_Tc_units": [L * Tc for L in lengths], "dt_Tc_units": p["hyst_dt"], "n": n, "paths": P,
            "up": up.mean(0).tolist(), "down": down.mean(0).tolist(),
            "up_stderr": (up.std(0, ddof=1) / math.sqrt(P)).tolist(),
            "down_stderr": (down.std(0, ddof=1) / math.sqrt(P)).tolist(),
            "gap": (up - down).mean(0).tolist(), "area": float(areas.mean()),
            "area_stderr": float(areas.std(ddof=1) / math.sqrt(P)),
            "mean_field_up": mf_up, "mean_field_down": mf_down,
            "area_mean_field": float(np.trapezoid(np.subtract(mf_up, mf_down), ratios)),
            "up_paths": up, "down_paths": down}


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
    # β must stay > 0 for the library's heads: clip the (rare) excursions and say so
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
        res = _stationary(p, d, n, T, dtype, heads=proc, t1=t1, paths=1, tag=f"weights_{name}", run=run)
        am = float(_time_mean(res["t"], res["m"].norm(dim=-1), t1 / 2).mean())
        out[name] = {"abs_m": am, "averaged_rate": predicted[name], "T": T, "Tc_mean_beta": Tc,
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



# ---------------------------------------------------------------------------- measurement tools on S¹
def circle_turns(x) -> np.ndarray:
    """Angles of points x (n, 2) on S¹ in turns, in [0, 1) (float64 numpy)."""
    x = torch.as_tensor(x).detach().cpu().double().numpy()
    if x.ndim != 2 or x.shape[-1] != 2:
        raise ValueError(f"points on S¹ must have shape (n, 2), got {tuple(x.shape)}")
    return np.mod(np.arctan2(x[:, 1], x[:, 0]) / (2 * math.pi), 1.0)


def circle_quantile(turns, weights=None, *, cells: bool = False):
    """Quantile function of a measure on S¹ = ℝ/ℤ (angles in turns) as knots (t, q), piecewise linear.

    ``cells=False``: atoms of mass ``weights`` at ``turns`` (q is a step function: pairs of knots at
    each jump).  ``cells=True``: a piecewise-constant density, the mass w_k spread uniformly over the
    cell of point k (boundaries halfway between neighbouring points, as on ``tp.sphere.circle_grid``).

    Parameters
    ----------
    turns : array_like
        (n,) angles in turns (any real numbers; taken modulo 1).
    weights : array_like, optional
        (n,) masses ≥ 0 (default uniform); normalised to 1.
    cells : bool
        atoms (False) or cells (True).

    Returns
    -------
    tuple
        (t, q): non-decreasing knots with t[0] = 0, t[-1] = 1, q[-1] − q[0] ≤ 1.

    Raises
    ------
    ValueError
        empty input, mismatched shapes, negative or zero total mass, non-finite values.
    """
    a = np.mod(np.asarray(turns, dtype=np.float64).reshape(-1), 1.0)
    w = np.full(a.shape, 1.0 / max(a.size, 1)) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if a.size == 0 or w.shape != a.shape:
        raise ValueError(f"a measure on S¹ needs n >= 1 angles and n weights, got {a.size} and {w.size}")
    if not (np.isfinite(a).all() and np.isfinite(w).all()) or (w < 0).any() or w.sum() <= 0:
        raise ValueError("the angles and weights must be finite, the weights >= 0 with a positive sum")
    order = np.argsort(a, kind="stable")
    a, w = a[order], w[order] / w.sum()
    W = np.concatenate([[0.0], np.cumsum(w)])
    W[-1] = 1.0
    if not cells:
        return np.repeat(W, 2)[1:-1], np.repeat(a, 2)
    prv = np.insert(a[:-1], 0, a[-1] - 1.0)
    lo = 0.5 * (a + prv)  # cell k = [lo_k, lo_{k+1}]
    return W, np.append(lo, lo[0] + 1.0) if a.size > 1 else np.array([a[0] - 0.5, a[0] + 0.5])


_GL = (0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0))  # 2-point Gauss–Legendre on [0, 1]


def _shift_cost(qa, qb, alpha):
    """∫_0^1 |Q_a(t) − Q_b(t + α)|² dt, Q_b extended by Q_b(s + 1) = Q_b(s) + 1: exact for piecewise-linear Q."""
    ta, va = qa
    tb, vb = qb
    ks = np.arange(math.floor(-alpha) - 1, math.ceil(1 - alpha) + 2)
    tbs = (tb[None, :] + ks[:, None] - alpha).reshape(-1)
    knots = np.unique(np.concatenate([ta, tbs[(tbs > 0) & (tbs < 1)], [0.0, 1.0]]))
    lo, h = knots[:-1], np.diff(knots)
    total = 0.0
    for g in _GL:  # the integrand is quadratic on every merged interval: 2 Gauss points are exact
        t = lo + g * h
        s = t + alpha
        k = np.floor(s)
        diff = np.interp(t, ta, va) - (np.interp(s - k, tb, vb) + k)
        total += 0.5 * float((h * diff * diff).sum())
    return total


def circle_w2(a, b) -> float:
    """Exact W2 (geodesic cost, radians) between two measures on S¹ given by :func:`circle_quantile` knots.

        W2² = (2π)² min_α ∫_0^1 |Q_a(t) − Q_b(t + α)|² dt

    (Delon–Salomon–Sobolevski 2010: on the circle the optimal plan is monotone after a shift of the cut, and
    the cost is convex in the shift α).  The integral is exact for piecewise-linear quantiles (atoms,
    piecewise-constant densities); the convex minimisation in α is bracketed by a scan and refined by Brent.

    Parameters
    ----------
    a, b : tuple
        (t, q) knots from :func:`circle_quantile`.

    Returns
    -------
    float
        W2 in radians (the geodesic distance on the unit circle).
    """
    from scipy.optimize import minimize_scalar  # scipy on first use: `import transformer_pde` stays light
    grid = np.linspace(-1.0, 1.0, 41)
    vals = [_shift_cost(a, b, al) for al in grid]
    i = int(np.argmin(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    res = minimize_scalar(lambda al: _shift_cost(a, b, al), bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-12})
    best = min(float(res.fun), vals[i])
    return 2 * math.pi * math.sqrt(max(best, 0.0))


def fokker_planck_circle(coef0, t_out, *, beta: float, lam: float, T: float, modes: int = 128, dt: float = 1e-3):
    """Reference mean field on S¹: the McKean–Vlasov Fokker–Planck equation of one unnormalised head
    A = V = λI (ascent), ∂_tρ = −∂_θ(ρ v) + T ∂_θ²ρ with v = (1/β) ∂_θ ∫ e^{βλ cos(θ−φ)} ρ(φ) dφ,
    by a Fourier pseudo-spectral method (integrating-factor RK4; the kernel acts on mode k as 2π I_k(βλ)).

    An implementation independent of the library's solvers, used as the reference density.

    Parameters
    ----------
    coef0 : callable or array_like
        ρ0 as a function of θ (radians, numpy array) → density w.r.t. dθ (normalised here), or its
        Fourier coefficients c_k (k = 0..M/2, as returned).
    t_out : Sequence[float]
        output times (> 0, increasing); each must be a multiple of ``dt``.
    beta, lam, T : float
        inverse temperature, head strength, temperature.
    modes : int
        grid points M (Fourier modes 0..M/2).
    dt : float
        time step.

    Returns
    -------
    dict
        {t: complex Fourier coefficients c_k (k = 0..M/2) with ρ(θ) = Σ_k c_k e^{ikθ}, c_0 = 1/(2π)}.
    """
    from scipy.special import ive
    M = int(modes)
    th = 2 * math.pi * np.arange(M) / M
    if callable(coef0):
        rho = np.asarray(coef0(th), dtype=np.float64)
    else:
        c_in = np.zeros(M // 2 + 1, dtype=np.complex128)
        c_given = np.asarray(coef0, dtype=np.complex128).reshape(-1)[:M // 2 + 1]
        c_in[:c_given.size] = c_given
        rho = np.fft.irfft(c_in * M, M)
    rho = rho / (rho.mean() * 2 * math.pi)
    c = np.fft.rfft(rho) / M
    k = np.arange(c.size)
    a = beta * lam
    # v = (1/β) ∂_θ Φ,  Φ_k = 2π I_k(a) c_k
    vmult = 1j * k / beta * 2 * math.pi * ive(k, a) * math.exp(a)
    dmult = 1j * k
    cut = k > (2 * M) // 6  # 2/3 de-aliasing
    L = -T * k.astype(np.float64) ** 2

    def nonlin(c):
        r = np.fft.irfft(c * M, M)
        v = np.fft.irfft(vmult * c * M, M)
        out = -dmult * np.fft.rfft(r * v) / M
        out[cut] = 0.0
        return out

    E, E2 = np.exp(L * dt), np.exp(L * dt / 2)
    out, t, steps_done = {}, 0.0, 0
    for t_target in t_out:
        n = round(t_target / dt)
        if abs(n * dt - t_target) > 1e-9 * max(1.0, t_target) or n < steps_done:
            raise ValueError(f"output time {t_target} must be an increasing multiple of dt = {dt}")
        for _ in range(n - steps_done):
            k1 = nonlin(c)
            k2 = nonlin(E2 * (c + 0.5 * dt * k1))
            k3 = nonlin(E2 * c + 0.5 * dt * k2)
            k4 = nonlin(E * c + dt * E2 * k3)
            c = E * c + dt / 6 * (E * k1 + 2 * E2 * (k2 + k3) + k4)
        steps_done = n
        out[t_target] = c.copy()
    return out


def circle_cell_masses(coef, m: int) -> np.ndarray:
    """Masses of the m equal cells centred at the ``circle_grid(m)`` points (angles 2πb/m) of the density
    ρ(θ) = Σ_k c_k e^{ikθ} (real: c_{−k} = conj c_k), integrated exactly."""
    c = np.asarray(coef)
    h = 2 * math.pi / m
    lo = h * (np.arange(m) - 0.5)
    k = np.arange(1, c.size)
    # ∫_lo^{lo+h} e^{ikθ} dθ = e^{ik lo}(e^{ikh} − 1)/(ik)
    f = np.exp(1j * np.outer(lo, k)) * ((np.exp(1j * k * h) - 1) / (1j * k))
    mass = h * c[0].real + 2 * (f @ c[1:]).real
    return mass


def _figures(p, metrics, sweep, sus, rates, hyst, ser, run):
    dims = p["dims"]
    fig, axs = subplots(1, len(dims), (5 * len(dims), 3.8), squeeze=False)
    for j, d in enumerate(dims):
        ax = axs[0, j]
        for n in (p["ns"] if d == 2 else p["ns_high_d"]):
            ax.plot(p["ratios"], sweep[(d, n)], "o-", label=f"particles N = {n}")
        if d == 2 and "abs_m_eulerian_d2" in metrics:
            e = metrics["abs_m_eulerian_d2"]
            ax.plot(p["ratios"], [e[f"{r:g}"] for r in p["ratios"]], "k*--",
                    label="Eulerian JKO (unnormalised, T/T_c of that model)")
        ax.axvline(1.0, color="0.5", ls=":")
        panel(ax, "T / T_c", "stationary |m|", f"{sphere_name(d)}, softmax, β = {p['beta']}, λ = {p['lam']}",
              legend={"fontsize": 8})
    save_captioned(run, fig, "abs_m", "Order parameter |m| = |(1/N)Σx_i| averaged over the second half of the run, "
                   "against T/T_c with T_c = Σω A_d(βλ)/β (critical_temperature). Above T_c |m| ~ N^{-1/2}; "
                   "below it the tokens cluster.", metrics)

    fig, axs = subplots(1, 2, (10, 3.8), squeeze=False)
    for d in dims:
        r, m, s, w = zip(*sus[d])
        axs[0, 0].errorbar(r, m, yerr=[2 * x for x in s], fmt="o", label=f"measured {sphere_name(d)}")
        axs[0, 0].plot(r, w, "x--", label=f"T/(T − T_c) {sphere_name(d)}")
        rr, meas, want = zip(*rates[d])
        axs[0, 1].plot(rr, meas, "o", label=f"measured {sphere_name(d)}")
        axs[0, 1].plot(rr, want, "x--", label=f"(d−1)(T_c − T) {sphere_name(d)}")
    panel(axs[0, 0], "T / T_c", "N·E|m|²", f"susceptibility, N = {p['sus_n']}", legend={"fontsize": 8})
    panel(axs[0, 1], "T / T_c", "growth rate of ⟨m⟩", f"mode 1 near uniform, N = {p['rate_n']}",
          legend={"fontsize": 8})
    save_captioned(run, fig, "susceptibility_rates", "Left: N·E|m|² at stationarity (2 standard errors) against "
                   "the closed form T/(T − T_c). Right: the fitted growth rate of the path-mean of m from a tilted "
                   "uniform start against r_1 = (d−1)(T_c − T).", metrics)

    fig, axs = subplots(1, len(hyst), (5 * len(hyst), 3.8), squeeze=False)
    for j, (hb, h) in enumerate(hyst.items()):
        ax = axs[0, j]
        ax.errorbar(h["ratios"], h["up"], yerr=[2 * e for e in h["up_stderr"]], fmt="o-", capsize=2,
                    label="sweep up (from the stationary cluster)")
        ax.errorbar(h["ratios"], h["down"], yerr=[2 * e for e in h["down_stderr"]], fmt="s--", capsize=2,
                    label="sweep down (from uniform)")
        ax.plot(h["ratios"], h["mean_field_up"], "k:", lw=1, label="mean field, clustered branch")
        ax.axvline(1.0, color="0.5", ls=":")
        panel(ax, "T / T_c", "|m| per stage", f"unnormalised, S¹, β = {hb:g} "
              f"({'first order' if h['first_order'] else 'continuous'}): area {h['area']:.3f} ± "
              f"{h['area_stderr']:.3f}", legend={"fontsize": 7})
    areas = "; ".join(f"β = {hb:g}: {h['area']:.4f} ± {h['area_stderr']:.4f} (mean field {h['area_mean_field']:.4f})"
                      for hb, h in hyst.items())
    save_captioned(run, fig, "hysteresis", f"T swept up and down (N = {p['hyst_n']}, {p['hyst_paths']} seeds, "
                   f"2 standard errors; Heun, dt = {p['hyst_dt']:g}/T_c at the calibrated temperature).  Stage "
                   f"length {p['hyst_efolds']:g}/|r_1(T)|, clipped to [{p['hyst_stage_min']:g}, "
                   f"{p['hyst_stage_max']:g}]/T_c; the up sweep starts from iid tokens of the mean-field "
                   f"stationary cluster, the down sweep from iid uniform tokens.  Above β = "
                   f"{tn.first_order_beta(2):.3f} (root of I_2/I_1 = 1/2) the transition is first order and the "
                   f"clustered branch survives above T_c.  Loop areas ∫(|m|_up − |m|_down) d(T/T_c): {areas}.",
                   metrics)

    fig, axs = subplots(1, 1, (6, 3.6), squeeze=False)
    for name, (t, am) in ser.items():
        axs[0, 0].plot(t.numpy(), am.numpy(), label=f"{name} β_t (avg rate {metrics['weights'][name]['averaged_rate']:+.3f})")
    panel(axs[0, 0], "time t", "|m|", f"S¹, T = {p['weights_ratio']:g}·T_c(β̄ = {p['weights_beta']:g}), N = {p['weights_n']}",
          legend={"fontsize": 8})
    save_captioned(run, fig, "weights", "Constant vs OU vs oscillating β_t (A = I, softmax): the time-averaged "
                   "mode-1 rate (theory.noise.averaged_growth_rate of the realised β_t) decides whether the uniform "
                   "state survives.", metrics)
