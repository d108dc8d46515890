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

Files (docs/model.md#jko): this module is the keyword front end :func:`jko` (it checks the keywords in their own
names, builds the :class:`~transformer_pde.Model`, the solver object and the options and calls
:func:`transformer_pde.solve`).  The solver objects :class:`~transformer_pde.LagrangianJKO` and
:class:`~transformer_pde.EulerianJKO` (:mod:`~transformer_pde.solvers.jko.methods`) run themselves: every check
before any work in :mod:`~transformer_pde.solvers.jko.problem` (the frozen checked problem), Θ_t through the
:class:`~transformer_pde.processes.weights.WeightDriver` in :mod:`~transformer_pde.solvers.jko.theta` (as
:func:`transformer_pde.simulate` reads it), and the run shared by both variants (batch layout, diagnostics,
ledger, records) in :mod:`~transformer_pde.solvers.jko.run`.  The steps live in
:mod:`~transformer_pde.solvers.jko.lagrangian` (tokens move: transports "emd", "sinkhorn", "identity") and
:mod:`~transformer_pde.solvers.jko.eulerian` (weights on a fixed grid move; :func:`to_grid`,
:func:`self_potential`); the inner optimiser of the Lagrangian step is the Riemannian L-BFGS of
:mod:`~transformer_pde.solvers.jko.lbfgs`, whose retraction is the model's geometry seam
(``model.layer_norm.retract``, x ↦ x/|x| for the projected flow).

Each Lagrangian step records the first-order optimality residual (the velocity error in L²(μ) of
:mod:`~transformer_pde.solvers.jko.lagrangian`) and its inner iteration count; a step stops when
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
from typing import Callable, Optional, Union

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import (
    DIRECTIONS, check_bool, check_choice, check_every, check_int, check_positive, check_real, check_seed_generator,
    check_tensor,
)
from ...model.heads import Heads
from ...processes.weights import Process
from ...dynamics.model import Model
from ...dynamics.noise import TokenNoise
from ..options import LedgerOptions, Limits, Progress, SaveAt
from ..solve import solve
from ..trajectory import Trajectory
from .eulerian import check_grid_type, self_potential, to_grid
from .methods import EulerianJKO, LagrangianJKO
from .problem import VARIANTS
from .run import JKOConvergenceError
from .transport import EMD, Identity, RiemannianLBFGS, SinkhornTransport, TransportTerm

__all__ = ["jko", "to_grid", "self_potential", "JKOConvergenceError", "TRANSPORTS", "SCHEMES", "MOBILITIES", "COSTS"]

TRANSPORTS = ("emd", "sinkhorn", "identity")
#: the values of jko's ``scheme=`` (the JKO variants)
SCHEMES = VARIANTS
MOBILITIES = ("effective", "unit")
COSTS = ("source", "symmetric")


# ---------------------------------------------------------------------------- the keywords, in their own names
def _check_steps(tau, steps, t0, record_every) -> tuple:
    """(τ, steps, t0, record_every), checked."""
    tau = check_positive(tau, "tau")
    steps = check_int(steps, "steps")
    t0 = check_real(t0, "t0")
    return tau, steps, t0, check_every(record_every, "record_every", steps, f"steps = {steps} of tau = {tau:.6g}")


def _transport_term(variant: str, transport, cost, eps, sinkhorn_scaling) -> tuple:
    """The transport keywords of the variant (``scheme=``, checked), checked, with their defaults: (transport term
    or None (Eulerian), cost, ε)."""
    lagrangian = variant == "lagrangian"
    if transport is None:
        transport = "emd" if lagrangian else "sinkhorn"
    check_choice(transport, TRANSPORTS, "transport")
    if not lagrangian and transport != "sinkhorn":
        raise ValueError(f"the Eulerian scheme moves weights on a fixed grid with entropic transport: use "
                         f"transport='sinkhorn' (got {transport!r}); transport='emd' / 'identity' are Lagrangian")
    if cost is None:
        cost = "symmetric" if transport == "sinkhorn" else "source"
    check_choice(cost, COSTS, "cost")
    if transport == "sinkhorn" and lagrangian and cost != "symmetric":
        raise ValueError("the debiased Sinkhorn divergence needs a symmetric cost: use cost='symmetric' (the default) "
                         "with transport='sinkhorn'")
    if not lagrangian and cost != "symmetric":
        raise ValueError("the Eulerian scheme uses the symmetric cost ½(b_k(z_a) + b_k(z_b))|z_a − z_b|²: "
                         "use cost='symmetric' (the default)")
    eps = check_positive(eps, "eps")
    sinkhorn_scaling = check_positive(sinkhorn_scaling, "sinkhorn_scaling")
    if not sinkhorn_scaling < 1:
        raise ValueError(f"sinkhorn_scaling must lie in (0, 1), got {sinkhorn_scaling}")
    if not lagrangian:
        return None, cost, eps
    term = {"emd": lambda: EMD(cost), "identity": lambda: Identity(cost),
            "sinkhorn": lambda: SinkhornTransport(eps, sinkhorn_scaling)}[transport]()
    return term, cost, eps


