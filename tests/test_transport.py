"""Distances of transformer_pde.model.transport: one convention, c(x, y) = |x − y|² (or d_S²).

Closed forms on two-point and rotated measures pin the factor-2 conventions of POT
(|x − y|²) and geomloss (½|x − y|², ε = blur²); an independent log-domain Sinkhorn written
here checks the entropic values; the ε-bias bound |S_ε − W2²| ≤ ε·max(H(a), H(b)) ties the
Sinkhorn divergence to the exact W2.
"""

import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde import transport
from conftest import gen
from problems import tolerances


tol = tolerances(f64=(1e-10, 1e-12), f32=(2e-5, 2e-6))


def rand_sphere(n, d, seed, dtype=torch.float64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=torch.float64).to(dtype)


def rotation(angle, axis, dtype=torch.float64):
    """Rotation of R^3 by `angle` about the unit `axis` (Rodrigues), independent of the library."""
    k = torch.as_tensor(axis, dtype=torch.float64)
    k = k / k.norm()
    K = torch.tensor([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]], dtype=torch.float64)
    R = torch.eye(3, dtype=torch.float64) + math.sin(angle) * K + (1 - math.cos(angle)) * K @ K
    return R.to(dtype)


def entropy(w):
    return float(-(w * torch.log(w)).sum())


def log_sinkhorn_ot(x, a, y, b, eps, iters=4000):
    """Independent oracle: OT_ε = min ⟨π, |x−y|²⟩ + ε KL(π | a⊗b) by plain log-domain Sinkhorn
    (float64); at convergence the value is ⟨a, f⟩ + ⟨b, g⟩."""
    C = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    for _ in range(iters):
        f = -eps * torch.logsumexp(torch.log(b)[None, :] + (g[None, :] - C) / eps, 1)
        g = -eps * torch.logsumexp(torch.log(a)[:, None] + (f[:, None] - C) / eps, 0)
    return float((a * f).sum() + (b * g).sum())


# ---------------------------------------------------------------------------- two-point measures
@pytest.mark.parametrize("d", [2, 3])
def test_dirac_pair_closed_form(dtype, d):
    """μ = δ_x, ν = δ_y: W2² = S_ε = |x − y|² (one coupling, KL = 0), geodesic d_S² = arccos⟨x,y⟩²."""
    x, y = rand_sphere(1, d, 1, dtype), rand_sphere(1, d, 2, dtype)
    c2 = float(((x - y) ** 2).sum())
    ang = math.acos(max(-1.0, min(1.0, float((x.double() * y.double()).sum()))))
    t = tol(dtype)
    exp = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    torch.testing.assert_close(tp.distance(x, y, "w2", squared=True), exp(c2), **t)
    torch.testing.assert_close(tp.distance(x, y, "w2"), exp(math.sqrt(c2)), **t)
    torch.testing.assert_close(tp.distance(x, y, "w2", squared=True, metric="geodesic"), exp(ang ** 2), **t)
    # geomloss' ½|x−y|² and ε = blur²: a missing factor 2 would give c2/2
    for eps in (1e-1, 1e-3):
        torch.testing.assert_close(tp.distance(x, y, "sinkhorn", squared=True, eps=eps), exp(c2),
                                   rtol=1e-6 if dtype == torch.float64 else 1e-4, atol=1e-7)
    torch.testing.assert_close(tp.distance(x, y, "sinkhorn", squared=True, metric="geodesic", eps=1e-2),
                               exp(ang ** 2), rtol=1e-6 if dtype == torch.float64 else 1e-4, atol=1e-7)
    if d == 2:  # on S¹ every projection is an isometry: the sliced distance is the angle
        torch.testing.assert_close(tp.distance(x, y, "sliced"), exp(ang), rtol=1e-5, atol=1e-6)


def test_two_point_measures_closed_form():
    """μ = ½δ_{x1} + ½δ_{x2}, ν = ½δ_{y1} + ½δ_{y2}: W2² = ½ min over the two matchings."""
    x, y = rand_sphere(2, 3, 3), rand_sphere(2, 3, 4)
    c = lambda p, q: float(((p - q) ** 2).sum())  # noqa: E731
    w2 = 0.5 * min(c(x[0], y[0]) + c(x[1], y[1]), c(x[0], y[1]) + c(x[1], y[0]))
    torch.testing.assert_close(tp.distance(x, y, squared=True), torch.tensor(w2, dtype=torch.float64))
    # ε-bias bound for the debiased divergence (H = log 2 for both)
    for eps in (1e-1, 1e-2):
        s = float(tp.distance(x, y, "sinkhorn", squared=True, eps=eps, scaling=0.99))
        assert abs(s - w2) <= eps * math.log(2) * 1.01, (eps, s, w2)


