"""Facts about the CPU the kernels run on: its model name and its data-cache sizes.

The fused kernels take their work in blocks that stay in one core's cache (the layer maps'
:class:`~transformer_pde.dynamics.layernorm.FusedUpdate` sizes its score blocks from the L2 size).
The sizes are read once per process, from the first source that answers:

1. Linux sysfs, ``/sys/devices/system/cpu/cpu0/cache/index*/`` (files ``level``, ``type``, ``size``
   and ``shared_cpu_list``): the data and unified caches of the first CPU;
2. ``os.sysconf`` (``SC_LEVEL1_DCACHE_SIZE``, ``SC_LEVEL2_CACHE_SIZE``, ``SC_LEVEL3_CACHE_SIZE``, glibc);
3. the fallback :data:`FALLBACK`: L1d 32 KiB, L2 1 MiB, L3 unknown (a common size on current x86
   cores; a wrong guess costs speed, never correctness).

::

    from transformer_pde.utils import hardware

    hardware.cpu_model()          # e.g. 'Intel(R) Xeon(R) Processor' (/proc/cpuinfo, else platform)
    c = hardware.cache_sizes()    # CacheSizes(l1d=49152, l2=2097152, l3=503316480, source='sysfs')
    c.l2                          # bytes of one core's L2 cache
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Union

__all__ = ["CacheSizes", "FALLBACK", "SYSFS_CACHE_DIR", "parse_size", "read_sysfs", "read_sysconf",
           "cache_sizes", "cpu_model"]

#: where Linux lists the caches of the first CPU
SYSFS_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class CacheSizes:
    """Data-cache sizes in bytes of one core (L3: the whole cache, shared by ``l3_shared`` CPUs;
    None where unknown) and where they were read (``source``: "sysfs", "sysconf" or "fallback")."""

    l1d: int
    l2: int
    l3: Optional[int]
    source: str
    l3_shared: int = 1


#: the sizes used when the system says nothing
FALLBACK = CacheSizes(l1d=32 * 1024, l2=1024 * 1024, l3=None, source="fallback")

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2, "MIB": 1024 ** 2,
          "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}


def parse_size(text: str) -> int:
    """Bytes of a cache size as sysfs and lscpu write it: "48K", "2048K", "1 MiB", "32768" (bytes).

    Raises
    ------
    ValueError
        not a number followed by one of B, K, KB, KiB, M, MB, MiB, G, GB, GiB (any case).
    """
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a cache size from {text!r}; expected e.g. '48K', '2048K', '1 MiB' or '32768'")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _count_cpus(cpu_list: str) -> int:
    """Number of CPUs in a sysfs list such as "0-3,8-11" (1 for an empty or unreadable list)."""
    n = 0
    for part in cpu_list.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            n += int(hi or lo) - int(lo) + 1
        except ValueError:
            return 1
    return max(n, 1)


def read_sysfs(root: Union[str, Path] = SYSFS_CACHE_DIR) -> Optional[CacheSizes]:
    """The data and unified caches listed under ``root`` (``index*/level``, ``type``, ``size``,
    ``shared_cpu_list``); None when there is no readable L2 (no such folder, other systems)."""
    found: Dict[int, tuple] = {}
    try:
        entries = sorted(Path(root).glob("index*"))
    except OSError:
        return None
    for entry in entries:
        try:
            kind = (entry / "type").read_text().strip()
            level = int((entry / "level").read_text())
            size = parse_size((entry / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or size <= 0:
            continue
        try:
            shared = _count_cpus((entry / "shared_cpu_list").read_text())
        except OSError:
            shared = 1
        found.setdefault(level, (size, shared))
    if 2 not in found:
        return None
    l1d = found.get(1, (FALLBACK.l1d, 1))[0]
    l3, l3_shared = found.get(3, (None, 1))
    return CacheSizes(l1d=l1d, l2=found[2][0], l3=l3, source="sysfs", l3_shared=l3_shared)


def read_sysconf() -> Optional[CacheSizes]:
    """The sizes from ``os.sysconf`` (glibc reports them, 0 or -1 when it does not know); None without an L2."""
    def get(name):
        try:
            v = os.sysconf(name) if name in getattr(os, "sysconf_names", {}) else 0
        except (OSError, ValueError):
            v = 0
        return v if v and v > 0 else None

    l2 = get("SC_LEVEL2_CACHE_SIZE")
    if l2 is None:
        return None
    return CacheSizes(l1d=get("SC_LEVEL1_DCACHE_SIZE") or FALLBACK.l1d, l2=l2, l3=get("SC_LEVEL3_CACHE_SIZE"),
                      source="sysconf")


@functools.lru_cache(maxsize=None)
def cache_sizes() -> CacheSizes:
    """This machine's cache sizes, read once per process (module docstring: sysfs, sysconf, fallback)."""
    return read_sysfs() or read_sysconf() or FALLBACK


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name ("model name" of /proc/cpuinfo; else ``platform.processor()``; else "unknown")."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
