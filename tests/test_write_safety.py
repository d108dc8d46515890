"""Writing files safely: a checkpoint path is checked before any step, a failed write for lack of space says so
(and how to go on) instead of torch's internal message, a run refused by its config leaves no folder behind,
a damaged segment is recomputed on --resume, and the temporary files of a write killed half-way are cleaned up
under the run's lock."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from transformer_pde.application import runs
from transformer_pde.application.cli import main as cli_main
from transformer_pde.utils import validation

ROOT = Path(__file__).resolve().parents[1]


def _problem(dtype):
    x0 = tp.sphere.sample_uniform(6, 3, generator=gen(1), dtype=dtype)
    return x0, tp.OrnsteinUhlenbeck(tp.Heads.random(2, 3, generator=gen(2), dtype=dtype))


# ---------------------------------------------------------------------------- checkpoint path
@pytest.mark.parametrize("where", ["missing/run.ckpt", "a_file/run.ckpt", "folder"])
def test_a_checkpoint_path_that_cannot_be_written_is_refused_before_any_step(tmp_path, dtype, where):
    (tmp_path / "a_file").write_text("a file, not a folder")
    (tmp_path / "folder").mkdir()
    x0, theta = _problem(dtype)
    steps = []
    with pytest.raises(ValueError, match=r"checkpoint .*(does not exist|not a folder|is a folder)"):
        tp.simulate(x0, theta, t1=0.5, dt=0.1, paths=2, seed=0, checkpoint=tmp_path / where, checkpoint_every=2,
                    callback=lambda k, t, x: steps.append(k))
    assert steps == []
    with pytest.raises(ValueError, match="does not exist"):  # the composable entry point too
        tp.solve(tp.Model(theta), x0, tp.Euler(), t1=0.5, dt=0.1, paths=2, seed=0,
                 checkpoint=tp.Checkpointing(tmp_path / "missing" / "x.ckpt", 2))
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------- a full disk
class _FullDisk(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_that_fails_for_lack_of_space_names_the_file_and_the_fix(tmp_path, monkeypatch):
    target = tmp_path / "data" / "seg.pt"
    with pytest.raises(OSError) as got:
        torch.save({"x": torch.zeros(100)}, _FullDisk())
    err = validation.write_error(target, got.value)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err).startswith(f"disk full while writing {target}") and "resume" in str(err)
    # torch's own writer on a full disk: "[enforce fail at inline_container.cc:...]", here with no space left
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("Usage", (), {"free": 0})())
    torch_err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert str(validation.write_error(target, torch_err)).startswith(f"disk full while writing {target}")
    assert validation.write_error(target, RuntimeError("something else")) is None
    assert validation.write_error(target, ValueError("bad value")) is None


_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (60000, 60000))
from transformer_pde.application.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_a_run_that_cannot_write_its_data_says_why_and_how_to_resume(tmp_path):
    # a real failed write: the file size limit (ulimit -f) stops torch.save of a segment half-way
    args = ["run", "ou_vs_oscillating_quick", "-o", "heads=[1]", "-o", 'regimes=["ou"]', "-o", "n=200",
            "-o", "t1=0.2", "-o", "t_avg=0.1", "-o", "figures=false", "-o", "workers=1", "-o", "bootstrap=0",
            "-o", "record_every=1", "--out", str(tmp_path), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _LIMITED, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "enforce fail" not in r.stderr and "Traceback" not in r.stderr
    assert "file size limit" in r.stderr and "data/ou_H1.pt" in r.stderr and "--resume" in r.stderr
    run = tmp_path / "ou_vs_oscillating_quick"
    assert not [p for p in run.rglob("*.tmp")]  # the half-written file was removed
    status = (run / "status.json").read_text()
    assert "interrupted" in status


# ---------------------------------------------------------------------------- refused config: nothing written
def test_demo_with_a_step_that_does_not_divide_the_horizon_is_refused_before_any_folder(tmp_path, capsys):
    rc = cli_main(["demo", "-o", "dt=0.3", "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 2
    assert "dt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- resume
def _paper_cfg(name="r"):
    return {"kind": "ou_vs_oscillating", "name": name, "params": {
        "regimes": ["ou"], "heads": [1, 2], "n": 8, "t1": 0.1, "dt": 0.02, "t_avg": 0.04, "paths": 2,
        "store_paths": 1, "record_every": 1, "figures": False, "workers": 1, "bootstrap": 0,
        "checkpoint_every": 2}}


def test_resume_recomputes_a_segment_that_lacks_a_key(tmp_path, caplog):
    path = runs.execute(_paper_cfg(), out_dir=tmp_path, progress=False)
    seg_file = path / "data" / "ou_H1.pt"
    seg = torch.load(seg_file, weights_only=False)
    reference = seg["slope"].clone()
    del seg["x"]
    torch.save(seg, seg_file)
    (path / "status.json").write_text('{"state": "interrupted"}')  # as if killed before the end
    rc = cli_main(["run", str(_toml(tmp_path)), "--out", str(tmp_path), "--resume", "--no-progress"])
    assert rc == 0
    again = torch.load(seg_file, weights_only=False)
    assert "x" in again
    assert_close(again["slope"], reference, rtol=1e-12, atol=1e-14)  # the same deterministic numbers


def _toml(tmp_path: Path) -> Path:
    cfg = _paper_cfg()
    lines = ['kind = "ou_vs_oscillating"', 'name = "r"', "[params]"]
    for k, v in cfg["params"].items():
        lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v).replace(chr(39), chr(34))}")
    p = tmp_path / "r.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_resume_removes_the_temporary_files_of_a_killed_write(tmp_path):
    path = runs.execute(_paper_cfg(), out_dir=tmp_path, progress=False)
    (path / "status.json").write_text('{"state": "interrupted"}')
    # what a kill -9 during a write leaves: the temporary file of an atomic data write, of a checkpoint save
    stale = [path / "data" / ".ou_H2.pt.4242.0a1b2c3d.tmp", path / "checkpoints" / "ou_H2.ckpt.k3j_x9z1.tmp"]
    for s in stale:
        s.write_bytes(b"half a file")
    mine = path / "notes.tmp"  # not a name the program writes: left alone
    mine.write_text("a user's note")
    runs.execute(_paper_cfg(), out_dir=tmp_path, progress=False, resume=True)
    assert not any(s.exists() for s in stale)
    assert mine.read_text() == "a user's note"
