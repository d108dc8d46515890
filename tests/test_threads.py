"""The thread policy (transformer_pde.threads): modes, the OMP_NUM_THREADS cap, the load rule,
scope's restore, bad input.  No timing: speed lives in scripts/benchmark_threads.py."""

import math
import os

import pytest
import torch

from transformer_pde import threads

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
    torch.set_num_threads(1)
    threads.policy("auto")
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
