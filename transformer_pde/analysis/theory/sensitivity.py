"""Worst-case sensitivity of the token flow, and bounds computed along the trajectory (docs/theorems.md).

For tokens x ∈ (S^{d−1})^n with masses w (a weighted empirical measure μ = Σ w_i δ_{x_i}) and weights Θ_t,
the flow map Φ_t: x_0 ↦ x_t of ẋ_i = V[μ, Θ_t](x_i) has a derivative DΦ_t that maps tangent
perturbations at x_0 to tangent perturbations at x_t.  In the mass-weighted norm
‖δ‖_w² = Σ_i w_i |δ_i|² (the cost of the identity coupling between μ and the moved measure, = W_2 to first
order when that coupling is optimal) the worst-case amplification is the top singular value

    σ_1(t) = max_δ ‖DΦ_t δ‖_w / ‖δ‖_w,     σ_1(t) = lim_{ε→0} sup_{ν_0: W_2(μ_0,ν_0)=ε moved atoms} W_2(μ_t, ν_t)/ε.

:func:`flow_sensitivity` integrates the variational equation δ' = DV(x_t) δ alongside the tokens by forward-mode
differentiation through the RK4 steps (one Jacobian–vector product per tangent direction, all directions in
one batch), so σ_1, …, σ_k are exact singular values of the discrete flow's Jacobian, not estimates from a
few random directions.

**Bounds along the trajectory.**  For tangent δ, d/dt ‖δ‖_w² = 2 ⟨δ, W DV δ⟩ ≤ 2 μ_w(t) ‖δ‖_w², where
μ_w(t) = λ_max of the symmetric part of M = W^{1/2} Bᵀ DV(x_t) B W^{−1/2} (B: orthonormal tangent frames, W the
masses) is the logarithmic norm of the field's derivative on the tangent space.  Hence

    σ_1(t) ≤ exp(∫_0^t μ_w(s) ds)                 (log-norm bound: tight at short times)
           ≤ exp(∫_0^t ‖M(s)‖_2 ds)               (local Lipschitz constant of the field along the run)
           ≤ exp(∫_0^t L(s) ds)                   (the global constant of ``lipschitz_bound``).

With a forcing (the weights perturbed to Θ^ε), δ' = DV δ + g with g = V[·, Θ^ε_t] − V[·, Θ_t] at x_t, and
Duhamel's formula gives ‖δ_t‖_w ≤ ∫_0^t exp(∫_s^t μ_w) ‖g(s)‖_w ds (:func:`duhamel_bound`).

How loose the log-norm bound is depends on the draw: on the quick stability config (n = 12, d = 3, H = 2,
T = 1) bound/σ_1 stayed below 1.2 for constant heads and reached 2.08 for layerwise heads (docs/theorems.md);
no factor is guaranteed.  The heads may be non-symmetric: the field's derivative is taken in forward mode,
where the field steps aside from its fused pass (whose ``out=`` products forward mode does not support).
"""

from __future__ import annotations

from typing import Dict

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...model.field import velocity
from ...model.heads import Heads
from ...utils.validation import check_int, check_positive, check_token_weights, check_tokens, direction_sign

__all__ = ["tangent_frames", "field_jacobian_rates", "flow_sensitivity", "duhamel_bound"]

_LEFT = 1e-9  # the last RK stage reads the weights just before t_{k+1} (left limit at a layer boundary)


def _heads_at(theta, t: float) -> Heads:
    return theta if isinstance(theta, Heads) else theta.heads_at(t)


