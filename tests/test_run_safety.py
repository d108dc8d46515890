"""Run directories never lose data: names, markers, overwrite, demo, locks, SIGTERM, errors.

Every test works in a temporary tree that holds, next to ``--out``, folders with sentinel files
(a plain folder inside ``--out``, a finished run, a file next to ``--out``).  After each refused
or allowed operation the whole tree is compared with a snapshot: nothing outside the run
directory the operation was allowed to write may change, and a refused operation changes nothing
at all.  Each way of losing data is one test here; the subprocess faults (SIGKILL, SIGTERM,
two live runs) are in tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from transformer_pde.application import studies
from transformer_pde.application.cli import main as cli_main
from transformer_pde.application.rundir import MARKER, is_run_dir
from transformer_pde.application.locks import RunLockedError, Terminated
from transformer_pde.application.config import check_run_name
from transformer_pde.application.runs import execute, plan
from transformer_pde.application.studies import Option, Study, positive

QUICK_DEMO = ["-o", "n=8", "-o", "heads=2", "-o", "t1=0.1", "-o", "dt=0.02", "-o", "paths=1"]


def _register(monkeypatch, kind="_t_safe", fn=None):
    studies.available()

    def ok(params, run):
        run.save_series("s", {"t": [0.0, 1.0], "v": [float(params["n"]), 2.0]})
        return {"n": params["n"]}

    opts = {"n": Option(3, (int,), "a count", check=positive), "x": Option(1.0, (float,), "a float")}
    monkeypatch.setitem(studies._REGISTRY, kind, Study(kind, fn or ok, opts, "test study"))
    return {"kind": kind, "name": "r"}


def _tree(root: Path) -> dict:
    """{relative path: bytes (files) | 'dir' | 'link -> target'} of everything under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


@pytest.fixture
def site(tmp_path, monkeypatch):
    """tmp/  keep.txt (next to --out)   out/plain/sentinel.txt (not a run)   out/done (a finished run)."""
    cfg = _register(monkeypatch)
    (tmp_path / "keep.txt").write_text("next to --out: must survive")
    out = tmp_path / "out"
    (out / "plain").mkdir(parents=True)
    (out / "plain" / "sentinel.txt").write_text("a user's folder: must survive")
    execute(cfg, out_dir=out, name="done", progress=False)
    assert is_run_dir(out / "done")
    return tmp_path, out, cfg


def _toml(path: Path, kind: str, name: str = "r") -> Path:
    path.write_text(f'kind = "{kind}"\nname = "{name}"\n')
    return path


# ---------------------------------------------------------------------------- names
BAD_NAMES = ["", ".", "..", "../escape", "a/b", "/abs", "x\0y", "-rf", " x", "x ", "tab\tname", "x/..", "del\x7f"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_unsafe_names_are_refused_and_nothing_changes(site, bad):
    tmp_path, out, cfg = site
    before = _tree(tmp_path)
    for kw in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ValueError, match="run name"):
            execute(cfg, out_dir=out, name=bad, progress=False, **kw)
    with pytest.raises(ValueError, match="run name"):  # a name from the config file itself
        execute({**cfg, "name": bad}, out_dir=out, progress=False)
    assert _tree(tmp_path) == before


def test_plain_names_are_accepted():
    for good in ("run", "run.2", "a-b_c", "ünïcode", ".hidden_ok", "x" * 100):
        assert check_run_name(good) == good


def test_cli_empty_name_escape_and_dotdot_overwrite(site, capsys):
    """Three commands that could delete or write outside --out: each is refused."""
    tmp_path, out, cfg = site
    toml = _toml(tmp_path / "c.toml", cfg["kind"])
    before = _tree(tmp_path)
    for args in (["--name", ""], ["--name", "", "--overwrite"], ["--name", "../escape"],
                 ["--name", "..", "--overwrite"], ["--name", "../escape", "--resume"]):
        assert cli_main(["run", str(toml), "--out", str(out), "--no-progress", *args]) == 2, args
        err = capsys.readouterr().err
        assert "run name" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for args in (["--name", ""], ["--name", ".."], ["--name", "../escape"]):
        assert cli_main(["demo", "--out", str(out), "--no-progress", *args]) == 2
        assert "run name" in capsys.readouterr().err
    assert _tree(tmp_path) == before
    assert not (tmp_path / "escape").exists()


