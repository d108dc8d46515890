"""JKO (minimizing-movement) solver of the transformer PDE: Lagrangian and Eulerian.

One step of size τ from μ_k at t_k (descent; ascent minimises −E):

    μ_{k+1} ∈ argmin_μ  E(μ, Θ_{t_{k+1}}) + W_{b_k}(μ, μ_k)² / (2τ),
    W_{b_k}(μ, μ_k)² = min_{π ∈ Π(μ_k, μ)} ∫ c_k(x, y) dπ(x, y),   c_k(x, y) = b_k(x) |x − y|²,

with the weighted cost frozen at the effective mobility of the previous step,
b_k = b[μ_k, Θ_{t_k}], b^{-1} = Σ_h ω̄_h / m_h (:func:`transformer_pde.model.mobility`).

**Which power of b, and why.**  The metric of docs/model.md#jko is g_μ(v, v) = ∫ b |v|² dμ.  The
gradient flow in this metric solves g_μ(V, u) = −dE[u] for all u, i.e. ∫ b⟨V, u⟩ dμ =
−∫⟨∇_S δE/δμ, u⟩ dμ, so V = −b^{-1} ∇_S δE/δμ — the "effective" field of
:func:`transformer_pde.velocity` (descent).  The JKO step must reproduce it: for
μ = Σ w_i δ_{y_i} with the identity coupling the objective is

    F(y) = E(y, t_{k+1}) + Σ_i w_i b_k(x_i) |y_i − x_i|² / (2τ),

and ∂F/∂y_i = w_i ∇δE/δμ(y_i) + w_i b_k(x_i)(y_i − x_i)/τ, so the first-order condition on the
sphere is P_{y_i}(y_i − x_i)/τ = −b_k(x_i)^{-1} ∇_S δE/δμ(y_i): exactly the projected implicit
Euler step y_i = (x_i + τ V(y_i)) / |x_i + τ V(y_i)| of ẋ = V with V = −b_k^{-1} ∇_S δE/δμ, the
mobility frozen at the old positions.  The proximal weight is therefore b (not 1/b); this is
tested against an independent fixed-point implicit Euler in ``tests/test_jko.py``.  With
``mobility="unit"`` (b ≡ 1) the same scheme is the plain W2 flow, V = −∇_S δE/δμ, which is the
"unnormalized" field for tied symmetric heads.

Files (docs/model.md#jko): this module is the front end — :func:`solve_jko` (the implementation, from
:class:`~transformer_pde.Model` and the solver objects :class:`~transformer_pde.LagrangianJKO` /
:class:`~transformer_pde.EulerianJKO`), :func:`jko` (the keyword front end, a thin wrapper that builds those
objects), Θ_t through :class:`~transformer_pde.processes.weights.WeightDriver` (as :func:`transformer_pde.simulate`
reads it), and the run shared by both schemes (batch layout, diagnostics, ledger, records).  The schemes live in
:mod:`~transformer_pde.solvers.jko_lagrangian` (tokens move: transports "emd", "sinkhorn", "identity") and
:mod:`~transformer_pde.solvers.jko_eulerian` (weights on a fixed grid move; :func:`to_grid`,
:func:`self_potential`); the inner optimiser of the Lagrangian step is the Riemannian L-BFGS of
:mod:`~transformer_pde.solvers.lbfgs`, whose retraction is the model's geometry seam
(``model.geometry.retract``, x ↦ x/|x| for the projected flow).

Each Lagrangian step records the first-order optimality residual (the velocity error in L²(μ) of
:mod:`~transformer_pde.solvers.jko_lagrangian`) and its inner iteration count; a step stops when
r ≤ tol·r₀ + 100·u·(1/τ + r₀).  A non-finite residual never counts as converged; neither does a step in which a
token with mass has a mobility below the scale's range (it could not move).  A step that does not
converge warns with its step, time and residual (``strict=True``: raises :class:`JKOConvergenceError`).
Descent from y = x makes F(y) ≤ F(x), so the discrete energy inequality below holds for every accepted
step.

Batch axes: the run always carries a leading paths axis (size ``paths``, or 1) in front of the broadcast batch
of the measure and the heads, and drops it once at the end when ``paths=None``; the output shapes are those
of :func:`jko`'s docstring.

Discrete energy ledger (every step k → k+1, W² the proximal value actually minimised):

    E(μ_{k+1}, t_{k+1}) + W²/(2τ) ≤ E(μ_k, t_k) + [E(μ_k, t_{k+1}) − E(μ_k, t_k)],

whose defect (left − right, ≤ 0 up to round-off) is recorded per step.  The running ledger uses
the keys of :func:`transformer_pde.simulate`: "dE", "partial" = Σ [E(μ_j, t_{j+1}) − E(μ_j, t_j)]
(the energy change due to Θ, noise included, so "martingale" is 0), "slope" = Σ W²/τ (≈ ∫𝒢²),
"dissipation" = s Σ [W²/(2τ) + (τ/2)|∂E|²(μ_{j+1})] (the De Giorgi form, ≈ ∫𝒟),
"residual" = dE − partial − dissipation (→ 0 like τ), "residual_slope" = dE − partial − s·slope,
and "jko_defect" = the running sum of the defects (≤ 0).  Energies, 𝒢², 𝒟 and every ledger term are
reported times e^{−c} with one common scale per run (``stats["energy_log_scale"]`` = c, chosen at t0 by
:func:`transformer_pde.model.energy.choose_log_scale`, 0 for ordinary runs), as :func:`simulate` does; the
ledger is linear, so its identities hold at any scale.

The heads must be tied (V_h = A_h): the scheme is the gradient flow of E, which does not see V;
untied values are refused (ValueError) rather than silently ignored.
"""

from __future__ import annotations

import math
import time
import warnings
from types import SimpleNamespace
from typing import Callable, Optional, Union

import torch

from ..utils import threads
from ..utils.validation import (
    broadcast_shapes, check_bool, check_choice, check_every, check_int, check_limits, check_positive, check_real,
    check_same, check_seed_generator, check_tensor, check_tied_all, check_token_weights, check_tokens,
    direction_sign,
)
from ..model.attention import softmax_statistics
from ..model.energy import choose_log_scale
from ..model.field import FieldEval, evaluate, log_inverse_mobility, token_mean
from ..model.heads import Heads
from ..processes.driver import WeightDriver, grid_steps, path_bytes
from ..processes.paths import WeightPath
from ..processes.weights import Process
from .jko_eulerian import check_grid_type, entropy, eulerian_step, resolve_grid, self_potential, to_grid
from .jko_lagrangian import lagrangian_step, scaled_energy
from .methods import EMD, EulerianJKO, Identity, LagrangianJKO, RiemannianLBFGS, Sinkhorn
from .model import Model
from .noise import TokenNoise
from .options import LedgerOptions, Limits, Progress, SaveAt
from .trajectory import NonFiniteError, Trajectory, nonfinite_error
from .parts import LEDGER_KEYS as STEP_LEDGER_KEYS, Ledger, Recorder, progress_bar

