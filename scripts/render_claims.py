#!/usr/bin/env python
"""Turn the ``claims`` of run directories' metrics.json into markdown tables (for docs/theorems.md and
docs/noisy_tokens.md, so that the quoted numbers come from the runs, not from typing).

    python scripts/render_claims.py runs/theorem_stability_data_quick runs/noisy_transition_quick
    python scripts/render_claims.py --digits 3 runs/theorem_stability_weights

Each run gives a heading (its name and config kind) and a table: claim | value ± error | seeds | reference |
holds.  A run without claims is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer_pde.application.studies.claims import render_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.json)")
    ap.add_argument("--digits", type=int, default=4, help="significant digits")
    args = ap.parse_args(argv)
    status = 0
    for run in args.runs:
        path = run / "metrics.json"
        if not path.exists():
            print(f"{run}: no metrics.json", file=sys.stderr)
            status = 1
            continue
        claims = json.loads(path.read_text()).get("claims")
        if not claims:
            print(f"{run}: no claims in metrics.json", file=sys.stderr)
            status = 1
            continue
        print(f"**{run.name}**\n")
        print(render_table(claims, args.digits))
        print()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
