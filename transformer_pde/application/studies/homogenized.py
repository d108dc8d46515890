"""Random layers and their homogenized limit with common noise (kind ``homogenized``; docs/homogenized.md).

Two tokens, one softmax head A = I, centred random values V_l = σ Z_l/√Δ drawn afresh at every layer
(``tp.RandomLayers``), L = T/Δ layers of ``tp.simulate`` (Euler, retraction to the sphere), every path one batch
member (its own draws).  Two measurements:

1. **Weak error against the exact limit.**  The inner product ρ = ⟨x₁, x₂⟩ of the limit SDE is a diffusion on
   [−1, 1] whose law at time T is computed to ~1e-8 by the backward Kolmogorov equation
   (:func:`transformer_pde.analysis.theory.homogenized.two_token_expectation`).  For each depth L, the Monte-Carlo
   means of f(ρ_T) (f = ρ, ρ²) over ``seeds`` independent batches; the weak error E f(ρ_T^L) − E f(ρ_T) and the
   slope of log|error| against log L over the deepest depths, with a bootstrap over the seeds, against 1 (Euler's
   weak order).  The same for the library's integrator of the limit SDE
   (:func:`~transformer_pde.analysis.theory.homogenized.homogenized_sde`, scheme "ito", step T/L).
2. **Antipodal pairs.**  From orthogonal tokens (ρ₀ = 0), deep networks (layer time Δ, horizon T) over a grid of
   (β, d): the fraction of pairs ending antipodal (ρ_T < −1 + ε) with its Wilson interval, against the exact
   absorption probability of the limit diffusion
   (:func:`~transformer_pde.analysis.theory.homogenized.antipodal_probability`, 0 for d ≥ d_c(β) = 1 + 2cosh²β).
   The verdict uses a band: the Wilson interval widened by the pairs neither antipodal nor clustered at T
   ("unresolved", upwards) and by the observed shift between layer times Δ and 2Δ (the O(Δ) bias, both ways);
   no verdict where |λ₋|·T < ``resolve`` (near d_c the absorption is too slow for the horizon).
"""

from __future__ import annotations

import logging
import math
from typing import Dict

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import homogenized as hz

from . import Option, at_least, cached, dtype_of, panel, positive, save_captioned, study, subplots
from .claims import bootstrap_interval, claim

__all__ = ["run_homogenized", "wilson_interval", "pair_start", "network_inner_products", "weak_error_table",
           "log_slope"]

log = logging.getLogger(__name__)

TESTS = {"rho": lambda r: r, "rho^2": lambda r: r * r}


def _ints(lo: int):
    return lambda v: None if v and all(isinstance(k, int) and not isinstance(k, bool) and k >= lo for k in v) \
        and len(set(v)) == len(v) else f"must be a non-empty list of distinct integers >= {lo}"


def _floats(v):
    return None if v and all(isinstance(b, float) for b in v) and len(set(v)) == len(v) \
        else "must be a non-empty list of distinct floats"


