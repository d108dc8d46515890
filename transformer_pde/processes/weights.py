"""Time-dependent heads Θ_t: processes for the per-head score matrices (docs/model.md#processes).

Every process starts from given heads ``heads0`` and moves their score matrices A_h(t)
(values stay tied to the scores when they were, head weights and β stay fixed; use
:class:`Layerwise` for heads whose values or weights change too).  Shapes follow
``heads0``: (..., H, d, d); Monte-Carlo paths add a leading axis.

Two ways of producing Θ_t, chosen with ``scheme``:

* ``"exact"``: deterministic processes are evaluated in closed form at any time (the
  solvers' Runge–Kutta stages see the weights at their own stage times); stochastic ones
  are sampled on the solver grid by their exact Gaussian transition.
* ``"euler"``: the weights are stepped by Euler / Euler–Maruyama on the solver grid, as
  the reference code does, so that runs can be matched step for step.

On a grid-sampled path the Runge–Kutta stages see the linear interpolation between the
two grid values that bracket the stage time (a consistent, non-anticipating choice for
the token ODE: the weights of the step are fixed before the tokens move).

Symmetric noise: dW_sym = ½(dB + dBᵀ) with B a d×d Brownian matrix, so diagonal entries
have variance dt and off-diagonal ones dt/2; it keeps symmetric matrices symmetric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..utils.validation import (
    broadcast_shapes, check_choice, check_horizon, check_int, check_limits, check_positive, check_real, check_same,
    check_seed_generator, check_tensor,
)
from ..model.heads import Heads

#: named internal API (not public), used by the solvers' resource guards
__internal__ = ["path_bytes", "grid_steps", "lift_paths"]

__all__ = ["Process", "Constant", "OrnsteinUhlenbeck", "Oscillating", "Layerwise", "Custom", "WeightPath", "sample_path",
           "symmetric_noise", "oscillating_target", "WeightDriver"]

SCHEMES = ("exact", "euler")


def symmetric_noise(shape, *, generator=None, dtype=None, device=None) -> torch.Tensor:
    """One draw of W_sym(1) = ½(Z + Zᵀ), Z i.i.d. N(0, 1) of shape (..., d, d)."""
    Z = torch.randn(shape, generator=generator, dtype=dtype, device=device)
    return 0.5 * (Z + Z.transpose(-1, -2))


def _scalar_param(value, name: str, like: torch.Tensor, *, allow_zero: bool = False):
    """A scalar process parameter (κ, σ): a float, or a one-element tensor that requires grad,
    kept as a 0-dim tensor so that :func:`simulate` can differentiate with respect to it.
    Anything else (ints, floats, tensors without grad) becomes a float as before."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got a tensor of shape {tuple(value.shape)}")
        check_tensor(value, name)
        check_same(like, value, "heads0", name)
        check_positive(value.detach(), name, allow_zero=allow_zero)
        return value.reshape(())
    return check_positive(value, name, allow_zero=allow_zero)


def _exp(v):
    return torch.exp(v) if isinstance(v, torch.Tensor) else math.exp(v)


def _expm1(v):
    return torch.expm1(v) if isinstance(v, torch.Tensor) else math.expm1(v)


def _sqrt(v):
    return torch.sqrt(v) if isinstance(v, torch.Tensor) else math.sqrt(v)


def _as_heads(heads0) -> Heads:
    if isinstance(heads0, Heads):
        return heads0
    if isinstance(heads0, torch.Tensor):
        return Heads(heads0)
    raise TypeError(f"heads0 must be a transformer_pde.Heads or a score tensor (..., H, d, d), got {type(heads0).__name__}")


