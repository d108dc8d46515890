"""Cluster statistics and plateau detection against closed forms (transformer_pde.analysis.clustering),
and the clustering studies (phase_diagram, metastability) end to end on tiny configs."""

import inspect
import json
import math

import numpy as np
import pytest
import torch

import transformer_pde as tp
from transformer_pde import clustering as cl

DTYPES = [torch.float32, torch.float64]


def _separated(k, sizes, d, *, spread, gen, dtype):
    """k clusters of the given sizes around the first k of ±e_j (pairwise chord ≥ √2), noise of
    chordal size ≤ spread; returns (x (N, d), labels (N,))."""
    centers = torch.cat([torch.eye(d, dtype=torch.float64), -torch.eye(d, dtype=torch.float64)])[:k]
    xs, lab = [], []
    for c, m in enumerate(sizes):
        noise = torch.randn(m, d, generator=gen, dtype=torch.float64)
        noise = spread * 0.4 * noise / noise.norm(dim=-1, keepdim=True) * torch.rand(m, 1, generator=gen,
                                                                                       dtype=torch.float64)
        xs.append(tp.sphere.normalize(centers[c] + noise))
        lab += [c] * m
    return torch.cat(xs).to(dtype), torch.tensor(lab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_well_separated_clusters_counted_exactly(dtype, k):
    gen = torch.Generator().manual_seed(k)
    sizes = [2 + 3 * c for c in range(k)]
    x, lab = _separated(k, sizes, 4, spread=0.02, gen=gen, dtype=dtype)
    perm = torch.randperm(len(x), generator=gen)
    x = x[perm]
    for r in (0.05, 0.5, 1.0):  # any radius between the spread and the separation (√2)
        assert int(cl.cluster_count(x, radius=r)) == k
        assert int(cl.gram_rank_count(x, radius=r)) == k
    st = cl.cluster_statistics(x, radius=0.5)
    assert int(st["clusters"]) == k and int(st["gram_rank"]) == k
    N = sum(sizes)
    torch.testing.assert_close(st["largest_mass"], torch.tensor(max(sizes) / N, dtype=dtype))
    frac = sum(m * (m - 1) for m in sizes) / (N * (N - 1))
    torch.testing.assert_close(st["pair_fraction"], torch.tensor(frac, dtype=dtype))
    # the labels are the clusters (up to naming): same label <=> same true cluster
    labels = cl.cluster_labels(x, radius=0.5)
    same_true = lab[perm].unsqueeze(0) == lab[perm].unsqueeze(1)
    assert torch.equal(labels.unsqueeze(0) == labels.unsqueeze(1), same_true)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_point_and_tiny_radius(dtype):
    x = tp.sphere.normalize(torch.ones(7, 3, dtype=dtype))
    st = cl.cluster_statistics(x, radius=1e-3)
    assert int(st["clusters"]) == 1 and int(st["gram_rank"]) == 1
    torch.testing.assert_close(st["pair_fraction"], torch.tensor(1.0, dtype=dtype))
    torch.testing.assert_close(st["largest_mass"], torch.tensor(1.0, dtype=dtype))
    torch.testing.assert_close(st["radius"], torch.tensor(0.0, dtype=dtype), atol=2e-3 if dtype == torch.float32 else 1e-7,
                               rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [0.2, 0.9, 0.995])
def test_equiangular_closed_forms(dtype, gamma):
    n = 6
    x = tp.sphere.equiangular(n, gamma, dtype=dtype)
    gap = 1 - gamma
    for eps, linked_all in ((1.5 * gap, True), (0.5 * gap, False)):
        P = cl.pair_fraction(x, eps=eps)
        torch.testing.assert_close(P, torch.tensor(1.0 if linked_all else 0.0, dtype=dtype))
        assert int(cl.gram_rank_count(x, eps=eps)) == (1 if linked_all else n)
        assert int(cl.cluster_count(x, radius=cl.radius_from_eps(eps))) == (1 if linked_all else n)
        st = cl.cluster_statistics(x, eps=eps)
        torch.testing.assert_close(st["largest_mass"], torch.tensor(1.0 if linked_all else 1 / n, dtype=dtype))
        torch.testing.assert_close(st["mean_overlap"], torch.tensor(gamma, dtype=dtype), atol=1e-5, rtol=1e-5)
        # spread of one equiangular cluster: cos θ = √((1 + (n−1)γ)/n)
        R = math.acos(math.sqrt((1 + (n - 1) * gamma) / n)) if linked_all else 0.0
        torch.testing.assert_close(st["radius"], torch.tensor(R, dtype=dtype), atol=1e-3 if dtype == torch.float32 else 1e-9,
                                   rtol=1e-4)


def test_chain_single_linkage_vs_rank():
    """Three tokens on a great circle, neighbours 0.8 r apart, ends 1.6 r apart: one single-linkage
    cluster, but the thresholded Gram matrix [[1,1,0],[1,1,1],[0,1,1]] has rank 3 (det = −1)."""
    r = 0.1
    a = 2 * math.asin(0.8 * r / 2)
    ang = torch.tensor([0.0, a, 2 * a], dtype=torch.float64)
    x = torch.stack([torch.cos(ang), torch.sin(ang)], -1)
    assert int(cl.cluster_count(x, radius=r)) == 1
    assert int(cl.gram_rank_count(x, radius=r)) == 3
    torch.testing.assert_close(cl.pair_fraction(x, radius=r), torch.tensor(4 / 6, dtype=torch.float64))


@pytest.mark.parametrize("metric", ["chordal", "geodesic"])
def test_matches_scipy_connected_components(metric):
    """cluster_count against scipy's connected components of the graph built here from the angles
    (geodesic: arccos⟨x_i, x_j⟩ < ρ) or the distances (chordal: |x_i − x_j| < r)."""
    from scipy.sparse.csgraph import connected_components

    gen = torch.Generator().manual_seed(3)
    x = tp.sphere.sample_uniform(40, 3, batch_shape=(4, 5), generator=gen, dtype=torch.float64)
    xs = x.reshape(-1, 40, 3).numpy()
    for r in (0.2, 0.4, 0.8):
        ours = cl.cluster_count(x, radius=r, metric=metric)
        ref = []
        for c in xs:
            dist = (np.arccos(np.clip(c @ c.T, -1.0, 1.0)) if metric == "geodesic"
                    else np.linalg.norm(c[:, None] - c[None], axis=-1))
            ref.append(connected_components(dist < r, directed=False)[0])
        assert ours.reshape(-1).tolist() == ref, (metric, r)
    assert len(set(ours.flatten().tolist())) > 1  # the configurations are not all alike


def test_geodesic_radius_is_the_chordal_radius_of_the_same_angle():
    """Two tokens at angle θ: one cluster iff θ < ρ (geodesic) iff |x − y| = 2 sin(θ/2) < r (chordal)."""
    for rho in (0.5, 1.2, 3.0):
        for theta, count in ((0.98 * rho, 1), (1.02 * rho, 2)):
            theta = min(theta, math.pi)
            x = torch.tensor([[1.0, 0.0, 0.0], [math.cos(theta), math.sin(theta), 0.0]], dtype=torch.float64)
            want = 1 if theta < min(rho, math.pi) else 2
            if theta < math.pi:
                assert want == count
            assert int(cl.cluster_count(x, radius=rho, metric="geodesic")) == want, (rho, theta)
    with pytest.raises(ValueError, match="metric"):
        cl.cluster_count(torch.eye(3, dtype=torch.float64), radius=0.1, metric="euclidean")
    with pytest.raises(ValueError, match="radius"):
        cl.cluster_count(torch.eye(3, dtype=torch.float64), radius=-1.0, metric="geodesic")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_dims_equal_separate_calls(dtype):
    gen = torch.Generator().manual_seed(5)
    x = tp.sphere.sample_uniform(20, 3, batch_shape=(2, 3), generator=gen, dtype=dtype)
    w = torch.rand(2, 3, 20, generator=gen, dtype=dtype)
    w = w / w.sum(-1, keepdim=True)
    st = cl.cluster_statistics(x, w, radius=0.6)
    for i in range(2):
        for j in range(3):
            one = cl.cluster_statistics(x[i, j], w[i, j], radius=0.6)
            for key, v in one.items():
                torch.testing.assert_close(st[key][i, j], v)
    # the separate functions agree with the dict
    assert torch.equal(st["clusters"], cl.cluster_count(x, radius=0.6, weights=w))
    assert torch.equal(st["gram_rank"], cl.gram_rank_count(x, radius=0.6, weights=w))
    torch.testing.assert_close(st["pair_fraction"], cl.pair_fraction(x, radius=0.6, weights=w))
    torch.testing.assert_close(st["largest_mass"], cl.largest_cluster_mass(x, radius=0.6, weights=w))
    torch.testing.assert_close(st["radius"], cl.cluster_radius(x, radius=0.6, weights=w))
    # permuting the tokens changes nothing
    perm = torch.randperm(20, generator=gen)
    st2 = cl.cluster_statistics(x[..., perm, :], w[..., perm], radius=0.6)
    for key in st:
        torch.testing.assert_close(st2[key], st[key])


def test_weights_closed_forms():
    e = torch.eye(3, dtype=torch.float64)
    x = torch.stack([e[0], e[0], e[1], e[1], e[1], e[2]])
    w = torch.tensor([0.1, 0.3, 0.2, 0.1, 0.3, 0.0], dtype=torch.float64)
    # the zero-weight token (alone at e_2) is not a cluster
    assert int(cl.cluster_count(x, radius=0.1, weights=w)) == 2
    assert int(cl.gram_rank_count(x, radius=0.1, weights=w)) == 2
    assert int(cl.cluster_count(x, radius=0.1)) == 3
    torch.testing.assert_close(cl.largest_cluster_mass(x, radius=0.1, weights=w), torch.tensor(0.6, dtype=torch.float64))
    # P = Σ_c (W_c² − Σ_{i∈c} w_i²) / (1 − Σ_i w_i²)
    num = (0.4 ** 2 - 0.1 ** 2 - 0.3 ** 2) + (0.6 ** 2 - 0.2 ** 2 - 0.1 ** 2 - 0.3 ** 2)
    den = 1 - float((w ** 2).sum())
    torch.testing.assert_close(cl.pair_fraction(x, radius=0.1, weights=w), torch.tensor(num / den, dtype=torch.float64))
    # largest mass is differentiable in the weights: gradient = indicator of the largest cluster
    wg = w.clone().requires_grad_(True)
    cl.largest_cluster_mass(x, radius=0.1, weights=wg).backward()
    torch.testing.assert_close(wg.grad, torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.float64))


