"""Cluster statistics of token configurations and plateau (metastability) detection.

Every statistic takes tokens ``x`` of shape ``(..., n, d)`` on S^{d-1} and optional token
weights ``w`` of shape ``(..., n)`` (non-negative, summing to 1; ``None`` = uniform 1/n) and
is batched over the leading dims (ensembles, Monte-Carlo paths, recorded times).  dtype and
device follow ``x``.

One scale links them.  Two tokens are *linked* when their chordal distance is below the
radius r, equivalently when their overlap exceeds 1 − ε with ε = r²/2:

    |x_i − x_j| < r   ⇔   ⟨x_i, x_j⟩ > 1 − ε,      ε = r²/2      (unit vectors)

* :func:`cluster_labels` / :func:`cluster_count` — single linkage at radius r: the connected
  components of the graph of linked tokens (tokens of zero weight are ignored);
* :func:`gram_rank_count` — the numerical rank of the thresholded Gram matrix
  T_ij = 1[⟨x_i, x_j⟩ > 1 − ε] (k exactly separated clusters give k all-ones blocks: rank k);
* :func:`pair_fraction` — P_ε = Σ_{i≠j} w_i w_j 1[⟨x_i, x_j⟩ > 1 − ε] / Σ_{i≠j} w_i w_j, the
  (weighted) fraction of distinct token pairs that are ε-close; a smooth version (logistic of
  width ``temperature`` in place of the indicator) is differentiable in x;
* :func:`largest_cluster_mass` — max over the single-linkage clusters C of Σ_{i∈C} w_i
  (differentiable in w);
* :func:`cluster_radius` — max over clusters C and members i ∈ C of the geodesic distance from
  x_i to the normalised weighted mean of C (differentiable in x, through the means);
* :func:`cluster_statistics` — all of them (and the mean overlap) as a dict, the form that
  ``tp.solve(..., saveat=tp.SaveAt(observables=...))`` and the studies record over time.

:func:`crossing_time` gives the first time a recorded series reaches a level (clustering times).
Metastability: :func:`detect_plateaus` finds the flat steps of a staircase (energy, cluster
count) in a time series, batched over leading dims; see its docstring for the thresholds.

    >>> import torch, transformer_pde as tp
    >>> e = torch.eye(3, dtype=torch.float64)
    >>> x = torch.stack([e[0], e[0], e[1], e[2]])          # three clusters, one of two tokens
    >>> int(tp.clustering.cluster_count(x, radius=0.1)), int(tp.clustering.gram_rank_count(x, radius=0.1))
    (3, 3)
    >>> round(float(tp.clustering.pair_fraction(x, radius=0.1)), 4)   # 2 ordered pairs of 12
    0.1667
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ..utils.validation import (broadcast_shapes, check_choice, check_positive, check_tensor, check_token_weights,
                                check_tokens)

__all__ = [
    "linked",
    "cluster_labels",
    "cluster_count",
    "mean_overlap",
    "gram_rank_count",
    "pair_fraction",
    "pair_fraction_observable",
    "cluster_masses",
    "largest_cluster_mass",
    "cluster_radius",
    "cluster_statistics",
    "statistics_observables",
    "Staircase",
    "detect_plateaus",
    "crossing_time",
    "radius_from_eps",
    "eps_from_radius",
]


# ---------------------------------------------------------------------------- helpers
def eps_from_radius(radius: float) -> float:
    """ε = r²/2: ⟨x, y⟩ > 1 − ε ⇔ |x − y| < r for unit vectors."""
    return 0.5 * check_positive(radius, "radius") ** 2


def radius_from_eps(eps: float) -> float:
    """r = √(2ε), the inverse of :func:`eps_from_radius`."""
    return math.sqrt(2 * check_positive(eps, "eps"))


def _check(x, weights, radius):
    check_tokens(x, "x")
    check_token_weights(weights, x, "weights", "x")
    radius = check_positive(radius, "radius")
    if radius > 2.0:
        raise ValueError(f"radius is a chordal distance and must be <= 2 (the diameter of the sphere), got {radius}; "
                         f"every pair is linked already at radius 2")
    return radius


def _weights(x, weights):
    n = x.shape[-2]
    if weights is None:
        return torch.full(x.shape[:-2] + (n,), 1.0 / n, dtype=x.dtype, device=x.device)
    return weights.expand(*broadcast_shapes(weights.shape[:-1], x.shape[:-2]), n)


def _half_sq_dist(x):
    """|x_i − x_j|²/2, (..., n, n): by differences (accurate when tokens nearly coincide)."""
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist").square() * 0.5


def linked(x, *, radius: float = 0.1, weights=None) -> torch.Tensor:
    """Adjacency of single linkage, (..., n, n) bool: |x_i − x_j| < radius and w_i, w_j > 0.

    The diagonal is True for tokens of positive weight.  Raises ValueError / TypeError for bad input."""
    radius = _check(x, weights, radius)
    adj = _half_sq_dist(x.detach()) < 0.5 * radius * radius
    if weights is not None:
        pos = weights.detach() > 0
        adj = adj & pos.unsqueeze(-1) & pos.unsqueeze(-2)
    return adj


# ---------------------------------------------------------------------------- single linkage
def _components(adj: torch.Tensor) -> torch.Tensor:
    """Connected components of the boolean graphs adj (..., n, n) (symmetric, reflexive).

    Minimum-label propagation with pointer jumping, vectorised over the batch:
        ℓ_i ← min_{j : adj_ij} ℓ_j,   then   ℓ_i ← ℓ_{ℓ_i},
    iterated to the fixed point (at most n rounds; O(log n)-ish on clustered configurations).
    At the fixed point ℓ_i is the smallest index of i's component.  Returns (..., n) int64."""
    n = adj.shape[-1]
    batch = adj.shape[:-2]
    idx = torch.arange(n, device=adj.device)
    labels = idx.expand(*batch, n).clone()
    big = torch.tensor(n, device=adj.device)
    for _ in range(n):  # bound on the rounds, not a loop over tokens: each round is one batched pass
        new = torch.where(adj, labels.unsqueeze(-2), big).amin(-1)
        new = torch.minimum(new, labels)
        new = torch.gather(new, -1, new)  # pointer jumping: a label points at a token of the same component
        if torch.equal(new, labels):
            break
        labels = new
    return labels