class Process:
    """Base class of weight processes dA_h = drift(t, A) dt + σ dW_sym.

    Subclasses set ``heads0``, ``scheme`` and implement :meth:`drift` and :meth:`sigma`;
    closed-form deterministic ones also implement :meth:`heads_at` and :meth:`score_rate`.
    """

    heads0: Heads
    scheme: str = "exact"

    # -- what the solvers ask
    @property
    def noisy(self) -> bool:
        """True when σ > 0 (a stochastic path, sampled on the solver grid)."""
        return False

    @property
    def closed_form(self) -> bool:
        """True when Θ_t can be evaluated at any t (deterministic, scheme="exact")."""
        return False

    def drift(self, score: torch.Tensor, t: float) -> torch.Tensor:
        raise NotImplementedError

    def sigma(self, t: float):
        """Noise amplitude σ_h: float, or tensor broadcasting against (..., H)."""
        return 0.0

    def heads_at(self, t: float) -> Heads:
        raise TypeError(f"{type(self).__name__} with scheme={self.scheme!r} has no closed form; sample it on a grid")

    def score_rate(self, t: float) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} with scheme={self.scheme!r} has no closed form")

    def jumps(self, t0: float, t1: float) -> List[float]:
        """Times in (t0, t1] where Θ_t jumps (piecewise-constant layer weights)."""
        return []

    def knots(self, t0: float, t1: float) -> List[float]:
        """Times in (t0, t1] where Θ_t or its rate is discontinuous (the jumps and the kinks)."""
        return self.jumps(t0, t1)

    def left_heads_at(self, t: float) -> Heads:
        """The left limit Θ(t−); Θ(t) where Θ is continuous."""
        return self.heads_at(t)

    def left_score_rate(self, t: float) -> torch.Tensor:
        """The left limit of dA/dt at t; dA/dt where it is continuous."""
        return self.score_rate(t)

    def step(self, score: torch.Tensor, t: float, dt: float, generator=None):
        """One grid step: (A(t + dt), noise) where noise = A(t+dt) − A(t) − drift(A(t), t)·dt
        is the martingale part of the increment (None for a noiseless step)."""
        f = self.drift(score, t)
        if self.scheme == "euler" or not self.noisy:
            nxt = score + dt * f
            if not self.noisy:
                return nxt, None
            noise = self._sigma_mat(t) * math.sqrt(dt) * symmetric_noise(
                score.shape, generator=generator, dtype=score.dtype, device=score.device)
            return nxt + noise, noise
        nxt = self._exact_step(score, t, dt, generator)
        return nxt, nxt - score - dt * f

    def _exact_step(self, score, t, dt, generator):  # pragma: no cover - overridden
        raise TypeError(f"{type(self).__name__} has no exact transition; use scheme='euler'")

    def _sigma_mat(self, t):
        s = self.sigma(t)
        if isinstance(s, torch.Tensor):
            return s[..., None, None]
        return s

    def __repr__(self):
        return f"{type(self).__name__}(H={self.heads0.num_heads}, d={self.heads0.dim}, scheme={self.scheme!r})"


def _check_scheme(scheme):
    return check_choice(scheme, SCHEMES, "scheme")


class Constant(Process):
    """Θ_t = heads0 for all t."""

    def __init__(self, heads0):
        self.heads0 = _as_heads(heads0)
        self.scheme = "exact"

    @property
    def closed_form(self):
        return True

    def drift(self, score, t):
        return torch.zeros_like(score)

    def heads_at(self, t):
        return self.heads0

    def score_rate(self, t):
        return torch.zeros_like(self.heads0.score_matrix)


class _Diffusive(Process):
    """A process with a noise amplitude ``sigma_value``: noisy when it is > 0, closed-form otherwise
    (with scheme="exact")."""

    @property
    def noisy(self):
        return bool(self.sigma_value > 0)

    @property
    def closed_form(self):
        return not self.noisy and self.scheme == "exact"


