"""Repulsive and weak attention on the circle: which random starts synchronise (kind ``repulsive``;
docs/repulsive.md).

n tokens on S¹, one head A = V = I, ``direction="ascent"``, the un-normalised flow (the gradient ascent of E that
Criscitiello–Rebjock–McRae–Boumal and Polyanskiy–Rigollet–Yao study) and optionally the softmax flow, for β on a
grid of [−1, 2] (β ≤ 0 included: ``tp.Heads.scalar([1], 2, beta=β)``).  For each n, all starts and all β are one
batch of ``tp.simulate`` (β a tensor over the batch; no Python loop over starts): i.i.d. uniform angles, the same
starts for every β.  The runs go on in segments until every start has settled — synchronised (order parameter
1 − R < ``sync_tol``) or at rest (max |V| < ``velocity_tol``) — or ``t_max`` is reached (then "unsettled").

Reported per (n, β): the fraction synchronised with its exact (Clopper–Pearson) 95 % interval, against the
proved ranges (:mod:`transformer_pde.analysis.theory.synchronization`: synchronisation for β ≥ −0.16, not for
β < −2/3); every non-synchronised terminal state with the spectrum of the energy's Hessian (all eigenvalues but
the rotation's < 0: a stable equilibrium) and its cluster sizes; and, for the most balanced three clusters, the
equilibrium of the clusters and its Hessian spectrum (the mechanism of the −2/3 threshold).
"""

from __future__ import annotations

import logging
import math
from typing import Dict

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import synchronization as sy

from . import Option, at_least, cached, dtype_of, panel, positive, save_captioned, study, subplots
from .claims import claim

__all__ = ["run_repulsive", "basins", "clopper_pearson", "cluster_sizes"]

log = logging.getLogger(__name__)


def _betas(v):
    if not v or len(set(v)) != len(v) or not all(isinstance(b, float) for b in v):
        return "must be a non-empty list of distinct floats"
    return None


def _ns(v):
    return None if v and all(isinstance(k, int) and not isinstance(k, bool) and k >= 3 for k in v) \
        and len(set(v)) == len(v) else "must be a non-empty list of distinct integers >= 3"


OPTIONS = {
    "ns": Option([8, 12, 24, 48, 64], (list,), "token counts n", check=_ns),
    "betas": Option([-1.0, -0.9, -0.8, -0.7, -0.6, -0.5, -0.4, -0.3, -0.16, 0.0, 0.5, 1.0, 2.0], (list,),
                    "inverse temperatures β (any sign)", check=_betas),
    "starts": Option(1000, (int,), "random starts per (n, β) (one batch)", check=at_least(10)),
    "normalizations": Option(["unnormalized"], (list,), "flows: the gradient ascent of E ('unnormalized') and/or "
                             "softmax", choices=("unnormalized", "softmax"),
                             check=lambda v: None if v and len(set(v)) == len(v) else "must be a non-empty list"),
    "dt": Option(0.1, (float,), "Euler step (stable for |β| ≤ 2: the fastest rate at synchrony is e^β ≤ 7.4)",
                 check=positive),
    "t_segment": Option(10.0, (float,), "time between the settling checks (settled starts leave the batch)",
                        check=positive),
    "t_max": Option(400.0, (float,), "horizon; starts not settled by then are reported as unsettled",
                    check=positive),
    "sync_tol": Option(1e-6, (float,), "synchronised when 1 − R < sync_tol (R the order parameter)", check=positive),
    "velocity_tol": Option(1e-9, (float,), "at rest when max |V| < velocity_tol", check=positive),
    "cluster_ns": Option([8, 9, 12, 16, 24, 32, 48, 64], (list,), "n of the constructed three-cluster equilibria",
                         check=_ns),
    "cluster_betas": Option([-1.0, -0.9, -0.8, -0.7, -0.68, -0.66, -0.6, -0.5], (list,),
                            "β of the constructed three-cluster equilibria", check=_betas),
    "local_starts": Option(100, (int,), "perturbed starts around each stable three-cluster equilibrium",
                           check=at_least(2)),
    "local_eps": Option(0.02, (float,), "standard deviation (radians) of the perturbations of those starts",
                        check=positive),
    "local_t_max": Option(4000.0, (float,), "cap on the horizon of the perturbed runs (otherwise 40 e-folds of the "
                          "slowest decay n|λ_max| of the Hessian)", check=positive),
    "seed": Option(0, (int,), "seed of the starts"),
    "figures": Option(True, (bool,), "write the figures"),
}


