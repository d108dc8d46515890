"""The run directory's files: atomic writes, the marker, metrics, series, figures and tensors.

Every file is written to a new temporary file, created exclusively (``O_CREAT | O_EXCL |
O_NOFOLLOW``, never through an existing link), and moved into place with ``os.replace``, so a
killed run never leaves a half-written file behind (:func:`atomic_file`).  A directory is ours when
it carries the marker (:data:`MARKER`, :func:`is_run_dir`); :class:`RunDir` is what studies write
through.  The layout is described in :mod:`transformer_pde.application.runs`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import platform
import re
import secrets
import shlex
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..utils.validation import write_error

__all__ = ["RunDir", "MARKER", "atomic_write_text", "flatten_metrics", "is_run_dir", "package_versions"]

# shared with runs and sweep (named internal API)
__internal__ = ["atomic_file", "write_csv", "write_figure", "json_default", "to_list", "read_marker", "not_ours",
                "write_marker", "check_no_links", "remove_stale_temps", "nonfinite_to_null", "loads_json",
                "config_stamp", "STAMP_KEY"]

logger = logging.getLogger(__name__)

MARKER = ".transformer-pde-run"
_MARKER_FORMAT = 1


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: the key under which every finished piece (data/*.pt) records the run configuration it was computed with
STAMP_KEY = "run_config"


def loads_json(text: str, where: str = "the file"):
    """``json.loads(text)``; a document nested too deeply for the parser (a damaged or planted file) is a
    ValueError naming ``where``, like any other unreadable JSON, never a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} nests its JSON too deeply to be read (a damaged file)") from None


def config_stamp(cfg) -> Optional[str]:
    """The run configuration a finished piece is stamped with: the JSON text of its kind and parameters (None
    for a folder without a config, such as an example's output)."""
    if not isinstance(cfg, dict) or "params" not in cfg:
        return None
    return json.dumps({"kind": cfg.get("kind"), "params": cfg["params"]}, sort_keys=True, default=json_default)


def _stamp_diff(old: str, new: str) -> str:
    """'key: old -> new' for the parameters that differ between two stamps."""
    try:
        a, b = loads_json(old), loads_json(new)
        pa, pb = a.get("params", {}), b.get("params", {})
        keys = ([("kind", a.get("kind"), b.get("kind"))] if a.get("kind") != b.get("kind") else []) + [
            (k, pa.get(k, "(absent)"), pb.get(k, "(absent)")) for k in sorted(set(pa) | set(pb))
            if pa.get(k, "(absent)") != pb.get(k, "(absent)")]
    except (ValueError, AttributeError, TypeError):
        return "an unreadable configuration"
    return "; ".join(f"{k}: {x!r} -> {y!r}" for k, x, y in keys[:6]) + ("; ..." if len(keys) > 6 else "")


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
def atomic_file(path, mode: str = "wb"):
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
    with atomic_file(path, "w") as f:
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
        with atomic_file(p) as f:
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
                 step_callback: Optional[Callable[[str, int, float], None]] = None, config=None):
        self.path = Path(path)
        self.progress = progress
        self.resume = resume
        self.step_callback = step_callback
        self.stamp = config_stamp(config)
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
            raise not_ours(path)
        if not is_run_dir(path):
            path.mkdir(parents=True, exist_ok=True)
            write_marker(path, {"kind": kind, "name": path.name})
        return cls(path, progress=progress)

    def checkpoint_path(self, tag: str) -> Path:
        return self.path / "checkpoints" / f"{tag}.ckpt"

    def data_path(self, tag: str) -> Path:
        return self.path / "data" / f"{tag}.pt"

    def save_tensors(self, tag: str, obj) -> Path:
        """torch.save(obj) to data/<tag>.pt atomically (tmp + os.replace); a dict is stamped with the run's
        configuration (:data:`STAMP_KEY`), which :meth:`load_tensors` checks."""
        p = self.data_path(tag)
        if isinstance(obj, dict) and self.stamp is not None:
            obj = {**obj, STAMP_KEY: self.stamp}
        with atomic_file(p) as f:
            torch.save(obj, f)
        return p

    def load_tensors(self, tag: str):
        """The object saved under ``tag``, or None when there is none; ValueError when unreadable, or when its
        configuration stamp differs from this run's (a piece copied in from another run).  A piece without a
        stamp (an earlier version's) is returned as it is, for the study's own checks."""
        p = self.data_path(tag)
        if not p.exists():
            return None
        try:
            obj = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(f"{p} is corrupted or unreadable ({type(e).__name__}: {e}); delete it to recompute "
                             f"that part of the run") from None
        if self.stamp is not None and isinstance(obj, dict):
            stamp = obj.pop(STAMP_KEY, None)  # None: a piece of an earlier version, left to the study's own checks
            if stamp is not None and stamp != self.stamp:
                raise ValueError(f"{p} was computed by a run with another configuration ({_stamp_diff(stamp, self.stamp)}"
                                 f" [its -> this run's]); it is not this run's result: delete it to recompute that "
                                 f"part, or resume the run it came from")
        return obj

    def write_json(self, name: str, obj, *, sort_keys: bool = True) -> Path:
        """Write ``obj`` as JSON atomically; ValueError if it holds NaN/inf (``allow_nan=False``: a JSON file
        never carries the non-standard NaN/Infinity tokens).  ``sort_keys=False`` keeps the objects' own key
        order (metrics.json: a study's entries in the order it lists them)."""
        p = self.path / name
        atomic_write_text(p, json.dumps(obj, indent=2, sort_keys=sort_keys, default=json_default, allow_nan=False)
                          + "\n")
        return p

    def read_json(self, name: str):
        p = self.path / name
        return loads_json(p.read_text(), str(p)) if p.exists() else None

    def save_series(self, name: str, columns: Dict[str, Any]) -> Path:
        """Write columns (1-D tensors/arrays/lists of equal length) as series/<name>.csv."""
        cols = {k: to_list(v) for k, v in columns.items()}
        lengths = {len(v) for v in cols.values()}
        if len(lengths) != 1:
            raise ValueError(f"series {name!r}: columns have different lengths {sorted(lengths)}")
        p = self.path / "series" / f"{name}.csv"
        write_csv(p, [list(cols), *zip(*cols.values())])
        return p

    def save_figure(self, fig, name: str, formats: Sequence[str] = ("png", "pdf")) -> list:
        """Write figures/<name>.<format> for each format; one log line per figure, so that a study's figures
        phase (seconds per figure) is never silent."""
        t0 = time.perf_counter()
        out = write_figure(fig, self.path / "figures", name, formats)
        logger.info("[figures] %s (%s) written in %.1f s", name, ", ".join(formats), time.perf_counter() - t0)
        return out


