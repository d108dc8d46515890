"""The train_digits study: the quick config through the CLI (metrics blocks, parameter counts against
their closed form, learning above chance, figures), a run killed after an epoch and resumed against
an uninterrupted one, and the refusals."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("sklearn", reason="the train_digits study reads scikit-learn's load_digits (the 'train' extra)")

from transformer_pde.application.cli import main as cli_main  # noqa: E402
from transformer_pde.application.runs import execute  # noqa: E402

# a smaller quick config: the study's machinery, not its numbers
SMALL = ["seeds=[0, 1]", "epochs=2", "dim=8", "heads=2", "feedforward=8", "steps=1", "analysis_images=16",
         "lambdas=[0.001]", "batch_size=32", "train_limit=480"]


def _flow_parameters(d, H, L, m, n=8, pixels=8, classes=10):
    """Embedding (p·d + d) + positions (n·d) + L layers of W_Q, W_K, W_V (k×d each per head) and W_O (d×k per
    head) + L feed-forward terms (m·d + m + d·m) + read-out (d·10 + 10)."""
    k = d // H
    return pixels * d + d + n * d + L * 4 * H * k * d + L * (2 * d * m + m) + classes * d + classes


def test_quick_config_through_the_cli(tmp_path):
    args = ["run", "experiments/train_digits_quick.toml", "--out", str(tmp_path), "--name", "q", "--no-progress"]
    for o in SMALL:
        args += ["--override", o]
    assert cli_main(args) == 0
    run = tmp_path / "q"
    m = json.loads((run / "metrics.json").read_text())
    names = {"flow", "transformer", "flow_kinetic_0.001"}
    assert set(m["test_accuracy"]) == names and set(m["parameters"]) == names
    for name, acc in m["test_accuracy"].items():
        s = torch.tensor(acc["seeds"], dtype=torch.float64)
        assert len(s) == 2
        assert acc["mean"] == pytest.approx(float(s.mean()), rel=1e-12)
        assert acc["sem"] == pytest.approx(float(s.std(unbiased=True)) / math.sqrt(2), rel=1e-9, abs=1e-15)
        assert float(s.min()) > 0.2, (name, acc)  # ten classes: chance is 0.1; two epochs already learn
        hist = m["history"][name]
        assert [e["epoch"] for e in hist["0"]] == [1, 2]
        assert hist["0"][-1]["test_accuracy"] == acc["seeds"][0]
    assert m["parameters"]["flow"] == m["parameters"]["flow_kinetic_0.001"] == _flow_parameters(8, 2, 2, 8)
    # the discrete transformer's width is matched to the flow's count (its layers carry biases and LayerNorms)
    assert abs(m["parameters"]["transformer"] - m["parameters"]["flow"]) <= 0.05 * m["parameters"]["flow"]
    assert m["split"] == {"train": 480, "test": 540}
    # the regularised flow moves its tokens less than the plain one, on every seed
    for a, b in zip(m["test_kinetic"]["flow_kinetic_0.001"]["seeds"], m["test_kinetic"]["flow"]["seeds"]):
        assert a < b
    depth = m["depth"]["flow"]
    assert len(depth["times"]) == len(depth["mean_cosine"]) == len(depth["clusters"]) == len(depth["energy"])
    assert all(-1.0 <= c <= 1.0 for c in depth["mean_cosine"]) and all(1 <= c <= 8 for c in depth["clusters"])
    for fig in ("train_digits_accuracy", "train_digits_depth"):
        assert (run / "figures" / f"{fig}.png").exists() and fig in m["figure_captions"]
    assert (run / "series" / "flow_seed1.csv").read_text().count("\n") == 3  # header + two epochs
    assert not list((run / "data").glob("*_checkpoint.pt"))  # finished models leave no checkpoint behind
    from transformer_pde.application.studies.training import results_table

    table = results_table(m)
    assert table.count("\n| flow") == 2 and "| transformer |" in table


def test_a_run_killed_after_an_epoch_resumes_without_losing_or_repeating_one(tmp_path):
    cfg = {"kind": "train_digits", "name": "r",
           "params": {"seeds": [3], "epochs": 3, "dim": 8, "heads": 2, "feedforward": 4, "steps": 1,
                      "lambdas": [0.01], "analysis_images": 8, "batch_size": 32, "figures": False,
                      "dtype": "float64", "train_limit": 96}}

    class Kill(Exception):
        pass

    def killer(tag, epoch, _t):
        if tag == "flow_kinetic_0.01_seed3" and epoch == 2:
            raise Kill

    with pytest.raises(Kill):
        execute(cfg, out_dir=tmp_path / "a", progress=False, step_callback=killer)
    ck = torch.load(tmp_path / "a" / "r" / "data" / "flow_kinetic_0.01_seed3_checkpoint.pt", weights_only=False)
    assert ck["epoch"] == 2
    epochs = []
    a = execute(cfg, out_dir=tmp_path / "a", progress=False, resume=True,
                step_callback=lambda tag, e, _t: epochs.append((tag, e)))
    assert epochs == [("flow_kinetic_0.01_seed3", 3)]  # the finished models are reused, the killed one continues
    b = execute(cfg, out_dir=tmp_path / "b", progress=False)
    ha, hb = (json.loads((p / "metrics.json").read_text())["history"] for p in (a, b))
    for name in ("flow", "transformer", "flow_kinetic_0.01"):
        ra, rb = ha[name]["3"], hb[name]["3"]
        assert [e["epoch"] for e in ra] == [e["epoch"] for e in rb] == [1, 2, 3]
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert_close(torch.tensor([e[key] for e in ra]), torch.tensor([e[key] for e in rb]),
                         rtol=1e-9, atol=1e-12)


def test_bad_configs_are_refused_before_any_work(tmp_path):
    base = {"kind": "train_digits", "name": "x", "params": {"dim": 6, "heads": 4}}
    with pytest.raises(ValueError, match="multiple of H"):
        execute(base, out_dir=tmp_path, progress=False)
    for params, key in (({"kinetic": "euclid"}, "kinetic"), ({"lambdas": [-1.0]}, "lambdas"),
                        ({"tokens": "pixels"}, "tokens"), ({"seeds": []}, "seeds")):
        with pytest.raises(ValueError, match=key):
            execute({"kind": "train_digits", "name": "x", "params": params}, out_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())
