"""Energy, 𝒢² and 𝒟 at the recorded times of a particle solve, from the records alone (docs/model.md#ledger).

A solve need not evaluate E, 𝒢², 𝒟 at every step when only the recorded values are read: they are
functions of the recorded tokens x_k, the heads Θ(t_k) and (layer maps with a radius) the recorded
radii r_k, so they can be computed after the solve, once, vectorised over the records.  This module
computes exactly what the eager per-step path records (:class:`~transformer_pde.solvers.particle.evaluator.Evaluator`
with diagnostics, then :func:`~transformer_pde.dynamics.layernorm.geometry_densities` for a layer map):

    E_k e^{−c}  = E(μ_k, Θ(t_k)) e^{−c},
    𝒢²_k e^{−c} = Σ_i w_i λ_i b(x_i) |V(x_i)|² e^{−c},    𝒟_k e^{−c} = Σ_i w_i λ_i ⟨∇_S δE/δμ(x_i), V(x_i)⟩ e^{−c}

with V the signed field of the model's normalisation (causal or not), λ_i the layer map's speed (1 for
the projected flow) and c the common log scale.  The energy ledger is NOT computed here: it integrates
𝒟, ∂_tE and the martingale over every step, which the records do not hold.

Interface (a named internal API, for the particle solvers):

* :class:`RecordedHeads` — Θ at the recorded times.  Built from the heads the solver holds at each
  record (``RecordedHeads([...])`` / :meth:`RecordedHeads.append` with ``driver.current``), from a single
  :class:`~transformer_pde.Heads` for constant weights (no copies), or from a closed form / a stored
  :class:`~transformer_pde.WeightPath` at the record times (:meth:`RecordedHeads.at_times`).  A chunk of
  records is one ``Heads`` with a leading time axis (:meth:`RecordedHeads.chunk`); its list
  (:meth:`RecordedHeads.state`) is plain data for a checkpoint.
* :class:`RecordedDiagnostics` — ``RecordedDiagnostics(model, x, heads, log_scale=c, radius=r,
  times=..., steps=..., chunk_elements=...)``; calling it returns ``{"energy", "slope", "dissipation"}``,
  each (T, *batch), computed on the first call and kept.  The records are folded into the batch and
  evaluated by :func:`~transformer_pde.model.field.evaluate` in chunks of records whose score blocks
  hold at most ``chunk_elements`` entries together (the solve's memory cap); differentiable with
  respect to x (and the heads' tensors) when they require grad, also when first read under
  ``torch.no_grad()`` (as the values the solve would have recorded).  A non-finite value raises
  :class:`~transformer_pde.solvers.trajectory.NonFiniteError` naming the record's time and step.
* the trajectory side: ``Trajectory(times, x, *lazy_series(source), ledger=None, ...)``
  (:func:`~transformer_pde.solvers.trajectory.lazy_series`) defers the three series to the first
  read of ``traj.energy`` / ``traj.slope`` / ``traj.dissipation``.

Wiring a fixed-step run in a few lines::

    run.heads_rec = RecordedHeads()                   # at each record: run.heads_rec.append(drv.current)
    ...                                               # checkpoint: state["heads"] = run.heads_rec.state()
    src = RecordedDiagnostics(model, out_x, run.heads_rec, log_scale=energy_log_scale,  # the user's c or None
                              radius=torch.stack(run.radii) if model.layer_norm.radius else None, times=times,
                              steps=run.rec.steps, chunk_elements=chunk)
    stats["energy_log_scale"] = src.log_scale
    Trajectory(times, out_x, *lazy_series(src), None, stats, ...)   # out_x with the paths axis; axis.finish

``log_scale=None`` re-chooses c from the first record, so a resumed run needs no saved scale.  For
"adaptive": ``RecordedHeads.at_times(path if path is not None else process, grid[rows])`` (the record
times as its grid has them) and ``xs[rows]``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Optional, Sequence, Union

import torch

from ..model.backends import DEFAULT_CHUNK_ELEMENTS
from ..model.softmax import softmax_statistics
from ..model.energy import choose_log_scale
from ..model.field import evaluate
from ..model.pair_block import scores_bounded
from ..model.heads import Heads
from ..utils.validation import direction_sign
from ..dynamics.layernorm import geometry_densities
from .trajectory import check_finite, ledger_nonfinite

__all__: List[str] = []
__internal__ = ["RecordedHeads", "RecordedDiagnostics", "records_per_chunk"]

SERIES = ("energy", "slope", "dissipation")


# ---------------------------------------------------------------------------- heads at the records
def _pad(t: torch.Tensor, batch_rank: int, tail: int) -> torch.Tensor:
    """t (*b, *tail) as (1, ..., 1, *b, *tail) with ``batch_rank`` batch dims (right-aligned broadcast)."""
    extra = batch_rank - (t.dim() - tail)
    return t.reshape((1,) * extra + tuple(t.shape)) if extra > 0 else t


def _stack(values: Sequence, batch_rank: int, tail: int):
    """The per-record tensors stacked on a new leading time axis, each padded to ``batch_rank`` batch dims
    (one shared tensor is returned as it is: it broadcasts over the time axis)."""
    first = values[0]
    if all(v is first for v in values):
        return first
    padded = torch.broadcast_tensors(*[_pad(v, batch_rank, tail) for v in values])
    return torch.stack(padded)


def _stack_beta(betas: Sequence, batch_rank: int, like: torch.Tensor):
    """β of the records: the float when all agree, else a tensor (t, 1|b, ...) padded like the other fields
    (floats become tensors of the heads' dtype and device, ``like``)."""
    first = betas[0]
    if all(b is first for b in betas) or all(isinstance(b, float) for b in betas) and all(b == first for b in betas):
        return first
    ts = [b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=like.dtype, device=like.device) for b in betas]
    return _stack(ts, batch_rank, 0)


