"""The lost_in_the_middle study (docs/lost_in_the_middle.md): its estimator against the exact one-step Jacobian and
the closed form of a small-β (linear) case, the tangent sensitivity against finite differences, the profile pipeline
on a tiny random GPT-2, and the study end to end through the CLI (claims, figures, resume)."""

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.analysis.theory import kinetic as kt
from transformer_pde.application.studies import retrieval as lim
from conftest import gen

F64 = torch.float64


def _paper_derivative(theta, beta, lam):
    """∂F_N/∂θ_k = −π_Nk K'(θ_N − θ_k), K(φ) = −β sin φ e^{β cos φ}, K'(φ) = −β(cos φ − β sin²φ) e^{β cos φ},
    for the last token N = n − 1 and k < N (the paper's force, differentiated by hand)."""
    n = theta.shape[-1]
    k = np.arange(n - 1)
    c = np.exp(-(lam / n) * (n - 1 - k))
    pi = c / c.sum()
    phi = theta[..., -1:] - theta[..., :-1]
    dK = -beta * (np.cos(phi) - beta * np.sin(phi) ** 2) * np.exp(beta * np.cos(phi))
    return -pi * dK


def test_one_euler_step_gives_the_exact_first_order_response():
    """After one Euler step h the Jacobian row is h ∂F_N/∂θ_k exactly; the estimator is n · that · w(θ_N(h) − θ_k)."""
    n, R, beta, lam, h = 12, 3, 1.7, 2.0, 0.01
    theta0 = torch.rand(R, n, generator=gen(1), dtype=F64) * 2 * math.pi
    res = lim.retrieval_estimates(lim.paper_model(beta, lam), theta0, [h], dt=h, M=8.0, modes=20, method="euler")
    th = theta0.numpy()
    x = np.stack([np.cos(th), np.sin(th)], -1)
    force = lambda t: np.stack([(  # noqa: E731  the paper's force on the last token only (loop-free)
        (np.exp(-(lam / n) * (n - 1 - np.arange(n - 1))) / np.exp(-(lam / n) * (n - 1 - np.arange(n - 1))).sum())
        * (-beta * np.sin(t[r, -1] - t[r, :-1]) * np.exp(beta * np.cos(t[r, -1] - t[r, :-1])))).sum()
        for r in range(R)])
    # Euler on the circle: x + h V, retracted; the angle moves by atan(h θ̇) (exact for the projection)
    thN = th[:, -1] + np.arctan(h * force(th))
    assert x.shape == (R, n, 2)
    J = h * _paper_derivative(th, beta, lam) / (1 + (h * force(th)[:, None]) ** 2)  # d atan(hF) = h dF/(1 + h²F²)
    w = lim.mode_readout(torch.from_numpy(thN[:, None] - th[:, :-1]), 8.0, 20).numpy()
    assert_close(res["est"][0], torch.from_numpy(n * J * w), rtol=1e-9, atol=1e-12)
    assert res["est"].shape == (1, R, n - 1) and float(res["t"][0]) == pytest.approx(h)


@pytest.mark.parametrize("beta", [1.0, 3.0])
def test_the_default_time_step_resolves_the_response(beta):
    """The study's Heun step min(0.05, 0.25/(β e^β)) against RK4 at half of it, same initial data, at
    t = t_crit / 2: the binned estimates agree to 1e-2 relative (measured: < 1e-3), far inside their noise."""
    n, R = 32, 4
    tc = kt.critical_time(beta) / 2
    dt = lim.time_step(beta, tc, dt_max=0.05, courant=0.25)
    theta0 = torch.rand(R, n, generator=gen(7), dtype=F64) * 2 * math.pi
    m, idx = lim.paper_model(beta, 1.0), lim.token_bins(n, 4)
    heun = lim.binned(lim.retrieval_estimates(m, theta0, [tc], dt=dt, M=8.0, modes=20)["est"][0], idx, 4)
    fine = lim.binned(lim.retrieval_estimates(m, theta0, [tc], dt=dt / 2, M=8.0, modes=20, method="rk4")["est"][0],
                       idx, 4)
    assert_close(heun, fine, rtol=1e-2, atol=1e-2 * float(fine.abs().max()))


