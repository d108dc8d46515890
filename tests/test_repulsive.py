"""Synchronisation on the circle for any sign of β and the repulsive study (docs/repulsive.md).

Independent checks: the closed-form Hessian of E on S¹ against autograd of ``tp.energy``; the −2/3 threshold of
three equal clusters (the Hessian's largest eigenvalue changes sign between −0.68 and −0.66 at n = 9, 12); the exact
binomial interval against its closed form at k = N; a synchronising (β = 1) and a non-synchronising (β = −1, perturbed
three clusters) batch of the study's runner; the study end to end through the command line."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.analysis.theory import synchronization as sy
from transformer_pde.application.studies import repulsive as rp

F64 = torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_circle_hessian_against_autograd_of_the_energy(dtype):
    """circle_gradient / circle_hessian equal the autograd derivatives of tp.energy(x(θ), A = I, β) at β = 1.3,
    −0.8 and 0 (the finite part), batched over two configurations with their own β."""
    th = (6 * torch.rand(2, 7, generator=torch.Generator().manual_seed(0), dtype=F64)).to(dtype)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-13)
    for b in (1.3, -0.8, 0.0):
        heads = tp.Heads.scalar(torch.ones(1, dtype=dtype), 2, beta=b)

        def E(t):
            return tp.energy(torch.stack([torch.cos(t), torch.sin(t)], -1), heads)

        for i in range(2):
            assert_close(sy.circle_hessian(th[i], b), torch.autograd.functional.hessian(E, th[i]), **tol)
            assert_close(sy.circle_gradient(th[i], b), torch.autograd.functional.jacobian(E, th[i]), **tol)
    bt = torch.tensor([1.3, -0.8], dtype=dtype)
    H = sy.circle_hessian(th, bt)
    assert_close(H[1], sy.circle_hessian(th[1], -0.8), **tol)


def test_three_equal_clusters_change_stability_at_minus_two_thirds():
    """n = 9 and 12: the equal three-cluster equilibrium (120° apart) has its largest Hessian eigenvalue
    (rotation removed) < 0 at β = −0.68 and > 0 at β = −0.66; the eigenvalue of the pair mode is proportional to
    3β/4 + 1/2, so it changes sign at −2/3."""
    for n in (9, 12):
        sizes = sy.balanced_sizes(n, 3)
        assert sizes == [n // 3] * 3
        tops = {}
        for b in (-0.68, -0.66):
            a = sy.cluster_equilibrium(sizes, b)
            assert_close(torch.diff(a), torch.full((2,), 2 * math.pi / 3, dtype=F64), rtol=0, atol=1e-8)
            tops[b] = float(sy.stability_spectrum(sy.cluster_configuration(sizes, a), b).max())
        assert tops[-0.68] < 0 < tops[-0.66], tops
    assert sy.proven_regime(-1.0) == "not globally" and sy.proven_regime(-0.5) == "open"
    assert sy.proven_regime(-0.16) == "synchronises" and sy.proven_regime(2.0) == "synchronises"


def test_clopper_pearson_and_cluster_sizes():
    """k = N: the exact interval is [(α/2)^{1/N}, 1]; k = 0: [0, 1 − (α/2)^{1/N}]; cluster sizes around the circle
    (a cluster split by the 2π seam counts once)."""
    lo, hi = rp.clopper_pearson(200, 200)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 200), rel=1e-10)
    lo, hi = rp.clopper_pearson(0, 50)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 50), rel=1e-10)
    th = torch.tensor([0.0, 1e-5, 2 * math.pi - 1e-5, 2.0, 2.0, 4.0], dtype=F64)
    assert rp.cluster_sizes(th) == (3, 2, 1)


def test_a_synchronising_and_a_non_synchronising_batch():
    """β = 1: 64 uniform starts of n = 8 all synchronise; β = −1: 32 perturbations (ε = 0.02) of three equal
    clusters of n = 9 all return to three clusters at rest, every one a strict local maximum of E (Hessian)."""
    r = rp.basins(8, [1.0], 64, t_segment=10.0, t_max=100.0, seed=3)
    assert bool((r["status"] == 0).all())
    sizes = [3, 3, 3]
    base = sy.cluster_configuration(sizes, sy.cluster_equilibrium(sizes, -1.0))
    th0 = base + 0.02 * torch.randn(1, 32, 9, generator=torch.Generator().manual_seed(4), dtype=F64)
    r = rp.basins(9, [-1.0], 32, t_segment=20.0, t_max=400.0, theta0=th0)
    assert bool((r["status"] == 1).all())
    assert all(rp.cluster_sizes(t) == (3, 3, 3) for t in r["theta"][0])
    assert bool((sy.stability_spectrum(r["theta"][0], -1.0) < 0).all())


def test_quick_config_through_the_command_line(tmp_path):
    """The quick config, made tiny, runs through the CLI: claims with exact binomial intervals, the proved range
    synchronises, the constructed equal clusters change stability at −2/3, the figures are written."""
    from transformer_pde.application.cli import main as cli_main

    over = ["ns=[8]", "betas=[-1.0, 0.0, 1.0]", "starts=40", "t_max=100.0", "cluster_ns=[9]",
            "cluster_betas=[-1.0, -0.6]", "local_starts=8"]
    args = ["run", "experiments/repulsive_quick.toml", "--out", str(tmp_path), "--name", "r", "--no-progress", "-qq"]
    for o in over:
        args += ["--override", o]
    assert cli_main(args) == 0
    m = json.loads((tmp_path / "r" / "metrics.json").read_text())
    claims = m["claims"]
    for c in claims:
        assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
    sync = [c for c in claims if c["name"].startswith("fraction synchronised") and c["reference"] == 1.0]
    assert len(sync) == 2 and all(c["holds"] and c["seeds"] == 40 for c in sync)
    eq = [c for c in claims if c["name"].startswith("three equal clusters")]
    assert len(eq) == 2 and all(c["holds"] for c in eq)
    back = [c for c in claims if c["name"].startswith("perturbed three clusters")]
    assert len(back) == 1 and back[0]["holds"]
    assert (tmp_path / "r" / "figures" / "synchronisation.png").exists()
