"""The sharded particle solver: multi-device scale-out on ``torch.distributed``, the tokens (queries)
sharded across ranks (``tp.solve(model, x_local, tp.ShardedEuler(), ...)`` or
:func:`simulate_sharded`; the module is ``tp.distributed``).

Rank r holds a shard x_r (..., n_r, d) of the tokens and its share w_r of the token weights
(Σ_r Σ_i w_{r,i} = 1; None means uniform 1/N over all N tokens).  One evaluation

    1. all-gathers the keys  x = [x_0, ..., x_{R-1}] (..., N, d)  and their weights,
    2. evaluates, at the local queries only, the field of the full measure
       μ = Σ_j w_j δ_{x_j} (``tp.evaluate(x_r, heads, w_r, keys=x, key_weights=w)``),
    3. all-reduces (SUM) the partial sums Σ_{i ∈ shard} w_i (...) of E, 𝒢², 𝒟 and of the ledger
       terms ∂_tE, Itô correction and martingale increment.

Per rank: time ∝ n_r · N · H, memory O(N·d + n_r·H) plus one kernel block; communication
O(N·d) per evaluation.  Tensors stay on the input's device, so the same code runs with the
``gloo`` backend on CPU and ``nccl`` on GPUs.  Forward only (no autograd through the
collectives).  Without an initialised process group every function runs as one rank.

Launch one process per device with torchrun::

    torchrun --standalone --nproc_per_node=4 sharded_run.py

with, in the script::

    import os, torch, torch.distributed as dist, transformer_pde as tp
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else "cpu"
    x = tp.sphere.octahedral(100_000, dtype=torch.float32, device=device)   # same on every rank
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(8, 3, generator=torch.Generator().manual_seed(0),
                                                 dtype=torch.float32).to(device))
    x_local, w_local = tp.distributed.shard_tokens(x)
    traj = tp.distributed.simulate_sharded(x_local, theta, t1=1.0, dt=1e-2, paths=4, seed=0)
    if dist.get_rank() == 0:
        print(traj.energy[-1], traj.ledger["residual"][-1])

Every rank must build the same heads and use the same ``seed``: the weight process is sampled
redundantly on each rank (it is tiny), so all ranks see the same Θ_t without communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...utils.validation import DEFAULT_DIRECTION, DIRECTIONS
from ...utils.validation import (
    broadcast_shapes, check_bool, check_choice, check_every, check_int, check_positive, check_real, check_same,
    check_tokens, direction_sign,
)
from ...model.normalization import normalization as as_normalization
from ...model.backends import BACKENDS
from ...model.energy import pairing
from ...model.field import FieldEval, evaluate
from ...model.heads import Heads
from ...processes.driver import WeightDriver, grid_steps
from ...processes.paths import WeightPath
from ...processes.weights import Process
from ...dynamics.model import Model
from ..solver import Solver
from ..options import LedgerOptions, Limits, Progress, SaveAt, SolveOptions, check_ledger_choices
from ..loop import ParticleState, Run
from ..parts import Checkpointer, Ledger, Recorder, Stepper, partial_density, process_parts
from ..solve import solve
from ..tableaux import TABLEAUX
from ..trajectory import PathsAxis, Trajectory, nonfinite_error

__all__ = ["ShardedEuler", "rank_and_world", "shard_tokens", "gather_tokens", "distributed_evaluate",
           "simulate_sharded"]

#: the projected Euler step with the retraction (the sharded solver's step)
_EULER = Stepper(TABLEAUX["euler"], retract=True)


@dataclass(frozen=True)
class ShardedEuler(Solver):
    """Projected Euler with the tokens sharded over the ranks of ``group`` (a ``torch.distributed``
    process group; None: the world, or one rank without an initialised group).  x0 of
    :func:`~transformer_pde.solve` is this rank's shard (``tp.distributed.shard_tokens``), the model's
    token weights this rank's share of the global weights.  ``backend``: the kernel
    (:mod:`transformer_pde.model.attention`); ``gather_x``: record all N tokens instead of the shard.

    The ledger is the left-point one of ``Euler()``, booked at every step whatever
    ``LedgerOptions.ledger`` (the diagnostics are all-reduced partial sums of every step: computing
    them from the records would need the records of every rank), so ``traj.ledger`` is there with
    ``diagnostics=True``; no observables, stored paths, realised quadratic variation or given energy scale;
    no layer maps, token noise or causal attention in the model; the weights are drawn from ``seed=`` on every
    rank (no generator).  It runs through the loop of :mod:`~transformer_pde.solvers.loop`: the callback
    (``callback(k, t, x_local)`` on every rank) and checkpoints (one file per rank: ``path`` with one rank,
    ``<stem>.rank<r><suffix>`` with several; every rank resumes the same step or all refuse)."""

    group: Any = None
    backend: str = "auto"
    gather_x: bool = False
    accepts: ClassVar[FrozenSet[str]] = frozenset({"saveat", "ledger", "checkpoint", "progress", "limits"})
    unsupported: ClassVar[Mapping[str, Tuple[str, ...]]] = {
        "saveat": ("observables", "path"), "ledger": ("quadrature", "quadratic_variation", "energy_log_scale",
                                                    "kinetic", "records"),
        "limits": ("max_steps", "max_memory")}
    #: ``Trajectory.method``
    method: ClassVar[str] = "euler"

    def __post_init__(self):
        check_choice(self.backend, BACKENDS, "ShardedEuler.backend")
        check_bool(self.gather_x, "ShardedEuler.gather_x")

    def init(self, model: Model, x0: torch.Tensor, options: SolveOptions):
        """The started sharded run (:meth:`transformer_pde.solvers.solver.Solver.init`); ``run`` steps it.

        Parameters
        ----------
        model : Model
            the dynamics (projected flow, no token noise, not causal); its token weights are this
            rank's share.
        x0 : torch.Tensor
            this rank's shard of the initial tokens (..., n_r, d).
        options : SolveOptions
            the grid, ``seed`` (the same on every rank; no generator), the options objects.

        Returns
        -------
        Run
            the run at t0, or at the step every rank's checkpoint holds; ``run`` returns the
            Trajectory of :func:`simulate_sharded`.
        """
        return _start(ShardedProblem.check(model, x0, self, options))

    def step(self, state, t: float, dt: float):
        """The projected Euler step of this rank's tokens.

        Parameters
        ----------
        state : ParticleState
            this rank's tokens and the field of the whole measure at them.
        t : float
            the left end.
        dt : float
            the step.

        Returns
        -------
        tuple
            (the new tokens, {"sphere_error": the largest |‖y‖ − 1| before the retraction}).
        """
        x_new, err = _EULER.step(state.x, state.velocity, dt, None)
        return x_new, {"sphere_error": err}


def rank_and_world(group=None):
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _active(group) -> bool:
    return rank_and_world(group)[1] > 1


def shard_tokens(x: torch.Tensor, weights: Optional[torch.Tensor] = None, *, group=None):
    """This rank's balanced slice of the tokens (along the token axis -2) and of their weights.

    x: (..., N, d) the full token set (identical on every rank); weights: (..., N) or None.
    Returns (x_r (..., n_r, d), w_r (..., n_r) or None), with n_r = ⌈N/R⌉ or ⌊N/R⌋
    (``torch.tensor_split``); the weights keep their global normalisation.
    """
    check_tokens(x, "x")
    rank, world = rank_and_world(group)
    if x.shape[-2] < world:
        raise ValueError(f"cannot shard {x.shape[-2]} tokens over {world} ranks; use at most one rank per token")
    xs = torch.tensor_split(x, world, dim=-2)[rank]
    ws = None if weights is None else torch.tensor_split(weights, world, dim=-1)[rank]
    return xs.contiguous(), None if ws is None else ws.contiguous()


def _gather_sizes(n_local: int, device, group) -> List[int]:
    _, world = rank_and_world(group)
    n = torch.tensor([n_local], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    return [int(s) for s in sizes]


def gather_tokens(x_local: torch.Tensor, *, group=None, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather token shards (..., n_r, c) into (..., N, c) in rank order (uneven shards allowed).

    ``sizes``: the n_r of every rank when already known (saves one collective)."""
    if not _active(group):
        return x_local
    if sizes is None:
        sizes = _gather_sizes(x_local.shape[-2], x_local.device, group)
    nmax = max(sizes)
    pad = x_local
    if x_local.shape[-2] < nmax:
        pad = torch.nn.functional.pad(x_local, (0, 0, 0, nmax - x_local.shape[-2]))
    pad = pad.contiguous()
    bufs = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(bufs, pad, group=group)
    return torch.cat([b[..., :s, :] for b, s in zip(bufs, sizes)], -2)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if _active(group):
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _Shard:
    """Token-weight bookkeeping of one rank: query weights (global normalisation) and key weights."""

    def __init__(self, x_local, weights, group):
        self.group = group
        self.sizes = _gather_sizes(x_local.shape[-2], x_local.device, group) if _active(group) else [x_local.shape[-2]]
        self.N = sum(self.sizes)
        if weights is None:
            # uniform over all N tokens: queries weigh 1/N each, keys are uniform (None)
            self.query = torch.full(x_local.shape[-2:-1], 1.0 / self.N, dtype=x_local.dtype, device=x_local.device)
            self.keys = None
        else:
            check_tokens(x_local, "x_local")
            if not isinstance(weights, torch.Tensor):
                raise TypeError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
            check_same(x_local, weights, "x_local", "weights")
            if weights.shape[-1] != x_local.shape[-2]:
                raise ValueError(f"weights must have shape (..., n_local) with n_local = {x_local.shape[-2]}, "
                                 f"got {tuple(weights.shape)}")
            if bool((weights < 0).any()):
                raise ValueError("token weights must be >= 0")
            total = _all_reduce(weights.sum(-1).clone(), group)
            err = float((total - 1).abs().max())
            if err > max(1e-6, 1e3 * torch.finfo(weights.dtype).eps):
                raise ValueError(f"the token weights must sum to 1 over all ranks (max |sum - 1| = {err:.1e}); "
                                 f"shard globally normalised weights with tp.distributed.shard_tokens")
            self.query = weights
            self.keys = gather_tokens(weights.unsqueeze(-1), group=group, sizes=self.sizes).squeeze(-1)

    def gather(self, x_local):
        return gather_tokens(x_local, group=self.group, sizes=self.sizes)


