"""Faults on real `transformer-pde run` processes: SIGKILL, SIGTERM, two live runs on one name.

A small harness runs the CLI in a subprocess with a step callback that, at a chosen
(segment, step) of the study, either kills its own process with SIGKILL (no chance to clean up)
or announces itself and blocks (so that the test can send SIGTERM or start a second run against
the live one).  The run is a tiny ``ou_vs_oscillating`` config (4 segments of 10 steps,
checkpoints every 3 steps), so every piece of the resume machinery is used in a few seconds.

Records (series CSVs byte for byte, data tensors bit for bit, metrics except wall times) of every
interrupted-and-resumed run must equal those of one uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transformer_pde.application.cli import main as cli_main
from transformer_pde.application.locks import LOCK_FILE
from transformer_pde.application.runs import execute
from problems import assert_replayed

ROOT = Path(__file__).resolve().parent.parent
PARAMS = {"n": 16, "heads": [1, 3], "paths": 2, "t1": 0.2, "dt": 0.02, "t_avg": 0.05, "record_every": 2,
          "bootstrap": 50, "checkpoint_every": 3, "figures": False, "device": "cpu"}

HARNESS = r'''
import os, signal, sys, time
from pathlib import Path
import transformer_pde.application.runs as runs
from transformer_pde.application.cli import main

mode, tag, step, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
real = runs.execute

def cb(t, k, _time):
    if t == tag and k == step:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        flag.write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not Path(str(flag) + ".go").exists():
            if time.monotonic() > deadline:
                raise SystemExit("harness: never released")
            time.sleep(0.02)

def patched(*a, **kw):
    kw["step_callback"] = cb
    return real(*a, **kw)

runs.execute = patched
sys.exit(main(sys.argv[5:]))
'''


def _toml(path: Path) -> Path:
    lines = ['kind = "ou_vs_oscillating"', 'name = "tiny"', "[params]"]
    lines += [f"{k} = {json.dumps(v).lower() if isinstance(v, bool) else json.dumps(v)}" for k, v in PARAMS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run and the order of its (segment, step) callbacks."""
    tmp = tmp_path_factory.mktemp("reference")
    toml = _toml(tmp / "tiny.toml")
    order = []
    run = execute(toml, out_dir=tmp / "out", progress=False, step_callback=lambda t, k, _: order.append((t, k)))
    assert len(order) >= 30 and len({t for t, _ in order}) == 4
    return toml, run, order