class OrnsteinUhlenbeck(_Diffusive):
    """dA_h = κ (Ā − A_h) dt + σ dW_sym, independently per head (and per path).

    Exact transition (scheme="exact"):  A(t+h) = Ā + e^{−κh}(A(t) − Ā) + σ √((1 − e^{−2κh})/(2κ)) W_sym,
    so the stationary law is Gaussian with mean Ā, Var(A_ii) = σ²/(2κ), Var(A_ij) = σ²/(4κ)
    (i ≠ j), a GOE-type ensemble.  scheme="euler" is Euler–Maruyama (the reference code).
    Paper: Ā = I, κ = 1, σ² = 2.

    Parameters
    ----------
    heads0
        Heads (or score tensor) at t = 0.
    mean
        Ā, (d, d) or (..., H, d, d); default I.
    rate
        κ > 0.   sigma: σ >= 0.   scheme: "exact" | "euler".
        A one-element tensor that requires grad is kept as a tensor (differentiable
        simulations); other values are stored as floats.
    """

    def __init__(self, heads0, mean=None, rate: float = 1.0, sigma: float = 2 ** 0.5, scheme: str = "exact"):
        self.heads0 = _as_heads(heads0)
        A0 = self.heads0.score_matrix
        self.rate = _scalar_param(rate, "rate (kappa)", A0)
        self.sigma_value = _scalar_param(sigma, "sigma", A0, allow_zero=True)
        self.scheme = _check_scheme(scheme)
        d = self.heads0.dim
        if mean is None:
            mean = torch.eye(d, dtype=A0.dtype, device=A0.device)
        else:
            check_tensor(mean, "mean", min_dim=2)
            check_same(A0, mean, "heads0", "mean")
            if mean.shape[-2:] != (d, d):
                raise ValueError(f"mean must have shape (d, d) or (..., H, d, d) with d = {d}, got {tuple(mean.shape)}")
            try:
                broadcast_shapes(mean.shape, A0.shape)
            except RuntimeError:
                raise ValueError(f"mean of shape {tuple(mean.shape)} does not broadcast against the scores {tuple(A0.shape)}") from None
        self.mean = mean

    def drift(self, score, t):
        return self.rate * (self.mean - score)

    def sigma(self, t):
        return self.sigma_value

    def _exact_step(self, score, t, dt, generator):
        e = _exp(-self.rate * dt)
        sd = self.sigma_value * _sqrt(-_expm1(-2 * self.rate * dt) / (2 * self.rate))
        noise = symmetric_noise(score.shape, generator=generator, dtype=score.dtype, device=score.device)
        return self.mean + e * (score - self.mean) + sd * noise

    def heads_at(self, t):
        if not self.closed_form:
            return super().heads_at(t)
        A = self.mean + _exp(-self.rate * t) * (self.heads0.score_matrix - self.mean)
        return self.heads0.with_score(A, symmetric=self.heads0.known_symmetric)

    def score_rate(self, t):
        return self.drift(self.heads_at(t).score_matrix, t)

    def moments(self, t: float):
        """Closed-form mean (..., H, d, d) and entrywise variance (d, d) of A(t) for the exact law."""
        A0 = self.heads0.score_matrix
        mean = self.mean + _exp(-self.rate * t) * (A0 - self.mean)
        v = self.sigma_value ** 2 * (-_expm1(-2 * self.rate * t)) / (2 * self.rate)
        v = float(v.detach()) if isinstance(v, torch.Tensor) else v
        d = self.heads0.dim
        var = torch.full((d, d), v / 2, dtype=A0.dtype, device=A0.device)
        var.diagonal().fill_(v)
        return mean, var


def _oscillating_terms(d: int):
    """F(t) = 2 I + Σ_k M_k cos(ω_k t + φ_k); returns (omegas, phases, mats (K, d, d))."""
    E = lambda i, j: torch.zeros(d, d, dtype=torch.float64).index_put_((torch.tensor([i]), torch.tensor([j])), torch.tensor(1.0, dtype=torch.float64))  # noqa: E731
    S = lambda i, j: E(i, j) + E(j, i)  # noqa: E731
    half = -math.pi / 2  # sin θ = cos(θ − π/2)
    if d == 2:
        terms = [(1.0, 0.0, 1.5 * (E(0, 0) - E(1, 1))), (2.0, half, S(0, 1))]
    elif d == 3:
        terms = [(1.0, 0.0, 1.5 * E(0, 0)), (2.0, half, S(0, 1)), (1.0, half, S(0, 2)),
                 (1.0, half, 1.5 * E(1, 1)), (2.0, 0.0, S(1, 2)), (1.0, math.pi / 4, 1.5 * E(2, 2))]
    else:
        terms = [(1.0, 2 * math.pi * i / d, 1.5 * E(i, i)) for i in range(d)]
        P = d * (d - 1) // 2
        pairs = [(i, j) for i in range(d) for j in range(i + 1, d)]
        terms += [(2.0, 2 * math.pi * p / P + half, S(i, j)) for p, (i, j) in enumerate(pairs)]
    om = torch.tensor([t[0] for t in terms], dtype=torch.float64)
    ph = torch.tensor([t[1] for t in terms], dtype=torch.float64)
    mats = torch.stack([t[2] for t in terms])
    return om, ph, mats


def oscillating_target(t: float, d: int, num_heads: int = 1, phase: str = "shared", *, dtype=torch.float64, device=None):
    """The reference target F(t), (H, d, d) (docs/model.md#processes); per_head shifts head h to t + 2πh/H."""
    om, ph, mats = _oscillating_terms(d)
    shift = _phase_shift(num_heads, phase)
    ang = om * (t + shift[:, None]) + ph  # (H, K)
    F = 2 * torch.eye(d, dtype=torch.float64) + torch.einsum("hk,kij->hij", torch.cos(ang), mats)
    return F.to(dtype=dtype, device=device)


def _phase_shift(H, phase):
    if phase == "shared":
        return torch.zeros(H, dtype=torch.float64)
    return 2 * math.pi * torch.arange(H, dtype=torch.float64) / H


