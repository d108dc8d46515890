"""Sweeps: grid expansion, in-process and worker-pool execution, Dask, resume, the gathered table."""

import argparse
import csv
import json

import pytest

from transformer_pde.application import sweep

# a run of a few milliseconds and no figures: 6 tokens, one head, OU only, four Euler steps (each recorded), one path
TINY = {"kind": "causal_clustering", "name": "tiny",
        "params": {"n": 6, "heads": 1, "t1": 0.4, "dt": 0.1, "paths": 1, "regimes": ["ou"], "figures": False,
                   "record_every": 1}}
M = "ou_causal.mean_overlap_final"  # a continuous metric of every point


def _read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_grid_expansion_and_axis_syntax():
    grid = sweep.expand_grid({"a": [1, 2], "b": ["x", "y", "z"]})
    assert len(grid) == 6
    assert grid[0] == {"a": 1, "b": "x"} and grid[1] == {"a": 1, "b": "y"} and grid[3] == {"a": 2, "b": "x"}
    assert {(g["a"], g["b"]) for g in grid} == {(a, b) for a in (1, 2) for b in "xyz"}
    assert sweep.expand_grid({}) == [{}]
    assert sweep.parse_axis("beta=[0.5, 1, 2]") == ("beta", [0.5, 1, 2])
    assert sweep.parse_axis("params.heads=[[1], [1, 10]]") == ("heads", [[1], [1, 10]])
    for bad in ("beta=0.5", "beta=[]", "beta"):
        with pytest.raises(ValueError):
            sweep.parse_axis(bad)
    names = [sweep.point_name(i, p) for i, p in enumerate(sweep.expand_grid({"heads": [[1], [1, 10]], "s": ["a b"]}))]
    assert len(set(names)) == 2 and all("/" not in n and " " not in n for n in names)


