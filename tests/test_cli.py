"""The `transformer-pde` command's interface: help, version, output streams, logging, threads,
several configs in one call, configs by name, `list` errors before output."""

from __future__ import annotations

import argparse
import json
import logging
import re

import torch

import transformer_pde
from transformer_pde.application import studies
from transformer_pde.utils import threads
from transformer_pde.application.cli import build_parser, main as cli_main
from transformer_pde.application.studies import Option, Study, positive


def _register(monkeypatch, kind, fn):
    studies.available()
    monkeypatch.setitem(studies._REGISTRY, kind, Study(kind, fn, {"n": Option(3, (int,), "a count", check=positive)},
                                                       "test study"))


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise AssertionError("no subcommands")


def test_version(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"transformer-pde {transformer_pde.__version__}"


def test_help_is_plain_text_and_every_option_is_explained(capsys):
    assert cli_main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "``" not in top and ":func:" not in top
    subs = _subparsers(build_parser())
    assert {"run", "list", "demo"} <= set(subs)
    for name, sp in subs.items():
        assert name in top
        for action in sp._actions:
            assert action.help and action.help.strip(), f"`{name} {action.option_strings or action.dest}` has no help"
        for opt in ("--threads", "--verbose", "--quiet"):
            assert opt in sp.format_help(), (name, opt)
        assert cli_main([name, "--help"]) == 0
        assert "``" not in capsys.readouterr().out


def test_list_refuses_an_unknown_kind_before_printing(capsys):
    assert cli_main(["list", "foo"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "'foo'" in cap.err and "'demo'" in cap.err


def test_list_shows_shipped_config_names(capsys):
    from transformer_pde.utils.resources import config_names

    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    names = config_names()
    assert "ou_vs_oscillating_quick" in names
    for n in names:
        assert f"  {n} " in out, n


def test_a_shipped_config_is_found_by_name(tmp_path, capsys, monkeypatch):
    # the name resolves to the ou_vs_oscillating config: its keys are known, a wrong one is refused by name,
    # also from another working directory that holds a folder of that name (a run made with --out .)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ou_vs_oscillating_quick").mkdir()
    for name in ("ou_vs_oscillating_quick", "ou_vs_oscillating_quick.toml"):
        assert cli_main(["run", name, "--out", str(tmp_path / "o"), "-o", "bogus=1"]) == 2
        err = capsys.readouterr().err
        assert "'bogus'" in err and "'ou_vs_oscillating'" in err
    assert [p.name for p in tmp_path.iterdir()] == ["ou_vs_oscillating_quick"]


def test_results_on_stdout_messages_on_stderr_and_verbosity(monkeypatch, tmp_path, capsys):
    def study(params, run):
        logging.getLogger("transformer_pde.application.studies.fake").info("segment done: one")
        logging.getLogger("transformer_pde.application.studies.fake").debug("a debug detail")
        return {"n": params["n"]}

    _register(monkeypatch, "_t_cli", study)
    (tmp_path / "c.toml").write_text('kind = "_t_cli"\n')
    handlers = list(logging.getLogger("transformer_pde").handlers)
    cfg = str(tmp_path / "c.toml")
    for i, (flags, info, debug) in enumerate([([], True, False), (["-v"], True, True), (["-q"], False, False)]):
        assert cli_main(["run", cfg, "--out", str(tmp_path), "--name", f"r{i}", "--no-progress", *flags]) == 0
        cap = capsys.readouterr()
        assert f"run directory: {tmp_path / f'r{i}'}" in cap.out and "n = 3" in cap.out
        assert "segment done" not in cap.out and "running" not in cap.out  # diagnostics never on stdout
        assert ("segment done: one" in cap.err) == info and ("a debug detail" in cap.err) == debug, (flags, cap.err)
    assert logging.getLogger("transformer_pde").handlers == handlers  # the CLI removes its handler again


def test_threads_option_sets_the_policy_for_the_command_only(monkeypatch, tmp_path, capsys):
    seen = []

    def study(params, run):
        seen.append((threads.current(), torch.get_num_threads()))
        return {}

    _register(monkeypatch, "_t_threads", study)
    monkeypatch.setattr(threads, "other_load", lambda: 0.0)  # "auto" reads the load: an idle machine, not today's
    (tmp_path / "c.toml").write_text('kind = "_t_threads"\n')
    before = (threads.current(), torch.get_num_threads())
    expected_auto = threads.baseline()  # the count "auto" gives on the idle machine, capped by OMP_NUM_THREADS
    assert cli_main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path), "--name", "a", "--no-progress"]) == 0
    assert cli_main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path), "--name", "b", "--no-progress",
                     "--threads", "1"]) == 0
    assert seen == [("auto", expected_auto), (1, 1)]
    assert (threads.current(), torch.get_num_threads()) == before
    for cmd in (["list", "--threads", "2"], ["list", "demo", "--threads", "auto"]):
        assert cli_main(cmd) == 0
    for bad in ("0", "-1", "two", "1.5"):
        assert cli_main(["list", "--threads", bad]) == 2
        assert "--threads" in capsys.readouterr().err


