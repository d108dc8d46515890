"""E, 𝒢², 𝒟 at the recorded times from the records alone (transformer_pde.solvers.recorded) and the lazy
series of a Trajectory (transformer_pde.solvers.trajectory.lazy_series).

The values computed after the solve, vectorised over the records, must be those the per-step solve
records: checked against tp.simulate(..., diagnostics=True) and against a per-record evaluation (one
record and one set of heads at a time, no folding of the records into the batch), for every model
option that changes them; against the dense naive formulas of tests/problems.py; and in their
gradients.  The lazy Trajectory computes its source at most once, through copies and pickling."""

import io
import pickle

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import naive_dissipation, naive_energy, naive_slope, random_weights
from transformer_pde.model.field import evaluate
from transformer_pde.dynamics.layernorm import geometry_densities
from transformer_pde.solvers.recorded import RecordedDiagnostics, RecordedHeads, records_per_chunk, stack_heads
from transformer_pde.solvers.trajectory import NonFiniteError, Trajectory, lazy_series

SERIES = ("energy", "slope", "dissipation")


def close(a, b, dtype, ulps=64):
    """Two evaluations of the same sums in another order / batch layout: a few ulps of the largest value."""
    eps = torch.finfo(dtype).eps
    scale = float(b.detach().abs().max()) if b.numel() else 1.0
    assert_close(a, b, rtol=ulps * eps, atol=ulps * eps * max(scale, 1e-30))


def problem(dtype, n=6, d=3, H=2, batch=(2,), seed=0):
    x0 = tp.sphere.sample_uniform(n, d, batch_shape=batch, generator=gen(seed), dtype=dtype)
    heads = tp.Heads.random(H, d, generator=gen(seed + 1), dtype=dtype)
    return x0, heads


def model_of(theta, kw):
    """The Model that tp.simulate builds from these keywords."""
    return tp.Model(theta, normalization=kw.get("normalization", "softmax"), direction=kw.get("direction", "ascent"),
                    layer_norm=kw.get("layer_norm", "none"), temperature=kw.get("temperature") or 0.0, weights=kw.get("weights"),
                    causal=kw.get("causal", False))


def heads_at_records(theta, traj):
    """Θ at the recorded times: the constant heads, the closed form, or the realised path (return_path=True)."""
    if isinstance(theta, tp.Heads):
        return RecordedHeads(theta)
    # a closed form at the times themselves (a stored path keeps the first heads' values, head weights and β)
    return RecordedHeads.at_times(theta if theta.closed_form else traj.path, traj.times)


def per_record(model, traj, rec, c):
    """The per-step evaluation of the eager solve, one record at a time (no folding of records into the batch)."""
    out = {k: [] for k in SERIES}
    sign = 1.0 if model.direction == "ascent" else -1.0
    radius = traj.extras.get("radius")
    for k in range(len(traj.times)):
        h = rec.constant if rec.constant is not None else rec.items[k]
        e = evaluate(traj.x[k], h, model.weights, normalization=model.normalization, sign=sign, diagnostics=True,
                     log_scale=c, **({"causal": model.causal} if model.causal else {}))
        D, G = (e.dissipation, e.slope) if model.layer_norm.projected else geometry_densities(
            model.layer_norm, e, h, model.weights, None if radius is None else radius[k], c)
        for key, v in zip(SERIES, (e.energy, G, D)):
            out[key].append(v)
    return {k: torch.stack(v) for k, v in out.items()}


def _osc(h):
    return tp.Oscillating(h)


def _ou(h):
    return tp.OrnsteinUhlenbeck(h, sigma=0.7)


def _layerwise(h):
    return tp.Layerwise([h, tp.Heads(2 * h.score_matrix)], layer_time=0.2)


def _layerwise_beta(h):
    """Layers whose β (floats), head weights and untied values differ: every field of the heads is stacked."""
    A = h.score_matrix
    second = tp.Heads(A.flip(-1), 0.5 * A, weights=torch.tensor([0.7, 0.3], dtype=A.dtype), beta=1.7)
    return tp.Layerwise([h, second, tp.Heads(A, beta=0.6)], layer_time=0.2, interpolation="linear")