def test_weighted_measure_against_a_dirac():
    """μ = a δ_{x1} + (1−a) δ_{x2}, ν = δ_y: the only plan sends everything to y, so
    W2² = a|x1−y|² + (1−a)|x2−y|²; S_ε = W2² − ½ OT_ε(μ, μ) lies in [W2² − ½εH(a), W2²]."""
    x, y = rand_sphere(2, 3, 5), rand_sphere(1, 3, 6)
    a = torch.tensor([0.3, 0.7], dtype=torch.float64)
    w2 = float(a[0] * ((x[0] - y[0]) ** 2).sum() + a[1] * ((x[1] - y[0]) ** 2).sum())
    torch.testing.assert_close(tp.distance((x, a), y, squared=True), torch.tensor(w2, dtype=torch.float64))
    eps = 0.2
    s = float(tp.distance((x, a), y, "sinkhorn", squared=True, eps=eps, scaling=0.99))
    assert w2 - 0.5 * eps * entropy(a) - 1e-6 <= s <= w2 + 1e-6


# ---------------------------------------------------------------------------- rotated measures
@pytest.mark.parametrize("metric", ["chordal", "geodesic"])
def test_rotated_circle_grid_closed_form(dtype, metric):
    """The uniform m-grid on S¹ and its rotation by α < π/m: the optimal plan is the rotation
    (each point to its image), so W2² = 4 sin²(α/2) (chordal) or α² (geodesic); sliced = α."""
    m, alpha = 12, 0.17
    x = tp.sphere.circle_grid(m, dtype=dtype)
    R = torch.tensor([[math.cos(alpha), -math.sin(alpha)], [math.sin(alpha), math.cos(alpha)]], dtype=dtype)
    y = x @ R.T
    exact = 4 * math.sin(alpha / 2) ** 2 if metric == "chordal" else alpha ** 2
    t = tol(dtype)
    torch.testing.assert_close(tp.distance(x, y, squared=True, metric=metric), torch.tensor(exact, dtype=dtype), **t)
    # entropic bias is exponentially small here: grid spacing² / ε = 0.27 / 1e-3
    torch.testing.assert_close(tp.distance(x, y, "sinkhorn", squared=True, metric=metric, eps=1e-3),
                               torch.tensor(exact, dtype=dtype), rtol=1e-6 if dtype == torch.float64 else 1e-4, atol=1e-8)
    torch.testing.assert_close(tp.distance(x, y, "sliced"), torch.tensor(alpha, dtype=dtype), rtol=1e-5, atol=1e-6)


def test_rotation_invariance_on_s2():
    """d(Rμ, Rν) = d(μ, ν) for a rotation R, for W2 and S_ε (random weighted measures)."""
    x, y = rand_sphere(7, 3, 7), rand_sphere(9, 3, 8)
    a = torch.rand(7, generator=gen(9), dtype=torch.float64) + 0.1
    a = a / a.sum()
    R = rotation(0.9, [1.0, -2.0, 0.5])
    for kind, kw in (("w2", {}), ("sinkhorn", dict(eps=1e-2))):
        d0 = tp.distance((x, a), y, kind, squared=True, **kw)
        d1 = tp.distance((x @ R.T, a), y @ R.T, kind, squared=True, **kw)
        torch.testing.assert_close(d1, d0, rtol=1e-9, atol=1e-12)


def test_rotated_measure_small_angle_on_s2():
    """A measure and its rotation by a small angle θ about an axis k: for θ → 0 the optimal plan is
    the rotation itself, so W2² = Σ a_i |x_i − R x_i|² = Σ a_i 4 sin²(θ/2) (1 − ⟨x_i, k⟩²)."""
    x = rand_sphere(6, 3, 10)
    k = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64)
    k = k / k.norm()
    theta = 1e-2
    y = x @ rotation(theta, k).T
    exact = float((4 * math.sin(theta / 2) ** 2 * (1 - (x @ k) ** 2)).mean())
    torch.testing.assert_close(tp.distance(x, y, squared=True), torch.tensor(exact, dtype=torch.float64))


