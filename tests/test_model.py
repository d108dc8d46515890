"""transformer_pde.dynamics.model: Model validates its parts when built, and each part is what the
solve uses (weight process, normalisation object, direction, geometry, token noise, weights, causality)."""

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen


@pytest.fixture
def parts():
    x0 = tp.sphere.sample_uniform(5, 3, generator=gen(0), dtype=torch.float64)
    return x0, tp.Heads.random(2, 3, generator=gen(1), dtype=torch.float64)


def test_model_normalises_its_parts(parts):
    _, heads = parts
    m = tp.Model(heads, direction="descent")
    assert isinstance(m.process, tp.Constant) and m.process.heads0 is heads
    assert isinstance(m.normalization, tp.Softmax) and m.normalization.name == "softmax"
    assert isinstance(m.layer_norm, tp.Projected) and m.layer_norm.projected
    assert m.noise is None and m.temperature == 0.0
    ou = tp.OrnsteinUhlenbeck(heads)
    assert tp.Model(ou, direction="descent").process is ou
    assert isinstance(tp.Model(heads, "unnormalized", direction="descent").normalization, tp.Unnormalized)
    assert isinstance(tp.Model(heads, layer_norm="pre", direction="descent").layer_norm, tp.PreLN)
    noisy = tp.Model(heads, temperature=0.3, direction="descent")
    assert isinstance(noisy.noise, tp.TokenNoise) and noisy.temperature == 0.3
    assert tp.Model(heads, temperature=0.0, direction="descent").noise is None  # T = 0 is the deterministic model


@pytest.mark.parametrize("kw,err,msg", [
    (dict(theta="heads"), TypeError, "Model.theta must be a Heads"),
    (dict(normalization="sparsemax"), ValueError, "sparsemax"),
    (dict(direction="sideways"), ValueError, "Model.direction"),
    (dict(layer_norm="rms"), ValueError, "rms"),
    (dict(weights=[0.2] * 5), TypeError, "Model.weights must be a tensor"),
    (dict(causal="prefix"), TypeError, "prefix"),
    (dict(normalization="effective", causal=True), ValueError, "no causal version"),
    (dict(layer_norm="post", temperature=0.1), ValueError, "projected flow only"),
    (dict(temperature=-1.0), ValueError, "temperature"),
])
def test_model_refuses_bad_parts_when_built(parts, kw, err, msg):
    _, heads = parts
    kw = {"theta": heads, **kw}
    with pytest.raises(err, match=msg):
        tp.Model(**kw)


def test_model_is_frozen(parts):
    m = tp.Model(parts[1], direction="descent")
    with pytest.raises(Exception):
        m.direction = "ascent"


def test_each_part_of_the_model_is_what_the_solve_uses(parts):
    """Independent checks of the wiring: descent and ascent are time reversals of each other at first
    order (one Euler step is x ∓ dt·V), the token weights enter the field (a point mass on token 0 is
    the field of one token), and the normalisation object picks the field."""
    x0, heads = parts
    dt = 1e-3
    down = tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=dt, dt=dt).x[-1]
    up = tp.solve(tp.Model(heads, direction="ascent"), x0, tp.Euler(), t1=dt, dt=dt).x[-1]
    v = tp.velocity(x0, heads, normalization="softmax", direction="ascent")
    assert_close(up, tp.sphere.normalize(x0 + dt * v), rtol=0, atol=1e-14)
    assert_close(down, tp.sphere.normalize(x0 - dt * v), rtol=0, atol=1e-14)
    w = torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64)
    point = tp.solve(tp.Model(heads, weights=w, direction="ascent"), x0, tp.Euler(), t1=dt, dt=dt).x[-1]
    v1 = tp.velocity(x0, heads, w, direction="ascent")
    assert_close(point, tp.sphere.normalize(x0 + dt * v1), rtol=0, atol=1e-14)
    unn = tp.solve(tp.Model(heads, "unnormalized", direction="ascent"), x0, tp.Euler(), t1=dt, dt=dt).x[-1]
    vu = tp.velocity(x0, heads, normalization="unnormalized", direction="ascent")
    assert_close(unn, tp.sphere.normalize(x0 + dt * vu), rtol=0, atol=1e-14)
    assert float((unn - up).abs().max()) > 1e-6


def test_the_retraction_of_the_default_geometry_is_x_over_its_norm(parts):
    y = 3.0 * parts[0] + 0.1
    g = tp.Projected()
    r = g.retract(y)
    assert_close(r.norm(dim=-1), torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-15)
    assert_close(r * y.norm(dim=-1, keepdim=True), y, rtol=1e-15, atol=1e-15)
    out, err = g.retract_step(y)
    assert_close(out, r, rtol=4 * torch.finfo(torch.float64).eps, atol=1e-15)
    assert err == pytest.approx(float((y.norm(dim=-1) - 1).abs().max()))
