"""The particle solves' less travelled paths, each against an independent computation or a documented value: a
layer-norm run (pre-, peri-LN: token radii) resumed from a checkpoint equals the uninterrupted run; the kinetic
term at a given common scale, at the scale chosen at large β and resumed there; the ledger of a noisy run with and
without autograd (the fused kernel's moment sums against the plain pairing); the trapezoid ledger at the kinks of
linear layers against naive sums; old checkpoints without a scale; lazy diagnostics at large β; checkpoint
refusals that name the differing input; a replayed weight path; the adaptive run's stats; the memory estimate
against the stored arrays; the messages and the log line of the common scale."""

import logging
import math
import re

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen
from problems import Interrupted, stop_at_step, naive_kernel, naive_pairing, naive_slope, random_sphere, random_weights

F64 = torch.float64
T1, DT = 1.0, 0.1


def _heads(dtype, H=2, d=4, seed=3, scale=0.5):
    A = torch.randn(H, d, d, generator=gen(seed), dtype=F64) * scale
    V = torch.randn(H, d, d, generator=gen(seed + 1), dtype=F64) * scale
    return A.to(dtype), V.to(dtype)


def _ulps(dtype, k, scale=1.0):
    eps = torch.finfo(dtype).eps
    return dict(rtol=k * eps, atol=k * eps * scale)


@pytest.mark.parametrize("geometry", ["pre", "peri"])
def test_a_layer_norm_run_resumes_from_a_checkpoint_with_its_radii(tmp_path, dtype, geometry):
    """Interrupted after step 7 with checkpoints every 5 steps: the resumed run (token radii r_i and their
    records restored from the checkpoint) ends with the uninterrupted run's tokens, radii and energies."""
    x0 = random_sphere(2, 6, 4, dtype=dtype, seed=20)
    A, V = _heads(dtype)
    model = tp.Model(tp.Heads(A, V), layer_norm=geometry, direction="ascent")
    kw = dict(t1=T1, dt=DT, saveat=tp.SaveAt(record_every=2))
    full = tp.solve(model, x0, tp.Euler(), progress=False, **kw)
    radius = full.extras["radius"]
    assert float((radius[-1] - 1).abs().max()) > 1e-3  # the radii move: their records are not all ones
    ck = tp.Checkpointing(tmp_path / "ln.pt", every=5)
    with pytest.raises(Interrupted):
        tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=tp.Progress(False, stop_at_step(7)), **kw)
    resumed = tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=False, **kw)
    tol = _ulps(dtype, 64)
    assert_close(resumed.times, full.times)
    assert_close(resumed.x, full.x, **tol)
    assert_close(resumed.extras["radius"], radius, **_ulps(dtype, 64, float(radius.abs().max())))
    assert_close(resumed.energy, full.energy, **_ulps(dtype, 64, float(full.energy.abs().max())))


def test_kinetic_term_at_a_given_common_scale(dtype):
    """With ``energy_log_scale=c`` given, the kinetic term is reported times e^{−c} at that c (not at the
    scale the run would choose, 0 here)."""
    x0 = random_sphere(3, 6, 4, dtype=dtype, seed=21)
    A, V = _heads(dtype)
    model = tp.Model(tp.Heads(A, V), direction="ascent")
    kw = dict(t1=T1, dt=DT, progress=False)
    plain = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(diagnostics=False, kinetic=True), **kw)
    c = 3.0
    given = tp.solve(model, x0, tp.Euler(),
                     ledger=tp.LedgerOptions(diagnostics=False, kinetic=True, energy_log_scale=c), **kw)
    assert plain.stats["energy_log_scale"] == 0.0 and given.stats["energy_log_scale"] == c
    want = plain.kinetic * math.exp(-c)
    assert float(plain.kinetic[-1].min()) > 1e-2  # a flow that moves
    assert_close(given.kinetic, want, **_ulps(dtype, 64, float(want.abs().max())))


