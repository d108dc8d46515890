"""Parameter sweeps: the cartesian grid of a config's parameters as independent runs.

    transformer-pde sweep CONFIG -s 'beta=[0.5,1,2]' -s 'heads=[1,4]' [-o KEY=VALUE ...]
                          [--workers N | --scheduler ADDRESS] [--resume] [--out runs] [--name NAME]

Syntax.  ``-s/--sweep KEY=[v1, v2, ...]`` declares a sweep axis: KEY takes each listed value
(a TOML list).  ``-o/--override KEY=VALUE`` fixes a parameter for every point, exactly as in
``transformer-pde run`` — so ``-o 'heads=[1,10]'`` keeps its meaning for list-valued options
(one run with both head counts), and sweeping a list-valued option lists lists:
``-s 'heads=[[1],[1,10]]'`` makes two points.  A key may not be both an axis and an override.

Layout of ``<out>/<name>/`` (name defaults to ``<config name>_sweep``)::

    sweep.json            the resolved base config, the axes and the point names (resume checks it)
    points/<point>/       one ordinary run directory per grid point (transformer_pde.application.runs.execute)
    results.csv           one row per point: point, state, wall time, every parameter, scalar metrics
    figures/sweep.png|pdf the metrics against the first axis, one line per value of the other axes

Execution.  Every point is validated before anything runs.  ``workers=1`` runs the points one
after another in this process; ``workers=N > 1`` on a pool of N worker processes
(``concurrent.futures.ProcessPoolExecutor``, spawn context, so no forked torch state; each
worker gets ``threads`` torch threads, by default cpu_count // N; from a script, call
:func:`run_sweep` under ``if __name__ == "__main__":``, since spawned workers import the main
module); ``scheduler=ADDRESS`` on an existing Dask distributed cluster
(``dask.distributed.Client(ADDRESS)``; the workers need this package installed and the output
folder on a filesystem they share).  A point that raises is recorded as "failed" (with its
error) and the others continue; so is a point whose worker process dies (``kill -9``, out of
memory), and results.csv is still written.

Safety (docs/reliability.md).  Everything — axes, every point's config and resource estimate
(``max_memory``, ``max_steps``), the grid size (``max_points``, default 10⁴), ``out_dir``, the
scheduler connection — is checked before anything is written.  The sweep directory is locked
like a run directory (a second sweep of it is refused while one runs).  Workers end with the
sweep: SIGTERM (or Ctrl-C) stops them first, each point checkpointing; a worker whose sweep
process was killed notices (it polls its parent PID) and stops its point the same way.

Resume.  ``resume=True`` continues a sweep directory with the same sweep.json: points whose run
directory says ``status.json: complete`` are skipped, interrupted ones are resumed (their
studies continue from their own checkpoints), missing ones run.  Without ``resume`` an existing
sweep directory is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .rundir import loads_json
from .studies import interrupts_left_to_parent

__all__ = ["SweepResult", "parse_axis", "expand_grid", "point_name", "run_sweep", "gather", "plot_sweep",
           "add_parser"]

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """path: the sweep directory; table: results.csv; figure: the png (None without numeric metrics);
    rows: one dict per point (the table's rows); ran / skipped / failed: point names."""

    path: Path
    table: Path
    figure: Optional[Path]
    rows: List[Dict[str, Any]]
    ran: List[str]
    skipped: List[str]
    failed: List[str]


# ---------------------------------------------------------------------------- the grid
def parse_axis(text: str) -> Tuple[str, list]:
    """'key=[v1, v2, ...]' (TOML list) -> (key, [v1, v2, ...]).

    Raises ValueError when the text is not key=value or the value is not a non-empty list."""
    from .config import parse_override

    key, value = parse_override(text)
    if not isinstance(value, list) or not value:
        raise ValueError(f"sweep axis {text!r} needs a non-empty TOML list of values, e.g. -s 'beta=[0.5,1,2]' "
                         f"(to sweep a list-valued option, list lists: -s 'heads=[[1],[1,10]]')")
    return key, value


def expand_grid(axes: Dict[str, list]) -> List[Dict[str, Any]]:
    """The cartesian product of the axes, first axis slowest: [{key: value, ...}, ...].

    expand_grid({"a": [1, 2], "b": [3, 4, 5]}) has 6 points, (1,3), (1,4), (1,5), (2,3), ...
    No axes give one point (the base config)."""
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(_fmt(u) for u in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def point_name(index: int, point: Dict[str, Any]) -> str:
    """Directory name of a point: p<index>_<key>=<value>_..., with characters outside
    [A-Za-z0-9.,=+-] replaced by '_' (the index keeps names unique)."""
    body = "_".join(f"{k}={_fmt(v)}" for k, v in point.items())
    body = re.sub(r"[^A-Za-z0-9.,=+\-\[\]]", "_", body).replace("[", "(").replace("]", ")")
    return f"p{index:03d}" + (f"_{body}" if body else "")


# ---------------------------------------------------------------------------- one point (worker side)
def _run_point(cfg: dict, out_dir: str, name: str, threads: Optional[int]) -> Dict[str, Any]:
    """Run (or resume) one point; returns {"point", "state", "error"}.  Module level: picklable."""
    if threads is not None:
        import torch

        torch.set_num_threads(int(threads))
    from .runs import execute

    t0 = time.perf_counter()
    try:
        # resume=True: continues an interrupted point, starts a missing one (runs.execute)
        execute(cfg, out_dir=out_dir, name=name, resume=True, progress=False)
    except KeyboardInterrupt as e:
        if _IN_WORKER:  # a pool worker stopped by the sweep (or by its parent's death): the point is checkpointed
            os._exit(128 + getattr(e, "signum", 2))
        raise
    except Exception as e:  # recorded; the other points go on
        return {"point": name, "state": "failed", "error": f"{type(e).__name__}: {e}",
                "wall_time_s": time.perf_counter() - t0}
    return {"point": name, "state": "complete", "error": "", "wall_time_s": time.perf_counter() - t0}


def _is_complete(run_path: Path) -> bool:
    try:
        st = loads_json((run_path / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return st.get("state") == "complete" and (run_path / "metrics.json").exists()


# ---------------------------------------------------------------------------- the sweep
def _check_int(v, name, minimum=1):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


DEFAULT_MAX_POINTS = 10_000  # grid points of one sweep without max_points= / --max-points


_IN_WORKER = False  # True in a sweep's pool worker (set by _parent_watch)


def _parent_watch(parent_pid: int, interval: float = 0.5, grace: float = 20.0) -> None:
    """Worker initializer: a daemon thread that ends this worker when the sweep process that started it is gone
    (killed with SIGKILL: no chance to stop its workers).  The worker first gets SIGTERM (its point checkpoints
    and says "interrupted", its lock is released), and is ended outright ``grace`` seconds later."""
    import signal
    import threading

    global _IN_WORKER
    _IN_WORKER = True
    # tqdm's default lock is a multiprocessing semaphore, registered with the sweep's resource tracker; a worker
    # stopped by the sweep exits at once (os._exit), so that semaphore would be reported as leaked at the end
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="transformer-pde-parent-watch", daemon=True).start()


def _resolve_config(config):
    """A path, a shipped config name (as `transformer-pde run` accepts) or a dict."""
    if isinstance(config, (str, Path)) and not isinstance(config, dict):
        from ..utils.resources import find_config

        p = Path(config)
        try:
            if p.is_file():
                return p
        except OSError as e:
            raise ValueError(f"config {str(config)[:60]!r}... cannot be looked up ({e.strerror or e})") from None
        return find_config(config) if not p.exists() else p
    return config


def run_sweep(config, axes: Dict[str, list] | Sequence[str], *, overrides: Iterable[str] = (), out_dir="runs",
              name: Optional[str] = None, workers: int = 1, scheduler: Optional[str] = None,
              threads: Optional[int] = None, resume: bool = False, progress: bool = False,
              metrics: Sequence[str] = (), figure: bool = True, max_points: int = DEFAULT_MAX_POINTS,
              max_memory=None, max_steps: Optional[int] = None) -> SweepResult:
    """Run the cartesian grid of ``axes`` over ``config`` as independent runs (module docstring).

    Parameters
    ----------
    config
        TOML path, shipped config name or config dict {"kind", "name", "params"} (as for ``runs.execute``).
    axes : Dict[str, list] | Sequence[str]
        {key: [values]} or a sequence of "key=[v1,v2]" strings (the CLI's -s).
    overrides : Iterable[str]
        "key=value" strings fixed for every point (the CLI's -o).
    out_dir, name
        the sweep directory is out_dir/name (default name: <config name>_sweep).
    workers : int
        worker processes (1: in this process; at most 4 × the CPU cores).  scheduler: a Dask scheduler
        address ("tcp://host:8786"); when given, ``workers`` is ignored.
    threads : Optional[int]
        torch threads per point (default: cpu_count // workers, at least 1).
    resume : bool
        continue an existing sweep directory (finished points are skipped).
    progress : bool
        a bar over the points.  metrics: metric keys for the figure (default: up to 4).
    figure : bool
        write figures/sweep.png|pdf (False: the table only).
    max_points : int
        refuse a grid of more points (default :data:`DEFAULT_MAX_POINTS`).
    max_memory, max_steps
        the resource limits of every point (``config.check_resources``).

    Returns
    -------
    SweepResult
        :class:`SweepResult`.

    Raises
    ------
    ValueError
        for a bad axis, a key both swept and overridden, an invalid point, a grid above
        ``max_points``, a point above the resource limits, an ``out_dir`` that is a file or not writable, an
        existing sweep directory without resume or one holding another sweep, a sweep directory in use by
        another live sweep (:class:`~transformer_pde.application.locks.RunLockedError`), an unreachable scheduler — all
        before anything is written; ImportError (with the install command) for scheduler= without
        dask.distributed.  :class:`~transformer_pde.application.locks.Terminated` when SIGTERM stops the sweep (its
        workers are stopped first).
    """
    from .locks import DirLock
    from .rundir import atomic_write_text
    from .config import check_out_dir, check_resources, check_run_name, load_config, parse_override

    workers = _check_int(workers, "workers")
    threads = _check_int(threads, "threads")
    max_points = _check_int(max_points, "max_points")
    cap = 4 * (os.cpu_count() or 1)
    for value, what in ((workers, "workers"), (threads, "threads")):
        if value is not None and value > cap:
            raise ValueError(f"{what} = {value} is more than this machine can use: give at most {cap} "
                             f"(4 × its {os.cpu_count()} CPU cores)")
    if scheduler is not None and (not isinstance(scheduler, str) or not scheduler):
        raise ValueError(f"scheduler must be a Dask scheduler address such as 'tcp://127.0.0.1:8786', "
                         f"got {scheduler!r}")
    if not isinstance(axes, dict):
        parsed: Dict[str, list] = {}
        for text in axes:
            k, vals = parse_axis(text)
            if k in parsed:
                raise ValueError(f"sweep axis '{k}' is given twice; give all its values in one -s '{k}=[...]'")
            parsed[k] = vals
        axes = parsed
    else:
        axes = {(k[len("params."):] if k.startswith("params.") else k): list(v) for k, v in axes.items()}
        for k, v in axes.items():
            if not v:
                raise ValueError(f"sweep axis '{k}' has no values")
    size = math.prod(len(v) for v in axes.values())
    if size > max_points:
        raise ValueError(f"the sweep grid has {size} points ({' × '.join(str(len(v)) for v in axes.values())}), "
                         f"above the limit of {max_points}; pass --max-points {size} (max_points={size}) to run it")
    overrides = list(overrides)
    both = sorted({parse_override(o)[0] for o in overrides} & set(axes))
    if both:
        raise ValueError(f"'{both[0]}' is both a sweep axis (-s) and a fixed override (-o); keep one")
    base = load_config(_resolve_config(config), overrides)
    points = expand_grid(axes)
    names = [point_name(i, p) for i, p in enumerate(points)]
    cfgs = []
    for nm, p in zip(names, points):
        raw = {"kind": base["kind"], "name": nm, "description": base["description"],
               "params": {**base["params"], **p}}
        try:
            cfg = load_config(raw)
            check_resources(cfg, max_memory=max_memory, max_steps=max_steps)
        except ValueError as e:
            raise ValueError(f"sweep point {nm}: {e}") from None
        cfgs.append(cfg)

    out = check_out_dir(out_dir)
    sweep_dir = out / check_run_name(name if name is not None else f"{base['name']}_sweep")
    spec = json.loads(json.dumps({"config": base, "axes": axes, "points": names}, default=str))
    spec_file = sweep_dir / "sweep.json"
    _check_sweep_dir(sweep_dir, spec, resume=resume)
    client = _connect(scheduler) if scheduler is not None else None  # before anything is written
    try:
        made = not sweep_dir.exists()
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the sweep directory {sweep_dir} ({e.strerror or e}); choose a writable "
                             f"--out") from None
        try:
            lock = DirLock(sweep_dir).acquire()
        except BaseException:
            if made:
                with contextlib.suppress(OSError):
                    (sweep_dir / ".lock").unlink()
                    sweep_dir.rmdir()
            raise
        try:
            _check_sweep_dir(sweep_dir, spec, resume=resume, held=True)  # again, under the lock
            lock.claim()
            points_dir = sweep_dir / "points"
            points_dir.mkdir(exist_ok=True)
            atomic_write_text(spec_file, json.dumps(spec, indent=2, sort_keys=True) + "\n")

            todo = [(nm, cfg) for nm, cfg in zip(names, cfgs) if not _is_complete(points_dir / nm)]
            skipped = [nm for nm in names if not any(nm == t[0] for t in todo)]
            if skipped:
                log.info("sweep %s: %d of %d points already complete, skipped", sweep_dir, len(skipped), len(names))
            n_par = workers if scheduler is None else None
            if threads is None and scheduler is None:
                threads = max(1, (os.cpu_count() or 1) // max(1, workers))
            results = _dispatch(todo, str(points_dir), threads, n_par, client, progress)
            failed = [r["point"] for r in results if r["state"] != "complete"]
            for r in results:
                if r["state"] != "complete":
                    log.warning("sweep point %s failed: %s", r["point"], r["error"])
            table, rows, metric_keys = gather(sweep_dir, errors={r["point"]: r["error"] for r in results})
            metrics = metrics or [k for k in metric_keys if k != "wall_time_s"][:4]
            fig_path = plot_sweep(sweep_dir, rows, list(axes), metrics=metrics) if figure else None
        finally:
            lock.release()
    finally:
        if client is not None:
            client.close()
    return SweepResult(sweep_dir, table, fig_path, rows, [r["point"] for r in results], skipped, failed)


def _check_sweep_dir(sweep_dir: Path, spec, *, resume: bool, held: bool = False) -> None:
    from .locks import RunLockedError
    from .rundir import check_no_links

    spec_file = sweep_dir / "sweep.json"
    if sweep_dir.is_symlink() or (sweep_dir.exists() and not sweep_dir.is_dir()):
        raise ValueError(f"{sweep_dir} exists and is not a sweep directory; choose another --name")
    if not sweep_dir.exists():
        return
    holder = False if held else _lock_pid(sweep_dir)
    if holder is not False:
        raise RunLockedError(sweep_dir, holder)
    if spec_file.exists():
        if not resume:
            raise ValueError(f"sweep directory {sweep_dir} exists; pass --resume to continue it (finished points are "
                             f"skipped) or --name NEW for another sweep")
        try:
            old = loads_json(spec_file.read_text())
        except (OSError, ValueError):
            raise ValueError(f"cannot resume {sweep_dir}: its sweep.json is unreadable; use --name NEW") from None
        if old != spec:
            raise ValueError(f"cannot resume {sweep_dir}: it holds another sweep (config, axes or points differ); "
                             f"use --name NEW")
        check_no_links(sweep_dir)
    elif any(e.name != ".lock" for e in os.scandir(sweep_dir)):
        raise ValueError(f"{sweep_dir} exists and is not a sweep directory (no sweep.json); choose another --name")


def _lock_pid(path: Path):
    """False when ``path/.lock`` is free (or absent), else the holder's PID (None when unknown)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the lock itself refuses
        return False
    p = path / ".lock"
    if p.is_symlink() or not p.is_file():
        return False
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def _connect(scheduler: str, timeout: float = 10.0):
    try:
        from dask.distributed import Client
    except ImportError:
        raise ImportError("scheduler= needs Dask distributed: pip install \"dask[distributed]\" "
                          "(or the extra: pip install \"transformer_pde[sweep]\")") from None
    try:
        return Client(scheduler, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as e:
        raise ValueError(f"cannot reach the Dask scheduler {scheduler!r} ({type(e).__name__}: {e}); start it or "
                         f"check the address (nothing was written)") from None


def _stop_workers(pool, grace: float = 15.0) -> None:
    """SIGTERM to every worker of a ProcessPoolExecutor (each point checkpoints and says "interrupted"), then
    SIGKILL to those still alive after ``grace`` seconds."""
    procs = list(getattr(pool, "_processes", {}).values())
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
                p.join(5)


def _dispatch(todo, points_dir, threads, n_par, client, progress) -> List[Dict[str, Any]]:
    from tqdm.auto import tqdm

    from .locks import sigterm_as_interrupt

    bar = tqdm(total=len(todo), desc="sweep", unit="point", disable=None if progress else True)
    out: List[Dict[str, Any]] = []
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        if not todo:
            return out
        if client is not None:
            from dask.distributed import as_completed

            futs = [client.submit(_run_point, cfg, points_dir, nm, threads, pure=False, key=f"tp-sweep-{nm}-"
                                  f"{time.time_ns()}") for nm, cfg in todo]
            for fut in as_completed(futs):
                out.append(fut.result())
                bar.update(1)
        elif n_par == 1:
            import torch

            saved = torch.get_num_threads()
            try:
                for nm, cfg in todo:
                    out.append(_run_point(cfg, points_dir, nm, threads))
                    bar.update(1)
            finally:
                torch.set_num_threads(saved)
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed as cf_completed
            from concurrent.futures.process import BrokenProcessPool

            ctx = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(max_workers=min(n_par, len(todo)), mp_context=ctx,
                                       initializer=_parent_watch, initargs=(os.getpid(),))
            try:
                with interrupts_left_to_parent():  # the workers are spawned (and start) with Ctrl-C ignored
                    futs = {pool.submit(_run_point, cfg, points_dir, nm, threads): nm for nm, cfg in todo}
                for fut in cf_completed(futs):
                    try:
                        out.append(fut.result())
                    except BrokenProcessPool:
                        out.append({"point": futs[fut], "state": "failed", "wall_time_s": None,
                                    "error": "its worker process died (killed, out of memory, or a script that "
                                             "re-runs its sweep on import: call run_sweep under `if __name__ == "
                                             "'__main__':`) or the pool broke before it ran; --resume runs it again"})
                    bar.update(1)
            except BaseException:  # Ctrl-C, SIGTERM (Terminated): the workers end with the sweep
                _stop_workers(pool)
                # the workers are gone: waiting for the pool's own thread releases its queues (no "leaked
                # semaphore" warning from multiprocessing's resource tracker at exit)
                with contextlib.suppress(Exception):
                    pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown(wait=True)
    return out


# ---------------------------------------------------------------------------- gathering
def _scalar(v) -> bool:
    return v is None or isinstance(v, (int, float, str))  # bool is an int


def gather(sweep_dir, errors: Optional[Dict[str, str]] = None) -> Tuple[Path, List[Dict[str, Any]], List[str]]:
    """Write <sweep_dir>/results.csv from the point run directories; returns (path, rows, metric columns).

    Columns: point, state, error, the swept keys, the other parameters (lists written as TOML),
    then every scalar metric (flattened nested metrics, "a.b"); a metric whose name is also a
    parameter is prefixed "metric.".  Points not (yet) complete have state "running",
    "interrupted", "failed" or "missing" and empty metrics."""
    from .rundir import flatten_metrics, write_csv

    sweep_dir = Path(sweep_dir)
    spec = loads_json((sweep_dir / "sweep.json").read_text())
    axes = list(spec["axes"])
    errors = errors or {}
    rows: List[Dict[str, Any]] = []
    param_keys: List[str] = list(axes)
    metric_keys: List[str] = []
    for i, nm in enumerate(spec["points"]):
        rp = sweep_dir / "points" / nm
        row: Dict[str, Any] = {"point": nm}
        try:
            st = loads_json((rp / "status.json").read_text())
            state, err = st.get("state", "unknown"), st.get("error", "")
        except (OSError, ValueError):
            state, err = "missing", ""
        if nm in errors and errors[nm]:
            state, err = "failed", errors[nm]
        row["state"], row["error"] = state, err
        try:
            params = loads_json((rp / "config.json").read_text())["params"]
        except (OSError, ValueError, KeyError):
            params = {**spec["config"]["params"], **expand_grid(spec["axes"])[i]}
        row.update(params)
        param_keys += [k for k in params if k not in param_keys]
        if state == "complete":
            try:
                met = flatten_metrics(loads_json((rp / "metrics.json").read_text()))
            except (OSError, ValueError):
                met = {}
            for k, v in met.items():
                if not _scalar(v):
                    continue
                col = f"metric.{k}" if k in params or k in ("point", "state", "error") else k
                if col not in metric_keys:
                    metric_keys.append(col)
                row[col] = v
        rows.append(row)
    cols = ["point", "state", "error", *param_keys, *metric_keys]
    path = sweep_dir / "results.csv"
    write_csv(path, [cols, *([_fmt(v) if isinstance(v, list) else v for v in map(row.get, cols)] for row in rows)])
    return path, rows, metric_keys


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_sweep(sweep_dir, rows: List[Dict[str, Any]], axes: List[str], metrics: Sequence[str]) -> Optional[Path]:
    """figures/sweep.png|pdf: each metric (numeric ones; at most 6) against the first axis
    (categorical positions when its values are not numbers), one line per combination of the
    other axes.  None when no complete point has one of the metrics as a number."""
    done = [r for r in rows if r.get("state") == "complete"]
    keys = [m for m in metrics if any(_numeric(r.get(m)) for r in done)][:6]
    missing = [m for m in metrics if m not in keys]
    if missing:
        log.warning("sweep figure: no numeric metric named %s in the complete points", missing[0])
    if not keys:
        return None
    from .plotting import panel, subplots
    from .rundir import write_figure

    xkey = axes[0] if axes else None
    others = axes[1:]
    xs_all = [r.get(xkey) for r in done] if xkey else [0 for _ in done]
    numeric_x = all(_numeric(v) for v in xs_all)
    cats = list(dict.fromkeys(_fmt(v) for v in xs_all))  # distinct, in order
    fig, axs = subplots(1, len(keys), (4.2 * len(keys), 3.4), squeeze=False)
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in done:
        groups.setdefault(", ".join(f"{k}={_fmt(r.get(k))}" for k in others), []).append(r)
    for ax, key in zip(axs[0], keys):
        for label, rs in groups.items():
            pts = [(r.get(xkey) if numeric_x else cats.index(_fmt(r.get(xkey))), r.get(key)) for r in rs
                   if _numeric(r.get(key))] if xkey else [(0, r.get(key)) for r in rs if _numeric(r.get(key))]
            if not pts:
                continue
            pts.sort(key=lambda p: p[0])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label or None)
        if not numeric_x and xkey:
            ax.set_xticks(range(len(cats)), cats, rotation=30)
        panel(ax, xkey or "point", key, key, title_size=9, legend={"fontsize": 7} if others else None)
    spec_name = Path(sweep_dir).name
    fig.suptitle(f"sweep {spec_name}: {len(done)} complete points; metrics against {xkey or 'point'}"
                 + (f", one line per {', '.join(others)}" if others else ""), fontsize=9)
    fig.tight_layout()
    (Path(sweep_dir) / "figures").mkdir(exist_ok=True)
    return write_figure(fig, Path(sweep_dir) / "figures", "sweep", dpi=130)[0]


# ---------------------------------------------------------------------------- CLI
def add_parser(subparsers, parents: Sequence[argparse.ArgumentParser] = ()):
    """Register ``transformer-pde sweep`` on an argparse subparsers object (cli.build_parser).

    ``parents``: parent parsers of shared options (the CLI's -v/-q/--threads); when one defines
    ``--threads`` ("auto" or N), N means torch threads per point and "auto" the default."""
    p = subparsers.add_parser(
        "sweep", parents=list(parents), help="run a config over a grid of parameters (one run directory per point)",
        description="Run the cartesian grid of -s axes as independent runs, on worker processes or a Dask "
                    "cluster; finished points are skipped on --resume; writes results.csv and figures/sweep.png.")
    p.add_argument("config", help="a TOML config file or a shipped config name (as for `transformer-pde run`)")
    p.add_argument("--sweep", "-s", action="append", default=[], metavar="KEY=[V1,V2,...]",
                   help="a sweep axis: KEY takes each value of the TOML list, repeatable (grid = cartesian product); "
                        "list-valued options list lists: -s 'heads=[[1],[1,10]]'")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="fix a parameter for every point (TOML value), as in `transformer-pde run`")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes on this machine (default 1)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run on an existing Dask distributed cluster (e.g. tcp://host:8786) instead of local workers")
    with contextlib.suppress(argparse.ArgumentError):  # unless a parent parser has --threads
        p.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch threads per point (default: CPU cores // workers)")
    p.add_argument("--out", default="runs", help="parent folder of the sweep directory (default: runs)")
    p.add_argument("--name", default=None, help="sweep directory name (default: <config name>_sweep)")
    p.add_argument("--resume", action="store_true", help="continue a sweep: complete points are skipped")
    p.add_argument("--metric", action="append", default=[], metavar="KEY", help="metric(s) for the figure")
    p.add_argument("--no-figure", action="store_true", help="write the table only, no figures/sweep.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--max-points", type=int, default=DEFAULT_MAX_POINTS, metavar="N",
                   help=f"refuse a grid of more than N points (default {DEFAULT_MAX_POINTS}): confirms a large sweep")
    p.set_defaults(fn=_cmd_sweep)
    return p


def _cmd_sweep(args) -> int:
    """`transformer-pde sweep`: exit 0 done, 1 some point failed (results.csv written), 2 refused before anything was
    written, 130 Ctrl-C, 143 SIGTERM (the workers are stopped first; --resume continues)."""
    from .locks import Terminated

    try:
        res = run_sweep(args.config, args.sweep, overrides=args.override, out_dir=args.out, name=args.name,
                        workers=args.workers, scheduler=args.scheduler,
                        threads=args.threads if isinstance(args.threads, int) else None, resume=args.resume,
                        progress=not args.no_progress, metrics=args.metric, figure=not args.no_figure,
                        max_points=args.max_points, max_memory=getattr(args, "max_memory", None),
                        max_steps=getattr(args, "max_steps", None))
    except KeyboardInterrupt as e:
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"\ntransformer-pde: sweep {how}; run the same command with --resume to continue "
              "(complete points are skipped)", file=sys.stderr, flush=True)
        return 128 + e.signum if isinstance(e, Terminated) else 130
    print(f"sweep directory: {res.path}")
    print(f"  points: {len(res.rows)}  ran: {len(res.ran)}  skipped (complete): {len(res.skipped)}  "
          f"failed: {len(res.failed)}")
    print(f"  table: {res.table}")
    if res.figure is not None:
        print(f"  figure: {res.figure}")
    for nm in res.failed:
        err = next((r["error"] for r in res.rows if r["point"] == nm), "")
        print(f"  FAILED {nm}: {err}")
    if res.failed:
        print("rerun the same command with --resume to retry the failed points", flush=True)
    return 1 if res.failed else 0
