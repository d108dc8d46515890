"""The JKO schemes through tp.solve and the solver objects; Θ_t through the WeightDriver; the batch axes.

* tp.solve(Model, x0, LagrangianJKO / EulerianJKO, ..., ledger=tp.LedgerOptions(ledger=True)) equals tp.jko with the matching keywords (the
  keyword front end is a wrapper over the objects: the two must not drift apart);
* options a JKO scheme does not take are refused with TypeError before any step;
* the geometry seam: the Lagrangian line search retracts with ``model.layer_norm.retract``;
* a noisy process is sampled by the driver as the steps go: the run equals the run fed the WeightPath that
  tp.sample_path gives with the same seed (also with path_dt < τ, and with a paths axis), and ``traj.path`` is
  that path;
* batch axes: the paths axis stands in front of the measure's batch (x0 batched and paths= together).
"""

import dataclasses

import pytest
import torch

import transformer_pde as tp
from conftest import gen

F64 = torch.float64


def tokens(n, d, seed, dtype=F64):
    return tp.sphere.sample_uniform(n, d, generator=gen(seed), dtype=F64).to(dtype)


def rand_heads(H, d, seed, dtype=F64):
    return tp.Heads.random(H, d, generator=gen(seed), dtype=F64, scale=0.6).to(dtype)


def close(a, b, dtype):
    """Equal to the round-off of a few JKO steps in ``dtype`` (the same computation, possibly reordered)."""
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def same_run(a, b, dtype):
    close(a.x, b.x, dtype)
    close(a.times, b.times, dtype)
    for key in ("energy", "slope", "dissipation"):
        close(getattr(a, key), getattr(b, key), dtype)
    for key in a.ledger:
        close(a.ledger[key], b.ledger[key], dtype)
    close(a.stats["prox"], b.stats["prox"], dtype)
    assert a.stats["iterations"].tolist() == b.stats["iterations"].tolist()
    assert a.method == b.method and a.normalization == b.normalization and a.extras["tau"] == b.extras["tau"]
    if a.weights is None:
        assert b.weights is None
    else:
        close(a.weights, b.weights, dtype)


# ---------------------------------------------------------------------------- objects = keywords
LAGRANGIAN = [
    (dict(transport="emd"), tp.EMD(), {}),
    (dict(transport="emd", cost="symmetric"), tp.EMD("symmetric"), {}),
    (dict(transport="identity", mobility="unit"), tp.Identity(), dict(normalization="unnormalized")),
    (dict(transport="identity", direction="ascent"), tp.Identity(), dict(direction="ascent")),
    (dict(transport="sinkhorn", eps=1e-2), tp.SinkhornTransport(1e-2), {}),
]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kw,transport,model_kw", LAGRANGIAN)
def test_lagrangian_objects_equal_the_keywords(dtype, kw, transport, model_kw):
    x = tokens(8, 3, 1, dtype)
    heads = rand_heads(2, 3, 2, dtype)
    w = torch.softmax(torch.randn(8, generator=gen(3), dtype=F64), -1).to(dtype)
    a = tp.jko(x, heads, tau=0.05, steps=3, weights=w, max_iter=150, **kw)
    model = tp.Model(heads, **{"normalization": "effective", **model_kw}, weights=w)
    b = tp.solve(model, x, tp.LagrangianJKO(transport, tp.RiemannianLBFGS(max_iter=150)), t1=0.15, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, dtype)
    assert b.x.dtype == dtype


@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_eulerian_objects_equal_the_keywords(temperature):
    z = tp.sphere.circle_grid(24, dtype=F64)
    x = tokens(10, 2, 4)
    heads = tp.Heads.scalar([1.0, 2.0], 2).to(F64)
    a = tp.jko(x, heads, tau=0.1, steps=2, scheme="eulerian", grid=z, eps=0.02, bandwidth=0.4,
               temperature=temperature, record_every=2)
    b = tp.solve(tp.Model(heads, normalization="effective", temperature=temperature), x,
                 tp.EulerianJKO(grid=z, eps=0.02, bandwidth=0.4), t1=0.2, dt=0.1, saveat=tp.SaveAt(record_every=2), ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, F64)
    assert a.x.shape == (2, 24, 2) and b.weights.shape == (2, 24)


