"""Causal-attention clustering study: how the decoder mask (token i sees tokens j ≤ i) changes
clustering under OU and oscillating heads, against the same heads without the mask.

For every regime (OU heads, oscillating heads) the unmasked and the causal flow start from the
same tokens and are driven by the SAME weight path (same seed: a paired comparison).  Over time
it records, per path, the cluster statistics of :mod:`transformer_pde.analysis.clustering` at a chordal
radius r (single-linkage cluster count, fraction of ε-close token pairs with ε = r²/2,
largest-cluster mass, mean overlap Σ_{i≠j} w_i w_j ⟨x_i, x_j⟩ / Σ_{i≠j} w_i w_j) and, per token, its
merge time τ_i: the first recorded time at which token i is linked (⟨x_i, x_j⟩ > 1 − ε) to another
token.  "Which tokens cluster first" is the Spearman correlation ρ(i, τ_i) between the token's
position i in the stored order and τ_i (ρ > 0: early tokens merge first), and the mean τ over the
first and the last quarter of tokens.
Tokens that never merge get τ = t1 (right-censored) in ρ and the quarter means.

Expected picture (Karagodin, Polyanskiy, Rigollet 2024, "Clustering in causal attention
masking"): under the mask, token 0 sees only itself and later tokens are pulled towards the
earlier ones, so the flow collapses to one cluster where the unmasked flow can stay multi-
cluster.  The ledger of the causal runs is not a gradient-flow balance (not checked here).
"""

from __future__ import annotations

import logging
import math

import torch

import transformer_pde as tp

from . import (
    Option, at_least, cached, check_record_every, nonnegative, panel, positive, step_callback, study, subplots,
    weight_process, dtype_of)

log = logging.getLogger(__name__)

REGIMES = ("ou", "oscillating")
_STATS = ("pair_fraction", "clusters", "largest_mass", "mean_overlap")  # recorded per (time, path)

OPTIONS = {
    "n": Option(32, (int,), "number of tokens (>= 2: one token has no pairs, clusters or merge times)",
                check=at_least(2)),
    "d": Option(3, (int,), "dimension (tokens on S^{d-1})", check=at_least(2)),
    "heads": Option(4, (int,), "number of heads H (symmetric D_h(0) = Z + Zᵀ, ω = 1/H, as the paper)",
                    check=positive),
    "beta": Option(1.0, (float,), "inverse temperature β", check=positive),
    "t1": Option(20.0, (float,), "final time", check=positive),
    "dt": Option(0.05, (float,), "time step (Euler)", check=positive),
    "paths": Option(4, (int,), "Monte-Carlo paths of the head weights (and of nothing else)", check=positive),
    "seed": Option(0, (int,), "seed of the heads and weight paths (tokens use seed + 1)"),
    "regimes": Option(["ou", "oscillating"], (list,), "head processes to compare", choices=REGIMES),
    "ou_rate": Option(1.0, (float,), "OU mean-reversion rate κ", check=positive),
    "ou_sigma2": Option(2.0, (float,), "OU noise variance σ²", check=nonnegative),
    "phase": Option("shared", (str,), "oscillating phase", choices=("shared", "per_head")),
    "direction": Option("ascent", (str,), "token flow direction (ascent: x + attention(x), the clustering regime)",
                        choices=("ascent", "descent")),
    "radius": Option(0.1, (float,), "chordal linking radius r of the cluster statistics (ε = r²/2)",
                     check=positive),
    "record_every": Option(5, (int,), "record every k-th step", check=positive),
    "figures": Option(True, (bool,), "write the figures (off for large sweeps)"),
}


def _validate(p):
    k = p["t1"] / p["dt"]
    if abs(k - round(k)) > 1e-9 * max(1.0, k):
        raise ValueError(f"config key 't1' = {p['t1']} must be a whole number of steps dt = {p['dt']}")
    if not p["regimes"]:
        raise ValueError("config key 'regimes' must list at least one of 'ou', 'oscillating'")
    check_record_every(p, what="the time average of the pair fraction")


def _tag(regime: str, causal: bool) -> str:
    return f"{regime}_{'causal' if causal else 'full'}"