def distributed_evaluate(
    x_local: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor] = None,
    *,
    normalization: str = "softmax",
    direction: str = DEFAULT_DIRECTION,
    diagnostics: bool = True,
    second_moment: bool = False,
    backend: str = "auto",
    chunk_elements: Optional[int] = None,
    group=None,
) -> FieldEval:
    """V[μ,Θ] at this rank's tokens and the global E, 𝒢², 𝒟 of μ = Σ_r Σ_i w_{r,i} δ_{x_{r,i}}.

    Parameters
    ----------
    x_local : torch.Tensor
        this rank's tokens (..., n_r, d) on the sphere.  heads: :class:`Heads` (same on all ranks).
    weights : Optional[torch.Tensor]
        this rank's share (..., n_r) of the global token weights, or None (uniform 1/N).
    normalization, direction
        as :func:`transformer_pde.velocity`.
    diagnostics, second_moment, backend, chunk_elements
        as :func:`transformer_pde.evaluate`.
    group
        the process group (default: the world).

    Returns
    -------
    FieldEval
        :class:`FieldEval` whose velocity, stats, outputs and grad_first_variation are local
        (n_r rows) and whose energy, slope and dissipation are global (all-reduced, identical
        on every rank).

    Raises
    ------
    TypeError, ValueError
        for bad input, as the single-process entry points.
    """
    norm = as_normalization(normalization)  # a name or a Normalization object, resolved once here
    sign = direction_sign(direction)
    check_tokens(x_local, "x_local")
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}")
    check_same(x_local, heads.reference, "x_local", "heads")
    shard = _Shard(x_local, weights, group)
    keys = shard.gather(x_local)
    out = evaluate(x_local, heads, shard.query, keys=keys, key_weights=shard.keys, normalization=norm,
                   sign=sign, diagnostics=diagnostics, second_moment=second_moment, backend=backend,
                   chunk_elements=chunk_elements)
    if diagnostics:
        red = _all_reduce(torch.stack([out.energy, out.slope, out.dissipation]), group)
        out.energy, out.slope, out.dissipation = red[0], red[1], red[2]
    return out


