"""Studies checking Pendharkar's multi-head theory on the full particle system.

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
from functools import partial
from typing import Dict

import torch

import transformer_pde as tp
from transformer_pde.analysis import diagnostics as dg, theory as th

from . import Option, at_least, log_ticks, panel, positive, save_captioned, study, subplots, dtype_of


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


_positive_floats = _float_list(0.0, None, open_lo=True)


# ---------------------------------------------------------------------------- the options of the kinds
# the same option in several kinds
_HEADS = Option(3, (int,), "number of heads H", check=positive)
_BETA = Option(1.0, (float,), "inverse temperature", check=positive)
_T1 = Option(6.0, (float,), "final time", check=positive)
_RK4_DT = Option(0.01, (float,), "time step (rk4)", check=positive)
_SEED = Option(0, (int,), "seed")

ENERGY_OPTIONS = {
    "n": Option(24, (int,), "number of tokens", check=positive),
    "d": Option(3, (int,), "dimension", check=positive),
    "heads": _HEADS,
    "beta": _BETA,
    "scale": Option(0.4, (float,), "scale of the random symmetric heads Z + Zᵀ", check=positive),
    "t1": Option(2.0, (float,), "final time of the sphere runs", check=positive),
    "dt": _RK4_DT,
    "flat_t1": Option(0.1, (float,), "final time of the flat runs (they blow up in finite time)", check=positive),
    "flat_dt": Option(0.001, (float,), "time step of the flat runs", check=positive),
    "epsilons": Option([0.0125, 0.025, 0.05, 0.1, 0.2], (list,), "sizes of the symmetry / value-alignment breaking",
                       check=_positive_floats),
    "orth_angle": Option(60.0, (float,), "direction (degrees) of the token cluster in the orthogonal-heads example",
                         check=lambda v: None if 0 < v < 90 else "must lie in (0, 90)"),
    "seed": Option(0, (int,), "seed of tokens and heads"),
}

RADIAL_OPTIONS = {
    "heads": Option([1, 2, 3, 4, 5], (list,), "numbers of equal heads H", check=_int_list(1)),
    "n": Option([3, 5, 10, 20, 50, 100], (list,), "numbers of tokens", check=_int_list(2)),
    "alpha": Option(1.0, (float,), "head strength α (A_h = αI)", check=positive),
    "gammas": Option([0.05, 0.1, 0.2], (list,), "equiangular overlaps γ > 0 (outside the orthogonal regime)",
                     check=_float_list(0.0, 0.99)),
    "hetero": Option([0.5, 1.0, 2.0], (list,), "unequal head strengths for the heterogeneous example",
                     check=_positive_floats),
    "hetero_n": Option(50, (int,), "tokens in the heterogeneous example", check=positive),
}

RATES_OPTIONS = {
    "n": Option(8, (int,), "number of tokens (equiangular, d = n)", check=at_least(2)),
    "lambdas": Option([0.5, 1.5], (list,), "head strengths λ_h (A_h = λ_h I)", check=_positive_floats),
    "beta": _BETA,
    "gamma0": Option(0.05, (float,), "initial overlap of the equiangular tokens", check=_unit_interval),
    "t1": _T1,
    "dt": _RK4_DT,
    "phi_n": Option([2, 8, 32, 128], (list,), "token numbers for the φ(λ) curves", check=_int_list(2)),
    "total": Option([2.0, 16.0], (list,), "total strengths Λ for the super-additivity example (H = 2)",
                    check=_positive_floats),
    "targets": Option([0.05, 0.5], (list,), "overlaps defining the hitting times (from orthogonal tokens)",
                      check=_float_list(0.0, 0.99, open_lo=True)),
}

RELU_OPTIONS = {
    "n": Option([8, 16, 32, 64], (list,), "numbers of tokens", check=_int_list(2)),
    "d": Option([16, 256, 4096], (list,), "dimensions (initial overlap γ0 = 1/√d)", check=_int_list(2)),
    "lam": Option(1.0, (float,), "head strength λ (one head A = λI)", check=positive),
    "beta": _BETA,
    "target": Option(0.5, (float,), "overlap defining the clustering time", check=_unit_interval),
    "particles": Option(True, (bool,), "also run the equiangular particle system for every (n, d)"),
    "random_n": Option([8, 16], (list,), "token numbers of the random-token runs ([] to skip)",
                       check=lambda v: None if all(isinstance(t, int) and t >= 2 for t in v) else "ints >= 2"),
    "random_d": Option([16, 64], (list,), "dimensions of the random-token runs", check=_int_list(2)),
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
    "gamma0": Option(0.0, (float,), "initial overlap of the equiangular run", check=_unit_interval),
    "t1": _T1,
    "dt": _RK4_DT,
    "seed": _SEED,
}

ORTH_OPTIONS = {
    "angles": Option([70.0, 75.0, 80.0, 85.0, 90.0], (list,), "principal angles between head subspaces (degrees)",
                     check=_float_list(0.0, 90.0, open_lo=True)),
    "heads": _HEADS,
    "k": Option(2, (int,), "rank of every head (d = (H + 1) k)", check=positive),
    "alpha": Option(1.0, (float,), "head strength α (A_h = α U_h U_hᵀ)", check=positive),
    "beta": _BETA,
    "n": Option(32, (int,), "number of tokens", check=positive),
    "spread": Option(0.3, (float,), "noise of the token cluster around a direction shared by all heads",
                     check=positive),
    "flat_t1": Option(0.05, (float,), "final time of the flat runs", check=positive),
    "flat_dt": Option(0.0005, (float,), "time step of the flat runs", check=positive),
    "seed": _SEED,
}


# ---------------------------------------------------------------------------- shared by the kinds
def _scalar_heads(lams, d, beta, dtype):
    """Scalar heads λ_h I on R^d, ω_h = 1."""
    return tp.Heads.scalar(torch.tensor(list(lams), dtype=dtype), d, beta=beta,
                           weights=torch.ones(len(lams), dtype=dtype))


def _ascent(x0, heads, t1, dt, *, sparse=False, **kw):
    """The rk4 run of the ascent flow (tokens cluster); ``sparse``: no diagnostics, a record every ≈ 0.05."""
    if sparse:
        kw.update(diagnostics=False, record_every=max(1, round(0.05 / dt)))
    return tp.simulate(x0, heads, t1=t1, dt=dt, method="rk4", direction="ascent", **kw)


def _append(rows, *values) -> None:
    """Append one row to the table ``rows`` (a dict of equal-length lists, values in column order)."""
    for k, v in zip(rows, values):
        rows[k].append(v)


def _select(rows, cols, **where):
    """The tuples of the columns ``cols`` of the rows of ``rows`` whose columns in ``where`` hold the given values."""
    n = len(rows[cols[0]])
    return [tuple(rows[c][i] for c in cols) for i in range(n) if all(rows[k][i] == v for k, v in where.items())]


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


def _slope(x, y):
    """Least-squares slope of y against x (in float64)."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def _loglog_slope(x, y):
    """Least-squares slope of log y against log x (positive entries only)."""
    xs, ys = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    keep = (xs > 0) & (ys > 0) & torch.isfinite(ys)
    if int(keep.sum()) < 2:
        return float("nan")
    return _slope(xs[keep].log(), ys[keep].log())


