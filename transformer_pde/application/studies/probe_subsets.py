"""The order-free ladder of the pretrained-network probe (kind ``pretrained_probe``, ``subsets = true``;
docs/pretrained.md).

Every subset S of the four ingredients of :data:`transformer_pde.analysis.pretrained_subsets.INGREDIENTS`
(feed-forward, LayerNorm, attention biases, discrete time) is removed together from the network
(:func:`transformer_pde.analysis.pretrained_subsets.subset_rollout`, rolled out from the real embeddings),
and per sentence and hidden-state index the probe measures W₂ to the real tokens, the mean angle to them,
and the clustering statistics of the map's own tokens (:func:`subset_statistics`).  :func:`shapley_summary`
turns these 16 values per sentence into each ingredient's Shapley value (its share of the change from the
network to the mean-field flow, averaged over the 4! orders of removal), per layer and metric, with a
percentile bootstrap over sentences for the values and for the shares of the gap.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from . import panel, save_captioned, subplots
from .probe import cloud_statistics, sentence_w2
from ...analysis.pretrained_subsets import INGREDIENTS, SUBSETS, shapley_values, subset_name, subset_rollout

__all__ = ["SUBSET_METRICS", "LADDER_SUBSETS", "subset_statistics", "shapley_summary", "shapley_figure"]

#: the per-sentence statistics of every subset
SUBSET_METRICS = ("w2", "mean_angle", "mean_cosine", "pair_fraction", "clusters")

#: the ladder's rungs that are subsets (their statistics are reused, not recomputed)
LADDER_SUBSETS = {frozenset(): "network", frozenset({"feedforward"}): "no_feedforward",
                  frozenset({"feedforward", "layernorm"}): "sphere",
                  frozenset({"feedforward", "layernorm", "bias"}): "no_bias",
                  frozenset(INGREDIENTS): "continuous"}

_CHUNK_TOKENS = 2048


def _statistics(pred, states, mask, radius):
    step = max(1, _CHUNK_TOKENS // states.shape[-2])
    parts = []
    for s in range(0, states.shape[1], step):
        c = slice(s, s + step)
        st = cloud_statistics(pred[:, c], mask[c], radius)
        a = pred[:, c] / pred[:, c].norm(dim=-1, keepdim=True)
        b = states[:, c] / states[:, c].norm(dim=-1, keepdim=True)
        angle = torch.acos((a * b).sum(-1).clamp(-1.0, 1.0))
        st["w2"] = sentence_w2(pred[:, c], states[:, c], mask[c])
        st["mean_angle"] = (angle * mask[c]).sum(-1) / mask[c].sum(-1)
        parts.append(st)
    return {k: torch.cat([part[k] for part in parts], -1) for k in SUBSET_METRICS}


def subset_statistics(net, states: torch.Tensor, mask: torch.Tensor, *, dt: float, radius: float,
                      reuse: Optional[Dict[str, dict]] = None) -> Dict[str, dict]:
    """The statistics of :data:`SUBSET_METRICS` of every subset's rollout, per hidden-state index and sentence.

    Parameters
    ----------
    net
        a post-LN :class:`~transformer_pde.pretrained.PretrainedNetwork`.
    states : torch.Tensor
        the real hidden states (L+1, B, n, d).
    mask : torch.Tensor
        (B, n) bool.
    dt : float
        the continuous sublayers' step.
    radius : float
        the chordal radius of the clustering statistics.
    reuse : dict, optional
        ladder rung name → its statistics (the same keys), taken for the subsets that are rungs
        (:data:`LADDER_SUBSETS`) instead of recomputing them.

    Returns
    -------
    dict
        subset name (:func:`~transformer_pde.analysis.pretrained_subsets.subset_name`) → metric → (L+1, B).
    """
    out = {}
    for S in SUBSETS:
        rung = LADDER_SUBSETS.get(S)
        if reuse is not None and rung in reuse:
            out[subset_name(S)] = {k: reuse[rung][k] for k in SUBSET_METRICS}
            continue
        pred = subset_rollout(net, states[0], mask, S, dt=dt)
        if not bool(torch.isfinite(pred[:, mask]).all()):
            raise FloatingPointError(f"the subset {subset_name(S)!r} produced NaN/inf; lower dt or use float64")
        out[subset_name(S)] = {k: v.double() for k, v in _statistics(pred, states, mask, radius).items()}
    return out


def _bootstrap(values: np.ndarray, resamples: int, rng, ratio_to: Optional[np.ndarray] = None):
    """Means over the last axis (sentences) and the half-width of the 95 % percentile bootstrap interval; with
    ``ratio_to`` the ratio of means mean(values)/mean(ratio_to)."""
    S = values.shape[-1]
    counts = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64) / S  # (R, S)
    boot = values @ counts.T  # (..., R)
    mean = values.mean(-1)
    if ratio_to is not None:  # a zero total (the embeddings) gives NaN here, reported as undefined by the caller
        with np.errstate(divide="ignore", invalid="ignore"):
            boot = boot / (ratio_to @ counts.T)
            mean = mean / ratio_to.mean(-1)
    finite = np.isfinite(boot).all(-1)
    lo, hi = np.full(boot.shape[:-1], np.nan), np.full(boot.shape[:-1], np.nan)
    if finite.any():
        lo[finite], hi[finite] = np.quantile(boot[finite], [0.025, 0.975], axis=-1)
    return mean, (hi - lo) / 2


def shapley_summary(stats: Dict[str, dict], *, seed: int = 0, resamples: int = 1000) -> dict:
    """Per metric and hidden-state index: every subset's mean (± s.e. over sentences), each ingredient's Shapley
    value (± bootstrap half-width) and its share of the total change v(all) − v(∅) (ratio of means, ±
    bootstrap half-width).

    Parameters
    ----------
    stats : dict
        subset name → metric → (L+1, S) per-sentence values (all sentences of the run).
    seed : int
        the bootstrap's seed.
    resamples : int
        bootstrap resamples (sentences drawn with replacement).

    Returns
    -------
    dict
        {"ingredients", "subsets": name → metric → {"mean", "se"}, "shapley": metric → ingredient →
        {"value", "value_error", "share", "share_error"} (lists over the index), "total": metric →
        {"value", "error"}, "resamples", "sentences"}.
    """
    rng = np.random.default_rng(seed)
    names = {S: subset_name(S) for S in SUBSETS}
    S_count = next(iter(stats.values()))["w2"].shape[-1]
    out = {"ingredients": list(INGREDIENTS), "subsets": {}, "shapley": {}, "total": {}, "resamples": resamples,
           "sentences": int(S_count), "error_bars": "subset means: ± s.e. over sentences; Shapley values and shares: "
           "half-width of the 95 % percentile bootstrap interval over sentences"}
    for name, st in stats.items():
        out["subsets"][name] = {k: {"mean": v.mean(-1).tolist(),
                                    "se": (v.std(-1, unbiased=True) / v.shape[-1] ** 0.5).tolist()}
                                for k, v in st.items()}
    for metric in SUBSET_METRICS:
        values = {S: stats[names[S]][metric] for S in SUBSETS}
        phi = shapley_values(values)
        total = (values[frozenset(INGREDIENTS)] - values[frozenset()]).numpy()
        t_mean, t_err = _bootstrap(total, resamples, rng)
        out["total"][metric] = {"value": t_mean.tolist(), "error": t_err.tolist()}
        out["shapley"][metric] = {}
        # a share of a total that is zero to rounding (the embeddings, ℓ = 0), or not resolved from zero by the
        # bootstrap (its interval holds 0), is undefined: None
        defined = (np.abs(t_mean) > 1e-4 * max(float(np.abs(t_mean).max()), 1e-300)) & (np.abs(t_mean) > t_err)
        for i in INGREDIENTS:
            v = phi[i].numpy()
            m, e = _bootstrap(v, resamples, rng)
            share, share_e = _bootstrap(v, resamples, rng, ratio_to=total)
            out["shapley"][metric][i] = {"value": m.tolist(), "value_error": e.tolist(),
                                         "share": [float(a) if ok and np.isfinite(a) else None
                                                   for a, ok in zip(share, defined)],
                                         "share_error": [float(a) if ok and np.isfinite(a) else None
                                                         for a, ok in zip(share_e, defined)]}
    return out


_LABELS = {"feedforward": "feed-forward", "layernorm": "LayerNorm (vs sphere)", "bias": "attention biases",
           "discrete": "discrete time"}


def shapley_figure(run, p, metrics: dict) -> None:
    """``subset_shapley``: per hidden-state index, each ingredient's Shapley value of W₂ to the real tokens and
    of the cluster count, with its bootstrap interval (``metrics["subsets"]`` from :func:`shapley_summary`)."""
    summary = metrics["subsets"]
    fig, axes = subplots(1, 2, (11.5, 4.0), squeeze=False)
    for ax, metric, ylab in zip(axes[0], ("w2", "clusters"),
                                (r"Shapley value of $W_2$ to the real tokens", "Shapley value of the cluster count")):
        sh = summary["shapley"][metric]
        L1 = len(sh[INGREDIENTS[0]]["value"])
        idx = np.arange(L1)
        for k, i in enumerate(INGREDIENTS):
            v, e = np.asarray(sh[i]["value"]), np.asarray(sh[i]["value_error"])
            ax.errorbar(idx + 0.08 * (k - 1.5), v, yerr=e, marker="osd^"[k], ms=4, lw=1.4, capsize=2, color=f"C{k}",
                        label=_LABELS[i])
        tot = summary["total"][metric]
        ax.plot(idx, tot["value"], color="k", lw=1.0, ls=":", label="total (mean-field flow − network)")
        ax.axhline(0.0, color="0.6", lw=0.6)
        ax.set_xticks(idx)
        panel(ax, r"hidden-state index $\ell$ (depth)", ylab, None)
    axes[0, 0].legend(fontsize=8, loc="best")
    mo = metrics["model"]
    cap = (f"{metrics['text']['sentences']} sentences of pydoc_data.topics through {p['model']} ({mo['family']}, "
           f"{mo['norm']}-LN, L = {mo['layers']}, d = {mo['dim']}). Each ingredient's Shapley value over the 16 subsets of (feed-forward, LayerNorm → "
           f"sphere, attention biases, discrete → continuous time, dt = {p['dt']:g}) removed together, rolled out "
           f"from the real embeddings: its contribution to the change from the network to the mean-field flow, "
           f"averaged over the 24 orders of removal; the four add up to the total (dotted). Bars: 95 % bootstrap "
           f"intervals over {summary['sentences']} sentences.")
    fig.suptitle("which ingredient opens the gap, order-free", fontsize=11)
    save_captioned(run, fig, "subset_shapley", cap, metrics, tidy=True)
