"""Optimal-transport distances between token measures on the sphere, with ONE convention.

Measures are weighted point clouds μ = Σ_i a_i δ_{x_i}, x_i ∈ S^{d-1}: tokens ``x (..., n, d)``
and weights ``a (..., n)`` (uniform when omitted); leading dims are batches.

**The convention.**  Every distance in this library is built on the cost

    c(x, y) = |x − y|²            (chordal, squared; metric="chordal", the default)
    c(x, y) = d_S(x, y)²          (great-circle, squared; metric="geodesic")

so that

    W2²(μ, ν) = min_{π ∈ Π(a, b)} Σ_ij π_ij c(x_i, y_j).

How the libraries map onto it (tested on two-point and rotated measures in
``tests/test_transport.py``):

* POT: ``ot.emd`` with ``ot.dist(x, y)`` (squared Euclidean) is this cost as it stands.
* geomloss: ``SamplesLoss("sinkhorn", p=2)`` uses C(x, y) = ½|x − y|² and the temperature
  ε_g = blur^p = blur².  For our cost c = 2C and our temperature ε (the one that multiplies
  KL(π | a⊗b) next to c) the entropic problems are related by OT^c_ε = 2 OT^C_{ε/2}, so we
  call geomloss with ``blur = (ε/2)^{1/2}`` and multiply its value by 2.  ``diameter`` is set
  to 2 (chordal) or π (geodesic): the largest distance on the unit sphere.
* POT's spherical sliced Wasserstein (``ot.sliced_wasserstein_sphere``) projects onto great
  circles parametrised by [0, 1) (circumference 1) and returns (mean_U W_2²(P^U μ, P^U ν))^{1/2}
  in those units.  We multiply by 2π to report it in radians: on S¹ every projection is an
  isometry of the circle and the value equals the geodesic W2 exactly.

The Sinkhorn divergence is the debiased one,
S_ε(μ, ν) = OT_ε(μ, ν) − ½ OT_ε(μ, μ) − ½ OT_ε(ν, ν), OT_ε = min ⟨π, c⟩ + ε KL(π | a⊗b); it is
≥ 0, vanishes iff μ = ν, and for converged potentials |S_ε − W2²| ≤ ε·max(H(a), H(b)) with H
the Shannon entropy of the weights (OT ≤ OT_ε(μ, ν) ≤ OT + ε min(H(a), H(b)) and
0 ≤ OT_ε(μ, μ) ≤ ε H(a)).  "squared" distances are W2², S_ε and SSW²; the default returns
their square roots (S_ε clamped at 0 first).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import numpy as np
import torch

from ..utils.validation import (
    broadcast_shapes, check_choice, check_int, check_positive, check_same, check_seed, check_token_weights,
    check_tokens,
)

__all__ = ["distance", "transport_plan", "cost_matrix", "sinkhorn_divergence", "KINDS", "METRICS", "BACKENDS",
           "keops_available"]
#: named internal API (not public), used by the JKO scheme
__internal__ = ["emd_plans", "sq_chordal"]

KINDS = ("w2", "sinkhorn", "sliced")
METRICS = ("chordal", "geodesic")
BACKENDS = ("auto", "tensorized", "online", "keops")

Measure = Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]

# above this many elements of (n, m, d) the cost is formed from the Gram matrix (2 − 2⟨x, y⟩)
_DIFF_ELEMENTS = 1 << 24


def keops_available() -> bool:
    """True when pykeops can be imported (geomloss' "online" backend needs it)."""
    try:
        import pykeops  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


# ---------------------------------------------------------------------------- costs
def sq_chordal(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x_i − y_j|², (..., n, m); exact differences when small (no cancellation, safe gradient at 0)."""
    n, m, d = x.shape[-2], y.shape[-2], x.shape[-1]
    batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
    if math.prod(batch) * n * m * d <= _DIFF_ELEMENTS:
        return (x.unsqueeze(-2) - y.unsqueeze(-3)).square().sum(-1)
    return (2 - 2 * x @ y.transpose(-1, -2)).clamp_min(0)


def _sq_geodesic(c2: torch.Tensor) -> torch.Tensor:
    """d_S² = (2 asin(|x−y|/2))² from c2 = |x−y|²; series c2 + c2²/12 near 0 (smooth gradient)."""
    small = c2 < 1e-6
    safe = torch.where(small, torch.ones_like(c2), c2)
    exact = (2 * torch.asin((safe.sqrt() / 2).clamp(max=1.0))).square()
    return torch.where(small, c2 + c2 * c2 / 12, exact)


def cost_matrix(x: torch.Tensor, y: torch.Tensor, *, metric: str = "chordal") -> torch.Tensor:
    """c(x_i, y_j) of the module convention: |x_i − y_j|² (chordal) or d_S(x_i, y_j)² (geodesic).

    Parameters
    ----------
    x : torch.Tensor
        (..., n, d), y: (..., m, d) unit vectors (not validated: a helper for the solvers).

    Returns
    -------
    torch.Tensor
        (..., n, m) costs, dtype and device of x; differentiable (also at x_i = y_j).
    """
    check_choice(metric, METRICS, "metric")
    c2 = sq_chordal(x, y)
    return c2 if metric == "chordal" else _sq_geodesic(c2)


# ---------------------------------------------------------------------------- input handling
def _split(mu, name: str):
    if isinstance(mu, (tuple, list)):
        if len(mu) != 2:
            raise ValueError(f"{name} must be tokens (..., n, d) or a pair (tokens, weights); got a sequence of length {len(mu)}")
        x, w = mu
    else:
        x, w = mu, None
    check_tokens(x, f"{name} tokens")
    check_token_weights(w, x, f"{name} weights", f"{name} tokens")
    return x, w


def _prepare(mu, nu):
    """Validate and flatten both measures to (B, n, d), (B, n), (B, m, d), (B, m)."""
    x, a = _split(mu, "mu")
    y, b = _split(nu, "nu")
    check_same(x, y, "mu tokens", "nu tokens")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"mu lives on S^{x.shape[-1] - 1} (d = {x.shape[-1]}) but nu on S^{y.shape[-1] - 1} "
                         f"(d = {y.shape[-1]}); both need the same d")
    try:
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2],
                                       *(() if a is None else (a.shape[:-1],)), *(() if b is None else (b.shape[:-1],)))
    except RuntimeError:
        raise ValueError(f"the batch shapes of mu {tuple(x.shape[:-2])} and nu {tuple(y.shape[:-2])} do not broadcast") from None
    n, m, d = x.shape[-2], y.shape[-2], x.shape[-1]
    B = math.prod(batch)
    f = dict(dtype=x.dtype, device=x.device)
    a = torch.full((n,), 1.0 / n, **f) if a is None else a
    b = torch.full((m,), 1.0 / m, **f) if b is None else b
    xs = x.expand(*batch, n, d).reshape(B, n, d)
    ys = y.expand(*batch, m, d).reshape(B, m, d)
    return xs, a.expand(*batch, n).reshape(B, n), ys, b.expand(*batch, m).reshape(B, m), tuple(batch)


# ---------------------------------------------------------------------------- exact OT
def emd_plans(a: torch.Tensor, b: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """Exact plans for every batch item (POT emd, a loop over the batch: POT's LP is not batched).

    The LP runs in float64 on the CPU with the weights renormalised there; the plan is
    returned on M's device and dtype and carries no gradient (envelope theorem: the gradient
    of the optimal value with respect to the points is that of Σ π_ij c_ij at fixed π)."""
    import ot

    A = a.detach().to("cpu", torch.float64).numpy()
    Bw = b.detach().to("cpu", torch.float64).numpy()
    C = M.detach().to("cpu", torch.float64).numpy()
    plans = []
    for k in range(C.shape[0]):
        ak = A[k] / A[k].sum()
        bk = Bw[k] / Bw[k].sum()
        P, log = ot.emd(ak, bk, np.ascontiguousarray(C[k]), numItermax=max(100000, 50 * C.shape[1] * C.shape[2]),
                        log=True)
        if log.get("warning"):
            raise RuntimeError(f"POT emd did not solve the transport problem of batch item {k}: {log['warning']}")
        plans.append(P)
    return torch.as_tensor(np.stack(plans), dtype=M.dtype, device=M.device)


def transport_plan(mu: Measure, nu: Measure, *, metric: str = "chordal") -> torch.Tensor:
    """Exact optimal plan π ∈ argmin_{π ∈ Π(a, b)} Σ_ij π_ij c(x_i, y_j) (POT ``emd``).

    Parameters
    ----------
    mu, nu
        tokens (..., n, d) / (..., m, d), or pairs (tokens, weights (..., n)).
    metric : str
        "chordal" (c = |x − y|²) or "geodesic" (c = d_S²).

    Returns
    -------
    torch.Tensor
        (..., n, m) plan with row sums a and column sums b; no gradient.
    """
    check_choice(metric, METRICS, "metric")
    x, a, y, b, batch = _prepare(mu, nu)
    P = emd_plans(a, b, cost_matrix(x, y, metric=metric))
    return P.reshape(*batch, *P.shape[-2:])


# ---------------------------------------------------------------------------- Sinkhorn
def _resolve_backend(backend: str, custom_cost: bool, n: int, m: int) -> str:
    check_choice(backend, BACKENDS, "backend")
    if backend == "keops":
        backend = "online"
    if backend == "online":
        if custom_cost:
            raise ValueError("the geodesic / mobility-weighted costs are implemented for backend='tensorized' only; "
                             "use backend='tensorized' (or metric='chordal' for the KeOps backend)")
        if not keops_available():
            raise ValueError("backend='online' (KeOps) needs the pykeops package, which is not installed: "
                             "pip install pykeops (CUDA recommended), or use backend='tensorized'")
        return "online"
    if backend == "auto":
        return "online" if (not custom_cost and n * m > 5000 ** 2 and keops_available()) else "tensorized"
    return backend


def sinkhorn_divergence(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, b: torch.Tensor, *, eps: float,
                        cost: Optional[Callable] = None, metric: str = "chordal", diameter: Optional[float] = None,
                        scaling: float = 0.9, backend: str = "tensorized") -> torch.Tensor:
    """Debiased Sinkhorn divergence S_ε in the module convention, batched (geomloss).

        S_ε = OT_ε(μ, ν) − ½ OT_ε(μ, μ) − ½ OT_ε(ν, ν),  OT_ε = min ⟨π, c⟩ + ε KL(π | a⊗b)

    Parameters
    ----------
    x : torch.Tensor
        (B, n, d), a: (B, n), y: (B, m, d), b: (B, m) (not validated: solver helper;
        :func:`distance` is the checked entry point).
    eps : float
        ε > 0 of the cost c.
    cost : Optional[Callable]
        optional symmetric cost callable (X (B, N, d), Y (B, M, d)) -> (B, N, M) that
        replaces c (tensorized backend only); ``diameter`` must then bound sqrt(max c).
    metric : str
        "chordal" | "geodesic" when ``cost`` is None.
    scaling : float
        geomloss ε-scaling ratio (0.9: accurate, 0.5: fast).

    Returns
    -------
    torch.Tensor
        (B,) values, differentiable with respect to x, y, a and b.
    """
    from geomloss import SamplesLoss

    n, m = x.shape[-2], y.shape[-2]
    if cost is not None:
        # a user cost is taken as it stands: ε of that cost, blur = ε^{1/2}
        loss = SamplesLoss("sinkhorn", p=2, blur=math.sqrt(eps), diameter=diameter, scaling=scaling,
                           cost=cost, backend="tensorized", debias=True)
        return loss(a, x, b, y)
    be = _resolve_backend(backend, metric == "geodesic", n, m)
    if metric == "geodesic":
        half = lambda X, Y: 0.5 * cost_matrix(X, Y, metric="geodesic")  # noqa: E731
        loss = SamplesLoss("sinkhorn", p=2, blur=math.sqrt(eps / 2), diameter=math.pi if diameter is None else diameter,
                           scaling=scaling, cost=half, backend="tensorized", debias=True)
    else:
        loss = SamplesLoss("sinkhorn", p=2, blur=math.sqrt(eps / 2), diameter=2.0 if diameter is None else diameter,
                           scaling=scaling, backend=be, debias=True)
    return 2 * loss(a, x, b, y)


# ---------------------------------------------------------------------------- sliced
def _stiefel(d: int, k: int, *, seed: int, dtype, device) -> torch.Tensor:
    """k uniform d×2 frames (Q of a Gaussian QR), from a local generator (no global RNG side effect)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    Z = torch.randn(k, d, 2, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(Z)
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # unique (Haar) frame
    return Q.to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------- public entry point
def distance(mu: Measure, nu: Measure, kind: str = "w2", *, squared: bool = False, metric: str = "chordal",
             eps: float = 1e-3, backend: str = "auto", scaling: float = 0.9, n_projections: int = 200,
             seed: int = 0) -> torch.Tensor:
    """Distance between token measures, in the module's single convention (module docstring).

        kind="w2":        W2(μ, ν) = (min_π Σ π_ij c(x_i, y_j))^{1/2}      (POT emd, exact)
        kind="sinkhorn":  S_ε(μ, ν)^{1/2}, S_ε the debiased Sinkhorn divergence (geomloss)
        kind="sliced":    SSW_2(μ, ν) in radians (POT ot.sliced_wasserstein_sphere × 2π)

    with c(x, y) = |x − y|² (metric="chordal") or d_S(x, y)² (metric="geodesic").

    Parameters
    ----------
    mu, nu
        tokens (..., n, d) and (..., m, d) on the unit sphere, or pairs
        (tokens, weights (..., n)) with non-negative weights summing to 1 (uniform when omitted).
        Batch dims broadcast against each other.
    kind : str
        "w2" | "sinkhorn" | "sliced".
    squared : bool
        return W2², S_ε or SSW² instead of their square roots.
    metric : str
        "chordal" | "geodesic" (w2 and sinkhorn; sliced is geodesic by construction).
    eps : float
        ε > 0 of the Sinkhorn divergence, in units of the cost c (|x − y|² ≤ 4 on the sphere).
    backend : str
        geomloss backend "auto" | "tensorized" | "online"/"keops" (the latter need pykeops).
    scaling : float
        geomloss ε-scaling ratio in (0, 1): closer to 1 is more accurate.
    n_projections, seed
        Monte-Carlo projections of the sliced distance (a local generator;
        the global RNG is not touched).

    Returns
    -------
    torch.Tensor
        (...,) tensor, dtype and device of mu's tokens.  "w2" is differentiable through the costs
        at the optimal plan (envelope theorem), "sinkhorn" through geomloss, "sliced" through POT.

    Raises
    ------
    TypeError, ValueError
        tokens off the sphere, bad weights, mismatched d or batch shapes,
        an empty measure (n = 0) or an empty batch (a batch dim of size 0), unknown kind / metric /
        backend, eps <= 0, a seed that is not an int in [0, 2^64), or a KeOps backend without pykeops.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    >>> y = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    >>> float(tp.distance(x, y, squared=True))  # |x − y|² = 2
    2.0
    """
    check_choice(kind, KINDS, "kind")
    check_choice(metric, METRICS, "metric")
    check_choice(backend, BACKENDS, "backend")
    if not isinstance(squared, bool):
        raise TypeError(f"squared must be True or False, got {type(squared).__name__}")
    if kind == "sinkhorn":
        eps = check_positive(eps, "eps")
        scaling = check_positive(scaling, "scaling")
        if not scaling < 1:
            raise ValueError(f"scaling must lie in (0, 1), got {scaling}")
    if kind == "sliced":
        check_int(n_projections, "n_projections")
        seed = check_seed(seed)
    x, a, y, b, batch = _prepare(mu, nu)
    if kind == "sinkhorn":
        _resolve_backend(backend, metric == "geodesic", x.shape[-2], y.shape[-2])  # errors before any work
    if kind == "w2":
        M = cost_matrix(x, y, metric=metric)
        P = emd_plans(a, b, M)
        val = (P * M).sum((-1, -2))
    elif kind == "sinkhorn":
        val = sinkhorn_divergence(x, a, y, b, eps=eps, metric=metric, scaling=scaling, backend=backend)
    else:
        import ot

        proj = _stiefel(x.shape[-1], n_projections, seed=seed, dtype=x.dtype, device=x.device)
        vals = []
        for k in range(x.shape[0]):
            # renormalise: POT checks |x|² − 1 at 1e-4, tighter than float32 round-off allows
            xs = x[k] / x[k].norm(dim=-1, keepdim=True)
            ys = y[k] / y[k].norm(dim=-1, keepdim=True)
            v = ot.sliced_wasserstein_sphere(xs, ys, a[k], b[k], n_projections=n_projections, p=2, projections=proj)
            vals.append((2 * math.pi * v) ** 2)
        val = torch.stack(vals)
    val = val.reshape(batch)
    if squared:
        return val
    return val.clamp_min(0).sqrt()
