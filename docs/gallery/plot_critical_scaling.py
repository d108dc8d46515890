"""
Critical attention scaling: β_n = γ log n
=========================================

One softmax head A = V = I whose inverse temperature is a rule of the context length,
``tp.Heads(I, beta=tp.LogScaling(γ))`` with a tensor of γ (the whole sweep in one kernel call).  Almost-simplex
tokens y_j = √ρ e + √(1 − ρ) z_j in R^64 (pairwise inner product ρ = 0.5 on average), one query against n keys,
n = 10² … 10⁵: the query's weight on itself crosses from 0 (attention averages, the tokens collapse) to 1
(attention is the identity) near γ_c = 1/(1 − ρ) = 2, the critical scale of Chen, Lin, Polyanskiy and Rigollet.
The dashed lines are the annealed prediction for these tokens, the dotted one the exact simplex at n = 10⁵; the
transition sits slightly above γ_c because log n is not small against d (docs/critical_scaling.md).
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import scaling as ts

rho, d = 0.5, 64
gc = ts.critical_gamma(rho)
gam = torch.linspace(0.3, 2.0, 35, dtype=torch.float64) * gc
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for n in (100, 1000, 10000, 100000):
    y = ts.almost_simplex(n, d, rho, generator=torch.Generator().manual_seed(n))
    heads = tp.Heads(torch.eye(d, dtype=torch.float64)[None], beta=tp.LogScaling(gam)).at_context(n)
    lse = tp.softmax_statistics(y[:1], heads, keys=y).log_partition.reshape(-1)  # one query, n keys: O(n)
    self_weight = torch.exp(heads.beta - math.log(n) - lse)
    line, = ax.plot(gam / gc, self_weight, "o", ms=3, label=f"n = {n}")
    ax.plot(gam / gc, ts.annealed_self_weight(gam.numpy(), rho, n, d), "--", color=line.get_color(), lw=0.8)
ax.plot(gam / gc, [ts.simplex_self_weight(float(g), rho, 100000) for g in gam], "k:", label="simplex, n = 10⁵")
ax.axvline(1.0, color="0.6", ls=":")
ax.set_xlabel(r"$\gamma / \gamma_c$,  $\beta_n = \gamma \log n$")
ax.set_ylabel("self weight of the query")
ax.set_title(rf"one softmax layer, almost-simplex tokens in $R^{{{d}}}$, $\rho$ = {rho}")
ax.legend(fontsize=8)
fig.tight_layout()