def cluster_labels(x, *, radius: float = 0.1, weights=None) -> torch.Tensor:
    """Single-linkage cluster labels at chordal radius r, (..., n) int64.

    Clusters are the connected components of the graph i ~ j ⇔ |x_i − x_j| < r; the label of a
    token is the smallest token index of its cluster.  Tokens of zero weight form no links (each
    is its own singleton) and are not counted by :func:`cluster_count`.

    Parameters
    ----------
    x
        (..., n, d) unit vectors.  radius: r in (0, 2].  weights: (..., n) or None.

    Raises
    ------
    TypeError, ValueError
        bad x, weights or radius (before any work)."""
    return _components(linked(x, radius=radius, weights=weights))


def cluster_masses(x, *, radius: float = 0.1, weights=None) -> torch.Tensor:
    """Mass of every single-linkage cluster, indexed by its label: (..., n) with
    M_c = Σ_{i : ℓ_i = c} w_i (zero for indices that label no cluster).  Differentiable in w."""
    labels = cluster_labels(x, radius=radius, weights=weights)
    w = _weights(x, weights)
    onehot = (labels.unsqueeze(-1) == torch.arange(x.shape[-2], device=x.device)).to(w.dtype)  # (..., n_i, n_c)
    return (w.unsqueeze(-1) * onehot).sum(-2)


def cluster_count(x, *, radius: float = 0.1, weights=None, metric: str = "chordal") -> torch.Tensor:
    """Number of single-linkage clusters at radius r that carry positive mass, (...,) int64.

    k groups of tokens whose within-group links chain together at radius r and whose groups are
    more than r apart give exactly k.  See :func:`cluster_labels`.

    Parameters
    ----------
    x
        (..., n, d) unit vectors.
    radius : float
        the linking radius r: a chordal distance |x_i − x_j| in (0, 2] (``metric="chordal"``), or a
        geodesic angle θ > 0 (``metric="geodesic"``), linked when the angle is below θ: the same graph
        as the chordal radius 2 sin(min(θ, π)/2).
    weights
        (..., n) token weights or None (uniform).
    metric : str
        "chordal" or "geodesic": how ``radius`` is measured.

    Raises
    ------
    TypeError, ValueError
        bad x, weights, radius or metric (before any work)."""
    check_choice(metric, ("chordal", "geodesic"), "metric")
    if metric == "geodesic":
        radius = 2 * math.sin(min(check_positive(radius, "radius"), math.pi) / 2)
    labels = cluster_labels(x, radius=radius, weights=weights)  # validates x and weights first
    w = _weights(x, weights)
    roots = labels == torch.arange(x.shape[-2], device=x.device)
    return (roots & (w > 0)).sum(-1)


def largest_cluster_mass(x, *, radius: float = 0.1, weights=None) -> torch.Tensor:
    """max_C Σ_{i∈C} w_i over the single-linkage clusters at radius r, (...,) in (0, 1].
    1 for one cluster; 1/n for n separated tokens of uniform weight.  Differentiable in w."""
    return cluster_masses(x, radius=radius, weights=weights).amax(-1)


