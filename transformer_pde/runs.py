"""Run directories: resolved config, package versions, seeds, metrics, figures, checkpoints.

Layout of ``runs/<name>/``::

    config.json        the resolved config (defaults filled in, overrides applied)
    environment.json   package versions, Python, platform, device, start time (and resume times)
    status.json        "running" / "interrupted" (with the error) / "complete", with the wall time
    metrics.json       the study's numbers (written atomically at the end)
    metrics.csv        the same numbers flattened to key,value rows
    series/*.csv       time series (one column per quantity)
    data/*.pt          recorded tensors of finished pieces of work (torch.save)
    figures/*.png|pdf  figures
    checkpoints/       atomic checkpoints used by --resume

Every file is written to a temporary name first and moved into place with ``os.replace``,
so a killed run never leaves a half-written file behind.  ``--resume`` re-enters the study
with the same resolved config; studies skip the pieces whose results are already in the run
directory and continue a partial piece from its checkpoint.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import torch

from .studies import get_study, validate_params

__all__ = ["RunDir", "load_config", "parse_override", "execute", "package_versions", "atomic_write_text",
           "flatten_metrics"]


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        (self.path / "figures").mkdir(parents=True, exist_ok=True)
        (self.path / "series").mkdir(exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)
        (self.path / "data").mkdir(exist_ok=True)

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
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(list(cols))
        for row in zip(*cols.values()):
            w.writerow([repr(float(v)) if isinstance(v, float) else v for v in row])
        p = self.path / "series" / f"{name}.csv"
        atomic_write_text(p, buf.getvalue())
        return p

    def save_figure(self, fig, name: str, formats: Sequence[str] = ("png", "pdf")) -> list:
        import matplotlib.pyplot as plt

        out = []
        for ext in formats:
            p = self.path / "figures" / f"{name}.{ext}"
            tmp = p.with_name(p.stem + ".tmp." + ext)
            fig.savefig(tmp, dpi=150, bbox_inches="tight")
            os.replace(tmp, p)
            out.append(p)
        plt.close(fig)
        return out


def _to_list(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().reshape(-1).tolist()
    if hasattr(v, "tolist"):
        return list(v.reshape(-1).tolist())
    return list(v)


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.detach().cpu().tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):
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


def load_config(source, overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """Read a TOML config (path or dict) and resolve it: {'kind', 'name', 'params'}."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist; `transformer-pde list` shows the shipped configs")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        default_name = path.stem
    else:
        raw = dict(source)
        default_name = raw.get("kind", "run")
    allowed_top = {"kind", "name", "description", "params"}
    extra = sorted(set(raw) - allowed_top)
    if extra:
        raise ValueError(f"unknown top-level config key '{extra[0]}'; allowed keys: {', '.join(sorted(allowed_top))}")
    if "kind" not in raw:
        raise ValueError("the config needs a top-level 'kind' naming the experiment (see `transformer-pde list`)")
    kind = raw["kind"]
    params = dict(raw.get("params", {}))
    for ov in overrides:
        k, v = parse_override(ov)
        params[k] = v
    resolved = validate_params(kind, params)
    # checks that involve several keys, declared by the study as fn.validate(params)
    check = getattr(get_study(kind).fn, "validate", None)
    if check is not None:
        check(resolved)
    return {"kind": kind, "name": raw.get("name", default_name), "description": raw.get("description", ""),
            "params": resolved}


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


def _device_info() -> Dict[str, Any]:
    info = {"cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def execute(source, *, overrides: Iterable[str] = (), out_dir="runs", name: Optional[str] = None,
            resume: bool = False, progress: bool = True, overwrite: bool = False,
            step_callback: Optional[Callable[[str, int, float], None]] = None) -> Path:
    """Validate the config, prepare the run directory, run the study, write its metrics.

    Args:
        source: TOML path or config dict {"kind", "name", "params"}.
        overrides: "key=value" strings (TOML values) applied to ``params``.
        out_dir, name: the run directory is out_dir/name (name defaults to the config's).
        resume: continue an existing run directory (same resolved config); otherwise an
            existing directory is refused.
        overwrite: delete an existing run directory (one holding a config.json) and start afresh.
        progress: progress bars.  step_callback: see :class:`RunDir`.

    Returns:
        the run directory.

    Raises:
        ValueError for an invalid config (before anything is written) or a run directory
        that exists (without resume) or holds another config; whatever the study raises
        (the status file then says "interrupted" and how to resume).
    """
    cfg = load_config(source, overrides)
    if name is not None:
        cfg["name"] = name
    run_path = Path(out_dir) / cfg["name"]
    cfg_file = run_path / "config.json"
    resumed = False
    if resume and overwrite:
        raise ValueError("choose either --resume (continue the run) or --overwrite (start it afresh), not both")
    if overwrite and run_path.exists():
        if not cfg_file.exists():
            raise ValueError(f"{run_path} exists but is not a run directory (no config.json); not deleting it")
        import shutil

        shutil.rmtree(run_path)
    if run_path.exists() and cfg_file.exists():
        old = json.loads(cfg_file.read_text())
        if not resume:
            raise ValueError(
                f"run directory {run_path} exists; pass --resume to continue it, --overwrite to start it afresh, "
                f"or --name NEW to start another run"
            )
        if old != json.loads(json.dumps(cfg, default=_json_default)):
            raise ValueError(
                f"cannot resume {run_path}: its config differs from this one; use --name NEW for a new run"
            )
        resumed = True
    run = RunDir(run_path, progress=progress, resume=resume, step_callback=step_callback)
    run.write_json("config.json", cfg)
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    env = run.read_json("environment.json") if resumed else None
    if env is None:
        env = package_versions()
        env.update(_device_info())
        env["started"] = now
        env["resumed"] = []
    else:
        env.setdefault("resumed", []).append(now)
    run.write_json("environment.json", env)
    run.write_json("status.json", {"state": "running", "started": now})
    st = get_study(cfg["kind"])
    t0 = time.perf_counter()
    try:
        metrics = st.fn(cfg["params"], run)
    except BaseException as e:
        run.write_json("status.json", {
            "state": "interrupted", "error": f"{type(e).__name__}: {e}",
            "wall_time_s": time.perf_counter() - t0,
            "resume_with": "transformer-pde run CONFIG --resume (same config and overrides)"})
        raise
    wall = time.perf_counter() - t0
    metrics = dict(metrics or {})
    metrics["wall_time_s"] = wall
    run.write_json("metrics.json", metrics)
    flat = flatten_metrics(json.loads(json.dumps(metrics, default=_json_default)))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["key", "value"])
    for k, v in flat.items():
        w.writerow([k, "" if v is None else (repr(v) if isinstance(v, float) else v)])
    atomic_write_text(run.path / "metrics.csv", buf.getvalue())
    run.write_json("status.json", {"state": "complete", "wall_time_s": wall})
    return run_path