def test_kinetic_term_at_large_beta_is_at_the_chosen_common_scale(dtype):
    """At β‖A‖ beyond R/2 (R = log of the dtype's largest float) the run chooses c ≠ 0 from the
    log-partitions at t0 (the ledger's rule): the kinetic term is the ledger's "slope" at that same c."""
    x0 = random_sphere(2, 5, 3, dtype=dtype, seed=22)
    beta = 60.0 if dtype == torch.float32 else 400.0  # log m ≈ β > R/2 (44.4 in float32, 354.9 in float64)
    e = torch.eye(3, dtype=dtype)
    model = tp.Model(tp.Heads(e[None], None, None, beta), direction="ascent")
    kw = dict(t1=0.2, dt=0.02, progress=False)
    led = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(ledger=True), **kw)
    kin = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(diagnostics=False, kinetic=True), **kw)
    c = led.stats["energy_log_scale"]
    assert c > beta  # the common scale is in use
    assert kin.stats["energy_log_scale"] == c
    slope = led.ledger["slope"]
    assert float(slope[-1].min()) > 0.0
    assert_close(kin.kinetic, slope, **_ulps(dtype, 256, float(slope.abs().max())))


def test_noisy_ledger_is_the_same_with_and_without_autograd(dtype):
    """The Itô terms of a noisy run (martingale increments, ∂_tE and the Itô correction) from the fused
    kernel's moment sums (no autograd) and from the plain pairing of the statistics (tokens that require
    a gradient): the same ledger, to rounding."""
    x0 = random_sphere(2, 6, 4, dtype=dtype, seed=23)
    A, _ = _heads(dtype)
    theta = tp.OrnsteinUhlenbeck(tp.Heads(A + A.transpose(-1, -2)), mean=torch.eye(4, dtype=dtype), sigma=0.5)
    model = tp.Model(theta, direction="ascent")
    kw = dict(t1=0.5, dt=0.05, paths=2, seed=24, ledger=tp.LedgerOptions(ledger=True), progress=False)
    ref = tp.solve(model, x0, tp.Euler(), **kw)
    grad = tp.solve(model, x0.clone().requires_grad_(True), tp.Euler(), **kw)
    for key in ("martingale", "partial", "slope"):
        want = ref.ledger[key]
        assert float(want.abs().max()) > 1e-3, key
        assert_close(grad.ledger[key].detach(), want, **_ulps(dtype, 256, float(want.abs().max())))


def test_trapezoid_ledger_at_the_kinks_of_linear_layers(dtype):
    """Heun with linearly interpolated layers (Θ continuous, Ȧ jumps at the layer starts t = 0.5, 1): the
    ledger's ∫𝒢² dt and ∫∂_tE dt are the trapezoid sums of the naive 𝒢² and ⟨∂_A E, Ȧ⟩ (tests/problems.py)
    over the recorded states, the right end of the step that ends at a layer start taken at Θ(t_{k+1}) and
    the left limit Ȧ(t_{k+1}−) (the slope of the layer that ends there)."""
    x0 = random_sphere(2, 6, 4, dtype=dtype, seed=25)
    w = random_weights((2, 6), seed=26, floor=0.2).to(dtype)
    layers = [(0.5 * a + 0.5 * a.transpose(-1, -2)) for a in (_heads(dtype, seed=s)[0] for s in (30, 32, 34))]
    lt = 0.5
    theta = tp.Layerwise([tp.Heads(a) for a in layers], "linear", layer_time=lt)
    tr = tp.solve(tp.Model(theta, direction="ascent", weights=w), x0, tp.Heun(), t1=T1, dt=DT,
                  saveat=tp.SaveAt(record_every=1), ledger=tp.LedgerOptions(ledger=True), progress=False)
    K, xs = round(T1 / DT), tr.x
    omega = torch.full((2,), 0.5, dtype=dtype)

    def at(t):  # Θ(t) of the linear interpolation, and the layer index of the step that starts at t
        l = min(int(t / lt + 1e-9), len(layers) - 1)
        frac = t / lt - l
        A = layers[l] if l == len(layers) - 1 else layers[l] + frac * (layers[l + 1] - layers[l])
        return A, l

    G = lambda x, A: naive_slope(x, A, omega, 1.0, w)  # noqa: E731

    def P(x, A, l):  # per batch entry: naive_pairing's autograd sums the energy over the batch
        rate = (layers[l + 1] - layers[l]) / lt
        return torch.stack([naive_pairing(x[b], A, omega, 1.0, w[b], rate) for b in range(x.shape[0])])
    slope, partial = [], []
    for k in range(K):
        (A0, l), (A1, _) = at(k * DT), at((k + 1) * DT)
        slope.append(0.5 * DT * (G(xs[k], A0) + G(xs[k + 1], A1)))
        partial.append(0.5 * DT * (P(xs[k], A0, l) + P(xs[k + 1], A1, l)))  # Ȧ of the step's own layer
    for key, inc in (("slope", slope), ("partial", partial)):
        want = torch.cumsum(torch.stack(inc), 0)
        assert float(want[-1].abs().min()) > 1e-3, key
        assert_close(tr.ledger[key][1:], want, **_ulps(dtype, 256, float(want.abs().max())))


