"""The reference paper's theorems as studies (docs/theorems.md).

Kinds (each a ``theorem_*`` config in experiments/, a quick and a full one):

``theorem_stability_data``
    Stability in the initial data.  Pairs (μ_0, ν_0) at W_2 distance ε (ν rotated, jittered or
    reweighted), both evolved under the same Θ_t (constant, one shared OU path replayed for both,
    oscillating, layerwise): W_2(μ_t, ν_t)/W_2(μ_0, ν_0) against t, W_2(μ_T, ν_T) against ε (fitted
    slope ≈ 1), and the Grönwall bound exp(∫_0^t L(s) ds) with L = ``tp.theory.lipschitz_bound``.
    Uniqueness: the particle and the JKO solution from the same data agree as τ → 0 (composed from
    ``tp.jko``; the full study is the ``jko_vs_particles`` kind).
``theorem_stability_weights``
    Stability in the weights: Θ^ε → Θ (OU path + ε·independent path, oscillating target F(t + ε),
    layer weights + ε·noise); sup_t |E^ε − E| and W_2(μ^ε_T, μ_T) against ε (slope ≈ 1); ε = 0 is the
    unperturbed run.
``theorem_omega_limit``
    The ω-limit: long runs for OU weights at several H, layerwise weights whose last layer holds,
    damped oscillations and the paper's oscillating weights; 𝒢²(t), the residual velocity
    ‖V[μ_t, Θ_∞]‖_{L²(μ_t)} against the limiting weights, cluster count and the sign of the Hessian of
    E(·, Θ_∞) on the sphere at the final state.
``theorem_fast_weights``
    The fast-weights limit: value matrices resampled i.i.d. at every layer of length δ with diffusive
    scale (V = V̄ + ΔW/δ, ΔW a Brownian increment) converge, as δ → 0, to the Stratonovich SDE with a
    noise shared by all tokens; weak errors of the mean overlap and of the energy against δ (fitted
    rate), with the SDE simulated by :func:`common_noise_sde` on the same Brownian paths.

Every number comes from the public API (``tp.simulate``, ``tp.sample_path``, ``tp.distance``,
``tp.velocity``, ``tp.energy``, ``tp.theory.lipschitz_bound``, ``tp.clustering``), so the heads and
processes can be swapped.  All studies use direction "descent" (the reference code) unless the config
says otherwise.
"""

from __future__ import annotations

import logging
import math
from typing import Dict

import numpy as np
import torch

import transformer_pde as tp

from . import (
    DTYPE, Option, at_least, cached, log_ticks, nonnegative, panel, positive, save_captioned, study, subplots, dtype_of)
from .jko import fit_slope

__all__ = ["perturbed_pair", "riemannian_hessian", "common_noise_sde", "run_stability_data",
           "run_stability_weights", "run_omega_limit", "run_fast_weights"]

logger = logging.getLogger(__name__)

_DIRECTION = Option("descent", (str,), "descent (the reference code) or ascent", choices=("descent", "ascent"))


def _eps_list(v):
    if len(v) < 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1 for x in v):
        return "must be a list of at least two numbers in (0, 1)"
    return None if len(set(v)) == len(v) else "must not repeat a value"


def _subset(allowed):
    def check(v):
        if not v or any(x not in allowed for x in v) or len(set(v)) != len(v):
            return f"must be a non-empty list of distinct values from {list(allowed)}"
        return None
    return check


def _head_counts(v):
    if not v or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in v) or len(set(v)) != len(v):
        return "must be a non-empty list of distinct integers >= 1"
    return None


def _whole_steps(t1: float, dt: float, what: str = "t1", step: str = "dt") -> int:
    K = round(t1 / dt)
    if K < 1 or abs(K * dt - t1) > 1e-9 * max(1.0, t1):
        raise ValueError(f"config keys '{what}' = {t1} and '{step}' = {dt}: {what}/{step} is not a whole number of "
                         f"steps; choose {step} = {t1 / max(K, 1):.6g}")
    return K


def _random_heads(p, seed: int, dtype, num_heads=None) -> tp.Heads:
    g = torch.Generator().manual_seed(seed)
    return tp.Heads.random(num_heads or p["heads"], p["d"], scale=p["head_scale"], beta=p["beta"], generator=g,
                           dtype=torch.float64).to(dtype)


def _tokens(p, seed: int, dtype) -> torch.Tensor:
    return tp.sphere.sample_uniform(p["n"], p["d"], generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.float64).to(dtype)


def _heads_at(theta, t: float) -> tp.Heads:
    return theta if isinstance(theta, tp.Heads) else theta.heads_at(t)


def _process(kind: str, heads0: tp.Heads, p, seed: int):
    """Θ_t of the stability studies: constant heads, one sampled OU path (replayed by every run),
    the oscillating weights (shared phase), or ``layers`` random layers of length t1/layers."""
    if kind == "constant":
        return heads0
    if kind == "ou":
        return tp.sample_path(tp.OrnsteinUhlenbeck(heads0, sigma=p["sigma"]), t1=p["t1"], dt=p["dt"], seed=seed)
    if kind == "oscillating":
        return tp.Oscillating(heads0)
    layers = [heads0] + [_random_heads(p, seed + 10 + k, heads0.dtype) for k in range(p["layers"] - 1)]
    return tp.Layerwise(layers, layer_time=p["t1"] / p["layers"])


# ---------------------------------------------------------------------------- pairs at distance ε
def perturbed_pair(x, eps: float, kind: str, *, weights=None, generator=None, iterations: int = 6):
    """A measure ν_0 at W_2 distance ≈ ε from μ_0 = Σ w_i δ_{x_i}; returns (y, w_ν).

    kind="rotated": y = R x, R a rotation in a random plane by the angle that makes the identity
    coupling cost (Σ w_i |x_i − R x_i|²)^{1/2} equal to ε; "jittered": y_i = (x_i + δ ξ_i)/|·| with
    random tangent ξ_i, δ tuned (fixed-point iterations) to the same identity cost ε; "reweighted": y = x,
    w_ν ∝ w (1 + δ ξ), ξ centred, δ tuned so that POT's exact W_2 (``tp.distance``) equals ε (W_2² is
    linear in δ for small δ).  For small ε the identity coupling is optimal, so ``tp.distance`` returns ε.
    """
    n, d = x.shape[-2:]
    w = torch.full((n,), 1.0 / n, dtype=x.dtype) if weights is None else weights
    f = dict(dtype=torch.float64, generator=generator)
    x64, w64 = x.double(), w.double()
    if kind == "rotated":
        Q, _ = torch.linalg.qr(torch.randn(d, 2, **f))
        r = ((x64 @ Q).square().sum(-1) * w64).sum().sqrt()
        alpha = 2 * math.asin(min(1.0, eps / (2 * float(r))))
        u, v = Q[:, 0], Q[:, 1]
        R = (torch.eye(d, dtype=torch.float64) + math.sin(alpha) * (torch.outer(v, u) - torch.outer(u, v))
             + (math.cos(alpha) - 1) * (torch.outer(u, u) + torch.outer(v, v)))
        return (x64 @ R.T).to(x.dtype), w
    if kind == "jittered":
        xi = tp.sphere.tangent_projection(x64, torch.randn(n, d, **f))
        delta = eps
        for _ in range(iterations):
            y = tp.sphere.normalize(x64 + delta * xi)
            cost = float(((y - x64).square().sum(-1) * w64).sum().sqrt())
            delta *= eps / cost
        return tp.sphere.normalize(x64 + delta * xi).to(x.dtype), w
    if kind == "reweighted":
        xi = torch.rand(n, **f) - 0.5
        xi = xi - (w64 * xi).sum()
        delta = min(0.5 / float(xi.abs().max()), 1e-3)
        for _ in range(iterations):
            wv = w64 * (1 + delta * xi)
            W = float(tp.distance((x64, w64), (x64, wv / wv.sum())))
            delta = min(delta * (eps / W) ** 2, 0.5 / float(xi.abs().max()))
        wv = w64 * (1 + delta * xi)
        return x, (wv / wv.sum()).to(x.dtype)
    raise ValueError(f"perturbation kind {kind!r}; allowed values: 'rotated', 'jittered', 'reweighted'")