def cluster_radius(x, *, radius: float = 0.1, weights=None) -> torch.Tensor:
    """Largest geodesic spread of a single-linkage cluster, (...,):

        R = max_C max_{i∈C, w_i>0} d_geo(x_i, m_C),   m_C = Σ_{i∈C} w_i x_i / |Σ_{i∈C} w_i x_i|

    (0 when every cluster is a point; a cluster whose weighted mean vanishes, e.g. antipodal
    tokens, which single linkage at r < 2 never joins, would give NaN).  Differentiable in x and w
    through the means.  Uniform weights count every token."""
    labels = cluster_labels(x, radius=radius, weights=weights)
    return _spread(x, _weights(x, weights), labels)


def _spread(x, w, labels):
    """max_i d_geo(x_i, m_{C(i)}) over tokens of positive weight, (...,)."""
    same = (labels.unsqueeze(-1) == labels.unsqueeze(-2)).to(x.dtype)  # (..., i, j): j in i's cluster
    m = (same * w.unsqueeze(-2)) @ x  # (..., n, d): weighted sum of i's cluster
    pos = w > 0
    # a token of zero weight is its own cluster with m = 0: divide by 1 there (it is masked out below),
    # so that neither the value nor the gradient meets 0/0
    norm = m.norm(dim=-1, keepdim=True)
    m = m / torch.where(pos.unsqueeze(-1), norm, torch.ones_like(norm))
    dist = 2 * torch.asin(((x - m).norm(dim=-1) / 2).clamp(max=1.0))
    return torch.where(pos, dist, torch.zeros_like(dist)).amax(-1)


# ---------------------------------------------------------------------------- Gram statistics
def pair_fraction(x, *, radius: Optional[float] = None, eps: Optional[float] = None, weights=None,
                  temperature: Optional[float] = None) -> torch.Tensor:
    """Weighted fraction of distinct ε-close token pairs, (...,) in [0, 1]:

        P_ε = Σ_{i≠j} w_i w_j 1[⟨x_i, x_j⟩ > 1 − ε] / Σ_{i≠j} w_i w_j

    with ε given directly or as ε = r²/2 from a chordal radius (default r = 0.1).  Uniform weights:
    the number of ordered pairs i ≠ j with ⟨x_i, x_j⟩ > 1 − ε over n(n − 1).  With ``temperature`` τ
    the indicator is replaced by the logistic σ((ε − |x_i − x_j|²/2)/τ), a smooth version that is
    differentiable in x (and tends to the hard one as τ → 0).

    Equiangular tokens (⟨x_i, x_j⟩ = γ for all i ≠ j) give 1 when γ > 1 − ε and 0 otherwise; one
    point gives 1 — one token (n = 1), or weights that put all the mass on one token (then
    Σ_{i≠j} w_i w_j = 0 and the measure is a Dirac mass, a single cluster); k equal clusters of m
    tokens give (m − 1)/(km − 1).

    Raises
    ------
    TypeError, ValueError
        bad x or weights (an empty batch among them), both or invalid
        radius/eps, τ <= 0."""
    if radius is not None and eps is not None:
        raise ValueError("give either radius (chordal) or eps (overlap > 1 - eps), not both; eps = radius**2 / 2")
    if eps is None:
        eps = eps_from_radius(0.1 if radius is None else radius)
    eps = check_positive(eps, "eps")
    if eps > 2.0:
        raise ValueError(f"eps must be <= 2 (overlaps are >= -1), got {eps}")
    _check(x, weights, 1.0)
    if temperature is not None:
        temperature = check_positive(temperature, "temperature")
    w = _weights(x, weights)
    gap = _half_sq_dist(x)
    if temperature is None:
        close = (gap < eps).to(x.dtype)
    else:
        close = torch.sigmoid((eps - gap) / temperature)
    return _pair_mean(w, close, one_point=1.0)