def test_the_control_variate_has_mean_zero_and_is_the_first_order_term():
    """first_order_control: its mean over uniform angles is zero (a fine grid of phases, the last token at 0:
    the quadrature of f'(−φ) w(φ) against Σ ω_j a_j), and est − control after one Euler step h is the exact mean
    n h π_Nk Σ ω_j a_j up to O(h²) (the error falls 4× when h halves)."""
    n, beta, lam = 2001, 2.0, 1.0
    grid = torch.linspace(0, 2 * math.pi, n, dtype=F64)[:-1]
    theta = torch.cat([grid, torch.zeros(1, dtype=F64)]).unsqueeze(0)  # θ_N = 0, θ_k uniform
    C = lim.first_order_control(theta, [1.0], beta, lam, M=8.0, modes=20)[0, 0]
    k = torch.arange(n - 1, dtype=F64)
    pi = torch.exp(-(lam / n) * (n - 1 - k))
    pi = pi / pi.sum()
    assert abs(float((C / (n * pi)).mean())) < 1e-10  # E[f' w] − Σ ω a = 0 by the trapezoid rule (spectral)
    R, n = 3, 10
    theta0 = torch.rand(R, n, generator=gen(8), dtype=F64) * 2 * math.pi
    mean = n * (torch.exp(-(lam / n) * (n - 1 - torch.arange(n - 1, dtype=F64)))
                / torch.exp(-(lam / n) * (n - 1 - torch.arange(n - 1, dtype=F64))).sum())
    mean = mean * float((kt.mode_weights(8.0, 20) * kt.mode_rates(beta, 20)).sum())
    errs = []
    for h in (0.02, 0.01):
        est = lim.retrieval_estimates(lim.paper_model(beta, lam), theta0, [h], dt=h, M=8.0, modes=20,
                                      method="euler")["est"][0]
        ctl = lim.first_order_control(theta0, [h], beta, lam, M=8.0, modes=20)[0]
        errs.append(float((est - ctl - h * mean).abs().max()))
    assert 3.0 < errs[0] / errs[1] < 5.0


def test_the_mode_readout_is_the_weighted_cosine_sum():
    phi = torch.linspace(-3, 3, 7, dtype=F64)
    want = sum(math.exp(-(math.pi * m / 8) ** 2 / 2) * torch.cos(m * phi) for m in range(1, 21))
    assert_close(lim.mode_readout(phi, 8.0, 20), want, rtol=1e-13, atol=1e-13)


def test_the_particle_profile_of_a_small_beta_case_lies_within_its_band():
    """β = 0.5 (a_m ≤ 0.26: the uniform state's fluctuations barely grow), n = 64, 64 initial conditions, t = 1.5:
    every binned mean lies within 3 standard errors of the closed form averaged over the same tokens, and the
    χ² per bin is compatible with 1.  A wrong prefix normalisation, kernel or factor β moves the profile by more
    than its band (the check below with the value matrix I instead of β·I fails)."""
    n, R, beta, lam, t, B = 64, 64, 0.5, 1.0, 1.5, 8
    theta0 = torch.rand(R, n, generator=gen(2), dtype=F64) * 2 * math.pi
    idx = lim.token_bins(n, B)
    s = (np.arange(n - 1) + 1) / n
    theory = lim.binned(torch.as_tensor(kt.retrieval_profile(s, t, beta, lam, 8.0, 20)), idx, B)

    def zscores(model):
        est = lim.retrieval_estimates(model, theta0, [t], dt=0.1, M=8.0, modes=20)["est"][0]
        bins = lim.binned(est, idx, B)
        return (bins.mean(0) - theory) / (bins.std(0) / math.sqrt(R))

    z = zscores(lim.paper_model(beta, lam))
    assert float(z.abs().max()) < 3.0
    assert float(z.square().mean()) < 1 + 3 * math.sqrt(2 / B)
    I = torch.eye(2, dtype=F64).unsqueeze(0)
    wrong = tp.Model(tp.Heads(I, I, beta=beta), normalization="unnormalized", direction="ascent",
                     causal=tp.KineticDecay(lam, strict=True))
    assert float(zscores(wrong).abs().max()) > 3.0