# ---------------------------------------------------------------------------- markers
def test_overwrite_resume_and_run_refuse_an_unmarked_folder(site):
    tmp_path, out, cfg = site
    # a folder that even looks like a run (config.json, status.json) but was not made by us
    fake = out / "r"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"kind": cfg["kind"]}))
    (fake / "results.csv").write_text("precious")
    before = _tree(tmp_path)
    for kw in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ValueError, match="not a transformer-pde run directory.*left untouched"):
            execute(cfg, out_dir=out, progress=False, **kw)
        with pytest.raises(ValueError, match="not a transformer-pde run directory"):
            execute(cfg, out_dir=out, name="plain", progress=False, **kw)
    assert _tree(tmp_path) == before
    assert not (fake / ".lock").exists(), "not even a lock file may be created in a folder that is not ours"


@pytest.mark.parametrize("marker", ["", "not json", "[]", '{"transformer_pde_run": false}', "dir", "link"])
def test_a_forged_or_broken_marker_is_not_ours(site, marker):
    tmp_path, out, cfg = site
    d = out / "r"
    d.mkdir()
    if marker == "dir":
        (d / MARKER).mkdir()
    elif marker == "link":
        os.symlink(out / "done" / MARKER, d / MARKER)
    else:
        (d / MARKER).write_text(marker)
    (d / "data.txt").write_text("keep")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="not a transformer-pde run directory"):
        execute(cfg, out_dir=out, progress=False, overwrite=True)
    assert _tree(tmp_path) == before


def test_a_symlink_to_a_run_is_not_followed(site):
    tmp_path, out, cfg = site
    os.symlink(out / "done", out / "r")
    before = _tree(tmp_path)
    for kw in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ValueError, match="not a transformer-pde run directory"):
            execute(cfg, out_dir=out, progress=False, **kw)
    assert _tree(tmp_path) == before


def test_overwrite_empties_only_the_marked_run_and_never_follows_links(site):
    tmp_path, out, cfg = site
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "precious.txt").write_text("outside the run: must survive")
    os.symlink(victim, out / "done" / "link_to_elsewhere")
    (out / "done" / "extra.txt").write_text("made inside the run: may go")
    before = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("out/done")}
    execute(cfg, out_dir=out, name="done", progress=False, overwrite=True)
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/done")} == before
    assert not (out / "done" / "extra.txt").exists() and not (out / "done" / "link_to_elsewhere").exists()
    assert (victim / "precious.txt").read_text() == "outside the run: must survive"
    assert is_run_dir(out / "done")
    assert json.loads((out / "done" / "status.json").read_text())["state"] == "complete"
    assert json.loads((out / "done" / "environment.json").read_text())["resumed"] == []


def test_an_existing_run_is_refused_without_resume_or_overwrite(site, capsys):
    tmp_path, out, cfg = site
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="exists and is complete .*--overwrite"):  # the finished run is named so
        execute(cfg, out_dir=out, name="done", progress=False)
    assert _tree(tmp_path) == before


def test_refused_resume_lists_the_differing_keys(site):
    tmp_path, out, cfg = site
    before = _tree(tmp_path)
    with pytest.raises(ValueError) as e:
        execute(cfg, overrides=["n=5", "x=2.5"], out_dir=out, name="done", progress=False, resume=True)
    msg = str(e.value)
    assert "n: 3 -> 5" in msg and "x: 1.0 -> 2.5" in msg, msg
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------- demo
def test_demo_refuses_an_unmarked_folder_and_a_run_of_another_kind(site, capsys):
    tmp_path, out, cfg = site
    before = _tree(tmp_path)
    assert cli_main(["demo", "--out", str(out), "--name", "plain", "--no-progress", *QUICK_DEMO]) == 2
    assert "not a transformer-pde run directory" in capsys.readouterr().err
    assert cli_main(["demo", "--out", str(out), "--name", "done", "--no-progress", *QUICK_DEMO]) == 2
    assert "not a 'demo' run" in capsys.readouterr().err
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------- locks (in-process part)
def test_a_locked_run_is_refused_with_the_pid(site, monkeypatch):
    """The holder is this very process here (the lock is per open file); tests/test_faults.py uses a second one."""
    tmp_path, out, cfg = site
    seen = {}

    def study(params, run):
        before = _tree(tmp_path)
        for kw in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(RunLockedError, match=f"in use by a live run, process {os.getpid()}") as e:
                execute(cfg, out_dir=out, name="live", progress=False, **kw)
            assert e.value.pid == os.getpid()
        assert _tree(tmp_path) == before
        seen["ok"] = True
        return {}

    _register(monkeypatch, kind=cfg["kind"], fn=study)
    execute(cfg, out_dir=out, name="live", progress=False)
    assert seen == {"ok": True}
    # released at the end: a resume is allowed again
    assert plan(cfg, out_dir=out, name="live", resume=True)[1] == out / "live"


