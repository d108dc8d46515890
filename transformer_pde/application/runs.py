"""Run directories: resolved config, package versions, seeds, metrics, figures, checkpoints.

Layout of ``runs/<name>/``::

    .transformer-pde-run  the marker (JSON) written when the directory is created: proof that it is ours
    .lock              the lock file of the live run (its PID inside; ``fcntl.flock``, released by the OS)
    config.json        the resolved config (defaults filled in, overrides applied)
    environment.json   package versions, Python, platform, device, start time (and resume times)
    status.json        "running" / "interrupted" (with the error) / "complete", with the wall time
    metrics.json       the study's numbers (written atomically at the end)
    metrics.csv        the same numbers flattened to key,value rows
    series/*.csv       time series (one column per quantity)
    data/*.pt          recorded tensors of finished pieces of work (torch.save)
    figures/*.png|pdf  figures
    checkpoints/       atomic checkpoints used by --resume

Safety rules (:func:`execute`):

* the run name is one plain path component under ``out_dir`` (no separators, not ``.``/``..``,
  not empty, no NUL, no leading ``-``); everything is validated before anything is written;
* a directory is only created, resumed, written into or emptied (``overwrite``) when it carries
  the marker; a folder without it is refused and never touched;
* the live run holds an exclusive lock on ``.lock``; a second run, resume or overwrite of the
  same directory is refused with the holder's PID.  The lock is taken before anything is deleted;
* SIGTERM is turned into :class:`Terminated` (a ``KeyboardInterrupt``) while the study runs, so a
  terminated run checkpoints and says "interrupted" in ``status.json`` like Ctrl-C;
* the lock is taken before anything is written, and the PID is written into it only once every check
  has passed: a refused second run leaves every file as it was;
* a resume is refused when the directory holds a symlink, a hard-linked file or a special file
  (:func:`check_no_links`), a damaged ``environment.json``, or a stored segment or checkpoint that
  is unreadable or not finite;
* the run's memory and solver steps are estimated before the directory is created and refused
  above ``max_memory`` / ``max_steps`` (:func:`check_resources`);
* ``metrics.json`` is strict JSON: NaN/inf metrics are written as null and listed.  A study whose tables the
  docs publish (a kind of ``studies.provenance.TABLE_SOURCES``) also gets ``code_fingerprint``, the hash of the
  code those tables depend on, taken when the run starts.

Every file is written to a new temporary file, created exclusively (``O_CREAT | O_EXCL |
O_NOFOLLOW``, never through an existing link), and moved into place with ``os.replace``, so a
killed run never leaves a half-written file behind.  docs/reliability.md is the user's account.
``--resume`` re-enters the study with the same resolved config; studies skip the pieces whose
results are already in the run directory and continue a partial piece from its checkpoint.

This module runs a study (:func:`plan`, :func:`execute`); it is built on :mod:`.config` (reading and
resolving a config, the run name, the resource limits), :mod:`.rundir` (the directory's files: atomic
writes, the marker, :class:`~transformer_pde.application.rundir.RunDir`) and :mod:`.locks` (the run's
lock, SIGTERM as an interrupt), which are imported from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..utils import threads
from .config import check_out_dir, check_resources, check_run_name, load_config
from .locks import (LOCK_FILE, RunLock, RunLockedError, Terminated, lock_holder, sigterm_as_interrupt,
                    wait_for_creator)
from .rundir import (RunDir, check_no_links, flatten_metrics, is_run_dir, json_default, loads_json, nonfinite_to_null,
                     not_ours, package_versions, read_marker, remove_stale_temps, write_csv, write_marker)
from .studies import get_study, nonfinite_keys, provenance

__all__ = ["execute", "plan", "failed_run_dir"]


logger = logging.getLogger(__name__)


def _config_diff(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """'key: old -> new' for every top-level or params key whose value differs."""
    po, pn = old.get("params", {}) or {}, new.get("params", {}) or {}
    top = [k for k in sorted(set(old) | set(new)) if k != "params" and old.get(k) != new.get(k)]
    params = [k for k in sorted(set(po) | set(pn)) if po.get(k, "(absent)") != pn.get(k, "(absent)")]
    return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for keys, a, b in
            ((top, old, new), (params, po, pn)) for k in keys]


def plan(source, *, overrides: Iterable[str] = (), out_dir="runs", name: Optional[str] = None,
         resume: bool = False, overwrite: bool = False, replace_kind: Optional[str] = None,
         max_memory=None, max_steps: Optional[int] = None) -> Tuple[Dict[str, Any], Path]:
    """Every check :func:`execute` makes before it writes anything; returns (resolved config, run path).

    Nothing is created or changed.  :func:`execute` repeats the directory checks under the lock.

    Raises
    ------
    ValueError
        invalid config or override, unsafe run name, ``out_dir`` that is a file or not
        writable, an existing folder that is not a run directory, an existing run without
        ``resume``/``overwrite``, a resume whose config differs (the differing keys listed), a run
        whose estimated memory or step count is above ``max_memory`` / ``max_steps``
        (:func:`check_resources`), a resume of a directory holding links or damaged files.
    """
    if resume and overwrite:
        raise ValueError("choose either --resume (continue the run) or --overwrite (start it afresh), not both")
    cfg = load_config(source, overrides)
    if name is not None:
        cfg["name"] = name
    check_run_name(cfg["name"])
    check_resources(cfg, max_memory=max_memory, max_steps=max_steps)
    out = check_out_dir(out_dir)
    run_path = out / cfg["name"]
    if run_path.is_symlink() or run_path.exists():
        _check_existing(run_path, cfg, resume=resume, overwrite=overwrite, replace_kind=replace_kind)
    return cfg, run_path


def _check_stored(run_path: Path) -> None:
    """ValueError naming the file when environment.json is unreadable, or a finished segment (data/*.pt) or a
    checkpoint (checkpoints/*.ckpt) is unreadable or holds NaN/inf: a resume never builds on a damaged piece."""
    env = run_path / "environment.json"
    if env.exists():
        try:
            ok = isinstance(loads_json(env.read_text(encoding="utf-8"), str(env)), dict)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"cannot resume {run_path}: {env} is damaged (not a JSON object); delete it (it is "
                             f"written again) and resume, or start afresh with --overwrite")
    for sub, pattern, what in (("data", "*.pt", "finished piece"), ("checkpoints", "*.ckpt", "checkpoint")):
        for f in sorted((run_path / sub).glob(pattern)) if (run_path / sub).is_dir() else []:
            try:
                obj = torch.load(f, map_location="cpu", weights_only=False)
            except Exception as e:
                raise ValueError(f"cannot resume {run_path}: the {what} {f} is corrupted or unreadable "
                                 f"({type(e).__name__}); delete it to recompute that part of the run") from None
            if sub == "checkpoints" and not (isinstance(obj, dict) and obj.get("kind") == "transformer_pde.simulate"):
                raise ValueError(f"cannot resume {run_path}: {f} is not a transformer_pde simulate checkpoint; delete "
                                 f"it to recompute that part of the run")
            segment = isinstance(obj, dict) and str(obj.get("kind", "")).endswith((".segment", ".simulate"))
            bad = nonfinite_keys(obj, skip=("timing", "scale")) if segment else []  # scale: ±inf/NaN sentinels
            if bad:
                raise ValueError(f"cannot resume {run_path}: the {what} {f} holds NaN/inf in '{bad[0]}' (a damaged "
                                 f"file: stored pieces are always finite); delete it to recompute that part of the run")


def _check_existing(run_path: Path, cfg, *, resume: bool, overwrite: bool, replace_kind: Optional[str],
                    check_lock: bool = True) -> str:
    """For an existing ``run_path``: "resume", "overwrite" or "fresh" (marked, nothing to lose); else ValueError.

    A resume (and a "fresh" reuse) is refused when the directory holds a link (:func:`check_no_links`); under the
    lock (``check_lock=False``) the stored pieces are also checked (:func:`_check_stored`)."""
    real_dir = run_path.is_dir() and not run_path.is_symlink()
    marker = read_marker(run_path) if real_dir else None
    if marker is None and real_dir and check_lock:  # perhaps a run creating it right now
        wait_for_creator(run_path)
        marker = read_marker(run_path)
    locked, pid = lock_holder(run_path) if check_lock and real_dir else (False, None)
    if locked:
        raise RunLockedError(run_path, pid)
    if marker is None:
        raise not_ours(run_path)
    if not os.access(run_path, os.W_OK | os.X_OK):
        raise ValueError(f"run directory {run_path} is not writable (permission denied); choose another --out")
    cfg_file = run_path / "config.json"
    if overwrite or (replace_kind is not None and marker.get("kind") == replace_kind):
        return "overwrite"
    if replace_kind is not None:
        raise ValueError(f"{run_path} holds a run of kind {marker.get('kind')!r}, not a {replace_kind!r} run; "
                         f"it is kept: choose another --name or --out")
    check_no_links(run_path)
    if not cfg_file.exists():
        return "fresh"  # created, then stopped before its config was written: nothing to lose
    if not resume:
        if _is_complete(run_path):
            raise ValueError(f"run directory {run_path} exists and is complete (its results: "
                             f"{run_path / 'metrics.json'}, figures in {run_path / 'figures'}, shown again by --resume); nothing "
                             f"was run. Pass --overwrite to run it again, or --name NEW to keep it and start another run")
        raise ValueError(f"run directory {run_path} exists; pass --resume to continue it, --overwrite to start it "
                         f"afresh, or --name NEW to start another run")
    try:
        old = loads_json(cfg_file.read_text(), str(cfg_file))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resume {run_path}: its config.json is unreadable ({e}); use --overwrite to "
                         f"start it afresh") from None
    new = json.loads(json.dumps(cfg, default=json_default))
    if old != new:
        diff = _config_diff(old if isinstance(old, dict) else {}, new)
        raise ValueError(f"cannot resume {run_path}: its config differs from this one ({'; '.join(diff)} "
                         f"[old -> new]); resume with the same config and overrides, or use --name NEW for a "
                         f"new run or --overwrite to start afresh")
    if not check_lock:
        _check_stored(run_path)
    return "resume"


def _is_complete(run_path: Path) -> bool:
    """Whether the run in ``run_path`` finished: status.json says "complete" and metrics.json is a JSON object."""
    try:
        status = loads_json((run_path / "status.json").read_text(encoding="utf-8"))
        metrics = loads_json((run_path / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(status, dict) and status.get("state") == "complete" and isinstance(metrics, dict)


def _empty_run_dir(run_path: Path) -> None:
    """Delete everything in the (marked, locked) run directory except the lock file; symlinks are unlinked,
    never followed."""
    for entry in list(run_path.iterdir()):
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _open_run_dir(cfg, run_path: Path, *, resume: bool, overwrite: bool, replace_kind: Optional[str]
                  ) -> Tuple[RunLock, bool]:
    """Create or claim ``run_path`` under its lock; returns (the held lock, resumed?).

    The lock is taken before anything is written into the directory, and the lock file is only written (the PID)
    once every check has passed: a run refused here (another live run, a run that finished in the meantime, a
    folder that is not ours) leaves every file as it was.  Folders this call created are removed again when it
    fails before the run directory exists."""
    out = run_path.parent
    made = []  # the --out folders created here (removed again if the run directory cannot be made)
    p = out
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(made)
        raise ValueError(f"--out {out}: cannot create it ({e.strerror or e}); choose a writable --out") from None
    created = False
    try:
        os.mkdir(run_path)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        _remove_empty(made)
        raise ValueError(f"cannot create run directory {run_path} ({e.strerror or e}); choose another --out") from None
    if not created:
        wait_for_creator(run_path)
        locked, pid = lock_holder(run_path)
        if locked:  # a run that is being created or running right now
            raise RunLockedError(run_path, pid)
        if not is_run_dir(run_path):  # ours before we touch it (not even the lock file is created)
            raise not_ours(run_path)
    lock = RunLock(run_path).acquire()
    try:
        if created:
            lock.claim()
            write_marker(run_path, cfg)
            return lock, False
        action = _check_existing(run_path, cfg, resume=resume, overwrite=overwrite, replace_kind=replace_kind,
                                 check_lock=False)  # we hold it
        lock.claim()
        if action == "overwrite":
            logger.info("overwriting run directory %s", run_path)
            _empty_run_dir(run_path)
            write_marker(run_path, cfg)
        else:
            remove_stale_temps(run_path)
        return lock, action == "resume"
    except BaseException:
        lock.release()
        raise


# the temporary files of an atomic write: ``.<name>.<pid>.<hex>.tmp`` (:func:`_new_temp`) and a solver checkpoint's
def _remove_empty(folders) -> None:
    for f in folders:  # innermost first; only empty folders this process created
        with contextlib.suppress(OSError):
            os.rmdir(f)


def execute(source, *, overrides: Iterable[str] = (), out_dir="runs", name: Optional[str] = None,
            resume: bool = False, progress: bool = True, overwrite: bool = False,
            step_callback: Optional[Callable[[str, int, float], None]] = None,
            replace_kind: Optional[str] = None, max_memory=None, max_steps: Optional[int] = None) -> Path:
    """Validate the config, prepare the run directory, run the study, write its metrics.

    Parameters
    ----------
    source
        TOML path or config dict {"kind", "name", "params"}.
    overrides : Iterable[str]
        "key=value" strings (TOML values) applied to ``params``.
    out_dir, name
        the run directory is out_dir/name (name defaults to the config's; it must be
        one plain folder name, see :func:`check_run_name`).
    resume : bool
        continue an existing run directory (same resolved config); otherwise an
        existing run is refused.  A resume of a directory that does not exist starts the run; a resume of
        a complete run returns it as it is.
    overwrite : bool
        empty an existing *run directory* (one carrying the marker) and start afresh.
    replace_kind : Optional[str]
        overwrite an existing run directory only when it holds a run of this kind
        (``transformer-pde demo`` uses "demo"); runs of other kinds are refused.
    progress : bool
        progress bars allowed (tqdm ``disable=None``: shown only on a terminal).
    step_callback : Optional[Callable[[str, int, float], None]]
        see :class:`RunDir`.
    max_memory, max_steps
        limits of the resource estimate (:func:`check_resources`; bytes or "16G", and
        solver steps), checked before anything is written.

    Returns
    -------
    Path
        the run directory.

    Raises
    ------
    ValueError
        for an invalid config, name or ``out_dir`` (before anything is written), a folder
        that is not a run directory (never touched), a run directory that exists (without resume) or
        holds another config (the differing keys listed); :class:`RunLockedError` (a ValueError) when a
        live run holds the directory; whatever the study raises (the status file then says
        "interrupted" and how to resume).  SIGTERM during the study raises :class:`Terminated`.
    """
    cfg, run_path = plan(source, overrides=overrides, out_dir=out_dir, name=name, resume=resume,
                         overwrite=overwrite, replace_kind=replace_kind, max_memory=max_memory, max_steps=max_steps)
    lock, resumed = _open_run_dir(cfg, run_path, resume=resume, overwrite=overwrite, replace_kind=replace_kind)
    try:
        if resumed and _is_complete(run_path):  # nothing to continue: its results stand (no figure is redrawn)
            logger.info("%s is already complete: nothing to resume (--overwrite runs it again)", run_path)
            return run_path
        with sigterm_as_interrupt():
            return _run_study(cfg, run_path, resumed=resumed, resume=resume, progress=progress,
                              step_callback=step_callback)
    finally:
        lock.release()


def failed_run_dir(exc: BaseException) -> Optional[Path]:
    """The run directory when ``exc`` was raised while a study ran (after its directory was written), None when it
    was raised before anything was written (a refused config, name, folder or resource estimate)."""
    return getattr(exc, "transformer_pde_run_dir", None)


def _run_study(cfg, run_path: Path, *, resumed: bool, resume: bool, progress: bool, step_callback) -> Path:
    run = RunDir(run_path, progress=progress, resume=resume, step_callback=step_callback, config=cfg)
    run.write_json("config.json", cfg)
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    env = run.read_json("environment.json") if resumed else None
    if env is None:
        env = {**package_versions(), "cpu_count": os.cpu_count(), "started": now, "resumed": []}
        if env["cuda_available"]:
            env["cuda_device"] = torch.cuda.get_device_name(0)
    else:
        env.setdefault("resumed", []).append(now)
    run.write_json("environment.json", env)
    run.write_json("status.json", {"state": "running", "started": now, "pid": os.getpid()})
    st = get_study(cfg["kind"])
    # the code a published table of this kind depends on, as it is when the run starts (docs tables' markers)
    code = provenance.code_fingerprint(cfg["kind"]) if cfg["kind"] in provenance.TABLE_SOURCES else None
    logger.info("%s %s (kind %s) in %s", "resuming" if resumed else "running", cfg["name"], cfg["kind"], run_path)
    t0 = time.perf_counter()
    mark = len(threads.usage())
    failed = False
    try:
        metrics = st.fn(cfg["params"], run)
    except BaseException as e:
        failed = True
        status = {"state": "interrupted", "error": f"{type(e).__name__}: {e}",
                  "wall_time_s": time.perf_counter() - t0,
                  "resume_with": "transformer-pde run CONFIG --resume (same config and overrides)"}
        if isinstance(e, Terminated):
            status["signal"] = "SIGTERM"
        with contextlib.suppress(OSError):  # e.g. the disk is full: the run's own error is the one to report
            run.write_json("status.json", status)
        with contextlib.suppress(AttributeError, TypeError):
            e.transformer_pde_run_dir = run_path  # see failed_run_dir: the run had started
        raise
    finally:  # the thread counts the solver loops (and any worker processes) really used
        env["thread_policy"], env["threads_used"] = threads.current(), env.get("threads_used", []) + threads.usage(mark)
        try:
            run.write_json("environment.json", env)
        except OSError:
            if not failed:  # only while the study's own error propagates is this one dropped
                raise
    wall = time.perf_counter() - t0
    metrics = {**(metrics or {}), "wall_time_s": wall}
    if code is not None:
        metrics.setdefault("code_fingerprint", code)
    metrics, undefined = nonfinite_to_null(metrics)
    if undefined:
        metrics["undefined_metrics"] = {
            "keys": undefined, "reason": "NaN or infinite for this run (a statistic undefined for these parameters, "
                                         "e.g. a correlation of constant values); written as null"}
        logger.warning("%s: %d metric(s) undefined for this run, written as null: %s", cfg["name"], len(undefined),
                       ", ".join(undefined[:5]))
    run.write_json("metrics.json", metrics, sort_keys=False)  # the study's own order (e.g. a ladder's rungs)
    flat = flatten_metrics(json.loads(json.dumps(metrics, default=json_default)))
    write_csv(run.path / "metrics.csv", [["key", "value"], *flat.items()])
    run.write_json("status.json", {"state": "complete", "wall_time_s": wall})
    logger.info("%s complete in %.1f s", cfg["name"], wall)
    return run_path