def test_the_tangent_sensitivity_against_finite_differences():
    """sensitivity_profile on a causal softmax flow in d = 3 against central differences of the flow along two
    tangent directions of each source; on the circle it is n·|∂θ_N/∂θ_k| of retrieval_estimates."""
    n, d = 6, 3
    x0 = tp.sphere.sample_uniform(n, d, generator=gen(3), dtype=F64)
    heads = tp.Heads(torch.randn(2, d, d, generator=gen(4), dtype=F64))
    model = tp.Model(heads, direction="ascent", causal=tp.ALiBi([0.2, 0.9]))

    def flow(x):
        return tp.solve(model, x, tp.Heun(), t1=0.5, dt=0.05, ledger=tp.LedgerOptions(diagnostics=False)).x[-1][..., -1, :]

    prof = lim.sensitivity_profile(flow, x0)
    xN = flow(x0)
    P = torch.eye(d, dtype=F64) - torch.outer(xN, xN) / xN.square().sum()
    eps = 1e-6
    for k in range(n - 1):
        e1 = torch.linalg.svd(torch.eye(d, dtype=F64) - torch.outer(x0[k], x0[k]))[0][:, :2]  # tangent basis
        cols = []
        for j in range(2):
            up, down = x0.clone(), x0.clone()
            up[k] = tp.sphere.normalize(x0[k] + eps * e1[:, j])
            down[k] = tp.sphere.normalize(x0[k] - eps * e1[:, j])
            cols.append(P @ (flow(up) - flow(down)) / (2 * eps))
        assert float(prof[k]) == pytest.approx(n * float(torch.stack(cols).norm()), rel=1e-6)
    # the circle: n |J| of the estimator's Jacobian
    theta0 = torch.rand(2, 10, generator=gen(5), dtype=F64) * 2 * math.pi
    m = lim.paper_model(1.0, 1.0)
    res = lim.retrieval_estimates(m, theta0, [0.4], dt=0.05, M=8.0, modes=1)
    flow2 = lambda x: tp.solve(m, x, tp.Heun(), t1=0.4, dt=0.05, ledger=tp.LedgerOptions(diagnostics=False)).x[-1][..., -1, :]  # noqa: E731
    sens = lim.sensitivity_profile(flow2, torch.stack([theta0.cos(), theta0.sin()], -1))
    thN = None
    est = res["est"][0]
    with torch.no_grad():
        xN = flow2(torch.stack([theta0.cos(), theta0.sin()], -1))
        thN = torch.atan2(xN[..., 1], xN[..., 0])
    w1 = math.exp(-(math.pi / 8) ** 2 / 2) * torch.cos(thN.unsqueeze(-1) - theta0[:, :-1])
    assert_close(sens, (est / w1).abs(), rtol=1e-8, atol=1e-10)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0,
                                  initializer_range=0.25)
    cfg._attn_implementation = "eager"
    return tp.pretrained.load(transformers.GPT2Model(cfg).eval(), dtype=F64)


def test_the_profile_pipeline_runs_on_a_tiny_random_gpt2():
    """tp.pretrained reads a random 2-layer GPT-2; its continuous rung (causal softmax heads of the layers) gives a
    finite profile over the source positions, the same as sensitivity_profile of the flow solved by hand, and it
    changes with a positional bias; padded inputs are refused."""
    net = _tiny_gpt2()
    assert net.causal
    ids = torch.randint(3, 100, (1, 7), generator=gen(6))
    prof = lim.network_profile(net, ids, dt=0.25)
    assert prof.shape == (1, 6) and prof.dtype == F64 and bool(torch.isfinite(prof).all()) and float(prof.min()) > 0
    states, _ = tp.pretrained.hidden_states(net, ids)
    model = tp.Model(tp.layerwise_from_pretrained(net), normalization="softmax", direction="ascent", causal=True)
    by_hand = lim.sensitivity_profile(
        lambda x: tp.solve(model, x, tp.Euler(), t1=2.0, dt=0.25, ledger=tp.LedgerOptions(diagnostics=False)).x[-1][..., -1, :],
        tp.sphere.normalize(states[0]))
    assert_close(prof, by_hand, rtol=1e-10, atol=1e-12)
    alibi = lim.network_profile(net, ids, dt=0.25, causal=tp.ALiBi.geometric(4))
    assert float((alibi - prof).abs().max()) > 1e-3 * float(prof.abs().max())
    with pytest.raises(ValueError, match="padding"):
        lim.network_profile(net, {"input_ids": ids, "attention_mask": torch.tensor([[1] * 5 + [0] * 2])})
    with pytest.raises(ValueError, match="dt"):
        lim.network_profile(net, ids, dt=0.3)


