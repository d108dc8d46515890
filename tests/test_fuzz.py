"""Property-based fuzz of the input boundaries ("fresh machine, hostile input"), with hypothesis.

The contract, for every input the strategies below generate:

* (a) the config loader ``transformer_pde.application.runs.load_config`` — given generated TOML *documents*
  (wrong types, lists and tables where scalars belong, integers beyond int64, NaN/inf floats,
  unicode, a UTF-8 BOM, NUL bytes, invalid UTF-8, unknown keys, truncated text) and generated
  ``-o key=value`` overrides — either returns a config whose every value is finite and strictly
  JSON-serialisable (it is written to ``config.json``), or raises ValueError / TypeError with a
  message.  Never another exception.
* (b) ``tp.simulate``, ``tp.jko`` and ``tp.distance`` — given generated shapes (empty batches,
  n = 0, d ≤ 1, mismatched d), dtypes (float16, bfloat16, int, complex, bool, mixed), values
  (off the sphere, NaN, inf) and arguments (zero, negative, NaN, inf, huge, strings, bools,
  tensors, None) — either return results without a NaN/inf or raise ValueError / TypeError.
  :class:`tp.NonFiniteError` (documented by both solvers: the run itself overflowed, with time,
  step and quantity) is accepted only for inputs flagged ``overflow_ok``: β·‖A‖ ≥ 30 (the
  kernel e^{β⟨Ax, y⟩} leaves the float32 range at β⟨Ax, y⟩ ≈ 88) — never for moderate inputs.
  :class:`tp.JKOConvergenceError` is accepted for ``strict=True`` only (its documented use).
* (c) the command line ``transformer_pde.application.cli.main(["run", CONFIG, "--out", OUT, "-o", ...])``, run
  in-process from a temporary working directory with a fuzzed override, returns one of its
  documented exit codes (0 done, 2 refused, 1 I/O error, 3 NaN/inf) without raising, writes
  nothing outside ``OUT/NAME`` (the working directory and the config's folder are compared before
  and after), and writes nothing at all when it refuses (exit code 2).

Sizes are tiny (n ≤ 4 tokens, d ≤ 3, H ≤ 2, ≤ 3 steps) so that each example runs in milliseconds;
the default run is derandomized (the same examples every time: it cannot flake) and takes well
under a minute on a busy 2-core machine; ``-m slow`` runs the same properties with many more
examples.  Values that only a resource guard can refuse (n = 10¹⁰ tokens, dt = 10⁻¹⁰) are left to
the tests of those guards: here sizes stay small and the step count at most a few.
"""

import json
import math
import os
import re
import tempfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

import transformer_pde as tp  # noqa: E402

# hypothesis keeps a cache directory; keep it out of the repository (and database=None below)
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "transformer_pde_hypothesis"))

HANG_S = 60
FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
SLOW = settings(FAST, max_examples=500)
TRIED = defaultdict(Counter)  # entry point -> {"ok": k, "ValueError": k, ...}
MESSAGES = defaultdict(set)  # entry point -> the error messages seen (printed with -s by test_zz_report_counts)
# messages of Python / torch internals, not of a check that says what was wrong and how to fix it
RAW = re.compile(r"unhashable type|Expected reduction dim|object of type .* has no len|not supported between "
                 r"instances|object is not (subscriptable|iterable|callable)|has no attribute|must be real number, not|"
                 r"can't convert|could not convert|invalid literal|too many dimensions|Overflow when unpacking|"
                 r"out of range integral type|division by zero|index \d+ is out of bounds|shape '\[|"
                 r"size of tensor a|mat1 and mat2|expected scalar type|Found dtype|not implemented for")


from fuzzing import _tensors, time_limit  # noqa: E402  (shared with the other property tests)


def contract(name, fn, *, allowed=(ValueError, TypeError)):
    """Call fn(); a documented exception (with a message) or a result without NaN/inf passes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with time_limit(HANG_S):
                out = fn()
    except allowed as e:
        TRIED[name][type(e).__name__] += 1
        msg = str(e).strip()
        MESSAGES[name].add(f"{type(e).__name__}: {msg[:160]}")
        assert msg, f"{name}: {type(e).__name__} without a message"
        assert not RAW.search(msg), f"{name}: a raw {type(e).__name__} from the internals, not a check: {msg}"
        return None
    for t in _tensors(out):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{name} returned a non-finite value without raising: {t}")
    TRIED[name]["ok"] += 1
    return out


# ---------------------------------------------------------------------------- (a) TOML documents
def toml_key(k: str) -> str:
    return k if k and all(c.isascii() and (c.isalnum() or c in "-_") for c in k) else json.dumps(k, ensure_ascii=False)


def toml_value(v) -> str:
    """A TOML rendering of a generated value (NaN/inf as TOML's nan/inf; strings JSON-escaped, which
    TOML mostly accepts — the rest is invalid TOML, itself a fair input)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise AssertionError(type(v))


