"""Peak memory and time of one training step of ``tp.nn.MeanFieldAttention`` as the number of solver steps grows:
backpropagation through the solver against torchdiffeq's adjoint.

One step = forward through the module (B token sets of n tokens on S^{d-1}, H heads, constant in depth),
a loss, ``backward()``.  The depth is T = K·Δt with Δt fixed, so the fixed-step solve takes K steps
(K = 10, 100, 1000 by default); for each K the script runs

* euler:          projected Euler, K steps, gradients by backpropagation through the steps;
* dopri5:         torchdiffeq's dopri5 on [0, T] (rtol, atol), backpropagation through its steps;
* dopri5-adjoint: the same solve, gradients by the adjoint ODE (``adjoint=True``);

and prints the seconds per training step (median of ``--repeat``), the peak memory of the step above
the baseline (CUDA allocator on CUDA; on CPU the resident-set growth sampled every 0.5 ms, each case in
a fresh process run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks leave the resident set), the
bytes autograd keeps from the forward for the backward pass (an exact count through
``torch.autograd.graph.saved_tensors_hooks``), the gradient's distance to dopri5-backprop's, and the
ratios adjoint / backprop of time and memory.
Expected: the memory of euler and dopri5 grows with the steps, that of the adjoint stays flat.

    python scripts/benchmark_gradient_memory.py                      # K = 10, 100, 1000 on CPU
    python scripts/benchmark_gradient_memory.py --steps 10 100 --batch 8 --repeat 1
    python scripts/benchmark_gradient_memory.py --device cuda

Timings on a shared machine are noisy (the load average is printed); compare ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and __name__ == "__main__":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

import transformer_pde as tp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_field import PeakMemory  # noqa: E402  (one peak-memory meter for the benchmarks)

METHODS = ("euler", "dopri5", "dopri5-adjoint")


class SavedBytes:
    """Bytes of the tensors autograd saves for backward inside the block (each storage counted once)."""

    def __init__(self):
        self.bytes, self._seen = 0, set()

    def _pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(method, K, args, device, dtype):
    kw = dict(layers=1, t1=K * args.dt, steps=K, dtype=dtype, device=device)
    if method != "euler":
        kw.update(method="adaptive", adjoint=method.endswith("adjoint"), rtol=args.rtol, atol=args.atol)
    return tp.nn.MeanFieldAttention(args.dim, args.heads, **kw)


def one_step(module, x, target, saved=None, kinetic=False):
    """Forward (its saved tensors counted by ``saved``), loss (+ the kinetic term), backward."""
    if saved is None:
        y = module(x, kinetic=kinetic)
    else:
        with saved:
            y = module(x, kinetic=kinetic)
    y, kin = y if kinetic else (y, None)
    loss = (y.mean(-2) @ target).square().mean()
    if kin is not None:
        loss = loss + 1e-3 * kin.mean()
    loss.backward()
    return loss.detach()


def run_case(method, K, args, device, dtype, state):
    module = build(method, K, args, device, dtype)
    module.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.tokens, args.dim, generator=g, dtype=dtype).to(device)
    x = x / x.norm(dim=-1, keepdim=True)
    target = torch.randn(args.dim, generator=g, dtype=dtype).to(device)
    one_step(module, x, target)  # warm-up
    times = []
    for _ in range(args.repeat):
        module.zero_grad()
        _sync(device)
        t0 = time.perf_counter()
        one_step(module, x, target)
        _sync(device)
        times.append(time.perf_counter() - t0)
    module.zero_grad()
    saved = SavedBytes()
    with PeakMemory(device) as mem:
        one_step(module, x, target, saved)
    grad = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    return {"method": method, "K": K, "seconds": statistics.median(times), "peak": mem.peak, "saved": saved.bytes,
            "grad": grad.double().cpu().tolist()}


def run_isolated(method, K, argv):
    """One case in a fresh interpreter (a clean heap: the resident-set growth is this case's alone)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--case", method, str(K)],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["grad"] = torch.tensor(r["grad"], dtype=torch.float64)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000], help="numbers K of Euler steps")
    ap.add_argument("--dt", type=float, default=0.01, help="the Euler step Δt (depth T = K·Δt)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-7)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--case", nargs=2, default=None, help=argparse.SUPPRESS)  # one case, in a child process
    raw = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(raw)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    state = tp.nn.MeanFieldAttention(args.dim, args.heads, dtype=dtype, device=device).state_dict()
    if args.case is not None:
        import json

        print(json.dumps(run_case(args.case[0], int(args.case[1]), args, device, dtype, state)))
        return None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# B = {args.batch} token sets, n = {args.tokens}, d = {args.dim}, H = {args.heads}, {args.dtype} on "
          f"{device}, Δt = {args.dt}, dopri5 rtol = {args.rtol}, atol = {args.atol}; {args.threads} thread(s), "
          f"load average {load:.1f}; median of {args.repeat} steps")
    print(f"{'K':>6} {'method':>15} {'s/step':>9} {'peak MB':>9} {'saved MB':>9} {'time/euler':>11} "
          f"{'mem/euler':>10} {'|Δgrad|/|grad|':>15}")
    rows = []
    for K in args.steps:
        res = {m: run_isolated(m, K, raw) for m in METHODS}
        e = res["euler"]
        for m in METHODS:
            r = res[m]
            rel = float((r["grad"] - res["dopri5"]["grad"]).norm() / res["dopri5"]["grad"].norm())
            print(f"{K:>6} {m:>15} {r['seconds']:>9.4f} {r['peak'] / 2**20:>9.2f} {r['saved'] / 2**20:>9.2f} "
                  f"{r['seconds'] / e['seconds']:>11.2f} {max(r['peak'], 1) / max(e['peak'], 1):>10.3f} {rel:>15.1e}")
            rows.append(r)
        a, b = res["dopri5-adjoint"], res["dopri5"]
        print(f"{'':>6} {'adjoint/dopri5':>15} time {a['seconds'] / b['seconds']:.2f}×, peak memory "
              f"{max(a['peak'], 1) / max(b['peak'], 1):.3f}×, saved {max(a['saved'], 1) / max(b['saved'], 1):.3f}×")
    print("# |Δgrad|/|grad|: the gradient against dopri5-backprop's at the same K (euler: its O(Δt) error).")
    K = args.steps[0]
    module = build("euler", K, args, device, dtype)
    module.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.tokens, args.dim, generator=g, dtype=dtype).to(device)
    x = x / x.norm(dim=-1, keepdim=True)
    target = torch.randn(args.dim, generator=g, dtype=dtype).to(device)
    cost = {}
    for kinetic in (False, "displacement", "metric", False, "displacement", "metric"):  # twice: the second counts
        times = []
        for _ in range(args.repeat + 1):
            _sync(device)
            t0 = time.perf_counter()
            one_step(module, x, target, kinetic=kinetic)
            _sync(device)
            times.append(time.perf_counter() - t0)
        cost[kinetic] = statistics.median(times)
    print(f"# euler, K = {K}: s/step without a kinetic term {cost[False]:.4f}; with kinetic='displacement' "
          f"{cost['displacement']:.4f} ({cost['displacement'] / cost[False]:.2f}×); with kinetic='metric' (∫𝒢²dt "
          f"from the steps' field) {cost['metric']:.4f} ({cost['metric'] / cost[False]:.2f}×)")
    return rows


if __name__ == "__main__":
    main()