def pair_fraction_observable(*, eps: float = 1e-3):
    """The reference simulators' pair statistic as an observable ``fn(x, weights) -> (...,)`` for
    ``tp.solve(..., saveat=tp.SaveAt(observables={"pairs": fn}))``: the fraction of distinct pairs whose overlap,
    read off the Gram matrix, exceeds 1 − ε (rotf and simuformer record it at every step with
    ε = 1e-3, the default),

        Σ_{i≠j} w_i w_j 1[⟨x_i, x_j⟩ > 1 − ε] / Σ_{i≠j} w_i w_j      (1 for a one-point measure).

    The same statistic as :func:`pair_fraction` with ``eps``, except for pairs within rounding of the
    threshold: this compares the overlaps ⟨x_i, x_j⟩ (the peers' arithmetic), :func:`pair_fraction`
    the differences |x_i − x_j|²/2 (accurate for near-coincident tokens).  ε is checked here, once;
    the tokens are not (the solver hands over tokens on the sphere), so the per-step cost is one
    Gram product and one pass over it: with uniform weights the indicator is written as 0/1 in x's
    dtype (an exact count below 2²⁴ pairs in float32, else float64) over the Gram matrix, which
    ``fn`` keeps from one call to the next (one buffer per thread), and the diagonal is taken off
    by its own count, without a mask.

    Raises
    ------
    ValueError
        eps not in (0, 2]."""
    eps = check_positive(eps, "eps")
    if eps > 2.0:
        raise ValueError(f"eps must be <= 2 (overlaps are >= -1), got {eps}")
    level = 1.0 - eps

    kept = threading.local()  # the Gram matrix's buffer, reused from one call to the next (per thread)

    def fn(x, weights=None):
        n = x.shape[-2]
        if x.requires_grad and torch.is_grad_enabled():
            G = x @ x.transpose(-1, -2)
        else:  # into the kept buffer: no fresh memory per step (a run records a new state at every step)
            buf = getattr(kept, "G", None)
            shape = (*x.shape[:-1], n)
            if buf is None or buf.shape != shape or buf.dtype != x.dtype or buf.device != x.device:
                buf = kept.G = torch.empty(shape, dtype=x.dtype, device=x.device)
            G = torch.matmul(x, x.transpose(-1, -2), out=buf)
        if weights is not None:
            return _pair_mean(_weights(x, weights), (G > level).to(x.dtype), one_point=1.0)
        if n < 2:
            return torch.ones(x.shape[:-2], dtype=x.dtype, device=x.device)
        exact = x.dtype if x.dtype == torch.float64 or (x.dtype == torch.float32 and n * n < 2 ** 24) else torch.float64
        if exact == G.dtype and not G.requires_grad:  # the indicator written over the Gram matrix (no new buffer)
            close = G.gt_(level)
        else:
            close = torch.gt(G, level, out=torch.empty(G.shape, dtype=exact, device=x.device))
        count = close.sum((-1, -2)) - close.diagonal(0, -2, -1).sum(-1)
        return (count / (n * (n - 1))).to(x.dtype)

    return fn


def _pair_mean(w, f, *, one_point: float):
    """Σ_{i≠j} w_i w_j f_ij / Σ_{i≠j} w_i w_j, (...,); ``one_point`` where the denominator is 0.

    The denominator vanishes exactly when at most one token carries mass (n = 1, or all the weight
    on one token): the measure is one point, and the statistic takes its value there (pairs of
    draws from a Dirac mass coincide: pair fraction 1, overlap 1).  The masked division keeps the
    gradient finite (no 0/0 in the unselected branch)."""
    n = w.shape[-1]
    ww = w.unsqueeze(-1) * w.unsqueeze(-2)
    offdiag = 1.0 - torch.eye(n, dtype=w.dtype, device=w.device)
    num = (ww * offdiag * f).sum((-1, -2))
    den = (ww * offdiag).sum((-1, -2))
    single = den <= 0
    value = num / torch.where(single, torch.ones_like(den), den)
    return torch.where(single, torch.full_like(value, one_point), value)


def gram_rank_count(x, *, radius: Optional[float] = None, eps: Optional[float] = None, weights=None,
                    rtol: Optional[float] = None) -> torch.Tensor:
    """Number of clusters as the numerical rank of the thresholded Gram matrix, (...,) int64:

        T_ij = 1[⟨x_i, x_j⟩ > 1 − ε] 1[w_i > 0] 1[w_j > 0],
        count = #{eigenvalues λ of T : |λ| > rtol · max|λ|},   rtol = n · 2⁻⁵² by default

    (ε given or ε = r²/2, default r = 0.1).  The default tolerance is ``torch.linalg.matrix_rank``'s
    (the reference simulator rotf counts clusters as ``matrix_rank(IP > 0.9999)``, i.e. ε = 1e-4),
    applied in float64 whatever the dtype of x: T has integer entries, so the count is exact.
    Exactly separated clusters (overlap > 1 − ε within, < 1 − ε across) make T block diagonal with
    all-ones blocks of sizes m_1 … m_k, eigenvalues m_1 … m_k ≥ 1 and 0: the rank is k, as the
    single-linkage count, for clusters of any size — one token among 10⁴ counts.  (Before, the
    threshold was 10⁻³·n, which dropped every cluster of at most n/1000 tokens.)  When linking is
    not transitive the two counts differ (a chain of three tokens: single linkage 1, rank 2 or
    3), which flags clusters that are not well separated.

    Exact duplicates give equal rows of T and leave its rank unchanged, so for n > 512 each system
    is first reduced to its distinct tokens (``torch.unique``): a clustered configuration of 10⁴
    tokens costs the eigenvalues of a k×k matrix.  Otherwise ``torch.linalg.eigvalsh`` (batched)."""
    if radius is not None and eps is not None:
        raise ValueError("give either radius (chordal) or eps (overlap > 1 - eps), not both; eps = radius**2 / 2")
    if eps is None:
        eps = eps_from_radius(0.1 if radius is None else radius)
    eps = check_positive(eps, "eps")
    _check(x, weights, 1.0)
    if rtol is not None:
        rtol = check_positive(rtol, "rtol")
    n = x.shape[-2]
    if n > _DEDUPE_MIN:
        return _rank_deduplicated(x.detach(), None if weights is None else weights.detach(), eps, rtol)
    T = (_half_sq_dist(x.detach()) < eps)
    if weights is not None:
        pos = weights.detach() > 0
        T = T & pos.unsqueeze(-1) & pos.unsqueeze(-2)
    return _rank_of_linked(T, rtol)


