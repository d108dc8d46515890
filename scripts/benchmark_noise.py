"""Cost of the token noise per step: simulate(temperature=T) against the noiseless step, side by side.

    python scripts/benchmark_noise.py [--n 512] [--d 3] [--heads 4] [--paths 4] [--steps 40] [--repeats 5]

Interleaved repeats (noiseless, noisy, noiseless, …), best of each; prints the ratio (target ≤ 1.2×),
the torch thread count and the load average (the machine may be shared).
"""

import argparse
import os
import time

import torch

import transformer_pde as tp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--d", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--paths", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--diagnostics", action="store_true", help="also time the ledger (with its noise terms)")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x0 = tp.sphere.sample_uniform(a.n, a.d, generator=g, dtype=torch.float64)
    heads = tp.Heads.random(a.heads, a.d, generator=g, dtype=torch.float64)
    kw = dict(t1=a.steps * 0.01, dt=0.01, paths=a.paths, diagnostics=a.diagnostics, ledger=a.diagnostics,
              record_every=a.steps)
    best = {0.0: float("inf"), 0.1: float("inf")}
    tp.simulate(x0, heads, temperature=0.1, **{**kw, "t1": 0.02})  # warm-up
    for _ in range(a.repeats):
        for T in best:
            t = time.perf_counter()
            tp.simulate(x0, heads, temperature=T, **kw)
            best[T] = min(best[T], time.perf_counter() - t)
    per0, per1 = best[0.0] / a.steps, best[0.1] / a.steps
    print(f"n={a.n} d={a.d} H={a.heads} paths={a.paths} steps={a.steps} diagnostics={a.diagnostics} "
          f"threads={torch.get_num_threads()} loadavg={os.getloadavg()[0]:.2f}")
    print(f"noiseless {per0 * 1e3:.3f} ms/step, noisy {per1 * 1e3:.3f} ms/step, ratio {per1 / per0:.3f} "
          f"(target <= 1.2)")


if __name__ == "__main__":
    main()
