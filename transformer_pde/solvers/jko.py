"""JKO (minimizing-movement) solver of the transformer PDE: Lagrangian and Eulerian.

One step of size τ from μ_k at t_k (descent; ascent minimises −E):

    μ_{k+1} ∈ argmin_μ  E(μ, Θ_{t_{k+1}}) + W_{b_k}(μ, μ_k)² / (2τ),
    W_{b_k}(μ, μ_k)² = min_{π ∈ Π(μ_k, μ)} ∫ c_k(x, y) dπ(x, y),   c_k(x, y) = b_k(x) |x − y|²,

with the weighted cost frozen at the effective mobility of the previous step,
b_k = b[μ_k, Θ_{t_k}], b^{-1} = Σ_h ω̄_h / m_h (:func:`transformer_pde.mobility`).

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

Transports of the Lagrangian scheme (tokens y_i are the unknowns, weights w_i are carried):

* ``"identity"``: π = diag(w) (token i goes to token i) — implicit Euler for the particles;
* ``"emd"``: the exact plan (POT ``emd``) of the cost c_k between μ_k and the current iterate,
  held FIXED during an inner solve and recomputed at its solution; the outer loop stops when
  the old plan is still optimal (block-coordinate descent in (y, π), monotone in F);
* ``"sinkhorn"``: the debiased Sinkhorn divergence S_ε (geomloss, :mod:`transformer_pde.transport`).
  The debiased divergence needs a symmetric cost, so here c_k(x, y) = ½(b_k(x) + b_k(y))|x − y|²,
  with b_k the mobility field of μ_k evaluated anywhere on the sphere; it agrees with
  b_k(x)|x − y|² up to O(|x − y|³), which changes a step by O(τ²).  ``cost="symmetric"`` uses the
  same cost with emd / identity (for like-for-like comparisons).

The inner solver is Riemannian L-BFGS whose initial inverse Hessian is the metric preconditioner
τ/(w_i b_k(x_i)) (a near-Newton step for small τ), with the projective retraction y ↦ y/|y| and
Armijo backtracking, vectorised over the batch.  It minimises F/c, c = 2^k ≈ max_i b_k(x_i) per batch
item: E and the proximal term both grow like e^{β⟨Ax, y⟩}, and F/c — evaluated from the
log-partitions, e^{log m_h − log c} — stays O(1) where F overflows (dividing the whole objective by one
number does not move its minimiser).  A stiff step (τ|V| > ½: the effective field at large β‖A‖ with
heads of different scales is ~ max_h m_h / min_h m_h) is divided further so that the first
preconditioned step moves a token by at most ½, and every iteration is capped at ½ per token (a trust
region, inactive for τ|V| < ½).  Each step records the first-order optimality residual, the velocity
error in L²(μ),

    r = ( Σ_i w_i |G_i|² )^{1/2},   G_i = P_{y_i} ∂F/∂y_i / (w_i b_k(x_i))   (= P(y_i − x_i)/τ − V_k(y_i)),

computed without squaring large numbers, and the inner iteration count; a step stops when
r ≤ tol·r₀ + 100·u·(1/τ + r₀) (r₀ the value at y = x, u the unit round-off) — for a stiff step every
token with mass must also meet that bound with its own |G_i| and r₀_i, since the tokens' scales can
span more than 1/u.  A non-finite residual never counts as converged; neither does a step in which a
token with mass has a mobility below the scale's range (it could not move).  A step that does not
converge warns with its step, time and residual (``strict=True``: raises :class:`JKOConvergenceError`).
Descent from y = x makes F(y) ≤ F(x), so the discrete energy inequality below holds for every accepted
step.  Massless tokens (w_i = 0) do not enter F and stay where they are.

Eulerian scheme (a density solver, independent of the particles): the measure is
μ = Σ_a p_a δ_{z_a} on a fixed grid (``tp.sphere.circle_grid`` on S¹, ``fibonacci_sphere`` or
``icosphere`` on S²) and the unknowns are the weights p.  With the symmetric cost
C_ab = ½(b_k(z_a) + b_k(z_b))|z_a − z_b|² the step minimises, over couplings π with first
marginal q = p_k (the second marginal p = πᵀ1 is free),

    ε KL(π | π^ε_{qq}) + 2τ s' E(πᵀ1, t_{k+1}),

where π^ε_{qq} = q_a q_b e^{(f_a + f_b − C_ab)/ε} ∈ Π(q, q) is the entropic self-transport plan of q
(potential f from :func:`self_potential`).  The proximal term D_ε(p | q) = min_{π ∈ Π(q, p)}
ε KL(π | π^ε_{qq}) = OT_ε(q, p) + ε KL(p | q) − ⟨f, p + q⟩ (OT_ε with KL(π | q⊗p)) is ≥ 0 and
vanishes at p = q: without energy the step returns q exactly (no entropic blur, the role
debiasing plays in S_ε); as ε → 0, f → 0 and D_ε → W_{b_k}(q, p)².  The first-order condition is
the fixed point

    p = T(p),  T(p)_b = Σ_a q_a softmax_b(log q_b + (f_b − C_ab − 2τ s' δE/δμ[p](z_b))/ε),

solved by damped iteration (it contracts like an explicit step of the smooth energy part, a
handful of iterations for moderate τ).  The weights stay ≥ 0 and sum to 1 by construction; grid
points where q vanishes stay empty, so start from a strictly positive density (:func:`to_grid`
gives one from tokens).  Resolution needs ε ≳ (grid spacing)²; the recorded residual is
‖T(p) − p‖₁.

Discrete energy ledger (every step k → k+1, W² the proximal value actually minimised):

    E(μ_{k+1}, t_{k+1}) + W²/(2τ) ≤ E(μ_k, t_k) + [E(μ_k, t_{k+1}) − E(μ_k, t_k)],

whose defect (left − right, ≤ 0 up to round-off) is recorded per step.  The running ledger uses
the keys of :func:`transformer_pde.simulate`: "dE", "partial" = Σ [E(μ_j, t_{j+1}) − E(μ_j, t_j)]
(the energy change due to Θ, noise included, so "martingale" is 0), "slope" = Σ W²/τ (≈ ∫𝒢²),
"dissipation" = s Σ [W²/(2τ) + (τ/2)|∂E|²(μ_{j+1})] (the De Giorgi form, ≈ ∫𝒟),
"residual" = dE − partial − dissipation (→ 0 like τ), "residual_slope" = dE − partial − s·slope,
and "jko_defect" = the running sum of the defects (≤ 0).  Energies, 𝒢², 𝒟 and every ledger term are
reported times e^{−c} with one common scale per run (``stats["energy_log_scale"]`` = c, chosen at t0 by
:func:`transformer_pde.energy.choose_log_scale`, 0 for ordinary runs), as :func:`simulate` does; the
ledger is linear, so its identities hold at any scale.

The heads must be tied (V_h = A_h): the scheme is the gradient flow of E, which does not see V;
untied values are refused (ValueError) rather than silently ignored.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections import deque
from types import SimpleNamespace
from typing import Callable, Optional, Union

import torch

from .. import threads
from .._validation import (broadcast_shapes, check_bool, check_choice, check_every, check_int, check_limits,
                           check_positive, check_real, check_same, check_seed_generator, check_tied_all,
                           check_token_weights, check_tokens, direction_sign)
from ..attention import softmax_statistics
from ..energy import choose_log_scale
from ..field import FieldEval, evaluate, head_token_mean, log_inverse_mobility, token_mean
from ..mobility import scaled_diagnostics
from ..heads import Heads
from ..processes import Process, WeightPath, grid_steps, path_bytes, sample_path
from ..sphere import circle_grid, fibonacci_sphere, normalize, tangent_projection
from ..transport import emd_plans, sq_chordal, sinkhorn_divergence
from .methods import LagrangianJKO
from .noise import TokenNoise
from .particle import NonFiniteError, Trajectory, nonfinite_error
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


def _theta_source(theta, *, t0, t_end, tau, paths, seed, generator, path_dt, max_steps=None, max_memory=None):
    """(heads_at(t) callable, WeightPath or None) for Heads / closed-form process / noisy process / stored path
    (theta and path_dt already checked)."""
    if isinstance(theta, Heads):
        return (lambda t: theta), None
    if isinstance(theta, WeightPath):
        if paths is not None:
            raise ValueError("a stored WeightPath already carries its paths axis; call jko without paths=")
        theta.check_covers(t0, t_end)
        if theta.dt > 0:
            ratio, offset = tau / theta.dt, (t0 - float(theta.times[0])) / theta.dt
            if abs(ratio - round(ratio)) > 1e-6 * max(1.0, ratio) or abs(offset - round(offset)) > 1e-6:
                warnings.warn(
                    f"tau = {tau:.6g} (or t0) is not a multiple of the weight path's dt = {theta.dt:.6g}: the JKO "
                    f"steps see the path linearly interpolated between its grid values", stacklevel=4)
        return theta.heads_at, theta
    if theta.closed_form:
        return theta.heads_at, None
    dt = tau if path_dt is None else path_dt
    ratio = tau / dt
    if abs(ratio - round(ratio)) > 1e-9 * max(1.0, ratio) or round(ratio) < 1:
        raise ValueError(f"path_dt = {dt:.6g} must divide tau = {tau:.6g} (tau / path_dt = {ratio:.6g} is not a whole "
                         f"number); choose path_dt = tau / k")
    path = sample_path(theta, t1=t_end, dt=dt, t0=t0, paths=paths, seed=seed, generator=generator,
                       max_steps=max_steps, max_memory=max_memory)
    return path.heads_at, path


def _energy(y: torch.Tensor, heads: Heads, w: Optional[torch.Tensor], logc: torch.Tensor) -> torch.Tensor:
    """The scaled energy E(μ, Θ) / e^{logc} = Σ_h ω_h/(2β) Σ_i w_i e^{log m_h(y_i) − logc}, (B,), from the
    log-partitions (differentiable, no validation; logc (B,))."""
    lse = softmax_statistics(y, heads, w).log_partition - logc[:, None, None]  # (B, H, n)
    return (heads.weights * head_token_mean(torch.exp(lse), w)).sum(-1) / (2 * heads.beta)


def _first_variation(z: torch.Tensor, heads: Heads, p: torch.Tensor) -> torch.Tensor:
    """δE/δμ at the grid points for μ = Σ p_a δ_{z_a}: Σ_h ω_h (m_h + m̃_h)/(2β), (B, m)."""
    omega, beta = heads.weights.unsqueeze(-1), heads.beta
    s = softmax_statistics(z, heads, p)
    g = (omega * torch.exp(s.log_partition)).sum(-2)
    if not heads.is_symmetric:
        st = softmax_statistics(z, heads, p, transpose=True)
        g = 0.5 * (g + (omega * torch.exp(st.log_partition)).sum(-2))
    return g / (beta.unsqueeze(-1) if isinstance(beta, torch.Tensor) and beta.dim() > 0 else beta)


# ---------------------------------------------------------------------------- grid helpers
def _resolve_grid(grid, d, dtype, device) -> torch.Tensor:
    if grid is None:
        raise ValueError("scheme='eulerian' needs grid=: a tensor (m, d) of points on the sphere, or an int m "
                         "(circle_grid on S¹, fibonacci_sphere on S²)")
    if isinstance(grid, bool) or not isinstance(grid, (int, torch.Tensor)):
        got = "a bool" if isinstance(grid, bool) else type(grid).__name__
        raise TypeError(f"grid must be a tensor (m, d) or an int m, got {got}")
    if isinstance(grid, int):
        if grid < 3:
            raise ValueError(f"an int grid is the number of grid points m >= 3, got {grid}")
        if d == 2:
            return circle_grid(grid, dtype=dtype, device=device)
        if d == 3:
            return fibonacci_sphere(max(grid, 4), dtype=dtype, device=device)
        raise ValueError(f"an int grid is only understood on S¹ (d = 2) and S² (d = 3); for d = {d} pass the grid "
                         f"points as a tensor (m, {d})")
    check_tokens(grid, "grid")
    if grid.dim() != 2:
        raise ValueError(f"grid must have shape (m, d) (one grid shared by the batch), got {tuple(grid.shape)}")
    if grid.shape[0] < 3:
        raise ValueError(f"grid must have at least 3 points, got {grid.shape[0]}")
    if grid.shape[-1] != d:
        raise ValueError(f"grid points live in d = {grid.shape[-1]} but the heads act on d = {d}")
    return grid


def _grid_spacing(grid: torch.Tensor) -> float:
    """Mean nearest-neighbour distance of the grid points."""
    D = sq_chordal(grid, grid)
    D.fill_diagonal_(float("inf"))
    return float(D.min(-1).values.clamp_min(0).sqrt().mean())


def to_grid(x: torch.Tensor, grid: torch.Tensor, *, weights: Optional[torch.Tensor] = None,
            bandwidth: Optional[float] = None) -> torch.Tensor:
    """Strictly positive grid weights from tokens by a von Mises–Fisher kernel density.

        q_a ∝ Σ_i w_i exp((⟨z_a, x_i⟩ − 1) / h²),   Σ_a q_a = 1,

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) on the sphere.  grid: points z (m, d) on the sphere.
    weights : Optional[torch.Tensor]
        token weights (..., n) or None (uniform).
    bandwidth : Optional[float]
        h > 0 (an angle, radians); default 2 × the grid's mean nearest-neighbour distance.

    Returns
    -------
    torch.Tensor
        (..., m) weights, computed by log-sum-exp and clamped at the smallest normal number
        before normalising, so that every entry is > 0 (the Eulerian JKO needs a positive start).
    """
    check_tokens(x, "x")
    check_tokens(grid, "grid")
    check_same(x, grid, "x", "grid")
    if grid.dim() != 2 or grid.shape[-1] != x.shape[-1]:
        raise ValueError(f"grid must have shape (m, {x.shape[-1]}), got {tuple(grid.shape)}")
    check_token_weights(weights, x)
    h = 2 * _grid_spacing(grid) if bandwidth is None else check_positive(bandwidth, "bandwidth")
    s = (x @ grid.T - 1) / (h * h)  # (..., n, m)
    if weights is not None:
        s = s + torch.log(weights).unsqueeze(-1)
    logq = torch.logsumexp(s, -2)
    q = torch.exp(logq - torch.logsumexp(logq, -1, keepdim=True)).clamp_min(torch.finfo(x.dtype).tiny)
    return q / q.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------- inner solver
def _value_and_grad(objective: Callable, y: torch.Tensor):
    with torch.enable_grad():
        yv = y.detach().requires_grad_(True)
        val = objective(yv)
        (g,) = torch.autograd.grad(val.sum(), yv)
    return val.detach(), g


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum((-1, -2))


_TRUST = 0.5  # the largest move of a token in one inner iteration (chordal distance)


class _Residual:
    """The velocity error of an inner solve and its stopping test (:func:`_descend`), from the Riemannian
    gradient rg of F/K: G_i = K inv_i rg_i with inv = 1/(w_i b_i), r = (Σ_i w_i |G_i|²)^{1/2} (batch) and
    |G_i| (tokens), both squared relative to the largest entry of the batch item (no overflow)."""

    def __init__(self, rg, inv, wt, K, *, tau: float, tol: float):
        u = torch.finfo(rg.dtype).eps
        self.inv, self.wt, self.K = inv, wt, K
        self.r0 = self.total(rg)
        thresh = tol * self.r0 + 100 * u * (1 / tau + self.r0)
        self.thresh = torch.where(torch.isfinite(thresh), thresh, torch.zeros_like(thresh))
        self.stiff = K > 1  # there every token with mass must converge relative to its own start, too
        r0_tok = self.tokens(rg)
        self.thresh_tok = tol * r0_tok + 100 * u * (1 / tau + r0_tok)

    def _scaled(self, rg):
        """(G / top, top (B, 1, 1)), top the largest |entry| of G = inv · rg per batch item."""
        G = rg * self.inv
        top = G.abs().amax((-1, -2), keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
        return G / top, top

    def total(self, rg):
        """r, (B,); inf where it is not finite."""
        Gs, top = self._scaled(rg)
        r = self.K * top.reshape(-1) * (Gs.square().sum(-1) * self.wt).sum(-1).sqrt()
        return torch.where(torch.isfinite(r), r, torch.full_like(r, float("inf")))

    def tokens(self, rg):
        """|G_i| per token, (B, n)."""
        Gs, top = self._scaled(rg)
        return self.K.reshape(-1, 1) * top.reshape(-1, 1) * Gs.norm(dim=-1)

    def unconverged(self, rg, r):
        out = ~(torch.isfinite(r) & (r <= self.thresh))
        if bool(self.stiff.any()):
            bad_tok = ((~(self.tokens(rg) <= self.thresh_tok)) & (self.wt > 0)).any(-1)
            out = out | (self.stiff & bad_tok)
        return out


def _lbfgs_direction(y, rg, pre, memory):
    """The L-BFGS direction at y: the two-loop recursion over the pairs (s, z) of ``memory``, projected on the
    tangent space at y (pairs with ⟨s, z⟩ <= 0 masked out), with the initial inverse Hessian γ·pre.  Where it is
    not a descent direction: the preconditioned gradient −pre·rg.  Returns (direction, mask of those items)."""
    qv = rg.clone()
    alphas = []
    for s_, z_ in reversed(memory):
        s_p, z_p = tangent_projection(y, s_), tangent_projection(y, z_)
        sz = _dot(s_p, z_p)
        rho = torch.where(sz > 0, 1 / sz.clamp_min(1e-300), torch.zeros_like(sz))
        al = rho * _dot(s_p, qv)
        qv = qv - al[:, None, None] * z_p
        alphas.append((al, rho, s_p, z_p))
    gamma = torch.ones(y.shape[0], dtype=y.dtype, device=y.device)
    if alphas:  # γ from the newest pair
        s_p, z_p = alphas[0][2:]
        sz, zz = _dot(s_p, z_p), _dot(z_p, pre * z_p)
        gamma = torch.where((sz > 0) & (zz > 0), sz / zz.clamp_min(1e-300), gamma)
    rv = gamma[:, None, None] * pre * qv
    for al, rho, s_p, z_p in reversed(alphas):
        be = rho * _dot(z_p, rv)
        rv = rv + (al - be)[:, None, None] * s_p
    d = tangent_projection(y, -rv)
    gd = _dot(rg, d)
    bad = ~(gd < 0) | ~torch.isfinite(gd)
    return torch.where(bad[:, None, None], -pre * rg, d), bad


def _line_search(objective: Callable, y, f, g, d, gd, active):
    """Armijo backtracking along y ↦ normalize(y + a d), a = 1, ½, ... (20 tries), batched: (y, f, g) with
    the items that found a decrease updated, and the mask of the items done (found one, or inactive)."""
    slack = 10 * torch.finfo(y.dtype).eps * f.abs()
    a = torch.ones(y.shape[0], dtype=y.dtype, device=y.device)
    done = ~active
    y_new, f_new, g_new = y.clone(), f.clone(), g.clone()
    for _ls in range(20):
        cand = normalize(y + a[:, None, None] * d)
        fc, gc = _value_and_grad(objective, cand)
        ok = ~done & torch.isfinite(fc) & (fc <= f + 1e-4 * a * gd + slack)
        if bool(ok.any()):
            y_new[ok], f_new[ok], g_new[ok] = cand[ok], fc[ok], gc[ok]
        done = done | ok
        if bool(done.all()):
            break
        a = torch.where(done, a, a / 2)
    return y_new, f_new, g_new, done


def _descend(objective: Callable, y: torch.Tensor, pre: torch.Tensor, wt: torch.Tensor, *, tau: float, tol: float,
             max_iter: int, memory: int = 8):
    """Riemannian L-BFGS with the metric preconditioner, retraction and Armijo backtracking (batched, dim 0).

    The initial inverse Hessian is γ·pre, pre = τ/(w_i b_i) (the inverse Hessian of the proximal
    term as τ → 0), γ = ⟨s, z⟩/⟨z, pre z⟩; pairs (s, z) are ambient differences of iterates and
    Riemannian gradients, projected on the current tangent space when used (projection vector
    transport), and kept only when ⟨s, z⟩ > 0.  A non-descent direction or a failed line search
    falls back to the preconditioned gradient and clears the memory.

    The residual is the velocity error in L²(μ) of the module docstring, G_i = (pre_i/τ) P_{y_i} ∂F/∂y_i
    (``wt`` the token weights): it has the units of a velocity whatever the scale of F, and every token counts
    (a b-weighted norm would ignore tokens whose mobility is e^{-100} of the largest).

    Returns (y, {"residual", "iterations", "converged", "r0"}, each (B,)); (y, None) when the objective is
    not finite at the start."""
    B = y.shape[0]
    f, g = _value_and_grad(objective, y)
    if not bool(torch.isfinite(f).all()) or not bool(torch.isfinite(g).all()):
        return y, None
    # a stiff step (τ|V| ≫ 1, module docstring): F/K, K = τ max_i |G_i| / ρ, so that the first preconditioned
    # step is at most ρ and the L-BFGS products stay finite; K = 1 otherwise
    K = (tau * (tangent_projection(y, g) * (pre / tau)).abs().amax((-1, -2)) / _TRUST).clamp_min(1.0)
    if bool((K > 1).any()):
        raw = objective

        def objective(yy, raw=raw, K=K):
            return raw(yy) / K

        f, g = f / K, g / K.reshape(B, 1, 1)
    rg = tangent_projection(y, g)
    res = _Residual(rg, pre / tau, wt, K, tau=tau, tol=tol)
    iters = torch.zeros(B, dtype=torch.long, device=y.device)
    since = torch.zeros(B, dtype=torch.long, device=y.device)
    stalled = torch.zeros(B, dtype=torch.bool, device=y.device)
    best = res.r0.clone()
    pairs = deque(maxlen=memory)  # (s, z): differences of iterates and of Riemannian gradients
    for _ in range(max_iter):
        r = res.total(rg)
        # stagnation (an inexact objective, e.g. Sinkhorn potentials): no halving of the residual in 12 iterations
        improved = r < 0.5 * best
        best = torch.where(improved, r, best)
        since = torch.where(improved, torch.zeros_like(since), since + 1)
        stalled = stalled | (since > 12)
        active = res.unconverged(rg, r) & ~stalled
        if not bool(active.any()):
            break
        d, bad = _lbfgs_direction(y, rg, pre, pairs)
        # trust region: no token moves by more than ρ (chordal) in one iteration (inactive for τ|V| < ρ)
        dn = d.norm(dim=-1, keepdim=True)
        d = d * torch.where(dn > _TRUST, _TRUST / dn.clamp_min(torch.finfo(y.dtype).tiny), torch.ones_like(dn))
        d = d * active[:, None, None].to(y.dtype)
        y_new, f_new, g_new, done = _line_search(objective, y, f, g, d, _dot(rg, d), active)
        failed, moved = active & ~done, active & done
        stalled = stalled | (failed & bad)  # even the preconditioned gradient found no decrease
        iters = iters + moved.long()
        rg_new = tangent_projection(y_new, g_new)
        pairs.append((torch.where(moved[:, None, None], y_new - y, torch.zeros_like(y)),
                      torch.where(moved[:, None, None], rg_new - rg, torch.zeros_like(y))))
        if bool((failed & ~bad).any()):  # L-BFGS direction failed: retry with the gradient next time
            pairs.clear()
        y, f, g, rg = y_new, f_new, g_new, rg_new
    r = res.total(rg)
    return y, dict(residual=r, iterations=iters, converged=~res.unconverged(rg, r), r0=res.r0)


# ---------------------------------------------------------------------------- Lagrangian step
def _lagrangian_step(x, w, wt, h_old, h_new, lb_old, *, tau, sgn, transport, symmetric, unit, eps, scaling,
                     tol, max_iter, max_plan_updates, out_log_scale=0.0):
    """One JKO step for tokens x (B, n, d): (y, info) with the proximal value, residual, iterations, ...;
    (None, None) when the objective is not finite at the start.

    F is minimised divided by c = 2^k ≈ max_i b_k(x_i) per batch item (module docstring; k an integer, so the
    division is exact where nothing underflows); with transport="sinkhorn" ε is divided by c as well
    (OT_ε(c·C) = c·OT_{ε/c}(C)).  The returned ``prox`` is W² · e^{−out_log_scale} (the run's common scale)."""
    B = x.shape[0]
    ln2 = math.log(2.0)
    logc = torch.round(lb_old.max(-1).values / ln2) * ln2  # (B,) ("unit": c = 1)
    if transport == "sinkhorn":  # one ε for the whole batch: one scale
        logc = logc.max().expand(B)
    b_old = torch.exp(lb_old - logc.unsqueeze(-1))  # (B, n), b_k / c
    wb = wt * b_old
    pre = torch.where(wb > 0, tau / wb, torch.zeros_like(wb)).unsqueeze(-1)  # massless tokens stay

    def b_field(q):
        """b_k / c at arbitrary points q (B, N, d): mobility field of μ_k under Θ_{t_k}, scaled."""
        if unit:
            return torch.exp(-logc).unsqueeze(-1).expand(q.shape[:-1])
        lse = softmax_statistics(q, h_old, w, keys=x).log_partition
        return torch.exp(-log_inverse_mobility(h_old, lse) - logc.unsqueeze(-1))

    solve = functools.partial(_descend, pre=pre, wt=wt, tau=tau, tol=tol, max_iter=max_iter)

    def energy(y):
        return sgn * _energy(y, h_new, w, logc)

    if transport == "identity":
        def objective(y):  # the terms in their historical order: it fixes the round-off of the gradient
            c2 = (y - x).square().sum(-1)
            bb = 0.5 * (b_field(y) + b_old) if symmetric else b_old
            return energy(y) + (wt * bb * c2).sum(-1) / (2 * tau)

        def prox_fn(y):
            return (wt * (0.5 * (b_field(y) + b_old) if symmetric else b_old) * (y - x).square().sum(-1)).sum(-1)

        y, info = solve(objective, x)
    elif transport == "emd":
        def cost_rows(y):
            """c_k(x_j, y_i) / c as a (B, n_new, n_old) matrix."""
            c2 = sq_chordal(y, x)
            if symmetric:
                return 0.5 * (b_field(y).unsqueeze(-1) + b_old.unsqueeze(-2)) * c2
            return b_old.unsqueeze(-2) * c2

        def solve_at(P, y0):
            return solve(lambda y: energy(y) + (P * cost_rows(y)).sum((-1, -2)) / (2 * tau), y0)

        y, info, P = _plan_descent(solve_at, cost_rows, x, wt, max_plan_updates)

        def prox_fn(y):
            return (P * cost_rows(y)).sum((-1, -2))
    else:  # sinkhorn, with the symmetric cost
        def sym_cost(X, Y):
            c2 = sq_chordal(X, Y)
            return 0.5 * (b_field(X).unsqueeze(-1) + b_field(Y).unsqueeze(-2)) * c2

        eps_s = eps * (float(torch.exp(-logc[0])) if B > 0 else 1.0)
        diameter = 2.0 * math.sqrt(max(float(b_old.max()), 1e-300)) * 1.5

        def prox_fn(y):
            return sinkhorn_divergence(y, wt, x, wt, eps=eps_s, cost=sym_cost, diameter=diameter, scaling=scaling)

        y, info = solve(lambda y: energy(y) + prox_fn(y) / (2 * tau), x)
    if info is None:
        return None, None
    with torch.no_grad():
        info["prox"] = prox_fn(y).detach() * torch.exp(logc - out_log_scale)  # in the run's units (times e^{−c_run})
    # a token with mass whose scaled mobility underflowed (b_i/c = 0) was held fixed: not converged
    info["converged"] = info["converged"] & ~((wt > 0) & ~(wb > 0)).any(-1)
    info.setdefault("plan_updates", torch.zeros(B, dtype=torch.long, device=x.device))
    return y.detach(), info


def _plan_descent(solve_at: Callable, cost_rows: Callable, x, wt, max_plan_updates: int):
    """transport="emd": inner solves ``solve_at(π, y)`` at a fixed plan π, each followed by the exact plan of the
    cost at its solution, until that plan is no better (block-coordinate descent in (y, π), monotone in F).
    Returns (y, info of the last solve with the iterations of all and r₀ of the first, π), or (y, None, None)."""
    P, y = torch.diag_embed(wt), x  # optimal at y = x
    iters = plans = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    r0 = None
    for _ in range(max_plan_updates):
        y, info = solve_at(P, y)
        if info is None:
            return y, None, None
        r0 = info["r0"] if r0 is None else r0
        iters = iters + info["iterations"]
        with torch.no_grad():
            M = cost_rows(y)
            Pn = emd_plans(wt, wt, M)
            old, new = (P * M).sum((-1, -2)), (Pn * M).sum((-1, -2))
            improve = old - new > 1e-12 * (old.abs() + 1e-300) + 1e-300
        if not bool(improve.any()):
            break
        plans = plans + improve.long()
        P = torch.where(improve[:, None, None], Pn, P)
    # the last recomputed plan was not used by an inner solve
    info.update(iterations=iters, r0=r0, converged=info["converged"] & ~improve, plan_updates=plans)
    return y, info, P


# ---------------------------------------------------------------------------- Eulerian step
def self_potential(q: torch.Tensor, C: torch.Tensor, eps: float, *, init: Optional[torch.Tensor] = None,
                   tol: Optional[float] = None, max_iter: int = 1000):
    """Potential f of the entropic self-transport OT_ε(q, q) for a symmetric cost C, batched.

        f_a = −ε log Σ_b q_b exp((f_b − C_ab)/ε),   π_ab = q_a q_b exp((f_a + f_b − C_ab)/ε) ∈ Π(q, q)

    solved by the averaged symmetric iteration f ← ½(f + T f) (Feydy et al. 2019): its
    linearisation ½(I − P), P the plan's transition matrix, contracts every mode by ≤ ½, so it
    converges in tens of iterations where plain Sinkhorn needs thousands at small ε (geomloss uses
    this iteration for its debiasing terms but does not return converged potentials; POT's
    ``sinkhorn_log`` solves the same problem and is the test oracle).

    Parameters
    ----------
    q : torch.Tensor
        (B, m) weights (zeros allowed).  C: (B, m, m) or (m, m) symmetric costs.  eps: ε > 0.
    tol : Optional[float]
        stop when max_a |f − T f|/ε (the log of the marginal error) ≤ tol (default 1e-13 in
        float64, 1e-6 in float32).

    Returns
    -------
    result
        (f (B, m), iterations, max marginal log-error).
    """
    tol = (1e-13 if q.dtype == torch.float64 else 1e-6) if tol is None else tol
    logq = torch.log(q).unsqueeze(-2)  # (B, 1, m)
    f = torch.zeros_like(q) if init is None else init.clone()
    err = float("inf")
    it = 0
    for it in range(1, max_iter + 1):
        Tf = -eps * torch.logsumexp(logq + (f.unsqueeze(-2) - C) / eps, -1)
        err = float((f - Tf).abs().max()) / eps
        f = 0.5 * (f + Tf)
        if err <= tol:
            break
    return f, it, err


def _eulerian_step(z, q, h_old, h_new, lb_old, *, tau, sgn, eps, tol, max_iter, warm, temperature=0.0):
    """One entropic JKO step of the grid weights q (B, m). Returns p, info, warm-start state.

    ``temperature`` T > 0 adds the entropy T Σ_b p_b log(m p_b) (the Fokker–Planck JKO): the first-order
    condition gains T log(m p_b) next to s'δE/δμ, and the iteration mixes geometrically,
    log p ← (log T(p) + κ log p)/(1 + κ) with κ = 2τT/ε, the exact solve of its log p dependence."""
    B, m = q.shape
    c2 = sq_chordal(z, z)  # (m, m)
    bz = torch.exp(lb_old)  # (B, m)
    C = 0.5 * (bz.unsqueeze(-1) + bz.unsqueeze(-2)) * c2  # (B, m, m), symmetric
    f_self, _, _ = self_potential(q, C, eps, init=warm)
    log_v = torch.log(q) + f_self / eps
    base = log_v.unsqueeze(-2) - C / eps  # (B, m, m)
    zb = z.expand(B, m, z.shape[-1])

    kappa = 2 * tau * temperature / eps
    log_m = math.log(m)

    def T(p):
        g = _first_variation(zb, h_new, p)
        if kappa > 0:
            g = sgn * g + temperature * (torch.log(p) + log_m)
            L = base - (2 * tau / eps) * g.unsqueeze(-2)
        else:
            L = base - (2 * tau * sgn / eps) * g.unsqueeze(-2)
        ls = torch.log_softmax(L, -1)
        return torch.einsum("ba,bac->bc", q, torch.exp(ls)), ls

    u = torch.finfo(q.dtype).eps
    p = q.clone()
    theta = torch.ones(B, dtype=q.dtype, device=q.device)
    r_prev = torch.full((B,), float("inf"), dtype=q.dtype, device=q.device)
    iters = torch.zeros(B, dtype=torch.long, device=q.device)
    for i in range(max_iter + 1):
        Tp, ls = T(p)
        r = (Tp - p).abs().sum(-1)
        conv = r <= tol * (Tp - q).abs().sum(-1) + 100 * u * m
        if bool(conv.all()) or i == max_iter:
            break
        theta = torch.where(r > r_prev, (theta / 2).clamp_min(1 / 64), theta)
        r_prev = r
        act = ~conv
        if kappa > 0:  # geometric mixing: stays > 0; the final image T(p) has mass 1 exactly
            th = (theta / (1 + kappa)).unsqueeze(-1)
            mixed = torch.exp((1 - th) * torch.log(p) + th * torch.log(Tp))
        else:
            mixed = (1 - theta.unsqueeze(-1)) * p + theta.unsqueeze(-1) * Tp
        p = torch.where(act.unsqueeze(-1), mixed, p)
        iters = iters + act.long()
    p = Tp  # the image of the last iterate: exactly a coupling marginal (≥ 0, mass 1)
    # proximal value D_ε(p | q) = ε KL(π* | π⁰) = J(π*) − J(π⁰), J(π) = Σ π (C + ε(log softmax − log v))
    # = ε KL(π | π^ε_qq) + Σ_a q_a f_a, and π⁰ = π^ε_qq
    ls0 = torch.log_softmax(base, -1)

    def J(lsm):
        pi = q.unsqueeze(-1) * torch.exp(lsm)
        term = pi * (C + eps * (lsm - log_v.unsqueeze(-2)))
        return torch.where(pi > 0, term, torch.zeros_like(term)).sum((-1, -2))

    prox = J(ls) - J(ls0)
    info = dict(prox=prox, residual=r, iterations=iters, converged=conv,
                plan_updates=torch.zeros(B, dtype=torch.long, device=q.device))
    return p, info, f_self


# ---------------------------------------------------------------------------- entry point
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
    z = _resolve_grid(grid, h_ref.dim, h_ref.dtype, h_ref.device)
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


def _check_jko_args(x0, theta, **settings) -> SimpleNamespace:
    """Every check of :func:`jko`, before any work: its keyword arguments ``settings``, normalised, with the sign
    of the direction, the grid z and weights q0 (Eulerian; None otherwise), the tolerance and the source of Θ_t
    (heads_at, sampled path)."""
    o = SimpleNamespace(**settings)
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
    o.z, o.q0 = _check_measure(x0, theta, lagrangian, weights=o.weights, grid=o.grid, grid_weights=o.grid_weights,
                               bandwidth=o.bandwidth)
    if o.tol is None:
        dtype = (x0 if lagrangian else o.q0).dtype
        o.tol = (1e-6 if o.transport == "sinkhorn" and lagrangian else 1e-9) if dtype == torch.float64 else 1e-4
    else:
        o.tol = check_positive(o.tol, "tol")
    if o.path_dt is not None:
        o.path_dt = check_positive(o.path_dt, "path_dt")
    check_limits(f"jko with {o.steps} steps of tau = {o.tau:.6g}", steps=o.steps,
                 memory=_estimate_memory(x0 if lagrangian else o.q0, theta, o, lagrangian),
                 max_steps=o.max_steps, max_memory=o.max_memory, device=(x0 if lagrangian else o.q0).device,
                 fix="record fewer steps (record_every=), use fewer paths or a coarser path_dt")
    o.heads_at, o.path = _theta_source(theta, t0=o.t0, t_end=o.t0 + o.steps * o.tau, tau=o.tau, paths=o.paths,
                                       seed=o.seed, generator=o.generator, path_dt=o.path_dt,
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
        means 0; giving seed and generator together is refused).
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
    o = _check_jko_args(
        x0, theta, tau=tau, steps=steps, t0=t0, transport=transport, scheme=scheme, direction=direction,
        mobility=mobility, cost=cost, eps=eps, weights=weights, grid=grid, grid_weights=grid_weights,
        bandwidth=bandwidth, paths=paths, seed=seed, generator=generator, path_dt=path_dt, tol=tol, max_iter=max_iter,
        max_plan_updates=max_plan_updates, sinkhorn_scaling=sinkhorn_scaling, strict=strict,
        record_every=record_every, diagnostics=diagnostics, max_steps=max_steps, max_memory=max_memory)
    o.temperature = _check_jko_temperature(temperature, scheme)
    start = time.perf_counter()
    run = _JKORun(x0, o)
    with progress_bar(progress, o.steps, f"jko ({scheme}, {o.transport})") as bar, threads.scope(run.work) as pool:
        for k in range(o.steps):
            t_new, new_state = run.step(k)
            if callback is not None:
                callback(k + 1, t_new, new_state)
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
                           scaling=o.sinkhorn_scaling, max_plan_updates=o.max_plan_updates)
        self.rec = Recorder(o.steps, o.record_every, diagnostics=True, ledger_keys=LEDGER_KEYS)
        self.rec.records.update({"w": [], "ledger.jko_defect": []})
        self.S = {k: [] for k in ("residual", "iterations", "converged", "defect", "prox", "plan_updates")}
        self.bad_steps, self.bad_residuals = [], []
        self._layout(x0)
        self._start()

    def _layout(self, x0):
        """The batch shape of measure and heads, flattened to one axis of size B."""
        o, weights = self.o, self.o.weights
        hb = tuple(o.heads_at(o.t0).batch_shape)
        state = (x0 if self.lagrangian else o.q0).detach()
        event = tuple(state.shape[-2:] if self.lagrangian else state.shape[-1:])  # (n, d) or (m,)
        xb = tuple(state.shape[:state.dim() - len(event)])
        if self.lagrangian and weights is not None:
            xb = tuple(broadcast_shapes(xb, weights.shape[:-1]))
        if o.paths is not None and o.path is None:
            xb, state = (o.paths, *xb), state.unsqueeze(0).expand(o.paths, *state.shape)
        try:
            batch = tuple(broadcast_shapes(xb, hb))
        except RuntimeError:
            raise ValueError(f"the batch shape of the initial measure {xb} does not broadcast against the heads' "
                             f"batch shape {hb}") from None
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

    def flat(self, t) -> Heads:
        return _flatten_heads(self.o.heads_at(t), self.batch, self.B)

    # ------------------------------------------------------------------ diagnostics in the scheme's metric
    def entropy_term(self, p) -> torch.Tensor:
        """s'·T Σ_b p_b log(m p_b) · e^{−c} (B,): the entropy part of Ẽ = E + s'T∫ρ log ρ (0 at T = 0)."""
        T = getattr(self.o, "temperature", 0.0)
        if self.lagrangian or T == 0:
            return torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)
        plogp = torch.where(p > 0, p * torch.log(p * p.shape[-1]), torch.zeros_like(p))
        return self.o.sgn * T * plogp.sum(-1) * math.exp(-self.c)

    def evaluate(self, points, wts, heads) -> FieldEval:
        """The field, energy, 𝒢² and 𝒟 of the measure (points, wts), times e^{−c} (with temperature: Ẽ)."""
        ev = self._evaluate(points, wts, heads)
        if getattr(self.o, "temperature", 0.0) > 0 and not self.lagrangian:
            ev = FieldEval(ev.velocity, ev.stats, ev.outputs, ev.grad_first_variation,
                           ev.energy + self.entropy_term(wts), ev.slope, ev.dissipation)
        return ev

    def _evaluate(self, points, wts, heads) -> FieldEval:
        ev = evaluate(points, heads, wts, normalization=self.norm, sign=self.o.sign, diagnostics=True, log_scale=self.c)
        # the scheme's field is the gradient flow V = s g / b (b ≡ 1 for "unit"): 𝒢² = Σ w b|V|² = Σ w |g|²/b
        # and 𝒟 = Σ w ⟨g, V⟩ = s 𝒢², formed from g b^{-1/2} (no |V|² ~ e^{2β‖A‖} in between)
        G = self.metric_slope(ev.grad_first_variation, ev.stats.log_partition, heads, wts)
        return FieldEval(ev.velocity, ev.stats, ev.outputs, ev.grad_first_variation, ev.energy, G, self.o.sign * G)

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
        self.heads_cur = self.flat(t0)
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
            new, info = _lagrangian_step(self.state, self.w, self.wt, self.heads_cur, heads_new, self.lb,
                                         **self.prox_kw, **self.lag_kw, out_log_scale=self.c)
            if new is None:
                raise nonfinite_error("the JKO objective", t_new, k + 1, heads_new)
        else:
            with torch.no_grad():
                new, info, self.warm = _eulerian_step(self.o.z, self.state, self.heads_cur, heads_new, self.lb,
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
        heads_new = self.flat(t_new)
        pts, w = self.measure(self.state)
        with torch.no_grad():
            E_cross = _energy(pts, heads_new, w, self.log_c) + (0.0 if self.lagrangian else self.entropy_term(w))
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
                          f"or reduce tau (strict=True raises instead)", RuntimeWarning, stacklevel=3)

    def trajectory(self, start: float) -> Trajectory:
        """The records and per-step statistics, from the flat batch axis to the batch shape."""
        o, batch, T = self.o, self.batch, len(self.rec.steps)
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
                          f"jko-{o.scheme}-{o.transport}", self.norm, o.direction, weights, o.path, extras)


