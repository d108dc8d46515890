"""
The energy ledger of a noisy run
================================

Every run books the energy balance E(t) − E(0) = ∫∂_sE + ∫𝒟 + M_t term by term
(:doc:`/model`, section "The energy ledger").  Here: 24 tokens on S², four OU heads, Euler
steps; the residual of the balance is printed for three step sizes and shrinks like dt.
"""

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp

f64 = dict(dtype=torch.float64)
x0 = tp.sphere.sample_uniform(24, 3, generator=torch.Generator().manual_seed(0), **f64)
heads = tp.Heads.random(4, 3, scale=0.5, generator=torch.Generator().manual_seed(1), **f64)
theta = tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=0.5)

traj = tp.simulate(x0, theta, t1=1.0, dt=0.01, paths=4, seed=0, direction="descent", ledger=True)
t, L = traj.times, traj.ledger

fig, ax = plt.subplots(figsize=(6, 3.8))
for key, label in (("dE", "E(t) − E(0)"), ("partial", "∫∂_sE (with Itô term)"),
                   ("dissipation", r"$\int \mathcal{D}$"), ("martingale", "M_t"), ("residual", "residual")):
    mean = L[key].mean(1)
    ax.plot(t, mean, label=label, lw=2 if key == "residual" else 1.2)
ax.set_xlabel("t")
ax.set_ylabel("mean over 4 paths")
ax.legend(fontsize=8)
fig.tight_layout()

# the residual's mean over paths at the end, for three step sizes (order 1 for Euler)
for dt in (0.04, 0.02, 0.01):
    r = tp.simulate(x0, theta, t1=1.0, dt=dt, paths=4, seed=0, direction="descent", ledger=True).ledger["residual"]
    print(f"dt = {dt:<5}  mean final residual = {float(r[-1].mean()):+.2e}")