OPTIONS = {
    "d": Option(3, (int,), "dimension of the weak-error case", check=at_least(2)),
    "beta": Option(1.0, (float,), "β of the weak-error case"),
    "sigma": Option(1.0, (float,), "value noise σ (entries of V_l: σ/√Δ)", check=positive),
    "t1": Option(1.0, (float,), "horizon T of the weak-error case", check=positive),
    "rho0": Option(0.0, (float,), "initial inner product of the weak-error case",
                   check=lambda v: None if -1.0 < v < 1.0 else "must lie in (-1, 1)"),
    "depths": Option([2, 4, 8, 16, 32, 64], (list,), "numbers of layers L of the network", check=_ints(1)),
    "sde_depths": Option([2, 4, 8, 16, 32], (list,), "numbers of steps of the limit SDE's integrator ([] for none)",
                         check=lambda v: None if all(isinstance(k, int) and k >= 1 for k in v) else "must be ints"),
    "fit_min_depth": Option(8, (int,), "the rates are fitted on the depths >= this", check=at_least(1)),
    "seeds": Option(8, (int,), "independent batches (the error bars)", check=at_least(2)),
    "paths": Option(25000, (int,), "paths per batch", check=at_least(10)),
    "betas": Option([0.0, 0.5, 1.0, 2.0], (list,), "β of the antipodal grid", check=_floats),
    "dims": Option([2, 3, 4, 5, 6], (list,), "dimensions of the antipodal grid", check=_ints(2)),
    "pairs": Option(2000, (int,), "pairs per (β, d) cell", check=at_least(10)),
    "layer_time": Option(0.05, (float,), "layer time Δ of the antipodal runs", check=positive),
    "t_pairs": Option(30.0, (float,), "horizon of the antipodal runs", check=positive),
    "resolve": Option(8.0, (float,), "a verdict only where |λ₋|·t_pairs >= this (the horizon resolves the limit)",
                      check=positive),
    "eps": Option(0.01, (float,), "antipodal when ρ_T < −1 + ε, clustered when ρ_T > 1 − ε",
                  check=lambda v: None if 0 < v < 1 else "must lie in (0, 1)"),
    "z": Option(2.576, (float,), "normal quantile of the Wilson intervals (2.576: 99 %)", check=positive),
    "seed": Option(0, (int,), "base seed"),
    "figures": Option(True, (bool,), "write the figures"),
}


def _whole(a: float, b: float, what: str):
    k = a / b
    if abs(k - round(k)) > 1e-9 * max(1.0, k):
        raise ValueError(f"{what} = {k:g} must be a whole number of layers")


def _validate(p):
    _whole(p["t_pairs"], 2 * p["layer_time"], "t_pairs/(2 layer_time)")
    if sum(1 for L in p["depths"] if L >= p["fit_min_depth"]) < 2:
        raise ValueError(f"at least two depths must be >= fit_min_depth = {p['fit_min_depth']} to fit a rate")


def _resources(p):
    item = 4 if p["dtype"] == "float32" else 8
    P = p["seeds"] * p["paths"]
    cells = len(p["betas"]) * len(p["dims"])
    steps = sum(p["depths"]) + sum(p["sde_depths"]) + 1.5 * cells * p["t_pairs"] / p["layer_time"]
    return {"memory": float(item * P * 2 * max(p["dims"] + [p["d"]]) ** 2 * 8), "steps": steps,
            "detail": f"{P} pairs per weak-error depth, {p['pairs']} pairs per antipodal cell"}


def wilson_interval(k: int, N: int, z: float = 1.96):
    """The Wilson score interval (lower, upper) of a proportion k/N at the normal quantile z."""
    if N <= 0:
        raise ValueError("N must be > 0")
    ph = k / N
    den = 1 + z * z / N
    mid = (ph + z * z / (2 * N)) / den
    half = z * math.sqrt(ph * (1 - ph) / N + z * z / (4 * N * N)) / den
    return (0.0 if k == 0 else max(0.0, mid - half)), (1.0 if k == N else min(1.0, mid + half))


def pair_start(rho0: float, d: int, dtype=torch.float64) -> torch.Tensor:
    """Two unit vectors (2, d) with ⟨x₁, x₂⟩ = ρ₀ (x₁ = e₁, x₂ in the (e₁, e₂) plane)."""
    x = torch.zeros(2, d, dtype=dtype)
    x[0, 0] = 1.0
    x[1, 0] = rho0
    x[1, 1] = math.sqrt(1.0 - rho0 * rho0)
    return x


def network_inner_products(rho0: float, d: int, beta: float, sigma: float, *, t1: float, layers: int, paths: int,
                           seed: int, dtype=torch.float64) -> torch.Tensor:
    """ρ_T of ``paths`` random-layer networks of ``layers`` layers on [0, t1] from ⟨x₁, x₂⟩ = ρ₀ (one batch of
    ``tp.simulate``; each path draws its own values at every layer)."""
    A = torch.eye(d, dtype=dtype)[None]
    heads = tp.Heads(A, torch.zeros_like(A), beta=beta)
    dt = t1 / layers
    proc = tp.RandomLayers(heads, sigma, layer_time=dt, batch_shape=(paths,), seed=seed)
    x0 = pair_start(rho0, d, dtype).expand(paths, 2, d).contiguous()
    tr = tp.simulate(x0, proc, t1=t1, dt=dt, diagnostics=False, record_every=layers, progress=False)
    x = tr.x[-1]
    return (x[:, 0] * x[:, 1]).sum(-1).double()