def _merge_times(times: torch.Tensor, x: torch.Tensor, radius: float) -> torch.Tensor:
    """τ_i: first recorded time token i is linked to another token, (paths, n); t_end when never."""
    adj = tp.clustering.linked(x, radius=radius)  # (T, paths, n, n) bool
    n = x.shape[-2]
    adj = adj & ~torch.eye(n, dtype=torch.bool, device=x.device)
    merged = adj.any(-1)  # (T, paths, n)
    first = merged.to(torch.int8).argmax(0)  # (paths, n)
    ever = merged.any(0)
    t = times.to(x.dtype)
    return torch.where(ever, t[first], torch.full_like(t[first], float(t[-1])))


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D float tensors (average ranks for ties)."""
    def ranks(v):
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=v.dtype)
        # average ranks over ties
        uniq, inv = torch.unique(v, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=v.dtype).index_add_(0, inv, r)
        cnt = torch.zeros(len(uniq), dtype=v.dtype).index_add_(0, inv, torch.ones_like(r))
        return (sums / cnt)[inv]

    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def _piece(p, regime, causal, x0, heads0, run):
    """Simulate one (regime, mask) flow and reduce it to the recorded statistics (cached on resume)."""
    tag = _tag(regime, causal)

    def compute():
        proc = weight_process(regime, heads0, rate=p["ou_rate"], sigma=math.sqrt(p["ou_sigma2"]), phase=p["phase"])
        traj = tp.solve(tp.Model(proc, normalization="softmax", direction=p["direction"], causal=causal), x0,
                        tp.Euler(), t1=p["t1"], dt=p["dt"], paths=p["paths"], seed=p["seed"],
                        saveat=tp.SaveAt(record_every=p["record_every"]), ledger=tp.LedgerOptions(diagnostics=False),
                        progress=tp.Progress(show=run.progress, callback=step_callback(run, tag)))
        st = tp.clustering.cluster_statistics(traj.x, radius=p["radius"], gram_rank=False)  # (T, paths) each
        out = {"t": traj.times.to(torch.float64), **{k: st[k].double() for k in _STATS},
               "merge_time": _merge_times(traj.times, traj.x, p["radius"]).double(),  # (paths, n)
               "x_final": traj.x[-1].double()}
        log.info("[%s] final pair fraction %.3f", tag, float(out["pair_fraction"][-1].mean()))
        return out

    return cached(run, tag, compute, log)


def _summaries(res, t1):
    t = res["t"]
    pf_mean = res["pair_fraction"].mean(-1)
    tau = res["merge_time"]  # (paths, n)
    n = tau.shape[-1]
    q = max(1, n // 4)
    idx = torch.arange(n, dtype=torch.float64)
    tau_mean = tau.mean(0)
    return {
        "pair_fraction_final": float(pf_mean[-1]),
        "pair_fraction_time_average": float(torch.trapezoid(pf_mean, t) / (t[-1] - t[0])),
        "clusters_final_median": float(res["clusters"][-1].median()),
        "largest_mass_final": float(res["largest_mass"][-1].mean()),
        "mean_overlap_final": float(res["mean_overlap"][-1].mean()),
        "time_to_half_pairs": float(tp.clustering.crossing_time(t, pf_mean, 0.5)),
        "merge_spearman_index_vs_time": _spearman(idx, tau_mean),
        "merge_time_first_quarter": float(tau[:, :q].mean()),
        "merge_time_last_quarter": float(tau[:, -q:].mean()),
        "never_merged_fraction": float((tau >= t1).double().mean()),
    }


@study("causal_clustering", OPTIONS,
       "causal (decoder-mask) vs full attention: clustering over time under OU and oscillating heads",
       validate=_validate)  # checks across keys, run by config.load_config before anything is written
def run_causal(params, run):
    p = params
    _validate(p)
    dtype = dtype_of(p)
    x0 = tp.sphere.sample_uniform(p["n"], p["d"], generator=torch.Generator().manual_seed(p["seed"] + 1),
                                  dtype=torch.float64).to(dtype)
    D = tp.Heads.random(p["heads"], p["d"], generator=torch.Generator().manual_seed(p["seed"] + p["heads"]),
                        dtype=torch.float64).score_matrix
    heads0 = tp.Heads.symmetric(D.to(dtype), beta=p["beta"])
    results, metrics, summary = {}, {}, []
    for regime in p["regimes"]:
        for causal in (False, True):
            key = _tag(regime, causal)
            res = _piece(p, regime, causal, x0, heads0, run)
            results[key] = res
            metrics[key] = _summaries(res, p["t1"])
            run.save_series(key, {"t": res["t"], "pair_fraction_mean": res["pair_fraction"].mean(-1),
                                  "clusters_median": res["clusters"].median(-1).values,
                                  "largest_mass_mean": res["largest_mass"].mean(-1)})
            run.save_series(f"{key}_merge_times", {"token": torch.arange(p["n"]),
                                                   "merge_time_mean": res["merge_time"].mean(0)})
        f, c = metrics[f"{regime}_full"], metrics[f"{regime}_causal"]
        summary.append(
            f"{regime}: final pair fraction full {f['pair_fraction_final']:.3f} vs causal "
            f"{c['pair_fraction_final']:.3f}; time to half the pairs {f['time_to_half_pairs']:.3g} vs "
            f"{c['time_to_half_pairs']:.3g}; median clusters {f['clusters_final_median']:.0f} vs "
            f"{c['clusters_final_median']:.0f}; ρ(index, merge time) {f['merge_spearman_index_vs_time']:+.2f} vs "
            f"{c['merge_spearman_index_vs_time']:+.2f}")
    metrics["summary"] = summary
    if p["figures"]:
        _figures(p, results, run)
    return metrics


def _figures(p, results, run):
    regimes = p["regimes"]
    caption = (f"n = {p['n']} tokens on S^{p['d'] - 1}, H = {p['heads']}, β = {p['beta']}, {p['direction']}, "
               f"{p['paths']} paths (same weight paths with and without the mask); r = {p['radius']}. "
               f"Full attention vs causal (token i sees j ≤ i).")
    fig, axs = subplots(2, len(regimes), (5 * len(regimes), 6.4), squeeze=False, sharex=True)
    for col, regime in enumerate(regimes):
        for causal, ls in ((False, "-"), (True, "--")):
            res = results[_tag(regime, causal)]
            t = res["t"].numpy()
            lab = "causal" if causal else "full"
            pf = res["pair_fraction"]
            axs[0, col].plot(t, pf.mean(-1).numpy(), ls, color="C0", label=f"{lab}: mean")
            axs[0, col].fill_between(t, pf.min(-1).values.numpy(), pf.max(-1).values.numpy(), color="C0",
                                     alpha=0.12 if causal else 0.2)
            axs[1, col].plot(t, res["clusters"].median(-1).values.numpy(), ls, color="C3", label=f"{lab}: median")
        axs[1, col].set_yscale("log")
        panel(axs[0, col], None, f"pair fraction P_ε (ε = {p['radius'] ** 2 / 2:.3g})", f"{regime} heads",
              legend={"fontsize": 8})
        panel(axs[1, col], "time t", f"clusters (single linkage, r = {p['radius']})", legend={"fontsize": 8})
    fig.suptitle("causal vs full attention: clustering over time", fontsize=11)
    fig.text(0.5, -0.02, caption + " Solid: full, dashed: causal; band: min–max over paths.", ha="center",
             va="top", fontsize=8, wrap=True)
    run.save_figure(fig, "causal_clustering")

    fig, axs = subplots(1, len(regimes), (5 * len(regimes), 3.6), squeeze=False)
    for col, regime in enumerate(regimes):
        for causal, mk in ((False, "o"), (True, "s")):
            tau = results[_tag(regime, causal)]["merge_time"]
            axs[0, col].plot(range(p["n"]), tau.mean(0).numpy(), mk, ms=3.5, label="causal" if causal else "full")
        panel(axs[0, col], "token index i (stored order)", "merge time τ_i (mean over paths)",
              f"{regime} heads: which tokens cluster first", legend={"fontsize": 8})
    fig.text(0.5, -0.04, caption + f" τ_i = first time token i is within r of another token (t1 = {p['t1']} "
             f"if never).", ha="center", va="top", fontsize=8, wrap=True)
    run.save_figure(fig, "merge_times")
