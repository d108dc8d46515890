"""Registry of experiment kinds ("studies") that ``transformer-pde run CONFIG`` can execute.

A study is a function ``fn(params: dict, run: RunDir) -> dict`` registered with
:func:`study`, together with the schema of its parameters (every study takes the floating
``dtype``, :data:`DTYPE`).  Config files (TOML) name the study in ``kind`` and give its
parameters in ``[params]``; unknown keys or invalid values are refused with the key and the
allowed values before anything runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

import transformer_pde as tp
from ...utils.resources import did_you_mean

from .. import plotting

__all__ = ["Option", "Study", "study", "get_study", "available", "validate_params", "SEED_MAX", "INT_MAX",
           "estimate_resources"]
# what the study modules share (named internal API): option checks and options, run set-up, stored pieces, figures
__internal__ = ["positive", "nonnegative", "at_least", "open_unit", "unique_nonempty", "DTYPE", "DEVICE", "dtype_of",
                "check_whole_steps", "check_device", "device_of", "weight_process", "step_callback", "cached",
                "fingerprint", "load_segment", "segment_bar", "SegmentBar", "HEARTBEAT_S", "check_record_every", "nonfinite_keys", "subplots",
                "save_captioned", "panel", "log_ticks",
                "sphere_name", "interrupts_left_to_parent", "spawn_pool"]

_log = logging.getLogger(__name__)

SEED_MAX = 2**32 - 1
INT_MAX = 2**63 - 1  # integers beyond int64 cannot reach torch or numpy


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
        big = [v for v in _leaves(items) if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_MAX]
        if big:
            raise ValueError(f"config key '{key}' = {big[0]} is beyond the 64-bit integer range (|v| <= {INT_MAX}); "
                             f"give a smaller integer")
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ValueError(f"config key '{key}' = {value!r} is not a finite number; give a finite value "
                             f"(e.g. -o {key}=1.0)")
        if (key == "seed" or key.endswith("_seed")) and isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value <= SEED_MAX:
                raise ValueError(f"config key '{key}' = {value!r} is not a valid random seed; give an integer in "
                                 f"[0, {SEED_MAX}]")
        if self.choices is not None:
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


def _leaves(items):
    for v in items:
        if isinstance(v, list):
            yield from _leaves(v)
        else:
            yield v


@dataclass(frozen=True)
class Study:
    kind: str
    fn: Callable
    options: Dict[str, Option]
    description: str


_REGISTRY: Dict[str, Study] = {}
# modules that register studies; imported lazily so `import transformer_pde` stays light
_MODULES = [f"{__name__}.{m}" for m in ("demo", "paper", "theory_energy", "theory_clustering", "jko", "clustering",
                                       "causal", "layernorm", "noisy", "theorems", "training", "pretrained",
                                       "critical_scaling", "repulsive", "lost_in_the_middle", "homogenized")]


def study(kind: str, options: Dict[str, Option], description: str = "", *, validate: Optional[Callable] = None,
          resources: Optional[Callable] = None):
    """Decorator registering ``fn(params, run) -> metrics`` as the study ``kind``.

    ``options`` gets the option ``dtype`` (:data:`DTYPE`) at its end unless it places it itself.
    ``validate(params)``, when given, checks across keys (raises ValueError); it becomes ``fn.validate``, which
    ``config.load_config`` runs before anything is written.  ``resources(params)``, when given, returns the
    study's own estimate ``{"memory": bytes, "steps": solver steps, "detail": str}`` (``fn.resources``);
    otherwise :func:`estimate_resources` estimates from the usual keys.
    """

    def deco(fn):
        if validate is not None:
            fn.validate = validate
        if resources is not None:
            fn.resources = resources
        _REGISTRY[kind] = Study(kind, fn, {**options, "dtype": options.get("dtype", DTYPE)},
                                description or (fn.__doc__ or "").strip().split("\n")[0])
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
    if not isinstance(kind, str):
        raise ValueError(f"the experiment kind must be a string naming one of {', '.join(map(repr, sorted(_REGISTRY)))}, "
                         f"got {kind!r} ({type(kind).__name__}); write e.g. kind = \"demo\"")
    if kind not in _REGISTRY:
        raise ValueError(f"unknown experiment kind {kind!r}{did_you_mean(kind, _REGISTRY)}; allowed values: "
                         f"{', '.join(map(repr, sorted(_REGISTRY)))}")
    return _REGISTRY[kind]


def validate_params(kind: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """Resolve params against the study's schema: defaults filled in, every value checked."""
    st = get_study(kind)
    unknown = sorted(set(params) - set(st.options))
    if unknown:
        raise ValueError(
            f"unknown config key '{unknown[0]}' for kind {kind!r}{did_you_mean(unknown[0], st.options)}; allowed "
            f"keys: {', '.join(sorted(st.options))}"
        )
    return {key: opt.validate(key, params[key]) if key in params else opt.default for key, opt in st.options.items()}


