"""Ensembles: B independent token systems with random heads, simulated in one batched call.

An ensemble is a batch axis shared by the tokens ``x0`` (B, n, d) and the heads (score and
value (B, H, d, d)); :func:`transformer_pde.simulate` evolves every member independently
(the field, energy and processes broadcast over leading dims), so one call replaces B calls.
Laws of the score matrices A_h (σ = ``scale``, Z with i.i.d. N(0, 1) entries, d × d):

    "gaussian"   A = σ Z / √d                        i.i.d. N(0, σ²/d) entries, not symmetric
                                                     (circular law on the disc of radius σ)
    "goe"        A = σ (Z + Zᵀ) / √(2d)              symmetric; off-diagonal N(0, σ²/d), diagonal
                                                     N(0, 2σ²/d): the Gaussian orthogonal ensemble
                                                     (semicircle on [−2σ, 2σ] as d → ∞)
    "wigner"     A_ij = A_ji = σ ε_ij / √d (i <= j)  symmetric with i.i.d. Rademacher ε_ij = ±1 on and
                                                     above the diagonal: a non-Gaussian Wigner matrix
                                                     (same semicircle limit as "goe")

Value matrices V_h:

    "identity"   V = I                "random"   an independent draw from the same law
    "+A"         V = A (tied; with a symmetric law these are the gradient-flow "symmetric heads")
    "-A"         V = −A (repulsive counterpart)

Each member has its own draw; H heads per member.  The heads' weights are ω_h = 1/H unless given,
β is a float or a (B,) tensor (one temperature per member, e.g. a β sweep inside one ensemble).

    >>> import torch, transformer_pde as tp
    >>> g = torch.Generator().manual_seed(0)
    >>> heads = tp.ensembles.random_heads(8, 2, 3, law="goe", values="+A", generator=g, dtype=torch.float64)
    >>> x0 = tp.sphere.sample_uniform(5, 3, batch_shape=(8,), generator=g, dtype=torch.float64)
    >>> tp.ensembles.simulate(x0, heads, t1=0.5, dt=0.05).x.shape
    torch.Size([11, 8, 5, 3])
"""

from __future__ import annotations

import math
from typing import Union

import torch

from ..utils.validation import check_choice, check_int, check_positive, check_tokens
from ..model.heads import Heads
from ..processes.weights import Process

__all__ = ["LAWS", "VALUES", "random_matrices", "random_heads", "random_tokens", "simulate"]

LAWS = ("gaussian", "goe", "wigner")
VALUES = ("identity", "random", "+A", "-A")


def _batch(batch) -> tuple:
    if isinstance(batch, int) and not isinstance(batch, bool):
        batch = (batch,)
    if not isinstance(batch, (tuple, list, torch.Size)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batch):
        raise ValueError(f"the ensemble size must be an int >= 1 or a tuple of them (batch shape), got {batch!r}")
    return tuple(batch)


def _shape(shape) -> tuple:
    """A sample shape: an int >= 0 or a sequence of them."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in shape):
        raise ValueError(f"shape must be an int >= 0 or a tuple of them, got {shape!r}")
    return tuple(shape)


def _draw_options(generator, dtype):
    """Refuse a generator that is not a torch.Generator and a dtype that is not floating, before drawing."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}; "
                        f"make one with torch.Generator().manual_seed(seed)")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch dtype (torch.float32 or torch.float64), got {dtype!r}")


def random_matrices(shape, d: int, *, law: str = "goe", scale: float = 1.0, generator=None, dtype=None,
                    device=None) -> torch.Tensor:
    """Random d × d matrices of the given law (module docstring), shape (*shape, d, d).

    Raises
    ------
    ValueError, TypeError
        unknown law, d < 2, scale < 0, bad shape, a generator that is not a
        torch.Generator, a dtype that is not floating."""
    check_choice(law, LAWS, "law")
    d = check_int(d, "d", minimum=2)
    scale = check_positive(scale, "scale", allow_zero=True)
    shape = _shape(shape)
    _draw_options(generator, dtype)
    f = dict(dtype=dtype or torch.get_default_dtype(), device=device)
    if law == "gaussian":
        return (scale / math.sqrt(d)) * torch.randn(*shape, d, d, generator=generator, **f)
    if law == "goe":
        Z = torch.randn(*shape, d, d, generator=generator, **f)
        return (scale / math.sqrt(2 * d)) * (Z + Z.transpose(-1, -2))
    signs = torch.randint(0, 2, (*shape, d, d), generator=generator, device=device).to(f["dtype"]) * 2 - 1
    upper = torch.triu(signs)
    return (scale / math.sqrt(d)) * (upper + torch.triu(signs, 1).transpose(-1, -2))