def test_softmax_model_is_solved_with_the_effective_mobility():
    """normalization "softmax" has jko_mobility "effective" (equal for one head): the same run as "effective"."""
    x, heads = tokens(6, 3, 5), rand_heads(1, 3, 6)
    a = tp.solve(tp.Model(heads, normalization="softmax"), x, tp.LagrangianJKO(tp.Identity()), t1=0.1, dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    b = tp.jko(x, heads, tau=0.05, steps=2, transport="identity")
    same_run(a, b, F64)


# ---------------------------------------------------------------------------- refused options
def test_options_a_jko_scheme_does_not_take_are_refused_before_any_step(tmp_path):
    x, heads = tokens(5, 3, 7), rand_heads(2, 3, 8)
    calls = []
    progress = tp.Progress(callback=lambda k, t, s: calls.append(k))
    model = tp.Model(heads, normalization="effective")
    solver = tp.LagrangianJKO()
    bad = [
        dict(checkpoint=tp.Checkpointing(tmp_path / "ck.pt")),
        dict(ledger=tp.LedgerOptions(ledger=True, quadrature="trapezoid")),
        dict(ledger=tp.LedgerOptions(ledger=True, quadratic_variation="realised")),
        dict(ledger=tp.LedgerOptions(energy_log_scale=1.0)),
        dict(saveat=tp.SaveAt(observables={"m": lambda x, w: x.mean(-2)})),
        dict(saveat=tp.SaveAt(path=True)),
        dict(limits=tp.Limits(chunk_elements=1000)),
    ]
    for kw in bad:
        with pytest.raises(TypeError):
            tp.solve(model, x, solver, t1=0.1, dt=0.05, progress=progress, **kw)
        with pytest.raises(TypeError):  # and by the solver's run called directly
            solver.run(model, x, tp.SolveOptions(t1=0.1, dt=0.05, progress=progress, **kw))
    for m, s in [(tp.Model(heads, normalization="relu"), solver),
                 (tp.Model(heads, normalization="unnormalized", causal=True), solver),
                 (tp.Model(heads, normalization="effective", layer_norm="post"), solver),
                 (tp.Model(heads, normalization="effective", temperature=0.1), solver),
                 (tp.Model(heads, normalization="effective", weights=torch.full((5,), 0.2, dtype=F64)),
                  tp.EulerianJKO(grid=20))]:
        with pytest.raises(ValueError):
            tp.solve(m, x, s, t1=0.1, dt=0.05, progress=progress, ledger=tp.LedgerOptions(ledger=True))
    assert calls == []
    with pytest.raises(TypeError, match="tp.Model"):
        solver.run(heads, x, tp.SolveOptions(t1=0.1, dt=0.05))
    with pytest.raises(TypeError, match="tp.SolveOptions"):
        solver.run(model, x, dict(t1=0.1, dt=0.05))


def test_jko_keyword_errors_are_worded_in_its_keywords():
    """The wrapper checks its keywords before it builds the objects: the messages name jko's arguments."""
    x, heads = tokens(5, 3, 9), rand_heads(2, 3, 10)
    cases = [
        (dict(tol=-1.0), ValueError, "tol must be"),
        (dict(path_dt=0.0), ValueError, "path_dt must be"),
        (dict(max_memory="lots"), TypeError, "max_memory must be"),
        (dict(max_steps=2.5), TypeError, "max_steps must be an int"),
        (dict(weights=[0.2] * 5), TypeError, "weights must be a torch.Tensor"),
        (dict(scheme="eulerian", grid="fine"), TypeError, "grid must be a tensor"),
        (dict(scheme="eulerian", grid=20, weights=torch.full((5,), 0.2, dtype=F64)), ValueError,
         "weights= are token weights"),
        (dict(temperature=0.1), ValueError, "needs scheme='eulerian'"),
        (dict(sinkhorn_scaling=1.0), ValueError, "sinkhorn_scaling must lie in"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            tp.jko(x, heads, tau=0.05, steps=2, **kw)


# ---------------------------------------------------------------------------- the geometry seam
def test_the_lagrangian_line_search_retracts_with_the_models_geometry():
    @dataclasses.dataclass(frozen=True)
    class Counting(tp.dynamics.layernorm.Projected):
        calls: list = dataclasses.field(default_factory=list)

        def retract(self, x):
            self.calls.append(tuple(x.shape))
            return super().retract(x)

    x, heads = tokens(6, 3, 11), rand_heads(2, 3, 12)
    geometry = Counting()
    a = tp.solve(tp.Model(heads, normalization="effective", layer_norm=geometry), x, tp.LagrangianJKO(), t1=0.1,
                 dt=0.05, ledger=tp.LedgerOptions(ledger=True))
    assert len(geometry.calls) > 2 and all(s[-2:] == (6, 3) for s in geometry.calls)
    same_run(a, tp.jko(x, heads, tau=0.05, steps=2), F64)


# ---------------------------------------------------------------------------- Θ_t through the driver
@pytest.mark.parametrize("paths", [None, 2])
@pytest.mark.parametrize("path_dt", [None, 0.025])
def test_noisy_ou_run_equals_the_run_fed_the_path_sample_path_gives(paths, path_dt):
    x = tokens(6, 3, 13)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 14), sigma=0.8)
    a = tp.jko(x, proc, tau=0.05, steps=3, transport="identity", seed=7, paths=paths, path_dt=path_dt)
    path = tp.sample_path(proc, t1=0.15, dt=path_dt or 0.05, seed=7, paths=paths)
    b = tp.jko(x, path, tau=0.05, steps=3, transport="identity")
    same_run(a, b, F64)
    lead = () if paths is None else (paths,)
    assert a.x.shape == (4, *lead, 6, 3)
    for key in ("times", "scores", "rates", "noise"):
        close(getattr(a.path, key), getattr(path, key), F64)
    assert a.path.sigmas == path.sigmas
    if paths is not None:
        assert float((a.x[-1, 0] - a.x[-1, 1]).abs().max()) > 1e-6  # the paths differ


def test_a_generator_drives_the_weights_as_in_sample_path():
    x = tokens(5, 3, 15)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 16), sigma=0.5)
    a = tp.jko(x, proc, tau=0.05, steps=2, transport="identity", generator=torch.Generator().manual_seed(3))
    path = tp.sample_path(proc, t1=0.1, dt=0.05, generator=torch.Generator().manual_seed(3))
    close(a.path.scores, path.scores, F64)
    same_run(a, tp.jko(x, path, tau=0.05, steps=2, transport="identity"), F64)


