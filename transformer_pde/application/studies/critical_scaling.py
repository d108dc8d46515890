"""Critical attention scaling β_n = γ log n (kind ``critical_scaling``; docs/critical_scaling.md).

One softmax head A = V = I whose inverse temperature is a rule of the context length
(``tp.Heads(I, beta=tp.LogScaling(γ))``, a tensor of γ: the whole sweep in one kernel call), one layer, a query
against n keys: every quantity is a query-against-keys statistic of :func:`transformer_pde.softmax_statistics`
(O(n) per query, keys in blocks; no n × n matrix is formed).  Three measurements:

1. **Crossing of the self weight** (Chen, Lin, Polyanskiy, Rigollet, arXiv 2510.05554): almost-simplex tokens
   y_j = √ρ e + √(1 − ρ) z_j in R^d (:mod:`transformer_pde.analysis.theory.scaling`).  The self weight of a token
   depends only on its scores, whose law is exact and cheap to sample at any d
   (:func:`~transformer_pde.analysis.theory.scaling.almost_simplex_scores`); the keys are then represented on S¹ by
   (s_j, √(1 − s_j²)) against the query (1, 0), which gives the same softmax.  Per seed, the γ*(n, d) at which
   the self weight is 1/2 (a coarse and a fine γ grid, log-odds interpolated), against the annealed prediction;
   γ_c is recovered by extrapolating γ*(n_max, d) to L/(d − 1) → 0 (a polynomial fit, bootstrap over seeds)
   and compared with 1/(1 − ρ).
2. **One layer as n grows** (full tokens in R^d, keys generated in blocks and merged by log-sum-exp): across γ,
   the self weight, the distance of the output ATT(y_q) = Σ_j p_j y_j to the mean of the tokens and to the
   token itself, and the norm of the layer's Jacobian ∂ATT(y_q)/∂y_q along tangent directions (the query part
   by central differences of the library's softmax mean, the token's own key analytically:
   J u = β Cov_p(y, ⟨u, y⟩) + p_q u for u ⊥ y_q).
3. **Uniform keys** (arXiv 2605.08505): a fixed query and n i.i.d. uniform keys on S^{d−1}
   (``tp.sphere.sample_uniform``), heads ``tp.PowerScaling.uniform_keys(d, c)``; per seed the β*_n at which the
   nearest key's weight is 1/2, and the slope of log β*_n against log n (bootstrap) against 2/(d − 1).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Dict, List

import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import scaling as ts

from . import Option, at_least, cached, dtype_of, log_ticks, panel, save_captioned, sphere_name, study, subplots
from .claims import claim

__all__ = ["run_critical_scaling", "self_weight_crossing", "streamed_attention", "layer_measurements",
           "uniform_key_crossing"]

log = logging.getLogger(__name__)


def _ints(lo: int):
    return lambda v: None if v and all(isinstance(k, int) and not isinstance(k, bool) and k >= lo for k in v) \
        and len(set(v)) == len(v) else f"must be a non-empty list of distinct integers >= {lo}"


def _rhos(v):
    return None if v and all(isinstance(r, float) and 0.0 <= r < 1.0 for r in v) else "must be floats in [0, 1)"


OPTIONS = {
    "rhos": Option([0.0, 0.3, 0.6], (list,), "pairwise inner products ρ of the almost-simplex tokens", check=_rhos),
    "crossing_ns": Option([100, 1000, 10000, 100000, 1000000], (list,), "context lengths n of the crossing",
                          check=_ints(3)),
    "crossing_dims": Option([16, 64, 256, 1024, 4096, 16384], (list,), "dimensions d of the almost-simplex tokens "
                            "(the scores' law is sampled exactly: the cost does not grow with d)",
                            check=_ints(3)),
    "crossing_seeds": Option(16, (int,), "independent token draws per (ρ, n, d)", check=at_least(2)),
    "fit_dim_min": Option(256, (int,), "dimensions d >= this enter the extrapolation of γ*(n_max, d)",
                          check=at_least(3)),
    "layer_rho": Option(0.5, (float,), "ρ of the one-layer measurements", check=lambda v: _rhos([v])),
    "layer_dim": Option(64, (int,), "dimension d of the one-layer measurements", check=at_least(3)),
    "layer_ns": Option([100, 1000, 10000, 100000, 1000000], (list,), "context lengths n of the one-layer sweep",
                       check=_ints(3)),
    "layer_gammas": Option([0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5], (list,),
                           "γ of the one-layer sweep, in units of γ_c = 1/(1 − ρ)",
                           check=lambda v: None if v and all(isinstance(g, float) and g > 0 for g in v) else
                           "must be a non-empty list of positive floats"),
    "layer_seeds": Option(4, (int,), "token draws per n of the one-layer sweep", check=at_least(2)),
    "directions": Option(2, (int,), "tangent directions u of the Jacobian norm", check=at_least(1)),
    "uniform_dims": Option([3, 5], (list,), "dimensions d of the uniform keys (S^{d-1})", check=_ints(2)),
    "uniform_ns": Option([100, 1000, 10000, 100000, 1000000], (list,), "numbers n of uniform keys",
                         check=_ints(10)),
    "uniform_seeds": Option(128, (int,), "key draws per (d, n) (log c* has an O(1) spread over draws)",
                            check=at_least(4)),
    "uniform_fit_min": Option(1000, (int,), "n >= this enter the fit of log β*_n against log n", check=at_least(10)),
    "key_block": Option(65536, (int,), "keys per block of the one-layer sweep (memory ~ block × d)",
                        check=at_least(16)),
    "bootstrap": Option(2000, (int,), "bootstrap resamples of the fits", check=at_least(100)),
    "seed": Option(0, (int,), "base seed"),
    "figures": Option(True, (bool,), "write the figures"),
}


def _validate(p):
    if max(p["uniform_ns"]) < p["uniform_fit_min"] or sum(n >= p["uniform_fit_min"] for n in p["uniform_ns"]) < 2:
        raise ValueError(f"uniform_fit_min = {p['uniform_fit_min']} leaves fewer than two n of uniform_ns "
                         f"{p['uniform_ns']} for the fit of the exponent; lower it or add larger n")
    if sum(d >= p["fit_dim_min"] for d in p["crossing_dims"]) < 2:
        raise ValueError(f"fit_dim_min = {p['fit_dim_min']} leaves fewer than two of crossing_dims "
                         f"{p['crossing_dims']} for the extrapolation of γ_c; lower it or add larger d")


def _resources(p):
    item = 4 if p["dtype"] == "float32" else 8
    n = max(max(p["crossing_ns"]), max(p["uniform_ns"]))
    G = 32
    mem = item * (n * 8 + G * n * 4 + p["key_block"] * p["layer_dim"] * (6 + 2 * p["directions"]) * 4)
    return {"memory": float(mem), "steps": 0.0,
            "detail": f"query-against-keys statistics up to n = {n} keys (O(n) memory: no n × n block)"}


# ---------------------------------------------------------------------------- 1. crossing of the self weight
def _keys_on_circle(s: torch.Tensor) -> torch.Tensor:
    """Keys (s_j, √(1 − s_j²)) on S¹: their scores against the query (1, 0) are s_j."""
    return torch.stack([s, torch.sqrt((1 - s * s).clamp_min(0.0))], -1)


def _self_weights(s: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """Self weight a(γ) = p_0 of the query whose scores against the n keys are s (s_0 = 1: itself), for every γ
    of the tensor ``gammas`` (β = γ log n), by one call of the library's kernel: (G,)."""
    n = s.shape[0]
    q = torch.tensor([[1.0, 0.0]], dtype=s.dtype)
    heads = tp.Heads(torch.eye(2, dtype=s.dtype)[None], beta=tp.LogScaling(gammas)).at_context(n)
    lse = tp.softmax_statistics(q, heads, keys=_keys_on_circle(s)).log_partition.reshape(-1)  # (G,)
    return torch.exp(heads.beta * s[0] - math.log(n) - lse)


