
import pytest
import torch
from torch.testing import assert_close

from transformer_pde import sphere
from conftest import gen


def test_projection_and_retraction(dtype):
    x = sphere.sample_uniform(50, 4, generator=gen(1), dtype=dtype)
    v = torch.randn(50, 4, generator=gen(2), dtype=dtype)
    pv = sphere.tangent_projection(x, v)
    assert_close((pv * x).sum(-1), torch.zeros(50, dtype=dtype), atol=1e-6 if dtype == torch.float32 else 1e-14, rtol=0)
    assert_close(sphere.tangent_projection(x, pv), pv)  # idempotent
    r = sphere.retract(x, 0.3 * pv)
    assert_close(r.norm(dim=-1), torch.ones(50, dtype=dtype))


def test_exp_log_inverse_and_distance():
    x = sphere.sample_uniform(40, 3, generator=gen(3), dtype=torch.float64)
    y = sphere.sample_uniform(40, 3, generator=gen(4), dtype=torch.float64)
    v = sphere.log_map(x, y)
    assert_close((v * x).sum(-1), torch.zeros(40, dtype=torch.float64), atol=1e-12, rtol=0)
    assert_close(v.norm(dim=-1), sphere.geodesic_distance(x, y))
    assert_close(sphere.exp_map(x, v), y, atol=1e-10, rtol=0)
    # geodesic distance against arccos, chordal against the law of cosines
    c = (x * y).sum(-1)
    assert_close(sphere.geodesic_distance(x, y), torch.arccos(c), atol=1e-7, rtol=0)
    assert_close(sphere.chordal_distance(x, y) ** 2, 2 - 2 * c)
    # exp of zero is the identity
    assert_close(sphere.exp_map(x, torch.zeros_like(x)), x)


def test_equiangular_configurations():
    for n, g in [(4, 0.3), (5, -0.2), (3, -0.5), (6, 0.9)]:
        x = sphere.equiangular(n, g, dtype=torch.float64)
        G = x @ x.T
        expect = torch.full((n, n), g, dtype=torch.float64)
        expect.fill_diagonal_(1.0)
        assert_close(G, expect, atol=1e-12, rtol=0)
    # regular simplex fits in n-1 dims
    assert sphere.equiangular(4, -1 / 3).shape[-1] == 3
    with pytest.raises(ValueError, match="gamma must lie"):
        sphere.equiangular(4, -0.5)
    with pytest.raises(ValueError, match="pass d >="):
        sphere.equiangular(5, 0.2, d=3)


def test_octahedral_matches_reference_draws():
    # the reference draws: rng.choice(6, n) then rng.normal(0, noise, (n, 3)), vertices ±e_k in that order
    import numpy as np

    rng = np.random.default_rng(42)
    verts = np.array([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]], float)
    pts = verts[rng.choice(6, 200)] + rng.normal(0, 0.05, (200, 3))
    pts /= np.linalg.norm(pts, axis=1, keepdims=True)
    x = sphere.octahedral(200, seed=42, dtype=torch.float64)
    assert_close(x, torch.as_tensor(pts))
    assert_close(x.norm(dim=-1), torch.ones(200, dtype=torch.float64))


def test_grids_are_on_the_sphere_and_spread():
    for pts in (sphere.circle_grid(12), sphere.fibonacci_sphere(100), sphere.icosphere(2)):
        pts = pts.double()
        assert_close(pts.norm(dim=-1), torch.ones(len(pts), dtype=torch.float64), atol=1e-6, rtol=0)
        # quasi-uniform: the mean is near 0
        assert pts.mean(0).norm() < 0.05
    assert len(sphere.icosphere(1)) == 42
    ico = sphere.icosphere(1, dtype=torch.float64)
    d = torch.cdist(ico, ico) + 10 * torch.eye(42, dtype=torch.float64)
    nn = d.min(1).values
    assert nn.max() / nn.min() < 1.3  # nearly uniform spacing


def test_uniform_sampler_moments():
    x = sphere.sample_uniform(20000, 3, generator=gen(5), dtype=torch.float64)
    assert_close(x.mean(0), torch.zeros(3, dtype=torch.float64), atol=0.03, rtol=0)
    assert_close(x.T @ x / 20000, torch.eye(3, dtype=torch.float64) / 3, atol=0.02, rtol=0)
