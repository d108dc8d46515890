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
* ``metrics.json`` is strict JSON: NaN/inf metrics are written as null and listed.

Every file is written to a new temporary file, created exclusively (``O_CREAT | O_EXCL |
O_NOFOLLOW``, never through an existing link), and moved into place with ``os.replace``, so a
killed run never leaves a half-written file behind.  docs/reliability.md is the user's account.
``--resume`` re-enters the study with the same resolved config; studies skip the pieces whose
results are already in the run directory and continue a partial piece from its checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import logging
import math
import platform
import re
import secrets
import shlex
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..utils import threads
from ..utils.resources import tomllib
from ..utils.validation import write_error
from .studies import did_you_mean, estimate_resources, get_study, nonfinite_keys, validate_params

__all__ = ["RunDir", "load_config", "parse_override", "execute", "plan", "package_versions", "atomic_write_text",
           "flatten_metrics", "check_run_name", "is_run_dir", "RunLockedError", "Terminated", "MARKER", "LOCK_FILE",
           "check_resources", "parse_size", "memory_limit", "DEFAULT_MAX_STEPS", "failed_run_dir"]

# shared with sweep (named internal API)
__internal__ = ["write_csv", "write_figure", "check_out_dir", "check_no_links", "DirLock", "sigterm_as_interrupt"]

logger = logging.getLogger(__name__)

