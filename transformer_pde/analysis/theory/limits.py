"""The limit objects of the theorems (docs/theorems.md): the Hessian of E at an ω-limit point and the fast-weights
limit SDE.

:func:`riemannian_hessian` is the second-order test of the ω-limit theorem (the sign of the Hessian of
E(·, Θ_∞) on (S^{d-1})^n at the final state); :func:`common_noise_sde` integrates the Stratonovich SDE with a
noise shared by all tokens that value matrices resampled at every layer converge to (its coefficients are
:func:`transformer_pde.analysis.theory.stability.fast_weights_coefficients`).
"""

from __future__ import annotations

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_positive, check_tensor, check_tokens
from ...model.energy import energy
from ...model.field import velocity
from ...model.heads import Heads
from ...model.sphere import normalize

__all__ = ["riemannian_hessian", "common_noise_sde"]


def riemannian_hessian(x, heads: Heads, weights=None):
    """The Hessian of E(·, Θ) on (S^{d-1})^n at the tokens x (n, d), in orthonormal tangent frames.

    u ↦ E(x(u)) with x_i(u) = (x_i + B_i u_i)/|x_i + B_i u_i|, B_i (d, d−1) an orthonormal basis of
    T_{x_i}S^{d-1}; the derivatives at u = 0 are taken by automatic differentiation of the energy.
    At a critical point (zero Riemannian gradient) this is the Riemannian Hessian.

    Parameters
    ----------
    x : torch.Tensor
        tokens (n, d) on the unit sphere (one configuration, no batch axes).
    heads : Heads
        unbatched heads Θ.
    weights : torch.Tensor or None
        token weights (n,), None = uniform.

    Returns
    -------
    tuple of torch.Tensor
        (gradient (n(d−1),), Hessian (n(d−1), n(d−1))).

    Raises
    ------
    ValueError
        x is not one configuration (n, d) of unit vectors.
    """
    check_tokens(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be one configuration of shape (n, d), got shape {tuple(x.shape)}; pass x[b] for "
                         f"each batch member")
    n, d = x.shape
    P = torch.eye(d, dtype=x.dtype, device=x.device) - x[:, :, None] * x[:, None, :]
    _, vecs = torch.linalg.eigh(P)
    B = vecs[..., 1:]  # eigenvalue 1 eigenvectors: the tangent space (the 0 one is x)

    def E(u):
        y = x + (B @ u.reshape(n, d - 1, 1)).squeeze(-1)
        return energy(y / y.norm(dim=-1, keepdim=True), heads, weights)

    u0 = torch.zeros(n * (d - 1), dtype=x.dtype, device=x.device)
    grad = torch.autograd.functional.jacobian(E, u0)
    hess = torch.autograd.functional.hessian(E, u0)
    return grad, hess


def common_noise_sde(x0, heads: Heads, increments, dt: float, *, normalization: str = "softmax",
                     direction: str = DEFAULT_DIRECTION):
    """The fast-weights limit SDE dx_i = V[μ, (A, V̄)](x_i) dt + Σ_h ω_h P_{x_i} (∘dW_h) ȳ_h(x_i), by the
    projected stochastic Heun scheme (Stratonovich, weak order 1), with one noise shared by all tokens.

    The field is linear in the value matrices, so one step with Brownian increments ΔW_h (d×d per head) is
    the velocity of the heads (A_h, V̄_h dt + ΔW_h): k1 = velocity(x, ·), x̃ = (x + k1)/|·|,
    k2 = velocity(x̃, ·), x ← (x + (k1 + k2)/2)/|·|.

    Parameters
    ----------
    x0 : torch.Tensor
        tokens (P, n, d) (P paths).
    heads : Heads
        mean heads (A_h, V̄_h, ω_h, β), unbatched.
    increments : torch.Tensor
        (K, P, H, d, d) Brownian increments of the value noise (variance s² dt per entry).
    dt : float
        the step of the increments.
    normalization, direction
        as :func:`transformer_pde.velocity`.

    Returns
    -------
    torch.Tensor
        tokens (K + 1, P, n, d) at the grid times.

    Raises
    ------
    ValueError, TypeError
        tokens off the sphere, increments that are not (K, P, H, d, d), or dt not positive.
    """
    check_tokens(x0, "x0")
    check_tensor(increments, "increments", min_dim=5)
    dt = check_positive(dt, "dt")
    A, Vbar = heads.score_matrix, heads.value_matrix
    x = x0
    out = [x0]
    for dW in increments:  # the steps of one SDE path (sequential in time)
        h = Heads(A, Vbar * dt + dW, heads.weights, heads.beta)
        k1 = velocity(x, h, normalization=normalization, direction=direction)
        xt = normalize(x + k1)
        k2 = velocity(xt, h, normalization=normalization, direction=direction)
        x = normalize(x + 0.5 * (k1 + k2))
        out.append(x)
    return torch.stack(out)
