"""
Metastability: staircases of the cluster count
==============================================

At large β tokens on the circle first gather into several clusters that merge only slowly: the
cluster count descends in a staircase.  :func:`transformer_pde.detect_plateaus` finds the flat
steps.  32 tokens on S¹, β = 16, one head A = I, ascent, 4 systems.
"""

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp

f64 = dict(dtype=torch.float64)
x0 = tp.sphere.sample_uniform(32, 2, batch_shape=(4,), generator=torch.Generator().manual_seed(0), **f64)
heads = tp.Heads(torch.eye(2, **f64).expand(4, 1, 2, 2), beta=16.0)
obs = tp.clustering.statistics_observables(radius=0.1, keys=["clusters"], stacked=True)
traj = tp.simulate(x0, heads, t1=100.0, dt=0.2, record_every=2, direction="ascent", observables=obs,
                   diagnostics=False)
clusters = traj.observables["cluster_statistics"][..., 0]          # (T, 4)
stairs = tp.detect_plateaus(traj.times, clusters.movedim(0, -1))

fig, ax = plt.subplots(figsize=(6, 3.5))
for b in range(4):
    ax.step(traj.times, clusters[:, b], where="post", label=f"system {b}")
ax.set_xlabel("t")
ax.set_ylabel("clusters (r = 0.1)")
ax.set_yscale("log")
ax.legend(fontsize=8)
fig.tight_layout()
print("plateaus per system:", stairs.count.tolist() if hasattr(stairs, "count") else stairs)
