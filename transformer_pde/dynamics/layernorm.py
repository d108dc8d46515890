"""Layer normalisation: how one layer maps the tokens (the geometry / step seam of the solvers).

Every scheme reads the attention update at the tokens,

    A_i = s · Σ_h ω_h f_h(x_i)          (un-projected, signed; ``FieldEval.ambient``)

computed from tokens on the sphere (every scheme's attention sees the normalised tokens x_i),
and maps one layer of depth Δt.  In continuous time (Karagodin, Ge, Polyanskiy, Rigollet 2025,
"Normalization in attention dynamics") every scheme is the attention direction times a
per-token speed factor λ_i > 0,

    ẋ_i = λ_i · P_{x_i} A_i

(see ``docs/layer_norms.md``):

==========  ==========================================================  =====================
 name        discrete layer map (one step Δt)                            speed factor λ_i
==========  ==========================================================  =====================
 "none"      x ← normalize(x + Δt·P_x A) (Runge–Kutta + retraction)      1
 "post"      x ← normalize(x + Δt·A)                                     1
 "pre"       z = r x + Δt·A,  r ← |z|,  x ← z/|z|                        1/r_i,  ṙ_i = ⟨x_i, A_i⟩
 "peri"      z = r x + Δt·Â,  Â = A/|A|,  r ← |z|,  x ← z/|z|            1/(r_i|A_i|),  ṙ_i = ⟨x_i, Â_i⟩
 "ngpt"      x ← normalize(x + Δt·α·Â)                                   α/|A_i|
==========  ==========================================================  =====================

"none" is the projected flow of the other solvers (the same arithmetic); "post" is the map that both reference
simulators iterate (borjanG/2023-transformers-rotf ``simu_xform.step_1``,
nikitus20/simuformer ``SimuXForm.step`` with ``norm='postln'``): it has the same ODE limit as
"none" but differs from the projected Euler step at O(Δt²) per step, O(Δt) over a run.
"pre" and "peri" carry the token radius r_i (the norm of the residual stream; r_i = 1 at t0).
``rule="simuformer"`` reproduces simuformer's own arithmetic for pre-/peri-LN (the radius
update r ← r + Δt·r·Σ_k A_k, a sum of coordinates, then x ← normalize(x + Δt·u/(r + ε)) with
u = P_x A for pre-LN, u = Â for peri-LN); :func:`simuformer_scheme` gives the objects that
match that code to rounding.

Gradient flow and ledger.  Since λ_i > 0 is a per-token time change, each scheme is a gradient
flow of E exactly when the projected flow is (symmetric heads, and H = 1 or
normalization="effective"), in the metric Σ_i w_i (b_i/λ_i)|v_i|².  The ledger books the
chain-rule rate 𝒟_λ = Σ_i w_i λ_i ⟨∇_S δE/δμ(x_i), V_i⟩ and the slope of that metric
𝒢²_λ = Σ_i w_i λ_i b_i |V_i|² (V = s P_x Σ_h ω_h f_h, the projected field); with λ = 1 they are
the projected flow's 𝒟 and 𝒢².  The residuals close at the order of the step (O(Δt) for these Euler-type
maps).  For "pre" and "peri" the metric depends on the radii, which evolve with the flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple, Union

import math

import torch

from ..utils import hardware
from ..utils.recycle import Recycler
from ..utils.validation import broadcast_shapes
from ..model.field import FieldEval, log_inverse_mobility
from ..model.sphere import normalize, tangent_projection

__all__ = ["LayerNormScheme", "Projected", "PostLN", "PreLN", "PeriLN", "NGPT", "LAYER_NORMS", "as_geometry",
           "simuformer_scheme"]
#: named internal API (the solvers' use of the seam)
__internal__ = ["geometry_densities", "check_layer_norm_method", "FusedUpdate", "score_block_bytes", "SCORE_BLOCK_FRACTION"]

#: the names accepted by ``simulate(..., layer_norm=...)``
LAYER_NORMS = ("none", "post", "pre", "peri", "ngpt")
RULES = ("residual", "simuformer")


def _scaled(a: torch.Tensor):
    """(a/s, s) with s = max_k |a_k| over the last axis (s = 1 where a = 0): |a/s| lies in [1, √d], so its
    square neither underflows nor overflows (|a|² of a = 1e-30 in float32, or of 1e-310 in float64, is 0)."""
    s = a.detach().abs().amax(dim=-1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return a / s, s


def _over_norm(v: torch.Tensor, a: torch.Tensor, eps: float) -> torch.Tensor:
    """v/(|a| + eps) over the last axis, with |a| formed from a/max|a_k| (no underflow of |a|²); 0 where
    a = 0 and eps = 0 (the zero update: Â = 0, the token does not move)."""
    b, s = _scaled(a)
    den = b.norm(dim=-1, keepdim=True)
    if eps:  # (eps / s: torch forms eps · (1/s), which is 0 · inf = NaN for eps = 0 and a subnormal s)
        den = den + eps / s
    ok = den > 0
    return torch.where(ok, (v / s) / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(v))


def _unit(a: torch.Tensor, eps: float) -> torch.Tensor:
    """Â = a/(|a| + eps) over the last axis; well defined for tiny a (no underflow) and 0 at a = 0."""
    return _over_norm(a, a, eps)


def _norm(a: torch.Tensor) -> torch.Tensor:
    """|a| over the last axis (..., ) without underflow of |a|²."""
    b, s = _scaled(a)
    return b.norm(dim=-1) * s.squeeze(-1)


def _check_eps(eps, name):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps != eps:
        raise ValueError(f"{name}: eps must be a float >= 0 (the guard added to a norm in a denominator), got {eps!r}")


def _check_rule(rule, name):
    if rule not in RULES:
        raise ValueError(f"{name}: rule must be one of {RULES} ('residual': the residual stream z ← z + Δt·u; "
                         f"'simuformer': that code's radius update), got {rule!r}")


@dataclass(frozen=True)
class LayerNormScheme:
    """A layer-normalisation scheme (base class; module docstring).

    Class attributes: ``name`` (the string of ``simulate(layer_norm=...)``), ``radius`` (the state
    carries the token radii r (..., n)), ``projected`` (the projected Runge–Kutta flow:
    the solver's own tableau and retraction do the step), ``sees`` (the tokens the attention
    reads: always the normalised tokens x on the sphere)."""

    name: ClassVar[str] = ""
    radius: ClassVar[bool] = False
    projected: ClassVar[bool] = False
    sees: ClassVar[str] = "the normalised tokens x_i = z_i/|z_i| on the sphere"

    @property
    def gradient_flow(self) -> str:
        """When the scheme is a gradient flow of E (module docstring)."""
        return ("when the projected flow is (symmetric heads; H = 1 or normalization='effective'), in the metric "
                "Σ_i w_i (b_i/λ_i)|v_i|² with the speed factor λ_i of this scheme")

    def initial_radius(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """r at t0: ones (..., n) for the schemes with a radius, else None."""
        return torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device) if self.radius else None

    def speed(self, x: torch.Tensor, r: Optional[torch.Tensor], update: torch.Tensor) -> Optional[torch.Tensor]:
        """λ_i (..., n) of the continuous-time limit ẋ_i = λ_i P_x A_i; None when λ = 1."""
        return None

    def radius_rate(self, x, r, update) -> Optional[torch.Tensor]:
        """ṙ_i (..., n) of the continuous-time limit, or None (no radius)."""
        return None

    def speed_times(self, x, r, update: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
        """λ_i v_i (..., n, d) for a vector v_i of size O(|A_i|) (the projected update); None when λ = 1.  The
        schemes whose λ has 1/|A| form it as v/|A| (finite for tiny and zero A, where λ alone overflows)."""
        lam = self.speed(x, r, update)
        return None if lam is None else lam.unsqueeze(-1) * v

    def limit(self, x: torch.Tensor, r: Optional[torch.Tensor], update: torch.Tensor):
        """The continuous-time limit (ẋ (..., n, d), ṙ (..., n) or None) at (x, r) with A = ``update``."""
        v = tangent_projection(x, update)
        lv = self.speed_times(x, r, update, v)
        return (v if lv is None else lv), self.radius_rate(x, r, update)

    def step(self, x: torch.Tensor, r: Optional[torch.Tensor], update: torch.Tensor, dt: float):
        """One layer: (x_new, r_new or None, the largest |‖y‖ − 1| before normalising)."""
        raise NotImplementedError  # pragma: no cover - every concrete scheme defines it

    def retract(self, x: torch.Tensor) -> torch.Tensor:
        """Pull ambient points back to the sphere (the geometry seam of every solver: the projected
        Runge–Kutta stages, the adaptive solve and the JKO line search): x ↦ x/|x|."""
        return normalize(x)

    def retract_step(self, y: torch.Tensor):
        """The end of a projected Runge–Kutta step: (``retract(y)``, the largest |‖y‖ − 1| before it).

        The default reuses the norm it measures (x/|x| without a second norm); a scheme that
        overrides :meth:`retract` overrides this too."""
        ny = y.detach().norm(dim=-1)
        return (y / ny.unsqueeze(-1) if not y.requires_grad else self.retract(y)), float((ny - 1).abs().max())

    def describe(self) -> str:
        return self.name


def _normalized(y: torch.Tensor):
    """(y/|y|, |y|) for a freshly computed y, which is divided in place when no gradient flows through it."""
    ny = y.norm(dim=-1, keepdim=True)
    return (y / ny if y.requires_grad else y.div_(ny)), ny.squeeze(-1)


def _err(ny: torch.Tensor) -> float:
    return float((ny.detach() - 1).abs().max()) if ny.numel() else 0.0


@dataclass(frozen=True)
class Projected(LayerNormScheme):
    """"none": the projected flow ẋ = P_x A, integrated by the solver's Runge–Kutta tableau
    with the retraction x ↦ x/|x| after every stage.  The default."""

    name: ClassVar[str] = "none"
    projected: ClassVar[bool] = True

    def step(self, x, r, update, dt):
        y = x + dt * tangent_projection(x, update)
        out, ny = _normalized(y)
        return out, None, _err(ny)


@dataclass(frozen=True)
class PostLN(LayerNormScheme):
    """"post": x ← normalize(x + Δt·A), the residual layer followed by the normalisation, without
    the tangent projection (the reference simulators' map).  Limit: the projected flow (λ = 1)."""

    name: ClassVar[str] = "post"

    def step(self, x, r, update, dt, out: Optional[torch.Tensor] = None):
        """One layer; ``out``: where to write the new tokens when no gradient flows (memory the run
        recycles), else new memory."""
        grad = torch.is_grad_enabled() and (x.requires_grad or update.requires_grad)
        y = torch.add(x, update, alpha=dt, out=out) if out is not None and not grad else torch.add(x, update, alpha=dt)
        y, ny = _normalized(y)
        return y, None, _err(ny)


@dataclass(frozen=True)
class PreLN(LayerNormScheme):
    """"pre": the residual stream z = r x is not normalised, the attention reads x = z/|z|:
    z ← z + Δt·A(x).  Limit ẋ = P_x A / r, ṙ = ⟨x, A⟩ (λ = 1/r).

    rule="simuformer": that code's arithmetic, r ← r + Δt·r·Σ_k A_k (the coordinate sum of A),
    then x ← normalize(x + Δt·P_x A/(r + eps)) with the new r; its radius limit is ṙ = r Σ_k A_k."""

    rule: str = "residual"
    eps: float = 0.0
    name: ClassVar[str] = "pre"
    radius: ClassVar[bool] = True

    def __post_init__(self):
        _check_rule(self.rule, "PreLN")
        _check_eps(self.eps, "PreLN")

    def speed(self, x, r, update):
        return 1.0 / (r + self.eps)

    def radius_rate(self, x, r, update):
        if self.rule == "simuformer":
            return r * update.sum(-1)
        return (x * update).sum(-1)

    def step(self, x, r, update, dt):
        if self.rule == "simuformer":
            r_new = r + dt * (r * update.sum(-1))
            out, ny = _normalized(x + (dt * tangent_projection(x, update)) / (r_new.unsqueeze(-1) + self.eps))
            return out, r_new, _err(ny)
        z = r.unsqueeze(-1) * x + dt * update
        out, nz = _normalized(z)
        return out, nz, 0.0


@dataclass(frozen=True)
class PeriLN(LayerNormScheme):
    """"peri": the attention output is normalised too, z ← z + Δt·Â, Â = A/(|A| + eps), and the
    attention reads x = z/|z|.  Limit ẋ = P_x Â / r, ṙ = ⟨x, Â⟩ (λ = 1/(r|A|)).

    rule="simuformer": r ← r + Δt·r·Σ_k Â_k, then x ← normalize(x + Δt·Â/(r + eps)) (no projection)."""

    rule: str = "residual"
    eps: float = 0.0
    name: ClassVar[str] = "peri"
    radius: ClassVar[bool] = True

    def __post_init__(self):
        _check_rule(self.rule, "PeriLN")
        _check_eps(self.eps, "PeriLN")

    def speed(self, x, r, update):
        return 1.0 / ((r + self.eps) * (_norm(update) + self.eps))

    def speed_times(self, x, r, update, v):
        return _over_norm(v, update, self.eps) / (r + self.eps).unsqueeze(-1)

    def radius_rate(self, x, r, update):
        u = _unit(update, self.eps)
        return r * u.sum(-1) if self.rule == "simuformer" else (x * u).sum(-1)

    def step(self, x, r, update, dt):
        u = _unit(update, self.eps)
        if self.rule == "simuformer":
            r_new = r + dt * (r * u.sum(-1))
            out, ny = _normalized(x + (dt * u) / (r_new.unsqueeze(-1) + self.eps))
            return out, r_new, _err(ny)
        out, nz = _normalized(r.unsqueeze(-1) * x + dt * u)
        return out, nz, 0.0


@dataclass(frozen=True)
class NGPT(LayerNormScheme):
    """"ngpt" (normalised transformer): x ← normalize(x + Δt·α·Â), Â = A/(|A| + eps), α = 0.2 as in
    simuformer.  Limit ẋ = α P_x A/|A| (λ = α/|A|).  (nGPT's own update normalize(x + α(Â − x))
    has the same limit with α/(1 − Δtα) in place of α per step.)"""

    alpha: float = 0.2
    eps: float = 0.0
    name: ClassVar[str] = "ngpt"

    def __post_init__(self):
        _check_eps(self.eps, "NGPT")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"NGPT: alpha must be a float > 0 (the step of the normalised update), got {self.alpha!r}")

    def speed(self, x, r, update):
        return self.alpha / (_norm(update) + self.eps)

    def speed_times(self, x, r, update, v):
        return self.alpha * _over_norm(v, update, self.eps)

    def step(self, x, r, update, dt):
        out, ny = _normalized(x + (dt * self.alpha) * _unit(update, self.eps))
        return out, None, _err(ny)


