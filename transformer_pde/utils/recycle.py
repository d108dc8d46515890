"""Memory a run step can write into again: results the caller has let go of.

A run loop holds the current tokens (and the current field) while it computes the next ones, then drops
the old ones.  Allocating a fresh (..., n, d) tensor at every step makes the operating system hand out
fresh pages, and on a virtual machine every first touch of a 4 KiB page is a fault (about 0.4 ms per MiB
on the CPUs this library is benchmarked on, as much as a small step's arithmetic).  :class:`Recycler`
keeps the last few results it handed out and hands one back only when nothing else uses its memory any
more: no Python reference to the tensor (a callback that kept the tokens, a local variable, an
evaluation) and no other tensor on its memory (a view, a detached copy) holds it.

    ring = Recycler(2)
    y = ring.take((B, n, d), like=x)     # an earlier result if it is free, else new memory (kept)

The tests are the tensor's Python reference count and its storage's use count (:func:`sole_user`, which
torch's own CUDA-graph trees read for the same question); where the latter cannot be read, nothing is
reused.
"""

from __future__ import annotations

import sys
from typing import List, Sequence

import torch

__all__ = ["Recycler", "sole_user"]


def sole_user(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor that uses its memory (False where torch cannot say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # pragma: no cover - a torch without the count: never reuse
        return False
    try:
        return count(t.untyped_storage()._cdata) <= 2    # t itself, and the storage object made to ask
    except Exception:  # pragma: no cover - the same
        return False


class Recycler:
    """Up to ``keep`` results handed out before, reused once nothing else holds them (module docstring)."""

    def __init__(self, keep: int = 2):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.keep = keep
        self._kept: List[torch.Tensor] = []

    def take(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``shape`` with ``like``'s dtype and device that nothing else uses: one handed out
        before whose holders have all let go, else a new one (kept, dropping the oldest beyond ``keep``).
        Its contents are arbitrary."""
        shape = tuple(shape)
        for i in range(len(self._kept)):
            if self._free(i) and self._kept[i].shape == shape and self._kept[i].dtype == like.dtype \
                    and self._kept[i].device == like.device:
                return self._kept[i]
        t = torch.empty(shape, dtype=like.dtype, device=like.device)
        self._kept.append(t)
        del self._kept[:-self.keep]
        return t

    def _free(self, i: int) -> bool:
        """Whether nothing but this recycler holds the i-th kept tensor: no Python reference to the tensor
        besides the recycler's list, and no other tensor (a view, a detached copy) on its memory."""
        return sys.getrefcount(self._kept[i]) <= 2 and sole_user(self._kept[i])   # the list and the call's argument
