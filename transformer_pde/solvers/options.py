"""Options objects of :func:`transformer_pde.solve`: what to save, how to keep the ledger, where to
checkpoint, how to report progress, and the limits checked before any work.

Each object validates its fields when built (TypeError / ValueError with the fix), so a bad
option fails at the line that made it.  A solver states which of them it accepts
(``Solver.accepts``); :func:`transformer_pde.solve` refuses the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch

from ..utils.validation import check_bool, check_choice, check_int, check_positive, check_real, check_seed_generator
from ..processes.driver import grid_steps

__all__ = ["SaveAt", "LedgerOptions", "Checkpointing", "Progress", "Limits", "SolveOptions", "QUADRATURES",
           "QUADRATIC_VARIATIONS", "RECORD_DIAGNOSTICS"]
#: named internal API: the ledger's checks, shared by LedgerOptions and the keyword front ends (each in its own names)
__internal__ = ["check_ledger_choices", "check_observables_mapping"]

#: the ledger's quadratures of the time integrals
QUADRATURES = ("left", "trapezoid")
#: the ways the ledger books the second-order (Itô) term of noisy weights
QUADRATIC_VARIATIONS = ("expected", "realised")
#: when the diagnostics at the recorded times are computed without the ledger: after the solve on first read, or
#: during the solve from each recorded step's own field evaluation
RECORD_DIAGNOSTICS = ("lazy", "step")


@dataclass(frozen=True)
class SaveAt:
    """What the trajectory keeps.

    record_every : int
        keep every k-th step (the first and the last time are always kept); the ``record_every=`` of
        :func:`transformer_pde.simulate`.
    ends : bool
        keep only t0 and t1 (whatever the number of steps); ``record_every`` must then be left at 1.
    observables : Mapping[str, Callable] or None
        name -> callable(x, weights) evaluated at every kept time (``traj.observables``).
    path : bool
        store the realised weight path in ``traj.path`` (for replay).
    """

    record_every: int = 1
    ends: bool = False
    observables: Optional[Mapping[str, Callable]] = None
    path: bool = False

    def __post_init__(self):
        object.__setattr__(self, "record_every", check_int(self.record_every, "SaveAt.record_every"))
        check_bool(self.ends, "SaveAt.ends")
        check_bool(self.path, "SaveAt.path")
        if self.ends and self.record_every != 1:
            raise ValueError(f"SaveAt(ends=True) keeps t0 and t1 only; drop record_every={self.record_every}")
        check_observables_mapping(self.observables, "SaveAt.observables")

    def stride(self, steps: int) -> int:
        """The record stride on a grid of ``steps`` steps."""
        return max(int(steps), 1) if self.ends else self.record_every


def check_observables_mapping(observables, name: str = "observables") -> None:
    """TypeError unless ``observables`` is None or a mapping name -> callable(x, weights)."""
    if observables is not None and not isinstance(observables, Mapping):
        raise TypeError(f"{name} must be a mapping name -> callable(x, weights), got {type(observables).__name__}")


def check_ledger_choices(diagnostics, ledger, quadrature, quadratic_variation, energy_log_scale, records,
                         kinetic=False, prefix: str = ""):
    """The checks of the ledger's fields, naming each ``prefix + field`` (``"LedgerOptions."`` for the object,
    ``""`` for a keyword front end whose keywords carry the fields' names); returns ``energy_log_scale`` as a
    float (or None).  TypeError / ValueError with the fix."""
    n = {k: prefix + k for k in ("diagnostics", "ledger", "kinetic", "records", "quadrature", "quadratic_variation",
                                 "energy_log_scale")}
    check_bool(diagnostics, n["diagnostics"])
    check_bool(ledger, n["ledger"])
    check_bool(kinetic, n["kinetic"])
    check_choice(records, RECORD_DIAGNOSTICS, n["records"])
    if records == "step" and (ledger or not diagnostics):
        raise ValueError(f"{n['records']}='step' computes the diagnostics at the record steps when there is no "
                         "ledger and diagnostics are on; "
                         + (f"with {n['ledger']}=True they come from every step already: drop {n['records']}='step'"
                            if ledger else f"with {n['diagnostics']}=False there are none: drop {n['records']}='step'"))
    if quadrature is not None:
        check_choice(quadrature, QUADRATURES, n["quadrature"])
    check_choice(quadratic_variation, QUADRATIC_VARIATIONS, n["quadratic_variation"])
    if ledger and not diagnostics:
        raise ValueError(f"{n['ledger']}=True needs {n['diagnostics']}=True: the ledger integrates the energy, 𝒢² "
                         f"and 𝒟 over every step; drop {n['ledger']} or keep the diagnostics")
    if not ledger:
        # the quadrature also integrates the kinetic term; the Itô term belongs to the ledger alone
        given = [f"{n[k]}={v!r}" for k, v, default in (
                 *((("quadrature", quadrature, None),) if not kinetic else ()),
                 ("quadratic_variation", quadratic_variation, "expected")) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)} sets how the energy ledger is integrated, but the ledger is off: "
                             f"pass {n['ledger']}=True as well")
    c = energy_log_scale
    if c is None:
        return None
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        raise TypeError(f"{n['energy_log_scale']} must be None (automatic) or a float, got {type(c).__name__}")
    if not math.isfinite(c):
        raise ValueError(f"{n['energy_log_scale']} must be finite, got {c!r}")
    return float(c)


@dataclass(frozen=True)
class LedgerOptions:
    """The recorded diagnostics and the energy–dissipation ledger (docs/model.md#ledger).

    diagnostics : bool
        energy, 𝒢², 𝒟 at the recorded times (False: tokens only).  Without the ledger they are
        computed after the solve, from the recorded tokens and heads (and radii of a layer map), on
        their first read, vectorised over the records (:mod:`~transformer_pde.solvers.recorded`):
        the solve itself evaluates the field only.
    ledger : bool
        also keep the energy ledger (``traj.ledger``): E, 𝒢², 𝒟, ∂_tE and the Itô terms evaluated
        at every step (the quadrature's points), one diagnostics evaluation per step in place of the
        tokens-only one.  Its cost depends on what the tokens-only step saves: measured
        (scripts/benchmark_diagnostics.py, one thread, float64, median of 5 pairs, idle / 2 busy processes
        per core) 1.17× / 1.15× the tokens-only solve on the paper's H = 100 OU step, 1.5× / 1.5× with token
        noise at n = 200 (the Itô term's per-step bookkeeping on a small step), 1.7× / 1.6× on the peers'
        post-LN workload and 1.5× / 1.5× on a causal one (non-symmetric heads: the two halves of ∇δE/δμ are two
        products per head that the field-only pass does not form; docs/performance.md).
        Needs ``diagnostics=True``.  Without it, reading ``traj.ledger`` raises a ValueError and the
        diagnostics of the records are computed as ``records`` says.
    quadrature : str or None
        "left" or "trapezoid" for the ledger's time integrals (None: the solver's default — "left"
        for Euler, "trapezoid" otherwise); needs ``ledger=True`` or ``kinetic=True``.
    quadratic_variation : str
        "expected" or "realised" Itô term of noisy weights in the ledger; "realised" needs ``ledger=True``.
    energy_log_scale : float or None
        the common scale c (values reported times e^{−c}); None: chosen at t0.
    records : str
        how E, 𝒢², 𝒟 at the recorded times are computed without the ledger. "lazy" (default): after the
        solve, from the records, on their first read: free when never read, about one kernel pass per
        record when read (so sparse records, ``SaveAt(record_every=k)``, are what saves).  "step": during the
        solve, from the field evaluation of each recorded step itself (one evaluation with diagnostics
        in place of the tokens-only one at the record steps only): what the diagnostics add to that
        evaluation, paid whether they are read or not; the cheaper choice when the records are dense and
        read.  Measured as the ledger above: at a stride of 5–10 steps at most 1.10× the tokens-only solve on
        those four paths; at every step 1.05× (H = 100 OU), 1.1–1.2× (token noise), 1.6× (post-LN) and 1.4–1.5×
        (causal), against 1.8–2.6× for lazy records read at every step (docs/performance.md).  The same
        values to rounding.  Fixed-step particle solvers only (tp.Euler(), tp.Heun(), tp.RK4()); with
        ``ledger=True`` the diagnostics already come from every step: leave it at "lazy".
    kinetic : bool
        also accumulate the kinetic term ∫_{t0}^{t} 𝒢² ds, 𝒢² = Σ_i w_i b(x_i) |V(x_i)|², at every step from
        the step's own field evaluations (``traj.kinetic``, (T, [paths,] ...), times e^{−c}): b is the
        harmonic mean of the log-partitions that the field's kernel pass computes anyway, so it costs a few
        elementwise operations per step, not the ledger's diagnostics (fixed-step solvers, which carry
        autograd through it).  The same quadrature as the ledger's "slope" (``quadrature``), hence the same
        number to rounding.  With ``ledger=True`` it is that "slope" itself (nothing more is computed).
        Causal attention: 𝒢² is of the whole measure, so each evaluation point adds one non-causal kernel
        pass for the mobility.  Not available with Dopri5 (whose ledger integrates the record grid: use
        ``ledger=True`` and ``SaveAt(record_every=1)`` there), the sharded or the JKO solvers.
    """

    diagnostics: bool = True
    ledger: bool = False
    quadrature: Optional[str] = None
    quadratic_variation: str = "expected"
    energy_log_scale: Optional[float] = None
    kinetic: bool = False
    records: str = "lazy"

    def __post_init__(self):
        c = check_ledger_choices(self.diagnostics, self.ledger, self.quadrature, self.quadratic_variation,
                                 self.energy_log_scale, self.records, self.kinetic, prefix="LedgerOptions.")
        object.__setattr__(self, "energy_log_scale", c)

    @property
    def lazy(self) -> bool:
        """True when the diagnostics are computed from the records after the solve (no ledger)."""
        return self.diagnostics and not self.ledger and self.records == "lazy"

    @property
    def at_record_steps(self) -> bool:
        """True when the diagnostics are computed during the solve at the recorded steps only (no ledger)."""
        return self.diagnostics and not self.ledger and self.records == "step"

    @property
    def kinetic_only(self) -> bool:
        """True when the kinetic term is accumulated on its own, from the step's field (no ledger)."""
        return self.kinetic and not self.ledger


@dataclass(frozen=True)
class Checkpointing:
    """Atomic checkpoints every ``every`` steps to ``path``, and resume from it when it matches."""

    path: Union[str, Path]
    every: int = 200

    def __post_init__(self):
        if not isinstance(self.path, (str, Path)):
            raise TypeError(f"Checkpointing.path must be a str or Path, got {type(self.path).__name__}")
        object.__setattr__(self, "every", check_int(self.every, "Checkpointing.every"))


@dataclass(frozen=True)
class Progress:
    """Progress reporting: a tqdm bar (``show``: True / False / None = automatic for long solves) and
    a ``callback(k, t, state)`` after every step."""

    show: Optional[bool] = None
    callback: Optional[Callable] = None

    def __post_init__(self):
        check_bool(self.show, "Progress.show", allow_none=True)
        if self.callback is not None and not callable(self.callback):
            raise TypeError(f"Progress.callback must be callable(k, t, state), got {type(self.callback).__name__}")


@dataclass(frozen=True)
class Limits:
    """Limits checked before any allocation: steps (None: 10⁷), estimated bytes (None: 3/4 of the
    machine's memory; inf: none), and the memory cap of one score block (``chunk_elements``)."""

    max_steps: Optional[int] = None
    max_memory: Optional[float] = None
    chunk_elements: Optional[int] = None

    def __post_init__(self):
        if self.max_steps is not None:
            object.__setattr__(self, "max_steps", check_int(self.max_steps, "Limits.max_steps"))
        if self.chunk_elements is not None:
            object.__setattr__(self, "chunk_elements", check_int(self.chunk_elements, "Limits.chunk_elements"))
        m = self.max_memory
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0):
            raise ValueError(f"Limits.max_memory must be a positive number of bytes (or inf), got {m!r}")

