"""Time and peak memory of one attention-field evaluation vs N, per kernel backend and dtype.

Measured side by side in one run on this machine (d = 3, H = 4 symmetric heads, tokens uniform
on S², β = 1): ``tp.evaluate(x, heads, diagnostics=False)`` (velocity and log-partitions) for
each backend of :mod:`transformer_pde.model.backends`, against a straightforward dense
implementation written below (``naive_field``: per head the (N, N) score matrix, softmax,
product; then the projection) which is skipped where its tensors would exceed
``--max-dense-gb`` (4 GB).  For every
case the table gives the time, the peak memory above the baseline, the ratios to the dense
code, and the achieved arithmetic rate as a fraction of a plain matmul on this machine::

    rate = H · N² · (2d + 2(d+1)) flop / time      (score dot products + moments incl. partition)
    GEMM = 2·n³ / time of torch.mm on n × n matrices (n = 1024, same dtype and device)

then the reference-configuration step of the reproduction (scripts/benchmark_reference_step.py).

    python scripts/benchmark_field.py                      # N = 1e2 … 1e5, float32 and float64
    python scripts/benchmark_field.py --sizes 100 1000 --dtypes float64 --backends chunked sdpa
    python scripts/benchmark_field.py --device cuda        # peak memory from the CUDA allocator

Peak memory on CPU is the resident-set growth sampled every 0.5 ms while the evaluation runs
(the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed blocks leave
the resident set); on CUDA it is ``torch.cuda.max_memory_allocated``.  Cases whose projected
time exceeds ``--max-seconds`` are skipped and listed.  Timings on a shared machine are noisy;
the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and __name__ == "__main__":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

import transformer_pde as tp  # noqa: E402
from transformer_pde.model.backends import BACKENDS, keops_available, select_backend  # noqa: E402
from transformer_pde.model.field import evaluate  # noqa: E402


def naive_field(x, A, beta=1.0):
    """Straightforward dense softmax field, one head at a time (memory 2·N² per head):
    V(x_i) = P_{x_i} (1/H) Σ_h A_h Σ_j softmax_j(β⟨x_i, A_h x_j⟩) x_j, and log m_h(x_i)."""
    f, lses = 0.0, []
    for h in range(A.shape[0]):
        S = beta * (x @ A[h] @ x.T)  # (N, N)
        P = torch.softmax(S, -1)
        f = f + (P @ x) @ A[h].T
        lses.append(torch.logsumexp(S, -1) - math.log(x.shape[0]))
        del S, P
    f = f / A.shape[0]
    return f - (f * x).sum(-1, keepdim=True) * x, torch.stack(lses)


class PeakMemory:
    """Peak memory above the baseline during a block: CUDA allocator, or sampled RSS on CPU."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak = 0

    @staticmethod
    def _rss():
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: no sampling
            return 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.base = self._rss()
        self.peak_rss = self.base
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak_rss = max(self.peak_rss, self._rss())
                time.sleep(0.0005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak_rss, self._rss()) - self.base
        return False


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat=1):
    best = math.inf
    out = None
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def gemm_rate(dtype, device, n=1024):
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    t, _ = timed(lambda: torch.mm(a, b), device, repeat=3)
    return 2 * n ** 3 / t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10_000, 100_000])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    ap.add_argument("--backends", nargs="+", default=None,
                    help=f"from {BACKENDS[1:]} plus 'naive' (default: all that run here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-dense-gb", type=float, default=4.0)
    ap.add_argument("--max-seconds", type=float, default=150.0, help="skip cases projected to take longer")
    ap.add_argument("--no-reference-step", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends
    if backends is None:
        backends = ["naive", "dense", "chunked", "sdpa"] + (["keops"] if keops_available() else [])
    H, d = args.heads, 3
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, load average {load:.2f}; "
          f"d = {d}, H = {H}")
    skipped, losses = [], []
    flop_per_pair = 2 * d + 2 * (d + 1)
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        peak = gemm_rate(dtype, device)
        print(f"\n{dname}: plain matmul (1024²) {peak / 1e9:.1f} GFLOP/s")
        print(f"{'N':>7} {'backend':>8} {'runs as':>8} {'time s':>9} {'peak MiB':>9} {'t/t_naive':>9} "
              f"{'mem/naive':>9} {'GFLOP/s':>8} {'% GEMM':>7} {'max|ΔV|':>9}")
        per_pair = {}  # seconds per (head, query, key) triple, to project larger N
        for N in args.sizes:
            g = torch.Generator().manual_seed(0)
            x = torch.nn.functional.normalize(torch.randn(N, d, generator=g, dtype=torch.float64), dim=-1)
            A = torch.randn(H, d, d, generator=g, dtype=torch.float64)
            A = (A + A.transpose(-1, -2)) / 2
            x, A = x.to(dtype=dtype, device=device), A.to(dtype=dtype, device=device)
            heads = tp.Heads.symmetric(A)
            naive_t = naive_m = None
            V_ref = None
            for backend in backends:
                pairs = H * N * N
                if backend == "naive":
                    need = 2 * N * N * x.element_size()
                    if need > args.max_dense_gb * 2**30:
                        skipped.append(f"{dname} N={N} naive: needs ~{need / 2**30:.0f} GB > {args.max_dense_gb:g} GB")
                        continue
                    fn = lambda: naive_field(x, A)  # noqa: E731
                    runs_as = "-"
                else:
                    if backend == "keops" and not keops_available():
                        skipped.append(f"{dname} N={N} keops: pykeops not importable")
                        continue
                    runs_as = select_backend(backend, device, dtype, pairs)
                    if backend == "dense" and 2 * pairs * x.element_size() > args.max_dense_gb * 2**30:
                        skipped.append(f"{dname} N={N} dense backend: one block would need "
                                       f"~{2 * pairs * x.element_size() / 2**30:.0f} GB")
                        continue
                    fn = lambda b=backend: evaluate(x, heads, diagnostics=False, backend=b)  # noqa: E731
                key = backend
                if key in per_pair and per_pair[key] * pairs > args.max_seconds:
                    skipped.append(f"{dname} N={N} {backend}: projected {per_pair[key] * pairs:.0f} s "
                                   f"> --max-seconds {args.max_seconds:g}")
                    continue
                fn_small = fn if N <= 1000 else None
                if fn_small is not None:
                    fn_small()  # warm-up
                t, out = timed(fn, device, repeat=5 if N <= 1000 else 1)
                with PeakMemory(device) as pm:
                    fn()
                per_pair[key] = t / pairs
                V = out[0] if backend == "naive" else out.velocity
                if V_ref is None:
                    V_ref = V.double()
                err = float((V.double() - V_ref).abs().max())
                if backend == "naive":
                    naive_t, naive_m = t, max(pm.peak, 1)
                rate = flop_per_pair * pairs / t
                rt = f"{t / naive_t:9.2f}" if naive_t else f"{'-':>9}"
                rm = f"{pm.peak / naive_m:9.3f}" if naive_m else f"{'-':>9}"
                print(f"{N:>7} {backend:>8} {runs_as:>8} {t:>9.4f} {pm.peak / 2**20:>9.1f} {rt} {rm} "
                      f"{rate / 1e9:>8.2f} {100 * rate / peak:>6.1f}% {err:>9.1e}", flush=True)
                if naive_t and backend != "naive" and N <= 10_000 and t > 3 * naive_t:
                    losses.append(f"{dname} N={N} {backend}: {t / naive_t:.1f}× the dense time")
    if skipped:
        print("\nskipped: " + "; ".join(skipped))
    print("\nlosses (N ≤ 1e4 slower than 3× dense): " + ("; ".join(losses) if losses else "none"))
    if not args.no_reference_step and device.type == "cpu":
        print("\nreference-configuration step (n = 200, H = 100, 10 paths, float64, all diagnostics):")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import benchmark_reference_step

        benchmark_reference_step.main(["--steps", "3", "--no-projection"])


if __name__ == "__main__":
    main()
