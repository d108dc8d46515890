"""Wall time of the README's first workload with 1 thread, 2 threads and the "auto" policy, on
the machine as it is and with a busy-loop process on every core.

Goal: the README's first command (`transformer-pde run
experiments/ou_vs_oscillating_quick.toml`) in ≤ 60 s on 2 idle cores, and with the default
``--threads auto`` never more than 2× the 1-thread time when the cores are busy.

Workloads:

``segments`` (default, about a sixth of the run)
    the quick config's six segments — OU with H = 1, 4, 16 and 4 paths, oscillating with
    H = 1, 4, 16 and one path; n = 64 tokens on S², float64, Euler, dt = 0.01, every
    diagnostic — for ``--steps`` steps each (the config runs 600), in this process through
    ``tp.simulate`` under ``threads.policy(mode)``.
``quick``
    the whole command, `transformer-pde run experiments/ou_vs_oscillating_quick.toml
    --threads MODE` in a subprocess (figures included), into a temporary directory.

``paper``
    the full paper configuration (`experiments/ou_vs_oscillating.toml`: n = 200, H = 1, 10, 100,
    10 OU paths, 4000 steps) shortened to ``--steps`` and 2·``--steps`` steps (``-o t1=...``, no
    figures, no bootstrap), in a subprocess, for each ``--variants`` entry: ``auto``, ``1``, ``2``
    (``--threads`` of one process, ``workers=1``) or ``wN`` (``workers=N`` one-thread worker
    processes, the paths of the largest segments split between them).  The difference of the two
    lengths gives the seconds per step, projected to the full 4000 steps plus the fixed cost.

Load: ``--load busy`` starts one pure-Python busy loop per core (``os.cpu_count()``, or
``--load-procs``) before the measurements of that condition and kills them after; each loop
also ends by itself after ``--load-seconds``.  ``--load both`` (default) measures idle first,
then busy.  "idle" means no load added by this script: other jobs on the machine still count,
so the table prints the one-minute load average and the tasks runnable at the start of every
measurement, and the thread count "auto" chose.

    python scripts/benchmark_threads.py                        # segments, idle then busy
    python scripts/benchmark_threads.py --workload quick --load idle
    python scripts/benchmark_threads.py --steps 50 --repeat 3 --modes 1 2 auto
    python scripts/benchmark_threads.py --sweep                # where 2 threads start to pay off
    python scripts/benchmark_threads.py --workload paper --steps 40 --variants auto 1 w2

Read the ratios (time / time with 1 thread, same condition), not the absolute seconds, on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import transformer_pde as tp
from transformer_pde.utils import threads

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "experiments" / "ou_vs_oscillating_quick.toml"

BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def start_load(procs: int, seconds: float):
    """``procs`` busy-loop processes, each ending by itself after ``seconds``."""
    return [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=seconds)]) for _ in range(procs)]


def stop_load(load) -> None:
    for p in load:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in load:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def machine_state() -> str:
    try:
        la = os.getloadavg()[0]
    except OSError:
        return "n/a"
    now = threads.runnable_now()
    return f"{la:5.2f} / {now if now is not None else '?'}"


def run_segments(mode, steps: int, paths: int = 4, n: int = 64, heads=(1, 4, 16)) -> float:
    """The quick config's six segments for ``steps`` steps each; seconds."""
    old = threads.policy(mode)
    try:
        x0 = tp.sphere.octahedral(n, dtype=torch.float64)
        t0 = time.perf_counter()
        for H in heads:
            D0 = tp.Heads.random(H, 3, generator=torch.Generator().manual_seed(42 + H), dtype=torch.float64)
            for theta, p in ((tp.OrnsteinUhlenbeck(D0, rate=1.0, sigma=2 ** 0.5), paths),
                             (tp.Oscillating(D0, phase="shared"), None)):
                tp.simulate(x0, theta, t1=steps * 0.01, dt=0.01, paths=p, seed=2000 + H, record_every=5,
                            direction="descent", progress=False)
        return time.perf_counter() - t0
    finally:
        threads.policy(old)


