"""Layer-normalisation schemes (transformer_pde.dynamics.layernorm, docs/layer_norms.md).

* each discrete layer map against an independent re-implementation, written here as a plain loop
  over tokens and heads from the published arithmetic of the two reference simulators
  (borjanG/2023-transformers-rotf ``phase-diagrams.py: simu_xform.step_1``; nikitus20/simuformer
  ``simuxform.py: SimuXForm.step``), equal to rounding after many steps, batched, multi-head, causal;
* the continuous-time limits: post-LN and the projected flow differ at O(Δt) (fitted order ≈ 1),
  every scheme converges to its ODE limit (solved here by torchdiffeq) at order 1;
* the ledger along the scheme's velocity closes at order 1; "none" is the projected flow.
"""

import math

import pytest
import torch

import transformer_pde as tp
from conftest import gen as _gen
from problems import interrupt_and_resume, tolerances
from transformer_pde.dynamics.layernorm import NGPT, PeriLN, PostLN, PreLN, Projected, simuformer_scheme

F64 = torch.float64


# rounding of `steps` layer maps: ~ steps · eps of the dtype, with a margin for the growth of errors
_tol = tolerances(ulps=200)


def _slope(dts, errs):
    ld, le = torch.log(torch.tensor(dts, dtype=F64)), torch.log(torch.tensor(errs, dtype=F64))
    ld, le = ld - ld.mean(), le - le.mean()
    return float((ld * le).sum() / (ld * ld).sum())


# ---------------------------------------------------------------- the peers' arithmetic, as plain loops
def _softmax(s):
    m = max(s)
    e = [math.exp(v - m) for v in s]
    z = sum(e)
    return [v / z for v in e]


def rotf_step(X, BF, V, beta, eta, use_softmax=True):
    """rotf's simu_xform.step_1 for one system: scores x_iᵀ BF x_j, softmax (or e^s / n), the
    mean η Σ_j p_ij x_j, times V on the right (row vectors), added to x_i, normalised."""
    n = X.shape[0]
    out = torch.empty_like(X)
    for i in range(n):
        s = [beta * float(X[i] @ BF @ X[j]) for j in range(n)]
        p = _softmax(s) if use_softmax else [math.exp(v) / n for v in s]
        u = sum(p[j] * X[j] for j in range(n)) * eta
        if V is not None:
            u = u @ V
        y = u + X[i]
        out[i] = y / y.norm()
    return out


def simuformer_step(X, r, BF, V, beta, eta, norm, causal=False, use_softmax=True):
    """simuformer's SimuXForm.step for one system: per head scores x_iᵀ BF_h x_j (−∞ above the
    diagonal when sequential), times β, softmax or exp (no 1/n), values x_jᵀ V_h, mean over heads;
    then the update of its --norm mode."""
    n, d = X.shape
    H = BF.shape[0]
    A = torch.zeros_like(X)
    for h in range(H):
        for i in range(n):
            js = range(i + 1) if causal else range(n)
            s = [beta * float(X[i] @ BF[h] @ X[j]) for j in js]
            p = _softmax(s) if use_softmax else [math.exp(v) for v in s]
            A[i] += sum(p[k] * (X[j] @ V[h]) for k, j in enumerate(js)) / H
    X, r = X.clone(), r.clone()
    for i in range(n):
        a = A[i]
        if norm == "postln":
            y = X[i] + eta * a
        elif norm == "preln":
            r[i] = r[i] + eta * (r[i] * a).sum()
            tangent = a - (X[i] * a).sum() * X[i]
            y = X[i] + eta * tangent / (r[i] + 1e-9)
        elif norm == "periln":
            an = a / (a.norm() + 1e-9)
            r[i] = r[i] + eta * (r[i] * an).sum()
            y = X[i] + eta * an / (r[i] + 1e-9)
        elif norm == "ngpt":
            an = a / (a.norm() + 1e-9)
            y = X[i] + eta * 0.2 * an
        X[i] = y / y.norm()
    return X, r


def _peer_problem(dtype, batch=2, n=6, d=3, H=3, seed=0):
    g = _gen(seed)
    X = tp.sphere.sample_uniform(n, d, batch_shape=(batch,), generator=g, dtype=F64).to(dtype)
    BF = (torch.randn(batch, H, d, d, generator=g, dtype=F64) / math.sqrt(d)).to(dtype)
    V = (torch.randn(batch, H, d, d, generator=g, dtype=F64) / math.sqrt(d)).to(dtype)
    return X, BF, V