__all__ = ["jko", "solve_jko", "to_grid", "self_potential", "JKOConvergenceError", "TRANSPORTS", "SCHEMES", "MOBILITIES", "COSTS"]

TRANSPORTS = ("emd", "sinkhorn", "identity")
SCHEMES = ("lagrangian", "eulerian")
MOBILITIES = ("effective", "unit")
COSTS = ("source", "symmetric")
LEDGER_KEYS = (*STEP_LEDGER_KEYS, "jko_defect")


class JKOConvergenceError(RuntimeError):
    """An inner JKO solve did not reach its tolerance (raised with ``strict=True``)."""


# ---------------------------------------------------------------------------- heads in time
def _flatten_heads(h: Heads, batch: tuple, B: int) -> Heads:
    """Heads broadcast to the batch shape and flattened to one batch axis of size B."""
    if len(h.batch_shape) == 0:
        return h

    def fl(t, tail):
        if t is None:
            return None
        t = t.expand(*batch, *t.shape[t.dim() - tail:])
        return t.reshape(B, *t.shape[len(batch):])

    beta = fl(h.beta, 0) if isinstance(h.beta, torch.Tensor) and h.beta.dim() > 0 else h.beta
    return h.replace(score=fl(h.score, 3), value=fl(h.value, 3), weights=fl(h.weights, 1), query=fl(h.query, 3),
                     key=fl(h.key, 3), beta=beta, symmetric=h.known_symmetric)


class _Theta:
    """Θ_t at the JKO times t_k = t0 + kτ, read through :class:`~transformer_pde.processes.weights.WeightDriver`, the
    driver :func:`transformer_pde.simulate` reads it with.

    A closed-form process (and constant heads) is read on the driver's grid of step τ; a noisy or Euler-scheme
    process is sampled on the grid of step ``path_dt`` (τ / path_dt whole) as the steps go, the driver storing
    the path (``traj.path``: the WeightPath that ``sample_path`` with the same seed gives); a stored WeightPath is
    replayed, linearly interpolated between its grid values where τ (or t0) is off its grid."""

    def __init__(self, theta: Process, *, t0, tau, paths, seed, generator, path_dt, batch_rank):
        self.t0, self.tau = t0, tau
        self.given = theta if isinstance(theta, WeightPath) else None
        self.sampled = self.given is None and not theta.closed_form
        if self.given is not None:
            self.origin, self.dt, self.last = float(theta.times[0]), theta.dt, len(theta.times) - 1
            self.drv = WeightDriver(theta, paths=None, generator=None, seed=0, t0=self.origin, dt=theta.dt)
        else:
            dt = path_dt if self.sampled and path_dt is not None else tau
            self.ratio = round(tau / dt)
            self.drv = WeightDriver(theta, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt,
                                    store=self.sampled, batch_rank=batch_rank)

    def heads(self, k: int) -> Heads:
        """Θ at t_k (k = 0, 1, ... in increasing order: the driver only moves forward)."""
        if self.given is None:
            while self.drv.k < k * self.ratio:
                self.drv.advance()
            return self.drv.current
        u = (self.t0 + k * self.tau - self.origin) / self.dt  # WeightPath.heads_at's reading of its grid
        j = min(max(int(math.floor(u + 1e-9)), 0), self.last)
        frac = u - j
        while self.drv.k < j:
            self.drv.advance()
        if j == self.last or abs(frac) < 1e-9:
            return self.drv.current
        return self.drv.stage(frac)

    def path(self) -> Optional[WeightPath]:
        """The weight path the run saw: the stored one, the sampled one, or None (closed form)."""
        if self.given is not None:
            return self.given
        return self.drv.path() if self.sampled else None


def _theta_source(theta: Process, *, t0, tau, steps, paths, seed, generator, path_dt, batch_rank, max_steps,
                  max_memory) -> _Theta:
    """The :class:`_Theta` of a process or stored path, after the checks of its grid (theta and path_dt already
    checked; paths refused next to a stored path)."""
    t_end = t0 + steps * tau
    if isinstance(theta, WeightPath):
        if paths is not None:
            raise ValueError("a stored WeightPath already carries its paths axis; call jko without paths=")
        theta.check_covers(t0, t_end)
        if theta.dt > 0:
            ratio, offset = tau / theta.dt, (t0 - float(theta.times[0])) / theta.dt
            if abs(ratio - round(ratio)) > 1e-6 * max(1.0, ratio) or abs(offset - round(offset)) > 1e-6:
                warnings.warn(
                    f"tau = {tau:.6g} (or t0) is not a multiple of the weight path's dt = {theta.dt:.6g}: the JKO "
                    f"steps see the path linearly interpolated between its grid values", stacklevel=5)
    elif not theta.closed_form:
        dt = tau if path_dt is None else path_dt
        ratio = tau / dt
        if abs(ratio - round(ratio)) > 1e-9 * max(1.0, ratio) or round(ratio) < 1:
            raise ValueError(f"path_dt = {dt:.6g} must divide tau = {tau:.6g} (tau / path_dt = {ratio:.6g} is not a "
                             f"whole number); choose path_dt = tau / k")
        K = steps * round(ratio)  # the limits of sample_path on the same grid
        check_limits(f"sample_path on [{t0:.6g}, {t_end:.6g}] with dt = {dt:.6g}", steps=K,
                     memory={"the stored path": path_bytes(theta.heads0, K, paths, theta.noisy)},
                     max_steps=max_steps, max_memory=max_memory, device=theta.heads0.device,
                     fix="use fewer paths or a larger dt")
    return _Theta(theta, t0=t0, tau=tau, paths=paths, seed=seed, generator=generator, path_dt=path_dt,
                  batch_rank=batch_rank)


# ---------------------------------------------------------------------------- checks
def _check_x0(x0, h_ref: Heads):
    check_tokens(x0, "x0")
    check_same(x0, h_ref.reference, "x0", "theta's heads")
    if x0.shape[-1] != h_ref.dim:
        raise ValueError(f"the heads act on d = {h_ref.dim} but x0 has d = {x0.shape[-1]}")



