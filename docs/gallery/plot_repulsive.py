"""
Repulsive attention on the circle: who synchronises?
====================================================

n = 12 tokens on S¹, one head A = V = I with β from −1 to 2 (β ≤ 0 is a plain float:
``tp.Heads.scalar([1], 2, beta=-1.0)``), the gradient ascent of the energy (``normalization="unnormalized"``).
Left: the fraction of 60 random starts that synchronise, every β and start in one batch of ``tp.simulate``, with
exact binomial intervals, against the proved ranges (synchronisation for β ≥ −0.16, Polyanskiy–Rigollet–Yao; not
for β < −2/3).  Right: the largest eigenvalue of the energy's Hessian at three equal clusters 120° apart — negative
below β = −2/3: a stable non-synchronised state, whose basin from uniform starts is small at these β
(docs/repulsive.md).
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from transformer_pde.analysis.theory import synchronization as sy
from transformer_pde.application.studies.repulsive import basins, clopper_pearson

n, starts = 12, 60
betas = [-1.0, -0.7, -0.4, -0.16, 0.0, 0.5, 1.0, 2.0]
res = basins(n, betas, starts, dt=0.1, t_segment=25.0, t_max=100.0, seed=1)  # len(betas)·starts systems, one batch
k = (res["status"] == 0).sum(-1).numpy()
ci = np.array([clopper_pearson(int(v), starts) for v in k])

fig, axs = plt.subplots(1, 2, figsize=(10, 3.8))
f = k / starts
axs[0].errorbar(betas, f, yerr=[f - ci[:, 0], ci[:, 1] - f], fmt="o-", capsize=2)
axs[0].axvspan(sy.SYNC_BETA_MIN, 2.0, color="tab:green", alpha=0.1, label="proved: synchronises")
axs[0].axvspan(-1.0, sy.NO_SYNC_BETA_MAX, color="tab:red", alpha=0.1, label="proved: not globally")
axs[0].set_xlabel(r"$\beta$")
axs[0].set_ylabel("fraction synchronised")
axs[0].set_title(f"n = {n}, {starts} starts per β")
axs[0].legend(fontsize=7)

bs = np.linspace(-1.0, -0.4, 13)
sizes = sy.balanced_sizes(n, 3)
tops = [float(sy.stability_spectrum(sy.cluster_configuration(sizes, sy.cluster_equilibrium(sizes, b)), b).max())
        for b in bs]
axs[1].plot(bs, tops, "o-", ms=3)
axs[1].axhline(0.0, color="0.4", lw=0.8)
axs[1].axvline(-2 / 3, color="tab:red", ls=":", label=r"$\beta = -2/3$")
axs[1].set_xlabel(r"$\beta$")
axs[1].set_ylabel("largest Hessian eigenvalue")
axs[1].set_title("three equal clusters (rotation removed)")
axs[1].legend(fontsize=7)
fig.tight_layout()
