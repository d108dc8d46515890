"""
Eulerian JKO on the circle
==========================

``scheme="eulerian"`` solves the PDE for a density on a fixed grid of S¹: each step is an entropic
minimising movement for the grid weights.  Mass stays 1 and the weights stay non-negative by
construction.  The figure shows the density at a few times, started from a smoothed version of
32 random tokens (:func:`transformer_pde.to_grid`).
"""

import math

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp

f64 = dict(dtype=torch.float64)
m = 128
grid = tp.sphere.circle_grid(m, **f64)
tokens = tp.sphere.sample_uniform(32, 2, generator=torch.Generator().manual_seed(0), **f64)
q0 = tp.to_grid(tokens, grid)
heads = tp.Heads.random(2, 2, scale=1.0, generator=torch.Generator().manual_seed(3), **f64)
eps = (2.0 * 2 * math.pi / m) ** 2
traj = tp.jko(None, heads, tau=0.05, steps=20, scheme="eulerian", grid=grid, grid_weights=q0, eps=eps,
              direction="ascent")

angle = torch.atan2(grid[:, 1], grid[:, 0])
order = angle.argsort()
fig, ax = plt.subplots(figsize=(6, 3.5))
for k in (0, 5, 10, 20):
    ax.plot(angle[order], traj.weights[k][order] * m / (2 * math.pi), label=f"t = {float(traj.times[k]):.2f}")
ax.set_xlabel("angle on S¹")
ax.set_ylabel("density")
ax.legend(fontsize=8)
fig.tight_layout()
print("mass error", float((traj.weights.sum(-1) - 1).abs().max()), " min weight", float(traj.weights.min()))
