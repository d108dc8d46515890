"""Studies checking Pendharkar's multi-head theory on the full particle system (issue #6).

One kind per result; every kind writes a figure (PNG + PDF), CSV series and metrics.json.
All runs use Pendharkar's conventions: symmetric heads with V_h = A_h, head weights ω_h = 1,
direction "ascent" (tokens cluster), unnormalised heads for the energy results and softmax
scalar heads λ_h I for the quantitative ones.

    theory_energy          items 1–2: total-energy monotonicity (sphere and flat), its defect for
                           broken symmetry / value alignment, per-head energies and radial shadows
    theory_radial          item 3: radial-dominance margin and the critical β*(H, n)
    theory_rates           item 4: equiangular γ-ODE vs particles, early/late rates, Lambert-W
                           maximiser, super-additivity
    theory_relu_softmax    item 5: linearised vs nonlinear clustering times, swept over n and d
    theory_entropy         item 6: attention entropy and dH/dt = −Cov(s, ṡ)
    theory_orthogonality   item 7: approximately orthogonal heads (principal angles 70–90°)
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from . import Option, positive, study

_DT = ("float32", "float64")


# ---------------------------------------------------------------------------- option checks
def _int_list(minimum):
    def check(v):
        if not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= minimum for t in v):
            return f"must be a non-empty list of ints >= {minimum}"
        return None

    return check


def _float_list(lo=None, hi=None, *, open_lo=False):
    def check(v):
        ok = bool(v) and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in v)
        if ok and lo is not None:
            ok = all((t > lo) if open_lo else (t >= lo) for t in v)
        if ok and hi is not None:
            ok = all(t <= hi for t in v)
        if not ok:
            rng = f" in {'(' if open_lo else '['}{lo}, {hi}]" if lo is not None or hi is not None else ""
            return f"must be a non-empty list of finite numbers{rng}"
        return None

    return check


def _unit_interval(v):
    return None if 0 <= v < 1 else "must lie in [0, 1)"


def _ones(H, dtype):
    return torch.ones(H, dtype=dtype)


def _cumtrapz(t, y):
    dt = (t[1:] - t[:-1]).to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))
    return torch.cat([torch.zeros_like(y[:1]), torch.cumsum(0.5 * dt * (y[1:] + y[:-1]), 0)])


def _simpson_residual(t, E, K):
    """max_k |E(t_2k) − E(0) − ∫_0^{t_2k} K dt| on a uniform grid, the integral by composite Simpson
    (error O(dt⁴), the order of the rk4 energies), relative to max |E − E(0)|."""
    m = (len(t) - 1) // 2
    if m < 1:
        return float("nan")
    h = float(t[1] - t[0])
    panels = h / 3 * (K[0:2 * m:2] + 4 * K[1:2 * m:2] + K[2:2 * m + 1:2])
    integral = torch.cumsum(panels, 0)
    dE = E[2:2 * m + 1:2] - E[0]
    return float((dE - integral).abs().max() / (E - E[0]).abs().max().clamp_min(1e-300))


def _loglog_slope(x, y):
    """Least-squares slope of log y against log x (positive entries only)."""
    xs = torch.as_tensor(x, dtype=torch.float64)
    ys = torch.as_tensor(y, dtype=torch.float64)
    keep = (xs > 0) & (ys > 0) & torch.isfinite(ys)
    if int(keep.sum()) < 2:
        return float("nan")
    lx, ly = xs[keep].log(), ys[keep].log()
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _save(run, fig, name: str, caption: str, metrics: Dict) -> None:
    """Legends under their axes, a caption line under the figure (and in metrics["figure_captions"]), save."""
    from .. import plotting

    plotting.finish_figure(fig, caption)
    metrics.setdefault("figure_captions", {})[name] = caption
    run.save_figure(fig, name)


def _log_ticks_at(ax, values) -> None:
    """Tick a log x axis at the data values only (no crowded minor labels)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter, NullLocator

    vals = sorted(set(float(v) for v in values))
    ax.xaxis.set_major_locator(FixedLocator(vals))
    ax.xaxis.set_major_formatter(FixedFormatter([f"{v:g}" for v in vals]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


# ---------------------------------------------------------------------------- items 1–2
ENERGY_OPTIONS = {
    "n": Option(24, (int,), "number of tokens", check=positive),
    "d": Option(3, (int,), "dimension", check=positive),
    "heads": Option(3, (int,), "number of heads H", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature", check=positive),
    "scale": Option(0.4, (float,), "scale of the random symmetric heads Z + Zᵀ", check=positive),
    "t1": Option(2.0, (float,), "final time of the sphere runs", check=positive),
    "dt": Option(0.01, (float,), "time step (rk4)", check=positive),
    "flat_t1": Option(0.1, (float,), "final time of the flat runs (they blow up in finite time)", check=positive),
    "flat_dt": Option(0.001, (float,), "time step of the flat runs", check=positive),
    "epsilons": Option([0.0125, 0.025, 0.05, 0.1, 0.2], (list,), "sizes of the symmetry / value-alignment breaking",
                       check=_float_list(0.0, None, open_lo=True)),
    "orth_angle": Option(60.0, (float,), "direction (degrees) of the token cluster in the orthogonal-heads example",
                         check=lambda v: None if 0 < v < 90 else "must lie in (0, 90)"),
    "seed": Option(0, (int,), "seed of tokens and heads"),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_energy", ENERGY_OPTIONS,
       "Pendharkar items 1-2: energy monotonicity (sphere/flat), its defect, per-head energies and radial shadows")
def run_energy(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg

    dtype = getattr(torch, params["dtype"])
    g = torch.Generator().manual_seed(params["seed"])
    n, d, H, beta = params["n"], params["d"], params["heads"], params["beta"]
    x0 = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    heads = tp.Heads.random(H, d, generator=g, scale=params["scale"], beta=beta, weights=_ones(H, dtype), dtype=dtype)
    metrics = {}

    # -- 1. total energy along the sphere dynamics: E(t) − E(0) = ∫ (1/n) Σ ‖ẋ_i‖² dt
    traj = tp.simulate(x0, heads, t1=params["t1"], dt=params["dt"], method="rk4", normalization="unnormalized",
                       direction="ascent", progress=run.progress)
    kin = dg.energy_balance(traj.x, heads).kinetic
    dE = traj.energy - traj.energy[0]
    ikin = _cumtrapz(traj.times, kin)
    metrics["sphere_identity_rel_residual"] = _simpson_residual(traj.times, traj.energy, kin)
    metrics["sphere_min_energy_increment"] = float((traj.energy[1:] - traj.energy[:-1]).min())
    metrics["sphere_energy_gain"] = float(dE[-1])

    # -- flat (unprojected) dynamics
    ft = dg.flat_flow(x0, heads, t1=params["flat_t1"], dt=params["flat_dt"])
    dEf = ft.energy - ft.energy[0]
    ikf = _cumtrapz(ft.times, ft.kinetic)
    metrics["flat_identity_rel_residual"] = _simpson_residual(ft.times, ft.energy, ft.kinetic)
    metrics["flat_min_energy_increment"] = float((ft.energy[1:] - ft.energy[:-1]).min())
    metrics["flat_max_token_norm"] = float(ft.norms[-1])

    # -- defect when symmetry (A ≠ Aᵀ) or value alignment (V ≠ A) is broken
    A = heads.score_matrix
    Kr = torch.randn(H, d, d, generator=g, dtype=dtype)
    K = Kr - Kr.transpose(-1, -2)
    K = K / torch.linalg.matrix_norm(K, ord=2)[..., None, None]
    N = torch.randn(H, d, d, generator=g, dtype=dtype)
    N = N / torch.linalg.matrix_norm(N, ord=2)[..., None, None]
    eps = [float(e) for e in params["epsilons"]]
    t_half = max(1, round(params["t1"] / (4 * params["dt"]))) * 2 * params["dt"]  # ≈ t1/2 on the 2·dt grid
    rows = {"epsilon": eps, "defect_asym": [], "bound_asym": [], "defect_value": [], "bound_value": [],
            "ledger_asym": [], "ledger_value": []}
    for e in eps:
        for tag, h in (("asym", tp.Heads(A + e * K, None, _ones(H, dtype), beta)),
                       ("value", tp.Heads(A, A + e * N, _ones(H, dtype), beta))):
            bal = dg.energy_balance(x0, h)
            rows[f"defect_{tag}"].append(float(bal.defect))
            rows[f"bound_{tag}"].append(float(bal.bound))
            tr = tp.simulate(x0, h, t1=t_half, dt=2 * params["dt"], method="rk4",
                             normalization="unnormalized", direction="ascent")
            kin_e = dg.energy_balance(tr.x, h).kinetic
            rows[f"ledger_{tag}"].append(float((tr.energy - tr.energy[0] - _cumtrapz(tr.times, kin_e)).abs().max()))
    for tag in ("asym", "value"):
        de = [abs(v) for v in rows[f"defect_{tag}"]]
        # the defect is O(ε); its first-order coefficient depends on the configuration (it can be small)
        metrics[f"defect_{tag}_over_epsilon_at_min"] = de[0] / eps[0]
        metrics[f"defect_{tag}_at_max_epsilon"] = de[-1]
        metrics[f"defect_{tag}_max_over_bound"] = max(a / b for a, b in zip(de, rows[f"bound_{tag}"]))
        metrics[f"ledger_gap_{tag}_at_max_epsilon"] = rows[f"ledger_{tag}"][-1]
    run.save_series("defect", rows)

    # -- 2. exactly orthogonal heads: a per-head energy decreases on the sphere, not in flat space
    th0 = math.radians(params["orth_angle"])
    base = torch.tensor([math.cos(th0), math.sin(th0)], dtype=dtype)
    xo = tp.sphere.normalize(base + 0.1 * torch.randn(n, 2, generator=g, dtype=dtype))
    Ao = torch.zeros(2, 2, 2, dtype=dtype)
    Ao[0, 0, 0] = Ao[1, 1, 1] = 1.0
    ho = tp.Heads.symmetric(Ao, beta=beta, weights=_ones(2, dtype))
    rd = dg.radial_decomposition(xo, ho)
    metrics.update({
        "orth_head_defect": float(dg.orthogonality_defect(ho).max()),
        "orth_rate_head1_sphere": float(rd.sphere_rates[0]), "orth_rate_head1_flat": float(rd.flat_rates[0]),
        "orth_rate_head2_sphere": float(rd.sphere_rates[1]), "orth_rate_head2_flat": float(rd.flat_rates[1]),
        "orth_cross_coupling_12": float(rd.coupling[0, 1]), "orth_shadow_coupling_12": float(rd.shadow[0, 1]),
    })
    to = tp.simulate(xo, ho, t1=t_half, dt=params["dt"], method="rk4", normalization="unnormalized",
                     direction="ascent")
    Eh_s = tp.head_energies(to.x, ho)
    fo = dg.flat_flow(xo, ho, t1=params["flat_t1"], dt=params["flat_dt"])
    metrics["orth_head1_change_sphere"] = float(Eh_s[-1, 0] - Eh_s[0, 0])
    metrics["orth_head1_change_flat"] = float(fo.head_energies[-1, 0] - fo.head_energies[0, 0])
    metrics["orth_head1_max_increment_sphere"] = float((Eh_s[1:, 0] - Eh_s[:-1, 0]).max())
    metrics["orth_head1_min_increment_flat"] = float((fo.head_energies[1:, 0] - fo.head_energies[:-1, 0]).min())
    run.save_series("sphere_energy", {"t": traj.times, "dE": dE, "int_kinetic": ikin})
    run.save_series("flat_energy", {"t": ft.times, "dE": dEf, "int_kinetic": ikf})
    run.save_series("orthogonal_sphere", {"t": to.times, "E1": Eh_s[:, 0], "E2": Eh_s[:, 1]})
    run.save_series("orthogonal_flat", {"t": fo.times, "E1": fo.head_energies[:, 0], "E2": fo.head_energies[:, 1]})

    plt = _plt()
    fig, ax = plt.subplots(2, 3, figsize=(14, 7.5))
    t = traj.times.numpy()
    ax[0, 0].plot(t, dE.numpy(), label="E(t) − E(0)")
    ax[0, 0].plot(t, ikin.numpy(), "--", label="∫ (1/n)Σ‖ẋ‖² dt")
    ax[0, 0].set_title("sphere: dE/dt = (1/n)Σ‖ẋ_i‖²")
    ax[0, 1].plot(ft.times.numpy(), dEf.numpy(), label="E(t) − E(0)")
    ax[0, 1].plot(ft.times.numpy(), ikf.numpy(), "--", label="∫ (1/n)Σ‖ẋ‖² dt")
    ax[0, 1].set_title("flat (unprojected) dynamics")
    for tag, mk in (("asym", "o"), ("value", "s")):
        ax[0, 2].loglog(eps, [abs(v) for v in rows[f"defect_{tag}"]], mk + "-",
                        label=f"|defect|, {'A ≠ Aᵀ' if tag == 'asym' else 'V ≠ A'}")
        ax[0, 2].loglog(eps, rows[f"bound_{tag}"], mk + ":", label=f"bound, {'A ≠ Aᵀ' if tag == 'asym' else 'V ≠ A'}")
    ax[0, 2].set_xlabel("ε")
    ax[0, 2].set_xticks(eps, [f"{e:g}" for e in eps])
    ax[0, 2].minorticks_off()
    ax[0, 2].set_title("monotonicity defect at t = 0")
    for h, c in ((0, "C0"), (1, "C1")):
        ax[1, 0].plot(to.times.numpy(), (Eh_s[:, h] - Eh_s[0, h]).numpy(), c, label=f"E_{h + 1}")
        ax[1, 1].plot(fo.times.numpy(), (fo.head_energies[:, h] - fo.head_energies[0, h]).numpy(), c, label=f"E_{h + 1}")
    ax[1, 0].set_title(f"orthogonal heads e₁e₁ᵀ, e₂e₂ᵀ on the sphere (cluster at {params['orth_angle']:.0f}°)")
    ax[1, 1].set_title("same heads, flat dynamics")
    labels = ["C₁₁−S₁₁", "C₁₂", "−S₁₂", "C₂₂−S₂₂", "C₂₁", "−S₂₁"]
    vals = [float(rd.tangential[0]), float(rd.coupling[0, 1]), -float(rd.shadow[0, 1]),
            float(rd.tangential[1]), float(rd.coupling[1, 0]), -float(rd.shadow[1, 0])]
    ax[1, 2].bar(range(6), vals, color=["C0", "C0", "C0", "C1", "C1", "C1"])
    ax[1, 2].set_xticks(range(6), labels)
    ax[1, 2].axhline(0, color="k", lw=0.5)
    ax[1, 2].set_title("dE_h/dt terms at t = 0: tangential, cross, radial shadow")
    for a in ax.flat[:5]:
        a.legend(fontsize=8)
    for a in (ax[0, 0], ax[0, 1], ax[1, 0], ax[1, 1]):
        a.set_xlabel("t")
    ax[0, 0].set_ylabel("energy gain")
    ax[0, 1].set_ylabel("energy gain")
    ax[0, 2].set_ylabel("|dE/dt defect| and its bound")
    ax[1, 0].set_ylabel("head energy E_h(t) − E_h(0)")
    ax[1, 1].set_ylabel("head energy E_h(t) − E_h(0)")
    ax[1, 2].set_ylabel("term of dE_h/dt at t = 0")
    ax[1, 2].set_xlabel("term (blue: head 1, orange: head 2)")
    fig.suptitle("Pendharkar energy results, unnormalised heads, ω_h = 1, ascent (tokens cluster)")
    _save(run, fig, "energy", "Deterministic runs (no bands). Top left/centre: the energy gain E(t) − E(0) against "
          "the integrated kinetic term ∫(1/n)Σ‖ẋ_i‖² dt on the sphere and in flat space (the curves coincide: the "
          "energy identity). Top right: the monotonicity defect at t = 0 for non-symmetric A (A ≠ Aᵀ) and V ≠ A at "
          "perturbation size ε (solid) and its bound (dotted). Bottom: per-head energies of two orthogonal heads "
          "(one decreases on the sphere, not in flat space) and the terms of dE_h/dt at t = 0.", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 3
RADIAL_OPTIONS = {
    "heads": Option([1, 2, 3, 4, 5], (list,), "numbers of equal heads H", check=_int_list(1)),
    "n": Option([3, 5, 10, 20, 50, 100], (list,), "numbers of tokens", check=_int_list(2)),
    "alpha": Option(1.0, (float,), "head strength α (A_h = αI)", check=positive),
    "gammas": Option([0.05, 0.1, 0.2], (list,), "equiangular overlaps γ > 0 (outside the orthogonal regime)",
                     check=_float_list(0.0, 0.99)),
    "hetero": Option([0.5, 1.0, 2.0], (list,), "unequal head strengths for the heterogeneous example",
                     check=_float_list(0.0, None, open_lo=True)),
    "hetero_n": Option(50, (int,), "tokens in the heterogeneous example", check=positive),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_radial", RADIAL_OPTIONS, "Pendharkar item 3: radial-dominance margin and critical beta*(H, n)")
def run_radial(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg, theory as th

    dtype = getattr(torch, params["dtype"])
    alpha = params["alpha"]
    rows = {"H": [], "n": [], "form": [], "gamma": [], "closed_form": [], "numeric": [], "rel_error": []}

    def add(H, n, form, gamma, cf, num):
        rows["H"].append(H)
        rows["n"].append(n)
        rows["form"].append(form)
        rows["gamma"].append(gamma)
        rows["closed_form"].append(cf)
        rows["numeric"].append(num)
        if math.isfinite(cf) and cf > 1e-12:
            err = abs(num - cf) / cf
        else:  # β* = inf (H = 1) or ≤ 0 (to rounding): the margin never / always is negative for β > 0
            err = 0.0 if (num == cf or (cf <= 1e-12 and num == -math.inf)) else math.inf
        rows["rel_error"].append(err)

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

    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = sorted(set(params["n"]))
    nn = list(range(min(ns), max(ns) + 1))
    for i, H in enumerate(params["heads"]):
        if H == 1:
            continue
        c = f"C{i}"
        ax[0].plot(nn, [th.critical_beta(H, v, alpha) for v in nn], c, lw=1)
        sel = [(n, b) for Hh, n, f, gm, b in zip(rows["H"], rows["n"], rows["form"], rows["gamma"], rows["numeric"])
               if Hh == H and f == "token" and gm == 0.0 and math.isfinite(b)]
        if sel:
            ax[0].plot(*zip(*sel), "o", color=c, label=f"H = {H} (c* = {th.critical_cosine(H):.3f})")
        selp = [(n, b) for Hh, n, f, b in zip(rows["H"], rows["n"], rows["form"], rows["numeric"])
                if Hh == H and f == "pairwise" and math.isfinite(b)]
        if selp:
            ax[0].plot(*zip(*selp), "x", color=c, alpha=0.6)
    ax[0].set_xscale("log")
    _log_ticks_at(ax[0], ns)
    ax[0].set_xlabel("n (orthogonal tokens)")
    ax[0].set_ylabel("β*")
    ax[0].set_title(f"β*(H, n), α = {alpha}: lines formula, ● token margin, × pairwise margin")
    ax[0].legend(fontsize=8)
    # margin vs β for H = 2 (first n >= 5)
    n2 = next((n for n in ns if n >= 5), ns[-1])
    Hs = [H for H in params["heads"] if H >= 2] or [2]
    H2 = Hs[0]
    x = tp.sphere.equiangular(n2, 0.0, n2, dtype=dtype)
    bstar = th.critical_beta(H2, n2, alpha)
    bmax = 3 * bstar if math.isfinite(bstar) and bstar > 0 else 3.0
    betas = torch.linspace(bmax / 300, bmax, 300, dtype=dtype)
    hb = tp.Heads.scalar(torch.full((len(betas), H2), alpha, dtype=dtype), n2, beta=betas,
                         weights=torch.ones(len(betas), H2, dtype=dtype))
    for form, ls in (("token", "-"), ("pairwise", "--")):
        m = dg.radial_dominance_margin(x, hb, form=form)[:, 0, 0]
        ax[1].plot(betas.numpy(), m.numpy(), ls, label=f"{form} margin")
    ax[1].axhline(0, color="k", lw=0.5)
    if math.isfinite(bstar) and bstar > 0:
        ax[1].axvline(bstar, color="C3", ls=":", label=f"β* = {bstar:.4f}")
    ax[1].set_xlabel("β")
    ax[1].set_ylabel("radial-dominance margin")
    ax[1].set_title(f"margin of head 1, H = {H2}, n = {n2}, softmax, orthogonal tokens")
    ax[1].legend(fontsize=8)
    _save(run, fig, "radial_dominance", "Left: the critical inverse temperature β*(H, n) — lines: the closed form; "
          "dots: where the token margin of the particle system changes sign; crosses: the same for the pairwise "
          "margin. Right: both margins against β for one configuration; dotted: the closed-form β*. Deterministic "
          "computations (no bands).", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 4
RATES_OPTIONS = {
    "n": Option(8, (int,), "number of tokens (equiangular, d = n)", check=lambda v: None if v >= 2 else "must be >= 2"),
    "lambdas": Option([0.5, 1.5], (list,), "head strengths λ_h (A_h = λ_h I)", check=_float_list(0.0, None, open_lo=True)),
    "beta": Option(1.0, (float,), "inverse temperature", check=positive),
    "gamma0": Option(0.05, (float,), "initial overlap of the equiangular tokens", check=_unit_interval),
    "t1": Option(6.0, (float,), "final time", check=positive),
    "dt": Option(0.01, (float,), "time step (rk4)", check=positive),
    "phi_n": Option([2, 8, 32, 128], (list,), "token numbers for the φ(λ) curves", check=_int_list(2)),
    "total": Option([2.0, 16.0], (list,), "total strengths Λ for the super-additivity example (H = 2)",
                    check=_float_list(0.0, None, open_lo=True)),
    "targets": Option([0.05, 0.5], (list,), "overlaps defining the hitting times (from orthogonal tokens)",
                      check=_float_list(0.0, 0.99, open_lo=True)),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_rates", RATES_OPTIONS,
       "Pendharkar item 4: equiangular gamma-ODE vs particles, early/late rates, Lambert-W maximiser, super-additivity")
def run_rates(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg, theory as th

    dtype = getattr(torch, params["dtype"])
    n, beta, g0 = params["n"], params["beta"], params["gamma0"]
    lam = [float(v) for v in params["lambdas"]]
    H = len(lam)
    lam_t = torch.tensor(lam, dtype=dtype)
    heads = tp.Heads.scalar(lam_t, n, beta=beta, weights=_ones(H, dtype))
    x0 = tp.sphere.equiangular(n, g0, n, dtype=dtype)
    off = ~torch.eye(n, dtype=torch.bool)
    metrics, curves = {}, {}
    for norm in th.REDUCED_NORMALIZATIONS:
        traj = tp.simulate(x0, heads, t1=params["t1"], dt=params["dt"], method="rk4", normalization=norm,
                           direction="ascent", diagnostics=False, record_every=max(1, round(0.05 / params["dt"])),
                           progress=run.progress)
        Gm = traj.x @ traj.x.transpose(-1, -2)
        gp = Gm[:, off]
        gode, gap_ode = th.gamma_ode(traj.times.to(dtype), lam, beta=beta, n=n, gamma0=g0, normalization=norm)
        metrics[f"{norm}_max_abs_error_particles_vs_ode"] = float((gp - gode[:, None]).abs().max())
        metrics[f"{norm}_max_equiangular_spread"] = float((gp.amax(-1) - gp.amin(-1)).max())
        _, gap = dg.mean_overlap(traj.x)
        curves[norm] = (traj.times, gp.mean(-1), gode, gap, gap_ode)
        # late rate: fit ln(1 − γ) on the part of the run where 1e-13 < 1 − γ < 1e-4
        sel = (gap < 1e-4) & (gap > 1e-13)
        Lam = float(th.late_rate(lam, beta, normalization=norm))
        if int(sel.sum()) >= 3:
            tt, ll = traj.times[sel].to(torch.float64), gap[sel].log().to(torch.float64)
            tc = tt - tt.mean()
            slope = float((tc * (ll - ll.mean())).sum() / (tc * tc).sum())
            metrics[f"{norm}_late_slope"] = slope
            metrics[f"{norm}_late_slope_rel_error"] = abs(slope / (-2 * Lam) - 1)
        metrics[f"{norm}_late_rate_Lambda"] = Lam
    # early rate at orthogonal tokens: exact from the particle field at t = 0
    xo = torch.eye(n, dtype=dtype)
    V = tp.velocity(xo, heads)
    rate_p = float((V @ xo.T + xo @ V.T)[off].mean())
    rate_c = float(th.early_rate(lam_t, beta, n).sum())
    metrics["early_rate_particles"] = rate_p
    metrics["early_rate_closed_form"] = rate_c
    metrics["early_rate_rel_error"] = abs(rate_p / rate_c - 1)
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
    # super-additivity: H = 2 heads λ = (Λ/2)(1 ± s) vs equal heads Λ/2
    spreads = torch.linspace(0, 0.95, 20, dtype=torch.float64).tolist()
    lc = th.rate_inflection(beta, n)
    metrics["phi_inflection_lambda_c"] = lc
    sa = {}
    for Lt in params["total"]:
        gains = [th.superadditivity([Lt / 2 * (1 + s), Lt / 2 * (1 - s)], beta=beta, n=n)["gain"] for s in spreads]
        sa[Lt] = gains
        s_ex = 0.5
        ex = [Lt / 2 * (1 + s_ex), Lt / 2 * (1 - s_ex)]
        res = th.superadditivity(ex, beta=beta, n=n)
        metrics[f"total{Lt:g}_regime_at_spread0.5"] = res["regime"]
        metrics[f"total{Lt:g}_gain_at_spread0.5"] = res["gain"]
        # particles: hitting times from orthogonal tokens, heterogeneous vs equal heads
        for target in params["targets"]:
            times = {}
            for tag, ll in (("hetero", ex), ("equal", [Lt / 2, Lt / 2])):
                hh = tp.Heads.scalar(torch.tensor(ll, dtype=dtype), n, beta=beta, weights=_ones(2, dtype))
                T_ode = th.hitting_time(ll, beta=beta, n=n, gamma0=0.0, target=target)
                T_p = float(dg.clustering_hitting_time(xo, hh, target=target, t_max=1.5 * T_ode + 1.0,
                                                       dt=min(params["dt"], T_ode / 200)))
                times[tag] = T_p
                metrics[f"total{Lt:g}_{tag}_time_to_{target:g}_particles"] = T_p
                metrics[f"total{Lt:g}_{tag}_time_to_{target:g}_ode"] = T_ode
            metrics[f"total{Lt:g}_hetero_faster_to_{target:g}"] = bool(times["hetero"] < times["equal"])
    run.save_series("superadditivity", {"spread": spreads, **{f"gain_total{k:g}": v for k, v in sa.items()}})
    t, gmean, gode, gap, gap_ode = curves["softmax"]
    run.save_series("gamma_softmax", {"t": t, "gamma_particles": gmean, "gamma_ode": gode, "gap": gap, "gap_ode": gap_ode})

    plt = _plt()
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for i, norm in enumerate(th.REDUCED_NORMALIZATIONS):
        t, gm_, go, gp_, gpo = curves[norm]
        ax[0, 0].plot(t.numpy(), go.numpy(), f"C{i}", lw=1, label=f"{norm}: γ-ODE")
        ax[0, 0].plot(t.numpy()[::4], gm_.numpy()[::4], f"C{i}o", ms=3, label=f"{norm}: particles")
        ax[1, 0].semilogy(t.numpy(), gp_.clamp_min(1e-300).numpy(), f"C{i}", label=f"{norm}: 1 − γ (particles)")
        Lam = float(th.late_rate(lam, beta, normalization=norm))
        t_end = float(t[-1])
        if float(gp_[-1]) > 0:
            ax[1, 0].semilogy(t.numpy(), (float(gp_[-1]) * torch.exp(-2 * Lam * (t - t_end))).numpy(), f"C{i}:", lw=1)
    ax[0, 0].set_title(f"equiangular tokens, λ = {lam}, n = {n}")
    ax[0, 0].set_xlabel("t")
    ax[0, 0].legend(fontsize=7)
    ax[1, 0].set_ylim(1e-30, 2)
    ax[1, 0].set_title("late decay; dotted: slope −2Λ")
    ax[1, 0].set_xlabel("t")
    ax[1, 0].legend(fontsize=7)
    for i, (m, (vals, ls, ps)) in enumerate(phis.items()):
        ax[0, 1].plot(grid.numpy(), vals.numpy(), f"C{i}", label=f"n = {m}")
        ax[0, 1].plot([ls], [ps], f"C{i}*", ms=10)
    ax[0, 1].set_xlabel("λ")
    ax[0, 1].set_title("early rate φ(λ) = 2λ/(e^{λβ} + n − 1); ★ Lambert-W maximiser")
    ax[0, 1].legend(fontsize=8)
    for i, (Lt, gains) in enumerate(sa.items()):
        ax[1, 1].plot(spreads, gains, f"C{i}", label=f"Λ = {Lt:g} (Λ/2 {'>' if Lt / 2 > lc else '<'} λ_c = {lc:.2f})")
    ax[1, 1].axhline(0, color="k", lw=0.5)
    ax[1, 1].set_xlabel("spread s: λ = (Λ/2)(1 ± s)")
    ax[1, 1].set_title("Σφ(λ_h) − Hφ(Λ/H): heterogeneous minus equal heads")
    ax[1, 1].legend(fontsize=8)
    ax[0, 0].set_ylabel("γ(t) = ⟨x_i, x_j⟩")
    ax[0, 1].set_ylabel("early rate φ(λ)")
    ax[1, 0].set_ylabel("1 − γ(t)")
    ax[1, 1].set_ylabel("Σφ(λ_h) − Hφ(Λ/H)")
    fig.suptitle("Pendharkar rates: softmax scalar heads, ω_h = 1, ascent (tokens cluster)")
    _save(run, fig, "rates", "Equiangular tokens (common cosine γ). Top left: lines — the reduced γ-ODE, dots — the "
          "particle system, per normalisation. Top right: the early rate φ(λ), star at the Lambert-W maximiser. "
          "Bottom left: 1 − γ of the particles on a log axis, dotted: the predicted late slope −2Λ. Bottom right: "
          "the gain of heterogeneous over equal heads at fixed total Λ. Deterministic runs (no bands).", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 5
RELU_OPTIONS = {
    "n": Option([8, 16, 32, 64], (list,), "numbers of tokens", check=_int_list(2)),
    "d": Option([16, 256, 4096], (list,), "dimensions (initial overlap γ0 = 1/√d)", check=_int_list(2)),
    "lam": Option(1.0, (float,), "head strength λ (one head A = λI)", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature", check=positive),
    "target": Option(0.5, (float,), "overlap defining the clustering time", check=_unit_interval),
    "particles": Option(True, (bool,), "also run the equiangular particle system for every (n, d)"),
    "random_n": Option([8, 16], (list,), "token numbers of the random-token runs ([] to skip)",
                       check=lambda v: None if all(isinstance(t, int) and t >= 2 for t in v) else "ints >= 2"),
    "random_d": Option([16, 64], (list,), "dimensions of the random-token runs", check=_int_list(2)),
    "ensemble": Option(4, (int,), "random-token ensemble size", check=positive),
    "dt": Option(0.05, (float,), "largest time step (rk4)", check=positive),
    "seed": Option(0, (int,), "seed of the random tokens"),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_relu_softmax", RELU_OPTIONS,
       "Pendharkar item 5: ReLU vs softmax clustering times, linearised Theta(n) vs Theta(n log d) and nonlinear")
def run_relu_softmax(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg, theory as th

    dtype = getattr(torch, params["dtype"])
    lam, beta, target = params["lam"], params["beta"], params["target"]
    rows = {k: [] for k in ("normalization", "n", "d", "gamma0", "linearized", "ode", "particles")}
    for norm in ("softmax", "relu"):
        for n in params["n"]:
            for d in params["d"]:
                g0 = th.typical_overlap(d)
                tl = th.linearized_clustering_time([lam], beta=beta, n=n, gamma0=g0, target=target, normalization=norm)
                to = th.hitting_time([lam], beta=beta, n=n, gamma0=g0, target=target, normalization=norm)
                tp_ = float("nan")
                if params["particles"]:
                    # equiangular tokens live in their n-dimensional span: simulate there
                    x0 = tp.sphere.equiangular(n, g0, n, dtype=dtype)
                    hh = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), n, beta=beta, weights=_ones(1, dtype))
                    step = min(params["dt"], to / 100)
                    tp_ = float(dg.clustering_hitting_time(x0, hh, target=target, t_max=1.3 * to + 5 * step, dt=step,
                                                           normalization=norm))
                for k, v in zip(rows, (norm, n, d, g0, tl, to, tp_)):
                    rows[k].append(v)
    run.save_series("clustering_times", rows)
    metrics = {}
    ds, ns = params["d"], params["n"]
    for norm in ("softmax", "relu"):
        for kind in ("linearized", "ode"):
            for d in (ds[0], ds[-1]):
                sel = [(n, T) for nm, n, dd, T in zip(rows["normalization"], rows["n"], rows["d"], rows[kind])
                       if nm == norm and dd == d]
                if len(sel) >= 2:
                    metrics[f"{norm}_{kind}_exponent_in_n_d{d}"] = _loglog_slope(*zip(*sel))
            # dependence on d at the largest n: slope of T against ln d
            sel = [(math.log(dd), T) for nm, n, dd, T in zip(rows["normalization"], rows["n"], rows["d"], rows[kind])
                   if nm == norm and n == ns[-1]]
            if len(sel) >= 2:
                lx = torch.tensor([s[0] for s in sel], dtype=torch.float64)
                ly = torch.tensor([s[1] for s in sel], dtype=torch.float64)
                lc = lx - lx.mean()
                metrics[f"{norm}_{kind}_slope_in_log_d_n{ns[-1]}"] = float((lc * (ly - ly.mean())).sum() / (lc * lc).sum())
        if params["particles"]:
            errs = [abs(p / o - 1) for nm, p, o in zip(rows["normalization"], rows["particles"], rows["ode"])
                    if nm == norm]
            metrics[f"{norm}_particles_vs_ode_max_rel_error"] = max(errs)
    # random tokens (outside the equiangular reduction)
    rnd = {k: [] for k in ("normalization", "n", "d", "median_time", "reached", "ode_time")}
    g = torch.Generator().manual_seed(params["seed"])
    for norm in ("softmax", "relu"):
        for n in params["random_n"]:
            for d in params["random_d"]:
                x0 = tp.sphere.sample_uniform(n, d, batch_shape=(params["ensemble"],), generator=g, dtype=dtype)
                hh = tp.Heads.scalar(torch.tensor([lam], dtype=dtype), d, beta=beta, weights=_ones(1, dtype))
                to = th.hitting_time([lam], beta=beta, n=n, gamma0=th.typical_overlap(d), target=target,
                                     normalization=norm)
                T = dg.clustering_hitting_time(x0, hh, target=target, t_max=4 * to + 1.0,
                                               dt=min(params["dt"], to / 100), normalization=norm)
                fin = T[torch.isfinite(T)]
                for k, v in zip(rnd, (norm, n, d, float(T.median()) if len(fin) else float("inf"),
                                      len(fin) / len(T), to)):
                    rnd[k].append(v)
    if rnd["n"]:
        run.save_series("random_tokens", rnd)
        for norm in ("softmax", "relu"):
            fr = [r for nm, r in zip(rnd["normalization"], rnd["reached"]) if nm == norm]
            metrics[f"{norm}_random_tokens_fraction_reached"] = sum(fr) / len(fr)

    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, norm in enumerate(("softmax", "relu")):
        for j, d in enumerate(ds):
            sel = [(n, tl, to, tpp) for nm, n, dd, tl, to, tpp in zip(rows["normalization"], rows["n"], rows["d"],
                                                                      rows["linearized"], rows["ode"], rows["particles"])
                   if nm == norm and dd == d]
            nn, tl, to, tpp = zip(*sel)
            c = f"C{2 * j + i}"
            ax[0].loglog(nn, tl, "--", color=c, lw=1)
            ax[0].loglog(nn, to, "-", color=c, label=f"{norm}, d = {d}")
            if params["particles"]:
                ax[0].loglog(nn, tpp, "o", color=c, ms=4)
        n_big = ns[-1]
        sel = [(dd, tl, to) for nm, n, dd, tl, to in zip(rows["normalization"], rows["n"], rows["d"],
                                                         rows["linearized"], rows["ode"]) if nm == norm and n == n_big]
        dd, tl, to = zip(*sel)
        ax[1].semilogx(dd, tl, "--", color=f"C{i}", label=f"{norm}, linearised")
        ax[1].semilogx(dd, to, "-o", color=f"C{i}", label=f"{norm}, nonlinear γ-ODE")
    if rnd["n"]:
        for i, norm in enumerate(("softmax", "relu")):
            sel = [(n, T) for nm, n, d, T in zip(rnd["normalization"], rnd["n"], rnd["d"], rnd["median_time"])
                   if nm == norm and d == params["random_d"][-1] and math.isfinite(T)]
            if sel:
                ax[0].loglog(*zip(*sel), "x", color=f"C{i}", ms=8, label=f"{norm}, random tokens d = {params['random_d'][-1]}")
    _log_ticks_at(ax[0], ns)
    _log_ticks_at(ax[1], ds)
    ax[0].set_xlabel("n")
    ax[0].set_ylabel(f"time to γ = {target}")
    ax[0].set_title("dashed: linearised, solid: γ-ODE, ●: particles (equiangular)")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("d (γ0 = 1/√d)")
    ax[1].set_ylabel(f"time to γ = {target}")
    ax[1].set_title(f"n = {ns[-1]}: dependence on d")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"ReLU vs softmax clustering times, one head λ = {lam}, β = {beta}, ascent (tokens cluster)")
    _save(run, fig, "clustering_times", f"Time for the common cosine γ to reach {target}. Left, against n: dashed — "
          "the linearised formula, solid — the nonlinear γ-ODE, dots — the particle system (equiangular start), "
          "crosses — the median over random starts. Right, against d at the largest n. No bands: each point is one "
          "deterministic run (random tokens: the median over the ensemble).", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 6
ENTROPY_OPTIONS = {
    "n": Option(16, (int,), "tokens of the random configurations", check=lambda v: None if v >= 2 else "must be >= 2"),
    "d": Option(4, (int,), "dimension of the random configurations", check=lambda v: None if v >= 2 else "must be >= 2"),
    "heads": Option(3, (int,), "heads of the random configurations", check=positive),
    "configs": Option(8, (int,), "number of random configurations", check=positive),
    "fd_step": Option(1e-5, (float,), "central finite-difference step", check=positive),
    "equi_n": Option(8, (int,), "tokens of the equiangular run", check=lambda v: None if v >= 2 else "must be >= 2"),
    "lam": Option(1.0, (float,), "head strength of the equiangular run", check=positive),
    "beta": Option(2.0, (float,), "inverse temperature of the equiangular run", check=positive),
    "gamma0": Option(0.0, (float,), "initial overlap of the equiangular run", check=_unit_interval),
    "t1": Option(6.0, (float,), "final time", check=positive),
    "dt": Option(0.01, (float,), "time step (rk4)", check=positive),
    "seed": Option(0, (int,), "seed"),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_entropy", ENTROPY_OPTIONS, "Pendharkar item 6: attention entropy, dH/dt = -Cov(s, sdot), rise to log n")
def run_entropy(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg, theory as th

    dtype = getattr(torch, params["dtype"])
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
    x0 = tp.sphere.equiangular(m, params["gamma0"], m, dtype=dtype) if params["gamma0"] > 0 else torch.eye(m, dtype=dtype)
    hs = tp.Heads.scalar(torch.tensor([params["lam"]], dtype=dtype), m, beta=params["beta"], weights=_ones(1, dtype))
    traj = tp.simulate(x0, hs, t1=params["t1"], dt=params["dt"], method="rk4", direction="ascent", diagnostics=False,
                       record_every=max(1, round(0.05 / params["dt"])), progress=run.progress)
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
    hr = tp.Heads.scalar(torch.tensor([params["lam"]], dtype=dtype), d, beta=params["beta"], weights=_ones(1, dtype))
    tr = tp.simulate(xr, hr, t1=params["t1"], dt=params["dt"], method="rk4", direction="ascent", diagnostics=False,
                     record_every=max(1, round(0.05 / params["dt"])))
    Hr = dg.attention_entropy(tr.x, hr)[:, 0]
    metrics["random_min_mean_entropy_increment"] = float((Hr.mean(-1)[1:] - Hr.mean(-1)[:-1]).min())
    metrics["random_min_token_entropy_increment"] = float((Hr[1:] - Hr[:-1]).min())
    metrics["random_final_clusters"] = int(dg.cluster_count(tr.x[-1], radius=0.05))
    run.save_series("equiangular_entropy", {"t": traj.times, "H_particles": Hm, "H_closed_form": Hc, "dHdt": rates})

    plt = _plt()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    ax[0].plot(fd.flatten().numpy(), ident.flatten().numpy(), ".", ms=3)
    lim = float(fd.abs().max())
    ax[0].plot([-lim, lim], [-lim, lim], "k-", lw=0.5)
    ax[0].set_xlabel("finite difference of H_i^h")
    ax[0].set_ylabel("−Cov_p(s, ṡ)")
    ax[0].set_title(f"random heads, moving A, weighted tokens\nidentity vs finite differences (max err {float(err.max()):.1e})")
    t = traj.times.numpy()
    ax[1].plot(t, Hm.numpy(), label="particles")
    ax[1].plot(t[::4], Hc.numpy()[::4], "o", ms=3, label="closed form H(γ(t))")
    ax[1].axhline(math.log(m), color="k", ls=":", label="ln n")
    ax[1].set_xlabel("t")
    ax[1].set_title(f"equiangular tokens\nn = {m}, λ = {params['lam']}, β = {params['beta']}")
    ax[1].legend(fontsize=8)
    ax[2].plot(tr.times.numpy(), Hr.numpy(), lw=0.5, color="0.6")
    ax[2].plot(tr.times.numpy(), Hr.mean(-1).numpy(), "C0", lw=2, label="mean over tokens")
    ax[2].axhline(math.log(n), color="k", ls=":", label="ln n")
    ax[2].set_xlabel("t")
    ax[2].set_title(f"random tokens in S^{d - 1}\nH_i(t) per token (no monotonicity theorem)")
    ax[2].legend(fontsize=8)
    ax[1].set_ylabel("attention entropy H(t)")
    ax[2].set_ylabel("attention entropy H_i(t)")
    fig.suptitle("Attention entropy, softmax heads, ascent (tokens cluster)")
    _save(run, fig, "entropy", "Left: the entropy identity dH_i/dt = −Cov_p(s, ṡ) against finite differences, one "
          "dot per (token, head); the line is y = x. Centre: the attention entropy of equiangular tokens, particles "
          "(line) vs the closed form H(γ(t)) (dots); dotted: ln n. Right: random tokens, thin grey lines: every "
          "token's entropy, thick: their mean (no band).", metrics)
    return metrics


# ---------------------------------------------------------------------------- item 7
ORTH_OPTIONS = {
    "angles": Option([70.0, 75.0, 80.0, 85.0, 90.0], (list,), "principal angles between head subspaces (degrees)",
                     check=_float_list(0.0, 90.0, open_lo=True)),
    "heads": Option(3, (int,), "number of heads H", check=positive),
    "k": Option(2, (int,), "rank of every head (d = (H + 1) k)", check=positive),
    "alpha": Option(1.0, (float,), "head strength α (A_h = α U_h U_hᵀ)", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature", check=positive),
    "n": Option(32, (int,), "number of tokens", check=positive),
    "spread": Option(0.3, (float,), "noise of the token cluster around a direction shared by all heads", check=positive),
    "flat_t1": Option(0.05, (float,), "final time of the flat runs", check=positive),
    "flat_dt": Option(0.0005, (float,), "time step of the flat runs", check=positive),
    "seed": Option(0, (int,), "seed"),
    "dtype": Option("float64", (str,), "floating dtype", choices=_DT),
}


@study("theory_orthogonality", ORTH_OPTIONS,
       "Pendharkar item 7: robustness to approximately orthogonal heads (principal angles 70-90 degrees)")
def run_orthogonality(params, run):
    import transformer_pde as tp
    from transformer_pde import diagnostics as dg

    dtype = getattr(torch, params["dtype"])
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
        for key, val in zip(rows, (ang, delta, alpha ** 2 * math.cos(math.radians(ang)), math.degrees(pa), ratio,
                                   float(rd.flat_rates.min()), float(rb_f.mean(-1).min()),
                                   float((rb_f > 0).double().mean()), float(rd.sphere_rates.min()),
                                   float(rb_s.mean(-1).min()), float((rb_s > 0).double().mean()), mono)):
            rows[key].append(val)
    run.save_series("orthogonality", rows)
    metrics = {
        "max_delta_error_vs_alpha2_cos": max(abs(a - b) for a, b in zip(rows["delta"], rows["delta_formula"])),
        "max_principal_angle_error_deg": max(abs(a - b) for a, b in zip(rows["min_principal_angle"], rows["angle"])),
        "max_coupling_over_bound": max(rows["coupling_over_bound"]),
        "all_flat_head_energies_monotone": all(rows["flat_head_energies_monotone"]),
        "min_flat_head_rate": min(rows["flat_min_head_rate"]),
        "min_sphere_head_rate": min(rows["sphere_min_head_rate"]),
    }
    for key in ("flat_certified_fraction", "sphere_certified_fraction", "flat_min_robust_bound", "sphere_min_robust_bound"):
        metrics[f"{key}_at_{rows['angle'][0]:g}deg"] = rows[key][0]
        metrics[f"{key}_at_{rows['angle'][-1]:g}deg"] = rows[key][-1]

    plt = _plt()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.3))
    ax[0].plot(rows["angle"], rows["delta"], "o-", label="δ = max‖A_h A_k‖ (measured)")
    ax[0].plot(rows["angle"], rows["delta_formula"], "k:", label="α² cos θ")
    ax[0].plot(rows["angle"], rows["coupling_over_bound"], "s-", label="max |⟨f_h,f_k⟩| / (δ m_h m_k)")
    ax[0].set_xlabel("principal angle θ (degrees)")
    ax[0].legend(fontsize=8)
    ax[0].set_title("approximate orthogonality")
    ax[1].plot(rows["angle"], rows["flat_min_head_rate"], "o-", label="flat: min_h dE_h/dt")
    ax[1].plot(rows["angle"], rows["flat_min_robust_bound"], "o:", label="flat: min_h robust bound")
    ax[1].plot(rows["angle"], rows["sphere_min_head_rate"], "s-", label="sphere: min_h dE_h/dt")
    ax[1].plot(rows["angle"], rows["sphere_min_robust_bound"], "s:", label="sphere: min_h robust bound")
    ax[1].axhline(0, color="k", lw=0.5)
    ax[1].set_xlabel("θ (degrees)")
    ax[1].legend(fontsize=8)
    ax[1].set_title("per-head energy rates vs the δ-corrected margin")
    ax[2].plot(rows["angle"], rows["flat_certified_fraction"], "o-", label="flat")
    ax[2].plot(rows["angle"], rows["sphere_certified_fraction"], "s-", label="sphere")
    ax[2].set_xlabel("θ (degrees)")
    ax[2].set_ylim(-0.05, 1.05)
    ax[2].set_title("fraction of (head, token) pairs with robust margin > 0")
    ax[2].legend(fontsize=8)
    ax[0].set_ylabel("δ and coupling ratio")
    ax[1].set_ylabel("dE_h/dt (min over heads)")
    ax[2].set_ylabel("certified fraction")
    fig.suptitle(f"H = {H} heads of rank {k} in d = {d}, unnormalised, ω_h = 1, ascent (tokens cluster)")
    _save(run, fig, "orthogonality", "Against the principal angle θ between the heads' ranges. Left: the measured "
          "overlap δ and its formula α² cos θ, and the largest cross-coupling relative to its bound (≤ 1). Centre: the "
          "smallest per-head energy rate (solid) and the δ-corrected robust bound (dotted), flat space and sphere. "
          "Right: the fraction of (head, token) pairs with a positive robust margin. Deterministic (no bands).",
          metrics)
    return metrics