def test_a_checkpoint_without_the_scale_entry_resumes_at_scale_zero(tmp_path):
    """A checkpoint of an earlier version holds no common scale: the run resumes at c = 0 (the scale
    such a run had) and ends with the uninterrupted run's ledger."""
    x0 = random_sphere(2, 6, 4, seed=27)
    A, V = _heads(F64)
    model = tp.Model(tp.Heads(A, V), direction="ascent")
    kw = dict(t1=T1, dt=DT, ledger=tp.LedgerOptions(ledger=True))
    full = tp.solve(model, x0, tp.Euler(), progress=False, **kw)
    path = tmp_path / "old.pt"
    ck = tp.Checkpointing(path, every=5)
    with pytest.raises(Interrupted):
        tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=tp.Progress(False, stop_at_step(7)), **kw)
    state = torch.load(path, weights_only=False)
    del state["scale"]
    torch.save(state, path)
    resumed = tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=False, **kw)
    assert resumed.stats["energy_log_scale"] == 0.0
    for key in ("slope", "dissipation", "residual"):
        assert_close(resumed.ledger[key], full.ledger[key], **_ulps(F64, 64, float(full.ledger["slope"].abs().max())))


def test_kinetic_term_at_large_beta_resumes_at_its_common_scale(tmp_path, dtype):
    """A large-β kinetic run (c ≠ 0) resumed from a checkpoint continues at the checkpoint's c."""
    x0 = random_sphere(2, 5, 3, dtype=dtype, seed=28)
    beta = 60.0 if dtype == torch.float32 else 400.0
    model = tp.Model(tp.Heads(torch.eye(3, dtype=dtype)[None], None, None, beta), direction="ascent")
    kw = dict(t1=0.2, dt=0.02, ledger=tp.LedgerOptions(diagnostics=False, kinetic=True))
    full = tp.solve(model, x0, tp.Euler(), progress=False, **kw)
    assert full.stats["energy_log_scale"] > beta
    ck = tp.Checkpointing(tmp_path / "kin.pt", every=4)
    with pytest.raises(Interrupted):
        tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=tp.Progress(False, stop_at_step(6)), **kw)
    resumed = tp.solve(model, x0, tp.Euler(), checkpoint=ck, progress=False, **kw)
    assert resumed.stats["energy_log_scale"] == full.stats["energy_log_scale"]
    assert_close(resumed.kinetic, full.kinetic, **_ulps(dtype, 64, float(full.kinetic.abs().max())))


