"""Hysteresis of noisy tokens on S¹ (the ``noisy_transition`` study, docs/noisy_tokens.md).

The unnormalised head A = V = I at inverse temperature β is swept in T up (from the stationary cluster) and down
(from iid uniform tokens), ``hyst_paths`` seeds per direction, β and N.  The particle loops are compared with the
mean-field limit computed two ways:

* stationary (independent of the stage lengths): the clustered branch of the stationary Fokker–Planck equation
  by continuation (:mod:`transformer_pde.analysis.theory.continuation`), its fold (spinodal T_s) and the loop
  of a quasi-static sweep through the same stages;
* finite-stage: the spectral Fokker–Planck solution (:func:`~transformer_pde.analysis.theory.circle.
  fokker_planck_circle`) run through exactly the particles' stages (up from the stationary cluster, down from the
  uniform density tilted to |m| = N^{−1/2}, the size of the particles' initial fluctuation), which shows what a
  finite stage length leaves of the critical slowing down near T_c.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import continuation as tc
from transformer_pde.analysis.theory import noise as tn
from transformer_pde.analysis.theory.circle import (calibrated_temperature, circle_cell_masses, fokker_planck_circle,
                                                    fokker_planck_stable_dt)

from . import cached, panel, save_captioned, subplots
from .claims import claim, ensemble

__all__ = ["hysteresis", "hysteresis_claims", "hysteresis_figure", "branch_coefficients"]

log = logging.getLogger(__name__)

_MODES = 48  # continuation modes (the fold moves by < 1e-12 between 32 and 64)
_FS_MODES = 64  # Fourier grid of the finite-stage mean-field reference


def branch_coefficients(b) -> np.ndarray:
    """Fourier coefficients c_k (k = 0..K) of ρ(θ) = (1/2π) Σ_ℓ b_ℓ cos ℓθ (b_0 = 1; density w.r.t. dθ), the
    convention of ``fokker_planck_circle``, from the continuation's Chebyshev coefficients b_1..b_K."""
    b = np.asarray(b, dtype=np.float64)
    return np.concatenate([[1 / (2 * math.pi)], b / (4 * math.pi)]).astype(np.complex128)


def _sample_density(coef, shape, rng):
    """iid angles (radians) from the density Σ c_k e^{ikθ} (4096 exact cells, uniform within a cell)."""
    m = 4096
    cdf = np.cumsum(circle_cell_masses(coef, m))
    cdf = cdf / cdf[-1]
    u = rng.random(shape)
    return 2 * math.pi * (np.searchsorted(cdf, u).clip(max=m - 1) + rng.random(shape) - 0.5) / m


def _stage_lengths(p, hb, Tc, ratios, dt):
    out = []
    for r in ratios:
        rate = abs(float(tn.mode_growth_rates(hb, 2, r * Tc, 1, lambdas=(1.0,), normalization="unnormalized")[1]))
        L = min(max(p["hyst_efolds"] / max(rate, 1e-300), p["hyst_stage_min"] / Tc), p["hyst_stage_max"] / Tc)
        out.append(max(2, round(L / dt)) * dt)
    return out