# ============================================================================ stability in the data
DATA_OPTIONS = {
    "d": Option(3, (int,), "ambient dimension (S^{d-1})", check=at_least(2)),
    "n": Option(16, (int,), "number of tokens", check=at_least(2)),
    "heads": Option(2, (int,), "number of heads H", check=positive),
    "head_scale": Option(0.5, (float,), "A_h(0) = scale·(Z + Zᵀ)", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "eps": Option([1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6], (list,), "initial distances ε", check=_eps_list),
    "perturbations": Option(["rotated", "jittered", "reweighted"], (list,), "how ν_0 is made from μ_0",
                            check=_subset(("rotated", "jittered", "reweighted"))),
    "processes": Option(["constant", "ou", "oscillating", "layerwise"], (list,), "weight processes",
                        check=_subset(("constant", "ou", "oscillating", "layerwise"))),
    "layers": Option(4, (int,), "number of layers of the layerwise weights", check=positive),
    "sigma": Option(2 ** 0.5, (float,), "OU noise σ", check=nonnegative),
    "t1": Option(2.0, (float,), "final time", check=positive),
    "dt": Option(0.01, (float,), "RK4 step = weight-path grid", check=positive),
    "record_every": Option(10, (int,), "record every k-th step", check=positive),
    "normalization": Option("softmax", (str,), "field normalisation", choices=("softmax", "unnormalized", "relu")),
    "direction": _DIRECTION,
    "uniqueness": Option(True, (bool,), "add the particle-vs-JKO panel (uniqueness)"),
    "jko_taus": Option([0.1, 0.05, 0.025], (list,), "JKO steps τ of the uniqueness panel", check=_eps_list),
    "jko_t1": Option(0.2, (float,), "final time of the uniqueness panel", check=positive),
    "seed": Option(0, (int,), "heads seed (tokens seed + 1, weight noise seed + 2, perturbations seed + 3)"),
    "dtype": DTYPE,
    "figures": Option(True, (bool,), "write the figure"),
}


def _check_resolution(p):
    """ε below float32's resolution of W2 (≈ 1e-4 after a run) measures rounding, not the flow."""
    if p["dtype"] == "float32" and min(p["eps"]) < 1e-4:
        raise ValueError(f"config key 'eps' has {min(p['eps']):g} < 1e-4 with dtype = 'float32': float32 cannot "
                         "resolve such distances; use dtype = \"float64\" or drop the ε below 1e-4")


def _check_data(p):
    _check_resolution(p)
    _whole_steps(p["t1"], p["dt"])
    for tau in p["jko_taus"]:
        _whole_steps(p["jko_t1"], tau, "jko_t1", "jko_taus")


@study("theorem_stability_data", DATA_OPTIONS,
       "Stability in the initial data: W2(μ_t, ν_t) linear in W2(μ_0, ν_0), under Grönwall's bound",
       validate=_check_data)
def run_stability_data(params, run) -> Dict[str, object]:
    p = dict(params)
    _check_data(p)
    dtype = dtype_of(p)
    heads0 = _random_heads(p, p["seed"], dtype)
    x0 = _tokens(p, p["seed"] + 1, dtype)
    n = p["n"]
    w0 = torch.full((n,), 1.0 / n, dtype=dtype)
    eps = sorted(p["eps"], reverse=True)
    pairs = [(kind, e) for kind in p["perturbations"] for e in eps]
    ys, ws = [x0], [w0]
    for kind, e in pairs:
        # the same direction of perturbation at every ε (one generator state per kind)
        y, wv = perturbed_pair(x0, e, kind, generator=torch.Generator().manual_seed(p["seed"] + 3))
        ys.append(y)
        ws.append(wv)
    X0, W = torch.stack(ys), torch.stack(ws)
    W_init = tp.distance((X0[1:], W[1:]), (X0[:1], W[:1]))  # exact W2 (POT emd)
    ident = ((X0[1:] - X0[:1]).square().sum(-1) * W[:1]).sum(-1).sqrt()  # identity coupling (same weights)
    same = torch.tensor([k != "reweighted" for k, _ in pairs])
    target = torch.tensor([e for _, e in pairs], dtype=dtype)
    metrics: Dict[str, object] = {"direction": p["direction"], "normalization": p["normalization"],
                                  "initial_w2_rel_error_max": float((W_init / target - 1).abs().max())}
    if bool(same.any()):
        # emd ≤ identity cost always; equality = the identity coupling is optimal
        metrics["initial_emd_vs_identity_rel_gap_max"] = float(((ident - W_init) / ident)[same].abs().max())
    K = _whole_steps(p["t1"], p["dt"])
    grid = torch.arange(K + 1, dtype=torch.float64) * p["dt"]
    curves, slopes, finals, bound_ok = {}, {}, {}, {}
    for proc in p["processes"]:
        theta = _process(proc, heads0, p, p["seed"] + 2)

        def go(theta=theta):
            tr = tp.simulate(X0, theta, t1=p["t1"], dt=p["dt"], method="rk4", normalization=p["normalization"],
                             direction=p["direction"], weights=W, record_every=p["record_every"],
                             diagnostics=False, progress=False)
            dist = tp.distance((tr.x[:, 1:], W[1:]), (tr.x[:, :1], W[:1]))  # (T, P)
            rates = torch.stack([tp.theory.lipschitz_bound(_heads_at(theta, float(t)), p["normalization"])
                                 for t in grid])
            return {"times": tr.times, "w2": dist, "log_gronwall": tp.theory.gronwall_factor(grid, rates, log=True),
                    "rates": rates}

        out = cached(run, f"data_{proc}", go, logger)
        rec = torch.round(out["times"] / p["dt"]).long()
        logG = out["log_gronwall"][rec]  # ∫_0^t L on the record grid
        ratio = out["w2"] / W_init  # (T, P)
        curves[proc] = {"times": out["times"], "ratio": ratio, "log10_gronwall": logG / math.log(10)}
        # log10(ratio / bound) at t > 0 (at t = 0 both are 1): ≤ 0 where Grönwall holds
        bound_ok[proc] = float((torch.log10(ratio[1:]) - logG[1:, None] / math.log(10)).max())
        metrics[f"{proc}_max_log10_ratio_over_gronwall"] = bound_ok[proc]
        metrics[f"{proc}_log10_gronwall_T"] = float(logG[-1] / math.log(10))
        metrics[f"{proc}_max_ratio"] = float(ratio.max())
        metrics[f"{proc}_lipschitz_mean"] = float(out["rates"].mean())
        for kind in p["perturbations"]:
            idx = [i for i, (k, _) in enumerate(pairs) if k == kind]
            fin = out["w2"][-1, idx]
            slopes[(proc, kind)] = fit_slope(W_init[idx].tolist(), fin.tolist())
            finals[(proc, kind)] = (W_init[idx], fin)
            metrics[f"{proc}_{kind}_slope"] = slopes[(proc, kind)]
            small = [i for i, j in enumerate(idx) if pairs[j][1] <= 1e-2]  # the linear regime
            metrics[f"{proc}_{kind}_slope_eps_le_1e-2"] = fit_slope(W_init[idx][small].tolist(), fin[small].tolist())
            metrics[f"{proc}_{kind}_amplification_T"] = [float(v) for v in fin / W_init[idx]]
            run.save_series(f"data_{proc}_{kind}", {"t": out["times"], **{
                f"ratio_eps{e:g}": ratio[:, i] for i, (k, e) in zip(idx, [pairs[i] for i in idx])},
                "log10_gronwall": logG / math.log(10)})
    metrics["slope_min"] = min(slopes.values())
    metrics["slope_max"] = max(slopes.values())
    metrics["bound_holds"] = all(v <= 1e-9 for v in bound_ok.values())
    uniq = _uniqueness(run, p, x0, heads0, metrics) if p["uniqueness"] else None
    if p["figures"]:
        _data_figure(run, p, eps, pairs, curves, finals, uniq, metrics)
    return metrics


def _uniqueness(run, p, x0, heads0, metrics):
    """W_2(JKO_τ(T), particles(T)) from the same data and constant heads, τ → 0 (effective field: the flow
    whose JKO scheme tp.jko is); the full comparison is the jko_vs_particles study."""
    def go():
        dt_ref = min(p["jko_taus"]) / 10
        ref = tp.simulate(x0, heads0, t1=p["jko_t1"], dt=dt_ref, method="rk4", normalization="effective",
                          direction=p["direction"], diagnostics=False, progress=False)
        errs = []
        for tau in sorted(p["jko_taus"], reverse=True):
            tr = tp.jko(x0, heads0, tau=tau, steps=_whole_steps(p["jko_t1"], tau, "jko_t1"), transport="identity",
                        direction=p["direction"], progress=False)
            errs.append(tp.distance(tr.x[-1], ref.x[-1]))
        return {"taus": torch.tensor(sorted(p["jko_taus"], reverse=True)), "w2": torch.stack(errs)}

    out = cached(run, "uniqueness", go, logger)
    metrics["uniqueness_w2"] = out["w2"].tolist()
    metrics["uniqueness_slope"] = fit_slope(out["taus"].tolist(), out["w2"].tolist())
    run.save_series("uniqueness", {"tau": out["taus"], "w2_jko_vs_particles": out["w2"]})
    return out


def _data_figure(run, p, eps, pairs, curves, finals, uniq, metrics):
    ncol = 4 if uniq is not None else 3
    fig, axes = subplots(1, ncol, figsize=(4.2 * ncol, 5.0))
    colors = {"constant": "C0", "ou": "C1", "oscillating": "C2", "layerwise": "C3"}
    kind0 = p["perturbations"][0]
    i_mid = [i for i, (k, e) in enumerate(pairs) if k == kind0][len(eps) // 2]
    ax = axes[0]
    for proc, c in curves.items():
        ax.plot(c["times"], torch.log10(c["ratio"][:, i_mid]), color=colors[proc], label=proc)
        ax.plot(c["times"], c["log10_gronwall"], color=colors[proc], ls="--", lw=0.8)
    panel(ax, "t", "log₁₀ W₂(μ_t, ν_t) / W₂(μ₀, ν₀)",
          f"(a) {kind0}, ε = {pairs[i_mid][1]:g}; dashed: Grönwall", legend=True)
    ax = axes[1]
    proc0 = "ou" if "ou" in curves else next(iter(curves))
    for j, (i, (k, e)) in enumerate([(i, pe) for i, pe in enumerate(pairs) if pe[0] == kind0]):
        ax.plot(curves[proc0]["times"], curves[proc0]["ratio"][:, i], color=f"C{j}", label=f"ε = {e:g}")
    panel(ax, "t", "W₂(μ_t, ν_t) / W₂(μ₀, ν₀)", f"(b) {proc0}, {kind0}: one curve for all ε", legend=True)
    ax = axes[2]
    marks = {"rotated": "o", "jittered": "s", "reweighted": "^"}
    for (proc, kind), (w0, fin) in finals.items():
        ax.loglog(w0, fin, marker=marks[kind], color=colors[proc], ls="-", lw=0.7, ms=4,
                  label=f"{proc}/{kind}: {metrics[f'{proc}_{kind}_slope']:.3f}")
    panel(ax, "W₂(μ₀, ν₀)", "W₂(μ_T, ν_T)", "(c) final distance; legend: fitted slope",
          legend=True)
    if uniq is not None:
        ax = axes[3]
        ax.loglog(uniq["taus"], uniq["w2"], "o-", label=f"slope {metrics['uniqueness_slope']:.2f}")
        log_ticks(ax, uniq["taus"].tolist())
        panel(ax, "τ", "W₂(JKO_τ(T), particles(T))", "(d) uniqueness: JKO → particles", legend=True)
    cap = (f"Stability in the initial data ({p['normalization']}, direction {p['direction']}, n = {p['n']}, "
           f"H = {p['heads']}, d = {p['d']}, T = {p['t1']:g}). (a) The distance ratio stays below the Grönwall "
           f"bound exp(∫L) (dashed), which is loose by "
           f"{-max(metrics[f'{q}_max_log10_ratio_over_gronwall'] for q in curves):.0f} or more orders of magnitude: "
           f"L is a worst case over all measures, e^(β‖A‖) included. (b) The ratio does not depend on ε: "
           f"the flow map is "
           f"differentiable in the data. (c) W₂(μ_T, ν_T) ∝ W₂(μ₀, ν₀), fitted slopes "
           f"{metrics['slope_min']:.3f}–{metrics['slope_max']:.3f}.")
    if uniq is not None:
        cap += (f" (d) JKO (identity coupling) and particles (effective field) from the same data agree as τ → 0 "
                f"(slope {metrics['uniqueness_slope']:.2f}; see the jko_vs_particles study).")
    save_captioned(run, fig, "stability_data", cap, metrics, tidy=True)


# ============================================================================ stability in the weights
WEIGHT_OPTIONS = {
    "d": Option(3, (int,), "ambient dimension (S^{d-1})", check=at_least(2)),
    "n": Option(16, (int,), "number of tokens", check=at_least(2)),
    "heads": Option(2, (int,), "number of heads H", check=positive),
    "head_scale": Option(0.5, (float,), "A_h(0) = scale·(Z + Zᵀ)", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "eps": Option([1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6], (list,), "weight perturbations ε", check=_eps_list),
    "perturbations": Option(["ou", "oscillating", "layerwise"], (list,), "Θ^ε families",
                            check=_subset(("ou", "oscillating", "layerwise"))),
    "layers": Option(4, (int,), "number of layers of the layerwise weights", check=positive),
    "sigma": Option(2 ** 0.5, (float,), "OU noise σ", check=nonnegative),
    "t1": Option(2.0, (float,), "final time", check=positive),
    "dt": Option(0.01, (float,), "RK4 step = weight-path grid", check=positive),
    "record_every": Option(5, (int,), "record every k-th step", check=positive),
    "normalization": Option("softmax", (str,), "field normalisation",
                            choices=("softmax", "unnormalized", "relu", "effective")),
    "direction": _DIRECTION,
    "seed": Option(0, (int,), "heads seed (tokens seed + 1, weight noise seed + 2, perturbation seed + 3)"),
    "dtype": DTYPE,
    "figures": Option(True, (bool,), "write the figure"),
}


def perturbed_weights(kind: str, heads0: tp.Heads, eps, *, t1: float, dt: float, sigma: float = 2 ** 0.5,
                      seed: int = 0, layer_heads=None):
    """Θ^ε of the weight-stability study for every ε in ``eps`` at once (batch dim (E,) in front of the heads;
    ε = 0: the unperturbed Θ), all from the public API.

    "ou": the OU path A(t) of seed ``seed`` plus ε times an independent OU path (seed ``seed + 1``),
    replayed as one ``tp.WeightPath``; "oscillating": dA = (F(t + ε) − A) dt (``tp.Custom`` with
    ``tp.oscillating_target``, Euler on the grid, sampled once and replayed); "layerwise": ``layer_heads``
    (a list of Heads) with ε times a fixed symmetric Gaussian matrix (seed ``seed + 1``) added to every
    layer's scores, each layer lasting t1 / len(layer_heads)."""
    H, d = heads0.num_heads, heads0.dim
    e = torch.as_tensor(list(eps), dtype=heads0.dtype, device=heads0.device)
    E = e.shape[0]
    col = e.reshape(E, 1, 1, 1)
    if kind == "ou":
        a = tp.sample_path(tp.OrnsteinUhlenbeck(heads0, sigma=sigma), t1=t1, dt=dt, seed=seed)
        b = tp.sample_path(tp.OrnsteinUhlenbeck(heads0, sigma=sigma), t1=t1, dt=dt, seed=seed + 1)
        noise = None if a.noise is None else a.noise.unsqueeze(1) + col * b.noise.unsqueeze(1)
        return tp.WeightPath(a.times, a.scores.unsqueeze(1) + col * b.scores.unsqueeze(1),
                             a.rates.unsqueeze(1) + col * b.rates.unsqueeze(1), noise, list(a.sigmas), a.template)
    if kind == "oscillating":
        def drift(t, A):
            F = torch.stack([tp.oscillating_target(t + float(v), d, H, dtype=A.dtype, device=A.device) for v in e])
            return F - A
        start = tp.Heads.symmetric(heads0.score_matrix.expand(E, H, d, d).clone(), beta=heads0.beta,
                                   weights=heads0.weights)
        return tp.sample_path(tp.Custom(start, drift), t1=t1, dt=dt, seed=seed)
    if kind == "layerwise":
        g = torch.Generator().manual_seed(seed + 1)
        out = []
        for h in layer_heads:
            Z = torch.randn(h.score_matrix.shape, generator=g, dtype=torch.float64).to(h.dtype)
            out.append(tp.Heads.symmetric(h.score_matrix + col * (Z + Z.transpose(-1, -2)) / 2, beta=h.beta,
                                          weights=h.weights))
        return tp.Layerwise(out, layer_time=t1 / len(out))
    raise ValueError(f"perturbation {kind!r}; allowed values: 'ou', 'oscillating', 'layerwise'")


def _unperturbed(kind: str, theta):
    """The ε = 0 member (batch index 0) of a batched Θ^ε as its own process."""
    if kind == "layerwise":
        return tp.Layerwise([tp.Heads.symmetric(h.score_matrix[0], beta=h.beta, weights=h.weights)
                             for h in theta.layers], layer_time=theta.layer_time)
    noise = None if theta.noise is None else theta.noise[:, 0]
    return tp.WeightPath(theta.times, theta.scores[:, 0], theta.rates[:, 0], noise, list(theta.sigmas),
                         theta.template)


def _check_weights(p):
    _check_resolution(p)
    _whole_steps(p["t1"], p["dt"])


@study("theorem_stability_weights", WEIGHT_OPTIONS,
       "Stability in the weights: Θ^ε → Θ gives E^ε → E and μ^ε → μ, linearly in ε",
       validate=_check_weights)
def run_stability_weights(params, run) -> Dict[str, object]:
    p = dict(params)
    _check_weights(p)
    dtype = dtype_of(p)
    heads0 = _random_heads(p, p["seed"], dtype)
    x0 = _tokens(p, p["seed"] + 1, dtype)
    layer_heads = [heads0] + [_random_heads(p, p["seed"] + 10 + k, dtype) for k in range(p["layers"] - 1)]
    eps = sorted(p["eps"], reverse=True)
    metrics: Dict[str, object] = {"direction": p["direction"], "normalization": p["normalization"]}
    results = {}
    for kind in p["perturbations"]:
        def go(kind=kind):
            theta = perturbed_weights(kind, heads0, [0.0] + eps, t1=p["t1"], dt=p["dt"], sigma=p["sigma"],
                                      seed=p["seed"] + 2, layer_heads=layer_heads)
            X0 = x0.expand(len(eps) + 1, *x0.shape).clone()
            tr = tp.simulate(X0, theta, t1=p["t1"], dt=p["dt"], method="rk4", normalization=p["normalization"],
                             direction=p["direction"], record_every=p["record_every"], diagnostics=False,
                             progress=False)
            energy = torch.stack([tp.energy(x, theta.heads_at(float(t))) for t, x in zip(tr.times, tr.x)])  # (T, E+1)
            dE = (energy[:, 1:] - energy[:, :1]).abs().T  # (E, T)
            w2 = tp.distance(tr.x[-1, 1:], tr.x[-1, :1])
            # the ε = 0 member against an independent unbatched run of the unperturbed weights
            ref = tp.simulate(x0, _unperturbed(kind, theta), t1=p["t1"], dt=p["dt"], method="rk4",
                              normalization=p["normalization"], direction=p["direction"],
                              record_every=p["record_every"], diagnostics=False, progress=False)
            return {"times": tr.times, "energy_gap": dE, "w2_T": w2, "energy": energy[:, 0],
                    "zero_limit": (tr.x[:, 0] - ref.x).abs().max()}

        out = cached(run, f"weights_{kind}", go, logger)
        results[kind] = out
        sup = out["energy_gap"].max(-1).values
        metrics[f"{kind}_sup_energy_gap"] = sup.tolist()
        metrics[f"{kind}_w2_T"] = out["w2_T"].tolist()
        metrics[f"{kind}_energy_slope"] = fit_slope(eps, sup.tolist())
        metrics[f"{kind}_w2_slope"] = fit_slope(eps, out["w2_T"].tolist())
        metrics[f"{kind}_zero_limit_max_abs"] = float(out["zero_limit"])
        run.save_series(f"weights_{kind}", {"eps": eps, "sup_energy_gap": sup, "w2_T": out["w2_T"]})
    slopes = [metrics[f"{k}_{q}_slope"] for k in p["perturbations"] for q in ("energy", "w2")]
    metrics["slope_min"], metrics["slope_max"] = min(slopes), max(slopes)
    if p["figures"]:
        _weights_figure(run, p, eps, results, metrics)
    return metrics


def _weights_figure(run, p, eps, results, metrics):
    fig, axes = subplots(1, 3, figsize=(13, 4.8))
    for j, (kind, out) in enumerate(results.items()):
        sup = out["energy_gap"].max(-1).values
        axes[0].loglog(eps, sup, "o-", color=f"C{j}", label=f"{kind}: {metrics[f'{kind}_energy_slope']:.3f}")
        axes[1].loglog(eps, out["w2_T"], "s-", color=f"C{j}", label=f"{kind}: {metrics[f'{kind}_w2_slope']:.3f}")
    panel(axes[0], "ε", "sup_t |E^ε(t) − E(t)|", "(a) energies; legend: fitted slope", legend=True)
    panel(axes[1], "ε", "W₂(μ^ε_T, μ_T)", "(b) final tokens; legend: fitted slope", legend=True)
    kind0 = next(iter(results))
    out = results[kind0]
    for i, e in enumerate(eps):
        axes[2].plot(out["times"], out["energy_gap"][i] / e, color=f"C{i}", label=f"ε = {e:g}")
    panel(axes[2], "t", "|E^ε(t) − E(t)| / ε", f"(c) {kind0}: one curve for all ε", legend=True)
    cap = (f"Stability in the weights ({p['normalization']}, direction {p['direction']}, n = {p['n']}, "
           f"H = {p['heads']}, d = {p['d']}, T = {p['t1']:g}): Θ^ε = OU path + ε·independent path, oscillating "
           f"target F(t + ε), layer scores + ε·noise. Energies and final tokens converge linearly in ε "
           f"(slopes {metrics['slope_min']:.3f}–{metrics['slope_max']:.3f}); (c) the rescaled energy gap is "
           f"independent of ε.")
    save_captioned(run, fig, "stability_weights", cap, metrics, tidy=True)


# ============================================================================ the ω-limit
OMEGA_OPTIONS = {
    "d": Option(3, (int,), "ambient dimension (S^{d-1})", check=at_least(2)),
    "n": Option(16, (int,), "number of tokens", check=at_least(2)),
    "heads": Option(4, (int,), "number of heads H of the layerwise, damped and oscillating cases", check=positive),
    "ou_heads": Option([1, 10, 100], (list,), "H of the OU cases", check=_head_counts),
    "cases": Option(["ou", "layerwise", "damped", "oscillating"], (list,), "weight families",
                    check=_subset(("ou", "layerwise", "damped", "oscillating"))),
    "head_scale": Option(0.5, (float,), "A_h(0) = scale·(Z + Zᵀ)", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "sigma": Option(2 ** 0.5, (float,), "OU noise σ (stationary law: A = I + σ/√2 · W_sym)", check=nonnegative),
    "stationary_samples": Option(1000, (int,), "heads drawn from the OU stationary law for Θ_∞", check=positive),
    "layers": Option(4, (int,), "number of layers (the last holds for ever)", check=at_least(2)),
    "layer_time": Option(1.0, (float,), "time each layer lasts", check=positive),
    "damping": Option(0.3, (float,), "γ of the damped oscillation A∞ + e^{−γt} cos(ωt) M", check=positive),
    "frequency": Option(2.0, (float,), "ω of the damped oscillation", check=positive),
    "t1": Option(20.0, (float,), "final time", check=positive),
    "dt": Option(0.05, (float,), "RK4 step (= weight grid)", check=positive),
    "record_every": Option(10, (int,), "record every k-th step", check=positive),
    "normalization": Option("effective", (str,), "field ('effective': the exact gradient flow of E for every H)",
                            choices=("effective", "softmax")),
    "direction": _DIRECTION,
    "cluster_radius": Option(0.1, (float,), "chordal radius of tp.clustering.cluster_count", check=positive),
    "hessian_max_dof": Option(400, (int,), "compute the Hessian when n(d − 1) is at most this", check=positive),
    "seed": Option(0, (int,), "heads seed (tokens seed + 1, weight noise seed + 2)"),
    "dtype": DTYPE,
    "figures": Option(True, (bool,), "write the figure"),
}


def riemannian_hessian(x, heads, weights=None):
    """The Hessian of E(·, Θ) on (S^{d-1})^n at the tokens x (n, d), in orthonormal tangent frames.

    u ↦ E(x(u)) with x_i(u) = (x_i + B_i u_i)/|x_i + B_i u_i|, B_i (d, d−1) an orthonormal basis of
    T_{x_i}S^{d-1}; the derivatives at u = 0 are taken by automatic differentiation of ``tp.energy``.
    At a critical point (zero Riemannian gradient) this is the Riemannian Hessian.

    Returns (gradient (n(d−1),), Hessian (n(d−1), n(d−1)))."""
    n, d = x.shape
    P = torch.eye(d, dtype=x.dtype, device=x.device) - x[:, :, None] * x[:, None, :]
    _, vecs = torch.linalg.eigh(P)
    B = vecs[..., 1:]  # eigenvalue 1 eigenvectors: the tangent space (the 0 one is x)

    def E(u):
        y = x + (B @ u.reshape(n, d - 1, 1)).squeeze(-1)
        return tp.energy(y / y.norm(dim=-1, keepdim=True), heads, weights)

    u0 = torch.zeros(n * (d - 1), dtype=x.dtype, device=x.device)
    grad = torch.autograd.functional.jacobian(E, u0)
    hess = torch.autograd.functional.hessian(E, u0)
    return grad, hess


def _stationary_ou(p, H_inf: int, dtype) -> tp.Heads:
    """H_inf heads from the OU stationary law A = I + (σ/√(2κ)) W_sym, κ = 1 (the law the weights converge to)."""
    g = torch.Generator().manual_seed(p["seed"] + 7)
    d = p["d"]
    Z = torch.randn(H_inf, d, d, generator=g, dtype=torch.float64)
    A = torch.eye(d, dtype=torch.float64) + p["sigma"] / math.sqrt(2) * (Z + Z.transpose(-1, -2)) / 2
    return tp.Heads.symmetric(A.to(dtype), beta=p["beta"])


def _omega_cases(p, dtype):
    """name -> (Θ_t, Θ_∞, what Θ_∞ is) of the ω-limit study."""
    cases = {}
    H, d = p["heads"], p["d"]
    for c in p["cases"]:
        if c == "ou":
            for Hou in p["ou_heads"]:
                h0 = _random_heads(p, p["seed"], dtype, num_heads=Hou)
                cases[f"ou_H{Hou}"] = (tp.OrnsteinUhlenbeck(h0, sigma=p["sigma"]),
                                       _stationary_ou(p, p["stationary_samples"], dtype),
                                       "samples of the OU stationary law (the H → ∞ limit of the head measure)")
        elif c == "layerwise":
            layers = [_random_heads(p, p["seed"] + 10 + k, dtype) for k in range(p["layers"])]
            cases["layerwise"] = (tp.Layerwise(layers, layer_time=p["layer_time"]), layers[-1], "the last layer")
        elif c == "damped":
            A_inf = _random_heads(p, p["seed"], dtype)
            M = _random_heads(p, p["seed"] + 20, dtype).score_matrix
            gam, om = p["damping"], p["frequency"]

            def drift(t, A, A_inf=A_inf.score_matrix, M=M, gam=gam, om=om):
                # A(t) = A∞ + e^{−γt} cos(ωt) M solves dA = [−γ(A − A∞) − ω e^{−γt} sin(ωt) M] dt
                return -gam * (A - A_inf) - om * math.exp(-gam * t) * math.sin(om * t) * M

            start = tp.Heads.symmetric(A_inf.score_matrix + M, beta=p["beta"])
            cases["damped"] = (tp.Custom(start, drift), A_inf, "A∞ (the damped oscillation's centre)")
        else:
            h0 = _random_heads(p, p["seed"], dtype)
            mean = tp.Heads.symmetric(2 * torch.eye(d, dtype=dtype).expand(H, d, d).clone(), beta=p["beta"])
            cases["oscillating"] = (tp.Oscillating(h0), mean, "the period mean 2I of F(t) (no limit exists)")
    return cases


def _check_omega(p):
    _whole_steps(p["t1"], p["dt"])


@study("theorem_omega_limit", OMEGA_OPTIONS,
       "The ω-limit: residual velocity against the limiting weights, limit states classified", validate=_check_omega)
def run_omega_limit(params, run) -> Dict[str, object]:
    p = dict(params)
    _check_omega(p)
    dtype = dtype_of(p)
    x0 = _tokens(p, p["seed"] + 1, dtype)
    metrics: Dict[str, object] = {"direction": p["direction"], "normalization": p["normalization"],
                                  "limit_weights": {}}
    results = {}
    stable_sign = 1.0 if p["direction"] == "descent" else -1.0  # descent decreases E: stable limits are minima
    for name, (theta, theta_inf, what) in _omega_cases(p, dtype).items():
        metrics["limit_weights"][name] = what

        def go(theta=theta, theta_inf=theta_inf):
            tr = tp.simulate(x0, theta, t1=p["t1"], dt=p["dt"], method="rk4", normalization=p["normalization"],
                             direction=p["direction"], record_every=p["record_every"], seed=p["seed"] + 2,
                             progress=run.progress)
            V = tp.velocity(tr.x, theta_inf, normalization=p["normalization"], direction=p["direction"])
            resid = V.square().sum(-1).mean(-1).sqrt()  # ‖V[μ_t, Θ_∞]‖_{L²(μ_t)}
            out = {"times": tr.times, "slope": tr.slope, "residual": resid, "x_T": tr.x[-1]}
            if p["n"] * (p["d"] - 1) <= p["hessian_max_dof"]:
                g, Hs = riemannian_hessian(tr.x[-1].double(), theta_inf.to(torch.float64))
                out["grad_norm"] = g.norm()
                out["hessian_eigs"] = torch.linalg.eigvalsh(0.5 * (Hs + Hs.T))
            return out

        out = cached(run, f"omega_{name}", go, logger)
        results[name] = out
        T = out["times"]
        late = T >= 0.9 * T[-1]
        early = (T > 0) & (T <= 0.1 * T[-1] + 1e-12)
        m = {"slope_T": float(out["slope"][-1]), "residual_T": float(out["residual"][-1]),
             "residual_late_mean": float(out["residual"][late].mean()),
             "residual_early_mean": float(out["residual"][early].mean()) if bool(early.any()) else float("nan"),
             "slope_late_mean": float(out["slope"][late].mean()),
             "clusters_T": int(tp.clustering.cluster_count(out["x_T"], radius=p["cluster_radius"])),
             "mean_overlap_T": float(tp.clustering.mean_overlap(out["x_T"])[0])}
        m["residual_decay"] = m["residual_late_mean"] / m["residual_early_mean"]
        if "hessian_eigs" in out:
            ev = out["hessian_eigs"] * stable_sign
            tol = 1e-6 * float(ev.abs().max())
            m.update({"grad_norm_T": float(out["grad_norm"]), "hessian_min": float(out["hessian_eigs"].min()),
                      "hessian_max": float(out["hessian_eigs"].max()), "unstable_directions": int((ev < -tol).sum()),
                      "zero_directions": int((ev.abs() <= tol).sum())})
        metrics[name] = m
        run.save_series(f"omega_{name}", {"t": T, "slope": out["slope"], "residual": out["residual"]})
    if p["figures"]:
        _omega_figure(run, p, results, metrics)
    return metrics


def _omega_figure(run, p, results, metrics):
    fig, axes = subplots(1, 3, figsize=(13.5, 4.8))
    for j, (name, out) in enumerate(results.items()):
        c = f"C{j}"
        axes[0].semilogy(out["times"], out["slope"].clamp_min(1e-300), color=c, label=name)
        axes[1].semilogy(out["times"], out["residual"].clamp_min(1e-300), color=c, label=name)
        if "hessian_eigs" in out:
            ev = out["hessian_eigs"]
            axes[2].plot(np.arange(len(ev)), ev / ev.abs().max(), ".-", color=c, ms=3, lw=0.6,
                         label=f"{name}: {metrics[name]['clusters_T']} cl., "
                               f"{metrics[name]['unstable_directions']} unst.")
    panel(axes[0], "t", "G²(t) (metric slope, current Θ_t)", "(a) metric slope", legend=True)
    panel(axes[1], "t", "‖V[μ_t, Θ_∞]‖_{L²(μ_t)}", "(b) residual velocity against the limit weights",
          legend=True)
    panel(axes[2], "index", "eigenvalue / max |eigenvalue|", "(c) Hessian of E(·, Θ_∞) at μ_T", legend=True)
    dec = ", ".join(f"{k} {v['residual_decay']:.1e}" for k, v in metrics.items() if isinstance(v, dict) and
                    "residual_decay" in v)
    cap = (f"The ω-limit ({p['normalization']} field, direction {p['direction']}, n = {p['n']}, d = {p['d']}, "
           f"T = {p['t1']:g}). (a) the metric slope G² against the current weights; (b) the residual velocity "
           f"of μ_t against the "
           f"limiting weights Θ_∞ (OU: samples of the stationary law — the theorem speaks of laws, or H → ∞; "
           f"a pathwise Θ_t never converges at finite H; oscillating: the period mean, no limit exists); late/early "
           f"ratio: {dec}. (c) Hessian spectrum of E(·, Θ_∞) at the final state (legend: clusters, directions of "
           f"the wrong sign for a stable critical point).")
    save_captioned(run, fig, "omega_limit", cap, metrics, tidy=True)


# ============================================================================ the fast-weights limit
FAST_OPTIONS = {
    "d": Option(3, (int,), "ambient dimension (S^{d-1})", check=at_least(2)),
    "n": Option(8, (int,), "number of tokens", check=at_least(2)),
    "heads": Option(2, (int,), "number of heads H", check=positive),
    "head_scale": Option(0.5, (float,), "A_h = scale·(Z + Zᵀ), fixed; mean values V̄_h = A_h", check=positive),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "value_std": Option(0.5, (float,), "s: entrywise std of the diffusive value noise", check=positive),
    "families": Option(["iid", "ou"], (list,), "iid: values resampled per layer; ou: OU values, correlation time τ",
                       check=_subset(("iid", "ou"))),
    "deltas": Option([0.1, 0.05, 0.025, 0.0125], (list,), "layer lengths δ (iid) = correlation times τ (ou)",
                     check=_eps_list),
    "refine": Option(4, (int,), "fine Brownian steps per smallest δ (the SDE's Heun step)", check=positive),
    "substeps": Option(2, (int,), "RK4 steps per layer of the iid pre-limit", check=positive),
    "paths": Option(256, (int,), "Monte-Carlo paths (shared by the pre-limits and the SDE)", check=at_least(2)),
    "t1": Option(0.5, (float,), "final time", check=positive),
    "normalization": Option("softmax", (str,), "field normalisation (linear in V)",
                            choices=("softmax", "unnormalized", "relu")),
    "direction": _DIRECTION,
    "seed": Option(0, (int,), "heads seed (tokens seed + 1, Brownian seed + 2)"),
    "dtype": DTYPE,
    "figures": Option(True, (bool,), "write the figure"),
}


def common_noise_sde(x0, heads: tp.Heads, increments, dt: float, *, normalization: str = "softmax",
                     direction: str = "descent"):
    """The fast-weights limit SDE dx_i = V[μ, (A, V̄)](x_i) dt + Σ_h ω_h P_{x_i} (∘dW_h) ȳ_h(x_i), by the
    projected stochastic Heun scheme (Stratonovich, weak order 1), with one noise shared by all tokens.

    The field is linear in the value matrices, so one step with Brownian increments ΔW_h (d×d per head) is
    the velocity of the heads (A_h, V̄_h dt + ΔW_h): k1 = tp.velocity(x, ·), x̃ = (x + k1)/|·|,
    k2 = tp.velocity(x̃, ·), x ← (x + (k1 + k2)/2)/|·|.

    Parameters
    ----------
    x0
        tokens (P, n, d) (P paths).  heads: mean heads (A_h, V̄_h, ω_h, β), unbatched.
    increments
        (K, P, H, d, d) Brownian increments of the value noise (variance s² dt per entry).
    dt : float
        the step of the increments.

    Returns
    -------
    result
        tokens (K + 1, P, n, d) at the grid times.
    """
    A, Vbar = heads.score_matrix, heads.value_matrix
    x = x0
    out = [x0]
    for dW in increments:
        h = tp.Heads(A, Vbar * dt + dW, heads.weights, heads.beta)
        k1 = tp.velocity(x, h, normalization=normalization, direction=direction)
        xt = tp.sphere.normalize(x + k1)
        k2 = tp.velocity(xt, h, normalization=normalization, direction=direction)
        x = tp.sphere.normalize(x + 0.5 * (k1 + k2))
        out.append(x)
    return torch.stack(out)


def _check_fast(p):
    deltas = sorted(p["deltas"])
    fine = deltas[0] / p["refine"]
    for dl in deltas:
        r = round(dl / fine)
        if abs(r * fine - dl) > 1e-9 * dl:
            raise ValueError(f"config key 'deltas': every δ must be a whole multiple of min(deltas)/refine = {fine:g} "
                             f"(got δ = {dl:g})")
        _whole_steps(p["t1"], dl, "t1", "deltas")


def _observables(x, score_heads):
    """(mean overlap ⟨x_i, x_j⟩ over i ≠ j, energy E(μ, A)) of tokens (..., n, d)."""
    return tp.clustering.mean_overlap(x)[0], tp.energy(x, score_heads)


@study("theorem_fast_weights", FAST_OPTIONS,
       "The fast-weights limit: i.i.d./OU value noise → a token SDE with common noise (weak rate in δ)",
       validate=_check_fast)
def run_fast_weights(params, run) -> Dict[str, object]:
    p = dict(params)
    _check_fast(p)
    dtype = dtype_of(p)
    mean = _random_heads(p, p["seed"], dtype)  # A_h = V̄_h
    A = mean.score_matrix
    H, d, P = p["heads"], p["d"], p["paths"]
    score_heads = tp.Heads.symmetric(A, beta=p["beta"], weights=mean.weights)
    x0 = _tokens(p, p["seed"] + 1, dtype).expand(P, p["n"], d).clone()
    deltas = sorted(p["deltas"], reverse=True)
    fine = min(deltas) / p["refine"]
    Kf = _whole_steps(p["t1"], fine, "t1")
    s = p["value_std"]
    g = torch.Generator().manual_seed(p["seed"] + 2)
    dW = (s * math.sqrt(fine) * torch.randn(Kf, P, H, d, d, generator=g, dtype=torch.float64)).to(dtype)
    kw = dict(normalization=p["normalization"], direction=p["direction"])

    def limit():
        xs = common_noise_sde(x0, mean, dW, fine, **kw)
        return {"x_T": xs[-1]}

    ref = cached(run, "fast_limit_sde", limit, logger)
    ov_ref, en_ref = _observables(ref["x_T"], score_heads)
    metrics: Dict[str, object] = {"direction": p["direction"], "normalization": p["normalization"],
                                  "sde_step": fine, "limit_mean_overlap": float(ov_ref.mean()),
                                  "limit_energy": float(en_ref.mean()),
                                  "limit_mean_overlap_mc_se": float(ov_ref.std() / math.sqrt(P))}
    curves = {}
    for fam in p["families"]:
        def go(fam=fam):
            xs = []
            for dl in deltas:
                r = round(dl / fine)
                if fam == "iid":
                    L = round(p["t1"] / dl)
                    inc = dW.reshape(L, r, P, H, d, d).sum(1)  # the Brownian increment of each layer
                    layers = [tp.Heads(A, mean.value_matrix + inc[l] / dl, mean.weights, mean.beta) for l in range(L)]
                    theta = tp.Layerwise(layers, layer_time=dl)
                    tr = tp.simulate(x0, theta, t1=p["t1"], dt=dl / p["substeps"], method="rk4", diagnostics=False,
                                     record_every=L * p["substeps"], progress=False, **kw)
                else:
                    # OU values V = V̄ + U, dU = −U/τ dt + (s/τ) dW (stationary variance s²/(2τ),
                    # ∫U dt → s W),
                    # stepped on the fine grid with the same increments: U ← e^{−h/τ} U + (1 − e^{−h/τ}) ΔW/h
                    a = math.exp(-fine / dl)  # τ = δ
                    U = [torch.zeros_like(dW[0])]
                    for k in range(Kf):
                        U.append(a * U[-1] + (1 - a) * dW[k] / fine)
                    layers = [tp.Heads(A, mean.value_matrix + u, mean.weights, mean.beta) for u in U]
                    theta = tp.Layerwise(layers, layer_time=fine, interpolation="linear")
                    tr = tp.simulate(x0, theta, t1=p["t1"], dt=fine, method="rk4", diagnostics=False,
                                     record_every=Kf, progress=False, **kw)
                xs.append(tr.x[-1])
            return {"x_T": torch.stack(xs)}

        out = cached(run, f"fast_{fam}", go, logger)
        ov, en = _observables(out["x_T"], score_heads)  # (D, P)
        c = {"overlap_err": (ov.mean(-1) - ov_ref.mean()).abs(),
             "overlap_se": (ov - ov_ref).std(-1) / math.sqrt(P),
             "energy_err": (en.mean(-1) - en_ref.mean()).abs(),
             "energy_se": (en - en_ref).std(-1) / math.sqrt(P),
             "strong": (out["x_T"] - ref["x_T"]).square().sum(-1).mean((-1, -2)).sqrt()}
        curves[fam] = c
        for key in ("overlap_err", "energy_err", "strong"):
            metrics[f"{fam}_{key}"] = c[key].tolist()
            metrics[f"{fam}_{key}_rate"] = fit_slope(deltas, c[key].tolist())
        metrics[f"{fam}_overlap_se"] = c["overlap_se"].tolist()
        metrics[f"{fam}_energy_se"] = c["energy_se"].tolist()
        # a weak error is resolved where it exceeds twice the Monte-Carlo standard error of the coupled difference
        for key in ("overlap", "energy"):
            ok = [bool(e > 2 * se) for e, se in zip(c[f"{key}_err"], c[f"{key}_se"])]
            metrics[f"{fam}_{key}_resolved"] = ok
            # the rate over the resolved points only (NaN when fewer than two)
            metrics[f"{fam}_{key}_err_rate_resolved"] = fit_slope([dl for dl, k in zip(deltas, ok) if k],
                                                                  [float(e) for e, k in zip(c[f"{key}_err"], ok) if k])
        run.save_series(f"fast_{fam}", {"delta": deltas, **{k: v for k, v in c.items()}})
    if p["figures"]:
        _fast_figure(run, p, deltas, curves, metrics)
    return metrics


def _fast_figure(run, p, deltas, curves, metrics):
    fig, axes = subplots(1, 3, figsize=(13, 4.8))
    for j, (fam, c) in enumerate(curves.items()):
        for ax, key, lab in ((axes[0], "overlap", "mean overlap"), (axes[1], "energy", "energy")):
            ax.errorbar(deltas, c[f"{key}_err"], yerr=c[f"{key}_se"], marker="o", color=f"C{j}", capsize=2,
                        label=f"{fam}: rate {metrics[f'{fam}_{key}_err_rate']:.2f}")
        axes[2].loglog(deltas, c["strong"], "s-", color=f"C{j}",
                       label=f"{fam}: rate {metrics[f'{fam}_strong_rate']:.2f}")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        log_ticks(ax, deltas)
    panel(axes[0], "δ (layer length / correlation time)", "|E⟨x_i, x_j⟩_δ − E⟨x_i, x_j⟩_SDE|",
          "(a) weak error, overlap", legend=True)
    panel(axes[1], "δ", "|E E_δ − E E_SDE|", "(b) weak error, energy", legend=True)
    panel(axes[2], "δ", "E[|x_δ − x_SDE|²]^{1/2}", "(c) strong error (same Brownian)", legend=True)
    cap = (f"The fast-weights limit ({p['normalization']}, direction {p['direction']}, n = {p['n']}, H = {p['heads']}, "
           f"d = {p['d']}, T = {p['t1']:g}, {p['paths']} paths): values V = V̄ + ΔW/δ resampled per layer (iid) or "
           f"OU with correlation time δ, against the common-noise Stratonovich SDE (stochastic Heun, step "
           f"{metrics['sde_step']:g}) on the same Brownian paths. Error bars: Monte-Carlo standard errors of the "
           f"coupled differences; a weak error below 2 of them is not resolved (metrics *_resolved).")
    save_captioned(run, fig, "fast_weights", cap, metrics, tidy=True)