def test_lazy_diagnostics_at_large_beta_report_their_common_scale(dtype):
    """The default (lazy) diagnostics at β‖A‖ beyond R/2: E, 𝒢² and the reported common scale c are the
    eager ledger run's (the scale chosen from the records' log-partitions at t0, not the solve's c = 0)."""
    x0 = random_sphere(2, 5, 3, dtype=dtype, seed=29)
    beta = 60.0 if dtype == torch.float32 else 400.0
    model = tp.Model(tp.Heads(torch.eye(3, dtype=dtype)[None], None, None, beta), direction="ascent")
    kw = dict(t1=0.2, dt=0.02, progress=False)
    eager = tp.solve(model, x0, tp.Euler(), ledger=tp.LedgerOptions(ledger=True), **kw)
    lazy = tp.solve(model, x0, tp.Euler(), **kw)
    c = eager.stats["energy_log_scale"]
    assert c > beta and lazy.stats["energy_log_scale"] == c
    for key in ("energy", "slope"):
        want = getattr(eager, key)
        assert_close(getattr(lazy, key), want, **_ulps(dtype, 256, float(want.abs().max())))


def test_a_weighted_solve_carries_its_token_weights(dtype):
    x0 = random_sphere(3, 6, 4, dtype=dtype, seed=30)
    w = random_weights((3, 6), seed=31, floor=0.2).to(dtype)
    A, V = _heads(dtype)
    tr = tp.solve(tp.Model(tp.Heads(A, V), weights=w), x0, tp.Euler(), t1=0.2, dt=DT, progress=False)
    assert tr.weights is not None and "weights=" in repr(tr)
    assert_close(tr.weights, w)


def _first_coordinate_mean(x, weights):
    return x[..., 0].mean(-1)


def _second_coordinate_mean(x, weights):
    return x[..., 1].mean(-1)


def test_a_checkpoint_names_the_inputs_that_differ(tmp_path):
    """A resume with another normalization, quadrature or observable is refused, naming that input; a
    resume with the same observables continues with the uninterrupted run's records."""
    x0 = random_sphere(2, 6, 4, seed=32)
    A, V = _heads(F64)
    heads = tp.Heads(A, V)
    led = tp.LedgerOptions(ledger=True, quadrature="trapezoid")
    kw = dict(t1=T1, dt=DT)
    obs = tp.SaveAt(record_every=2, observables={"m": _first_coordinate_mean})
    full = tp.solve(tp.Model(heads), x0, tp.Euler(), ledger=led, saveat=obs, progress=False, **kw)
    ck = tp.Checkpointing(tmp_path / "ck.pt", every=5)
    with pytest.raises(Interrupted):
        tp.solve(tp.Model(heads), x0, tp.Euler(), ledger=led, saveat=obs, checkpoint=ck,
                 progress=tp.Progress(False, stop_at_step(7)), **kw)
    refusals = [
        (dict(model=tp.Model(heads, normalization="unnormalized")), r"these inputs differ: normalization\)"),
        (dict(ledger=tp.LedgerOptions(ledger=True, quadrature="left")), r"these inputs differ: quadrature\)"),
        (dict(saveat=tp.SaveAt(record_every=2, observables={"m": _second_coordinate_mean})),
         r"these inputs differ: observables\['m'\]\)"),
    ]
    for change, match in refusals:
        args = dict(model=tp.Model(heads), ledger=led, saveat=obs) | change
        with pytest.raises(ValueError, match=match):
            tp.solve(args["model"], x0, tp.Euler(), ledger=args["ledger"], saveat=args["saveat"], checkpoint=ck,
                     progress=False, **kw)
    resumed = tp.solve(tp.Model(heads), x0, tp.Euler(), ledger=led, saveat=obs, checkpoint=ck, progress=False, **kw)
    assert_close(resumed.observables["m"], full.observables["m"], **_ulps(F64, 64))
    assert_close(resumed.ledger["residual"], full.ledger["residual"], **_ulps(F64, 64))


