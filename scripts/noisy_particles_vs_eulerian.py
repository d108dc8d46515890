"""Noisy particles against the Fokker–Planck JKO on S¹: W2 at a fixed time as N grows and as τ → 0.

    python scripts/noisy_particles_vs_eulerian.py

One unnormalised head A = V = I (β = 1, ascent), T = 0.5·T_c. The Eulerian JKO with unit mobility is the W2
gradient flow of −E + T∫ρ log ρ, the mean field of these particles. Both start from ρ0 ∝ 1 + 0.5 cos θ: the
particles as N quantile tokens, the grid as ρ0 at its points. Prints W2 between the particles at t = 1 (all
paths pooled) and the Eulerian density, for each N and τ, with fitted log–log slopes. W2 is the exact POT
distance with chordal cost, via tp.distance.
"""

import math

import numpy as np
import torch

import transformer_pde as tp

F64 = torch.float64
beta, t1 = 1.0, 1.0
heads = tp.Heads.scalar(torch.tensor([1.0], dtype=F64), 2, beta=beta)
Tc = tp.theory.critical_temperature(beta, 2, normalization="unnormalized")
T = 0.5 * Tc


def quantile_tokens(n):
    th = np.linspace(-math.pi, math.pi, 20001)
    cdf = (th + math.pi + 0.5 * np.sin(th)) / (2 * math.pi)  # ∫ (1 + 0.5 cos)/(2π)
    u = (np.arange(n) + 0.5) / n
    a = np.interp(u, cdf, th)
    return torch.tensor(np.stack([np.cos(a), np.sin(a)], -1), dtype=F64)


def eulerian(tau, m=96):
    z = tp.sphere.circle_grid(m, dtype=F64)
    th = torch.atan2(z[:, 1], z[:, 0])
    q0 = (1 + 0.5 * torch.cos(th))
    q0 = q0 / q0.sum()
    tr = tp.jko(None, heads, tau=tau, steps=round(t1 / tau), scheme="eulerian", grid=z, grid_weights=q0,
                direction="ascent", mobility="unit", temperature=T, eps=0.01, tol=1e-8, max_iter=5000)
    return z, tr.weights[-1]


def particles(n, paths=8, dt=0.005):
    tr = tp.simulate(quantile_tokens(n), heads, t1=t1, dt=dt, temperature=T, paths=paths, seed=0,
                     normalization="unnormalized", direction="ascent", diagnostics=False,
                     record_every=round(t1 / dt))
    return tr.final.reshape(-1, 2)


ref = eulerian(0.05)
print(f"T = {T:.4f} (T_c = {Tc:.4f}), t = {t1}; reference Eulerian: m = 96, tau = 0.05, eps = 0.01")
ns, w_n = [100, 400, 1600], []
for n in ns:
    x = particles(n)
    w_n.append(float(tp.distance(x, ref, kind="w2")))
    print(f"particles N = {n} (x8 paths pooled): W2 to the Eulerian density = {w_n[-1]:.4f}")
print(f"fitted slope in N: {np.polyfit(np.log(ns), np.log(w_n), 1)[0]:.3f}")
xbig = particles(3200, paths=8)
taus, w_t = [0.2, 0.1, 0.05], []
for tau in taus:
    e = ref if tau == 0.05 else eulerian(tau)
    w_t.append(float(tp.distance(xbig, e, kind="w2")))
    print(f"Eulerian tau = {tau}: W2 to the particles (N = 3200, x8 paths) = {w_t[-1]:.4f}")
print(f"fitted slope in tau: {np.polyfit(np.log(taus), np.log(w_t), 1)[0]:.3f}")
