"""A run's config: reading and resolving it, overrides, the run name, the output folder, the resource limits.

:func:`load_config` is the one config parser of the command line, the runs and the sweeps: the
file is read by :func:`transformer_pde.utils.resources.load_toml` (bounded, regular files only,
UTF-8 TOML, every refusal a ValueError with the fix), then checked against the study's declared
parameters.  Everything here runs before anything is written.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable

from ..utils.resources import CONFIG_MAX_BYTES, check_nesting, did_you_mean, load_toml, loads_toml, tomllib
from .studies import estimate_resources, get_study, validate_params

__all__ = ["load_config", "parse_override", "check_run_name", "check_resources", "parse_size", "memory_limit",
           "DEFAULT_MAX_STEPS", "CONFIG_MAX_BYTES"]

# shared with runs and sweep (named internal API)
__internal__ = ["check_out_dir"]

def parse_override(text: str):
    """'key=value' with a TOML value (numbers, booleans, lists, quoted or bare strings)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value (e.g. n=100 or heads=[1,10])")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("params."):
        key = key[len("params."):]
    try:
        value = loads_toml(f"v = {raw}", where=f"override {key[:40]}=...")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value



def load_config(source, overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """Read a TOML config (path or dict) and resolve it: {'kind', 'name', 'params'}.

    Raises
    ------
    ValueError
        a missing, unreadable, binary or non-TOML file; an unknown kind or key; a value
        of the wrong type, outside its choices or not finite (each names the key and the fix).
    """
    if isinstance(source, (str, Path)):
        raw, default_name = load_toml(Path(source)), Path(source).stem
    elif isinstance(source, dict):
        check_nesting(source, "the config")
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


