#!/usr/bin/env python
"""The paper's full configuration in float64 vs float32 tokens, side by side: time and headline numbers.

Runs ``experiments/ou_vs_oscillating.toml`` (or ``--config``) shortened to ``--t1`` (the time average
over the second half) with ``-o dtype="float64"`` and ``-o dtype="float32"``, alternating, ``--reps``
times each, every run through the command line in its own process (``workers`` as in the config, no
figures).  Prints, per dtype, the wall time and the CPU time (user + system of the run and its worker
processes) of every run, the ratios float64 / float32 of the medians, and the headline numbers of the
last pair: the fitted exponent b per regime (with the float64 run's bootstrap interval or OLS s.e.),
the largest relative difference of the per-path time averages of 𝒢², and of the final 𝒟-based
residuals.  Both dtypes step the weights in float64 from the same draws
(:class:`transformer_pde.application.studies.paper._PathSlice`), so the differences are rounding
carried along the trajectories, not another realisation of the noise.

    python scripts/benchmark_paper_dtype.py                    # t1 = 0.5 (100 steps), 2 pairs
    python scripts/benchmark_paper_dtype.py --t1 20 --reps 1   # the full horizon
    python scripts/benchmark_paper_dtype.py --config experiments/ou_vs_oscillating_quick.toml --t1 6

On a shared machine compare the ratios, not the absolute times (the load is printed with each run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float64", "float32")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(config: Path, dtype: str, t1: float, out: Path, name: str) -> dict:
    """One CLI run; its wall time, CPU time (with its worker processes), load average and metrics."""
    cmd = [sys.executable, "-m", "transformer_pde.application.cli", "run", str(config), "-o", f"t1={t1}",
           "-o", f"t_avg={t1 / 2}", "-o", "figures=false", "-o", f'dtype="{dtype}"', "--out", str(out),
           "--name", name, "--overwrite", "-q", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    c0, w0 = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - w0, _children_cpu() - c0
    return {"wall": wall, "cpu": cpu, "load": os.getloadavg()[0],
            "metrics": json.loads((out / name / "metrics.json").read_text())}


def compare(m64: dict, m32: dict) -> list:
    """The markdown table of every reported number (studies.paper_dtype.dtype_differences): float64, float32, the
    difference, the interval the run gives the number and their ratio."""
    sys.path.insert(0, str(ROOT))
    from transformer_pde.application.studies.paper_dtype import dtype_differences

    rows = dtype_differences(m64, m32)
    lines = ["| reported number | float64 | float32 | difference | interval width | difference / interval |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        w = r["interval"]
        ratio = "—" if w is None else f"{r['difference'] / w:.1e}"
        width = "—" if w is None else f"{w:.3g}"
        lines.append(f"| {r['name']} | {r['float64']:.7g} | {r['float32']:.7g} | {r['difference']:.2e} | {width} | "
                     f"{ratio} |")
    worst = max((r["difference"] / r["interval"] for r in rows if r["interval"]), default=float("nan"))
    rel = max((r["difference"] / max(abs(r["float64"]), 1e-300) for r in rows if not r["interval"]),
              default=float("nan"))
    lines += ["", f"largest difference / interval: {worst:.1e}; largest relative difference of a number without "
                  f"an interval: {rel:.1e}"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "experiments" / "ou_vs_oscillating.toml")
    ap.add_argument("--t1", type=float, default=0.5, help="final time of the shortened runs (default 0.5)")
    ap.add_argument("--reps", type=int, default=2, help="runs per dtype, alternating (default 2)")
    a = ap.parse_args(argv)
    res = {dt: [] for dt in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for dt in DTYPES:
                r = run_once(a.config, dt, a.t1, Path(tmp), f"{dt}_{rep}")
                res[dt].append(r)
                print(f"{dt} run {rep + 1}: wall {r['wall']:.1f} s, CPU {r['cpu']:.1f} s (load average "
                      f"{r['load']:.1f})", flush=True)
    wall = {dt: statistics.median(r["wall"] for r in res[dt]) for dt in DTYPES}
    cpu = {dt: statistics.median(r["cpu"] for r in res[dt]) for dt in DTYPES}
    print(f"median float64 / float32: wall {wall['float64'] / wall['float32']:.2f}x, "
          f"CPU {cpu['float64'] / cpu['float32']:.2f}x ({a.reps} run(s) each, {a.config.name}, t1 = {a.t1})")
    for line in compare(res["float64"][-1]["metrics"], res["float32"][-1]["metrics"]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
