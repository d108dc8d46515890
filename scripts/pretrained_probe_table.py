"""Render the results of a ``pretrained_probe`` run (its metrics.json) as Markdown tables.

    python scripts/pretrained_probe_table.py runs/pretrained_probe/metrics.json            # print
    python scripts/pretrained_probe_table.py runs/pretrained_probe/metrics.json --write docs/pretrained.md

``--write`` replaces the text between the markers ``<!-- probe-results:start -->`` and
``<!-- probe-results:end -->`` of the page, so the numbers quoted in docs/pretrained.md are the
run's, never typed by hand.  Every mean carries ± one standard error over sentences.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

START, END = "<!-- probe-results:start -->", "<!-- probe-results:end -->"
_RUNG_NAMES = {"network": "exact network map", "no_feedforward": "− feed-forward",
               "sphere": "− LayerNorm (sphere of radius √d)", "no_bias": "− attention biases",
               "continuous": "continuous time (projected mean-field flow)"}


def _pm(mean, se, digits=3):
    if 0 < abs(mean) < 10 ** -digits:  # rounding-level values (the exact map's distance) in scientific notation
        return f"{mean:.1e} ± {se:.1e}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def _findings(m: dict) -> list:
    """Three sentences read off the numbers: clustering across depth, the rung that opens the gap, the fit of
    one temperature."""
    real, lay, lad, rungs = m["real"], m["layers"], m["ladder"], m["ladder_rungs"]
    L = m["model"]["layers"]
    rise = (f"* **Clustering across depth.** The mean cosine of a sentence's real tokens goes from "
            f"{_pm(real['mean_cosine'][0], real['mean_cosine_se'][0])} (embeddings) to "
            f"{_pm(real['mean_cosine'][L], real['mean_cosine_se'][L])} after block {L}; the last rung "
            f"({rungs[-1]}) reaches {_pm(lad[rungs[-1]]['mean_cosine'][L], lad[rungs[-1]]['mean_cosine_se'][L])}. "
            f"Single-linkage clusters at chordal radius {m.get('clustering_radius', '(the run’s)')}: "
            f"{_pm(real['clusters'][0], real['clusters_se'][0], 2)} → {_pm(real['clusters'][L], real['clusters_se'][L], 2)} "
            f"in the network, {_pm(lad[rungs[-1]]['clusters'][L], lad[rungs[-1]]['clusters_se'][L], 2)} at the last "
            f"rung.")
    steps = [(st["w2_final_change"], st["w2_final_change_se"], st["to"]) for st in m["ladder_steps"]]
    out = ["", rise]
    if steps:
        total = lad[rungs[-1]]["w2"][L] - lad[rungs[0]]["w2"][L]
        big, big_se, name = max(steps)
        out.append(f"* **Which ingredient accounts for the gap.** Of the W₂ = "
                   f"{_pm(lad[rungs[-1]]['w2'][L], lad[rungs[-1]]['w2_se'][L])} between the last rung and the real "
                   f"tokens at ℓ = {L}, the step to `{name}` ({_RUNG_NAMES.get(name, name)}) adds "
                   f"{_pm(big, big_se)} ({100 * big / total:.0f} %); every step (paired over sentences): "
                   + ", ".join(f"`{n}` {d:+.3f} ± {e:.3f}" for d, e, n in steps) + ".")
    explained = [1 - f / u for f, u in zip(lay["kl_fit"], lay["kl_uniform"])]
    verdict = ("cosine similarity alone says little about where the heads attend" if max(explained) < 0.5 else
               "cosine similarity accounts for much of where the heads attend")
    out.append(f"* **One temperature per layer.** β_eff runs from "
               f"{_pm(lay['beta_eff'][0], lay['beta_eff_se'][0], 2)} (layer 0) to "
               f"{_pm(lay['beta_eff'][-1], lay['beta_eff_se'][-1], 2)} (layer {L - 1}); the kernel "
               f"softmax(β_eff⟨x̂_i, x̂_j⟩) removes {100 * min(explained):.1f} % to {100 * max(explained):.1f} % of the "
               f"mean KL divergence of the head-averaged attention from uniform attention: {verdict}.")
    return out + [""]


def render(m: dict) -> str:
    """The Markdown of the results section for the metrics ``m`` of one run."""
    mo, tx, real, lay, lad = m["model"], m["text"], m["real"], m["layers"], m["ladder"]
    L = mo["layers"]
    out = [f"Run: `{mo['source']}` ({mo['family']}, {mo['norm']}-LN, L = {L}, d = {mo['dim']}, H = {mo['heads']}), "
           f"{tx['sentences']} sentences ({tx['tokens']} tokens) of `pydoc_data.topics` under Python {tx['python']} "
           f"(sha256 of sentences.txt's lines {tx['sha256'][:12]}…), ladder mode `{m['ladder_mode']}`, "
           f"compute time of its parts {sum(m['timing'].values()):.0f} s (the run's `timing` block). Error bars: "
           f"{m['error_bars']}.", "",
           "**The real hidden states** (normalised tokens; pair fraction and clusters at the run's radius):", "",
           "| ℓ | mean cosine | pair fraction | clusters | RMS token norm |", "|---|---|---|---|---|"]
    for i in range(L + 1):
        out.append(f"| {i} | {_pm(real['mean_cosine'][i], real['mean_cosine_se'][i])} | "
                   f"{_pm(real['pair_fraction'][i], real['pair_fraction_se'][i])} | "
                   f"{_pm(real['clusters'][i], real['clusters_se'][i], 2)} | "
                   f"{_pm(real['token_norm'][i], real['token_norm_se'][i], 2)} |")
    out += ["", f"**Per layer** (map x_ℓ → x_ℓ₊₁; Lipschitz constants over {lay['lipschitz_sentences']} sentences):",
            "", "| layer ℓ | β_eff (mean) | β_eff (median) | KL at β_eff / KL uniform | Δ log E_β across the layer "
            "| share of sentences with E_β up | ‖∂x_ℓ₊₁/∂x_ℓ‖₂ (mean) | max |", "|---|---|---|---|---|---|---|---|"]
    for i in range(L):
        out.append(f"| {i} | {_pm(lay['beta_eff'][i], lay['beta_eff_se'][i], 2)} | {lay['beta_eff_median'][i]:.2f} | "
                   f"{lay['kl_fit'][i] / lay['kl_uniform'][i]:.3f} | "
                   f"{_pm(lay['log_energy_change'][i], lay['log_energy_change_se'][i], 3)} | "
                   f"{lay['energy_increase_fraction'][i]:.3f} | {_pm(lay['lipschitz'][i], lay['lipschitz_se'][i], 2)} | "
                   f"{lay['lipschitz_max'][i]:.2f} |")
    rungs = m["ladder_rungs"]
    out = _findings(m) + out
    out += ["", "**The ladder**: W₂ between each rung's normalised token cloud and the real one, per hidden-state "
            "index (mean over sentences ± s.e.):", "",
            "| rung | " + " | ".join(f"ℓ = {i}" for i in range(1, L + 1)) + " |", "|---" * (L + 1) + "|"]
    for r in rungs:
        e = lad[r]
        out.append(f"| {_RUNG_NAMES.get(r, r)} | " + " | ".join(_pm(e["w2"][i], e["w2_se"][i]) for i in range(1, L + 1))
                   + " |")
    out += ["", f"At the last layer (ℓ = {L}): mean angle to the real token, and the mean cosine of the rung's "
            f"tokens (real network: {_pm(real['mean_cosine'][L], real['mean_cosine_se'][L])}):", "",
            "| rung | W₂ | mean angle (rad) | mean cosine | step from the rung above: ΔW₂ |", "|---|---|---|---|---|"]
    for k, r in enumerate(rungs):
        e = lad[r]
        st = m["ladder_steps"][k - 1] if k else None
        step = "" if k == 0 else f"{st['w2_final_change']:+.3f} ± {st['w2_final_change_se']:.3f}"
        out.append(f"| {_RUNG_NAMES.get(r, r)} | {_pm(e['w2'][L], e['w2_se'][L])} | "
                   f"{_pm(e['mean_angle'][L], e['mean_angle_se'][L])} | "
                   f"{_pm(e['mean_cosine'][L], e['mean_cosine_se'][L])} | {step} |")
    return "\n".join(out) + "\n"


def write(page: Path, text: str) -> None:
    """Replace the marked section of ``page`` with ``text`` (ValueError when the markers are missing)."""
    doc = page.read_text(encoding="utf-8")
    if START not in doc or END not in doc:
        raise ValueError(f"{page} has no '{START}' … '{END}' section to replace")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{text}{END}{tail}", encoding="utf-8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", type=Path, help="metrics.json of a pretrained_probe run")
    ap.add_argument("--write", type=Path, default=None, help="the Markdown page whose marked section to replace")
    args = ap.parse_args(argv)
    text = render(json.loads(args.metrics.read_text()))
    if args.write is None:
        print(text)
    else:
        write(args.write, text)
        print(f"wrote the results of {args.metrics} into {args.write}")


if __name__ == "__main__":
    main()
