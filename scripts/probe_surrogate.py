"""A fitted mean-field surrogate of all-MiniLM-L6-v2: how far four numbers per layer take the flow towards the
network, fitted on half of the sentences and reported on the other half (docs/pretrained.md).

    PYTHONPATH=. python scripts/probe_surrogate.py --sentences 64 --iters 40
    PYTHONPATH=. python scripts/probe_surrogate.py --sentences 128 --iters 60 --write docs/pretrained.md

``--write`` replaces the text between ``<!-- probe-surrogate:start -->`` and ``<!-- probe-surrogate:end -->`` of
the page with the tables, under a ``table-source`` marker holding the fingerprint of the code they came from
(tests/test_docs_provenance.py fails when that code changes and the tables are not regenerated).

The surrogate is the continuous rung of the probe's ladder (the projected flow ẋ = P_x v(x) of the layer's
heads without biases, Euler, ``--steps`` steps per layer, from the real embeddings) with per layer l: a factor
e^{a_l} on β, a layer time e^{s_l}, a gain g_l on the heads' values, and the layer's own feed-forward added
to the field as a token-wise drift with gain f_l, v = g_l Σ_h f_h(x) + f_l FF_l(r x)/r (r = √d).  a = s = f = 0,
g = 1 is the unfitted continuous rung.  The parameters are fitted by Adam on the mean over layers and tokens
of 1 − cos(x_l, x̂_l) (x̂_l the network's normalised hidden states) of the even-indexed sentences; W₂ to the
real tokens per layer (probe.sentence_w2) is reported on the odd-indexed ones, mean ± standard error over
those sentences, for the unfitted and the fitted surrogate.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import transformer_pde as tp
from transformer_pde.application.studies.probe import select_sentences, sentence_w2
from transformer_pde.application.studies.provenance import code_fingerprint, marker


def _attention(lw, x, mask, beta_gain, value_gain, r):
    """g Σ_h O_h Σ_j p^h_ij V_h x_j, p the masked softmax of β e^{a} ⟨Q_h x_i, K_h x_j⟩, β = c r² (unit x)."""
    q = torch.einsum("hkd,bnd->bhnk", lw.query, x)
    k = torch.einsum("hkd,bnd->bhnk", lw.key, x)
    v = torch.einsum("hkd,bnd->bhnk", lw.value, x)
    s = (lw.scale * r * r) * beta_gain * (q @ k.transpose(-1, -2))
    s = s.masked_fill(~mask[:, None, None, :], -math.inf)
    o = torch.softmax(s, -1) @ v  # (B, H, n, k)
    return value_gain * torch.einsum("hdk,bhnk->bnd", lw.output, o)


def rollout(net, x0, mask, theta, steps):
    """Hidden states (L+1, B, n, d) of the surrogate with parameters theta (L, 4) = (a, s, g, f)."""
    r = math.sqrt(net.dim)
    xs = [x0]
    x = x0
    for l, lw in enumerate(net.layers):
        a, s, g, f = theta[l]
        h = torch.exp(s) / steps
        for _ in range(steps):
            v = _attention(lw, x, mask, torch.exp(a), g, r) + f * lw.feed_forward(r * x) / r
            v = v - (v * x).sum(-1, keepdim=True) * x
            x = torch.nn.functional.normalize(x + h * v, dim=-1)
        xs.append(x)
    return torch.stack(xs)


def _loss(pred, real, mask):
    m = mask.to(pred.dtype)
    cos = (pred[1:] * real[1:]).sum(-1)
    return ((1 - cos) * m).sum() / (m.sum() * (pred.shape[0] - 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=64, help="sentences (half fitted, half held out)")
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="Euler steps per layer")
    ap.add_argument("--iters", type=int, default=40, help="Adam steps")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0, help="the sentence draw")
    ap.add_argument("--write", type=Path, default=None, help="the Markdown page whose probe-surrogate section to replace")
    args = ap.parse_args(argv)
    net = tp.pretrained.load(tp.pretrained.packaged_minilm())
    texts = select_sentences(args.sentences, args.seed)
    states, mask = tp.pretrained.hidden_states(net, texts, max_length=args.max_length)
    real = torch.nn.functional.normalize(states, dim=-1)
    fit, held = torch.arange(0, len(texts), 2), torch.arange(1, len(texts), 2)
    L = net.num_layers
    theta0 = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * L)
    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=args.lr)
    for it in range(args.iters):
        loss = _loss(rollout(net, real[0, fit], mask[fit], theta, args.steps), real[:, fit], mask[fit])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % 10 == 0 or it == args.iters - 1:
            print(f"# iteration {it}: training loss {float(loss.detach()):.4f}")
    with torch.no_grad():
        rows = {}
        for name, th in (("unfitted continuous rung", theta0), ("fitted surrogate", theta.detach())):
            pred = rollout(net, real[0, held], mask[held], th, args.steps)
            w2 = sentence_w2(pred, states[:, held], mask[held])  # (L+1, S)
            rows[name] = (w2.mean(-1), w2.std(-1) / math.sqrt(w2.shape[-1]), float(_loss(pred, real[:, held],
                                                                                         mask[held])))
    lines = [f"{len(fit)} sentences fitted, {len(held)} held out (≤ {args.max_length} tokens), {args.steps} Euler "
             f"steps per layer, {args.iters} Adam steps (training loss {float(loss.detach()):.4f} at the last); "
             f"W₂ to the real tokens on the held-out sentences, mean ± s.e. over them:", "",
             "| surrogate | held-out 1 − cos | " + " | ".join(f"ℓ = {i}" for i in range(1, L + 1)) + " |",
             "|---" * (L + 2) + "|"]
    for name, (m, se, lo) in rows.items():
        lines.append(f"| {name} | {lo:.4f} | " + " | ".join(f"{float(a):.3f} ± {float(b):.3f}" for a, b in
                                                             zip(m[1:], se[1:])) + " |")
    lines += ["", "| layer | β factor e^a | layer time e^s | value gain g | feed-forward gain f |", "|---|---|---|---|---|"]
    for l, (a, s, g, f) in enumerate(theta.detach().tolist()):
        lines.append(f"| {l} | {math.exp(a):.3f} | {math.exp(s):.3f} | {g:.3f} | {f:.3f} |")
    print("\n".join(lines))
    if args.write is not None:
        start, end = "<!-- probe-surrogate:start -->", "<!-- probe-surrogate:end -->"
        text = args.write.read_text(encoding="utf-8")
        if start not in text or end not in text:
            raise SystemExit(f"{args.write} has no '{start}' … '{end}' section to replace")
        body = "\n".join([start, marker("probe_surrogate", code_fingerprint("probe_surrogate")), "", *lines, end])
        head, rest = text.split(start, 1)
        args.write.write_text(head + body + rest.split(end, 1)[1], encoding="utf-8")
        print(f"wrote the tables into {args.write}")

if __name__ == "__main__":
    main()
