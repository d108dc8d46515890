"""The adaptive particle solve: torchdiffeq's dopri5 (or its adjoint) on the projected field, with the
ledger by the trapezoid rule on the record grid (docs/model.md#solvers, #ledger) when
``LedgerOptions(ledger=True)``; by default the energy, 𝒢², 𝒟 of the records are computed on their first
read (:class:`~transformer_pde.solvers.recorded.RecordedDiagnostics`).

The tokens are pulled back to the sphere by the model's geometry (``geometry.retract``: x ↦ x/|x|
for the projected flow), in the field and on the solution.  Entry points:
:meth:`transformer_pde.Dopri5.run` (through :func:`transformer_pde.solve` or
``transformer_pde.simulate(method="adaptive")``); this is a named internal API.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Dict, Tuple

import torch

from ...model.energy import pairing
from ...model.energy import quadratic_variation as realised_qv_term
from ...model.field import evaluate
from ...model.heads import Heads
from ...processes.paths import WeightPath
from ...processes.weights import Process
from ..parts import Recorder, ledger_from_series, partial_density
from ..recorded import RecordedDiagnostics, RecordedHeads
from ..trajectory import Trajectory, check_finite, check_ledger, lazy_series, nonfinite_error

__all__: list = []
__internal__ = ["solve_adaptive", "dopri5"]


class _AdjointField(torch.nn.Module):
    """The projected field as the nn.Module that torchdiffeq's adjoint needs; ``adjoint_params``
    are the tensors requiring grad that the field reads (see :func:`_rebind_for_adjoint`)."""

    def __init__(self, func: Callable, params: Tuple[torch.Tensor, ...]):
        super().__init__()
        self._func = func
        self.adjoint_params = params

    def forward(self, t, y):
        return self._func(t, y)


def _walk(o, fn, depth=0):
    """Rebuild o with every tensor replaced by fn(tensor), through Heads, Processes (shallow
    copies), lists, tuples and dicts; other objects are returned as they are."""
    if depth > 8:
        return o
    if isinstance(o, torch.Tensor):
        return fn(o)
    if isinstance(o, Heads):
        return o.map(fn)
    if isinstance(o, (list, tuple)):
        return type(o)(_walk(v, fn, depth + 1) for v in o)
    if isinstance(o, dict):
        return {k: _walk(v, fn, depth + 1) for k, v in o.items()}
    if isinstance(o, WeightPath):  # the field reads the scores and the template only
        new = copy.copy(o)
        new.scores, new.template = fn(o.scores), _walk(o.template, fn, depth + 1)
        new.points = None if o.points is None else _walk(list(o.points), fn, depth + 1)
        return new
    if isinstance(o, Process):
        new = copy.copy(o)
        for k, v in vars(o).items():
            setattr(new, k, _walk(v, fn, depth + 1))
        return new
    return o


def _rebind_for_adjoint(*objs):
    """(copies of objs, params) for odeint_adjoint.

    Every tensor requiring grad that the objects hold (head tensors, β, process parameters, a
    sampled weight path, token weights) is replaced in the copies by a clone, and the clones are
    the adjoint parameters.  Clones, not the tensors themselves: the adjoint takes the gradient
    of the field with respect to all of its parameters at once, and a parameter that is a
    function of another (a sampled path of its initial heads, V = 2A, A = QᵀK next to Q) would
    be counted twice.  A clone is read by the field only, so each gets the field's direct
    dependence; autograd then carries the clones' gradients back to the originals."""
    clones: Dict[int, torch.Tensor] = {}

    def fn(t):
        if not t.requires_grad:
            return t
        if id(t) not in clones:
            clones[id(t)] = t.clone()
        return clones[id(t)]

    copies = tuple(_walk(o, fn) for o in objs)
    return copies, tuple(clones.values())


@torch.no_grad()
def _initial_step(func, t0: torch.Tensor, y0: torch.Tensor, rtol: float, atol: float, order: int = 5) -> float:
    """First step of an adaptive solve (Hairer, Nørsett & Wanner I, §II.4, the rule torchdiffeq
    uses), computed without autograd.  torchdiffeq's own choice is differentiable, so every node
    time of the solve would depend on the parameters through it; with a time-dependent field
    evaluated at float(t) that dependence is cut and backpropagated gradients come out wrong
    (by 1e-4 relative at rtol = 1e-11, 1e-2 at rtol = 1e-5).  A constant first step removes it."""
    scale = atol + y0.abs() * rtol
    rms = lambda v: float(v.square().mean().sqrt())  # noqa: E731
    f0 = func(t0, y0)
    d0, d1 = rms(y0 / scale), rms(f0 / scale)
    h0 = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    f1 = func(t0 + h0, y0 + h0 * f0)
    d2 = rms((f1 - f0) / scale) / h0
    h1 = max(1e-6, h0 * 1e-3) if max(d1, d2) <= 1e-15 else (0.01 / max(d1, d2)) ** (1.0 / order)
    return min(100 * h0, h1)