_BY_NAME = {"none": Projected, "post": PostLN, "pre": PreLN, "peri": PeriLN, "ngpt": NGPT}


def as_geometry(layer_norm: Union[str, LayerNormScheme]) -> LayerNormScheme:
    """The scheme object for a name of :data:`LAYER_NORMS` (or the object itself); TypeError / ValueError
    otherwise."""
    if isinstance(layer_norm, LayerNormScheme):
        if type(layer_norm) is LayerNormScheme:
            raise TypeError("layer_norm=LayerNormScheme() is the abstract base; use Projected(), PostLN(), PreLN(), "
                            "PeriLN() or NGPT()")
        return layer_norm
    if not isinstance(layer_norm, str):
        raise TypeError(f"layer_norm must be one of {LAYER_NORMS} or a transformer_pde LayerNormScheme object, got "
                        f"{type(layer_norm).__name__}")
    if layer_norm not in _BY_NAME:
        raise ValueError(f"unknown layer_norm {layer_norm!r}; choose one of {LAYER_NORMS}")
    return _BY_NAME[layer_norm]()


def simuformer_scheme(norm: str) -> LayerNormScheme:
    """The scheme that repeats nikitus20/simuformer's ``--norm`` mode to rounding:
    "postln" → PostLN(), "preln" → PreLN("simuformer", 1e-9), "periln" → PeriLN("simuformer", 1e-9),
    "ngpt" → NGPT(0.2, 1e-9).  (Run with direction="ascent", ω_h = 1/H, and A_h, V_h the
    transposes of that code's BF[h], V[h]: its scores are x_iᵀ BF x_j and its values V[h]ᵀ x_j.)"""
    table = {"postln": PostLN(), "preln": PreLN("simuformer", 1e-9), "periln": PeriLN("simuformer", 1e-9),
             "ngpt": NGPT(0.2, 1e-9)}
    if norm not in table:
        raise ValueError(f"unknown simuformer norm {norm!r}; choose one of {tuple(table)}")
    return table[norm]


