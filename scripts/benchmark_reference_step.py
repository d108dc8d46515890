"""Time one solver step of the paper's reference configuration against a straightforward dense code.

Reference configuration (issue #4, DESIGN §1): n = 200 tokens on S² started near the octahedral
vertices, H = 100 symmetric heads D_h(0) = Z + Zᵀ, β = 1, ω = 1/H, direction "descent",
Ornstein–Uhlenbeck weights (mean I, rate 1, σ² = 2) with 10 Monte-Carlo paths, float64,
dt = 5·10⁻³, Euler, every diagnostic on (energy, 𝒢², 𝒟, ∂_tE with the Itô correction, the
martingale pairing).

Two implementations run side by side in this process on the same weight path:

* ours: ``tp.simulate(x0, OrnsteinUhlenbeck(...), method="euler", paths=10, return_path=True)``;
* dense: the same formulas written out below the way the public reference code organises
  them — (paths, heads, n, n) tensors of logits, their exponentials, row sums, normalised
  attention, einsums for the field and for every ledger term (``dense_step``).

The script prints the seconds per step of each, their ratio, and the largest differences of
the tokens and of the ledger terms (they must agree to rounding), then the projected wall time
of the paper's full experiment (4000 steps of OU with H = 1, 10, 100 and 10 paths, and of
oscillating weights with H = 1, 10, 100 and one path) from per-step times measured here.

    python scripts/benchmark_reference_step.py                 # H = 100, 10 steps
    python scripts/benchmark_reference_step.py --heads 1 10 100 --steps 20 --backend chunked

Timings on a shared machine are noisy: the script prints the load average and the CPU time
next to the wall time; compare ratios from one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import transformer_pde as tp


def reference_setup(H, *, dtype=torch.float64, seed=0, device="cpu"):
    """Octahedral tokens (seed 42) and symmetric heads Z + Zᵀ (seed ``seed``) as in the paper."""
    x0 = tp.sphere.octahedral(200, 3, dtype=dtype)
    heads = tp.Heads.random(H, 3, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return x0.to(device), heads.to(device)


# ---------------------------------------------------------------------------- dense reference
def dense_step(x, D, F, noise, sigma, dt):
    """One Euler step with all diagnostics, written with dense (P, H, n, n) tensors.

    x (P, n, d) tokens, D (P, H, d, d) symmetric scores = values, F (P, H, d, d) the drift
    of D at this grid point, noise (P, H, d, d) = σ ΔW_sym (or None), sigma the noise amplitude.
    β = 1, ω_h = 1/H, descent.  Returns (x_next, energy, dEdt, slope, dissipation, martingale).
    """
    P, n, d = x.shape
    H = D.shape[1]
    c = 1.0 / (H * n * n)
    Dx = torch.einsum("phab,pjb->phja", D, x)  # A_h x_j
    logits = torch.einsum("pia,phja->phij", x, Dx)  # s_ij = <x_i, A_h x_j>
    U = torch.exp(logits)
    Zrow = U.sum(-1)  # n · m_h(x_i)
    attn = U / Zrow.unsqueeze(-1)
    energy = 0.5 * c * U.sum((1, 2, 3))
    Fx = torch.einsum("phab,pjb->phja", F, x)
    drift = torch.einsum("pia,phja->phij", x, Fx)
    dEdt = 0.5 * c * (U * drift).sum((1, 2, 3))
    if noise is not None:
        G = x @ x.transpose(-1, -2)
        ito = (sigma * sigma / 4.0) * (1.0 + G.square())
        dEdt = dEdt + 0.5 * c * (U * ito.unsqueeze(1)).sum((1, 2, 3))
    f = torch.einsum("phij,phja->phia", attn, Dx)  # f_h(x_i) = A_h ȳ_h(x_i)
    radial = (f * x.unsqueeze(1)).sum(-1, keepdim=True)
    proj = f - radial * x.unsqueeze(1)  # P_x f_h
    v = -proj.mean(1)  # descent
    m = Zrow / n  # m_h(x_i)
    b = 1.0 / (1.0 / m).mean(1)  # harmonic mean over heads
    slope = (b * v.square().sum(-1)).mean(-1)
    grad = (m.unsqueeze(-1) * proj).mean(1)  # ∇_S δE/δμ = Σ_h ω_h m_h P_x A_h ȳ_h
    dissipation = (grad * v).sum(-1).mean(-1)
    mart = None
    if noise is not None:
        Nx = torch.einsum("phab,pjb->phja", noise, x)
        mart = 0.5 * c * (U * torch.einsum("pia,phja->phij", x, Nx)).sum((1, 2, 3))
    y = x + dt * v
    return y / y.norm(dim=-1, keepdim=True), energy, dEdt, slope, dissipation, mart


def dense_run(x0, path, steps, dt):
    """Replay a stored weight path with :func:`dense_step`; returns (x, ledger dict) at the end."""
    P = path.scores.shape[1]
    x = x0.unsqueeze(0).expand(P, *x0.shape).clone()
    acc = {"partial": 0.0, "dissipation": 0.0, "slope": 0.0, "martingale": 0.0}
    E0 = energies = None
    for k in range(steps):
        sig = path.sigmas[k]
        sig = float(sig) if not isinstance(sig, torch.Tensor) or sig.numel() == 1 else sig
        noise = None if path.noise is None else path.noise[k]
        x, E, dEdt, G2, Dis, M = dense_step(x, path.scores[k], path.rates[k], noise, sig, dt)
        if E0 is None:
            E0 = E
        acc["partial"] = acc["partial"] + dt * dEdt
        acc["dissipation"] = acc["dissipation"] + dt * Dis
        acc["slope"] = acc["slope"] + dt * G2
        if M is not None:
            acc["martingale"] = acc["martingale"] + M
    # energy at the final state (the same kernel pass the solver records)
    _, energies, *_ = dense_step(x, path.scores[steps], path.rates[steps], None, 0.0, dt)
    acc["dE"] = energies - E0
    return x, acc


# ---------------------------------------------------------------------------- timing
def _time(fn, repeat):
    best_wall, best_cpu, out = math.inf, math.inf, None
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best_wall = min(best_wall, time.perf_counter() - w)
        best_cpu = min(best_cpu, time.process_time() - c)
    return best_wall, best_cpu, out


def ours(x0, theta, steps, dt, paths, backend):
    with tp.attention.kernel_backend(backend):
        return tp.simulate(x0, theta, t1=steps * dt, dt=dt, method="euler", direction="descent", paths=paths,
                           seed=0, record_every=steps, return_path=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[100])
    ap.add_argument("--paths", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2, help="take the best of this many timed runs")
    ap.add_argument("--dt", type=float, default=5e-3)
    ap.add_argument("--backend", default="auto", choices=tp.attention.BACKENDS)
    ap.add_argument("--float32", action="store_true", help="time float32 instead of float64")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--no-projection", action="store_true", help="skip the projected full-experiment time")
    args = ap.parse_args(argv)
    dtype = torch.float32 if args.float32 else torch.float64
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.2f}, {dtype}, "
          f"backend {args.backend} -> "
          f"{tp.attention.select_backend(args.backend, args.device, dtype, 10**6)} on {args.device}")
    print(f"{'H':>4} {'paths':>5} {'ours s/step':>12} {'(cpu)':>7} {'dense s/step':>13} {'(cpu)':>7} "
          f"{'dense/ours':>10} {'max|Δx|':>9} {'max|Δledger|':>12}")
    per_step = {}
    for H in args.heads:
        x0, heads = reference_setup(H, dtype=dtype, device=args.device)
        theta = tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=2 ** 0.5)
        ours(x0, theta, 1, args.dt, args.paths, args.backend)  # warm-up
        w_o, c_o, traj = _time(lambda: ours(x0, theta, args.steps, args.dt, args.paths, args.backend), args.repeat)
        path = traj.path
        with torch.no_grad():
            dense_run(x0, path, 1, args.dt)  # warm-up
            w_d, c_d, (xd, acc) = _time(lambda: dense_run(x0, path, args.steps, args.dt), args.repeat)
        dx = float((traj.x[-1] - xd).abs().max())
        dl = max(float((traj.ledger[key][-1] - acc[key]).abs().max())
                 for key in ("dE", "partial", "dissipation", "slope", "martingale"))
        s_o, s_d = w_o / args.steps, w_d / args.steps
        per_step[("ou", H)] = s_o
        print(f"{H:>4} {args.paths:>5} {s_o:>12.4f} {c_o / args.steps:>7.3f} {s_d:>13.4f} {c_d / args.steps:>7.3f} "
              f"{s_d / s_o:>10.2f} {dx:>9.1e} {dl:>12.1e}", flush=True)
    if args.no_projection:
        return per_step
    # projected full experiment: 4000 steps for each of OU (10 paths) and oscillating (1 path), H = 1, 10, 100
    K = round(20.0 / 5e-3)
    total = 0.0
    rows = []
    for kind, paths in (("ou", args.paths), ("oscillating", None)):
        for H in (1, 10, 100):
            if (kind, H) not in per_step:
                x0, heads = reference_setup(H, dtype=dtype, device=args.device)
                theta = (tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=2 ** 0.5) if kind == "ou"
                         else tp.Oscillating(heads, phase="shared"))
                ours(x0, theta, 1, args.dt, paths, args.backend)
                w, _, _ = _time(lambda: ours(x0, theta, args.steps, args.dt, paths, args.backend), args.repeat)
                per_step[(kind, H)] = w / args.steps
            total += K * per_step[(kind, H)]
            rows.append(f"{kind} H={H}: {per_step[(kind, H)]:.4f} s/step")
    print("per-step times: " + "; ".join(rows))
    print(f"projected full reference experiment ({K} steps × 6 runs): {total / 60:.1f} min "
          f"(target < 25 min on 2 cores)")
    return per_step


if __name__ == "__main__":
    main()