TEXT = st.characters(blacklist_categories=("Cs",))  # any unicode scalar value (TOML cannot hold lone surrogates)
HUGE_INTS = st.sampled_from([2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30, -10 ** 30, 2 ** 200])
scalars = st.one_of(
    st.integers(-3, 100), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-320, 1e308, 0.5, 2.5]),
    st.booleans(),
    st.text(TEXT, max_size=8), st.sampled_from(["", "float16", "float64", "rk4", "ou", "é∂ƒ", "\u202e", "a\x00b", "☃",
                                                "\U0001f600"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(TEXT, max_size=4), inner, max_size=2)),
                      max_leaves=6)

from transformer_pde.application import studies as _studies  # noqa: E402

KINDS = sorted(_studies.available())
kinds = st.one_of(st.sampled_from(KINDS), st.sampled_from([["demo"], {"a": 1}, 3, 1.5, True, "", "no_such_kind",
                                                           "démo", "demo\x00"]))


def option_names(kind):
    return sorted(_studies.get_study(kind).options) if kind in KINDS else ["n"]


@st.composite
def documents(draw):
    """(bytes of a TOML file, overrides)."""
    kind = draw(kinds)
    names = option_names(kind) if isinstance(kind, str) else ["n"]
    keys = st.one_of(st.sampled_from(names), st.sampled_from(["no_such_key", "", "params.n", "é", "n.m"]))
    lines = []
    if draw(st.sampled_from([True] * 9 + [False])):  # 1 in 10 documents has no kind
        lines.append(f"kind = {toml_value(kind)}")
    for top in draw(st.lists(st.sampled_from(["name", "description", "unknown_top", "params"]), max_size=2,
                             unique=True)):
        lines.append(f"{top} = {toml_value(draw(values))}")
    params = draw(st.dictionaries(keys, st.one_of(values, st.sampled_from([1, 2, 0.01, 0.1, "float64"])),
                                  max_size=4))
    if isinstance(kind, str) and kind in KINDS and draw(st.booleans()):
        # a valid document with at most one odd value: the defaults of a few keys, one of them redrawn
        opts = _studies.get_study(kind).options
        chosen = draw(st.lists(st.sampled_from(sorted(opts)), max_size=4, unique=True))
        params = {k: opts[k].default for k in chosen}
        if chosen and draw(st.booleans()):
            params[draw(st.sampled_from(chosen))] = draw(values)
    if params and not any(line.startswith("params =") for line in lines):
        lines.append("[params]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in params.items()]
    text = "\n".join(lines) + "\n"
    mutation = draw(st.sampled_from([None] * 12 + ["bom", "nul", "latin1", "truncate", "duplicate", "garbage"]))
    data = text.encode("utf-8")
    if mutation == "bom":
        data = b"\xef\xbb\xbf" + data
    elif mutation == "nul":
        data = data + b"\x00"
    elif mutation == "latin1":
        data = data + "x = 'caf\xe9'\n".encode("latin-1")
    elif mutation == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif mutation == "duplicate" and lines:
        data = (text + lines[0] + "\n").encode("utf-8")
    elif mutation == "garbage":
        data = data + draw(st.binary(max_size=8))
    overrides = draw(st.lists(st.one_of(
        st.builds(lambda k, v: f"{k}={toml_value(v)}", keys, values),
        st.sampled_from(["n", "=", "=1", "n=", "n==1", "n=1e400", "n=[", "params.=1", "n=\"x", "é=1"])),
        max_size=2))
    return data, overrides


def _check_config(cfg):
    assert set(cfg) >= {"kind", "name", "params"}, cfg
    # config.json is written from it: strict JSON (no NaN/Infinity), every float finite
    json.dumps(cfg, allow_nan=False)


def _config_props(data, overrides, tmp):
    from transformer_pde.application.config import load_config

    path = Path(tmp) / "config.toml"
    path.write_bytes(data)
    cfg = contract("load_config[file]", lambda: load_config(path, overrides))
    if cfg is not None:
        _check_config(cfg)


@FAST
@given(documents())
def test_config_loader_contract(doc):
    with tempfile.TemporaryDirectory() as tmp:
        _config_props(*doc, tmp)


@pytest.mark.slow
@SLOW
@given(documents())
def test_config_loader_contract_slow(doc):
    with tempfile.TemporaryDirectory() as tmp:
        _config_props(*doc, tmp)


python_values = st.one_of(values, st.sampled_from([None, (1, 2), {1, 2}, b"bytes", object(), float("nan"),
                                                   torch.tensor(1.0), 1 + 2j]))


@FAST
@given(kinds, st.dictionaries(st.one_of(st.sampled_from(["n", "t1", "dt", "seed", "heads", "paths", "dtype"]),
                                        st.text(max_size=3)), python_values, max_size=3),
       st.dictionaries(st.sampled_from(["name", "description", "extra"]), python_values, max_size=2))
def test_config_dict_contract(kind, params, top):
    """load_config(dict): Python objects that TOML cannot even express (None, tuples, sets, bytes,
    complex, tensors) are refused with ValueError / TypeError too."""
    from transformer_pde.application.config import load_config

    cfg = contract("load_config[dict]", lambda: load_config({"kind": kind, "params": params, **top}))
    if cfg is not None:
        _check_config(cfg)


# ---------------------------------------------------------------------------- (b) solver arguments
# Every call spoils at most one aspect (about half the calls none), so that the valid paths run too
# and each refusal is the refusal of one thing.
GOOD = [torch.float64, torch.float32]
BAD_DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.complex64, torch.bool]
NOT_A_NUMBER = [None, "1", True, [1.0], torch.tensor([1.0, 2.0]), 1 + 1j]


