"""Continuous-depth attention as a ``torch.nn.Module``: tokens carried by :func:`transformer_pde.solve`.

:class:`MeanFieldAttention` holds trainable per-layer projections W_Q, W_K, W_V, W_O of H heads
(the parameters of L stacked ``MultiheadAttention`` layers without biases) and, in every forward,
builds from them the heads Θ_t of docs/model.md#heads,

    A_{l,h} = W_{Q,l,h}ᵀ W_{K,l,h},   V_{l,h} = W_{O,l,h} W_{V,l,h},   β,   ω_h = 1 (heads summed),

as a :class:`~transformer_pde.Layerwise` process on [0, T]: layer l holds on [lT/L, (l+1)T/L)
("constant", a residual network in continuous depth) or the layers are knots of a linear
interpolation ("linear", a smooth Θ_t).  The tokens x (..., n, d) on the unit sphere then follow

    ẋ_i = s · P_{x_i} Σ_h f_h(x_i)     (layer_norm "none": the projected flow, docs/model.md#fields)

or the post-/pre-LN layer maps of docs/layer_norms.md, integrated by a fixed-step Runge–Kutta
solver (gradients by backpropagation through the steps) or by the adaptive dopri5 (``method="adaptive"``,
:class:`~transformer_pde.Dopri5`), optionally with torchdiffeq's
adjoint (``adjoint=True``: memory independent of the number of steps).

Optional feed-forward term (``feedforward=m``): after the attention flow of layer l the tokens take
one residual step x ← (x + Δ F_l(x)) / |x + Δ F_l(x)| of the two-layer perceptron
F_l(x) = W_{2,l} GELU(W_{1,l} x + b_{1,l}), Δ = T/L (Lie splitting of attention and feed-forward,
first order in Δ, as a pre-/post-LN transformer block alternates them).

Kinetic energy.  ``forward(x, kinetic=True)`` also returns the solver's own ledger term

    ∫_0^T 𝒢²(t) dt,   𝒢² = ∫ b(x) |V[μ_t, Θ_t](x)|² dμ_t(x)

(``traj.kinetic``, the ledger's "slope": the squared metric speed of the flow in the mobility metric in
which it is a gradient flow, docs/model.md#ledger; b = the harmonic mean of the heads' partition
functions, e^{−β‖A‖} ≤ m_h ≤ e^{β‖A‖}), accumulated by the solver along its own velocity at the grid
points (left point rule for Euler, trapezoid otherwise; with a layer map along the scheme's velocity).
It is the transport cost of OT-Transformer's regulariser λ∫‖v‖² dt in the model's metric.  The
fixed-step solvers accumulate it from each step's own field evaluation (``LedgerOptions(kinetic=True)``:
b from the log-partitions the field's kernel pass already has), at a few per cent over the plain
forward (docs/performance.md); dopri5 integrates it from the ledger on its record grid.

``forward(x, kinetic="displacement")`` returns instead the discrete kinetic action of the solver's
own steps (no field evaluation, no diagnostics: the cheap one),

    Σ_k Σ_i w_i |x_{k+1,i} − x_{k,i}|² / Δt  →  ∫_0^T ∫ |v|² dμ_t dt   (Δt → 0),

the Benamou–Brenier action of the discrete path with the plain (unit) metric: OT-Transformer's
∫‖v‖² dt.  For the projected Euler step x_{k+1} = (x_k + Δt v_k)/|x_k + Δt v_k| each term is
exactly (2 − 2/√(1 + Δt²|v_k|²))/Δt = Δt|v_k|² (1 + O(Δt²|v|²)); for a layer map, the step of the
map.  The feed-forward steps are not counted in either term.

The heads are rebuilt from the parameters in every forward, so a training loop of many
``backward()`` calls just works; heads built once outside the loop hold a graph that the first
``backward()`` frees (docs/training.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..utils.validation import DEFAULT_DIRECTION
from ..model.heads import Heads
from ..processes.nn import attention_modules
from ..processes.weights import Layerwise
from ..solvers.particle.methods import Dopri5, FixedStep
from ..solvers.tableaux import ADAPTIVE_ATOL, ADAPTIVE_RTOL, METHODS
from ..dynamics.model import Model
from ..solvers.options import LedgerOptions, SaveAt
from ..solvers.solve import solve
from ..utils.validation import check_bool, check_choice, check_int, check_positive, check_real

__all__ = ["MeanFieldAttention", "TransformerFlow"]

#: the layer maps the module steps ("none": the projected flow)
FLOW_LAYER_NORMS = ("none", "post", "pre")


class MeanFieldAttention(torch.nn.Module):
    """Self-attention in continuous depth: tokens on the sphere integrated through a solve (module docstring).

    Parameters
    ----------
    dim : int
        d, the token dimension.
    num_heads : int
        H; the head size is k = d // H (d must be a multiple of H) unless ``head_dim`` is given.
    layers : int
        L, the number of parameter slices (layers or knots) of Θ_t on [0, ``t1``].
    t1 : float
        T, the depth (final time).
    steps : int
        solver steps per layer (fixed-step methods; "adaptive": the record grid of the kinetic term).
    method : str
        "euler", "heun", "rk4" (backpropagation through the steps) or "adaptive" (dopri5,
        :class:`~transformer_pde.Dopri5`), the ``method=`` of :func:`transformer_pde.simulate`.
    adjoint : bool
        with "adaptive": gradients by torchdiffeq's adjoint ODE (memory flat in the number of steps).
    interpolation : str
        "constant" (layer l holds on its interval) or "linear" (knots at the layer starts).
    layer_norm : str
        "none" (projected flow), "post" or "pre" (the LayerNorm maps, Euler only), the ``layer_norm=`` of
        :func:`transformer_pde.simulate`.
    direction : str
        "ascent" (x + attention(x), the residual transformer) or "descent".
    head_dim : int or None
        k (default d // H).
    beta : float or None
        inverse temperature, any finite real (β ≤ 0: repulsive attention); None means d/√k, the scale of a
        MultiheadAttention fed LayerNorm'd tokens of norm √d.
    feedforward : int
        hidden width m of the feed-forward term (0: none).
    rtol, atol : float
        the tolerances of "adaptive" (default those of :class:`~transformer_pde.Dopri5`, 1e-7 and 1e-9); refused
        below the round-off of the tokens' dtype when the forward sees them.
    dtype, device
        of the parameters.

    Raises
    ------
    ValueError, TypeError
        bad sizes or options (before any parameter is made).

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> layer = tp.nn.MeanFieldAttention(8, 2, layers=2, t1=1.0, steps=2).double()
    >>> x = torch.nn.functional.normalize(torch.randn(3, 5, 8, dtype=torch.float64), dim=-1)
    >>> y, kinetic = layer(x, kinetic=True)
    >>> tuple(y.shape), tuple(kinetic.shape)
    ((3, 5, 8), (3,))
    >>> (y.norm(dim=-1) - 1).abs().max().item() < 1e-12
    True
    """

    def __init__(self, dim: int, num_heads: int, *, layers: int = 1, t1: float = 1.0, steps: int = 1,
                 method: str = "euler", adjoint: bool = False, interpolation: str = "constant",
                 layer_norm: str = "none", direction: str = DEFAULT_DIRECTION, head_dim: Optional[int] = None,
                 beta: Optional[float] = None, feedforward: int = 0, rtol: float = ADAPTIVE_RTOL,
                 atol: float = ADAPTIVE_ATOL,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        d, H = check_int(dim, "dim"), check_int(num_heads, "num_heads")
        if head_dim is None:
            if d % H:
                raise ValueError(f"dim = {d} is not a multiple of num_heads = {H}; pass head_dim= or choose H dividing d")
            head_dim = d // H
        k = check_int(head_dim, "head_dim")
        self.layers, self.steps = check_int(layers, "layers"), check_int(steps, "steps")
        self.t1 = check_positive(t1, "t1")
        self.method = check_choice(method, METHODS, "method")
        self.adjoint = check_bool(adjoint, "adjoint")
        if self.adjoint and self.method != "adaptive":
            raise ValueError(f"adjoint=True needs method='adaptive' (the adjoint ODE of torchdiffeq), got "
                             f"method={method!r}")
        self.interpolation = check_choice(interpolation, ("constant", "linear"), "interpolation")
        self.layer_norm = check_choice(layer_norm, FLOW_LAYER_NORMS, "layer_norm")
        if self.layer_norm != "none" and self.method != "euler":
            raise ValueError(f"layer_norm={layer_norm!r} is a layer map stepped by Euler; use method='euler' "
                             f"(or layer_norm='none' with method={method!r})")
        self.direction = check_choice(direction, ("ascent", "descent"), "direction")
        self.feedforward = check_int(feedforward, "feedforward", minimum=0)
        if self.feedforward and self.layer_norm == "pre":
            raise ValueError("feedforward with layer_norm='pre' is not available: the pre-LN radius is the solver's "
                             "state and would restart at every feed-forward step; use layer_norm 'none' or 'post'")
        if self.feedforward and self.interpolation == "linear":
            raise ValueError("feedforward acts between layers; use interpolation='constant' with it")
        self.beta = d / math.sqrt(k) if beta is None else check_real(beta, "beta")
        self.rtol, self.atol = check_positive(rtol, "rtol"), check_positive(atol, "atol")
        self.dim, self.num_heads, self.head_dim = d, H, k
        L, kw = self.layers, {"dtype": dtype, "device": device}
        self.query = torch.nn.Parameter(torch.empty(L, H, k, d, **kw))
        self.key = torch.nn.Parameter(torch.empty(L, H, k, d, **kw))
        self.value = torch.nn.Parameter(torch.empty(L, H, k, d, **kw))
        self.output = torch.nn.Parameter(torch.empty(L, H, d, k, **kw))
        if self.feedforward:
            m = self.feedforward
            self.ff_in = torch.nn.Parameter(torch.empty(L, m, d, **kw))
            self.ff_bias = torch.nn.Parameter(torch.empty(L, m, **kw))
            self.ff_out = torch.nn.Parameter(torch.empty(L, d, m, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections (as ``MultiheadAttention``'s packed in_proj and out_proj),
        uniform(±1/√fan_in) feed-forward weights and zero feed-forward bias (as ``torch.nn.Linear``)."""
        d = self.dim
        bound = math.sqrt(6.0 / (d + d))
        for p in (self.query, self.key, self.value, self.output):
            torch.nn.init.uniform_(p, -bound, bound)
        if self.feedforward:
            torch.nn.init.uniform_(self.ff_in, -1 / math.sqrt(d), 1 / math.sqrt(d))
            torch.nn.init.uniform_(self.ff_out, -1 / math.sqrt(self.feedforward), 1 / math.sqrt(self.feedforward))
            torch.nn.init.zeros_(self.ff_bias)

    # ------------------------------------------------------------------ heads and solves
    def heads(self, layer: int) -> Heads:
        """The heads of layer ``layer``, built from the current parameters (a new graph every call)."""
        ones = torch.ones(self.num_heads, dtype=self.query.dtype, device=self.query.device)
        return Heads.from_qkv(self.query[layer], self.key[layer], self.value[layer], self.output[layer],
                              beta=self.beta, weights=ones, keep_factors=self.head_dim < self.dim)

    def theta(self, layers: Optional[range] = None) -> Layerwise:
        """Θ_t of the given layers (default all) as a Layerwise process starting at the first one's time."""
        layers = range(self.layers) if layers is None else layers
        dl = self.t1 / self.layers
        return Layerwise([self.heads(l) for l in layers], interpolation=self.interpolation, layer_time=dl,
                         t0=layers[0] * dl)

    def _solver(self):
        if self.method == "adaptive":
            return Dopri5(rtol=self.rtol, atol=self.atol, adjoint=self.adjoint)
        return FixedStep(self.method)

    def _pieces(self):
        """(layers, t0, t1) of each solve: one over [0, T], or one per layer with a feed-forward term."""
        dl = self.t1 / self.layers
        if not self.feedforward:
            return [(range(self.layers), 0.0, self.t1)]
        return [(range(l, l + 1), l * dl, (l + 1) * dl) for l in range(self.layers)]

    def _displacement(self, traj, weights, dt):
        """Σ_k Σ_i w_i |x_{k+1,i} − x_{k,i}|² / Δt over the recorded (every) steps of one solve, (...,)."""
        step = (traj.x[1:] - traj.x[:-1]).square().sum(-1)  # (K, ..., n)
        w = 1.0 / traj.x.shape[-2] if weights is None else weights
        return (step * w).sum(-1).sum(0) / dt

    def _solve(self, x, piece, weights, *, diagnostics: bool, kinetic: bool, every: Optional[int]):
        layers, t0, t1 = piece
        dt = (t1 - t0) / (self.steps * len(layers))
        model = Model(self.theta(layers), normalization="softmax", direction=self.direction, layer_norm=self.layer_norm,
                      weights=weights)
        # a fixed energy scale c = 0: the values are the plain ones, comparable across batches.  The kinetic
        # term ∫𝒢² dt (every step, also between the records): the fixed-step solvers accumulate it from the
        # step's own field (kinetic=True; the diagnostics, if asked, from the records); dopri5 from its ledger,
        # the trapezoid rule on the record grid, which must then be the whole dt grid
        adaptive = self.method == "adaptive"
        ledger = LedgerOptions(diagnostics=diagnostics or (kinetic and adaptive), ledger=kinetic and adaptive,
                               kinetic=kinetic and not adaptive,
                               energy_log_scale=0.0 if (diagnostics or kinetic) else None)
        if every is None:
            every = 1 if (kinetic and adaptive) else None
        saveat = SaveAt(ends=True) if every is None else SaveAt(record_every=every)
        extra = {} if adaptive else {"progress": False}
        return solve(model, x, self._solver(), t0=t0, t1=t1, dt=dt, saveat=saveat, ledger=ledger, **extra)

    def _feedforward(self, x, layer: int):
        dl = self.t1 / self.layers
        h = torch.nn.functional.gelu(x @ self.ff_in[layer].transpose(-1, -2) + self.ff_bias[layer])
        y = x + dl * (h @ self.ff_out[layer].transpose(-1, -2))
        return y / y.norm(dim=-1, keepdim=True)

    def _check(self, x, weights):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor (..., n, d), got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor of unit tokens (..., n, d), got dtype {x.dtype}; "
                            f"convert it (x.to(torch.float32) or the module's dtype) and normalise it to the sphere")
        if x.dim() < 2 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (..., n, {self.dim}) (d = dim = {self.dim}), got {tuple(x.shape)}")
        ref = self._reference()
        if x.dtype != ref.dtype or x.device != ref.device:
            raise ValueError(f"x is {x.dtype} on {x.device} but the module's parameters are {ref.dtype} on "
                             f"{ref.device}; convert one of them (module.to(x) or x.to(...))")

    def _reference(self) -> torch.Tensor:
        return self.query

    def forward(self, x: torch.Tensor, *, weights: Optional[torch.Tensor] = None, kinetic=False):
        """Carry tokens x (..., n, d) on the unit sphere from depth 0 to T.

        Parameters
        ----------
        x : torch.Tensor
            tokens (..., n, d), |x_i| = 1 (normalise with ``x / x.norm(dim=-1, keepdim=True)``).
        weights : torch.Tensor or None
            token weights (..., n) summing to 1, or None (uniform).
        kinetic : bool or str
            also return a kinetic term (...,) (module docstring): True or "metric" for ∫_0^T 𝒢² dt,
            the ledger's "slope" term (accumulated from the steps' own field evaluations,
            ``LedgerOptions(kinetic=True)``); "displacement" for Σ_k Σ_i w_i |x_{k+1,i} − x_{k,i}|²/Δt,
            the action of its steps (fixed-step solvers only).

        Returns
        -------
        torch.Tensor or tuple
            the tokens at depth T (..., n, d), and with ``kinetic`` the kinetic term (...,).
        """
        self._check(x, weights)
        mode = self._kinetic_mode(kinetic)
        kin = None
        for piece in self._pieces():
            traj = self._solve(x, piece, weights, diagnostics=False, kinetic=mode == "metric",
                               every=1 if mode == "displacement" else None)
            x = traj.final
            if mode is not None:
                dt = (piece[2] - piece[1]) / (self.steps * len(piece[0]))
                k = traj.kinetic[-1] if mode == "metric" else self._displacement(traj, weights, dt)
                kin = k if kin is None else kin + k
            if self.feedforward:
                x = self._feedforward(x, piece[0][0])
        return (x, kin) if kinetic else x

    def _kinetic_mode(self, kinetic):
        if kinetic is False or kinetic is None:
            return None
        if kinetic is True:
            return "metric"
        if kinetic not in ("metric", "displacement"):
            raise ValueError(f"kinetic must be False, True / 'metric' (∫𝒢²dt from the ledger) or 'displacement' "
                             f"(the action of the solver's steps), got {kinetic!r}")
        if kinetic == "displacement" and self.method == "adaptive":
            raise ValueError("kinetic='displacement' sums the fixed steps of the solver; with method='adaptive' use "
                             "kinetic='metric'")
        return kinetic

    def trajectory(self, x: torch.Tensor, *, weights: Optional[torch.Tensor] = None, every: int = 1) -> dict:
        """The tokens and the diagnostics along depth (for analysis; differentiable, wrap in ``torch.no_grad``).

        Parameters
        ----------
        x : torch.Tensor
            tokens (..., n, d) on the unit sphere.
        weights : torch.Tensor or None
            token weights or None.
        every : int
            keep every k-th solver step.

        Returns
        -------
        dict
            "times" (T,), "x" (T, ..., n, d), "energy", "slope" (𝒢²) and "dissipation" (𝒟), each (T, ...),
            "kinetic" (...,) = ∫𝒢² dt and "displacement" (...,), the action of the recorded steps
            (that of the solver's steps when ``every`` = 1); with a feed-forward term the pieces of the layers are
            concatenated (each layer boundary is recorded twice: before and after the feed-forward step).
        """
        self._check(x, weights)
        every = check_int(every, "every")
        parts, kin, act = [], None, None
        for piece in self._pieces():
            traj = self._solve(x, piece, weights, diagnostics=True, kinetic=True, every=every)
            parts.append({"times": traj.times, "x": traj.x, "energy": traj.energy, "slope": traj.slope,
                          "dissipation": traj.dissipation})
            k = traj.kinetic[-1]
            kin = k if kin is None else kin + k
            a = self._displacement(traj, weights, every * (piece[2] - piece[1]) / (self.steps * len(piece[0])))
            act = a if act is None else act + a
            x = traj.final
            if self.feedforward:
                x = self._feedforward(x, piece[0][0])
        out = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        out["kinetic"], out["displacement"] = kin, act
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, layers={self.layers}, "
                f"t1={self.t1:g}, steps={self.steps}, method={self.method!r}, adjoint={self.adjoint}, "
                f"layer_norm={self.layer_norm!r}, feedforward={self.feedforward}")


