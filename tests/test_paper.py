"""The paper's OU-vs-oscillating study (transformer_pde/application/studies/paper.py).

What is checked, and against what:
* the quick config runs end to end (shrunk by overrides) and writes every figure and metric file,
  a caption per figure in metrics.json and, with animate=true, a GIF with one frame per record;
* the per-segment lines go through logging at INFO (so --no-progress does not silence them);
* one segment, weights stepped by scheme="euler", equals an independent dense implementation of
  the reference code's algorithm written here (same seeds, same draws) step for step;
* a run interrupted mid-segment (twice) and resumed gives bit-for-bit the same records,
  series and metrics as an uninterrupted run, and finished segments are not recomputed;
  the same after SIGKILL of a CLI subprocess (slow);
* corrupt and foreign checkpoints / segment files are refused with a clear message;
* invalid config keys and values name the key and the allowed values, before any work;
* the a·H^b fit recovers known exponents (exact data, numpy.polyfit, interval coverage);
* the energy balance of a deterministic (oscillating) run closes at order dt, and the 𝒢²-based
  residual does not close for H > 1 (the 𝒟 ≠ s·𝒢² gap);
* per-head phase with H = 1 equals the shared phase; float32 and ascent runs work.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import transformer_pde as tp
from transformer_pde.application.cli import main as cli_main
from transformer_pde.application.runs import execute
from transformer_pde.application.config import load_config
from transformer_pde.application.studies.paper import fit_power_law, power_law_intervals, time_average
from problems import assert_replayed

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "experiments" / "ou_vs_oscillating_quick.toml"
FIGURES = ["snapshots_ou", "snapshots_oscillating", "snapshots_comparison", "energy_balance", "slope", "scaling"]
# a seconds-long version of the quick config: 10 steps per segment, 4 segments
TINY = ["n=16", "heads=[1,3]", "paths=2", "t1=0.2", "dt=0.02", "t_avg=0.05", "record_every=2", "bootstrap=200",
        "checkpoint_every=3", "device='cpu'"]


def _cfg(**params):
    base = {"n": 16, "heads": [1, 3], "paths": 2, "t1": 0.2, "dt": 0.02, "t_avg": 0.05, "record_every": 2,
            "bootstrap": 200, "checkpoint_every": 3, "figures": False, "device": "cpu"}
    base.update(params)
    return {"kind": "ou_vs_oscillating", "name": "tiny", "params": base}


class Interrupt(Exception):
    pass


def _stop_at(tag, step):
    def cb(t, k, time_):
        if t == tag and k == step:
            raise Interrupt(f"{tag} step {step}")
    return cb


# ---------------------------------------------------------------------------- helpers
def _tensor_tree_equal(a, b, path=""):
    """Equality of nested dicts of tensors to rounding (timing excluded; :func:`problems.assert_replayed`)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ {set(a) ^ set(b)}"
        for k in a:
            if k != "timing":
                _tensor_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert_replayed(a, b, path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _metrics(run):
    m = json.loads((run / "metrics.json").read_text())
    m.pop("timing")
    m.pop("wall_time_s")
    return m


def _assert_same_run(r1: Path, r2: Path):
    assert _metrics(r1) == _metrics(r2)
    files1 = sorted(p.name for p in (r1 / "series").iterdir())
    assert files1 == sorted(p.name for p in (r2 / "series").iterdir()) and files1
    for name in files1:
        assert (r1 / "series" / name).read_bytes() == (r2 / "series" / name).read_bytes(), name
    data1 = sorted(p.name for p in (r1 / "data").iterdir())
    assert data1 == sorted(p.name for p in (r2 / "data").iterdir()) and data1
    for name in data1:
        _tensor_tree_equal(torch.load(r1 / "data" / name, weights_only=False),
                           torch.load(r2 / "data" / name, weights_only=False), name)
    assert not list((r2 / "checkpoints").iterdir()), "checkpoints of finished segments must be removed"


# ---------------------------------------------------------------------------- end to end
def test_shipped_configs_validate():
    names = set()
    for path in sorted((ROOT / "experiments").glob("*.toml")):
        cfg = load_config(path)
        if cfg["kind"] == "ou_vs_oscillating":
            names.add(path.stem)
    assert {"s2_ou", "s2_oscillating", "ou_vs_oscillating", "ou_vs_oscillating_quick", "s1_ou_vs_oscillating",
            "hd_ou_vs_oscillating"} <= names
    full = load_config(ROOT / "experiments" / "ou_vs_oscillating.toml")["params"]
    ref = {"n": 200, "d": 3, "heads": [1, 10, 100], "beta": 1.0, "paths": 10, "ou_sigma2": 2.0, "ou_rate": 1.0,
           "phase": "shared", "direction": "descent", "t1": 20.0, "dt": 0.005, "record_every": 5, "t_avg": 2.5,
           "seed": 42, "noise_seed": 2000, "regimes": ["ou", "oscillating"],
           "dtype": "float32"}  # tokens only: the weights are stepped in float64 (test_float32_and_ascent_options)
    assert {k: full[k] for k in ref} == ref


def test_quick_config_end_to_end(tmp_path, capsys):
    rc = cli_main(["run", str(QUICK), "--out", str(tmp_path), "--no-progress", "-o", "animate=true",
                   *sum([["-o", o] for o in TINY], [])])
    assert rc == 0
    out = capsys.readouterr().out
    run = tmp_path / "ou_vs_oscillating_quick"
    assert "b = " in out and "residual at T" in out  # the fit and residuals are printed
    for name in FIGURES:
        for ext in ("png", "pdf"):
            f = run / "figures" / f"{name}.{ext}"
            assert f.is_file() and f.stat().st_size > 1000, f
    for name in ("config.json", "environment.json", "status.json", "metrics.json", "metrics.csv"):
        assert (run / name).is_file(), name
    assert json.loads((run / "status.json").read_text())["state"] == "complete"
    env = json.loads((run / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and "cpu_count" in env
    m = json.loads((run / "metrics.json").read_text())
    for regime in ("ou", "oscillating"):
        assert math.isfinite(m[f"b_{regime}"]) and math.isfinite(m[f"a_{regime}"])
        for H in ("1", "3"):
            assert (run / "series" / f"{regime}_H{H}.csv").is_file()
            assert (run / "data" / f"{regime}_H{H}.pt").is_file()
            r = m["residuals"][regime][H]
            assert math.isfinite(r["residual"]["final_mean"]) and math.isfinite(r["residual_slope"]["final_std"])
    lo, hi = m["fit"]["ou"]["b_ci"]
    assert lo <= hi
    assert m["fit"]["oscillating"]["b_ci"] is None  # a single deterministic path: no interval over paths
    assert m["seeds"]["heads"] == {"1": 43, "3": 45} and m["seeds"]["ou_noise"] == {"1": 2001, "3": 2003}
    csv_rows = (run / "metrics.csv").read_text().splitlines()
    assert csv_rows[0] == "key,value" and any(r.startswith("fit.ou.b,") for r in csv_rows)
    header = (run / "series" / "ou_H3.csv").read_text().splitlines()[0].split(",")
    assert {"t", "slope_mean", "slope_std", "ledger_residual_mean", "ledger_residual_slope_std"} <= set(header)
    seg = torch.load(run / "data" / "ou_H3.pt", weights_only=False)
    assert seg["x"].shape == (6, 1, 16, 3) and seg["slope"].shape == (6, 2)  # 10 steps recorded every 2
    # only the stored path is on disk (a saved slice would carry the storage of all paths)
    assert seg["x"].untyped_storage().nbytes() == seg["x"].numel() * seg["x"].element_size()
    # a caption per figure, saying what bands / bars are; the OU-vs-oscillating animation
    caps = m["figure_captions"]
    assert set(caps) == set(FIGURES)
    assert "± 1 std over the paths" in caps["energy_balance"] and "one path" in caps["snapshots_comparison"]
    from PIL import Image

    with Image.open(run / "figures" / "tokens.gif") as im:
        assert im.format == "GIF" and im.n_frames == 6  # one frame per recorded time (6 < 60 frames asked)
    assert m["animation"]["frames"] == 6 and m["animation"]["bytes"] < 3 * 2 ** 20


def test_segment_lines_go_through_logging(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="transformer_pde.application.studies.paper")
    cfg = _cfg(heads=[1], regimes=["oscillating", "ou"])
    execute(cfg, out_dir=tmp_path, progress=False)
    msgs = [r.getMessage() for r in caplog.records if r.name == "transformer_pde.application.studies.paper"]
    assert any(m.startswith("[oscillating_H1] segment 1/2 running") for m in msgs), msgs
    assert any(m.startswith("[ou_H1] done in") for m in msgs), msgs
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "transformer_pde.application.studies.paper")
    caplog.clear()
    (tmp_path / "tiny" / "status.json").write_text('{"state": "interrupted"}')  # a complete run is not re-entered
    execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    msgs = [r.getMessage() for r in caplog.records if r.name == "transformer_pde.application.studies.paper"]
    assert "[ou_H1] segment 2/2 already complete, skipped" in msgs, msgs


# ---------------------------------------------------------------------------- reference oracle
def _reference_run(x0, D0, *, steps, dt, rec, paths, seed, sigma2, target=None):
    """Dense re-implementation of the reference code's loop (docs/reproducing.md): energy, 𝒢²,
    ∫∂E (with Itô term), ∫𝒢², M_t per path at the recorded steps.  Euler for the tokens
    (descent), Euler–Maruyama for D with the same torch generator draws.  target(t) -> F (d, d)
    for oscillating weights, None for OU (mean I, rate 1)."""
    P, (H, d, _), n = paths, D0.shape, x0.shape[0]
    x = x0.expand(P, n, d).clone()
    D = D0.expand(P, H, d, d).clone()
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(d, dtype=x.dtype)
    acc = {k: torch.zeros(P, dtype=x.dtype) for k in ("partial", "slope", "martingale")}
    out = {k: [] for k in ("energy", "slope", "partial", "slope_int", "martingale")}
    for k in range(steps + 1):
        S = torch.einsum("pnd,phde,pme->phnm", x, D, x)  # ⟨x_n, D_h x_m⟩
        U = torch.exp(S)
        N = U.sum(-1)  # (P, H, n)
        energy = 0.5 * U.sum((1, 2, 3)) / (H * n * n)
        drift = (eye - D) if target is None else (target(k * dt) - D)
        dS = torch.einsum("pnd,phde,pme->phnm", x, drift, x)
        gram = x @ x.transpose(-1, -2)
        ito = sigma2 / 4 * (gram ** 2 + 1)[:, None]
        dEdt = 0.5 * (U * (dS + ito)).sum((1, 2, 3)) / (H * n * n)
        att = torch.einsum("phnm,phme->phne", U / N[..., None], torch.einsum("phde,pme->phmd", D, x))
        proj = att - (att * x[:, None]).sum(-1, keepdim=True) * x[:, None]
        v = proj.mean(1)
        g2 = ((v * v).sum(-1) / (n / N).mean(1)).mean(1)
        if k % rec == 0 or k == steps:
            out["energy"].append(energy)
            out["slope"].append(g2)
            out["partial"].append(acc["partial"].clone())
            out["slope_int"].append(acc["slope"].clone())
            out["martingale"].append(acc["martingale"].clone())
        if k == steps:
            break
        acc["partial"] += dEdt * dt
        acc["slope"] += g2 * dt
        x_old = x
        x = x - dt * v
        x = x / x.norm(dim=-1, keepdim=True)
        D = D + dt * drift
        if sigma2 > 0:
            Z = torch.randn(D.shape, dtype=D.dtype, generator=gen)
            dW = math.sqrt(sigma2) * math.sqrt(dt) * 0.5 * (Z + Z.transpose(-1, -2))
            D = D + dW
            # Itô: the increment pairs the kernel and the tokens at the left end of the step
            acc["martingale"] += 0.5 * (U * torch.einsum("pnd,phde,pme->phnm", x_old, dW, x_old)).sum((1, 2, 3)) / (
                H * n * n)
    return {k: torch.stack(v) for k, v in out.items()}


def _reference_tokens(n, seed=42, noise=0.05):
    rng = np.random.default_rng(seed)
    verts = np.array([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]], dtype=float)
    pts = verts[rng.choice(6, n)] + rng.normal(0, noise, (n, 3))
    return torch.as_tensor(pts / np.linalg.norm(pts, axis=-1, keepdims=True))


def _shared_target(t):
    c, s = math.cos, math.sin
    return torch.tensor([[2 + 1.5 * c(t), s(2 * t), s(t)],
                         [s(2 * t), 2 + 1.5 * s(t), c(2 * t)],
                         [s(t), c(2 * t), 2 + 1.5 * c(t + math.pi / 4)]], dtype=torch.float64)


def test_matches_reference_algorithm_step_for_step(tmp_path):
    """scheme = "euler": the study's records equal an independent dense implementation of the
    reference algorithm with the reference seeds (tokens seed 42, D_h(0) seed 42 + H, noise 2000 + H)."""
    n, H, steps, dt, rec = 12, 3, 10, 0.02, 2
    run = execute(_cfg(n=n, heads=[H], paths=3, t1=steps * dt, dt=dt, record_every=rec, scheme="euler",
                       t_avg=0.0), out_dir=tmp_path, progress=False)
    x0 = _reference_tokens(n)
    Z = torch.randn((H, 3, 3), dtype=torch.float64, generator=torch.Generator().manual_seed(42 + H))
    D0 = Z + Z.transpose(-1, -2)
    for regime, kw in (("ou", dict(paths=3, seed=2000 + H, sigma2=2.0)),
                       ("oscillating", dict(paths=1, seed=0, sigma2=0.0, target=_shared_target))):
        seg = torch.load(run / "data" / f"{regime}_H{H}.pt", weights_only=False)
        torch.testing.assert_close(seg["x"][0, 0], x0, rtol=0, atol=1e-15)
        ref = _reference_run(x0, D0, steps=steps, dt=dt, rec=rec, **kw)
        tol = dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(seg["energy"], ref["energy"], **tol)
        torch.testing.assert_close(seg["slope"], ref["slope"], **tol)
        torch.testing.assert_close(seg["ledger"]["partial"], ref["partial"], **tol)
        torch.testing.assert_close(seg["ledger"]["slope"], ref["slope_int"], **tol)
        torch.testing.assert_close(seg["ledger"]["martingale"], ref["martingale"], **tol)
        if regime == "ou":
            assert float(ref["martingale"][-1].abs().max()) > 1e-4  # the noise really enters


# ---------------------------------------------------------------------------- resume
def test_kill_and_resume_is_bit_for_bit(tmp_path):
    cfg = _cfg()
    full = execute(cfg, out_dir=tmp_path / "a", progress=False)
    calls = []

    def stop(tag, step):
        def cb(t, k, time_):
            calls.append((t, k))
            if t == tag and k == step:
                raise Interrupt(f"{tag} step {step}")
        return cb

    # interrupted in the second OU segment after its checkpoints at steps 3 and 6
    with pytest.raises(Interrupt):
        execute(cfg, out_dir=tmp_path / "b", progress=False, step_callback=stop("ou_H3", 8))
    run = tmp_path / "b" / "tiny"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and "Interrupt" in status["error"]
    assert (run / "data" / "ou_H1.pt").is_file() and (run / "checkpoints" / "ou_H3.ckpt").is_file()
    assert not (run / "data" / "ou_H3.pt").exists()
    # resume, interrupted again in the (closed-form) oscillating segment
    calls.clear()
    with pytest.raises(Interrupt):
        execute(cfg, out_dir=tmp_path / "b", progress=False, resume=True, step_callback=stop("oscillating_H1", 4))
    assert all(t != "ou_H1" for t, _ in calls), "a finished segment was recomputed"
    assert [k for t, k in calls if t == "ou_H3"] == list(range(7, 11)), "resume must continue after step 6"
    calls.clear()
    execute(cfg, out_dir=tmp_path / "b", progress=False, resume=True, step_callback=stop("none", 0))
    assert [k for t, k in calls if t == "oscillating_H1"] == list(range(4, 11))
    assert {t for t, _ in calls} == {"oscillating_H1", "oscillating_H3"}
    env = json.loads((run / "environment.json").read_text())
    assert len(env["resumed"]) == 2
    _assert_same_run(full, run)


def test_resume_refuses_other_config_and_existing_dir(tmp_path):
    cfg = _cfg(regimes=["oscillating"], heads=[2])
    execute(cfg, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="--resume"):
        execute(cfg, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="config differs"):
        execute(cfg, overrides=["n=17"], out_dir=tmp_path, progress=False, resume=True)


@pytest.mark.slow
def test_sigkill_and_resume_from_cli(tmp_path):
    """A CLI run killed with SIGKILL mid-segment resumes to the uninterrupted records."""
    over = ["n=24", "heads=[1,6]", "paths=3", "t1=3.0", "dt=0.01", "t_avg=0.5", "record_every=5", "bootstrap=100",
            "checkpoint_every=20", "figures=false", "device='cpu'"]
    args = ["run", str(QUICK), "--no-progress", *sum([["-o", o] for o in over], [])]
    assert cli_main([*args, "--out", str(tmp_path / "a")]) == 0
    cmd = [sys.executable, "-m", "transformer_pde.application.cli", *args, "--out", str(tmp_path / "b")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = tmp_path / "b" / "ou_vs_oscillating_quick"
    ckpt = run / "checkpoints" / "ou_H6.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((run / "status.json").read_text())["state"] == "running"  # killed: no chance to write
    assert cli_main([*args, "--out", str(tmp_path / "b"), "--resume"]) == 0
    _assert_same_run(tmp_path / "a" / "ou_vs_oscillating_quick", run)


def test_corrupt_and_foreign_checkpoints_are_refused(tmp_path, capsys):
    cfg = _cfg(regimes=["ou"], heads=[2])
    with pytest.raises(Interrupt):
        execute(cfg, out_dir=tmp_path, progress=False, step_callback=_stop_at("ou_H2", 5))
    ckpt = tmp_path / "tiny" / "checkpoints" / "ou_H2.ckpt"
    good = ckpt.read_bytes()
    ckpt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="corrupted or unreadable"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    # a checkpoint of another configuration (other noise seed) put in its place
    other = _cfg(regimes=["ou"], heads=[2], noise_seed=7)
    with pytest.raises(Interrupt):
        execute(other, out_dir=tmp_path / "other", progress=False, step_callback=_stop_at("ou_H2", 5))
    ckpt.write_bytes((tmp_path / "other" / "tiny" / "checkpoints" / "ou_H2.ckpt").read_bytes())
    with pytest.raises(ValueError, match="different run"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    # a pickled object that is no checkpoint at all
    torch.save({"hello": 1}, ckpt)
    with pytest.raises(ValueError, match="not a transformer_pde simulate checkpoint"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    # the CLI reports it and exits with 2
    toml = tmp_path / "tiny.toml"
    toml.write_text('kind = "ou_vs_oscillating"\nname = "tiny"\n[params]\n' + "\n".join(
        f"{k} = {json.dumps(v)}" for k, v in cfg["params"].items()) + "\n")
    assert cli_main(["run", str(toml), "--out", str(tmp_path), "--resume", "--no-progress"]) == 2
    assert "not a transformer_pde simulate checkpoint" in capsys.readouterr().err
    # the good checkpoint resumes; then a corrupted finished segment is refused as well
    ckpt.write_bytes(good)
    execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    seg = tmp_path / "tiny" / "data" / "ou_H2.pt"
    seg.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupted or unreadable"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)
    torch.save({"kind": "transformer_pde.ou_vs_oscillating.segment", "fingerprint": "0" * 16}, seg)
    (tmp_path / "tiny" / "status.json").write_text('{"state": "interrupted"}')  # a complete run is not re-entered
    with pytest.raises(ValueError, match="different configuration"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)


# ---------------------------------------------------------------------------- config validation
@pytest.mark.parametrize("override, needles", [
    ("bogus=1", ["'bogus'", "allowed keys", "regimes"]),
    ("regimes=['ou','sde']", ["'regimes'", "'sde'", "'ou', 'oscillating'"]),
    ("regimes=[]", ["'regimes'", "must not be empty"]),
    ("phase='random'", ["'phase'", "'shared', 'per_head'"]),
    ("direction='up'", ["'direction'", "'descent', 'ascent'"]),
    ("dtype='float16'", ["'dtype'", "'float32', 'float64'"]),
    ("method='adaptive'", ["'method'", "'euler', 'heun', 'rk4'"]),
    ("scheme='milstein'", ["'scheme'", "'exact', 'euler'"]),
    ("normalization='linear'", ["'normalization'", "'softmax'", "'effective'"]),
    ("init='grid'", ["'init'", "'octahedral'"]),
    ("device='tpu'", ["'device'", "'cpu'"]),
    ("heads=[0, 10]", ["'heads'", ">= 1"]),
    ("heads=[1, 1]", ["'heads'", "repeat"]),
    ("heads=10", ["'heads'", "list"]),
    ("n=0", ["'n'", "> 0"]),
    ("d=1", ["'d'", ">= 2"]),
    ("dt='small'", ["'dt'", "float"]),
    ("paths=2.5", ["'paths'", "int"]),
    ("ci_level=1.5", ["'ci_level'", "between 0 and 1"]),
    ("dt=0.007", ["'t1'", "'dt'", "whole number"]),
    ("t_avg=30.0", ["'t_avg'", "'t1'"]),
    ("init='clustered_circle'", ["'init'", "d = 2", "'octahedral', 'uniform'"]),
])
def test_invalid_config_names_key_and_allowed_values(tmp_path, override, needles):
    with pytest.raises(ValueError) as e:
        execute(QUICK, overrides=[override], out_dir=tmp_path, progress=False)
    for s in needles:
        assert s in str(e.value), (s, str(e.value))
    assert not (tmp_path / "ou_vs_oscillating_quick").exists(), "nothing may be written for an invalid config"


def test_invalid_config_through_cli(tmp_path, capsys):
    assert cli_main(["run", str(QUICK), "--out", str(tmp_path), "-o", "phase=diagonal"]) == 2
    err = capsys.readouterr().err
    assert "'phase'" in err and "'per_head'" in err


# ---------------------------------------------------------------------------- statistics
def test_time_average_trapezoid():
    t = np.linspace(0.0, 4.0, 81)
    v = np.stack([3 * t + 1, t ** 2], -1)  # linear: exact; quadratic: trapezoid error h²/6·(…)
    got = time_average(t, v, 1.0)
    np.testing.assert_allclose(got[0], 3 * (1 + 4) / 2 + 1, rtol=1e-14)
    np.testing.assert_allclose(got[1], (4 ** 3 - 1) / 3 / 3, rtol=1e-3)
    # the Trajectory's own time average (an independent implementation)
    traj = tp.Trajectory(torch.as_tensor(t), None, None, None, None, {}, {}, "euler", "softmax", "descent")
    np.testing.assert_allclose(got, traj.time_average(torch.as_tensor(v), 1.0).numpy(), rtol=1e-13)


def test_power_law_fit_exact_and_against_polyfit():
    H = np.array([1, 2, 4, 8, 16, 32, 100])
    for a, b in ((0.3, -1.0), (2.0, 0.0), (0.05, 0.5)):
        f = fit_power_law(H, a * H.astype(float) ** b)
        assert abs(f["b"] - b) < 1e-12 and abs(f["a"] - a) < 1e-12 * max(1, a)
        assert f["b_se"] < 1e-10
    rng = np.random.default_rng(1)
    y = 0.7 * H ** -0.8 * np.exp(rng.normal(0, 0.2, len(H)))
    b_ref, c_ref = np.polyfit(np.log(H), np.log(y), 1)
    f = fit_power_law(H, y)
    np.testing.assert_allclose([f["b"], f["a"]], [b_ref, math.exp(c_ref)], rtol=1e-12)
    assert fit_power_law([10, 10], [1.0, 2.0])["b"] is None  # one distinct H: no fit


def test_power_law_intervals_cover_the_truth():
    """Per-path lognormal data around a·H^b: both intervals cover b at about the nominal rate."""
    from scipy import stats

    H = np.array([1, 10, 100])
    b_true, P, reps = -1.0, 10, 200
    rng = np.random.default_rng(0)
    cover_boot = cover_t = 0
    for r in range(reps):
        per = [0.2 * h ** b_true * np.exp(rng.normal(0, 0.4, P)) for h in H]
        out = power_law_intervals(H, per, level=0.9, resamples=300, seed=r)
        cover_boot += out["b_ci"][0] <= b_true <= out["b_ci"][1]
        cover_t += out["b_ci_paths"][0] <= b_true <= out["b_ci_paths"][1]
        if r == 0:  # the t-interval by hand
            bp = np.array([np.polyfit(np.log(H), np.log([per[k][p] for k in range(3)]), 1)[0] for p in range(P)])
            q = stats.t.ppf(0.95, P - 1)
            half = q * bp.std(ddof=1) / math.sqrt(P)
            np.testing.assert_allclose(out["b_ci_paths"], [bp.mean() - half, bp.mean() + half], rtol=1e-10)
            np.testing.assert_allclose(out["b"], np.polyfit(np.log(H), np.log([p.mean() for p in per]), 1)[0],
                                       rtol=1e-12)
    assert 0.83 <= cover_t / reps <= 0.97, cover_t / reps  # exact t-interval (Gaussian per-path slopes): 0.90
    assert 0.75 <= cover_boot / reps <= 0.97, cover_boot / reps  # percentile bootstrap, 10 paths: a bit under
    single = power_law_intervals(H, [np.array([v]) for v in (1.0, 0.1, 0.01)])
    assert single["b_ci"] is None and single["b_ci_paths"] is None and abs(single["b"] + 1) < 1e-12


# ---------------------------------------------------------------------------- energy balance, options
def test_energy_balance_closes_at_order_dt(tmp_path):
    """Deterministic oscillating run, Euler: the 𝒟-based residual at T is O(dt) for every H;
    the 𝒢²-based one closes for H = 1 only (𝒟 ≠ s·𝒢² for softmax heads with H > 1)."""
    dts = [0.04, 0.02, 0.01]
    res = []
    for dt in dts:
        run = execute(_cfg(regimes=["oscillating"], heads=[1, 3], n=12, t1=0.4, dt=dt, record_every=1, t_avg=0.0,
                           bootstrap=0), out_dir=tmp_path, name=f"dt{dt}", progress=False)
        res.append(json.loads((run / "metrics.json").read_text())["residuals"]["oscillating"])
    for H in ("1", "3"):
        r = np.abs([x[H]["residual"]["final_mean"] for x in res])
        order = np.polyfit(np.log(dts), np.log(r), 1)[0]
        assert 0.85 < order < 1.15, (H, order, r)
    r1 = np.abs([x["1"]["residual_slope"]["final_mean"] for x in res])
    assert 0.85 < np.polyfit(np.log(dts), np.log(r1), 1)[0] < 1.15
    r3 = np.abs([x["3"]["residual_slope"]["final_mean"] for x in res])
    assert r3[-1] > 0.5 * r3[0] and r3[-1] > 5 * abs(res[-1]["3"]["residual"]["final_mean"])


def test_per_head_phase_with_one_head_is_shared_phase(tmp_path):
    runs = [execute(_cfg(regimes=["oscillating"], heads=[1], phase=ph), out_dir=tmp_path, name=ph, progress=False)
            for ph in ("shared", "per_head")]
    a, b = (torch.load(r / "data" / "oscillating_H1.pt", weights_only=False) for r in runs)
    assert_replayed(a["x"], b["x"], "x")
    assert_replayed(a["ledger"]["residual"], b["ledger"]["residual"], "residual")
    c = execute(_cfg(regimes=["oscillating"], heads=[3], phase="per_head"), out_dir=tmp_path, name="ph3",
                progress=False)
    d = execute(_cfg(regimes=["oscillating"], heads=[3], phase="shared"), out_dir=tmp_path, name="sh3",
                progress=False)
    xc = torch.load(c / "data" / "oscillating_H3.pt", weights_only=False)["x"]
    xd = torch.load(d / "data" / "oscillating_H3.pt", weights_only=False)["x"]
    assert not torch.equal(xc, xd)  # with H > 1 the phases do matter


def test_float32_and_ascent_options(tmp_path):
    r32 = execute(_cfg(dtype="float32", heads=[2], direction="ascent", normalization="effective"), out_dir=tmp_path,
                  progress=False)
    seg = torch.load(r32 / "data" / "ou_H2.pt", weights_only=False)
    assert seg["x"].dtype == torch.float32 and seg["energy"].dtype == torch.float32
    m = json.loads((r32 / "metrics.json").read_text())
    assert m["sign"] == 1.0 and m["direction"] == "ascent"
    r64 = execute(_cfg(dtype="float64", heads=[2], direction="ascent", normalization="effective"), out_dir=tmp_path,
                  name="f64", progress=False)
    # the OU weights are stepped in float64 from the float64 run's draws: both runs follow the same path and
    # differ by float32 rounding, about eps·sqrt(K + 1) over K steps (the tolerance of
    # tests/test_reference_records.py, C = 4); a float32 run drawing its own normals differs by O(1)
    K = round(0.2 / 0.02)
    tol = 4 * torch.finfo(torch.float32).eps * math.sqrt(K + 1)
    for tag in ("oscillating_H2", "ou_H2"):
        a32 = torch.load(r32 / "data" / f"{tag}.pt", weights_only=False)
        a64 = torch.load(r64 / "data" / f"{tag}.pt", weights_only=False)
        scale = float(a64["energy"].abs().max())
        torch.testing.assert_close(a32["energy"].double(), a64["energy"], rtol=tol, atol=tol * scale)
        torch.testing.assert_close(a32["x"].double(), a64["x"], rtol=tol, atol=tol)
    # "effective" normalisation: 𝒟 = s·𝒢², so both residuals agree for every H
    r = m["residuals"]["oscillating"]["2"]
    assert abs(r["residual"]["final_mean"] - r["residual_slope"]["final_mean"]) < 1e-4


def test_float32_tokens_change_no_reported_number_beyond_its_interval(tmp_path):
    """Why the full configuration may run its tokens in float32: every number the run reports (fits, time
    averages, residuals; studies.paper_dtype.dtype_differences) moves between float64 and float32 tokens by rounding
    only — at most C·eps32·√(K + 1)·(1 + |value|) for K steps — and by less than 10⁻³ of the interval the run
    gives it (bootstrap CI, Student-t, ±z·std/√P over the Monte-Carlo paths)."""
    from transformer_pde.application.studies.paper_dtype import dtype_differences

    runs = {dt: json.loads((execute(_cfg(dtype=dt, paths=3, bootstrap=200), out_dir=tmp_path, name=dt,
                                    progress=False) / "metrics.json").read_text()) for dt in ("float64", "float32")}
    rows = dtype_differences(runs["float64"], runs["float32"])
    K = round(0.2 / 0.02)
    tol = 50 * torch.finfo(torch.float32).eps * math.sqrt(K + 1)
    names = {r["name"] for r in rows}
    assert {"fit ou: b", "fit oscillating: b", "ou H=3: time-averaged 𝒢², mean over paths",
            "ou H=1: final 𝒟-based residual, mean over paths", "oscillating H=3: final dE, mean over paths"} <= names
    with_interval = [r for r in rows if r["interval"] is not None]
    assert len(with_interval) >= 8
    for r in rows:
        assert r["difference"] <= tol * (1 + abs(r["float64"])), r
    for r in with_interval:
        assert r["difference"] <= 1e-3 * r["interval"], r
    # the check is not vacuous: the float32 run is not the float64 run
    assert max(r["difference"] for r in rows) > 0
