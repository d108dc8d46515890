"""Hostile input to the solver entry points: no silent wrong result, no raw traceback, no
allocation before the checks.

Each test names a hostile input and what the entry point must do with it.
"""

import math
import os

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import Interrupted, stop_at_step, tokens_and_heads
from transformer_pde import processes
from transformer_pde.solvers import parts
from transformer_pde.solvers.particle import methods as particle

F64 = torch.float64


def _problem(dtype=F64, n=5):
    return tokens_and_heads(dtype, n=n, seed=10)


def _checkpointed(tmp_path, x0, theta, stop=5, **kw):
    """A checkpoint of the run interrupted after step ``stop`` (written at step 3)."""
    ck = tmp_path / "run.ckpt"
    with pytest.raises(Interrupted):
        tp.simulate(x0, theta, checkpoint=ck, checkpoint_every=3, callback=stop_at_step(stop), **kw, direction="descent")
    assert ck.is_file()
    return ck


def _drift_minus(t, A):
    return -A


def _drift_plus(t, A):
    return 0.5 * A


def _scaled_drift(k):
    return lambda t, A: -k * A


# ---------------------------------------------------------------------------- checkpoint fingerprint
def test_checkpoint_of_another_custom_drift_is_refused_naming_it(tmp_path):
    """Before: a checkpoint made with one Custom drift resumed a run with another (0.73 off the true run)."""
    x0, h = _problem()
    kw = dict(t1=0.5, dt=0.05)
    ck = _checkpointed(tmp_path, x0, tp.Custom(h, _drift_minus), **kw)
    with pytest.raises(ValueError, match=r"different run.*theta\.drift"):
        tp.simulate(x0, tp.Custom(h, _drift_plus), checkpoint=ck, **kw, direction="descent")
    # the same drift resumes, and the resumed run is the uninterrupted one
    full = tp.simulate(x0, tp.Custom(h, _drift_minus), **kw, direction="descent")
    resumed = tp.simulate(x0, tp.Custom(h, _drift_minus), checkpoint=ck, **kw, direction="descent")
    assert_close(resumed.x, full.x, rtol=1e-12, atol=1e-14)


def test_checkpoint_sees_the_values_a_drift_closes_over(tmp_path):
    """Same source, same qualified name, other captured constant: another drift."""
    x0, h = _problem()
    kw = dict(t1=0.5, dt=0.05)
    ck = _checkpointed(tmp_path, x0, tp.Custom(h, _scaled_drift(1.0)), **kw)
    with pytest.raises(ValueError, match=r"theta\.drift"):
        tp.simulate(x0, tp.Custom(h, _scaled_drift(2.0)), checkpoint=ck, **kw, direction="descent")
    tp.simulate(x0, tp.Custom(h, _scaled_drift(1.0)), checkpoint=ck, **kw, direction="descent")  # resumes


def test_a_drift_without_source_needs_a_tag_to_be_checkpointed(tmp_path):
    x0, h = _problem()
    ns = {}
    exec("def drift(t, A):\n    return -A\n", ns)  # no file: inspect.getsource cannot read it
    with pytest.raises(ValueError, match="no readable source.*tag"):
        tp.simulate(x0, tp.Custom(h, ns["drift"]), t1=0.5, dt=0.05, checkpoint=tmp_path / "a.ckpt", direction="descent")
    assert not (tmp_path / "a.ckpt").exists()
    tp.simulate(x0, tp.Custom(h, ns["drift"]), t1=0.5, dt=0.05, direction="descent")  # without a checkpoint nothing needs it
    ck = _checkpointed(tmp_path, x0, tp.Custom(h, ns["drift"], tag="decay-v1"), t1=0.5, dt=0.05)
    with pytest.raises(ValueError, match=r"theta\.tag"):
        tp.simulate(x0, tp.Custom(h, ns["drift"], tag="decay-v2"), t1=0.5, dt=0.05, checkpoint=ck, direction="descent")
    with pytest.raises(TypeError, match="tag"):
        tp.Custom(h, ns["drift"], tag=3)


def test_checkpoint_of_another_generator_state_is_refused(tmp_path):
    """Before: a run with generator= seeded 6 resumed the checkpoint of one seeded 5 (0.55 off)."""
    x0, h = _problem()
    theta = tp.OrnsteinUhlenbeck(h)
    kw = dict(t1=0.5, dt=0.05, paths=2)
    ck = _checkpointed(tmp_path, x0, theta, generator=gen(5), **kw)
    with pytest.raises(ValueError, match="generator"):
        tp.simulate(x0, theta, checkpoint=ck, generator=gen(6), **kw, direction="descent")
    full = tp.simulate(x0, theta, generator=gen(5), **kw, direction="descent")
    resumed = tp.simulate(x0, theta, checkpoint=ck, generator=gen(5), **kw, direction="descent")
    assert_close(resumed.x, full.x, rtol=1e-12, atol=1e-14)