# ---------------------------------------------------------------------------- SIGTERM (in-process part)
def test_sigterm_is_handled_like_ctrl_c_and_the_handler_is_restored(site, monkeypatch, capsys):
    tmp_path, out, cfg = site
    calls = []

    def study(params, run):
        calls.append(run.resume)
        if len(calls) == 1:
            run.save_tensors("part", {"v": torch.ones(1)})
            os.kill(os.getpid(), signal.SIGTERM)
        return {"parts": 2 if run.load_tensors("part") is not None else 1}

    _register(monkeypatch, kind=cfg["kind"], fn=study)
    old = signal.getsignal(signal.SIGTERM)
    toml = _toml(tmp_path / "c.toml", cfg["kind"])
    assert cli_main(["run", str(toml), "--out", str(out), "--no-progress"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "terminated (SIGTERM)" in err and "--resume" in err and str(toml) in err
    assert signal.getsignal(signal.SIGTERM) is old
    status = json.loads((out / "r" / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == "SIGTERM"
    assert cli_main(["run", str(toml), "--out", str(out), "--no-progress", "--resume"]) == 0
    assert json.loads((out / "r" / "metrics.json").read_text())["parts"] == 2 and calls == [False, True]
    with pytest.raises(Terminated):  # the library raises it too
        calls.clear()
        execute(cfg, out_dir=out, name="lib", progress=False)
    assert signal.getsignal(signal.SIGTERM) is old


# ---------------------------------------------------------------------------- CLI errors: exit 2, nothing written
@pytest.mark.parametrize("override, key", [
    ("t1=inf", "t1"), ("beta=inf", "beta"), ("ou_sigma2=inf", "ou_sigma2"), ("ou_rate=inf", "ou_rate"),
    ("seed=-1", "seed"), ("noise_seed=-5", "noise_seed"), ("t1=nan", "t1"), ("dt=-inf", "dt"), ("seed=4294967296", "seed"),
    ("t_avg=1e400", "t_avg"),
])
def test_bad_overrides_are_refused_before_the_run_directory_exists(tmp_path, capsys, override, key):
    out = tmp_path / "out"
    assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(out), "-o", override, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_bad_config_and_out_arguments_give_one_line_errors(tmp_path, capsys):
    binary = tmp_path / "b.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    nul = tmp_path / "n.toml"
    nul.write_text('kind = "demo"\x00\n')
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [
        (["run", str(tmp_path / "adir"), "--out", str(tmp_path / "o")], "is a directory"),
        (["run", str(binary), "--out", str(tmp_path / "o")], "not a text (UTF-8) TOML file"),
        (["run", str(nul), "--out", str(tmp_path / "o")], "binary file"),
        (["run", "no_such_config", "--out", str(tmp_path / "o")], "neither a file nor a shipped config"),
        (["run", "ou_vs_oscillating_quick", "--out", str(afile)], "is a file, not a folder"),
        (["run", "ou_vs_oscillating_quick", "--out", str(afile / "sub")], "not a folder"),
        (["demo", "--out", str(afile)], "is a file, not a folder"),
        (["run", "ou_vs_oscillating_quick", "demo_missing.toml", "--out", str(tmp_path / "o")], "1 of 2 configs"),
        (["run", "ou_vs_oscillating_quick", "s2_ou", "--name", "x", "--out", str(tmp_path / "o")],
         "--name names one run directory"),
        (["run", "ou_vs_oscillating_quick", "ou_vs_oscillating_quick", "--out", str(tmp_path / "o")],
         "same run directory"),
    ]
    before = _tree(tmp_path)
    for argv, needle in cases:
        assert cli_main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    assert _tree(tmp_path) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(ro), "--no-progress"]) == 2
        assert "permission denied" in capsys.readouterr().err
        assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(ro / "sub"), "--no-progress"]) == 2
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_out_that_cannot_be_created_is_a_clean_error(site, monkeypatch, capsys):
    """What a read-only --out looks like when the permission check passes (e.g. root on a read-only mount)."""
    tmp_path, out, cfg = site
    real_mkdir = os.mkdir

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "mkdir", refuse)
    toml = _toml(tmp_path / "c.toml", cfg["kind"], name="new")
    before = _tree(tmp_path)
    assert cli_main(["run", str(toml), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot create" in err and "Permission denied" in err and "Traceback" not in err
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert _tree(tmp_path) == before


def test_script_output_folders_follow_the_run_rules(tmp_path):
    """The examples' --out: created and marked when new or empty, reused when marked, else refused."""
    from transformer_pde.application.rundir import RunDir

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a transformer-pde run directory"):
        RunDir.for_script(user, "example:x")
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    link = tmp_path / "link"
    link.symlink_to(user)
    with pytest.raises(ValueError, match="not a transformer-pde run directory"):
        RunDir.for_script(link, "example:x")
    fresh = tmp_path / "a" / "b"
    rd = RunDir.for_script(fresh, "example:x")
    assert is_run_dir(fresh) and (fresh / "figures").is_dir()
    rd.write_json("metrics.json", {"v": 1})
    again = RunDir.for_script(fresh, "example:x")        # our own folder: reused
    assert again.read_json("metrics.json") == {"v": 1}
    empty = tmp_path / "empty"
    empty.mkdir()
    RunDir.for_script(empty, "example:x")
    assert is_run_dir(empty)


# ============================================================================ hostile run directories
def _strict_json(path: Path):
    """json.loads that refuses the non-standard NaN / Infinity tokens."""
    def refuse(token):
        raise AssertionError(f"{path} holds the non-JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _interrupted_run(tmp_path, monkeypatch, kind="_t_links"):
    """An interrupted run out/r (its first call fails after writing a series and a piece), resumable, and the
    TOML config that resumes it."""
    calls = []

    def study(params, run):
        calls.append(run.resume)
        run.save_series("s", {"t": [0.0, 1.0], "v": [1.0, 2.0]})
        run.save_tensors("piece", {"v": torch.ones(2)})
        if len(calls) == 1:
            raise KeyboardInterrupt
        return {"n": params["n"]}

    cfg = _register(monkeypatch, kind=kind, fn=study)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        execute(cfg, out_dir=out, progress=False)
    return out / "r", _toml(tmp_path / "c.toml", kind), calls


def _outside(tmp_path):
    """Files and a folder OUTSIDE the run directory that a link inside it may point at."""
    victim = tmp_path / "outside"
    victim.mkdir()
    (victim / "precious.txt").write_text("outside the run: must stay byte for byte")
    (victim / "other.bin").write_bytes(bytes(range(256)))
    return victim


def _plant(kind: str, run: Path, victim: Path):
    if kind == "symlink config.json.tmp":
        os.symlink(victim / "precious.txt", run / "config.json.tmp")
    elif kind == "hardlink status.json.tmp":
        os.link(victim / "other.bin", run / "status.json.tmp")
    elif kind == "symlink series/":
        import shutil

        shutil.rmtree(run / "series")
        os.symlink(victim, run / "series")
    elif kind == "symlink data/piece.pt":
        (run / "data" / "piece.pt").unlink()
        os.symlink(victim / "other.bin", run / "data" / "piece.pt")
    elif kind == "hardlink metrics.csv":
        os.link(victim / "precious.txt", run / "metrics.csv")
    elif kind == "symlink .lock":
        (run / ".lock").unlink()
        os.symlink(victim / "precious.txt", run / ".lock")
    elif kind == "hardlink .lock":
        (run / ".lock").unlink()
        os.link(victim / "precious.txt", run / ".lock")


LINKS = ["symlink config.json.tmp", "hardlink status.json.tmp", "symlink series/", "symlink data/piece.pt",
         "hardlink metrics.csv", "symlink .lock", "hardlink .lock"]


@pytest.mark.parametrize("link", LINKS)
def test_resume_refuses_a_run_directory_holding_links_and_the_outside_is_untouched(tmp_path, monkeypatch, capsys,
                                                                                   link):
    """--resume must not write through a symlinked config.json.tmp or truncate a file hard-linked as
    status.json.tmp and wrote CSVs into the folder a symlinked series/ pointed to."""
    run, toml, calls = _interrupted_run(tmp_path, monkeypatch)
    victim = _outside(tmp_path)
    _plant(link, run, victim)
    before = _tree(victim)
    run_before = _tree(run)
    assert cli_main(["run", str(toml), "--out", str(run.parent), "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert ("link" in err or "lock file" in err) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _tree(victim) == before, "a file outside the run directory changed"
    assert _tree(run) == run_before, "a refused resume changed the run directory"
    assert calls == [False], "the study ran although the resume was refused"


def test_atomic_writes_never_open_an_existing_name(tmp_path):
    """The temporary file is created exclusively: a link planted at the old fixed temp name (or at the target)
    is never written through; the target name is replaced, its former (outside) inode untouched."""
    from transformer_pde.application.rundir import RunDir, atomic_write_text

    victim = _outside(tmp_path)
    before = _tree(victim)
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(victim / "precious.txt", d / "f.txt.tmp")
    os.link(victim / "other.bin", d / "g.txt")
    atomic_write_text(d / "f.txt", "mine")
    atomic_write_text(d / "g.txt", "mine too")
    rd = RunDir(tmp_path / "r")
    os.symlink(victim / "other.bin", rd.data_path("x").with_name("x.pt.tmp"))
    rd.save_tensors("x", {"v": torch.zeros(1)})
    assert (d / "f.txt").read_text() == "mine" and (d / "g.txt").read_text() == "mine too"
    assert os.stat(d / "g.txt").st_nlink == 1
    torch.testing.assert_close(rd.load_tensors("x")["v"], torch.zeros(1))
    assert _tree(victim) == before
    assert not [p for p in d.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


# ---------------------------------------------------------------------------- two runs of one name
def _mtimes(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size, p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_a_run_refused_after_the_other_finished_leaves_every_file_as_it_was(tmp_path, monkeypatch):
    """Two runs of one --name started together.  Here the race is replayed deterministically: B passes
    its checks while the folder does not exist, A then runs to the end, B opens the folder.  B is refused
    (exit 2 in the CLI) and must not have created or modified a single file (the lock file included)."""
    import transformer_pde.application.runs as runs

    cfg = _register(monkeypatch)
    out = tmp_path / "out"
    real_plan = runs.plan
    state = {}

    def plan_then_a_wins(*a, **kw):
        got = real_plan(*a, **kw)
        if not state:
            state["a"] = True
            execute(cfg, out_dir=out, name="same", progress=False)  # A: from start to finish
            state["after_a"] = _mtimes(out / "same")
        return got

    monkeypatch.setattr(runs, "plan", plan_then_a_wins)
    with pytest.raises(ValueError, match="exists and is complete .*--overwrite"):
        execute(cfg, out_dir=out, name="same", progress=False)  # B
    assert _mtimes(out / "same") == state["after_a"]


def test_a_folder_being_created_by_a_live_run_is_reported_as_in_use(tmp_path, monkeypatch):
    """The other run has made the folder and holds its lock but has not written its marker yet: the refusal names
    the live run (not "not a run directory"), and nothing changes."""
    import fcntl

    import transformer_pde.application.runs as runs

    cfg = _register(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    real_plan = runs.plan

    def plan_then_other_starts(*a, **kw):
        got = real_plan(*a, **kw)
        (out / "same").mkdir()
        fd = os.open(out / "same" / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts like another process
        state.append(fd)
        return got

    state = []
    monkeypatch.setattr(runs, "plan", plan_then_other_starts)
    try:
        with pytest.raises(RunLockedError, match="in use by a live run"):
            execute(cfg, out_dir=out, name="same", progress=False)
        assert [p.name for p in (out / "same").iterdir()] == [".lock"]
        assert (out / "same" / ".lock").read_bytes() == b""
    finally:
        for fd in state:
            os.close(fd)


def test_two_processes_with_one_name_started_together(tmp_path, monkeypatch):
    """Two forked `run` commands on one --name released at the same instant: exit codes 0 and 2, the loser's one
    line names the live (or finished) run, and the run directory is the winner's complete run."""
    import multiprocessing
    import time

    def slow(params, run):
        time.sleep(0.5)
        run.save_series("s", {"t": [0.0], "v": [1.0]})
        return {"n": params["n"]}

    cfg = _register(monkeypatch, fn=slow)
    toml = _toml(tmp_path / "c.toml", cfg["kind"], name="same")
    out = tmp_path / "out"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)

    def child(i):
        fd = os.open(tmp_path / f"err{i}", os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        import sys

        sys.stderr = os.fdopen(2, "w", buffering=1)
        barrier.wait(30)
        os._exit(cli_main(["run", str(toml), "--out", str(out), "--no-progress"]))

    procs = [ctx.Process(target=child, args=(i,)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.exitcode is None:
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert sorted(codes) == [0, 2], codes
    loser = codes.index(2)
    err = (tmp_path / f"err{loser}").read_text()
    assert ("in use by a live run" in err or "exists; pass --resume" in err or "exists and is complete" in err) \
        and "not a transformer-pde" not in err, err
    assert json.loads((out / "same" / "status.json").read_text())["state"] == "complete"
    assert (out / "same" / ".lock").read_bytes() == b""


# ---------------------------------------------------------------------------- resume integrity
PAPER_TINY = ["-o", "n=8", "-o", "heads=[1,2]", "-o", "paths=2", "-o", "t1=0.1", "-o", "dt=0.02", "-o", "t_avg=0.02",
              "-o", "record_every=1", "-o", "bootstrap=20", "-o", "figures=false", "-o", "regimes=['ou']",
              "-o", "device='cpu'"]


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    """A finished tiny ou_vs_oscillating run (two segments): its folder is copied by each test."""
    out = tmp_path_factory.mktemp("paper")
    assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(out), "--name", "p", "--no-progress",
                     *PAPER_TINY]) == 0
    return out / "p"


def _copy_run(src: Path, dst_parent: Path) -> Path:
    import shutil

    dst = dst_parent / src.name
    shutil.copytree(src, dst, symlinks=True)
    (dst / ".lock").write_bytes(b"")
    return dst


def _resume(run: Path):
    return cli_main(["run", "ou_vs_oscillating_quick", "--out", str(run.parent), "--name", run.name, "--no-progress",
                     "--resume", *PAPER_TINY])


@pytest.mark.parametrize("where", ["segment", "checkpoint"])
def test_resume_refuses_a_stored_piece_holding_nan(tmp_path, paper_run, capsys, where):
    """--resume must refuse a stored segment holding NaN (metrics.json would get NaN, the summary 'mean 𝒢² = nan')."""
    run = _copy_run(paper_run, tmp_path)
    if where == "segment":
        f = run / "data" / "ou_H1.pt"
        seg = torch.load(f, weights_only=False)
        seg["slope"][3, 0] = float("nan")
        torch.save(seg, f)
        needle = "'slope'"
    else:
        f = run / "checkpoints" / "ou_H2.ckpt"
        torch.save({"kind": "transformer_pde.simulate", "fingerprint": "x", "k": 2,
                    "x": torch.tensor([[1.0, float("inf")]])}, f)
        needle = "'x'"
    before = _tree(run)
    assert _resume(run) == 2
    err = capsys.readouterr().err
    assert str(f) in err and needle in err and "NaN/inf" in err and "delete it" in err, err
    assert _tree(run) == before


def test_resume_with_a_segment_missing_a_key_recomputes_it_and_names_the_file(tmp_path, paper_run, capsys):
    run = _copy_run(paper_run, tmp_path)
    f = run / "data" / "ou_H2.pt"
    seg = torch.load(f, weights_only=False)
    del seg["ledger"]
    torch.save(seg, f)
    (run / "status.json").write_text('{"state": "interrupted"}')  # a complete run is not run again on --resume
    rc = _resume(run)
    err = capsys.readouterr().err
    assert rc == 0 and str(f) in err and "'ledger" in err and "computed again" in err and "Traceback" not in err, err
    assert "ledger" in torch.load(f, weights_only=False)


def test_resume_with_a_corrupt_environment_json_names_the_file(tmp_path, paper_run, capsys):
    run = _copy_run(paper_run, tmp_path)
    (run / "environment.json").write_text('{"torch": "2.')
    before = _tree(run)
    assert _resume(run) == 2
    err = capsys.readouterr().err
    assert str(run / "environment.json") in err and "Traceback" not in err, err
    assert _tree(run) == before


def test_an_intact_run_resumes(tmp_path, paper_run):
    run = _copy_run(paper_run, tmp_path)
    assert _resume(run) == 0
    m = _strict_json(run / "metrics.json")
    assert m["summary"] and "nan" not in " ".join(m["summary"]).lower()


def test_metrics_json_never_holds_nan_or_infinity(tmp_path, monkeypatch):
    """Undefined statistics are written as null, listed with a reason; the file is strict JSON."""
    def study(params, run):
        return {"a": float("nan"), "b": {"c": [1.0, float("inf")]}, "t": torch.tensor([float("-inf"), 2.0]),
                "ok": 1.5}

    cfg = _register(monkeypatch, fn=study)
    run = execute(cfg, out_dir=tmp_path, progress=False)
    m = _strict_json(run / "metrics.json")
    assert m["a"] is None and m["b"]["c"] == [1.0, None] and m["t"] == [None, 2.0] and m["ok"] == 1.5
    assert sorted(m["undefined_metrics"]["keys"]) == ["a", "b.c.1", "t.0"] and m["undefined_metrics"]["reason"]
    import csv

    rows = dict(csv.reader((run / "metrics.csv").read_text().splitlines()))
    assert rows["a"] == "" and rows["b.c.1"] == "" and rows["t.1"] == "2.0"
    assert not [v for v in rows.values() if v.lower() in ("nan", "inf", "-inf")]
    from transformer_pde.application.rundir import RunDir

    with pytest.raises(ValueError):  # the guard itself: allow_nan=False
        RunDir(tmp_path / "x").write_json("y.json", {"v": float("nan")})


def test_causal_refuses_a_single_token(tmp_path, capsys):
    """causal with n = 1: metrics.json never holds NaN or Infinity."""
    out = tmp_path / "out"
    assert cli_main(["run", "causal_quick", "--out", str(out), "-o", "n=1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'n'" in err and ">= 2" in err
    assert not out.exists()


# ---------------------------------------------------------------------------- option bounds, raw errors
@pytest.mark.parametrize("config, override, needles", [
    ("ou_vs_oscillating_quick", "record_every=1000", ["'record_every'", "600 steps", "record_every <= 175"]),
    ("causal_quick", "record_every=41", ["'record_every'", "40 steps", "record_every <= 40"]),
    ("phase_diagram_quick", "record_every=100000", ["'record_every'", "steps"]),
    ("ou_vs_oscillating_quick", "n=99999999999999999999", ["'n'", "64-bit"]),
    ("ou_vs_oscillating_quick", "heads=[1, 99999999999999999999]", ["'heads'", "64-bit"]),
])
def test_options_bounded_by_the_horizon_and_int64(tmp_path, capsys, config, override, needles):
    out = tmp_path / "out"
    assert cli_main(["run", config, "--out", str(out), "-o", override, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in needles) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_record_every_at_the_horizon_is_accepted():
    from transformer_pde.application.config import load_config

    cfg = load_config({"kind": "causal_clustering", "params": {"t1": 4.0, "dt": 0.1, "record_every": 40}})
    assert cfg["params"]["record_every"] == 40


def test_raw_config_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    cfg = _register(monkeypatch)
    listkind = tmp_path / "listkind.toml"
    listkind.write_text('kind = ["demo", "x"]\n')
    nested = tmp_path / "nested.toml"
    nested.write_text('kind = {a = 1}\n')
    long_name = "x" * 300
    out = tmp_path / "out"
    cases = [
        (["run", str(listkind)], "'kind' must be a string"),
        (["run", str(nested)], "'kind' must be a string"),
        (["run", f"{long_name}.toml"], "cannot be looked up"),
        (["run", str(_toml(tmp_path / "c.toml", cfg["kind"])), "--name", long_name], "shorter --name"),
        (["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / long_name / "o")], "shorter --out"),
        (["demo", "--name", long_name], "shorter --name"),
    ]
    before = _tree(tmp_path)
    for argv, needle in cases:
        argv = [*argv, "--no-progress"] + ([] if "--out" in argv else ["--out", str(out)])
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert _tree(tmp_path) == before and not out.exists()


def test_a_utf8_bom_is_accepted(tmp_path, monkeypatch):
    cfg = _register(monkeypatch)
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf" + f'kind = "{cfg["kind"]}"\n[params]\nn = 4\n'.encode())
    from transformer_pde.application.config import load_config

    assert load_config(f)["params"]["n"] == 4


def test_a_failed_run_directory_creation_leaves_no_new_out_folder(site, monkeypatch):
    """With a new --out and a run directory that cannot be made, the --out folder is not left behind."""
    tmp_path, out, cfg = site
    real_mkdir = os.mkdir

    def refuse_run_dir(path, *a, **k):
        if Path(path).name == "r":
            raise OSError(36, "File name too long", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", refuse_run_dir)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="cannot create run directory"):
        execute(cfg, out_dir=tmp_path / "new" / "deeper", progress=False)
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------- resource guards
@pytest.mark.parametrize("override, flag, term", [
    ("n=10000000000", "--max-memory", "kernel blocks"), ("paths=10000000", "--max-memory", "kernel blocks"),
    ("bootstrap=1000000000", "--max-memory", "lower bootstrap"), ("dt=1e-10", "--max-steps", "raise dt"),
])
def test_resource_guards_refuse_before_anything_is_written(tmp_path, capsys, override, flag, term):
    """Runs too large for the machine: one line with the estimate and the flag to pass, exit 2, nothing created
    (not a MemoryError/RuntimeError traceback after seconds, or a hang, with a run directory written)."""
    out = tmp_path / "out"
    assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(out), "-o", override, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert flag in err and term in err and "about" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_resource_limits_are_raised_and_lowered_by_flags(tmp_path, capsys, monkeypatch):
    from transformer_pde.application.config import check_resources, load_config, parse_size

    assert [parse_size(s) for s in ("512", "1K", "2M", "1.5G", "1T", "3GiB")] == \
        [512, 1024, 2 * 2**20, int(1.5 * 2**30), 2**40, 3 * 2**30]
    for bad in ("", "-1G", "lots", "1X", "nanG"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    cfg = load_config("experiments/ou_vs_oscillating_quick.toml", ["dt=1e-10"])
    est = check_resources(cfg, max_steps=10**12, max_memory="100T")  # raised: accepted
    assert est["steps"] == pytest.approx(6 * 6.0 / 1e-10, rel=1e-6)  # 2 regimes x 3 head counts x t1/dt
    out = tmp_path / "out"
    for extra, needle in ((["--max-memory", "1K"], "--max-memory"), (["--max-steps", "10"], "--max-steps")):
        assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(out), "--no-progress", *extra]) == 2
        assert needle in capsys.readouterr().err
    assert cli_main(["run", "ou_vs_oscillating_quick", "--out", str(out), "--max-memory", "lots"]) == 2
    assert "--max-memory" in capsys.readouterr().err
    assert not out.exists()


def test_threads_are_bounded_by_the_machine(tmp_path, capsys):
    """--threads 100000 is refused (a huge count crashes the OpenMP runtime)."""
    from transformer_pde.application.cli import max_threads

    for cmd in (["run", "ou_vs_oscillating_quick", "--out", str(tmp_path / "o")], ["list"],
                ["sweep", "causal_quick", "-s", "seed=[0]", "--out", str(tmp_path / "o")]):
        for n in ("100000", str(max_threads() + 1), "9" * 30):
            assert cli_main([*cmd, "--threads", n]) == 2
            err = capsys.readouterr().err
            assert "--threads" in err and str(max_threads()) in err and "Traceback" not in err, err
    assert cli_main(["list", "--threads", str(max_threads())]) == 0
    assert not (tmp_path / "o").exists()