def _spoil(draw, aspects):
    return draw(st.one_of(st.none(), st.sampled_from(list(aspects))))  # half the calls clean


@st.composite
def token_tensors(draw, spoiled=False):
    """Tokens (*batch, n, d) on the sphere in float32/64 (n ≤ 4, d ≤ 3, batch ≤ 2) — or, spoiled, one of:
    an empty batch, n = 0, d ≤ 1, NaN, inf, off the sphere, a bad dtype, a list, a scalar, None, 1-D."""
    bad = draw(st.sampled_from(["empty_batch", "n0", "d1", "d0", "nan", "inf", "off", "dtype", "list", "scalar",
                                "none", "1d"])) if spoiled else None
    n = 0 if bad == "n0" else draw(st.integers(1, 4))
    d = {"d1": 1, "d0": 0}.get(bad, draw(st.integers(2, 3)))
    batch = (0,) if bad == "empty_batch" else tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x = torch.randn(*batch, n, d, generator=g, dtype=torch.float64)
    if bad != "off" and x.numel():
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    if bad == "nan" and x.numel():
        x.view(-1)[0] = float("nan")
    if bad == "inf" and x.numel():
        x.view(-1)[0] = float("inf")
    x = x.to(draw(st.sampled_from(BAD_DTYPES if bad == "dtype" else GOOD)))
    return {"list": x.tolist(), "scalar": 1.0, "none": None, "1d": x.reshape(-1)}.get(bad, x)


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _dtype(x):
    return x.dtype if isinstance(x, torch.Tensor) and x.dtype in GOOD else torch.float64