def test_several_configs_in_one_call(monkeypatch, tmp_path, capsys):
    def study(params, run):
        if params["n"] == 13:
            raise ValueError("config key 'n' = 13 is unlucky")
        return {"n": params["n"]}

    _register(monkeypatch, "_t_multi", study)
    a, b, c = (tmp_path / f"{x}.toml" for x in "abc")
    a.write_text('kind = "_t_multi"\n[params]\nn = 1\n')
    b.write_text('kind = "_t_multi"\n[params]\nn = 2\n')
    c.write_text('kind = "_t_multi"\n[params]\nn = 13\n')
    out = tmp_path / "out"
    assert cli_main(["run", str(a), str(b), "--out", str(out), "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert f"run directory: {out / 'a'}" in cap.out and f"run directory: {out / 'b'}" in cap.out
    assert [json.loads((out / x / "metrics.json").read_text())["n"] for x in "ab"] == [1, 2]
    # one refused config: nothing runs at all
    assert cli_main(["run", str(a), str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()
    # one failing run does not stop the others; the exit code says something failed
    assert cli_main(["run", str(c), str(a), "--out", str(tmp_path / "o3"), "--no-progress"]) == 1
    cap = capsys.readouterr()
    assert "unlucky" in cap.err and "1 of 2 runs failed" in cap.err
    assert json.loads((tmp_path / "o3" / "a" / "status.json").read_text())["state"] == "complete"
    assert json.loads((tmp_path / "o3" / "c" / "status.json").read_text())["state"] == "interrupted"


def test_interrupt_in_a_series_names_the_resume_command_and_what_did_not_start(monkeypatch, tmp_path, capsys):
    def study(params, run):
        if params["n"] == 2:
            raise KeyboardInterrupt
        return {}

    _register(monkeypatch, "_t_int", study)
    files = []
    for n in (1, 2, 3):
        f = tmp_path / f"c{n}.toml"
        f.write_text(f'kind = "_t_int"\n[params]\nn = {n}\n')
        files.append(str(f))
    assert cli_main(["run", *files, "--out", str(tmp_path / "o"), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert f"transformer-pde run {files[1]} --out {tmp_path / 'o'} --resume" in err
    assert f"not started: {files[2]}" in err


def test_exit_codes_are_in_the_help_epilog(capsys):
    from transformer_pde.application.cli import EXIT_CODES

    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "docs/reliability.md" in out
    for code in (0, 1, 2, 130):
        assert f"  {code} " in out, code
    assert {0, 1, 2, 130} <= set(EXIT_CODES)


def test_an_error_during_a_run_is_exit_1_and_a_refusal_before_it_is_exit_2(monkeypatch, tmp_path, capsys):
    """Exit 2 promises that nothing ran; a ValueError raised by the study once its run directory is written is a
    failure during the run (1), and the message names the run directory."""
    def study(params, run):
        raise ValueError("config key 'n' broke the study midway")

    _register(monkeypatch, "_t_mid", study)
    (tmp_path / "c.toml").write_text('kind = "_t_mid"\n')
    assert cli_main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "midway" in err and str(tmp_path / "c") in err and "--resume" in err
    assert json.loads((tmp_path / "c" / "status.json").read_text())["state"] == "interrupted"
    assert cli_main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "-o", "n=0"]) == 2
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------- what a newcomer reads
def test_a_misspelt_key_kind_or_config_name_gets_a_suggestion(tmp_path, capsys):
    for argv, hint in ((["run", "ou_vs_oscillating_quick", "-o", "head=[1]"], "did you mean 'heads'?"),
                       (["run", "ou_vs_oscilating_quick"], "did you mean 'ou_vs_oscillating_quick'?"),
                       (["list", "dem"], "did you mean 'demo'?")):
        assert cli_main([*argv, *(["--out", str(tmp_path)] if argv[0] == "run" else [])]) == 2
        assert hint in capsys.readouterr().err, argv
    assert not any(tmp_path.iterdir())


def test_run_and_demo_print_results_alike_and_rounded(monkeypatch, tmp_path, capsys):
    def study(params, run):
        return {"x": 0.7676645583315466, "n": params["n"]}

    _register(monkeypatch, "_t_print", study)
    (tmp_path / "c.toml").write_text('kind = "_t_print"\n')
    assert cli_main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "x = 0.7677" in out and "0.76766455" not in out and "n = 3" in out and "{" not in out
    assert cli_main(["demo", "-o", "t1=0.1", "-o", "dt=0.05", "-o", "n=8", "--out", str(tmp_path),
                     "--no-progress", "-q"]) == 0
    out = capsys.readouterr().out
    assert "demo written to" in out and "{" not in out and "energy_final_mean = " in out
    value = out.split("energy_final_mean = ")[1].split()[0]
    assert len(value.replace("-", "").replace(".", "").lstrip("0")) <= 4  # 4 significant digits


def test_list_aligns_every_name_and_shows_the_last_run_time(tmp_path, capsys):
    from transformer_pde.utils.resources import config_names

    done = tmp_path / "ou_vs_oscillating_quick"
    done.mkdir()
    (done / "status.json").write_text('{"state": "complete", "wall_time_s": 26.4}')
    assert cli_main(["list", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(r for r in out if r.startswith("shipped configs")))
    rows = [r for r in out[head + 1:] if r.strip().split(" ")[0] in config_names()]
    assert len(rows) == len(config_names())
    starts = {r.rindex(re.split(r"\s{2,}", r.strip())[-1]) for r in rows}  # where the descriptions start
    assert len(starts) == 1, rows
    assert any(r.strip().startswith("ou_vs_oscillating_quick") and "last run 26 s" in r for r in rows)
    kinds = out[1:head]
    assert len({len(r) - len(r[2:].split(" ", 1)[1].lstrip()) for r in kinds}) == 1, kinds


def test_a_complete_run_is_not_run_again_on_resume_and_a_rerun_says_it_is_complete(monkeypatch, tmp_path, capsys):
    calls = []

    def study(params, run):
        calls.append(1)
        return {"n": params["n"]}

    _register(monkeypatch, "_t_done", study)
    (tmp_path / "c.toml").write_text('kind = "_t_done"\n')
    argv = ["run", str(tmp_path / "c.toml"), "--out", str(tmp_path), "--no-progress"]
    assert cli_main(argv) == 0 and calls == [1]
    assert cli_main(argv) == 2
    assert "is complete" in capsys.readouterr().err
    assert cli_main([*argv, "--resume"]) == 0 and calls == [1]
    assert "already complete" in capsys.readouterr().err