# ---------------------------------------------------------------- the discrete maps reproduce the peers
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("use_softmax", [True, False])
def test_post_ln_reproduces_rotf(dtype, use_softmax):
    """rotf (one head, ω = 1): A = BF, value matrix Vᵀ; softmax or e^s/n (our 'unnormalized')."""
    X, BF, V = _peer_problem(dtype, H=1)
    beta, eta, steps = 1.5, 0.1, 40
    heads = tp.Heads(BF, V.transpose(-1, -2), weights=torch.ones(2, 1, dtype=dtype), beta=beta)
    traj = tp.simulate(X, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm="post",
                       normalization="softmax" if use_softmax else "unnormalized", diagnostics=False,
                       record_every=steps)
    ref = X.clone()
    for _ in range(steps):
        ref = torch.stack([rotf_step(ref[b], BF[b, 0], V[b, 0], beta, eta, use_softmax) for b in range(2)])
    torch.testing.assert_close(traj.final, ref, **_tol(dtype, steps))
    # the projected Euler step does not reproduce it: the maps differ at O(Δt²) per step
    proj = tp.simulate(X, heads, t1=steps * eta, dt=eta, direction="ascent", diagnostics=False,
                       normalization="softmax" if use_softmax else "unnormalized", record_every=steps).final
    assert float((proj - ref).abs().max()) > max(1e-2, 10 * _tol(dtype, steps)["atol"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm", ["postln", "preln", "periln", "ngpt"])
@pytest.mark.parametrize("causal", [False, True])
def test_simuformer_modes_reproduced(dtype, norm, causal):
    """Every --norm mode of simuformer, multi-head (ω = 1/H), batched, with and without its causal mask."""
    X, BF, V = _peer_problem(dtype)
    beta, eta, steps = 2.0, 0.1, 25
    heads = tp.Heads(BF, V.transpose(-1, -2), beta=beta)
    traj = tp.simulate(X, heads, t1=steps * eta, dt=eta, direction="ascent", layer_norm=simuformer_scheme(norm),
                       causal=causal, diagnostics=False, record_every=steps)
    ref, r = X.clone(), torch.ones(X.shape[:-1], dtype=dtype)
    for _ in range(steps):
        out = [simuformer_step(ref[b], r[b], BF[b], V[b], beta, eta, norm, causal) for b in range(2)]
        ref, r = torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])
    torch.testing.assert_close(traj.final, ref, **_tol(dtype, steps))
    if norm in ("preln", "periln"):
        torch.testing.assert_close(traj.extras["radius"][-1], r, **_tol(dtype, steps))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_simuformer_causal_unnormalized_is_prefix_sum(dtype):
    """simuformer's causal e^s attention sums over the prefix with unit weights: causal='sum', V·n;
    the prefix mean (causal=True) is another flow."""
    X, BF, V = _peer_problem(dtype)
    n = X.shape[-2]
    beta, eta, steps = 0.5, 0.02, 20
    heads = tp.Heads(BF, n * V.transpose(-1, -2), beta=beta)
    kw = dict(t1=steps * eta, dt=eta, direction="ascent", layer_norm="post", normalization="unnormalized",
              diagnostics=False, record_every=steps)
    got = tp.simulate(X, heads, causal="sum", **kw).final
    ref, r = X.clone(), torch.ones(X.shape[:-1], dtype=dtype)
    for _ in range(steps):
        ref = torch.stack([simuformer_step(ref[b], r[b], BF[b], V[b], beta, eta, "postln", True, False)[0]
                           for b in range(2)])
    torch.testing.assert_close(got, ref, **_tol(dtype, steps))
    mean = tp.simulate(X, heads, causal=True, **kw).final
    assert float((mean - ref).abs().max()) > 1e-2


def test_residual_pre_and_peri_ln_are_the_residual_stream():
    """rule='residual': z ← z + Δt·u(z/|z|) with u = A (pre) or A/|A| (peri), read in the radius and direction."""
    X, BF, V = _peer_problem(F64, H=2)
    heads = tp.Heads(BF, V, beta=1.0)
    dt, steps = 0.05, 30
    for scheme, unit in ((PreLN(), False), (PeriLN(), True)):
        traj = tp.simulate(X, heads, t1=steps * dt, dt=dt, direction="ascent", layer_norm=scheme, diagnostics=False,
                           record_every=steps)
        z = X.clone()
        for _ in range(steps):
            x = z / z.norm(dim=-1, keepdim=True)
            a = (heads.weights[..., None, None] * tp.head_outputs(x, heads)).sum(-3)
            z = z + dt * (a / a.norm(dim=-1, keepdim=True) if unit else a)
        torch.testing.assert_close(traj.final, z / z.norm(dim=-1, keepdim=True), **_tol(F64, steps))
        torch.testing.assert_close(traj.extras["radius"][-1], z.norm(dim=-1), **_tol(F64, steps))


def test_none_is_the_projected_flow():
    X, BF, V = _peer_problem(F64, H=2)
    heads = tp.Heads(BF, V, beta=1.0)
    kw = dict(t1=0.5, dt=0.05, method="heun", ledger=True)
    base = tp.simulate(X, heads, **kw)
    for ln in ("none", Projected()):
        other = tp.simulate(X, heads, layer_norm=ln, **kw)
        torch.testing.assert_close(other.x, base.x)
        torch.testing.assert_close(other.ledger["residual"], base.ledger["residual"])
        assert "layer_norm" not in other.stats and "radius" not in other.extras


# ---------------------------------------------------------------- continuous-time limits
def _field(x, heads):
    return (heads.weights[..., None, None] * tp.head_outputs(x, heads)).sum(-3)


def _limit_rhs(kind, heads, alpha=0.2):
    """The ODE limits of docs/layer_norms.md, written out here: ẋ = λ P_x A, ṙ for pre/peri."""
    def rhs(t, y):
        x, r = y[..., :-1], y[..., -1]
        x = x / x.norm(dim=-1, keepdim=True)
        a = _field(x, heads)
        tang = a - (x * a).sum(-1, keepdim=True) * x
        na = a.norm(dim=-1)
        if kind in ("none", "post"):
            v, dr = tang, torch.zeros_like(r)
        elif kind == "pre":
            v, dr = tang / r[..., None], (x * a).sum(-1)
        elif kind == "peri":
            v, dr = tang / (r * na)[..., None], (x * a).sum(-1) / na
        else:
            v, dr = alpha * tang / na[..., None], torch.zeros_like(r)
        return torch.cat([v, dr[..., None]], -1)
    return rhs


