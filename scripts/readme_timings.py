"""Time what the README asks a new user to run, and print the table of docs/performance.md.

    python scripts/readme_timings.py            # one run of each; --repeats 3 for a spread

Rows: ``transformer-pde --version`` (the launcher, without torch), ``import transformer_pde``, the README's
quick-start and composable-core blocks pasted into a fresh ``python``, the first command's experiment
(``transformer-pde run ou_vs_oscillating_quick`` into a temporary folder, its own ``--threads auto``), and
``transformer-pde list``.  Each row is the wall time of a fresh process (imports included), min and max over
the repeats; the header gives the machine (CPU model, cores), torch's version and the load average before and
after, which says how busy the cores were: read the numbers next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blocks() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    tail = text[text.index("## Quick start"):]
    return "\n".join(re.findall(r"```python\n(.*?)```", tail, re.S)[:2])


def _time(cmd, cwd, env) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-2000:]}")
    return wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    py = sys.executable
    cli = [py, "-c", "import sys, _transformer_pde_cli as c; sys.exit(c.main())"]
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = {"`transformer-pde --version`": lambda d: cli + ["--version"],
            "`import transformer_pde`": lambda d: [py, "-c", "import transformer_pde"],
            "the quick-start and composable-core blocks, pasted into `python`": lambda d: [py, "-c", _blocks()],
            "`transformer-pde run ou_vs_oscillating_quick` (the first command, without the install)":
                lambda d: cli + ["run", "ou_vs_oscillating_quick", "--out", str(Path(d) / f"runs{time.time_ns()}"),
                                 "--no-progress"],
            "`transformer-pde list`": lambda d: cli + ["list"]}
    times = {k: [] for k in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, cmd in rows.items():  # interleaved: a burst of load touches every row alike
                times[name].append(_time(cmd(tmp), tmp, env))
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import torch

    print(f"{_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}; "
          f"load average {load0:.1f} before, {load1:.1f} after; {args.repeats} run(s) of each, fresh processes\n")
    print("| what | wall time (s) |\n|---|---|")
    for name, ts in times.items():
        span = f"{min(ts):.1f}" if len(ts) == 1 else f"{min(ts):.1f}–{max(ts):.1f}"
        print(f"| {name} | {span} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