def _validate(p):
    if not p["t_segment"] <= p["t_max"]:
        raise ValueError(f"t_segment = {p['t_segment']} must not exceed t_max = {p['t_max']}")
    for key in ("t_segment", "t_max"):
        steps = p[key] / p["dt"]
        if abs(steps - round(steps)) > 1e-9 * max(1.0, steps):
            raise ValueError(f"{key}/dt = {steps} must be a whole number of steps")


def _resources(p):
    item = 4 if p["dtype"] == "float32" else 8
    n = max(p["ns"])
    B = len(p["betas"]) * p["starts"]
    steps = p["t_max"] / p["dt"] * len(p["ns"]) * len(p["normalizations"])
    return {"memory": float(item * B * (n * n * 3 + n * 8)), "steps": steps,
            "detail": f"{B} systems of up to n = {n} tokens on S¹ per batch"}


def clopper_pearson(k: int, N: int, level: float = 0.95):
    """The exact binomial interval (lower, upper) of a proportion k/N."""
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(N)).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def cluster_sizes(theta: torch.Tensor, tol: float = 1e-3) -> tuple:
    """The sizes (descending) of the groups of angles closer than ``tol`` around the circle."""
    a = np.sort(np.mod(theta.detach().cpu().double().numpy(), 2 * math.pi))
    gaps = np.diff(np.concatenate([a, [a[0] + 2 * math.pi]]))
    cuts = np.nonzero(gaps > tol)[0]
    if cuts.size == 0:
        return (a.size,)
    sizes = np.diff(np.concatenate([cuts, [cuts[0] + a.size]]))
    return tuple(sorted(int(s) for s in sizes)[::-1])


def basins(n: int, betas, starts: int, *, normalization: str = "unnormalized", dt: float = 0.05,
           t_segment: float = 20.0, t_max: float = 400.0, sync_tol: float = 1e-6, velocity_tol: float = 1e-9,
           seed: int = 0, theta0=None, dtype=torch.float64) -> Dict[str, torch.Tensor]:
    """Run ``starts`` starts of n tokens on S¹ for every β of ``betas`` (one batch of ``len(betas)·starts``
    systems) until each settles; the starts are i.i.d. uniform angles (the same for every β), or ``theta0``
    (len(betas), starts, n).  Returns ``status`` (len(betas), starts) int (0 synchronised, 1 at rest and not
    synchronised, 2 not settled by t_max), ``time`` (the settling time), ``theta`` the final angles
    (len(betas), starts, n)."""
    nb = len(betas)
    if theta0 is None:
        g = torch.Generator().manual_seed(seed)
        theta0 = (2 * math.pi * torch.rand(starts, n, generator=g, dtype=torch.float64)).expand(nb, starts, n)
    th0 = theta0.reshape(nb * starts, n)
    x = torch.stack([torch.cos(th0), torch.sin(th0)], -1).to(dtype).contiguous()
    beta = torch.tensor(betas, dtype=dtype).repeat_interleave(starts)
    status = torch.full((nb * starts,), 2, dtype=torch.int64)
    settled_at = torch.full((nb * starts,), float("nan"), dtype=torch.float64)
    active = torch.arange(nb * starts)
    t = 0.0
    while active.numel() and t < t_max - 1e-9:
        heads = tp.Heads.scalar(torch.ones(1, dtype=dtype), 2, beta=beta[active])
        seg = min(t_segment, t_max - t)
        steps = round(seg / dt)
        tr = tp.simulate(x[active], heads, t1=seg, dt=dt, normalization=normalization, direction="ascent",
                         diagnostics=False, record_every=steps)
        xa = tr.x[-1]
        x[active] = xa
        t += seg
        R = xa.mean(-2).norm(dim=-1)
        v = tp.velocity(xa, heads, normalization=normalization, direction="ascent").norm(dim=-1).amax(-1)
        sync = (1 - R) < sync_tol
        rest = (~sync) & (v < velocity_tol)
        done = sync | rest
        idx = active[done]
        status[idx] = torch.where(sync[done], 0, 1)
        settled_at[idx] = t
        active = active[~done]
        log.info("n = %d, %s: t = %g, %d of %d starts still moving", n, normalization, t, active.numel(), nb * starts)
    theta = torch.atan2(x[..., 1], x[..., 0]).double()
    return {"status": status.reshape(nb, starts), "time": settled_at.reshape(nb, starts),
            "theta": theta.reshape(nb, starts, n)}


