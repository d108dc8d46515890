"""Figures of the pretrained-network probe (kind ``pretrained_probe``; docs/pretrained.md).

* ``depth_curves`` — the clustering statistics across depth, the real network and every rung side by side;
* ``ladder_distances`` — W2 and mean angle between each rung's tokens and the real ones, per layer;
* ``layer_probes`` — β_eff, the change of the layer's own log E_β, and the local Lipschitz constant per layer;
* ``token_clouds`` — one sentence's normalised tokens per layer, projected on the top two principal
  directions of the real tokens of that layer (the same axes for the real network and the rungs).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

from . import panel, save_captioned, subplots

__all__ = ["figures", "RUNG_LABELS"]

#: legend names of the rungs
RUNG_LABELS = {"network": "exact network map", "no_feedforward": "− feed-forward", "sphere": "− LayerNorm → sphere",
               "no_bias": "− biases", "continuous": "continuous time"}
_STAT_LABELS = {"mean_cosine": r"mean cosine $\rho_\ell$", "pair_fraction": r"pair fraction $P_\varepsilon$",
                "clusters": "clusters (single linkage)"}


def _rung_style(k: int, rung: str):
    return {"color": f"C{k + 1}", "ls": ("-", "--", "-.", ":", (0, (5, 1)))[k % 5],
            "marker": "osd^v"[k % 5], "ms": 3.5, "lw": 1.4, "label": RUNG_LABELS.get(rung, rung)}


def _error_line(ax, x, mean, se, **style):
    mean, se = np.asarray(mean, float), np.asarray(se, float)
    ax.fill_between(x, mean - se, mean + se, color=style.get("color"), alpha=0.2, lw=0)
    ax.plot(x, mean, **style)


def _depth_curves(run, p, m):
    L = m["model"]["layers"]
    idx = np.arange(L + 1)
    fig, axes = subplots(1, 3, (13.5, 4.0), squeeze=False)
    for ax, stat in zip(axes[0], ("mean_cosine", "pair_fraction", "clusters")):
        _error_line(ax, idx, m["real"][stat], m["real"][f"{stat}_se"], color="k", lw=2.4, label="real hidden states")
        for k, rung in enumerate(m["ladder_rungs"]):
            e = m["ladder"][rung]
            _error_line(ax, idx, e[stat], e[f"{stat}_se"], **_rung_style(k, rung))
        ax.set_xticks(idx)
        panel(ax, r"hidden-state index $\ell$ (depth)", _STAT_LABELS[stat], None)
    axes[0, 2].legend(fontsize=8, loc="best")
    cap = (f"{m['text']['sentences']} sentences of pydoc_data.topics through {_net(m)}; rungs "
           f"{'rolled out from the real embeddings' if m['ladder_mode'] == 'rollout' else 'one layer from the real tokens'}"
           f" (continuous rung dt = {p['dt']:g}). Pair fraction and clusters of the normalised tokens at chordal "
           f"radius r = {p['radius']:g}. Bands: ± one standard error over sentences.")
    fig.suptitle("clustering across depth: the real network and the ladder of approximations", fontsize=11)
    save_captioned(run, fig, "depth_curves", cap, m, tidy=True)


def _net(m):
    mo = m["model"]
    return (f"{mo['source']} ({mo['family']}, {mo['norm']}-LN, L = {mo['layers']}, d = {mo['dim']}, "
            f"H = {mo['heads']})")


def _ladder_distances(run, p, m):
    L = m["model"]["layers"]
    idx = np.arange(L + 1)
    fig, axes = subplots(1, 2, (10.5, 4.0), squeeze=False)
    for k, rung in enumerate(m["ladder_rungs"]):
        e = m["ladder"][rung]
        st = _rung_style(k, rung)
        _error_line(axes[0, 0], idx, e["w2"], e["w2_se"], **st)
        _error_line(axes[0, 1], idx, e["mean_angle"], e["mean_angle_se"], **st)
    for ax, level in zip(axes[0], (np.sqrt(2.0), np.pi / 2)):
        ax.set_xticks(idx)
        ax.axhline(level, color="0.6", lw=0.9, ls=":", label="orthogonal clouds")
    panel(axes[0, 0], r"hidden-state index $\ell$", r"$W_2(\hat\mu^{\mathrm{rung}}_\ell, \hat\mu_\ell)$", None)
    panel(axes[0, 1], r"hidden-state index $\ell$", "mean angle to the real token (rad)", None,
          legend={"fontsize": 8})
    cap = (f"Distance of each rung's tokens to the real hidden states of {_net(m)}, mean over "
           f"{m['text']['sentences']} sentences; W2 between the normalised token clouds of a sentence, mean angle "
           f"between a token and its real counterpart (bands: ± one standard error); dotted: the values of two clouds of "
           f"mutually orthogonal vectors (W2 = √2, angle π/2). "
           + (f"The exact map's W2 stays below {max(m['ladder']['network']['w2']):.1e} (rounding)."
              if "network" in m["ladder"] else ""))
    fig.suptitle("how far each rung of the ladder is from the real network", fontsize=11)
    save_captioned(run, fig, "ladder_distances", cap, m, tidy=True)


def _layer_probes(run, p, m):
    lay = m["layers"]
    L = m["model"]["layers"]
    idx = np.arange(L)
    fig, axes = subplots(1, 3, (13.5, 3.8), squeeze=False)
    ax = axes[0, 0]
    ax.errorbar(idx, lay["beta_eff"], yerr=lay["beta_eff_se"], fmt="o-", color="C0", capsize=3, label="mean ± s.e.")
    ax.plot(idx, lay["beta_eff_median"], "s--", color="C0", alpha=0.6, ms=3.5, label="median")
    panel(ax, r"layer $\ell$", r"$\beta_{\mathrm{eff}}$", None, legend={"fontsize": 8})
    ax = axes[0, 1]
    ax.errorbar(idx, lay["log_energy_change"], yerr=lay["log_energy_change_se"], fmt="o-", color="C2", capsize=3)
    ax.axhline(0.0, color="0.5", lw=0.8)
    panel(ax, r"layer $\ell$", r"$\log E_\ell(\hat x_{\ell+1}) - \log E_\ell(\hat x_\ell)$", None)
    ax = axes[0, 2]
    ax.errorbar(idx, lay["lipschitz"], yerr=lay["lipschitz_se"], fmt="o-", color="C3", capsize=3,
                label="mean ± s.e.")
    ax.plot(idx, lay["lipschitz_max"], "v:", color="C3", ms=4, label="max")
    panel(ax, r"layer $\ell$", r"$\|\partial x_{\ell+1}/\partial x_\ell\|_2$", None, legend={"fontsize": 8})
    for a in axes[0]:
        a.set_xticks(idx)
    cap = (f"Per layer of {_net(m)}: left, the inverse temperature of the kernel softmax(β⟨x̂_i, x̂_j⟩) closest "
           f"in mean KL to the head-averaged attention, fitted per sentence; middle, the change of the layer's own "
           f"log-energy log E_β (its heads, biases dropped) across the layer; right, the spectral norm of the "
           f"layer map's Jacobian at the real tokens ({lay['lipschitz_sentences']} sentences, "
           f"{p['lipschitz_iterations']} power steps). Error bars: ± one standard error over sentences.")
    fig.suptitle("per-layer probes: effective temperature, own energy, local Lipschitz constant", fontsize=11)
    save_captioned(run, fig, "layer_probes", cap, m, tidy=True)


def _token_clouds(run, p, m, clouds: Dict[str, torch.Tensor], tokens: Sequence[str], sentence: str):
    rows = ["real"] + [r for r in m["ladder_rungs"] if r != "network"][-1:]
    real = clouds["real"].double()
    L1 = real.shape[0]
    fig, axes = subplots(len(rows), L1, (2.3 * L1, 2.4 * len(rows) + 0.4), squeeze=False)
    for l in range(L1):
        xr = real[l] / real[l].norm(dim=-1, keepdim=True)
        centre = xr.mean(0)
        basis = torch.linalg.svd(xr - centre, full_matrices=False)[2][:2].T
        zs = [((clouds[name][l].double() / clouds[name][l].double().norm(dim=-1, keepdim=True) - centre) @ basis).numpy()
              for name in rows]
        allz = np.concatenate(zs)
        pad = 0.08 * (allz.max(0) - allz.min(0)) + 1e-9
        lo, hi = allz.min(0) - pad, allz.max(0) + pad
        for r, (name, z) in enumerate(zip(rows, zs)):
            ax = axes[r, l]
            ax.scatter(z[:, 0], z[:, 1], s=14, c=np.arange(len(z)), cmap="viridis")
            for i in (0, len(z) - 1):
                ax.annotate(tokens[i] if i < len(tokens) else str(i), z[i], fontsize=6)
            ax.set_xlim(lo[0], hi[0])
            ax.set_ylim(lo[1], hi[1])
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(rf"$\ell = {l}$", fontsize=9)
            if l == 0:
                ax.set_ylabel("real" if name == "real" else RUNG_LABELS.get(name, name), fontsize=8)
    text = sentence if len(sentence) <= 100 else sentence[:97] + "..."
    cap = (f"One sentence, {len(tokens)} tokens with [CLS] and [SEP]: \"{text}\". Normalised tokens x̂ projected per "
           f"column on the top two principal directions of the real tokens of that layer (same axes and limits in a "
           f"column); colour = position, first and last token labelled. Top: the real network; bottom: the last "
           f"rung ({m['ladder_mode']}).")
    fig.suptitle("token cloud of one sentence across depth", fontsize=11)
    save_captioned(run, fig, "token_clouds", cap, m, tidy=True)


def figures(run, p: Dict, metrics: Dict, clouds: Dict[str, torch.Tensor], tokens: List[str], sentence: str) -> None:
    """Write the four figures of the probe into the run's figures/ and their captions into ``metrics``."""
    _depth_curves(run, p, metrics)
    _ladder_distances(run, p, metrics)
    _layer_probes(run, p, metrics)
    _token_clouds(run, p, metrics, clouds, tokens, sentence)