class Oscillating(_Diffusive):
    """dA_h = (F_h(t) − A_h) dt + σ dW_sym with the reference target F(t) (docs/model.md#processes).

    ``phase="shared"`` (default): one F(t) for all heads — what produced the paper's
    figures (a bug in the original script).  ``phase="per_head"``: head h sees F(t + 2πh/H),
    as the later reference code does; this removes the paper's "no decay" result.

    Closed form (σ = 0, scheme="exact"): with F = 2I + Σ_k M_k cos(ω_k t + φ_k),
    A(t) = A_p(t) + e^{−t}(A(0) − A_p(0)), A_p(t) = 2I + Σ_k M_k (cos θ_k + ω_k sin θ_k)/(1 + ω_k²).
    With σ > 0 the exact transition is A(t+h) = A_p(t+h) + e^{−h}(A(t) − A_p(t)) + σ√((1−e^{−2h})/2) W_sym.
    """

    def __init__(self, heads0, phase: str = "shared", sigma: float = 0.0, scheme: str = "exact"):
        self.heads0 = _as_heads(heads0)
        self.phase = check_choice(phase, ("shared", "per_head"), "phase")
        A0 = self.heads0.score_matrix
        self.sigma_value = _scalar_param(sigma, "sigma", A0, allow_zero=True)
        self.scheme = _check_scheme(scheme)
        H, d = self.heads0.num_heads, self.heads0.dim
        om, ph, mats = _oscillating_terms(d)
        f = dict(dtype=A0.dtype, device=A0.device)
        self._om = om.to(**f)
        self._ph = ph.to(**f)
        self._mats = mats.to(**f)
        self._shift = _phase_shift(H, self.phase).to(**f)
        self._eye2 = 2 * torch.eye(d, **f)

    def _angles(self, t):
        return self._om * (t + self._shift[:, None]) + self._ph  # (H, K)

    def target(self, t: float) -> torch.Tensor:
        """F_h(t), (H, d, d)."""
        return self._eye2 + torch.einsum("hk,kij->hij", torch.cos(self._angles(t)), self._mats)

    def _particular(self, t):
        a = self._angles(t)
        c = (torch.cos(a) + self._om * torch.sin(a)) / (1 + self._om ** 2)
        return self._eye2 + torch.einsum("hk,kij->hij", c, self._mats)

    def drift(self, score, t):
        return self.target(t) - score

    def sigma(self, t):
        return self.sigma_value

    def heads_at(self, t):
        if not self.closed_form:
            return super().heads_at(t)
        A0 = self.heads0.score_matrix
        A = self._particular(t) + math.exp(-t) * (A0 - self._particular(0.0))
        return self.heads0.with_score(A, symmetric=self.heads0.known_symmetric)

    def score_rate(self, t):
        return self.drift(self.heads_at(t).score_matrix, t)

    def _exact_step(self, score, t, dt, generator):
        e = math.exp(-dt)
        sd = self.sigma_value * math.sqrt(-math.expm1(-2 * dt) / 2)
        noise = symmetric_noise(score.shape, generator=generator, dtype=score.dtype, device=score.device)
        return self._particular(t + dt) + e * (score - self._particular(t)) + sd * noise