def _check_measure(x0, theta, lagrangian: bool, *, weights, grid, grid_weights, bandwidth):
    """The checks of the initial measure: tokens x0 and their weights (Lagrangian), or the grid z and its weights
    q0 (given, or x0 deposited with :func:`to_grid`) (Eulerian).  Returns (z, q0), (None, None) for Lagrangian."""
    h_ref = theta if isinstance(theta, Heads) else theta.heads0
    check_tied_all(theta, "jko")
    if lagrangian:
        if x0 is None:
            raise ValueError("the Lagrangian scheme needs the initial tokens x0 (..., n, d)")
        _check_x0(x0, h_ref)
        check_token_weights(weights, x0, "weights", "x0")
        return None, None
    if weights is not None:
        raise ValueError("weights= are token weights of the Lagrangian scheme; for the Eulerian scheme give "
                         "grid_weights= (or tokens x0, deposited with to_grid)")
    z = resolve_grid(grid, h_ref.dim, h_ref.dtype, h_ref.device)
    check_same(z, h_ref.reference, "grid", "theta's heads")
    if grid_weights is None:
        if x0 is None:
            raise ValueError("the Eulerian scheme needs grid_weights= (..., m) or tokens x0 to deposit on the grid")
        _check_x0(x0, h_ref)
        return z, to_grid(x0, z, bandwidth=bandwidth)
    if x0 is not None:
        raise ValueError("give either tokens x0 or grid_weights for the Eulerian scheme, not both")
    check_token_weights(grid_weights, z, "grid_weights", "grid")
    return z, grid_weights



def _measure_batch(x0, theta, o, lagrangian: bool) -> tuple:
    """The batch shape of the initial measure broadcast against the heads' (without a paths axis)."""
    h0 = theta if isinstance(theta, Heads) else theta.heads0
    state = x0 if lagrangian else o.q0
    xb = tuple(state.shape[:-2] if lagrangian else state.shape[:-1])
    if lagrangian and o.weights is not None:
        xb = tuple(broadcast_shapes(xb, o.weights.shape[:-1]))
    hb = tuple(h0.batch_shape)
    try:
        return tuple(broadcast_shapes(xb, hb))
    except RuntimeError:
        raise ValueError(f"the batch shape of the initial measure {xb} does not broadcast against the heads' "
                         f"batch shape {hb}") from None


def _estimate_memory(state, theta, o, lagrangian: bool) -> dict:
    """Estimated bytes of the large arrays of a JKO solve (name -> bytes), before any of them exists."""
    item = state.element_size()
    h0 = theta if isinstance(theta, Heads) else theta.heads0
    H, d = h0.num_heads, h0.dim
    n = state.shape[-2] if lagrangian else o.z.shape[-2]
    xb = tuple(state.shape[:-2] if lagrangian else state.shape[:-1])
    B = float(math.prod(xb)) * float(math.prod(tuple(h0.batch_shape)) or 1) * (o.paths or 1)
    T = o.steps // o.record_every + 2
    out = {"the recorded measures": T * B * n * (d + 1) * item, "the kernel blocks": B * H * n * n * item * 4,
           "the transport plans and costs": B * n * n * item * 4}
    if isinstance(theta, Process) and not isinstance(theta, WeightPath) and not theta.closed_form:
        dt = o.tau if o.path_dt is None else o.path_dt
        K = max(1, round(o.steps * o.tau / dt))
        out["the sampled weight path"] = path_bytes(h0, K, o.paths, theta.noisy)
    return out


def _check_keywords(o: SimpleNamespace, theta) -> SimpleNamespace:
    """The checks of the scalar settings of :func:`jko` (before any work), normalised in place: the defaults of
    transport and cost, the sign of the direction."""
    o.tau = check_positive(o.tau, "tau")
    o.steps = check_int(o.steps, "steps")
    check_choice(o.scheme, SCHEMES, "scheme")
    lagrangian = o.scheme == "lagrangian"
    if o.transport is None:
        o.transport = "emd" if lagrangian else "sinkhorn"
    check_choice(o.transport, TRANSPORTS, "transport")
    if not lagrangian and o.transport != "sinkhorn":
        raise ValueError(f"the Eulerian scheme moves weights on a fixed grid with entropic transport: use "
                         f"transport='sinkhorn' (got {o.transport!r}); transport='emd' / 'identity' are Lagrangian")
    o.sign = direction_sign(o.direction)
    o.sgn = -o.sign
    check_choice(o.mobility, MOBILITIES, "mobility")
    o.unit = o.mobility == "unit"
    if o.cost is None:
        o.cost = "symmetric" if o.transport == "sinkhorn" else "source"
    check_choice(o.cost, COSTS, "cost")
    if o.transport == "sinkhorn" and lagrangian and o.cost != "symmetric":
        raise ValueError("the debiased Sinkhorn divergence needs a symmetric cost: use cost='symmetric' (the default) "
                         "with transport='sinkhorn'")
    if not lagrangian and o.cost != "symmetric":
        raise ValueError("the Eulerian scheme uses the symmetric cost ½(b_k(z_a) + b_k(z_b))|z_a − z_b|²: "
                         "use cost='symmetric' (the default)")
    o.eps = check_positive(o.eps, "eps")
    o.t0 = check_real(o.t0, "t0")
    o.seed = check_seed_generator(o.seed, o.generator)
    if o.generator is not None:
        o.seed = None  # the draws come from the generator (sample_path refuses a seed next to it)
    if not isinstance(o.strict, bool):
        raise TypeError(f"strict must be True or False, got {type(o.strict).__name__}")
    check_bool(o.diagnostics, "diagnostics")
    o.max_iter = check_int(o.max_iter, "max_iter")
    o.max_plan_updates = check_int(o.max_plan_updates, "max_plan_updates")
    o.record_every = check_every(o.record_every, "record_every", o.steps, f"steps = {o.steps} of tau = {o.tau:.6g}")
    o.sinkhorn_scaling = check_positive(o.sinkhorn_scaling, "sinkhorn_scaling")
    if not o.sinkhorn_scaling < 1:
        raise ValueError(f"sinkhorn_scaling must lie in (0, 1), got {o.sinkhorn_scaling}")
    if o.paths is not None:
        o.paths = check_int(o.paths, "paths")
    if not isinstance(theta, (Heads, Process)):
        raise TypeError(f"theta must be a Heads, a Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom) or a "
                        f"WeightPath, got {type(theta).__name__}")
    return o


