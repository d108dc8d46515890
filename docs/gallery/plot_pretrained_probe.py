"""A real network's token dynamics: MiniLM against the mean-field flow
=====================================================================

Six English sentences from Python's own help topics go through the packaged all-MiniLM-L6-v2
(6 post-LN BERT blocks).  Left: the mean cosine of a sentence's normalised hidden states across depth,
for the real network and for three rungs of the ladder rolled out from the same embeddings — the
exact block, the block without its feed-forward sublayer, and the continuous-time mean-field flow of
the block's own heads on the sphere.  Right: W₂ between each rung's token cloud and the real one.
The full study (1000 sentences, every rung, β_eff, energies, Lipschitz constants) is
``transformer-pde run pretrained_probe``; docs/pretrained.md has its numbers.
"""

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp
from transformer_pde.application.studies.probe import mean_cosine, select_sentences

net = tp.pretrained.load(tp.pretrained.packaged_minilm())  # the user cache (TRANSFORMER_PDE_CACHE)
texts = select_sentences(6, seed=0)
states, mask = tp.pretrained.hidden_states(net, texts, max_length=24)
rungs = ("network", "no_feedforward", "continuous")
preds = tp.pretrained.ladder(net, states, mask, rungs=rungs, dt=0.5, mode="rollout")

depth = range(net.num_layers + 1)
rho = mean_cosine(states, mask)  # (L + 1, sentences)
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
ax.errorbar(depth, rho.mean(-1), yerr=rho.std(-1) / len(texts) ** 0.5, color="k", lw=2.2, capsize=3,
            label="real hidden states")
for k, rung in enumerate(rungs):
    r = mean_cosine(preds[rung], mask)
    ax.plot(depth, r.mean(-1), "o--", color=f"C{k + 1}", ms=4, label=rung)
    w2 = tp.pretrained.cloud_distances(preds[rung], states, mask)["w2"]
    bx.plot(depth, [max(v, 1e-8) for v in w2], "o-", color=f"C{k + 1}", ms=4, label=rung)
ax.set(xlabel=r"hidden-state index $\ell$ (depth)", ylabel=r"mean cosine $\rho_\ell$",
       title="clustering across depth (± s.e. over 6 sentences)")
bx.set(xlabel=r"hidden-state index $\ell$", ylabel=r"$W_2$ to the real token cloud", yscale="log",
       title="distance of each rung to the network")
ax.legend(fontsize=8)
bx.legend(fontsize=8)
fig.tight_layout()
plt.show()
