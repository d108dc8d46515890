"""The critical attention scaling study and its closed forms (docs/critical_scaling.md).

Independent checks: the library's attention on exact simplex scores against the closed form 1/(1 + (n−1)n^{−γ(1−ρ)});
the two-dimensional representation of the keys against the full tokens; the exact score law against the
annealed moment κ_0 (Monte Carlo vs the hypergeometric formula); the blockwise merge against one kernel call;
the Jacobian of one layer against autograd; the study end to end through the command line."""

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.analysis.theory import scaling as ts
from transformer_pde.application.studies import critical_scaling as cs

F64 = torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_simplex_self_weight_from_the_library_equals_the_closed_form(dtype):
    """Keys with scores exactly ρ against the query (and 1 for itself), β = γ log n by tp.LogScaling: the self
    weight of softmax_statistics is 1/(1 + (n − 1) n^{−γ(1−ρ)}) at n = 10 and 2000, γ on both sides of γ_c."""
    rho = 0.4
    for n in (10, 2000):
        s = torch.full((n,), rho, dtype=dtype)
        s[0] = 1.0
        gam = torch.tensor([0.5, 1.0, 1 / (1 - rho), 2.5], dtype=dtype)
        got = cs._self_weights(s, gam)
        want = ts.simplex_self_weight(gam.double(), rho, n)
        assert_close(got.double(), want, rtol=1e-4 if dtype == torch.float32 else 1e-12, atol=1e-7)
    assert ts.critical_gamma(rho) == pytest.approx(1 / 0.6)


def test_keys_on_the_circle_reproduce_the_full_tokens():
    """The self weight of token 0 of 300 almost-simplex tokens in R^8 is the same from the full keys and from the
    keys (s_j, √(1 − s_j²)) on S¹ built from its scores."""
    Y = ts.almost_simplex(300, 8, 0.3, generator=torch.Generator().manual_seed(3))
    assert_close(Y.norm(dim=-1), torch.ones(300, dtype=F64))
    off = (Y @ Y.T)[~torch.eye(300, dtype=torch.bool)]
    assert abs(float(off.mean()) - 0.3) < 0.02  # pairwise inner products ρ on average
    gam = torch.tensor([0.8, 1.5, 2.4], dtype=F64)
    heads = tp.Heads(torch.eye(8, dtype=F64)[None], beta=tp.LogScaling(gam)).at_context(300)
    lse = tp.softmax_statistics(Y[:1], heads, keys=Y).log_partition.reshape(-1)
    full = torch.exp(heads.beta - math.log(300) - lse)
    assert_close(cs._self_weights(Y @ Y[0], gam), full)


def test_score_law_against_the_annealed_moment():
    """E e^{aζ} of the sampled scores (ζ = (s − ρ)/(1 − ρ), 2·10⁵ draws) equals κ_0(a; d − 1) = ₀F₁(; (d−1)/2; a²/4)
    within 4 standard errors, at d = 5 and 40; the full-vector sampler gives the same mean."""
    for d, a in ((5, 2.0), (40, 3.0)):
        s = ts.almost_simplex_scores(200001, d, 0.2, seed=d)[1:]
        z = (s - 0.2) / 0.8
        e = torch.exp(a * z)
        want = float(np.exp(ts._log_kappa0(np.array(a), d - 1)))
        assert abs(float(e.mean()) - want) < 4 * float(e.std() / math.sqrt(e.numel())), (d, float(e.mean()), want)
    Y = ts.almost_simplex(100001, 5, 0.2, generator=torch.Generator().manual_seed(1))
    zf = ((Y[1:] @ Y[0]) - 0.2) / 0.8
    ef = torch.exp(2.0 * zf)
    want = float(np.exp(ts._log_kappa0(np.array(2.0), 4)))
    assert abs(float(ef.mean()) - want) < 4 * float(ef.std() / math.sqrt(ef.numel()))


def test_annealed_crossing_tends_to_the_critical_gamma():
    """γ*(1 − ρ) of the annealed self weight → 1 as d → ∞, with the leading correction log n/(2(d − 1))."""
    n = 10 ** 5
    L = math.log(n)
    for d in (2000, 20000):
        u = ts.annealed_critical_gamma(0.5, n, d) * 0.5
        assert u - 1 == pytest.approx(L / (2 * (d - 1)), rel=0.05)
    assert ts.annealed_self_weight(2.0, 0.5, n, 10 ** 7) == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="rho"):
        ts.critical_gamma(1.0)
    with pytest.raises(ValueError, match="d must be"):
        ts.annealed_self_weight(1.0, 0.0, 100, 2)


