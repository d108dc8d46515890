"""
Heads from nn.MultiheadAttention, trained through the solver
============================================================

:meth:`transformer_pde.Heads.from_multihead_attention` reads the heads of a real attention
layer (A_h = W_Q,hᵀ W_K,h, V_h = W_O,h W_V,h, β = 1/√k); :func:`transformer_pde.simulate` is
differentiable, so a loss of the flow trains the layer's weights with an ordinary optimiser.
The loss asks the tokens of two hemispheres to reach two target points; the figure shows it
falling over the Adam steps.
"""

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp

torch.manual_seed(0)
f64 = dict(dtype=torch.float64)
d = 4
mha = torch.nn.MultiheadAttention(d, num_heads=2, bias=False, **f64)
opt = torch.optim.Adam(mha.parameters(), lr=0.05)
x0 = tp.sphere.sample_uniform(12, d, generator=torch.Generator().manual_seed(1), **f64)
side = x0[:, 0] > 0
targets = torch.where(side[:, None], torch.eye(d, **f64)[1], -torch.eye(d, **f64)[1])

losses = []
for step in range(20):
    heads = tp.Heads.from_multihead_attention(mha)
    traj = tp.simulate(x0, heads, t1=1.0, dt=0.1, method="euler", direction="ascent", diagnostics=False)
    loss = (1 - (traj.final * targets).sum(-1)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))

fig, ax = plt.subplots(figsize=(4.5, 3.3))
ax.plot(losses, "o-", ms=3)
ax.set_xlabel("Adam step")
ax.set_ylabel("mean 1 − ⟨x_i(1), target_i⟩")
fig.tight_layout()
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