def log_slope(depths, errors) -> float:
    """The least-squares slope of log|error| against log L, negated (the order p of error ~ L^{−p})."""
    x = np.log(np.asarray(depths, dtype=np.float64))
    y = np.log(np.abs(np.asarray(errors, dtype=np.float64)))
    x = x - x.mean()
    return float(-(x * (y - y.mean())).sum() / (x * x).sum())


def weak_error_table(means: Dict[int, np.ndarray], exact: float, depths, fit_depths, seed: int = 0):
    """Per depth (error, standard error over seeds); the order (slope) over ``fit_depths`` with the half-width of
    its 95 % bootstrap interval over the seeds (NaN when ``fit_depths`` is None).  ``means[L]``: the per-seed
    Monte-Carlo means (S,)."""
    rows = []
    for L in depths:
        m = means[L]
        rows.append({"L": L, "error": float(m.mean() - exact), "stderr": float(m.std(ddof=1) / math.sqrt(m.size))})
    if fit_depths is None:
        return rows, float("nan"), float("nan")
    V = np.stack([means[L] for L in fit_depths], 1) - exact  # (S, len(fit))
    order, half = bootstrap_interval(V, lambda v: log_slope(fit_depths, v.mean(0)), seed=seed)
    return rows, order, half


@study("homogenized", OPTIONS, "random layers with values drawn afresh per layer (1/√L scaling): weak error "
       "against the exact two-token limit; antipodal pairs over (β, d) against the limit's absorption probability",
       validate=_validate, resources=_resources)
