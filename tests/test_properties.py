"""Property-based contract of the public entry points, with hypothesis.

The contract: for any input — random shapes, dtypes (float16 / bfloat16 / int / complex among them),
β up to 10⁴ (and 0, negative, inf, NaN), head and token weights with zeros and negatives, process
parameters with inf / NaN / negatives, config overrides — every entry point either returns finite
values or raises one of the documented exceptions:

    ValueError, TypeError (bad input, before any work), tp.NonFiniteError (a solver met NaN/inf:
    time, step, quantity), tp.JKOConvergenceError (strict JKO), and OverflowError for tp.velocity (unnormalised kernels) / tp.mobility / tp.energy /
    tp.slope / tp.dissipation at log_scale=0 (documented there: the value does not fit the dtype).

Anything else — another exception, a NaN or inf in a returned value, a call running past
``HANG_S`` seconds — fails.  Sizes are tiny (n ≤ 5 tokens, d ≤ 4, H ≤ 3, ≤ 3 steps) so that the
default run stays within ~30 s on a busy 2-core machine; ``-m slow`` runs the same properties with
many more examples.  The number of inputs tried per entry point and how they ended is printed with
``pytest -s`` (``TRIED``).
"""

import warnings
from collections import Counter, defaultdict

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import transformer_pde as tp  # noqa: E402

# hypothesis keeps a cache directory; keep it out of the repository
import tempfile  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

set_hypothesis_home_dir(str(_Path(tempfile.gettempdir()) / "transformer_pde_hypothesis"))

HANG_S = 60
DOCUMENTED = (ValueError, TypeError, tp.NonFiniteError, tp.JKOConvergenceError)
TRIED = defaultdict(Counter)  # entry point -> {"finite": k, "ValueError": k, ...}

FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
SLOW = settings(FAST, max_examples=400)


from fuzzing import _tensors, time_limit  # noqa: E402  (shared with the other property tests)


# Non-finite results tolerated without an error (none: add a name here only with a reason).
KNOWN_NONFINITE: set = set()


def contract(name, fn, *, extra=()):
    """Call fn(); assert the contract; record the outcome under ``name``."""
    allowed = DOCUMENTED + tuple(extra)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with time_limit(HANG_S):
                out = fn()
    except allowed as e:
        TRIED[name][type(e).__name__] += 1
        assert str(e), f"{name}: {type(e).__name__} without a message"
        return None
    for t in _tensors(out):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            if name in KNOWN_NONFINITE:
                TRIED[name]["known non-finite"] += 1
                return out
            TRIED[name]["NON-FINITE"] += 1
            raise AssertionError(f"{name} returned a non-finite value without raising: {t}")
    TRIED[name]["finite"] += 1
    return out


# ---------------------------------------------------------------------------- strategies
GOOD_DTYPES = [torch.float64, torch.float32]
BAD_DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.complex64]
dtypes = st.sampled_from(GOOD_DTYPES * 6 + BAD_DTYPES)


def _to(t, dtype):
    return t.to(dtype)


BAD_ASPECTS = ["x_off_sphere", "x_nan", "omega_zero", "omega_negative", "beta", "w_negative", "w_sum",
               "dtype", "untied"]
aspects = st.sampled_from([None] * 6 + BAD_ASPECTS)  # about 2 in 5 inputs are bad in exactly one way


@st.composite
def problems(draw, batch=True):
    """(x, heads, weights) with random shapes, dtypes, β, head and token weights; ``bad`` spoils one."""
    bad = draw(aspects)
    n = draw(st.integers(1, 5))
    d = draw(st.integers(2, 4))
    H = draw(st.integers(1, 3))
    bshape = tuple(draw(st.lists(st.integers(1, 2), max_size=1))) if batch else ()
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x = torch.randn(*bshape, n, d, generator=g, dtype=torch.float64)
    if bad != "x_off_sphere":
        x = x / x.norm(dim=-1, keepdim=True)
    if bad == "x_nan":
        x[..., 0, 0] = float("nan")
    symmetric = draw(st.booleans())
    scale = draw(st.sampled_from([0.0, 0.1, 1.0, 5.0]))
    A = scale * torch.randn(H, d, d, generator=g, dtype=torch.float64)
    if symmetric:
        A = A + A.transpose(-1, -2)
    omega = None if draw(st.booleans()) else torch.rand(H, generator=g, dtype=torch.float64)
    if bad == "omega_zero":
        omega = torch.zeros(H, dtype=torch.float64)
    elif bad == "omega_negative":
        omega = -torch.ones(H, dtype=torch.float64)
    beta = draw(st.sampled_from([float("inf"), float("nan"), -float("inf")])) if bad == "beta" else draw(
        st.one_of(st.floats(1e-3, 1e4), st.sampled_from([1e-3, 1.0, 1e2, 1e3, 1e4])))
    wkind = draw(st.integers(0, 2))
    w = None
    if wkind == 1:
        w = torch.rand(*bshape, n, generator=g, dtype=torch.float64)
        w = w / w.sum(-1, keepdim=True)
    elif wkind == 2:
        w = torch.zeros(*bshape, n, dtype=torch.float64)
        w[..., 0] = 1.0  # zero weights are allowed
    if bad == "w_negative":
        w = torch.full((*bshape, n), -1.0 / n, dtype=torch.float64)
    elif bad == "w_sum":
        w = 2 * torch.rand(*bshape, n, generator=g, dtype=torch.float64) + 0.1
    dtype = draw(st.sampled_from(BAD_DTYPES if bad == "dtype" else GOOD_DTYPES))
    value = torch.randn(H, d, d, generator=g, dtype=torch.float64) if bad == "untied" else None
    return dict(x=x, A=A, value=value, omega=omega, beta=beta, w=w, dtype=dtype, symmetric=symmetric, bad=bad)


