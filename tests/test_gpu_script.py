"""scripts/gpu_check.py: the plan covers the GPU measurements of docs/clustering.md, and the script runs end to end
on the CPU with --device cpu --small (slow: four subprocesses that each import torch)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_covers_the_issue(capsys):
    mod = _module()
    steps = mod.plan("cuda", small=False)
    names = [s[0] for s in steps]
    assert names == ["pytest -m gpu", "field benchmark", "ensemble", "reference step"]
    field = steps[1][1]
    assert "1000000" in field and field[field.index("--heads") + 1] == "8"
    assert field[field.index("--dtypes") + 1] == "float32" and field[field.index("--device") + 1] == "cuda"
    assert "4096" in steps[2][1]
    assert any(p.endswith("benchmark_reference_step.py") for p in steps[3][1])
    assert sum(s[2] for s in steps) <= 8 * 60  # the time limits add up to under 8 minutes
    for name, argv, _ in steps + mod.plan("cpu", small=True):  # every script it calls exists
        scripts = [a for a in argv if a.endswith(".py")]
        assert all(Path(a).exists() for a in scripts), name
    assert all("cuda" not in argv for _, argv, _ in mod.plan("cpu", small=True))
    assert mod.main(["--dry-run"]) == 0
    assert "benchmark_field.py" in capsys.readouterr().out


@pytest.mark.slow
def test_small_cpu_run_writes_the_report(tmp_path):
    report = tmp_path / "report.md"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--small",
                        "--report", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    text = report.read_text()
    for name in ("pytest -m gpu", "field benchmark", "ensemble", "reference step"):
        assert f"| {name} | 0 |" in text
    assert "separate/batched" in text  # the ensemble table