@st.composite
def heads_for(draw, x, spoil_heads=False, spoil_theta=False, noisy=True):
    """(theta, overflow_ok): Heads, OU or Oscillating heads matching x, β up to 10⁴ (overflow_ok when
    β·‖A‖ ≥ 30); spoiled: a bad β, a mismatched d or dtype, a bad OU σ, or no heads at all."""
    s = _shape(x)
    d = s[-1] if s and len(s) >= 2 and s[-1] >= 2 else 3
    if spoil_theta:
        return draw(st.sampled_from(NOT_A_NUMBER + [torch.eye(d, dtype=torch.float64)])), False
    bad = draw(st.sampled_from(["beta", "d", "dtype", "sigma"])) if spoil_heads else None
    if bad == "d":
        d = draw(st.sampled_from([d + 1, 1]))
    H = draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    A = draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) * torch.randn(H, d, d, generator=g, dtype=torch.float64)
    A = A + A.transpose(-1, -2)
    dtype = draw(st.sampled_from([t for t in GOOD + BAD_DTYPES[:2] if t != _dtype(x)])) if bad == "dtype" else _dtype(x)
    beta = draw(st.one_of(st.sampled_from([1e-3, 0.5, 1.0, 2.0]), st.floats(1e-3, 10.0), st.floats(10.0, 1e4)))
    if bad == "beta":
        beta = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, "1", None, True]))
    norm_A = float(torch.linalg.matrix_norm(A, ord=2).max()) if A.numel() else 0.0
    overflow_ok = isinstance(beta, float) and math.isfinite(beta) and beta * max(norm_A, 1.0) >= 30
    kind = draw(st.sampled_from(["heads", "ou", "osc"] if noisy else ["heads", "osc"]))
    if bad == "sigma":
        kind = "ou"
    sigma = draw(st.sampled_from([-1.0, float("nan"), float("inf"), "0.3"])) if bad == "sigma" else 0.3

    def make():
        h = tp.Heads(A.to(dtype), beta=beta)
        return {"ou": lambda: tp.OrnsteinUhlenbeck(h, sigma=sigma), "osc": lambda: tp.Oscillating(h)}.get(
            kind, lambda: h)()

    theta = contract("Heads", make)
    return theta, overflow_ok  # None when the heads themselves were refused: then the solver must refuse None


def token_weights(draw, x, spoiled):
    s = _shape(x)
    n = s[-2] if s and len(s) >= 2 else 3
    batch = s[:-2] if s and len(s) >= 2 else ()
    dt = _dtype(x)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    w = torch.rand(*batch, n, generator=g, dtype=torch.float64).to(dt)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    if not spoiled:
        one = torch.zeros_like(w)
        one[..., :1] = 1.0  # zero weights are allowed: a one-point measure
        return draw(st.sampled_from([None, w, one]))
    other = torch.float64 if dt == torch.float32 else torch.float32
    return draw(st.sampled_from([w.to(other), -w, 2 * w, torch.full((n + 1,), 1.0 / (n + 1), dtype=dt),
                                 torch.zeros(0, n, dtype=dt), torch.full_like(w, float("nan")), w.tolist(),
                                 "uniform"]))


COUNT_BAD = [0, -1, 1.5, True, "2", None, float("nan")]  # (2**70 steps or paths: a resource guard's job)
SEED_BAD = [-1, 1.5, "1", 2 ** 70, None, float("nan")]
STEP_BAD = [0.0, -0.1, float("nan"), float("inf"), "0.1", None, True, 1e300]


def pick(draw, spoil, name, good, bad):
    return draw(st.sampled_from(bad) if spoil == name else good)


SIM_ASPECTS = ["x", "theta", "heads", "t1", "dt", "method", "normalization", "direction", "weights", "paths", "seed",
               "record_every", "diagnostics", "adjoint", "return_path", "progress"]


@st.composite
def simulate_calls(draw):
    spoil = _spoil(draw, SIM_ASPECTS)
    x = draw(token_tensors(spoiled=spoil == "x"))
    theta, overflow_ok = draw(heads_for(x, spoil_heads=spoil == "heads", spoil_theta=spoil == "theta"))
    dt = pick(draw, spoil, "dt", st.sampled_from([0.01, 0.1, 0.5]), STEP_BAD)
    good_dt = dt if isinstance(dt, float) and 0 < dt <= 0.5 else 0.1
    t1 = pick(draw, spoil, "t1", st.integers(1, 3).map(lambda k: k * good_dt),
              [0.0, -1.0, float("nan"), float("inf"), "1", 0.123, None])
    kw = dict(t1=t1, dt=dt,
              method=pick(draw, spoil, "method", st.sampled_from(["euler", "heun", "rk4"]), ["bogus", None, 3, ""]),
              normalization=pick(draw, spoil, "normalization",
                                 st.sampled_from(["softmax", "unnormalized", "relu", "effective"]), ["bogus", None]),
              direction=pick(draw, spoil, "direction", st.sampled_from(["descent", "ascent"]), ["up", None, 1]),
              weights=token_weights(draw, x, spoil == "weights"),
              paths=pick(draw, spoil, "paths", st.sampled_from([None, 1, 2]), [c for c in COUNT_BAD if c is not None]),
              seed=pick(draw, spoil, "seed", st.integers(0, 2 ** 32), SEED_BAD),
              record_every=pick(draw, spoil, "record_every", st.integers(1, 5), COUNT_BAD),
              diagnostics=pick(draw, spoil, "diagnostics", st.booleans(), ["yes", None, 1]),
              adjoint=pick(draw, spoil, "adjoint", st.just(False), ["yes", None, 1]),
              return_path=pick(draw, spoil, "return_path", st.booleans(), ["yes", None, 1]),
              progress=pick(draw, spoil, "progress", st.just(False), ["yes", 1]))
    return spoil, x, theta, kw, overflow_ok