@pytest.mark.parametrize("kind", ["post", "pre", "peri", "ngpt"])
def test_each_scheme_converges_to_its_limit_at_order_one(kind):
    from torchdiffeq import odeint

    X, BF, V = _peer_problem(F64, batch=1, n=5, H=2, seed=3)
    heads = tp.Heads(BF, V, beta=1.0)
    T = 1.0
    y0 = torch.cat([X, torch.ones(*X.shape[:-1], 1, dtype=F64)], -1)
    yT = odeint(_limit_rhs(kind, heads), y0, torch.tensor([0.0, T], dtype=F64), method="dopri5", rtol=1e-11,
                atol=1e-12)[-1]
    xT, rT = yT[..., :-1] / yT[..., :-1].norm(dim=-1, keepdim=True), yT[..., -1]
    dts, errs = [0.05, 0.025, 0.0125], []
    for dt in dts:
        traj = tp.simulate(X, heads, t1=T, dt=dt, direction="ascent", layer_norm=kind, diagnostics=False,
                           record_every=round(T / dt))
        err = float((traj.final - xT).abs().max())
        if kind in ("pre", "peri"):
            err = max(err, float((traj.extras["radius"][-1] - rT).abs().max()))
        errs.append(err)
    assert errs[-1] < 1e-2
    assert 0.8 < _slope(dts, errs) < 1.25, (errs, _slope(dts, errs))


def test_post_ln_and_projected_flow_differ_at_order_one():
    """Same ODE limit, different maps: |x_post(T) − x_none(T)| ~ C Δt (measured 0.91–0.99)."""
    X, BF, V = _peer_problem(F64, batch=2, n=6, H=2, seed=1)
    heads = tp.Heads(BF, V, beta=1.0)
    dts, errs = [0.04, 0.02, 0.01, 0.005], []
    for dt in dts:
        kw = dict(t1=1.0, dt=dt, direction="ascent", diagnostics=False, record_every=round(1.0 / dt))
        errs.append(float((tp.simulate(X, heads, layer_norm="post", **kw).final
                           - tp.simulate(X, heads, **kw).final).abs().max()))
    assert errs[-1] > 1e3 * torch.finfo(F64).eps
    assert 0.85 < _slope(dts, errs) < 1.15, errs


@pytest.mark.parametrize("kind", ["post", "pre", "peri", "ngpt"])
def test_ledger_closes_along_the_schemes_velocity(kind):
    """H = 1 symmetric heads: each scheme is a gradient flow of E in the metric Σ w (b/λ)|v|²: both residuals
    (with 𝒟_λ and with s·𝒢²_λ) vanish at order 1 in Δt."""
    g = _gen(5)
    X = tp.sphere.sample_uniform(6, 3, batch_shape=(2,), generator=g, dtype=F64)
    D = torch.randn(3, 3, generator=g, dtype=F64)
    heads = tp.Heads.symmetric((D + D.T)[None] / 2, beta=1.0)
    dts, res, res_s = [0.02, 0.01, 0.005], [], []
    for dt in dts:
        traj = tp.simulate(X, heads, t1=1.0, dt=dt, direction="descent", layer_norm=kind, record_every=round(1.0 / dt), ledger=True)
        res.append(float(traj.ledger["residual"][-1].abs().max()))
        res_s.append(float(traj.ledger["residual_slope"][-1].abs().max()))
        assert traj.stats["layer_norm"] == kind
    assert 0.8 < _slope(dts, res) < 1.3, res
    assert 0.8 < _slope(dts, res_s) < 1.3, res_s
    # one head: 𝒟_λ = s·𝒢²_λ pointwise in time (the gradient-flow identity in the λ-metric)
    torch.testing.assert_close(traj.slope, -traj.dissipation)


def test_limit_method_matches_the_test_rhs():
    X, BF, V = _peer_problem(F64, batch=1, n=4, H=2, seed=2)
    heads = tp.Heads(BF, V)
    a = _field(X, heads)
    r = torch.rand(X.shape[:-1], generator=_gen(1), dtype=F64) + 0.5
    y = torch.cat([X, r[..., None]], -1)
    for kind, scheme in (("pre", PreLN()), ("peri", PeriLN()), ("ngpt", NGPT()), ("post", PostLN())):
        want = _limit_rhs(kind, heads)(0.0, y)
        v, dr = scheme.limit(X, r, a)
        torch.testing.assert_close(v, want[..., :-1])
        if dr is not None:
            torch.testing.assert_close(dr, want[..., -1])


