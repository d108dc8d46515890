"""Registry of experiment kinds ("studies") that ``transformer-pde run CONFIG`` can execute.

A study is a function ``fn(params: dict, run: RunDir) -> dict`` registered with
:func:`study`, together with the schema of its parameters.  Config files (TOML) name the
study in ``kind`` and give its parameters in ``[params]``; unknown keys or invalid values
are refused with the key and the allowed values before anything runs.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["Option", "Study", "study", "get_study", "available", "validate_params", "SEED_MAX"]

SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class Option:
    """One parameter of a study: default, accepted type(s), optional choices and check.

    check(value) returns None when the value is fine, else a short description of what is allowed.

    Checks every option gets, whatever its ``check``: floats (alone or in a list) must be finite
    (``inf``/``nan`` are refused); keys named ``seed`` or ending in ``_seed`` are random seeds and
    must be integers in [0, 2³² − 1] (what numpy and torch generators accept).
    """

    default: Any
    types: Tuple[type, ...]
    help: str = ""
    choices: Optional[Tuple[Any, ...]] = None
    check: Optional[Callable[[Any], Optional[str]]] = None

    def validate(self, key: str, value: Any) -> Any:
        if float in self.types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            names = " or ".join(t.__name__ for t in self.types)
            raise ValueError(f"config key '{key}' must be {names}, got {value!r} ({type(value).__name__})")
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ValueError(f"config key '{key}' = {value!r} is not a finite number; give a finite value "
                             f"(e.g. -o {key}=1.0)")
        if (key == "seed" or key.endswith("_seed")) and isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value <= SEED_MAX:
                raise ValueError(f"config key '{key}' = {value!r} is not a valid random seed; give an integer in "
                                 f"[0, {SEED_MAX}]")
        if self.choices is not None:
            items = value if isinstance(value, list) else [value]
            bad = [v for v in items if v not in self.choices]
            if bad:
                raise ValueError(
                    f"config key '{key}' has value {bad[0]!r}; allowed values: {', '.join(map(repr, self.choices))}"
                )
        if self.check is not None:
            msg = self.check(value)
            if msg:
                raise ValueError(f"config key '{key}' = {value!r} is invalid: {msg}")
        return value


@dataclass(frozen=True)
class Study:
    kind: str
    fn: Callable
    options: Dict[str, Option]
    description: str


_REGISTRY: Dict[str, Study] = {}
# modules that register studies; imported lazily so `import transformer_pde` stays light
_MODULES = ["transformer_pde.studies.demo", "transformer_pde.studies.paper", "transformer_pde.studies.theory", "transformer_pde.studies.jko",
            "transformer_pde.studies.clustering", "transformer_pde.studies.causal"]


def study(kind: str, options: Dict[str, Option], description: str = ""):
    """Decorator registering ``fn(params, run) -> metrics`` as the study ``kind``."""

    def deco(fn):
        _REGISTRY[kind] = Study(kind, fn, dict(options), description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def _load_all():
    for mod in _MODULES:
        importlib.import_module(mod)


def available() -> Dict[str, Study]:
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def get_study(kind) -> Study:
    _load_all()
    if kind not in _REGISTRY:
        raise ValueError(f"unknown experiment kind {kind!r}; allowed values: {', '.join(map(repr, sorted(_REGISTRY)))}")
    return _REGISTRY[kind]


def validate_params(kind: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """Resolve params against the study's schema: defaults filled in, every value checked."""
    st = get_study(kind)
    unknown = sorted(set(params) - set(st.options))
    if unknown:
        raise ValueError(
            f"unknown config key '{unknown[0]}' for kind {kind!r}; allowed keys: {', '.join(sorted(st.options))}"
        )
    out = {}
    for key, opt in st.options.items():
        out[key] = opt.validate(key, params[key]) if key in params else opt.default
    return out


def positive(v):
    vals = v if isinstance(v, list) else [v]
    return None if all(x > 0 for x in vals) else "must be > 0"


def nonnegative(v):
    vals = v if isinstance(v, list) else [v]
    return None if all(x >= 0 for x in vals) else "must be >= 0"