def _allowed(overflow_ok, *extra):
    return (ValueError, TypeError) + ((tp.NonFiniteError,) if overflow_ok else ()) + extra


def _simulate_props(call):
    spoil, x, theta, kw, overflow_ok = call
    out = contract("simulate" if spoil is None else "simulate[spoiled]", lambda: tp.simulate(x, theta, **kw),
                   allowed=_allowed(overflow_ok))
    if out is not None:
        assert spoil is None or spoil == "heads" or spoil == "x", f"spoiled {spoil!r} ran: {kw.get(spoil)!r}"


@FAST
@given(simulate_calls())
def test_simulate_argument_contract(call):
    _simulate_props(call)


@pytest.mark.slow
@SLOW
@given(simulate_calls())
def test_simulate_argument_contract_slow(call):
    _simulate_props(call)


JKO_ASPECTS = ["x", "theta", "heads", "tau", "steps", "transport", "direction", "mobility", "eps", "weights",
               "max_iter", "record_every", "strict", "diagnostics", "progress"]


@st.composite
def jko_calls(draw):
    spoil = _spoil(draw, JKO_ASPECTS)
    x = draw(token_tensors(spoiled=spoil == "x"))
    theta, overflow_ok = draw(heads_for(x, spoil_heads=spoil == "heads", spoil_theta=spoil == "theta"))
    strict = pick(draw, spoil, "strict", st.booleans(), ["no", None, 1])
    kw = dict(tau=pick(draw, spoil, "tau", st.sampled_from([0.01, 0.1, 0.5]), STEP_BAD),
              steps=pick(draw, spoil, "steps", st.integers(1, 2), COUNT_BAD),
              transport=pick(draw, spoil, "transport", st.sampled_from(["identity", "identity", "emd", "sinkhorn"]),
                             ["bogus", 3, ""]),
              direction=pick(draw, spoil, "direction", st.sampled_from(["descent", "ascent"]), ["up", None]),
              mobility=pick(draw, spoil, "mobility", st.sampled_from(["effective", "unit"]), ["bogus", None]),
              eps=pick(draw, spoil, "eps", st.sampled_from([1e-2, 0.1]), [0.0, -1.0, float("nan"), "1", None]),
              weights=token_weights(draw, x, spoil == "weights"),
              max_iter=pick(draw, spoil, "max_iter", st.integers(1, 20), [0, -1, 1.5, None, "3"]),
              record_every=pick(draw, spoil, "record_every", st.integers(1, 3), COUNT_BAD),
              strict=strict, diagnostics=pick(draw, spoil, "diagnostics", st.booleans(), ["yes", None, 1]),
              progress=pick(draw, spoil, "progress", st.just(False), ["yes", 1]))
    extra = (tp.JKOConvergenceError,) if strict is True else ()
    return spoil, x, theta, kw, overflow_ok, extra


def _jko_props(call):
    spoil, x, theta, kw, overflow_ok, extra = call
    out = contract("jko" if spoil is None else "jko[spoiled]", lambda: tp.jko(x, theta, **kw),
                   allowed=_allowed(overflow_ok, *extra))
    if out is not None:
        assert spoil in (None, "heads", "x"), f"spoiled {spoil!r} ran: {kw.get(spoil)!r}"


@FAST
@given(jko_calls())
def test_jko_argument_contract(call):
    _jko_props(call)


@pytest.mark.slow
@SLOW
@given(jko_calls())
def test_jko_argument_contract_slow(call):
    _jko_props(call)


DIST_ASPECTS = ["mu", "nu", "a", "b", "pair", "dtype", "kind", "squared", "metric", "eps", "scaling", "n_projections",
                "seed"]