@study("repulsive", OPTIONS, "repulsive and weak attention on S¹ (β ∈ [−1, 2]): the fraction of random starts that "
       "synchronise, against the proved ranges; stable non-synchronised states and their Hessian spectra",
       validate=_validate, resources=_resources)
def run_repulsive(params, run):
    p = params
    dtype = dtype_of(p)
    betas = p["betas"]
    metrics: Dict = {"fractions": [], "nonsync": [], "clusters": []}
    claims = []
    res = {}
    for norm in p["normalizations"]:
        for n in p["ns"]:
            res[(norm, n)] = cached(run, f"basins_{norm}_n{n}", lambda norm=norm, n=n: basins(
                n, betas, p["starts"], normalization=norm, dt=p["dt"], t_segment=p["t_segment"], t_max=p["t_max"],
                sync_tol=p["sync_tol"], velocity_tol=p["velocity_tol"], seed=p["seed"] + n, dtype=dtype), log)

    # ---- the constructed three-cluster equilibria (the −2/3 mechanism) -------------------------------------------
    constructed = {}
    for n in p["cluster_ns"]:
        sizes = sy.balanced_sizes(n, 3)
        for b in p["cluster_betas"]:
            try:
                a = sy.cluster_equilibrium(sizes, b)
                top = float(sy.stability_spectrum(sy.cluster_configuration(sizes, a), b).max())
            except ValueError:
                a, top = None, float("nan")  # the clusters merge: no such local maximum
            constructed[(n, b)] = top
            metrics["clusters"].append({"n": n, "beta": b, "sizes": sizes, "max_eigenvalue": top,
                                        "angles": None if a is None else [float(v) for v in a]})
    # each stable one, perturbed by ε·N(0, 1) per token: does the flow bring it back (a stable state at rest)?
    local = {}
    for n in p["cluster_ns"]:
        stable_b = [b for b in p["cluster_betas"] if constructed[(n, b)] < 0]
        if not stable_b:
            continue
        sizes = sy.balanced_sizes(n, 3)
        g = torch.Generator().manual_seed(p["seed"] + 17 * n)
        base = torch.stack([sy.cluster_configuration(sizes, sy.cluster_equilibrium(sizes, b)) for b in stable_b])
        theta0 = base[:, None, :] + p["local_eps"] * torch.randn(len(stable_b), p["local_starts"], n, generator=g,
                                                                  dtype=torch.float64)
        slowest = min(abs(constructed[(n, b)]) for b in stable_b) * n  # the flow's rate is n × the Hessian's
        horizon = min(p["local_t_max"], max(p["t_max"], 40.0 / slowest))
        horizon = p["t_segment"] * math.ceil(horizon / p["t_segment"])
        for norm in p["normalizations"]:
            r = cached(run, f"local_{norm}_n{n}", lambda norm=norm, n=n, stable_b=stable_b, theta0=theta0: basins(
                n, stable_b, p["local_starts"], normalization=norm, dt=p["dt"], t_segment=p["t_segment"],
                t_max=horizon, sync_tol=p["sync_tol"], velocity_tol=p["velocity_tol"], theta0=theta0, dtype=dtype),
                log)
            for i, b in enumerate(stable_b):
                st = r["status"][i]
                back = st == 1
                same = [cluster_sizes(th) == tuple(sorted(sizes, reverse=True)) for th in r["theta"][i]]
                k = int((back & torch.tensor(same)).sum())
                N = int(st.numel())
                lo, hi = clopper_pearson(k, N)
                local[(norm, n, b)] = k / N
                claims.append(claim(f"perturbed three clusters return (eps = {p['local_eps']:g}), {norm}, n = {n}, "
                                    f"beta = {b:g} (stable: 1)", k / N, max(k / N - lo, hi - k / N), N,
                                    reference=1.0, holds=bool(k == N), ci_low=lo, ci_high=hi,
                                    unsettled=int((st == 2).sum()), horizon=horizon))
    metrics["local"] = [{"normalization": k[0], "n": k[1], "beta": k[2], "fraction_returned": v}
                        for k, v in local.items()]
    for n in p["cluster_ns"]:
        if n % 3 == 0:
            for b in p["cluster_betas"]:
                top = constructed[(n, b)]
                if math.isfinite(top):
                    claims.append(claim(f"three equal clusters, n = {n}, beta = {b:g}: largest Hessian eigenvalue "
                                        f"(theory: < 0 iff beta < -2/3)", top, 0.0, 0, reference=0.0,
                                        holds=bool((top < 0) == (b < sy.NO_SYNC_BETA_MAX))))

    # ---- fractions, terminal states, claims --------------------------------------------------------------------------
    for norm in p["normalizations"]:
        for n in p["ns"]:
            r = res[(norm, n)]
            for i, b in enumerate(betas):
                st = r["status"][i]
                N = int(st.numel())
                k = int((st == 0).sum())
                unsettled = int((st == 2).sum())
                lo, hi = clopper_pearson(k, N)
                frac = k / N
                rest = r["theta"][i][st == 1]
                tops = sy.stability_spectrum(rest, b).amax(-1) if rest.shape[0] else torch.empty(0)
                stable = int((tops < 0).sum())
                types: Dict[str, int] = {}
                for th in rest:
                    key = "+".join(map(str, cluster_sizes(th)))
                    types[key] = types.get(key, 0) + 1
                regime = sy.proven_regime(b)
                row = {"normalization": norm, "n": n, "beta": b, "fraction": frac, "ci_low": lo, "ci_high": hi,
                       "starts": N, "synchronised": k, "at_rest": int((st == 1).sum()), "unsettled": unsettled,
                       "stable_at_rest": stable, "regime": regime, "cluster_types": types,
                       "max_eigenvalue_at_rest": float(tops.max()) if tops.numel() else None}
                metrics["fractions"].append(row)
                err = max(frac - lo, hi - frac)
                name = f"fraction synchronised, {norm}, n = {n}, beta = {b:g}"
                if regime == "synchronises":
                    claims.append(claim(name + " (theory: 1)", frac, err, N, reference=1.0, holds=bool(k == N),
                                        ci_low=lo, ci_high=hi, unsettled=unsettled))
                else:
                    claims.append(claim(name + f" (theory: {regime})", frac, err, N, reference=None, holds=None,
                                        ci_low=lo, ci_high=hi, unsettled=unsettled))
                if tops.numel():
                    claims.append(claim(f"largest Hessian eigenvalue of the {rest.shape[0]} states at rest, {norm}, "
                                        f"n = {n}, beta = {b:g} (stable: < 0)", float(tops.max()), 0.0, 0,
                                        reference=0.0, holds=bool(float(tops.max()) < 0)))
                if (n, b) in constructed and constructed[(n, b)] < 0:
                    # a stable three-cluster state exists, so its basin has positive measure; the theory gives no size
                    slo, shi = clopper_pearson(stable, N)
                    claims.append(claim(f"fraction of starts ending at a stable state at rest, {norm}, n = {n}, "
                                        f"beta = {b:g} (a stable three-cluster state exists)", stable / N,
                                        max(stable / N - slo, shi - stable / N), N, reference=None, holds=None,
                                        ci_low=slo, ci_high=shi))
    metrics["claims"] = claims
    metrics["summary"] = [f"{r['normalization']}, n = {r['n']}, β = {r['beta']:g}: {r['synchronised']}/{r['starts']} "
                          f"synchronised ([{r['ci_low']:.4f}, {r['ci_high']:.4f}]), {r['stable_at_rest']} stable at "
                          f"rest {r['cluster_types']}, {r['unsettled']} unsettled ({r['regime']})"
                          for r in metrics["fractions"]]
    if p["figures"]:
        _figures(p, metrics, res, constructed, run)
    return metrics


