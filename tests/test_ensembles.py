"""Ensembles (transformer_pde.analysis.ensembles): the laws of the random heads, and an ensemble of B
systems in one call equal to B separate calls."""

import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde import ensembles as ens

DTYPES = [torch.float32, torch.float64]


def test_laws_moments_and_symmetry():
    gen = torch.Generator().manual_seed(0)
    d, N, s = 6, 4000, 1.5
    iu = torch.triu_indices(d, d, 1)
    for law in ens.LAWS:
        A = ens.random_matrices((N,), d, law=law, scale=s, generator=gen, dtype=torch.float64)
        assert A.shape == (N, d, d)
        off = A[:, iu[0], iu[1]].reshape(-1)
        diag = A.diagonal(dim1=-2, dim2=-1).reshape(-1)
        var_off, var_diag = s * s / d, (s * s / d if law != "goe" else 2 * s * s / d)
        # sample variances within 6 standard errors (Var of a sample variance: 2σ⁴/m for a Gaussian, ≤ that otherwise)
        for v, target in ((off, var_off), (diag, var_diag)):
            se = target * math.sqrt(2 / v.numel())
            assert abs(float(v.var()) - target) < 6 * se, (law, float(v.var()), target)
            assert abs(float(v.mean())) < 6 * math.sqrt(target / v.numel())
        if law in ("goe", "wigner"):
            torch.testing.assert_close(A, A.transpose(-1, -2), rtol=0, atol=0)
        else:
            assert not torch.equal(A, A.transpose(-1, -2))
        if law == "wigner":  # Rademacher entries ±σ/√d
            torch.testing.assert_close(A.abs(), torch.full_like(A, s / math.sqrt(d)))
    # the semicircle edge: the largest GOE eigenvalue is close to 2σ for large d
    A = ens.random_matrices((8,), 200, law="goe", scale=1.0, generator=gen, dtype=torch.float64)
    lmax = torch.linalg.eigvalsh(A)[:, -1]
    assert float((lmax - 2).abs().max()) < 0.25


@pytest.mark.parametrize("values", ens.VALUES)
def test_values(values):
    gen = torch.Generator().manual_seed(1)
    h = ens.random_heads(5, 3, 4, law="goe", values=values, generator=gen, dtype=torch.float64)
    assert tuple(h.batch_shape) == (5,) and h.num_heads == 3 and h.dim == 4
    A, V = h.score_matrix, h.value_matrix
    if values == "+A":
        assert h.tied and h.is_symmetric
    elif values == "-A":
        torch.testing.assert_close(V, -A)
    elif values == "identity":
        torch.testing.assert_close(V, torch.eye(4, dtype=torch.float64).expand_as(V))
    else:
        assert not torch.allclose(V, A)
        torch.testing.assert_close(V, V.transpose(-1, -2))  # same (symmetric) law


def test_bad_arguments_refused():
    with pytest.raises(ValueError, match="law"):
        ens.random_heads(4, 1, 3, law="cauchy")
    with pytest.raises(ValueError, match="values"):
        ens.random_heads(4, 1, 3, values="A")
    with pytest.raises(ValueError, match="ensemble size"):
        ens.random_heads(0, 1, 3)
    x0 = tp.sphere.sample_uniform(5, 3, batch_shape=(4,), dtype=torch.float64)
    h = ens.random_heads(3, 1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch shape"):
        ens.simulate(x0, h, t1=0.1, dt=0.05)
    with pytest.raises(ValueError, match=r"\(B, n, d\)"):
        ens.simulate(x0[0], ens.random_heads(1, 1, 3, dtype=torch.float64), t1=0.1, dt=0.05)


def _member(theta_kind, heads, b, beta_b):
    hb = tp.Heads(heads.score[b], None if heads.tied else heads.value[b], None, beta_b)
    if theta_kind == "constant":
        return hb
    if theta_kind == "ou":
        return tp.OrnsteinUhlenbeck(hb, sigma=0.0)
    return tp.Oscillating(hb, phase="per_head")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("theta_kind,law,values", [("constant", "gaussian", "random"), ("ou", "goe", "+A"),
                                                    ("oscillating", "wigner", "identity"), ("constant", "goe", "-A")])
def test_ensemble_equals_separate_calls(dtype, theta_kind, law, values):
    B, H, n, d = 5, 2, 6, 4
    gen = torch.Generator().manual_seed(2)
    betas = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0], dtype=dtype)
    heads = ens.random_heads(B, H, d, law=law, values=values, beta=betas, generator=gen, dtype=dtype)
    x0 = ens.random_tokens(B, n, d, generator=gen, dtype=dtype)
    theta = _member(theta_kind, heads, slice(None), betas)
    diag = heads.tied  # the energy ledger needs tied heads
    kw = dict(t1=0.6, dt=0.05, method="heun", direction="ascent", record_every=3, ledger=diag)
    traj = ens.simulate(x0, theta, diagnostics=diag, **kw)
    assert traj.x.shape == (5, B, n, d)
    for b in range(B):
        one = tp.simulate(x0[b], _member(theta_kind, heads, b, float(betas[b])), diagnostics=diag, **kw)
        torch.testing.assert_close(traj.x[:, b], one.x)
        if diag:
            torch.testing.assert_close(traj.energy[:, b], one.energy)
            torch.testing.assert_close(traj.ledger["residual"][:, b], one.ledger["residual"])


