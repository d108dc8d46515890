"""The trained network against its architecture re-initialised (kind ``pretrained_probe``, ``reinit_seeds``;
docs/pretrained.md).

For each seed the network's configuration is instantiated afresh by transformers (``AutoModel.from_config``
under ``torch.manual_seed(seed)``: the architecture's own initialiser ``_init_weights``, embeddings included;
the trained network's tokenizer), and the same sentences go through it.  Per hidden-state index: the mean
cosine and the single-linkage cluster count of the normalised tokens (means over sentences); per layer: β_eff
of the head-averaged attention (:func:`~transformer_pde.application.studies.probe.fit_effective_beta`) and
the local Lipschitz constant of the block at the real tokens of the same seeded subset of sentences as the
trained network's (:func:`~transformer_pde.application.studies.probe.top_singular_value`).  The per-seed
means are then summarised over seeds (mean ± standard error over seeds): what the trained network shows
beyond that spread belongs to training, what the re-initialised networks show as well belongs to the
architecture.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

import transformer_pde as tp

from . import panel, save_captioned, subplots
from .probe import cloud_statistics, fit_effective_beta, top_singular_value

__all__ = ["reinitialised", "reinit_statistics", "summarise_seeds", "reinit_figure"]

_CHUNK = 64  # sentences per forward pass


def reinitialised(net, seed: int):
    """The network's architecture with fresh weights from its configuration's initialiser (seeded), as a
    :class:`~transformer_pde.pretrained.PretrainedNetwork` carrying the trained network's tokenizer.

    Parameters
    ----------
    net
        a PretrainedNetwork (its ``model.config`` is reused).
    seed : int
        the seed of torch's generator during the initialisation (the global generator is restored after).

    Returns
    -------
    PretrainedNetwork
        in the trained network's dtype.
    """
    import transformers

    cfg = net.model.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = transformers.AutoModel.from_config(cfg).eval()
    return tp.pretrained.load(model, dtype=net.dtype, tokenizer=net.tokenizer)


def _layer_map(net, mask):
    def fn(x):
        return torch.stack([tp.pretrained.layer_map(net, l, x[l], mask) for l in range(x.shape[0])])
    return fn


def reinit_statistics(net, texts: Sequence[str], p, lipschitz_idx: Sequence[int]) -> Dict[str, torch.Tensor]:
    """Per-sentence statistics of one network (trained or re-initialised) on ``texts``.

    Parameters
    ----------
    net
        a PretrainedNetwork with a tokenizer.
    texts : Sequence[str]
        the sentences.
    p : dict
        the probe's parameters (max_length, radius, seed, lipschitz_iterations, lipschitz_rtol).
    lipschitz_idx : Sequence[int]
        indices (into texts) of the Lipschitz estimate's sentences.

    Returns
    -------
    dict
        "mean_cosine", "clusters" (L+1, S); "beta" (L, S); "lipschitz" (L, len(lipschitz_idx)).
    """
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths share a batch
    cos, clusters, beta = [], [], []
    with torch.no_grad():
        for s in range(0, len(order), _CHUNK):
            idx = order[s:s + _CHUNK]
            states, mask = tp.pretrained.hidden_states(net, [texts[i] for i in idx], max_length=p["max_length"])
            st = cloud_statistics(states, mask, p["radius"])
            cos.append(st["mean_cosine"])
            clusters.append(st["clusters"])
            probs, gram = [], []
            for l in range(net.num_layers):
                probs.append(tp.pretrained.attention_probabilities(net, l, states[l], mask).mean(1))
                xn = states[l] / states[l].norm(dim=-1, keepdim=True)
                gram.append(xn @ xn.transpose(-1, -2))
            beta.append(fit_effective_beta(torch.stack(probs), torch.stack(gram), mask)["beta"])
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(order)] = torch.arange(len(order))
    out = {k: torch.cat(v, -1)[..., inv].double() for k, v in (("mean_cosine", cos), ("clusters", clusters),
                                                                 ("beta", beta))}
    states, mask = tp.pretrained.hidden_states(net, [texts[i] for i in lipschitz_idx], max_length=p["max_length"])
    gen = torch.Generator().manual_seed(p["seed"])
    x = states[:-1]
    sigma = top_singular_value(_layer_map(net, mask), x, batch_dims=2, mask=mask.expand(x.shape[:-1]),
                               iterations=p["lipschitz_iterations"], generator=gen, rtol=p["lipschitz_rtol"])
    out["lipschitz"] = sigma.double()
    return out


def summarise_seeds(per_seed: List[Dict[str, torch.Tensor]], seeds: Sequence[int]) -> dict:
    """Per statistic and index: the mean over sentences of each seed, then their mean ± standard error over
    seeds (NaN error for one seed), and the per-seed means.

    Parameters
    ----------
    per_seed : list of dict
        :func:`reinit_statistics` of each seed.
    seeds : Sequence[int]
        the seeds, in the same order.

    Returns
    -------
    dict
        {"seeds", statistic → {"mean", "se", "per_seed"}}.
    """
    out = {"seeds": [int(s) for s in seeds]}
    for k in per_seed[0]:
        m = torch.stack([d[k].mean(-1) for d in per_seed])  # (seeds, index)
        se = m.std(0, unbiased=True) / math.sqrt(m.shape[0]) if m.shape[0] > 1 else torch.full_like(m[0], math.nan)
        out[k] = {"mean": m.mean(0).tolist(), "se": se.tolist(), "per_seed": m.tolist()}
    return out


def reinit_figure(run, p, metrics: dict) -> None:
    """``trained_vs_reinit``: the trained network (sentence means ± s.e.) and the re-initialised architecture
    (mean over seeds ± s.e. over seeds) per hidden-state index (mean cosine, clusters) and per layer (β_eff,
    Lipschitz constant)."""
    import numpy as np

    r, real, lay = metrics["reinitialised"], metrics["real"], metrics["layers"]
    rows = (("mean_cosine", real["mean_cosine"], real["mean_cosine_se"], "mean cosine", "hidden-state index"),
            ("clusters", real["clusters"], real["clusters_se"], "clusters (single linkage)", "hidden-state index"),
            ("beta", lay["beta_eff"], lay["beta_eff_se"], r"$\beta_{\mathrm{eff}}$", "layer"),
            ("lipschitz", lay["lipschitz"], lay["lipschitz_se"], r"$\|\partial x_{\ell+1}/\partial x_\ell\|_2$",
             "layer"))
    fig, axes = subplots(1, 4, (15.0, 3.8), squeeze=False)
    for ax, (key, tm, ts, ylab, xlab) in zip(axes[0], rows):
        idx = np.arange(len(tm))
        ax.errorbar(idx, tm, yerr=ts, color="k", marker="o", ms=4, capsize=2, label="trained")
        ax.errorbar(idx, r[key]["mean"], yerr=np.nan_to_num(r[key]["se"]), color="C3", marker="s", ms=4, capsize=2,
                    label=f"re-initialised ({len(r['seeds'])} seeds)")
        ax.set_xticks(idx)
        panel(ax, xlab, ylab, None)
    axes[0, 0].legend(fontsize=8, loc="best")
    cap = (f"{metrics['text']['sentences']} sentences through the trained {p['model']} and through its architecture "
           f"re-initialised by its configuration's own initialiser (AutoModel.from_config, seeds "
           f"{', '.join(map(str, r['seeds']))}). Trained: ± one standard error over sentences (Lipschitz: over "
           f"{metrics['layers']['lipschitz_sentences']} sentences); re-initialised: ± one standard error over seeds. "
           f"Clustering radius {p['radius']:g}.")
    fig.suptitle("what belongs to training and what to the architecture", fontsize=11)
    save_captioned(run, fig, "trained_vs_reinit", cap, metrics, tidy=True)
