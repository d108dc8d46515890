"""Positional attention (ALiBi, the kinetic decay, a user's position kernel) against plain causal attention,
measured side by side in one run.

Paired, interleaved CPU-time ratios (median of ``--repeats`` pairs [min, max]) of one field evaluation,
``tp.velocity(x, heads, normalization=..., causal=bias)`` over ``tp.velocity(..., causal=True)``, for n tokens
in a batch of systems (default: 8 systems, d = 3, H = 4 symmetric heads; and the circle workload of the
lost-in-the-middle study: d = 2, H = 1, the "unnormalized" kernel).  The plain causal field runs the library's
fastest causal kernels (the one-block kernel for n <= 512, the log-sum-exp kernels above); the positional
field runs its own block kernel over the causal prefix (:mod:`transformer_pde.model.positional`).  A second
table times the gradient of a scalar of the field with respect to x (autograd; the positional kernel
recomputes its blocks in the backward pass, so its memory stays O(n) per block).

The header prints the load average, the torch thread count and the CPU.

    python scripts/benchmark_positional.py
    python scripts/benchmark_positional.py --sizes 256 1024 --repeats 7 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402


def cpu_time(fn, calls):
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls


def paired(base, variants, repeats, calls):
    """{name: ([ratio per pair], base seconds)}: each variant timed right after the baseline, interleaved."""
    base()
    for fn in variants.values():
        fn()
    out = {k: [] for k in variants}
    tbase = []
    for _ in range(repeats):
        for k, fn in variants.items():
            tb = cpu_time(base, calls)
            tbase.append(tb)
            out[k].append(cpu_time(fn, calls) / tb)
    return out, statistics.median(tbase)


def _calls(n, batch):
    return max(1, int(2e6 // (batch * n * n)))


def workloads(dtype):
    g = torch.Generator().manual_seed(0)
    heads = tp.Heads.random(4, 3, generator=g, dtype=torch.float64).to(dtype)
    circle = tp.Heads(torch.eye(2, dtype=dtype)[None], 2.0 * torch.eye(2, dtype=dtype)[None], beta=2.0)
    return (("d=3, H=4, softmax", 3, heads, "softmax"), ("d=2, H=1, unnormalized", 2, circle, "unnormalized"))


def biases(H):
    return {"ALiBi (one slope)": tp.ALiBi(0.05),
            f"ALiBi.geometric({H})": tp.ALiBi.geometric(H) if H > 1 else tp.ALiBi(0.05),
            "KineticDecay(1, strict)": tp.KineticDecay(1.0, strict=True),
            "PositionKernel (power law)": tp.PositionKernel(lambda p, q: (1.0 + p - q) ** -1.5)}


def field_table(sizes, batch, repeats, dtype):
    print(f"\n1. one field evaluation, {batch} systems, {str(dtype).replace('torch.', '')}: "
          f"positional / causal=True   (causal=True's time in ms)")
    for label, d, heads, norm in workloads(dtype):
        print(f"  {label}")
        for n in sizes:
            x = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
            x = x.to(dtype).expand(batch, n, d).contiguous()
            base = lambda: tp.velocity(x, heads, normalization=norm, causal=True)  # noqa: E731
            variants = {k: (lambda b=b: tp.velocity(x, heads, normalization=norm, causal=b))
                        for k, b in biases(heads.num_heads).items()}
            ratios, tb = paired(base, variants, repeats, _calls(n, batch))
            for k, r in ratios.items():
                print(f"    n={n:5d}  {k:28s} {statistics.median(r):5.2f}  [{min(r):.2f}, {max(r):.2f}]"
                      f"   ({1e3 * tb:.2f} ms)")


def gradient_table(sizes, batch, repeats, dtype):
    print(f"\n2. field + backward (gradient of Σ ⟨V, r⟩ in x), {batch} systems, {str(dtype).replace('torch.', '')}: "
          f"positional / causal=True")
    label, d, heads, norm = workloads(dtype)[1]
    print(f"  {label}")
    for n in sizes:
        x0 = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        x0 = x0.to(dtype).expand(batch, n, d).contiguous()
        r = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)

        def run(causal):
            x = x0.clone().requires_grad_(True)
            (tp.velocity(x, heads, normalization=norm, causal=causal) * r).sum().backward()

        ratios, tb = paired(lambda: run(True), {"KineticDecay(1, strict)": lambda: run(tp.KineticDecay(1.0, strict=True))},
                            repeats, _calls(n, batch))
        for k, rr in ratios.items():
            print(f"    n={n:5d}  {k:28s} {statistics.median(rr):5.2f}  [{min(rr):.2f}, {max(rr):.2f}]"
                  f"   ({1e3 * tb:.2f} ms)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--batch", type=int, default=8, help="systems per evaluation")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"positional attention vs plain causal attention; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("ratio < 1: the positional field is cheaper (its kernel visits only the causal prefix)")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        field_table(args.sizes, args.batch, args.repeats, dtype)
        gradient_table(args.sizes, args.batch, args.repeats, dtype)


if __name__ == "__main__":
    main()