def _crossing(x: np.ndarray, logit: np.ndarray) -> float:
    """The x at which the increasing ``logit`` crosses 0 (linear interpolation; NaN when it does not)."""
    k = np.nonzero(np.diff(np.sign(logit)) > 0)[0]
    if k.size == 0:
        return float("nan")
    i = int(k[0])
    return float(x[i] - logit[i] * (x[i + 1] - x[i]) / (logit[i + 1] - logit[i]))


def self_weight_crossing(s: torch.Tensor, rho: float, *, coarse=(0.6, 3.2, 40), fine: int = 16) -> float:
    """u* = γ*(1 − ρ) at which the self weight of the query with scores ``s`` equals 1/2: a coarse grid of u, then a
    fine grid on the bracketing interval (log-odds interpolated linearly)."""
    lo, hi, G = coarse
    u = torch.linspace(lo, hi, G, dtype=s.dtype)
    a = _self_weights(s, u / (1 - rho))
    logit = (torch.log(a) - torch.log1p(-a)).numpy()
    uc = _crossing(u.numpy(), logit)
    if not math.isfinite(uc):
        return uc
    step = (hi - lo) / (G - 1)
    u2 = torch.linspace(uc - step, uc + step, fine, dtype=s.dtype)
    a2 = _self_weights(s, u2 / (1 - rho))
    return _crossing(u2.numpy(), (torch.log(a2) - torch.log1p(-a2)).numpy())