def test_a_stored_path_is_read_between_its_grid_points_like_heads_at():
    """τ = 1.5 dt: the JKO steps see the stored path linearly interpolated (WeightPath.heads_at), warned."""
    x = tokens(5, 3, 17)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 18), sigma=0.5)
    path = tp.sample_path(proc, t1=0.3, dt=0.02, seed=1)
    with pytest.warns(UserWarning, match="not a multiple"):
        traj = tp.jko(x, path, tau=0.03, steps=3, transport="identity")
    # the partial term E(μ_k, t_{k+1}) − E(μ_k, t_k) of the ledger reads Θ at t_k
    E = lambda xx, t: tp.energy(xx, path.heads_at(t))  # noqa: E731
    expected = sum(E(traj.x[k], 0.03 * (k + 1)) - E(traj.x[k], 0.03 * k) for k in range(3))
    close(traj.ledger["partial"][-1], expected, F64)


# ---------------------------------------------------------------------------- batch axes
def test_the_paths_axis_stands_in_front_of_the_measures_batch():
    """x0 (2, n, d) with paths=3: x (T, 3, 2, n, d); path p of item i is the run of x0[i] with path p replayed."""
    x = tokens(12, 3, 19).reshape(2, 6, 3)
    proc = tp.OrnsteinUhlenbeck(rand_heads(2, 3, 20), sigma=0.6)
    both = tp.jko(x, proc, tau=0.05, steps=2, transport="identity", paths=3, seed=2)
    assert both.x.shape == (3, 3, 2, 6, 3) and both.energy.shape == (3, 3, 2)
    assert both.stats["residual"].shape == (2, 3, 2)
    for i in range(2):
        one = tp.jko(x[i], both.path, tau=0.05, steps=2, transport="identity")
        close(one.x[:, :, 0], both.x[:, :, i], F64)
    assert float((both.x[-1, 0] - both.x[-1, 1]).abs().max()) > 1e-6