def solve_jko(model, x0, solver, *, t1, dt, t0, paths, seed, generator, saveat, ledger, checkpoint, progress,
               limits):
    """:func:`transformer_pde.solve` for the JKO solver objects (LagrangianJKO, EulerianJKO): the model and the
    options objects turned into the schemes' settings; options that do not apply are refused."""
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
    steps = grid_steps(check_real(t0, "t0"), check_real(t1, "t1"), check_positive(dt, "dt"))
    common = dict(tau=dt, steps=steps, t0=t0, direction=model.direction, mobility=norm.jko_mobility,
                  paths=paths, seed=seed, generator=generator, path_dt=solver.path_dt, strict=solver.strict,
                  record_every=saveat.record_every(steps), diagnostics=ledger.diagnostics,
                  progress=bool(progress.show), callback=progress.callback, max_steps=limits.max_steps,
                  max_memory=limits.max_memory)
    if isinstance(solver, LagrangianJKO):
        if model.noise is not None:
            raise ValueError("token noise with a JKO solver needs EulerianJKO (the entropy of a density on a grid)")
        tr = solver.transport
        return jko(x0, model.theta, scheme="lagrangian", transport=tr.name, cost=getattr(tr, "cost", "symmetric"),
                   eps=getattr(tr, "eps", 1e-3), sinkhorn_scaling=getattr(tr, "scaling", 0.95),
                   weights=model.weights, tol=solver.inner.tol, max_iter=solver.inner.max_iter,
                   max_plan_updates=solver.inner.max_plan_updates, **common)
    if model.weights is not None:
        raise ValueError("EulerianJKO carries its weights on the grid: give EulerianJKO(grid_weights=...) instead "
                         "of Model(weights=...)")
    return jko(x0, model.theta, scheme="eulerian", transport="sinkhorn", eps=solver.eps, grid=solver.grid,
               grid_weights=solver.grid_weights, bandwidth=solver.bandwidth, tol=solver.tol,
               max_iter=solver.max_iter, temperature=model.temperature, **common)