def test_bad_sweeps_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="sweep point p001.*dt"):
        sweep.run_sweep(TINY, ["dt=[0.02, -1.0]"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="both a sweep axis"):
        sweep.run_sweep(TINY, ["n=[4, 6]"], overrides=["n=5"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="twice"):
        sweep.run_sweep(TINY, ["n=[4]", "n=[6]"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown config key"):
        sweep.run_sweep(TINY, ["nope=[1, 2]"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="workers"):
        sweep.run_sweep(TINY, ["n=[4]"], workers=0, out_dir=tmp_path)
    for bad in ("", "..", "../escape", "a/b"):
        with pytest.raises(ValueError, match="run name"):
            sweep.run_sweep(TINY, ["n=[4]"], out_dir=tmp_path / "out", name=bad)
    assert list(tmp_path.iterdir()) == []


def test_in_process_sweep_table_resume_and_failure(tmp_path):
    res = sweep.run_sweep(TINY, ["seed=[0, 1]", "n=[4, 6]"], out_dir=tmp_path, name="sw")
    assert len(res.rows) == 4 and len(res.ran) == 4 and not res.skipped and not res.failed
    rows = _read_csv(res.table)
    assert [(int(r["seed"]), int(r["n"])) for r in rows] == [(0, 4), (0, 6), (1, 4), (1, 6)]
    for r in rows:
        # every row carries the point's own resolved params and metrics, read back independently
        rp = res.path / "points" / r["point"]
        cfg = json.loads((rp / "config.json").read_text())["params"]
        met = json.loads((rp / "metrics.json").read_text())
        assert r["state"] == "complete" and int(r["n"]) == cfg["n"] and float(r["t1"]) == cfg["t1"]
        assert float(r[M]) == met["ou_causal"]["mean_overlap_final"]
    # different points really differ, the same seed and n give the same numbers as a direct run
    assert len({r[M] for r in rows}) == 4
    assert res.figure is not None and res.figure.exists() and (res.path / "figures" / "sweep.pdf").exists()

    # an existing sweep needs --resume; another grid in the same directory is refused
    with pytest.raises(ValueError, match="--resume"):
        sweep.run_sweep(TINY, ["seed=[0, 1]", "n=[4, 6]"], out_dir=tmp_path, name="sw")
    with pytest.raises(ValueError, match="another sweep"):
        sweep.run_sweep(TINY, ["seed=[0, 2]", "n=[4, 6]"], out_dir=tmp_path, name="sw", resume=True)

    # a point killed mid-run (status "running"), and one whose directory holds another config (fails)
    killed, clash = rows[1]["point"], rows[2]["point"]
    (res.path / "points" / killed / "status.json").write_text(json.dumps({"state": "running"}))
    cfg_file = res.path / "points" / clash / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["params"]["t1"] = 9.0
    cfg_file.write_text(json.dumps(cfg))
    (res.path / "points" / clash / "status.json").write_text(json.dumps({"state": "interrupted"}))
    before = {r["point"]: (res.path / "points" / r["point"] / "metrics.json").stat().st_mtime_ns for r in rows}
    res2 = sweep.run_sweep(TINY, ["seed=[0, 1]", "n=[4, 6]"], out_dir=tmp_path, name="sw", resume=True,
                           figure=False)
    assert sorted(res2.ran) == sorted([killed, clash])
    assert sorted(res2.skipped) == sorted([rows[0]["point"], rows[3]["point"]])
    assert res2.failed == [clash]
    for p in res2.skipped:  # finished points were not touched
        assert (res.path / "points" / p / "metrics.json").stat().st_mtime_ns == before[p]
    rows2 = {r["point"]: r for r in _read_csv(res2.table)}
    assert rows2[killed]["state"] == "complete"
    assert rows2[killed][M] == rows[1][M]  # same point, same numbers
    assert rows2[clash]["state"] == "failed" and "differs" in rows2[clash]["error"]


def test_pool_of_two_workers_matches_in_process(tmp_path):
    res = sweep.run_sweep(TINY, ["seed=[3, 4]"], out_dir=tmp_path, name="pool", workers=2, threads=1, figure=False)
    assert not res.failed and len(res.ran) == 2
    a = {r["seed"]: r[M] for r in _read_csv(res.table)}
    assert len(set(a.values())) == 2
    # the worker's point is the same run as in this process (seed 4 alone, in-process)
    ref = sweep.run_sweep(TINY, ["seed=[4]"], out_dir=tmp_path, name="serial", workers=1, threads=1, figure=False)
    assert _read_csv(ref.table)[0][M] == a["4"]


def test_cli_subcommand(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    sweep.add_parser(sub)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('kind = "causal_clustering"\n[params]\nn = 6\nheads = 1\nt1 = 0.4\ndt = 0.1\npaths = 1\n'
                   'regimes = ["ou"]\nfigures = false\nrecord_every = 1\n')
    args = parser.parse_args(["sweep", str(cfg), "-s", "seed=[0,1]", "-o", "n=5", "--out", str(tmp_path),
                              "--no-progress", "--metric", M, "--no-figure"])
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert "points: 2" in out and "tiny_sweep" in out
    rows = _read_csv(tmp_path / "tiny_sweep" / "results.csv")
    assert [int(r["n"]) for r in rows] == [5, 5]
    # under the CLI's shared options (a parent parser with --threads "auto" | N), no clash
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser = argparse.ArgumentParser()
    sweep.add_parser(parser.add_subparsers(dest="command"), parents=[common])
    assert parser.parse_args(["sweep", str(cfg), "--threads", "2"]).threads == 2
    assert parser.parse_args(["sweep", str(cfg)]).threads == "auto"


@pytest.mark.slow
def test_dask_local_cluster_of_two_workers(tmp_path):
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cl:
        res = sweep.run_sweep(TINY, ["seed=[5, 6]"], out_dir=tmp_path, name="dask", scheduler=cl.scheduler_address,
                              figure=False)
        # resume through the cluster: nothing left to do
        res2 = sweep.run_sweep(TINY, ["seed=[5, 6]"], out_dir=tmp_path, name="dask", scheduler=cl.scheduler_address,
                               resume=True)
    assert not res.failed and len(res.ran) == 2
    assert res2.ran == [] and len(res2.skipped) == 2
    ref = sweep.run_sweep(TINY, ["seed=[5, 6]"], out_dir=tmp_path, name="serial")
    assert {r["point"]: r[M] for r in _read_csv(res.table)} == \
        {r["point"]: r[M] for r in _read_csv(ref.table)}


def test_dask_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("dask"):
            raise ImportError("no dask here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match="dask\\[distributed\\]"):
        sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, scheduler="tcp://127.0.0.1:1")


# ============================================================================ hostile sweeps
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# points that run for minutes (so that they are live when the test strikes); the tests never wait for them
LONG_TOML = ('kind = "causal_clustering"\nname = "long"\n[params]\nn = 16\nheads = 1\nt1 = 20000.0\ndt = 0.1\n'
             'paths = 1\nregimes = ["ou"]\nfigures = false\nrecord_every = 100\n')


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else "dir")
            for p in sorted(root.rglob("*"))}


def _lock_free(path: Path) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class _Sweep:
    """`transformer-pde sweep` of two long points on 2 workers in its own session (so that the test can always kill
    the whole process group); used as a context manager that kills whatever is left."""

    def __init__(self, tmp: Path, *extra):
        (tmp / "long.toml").write_text(LONG_TOML)
        self.dir = tmp / "out" / "long_sweep"
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transformer_pde.application.cli", "sweep", str(tmp / "long.toml"), "-s", "seed=[0, 1]",
             "--workers", "2", "--threads", "1", "--out", str(tmp / "out"), "--no-progress", "--no-figure", *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def workers(self, timeout=180):
        """The PIDs of the two live points (read from their lock files once both say "running")."""
        def running():
            assert self.proc.poll() is None, self.proc.communicate()
            pids = []
            for d in sorted((self.dir / "points").glob("p*")):
                try:
                    state = json.loads((d / "status.json").read_text())["state"]
                    pid = (d / ".lock").read_text().strip()
                except (OSError, ValueError, KeyError):
                    return False
                if state == "running" and pid.isdigit():
                    pids.append(int(pid))
            self.pids = pids
            return len(pids) == 2

        _wait(running, timeout, "two running points")
        return self.pids

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=30)


import contextlib  # noqa: E402


@pytest.mark.slow
def test_sigterm_stops_the_workers_prints_the_resume_hint_and_frees_the_locks(tmp_path):
    """SIGTERM of a `sweep --workers 2` parent stops the workers and frees the point locks (so that an
    immediate --resume works), and prints the resume hint."""
    with _Sweep(tmp_path) as sw:
        pids = sw.workers()
        sw.proc.send_signal(signal.SIGTERM)
        _, err = sw.proc.communicate(timeout=120)
        assert sw.proc.returncode == 128 + signal.SIGTERM, err
        assert "--resume" in err and "Traceback" not in err, err
        _wait(lambda: not any(_alive(p) for p in pids), 30, "the workers to end")
        for d in sorted((sw.dir / "points").glob("p*")):
            assert json.loads((d / "status.json").read_text())["state"] == "interrupted"
            assert _lock_free(d / ".lock")
        assert _lock_free(sw.dir / ".lock")


@pytest.mark.slow
def test_sigkill_of_the_sweep_ends_its_workers(tmp_path):
    with _Sweep(tmp_path) as sw:
        pids = sw.workers()
        sw.proc.send_signal(signal.SIGKILL)
        sw.proc.communicate(timeout=30)
        _wait(lambda: not any(_alive(p) for p in pids), 60, "the orphaned workers to end")
        for d in sorted((sw.dir / "points").glob("p*")):
            assert _lock_free(d / ".lock")
            assert json.loads((d / "status.json").read_text())["state"] == "interrupted"


@pytest.mark.slow
def test_a_killed_worker_is_a_failed_point_and_results_csv_is_written(tmp_path):
    """kill -9 of one worker ends the sweep without a traceback, with the resume hint and a results.csv
    that marks the points failed."""
    with _Sweep(tmp_path) as sw:
        pids = sw.workers()
        os.kill(pids[0], signal.SIGKILL)
        out, err = sw.proc.communicate(timeout=120)
        assert sw.proc.returncode == 1, err
        assert "Traceback" not in err and "--resume" in out + err, err
        rows = {r["point"]: r for r in _read_csv(sw.dir / "results.csv")}
        assert len(rows) == 2 and all(r["state"] == "failed" for r in rows.values())
        assert any("worker process died" in r["error"] for r in rows.values())
        _wait(lambda: not any(_alive(p) for p in pids), 30, "the other worker to end")


def test_a_sweep_directory_is_locked_like_a_run_directory(tmp_path):
    """A second sweep of one folder is refused while the first runs (two at once would mark a completed
    point failed)."""
    from transformer_pde.application.locks import DirLock, RunLockedError

    res = sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, name="sw", figure=False)
    lock = DirLock(res.path).acquire()  # another live sweep of this folder
    lock.claim()
    try:
        before = _tree(tmp_path)
        with pytest.raises(RunLockedError, match=f"in use by a live run, process {os.getpid()}"):
            sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, name="sw", resume=True, figure=False)
        assert _tree(tmp_path) == before
    finally:
        lock.release()
    res2 = sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, name="sw", resume=True, figure=False)
    assert res2.skipped == res.ran and not res2.failed


