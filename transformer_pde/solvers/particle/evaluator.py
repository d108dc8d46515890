"""The field evaluation of a particle solve and its common energy scale (docs/model.md#ledger).

:class:`Evaluator` is shared by the fixed-step run (:mod:`~transformer_pde.solvers.particle.fixed_step`)
and the adaptive solve (:mod:`~transformer_pde.solvers.particle.adaptive`): ``ev(x, heads, diag)`` is one
:class:`~transformer_pde.FieldEval`, and with diagnostics energy, 𝒢², 𝒟 are reported times
e^{−c} for the common scale c fixed at t0.  :class:`RunParts` carries the prepared parts of one
particle solve (weight driver, evaluator, paths axis, checkpointer, dopri5 driver) into those solves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ...model.values import values_first_applies
from ...model.energy import choose_log_scale
from ...model.field import evaluate

__all__ = ["Evaluator"]
__internal__ = ["RunParts"]

logger = logging.getLogger(__name__)


class Evaluator:
    """The field evaluation of a solve: ``ev(x, heads, diag)`` (a FieldEval; with diag the non-causal
    statistics and energy, 𝒢², 𝒟 times e^{−c}) and the common scale c (``scale``, fixed at t0 by
    :meth:`fix_scale` unless given)."""

    def __init__(self, weights, *, normalization, sign, noisy, causal, chunk_elements, energy_log_scale,
                 fused=None, ledger: bool = True, pairing: bool = True, scale: Optional[dict] = None):
        """``weights``: token weights or None; ``normalization``: a Normalization object (or a name of
        the registry); ``sign``: the direction's sign; ``noisy``: the second moment for the Itô terms;
        ``causal``, ``chunk_elements`` as :func:`transformer_pde.evaluate`; ``energy_log_scale``: the
        given common scale c (None: fixed at t0 by :meth:`fix_scale`); ``fused``: a
        :class:`~transformer_pde.dynamics.layernorm.FusedUpdate` for the tokens-only evaluations of a layer map
        (None: none); ``ledger``: False when the evaluations with diagnostics serve records only (no Itô
        term, no second moment); ``pairing``: False when no rate of the heads is paired with the statistics
        (no ledger moment); ``scale``: the common scale of a resumed run (c and the largest log-partition at t0,
        from its checkpoint)."""
        self.w, self.normalization, self.sign, self.noisy = weights, normalization, sign, noisy
        self.causal, self.chunk, self.given = causal, chunk_elements, energy_log_scale
        self.causal_kw = {"causal": causal} if causal else {}
        self.scale = {"c": 0.0 if energy_log_scale is None else energy_log_scale, "start_max": float("nan"),
                      "given": energy_log_scale is not None, **(scale or {})}
        self.fused, self.ledger, self.pairing = fused, ledger, pairing

    def __call__(self, xk, heads, diag):
        # value-factored heads: evaluate's values-first kernel (the fused pass would form every d×d A_h and V_h)
        if not diag and self.fused is not None and not values_first_applies(heads):
            fe = self.fused(xk, heads)
            if fe is not None:
                return fe
        # one implementation of E, 𝒢², 𝒟 at the common scale e^{−c} (c = 0: the values), causal or not
        return evaluate(xk, heads, self.w, normalization=self.normalization, sign=self.sign, diagnostics=diag,
                        log_scale=self.scale["c"], second_moment=diag and self.noisy and self.ledger,
                        chunk_elements=self.chunk,
                        ledger_moment=self.pairing, **self.causal_kw)

    def fix_scale(self, evk) -> bool:
        """Fix c from the log-partitions of the first evaluation (unless given); True when c ≠ 0
        (the caller then evaluates again, at that scale)."""
        lp = evk.stats.log_partition.detach()
        self.scale["start_max"] = float(lp.max()) if lp.numel() else 0.0
        if self.given is not None:
            return False  # the first evaluation already used the given scale
        self.scale["c"] = choose_log_scale(lp)
        if self.scale["c"] != 0.0:
            logger.info("energy and ledger reported times e^(-%.6g) (largest log-partition at t0: %.6g)",
                        self.scale["c"], self.scale["start_max"])
        return self.scale["c"] != 0.0



@dataclass(frozen=True)
class RunParts:
    """The prepared parts of one particle solve, passed to the fixed-step and adaptive solves.

    driver : WeightDriver
        Θ_t on the grid (:class:`~transformer_pde.processes.weights.WeightDriver`).
    evaluator : Evaluator
        the field and the common scale.
    axis : PathsAxis
        the paths axis of the state (dropped once at the end when none was asked).
    start : float
        ``time.perf_counter()`` at the start (the wall time of the stats).
    work : float
        paths · batch · H · n², the thread policy's measure of one evaluation.
    checkpointer : Checkpointer or None
        the fixed-step solve's checkpoints (:class:`~transformer_pde.solvers.parts.Checkpointer`).
    integrate : callable or None
        the adaptive solve's dopri5 driver (:func:`~transformer_pde.solvers.particle.adaptive.dopri5`).
    resume : dict or None
        the checkpoint the run resumes (read before the parts are built), or None: start at t0.
    eager : bool
        the energy ledger is booked at every step (asked for, or the checkpoint resumed was written so).
    lazy : bool
        the diagnostics are computed from the records on their first read.
    """

    driver: Any
    evaluator: Evaluator
    axis: Any
    start: float
    work: float
    checkpointer: Optional[Any] = None
    integrate: Optional[Callable] = None
    resume: Optional[dict] = None
    eager: bool = False
    lazy: bool = False
