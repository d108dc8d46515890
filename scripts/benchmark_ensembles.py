"""Time and peak memory of an ensemble of B small systems in one batched call vs B separate calls.

Each system: n tokens on S^{d-1}, H symmetric GOE heads (``tp.ensembles.random_heads``, V = A),
constant in time, softmax, Euler, ``steps`` steps, diagnostics off (tokens only) unless
``--diagnostics``.  For every B the script times

* batched:   ``tp.ensembles.simulate(x0 (B, n, d), heads (B, H, d, d))``   — one call;
* separate:  ``tp.simulate(x0[b], heads_b)`` for b = 1 … B                  — B calls
             (timed on min(B, --max-separate) members and scaled linearly to B),

and prints the seconds per system-step of each, their ratio (separate / batched: the speed-up of
batching), the peak memory of the batched call above the baseline, and the largest difference
between the batched and the separate tokens (must be rounding).  Peak memory: the CUDA
allocator's ``max_memory_allocated`` on CUDA; on CPU the resident-set growth sampled every
0.5 ms (re-executed with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks leave the resident set).

    python scripts/benchmark_ensembles.py                         # B = 16 … 4096, CPU (+ CUDA if present)
    python scripts/benchmark_ensembles.py --sizes 16 256 --device cpu --steps 10
    python scripts/benchmark_ensembles.py --device cuda --dtype float32

Timings on a shared machine are noisy (the load average is printed); compare ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and __name__ == "__main__":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

import transformer_pde as tp  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_field import PeakMemory  # noqa: E402  (one peak-memory meter for both benchmarks)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def setup(B, n, d, H, *, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = tp.ensembles.random_heads(B, H, d, law="goe", values="+A", generator=g, dtype=dtype).to(device)
    x0 = tp.ensembles.random_tokens(B, n, d, generator=g, dtype=dtype).to(device)
    return x0, heads


def run_case(B, args, device, dtype):
    x0, heads = setup(B, args.n, args.d, args.heads, dtype=dtype, device=device)
    kw = dict(t1=args.steps * args.dt, dt=args.dt, direction="ascent", diagnostics=args.diagnostics,
              ledger=args.diagnostics, record_every=args.steps)
    tp.ensembles.simulate(x0[:2], tp.Heads(heads.score[:2]), **kw)  # warm-up
    _sync(device)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        traj = tp.ensembles.simulate(x0, heads, **kw)
        _sync(device)
        t_batch = time.perf_counter() - t0
    m = min(B, args.max_separate)
    t0 = time.perf_counter()
    err = 0.0
    for b in range(m):
        one = tp.simulate(x0[b], tp.Heads(heads.score[b]), **kw)
        err = max(err, float((one.x[-1] - traj.x[-1, b]).abs().max()))
    _sync(device)
    t_sep = (time.perf_counter() - t0) * B / m
    return {"B": B, "batched_s": t_batch, "separate_s": t_sep, "ratio": t_sep / t_batch, "peak_bytes": mem.peak,
            "max_diff": err, "per_system_step_us": 1e6 * t_batch / (B * args.steps)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    ap.add_argument("--n", type=int, default=16, help="tokens per system")
    ap.add_argument("--d", type=int, default=3)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dt", type=float, default=0.05)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--device", nargs="+", default=None, help="cpu and/or cuda (default: cpu, and cuda if present)")
    ap.add_argument("--max-separate", type=int, default=64,
                    help="time at most this many separate calls and scale to B")
    ap.add_argument("--diagnostics", action="store_true", help="energy, slope and ledger on")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.2f}, {args.dtype}; "
          f"systems of n = {args.n} tokens on S^{args.d - 1}, H = {args.heads} GOE heads, {args.steps} Euler steps")
    rows = []
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            print("cuda: not available, skipped")
            continue
        print(f"\n{device}:")
        print(f"{'B':>6} {'batched s':>10} {'separate s':>11} {'separate/batched':>17} {'µs/system-step':>15} "
              f"{'peak MB':>8} {'max|Δx|':>9}")
        for B in args.sizes:
            r = run_case(B, args, device, dtype)
            r["device"] = device
            rows.append(r)
            print(f"{B:>6} {r['batched_s']:>10.3f} {r['separate_s']:>11.3f} {r['ratio']:>17.1f} "
                  f"{r['per_system_step_us']:>15.2f} {r['peak_bytes'] / 2**20:>8.1f} {r['max_diff']:>9.1e}",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
