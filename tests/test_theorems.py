"""The stability theorems' constants and studies (docs/theorems.md).

* tp.theory.lipschitz_bound: never exceeded by the measured Lipschitz ratio of the field on random
  configurations (large β included), and not vacuous (within 5 % of measured ratios at small β for
  softmax/unnormalized, a factor 5 for relu);
* tp.theory.gronwall_factor against closed forms;
* stability in the data: pairs at W2 distance ε (emd = identity coupling); the worst case over directions and its
  trajectory bound are tested in tests/test_sensitivity.py, and here through the study's claims;
* stability in the weights: Θ^ε at ε = 0 is the unperturbed run (to rounding), linear in ε; the study's W2
  constant never exceeds the Duhamel bound along the run, and the energy gap splits into direct + flow parts;
* the Hessian of E on the sphere at known critical points (regular simplex = minimum, consensus = maximum);
* the fast-weights limit: the closed-form diffusion covariance against its basis sum, the Itô correction
  against Monte Carlo of one fast layer, the SDE integrator without noise against tp.simulate(heun);
* each study's quick config runs through the CLI entry point (tiny overrides).
"""

import json
import math
from pathlib import Path

import pytest
import torch

import transformer_pde as tp
from transformer_pde.analysis.theory.limits import common_noise_sde, riemannian_hessian
from transformer_pde.application.studies.theorems import perturbed_pair, perturbed_weights

ROOT = Path(__file__).resolve().parent.parent / "experiments"
F64 = torch.float64


def _field_at(x, mu, w, heads, normalization):
    """V[μ, Θ](x) for points x (B, d) not among the tokens: appended as tokens of weight 0."""
    B, n = x.shape[0], mu.shape[-2]
    toks = torch.cat([x[:, None, :], mu.expand(B, n, mu.shape[-1])], 1)
    ws = torch.cat([torch.zeros(B, 1, dtype=x.dtype), w.expand(B, n)], 1)
    return tp.velocity(toks, heads, weights=ws, normalization=normalization)[:, 0]


def _random_case(g, normalization, beta, scale):
    d = int(torch.randint(2, 5, (1,), generator=g))
    n = int(torch.randint(2, 7, (1,), generator=g))
    H = int(torch.randint(1, 4, (1,), generator=g))
    A = scale * torch.randn(H, d, d, generator=g, dtype=F64)
    V = scale * torch.randn(H, d, d, generator=g, dtype=F64)
    heads = tp.Heads(A, V, torch.rand(H, generator=g, dtype=F64) + 0.1, beta)
    mu = tp.sphere.sample_uniform(n, d, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) + 0.05
    w = w / w.sum()
    # ν: moved tokens (small or large) and reweighting, so both parts of the bound are exercised
    move = float(torch.rand(1, generator=g)) ** 3
    nu = tp.sphere.normalize(mu + move * torch.randn(n, d, generator=g, dtype=F64))
    wn = w * (1 + float(torch.rand(1, generator=g)) * (torch.rand(n, generator=g, dtype=F64) - 0.5))
    wn = wn / wn.sum()
    x = tp.sphere.sample_uniform(1, d, generator=g, dtype=F64)
    y = tp.sphere.normalize(x + float(torch.rand(1, generator=g)) ** 2 * torch.randn(1, d, generator=g, dtype=F64))
    return heads, (mu, w), (nu, wn), x, y


@pytest.mark.parametrize("normalization", ["softmax", "unnormalized", "relu"])
def test_lipschitz_bound_is_never_exceeded(normalization):
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for beta in (0.1, 1.0, 5.0, 20.0):
        for scale in (0.1, 0.5, 1.5):
            for _ in range(8):
                heads, (mu, w), (nu, wn), x, y = _random_case(g, normalization, beta, scale)
                c = tp.theory.lipschitz_constants(heads, normalization)
                lhs = (_field_at(x, mu, w, heads, normalization) - _field_at(y, nu, wn, heads, normalization)).norm()
                W = tp.distance((mu, w), (nu, wn))
                dx = (x - y).norm()
                rhs = c["space"] * dx + c["measure"] * W
                worst = max(worst, float(lhs / rhs))
                Lmax = tp.theory.lipschitz_bound(heads, normalization, part="max")
                assert float(lhs) <= float(Lmax * (dx + W)) * (1 + 1e-12) + 1e-14
    assert worst <= 1.0 + 1e-12, worst