def to_list(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().reshape(-1).tolist()
    if hasattr(v, "tolist"):
        return list(v.reshape(-1).tolist())
    return list(v)


def json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # tensors, numpy arrays and scalars
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")



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


def read_marker(path: Path) -> Optional[Dict[str, Any]]:
    m = Path(path) / MARKER
    if m.is_symlink() or not m.is_file():
        return None
    try:
        obj = loads_json(m.read_text(), str(m))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("transformer_pde_run") is True else None


def is_run_dir(path) -> bool:
    """True when ``path`` is a real directory (not a symlink) carrying a valid run marker."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and read_marker(path) is not None


def not_ours(path: Path) -> ValueError:
    return ValueError(
        f"{path} exists but is not a transformer-pde run directory (no {MARKER} marker); it is left untouched. "
        f"Choose another --name or --out (or, if it is a run made by an older version, adopt it with: "
        f"echo '{{\"transformer_pde_run\": true}}' > {shlex.quote(str(path / MARKER))})")



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


def write_marker(run_path: Path, cfg) -> None:
    from .. import __version__

    atomic_write_text(run_path / MARKER, json.dumps({
        "transformer_pde_run": True, "format": _MARKER_FORMAT, "kind": cfg["kind"], "name": cfg["name"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "created_by": f"transformer_pde {__version__}",
        "pid": os.getpid()}, indent=2, sort_keys=True) + "\n")



# ``<name>.<random>.tmp`` (``tempfile.mkstemp`` next to checkpoints/<tag>.ckpt)
TEMP_NAMES = (re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$"), re.compile(r"^.+\.ckpt\.[A-Za-z0-9_]+\.tmp$"))


def remove_stale_temps(run_path: Path) -> List[Path]:
    """Delete the temporary files an earlier process of this run left behind when it was killed in the middle of
    a write (kill -9, power loss).  Called under the run's lock, before the run writes anything: no live process
    of this run is writing then, so every such file is stale.  Only regular files of the temporary-file names are
    removed; returns them."""
    gone = []
    for root, _dirs, files in os.walk(run_path, followlinks=False):
        for name in files:
            p = Path(root) / name
            if any(r.match(name) for r in TEMP_NAMES) and stat.S_ISREG(os.lstat(p).st_mode):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    gone.append(p)
    if gone:
        logger.info("removed %d temporary file(s) left by an interrupted write: %s", len(gone),
                    ", ".join(str(g.relative_to(run_path)) for g in gone[:5]))
    return gone



def nonfinite_to_null(metrics) -> Tuple[Any, List[str]]:
    """(metrics with every NaN/±inf float replaced by None, the dotted keys replaced); tensors become lists."""
    plain = json.loads(json.dumps(metrics, default=json_default))  # json reads back NaN/Infinity as floats
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