# ---------------------------------------------------------------------------- POT vs geomloss vs oracle
def test_sinkhorn_matches_independent_log_sinkhorn():
    """S_ε (geomloss, ×2, blur = (ε/2)^½) equals OT_ε(μ,ν) − ½OT_ε(μ,μ) − ½OT_ε(ν,ν) computed
    here by plain log-domain Sinkhorn with the cost |x − y|² and the same ε."""
    x, y = rand_sphere(8, 3, 11), rand_sphere(10, 3, 12)
    a = torch.full((8,), 1 / 8, dtype=torch.float64)
    b = torch.full((10,), 1 / 10, dtype=torch.float64)
    eps = 0.3
    oracle = (log_sinkhorn_ot(x, a, y, b, eps) - 0.5 * log_sinkhorn_ot(x, a, x, a, eps)
              - 0.5 * log_sinkhorn_ot(y, b, y, b, eps))
    ours = float(tp.distance(x, y, "sinkhorn", squared=True, eps=eps, scaling=0.999))
    assert abs(ours - oracle) <= 1e-3 * abs(oracle), (ours, oracle)
    # the un-doubled geomloss value would be off by a factor 2
    assert abs(ours / 2 - oracle) > 0.3 * abs(oracle)


@pytest.mark.parametrize("eps", [5e-2, 1e-2])
def test_sinkhorn_within_eps_bias_of_exact_w2(eps):
    """|S_ε − W2²| ≤ ε·max(H(a), H(b)) (module docstring), and S_ε → W2² as ε → 0."""
    x, y = rand_sphere(12, 3, 13), rand_sphere(15, 3, 14)
    a = torch.rand(12, generator=gen(15), dtype=torch.float64) + 0.2
    a = a / a.sum()
    b = torch.full((15,), 1 / 15, dtype=torch.float64)
    w2 = float(tp.distance((x, a), (y, b), squared=True))
    s = float(tp.distance((x, a), (y, b), "sinkhorn", squared=True, eps=eps, scaling=0.99))
    bound = eps * max(entropy(a), entropy(b))
    assert abs(s - w2) <= bound, (s, w2, bound)


def test_sliced_on_circle_equals_geodesic_w2():
    """On S¹ the spherical sliced Wasserstein (×2π) is the exact geodesic W2 (POT emd, d_S² cost)."""
    x, y = rand_sphere(9, 2, 16), rand_sphere(7, 2, 17)
    a = torch.rand(9, generator=gen(18), dtype=torch.float64) + 0.1
    a = a / a.sum()
    exact = tp.distance((x, a), y, "w2", metric="geodesic")
    torch.testing.assert_close(tp.distance((x, a), y, "sliced", n_projections=20), exact, rtol=1e-5, atol=1e-6)


def test_sliced_is_deterministic_and_leaves_global_rng_alone():
    x, y = rand_sphere(9, 3, 19), rand_sphere(9, 3, 20)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    d1 = tp.distance(x, y, "sliced", seed=4)
    after = torch.rand(3)
    torch.testing.assert_close(before, after)
    torch.testing.assert_close(tp.distance(x, y, "sliced", seed=4), d1)
    assert 0 < float(d1) <= float(tp.distance(x, y, metric="geodesic")) + 1e-9  # slicing contracts


# ---------------------------------------------------------------------------- plans, gradients, batches
def test_w2_gradient_is_the_envelope_formula():
    """∂W2²/∂x_i = Σ_j π_ij 2(x_i − y_j) at the optimal plan (autograd vs formula)."""
    x, y = rand_sphere(5, 3, 21), rand_sphere(6, 3, 22)
    P = tp.transport_plan(x, y)
    torch.testing.assert_close(P.sum(-1), torch.full((5,), 0.2, dtype=torch.float64))
    torch.testing.assert_close(P.sum(-2), torch.full((6,), 1 / 6, dtype=torch.float64))
    xv = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(tp.distance(xv, y, squared=True), xv)
    expected = 2 * (P.sum(-1, keepdim=True) * x - P @ y)
    torch.testing.assert_close(g, expected)


def test_batched_equals_loop(dtype):
    x = rand_sphere(2 * 3 * 6, 3, 23, dtype).reshape(2, 3, 6, 3)
    y = rand_sphere(5, 3, 24, dtype)  # broadcast against the batch
    for kind, kw in (("w2", {}), ("sinkhorn", dict(eps=1e-2)), ("sliced", dict(n_projections=10))):
        batched = tp.distance(x, y, kind, **kw)
        assert batched.shape == (2, 3) and batched.dtype == dtype
        loop = torch.stack([torch.stack([tp.distance(x[i, j], y, kind, **kw) for j in range(3)]) for i in range(2)])
        torch.testing.assert_close(batched, loop, rtol=1e-8 if dtype == torch.float64 else 1e-5, atol=1e-9)