@torch.no_grad()
def _flag(*ts) -> float:
    """1.0 when any of the tensors holds NaN/inf, else 0.0 (all-reduced with the entries, so every rank agrees)."""
    return float(any(not bool(torch.isfinite(t).all()) for t in ts))


def _reduce_with_flag(entries, bad: float, zero: torch.Tensor, group):
    """Sum the entries (tensors broadcast to the batch shape of ``zero``, or numbers) and the non-finite flag
    over the ranks in one all-reduce; returns (the summed entries, whether any rank flagged)."""
    batch = zero.shape
    vec = torch.stack([e.expand(batch) if isinstance(e, torch.Tensor) else zero + e for e in entries] + [zero + bad])
    vec = _all_reduce(vec, group)
    return vec[:-1], float(vec[-1].max()) > 0


@dataclass(frozen=True)
class ShardedProblem:
    """A sharded solve's inputs, checked before any work (:meth:`check`): the weight process, the
    direction's sign, the number of steps, the record stride and the seed."""

    model: Model
    x0: torch.Tensor
    solver: ShardedEuler
    options: SolveOptions
    steps: int
    record_every: int
    seed: int

    @classmethod
    def check(cls, model: Model, x0_local: torch.Tensor, solver: ShardedEuler, options: SolveOptions):
        """The checks that need x0 and the model parts the sharded solver does not implement."""
        o = options
        if o.generator is not None:
            raise TypeError("ShardedEuler samples the weights redundantly on every rank from seed=: give seed=, "
                            "not generator=")
        for part, bad in (("layer_norm", not model.layer_norm.projected), ("temperature", model.noise is not None),
                          ("causal", bool(model.causal))):
            if bad:
                raise ValueError(f"ShardedEuler implements the projected flow of non-causal attention without "
                                 f"token noise; Model.{part} = {getattr(model, part)!r} is not supported: drop it "
                                 f"or use tp.Euler()")
        check_tokens(x0_local, "x0_local")
        K = o.steps
        record_every = check_every(o.saveat.stride(K), "SaveAt.record_every", K,
                                   f"t0 = {o.t0:.6g} to t1 = {o.t1:.6g} in steps dt = {o.dt:.6g}")
        process = model.process
        if isinstance(process, WeightPath) and o.paths is not None:
            raise ValueError("a stored WeightPath already carries its paths axis; call without paths=")
        h0 = process.heads0
        check_same(x0_local, h0.reference, "x0_local", "theta's heads")
        if h0.dim != x0_local.shape[-1]:
            raise ValueError(f"the heads act on d = {h0.dim} but x0_local has d = {x0_local.shape[-1]}")
        return cls(model, x0_local, solver, options, K, record_every, o.weight_seed)