def test_noisy_ensemble_members_are_independent():
    """Identical members under OU noise diverge (each member draws its own noise), and the
    ensemble has the law of separate runs: the same stream replayed member by member."""
    B, H, n, d = 4, 1, 5, 3
    x0 = ens.random_tokens(1, n, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64).expand(B, n, d)
    A = torch.eye(d, dtype=torch.float64).expand(B, H, d, d).clone()
    theta = tp.OrnsteinUhlenbeck(tp.Heads(A), sigma=1.0)
    traj = ens.simulate(x0, theta, t1=1.0, dt=0.05, seed=7, direction="ascent", diagnostics=False,
                        return_path=True)
    xs = traj.x[-1]
    assert float((xs[0] - xs[1]).abs().max()) > 1e-3
    for b in range(B):  # replaying member b's weight path alone gives member b
        path_b = traj.path
        one = tp.simulate(x0[b], tp.WeightPath(path_b.times, path_b.scores[:, b], path_b.rates[:, b],
                                               None if path_b.noise is None else path_b.noise[:, b],
                                               path_b.sigmas, tp.Heads(A[b])),
                          t1=1.0, dt=0.05, direction="ascent", diagnostics=False)
        torch.testing.assert_close(one.x[-1], xs[b])


# ---------------------------------------------------------------------------- the law across members
# The tests above check shapes, the law of the matrix sampler pooled over all entries, and that a
# batched run equals separate runs *of the same heads*.  None of them sees an ensemble whose members
# all share one draw: these check the law across members — members pairwise different, every entry's
# mean and second moment over the members as the sampler's law says, members (and heads within a
# member) uncorrelated — with bounds derived from the sample size, and prove that they catch a
# sampler that reuses one draw.
from scipy import stats  # noqa: E402

ALPHA = 1e-7  # family-wise false-alarm probability of each check (Bonferroni over the entries)


def _z_bound(k):
    """|z| bound for k standard-normal scores such that P(any exceeds it) <= ALPHA."""
    return float(stats.norm.isf(ALPHA / (2 * k)))


def _check_chi2(z, what):
    """Σ z² of k independent N(0, 1) scores is χ²_k: both tails at level ALPHA (too spread or too tight)."""
    k = z.numel()
    q = float((z ** 2).sum())
    lo, hi = stats.chi2.ppf(ALPHA / 2, k), stats.chi2.isf(ALPHA / 2, k)
    assert lo < q < hi, f"{what}: Σz² = {q:.1f} outside the χ²_{k} range [{lo:.1f}, {hi:.1f}]"