def test_blocks_merge_to_one_kernel_call():
    """streamed_attention over key blocks gives the log-partition and mean of one softmax_statistics call."""
    g = torch.Generator().manual_seed(0)
    Y = tp.sphere.sample_uniform(1000, 6, generator=g, dtype=F64)
    Q = tp.sphere.sample_uniform(3, 6, generator=g, dtype=F64)
    heads = tp.Heads(torch.eye(6, dtype=F64)[None], beta=torch.tensor([0.5, 4.0, -2.0], dtype=F64))
    lse, mean, ksum, n = cs.streamed_attention(Q, heads, (Y[i:i + 137] for i in range(0, 1000, 137)))
    st = tp.softmax_statistics(Q, heads, keys=Y)
    assert n == 1000
    assert_close(lse, st.log_partition[:, 0])
    assert_close(mean, st.mean[:, 0])
    assert_close(ksum, Y.sum(0))


def test_layer_jacobian_against_autograd():
    """The layer's Jacobian along tangent u (the query's part by central differences of the library's softmax mean,
    the token's own key analytically) against autograd of ATT(y_q) = Σ_j softmax_j(β⟨y_q, y_j⟩) y_j in which y_q
    is both the query and key 0; the self weight and the two distances against the same dense formula."""
    n, d, rho = 400, 6, 0.3
    gam = torch.tensor([0.7, 1.4, 2.5], dtype=F64)
    out = cs.layer_measurements(n, d, rho, gam, directions=3, block=128, seed=5)
    Y = torch.cat(list(cs._blocks(n, d, rho, 128, 5, F64)))
    U = torch.randn(3, d, generator=torch.Generator().manual_seed(6), dtype=F64)
    q = Y[0]
    U = tp.sphere.normalize(U - (U @ q).unsqueeze(-1) * q)
    for k, g in enumerate(gam):
        beta = float(g) * math.log(n)

        def att(y0):
            keys = torch.cat([y0[None], Y[1:]])
            return torch.softmax(beta * (keys @ y0), 0) @ keys

        J = torch.autograd.functional.jacobian(att, q)
        p = torch.softmax(beta * (Y @ q), 0)
        a = p @ Y
        assert out["self_weight"][k] == pytest.approx(float(p[0]), rel=1e-10)
        assert out["dist_mean"][k] == pytest.approx(float((a - Y.mean(0)).norm()), rel=1e-10)
        assert out["dist_identity"][k] == pytest.approx(float((a - q).norm()), rel=1e-10)
        want = (J @ U.T).T.square().sum(-1).mean().sqrt()
        assert out["jacobian"][k] == pytest.approx(float(want), rel=1e-6)


def test_uniform_key_crossing_puts_half_the_weight_on_the_nearest_key():
    """At β* = c*·n^{2/(d−1)} the nearest key's weight (a dense softmax) is 1/2."""
    for d in (3, 5):
        n, seed = 3000, 11
        logc = cs.uniform_key_crossing(n, d, seed)
        Y = tp.sphere.sample_uniform(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)
        beta = math.exp(logc) * n ** ts.uniform_key_exponent(d)
        p = torch.softmax(beta * Y[:, 0], 0)
        assert float(p.max()) == pytest.approx(0.5, abs=1e-4)


def test_quick_config_through_the_command_line(tmp_path):
    """The quick config, made tiny, runs through the CLI: every number is a claim (value, error, seeds, reference,
    holds), the extrapolated γ_c sits near 1/(1 − ρ), the figures are written."""
    from transformer_pde.application.cli import main as cli_main

    over = ["rhos=[0.5]", "crossing_ns=[100, 1000]", "crossing_dims=[16, 256, 4096, 16384]", "crossing_seeds=4",
            "layer_dim=8", "layer_ns=[100, 400]", "layer_gammas=[0.5, 1.0, 2.0]", "layer_seeds=2",
            "uniform_ns=[100, 300, 1000]", "uniform_seeds=6", "uniform_fit_min=100", "bootstrap=200"]
    args = ["run", "experiments/critical_scaling_quick.toml", "--out", str(tmp_path), "--name", "c", "--no-progress",
            "-qq"]
    for o in over:
        args += ["--override", o]
    assert cli_main(args) == 0
    m = json.loads((tmp_path / "c" / "metrics.json").read_text())
    for c in m["claims"]:
        assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
    gc = [c for c in m["claims"] if c["name"].startswith("gamma_c extrapolated")]
    assert len(gc) == 1 and gc[0]["reference"] == 2.0 and abs(gc[0]["value"] - 2.0) < 0.01
    for name in ("crossing", "one_layer", "uniform_keys"):
        assert (tmp_path / "c" / "figures" / f"{name}.png").exists() and name in m["figure_captions"]
