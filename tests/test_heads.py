"""transformer_pde.model.heads: the Heads container (docs/model.md#heads): its builders against the formulas
they document (symmetric, scalar, random, from_qkv), defaults (ω = 1/H, tied values), batch-shape
broadcasting, the symmetry flag (reference, known_symmetric, is_symmetric, assume_symmetric, replace),
transforms and the refusal of bad input."""

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from conftest import gen


def _sym(shape, seed, dtype):
    Z = torch.randn(shape, generator=gen(seed), dtype=torch.float64)
    return (Z + Z.transpose(-1, -2)).to(dtype)


# ---------------------------------------------------------------------------- builders
def test_symmetric_heads_tie_the_values_and_are_flagged_symmetric(dtype):
    D = _sym((3, 4, 4), 1, dtype)
    om = torch.tensor([0.2, 0.5, 1.3], dtype=dtype)
    h = tp.Heads.symmetric(D, beta=1.7, weights=om)
    assert h.tied and h.value is None
    assert h.score is D and h.score_matrix is D and h.value_matrix is D
    assert h.known_symmetric is True and h.is_symmetric
    assert (h.num_heads, h.dim, h.dtype, h.beta) == (3, 4, dtype, 1.7)
    assert_close(h.normalized_weights, om / om.sum(), rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_symmetric_refuses_a_matrix_that_is_not_symmetric():
    D = _sym((2, 3, 3), 2, torch.float64)
    D[1, 0, 2] += 1e-3
    with pytest.raises(ValueError, match=r"D is not symmetric \(max \|D - Dᵀ\| = 1\.00e-03\); use \(D \+ D\.mT\) / 2"):
        tp.Heads.symmetric(D)


def test_scalar_heads_are_multiples_of_the_identity(dtype):
    lam = torch.tensor([[0.5, -1.0], [2.0, 3.0]], dtype=dtype)  # a batch of 2, H = 2
    h = tp.Heads.scalar(lam, 3, beta=0.8)
    assert h.score.shape == (2, 2, 3, 3) and h.batch_shape == (2,)
    eye = torch.eye(3, dtype=dtype)
    for b in range(2):
        for k in range(2):
            # λ·1 and λ·0 are exact; a few ulps of |λ| allow for any kernel that computes them
            e = 4 * torch.finfo(dtype).eps
            assert_close(h.score[b, k], lam[b, k] * eye, rtol=e, atol=e * float(lam[b, k].abs()))
    assert h.is_symmetric and h.tied
    assert_close(h.weights, torch.full((2,), 0.5, dtype=dtype), rtol=0, atol=0)
    # a list of floats takes the default dtype
    assert tp.Heads.scalar([1.0, 2.0], 2).dtype == torch.get_default_dtype()


@pytest.mark.parametrize("bad", [1, True, 2.0])
def test_scalar_refuses_a_bad_dimension(bad):
    with pytest.raises(ValueError, match="dim must be an int >= 2"):
        tp.Heads.scalar([1.0], bad)


def test_random_symmetric_heads_are_scale_times_z_plus_z_transposed(dtype):
    """symmetric=True: A_h = V_h = scale·(Z + Zᵀ) with Z the generator's first normal draw."""
    h = tp.Heads.random(2, 3, scale=0.3, batch_shape=(4,), generator=gen(5), dtype=dtype, beta=2.0)
    Z = torch.randn(4, 2, 3, 3, generator=gen(5), dtype=dtype)
    assert h.score.shape == (4, 2, 3, 3) and h.batch_shape == (4,) and h.tied
    assert_close(h.score, 0.3 * (Z + Z.transpose(-1, -2)), rtol=2 * torch.finfo(dtype).eps, atol=0)
    assert h.known_symmetric is True


def test_random_non_symmetric_heads_draw_scores_then_values():
    h = tp.Heads.random(2, 3, symmetric=False, scale=0.5, generator=gen(6), dtype=torch.float64)
    g = gen(6)
    Z1 = torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
    Z2 = torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
    assert not h.tied
    assert_close(h.score, 0.5 * Z1, rtol=1e-15, atol=0)
    assert_close(h.value, 0.5 * Z2, rtol=1e-15, atol=0)
    assert h.known_symmetric is None and not h.is_symmetric


@pytest.mark.parametrize("kw,match", [(dict(num_heads=0), "num_heads must be an int >= 1"),
                                      (dict(num_heads=True), "num_heads must be an int >= 1"),
                                      (dict(dim=1), "dim must be an int >= 2")])
def test_random_refuses_bad_counts(kw, match):
    args = {"num_heads": 2, "dim": 3, **kw}
    with pytest.raises(ValueError, match=match):
        tp.Heads.random(args["num_heads"], args["dim"])


def test_from_qkv_forms_the_products_and_keeps_the_factors():
    """A_h = Q_hᵀ K_h, V_h = O_h W_{V,h}; keep_factors=False gives the same matrices without factors."""
    g = gen(7)
    Q = torch.randn(2, 2, 4, generator=g, dtype=torch.float64)
    K = torch.randn(2, 2, 4, generator=g, dtype=torch.float64)
    Wv = torch.randn(2, 2, 4, generator=g, dtype=torch.float64)
    O = torch.randn(2, 4, 2, generator=g, dtype=torch.float64)
    h = tp.Heads.from_qkv(Q, K, Wv, O, beta=0.7)
    assert h.score is None and h.query is Q and h.key is K and h.reference is Q
    A = torch.einsum("hkd,hke->hde", Q, K)
    V = torch.einsum("hdk,hke->hde", O, Wv)
    assert_close(h.score_matrix, A, rtol=1e-14, atol=1e-15)
    assert_close(h.value_matrix, V, rtol=1e-14, atol=1e-15)
    flat = tp.Heads.from_qkv(Q, K, Wv, O, beta=0.7, keep_factors=False)
    assert flat.query is None and flat.reference is flat.score
    assert_close(flat.score, A, rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="k_v != d: pass the output projection"):
        tp.Heads.from_qkv(Q, K, Wv)


# ---------------------------------------------------------------------------- shapes
def test_batch_shape_broadcasts_scores_weights_values_and_beta():
    A = torch.zeros(2, 1, 3, 4, 4, dtype=torch.float64)
    V = torch.zeros(1, 5, 3, 4, 4, dtype=torch.float64)
    w = torch.ones(5, 3, dtype=torch.float64)
    beta = torch.full((2, 1), 1.5, dtype=torch.float64)
    h = tp.Heads(A, V, w, beta)
    assert h.batch_shape == (2, 5)
    assert tp.Heads(A).batch_shape == (2, 1)
    # a one-element β tensor is stored 0-dimensional and adds no batch axis
    h1 = tp.Heads(A, beta=torch.tensor([[1.5]], dtype=torch.float64))
    assert h1.beta.shape == () and h1.batch_shape == (2, 1)
    assert h1.beta_tensor() is h1.beta
    bt = tp.Heads(A, beta=1.5).beta_tensor()
    assert bt.shape == () and bt.dtype == torch.float64 and float(bt) == 1.5
    with pytest.raises(ValueError, match="do not broadcast together"):
        tp.Heads(A, V, beta=torch.full((3,), 1.5, dtype=torch.float64))  # (2, 1), (1, 5) and (3,)


def test_default_weights_are_the_mean():
    h = tp.Heads(torch.zeros(4, 2, 2, dtype=torch.float32))
    assert h.weights.dtype == torch.float32
    assert_close(h.weights, torch.full((4,), 0.25), rtol=0, atol=0)  # 1/4 is exact
    e = 4 * torch.finfo(torch.float32).eps
    assert_close(h.normalized_weights, h.weights, rtol=e, atol=e * 0.25)


# ---------------------------------------------------------------------------- the symmetry flag
def test_is_symmetric_checks_once_and_caches():
    D = _sym((2, 3, 3), 8, torch.float64)
    h = tp.Heads(D)
    assert h.known_symmetric is None
    assert h.is_symmetric and h.known_symmetric is True
    A = D.clone()
    A[0, 0, 1] += 1e-12
    h2 = tp.Heads(A)
    assert not h2.is_symmetric and h2.known_symmetric is False


def test_assume_symmetric_shares_the_tensors_and_only_sets_the_flag():
    A = torch.randn(2, 3, 3, generator=gen(9), dtype=torch.float64)
    h = tp.Heads(A, weights=torch.tensor([0.3, 0.7], dtype=torch.float64), beta=1.2)
    s = h.assume_symmetric()
    assert s is not h and s.score is h.score and s.weights is h.weights and s.beta == h.beta
    assert s.known_symmetric is True and s.is_symmetric  # declared, not checked
    assert h.known_symmetric is None  # the original is unchanged
    again = s.assume_symmetric(None)
    assert again.known_symmetric is None and not again.is_symmetric  # checked again: A is not symmetric


def test_replace_swaps_fields_unchecked_and_declares_the_symmetry():
    D = _sym((2, 3, 3), 10, torch.float64)
    h = tp.Heads.symmetric(D, beta=1.3)
    A = torch.randn(2, 3, 3, generator=gen(11), dtype=torch.float64)
    r = h.replace(score=A)
    assert r.score is A and r.weights is h.weights and r.beta == 1.3 and r.value is None
    assert r.known_symmetric is None and not r.is_symmetric  # the old flag does not carry over
    r2 = h.replace(beta=2.5, symmetric=True)
    assert r2.beta == 2.5 and r2.score is D and r2.known_symmetric is True
    assert h.beta == 1.3  # the original is unchanged
    with pytest.raises(TypeError, match=r"Heads.replace got unknown fields \['temperature'\]"):
        h.replace(temperature=2.0)


def test_to_and_map_convert_every_tensor_and_keep_the_flag():
    h = tp.Heads.random(2, 3, symmetric=False, generator=gen(12), dtype=torch.float64,
                        beta=torch.tensor([1.0, 2.0], dtype=torch.float64))
    f = h.to(torch.float32)
    assert {t.dtype for t in (f.score, f.value, f.weights, f.beta)} == {torch.float32}
    assert_close(f.score.double(), h.score, rtol=torch.finfo(torch.float32).eps, atol=0)
    assert f.known_symmetric == h.known_symmetric
    s = tp.Heads.scalar([1.0], 2).detach()
    assert s.known_symmetric is True
    assert "H=2, d=3, batch_shape=(2,)" in repr(h) and "tied=False" in repr(h)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make,err,match", [
    (lambda A: tp.Heads(), ValueError, "give the score matrices A"),
    (lambda A: tp.Heads(A, query=A, key=A), ValueError, "not both"),
    (lambda A: tp.Heads(A[..., :2]), ValueError, r"score must have shape \(\.\.\., H, d, d\)"),
    (lambda A: tp.Heads(A, value=A[:1]), ValueError, r"value must have shape \(\.\.\., 2, 3, 3\)"),
    (lambda A: tp.Heads(A, weights=torch.ones(3, dtype=torch.float64)), ValueError, "with H = 2"),
    (lambda A: tp.Heads(A, weights=torch.tensor([1.0, -0.1], dtype=torch.float64)), ValueError, "must be >= 0"),
    (lambda A: tp.Heads(A, weights=torch.zeros(2, dtype=torch.float64)), ValueError, "must not all be zero"),
    (lambda A: tp.Heads(A, beta=float("nan")), ValueError, "beta must be finite"),
    (lambda A: tp.Heads(A, beta=torch.tensor([1.0, float("inf")], dtype=torch.float64)), ValueError,
     "beta must be finite"),
    (lambda A: tp.Heads(A, beta=torch.tensor([1, 2])), TypeError, "beta must be a float tensor"),
    (lambda A: tp.Heads(A, beta="1"), TypeError, "beta must be a real number"),
    (lambda A: tp.Heads(A.float(), weights=torch.ones(2, dtype=torch.float64)), TypeError, "weights"),
    (lambda A: tp.Heads(A.numpy()), TypeError, "score"),
])
def test_bad_heads_are_refused_with_what_was_wrong(make, err, match):
    A = torch.zeros(2, 3, 3, dtype=torch.float64)
    with pytest.raises(err, match=match):
        make(A)
