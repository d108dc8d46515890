"""CPU time of ``tp.simulate(..., layer_norm="post")`` against the two reference simulators' OWN code.

The peers' published code is imported from checkouts given on the command line (or by environment
variables) and timed as it is; nothing of it is copied here.  Without both checkouts the script
refuses (exit status 2) and says how to get them (PEERS: any folder of yours):

    git clone https://github.com/nikitus20/simuformer PEERS/simuformer
    git clone https://github.com/borjanG/2023-transformers-rotf PEERS/rotf
    python scripts/benchmark_peers.py --simuformer PEERS/simuformer --rotf PEERS/rotf
    # or: TRANSFORMER_PDE_SIMUFORMER=... TRANSFORMER_PDE_ROTF=... python scripts/benchmark_peers.py

Workload of the reference simulators: 256 systems × 32 tokens × d = 16, 100 post-LN steps of Δt = 0.1,
softmax, β = 1, random Gaussian score and value matrices per system, and the statistic they record (the
fraction of distinct pairs with overlap > 0.999).  Heads: 8 for simuformer (ω_h = 1/H), 1 for rotf (that
code has one head).

* **simuformer** (``simuxform.py``): a ``SimuXForm`` built by its own constructor (``norm='postln'``, the
  score and value matrices passed as its ``BF`` and ``V`` lists, ``device='cpu'``, the torch default dtype
  set to the benchmark's dtype while it allocates its buffers), its tokens set to the common start; timed:
  ``SimuXForm.step`` and ``SimuXForm.check_stats`` at every step ("step + stats"), and ``step`` alone.
* **rotf** (``phase-diagrams.py``, loaded as a module; its ``__main__`` block does not run): its
  constructor hard-codes ``.to('cuda')``, so the ``simu_xform`` object is made with ``__new__`` and given
  the attributes its constructor sets (the tokens, the buffers ``IP``, ``SM``, ``M2``, ``M3`` of the
  benchmark's dtype, ``BF``, ``V``, ``beta``, ``eta``, ``args``; the module-level ``args`` that ``step_1``
  reads); timed: ``simu_xform.step_1`` and ``simu_xform.check_stats`` at every step, and ``step_1`` alone.

Ours, in the same process, interleaved with the peers (process CPU time, ``--threads`` torch threads,
default 1, as the peers' code gets):

* **same work**: ``tp.simulate(x0, heads, t1=100·Δt, dt=Δt, direction="ascent", layer_norm="post",
  diagnostics=False, observables={"pair_fraction": tp.clustering.pair_fraction_observable(eps=1e-3)})``:
  the map and the statistic at every step; against the peers' step + stats;
* **obvious**: ``tp.simulate(x0, heads, t1=..., dt=..., direction="ascent", layer_norm="post")`` with every
  other argument at its default (no statistic); against the peers' step alone.

The script checks that the final tokens and the statistic agree with the peers' own (to rounding), and
prints two floors: our kernel's four products alone (queries, scores, means, values, no exponential or
bookkeeping; :func:`products_floor`) with the statistic's Gram product, against the peer's step + stats, and
the four products with the obvious call's records (101 states copied into fresh memory) against the peer's
step.  A target below its floor is out of the kernel's reach with these products.
It also prints the re-implementations of the peers' loops (:func:`simuformer_reimplementation`,
:func:`rotf_reimplementation`, written from reading their code) as a labelled second yardstick.  Every ratio
is ours / peer: the median of the per-repeat ratios (each repeat runs every case once, back to back) with
their range, and the ratio of the best times.  The whole measurement runs twice: with no added load, and
with ``--load`` busy processes per core started by the script itself (spinning Python loops).
``--assume-l2 2M`` also times the same-work call with the cache-sized blocks the library would choose on a
CPU with that L2 (``transformer_pde.utils.hardware.cache_sizes`` reports it for the call): a 1 MiB and a
2 MiB L2 side by side show whether the block rule holds on both.  The header names the CPU model, its
caches, the thread count and the load average; the last lines print the tables of docs/performance.md.

    python scripts/benchmark_peers.py --simuformer S --rotf R                  # idle + loaded, both dtypes
    python scripts/benchmark_peers.py --simuformer S --rotf R --load 0 --repeats 3 --dtype float32
    python scripts/benchmark_peers.py --simuformer S --rotf R --assume-l2 1M,2M
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402
from transformer_pde.dynamics import layernorm  # noqa: E402
from transformer_pde.utils import hardware  # noqa: E402

SIMUFORMER_URL = "https://github.com/nikitus20/simuformer"
ROTF_URL = "https://github.com/borjanG/2023-transformers-rotf"
ENV = {"simuformer": "TRANSFORMER_PDE_SIMUFORMER", "rotf": "TRANSFORMER_PDE_ROTF"}


class PeerMissing(RuntimeError):
    """A peer's checkout is not given or does not hold the code this benchmark times."""