class Layerwise(Process):
    """Heads read from a network, one set per layer: layer l holds on [t0 + l·Δ, t0 + (l+1)·Δ).

    Parameters
    ----------
    layers
        sequence of Heads (same H, d, dtype, device) — or a tensor (L, ..., H, d, d) of scores.
    layer_time
        Δ > 0, the time one layer lasts (default 1: time = depth).
    interpolation
        "constant" (piecewise constant; Θ jumps at the layer boundaries and the
        energy ledger books each jump) or "linear" (scores, values, head weights and β
        interpolated linearly between the layer starts t0 + l·Δ, constant after the last).
    """

    def __init__(self, layers, interpolation: str = "constant", layer_time: float = 1.0, t0: float = 0.0):
        if isinstance(layers, torch.Tensor):
            layers = [Heads(a) for a in layers]
        layers = list(layers)
        if not layers:
            raise ValueError("Layerwise needs at least one layer of heads")
        for i, h in enumerate(layers):
            if not isinstance(h, Heads):
                raise TypeError(f"layer {i} is a {type(h).__name__}, not a transformer_pde.Heads")
            if (h.num_heads, h.dim, h.dtype, h.device) != (layers[0].num_heads, layers[0].dim, layers[0].dtype, layers[0].device):
                raise ValueError(
                    f"layer {i} has (H, d, dtype, device) = {(h.num_heads, h.dim, h.dtype, h.device)}, "
                    f"layer 0 has {(layers[0].num_heads, layers[0].dim, layers[0].dtype, layers[0].device)}; all layers must agree"
                )
        self.layers = layers
        self.heads0 = layers[0]
        self.interpolation = check_choice(interpolation, ("constant", "linear"), "interpolation")
        self.layer_time = check_positive(layer_time, "layer_time")
        self.t0 = check_real(t0, "t0")
        self.scheme = "exact"

    @property
    def closed_form(self):
        return True

    def _locate(self, t, left: bool = False):
        """(layer l, fraction of it) at t; ``left``: of the layer that ends at a boundary t."""
        u = (t - self.t0) / self.layer_time
        l = int(math.ceil(u - 1e-12)) - 1 if left else int(math.floor(u + 1e-12))
        l = min(max(l, 0), len(self.layers) - 1)
        return l, u - l

    def left_heads_at(self, t):
        """The left limit Θ(t−): at a layer boundary the layer that ends there.  The solvers'
        Runge–Kutta stages inside (t_k, t_{k+1}] use it, so a step that ends on a boundary
        integrates one smooth piece and keeps its order."""
        if self.interpolation == "constant":
            return self.layers[self._locate(t, left=True)[0]]
        return self.heads_at(t)

    def heads_at(self, t):
        l, frac = self._locate(t)
        if self.interpolation == "constant" or l == len(self.layers) - 1 or frac <= 0:
            return self.layers[l]
        a, b = self.layers[l], self.layers[l + 1]
        lerp = lambda p, q: None if p is None else p + frac * (q - p)  # noqa: E731
        A = lerp(a.score_matrix, b.score_matrix)
        V = None if (a.tied and b.tied) else lerp(a.value_matrix, b.value_matrix)
        beta = a.beta if isinstance(a.beta, float) and isinstance(b.beta, float) and a.beta == b.beta else lerp(a.beta_tensor(), b.beta_tensor())
        return Heads(A, V, lerp(a.weights, b.weights), beta)

    def score_rate(self, t, left: bool = False):
        l, frac = self._locate(t, left)
        if self.interpolation == "constant" or l == len(self.layers) - 1:
            return torch.zeros_like(self.layers[l].score_matrix)
        return (self.layers[l + 1].score_matrix - self.layers[l].score_matrix) / self.layer_time

    def left_score_rate(self, t):
        return self.score_rate(t, left=True)

    def drift(self, score, t):
        return self.score_rate(t)

    def knots(self, t0, t1):
        """The layer starts in (t0, t1]: Θ jumps there ("constant") or Ȧ does ("linear")."""
        out = []
        for l in range(1, len(self.layers)):
            tj = self.t0 + l * self.layer_time
            if t0 < tj <= t1 + 1e-12:
                out.append(tj)
        return out

    def jumps(self, t0, t1):
        return self.knots(t0, t1) if self.interpolation == "constant" else []

    @property
    def time_dependent_values(self) -> bool:
        return True


