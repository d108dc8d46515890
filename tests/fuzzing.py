"""Helpers shared by the property tests (tests/test_properties.py, tests/test_fuzz.py)."""

import signal
from contextlib import contextmanager

import torch

import transformer_pde as tp


@contextmanager
def time_limit(seconds):
    def handler(signum, frame):
        raise TimeoutError(f"hang: the call ran for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _tensors(obj, depth=0):
    """Every tensor inside a result (tensors, tuples, dicts, dataclass-like objects)."""
    if depth > 3 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, tp.Heads, tp.Process)):
        for k, o in vars(obj).items():
            if k not in ("path", "extras"):
                yield from _tensors(o, depth + 1)