# ------------------------------------------------------------------------------------------- the study
TINY = ["n=16", "samples=8", "betas=[2.0]", "times=[0.5, 1.0]", "bins=4", "window=0.3", "convergence_ns=[16, 32]",
        "convergence_budget=128", "linear_n=16", "resamples=100", "dt_max=0.1", "courant=0.5"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from transformer_pde.application.cli import main as cli_main

    out = tmp_path_factory.mktemp("lim")
    args = ["run", "experiments/lost_in_the_middle_quick.toml", "--out", str(out), "--name", "t", "--no-progress", "-qq"]
    for o in TINY:
        args += ["--override", o]
    assert cli_main(args) == 0
    return out, args, json.loads((out / "t" / "metrics.json").read_text())


def test_the_study_writes_claims_figures_and_resumes(tiny_run):
    out, args, m = tiny_run
    claims = m["claims"]
    for c in claims:
        assert set(c) >= {"name", "value", "error", "seeds", "reference", "holds"}, c
    paper = [c for c in claims if "paper's number" in c["name"]]
    assert [c["reference"] for c in paper] == [2.4575, 0.6007, 0.174] and all(c["holds"] for c in paper)
    assert any(c["name"].startswith("t_crit measured, β=2") for c in claims)
    assert any("U-shape" in c["name"] for c in claims) and any("convergence rate" in c["name"] for c in claims)
    assert any("small-β" in c["name"] for c in claims)
    assert m["t_crit"]["beta=2"]["closed_form"] == pytest.approx(kt.critical_time(2.0), rel=1e-12)
    for name in ("profiles", "t_crit", "convergence"):
        assert (out / "t" / "figures" / f"{name}.png").exists() and name in m["figure_captions"]
    pieces = sorted(p.name for p in (out / "t" / "data").glob("*.pt"))
    assert pieces == sorted(["beta2.pt", "conv_n16.pt", "conv_n32.pt", "linear.pt"])
    # a run stopped after its pieces (status "interrupted", as a kill leaves it) resumes from them: the same numbers
    from transformer_pde.application.cli import main as cli_main

    (out / "t" / "status.json").write_text(json.dumps({"state": "interrupted"}))
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "t" / "data").glob("*.pt")}
    assert cli_main(args + ["--resume"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "t" / "data").glob("*.pt")} == stamps  # none recomputed
    again = json.loads((out / "t" / "metrics.json").read_text())
    assert again["t_crit"] == m["t_crit"] and again["convergence"] == m["convergence"]


@pytest.mark.parametrize("override,text", [(["bins=9"], "bins"), (["window=0.05"], "window"),
                                           (["convergence_ns=[8, 64]"], "convergence_ns"),
                                           (["times=[]"], "times"), (["betas=[1.0, 1.0]"], "betas")])
def test_bad_configurations_are_refused_before_anything_runs(tmp_path, override, text, capsys):
    from transformer_pde.application.cli import main as cli_main

    args = ["run", "experiments/lost_in_the_middle_quick.toml", "--out", str(tmp_path), "--no-progress", "-o", "n=16"]
    for o in override:
        args += ["-o", o]
    assert cli_main(args) == 2
    assert text in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_quick_config_as_shipped(tmp_path):
    from transformer_pde.application.cli import main as cli_main

    assert cli_main(["run", "experiments/lost_in_the_middle_quick.toml", "--out", str(tmp_path), "--no-progress",
                     "-qq"]) == 0
    m = json.loads((tmp_path / "lost_in_the_middle_quick" / "metrics.json").read_text())
    assert len(m["t_crit"]) == 3 and m["linear"]["samples"] == 24


def test_the_measurement_refuses_bad_input():
    model = lim.paper_model(1.0, 1.0)
    theta0 = torch.rand(2, 8, generator=gen(9), dtype=F64)
    with pytest.raises(ValueError, match="multiples of dt"):
        lim.retrieval_estimates(model, theta0, [0.13], dt=0.05, M=8.0, modes=20)
    with pytest.raises(ValueError, match="multiples of dt"):
        lim.retrieval_estimates(model, theta0, [0.0], dt=0.05, M=8.0, modes=20)
    with pytest.raises(ValueError, match=r"\(R, n\)"):
        lim.retrieval_estimates(model, theta0[0], [0.1], dt=0.05, M=8.0, modes=20)
    x0 = torch.stack([theta0.cos(), theta0.sin()], -1)
    with pytest.raises(ValueError, match="last token's state"):
        lim.sensitivity_profile(lambda x: x.sum(-2, keepdim=True), x0)
