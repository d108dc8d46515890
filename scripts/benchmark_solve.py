"""Old against new: the particle solver before the composable core (commit 2bea6cf of this
repository) and this checkout's ``tp.simulate`` (a wrapper building Model / solver / options objects)
and ``tp.solve``, timed back to back in fresh interpreters with interleaved repeats.

Configurations (float64, Euler, every diagnostic on):

* ``reference`` — the paper's reference step: n = 200 octahedral tokens on S², H = 100 symmetric
  heads Z + Zᵀ, OU weights (mean I, rate 1, σ² = 2) on 10 Monte-Carlo paths, dt = 5·10⁻³;
* ``quick`` — the largest segment of experiments/ou_vs_oscillating_quick.toml: n = 64, H = 16,
  4 OU paths, dt = 0.01, record_every = 5.

The tree of COMMIT ("old") is extracted with ``git -C MAIN archive COMMIT transformer_pde`` into a temporary folder
and imported through PYTHONPATH in its own child process; each child times ``--inner`` solves
after one warm-up and reports the best per-step time.  The script prints, per configuration, the
per-step seconds of each side and the ratios new/old (median over the interleaved repeats).
Timings on a shared machine are noisy: compare the ratios of one run, not times across runs.

    python scripts/benchmark_solve.py                        # both configs, 3 interleaved repeats
    python scripts/benchmark_solve.py --configs quick --repeat 5 --main . --commit 2bea6cf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "reference": dict(n=200, H=100, paths=10, dt=5e-3, steps=10, record_every=1, octahedral=True),
    "quick": dict(n=64, H=16, paths=4, dt=0.01, steps=50, record_every=5, octahedral=True),
}

WORKER = r"""
import json, math, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import transformer_pde as tp
cfg, mode, inner = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[4])
x0 = tp.sphere.octahedral(cfg["n"], 3, dtype=torch.float64)
heads = tp.Heads.random(cfg["H"], 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
theta = tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=math.sqrt(2.0))
t1 = cfg["steps"] * cfg["dt"]
if mode == "solve":
    run = lambda: tp.solve(tp.Model(theta), x0, tp.Euler(), t1=t1, dt=cfg["dt"], paths=cfg["paths"], seed=0,
                           saveat=tp.SaveAt(record_every=cfg["record_every"]), ledger=tp.LedgerOptions(ledger=True),
                           progress=False)
else:
    run = lambda: tp.simulate(x0, theta, t1=t1, dt=cfg["dt"], paths=cfg["paths"], seed=0, method="euler",
                              record_every=cfg["record_every"], ledger=True, progress=False)
traj = run()
best = float("inf")
for _ in range(inner):
    t = time.perf_counter()
    traj = run()
    best = min(best, (time.perf_counter() - t) / cfg["steps"])
print(json.dumps({"per_step": best, "residual": float(traj.ledger["residual"][-1].abs().max()),
                  "x_sum": float(traj.x[-1].sum())}))
"""


def extract(main: str, commit: str, into: Path) -> Path:
    """The old transformer_pde of ``commit`` in ``main``, extracted under ``into``."""
    archive = into / "old.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", main, "archive", commit, "transformer_pde"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into)
    return into


def child(path: Path, cfg: dict, mode: str, threads: int, inner: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path))
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cfg), mode, str(threads), str(inner)],
                         env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeat", type=int, default=3, help="interleaved old/new repeats")
    ap.add_argument("--inner", type=int, default=2, help="timed solves per child (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--main", default=str(ROOT), help="the git checkout holding the old commit (default: this one)")
    ap.add_argument("--commit", default="2bea6cf", help="the commit of the old code path")
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()}, threads {args.threads}, old = {args.commit}, new = {ROOT}")
    with tempfile.TemporaryDirectory() as tmp:
        old = extract(args.main, args.commit, Path(tmp))
        for name in args.configs:
            cfg = CONFIGS[name]
            rows = {"old": [], "new simulate": [], "new solve": []}
            checks = {}
            for _ in range(args.repeat):
                for label, path, mode in (("old", old, "simulate"), ("new simulate", ROOT, "simulate"),
                                          ("new solve", ROOT, "solve")):
                    r = child(path, cfg, mode, args.threads, args.inner)
                    rows[label].append(r["per_step"])
                    checks[label] = (r["residual"], r["x_sum"])
            print(f"\n{name}: {cfg}")
            for label, v in rows.items():
                print(f"  {label:13s} per step {statistics.median(v) * 1e3:9.3f} ms  (runs {', '.join(f'{t * 1e3:.3f}' for t in v)})"
                      f"  residual {checks[label][0]:.3e}  Σx(t1) {checks[label][1]:.12f}")
            for label in ("new simulate", "new solve"):
                ratios = [n / o for n, o in zip(rows[label], rows["old"])]
                print(f"  ratio {label}/old: median {statistics.median(ratios):.3f} "
                      f"(per repeat {', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
