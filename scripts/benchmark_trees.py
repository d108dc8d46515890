"""CPU time of the same solves on two checkouts of the library, side by side: a change's cost against its base.

    python scripts/benchmark_trees.py --base /path/to/other/checkout [--repeats 5] [--cases reference peers_same]

Each case runs in a fresh interpreter per tree (``PYTHONPATH`` set to the tree, one torch thread), after a
warm-up solve, and reports the process CPU time of the timed solve; the two trees alternate, repeat by
repeat, so that a change of the machine's load falls on both.  The script prints, per case, the median CPU
seconds of each tree and the median [range] of the per-repeat ratios (this tree / base).  Both trees must
accept the calls below (``tp.simulate`` with the keywords of DESIGN §4 and ``layer_norm=``).

Cases:

* ``reference``: the paper's reference step (n = 200 on S², H = 100 symmetric heads, OU weights, 10 paths,
  float64, Euler, dt = 5·10⁻³, every diagnostic), 10 steps;
* ``peers_same``: the peers' workload (256 systems × 32 tokens × d = 16, 8 heads, post-LN, 100 steps of 0.1,
  float64), no diagnostics, the pair-fraction statistic at every step;
* ``peers_obvious``: the same with every other argument at its default;
* ``small_heun``: 8 tokens on S², one head, 400 Heun steps (the per-step overhead of the run loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASE_CODE = r'''
import json, sys, time, torch
torch.set_num_threads(1)
import transformer_pde as tp
case = sys.argv[1]
g = torch.Generator().manual_seed(0)
if case == "reference":
    Z = torch.randn(100, 3, 3, generator=g, dtype=torch.float64)
    theta = tp.OrnsteinUhlenbeck(tp.Heads.symmetric(Z + Z.transpose(-1, -2)), mean=torch.eye(3, dtype=torch.float64),
                                 rate=1.0, sigma=2 ** 0.5)
    x0 = torch.nn.functional.normalize(torch.randn(200, 3, generator=g, dtype=torch.float64), dim=-1)
    call = lambda: tp.simulate(x0, theta, t1=0.05, dt=5e-3, method="euler", paths=10, seed=1, direction="descent")
elif case.startswith("peers"):
    B, n, d, H = 256, 32, 16, 8
    A = torch.randn(B, H, d, d, generator=g, dtype=torch.float64) / d ** 0.5
    V = torch.randn(B, H, d, d, generator=g, dtype=torch.float64) / d ** 0.5
    heads = tp.Heads(A, V)
    x0 = torch.nn.functional.normalize(torch.randn(B, n, d, generator=g, dtype=torch.float64), dim=-1)
    kw = dict(t1=10.0, dt=0.1, direction="ascent", layer_norm="post")
    if case == "peers_same":
        kw.update(diagnostics=False, observables={"pair_fraction": tp.clustering.pair_fraction_observable(eps=1e-3)})
    call = lambda: tp.simulate(x0, heads, **kw)
elif case == "small_heun":
    heads = tp.Heads.scalar([1.0], 3).to(torch.float64)
    x0 = torch.nn.functional.normalize(torch.randn(8, 3, generator=g, dtype=torch.float64), dim=-1)
    call = lambda: tp.simulate(x0, heads, t1=4.0, dt=0.01, method="heun")
else:
    raise SystemExit(f"unknown case {case}")
call()
t = time.process_time()
call()
print(json.dumps({"cpu": time.process_time() - t}))
'''

CASES = ("reference", "peers_same", "peers_obvious", "small_heun")


def run(tree: Path, case: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "TP_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CASE_CODE, case], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{case} failed in {tree}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (its root, holding transformer_pde/)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = ap.parse_args(argv)
    if not (args.base / "transformer_pde" / "__init__.py").is_file():
        ap.error(f"--base {args.base} holds no transformer_pde/ package: give the root of a checkout")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"this tree {ROOT} against {args.base.resolve()}; {os.cpu_count()} CPUs, load average {load:.1f} at the "
          f"start; process CPU seconds, one thread, {args.repeats} alternating repeats")
    print("| case | this tree (median s) | base (median s) | ratio this / base, median [range] |")
    print("| --- | --- | --- | --- |")
    for case in args.cases:
        ours, base = [], []
        for _ in range(args.repeats):
            ours.append(run(ROOT, case))
            base.append(run(args.base, case))
        ratios = [o / b for o, b in zip(ours, base)]
        print(f"| {case} | {statistics.median(ours):.3f} | {statistics.median(base):.3f} | "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |", flush=True)
    end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {end:.1f} at the end")


if __name__ == "__main__":
    main()
