"""What a user sees on a terminal: the command run under a pseudo-terminal of a fixed width, its output replayed
on a small terminal emulator; and the progress of a long segment where no terminal shows it."""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer_pde.application import rundir, runs
from transformer_pde.application import studies
from transformer_pde.application.studies import paper

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 120
_CSI = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def screen(raw: str, width: int = WIDTH):
    """Replay ``raw`` (what a program wrote to a terminal) on an emulated terminal ``width`` columns wide: returns the
    rows of the final screen (the scroll-back included), right-stripped.  Printable characters overwrite the cell
    under the cursor and wrap at ``width``; ``\\r`` goes to column 0, ``\\n`` one row down, ``ESC[nA``/``ESC[nB``
    n rows up/down, ``ESC[K`` erases to the end of the row; other escape sequences are ignored."""
    rows, r, c, i = [[]], 0, 0, 0

    def row(k):
        while len(rows) <= k:
            rows.append([])
        return rows[k]

    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            m = _CSI.match(raw, i)
            if m:
                n = int(m.group(1) or 1)
                if m.group(2) == "A":
                    r = max(0, r - n)
                elif m.group(2) == "B":
                    r += n
                elif m.group(2) == "K":
                    del row(r)[c:]
                i = m.end()
            else:
                i += 1
            continue
        if ch == "\r":
            c = 0
        elif ch == "\n":
            r += 1
        elif ch >= " ":
            if c >= width:
                r, c = r + 1, 0
            cells = row(r)
            cells.extend(" " * (c + 1 - len(cells)))
            cells[c] = ch
            c += 1
        i += 1
    return ["".join(x).rstrip() for x in rows]


def test_the_emulator_replays_a_bar_overwritten_in_place():
    # a bar drawn twice in place, a line under it, the cursor back up and the bar erased: one row left
    raw = "\rbar  10%\rbar  50%\n\rsub\x1b[A\r\x1b[K\rlog line\n"
    assert screen(raw) == ["log line", "sub"]
    assert screen("x" * 130 + "\n", width=120) == ["x" * 120, "x" * 10]


def _run_under_pty(args, cwd, env, timeout=120.0) -> str:
    """stdout + stderr of ``python -m transformer_pde.application.cli ARGS`` on a pseudo-terminal of WIDTH columns."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, WIDTH, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "transformer_pde.application.cli", *args], cwd=cwd, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        proc.wait(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    return out.decode("utf-8", errors="replace")


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="needs a POSIX pseudo-terminal")
def test_log_lines_never_land_inside_a_progress_bar_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COLUMNS": str(WIDTH), "LINES": "40", "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    env.pop("TQDM_DISABLE", None)
    raw = _run_under_pty(["run", "ou_vs_oscillating_quick", "-o", "heads=[1,3]", "-o", 'regimes=["ou"]',
                          "-o", "n=12", "-o", "t1=0.4", "-o", "t_avg=0.2", "-o", "figures=false", "-o", "workers=1",
                          "-o", "bootstrap=0", "--out", str(tmp_path), "--threads", "1"], tmp_path, env)
    assert "%|" in raw, "no progress bar was drawn: the test did not run on a terminal"
    rows = screen(raw)
    logs = [r for r in rows if re.search(r"\[ou_H\d+\] (segment|done)", r)]
    assert len(logs) == 4, rows  # running + done for each of the two segments
    for r in logs:  # each log line on a row of its own, from column 0, never after a bar
        assert re.match(r"\[ou_H\d+\] (segment \d/2 running|done in)", r), rows
        assert "%|" not in r, rows
    for r in rows:  # and no bar row carries a message
        if "%|" in r:
            assert "[ou_H" not in r and "running" not in r, rows
        assert len(r) <= WIDTH


class _Run:
    def __init__(self, progress):
        self.progress, self.step_callback = progress, None


def test_the_segment_bar_counts_work_not_segments():
    # segments of costs steps · paths · H · n²: the first (H = 4) is 4/104 of the work, not half of it
    p = {"t1": 1.0, "dt": 0.01, "paths": 4, "n": 10}
    segs = [("ou", 4), ("ou", 100)]
    work = {s: paper.segment_work(p, [s]) for s in segs}
    with studies.segment_bar(_Run(False), len(segs), "x", "segment", work=work) as bar:
        bar.update(key=("ou", 4))
        assert bar.fraction == pytest.approx(4 / 104, rel=1e-12)
        bar.update(key=("ou", 100))
        assert bar.fraction == 1.0
    with studies.segment_bar(_Run(False), 3, "x", "segment") as bar:  # without costs: equal shares
        bar.update(2)
        assert bar.fraction == pytest.approx(2 / 3, rel=1e-12)


def test_a_segment_without_a_visible_bar_logs_a_heartbeat(tmp_path, monkeypatch, caplog):
    # output not on a terminal (progress off): between "running" and "done" the log says how far the solver is
    monkeypatch.setattr(studies, "HEARTBEAT_S", 0.0)
    cfg = {"kind": "ou_vs_oscillating", "name": "hb", "params": {
        "regimes": ["ou"], "heads": [1, 2], "n": 8, "t1": 0.1, "dt": 0.02, "t_avg": 0.04, "paths": 2,
        "store_paths": 1, "record_every": 1, "figures": False, "workers": 1, "bootstrap": 0}}
    with caplog.at_level(logging.INFO, logger="transformer_pde"):
        runs.execute(cfg, out_dir=tmp_path, progress=False)
    text = [r.getMessage() for r in caplog.records]
    start = text.index(next(t for t in text if t.startswith("[ou_H2] segment 2/2 running")))
    end = text.index(next(t for t in text if t.startswith("[ou_H2] done")))
    beats = [t for t in text[start:end] if t.startswith("[ou_H2] step ")]
    assert [int(re.match(r"\[ou_H2\] step (\d+)/5 ", t).group(1)) for t in beats] == [1, 2, 3, 4, 5]


def test_a_one_path_segment_prints_no_spread(tmp_path):
    # the oscillating weights are deterministic: one path, so its residual has no spread to quote ("± 0.00e+00")
    cfg = {"kind": "ou_vs_oscillating", "name": "one", "params": {
        "regimes": ["oscillating", "ou"], "heads": [1, 2], "n": 8, "t1": 0.1, "dt": 0.02, "t_avg": 0.04,
        "paths": 2, "record_every": 1, "figures": False, "workers": 1, "bootstrap": 0}}
    path = runs.execute(cfg, out_dir=tmp_path, progress=False)
    summary = rundir.RunDir(path).read_json("metrics.json")["summary"]
    osc = [s for s in summary if s.strip().startswith("oscillating H=")]
    ou = [s for s in summary if s.strip().startswith("ou H=")]
    assert len(osc) == 2 and all("one path: no spread" in s and "±" not in s for s in osc), summary
    assert len(ou) == 2 and all(s.count("±") == 2 for s in ou), summary
