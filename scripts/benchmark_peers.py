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

The cases run interleaved, ``--repeats`` times, in one process at ``--threads`` torch threads
(default 1); the script prints the best process CPU time of each (``time.process_time``, all
threads of this process), the ratios ours/peer of the best times and the range of the per-repeat
ratios (each repeat runs every case once, back to back), for float64 and float32.  Two calls of
ours are timed:

* **same work**: the call above (no diagnostics, the peers' statistic at every step);
* **lean**: the same work with the statistic from ``callback=`` at every step and the tokens
  recorded at the start and the end only (``record_every=steps``): what recording a state per
  step costs;
* **obvious**: ``tp.simulate(x0, heads, t1=..., dt=..., direction="ascent", layer_norm="post")``
  with every other argument at its default (the direction is the peers' x + Δt·A), which
  computes what the defaults compute (diagnostics, progress policy) and no statistic.

``--block-fractions 0.125,0.25,0.5`` times the same-work call once per size of the fused
kernel's score block, as fractions of this CPU's L2 cache (``layernorm._SCORE_BLOCK_BYTES``; the
library's default is ``layernorm.SCORE_BLOCK_FRACTION``), side by side with the peers.  The header
names the CPU, its caches, the thread count and the load average before and after; a load
average above half the cores, or rising by more than 0.5 during the run, is reported as a busy
machine (the peers' and our times then both rise: compare ratios from one run).

    python scripts/benchmark_peers.py                    # both dtypes, 1 thread, 3 repeats
    python scripts/benchmark_peers.py --dtype float32 --repeats 9 --systems 64
    python scripts/benchmark_peers.py --block-fractions 0.0625,0.125,0.25,0.5,1 --no-obvious
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import transformer_pde as tp
from transformer_pde.solvers import layernorm
from transformer_pde.utils import hardware


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


def lean_run(M, BF, V, beta, eta, steps, weights=None):
    """The same work without a recorded state per step: the statistic from a callback at every step,
    the tokens recorded at the start and the end only."""
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=weights, beta=beta)
    stats = []
    traj = tp.simulate(M, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post", diagnostics=False,
                       record_every=steps, progress=False, callback=lambda k, t, x: stats.append(_pair_observable(x)))
    return traj.final, torch.stack(stats).mean(-1)


def obvious_run(M, BF, V, beta, eta, steps, weights=None):
    """The obvious call: post-LN and the peers' direction, every other argument at its default."""
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=weights, beta=beta)
    traj = tp.simulate(M, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post")
    return traj.final, None


def cpu(fn, *a):
    t = time.process_time()
    out = fn(*a)
    return time.process_time() - t, out


def _with_block(nbytes, fn):
    """fn with the fused kernel's score block set to ``nbytes`` (None: the library's default)."""
    def run():
        old = layernorm._SCORE_BLOCK_BYTES
        layernorm._SCORE_BLOCK_BYTES = nbytes
        try:
            return fn()
        finally:
            layernorm._SCORE_BLOCK_BYTES = old
    return run


def bench(dtype, args):
    steps, beta, eta = args.steps, 1.0, 0.1
    M, BF, V = problem(args.systems, args.tokens, args.dim, args.heads, dtype)
    bf_list, v_list = [BF[:, h].contiguous() for h in range(args.heads)], [V[:, h].contiguous() for h in range(args.heads)]
    bf1, v1 = BF[:, 0].contiguous(), V[:, 0].contiguous()
    one = torch.ones(1, dtype=dtype)
    l2 = hardware.cache_sizes().l2
    blocks = [None] + [int(f * l2) for f in args.block_fractions]
    cases = {"simuformer (H=8)": lambda: simuformer_run(M, bf_list, v_list, beta, eta, steps),
             "rotf (H=1)": lambda: rotf_run(M, bf1, v1, beta, eta, steps)}
    for nb in blocks:
        tag = "" if nb is None else f" block {nb // 1024} KiB"
        cases[f"ours (H=8){tag}"] = _with_block(nb, lambda: ours_run(M, BF, V, beta, eta, steps))
        cases[f"ours (H=1){tag}"] = _with_block(nb, lambda: ours_run(M, BF[:, :1], V[:, :1], beta, eta, steps,
                                                                      weights=one))
    cases["lean (H=8)"] = lambda: lean_run(M, BF, V, beta, eta, steps)
    cases["lean (H=1)"] = lambda: lean_run(M, BF[:, :1], V[:, :1], beta, eta, steps, weights=one)
    if args.obvious:
        cases["obvious (H=8)"] = lambda: obvious_run(M, BF, V, beta, eta, steps)
        cases["obvious (H=1)"] = lambda: obvious_run(M, BF[:, :1], V[:, :1], beta, eta, steps, weights=one)
    times = {k: [] for k in cases}
    outs = {}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            t, outs[k] = cpu(fn)
            times[k].append(t)
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    for a, b in (("ours (H=8)", "simuformer (H=8)"), ("ours (H=1)", "rotf (H=1)"), ("lean (H=8)", "simuformer (H=8)"),
                 ("lean (H=1)", "rotf (H=1)")):
        dx = float((outs[a][0] - outs[b][0]).abs().max())
        ds = float((outs[a][1] - outs[b][1]).abs().max())
        flag = "" if dx < tol and ds < 1e-2 else "   <-- MISMATCH"
        print(f"  {a} vs {b}: max |Δx| = {dx:.2e}, max |Δ pair fraction| = {ds:.2e}{flag}")
    for k in cases:
        print(f"  {k:28s} best CPU {min(times[k]):.3f} s  (repeats {min(times[k]):.3f}–{max(times[k]):.3f})")
    print(f"  {'ours / peer':28s} {'simuformer (H=8)':>28s} {'rotf (H=1)':>28s}   (best; per-repeat range)")
    rows = {}
    for k in cases:
        if k.startswith(("ours (H=8)", "lean (H=8)", "obvious (H=8)")):
            label = k.replace(" (H=8)", "")
            r8 = _ratios(times[k], times["simuformer (H=8)"])
            r1 = _ratios(times[k.replace("H=8", "H=1")], times["rotf (H=1)"])
            rows[label] = (r8, r1)
            print(f"  {label:28s} {_fmt(r8):>28s} {_fmt(r1):>28s}")
    return rows


def _ratios(ours, peer):
    per = [a / b for a, b in zip(ours, peer)]
    return min(ours) / min(peer), min(per), max(per)


def _fmt(r):
    return f"{r[0]:.2f} ({r[1]:.2f}–{r[2]:.2f})"


def _fractions(text):
    try:
        out = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--block-fractions takes numbers separated by commas, got {text!r}")
    if any(not 0 < f <= 64 for f in out):
        raise argparse.ArgumentTypeError(f"--block-fractions are fractions of the L2 size in (0, 64], got {text!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    ap.add_argument("--block-fractions", type=_fractions, default=[],
                    help="also time the same-work call with score blocks of these fractions of the L2 cache")
    ap.add_argument("--no-obvious", dest="obvious", action="store_false", help="skip the obvious call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    c = hardware.cache_sizes()
    cores = os.cpu_count() or 1
    load0 = os.getloadavg()
    print(f"CPU {hardware.cpu_model()!r}, {cores} CPUs; caches ({c.source}): L1d {c.l1d // 1024} KiB, "
          f"L2 {c.l2 // 1024} KiB, L3 {'?' if c.l3 is None else c.l3 // 1024 ** 2} MiB; fused score block "
          f"{layernorm.score_block_bytes(torch.device('cpu')) // 1024} KiB")
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f} (1, 5, 15 min); {args.systems} systems × {args.tokens} tokens × d = {args.dim}, "
          f"{args.steps} steps, best of {args.repeats} interleaved repeats (process CPU time)")
    for name in (("float64", "float32") if args.dtype == "both" else (args.dtype,)):
        print(f"{name}:")
        bench(getattr(torch, name), args)
    load1 = os.getloadavg()
    busy = max(load0[0], load1[0]) > 0.5 * cores or load1[0] - load0[0] > 0.5
    print(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; the machine was "
          f"{'BUSY (other processes shared the cores: ratios from one run still compare)' if busy else 'idle'}")


if __name__ == "__main__":
    main()