def _assert_members_follow_the_law(A, law, scale):
    """A (B, H, d, d): B members' score matrices under ``law``, each an independent draw."""
    B, H, d = A.shape[0], A.shape[1], A.shape[-1]
    flat = A.reshape(B, -1)
    # 1. members pairwise different (continuous laws: equal with probability 0; Rademacher with d = 5,
    #    H = 2: 2^30 sign patterns per member, a coincidence among B = 1000 members has probability ~5e-4)
    same = (flat.unsqueeze(0) == flat.unsqueeze(1)).all(-1)
    same.fill_diagonal_(False)
    assert not bool(same.any()), f"{int(same.sum()) // 2} pairs of members have identical heads"
    # the free entries: all of them, or the upper triangle of the symmetric laws
    iu = torch.triu_indices(d, d, 0) if law != "gaussian" else torch.cartesian_prod(torch.arange(d), torch.arange(d)).T
    E = A[:, :, iu[0], iu[1]].reshape(B, -1).double()  # (B, k)
    diag = (iu[0] == iu[1]).repeat(H)
    var = torch.full((E.shape[1],), scale ** 2 / d, dtype=torch.float64)
    if law == "goe":
        var[diag] = 2 * scale ** 2 / d
    k = E.shape[1]
    # 2. each entry's mean over the members: N(0, var/B) by the CLT
    z_mean = E.mean(0) / (var / B).sqrt()
    assert float(z_mean.abs().max()) < _z_bound(k), f"entry means over members off: max |z| = {float(z_mean.abs().max()):.1f}"
    _check_chi2(z_mean, "entry means over members")
    # 3. each entry's second moment over the members: mean of a² has sd <= sqrt(2 var²/B) (Gaussian
    #    fourth moment 3 var²; Rademacher var², smaller) — a conservative bound for every law
    z_var = (E.square().mean(0) - var) / (2 * var ** 2 / B).sqrt()
    assert float(z_var.abs().max()) < _z_bound(k), f"entry variances over members off: max |z| = {float(z_var.abs().max()):.1f}"
    # 4. uncorrelated members (neighbours b, b + 1) and heads (h = 0 vs 1): sample correlation r of
    #    independent pairs has √m·r → N(0, 1)
    def corr_z(u, v):
        u, v = u - u.mean(0), v - v.mean(0)
        r = (u * v).sum(0) / (u.square().sum(0) * v.square().sum(0)).sqrt()
        return r * math.sqrt(u.shape[0])

    E4 = A.reshape(B, H, d, d)[:, :, iu[0], iu[1]].double()  # (B, H, k/H)
    for z, what in ((corr_z(E[0::2], E[1::2]), "neighbouring members"), (corr_z(E4[:, 0], E4[:, 1]), "heads")):
        assert bool(torch.isfinite(z).all()), f"{what}: an entry does not vary"
        assert float(z.abs().max()) < _z_bound(z.numel()), f"{what} correlated: max |z| = {float(z.abs().max()):.1f}"


ENSEMBLE = dict(B=1000, H=2, d=5, scale=1.5)


@pytest.mark.parametrize("law", ens.LAWS)
@pytest.mark.parametrize("values", ["+A", "random"])
def test_members_are_independent_draws_of_the_law(law, values):
    B, H, d, s = ENSEMBLE["B"], ENSEMBLE["H"], ENSEMBLE["d"], ENSEMBLE["scale"]
    h = ens.random_heads(B, H, d, law=law, values=values, scale=s, generator=torch.Generator().manual_seed(11),
                         dtype=torch.float64)
    _assert_members_follow_the_law(h.score_matrix, law, s)
    if values == "random":  # the values: an independent draw of the same law, independent of the scores
        V = h.value_matrix
        _assert_members_follow_the_law(V, law, s)
        flatA, flatV = h.score_matrix.reshape(B, -1), V.reshape(B, -1)
        a, v = flatA - flatA.mean(0), flatV - flatV.mean(0)
        z = (a * v).sum(0) / (a.square().sum(0) * v.square().sum(0)).sqrt() * math.sqrt(B)
        assert float(z.abs().max()) < _z_bound(z.numel())