def test_float32_agrees_with_float64():
    x, y = rand_sphere(10, 3, 25), rand_sphere(11, 3, 26)
    for kind, kw in (("w2", {}), ("sinkhorn", dict(eps=1e-2)), ("sliced", {})):
        d64 = tp.distance(x, y, kind, **kw)
        d32 = tp.distance(x.float(), y.float(), kind, **kw)
        assert d32.dtype == torch.float32
        torch.testing.assert_close(d32.double(), d64, rtol=1e-4, atol=1e-5)


def test_geodesic_cost_gradient_is_finite_at_coincident_points():
    x = rand_sphere(3, 3, 27).requires_grad_(True)
    c = transport.cost_matrix(x, x.detach(), metric="geodesic")
    (g,) = torch.autograd.grad(c.sum(), x)
    assert bool(torch.isfinite(g).all())


# ---------------------------------------------------------------------------- errors
def test_bad_input_raises_clear_errors():
    x, y = rand_sphere(4, 3, 28), rand_sphere(5, 3, 29)
    with pytest.raises(ValueError, match="unknown kind"):
        tp.distance(x, y, "w1")
    with pytest.raises(ValueError, match="unknown metric"):
        tp.distance(x, y, metric="euclid")
    with pytest.raises(ValueError, match="unknown backend"):
        tp.distance(x, y, "sinkhorn", backend="gpu")
    with pytest.raises(ValueError, match="eps must be finite and > 0"):
        tp.distance(x, y, "sinkhorn", eps=0.0)
    with pytest.raises(ValueError, match=r"scaling must lie in \(0, 1\)"):
        tp.distance(x, y, "sinkhorn", scaling=1.0)
    with pytest.raises(ValueError, match="not on the unit sphere"):
        tp.distance(2 * x, y)
    with pytest.raises(ValueError, match="same d"):
        tp.distance(x, rand_sphere(5, 2, 30))
    with pytest.raises(ValueError, match="must sum to 1"):
        tp.distance((x, torch.full((4,), 0.3, dtype=torch.float64)), y)
    with pytest.raises(ValueError, match="negative"):
        tp.distance((x, torch.tensor([0.5, 0.6, -0.2, 0.1], dtype=torch.float64)), y)
    with pytest.raises(TypeError, match="dtype"):
        tp.distance(x, y.float())
    with pytest.raises(ValueError, match="pair"):
        tp.distance((x, None, None), y)
    with pytest.raises(ValueError, match="do not broadcast"):
        tp.distance(rand_sphere(8, 3, 31).reshape(2, 4, 3), rand_sphere(15, 3, 32).reshape(3, 5, 3))
    with pytest.raises(TypeError, match="squared"):
        tp.distance(x, y, squared="yes")
    with pytest.raises(ValueError, match="tensorized"):
        tp.distance(x, y, "sinkhorn", metric="geodesic", backend="online")



