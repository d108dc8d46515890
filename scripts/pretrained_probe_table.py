"""Render the results of a ``pretrained_probe`` run (its metrics.json) as Markdown tables.

    python scripts/pretrained_probe_table.py runs/pretrained_probe/metrics.json            # print
    python scripts/pretrained_probe_table.py runs/pretrained_probe/metrics.json --write docs/pretrained.md

``--write`` replaces the text between the markers ``<!-- probe-results:start -->`` and
``<!-- probe-results:end -->`` of the page, so the numbers quoted in docs/pretrained.md are the
run's, never typed by hand.  Every mean carries ± one standard error over sentences; the Shapley
values and shares of the order-free ladder the half-width of a 95 % bootstrap interval over sentences.
The section starts with a ``table-source`` marker holding the run's code fingerprint, which
tests/test_docs_provenance.py compares with the code of today's tree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformer_pde.application.studies.provenance import marker, write_section

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
    if m.get("subsets"):
        out += _subset_findings(m)
    elif steps:
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


_INGREDIENT_NAMES = {"feedforward": "the feed-forward", "layernorm": "LayerNorm (vs the sphere projection)",
                     "bias": "the attention biases", "discrete": "discrete time (vs continuous)"}


def _share(sh, i, L):
    return f"{100 * sh[i]['share'][L]:.1f} ± {100 * sh[i]['share_error'][L]:.1f} %"


def _subset_findings(m: dict) -> list:
    """The order-free attribution of the gap and where the clusters are lost, read off the subsets."""
    L = m["model"]["layers"]
    sub, sh, tot = m["subsets"]["subsets"], m["subsets"]["shapley"]["w2"], m["subsets"]["total"]["w2"]
    order = sorted(sh, key=lambda i: -sh[i]["share"][L])
    lad = m["ladder"]
    rung_share = None
    if "no_feedforward" in lad and "network" in lad:
        rung_share = (lad["no_feedforward"]["w2"][L] - lad["network"]["w2"][L]) / tot["value"][L]

    def w(name, key="w2", digits=3):
        e = sub[name][key]
        return _pm(e["mean"][L], e["se"][L], digits)

    first = ("" if rung_share is None else
             f" The ladder's order (feed-forward removed first) gives the feed-forward {100 * rung_share:.0f} % of it, "
             f"but that share depends on the order: with LayerNorm replaced by the sphere projection first and the "
             f"feed-forward kept, W₂ is already {w('sphere')} ({100 * sub['sphere']['w2']['mean'][L] / sub['no_ff+sphere']['w2']['mean'][L]:.0f} % "
             f"of the sphere rung's {w('no_ff+sphere')}).")
    out = [f"* **Which ingredient accounts for the gap, order-free.** Of the W₂ = "
           f"{tot['value'][L]:.3f} ± {tot['error'][L]:.3f} between the mean-field flow (all four ingredients removed) "
           f"and the network at ℓ = {L}, the Shapley shares over the 16 subsets (each ingredient's contribution "
           f"averaged over the 24 orders of removal) are: "
           + ", ".join(f"{_INGREDIENT_NAMES[i]} {_share(sh, i, L)}" for i in order) + "." + first]
    cl = m["subsets"]["shapley"]["clusters"]
    ctot = m["subsets"]["total"]["clusters"]
    corder = sorted(cl, key=lambda i: cl[i]["value"][L])
    flow, rung = sub["no_ff+sphere+no_bias+continuous"]["clusters"], sub["no_ff+sphere"]["clusters"]
    near = abs(rung["mean"][L] - flow["mean"][L]) <= 2 * (rung["se"][L] ** 2 + flow["se"][L] ** 2) ** 0.5 + 0.1
    lead = ("Over-clustering is not the continuous-time step: the discrete `sphere` rung" if near else
            "The discrete `sphere` rung")
    out.append(f"* **Where the clusters are lost.** The network ends at {w('network', 'clusters', 2)} single-linkage "
               f"clusters, the mean-field flow at {w('no_ff+sphere+no_bias+continuous', 'clusters', 2)}. {lead} "
               f"(feed-forward removed, LayerNorm → sphere) already has {w('no_ff+sphere', 'clusters', 2)}"
               f"{'' if near else ' clusters'}; with LayerNorm replaced but the "
               f"feed-forward kept there are {w('sphere', 'clusters', 2)}, with the feed-forward removed but "
               f"LayerNorm kept {w('no_ff', 'clusters', 2)}. Shapley values of the cluster count at ℓ = {L} "
               f"(total {ctot['value'][L]:+.2f} ± {ctot['error'][L]:.2f}): "
               + ", ".join(f"{_INGREDIENT_NAMES[i]} {cl[i]['value'][L]:+.2f} ± {cl[i]['value_error'][L]:.2f}"
                           for i in corder) + ".")
    return out


def _subset_tables(m: dict) -> list:
    L = m["model"]["layers"]
    S = m["subsets"]
    out = ["", f"**The order-free ladder** ({S['sentences']} sentences, every subset rolled out from the real "
           f"embeddings; Shapley values ± the half-width of the 95 % bootstrap interval over sentences, "
           f"{S['resamples']} resamples). Share of the W₂ gap per hidden-state index:", "",
           "| ingredient | " + " | ".join(f"ℓ = {i}" for i in range(1, L + 1)) + " |", "|---" * (L + 1) + "|"]
    for i, name in _INGREDIENT_NAMES.items():
        e = S["shapley"]["w2"][i]
        out.append(f"| {name} | " + " | ".join("—" if e["share"][k] is None else
                                              f"{100 * e['share'][k]:.1f} ± {100 * e['share_error'][k]:.1f} %"
                                              for k in range(1, L + 1)) + " |")
    t = S["total"]["w2"]
    out.append("| total W₂ (mean-field flow − network) | " + " | ".join(f"{t['value'][k]:.3f} ± {t['error'][k]:.3f}"
                                                                       for k in range(1, L + 1)) + " |")
    out += ["", "Shapley values of the cluster count (negative: the ingredient's removal loses clusters):", "",
            "| ingredient | " + " | ".join(f"ℓ = {i}" for i in range(1, L + 1)) + " |", "|---" * (L + 1) + "|"]
    for i, name in _INGREDIENT_NAMES.items():
        e = S["shapley"]["clusters"][i]
        out.append(f"| {name} | " + " | ".join(f"{e['value'][k]:+.2f} ± {e['value_error'][k]:.2f}"
                                              for k in range(1, L + 1)) + " |")
    t = S["total"]["clusters"]
    out.append("| total | " + " | ".join(f"{t['value'][k]:+.2f} ± {t['error'][k]:.2f}" for k in range(1, L + 1))
               + " |")
    out += ["", f"Every subset at ℓ = {L} (removed ingredients; mean ± s.e. over sentences):", "",
            "| removed | W₂ | mean angle (rad) | mean cosine | clusters |", "|---|---|---|---|---|"]
    for name, e in S["subsets"].items():
        out.append(f"| {name} | {_pm(e['w2']['mean'][L], e['w2']['se'][L])} | "
                   f"{_pm(e['mean_angle']['mean'][L], e['mean_angle']['se'][L])} | "
                   f"{_pm(e['mean_cosine']['mean'][L], e['mean_cosine']['se'][L])} | "
                   f"{_pm(e['clusters']['mean'][L], e['clusters']['se'][L], 2)} |")
    return out


def _se(x):
    return "—" if x is None or x != x else x


def _reinit_findings(m: dict) -> list:
    r, real, lay = m["reinitialised"], m["real"], m["layers"]
    L = m["model"]["layers"]
    k = len(r["seeds"])

    def rr(key, i, digits=3):
        se = r[key]["se"][i]
        return f"{r[key]['mean'][i]:.{digits}f}" + ("" if se is None or se != se else f" ± {se:.{digits}f}")

    return [f"* **Training, not the architecture, makes the tokens cluster.** The same architecture re-initialised "
            f"by its configuration's initialiser ({k} seeds; ± over seeds) keeps its tokens apart across depth: mean "
            f"cosine {rr('mean_cosine', 0)} → {rr('mean_cosine', L)} and {rr('clusters', 0, 2)} → "
            f"{rr('clusters', L, 2)} clusters, against {_pm(real['mean_cosine'][0], real['mean_cosine_se'][0])} → "
            f"{_pm(real['mean_cosine'][L], real['mean_cosine_se'][L])} and "
            f"{_pm(real['clusters'][0], real['clusters_se'][0], 2)} → {_pm(real['clusters'][L], real['clusters_se'][L], 2)}"
            f" trained.  Its attention is nearly isotropic-uniform (β_eff {min(r['beta']['mean']):+.3f} to "
            f"{max(r['beta']['mean']):+.3f}, trained {min(lay['beta_eff']):+.2f} to {max(lay['beta_eff']):+.2f}) and its "
            f"blocks are nearly isometric (Lipschitz constant {min(r['lipschitz']['mean']):.2f}–"
            f"{max(r['lipschitz']['mean']):.2f}, trained {min(lay['lipschitz']):.2f}–{max(lay['lipschitz']):.2f}): the "
            f"growing cosine, the falling cluster count, the negative temperatures of the later layers and the "
            f"expansive middle blocks belong to training.  What the architecture gives without training is a "
            f"mean cosine of {rr('mean_cosine', 0)} already at its embeddings, which its blocks barely change."]


def _reinit_tables(m: dict) -> list:
    r, real, lay = m["reinitialised"], m["real"], m["layers"]
    L = m["model"]["layers"]

    def rr(key, i, digits=3):
        se = r[key]["se"][i]
        return f"{r[key]['mean'][i]:.{digits}f}" + ("" if se is None or se != se else f" ± {se:.{digits}f}")

    out = ["", f"**Trained against re-initialised** (the architecture from its configuration's initialiser, seeds "
           f"{', '.join(map(str, r['seeds']))}: mean over seeds ± s.e. over seeds; trained: ± s.e. over sentences):", "",
           "| ℓ | mean cosine, trained | re-initialised | clusters, trained | re-initialised |", "|---|---|---|---|---|"]
    for i in range(L + 1):
        out.append(f"| {i} | {_pm(real['mean_cosine'][i], real['mean_cosine_se'][i])} | {rr('mean_cosine', i)} | "
                   f"{_pm(real['clusters'][i], real['clusters_se'][i], 2)} | {rr('clusters', i, 2)} |")
    out += ["", "| layer ℓ | β_eff, trained | re-initialised | ‖∂x_ℓ₊₁/∂x_ℓ‖₂, trained | re-initialised |",
            "|---|---|---|---|---|"]
    for i in range(L):
        out.append(f"| {i} | {_pm(lay['beta_eff'][i], lay['beta_eff_se'][i], 2)} | {rr('beta', i)} | "
                   f"{_pm(lay['lipschitz'][i], lay['lipschitz_se'][i], 2)} | {rr('lipschitz', i, 2)} |")
    return out


def render(m: dict, run: str = "") -> str:
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
    findings = _findings(m)
    if m.get("reinitialised"):
        findings = findings[:-1] + _reinit_findings(m) + findings[-1:]
    out = findings + out
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
    if m.get("subsets"):
        out += _subset_tables(m)
    if m.get("reinitialised"):
        out += _reinit_tables(m)
    head = marker("pretrained_probe", m.get("code_fingerprint", "unknown"), run)
    return head + "\n" + "\n".join(out) + "\n"


def write(page: Path, text: str) -> None:
    """Replace the marked section of ``page`` with ``text`` (ValueError when the markers are missing)."""
    write_section(page, START, END, text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", type=Path, help="metrics.json of a pretrained_probe run")
    ap.add_argument("--write", type=Path, default=None, help="the Markdown page whose marked section to replace")
    args = ap.parse_args(argv)
    text = render(json.loads(args.metrics.read_text()), args.metrics.resolve().parent.name)
    if args.write is None:
        print(text)
    else:
        write(args.write, text)
        print(f"wrote the results of {args.metrics} into {args.write}")


if __name__ == "__main__":
    main()