@dataclass(frozen=True)
class SolveOptions:
    """Everything of a solve besides the model, the solver and x0: the time grid, the weights'
    random stream and the options objects.  :func:`transformer_pde.solve` builds it (filling in the
    defaults) and passes it to ``solver.run(model, x0, options)``.

    t1, dt, t0 : float
        final time, step (fixed step; Dopri5: the weights' sampling grid; JKO: τ) and start;
        (t1 − t0)/dt must be a whole number.
    paths : int or None
        Monte-Carlo paths of the weights (a leading axis of the results; None: no axis).
    seed, generator
        the weights' random stream (seed xor generator; None and None: seed 0).
    saveat, ledger, checkpoint, progress, limits
        the options objects (:class:`SaveAt`, :class:`LedgerOptions`, :class:`Checkpointing` or None,
        :class:`Progress`, :class:`Limits`).
    """

    t1: float
    dt: float
    t0: float = 0.0
    paths: Optional[int] = None
    seed: Optional[int] = None
    generator: Optional[torch.Generator] = None
    saveat: SaveAt = SaveAt()
    ledger: LedgerOptions = LedgerOptions()
    checkpoint: Optional[Checkpointing] = None
    progress: Progress = Progress()
    limits: Limits = Limits()

    def __post_init__(self):
        object.__setattr__(self, "t0", check_real(self.t0, "t0"))
        object.__setattr__(self, "t1", check_real(self.t1, "t1"))
        object.__setattr__(self, "dt", check_positive(self.dt, "dt"))
        if self.paths is not None:
            object.__setattr__(self, "paths", check_int(self.paths, "paths"))
        seed = check_seed_generator(self.seed, self.generator)
        if self.seed is not None:
            object.__setattr__(self, "seed", seed)
        for key, cls in (("saveat", SaveAt), ("ledger", LedgerOptions), ("progress", Progress), ("limits", Limits)):
            if not isinstance(getattr(self, key), cls):
                raise TypeError(f"{key}= must be a {cls.__name__}, got {type(getattr(self, key)).__name__}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, Checkpointing):
            raise TypeError(f"checkpoint= must be a Checkpointing or None, got {type(self.checkpoint).__name__}")

    @property
    def weight_seed(self) -> int:
        """The seed of the weights' random stream as an int (``seed``; 0 when None: a ``generator``, when
        given, is the stream itself), what :class:`~transformer_pde.processes.weights.WeightDriver` takes."""
        return 0 if self.seed is None else self.seed

    @property
    def steps(self) -> int:
        """The number of steps K = (t1 − t0)/dt of the grid (ValueError when it is not whole)."""
        return grid_steps(self.t0, self.t1, self.dt)
