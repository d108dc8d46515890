"""Run directories and the `transformer-pde run` command (transformer_pde/application/runs.py, cli.py).

Studies registered here are throw-away ones (removed again after each test) so that the
machinery is tested independently of any experiment: config resolution and overrides,
refusals with the key and the allowed values, atomic writes, status on interruption,
environment on resume, flattened metrics, the CLI's messages and exit codes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from transformer_pde.application import studies
from transformer_pde.application.cli import main as cli_main
from transformer_pde.application.rundir import RunDir, atomic_write_text, flatten_metrics
from transformer_pde.application.runs import execute
from transformer_pde.application.config import load_config, parse_override
from transformer_pde.application.studies import Option, Study, positive


class Boom(Exception):
    pass


def _register(monkeypatch, kind, fn, options=None, validate=None):
    studies.available()  # import the shipped studies first
    if validate is not None:
        fn.validate = validate
    opts = options if options is not None else {
        "n": Option(3, (int,), "a count", check=positive),
        "mode": Option("a", (str,), "a choice", choices=("a", "b")),
        "xs": Option([1.0], (list,), "a list"),
        "flag": Option(False, (bool,), "a flag"),
    }
    monkeypatch.setitem(studies._REGISTRY, kind, Study(kind, fn, opts, "test study"))


def _ok_study(params, run):
    run.save_series("s", {"t": torch.arange(3.0), "v": [1.0, 2.0, 3.0]})
    run.save_tensors("piece", {"x": torch.ones(2)})
    return {"nested": {"a": 1.5, "b": [1, None]}, "n": params["n"], "summary": ["line one", "line two"]}


# ---------------------------------------------------------------------------- overrides, configs
@pytest.mark.parametrize("text, expected", [
    ("n=100", ("n", 100)), ("dt=5e-3", ("dt", 0.005)), ("heads=[1, 10]", ("heads", [1, 10])),
    ("flag=true", ("flag", True)), ("mode='b'", ("mode", "b")), ("mode=b", ("mode", "b")),
    ("params.n=2", ("n", 2)), ("name=with=equals", ("name", "with=equals")),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_parse_override_needs_equals():
    with pytest.raises(ValueError, match="key=value"):
        parse_override("n100")


def test_load_config_fills_defaults_and_applies_overrides(monkeypatch, tmp_path):
    _register(monkeypatch, "_t_ok", _ok_study)
    toml = tmp_path / "c.toml"
    toml.write_text('kind = "_t_ok"\n[params]\nn = 5\n')
    cfg = load_config(toml, ["mode='b'", "xs=[1, 2]"])
    assert cfg == {"kind": "_t_ok", "name": "c", "description": "",
                   "params": {"n": 5, "mode": "b", "xs": [1, 2], "flag": False}}


@pytest.mark.parametrize("raw, needles", [
    ({"kind": "_t_ok", "params": {"m": 1}}, ["'m'", "allowed keys: flag, mode, n, xs"]),
    ({"kind": "_t_ok", "params": {"mode": "c"}}, ["'mode'", "'a', 'b'"]),
    ({"kind": "_t_ok", "params": {"n": "3"}}, ["'n'", "must be int"]),
    ({"kind": "_t_ok", "params": {"n": 0}}, ["'n'", "> 0"]),
    ({"kind": "_t_ok", "params": {"flag": 1}}, ["'flag'", "bool"]),
    ({"kind": "_t_ok", "extra": 1}, ["'extra'", "allowed keys"]),
    ({"params": {}}, ["'kind'"]),
    ({"kind": "_t_nope"}, ["'_t_nope'", "'ou_vs_oscillating'"]),
])
def test_invalid_configs_name_key_and_allowed(monkeypatch, raw, needles):
    _register(monkeypatch, "_t_ok", _ok_study)
    with pytest.raises(ValueError) as e:
        load_config(raw)
    for s in needles:
        assert s in str(e.value), (s, str(e.value))


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("kind = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_study_cross_checks_run_before_anything_is_written(monkeypatch, tmp_path):
    def validate(p):
        if p["mode"] == "b" and p["n"] > 3:
            raise ValueError("config keys 'mode' = 'b' and 'n' > 3 do not go together")

    _register(monkeypatch, "_t_ok", _ok_study, validate=validate)
    with pytest.raises(ValueError, match="'mode'"):
        execute({"kind": "_t_ok", "params": {"mode": "b", "n": 4}}, out_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- run directories
def test_execute_writes_the_run_directory(monkeypatch, tmp_path):
    _register(monkeypatch, "_t_ok", _ok_study)
    run = execute({"kind": "_t_ok", "name": "r"}, out_dir=tmp_path, progress=False)
    assert run == tmp_path / "r"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["params"] == {"n": 3, "mode": "a", "xs": [1.0], "flag": False}
    env = json.loads((run / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["resumed"] == [] and "cuda_available" in env
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "complete" and status["wall_time_s"] >= 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["nested"] == {"a": 1.5, "b": [1, None]} and m["wall_time_s"] >= 0
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[:5] == ["key,value", "nested.a,1.5", "nested.b.0,1", "nested.b.1,", "n,3"]
    assert (run / "series" / "s.csv").read_text().splitlines() == ["t,v", "0.0,1.0", "1.0,2.0", "2.0,3.0"]
    assert torch.equal(RunDir(run).load_tensors("piece")["x"], torch.ones(2))
    assert RunDir(run).load_tensors("absent") is None
    assert not [p for p in run.rglob("*") if ".tmp" in p.name], "temporary files left behind"


def test_flatten_metrics():
    assert flatten_metrics({"a": {"b": [1, {"c": None}]}, "d": "x"}) == {"a.b.0": 1, "a.b.1.c": None, "d": "x"}


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "sub" / "f.txt"
    atomic_write_text(p, "first version, long")
    atomic_write_text(p, "second")
    assert p.read_text() == "second" and [q.name for q in p.parent.iterdir()] == ["f.txt"]


def test_corrupt_tensor_file_is_refused(tmp_path):
    run = RunDir(tmp_path / "r")
    run.data_path("x").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="corrupted or unreadable.*delete it"):
        run.load_tensors("x")


def test_interrupted_run_status_and_resume(monkeypatch, tmp_path):
    calls = []

    def study(params, run):
        calls.append(run.resume)
        done = run.load_tensors("part1")
        if done is None:
            run.save_tensors("part1", {"v": torch.tensor([1.0])})
            if len(calls) == 1:
                raise Boom("killed after part 1")
        return {"parts": 1 if done is None else 2}

    _register(monkeypatch, "_t_resume", study)
    cfg = {"kind": "_t_resume", "name": "r"}
    with pytest.raises(Boom):
        execute(cfg, out_dir=tmp_path, progress=False)
    run = tmp_path / "r"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and "Boom: killed after part 1" in status["error"]
    assert "--resume" in status["resume_with"]
    assert not (run / "metrics.json").exists()
    with pytest.raises(ValueError, match="--resume"):
        execute(cfg, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="config differs"):
        execute(cfg, overrides=["n=4"], out_dir=tmp_path, progress=False, resume=True)
    execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    assert calls == [False, True]
    assert json.loads((run / "metrics.json").read_text())["parts"] == 2
    env = json.loads((run / "environment.json").read_text())
    assert len(env["resumed"]) == 1 and env["started"] <= env["resumed"][0]
    # --overwrite starts afresh (and refuses to delete a directory that is not a run)
    calls.clear()
    with pytest.raises(Boom):  # a fresh start: the first part runs (and fails) again
        execute(cfg, out_dir=tmp_path, progress=False, overwrite=True)
    assert calls == [False] and json.loads((run / "environment.json").read_text())["resumed"] == []
    with pytest.raises(ValueError, match="not both"):
        execute(cfg, out_dir=tmp_path, progress=False, overwrite=True, resume=True)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a transformer-pde run directory"):
        execute(cfg, out_dir=tmp_path, name="plain", progress=False, overwrite=True)
    # --resume on a directory that does not exist yet just starts the run
    execute(cfg, out_dir=tmp_path, name="fresh", progress=False, resume=True)
    assert json.loads((tmp_path / "fresh" / "status.json").read_text())["state"] == "complete"


# ---------------------------------------------------------------------------- the CLI
def test_cli_prints_summary_and_scalars(monkeypatch, tmp_path, capsys):
    _register(monkeypatch, "_t_ok", _ok_study)
    toml = tmp_path / "c.toml"
    toml.write_text('kind = "_t_ok"\nname = "cli"\n')
    assert cli_main(["run", str(toml), "--out", str(tmp_path), "-o", "n=7", "--no-progress"]) == 0
    out = capsys.readouterr().out
    # the study's summary, the wall time and where every number is; the numbers are not repeated after the summary
    assert "line one" in out and "line two" in out and "wall time" in out and "metrics.json" in out
    assert "n = 7" not in out
    assert cli_main(["run", str(toml), "--out", str(tmp_path), "-o", "mode=z"]) == 2
    err = capsys.readouterr().err
    assert "'mode'" in err and "'a', 'b'" in err
    assert cli_main(["run", str(toml), "--out", str(tmp_path), "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "integer >= 1" in err


def test_cli_interrupt_prints_resume_command(monkeypatch, tmp_path, capsys):
    def study(params, run):
        raise KeyboardInterrupt

    _register(monkeypatch, "_t_ctrl_c", study)
    toml = tmp_path / "c.toml"
    toml.write_text('kind = "_t_ctrl_c"\n')
    threads = torch.get_num_threads()
    try:
        assert cli_main(["run", str(toml), "--out", str(tmp_path), "-o", "n=2", "--no-progress", "--threads", "1"]) == 130
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "--resume" in err and "-o n=2" in err and str(toml) in err and "--threads 1" in err
    assert json.loads((tmp_path / "c" / "status.json").read_text())["state"] == "interrupted"


def test_cli_reports_nonfinite_runs(monkeypatch, tmp_path, capsys):
    import transformer_pde as tp

    def study(params, run):
        raise tp.NonFiniteError("the energy became NaN/inf at t = 1 (step 3)")

    _register(monkeypatch, "_t_nan", study)
    toml = tmp_path / "c.toml"
    toml.write_text('kind = "_t_nan"\n')
    assert cli_main(["run", str(toml), "--out", str(tmp_path), "--no-progress"]) == 3
    assert "step 3" in capsys.readouterr().err


def test_cli_list_shows_the_paper_study(capsys):
    assert cli_main(["list", "ou_vs_oscillating"]) == 0
    out = capsys.readouterr().out
    from transformer_pde.utils.resources import config_dir

    assert "ou_vs_oscillating" in out and "  ou_vs_oscillating_quick " in out and str(config_dir()) in out
    for key in ("regimes", "heads", "phase", "direction", "scheme", "paths", "t_avg"):
        assert key in out, key


def test_reproduce_script_maps_names_to_configs(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "reproduce_paper.py"
    spec = importlib.util.spec_from_file_location("reproduce_paper", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for cfg in mod.EXPERIMENTS.values():
        assert (path.parent.parent / "experiments" / cfg).is_file(), cfg
    assert mod.main(["unknown"]) == 2
    assert "experiments: quick, full" in capsys.readouterr().out
    # arguments pass through to `transformer-pde run`: an invalid override is refused by the CLI
    assert mod.main(["quick", "--out", str(tmp_path), "-o", "direction=sideways"]) == 2
    assert "'direction'" in capsys.readouterr().err
