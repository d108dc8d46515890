"""Time of the softmax field of value-factored heads: moments first vs values first, vs an attention layer.

Heads shaped like one MiniLM layer (d = 384, H = 12, query/key/value factors of rank k = 32, random,
β = r²/√k with token norm r = √d), B = 64 sentences × n = 64 tokens on the sphere, token weights with
padding (sentence b has 64 − (b mod 24) real tokens; zero weight on the rest).  Measured side by side in
one run, each case repeated ``--reps`` times interleaved (median, and min–max over the repeats):

* ``evaluate``: one ``tp.evaluate(..., diagnostics=False)`` (the field only);
* ``solve 1`` / ``solve N``: ``tp.solve`` of the constant heads, Euler, ``LedgerOptions(diagnostics=False)``,
  one step and ``--steps`` steps (each solve evaluates the field once at t0 and once per step);

for the moments-first order ("old": ȳ_h = Σ_j p_ij y_j, d-dimensional, then O_h W_{V,h}; forced here by
switching the values-first routing of :mod:`transformer_pde.model.field` off) and the values-first order
("new": averages of W_{V,h} y_j, k_v-dimensional, then O_h), each under the kernel backends "chunked" and
"sdpa" (:func:`transformer_pde.model.backends.kernel_backend`); and ``torch.nn.MultiheadAttention``'s
forward on the same shapes (bias-free, ``key_padding_mask``, ``need_weights=False``) as the cost of a real
attention layer.  Ratios are to the MultiheadAttention forward.

    python scripts/benchmark_value_factors.py                  # float32, torch's thread count
    python scripts/benchmark_value_factors.py --threads 2 --dtype float64 --reps 7

The cores may be shared with other jobs: the load average is printed before and after; compare ratios
measured in the same run, not times across runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

import transformer_pde as tp
from transformer_pde.model import field as field_module
from transformer_pde.model.backends import kernel_backend
from transformer_pde.processes.weights import Constant
from transformer_pde.solvers.particle.methods import Euler
from transformer_pde.dynamics.model import Model
from transformer_pde.solvers.options import LedgerOptions, SaveAt
from transformer_pde.solvers.solve import solve


def problem(dtype, B=64, n=64, d=384, H=12, k=32, seed=0):
    """(tokens (B, n, d), weights (B, n), heads, module): random MiniLM-shaped factors, the same maps in a
    torch.nn.MultiheadAttention."""
    g = torch.Generator().manual_seed(seed)
    Q, K, Wv = (torch.randn(H, k, d, generator=g, dtype=dtype) / math.sqrt(d) for _ in range(3))
    O = torch.randn(H, d, k, generator=g, dtype=dtype) / math.sqrt(k)
    beta = d / math.sqrt(k)  # r² / √k with r = √d
    heads = tp.Heads(None, None, torch.ones(H, dtype=dtype), beta, query=Q, key=K, value_in=Wv, value_out=O)
    x = tp.sphere.normalize(torch.randn(B, n, d, generator=g, dtype=dtype))
    real = n - torch.arange(B) % 24  # padded sentences
    mask = torch.arange(n).unsqueeze(0) < real.unsqueeze(1)
    w = mask.to(dtype)
    w = w / w.sum(-1, keepdim=True)
    mha = torch.nn.MultiheadAttention(d, H, bias=False, batch_first=True, dtype=dtype)
    with torch.no_grad():  # the same maps: rows h·k … h·k + k − 1 of the in-projection are head h's factors
        mha.in_proj_weight.copy_(torch.cat([Q.reshape(H * k, d), K.reshape(H * k, d), Wv.reshape(H * k, d)]))
        mha.out_proj.weight.copy_(O.transpose(0, 1).reshape(d, H * k))
    return x, w, heads, mha, ~mask


def run_solve(x, w, heads, steps):
    dt = 0.1
    model = Model(Constant(heads), normalization="softmax", direction="ascent", layer_norm="none", weights=w)
    return solve(model, x, Euler(), t1=dt * steps, dt=dt, saveat=SaveAt(record_every=steps),
                 ledger=LedgerOptions(diagnostics=False), progress=False).x


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    x, w, heads, mha, pad = problem(dtype)
    routing = field_module._values_first

    def with_order(order, backend, fn):
        def go():
            field_module._values_first = routing if order == "new" else (lambda norm, heads: False)
            try:
                with kernel_backend(backend), torch.no_grad():
                    return fn()
            finally:
                field_module._values_first = routing
        return go

    cases = {}
    for order in ("old", "new"):
        for backend in ("chunked", "sdpa"):
            tag = f"{order} / {backend}"
            cases[("evaluate", tag)] = with_order(order, backend, lambda: tp.evaluate(x, heads, w, diagnostics=False))
            cases[("solve 1", tag)] = with_order(order, backend, lambda: run_solve(x, w, heads, 1))
            cases[(f"solve {args.steps}", tag)] = with_order(order, backend, lambda: run_solve(x, w, heads, args.steps))

    def mha_forward():
        with torch.no_grad():
            return mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    cases[("forward", "nn.MultiheadAttention")] = mha_forward
    # the orders agree (the field's difference relative to its size)
    v_old = with_order("old", "chunked", lambda: tp.evaluate(x, heads, w, diagnostics=False).velocity)()
    v_new = with_order("new", "sdpa", lambda: tp.evaluate(x, heads, w, diagnostics=False).velocity)()
    rel = float((v_old - v_new).abs().max() / v_old.abs().max())

    load0 = os.getloadavg()
    for fn in cases.values():  # warm-up
        fn()
    times = {key: [] for key in cases}
    for _ in range(args.reps):
        for key, fn in cases.items():
            times[key].append(timed(fn))
    load1 = os.getloadavg()

    ref = statistics.median(times[("forward", "nn.MultiheadAttention")])
    print(f"MiniLM-shaped heads d=384 H=12 k=k_v=32, B=64 x n=64 tokens (padded), {args.dtype}, "
          f"torch threads {torch.get_num_threads()}, {args.reps} interleaved repeats after one warm-up")
    print(f"load average before {load0[0]:.2f} / after {load1[0]:.2f} (1 min) on {os.cpu_count()} cores, shared "
          f"with other jobs: the times are noisy, ratios within this run are what to compare")
    print(f"max |V_old − V_new| / max |V_old| = {rel:.1e}")
    head = ("what", "order / backend", "median ms", "min–max ms", "/ MHA fwd", "old/new")
    print(f"{head[0]:<10} {head[1]:<24} {head[2]:>10} {head[3]:>18} {head[4]:>10} {head[5]:>8}")
    for (what, tag), ts in times.items():
        med = statistics.median(ts)
        speedup = ""
        if tag.startswith("new"):
            old = statistics.median(times[(what, "old" + tag[3:])])
            speedup = f"{old / med:8.1f}"
        print(f"{what:<10} {tag:<24} {1e3 * med:10.2f} {1e3 * min(ts):8.2f}–{1e3 * max(ts):<9.2f} {med / ref:10.1f} "
              f"{speedup:>8}")


if __name__ == "__main__":
    main()
