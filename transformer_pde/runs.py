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
  terminated run checkpoints and says "interrupted" in ``status.json`` like Ctrl-C.

Every file is written to a temporary name first and moved into place with ``os.replace``,
so a killed run never leaves a half-written file behind.  ``--resume`` re-enters the study
with the same resolved config; studies skip the pieces whose results are already in the run
directory and continue a partial piece from its checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import logging
import platform
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import threads
from .resources import tomllib
from .studies import get_study, validate_params

__all__ = ["RunDir", "load_config", "parse_override", "execute", "plan", "package_versions", "atomic_write_text",
           "flatten_metrics", "check_run_name", "is_run_dir", "RunLockedError", "Terminated", "MARKER", "LOCK_FILE"]

# shared with sweep (named internal API)
__internal__ = ["write_csv", "write_figure"]

logger = logging.getLogger(__name__)

MARKER = ".transformer-pde-run"
LOCK_FILE = ".lock"
_MARKER_FORMAT = 1


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_csv(path: Path, rows: Iterable[Sequence]) -> None:
    """Write the rows (the first is the header) as a CSV file, atomically; floats as repr, None as ""."""
    buf = io.StringIO()
    csv.writer(buf).writerows([repr(float(v)) if isinstance(v, float) else v for v in row] for row in rows)
    atomic_write_text(path, buf.getvalue())


def write_figure(fig, folder: Path, name: str, formats: Sequence[str] = ("png", "pdf"), dpi: int = 150) -> list:
    """Save ``fig`` as folder/<name>.<ext> for each format (each atomically) and close it; returns the paths."""
    import matplotlib.pyplot as plt

    out = []
    for ext in formats:
        p = Path(folder) / f"{name}.{ext}"
        tmp = p.with_name(p.stem + ".tmp." + ext)
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
        os.replace(tmp, p)
        out.append(p)
    plt.close(fig)
    return out