def run_homogenized(params, run):
    p = params
    dtype = dtype_of(p)
    metrics: Dict = {"settings": {k: p[k] for k in ("d", "beta", "sigma", "t1", "rho0", "seeds", "paths")},
                     "weak": {}, "antipodal": []}
    claims = []
    S = p["seeds"]

    # ---- 1. weak error of the network and of the SDE integrator against the exact limit ---------------------------
    exact = {k: float(hz.two_token_expectation(f, p["rho0"], p["t1"], p["beta"], p["d"], p["sigma"]))
             for k, f in TESTS.items()}
    check = {k: float(hz.two_token_expectation(f, p["rho0"], p["t1"], p["beta"], p["d"], p["sigma"], nodes=384))
             for k, f in TESTS.items()}
    metrics["weak"]["exact"] = exact
    metrics["weak"]["exact_discretisation"] = {k: abs(exact[k] - check[k]) for k in TESTS}

    def batch_means(kind, L):
        out = {k: np.empty(S) for k in TESTS}
        for s in range(S):
            sd = p["seed"] + 1000 * L + s
            if kind == "network":
                r = network_inner_products(p["rho0"], p["d"], p["beta"], p["sigma"], t1=p["t1"], layers=L,
                                           paths=p["paths"], seed=sd, dtype=dtype)
            else:
                A = torch.eye(p["d"], dtype=dtype)[None]
                X = hz.homogenized_sde(pair_start(p["rho0"], p["d"], dtype), tp.Heads(A, torch.zeros_like(A),
                                       beta=p["beta"]), p["sigma"], t1=p["t1"], dt=p["t1"] / L, paths=p["paths"],
                                       record_every=L, scheme="ito", seed=sd)
                r = (X[-1, :, 0] * X[-1, :, 1]).sum(-1).double()
            for k, f in TESTS.items():
                out[k][s] = float(f(r).mean())
        return {k: torch.from_numpy(v) for k, v in out.items()}

    for kind, depths in (("network", p["depths"]), ("sde", p["sde_depths"])):
        if not depths:
            continue
        means = {L: cached(run, f"weak_{kind}_L{L}", lambda L=L, kind=kind: batch_means(kind, L), log)
                 for L in depths}
        fit = [L for L in depths if L >= p["fit_min_depth"]]
        fit = fit if len(fit) >= 2 else sorted(depths)[-2:]
        metrics["weak"][kind] = {}
        for k in TESTS:
            per = {L: means[L][k].numpy() for L in depths}
            what = "random-layer network" if kind == "network" else "limit SDE integrator (ito scheme)"
            if len(fit) < 2:  # one depth: an error, no order
                rows, order, half = weak_error_table(per, exact[k], depths, None, p["seed"])
            else:
                rows, order, half = weak_error_table(per, exact[k], depths, fit, p["seed"])
                claims.append(claim(f"weak order of E {k}(T) of the {what}, depths {fit[0]}..{fit[-1]} (Euler: 1)",
                                    order, half, S, reference=1.0, holds=bool(abs(order - 1.0) <= half),
                                    fit_depths=fit))
            metrics["weak"][kind][k] = {"rows": rows, "order": order, "order_halfwidth": half}
            last = rows[-1]
            claims.append(claim(f"weak error of E {k}(T), {what}, L = {last['L']}", last["error"], last["stderr"], S,
                                reference=0.0, holds=None, exact=exact[k]))

    # ---- 2. antipodal pairs over (β, d), at layer times Δ and 2Δ ----------------------------------------------------
    def fractions(beta, d, i, j, dt):
        res = cached(run, f"pairs_b{beta:g}_d{d}_dt{dt:g}", lambda: {"rho": network_inner_products(
            0.0, d, beta, p["sigma"], t1=p["t_pairs"], layers=round(p["t_pairs"] / dt), paths=p["pairs"],
            seed=p["seed"] + 7919 * (i + 1) + 104729 * (j + 1) + round(1e6 * dt), dtype=dtype)}, log)
        r = res["rho"]
        return int(r.numel()), int((r < -1 + p["eps"]).sum()), int((r > 1 - p["eps"]).sum())

    for i, beta in enumerate(p["betas"]):
        for j, d in enumerate(p["dims"]):
            N, k, clustered = fractions(beta, d, i, j, p["layer_time"])
            N2, k2, _ = fractions(beta, d, i, j, 2 * p["layer_time"])
            unresolved = N - k - clustered
            lo, hi = wilson_interval(k, N, p["z"])
            shift = abs(k / N - k2 / N2)  # the O(Δ) bias estimate f(Δ) − f(2Δ)
            lo_b, hi_b = max(0.0, lo - shift), min(1.0, hi + unresolved / N + shift)
            lam_minus, _ = hz.boundary_exponents(beta, d, p["sigma"])
            exact_p = float(hz.antipodal_probability(0.0, beta, d, p["sigma"]))
            resolved = abs(lam_minus) * p["t_pairs"] >= p["resolve"]
            row = {"beta": beta, "d": d, "pairs": N, "antipodal": k, "clustered": clustered, "unresolved": unresolved,
                   "fraction": k / N, "ci_low": lo, "ci_high": hi, "fraction_2dt": k2 / N2, "band_low": lo_b,
                   "band_high": hi_b, "exact": exact_p, "lambda_minus": lam_minus,
                   "critical_dimension": hz.critical_dimension(beta), "horizon_resolves": resolved}
            metrics["antipodal"].append(row)
            claims.append(claim(f"fraction antipodal, beta = {beta:g}, d = {d} (limit: {exact_p:.4f}; "
                                f"lambda_- = {lam_minus:.3f})", k / N, max(k / N - lo_b, hi_b - k / N), N,
                                reference=exact_p, holds=bool(lo_b <= exact_p <= hi_b) if resolved else None,
                                ci_low=lo, ci_high=hi, band_low=lo_b, band_high=hi_b, unresolved=unresolved,
                                fraction_2dt=k2 / N2))
    for beta in p["betas"]:
        # the paper states a phase transition in (β, d); its threshold could not be read here: no verdict
        claims.append(claim(f"critical dimension d_c(beta = {beta:g}) = 1 + 2cosh^2(beta) of the limit diffusion "
                            "(derived; the paper's threshold not compared)", hz.critical_dimension(beta), 0.0, 0,
                            reference=None, holds=None))
    metrics["claims"] = claims
    metrics["summary"] = [f"weak order ({kind}, {k}): {metrics['weak'][kind][k]['order']:.3f} ± "
                          f"{metrics['weak'][kind][k]['order_halfwidth']:.3f}"
                          for kind in ("network", "sde") if kind in metrics["weak"] for k in TESTS]
    metrics["summary"] += [f"β = {r['beta']:g}, d = {r['d']}: {r['antipodal']}/{r['pairs']} antipodal "
                           f"(Wilson [{r['ci_low']:.4f}, {r['ci_high']:.4f}], band [{r['band_low']:.4f}, "
                           f"{r['band_high']:.4f}]; 2Δ: {r['fraction_2dt']:.4f}), limit {r['exact']:.4f}, "
                           f"{r['unresolved']} unresolved" for r in metrics["antipodal"]]
    if p["figures"]:
        _figures(p, metrics, run)
    return metrics


