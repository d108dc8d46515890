"""Random layers: value matrices drawn afresh at every layer and head, with the depth scaling of the homogenized
limit (docs/homogenized.md).

Layer l (on [t0 + lΔ, t0 + (l+1)Δ), Δ = ``layer_time`` = T/L) holds the heads

    A_h (fixed),   V_{l,h} = V̄_h + σ_h Z_{l,h} / √Δ,   Z_{l,h} i.i.d. d×d with i.i.d. N(0, 1) entries,

independent over layers, heads and the batch (paths) axes.  One explicit Euler step of length Δ of the attention
flow with these heads is the residual layer x ← retract(x + Δ·P_x Σ_h ω_h V̄_h ȳ_h + √Δ·P_x Σ_h ω_h σ_h Z_{l,h} ȳ_h):
the mean values act at order Δ = 1/L, the random part at order √Δ = 1/√L (the diffusion scaling).  As L → ∞ the
tokens converge in law to the Itô SDE with a noise common to all tokens of
:func:`transformer_pde.analysis.theory.homogenized.homogenized_sde`.

The process is deterministic given its seed (``closed_form``): layer l's draws come from a generator seeded by
(seed, l), so Θ_t can be evaluated at any t, in any order, by every solver (``tp.solve`` / ``tp.simulate``), and
only one layer is held in memory.  Θ is piecewise constant (``piecewise_constant``), with knots at the layer
starts; a Runge–Kutta stage inside a layer sees that layer (the left limit at its end).
"""

from __future__ import annotations

import copy
import math
from typing import List

import torch

from ..model.heads import Heads
from ..utils.validation import check_int, check_positive, check_real, check_seed
from .weights import Process

__all__ = ["RandomLayers"]
__internal__ = ["check_head_sigmas"]

_MIX = 0x9E3779B97F4A7C15  # the golden-ratio constant: layer seeds far apart for nearby (seed, l)


def _layer_seed(seed: int, layer: int) -> int:
    return (seed * _MIX + layer * 0xBF58476D1CE4E5B9 + 1) % (2 ** 63)


def check_head_sigmas(sigma: torch.Tensor, num_heads: int) -> None:
    """Refuse a per-head σ tensor that is not (H,), finite and ≥ 0.

    Parameters
    ----------
    sigma : torch.Tensor
        σ_h, one per head.
    num_heads : int
        H.

    Raises
    ------
    ValueError
        another shape, a non-finite or a negative entry.
    """
    if sigma.shape != (num_heads,):
        raise ValueError(f"sigma must be a float or a tensor (H,) = ({num_heads},) per head, got shape "
                         f"{tuple(sigma.shape)}")
    if not bool(torch.isfinite(sigma).all()) or bool((sigma < 0).any()):
        raise ValueError("sigma must be finite and >= 0 for every head")