def test_adaptive_run_reports_its_steps_and_field_evaluations():
    """stats of a Dopri5 solve (with and without the adjoint): "steps" is the dt grid's K = (t1 − t0)/dt, and
    "field_evaluations" counts the dopri5 stages: positive, and more at a tighter tolerance."""
    x0 = random_sphere(2, 6, 4, seed=33)
    A, V = _heads(F64, scale=1.0)
    model = tp.Model(tp.Heads(A, V))
    kw = dict(t1=T1, dt=DT)
    for adjoint in (False, True):
        loose = tp.solve(model, x0, tp.Dopri5(rtol=1e-3, atol=1e-5, adjoint=adjoint), **kw)
        tight = tp.solve(model, x0, tp.Dopri5(rtol=1e-10, atol=1e-12, adjoint=adjoint), **kw)
        assert loose.stats["steps"] == tight.stats["steps"] == 10
        assert tight.stats["field_evaluations"] > loose.stats["field_evaluations"] >= 7  # one dopri5 step: 7 stages


def test_a_bad_dopri5_tolerance_is_named():
    with pytest.raises(ValueError, match=r"Dopri5\.atol"):
        tp.Dopri5(atol=-1.0)
    with pytest.raises(ValueError, match=r"Dopri5\.rtol"):
        tp.Dopri5(rtol=0.0)


def test_the_common_scale_is_logged_only_when_it_is_not_zero(caplog):
    """An eager ledger at β‖A‖ beyond R/2 logs the chosen c and the largest log-partition at t0 (info); at
    β = 1 (c = 0) nothing is logged."""
    x0 = random_sphere(2, 5, 3, seed=34)
    e = torch.eye(3, dtype=F64)
    kw = dict(t1=0.1, dt=0.05, ledger=tp.LedgerOptions(ledger=True), progress=False)
    with caplog.at_level(logging.INFO, logger="transformer_pde.solvers.particle.evaluator"):
        tp.solve(tp.Model(tp.Heads(e[None])), x0, tp.Euler(), **kw)
        assert not [r for r in caplog.records if "reported times e^" in r.getMessage()]
        tr = tp.solve(tp.Model(tp.Heads(e[None], None, None, 400.0)), x0, tp.Euler(), **kw)
    c = tr.stats["energy_log_scale"]
    msgs = [r.getMessage() for r in caplog.records if "reported times e^" in r.getMessage()]
    assert c > 400.0 and len(msgs) == 1 and f"e^(-{c:.6g})" in msgs[0], msgs
    # the largest log-partition at t0 it names: max_i log (1/n) Σ_j e^{β⟨x_i, x_j⟩}, from the dense kernel
    L = float(torch.log(naive_kernel(x0, e[None], 400.0).mean(-1)).max())
    named = float(re.search(r"largest log-partition at t0: ([-+.\de]+)", msgs[0]).group(1))
    assert abs(named - L) <= 1e-5 * abs(L), (named, L)


def test_simulate_names_the_tolerances_a_fixed_step_method_has_not():
    x0 = random_sphere(5, 3, seed=35)
    heads = tp.Heads(torch.eye(3, dtype=F64)[None])
    with pytest.raises(ValueError, match=r"^rtol=0\.001: rtol and atol are the tolerances of method='adaptive'"):
        tp.simulate(x0, heads, t1=0.2, dt=0.1, method="euler", rtol=1e-3)
    with pytest.raises(ValueError, match=r"^rtol=0\.001, atol=1e-06: rtol and atol"):
        tp.simulate(x0, heads, t1=0.2, dt=0.1, method="heun", rtol=1e-3, atol=1e-6)