def geometry_densities(geometry: LayerNormScheme, e, heads, weights, r, log_scale: float = 0.0
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(𝒟_λ, 𝒢²_λ) (...,) of a field evaluation ``e`` (with diagnostics) under the scheme's speed λ:

        𝒟_λ = Σ_i w_i λ_i ⟨∇_S δE/δμ(x_i), V_i⟩,    𝒢²_λ = Σ_i w_i λ_i b_i |V_i|²

    times e^{−c}; (e.dissipation, e.slope) themselves when λ = 1."""
    if type(geometry).speed is LayerNormScheme.speed:  # λ = 1: the field's own densities (V is not formed)
        return e.dissipation, e.slope
    V = e.velocity
    lam_v = geometry.speed_times(None, r, e.ambient, V)  # λ_i V_i, finite also where |A_i| is tiny or 0
    b = torch.exp(-log_inverse_mobility(heads, e.stats.log_partition) - log_scale)

    def mean(v):
        return v.mean(-1) if weights is None else (v * weights).sum(-1)

    return mean((e.grad_first_variation * lam_v).sum(-1)), mean(b * (V * lam_v).sum(-1))


def check_layer_norm_method(geometry: LayerNormScheme, method: str) -> None:
    """The layer maps are one attention evaluation per layer: they need method='euler'."""
    if not geometry.projected and method != "euler":
        raise ValueError(f"layer_norm={geometry.name!r} is a discrete layer map (one attention evaluation per layer "
                         f"of depth dt); use method='euler' (got method={method!r}), or layer_norm='none' for the "
                         f"projected flow with Runge–Kutta and adaptive methods")



#: the scores of one block of systems in FusedUpdate, as a fraction of one core's L2 cache: the exponential,
#: the normalisation and the product with the tokens then run on data held in the cache, not main memory
#: (on the peers' workload ½ L2 was within a few per cent of the best block both with a 1 MiB and a 2 MiB L2:
#: docs/performance.md, "The layer maps' kernel on the peers' workload")
SCORE_BLOCK_FRACTION = 0.5
#: the score block in bytes when set (tests, benchmarks); None: SCORE_BLOCK_FRACTION of the L2 size
_SCORE_BLOCK_BYTES: Optional[int] = None
#: the score block on devices other than the CPU (no CPU cache to fit; a bound on the scores' memory)
_DEVICE_BLOCK_BYTES = 2 ** 26
#: log₂ e: the queries carry it, so that exp2 of the scores is e^{β⟨x_i, A_h x_j⟩}
_LOG2E = 1.0 / math.log(2.0)


def score_block_bytes(device: torch.device) -> int:
    """Bytes of the scores of one block of systems in :class:`FusedUpdate` on ``device``: on the CPU
    ``SCORE_BLOCK_FRACTION`` of one core's L2 cache (:func:`transformer_pde.utils.hardware.cache_sizes`),
    at least 64 KiB; elsewhere 64 MiB; ``_SCORE_BLOCK_BYTES`` when set."""
    if _SCORE_BLOCK_BYTES is not None:
        return int(_SCORE_BLOCK_BYTES)
    if device.type != "cpu":
        return _DEVICE_BLOCK_BYTES
    return max(2 ** 16, int(SCORE_BLOCK_FRACTION * hardware.cache_sizes().l2))


class _Workspace:
    """Buffers reused from one call to the next (the scores, queries and head means of one block): no
    allocation, and no fresh pages to fault in, per step.  ``get(name, shape, like)`` is a view of
    the first elements of the named buffer, which grows when a larger shape, another dtype or device
    asks for it."""

    def __init__(self):
        self._bufs = {}
        self.outputs = Recycler(2)  # the results: the caller's current one and the one before it

    def get(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._bufs[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf[:size].view(shape)


class _AmbientEval(FieldEval):
    """A tokens-only FieldEval of a layer map: ``ambient`` = A, and ``velocity`` = P_x A computed on
    first read (the layer maps add A itself; the projection is made only for a caller that asks)."""

    def __init__(self, x: torch.Tensor, ambient: torch.Tensor):
        self._x, self._v = x, None
        super().__init__(None, None, None, ambient=ambient)

    @property
    def velocity(self) -> torch.Tensor:
        if self._v is None:
            self._v = tangent_projection(self._x, self.ambient)
        return self._v

    @velocity.setter
    def velocity(self, value):
        self._v = value


#: the layouts of :class:`FusedUpdate`'s products by dtype: "keys" (the scores as (keys, queries·heads), every
#: product with an output of at least n columns) where the CPU BLAS is slow on the (·, d)-column outputs of the
#: "queries" layout (MKL's float64 kernels: 17 against 32 GFLOP/s for d = 16 on the peers' workload,
#: docs/performance.md); "queries" (the scores as (queries·heads, keys), no transposing pass) elsewhere
LAYOUTS = {torch.float64: "keys"}


class FusedUpdate:
    """The layer maps' attention update without diagnostics, in one fused pass (softmax, not causal):

        Q_ih = β log₂e A_hᵀ x_i,   E_ihj = w_j 2^{⟨Q_ih, x_j⟩} = w_j e^{β⟨x_i, A_h x_j⟩},
        P_ihj = E_ihj / Σ_k E_ihk,   A_i = Σ_h ω_h s V_h (Σ_j P_ihj x_j)

    All heads share each product: Q for every head comes from one product of the tokens with
    [β log₂e A_1 … β log₂e A_H] (rows i·H + h), the scores of every head from one product of Q with the
    tokens, exponentiated in place by ``exp2`` (the factor log₂e is folded into the stacked matrices:
    2^{log₂e·s} = e^{s}, and torch's exp2 is 1.7–2.8× faster than its exp on the CPU), the head means
    Σ_j P_ihj x_j from one product of the scores with the tokens divided by the row sums (a pass over the
    n·H × d means instead of the n·H × n scores), and the head-summed update from one product of the means
    (n × Hd) with [ω_1 s V_1ᵀ; …; ω_H s V_Hᵀ] (Hd × d).  Two layouts of the same products
    (:data:`LAYOUTS`): "queries" keeps the scores as E (n·H, n) (rows (i, h), the row sums over the
    contiguous axis); "keys" as Eᵀ (n, n·H) = X Qᵀ, the means as Xᵀ Eᵀ (d, n·H), divided by the column
    sums into the (h, ·, i) layout of the last product, taken transposed (Aᵀ = [ω_h s V_h]_h · means, an
    output of n columns), so that no product has an output of only d columns.  The systems are taken in
    blocks whose scores (or queries, when d > n) fill :func:`score_block_bytes` (a fraction of one core's
    L2 cache), into buffers kept from one call to the next, and the result into the memory of an earlier
    one when nothing holds it any more (:class:`~transformer_pde.utils.recycle.Recycler`).  The exponential runs on the scores directly (no max shift): |⟨x_i, β A_h x_j⟩| ≤ β‖A_h‖_F for
    unit vectors, and the pass is used only when that bound is below ½ log(finfo.max) − log n (else
    ``None``: the caller falls back to :func:`transformer_pde.model.field.evaluate`), nor with autograd.
    The same numbers as ``evaluate`` to rounding (tests/test_layernorm.py).  The stacked matrices are
    prepared once per head tensors (constant weights reuse them every step).  Returns a :class:`FieldEval`
    with ``ambient`` = A, ``velocity`` = P_x A (computed when first read) and no statistics."""

    def __init__(self, weights, sign: float):
        self.w, self.sign = weights, float(sign)
        self._key = None
        self._prep = None
        self._ws = _Workspace()

    @staticmethod
    def _signature(heads):
        ts = [heads.score_matrix, heads.value_matrix, heads.weights]
        b = heads.beta
        return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in ts) + (
            (b.data_ptr(), b._version) if isinstance(b, torch.Tensor) else (float(b),),)

    def _prepare(self, heads, x):
        keys = LAYOUTS.get(x.dtype) == "keys"                               # the value matrices' orientation
        key = self._signature(heads) + (keys,) if heads.score is not None else None
        if key is not None and key == self._key:
            return self._prep
        A, V = heads.score_matrix, heads.value_matrix
        H, d = A.shape[-3], A.shape[-1]
        beta = heads.beta_tensor().to(A.dtype)
        beta = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
        bound = float((beta * A).flatten(-2).norm(dim=-1).detach().max())
        limit = 0.5 * math.log(torch.finfo(x.dtype).max) - math.log(max(x.shape[-2], 1))
        qa = (beta * _LOG2E) * A                                             # 2^{⟨Q, x⟩} = e^{β⟨x, A x⟩}
        qa = qa.movedim(-3, -2).reshape(*qa.shape[:-3], d, H * d)          # (..., d, H·d): column block h = β log₂e A_h
        vs = (heads.weights[..., None, None] * (self.sign * V)).transpose(-1, -2)
        vs = vs.reshape(*vs.shape[:-3], H * d, d)                            # (..., H·d, d): row block h = ω_h s V_hᵀ
        if keys:                                                             # (..., d, H·d): column block h = ω_h s V_h
            vs = vs.transpose(-1, -2).contiguous()
        self._prep, self._key = (qa, vs, H, bound <= limit), key
        return self._prep

    def __call__(self, x: torch.Tensor, heads) -> "FieldEval | None":
        qa, vs, H, safe = self._prepare(heads, x)
        if not safe or (torch.is_grad_enabled() and (x.requires_grad or qa.requires_grad or vs.requires_grad)):
            return None
        n, d = x.shape[-2:]
        w = self.w.unsqueeze(-2) if self.w is not None else None            # (..., 1, n)
        parts = [x, qa, vs] + ([w] if w is not None else [])
        batch = broadcast_shapes(*(t.shape[:-2] for t in parts))
        B = math.prod(batch)
        per = n * H * max(n, d) * x.element_size()    # bytes of one system's scores (or queries, when d > n)
        size = max(1, min(B, score_block_bytes(x.device) // max(per, 1)))
        # every system's tokens (B, n, d); the heads and weights stay 2-D when all systems share them
        flat = [t.expand(*batch, *t.shape[-2:]).reshape(B, *t.shape[-2:]) if t.dim() > 2 or i == 0 else t
                for i, t in enumerate(parts)]
        ambient = self._ws.outputs.take((B, n, d), x)                       # an earlier result's memory when free
        keys = LAYOUTS.get(x.dtype, "queries") == "keys"
        update = self._update_keys if keys else self._update
        shared = flat[2].dim() == 2
        plan = self._plan(size, (n, d, H), x, keys, shared)
        # blocks of systems whose scores stay in cache through exp, sums and products (views, one split each)
        blocks = zip(*[t.split(size) if t.dim() > 2 else [t] * -(-B // size) for t in flat], ambient.split(size))
        with torch.no_grad():
            for *blk, out in blocks:
                b = out.shape[0]
                update(blk, plan if b == size else self._plan(b, (n, d, H), x, keys, shared), out)
        return _AmbientEval(x, ambient.view(*batch, n, d))

    def _buffers(self, b: int, sizes, x, keys: bool = False):
        """The workspace's queries (b, n, H·d), scores, row sums and means: the scores (b, n·H, n), sums
        (b, n·H, 1) and means (b, n·H, d), or in layout "keys" the scores (b, n, n·H), sums (b, 1, n·H),
        means (b, H·d, n) (with heads shared by all systems read as (H·d, b·n)), the undivided means
        (b, d, n·H) and the transposed update (b, d, n) (shared heads: (d, b·n))."""
        n, d, H = sizes
        ws = self._ws
        if keys:
            return (ws.get("q", (b, n, H * d), x), ws.get("e", (b, n, n * H), x), ws.get("s", (b, 1, n * H), x),
                    ws.get("m", (b, H * d, n), x), ws.get("t", (b, d, n * H), x), ws.get("o", (b, d, n), x))
        return (ws.get("q", (b, n, H * d), x), ws.get("e", (b, n * H, n), x), ws.get("s", (b, n * H, 1), x),
                ws.get("m", (b, n * H, d), x))

    def _plan(self, b: int, sizes, x, keys: bool, shared: bool):
        """The buffers of a block of b systems (:meth:`_buffers`) with the views of them that every such
        block reads, made once per call: layout "queries" (Q, Q as (b, n·H, d), E, sums, means); layout
        "keys" (Q, Qᵀ as (b, d, n·H), Eᵀ, sums, undivided means, (dividend, divisor, quotient) of the
        division into the (h, ·, i) layout, the means, the transposed update, and that update read as
        (b, n, d)), for heads per system or ``shared`` by all systems."""
        n, d, H = sizes
        bufs = self._buffers(b, sizes, x, keys)
        if not keys:
            Q, E, s, means = bufs
            return Q, Q.view(b, -1, d), E, s, means
        Q, ET, s, means, MT, out_t = bufs
        if shared:                                                            # (h, ·, system, i)
            div = (MT.view(b, d, n, H).permute(3, 1, 0, 2), s.view(b, 1, n, H).permute(3, 1, 0, 2),
                   means.view(H, d, b, n))
            back = out_t.view(d, b, n).permute(1, 2, 0)
        else:                                                                 # (system, h, ·, i)
            div = (MT.view(b, d, n, H).permute(0, 3, 1, 2), s.view(b, 1, n, H).permute(0, 3, 1, 2),
                   means.view(b, H, d, n))
            back = out_t.transpose(1, 2)
        return Q, Q.view(b, -1, d).transpose(1, 2), ET, s, MT, div, means, out_t, back

    @staticmethod
    def _queries(x, qa, Q):
        b, n, d = x.shape
        if qa.dim() == 2:                                                    # heads shared by all systems
            torch.mm(x.reshape(b * n, d), qa, out=Q.view(b * n, -1))
        else:
            torch.bmm(x, qa, out=Q)                                          # Q[i, h] = β log₂e A_hᵀ x_i

    @staticmethod
    def _values(means, vs, out):
        b, n, d = out.shape
        if vs.dim() == 2:
            torch.mm(means.view(b * n, -1), vs, out=out.view(b * n, d))
        else:
            torch.bmm(means.view(b, n, -1), vs, out=out)

    @staticmethod
    def _values_keys(means, vs, out_t):
        """Layout "keys": the transposed update Aᵀ = [ω_1 s V_1 … ω_H s V_H] (d × H·d) times the means
        (H·d × n) of each system, or of all b systems at once, (H·d × b·n), when the heads are shared."""
        if vs.dim() == 2:
            torch.mm(vs, means.view(vs.shape[1], -1), out=out_t.view(vs.shape[0], -1))
        else:
            torch.bmm(vs, means, out=out_t)

    @classmethod
    def _update(cls, blk, plan, out):
        """A of one block into ``out`` (b, n, d), through the buffers and views ``plan`` (:meth:`_plan`),
        layout "queries": the products and in-place passes of the class docstring."""
        x, qa, vs = blk[:3]
        w = blk[3] if len(blk) > 3 else None
        Q, Qr, E, s, means = plan
        cls._queries(x, qa, Q)
        torch.bmm(Qr, x.transpose(1, 2), out=E)                              # E[i·H + h, j]
        E.exp2_()
        if w is not None:
            E.mul_(w)
        torch.sum(E, -1, keepdim=True, out=s)
        torch.bmm(E, x, out=means)                                           # Σ_j E_ihj x_j
        means.div_(s)                                                        # Σ_j P_ihj x_j
        cls._values(means, vs, out)

    @classmethod
    def _update_keys(cls, blk, plan, out):
        """The same as :meth:`_update` in layout "keys": Eᵀ = X Qᵀ (b, n, n·H), its column sums (with
        weights: wᵀ Eᵀ) and the transposed means Xᵀ Eᵀ (with weights: (w x)ᵀ Eᵀ), divided into the
        (h, ·, i) layout of the last product, which gives the transposed update (its output has n or
        b·n columns, not d; the update is copied into ``out`` from it)."""
        x, qa, vs = blk[:3]
        w = blk[3] if len(blk) > 3 else None
        Q, QT, ET, s, MT, (num, den, quot), means, out_t, back = plan
        cls._queries(x, qa, Q)
        torch.bmm(x, QT, out=ET)                                             # Eᵀ[j, i·H + h]
        ET.exp2_()
        if w is None:
            torch.sum(ET, 1, keepdim=True, out=s)
            torch.bmm(x.transpose(1, 2), ET, out=MT)                         # Σ_j E_ihj x_j, as (d, n·H)
        else:
            wb = w.expand(x.shape[0], 1, x.shape[1])
            torch.bmm(wb, ET, out=s)
            torch.bmm((x * wb.transpose(1, 2)).transpose(1, 2), ET, out=MT)
        torch.div(num, den, out=quot)                                        # Σ_j P_ihj x_j
        cls._values_keys(means, vs, out_t)
        out.copy_(back)
