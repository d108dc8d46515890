"""What the diagnostics cost on every solver path that records them, as paired ratios to the bare step.

For each path the same solve runs three ways, interleaved, in this process:

* **bare**: ``LedgerOptions(diagnostics=False)``, tokens only;
* **recorded**: the default ``LedgerOptions()``: E, 𝒢², 𝒟 computed lazily at the recorded times, and read
  (``traj.energy``, ``traj.slope``, ``traj.dissipation``), so the timing includes them; recorded at every
  step (``--every 1``, the worst case) and at the path's own stride;
* **at the record steps**: ``LedgerOptions(records="step")``: E, 𝒢², 𝒟 from each recorded step's own field
  evaluation during the solve (at every step and at the path's stride), read;
* **ledger**: ``LedgerOptions(ledger=True)``: E, 𝒢², 𝒟 and the energy ledger at every step.

Paths: the paper's merged H = 100 reference step (n = 200 on S², 10 OU paths, float64); post-LN on the peers'
workload (256 systems × 32 tokens × d = 16, 8 heads); causal attention; noisy tokens (temperature); and a
training step with autograd (``tp.nn.MeanFieldAttention`` forward + backward, without and with the kinetic
term ∫𝒢² dt, ``LedgerOptions(kinetic=True)``: 𝒢² from each step's own field evaluation).

Each ratio is the median over ``--repeats`` pairs of (variant CPU time) / (bare CPU time measured right
before it), with the range; the CPU time of the process is used so that a busy machine inflates both
sides alike.  ``--load K`` repeats the whole measurement with K busy processes per core started by the
script (spinning Python loops, niceness 0), so one run reports the idle and the loaded ratios side by side.

    python scripts/benchmark_diagnostics.py                 # idle, then 2 busy processes per core
    python scripts/benchmark_diagnostics.py --load 0 --paths post_ln causal
    python scripts/benchmark_diagnostics.py --load 0 --paths noisy --noisy-tokens 200 500 1000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402
from transformer_pde.utils import hardware  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def _particle_path(name, x0, theta, steps, dt, every, **kw):
    """The variants of one particle solve (``tp.simulate`` with the public keywords), as closures returning the
    values a user reads."""
    kw = dict(t1=steps * dt, dt=dt, seed=0, progress=False, **kw)

    def bare():
        return tp.simulate(x0, theta, diagnostics=False, **kw).final

    def recorded(k, records="lazy"):
        def run():
            tr = tp.simulate(x0, theta, record_every=k, records=records, **kw)
            return tr.energy, tr.slope, tr.dissipation
        return run

    def ledger():
        tr = tp.simulate(x0, theta, ledger=True, **kw)
        return tr.energy, tr.ledger["residual"] if "residual" in tr.ledger else tr.ledger["dE"]

    variants = {"recorded, every step": recorded(1), "at the steps, every step": recorded(1, "step")}
    if every > 1:
        variants[f"recorded, every {every}"] = recorded(every)
        variants[f"at the steps, every {every}"] = recorded(every, "step")
    variants["ledger (every step)"] = ledger
    return name, bare, variants


def paths_of(names, noisy_tokens=(200,)):
    f64 = torch.float64
    out = []
    if "merged" in names:
        n, H = 200, 100
        x0 = tp.sphere.octahedral(n, dtype=f64)
        Z = torch.randn(H, 3, 3, generator=_gen(1), dtype=f64)
        heads = tp.Heads(Z + Z.transpose(-1, -2), weights=torch.full((H,), 1.0 / H, dtype=f64))
        theta = tp.OrnsteinUhlenbeck(heads, mean=torch.eye(3, dtype=f64))
        out.append(_particle_path("merged H=100 (OU, 10 paths, n=200, d=3)", x0, theta, 10, 5e-3, 5, paths=10,
                                  direction="descent"))
    if "post_ln" in names:
        B, n, d, H = 256, 32, 16, 8
        x0 = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=_gen(2), dtype=f64)
        A = torch.randn(B, H, d, d, generator=_gen(3), dtype=f64) / d ** 0.5
        V = torch.randn(B, H, d, d, generator=_gen(4), dtype=f64) / d ** 0.5
        out.append(_particle_path("post-LN (256 x 32, d=16, H=8)", x0, tp.Heads(A, V), 20, 0.1, 10, layer_norm="post",
                                  direction="ascent"))
    if "causal" in names:
        B, n, d, H = 64, 32, 16, 4
        x0 = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=_gen(5), dtype=f64)
        A = torch.randn(H, d, d, generator=_gen(6), dtype=f64) / d ** 0.5
        out.append(_particle_path("causal (64 x 32, d=16, H=4)", x0, tp.Heads(A, A.transpose(-1, -2) @ A), 20, 0.05,
                                  10, causal=True, direction="ascent"))
    for n in (noisy_tokens if "noisy" in names else ()):
        H = 10
        x0 = tp.sphere.sample_uniform(n, 3, generator=_gen(7), dtype=f64)
        heads = tp.Heads.scalar(torch.linspace(0.5, 2.0, H, dtype=f64).tolist(), 3).to(f64)
        out.append(_particle_path(f"noisy tokens (T=0.1, n={n}, d=3, H=10)", x0, heads, 20, 0.01, 10,
                                  temperature=0.1, direction="ascent"))
    if "training" in names:
        torch.manual_seed(0)
        layer = tp.nn.MeanFieldAttention(16, 4, layers=2, steps=4).double()
        x = tp.sphere.sample_uniform(32, 16, batch_shape=(64,), generator=_gen(8), dtype=f64)

        def step(kinetic):
            def run():
                layer.zero_grad()
                out = layer(x, kinetic=kinetic)
                loss = (out[0].sum() + out[1].sum()) if kinetic else out.sum()
                loss.backward()
                return loss.detach()
            return run

        out.append(("training step (64 x 32, d=16, H=4, 2 layers x 4 Euler steps)", step(False),
                    {"kinetic ∫𝒢²dt (kinetic=True)": step(True)}))
    return out


def measure(paths, repeats):
    rows = []
    for name, bare, variants in paths:
        bare()  # warm up (allocations, kernel choice)
        for fn in variants.values():
            fn()
        ratios = {k: [] for k in variants}
        bares = []
        for _ in range(repeats):
            for key, fn in variants.items():
                t = time.process_time()
                bare()
                tb = time.process_time() - t
                t = time.process_time()
                fn()
                ratios[key].append((time.process_time() - t) / tb)
                bares.append(tb)
        rows.append((name, ratios, statistics.median(bares)))
    return rows


def report(rows, label):
    print(f"\n{label}: load average {os.getloadavg()[0]:.2f}")
    for name, ratios, bare in rows:
        print(f"  {name}: bare {bare * 1e3:.1f} ms CPU (median)")
        for key, r in ratios.items():
            print(f"    {key:30s} median {statistics.median(r):5.2f}  [{min(r):.2f}, {max(r):.2f}]  "
                  f"({len(r)} pairs)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", default=["merged", "post_ln", "causal", "noisy", "training"],
                    choices=["merged", "post_ln", "causal", "noisy", "training"])
    ap.add_argument("--noisy-tokens", type=int, nargs="+", default=[200], metavar="N",
                    help="token counts of the noisy path (one path each): the ledger's fixed per-step cost against n")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load", type=int, default=2, help="busy processes per core for the loaded pass (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caches = hardware.cache_sizes()
    print(f"{hardware.cpu_model()}, {os.cpu_count()} CPUs, L2 {caches.l2 // 1024} KiB; torch {torch.__version__}, "
          f"{args.threads} thread(s); ratios = variant CPU time / bare CPU time of the pair")
    paths = paths_of(args.paths, args.noisy_tokens)
    report(measure(paths, args.repeats), "no added load")
    if args.load > 0:
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load * os.cpu_count())]
        for p in procs:
            p.start()
        try:
            time.sleep(2.0)
            report(measure(paths, args.repeats), f"{len(procs)} busy processes ({args.load} per core)")
        finally:
            stop.set()
            for p in procs:
                p.join()


if __name__ == "__main__":
    main()