def test_replaying_a_sampled_weight_path_reproduces_the_noisy_run(dtype):
    """A solve whose process is the weight path of a noisy run with paths=3 (one set of tokens, the path's
    own paths axis) carries the tokens over that axis from t0 and reproduces the run's tokens."""
    A, _ = _heads(dtype, H=2, d=3, seed=36)
    x0 = random_sphere(5, 3, dtype=dtype, seed=37)
    theta = tp.OrnsteinUhlenbeck(tp.Heads(A + A.transpose(-1, -2)), sigma=0.5)
    kw = dict(t1=0.3, dt=0.1, progress=False)
    noisy = tp.solve(tp.Model(theta), x0, tp.Euler(), paths=3, seed=1, saveat=tp.SaveAt(path=True), **kw)
    replay = tp.solve(tp.Model(noisy.path), x0, tp.Euler(), **kw)
    assert replay.x.shape == noisy.x.shape == (4, 3, 5, 3)
    assert float((noisy.x[-1, 0] - noisy.x[-1, 1]).abs().max()) > 1e-3  # the paths differ
    assert_close(replay.x, noisy.x, **_ulps(dtype, 16))


def test_memory_estimate_of_the_recorded_tokens_counts_the_batch_tokens_and_dimension():
    """The recorded tokens take T·B·n·d·itemsize bytes, T = K/record_every + 2: with n ≠ d, and with B the
    paths axis of a replayed weight path."""
    from transformer_pde.solvers.particle import methods as particle

    def recorded(x0, process):
        return particle._estimate_memory(x0, process, K=10, record_every=1, paths=None, method="euler",
                                         diagnostics=False, return_path=False, chunk_elements=None, noisy=False,
                                         obs={})["the recorded tokens"]
    A, _ = _heads(F64, H=2, d=3, seed=38)
    theta = tp.OrnsteinUhlenbeck(tp.Heads(A + A.transpose(-1, -2)), sigma=0.5)
    x0 = random_sphere(2, 7, 3, seed=39)
    assert recorded(x0, theta) == pytest.approx(12 * 2 * 7 * 3 * 8, rel=1e-12)
    path = tp.solve(tp.Model(theta), x0[0], tp.Euler(), t1=0.2, dt=0.1, paths=3, seed=1,
                    saveat=tp.SaveAt(path=True), progress=False).path
    assert recorded(x0[0], path) == pytest.approx(12 * 3 * 7 * 3 * 8, rel=1e-12)


def _estimate(x0, process, **kw):
    from transformer_pde.solvers.particle import methods as particle
    args = dict(K=10, record_every=1, paths=None, method="euler", diagnostics=False, return_path=False,
                chunk_elements=None, noisy=True, obs={})
    return particle._estimate_memory(x0, process, **(args | kw))


def test_memory_estimate_of_the_weight_path_and_the_adaptive_solution():
    """The weight path's estimate is the same multiple of the stored path's scores for batched heads as for one
    set of heads (the heads' batch is in their element count once); an adaptive solve adds its solution on the record grid (two T·B·n·d arrays, T = K + 2) to a fixed step's."""
    A, _ = _heads(F64, H=2, d=3, seed=40)
    S = A + A.transpose(-1, -2)
    x0 = random_sphere(4, 7, 3, seed=41)
    one = tp.OrnsteinUhlenbeck(tp.Heads(S), sigma=0.5)
    batched = tp.OrnsteinUhlenbeck(tp.Heads(S.expand(4, 2, 3, 3).clone()), sigma=0.5)
    kw = dict(t1=1.0, dt=0.1, saveat=tp.SaveAt(path=True), progress=False)
    ratios = []
    for theta in (one, batched):  # the estimate against the stored path's scores, (K + 1) × batch × H × d × d
        scores = tp.solve(tp.Model(theta), x0, tp.Euler(), **kw).path.scores
        est = _estimate(x0, theta, return_path=True)["the weight path"]
        ratios.append(est / (scores.numel() * scores.element_size()))
    assert ratios[0] >= 1.0  # an upper estimate (scores, rates and noise increments: (3K + 2)/(K + 1) of them)
    assert ratios[1] == pytest.approx(ratios[0], rel=1e-12)  # not counting the heads' batch twice
    adaptive, euler = (sum(_estimate(x0, one, method=m, noisy=False).values()) for m in ("adaptive", "euler"))
    assert adaptive - euler >= 2 * 12 * 4 * 7 * 3 * 8
