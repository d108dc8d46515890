"""Training continuous-depth attention on handwritten digits
=========================================================

A classifier whose attention block is :class:`transformer_pde.nn.MeanFieldAttention` — the tokens
(the 8 rows of an 8×8 digit, embedded and normalised onto the sphere) are carried through depth
by ``tp.solve`` — trained for two epochs on scikit-learn's ``load_digits``, once plainly and once
with the kinetic regulariser λ·Σ|x_{k+1} − x_k|²/Δt (the action of the solver's steps,
OT-Transformer's λ∫‖v‖²dt).  Left: test accuracy per epoch.  Right: the mean cosine of the
tokens along depth for the trained flows: the regularised flow moves its tokens less.  The full
study with a seed ensemble and a discrete transformer of the same size is
``transformer-pde run experiments/train_digits.toml`` (docs/training.md).
"""

import matplotlib.pyplot as plt
import torch

import transformer_pde as tp
from transformer_pde.application.studies.training import DigitClassifier, load_digit_tokens

torch.manual_seed(0)
data = load_digit_tokens("rows")
x, y = data["x_train"], data["y_train"]


def train(lam, epochs=2, batch=32):
    torch.manual_seed(0)  # the same initialisation and batches for every λ
    body = tp.nn.MeanFieldAttention(16, 2, layers=2, t1=1.0, steps=2, feedforward=32)
    model = DigitClassifier(body, tokens=8, pixels=8, dim=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    accuracy = []
    for _ in range(epochs):
        for b in torch.randperm(len(y)).split(batch):
            logits, action = model(x[b], kinetic="displacement")
            loss = torch.nn.functional.cross_entropy(logits, y[b]) + lam * action.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            accuracy.append(float((model(data["x_test"]).argmax(-1) == data["y_test"]).float().mean()))
    return model, accuracy


fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4))
for k, lam in enumerate([0.0, 0.1]):
    model, accuracy = train(lam)
    with torch.no_grad():
        tr = model.body.trajectory(model.tokens(data["x_test"][:128]))
        cos = tp.clustering.cluster_statistics(tr["x"], gram_rank=False)["mean_overlap"].mean(-1)
    ax0.plot(range(1, len(accuracy) + 1), accuracy, marker="o", color=f"C{k}", label=f"λ = {lam:g}")
    ax1.plot(tr["times"], cos, color=f"C{k}", label=f"λ = {lam:g}, action {float(tr['displacement'].mean()):.3f}")
ax0.set(xlabel="epoch", ylabel="test accuracy", title="digits: continuous-depth attention")
ax1.set(xlabel="depth t", ylabel="mean cosine of the tokens", title="trained flows along depth")
ax0.legend()
ax1.legend()
plt.show()