class TransformerFlow(MeanFieldAttention):
    """The attention layers of a torch model as a flow in depth, their heads read again in every forward.

    Wraps ``model`` — anything :func:`~transformer_pde.processes.nn.attention_modules` accepts: a
    ``torch.nn.TransformerEncoder``, a list or ``ModuleList`` of ``MultiheadAttention`` modules or of
    layers with ``self_attn`` — as a submodule (its parameters are this module's) and, in every
    forward, converts its attention layers with
    :meth:`~transformer_pde.Heads.from_multihead_attention` (layer l holds on
    [l·Δ, (l+1)·Δ), Δ = ``layer_time``) and solves, like :class:`MeanFieldAttention` (same forward,
    kinetic terms and trajectory).  So a training loop may call ``backward()`` on every step: the
    heads are never reused across graphs.  What the conversion keeps and drops (the MLP, LayerNorm's
    affine parameters, biases): docs/training.md.

    Parameters
    ----------
    model : torch.nn.Module or list
        the attention layers.
    layer_time : float
        Δ, the depth of one layer (T = L·Δ).
    steps : int
        solver steps per layer.
    token_norm : float
        r, the norm of the tokens the layers see (√d after a LayerNorm without affine parameters): β = r²/√k.
    bias : str
        "warn", "drop" or "error" for the biases the model cannot represent
        (:meth:`~transformer_pde.Heads.from_multihead_attention`).
    head_weights : str
        "sum" (MHA(x) = Σ_h f_h exactly) or "mean".
    method, adjoint, interpolation, layer_norm, direction, rtol, atol
        as for :class:`MeanFieldAttention`.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64)
    >>> flow = tp.nn.TransformerFlow(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), steps=2)
    >>> x = torch.nn.functional.normalize(torch.randn(3, 5, 8, dtype=torch.float64), dim=-1)
    >>> for _ in range(2):                                    # two backward passes: the heads are rebuilt
    ...     flow(x).sum().backward()
    >>> tuple(flow(x).shape)
    (3, 5, 8)
    """

    def __init__(self, model, *, layer_time: float = 1.0, steps: int = 1, token_norm: float = 1.0,
                 bias: str = "warn", head_weights: str = "sum", method: str = "euler", adjoint: bool = False,
                 interpolation: str = "constant", layer_norm: str = "none", direction: str = DEFAULT_DIRECTION,
                 rtol: float = ADAPTIVE_RTOL, atol: float = ADAPTIVE_ATOL):
        mods = attention_modules(model)  # refuses what holds no attention layers (TypeError / ValueError)
        if any(not isinstance(m, torch.nn.Module) for m in mods):
            raise TypeError("TransformerFlow needs torch modules (their parameters are trained); a dict of heads "
                            "is fixed tensors: use tp.layerwise_from_transformer and tp.solve instead")
        first = mods[0].self_attn if hasattr(mods[0], "self_attn") else mods[0]
        d, H = first.embed_dim, first.num_heads
        layers = len(mods)
        super().__init__(d, H, layers=layers, t1=check_positive(layer_time, "layer_time") * layers, steps=steps,
                         method=method, adjoint=adjoint, interpolation=interpolation, layer_norm=layer_norm,
                         direction=direction, rtol=rtol, atol=atol, dtype=first.out_proj.weight.dtype,
                         device=first.out_proj.weight.device)
        for name in ("query", "key", "value", "output"):  # the wrapped model's parameters are the only ones
            delattr(self, name)
        self.model = model if isinstance(model, torch.nn.Module) else torch.nn.ModuleList(mods)
        self.convert = {"token_norm": check_positive(token_norm, "token_norm"),
                        "bias": check_choice(bias, ("warn", "drop", "error"), "bias"),
                        "head_weights": check_choice(head_weights, ("sum", "mean"), "head_weights")}
        self.beta = self.convert["token_norm"] ** 2 / math.sqrt(d // H)

    def reset_parameters(self) -> None:
        """Nothing to do: the parameters are the wrapped model's (its own initialisation)."""

    def _reference(self) -> torch.Tensor:
        return next(self.model.parameters())

    def heads(self, layer: int) -> Heads:
        """The heads of attention layer ``layer``, converted from the model's current parameters."""
        return Heads.from_multihead_attention(attention_modules(self.model)[layer], **self.convert)

    def extra_repr(self) -> str:
        return (f"layers={self.layers}, t1={self.t1:g}, steps={self.steps}, method={self.method!r}, "
                f"adjoint={self.adjoint}, layer_norm={self.layer_norm!r}, token_norm={self.convert['token_norm']:g}")
