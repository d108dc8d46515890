"""Synchronisation of attention on the circle for any sign of β (docs/repulsive.md).

Tokens x_i = (cos θ_i, sin θ_i) on S¹, one head A = V = I, uniform weights, the library's energy

    E(θ) = (1/(2βn²)) Σ_ij e^{β cos(θ_i − θ_j)}          (its finite part ½ n⁻² Σ_ij cos(θ_i − θ_j) at β = 0).

The un-normalised ascent flow (``normalization="unnormalized"``, ``direction="ascent"``) is
θ̇_i = (1/n) Σ_j e^{β cos θ_ij} sin(θ_j − θ_i) = n ∂E/∂θ_i, a gradient ascent of E for every real β; the softmax
flow divides token i's velocity by its partition function m_i > 0, so it has the same equilibria, and at an
equilibrium its linearisation D⁻¹H (D = diag(m_i/n) > 0) has the inertia of the Hessian H of E (Sylvester): a
configuration is a stable equilibrium of either flow iff it is a critical point at which H is negative definite
on the complement of the rotations.

With φ(t) = e^{β cos t}, (1/β) φ''(t) = (β sin²t − cos t) e^{β cos t} is finite at β = 0, and

    ∂E/∂θ_i = (1/(βn²)) Σ_j φ'(θ_i − θ_j),      ∂²E/∂θ_i∂θ_k = −(1/(βn²)) φ''(θ_i − θ_k) (i ≠ k),
    ∂²E/∂θ_i² = (1/(βn²)) Σ_{j≠i} φ''(θ_i − θ_j),     so  δ²E[δ] = (1/(2βn²)) Σ_ij φ''(θ_ij)(δ_i − δ_j)².

**What is proved.**  Criscitiello, Rebjock, McRae, Boumal (arXiv 2405.18273): for φ = e^{βt} with β ∈ (0, 1] every
local maximum of E on the circle is synchronised (the Taylor coefficients of φ' decrease), so the flow synchronises
from almost every start.  Polyanskiy, Rigollet, Yao (arXiv 2507.22857): synchronisation for every β ≥ −0.16, and
not for β < −2/3.  Why −2/3: at three equal clusters 120° apart, every pair term of δ²E carries
(1/β)φ''(0) = −e^β < 0 or (1/β)φ''(2π/3) = (3β/4 + 1/2) e^{−β/2}, negative iff β < −2/3 — then the configuration
is a strict local maximum (n divisible by 3; for other n the clusters are unequal and :func:`cluster_equilibrium`
finds their positions).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ...utils.validation import check_int, check_real

__all__ = ["SYNC_BETA_MIN", "NO_SYNC_BETA_MAX", "CRMB_SYNC_RANGE", "proven_regime", "circle_gradient",
           "circle_hessian", "stability_spectrum", "order_parameter", "balanced_sizes", "cluster_equilibrium",
           "cluster_configuration"]

#: Polyanskiy–Rigollet–Yao: synchronisation from almost every start for every β >= SYNC_BETA_MIN
SYNC_BETA_MIN = -0.16
#: Polyanskiy–Rigollet–Yao: no global synchronisation for β < NO_SYNC_BETA_MAX
NO_SYNC_BETA_MAX = -2.0 / 3.0
#: Criscitiello–Rebjock–McRae–Boumal: synchronisation for β in (0, 1]
CRMB_SYNC_RANGE = (0.0, 1.0)


def proven_regime(beta) -> str:
    """"synchronises" (β ≥ −0.16), "not globally" (β < −2/3) or "open" (in between): what is proved on S¹."""
    b = check_real(beta, "beta")
    if b >= SYNC_BETA_MIN:
        return "synchronises"
    return "not globally" if b < NO_SYNC_BETA_MAX else "open"


def _beta_col(beta, theta: torch.Tensor):
    """β as a tensor broadcasting against (..., 1, 1)."""
    b = beta if isinstance(beta, torch.Tensor) else torch.tensor(float(beta), dtype=theta.dtype, device=theta.device)
    return b.to(theta.dtype).reshape(*b.shape, 1, 1) if b.dim() else b


def circle_gradient(theta: torch.Tensor, beta) -> torch.Tensor:
    """∂E/∂θ_i = −(1/n²) Σ_j e^{β cos θ_ij} sin θ_ij (θ_ij = θ_i − θ_j), (..., n); β a float or a tensor of the batch
    shape (...,)."""
    t = theta.unsqueeze(-1) - theta.unsqueeze(-2)
    b = _beta_col(beta, theta)
    n = theta.shape[-1]
    return -(torch.exp(b * torch.cos(t)) * torch.sin(t)).sum(-1) / n ** 2


def circle_hessian(theta: torch.Tensor, beta) -> torch.Tensor:
    """The Hessian of E in the angles (module docstring), (..., n, n); finite at β = 0."""
    t = theta.unsqueeze(-1) - theta.unsqueeze(-2)
    b = _beta_col(beta, theta)
    n = theta.shape[-1]
    c = torch.cos(t)
    k = (b * torch.sin(t) ** 2 - c) * torch.exp(b * c) / n ** 2  # (1/(βn²)) φ''(θ_ik)
    return torch.diag_embed(k.sum(-1)) - k  # H_ii = Σ_{j≠i} k_ij (the j = i terms cancel), H_ik = −k_ik


def stability_spectrum(theta: torch.Tensor, beta) -> torch.Tensor:
    """The eigenvalues (ascending, (..., n − 1)) of the Hessian restricted to the complement of the rotations
    (the constant direction): all < 0 at a strict local maximum of E, i.e. a stable equilibrium of the ascent flows."""
    H = circle_hessian(theta, beta)
    n = theta.shape[-1]
    # an orthonormal basis of 1^⊥: the last n − 1 columns of the QR factor of [1 | I]
    M = torch.cat([torch.ones(n, 1, dtype=theta.dtype, device=theta.device),
                   torch.eye(n, dtype=theta.dtype, device=theta.device)[:, : n - 1]], 1)
    Q = torch.linalg.qr(M).Q[:, 1:]
    return torch.linalg.eigvalsh(Q.T @ H @ Q)


def order_parameter(theta: torch.Tensor) -> torch.Tensor:
    """R = |(1/n) Σ_j e^{iθ_j}| ∈ [0, 1] (1: synchronised), (...,)."""
    return torch.sqrt(torch.cos(theta).mean(-1) ** 2 + torch.sin(theta).mean(-1) ** 2)


def balanced_sizes(n: int, k: int) -> list:
    """k cluster sizes summing to n, as equal as possible (largest first)."""
    n, k = check_int(n, "n"), check_int(k, "k")
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def cluster_equilibrium(sizes: Sequence[int], beta, *, tol: float = 1e-10, horizon: float = 4000.0) -> torch.Tensor:
    """Angles (k,) of k point clusters of the given sizes (in this order around the circle), the first at 0, in
    equilibrium: a critical point of the energy restricted to such clusters,
    E_k(α) = Σ_ab m_a m_b e^{β cos(α_a − α_b)}/(2β).  Newton–Powell (scipy's hybrid method) from k equally spaced
    clusters, accepted when every arc stays within a factor 1.5 of 2π/k; otherwise the clusters' ascent flow
    from there up to ``horizon`` (RK45), then Newton–Powell: a local maximum of E_k, which every stable state of
    this family is (the restriction of a negative definite Hessian is negative definite).  Whether the
    equilibrium is stable for the n individual tokens is :func:`stability_spectrum`'s to say.  float64.

    Raises
    ------
    ValueError
        no equilibrium with distinct clusters in this order is found (the flow merges them)."""
    from scipy.integrate import solve_ivp
    from scipy.optimize import root

    beta = check_real(beta, "beta")
    m = torch.tensor([float(check_int(s, "size")) for s in sizes], dtype=torch.float64)
    k = len(sizes)
    if k < 2:
        raise ValueError("give at least two cluster sizes")
    m = m / m.sum()

    def full(rest):
        return torch.cat([torch.zeros(1, dtype=torch.float64), torch.as_tensor(rest, dtype=torch.float64)])

    def grad(a):  # ∂E_k/∂α_a · (1/m_a)
        t = a.unsqueeze(-1) - a.unsqueeze(-2)
        return -(m * torch.exp(beta * torch.cos(t)) * torch.sin(t)).sum(-1)

    start = (2 * math.pi * torch.arange(1, k, dtype=torch.float64) / k).numpy()
    near = root(lambda r: grad(full(r))[1:].numpy(), start, method="hybr", tol=1e-15)
    alpha = full(near.x)  # (hybr may stop with its success flag down at a zero of the gradient: test the gradient)
    arcs = torch.diff(torch.cat([alpha, torch.tensor([2 * math.pi], dtype=torch.float64)]))
    if float(grad(alpha).abs().max()) <= tol and bool(((arcs > 2 * math.pi / k / 1.5) &
                                                       (arcs < 1.5 * 2 * math.pi / k)).all()):
        return alpha
    # the clusters' own ascent flow α̇_a = Σ_b m_b e^{β cos α_ab} sin(α_b − α_a) (relative to cluster 0), then Newton
    flow = solve_ivp(lambda _t, r: (grad(full(r))[1:] - grad(full(r))[0]).numpy(), (0.0, horizon), start,
                     rtol=1e-10, atol=1e-12)
    x_end = flow.y[:, -1]
    sol = root(lambda r: grad(full(r))[1:].numpy(), x_end, method="hybr", tol=1e-15)
    alpha = min((full(sol.x), full(x_end)), key=lambda a: float(grad(a).abs().max()))
    arcs = torch.diff(torch.cat([alpha, torch.tensor([2 * math.pi], dtype=torch.float64)]))
    if float(grad(alpha).abs().max()) > tol or bool((arcs <= 1e-6).any()):
        raise ValueError(f"no local maximum of {k} distinct clusters of sizes {list(sizes)} in this order at beta = "
                         f"{beta} (the maximisation ends at angles {[round(float(a), 4) for a in alpha]})")
    return alpha


def cluster_configuration(sizes: Sequence[int], angles: torch.Tensor) -> torch.Tensor:
    """The n = Σ sizes token angles of clusters at ``angles``, (n,)."""
    return torch.cat([angles[i].expand(int(s)) for i, s in enumerate(sizes)])
