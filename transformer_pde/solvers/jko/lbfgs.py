"""Riemannian L-BFGS on a product of spheres (docs/model.md#jko), batched over a leading axis.

    y, info = minimize(objective, y0, preconditioner=pre, weights=w, tau=τ, tol=1e-9)

minimises B independent objectives F_b(y_b), y_b = (y_{b,1}, ..., y_{b,n}) ∈ (S^{d-1})^n, given as one
callable ``objective(y)`` (B, n, d) -> (B,) that autograd can differentiate.  The method:

* Riemannian gradient rg = P_y ∇F (P_y the tangent projection of each token);
* L-BFGS two-loop recursion over the last ``memory`` pairs (s, z) — ambient differences of iterates
  and of Riemannian gradients, projected on the current tangent space when used (projection vector
  transport), kept only when ⟨s, z⟩ > 0 — with initial inverse Hessian γ·pre,
  γ = ⟨s, z⟩/⟨z, pre z⟩ (``preconditioner``: 1 by default; the JKO passes τ/(w_i b_i), the inverse
  Hessian of its proximal term as τ → 0);
* a trust region: no token moves by more than ρ = ``trust_radius`` (chordal) in one iteration;
* Armijo backtracking along y ↦ R(y + a d), a = 1, ½, ..., with the retraction R = ``retract``
  (the geometry seam: x ↦ x/|x| for the projected flow, ``model.layer_norm.retract``);
* a non-descent direction or a failed line search falls back to the preconditioned gradient
  −pre·rg and clears the memory.

**Residual and stopping.**  The residual is the preconditioned gradient in units of a velocity,

    G_i = (pre_i / τ) P_{y_i} ∂F/∂y_i,   r = ( Σ_i w_i |G_i|² )^{1/2},

computed relative to its largest entry (no squaring of large numbers).  A batch item stops when
r ≤ tol·r₀ + 100·u·(1/τ + r₀) (r₀ the value at y0, u the unit round-off), or when its residual has not
halved in 12 iterations (stagnation: an inexact objective), or when even the preconditioned
gradient finds no decrease.  A non-finite residual never counts as converged.  The stagnation rule also
stops (unconverged) a solve whose residual grows for 12 iterations on its way — e.g. a token that starts
more than 90° from the minimiser of a linear objective, with a small trust radius.

**Stiff objectives.**  When the first preconditioned step would move a token by more than ρ, the
objective is divided by K = max_i |pre_i P∇F_i| / ρ (per batch item; dividing F by a number does not
move its minimiser) so that the L-BFGS products stay finite; every token with weight w_i > 0 must
then also meet the bound above with its own |G_i| and r₀_i (the tokens' scales can span more
than 1/u).  Tokens with pre_i = 0 do not move.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

from ...utils.validation import check_int, check_positive, sphere_tolerance
from ...model.sphere import normalize, tangent_projection

__all__ = ["minimize", "TRUST_RADIUS"]
__internal__ = ["descend", "line_search", "lbfgs_direction", "Residual", "value_and_grad", "dot"]

#: the default largest move of a token in one inner iteration (chordal distance)
TRUST_RADIUS = 0.5
_STALL = 12  # iterations without halving the residual before a solve counts as stagnated
_LINE_SEARCH_TRIES = 20


def value_and_grad(objective: Callable, y: torch.Tensor):
    """(objective(y) detached (B,), its gradient (B, n, d)), with autograd enabled inside."""
    with torch.enable_grad():
        yv = y.detach().requires_grad_(True)
        val = objective(yv)
        (g,) = torch.autograd.grad(val.sum(), yv)
    return val.detach(), g


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """⟨a, b⟩ per batch item, summed over tokens and coordinates: (B,)."""
    return (a * b).sum((-1, -2))


class Residual:
    """The residual of a solve and its stopping test (module docstring), from the Riemannian gradient rg
    of F/K: G_i = K inv_i rg_i with inv = pre/τ, r = (Σ_i w_i |G_i|²)^{1/2} (batch) and |G_i| (tokens),
    both squared relative to the largest entry of the batch item (no overflow)."""

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
        """(B,) True where the item has not met its tolerance (module docstring)."""
        out = ~(torch.isfinite(r) & (r <= self.thresh))
        if bool(self.stiff.any()):
            bad_tok = ((~(self.tokens(rg) <= self.thresh_tok)) & (self.wt > 0)).any(-1)
            out = out | (self.stiff & bad_tok)
        return out


def lbfgs_direction(y, rg, pre, memory):
    """The L-BFGS direction at y: the two-loop recursion over the pairs (s, z) of ``memory``, projected on the
    tangent space at y (pairs with ⟨s, z⟩ <= 0 masked out), with the initial inverse Hessian γ·pre.  Where it is
    not a descent direction: the preconditioned gradient −pre·rg.  Returns (direction, mask of those items)."""
    qv = rg.clone()
    alphas = []
    for s_, z_ in reversed(memory):
        s_p, z_p = tangent_projection(y, s_), tangent_projection(y, z_)
        sz = dot(s_p, z_p)
        rho = torch.where(sz > 0, 1 / sz.clamp_min(1e-300), torch.zeros_like(sz))
        al = rho * dot(s_p, qv)
        qv = qv - al[:, None, None] * z_p
        alphas.append((al, rho, s_p, z_p))
    gamma = torch.ones(y.shape[0], dtype=y.dtype, device=y.device)
    if alphas:  # γ from the newest pair
        s_p, z_p = alphas[0][2:]
        sz, zz = dot(s_p, z_p), dot(z_p, pre * z_p)
        gamma = torch.where((sz > 0) & (zz > 0), sz / zz.clamp_min(1e-300), gamma)
    rv = gamma[:, None, None] * pre * qv
    for al, rho, s_p, z_p in reversed(alphas):
        be = rho * dot(z_p, rv)
        rv = rv + (al - be)[:, None, None] * s_p
    d = tangent_projection(y, -rv)
    gd = dot(rg, d)
    bad = ~(gd < 0) | ~torch.isfinite(gd)
    return torch.where(bad[:, None, None], -pre * rg, d), bad


def line_search(objective: Callable, y, f, g, d, gd, active, *, retract: Callable = normalize):
    """Armijo backtracking along y ↦ retract(y + a d), a = 1, ½, ... (20 tries), batched: (y, f, g) with
    the items that found a decrease updated, and the mask of the items done (found one, or inactive)."""
    slack = 10 * torch.finfo(y.dtype).eps * f.abs()
    a = torch.ones(y.shape[0], dtype=y.dtype, device=y.device)
    done = ~active
    y_new, f_new, g_new = y.clone(), f.clone(), g.clone()
    for _ls in range(_LINE_SEARCH_TRIES):
        cand = retract(y + a[:, None, None] * d)
        fc, gc = value_and_grad(objective, cand)
        ok = ~done & torch.isfinite(fc) & (fc <= f + 1e-4 * a * gd + slack)
        if bool(ok.any()):
            y_new[ok], f_new[ok], g_new[ok] = cand[ok], fc[ok], gc[ok]
        done = done | ok
        if bool(done.all()):
            break
        a = torch.where(done, a, a / 2)
    return y_new, f_new, g_new, done


def descend(objective: Callable, y: torch.Tensor, pre: torch.Tensor, wt: torch.Tensor, *, tau: float, tol: float,
            max_iter: int, memory: int = 8, retract: Callable = normalize, trust_radius: float = TRUST_RADIUS):
    """The solve of :func:`minimize` without its input checks (the arguments are as there, ``pre`` of
    shape (B, n, 1) or (B, n, d) and ``wt`` (B, n) given).

    Returns
    -------
    tuple
        (y, {"residual", "iterations", "converged", "r0"}, each (B,)); (y, None) when the objective or its
        gradient is not finite at the start.
    """
    B = y.shape[0]
    f, g = value_and_grad(objective, y)
    if not bool(torch.isfinite(f).all()) or not bool(torch.isfinite(g).all()):
        return y, None
    # a stiff objective (module docstring): F/K, K = τ max_i |G_i| / ρ, so that the first preconditioned
    # step is at most ρ and the L-BFGS products stay finite; K = 1 otherwise
    K = (tau * (tangent_projection(y, g) * (pre / tau)).abs().amax((-1, -2)) / trust_radius).clamp_min(1.0)
    if bool((K > 1).any()):
        raw = objective

        def objective(yy, raw=raw, K=K):
            return raw(yy) / K

        f, g = f / K, g / K.reshape(B, 1, 1)
    rg = tangent_projection(y, g)
    res = Residual(rg, pre / tau, wt, K, tau=tau, tol=tol)
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
        stalled = stalled | (since > _STALL)
        active = res.unconverged(rg, r) & ~stalled
        if not bool(active.any()):
            break
        d, bad = lbfgs_direction(y, rg, pre, pairs)
        # trust region: no token moves by more than ρ (chordal) in one iteration (inactive for τ|V| < ρ)
        dn = d.norm(dim=-1, keepdim=True)
        d = d * torch.where(dn > trust_radius, trust_radius / dn.clamp_min(torch.finfo(y.dtype).tiny),
                            torch.ones_like(dn))
        d = d * active[:, None, None].to(y.dtype)
        y_new, f_new, g_new, done = line_search(objective, y, f, g, d, dot(rg, d), active, retract=retract)
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


def minimize(objective: Callable, y0: torch.Tensor, *, preconditioner: Optional[torch.Tensor] = None,
             weights: Optional[torch.Tensor] = None, tau: float = 1.0, tol: Optional[float] = None,
             max_iter: int = 200, memory: int = 8, retract: Callable = normalize,
             trust_radius: float = TRUST_RADIUS):
    """Minimise B objectives on the product of spheres by Riemannian L-BFGS (module docstring).

    Parameters
    ----------
    objective : Callable
        ``objective(y)``: (B, n, d) -> (B,), differentiable by autograd; item b may depend on y[b] only
        (the batch items are independent problems).
    y0 : torch.Tensor
        the start (B, n, d), float32 or float64, a fixed point of ``retract`` (on the manifold).
    preconditioner : Optional[torch.Tensor]
        pre ≥ 0 (not NaN), (B, n, 1) or (B, n, d): the initial inverse Hessian (scaled by γ) and the metric
        of the residual; tokens with pre = 0 stay where they are.  None: 1.
    weights : Optional[torch.Tensor]
        w ≥ 0 (not NaN), (B, n): the token weights of the residual norm r = (Σ_i w_i |G_i|²)^{1/2}.  None: 1/n.
    tau : float
        τ > 0, the time scale of the residual G = pre·P∇F/τ (1: the preconditioned gradient itself).
    tol : Optional[float]
        relative tolerance on r (None: 1e-9 in float64, 1e-4 in float32).
    max_iter : int
        iterations (≥ 1).
    memory : int
        number of (s, z) pairs of the two-loop recursion (≥ 1).
    retract : Callable
        the retraction R(y) of the line search, (B, n, d) -> (B, n, d); default x ↦ x/|x| (the projected
        flow's; ``model.layer_norm.retract``).
    trust_radius : float
        ρ > 0, the largest move of one token in one iteration.

    Returns
    -------
    tuple
        (y (B, n, d), info) with info a dict of (B,) tensors: "residual" r at y, "iterations" (accepted moves,
        torch.long), "converged" (bool) and "r0" (r at y0); info is None (and y = y0) when the objective or
        its gradient is not finite at y0.

    Raises
    ------
    TypeError, ValueError
        bad input (before any evaluation of the objective).

    Examples
    --------
    >>> import torch
    >>> from transformer_pde.solvers.jko.lbfgs import minimize
    >>> M = torch.diag(torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64))
    >>> y0 = torch.nn.functional.normalize(torch.ones(1, 1, 3, dtype=torch.float64), dim=-1)
    >>> y, info = minimize(lambda y: ((y @ M) * y).sum((-1, -2)), y0)
    >>> bool(info["converged"]), round(abs(float(y[0, 0, 1])), 6)
    (True, 1.0)
    """
    if not callable(objective):
        raise TypeError(f"objective must be callable(y) -> (B,), got {type(objective).__name__}")
    if not callable(retract):
        raise TypeError(f"retract must be callable(y) -> y on the manifold, got {type(retract).__name__}")
    if not isinstance(y0, torch.Tensor):
        raise TypeError(f"y0 must be a torch.Tensor (B, n, d), got {type(y0).__name__}")
    if y0.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"y0 must be float32 or float64, got {y0.dtype}; convert it with y0.double()")
    if y0.dim() != 3 or y0.numel() == 0:
        raise ValueError(f"y0 must have shape (B, n, d) with B, n, d >= 1 (one batch axis; reshape others into it), "
                         f"got {tuple(y0.shape)}")
    if not bool(torch.isfinite(y0).all()):
        raise ValueError("y0 holds NaN or inf")
    off = float((retract(y0) - y0).abs().max())
    if not off <= sphere_tolerance(y0.dtype):
        raise ValueError(f"y0 is not on the manifold of retract: max |retract(y0) − y0| = {off:.1e} > "
                         f"{sphere_tolerance(y0.dtype):.0e}; start from retract(y0)")
    B, n, d = y0.shape
    f = dict(dtype=y0.dtype, device=y0.device)
    if preconditioner is None:
        pre = torch.ones(B, n, 1, **f)
    else:
        pre = _check_tensor_arg(preconditioner, "preconditioner", y0, ((B, n, 1), (B, n, d)))
    if weights is None:
        wt = torch.full((B, n), 1.0 / n, **f)
    else:
        wt = _check_tensor_arg(weights, "weights", y0, ((B, n),))
    tau = check_positive(tau, "tau")
    tol = (1e-9 if y0.dtype == torch.float64 else 1e-4) if tol is None else check_positive(tol, "tol")
    max_iter = check_int(max_iter, "max_iter")
    memory = check_int(memory, "memory")
    trust_radius = check_positive(trust_radius, "trust_radius")
    return descend(objective, y0.detach(), pre, wt, tau=tau, tol=tol, max_iter=max_iter, memory=memory,
                   retract=retract, trust_radius=trust_radius)


def _check_tensor_arg(t, name: str, y0: torch.Tensor, shapes) -> torch.Tensor:
    """A non-negative tensor of one of ``shapes``, on y0's dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != y0.dtype or t.device != y0.device:
        raise TypeError(f"{name} must have y0's dtype and device ({y0.dtype}, {y0.device}), got ({t.dtype}, "
                        f"{t.device}); convert it with .to(y0)")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
    if not bool((t >= 0).all()):  # +inf is allowed (a token whose scale underflowed); NaN is not
        raise ValueError(f"{name} must be >= 0 (and not NaN)")
    return t.detach()
