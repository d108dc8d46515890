"""CPU time of ``tp.simulate(..., layer_norm="post")`` against the two reference simulators' step functions.

Workload of the reference simulators: 256 systems × 32 tokens × d = 16, 100 steps of
Δt = 0.1, softmax, β = 1, random Gaussian score and value matrices per system, post-LN, and the
statistic they record at every step (the fraction of distinct pairs with overlap > 0.999).
Heads: 8 for simuformer (ω_h = 1/H), 1 for rotf (that code has one head).

The peers' arithmetic is re-implemented below from their published code (read, not copied):

* :func:`rotf_run` mirrors borjanG/2023-transformers-rotf, ``phase-diagrams.py``,
  ``simu_xform.step_1`` (M@BF, scores against M, ×β, softmax, @M, ×η, @V, +M, normalise) and
  ``simu_xform.check_stats`` (IP = M Mᵀ, off-diagonal fraction > 0.999);
* :func:`simuformer_run` mirrors nikitus20/simuformer, ``simuxform.py``, ``SimuXForm.step`` with
  ``norm='postln'`` (a Python loop over heads: bmm(bmm(M, BF_h), Mᵀ), ×β, softmax,
  bmm(SM, bmm(M, V_h))/H accumulated; M + η·A, normalise) and ``SimuXForm.check_stats``.

Ours: ``tp.simulate(x0, heads, t1=100·Δt, dt=Δt, direction="ascent", layer_norm="post",
diagnostics=False, observables={"pair_fraction": tp.clustering.pair_fraction_observable(eps=1e-3)})``
— the same map (checked here: the final
tokens agree to rounding), the same statistic at every step.

The three run interleaved, ``--repeats`` times; the script prints the best process CPU time of
each (``time.process_time``, all threads of this process) and the ratios ours/peer, for float64
and float32, at ``--threads`` torch threads (default 1).  The machine may be shared: the load
average is printed; compare ratios from one run.

    python scripts/benchmark_peers.py                    # both dtypes, 1 thread, 5 repeats
    python scripts/benchmark_peers.py --dtype float32 --repeats 9 --systems 64
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import transformer_pde as tp


def problem(systems, n, d, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = torch.nn.functional.normalize(torch.randn(systems, n, d, generator=g, dtype=torch.float64), dim=2)
    BF = torch.randn(systems, H, d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    V = torch.randn(systems, H, d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return M.to(dtype), BF.to(dtype), V.to(dtype)


def _pair_fraction_ip(M):
    """The peers' statistic: off-diagonal fraction of IP = M Mᵀ above 0.999."""
    n = M.shape[1]
    IP = torch.bmm(M, M.transpose(1, 2))
    mask = ~torch.eye(n, dtype=torch.bool).expand(M.shape[0], -1, -1)
    return (IP[mask] > 0.999).sum() / mask.sum()


def rotf_run(M, BF, V, beta, eta, steps):
    """rotf's step_1 (one head: BF, V of shape (systems, d, d)) and check_stats every step."""
    stats = []
    with torch.no_grad():
        for _ in range(steps):
            M2 = torch.matmul(M, BF)
            SM = torch.matmul(M2, M.transpose(1, 2)) * beta
            SM = torch.softmax(SM, dim=2)
            M2 = torch.matmul(SM, M) * eta
            M2 = torch.matmul(M2, V) + M
            M = torch.nn.functional.normalize(M2, dim=2)
            stats.append(_pair_fraction_ip(M))
    return M, torch.stack(stats)


def simuformer_run(M, BF, V, beta, eta, steps):
    """simuformer's step (postln; BF, V as lists of (systems, d, d) per head) and check_stats every step."""
    H = len(BF)
    stats = []
    with torch.no_grad():
        for _ in range(steps):
            acc = torch.zeros_like(M)
            for h in range(H):
                SM = torch.bmm(torch.bmm(M, BF[h]), M.transpose(1, 2))
                SM = torch.softmax(SM * beta, dim=2)
                acc += torch.bmm(SM, torch.bmm(M, V[h])) / H
            M = torch.nn.functional.normalize(M + eta * acc, dim=2)
            stats.append(_pair_fraction_ip(M))
    return M, torch.stack(stats)


#: the same statistic per system from the tokens (what ours records at every step)
_pair_observable = tp.clustering.pair_fraction_observable(eps=1e-3)


def ours_run(M, BF, V, beta, eta, steps, weights=None):
    """tp.simulate with the post-LN map: A_h = BF_h, value Vᵀ (the peers use row vectors)."""
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=weights, beta=beta)
    traj = tp.simulate(M, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post", diagnostics=False,
                       observables={"pair_fraction": _pair_observable}, record_every=1, progress=False)
    return traj.final, traj.observables["pair_fraction"][1:].mean(-1)


def cpu(fn, *a):
    t = time.process_time()
    out = fn(*a)
    return time.process_time() - t, out


def bench(dtype, args):
    steps, beta, eta = args.steps, 1.0, 0.1
    M, BF, V = problem(args.systems, args.tokens, args.dim, args.heads, dtype)
    bf_list, v_list = [BF[:, h].contiguous() for h in range(args.heads)], [V[:, h].contiguous() for h in range(args.heads)]
    bf1, v1 = BF[:, 0].contiguous(), V[:, 0].contiguous()
    one = torch.ones(1, dtype=dtype)
    cases = {
        "simuformer (H=8)": lambda: simuformer_run(M, bf_list, v_list, beta, eta, steps),
        "ours (H=8)": lambda: ours_run(M, BF, V, beta, eta, steps),
        "rotf (H=1)": lambda: rotf_run(M, bf1, v1, beta, eta, steps),
        "ours (H=1)": lambda: ours_run(M, BF[:, :1], V[:, :1], beta, eta, steps, weights=one),
    }
    best = {k: float("inf") for k in cases}
    outs = {}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            t, outs[k] = cpu(fn)
            best[k] = min(best[k], t)
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    for a, b in (("ours (H=8)", "simuformer (H=8)"), ("ours (H=1)", "rotf (H=1)")):
        dx = float((outs[a][0] - outs[b][0]).abs().max())
        ds = float((outs[a][1] - outs[b][1]).abs().max())
        flag = "" if dx < tol and ds < 1e-2 else "   <-- MISMATCH"
        print(f"  {a} vs {b}: max |Δx| = {dx:.2e}, max |Δ pair fraction| = {ds:.2e}{flag}")
    for k in cases:
        print(f"  {k:18s} best CPU {best[k]:.3f} s")
    r1 = best["ours (H=8)"] / best["simuformer (H=8)"]
    r2 = best["ours (H=1)"] / best["rotf (H=1)"]
    print(f"  ratio ours/simuformer = {r1:.2f}   ours/rotf = {r2:.2f}   (target <= 0.7)")
    return r1, r2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs; {args.systems} systems × {args.tokens} tokens × d = {args.dim}, "
          f"{args.steps} steps, best of {args.repeats} interleaved repeats (process CPU time)")
    for name in (("float64", "float32") if args.dtype == "both" else (args.dtype,)):
        print(f"{name}:")
        bench(getattr(torch, name), args)


if __name__ == "__main__":
    main()
