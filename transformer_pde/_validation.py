"""Input checks shared by the public entry points.

Every check raises ``TypeError`` (wrong kind of object, dtype, device) or
``ValueError`` (wrong shape or value) with a message that says what was wrong and
how to fix it.  Checks run once, at the entry point, before any work is done; the
hot loops call the private kernels directly.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

NORMALIZATIONS = ("softmax", "unnormalized", "relu", "effective")
DIRECTIONS = ("ascent", "descent")


def sphere_tolerance(dtype: torch.dtype) -> float:
    """How far from |x| = 1 a token may be: 1e-6 in float64, ~1e-4 in float32."""
    return max(1e-6, 1e3 * torch.finfo(dtype).eps)


def check_choice(value, allowed: Iterable[str], name: str) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, allowed))}")
    return value


def direction_sign(direction: str) -> float:
    """``+1`` for "ascent" (x + attention(x)), ``-1`` for "descent" (the reference code)."""
    check_choice(direction, DIRECTIONS, "direction")
    return 1.0 if direction == "ascent" else -1.0


def check_tensor(x, name: str, *, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(x).__name__}; wrap it with torch.as_tensor(...)"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float32 or float64), got {x.dtype}; "
            f"convert it with {name}.double() or {name}.float()"
        )
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf values; remove or replace them before calling")
    return x


def check_same(reference: torch.Tensor, other: torch.Tensor, ref_name: str, name: str) -> None:
    """Refuse mixed devices or dtypes, with a hint (as geomloss does)."""
    if other.device != reference.device:
        raise ValueError(
            f"{name} is on {other.device} but {ref_name} is on {reference.device}; "
            f"move them to one device with .to({ref_name}.device)"
        )
    if other.dtype != reference.dtype:
        raise TypeError(
            f"{name} has dtype {other.dtype} but {ref_name} has dtype {reference.dtype}; "
            f"convert with .to({ref_name}.dtype)"
        )


def check_tokens(x, name: str = "x") -> torch.Tensor:
    """x: (..., n, d) unit vectors, d >= 2, n >= 1."""
    check_tensor(x, name, min_dim=2)
    n, d = x.shape[-2], x.shape[-1]
    if d < 2:
        raise ValueError(f"{name} must have shape (..., n, d) with d >= 2, got shape {tuple(x.shape)}")
    if n < 1:
        raise ValueError(f"{name} holds no tokens (n = 0): shape {tuple(x.shape)}")
    err = (x.norm(dim=-1) - 1).abs().max().item()
    tol = sphere_tolerance(x.dtype)
    if err > tol:
        raise ValueError(
            f"{name} is not on the unit sphere: max | |x|-1 | = {err:.1e} > {tol:.0e}; "
            f"normalise with x / x.norm(dim=-1, keepdim=True)"
        )
    return x


def check_token_weights(w, x: torch.Tensor, name: str = "weights", x_name: str = "x"):
    """w: (..., n) non-negative, summing to 1, or None (uniform)."""
    if w is None:
        return None
    check_tensor(w, name, min_dim=1)
    check_same(x, w, x_name, name)
    n = x.shape[-2]
    if w.shape[-1] != n:
        raise ValueError(
            f"{name} must have shape (..., n) with n = {n} tokens, got shape {tuple(w.shape)}"
        )
    try:
        torch.broadcast_shapes(w.shape[:-1], x.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch shape of {name} {tuple(w.shape[:-1])} does not broadcast against "
            f"the batch shape of {x_name} {tuple(x.shape[:-2])}"
        ) from None
    if bool((w < 0).any()):
        raise ValueError(f"{name} has negative entries (min {w.min().item():.3g}); token weights must be >= 0")
    err = (w.sum(-1) - 1).abs().max().item()
    tol = max(1e-6, 1e3 * torch.finfo(w.dtype).eps)
    if err > tol:
        raise ValueError(
            f"{name} must sum to 1 over the tokens (max |sum - 1| = {err:.1e}); "
            f"normalise with {name} / {name}.sum(-1, keepdim=True)"
        )
    return w


def check_positive(value, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def check_int(value, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