#: gram_rank_count reduces each system to its distinct tokens above this many tokens
_DEDUPE_MIN = 512


def _rank_of_linked(T: torch.Tensor, rtol: Optional[float]) -> torch.Tensor:
    """Numerical rank of 0/1 matrices T (..., n, n), in float64: |λ| > rtol · max|λ| (default n·2⁻⁵²)."""
    n = T.shape[-1]
    ev = torch.linalg.eigvalsh(T.to(torch.float64)).abs()
    tol = (n * torch.finfo(torch.float64).eps if rtol is None else rtol) * ev.amax(-1, keepdim=True)
    return ((ev > tol) & (ev > 0)).sum(-1)


def _rank_deduplicated(x, weights, eps, rtol):
    """gram_rank_count system by system on the distinct tokens of positive weight."""
    batch = x.shape[:-2]
    xs = x.reshape(-1, *x.shape[-2:])
    ws = None if weights is None else weights.expand(*batch, x.shape[-2]).reshape(-1, x.shape[-2])
    out = torch.zeros(xs.shape[0], dtype=torch.int64, device=x.device)
    for b in range(xs.shape[0]):
        pts = xs[b] if ws is None else xs[b][ws[b] > 0]
        if pts.shape[0] == 0:
            continue
        u = torch.unique(pts, dim=0)
        out[b] = _rank_of_linked(_half_sq_dist(u) < eps, rtol)
    return out.reshape(batch)