def _crossings(p, rho, n, d, k_rho) -> np.ndarray:
    seeds = p["crossing_seeds"]
    base = p["seed"] + 7919 * k_rho + 104729 * (n % 9973) + 31 * d
    return np.array([self_weight_crossing(ts.almost_simplex_scores(n, d, rho, seed=base + 1000003 * i), rho)
                     for i in range(seeds)])


def _extrapolate(xs: np.ndarray, per_seed: List[np.ndarray], resamples: int, seed: int):
    """(u∞, its 95 % half-width, a, its half-width, degree) of the weighted polynomial fit
    u*(x) = u∞ + a x + b x² (a line for two points) of the seed means, weights 1/(standard error); the intervals
    by the percentile bootstrap (seeds resampled within each x, the weights kept)."""
    deg = 2 if len(xs) >= 3 else 1
    means = np.array([v.mean() for v in per_seed])
    w = 1.0 / np.array([v.std(ddof=1) / math.sqrt(v.size) for v in per_seed])
    coef = np.polyfit(xs, means, deg, w=w)
    rng = np.random.default_rng(seed)
    boot = np.empty((resamples, 2))
    for r in range(resamples):
        m = np.array([v[rng.integers(0, v.size, v.size)].mean() for v in per_seed])
        boot[r] = np.polyfit(xs, m, deg, w=w)[-2:][::-1]
    lo, hi = np.quantile(boot, [0.025, 0.975], axis=0)
    half = (hi - lo) / 2
    return float(coef[-1]), float(half[0]), float(coef[-2]), float(half[1]), deg


# ---------------------------------------------------------------------------- 2. one layer as n grows
def streamed_attention(queries: torch.Tensor, heads, blocks):
    """Softmax statistics of ``queries`` (k, d) against the union of the key ``blocks`` (an iterable of (m_b, d)
    tensors, uniform weights over all keys), merged block by block from :func:`transformer_pde.softmax_statistics`
    (log-sum-exp of the block log-partitions): (lse (..., k), mean (..., k, d), key sum (d,), n).  Memory: one
    block; the heads carry a fixed β (resolve a rule with ``heads.at_context(n)`` first)."""
    lse = mean = None
    ksum, n = 0.0, 0
    for y in blocks:
        st = tp.softmax_statistics(queries, heads, keys=y)
        l_b = st.log_partition[..., 0, :] + math.log(y.shape[0])  # log Σ_{j ∈ b} e^{s_j}, (..., k)
        m_b = st.mean[..., 0, :, :]
        if lse is None:
            lse, mean = l_b, m_b
        else:
            new = torch.logaddexp(lse, l_b)
            mean = torch.exp(lse - new).unsqueeze(-1) * mean + torch.exp(l_b - new).unsqueeze(-1) * m_b
            lse = new
        ksum = ksum + y.sum(0)
        n += y.shape[0]
    return lse - math.log(n), mean, ksum, n


