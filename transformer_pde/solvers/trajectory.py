"""The result of every solver (:class:`Trajectory`) and the errors they raise on NaN/inf.

* :class:`Trajectory` — recorded times, tokens, energy, 𝒢², 𝒟, the ledger (docs/model.md#ledger),
  the step statistics and the batch-axis convention (``paths``, :meth:`Trajectory.with_paths`);
* :class:`NonFiniteError` and :func:`nonfinite_error` / :func:`ledger_nonfinite` — the message
  names the time, the step, the quantity and the fix;
* :func:`check_finite`, :func:`check_ledger` — the solvers' finiteness checks;
* :class:`LazySeries` and :func:`lazy_series` — energy, 𝒢², 𝒟 computed on their first read from a
  source (the records of a solve, :mod:`~transformer_pde.solvers.recorded`), once.

Lazy diagnostics.  A solver may give, instead of the three tensors energy, slope, dissipation, the
:class:`LazySeries` of :func:`lazy_series` ``(source)``: ``source()`` returns the mapping
{"energy", "slope", "dissipation"} of (T, [paths,] ...) tensors and is called at most once, on the
first read of any of them (then kept).  :meth:`Trajectory.with_paths`, the paths-axis drop and the
other copies share the source, so no copy computes it again; pickling (``torch.save``) computes it
first and stores the tensors.  ``ledger=None`` marks a run solved without the energy ledger: reading
``traj.ledger`` then raises a ValueError that says how to ask for it (``has_ledger`` tells without raising).

Batch axes (docs/solve.md#batch-axes).  Every series is (T, [paths,] *batch, ...): the solvers
always carry a paths axis internally (P = 1 when ``paths=None``) and drop it once, at the end,
when the caller did not ask for paths (:func:`drop_paths`).  ``traj.paths`` says which: None
(no paths axis) or P.  :meth:`Trajectory.with_paths` gives the series with the axis in either
case, so a consumer indexes ``[:, p]`` without branching on ``paths is None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Union

import torch

from ..model.field import FieldEval
from ..model.heads import Heads
from ..model.normalization import normalization as as_normalization
from ..processes.paths import WeightPath

#: the result, its errors, and what a solver of one's own needs (the paths-axis convention, the
#: non-finite check and its error with time, step and fix)
__all__ = ["Trajectory", "NonFiniteError", "PathsAxis", "nonfinite_error", "check_finite"]
#: named internal API (not public), used by the solvers
__internal__ = ["ledger_nonfinite", "check_ledger", "drop_paths", "NoLedgerError", "SERIES_EXTRAS", "LazySeries",
                "lazy_series"]

#: the entries of ``Trajectory.extras`` that are time series (T, [paths,] ...) with the batch axes
SERIES_EXTRAS = ("radius", "kinetic")


class LazySeries:
    """One of energy, slope, dissipation of a :class:`Trajectory`, computed on first read from a shared
    source (module docstring): ``source()[name]`` with the trajectory's axis changes (``transforms``,
    e.g. the paths axis added by :meth:`Trajectory.with_paths`) applied in order."""

    __slots__ = ("source", "name", "transforms")

    def __init__(self, source, name: str, transforms: tuple = ()):
        self.source, self.name, self.transforms = source, name, tuple(transforms)

    def map(self, fn) -> "LazySeries":
        """The same series with ``fn`` applied after the others (nothing is computed)."""
        return LazySeries(self.source, self.name, self.transforms + (fn,))

    def resolve(self) -> Optional[torch.Tensor]:
        """The tensor (the source is computed at most once: it is wrapped by :func:`lazy_series`)."""
        v = self.source()[self.name]
        for fn in self.transforms:
            v = None if v is None else fn(v)
        return v

    def __repr__(self) -> str:
        return f"LazySeries({self.name!r})"


class _Once:
    """A zero-argument callable called at most once; later calls return the first result."""

    def __init__(self, fn):
        self.fn, self.value, self.done = fn, None, False

    def __call__(self):
        if not self.done:
            self.value, self.done = self.fn(), True
            self.fn = None  # the source (records, heads) is released once the series are computed
        return self.value


def lazy_series(source) -> tuple:
    """(energy, slope, dissipation) as :class:`LazySeries` of one source, for ``Trajectory(times, x, *these, ...)``.

    ``source``: a zero-argument callable returning {"energy", "slope", "dissipation"} of (T, ...) tensors
    (:class:`~transformer_pde.solvers.recorded.RecordedDiagnostics`); it is called at most once, on the
    first read of any of the three from the trajectory or any of its copies."""
    if not callable(source):
        raise TypeError(f"lazy_series needs a zero-argument callable source, got {type(source).__name__}")
    once = _Once(source)
    return tuple(LazySeries(once, name) for name in ("energy", "slope", "dissipation"))


_NO_LEDGER = ("this trajectory was solved without the energy ledger: it integrates E, 𝒟, ∂_tE and the Itô terms over "
              "every step, which costs a diagnostics evaluation (its own kernel passes) at every step, up to several "
              "times the tokens-only solve (scripts/benchmark_lazy_diagnostics.py). Pass ledger=True to tp.simulate, or "
              "ledger=tp.LedgerOptions(ledger=True) to tp.solve. The recorded energy, slope and "
              "dissipation are there without it (computed on first read)")


class NonFiniteError(FloatingPointError):
    """A solver produced NaN or inf; the message names the time, the step and the quantity."""


class NoLedgerError(ValueError, AttributeError):
    """``traj.ledger`` of a run solved without the energy ledger: a ValueError naming the option, and an
    AttributeError, so that ``hasattr(traj, "ledger")`` and ``getattr(traj, "ledger", None)`` tell without raising."""


@dataclass
class Trajectory:
    """Result of :func:`simulate` (and :func:`transformer_pde.jko`).

    times: (T,) recorded times.   x: (T, [paths,] ..., n, d) tokens.
    energy, slope (𝒢²), dissipation (𝒟): (T, [paths,] ...); a solver may give them lazily
      (:func:`lazy_series`): they are then computed from the records on the first read of any of them,
      once, with the values the per-step evaluation would have recorded.
    ledger: running terms, each (T, [paths,] ...): "dE" = E(t) − E(0), "partial" = ∫∂_sE (with
      the Itô correction for noisy weights, and the jumps of piecewise-constant weights),
      "dissipation" = ∫𝒟, "slope" = ∫𝒢², "martingale" = M_t,
      "residual" = dE − partial − dissipation − martingale,
      "residual_slope" = dE − partial − s·slope − martingale (the reference code's check).
      None for a run solved without the ledger: reading ``ledger`` then raises a ValueError naming the
      option (``ledger=True``); :attr:`has_ledger` tells without raising.
    stats: step statistics (steps, field evaluations, max pre-retraction sphere error, wall time,
      order); from :func:`simulate` also "energy_log_scale" (below) and "gradient_flow" (False for
      causal attention: then the ledger has no "residual"/"residual_slope").
    weights: token weights (or None).  path: the weight path (WeightPath) when return_path=True.
    observables: name -> (T, ...) series of the ``observables=`` callables of :func:`simulate`.
    paths: the number P of Monte-Carlo paths when the run was asked for them (then every series has
      the paths axis right after the time axis), None when it was not (no paths axis).
      :meth:`with_paths` gives the series with the paths axis in both cases (P = 1).

    Common scale: energy, slope, dissipation and every ledger term are reported times e^{−c},
    c = ``stats["energy_log_scale"]`` (0 for ordinary runs: the values themselves).  The ledger is
    linear in them, so its identities hold at any scale; :meth:`log_energy` gives log E.
    """

    times: torch.Tensor
    x: torch.Tensor
    energy: Union[torch.Tensor, LazySeries, None]
    slope: Union[torch.Tensor, LazySeries, None]
    dissipation: Union[torch.Tensor, LazySeries, None]
    ledger: Optional[Dict[str, torch.Tensor]]
    stats: Dict[str, float]
    method: str
    normalization: str
    direction: str
    weights: Optional[torch.Tensor] = None
    path: Optional[WeightPath] = None
    extras: Dict[str, object] = field(default_factory=dict)
    observables: Dict[str, torch.Tensor] = field(default_factory=dict)
    paths: Optional[int] = None

    @property
    def energy_log_scale(self) -> float:
        """c with energy, slope, dissipation and ledger reported times e^{−c} (0: unscaled)."""
        return float(self.stats.get("energy_log_scale", 0.0)) if isinstance(self.stats, dict) else 0.0

    @property
    def has_ledger(self) -> bool:
        """True when the run booked the energy ledger (``traj.ledger`` can be read)."""
        return self.__dict__.get("_ledger") is not None

    @property
    def lazy(self) -> bool:
        """True while energy, slope or dissipation are still to be computed (on their first read)."""
        return any(isinstance(self.__dict__.get(f"_{k}"), LazySeries) for k in ("energy", "slope", "dissipation"))

    def __getstate__(self) -> dict:
        """Pickling (``torch.save``) stores the tensors: lazy series are computed first."""
        for k in ("energy", "slope", "dissipation"):
            getattr(self, k)
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        for k in ("energy", "slope", "dissipation", "ledger"):  # pickles of the plain-attribute layout
            if k in state:
                state[f"_{k}"] = state.pop(k)
        self.__dict__.update(state)

    @property
    def kinetic(self) -> torch.Tensor:
        """The running kinetic term ∫_{t0}^{t} 𝒢² ds times e^{−c} at the recorded times, (T, [paths,] ...).

        From ``LedgerOptions(kinetic=True)`` (accumulated from the step's own field evaluations,
        ``extras["kinetic"]``) or the ledger's "slope" (``ledger=True``): the same quadrature, the
        same number to rounding.  ``traj.kinetic[-1]`` is ∫_{t0}^{t1} 𝒢² dt.

        Raises
        ------
        ValueError
            for a run solved with neither (the message names the options).
        """
        k = self.extras.get("kinetic") if isinstance(self.extras, dict) else None
        if k is not None:
            return k
        ledger = self.__dict__.get("_ledger")
        if ledger is not None and "slope" in ledger:
            return ledger["slope"]
        raise ValueError("this trajectory has no kinetic term ∫𝒢² dt: solve with ledger=tp.LedgerOptions(kinetic=True) "
                         "(from the step's own field, at nearly the cost of the field) or with the energy ledger "
                         "(ledger=True; its 'slope')")

    def log_energy(self) -> torch.Tensor:
        """log E(t) = log(energy) + c, (T, ...): finite even where E itself overflows the dtype."""
        if self.energy is None:
            raise ValueError("this trajectory has no energy (it was run with diagnostics=False)")
        return torch.log(self.energy) + self.energy_log_scale

    def __repr__(self) -> str:
        def shape(v):
            if v is None:
                return "None"
            if isinstance(v, torch.Tensor):
                return f"{tuple(v.shape)}"
            return type(v).__name__

        parts = [f"method={self.method!r}", f"normalization={self.normalization!r}", f"direction={self.direction!r}"]
        t = self.times
        if isinstance(t, torch.Tensor) and t.numel():
            parts.append(f"times={t.numel()} in [{float(t[0]):.6g}, {float(t[-1]):.6g}]")
        else:
            parts.append(f"times={shape(t)}")
        x = self.x
        parts.append(f"x={shape(x)}" + (f" {str(x.dtype).replace('torch.', '')}" if isinstance(x, torch.Tensor) else ""))
        energy = self.__dict__.get("_energy")
        if isinstance(energy, LazySeries):
            parts.append("energy=lazy")
        elif energy is not None:
            parts.append(f"energy={shape(energy)}")
        ledger = self.__dict__.get("_ledger")
        if ledger:
            parts.append(f"ledger=[{', '.join(ledger)}]")
        elif ledger is None:
            parts.append("ledger=None")
        if self.observables:
            parts.append(f"observables=[{', '.join(self.observables)}]")
        if self.weights is not None:
            parts.append(f"weights={shape(self.weights)}")
        if self.path is not None:
            parts.append("path=WeightPath")
        if isinstance(self.stats, dict) and self.stats:
            parts.append(f"stats=[{', '.join(map(str, self.stats))}]")
        return f"Trajectory({', '.join(parts)})"

    @property
    def num_paths(self) -> int:
        """P, the length of the paths axis of :meth:`with_paths` (1 for a run without paths)."""
        return 1 if self.paths is None else int(self.paths)

    def with_paths(self) -> "Trajectory":
        """This trajectory with a paths axis in every series, (T, P, *batch, ...) (P = 1 without paths).

        Returns
        -------
        Trajectory
            ``self`` when it has the axis already (``paths`` is an int), else a copy whose x, energy,
            slope, dissipation, ledger terms, observables and series extras (radius) have a new axis
            of length 1 at position 1 (views of the same storage) and ``paths = 1``.
        """
        if self.paths is not None:
            return self
        return _map_series(self, lambda v: v.unsqueeze(1), paths=1)

    @property
    def final(self) -> torch.Tensor:
        """Tokens at the last recorded time, ([paths,] ..., n, d)."""
        return self.x[-1]

    def time_average(self, values: torch.Tensor, t_min: float = 0.0) -> torch.Tensor:
        """Trapezoid time average of a recorded series (T, ...) over times >= t_min."""
        keep = self.times >= t_min - 1e-12
        t, v = self.times[keep], values[keep]
        if len(t) < 2:
            return v[0]
        w = torch.zeros_like(t)
        dtv = t[1:] - t[:-1]
        w[1:] += dtv / 2
        w[:-1] += dtv / 2
        w = w / (t[-1] - t[0])
        return (w.reshape(-1, *([1] * (v.dim() - 1))) * v).sum(0)


def _series_property(name: str) -> property:
    """energy / slope / dissipation: a tensor, None, or a :class:`LazySeries` resolved (and kept) on first read."""
    key = f"_{name}"

    def get(self):
        v = self.__dict__.get(key)
        if isinstance(v, LazySeries):
            v = v.resolve()
            self.__dict__[key] = v
        return v

    def set(self, value):
        self.__dict__[key] = value

    return property(get, set, doc=f"{name} (T, [paths,] ...) times e^(−c); computed on first read when lazy.")


def _ledger_get(self):
    v = self.__dict__.get("_ledger")
    if v is None:
        raise NoLedgerError(_NO_LEDGER)
    return v


def _ledger_set(self, value):
    self.__dict__["_ledger"] = value


Trajectory.energy = _series_property("energy")
Trajectory.slope = _series_property("slope")
Trajectory.dissipation = _series_property("dissipation")
Trajectory.ledger = property(_ledger_get, _ledger_set, doc="the energy ledger: name -> (T, [paths,] ...) "
                             "(NoLedgerError, a ValueError and an AttributeError, for a run solved without it: pass "
                             "ledger=True; hasattr(traj, 'ledger') is then False).")
_LAZY_FIELDS = ("energy", "slope", "dissipation")


def _raw(traj: Trajectory, name: str):
    """The stored value of a series field (a LazySeries is not resolved)."""
    return traj.__dict__.get(f"_{name}")


def _copy(traj: Trajectory, **changes) -> Trajectory:
    """A shallow copy with some fields changed, resolving no lazy series (unlike dataclasses.replace)."""
    new = object.__new__(type(traj))
    new.__dict__.update(traj.__dict__)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _map_series(traj: Trajectory, fn, *, paths) -> Trajectory:
    """A copy of ``traj`` with fn applied to every recorded series (T, ...) and ``paths`` set (lazy series
    stay lazy: fn is applied when they are computed)."""
    def opt(v):
        if isinstance(v, LazySeries):
            return v.map(fn)
        return None if v is None else fn(v)

    extras = {k: (fn(v) if k in SERIES_EXTRAS and isinstance(v, torch.Tensor) else v) for k, v in traj.extras.items()}
    ledger = _raw(traj, "ledger")
    return _copy(traj, x=fn(traj.x), **{k: opt(_raw(traj, k)) for k in _LAZY_FIELDS},
                 ledger=None if ledger is None else {k: fn(v) for k, v in ledger.items()},
                 observables={k: fn(v) for k, v in traj.observables.items()}, extras=extras, paths=paths)


def drop_paths(traj: Trajectory, paths: Optional[int]) -> Trajectory:
    """The solvers' last step: ``traj`` (always computed with a paths axis at position 1) with that axis
    dropped when the caller gave ``paths=None``, else with ``traj.paths = paths``."""
    if paths is None and traj.x.shape[1] != 1:  # a replayed WeightPath broadcast the axis to its own paths
        paths = int(traj.x.shape[1])
    if paths is not None:
        return _copy(traj, paths=paths)
    return _map_series(traj, lambda v: v.squeeze(1), paths=None)


class PathsAxis:
    """The batch-axis convention of a solve (module docstring): the solver's state always has a
    leading paths axis of length P (1 when the caller gave ``paths=None``); this object adds it to
    x0, shows the caller's view of a state (callbacks, observables, checkpoints) and drops it from
    the result.  The one place that knows whether the caller asked for paths."""

    def __init__(self, paths: Optional[int]):
        self.paths = paths
        self.size = 1 if paths is None else int(paths)
        self._drop = paths is None

    def lift(self, x: torch.Tensor) -> torch.Tensor:
        """x (*batch, n, d) as (P, *batch, n, d) (an expanded view)."""
        return x.unsqueeze(0).expand(self.size, *x.shape)

    def view(self, v):
        """The caller's view of a state tensor (P, ...): without the axis when no paths were asked for
        (and the axis was not broadcast to a replayed path's paths); other objects unchanged."""
        if self._drop and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 1:
            return v.squeeze(0)
        return v

    def unview(self, v):
        """The inverse of :meth:`view` for a state read back (a checkpoint)."""
        if self._drop and isinstance(v, torch.Tensor):
            return v.unsqueeze(0)
        return v

    def observable(self, fn):
        """``fn(x, w)`` of the caller's convention as a callable on the solver's states."""
        if not self._drop:
            return fn

        def on_state(x, w):
            v = fn(self.view(x), w)
            return v.unsqueeze(0) if isinstance(v, torch.Tensor) and x.shape[0] == 1 else v
        return on_state

    def finish(self, traj: Trajectory) -> Trajectory:
        """The result in the caller's convention (:func:`drop_paths`)."""
        return drop_paths(traj, self.paths)


# ---------------------------------------------------------------------------- helpers
def nonfinite_error(what: str, t: float, k: int, heads: Heads, normalization: Optional[str] = None) -> NonFiniteError:
    """NonFiniteError for a non-finite field or token step, with the fix that fits the normalisation."""
    A = heads.score_matrix.detach()
    bmax = (A.flatten(-2).abs().amax(-1).max() * (abs(heads.beta) if isinstance(heads.beta, float) else heads.beta.abs().max())).item()
    R = math.log(torch.finfo(A.dtype).max) if A.is_floating_point() else float("inf")
    norm = None if normalization is None else as_normalization(normalization)
    if norm is not None and norm.overflow == "kernel" and bmax > R / 2:
        kind = ("the unnormalised field carries the kernel e^{β⟨x,Ay⟩} itself" if norm.uses_value
                else "the effective field scales like max_h m_h / min_k m_k")
        fix = (f"{kind}, which overflows {A.dtype} near β·‖A‖ ≈ {R:.3g}: use normalization='softmax', reduce beta or "
               f"the scale of the heads, or run in float64")
    elif normalization is None:
        fix = ("the exponential kernel overflowed or the step diverged: reduce beta or the scale of the heads, "
               "use a smaller dt, or normalization='softmax'")
    else:
        fix = "the step diverged (the softmax field itself cannot overflow): use a smaller dt or a higher-order method"
    return NonFiniteError(f"{what} became NaN/inf at t = {t:.6g} (step {k}); β·max|A_h| = {bmax:.3g}. {fix}")


def ledger_nonfinite(what: str, t: float, k: int, log_partition: torch.Tensor, scale: float,
                      start_max: float, given: bool = False) -> NonFiniteError:
    """NonFiniteError for an energy or ledger term: says whether the kernel outgrew the common scale."""
    lp = log_partition.detach()
    R = math.log(torch.finfo(lp.dtype).max)
    now = float(lp.max()) if bool(torch.isfinite(lp).all()) else float("nan")
    head = (f"{what} became NaN/inf at t = {t:.6g} (step {k}); energy, 𝒢², 𝒟 and the ledger are reported times "
            f"e^(−c), c = energy_log_scale = {scale:.6g} ({'given' if given else 'chosen from the log-partitions at t0'}"
            f"; largest log-partition at t0 {start_max:.6g})")
    if math.isfinite(now) and now - scale > 0.75 * R:
        lo, hi = now - R + 8.0, start_max + R - 20.0  # scales that hold both the values at t0 and now
        if lo <= hi:
            suggest = math.ceil(min(hi, max(lo, now - R / 2)))
            fix = (f"pass energy_log_scale={suggest} to simulate (it holds both the values at t0 and the "
                   f"log-partition reached), or run in float64, or diagnostics=False (tokens only)")
        else:
            fix = (f"the exponent has grown by {now - start_max:.4g} since t0, more than {lp.dtype} can span at one "
                   f"scale: run in float64 (or diagnostics=False: tokens only)")
        return NonFiniteError(
            f"{head}; the largest log-partition is now {now:.6g}, {now - scale:.4g} above the scale, beyond "
            f"what {lp.dtype} holds (e^{R:.4g}). Fix: {fix}")
    return NonFiniteError(
        f"{head}; the kernel's exponent is in range (largest log-partition {now:.6g}), so the values themselves "
        f"diverged: use a smaller dt, check the weight process's rates and σ, or run in float64")


def check_finite(t: torch.Tensor) -> bool:
    """True when every entry of ``t`` is finite (NaN and inf make it False)."""
    # a sum is finite only when every entry is (an inf or NaN entry makes it inf or NaN): one pass and
    # no bool tensor; a finite sum proves the check, an overflowing one falls back to the entrywise test
    if t.is_floating_point() and math.isfinite(_total(t)):
        return True
    return bool(torch.isfinite(t).all())


def _total(t: torch.Tensor) -> float:
    """The sum of the entries of a floating tensor as a Python float (a 0-d one read as it is)."""
    t = t.detach() if t.requires_grad else t
    return float(t if t.numel() == 1 else t.sum())


def check_ledger(e: FieldEval, pt: torch.Tensor, t: float, k: int, scale: Mapping):
    """NonFiniteError unless the energy, 𝒟, 𝒢² and ∂_tE of one evaluation are finite (``pt`` None: ∂_tE = 0)."""
    vals = (("the energy", e.energy), ("the dissipation 𝒟", e.dissipation), ("the metric slope 𝒢²", e.slope),
            ("∂_tE (ledger 'partial')", pt))
    # one test of the sum of their sums (finite only when every entry is; an overflow falls through to each)
    if math.isfinite(sum(_total(v) for _, v in vals if v is not None)):
        return
    for name, v in vals:
        if v is not None and not check_finite(v):
            raise ledger_nonfinite(name, t, k, e.stats.log_partition, scale["c"], scale["start_max"],
                                    scale.get("given", False))


