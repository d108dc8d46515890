"""Intra-op thread policy: how many threads torch uses for a solver's step loop.

PyTorch's CPU kernels run on an OpenMP pool with one thread per core by default.  That is
fast on an idle machine but collapses on a shared one: when another job holds a core, every
parallel region waits at its barrier for the descheduled thread, and a run with 2 threads on 2
busy cores can be several times slower than the same run with 1 thread.  Small problems do
not gain from threads at all (the fork/join cost is larger than the work).  This module picks
the thread count from the size of the problem and the load of the machine, so that a user
does not need to know about OpenMP.

Usage::

    from transformer_pde.utils import threads

    threads.policy("auto")               # the CLI does this (``--threads auto``, its default)
    with threads.scope(paths * H * n * n) as pool:   # what simulate / jko do around their loops
        for step in range(steps):
            ...
            pool.refresh()               # optional: re-read the load every few seconds

Library users get the same policy with ``tp.thread_policy("auto")`` (:class:`thread_policy`: a
call sets it, a ``with`` block restores the previous one).  :func:`usage` lists the thread counts
the solver loops really ran with; run directories record them in ``environment.json``.

Policies (process-wide, set with :func:`policy`):

``None`` (the library default)
    leave torch alone: :func:`scope` changes nothing, so a library user keeps full control
    through ``torch.set_num_threads`` and ``OMP_NUM_THREADS``.
``"auto"``
    :func:`choose` the count for each block from its ``work`` (elementary kernel terms per
    step, e.g. paths·H·n²): 1 thread below :data:`WORK_THRESHOLD`; above it, the number of
    cores that are free (:func:`free_cores`: the cores this process may use, at most
    ``os.cpu_count()``, minus the load of other processes), at least 1.
    ``OMP_NUM_THREADS``, when set to a positive integer, caps the choice.  Outside the solver
    loops' scopes too: setting "auto" sets torch's count for the process to the free cores
    (:func:`baseline`), and :func:`refresh` (called when a scope ends) re-reads the load, so that
    every CPU phase of the library under "auto" (the command line's studies: hidden states,
    power iterations, distances) runs with one thread while other processes keep the cores busy.
    With a second thread on a busy core, PyTorch's OpenMP workers spin while they wait (libgomp's
    default wait policy, read once when torch loads: nothing can change it later), and every
    parallel operation waits for a scheduler slice: the pretrained probe took 5–7× as long as with
    ``OMP_WAIT_POLICY=PASSIVE`` (docs/performance.md, "Threads under load").  One thread has no
    workers to spin.  The policy the previous mode left is restored when "auto" is left.
a positive int ``k``
    exactly ``k`` threads in every scope (an explicit choice; ``OMP_NUM_THREADS`` does not cap
    it).

The load of other processes is :func:`other_load`, which errs towards fewer threads on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple, Union

import torch

__all__ = ["policy", "current", "choose", "scope", "Scope", "free_cores", "other_load", "cpu_budget", "omp_cap",
           "runnable_now", "thread_policy", "usage", "note", "baseline", "refresh", "WORK_THRESHOLD",
           "REFRESH_SECONDS"]

logger = logging.getLogger(__name__)

#: Below this many elementary kernel terms per step (paths·H·n²), "auto" uses one thread.
#: Provisional: a second thread was measured to help on 2 quiet cores for the paper's
#: reference step (H = 100, 10 paths, n = 200: 4·10⁷ terms, 0.25 s against 0.40 s per step)
#: and a little for the quick config as a whole (24 s against 29 s; its largest segment has
#: 2.6·10⁵ terms), not for steps whose kernels are too short to share;
#: ``python scripts/benchmark_threads.py --sweep`` on a quiet machine places it more exactly
#: (on a loaded machine 2 threads lose at every size).
WORK_THRESHOLD: float = 1.0e5

# a core counts as free when at least this fraction of it is (floor(free + _ROUND))
_ROUND = 0.25

#: :meth:`Scope.refresh` re-reads the load at most this often (seconds).
REFRESH_SECONDS: float = 5.0

_lock = threading.Lock()
_mode: Union[None, str, int] = None

# This process's share of the load average: an exponential moving average of its CPU use
# (cores) with the one-minute load average's time constant, updated whenever the load is read.
_LOAD_TAU = 60.0


def _validate(mode) -> Union[None, str, int]:
    if mode is None:
        return None
    if isinstance(mode, bool):
        raise TypeError(f"threads.policy: mode must be 'auto', a positive int or None, got the bool {mode!r}")
    if isinstance(mode, str):
        text = mode.strip().lower()
        if text == "auto":
            return "auto"
        if not text.isdigit():
            raise ValueError(f"threads.policy: mode must be 'auto', a positive int or None, got {mode!r}; "
                             "use e.g. policy('auto') or policy(2)")
        mode = int(text)
    if not isinstance(mode, int):
        if isinstance(mode, float) or not hasattr(mode, "__index__"):
            raise TypeError(f"threads.policy: mode must be 'auto', a positive int or None, got "
                            f"{type(mode).__name__} {mode!r}")
        mode = int(mode.__index__())
    if mode < 1:
        raise ValueError(f"threads.policy: a thread count must be >= 1, got {mode}; use 'auto' to let "
                         "the library choose or None to leave torch alone")
    return mode


def policy(mode: Union[None, str, int]) -> Union[None, str, int]:
    """Set the process-wide thread policy and return the previous one.

    Parameters
    ----------
    mode : Union[None, str, int]
        ``"auto"`` (choose from the work and the machine's load), a positive int
        (exactly that many intra-op threads; a string of digits is accepted too, as the
        CLI passes it) or ``None`` (leave torch alone: the library default).

    Returns
    -------
    Union[None, str, int]
        The previous policy, so that ``threads.policy(old)`` restores it.

    Raises
    ------
    TypeError
        ``mode`` is not a string, an int or None (a bool or a float is refused).
    ValueError
        a string other than ``"auto"`` or digits, or a count below 1.
    """
    global _mode
    new = _validate(mode)
    with _lock:
        old, _mode = _mode, new
    if new == "auto":
        refresh(force=True)  # the library decides the process's count from now on
    elif old == "auto":
        _leave_auto()
    return old


def current() -> Union[None, str, int]:
    """The process-wide policy: ``None``, ``"auto"`` or a positive int."""
    return _mode


# what "auto" did to torch's count outside the scopes: the count before it (restored when "auto" is left),
# the count it set (a count changed by someone else since is left alone), when it last read the load
_auto = {"before": None, "set": None, "read": -math.inf}


def baseline() -> int:
    """The process's intra-op thread count under ``"auto"`` outside the solver loops' scopes: the free cores
    (:func:`free_cores`, rounded as :func:`choose` rounds them) clamped to ``[1, cpu_budget()]`` and capped by
    ``OMP_NUM_THREADS``: one thread while other processes keep the cores busy (module docstring)."""
    k = int(math.floor(free_cores() + _ROUND))
    k = min(max(k, 1), cpu_budget())
    cap = omp_cap()
    return k if cap is None else min(k, cap)


def refresh(force: bool = False) -> int:
    """Under ``"auto"``: set torch's count to :func:`baseline` (the load is re-read at most every
    :data:`REFRESH_SECONDS`, unless ``force``); the library calls it when "auto" is set and when a scope ends.
    Other policies: nothing changes.

    Returns
    -------
    int
        torch's intra-op thread count now.
    """
    if _mode != "auto":
        return torch.get_num_threads()
    now = time.monotonic()
    with _lock:
        if not force and now - _auto["read"] < REFRESH_SECONDS:
            return torch.get_num_threads()
        _auto["read"] = now
    k = baseline()
    have = torch.get_num_threads()
    if _auto["before"] is None:
        _auto["before"] = have
    if k != have:
        torch.set_num_threads(k)
        logger.debug("intra-op threads set to %d outside the solver loops (policy 'auto')", k)
    _auto["set"] = k
    return k


def _leave_auto() -> None:
    """Back to the count "auto" found, unless someone changed torch's count since "auto" set it."""
    before, done = _auto["before"], _auto["set"]
    _auto.update(before=None, set=None, read=-math.inf)
    if before is not None and torch.get_num_threads() == done and before != done:
        torch.set_num_threads(before)


