"""Reading a pretrained network's files: every damaged or foreign file is refused by name with the fix before
any weight is read (never a random-weight fill, a raw parser error or an index error deep in the model), the
inputs of its forward pass are checked, and the probe study matches its stored pieces to the weights."""

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformer_pde as tp
from transformer_pde.processes import model_files as pre

transformers = pytest.importorskip("transformers", reason="reading networks needs transformers")

ROOT = Path(__file__).resolve().parents[1]


def _tiny(kind: str, folder: Path) -> Path:
    """A seeded two-layer network of ``kind`` saved to ``folder`` (config.json + model.safetensors)."""
    torch.manual_seed(0)
    T = transformers
    common = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=8, intermediate_size=16)
    model = {"bert": lambda: T.BertModel(T.BertConfig(vocab_size=50, max_position_embeddings=24, **common)),
             "roberta": lambda: T.RobertaModel(T.RobertaConfig(vocab_size=50, max_position_embeddings=24, **common)),
             "gpt2": lambda: T.GPT2Model(T.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=50, n_positions=24)),
             "vit": lambda: T.ViTModel(T.ViTConfig(image_size=8, patch_size=4, **common))}[kind]()
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def bert(tmp_path):
    return _tiny("bert", tmp_path / "bert")


def _edit_config(folder: Path, change):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(cfg)))


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2", "vit"])
def test_the_saved_networks_of_every_family_pass_the_checks_and_load(tmp_path, kind):
    folder = _tiny(kind, tmp_path / kind)
    info = pre.check_model_folder(folder)
    assert info["layers"] == 2 and info["hidden_size"] == 8
    net = tp.pretrained.load(folder)
    assert net.num_layers == 2 and net.dim == 8


@pytest.mark.parametrize("change, match", [
    (lambda c: {**c, "num_hidden_layers": 4}, "config.json says 4 layers, the weights hold 2 blocks"),
    (lambda c: [c], "holds a JSON list, not an object"),
    (lambda c: {**c, "hidden_size": 16}, "hidden size 16"),
    (lambda c: {**c, "model_type": "llama"}, "model_type 'llama', which this library does not read"),
    (lambda c: {**c, "vocab_size": 60}, "vocab_size 60"),
    (lambda c: {**c, "max_position_embeddings": 30}, "30 position embeddings"),
    (lambda c: {**c, "num_attention_heads": 3}, "not a multiple of the 3 attention heads"),
    (lambda c: {**c, "num_hidden_layers": "two"}, "num_hidden_layers = 'two' must be a whole number"),
])
def test_a_config_that_does_not_fit_the_weights_is_refused_before_loading(bert, change, match):
    _edit_config(bert, change)
    with pytest.raises(ValueError, match=match):
        tp.pretrained.load(bert)


