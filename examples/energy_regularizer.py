"""The metric slope 𝒢² (or the energy) as a regulariser inside a training loop.

A set classifier: each sample is a set of n = 16 tokens on S³ scattered around e₁ (class 0)
or e₂ (class 1) with heavy noise.  The tokens flow for a time T under learned heads
(``tp.Heads(query=Q, key=K, value=V)``, H = 2, direction "ascent": x + attention(x)), and a
linear read-out of their mean at time T gives the logit.  The training loss is

    cross-entropy + λ · R,   R = ∫_0^T 𝒢²(μ_t, Θ) dt   (``traj.ledger["slope"][-1]``, the default)
                          or R = E(μ_T, Θ)             (``--regularizer energy``)

where 𝒢² = ∫ b |V|² dμ is the metric slope: ∫𝒢² dt is the kinetic cost of the transport
in the weighted Wasserstein metric of the model, the analogue of the kinetic-energy
regularisation of neural ODEs.  The script trains twice, with λ = 0 and λ > 0, and compares
held-out accuracy, ∫𝒢² dt, the energy and the number of field evaluations that the adaptive
solver needs for the learned flow (regularised flows are straighter and cheaper to solve).

    python examples/energy_regularizer.py             # 120 Adam steps, ~2-3 minutes on 2 CPU cores
    python examples/energy_regularizer.py --quick     # 30 Adam steps of 16 sets, about a minute

The regulariser first pulls the flow towards rest (∫𝒢² dt falls within a few steps) and only
then does the read-out catch up: after 8 Adam steps the λ = 1 model is still behind (held-out
accuracy 0.73 against 0.92 for λ = 0, an earlier quick mode); from about 30 steps on both
reach the same accuracy while the regularised flow has a far smaller ∫𝒢² dt and needs fewer
field evaluations of the adaptive solver.

Writes ``metrics.json``, ``series/training.csv`` and ``figures/energy_regularizer.{png,pdf}``
into ``--out`` (default ``runs/examples/energy_regularizer``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import transformer_pde as tp
from transformer_pde.application.rundir import RunDir

DTYPE = torch.float64


class FlowClassifier(torch.nn.Module):
    """Tokens → flow of learned heads for time T → linear read-out of the mean token."""

    def __init__(self, dim: int = 4, heads: int = 2, *, t1: float = 1.5, dt: float = 0.1, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.query = torch.nn.Parameter(0.5 * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.key = torch.nn.Parameter(0.5 * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.value = torch.nn.Parameter(0.5 * torch.randn(heads, dim, dim, generator=g, dtype=DTYPE))
        self.readout = torch.nn.Linear(dim, 1).to(DTYPE)
        torch.nn.init.zeros_(self.readout.weight)
        torch.nn.init.zeros_(self.readout.bias)
        self.t1, self.dt = t1, dt

    def heads(self) -> tp.Heads:
        H = self.query.shape[0]
        return tp.Heads(query=self.query, key=self.key, value=self.value, weights=torch.ones(H, dtype=DTYPE))

    def forward(self, x0: torch.Tensor, *, diagnostics: bool = True):
        """x0 (B, n, d) -> (logits (B,), trajectory with energy, 𝒢² and the ledger)."""
        traj = tp.simulate(x0, self.heads(), t1=self.t1, dt=self.dt, method="heun", direction="ascent",
                           diagnostics=diagnostics, ledger=diagnostics, record_every=round(self.t1 / self.dt))
        return self.readout(traj.final.mean(-2)).squeeze(-1), traj


def make_batch(batch: int, n: int, generator: torch.Generator, *, dim: int = 4, noise: float = 1.2):
    y = torch.randint(0, 2, (batch,), generator=generator)
    centre = torch.eye(dim, dtype=DTYPE)[y]
    x = tp.sphere.normalize(centre.unsqueeze(-2) + noise * torch.randn(batch, n, dim, generator=generator, dtype=DTYPE))
    return x, y.to(DTYPE)


def regularizer(traj, kind: str) -> torch.Tensor:
    if kind == "slope":
        return traj.ledger["slope"][-1].mean()  # ∫_0^T 𝒢² dt
    if kind == "energy":
        return traj.energy[-1].mean()
    raise ValueError(f"unknown regularizer {kind!r}; choose 'slope' or 'energy'")


@torch.no_grad()
def assess(model: FlowClassifier, x, y) -> dict:
    logits, traj = model(x)
    adaptive = tp.simulate(x, model.heads(), t1=model.t1, dt=model.t1, method="adaptive", direction="ascent",
                           rtol=1e-6, atol=1e-8, diagnostics=False)
    return {
        "accuracy": float(((logits > 0).to(DTYPE) == y).to(DTYPE).mean()),
        "cross_entropy": float(F.binary_cross_entropy_with_logits(logits, y)),
        "kinetic": float(traj.ledger["slope"][-1].mean()),
        "energy": float(traj.energy[-1].mean()),
        "adaptive_nfe": int(adaptive.stats["field_evaluations"]),
    }


def train(lam: float, *, kind: str, iters: int, batch: int, n: int, lr: float, seed: int, x_test, y_test,
          progress: bool = True):
    model = FlowClassifier(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    history = {"task": [], "reg": []}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=iters, desc=f"train λ={lam:g}", unit="it", leave=False, disable=None)  # a terminal only
    for _ in range(iters):
        x, y = make_batch(batch, n, gen)
        logits, traj = model(x)
        task = F.binary_cross_entropy_with_logits(logits, y)
        reg = regularizer(traj, kind)
        loss = task + lam * reg
        opt.zero_grad()
        loss.backward()
        opt.step()
        history["task"].append(float(task.detach()))
        history["reg"].append(float(reg.detach()))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return model, history, assess(model, x_test, y_test)


def run(*, quick: bool = False, iters: Optional[int] = None, lambdas: Sequence[float] = (0.0, 1.0),
        regularizer_kind: str = "slope", batch: Optional[int] = None, n: int = 16, lr: float = 0.05, seed: int = 0,
        test_size: Optional[int] = None, out: Optional[Path] = None, progress: bool = True,
        verbose: bool = True) -> dict:
    """Train once per λ; returns the metrics (also written to ``out``/metrics.json)."""
    if regularizer_kind not in ("slope", "energy"):
        raise ValueError(f"unknown regularizer {regularizer_kind!r}; choose 'slope' or 'energy'")
    iters = iters if iters is not None else (30 if quick else 120)
    batch = batch if batch is not None else (16 if quick else 32)
    start = time.perf_counter()
    test_size = test_size or (128 if quick else 256)
    x_test, y_test = make_batch(test_size, n, torch.Generator().manual_seed(seed + 1000))
    results, histories = {}, {}
    for lam in lambdas:
        _, hist, res = train(lam, kind=regularizer_kind, iters=iters, batch=batch, n=n, lr=lr, seed=seed,
                             x_test=x_test, y_test=y_test, progress=progress)
        results[f"{lam:g}"] = res
        histories[lam] = hist
    metrics = {"regularizer": regularizer_kind, "iterations": iters, "lambdas": list(lambdas), "results": results,
               "wall_time": time.perf_counter() - start}
    if verbose:
        label = "∫𝒢² dt" if regularizer_kind == "slope" else "E(T)"
        print(f"energy_regularizer: loss = cross-entropy + λ·{label}, {iters} Adam steps (direction: ascent)")
        print(f"{'λ':>6} {'accuracy':>9} {'x-entropy':>10} {'∫𝒢² dt':>9} {'E(T)':>8} {'adaptive NFE':>13}")
        for lam in lambdas:
            r = results[f"{lam:g}"]
            print(f"{lam:>6g} {r['accuracy']:>9.3f} {r['cross_entropy']:>10.4f} {r['kinetic']:>9.4f} "
                  f"{r['energy']:>8.4f} {r['adaptive_nfe']:>13d}")
        print(f"wall time {metrics['wall_time']:.1f} s")
    if out is not None:
        rd = RunDir.for_script(Path(out), "example:energy_regularizer")
        rd.write_json("metrics.json", metrics)
        cols = {"iteration": list(range(iters))}
        for lam, h in histories.items():
            cols[f"task_lambda_{lam:g}"] = h["task"]
            cols[f"reg_lambda_{lam:g}"] = h["reg"]
        rd.save_series("training", cols)
        _figure(rd, histories, regularizer_kind)
    return metrics


def _figure(rd, histories, kind):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    for lam, h in histories.items():
        ax1.plot(h["task"], label=f"λ = {lam:g}")
        ax2.semilogy(h["reg"], label=f"λ = {lam:g}")
    ax1.set_xlabel("Adam step")
    ax1.set_ylabel("cross-entropy (training batch)")
    ax1.set_title("task loss (ascent flow)")
    ax2.set_xlabel("Adam step")
    ax2.set_ylabel("∫ G² dt" if kind == "slope" else "E(T)")
    ax2.set_title("regulariser")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    rd.save_figure(fig, "energy_regularizer")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="30 Adam steps of 16 sets (about a minute)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--regularizer", choices=("slope", "energy"), default="slope")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/examples/energy_regularizer"))
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return run(quick=a.quick, iters=a.iters, lambdas=a.lambdas, regularizer_kind=a.regularizer, lr=a.lr,
               seed=a.seed, out=a.out)


if __name__ == "__main__":
    main()