@st.composite
def distance_calls(draw):
    spoil = _spoil(draw, DIST_ASPECTS)
    x = draw(token_tensors(spoiled=spoil == "mu"))
    y = draw(token_tensors(spoiled=spoil == "nu"))
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 2 and y.dim() >= 2:
        if y.shape[-1] != x.shape[-1] and spoil not in ("mu", "nu"):
            y = tp.sphere.normalize(torch.ones(*y.shape[:-1], x.shape[-1], dtype=torch.float64))
        if spoil != "nu":
            y = y.to(x.dtype)
        if spoil == "dtype":
            y = y.to(torch.float32 if x.dtype == torch.float64 else torch.float64)
        if x.shape[:-2] != y.shape[:-2] and spoil not in ("mu", "nu"):
            y = y.reshape(-1, y.shape[-1])[: y.shape[-2]]  # unbatched: broadcasts against any batch
    a = token_weights(draw, x, spoil == "a")
    b = token_weights(draw, y, spoil == "b")
    mu = x if a is None else (x, a)
    nu = y if b is None else (y, b)
    if spoil == "pair":
        mu = draw(st.sampled_from([(x,), (x, None, None), "mu", {"x": x}]))
    kw = dict(kind=pick(draw, spoil, "kind", st.sampled_from(["w2", "w2", "sinkhorn", "sliced"]), ["mmd", None, 2]),
              squared=pick(draw, spoil, "squared", st.booleans(), [1, "yes", None]),
              metric=pick(draw, spoil, "metric", st.sampled_from(["chordal", "geodesic"]), ["flat", None]),
              eps=pick(draw, spoil, "eps", st.sampled_from([1e-3, 0.1, 1.0, 1e3]),
                       [0.0, -1.0, float("nan"), float("inf"), "1", None]),
              scaling=pick(draw, spoil, "scaling", st.sampled_from([0.5, 0.9]), [0.0, 1.0, 2.0, float("nan"), None]),
              n_projections=pick(draw, spoil, "n_projections", st.integers(1, 20), [0, -1, 1.5, True, None]),
              seed=pick(draw, spoil, "seed", st.integers(0, 100), SEED_BAD))
    # arguments a kind does not use are not checked: spoil only what the kind reads
    uses = {"eps": ("sinkhorn",), "scaling": ("sinkhorn",), "n_projections": ("sliced",), "seed": ("sliced",),
            "metric": ("w2", "sinkhorn")}
    if spoil in uses and kw["kind"] not in uses[spoil]:
        kw["kind"] = uses[spoil][0]
    return spoil, mu, nu, kw


def _distance_props(call):
    spoil, mu, nu, kw = call

    def run():
        v = tp.distance(mu, nu, **kw)
        assert kw["squared"] or bool((v >= 0).all()), f"a distance below 0: {v}"
        return v

    out = contract("distance" if spoil is None else "distance[spoiled]", run)
    if out is not None:
        assert spoil is None, f"spoiled {spoil!r} ran: {kw.get(spoil, '')!r}"


@FAST
@given(distance_calls())
def test_distance_argument_contract(call):
    _distance_props(call)


@pytest.mark.slow
@SLOW
@given(distance_calls())
def test_distance_argument_contract_slow(call):
    _distance_props(call)


# ---------------------------------------------------------------------------- cluster statistics
@st.composite
def statistics_calls(draw):
    spoil = _spoil(draw, ["x", "weights", "radius"])
    x = draw(token_tensors(spoiled=spoil == "x"))
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] >= 2 and spoil is None and draw(st.booleans()):
        x = x.clone()
        x[..., 1, :] = x[..., 0, :]  # coincident tokens
    w = token_weights(draw, x, spoil == "weights")
    radius = pick(draw, spoil, "radius", st.sampled_from([1e-3, 0.1, 0.5, 1.0, 2.0]),
                  [0.0, -0.1, 2.5, float("nan"), float("inf"), "0.1", None, True])
    return spoil, x, w, radius


def _statistics_props(call):
    spoil, x, w, radius = call
    st_ = contract("cluster_statistics" if spoil is None else "cluster_statistics[spoiled]",
                   lambda: tp.clustering.cluster_statistics(x, w, radius=radius))
    pf = contract("pair_fraction", lambda: tp.clustering.pair_fraction(x, radius=radius, weights=w))
    if st_ is None:
        assert spoil is not None, "clean input refused"
        return
    assert spoil is None, f"spoiled {spoil!r} ran"
    # the statistics' ranges (docstrings), also for one-point measures and coincident tokens
    assert bool(((st_["pair_fraction"] >= 0) & (st_["pair_fraction"] <= 1)).all())
    assert bool(((st_["largest_mass"] > 0) & (st_["largest_mass"] <= 1 + 1e-6)).all())
    assert bool((st_["clusters"] >= 1).all()) and bool((st_["clusters"] <= x.shape[-2]).all())
    assert bool((st_["mean_overlap"].abs() <= 1 + 1e-5).all()) and bool((st_["radius"] >= 0).all())
    torch.testing.assert_close(pf, st_["pair_fraction"])
    if w is not None:
        single = (w > 0).sum(-1) == 1  # a Dirac mass: one cluster, pair fraction 1 (docstring)
        assert bool((st_["pair_fraction"][single] == 1).all()) and bool((st_["clusters"][single] == 1).all())


