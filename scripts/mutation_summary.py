"""Summarise a mutation run of scripts/mutation_check.sh: per module the killed, timed-out and
surviving mutants and the score, then every survivor with its verdict (with --show, its diff).

    python scripts/mutation_summary.py WORKDIR [--show]
    python scripts/mutation_summary.py WORKDIR --skeleton   # JSON verdict stubs (mutant, diff) of the unexplained

Raw score = (killed + timeout) / (killed + timeout + survived + suspicious), over the mutants that ran
(the sampled ones where the module was sampled; `sample_<module>.txt` in WORKDIR lists them).  A
timeout counts as killed: the mutant made the suite run 10× longer than the unmutated code.
With a sample, the 95 % interval of the module's score is the Wilson interval.

Every survivor then gets a verdict, from docs/mutation/verdicts/*.json (written by hand, one object
per mutant: {"mutant", "verdict", "reason", "case", "diff"}; a verdict whose recorded diff differs
from the mutant's is not applied; a non-"killed" verdict of a function that has since moved to
another module applies when the function name and the diff match) or else from the automatic
CLASSES below:
* killed      a test that the run's tree did not have kills it; "case" is the textual mutation, checked with
              `python scripts/mutant_kill_check.py docs/mutation/verdicts/<file>.json`;
* equivalent  it cannot change any result for any valid input (the reason says why);
* error-path  it changes only the wording or a reported value of an error raised for invalid or
              non-finite input;
* accepted    it can change a result, but only through a tuning constant that no specification fixes
              (the reason says where it would matter); counted as not killed;
* unexplained no verdict yet.
Score = (killed in the run + killed later) / (mutants run − equivalent); error-path and accepted
survivors count as not killed (the score without the error-path ones is printed too).
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import math
import os
import re
import sys
from pathlib import Path

# Survivors without a hand-written verdict whose one-line change matches one of these are sorted into
# a class with its one-line reason (`left`: the text of the line before the change; `old`: the changed
# text); the rest are "unexplained" until a verdict is written (--skeleton prints the stubs).
CLASSES = [  # (label, rule, reason); the verdict of each label is in CLASS_VERDICT
    ("memory/device only",
     lambda left, old, line: re.search(r"(chunk_elements|device)=\s*$", left)
     or re.match(r"\s*,?\s*(chunk_elements|device)=", old),
     "the argument only sets the memory cap (chunk size) or the device; the numbers are the same on CPU"),
    ("overflow/error-path argument",
     lambda left, old, line: re.search(r"(overflow_check|nonfinite_error|_ledger_nonfinite)\(.*,", left),
     "an argument that only shapes the error raised when a value overflows or is not finite (name, "
     "log-values, scale, hint); finite runs never read it"),
    ("message text",
     lambda left, old, line: re.match(r"\s*(name|what|desc|label|msg|hint) = ", line),
     "a string that only appears in a message"),
]
CLASS_VERDICT = {"memory/device only": "equivalent", "overflow/error-path argument": "error-path",
                 "message text": "error-path", "unclassified": "unexplained"}
VERDICTS = Path(__file__).resolve().parents[1] / "docs" / "mutation" / "verdicts"
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


def wilson(k: int, n: int, z: float = 1.96):
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


@functools.lru_cache(maxsize=None)
def _functions(path: Path):
    """name -> body lines (stripped) of every function in mutmut's trampolined copy of a module."""
    src = path.read_text()
    lines = src.splitlines()
    # the def line too (a mutated default argument), with the function's own name taken out
    return {node.name: [re.sub(r"^(async )?def \w+", "def _", ln.strip()) for ln in lines[node.lineno - 1:node.end_lineno]]
            for node in ast.walk(ast.parse(src)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def mutant_diff(workdir: Path, mod: str, name: str):
    """(removed lines, added lines) of a mutant, read from mutmut's trampolined copy of the module."""
    bodies = _functions(workdir / "mutants" / "transformer_pde" / (mod.replace(".", "/") + ".py"))
    fn = name.rsplit(".", 1)[-1]
    orig = fn.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
    if fn not in bodies or orig not in bodies:
        return [], []
    a, b = bodies[orig], bodies[fn]
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    removed = [ln for op, i1, i2, _, _ in sm.get_opcodes() if op != "equal" for ln in a[i1:i2]]
    added = [ln for op, _, _, j1, j2 in sm.get_opcodes() if op != "equal" for ln in b[j1:j2]]
    return removed, added


def classify(removed, added):
    if len(removed) != 1 or len(added) > 1:
        return "unclassified"
    a, b = removed[0], (added[0] if added else "")
    p = len(os.path.commonprefix([a, b]))
    q = len(os.path.commonprefix([a[p:][::-1], b[p:][::-1]]))
    left, old = a[:p], a[p:len(a) - q]
    for label, rule, _ in CLASSES:
        if rule(left, old, a):
            return label
    return "unclassified"


def main(workdir: Path, show: bool, skeleton: bool = False):
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
    out = sys.stderr if skeleton else sys.stdout  # --skeleton: only the JSON on stdout
    print("| module | mutants | run | killed | timeout | survived | not checked | score | 95 % interval |", file=out)
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    K = R = 0
    for mod, total, picked, c, k, ran, lo, hi in rows:
        K, R = K + k, R + ran
        score = f"{100 * k / ran:.1f} %" if ran else "–"
        interval = "all" if picked == total else f"{100 * lo:.1f}–{100 * hi:.1f} %"
        print(f"| {mod} | {total} | {picked} | {c.get('killed', 0)} | {c.get('timeout', 0)} | "
              f"{c.get('survived', 0) + c.get('suspicious', 0)} | {c.get('not checked', 0)} | {score} | {interval} |",
              file=out)
    if R:
        print(f"\nall modules: {K}/{R} = {100 * K / R:.1f} % killed (timeouts count as killed)", file=out)
    hand = load_verdicts()
    # a function that moved to another module (the layer sub-packages, the split solver files) keeps
    # its mutants' numbers and diffs: its equivalent / error-path / accepted verdicts carry over when the
    # function part of the name and the recorded diff both match
    moved = {}
    for name, v in hand.items():
        if v["verdict"] != "killed" and "diff" in v:
            moved.setdefault((name.rsplit(".", 1)[-1], json.dumps(v["diff"], ensure_ascii=False)), v)
    by_verdict = {}
    for mod, n, st in survivors:
        removed, added = mutant_diff(workdir, mod, n)
        short = n.split("transformer_pde.", 1)[-1]
        v = hand.get(short)
        if v is None:
            v = moved.get((short.rsplit(".", 1)[-1], json.dumps([removed, added], ensure_ascii=False)))
        if v is not None and "diff" in v and v["diff"] != [removed, added]:
            # the verdict was written for another mutation that had this name (the function changed since)
            verdict, reason = "unexplained", "its verdict in docs/mutation/verdicts is for another mutation of this name"
        elif v is not None:
            verdict, reason = v["verdict"], v.get("reason", "")
        else:
            label = classify(removed, added)
            verdict, reason = CLASS_VERDICT[label], {c[0]: f"{c[0]}: {c[2]}" for c in CLASSES}.get(label, "")
        by_verdict.setdefault(verdict, []).append((short, st, reason, removed, added))
    if skeleton:  # stubs to fill in (verdict, reason, and for a kill the checked case) and add to a verdict file
        print(json.dumps([{"mutant": short, "verdict": "", "reason": "", "diff": [removed, added]}
                          for short, _, _, removed, added in by_verdict.get("unexplained", [])],
                         indent=1, ensure_ascii=False))
        return
    later = len(by_verdict.get("killed", []))
    eq = len(by_verdict.get("equivalent", []))
    err = len(by_verdict.get("error-path", []))
    acc = len(by_verdict.get("accepted", []))
    if R:
        print(f"after the verdicts: {K} killed in the run + {later} killed by later tests, {eq} equivalent, "
              f"{err} error-path, {acc} accepted, {len(by_verdict.get('unexplained', []))} unexplained")
        if R - eq:
            print(f"score over the non-equivalent mutants: {K + later}/{R - eq} = {100 * (K + later) / (R - eq):.1f} %"
                  + (f"; without the error-path ones: {K + later}/{R - eq - err} = "
                     f"{100 * (K + later) / (R - eq - err):.1f} %" if R - eq - err else ""))
    print(f"\n{len(survivors)} survivors:")
    for verdict in ("killed", "equivalent", "error-path", "accepted", "unexplained"):
        rows = by_verdict.get(verdict, [])
        print(f"\n### {verdict} ({len(rows)})")
        for short, st, reason, removed, added in rows:
            print(f"- `{short}`" + (f" ({st})" if st != "survived" else "") + (f": {reason}" if reason else ""))
            if show:
                for ln in removed:
                    print(f"      - {ln}")
                for ln in added:
                    print(f"      + {ln}")


def load_verdicts():
    """mutant name (without `transformer_pde.`) -> verdict object, from docs/mutation/verdicts/*.json."""
    out = {}
    for f in sorted(VERDICTS.glob("*.json")):
        for v in json.loads(f.read_text()):
            if v.get("verdict") not in ("killed", "equivalent", "error-path", "accepted"):
                raise ValueError(f"{f.name}: {v.get('mutant')}: verdict must be killed, equivalent, error-path or accepted")
            if v["verdict"] == "killed" and not v.get("case"):
                raise ValueError(f"{f.name}: {v['mutant']}: a 'killed' verdict needs the checked 'case'")
            name = v["mutant"].split("transformer_pde.", 1)[-1]
            if name in out:
                raise ValueError(f"{f.name}: {name} has a verdict in another file already; keep one")
            out[name] = v
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/mutation_summary.py WORKDIR [--show | --skeleton]")
    main(Path(sys.argv[1]), "--show" in sys.argv[2:], "--skeleton" in sys.argv[2:])
