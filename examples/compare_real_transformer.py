"""Compare a real ``torch.nn.TransformerEncoder`` with the mean-field flow of its own heads.

A randomly initialised stack of ``TransformerEncoderLayer`` (float64, no dropout) is read layer
by layer with :func:`transformer_pde.layerwise_from_transformer` (layer l holds on [l, l+1),
β = d/√k for tokens of norm √d, the scale a LayerNorm gives).  From the same unit tokens we
follow, layer by layer and normalised to the sphere:

* ``block``    the idealised residual block the model keeps, x ← normalise(x + MHA(√d x)/√d)
               (:func:`transformer_pde.residual_attention_step`);
* ``euler``    ``tp.simulate(..., method="euler", dt=1)``: one projected-Euler step per layer,
               equal to ``block`` up to O(step²) per layer;
* ``flow``     the mean-field ODE of the same heads, ``tp.simulate(..., method="adaptive")``,
               the continuous-depth limit (direction "ascent": x + attention(x));
* ``attn_ln``  the real attention sublayer with the real LayerNorm, z ← LN(z + MHA(z)) (no MLP);
* ``full``     the real layer (attention + MLP + LayerNorms), for contrast.

It then refines the network without changing its weights, splitting every layer into m blocks
of step 1/m (x ← normalise(x + MHA(x)/m), m times), and shows that the refined network
converges to the flow at first order in 1/m: the mean-field model is the small-step limit of
the idealised block, and the table says how far the real layer is from it.

    python examples/compare_real_transformer.py            # 10-30 s on 2 CPU cores
    python examples/compare_real_transformer.py --quick    # a few seconds

Writes ``metrics.json``, ``series/discrepancy.csv``, ``series/refinement.csv`` and
``figures/compare_real_transformer.{png,pdf}`` into ``--out`` (default
``runs/examples/compare_real_transformer``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

import transformer_pde as tp
from transformer_pde.application.rundir import RunDir


def build_model(d: int, heads: int, layers: int, *, gain: float = 1.5, seed: int = 0,
                dtype=torch.float64) -> torch.nn.TransformerEncoder:
    """A random post-norm encoder (PyTorch's default init), attention weights scaled by ``gain``."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(dtype).eval()
    with torch.no_grad():
        for lay in model.layers:
            lay.self_attn.in_proj_weight.mul_(gain)
            lay.self_attn.out_proj.weight.mul_(gain)
    return model


@torch.no_grad()
def network_trajectories(model, x0: torch.Tensor, *, refine: int = 1) -> Dict[str, torch.Tensor]:
    """Token trajectories (L+1, n, d) through the network, normalised to the unit sphere."""
    d = x0.shape[-1]
    r = math.sqrt(d)
    block, attn_ln, full = [x0], [x0], [x0]
    x, za, zf = x0, r * x0, r * x0
    for lay in model.layers:
        for _ in range(refine):
            x = tp.residual_attention_step(lay, x, step=1.0 / refine, token_norm=r)
        block.append(x)
        if refine == 1:
            za = lay.norm1(za + lay.self_attn(za, za, za, need_weights=False)[0])
            attn_ln.append(tp.sphere.normalize(za))
            zf = lay(zf.unsqueeze(0)).squeeze(0)
            full.append(tp.sphere.normalize(zf))
    out = {"block": torch.stack(block)}
    if refine == 1:
        out["attn_ln"] = torch.stack(attn_ln)
        out["full"] = torch.stack(full)
    return out


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean geodesic distance between corresponding tokens, per layer: (L+1,)."""
    return tp.sphere.geodesic_distance(a, b).mean(-1)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    lx = torch.log(torch.tensor(xs, dtype=torch.float64))
    ly = torch.log(torch.tensor(ys, dtype=torch.float64))
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())


def run(*, quick: bool = False, d: Optional[int] = None, heads: Optional[int] = None, layers: Optional[int] = None,
        n: Optional[int] = None, gain: float = 1.5, seed: int = 0, refinements: Optional[Sequence[int]] = None,
        rtol: float = 1e-8, out: Optional[Path] = None, verbose: bool = True) -> dict:
    """Run the comparison; returns the metrics (also written to ``out``/metrics.json)."""
    d = d or (8 if quick else 16)
    heads = heads or (2 if quick else 4)
    layers = layers or (3 if quick else 6)
    n = n or (12 if quick else 48)
    refinements = list(refinements or ((2, 4, 8) if quick else (1, 2, 4, 8, 16, 32)))
    if quick:
        rtol = max(rtol, 1e-7)
    start = time.perf_counter()
    model = build_model(d, heads, layers, gain=gain, seed=seed)
    x0 = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    theta = tp.layerwise_from_transformer(model, token_norm=math.sqrt(d), detach=True)
    L = float(layers)
    flow = tp.simulate(x0, theta, t1=L, dt=1.0, method="adaptive", direction="ascent", rtol=rtol, atol=rtol * 1e-2,
                       diagnostics=False).x
    euler = tp.simulate(x0, theta, t1=L, dt=1.0, method="euler", direction="ascent", diagnostics=False).x
    net = network_trajectories(model, x0)
    series = {
        "layer": torch.arange(layers + 1),
        "moved": _distance(flow, x0),
        "block_vs_flow": _distance(net["block"], flow),
        "euler_vs_block": _distance(euler, net["block"]),
        "attn_ln_vs_flow": _distance(net["attn_ln"], flow),
        "attn_ln_vs_block": _distance(net["attn_ln"], net["block"]),
        "full_vs_flow": _distance(net["full"], flow),
        "full_vs_block": _distance(net["full"], net["block"]),
    }
    refined = []
    for m in refinements:
        xb = net["block"] if m == 1 else network_trajectories(model, x0, refine=m)["block"]
        refined.append(float(_distance(xb, flow)[-1]))
    metrics = {
        "d": d, "heads": heads, "layers": layers, "n": n, "gain": gain,
        "final_moved": float(series["moved"][-1]),
        **{f"final_{k}": float(v[-1]) for k, v in series.items() if k not in ("layer", "moved")},
        "refinements": refinements,
        "refined_block_vs_flow": refined,
        # fitted on the three finest refinements (the coarsest are pre-asymptotic)
        "refinement_order": _slope([1.0 / m for m in refinements[-3:]], refined[-3:]),
        "wall_time": time.perf_counter() - start,
    }
    if verbose:
        print(f"random TransformerEncoder: d = {d}, H = {heads}, L = {layers} layers, n = {n} tokens "
              f"(direction: ascent, x + attention(x))")
        print("mean geodesic distance per layer (tokens moved by the flow: "
              + ", ".join(f"{v:.3f}" for v in series["moved"].tolist()) + ")")
        print(f"{'layer':>5} {'block-flow':>11} {'euler-block':>12} {'attnLN-flow':>12} {'full-flow':>10} {'full-block':>11}")
        for l in range(layers + 1):
            print(f"{l:>5d} {float(series['block_vs_flow'][l]):>11.4f} {float(series['euler_vs_block'][l]):>12.2e} "
                  f"{float(series['attn_ln_vs_flow'][l]):>12.4f} {float(series['full_vs_flow'][l]):>10.4f} "
                  f"{float(series['full_vs_block'][l]):>11.4f}")
        print("network refined into m blocks of step 1/m per layer vs the flow (final layer):")
        for m, e in zip(refinements, refined):
            print(f"  m = {m:>3d}: {e:.4e}")
        print(f"  observed order in 1/m (three finest): {metrics['refinement_order']:.3f} (expected 1)")
        print(f"wall time {metrics['wall_time']:.1f} s")
    if out is not None:
        rd = RunDir.for_script(Path(out), "example:compare_real_transformer")
        rd.write_json("metrics.json", metrics)
        rd.save_series("discrepancy", series)
        rd.save_series("refinement", {"m": refinements, "block_vs_flow": refined})
        _figure(rd, series, refinements, refined)
    return metrics


def _figure(rd: RunDir, series, refinements, refined):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    layer = series["layer"].numpy()
    for key, label in (("block_vs_flow", "idealised block vs flow"), ("attn_ln_vs_flow", "attention + LayerNorm vs flow"),
                       ("full_vs_flow", "full layer (with MLP) vs flow"), ("euler_vs_block", "simulate(euler, dt=1) vs block"),
                       ("moved", "distance moved by the flow")):
        ax1.plot(layer, series[key].numpy(), marker="o", label=label, ls="--" if key == "moved" else "-")
    ax1.set_xlabel("layer (time t)")
    ax1.set_ylabel("mean geodesic distance")
    ax1.set_title("real transformer vs mean-field flow (ascent)")
    ax1.legend(fontsize=7)
    h = [1.0 / m for m in refinements]
    ax2.loglog(h, refined, "o-", label="refined network vs flow")
    ax2.loglog(h, [refined[-1] * x / h[-1] for x in h], "k:", label="slope 1")
    ax2.set_xlabel("step 1/m of the refined residual block")
    ax2.set_title("continuous-depth limit (ascent)")
    ax2.legend(fontsize=8)
    rd.save_figure(fig, "compare_real_transformer")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small and fast (a few seconds)")
    p.add_argument("--d", type=int, default=None, help="model dimension d")
    p.add_argument("--heads", type=int, default=None, help="number of heads H (d must be a multiple)")
    p.add_argument("--layers", type=int, default=None, help="number of layers L")
    p.add_argument("--n", type=int, default=None, help="number of tokens")
    p.add_argument("--gain", type=float, default=1.5, help="scale of the attention weights over PyTorch's init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/examples/compare_real_transformer"))
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return run(quick=a.quick, d=a.d, heads=a.heads, layers=a.layers, n=a.n, gain=a.gain, seed=a.seed, out=a.out)


if __name__ == "__main__":
    main()