def test_soft_pair_fraction_differentiable_and_tends_to_hard():
    gen = torch.Generator().manual_seed(7)
    x = tp.sphere.sample_uniform(8, 3, batch_shape=(2,), generator=gen, dtype=torch.float64)
    hard = cl.pair_fraction(x, eps=0.3)
    soft = cl.pair_fraction(x, eps=0.3, temperature=1e-6)
    torch.testing.assert_close(soft, hard, atol=1e-6, rtol=0)

    def f(y):
        return cl.pair_fraction(tp.sphere.normalize(y), eps=0.3, temperature=0.05)

    torch.autograd.gradcheck(f, (x.clone().requires_grad_(True),))
    xr = x.clone().requires_grad_(True)
    cl.cluster_radius(xr, radius=1.0).sum().backward()
    assert torch.isfinite(xr.grad).all()


def test_bad_input_refused():
    x = tp.sphere.normalize(torch.ones(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="radius"):
        cl.cluster_count(x, radius=3.0)
    with pytest.raises(ValueError, match="radius"):
        cl.cluster_count(x, radius=0.0)
    with pytest.raises(ValueError, match="either radius"):
        cl.pair_fraction(x, radius=0.1, eps=0.1)
    with pytest.raises(ValueError, match="unit sphere"):
        cl.cluster_statistics(2 * x)
    with pytest.raises(ValueError, match="weights"):
        cl.cluster_statistics(x, torch.ones(3, dtype=torch.float64) / 3)
    with pytest.raises(TypeError, match="dtype"):
        cl.cluster_statistics(x.float(), torch.ones(4, dtype=torch.float64) / 4)
    with pytest.raises(ValueError, match="unknown statistic"):
        cl.statistics_observables(keys=["nope"])


# ---------------------------------------------------------------------------- plateaus
def _staircase(t, switches, levels, width=0.02):
    y = torch.full_like(t, levels[0])
    for s, a, b in zip(switches, levels[:-1], levels[1:]):
        y = y + (b - a) * 0.5 * (1 + torch.tanh((t - s) / width))
    return y


@pytest.mark.parametrize("dtype", DTYPES)
def test_plateaus_of_a_synthetic_staircase(dtype):
    t = torch.linspace(0, 12, 1201, dtype=torch.float64)
    levels, switches = [5.0, 3.0, 2.0, 1.0], [2.0, 5.0, 9.0]
    y1 = _staircase(t, switches, levels)
    y2 = _staircase(t, [4.0, 8.0], [0.0, 10.0, 4.0])  # up and down
    y3 = torch.full_like(t, 2.5)  # constant: one plateau
    Y = torch.stack([y1, y2, y3]).to(dtype).reshape(3, 1, -1)
    st = cl.detect_plateaus(t, Y)
    assert st.start.shape == (3, 1, 4)
    assert st.count.flatten().tolist() == [4, 3, 1]
    bounds1 = [0.0, *switches, 12.0]
    for i, (bounds, lev) in enumerate([(bounds1, levels), ([0.0, 4.0, 8.0, 12.0], [0.0, 10.0, 4.0]),
                                       ([0.0, 12.0], [2.5])]):
        k = len(lev)
        torch.testing.assert_close(st.level[i, 0, :k], torch.tensor(lev, dtype=dtype), atol=0.03, rtol=0)
        s = st.start[i, 0, :k].double()
        e = st.end[i, 0, :k].double()
        torch.testing.assert_close(s, torch.tensor(bounds[:-1], dtype=torch.float64), atol=0.2, rtol=0)
        torch.testing.assert_close(e, torch.tensor(bounds[1:], dtype=torch.float64), atol=0.2, rtol=0)
        assert bool(torch.isnan(st.start[i, 0, k:]).all())
    assert st.as_rows((0, 0))[1]["level"] == pytest.approx(3.0, abs=0.03)


def test_plateaus_of_an_integer_count_series_are_exact():
    t = torch.arange(0, 101, dtype=torch.float64) * 0.5
    c = torch.tensor([8] * 20 + [5] * 30 + [4] * 1 + [2] * 50, dtype=torch.float64)  # one-sample step at 4
    st = cl.detect_plateaus(t, c, min_duration=2.0)
    assert int(st.count) == 3
    torch.testing.assert_close(st.level, torch.tensor([8.0, 5.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(st.start, torch.tensor([0.0, 10.0, 25.5], dtype=torch.float64))
    torch.testing.assert_close(st.end, torch.tensor([9.5, 24.5, 50.0], dtype=torch.float64))


def test_plateau_and_crossing_validation_and_crossing_closed_form():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    with pytest.raises(ValueError, match="one entry per value"):
        cl.detect_plateaus(t, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="increasing"):
        cl.detect_plateaus(t.flip(0), torch.zeros(11, dtype=torch.float64))
    with pytest.raises(ValueError, match="slope_tol"):
        cl.detect_plateaus(t, torch.zeros(11, dtype=torch.float64), slope_tol=-1.0)
    y = torch.stack([t ** 2, 3 * t, torch.zeros_like(t), torch.ones_like(t)])
    tc = cl.crossing_time(t, y, 0.5)
    # t² is piecewise-linearly interpolated between records: crossing between 0.7 (0.49) and 0.8 (0.64)
    torch.testing.assert_close(tc, torch.tensor([0.7 + 0.1 * 0.01 / 0.15, 0.5 / 3, math.inf, 0.0], dtype=torch.float64))


# ---------------------------------------------------------------------------- with simulate
def test_statistics_along_a_simulation():
    gen = torch.Generator().manual_seed(0)
    x0 = tp.sphere.sample_uniform(10, 3, batch_shape=(3,), generator=gen, dtype=torch.float64)
    heads = tp.Heads.scalar(torch.tensor([1.0], dtype=torch.float64), 3)
    kw = dict(t1=30.0, dt=0.2, direction="ascent", diagnostics=False, record_every=25)
    if "observables" in inspect.signature(tp.simulate).parameters:
        obs = cl.statistics_observables(radius=0.2, keys=["clusters", "pair_fraction"])
        obs.update(cl.statistics_observables(radius=0.2, keys=["gram_rank", "largest_mass"], stacked=True))
        traj = tp.simulate(x0, heads, observables=obs, **kw)
        ref = cl.cluster_statistics(traj.x, radius=0.2)
        assert torch.equal(traj.observables["clusters"], ref["clusters"])
        torch.testing.assert_close(traj.observables["pair_fraction"], ref["pair_fraction"])
        stk = traj.observables["cluster_statistics"]
        assert stk.shape == (7, 3, 2)
        torch.testing.assert_close(stk[..., 0], ref["gram_rank"].double())
        torch.testing.assert_close(stk[..., 1], ref["largest_mass"])
    else:
        traj = tp.simulate(x0, heads, **kw)
        ref = cl.cluster_statistics(traj.x, radius=0.2)
    # attractive heads: clustering increases, all tokens in one cluster at the end
    assert ref["clusters"].shape == (7, 3)
    assert bool((ref["clusters"][-1] == 1).all()) and bool((ref["clusters"][0] > 1).all())
    assert bool((ref["pair_fraction"][-1] == 1).all())


# ---------------------------------------------------------------------------- studies
def _tiny_phase(**kw):
    p = {"regimes": ["constant", "ou", "oscillating"], "betas": [1.0, 4.0], "n": 6, "d": 4, "systems": 4,
         "t1": 3.0, "dt": 0.1, "record_every": 3, "figures": False}
    p.update(kw)
    return {"kind": "phase_diagram", "name": "pd", "params": p}


def test_phase_diagram_study_runs_resumes_and_compares_with_theory(tmp_path):
    from transformer_pde.application.runs import execute

    path = execute(_tiny_phase(), out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    assert set(m["regimes"]) == {"constant", "ou", "oscillating"}
    th = m["theory"]["hitting_time"]
    assert th[1] > th[0] > 0  # the single-head clustering time grows with β
    rows = m["regimes"]["constant"]["per_beta"]
    assert [r["beta"] for r in rows] == [1.0, 4.0]
    assert "ratio_to_theory" in rows[0]
    assert (path / "series" / "ou.csv").exists() and (path / "data" / "constant.pt").exists()
    # resume: finished segments are reused, same numbers
    path2 = execute(_tiny_phase(), out_dir=tmp_path, progress=False, resume=True)
    m2 = json.loads((path2 / "metrics.json").read_text())
    assert m2["regimes"] == m["regimes"]


def test_phase_diagram_resumes_a_killed_segment_exactly(tmp_path):
    from transformer_pde.application.runs import execute

    class Kill(Exception):
        pass

    def killer(tag, k, t):
        if tag == "ou" and k == 17:
            raise Kill

    cfg = _tiny_phase(regimes=["constant", "ou"], checkpoint_every=5)
    with pytest.raises(Kill):
        execute(cfg, out_dir=tmp_path / "a", progress=False, step_callback=killer)
    assert (tmp_path / "a" / "pd" / "checkpoints" / "ou.ckpt").exists()
    a = execute(cfg, out_dir=tmp_path / "a", progress=False, resume=True)
    b = execute(cfg, out_dir=tmp_path / "b", progress=False)
    ma, mb = (json.loads((p / "metrics.json").read_text()) for p in (a, b))
    assert ma["regimes"]["ou"]["per_beta"] == mb["regimes"]["ou"]["per_beta"]
    sa, sb = (torch.load(p / "data" / "ou.pt", weights_only=False) for p in (a, b))
    for key in ("pair_fraction", "clusters", "mean_overlap", "largest_mass"):
        assert torch.equal(sa[key], sb[key])


def test_study_configs_refuse_bad_values(tmp_path):
    from transformer_pde.application.config import load_config

    with pytest.raises(ValueError, match="betas"):
        load_config({"kind": "phase_diagram", "params": {"betas": [2.0, 1.0]}})
    with pytest.raises(ValueError, match="whole number"):
        load_config({"kind": "phase_diagram", "params": {"t1": 1.0, "dt": 0.3}})
    with pytest.raises(ValueError, match="radius"):
        load_config({"kind": "metastability", "params": {"radius": 3.0}})
    for name in ("phase_diagram", "phase_diagram_quick", "metastability", "metastability_quick"):
        import pathlib

        root = pathlib.Path(__file__).resolve().parents[1]
        load_config(root / "experiments" / f"{name}.toml")


@pytest.mark.slow
def test_metastability_study_with_figures(tmp_path):
    from transformer_pde.application.runs import execute

    cfg = {"kind": "metastability", "name": "ms", "params": {"n": 12, "systems": 2, "t1": 20.0, "dt": 0.2,
                                                             "record_every": 2}}
    path = execute(cfg, out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    for regime in ("constant", "ou", "oscillating"):
        r = m["regimes"][regime]
        assert r["final_clusters_median"] <= r["initial_clusters_median"] or regime != "constant"
        assert r["cluster_plateaus_median"] >= 1
    assert (path / "figures" / "staircases.png").exists()
    assert "plateaus" in m["figure_captions"]["staircases"]
    cfg = _tiny_phase(figures=True, heads=2, betas=[0.5, 1.0, 2.0], init_heads="goe", phase="per_head")
    path = execute(cfg, out_dir=tmp_path, progress=False)
    assert (path / "figures" / "phase_diagram.png").exists() and (path / "figures" / "clustering_time.png").exists()
    m = json.loads((path / "metrics.json").read_text())
    assert m["theory"]["beta_star"] == pytest.approx(tp.theory.critical_beta(2, 6, 1.0))
    assert "β*" in m["figure_captions"]["phase_diagram"]


# ---------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_point_measure_statistics_equal_their_docstrings(dtype):
    """A one-point measure — one token, or weights putting all the mass on one token — is one
    cluster of mass 1 and radius 0 with pair fraction 1 and mean overlap 1 (the docstrings), the
    values of any number of coincident tokens (not pair fraction 0 from 0/tiny)."""
    e = torch.eye(3, dtype=dtype)
    x = torch.stack([e[0], e[1], e[2]])
    coincident = e[0].expand(4, 3)
    for w in (torch.tensor([1.0, 0.0, 0.0], dtype=dtype), torch.tensor([0.0, 0.0, 1.0], dtype=dtype)):
        torch.testing.assert_close(cl.pair_fraction(x, weights=w), torch.tensor(1.0, dtype=dtype))
        torch.testing.assert_close(cl.pair_fraction(x, weights=w, temperature=0.1), torch.tensor(1.0, dtype=dtype))
        st = cl.cluster_statistics(x, w, radius=0.5)
        ref = cl.cluster_statistics(coincident, radius=0.5)  # four coincident tokens: the same measure
        for key in ("clusters", "largest_mass", "pair_fraction", "mean_overlap", "radius", "gram_rank"):
            torch.testing.assert_close(st[key], ref[key], msg=key)
        assert int(st["clusters"]) == 1 and float(st["pair_fraction"]) == 1.0 and float(st["mean_overlap"]) == 1.0
    one = x[:1]
    torch.testing.assert_close(cl.pair_fraction(one), torch.tensor(1.0, dtype=dtype))
    st = cl.cluster_statistics(one)
    torch.testing.assert_close(st["pair_fraction"], torch.tensor(1.0, dtype=dtype))
    torch.testing.assert_close(st["mean_overlap"], torch.tensor(1.0, dtype=dtype))
    # batched: the one-point member does not disturb the others (two separated tokens: 0 close pairs)
    W = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]], dtype=dtype)
    torch.testing.assert_close(cl.pair_fraction(x, weights=W), torch.tensor([1.0, 0.0], dtype=dtype))
    torch.testing.assert_close(cl.cluster_statistics(x, W)["mean_overlap"], torch.tensor([1.0, 0.0], dtype=dtype))


def test_statistics_with_zero_weight_tokens_have_finite_gradients():
    """A token of zero weight is its own cluster with weighted mean 0; the old radius divided 0/0
    there and, although that branch was masked, its gradient was NaN for every token."""
    g = torch.Generator().manual_seed(4)
    x = tp.sphere.normalize(torch.randn(4, 3, generator=g, dtype=torch.float64)).requires_grad_()
    w = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    st = cl.cluster_statistics(x, w, radius=1.999)
    (st["radius"] + st["mean_overlap"] + st["largest_mass"]).backward()
    assert bool(torch.isfinite(x.grad).all()) and bool(torch.isfinite(w.grad).all())
    assert float(x.grad[2:].abs().max()) == 0.0  # zero-weight tokens do not move the statistics
    # the radius of the two-token cluster is half their geodesic distance, with the gradient of that
    x.grad = None
    r = cl.cluster_radius(x, radius=1.999, weights=w)
    r.backward()
    xd = x.detach()[:2].clone().requires_grad_()
    half = torch.acos((xd[0] * xd[1]).sum().clamp(-1, 1)) / 2
    half.backward()
    torch.testing.assert_close(r.detach(), half.detach())
    torch.testing.assert_close(st["radius"].detach(), half.detach())
    tangent = lambda g: g - (g * xd.detach()).sum(-1, keepdim=True) * xd.detach()  # noqa: E731  (on-sphere part)
    torch.testing.assert_close(tangent(x.grad[:2]), tangent(xd.grad))


@pytest.mark.parametrize("fn", [cl.cluster_statistics, cl.cluster_count, cl.cluster_labels, cl.cluster_masses,
                                cl.largest_cluster_mass, cl.cluster_radius, cl.pair_fraction, cl.linked,
                                cl.gram_rank_count])
def test_empty_batches_are_refused_with_a_clear_error(fn):
    """x of shape (0, n, d) gave torch's "max(): Expected reduction dim" from the sphere check."""
    with pytest.raises(ValueError, match="empty batch"):
        fn(torch.zeros(0, 3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="no tokens"):
        fn(torch.zeros(2, 0, 2, dtype=torch.float64))
    x = tp.sphere.normalize(torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty batch"):
        fn(x, weights=torch.zeros(0, 3, dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_plateaus_and_crossings_refuse_non_finite_times(bad):
    y = torch.tensor([0.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    t = [0.0, 1.0, 2.0, bad] if bad != -float("inf") else [bad, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="finite"):
        cl.detect_plateaus(t, y)
    with pytest.raises(ValueError, match="finite"):
        cl.crossing_time(t, y, 0.5)
    # times finite in float64 but not in float32 (the values' dtype): refused too
    with pytest.raises(ValueError, match="finite"):
        cl.detect_plateaus([0.0, 1.0, 2.0, 1e39], y.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plateaus_refuse_a_horizon_too_short_for_the_range(dtype):
    """(max y − min y)/(t_end − t_0) overflowing (subnormal spacing) is refused, not returned as an infinite
    threshold; the same spacing with a constant series (slope 0) is one plateau."""
    tiny = torch.finfo(dtype).tiny / 8  # subnormal in the values' dtype
    y = torch.tensor([[0.0, 1.0], [2.0, 2.0]], dtype=dtype)
    with pytest.raises(ValueError, match="average slope .* overflows"):
        cl.detect_plateaus([0.0, tiny], y)
    st = cl.detect_plateaus([0.0, tiny], y[1:])
    assert bool(torch.isfinite(st.threshold).all()) and st.count.tolist() == [1]
    ok = cl.detect_plateaus([0.0, 1.0], y)  # the same series on a unit horizon
    assert bool(torch.isfinite(ok.threshold).all())


def test_crossing_time_refuses_decreasing_times_and_allows_repeated_ones():
    y = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="increasing"):
        cl.crossing_time([2.0, 1.0, 0.0], y, 0.5)  # not 1.5 read off the unsorted times
    with pytest.raises(ValueError, match="increasing"):
        cl.crossing_time([0.0, 2.0, 1.0], y, 1.5)
    # a repeated time (a left-limit record at a knot) is a jump of the series at that time
    torch.testing.assert_close(cl.crossing_time([0.0, 1.0, 1.0], y, 1.5), torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="strictly increasing"):
        cl.detect_plateaus([0.0, 1.0, 1.0], y)
    # T = 0 records: a clear error, not argmax's IndexError
    with pytest.raises(ValueError, match="T = 0"):
        cl.crossing_time([], torch.zeros(0, dtype=torch.float64), 0.5)
    with pytest.raises(TypeError, match="real"):
        cl.crossing_time(torch.tensor([0.0, 1j, 2.0]), y, 0.5)
    with pytest.raises(TypeError, match="times"):
        cl.crossing_time(["a", "b", "c"], y, 0.5)
    with pytest.raises(ValueError, match="overflows"):
        cl.detect_plateaus(torch.tensor([-3e38, 0.0, 3e38]), torch.zeros(3))
    # an empty batch of series is a batch of no answers, in the batch shape
    assert cl.crossing_time([0.0, 1.0], torch.zeros(0, 2, dtype=torch.float64), 0.5).shape == (0,)
    assert cl.detect_plateaus([0.0, 1.0], torch.zeros(0, 2, dtype=torch.float64)).count.shape == (0,)


def test_statistics_observables_refuse_bad_keys_and_radius_up_front():
    with pytest.raises(ValueError, match="keys is empty"):
        cl.statistics_observables(keys=[])
    with pytest.raises(TypeError, match="string"):
        cl.statistics_observables(keys="clusters")
    with pytest.raises(ValueError, match="unknown statistic"):
        cl.statistics_observables(keys=[["clusters"]])
    with pytest.raises(ValueError, match="radius"):
        cl.statistics_observables(radius=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_fraction_observable_is_the_peers_statistic(dtype):
    """pair_fraction_observable against a loop over pairs of the overlap test (the reference
    simulators' check_stats), against pair_fraction(eps=...) on configurations with no overlap near the
    threshold (weighted and uniform), one token, and in simulate at every step."""
    g = torch.Generator().manual_seed(3)
    # clusters of coincident tokens (overlap 1) and random tokens (overlaps far below 1 − ε)
    base = torch.nn.functional.normalize(torch.randn(4, 6, 5, generator=g, dtype=torch.float64), dim=-1)
    pick = torch.randint(0, 6, (4, 9), generator=g)
    x = torch.gather(base, 1, pick.unsqueeze(-1).expand(4, 9, 5)).to(dtype)
    x = x / x.norm(dim=-1, keepdim=True)
    eps = 1e-3
    fn = cl.pair_fraction_observable(eps=eps)
    got = fn(x, None)
    want = []
    for b in range(4):
        c = sum(float(x[b, i] @ x[b, j]) > 1 - eps for i in range(9) for j in range(9) if i != j)
        want.append(c / (9 * 8))
    torch.testing.assert_close(got, torch.tensor(want, dtype=dtype), rtol=1e-12, atol=torch.finfo(dtype).eps * 4)
    torch.testing.assert_close(got, cl.pair_fraction(x, eps=eps), rtol=1e-12, atol=torch.finfo(dtype).eps * 4)
    # fn keeps its Gram buffer: calls on other tokens (same and other shapes) leave later calls right
    fn(torch.nn.functional.normalize(torch.randn(4, 9, 5, generator=g, dtype=torch.float64), dim=-1).to(dtype), None)
    fn(x[:2, :5], None)
    torch.testing.assert_close(fn(x, None), torch.tensor(want, dtype=dtype), rtol=1e-12,
                               atol=torch.finfo(dtype).eps * 4)
    w = torch.rand(4, 9, generator=g, dtype=torch.float64).to(dtype)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(fn(x, w), cl.pair_fraction(x, eps=eps, weights=w))
    assert fn(x[:, :1], None).tolist() == [1.0] * 4
    assert got.dtype == dtype and got.shape == (4,)
    heads = tp.Heads(torch.eye(5, dtype=dtype).expand(2, 5, 5), torch.eye(5, dtype=dtype).expand(2, 5, 5), beta=2.0)
    traj = tp.simulate(x, heads, t1=0.3, dt=0.1, layer_norm="post", diagnostics=False, progress=False,
                       observables={"pairs": fn, "ref": lambda y, _: cl.pair_fraction(y, eps=eps)})
    torch.testing.assert_close(traj.observables["pairs"], traj.observables["ref"], rtol=1e-6, atol=0.05)
    with pytest.raises(ValueError, match="eps"):
        cl.pair_fraction_observable(eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        cl.pair_fraction_observable(eps=3.0)
