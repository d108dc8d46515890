"""One prepared GPU check (under 8 minutes on one CUDA GPU) that writes one report file.

Steps, each a subprocess with its own time limit (the report keeps its command, exit status,
wall time and the tail of its output):

1. ``pytest -m gpu``: the tests that need a CUDA device;
2. the field benchmark (scripts/benchmark_field.py) up to N = 10⁶ tokens × 8 heads, float32;
3. an ensemble of 4096 systems in one call against separate calls (scripts/benchmark_ensembles.py);
4. the reference-configuration step (scripts/benchmark_reference_step.py, n = 200, H = 100, 10 paths).

    python scripts/gpu_check.py                              # on a CUDA machine: report gpu_check_report.md
    python scripts/gpu_check.py --device cpu --small         # everything tiny on the CPU (plumbing check)
    python scripts/gpu_check.py --dry-run                    # print the commands only

The exit status is 0 when every step exited with 0, else 1 (the report says which failed).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plan(device: str, small: bool):
    """The steps as (name, argv, timeout_s)."""
    py = sys.executable
    s = str(ROOT / "scripts")
    if small:
        return [
            ("pytest -m gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "test_attention.py")], 120),
            ("field benchmark", [py, f"{s}/benchmark_field.py", "--sizes", "100", "400", "--heads", "2", "--dtypes",
                                 "float32", "--device", device, "--no-reference-step", "--max-seconds", "20"], 120),
            ("ensemble", [py, f"{s}/benchmark_ensembles.py", "--sizes", "16", "64", "--steps", "3", "--n", "8",
                          "--max-separate", "4", "--dtype", "float32", "--device", device], 120),
            ("reference step", [py, f"{s}/benchmark_reference_step.py", "--heads", "2", "--paths", "2", "--steps", "2",
                                "--repeat", "1", "--no-projection", "--device", device], 120),
        ]
    return [
        ("pytest -m gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], 150),
        ("field benchmark", [py, f"{s}/benchmark_field.py", "--sizes", "1000", "10000", "100000", "1000000",
                             "--heads", "8", "--dtypes", "float32", "--device", device, "--no-reference-step",
                             "--max-seconds", "60"], 170),
        ("ensemble", [py, f"{s}/benchmark_ensembles.py", "--sizes", "256", "4096", "--steps", "20", "--max-separate",
                      "32", "--dtype", "float32", "--device", device], 60),
        ("reference step", [py, f"{s}/benchmark_reference_step.py", "--heads", "100", "--steps", "10",
                            "--no-projection", "--device", device], 60),
    ]


def _device_line(device: str) -> str:
    try:
        import torch

        line = f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
        if torch.cuda.is_available():
            line += f", {torch.cuda.get_device_name(0)}"
        return line
    except Exception as e:  # the report still says why
        return f"torch not importable: {e}"


def run_step(name, argv, timeout, env):
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + ("\n[stderr]\n" + p.stderr if p.stderr.strip() else "")
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + \
              f"\n[killed after {timeout} s]"
    return {"name": name, "command": shlex.join(argv), "rc": rc, "wall_s": time.perf_counter() - t0, "output": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny sizes (a plumbing check, e.g. on CPU)")
    ap.add_argument("--report", default="gpu_check_report.md", help="the report file to write")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    ap.add_argument("--tail", type=int, default=60, help="lines of each step's output kept in the report")
    args = ap.parse_args(argv)
    steps = plan(args.device, args.small)
    if args.dry_run:
        for name, cmd, timeout in steps:
            print(f"{name} (limit {timeout} s): {shlex.join(cmd)}")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: --device cuda but CUDA is not available here; use --device cpu --small for a "
                  "plumbing check", file=sys.stderr)
            return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    results = []
    t0 = time.perf_counter()
    for name, cmd, timeout in steps:
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        r = run_step(name, cmd, timeout, env)
        print(f"[gpu_check] {name}: rc = {r['rc']}, {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
        results.append(r)
    total = time.perf_counter() - t0
    lines = [f"# transformer_pde GPU check ({'small, ' if args.small else ''}device {args.device})", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", f"- host: {platform.node()} ({platform.platform()})",
             f"- {_device_line(args.device)}", f"- total wall time: {total:.1f} s", "",
             "| step | exit | wall s |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['rc']} | {r['wall_s']:.1f} |" for r in results]
    for r in results:
        tail = "\n".join(r["output"].rstrip().splitlines()[-args.tail:])
        lines += ["", f"## {r['name']}", "", f"`{r['command']}`", "", "```", tail, "```"]
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    tmp = report.with_name(report.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, report)
    ok = all(r["rc"] == 0 for r in results)
    print(f"report: {report} ({'all steps passed' if ok else 'some steps failed'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