def solve_adaptive(x, problem, parts) -> Trajectory:
    """dopri5 through torchdiffeq on the projected field; ledger by the trapezoid rule on the record grid
    (the martingale, and with ``quadratic_variation="realised"`` the quadratic variation, as Itô sums
    over the record intervals).  A closed-form Θ with knots (layer starts) is solved piece by piece
    between them, and the ledger is sampled on both sides of each knot, so it books the jumps of Θ.

    ``problem``: the checked problem (a :class:`~transformer_pde.solvers.particle.methods.ParticleProblem`:
    model, Dopri5 solver (``adjoint``: gradients by the adjoint ODE), options, steps, record stride,
    observables); ``parts``: the prepared :class:`~transformer_pde.solvers.particle.evaluator.RunParts` (its
    ``integrate`` is the dopri5 driver, default :func:`dopri5`).  The tokens are pulled back to the
    sphere by the model's geometry (``geometry.retract``).  The Trajectory still carries the paths axis."""
    model, o, ev, drv = problem.model, problem.options, parts.evaluator, parts.driver
    K, t0, dt, process, retract = problem.steps, o.t0, o.dt, problem.process, model.layer_norm.retract
    integrate = dopri5 if parts.integrate is None else parts.integrate
    # stochastic or grid-stepped weights: sample the whole path on the dt grid first
    path = drv.sample_path(K) if drv.mode != "closed" else None
    source = path if path is not None else process
    obs = {name: parts.axis.observable(fn) for name, fn in problem.observables.items()}
    rec = Recorder(K, problem.record_every, diagnostics=False, observables=obs, weights=model.weights)
    times = rec.times(t0, dt)
    knots = [] if path is not None else process.knots(t0, float(times[-1]))
    grid, rows = _knot_grid(times, knots)
    ys, nfe = integrate(x, ev, source, grid.to(x.dtype).to(x.device), knots, problem)
    xs = retract(ys)
    if not check_finite(xs):
        bad = int((~torch.isfinite(xs.flatten(1)).all(-1)).nonzero()[0])
        tb = float(grid[bad])
        raise nonfinite_error("the token positions", tb, round((tb - t0) / dt), source.heads_at(tb),
                              model.normalization)
    ledger, series, c = {}, {"energy": None, "slope": None, "dissipation": None}, ev.scale["c"]
    if o.ledger.ledger:
        ledger, series = _record_grid_ledger(xs, grid, rows, rec.steps, ev, path, knots, problem)
        c = ev.scale["c"]
    xs, ys = xs[rows], ys[rows]
    if o.ledger.lazy:  # E, 𝒢², 𝒟 from the records (Θ at the record times as the grid has them), on first read
        src = RecordedDiagnostics(model, xs, RecordedHeads.at_times(source, grid[rows]),
                                  log_scale=o.ledger.energy_log_scale, times=times, steps=rec.steps,
                                  chunk_elements=o.limits.chunk_elements)
        series, ledger, c = dict(zip(("energy", "slope", "dissipation"), lazy_series(src))), None, src.log_scale
    for r in range(len(rec.steps)):
        rec.record(xs[r])
    observed = rec.stacked(t0, dt)[4]
    stats = {"steps": K, "field_evaluations": nfe, "max_sphere_error": float((ys.detach().norm(dim=-1) - 1).abs().max()),
             "wall_time": time.perf_counter() - parts.start, "order": 5, "energy_log_scale": c,
             "gradient_flow": not model.causal}
    return Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                      problem.solver.method, model.normalization.name, model.direction, model.weights,
                      path if o.saveat.path else None, observables=observed)


def _knot_grid(times, knots):
    """(the record times with the knots added, float64; the index of each record time in it).

    A knot within 1e-9 of the span of a record time takes that record time's place, so that Θ is
    sampled on both sides of the knot itself: sampled at the record time, both sides could fall in
    the same layer and the jump would be lost."""
    if not knots:
        return times, list(range(len(times)))
    tol = 1e-9 * float(times[-1] - times[0])
    grid, extra = times.clone(), []
    for tj in knots:
        i = int((times - tj).abs().argmin())
        if abs(float(times[i]) - tj) > tol:
            extra.append(tj)
        else:
            grid[i] = tj
    grid = torch.sort(torch.cat([grid, torch.tensor(extra, dtype=torch.float64)])).values
    return grid, [int((grid - t).abs().argmin()) for t in times]


def _pieces(grid, knots):
    """Index ranges [i, j] of the grid between consecutive knots (each knot ends one piece, starts the next)."""
    tol = 1e-9 * float(grid[-1] - grid[0])
    cuts = [0] + [int((grid - tj).abs().argmin()) for tj in knots if abs(float(grid[-1]) - tj) > tol] + [len(grid) - 1]
    return list(zip(cuts[:-1], cuts[1:]))


def _piece_heads(source, a: float, b: float, closed: bool):
    """Θ on the piece [a, b]: its right limit at a, its left limit at b (the piece's own layer),
    whatever the rounding of the solver's time; the plain ``heads_at`` without knots."""
    if not closed:
        return source.heads_at
    tol = 1e-6 * (b - a)

    def heads(t):
        return source.heads_at(a) if t <= a + tol else source.left_heads_at(min(t, b))
    return heads