def package_versions() -> Dict[str, Any]:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for pkg in ("transformer_pde", "torch", "torchdiffeq", "pot", "geomloss", "numpy", "matplotlib", "tqdm", "pykeops"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["torch_threads"] = torch.get_num_threads()
    out["cuda_available"] = torch.cuda.is_available()
    return out


class RunDir:
    """A run directory and the helpers studies use to write into it.

    Attributes:
        path: the directory.  progress: show progress bars.  resume: the run continues an
        interrupted one.  step_callback: None or a callable ``(tag, step, time)`` that studies
        call after every solver step of the piece of work ``tag`` (monitoring; tests use it
        to interrupt a run at a chosen step).
    """

    def __init__(self, path: Path, *, progress: bool = True, resume: bool = False,
                 step_callback: Optional[Callable[[str, int, float], None]] = None):
        self.path = Path(path)
        self.progress = progress
        self.resume = resume
        self.step_callback = step_callback
        for sub in ("figures", "series", "checkpoints", "data"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_script(cls, path, kind: str, *, progress: bool = False) -> "RunDir":
        """A RunDir for a script's output folder (the examples' ``--out``), following the run rules.

        A missing or empty folder is created and marked as ours; a folder carrying the marker
        (an earlier output of a script or run) is reused, its files replaced one by one; any
        other folder is refused with ValueError and left untouched.
        """
        path = Path(path)
        if path.is_symlink() or (path.exists() and not path.is_dir()) or (
                path.is_dir() and any(path.iterdir()) and not is_run_dir(path)):
            raise _not_ours(path)
        if not is_run_dir(path):
            path.mkdir(parents=True, exist_ok=True)
            _write_marker(path, {"kind": kind, "name": path.name})
        return cls(path, progress=progress)

    def checkpoint_path(self, tag: str) -> Path:
        return self.path / "checkpoints" / f"{tag}.ckpt"

    def data_path(self, tag: str) -> Path:
        return self.path / "data" / f"{tag}.pt"

    def save_tensors(self, tag: str, obj) -> Path:
        """torch.save(obj) to data/<tag>.pt atomically (tmp + os.replace)."""
        p = self.data_path(tag)
        tmp = p.with_name(p.name + ".tmp")
        torch.save(obj, tmp)
        os.replace(tmp, p)
        return p

    def load_tensors(self, tag: str):
        """The object saved under ``tag``, or None when there is none; ValueError when unreadable."""
        p = self.data_path(tag)
        if not p.exists():
            return None
        try:
            return torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(f"{p} is corrupted or unreadable ({type(e).__name__}: {e}); delete it to recompute "
                             f"that part of the run") from None

    def write_json(self, name: str, obj) -> Path:
        p = self.path / name
        atomic_write_text(p, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")
        return p

    def read_json(self, name: str):
        p = self.path / name
        return json.loads(p.read_text()) if p.exists() else None

    def save_series(self, name: str, columns: Dict[str, Any]) -> Path:
        """Write columns (1-D tensors/arrays/lists of equal length) as series/<name>.csv."""
        cols = {k: _to_list(v) for k, v in columns.items()}
        lengths = {len(v) for v in cols.values()}
        if len(lengths) != 1:
            raise ValueError(f"series {name!r}: columns have different lengths {sorted(lengths)}")
        p = self.path / "series" / f"{name}.csv"
        write_csv(p, [list(cols), *zip(*cols.values())])
        return p

    def save_figure(self, fig, name: str, formats: Sequence[str] = ("png", "pdf")) -> list:
        return write_figure(fig, self.path / "figures", name, formats)


def _to_list(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().reshape(-1).tolist()
    if hasattr(v, "tolist"):
        return list(v.reshape(-1).tolist())
    return list(v)


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # tensors, numpy arrays and scalars
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def parse_override(text: str):
    """'key=value' with a TOML value (numbers, booleans, lists, quoted or bare strings)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value (e.g. n=100 or heads=[1,10])")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("params."):
        key = key[len("params."):]
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def _read_config_file(path: Path) -> Dict[str, Any]:
    """The TOML table in ``path``; ValueError (one line, with the fix) for anything that is not one."""
    if not path.exists():
        raise ValueError(f"config file {path} does not exist; `transformer-pde list` shows the shipped configs")
    if path.is_dir():
        raise ValueError(f"config {path} is a directory, not a TOML file; give a file such as "
                         f"experiments/ou_vs_oscillating_quick.toml or a shipped config name")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not a text (UTF-8) TOML file; give a .toml config") from None
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror or e}); check its permissions") from None
    if "\x00" in text:
        raise ValueError(f"config file {path} is a binary file, not a TOML config; give a .toml config")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


def load_config(source, overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """Read a TOML config (path or dict) and resolve it: {'kind', 'name', 'params'}.

    Raises:
        ValueError: a missing, unreadable, binary or non-TOML file; an unknown kind or key; a value
            of the wrong type, outside its choices or not finite (each names the key and the fix).
    """
    if isinstance(source, (str, Path)):
        raw, default_name = _read_config_file(Path(source)), Path(source).stem
    elif isinstance(source, dict):
        raw = dict(source)
        default_name = raw.get("kind", "run")
    else:
        raise TypeError(f"config source must be a path or a dict, got {type(source).__name__}")
    allowed_top = {"kind", "name", "description", "params"}
    extra = sorted(set(raw) - allowed_top)
    if extra:
        raise ValueError(f"unknown top-level config key '{extra[0]}'; allowed keys: {', '.join(sorted(allowed_top))}")
    if "kind" not in raw:
        raise ValueError("the config needs a top-level 'kind' naming the experiment (see `transformer-pde list`)")
    kind = raw["kind"]
    if not isinstance(raw.get("params", {}), dict):
        raise ValueError("config key 'params' must be a table ([params] in TOML) of parameter = value lines")
    params = {**raw.get("params", {}), **dict(parse_override(ov) for ov in overrides)}
    resolved = validate_params(kind, params)
    # checks that involve several keys, declared by the study as fn.validate(params)
    check = getattr(get_study(kind).fn, "validate", None)
    if check is not None:
        try:
            check(resolved)
        except (OverflowError, ZeroDivisionError, ArithmeticError) as e:
            raise ValueError(f"config of kind {kind!r} has values out of range ({type(e).__name__}: {e}); "
                             f"check the numbers given with -o or in [params]") from None
    name = raw.get("name", default_name)
    if not isinstance(name, str):
        raise ValueError(f"config key 'name' must be a string, got {name!r}")
    return {"kind": kind, "name": name, "description": raw.get("description", ""), "params": resolved}


def flatten_metrics(obj, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts/lists of metrics -> {"a.b.0": value} with scalar (or None) values."""
    out: Dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_metrics(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_metrics(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


# ---------------------------------------------------------------------------- run-directory safety
class RunLockedError(ValueError):
    """The run directory is in use by a live run (``pid`` holds the lock; None when unknown)."""

    def __init__(self, path: Path, pid: Optional[int]):
        self.path, self.pid = Path(path), pid
        who = f"process {pid}" if pid is not None else "another process"
        stop = f" (kill {pid} to stop it)" if pid is not None else ""
        super().__init__(f"run directory {path} is in use by a live run, {who}; wait for it to finish{stop} "
                         f"or use --name NEW for another run")


class Terminated(KeyboardInterrupt):
    """SIGTERM received while a study ran: handled like Ctrl-C (``signum`` is the signal number)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def check_run_name(name) -> str:
    """``name`` if it is one plain path component, else ValueError saying what to give instead.

    Refused: non-strings, '', '.', '..', names with '/', the OS separator, NUL or a control
    character, names starting with '-' (they read like options) or ending in whitespace.
    """
    fix = "give a plain folder name such as 'my_run' (letters, digits, '_', '-', '.')"
    if not isinstance(name, str):
        raise ValueError(f"run name must be a string, got {name!r}; {fix}")
    if name in ("", ".", ".."):
        raise ValueError(f"run name {name!r} is not a folder name (--name / config 'name'); {fix}")
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if any(c in name for c in seps) or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise ValueError(f"run name {name!r} must be a single folder name under --out, without path separators "
                         f"or control characters; {fix}")
    if name.startswith("-") or name != name.strip():
        raise ValueError(f"run name {name!r} must not start with '-' or start/end with spaces; {fix}")
    return name


def _read_marker(path: Path) -> Optional[Dict[str, Any]]:
    m = Path(path) / MARKER
    if m.is_symlink() or not m.is_file():
        return None
    try:
        obj = json.loads(m.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("transformer_pde_run") is True else None


def is_run_dir(path) -> bool:
    """True when ``path`` is a real directory (not a symlink) carrying a valid run marker."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and _read_marker(path) is not None


def _not_ours(path: Path) -> ValueError:
    return ValueError(
        f"{path} exists but is not a transformer-pde run directory (no {MARKER} marker); it is left untouched. "
        f"Choose another --name or --out (or, if it is a run made by an older version, adopt it with: "
        f"echo '{{\"transformer_pde_run\": true}}' > {shlex.quote(str(path / MARKER))})")


def _config_diff(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """'key: old -> new' for every top-level or params key whose value differs."""
    po, pn = old.get("params", {}) or {}, new.get("params", {}) or {}
    top = [k for k in sorted(set(old) | set(new)) if k != "params" and old.get(k) != new.get(k)]
    params = [k for k in sorted(set(po) | set(pn)) if po.get(k, "(absent)") != pn.get(k, "(absent)")]
    return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for keys, a, b in
            ((top, old, new), (params, po, pn)) for k in keys]


def plan(source, *, overrides: Iterable[str] = (), out_dir="runs", name: Optional[str] = None,
         resume: bool = False, overwrite: bool = False, replace_kind: Optional[str] = None
         ) -> Tuple[Dict[str, Any], Path]:
    """Every check :func:`execute` makes before it writes anything; returns (resolved config, run path).

    Nothing is created or changed.  :func:`execute` repeats the directory checks under the lock.

    Raises:
        ValueError: invalid config or override, unsafe run name, ``out_dir`` that is a file or not
            writable, an existing folder that is not a run directory, an existing run without
            ``resume``/``overwrite``, a resume whose config differs (the differing keys listed).
    """
    if resume and overwrite:
        raise ValueError("choose either --resume (continue the run) or --overwrite (start it afresh), not both")
    cfg = load_config(source, overrides)
    if name is not None:
        cfg["name"] = name
    check_run_name(cfg["name"])
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; give a folder for the run directories")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write in {existing} (permission denied); choose a writable --out")
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is not a folder; choose another --out")
    run_path = out / cfg["name"]
    if run_path.is_symlink() or run_path.exists():
        _check_existing(run_path, cfg, resume=resume, overwrite=overwrite, replace_kind=replace_kind)
    return cfg, run_path


def _check_existing(run_path: Path, cfg, *, resume: bool, overwrite: bool, replace_kind: Optional[str],
                    check_lock: bool = True) -> str:
    """For an existing ``run_path``: "resume", "overwrite" or "fresh" (marked, nothing to lose); else ValueError."""
    marker = _read_marker(run_path) if run_path.is_dir() and not run_path.is_symlink() else None
    if marker is None:
        raise _not_ours(run_path)
    locked, pid = _lock_holder(run_path) if check_lock else (False, None)
    if locked:
        raise RunLockedError(run_path, pid)
    if not os.access(run_path, os.W_OK | os.X_OK):
        raise ValueError(f"run directory {run_path} is not writable (permission denied); choose another --out")
    cfg_file = run_path / "config.json"
    if overwrite or (replace_kind is not None and marker.get("kind") == replace_kind):
        return "overwrite"
    if replace_kind is not None:
        raise ValueError(f"{run_path} holds a run of kind {marker.get('kind')!r}, not a {replace_kind!r} run; "
                         f"it is kept: choose another --name or --out")
    if not cfg_file.exists():
        return "fresh"  # created, then stopped before its config was written: nothing to lose
    if not resume:
        raise ValueError(f"run directory {run_path} exists; pass --resume to continue it, --overwrite to start it "
                         f"afresh, or --name NEW to start another run")
    try:
        old = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resume {run_path}: its config.json is unreadable ({e}); use --overwrite to "
                         f"start it afresh") from None
    new = json.loads(json.dumps(cfg, default=_json_default))
    if old != new:
        diff = _config_diff(old if isinstance(old, dict) else {}, new)
        raise ValueError(f"cannot resume {run_path}: its config differs from this one ({'; '.join(diff)} "
                         f"[old -> new]); resume with the same config and overrides, or use --name NEW for a "
                         f"new run or --overwrite to start afresh")
    return "resume"


class _RunLock:
    """Exclusive lock on ``run_path/.lock`` (fcntl.flock; msvcrt on Windows) with the holder's PID inside."""

    def __init__(self, run_path: Path):
        self.path = Path(run_path) / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self) -> "_RunLock":
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o644)
        try:
            _lock_fd(fd)
        except BlockingIOError:
            try:
                text = os.pread(fd, 64, 0).decode("ascii", "replace").strip() if hasattr(os, "pread") else ""
                pid = int(text) if text.isdigit() else None
            finally:
                os.close(fd)
            raise RunLockedError(self.path.parent, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def _lock_holder(run_path: Path) -> Tuple[bool, Optional[int]]:
    """(locked?, holder PID or None) for ``run_path/.lock``, without creating or changing anything."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the claim in _open_run_dir decides
        return False, None
    p = Path(run_path) / LOCK_FILE
    if p.is_symlink() or not p.is_file():
        return False, None
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return True, int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def _lock_fd(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            raise BlockingIOError("locked") from None
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _write_marker(run_path: Path, cfg) -> None:
    from . import __version__

    atomic_write_text(run_path / MARKER, json.dumps({
        "transformer_pde_run": True, "format": _MARKER_FORMAT, "kind": cfg["kind"], "name": cfg["name"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "created_by": f"transformer_pde {__version__}",
        "pid": os.getpid()}, indent=2, sort_keys=True) + "\n")


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
                  ) -> Tuple[_RunLock, bool]:
    """Create or claim ``run_path`` under its lock; returns (the held lock, resumed?)."""
    out = run_path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create it ({e.strerror or e}); choose a writable --out") from None
    created = False
    try:
        os.mkdir(run_path)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise ValueError(f"cannot create run directory {run_path} ({e.strerror or e}); choose another --out") from None
    if not created and not is_run_dir(run_path):  # ours before we touch it (not even the lock file is created)
        raise _not_ours(run_path)
    lock = _RunLock(run_path).acquire()
    try:
        if created:
            _write_marker(run_path, cfg)
            return lock, False
        action = _check_existing(run_path, cfg, resume=resume, overwrite=overwrite, replace_kind=replace_kind,
                                 check_lock=False)  # we hold it
        if action == "overwrite":
            logger.info("overwriting run directory %s", run_path)
            _empty_run_dir(run_path)
            _write_marker(run_path, cfg)
        return lock, action == "resume"
    except BaseException:
        lock.release()
        raise


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Within the block (main thread only), the first SIGTERM raises :class:`Terminated` (a second one gets the
    previous handler, by default: terminate at once); the previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    old = signal.SIG_DFL if previous is None else previous

    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, old)  # one-shot
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def execute(source, *, overrides: Iterable[str] = (), out_dir="runs", name: Optional[str] = None,
            resume: bool = False, progress: bool = True, overwrite: bool = False,
            step_callback: Optional[Callable[[str, int, float], None]] = None,
            replace_kind: Optional[str] = None) -> Path:
    """Validate the config, prepare the run directory, run the study, write its metrics.

    Args:
        source: TOML path or config dict {"kind", "name", "params"}.
        overrides: "key=value" strings (TOML values) applied to ``params``.
        out_dir, name: the run directory is out_dir/name (name defaults to the config's; it must be
            one plain folder name, see :func:`check_run_name`).
        resume: continue an existing run directory (same resolved config); otherwise an
            existing run is refused.  A resume of a directory that does not exist starts the run.
        overwrite: empty an existing *run directory* (one carrying the marker) and start afresh.
        replace_kind: overwrite an existing run directory only when it holds a run of this kind
            (``transformer-pde demo`` uses "demo"); runs of other kinds are refused.
        progress: progress bars allowed (tqdm ``disable=None``: shown only on a terminal).
        step_callback: see :class:`RunDir`.

    Returns:
        the run directory.

    Raises:
        ValueError for an invalid config, name or ``out_dir`` (before anything is written), a folder
        that is not a run directory (never touched), a run directory that exists (without resume) or
        holds another config (the differing keys listed); :class:`RunLockedError` (a ValueError) when a
        live run holds the directory; whatever the study raises (the status file then says
        "interrupted" and how to resume).  SIGTERM during the study raises :class:`Terminated`.
    """
    cfg, run_path = plan(source, overrides=overrides, out_dir=out_dir, name=name, resume=resume,
                         overwrite=overwrite, replace_kind=replace_kind)
    lock, resumed = _open_run_dir(cfg, run_path, resume=resume, overwrite=overwrite, replace_kind=replace_kind)
    try:
        with _sigterm_as_interrupt():
            return _run_study(cfg, run_path, resumed=resumed, resume=resume, progress=progress,
                              step_callback=step_callback)
    finally:
        lock.release()


def _run_study(cfg, run_path: Path, *, resumed: bool, resume: bool, progress: bool, step_callback) -> Path:
    run = RunDir(run_path, progress=progress, resume=resume, step_callback=step_callback)
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
    logger.info("%s %s (kind %s) in %s", "resuming" if resumed else "running", cfg["name"], cfg["kind"], run_path)
    t0 = time.perf_counter()
    mark = len(threads.usage())
    try:
        metrics = st.fn(cfg["params"], run)
    except BaseException as e:
        status = {"state": "interrupted", "error": f"{type(e).__name__}: {e}",
                  "wall_time_s": time.perf_counter() - t0,
                  "resume_with": "transformer-pde run CONFIG --resume (same config and overrides)"}
        if isinstance(e, Terminated):
            status["signal"] = "SIGTERM"
        run.write_json("status.json", status)
        raise
    finally:  # the thread counts the solver loops (and any worker processes) really used
        env["thread_policy"], env["threads_used"] = threads.current(), env.get("threads_used", []) + threads.usage(mark)
        run.write_json("environment.json", env)
    wall = time.perf_counter() - t0
    metrics = {**(metrics or {}), "wall_time_s": wall}
    run.write_json("metrics.json", metrics)
    flat = flatten_metrics(json.loads(json.dumps(metrics, default=_json_default)))
    write_csv(run.path / "metrics.csv", [["key", "value"], *flat.items()])
    run.write_json("status.json", {"state": "complete", "wall_time_s": wall})
    logger.info("%s complete in %.1f s", cfg["name"], wall)
    return run_path