def problem(systems, n, d, H, dtype, seed=0):
    """The peers' workload: tokens (systems, n, d) on the sphere, score and value matrices (systems, H, d, d)."""
    g = torch.Generator().manual_seed(seed)
    M = torch.nn.functional.normalize(torch.randn(systems, n, d, generator=g, dtype=torch.float64), dim=2)
    BF = torch.randn(systems, H, d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    V = torch.randn(systems, H, d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return M.to(dtype), BF.to(dtype), V.to(dtype)


# ----------------------------------------------------------------------------------------------------------
# the peers' own code, from their checkouts


def _checkout(name: str, given) -> Path:
    path = given or os.environ.get(ENV[name])
    url = {"simuformer": SIMUFORMER_URL, "rotf": ROTF_URL}[name]
    if not path:
        raise PeerMissing(f"no checkout of {name}: this benchmark times the peers' own code.  Clone it "
                          f"(git clone {url} PEERS/{name}) and pass --{name} PEERS/{name} "
                          f"(or set {ENV[name]}).")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise PeerMissing(f"--{name} {path!r} is not a folder; give the checkout of {url}")
    return p


def load_simuformer(path=None):
    """The ``simuxform`` module of a simuformer checkout (PeerMissing when absent or without SimuXForm.step
    and SimuXForm.check_stats)."""
    root = _checkout("simuformer", path)
    src = root / "simuxform.py"
    if not src.is_file():
        raise PeerMissing(f"{root} has no simuxform.py: give the checkout of {SIMUFORMER_URL}")
    mod = _import(src, "peer_simuxform")
    cls = getattr(mod, "SimuXForm", None)
    if cls is None or not all(callable(getattr(cls, m, None)) for m in ("step", "check_stats")):
        raise PeerMissing(f"{src} defines no SimuXForm with step and check_stats: another version of simuformer?")
    return mod


def load_rotf(path=None):
    """The ``phase-diagrams.py`` module of a rotf checkout (PeerMissing when absent or without
    simu_xform.step_1 and simu_xform.check_stats)."""
    root = _checkout("rotf", path)
    src = root / "phase-diagrams.py"
    if not src.is_file():
        raise PeerMissing(f"{root} has no phase-diagrams.py: give the checkout of {ROTF_URL}")
    mod = _import(src, "peer_rotf_phase_diagrams")
    cls = getattr(mod, "simu_xform", None)
    if cls is None or not all(callable(getattr(cls, m, None)) for m in ("step_1", "check_stats")):
        raise PeerMissing(f"{src} defines no simu_xform with step_1 and check_stats: another version of rotf?")
    return mod


def _import(src: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, src)
    mod = importlib.util.module_from_spec(spec)
    folder = str(src.parent)
    sys.path.insert(0, folder)  # the peer's own sibling modules, if it imports any
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(folder)
    return mod


def _peer_args(systems, n, d, H):
    """The argparse namespace both peers read (their command-line defaults for this workload: softmax,
    post-LN, random score and value matrices, no extra statistics)."""
    return SimpleNamespace(batch=systems, ntokens=n, dmodel=d, n_heads=H, device="cpu", use_softmax=True,
                           rawstep=False, step=0.1, noanneal=0, randomKQ=1, randomV=1, analyze_evecs=False,
                           norm="postln", sequential=False, plotdim=False, adjacent=False, cluster_sizes=False,
                           regen_period=0.0)


def simuformer_runner(mod, M, BF, V, beta, eta, steps, stats=True):
    """A closure running simuformer's own ``step`` (and ``check_stats``) ``steps`` times from M; returns
    (final tokens, pair fractions or None)."""
    systems, H, d = BF.shape[0], BF.shape[1], BF.shape[-1]
    args = _peer_args(systems, M.shape[1], d, H)
    args.step = eta
    old = torch.get_default_dtype()
    torch.set_default_dtype(M.dtype)  # its buffers (M2, SM, IP, r) take the default dtype
    try:
        sim = mod.SimuXForm(args, beta, V=[V[:, h].contiguous() for h in range(H)],
                            BF=[BF[:, h].contiguous() for h in range(H)])
    finally:
        torch.set_default_dtype(old)

    def run():
        sim.M = M.clone()
        t, dens = 0.0, []
        for _ in range(steps):
            t = sim.step(t)
            if stats:
                dens.append(sim.check_stats()[0])
        return sim.M, (torch.tensor(dens, dtype=torch.float64) if stats else None)
    return run


def rotf_runner(mod, M, BF, V, beta, eta, steps, stats=True):
    """A closure running rotf's own ``step_1`` (and ``check_stats``) ``steps`` times from M (one head:
    BF, V (systems, d, d)); returns (final tokens, pair fractions or None)."""
    systems, n, d = M.shape
    args = _peer_args(systems, n, d, 1)
    args.step = eta
    mod.args = args  # step_1 reads the module-level args of its __main__ block
    sim = mod.simu_xform.__new__(mod.simu_xform)  # its __init__ moves every buffer to 'cuda'
    sim.args, sim.beta, sim.eta, sim.BF, sim.V = args, beta, eta, BF, V
    sim.IP = torch.zeros(systems, n, n, dtype=M.dtype)
    sim.SM = torch.zeros(systems, n, n, dtype=M.dtype)
    sim.M2 = torch.empty(systems, n, d, dtype=M.dtype)
    sim.M3 = torch.empty(systems, n, d, dtype=M.dtype)

    def run():
        sim.M = M.clone()
        t, dens = 0.0, []
        for _ in range(steps):
            t = sim.step_1(t)
            if stats:
                dens.append(float(sim.check_stats()[0]))
        return sim.M, (torch.tensor(dens, dtype=torch.float64) if stats else None)
    return run


# ----------------------------------------------------------------------------------------------------------
# the peers' loops written out (read, not copied): the second yardstick


def _pair_fraction_ip(M):
    n = M.shape[1]
    IP = torch.bmm(M, M.transpose(1, 2))
    mask = ~torch.eye(n, dtype=torch.bool).expand(M.shape[0], -1, -1)
    return (IP[mask] > 0.999).sum() / mask.sum()


def rotf_reimplementation(M, BF, V, beta, eta, steps):
    """rotf's step_1 (one head) and check_stats every step, written out."""
    stats = []
    with torch.no_grad():
        for _ in range(steps):
            M2 = torch.matmul(M, BF)
            SM = torch.softmax(torch.matmul(M2, M.transpose(1, 2)) * beta, dim=2)
            M = torch.nn.functional.normalize(torch.matmul(torch.matmul(SM, M) * eta, V) + M, dim=2)
            stats.append(_pair_fraction_ip(M))
    return M, torch.stack(stats)


def simuformer_reimplementation(M, BF, V, beta, eta, steps):
    """simuformer's step (postln; BF, V lists of (systems, d, d) per head) and check_stats every step, written out."""
    H = len(BF)
    stats = []
    with torch.no_grad():
        for _ in range(steps):
            acc = torch.zeros_like(M)
            for h in range(H):
                SM = torch.softmax(torch.bmm(torch.bmm(M, BF[h]), M.transpose(1, 2)) * beta, dim=2)
                acc += torch.bmm(SM, torch.bmm(M, V[h])) / H
            M = torch.nn.functional.normalize(M + eta * acc, dim=2)
            stats.append(_pair_fraction_ip(M))
    return M, torch.stack(stats)


# ----------------------------------------------------------------------------------------------------------
# ours

#: the same statistic per system from the tokens (what ours records at every step)
_pair_observable = tp.clustering.pair_fraction_observable(eps=1e-3)


def ours_run(M, BF, V, beta, eta, steps, weights=None):
    """Same work: tp.simulate with the post-LN map (A_h = BF_h, value Vᵀ: the peers use row vectors) and the
    statistic at every step."""
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=weights, beta=beta)
    traj = tp.simulate(M, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post", diagnostics=False,
                       observables={"pair_fraction": _pair_observable}, record_every=1, progress=False)
    return traj.final, traj.observables["pair_fraction"][1:].mean(-1)


def obvious_run(M, BF, V, beta, eta, steps, weights=None):
    """The obvious call: post-LN and the peers' direction, every other argument at its default."""
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=weights, beta=beta)
    traj = tp.simulate(M, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post")
    return traj.final, None


def products_floor(M, BF, V, steps, stats=False, records=False):
    """A closure running, ``steps`` times, only the four products of our fused kernel: queries, scores, means
    and values, with the calls, layouts, block sizes and buffers of ``layernorm.FusedUpdate`` (its buffers
    filled by one real call first), and no exponential, sums, division, normalisation or records; with
    ``stats`` also the statistic's Gram product; with ``records`` also what the obvious call keeps, the state
    after every step copied into one fresh (steps + 1, ...) buffer (its first touch is page faults).  No exact
    softmax step that runs these products can be faster, so a ratio target below (this time) / (the peer's)
    is out of the kernel's reach."""
    heads = tp.Heads(BF, V.transpose(-1, -2), beta=1.0)
    fused = layernorm.FusedUpdate(None, 1.0)
    qa, vs, H, _ = fused._prepare(heads, M)
    fused(M, heads)  # the workspace's buffers hold real scores and means, not uninitialised memory
    B, n, d = M.shape
    keys = layernorm.LAYOUTS.get(M.dtype, "queries") == "keys"
    size = max(1, min(B, layernorm.score_block_bytes(M.device) // (n * H * max(n, d) * M.element_size())))
    out = torch.empty_like(M)
    gram = torch.empty(B, n, n, dtype=M.dtype)

    def run():
        kept = torch.empty((steps + 1, *M.shape), dtype=M.dtype) if records else None
        with torch.no_grad():
            if records:
                kept[0].copy_(M)
            for k in range(steps):
                for x, q, v, o in zip(M.split(size), qa.split(size), vs.split(size), out.split(size)):
                    b = x.shape[0]
                    bufs = fused._buffers(b, (n, d, H), M, keys)
                    Q, E, means = bufs[0], bufs[1], bufs[3]
                    fused._queries(x, q, Q)
                    if keys:
                        torch.bmm(x, Q.view(b, -1, d).transpose(1, 2), out=E)
                        torch.bmm(x.transpose(1, 2), E, out=bufs[4])
                        fused._values_keys(means, v, bufs[5])
                    else:
                        torch.bmm(Q.view(b, -1, d), x.transpose(1, 2), out=E)
                        torch.bmm(E, x, out=means)
                        fused._values(means, v, o)
                if stats:
                    torch.matmul(M, M.transpose(-1, -2), out=gram)
                if records:
                    kept[k + 1].copy_(out)
        return out, None
    return run


@contextlib.contextmanager
def assumed_l2(nbytes):
    """The library's cache-sized blocks chosen as on a CPU whose L2 is ``nbytes`` (None: this CPU's)."""
    if nbytes is None:
        yield
        return
    real = hardware.cache_sizes
    c = real()
    fake = hardware.CacheSizes(l1d=c.l1d, l2=int(nbytes), l3=c.l3, source=f"assumed {nbytes // 1024} KiB")
    hardware.cache_sizes = lambda: fake
    try:
        yield
    finally:
        hardware.cache_sizes = real


def _with_l2(nbytes, fn):
    def run():
        with assumed_l2(nbytes):
            return fn()
    return run


# ----------------------------------------------------------------------------------------------------------
# measurement


def cases_for(dtype, args, peers):
    steps, beta, eta = args.steps, 1.0, 0.1
    M, BF, V = problem(args.systems, args.tokens, args.dim, args.heads, dtype)
    bf1, v1 = BF[:, 0].contiguous(), V[:, 0].contiguous()
    one = torch.ones(1, dtype=dtype)
    sf, rf = peers
    H = args.heads
    cases = {
        "simuformer: step + stats": simuformer_runner(sf, M, BF, V, beta, eta, steps, stats=True),
        "simuformer: step": simuformer_runner(sf, M, BF, V, beta, eta, steps, stats=False),
        "rotf: step_1 + stats": rotf_runner(rf, M, bf1, v1, beta, eta, steps, stats=True),
        "rotf: step_1": rotf_runner(rf, M, bf1, v1, beta, eta, steps, stats=False),
        "re-implemented simuformer": lambda: simuformer_reimplementation(
            M, [BF[:, h].contiguous() for h in range(H)], [V[:, h].contiguous() for h in range(H)], beta, eta, steps),
        "re-implemented rotf": lambda: rotf_reimplementation(M, bf1, v1, beta, eta, steps),
        f"ours same work (H={H})": lambda: ours_run(M, BF, V, beta, eta, steps),
        "ours same work (H=1)": lambda: ours_run(M, BF[:, :1], V[:, :1], beta, eta, steps, weights=one),
        f"ours obvious (H={H})": lambda: obvious_run(M, BF, V, beta, eta, steps),
        "ours obvious (H=1)": lambda: obvious_run(M, BF[:, :1], V[:, :1], beta, eta, steps, weights=one),
        f"floor: products + records (H={H})": products_floor(M, BF, V, steps, records=True),
        "floor: products + records (H=1)": products_floor(M, BF[:, :1], V[:, :1], steps, records=True),
        f"floor: products + Gram (H={H})": products_floor(M, BF, V, steps, stats=True),
        "floor: products + Gram (H=1)": products_floor(M, BF[:, :1], V[:, :1], steps, stats=True),
    }
    for l2 in args.assume_l2:
        tag = f" [L2 {l2 // 1024} KiB]"
        cases[f"ours same work (H={H}){tag}"] = _with_l2(l2, cases[f"ours same work (H={H})"])
        cases[f"ours same work (H=1){tag}"] = _with_l2(l2, cases["ours same work (H=1)"])
    return cases


#: (ours, yardstick) pairs of the tables: row label, our case, the peer case per column
def _pairs(H, assume_l2):
    rows = [("same work / peer's step + stats", f"ours same work (H={H})", "simuformer: step + stats",
             "ours same work (H=1)", "rotf: step_1 + stats"),
            ("obvious / peer's step alone", f"ours obvious (H={H})", "simuformer: step",
             "ours obvious (H=1)", "rotf: step_1")]
    for l2 in assume_l2:
        tag = f" [L2 {l2 // 1024} KiB]"
        rows.append((f"same work, blocks for a {l2 // 1024} KiB L2", f"ours same work (H={H}){tag}",
                     "simuformer: step + stats", f"ours same work (H=1){tag}", "rotf: step_1 + stats"))
    rows.append(("same work / re-implemented peer", f"ours same work (H={H})", "re-implemented simuformer",
                 "ours same work (H=1)", "re-implemented rotf"))
    rows.append(("floor of same work: our products + Gram alone / peer's step + stats", f"floor: products + Gram (H={H})",
                 "simuformer: step + stats", "floor: products + Gram (H=1)", "rotf: step_1 + stats"))
    rows.append(("floor of obvious: our products + the records alone / peer's step alone",
                 f"floor: products + records (H={H})", "simuformer: step", "floor: products + records (H=1)",
                 "rotf: step_1"))
    return rows


def measure(dtype, args, peers):
    cases = cases_for(dtype, args, peers)
    outs = {k: fn() for k, fn in cases.items()}  # warm-up, and the values compared below
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    H = args.heads
    for ours, peer in ((f"ours same work (H={H})", "simuformer: step + stats"),
                       ("ours same work (H=1)", "rotf: step_1 + stats"),
                       (f"ours obvious (H={H})", "simuformer: step"), ("ours obvious (H=1)", "rotf: step_1")):
        dx = float((outs[ours][0] - outs[peer][0]).abs().max())
        line = f"  {ours} vs {peer}: max |Δx| = {dx:.2e}"
        bad = dx > tol
        if outs[ours][1] is not None and outs[peer][1] is not None:
            ds = float((outs[ours][1].double() - outs[peer][1]).abs().max())
            line += f", max |Δ pair fraction| = {ds:.2e}"
            bad = bad or ds > 1e-2
        print(line + ("   <-- MISMATCH" if bad else ""))
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            t = time.process_time()
            fn()
            times[k].append(time.process_time() - t)
    for k, v in times.items():
        print(f"  {k:44s} CPU s: best {min(v):.3f}, median {statistics.median(v):.3f}  [{min(v):.3f}, {max(v):.3f}]")
    return times


def ratio(times, ours, peer):
    """(median of the per-repeat ratios, min, max, ratio of the best times)."""
    per = [a / b for a, b in zip(times[ours], times[peer])]
    return statistics.median(per), min(per), max(per), min(times[ours]) / min(times[peer])


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


@contextlib.contextmanager
def busy(per_core: int):
    """``per_core`` spinning processes per CPU, started here and stopped on exit (none for 0)."""
    if per_core <= 0:
        yield 0
        return
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(per_core * (os.cpu_count() or 1))]
    for p in procs:
        p.start()
    try:
        time.sleep(2.0)
        yield len(procs)
    finally:
        stop.set()
        for p in procs:
            p.join()


def header(args):
    c = hardware.cache_sizes()
    l3 = "?" if c.l3 is None else f"{c.l3 // 1024 ** 2} MiB"
    return (f"CPU {hardware.cpu_model()!r}, {os.cpu_count()} CPUs; caches ({c.source}): L1d {c.l1d // 1024} KiB, "
            f"L2 {c.l2 // 1024} KiB per core, L3 {l3}; torch {torch.__version__}, {args.threads} thread(s), "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")


def table(label, results, args):
    """The markdown table of docs/performance.md for one pass (``results``: dtype name -> times)."""
    H = args.heads
    names = list(results)
    cols = [f"{dt} / {peer}" for dt in names for peer in (f"simuformer (H={H})", "rotf (H=1)")]
    lines = [f"{label}; ratio ours / peer, median of {args.repeats} paired repeats [range] (best / best):", "",
             "| call | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for row, o8, p8, o1, p1 in _pairs(H, args.assume_l2):
        cells = []
        for dt in names:
            for o, p in ((o8, p8), (o1, p1)):
                med, lo, hi, best = ratio(results[dt], o, p)
                cells.append(f"{med:.2f} [{lo:.2f}, {hi:.2f}] ({best:.2f})")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sizes(text):
    try:
        return [hardware.parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--assume-l2 takes cache sizes such as 1M,2M: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--simuformer", default=None, help=f"checkout of {SIMUFORMER_URL} (or ${ENV['simuformer']})")
    ap.add_argument("--rotf", default=None, help=f"checkout of {ROTF_URL} (or ${ENV['rotf']})")
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load", type=int, default=2, help="busy processes per core for the loaded pass (0: none)")
    ap.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    ap.add_argument("--assume-l2", type=_sizes, default=[], metavar="SIZES",
                    help="also time the same-work call with the blocks chosen for these L2 sizes, e.g. 1M,2M")
    args = ap.parse_args(argv)
    try:
        peers = (load_simuformer(args.simuformer), load_rotf(args.rotf))
    except PeerMissing as e:
        print(f"benchmark_peers.py: {e}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    dtypes = ("float64", "float32") if args.dtype == "both" else (args.dtype,)
    print(header(args))
    print(f"{args.systems} systems × {args.tokens} tokens × d = {args.dim}, {args.steps} steps; process CPU time")
    tables = []
    for per_core in ((0, args.load) if args.load > 0 else (0,)):
        with busy(per_core) as nbusy:
            load0 = os.getloadavg()
            label = "no added load" if not nbusy else f"{nbusy} busy processes started by the script ({per_core} per core)"
            print(f"\n{label}: load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (1, 5, 15 min)")
            results = {}
            for name in dtypes:
                print(f"{name}:")
                results[name] = measure(getattr(torch, name), args, peers)
            load1 = os.getloadavg()
        tables.append(table(f"{label}, load average {load0[0]:.1f} → {load1[0]:.1f}", results, args))
        print("\n" + tables[-1], flush=True)  # each pass's table at once: a run cut short keeps it
    print("\n" + header(args))
    for t in tables:
        print("\n" + t)


if __name__ == "__main__":
    main()