def stack_heads(items: Sequence[Heads], batch_rank: int) -> Heads:
    """Heads of several records as one Heads with a leading time axis (t, 1..., *batch, H, ...), its batch
    padded to ``batch_rank`` dims after the time axis so that it broadcasts against tokens (t, *S, n, d)
    with len(S) = batch_rank.  Fields every record shares (the same tensor) are not copied."""
    first = items[0]
    if all(h is first for h in items):
        return first
    fields: Dict[str, object] = {}
    if all(h.score is not None for h in items):
        fields.update(score=_stack([h.score for h in items], batch_rank, 3), query=None, key=None)
    elif all(h.score is None for h in items):
        fields.update(score=None, query=_stack([h.query for h in items], batch_rank, 3),
                      key=_stack([h.key for h in items], batch_rank, 3))
    else:  # some records with factors, some without: the dense scores
        fields.update(score=_stack([h.score_matrix for h in items], batch_rank, 3), query=None, key=None)
    if all(h.tied for h in items):
        fields.update(value=None, value_in=None, value_out=None)
    elif all(h.value_factored for h in items):
        fields.update(value=None, value_in=_stack([h.value_in for h in items], batch_rank, 3),
                      value_out=_stack([h.value_out for h in items], batch_rank, 3))
    else:  # dense values (formed for the records that hold factors or are tied)
        fields.update(value=_stack([h.value_matrix for h in items], batch_rank, 3), value_in=None, value_out=None)
    fields["weights"] = _stack([h.weights for h in items], batch_rank, 1)
    fields["beta"] = _stack_beta([h.beta for h in items], batch_rank, first.reference)
    symmetric = True if all(h.known_symmetric is True for h in items) else None
    return first.replace(symmetric=symmetric, **fields)


class RecordedHeads:
    """Θ at the recorded times of a solve, one :class:`~transformer_pde.Heads` per record.

    Parameters
    ----------
    heads : sequence of Heads, a Heads, or None
        the heads at each record (in the order of the records); one Heads: the same heads at every
        record (constant weights); None: empty, filled by :meth:`append` during the solve.

    The heads of a record broadcast against the tokens of that record (*S, n, d), as in the solve
    (a paths axis, a replayed path's axis, an ensemble).  Holding the solver's ``driver.current`` at
    each record costs one reference per record (constant and closed-form heads share their tensors)."""

    def __init__(self, heads: Union[None, Heads, Sequence[Heads]] = None):
        self.constant = heads if isinstance(heads, Heads) else None
        self.items: List[Heads] = [] if heads is None or self.constant is not None else list(heads)
        for i, h in enumerate(self.items):
            if not isinstance(h, Heads):
                raise TypeError(f"RecordedHeads: record {i} is a {type(h).__name__}, not a transformer_pde.Heads")

    @classmethod
    def at_times(cls, source, times) -> "RecordedHeads":
        """``source.heads_at(t)`` at each recorded time: a closed-form Process or a stored WeightPath."""
        return cls([source.heads_at(float(t)) for t in times])

    def append(self, heads: Heads) -> None:
        """Add the heads of the next record."""
        if self.constant is not None:
            raise ValueError("these recorded heads are constant (one Heads for every record); nothing to append")
        self.items.append(heads)

    def __len__(self) -> int:
        return len(self.items)

    def chunk(self, lo: int, hi: int, batch_rank: int) -> Heads:
        """The heads of records lo..hi−1 as one Heads with a leading time axis (or the constant heads,
        which broadcast over it); ``batch_rank`` = the number of batch dims of a record's tokens."""
        if self.constant is not None:
            return self.constant
        return stack_heads(self.items[lo:hi], batch_rank)

    def state(self) -> Union[Heads, List[Heads]]:
        """What a checkpoint stores (plain data: Heads objects); ``RecordedHeads(state)`` restores it."""
        return self.constant if self.constant is not None else list(self.items)