MARKER = ".transformer-pde-run"
LOCK_FILE = ".lock"
_MARKER_FORMAT = 1


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _new_temp(path: Path) -> Tuple[int, Path]:
    """A new, empty temporary file next to ``path``: (descriptor, its path).

    The name is fresh (``.<name>.<pid>.<random>.tmp``) and the file is created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``, so an existing file, symlink or hard link of that name is never
    opened: the program only ever writes into a file it has just created itself.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | getattr(os, "O_BINARY", 0)
    for _ in range(64):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file next to {path}")  # pragma: no cover


@contextlib.contextmanager
def _atomic_file(path, mode: str = "wb"):
    """Open a new temporary file (see :func:`_new_temp`) as a file object; on success it is flushed, synced and
    moved onto ``path`` with ``os.replace`` (which replaces a link at ``path`` itself, never its target); on an
    error it is removed."""
    path = Path(path)
    fd, tmp = _new_temp(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        err = write_error(path, e)  # a full disk: say so and how to go on, not torch's "[enforce fail at ...]"
        if err is not None:
            raise err from e
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a new temporary file (created exclusively, never through a link),
    then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_file(path, "w") as f:
        f.write(text)


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
        with _atomic_file(p) as f:
            fig.savefig(f, format=ext, dpi=dpi, bbox_inches="tight")
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

    Attributes
    ----------
    path
        the directory.  progress: show progress bars.  resume: the run continues an
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
        with _atomic_file(p) as f:
            torch.save(obj, f)
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

    def write_json(self, name: str, obj, *, sort_keys: bool = True) -> Path:
        """Write ``obj`` as JSON atomically; ValueError if it holds NaN/inf (``allow_nan=False``: a JSON file
        never carries the non-standard NaN/Infinity tokens).  ``sort_keys=False`` keeps the objects' own key
        order (metrics.json: a study's entries in the order it lists them)."""
        p = self.path / name
        atomic_write_text(p, json.dumps(obj, indent=2, sort_keys=sort_keys, default=_json_default, allow_nan=False)
                          + "\n")
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


#: the largest config file read (bytes): the shipped ones are below 4 KiB
CONFIG_MAX_BYTES = 2**20


def _read_config_file(path: Path) -> Dict[str, Any]:
    """The TOML table in ``path``; ValueError (one line, with the fix) for anything that is not one."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as e:  # e.g. a file name too long for the file system
        raise ValueError(f"config file {str(path)[:80]}... cannot be looked up ({e.strerror or e}); give a shorter "
                         f"path or a shipped config name") from None
    if not exists:
        raise ValueError(f"config file {path} does not exist; `transformer-pde list` shows the shipped configs")
    if is_dir:
        raise ValueError(f"config {path} is a directory, not a TOML file; give a file such as "
                         f"experiments/ou_vs_oscillating_quick.toml or a shipped config name")
    try:
        st = os.stat(path)  # not opened yet: opening a FIFO would block until someone writes into it
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror or e}); check its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        what = ("a named pipe (FIFO)" if stat.S_ISFIFO(st.st_mode) else "a device" if
                stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise ValueError(f"config {path} is {what}, not a TOML file; give a regular .toml file (e.g. "
                         f"experiments/ou_vs_oscillating_quick.toml) or a shipped config name")
    if st.st_size > CONFIG_MAX_BYTES:
        raise ValueError(f"config file {path} is {st.st_size} bytes, more than a config can be ({CONFIG_MAX_BYTES} "
                         f"bytes); give the .toml config itself")
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)  # bounded, also when the file grows while it is read
        if len(raw) > CONFIG_MAX_BYTES:
            raise ValueError(f"config file {path} is more than {CONFIG_MAX_BYTES} bytes, more than a config can be; "
                             f"give the .toml config itself")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not a text (UTF-8) TOML file; give a .toml config") from None
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror or e}); check its permissions") from None
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark (some Windows editors write one): not part of the TOML
        text = text[1:]
    if "\x00" in text:
        raise ValueError(f"config file {path} is a binary file, not a TOML config; give a .toml config")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


def load_config(source, overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """Read a TOML config (path or dict) and resolve it: {'kind', 'name', 'params'}.

    Raises
    ------
    ValueError
        a missing, unreadable, binary or non-TOML file; an unknown kind or key; a value
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
        raise ValueError(f"unknown top-level config key '{extra[0]}'{did_you_mean(extra[0], allowed_top)}; allowed "
                         f"keys: {', '.join(sorted(allowed_top))} (parameters go under [params])")
    if "kind" not in raw:
        raise ValueError("the config needs a top-level 'kind' naming the experiment (see `transformer-pde list`)")
    kind = raw["kind"]
    if not isinstance(kind, str):
        raise ValueError(f"config key 'kind' must be a string naming one experiment kind (see `transformer-pde list`), "
                         f"got {kind!r} ({type(kind).__name__})")
    if not isinstance(raw.get("description", ""), str):
        raise ValueError(f"config key 'description' must be a string, got {type(raw['description']).__name__}")
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
    if len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
        raise ValueError(f"run name {name[:40]!r}... is {len(name.encode('utf-8', 'surrogateescape'))} bytes long; "
                         f"file systems allow at most {_NAME_MAX}: give a shorter --name")
    return name


_NAME_MAX = 255  # bytes of one file name on the usual file systems (ext4, xfs, btrfs, APFS, NTFS)
DEFAULT_MAX_STEPS = 10**8  # solver steps of one run (all its pieces) without --max-steps


def check_out_dir(out, flag: str = "--out") -> Path:
    """``out`` as a Path when it is (or can be created as) a writable folder; ValueError (one sentence, with the fix)
    otherwise.  Nothing is created."""
    out = Path(out)
    for part in out.parts:
        if len(part.encode("utf-8", "surrogateescape")) > _NAME_MAX:
            raise ValueError(f"{flag} {str(out)[:60]}...: the folder name {part[:30]!r}... is longer than "
                             f"{_NAME_MAX} bytes; choose a shorter {flag}")
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{flag} {out} is a file, not a folder; give a folder for the run directories")
        existing = out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {out}: cannot write in {existing} (permission denied); choose a writable {flag}")
        if not existing.is_dir():
            raise ValueError(f"{flag} {out}: {existing} is not a folder; choose another {flag}")
    except OSError as e:
        raise ValueError(f"{flag} {out}: cannot be looked up ({e.strerror or e}); choose another {flag}") from None
    return out


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def parse_size(text) -> int:
    """Bytes of a size such as ``"512M"``, ``"8G"``, ``"1.5T"``, ``"4096"`` (K/M/G/T/P are powers of 1024; an
    optional trailing "B"/"iB").  ValueError for anything else."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    t = str(text).strip().upper().replace("IB", "").rstrip("B") if isinstance(text, str) else ""
    unit = t[-1] if t and t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        v = float(num) * _UNITS[unit]
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v >= 1):
        raise ValueError(f"size {text!r} is not a size; give bytes with an optional K/M/G/T suffix, e.g. 16G")
    return int(v)


def _fmt_bytes(v: float) -> str:
    for unit in ("P", "T", "G", "M", "K"):
        if v >= _UNITS[unit]:
            return f"{v / _UNITS[unit]:.3g}{unit}"
    return f"{v:.0f}B"


def memory_limit() -> int:
    """The default memory limit of a run: the physical memory of this machine (2⁶² when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 2**62


def check_resources(cfg: Dict[str, Any], *, max_memory=None, max_steps=None) -> Dict[str, Any]:
    """Refuse (ValueError, with the estimate and the flag that raises the limit) a run whose estimated memory
    (:func:`transformer_pde.application.studies.estimate_resources`) is above ``max_memory`` bytes (default: the physical
    memory, :func:`memory_limit`) or whose step count is above ``max_steps`` (default :data:`DEFAULT_MAX_STEPS`);
    returns the estimate.  Runs before anything is allocated or written."""
    est = estimate_resources(cfg["kind"], cfg["params"])
    mem_lim = memory_limit() if max_memory is None else parse_size(max_memory)
    step_lim = DEFAULT_MAX_STEPS if max_steps is None else max_steps
    if isinstance(step_lim, bool) or not isinstance(step_lim, int) or step_lim < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {step_lim!r}")
    name = cfg.get("name", cfg["kind"])
    mem, steps = float(est["memory"]), float(est["steps"])
    if not math.isfinite(steps) or steps > step_lim:
        raise ValueError(f"run {name!r} would take about {steps:.3g} solver steps ({est['detail']}), above the limit "
                         f"{step_lim:.3g} (--max-steps); raise dt or lower t1, or pass --max-steps "
                         f"{int(steps) + 1 if math.isfinite(steps) else 'N'} to run it anyway")
    if not math.isfinite(mem) or mem > mem_lim:
        what = "the physical memory of this machine" if max_memory is None else "--max-memory"
        raise ValueError(f"run {name!r} would need about {_fmt_bytes(mem) if math.isfinite(mem) else 'unbounded'} of "
                         f"memory ({est['detail']}), above the limit {_fmt_bytes(mem_lim)} ({what}); make the largest "
                         f"term smaller, or pass --max-memory "
                         f"{_fmt_bytes(mem * 1.25) if math.isfinite(mem) else 'SIZE'} to run it anyway")
    return est


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


def check_no_links(run_path: Path) -> None:
    """ValueError naming the first symbolic link, hard-linked file (more than one name) or special file inside
    ``run_path``: a run directory holds only what the program wrote there, and a resume never writes through a
    link it did not create (a link could point anywhere outside the run)."""
    fix = ("remove it (the run directory may only hold files the run wrote) and resume again, or start afresh with "
           "--overwrite or --name NEW")
    for root, dirs, files in os.walk(run_path, followlinks=False):
        for entry in sorted(dirs + files):
            p = Path(root) / entry
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise ValueError(f"cannot resume {run_path}: {p} is a symbolic link (to {os.readlink(p)}); {fix}")
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise ValueError(f"cannot resume {run_path}: {p} is a hard link ({st.st_nlink} names for one file, "
                                 f"possibly outside the run); {fix}")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise ValueError(f"cannot resume {run_path}: {p} is not a regular file or folder; {fix}")


def _check_stored(run_path: Path) -> None:
    """ValueError naming the file when environment.json is unreadable, or a finished segment (data/*.pt) or a
    checkpoint (checkpoints/*.ckpt) is unreadable or holds NaN/inf: a resume never builds on a damaged piece."""
    env = run_path / "environment.json"
    if env.exists():
        try:
            ok = isinstance(json.loads(env.read_text(encoding="utf-8")), dict)
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
    marker = _read_marker(run_path) if real_dir else None
    if marker is None and real_dir and check_lock:  # perhaps a run creating it right now
        _wait_for_creator(run_path)
        marker = _read_marker(run_path)
    locked, pid = _lock_holder(run_path) if check_lock and real_dir else (False, None)
    if locked:
        raise RunLockedError(run_path, pid)
    if marker is None:
        raise _not_ours(run_path)
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
            raise ValueError(f"run directory {run_path} exists and is complete (results in "
                             f"{run_path / 'metrics.json'} and {run_path / 'figures'}), so --resume has nothing to "
                             f"continue; pass --overwrite to run it again, or --name NEW to keep it and start another "
                             f"run")
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
    if not check_lock:
        _check_stored(run_path)
    return "resume"


def _is_complete(run_path: Path) -> bool:
    """Whether the run in ``run_path`` finished: status.json says "complete" and metrics.json is a JSON object."""
    try:
        status = json.loads((run_path / "status.json").read_text(encoding="utf-8"))
        metrics = json.loads((run_path / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(status, dict) and status.get("state") == "complete" and isinstance(metrics, dict)


class _RunLock:
    """Exclusive lock on ``run_path/.lock`` (fcntl.flock; msvcrt on Windows) with the holder's PID inside."""

    def __init__(self, run_path: Path):
        self.path = Path(run_path) / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self) -> "_RunLock":
        """Take the lock (RunLockedError when a live run holds it); the file is not changed: :meth:`claim` writes
        this process's PID once every check has passed, so a refused run leaves the directory as it found it."""
        flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:  # a symlink (ELOOP) or another non-file in place of the lock
            raise ValueError(f"{self.path} is not a plain lock file ({e.strerror or e}); remove it and run "
                             f"again") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                raise ValueError(f"{self.path} is a hard link or not a regular file; a lock file is never shared: "
                                 f"remove it and run again")
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
        self.fd = fd
        return self

    def claim(self) -> None:
        """Write this process's PID into the held lock file (what a refused second run reports)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0) if hasattr(os, "pwrite") else os.write(
            self.fd, f"{os.getpid()}\n".encode())
        self.claimed = True

    def release(self) -> None:
        if self.fd is not None:
            if getattr(self, "claimed", False):
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
    from .. import __version__

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
        _wait_for_creator(run_path)
        locked, pid = _lock_holder(run_path)
        if locked:  # a run that is being created or running right now
            raise RunLockedError(run_path, pid)
        if not is_run_dir(run_path):  # ours before we touch it (not even the lock file is created)
            raise _not_ours(run_path)
    lock = _RunLock(run_path).acquire()
    try:
        if created:
            lock.claim()
            _write_marker(run_path, cfg)
            return lock, False
        action = _check_existing(run_path, cfg, resume=resume, overwrite=overwrite, replace_kind=replace_kind,
                                 check_lock=False)  # we hold it
        lock.claim()
        if action == "overwrite":
            logger.info("overwriting run directory %s", run_path)
            _empty_run_dir(run_path)
            _write_marker(run_path, cfg)
        else:
            _remove_stale_temps(run_path)
        return lock, action == "resume"
    except BaseException:
        lock.release()
        raise


# the temporary files of an atomic write: ``.<name>.<pid>.<hex>.tmp`` (:func:`_new_temp`) and a solver checkpoint's
# ``<name>.<random>.tmp`` (``tempfile.mkstemp`` next to checkpoints/<tag>.ckpt)
_TEMP_NAMES = (re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$"), re.compile(r"^.+\.ckpt\.[A-Za-z0-9_]+\.tmp$"))


def _remove_stale_temps(run_path: Path) -> List[Path]:
    """Delete the temporary files an earlier process of this run left behind when it was killed in the middle of
    a write (kill -9, power loss).  Called under the run's lock, before the run writes anything: no live process
    of this run is writing then, so every such file is stale.  Only regular files of the temporary-file names are
    removed; returns them."""
    gone = []
    for root, _dirs, files in os.walk(run_path, followlinks=False):
        for name in files:
            p = Path(root) / name
            if any(r.match(name) for r in _TEMP_NAMES) and stat.S_ISREG(os.lstat(p).st_mode):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    gone.append(p)
    if gone:
        logger.info("removed %d temporary file(s) left by an interrupted write: %s", len(gone),
                    ", ".join(str(g.relative_to(run_path)) for g in gone[:5]))
    return gone


def _remove_empty(folders) -> None:
    for f in folders:  # innermost first; only empty folders this process created
        with contextlib.suppress(OSError):
            os.rmdir(f)


def _wait_for_creator(run_path: Path, timeout: float = 2.0) -> None:
    """A folder holding nothing (or only an unlocked lock file) may be being created by a concurrent run (it
    makes the folder, then takes its lock, then writes its marker): wait up to ``timeout`` seconds for that lock
    or marker, so that the refusal names the live run instead of calling the folder foreign."""
    deadline = time.monotonic() + timeout
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            if {e.name for e in os.scandir(run_path)} - {LOCK_FILE} or _lock_holder(run_path)[0]:
                return
            time.sleep(0.01)


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


DirLock = _RunLock  # the sweep directory's lock (sweep.py)
sigterm_as_interrupt = _sigterm_as_interrupt


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
        with _sigterm_as_interrupt():
            return _run_study(cfg, run_path, resumed=resumed, resume=resume, progress=progress,
                              step_callback=step_callback)
    finally:
        lock.release()


def _nonfinite_to_null(metrics) -> Tuple[Any, List[str]]:
    """(metrics with every NaN/±inf float replaced by None, the dotted keys replaced); tensors become lists."""
    plain = json.loads(json.dumps(metrics, default=_json_default))  # json reads back NaN/Infinity as floats
    bad: List[str] = []

    def clean(v, key):
        if isinstance(v, dict):
            return {k: clean(u, f"{key}{k}.") for k, u in v.items()}
        if isinstance(v, list):
            return [clean(u, f"{key}{i}.") for i, u in enumerate(v)]
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(key[:-1])
            return None
        return v

    return clean(plain, ""), bad


def failed_run_dir(exc: BaseException) -> Optional[Path]:
    """The run directory when ``exc`` was raised while a study ran (after its directory was written), None when it
    was raised before anything was written (a refused config, name, folder or resource estimate)."""
    return getattr(exc, "transformer_pde_run_dir", None)


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
    metrics, undefined = _nonfinite_to_null({**(metrics or {}), "wall_time_s": wall})
    if undefined:
        metrics["undefined_metrics"] = {
            "keys": undefined, "reason": "NaN or infinite for this run (a statistic undefined for these parameters, "
                                         "e.g. a correlation of constant values); written as null"}
        logger.warning("%s: %d metric(s) undefined for this run, written as null: %s", cfg["name"], len(undefined),
                       ", ".join(undefined[:5]))
    run.write_json("metrics.json", metrics, sort_keys=False)  # the study's own order (e.g. a ladder's rungs)
    flat = flatten_metrics(json.loads(json.dumps(metrics, default=_json_default)))
    write_csv(run.path / "metrics.csv", [["key", "value"], *flat.items()])
    run.write_json("status.json", {"state": "complete", "wall_time_s": wall})
    logger.info("%s complete in %.1f s", cfg["name"], wall)
    return run_path
