"""Learn head matrices so that the token flow reaches a target clustering (gradient descent through the solver).

Tokens x_i(0) are uniform on S²; token i is labelled ℓ_i = sign⟨x_i(0), u⟩ (u = e₁) and should
end, at time T, at the target centre ℓ_i c (c = e₃, orthogonal to u: the flow has to rotate
the two hemispheres onto two antipodal clusters).  The heads are learned as factors
Θ = (Q_h, K_h, V_h), H = 2, ω_h = 1 (``tp.Heads(query=Q, key=K, value=V)``); the loss

    L(Θ) = mean_i (1 − ⟨x_i(T; Θ), ℓ_i c⟩),    x(T; Θ) = tp.simulate(x(0), Θ, t1=T, direction="ascent")

is differentiated through the solver (backpropagation through Heun steps, or with
``--adjoint`` torchdiffeq's adjoint on the adaptive solver) and minimised with Adam on fresh
batches of token sets.  The held-out loss and the share of tokens that end in the right
hemisphere (⟨x_i(T), ℓ_i c⟩ > 0) are reported before and after training.

    python examples/learn_clustering.py             # ~1-2 minutes on 2 CPU cores
    python examples/learn_clustering.py --quick     # a few seconds
    python examples/learn_clustering.py --adjoint   # gradients by the adjoint ODE

Writes ``metrics.json``, ``series/training.csv`` and ``figures/learn_clustering.{png,pdf}``
into ``--out`` (default ``runs/examples/learn_clustering``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import torch

import transformer_pde as tp
from transformer_pde.application.rundir import RunDir

DTYPE = torch.float64


class ClusteringFlow(torch.nn.Module):
    """Learnable heads (Q_h, K_h, V_h) whose flow maps a token set to its final positions."""

    def __init__(self, heads: int = 2, dim: int = 3, *, scale: float = 0.5, t1: float = 2.0, dt: float = 0.1,
                 adjoint: bool = False, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.query = torch.nn.Parameter(scale * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.key = torch.nn.Parameter(scale * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.value = torch.nn.Parameter(scale * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.t1, self.dt, self.adjoint = t1, dt, adjoint

    def heads(self) -> tp.Heads:
        H = self.query.shape[0]
        return tp.Heads(query=self.query, key=self.key, value=self.value, weights=torch.ones(H, dtype=DTYPE))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """x0 (B, n, d) on the sphere -> x(T) (B, n, d)."""
        if self.adjoint:
            traj = tp.simulate(x0, self.heads(), t1=self.t1, dt=self.t1, method="adaptive", adjoint=True,
                               rtol=1e-6, atol=1e-8, direction="ascent", diagnostics=False)
        else:
            traj = tp.simulate(x0, self.heads(), t1=self.t1, dt=self.dt, method="heun", direction="ascent",
                               diagnostics=False, record_every=round(self.t1 / self.dt))
        return traj.final


def make_batch(batch: int, n: int, generator: torch.Generator, *, dim: int = 3):
    """Token sets (batch, n, d) uniform on the sphere and their targets ℓ_i c, (batch, n, d)."""
    u = torch.zeros(dim, dtype=DTYPE)
    u[0] = 1.0
    c = torch.zeros(dim, dtype=DTYPE)
    c[2] = 1.0
    x = tp.sphere.sample_uniform(n, dim, batch_shape=(batch,), generator=generator, dtype=DTYPE)
    label = torch.where(x @ u > 0, 1.0, -1.0).to(DTYPE)
    return x, label.unsqueeze(-1) * c


def loss_fn(xT: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (1 - (xT * target).sum(-1)).mean()


def evaluate(model: ClusteringFlow, x, target):
    with torch.no_grad():
        xT = model(x)
        return float(loss_fn(xT, target)), float(((xT * target).sum(-1) > 0).to(DTYPE).mean()), xT


def run(*, quick: bool = False, iters: Optional[int] = None, batch: int = 8, n: int = 24, lr: float = 0.05,
        adjoint: bool = False, seed: int = 0, out: Optional[Path] = None, progress: bool = True,
        verbose: bool = True) -> dict:
    """Train; returns the metrics (also written to ``out``/metrics.json)."""
    iters = iters if iters is not None else (12 if quick else 150)
    start = time.perf_counter()
    model = ClusteringFlow(adjoint=adjoint, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, iters))
    gen = torch.Generator().manual_seed(seed + 1)
    x_test, t_test = make_batch(16 if not quick else 4, n, torch.Generator().manual_seed(seed + 1000))
    loss0, acc0, xT0 = evaluate(model, x_test, t_test)
    history = {"iteration": [], "train_loss": []}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=iters, desc="learn_clustering", unit="it", leave=False, disable=None)  # a terminal only
    for it in range(iters):
        x, target = make_batch(batch, n, gen)
        loss = loss_fn(model(x), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history["iteration"].append(it)
        history["train_loss"].append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    if bar is not None:
        bar.close()
    loss1, acc1, xT1 = evaluate(model, x_test, t_test)
    metrics = {
        "iterations": iters, "adjoint": adjoint,
        "test_loss_initial": loss0, "test_loss_final": loss1,
        "test_accuracy_initial": acc0, "test_accuracy_final": acc1,
        "wall_time": time.perf_counter() - start,
    }
    if verbose:
        print(f"learn_clustering ({'adjoint, adaptive' if adjoint else 'backprop, heun'}; direction: ascent): "
              f"{iters} Adam steps")
        print(f"  held-out loss      {loss0:.4f} -> {loss1:.4f}")
        print(f"  tokens in the right cluster hemisphere {acc0:.3f} -> {acc1:.3f}")
        print(f"  wall time {metrics['wall_time']:.1f} s")
    if out is not None:
        rd = RunDir.for_script(Path(out), "example:learn_clustering")
        rd.write_json("metrics.json", metrics)
        rd.save_series("training", history)
        _figure(rd, history, x_test, t_test, xT0, xT1)
    return metrics


def _figure(rd, history, x0, target, xT0, xT1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot(1, 3, 1)
    ax.plot(history["iteration"], history["train_loss"])
    ax.set_xlabel("Adam step")
    ax.set_ylabel("training loss")
    ax.set_title("learning the heads (ascent)")
    colour = (target[..., 2] > 0).flatten().numpy()
    for k, (xs, title) in enumerate(((xT0, "x(T), initial heads"), (xT1, "x(T), learned heads"))):
        a = fig.add_subplot(1, 3, 2 + k)
        p = xs.reshape(-1, xs.shape[-1]).numpy()
        a.scatter(p[:, 0], p[:, 2], c=colour, cmap="coolwarm", s=8)
        a.scatter([0, 0], [1, -1], marker="*", s=120, c="k")
        a.set_xlabel("⟨x, u⟩ (label direction)")
        a.set_ylabel("⟨x, c⟩ (target centres ±c)")
        a.set_title(title, fontsize=9)
        a.set_xlim(-1.05, 1.05)
        a.set_ylim(-1.05, 1.05)
        a.set_aspect("equal")
    rd.save_figure(fig, "learn_clustering")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few Adam steps (seconds)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--adjoint", action="store_true", help="adaptive solver with adjoint gradients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/examples/learn_clustering"))
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return run(quick=a.quick, iters=a.iters, lr=a.lr, adjoint=a.adjoint, seed=a.seed, out=a.out)


if __name__ == "__main__":
    main()
