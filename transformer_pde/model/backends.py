"""Kernel backends: which implementation computes the attention statistics, and the plumbing they share.

Backends (``backend=``; all return the same numbers to rounding, see tests/test_attention.py):

* ``"chunked"`` — plain torch (:func:`transformer_pde.model.softmax.softmax_statistics`).  The score
  block is formed ``chunk_elements`` entries at a time (``batch · H · rows · m`` ≤
  ``DEFAULT_CHUNK_ELEMENTS`` by default), so memory grows like N, not N².
* ``"dense"`` — the same code with a single block (memory ``batch · H · n · m``): the oracle.
* ``"sdpa"`` — torch's fused scaled-dot-product-attention kernel.  On CPU this is the flash
  kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, :func:`flash_cpu_op`), which also
  returns the log-sum-exp, so it gives the full statistics in one fused, O(N)-memory, parallel pass.
  Where that kernel does not apply (CUDA and other devices, dtypes other than float32/float64, a
  torch without it) it falls back to ``"chunked"``.
* ``"keops"`` — symbolic KeOps reductions (``pykeops``, optional dependency, CUDA only in
  practice); raises ``ImportError`` with an install hint when pykeops is missing.
* ``"auto"`` (default) — autograd path when an input requires grad; otherwise ``"sdpa"`` on
  CPU (float32/float64) when the fused kernel is available, KeOps on CUDA for large problems
  when pykeops is importable, ``"chunked"`` elsewhere.  Never KeOps on CPU.  :class:`kernel_backend`
  sets what "auto" resolves to for code that does not pass a backend.

Memory of the no-grad backends ("chunked", "sdpa", "keops"): O(batch · H · (n + m) · c) for
the inputs and outputs plus one block — never the (batch, H, n, m) tensor (tests/test_attention.py
measures the peak; scripts/benchmark_field.py prints it).

Causal attention (``causal=True``): query i sees only the keys j ≤ i; :func:`causal_log_prefix_mass`
gives log W_i = log Σ_{j≤i} w_j and :func:`causal_block_mask` the mask of one score block.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "BACKENDS", "KEOPS_AUTO_MIN_ELEMENTS", "select_backend", "keops_available",
           "sdpa_available", "kernel_backend", "causal_log_prefix_mass"]
#: named internal API (not public): the argument checks and block plumbing every kernel shares
__internal__ = ["flash_cpu_op", "check_backend", "check_chunk", "check_causal", "rows_per_chunk", "needs_grad",
                "bshape", "causal_block_mask"]

#: elements of one score block (batch · H · rows · m); 2^22 float64 = 32 MiB
DEFAULT_CHUNK_ELEMENTS = 1 << 22

#: kernel backends accepted by ``backend=`` (module docstring)
BACKENDS = ("auto", "dense", "chunked", "sdpa", "keops")

#: problems with at least this many score entries (batch · H · n · m) use KeOps under "auto" on CUDA
KEOPS_AUTO_MIN_ELEMENTS = 1 << 26



def keops_available() -> bool:
    """True when ``pykeops`` can be imported (it is not a hard dependency)."""
    try:
        import pykeops.torch  # noqa: F401
    except Exception:  # ImportError, or a broken compiler setup raising at import
        return False
    return True


_FLASH_CPU = None


def flash_cpu_op():
    """torch's CPU flash-attention op returning (output, logsumexp), or None if this torch lacks it."""
    global _FLASH_CPU
    if _FLASH_CPU is None:
        try:
            _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        except (AttributeError, RuntimeError):
            _FLASH_CPU = False
    return _FLASH_CPU or None