class RandomLayers(Process):
    """Heads whose value matrices are drawn afresh, independently, at every layer and head (and path).

    Parameters
    ----------
    heads0 : Heads
        the mean heads (A_h, V̄_h, ω_h, β): scores, mean values, head weights and β, kept at every layer.  Tied
        heads (V = A) have mean values A_h; pass ``value=torch.zeros_like(A)`` for centred values (the Gaussian
        setting, no mean drift).
    sigma : float or torch.Tensor
        σ ≥ 0, the standard deviation of the value entries times √Δ: a float, or a tensor (H,) per head.
    layer_time : float
        Δ > 0, the time one layer lasts (T/L for L layers on [0, T]); the random part of the values is σ/√Δ.
    batch_shape : tuple of int
        independent draws per batch member, e.g. ``(P,)`` for P paths of tokens (P, n, d) (the heads' batch axes
        broadcast against the tokens'); ``()``: one draw per layer shared by the whole batch.
    seed : int
        the random stream: layer l is drawn from a generator seeded by (seed, l).
    t0 : float
        the start of layer 0.

    Raises
    ------
    TypeError
        heads0 not a Heads; a seed, batch shape or σ of the wrong type.
    ValueError
        σ < 0 or not of shape (H,); Δ ≤ 0; a negative batch size; heads with a β rule given as a batch.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> A = torch.eye(3, dtype=torch.float64)[None]
    >>> p = tp.RandomLayers(tp.Heads(A, torch.zeros_like(A)), 1.0, layer_time=0.1, batch_shape=(4,), seed=0)
    >>> p.heads_at(0.25).value_matrix.shape
    torch.Size([4, 1, 3, 3])
    """

    def __init__(self, heads0, sigma=1.0, *, layer_time: float, batch_shape=(), seed: int = 0, t0: float = 0.0):
        if not isinstance(heads0, Heads):
            raise TypeError(f"heads0 must be a transformer_pde.Heads (the mean heads A_h, V̄_h, ω_h, β), got "
                            f"{type(heads0).__name__}")
        self.heads0 = heads0
        A = heads0.score_matrix
        H = heads0.num_heads
        if isinstance(sigma, torch.Tensor) and sigma.numel() != 1:
            check_head_sigmas(sigma, H)
            self.sigma_value = sigma.detach().to(dtype=A.dtype, device=A.device)
        else:
            self.sigma_value = check_positive(sigma, "sigma", allow_zero=True)
        self.layer_time = check_positive(layer_time, "layer_time")
        if isinstance(batch_shape, int) or not isinstance(batch_shape, (tuple, list, torch.Size)):
            raise TypeError(f"batch_shape must be a tuple of ints, e.g. (paths,), got {batch_shape!r}")
        self.batch_shape = tuple(check_int(b, "batch_shape entry", minimum=1) for b in batch_shape)
        self.seed = check_seed(seed)
        self.t0 = check_real(t0, "t0")
        self.scheme = "exact"
        self._cache = None

    # ----------------------------------------------------------------------------- what the solvers ask
    @property
    def closed_form(self) -> bool:
        return True

    piecewise_constant = True

    @property
    def time_dependent_values(self) -> bool:
        return True

    def _value_scale(self, t=None):
        s = self.sigma_value
        return s[:, None, None] if isinstance(s, torch.Tensor) else s

    def noise_std(self) -> torch.Tensor:
        """σ_h / √Δ, (H,): the standard deviation of the entries of V_{l,h} − V̄_h."""
        A = self.heads0.score_matrix
        s = torch.as_tensor(self.sigma_value, dtype=A.dtype, device=A.device)
        return s.expand(self.heads0.num_heads) / math.sqrt(self.layer_time)

    def layer_index(self, t: float, left: bool = False) -> int:
        """The layer l that holds at t (``left``: the layer that ends at a layer start t)."""
        u = (t - self.t0) / self.layer_time
        l = int(math.ceil(u - 1e-9)) - 1 if left else int(math.floor(u + 1e-9))
        return max(l, 0)

    def layer(self, l: int) -> Heads:
        """The heads of layer l: A_h, V̄_h + σ_h Z_{l,h}/√Δ, ω_h, β (Z drawn from the stream (seed, l))."""
        l = check_int(l, "layer", minimum=0)
        if self._cache is not None and self._cache[0] == l:
            return self._cache[1]
        h0 = self.heads0
        A = h0.score_matrix
        gen = torch.Generator(device=A.device)
        gen.manual_seed(_layer_seed(self.seed, l))
        Z = torch.randn(self.batch_shape + (h0.num_heads, h0.dim, h0.dim), generator=gen, dtype=A.dtype,
                        device=A.device)
        V = h0.value_matrix + self._value_scale() * Z / math.sqrt(self.layer_time)
        heads = Heads(A, V, h0.weights, h0.beta)
        self._cache = (l, heads)
        return heads

    def heads_at(self, t: float) -> Heads:
        return self.layer(self.layer_index(t))

    def left_heads_at(self, t: float) -> Heads:
        return self.layer(self.layer_index(t, left=True))

    def score_rate(self, t: float) -> torch.Tensor:
        return torch.zeros_like(self.heads0.score_matrix)

    def left_score_rate(self, t: float) -> torch.Tensor:
        return self.score_rate(t)

    def drift(self, score, t):
        return torch.zeros_like(score)

    def knots(self, t0: float, t1: float) -> List[float]:
        """The layer starts in (t0, t1]: Θ jumps there."""
        first = max(1, math.floor((t0 - self.t0) / self.layer_time + 1e-9) + 1)
        out, l = [], first
        while self.t0 + l * self.layer_time <= t1 + 1e-12:
            tj = self.t0 + l * self.layer_time
            if tj > t0:
                out.append(tj)
            l += 1
        return out

    def jumps(self, t0: float, t1: float) -> List[float]:
        return self.knots(t0, t1)

    def at_context(self, n: int) -> "RandomLayers":
        """The process with a β rule of its heads resolved at n tokens (the cached layer is dropped)."""
        if self.resolved:
            return self
        new = copy.copy(self)
        new.heads0 = self.heads0.at_context(n)
        new._cache = None
        return new

    def __repr__(self):
        return (f"RandomLayers(H={self.heads0.num_heads}, d={self.heads0.dim}, sigma={self.sigma_value}, "
                f"layer_time={self.layer_time:g}, batch_shape={self.batch_shape}, seed={self.seed})")