# ---------------------------------------------------------------------------- option checks and options
def positive(v):
    vals = v if isinstance(v, list) else [v]
    return None if all(x > 0 for x in vals) else "must be > 0"


def nonnegative(v):
    vals = v if isinstance(v, list) else [v]
    return None if all(x >= 0 for x in vals) else "must be >= 0"


def at_least(k):
    return lambda v: None if v >= k else f"must be >= {k}"


def open_unit(v):
    return None if 0 < v < 1 else "must lie strictly between 0 and 1"


def unique_nonempty(v):
    if len(v) == 0:
        return "must not be empty"
    if len(set(v)) != len(v):
        return "must not repeat a value"
    return None


DTYPE = Option("float64", (str,), "floating dtype", choices=("float32", "float64"))
DEVICE = Option("auto", (str,), "'auto' = cuda when available, else cpu", choices=("auto", "cpu", "cuda"))


def dtype_of(params: Dict) -> torch.dtype:
    """The torch dtype of a study's validated ``dtype`` option (:data:`DTYPE`: "float32" or "float64").

    Parameters
    ----------
    params : dict
        the study's parameters, after :func:`validate_params`.

    Returns
    -------
    torch.dtype
        torch.float32 or torch.float64."""
    return {"float32": torch.float32, "float64": torch.float64}[params["dtype"]]


# ---------------------------------------------------------------------------- run set-up
def check_whole_steps(p: Dict) -> None:
    """Refuse a final time ``t1`` that is not a whole number of steps ``dt`` (ValueError)."""
    K = round(p["t1"] / p["dt"])
    if K < 1 or abs(K * p["dt"] - p["t1"]) > 1e-9 * max(1.0, p["t1"]):
        raise ValueError(
            f"config keys 't1' = {p['t1']} and 'dt' = {p['dt']}: t1/dt = {p['t1'] / p['dt']:.6g} is not a whole "
            f"number of steps; choose dt = {p['t1'] / max(K, 1):.6g} or another dt that divides t1")