# ---------------------------------------------------------------------------- all at once
def cluster_statistics(x, weights=None, *, radius: float = 0.1, eps: Optional[float] = None,
                       gram_rank: bool = True, count_eps: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """Every cluster statistic of this module at one scale, as a dict of (...,) tensors:

        "clusters"        single-linkage count at radius r (int64)            :func:`cluster_count`
        "gram_rank"       rank of the thresholded Gram matrix (int64)          :func:`gram_rank_count`
        "pair_fraction"   fraction of distinct ε-close pairs                   :func:`pair_fraction`
        "largest_mass"    mass of the largest cluster                          :func:`largest_cluster_mass`
        "radius"          largest geodesic spread of a cluster                 :func:`cluster_radius`
        "mean_overlap"    Σ_{i≠j} w_i w_j ⟨x_i, x_j⟩ / Σ_{i≠j} w_i w_j

    with ε = r²/2 unless ``eps`` is given (then r = √(2ε)).  A one-point measure (n = 1, or all the
    weight on one token) has one cluster of mass 1 and radius 0, pair fraction 1 and mean overlap 1
    (the values of any number of coincident tokens).  ``gram_rank=False`` skips the
    eigenvalues (the costliest part, O(n³)).  ``count_eps``: a separate threshold for the cluster
    counts ("clusters", "gram_rank", "largest_mass", "radius": overlap > 1 − count_eps), the pair
    fraction and mean overlap keeping ε (rotf: ε = 1e-3 for the pairs, count_eps = 1e-4 for the
    rank).  The signature ``(x, weights)`` is the observable
    form of ``tp.solve(..., saveat=tp.SaveAt(observables={"clusters": tp.clustering.cluster_statistics}))``;
    :func:`statistics_observables` makes one entry per statistic with other settings.
    """
    if eps is not None:
        radius = radius_from_eps(eps)
    radius = _check(x, weights, radius)
    eps = eps_from_radius(radius)
    w = _weights(x, weights)
    n = x.shape[-2]
    pairs = linked(x, radius=radius, weights=weights)
    if count_eps is None:
        count_eps, adj = eps, pairs
    else:
        count_eps = check_positive(count_eps, "count_eps")
        adj = linked(x, radius=_check(x, None, radius_from_eps(count_eps)), weights=weights)
    labels = _components(adj)
    ar = torch.arange(n, device=x.device)
    roots = labels == ar
    onehot = (labels.unsqueeze(-1) == ar).to(x.dtype)
    masses = (w.unsqueeze(-1) * onehot).sum(-2)
    out = {"clusters": (roots & (w > 0)).sum(-1), "largest_mass": masses.amax(-1)}
    if gram_rank:
        out["gram_rank"] = (_rank_of_linked(adj, None) if n <= _DEDUPE_MIN
                            else _rank_deduplicated(x.detach(), weights, count_eps, None))
    out["pair_fraction"] = _pair_mean(w, pairs.to(x.dtype), one_point=1.0)
    out["mean_overlap"] = _pair_mean(w, x @ x.transpose(-1, -2), one_point=1.0)
    out["radius"] = _spread(x, w, labels)
    return out


def statistics_observables(*, radius: float = 0.1, eps: Optional[float] = None, keys=None,
                           stacked: bool = False, count_eps: Optional[float] = None) -> Dict[str, object]:
    """Observables for ``tp.SaveAt(observables=...)`` (``tp.solve``) from :func:`cluster_statistics`.

    stacked=False: one entry per statistic in ``keys`` (default: all), each a callable(x, weights)
    returning (...,); every entry recomputes the statistics.  stacked=True: one entry
    ``"cluster_statistics"`` whose callable returns (..., k), the k statistics of ``keys`` in that order
    (cast to x's dtype), computed once per recorded time; ``traj.observables["cluster_statistics"][..., i]``
    is ``keys[i]``.  The Gram rank (eigenvalues, O(n³)) is computed only when "gram_rank" is in keys.
    ``count_eps``: the separate threshold of the cluster counts (:func:`cluster_statistics`).

    Raises
    ------
    ValueError
        unknown key, bad radius/eps."""
    if eps is not None:
        radius = radius_from_eps(eps)
    radius = check_positive(radius, "radius")
    if radius > 2.0:
        raise ValueError(f"radius is a chordal distance and must be <= 2 (the diameter of the sphere), got {radius}")
    if count_eps is not None:
        count_eps = check_positive(count_eps, "count_eps")
    allowed = ("clusters", "gram_rank", "pair_fraction", "largest_mass", "radius", "mean_overlap")
    if isinstance(keys, str):
        raise TypeError(f"keys must be a sequence of statistic names, got the string {keys!r}; write keys=[{keys!r}]")
    keys = allowed if keys is None else tuple(keys)
    if not keys:
        raise ValueError(f"keys is empty; give at least one of {', '.join(map(repr, allowed))} (or None for all)")
    bad = [k for k in keys if not isinstance(k, str) or k not in allowed]
    if bad:
        raise ValueError(f"unknown statistic {bad[0]!r}; allowed values: {', '.join(map(repr, allowed))}")
    rank = "gram_rank" in keys
    if stacked:
        def fn(x, w):
            st = cluster_statistics(x, w, radius=radius, gram_rank=rank, count_eps=count_eps)
            return torch.stack([st[k].to(x.dtype) for k in keys], -1)

        return {"cluster_statistics": fn}

    def make(key):
        return lambda x, w: cluster_statistics(x, w, radius=radius, gram_rank=(key == "gram_rank"),
                                               count_eps=count_eps)[key]

    return {k: make(k) for k in keys}


# ---------------------------------------------------------------------------- plateaus
@dataclass
class Staircase:
    """Plateaus found by :func:`detect_plateaus`, padded to the largest count P over the batch.

    start, end, level, duration: (..., P) float (NaN where there is no plateau); count (...,) int64;
    valid (..., P) bool.  Plateaus are in time order.  ``threshold`` records the slope threshold
    used (per series, (...,)); ``min_duration`` the minimum length."""

    start: torch.Tensor
    end: torch.Tensor
    level: torch.Tensor
    duration: torch.Tensor
    count: torch.Tensor
    valid: torch.Tensor
    threshold: torch.Tensor
    min_duration: float

    def as_rows(self, index=()) -> list:
        """The plateaus of one series (batch ``index``) as [{"start", "end", "level"}, ...]."""
        v = self.valid[index]
        return [{"start": float(s), "end": float(e), "level": float(lv)}
                for s, e, lv in zip(self.start[index][v], self.end[index][v], self.level[index][v])]


def _time_axis(times, values, *, strict: bool) -> torch.Tensor:
    """The times (T,) in the dtype and device of ``values`` (..., T), checked against its last axis:
    real, finite (also after the conversion to ``values``' dtype), T >= 1, and increasing —
    strictly when ``strict`` (t_{k+1} > t_k), else non-decreasing (a repeated time is allowed)."""
    check_tensor(values, "values", min_dim=1)
    if isinstance(times, torch.Tensor):
        t = times
    else:
        try:
            t = torch.as_tensor(times, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"times must be a 1-D tensor or sequence of real numbers, got {type(times).__name__} "
                            f"{str(times)[:40]}") from None
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"times must be real numbers, got dtype {t.dtype}")
    t = t.to(dtype=values.dtype, device=values.device)
    if t.dim() != 1 or t.shape[0] != values.shape[-1]:
        raise ValueError(f"times must be 1-D with one entry per value: times {tuple(t.shape)}, "
                         f"values {tuple(values.shape)} (time is the last axis of values)")
    if t.shape[0] == 0:
        raise ValueError(f"times and values hold no recorded time (T = 0): values {tuple(values.shape)}; "
                         f"give at least one record")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"times must be finite (in {values.dtype}, the dtype of values), got {t.tolist()[:8]}"
                         f"{' ...' if t.shape[0] > 8 else ''}")
    dt = t[1:] - t[:-1]
    if not bool((dt > 0).all() if strict else (dt >= 0).all()):
        k = int(torch.nonzero(~(dt > 0) if strict else ~(dt >= 0))[0])
        what = "strictly increasing" if strict else "increasing (non-decreasing)"
        raise ValueError(f"times must be {what}, but t[{k + 1}] = {float(t[k + 1])!r} follows t[{k}] = "
                         f"{float(t[k])!r}" + (f" (in {values.dtype})" if strict else "")
                         + "; sort the records by time")
    return t