def _finite_stage_mean_field(hb, Tc, ratios, lengths, coef_up, m0):
    """|m| per stage (mean over the stage's second half) of the spectral Fokker–Planck sweep up and down."""
    dt_max = fokker_planck_stable_dt(hb, 1.0, _FS_MODES, 0.02)
    res = {}
    c_down = np.zeros(_FS_MODES // 2 + 1, np.complex128)
    c_down[0], c_down[1] = 1 / (2 * math.pi), m0 / (2 * math.pi)
    for direction, c in (("up", coef_up), ("down", c_down)):
        order = range(len(ratios)) if direction == "up" else range(len(ratios) - 1, -1, -1)
        vals = {}
        for k in order:
            L = lengths[k]
            steps = max(16, math.ceil(L / dt_max / 16) * 16)
            h = L / steps
            outs = [h * (steps // 2 + j * steps // 16) for j in range(9)]
            sol = fokker_planck_circle(c, outs, beta=hb, lam=1.0, T=ratios[k] * Tc, modes=_FS_MODES, dt=h)
            vals[k] = float(np.mean([2 * math.pi * abs(sol[t][1]) for t in outs]))
            c = sol[outs[-1]]
        res[direction] = [vals[k] for k in range(len(ratios))]
    return res


def hysteresis(p, hb, n, dtype, run):
    """Particle sweeps (P seeds) at β = hb, N = n, and both mean-field references (module docstring)."""
    d, P = 2, p["hyst_paths"]
    Tc = tp.theory.critical_temperature(hb, d, lambdas=(1.0,), normalization="unnormalized")
    ratios = sorted(p["hyst_ratios"])
    heads = tp.Heads.scalar(torch.tensor([1.0], dtype=dtype), d, beta=hb)
    dt = p["hyst_dt"] / Tc
    lengths = _stage_lengths(p, hb, Tc, ratios, dt)
    branch = tc.stationary_branch(hb, d, modes=_MODES, m_max=0.95, steps=160)
    m_first = tc.stable_branch_at(branch, ratios[:1], beta=hb, d=d)[0]
    if not np.isfinite(m_first):
        raise ValueError(f"config key 'hyst_ratios': no stationary cluster at T/T_c = {ratios[0]:g} for β = {hb:g}; "
                         "start the sweep below T_c")
    sc = tc.ZonalSelfConsistency(hb, 1.0, d, _MODES)
    j = int(np.argmin(np.abs(branch["m"] - m_first)))
    b_first = sc.solve_at_T(ratios[0] * Tc, branch["b"][j])
    coef_up = branch_coefficients(b_first)

    def compute():
        rng = np.random.default_rng(p["seed"] + 11 + n)
        start = {"up": _sample_density(coef_up, (P, n), rng), "down": rng.random((P, n)) * 2 * math.pi}
        out = {}
        for jd, direction in enumerate(("up", "down")):
            a = start[direction]
            x = torch.tensor(np.stack([np.cos(a), np.sin(a)], -1), dtype=dtype)
            order = range(len(ratios)) if direction == "up" else range(len(ratios) - 1, -1, -1)
            vals = {}
            for k in order:
                model = tp.Model(heads, normalization="unnormalized", direction="ascent",
                                 temperature=calibrated_temperature(ratios[k] * Tc, dt))
                tr = tp.solve(model, x, tp.Heun(), t1=lengths[k], dt=dt, seed=p["seed"] + 1000 * (jd + 1) + k + 7 * n,
                              saveat=tp.SaveAt(record_every=max(1, round(0.5 / Tc / dt)),
                                               observables={"m": lambda x, w: x.mean(-2)}),
                              ledger=tp.LedgerOptions(diagnostics=False))
                x = tr.final
                am = tr.observables["m"].double().norm(dim=-1)  # (times, P)
                keep = tr.times.double() >= lengths[k] / 2 - 1e-12
                vals[k] = am[keep].mean(0)
            out[direction] = torch.stack([vals[k] for k in range(len(ratios))], -1)  # (P, K)
        return out

    res = cached(run, f"hyst3_b{hb:g}_n{n}", compute, log)
    up, down = res["up"].numpy(), res["down"].numpy()
    areas = np.trapezoid(up - down, ratios, axis=-1)  # (P,)
    loop = tc.mean_field_loop(hb, d, ratios, modes=_MODES)
    fs = _finite_stage_mean_field(hb, Tc, ratios, lengths, coef_up, n ** -0.5)
    return {"Tc": Tc, "first_order": bool(tn.landau_coefficient(hb, 2) < 0), "ratios": ratios, "n": n, "paths": P,
            "stage_lengths_Tc_units": [L * Tc for L in lengths], "dt_Tc_units": p["hyst_dt"],
            "up": up.mean(0).tolist(), "down": down.mean(0).tolist(),
            "up_stderr": (up.std(0, ddof=1) / math.sqrt(P)).tolist(),
            "down_stderr": (down.std(0, ddof=1) / math.sqrt(P)).tolist(),
            "areas": areas.tolist(), "area": float(areas.mean()), "area_stderr": float(areas.std(ddof=1) / math.sqrt(P)),
            "mean_field_up": loop["up"], "mean_field_down": loop["down"], "area_mean_field": loop["area_stages"],
            "area_mean_field_continuous": loop["area_continuous"], "spinodal": loop["spinodal"],
            "finite_stage_up": fs["up"], "finite_stage_down": fs["down"],
            "area_finite_stage": float(np.trapezoid(np.subtract(fs["up"], fs["down"]), ratios))}


def _spinodal_claims(hb):
    out = []
    for d, name in ((2, "S^1"), (3, "S^2")):
        s = tc.spinodal(hb, d, modes=_MODES)
        s2 = tc.spinodal(hb, d, modes=_MODES // 2)
        err = abs(s["ratio"] - s2["ratio"])  # numerical (modes K vs K/2); the quantity is deterministic
        out.append(claim(f"mean-field spinodal T_s/T_c, beta={hb:g}, {name} (continuation)", s["ratio"], err, 0,
                         reference=None, holds=None,
                         first_order_as_landau=bool(s["first_order"] == (tn.landau_coefficient(hb, d) < 0)),
                         m_at_fold=s["m"]))
    return out


def hysteresis_claims(hyst) -> list:
    """Claims of the sweeps: loop areas per (β, N) against the stationary mean-field loop, the contrast between the
    largest and smallest β per N, the spinodals and the continuous mean-field loop area."""
    claims = []
    betas = sorted({hb for hb, _ in hyst})
    for (hb, n), h in sorted(hyst.items()):
        ref = h["area_mean_field"]
        holds = abs(h["area"] - ref) <= 2 * h["area_stderr"]
        what = "control (continuous transition: no stationary loop)" if not h["first_order"] else "first order"
        claims.append(claim(f"loop area, beta={hb:g}, N={n}, {what}", h["area"], h["area_stderr"], h["paths"],
                            reference=ref, holds=holds, finite_stage_mean_field=h["area_finite_stage"]))
    for hb in betas:
        h = next(v for (b, _), v in hyst.items() if b == hb)
        claims.append(claim(f"mean-field loop area, continuous quasi-static sweep, beta={hb:g}, S^1",
                            h["area_mean_field_continuous"], 0.0, 0, reference=None, holds=None))
        if h["first_order"]:
            claims.extend(_spinodal_claims(hb))
    if len(betas) >= 2:
        for n in sorted({n for _, n in hyst}):
            a, b = hyst.get((betas[0], n)), hyst.get((betas[-1], n))
            if a is None or b is None:
                continue
            diff = np.subtract(b["areas"], a["areas"])
            v, e, _ = ensemble(diff.tolist())
            claims.append(claim(f"loop-area contrast beta={betas[-1]:g} minus beta={betas[0]:g}, N={n}", v, e,
                                len(diff), reference=b["area_mean_field"] - a["area_mean_field"],
                                holds=bool(v > 2 * e)))
    return claims


def hysteresis_figure(p, hyst, run, metrics):
    betas = sorted({hb for hb, _ in hyst})
    fig, axs = subplots(1, len(betas), (5.2 * len(betas), 4.2), squeeze=False)
    for j, hb in enumerate(betas):
        ax = axs[0, j]
        ns = sorted({n for _, n in hyst})
        for (b, n), h in sorted(hyst.items()):
            if b != hb:
                continue
            col = f"C{ns.index(n) % 10}"  # one colour per N in every panel
            ax.errorbar(h["ratios"], h["up"], yerr=[2 * e for e in h["up_stderr"]], fmt="o-", color=col, capsize=2,
                        label=f"$N$ = {n} up")
            ax.errorbar(h["ratios"], h["down"], yerr=[2 * e for e in h["down_stderr"]], fmt="s--", color=col,
                        capsize=2, label=f"$N$ = {n} down")
        h = next(v for (b, _), v in hyst.items() if b == hb)
        ax.plot(h["ratios"], h["mean_field_up"], "k-", lw=1.2, label="mean field (stationary), up")
        ax.plot(h["ratios"], h["mean_field_down"], "k--", lw=1.2, label="mean field (stationary), down")
        if h["first_order"]:
            ax.axvline(h["spinodal"]["ratio"], color="C3", ls=":", label="spinodal $T_s/T_c$")
        ax.axvline(1.0, color="0.5", ls=":")
        panel(ax, "$T/T_c$", "$|m|$ per stage", rf"$\beta$ = {hb:g}", legend={"fontsize": 7})
    areas = "; ".join(f"β = {hb:g}, N = {n}: {h['area']:.4f} ± {h['area_stderr']:.4f} (stationary mean field "
                      f"{h['area_mean_field']:.4f}, finite-stage {h['area_finite_stage']:.4f})"
                      for (hb, n), h in sorted(hyst.items()))
    cap = (f"Unnormalised head on S¹, T swept up and down ({p['hyst_paths']} seeds per direction, bars: 2 standard "
           f"errors; Heun, dt = {p['hyst_dt']:g}/T_c at the calibrated temperature; stage length "
           f"{p['hyst_efolds']:g}/|r_1(T)| clipped to [{p['hyst_stage_min']:g}, {p['hyst_stage_max']:g}]/T_c). Black: "
           f"the quasi-static mean-field loop from the stationary branch (continuation); red: its spinodal. "
           f"Loop areas ∫(|m|_up − |m|_down) d(T/T_c): {areas}.")
    save_captioned(run, fig, "hysteresis", cap, metrics, tidy=True)