# ---------------------------------------------------------------- input checks
def test_bad_layer_norm_input():
    X, BF, V = _peer_problem(F64, H=1)
    heads = tp.Heads(BF, V)
    kw = dict(t1=0.2, dt=0.1)
    with pytest.raises(ValueError, match="layer_norm"):
        tp.simulate(X, heads, layer_norm="layer", **kw)
    with pytest.raises(TypeError, match="layer_norm"):
        tp.simulate(X, heads, layer_norm=3, **kw)
    with pytest.raises(ValueError, match="method='euler'"):
        tp.simulate(X, heads, layer_norm="pre", method="rk4", **kw)
    with pytest.raises(ValueError, match="method='euler'"):
        tp.simulate(X, heads, layer_norm=PostLN(), method="adaptive", **kw)
    with pytest.raises(ValueError, match="rule"):
        PreLN(rule="karagodin")
    with pytest.raises(ValueError, match="eps"):
        PeriLN(eps=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        NGPT(alpha=0.0)
    with pytest.raises(TypeError, match="causal"):
        tp.simulate(X, heads, causal="prefix", **kw)


def test_checkpoint_resume_keeps_the_radius(tmp_path):
    X, BF, V = _peer_problem(F64, H=2)
    heads = tp.Heads(BF, V)
    kw = dict(t1=1.0, dt=0.05, direction="ascent", layer_norm="pre", record_every=4, ledger=True)
    full = tp.simulate(X, heads, **kw)
    ck = tmp_path / "run.pt"
    resumed = interrupt_and_resume(X, heads, ck, stop_at=11, **kw)
    torch.testing.assert_close(resumed.x, full.x)
    torch.testing.assert_close(resumed.extras["radius"], full.extras["radius"])
    torch.testing.assert_close(resumed.ledger["residual"], full.ledger["residual"])


# ---------------------------------------------------------------- clustering statistics of the peers
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gram_rank_counts_a_single_token_among_ten_thousand(dtype):
    """999 at e₁ + 1 at e₂ gave 1 with the old 10⁻³·n threshold; clusters of one token among 10⁴ count."""
    e = torch.eye(3, dtype=dtype)
    x = torch.cat([e[0].expand(999, 3), e[1][None]])
    assert int(tp.clustering.gram_rank_count(x, eps=1e-4)) == 2
    # the same without exact duplicates (no reduction to distinct tokens: the eigenvalues of the 1000 × 1000 T)
    jitter = 1e-4 * torch.randn(999, 3, generator=_gen(3), dtype=F64).to(dtype)
    near = torch.cat([tp.sphere.normalize(e[0] + jitter), e[1][None]])
    assert torch.unique(near, dim=0).shape[0] == 1000
    assert int(tp.clustering.gram_rank_count(near, eps=1e-4)) == 2
    small = x[-101:]  # 100 at e₁ + 1 at e₂: rotf's matrix_rank(IP > 0.9999)
    assert int(torch.linalg.matrix_rank((small @ small.T > 1 - 1e-4).double())) == 2
    assert int(tp.clustering.gram_rank_count(small, eps=1e-4)) == 2
    big = torch.cat([e[0].expand(9998, 3), e[1][None], e[2][None]])
    assert int(tp.clustering.gram_rank_count(big, eps=1e-4)) == 3
    batch = torch.stack([big, torch.cat([e[0].expand(9999, 3), e[2][None]])])
    assert tp.clustering.gram_rank_count(batch, eps=1e-4).tolist() == [3, 2]
    w = torch.full((10000,), 1e-4, dtype=dtype)
    w[-1], w[0] = 0.0, 2e-4
    assert int(tp.clustering.gram_rank_count(big, eps=1e-4, weights=w)) == 2  # a zero-weight token is no cluster


def test_gram_rank_agrees_with_matrix_rank_on_random_configurations():
    g = _gen(7)
    for n in (5, 40, 600):
        x = tp.sphere.sample_uniform(n, 2, generator=g, dtype=F64)
        x = torch.cat([x, x[: n // 3]])  # duplicates, so that the rank is not n
        T = (x @ x.T > 1 - 1e-2).double()
        assert int(tp.clustering.gram_rank_count(x, eps=1e-2)) == int(torch.linalg.matrix_rank(T))


def test_cluster_statistics_separate_thresholds():
    """rotf: pair fraction at overlap 0.999, cluster count at 0.9999: two tokens at overlap 0.9995 are one pair
    but two clusters."""
    a = 0.9995
    x = torch.tensor([[1.0, 0.0], [a, math.sqrt(1 - a * a)], [-1.0, 0.0]], dtype=F64)
    st = tp.clustering.cluster_statistics(x, eps=1e-3, count_eps=1e-4)
    torch.testing.assert_close(st["pair_fraction"], torch.tensor(2 / 6, dtype=F64))
    assert int(st["gram_rank"]) == 3 and int(st["clusters"]) == 3
    one = tp.clustering.cluster_statistics(x, eps=1e-3)
    assert int(one["gram_rank"]) == 2 and int(one["clusters"]) == 2
    obs = tp.clustering.statistics_observables(eps=1e-3, count_eps=1e-4, keys=("pair_fraction", "gram_rank"),
                                               stacked=True)["cluster_statistics"](x, None)
    torch.testing.assert_close(obs, torch.tensor([2 / 6, 3.0], dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_update_equals_evaluate(dtype):
    """The tokens-only fast path of the layer maps (one fused pass) against field.evaluate: token weights,
    head batch shapes, β tensors, both directions; large β‖A‖ falls back (None)."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics.layernorm import FusedUpdate

    X, BF, V = _peer_problem(dtype, batch=3, n=7, d=4, H=3, seed=11)
    w = torch.rand(3, 7, generator=_gen(2), dtype=F64).to(dtype)
    w = w / w.sum(-1, keepdim=True)
    tol = dict(rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    for heads, weights in ((tp.Heads(BF, V, beta=1.3), None), (tp.Heads(BF[0], V[0]), w),
                           (tp.Heads(BF, V, weights=torch.rand(3, 3, dtype=dtype), beta=torch.tensor([0.5, 1.0, 2.0],
                                                                                                      dtype=dtype)), w)):
        for sign in (1.0, -1.0):
            got = FusedUpdate(weights, sign)(X, heads)
            want = evaluate(X, heads, weights, sign=sign, diagnostics=False)
            torch.testing.assert_close(got.ambient, want.ambient, **tol)
            torch.testing.assert_close(got.velocity, want.velocity, **tol)
    assert FusedUpdate(None, 1.0)(X, tp.Heads(200 * BF, V)) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_update_in_blocks_of_systems_equals_evaluate(dtype, monkeypatch):
    """The blocked pass (systems in cache-sized blocks; the block made tiny here so that every batch is
    split, with a remainder) against field.evaluate: batched and unbatched heads, token weights
    broadcast over a second batch axis, a β per system; and against the unblocked pass."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics import layernorm
    from transformer_pde.dynamics.layernorm import FusedUpdate

    X, BF, V = _peer_problem(dtype, batch=5, n=6, d=4, H=3, seed=12)
    X2 = torch.stack([X, X.flip(-2)])                                         # (2, 5, n, d)
    w = torch.rand(5, 6, generator=_gen(4), dtype=F64).to(dtype)
    w = w / w.sum(-1, keepdim=True)
    tol = dict(rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    cases = ((X, tp.Heads(BF, V, beta=1.3), None), (X2, tp.Heads(BF[0], V[0]), w),
             (X2, tp.Heads(BF, V, beta=torch.linspace(0.5, 2.0, 5, dtype=dtype)), w))
    whole = [FusedUpdate(weights, -1.0)(x, heads).ambient for x, heads, weights in cases]
    monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", 2 * 6 * 3 * 6 * torch.finfo(dtype).bits // 8)
    for (x, heads, weights), un in zip(cases, whole):
        got = FusedUpdate(weights, -1.0)(x, heads)
        want = evaluate(x, heads, weights, sign=-1.0, diagnostics=False)
        torch.testing.assert_close(got.ambient, want.ambient, **tol)
        torch.testing.assert_close(got.velocity, want.velocity, **tol)
        torch.testing.assert_close(got.ambient, un, **tol)



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["queries", "keys"])
def test_fused_update_layouts_agree_with_evaluate(dtype, layout, monkeypatch):
    """Both layouts of the fused pass (scores as (queries·heads, keys), or transposed with the means divided
    into place) in both dtypes, whichever the dtype uses by default: heads per system and shared, token
    weights with a zero, a β per system, blocks with a remainder, against field.evaluate."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics import layernorm
    from transformer_pde.dynamics.layernorm import FusedUpdate

    monkeypatch.setattr(layernorm, "LAYOUTS", {dtype: layout})
    X, BF, V = _peer_problem(dtype, batch=5, n=7, d=4, H=3, seed=15)
    w = torch.rand(5, 7, generator=_gen(6), dtype=F64).to(dtype)
    w[2, 4] = 0.0
    w = w / w.sum(-1, keepdim=True)
    tol = dict(rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    cases = ((tp.Heads(BF, V, beta=1.3), None), (tp.Heads(BF[0], V[0]), w),
             (tp.Heads(BF, V, beta=torch.linspace(0.5, 2.0, 5, dtype=dtype)), w))
    for block in (None, 2 * 7 * 3 * 7 * torch.finfo(dtype).bits // 8):
        monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", block)
        for heads, weights in cases:
            for sign in (1.0, -1.0):
                got = FusedUpdate(weights, sign)(X, heads)
                want = evaluate(X, heads, weights, sign=sign, diagnostics=False)
                torch.testing.assert_close(got.ambient, want.ambient, **tol)
                assert float(want.ambient.abs().max()) > 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_update_takes_its_dtypes_layout_and_refuses_near_the_exp_bound(dtype, monkeypatch):
    """Each dtype takes the layout layernorm.LAYOUTS names (float64: keys, whose products have n·H columns;
    float32: queries); heads given by query and key factors (no score matrix kept) give the same update as
    evaluate; and the shift-free pass is refused (None) once β‖A‖_F passes ½ log(finfo.max) − log n, also
    within 2 log n of ½ log(finfo.max)."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics import layernorm
    from transformer_pde.dynamics.layernorm import FusedUpdate

    X, BF, V = _peer_problem(dtype, batch=3, n=7, d=4, H=2, seed=16)
    fu = FusedUpdate(None, 1.0)
    seen = []
    for name in ("_update", "_update_keys"):
        real = getattr(fu, name)
        monkeypatch.setattr(fu, name, lambda blk, bufs, out, real=real, name=name: (seen.append(name),
                                                                                    real(blk, bufs, out)))
    heads = tp.Heads(BF, V)
    torch.testing.assert_close(fu(X, heads).ambient, evaluate(X, heads, None, diagnostics=False).ambient,
                               rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    want = "_update_keys" if layernorm.LAYOUTS.get(dtype) == "keys" else "_update"
    assert set(seen) == {want} and want == {torch.float64: "_update_keys", torch.float32: "_update"}[dtype]
    g = _gen(17)
    factors = tp.Heads(None, V[0], None, 0.9, query=torch.randn(2, 3, 4, generator=g, dtype=F64).to(dtype),
                       key=torch.randn(2, 3, 4, generator=g, dtype=F64).to(dtype))
    for _ in range(2):  # twice: the second call with whatever the first one kept
        got = FusedUpdate(None, -1.0)(X, factors)
        want_f = evaluate(X, factors, None, sign=-1.0, diagnostics=False).ambient
        torch.testing.assert_close(got.ambient, want_f, rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    A = BF[0] / BF[0].flatten(-2).norm(dim=-1)[:, None, None]  # ‖A_h‖_F = 1: the bound is β
    half = 0.5 * math.log(torch.finfo(dtype).max)
    assert FusedUpdate(None, 1.0)(X, tp.Heads(A, V[0], beta=half - 2 * math.log(7))) is not None
    assert FusedUpdate(None, 1.0)(X, tp.Heads(A, V[0], beta=half)) is None  # between ½log max − log n and + log n


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_update_reuses_its_buffers_across_calls_and_block_sizes(dtype, monkeypatch):
    """One FusedUpdate called again and again, as a run does: its kept buffers serve batches of other
    sizes (larger, smaller, a remainder block) and other block sizes (one system, two, all, the
    default from the cache) and every call equals field.evaluate; an earlier result is not
    overwritten by a later call."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics import layernorm
    from transformer_pde.dynamics.layernorm import FusedUpdate

    X, BF, V = _peer_problem(dtype, batch=7, n=5, d=4, H=3, seed=13)
    tol = dict(rtol=50 * torch.finfo(dtype).eps, atol=50 * torch.finfo(dtype).eps)
    per = 5 * 3 * 5 * torch.finfo(dtype).bits // 8                         # bytes of one system's scores
    shared, batched = tp.Heads(BF[0], V[0], beta=1.1), tp.Heads(BF, V, beta=0.9)
    fu_shared, fu_batched = FusedUpdate(None, 1.0), FusedUpdate(None, -1.0)
    kept = []
    for block in (None, per, 2 * per, 100 * per, per):
        monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", block)
        for m in (7, 3, 6):
            x = X[:m].flip(-2) if m == 3 else X[:m]
            got = fu_shared(x, shared)
            torch.testing.assert_close(got.ambient, evaluate(x, shared, None, sign=1.0, diagnostics=False).ambient,
                                       **tol)
            kept.append((x, got.ambient))
        got = fu_batched(X, batched)
        torch.testing.assert_close(got.ambient, evaluate(X, batched, None, sign=-1.0, diagnostics=False).ambient,
                                   **tol)
    for x, ambient in kept:                                               # still the values of their call
        torch.testing.assert_close(ambient, evaluate(x, shared, None, sign=1.0, diagnostics=False).ambient, **tol)
    # wider tokens than there are tokens (d > n: the queries set the block), one and two systems per block
    Xw, BFw, Vw = _peer_problem(dtype, batch=5, n=3, d=6, H=2, seed=14)
    wide = tp.Heads(BFw, Vw, beta=0.7)
    for block in (3 * 2 * 6 * torch.finfo(dtype).bits // 8, 2 * 3 * 2 * 6 * torch.finfo(dtype).bits // 8):
        monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", block)
        torch.testing.assert_close(FusedUpdate(None, 1.0)(Xw, wide).ambient,
                                   evaluate(Xw, wide, None, sign=1.0, diagnostics=False).ambient, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scheme", [PostLN(), Projected(), PreLN(), NGPT()])
def test_layer_maps_keep_the_gradient_of_the_explicit_formula(dtype, scheme):
    """The layer maps normalise a fresh sum in place only when no gradient flows through it: with
    x and A requiring gradients, the result and the gradients equal those of the map written out
    (y/|y| with y the scheme's residual sum)."""
    g = _gen(21)
    x0 = tp.sphere.sample_uniform(6, 3, batch_shape=(2,), generator=g, dtype=F64).to(dtype)
    a0 = torch.randn(2, 6, 3, generator=g, dtype=F64).to(dtype)
    dt = 0.3

    def explicit(x, a):
        if isinstance(scheme, Projected):
            y = x + dt * (a - (x * a).sum(-1, keepdim=True) * x)
        elif isinstance(scheme, NGPT):
            y = x + dt * scheme.alpha * a / a.norm(dim=-1, keepdim=True)
        else:                                                              # post; pre with r = 1
            y = x + dt * a
        return y / y.norm(dim=-1, keepdim=True)

    x, a = x0.clone().requires_grad_(), a0.clone().requires_grad_()
    out = scheme.step(x, scheme.initial_radius(x), a, dt)[0]
    gx, ga = torch.autograd.grad((out * torch.arange(3, dtype=dtype)).sum(), (x, a))
    x2, a2 = x0.clone().requires_grad_(), a0.clone().requires_grad_()
    ref = explicit(x2, a2)
    rx, ra = torch.autograd.grad((ref * torch.arange(3, dtype=dtype)).sum(), (x2, a2))
    tol = dict(rtol=20 * torch.finfo(dtype).eps, atol=20 * torch.finfo(dtype).eps)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(ga, ra, **tol)
    with torch.no_grad():                                                 # the in-place path: the same numbers
        torch.testing.assert_close(scheme.step(x0, scheme.initial_radius(x0), a0, dt)[0], ref.detach(), **tol)

# ---------------------------------------------------------------- studies
def test_rotf_phase_diagram_study_records_the_peers_statistics(tmp_path):
    """phase_diagram with rotf's settings: post-LN, pair fraction at 0.999 and Gram rank at 0.9999; the
    recorded series equal the statistics recomputed from a direct simulate of the same ensemble."""
    import json

    from transformer_pde.application.runs import execute

    p = {"regimes": ["constant"], "betas": [1.0, 6.0], "n": 8, "d": 2, "systems": 3, "t1": 3.0, "dt": 0.1,
         "record_every": 10, "layer_norm": "post", "pair_eps": 1e-3, "count_eps": 1e-4, "count": "gram_rank",
         "figures": False}
    path = execute({"kind": "phase_diagram", "name": "rotf", "params": p}, out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    assert m["layer_norm"] == "post" and m["eps"] == 1e-3 and m["count_eps"] == 1e-4
    seg = torch.load(path / "data" / "constant.pt", weights_only=False)
    x0 = tp.ensembles.random_tokens(3, 8, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    heads = tp.Heads(torch.eye(2, dtype=F64).expand(3, 1, 2, 2).clone(), None, None,
                     torch.tensor([1.0, 6.0], dtype=F64)[:, None].expand(2, 3).contiguous())
    traj = tp.simulate(x0.expand(2, 3, 8, 2), heads, t1=3.0, dt=0.1, direction="ascent", layer_norm="post",
                       diagnostics=False, record_every=10)
    G = traj.x @ traj.x.transpose(-1, -2)
    off = ~torch.eye(8, dtype=torch.bool)
    pair = ((G > 1 - 1e-3) & off).sum((-1, -2)).double() / 56
    torch.testing.assert_close(seg["pair_fraction"], pair)
    rank = torch.linalg.matrix_rank((G > 1 - 1e-4).double())
    assert seg["gram_rank"].tolist() == rank.tolist()  # integer counts
    assert "final_gram_rank_median" in m["regimes"]["constant"]["per_beta"][0]


def test_layer_norm_rates_study_fits_the_post_ln_rate(tmp_path):
    """The post-LN map contracts the deviations from consensus by 1/(1 + Δt) per step (V = I):
    fitted rate 2·log(1/(1 + Δt))/Δt, → −2 as Δt → 0; pre-LN decays more slowly (a power)."""
    import json

    from transformer_pde.application.runs import execute

    p = {"schemes": ["post", "pre"], "n": 6, "d": 3, "draws": 4, "t1": 12.0, "dt": 0.1, "record_every": 2,
         "figures": False}
    path = execute({"kind": "layer_norm_rates", "name": "r", "params": p}, out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    post = m["schemes"]["post"]
    assert post["fitted_draws"] == 4
    assert abs(post["rate_median"] - 2 * math.log(1 / 1.1) / 0.1) < 0.03
    assert m["schemes"]["pre"]["final_gap_median"] > 1e3 * m["schemes"]["post"]["final_gap_median"]
    with pytest.raises(ValueError, match="fit_low"):
        execute({"kind": "layer_norm_rates", "name": "r2", "params": {**p, "fit_low": 0.5, "fit_high": 0.1}},
                out_dir=tmp_path, progress=False)


def test_s1_mode_rates_against_quadrature_and_the_literature_counts():
    """r_ℓ = ℓ² I_ℓ(β)/(β I_0(β)) with I_ℓ(β) = (1/π)∫_0^π e^{β cos θ} cos ℓθ dθ (trapezoid here); the fastest
    mode is 3 at β = 5 and 4 at β = 7 (Bruno–Pasqualotto–Agazzi)."""
    import numpy as np

    from transformer_pde.application.studies.clustering import s1_mode_rates

    th = np.linspace(0.0, math.pi, 20001)
    for beta in (2.0, 5.0, 7.0):
        bess = [np.trapezoid(np.exp(beta * np.cos(th)) * np.cos(l * th), th) / math.pi for l in range(9)]
        want = np.array([l * l * bess[l] / (beta * bess[0]) for l in range(9)])
        np.testing.assert_allclose(s1_mode_rates(beta, 8), want, rtol=1e-7, atol=1e-12)
    assert int(np.argmax(s1_mode_rates(5.0, 20)[1:])) + 1 == 3
    assert int(np.argmax(s1_mode_rates(7.0, 20)[1:])) + 1 == 4


@pytest.mark.parametrize("kind", ["post", "pre", "ngpt"])
def test_layer_maps_with_noisy_weights_replay_their_path(kind):
    """OU heads (grid-sampled, Monte-Carlo paths): a run and the replay of its stored weight path agree."""
    X, BF, V = _peer_problem(F64, batch=1, n=5, H=2, seed=4)
    heads = tp.Heads.symmetric(0.5 * (BF[0] + BF[0].transpose(-1, -2)))
    theta = tp.OrnsteinUhlenbeck(heads, mean=torch.eye(3, dtype=F64), rate=1.0, sigma=0.5)
    kw = dict(t1=0.6, dt=0.05, direction="ascent", layer_norm=kind, record_every=3, ledger=True)
    first = tp.simulate(X[0], theta, paths=2, seed=3, return_path=True, **kw)
    again = tp.simulate(X[0].expand(2, 5, 3), first.path, **kw)
    torch.testing.assert_close(again.x, first.x)
    assert torch.isfinite(first.ledger["residual"]).all()


# ---------------------------------------------------------------------------- the normalised update at |A| → 0
@pytest.mark.parametrize("geometry", ["peri", "ngpt"])
def test_a_zero_update_leaves_the_tokens_where_they_are(dtype, geometry):
    # Â = A/|A| at A = 0 is defined as 0: peri-LN and nGPT with zero value matrices do not move the tokens
    A = torch.eye(3, dtype=dtype).unsqueeze(0)
    x0 = tp.sphere.sample_uniform(6, 3, generator=_gen(3), dtype=dtype)
    traj = tp.solve(tp.Model(tp.Heads(score=A, value=torch.zeros_like(A)), layer_norm=geometry), x0, tp.Euler(),
                    t1=0.3, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(traj.final, x0, rtol=4 * eps, atol=4 * eps)  # the renormalisation's rounding
    assert bool(torch.isfinite(traj.ledger["residual"]).all())


@pytest.mark.parametrize("geometry", ["peri", "ngpt"])
def test_tiny_weights_give_the_direction_of_unit_weights(dtype, geometry):
    # weights c·I with c = 1e-310 (subnormal, float64) or 1e-30 (float32): |A|² underflows to 0, A/|A| does not.
    # Scores ~ 0 make the attention uniform, and Â is scale-invariant: the flow of score 0, value I
    c = 1e-310 if dtype == torch.float64 else 1e-30
    I = torch.eye(3, dtype=dtype).unsqueeze(0)
    x0 = tp.sphere.sample_uniform(6, 3, generator=_gen(4), dtype=dtype)
    tiny = tp.solve(tp.Model(tp.Heads(score=c * I, value=c * I), layer_norm=geometry), x0, tp.Euler(), t1=0.3, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    unit = tp.solve(tp.Model(tp.Heads(score=0 * I, value=I), layer_norm=geometry), x0, tp.Euler(), t1=0.3, dt=0.1, ledger=tp.LedgerOptions(ledger=True))
    assert float((tiny.final - x0).abs().max()) > 1e-2  # it moves
    # a subnormal float64 keeps 2^-38 of relative precision (1e-310 / 2^-1074): far coarser than eps
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(tiny.final, unit.final, rtol=tol, atol=tol)


def test_the_normalised_update_is_a_over_its_norm_plus_eps(dtype):
    from transformer_pde.dynamics.layernorm import _unit

    a = torch.randn(4, 5, 3, generator=_gen(5), dtype=dtype)
    a[0, 0] = 0.0
    for eps in (0.0, 1e-3):
        expected = a / (torch.linalg.vector_norm(a, dim=-1, keepdim=True) + eps)
        if eps == 0.0:
            expected[0, 0] = 0.0  # the zero update
        torch.testing.assert_close(_unit(a, eps), expected)


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized"])
def test_tokens_only_layer_maps_keep_causality_and_the_normalisation(normalization):
    """A post-LN solve without diagnostics (the fused layer-map pass where it applies) moves the tokens as the
    same solve with the ledger (every step through evaluate): causal attention stays causal and another
    normalisation stays itself; the non-causal run differs, so the comparison can tell."""
    dtype = torch.float64
    x0 = tp.sphere.sample_uniform(8, 4, batch_shape=(3,), generator=_gen(30), dtype=dtype)
    A = torch.randn(2, 4, 4, generator=_gen(31), dtype=dtype)
    heads = tp.Heads(A, torch.randn(2, 4, 4, generator=_gen(32), dtype=dtype))
    kw = dict(t1=0.5, dt=0.1, layer_norm="post", normalization=normalization)
    bare = tp.simulate(x0, heads, causal=True, diagnostics=False, **kw).x
    ledger = tp.simulate(x0, heads, causal=True, ledger=True, **kw).x
    whole = tp.simulate(x0, heads, causal=False, diagnostics=False, **kw).x
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(bare, ledger, rtol=1e3 * eps, atol=1e3 * eps)
    assert float((bare - whole).abs().max()) > 0.1
    torch.testing.assert_close(whole, tp.simulate(x0, heads, causal=False, ledger=True, **kw).x, rtol=1e3 * eps,
                               atol=1e3 * eps)


def test_one_fused_update_follows_a_change_of_layout_between_calls(monkeypatch):
    """The prepared value matrices are oriented for the layout: one FusedUpdate with the same heads, called
    in one layout and then the other, agrees with field.evaluate both times."""
    from transformer_pde.model.field import evaluate
    from transformer_pde.dynamics import layernorm
    X, BF, V = _peer_problem(F64, batch=3, n=5, d=4, H=2, seed=25)
    heads = tp.Heads(BF, V)
    fused = layernorm.FusedUpdate(None, 1.0)
    want = evaluate(X, heads, None, sign=1.0, diagnostics=False).ambient
    tol = dict(rtol=50 * torch.finfo(F64).eps, atol=50 * torch.finfo(F64).eps)
    for layout in ("keys", "queries", "keys"):
        monkeypatch.setattr(layernorm, "LAYOUTS", {F64: layout})
        torch.testing.assert_close(fused(X, heads).ambient, want, **tol)
