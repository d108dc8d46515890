"""Run directories never lose data (issue 12): names, markers, overwrite, demo, locks, SIGTERM, errors.

Every test works in a temporary tree that holds, next to ``--out``, folders with sentinel files
(a plain folder inside ``--out``, a finished run, a file next to ``--out``).  After each refused
or allowed operation the whole tree is compared with a snapshot: nothing outside the run
directory the operation was allowed to write may change, and a refused operation changes nothing
at all.  Each data-loss case of issue 12 is one test here; the subprocess faults (SIGKILL, SIGTERM,
two live runs) are in tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from transformer_pde import studies
from transformer_pde.cli import main as cli_main
from transformer_pde.runs import MARKER, RunLockedError, Terminated, check_run_name, execute, is_run_dir, plan
from transformer_pde.studies import Option, Study, positive

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
    """The three commands of issue 12 that deleted or wrote outside --out."""
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
    with pytest.raises(ValueError, match="exists; pass --resume"):
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
    from transformer_pde.runs import RunDir

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
