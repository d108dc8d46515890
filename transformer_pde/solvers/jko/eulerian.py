"""The Eulerian JKO step (docs/model.md#jko): a density solver on a fixed grid, independent of the particles.

The measure is μ = Σ_a p_a δ_{z_a} on a fixed grid (``tp.sphere.circle_grid`` on S¹, ``fibonacci_sphere`` or
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
‖T(p) − p‖₁.  With token noise (temperature T > 0) the step adds the entropy T Σ_b p_b log(m p_b)
(:func:`entropy`; the Fokker–Planck JKO, docs/noisy_tokens.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...utils.validation import check_positive, check_same, check_token_weights, check_tokens
from ...model.softmax import softmax_statistics
from ...model.finite_part import over_two_beta
from ...model.heads import Heads
from ...model.sphere import circle_grid, fibonacci_sphere
from ...model.transport import sq_chordal

__all__ = ["to_grid", "self_potential", "entropy"]
__internal__ = ["EulerianStep", "check_grid_type", "resolve_grid", "grid_spacing", "first_variation", "eulerian_step"]


@dataclass(frozen=True)
class EulerianStep:
    """The settings of an Eulerian JKO step, checked (:mod:`transformer_pde.solvers.jko.problem`).

    tau : the step τ;  sgn : s' = +1 (descent) or −1 (ascent);  eps : the blur ε;  tol, max_iter : the fixed-point
    iteration's;  temperature : T ≥ 0 of the entropy T Σ_b p_b log(m p_b) (0: none)."""

    tau: float
    sgn: float
    eps: float
    tol: float
    max_iter: int
    temperature: float = 0.0


def first_variation(z: torch.Tensor, heads: Heads, p: torch.Tensor) -> torch.Tensor:
    """δE/δμ at the grid points for μ = Σ p_a δ_{z_a}: Σ_h ω_h (m_h + m̃_h)/(2β), (B, m)."""
    omega, beta = heads.weights.unsqueeze(-1), heads.beta
    s = softmax_statistics(z, heads, p)
    g = (omega * torch.exp(s.log_partition)).sum(-2)
    if not heads.is_symmetric:
        st = softmax_statistics(z, heads, p, transpose=True)
        g = 0.5 * (g + (omega * torch.exp(st.log_partition)).sum(-2))
    if isinstance(beta, torch.Tensor) and beta.dim() > 0:
        heads = heads.replace(beta=beta.unsqueeze(-1))

    def finite_part():  # β = 0: Σ_h ω_h ⟨z, ½(A_h + A_hᵀ) z̄⟩, z̄ = Σ_a p_a z_a
        A = heads.score_matrix
        zbar = (p.unsqueeze(-1) * z).sum(-2)  # (B, d)
        Az = 0.5 * (zbar.unsqueeze(-2).unsqueeze(-2) @ (A + A.transpose(-1, -2))).squeeze(-2)  # (B, H, d)
        return (omega * (z.unsqueeze(-3) @ Az.unsqueeze(-1)).squeeze(-1)).sum(-2)

    return over_two_beta(2 * g, heads, finite_part)



# ---------------------------------------------------------------------------- grid helpers
def check_grid_type(grid) -> None:
    """TypeError unless ``grid`` is a tensor (m, d) or an int m (None is left to :func:`resolve_grid`)."""
    if grid is not None and (isinstance(grid, bool) or not isinstance(grid, (int, torch.Tensor))):
        got = "a bool" if isinstance(grid, bool) else type(grid).__name__
        raise TypeError(f"grid must be a tensor (m, d) or an int m, got {got}")


def resolve_grid(grid, d, dtype, device) -> torch.Tensor:
    if grid is None:
        raise ValueError("scheme='eulerian' needs grid=: a tensor (m, d) of points on the sphere, or an int m "
                         "(circle_grid on S¹, fibonacci_sphere on S²)")
    check_grid_type(grid)
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


def grid_spacing(grid: torch.Tensor) -> float:
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
    h = 2 * grid_spacing(grid) if bandwidth is None else check_positive(bandwidth, "bandwidth")
    s = (x @ grid.T - 1) / (h * h)  # (..., n, m)
    if weights is not None:
        s = s + torch.log(weights).unsqueeze(-1)
    logq = torch.logsumexp(s, -2)
    q = torch.exp(logq - torch.logsumexp(logq, -1, keepdim=True)).clamp_min(torch.finfo(x.dtype).tiny)
    return q / q.sum(-1, keepdim=True)



# ---------------------------------------------------------------------------- the step
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


def eulerian_step(z, q, h_old, h_new, lb_old, settings: EulerianStep, warm: Optional[torch.Tensor] = None):
    """One entropic JKO step of the grid weights q (B, m) on the grid z (m, d), from Θ_{t_k} = h_old (log-mobility
    lb_old (B, m) on the grid) to Θ_{t_{k+1}} = h_new.  Returns p, info, warm-start state (the self-potential,
    ``warm`` of the next step).

    ``temperature`` T > 0 adds the entropy T Σ_b p_b log(m p_b) (the Fokker–Planck JKO): the first-order
    condition gains T log(m p_b) next to s'δE/δμ, and the iteration mixes geometrically,
    log p ← (log T(p) + κ log p)/(1 + κ) with κ = 2τT/ε, the exact solve of its log p dependence."""
    tau, sgn, eps, tol, max_iter, temperature = (settings.tau, settings.sgn, settings.eps, settings.tol,
                                                   settings.max_iter, settings.temperature)
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
        g = first_variation(zb, h_new, p)
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



def entropy(p: torch.Tensor, temperature: float, sign: float, log_scale: float = 0.0) -> torch.Tensor:
    """The entropy part s'·T Σ_b p_b log(m p_b) · e^{−c} of the free energy Ẽ = E + s'T∫ρ log ρ.

    ρ is the density of p against the grid's uniform measure (m points, equal-area grids).

    Parameters
    ----------
    p : torch.Tensor
        grid weights (..., m), ≥ 0 (zeros contribute 0).
    temperature : float
        T ≥ 0 (0: no entropy, the result is 0).
    sign : float
        s' = +1 (descent) or −1 (ascent), the sign that makes F = s'Ẽ decrease.
    log_scale : float
        c, the run's common energy scale (values reported times e^{−c}).

    Returns
    -------
    torch.Tensor
        (...,).
    """
    if temperature == 0:
        return torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)
    plogp = torch.where(p > 0, p * torch.log(p * p.shape[-1]), torch.zeros_like(p))
    return sign * temperature * plogp.sum(-1) * math.exp(-log_scale)
