"""A small demonstration study: tokens on S² under OU heads, energy ledger and a snapshot."""

from __future__ import annotations

import torch

import transformer_pde as tp

from .. import plotting
from . import Option, check_whole_steps, dtype_of, positive, step_callback, study

OPTIONS = {
    "n": Option(64, (int,), "number of tokens", check=positive),
    "heads": Option(4, (int,), "number of heads H", check=positive),
    "t1": Option(2.0, (float,), "final time", check=positive),
    "dt": Option(0.01, (float,), "time step", check=positive),
    "paths": Option(4, (int,), "Monte-Carlo paths of the OU weights", check=positive),
    "seed": Option(0, (int,), "seed of the weights (tokens use seed + 1)"),
}


@study("demo", OPTIONS, "a few-second tour: OU heads on S², energy ledger, token snapshots",
       validate=check_whole_steps)
def run_demo(params, run):
    dtype = dtype_of(params)
    g = torch.Generator().manual_seed(params["seed"] + 1)
    x0 = tp.sphere.sample_uniform(params["n"], 3, generator=g, dtype=dtype)
    heads = tp.Heads.random(params["heads"], 3, generator=torch.Generator().manual_seed(params["seed"]), dtype=dtype)
    traj = tp.solve(tp.Model(tp.OrnsteinUhlenbeck(heads), normalization="softmax", direction="descent"), x0,
                    tp.Euler(), t1=params["t1"], dt=params["dt"], paths=params["paths"], seed=params["seed"],
                    ledger=tp.LedgerOptions(ledger=True),
                    progress=tp.Progress(show=run.progress, callback=step_callback(run, "demo")))
    led = traj.ledger
    metrics = {
        "energy_final_mean": float(traj.energy[-1].mean()),
        "slope_time_average": float(traj.time_average(traj.slope).mean()),
        "residual_final_abs_mean": float(led["residual"][-1].abs().mean()),
        "residual_slope_final_abs_mean": float(led["residual_slope"][-1].abs().mean()),
    }
    run.save_series("ledger", {"t": traj.times, **{k: v.mean(-1) for k, v in led.items()}})
    desc = f"OU heads, H = {params['heads']}, n = {params['n']}, {params['paths']} paths, descent"
    fig = plotting.plot_ledger(traj.times, led, sign=-1.0, title=f"demo: energy ledger, {desc}")
    run.save_figure(fig, "ledger")
    x = traj.x.detach().cpu()
    x = x[:, 0] if x.dim() == 4 else x  # (T, paths, n, d) -> path 0
    fig = plotting.sphere_snapshots([("path 0", x)], traj.times.cpu(), 4, title=f"demo: tokens on S² ({desc})",
                                    caption="Tokens of Monte-Carlo path 0 at evenly spaced recorded times. "
                                    + plotting.snapshot_caption(3, traj.times.cpu()[
                                        plotting.snapshot_indices(traj.times.cpu(), 4)]))
    run.save_figure(fig, "snapshots")
    return metrics