def _blocks(n, d, rho, block, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    for i in range(0, n, block):
        yield ts.almost_simplex(min(block, n - i), d, rho, generator=g, dtype=dtype)


def layer_measurements(n: int, d: int, rho: float, gammas: torch.Tensor, *, directions: int = 2, block: int = 65536,
                       seed: int = 0, dtype=torch.float64) -> Dict[str, torch.Tensor]:
    """The self weight, |ATT − ȳ|, |ATT − y_q| and the Jacobian norm (RMS of |J u| over ``directions`` tangent unit
    vectors u) of token 0 of n almost-simplex tokens in R^d, for every γ of ``gammas`` (β = γ log n): (G,) each.
    One pass over the keys (generated in blocks) for the query and its shifted copies y_q ± h u."""
    stream = _blocks(n, d, rho, block, seed, dtype)
    first = next(stream)
    q = first[0]  # token 0: the query is one of the keys (self-attention)
    g = torch.Generator().manual_seed(seed + 1)
    U = torch.randn(directions, d, generator=g, dtype=dtype)
    U = tp.sphere.normalize(U - (U @ q).unsqueeze(-1) * q)  # tangent at y_q
    h = torch.finfo(dtype).eps ** (1 / 3)
    Q = torch.cat([q[None], q + h * U, q - h * U])  # (1 + 2K, d)
    heads = tp.Heads(torch.eye(d, dtype=dtype)[None], beta=tp.LogScaling(gammas.to(dtype))).at_context(n)
    lse, mean, ksum, m = streamed_attention(Q, heads, itertools.chain([first], stream))
    beta = heads.beta
    att = mean[:, 0]  # (G, d)
    pq = torch.exp(beta * (q @ q) - lse[:, 0])  # uniform weights: p_q = e^{β⟨q,q⟩}/(n m_q), lse = log m_q
    pq = pq / n
    K = directions
    fd = (mean[:, 1:1 + K] - mean[:, 1 + K:]) / (2 * h)  # β Cov_p(y, ⟨u, y⟩): the query's part, (G, K, d)
    Ju = fd + pq[:, None, None] * U  # + the token's own key: p_q u (⟨q, u⟩ = 0)
    ybar = ksum / m
    return {"self_weight": pq, "dist_mean": (att - ybar).norm(dim=-1), "dist_identity": (att - q).norm(dim=-1),
            "jacobian": Ju.square().sum(-1).mean(-1).sqrt()}


# ---------------------------------------------------------------------------- 3. uniform keys
def uniform_key_crossing(n: int, d: int, seed: int, *, coarse=(-4.0, 4.0, 40), fine: int = 16,
                         dtype=torch.float64) -> float:
    """log c* with β* = c*·n^{2/(d−1)} the inverse temperature at which the nearest of n i.i.d. uniform keys on
    S^{d−1} gets the weight 1/2 from the query e_0 (heads ``tp.PowerScaling.uniform_keys(d, c)``, c on a coarse then
    a fine grid of log c)."""
    Y = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    q = torch.zeros(1, d, dtype=dtype)
    q[0, 0] = 1.0
    smax = float(Y[:, 0].max())

    def logit(logc):
        heads = tp.Heads(torch.eye(d, dtype=dtype)[None],
                         beta=tp.PowerScaling.uniform_keys(d, c=torch.exp(logc))).at_context(n)
        lse = tp.softmax_statistics(q, heads, keys=Y).log_partition.reshape(-1)
        lp = heads.beta * smax - math.log(n) - lse  # log p_max
        return (lp - torch.log(-torch.expm1(lp))).numpy()

    lo, hi, G = coarse
    for _ in range(8):  # widen the grid until it brackets the crossing (nearly tied nearest keys need a large c)
        x = torch.linspace(lo, hi, G, dtype=dtype)
        lg = logit(x)
        if lg[0] < 0 < lg[-1]:
            break
        lo, hi = (lo - (hi - lo), lo) if lg[0] >= 0 else (hi, hi + (hi - lo))
    xc = _crossing(x.numpy(), lg)
    if not math.isfinite(xc):
        return xc
    step = (hi - lo) / (G - 1)
    x2 = torch.linspace(xc - step, xc + step, fine, dtype=dtype)
    return _crossing(x2.numpy(), logit(x2))


def _slope_fit(logn: np.ndarray, per_seed: List[np.ndarray], resamples: int, seed: int):
    means = np.array([v.mean() for v in per_seed])
    slope = float(np.polyfit(logn, means, 1)[0])
    rng = np.random.default_rng(seed)
    boot = np.empty(resamples)
    for r in range(resamples):
        m = np.array([v[rng.integers(0, v.size, v.size)].mean() for v in per_seed])
        boot[r] = np.polyfit(logn, m, 1)[0]
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return slope, float((hi - lo) / 2)


# ---------------------------------------------------------------------------- the study
@study("critical_scaling", OPTIONS, "critical attention scaling β_n = γ log n: self weight, outputs, Jacobian "
       "across γ up to 10⁶ keys; γ_c against 1/(1 − ρ); the n^{2/(d−1)} scale of uniform keys",
       validate=_validate, resources=_resources)
def run_critical_scaling(params, run):
    p = params
    dtype = dtype_of(p)
    metrics: Dict = {"settings": {}}
    claims = []

    # ---- 1. crossing of the self weight, extrapolation of γ_c -------------------------------------------------
    n_max = max(p["crossing_ns"])
    L = math.log(n_max)
    cross = {}
    for k, rho in enumerate(p["rhos"]):
        for d in p["crossing_dims"]:
            for n in p["crossing_ns"]:
                res = cached(run, f"cross_rho{rho:g}_d{d}_n{n}",
                             lambda rho=rho, d=d, n=n, k=k: {"u": torch.from_numpy(_crossings(p, rho, n, d, k))}, log)
                cross[(rho, d, n)] = res["u"].numpy()
    crossing_rows = []
    for k, rho in enumerate(p["rhos"]):
        fit_dims = [d for d in sorted(p["crossing_dims"]) if d >= p["fit_dim_min"]]
        xs = np.array([L / (d - 1) for d in fit_dims])
        per = [cross[(rho, d, n_max)] for d in fit_dims]
        u_inf, half, slope, slope_half, deg = _extrapolate(xs, per, p["bootstrap"], p["seed"] + k)
        gc = ts.critical_gamma(rho)
        claims.append(claim(f"gamma_c extrapolated (d -> inf, n = {n_max}), rho = {rho:g}", u_inf * gc, half * gc,
                            p["crossing_seeds"], reference=gc, holds=bool(abs(u_inf - 1) * gc <= half * gc),
                            fit_degree=deg, fit_dims=fit_dims))
        claims.append(claim(f"slope of gamma*(1-rho) in log n/(d-1) at x -> 0, rho = {rho:g} (annealed: 1/2)", slope,
                            slope_half, p["crossing_seeds"], reference=0.5, holds=bool(abs(slope - 0.5) <= slope_half),
                            fit_degree=deg, fit_dims=fit_dims))
        for d in sorted(p["crossing_dims"]):
            u = cross[(rho, d, n_max)]
            se = float(u.std(ddof=1) / math.sqrt(u.size))
            ann = ts.annealed_critical_gamma(rho, n_max, d) * (1 - rho)
            crossing_rows.append({"rho": rho, "d": d, "n": n_max, "u_star": float(u.mean()), "stderr": se,
                                  "annealed": ann})
            claims.append(claim(f"gamma*(1-rho) at n = {n_max}, d = {d}, rho = {rho:g} (vs the annealed approximation)",
                                float(u.mean()), se, u.size,
                                reference=ann, holds=bool(abs(u.mean() - ann) <= 2 * se)))
    metrics["crossing"] = crossing_rows

    # ---- 2. one layer as n grows -------------------------------------------------------------------------------
    rho, d = p["layer_rho"], p["layer_dim"]
    gc = ts.critical_gamma(rho)
    gam = torch.tensor(p["layer_gammas"], dtype=torch.float64) * gc
    layer = {}
    for n in p["layer_ns"]:
        def compute(n=n):
            runs = [layer_measurements(n, d, rho, gam, directions=p["directions"], block=p["key_block"],
                                       seed=p["seed"] + 1 + 7 * i + 1009 * (n % 65521), dtype=dtype)
                    for i in range(p["layer_seeds"])]
            return {k: torch.stack([r[k] for r in runs]).double() for k in runs[0]}
        layer[n] = cached(run, f"layer_n{n}", compute, log)
    nl = max(p["layer_ns"])
    metrics["layer"] = {str(n): {k: v.mean(0).tolist() for k, v in layer[n].items()} for n in p["layer_ns"]}
    metrics["layer_gammas_over_gc"] = p["layer_gammas"]
    names = {"self_weight": "self weight", "dist_mean": "|ATT - mean|", "dist_identity": "|ATT - y|",
             "jacobian": "Jacobian norm"}
    for g in (0.5, 1.0, 2.0):
        if g not in p["layer_gammas"]:
            continue
        j = p["layer_gammas"].index(g)
        for key, label in names.items():
            v = layer[nl][key][:, j].numpy()
            ref = float(ts.annealed_self_weight(g * gc, rho, nl, d)) if key == "self_weight" else None
            se = float(v.std(ddof=1) / math.sqrt(v.size))
            suffix = " (vs the annealed approximation)" if key == "self_weight" else ""
            claims.append(claim(f"{label} at gamma = {g:g} gamma_c, n = {nl}, d = {d}, rho = {rho:g}{suffix}",
                                float(v.mean()),
                                se, v.size, reference=ref,
                                holds=None if ref is None else bool(abs(v.mean() - ref) <= 2 * se + 1e-12)))

    # ---- 3. uniform keys: the n^{2/(d-1)} scale -------------------------------------------------------------------
    uni = {}
    for du in p["uniform_dims"]:
        for n in p["uniform_ns"]:
            def compute(du=du, n=n):
                return {"logc": torch.tensor([uniform_key_crossing(n, du, p["seed"] + 13 * du + 100003 * i + n % 99991,
                                                                   dtype=dtype) for i in range(p["uniform_seeds"])],
                                             dtype=torch.float64)}
            uni[(du, n)] = cached(run, f"uniform_d{du}_n{n}", compute, log)["logc"].numpy()
    uni_rows = []
    for k, du in enumerate(p["uniform_dims"]):
        ns = [n for n in sorted(p["uniform_ns"]) if n >= p["uniform_fit_min"]]
        e = ts.uniform_key_exponent(du)
        per = [uni[(du, n)] + e * math.log(n) for n in ns]  # log β*_n
        slope, half = _slope_fit(np.log(ns), per, p["bootstrap"], p["seed"] + 100 + k)
        claims.append(claim(f"exponent of beta*_n, uniform keys on {sphere_name(du)}", slope, half,
                            p["uniform_seeds"], reference=e, holds=bool(abs(slope - e) <= half), fit_ns=ns))
        for n in sorted(p["uniform_ns"]):
            v = uni[(du, n)]
            uni_rows.append({"d": du, "n": n, "log_c_star": float(v.mean()),
                             "stderr": float(v.std(ddof=1) / math.sqrt(v.size))})
    metrics["uniform"] = uni_rows
    metrics["settings"] = {"model": "one softmax head A = V = I, scores β_n⟨y_i, y_j⟩, β_n = γ log n; ATT(y_q) = "
                                    "Σ_j p_j y_j without the residual α x_q",
                           "gamma_c": "1/(1 − ρ)"}
    metrics["claims"] = claims
    summ = [f"{c['name']}: {c['value']:.5g} ± {c['error']:.2g} (reference {c['reference']})" for c in claims
            if c["value"] is not None and c["error"] is not None]
    metrics["summary"] = summ
    if p["figures"]:
        _figures(p, cross, layer, uni, metrics, run)
    return metrics


def _figures(p, cross, layer, uni, metrics, run):
    n_max = max(p["crossing_ns"])
    rhos = p["rhos"]
    fig, axs = subplots(1, 2, (11, 4.0), squeeze=False)
    ax = axs[0, 0]
    rho0 = rhos[0]
    for d in sorted(p["crossing_dims"]):
        ns = sorted(p["crossing_ns"])
        m = [cross[(rho0, d, n)].mean() for n in ns]
        e = [2 * cross[(rho0, d, n)].std(ddof=1) / math.sqrt(p["crossing_seeds"]) for n in ns]
        line = ax.errorbar(ns, m, yerr=e, fmt="o", capsize=2, label=f"d = {d}")
        nn = np.geomspace(min(ns), max(ns), 60)
        ax.plot(nn, [ts.annealed_critical_gamma(rho0, int(k), d) * (1 - rho0) for k in nn], "-",
                color=line[0].get_color(), lw=0.8)
    ax.axhline(1.0, color="0.4", ls=":", label=r"$\gamma_c(1-\rho) = 1$")
    ax.set_xscale("log")
    panel(ax, "context length $n$", r"$\gamma^*(1-\rho)$ (self weight $= 1/2$)",
          rf"crossing, $\rho$ = {rho0:g} (lines: annealed)", legend={"fontsize": 7})
    ax = axs[0, 1]
    L = math.log(n_max)
    for rho in rhos:
        ds = sorted(p["crossing_dims"])
        x = [L / (d - 1) for d in ds]
        m = [cross[(rho, d, n_max)].mean() / (1 - rho) for d in ds]
        e = [2 * cross[(rho, d, n_max)].std(ddof=1) / math.sqrt(p["crossing_seeds"]) / (1 - rho) for d in ds]
        line = ax.errorbar(x, m, yerr=e, fmt="o", capsize=2, label=rf"$\rho$ = {rho:g}")
        ax.axhline(1 / (1 - rho), color=line[0].get_color(), ls=":", lw=0.8)
    ax.set_xscale("log")
    panel(ax, r"$\log n / (d - 1)$", r"$\gamma^*$", rf"$n$ = {n_max}: $\gamma^* \to 1/(1-\rho)$ (dotted) as "
          r"$d \to \infty$", legend={"fontsize": 7})
    save_captioned(run, fig, "crossing", "Left: the γ at which a token's self weight is 1/2, times 1 − ρ, against n for "
                   f"almost-simplex tokens in R^d ({p['crossing_seeds']} seeds, bars: 2 standard errors; lines: the "
                   "annealed prediction). For log n comparable to d the transition moves up and widens; it sharpens at "
                   "γ_c = 1/(1 − ρ) as d grows. Right: γ* at the largest n against log n/(d − 1), with 1/(1 − ρ) dotted.",
                   metrics, tidy=True)

    rho, d = p["layer_rho"], p["layer_dim"]
    g = np.array(p["layer_gammas"])
    fig, axs = subplots(1, 4, (18, 4.0), squeeze=False)
    labels = {"self_weight": "self weight $p_q$", "dist_mean": r"$|\mathrm{ATT}(y_q) - \bar y|$",
              "dist_identity": r"$|\mathrm{ATT}(y_q) - y_q|$", "jacobian": r"$|J u|$ (RMS over $u \perp y_q$)"}
    for j, (key, lab) in enumerate(labels.items()):
        ax = axs[0, j]
        for n in sorted(p["layer_ns"]):
            v = layer[n][key].numpy()
            ax.errorbar(g, v.mean(0), yerr=2 * v.std(0, ddof=1) / math.sqrt(v.shape[0]), fmt="o-", ms=3, capsize=2,
                        label=f"n = {n}")
        if key == "self_weight":
            nl = max(p["layer_ns"])
            gg = np.linspace(g.min(), g.max(), 100)
            ax.plot(gg, ts.annealed_self_weight(gg * ts.critical_gamma(rho), rho, nl, d), "k--", lw=0.8,
                    label=f"annealed, n = {nl}")
            ax.plot(gg, [ts.simplex_self_weight(float(x) * ts.critical_gamma(rho), rho, nl) for x in gg], "k:",
                    lw=0.8, label=f"simplex, n = {nl}")
        ax.axvline(1.0, color="0.6", ls=":")
        panel(ax, r"$\gamma / \gamma_c$", lab, None, legend={"fontsize": 6} if j == 0 else None)
    save_captioned(run, fig, "one_layer", f"One softmax layer (A = V = I, β = γ log n) on almost-simplex tokens in "
                   f"R^{d} with ρ = {rho:g} (γ_c = {ts.critical_gamma(rho):g}), as n grows: the self weight, the output's "
                   "distance to the mean and to the token, and the Jacobian norm along tangent directions "
                   f"({p['layer_seeds']} seeds, bars: 2 standard errors).", metrics, tidy=True)

    fig, axs = subplots(1, 2, (11, 4.0), squeeze=False)
    ax = axs[0, 0]
    for du in p["uniform_dims"]:
        ns = sorted(p["uniform_ns"])
        e = ts.uniform_key_exponent(du)
        m = [uni[(du, n)].mean() + e * math.log(n) for n in ns]
        s = [2 * uni[(du, n)].std(ddof=1) / math.sqrt(p["uniform_seeds"]) for n in ns]
        line = ax.errorbar(ns, m, yerr=s, fmt="o", capsize=2, label=f"{sphere_name(du)}")
        ax.plot(ns, [m[-1] + e * (math.log(n) - math.log(ns[-1])) for n in ns], ":", color=line[0].get_color(),
                label=f"slope 2/(d−1) = {e:g}")
    ax.set_xscale("log")
    log_ticks(ax, sorted(p["uniform_ns"]))
    panel(ax, "number of keys $n$", r"$\log \beta^*_n$", "uniform keys: nearest-key weight = 1/2",
          legend={"fontsize": 7})
    ax = axs[0, 1]
    for du in p["uniform_dims"]:
        ns = sorted(p["uniform_ns"])
        ax.errorbar(ns, [uni[(du, n)].mean() for n in ns],
                    yerr=[2 * uni[(du, n)].std(ddof=1) / math.sqrt(p["uniform_seeds"]) for n in ns], fmt="o-",
                    capsize=2, label=sphere_name(du))
    ax.set_xscale("log")
    log_ticks(ax, sorted(p["uniform_ns"]))
    panel(ax, "number of keys $n$", r"$\log c^* = \log(\beta^*_n / n^{2/(d-1)})$", "flat: the scale is $n^{2/(d-1)}$",
          legend={"fontsize": 7})
    save_captioned(run, fig, "uniform_keys", "A fixed query and n i.i.d. uniform keys on S^{d−1}: the inverse "
                   "temperature β*_n at which the nearest key gets half of the attention "
                   f"({p['uniform_seeds']} seeds, bars: 2 standard errors), against n^{{2/(d−1)}}.", metrics, tidy=True)