def sdpa_available(device, dtype) -> bool:
    """True when the fused "sdpa" statistics kernel runs for this device and dtype (CPU, float32/64)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.float64)
        and flash_cpu_op() is not None
    )


_DEFAULT_BACKEND = ["auto"]


class kernel_backend:
    """Set the backend that ``backend="auto"`` resolves to, for code that does not pass one
    (``tp.energy``, ``tp.simulate``, ...); use as a context manager or call ``.set()``.

        >>> import transformer_pde as tp
        >>> with tp.kernel_backend("chunked"):
        ...     pass  # every kernel called here with backend="auto" runs "chunked"
    """

    def __init__(self, name: str):
        self.name = check_backend(name)
        self._saved = None

    def set(self) -> "kernel_backend":
        _DEFAULT_BACKEND[0] = self.name
        return self

    def __enter__(self):
        self._saved = _DEFAULT_BACKEND[0]
        _DEFAULT_BACKEND[0] = self.name
        return self

    def __exit__(self, *exc):
        _DEFAULT_BACKEND[0] = self._saved
        return False


def check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def select_backend(backend: str, device, dtype, elements: int) -> str:
    """The backend that ``backend`` resolves to for a problem of ``elements`` = batch·H·n·m scores.

    "auto": "sdpa" on CPU (float32/float64, fused kernel present), "keops" on CUDA when pykeops
    is importable and ``elements >= KEOPS_AUTO_MIN_ELEMENTS``, else "chunked".  An explicit
    "keops" raises ImportError when pykeops is missing; an explicit "sdpa" falls back to
    "chunked" where the fused kernel does not apply.
    """
    check_backend(backend)
    dev = torch.device(device)
    if backend == "auto" and _DEFAULT_BACKEND[0] != "auto":
        backend = _DEFAULT_BACKEND[0]
    if backend == "auto":
        if sdpa_available(dev, dtype):
            return "sdpa"
        if dev.type == "cuda" and elements >= KEOPS_AUTO_MIN_ELEMENTS and keops_available():
            return "keops"
        return "chunked"
    if backend == "keops":
        if not keops_available():
            raise ImportError(
                "backend='keops' needs pykeops, which is not importable here; install it with "
                "`pip install pykeops` (it compiles kernels with a C++/CUDA toolchain), "
                "or use backend='auto' / 'chunked'"
            )
        return "keops"
    if backend == "sdpa" and not sdpa_available(dev, dtype):
        return "chunked"
    return backend



def rows_per_chunk(batch_numel: int, n: int, m: int, chunk_elements: Optional[int]) -> int:
    budget = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    return max(1, min(n, budget // max(1, batch_numel * m)))


def needs_grad(*ts) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def check_chunk(chunk_elements):
    if chunk_elements is None:
        return None
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int (elements of one score block), got {chunk_elements!r}")
    return chunk_elements



def bshape(*shapes) -> tuple:
    """torch.broadcast_shapes for plain tuples, without its overhead (hot path)."""
    r = max(len(s) for s in shapes)
    out = [1] * r
    for s in shapes:
        for i, v in enumerate(s, r - len(s)):
            if v != 1:
                if out[i] != 1 and out[i] != v:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                out[i] = v
    return tuple(out)



def check_causal(causal, keys):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}")
    if causal and keys is not None:
        raise ValueError("causal=True needs queries = keys (token i attends to tokens j <= i of the same "
                         "sequence); call without keys=, or with causal=False")


def causal_log_prefix_mass(weights: Optional[torch.Tensor], n: int, *, dtype=None, device=None) -> torch.Tensor:
    """log W_i, the log total weight of the causal prefix j ≤ i: (..., n) from token weights
    (..., n) (log of their cumulative sum), or (n,) = log((i+1)/n) for uniform weights (None)."""
    if weights is None:
        return torch.log(torch.arange(1, n + 1, dtype=dtype, device=device) / n)
    return torch.log(torch.cumsum(weights, -1))


def causal_block_mask(qidx: torch.Tensor, m: int) -> torch.Tensor:
    """(rows, m) boolean mask, True where key j > query index qidx[r] (masked out)."""
    return torch.arange(m, device=qidx.device).unsqueeze(0) > qidx.unsqueeze(-1)

