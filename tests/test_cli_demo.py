"""The README's entry points: `transformer-pde --help`, `list` and `demo`."""

import json
import subprocess
import sys

from transformer_pde.application.cli import main


def test_help_runs_as_a_console_script():
    out = subprocess.run([sys.executable, "-m", "transformer_pde.application.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "run" in out.stdout and "demo" in out.stdout


def test_demo_writes_a_run_directory(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    run = tmp_path / "demo"
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"energy_final_mean", "slope_time_average", "residual_final_abs_mean"} <= set(metrics)
    # descent with OU heads: the 𝒟-based ledger closes better than the reference code's 𝒢² one
    assert metrics["residual_final_abs_mean"] < metrics["residual_slope_final_abs_mean"]
    for f in ("config.json", "environment.json", "status.json", "figures/ledger.png", "figures/ledger.pdf", "figures/snapshots.png",
              "series/ledger.csv"):
        assert (run / f).exists(), f
    env = json.loads((run / "environment.json").read_text())
    assert env["torch"] and env["python"]
    # running the demo again replaces its own earlier run (and nothing else) rather than failing
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "sentinel.txt").write_text("must survive")
    (run / "stale.txt").write_text("left by the first demo")
    started = env["started"]
    quick = ["-o", "n=8", "-o", "heads=2", "-o", "t1=0.1", "-o", "dt=0.02", "-o", "paths=1"]
    assert main(["demo", "--out", str(tmp_path), "--no-progress", *quick]) == 0
    assert not (run / "stale.txt").exists() and (tmp_path / "keep" / "sentinel.txt").read_text() == "must survive"
    assert json.loads((run / "config.json").read_text())["params"]["n"] == 8
    assert json.loads((run / "environment.json").read_text())["started"] >= started
    assert "demo written to" in capsys.readouterr().out


def test_list_names_the_demo(capsys):
    assert main(["list", "demo"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "paths" in out
