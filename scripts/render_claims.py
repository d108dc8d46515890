#!/usr/bin/env python
"""Turn the ``claims`` of run directories' metrics.json into markdown tables (for docs/theorems.md,
docs/noisy_tokens.md and the frontier pages, so that the quoted numbers come from the runs, not from typing).

    python scripts/render_claims.py runs/theorem_stability_data_quick runs/noisy_transition_quick
    python scripts/render_claims.py --digits 3 runs/theorem_stability_weights
    python scripts/render_claims.py runs/theorem_stability_data_quick --write docs/theorems.md \\
        --section theorem_stability_data_quick

Each run gives a heading (its name and config kind) and a table: claim | value ± error | seeds | reference |
holds.  A run without claims is reported and skipped.

``--write PAGE --section NAME`` (one run) replaces what stands between ``<!-- claims:NAME:start -->`` and
``<!-- claims:NAME:end -->`` on the page with the run's table under a ``table-source`` marker: the run's kind
and the ``code_fingerprint`` its metrics.json recorded (transformer_pde.application.studies.provenance), which
``tests/test_docs_provenance.py`` compares with the code of today's tree.  A run without a fingerprint (made
by a version that did not record one) is refused: rerun it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer_pde.application.studies.claims import render_table  # noqa: E402
from transformer_pde.application.studies.provenance import marker, write_section  # noqa: E402


def _read(run: Path):
    """(metrics, config) of a run directory; ValueError naming what is missing."""
    path = run / "metrics.json"
    if not path.exists():
        raise ValueError(f"{run}: no metrics.json")
    metrics = json.loads(path.read_text())
    if not metrics.get("claims"):
        raise ValueError(f"{run}: no claims in metrics.json")
    cfg_path = run / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return metrics, cfg


def section(run: Path, digits: int) -> str:
    """The marked table of one run: the table-source marker, then the claims table (newline-terminated)."""
    metrics, cfg = _read(run)
    code, kind = metrics.get("code_fingerprint"), cfg.get("kind")
    if not code or not kind:
        raise ValueError(f"{run}: metrics.json has no code_fingerprint (or config.json no kind): the run was made by "
                         f"a version that did not record the code it ran; rerun it to publish its table")
    return f"{marker(kind, code, run.name)}\n{render_table(metrics['claims'], digits)}\n"


def write(page: Path, name: str, text: str) -> None:
    """Replace the page's ``<!-- claims:NAME:start -->`` … ``<!-- claims:NAME:end -->`` contents with ``text``."""
    write_section(page, f"<!-- claims:{name}:start -->", f"<!-- claims:{name}:end -->", text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.json)")
    ap.add_argument("--digits", type=int, default=4, help="significant digits")
    ap.add_argument("--write", type=Path, default=None, metavar="PAGE", help="replace the page's marked section")
    ap.add_argument("--section", default=None, help="the section name of --write")
    args = ap.parse_args(argv)
    if args.write is not None:
        if args.section is None or len(args.runs) != 1:
            ap.error("--write needs --section NAME and exactly one run directory")
        try:
            write(args.write, args.section, section(args.runs[0], args.digits))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"{args.write}: section {args.section} written from {args.runs[0]}")
        return 0
    status = 0
    for run in args.runs:
        try:
            metrics, _ = _read(run)
        except ValueError as e:
            print(e, file=sys.stderr)
            status = 1
            continue
        print(f"**{run.name}**\n")
        print(render_table(metrics["claims"], args.digits))
        print()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