# ---------------------------------------------------------------------------- the solver objects run themselves
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_run_called_directly_equals_tp_solve_and_the_keywords(dtype):
    """LagrangianJKO.run(model, x0, SolveOptions) is the solve: tp.solve only checks the options and calls it, and
    tp.jko builds the same objects."""
    x, heads = tokens(7, 3, 21, dtype), rand_heads(2, 3, 22, dtype)
    model = tp.Model(heads, normalization="effective", direction="ascent")
    solver = tp.LagrangianJKO(tp.EMD("symmetric"), tp.RiemannianLBFGS(max_iter=120))
    opts = dict(t1=0.2, dt=0.05, t0=0.05, saveat=tp.SaveAt(record_every=3))
    a = solver.run(model, x, tp.SolveOptions(**opts))
    b = tp.solve(model, x, solver, **opts)
    c = tp.jko(x, heads, tau=0.05, steps=3, t0=0.05, transport="emd", cost="symmetric", direction="ascent",
               max_iter=120, record_every=3)
    same_run(a, b, dtype)
    same_run(a, c, dtype)
    assert a.x.shape == (2, 7, 3) and a.x.dtype == dtype
    close(a.times, torch.tensor([0.05, 0.2], dtype=a.times.dtype), dtype)


def test_eulerian_run_called_directly_equals_tp_solve():
    z = tp.sphere.circle_grid(20, dtype=F64)
    heads = tp.Heads.scalar([1.5], 2).to(F64)
    q0 = torch.softmax(torch.randn(20, generator=gen(23), dtype=F64), -1)
    solver = tp.EulerianJKO(grid=z, grid_weights=q0, eps=0.03)
    model = tp.Model(heads, normalization="unnormalized")
    a = solver.run(model, None, tp.SolveOptions(t1=0.2, dt=0.1))
    b = tp.solve(model, None, solver, t1=0.2, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    same_run(a, b, F64)
    close(a.weights.sum(-1), torch.ones(3, dtype=F64), F64)  # the mass stays one
    assert a.extras["mobility"] == "unit" and a.normalization == "unnormalized"


def test_the_transport_term_base_class_is_distinct_from_the_transport_module():
    """tp.transport is the distances module; tp.TransportTerm the base class of the JKO transport terms, which
    LagrangianJKO refuses on its own (it is no transport)."""
    import types

    assert isinstance(tp.transport, types.ModuleType) and hasattr(tp.transport, "sinkhorn_divergence")
    for term in (tp.EMD(), tp.SinkhornTransport(), tp.Identity()):
        assert isinstance(term, tp.TransportTerm)
        assert tp.LagrangianJKO(term).transport is term
    with pytest.raises(TypeError, match="EMD\\(\\), SinkhornTransport\\(eps\\) or Identity\\(\\)"):
        tp.LagrangianJKO(tp.TransportTerm())
    with pytest.raises(TypeError, match="got module"):
        tp.LagrangianJKO(tp.transport)