def build(p):
    """Heads and tensors in the drawn dtype (Heads(...) itself is part of the contract)."""
    dt = p["dtype"]
    x = _to(p["x"], dt)
    w = None if p["w"] is None else _to(p["w"], dt)
    heads = tp.Heads(_to(p["A"], dt), None if p["value"] is None else _to(p["value"], dt),
                     None if p["omega"] is None else _to(p["omega"], dt), p["beta"])
    return x, heads, w


# ---------------------------------------------------------------------------- field, energy, mobility
def _field_props(p, norm, direction):
    contract("Heads", lambda: build(p)[1])
    contract(f"velocity[{norm}]", lambda: tp.velocity(*build(p), normalization=norm, direction=direction),
             extra=(OverflowError,))
    contract("energy", lambda: tp.energy(*build(p)), extra=(OverflowError,))
    contract("mobility", lambda: tp.mobility(*build(p)), extra=(OverflowError,))
    contract("slope", lambda: tp.slope(*build(p), normalization=norm), extra=(OverflowError,))
    contract("dissipation", lambda: tp.dissipation(*build(p), normalization=norm, direction=direction),
             extra=(OverflowError,))


norms = st.sampled_from(["softmax", "unnormalized", "relu", "effective", "bogus"])
directions = st.sampled_from(["ascent", "descent"])


@FAST
@given(problems(), norms, directions)
def test_field_energy_mobility_contract(p, norm, direction):
    _field_props(p, norm, direction)


@pytest.mark.slow
@SLOW
@given(problems(), norms, directions)
def test_field_energy_mobility_contract_slow(p, norm, direction):
    _field_props(p, norm, direction)


# ---------------------------------------------------------------------------- simulate, jko
def _solver_props(p, k, dt, method, norm, noisy, with_paths):
    def sim():
        x, heads, w = build(p)
        theta = tp.OrnsteinUhlenbeck(heads, sigma=0.3) if noisy else heads
        return tp.simulate(x, theta, t1=k * dt, dt=dt, method=method, normalization=norm, weights=w,
                           paths=2 if with_paths else None, seed=1)

    contract("simulate", sim)

    def jko():
        x, heads, w = build(p)
        theta = tp.OrnsteinUhlenbeck(heads, sigma=0.3) if noisy else heads
        return tp.jko(x, theta, tau=dt, steps=min(k, 2), transport="identity", weights=w, max_iter=30,
                      paths=2 if (with_paths and noisy) else None)

    contract("jko", jko)


@FAST
@given(problems(batch=False), st.integers(1, 3), st.sampled_from([0.01, 0.1, 0.5]),
       st.sampled_from(["euler", "heun", "rk4"]), st.sampled_from(["softmax", "unnormalized", "effective"]),
       st.booleans(), st.booleans())
def test_simulate_and_jko_contract(p, k, dt, method, norm, noisy, with_paths):
    _solver_props(p, k, dt, method, norm, noisy, with_paths)


@pytest.mark.slow
@SLOW
@given(problems(batch=False), st.integers(1, 3), st.sampled_from([0.01, 0.1, 0.5]),
       st.sampled_from(["euler", "heun", "rk4"]), st.sampled_from(["softmax", "unnormalized", "effective"]),
       st.booleans(), st.booleans())
def test_simulate_and_jko_contract_slow(p, k, dt, method, norm, noisy, with_paths):
    _solver_props(p, k, dt, method, norm, noisy, with_paths)