def _check_jko_args(x0, theta, **settings) -> SimpleNamespace:
    """Every check of a JKO solve, before any work: the settings (the keywords of :func:`jko`), normalised, with
    the sign of the direction, the grid z and weights q0 (Eulerian; None otherwise), the tolerance, the batch
    shape and the source of Θ_t (:class:`_Theta`)."""
    o = _check_keywords(SimpleNamespace(**settings), theta)
    lagrangian = o.scheme == "lagrangian"
    o.z, o.q0 = _check_measure(x0, theta, lagrangian, weights=o.weights, grid=o.grid, grid_weights=o.grid_weights,
                               bandwidth=o.bandwidth)
    if o.tol is None:
        dtype = (x0 if lagrangian else o.q0).dtype
        o.tol = (1e-6 if o.transport == "sinkhorn" and lagrangian else 1e-9) if dtype == torch.float64 else 1e-4
    else:
        o.tol = check_positive(o.tol, "tol")
    if o.path_dt is not None:
        o.path_dt = check_positive(o.path_dt, "path_dt")
    o.batch = _measure_batch(x0, theta, o, lagrangian)
    check_limits(f"jko with {o.steps} steps of tau = {o.tau:.6g}", steps=o.steps,
                 memory=_estimate_memory(x0 if lagrangian else o.q0, theta, o, lagrangian),
                 max_steps=o.max_steps, max_memory=o.max_memory, device=(x0 if lagrangian else o.q0).device,
                 fix="record fewer steps (record_every=), use fewer paths or a coarser path_dt")
    o.theta = _theta_source(theta, t0=o.t0, tau=o.tau, steps=o.steps, paths=o.paths, seed=o.seed,
                            generator=o.generator, path_dt=o.path_dt, batch_rank=len(o.batch),
                            max_steps=o.max_steps, max_memory=o.max_memory)
    return o


def _check_jko_temperature(temperature, scheme: str) -> float:
    """temperature= of :func:`jko`: a finite T ≥ 0; T > 0 only with the Eulerian scheme."""
    T = TokenNoise(temperature).temperature  # the same check as simulate(temperature=...)
    if T > 0 and scheme != "eulerian":
        raise ValueError(f"temperature={T} > 0 needs scheme='eulerian' (the entropy T∫ρ log ρ of a density on a grid); "
                         "for noisy particles use tp.simulate(..., temperature=T)")
    return T