@FAST
@given(statistics_calls())
def test_cluster_statistics_contract(call):
    _statistics_props(call)


@pytest.mark.slow
@SLOW
@given(statistics_calls())
def test_cluster_statistics_contract_slow(call):
    _statistics_props(call)


series_times = st.one_of(
    st.lists(st.floats(-1e3, 1e3), min_size=0, max_size=6).map(sorted),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=6),
    st.sampled_from([[0.0, 1.0, 1.0], [2.0, 1.0, 0.0], [0.0, 1e39], "abc", None, [[0.0, 1.0]]]))


SERIES_ARGS = (series_times, st.integers(0, 2 ** 16), st.sampled_from(GOOD), st.floats(-2, 2),
               st.sampled_from([None, 0.01, 1.0, 0.0, -1.0]))


@FAST
@given(*SERIES_ARGS)
def test_plateaus_and_crossing_contract(times, seed, dtype, level, min_duration):
    _series_props(times, seed, dtype, level, min_duration)


@pytest.mark.slow
@SLOW
@given(*SERIES_ARGS)
def test_plateaus_and_crossing_contract_slow(times, seed, dtype, level, min_duration):
    _series_props(times, seed, dtype, level, min_duration)


def _series_props(times, seed, dtype, level, min_duration):
    T = len(times) if isinstance(times, list) else 3
    y = torch.randn(2, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).cumsum(-1).to(dtype)
    # +inf (never reached) and NaN padding of the staircase are documented values: wrap them away
    def crossing():
        tc = tp.clustering.crossing_time(times, y, level)
        assert not bool(torch.isnan(tc).any()) and not bool((tc == -math.inf).any()), tc
        return torch.where(torch.isinf(tc), torch.zeros_like(tc), tc)

    def plateaus():
        stc = tp.clustering.detect_plateaus(times, y, min_duration=min_duration)
        assert bool((stc.duration[stc.valid] >= 0).all()), stc
        return [stc.start[stc.valid], stc.end[stc.valid], stc.level[stc.valid], stc.threshold]

    contract("crossing_time", crossing)
    contract("detect_plateaus", plateaus)


# ---------------------------------------------------------------------------- (c) the command line
CLI_CONFIG = """\
kind = "ou_vs_oscillating"
name = "tiny"
[params]
regimes = ["ou", "oscillating"]
heads = [1, 2]
n = 3
d = 3
t1 = 0.04
dt = 0.01
record_every = 1
t_avg = 0.01
paths = 1
bootstrap = 10
figures = false
checkpoint_every = 2
"""
CLI_KEYS = ["n", "d", "heads", "t1", "dt", "record_every", "t_avg", "paths", "seed", "noise_seed", "beta",
            "ou_rate", "ou_sigma2", "method", "dtype", "init", "regimes", "bootstrap", "ci_level", "store_paths",
            "checkpoint_every", "normalization", "scheme", "phase", "no_such_key", "", "params.n"]
# small sizes only (resource guards are tested elsewhere); everything else is fair game
CLI_VALUES = st.one_of(
    st.sampled_from(["1", "2", "0", "-1", "2.5", "0.02", "inf", "nan", "-inf", "1e400", "true", "\"x\"", "[1, 2]",
                     "[]", "[1, 1]", "float16", "float32", "rk4", "heun", "uniform", "clustered_circle", "", "é",
                     "99999999999999999999999", "[\"ou\"]", "{a = 1}", "0.04", "\"\\u0000\"", "1e-300"]),
    st.text(max_size=6))


def _snapshot(root: Path):
    return {str(p.relative_to(root)): (p.is_symlink(), p.is_dir()) for p in sorted(root.rglob("*"))}


