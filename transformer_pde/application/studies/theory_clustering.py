"""Pendharkar's items 4–7 on the full particle system: clustering rates, ReLU vs softmax, attention entropy,
approximately orthogonal heads.

    theory_rates           item 4: equiangular γ-ODE vs particles, early/late rates, Lambert-W
                           maximiser, super-additivity
    theory_relu_softmax    item 5: linearised vs nonlinear clustering times, swept over n and d
    theory_entropy         item 6: attention entropy and dH/dt = −Cov(s, ṡ)
    theory_orthogonality   item 7: approximately orthogonal heads (principal angles 70–90°)

Conventions and the shared parts: :mod:`transformer_pde.application.studies.theory`.  Every kind writes a figure (PNG + PDF), CSV series
and metrics.json.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

import transformer_pde as tp
from transformer_pde.analysis import diagnostics as dg, theory as th

from . import Option, at_least, log_ticks, panel, positive, study, subplots, dtype_of
from .theory import (BETA, HEADS, RK4_DT, SEED, T1, ascent_run, append_row, float_list, int_list,
                     loglog_slope, ls_slope, positive_floats, save_tidy, scalar_heads, select_rows, unit_interval)

__all__ = ["run_rates", "run_relu_softmax", "run_entropy", "run_orthogonality"]

RATES_OPTIONS = {
    "n": Option(8, (int,), "number of tokens (equiangular, d = n)", check=at_least(2)),
    "lambdas": Option([0.5, 1.5], (list,), "head strengths λ_h (A_h = λ_h I)", check=positive_floats),
    "beta": BETA,
    "gamma0": Option(0.05, (float,), "initial overlap of the equiangular tokens", check=unit_interval),
    "t1": T1,
    "dt": RK4_DT,
    "phi_n": Option([2, 8, 32, 128], (list,), "token numbers for the φ(λ) curves", check=int_list(2)),
    "total": Option([2.0, 16.0], (list,), "total strengths Λ for the super-additivity example (H = 2)",
                    check=positive_floats),
    "targets": Option([0.05, 0.5], (list,), "overlaps defining the hitting times (from orthogonal tokens)",
                      check=float_list(0.0, 0.99, open_lo=True)),
}

RELU_OPTIONS = {
    "n": Option([8, 16, 32, 64], (list,), "numbers of tokens", check=int_list(2)),
    "d": Option([16, 256, 4096], (list,), "dimensions (initial overlap γ0 = 1/√d)", check=int_list(2)),
    "lam": Option(1.0, (float,), "head strength λ (one head A = λI)", check=positive),
    "beta": BETA,
    "target": Option(0.5, (float,), "overlap defining the clustering time", check=unit_interval),
    "particles": Option(True, (bool,), "also run the equiangular particle system for every (n, d)"),
    "random_n": Option([8, 16], (list,), "token numbers of the random-token runs ([] to skip)",
                       check=lambda v: None if all(isinstance(t, int) and t >= 2 for t in v) else "ints >= 2"),
    "random_d": Option([16, 64], (list,), "dimensions of the random-token runs", check=int_list(2)),
    "ensemble": Option(4, (int,), "random-token ensemble size", check=positive),
    "dt": Option(0.05, (float,), "largest time step (rk4)", check=positive),
    "seed": Option(0, (int,), "seed of the random tokens"),
}
_NORMS = ("softmax", "relu")

ENTROPY_OPTIONS = {
    "n": Option(16, (int,), "tokens of the random configurations", check=at_least(2)),
    "d": Option(4, (int,), "dimension of the random configurations", check=at_least(2)),
    "heads": Option(3, (int,), "heads of the random configurations", check=positive),
    "configs": Option(8, (int,), "number of random configurations", check=positive),
    "fd_step": Option(1e-5, (float,), "central finite-difference step", check=positive),
    "equi_n": Option(8, (int,), "tokens of the equiangular run", check=at_least(2)),
    "lam": Option(1.0, (float,), "head strength of the equiangular run", check=positive),
    "beta": Option(2.0, (float,), "inverse temperature of the equiangular run", check=positive),
    "gamma0": Option(0.0, (float,), "initial overlap of the equiangular run", check=unit_interval),
    "t1": T1,
    "dt": RK4_DT,
    "seed": SEED,
}

ORTH_OPTIONS = {
    "angles": Option([70.0, 75.0, 80.0, 85.0, 90.0], (list,), "principal angles between head subspaces (degrees)",
                     check=float_list(0.0, 90.0, open_lo=True)),
    "heads": HEADS,
    "k": Option(2, (int,), "rank of every head (d = (H + 1) k)", check=positive),
    "alpha": Option(1.0, (float,), "head strength α (A_h = α U_h U_hᵀ)", check=positive),
    "beta": BETA,
    "n": Option(32, (int,), "number of tokens", check=positive),
    "spread": Option(0.3, (float,), "noise of the token cluster around a direction shared by all heads",
                     check=positive),
    "flat_t1": Option(0.05, (float,), "final time of the flat runs", check=positive),
    "flat_dt": Option(0.0005, (float,), "time step of the flat runs", check=positive),
    "seed": SEED,
}




# ---------------------------------------------------------------------------- item 4
@study("theory_rates", RATES_OPTIONS,
       "Pendharkar item 4: equiangular gamma-ODE vs particles, early/late rates, Lambert-W maximiser, super-additivity")
def run_rates(params, run):
    dtype = dtype_of(params)
    n, beta, g0 = params["n"], params["beta"], params["gamma0"]
    lam = [float(v) for v in params["lambdas"]]
    heads = scalar_heads(lam, n, beta, dtype)
    x0 = tp.sphere.equiangular(n, g0, n, dtype=dtype)
    off = ~torch.eye(n, dtype=torch.bool)
    metrics, curves = {}, {}
    for norm in th.REDUCED_NORMALIZATIONS:
        traj = ascent_run(x0, heads, params["t1"], params["dt"], sparse=True, normalization=norm, progress=run.progress)
        gp = (traj.x @ traj.x.transpose(-1, -2))[:, off]  # the overlaps ⟨x_i, x_j⟩, i ≠ j
        gode, gap_ode = th.gamma_ode(traj.times.to(dtype), lam, beta=beta, n=n, gamma0=g0, normalization=norm)
        metrics[f"{norm}_max_abs_error_particles_vs_ode"] = float((gp - gode[:, None]).abs().max())
        metrics[f"{norm}_max_equiangular_spread"] = float((gp.amax(-1) - gp.amin(-1)).max())
        _, gap = dg.mean_overlap(traj.x)
        curves[norm] = (traj.times, gp.mean(-1), gode, gap, gap_ode)
        # late rate: fit ln(1 − γ) on the part of the run where 1e-13 < 1 − γ < 1e-4
        sel = (gap < 1e-4) & (gap > 1e-13)
        Lam = float(th.late_rate(lam, beta, normalization=norm))
        if int(sel.sum()) >= 3:
            slope = ls_slope(traj.times[sel], gap[sel].log())
            metrics[f"{norm}_late_slope"] = slope
            metrics[f"{norm}_late_slope_rel_error"] = abs(slope / (-2 * Lam) - 1)
        metrics[f"{norm}_late_rate_Lambda"] = Lam
    # early rate at orthogonal tokens: exact from the particle field at t = 0
    xo = torch.eye(n, dtype=dtype)
    V = tp.velocity(xo, heads)
    rate_p = float((V @ xo.T + xo @ V.T)[off].mean())
    rate_c = float(th.early_rate(torch.tensor(lam, dtype=dtype), beta, n).sum())
    metrics.update(early_rate_particles=rate_p, early_rate_closed_form=rate_c,
                   early_rate_rel_error=abs(rate_p / rate_c - 1))
    # Lambert-W maximiser vs a dense grid
    grid = torch.linspace(1e-4, 12 / beta, 200001, dtype=torch.float64)
    worst = 0.0
    phis = {}
    for m in params["phi_n"]:
        ls, ps = th.optimal_head_strength(beta, m)
        vals = th.early_rate(grid, beta, m)
        lg = float(grid[int(vals.argmax())])
        worst = max(worst, abs(lg - ls) / ls)
        phis[m] = (vals, ls, ps)
        metrics[f"lambda_star_n{m}"] = ls
        metrics[f"phi_star_n{m}"] = ps
    metrics["lambda_star_grid_rel_error"] = worst
    spreads, sa = _superadditivity(params, xo, metrics, dtype)
    run.save_series("superadditivity", {"spread": spreads, **{f"gain_total{k:g}": v for k, v in sa.items()}})
    t, gmean, gode, gap, gap_ode = curves["softmax"]
    run.save_series("gamma_softmax", {"t": t, "gamma_particles": gmean, "gamma_ode": gode, "gap": gap,
                                      "gap_ode": gap_ode})
    _rates_figure(run, params, metrics, curves, (grid, phis), (spreads, sa))
    return metrics


def _rates_figure(run, params, metrics, curves, phi, gains) -> None:
    lam, beta, n = [float(v) for v in params["lambdas"]], params["beta"], params["n"]
    fig, ax = subplots(2, 2, (11, 8), "Pendharkar rates: softmax scalar heads, ω_h = 1, ascent (tokens cluster)")
    for i, norm in enumerate(th.REDUCED_NORMALIZATIONS):
        t, gm_, go, gp_, gpo = curves[norm]
        ax[0, 0].plot(t.numpy(), go.numpy(), f"C{i}", lw=1, label=f"{norm}: γ-ODE")
        ax[0, 0].plot(t.numpy()[::4], gm_.numpy()[::4], f"C{i}o", ms=3, label=f"{norm}: particles")
        ax[1, 0].semilogy(t.numpy(), gp_.clamp_min(1e-300).numpy(), f"C{i}", label=f"{norm}: 1 − γ (particles)")
        Lam = float(th.late_rate(lam, beta, normalization=norm))
        t_end = float(t[-1])
        if float(gp_[-1]) > 0:
            ax[1, 0].semilogy(t.numpy(), (float(gp_[-1]) * torch.exp(-2 * Lam * (t - t_end))).numpy(), f"C{i}:", lw=1)
    panel(ax[0, 0], "t", "γ(t) = ⟨x_i, x_j⟩", f"equiangular tokens, λ = {lam}, n = {n}", legend=True)
    ax[1, 0].set_ylim(1e-30, 2)
    panel(ax[1, 0], "t", "1 − γ(t)", "late decay; dotted: slope −2Λ", legend=True)
    grid, phis = phi
    for i, (m, (vals, ls, ps)) in enumerate(phis.items()):
        ax[0, 1].plot(grid.numpy(), vals.numpy(), f"C{i}", label=f"n = {m}")
        ax[0, 1].plot([ls], [ps], f"C{i}*", ms=10)
    panel(ax[0, 1], "λ", "early rate φ(λ)", "early rate φ(λ) = 2λ/(e^{λβ} + n − 1); ★ Lambert-W maximiser",
          legend=True)
    spreads, sa = gains
    lc = metrics["phi_inflection_lambda_c"]
    for i, (Lt, gain) in enumerate(sa.items()):
        ax[1, 1].plot(spreads, gain, f"C{i}", label=f"Λ = {Lt:g} (Λ/2 {'>' if Lt / 2 > lc else '<'} λ_c = {lc:.2f})")
    ax[1, 1].axhline(0, color="k", lw=0.5)
    panel(ax[1, 1], "spread s: λ = (Λ/2)(1 ± s)", "Σφ(λ_h) − Hφ(Λ/H)",
          "Σφ(λ_h) − Hφ(Λ/H): heterogeneous minus equal heads", legend=True)
    save_tidy(run, fig, "rates", "Equiangular tokens (common cosine γ). Top left: lines — the reduced γ-ODE, dots — the "
          "particle system, per normalisation. Top right: the early rate φ(λ), star at the Lambert-W maximiser. "
          "Bottom left: 1 − γ of the particles on a log axis, dotted: the predicted late slope −2Λ. Bottom right: "
          "the gain of heterogeneous over equal heads at fixed total Λ. Deterministic runs (no bands).", metrics)


def _superadditivity(params, xo, metrics, dtype):
    """H = 2 heads λ = (Λ/2)(1 ± s) vs equal heads Λ/2: the gain in φ against the spread s (returns the spreads and
    {Λ: gains}), and the particles' hitting times from the orthogonal tokens ``xo`` at the spread 0.5."""
    n, beta = params["n"], params["beta"]
    spreads = torch.linspace(0, 0.95, 20, dtype=torch.float64).tolist()
    metrics["phi_inflection_lambda_c"] = th.rate_inflection(beta, n)
    sa = {}
    for Lt in params["total"]:
        sa[Lt] = [th.superadditivity([Lt / 2 * (1 + s), Lt / 2 * (1 - s)], beta=beta, n=n)["gain"] for s in spreads]
        s_ex = 0.5
        ex = [Lt / 2 * (1 + s_ex), Lt / 2 * (1 - s_ex)]
        res = th.superadditivity(ex, beta=beta, n=n)
        metrics[f"total{Lt:g}_regime_at_spread0.5"] = res["regime"]
        metrics[f"total{Lt:g}_gain_at_spread0.5"] = res["gain"]
        # particles: hitting times from orthogonal tokens, heterogeneous vs equal heads
        for target in params["targets"]:
            times = {}
            for tag, ll in (("hetero", ex), ("equal", [Lt / 2, Lt / 2])):
                T_ode = th.hitting_time(ll, beta=beta, n=n, gamma0=0.0, target=target)
                T_p = float(dg.clustering_hitting_time(xo, scalar_heads(ll, n, beta, dtype), target=target,
                                                       t_max=1.5 * T_ode + 1.0, dt=min(params["dt"], T_ode / 200)))
                times[tag] = T_p
                metrics[f"total{Lt:g}_{tag}_time_to_{target:g}_particles"] = T_p
                metrics[f"total{Lt:g}_{tag}_time_to_{target:g}_ode"] = T_ode
            metrics[f"total{Lt:g}_hetero_faster_to_{target:g}"] = bool(times["hetero"] < times["equal"])
    return spreads, sa