def test_cli_sweep_accepts_shipped_names_and_refuses_cleanly(tmp_path, capsys):
    from transformer_pde.application.cli import main as cli_main

    out = tmp_path / "out"
    args = ["-s", "seed=[0]", "-o", "n=4", "-o", "regimes=['ou']", "-o", "figures=false", "--no-progress",
            "--no-figure"]
    assert cli_main(["sweep", "causal_quick", *args, "--out", str(out)]) == 0
    assert (out / "causal_quick_sweep" / "results.csv").is_file()
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = _tree(tmp_path)
    for extra, needle in ((["--out", str(afile)], "is a file"), (["--out", str(afile / "sub")], "not a folder"),
                          (["--out", str(out), "--name", "other", "--scheduler", "tcp://127.0.0.1:9"], "scheduler"),
                          (["--out", str(out), "--name", "big", "-s", "n=[4,5,6]", "--max-points", "2"],
                           "--max-points 3"),
                          (["--out", str(out), "--name", "mem", "--max-memory", "1K"], "--max-memory")):
        assert cli_main(["sweep", "causal_quick", *args, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle.lower() in err.lower() and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _tree(tmp_path) == before, "a refused sweep wrote something (e.g. sweep.json)"


def test_grid_and_worker_limits(tmp_path):
    huge = {"seed": list(range(1000)), "n": list(range(2, 1002))}
    with pytest.raises(ValueError, match="10⁶|1000000 points"):
        sweep.run_sweep(TINY, huge, out_dir=tmp_path)
    with pytest.raises(ValueError, match="max_points=4"):
        sweep.run_sweep(TINY, ["seed=[0,1]", "n=[4,5]"], out_dir=tmp_path, max_points=3)
    with pytest.raises(ValueError, match="more than this machine"):
        sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, workers=10**6)
    with pytest.raises(ValueError, match="more than this machine"):
        sweep.run_sweep(TINY, ["seed=[0]"], out_dir=tmp_path, threads=10**6)
    assert list(tmp_path.iterdir()) == []
