"""Check by hand that tests kill given mutations: apply ONE textual change at a time to a scratch copy
of the package and run the named tests against it (the checkout is never touched).

    python scripts/mutant_kill_check.py cases.json [more.json ...]
    python scripts/mutant_kill_check.py docs/mutation/verdicts/*.json     # every "killed" verdict (one file per module)

cases.json: a list of [file, old text, new text, "pytest arguments"], e.g.
    [["transformer_pde/model/energy.py", "/ (2 * beta)", "/ (2 / beta)", "tests/test_energy_and_field_formulas.py -k energy"]]
or a verdict file of scripts/mutation_summary.py (objects whose "case" is such a list; only the
"killed" ones are checked, except those marked ``"historical": true``: verdicts of an earlier run whose code
has changed since, kept as the record of that run).  ``old`` must occur exactly once in the file.  Prints KILLED or SURVIVED
per case and exits 1 if any survived or was skipped.  Used for the survivors of a mutmut run whose
killing tests are not in the run's tree (docs/MUTATION_REPORT.md).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def cases(paths):
    for path in paths:
        for c in json.load(open(path)):
            if isinstance(c, dict):
                if c.get("verdict") == "killed" and not c.get("historical"):
                    yield c["mutant"], c["case"]
            else:
                yield "", c


def main(paths):
    bad = 0
    for name, (f, old, new, tests) in cases(paths):
        with tempfile.TemporaryDirectory() as tmp:
            d = pathlib.Path(tmp)
            for sub in ("transformer_pde", "tests", "experiments"):
                shutil.copytree(REPO / sub, d / sub)
            shutil.copy(REPO / "pyproject.toml", d)
            p = d / f
            s = p.read_text()
            if s.count(old) != 1:
                print(f"SKIPPED  {name or f}: the old text occurs {s.count(old)} times")
                bad += 1
                continue
            p.write_text(s.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
                                *tests.split()], cwd=d, capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(d)})
            tail = (r.stdout.strip().splitlines() or [""])[-1]
            bad += r.returncode == 0
            print(f"{'KILLED  ' if r.returncode else 'SURVIVED'} {name or f}: {new.strip()[:70]!r} ({tail})")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