class thread_policy:
    """Set the thread policy for library code: as a call it sets it for the process (like
    :func:`policy`), as a context manager it restores the previous policy (and torch's thread count)
    on exit — the pattern of ``torch.set_grad_enabled``.  Exposed as ``tp.thread_policy``.

        >>> import transformer_pde as tp
        >>> with tp.thread_policy("auto"):   # simulate / jko choose their thread count, as the CLI does
        ...     pass
        >>> _ = tp.thread_policy(1)          # every solver loop from now on with exactly one thread
        >>> _ = tp.thread_policy(None)       # back to the library default: torch left alone

    Parameters
    ----------
    mode
        ``"auto"``, a positive int or ``None`` (see :func:`policy`).

    Raises
    ------
    TypeError, ValueError
        as :func:`policy`, before anything changes.
    """

    def __init__(self, mode: Union[None, str, int]):
        self._threads = torch.get_num_threads()
        self.previous = policy(mode)
        self.mode = _mode

    def __enter__(self) -> "thread_policy":
        return self

    def __exit__(self, *exc) -> bool:
        policy(self.previous)
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        return False

    def __repr__(self) -> str:
        return f"thread_policy({self.mode!r})"


# the thread counts the solver loops of this process ran with (and those workers reported): see usage()
_usage: list = []
_USAGE_MAX = 10000