class Custom(Process):
    """dA_h = drift(t, A) dt + diffusion(t) dW_sym, stepped by Euler(–Maruyama) on the solver grid.

    drift: callable (t: float, A: Tensor (..., H, d, d)) -> Tensor like A (its shape, dtype and device;
        a shape that broadcasts to A's is accepted).
    diffusion: None (deterministic), a float σ, or a callable t -> σ (float or tensor (..., H)).
    tag: an optional string naming this version of the callables.  A checkpoint
        (``simulate(checkpoint=...)``) fingerprints the drift and diffusion by qualified name and a hash
        of their source; a callable without readable source (defined in ``python -c`` or ``exec``)
        needs a tag, and a tag that changes with anything else they read (objects in module globals).

    Wrong output (not a tensor, a shape that does not broadcast to A's, another dtype or device)
    raises at the first call, naming the expected shape.
    """

    def __init__(self, heads0, drift: Callable, diffusion=None, scheme: str = "euler", tag: Optional[str] = None):
        self.heads0 = _as_heads(heads0)
        if not callable(drift):
            raise TypeError("drift must be a callable (t, A) -> dA/dt")
        if scheme != "euler":
            raise ValueError("Custom processes are stepped by Euler(–Maruyama) only: use scheme='euler'")
        if tag is not None and (not isinstance(tag, str) or not tag):
            raise TypeError(f"tag must be None or a non-empty string naming the drift/diffusion, got {tag!r}")
        self.scheme = "euler"
        self._drift = drift
        if diffusion is not None and not callable(diffusion):
            check_positive(diffusion, "diffusion", allow_zero=True)
        self._diffusion = diffusion
        self.tag = tag

    @property
    def noisy(self):
        if self._diffusion is None:
            return False
        if callable(self._diffusion):
            return True
        return float(self._diffusion) > 0

    def drift(self, score, t):
        f = self._drift(t, score)
        if not isinstance(f, torch.Tensor):
            raise TypeError(f"the Custom drift returned {type(f).__name__}; it must return a tensor dA/dt of the "
                            f"shape of A, {tuple(score.shape)} (..., H, d, d)")
        ok = True
        try:
            ok = tuple(broadcast_shapes(f.shape, score.shape)) == tuple(score.shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"the Custom drift returned shape {tuple(f.shape)}; it must return dA/dt of the shape "
                             f"of A, {tuple(score.shape)} (..., H, d, d) (or a shape that broadcasts to it)")
        if f.dtype != score.dtype or f.device != score.device:
            raise TypeError(f"the Custom drift returned {f.dtype} on {f.device}; it must follow A ({score.dtype} on "
                            f"{score.device}): build it from A, e.g. torch.zeros_like(A)")
        return f

    def sigma(self, t):
        if self._diffusion is None:
            return 0.0
        if not callable(self._diffusion):
            return float(self._diffusion)
        s = self._diffusion(t)
        batch = tuple(self.heads0.score_matrix.shape[:-2])
        if isinstance(s, torch.Tensor):
            try:
                broadcast_shapes(s.shape, batch)
            except RuntimeError:
                raise ValueError(f"the Custom diffusion returned shape {tuple(s.shape)}; it must return σ as a float "
                                 f"or a tensor that broadcasts against the heads' shape {batch} (..., H)") from None
            if s.dim() > len(batch):
                raise ValueError(f"the Custom diffusion returned shape {tuple(s.shape)}; it must return σ as a float "
                                 f"or a tensor of at most the heads' shape {batch} (..., H)")
            return s
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"the Custom diffusion returned {type(s).__name__}; it must return σ as a float or a "
                            f"tensor broadcasting against (..., H) = {batch}")
        return float(s)


@dataclass
class WeightPath(Process):
    """A realised weight path on a time grid, replayable bit for bit by the solvers.

    times: (K+1,) grid; scores: (K+1, ..., H, d, d); rates: (K+1, ...) the drift used by the
    ledger at each grid point; noise: (K, ...) martingale increments (or None); sigma: the
    noise amplitude per grid point (list) for the Itô correction; template: Heads giving values
    (when not tied), head weights and β.
    """

    times: torch.Tensor
    scores: torch.Tensor
    rates: torch.Tensor
    noise: Optional[torch.Tensor]
    sigmas: Sequence
    template: Heads

    def __post_init__(self):
        self.heads0 = self.template.with_score(self.scores[0], symmetric=self.template.known_symmetric)
        self.scheme = "euler"

    @property
    def noisy(self):
        return self.noise is not None

    @property
    def dt(self) -> float:
        return float(self.times[1] - self.times[0]) if len(self.times) > 1 else 0.0

    def index(self, t: float, dt: float) -> int:
        k = (t - float(self.times[0])) / dt
        return int(round(k))

    def heads_at(self, t: float) -> Heads:
        """Θ at time t: the stored value on a grid point, linear interpolation between."""
        t0, h = float(self.times[0]), self.dt
        K = len(self.times) - 1
        u = 0.0 if h == 0 else (t - t0) / h
        k = min(max(int(math.floor(u + 1e-9)), 0), K)
        frac = u - k
        if k == K or abs(frac) < 1e-9:
            A = self.scores[k]
        else:
            A = self.scores[k] + frac * (self.scores[k + 1] - self.scores[k])
        return self.template.with_score(A, symmetric=self.template.known_symmetric)

    def drift(self, score, t):  # pragma: no cover - replay uses stored rates
        raise TypeError("a WeightPath is replayed from its stored values")

    @property
    def horizon(self) -> float:
        """The last time of the stored grid."""
        return float(self.times[-1])

    def check_covers(self, t0: float, t1: float) -> None:
        """Raise ValueError (naming the horizon and the requested t1) unless [t0, t1] lies in the stored grid.

        The solvers call it before any work; replaying past the horizon would otherwise index past
        the stored scores."""
        check_horizon(self.times, t0, t1, "the stored weight path",
                      "sample the process again with tp.sample_path(process, t1=..., dt=...) up to the t1 you need, "
                      "or stop the run at the horizon")


