"""The pretrained probe's rung "continuous + feed-forward" (transformer_pde.analysis.pretrained_drift) against
the network and the ladder's "continuous" rung, per layer, on the probe's sentences.

    PYTHONPATH=$PWD python scripts/probe_ff_drift.py                      # the quick probe's 32 sentences
    PYTHONPATH=$PWD python scripts/probe_ff_drift.py --sentences 1000 --max-length 64
    PYTHONPATH=$PWD python scripts/probe_ff_drift.py --sentences 256 --write docs/pretrained.md

Per layer ℓ and sentence: W₂ between the normalised predicted and real token clouds (exact assignment,
studies.probe.sentence_w2), the mean angle between matched tokens, the single-linkage cluster count at the
chordal radius and the mean cosine (studies.probe.cloud_statistics), for the network's own hidden states, the
"continuous" rung and the "continuous + feed-forward" rung, the feed-forward reading the sphere token or, "affine",
the token with the first LayerNorm's gain and bias (all rolled out from the embeddings, Euler step
``--dt``); means over sentences ± bootstrap standard errors (resampling sentences).  The share of the
continuous rung's W₂ that the drift closes at layer ℓ is 1 − W̄₂(ff)/W̄₂(cont) (the network's own W₂ is 0),
with its bootstrap error.  The step is checked by re-running the drift rung at dt/2 on the first
``--dt-check`` sentences.  ``--write PAGE`` replaces the text between ``<!-- probe-ff-drift:start -->`` and
``<!-- probe-ff-drift:end -->`` with the tables under a ``table-source`` marker (kind probe_ff_drift).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import transformer_pde as tp
from transformer_pde.analysis.pretrained_drift import continuous_feedforward
from transformer_pde.application.studies.probe import cloud_statistics, select_sentences, sentence_w2
from transformer_pde.application.studies.provenance import code_fingerprint, marker

START, END = "<!-- probe-ff-drift:start -->", "<!-- probe-ff-drift:end -->"
RUNGS = ("network", "continuous", "continuous_ff", "continuous_ff_affine")
LABEL = {"network": "network", "continuous": "continuous", "continuous_ff": "continuous + FF",
         "continuous_ff_affine": "continuous + FF (affine)"}
DRIFTS = ("continuous_ff", "continuous_ff_affine")


def measure(net, texts, *, max_length, dt, radius, batch=64):
    """Per-sentence statistics (L+1, S) of each rung, the sentences sorted by token count into batches."""
    lengths = [len(net.tokenizer(t, truncation=True, max_length=max_length)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    out = {r: {k: [] for k in ("w2", "angle", "clusters", "cosine")} for r in RUNGS}
    for s in range(0, len(order), batch):
        group = [texts[i] for i in order[s:s + batch]]
        states, mask = tp.pretrained.hidden_states(net, group, max_length=max_length)
        preds = {"network": states,
                 "continuous": tp.pretrained.ladder(net, states, mask, rungs=["continuous"], dt=dt)["continuous"],
                 "continuous_ff": continuous_feedforward(net, states, mask, dt=dt),
                 "continuous_ff_affine": continuous_feedforward(net, states, mask, dt=dt, ff_input="affine")}
        b = states / states.norm(dim=-1, keepdim=True)
        for r, pred in preds.items():
            a = pred / pred.norm(dim=-1, keepdim=True)
            angle = torch.acos((a * b).sum(-1).clamp(-1.0, 1.0))
            stats = cloud_statistics(pred.double(), mask, radius)
            out[r]["w2"].append(sentence_w2(pred, states, mask))
            out[r]["angle"].append(((angle * mask).sum(-1) / mask.sum(-1)).double())
            out[r]["clusters"].append(stats["clusters"])
            out[r]["cosine"].append(stats["mean_cosine"])
    return {r: {k: torch.cat(v, -1) for k, v in d.items()} for r, d in out.items()}


def bootstrap(stats, resamples, seed):
    """(mean, bootstrap s.e.) per layer of every statistic, and of the gap share 1 − W̄₂(ff)/W̄₂(cont)."""
    S = stats["network"]["w2"].shape[-1]
    idx = torch.randint(0, S, (resamples, S), generator=torch.Generator().manual_seed(seed))
    res = {}
    for r, d in stats.items():
        for k, v in d.items():
            boot = v[:, idx].mean(-1)  # (L+1, resamples)
            res[r, k] = (v.mean(-1), boot.std(-1))
    w_c = stats["continuous"]["w2"]
    for r in DRIFTS:
        w_ff = stats[r]["w2"]
        share = 1 - w_ff[1:].mean(-1) / w_c[1:].mean(-1)
        boot = 1 - w_ff[1:, idx].mean(-1) / w_c[1:, idx].mean(-1)
        res["share", r] = (share, boot.std(-1))
    return res


def _pm(m, e, digits):
    return f"{m:.{digits}f} ± {e:.{digits}f}"


def tables(res, L):
    """The Markdown tables."""
    rungs = ("continuous",) + DRIFTS
    lines = ["| ℓ | " + " | ".join(f"W₂, {LABEL[r]}" for r in rungs) + " | "
             + " | ".join(f"W₂ gap closed, {LABEL[r]}" for r in DRIFTS) + " |", "|---" * 6 + "|"]
    for l in range(1, L + 1):
        cells = [_pm(res[r, "w2"][0][l], res[r, "w2"][1][l], 3) for r in rungs]
        cells += [f"{100 * res['share', r][0][l - 1]:.1f} ± {100 * res['share', r][1][l - 1]:.1f} %" for r in DRIFTS]
        lines.append(f"| {l} | " + " | ".join(cells) + " |")
    lines += ["", "| ℓ | " + " | ".join(f"mean angle, {LABEL[r]}" for r in rungs) + " |", "|---" * 4 + "|"]
    for l in range(1, L + 1):
        lines.append(f"| {l} | " + " | ".join(_pm(res[r, "angle"][0][l], res[r, "angle"][1][l], 3) for r in rungs)
                     + " |")
    for stat, name, digits in (("clusters", "clusters", 2), ("cosine", "mean cosine", 3)):
        lines += ["", "| ℓ | " + " | ".join(f"{name}, {LABEL[r]}" for r in RUNGS) + " |", "|---" * 5 + "|"]
        for l in range(L + 1):
            lines.append(f"| {l} | " + " | ".join(_pm(res[r, stat][0][l], res[r, stat][1][l], digits) for r in RUNGS)
                         + " |")
    return "\n".join(lines)


def write_section(page: Path, text: str):
    """Replace the text between START and END of ``page`` (ValueError when the markers are missing)."""
    doc = page.read_text(encoding="utf-8")
    if START not in doc or END not in doc:
        raise ValueError(f"{page} lacks the markers {START} / {END}; add them where the section goes")
    head, rest = doc.split(START, 1)
    tail = rest.split(END, 1)[1]
    page.write_text(head + START + "\n" + text + "\n" + END + tail, encoding="utf-8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=32, help="sentences drawn as the probe does (default 32, the "
                    "quick probe's; 1000 the full probe's)")
    ap.add_argument("--max-length", type=int, default=32, help="tokens per sentence at most (quick 32, full 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sentence draw and of the bootstrap")
    ap.add_argument("--dt", type=float, default=0.1, help="Euler step of both continuous rungs (1/N)")
    ap.add_argument("--radius", type=float, default=1.0, help="chordal radius of the cluster count")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples over sentences")
    ap.add_argument("--dt-check", type=int, default=16, help="sentences of the dt/2 check (0: none)")
    ap.add_argument("--write", type=Path, default=None, help="the docs page whose marked section is replaced")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    net = tp.pretrained.load(tp.pretrained.packaged_minilm())
    texts = select_sentences(args.sentences, args.seed)
    t0 = time.perf_counter()
    stats = measure(net, texts, max_length=args.max_length, dt=args.dt, radius=args.radius)
    elapsed = time.perf_counter() - t0
    res = bootstrap(stats, args.bootstrap, args.seed)
    L = net.num_layers
    check = ""
    if args.dt_check:
        sub = texts[:args.dt_check]
        states, mask = tp.pretrained.hidden_states(net, sub, max_length=args.max_length)
        w_a = sentence_w2(continuous_feedforward(net, states, mask, dt=args.dt), states, mask).mean(-1)
        w_b = sentence_w2(continuous_feedforward(net, states, mask, dt=args.dt / 2), states, mask).mean(-1)
        rel = float(((w_a - w_b).abs() / w_b)[1:].max())
        w_a = sentence_w2(continuous_feedforward(net, states, mask, dt=args.dt, ff_input="affine"), states, mask)
        w_b = sentence_w2(continuous_feedforward(net, states, mask, dt=args.dt / 2, ff_input="affine"), states, mask)
        rel_a = float(((w_a.mean(-1) - w_b.mean(-1)).abs() / w_b.mean(-1))[1:].max())
        check = (f"Halving dt to {args.dt / 2:g} on the first {len(sub)} sentences moves the W₂ of the continuous + FF "
                 f"rungs by at most {100 * rel:.1f} % (sphere) and {100 * rel_a:.1f} % (affine) at any layer "
                 f"(deterministic).")
    tokens = sum(len(net.tokenizer(t, truncation=True, max_length=args.max_length)["input_ids"]) for t in texts)
    run = (f"`PYTHONPATH=. python scripts/probe_ff_drift.py --sentences {args.sentences} --max-length "
           f"{args.max_length} --dt {args.dt:g} --write docs/pretrained.md`: all-MiniLM-L6-v2 ({net.dtype}), "
           f"{args.sentences} sentences ({tokens} tokens) drawn as the probe draws them (seed {args.seed}), rollout "
           f"from the embeddings, Euler step dt = {args.dt:g} for the continuous rungs, cluster radius "
           f"{args.radius:g}; {elapsed:.0f} s.  ± one bootstrap standard error over sentences ({args.bootstrap} "
           f"resamples).  {check}")
    body = tables(res, L)
    print(run + "\n\n" + body)
    if args.write is not None:
        code = code_fingerprint("probe_ff_drift")
        write_section(args.write, marker("probe_ff_drift", code, f"sentences{args.sentences}") + "\n\n" + run
                      + "\n\n" + body)
        print(f"wrote the section of {args.write}", file=sys.stderr)


if __name__ == "__main__":
    main()