_save = partial(save_captioned, tidy=True)  # legends under the axes, laid out, captioned and saved


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
    traj = _ascent(x0, heads, params["t1"], params["dt"], normalization="unnormalized", progress=run.progress)
    ft = dg.flat_flow(x0, heads, t1=params["flat_t1"], dt=params["flat_dt"])
    curves = {}
    for where, times, E, kin in (("sphere", traj.times, traj.energy, dg.energy_balance(traj.x, heads).kinetic),
                                 ("flat", ft.times, ft.energy, ft.kinetic)):
        curves[where] = {"t": times, "dE": E - E[0], "int_kinetic": _cumtrapz(times, kin)}
        metrics[f"{where}_identity_rel_residual"] = _simpson_residual(times, E, kin)
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
    _save(run, fig, "energy", "Deterministic runs (no bands). Top left/centre: the energy gain E(t) − E(0) against "
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
            tr = _ascent(x0, h, t_half, 2 * params["dt"], normalization="unnormalized")
            kin_e = dg.energy_balance(tr.x, h).kinetic
            rows[f"ledger_{tag}"].append(float((tr.energy - tr.energy[0] - _cumtrapz(tr.times, kin_e)).abs().max()))
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
    to = _ascent(xo, ho, t_half, params["dt"], normalization="unnormalized")
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
        _append(rows, H, n, form, gamma, cf, num, err)

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
            sel = [(n, b) for n, b in _select(rows, ("n", "numeric"), H=H, form=form, gamma=0.0) if math.isfinite(b)]
            if sel:
                ax[0].plot(*zip(*sel), fmt, color=c, **kw)
    ax[0].set_xscale("log")
    log_ticks(ax[0], ns)
    panel(ax[0], "n (orthogonal tokens)", "β*",
          f"β*(H, n), α = {alpha}: lines formula, ● token margin, × pairwise margin", legend=True)
    _margin_panel(ax[1], params, ns, dtype)
    _save(run, fig, "radial_dominance", "Left: the critical inverse temperature β*(H, n) — lines: the closed form; "
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


# ---------------------------------------------------------------------------- item 4
@study("theory_rates", RATES_OPTIONS,
       "Pendharkar item 4: equiangular gamma-ODE vs particles, early/late rates, Lambert-W maximiser, super-additivity")
def run_rates(params, run):
    dtype = dtype_of(params)
    n, beta, g0 = params["n"], params["beta"], params["gamma0"]
    lam = [float(v) for v in params["lambdas"]]
    heads = _scalar_heads(lam, n, beta, dtype)
    x0 = tp.sphere.equiangular(n, g0, n, dtype=dtype)
    off = ~torch.eye(n, dtype=torch.bool)
    metrics, curves = {}, {}
    for norm in th.REDUCED_NORMALIZATIONS:
        traj = _ascent(x0, heads, params["t1"], params["dt"], sparse=True, normalization=norm, progress=run.progress)
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
            slope = _slope(traj.times[sel], gap[sel].log())
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
    _save(run, fig, "rates", "Equiangular tokens (common cosine γ). Top left: lines — the reduced γ-ODE, dots — the "
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
                T_p = float(dg.clustering_hitting_time(xo, _scalar_heads(ll, n, beta, dtype), target=target,
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
                    tp_ = float(dg.clustering_hitting_time(x0, _scalar_heads([lam], n, beta, dtype), target=target,
                                                           t_max=1.3 * to + 5 * step, dt=step, normalization=norm))
                _append(rows, norm, n, d, g0, tl, to, tp_)
    run.save_series("clustering_times", rows)
    metrics = {}
    ds, ns = params["d"], params["n"]
    for norm in _NORMS:
        for kind in ("linearized", "ode"):
            for d in (ds[0], ds[-1]):
                sel = _select(rows, ("n", kind), normalization=norm, d=d)
                if len(sel) >= 2:
                    metrics[f"{norm}_{kind}_exponent_in_n_d{d}"] = _loglog_slope(*zip(*sel))
            # dependence on d at the largest n: slope of T against ln d
            sel = _select(rows, ("d", kind), normalization=norm, n=ns[-1])
            if len(sel) >= 2:
                metrics[f"{norm}_{kind}_slope_in_log_d_n{ns[-1]}"] = _slope([math.log(dd) for dd, _ in sel],
                                                                            [T for _, T in sel])
        if params["particles"]:
            errs = [abs(p / o - 1) for p, o in _select(rows, ("particles", "ode"), normalization=norm)]
            metrics[f"{norm}_particles_vs_ode_max_rel_error"] = max(errs)
    rnd = _random_tokens(params, dtype)
    if rnd["n"]:
        run.save_series("random_tokens", rnd)
        for norm in _NORMS:
            fr = [r for (r,) in _select(rnd, ("reached",), normalization=norm)]
            metrics[f"{norm}_random_tokens_fraction_reached"] = sum(fr) / len(fr)
    _relu_figure(run, params, metrics, rows, rnd)
    return metrics


def _relu_figure(run, params, metrics, rows, rnd) -> None:
    ds, ns, target = params["d"], params["n"], params["target"]
    fig, ax = subplots(1, 2, (12, 4.8), f"ReLU vs softmax clustering times, one head λ = {params['lam']}, "
                       f"β = {params['beta']}, ascent (tokens cluster)")
    for i, norm in enumerate(_NORMS):
        for j, d in enumerate(ds):
            nn, tl, to, tpp = zip(*_select(rows, ("n", "linearized", "ode", "particles"), normalization=norm, d=d))
            c = f"C{2 * j + i}"
            ax[0].loglog(nn, tl, "--", color=c, lw=1)
            ax[0].loglog(nn, to, "-", color=c, label=f"{norm}, d = {d}")
            if params["particles"]:
                ax[0].loglog(nn, tpp, "o", color=c, ms=4)
        dd, tl, to = zip(*_select(rows, ("d", "linearized", "ode"), normalization=norm, n=ns[-1]))
        ax[1].semilogx(dd, tl, "--", color=f"C{i}", label=f"{norm}, linearised")
        ax[1].semilogx(dd, to, "-o", color=f"C{i}", label=f"{norm}, nonlinear γ-ODE")
    d_rnd = params["random_d"][-1]
    for i, norm in enumerate(_NORMS):
        sel = [(n, T) for n, T in _select(rnd, ("n", "median_time"), normalization=norm, d=d_rnd) if math.isfinite(T)]
        if sel:
            ax[0].loglog(*zip(*sel), "x", color=f"C{i}", ms=8, label=f"{norm}, random tokens d = {d_rnd}")
    log_ticks(ax[0], ns)
    log_ticks(ax[1], ds)
    panel(ax[0], "n", f"time to γ = {target}", "dashed: linearised, solid: γ-ODE, ●: particles (equiangular)",
          legend=True)
    panel(ax[1], "d (γ0 = 1/√d)", f"time to γ = {target}", f"n = {ns[-1]}: dependence on d", legend=True)
    _save(run, fig, "clustering_times", f"Time for the common cosine γ to reach {target}. Left, against n: dashed — "
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
                T = dg.clustering_hitting_time(x0, _scalar_heads([lam], d, beta, dtype), target=target,
                                               t_max=4 * to + 1.0, dt=min(params["dt"], to / 100), normalization=norm)
                fin = T[torch.isfinite(T)]
                _append(rnd, norm, n, d, float(T.median()) if len(fin) else float("inf"), len(fin) / len(T), to)
    return rnd


# ---------------------------------------------------------------------------- item 6
@study("theory_entropy", ENTROPY_OPTIONS, "Pendharkar item 6: attention entropy, dH/dt = -Cov(s, sdot), rise to log n")
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
    hs = _scalar_heads([params["lam"]], m, params["beta"], dtype)
    traj = _ascent(x0, hs, params["t1"], params["dt"], sparse=True, progress=run.progress)
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
    hr = _scalar_heads([params["lam"]], d, params["beta"], dtype)
    tr = _ascent(xr, hr, params["t1"], params["dt"], sparse=True)
    Hr = dg.attention_entropy(tr.x, hr)[:, 0]
    metrics["random_min_mean_entropy_increment"] = float((Hr.mean(-1)[1:] - Hr.mean(-1)[:-1]).min())
    metrics["random_min_token_entropy_increment"] = float((Hr[1:] - Hr[:-1]).min())
    metrics["random_final_clusters"] = int(dg.cluster_count(tr.x[-1], radius=0.05))
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
    _save(run, fig, "entropy", "Left: the entropy identity dH_i/dt = −Cov_p(s, ṡ) against finite differences, one "
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
        _append(rows, ang, delta, alpha ** 2 * math.cos(math.radians(ang)), math.degrees(pa), ratio,
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
    _save(run, fig, "orthogonality", "Against the principal angle θ between the heads' ranges. Left: the measured "
          "overlap δ and its formula α² cos θ, and the largest cross-coupling relative to its bound (≤ 1). Centre: the "
          "smallest per-head energy rate (solid) and the δ-corrected robust bound (dotted), flat space and sphere. "
          "Right: the fraction of (head, token) pairs with a positive robust margin. Deterministic (no bands).",
          metrics)
    return metrics
