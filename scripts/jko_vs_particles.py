#!/usr/bin/env python
"""JKO vs particles: run the comparison and print its convergence tables.

A thin wrapper around ``transformer-pde run experiments/jko_vs_particles[_quick].toml``; the
other arguments pass through (``-o key=value``, ``--resume``, ``--out``, ``--name``,
``--no-progress``).  The figure (descent) is written to ``<out>/<name>/figures/``.

    python scripts/jko_vs_particles.py quick                 # ~2 minutes on 2 cores
    python scripts/jko_vs_particles.py full                  # S², n = 32, H = 3, t1 = 1
    python scripts/jko_vs_particles.py full -o process=\\"ou\\" --name jko_ou   # the noisy OU path
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = {"quick": "jko_vs_particles_quick.toml", "full": "jko_vs_particles.toml"}


def _table(path: Path) -> str:
    rows = list(csv.reader(path.read_text().splitlines()))
    if not rows:
        return ""
    head, body = rows[0], rows[1:]
    fmt = lambda v: f"{float(v):.4g}" if v not in ("", None) else ""  # noqa: E731
    lines = ["  ".join(f"{h:>24s}" for h in head)]
    lines += ["  ".join(f"{fmt(v):>24s}" for v in r) for r in body]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in EXPERIMENTS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from transformer_pde.application.cli import main as cli_main

    which, rest = argv[0], argv[1:]
    rc = cli_main(["run", str(ROOT / "experiments" / EXPERIMENTS[which]), *rest])
    if rc != 0:
        return rc
    out = Path(rest[rest.index("--out") + 1]) if "--out" in rest else Path("runs")
    name = rest[rest.index("--name") + 1] if "--name" in rest else Path(EXPERIMENTS[which]).stem
    run = out / name
    for series in ("tau_convergence", "n_convergence", "eps_convergence"):
        p = run / "series" / f"{series}.csv"
        if p.exists():
            print(f"\n{series}:\n{_table(p)}")
    m = json.loads((run / "metrics.json").read_text())
    slopes = {k: v for k, v in m.items() if "slope" in k}
    print("\nfitted slopes: " + ", ".join(f"{k} = {v:.3f}" for k, v in slopes.items()))
    print(f"largest energy-inequality defect (must be <= 0): {m['max_energy_defect']:.3e}")
    print(f"figure: {run / 'figures' / 'jko_vs_particles.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