def tangent_frames(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal bases B_i (d, d−1) of the tangent spaces T_{x_i}S^{d−1}, shape (..., n, d, d−1).

    Parameters
    ----------
    x : torch.Tensor
        points (..., n, d) on the sphere.

    Returns
    -------
    torch.Tensor
        B with B_iᵀ B_i = I and B_iᵀ x_i = 0.
    """
    d = x.shape[-1]
    P = torch.eye(d, dtype=x.dtype, device=x.device) - x[..., :, None] * x[..., None, :]
    return torch.linalg.eigh(P)[1][..., 1:]  # eigenvalue-1 eigenvectors (the 0 one is x)


def _reduced_jacobian(x, heads, w, normalization, direction):
    """M = W^{1/2} Bᵀ DV(x) B W^{−1/2}, (n(d−1), n(d−1)), for tokens (n, d) and masses (n,)."""
    n, d = x.shape

    def V(z):
        return velocity(z.reshape(n, d), heads, weights=w, normalization=normalization,
                        direction=direction).reshape(-1)

    J = torch.func.jacfwd(V)(x.reshape(-1)).reshape(n, d, n, d)
    B = tangent_frames(x)  # (n, d, d-1)
    M = torch.einsum("iak,iajb,jbl->ikjl", B, J, B)  # (n, d-1, n, d-1)
    s = w.sqrt()
    M = M * (s[:, None, None, None] / s[None, None, :, None])
    return M.reshape(n * (d - 1), n * (d - 1))


def field_jacobian_rates(x, heads: Heads, weights=None, *, normalization: str = "softmax",
                         direction: str = DEFAULT_DIRECTION) -> Dict[str, torch.Tensor]:
    """The logarithmic norm μ_w and the spectral norm ‖M‖₂ of the field's derivative on the tangent space
    (module docstring), for tokens x (n, d) with masses ``weights`` (n,) (None: uniform).

    Parameters
    ----------
    x : torch.Tensor
        tokens (n, d) on the sphere, no batch dims.
    heads : Heads
        unbatched heads.
    weights : torch.Tensor, optional
        token masses (n,), summing to 1.
    normalization, direction : str
        as :func:`transformer_pde.velocity`.

    Returns
    -------
    Dict[str, torch.Tensor]
        {"log_norm": μ_w, "lipschitz": ‖M‖₂} (0-dim tensors in the dtype of x).

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.sample_uniform(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> r = tp.theory.field_jacobian_rates(x, tp.Heads.scalar([1.0], 3).to(torch.float64))
    >>> bool(r["log_norm"] <= r["lipschitz"])
    True
    """
    check_tokens(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be (n, d) without batch dims, got shape {tuple(x.shape)}; loop over batches")
    w = _masses(x, weights)
    M = _reduced_jacobian(x, heads, w, normalization, direction)
    return {"log_norm": torch.linalg.eigvalsh(0.5 * (M + M.T))[-1], "lipschitz": torch.linalg.matrix_norm(M, ord=2)}


def _masses(x, weights):
    n = x.shape[-2]
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=x.dtype, device=x.device)
    check_token_weights(weights, x)
    return weights


def _rk4(x, theta, t, dt, w, kw):
    def f(z, s):  # stages evaluated on the sphere (the retracted RK4 step)
        return velocity(z / z.norm(dim=-1, keepdim=True), _heads_at(theta, s), weights=w, **kw)
    t_end = t + dt * (1 - _LEFT)
    k1 = f(x, t)
    k2 = f(x + 0.5 * dt * k1, t + 0.5 * dt)
    k3 = f(x + 0.5 * dt * k2, t + 0.5 * dt)
    k4 = f(x + dt * k3, t_end)
    y = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y / y.norm(dim=-1, keepdim=True)


def _same_heads(theta, t_left: float, t_right: float) -> bool:
    """Whether Θ is continuous between the two times (False across a jump of piecewise-constant weights)."""
    if isinstance(theta, Heads):
        return True
    a, b = _heads_at(theta, t_left), _heads_at(theta, t_right)
    return bool((a.score_matrix - b.score_matrix).abs().max() <= 1e-6 * (1 + a.score_matrix.abs().max()))


def flow_sensitivity(x0: torch.Tensor, theta, *, t1: float, dt: float, weights=None, normalization: str = "softmax",
                     direction: str = DEFAULT_DIRECTION, record_every: int = 1, top: int = 3) -> Dict[str, torch.Tensor]:
    """Top singular values σ_1 ≥ … ≥ σ_k of the tangent derivative of the flow map (mass-weighted norm), and
    the three bounds of the module docstring, on the recorded times of an RK4 run.

    Parameters
    ----------
    x0 : torch.Tensor
        tokens (n, d) on the sphere (no batch dims).
    theta
        a :class:`Heads` (constant) or any weight process with ``heads_at(t)`` (a sampled ``tp.WeightPath``,
        ``tp.Layerwise``, ``tp.Oscillating``); unbatched heads.
    t1, dt : float
        horizon and RK4 step (t1/dt a whole number).
    weights : torch.Tensor, optional
        token masses (n,) (None: uniform).
    normalization, direction : str
        as :func:`transformer_pde.velocity`.
    record_every : int
        record every k-th step (the bounds' integrals use every step).
    top : int
        how many singular values to return.

    Returns
    -------
    Dict[str, torch.Tensor]
        "times" (R,), "x" (R, n, d), "singular" (R, top), "right" (n, d): the worst initial direction at t1
        (tangent, ‖·‖_w = 1), "log_bound" (R,) = ∫_0^t μ_w, "log_lipschitz_bound" (R,) = ∫_0^t ‖M‖₂,
        "log_norm" (R,) = μ_w at the recorded times.

    Raises
    ------
    ValueError
        x0 not on the sphere or batched, t1/dt not whole, non-finite tokens during the run.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.sample_uniform(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> out = tp.theory.flow_sensitivity(x, tp.Heads.scalar([1.0], 3).to(torch.float64), t1=0.2, dt=0.05)
    >>> bool((out["singular"][:, 0] <= torch.exp(out["log_bound"]) * (1 + 1e-9)).all())
    True
    """
    check_tokens(x0, "x0")
    if x0.dim() != 2:
        raise ValueError(f"x0 must be (n, d) without batch dims, got shape {tuple(x0.shape)}; loop over batches")
    t1, dt = check_positive(t1, "t1"), check_positive(dt, "dt")
    K = round(t1 / dt)
    if K < 1 or abs(K * dt - t1) > 1e-9 * max(1.0, t1):
        raise ValueError(f"t1/dt = {t1 / dt:g} is not a whole number of steps; choose dt = {t1 / max(K, 1):.6g}")
    every = check_int(record_every, "record_every")
    top = check_int(top, "top")
    direction_sign(direction)
    n, d = x0.shape
    h0 = _heads_at(theta, 0.0)
    if not isinstance(h0, Heads) or len(h0.batch_shape):
        raise ValueError("theta must be unbatched Heads or a process whose heads_at(t) gives unbatched Heads; got "
                         f"batch shape {tuple(getattr(h0, 'batch_shape', ()))}: loop over the batch")
    w = _masses(x0, weights)
    kw = dict(normalization=normalization, direction=direction)
    C = n * (d - 1)
    # initial tangent directions: column c = token i, frame vector k, scaled by w_i^{-1/2} (unit ‖·‖_w)
    B0 = tangent_frames(x0)  # (n, d, d-1)
    cols = torch.zeros(n, d - 1, n, d, dtype=x0.dtype, device=x0.device)
    idx = torch.arange(n, device=x0.device)
    cols[idx, :, idx, :] = (B0 / w.sqrt()[:, None, None]).transpose(-1, -2)
    cols = cols.reshape(C, n, d)
    sw = w.sqrt().repeat_interleave(d)[:, None]  # (n d, 1): the mass-weighted norm

    def rates(z, s):
        M = _reduced_jacobian(z, _heads_at(theta, s), w, normalization, direction)
        return torch.stack([torch.linalg.eigvalsh(0.5 * (M + M.T))[-1], torch.linalg.matrix_norm(M, ord=2)])

    x, J = x0, cols.reshape(C, n * d).T  # J: (n d, C), images of the initial directions
    acc = torch.zeros(2, dtype=x0.dtype, device=x0.device)
    out = {"times": [], "x": [], "singular": [], "log_bound": [], "log_lipschitz_bound": [], "log_norm": []}

    def record(k, x, J, acc, mu_now):
        sv = torch.linalg.svdvals(J * sw)
        out["times"].append(torch.tensor(k * dt, dtype=x0.dtype))
        out["x"].append(x)
        out["singular"].append(sv[:top])
        out["log_bound"].append(acc[0].clone())
        out["log_lipschitz_bound"].append(acc[1].clone())
        out["log_norm"].append(mu_now)

    r_start = rates(x0, 0.0)
    record(0, x, J, acc, r_start[0])
    for k in range(K):
        t = k * dt
        step = lambda z: _rk4(z.reshape(n, d), theta, t, dt, w, kw).reshape(-1)  # noqa: E731
        Js = torch.autograd.functional.jacobian(step, x.reshape(-1), vectorize=True)  # (n d, n d)
        with torch.no_grad():
            x_new = step(x.reshape(-1)).reshape(n, d)
        J = Js @ J
        if not bool(torch.isfinite(x_new).all() and torch.isfinite(J).all()):
            raise ValueError(f"non-finite tokens or tangent directions at t = {t + dt:g} (step {k + 1}); "
                             "reduce dt or the scale of the heads")
        t_end = t + dt * (1 - _LEFT)
        v0 = velocity(x, _heads_at(theta, t), weights=w, **kw)
        v1 = velocity(x_new, _heads_at(theta, t_end), weights=w, **kw)
        xm = 0.5 * (x + x_new) + dt / 8 * (v0 - v1)  # Simpson on the step's cubic Hermite interpolant
        xm = xm / xm.norm(dim=-1, keepdim=True)
        r_end = rates(x_new, t_end)
        acc = acc + dt / 6 * (r_start + 4 * rates(xm, t + 0.5 * dt) + r_end)
        x = x_new
        # the next step starts from the right limit of the weights (a layer boundary changes them)
        r_start = r_end if _same_heads(theta, t_end, (k + 1) * dt) else rates(x, (k + 1) * dt)
        if (k + 1) % every == 0 or k + 1 == K:
            record(k + 1, x, J, acc, r_start[0])
    sv_full = torch.linalg.svd(J * sw, full_matrices=False)
    right = (sv_full.Vh[0] @ cols.reshape(C, n * d)).reshape(n, d)  # the worst initial direction (‖·‖_w = 1)
    res = {k: torch.stack(v) for k, v in out.items()}
    res["right"] = right
    return res


def duhamel_bound(times: torch.Tensor, log_norm: torch.Tensor, forcing: torch.Tensor, *,
                  log: bool = False) -> torch.Tensor:
    """∫_0^t exp(∫_s^t μ(u) du) g(s) ds on a grid (trapezoid rule in both integrals), shape (T, ...).

    The bound ‖δ_t‖ ≤ this for δ' = DV δ + forcing, ‖forcing(s)‖ ≤ g(s), log-norm μ (module docstring).

    Parameters
    ----------
    times : torch.Tensor
        (T,) increasing times.
    log_norm : torch.Tensor
        (T, ...) μ at the times.
    forcing : torch.Tensor
        (T, ...) g ≥ 0 at the times.
    log : bool
        return the logarithm of the bound (−inf at t_0), safe where exp(∫μ) overflows float64.

    Returns
    -------
    torch.Tensor
        (T, ...) the bound (0 at t_0), or its logarithm.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> t = torch.linspace(0, 1, 1001, dtype=torch.float64)
    >>> b = tp.theory.duhamel_bound(t, torch.zeros_like(t), torch.ones_like(t))  # ∫_0^1 1 ds
    >>> round(float(b[-1]), 6)
    1.0
    """
    if times.dim() != 1 or log_norm.shape[0] != times.shape[0] or forcing.shape != log_norm.shape:
        raise ValueError(f"times must be (T,), log_norm and forcing (T, ...) of one shape; got "
                         f"{tuple(times.shape)}, {tuple(log_norm.shape)}, {tuple(forcing.shape)}")
    if bool((forcing < 0).any()):
        raise ValueError("forcing must be >= 0 (a norm)")
    t = times.to(log_norm.dtype).reshape(-1, *([1] * (log_norm.dim() - 1)))
    h = t[1:] - t[:-1]
    lam = torch.cat([torch.zeros_like(log_norm[:1]), torch.cumsum(0.5 * (log_norm[1:] + log_norm[:-1]) * h, 0)])
    integrand = torch.exp(-lam) * forcing
    inner = torch.cat([torch.zeros_like(forcing[:1]), torch.cumsum(0.5 * (integrand[1:] + integrand[:-1]) * h, 0)])
    return lam + torch.log(inner) if log else torch.exp(lam) * inner