def random_heads(batch, num_heads: int, dim: int, *, law: str = "goe", values: str = "+A", scale: float = 1.0,
                 beta: Union[float, torch.Tensor] = 1.0, weights=None, generator=None, dtype=None,
                 device=None) -> Heads:
    """Heads of an ensemble: score (*batch, H, d, d) drawn from ``law``, values by ``values``.

    Parameters
    ----------
    batch
        B (int) or a batch shape.  num_heads: H.  dim: d.
    law : str
        "gaussian" | "goe" | "wigner" (module docstring).  values: "identity" | "random" | "+A" | "-A".
    scale : float
        σ >= 0.  beta: float or tensor broadcasting against the batch shape.
    weights
        ω (..., H) or None (1/H).  generator, dtype, device: of the draws.

    Returns
    -------
    Heads
        :class:`~transformer_pde.Heads` with batch shape ``batch``; symmetric (gradient-flow) heads
        when law is "goe"/"wigner" and values "+A".

    Raises
    ------
    ValueError, TypeError
        for bad arguments (before drawing).
    """
    batch = _batch(batch)
    check_choice(values, VALUES, "values")
    H = check_int(num_heads, "num_heads")
    _draw_options(generator, dtype)
    A = random_matrices(batch + (H,), dim, law=law, scale=scale, generator=generator, dtype=dtype, device=device)
    if values == "+A":
        h = Heads(A, None, weights, beta)
        return h if law == "gaussian" else h.assume_symmetric()
    if values == "-A":
        V = -A
    elif values == "identity":
        V = torch.eye(dim, dtype=A.dtype, device=A.device).expand_as(A).clone()
    else:
        V = random_matrices(batch + (H,), dim, law=law, scale=scale, generator=generator, dtype=A.dtype,
                            device=A.device)
    return Heads(A, V, weights, beta)


def random_tokens(batch, n: int, d: int, *, generator=None, dtype=None, device=None) -> torch.Tensor:
    """x0 (*batch, n, d): i.i.d. uniform tokens on S^{d-1} for every member."""
    from ..model.sphere import sample_uniform

    _draw_options(generator, dtype)
    return sample_uniform(n, d, batch_shape=_batch(batch), generator=generator, dtype=dtype, device=device)


def simulate(x0: torch.Tensor, theta: Union[Heads, Process], **kwargs):
    """Simulate an ensemble of B independent systems in one call: ``tp.simulate`` with checks that
    the tokens (B, n, d) and the heads (B, H, d, d) (batch shape (B,), or empty: shared heads)
    describe the same ensemble.  Every keyword of :func:`transformer_pde.simulate` is accepted
    (``paths=`` adds Monte-Carlo paths in front: (paths, B, ...)).

    Member b of the result equals ``tp.simulate(x0[b], heads_b, ...)`` for deterministic heads (and
    for noisy heads up to the random stream, which is drawn for the whole batch at once).  Noisy
    processes draw their noise with the shape of the score tensor: shared heads (empty batch shape)
    under OU noise give every member the *same* weight path; draw heads with batch shape (B,) (e.g.
    :func:`random_heads` or ``A.expand(B, H, d, d).clone()``) for independent paths.

    Returns
    -------
    Trajectory
        :class:`~transformer_pde.Trajectory` with x (T, [paths,] B, n, d).

    Raises
    ------
    ValueError
        x0 is not (..., n, d) with a batch axis, or the heads' batch shape is neither
        empty nor x0's batch shape; whatever ``tp.simulate`` raises.
    """
    from ..solvers.particle.front import simulate as _simulate_one

    check_tokens(x0, "x0")
    if x0.dim() < 3:
        raise ValueError(f"x0 must be (B, n, d) for an ensemble, got shape {tuple(x0.shape)}; "
                         f"use tp.simulate for one system")
    heads = theta if isinstance(theta, Heads) else getattr(theta, "heads0", None)
    if heads is not None:
        bh, bx = tuple(heads.batch_shape), tuple(x0.shape[:-2])
        if bh and bh != bx:
            raise ValueError(f"the heads' batch shape {bh} must be empty (shared heads) or equal to x0's batch "
                             f"shape {bx}; draw them with tp.ensembles.random_heads({bx[0] if len(bx) == 1 else bx}, H, d)")
    return _simulate_one(x0, theta, **kwargs)