def detect_plateaus(times, values, *, slope_tol: float = 0.05, min_duration: Optional[float] = None,
                    abs_slope: float = 0.0) -> Staircase:
    """Plateaus (flat steps) of a staircase-like series y(t), vectorised over leading dims.

    Thresholds.  On each recorded interval [t_k, t_{k+1}] the slope s_k = |y_{k+1} − y_k| / (t_{k+1} − t_k)
    is compared with the series' *average* slope

        s̄ = (max y − min y) / (t_end − t_0)      (per series),

    and the interval is flat when s_k <= slope_tol · s̄ + abs_slope.  A plateau is a maximal run of
    consecutive flat intervals [t_a, t_{b+1}] lasting at least ``min_duration`` (default: 2 % of the
    horizon t_end − t_0); its level is the time average of y over it (trapezoid rule).  A constant
    series is one plateau.  Integer series (cluster counts) are flat exactly where they do not
    change (any jump of 1 over one interval is steeper than slope_tol · s̄ unless the series has
    fewer than 1/slope_tol intervals per unit of range; pass abs_slope = 0).  For noisy series
    smooth first or raise slope_tol / abs_slope.

    Parameters
    ----------
    times
        (T,) strictly increasing (tensor or sequence).  values: (..., T) real.
    slope_tol : float
        relative slope threshold (>= 0).  min_duration: minimum plateau length (> 0).
    abs_slope : float
        absolute slope added to the threshold (>= 0).

    Returns
    -------
    Staircase
        :class:`Staircase` (dtype of ``values``; the times are converted to it).

    Raises
    ------
    TypeError, ValueError
        non-tensor values, T < 2, times not finite, not strictly increasing
        (in the dtype of ``values``) or of the wrong length, negative thresholds, non-finite values, a
        horizon so short that the average slope overflows.
    """
    t = _time_axis(times, values, strict=True)
    T = t.shape[0]
    if T < 2:
        raise ValueError("detect_plateaus needs at least two recorded times")
    dtv = t[1:] - t[:-1]
    slope_tol = check_positive(slope_tol, "slope_tol", allow_zero=True)
    abs_slope = check_positive(abs_slope, "abs_slope", allow_zero=True)
    span = float(t[-1] - t[0])
    if not math.isfinite(span):
        raise ValueError(f"the horizon t_end - t_0 = {t[-1].item()!r} - {t[0].item()!r} overflows {values.dtype}; "
                         f"shift or rescale the times (or pass float64 values)")
    min_duration = 0.02 * span if min_duration is None else check_positive(min_duration, "min_duration")

    y = values.detach()
    batch = y.shape[:-1]
    rng = y.amax(-1) - y.amin(-1)  # (...,)
    if not bool(torch.isfinite(rng).all()):
        raise ValueError(f"the range max y - min y of values overflows {values.dtype}; rescale the series "
                         f"(or pass float64 values)")
    mean_slope = rng / span
    if not bool(torch.isfinite(mean_slope).all()):
        raise ValueError(f"the average slope (max y - min y) / (t_end - t_0) overflows {values.dtype}: the horizon "
                         f"{span!r} is too short for the series' range; rescale the times (or the values)")
    thr = slope_tol * mean_slope + abs_slope
    s = (y[..., 1:] - y[..., :-1]).abs() / dtv
    flat = (s <= thr.unsqueeze(-1)) | (rng == 0).unsqueeze(-1)  # (..., T-1)
    prev = torch.cat([torch.zeros_like(flat[..., :1]), flat[..., :-1]], -1)
    starts = flat & ~prev
    run = torch.cumsum(starts.long(), -1) * flat.long()  # 1, 2, ... for the runs; 0 for steep intervals
    R = T  # more than the largest possible number of runs (+1 for the "0" bin)
    k = torch.arange(T - 1, device=y.device).expand_as(run)
    first = torch.full(batch + (R,), T, dtype=torch.long, device=y.device).scatter_reduce(-1, run, k, "amin")
    last = torch.full(batch + (R,), -1, dtype=torch.long, device=y.device).scatter_reduce(-1, run, k, "amax")
    area = (0.5 * (y[..., 1:] + y[..., :-1]) * dtv)
    area_sum = torch.zeros(batch + (R,), dtype=y.dtype, device=y.device).scatter_add(-1, run, area)
    length = torch.zeros(batch + (R,), dtype=y.dtype, device=y.device).scatter_add(-1, run, dtv.expand_as(area))
    exists = last >= 0
    exists[..., 0] = False  # bin 0 gathers the steep intervals
    t_start = t[first.clamp(max=T - 1)]
    t_end = t[(last + 1).clamp(min=0, max=T - 1)]
    valid = exists & ((t_end - t_start) >= min_duration * (1 - 1e-9))
    # compact the valid runs to the left, in time order (runs are numbered in time order)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    valid = torch.gather(valid, -1, order)
    P = int(valid.sum(-1).max()) if valid.numel() else 0
    pick = lambda v: torch.gather(v, -1, order)[..., :P]  # noqa: E731
    valid = valid[..., :P]
    nan = torch.tensor(float("nan"), dtype=y.dtype, device=y.device)
    start = torch.where(valid, pick(t_start), nan)
    end = torch.where(valid, pick(t_end), nan)
    level = torch.where(valid, pick(area_sum) / pick(length).clamp_min(torch.finfo(y.dtype).tiny), nan)
    return Staircase(start=start, end=end, level=level, duration=end - start, count=valid.sum(-1),
                     valid=valid, threshold=thr, min_duration=min_duration)