# ---------------------------------------------------------------------------- item 5
@study("theory_relu_softmax", RELU_OPTIONS,
       "Pendharkar item 5: ReLU vs softmax clustering times, linearised Theta(n) vs Theta(n log d) and nonlinear")
def run_relu_softmax(params, run):
    dtype = dtype_of(params)
    lam, beta, target = params["lam"], params["beta"], params["target"]
    rows = {k: [] for k in ("normalization", "n", "d", "gamma0", "linearized", "ode", "particles")}
    for norm in _NORMS:
        for n in params["n"]:
            for d in params["d"]:
                g0 = th.typical_overlap(d)
                tl = th.linearized_clustering_time([lam], beta=beta, n=n, gamma0=g0, target=target, normalization=norm)
                to = th.hitting_time([lam], beta=beta, n=n, gamma0=g0, target=target, normalization=norm)
                tp_ = float("nan")
                if params["particles"]:
                    # equiangular tokens live in their n-dimensional span: simulate there
                    x0 = tp.sphere.equiangular(n, g0, n, dtype=dtype)
                    step = min(params["dt"], to / 100)
                    tp_ = float(dg.clustering_hitting_time(x0, scalar_heads([lam], n, beta, dtype), target=target,
                                                           t_max=1.3 * to + 5 * step, dt=step, normalization=norm))
                append_row(rows, norm, n, d, g0, tl, to, tp_)
    run.save_series("clustering_times", rows)
    metrics = {}
    ds, ns = params["d"], params["n"]
    for norm in _NORMS:
        for kind in ("linearized", "ode"):
            for d in (ds[0], ds[-1]):
                sel = select_rows(rows, ("n", kind), normalization=norm, d=d)
                if len(sel) >= 2:
                    metrics[f"{norm}_{kind}_exponent_in_n_d{d}"] = loglog_slope(*zip(*sel))
            # dependence on d at the largest n: slope of T against ln d
            sel = select_rows(rows, ("d", kind), normalization=norm, n=ns[-1])
            if len(sel) >= 2:
                metrics[f"{norm}_{kind}_slope_in_log_d_n{ns[-1]}"] = ls_slope([math.log(dd) for dd, _ in sel],
                                                                            [T for _, T in sel])
        if params["particles"]:
            errs = [abs(p / o - 1) for p, o in select_rows(rows, ("particles", "ode"), normalization=norm)]
            metrics[f"{norm}_particles_vs_ode_max_rel_error"] = max(errs)
    rnd = _random_tokens(params, dtype)
    if rnd["n"]:
        run.save_series("random_tokens", rnd)
        for norm in _NORMS:
            fr = [r for (r,) in select_rows(rnd, ("reached",), normalization=norm)]
            metrics[f"{norm}_random_tokens_fraction_reached"] = sum(fr) / len(fr)
    _relu_figure(run, params, metrics, rows, rnd)
    return metrics