def _figures(p, metrics, run):
    fig, axs = subplots(1, 2, (11.0, 4.0), squeeze=False)
    ax = axs[0, 0]
    for kind, mk in (("network", "o-"), ("sde", "s--")):
        for k in TESTS:
            if kind not in metrics["weak"]:
                continue
            rows = metrics["weak"][kind][k]["rows"]
            L = np.array([r["L"] for r in rows])
            e = np.abs([r["error"] for r in rows])
            se = np.array([r["stderr"] for r in rows])
            ax.errorbar(L, e, yerr=se, fmt=mk, ms=4, capsize=2,
                        label=f"{kind}, E {k}: order {metrics['weak'][kind][k]['order']:.2f}")
    Ls = np.array(sorted(p["depths"]), dtype=float)
    ref = metrics["weak"]["network"]["rho^2"]["rows"][0]
    ax.plot(Ls, abs(ref["error"]) * Ls[0] / Ls, "k:", lw=1, label="1/L")
    ax.set_xscale("log")
    ax.set_yscale("log")
    panel(ax, "layers L", "|weak error|", f"two tokens, d = {p['d']}, β = {p['beta']:g}, T = {p['t1']:g}",
          legend={"fontsize": 7})
    ax = axs[0, 1]
    for beta in p["betas"]:
        rows = [r for r in metrics["antipodal"] if r["beta"] == beta]
        d = np.array([r["d"] for r in rows])
        f = np.array([r["fraction"] for r in rows])
        lo = np.array([r["ci_low"] for r in rows])
        hi = np.array([r["ci_high"] for r in rows])
        line = ax.errorbar(d, f, yerr=[np.clip(f - lo, 0, None), np.clip(hi - f, 0, None)], fmt="o", ms=4,
                           capsize=2, label=f"β = {beta:g}")
        ax.plot(d, [r["fraction_2dt"] for r in rows], "x", color=line[0].get_color(), ms=5)
        ax.plot(d, [r["exact"] for r in rows], "-", color=line[0].get_color(), lw=1)
        dc = hz.critical_dimension(beta)
        if dc <= max(p["dims"]):
            ax.axvline(dc, color=line[0].get_color(), ls=":", lw=1)
    panel(ax, "d", "fraction antipodal", f"ρ₀ = 0, {p['pairs']} pairs, T = {p['t_pairs']:g}, Δ = {p['layer_time']:g}",
          legend={"fontsize": 7})
    save_captioned(run, fig, "homogenized", "Left: weak error of E ρ_T and E ρ_T² for the random-layer network "
                   "(L layers) and the limit SDE's integrator (L steps) against the exact limit (backward Kolmogorov "
                   "equation), standard errors over the seeds; dotted: 1/L. Right: fraction of pairs ending "
                   "antipodal at layer time Δ with Wilson intervals (crosses: at 2Δ), against the limit's absorption "
                   "probability (lines); dotted verticals: d_c(β) = 1 + 2cosh²β.", metrics, tidy=True)