def sweep(steps: int, repeat: int) -> None:
    """1 vs 2 threads on single OU solves of growing work paths·H·n² (where does a second thread
    start to pay off? that sets threads.WORK_THRESHOLD)."""
    print(f"# threshold sweep: one OU solve, n tokens on S², float64, {steps} steps; median of {repeat}")
    print(f"{'n':>5s} {'H':>4s} {'paths':>5s} {'work':>9s} {'1 thread s':>11s} {'2 threads s':>12s} "
          f"{'2 / 1':>6s} {'load':>12s}")
    for n, H, paths in [(32, 1, 1), (64, 1, 1), (64, 4, 1), (64, 4, 4), (64, 16, 4), (128, 16, 4), (200, 10, 10),
                        (200, 100, 10)]:
        x0 = tp.sphere.octahedral(n, dtype=torch.float64)
        D0 = tp.Heads.random(H, 3, generator=torch.Generator().manual_seed(H), dtype=torch.float64)
        theta = tp.OrnsteinUhlenbeck(D0, rate=1.0, sigma=2 ** 0.5)
        k = max(2, steps if paths * H * n * n < 1e6 else steps // 10)
        state = machine_state()
        t = {}
        for mode in (1, 2):
            old = threads.policy(mode)
            try:
                ts = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    tp.simulate(x0, theta, t1=k * 0.01, dt=0.01, paths=paths, seed=0, progress=False)
                    ts.append((time.perf_counter() - t0) * steps / k)
                t[mode] = statistics.median(ts)
            finally:
                threads.policy(old)
        w = paths * H * n * n
        print(f"{n:5d} {H:4d} {paths:5d} {w:9.2e} {t[1]:11.3f} {t[2]:12.3f} {t[2] / t[1]:6.2f} {state:>12s}",
              flush=True)


def run_quick(mode, out: Path) -> float:
    """`transformer-pde run experiments/ou_vs_oscillating_quick.toml --threads MODE`; seconds."""
    shutil.rmtree(out, ignore_errors=True)  # our own temporary directory
    cmd = [sys.executable, "-c", "import sys; from transformer_pde.application.cli import main; sys.exit(main())", "run",
           str(QUICK), "--threads", str(mode), "--out", str(out), "--no-progress", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return dt


PAPER = Path(__file__).resolve().parents[1] / "experiments" / "ou_vs_oscillating.toml"


def run_paper(variant: str, steps: int, out: Path) -> float:
    """The paper configuration cut to ``steps`` steps, one variant ("auto", "1", "2": --threads of one
    process; "wN": N one-thread workers); seconds of the whole subprocess."""
    shutil.rmtree(out, ignore_errors=True)  # our own temporary directory
    dt = 0.005
    t1 = round(steps * dt, 10)
    over = ["-o", f"t1={t1!r}", "-o", f"t_avg={t1 / 2!r}", "-o", "figures=false", "-o", "bootstrap=0",
            "-o", "checkpoint_every=100000"]
    if variant.startswith("w"):
        over += ["-o", f"workers={int(variant[1:])}", "--threads", "auto"]
    else:
        over += ["-o", "workers=1", "--threads", variant]
    cmd = [sys.executable, "-c", "import sys; from transformer_pde.application.cli import main; sys.exit(main())", "run",
           str(PAPER), *over, "--out", str(out), "--no-progress", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return took


def paper_table(variants, steps: int, repeat: int) -> None:
    full = round(20.0 / 0.005)
    print(f"# paper configuration, {steps} and {2 * steps} steps per segment (the full run has {full}); "
          f"torch {torch.__version__}, {os.cpu_count()} cores (budget {threads.cpu_budget()})")
    print(f"{'variant':8s} {'s (short)':>10s} {'s (2x)':>8s} {'s/step':>8s} {'projected min':>14s} "
          f"{'vs auto':>8s} {'load at start':>14s} {'load at end':>12s}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_paper_"))
    proj = {}
    try:
        for _ in range(repeat):  # interleaved repeats: every variant sees the same drift of the load
            for v in variants:
                start = machine_state()
                a = run_paper(v, steps, tmp / "runs")
                b = run_paper(v, 2 * steps, tmp / "runs")
                per = max(0.0, (b - a) / steps)
                fixed = max(0.0, a - per * steps)
                proj.setdefault(v, []).append((a, b, per, (fixed + per * full) / 60))
                base = statistics.median(x[3] for x in proj["auto"]) if "auto" in proj else None
                r = f"{proj[v][-1][3] / base:.2f}" if base else "-"
                print(f"{v:8s} {a:10.1f} {b:8.1f} {per:8.3f} {proj[v][-1][3]:14.1f} {r:>8s} {start:>14s} "
                      f"{machine_state():>12s}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("# median projected minutes: " + ", ".join(f"{v}: {statistics.median(x[3] for x in proj[v]):.1f}"
                                                   for v in variants))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["auto", "1", "w2"],
                    help="--workload paper: 'auto', 'N' (threads of one process) or 'wN' (N one-thread workers)")
    ap.add_argument("--workload", choices=["segments", "quick", "paper"], default="segments",
                    help="segments: the quick config's per-step kernels for --steps steps (default); "
                         "quick: the README's whole first command in a subprocess")
    ap.add_argument("--steps", type=int, default=100, help="steps per segment (the quick config has 600)")
    ap.add_argument("--modes", nargs="+", default=["1", "2", "auto"], help="thread policies to compare")
    ap.add_argument("--load", choices=["idle", "busy", "both"], default="both", help="machine conditions")
    ap.add_argument("--load-procs", type=int, default=None, help="busy loops for --load busy (default: one per core)")
    ap.add_argument("--load-seconds", type=float, default=1800.0,
                    help="each busy loop ends by itself after this many seconds (a safety bound)")
    ap.add_argument("--repeat", type=int, default=1, help="repeats per cell (the median is reported)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: 1 vs 2 threads on solves of growing paths·H·n² (no added load), to place "
                         "threads.WORK_THRESHOLD")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeat < 1:
        ap.error("--steps and --repeat must be >= 1")
    if args.sweep:
        sweep(args.steps, args.repeat)
        return 0
    if args.workload == "paper":
        paper_table(args.variants, args.steps, args.repeat)
        return 0
    modes = []
    for m in args.modes:
        try:
            old = threads.policy(m)
        except (TypeError, ValueError) as e:
            ap.error(f"--modes: {e}")
        modes.append(threads.policy(old))  # the normalised mode ("auto" or an int)
    if "auto" in modes:  # the ratio needs the 1-thread time
        modes = [1] + [m for m in modes if m != 1] if 1 not in modes else modes

    ncpu = os.cpu_count() or 1
    conditions = ["idle", "busy"] if args.load == "both" else [args.load]
    work16 = 4 * 16 * 64 ** 2
    print(f"# workload: {args.workload}" + (f", {args.steps} steps per segment" if args.workload == "segments" else "")
          + f"; torch {torch.__version__}, {ncpu} cores (budget {threads.cpu_budget()}), "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, threads.WORK_THRESHOLD="
          f"{threads.WORK_THRESHOLD:.3g} (largest segment: paths·H·n² = {work16:.3g})")
    print("# load = one-minute load average / tasks runnable now, at the start of each measurement")
    print(f"{'condition':10s} {'threads':8s} {'auto chose':>10s} {'seconds':>9s} {'vs 1 thread':>12s} "
          f"{'load at start':>14s} {'load at end':>12s}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_threads_"))
    results = {}
    try:
        for cond in conditions:
            load = []
            if cond == "busy":
                load = start_load(args.load_procs or ncpu, args.load_seconds)
                time.sleep(2.0)  # let the loops start
            try:
                base = None
                for mode in modes:
                    times, states, chosen = [], [], []
                    for _ in range(args.repeat):
                        start = machine_state()
                        old = threads.policy("auto")
                        chosen.append(threads.choose(work16) if mode == "auto" else mode)
                        threads.policy(old)
                        if args.workload == "segments":
                            dt = run_segments(mode, args.steps)
                        else:
                            dt = run_quick(mode, tmp / "runs")
                        times.append(dt)
                        states.append((start, machine_state()))
                    t = statistics.median(times)
                    base = t if mode == 1 else base
                    results[(cond, mode)] = t
                    ratio = f"{t / base:.2f}x" if base else "-"
                    print(f"{cond:10s} {str(mode):8s} {str(chosen[-1]) if mode == 'auto' else '':>10s} {t:9.2f} "
                          f"{ratio:>12s} {states[0][0]:>14s} {states[-1][1]:>12s}", flush=True)
            finally:
                stop_load(load)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if ("busy", "auto") in results and ("busy", 1) in results:
        r = results[("busy", "auto")] / results[("busy", 1)]
        print(f"# busy cores: auto / 1 thread = {r:.2f} (goal <= 2)")
    if args.workload == "quick" and ("idle", "auto") in results:
        print(f"# README's first command with auto on this machine as it is: {results[('idle', 'auto')]:.1f} s "
              f"(goal <= 60 s on 2 idle cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