def _spawn(tmp: Path, mode: str, point, flag: Path, cli_args):
    harness = tmp / "harness.py"
    harness.write_text(HARNESS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(harness), mode, point[0], str(point[1]), str(flag), *cli_args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(flag: Path, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, f"the harness ended early (rc {proc.returncode}): {proc.communicate()}"
        assert time.monotonic() < deadline, "the harness never reached its step"
        time.sleep(0.02)


def _tensor_tree_equal(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ {set(a) ^ set(b)}"
        for k in a:
            if k != "timing":
                _tensor_tree_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert_replayed(a, b, where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _records(run: Path):
    m = json.loads((run / "metrics.json").read_text())
    for k in ("timing", "wall_time_s"):
        m.pop(k, None)
    series = {p.name: p.read_bytes() for p in sorted((run / "series").iterdir())}
    data = {p.name: torch.load(p, weights_only=False) for p in sorted((run / "data").iterdir())}
    return m, series, data


def assert_same_records(ref: Path, run: Path) -> int:
    """Asserts equal records; returns how many record files were compared."""
    m1, s1, d1 = _records(ref)
    m2, s2, d2 = _records(run)
    assert m1 == m2
    assert s1 == s2 and s1
    assert set(d1) == set(d2) and d1
    for k in d1:
        _tensor_tree_equal(d1[k], d2[k], k)
    assert json.loads((run / "status.json").read_text())["state"] == "complete"
    assert not list((run / "checkpoints").iterdir()), "checkpoints of finished segments must be removed"
    return 1 + len(s1) + len(d1)


def _kill_points(order, count, seed):
    """``count`` distinct (segment, step) points in increasing run order (each is reached after the last resume)."""
    idx = sorted(random.Random(seed).sample(range(len(order)), count))
    return [order[i] for i in idx]


def _fork_and_kill(point, cli_args):
    """Run `transformer-pde run` in a forked child (torch already imported: no start-up cost) that kills
    itself with SIGKILL at ``point``; returns (exit code, pid)."""
    ctx = multiprocessing.get_context("fork")

    def child():
        import transformer_pde.application.runs as runs

        real = runs.execute

        def cb(t, k, _time):
            if (t, k) == point:
                os.kill(os.getpid(), signal.SIGKILL)

        runs.execute = lambda *a, **kw: real(*a, **{**kw, "step_callback": cb})
        sys.exit(cli_main(cli_args))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(300)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    return proc.exitcode, proc.pid


def _sigkill_rounds(tmp_path, reference, count, seed, how):
    toml, ref_run, order = reference
    out = tmp_path / "out"
    args = ["run", str(toml), "--out", str(out), "--no-progress", "--threads", "1", "--resume"]
    for i, point in enumerate(_kill_points(order, count, seed)):
        if how == "fork":
            rc, pid = _fork_and_kill(point, args)
            err = ""
        else:
            proc = _spawn(tmp_path, "kill", point, tmp_path / f"flag{i}", args)
            _, err = proc.communicate(timeout=300)
            rc, pid = proc.returncode, proc.pid
        assert rc == -signal.SIGKILL, (point, rc, err)
        run = out / "tiny"
        assert json.loads((run / "status.json").read_text())["state"] == "running"  # killed: no chance to write
        assert (run / LOCK_FILE).read_text().strip() == str(pid)  # a dead holder's PID: the OS dropped its lock
    assert cli_main(args) == 0
    env = json.loads((out / "tiny" / "environment.json").read_text())
    assert len(env["resumed"]) == count  # the first round started the run, every later one resumed it
    return assert_same_records(ref_run, out / "tiny")


def test_sigkill_at_random_steps_then_resume_gives_the_uninterrupted_records(tmp_path, reference):
    """SIGKILL at 3 random steps (forked CLI processes), each time resumed, then completed."""
    assert _sigkill_rounds(tmp_path, reference, count=3, seed=2026, how="fork") >= 9


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_many_times(tmp_path, reference, seed):
    """SIGKILL at 8 random steps of fresh `python` processes running the CLI, each time resumed."""
    _sigkill_rounds(tmp_path, reference, count=8, seed=seed, how="subprocess")


def test_a_live_run_refuses_others_then_sigterm_checkpoints_and_resumes(tmp_path, reference, capsys):
    """While a `run` is live, a second `run`, `--resume` and `--overwrite` of it are refused with its PID and
    change nothing; SIGTERM then stops it like Ctrl-C (status "interrupted", exit 143, the resume command on
    stderr), the OS releases its lock, and `--resume` completes it to the uninterrupted records."""
    toml, ref_run, order = reference
    out = tmp_path / "out"
    (out / "neighbour").mkdir(parents=True)
    (out / "neighbour" / "sentinel.txt").write_text("must survive")
    args = ["run", str(toml), "--out", str(out), "--no-progress", "--threads", "1"]
    flag = tmp_path / "flag"
    proc = _spawn(tmp_path, "block", order[len(order) // 2 + 2], flag, args)
    try:
        _wait_for(flag, proc)
        snapshot = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert cli_main([*args, *extra]) == 2, extra
            err = capsys.readouterr().err
            assert f"in use by a live run, process {proc.pid}" in err, (extra, err)
        assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == snapshot
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert "terminated (SIGTERM)" in err and "--resume" in err and str(toml) in err and "Traceback" not in err
    status = json.loads((out / "tiny" / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == "SIGTERM"
    assert cli_main([*args, "--resume"]) == 0
    assert (out / "neighbour" / "sentinel.txt").read_text() == "must survive"
    assert_same_records(ref_run, out / "tiny")