def test_checkpoint_of_another_dtype_or_observable_is_refused(tmp_path):
    x0, h = _problem()
    kw = dict(t1=0.5, dt=0.05)
    ck = _checkpointed(tmp_path, x0, h, **kw)
    with pytest.raises(ValueError, match=r"x0 \(values, shape, dtype\)"):
        tp.simulate(x0.float(), h.to(torch.float32), checkpoint=ck, **kw, direction="descent")
    (tmp_path / "b").mkdir()
    ck2 = _checkpointed(tmp_path / "b", x0, h, observables={"m": lambda x, w: x.mean(-2)}, **kw)
    with pytest.raises(ValueError, match=r"observables\['m'\]"):
        tp.simulate(x0, h, checkpoint=ck2, observables={"m": lambda x, w: x.sum(-2)}, **kw, direction="descent")


def test_ordinary_checkpoints_keep_their_old_fingerprint(tmp_path):
    """The fingerprint of an ordinary run is the hash of the same values as before the labels (so a
    checkpoint written by the earlier code still resumes)."""
    x0, h = _problem()
    ck = _checkpointed(tmp_path, x0, h, t1=0.5, dt=0.05)
    old = parts._fingerprint(x0, *parts.process_signature(processes.weights.Constant(h)), 0.0, 0.5, 0.05, "euler", "softmax",
                             "descent", None, 0, 1, "left", True, None)
    assert torch.load(ck, weights_only=False)["fingerprint"] == old


def test_non_finite_checkpoint_is_refused(tmp_path):
    x0, h = _problem()
    ck = _checkpointed(tmp_path, x0, h, t1=0.5, dt=0.05)
    state = torch.load(ck, weights_only=False)
    state["x"] = state["x"].clone()
    state["x"][0, 0] = float("nan")
    torch.save(state, ck)
    with pytest.raises(ValueError, match="NaN or inf"):
        tp.simulate(x0, h, t1=0.5, dt=0.05, checkpoint=ck, direction="descent")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_checkpoint_never_writes_through_a_planted_temp_link(tmp_path):
    """Before: the checkpoint was saved to <path>.tmp, following a symlink planted there."""
    x0, h = _problem()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    ck = tmp_path / "run.ckpt"
    os.symlink(victim, tmp_path / "run.ckpt.tmp")
    with pytest.raises(Interrupted):
        tp.simulate(x0, h, t1=0.5, dt=0.05, checkpoint=ck, checkpoint_every=3, callback=stop_at_step(5), direction="descent")
    assert victim.read_text() == "keep me"
    assert ck.is_file() and not ck.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "run.ckpt.tmp", "victim.txt"]


# ---------------------------------------------------------------------------- seed and generator
def test_seed_next_to_a_generator_is_refused():
    """Before: seed= was silently ignored when generator= was given too."""
    x0, h = _problem()
    theta = tp.OrnsteinUhlenbeck(h)
    with pytest.raises(ValueError, match="not both"):
        tp.simulate(x0, theta, t1=0.2, dt=0.1, seed=3, generator=gen(1), direction="descent")
    with pytest.raises(ValueError, match="not both"):
        tp.sample_path(theta, t1=0.2, dt=0.1, seed=3, generator=gen(1))
    with pytest.raises(ValueError, match="not both"):
        tp.jko(x0, h, tau=0.1, steps=2, seed=3, generator=gen(1), direction="descent")
    # a generator alone still drives jko's sampled path (jko forwards no seed next to it)
    a = tp.jko(x0, theta, tau=0.1, steps=2, generator=gen(4), direction="descent")
    b = tp.jko(x0, theta, tau=0.1, steps=2, generator=gen(4), direction="descent")
    assert_close(a.path.scores, b.path.scores)
    # seed=0 is the default: the same numbers
    assert_close(tp.simulate(x0, theta, t1=0.2, dt=0.1, seed=0, direction="descent").x, tp.simulate(x0, theta, t1=0.2, dt=0.1, direction="descent").x)


# ---------------------------------------------------------------------------- adaptive tolerances
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["rtol", "atol"])
def test_adaptive_tolerances_must_be_positive_and_finite(bad, which):
    """Before: rtol = atol = −1 ran and returned tokens 1.13 off the sphere; 0 raised a bare AssertionError."""
    x0, h = _problem()
    with pytest.raises(ValueError, match=which):
        tp.simulate(x0, h, t1=0.2, dt=0.1, method="adaptive", **{which: bad}, direction="descent")