def dopri5(x, ev, source, grid, knots, problem):
    """torchdiffeq's dopri5 on the projected field through the grid, one solve per piece between knots,
    the tokens pulled back to the sphere by the model's geometry; the tolerances and ``adjoint`` of the
    problem's Dopri5 solver; (ys, field evaluations)."""
    from torchdiffeq import odeint, odeint_adjoint

    model, solver = problem.model, problem.solver
    rtol, atol, adjoint, retract = solver.rtol, solver.atol, solver.adjoint, model.layer_norm.retract
    weights, causal, chunk_elements = model.weights, model.causal, problem.options.limits.chunk_elements
    nfe = [0]
    pieces = _pieces(grid, knots) if knots else [(0, len(grid) - 1)]
    if adjoint:
        (source, w_c), params = _rebind_for_adjoint(source, weights)
        causal_kw = {"causal": causal} if causal else {}
    out, y = [x[None]], x
    for i, j in pieces:
        heads_at = _piece_heads(source, float(grid[i]), float(grid[j]), bool(knots))
        if adjoint:
            def afunc(t, y, heads_at=heads_at):
                nfe[0] += 1
                return evaluate(retract(y), heads_at(float(t.detach())), w_c, normalization=model.normalization,
                                sign=problem.sign, diagnostics=False, chunk_elements=chunk_elements, **causal_kw).velocity

            ys = odeint_adjoint(_AdjointField(afunc, params), y, grid[i:j + 1], method="dopri5", rtol=rtol,
                                atol=atol, adjoint_params=params)
        else:
            def func(t, y, heads_at=heads_at):
                nfe[0] += 1
                return ev(retract(y), heads_at(float(t.detach())), False).velocity

            first = _initial_step(func, grid[i], y.detach(), rtol, atol)
            ys = odeint(func, y, grid[i:j + 1], method="dopri5", rtol=rtol, atol=atol, options={"first_step": first})
        out.append(ys[1:])
        y = ys[-1]
    return (torch.cat(out) if len(out) > 2 else ys), nfe[0]


def _record_grid_ledger(xs, grid, rows, rec_k, ev, path, knots, problem):
    """Energy, 𝒢², 𝒟 and the ledger (:func:`~.parts.ledger_from_series`) at the tokens xs on the grid
    (record times and knots); at a knot a left-limit sample first, and the jump E(Θ) − E(Θ−) booked."""
    w, tol, process = problem.model.weights, 1e-9 * float(grid[-1] - grid[0]), problem.process
    scale, fix_scale = ev.scale, ev.fix_scale
    realised = problem.options.ledger.quadratic_variation == "realised"
    samples, step_of = [], dict(zip(rows, rec_k))  # (t, x, heads, rate, σ, record step or None)
    for g in range(len(grid)):
        t, k = float(grid[g]), step_of.get(g)
        if any(abs(t - tj) <= tol for tj in knots):
            samples.append((t, xs[g], process.left_heads_at(t), process.left_score_rate(t), 0.0, None))
        if path is not None:
            samples.append((t, xs[g], path.heads_at(t), path.rates[k], path.sigmas[k], k))
        else:
            samples.append((t, xs[g], process.heads_at(t), process.score_rate(t), 0.0, k))
    E, G, D, P, M, Q = [], [], [], [], [], []
    for r, (t, x, hk, rate, sig, k) in enumerate(samples):
        e = ev(x, hk, True)
        if r == 0 and fix_scale is not None and fix_scale(e):
            e = ev(x, hk, True)
        c = scale["c"]
        pt = partial_density(x, hk, w, e.stats, rate, sig, ito=process.noisy and not realised, log_scale=c)
        if process.noisy and r + 1 < len(samples):
            dn = path.noise[k:samples[r + 1][5]].sum(0)
            M.append(pairing(x, hk, w, e.stats, dn, log_scale=c))
            if realised:
                Q.append(realised_qv_term(x, hk, w, e.stats, dn, log_scale=c))
        elif knots and r > 0:  # the jump of Θ between a left-limit sample and the next (0 elsewhere)
            Q.append(e.energy - E[-1] if samples[r - 1][0] == t else torch.zeros_like(e.energy))
        check_ledger(e, pt, t, -1 if k is None else k, scale)
        E.append(e.energy)
        G.append(e.slope)
        D.append(e.dissipation)
        P.append(pt)
    keep = [r for r, smp in enumerate(samples) if smp[5] is not None]
    E, G, D, P = map(torch.stack, (E, G, D, P))
    times = torch.tensor([smp[0] for smp in samples], dtype=torch.float64)
    ledger = ledger_from_series(E, G, D, P, M, Q, times, sign=problem.sign, causal=problem.model.causal)
    return {key: v[keep] for key, v in ledger.items()}, {"energy": E[keep], "slope": G[keep], "dissipation": D[keep]}