def _relu_figure(run, params, metrics, rows, rnd) -> None:
    ds, ns, target = params["d"], params["n"], params["target"]
    fig, ax = subplots(1, 2, (12, 4.8), f"ReLU vs softmax clustering times, one head λ = {params['lam']}, "
                       f"β = {params['beta']}, ascent (tokens cluster)")
    for i, norm in enumerate(_NORMS):
        for j, d in enumerate(ds):
            nn, tl, to, tpp = zip(*select_rows(rows, ("n", "linearized", "ode", "particles"), normalization=norm, d=d))
            c = f"C{2 * j + i}"
            ax[0].loglog(nn, tl, "--", color=c, lw=1)
            ax[0].loglog(nn, to, "-", color=c, label=f"{norm}, d = {d}")
            if params["particles"]:
                ax[0].loglog(nn, tpp, "o", color=c, ms=4)
        dd, tl, to = zip(*select_rows(rows, ("d", "linearized", "ode"), normalization=norm, n=ns[-1]))
        ax[1].semilogx(dd, tl, "--", color=f"C{i}", label=f"{norm}, linearised")
        ax[1].semilogx(dd, to, "-o", color=f"C{i}", label=f"{norm}, nonlinear γ-ODE")
    d_rnd = params["random_d"][-1]
    for i, norm in enumerate(_NORMS):
        sel = [(n, T) for n, T in select_rows(rnd, ("n", "median_time"), normalization=norm, d=d_rnd) if math.isfinite(T)]
        if sel:
            ax[0].loglog(*zip(*sel), "x", color=f"C{i}", ms=8, label=f"{norm}, random tokens d = {d_rnd}")
    log_ticks(ax[0], ns)
    log_ticks(ax[1], ds)
    panel(ax[0], "n", f"time to γ = {target}", "dashed: linearised, solid: γ-ODE, ●: particles (equiangular)",
          legend=True)
    panel(ax[1], "d (γ0 = 1/√d)", f"time to γ = {target}", f"n = {ns[-1]}: dependence on d", legend=True)
    save_tidy(run, fig, "clustering_times", f"Time for the common cosine γ to reach {target}. Left, against n: dashed — "
          "the linearised formula, solid — the nonlinear γ-ODE, dots — the particle system (equiangular start), "
          "crosses — the median over random starts. Right, against d at the largest n. No bands: each point is one "
          "deterministic run (random tokens: the median over the ensemble).", metrics)