def simulate_sharded(
    x0_local: torch.Tensor,
    theta,
    *,
    t1: float,
    dt: float,
    t0: float = 0.0,
    weights: Optional[torch.Tensor] = None,
    paths: Optional[int] = None,
    seed: int = 0,
    normalization: str = "softmax",
    direction: str = DEFAULT_DIRECTION,
    record_every: int = 1,
    diagnostics: bool = True,
    ledger: bool = False,
    backend: str = "auto",
    chunk_elements: Optional[int] = None,
    gather_x: bool = False,
    progress: bool = False,
    group=None,
) -> Trajectory:
    """Projected Euler for ẋ_i = V[μ_t, Θ_t](x_i) with the tokens sharded over the ranks.

    The same scheme and ledger as ``tp.simulate(..., method="euler")`` (left-point quadrature,
    Itô martingale sum, jumps of piecewise-constant weights): with the same inputs the records
    agree with one process to rounding.  Per step: one all-gather of the tokens and one
    all-reduce of the stacked partial sums (E, 𝒢², 𝒟, ∂_tE + Itô, martingale, jump, NaN flag).

    Parameters
    ----------
    x0_local : torch.Tensor
        this rank's initial tokens (..., n_r, d) (e.g. from :func:`shard_tokens`).
    theta
        :class:`Heads` or a process (identical on every rank; the weights are sampled
        redundantly on every rank from ``seed``).
    t1, dt, t0, paths, seed, normalization, direction, record_every, diagnostics, ledger
        as
        :func:`transformer_pde.simulate`.
    weights : Optional[torch.Tensor]
        this rank's share of the global token weights, or None (uniform 1/N).
    backend, chunk_elements
        kernel choice (:mod:`transformer_pde.model.backends`).
    gather_x : bool
        record all N tokens (the gathered keys) instead of the local shard.
    progress : bool
        tqdm bar on rank 0.

    Returns
    -------
    Trajectory
        :class:`Trajectory`: ``x`` (T, [paths,] ..., n_r or N, d); energy, slope, dissipation and
        the ledger are global and identical on every rank.

    Raises
    ------
    TypeError, ValueError
        for bad input; NonFiniteError on every rank when any rank
        produces NaN/inf (the ranks agree through the all-reduced flag, so none hangs).
    """
    check_tokens(x0_local, "x0_local")
    if weights is not None and not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
    if not isinstance(theta, (Heads, Process)):
        raise TypeError(f"theta must be a Heads or a Process, got {type(theta).__name__}")
    norm = as_normalization(normalization, "normalization")
    check_choice(direction, DIRECTIONS, "direction")
    check_every(record_every, "record_every", grid_steps(check_real(t0, "t0"), check_real(t1, "t1"),
                                                         check_positive(dt, "dt")),
                f"t0 = {t0:.6g} to t1 = {t1:.6g} in steps dt = {dt:.6g}")
    check_ledger_choices(diagnostics, ledger, None, "expected", None, "lazy")
    check_bool(progress, "progress")
    check_bool(gather_x, "gather_x")
    check_choice(backend, BACKENDS, "backend")
    if chunk_elements is not None:
        check_int(chunk_elements, "chunk_elements")
    model = Model(theta, norm, direction, weights=weights)
    return solve(model, x0_local, ShardedEuler(group=group, backend=backend, gather_x=gather_x), t1=t1, dt=dt,
                 t0=t0, paths=paths, seed=seed, saveat=SaveAt(record_every),
                 ledger=LedgerOptions(diagnostics, ledger), progress=Progress(progress),
                 limits=Limits(chunk_elements=chunk_elements))