def test_a_config_nested_too_deeply_or_not_json_is_refused(bert):
    (bert / "config.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match="not a readable JSON file"):
        tp.pretrained.load(bert)
    (bert / "config.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        tp.pretrained.load(bert)


def _header_length(folder: Path) -> int:
    with open(folder / "model.safetensors", "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def test_damaged_weights_are_refused_by_name(bert):
    f = bert / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as h:  # truncated inside the tensor data: the header is intact
        h.truncate(size - 100)
    with pytest.raises(ValueError, match="model.safetensors is truncated: the tensor"):
        tp.pretrained.load(bert)
    with open(f, "r+b") as h:  # truncated inside the header
        h.truncate(_header_length(bert) // 2)
    with pytest.raises(ValueError, match="not a safetensors file: its header length"):
        tp.pretrained.load(bert)
    data = bytearray((bert.parent / "bert").joinpath("config.json").read_bytes())
    f.write_bytes(struct.pack("<Q", 2 ** 62) + bytes(data))  # a planted header length
    with pytest.raises(ValueError, match="header length 4611686018427387904 does not fit"):
        tp.pretrained.load(bert)
    f.write_bytes(struct.pack("<Q", 8) + b"notjson!" + b"\0" * 64)
    with pytest.raises(ValueError, match="header is not JSON"):
        tp.pretrained.load(bert)
    f.unlink()
    with pytest.raises(ValueError, match="lacks model.safetensors"):
        tp.pretrained.load(bert)


def test_a_damaged_tokenizer_is_refused_by_name(bert):
    (bert / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(ValueError, match="tokenizer.json cannot be read as a tokenizer.*remove it"):
        tp.pretrained.load(bert)


def test_forward_inputs_are_checked(bert):
    net = tp.pretrained.load(bert)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        tp.pretrained.hidden_states(net, torch.tensor([[1, 2, 10 ** 6]]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        tp.pretrained.hidden_states(net, torch.tensor([[1, -3, 2]]))
    with pytest.raises(ValueError, match="longer than the 24 positions"):
        tp.pretrained.hidden_states(net, torch.ones(1, 30, dtype=torch.long))
    states, mask = tp.pretrained.hidden_states(net, torch.ones(2, 5, dtype=torch.long))
    assert states.shape == (3, 2, 5, 8)


def test_text_with_a_lone_surrogate_is_refused_before_tokenising():
    with pytest.raises(ValueError, match=r"text 1 holds '\\udc80' at position 3, a lone surrogate"):
        pre.check_texts(["fine", "abc\udc80def"])
    pre.check_texts(["é ü 漢字 🙂"])  # real characters pass


def test_cloud_distances_refuse_nan_and_zero_tokens():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(3, 2, 4, 5, generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    pred = real + 0.1 * torch.randn(3, 2, 4, 5, generator=g)
    assert min(tp.pretrained.cloud_distances(pred, real, mask)["w2"][1:]) > 0
    for bad in (float("nan"), 0.0):
        p = pred.clone()
        p[1, 0, 2] = bad  # one token of one sentence at layer 1
        with pytest.raises(ValueError, match="pred holds a NaN/inf or zero vector at a real token of hidden-state index 1"):
            tp.pretrained.cloud_distances(p, real, mask)
        r = real.clone()
        r[2, 1, 0] = bad
        with pytest.raises(ValueError, match="real holds"):
            tp.pretrained.cloud_distances(pred, r, mask)
    p = pred.clone()
    p[1, 0, 3] = float("nan")
    m = mask.clone()
    m[0, 3] = False  # a padded token may hold anything
    assert all(math.isfinite(v) for v in tp.pretrained.cloud_distances(p, real, m)["w2"])


def _cli(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "transformer_pde.application.cli", *args], cwd=cwd, capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    return r.returncode, r.stdout, r.stderr


def test_the_probe_refuses_damaged_model_files_before_its_run_directory_exists(bert, tmp_path):
    with open(bert / "model.safetensors", "r+b") as h:
        h.seek(0)
        h.write(struct.pack("<Q", 2 ** 62))
    rc, out, err = _cli("run", "pretrained_probe_quick", "-o", f"model={json.dumps(str(bert))}", "--out", "runs",
                        cwd=tmp_path)
    assert rc == 2, err
    assert "config key 'model'" in err and "header length" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    shutil.rmtree(bert)
    _tiny("bert", bert)
    rc, out, err = _cli("run", "pretrained_probe_quick", "-o", f"model={json.dumps(str(bert))}", "-o", "max_length=64",
                        "--out", "runs", cwd=tmp_path)
    assert rc == 2 and "max_length' = 64 is beyond the 24 positions" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_resumed_probe_refuses_pieces_computed_with_other_weights(tmp_path):
    pytest.importorskip("all_minilm_l6_v2", reason="the packaged MiniLM: " + tp.pretrained.MINILM_PIP)
    from safetensors.torch import load_file, save_file

    from transformer_pde.application.runs import execute

    model = tmp_path / "model"
    shutil.copytree(tp.pretrained.packaged_minilm(tmp_path / "cache"), model)
    cfg = {"kind": "pretrained_probe", "name": "p", "params": {
        "model": str(model), "sentences": 4, "max_length": 8, "buckets": 2, "rungs": ["network"],
        "lipschitz_sentences": 1, "lipschitz_iterations": 1, "figures": False, "dtype": "float64"}}

    def stop(tag, k, t):
        if tag == "bucket_0":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(cfg, out_dir=tmp_path / "runs", progress=False, step_callback=stop)
    weights = load_file(model / "model.safetensors")
    weights["encoder.layer.0.attention.self.query.weight"] *= 2.0  # the same network shape, other weights
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="computed with other weights than the model folder"):
        execute(cfg, out_dir=tmp_path / "runs", progress=False, resume=True)


def test_texts_longer_than_the_positions_are_refused_by_max_length(tmp_path):
    pytest.importorskip("all_minilm_l6_v2", reason="the packaged MiniLM: " + tp.pretrained.MINILM_PIP)
    net = tp.pretrained.load(tp.pretrained.packaged_minilm(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"up to \d+ tokens long \(max_length = 1000\), beyond the 512 positions"):
        tp.pretrained.hidden_states(net, ["hello world " * 400], max_length=1000)
    with pytest.raises(ValueError, match="lone surrogate"):
        tp.pretrained.hidden_states(net, ["The cat sat.", "abc \ud800 def"])
    states, _ = tp.pretrained.hidden_states(net, ["hello world " * 400], max_length=512)  # cut to the positions
    assert states.shape[2] == 512
