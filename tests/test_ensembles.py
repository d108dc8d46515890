"""Ensembles (transformer_pde.ensembles): the laws of the random heads, and an ensemble of B
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
    kw = dict(t1=0.6, dt=0.05, method="heun", direction="ascent", record_every=3)
    diag = heads.tied  # the energy ledger needs tied heads
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