def _figures(p, metrics, res, constructed, run):
    betas = np.array(p["betas"])
    norms = p["normalizations"]
    fig, axs = subplots(1, len(norms) + 1, (5.5 * (len(norms) + 1), 4.0), squeeze=False)
    for j, norm in enumerate(norms):
        ax = axs[0, j]
        for n in p["ns"]:
            rows = [r for r in metrics["fractions"] if r["normalization"] == norm and r["n"] == n]
            f = np.array([r["fraction"] for r in rows])
            lo = np.array([r["ci_low"] for r in rows])
            hi = np.array([r["ci_high"] for r in rows])
            ax.errorbar(betas, f, yerr=[f - lo, hi - f], fmt="o-", ms=3, capsize=2, label=f"n = {n}")
        ax.axvspan(sy.SYNC_BETA_MIN, betas.max(), color="tab:green", alpha=0.08, label="proved: synchronises")
        ax.axvspan(betas.min(), sy.NO_SYNC_BETA_MAX, color="tab:red", alpha=0.08, label="proved: not globally")
        panel(ax, r"$\beta$", "fraction synchronised", f"{norm} flow, {p['starts']} starts per point",
              legend={"fontsize": 7})
    ax = axs[0, -1]
    for n in p["cluster_ns"]:
        bs = [b for b in p["cluster_betas"] if math.isfinite(constructed[(n, b)])]
        if bs:
            ax.plot(bs, [constructed[(n, b)] for b in bs], "o-", ms=3, label=f"n = {n} {sy.balanced_sizes(n, 3)}")
    ax.axhline(0.0, color="0.4", lw=0.8)
    ax.axvline(sy.NO_SYNC_BETA_MAX, color="tab:red", ls=":", label=r"$\beta = -2/3$")
    panel(ax, r"$\beta$", "largest Hessian eigenvalue", "three-cluster equilibria (absent: the clusters merge)",
          legend={"fontsize": 6})
    save_captioned(run, fig, "synchronisation", "Fraction of random starts whose tokens synchronise on S¹ (ascent, "
                   "A = V = I), with exact 95 % binomial intervals, against the proved ranges (green: β ≥ −0.16; red: "
                   "β < −2/3). Right: the largest eigenvalue of the energy's Hessian (rotation removed) at the most "
                   "balanced three-cluster equilibrium: negative = a stable non-synchronised state.", metrics,
                   tidy=True)

    found = [(norm, n, i) for norm in norms for n in p["ns"] for i in range(len(p["betas"]))
             if bool((res[(norm, n)]["status"][i] == 1).any())]
    if found:
        k = min(len(found), 4)
        fig, axs = subplots(1, k, (3.4 * k, 3.6), squeeze=False, subplot_kw={"projection": "polar"})
        for j, (norm, n, i) in enumerate(found[:k]):
            st = res[(norm, n)]["status"][i]
            th = res[(norm, n)]["theta"][i][st == 1][0]
            ax = axs[0, j]
            ax.plot(th.numpy(), np.ones(n), "o", ms=5, alpha=0.6)
            ax.set_yticks([])
            top = float(sy.stability_spectrum(th, p["betas"][i]).max())
            ax.set_title(f"{norm}, n = {n}, β = {p['betas'][i]:g}\nclusters {cluster_sizes(th)}, "
                         f"max eig {top:.2e}", fontsize=8)
        save_captioned(run, fig, "states_at_rest", "Non-synchronised terminal states (first found per panel) with their "
                       "cluster sizes and the largest eigenvalue of the energy's Hessian with the rotation removed "
                       "(negative: a strict local maximum of E, a stable equilibrium).", metrics)
