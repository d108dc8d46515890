"""The Sinkhorn divergence with the geodesic cost against a log-domain Sinkhorn written in
tests/problems.py (same cost, same ε, non-uniform weights)."""

import torch

import transformer_pde as tp
from conftest import gen
from problems import log_sinkhorn_ot


def test_geodesic_sinkhorn_divergence_against_log_domain_sinkhorn():
    """S_ε with the geodesic cost c = d_S² = arccos(⟨x, y⟩)² equals
    OT_ε(μ,ν) − ½OT_ε(μ,μ) − ½OT_ε(ν,ν), OT_ε = min ⟨π, c⟩ + ε KL(π | a⊗b), by the plain
    log-domain Sinkhorn of problems.py (same c, same ε), with non-uniform weights."""
    x = tp.sphere.sample_uniform(8, 3, generator=gen(21), dtype=torch.float64)
    y = tp.sphere.sample_uniform(9, 3, generator=gen(22), dtype=torch.float64)
    a = torch.rand(8, generator=gen(23), dtype=torch.float64) + 0.3
    a = a / a.sum()
    b = torch.full((9,), 1 / 9, dtype=torch.float64)
    dS2 = lambda p, q: torch.arccos((p @ q.T).clamp(-1, 1)).square()  # noqa: E731
    eps = 0.4
    oracle = (log_sinkhorn_ot(dS2(x, y), a, b, eps) - 0.5 * log_sinkhorn_ot(dS2(x, x), a, a, eps)
              - 0.5 * log_sinkhorn_ot(dS2(y, y), b, b, eps))
    ours = float(tp.distance((x, a), (y, b), "sinkhorn", squared=True, eps=eps, metric="geodesic", scaling=0.999))
    assert abs(ours - oracle) <= 1e-3 * abs(oracle), (ours, oracle)
    # the oracle tells ε from 2ε (the factor-2 slip of the geomloss convention, blur² = ε/2)
    for other in (2 * eps,):
        alt = (log_sinkhorn_ot(dS2(x, y), a, b, other) - 0.5 * log_sinkhorn_ot(dS2(x, x), a, a, other)
               - 0.5 * log_sinkhorn_ot(dS2(y, y), b, b, other))
        assert abs(alt - oracle) > 20 * 1e-3 * abs(oracle), (alt, oracle)