def _random_tokens(params, dtype) -> Dict:
    """Clustering times of random tokens (outside the equiangular reduction): the table of the ensemble medians."""
    lam, beta, target = params["lam"], params["beta"], params["target"]
    rnd = {k: [] for k in ("normalization", "n", "d", "median_time", "reached", "ode_time")}
    g = torch.Generator().manual_seed(params["seed"])
    for norm in _NORMS:
        for n in params["random_n"]:
            for d in params["random_d"]:
                x0 = tp.sphere.sample_uniform(n, d, batch_shape=(params["ensemble"],), generator=g, dtype=dtype)
                to = th.hitting_time([lam], beta=beta, n=n, gamma0=th.typical_overlap(d), target=target,
                                     normalization=norm)
                T = dg.clustering_hitting_time(x0, scalar_heads([lam], d, beta, dtype), target=target,
                                               t_max=4 * to + 1.0, dt=min(params["dt"], to / 100), normalization=norm)
                fin = T[torch.isfinite(T)]
                append_row(rnd, norm, n, d, float(T.median()) if len(fin) else float("inf"), len(fin) / len(T), to)
    return rnd


# ---------------------------------------------------------------------------- item 6
def _check_fd_step(p):
    """A central difference with a step below √(unit roundoff) of the dtype measures rounding (error ≈ ε_mach/h),
    and one above 0.1 measures curvature: neither checks the identity."""
    floor = math.sqrt(torch.finfo(dtype_of(p)).eps)
    if not floor <= p["fd_step"] <= 0.1:
        raise ValueError(f"config key 'fd_step' = {p['fd_step']:g} must lie in [{floor:.1g}, 0.1] with dtype = "
                         f"'{p['dtype']}': below, the central difference measures rounding (its error is about "
                         f"{torch.finfo(dtype_of(p)).eps:.1g}/fd_step); above, the curvature of the entropy")


