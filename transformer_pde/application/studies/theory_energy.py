"""Pendharkar's items 1–3 on the full particle system: the total energy and the radial dominance.

    theory_energy          items 1–2: total-energy monotonicity (sphere and flat), its defect for
                           broken symmetry / value alignment, per-head energies and radial shadows
    theory_radial          item 3: radial-dominance margin and the critical β*(H, n)

Conventions and the shared parts: :mod:`transformer_pde.application.studies.theory`.  Every kind writes a figure (PNG + PDF), CSV series
and metrics.json.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

import transformer_pde as tp
from transformer_pde.analysis import diagnostics as dg, theory as th

from . import Option, log_ticks, panel, positive, study, subplots, dtype_of
from .theory import (BETA, HEADS, RK4_DT, ascent_run, append_row, cumtrapz, float_list, int_list, positive_floats,
                     save_tidy, select_rows, simpson_residual)

__all__ = ["run_energy", "run_radial"]

ENERGY_OPTIONS = {
    "n": Option(24, (int,), "number of tokens", check=positive),
    "d": Option(3, (int,), "dimension", check=positive),
    "heads": HEADS,
    "beta": BETA,
    "scale": Option(0.4, (float,), "scale of the random symmetric heads Z + Zᵀ", check=positive),
    "t1": Option(2.0, (float,), "final time of the sphere runs", check=positive),
    "dt": RK4_DT,
    "flat_t1": Option(0.1, (float,), "final time of the flat runs (they blow up in finite time)", check=positive),
    "flat_dt": Option(0.001, (float,), "time step of the flat runs", check=positive),
    "epsilons": Option([0.0125, 0.025, 0.05, 0.1, 0.2], (list,), "sizes of the symmetry / value-alignment breaking",
                       check=positive_floats),
    "orth_angle": Option(60.0, (float,), "direction (degrees) of the token cluster in the orthogonal-heads example",
                         check=lambda v: None if 0 < v < 90 else "must lie in (0, 90)"),
    "seed": Option(0, (int,), "seed of tokens and heads"),
}

RADIAL_OPTIONS = {
    "heads": Option([1, 2, 3, 4, 5], (list,), "numbers of equal heads H", check=int_list(1)),
    "n": Option([3, 5, 10, 20, 50, 100], (list,), "numbers of tokens", check=int_list(2)),
    "alpha": Option(1.0, (float,), "head strength α (A_h = αI)", check=positive),
    "gammas": Option([0.05, 0.1, 0.2], (list,), "equiangular overlaps γ > 0 (outside the orthogonal regime)",
                     check=float_list(0.0, 0.99)),
    "hetero": Option([0.5, 1.0, 2.0], (list,), "unequal head strengths for the heterogeneous example",
                     check=positive_floats),
    "hetero_n": Option(50, (int,), "tokens in the heterogeneous example", check=positive),
}


# ---------------------------------------------------------------------------- items 1–2
@study("theory_energy", ENERGY_OPTIONS,
       "Pendharkar items 1-2: energy monotonicity (sphere/flat), its defect, per-head energies and radial shadows")
def run_energy(params, run):
    dtype = dtype_of(params)
    g = torch.Generator().manual_seed(params["seed"])
    n, d, H, beta = params["n"], params["d"], params["heads"], params["beta"]
    x0 = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    heads = tp.Heads.random(H, d, generator=g, scale=params["scale"], beta=beta, weights=torch.ones(H, dtype=dtype),
                            dtype=dtype)
    metrics = {}

    # -- 1. total energy along the sphere dynamics, E(t) − E(0) = ∫ (1/n) Σ ‖ẋ_i‖² dt, and along the flat dynamics
    traj = ascent_run(x0, heads, params["t1"], params["dt"], normalization="unnormalized", progress=run.progress)
    ft = dg.flat_flow(x0, heads, t1=params["flat_t1"], dt=params["flat_dt"])
    curves = {}
    for where, times, E, kin in (("sphere", traj.times, traj.energy, dg.energy_balance(traj.x, heads).kinetic),
                                 ("flat", ft.times, ft.energy, ft.kinetic)):
        curves[where] = {"t": times, "dE": E - E[0], "int_kinetic": cumtrapz(times, kin)}
        metrics[f"{where}_identity_rel_residual"] = simpson_residual(times, E, kin)
        metrics[f"{where}_min_energy_increment"] = float((E[1:] - E[:-1]).min())
        if where == "sphere":
            metrics["sphere_energy_gain"] = float(curves[where]["dE"][-1])
    metrics["flat_max_token_norm"] = float(ft.norms[-1])

    t_half = max(1, round(params["t1"] / (4 * params["dt"]))) * 2 * params["dt"]  # ≈ t1/2 on the 2·dt grid
    defects = _energy_defects(x0, heads, params, g, t_half, metrics)
    run.save_series("defect", defects)
    orth = _orthogonal_heads(params, g, t_half, metrics)
    for where in ("sphere", "flat"):
        t, Eh = orth[where]
        run.save_series(f"{where}_energy", curves[where])
        run.save_series(f"orthogonal_{where}", {"t": t, "E1": Eh[:, 0], "E2": Eh[:, 1]})
    _energy_figure(run, params, metrics, curves, defects, orth)
    return metrics


def _energy_figure(run, params, metrics, curves, rows, orth) -> None:
    fig, ax = subplots(2, 3, (14, 7.5), "Pendharkar energy results, unnormalised heads, ω_h = 1, ascent "
                       "(tokens cluster)")
    for a, where, title in ((ax[0, 0], "sphere", "sphere: dE/dt = (1/n)Σ‖ẋ_i‖²"),
                            (ax[0, 1], "flat", "flat (unprojected) dynamics")):
        t = curves[where]["t"].numpy()
        a.plot(t, curves[where]["dE"].numpy(), label="E(t) − E(0)")
        a.plot(t, curves[where]["int_kinetic"].numpy(), "--", label="∫ (1/n)Σ‖ẋ‖² dt")
        panel(a, "t", "energy gain", title, legend=True)
    eps = rows["epsilon"]
    for tag, mk in (("asym", "o"), ("value", "s")):
        broken = "A ≠ Aᵀ" if tag == "asym" else "V ≠ A"
        ax[0, 2].loglog(eps, [abs(v) for v in rows[f"defect_{tag}"]], mk + "-", label=f"|defect|, {broken}")
        ax[0, 2].loglog(eps, rows[f"bound_{tag}"], mk + ":", label=f"bound, {broken}")
    ax[0, 2].set_xticks(eps, [f"{e:g}" for e in eps])
    ax[0, 2].minorticks_off()
    panel(ax[0, 2], "ε", "|dE/dt defect| and its bound", "monotonicity defect at t = 0", legend=True)
    for a, where, title in ((ax[1, 0], "sphere", f"orthogonal heads e₁e₁ᵀ, e₂e₂ᵀ on the sphere (cluster at "
                                                 f"{params['orth_angle']:.0f}°)"),
                            (ax[1, 1], "flat", "same heads, flat dynamics")):
        t, Eh = orth[where]
        for h, c in ((0, "C0"), (1, "C1")):
            a.plot(t.numpy(), (Eh[:, h] - Eh[0, h]).numpy(), c, label=f"E_{h + 1}")
        panel(a, "t", "head energy E_h(t) − E_h(0)", title, legend=True)
    rd = orth["radial"]
    vals = [float(rd.tangential[0]), float(rd.coupling[0, 1]), -float(rd.shadow[0, 1]),
            float(rd.tangential[1]), float(rd.coupling[1, 0]), -float(rd.shadow[1, 0])]
    ax[1, 2].bar(range(6), vals, color=["C0", "C0", "C0", "C1", "C1", "C1"])
    ax[1, 2].set_xticks(range(6), ["C₁₁−S₁₁", "C₁₂", "−S₁₂", "C₂₂−S₂₂", "C₂₁", "−S₂₁"])
    ax[1, 2].axhline(0, color="k", lw=0.5)
    panel(ax[1, 2], "term (blue: head 1, orange: head 2)", "term of dE_h/dt at t = 0",
          "dE_h/dt terms at t = 0: tangential, cross, radial shadow")
    save_tidy(run, fig, "energy", "Deterministic runs (no bands). Top left/centre: the energy gain E(t) − E(0) against "
          "the integrated kinetic term ∫(1/n)Σ‖ẋ_i‖² dt on the sphere and in flat space (the curves coincide: the "
          "energy identity). Top right: the monotonicity defect at t = 0 for non-symmetric A (A ≠ Aᵀ) and V ≠ A at "
          "perturbation size ε (solid) and its bound (dotted). Bottom: per-head energies of two orthogonal heads "
          "(one decreases on the sphere, not in flat space) and the terms of dE_h/dt at t = 0.", metrics)


def _energy_defects(x0, heads, params, g, t_half, metrics) -> Dict:
    """The monotonicity defect when symmetry (A ≠ Aᵀ) or value alignment (V ≠ A) is broken by ε, its bound, and the
    largest gap of the energy identity along a run; the table of the series "defect"."""
    H, d, beta, dtype = params["heads"], params["d"], params["beta"], x0.dtype
    A = heads.score_matrix
    Kr = torch.randn(H, d, d, generator=g, dtype=dtype)
    K = Kr - Kr.transpose(-1, -2)
    K = K / torch.linalg.matrix_norm(K, ord=2)[..., None, None]
    N = torch.randn(H, d, d, generator=g, dtype=dtype)
    N = N / torch.linalg.matrix_norm(N, ord=2)[..., None, None]
    eps = [float(e) for e in params["epsilons"]]
    rows = {"epsilon": eps, "defect_asym": [], "bound_asym": [], "defect_value": [], "bound_value": [],
            "ledger_asym": [], "ledger_value": []}
    for e in eps:
        for tag, h in (("asym", tp.Heads(A + e * K, None, torch.ones(H, dtype=dtype), beta)),
                       ("value", tp.Heads(A, A + e * N, torch.ones(H, dtype=dtype), beta))):
            bal = dg.energy_balance(x0, h)
            rows[f"defect_{tag}"].append(float(bal.defect))
            rows[f"bound_{tag}"].append(float(bal.bound))
            tr = ascent_run(x0, h, t_half, 2 * params["dt"], normalization="unnormalized")
            kin_e = dg.energy_balance(tr.x, h).kinetic
            rows[f"ledger_{tag}"].append(float((tr.energy - tr.energy[0] - cumtrapz(tr.times, kin_e)).abs().max()))
    for tag in ("asym", "value"):
        de = [abs(v) for v in rows[f"defect_{tag}"]]
        # the defect is O(ε); its first-order coefficient depends on the configuration (it can be small)
        metrics[f"defect_{tag}_over_epsilon_at_min"] = de[0] / eps[0]
        metrics[f"defect_{tag}_at_max_epsilon"] = de[-1]
        metrics[f"defect_{tag}_max_over_bound"] = max(a / b for a, b in zip(de, rows[f"bound_{tag}"]))
        metrics[f"ledger_gap_{tag}_at_max_epsilon"] = rows[f"ledger_{tag}"][-1]
    return rows


def _orthogonal_heads(params, g, t_half, metrics) -> Dict:
    """Item 2, exactly orthogonal heads on S¹: a per-head energy decreases on the sphere, not in flat space.
    Returns {"radial": the decomposition at t = 0, "sphere"/"flat": (times, per-head energies (T, 2))}."""
    dtype = dtype_of(params)
    th0 = math.radians(params["orth_angle"])
    base = torch.tensor([math.cos(th0), math.sin(th0)], dtype=dtype)
    xo = tp.sphere.normalize(base + 0.1 * torch.randn(params["n"], 2, generator=g, dtype=dtype))
    Ao = torch.zeros(2, 2, 2, dtype=dtype)
    Ao[0, 0, 0] = Ao[1, 1, 1] = 1.0
    ho = tp.Heads.symmetric(Ao, beta=params["beta"], weights=torch.ones(2, dtype=dtype))
    rd = dg.radial_decomposition(xo, ho)
    metrics.update({
        "orth_head_defect": float(dg.orthogonality_defect(ho).max()),
        "orth_rate_head1_sphere": float(rd.sphere_rates[0]), "orth_rate_head1_flat": float(rd.flat_rates[0]),
        "orth_rate_head2_sphere": float(rd.sphere_rates[1]), "orth_rate_head2_flat": float(rd.flat_rates[1]),
        "orth_cross_coupling_12": float(rd.coupling[0, 1]), "orth_shadow_coupling_12": float(rd.shadow[0, 1]),
    })
    to = ascent_run(xo, ho, t_half, params["dt"], normalization="unnormalized")
    Eh_s = tp.head_energies(to.x, ho)
    fo = dg.flat_flow(xo, ho, t1=params["flat_t1"], dt=params["flat_dt"])
    Eh_f = fo.head_energies
    metrics["orth_head1_change_sphere"] = float(Eh_s[-1, 0] - Eh_s[0, 0])
    metrics["orth_head1_change_flat"] = float(Eh_f[-1, 0] - Eh_f[0, 0])
    metrics["orth_head1_max_increment_sphere"] = float((Eh_s[1:, 0] - Eh_s[:-1, 0]).max())
    metrics["orth_head1_min_increment_flat"] = float((Eh_f[1:, 0] - Eh_f[:-1, 0]).min())
    return {"radial": rd, "sphere": (to.times, Eh_s), "flat": (fo.times, Eh_f)}


# ---------------------------------------------------------------------------- item 3
@study("theory_radial", RADIAL_OPTIONS, "Pendharkar item 3: radial-dominance margin and critical beta*(H, n)")
def run_radial(params, run):
    dtype = dtype_of(params)
    alpha = params["alpha"]
    rows = {"H": [], "n": [], "form": [], "gamma": [], "closed_form": [], "numeric": [], "rel_error": []}

    def add(H, n, form, gamma, cf, num):
        if math.isfinite(cf) and cf > 1e-12:
            err = abs(num - cf) / cf
        else:  # β* = inf (H = 1) or ≤ 0 (to rounding): the margin never / always is negative for β > 0
            err = 0.0 if (num == cf or (cf <= 1e-12 and num == -math.inf)) else math.inf
        append_row(rows, H, n, form, gamma, cf, num, err)

    for H in params["heads"]:
        for n in params["n"]:
            for form in ("token", "pairwise"):
                num = dg.radial_dominance_threshold(n, [alpha] * H, form=form, dtype=dtype)
                add(H, n, form, 0.0, th.critical_beta(H, n, alpha, form=form), float(num[0]))
            for gm in params["gammas"]:
                num = dg.radial_dominance_threshold(n, [alpha] * H, gamma=gm, dtype=dtype)
                add(H, n, "token", gm, th.critical_beta(H, n, alpha, gamma=gm), float(num[0]))
    run.save_series("thresholds", rows)

    def max_err(pred):
        errs = [e for e, f, gm in zip(rows["rel_error"], rows["form"], rows["gamma"]) if pred(f, gm)]
        return max(errs) if errs else float("nan")

    metrics = {
        "cases": len(rows["H"]),
        "max_rel_error_token_gamma0": max_err(lambda f, gm: f == "token" and gm == 0.0),
        "max_rel_error_pairwise_gamma0": max_err(lambda f, gm: f == "pairwise"),
        "max_rel_error_token_gamma_extended": max_err(lambda f, gm: f == "token" and gm > 0),
        "c_star_2": th.critical_cosine(2),
        "golden_ratio_inverse": 2 / (1 + math.sqrt(5)),
    }
    # how far the γ = 0 formula is off once tokens are not orthogonal (largest H, n with β* > 0)
    shifts = []
    for H, n, f, gm, cf in zip(rows["H"], rows["n"], rows["form"], rows["gamma"], rows["closed_form"]):
        if f == "token" and gm > 0 and math.isfinite(cf) and cf > 0:
            b0 = th.critical_beta(H, n, alpha)
            shifts.append((gm, H, n, (cf - b0) / b0))
    if shifts:
        gm, H, n, s = max(shifts, key=lambda r: abs(r[3]))
        metrics["largest_relative_shift_from_gamma0_formula"] = s
        metrics["largest_shift_case"] = f"H={H}, n={n}, gamma={gm}"
    # heterogeneous heads: no closed form; compare with the equal-head formula at each λ_h
    lam = [float(v) for v in params["hetero"]]
    hn = params["hetero_n"]
    num = dg.radial_dominance_threshold(hn, lam, dtype=dtype)
    for h, (lh, b) in enumerate(zip(lam, num.tolist())):
        metrics[f"hetero_head{h + 1}_lambda{lh:g}_threshold"] = b
        metrics[f"hetero_head{h + 1}_equal_head_formula"] = th.critical_beta(len(lam), hn, lh)

    fig, ax = subplots(1, 2, (12, 4.5))
    ns = sorted(set(params["n"]))
    nn = list(range(min(ns), max(ns) + 1))
    for i, H in enumerate(params["heads"]):
        if H == 1:
            continue
        c = f"C{i}"
        ax[0].plot(nn, [th.critical_beta(H, v, alpha) for v in nn], c, lw=1)
        for form, fmt, kw in (("token", "o", {"label": f"H = {H} (c* = {th.critical_cosine(H):.3f})"}),
                              ("pairwise", "x", {"alpha": 0.6})):  # where the margin changes sign
            sel = [(n, b) for n, b in select_rows(rows, ("n", "numeric"), H=H, form=form, gamma=0.0) if math.isfinite(b)]
            if sel:
                ax[0].plot(*zip(*sel), fmt, color=c, **kw)
    ax[0].set_xscale("log")
    log_ticks(ax[0], ns)
    panel(ax[0], "n (orthogonal tokens)", "β*",
          f"β*(H, n), α = {alpha}: lines formula, ● token margin, × pairwise margin", legend=True)
    _margin_panel(ax[1], params, ns, dtype)
    save_tidy(run, fig, "radial_dominance", "Left: the critical inverse temperature β*(H, n) — lines: the closed form; "
          "dots: where the token margin of the particle system changes sign; crosses: the same for the pairwise "
          "margin. Right: both margins against β for one configuration; dotted: the closed-form β*. Deterministic "
          "computations (no bands).", metrics)
    return metrics


def _margin_panel(ax, params, ns, dtype) -> None:
    """Both radial-dominance margins of head 1 against β, H = the first H >= 2, n = the first n >= 5."""
    alpha = params["alpha"]
    n2 = next((n for n in ns if n >= 5), ns[-1])
    H2 = next((H for H in params["heads"] if H >= 2), 2)
    x = tp.sphere.equiangular(n2, 0.0, n2, dtype=dtype)
    bstar = th.critical_beta(H2, n2, alpha)
    bmax = 3 * bstar if math.isfinite(bstar) and bstar > 0 else 3.0
    betas = torch.linspace(bmax / 300, bmax, 300, dtype=dtype)
    hb = tp.Heads.scalar(torch.full((len(betas), H2), alpha, dtype=dtype), n2, beta=betas,
                         weights=torch.ones(len(betas), H2, dtype=dtype))
    for form, ls in (("token", "-"), ("pairwise", "--")):
        m = dg.radial_dominance_margin(x, hb, form=form)[:, 0, 0]
        ax.plot(betas.numpy(), m.numpy(), ls, label=f"{form} margin")
    ax.axhline(0, color="k", lw=0.5)
    if math.isfinite(bstar) and bstar > 0:
        ax.axvline(bstar, color="C3", ls=":", label=f"β* = {bstar:.4f}")
    panel(ax, "β", "radial-dominance margin", f"margin of head 1, H = {H2}, n = {n2}, softmax, orthogonal tokens",
          legend=True)


