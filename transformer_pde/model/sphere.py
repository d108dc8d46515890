"""Geometry of the unit sphere S^{d-1} ⊂ R^d and standard token configurations.

Shapes: points ``x`` are ``(..., d)`` unit vectors; tangent vectors ``v`` at ``x`` have
the same shape and satisfy ``<x, v> = 0``.  All functions broadcast over leading dims
and follow the dtype and device of their inputs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..utils.validation import check_int, check_positive

__all__ = [
    "tangent_projection",
    "retract",
    "normalize",
    "exp_map",
    "log_map",
    "geodesic_distance",
    "chordal_distance",
    "sample_uniform",
    "equiangular",
    "octahedral",
    "circle_grid",
    "fibonacci_sphere",
    "icosphere",
    "clustered_circle",
]


def tangent_projection(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P_x v = v - <x, v> x, the orthogonal projection onto T_x S^{d-1}."""
    return v - (x * v).sum(-1, keepdim=True) * x


def normalize(x: torch.Tensor) -> torch.Tensor:
    """x / |x| along the last axis."""
    return x / x.norm(dim=-1, keepdim=True)


def retract(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Projective retraction R_x(v) = (x + v) / |x + v| (the reference code's step)."""
    return normalize(x + v)


def exp_map(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Riemannian exponential exp_x(v) = cos|v| x + sin|v| v/|v| for tangent v."""
    nv = v.norm(dim=-1, keepdim=True)
    # sin(t)/t written with torch.sinc so that v = 0 is exact and differentiable
    sinc = torch.sinc(nv / math.pi)
    return normalize(torch.cos(nv) * x + sinc * v)


def log_map(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Riemannian logarithm log_x(y): the tangent vector at x of length d(x, y) pointing to y.

    Undefined for antipodal points (returns a vector of length ~pi in an arbitrary
    direction of the numerically computed difference)."""
    u = tangent_projection(x, y)
    theta = geodesic_distance(x, y).unsqueeze(-1)
    nu = u.norm(dim=-1, keepdim=True)
    scale = torch.where(nu > 0, theta / nu.clamp_min(torch.finfo(x.dtype).tiny), torch.ones_like(nu))
    return scale * u


def geodesic_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Great-circle distance d(x, y) = 2 asin(|x - y| / 2) (accurate near 0 and pi).

    Parameters
    ----------
    x, y : torch.Tensor
        unit vectors (..., d), broadcast against each other.

    Returns
    -------
    torch.Tensor
        (...,) angles in [0, π].

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> e = torch.eye(3, dtype=torch.float64)
    >>> round(float(tp.sphere.geodesic_distance(e[0], e[1])), 12)   # π/2
    1.570796326795
    """
    return 2 * torch.asin((chordal_distance(x, y) / 2).clamp(max=1.0))


def chordal_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Euclidean distance |x - y| of the embedding."""
    return (x - y).norm(dim=-1)


def _factory(dtype, device):
    return dict(dtype=dtype or torch.get_default_dtype(), device=device)


def sample_uniform(n: int, d: int, *, batch_shape=(), generator=None, dtype=None, device=None):
    """n i.i.d. points of the uniform law on S^{d-1}: (*batch_shape, n, d)."""
    check_int(n, "n")
    check_int(d, "d", minimum=2)
    z = torch.randn(*batch_shape, n, d, generator=generator, **_factory(dtype, device))
    return normalize(z)


def equiangular(n: int, gamma: float, d: int | None = None, *, dtype=None, device=None):
    """n unit vectors with <x_i, x_j> = gamma for all i != j, shape (n, d).

    The Gram matrix (1-gamma) I + gamma 11^T is PSD iff -1/(n-1) <= gamma <= 1 and has
    rank n (rank n-1 for the regular simplex gamma = -1/(n-1), rank 1 at gamma = 1), so
    d must be at least that rank.  ``d`` defaults to the rank (at least 2).

    Parameters
    ----------
    n : int
        number of vectors (at least 2).
    gamma : float
        the common overlap, in [-1/(n-1), 1].
    d : int or None
        the dimension (at least the rank of the Gram matrix); None: the rank.

    Returns
    -------
    torch.Tensor
        (n, d) unit vectors.

    Raises
    ------
    ValueError
        gamma outside [-1/(n-1), 1], or d below the rank.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.equiangular(4, 0.25, dtype=torch.float64)
    >>> x.shape, round(float(x[0] @ x[1]), 12)
    (torch.Size([4, 4]), 0.25)
    """
    check_int(n, "n", minimum=2)
    gamma = float(gamma)
    lo = -1.0 / (n - 1)
    if not (lo - 1e-12 <= gamma <= 1.0):
        raise ValueError(f"gamma must lie in [-1/(n-1), 1] = [{lo:.4g}, 1] for n = {n}, got {gamma}")
    G = (1 - gamma) * np.eye(n) + gamma * np.ones((n, n))
    lam, U = np.linalg.eigh(G)
    keep = lam > 1e-10
    rank = int(keep.sum())
    d = max(rank, 2) if d is None else check_int(d, "d", minimum=2)
    if d < rank:
        raise ValueError(
            f"{n} equiangular vectors with gamma = {gamma} span {rank} dimensions; pass d >= {rank}"
        )
    X = U[:, keep] * np.sqrt(lam[keep])
    out = np.zeros((n, d))
    out[:, :rank] = X
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return torch.as_tensor(out, **_factory(dtype, device))


def octahedral(n: int = 200, d: int = 3, *, noise: float = 0.05, seed: int = 42, dtype=None, device=None):
    """The paper's initial condition: n tokens near the 2d vertices ±e_k of the cross-polytope.

    Each token picks a vertex uniformly, adds N(0, noise^2) noise per coordinate and is
    normalised.  The draws use ``numpy.random.default_rng(seed)`` in the same order as the
    public reference code (choice, then normal), so seed 42 gives its tokens (computed here
    in float64 rather than float32).  For d = 2 the vertices are the 4 points ±e_1, ±e_2.
    """
    check_int(n, "n")
    check_int(d, "d", minimum=2)
    check_positive(noise, "noise", allow_zero=True)
    rng = np.random.default_rng(seed)
    # vertex order +e_0, -e_0, +e_1, -e_1, ... as in the reference
    verts = np.stack([s * np.eye(d)[k] for k in range(d) for s in (1.0, -1.0)])
    pts = verts[rng.choice(len(verts), n)] + rng.normal(0.0, noise, (n, d))
    pts /= np.linalg.norm(pts, axis=-1, keepdims=True)
    return torch.as_tensor(pts, **_factory(dtype, device))


def clustered_circle(n: int = 100, k: int = 5, *, noise: float = 0.05, seed: int = 42, dtype=None, device=None):
    """Tokens on S^1 around k equally spaced base angles with N(0, noise^2) angular noise
    (the reference code's S^1 initial condition, same draw order)."""
    check_int(n, "n")
    check_int(k, "k")
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 2 * np.pi, k, endpoint=False)
    ang = rng.choice(base, n) + rng.normal(0, noise, n)
    return torch.as_tensor(np.stack([np.cos(ang), np.sin(ang)], -1), **_factory(dtype, device))


def circle_grid(m: int, *, dtype=None, device=None):
    """m equally spaced points on S^1, angle 2 pi k / m: (m, 2)."""
    check_int(m, "m", minimum=3)
    a = torch.arange(m, **_factory(dtype, device)) * (2 * math.pi / m)
    return torch.stack([torch.cos(a), torch.sin(a)], -1)


def fibonacci_sphere(m: int, *, dtype=None, device=None):
    """m quasi-uniform points on S^2 (golden-angle spiral, equal-area latitude bands): (m, 3)."""
    check_int(m, "m", minimum=4)
    f = _factory(dtype, device)
    k = torch.arange(m, dtype=torch.float64, device=device)
    z = 1 - (2 * k + 1) / m
    r = torch.sqrt((1 - z * z).clamp_min(0))
    phi = k * math.pi * (3 - math.sqrt(5))
    return torch.stack([r * torch.cos(phi), r * torch.sin(phi), z], -1).to(f["dtype"])


def icosphere(subdivisions: int = 2, *, dtype=None, device=None):
    """Vertices of the subdivided icosahedron on S^2: 10 * 4^s + 2 points, (m, 3)."""
    check_int(subdivisions, "subdivisions", minimum=0)
    p = (1 + math.sqrt(5)) / 2
    verts = [(-1, p, 0), (1, p, 0), (-1, -p, 0), (1, -p, 0), (0, -1, p), (0, 1, p),
             (0, -1, -p), (0, 1, -p), (p, 0, -1), (p, 0, 1), (-p, 0, -1), (-p, 0, 1)]
    faces = [(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4),
             (11, 10, 2), (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8),
             (3, 8, 9), (4, 9, 5), (2, 4, 11), (6, 2, 10), (8, 6, 7), (9, 8, 1)]
    V = [np.array(v, dtype=float) / np.linalg.norm(v) for v in verts]
    for _ in range(subdivisions):
        cache: dict = {}

        def mid(a, b):
            key = (min(a, b), max(a, b))
            if key not in cache:
                m = V[a] + V[b]
                V.append(m / np.linalg.norm(m))
                cache[key] = len(V) - 1
            return cache[key]

        new = []
        for a, b, c in faces:
            ab, bc, ca = mid(a, b), mid(b, c), mid(c, a)
            new += [(a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca)]
        faces = new
    return torch.as_tensor(np.stack(V), **_factory(dtype, device))
