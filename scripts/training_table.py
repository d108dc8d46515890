"""Render the results of a ``train_digits`` run (its metrics.json) as the Markdown of docs/training.md.

    python scripts/training_table.py runs/train_digits/metrics.json                       # print
    python scripts/training_table.py runs/train_digits/metrics.json --write docs/training.md --section metric

``--write`` replaces the text between ``<!-- training-results:SECTION:start -->`` and
``<!-- training-results:SECTION:end -->`` of the page: the results table, the paired differences
(same seed: same initialisation and batches) and the sentences read off them (flow against the
discrete transformer: accuracy, test loss, time per epoch), so the page quotes the run's numbers,
never typed ones.  The section starts with a ``table-source`` marker holding the run's code
fingerprint, which tests/test_docs_provenance.py compares with the code of today's tree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformer_pde.application.studies.provenance import marker, write_section
from transformer_pde.application.studies.training import results_table, tradeoff_table


def _pm(s, scale=1.0, digits=2):
    return f"{s['mean'] * scale:.{digits}f} ± {s['sem'] * scale:.{digits}f}"


def findings(m: dict) -> list:
    """The flow against the discrete transformer, read off the numbers (no verdict beyond what they carry)."""
    acc, loss, sec = m["test_accuracy"], m["test_loss"], m["seconds_per_epoch"]
    if "flow" not in acc or "transformer" not in acc:
        return []
    d = m["kinetic_tradeoff"]["transformer"]
    da, dl = d["accuracy_minus_flow"], d["loss_minus_flow"]
    n = len(dl["seeds"])
    lower = sum(v < 0 for v in dl["seeds"])
    separated = abs(da["mean"]) > 2 * da["sem"]
    ratio = [f / t for f, t in zip(sec["flow"]["seeds"], sec["transformer"]["seeds"])]
    r_mean = sum(ratio) / len(ratio)
    r_sem = (sum((r - r_mean) ** 2 for r in ratio) / (len(ratio) - 1)) ** 0.5 / len(ratio) ** 0.5 \
        if len(ratio) > 1 else float("nan")
    acc_text = ("the difference exceeds two standard errors" if separated else
                "the difference is within two standard errors, so this run does not separate the two (it is not "
                "evidence of parity either: a difference of that size would go unseen)")
    return [
        f"* **Flow vs discrete transformer, same parameter count and budget** ({n} seeds): test accuracy "
        f"{_pm(acc['flow'], 100)} % (flow) vs {_pm(acc['transformer'], 100)} % (transformer); paired by seed, "
        f"transformer − flow = {100 * da['mean']:+.2f} ± {100 * da['sem']:.2f} points — {acc_text}.",
        f"* The transformer reaches the lower test loss ({_pm(loss['transformer'], digits=3)} vs "
        f"{_pm(loss['flow'], digits=3)}; paired {dl['mean']:+.4f} ± {dl['sem']:.4f}, lower on {lower} of {n} seeds) "
        f"and takes {r_mean:.1f} ± {r_sem:.1f}× less time per epoch ({_pm(sec['transformer'])} s vs "
        f"{_pm(sec['flow'])} s, wall time on a machine shared with other jobs: the ratio is the steadier figure).",
    ]


def kinetic_findings(m: dict) -> list:
    """The regularised flows against the plain flow (paired by seed), and the clustering along depth."""
    names = [n for n in m["test_accuracy"] if n.startswith("flow_kinetic_")]
    if not names:
        return []
    kind = m.get("kinetic", "metric")
    term = "∫𝒢²dt" if kind == "metric" else "the action Σ‖Δx‖²/Δt"
    key = "test_kinetic" if kind == "metric" else "test_action"
    tr = m["kinetic_tradeoff"]
    parts = []
    for n in names:
        da, dl = tr[n]["accuracy_minus_flow"], tr[n]["loss_minus_flow"]
        sig = abs(da["mean"]) > 2 * da["sem"] or abs(dl["mean"]) > 2 * dl["sem"]
        lower = sum(v < 0 for v in dl["seeds"])
        parts.append(f"λ = {n[len('flow_kinetic_'):]}: {term} {m[key][n]['mean']:.3g} (flow: {m[key]['flow']['mean']:.3g}), "
                     f"Δ accuracy {100 * da['mean']:+.2f} ± {100 * da['sem']:.2f} points, Δ test loss "
                     f"{dl['mean']:+.4f} ± {dl['sem']:.4f} (lower on {lower} of {len(dl['seeds'])} seeds"
                     f"{'; beyond two standard errors' if sig else ''})")
    out = [f"* **The kinetic regulariser ({term}), paired with the plain flow**: " + "; ".join(parts) + "."]
    depth = m.get("depth", {})
    if "flow" in depth:
        flows = ["flow"] + names
        out.append("* **Clustering along depth** (the analysis images): mean token cosine at t = 0 → t = T: "
                   + ", ".join(f"{n} {depth[n]['mean_cosine'][0]:.2f} → {depth[n]['mean_cosine'][-1]:.3f}"
                               for n in flows if n in depth)
                   + "; final clusters " + ", ".join(f"{n} {_pm(depth[n]['final_clusters'])}" for n in flows
                                                      if n in depth) + ".")
    return out


def render(m: dict, run: str = "") -> str:
    """The Markdown of one run's section."""
    out = [marker("train_digits", m.get("code_fingerprint", "unknown"), run), "", results_table(m), "",
           "Paired differences (same seed: same initialisation and batches; mean ± standard error over seeds):", "",
           tradeoff_table(m), ""]
    out += findings(m) + kinetic_findings(m)
    return "\n".join(out) + "\n"


def write(page: Path, section: str, text: str) -> None:
    """Replace the marked section of ``page`` with ``text`` (ValueError when its markers are missing)."""
    write_section(page, f"<!-- training-results:{section}:start -->", f"<!-- training-results:{section}:end -->", text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", type=Path, help="metrics.json of a train_digits run")
    ap.add_argument("--write", type=Path, default=None, help="the Markdown page whose marked section to replace")
    ap.add_argument("--section", default="metric", help="the section's name in its markers (default: metric)")
    args = ap.parse_args(argv)
    text = render(json.loads(args.metrics.read_text()), args.metrics.resolve().parent.name)
    if args.write is None:
        print(text)
    else:
        write(args.write, args.section, text)
        print(f"wrote the results of {args.metrics} into {args.write} ({args.section})")


if __name__ == "__main__":
    main()