def crossing_time(times, values, level: float) -> torch.Tensor:
    """First time a series reaches ``level`` from below, (...,), linearly interpolated between
    the two recorded times that bracket the crossing (``inf`` when it is never reached, t_0 when
    it starts at or above the level).

    times: (T,) finite and non-decreasing (a repeated time, e.g. a left-limit record at a knot, is
    allowed), T >= 1; values: (..., T) (time last), finite.  dtype follows ``values``.

    Raises
    ------
    TypeError, ValueError
        non-tensor or non-finite values, times empty, not finite, decreasing
        or of the wrong length, a level that is not a finite real number."""
    t = _time_axis(times, values, strict=False)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level):
        raise TypeError(f"level must be a finite real number, got {level!r}")
    y = values.detach()
    above = y >= level
    reached = above.any(-1)
    k = above.to(torch.int8).argmax(-1)  # first index at or above the level
    km = (k - 1).clamp(min=0)
    y1 = torch.gather(y, -1, k.unsqueeze(-1)).squeeze(-1)
    y0 = torch.gather(y, -1, km.unsqueeze(-1)).squeeze(-1)
    t1, t0 = t[k], t[km]
    frac = ((level - y0) / (y1 - y0).clamp_min(torch.finfo(y.dtype).tiny)).clamp(0, 1)
    out = torch.where(k > 0, t0 + frac * (t1 - t0), t1)
    return torch.where(reached, out, torch.full_like(out, math.inf))


# ---------------------------------------------------------------------------- overlaps
def mean_overlap(x):
    """(γ̄, gap): the mean over pairs i ≠ j of ⟨x_i, x_j⟩ and of ‖x_i − x_j‖²/2 (= 1 − ⟨x_i, x_j⟩ for
    unit tokens, but accurate when tokens nearly coincide), each (...,)."""
    check_tensor(x, "x", min_dim=2)
    n = x.shape[-2]
    if n < 2:
        raise ValueError("mean_overlap needs at least two tokens")
    Gm = x @ x.transpose(-1, -2)
    off = Gm.sum((-1, -2)) - torch.diagonal(Gm, dim1=-2, dim2=-1).sum(-1)
    gbar = off / (n * (n - 1))
    D = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist").square() / 2
    gap = D.sum((-1, -2)) / (n * (n - 1))
    return gbar, gap