def note(work, threads_used: int, *, label: Optional[str] = None, policy: Union[None, str, int] = "current") -> None:
    """Book that a block of ``work`` ran with ``threads_used`` intra-op threads (what :func:`scope`
    does on entry and whenever :meth:`Scope.refresh` changes the count; a study that runs pieces in
    worker processes books theirs here).  ``work`` is any JSON-able description (a number of terms,
    a path range); ``policy`` the policy it ran under (default: this process's)."""
    entry = {"work": work, "threads": int(threads_used), "policy": _mode if policy == "current" else policy}
    if label is not None:
        entry["label"] = label
    with _lock:
        last = _usage[-1] if _usage else None
        if last is not None and {k: v for k, v in last.items() if k != "count"} == entry:
            last["count"] += 1  # the same block again (a study's repeated solves): one line with a count
        elif len(_usage) < _USAGE_MAX:
            _usage.append({**entry, "count": 1})


def usage(since: int = 0) -> list:
    """The bookings of :func:`note` from index ``since`` on (``len(usage())`` marks a point): a list
    of ``{"work", "threads", "policy"[, "label"], "count"}`` (``count``: consecutive identical
    bookings).  Run directories record them in
    ``environment.json`` (``threads_used``)."""
    with _lock:
        return [dict(e) for e in _usage[since:]]


def _process_age() -> Optional[float]:
    """Seconds since this process started (Linux /proc), or None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = float(fields[19])  # field 22 of stat(5); fields[0] is field 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError, AttributeError):
        return None


def _initial_own() -> Tuple[float, float, float]:
    now, cpu = time.monotonic(), time.process_time()
    age = _process_age()
    if not age or age < 1.0:
        return now, cpu, 0.0
    # as if the CPU time so far had been spent evenly since the process started
    return now, cpu, (cpu / age) * (1.0 - math.exp(-age / _LOAD_TAU))


_own_state = list(_initial_own())  # [wall, cpu, ema in cores]


def _own_load() -> float:
    """This process's contribution to the one-minute load average, estimated in cores."""
    now, cpu = time.monotonic(), time.process_time()
    with _lock:
        t0, c0, ema = _own_state
        dt = now - t0
        if dt > 0.05:
            a = math.exp(-dt / _LOAD_TAU)
            ema = a * ema + (1.0 - a) * max(0.0, (cpu - c0) / dt)
            _own_state[:] = [now, cpu, ema]
    return ema


