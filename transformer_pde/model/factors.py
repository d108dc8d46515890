"""Checks of factored heads: the value factors' shapes, and the memory of the dense (..., H, d, d) matrices a
pair of factors would form (refused before the allocation)."""

from __future__ import annotations

import math

from ..utils.validation import MEMORY_FRACTION, broadcast_shapes, check_same, check_tensor, machine_memory

__all__ = []
#: named internal API: the checks of :class:`~transformer_pde.model.heads.Heads`
__internal__ = ["check_value_factors", "dense_bytes", "fits_in_memory", "check_dense"]


def check_value_factors(ref, value, value_in, value_out, H, d):
    """The value factors W_V (..., H, k_v, d) and O (..., H, d, k_v): both or neither, not with ``value``."""
    if value_in is None and value_out is None:
        return
    if value_in is None or value_out is None:
        raise ValueError("give both value factors value_in = W_V (..., H, k_v, d) and value_out = O (..., H, d, k_v), "
                         "or neither")
    if value is not None:
        raise ValueError("give either value (..., H, d, d) or the factors (value_in, value_out), not both")
    check_tensor(value_in, "value_in", min_dim=3)
    check_tensor(value_out, "value_out", min_dim=3)
    check_same(ref, value_in, "score", "value_in")
    check_same(ref, value_out, "score", "value_out")
    kv = value_in.shape[-2]
    if value_in.shape[-3:] != (H, kv, d) or value_out.shape[-3:] != (H, d, kv):
        raise ValueError(f"value factors must be value_in (..., {H}, k_v, {d}) and value_out (..., {H}, {d}, k_v); "
                         f"got {tuple(value_in.shape)} and {tuple(value_out.shape)}")


def dense_bytes(a, b, num_heads: int, dim: int) -> float:
    """Bytes of the dense (..., H, d, d) matrices formed from two factors a, b (..., H, k, d)."""
    batch = math.prod(broadcast_shapes(a.shape[:-3], b.shape[:-3]))
    return float(batch) * num_heads * dim ** 2 * a.element_size()


def fits_in_memory(a, b, num_heads: int, dim: int) -> bool:
    """Whether the dense matrices of :func:`dense_bytes` fit in ``MEMORY_FRACTION`` of the device's memory."""
    return dense_bytes(a, b, num_heads, dim) <= MEMORY_FRACTION * machine_memory(a.device)


def check_dense(a, b, num_heads: int, dim: int, what: str, fix: str) -> None:
    """Refuse, before the allocation, dense (..., H, d, d) matrices from factors that would not fit in memory
    (an out-of-memory error after seconds, or a machine that swaps)."""
    need, limit = dense_bytes(a, b, num_heads, dim), MEMORY_FRACTION * machine_memory(a.device)
    if need > limit:
        raise ValueError(f"these factored heads (H = {num_heads}, d = {dim}) would need their dense "
                         f"{what} here: {need / 2**30:.3g} GiB, more than {MEMORY_FRACTION:g} of this machine's "
                         f"memory ({limit / 2**30:.3g} GiB); {fix}")
