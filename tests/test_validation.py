"""Bad input gets a clear ValueError/TypeError naming the fix, before any work is done."""

import pytest
import torch

import transformer_pde as tp
from conftest import gen


@pytest.fixture
def x():
    return tp.sphere.sample_uniform(5, 3, generator=gen(0), dtype=torch.float64)


@pytest.fixture
def heads():
    return tp.Heads.random(2, 3, generator=gen(1), dtype=torch.float64)


def test_tokens_off_the_sphere(x, heads):
    with pytest.raises(ValueError, match=r"not on the unit sphere.*normalise with x / x.norm"):
        tp.velocity(1.1 * x, heads)
    with pytest.raises(ValueError, match="x0 is not on the unit sphere"):
        tp.simulate(1.1 * x, heads, t1=1.0, dt=0.1)


def test_wrong_shapes(x, heads):
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        tp.velocity(x[0], heads)
    with pytest.raises(ValueError, match="d >= 2"):
        tp.velocity(torch.ones(4, 1, dtype=torch.float64), tp.Heads(torch.ones(1, 2, 2, dtype=torch.float64)))
    x4 = tp.sphere.sample_uniform(5, 4, generator=gen(2), dtype=torch.float64)
    with pytest.raises(ValueError, match="d = 3 but x has d = 4"):
        tp.velocity(x4, heads)
    with pytest.raises(ValueError, match=r"\(\.\.\., H, d, d\)"):
        tp.Heads(torch.ones(2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="value must have shape"):
        tp.Heads(heads.score, torch.ones(2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not broadcast"):
        xb = tp.sphere.sample_uniform(5, 3, batch_shape=(3,), generator=gen(3), dtype=torch.float64)
        tp.velocity(xb, tp.Heads.random(2, 3, batch_shape=(4,), generator=gen(4), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weights must have shape \(\.\.\., n\)"):
        tp.velocity(x, heads, torch.full((4,), 0.25, dtype=torch.float64))


def test_mixed_devices_and_dtypes(x, heads):
    with pytest.raises(TypeError, match=r"dtype torch.float64 but x has dtype torch.float32.*\.to\(x.dtype\)"):
        tp.velocity(x.float(), heads)
    with pytest.raises(TypeError, match="dtype"):
        tp.simulate(x.float(), heads, t1=1.0, dt=0.1)
    # devices: a meta tensor stands in for another device (no GPU here)
    from transformer_pde.utils.validation import check_same

    with pytest.raises(ValueError, match=r"is on meta but x is on cpu.*\.to\(x.device\)"):
        check_same(x, torch.empty(3, device="meta", dtype=torch.float64), "x", "heads")
    with pytest.raises(TypeError, match="floating dtype"):
        tp.velocity(torch.ones(5, 3, dtype=torch.int64), heads)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        tp.velocity([[1.0, 0.0]], heads)
    with pytest.raises(TypeError, match="transformer_pde.Heads"):
        tp.velocity(x, heads.score)


def test_bad_token_weights(x, heads):
    with pytest.raises(ValueError, match="negative entries"):
        tp.velocity(x, heads, torch.tensor([0.5, 0.5, 0.5, -0.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"must sum to 1.*normalise with"):
        tp.velocity(x, heads, torch.full((5,), 0.3, dtype=torch.float64))
    with pytest.raises(ValueError, match="must sum to 1"):
        tp.simulate(x, heads, t1=1.0, dt=0.1, weights=torch.full((5,), 0.3, dtype=torch.float64))


def test_bad_head_weights_and_beta(heads):
    with pytest.raises(ValueError, match="head weights must be >= 0"):
        tp.Heads(heads.score, weights=torch.tensor([1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="must not all be zero"):
        tp.Heads(heads.score, weights=torch.zeros(2, dtype=torch.float64))
    for beta in (float("inf"), -float("inf"), float("nan")):
        with pytest.raises(ValueError, match="beta must be finite"):
            tp.Heads(heads.score, beta=beta)
    with pytest.raises(ValueError, match="beta must be finite"):
        tp.Heads(heads.score, beta=torch.tensor([1.0, float("nan")], dtype=torch.float64))
    for beta in (0.0, -1.0, torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)):  # any finite real β is a head
        tp.Heads(heads.score, beta=beta)
    with pytest.raises(TypeError, match="beta must be a real number"):
        tp.Heads(heads.score, beta="1")
    with pytest.raises(ValueError, match="not symmetric"):
        tp.Heads.symmetric(torch.randn(2, 3, 3, generator=gen(5), dtype=torch.float64))


def test_non_finite_values(x, heads):
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        tp.velocity(bad, heads)
    A = heads.score.clone()
    A[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        tp.Heads(A)


def test_unknown_names(x, heads):
    with pytest.raises(ValueError, match=r"unknown normalization 'sofmax'; choose one of 'softmax'"):
        tp.velocity(x, heads, normalization="sofmax")
    with pytest.raises(ValueError, match="unknown direction 'up'"):
        tp.velocity(x, heads, direction="up")
    with pytest.raises(ValueError, match=r"unknown method 'rk5'.*'euler', 'heun', 'rk4', 'adaptive'"):
        tp.simulate(x, heads, t1=1.0, dt=0.1, method="rk5")
    with pytest.raises(ValueError, match="unknown quadrature"):
        tp.simulate(x, heads, t1=1.0, dt=0.1, quadrature="simpson")
    with pytest.raises(TypeError, match="theta must be a Heads, a Process"):
        tp.simulate(x, "heads", t1=1.0, dt=0.1)


def test_bad_time_grid(x, heads):
    with pytest.raises(ValueError, match="dt must be finite and > 0"):
        tp.simulate(x, heads, t1=1.0, dt=0.0)
    with pytest.raises(ValueError, match="not a whole number of steps; choose dt"):
        tp.simulate(x, heads, t1=1.0, dt=0.3)
    with pytest.raises(ValueError, match="t1 must be larger than t0"):
        tp.simulate(x, heads, t1=-1.0, dt=0.1)
    with pytest.raises(ValueError, match="paths must be >= 1"):
        tp.simulate(x, heads, t1=1.0, dt=0.1, paths=0)
    with pytest.raises(TypeError, match="record_every must be an int"):
        tp.simulate(x, heads, t1=1.0, dt=0.1, record_every=2.5)


def test_validation_happens_before_work(x, heads, monkeypatch):
    """No kernel runs when the input is bad."""
    import transformer_pde.solvers.particle.evaluator as evaluator

    class Ran(Exception):
        pass

    calls = []

    def fake(*a, **k):
        calls.append(1)
        raise Ran

    monkeypatch.setattr(evaluator, "evaluate", fake)
    with pytest.raises(ValueError):
        tp.simulate(x, heads, t1=1.0, dt=0.3)
    assert calls == []
    with pytest.raises(Ran):  # the patched function is the one a good run calls first
        tp.simulate(x, heads, t1=1.0, dt=0.25)
    assert calls == [1]


# ---------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("bad", [torch.float16, torch.bfloat16])
def test_half_precision_is_refused_with_a_hint(x, heads, bad):
    with pytest.raises(TypeError, match=r"x has dtype torch\.(b?float16); the kernels need float32 or float64.*x\.float\(\)"):
        tp.velocity(x.to(bad), heads)
    with pytest.raises(TypeError, match=r"score has dtype .*float16"):
        tp.Heads(heads.score.to(bad))
    with pytest.raises(TypeError, match="x0 has dtype"):
        tp.simulate(x.to(bad), heads, t1=0.2, dt=0.1)
    with pytest.raises(TypeError, match="x0 has dtype"):
        tp.jko(x.to(bad), heads, tau=0.1, steps=1)
    with pytest.raises(TypeError, match="float32 or float64"):  # integers and complex as before
        tp.velocity(x.to(torch.complex128), heads)


def test_scalar_checks():
    from transformer_pde.utils.validation import check_real, check_seed

    assert check_real(1, "t1") == 1.0 and check_real(torch.tensor(0.5), "t1") == 0.5
    for bad in ("1", True, None, [1.0], torch.ones(2)):
        with pytest.raises(TypeError, match="t1 must be a real number"):
            check_real(bad, "t1")
    with pytest.raises(ValueError, match="t1 must be finite"):
        check_real(float("inf"), "t1")
    assert check_seed(3) == 3
    for bad in (1.5, "1", True, None):
        with pytest.raises(TypeError, match=r"seed must be an int"):
            check_seed(bad)
    with pytest.raises(ValueError, match=r"seed must lie in \[0, 2\^64\)"):
        check_seed(-1)


def test_sample_path_refuses_bad_arguments_up_front(heads, monkeypatch):
    proc = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    from transformer_pde.processes.driver import WeightDriver

    monkeypatch.setattr(WeightDriver, "__init__", lambda *a, **k: pytest.fail("work started"))
    for kw, err, msg in [
        (dict(paths=0), ValueError, "paths must be >= 1"),
        (dict(paths=2.0), TypeError, "paths must be an int"),
        (dict(t1="1"), TypeError, "t1 must be a real number, got str '1'"),
        (dict(t1=float("nan")), ValueError, "t1 must be finite"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(dt=-0.1), ValueError, "dt must be finite and > 0"),
        (dict(generator=0), TypeError, "generator must be a torch.Generator"),
    ]:
        args = {"t1": 0.5, "dt": 0.1, **kw}
        with pytest.raises(err, match=msg):
            tp.sample_path(proc, **args)
    with pytest.raises(TypeError, match="process must be a transformer_pde Process"):
        tp.sample_path(heads, t1=0.5, dt=0.1)


def test_weight_path_horizon_is_named(x, heads):
    path = tp.sample_path(tp.OrnsteinUhlenbeck(heads, sigma=0.5), t1=0.5, dt=0.1)
    assert path.horizon == pytest.approx(0.5)
    path.check_covers(0.0, 0.5)
    with pytest.raises(ValueError, match=r"horizon is t = 0\.5\).*t1 = 1\)"):
        path.check_covers(0.0, 1.0)
    with pytest.raises(ValueError, match=r"horizon is t = 0\.5.*t1 = 0\.6"):
        tp.jko(x, path, tau=0.1, steps=6)


def test_jko_refuses_bad_scalars_and_untied_values(x, heads):
    ok = dict(tau=0.1, steps=1)
    with pytest.raises(TypeError, match="seed must be an int"):
        tp.jko(x, tp.OrnsteinUhlenbeck(heads, sigma=0.5), seed=1.5, **ok)
    with pytest.raises(TypeError, match="t0 must be a real number"):
        tp.jko(x, heads, t0="0", **ok)
    with pytest.raises(TypeError, match="strict must be True or False"):
        tp.jko(x, heads, strict="yes", **ok)
    untied = tp.Heads.random(2, 3, symmetric=False, generator=gen(4), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"jko is the gradient flow of the energy.*V_h ≠ A_h.*value=None"):
        tp.jko(x, untied, **ok)
    with pytest.raises(ValueError, match="V_h ≠ A_h"):
        tp.jko(x, tp.Layerwise([heads, untied]), **ok)
    # values equal to the scores are tied in all but name
    same = tp.Heads(heads.score, heads.score.clone())
    tp.jko(x, same, **ok)


def test_check_tied_all_sees_every_layer_and_template(heads):
    from transformer_pde.utils.validation import check_tied_all

    untied = tp.Heads(heads.score, heads.score + 1)
    check_tied_all(heads, "normalization='effective'")
    check_tied_all(tp.OrnsteinUhlenbeck(heads), "x")
    for bad in (untied, tp.Layerwise([heads, untied]), tp.OrnsteinUhlenbeck(untied)):
        with pytest.raises(ValueError, match="normalization='effective' is the gradient flow"):
            check_tied_all(bad, "normalization='effective'")


def test_simulate_scalar_horizon_and_untied_checks(x, heads):
    proc = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    with pytest.raises(TypeError, match="t1 must be a real number"):
        tp.simulate(x, heads, t1="1", dt=0.1)
    with pytest.raises(TypeError, match="seed must be an int"):
        tp.simulate(x, proc, t1=0.2, dt=0.1, seed=1.5)
    path = tp.sample_path(proc, t1=0.5, dt=0.1)
    with pytest.raises(ValueError, match=r"horizon is t = 0\.5\).*t1 = 1\)"):
        tp.simulate(x, path, t1=1.0, dt=0.1)
    untied = tp.Heads.random(2, 3, symmetric=False, generator=gen(4), dtype=torch.float64)
    untied = tp.Heads(untied.score_matrix, untied.score_matrix.transpose(-1, -2) + 1.0)
    for call in (lambda: tp.velocity(x, untied, normalization="effective"),
                 lambda: tp.slope(x, untied, normalization="effective"),
                 lambda: tp.simulate(x, untied, t1=0.2, dt=0.1, normalization="effective")):
        with pytest.raises(ValueError, match="V_h ≠ A_h"):
            call()
    # tied heads pass
    tp.simulate(x, heads, t1=0.2, dt=0.1, normalization="effective")


def test_energy_time_derivative_refuses_a_rate_of_the_wrong_shape_or_type():
    x = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for bad in (torch.zeros(3, 3, 3, dtype=torch.float64), torch.zeros(2, 3, 4, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"score_rate must be a tensor of shape \(\.\.\., H, d, d\)"):
            tp.energy_time_derivative(x, heads, bad)
    with pytest.raises(ValueError, match="score_rate must be a tensor"):
        tp.energy_time_derivative(x, heads, [[0.0]])