def _own_running() -> int:
    """Threads of this process that are runnable now (Linux /proc; 1 elsewhere)."""
    try:
        n = 0
        for task in os.scandir("/proc/self/task"):
            try:
                stat = Path(task.path, "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] == "R":
                n += 1
        return max(n, 1)
    except OSError:
        return 1


def runnable_now() -> Optional[int]:
    """Runnable tasks on the machine now (the 4th field of /proc/loadavg), or None."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def cpu_budget() -> int:
    """Cores this process may use: the CPU affinity set, capped by a cgroup CPU quota
    (containers), else ``os.cpu_count()``."""
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        n = count() or 1
    else:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
    for files in (("cpu.max",), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):  # cgroup v2, v1
        try:
            quota, period = " ".join(Path("/sys/fs/cgroup", f).read_text() for f in files).split()
            if quota not in ("max", "-1") and float(period) > 0:
                n = min(n, max(1, math.ceil(float(quota) / float(period))))
            break
        except (OSError, ValueError):
            continue
    return max(1, n)


def omp_cap() -> Optional[int]:
    """``OMP_NUM_THREADS`` as a positive int, or None when it is unset or not a positive int.

    OpenMP allows a list ("4,2" for nested levels); its first entry is the outer level.
    """
    raw = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def other_load() -> float:
    """Cores kept busy by other processes: the larger of the one-minute load average (``os.getloadavg``)
    minus this process's own share (:func:`_own_load`, from its CPU time with the same one-minute
    averaging, so that a run does not throttle itself) and the tasks runnable right now
    (``/proc/loadavg``, which sees a job that started seconds ago) minus this process's runnable
    threads.  0 where neither is available (Windows).

    Taking the larger errs towards fewer threads: a thread too few costs at most the parallel
    speed-up, a thread too many on a busy core stalls every OpenMP barrier (measured: 5–15×
    slower with 2 threads on 2 busy cores, scripts/benchmark_threads.py).
    """
    try:
        avg = max(0.0, os.getloadavg()[0] - _own_load())
    except (OSError, AttributeError):
        avg = 0.0
    now = runnable_now()
    inst = 0.0 if now is None else float(max(0, now - _own_running()))
    return max(avg, inst)


def free_cores() -> float:
    """Cores not used by other processes: :func:`cpu_budget` − :func:`other_load`, >= 0."""
    return max(0.0, cpu_budget() - other_load())


def _check_work(work) -> float:
    if isinstance(work, bool) or not isinstance(work, (int, float)) and not hasattr(work, "__float__"):
        raise TypeError(f"threads: work must be a number (elementary terms per step, e.g. paths*H*n*n), "
                        f"got {type(work).__name__}")
    w = float(work)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"threads: work must be a finite number >= 0 (e.g. paths*H*n*n), got {work!r}")
    return w


def choose(work: float) -> int:
    """The intra-op thread count for a step of ``work`` elementary kernel terms.

    With policy ``"auto"``: 1 when ``work < WORK_THRESHOLD``; otherwise
    ``floor(free_cores() + 0.25)`` clamped to ``[1, cpu_budget()]`` and capped by
    ``OMP_NUM_THREADS`` when that is set.  With an int policy: that int.  With policy ``None``:
    ``torch.get_num_threads()`` (what torch will use anyway).

    Parameters
    ----------
    work : float
        elementary kernel terms per step, e.g. ``paths * H * n**2`` (a float >= 0).

    Returns
    -------
    int
        A thread count >= 1.

    Raises
    ------
    TypeError
        ``work`` is not a number.
    ValueError
        ``work`` is negative, NaN or infinite.
    """
    w = _check_work(work)
    mode = _mode
    if mode is None:
        return torch.get_num_threads()
    if isinstance(mode, int):
        return mode
    if w < WORK_THRESHOLD:
        return 1
    k = int(math.floor(free_cores() + _ROUND))
    k = min(max(k, 1), cpu_budget())
    cap = omp_cap()
    return k if cap is None else min(k, cap)


class Scope:
    """The handle :func:`scope` yields: the thread count in force and a :meth:`refresh`."""

    def __init__(self, work: float, active: bool):
        self.work = work
        self.active = active
        self.threads: Optional[int] = None
        self._last = time.monotonic()

    def _apply(self) -> None:
        k = choose(self.work)
        if k != torch.get_num_threads():
            torch.set_num_threads(k)
            logger.debug("intra-op threads set to %d (work %.3g, policy %r)", k, self.work, _mode)
        if k != self.threads:
            note(self.work, k)
        self.threads = k

    def refresh(self, force: bool = False) -> int:
        """Re-choose the thread count from the current load (at most every
        :data:`REFRESH_SECONDS`, unless ``force``); cheap enough to call every step.

        Returns
        -------
        int
            The thread count in force (``torch.get_num_threads()`` when the policy is None).
        """
        if self.active:
            now = time.monotonic()
            if force or now - self._last >= REFRESH_SECONDS:
                self._last = now
                self._apply()
            return self.threads  # type: ignore[return-value]
        return torch.get_num_threads()


@contextlib.contextmanager
def scope(work: float) -> Iterator[Scope]:
    """Apply the thread policy for a block: ``torch.set_num_threads(choose(work))`` on entry,
    the previous count restored on exit (also on an exception).  A no-op when the policy is
    ``None``.

    Parameters
    ----------
    work : float
        elementary kernel terms per step of the block, e.g. ``paths * H * n**2``.

    Yields
    ------
    Iterator[Scope]
        A :class:`Scope`; call ``.refresh()`` inside long loops to follow load changes.

    Raises
    ------
    TypeError, ValueError
        as :func:`choose`, before anything is changed.
    """
    w = _check_work(work)
    active = _mode is not None
    handle = Scope(w, active)
    if not active:
        note(w, torch.get_num_threads())
        yield handle
        return
    previous = torch.get_num_threads()
    try:
        handle._apply()
        yield handle
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
        if _mode == "auto" and previous == _auto["set"]:
            refresh()  # outside the scope: the process's count from the load now (rate-limited)