@study("theory_entropy", ENTROPY_OPTIONS, "Pendharkar item 6: attention entropy, dH/dt = -Cov(s, sdot), rise to log n",
       validate=_check_fd_step)
def run_entropy(params, run):
    dtype = dtype_of(params)
    g = torch.Generator().manual_seed(params["seed"])
    n, d, H, eps = params["n"], params["d"], params["heads"], params["fd_step"]
    B = params["configs"]
    # random non-symmetric heads, untied values, random head and token weights, moving heads
    x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=g, dtype=dtype)
    A = torch.randn(B, H, d, d, generator=g, dtype=dtype)
    V = torch.randn(B, H, d, d, generator=g, dtype=dtype)
    Adot = torch.randn(B, H, d, d, generator=g, dtype=dtype)
    om = torch.rand(B, H, generator=g, dtype=dtype)
    w = torch.rand(B, n, generator=g, dtype=dtype) + 0.1
    w = w / w.sum(-1, keepdim=True)
    heads = tp.Heads(A, V, om, 1.0)
    xdot = tp.velocity(x, heads, w)
    ident = dg.entropy_rate(x, heads, w, velocity=xdot, score_rate=Adot)

    def Hat(s):  # entropy along the motion x(s) = normalise(x + s ẋ), A(s) = A + s Ȧ
        return dg.attention_entropy(tp.sphere.normalize(x + s * xdot), tp.Heads(A + s * Adot, V, om, 1.0), w)

    fd = (Hat(eps) - Hat(-eps)) / (2 * eps)
    err = (ident - fd).abs()
    metrics = {"identity_max_abs_error_vs_fd": float(err.max()),
               "identity_max_rel_error_vs_fd": float(err.max() / ident.abs().max()),
               "identity_values_checked": ident.numel()}
    # equiangular: monotone rise to ln n, closed form H(γ(t))
    m = params["equi_n"]
    g0 = params["gamma0"]
    x0 = tp.sphere.equiangular(m, g0, m, dtype=dtype) if g0 > 0 else torch.eye(m, dtype=dtype)
    hs = scalar_heads([params["lam"]], m, params["beta"], dtype)
    traj = ascent_run(x0, hs, params["t1"], params["dt"], sparse=True, progress=run.progress)
    Ht = dg.attention_entropy(traj.x, hs)[:, 0]  # (T, m)
    Hm = Ht.mean(-1)
    gbar, _ = dg.mean_overlap(traj.x)
    Hc = th.equiangular_entropy(gbar, params["lam"], params["beta"], m)
    rates = dg.entropy_rate(traj.x, hs)[:, 0].mean(-1)
    metrics.update({
        "equiangular_min_entropy_increment": float((Hm[1:] - Hm[:-1]).min()),
        "equiangular_min_entropy_rate": float(rates.min()),
        "equiangular_final_gap_to_log_n": float(math.log(m) - Hm[-1]),
        "equiangular_max_error_vs_closed_form": float((Hm - Hc).abs().max()),
        "equiangular_token_spread": float((Ht.amax(-1) - Ht.amin(-1)).max()),
    })
    # random tokens: the mean entropy under clustering (no monotonicity theorem here)
    xr = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    hr = scalar_heads([params["lam"]], d, params["beta"], dtype)
    tr = ascent_run(xr, hr, params["t1"], params["dt"], sparse=True)
    Hr = dg.attention_entropy(tr.x, hr)[:, 0]
    metrics["random_min_mean_entropy_increment"] = float((Hr.mean(-1)[1:] - Hr.mean(-1)[:-1]).min())
    metrics["random_min_token_entropy_increment"] = float((Hr[1:] - Hr[:-1]).min())
    metrics["random_final_clusters"] = int(tp.clustering.cluster_count(tr.x[-1], radius=0.05, metric="geodesic"))
    run.save_series("equiangular_entropy", {"t": traj.times, "H_particles": Hm, "H_closed_form": Hc, "dHdt": rates})

    fig, ax = subplots(1, 3, (15, 4.5), "Attention entropy, softmax heads, ascent (tokens cluster)")
    ax[0].plot(fd.flatten().numpy(), ident.flatten().numpy(), ".", ms=3)
    lim = float(fd.abs().max())
    ax[0].plot([-lim, lim], [-lim, lim], "k-", lw=0.5)
    panel(ax[0], "finite difference of H_i^h", "−Cov_p(s, ṡ)",
          f"random heads, moving A, weighted tokens\nidentity vs finite differences (max err {float(err.max()):.1e})")
    t = traj.times.numpy()
    ax[1].plot(t, Hm.numpy(), label="particles")
    ax[1].plot(t[::4], Hc.numpy()[::4], "o", ms=3, label="closed form H(γ(t))")
    ax[1].axhline(math.log(m), color="k", ls=":", label="ln n")
    panel(ax[1], "t", "attention entropy H(t)", f"equiangular tokens\nn = {m}, λ = {params['lam']}, "
          f"β = {params['beta']}", legend=True)
    ax[2].plot(tr.times.numpy(), Hr.numpy(), lw=0.5, color="0.6")
    ax[2].plot(tr.times.numpy(), Hr.mean(-1).numpy(), "C0", lw=2, label="mean over tokens")
    ax[2].axhline(math.log(n), color="k", ls=":", label="ln n")
    panel(ax[2], "t", "attention entropy H_i(t)", f"random tokens in S^{d - 1}\nH_i(t) per token (no monotonicity "
          "theorem)", legend=True)
    save_tidy(run, fig, "entropy", "Left: the entropy identity dH_i/dt = −Cov_p(s, ṡ) against finite differences, one "
          "dot per (token, head); the line is y = x. Centre: the attention entropy of equiangular tokens, particles "
          "(line) vs the closed form H(γ(t)) (dots); dotted: ln n. Right: random tokens, thin grey lines: every "
          "token's entropy, thick: their mean (no band).", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 7
@study("theory_orthogonality", ORTH_OPTIONS,
       "Pendharkar item 7: robustness to approximately orthogonal heads (principal angles 70-90 degrees)")
def run_orthogonality(params, run):
    dtype = dtype_of(params)
    H, k, alpha = params["heads"], params["k"], params["alpha"]
    d = (H + 1) * k
    g = torch.Generator().manual_seed(params["seed"])
    # tokens around a direction with equal weight in every head subspace and the shared block
    u = torch.ones(d, dtype=dtype) / math.sqrt(d)
    x = tp.sphere.normalize(u + params["spread"] * torch.randn(params["n"], d, generator=g, dtype=dtype))
    rows = {k_: [] for k_ in ("angle", "delta", "delta_formula", "min_principal_angle", "coupling_over_bound",
                              "flat_min_head_rate", "flat_min_robust_bound", "flat_certified_fraction",
                              "sphere_min_head_rate", "sphere_min_robust_bound", "sphere_certified_fraction",
                              "flat_head_energies_monotone")}
    for ang in params["angles"]:
        h = dg.approximately_orthogonal_heads(H, k, ang, alpha=alpha, beta=params["beta"], dtype=dtype)
        delta = float(dg.orthogonality_defect(h).max())
        pa = min(float(dg.principal_angles(h.score_matrix[i], h.score_matrix[j]).min())
                 for i in range(H) for j in range(i + 1, H)) if H > 1 else math.pi / 2
        cpl, bnd = dg.cross_head_coupling(x, h)
        offd = ~torch.eye(H, dtype=torch.bool)
        ratio = float((cpl.abs()[offd] / bnd[offd].clamp_min(1e-300)).max()) if H > 1 and delta > 1e-12 else 0.0
        rd = dg.radial_decomposition(x, h)
        rb_f = dg.robust_margin(x, h, flat=True)
        rb_s = dg.robust_margin(x, h)
        fl = dg.flat_flow(x, h, t1=params["flat_t1"], dt=params["flat_dt"])
        mono = bool(((fl.head_energies[1:] - fl.head_energies[:-1]) >= 0).all())
        append_row(rows, ang, delta, alpha ** 2 * math.cos(math.radians(ang)), math.degrees(pa), ratio,
                float(rd.flat_rates.min()), float(rb_f.mean(-1).min()), float((rb_f > 0).double().mean()),
                float(rd.sphere_rates.min()), float(rb_s.mean(-1).min()), float((rb_s > 0).double().mean()), mono)
    run.save_series("orthogonality", rows)
    metrics = {
        "max_delta_error_vs_alpha2_cos": max(abs(a - b) for a, b in zip(rows["delta"], rows["delta_formula"])),
        "max_principal_angle_error_deg": max(abs(a - b) for a, b in zip(rows["min_principal_angle"], rows["angle"])),
        "max_coupling_over_bound": max(rows["coupling_over_bound"]),
        "all_flat_head_energies_monotone": all(rows["flat_head_energies_monotone"]),
        "min_flat_head_rate": min(rows["flat_min_head_rate"]),
        "min_sphere_head_rate": min(rows["sphere_min_head_rate"]),
    }
    for key in ("flat_certified_fraction", "sphere_certified_fraction", "flat_min_robust_bound",
                "sphere_min_robust_bound"):
        metrics[f"{key}_at_{rows['angle'][0]:g}deg"] = rows[key][0]
        metrics[f"{key}_at_{rows['angle'][-1]:g}deg"] = rows[key][-1]

    fig, ax = subplots(1, 3, (15, 4.3),
                       f"H = {H} heads of rank {k} in d = {d}, unnormalised, ω_h = 1, ascent (tokens cluster)")
    angle = rows["angle"]
    ax[0].plot(angle, rows["delta"], "o-", label="δ = max‖A_h A_k‖ (measured)")
    ax[0].plot(angle, rows["delta_formula"], "k:", label="α² cos θ")
    ax[0].plot(angle, rows["coupling_over_bound"], "s-", label="max |⟨f_h,f_k⟩| / (δ m_h m_k)")
    panel(ax[0], "principal angle θ (degrees)", "δ and coupling ratio", "approximate orthogonality", legend=True)
    for where, mk in (("flat", "o"), ("sphere", "s")):
        ax[1].plot(angle, rows[f"{where}_min_head_rate"], f"{mk}-", label=f"{where}: min_h dE_h/dt")
        ax[1].plot(angle, rows[f"{where}_min_robust_bound"], f"{mk}:", label=f"{where}: min_h robust bound")
        ax[2].plot(angle, rows[f"{where}_certified_fraction"], f"{mk}-", label=where)
    ax[1].axhline(0, color="k", lw=0.5)
    panel(ax[1], "θ (degrees)", "dE_h/dt (min over heads)", "per-head energy rates vs the δ-corrected margin",
          legend=True)
    ax[2].set_ylim(-0.05, 1.05)
    panel(ax[2], "θ (degrees)", "certified fraction", "fraction of (head, token) pairs with robust margin > 0",
          legend=True)
    save_tidy(run, fig, "orthogonality", "Against the principal angle θ between the heads' ranges. Left: the measured "
          "overlap δ and its formula α² cos θ, and the largest cross-coupling relative to its bound (≤ 1). Centre: the "
          "smallest per-head energy rate (solid) and the δ-corrected robust bound (dotted), flat space and sphere. "
          "Right: the fraction of (head, token) pairs with a positive robust margin. Deterministic (no bands).",
          metrics)
    return metrics