def _cli_props(pairs, tmp: Path):
    from transformer_pde.application.cli import main

    (tmp / "cfg").mkdir()
    cfg = tmp / "cfg" / "tiny.toml"
    cfg.write_text(CLI_CONFIG)
    work = tmp / "work"
    work.mkdir()
    before_cfg, before_work = _snapshot(tmp / "cfg"), _snapshot(work)
    argv = ["run", str(cfg), "--out", str(tmp / "out"), "--name", "r", "--no-progress", "-qq"]
    for k, v in pairs:
        argv += ["-o", f"{k}={v}"]
    cwd = os.getcwd()
    os.chdir(work)  # anything written relative to the working directory would land here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with time_limit(HANG_S):
                rc = main(argv)
    finally:
        os.chdir(cwd)
    TRIED["cli"][f"exit {rc}"] += 1
    assert rc in (0, 1, 2, 3), f"undocumented exit code {rc} for {argv}"
    assert _snapshot(tmp / "cfg") == before_cfg, "the config's folder changed"
    assert _snapshot(work) == before_work, f"files written in the working directory: {_snapshot(work)}"
    outside = [p for p in tmp.iterdir() if p.name not in ("cfg", "work", "out")]
    assert not outside, f"written next to the run parent: {outside}"
    if (tmp / "out").exists():
        stray = [p for p in (tmp / "out").iterdir() if p.name != "r"]
        assert not stray, f"written in --out beside the run directory: {stray}"
        links = [p for p in (tmp / "out").rglob("*") if p.is_symlink()]
        assert not links, f"links in the run directory: {links}"
    if rc == 2:  # refused before anything ran: nothing written at all
        assert not (tmp / "out").exists(), f"exit 2 (refused) but {tmp / 'out'} was created"
    if rc == 0:
        metrics = json.loads((tmp / "out" / "r" / "metrics.json").read_text(),
                             parse_constant=lambda c: pytest.fail(f"metrics.json holds {c}"))
        assert metrics


@settings(FAST, max_examples=15)
@given(st.lists(st.tuples(st.sampled_from(CLI_KEYS), CLI_VALUES), min_size=1, max_size=2))
def test_cli_writes_only_its_run_directory(pairs):
    with tempfile.TemporaryDirectory() as tmp:
        _cli_props(pairs, Path(tmp))


@pytest.mark.slow
@settings(FAST, max_examples=150)
@given(st.lists(st.tuples(st.sampled_from(CLI_KEYS), CLI_VALUES), min_size=1, max_size=3))
def test_cli_writes_only_its_run_directory_slow(pairs):
    with tempfile.TemporaryDirectory() as tmp:
        _cli_props(pairs, Path(tmp))


# ---------------------------------------------------------------------------- what the fuzz found, pinned
@pytest.mark.parametrize("kind", [["demo"], {"a": 1}, 3, None])
def test_a_kind_that_is_not_a_string_is_refused(kind, tmp_path):
    """A TOML kind that is not a string (found by test_config_dict_contract) is refused with a
    ValueError, not the registry lookup's TypeError "unhashable type: 'list'"."""
    from transformer_pde.application.config import load_config

    with pytest.raises(ValueError, match="kind.? must be a string"):
        load_config({"kind": kind})
    if kind is not None:
        path = tmp_path / "c.toml"
        path.write_text(f"kind = {toml_value(kind)}\n")
        with pytest.raises(ValueError, match="kind.? must be a string"):
            load_config(path)


@pytest.mark.parametrize("flag", ["diagnostics", "adjoint", "return_path"])
def test_simulate_flags_must_be_bools(flag):
    """Found by test_simulate_argument_contract: diagnostics="yes" ran (a truthy string taken for True)."""
    x = tp.sphere.octahedral(4, dtype=torch.float64)
    h = tp.Heads.scalar([1.0], 3).to(torch.float64)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=flag):
            tp.simulate(x, h, t1=0.1, dt=0.1, **{flag: bad})


def test_jko_flags_must_be_bools():
    x = tp.sphere.octahedral(4, dtype=torch.float64)
    h = tp.Heads.scalar([1.0], 3).to(torch.float64)
    for flag, bad in (("diagnostics", "yes"), ("diagnostics", None), ("progress", "yes"), ("progress", 1)):
        with pytest.raises(TypeError, match=flag):
            tp.jko(x, h, tau=0.1, steps=1, **{flag: bad})


def test_zz_report_counts(capsys):
    """Prints how many inputs each entry point was given in this test run and how they ended."""
    with capsys.disabled():
        for name in sorted(TRIED):
            c = TRIED[name]
            print(f"\n[fuzz] {name}: {sum(c.values())} inputs: {dict(c)}", end="")
            if os.environ.get("FUZZ_MESSAGES"):
                for m in sorted(MESSAGES[name]):
                    print(f"\n    {m}", end="")