def sample_path(process: Process, *, t1: float, dt: float, t0: float = 0.0, paths: Optional[int] = None,
                seed: Optional[int] = None, generator=None, max_steps: Optional[int] = None,
                max_memory: Optional[float] = None) -> WeightPath:
    """Sample a process on the grid t0, t0 + dt, ..., t1 and store it for replay.

    The same path can then be given to :func:`simulate` (same dt) and to :func:`jko`
    (any τ that is a multiple of dt, or linear interpolation in between).

    seed / generator: the random stream (seed None means 0; giving both is refused).
    max_steps / max_memory: limits checked before anything is sampled (defaults: 10⁷ steps, 3/4
    of the machine's memory): the path holds (K+1) × paths × H × d² scores, rates and noise.
    """

    if not isinstance(process, Process):
        raise TypeError(f"process must be a transformer_pde Process (OrnsteinUhlenbeck, Oscillating, Layerwise, Custom, "
                        f"Constant), got {type(process).__name__}")
    if isinstance(process, WeightPath):
        raise TypeError("process is already a sampled WeightPath: replay it directly (simulate / jko take it as theta)")
    t1 = check_real(t1, "t1")
    t0 = check_real(t0, "t0")
    dt = check_positive(dt, "dt")
    if paths is not None:
        paths = check_int(paths, "paths")
    seed = check_seed_generator(seed, generator)
    K = grid_steps(t0, t1, dt)
    check_limits(f"sample_path on [{t0:.6g}, {t1:.6g}] with dt = {dt:.6g}", steps=K,
                 memory={"the stored path": path_bytes(process.heads0, K, paths, process.noisy)},
                 max_steps=max_steps, max_memory=max_memory, device=process.heads0.device,
                 fix="use fewer paths or a larger dt")
    return WeightDriver(process, paths=paths, generator=generator, seed=seed, t0=t0, dt=dt).sample_path(K)


def path_bytes(heads0: Heads, K: int, paths: Optional[int], noisy: bool, batch: int = 1) -> float:
    """Estimated bytes of a stored weight path of K steps: the scores and rates at K + 1 grid points and
    the K noise increments, (paths ×) batch × H × d × d each."""
    A = heads0.score_matrix
    per = float(A.numel()) * A.element_size() * (paths or 1) * batch
    return per * ((K + 1) * 2 + (K if noisy else 0))


# ---------------------------------------------------------------------------- weights driver
def grid_steps(t0: float, t1: float, dt: float) -> int:
    """The number K of steps dt from t0 to t1; ValueError unless t1 > t0 and (t1 − t0)/dt is whole."""
    span = t1 - t0
    if not span > 0:
        raise ValueError(f"t1 must be larger than t0 (got t0 = {t0}, t1 = {t1})")
    K = round(span / dt)
    if K < 1 or abs(K * dt - span) > 1e-9 * max(1.0, abs(span)):
        raise ValueError(
            f"(t1 - t0) / dt = {span / dt:.6g} is not a whole number of steps; choose dt = {span / max(K, 1):.6g} "
            f"or another dt that divides t1 - t0"
        )
    return K


def lift_paths(score: torch.Tensor, paths: Optional[int], batch_rank: int, n_head_dims: int = 3) -> torch.Tensor:
    """Prepend singleton dims so the heads' batch rank matches the tokens', then a paths axis."""
    if paths is None:
        return score
    extra = batch_rank - (score.dim() - n_head_dims)
    if extra > 0:
        score = score.reshape((1,) * extra + tuple(score.shape))
    return score.unsqueeze(0).expand(paths, *score.shape).clone()


