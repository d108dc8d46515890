#!/usr/bin/env python
"""Reproduce the paper's OU-vs-oscillating experiments (Massucco et al. 2026, Section 6).

A thin wrapper around ``transformer-pde run``: picks the config of an experiment and passes
the other arguments through (``-o key=value``, ``--resume``, ``--out``, ``--name``,
``--no-progress``).

    python scripts/reproduce_paper.py quick            # ~1 minute on 2 cores
    python scripts/reproduce_paper.py full             # S², H = 1, 10, 100, 10 paths, T = 20 (the paper)
    python scripts/reproduce_paper.py s2_ou -o paths=20
    python scripts/reproduce_paper.py s2_oscillating -o phase=per_head --name s2_osc_per_head
    python scripts/reproduce_paper.py s1 | hd
    python scripts/reproduce_paper.py full --resume    # after an interruption
    python scripts/reproduce_paper.py quick -o animate=true   # also figures/tokens.gif (OU vs oscillating)
    python scripts/reproduce_paper.py all              # full, s1 and hd one after the other
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = {
    "quick": "ou_vs_oscillating_quick.toml",
    "full": "ou_vs_oscillating.toml",
    "s2_ou": "s2_ou.toml",
    "s2_oscillating": "s2_oscillating.toml",
    "s1": "s1_ou_vs_oscillating.toml",
    "hd": "hd_ou_vs_oscillating.toml",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*EXPERIMENTS, "all"):
        print(__doc__)
        print("experiments: " + ", ".join([*EXPERIMENTS, "all"]))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from transformer_pde.application.cli import main as cli_main

    which, rest = argv[0], argv[1:]
    names = ["full", "s1", "hd"] if which == "all" else [which]
    for name in names:
        rc = cli_main(["run", str(ROOT / "experiments" / EXPERIMENTS[name]), *rest])
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