def jko(
    x0: Optional[torch.Tensor],
    theta: Union[Heads, Process],
    *,
    tau: float,
    steps: int,
    t0: float = 0.0,
    transport: Optional[str] = None,
    scheme: str = "lagrangian",
    direction: str = "descent",
    mobility: str = "effective",
    cost: Optional[str] = None,
    eps: float = 1e-3,
    weights: Optional[torch.Tensor] = None,
    grid=None,
    grid_weights: Optional[torch.Tensor] = None,
    bandwidth: Optional[float] = None,
    paths: Optional[int] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    path_dt: Optional[float] = None,
    tol: Optional[float] = None,
    max_iter: int = 200,
    max_plan_updates: int = 20,
    sinkhorn_scaling: float = 0.95,
    strict: bool = False,
    record_every: int = 1,
    diagnostics: bool = True,
    progress: bool = False,
    callback: Optional[Callable] = None,
    max_steps: Optional[int] = None,
    max_memory: Optional[float] = None,
    temperature: float = 0.0,
) -> Trajectory:
    """Minimizing-movement (JKO) solution of the transformer PDE (module docstring for the scheme).

        μ_{k+1} ∈ argmin_μ  s'·E(μ, Θ_{t_{k+1}}) + W_{b_k}(μ, μ_k)² / (2τ),   s' = +1 descent, −1 ascent

    Parameters
    ----------
    x0 : Optional[torch.Tensor]
        tokens (..., n, d) on the sphere (Lagrangian; Eulerian: deposited on the grid with
        :func:`to_grid` unless ``grid_weights`` is given, in which case x0 may be None).
    theta : Union[Heads, Process]
        :class:`Heads`, a Process (closed-form ones are evaluated at t_k; noisy or
        Euler-scheme ones are first sampled with :func:`transformer_pde.sample_path` on a grid
        of step ``path_dt`` (default τ), returned in ``traj.path``), or a stored
        :class:`WeightPath` — give the particle run and the JKO run the same path.
    tau, steps
        step τ > 0 and number of steps; times t0 + kτ.
    transport : Optional[str]
        "emd" (exact plan, default Lagrangian), "sinkhorn" (debiased Sinkhorn
        divergence, geomloss; the only — and default — choice for the Eulerian scheme, there
        the entropic proximal term of the module docstring) or "identity" (implicit Euler
        of the particles).
    scheme : str
        "lagrangian" (tokens move) | "eulerian" (weights on a fixed grid move).
    direction : str
        "descent" (minimise E, the reference code) or "ascent" (minimise −E).
    mobility : str
        "effective" (b_k, matches ``normalization="effective"`` particles) or "unit"
        (b ≡ 1, the plain W2 flow; matches "unnormalized" for tied symmetric heads).
    cost : Optional[str]
        "source" (b_k(x)|x − y|², default for emd / identity) or "symmetric"
        (½(b_k(x) + b_k(y))|x − y|², always used by sinkhorn and by the Eulerian scheme).
    eps : float
        ε > 0 of the entropic transport (cost units; Eulerian needs ε ≳ grid spacing²).
    weights : Optional[torch.Tensor]
        token weights (..., n) or None (uniform) (Lagrangian).
    grid
        Eulerian grid, tensor (m, d) on the sphere or int m (circle_grid / fibonacci_sphere).
    grid_weights : Optional[torch.Tensor]
        initial Eulerian weights (..., m) (non-negative, sum 1).  bandwidth: of to_grid.
    paths, seed, generator, path_dt
        Monte-Carlo paths and sampling of noisy processes (seed None
        means 0; giving seed and generator together is refused).  With ``paths=P`` the results carry an
        axis P in front of the batch of x0 and the heads (as :func:`simulate`'s); Θ_t is sampled by the
        :class:`~transformer_pde.processes.weights.WeightDriver` as the steps go, the draws of
        :func:`transformer_pde.sample_path` with the same seed.
    tol : Optional[float]
        relative tolerance of the inner solves (default 1e-9 in float64, 1e-4 in float32; with
        transport="sinkhorn" 1e-6 / 1e-4: geomloss' ε-scaling returns potentials, hence
        gradients, that are consistent with its values only to about 1 − sinkhorn_scaling).
    max_iter : int
        inner iterations per solve.  max_plan_updates: emd plan recomputations per step.
    sinkhorn_scaling : float
        geomloss ε-scaling ratio of the Lagrangian sinkhorn transport.
    strict : bool
        raise :class:`JKOConvergenceError` instead of warning when a step does not converge.
    record_every : int
        keep every k-th step (first and last always kept); at most ``steps``.
    diagnostics : bool
        energy, 𝒢², 𝒟 series (the ledger is always kept).
    progress : bool
        tqdm progress bar.  callback: called as callback(k, t, state) after every step.
    max_steps, max_memory
        limits checked before any work: the number of steps (default 10⁷)
        and the estimated bytes of the records, the kernel and transport blocks and a sampled
        weight path (default 3/4 of the machine's memory); refused above either.
    temperature : float
        T ≥ 0, Eulerian only: the Fokker–Planck JKO, μ_{k+1} ∈ argmin s'E + T∫ρ log ρ +
        W²/(2τ) (ρ the density against the grid's uniform measure: circle and Fibonacci grids are
        equal-area).  The energies and the ledger are then those of Ẽ = E + s'T∫ρ log ρ (the free
        energy F = s'Ẽ is what decreases), and the ledger's "dissipation" uses the discrete slope
        W²/τ² in place of |∂F|² (so "residual" = "residual_slope", → 0 like τ); docs/noisy_tokens.md.

    Returns
    -------
    Trajectory
        :class:`Trajectory` (the type :func:`simulate` returns), dtype and device of the input:
        ``times`` (T,); ``x`` (T, ..., n, d) tokens — Eulerian: the grid (T, ..., m, d) with the
        time-dependent weights in ``weights`` (T, ..., m); ``energy``, ``slope`` 𝒢², ``dissipation`` 𝒟
        (T, ...) of the gradient-flow field ("effective" or, for unit mobility, "unnormalized");
        ``ledger`` (module docstring); ``stats`` with per-step tensors (steps, ...) "residual",
        "iterations", "converged", "defect", "prox" (the W² of each step), "plan_updates", and the
        scalars "steps", "wall_time", "max_defect", "max_residual", "mean_iterations",
        "nonconverged_steps", "order" = 1, "energy_log_scale" = c (energies, 𝒢², 𝒟, ledger and "prox" are
        reported times e^{−c}); ``path`` the sampled WeightPath (noisy processes);
        ``extras`` {"scheme", "transport", "tau", "mobility", "cost", "eps", "grid"}.  Outputs carry no gradient.

    Raises
    ------
    TypeError, ValueError
        for bad input (before any work), NonFiniteError when a step
        produces NaN/inf (time, step, quantity), JKOConvergenceError with strict=True.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x0 = tp.sphere.octahedral(12, dtype=torch.float64)
    >>> heads = tp.Heads.scalar([1.0, 2.0], 3).to(torch.float64)
    >>> traj = tp.jko(x0, heads, tau=0.1, steps=3)
    >>> traj.x.shape, bool((traj.stats["defect"] <= 1e-12).all())
    (torch.Size([4, 12, 3]), True)
    """
    check_bool(progress, "progress", allow_none=True)
    o = _check_keywords(SimpleNamespace(
        tau=tau, steps=steps, t0=t0, transport=transport, scheme=scheme, direction=direction, mobility=mobility,
        cost=cost, eps=eps, seed=seed, generator=generator, strict=strict, diagnostics=diagnostics,
        max_iter=max_iter, max_plan_updates=max_plan_updates, record_every=record_every,
        sinkhorn_scaling=sinkhorn_scaling, paths=paths), theta)
    T = _check_jko_temperature(temperature, scheme)
    # the checks the objects below would word in their own terms, here in jko's
    if weights is not None:
        if scheme == "eulerian":
            raise ValueError("weights= are token weights of the Lagrangian scheme; for the Eulerian scheme give "
                             "grid_weights= (or tokens x0, deposited with to_grid)")
        check_tensor(weights, "weights", min_dim=1)
    if scheme == "eulerian":
        check_grid_type(grid)
    for name, value in (("tol", tol), ("path_dt", path_dt), ("bandwidth", bandwidth)):
        if value is not None:
            check_positive(value, name)
    if max_steps is not None:
        max_steps = check_int(max_steps, "max_steps")
    if max_memory is not None and not (isinstance(max_memory, float) and max_memory == math.inf):
        max_memory = check_positive(max_memory, "max_memory")
    model = Model(theta, normalization="unnormalized" if o.unit else "effective", direction=direction,
                  noise=T if T > 0 else None, weights=weights)
    if scheme == "lagrangian":
        tr = {"emd": lambda: EMD(o.cost), "identity": lambda: Identity(o.cost),
              "sinkhorn": lambda: Sinkhorn(o.eps, o.sinkhorn_scaling)}[o.transport]()
        solver = LagrangianJKO(tr, RiemannianLBFGS(tol, o.max_iter, o.max_plan_updates), path_dt=path_dt,
                               strict=strict)
    else:
        solver = EulerianJKO(grid, grid_weights, bandwidth, o.eps, tol, o.max_iter, path_dt=path_dt, strict=strict)
    return solve_jko(model, x0, solver, t1=o.t0 + o.steps * o.tau, dt=o.tau, t0=o.t0, steps=o.steps, paths=paths,
                     seed=seed, generator=generator, saveat=SaveAt(every=o.record_every),
                     ledger=LedgerOptions(diagnostics=diagnostics), progress=Progress(progress, callback),
                     limits=Limits(max_steps, max_memory))


