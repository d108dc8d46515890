"""Time-dependent heads Θ_t: processes for the per-head score matrices (docs/model.md#processes).

The processes live here; a realised path stored for replay is :class:`~transformer_pde.processes.paths.WeightPath`,
and the driver that moves Θ along a solver's grid (with ``sample_path``) is
:mod:`transformer_pde.processes.driver`.

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

import copy
import math
from typing import Callable, List, Optional

import torch

from ..utils.validation import broadcast_shapes, check_choice, check_positive, check_real, check_same, check_tensor
from ..model.heads import Heads

__all__ = ["Process", "Constant", "OrnsteinUhlenbeck", "Oscillating", "Layerwise", "Custom", "symmetric_noise",
           "oscillating_target"]

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

    @property
    def piecewise_constant(self) -> bool:
        """True when Θ_t is constant between its jumps (:meth:`jumps`): dA/dt = 0 there, so the energy ledger's
        ∂_tE is 0 without pairing ∂_A E with a zero rate (Constant; Layerwise with constant interpolation)."""
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

    # -- β as a rule of the context length (docs/model.md#heads)
    def _heads_fields(self):
        for k, v in vars(self).items():
            if isinstance(v, Heads) or (isinstance(v, (list, tuple)) and any(isinstance(h, Heads) for h in v)):
                yield k, v

    @property
    def resolved(self) -> bool:
        """False when some heads of the process hold a rule β_n of the context length not resolved yet."""
        for _, v in self._heads_fields():
            for h in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(h, Heads) and not h.resolved:
                    return False
        return True

    def at_context(self, n: int) -> "Process":
        """The process with every rule β_n of its heads resolved at n tokens (:meth:`Heads.at_context`);
        the process itself when there is none.  ``tp.solve`` calls it once, with n = x0.shape[-2]."""
        if self.resolved:
            return self
        new = copy.copy(self)
        for k, v in self._heads_fields():
            if isinstance(v, Heads):
                setattr(new, k, v.at_context(n))
            else:
                setattr(new, k, type(v)(h.at_context(n) if isinstance(h, Heads) else h for h in v))
        return new


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

    piecewise_constant = True

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

    @property
    def piecewise_constant(self) -> bool:
        return self.interpolation == "constant"

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