def _check_inner(tol, max_iter, max_plan_updates, strict) -> tuple:
    """(tol, max_iter, max_plan_updates), checked; strict a bool."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {type(strict).__name__}")
    max_iter = check_int(max_iter, "max_iter")
    max_plan_updates = check_int(max_plan_updates, "max_plan_updates")
    return (None if tol is None else check_positive(tol, "tol")), max_iter, max_plan_updates


def _check_run(seed, generator, paths, diagnostics, max_steps, max_memory) -> Limits:
    """The random stream, paths, diagnostics and the limits, checked; the :class:`Limits`."""
    check_seed_generator(seed, generator)
    check_bool(diagnostics, "diagnostics")
    if paths is not None:
        check_int(paths, "paths")
    if max_steps is not None:
        max_steps = check_int(max_steps, "max_steps")
    if max_memory is not None and not (isinstance(max_memory, float) and max_memory == math.inf):
        max_memory = check_positive(max_memory, "max_memory")
    return Limits(max_steps, max_memory)


def _model(theta, variant: str, direction: str, mobility: str, weights, temperature) -> Model:
    """The :class:`Model` of the keywords (theta, direction, mobility, token weights, temperature), checked in their
    names first."""
    if not isinstance(theta, (Heads, Process)):
        raise TypeError(f"theta must be a Heads, a Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom) or a "
                        f"WeightPath, got {type(theta).__name__}")
    check_choice(direction, DIRECTIONS, "direction")
    check_choice(mobility, MOBILITIES, "mobility")
    T = TokenNoise(temperature).temperature  # the same check as simulate(temperature=...)
    if T > 0 and variant != "eulerian":
        raise ValueError(f"temperature={T} > 0 needs scheme='eulerian' (the entropy T∫ρ log ρ of a density on a grid); "
                         "for noisy particles use tp.simulate(..., temperature=T)")
    if weights is not None:
        if variant == "eulerian":
            raise ValueError("weights= are token weights of the Lagrangian scheme; for the Eulerian scheme give "
                             "grid_weights= (or tokens x0, deposited with to_grid)")
        check_tensor(weights, "weights", min_dim=1)
    return Model(theta, normalization="unnormalized" if mobility == "unit" else "effective", direction=direction,
                 temperature=T, weights=weights)


def jko(
    x0: Optional[torch.Tensor],
    theta: Union[Heads, Process],
    *,
    tau: float,
    steps: int,
    t0: float = 0.0,
    transport: Optional[str] = None,
    scheme: str = "lagrangian",
    direction: str = DEFAULT_DIRECTION,
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
        "ascent" (the default: minimise −E) or "descent" (minimise E, the reference code).
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
    tau, steps, t0, record_every = _check_steps(tau, steps, t0, record_every)
    variant = check_choice(scheme, SCHEMES, "scheme")
    term, cost, eps = _transport_term(variant, transport, cost, eps, sinkhorn_scaling)
    tol, max_iter, max_plan_updates = _check_inner(tol, max_iter, max_plan_updates, strict)
    limits = _check_run(seed, generator, paths, diagnostics, max_steps, max_memory)
    model = _model(theta, variant, direction, mobility, weights, temperature)
    if variant == "eulerian":
        check_grid_type(grid)
    for name, value in (("path_dt", path_dt), ("bandwidth", bandwidth)):
        if value is not None:
            check_positive(value, name)
    if isinstance(term, TransportTerm):
        solver = LagrangianJKO(term, RiemannianLBFGS(tol, max_iter, max_plan_updates), path_dt=path_dt, strict=strict)
    else:
        solver = EulerianJKO(grid, grid_weights, bandwidth, eps, tol, max_iter, path_dt=path_dt, strict=strict)
    return solve(model, x0, solver, t1=t0 + steps * tau, dt=tau, t0=t0, paths=paths, seed=seed, generator=generator,
                 saveat=SaveAt(record_every), ledger=LedgerOptions(diagnostics=diagnostics),
                 progress=Progress(progress, callback), limits=limits)
