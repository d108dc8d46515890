"""
Random layers: values drawn afresh at every layer
=================================================

Two tokens, one softmax head ``A = I`` and centred value matrices drawn afresh at every layer with the depth scaling
``σ Z/√Δ`` (``tp.RandomLayers``): as the number of layers ``L = T/Δ`` grows the network converges to an SDE on the
sphere driven by a noise common to the tokens.  Left: the weak error of ``E⟨x₁, x₂⟩²`` at ``T = 1`` against the
exact limit (``two_token_expectation``, the backward Kolmogorov equation of the inner product), shrinking like
``1/L``.  Right: the fraction of pairs that end antipodal, from orthogonal tokens, against the limit's absorption
probability (``antipodal_probability``), which is 0 from ``d_c(β) = 1 + 2cosh²β`` on (docs/homogenized.md).
"""

import math

import matplotlib.pyplot as plt
import numpy as np

from transformer_pde.analysis.theory import homogenized as hz
from transformer_pde.application.studies.homogenized import network_inner_products, wilson_interval

d, beta, T = 3, 1.0, 1.0
exact = float(hz.two_token_expectation(lambda r: r * r, 0.0, T, beta, d))
Ls = [2, 4, 8, 16]
err, se = [], []
for L in Ls:
    r = network_inner_products(0.0, d, beta, 1.0, t1=T, layers=L, paths=10000, seed=L)  # one batch of paths
    err.append(abs(float((r * r).mean()) - exact))
    se.append(float((r * r).std()) / math.sqrt(r.numel()))

dims, pairs = [2, 3, 4, 5], 200
frac, ci, limit = [], [], []
for dd in dims:
    r = network_inner_products(0.0, dd, beta, 1.0, t1=10.0, layers=200, paths=pairs, seed=dd)
    k = int((r < -0.99).sum())
    frac.append(k / pairs)
    ci.append(wilson_interval(k, pairs, 1.96))
    limit.append(float(hz.antipodal_probability(0.0, beta, dd)))

fig, axs = plt.subplots(1, 2, figsize=(10, 3.8))
axs[0].errorbar(Ls, err, yerr=se, fmt="o-", capsize=2, label="network")
axs[0].plot(Ls, err[0] * Ls[0] / np.array(Ls), "k:", label="1/L")
axs[0].set_xscale("log")
axs[0].set_yscale("log")
axs[0].set_xlabel("layers L")
axs[0].set_ylabel(r"|weak error of E$\rho_T^2$|")
axs[0].set_title(f"d = {d}, β = {beta:g}, T = {T:g}")
axs[0].legend(fontsize=7)
f = np.array(frac)
lo, hi = np.array(ci).T
axs[1].errorbar(dims, f, yerr=[np.clip(f - lo, 0, None), np.clip(hi - f, 0, None)], fmt="o", capsize=2,
                label=f"network, Δ = 0.05, {pairs} pairs")
axs[1].plot(dims, limit, "-", label="limit: absorption probability")
axs[1].axvline(hz.critical_dimension(beta), color="0.5", ls=":", label=r"$d_c = 1 + 2\cosh^2\beta$")
axs[1].set_xlabel("d")
axs[1].set_ylabel("fraction antipodal")
axs[1].set_title(f"β = {beta:g}, from orthogonal tokens")
axs[1].legend(fontsize=7)
fig.tight_layout()
