"""utils.hardware: cache sizes from a fake sysfs folder, sysconf, the fallback, and the fused kernel's
score block derived from them."""

import os

import pytest
import torch

from transformer_pde.dynamics import layernorm
from transformer_pde.utils import hardware


def _cache(root, index, level, kind, size, shared="0"):
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")
    if shared is not None:
        (d / "shared_cpu_list").write_text(f"{shared}\n")


@pytest.mark.parametrize("text,bytes_", [("48K", 48 * 1024), ("2048K", 2 * 1024 ** 2), ("1 MiB", 1024 ** 2),
                                         ("32768", 32768), ("1m", 1024 ** 2), (" 2G\n", 2 * 1024 ** 3)])
def test_parse_size_reads_sysfs_and_lscpu_sizes(text, bytes_):
    assert hardware.parse_size(text) == bytes_


@pytest.mark.parametrize("bad", ["", "K", "12 parsecs", "1.5M", "-4K"])
def test_parse_size_refuses_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match="cache size"):
        hardware.parse_size(bad)


def test_read_sysfs_takes_data_and_unified_caches(tmp_path):
    """The layout of this kind of machine: L1 data and instruction caches, a per-core L2, an L3 shared
    by CPUs 0-1 and 4-7; the instruction cache is ignored, the L3's sharing counted."""
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "64K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    _cache(tmp_path, 3, 3, "Unified", "491520K", shared="0-1,4-7")
    got = hardware.read_sysfs(tmp_path)
    assert got == hardware.CacheSizes(l1d=48 * 1024, l2=2048 * 1024, l3=491520 * 1024, source="sysfs", l3_shared=6)


def test_read_sysfs_without_l2_or_folder_is_none_and_skips_unreadable_entries(tmp_path):
    assert hardware.read_sysfs(tmp_path / "missing") is None
    _cache(tmp_path, 0, 1, "Data", "32K")
    assert hardware.read_sysfs(tmp_path) is None                       # no L2: the next source decides
    _cache(tmp_path, 1, 2, "Unified", "garbage")                        # unreadable size: skipped
    assert hardware.read_sysfs(tmp_path) is None
    _cache(tmp_path, 2, 2, "Unified", "1280K", shared=None)             # no shared_cpu_list: fine
    got = hardware.read_sysfs(tmp_path)
    assert (got.l1d, got.l2, got.l3) == (32 * 1024, 1280 * 1024, None)


def test_read_sysconf_and_the_fallback(monkeypatch):
    values = {"SC_LEVEL1_DCACHE_SIZE": 32768, "SC_LEVEL2_CACHE_SIZE": 1310720, "SC_LEVEL3_CACHE_SIZE": 0}
    monkeypatch.setattr(os, "sysconf_names", {k: i for i, k in enumerate(values)}, raising=False)
    monkeypatch.setattr(os, "sysconf", lambda name: values[name], raising=False)
    assert hardware.read_sysconf() == hardware.CacheSizes(l1d=32768, l2=1310720, l3=None, source="sysconf")
    values["SC_LEVEL2_CACHE_SIZE"] = -1                                 # glibc's "unknown"
    assert hardware.read_sysconf() is None
    # neither source answers: the fallback
    monkeypatch.setattr(hardware, "read_sysfs", lambda root=None: None)
    hardware.cache_sizes.cache_clear()
    try:
        assert hardware.cache_sizes() == hardware.FALLBACK
    finally:
        hardware.cache_sizes.cache_clear()


def test_this_machine_has_plausible_caches_and_a_model_name():
    c = hardware.cache_sizes()
    assert c.source in ("sysfs", "sysconf", "fallback")
    assert 4 * 1024 <= c.l1d <= c.l2 <= 1024 ** 3
    assert isinstance(hardware.cpu_model(), str) and hardware.cpu_model()


def test_score_block_is_a_fraction_of_l2_with_a_floor(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cache_sizes", lambda: hardware.CacheSizes(48 * 1024, 2 * 1024 ** 2, None, "sysfs"))
    assert layernorm.score_block_bytes(cpu) == int(layernorm.SCORE_BLOCK_FRACTION * 2 * 1024 ** 2)
    monkeypatch.setattr(hardware, "cache_sizes", lambda: hardware.CacheSizes(16 * 1024, 64 * 1024, None, "sysfs"))
    assert layernorm.score_block_bytes(cpu) == 64 * 1024                 # the floor
    assert layernorm.score_block_bytes(torch.device("meta")) == layernorm._DEVICE_BLOCK_BYTES
    monkeypatch.setattr(layernorm, "_SCORE_BLOCK_BYTES", 4096)
    assert layernorm.score_block_bytes(cpu) == 4096


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fused_passes_take_blocks_from_the_detected_l2(monkeypatch, dtype):
    """The layer maps' fused pass and the one-block kernel size their blocks of systems from the L2 that
    hardware.cache_sizes() reports: a 1 MiB L2 gives twice the blocks of a 2 MiB one (the peers' workload,
    256 systems × 32 tokens, H = 8: one system's scores are 32·8·32 numbers), with the same result."""
    import transformer_pde as tp
    from transformer_pde.model import pair_block

    g = torch.Generator().manual_seed(0)
    B, n, d, H = 256, 32, 16, 8
    x = torch.nn.functional.normalize(torch.randn(B, n, d, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    A = (torch.randn(B, H, d, d, generator=g, dtype=torch.float64) / 4).to(dtype)
    heads = tp.Heads(A, A.flip(-1))
    per = n * H * n * torch.finfo(dtype).bits // 8
    got = {}
    for l2 in (1024 ** 2, 2 * 1024 ** 2):
        monkeypatch.setattr(hardware, "cache_sizes", lambda l2=l2: hardware.CacheSizes(32 * 1024, l2, None, "sysfs"))
        fu = layernorm.FusedUpdate(None, 1.0)
        calls = []
        for name in ("_update", "_update_keys"):
            real = getattr(fu, name)
            monkeypatch.setattr(fu, name, lambda blk, bufs, out, real=real: (calls.append(out.shape[0]),
                                                                             real(blk, bufs, out)))
        got[l2] = fu(x, heads).ambient
        size = int(layernorm.SCORE_BLOCK_FRACTION * l2) // per  # systems per block
        assert calls == [size] * (B // size)
        assert pair_block.block_bytes(torch.device("cpu")) == int(pair_block.BLOCK_FRACTION * l2)
    tol = 20 * torch.finfo(dtype).eps
    torch.testing.assert_close(got[1024 ** 2], got[2 * 1024 ** 2], rtol=tol, atol=tol)