@pytest.mark.parametrize("kind", transport.KINDS)
def test_empty_batches_and_empty_measures_are_refused(kind):
    """An empty batch or measure is refused with a ValueError, not torch's "max(): Expected reduction
    dim" from the sphere check."""
    x, y = rand_sphere(4, 3, 35), rand_sphere(5, 3, 36)
    empty_batch = torch.zeros(0, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mu tokens holds no token sets \(an empty batch\)"):
        tp.distance(empty_batch, y, kind)
    with pytest.raises(ValueError, match=r"nu tokens holds no token sets \(an empty batch\)"):
        tp.distance(x, torch.zeros(2, 0, 5, 3, dtype=torch.float64), kind)
    with pytest.raises(ValueError, match="no tokens"):
        tp.distance(torch.zeros(2, 0, 3, dtype=torch.float64), y, kind)
    with pytest.raises(ValueError, match="no tokens"):
        tp.distance(x, torch.zeros(0, 3, dtype=torch.float64), kind)
    with pytest.raises(ValueError, match="mu weights has an empty batch"):  # weights that broadcast to no batch
        tp.distance((x, torch.zeros(0, 4, dtype=torch.float64)), y, kind)
    with pytest.raises(ValueError, match="empty batch"):
        tp.transport_plan(empty_batch, y)


def test_sliced_seed_is_checked():
    x, y = rand_sphere(4, 3, 37), rand_sphere(5, 3, 38)
    for bad, exc in ((1.5, TypeError), ("1", TypeError), (-1, ValueError), (2 ** 70, ValueError), (True, TypeError)):
        with pytest.raises(exc, match="seed"):
            tp.distance(x, y, "sliced", seed=bad)
    tp.distance(x, y, "w2", seed=1.5)  # the seed is that of the projections only: ignored by w2

@pytest.mark.skipif(transport.keops_available(), reason="pykeops is installed")
def test_keops_backend_without_pykeops_says_how_to_fix():
    x, y = rand_sphere(4, 3, 33), rand_sphere(5, 3, 34)
    for be in ("online", "keops"):
        with pytest.raises(ValueError, match="pip install pykeops"):
            tp.distance(x, y, "sinkhorn", backend=be)


def test_device_follows_input():
    x, y = rand_sphere(4, 3, 35), rand_sphere(5, 3, 36)
    for kind in transport.KINDS:
        assert tp.distance(x, y, kind).device == x.device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors():
    x, y = rand_sphere(20, 3, 37).cuda(), rand_sphere(25, 3, 38).cuda()
    for kind, kw in (("w2", {}), ("sinkhorn", dict(eps=1e-2)), ("sliced", {})):
        d = tp.distance(x, y, kind, **kw)
        assert d.device.type == "cuda"
        torch.testing.assert_close(d.cpu(), tp.distance(x.cpu(), y.cpu(), kind, **kw), rtol=1e-6, atol=1e-8)


# ==================================================================================================
# What the Sinkhorn divergence hands to geomloss (the backend for a user cost, the diameter of the geodesic
# cost), observed by a spy on geomloss.SamplesLoss.
# The tests below kill mutants of the formula modules that the tests above let survive
# (docs/MUTATION_REPORT.md); each checks the library against a closed form or an independent computation.
from torch.testing import assert_close  # noqa: E402


def _spy_samples_loss(monkeypatch, key):
    """Record kw[key] of every geomloss.SamplesLoss built from now on (the real object is returned)."""
    import geomloss
    seen, real = [], geomloss.SamplesLoss

    def spy(*args, **kw):
        seen.append(kw.get(key))
        return real(*args, **kw)

    monkeypatch.setattr(geomloss, "SamplesLoss", spy)
    return seen


def test_a_user_cost_is_handed_to_geomloss_with_the_tensorized_backend(monkeypatch):
    """A callable cost only works with geomloss' tensorized backend: its "auto" switches to the online
    (KeOps formula) one above 5000² point pairs, where a Python callable fails.  So the request must name
    "tensorized" explicitly; the value is unchanged (checked against the unpatched call)."""
    from transformer_pde import transport
    g = gen(91)
    x = tp.sphere.sample_uniform(6, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    y = tp.sphere.sample_uniform(5, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    a, b = torch.full((1, 6), 1 / 6, dtype=torch.float64), torch.full((1, 5), 1 / 5, dtype=torch.float64)
    cost = lambda X, Y: 0.5 * torch.cdist(X, Y).square()  # noqa: E731
    ref = transport.sinkhorn_divergence(x, a, y, b, eps=0.1, cost=cost, diameter=2.0)
    seen = _spy_samples_loss(monkeypatch, "backend")
    val = transport.sinkhorn_divergence(x, a, y, b, eps=0.1, cost=cost, diameter=2.0)
    assert seen == ["tensorized"]
    eps = torch.finfo(torch.float64).eps  # the same call twice: a few ulps of the value
    assert_close(val, ref, rtol=4 * eps, atol=4 * eps * float(ref.abs().max()))


@pytest.mark.parametrize("diameter", [None, 2.5])
def test_geodesic_sinkhorn_hands_geomloss_the_diameter(monkeypatch, diameter):
    """The geodesic cost's diameter for geomloss' ε-scaling: π (the sphere's) by default, the given one
    otherwise."""
    from transformer_pde import transport
    g = gen(98)
    x = tp.sphere.sample_uniform(6, 3, batch_shape=(1,), generator=g, dtype=torch.float64)
    a = torch.full((1, 6), 1 / 6, dtype=torch.float64)
    seen = _spy_samples_loss(monkeypatch, "diameter")
    transport.sinkhorn_divergence(x, a, x.flip(-2), a, eps=0.1, metric="geodesic", diameter=diameter)
    assert seen == [math.pi if diameter is None else diameter]
