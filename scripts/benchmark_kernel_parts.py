"""The parts of the layer maps' fused pass on this CPU: the exponential, the products by layout, the block size.

Prints, one torch thread, process CPU time, best of ``--repeats``:

1. ``torch.exp`` against ``torch.exp2`` per element on data in the cache (32 Ki elements) and on 2 Mi elements,
   float32 and float64: why the fused passes fold log₂e into the queries and take exp2;
2. the rate (GFLOP/s) of ``torch.bmm`` for the products of the peers' workload (16 systems per call,
   n = 32 tokens, d = 16, H = 8) in the "queries" layout (outputs of d = 16 columns for the means and the
   update) and the "keys" layout (scores and means with n·H = 256 columns, the update transposed with n),
   and of a 1024² ``torch.mm``:
   why float64 takes the keys layout (``transformer_pde.dynamics.layernorm.LAYOUTS``);
3. one ``FusedUpdate`` call on the peers' workload (256 systems, H = 8 and H = 1) for score blocks of
   1/8 … 4 × the L2 size and both layouts, relative to the library's default: where the block rule
   (``SCORE_BLOCK_FRACTION`` of the detected L2) lands.

    python scripts/benchmark_kernel_parts.py
    python scripts/benchmark_kernel_parts.py --repeats 9 --dtypes float64
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402
from transformer_pde.dynamics import layernorm  # noqa: E402
from transformer_pde.utils import hardware  # noqa: E402


def best(fn, repeats, inner=1):
    fn()
    t_best = math.inf
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(inner):
            fn()
        t_best = min(t_best, (time.process_time() - t) / inner)
    return t_best


def exp_table(dtypes, repeats):
    lines = ["| dtype | elements | exp ns/element | exp2 ns/element | exp / exp2 |", "| --- | --- | --- | --- | --- |"]
    for name in dtypes:
        dt = getattr(torch, name)
        for size in (2 ** 15, 2 ** 21):
            x = torch.rand(size, dtype=dt) - 0.5
            y = torch.empty_like(x)
            inner = max(1, 2 ** 22 // size)
            te = best(lambda: torch.exp(x, out=y), repeats, inner) / size * 1e9
            t2 = best(lambda: torch.exp2(x, out=y), repeats, inner) / size * 1e9
            lines.append(f"| {name} | {size} | {te:.2f} | {t2:.2f} | {te / t2:.2f} |")
    return "\n".join(lines)


def gemm_table(dtypes, repeats):
    B, n, d, H = 16, 32, 16, 8
    shapes = [("queries: Q = X·[βA_h] (n × d)(d × H·d)", (n, d, H * d), False),
              ("queries: scores Q·Xᵀ (n·H × d)(d × n)", (n * H, d, n), False),
              ("queries: means E·X (n·H × n)(n × d)", (n * H, n, d), False),
              ("queries: update (n × H·d)(H·d × d)", (n, H * d, d), False),
              ("keys: scores X·Qᵀ (n × d)(d × n·H)", (n, d, n * H), True),
              ("keys: means Xᵀ·Eᵀ (d × n)(n × n·H)", (d, n, n * H), False),
              ("keys: update, transposed (d × H·d)(H·d × n)", (d, H * d, n), False)]
    names = list(dtypes)
    lines = ["| product, 16 systems per call | " + " | ".join(f"{k} GFLOP/s" for k in names) + " |",
             "| --- |" + " --- |" * len(names)]
    rows = {label: [] for label, *_ in shapes}
    rows["torch.mm 1024 × 1024"] = []
    for name in names:
        dt = getattr(torch, name)
        for label, (m, k, N), bt in shapes:
            a = torch.randn(B, m, k, dtype=dt)
            b = torch.randn(B, N, k, dtype=dt).transpose(1, 2) if bt else torch.randn(B, k, N, dtype=dt)
            o = torch.empty(B, m, N, dtype=dt)
            rows[label].append(2 * B * m * k * N / best(lambda: torch.bmm(a, b, out=o), repeats, 20) / 1e9)
        a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
        o = torch.empty(1024, 1024, dtype=dt)
        rows["torch.mm 1024 × 1024"].append(2 * 1024 ** 3 / best(lambda: torch.mm(a, b, out=o), repeats) / 1e9)
    for label, v in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{r:.1f}" for r in v) + " |")
    return "\n".join(lines)


def block_table(dtypes, repeats):
    B, n, d = 256, 32, 16
    l2 = hardware.cache_sizes().l2
    fractions = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0]
    lines = ["| dtype, heads, layout | default block | " + " | ".join(f"{f:g} L2" for f in fractions) + " |",
             "| --- | --- |" + " --- |" * len(fractions)]
    old_layouts = dict(layernorm.LAYOUTS)
    try:
        for name in dtypes:
            dt = getattr(torch, name)
            for H in (8, 1):
                g = torch.Generator().manual_seed(H)
                x = torch.nn.functional.normalize(torch.randn(B, n, d, generator=g, dtype=dt), dim=-1)
                A = torch.randn(B, H, d, d, generator=g, dtype=dt) / 4
                V = torch.randn(B, H, d, d, generator=g, dtype=dt) / 4
                heads = tp.Heads(A, V, weights=torch.full((H,), 1.0 / H, dtype=dt))
                for layout in ("queries", "keys"):
                    layernorm.LAYOUTS.clear()
                    layernorm.LAYOUTS[dt] = layout
                    fu = layernorm.FusedUpdate(None, 1.0)
                    times = []
                    for nb in [None] + [int(f * l2) for f in fractions]:
                        layernorm._SCORE_BLOCK_BYTES = nb
                        times.append(best(lambda: fu(x, heads), repeats, 3))
                    layernorm._SCORE_BLOCK_BYTES = None
                    mark = " (the default)" if old_layouts.get(dt, "queries") == layout else ""
                    lines.append(f"| {name}, H = {H}, {layout}{mark} | {times[0] * 1e3:.2f} ms | "
                                 + " | ".join(f"{t / times[0]:.2f}" for t in times[1:]) + " |")
    finally:
        layernorm.LAYOUTS.clear()
        layernorm.LAYOUTS.update(old_layouts)
        layernorm._SCORE_BLOCK_BYTES = None
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    c = hardware.cache_sizes()
    load0 = os.getloadavg()[0]
    parts = [exp_table(args.dtypes, args.repeats), gemm_table(args.dtypes, args.repeats),
             block_table(args.dtypes, args.repeats)]
    print(f"CPU {hardware.cpu_model()!r}, L1d {c.l1d // 1024} KiB, L2 {c.l2 // 1024} KiB per core, L3 "
          f"{'?' if c.l3 is None else c.l3 // 1024 ** 2} MiB; torch {torch.__version__}, one thread; load average "
          f"{load0:.2f} → {os.getloadavg()[0]:.2f}; process CPU time, best of {args.repeats}")
    titles = ["1. the exponential", "2. the products (bmm rate by layout)",
              f"3. one FusedUpdate call (256 × 32 tokens, d = 16), time with the default block "
              f"({layernorm.SCORE_BLOCK_FRACTION:g} L2) and relative to it by block size"]
    for title, p in zip(titles, parts):
        print(f"\n{title}:\n\n{p}")


if __name__ == "__main__":
    main()