def _rank_path(path, group):
    """The checkpoint file of this rank: ``path`` with one rank, ``<stem>.rank<r><suffix>`` with several."""
    rank, world = rank_and_world(group)
    path = Path(path)
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _load_everywhere(ckpt, device, group):
    """This rank's checkpoint (or None), once every rank has read its own: a refusal on any rank, or ranks at
    different steps, raise on every rank (so that none waits in a collective)."""
    err, ck = None, None
    try:
        ck = ckpt.load(device)
    except ValueError as e:
        err = e
    k = -1 if ck is None else int(ck["k"])
    if _active(group):
        v = torch.tensor([1.0 if err is not None else 0.0, k, -k], dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
        bad, k_max, k_min = float(v[0]) > 0, int(v[1]), -int(v[2])
    else:
        bad, k_max, k_min = err is not None, k, k
    if err is not None:
        raise err
    if bad:
        raise ValueError("another rank refused its checkpoint (its error says why); delete the checkpoints of "
                         "every rank to start afresh")
    if k_max != k_min:
        raise ValueError(f"the ranks' checkpoints are of different steps ({k_min} to {k_max}; {ckpt.path} holds "
                         f"step {k}); delete the checkpoints of every rank to start afresh")
    return ck


def _fingerprint(problem: ShardedProblem, group) -> list:
    """The (label, values) of a sharded run's checkpoint: what changes its numbers, and the rank layout."""
    m, o = problem.model, problem.options
    parts = [("x0 (this rank's tokens)", [problem.x0]), *process_parts(m.process)]
    for label, v in (("t0", o.t0), ("t1", o.t1), ("dt", o.dt), ("normalization", repr(m.normalization)),
                     ("direction", m.direction), ("paths", o.paths), ("seed", problem.seed),
                     ("record_every", problem.record_every), ("diagnostics", o.ledger.diagnostics),
                     ("gather_x", problem.solver.gather_x), ("rank and world", rank_and_world(group)),
                     ("device", str(problem.x0.device))):
        parts.append((label, [v]))
    parts.append(("weights", [m.weights]))
    return parts


def _start(problem: ShardedProblem) -> "_ShardedRun":
    """The sharded run of a checked problem at t0, or resumed from every rank's checkpoint."""
    model, o, solver, x0_local = problem.model, problem.options, problem.solver, problem.x0
    group, weights = solver.group, model.weights
    start = time.perf_counter()
    ck = o.checkpoint
    ckpt = None if ck is None else Checkpointer(_rank_path(ck.path, group), ck.every, problem.steps,
                                                lambda: _fingerprint(problem, group))
    resume = None if ckpt is None else _load_everywhere(ckpt, x0_local.device, group)
    shard = _Shard(x0_local, weights, group)
    drv = WeightDriver(model.process, paths=o.paths, generator=None, seed=problem.seed, t0=o.t0, dt=o.dt,
                       batch_rank=x0_local.dim() - 2)
    axis = PathsAxis(o.paths)  # the state always has the paths axis (P = 1 without paths=)
    x = axis.lift(x0_local)
    x = x.expand(*broadcast_shapes(x.shape[:-2], drv.current.batch_shape), *x.shape[-2:])
    return _ShardedRun(x, drv, shard, problem, axis, start, ckpt, resume,
                       kw=dict(normalization=model.normalization, backend=solver.backend,
                               chunk_elements=o.limits.chunk_elements))


class _ShardedRun(Run):
    """The projected Euler solve of :func:`simulate_sharded`, composed of the solver parts (weight
    driver, the solver's step, left-point ledger, recorder) and stepped by the loop of
    :mod:`~transformer_pde.solvers.loop`; each evaluation's partial sums (E, 𝒢², 𝒟, ∂_tE + Itô, martingale,
    jump) and the NaN flag are summed over the ranks in one all-reduce.  ``resume``: this rank's checkpoint
    (every rank at the same step), or None."""

    def __init__(self, x, drv, shard, problem: ShardedProblem, axis, start, checkpointer, resume, kw):
        diagnostics, sign, group = problem.options.ledger.diagnostics, problem.model.sign, problem.solver.group
        self.x, self.drv, self.shard, self.dt, self.sign = x, drv, shard, problem.options.dt, sign
        self.gather_x, self.diagnostics, self.noisy, self.kw = problem.solver.gather_x, diagnostics, drv.noisy, kw
        self.problem, self.solver, self.axis, self.start = problem, problem.solver, axis, start
        self.checkpointer, self.steps, self.desc = checkpointer, problem.steps, "simulate_sharded (euler)"
        self.show = bool(problem.options.progress.show) and rank_and_world(group)[0] == 0
        u = axis.unview
        self.rec = Recorder(problem.steps, problem.record_every, diagnostics=diagnostics, records=None if resume is None
                            else {k: [u(t) for t in v] for k, v in resume["records"].items()})
        if resume is not None:
            self.x = x = u(resume["x"])
            drv.load_state(resume["driver"])
        self.keys = shard.gather(x)
        self.cur = self._evaluate(x, self.keys, drv.current, diagnostics)
        self.zero = torch.zeros(self.cur.velocity.shape[:-2], dtype=x.dtype, device=x.device)
        red = self._reduce(x, self.cur, [], "the velocity field", self.cur.velocity)
        acc = None if resume is None or not diagnostics else {k: u(v) for k, v in resume["acc"].items()}
        self.ledger = Ledger(red[0], sign=sign, quadrature="left", acc=acc) if diagnostics else None
        self._take(red)
        if resume is None:
            self._record()

    @property
    def k(self) -> int:
        """The steps done."""
        return self.drv.k

    @property
    def t(self) -> float:
        """The time of the current step."""
        return self.drv.t

    def view(self) -> torch.Tensor:
        """This rank's tokens in the caller's batch convention (the callback's x)."""
        return self.axis.view(self.x)

    def state(self) -> dict:
        """This rank's state for its checkpoint: tokens, Θ's driver, records, ledger sums."""
        v = self.axis.view
        st = {"x": v(self.x.detach()), "driver": self.drv.state(),
              "records": {k: [v(t).clone() for t in vals] for k, vals in self.rec.records.items()}}
        if self.diagnostics:
            st["acc"] = {k: v(t) for k, t in self.ledger.acc.items()}
        return st

    def finish(self) -> Trajectory:
        """The records as a Trajectory (energy, 𝒢², 𝒟 and the ledger global, identical on every rank)."""
        model, o, solver, group = self.problem.model, self.problem.options, self.solver, self.solver.group
        times, out_x, series, led, _ = self.rec.stacked(o.t0, o.dt)
        stats = {"steps": self.steps, "field_evaluations": self.steps + 1, "order": 1,
                 "wall_time": time.perf_counter() - self.start, "ranks": rank_and_world(group)[1],
                 "tokens": self.shard.N}
        return self.axis.finish(Trajectory(times, out_x, series["energy"], series["slope"], series["dissipation"], led,
                                           stats, solver.method, model.normalization.name, model.direction,
                                           model.weights))

    def _evaluate(self, xk, keys, heads, diag):
        return evaluate(xk, heads, self.shard.query, keys=keys, key_weights=self.shard.keys, sign=self.sign,
                        diagnostics=diag, second_moment=diag and self.noisy, **self.kw)

    def _reduce(self, x, e, extra, what, *check):
        """All-reduce [E, 𝒢², 𝒟, ∂_tE (+ Itô), *extra] of the evaluation e at x (nothing without
        diagnostics) with the NaN flag of ``check``; NonFiniteError on every rank when any flagged."""
        drv = self.drv
        entries = [] if not self.diagnostics else [
            e.energy, e.slope, e.dissipation,
            partial_density(x, drv.current, self.shard.query, e.stats, drv.rate, drv.sigma, ito=self.noisy), *extra]
        red, bad = _reduce_with_flag(entries, _flag(*check), self.zero, self.shard.group)
        if bad:
            raise nonfinite_error(what, drv.t, drv.k, drv.current)
        return red

    def _take(self, red):
        if self.diagnostics:
            self.E, G2, Dis, dens_p = red[:4]
            self.dens = {"partial": dens_p, "dissipation": Dis, "slope": G2}

    def _record(self):
        x = self.keys if self.gather_x else self.x
        if not self.diagnostics:
            return self.rec.record(x)
        self.rec.record(x, self.E, self.dens["slope"], self.dens["dissipation"], self.ledger.terms(self.E))

    def step(self):
        """t_k → t_{k+1}: martingale at the left end, the Euler step, one evaluation and one all-reduce,
        the ledger (left point, jumps of Θ), the record."""
        drv, x, heads, cur = self.drv, self.x, self.drv.current, self.cur
        noise = drv.prepare() if self.noisy else None
        diag_noise = self.diagnostics and noise is not None
        mart = pairing(x, heads, self.shard.query, cur.stats, noise) if diag_noise else 0.0
        x_new, _ = self.solver.step(ParticleState(x, cur.velocity, None, _EULER.geometry), drv.t, self.dt)
        jumps = drv.jumps()
        drv.advance()
        keys = self.shard.gather(x_new)
        nxt = self._evaluate(x_new, keys, drv.current, self.diagnostics)
        before = self._evaluate(x_new, keys, heads, True).energy if (self.diagnostics and jumps) else 0.0
        red = self._reduce(x_new, nxt, [mart, before], "the token positions or the velocity field", x_new,
                           nxt.velocity)
        if self.diagnostics:
            if diag_noise:
                self.ledger.add("martingale", red[4])
            self.ledger.integrate(self.dens, None, self.dt)
            self._take(red)
            if jumps:
                self.ledger.add("partial", self.E - red[5])
        self.x, self.cur, self.keys = x_new, nxt, keys
        if self.rec.keeps(self.drv.k):
            self._record()