def test_jko_large_beta_is_finite_or_documented():
    """β up to 10⁴ on fixed small problems: JKO converges, warns, or raises a documented error."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    A = torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
    A = A + A.transpose(-1, -2)
    for beta in (1.0, 30.0, 300.0, 1e4):
        for dtype in GOOD_DTYPES:
            contract("jko", lambda: tp.jko(x.to(dtype), tp.Heads(A.to(dtype), beta=beta), tau=0.01, steps=1,
                                           transport="identity", max_iter=40))


# ---------------------------------------------------------------------------- distance
def _distance_props(seed, n, m, d, kind, dtype, bad_w):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(m, d, generator=g, dtype=torch.float64)
    x, y = x / x.norm(dim=-1, keepdim=True), y / y.norm(dim=-1, keepdim=True)
    a = torch.full((n,), -1.0 if bad_w else 1.0 / n, dtype=torch.float64)
    contract("distance", lambda: tp.distance((_to(x, dtype), _to(a, dtype)), _to(y, dtype), kind))


@FAST
@given(st.integers(0, 1000), st.integers(1, 5), st.integers(1, 5), st.integers(2, 4),
       st.sampled_from(["w2", "w2", "sinkhorn", "sliced", "mmd", "nope"]), dtypes, st.integers(0, 4).map(lambda k: k == 0))
def test_distance_contract(seed, n, m, d, kind, dtype, bad_w):
    _distance_props(seed, n, m, d, kind, dtype, bad_w)


# ---------------------------------------------------------------------------- processes
def _process_props(which, rate, sigma, t1, dt, paths, seed, scheme):
    heads = tp.Heads(torch.eye(3, dtype=torch.float64).expand(2, 3, 3).clone(), beta=1.0)

    def make():
        if which == "ou":
            return tp.OrnsteinUhlenbeck(heads, rate=rate, sigma=sigma, scheme=scheme)
        if which == "osc":
            return tp.Oscillating(heads, sigma=sigma, scheme=scheme)
        if which == "custom":
            return tp.Custom(heads, lambda t, A: -rate * A, diffusion=sigma)
        return tp.Layerwise([heads, heads], layer_time=rate)

    proc = contract("process", make)
    if proc is not None:
        contract("sample_path", lambda: tp.sample_path(proc, t1=t1, dt=dt, paths=paths, seed=seed))


procs = st.sampled_from(["ou", "osc", "custom", "layerwise"])
params = st.one_of(st.floats(0, 10), st.sampled_from([-1.0, 0.0, float("inf"), float("nan"), "1", None]))
seeds = st.one_of(st.integers(0, 2 ** 31), st.sampled_from([-1, 1.5, "1", 2 ** 70]))
paths_ = st.one_of(st.none(), st.integers(-1, 3), st.sampled_from([1.5, "2"]))
t1s = st.one_of(st.sampled_from([0.1, 0.2, 0.3]), st.sampled_from([0.0, -1.0, float("inf"), float("nan"), "1"]))


@FAST
@given(procs, params, params, t1s, st.sampled_from([0.1, 0.05, 0.0, -0.1, float("nan")]), paths_, seeds,
       st.sampled_from(["exact", "euler", "bogus"]))
def test_process_and_sample_path_contract(which, rate, sigma, t1, dt, paths, seed, scheme):
    _process_props(which, rate, sigma, t1, dt, paths, seed, scheme)


@pytest.mark.slow
@SLOW
@given(procs, params, params, t1s, st.sampled_from([0.1, 0.05, 0.0, -0.1, float("nan")]), paths_, seeds,
       st.sampled_from(["exact", "euler", "bogus"]))
def test_process_and_sample_path_contract_slow(which, rate, sigma, t1, dt, paths, seed, scheme):
    _process_props(which, rate, sigma, t1, dt, paths, seed, scheme)


# ---------------------------------------------------------------------------- config overrides
CONFIG = "experiments/ou_vs_oscillating_quick.toml"
keys = st.sampled_from(["n", "d", "seed", "noise_seed", "t1", "dt", "paths", "heads", "record_every", "t_avg",
                        "beta", "ou_sigma2", "ou_rate", "method", "dtype", "no_such_key", "", "params.n"])
values = st.sampled_from(["1", "0", "-1", "2.5", "inf", "nan", "-inf", "1e400", "true", "\"x\"", "[1, 2]", "[]",
                          "float16", "rk4", "", "1e4", "9999999999999999999999"])


def _config_props(pairs):
    from pathlib import Path

    from transformer_pde.application.config import load_config

    src = Path(__file__).resolve().parents[1] / CONFIG
    overrides = [f"{k}={v}" for k, v in pairs]
    contract("load_config", lambda: load_config(src, overrides))


@FAST
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=3))
def test_config_override_contract(pairs):
    _config_props(pairs)


@pytest.mark.slow
@SLOW
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=3))
def test_config_override_contract_slow(pairs):
    _config_props(pairs)


def test_zz_report_counts(capsys):
    """Prints how many inputs each entry point was given in this test run and how they ended."""
    with capsys.disabled():
        for name in sorted(TRIED):
            c = TRIED[name]
            print(f"\n[properties] {name}: {sum(c.values())} inputs: {dict(c)}", end="")
    assert all(c["NON-FINITE"] == 0 for c in TRIED.values())
