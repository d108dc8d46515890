"""The benchmark scripts' refusals: the peer benchmark times the peers' own code and refuses clearly, before
any work, without checkouts of both (no timing here: speed lives in the scripts themselves)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def peers(monkeypatch):
    for var in ("TRANSFORMER_PDE_SIMUFORMER", "TRANSFORMER_PDE_ROTF"):
        monkeypatch.delenv(var, raising=False)
    return _script("benchmark_peers")


def _refused(peers, argv, capsys, *phrases):
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for p in phrases:
        assert p in err, err
    return err


def test_peer_benchmark_refuses_without_checkouts(peers, capsys, tmp_path, monkeypatch):
    _refused(peers, [], capsys, "no checkout of simuformer", "git clone https://github.com/nikitus20/simuformer",
             "--simuformer", "TRANSFORMER_PDE_SIMUFORMER")
    sf = tmp_path / "simuformer"
    sf.mkdir()
    (sf / "simuxform.py").write_text("class SimuXForm:\n    def step(self, t):\n        return t\n"
                                     "    def check_stats(self):\n        return 0.0, 0.0\n")
    _refused(peers, ["--simuformer", str(sf)], capsys, "no checkout of rotf",
             "git clone https://github.com/borjanG/2023-transformers-rotf")
    monkeypatch.setenv("TRANSFORMER_PDE_SIMUFORMER", str(sf))  # the environment names it as well as --simuformer
    _refused(peers, ["--rotf", str(tmp_path / "missing")], capsys, "is not a folder")
    empty = tmp_path / "rotf"
    empty.mkdir()
    _refused(peers, ["--rotf", str(empty)], capsys, "has no phase-diagrams.py")
    (empty / "phase-diagrams.py").write_text("class simu_xform:\n    def step_1(self, t):\n        return t\n")
    _refused(peers, ["--rotf", str(empty)], capsys, "no simu_xform with step_1 and check_stats")
    (sf / "simuxform.py").write_text("class SimuXForm:\n    pass\n")
    _refused(peers, ["--rotf", str(empty)], capsys, "no SimuXForm with step and check_stats")


def test_peer_benchmark_loads_a_checkout_with_the_timed_methods(peers, tmp_path):
    sf, rf = tmp_path / "sf", tmp_path / "rf"
    sf.mkdir()
    rf.mkdir()
    (sf / "simuxform.py").write_text("class SimuXForm:\n    def step(self, t):\n        return t\n"
                                     "    def check_stats(self):\n        return 0.0, 0.0\n")
    (rf / "phase-diagrams.py").write_text("if __name__ == '__main__':\n    raise SystemExit('not run')\n"
                                          "class simu_xform:\n    def step_1(self, t):\n        return t\n"
                                          "    def check_stats(self):\n        return 0, 0\n")
    assert peers.load_simuformer(str(sf)).SimuXForm.__name__ == "SimuXForm"
    assert peers.load_rotf(str(rf)).simu_xform.__name__ == "simu_xform"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("H", [1, 3])
def test_the_products_floor_runs_the_kernels_products_and_nothing_else(peers, monkeypatch, dtype, H):
    """The floor rows of the peer benchmark time the fused kernel's own matrix products: one step of
    ``products_floor`` makes the same product calls, with the same shapes, as one FusedUpdate call, in both
    layouts (float32 "queries", float64 "keys"), and no exponential."""
    import torch

    from transformer_pde.dynamics import layernorm

    dt = getattr(torch, dtype)
    M, BF, V = peers.problem(5, 4, 3, H, dt)
    monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", 2 * 4 * H * 4 * M.element_size())  # two systems a block
    calls = []
    for name in ("bmm", "mm"):
        real = getattr(torch, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, tuple(a[0].shape), tuple(a[1].shape)))
            return _real(*a, **k)
        monkeypatch.setattr(torch, name, spy)
    exps = []
    real_exp2 = torch.Tensor.exp2_
    monkeypatch.setattr(torch.Tensor, "exp2_", lambda self: exps.append(1) or real_exp2(self))

    floor = peers.products_floor(M, BF, V, steps=1)  # builds (and runs the kernel once to fill its buffers)
    calls.clear()
    exps.clear()
    heads = peers.tp.Heads(BF, V.transpose(-1, -2), beta=1.0)
    layernorm.FusedUpdate(None, 1.0)(M, heads)
    kernel, kernel_exps = list(calls), len(exps)
    calls.clear()
    exps.clear()
    floor()
    assert calls == kernel and len(calls) == 4 * 3  # four products in each of three blocks
    assert kernel_exps == 3 and exps == []