def test_the_law_check_catches_a_sampler_that_reuses_one_draw(monkeypatch):
    """The checks above fail when random_heads gives every member the same draw,
    and when neighbouring members share a draw."""
    B, H, d, s = ENSEMBLE["B"], ENSEMBLE["H"], ENSEMBLE["d"], ENSEMBLE["scale"]
    real = ens.random_matrices

    def one_draw(shape, dim, **kw):  # one (H, d, d) draw, copied to every member
        return real(tuple(shape)[-1:], dim, **kw).expand(*shape, dim, dim).clone()

    def pairs(shape, dim, **kw):  # members 2b and 2b+1 share a draw: half as many draws as members
        half = real((shape[0] // 2,) + tuple(shape[1:]), dim, **kw)
        return half.repeat_interleave(2, dim=0)

    for fake, msg in ((one_draw, "identical heads"), (pairs, "identical heads")):
        monkeypatch.setattr(ens, "random_matrices", fake)
        for law in ens.LAWS:
            h = ens.random_heads(B, H, d, law=law, scale=s, generator=torch.Generator().manual_seed(11),
                                 dtype=torch.float64)
            with pytest.raises(AssertionError, match=msg):
                _assert_members_follow_the_law(h.score_matrix, law, s)
    # and without the pairwise test, the moments alone catch the shared draw
    monkeypatch.setattr(ens, "random_matrices", one_draw)
    A = ens.random_heads(B, H, d, law="goe", scale=s, generator=torch.Generator().manual_seed(11),
                         dtype=torch.float64).score_matrix
    A = A + 1e-9 * torch.randn(A.shape, generator=torch.Generator().manual_seed(0), dtype=A.dtype)  # break ties
    with pytest.raises(AssertionError, match="over members off"):
        _assert_members_follow_the_law(A, "goe", s)


def _assert_tokens_uniform_across_members(X):
    """X (B, n, d): members' tokens, i.i.d. uniform on S^{d-1}: E x = 0, E x_k² = 1/d,
    Var x_k = 1/d, Var x_k² = 3/(d(d+2)) − 1/d²."""
    B, n, d = X.shape
    flat = X.reshape(B, -1)
    same = (flat.unsqueeze(0) == flat.unsqueeze(1)).all(-1)
    same.fill_diagonal_(False)
    assert not bool(same.any()), f"{int(same.sum()) // 2} pairs of members have identical tokens"
    k = flat.shape[1]
    z_mean = flat.mean(0) / math.sqrt(1 / (d * B))
    assert float(z_mean.abs().max()) < _z_bound(k), "token means over members off"
    _check_chi2(z_mean, "token means over members")
    v4 = 3 / (d * (d + 2)) - 1 / d ** 2
    z_sq = (flat.square().mean(0) - 1 / d) / math.sqrt(v4 / B)
    assert float(z_sq.abs().max()) < _z_bound(k), "token second moments over members off"


def test_random_tokens_members_are_independent_uniform_draws(monkeypatch):
    B, n, d = 1000, 3, 3
    X = ens.random_tokens(B, n, d, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    _assert_tokens_uniform_across_members(X)
    real = tp.sphere.sample_uniform

    def one_draw(n, d, *, batch_shape=(), **kw):
        return real(n, d, **kw).expand(*batch_shape, n, d).clone()

    monkeypatch.setattr(tp.sphere, "sample_uniform", one_draw)
    X = ens.random_tokens(B, n, d, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    with pytest.raises(AssertionError, match="identical tokens"):
        _assert_tokens_uniform_across_members(X)


def test_sampler_arguments_refused_before_drawing():
    """Refused with ValueError before torch sees them (torch would raise a raw RuntimeError /
    NotImplementedError / TypeError)."""
    with pytest.raises(ValueError, match="shape"):
        ens.random_matrices((-1,), 3)
    with pytest.raises(ValueError, match="shape"):
        ens.random_matrices((2.5,), 3)
    with pytest.raises(ValueError, match="shape"):
        ens.random_matrices("ab", 3)
    assert ens.random_matrices(2, 3, dtype=torch.float64).shape == (2, 3, 3)  # an int is a 1-D shape
    assert ens.random_matrices((0,), 3, dtype=torch.float64).shape == (0, 3, 3)  # an empty sample is a sample
    for fn in (lambda **kw: ens.random_matrices((2,), 3, **kw), lambda **kw: ens.random_heads(2, 1, 3, **kw),
               lambda **kw: ens.random_tokens(2, 3, 3, **kw)):
        with pytest.raises(TypeError, match="dtype"):
            fn(dtype=torch.int64)
        with pytest.raises(TypeError, match="generator"):
            fn(generator=5)