@pytest.mark.parametrize("normalization, factor", [("softmax", 1.05), ("unnormalized", 1.05), ("relu", 5.0)])
def test_lipschitz_bound_is_not_vacuous(normalization, factor):
    """At small β the bound is within the stated factor of measured ratios (and never below them): the space
    part seen from a point near a point mass, the measure part by moving the point mass.  A bound smaller by
    more than 5 % (softmax, unnormalized) fails the first assertion."""
    d, beta = 3, 0.01
    e = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    heads = tp.Heads.scalar([1.0], d, beta=beta).to(F64)
    c = tp.theory.lipschitz_constants(heads, normalization)
    x = torch.tensor([[0.0, 1.0, 0.0]], dtype=F64) if normalization != "relu" else \
        tp.sphere.normalize(torch.tensor([[1.0, 1.0, 0.0]], dtype=F64))
    y = tp.sphere.normalize(x + 1e-5 * e)
    one = torch.ones(1, dtype=F64)
    V = lambda p, m: _field_at(p, m, one, heads, normalization)  # noqa: E731
    ratio_x = float((V(x, e) - V(y, e)).norm() / (x - y).norm() / c["space"])
    e2 = tp.sphere.normalize(e + 1e-5 * torch.tensor([[0.0, 0.0, 1.0]], dtype=F64))
    ratio_mu = float((V(x, e) - V(x, e2)).norm() / tp.distance(e, e2) / c["measure"])
    for r in (ratio_x, ratio_mu):
        assert 1 / factor <= r <= 1 + 1e-9, (ratio_x, ratio_mu)
    torch.testing.assert_close(tp.theory.lipschitz_bound(heads, normalization), c["space"] + c["measure"])
    torch.testing.assert_close(tp.theory.lipschitz_bound(heads, normalization, part="max"),
                               torch.maximum(c["space"], c["measure"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lipschitz_constants_closed_form_and_dtype(dtype):
    """Scalar heads λI, v = |λ|, a = β|λ|: the formulas of docs/theorems.md, batched over heads batches."""
    lam = torch.tensor([[0.5, 2.0], [1.0, 3.0]], dtype=dtype)
    heads = tp.Heads.scalar(lam, 3, beta=0.5)
    c = tp.theory.lipschitz_constants(heads)
    a, v, w = 0.5 * lam, lam, 0.5
    torch.testing.assert_close(c["space"], (w * v * (1 + a)).sum(-1))
    torch.testing.assert_close(c["measure"], (w * v * torch.exp(a) * (1 + 2 * a)).sum(-1))
    assert c["space"].dtype == dtype and c["space"].shape == (2,)
    with pytest.raises(ValueError, match="normalization"):
        tp.theory.lipschitz_constants(heads, "effective")
    with pytest.raises(TypeError, match="Heads"):
        tp.theory.lipschitz_bound(torch.eye(3))


def test_gronwall_factor_closed_forms():
    t = torch.linspace(0, 2, 2001, dtype=F64)
    torch.testing.assert_close(tp.theory.gronwall_factor(t, 3 * torch.ones_like(t)), torch.exp(3 * t))
    # L = s: exp(t²/2); the trapezoid rule is exact for linear L
    torch.testing.assert_close(tp.theory.gronwall_factor(t, t.clone(), log=True), t ** 2 / 2)
    with pytest.raises(ValueError, match=">= 0"):
        tp.theory.gronwall_factor(t, -t)


@pytest.mark.parametrize("kind", ["rotated", "jittered", "reweighted"])
def test_perturbed_pairs_sit_at_distance_eps(kind):
    x = tp.sphere.sample_uniform(10, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    g = torch.Generator().manual_seed(2)
    for eps in (1e-1, 1e-3, 1e-6):
        y, wv = perturbed_pair(x, eps, kind, generator=g)
        W = float(tp.distance(x, (y, wv)))
        assert abs(W / eps - 1) < (1e-3 if kind == "reweighted" else 1e-8), (kind, eps, W)
        if kind != "reweighted":
            ident = float((y - x).square().sum(-1).mean().sqrt())  # the identity coupling: an upper bound
            assert W <= ident * (1 + 1e-12) and abs(W / ident - 1) < 1e-8


@pytest.mark.parametrize("kind", ["ou", "oscillating", "layerwise"])
def test_weight_perturbation_vanishes_with_eps(kind):
    heads = tp.Heads.random(2, 3, scale=0.5, generator=torch.Generator().manual_seed(0), dtype=F64)
    x = tp.sphere.sample_uniform(6, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    layers = [heads, tp.Heads.random(2, 3, scale=0.5, generator=torch.Generator().manual_seed(5), dtype=F64)]
    eps = [0.0, 1e-13, 1e-3, 1e-4]
    theta = perturbed_weights(kind, heads, eps, t1=0.4, dt=0.02, seed=3, layer_heads=layers)
    tr = tp.simulate(x.expand(len(eps), 6, 3).clone(), theta, t1=0.4, dt=0.02, method="rk4", diagnostics=False, direction="descent")
    # ε = 0 against the unperturbed process built independently
    if kind == "ou":
        base = tp.sample_path(tp.OrnsteinUhlenbeck(heads), t1=0.4, dt=0.02, seed=3)
    elif kind == "oscillating":
        base = tp.sample_path(tp.Custom(heads, lambda t, A: tp.oscillating_target(t, 3, 2, dtype=A.dtype) - A),
                              t1=0.4, dt=0.02)
    else:
        base = tp.Layerwise(layers, layer_time=0.2)
    ref = tp.simulate(x, base, t1=0.4, dt=0.02, method="rk4", diagnostics=False, direction="descent")
    torch.testing.assert_close(tr.x[:, 0], ref.x, rtol=1e-12, atol=1e-13)
    gap = (tr.x[-1, 1:] - tr.x[-1, :1]).norm(dim=-1).max(-1).values  # (3,)
    assert float(gap[0]) < 1e-11  # ε = 1e-13: the unperturbed run to rounding
    ratio = float(gap[1] / gap[2])  # ε = 1e-3 vs 1e-4: linear in ε
    assert 8 < ratio < 12.5, ratio


def _tetrahedron():
    v = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]], dtype=F64)
    return v / math.sqrt(3)


def test_hessian_at_known_critical_points():
    heads = tp.Heads.scalar([1.0], 3).to(F64)
    x = _tetrahedron()
    grad, H = riemannian_hessian(x, heads)
    assert float(grad.norm()) < 1e-12
    ev = torch.linalg.eigvalsh(H)
    tol = 1e-9 * float(ev.abs().max())
    assert float(ev.min()) > -tol and int((ev.abs() <= tol).sum()) == 3  # a minimum up to the 3 rotations
    # the quadratic form against a second difference of E along a tangent geodesic
    v = tp.sphere.tangent_projection(x, torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64))
    P = torch.eye(3, dtype=F64) - x[:, :, None] * x[:, None, :]
    B = torch.linalg.eigh(P)[1][..., 1:]
    u = torch.einsum("nda,nd->na", B, v).reshape(-1)
    h = 1e-4
    E = lambda s: tp.energy(tp.sphere.exp_map(x, s * v), heads)  # noqa: E731
    fd = (E(h) - 2 * E(0.0) + E(-h)) / h ** 2
    torch.testing.assert_close(u @ H @ u, fd, rtol=1e-5, atol=1e-9)
    # consensus: all tokens at one point is a maximum of E for A = I
    grad, H = riemannian_hessian(x[:1].expand(4, 3).clone(), heads)
    assert float(grad.norm()) < 1e-12 and float(torch.linalg.eigvalsh(H).max()) < 1e-12


def test_fast_weights_covariance_closed_form():
    heads = tp.Heads.random(2, 3, scale=0.5, generator=torch.Generator().manual_seed(0), dtype=F64)
    x = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    c = tp.theory.fast_weights_coefficients(x, heads, 0.7, direction="descent")
    torch.testing.assert_close(c["covariance"], c["basis_covariance"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c["drift"], tp.velocity(x, heads, direction="descent"))


def test_fast_weights_ito_correction_against_monte_carlo():
    """One fast layer of length δ with V = V̄ + s G/√δ: the antithetic mean displacement / δ is b + ½Dg(G)g(G) +
    O(δ), whose mean over G is the Itô drift b + c of tp.theory.fast_weights_coefficients; the covariance of the
    displacement / δ is the diffusion covariance."""
    H, d, n, M, delta, s = 1, 3, 4, 4000, 1e-3, 0.8
    heads = tp.Heads.random(H, d, scale=0.6, generator=torch.Generator().manual_seed(0), dtype=F64)
    x = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(1), dtype=F64)
    coef = tp.theory.fast_weights_coefficients(x, heads, s, direction="descent")
    G = torch.randn(M, H, d, d, generator=torch.Generator().manual_seed(2), dtype=F64)
    G = torch.cat([G, -G])
    V = heads.value_matrix + s * G / math.sqrt(delta)
    tr = tp.simulate(x.expand(2 * M, n, d).clone(), tp.Heads(heads.score_matrix, V, heads.weights, heads.beta),
                     t1=delta, dt=delta / 4, method="rk4", direction="descent", diagnostics=False)
    dx = tr.x[-1] - x  # (2M, n, d)
    ito = coef["drift"] + coef["correction"]
    mc = dx.mean(0) / delta
    se = (0.5 * (dx[:M] + dx[M:]) / delta).std(0) / math.sqrt(M)
    assert float(coef["correction"].norm()) > 10 * float(se.norm())  # the correction is resolved, not zero
    assert float((mc - ito).abs().max()) < 4 * float(se.max()) + 2e-2 * float(ito.abs().max())
    cov = torch.einsum("mia,mjb->ijab", dx, dx) / (2 * M) / delta
    torch.testing.assert_close(cov, coef["covariance"], rtol=1e-12, atol=0.06 * float(coef["covariance"].abs().max()))


def test_common_noise_sde_without_noise_is_heun():
    heads = tp.Heads.random(2, 3, scale=0.5, generator=torch.Generator().manual_seed(0), dtype=F64)
    x = tp.sphere.sample_uniform(5, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    K, dt = 20, 0.05
    xs = common_noise_sde(x[None], heads, torch.zeros(K, 1, 2, 3, 3, dtype=F64), dt, direction="descent")
    tr = tp.simulate(x, heads, t1=K * dt, dt=dt, method="heun", direction="descent", diagnostics=False)
    torch.testing.assert_close(xs[:, 0], tr.x, rtol=1e-12, atol=1e-13)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_limit_objects_refuse_bad_input_before_any_work(dtype):
    heads = tp.Heads.scalar([1.0], 3).to(dtype)
    x = _tetrahedron().to(dtype)
    with pytest.raises(ValueError, match=r"shape \(n, d\)"):
        riemannian_hessian(x.expand(2, 4, 3), heads)
    with pytest.raises(ValueError, match="unit sphere|normalise"):
        riemannian_hessian(2 * x, heads)
    inc = torch.zeros(3, 1, 1, 3, 3, dtype=dtype)
    with pytest.raises(ValueError, match="dt"):
        common_noise_sde(x[None], heads, inc, 0.0, direction="descent")
    with pytest.raises(TypeError, match="increments"):
        common_noise_sde(x[None], heads, [0.0], 0.1, direction="descent")
    xs = common_noise_sde(x[None], heads, inc, 0.1, direction="descent")  # dtype follows the input
    assert xs.dtype == dtype and xs.shape == (4, 1, 4, 3)


# ---------------------------------------------------------------------------- the studies through the CLI
STUDIES = {
    "theorem_stability_data": ["n=5", "seeds=2", "directions=8", "processes=[\"constant\", \"layerwise\"]",
                               "layers=2", "t1=0.4", "dt=0.05", "record_every=2", "tightness=1.6"],
    "theorem_stability_weights": ["n=5", "seeds=2", "eps=[1e-2, 1e-4]", "t1=0.2", "dt=0.02", "layers=2",
                                  "perturbations=[\"ou\", \"layerwise\"]"],
    "theorem_omega_limit": ["n=6", "ou_heads=[1, 10]", "stationary_samples=50", "t1=4.0", "dt=0.2", "layers=2",
                            "layer_time=1.0"],
    "theorem_fast_weights": ["n=4", "paths=16", "deltas=[0.1, 0.05]", "refine=2", "t1=0.2"],
}


@pytest.mark.parametrize("kind", list(STUDIES))
def test_theorem_studies_run_through_the_cli(kind, tmp_path):
    from transformer_pde.application.cli import main

    for cfg in (ROOT / f"{kind}_quick.toml", ROOT / f"{kind}.toml"):
        assert cfg.exists(), cfg
    args = ["run", str(ROOT / f"{kind}_quick.toml"), "--out", str(tmp_path), "--no-progress", "-qq"]
    for o in STUDIES[kind]:
        args += ["-o", o]
    assert main(args) == 0
    path = tmp_path / f"{kind}_quick"
    m = json.loads((path / "metrics.json").read_text())
    figs = sorted(p.suffix for p in (path / "figures").iterdir())
    assert ".png" in figs and ".pdf" in figs and m["figure_captions"]
    if kind in ("theorem_stability_data", "theorem_stability_weights"):
        for c in m["claims"]:
            assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
            assert c["seeds"] == 2 and c["value"] is not None
    if kind == "theorem_stability_data":
        # the worst case never exceeds its bound, random directions never exceed the worst case, and the worst
        # direction realised as a measure reproduces σ_1 through tp.simulate and POT (independent code paths)
        checked = [c for c in m["claims"] if "amplification" in c["name"] or "random directions" in c["name"]
                   or "exact W2" in c["name"] or "tightness" in c["name"]]
        assert len(checked) == 8 and all(c["holds"] for c in checked), checked
        amp = [c for c in m["claims"] if "amplification" in c["name"]]
        assert all(c["value"] <= c["reference"] for c in amp)
    if kind == "theorem_stability_weights":
        const = [c for c in m["claims"] if "constant sup_t" in c["name"]]
        # the constant never exceeds the Duhamel bound, which is not vacuous (measured 1.2 and 1.45 times the
        # constant here): tokens frozen at x_0 (W2 = 0), or the energy gap in place of W2, fail the second check
        assert len(const) == 2 and all(c["holds"] and c["value"] <= c["reference"] for c in const), const
        assert all(c["reference"] <= 3 * c["value"] for c in const), const
        frac = [c for c in m["claims"] if "due to the flow" in c["name"]]
        assert all(0 <= c["value"] <= 1 for c in frac)
        # the direct effect plus the flow's part is the total gap (the split is exhaustive)
        for k in ("ou", "layerwise"):
            tot, dire, flow = (m[k][f"sup_energy_{q}"] for q in ("total", "direct", "flow"))
            assert all(t <= a + b + 1e-15 for t, a, b in zip(tot, dire, flow))
    if kind == "theorem_omega_limit":
        assert set(m["limit_weights"]) == {"ou_H1", "ou_H10", "layerwise", "damped", "oscillating"}
        # one decay ratio and one Hessian count per token set, summarised as claims with their standard errors
        assert all(len(m[c]["residual_decay_seeds"]) == m["seeds"] == 8 for c in m["limit_weights"])
        assert len(m["claims"]) == 10 and all(c["seeds"] == 8 and c["error"] is not None for c in m["claims"])
        assert all("hessian_min" in m[c] and m[c]["clusters_T"] >= 1 for c in m["limit_weights"])
    if kind == "theorem_fast_weights":
        assert m["iid_strong"][1] < m["iid_strong"][0] and m["ou_strong"][1] < m["ou_strong"][0]


@pytest.mark.parametrize("kind", ["theorem_stability_data", "theorem_stability_weights"])
def test_stability_studies_in_float32(kind, tmp_path):
    """float32 runs (ε ≥ 1e-4) and keeps the bounds; smaller ε are refused before anything runs."""
    from transformer_pde.application.runs import execute

    base = ["n=5", "seeds=2", "t1=0.2", "dt=0.05", "record_every=2", "figures=false", "dtype=\"float32\""]
    extra = (["processes=[\"constant\"]", "directions=4", "eps=1e-3", "tightness=1.6"] if kind == "theorem_stability_data"
             else ["perturbations=[\"layerwise\"]", "layers=2", "eps=[1e-1, 1e-2, 1e-3]"])
    path = execute(ROOT / f"{kind}_quick.toml", overrides=base + extra, out_dir=tmp_path, progress=False)
    m = json.loads((path / "metrics.json").read_text())
    key = "amplification" if kind == "theorem_stability_data" else "constant"
    assert all(c["holds"] for c in m["claims"] if key in c["name"])
    bad = "eps=1e-6" if kind == "theorem_stability_data" else "eps=[1e-2, 1e-6]"
    with pytest.raises(ValueError, match="float32 cannot resolve"):
        execute(ROOT / f"{kind}_quick.toml", overrides=base + extra[:1] + [bad], out_dir=tmp_path, progress=False,
                name="bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("kind, override, match", [
    ("theorem_omega_limit", "ou_heads=[0, 10]", "distinct integers >= 1"),
    ("theorem_stability_data", "eps=0.5", "must be small"),
    ("theorem_stability_data", "layers=3", "t1/layers"),  # a layer boundary inside an RK4 step
    ("theorem_stability_weights", "eps=[0.1]", "at least two numbers"),
    ("theorem_stability_data", "dt=0.03", "whole number of steps"),
    ("theorem_fast_weights", "deltas=[0.1, 0.03]", "'deltas' = 0.03"),
    ("theorem_fast_weights", "deltas=[0.1, 0.0625]", "whole multiple"),
    ("theorem_stability_weights", "perturbations=[\"ou\", \"bogus\"]", "distinct values"),
])
def test_bad_configs_are_refused_before_anything_runs(kind, override, match, tmp_path):
    from transformer_pde.application.runs import execute

    with pytest.raises(ValueError, match=match):
        execute(ROOT / f"{kind}_quick.toml", overrides=[override], out_dir=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("norm", ["sinkhorn", "hardmax", "effective"])
def test_lipschitz_constants_refuse_normalisations_without_a_closed_form(norm):
    """The closed-form constants exist for softmax, unnormalised and ReLU heads only; a plan-based
    normalisation is refused by name instead of silently receiving the ReLU bound."""
    heads = tp.Heads.scalar([1.0, 2.0], 3).to(torch.float64)
    with pytest.raises(ValueError, match=norm):
        tp.theory.lipschitz_constants(heads, norm)
    assert torch.isfinite(tp.theory.lipschitz_constants(heads, "relu")["space"]).all()