def test_tolerances_with_a_fixed_step_method_are_refused():
    x0, h = _problem()
    with pytest.raises(ValueError, match="method='adaptive'"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, method="rk4", rtol=1e-9, direction="descent")
    tr = tp.simulate(x0, h, t1=0.2, dt=0.1, method="adaptive", rtol=1e-6, atol=1e-8, direction="descent")
    assert float((tr.x.norm(dim=-1) - 1).abs().max()) < 1e-12


# ---------------------------------------------------------------------------- common scale
def test_a_given_scale_is_checked_against_the_weighted_measure_at_t0():
    """The check of a given energy_log_scale reads the token weights: with the weight on one token the largest
    log-partition is the self-score β = 10, more than 1 above the uniform measure's (8.88 here), so a c that
    leaves the weighted values half a unit above the underflow floor is accepted with the weights and refused
    without them."""
    dtype = torch.float64
    x0 = tp.sphere.octahedral(6, dtype=dtype)
    heads = tp.Heads.scalar([10.0], 3).to(dtype)
    w = torch.tensor([1 - 5e-12] + [1e-12] * 5, dtype=dtype)
    fi = torch.finfo(dtype)
    c = float(tp.softmax_statistics(x0, heads, w).log_partition.max()) - math.log(fi.tiny / fi.eps) - 0.5
    tr = tp.simulate(x0, heads, t1=0.1, dt=0.1, weights=w, energy_log_scale=c)
    assert tr.stats["energy_log_scale"] == c
    with pytest.raises(ValueError, match="underflow"):
        tp.simulate(x0, heads, t1=0.1, dt=0.1, energy_log_scale=c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_an_underflowing_energy_log_scale_is_refused_with_the_value_that_fits(dtype):
    """Before: energy_log_scale=1e4 returned energy 0 and ledger residual 0 (everything underflowed)."""
    import re

    x0, h = _problem(dtype)
    with pytest.raises(ValueError, match="underflow") as e:
        tp.simulate(x0, h, t1=0.2, dt=0.1, energy_log_scale=1e4, direction="descent")
    msg = str(e.value)
    assert "energy_log_scale=None" in msg
    fits = int(re.search(r"a value <= (-?\d+)", msg).group(1))
    ref = tp.simulate(x0, h, t1=0.2, dt=0.1, direction="descent")
    tr = tp.simulate(x0, h, t1=0.2, dt=0.1, energy_log_scale=fits, direction="descent")  # the value it names is accepted
    assert bool((tr.energy > 0).all())
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    assert_close(tr.log_energy(), ref.log_energy(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="underflow"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, energy_log_scale=fits + 2, direction="descent")
    with pytest.raises(ValueError, match="underflow"):  # "adaptive": refused before the solve, too
        tp.simulate(x0, h, t1=0.2, dt=0.1, method="adaptive", energy_log_scale=1e4,
                    callback=None, observables={"boom": _must_not_run}, direction="descent")


def _must_not_run(x, w):
    raise AssertionError("the adaptive solve ran before the scale was checked")


# ---------------------------------------------------------------------------- horizon, empty, shapes
def test_record_every_beyond_the_horizon_is_refused():
    """Before: record_every=1000 with 50 steps kept one interval (a time average of one record)."""
    x0, h = _problem()
    with pytest.raises(ValueError, match=r"record_every = 1000 .*number of steps of the run \(50"):
        tp.simulate(x0, h, t1=5.0, dt=0.1, record_every=1000, direction="descent")
    with pytest.raises(ValueError, match=r"record_every = 4 .*\(3"):
        tp.jko(x0, h, tau=0.1, steps=3, record_every=4, direction="descent")
    with pytest.raises(ValueError, match=r"record_every = 5 .*\(2"):
        tp.simulate_sharded(x0, h, t1=0.2, dt=0.1, record_every=5, direction="descent")
    assert len(tp.simulate(x0, h, t1=0.5, dt=0.1, record_every=5, direction="descent").times) == 2  # = the number of steps: fine


def test_empty_batches_are_refused_naming_the_shape():
    """Before: "max(): Expected reduction dim" from simulate and jko."""
    _, h = _problem()
    empty = torch.zeros(0, 4, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"x0 holds no token sets.*\(0, 4, 3\)"):
        tp.simulate(empty, h, t1=0.2, dt=0.1, direction="descent")
    with pytest.raises(ValueError, match=r"x0 holds no token sets.*\(0, 4, 3\)"):
        tp.jko(empty, h, tau=0.1, steps=2, direction="descent")
    with pytest.raises(ValueError, match=r"grid_weights has an empty batch"):
        tp.jko(None, h, tau=0.1, steps=2, scheme="eulerian", grid=tp.sphere.fibonacci_sphere(10, dtype=F64),
               grid_weights=torch.zeros(0, 10, dtype=F64), direction="descent")


@pytest.mark.parametrize("bad,err,match", [
    (lambda t, A: A[..., :2, :2], ValueError, r"shape \(2, 2, 2\).*\(2, 3, 3\)"),
    (lambda t, A: A.sum(-1), ValueError, r"shape of A, \(2, 3, 3\)"),
    (lambda t, A: 1.0, TypeError, "returned float"),
    (lambda t, A: A.float(), TypeError, "float32"),
])
def test_a_custom_drift_of_the_wrong_output_is_named(bad, err, match):
    """Before: a Custom drift of the wrong shape failed deep in the solver with a broadcasting error."""
    x0, h = _problem()
    with pytest.raises(err, match=match):
        tp.simulate(x0, tp.Custom(h, bad), t1=0.2, dt=0.1, direction="descent")
    ok = tp.simulate(x0, tp.Custom(h, lambda t, A: -torch.eye(3, dtype=F64)), t1=0.2, dt=0.1, direction="descent")  # broadcasts to A
    assert ok.x.shape == (3, 5, 3)


def test_a_custom_diffusion_of_the_wrong_shape_is_named():
    x0, h = _problem()
    with pytest.raises(ValueError, match=r"diffusion returned shape \(7,\)"):
        tp.simulate(x0, tp.Custom(h, _drift_minus, diffusion=lambda t: torch.ones(7, dtype=F64)), t1=0.2, dt=0.1, direction="descent")
    with pytest.raises(TypeError, match="diffusion returned str"):
        tp.simulate(x0, tp.Custom(h, _drift_minus, diffusion=lambda t: "0.1"), t1=0.2, dt=0.1, direction="descent")


# ---------------------------------------------------------------------------- resource guards
@pytest.fixture
def no_allocation(monkeypatch):
    """Fail if a solver gets as far as building its weight driver (the first thing that allocates)."""
    def refuse(*a, **k):
        raise AssertionError("the run started: the guard must refuse before any allocation")
    monkeypatch.setattr(processes.driver.WeightDriver, "__init__", refuse)


def test_guards_refuse_at_once(no_allocation):
    """Before: dt=1e-10, paths=1e7 and sample_path(paths=1e9) died with MemoryError/RuntimeError after
    seconds, or hung."""
    x0, h = _problem()
    with pytest.raises(ValueError, match=r"1e\+10 steps, more than max_steps"):
        tp.simulate(x0, h, t1=1.0, dt=1e-10, direction="descent")
    with pytest.raises(ValueError, match=r"would need about .*max_memory"):
        tp.simulate(x0, tp.OrnsteinUhlenbeck(h), t1=1.0, dt=0.01, paths=10 ** 7, direction="descent")
    with pytest.raises(ValueError, match=r"the stored path .*max_memory"):
        tp.sample_path(tp.OrnsteinUhlenbeck(h), t1=1.0, dt=0.01, paths=10 ** 9)
    with pytest.raises(ValueError, match="max_steps"):
        tp.sample_path(tp.OrnsteinUhlenbeck(h), t1=1.0, dt=1e-10)
    with pytest.raises(ValueError, match="max_steps"):
        tp.jko(x0, h, tau=1e-3, steps=10 ** 8, direction="descent")
    with pytest.raises(ValueError, match="max_memory"):
        tp.jko(x0, tp.OrnsteinUhlenbeck(h), tau=0.1, steps=10, paths=10 ** 9, direction="descent")


def test_the_limits_can_be_raised_and_lowered():
    x0, h = _problem()
    with pytest.raises(ValueError, match=r"max_memory = 1 KiB|max_memory = 1\.02e\+03 B|max_memory"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, max_memory=1024, direction="descent")
    with pytest.raises(ValueError, match="max_steps = 10"):
        tp.simulate(x0, h, t1=2.0, dt=0.1, max_steps=10, direction="descent")
    tr = tp.simulate(x0, h, t1=2.0, dt=0.1, max_steps=20, max_memory=2 ** 30, direction="descent")
    assert tr.x.shape[0] == 21
    assert tp.simulate(x0, h, t1=0.2, dt=0.1, max_memory=float("inf"), direction="descent").x.shape[0] == 3  # no limit
    with pytest.raises(ValueError, match="max_steps"):
        tp.jko(x0, h, tau=0.1, steps=3, max_steps=2, direction="descent")
    with pytest.raises(TypeError, match="max_steps"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, max_steps=1.5, direction="descent")
    with pytest.raises(ValueError, match="max_memory"):
        tp.simulate(x0, h, t1=0.2, dt=0.1, max_memory=-1, direction="descent")


def test_memory_estimate_grows_with_what_is_stored():
    """The estimate is linear in the records, the paths and the stored path (not a constant)."""
    x0, h = _problem()
    ou = tp.OrnsteinUhlenbeck(h)
    est = lambda **kw: sum(particle._estimate_memory(  # noqa: E731
        x0, ou, **{**dict(K=100, record_every=1, paths=2, method="euler", diagnostics=True, return_path=False,
                          chunk_elements=None, noisy=True, obs={}), **kw}).values())
    assert est(paths=20) > 9 * est(paths=2)
    assert est(return_path=True) > est(return_path=False)
    assert est(record_every=1) > est(record_every=10)
    assert math.isfinite(est(K=10 ** 9))


class _Decay:
    def __init__(self, k):
        self.k = k

    def __call__(self, t, A):
        return -self.k * A


def _sig(fn):
    return parts._fingerprint(*parts.callable_signature(fn, "f"))


def test_callable_signature_sees_partials_objects_closures_and_globals():
    import functools

    assert _sig(functools.partial(_scaled_drift_at, k=1.0)) != _sig(functools.partial(_scaled_drift_at, k=2.0))
    assert _sig(functools.partial(_scaled_drift_at, k=1.0)) == _sig(functools.partial(_scaled_drift_at, k=1.0))
    assert _sig(_Decay(1.0)) != _sig(_Decay(2.0))
    assert _sig(_Decay(1.0)) == _sig(_Decay(1.0))
    assert _sig(_scaled_drift(1.0)) != _sig(_scaled_drift(3.0))
    assert _sig(torch.neg) != _sig(torch.exp)  # built-ins by qualified name (no source needed)
    assert _sig(_drift_minus) != _sig(_drift_plus)
    global _RATE
    before = _sig(_global_rate_drift)
    _RATE = 2.0
    try:
        assert _sig(_global_rate_drift) != before  # a module-level number it reads
    finally:
        _RATE = 1.0


_RATE = 1.0


def _scaled_drift_at(t, A, k=1.0):
    return -k * A


def _global_rate_drift(t, A):
    return -_RATE * A


# ---------------------------------------------------------------------------- configs that are not files, and sizes
_CLI = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))  # an unbounded read fails fast instead of swapping
from transformer_pde.application.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(args, cwd, timeout=60):
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _CLI, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_or_a_device_as_config_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "p.toml")  # opening it would wait for a writer for ever
    for config, what in (("p.toml", "named pipe"), ("/dev/zero", "device")):
        r = _cli(["run", config, "--out", str(tmp_path / "out")], tmp_path)
        assert r.returncode == 2 and what in r.stderr and "MemoryError" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_file_larger_than_any_config_is_refused(tmp_path, capsys):
    from transformer_pde.application import config
    from transformer_pde.application.cli import main

    big = tmp_path / "big.toml"
    big.write_text('kind = "demo"\n' + "# padding\n" * (config.CONFIG_MAX_BYTES // 10 + 1))
    assert main(["run", str(big), "--out", str(tmp_path / "out")]) == 2
    assert "bytes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tokens_on_the_meta_device_are_refused_naming_the_device(dtype):
    x0 = torch.empty(5, 3, device="meta", dtype=dtype)
    heads = tp.Heads.random(2, 3, generator=gen(0), dtype=dtype)
    with pytest.raises(ValueError, match="meta device"):
        tp.simulate(x0, heads, t1=0.1, dt=0.05, direction="descent")
    with pytest.raises(ValueError, match="meta device"):
        tp.solve(tp.Model(heads, direction="descent"), x0, tp.Euler(), t1=0.1, dt=0.05)


def test_mode_growth_rates_refuses_a_huge_ell_max_before_allocating():
    with pytest.raises(ValueError, match="ell_max = 1000000000 would allocate"):
        tp.theory.mode_growth_rates(1.0, 3, T=0.1, ell_max=10**9)
    # the largest accepted one still gives r_ℓ = ℓ(ℓ+1)(c_ℓ − T) with c_ℓ ≈ 0 far out
    r = tp.theory.mode_growth_rates(1.0, 3, T=0.1, ell_max=10**6)
    ell = 10**6
    assert_close(r[-1], torch.tensor(-0.1 * ell * (ell + 1), dtype=torch.float64), rtol=1e-12, atol=0.0)
