"""CPU time of E, 𝒢², 𝒟 computed at the recorded times after a solve vs at every step during it.

Two workloads (``--workload``):

* ``peers``: the peers' simulators (scripts/benchmark_peers.py): 256 systems × 32 tokens × d = 16,
  8 heads with random Gaussian score and value matrices per system, softmax, β = 1, post-LN, ascent,
  100 steps of Δt = 0.1;
* ``paper``: the paper's Euler step at H = 100 (scripts/benchmark_reference_step.py): 200 octahedral
  tokens on S², symmetric heads, OU weights (rate 1, σ = √2), 10 paths, descent, Δt = 5e-3.

Timed side by side, interleaved, ``--repeats`` times:

* tokens:  ``tp.simulate(..., diagnostics=False)`` — the tokens only;
* eager:   ``tp.simulate(..., ledger=True)`` — E, 𝒢², 𝒟 and the energy ledger at every step;
* default: ``tp.simulate(...)`` then a read of ``traj.energy`` — the solve evaluates the field only and
           E, 𝒢², 𝒟 are computed from the records on that read, for ``record_every`` = 1 and 10.

It prints the process CPU time (``time.process_time``) of each, median and [min, max] over the
repeats, and the ratios to the tokens-only solve: what ``ledger=True`` costs and what the default
costs.  It also checks that the default's values equal the eager ones (largest relative difference).
The machine may be shared: the load average is printed; compare ratios from one run.

    python scripts/benchmark_lazy_diagnostics.py                     # both workloads, float64 and float32
    python scripts/benchmark_lazy_diagnostics.py --workload paper --steps 50 --repeats 3 --dtype float64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import transformer_pde as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_peers import problem  # noqa: E402  (the peers' workload, one definition)
from benchmark_reference_step import reference_setup  # noqa: E402  (the paper's workload)


def timed(fn):
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def workload(args, dtype):
    """(x0, theta, simulate keywords) of the chosen workload."""
    if args.workload == "peers":
        M, BF, V = problem(args.systems, args.tokens, args.dim, args.heads, dtype)
        steps, dt = args.steps or 100, 0.1
        return M, tp.Heads(BF, V), dict(t1=steps * dt, dt=dt, direction="ascent", layer_norm="post", progress=False)
    x0, heads = reference_setup(100, dtype=dtype)
    steps, dt = args.steps or 100, 5e-3
    theta = tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=2 ** 0.5)
    return x0, theta, dict(t1=steps * dt, dt=dt, direction="descent", paths=10, seed=0, progress=False)


def run(args, dtype):
    x0, theta, kw = workload(args, dtype)
    times = {"tokens": [], "eager": [], "default (every 1)": [], "default (every 10)": []}
    err = 0.0
    for _ in range(args.repeats):
        t, _ = timed(lambda: tp.simulate(x0, theta, diagnostics=False, **kw))
        times["tokens"].append(t)
        t, eager = timed(lambda: tp.simulate(x0, theta, ledger=True, **kw))
        times["eager"].append(t)
        for every in (1, 10):
            def default():
                traj = tp.simulate(x0, theta, record_every=every, **kw)
                traj.energy  # the first read computes E, 𝒢², 𝒟 of every record
                return traj
            t, lazy = timed(default)
            times[f"default (every {every})"].append(t)
            if every == 1:
                for key in ("energy", "slope", "dissipation"):
                    ref = getattr(eager, key)
                    err = max(err, float(((getattr(lazy, key) - ref).abs() / ref.abs().max()).max()))
    return times, err


def fmt(ts):
    return f"{statistics.median(ts):8.3f} s [{min(ts):.3f}, {max(ts):.3f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="number of steps (default 100)")
    ap.add_argument("--workload", choices=["peers", "paper", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float64", "float32", "both"], default="both")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"peers: {args.systems} systems x {args.tokens} tokens x d = {args.dim}, {args.heads} heads, post-LN; "
          f"paper: 200 tokens, H = 100, 10 OU paths; {args.steps or 100} steps; {args.threads} thread(s); "
          f"{args.repeats} interleaved repeats; load average {os.getloadavg()[0]:.2f}")
    print("CPU time: median [min, max] over the repeats")
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    workloads = ["peers", "paper"] if args.workload == "both" else [args.workload]
    for wl in workloads:
        args.workload = wl
        for name in dtypes:
            times, err = run(args, getattr(torch, name))
            tok = statistics.median(times["tokens"])
            print(f"\n{wl}, {name}")
            for key, ts in times.items():
                print(f"  {key:20s} {fmt(ts)}   / tokens = {statistics.median(ts) / tok:.2f}")
            print(f"  default vs eager values: largest difference / largest value = {err:.2e}")


if __name__ == "__main__":
    main()