class WeightDriver:
    """Moves Θ along a solver's time grid t_k = t0 + k·dt: closed form, grid sampling, or replay of a
    WeightPath.  Shared by every solver (simulate, simulate_sharded, sample_path); the solver asks for
    the heads at stage c ∈ [0, 1] of the current step (:meth:`stage`), the rate dA/dt and σ at t_k for
    the ledger, the noise increment (:meth:`prepare`) and moves on (:meth:`advance`)."""

    def __init__(self, process: Process, *, paths, generator, seed, t0, dt, store=False, batch_rank=None, device=None):
        self.p = process
        self.t0, self.dt, self.k = float(t0), float(dt), 0
        h0 = process.heads0
        self.batch_rank = len(h0.batch_shape) if batch_rank is None else batch_rank
        if generator is None:
            generator = torch.Generator(device=h0.device)
            generator.manual_seed(int(seed))
        self.gen = generator
        self.replay = isinstance(process, WeightPath)
        self.mode = "replay" if self.replay else ("closed" if process.closed_form else "stepped")
        self.store = store
        self._scores: List[torch.Tensor] = []
        self._rates: List[torch.Tensor] = []
        self._noise: List[torch.Tensor] = []
        self._sigmas: List = []
        if self.replay:
            if abs(process.dt - dt) > 1e-12 * max(1.0, dt) or abs(float(process.times[0]) - t0) > 1e-12:
                raise ValueError(
                    f"the stored weight path has t0 = {float(process.times[0])}, dt = {process.dt}; "
                    f"replay it with the same t0 and dt (got t0 = {t0}, dt = {dt})"
                )
            self.A = process.scores[0]
        elif self.mode == "stepped":
            self.A = lift_paths(h0.score_matrix, paths, self.batch_rank)
        else:
            self.A = None
        self._next = None
        self._cur_heads = self._heads(0.0)
        self._record_current()

    @property
    def t(self) -> float:
        return self.t0 + self.k * self.dt

    def _heads(self, c: float) -> Heads:
        if self.mode == "closed":
            if c > 0.0:  # stages inside (t_k, t_{k+1}]: left limits
                return self.p.left_heads_at(self.t + c * self.dt)
            return self.p.heads_at(self.t + c * self.dt)
        if c == 0.0:
            A = self.A
        else:
            A = self.A + c * (self._next[0] - self.A)
        tmpl = self.p.template if self.replay else self.p.heads0
        return tmpl.with_score(A, symmetric=tmpl.known_symmetric)

    @property
    def current(self) -> Heads:
        return self._cur_heads

    @property
    def rate(self) -> torch.Tensor:
        """dA/dt used by the ledger at the current grid point."""
        if self.mode == "replay":
            return self.p.rates[self.k]
        if self.mode == "closed":
            return self.p.score_rate(self.t)
        return self.p.drift(self.A, self.t)

    @property
    def sigma(self):
        if self.mode == "replay":
            return self.p.sigmas[self.k]
        return self.p.sigma(self.t) if self.p.noisy else 0.0

    @property
    def noisy(self) -> bool:
        return self.p.noisy

    def prepare(self):
        """Sample (or read) the weights of the next grid point; returns the noise increment."""
        if self.mode == "closed" or self._next is not None:
            return None if self._next is None else self._next[1]
        if self.mode == "replay":
            noise = None if self.p.noise is None else self.p.noise[self.k]
            self._next = (self.p.scores[self.k + 1], noise)
        else:
            self._next = self.p.step(self.A, self.t, self.dt, self.gen)
        return self._next[1]

    def stage(self, c: float) -> Heads:
        if c == 0.0:
            return self._cur_heads
        self.prepare()
        return self._heads(c)

    def jumps(self) -> List[float]:
        return [] if self.mode != "closed" else self.p.jumps(self.t, self.t + self.dt)

    def left_limit(self):
        """(Θ(t_k−), Ȧ(t_k−)) when Θ or Ȧ is discontinuous at the current grid point, else None: the
        trapezoid rule of the step that ends here takes its right end point from the left limits."""
        if self.mode != "closed" or not any(abs(tj - self.t) <= 1e-9 * self.dt for tj in self.p.knots(
                self.t - self.dt, self.t)):
            return None
        return self.p.left_heads_at(self.t), self.p.left_score_rate(self.t)

    def advance(self):
        noise = self.prepare()
        if self.store and self.mode != "closed":
            self._noise.append(noise)
        if self.mode != "closed":
            self.A = self._next[0]
        self._next = None
        self.k += 1
        self._cur_heads = self._heads(0.0)
        self._record_current()

    def sample_path(self, K: int) -> WeightPath:
        """Sample (or read) the next K grid steps at once and return them, from the current point, as a
        WeightPath (for solvers that need Θ off the grid: "adaptive", JKO)."""
        self.store = True
        self._scores, self._rates, self._sigmas, self._noise = [], [], [], []
        self._record_current()
        for _ in range(K):
            self.advance()
        return self.path()

    def _record_current(self):
        if self.store:
            self._scores.append(self._cur_heads.score_matrix)
            self._rates.append(self.rate)
            self._sigmas.append(self.sigma)

    def path(self) -> WeightPath:
        times = self.t0 + self.dt * torch.arange(self.k + 1, dtype=torch.float64)
        noise = None
        if self.p.noisy and self._noise:
            noise = torch.stack(self._noise)
        tmpl = self.p.template if self.replay else self.p.heads0
        return WeightPath(times, torch.stack(self._scores), torch.stack(self._rates), noise, list(self._sigmas), tmpl)

    # checkpoint support
    def state(self):
        return {"k": self.k, "A": self.A, "gen": self.gen.get_state()}

    def load_state(self, st):
        self.k = st["k"]
        self.A = st["A"]
        self.gen.set_state(st["gen"])
        self._next = None
        self._cur_heads = self._heads(0.0)
