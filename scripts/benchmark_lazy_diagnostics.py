"""CPU time of E, 𝒢², 𝒟 computed at the recorded times after a solve vs at every step during it.

Workload of the peers' simulators (scripts/benchmark_peers.py): 256 systems × 32 tokens × d = 16,
8 heads with random Gaussian score and value matrices per system, softmax, β = 1, post-LN, ascent,
100 steps of Δt = 0.1.  Timed side by side, interleaved, ``--repeats`` times:

* tokens:  ``tp.simulate(..., diagnostics=False)`` — the tokens only;
* eager:   ``tp.simulate(..., diagnostics=True)`` — E, 𝒢², 𝒟 and the energy ledger at every step;
* lazy:    the E, 𝒢², 𝒟 of every record of the tokens-only run, computed after it from the records
           (:class:`transformer_pde.solvers.recorded.RecordedDiagnostics`, records folded into the batch,
           chunks within the solve's memory cap), for ``record_every`` = 1 (101 records) and 10 (11 records).

It prints the process CPU time (``time.process_time``) of each, median and [min, max] over the
repeats, and the ratios eager / tokens and (tokens + lazy) / tokens: what the obvious call costs today
and what it costs when the diagnostics are computed at the records only, on first read.  It also checks
that the lazy values equal the eager ones (largest relative difference).  The machine may be shared:
the load average is printed; compare ratios from one run.

    python scripts/benchmark_lazy_diagnostics.py                     # float64 and float32, 1 thread
    python scripts/benchmark_lazy_diagnostics.py --systems 64 --repeats 3 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import transformer_pde as tp
from transformer_pde.solvers.recorded import RecordedDiagnostics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_peers import problem  # noqa: E402  (the peers' workload, one definition)


def timed(fn):
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def run(args, dtype):
    M, BF, V = problem(args.systems, args.tokens, args.dim, args.heads, dtype)
    heads = tp.Heads(BF, V)
    kw = dict(t1=args.steps * args.dt, dt=args.dt, direction="ascent", layer_norm="post", progress=False)
    model = tp.Model(heads, direction="ascent", geometry="post")
    times = {"tokens": [], "eager": [], "lazy (every 1)": [], "lazy (every 10)": []}
    err = 0.0
    for _ in range(args.repeats):
        t, tok = timed(lambda: tp.simulate(M, heads, diagnostics=False, **kw))
        times["tokens"].append(t)
        t, eager = timed(lambda: tp.simulate(M, heads, diagnostics=True, **kw))
        times["eager"].append(t)
        t, lazy = timed(lambda: RecordedDiagnostics(model, tok.x, heads)())
        times["lazy (every 1)"].append(t)
        tok10 = tp.simulate(M, heads, diagnostics=False, record_every=10, **kw)
        t, _ = timed(lambda: RecordedDiagnostics(model, tok10.x, heads)())
        times["lazy (every 10)"].append(t)
        for key in ("energy", "slope", "dissipation"):
            ref = getattr(eager, key)
            err = max(err, float(((lazy[key] - ref).abs() / ref.abs().max()).max()))
    return times, err


def fmt(ts):
    return f"{statistics.median(ts):8.3f} s [{min(ts):.3f}, {max(ts):.3f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dt", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float64", "float32", "both"], default="both")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.systems} systems x {args.tokens} tokens x d = {args.dim}, {args.heads} heads, {args.steps} steps, "
          f"post-LN; {args.threads} thread(s); {args.repeats} interleaved repeats; load average "
          f"{os.getloadavg()[0]:.2f}")
    print("CPU time: median [min, max] over the repeats")
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    for name in dtypes:
        times, err = run(args, getattr(torch, name))
        tok = statistics.median(times["tokens"])
        print(f"\n{name}")
        for key, ts in times.items():
            print(f"  {key:16s} {fmt(ts)}")
        eager = statistics.median(times["eager"])
        print(f"  eager / tokens                     = {eager / tok:.2f}")
        for key in ("lazy (every 1)", "lazy (every 10)"):
            lz = statistics.median(times[key])
            print(f"  (tokens + {key}) / tokens  = {(tok + lz) / tok:.2f};  eager / (tokens + {key}) = "
                  f"{eager / (tok + lz):.2f}")
        print(f"  lazy vs eager values: largest difference / largest value = {err:.2e}")


if __name__ == "__main__":
    main()