CASES = {  # name: (theta builder, simulate keywords)
    "constant": (None, {}),
    "ou_paths": (_ou, {"paths": 3, "seed": 4}),
    "ou_no_paths": (_ou, {"seed": 5}),
    "oscillating": (_osc, {}),
    "layerwise_jumps": (_layerwise, {"method": "heun"}),
    "layerwise_beta": (_layerwise_beta, {"normalization": "unnormalized"}),
    "causal": (None, {"causal": True, "normalization": "unnormalized"}),
    "causal_sum": (_osc, {"causal": "sum", "normalization": "relu"}),
    "post_ln": (None, {"layer_norm": "post"}),
    "pre_ln": (_osc, {"layer_norm": "pre"}),
    "peri_ln": (None, {"layer_norm": "peri"}),
    "temperature": (None, {"temperature": 0.3, "paths": 2}),
    "record_every": (_ou, {"record_every": 3, "paths": 2, "method": "rk4"}),
    "token_weights": (None, {"weights": "random", "direction": "ascent"}),
    "effective": (_osc, {"normalization": "effective", "method": "heun"}),
    "log_scale": (None, {"energy_log_scale": 3.5}),
    "adaptive": (_osc, {"method": "adaptive", "rtol": 1e-6, "atol": 1e-8}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recorded_values_equal_the_eager_solve(case, dtype):
    build, kw = CASES[case]
    kw = dict(kw)
    x0, heads = problem(dtype)
    if kw.get("weights") == "random":
        kw["weights"] = random_weights((2, 6), seed=3, floor=0.2).to(dtype)
    theta = heads if build is None else build(heads)
    traj = tp.simulate(x0, theta, t1=0.6, dt=0.05, diagnostics=True, ledger=True,
                       return_path=not isinstance(theta, tp.Heads) and kw.get("method") != "adaptive", **kw)
    model = model_of(theta, kw)
    rec = heads_at_records(theta, traj)
    given = kw.get("energy_log_scale")
    src = RecordedDiagnostics(model, traj.x, rec, log_scale=given, radius=traj.extras.get("radius"),
                              times=traj.times)
    assert src.log_scale == traj.stats["energy_log_scale"]  # chosen at the first record as the solve does at t0
    got = src()
    ref = per_record(model, traj, rec, src.log_scale)
    for key in SERIES:
        assert got[key].shape == getattr(traj, key).shape, key
        assert got[key].dtype == dtype
        close(got[key], getattr(traj, key), dtype)
        close(got[key], ref[key], dtype)
    # the values change with the model: a check that compared a quantity with itself would not see this
    if case in ("causal", "token_weights", "effective", "pre_ln"):
        plain = RecordedDiagnostics(tp.Model(theta), traj.x, rec)()
        assert float((plain["slope"] - got["slope"]).abs().max()) > 1e-4 * float(got["slope"].abs().max())


@pytest.mark.parametrize("dtype_", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_automatic_scale_at_large_beta_matches_the_solve(dtype_):
    """β‖A‖ beyond half the dtype's exponent range: the solve reports times e^{−c} with c chosen at t0; the
    records give the same c (from the first record) and the same scaled values."""
    x0, heads = problem(dtype_)
    big = tp.Heads(heads.score_matrix, beta=60.0 if dtype_ == torch.float32 else 420.0)
    traj = tp.simulate(x0, big, t1=0.3, dt=0.05, diagnostics=True, ledger=True)
    assert traj.stats["energy_log_scale"] > 0
    src = RecordedDiagnostics(tp.Model(big), traj.x, big)
    assert src.log_scale == traj.stats["energy_log_scale"]
    ref = per_record(tp.Model(big), traj, RecordedHeads(big), src.log_scale)
    for key in SERIES:
        close(src()[key], getattr(traj, key), dtype_, ulps=256)
        close(src()[key], ref[key], dtype_, ulps=256)


def test_recorded_values_match_the_naive_formulas(dtype):
    """E, 𝒢², 𝒟 of every record against the dense einsum formulas of tests/problems.py (no kernel pass)."""
    x0, heads = problem(dtype, batch=(3,))
    w = random_weights((3, 6), seed=2, floor=0.1).to(dtype)
    theta = tp.Oscillating(heads)
    traj = tp.simulate(x0, theta, t1=0.4, dt=0.1, weights=w, diagnostics=False)
    got = RecordedDiagnostics(tp.Model(theta, weights=w, direction="descent"), traj.x,
                              RecordedHeads.at_times(theta, traj.times))()
    omega = heads.weights
    for k, t in enumerate(traj.times):
        A = theta.heads_at(float(t)).score_matrix
        args = (traj.x[k].double(), A.double(), omega.double(), 1.0, w.double())
        kw = dict(sign=-1.0)
        close(got["energy"][k].double(), naive_energy(*args), dtype)
        close(got["slope"][k].double(), naive_slope(*args, **kw), dtype)
        close(got["dissipation"][k].double(), naive_dissipation(*args, **kw), dtype)


def test_record_chunks_do_not_change_the_values(dtype):
    """One record per evaluation (a tiny memory cap) or all at once: the same numbers."""
    x0, heads = problem(dtype)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    traj = tp.simulate(x0, theta, t1=0.5, dt=0.05, paths=2, diagnostics=False, return_path=True)
    rec = RecordedHeads.at_times(traj.path, traj.times)
    assert records_per_chunk(4, 2, 6, 3, chunk_elements=1) == 1
    assert records_per_chunk(4, 2, 6, 3, chunk_elements=4 * 2 * 36 * 5) == 5
    one = RecordedDiagnostics(tp.Model(theta), traj.x, rec, chunk_elements=1)()
    many = RecordedDiagnostics(tp.Model(theta), traj.x, rec, chunk_elements=1 << 30)()
    for key in SERIES:
        close(one[key], many[key], dtype)


def test_stacked_heads_keep_values_factors_and_beta(dtype):
    """Records whose heads differ in every field (scores, untied values, head weights, β): the stacked Heads
    broadcast against (t, *S, n, d) and give each record its own heads."""
    d, H = 3, 2
    hs = []
    for k in range(3):
        A = torch.randn(H, d, d, generator=gen(k), dtype=dtype)
        V = torch.randn(H, d, d, generator=gen(10 + k), dtype=dtype)
        hs.append(tp.Heads(A, V, weights=torch.tensor([1.0 + k, 2.0], dtype=dtype), beta=1.0 + 0.5 * k))
    x = tp.sphere.sample_uniform(5, d, batch_shape=(3, 2, 4), generator=gen(7), dtype=dtype)  # (t, P, B, n, d)
    st = stack_heads(hs, batch_rank=2)
    assert st.score.shape == (3, 1, 1, H, d, d) and st.weights.shape == (3, 1, 1, H)
    got = evaluate(x, st, None, sign=-1.0, diagnostics=True)
    for k in range(3):
        ref = evaluate(x[k], hs[k], None, sign=-1.0, diagnostics=True)
        close(got.energy[k], ref.energy, dtype)
        close(got.dissipation[k], ref.dissipation, dtype)
    assert stack_heads([hs[0]] * 3, batch_rank=2) is hs[0]  # constant heads are not copied


def test_gradients_through_recorded_energy_equal_the_eager_ones(dtype):
    """d(Σ E(t_k))/dx0 and d/dA through the lazy values equal those through the eagerly recorded ones."""
    x0, heads = problem(dtype)
    A = heads.score_matrix.detach().clone()

    def run():
        xr = x0.clone().requires_grad_(True)
        Ar = A.clone().requires_grad_(True)
        h = tp.Heads(Ar)
        return xr, Ar, h, tp.simulate(xr, h, t1=0.3, dt=0.05, diagnostics=True, ledger=True)

    xr, Ar, h, traj = run()
    ge = torch.autograd.grad((traj.energy.sum() + traj.dissipation.sum()), (xr, Ar))
    xr2, Ar2, h2, traj2 = run()
    with torch.no_grad():  # first read without autograd: the values still carry the solve's graph
        lazy = RecordedDiagnostics(tp.Model(h2), traj2.x, h2)()
    gl = torch.autograd.grad((lazy["energy"].sum() + lazy["dissipation"].sum()), (xr2, Ar2))
    xr3, Ar3, h3, traj3 = run()
    one = per_record(tp.Model(h3), traj3, RecordedHeads(h3), 0.0)  # one record at a time
    gr = torch.autograd.grad((one["energy"].sum() + one["dissipation"].sum()), (xr3, Ar3))
    for a, b, r in zip(gl, ge, gr):
        assert float(b.abs().max()) > 0
        close(a, b, dtype, ulps=512)
        close(a, r, dtype, ulps=512)


# ---------------------------------------------------------------------------- the lazy Trajectory
class Counting:
    def __init__(self, values):
        self.values, self.calls = values, 0

    def __call__(self):
        self.calls += 1
        return self.values


def lazy_trajectory(dtype, paths=None):
    x0, heads = problem(dtype)
    eager = tp.simulate(x0, heads, t1=0.3, dt=0.05, paths=paths, diagnostics=True, ledger=True)
    src = RecordedDiagnostics(tp.Model(heads), eager.with_paths().x, heads)
    counter = Counting(src())
    series = lazy_series(counter)
    if paths is None:  # the solver computes with the paths axis and drops it at the end
        series = tuple(s.map(lambda v: v.squeeze(1)) for s in series)
    traj = Trajectory(eager.times, eager.x, *series, None, dict(eager.stats), "euler", "softmax", "descent",
                      paths=paths)
    return eager, traj, counter


@pytest.mark.parametrize("paths", [None, 2])
def test_lazy_trajectory_computes_once_through_copies_and_pickling(paths, dtype):
    eager, traj, counter = lazy_trajectory(dtype, paths)
    assert traj.lazy and "energy=lazy" in repr(traj)
    wp = traj.with_paths()
    assert counter.calls == 0  # building copies computes nothing
    close(wp.energy, eager.with_paths().energy, dtype)
    assert counter.calls == 1
    for key in SERIES:
        close(getattr(traj, key), getattr(eager, key), dtype)
    close(traj.log_energy(), eager.log_energy(), dtype)
    buf = io.BytesIO()
    torch.save(traj, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert not back.lazy and back.paths == paths
    for key in SERIES:
        close(getattr(back, key), getattr(eager, key), dtype)
    assert counter.calls == 1


def test_pickling_a_lazy_trajectory_stores_tensors_not_the_source(dtype):
    """The source holds the model (a Custom drift may be a lambda): pickling computes the series first and
    never pickles the source."""
    eager, traj, counter = lazy_trajectory(dtype)
    counter.unpicklable = lambda: None  # a lambda: pickling the source would fail
    back = pickle.loads(pickle.dumps(traj))
    close(back.dissipation, eager.dissipation, dtype)
    assert counter.calls == 1


def test_ledger_not_booked_raises_with_the_fix(dtype):
    eager, traj, _ = lazy_trajectory(dtype)
    assert not traj.has_ledger and eager.has_ledger
    with pytest.raises(ValueError, match=r"ledger=True"):
        traj.ledger
    with pytest.raises(ValueError, match=r"LedgerOptions\(ledger=True\)"):
        traj.with_paths().ledger
    assert set(eager.ledger) >= {"dE", "residual"}  # an eager run still has its ledger


def test_eager_trajectory_round_trips_through_pickle(dtype):
    eager, _, _ = lazy_trajectory(dtype, paths=2)
    back = pickle.loads(pickle.dumps(eager))
    for key in SERIES:
        close(getattr(back, key), getattr(eager, key), dtype)
    for key in eager.ledger:
        close(back.ledger[key], eager.ledger[key], dtype)


def test_source_is_computed_once(dtype):
    x0, heads = problem(dtype)
    traj = tp.simulate(x0, heads, t1=0.2, dt=0.05, diagnostics=False)
    src = RecordedDiagnostics(tp.Model(heads), traj.x, heads)
    t = Trajectory(traj.times, traj.x, *lazy_series(src), None, {}, "euler", "softmax", "descent")
    t.energy, t.slope, t.with_paths().dissipation, t.dissipation
    assert src.calls == 1


# ---------------------------------------------------------------------------- refusals and errors
def test_refusals_before_any_work(dtype):
    x0, heads = problem(dtype)
    traj = tp.simulate(x0, tp.Oscillating(heads), t1=0.2, dt=0.05, diagnostics=False)
    rec = RecordedHeads.at_times(tp.Oscillating(heads), traj.times[:-1])
    with pytest.raises(ValueError, match="4 recorded heads for 5"):
        RecordedDiagnostics(tp.Model(tp.Oscillating(heads)), traj.x, rec)
    with pytest.raises(ValueError, match="radii"):
        RecordedDiagnostics(tp.Model(heads, layer_norm="pre"), traj.x, heads)
    with pytest.raises(TypeError, match="RecordedHeads or a Heads"):
        RecordedDiagnostics(tp.Model(heads), traj.x, [heads])
    with pytest.raises(TypeError, match="not a transformer_pde.Heads"):
        RecordedHeads([heads, "A"])
    with pytest.raises(ValueError, match="constant"):
        RecordedHeads(heads).append(heads)


def test_non_finite_record_names_its_time(dtype):
    x0, heads = problem(dtype)
    traj = tp.simulate(x0, heads, t1=0.2, dt=0.05, diagnostics=False)
    x = traj.x.clone()
    x[3, 1, 2] = float("nan")
    src = RecordedDiagnostics(tp.Model(heads), x, heads, times=traj.times, steps=[0, 1, 2, 3, 4], chunk_elements=1)
    with pytest.raises(NonFiniteError, match=r"t = 0\.15 \(step 3\)"):
        src()


def test_recorded_heads_state_round_trips(dtype):
    """What a checkpoint stores of the recorded heads restores the same values."""
    x0, heads = problem(dtype)
    theta = tp.OrnsteinUhlenbeck(heads, sigma=0.5)
    traj = tp.simulate(x0, theta, t1=0.3, dt=0.05, paths=2, diagnostics=False, return_path=True)
    rec = RecordedHeads()
    for t in traj.times:
        rec.append(traj.path.heads_at(float(t)))
    buf = io.BytesIO()
    torch.save(rec.state(), buf)
    buf.seek(0)
    back = RecordedHeads(torch.load(buf, weights_only=False))
    a = RecordedDiagnostics(tp.Model(theta), traj.x, rec)()
    b = RecordedDiagnostics(tp.Model(theta), traj.x, back)()
    for key in SERIES:
        close(a[key], b[key], dtype)


def test_pickles_of_the_plain_attribute_layout_load(dtype):
    """A Trajectory pickled before the series were properties (attributes energy, ..., ledger) loads."""
    eager, _, _ = lazy_trajectory(dtype)
    old = {k.lstrip("_"): v for k, v in eager.__getstate__().items()}
    assert "energy" in old and "ledger" in old
    back = object.__new__(Trajectory)
    back.__setstate__(old)
    close(back.energy, eager.energy, dtype)
    close(back.ledger["dE"], eager.ledger["dE"], dtype)


def test_non_finite_record_names_its_step_within_a_chunk(dtype):
    """A NaN at the third record of one chunk of records (steps recorded every 3rd): the message names that
    record's time and step, with or without the times, and with a given scale."""
    x0, heads = problem(dtype)
    traj = tp.simulate(x0, heads, t1=0.2, dt=0.05, diagnostics=False)
    x = traj.x.clone()
    x[2, 0, 1] = float("nan")
    steps = [0, 3, 6, 9, 12]
    src = RecordedDiagnostics(tp.Model(heads), x, heads, times=traj.times, steps=steps, chunk_elements=1 << 30)
    with pytest.raises(NonFiniteError, match=r"t = 0\.1 \(step 6\)"):
        src()
    given = RecordedDiagnostics(tp.Model(heads), x, heads, log_scale=0.0, steps=steps)
    with pytest.raises(NonFiniteError, match=r"t = nan \(step 6\).*given"):
        given()


def test_non_finite_radius_names_the_dissipation(dtype):
    """A layer map's radius NaN at one record (the tokens finite): the energy is finite there, 𝒟 is not, and
    the message names the dissipation."""
    x0, heads = problem(dtype)
    traj = tp.simulate(x0, heads, t1=0.2, dt=0.05, diagnostics=False, layer_norm="pre")
    radius = traj.extras["radius"].clone()
    radius[1, 0, 0] = float("nan")
    model = tp.Model(heads, layer_norm="pre")
    src = RecordedDiagnostics(model, traj.x, heads, radius=radius, times=traj.times)
    with pytest.raises(NonFiniteError, match=r"the dissipation 𝒟 at the recorded time became NaN/inf at t = 0\.05"):
        src()


def test_stacked_query_key_factors_give_each_record_its_heads(dtype):
    """Records with their own low-rank factors A = Qᵀ K: the stacked heads keep the factors, and each record
    gets its own heads (against one evaluation per record)."""
    d, H, r = 3, 2, 2
    hs = [tp.Heads(query=torch.randn(H, r, d, generator=gen(k), dtype=dtype),
                   key=torch.randn(H, r, d, generator=gen(20 + k), dtype=dtype)) for k in range(3)]
    x = tp.sphere.sample_uniform(5, d, batch_shape=(3, 2), generator=gen(8), dtype=dtype)
    st = stack_heads(hs, batch_rank=1)
    assert st.score is None and st.query.shape == (3, 1, H, r, d)
    got = evaluate(x, st, None, sign=1.0, diagnostics=True)
    for k in range(3):
        ref = evaluate(x[k], hs[k], None, sign=1.0, diagnostics=True)
        close(got.energy[k], ref.energy, dtype)
        close(got.slope[k], ref.slope, dtype)
        close(got.dissipation[k], ref.dissipation, dtype)


def test_stacked_heads_keep_a_shared_beta_and_the_symmetry(dtype):
    """Equal float β's of the records (distinct objects) stay one float; records declared symmetric stay so;
    records known NOT symmetric are never declared symmetric (their values equal the per-record ones)."""
    d, H = 3, 2
    betas = [float(s) for s in ("1.25", "1.25", "1.25")]
    sym = [tp.Heads.random(H, d, generator=gen(k), dtype=dtype).replace(beta=b, symmetric=True)
           for k, b in enumerate(betas)]
    st = stack_heads(sym, batch_rank=1)
    assert isinstance(st.beta, float) and st.beta == 1.25
    assert st.known_symmetric is True
    asym = [tp.Heads.random(H, d, symmetric=False, generator=gen(30 + k), dtype=dtype) for k in range(3)]
    assert not any(h.is_symmetric for h in asym)  # cached: known not symmetric
    st = stack_heads(asym, batch_rank=1)
    assert st.known_symmetric is not True
    x = tp.sphere.sample_uniform(5, d, batch_shape=(3, 2), generator=gen(9), dtype=dtype)
    got = evaluate(x, st, None, sign=1.0, diagnostics=True)
    for k in range(3):
        ref = evaluate(x[k], asym[k], None, sign=1.0, diagnostics=True)
        close(got.energy[k], ref.energy, dtype)
        close(got.dissipation[k], ref.dissipation, dtype)


@pytest.mark.parametrize("dtype_", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_automatic_scale_with_token_weights_matches_the_solve(dtype_):
    """Large β with very uneven token weights: c is chosen from the weighted log-partitions at the first
    record, as the solve does at t0 (uniform weights would give another c)."""
    x0, heads = problem(dtype_)
    big = tp.Heads(heads.score_matrix, beta=60.0 if dtype_ == torch.float32 else 420.0)
    w = torch.tensor([1e-12, 1e-12, 1e-12, 1e-12, 1e-12, 1.0], dtype=dtype_).expand(2, 6)
    traj = tp.simulate(x0, big, t1=0.1, dt=0.05, weights=w, diagnostics=True, ledger=True)
    model = tp.Model(big, weights=w)
    src = RecordedDiagnostics(model, traj.x, big)
    assert src.log_scale == traj.stats["energy_log_scale"] > 0
    assert src.log_scale != RecordedDiagnostics(tp.Model(big), traj.x, big).log_scale
    for key in SERIES:
        close(src()[key], getattr(traj, key), dtype_, ulps=256)
