"""Cost of one field evaluation against the machine's limit: time and memory as n grows from 10² to 10⁵ tokens.

For d ∈ {3, 16}, H ∈ {1, 10} softmax heads (``tp.Heads.random``, β = 1) and float32 / float64 tokens on the
sphere, it times one ``transformer_pde.model.field.evaluate(x, heads, diagnostics=False)`` (the velocity field
at every token: the library's default kernel for that size, one torch thread unless ``--threads``), best of
``--repeats``, at n = 10², 10^2.5, …, 10⁵.  Above ``--full-max`` tokens the field is evaluated at ``--rows``
query tokens against all n keys (``evaluate(x[:m], heads, keys=x)``) and the time is scaled by n/m: every query
row of the kernel costs the same O(n·H·d), so this measures the full evaluation's per-row cost without
paying n² at the top (marked "rows" in the table).

In the same run it measures the CPU's own limits, one thread: the rate of a dense matrix product
(``torch.mm`` of 1024 × 1024 matrices, GFLOP/s) and the time of ``torch.exp2`` per element on data in cache.
Each evaluation is credited with 4·n²·H·d floating-point operations (the score ⟨q_i, k_j⟩ and the weighted
sum of the values, 2d each per pair and head: the arithmetic of an O(n²d) kernel), so

    fraction = (4·n²·H·d / time) / (dense product rate)

is how close the evaluation comes to the floor that the matrix unit sets (times are process CPU time); ``exp share`` = n²·H·(exp time per
element) / time is the part of the time one exponential per score takes at least.  Memory: the peak resident
memory of the process during the evaluation above what it held before (Linux: ``/proc/self/clear_refs`` resets
the peak, ``VmHWM`` reads it; "—" elsewhere), at the full size only.  The fitted exponents are least-squares
slopes of log time and log memory against log n over n ≥ 3·10³ (below, fixed costs per call count).

    python scripts/benchmark_scaling.py                          # the whole grid, a few minutes
    python scripts/benchmark_scaling.py --dims 3 --heads 1 --dtypes float64 --max-n 1e4
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402
from transformer_pde.model.field import evaluate  # noqa: E402
from transformer_pde.utils import hardware  # noqa: E402


def _status(key: str):
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def best_time(fn, repeats: int) -> float:
    """The best CPU time of ``repeats`` calls (process CPU time: other jobs on a shared machine change it less
    than the wall time; with one torch thread it is the kernel's own time)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _trim():
    """Give freed heap memory back to the system (glibc ``malloc_trim``), so that the next evaluation's
    memory shows in the resident set; a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def matmul_rate(dtype, size=1024, repeats=5) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    return 2 * size ** 3 / best_time(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def exp_time(dtype, size=2 ** 15, repeats=200) -> float:
    x = torch.rand(size, dtype=dtype) - 0.5
    y = torch.empty_like(x)
    return best_time(lambda: torch.exp2(x, out=y), repeats) / size


def point(n: int, d: int, H: int, dtype, args):
    g = torch.Generator().manual_seed(n + 7 * d + 13 * H)
    x = tp.sphere.sample_uniform(n, d, generator=g, dtype=dtype)
    heads = tp.Heads.random(H, d, generator=g, dtype=dtype)
    rows = n if n <= args.full_max else min(n, args.rows)
    q = x if rows == n else x[:rows]

    def run():
        return evaluate(q, heads, None, diagnostics=False, keys=None if rows == n else x).velocity

    t = best_time(run, args.repeats) * (n / rows)
    mem = None
    if rows == n:
        _trim()
        before = _status("VmRSS")
        if before is not None and _reset_peak():
            run()
            peak = _status("VmHWM")
            mem = None if peak is None else max(0, peak - before)
    return t, mem, rows


def fit(ns, vs):
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, vs) if n >= 3000 and v]
    if len(pts) < 2:
        return float("nan")
    X, Y = np.array(pts).T
    return float(np.polyfit(X, Y, 1)[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 16])
    ap.add_argument("--heads", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    ap.add_argument("--min-n", type=float, default=1e2)
    ap.add_argument("--max-n", type=float, default=1e5)
    ap.add_argument("--per-decade", type=int, default=2, help="points per decade of n")
    ap.add_argument("--full-max", type=float, default=1e4, help="above this n: sampled query rows, time scaled")
    ap.add_argument("--rows", type=int, default=1000, help="query rows of the sampled points")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k = args.per_decade
    exps = np.arange(round(k * math.log10(args.min_n)), round(k * math.log10(args.max_n)) + 1) / k
    ns = sorted({int(round(10 ** e)) for e in exps})
    c = hardware.cache_sizes()
    load0 = os.getloadavg()
    head = (f"CPU {hardware.cpu_model()!r}, {os.cpu_count()} CPUs, L1d {c.l1d // 1024} KiB, L2 {c.l2 // 1024} KiB, "
            f"L3 {'?' if c.l3 is None else c.l3 // 1024 ** 2} MiB; torch {torch.__version__}, {args.threads} "
            f"thread(s); load average {load0[0]:.2f} at the start")
    print(head)
    limits = {}
    for name in args.dtypes:
        dt = getattr(torch, name)
        limits[name] = (matmul_rate(dt), exp_time(dt))
        print(f"{name}: dense product {limits[name][0]:.1f} GFLOP/s (1024², one thread); exp2 "
              f"{limits[name][1] * 1e9:.2f} ns per element (in cache)")
    tables, fits = [], []
    for name in args.dtypes:
        dt = getattr(torch, name)
        rate, t_exp = limits[name]
        for d in args.dims:
            for H in args.heads:
                times, mems = [], []
                lines = [f"\n{name}, d = {d}, H = {H}:", "",
                         "| n | time s | memory MiB | GFLOP/s | fraction of the dense product | exp share |",
                         "| --- | --- | --- | --- | --- | --- |"]
                for n in ns:
                    t, mem, rows = point(n, d, H, dt, args)
                    flops = 4.0 * n * n * H * d
                    times.append(t)
                    mems.append(mem)
                    tag = "" if rows == n else f" ({rows} rows)"
                    lines.append(f"| {n}{tag} | {t:.3g} | {'—' if mem is None else f'{mem / 2 ** 20:.1f}'} | "
                                 f"{flops / t / 1e9:.2f} | {flops / t / 1e9 / rate:.3f} | "
                                 f"{n * n * H * t_exp / t:.2f} |")
                    print(lines[-1], flush=True)
                fits.append((name, d, H, fit(ns, times), fit([n for n, m in zip(ns, mems) if m], [m for m in mems if m]),
                             flops / times[-1] / 1e9 / rate))
                tables.append("\n".join(lines))
    load1 = os.getloadavg()
    print("\n" + head + f"; {load1[0]:.2f} at the end")
    print("\ndense product: " + ", ".join(f"{k} {v[0]:.1f} GFLOP/s" for k, v in limits.items()) + "; exp2: "
          + ", ".join(f"{k} {v[1] * 1e9:.2f} ns" for k, v in limits.items()))
    print("\n| dtype | d | H | time exponent (n ≥ 3·10³) | memory exponent | fraction at the largest n |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, d, H, te, me, fr in fits:
        print(f"| {name} | {d} | {H} | {te:.2f} | {me:.2f} | {fr:.3f} |")
    for t in tables:
        print(t)


if __name__ == "__main__":
    main()
