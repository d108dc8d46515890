"""Sinkhorn attention (tp.SinkhornAttention, the name "sinkhorn"): by default the plan is iterated to a
tolerance, not a fixed count, and it matches an independent Sinkhorn solver (POT) at convergence; schedules
that cannot end (or are not schedules) are refused before any work."""

import warnings

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.model.plans import plan_average, sinkhorn_tolerance
from conftest import gen

ot = pytest.importorskip("ot")


def _case(dtype, n=10, beta=2.0, seed=0):
    heads = tp.Heads.random(2, 3, beta=beta, generator=gen(seed), dtype=torch.float64).to(dtype)
    x = tp.sphere.sample_uniform(n, 3, generator=gen(seed + 1), dtype=torch.float64).to(dtype)
    w = torch.rand(n, generator=gen(seed + 2), dtype=torch.float64) + 0.5
    return heads, x, (w / w.sum()).to(dtype)


def _pot_average(x, heads, w):
    """Σ_j P_ij^h x_j with π^h = diag(w) P^h the entropic coupling of POT (cost −s_ij, reg 1, both marginals
    w), P^h_ij = π^h_ij / w_i: an independent solver, in float64."""
    X, W = x.double().numpy(), w.double().numpy()
    out = []
    for A in (heads.beta_tensor().double() * heads.score_matrix.double()).numpy():
        s = X @ A @ X.T
        pi = ot.sinkhorn(W, W, -s, reg=1.0, method="sinkhorn_log", stopThr=1e-15, numItermax=200000)
        out.append((pi / W[:, None]) @ X)
    return torch.as_tensor(np.stack(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_default_plan_is_converged_against_pot(dtype):
    """The default (tolerance) plan average equals POT's converged one to the dtype's tolerance, and so does
    the name "sinkhorn"; ten fixed rounds (the former default) are measurably further away here."""
    heads, x, w = _case(dtype)
    ref = _pot_average(x, heads, w)
    tol = 50 * sinkhorn_tolerance(dtype) + 100 * torch.finfo(dtype).eps
    got = plan_average(x, heads, w, "sinkhorn").double()
    assert_close(got, ref, rtol=0, atol=tol)
    ten = plan_average(x, heads, w, "sinkhorn", iterations=10).double()
    far = float((ten - ref).abs().max())
    assert far > 1e-3 and far > 10 * float((got - ref).abs().max()), far  # the fixed count was not converged
    v_name = tp.velocity(x, heads, w, normalization="sinkhorn")
    v_obj = tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(tol=float(sinkhorn_tolerance(dtype))))
    assert_close(v_name, v_obj, rtol=0, atol=10 * torch.finfo(dtype).eps)


def test_tolerance_is_honoured_and_the_cap_warns():
    """A looser tol stops earlier, within its tolerance of the converged plan's columns; a cap too small for the
    tolerance warns (RuntimeWarning) instead of running on."""
    heads, x, w = _case(torch.float64, beta=4.0)
    ref = _pot_average(x, heads, w)
    loose = plan_average(x, heads, w, "sinkhorn", tol=1e-3)
    err = float((loose - ref).abs().max())
    assert 1e-9 < err < 1e-2, err
    with pytest.warns(RuntimeWarning, match="max_iterations"):
        tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(max_iterations=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=0))  # a fixed count: no warning
    assert_close(tp.velocity(x, heads, w, normalization=tp.SinkhornAttention(iterations=0)),
                 tp.velocity(x, heads, w, normalization="softmax"), rtol=1e-12, atol=1e-12)  # 0 rounds: softmax


@pytest.mark.parametrize("kw, match", [
    (dict(iterations=10 ** 12), "int in \\[0, 100000\\]"),
    (dict(iterations=1e12), "int in \\[0, 100000\\]"),
    (dict(iterations=-1), "int in \\[0, 100000\\]"),
    (dict(tol=0.0), "tol must be a finite float > 0"),
    (dict(tol=float("nan")), "tol must be a finite float > 0"),
    (dict(max_iterations=10 ** 12), "max_iterations must be an int"),
    (dict(iterations=5, tol=1e-6), "not both"),
])
def test_schedules_that_cannot_end_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        tp.SinkhornAttention(**kw)
