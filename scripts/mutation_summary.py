"""Summarise a mutation run of scripts/mutation_check.sh: per module the killed, timed-out and
surviving mutants and the score, then every survivor (with --show, its diff from mutmut).

    python scripts/mutation_summary.py WORKDIR [--show]

Score = (killed + timeout) / (killed + timeout + survived + suspicious), over the mutants that ran
(the sampled ones where the module was sampled; `sample_<module>.txt` in WORKDIR lists them).  A
timeout counts as killed: the mutant made the suite run 10× longer than the unmutated code.
With a sample, the 95 % interval of the module's score is the Wilson interval.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


def wilson(k: int, n: int, z: float = 1.96):
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


def main(workdir: Path, show: bool):
    rows, survivors = [], []
    for sample in sorted(workdir.glob("sample_*.txt")):
        mod = sample.stem[len("sample_"):]
        meta = workdir / "mutants" / "transformer_pde" / (mod.replace(".", "/") + ".py.meta")
        if not meta.exists():
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        names = [n for n in sample.read_text().split() if n in codes]
        count = {}
        for n in names:
            st = STATUS.get(codes[n], "suspicious")
            count[st] = count.get(st, 0) + 1
            if st in ("survived", "suspicious"):
                survivors.append((mod, n, st))
        k = count.get("killed", 0) + count.get("timeout", 0)
        ran = k + count.get("survived", 0) + count.get("suspicious", 0)
        lo, hi = wilson(k, ran)
        rows.append((mod, len(codes), len(names), count, k, ran, lo, hi))
    print("| module | mutants | run | killed | timeout | survived | not checked | score | 95 % interval |")
    print("|---|---|---|---|---|---|---|---|---|")
    K = R = 0
    for mod, total, picked, c, k, ran, lo, hi in rows:
        K, R = K + k, R + ran
        score = f"{100 * k / ran:.1f} %" if ran else "–"
        interval = "all" if picked == total else f"{100 * lo:.1f}–{100 * hi:.1f} %"
        print(f"| {mod} | {total} | {picked} | {c.get('killed', 0)} | {c.get('timeout', 0)} | "
              f"{c.get('survived', 0) + c.get('suspicious', 0)} | {c.get('not checked', 0)} | {score} | {interval} |")
    if R:
        print(f"\nall modules: {K}/{R} = {100 * K / R:.1f} % killed (timeouts count as killed)")
    print(f"\n{len(survivors)} survivors:")
    for mod, n, st in survivors:
        print(f"- {n} ({st})")
        if show:
            out = subprocess.run([sys.executable, "-m", "mutmut", "show", n], cwd=workdir, capture_output=True,
                                 text=True).stdout
            diff = [ln for ln in out.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
            for ln in diff:
                print("      " + ln.strip())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/mutation_summary.py WORKDIR [--show]")
    main(Path(sys.argv[1]), "--show" in sys.argv[2:])