# ---------------------------------------------------------------------------- the diagnostics at the records
def records_per_chunk(batch_numel: int, num_heads: int, n: int, d: int, chunk_elements: Optional[int]) -> int:
    """How many records one evaluation takes: their score blocks (batch · H · n · max(n, d) entries per
    record) hold at most ``chunk_elements`` entries together (default the kernels' own cap), at least one."""
    cap = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    return max(1, cap // max(1, batch_numel * num_heads * n * max(n, d)))


class RecordedDiagnostics:
    """E, 𝒢², 𝒟 · e^{−c} at every record of a solve (module docstring), computed once on the first call.

    Parameters
    ----------
    model
        the solve's :class:`~transformer_pde.Model` (its normalization object, direction, geometry,
        token weights and causality are read).
    x : torch.Tensor
        the recorded tokens (T, *S, n, d) (S: the batch axes of the state, the paths axis included).
    heads : RecordedHeads or Heads
        Θ at the records (a Heads: constant weights).
    log_scale : float or None
        the common scale c; None: chosen from the log-partitions at the first record, as the eager
        solve does at t0 (:func:`transformer_pde.model.energy.choose_log_scale`); read it back from
        :attr:`log_scale`.
    radius : torch.Tensor or None
        the recorded token radii (T, *S, n) of a layer map with a radius (pre-, peri-LN); else None.
    times, steps
        the recorded times (T,) and step numbers, for the messages of a non-finite value.
    chunk_elements : int or None
        the solve's memory cap (entries of one score block); records are evaluated in chunks within it.

    Raises
    ------
    TypeError, ValueError
        at construction, for inputs of the wrong kind or shape (before any work).
    NonFiniteError
        on the call, when a value is NaN/inf (naming the record's time and step).
    """

    def __init__(self, model, x: torch.Tensor, heads, *, log_scale: Optional[float] = None,
                 radius: Optional[torch.Tensor] = None, times=None, steps: Optional[Sequence[int]] = None,
                 chunk_elements: Optional[int] = None):
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            raise TypeError(f"RecordedDiagnostics: x must be the recorded tokens, a tensor (T, ..., n, d); got "
                            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
        heads = RecordedHeads(heads) if isinstance(heads, Heads) else heads
        if not isinstance(heads, RecordedHeads):
            raise TypeError(f"RecordedDiagnostics: heads must be a RecordedHeads or a Heads, got {type(heads).__name__}")
        T = x.shape[0]
        if heads.constant is None and len(heads) != T:
            raise ValueError(f"RecordedDiagnostics: {len(heads)} recorded heads for {T} recorded token states; "
                             f"record the heads at every recorded time")
        geometry = model.layer_norm
        if geometry.radius and (radius is None or tuple(radius.shape) != tuple(x.shape[:-1])):
            raise ValueError(f"RecordedDiagnostics: layer_norm={geometry.name!r} needs the recorded radii of shape "
                             f"{tuple(x.shape[:-1])}, got {None if radius is None else tuple(radius.shape)}")
        self.model, self.x, self.heads, self.radius = model, x, heads, radius if geometry.radius else None
        self.times = None if times is None else [float(t) for t in times]
        self.steps = None if steps is None else [int(k) for k in steps]
        self.chunk_elements = chunk_elements
        self.sign = direction_sign(model.direction)
        self.calls = 0  # evaluations of the whole series (0 or 1)
        self._series: Optional[Dict[str, torch.Tensor]] = None
        self.given = log_scale is not None
        self._start_max: Optional[float] = None
        # None: c from the log-partitions at the first record, as the eager solve fixes it at t0 (0 without a
        # kernel pass where the scores are bounded below the scale's threshold)
        self.log_scale = float(log_scale) if self.given else (
            0.0 if scores_bounded(self.x[0], self._first_heads()) else choose_log_scale(self._first_log_partition()))

    def _first_heads(self):
        return self.heads.chunk(0, 1, self.x.dim() - 3) if self.heads.constant is not None else self.heads.items[0]

    def _first_log_partition(self) -> torch.Tensor:
        """log m_h at the first record (no autograd); also fixes :attr:`start_max`."""
        heads = self._first_heads()
        with torch.no_grad():
            lp0 = softmax_statistics(self.x[0], heads, self.model.weights,
                                     chunk_elements=self.chunk_elements).log_partition
        self._start_max = float(lp0.max()) if lp0.numel() else 0.0
        return lp0

    @property
    def start_max(self) -> float:
        """The largest log-partition at the first record (for the messages of a non-finite value)."""
        if self._start_max is None:
            self._first_log_partition()
        return self._start_max

    def __call__(self) -> Dict[str, torch.Tensor]:
        """{"energy", "slope", "dissipation"}, each (T, *S) times e^{−c}; computed on the first call."""
        if self._series is None:
            # the eager solve built the graph of its records when it ran with autograd (then x requires grad):
            # so do these values, whatever the grad mode at their first read
            with torch.enable_grad() if self.x.requires_grad else contextlib.nullcontext():
                self._series = self._compute()
            self.calls += 1
        return self._series

    def _compute(self) -> Dict[str, torch.Tensor]:
        x, model = self.x, self.model
        T, S, (n, d) = x.shape[0], x.shape[1:-2], x.shape[-2:]
        H = self.heads.constant.num_heads if self.heads.constant is not None else self.heads.items[0].num_heads
        step = records_per_chunk(math.prod(S), H, n, d, self.chunk_elements)
        out: Dict[str, List[torch.Tensor]] = {k: [] for k in SERIES}
        for lo in range(0, T, step):
            hi = min(T, lo + step)
            vals = self._chunk(lo, hi, len(S))
            for k in SERIES:
                out[k].append(vals[k])
        return {k: torch.cat(v) for k, v in out.items()}

    def _chunk(self, lo: int, hi: int, batch_rank: int) -> Dict[str, torch.Tensor]:
        """The three series at records lo..hi−1: one evaluation with the records folded into the batch."""
        model, c = self.model, self.log_scale
        xs = self.x[lo:hi]
        heads = self.heads.chunk(lo, hi, batch_rank)
        causal_kw = {"causal": model.causal} if model.causal else {}
        e = evaluate(xs, heads, model.weights, normalization=model.normalization, sign=self.sign, diagnostics=True,
                     log_scale=c, chunk_elements=self.chunk_elements, ledger_moment=False, **causal_kw)
        geometry = model.layer_norm
        if geometry.projected:
            D, G = e.dissipation, e.slope
        else:  # 𝒟 and 𝒢² along the geometry's velocity λ_i V_i (the eager layer-map solve books these)
            r = None if self.radius is None else self.radius[lo:hi]
            D, G = geometry_densities(geometry, e, heads, model.weights, r, c)
        E = e.energy
        shape = (hi - lo, *xs.shape[1:-2])  # the values broadcast to the tokens' batch (as the eager records)
        vals = {"energy": E.expand(shape), "slope": G.expand(shape), "dissipation": D.expand(shape)}
        for name, key in (("the energy", "energy"), ("the dissipation 𝒟", "dissipation"),
                          ("the metric slope 𝒢²", "slope")):
            if not check_finite(vals[key]):
                bad = lo + int((~torch.isfinite(vals[key].detach().reshape(hi - lo, -1))).any(-1).nonzero()[0])
                t = self.times[bad] if self.times is not None else float("nan")
                k = self.steps[bad] if self.steps is not None else bad
                raise ledger_nonfinite(f"{name} at the recorded time", t, k, e.stats.log_partition, c,
                                       self.start_max, self.given)
        return vals
