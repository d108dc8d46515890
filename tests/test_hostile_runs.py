"""Hostile input to runs, studies and user extensions: each is refused with a message naming the problem and
the fix (exit code 2 on the command line, before the run directory exists), or stops with the exit code of
its kind (3 for a run that produced NaN/inf) — never a silent wrong result, a RecursionError traceback or a
piece of another run taken as this run's own."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import transformer_pde as tp
from transformer_pde.application.cli import main as cli_main
from transformer_pde.application.config import load_config
from transformer_pde.application.runs import execute
from transformer_pde.application.studies import claims

ROOT = Path(__file__).resolve().parents[1]


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# ---------------------------------------------------------------------------- configs nested thousands deep
@pytest.mark.parametrize("depth", [20, 3000, 5000])
def test_an_override_nested_deeply_is_refused_with_exit_2(tmp_path, capsys, depth):
    rc = cli_main(["run", "theory_rates", "-o", f"n={_nested(depth)}", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "nest" in err and "Traceback" not in err and "RecursionError" not in err
    assert not (tmp_path / "runs").exists()


def test_a_config_file_nested_deeply_is_refused_by_name(tmp_path, capsys):
    cfg = tmp_path / "deep.toml"
    cfg.write_text(f'kind = "theory_rates"\n[params]\nn = {_nested(4000)}\n')
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"config file {cfg} nests arrays or tables too deeply" in err
    cfg.write_text('kind = "theory_rates"\n[params]\nn = ' + "{a = " * 3000 + "1" + "}" * 3000 + "\n")
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "runs")]) == 2
    assert not (tmp_path / "runs").exists()


def test_a_config_dict_nested_deeply_is_refused():
    deep = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match=r"nests lists or tables more than 16 deep \(at \['params'\]\['n'\]"):
        load_config({"kind": "theory_rates", "params": {"n": deep}})


def test_a_sweep_axis_nested_deeply_is_refused(tmp_path, capsys):
    rc = cli_main(["sweep", "theory_rates", "-s", f"n={_nested(3000)}", "--out", str(tmp_path / "runs")])
    assert rc == 2 and "nest" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_run_files_nested_deeply_are_refused_on_resume(tmp_path):
    cfg = {"kind": "demo", "name": "d", "params": {"n": 8, "t1": 0.1, "dt": 0.05, "paths": 1}}
    path = execute(cfg, out_dir=tmp_path, progress=False)
    (path / "status.json").write_text(json.dumps({"state": "running"}))
    (path / "config.json").write_text(_nested(5000))
    with pytest.raises(ValueError, match="config.json is unreadable"):
        execute(cfg, out_dir=tmp_path, progress=False, resume=True)


# ---------------------------------------------------------------------------- pieces of another run
def _digits(**extra):
    p = {"seeds": [0], "epochs": 1, "dim": 8, "heads": 2, "feedforward": 4, "steps": 1, "lambdas": [0.01],
         "analysis_images": 8, "batch_size": 32, "figures": False, "dtype": "float64", "train_limit": 64, **extra}
    return {"kind": "train_digits", "name": "t", "params": p}


def test_a_finished_piece_of_a_run_with_another_config_is_refused_on_resume(tmp_path):
    pytest.importorskip("sklearn")
    other = execute(_digits(lr=1e-2), out_dir=tmp_path / "a", progress=False)

    def stop(tag, epoch, _t):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(_digits(lr=3e-3), out_dir=tmp_path / "b", progress=False, step_callback=stop)
    mine = tmp_path / "b" / "t"
    shutil.copy(other / "data" / "flow_seed0.pt", mine / "data" / "flow_seed0.pt")  # a finished model, lr = 1e-2
    with pytest.raises(ValueError, match=r"flow_seed0.pt was computed by a run with another configuration "
                                         r"\(lr: 0.01 -> 0.003"):
        execute(_digits(lr=3e-3), out_dir=tmp_path / "b", progress=False, resume=True)


def test_a_training_checkpoint_of_another_width_is_refused_on_resume(tmp_path):
    pytest.importorskip("sklearn")

    def stop(tag, epoch, _t):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(_digits(dim=16, epochs=2), out_dir=tmp_path / "a", progress=False, step_callback=stop)
    with pytest.raises(KeyboardInterrupt):
        execute(_digits(epochs=2), out_dir=tmp_path / "b", progress=False, step_callback=stop)
    ck = "data/flow_seed0_checkpoint.pt"
    shutil.copy(tmp_path / "a" / "t" / ck, tmp_path / "b" / "t" / ck)
    with pytest.raises(ValueError, match=r"another configuration \(dim: 16 -> 8"):
        execute(_digits(epochs=2), out_dir=tmp_path / "b", progress=False, resume=True)


def test_a_piece_without_a_stamp_is_left_to_the_study(tmp_path):
    pytest.importorskip("sklearn")
    path = execute(_digits(), out_dir=tmp_path, progress=False)
    piece = torch.load(path / "data" / "flow_seed0.pt", weights_only=False)
    assert json.loads(piece.pop("run_config"))["params"]["lr"] == _digits()["params"].get("lr", 5e-3)
    torch.save(piece, path / "data" / "flow_seed0.pt")  # as an earlier version wrote it
    (path / "status.json").write_text(json.dumps({"state": "running"}))
    seen = []
    execute(_digits(), out_dir=tmp_path, progress=False, resume=True, step_callback=lambda t, e, _: seen.append(t))
    assert "flow_seed0" not in seen  # reused: old runs still resume


# ---------------------------------------------------------------------------- training that blows up or cannot split
def test_a_learning_rate_that_overflows_exits_3_naming_the_quantity(tmp_path, capsys):
    pytest.importorskip("sklearn")
    args = ["run", "train_digits_quick", "--out", str(tmp_path), "--name", "lr", "--no-progress"]
    for k, v in _digits(lr=1e30)["params"].items():
        args += ["-o", f"{k}={json.dumps(v)}"]
    assert cli_main(args) == 3
    err = capsys.readouterr().err
    assert "produced NaN/inf" in err and "lr = 1e+30" in err and ("tokens" in err or "parameter" in err), err
    assert "x0" not in err


def test_a_test_fraction_that_leaves_no_training_set_is_refused_before_the_run_directory(tmp_path, capsys):
    pytest.importorskip("sklearn")
    for frac in (0.999, 0.001):
        rc = cli_main(["run", "train_digits_quick", "-o", f"test_fraction={frac}", "--out", str(tmp_path)])
        assert rc == 2 and "stratified split needs at least one image of each of the 10 digits" in \
            capsys.readouterr().err
    rc = cli_main(["run", "train_digits_quick", "-o", "test_fraction=0.01", "-o", "analysis_images=64",
                   "--out", str(tmp_path)])
    assert rc == 2 and "analysis_images' = 64 is more than the 18 test images" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- perturbations below the resolution
@pytest.mark.parametrize("kind, eps", [("theorem_stability_weights", "[1e-6,1e-300]"),
                                       ("theorem_stability_data", "1e-300"),
                                       ("theorem_stability_weights", "[1e-6,1e-13]")])
def test_a_perturbation_below_the_resolution_is_refused(tmp_path, capsys, kind, eps):
    rc = cli_main(["run", f"{kind}_quick", "-o", f"eps={eps}", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "float64 cannot resolve such perturbations" in err and "eps >= 1e-12" in err, err
    assert not list(tmp_path.iterdir())


def test_a_claim_with_an_undefined_value_has_no_verdict():
    assert claims.claim("slope", float("nan"), 0.1, 4, reference=1.0, holds=False)["holds"] is None
    assert claims.claim("ratio", None, None, 4, holds=True)["holds"] is None
    assert claims.claim("slope", 1.0, 0.1, 4, reference=1.0, holds=True)["holds"] is True


def test_unresolved_distances_give_no_verdict_instead_of_a_vacuous_bound(tmp_path, monkeypatch):
    from transformer_pde.application.studies import theorems_stability as ts

    monkeypatch.setitem(ts.EPS_FLOOR, "float64", 0.0)  # as if the refusal were not there: eps = 1e-300 runs
    p = ["d=3", "n=4", "heads=1", "seeds=2", "eps=[1e-3,1e-300]", "t1=0.2", "dt=0.05", "record_every=1",
         "layers=2", "perturbations=['ou']", "figures=false"]
    path = execute(ROOT / "experiments" / "theorem_stability_weights_quick.toml", overrides=p, out_dir=tmp_path,
                   progress=False)
    got = json.loads((path / "metrics.json").read_text())["claims"]
    assert got and all(c["holds"] is None for c in got), got  # 0 <= 0 is not evidence


@pytest.mark.parametrize("override, match", [("fd_step=1e-300", "fd_step' = 1e-300 must lie in"),
                                             ("fd_step=0.5", "fd_step' = 0.5 must lie in")])
def test_a_finite_difference_step_outside_the_resolution_is_refused(tmp_path, capsys, override, match):
    assert cli_main(["run", "theory_entropy", "-o", override, "--out", str(tmp_path)]) == 2
    assert match in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_fit_window_below_the_resolution_is_refused(tmp_path, capsys):
    assert cli_main(["run", "layer_norm_rates_quick", "-o", "fit_low=1e-300", "--out", str(tmp_path)]) == 2
    assert "fit_low' = 1e-300 is below what dtype = 'float64' resolves" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- user extensions
X = tp.sphere.sample_uniform(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
HEADS = tp.Heads.random(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


class _NoOutputs(tp.Normalization):
    name = "no_outputs"

    def outputs(self, kernel):
        return None


class _OneHead(tp.Normalization):
    name = "one_head"

    def outputs(self, kernel):  # (1, n, d): would broadcast over the three heads without a check
        return kernel.value_mean()[..., :1, :, :]


class _FieldNone(tp.Normalization):
    name = "field_none"

    def field(self, kernel):
        return None, None


class _FieldWide(tp.Normalization):
    name = "field_wide"

    def field(self, kernel):
        f = kernel.value_field()
        return torch.cat([f, f], -1), None


class _FieldFloat32(tp.Normalization):
    name = "field_float32"

    def field(self, kernel):
        return kernel.value_field().float(), None


@pytest.mark.parametrize("norm, error, match", [
    (_NoOutputs(), TypeError, r"outputs\(kernel\) must return f_h of shape \(\.\.\., H, n, d\) = \(\.\.\., 3, 5, 4\)"),
    (_OneHead(), ValueError, r"have shape \((1, )?1, 5, 4\)"),
    (_FieldNone(), TypeError, "_FieldNone returned a field of NoneType"),
    (_FieldWide(), ValueError, r"_FieldWide returned a field of \((1, )?5, 8\)"),
    (_FieldFloat32(), ValueError, r"_FieldFloat32 returned a field of \((1, )?5, 4\) torch.float32"),
])
def test_a_user_normalisation_with_a_wrong_output_is_refused(norm, error, match):
    with pytest.raises(error, match=match):
        tp.velocity(X, HEADS, normalization=norm)
    with pytest.raises(error, match=match):
        tp.simulate(X, HEADS, t1=0.1, dt=0.05, normalization=norm)


def test_factored_heads_too_large_to_form_densely_are_refused_before_allocating():
    d, k, H = 10 ** 6, 2, 2  # dense A_h: 2 · 10¹² entries, 16 TB
    g = torch.Generator().manual_seed(0)
    q, kk = (torch.randn(H, k, d, generator=g, dtype=torch.float64) for _ in range(2))
    heads = tp.Heads(None, None, query=q, key=kk)
    x = torch.nn.functional.normalize(torch.randn(3, d, generator=g, dtype=torch.float64), dim=-1)
    with pytest.raises(ValueError, match=r"H = 2, d = 1000000\) would need their dense score matrices .* TiB|GiB"):
        tp.velocity(x, heads)
    with pytest.raises(ValueError, match="value factors"):
        heads.score_matrix
    assert heads.is_symmetric is False  # decided without the d × d matrices
    sym = tp.Heads(None, None, query=q, key=q)
    assert sym.is_symmetric is True  # A_h = Q_hᵀQ_h


def test_dense_value_matrices_from_factors_too_large_are_refused_and_the_field_needs_none():
    d, k, H = 10 ** 6, 2, 2
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    heads = tp.Heads(None, None, query=r(H, k, d), key=r(H, k, d), value_in=r(H, k, d), value_out=r(H, d, k))
    with pytest.raises(ValueError, match=r"dense value matrices .*apply_value"):
        heads.value
    x = torch.nn.functional.normalize(r(3, d), dim=-1)
    assert tp.velocity(x, heads).shape == (3, d)  # the values-first kernel: nothing d × d is formed