def solve_jko(model: Model, x0: Optional[torch.Tensor], solver: Union[LagrangianJKO, EulerianJKO], *, t1: float,
              dt: float, t0: float = 0.0, steps: Optional[int] = None, paths: Optional[int] = None,
              seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
              saveat: Optional[SaveAt] = None, ledger: Optional[LedgerOptions] = None, checkpoint=None,
              progress: Optional[Progress] = None, limits: Optional[Limits] = None) -> Trajectory:
    """:func:`transformer_pde.solve` for the JKO solver objects: the minimizing movement of ``model`` from x0
    (module docstring), step τ = ``dt``, from t0 to t1.

    Parameters
    ----------
    model : Model
        Θ_t, the normalisation (its ``jko_mobility``: "effective" → b_k, "unit" → b ≡ 1; "relu" has none), the
        direction, the token weights (Lagrangian) and the token noise (Eulerian: the entropy T∫ρ log ρ).  The
        projected, non-causal model only.
    x0 : torch.Tensor or None
        tokens (..., n, d) (Eulerian: deposited on the grid unless ``solver.grid_weights`` is given; then None).
    solver : LagrangianJKO or EulerianJKO
        the scheme with its settings (transport and inner optimiser; grid).
    t1, dt, t0
        final time, step τ and start: ``steps`` = (t1 − t0)/τ must be whole.
    steps : Optional[int]
        the number of steps when the caller knows it (:func:`jko`): then t1 is not re-derived from it.
    paths, seed, generator
        Monte-Carlo paths of a noisy Θ_t and their random stream.
    saveat, ledger, progress, limits
        :class:`~transformer_pde.SaveAt` (``every`` / ``ends``), :class:`~transformer_pde.LedgerOptions`
        (``diagnostics``), :class:`~transformer_pde.Progress`, :class:`~transformer_pde.Limits` (``max_steps``,
        ``max_memory``); None: the defaults.
    checkpoint
        must be None (the JKO schemes have no checkpoints).

    Returns
    -------
    Trajectory
        as :func:`jko` returns it.

    Raises
    ------
    TypeError
        an option the JKO schemes do not take (before any work).
    ValueError
        bad input or a model the scheme does not solve (before any work); NonFiniteError, JKOConvergenceError
        as :func:`jko`.
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must be a tp.Model, got {type(model).__name__}")
    if not isinstance(solver, (LagrangianJKO, EulerianJKO)):
        raise TypeError(f"solve_jko solves LagrangianJKO or EulerianJKO, got {type(solver).__name__}")
    saveat, ledger = SaveAt() if saveat is None else saveat, LedgerOptions() if ledger is None else ledger
    progress, limits = Progress(show=False) if progress is None else progress, Limits() if limits is None else limits
    for name, value, cls in (("saveat", saveat, SaveAt), ("ledger", ledger, LedgerOptions),
                             ("progress", progress, Progress), ("limits", limits, Limits)):
        if not isinstance(value, cls):
            raise TypeError(f"{name}= must be a {cls.__name__}, got {type(value).__name__}")
    if checkpoint is not None:
        raise TypeError(f"{type(solver).__name__} has no checkpoints: drop checkpoint=")
    norm = model.normalization
    if norm.jko_mobility is None:
        raise ValueError(f"{type(solver).__name__} solves the gradient flow of E: model.normalization must be "
                         f"'effective' (mobility b_k) or 'unnormalized' (b ≡ 1), got {norm.name!r} (softmax equals "
                         f"'effective' for one head)")
    if ledger.quadrature is not None or ledger.quadratic_variation != "expected" or \
            ledger.energy_log_scale is not None:
        raise TypeError(f"{type(solver).__name__} keeps its own ledger: LedgerOptions takes only diagnostics= here")
    if saveat.observables is not None or saveat.path:
        raise TypeError(f"{type(solver).__name__} records no observables and always returns a sampled noisy path: "
                        f"use SaveAt(every=...) or SaveAt(ends=True)")
    if not model.geometry.projected or model.causal:
        raise ValueError(f"{type(solver).__name__} solves the projected, non-causal model only")
    if limits.chunk_elements is not None:
        raise TypeError(f"{type(solver).__name__} has no chunked kernel: drop Limits(chunk_elements=)")
    lagrangian = isinstance(solver, LagrangianJKO)
    if lagrangian and model.noise is not None:
        raise ValueError("token noise with a JKO solver needs EulerianJKO (the entropy of a density on a grid)")
    if not lagrangian and model.weights is not None:
        raise ValueError("EulerianJKO carries its weights on the grid: give EulerianJKO(grid_weights=...) instead "
                         "of Model(weights=...)")
    if steps is None:
        steps = grid_steps(check_real(t0, "t0"), check_real(t1, "t1"), check_positive(dt, "dt"))
    common = dict(tau=dt, steps=steps, t0=t0, direction=model.direction, mobility=norm.jko_mobility, paths=paths,
                  seed=seed, generator=generator, path_dt=solver.path_dt, strict=solver.strict,
                  record_every=saveat.record_every(steps), diagnostics=ledger.diagnostics,
                  max_steps=limits.max_steps, max_memory=limits.max_memory)
    if lagrangian:
        tr = solver.transport
        o = _check_jko_args(x0, model.theta, scheme="lagrangian", transport=tr.name,
                            cost=getattr(tr, "cost", "symmetric"), eps=getattr(tr, "eps", 1e-3),
                            sinkhorn_scaling=getattr(tr, "scaling", 0.95), weights=model.weights, grid=None,
                            grid_weights=None, bandwidth=None, tol=solver.inner.tol, max_iter=solver.inner.max_iter,
                            max_plan_updates=solver.inner.max_plan_updates, **common)
    else:
        o = _check_jko_args(x0, model.theta, scheme="eulerian", transport="sinkhorn", cost="symmetric",
                            eps=solver.eps, sinkhorn_scaling=0.95, weights=None, grid=solver.grid,
                            grid_weights=solver.grid_weights, bandwidth=solver.bandwidth, tol=solver.tol,
                            max_iter=solver.max_iter, max_plan_updates=20, **common)
    o.temperature, o.retract = model.temperature, model.geometry.retract
    start = time.perf_counter()
    run = _JKORun(x0, o)
    with progress_bar(progress.show, o.steps, f"jko ({o.scheme}, {o.transport})") as bar, \
            threads.scope(run.work) as pool:
        for k in range(o.steps):
            t_new, new_state = run.step(k)
            if progress.callback is not None:
                progress.callback(k + 1, t_new, new_state)
            bar.update(1)
            pool.refresh()
    run.warn_nonconverged()
    return run.trajectory(start)


class _JKORun:
    """One JKO solve: the batch layout (flattened to B), the proximal steps (Lagrangian or Eulerian),
    the diagnostics in the scheme's metric, the ledger (:class:`~.parts.Ledger` with the extra
    ``jko_defect`` term) and the recorder.

    The state is the tokens (B, n, d) (Lagrangian) or the grid weights (B, m) (Eulerian); :meth:`measure`
    gives the points and weights of the measure it stands for.  Energies, 𝒢², 𝒟 and the ledger are
    reported times e^{−c}, c = ``self.c`` the common scale chosen at t0."""

    def __init__(self, x0, o: SimpleNamespace):
        self.o, self.lagrangian, self.c = o, o.scheme == "lagrangian", 0.0
        self.norm = "unnormalized" if o.unit else "effective"
        self.prox_kw = dict(tau=o.tau, sgn=o.sgn, eps=o.eps, tol=o.tol, max_iter=o.max_iter)
        self.lag_kw = dict(transport=o.transport, symmetric=o.cost == "symmetric", unit=o.unit,
                           scaling=o.sinkhorn_scaling, max_plan_updates=o.max_plan_updates, retract=o.retract)
        self.rec = Recorder(o.steps, o.record_every, diagnostics=True, ledger_keys=LEDGER_KEYS)
        self.rec.records.update({"w": [], "ledger.jko_defect": []})
        self.S = {k: [] for k in ("residual", "iterations", "converged", "defect", "prox", "plan_updates")}
        self.bad_steps, self.bad_residuals = [], []
        self._layout(x0)
        self._start()

    def _layout(self, x0):
        """The batch layout: a paths axis (``paths``, or 1) in front of the broadcast batch of the measure and the
        heads (``o.batch``), flattened to one axis of size B."""
        o, weights = self.o, self.o.weights
        state = (x0 if self.lagrangian else o.q0).detach()
        event = tuple(state.shape[-2:] if self.lagrangian else state.shape[-1:])  # (n, d) or (m,)
        batch = (o.paths or 1, *o.batch)
        self.out_batch = batch if o.paths is not None else batch[1:]  # the paths axis is dropped at the end
        B, n = math.prod(batch), event[0]
        self.batch, self.B, self.n, self.warm = batch, B, n, None
        self.f = dict(dtype=state.dtype, device=state.device)
        self.state = state.expand(*batch, *event).reshape(B, *event)
        if self.lagrangian:
            self.w = None if weights is None else weights.detach().expand(*batch, n).reshape(B, n)
            self.wt = torch.full((B, n), 1.0 / n, **self.f) if self.w is None else self.w
        else:
            self.pts = o.z.expand(B, *o.z.shape)

    def measure(self, state):
        """(points, weights) of the measure: the tokens and token weights, or the grid and the state."""
        return (state, self.w) if self.lagrangian else (self.pts, state)

    def flat(self, k: int) -> Heads:
        """Θ at t_k, flattened to the batch axis B."""
        return _flatten_heads(self.o.theta.heads(k), self.batch, self.B)

    # ------------------------------------------------------------------ diagnostics in the scheme's metric
    def entropy_term(self, p) -> torch.Tensor:
        """s'·T Σ_b p_b log(m p_b) · e^{−c} (B,): the entropy part of Ẽ = E + s'T∫ρ log ρ (0 at T = 0)."""
        return entropy(p, 0.0 if self.lagrangian else self.o.temperature, self.o.sgn, self.c)

    def evaluate(self, points, wts, heads) -> FieldEval:
        """The field, energy, 𝒢² and 𝒟 of the measure (points, wts), times e^{−c} (with temperature: Ẽ)."""
        ev = self._evaluate(points, wts, heads)
        if getattr(self.o, "temperature", 0.0) > 0 and not self.lagrangian:
            ev = ev.replace(energy=ev.energy + self.entropy_term(wts))
        return ev

    def _evaluate(self, points, wts, heads) -> FieldEval:
        ev = evaluate(points, heads, wts, normalization=self.norm, sign=self.o.sign, diagnostics=True, log_scale=self.c)
        # the scheme's field is the gradient flow V = s g / b (b ≡ 1 for "unit"): 𝒢² = Σ w b|V|² = Σ w |g|²/b
        # and 𝒟 = Σ w ⟨g, V⟩ = s 𝒢², formed from g b^{-1/2} (no |V|² ~ e^{2β‖A‖} in between)
        G = self.metric_slope(ev.grad_first_variation, ev.stats.log_partition, heads, wts)
        return ev.replace(slope=G, dissipation=self.o.sign * G, ambient=None)

    def metric_slope(self, g, log_partition, heads, wts):
        """|∂E|² e^{−c} in the scheme's metric: Σ w |∇δE|²/b (effective) or Σ w |∇δE|² (unit); g = ∇_S δE/δμ e^{−c}."""
        # |g|²/b · e^{−c} = |g e^{−c} · (e^{c}/b)^{1/2}|², scaled before squaring (finite whenever the result is)
        lbinv = torch.zeros_like(g[..., 0]) if self.o.unit else log_inverse_mobility(heads, log_partition)
        g = g * torch.exp(0.5 * (lbinv + self.c)).unsqueeze(-1)
        return token_mean(g.square().sum(-1), wts)

    def check(self, ev, t, k, heads):
        """NonFiniteError unless the energy (and, with diagnostics, 𝒢² and 𝒟) are finite."""
        if not bool(torch.isfinite(ev.energy).all()):
            raise nonfinite_error("the energy", t, k, heads)
        if self.o.diagnostics:
            for name, v in (("the metric slope 𝒢²", ev.slope), ("the dissipation 𝒟", ev.dissipation)):
                if not bool(torch.isfinite(v).all()):
                    err = nonfinite_error(name, t, k, heads, self.norm)
                    raise NonFiniteError(f"{err} (the JKO step itself does not need it: diagnostics=False)")

    # ------------------------------------------------------------------ steps
    def _start(self):
        """Θ at t0, the common scale, the first evaluation and record."""
        t0, (pts, w) = self.o.t0, self.measure(self.state)
        self.heads_cur = self.flat(0)
        with torch.no_grad():
            self.c = choose_log_scale(softmax_statistics(pts, self.heads_cur, w).log_partition)
        ev = self.evaluate(pts, w, self.heads_cur)
        self.check(ev, t0, 0, self.heads_cur)
        self.log_c = torch.full((self.B,), self.c, **self.f)
        self.work = float(self.B) * self.heads_cur.num_heads * self.n * self.n
        self.ledger = Ledger(ev.energy, sign=self.o.sign)
        self.ledger.acc["jko_defect"] = self.ledger.acc["partial"]
        self._accept(self.state, ev, record=True)

    def _accept(self, state, ev, record: bool):
        """Move to the new state, evaluated in ``ev``: the mobility and energy of the next step, the record."""
        self.state, self.E_prev = state, ev.energy
        lse = ev.stats.log_partition  # log b ("unit": 0)
        self.lb = torch.zeros_like(lse[..., 0, :]) if self.o.unit else -log_inverse_mobility(self.heads_cur, lse)
        if record:
            self.rec.record(self.measure(state)[0], ev.energy, ev.slope, ev.dissipation,
                            {**self.ledger.terms(ev.energy), "jko_defect": self.ledger.acc["jko_defect"]})
            self.rec.records["w"].append(state)

    def _proximal(self, heads_new, t_new, k):
        """The JKO step's minimiser (the new state) and the inner solve's info."""
        if self.lagrangian:
            new, info = lagrangian_step(self.state, self.w, self.wt, self.heads_cur, heads_new, self.lb,
                                         **self.prox_kw, **self.lag_kw, out_log_scale=self.c)
            if new is None:
                raise nonfinite_error("the JKO objective", t_new, k + 1, heads_new)
        else:
            with torch.no_grad():
                new, info, self.warm = eulerian_step(self.o.z, self.state, self.heads_cur, heads_new, self.lb,
                                                      **self.prox_kw, warm=self.warm,
                                                      temperature=self.o.temperature)
                if self.c != 0.0:
                    info["prox"] = info["prox"] * math.exp(-self.c)
        if not bool(torch.isfinite(info["residual"]).all()):  # the velocity error itself overflows the dtype
            raise nonfinite_error("the inner residual (velocity error |P(y − x)/τ − V|)", t_new, k + 1, heads_new,
                                  self.norm)
        if not bool(torch.isfinite(new).all()):
            raise nonfinite_error("the token positions" if self.lagrangian else "the grid weights",
                                  t_new, k + 1, heads_new)
        return new, info

    def step(self, k):
        """JKO step k → k + 1 with its ledger terms; returns (t_{k+1}, the new state)."""
        o, tau = self.o, self.o.tau
        t_new = o.t0 + (k + 1) * tau
        heads_new = self.flat(k + 1)
        pts, w = self.measure(self.state)
        with torch.no_grad():
            E_cross = scaled_energy(pts, heads_new, w, self.log_c) + (0.0 if self.lagrangian else self.entropy_term(w))
        if not bool(torch.isfinite(E_cross).all()):
            raise nonfinite_error("the energy", t_new, k + 1, heads_new)
        new_state, info = self._proximal(heads_new, t_new, k)
        new_pts, new_w = self.measure(new_state)
        with torch.no_grad():
            self.heads_cur = heads_new
            ev = self.evaluate(new_pts, new_w, self.heads_cur)
        self.check(ev, t_new, k + 1, self.heads_cur)
        prox = info["prox"]
        defect = o.sgn * (ev.energy - E_cross) + prox / (2 * tau)
        led = self.ledger
        led.add("partial", E_cross - self.E_prev)
        led.add("slope", prox / tau)
        if getattr(o, "temperature", 0.0) > 0:  # the discrete slope W²/τ² in place of |∂F|² (docstring of jko)
            led.add("dissipation", o.sign * prox / tau)
        else:
            led.add("dissipation", o.sign * (prox / (2 * tau) + 0.5 * tau * self.metric_slope(
                ev.grad_first_variation, ev.stats.log_partition, self.heads_cur, new_w)))
        led.add("jko_defect", defect)
        for key in ("partial", "slope", "dissipation", "jko_defect"):
            if not bool(torch.isfinite(led.acc[key]).all()):
                raise nonfinite_error(f"the ledger term {key!r}", t_new, k + 1, self.heads_cur)
        for key in self.S:
            self.S[key].append(defect if key == "defect" else info[key])
        if not bool(info["converged"].all()):
            self._not_converged(k, t_new, info)
        self._accept(new_state, ev, record=self.rec.keeps(k + 1))
        return t_new, new_state

    def _not_converged(self, k, t_new, info):
        """Note a step whose inner solve missed its tolerance (warned at the end); JKOConvergenceError if strict."""
        self.bad_steps.append(k + 1)
        self.bad_residuals.append(float(info["residual"][~info["converged"]].max()))
        if not self.o.strict:
            return
        what = (f" (velocity error in L²(μ); {float(info['r0'].max()):.3e} at the start)" if "r0" in info
                else " (‖T(p) − p‖₁)")
        sinkhorn = self.lagrangian and self.o.transport == "sinkhorn"
        raise JKOConvergenceError(
            f"JKO step {k + 1} (t = {t_new:.6g}) did not converge in {self.o.max_iter} inner iterations: residual "
            f"{self.bad_residuals[-1]:.3e}{what}; raise max_iter, loosen tol, or reduce tau"
            + (" (with transport='sinkhorn': raise sinkhorn_scaling towards 1 or lower eps)" if sinkhorn else ""))

    def warn_nonconverged(self):
        if self.bad_steps:
            b, r = self.bad_steps, self.bad_residuals
            warnings.warn(f"{len(b)} of {self.o.steps} JKO steps did not reach the inner tolerance (first: step "
                          f"{b[0]}, t = {self.o.t0 + b[0] * self.o.tau:.6g}, residual {r[0]:.3e}; largest "
                          f"residual {max(r):.3e}); see traj.stats['residual'] — raise max_iter, loosen tol, "
                          f"or reduce tau (strict=True raises instead)", RuntimeWarning, stacklevel=4)

    def trajectory(self, start: float) -> Trajectory:
        """The records and per-step statistics, from the flat batch axis to the batch shape."""
        o, batch, T = self.o, self.out_batch, len(self.rec.steps)
        times, xs, series, ledger, _ = self.rec.stacked(o.t0, o.tau)
        xs = xs.reshape(T, *batch, *xs.shape[2:])
        ledger = {key: v.reshape(T, *batch) for key, v in ledger.items()}
        series = {key: v.reshape(T, *batch) if o.diagnostics else None for key, v in series.items()}
        st = {key: torch.stack([v.reshape(batch) for v in vals]) for key, vals in self.S.items()}
        stats = {**st, "steps": o.steps, "wall_time": time.perf_counter() - start,
                 "max_defect": float(st["defect"].max()), "max_residual": float(st["residual"].max()),
                 "mean_iterations": float(st["iterations"].double().mean()), "nonconverged_steps": len(self.bad_steps),
                 "energy_log_scale": self.c, "order": 1}
        extras = {"scheme": o.scheme, "transport": o.transport, "tau": o.tau, "mobility": o.mobility, "cost": o.cost,
                  "eps": o.eps if o.transport == "sinkhorn" else None, "grid": None if self.lagrangian else o.z}
        if self.lagrangian:  # the token weights; Eulerian: the grid weights of every record
            weights = None if self.w is None else self.wt.reshape(*batch, self.n)
        else:
            weights = torch.stack([v.reshape(*batch, self.n) for v in self.rec.records["w"]])
        return Trajectory(times, xs, series["energy"], series["slope"], series["dissipation"], ledger, stats,
                          f"jko-{o.scheme}-{o.transport}", self.norm, o.direction, weights, o.theta.path(), extras,
                          paths=o.paths)
