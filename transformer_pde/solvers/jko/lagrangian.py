"""The Lagrangian JKO step (docs/model.md#jko): the tokens y_i are the unknowns, the weights w_i are carried.

One step of size τ from the tokens x at t_k minimises (descent: s' = 1; ascent: s' = −1)

    F(y) = s'E(y, Θ_{t_{k+1}}) + W_{b_k}(μ_y, μ_x)² / (2τ),   c_k(x, y) = b_k(x) |x − y|²,

with the mobility b_k = b[μ_k, Θ_{t_k}] frozen at the old tokens (:mod:`transformer_pde.solvers.jko.front` for why
b and not 1/b).  Transports:

* ``"identity"``: π = diag(w) (token i goes to token i) — implicit Euler for the particles;
* ``"emd"``: the exact plan (POT ``emd``) of the cost c_k between μ_k and the current iterate,
  held FIXED during an inner solve and recomputed at its solution; the outer loop stops when
  the old plan is still optimal (:func:`plan_descent`: block-coordinate descent in (y, π), monotone in F);
* ``"sinkhorn"``: the debiased Sinkhorn divergence S_ε (geomloss, :mod:`transformer_pde.model.transport`).
  The debiased divergence needs a symmetric cost, so here c_k(x, y) = ½(b_k(x) + b_k(y))|x − y|²,
  with b_k the mobility field of μ_k evaluated anywhere on the sphere; it agrees with
  b_k(x)|x − y|² up to O(|x − y|³), which changes a step by O(τ²).  ``cost="symmetric"`` uses the
  same cost with emd / identity (for like-for-like comparisons).

The inner solver is :func:`transformer_pde.solvers.jko.lbfgs.minimize` with the metric preconditioner
τ/(w_i b_k(x_i)) (a near-Newton step for small τ) and the model's retraction.  It minimises F/c,
c = 2^k ≈ max_i b_k(x_i) per batch item: E and the proximal term both grow like e^{β⟨Ax, y⟩}, and
F/c — evaluated from the log-partitions, e^{log m_h − log c} — stays O(1) where F overflows.  Its
residual is then the velocity error in L²(μ),

    r = ( Σ_i w_i |G_i|² )^{1/2},   G_i = P_{y_i} ∂F/∂y_i / (w_i b_k(x_i))   (= P(y_i − x_i)/τ − V_k(y_i)),

and a token with mass whose scaled mobility underflowed (it could not move) makes the step
unconverged.  Massless tokens (w_i = 0) do not enter F and stay where they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...model.softmax import softmax_statistics
from ...model.field import head_token_mean, log_inverse_mobility
from ...model.finite_part import over_two_beta, pair_mean_scores
from ...model.heads import Heads
from ...model.sphere import normalize
from ...model.transport import emd_plans, sinkhorn_divergence, sq_chordal
from .lbfgs import minimize

__all__ = []  # the scheme's parts; users call tp.jko / tp.solve(..., tp.LagrangianJKO(...))
__internal__ = ["LagrangianStep", "lagrangian_step", "plan_descent", "scaled_energy"]


@dataclass(frozen=True)
class LagrangianStep:
    """The settings of a Lagrangian JKO step, checked (:mod:`transformer_pde.solvers.jko.problem`).

    tau : the step τ;  sgn : s' = +1 (descent) or −1 (ascent);  transport : "emd", "sinkhorn" or "identity";
    symmetric : the cost ½(b_k(x) + b_k(y))|x − y|² (else b_k(x)|x − y|²);  unit : b ≡ 1;  eps, scaling : the
    blur and ε-scaling ratio of "sinkhorn";  tol, max_iter : the inner solve's;  max_plan_updates : the emd plan
    recomputations per step;  retract : the model's retraction (``model.layer_norm.retract``)."""

    tau: float
    sgn: float
    transport: str
    symmetric: bool
    unit: bool
    eps: float
    scaling: float
    tol: float
    max_iter: int
    max_plan_updates: int
    retract: Callable = normalize


def scaled_energy(y: torch.Tensor, heads: Heads, w: Optional[torch.Tensor], logc: torch.Tensor) -> torch.Tensor:
    """The scaled energy E(μ, Θ) / e^{logc} = Σ_h ω_h/(2β) Σ_i w_i e^{log m_h(y_i) − logc}, (B,), from the
    log-partitions (differentiable, no validation; logc (B,))."""
    lse = softmax_statistics(y, heads, w).log_partition - logc[:, None, None]  # (B, H, n)
    return over_two_beta((heads.weights * head_token_mean(torch.exp(lse), w)).sum(-1), heads,  # β = 0: finite part
                         lambda: 0.5 * (heads.weights * pair_mean_scores(y, heads, w)).sum(-1) * torch.exp(-logc))


def lagrangian_step(x, w, wt, h_old, h_new, lb_old, settings: LagrangianStep, out_log_scale: float = 0.0):
    """One JKO step for tokens x (B, n, d) with token weights w (None: uniform; wt the weights used, (B, n)),
    from Θ_{t_k} = h_old (log-mobility lb_old (B, n) at x) to Θ_{t_{k+1}} = h_new: (y, info) with the proximal
    value, residual, iterations, ...; (None, None) when the objective is not finite at the start.

    F is minimised divided by c = 2^k ≈ max_i b_k(x_i) per batch item (module docstring; k an integer, so the
    division is exact where nothing underflows); with transport="sinkhorn" ε is divided by c as well
    (OT_ε(c·C) = c·OT_{ε/c}(C)).  The returned ``prox`` is W² · e^{−out_log_scale} (the run's common scale)."""
    st = settings
    tau, sgn, transport, symmetric, unit = st.tau, st.sgn, st.transport, st.symmetric, st.unit
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

    def solve(objective, y0):
        return minimize(objective, y0, preconditioner=pre, weights=wt, tau=tau, tol=st.tol, max_iter=st.max_iter,
                        retract=st.retract)

    def energy(y):
        return sgn * scaled_energy(y, h_new, w, logc)

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

        y, info, P = plan_descent(solve_at, cost_rows, x, wt, st.max_plan_updates)

        def prox_fn(y):
            return (P * cost_rows(y)).sum((-1, -2))
    else:  # sinkhorn, with the symmetric cost
        def sym_cost(X, Y):
            c2 = sq_chordal(X, Y)
            return 0.5 * (b_field(X).unsqueeze(-1) + b_field(Y).unsqueeze(-2)) * c2

        eps_s = st.eps * (float(torch.exp(-logc[0])) if B > 0 else 1.0)
        diameter = 2.0 * math.sqrt(max(float(b_old.max()), 1e-300)) * 1.5

        def prox_fn(y):
            return sinkhorn_divergence(y, wt, x, wt, eps=eps_s, cost=sym_cost, diameter=diameter, scaling=st.scaling)

        y, info = solve(lambda y: energy(y) + prox_fn(y) / (2 * tau), x)
    if info is None:
        return None, None
    with torch.no_grad():
        info["prox"] = prox_fn(y).detach() * torch.exp(logc - out_log_scale)  # in the run's units (times e^{−c_run})
    # a token with mass whose scaled mobility underflowed (b_i/c = 0) was held fixed: not converged
    info["converged"] = info["converged"] & ~((wt > 0) & ~(wb > 0)).any(-1)
    info.setdefault("plan_updates", torch.zeros(B, dtype=torch.long, device=x.device))
    return y.detach(), info


def plan_descent(solve_at: Callable, cost_rows: Callable, x, wt, max_plan_updates: int):
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