def check_device(p: Dict) -> None:
    """Refuse ``device = "cuda"`` where CUDA is not available (ValueError)."""
    if p["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError("config key 'device' = 'cuda' but CUDA is not available here; allowed values: 'auto', 'cpu'")


def device_of(p: Dict) -> torch.device:
    """The torch device of ``p["device"]``: "auto" is cuda when available, else cpu."""
    if p["device"] == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(p["device"])


def weight_process(regime: str, heads0, *, rate: float = 1.0, sigma: float = 2 ** 0.5, phase: str = "shared",
                   scheme: str = "exact"):
    """Θ_t of a study: "ou" (dA = κ(I − A)dt + σ dW_sym, κ = ``rate``), "oscillating" (dA = (F(t) − A)dt,
    ``phase`` shared | per_head, no noise) or, for any other regime, the constant heads ``heads0``."""
    if regime == "ou":
        return tp.OrnsteinUhlenbeck(heads0, rate=rate, sigma=sigma, scheme=scheme)
    if regime == "oscillating":
        return tp.Oscillating(heads0, phase=phase, scheme=scheme)
    return tp.Constant(heads0)


def step_callback(run, tag: str):
    """The solver callback ``(k, t, ...)`` that reports step k at time t of the piece ``tag`` to
    ``run.step_callback(tag, k, t)``; None when the run directory has no step callback."""
    report = getattr(run, "step_callback", None)
    return None if report is None else (lambda k, t, *_: report(tag, k, t))


# ---------------------------------------------------------------------------- stored pieces
def cached(run, tag: str, compute: Callable[[], Any], log, *, timed: bool = False) -> Any:
    """compute() once per run directory (``data/<tag>.pt``), reused on --resume; progress on the logger ``log``;
    ``timed``: the result (a dict) also holds its wall time in seconds under "wall"."""
    got = run.load_tensors(tag) if run.resume else None
    if got is not None:
        log.info("[%s] already complete, reused from data/", tag)
        return got
    log.info("[%s] running", tag)
    t0 = time.perf_counter()
    out = compute()
    if timed:
        out["wall"] = time.perf_counter() - t0
    log.info("[%s] done in %.1f s", tag, time.perf_counter() - t0)
    run.save_tensors(tag, out)
    return out


def fingerprint(p: Dict, ignore, **ident) -> str:
    """Short hash of ``ident`` and every parameter not in ``ignore`` (the keys that do not change a segment)."""
    blob = json.dumps({**ident, **{k: v for k, v in p.items() if k not in ignore}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def nonfinite_keys(obj, skip=("timing",), prefix: str = "") -> list:
    """Dotted keys of every floating tensor (or float) in a nested dict/list holding NaN or ±inf; the subtrees
    named in ``skip`` (wall times and the like) are not looked at."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in skip:
                out += nonfinite_keys(v, skip, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += nonfinite_keys(v, skip, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and obj.numel() and not bool(torch.isfinite(obj).all()):
            out.append(prefix[:-1])
    elif isinstance(obj, float) and not math.isfinite(obj):
        out.append(prefix[:-1])
    return out


def load_segment(run, tag: str, kind: str, fp: str, required=()) -> Optional[Dict]:
    """The finished segment ``data/<tag>.pt`` of a ``kind`` run, None when there is none or when it lacks one of the
    ``required`` keys (dotted for nested ones: "ledger.dE"; a warning says it is computed again); ValueError when
    the file is not such a segment, was made with another configuration (fingerprint ``fp``) or holds NaN/inf (the
    file is named, with the fix)."""
    seg = run.load_tensors(tag)
    if seg is None:
        return None
    path = run.data_path(tag)
    if not isinstance(seg, dict) or seg.get("kind") != f"transformer_pde.{kind}.segment":
        raise ValueError(f"{path} is not a segment of {'an' if kind[0] in 'aeiou' else 'a'} {kind} "
                         "run; delete it to recompute")
    if seg.get("fingerprint") != fp:
        raise ValueError(f"{path} belongs to a different configuration (fingerprint "
                         f"{seg.get('fingerprint')} != {fp}); delete it or start a new run with --name")
    for key in required:
        node = seg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                _log.warning("%s is incomplete: it has no '%s' (a damaged file, or one written by another version); "
                             "that segment is computed again", path, key)
                return None  # its file is replaced when the segment is done
            node = node[part]
    bad = nonfinite_keys(seg)
    if bad:
        raise ValueError(f"{path} holds NaN/inf in '{bad[0]}' (a damaged file: a finished segment is always finite); "
                         f"delete it to recompute that segment")
    return seg


def check_record_every(p: Dict, *, t_from: float = 0.0, what: str = "") -> None:
    """Refuse a ``record_every`` that leaves fewer than two recorded times in [t_from, t1] (ValueError): a time
    average or a fit over one record is meaningless.  The recorded times are the multiples of record_every·dt."""
    K = round(p["t1"] / p["dt"])
    first = math.ceil(t_from / p["dt"] - 1e-9)
    r = p["record_every"]
    count = K // r - (-(-first // r)) + 1 if K >= first else 0
    if count < 2:
        best = K if first <= 0 else max(1, (K - first) // 2)
        window = f"[{t_from:g}, {p['t1']:g}]" + (f" ({what})" if what else "")
        raise ValueError(f"config key 'record_every' = {r} leaves {max(count, 0)} recorded time(s) in {window}: the "
                         f"horizon t1/dt is {K} steps; choose record_every <= {best}")


#: seconds between two "[tag] step k/K" log lines while a segment runs without a visible progress bar (output
#: redirected to a file, or --no-progress): a log never stays silent for minutes
HEARTBEAT_S = 30.0


class SegmentBar:
    """Progress over a study's segments, weighted by their work (not their count).

    ``work`` gives the cost of each segment in any unit (steps · paths · H · n², say): a list (the segments'
    keys are then 0, 1, ...) or a dict {key: cost}.  The bar's fraction and its ETA are the share of the work
    done, so a cheap first segment does not promise a short run.  Inside a segment, :meth:`steps` gives the
    solver callback that moves the bar step by step and, when the bar is not shown (output not a terminal, or
    progress off), logs a "[tag] step k/K" line every :data:`HEARTBEAT_S` seconds.  ``update(n)`` marks the next
    ``n`` unfinished segments done (skipped or run), ``update(key=k)`` the segment ``k``.  Use it as a context
    manager.
    """

    def __init__(self, run, work, desc: str, unit: str, log=None):
        from tqdm.auto import tqdm

        self.run, self.log, self.unit = run, log, unit
        items = work.items() if isinstance(work, dict) else enumerate(work)
        self.work = {k: max(float(w), 0.0) for k, w in items}
        self.done: set = set()
        self.total = sum(self.work.values()) or 1.0
        fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"
        self.bar = tqdm(total=self.total, desc=desc, bar_format=fmt, smoothing=0.0,
                        disable=None if run.progress else True)
        self._postfix()

    @property
    def shown(self) -> bool:
        """Whether the bar is drawn (on a terminal, progress allowed)."""
        return not self.bar.disable

    @property
    def base(self) -> float:
        """The work of the finished segments."""
        return sum(self.work[k] for k in self.done)

    @property
    def fraction(self) -> float:
        """The share of the work of the finished segments, in [0, 1]."""
        return 1.0 if len(self.done) == len(self.work) else self.base / self.total

    def _next(self):
        return next((k for k in self.work if k not in self.done), None)

    def _postfix(self) -> None:
        if self.shown:
            self.bar.set_postfix_str(f"{self.unit} {min(len(self.done) + 1, len(self.work))}/{len(self.work)}",
                                     refresh=False)

    def _goto(self, position: float) -> None:
        if self.shown and position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def update(self, n: int = 1, *, key=None) -> None:
        for _ in range(n if key is None else 1):
            k = self._next() if key is None else key
            if k is not None:
                self.done.add(k)
        self._postfix()
        self._goto(self.base)

    def steps(self, tag: str, total_steps: int, *, key=None):
        """The solver callback ``(k, t, ...)`` of the running segment ``tag`` (``total_steps`` steps; ``key``: its
        key, default the next unfinished one): moves the bar, logs a heartbeat when the bar is hidden, and reports
        to ``run.step_callback`` (see :func:`step_callback`)."""
        report = step_callback(self.run, tag)
        key = self._next() if key is None else key
        share = self.work.get(key, 0.0)
        K = max(int(total_steps), 1)
        t0 = last = time.monotonic()
        first = []

        def callback(k, t, *rest):
            nonlocal last
            self._goto(self.base + share * min(k, K) / K)
            if not first:
                first.append(k - 1)  # a resumed segment starts at its checkpoint's step
            now = time.monotonic()
            if self.log is not None and not self.shown and now - last >= HEARTBEAT_S:
                last = now
                left = (now - t0) / max(k - first[0], 1) * (K - k)
                self.log.info("[%s] step %d/%d (t = %.4g), %.0f s so far, about %.0f s left", tag, k, K, float(t),
                              now - t0, left)
            if report is not None:
                report(k, t, *rest)

        return callback

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "SegmentBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def segment_bar(run, total: int, desc: str, unit: str, *, work=None, log=None) -> SegmentBar:
    """A :class:`SegmentBar` over a study's ``total`` segments (each of equal work unless ``work`` gives their
    costs, a list or a dict by segment key), shown only on a terminal (never escape codes in a log file) and only when the run allows progress
    bars; ``log``: the logger of its heartbeat lines.  Use it as a context manager."""
    return SegmentBar(run, [1.0] * total if work is None else work, desc, unit, log=log)


# ---------------------------------------------------------------------------- worker processes
@contextlib.contextmanager
def interrupts_left_to_parent():
    """SIGINT ignored (and blocked) in this process while worker processes are spawned inside the ``with``:
    they inherit the disposition through exec, so they ignore Ctrl-C from their first instruction on (also
    while they import torch).  Ctrl-C at a terminal reaches the whole process group; answered by the parent
    alone, it prints one resume hint instead of a traceback per worker, and the parent stops the workers."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    # SIGINT also blocked meanwhile: the threads started inside (a pool's task, result and worker handlers)
    # inherit the mask, so the kernel delivers Ctrl-C to the main thread, the one that raises KeyboardInterrupt,
    # and wakes it from its wait on the workers' results; a Ctrl-C pressed inside stays pending until the end
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if main and hasattr(signal, "pthread_sigmask") \
        else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def spawn_pool(processes: int, initializer=None):
    """A ``multiprocessing`` pool of ``processes`` spawned workers (no forked torch state) that leave Ctrl-C to
    this process (:func:`interrupts_left_to_parent`); use it as a context manager (it terminates the workers)."""
    import multiprocessing

    with interrupts_left_to_parent():
        return multiprocessing.get_context("spawn").Pool(processes, initializer=initializer)


# ---------------------------------------------------------------------------- figures
subplots = plotting.subplots  # an Agg figure and its axes, no pyplot state
panel = plotting.panel  # axis labels, title and legend of one panel


def save_captioned(run, fig, name: str, caption: str, metrics: Dict, *, tidy: bool = False) -> None:
    """Write ``caption`` under the figure, record it in ``metrics["figure_captions"][name]`` and save
    figures/<name>.png and .pdf; ``tidy``: first move the legends under their axes and lay the figure out
    (``plotting.finish_figure``)."""
    (plotting.finish_figure if tidy else plotting.add_caption)(fig, caption)
    metrics.setdefault("figure_captions", {})[name] = caption
    run.save_figure(fig, name)


def log_ticks(ax, values) -> None:
    """Tick a log x axis at the data values only (plain numbers): no crowded minor labels."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter, NullLocator

    a = ax.xaxis
    vals = sorted(set(float(v) for v in values))
    a.set_major_locator(FixedLocator(vals))
    a.set_major_formatter(FixedFormatter([f"{v:g}" for v in vals]))
    a.set_minor_locator(NullLocator())
    a.set_minor_formatter(NullFormatter())


_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def sphere_name(d: int) -> str:
    """The sphere S^{d-1} of R^d as plain text with a superscript digit (S¹, S², S⁷, S¹⁵): right in figures, log lines
    and captions alike, where TeX markup would be drawn literally."""
    return "S" + str(int(d) - 1).translate(_SUPERSCRIPT)


# ---------------------------------------------------------------------------- resource estimates
_STEP_PAIRS = (("t1", "dt"), ("flat_t1", "flat_dt"), ("t1", "ref_dt"), ("n_t1", "n_tau"), ("t1", "eps_tau"))
_TOKEN_KEYS = ("n", "n_sweep", "hetero_n", "equi_n", "phi_n", "random_n", "grid")
_PIECE_KEYS = ("regimes", "heads", "n", "d", "n_sweep", "taus", "eps_sweep", "epsilons", "random_n", "random_d")


def _biggest(p: Dict, keys, default=1):
    vals = []
    for k in keys:
        v = p.get(k)
        vals += [x for x in _leaves(v if isinstance(v, list) else [v])
                 if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return max(vals) if vals else default


def _count(v) -> int:
    return len(v) if isinstance(v, list) and v else 1


def estimate_resources(kind: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """Rough upper estimate of what a run of ``kind`` with the resolved ``params`` needs, before anything is
    allocated: ``{"memory": bytes, "steps": solver steps over all its pieces, "detail": str}``.

    The study's own ``resources`` hook (:func:`study`) is used when it has one; otherwise the estimate reads the
    usual keys: tokens n, dimension d, heads H, paths × systems × len(betas) as the batch B, the horizon t1/dt
    (and flat_t1/flat_dt, t1/ref_dt, ...), record_every and bootstrap::

        memory ≈ itemsize · (records·B·n·d  [recorded tokens] + 4·B·H·n²  [kernel blocks]
                             + 2·B·H·d²  [heads, noise] + 16·records·B  [scalar series])
                 + 16 · bootstrap · B · len(heads)  [bootstrap arrays]
        steps  ≈ max(t1/dt, ...) · (number of pieces: regimes × heads × ... lists)

    It is an order of magnitude (what the CLI's --max-memory / --max-steps compare against), not a measurement.
    """
    st = get_study(kind)
    own = getattr(st.fn, "resources", None)
    if own is not None:
        return own(params)
    p = params
    item = 4 if p.get("dtype") == "float32" else 8
    n = _biggest(p, _TOKEN_KEYS)
    d = _biggest(p, ("d", "random_d"), 3)
    H = _biggest(p, ("heads",))
    batch = _biggest(p, ("paths",)) * _biggest(p, ("systems", "ensemble", "configs")) * _count(p.get("betas"))
    per_piece = 1.0
    for t_key, dt_key in _STEP_PAIRS:
        t, dt = p.get(t_key), p.get(dt_key)
        if isinstance(t, (int, float)) and isinstance(dt, (int, float)) and dt > 0:
            per_piece = max(per_piece, float(t) / float(dt))
    pieces = 1
    for k in _PIECE_KEYS:
        pieces *= _count(p.get(k))
    steps = per_piece * pieces
    every = p.get("record_every")
    records = per_piece / every + 2 if isinstance(every, int) and every > 0 else min(per_piece, 1e4) + 1
    boot = p.get("bootstrap")
    terms = {"recorded tokens (raise record_every, lower n or paths)": item * records * batch * n * d,
             "kernel blocks (lower n, heads or paths)": item * 4.0 * batch * H * n * n,
             "heads and noise (lower heads, d or paths)": item * 2.0 * batch * H * d * d,
             "scalar series (raise record_every)": item * 16.0 * records * batch,
             "bootstrap arrays (lower bootstrap)": 16.0 * boot * batch * _count(p.get("heads"))
             if isinstance(boot, int) and not isinstance(boot, bool) and boot > 0 else 0.0}
    memory = sum(terms.values())
    largest = max(terms, key=terms.get)
    detail = (f"n = {n:g} tokens, d = {d:g}, H = {H:g} heads, batch {batch:g} (paths × systems), "
              f"{records:.3g} records, {per_piece:.3g} steps per piece × {pieces} pieces; largest term: {largest}")
    return {"memory": memory, "steps": steps, "detail": detail, "terms": terms}
