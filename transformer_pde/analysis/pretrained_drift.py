"""The feed-forward rung: the ladder's "continuous" flow with the network's feed-forward kept, as a per-token
drift, through :func:`~transformer_pde.solve` (docs/pretrained.md).

The ladder's "continuous" rung (:func:`transformer_pde.pretrained.ladder`) is the projected mean-field flow
ẋ_i = P_{x_i} Σ_h f_h(x_i) on S^{d−1} with Θ_t piecewise constant per layer (the bias-free heads of
:func:`~transformer_pde.layerwise_from_pretrained`, tokens x = z/r on the sphere of radius r = √d).  It drops
the feed-forward.  Here it is kept, read from the network, as a drift of the same flow:

    ẋ_i = P_{x_i} [ Σ_h f_h(x_i) + F_l(r x_i)/r ],   l = ⌊t⌋ (layer time 1),

F_l(h) = W₂ φ(W₁ h + b₁) + b₂ the feed-forward of block l exactly as the network applies it
(:meth:`~transformer_pde.pretrained.LayerWeights.feed_forward`, its biases kept), read at the token r x_i on the
sphere of radius √d.  That is the input the "sphere" rungs give every sublayer: every LayerNorm is replaced by
the projection onto that sphere, so the feed-forward sees the normalised token without LayerNorm's gain γ and
bias b (as in the order-free ladder of :mod:`transformer_pde.analysis.pretrained_subsets` with "layernorm"
removed).  ``ff_input="affine"`` gives the feed-forward the token with the affine part of the block's first
LayerNorm, F_l(γ₁ ⊙ r x_i + b₁)/r: the network's own feed-forward input h = LN₁(·) with the normalisation
replaced by the sphere projection (mean-centring dropped) but its gain γ₁ and bias b₁ kept.  The rescaling by 1/r keeps the residual form: z ← z + dt·F(z) at the scale r of the tokens z = r x
is x ← x + dt·F(r x)/r at unit scale.  Attention and feed-forward act at once (the sum of the two fields), not
one after the other as the network's two sublayers (and the order-free ladder's Lie splitting) do.
Integrated by :class:`~transformer_pde.DriftEuler` (projected Euler, step ``dt``); with a feed-forward that
is zero it is the "continuous" rung to rounding.  Post-LN networks (the BERT family); rollout from the
embeddings only.

A LayerNorm variant (the post-LN geometry) is not here: the tokens of a LayerNorm live on the sphere of radius
√d in the hyperplane of mean-zero vectors and then pass the affine map x ↦ γ ⊙ x + b between the sublayers,
which is neither the unit sphere nor a map of tp.solve's layer geometries (those rescale a token along its own
direction), so it would not run through tp.solve as one flow.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..dynamics.model import Model
from ..model.backends import kernel_backend
from ..model.sphere import normalize
from ..processes.pretrained import PretrainedNetwork, layer_heads
from ..processes.weights import Layerwise
from ..solvers.options import LedgerOptions, SaveAt
from ..solvers.particle.drift import DriftEuler
from ..solvers.solve import solve

__all__ = ["FF_INPUTS", "feedforward_drift", "continuous_feedforward"]

#: what the feed-forward reads: the sphere token r x, or γ₁ ⊙ r x + b₁ (module docstring)
FF_INPUTS = ("sphere", "affine")

#: padded tokens per batch of sentences (larger batches are split over sentences), as the ladder's
_CHUNK_TOKENS = 2048


def _check_post_ln(net):
    if not isinstance(net, PretrainedNetwork):
        raise TypeError(f"net must be a PretrainedNetwork from tp.pretrained.load(...), got {type(net).__name__}")
    if net.norm != "post":
        raise ValueError("the feed-forward rung covers post-LN networks (the BERT family: BERT, RoBERTa, MiniLM), "
                         f"got a {net.norm}-LN network")


def feedforward_drift(net: PretrainedNetwork, *, layer_time: float = 1.0, ff_input: str = "sphere") -> Callable:
    """The drift b(t, x) = F_l(r x)/r of the network's feed-forward on the unit sphere (module docstring), or
    F_l(γ₁ ⊙ r x + b₁)/r with ``ff_input="affine"``.

    Parameters
    ----------
    net : PretrainedNetwork
        a post-LN network from :func:`transformer_pde.pretrained.load`.
    layer_time : float
        the time of one layer: block l = ⌊t/layer_time⌋ (clamped to 0 … L−1; the rule of
        :class:`~transformer_pde.Layerwise`).
    ff_input : str
        "sphere" (the token r x) or "affine" (γ₁ ⊙ r x + b₁, the block's first LayerNorm's gain and bias).

    Returns
    -------
    callable
        ``drift(t, x)``: x (..., d) unit tokens → (..., d), token-wise, in the network's dtype.

    Raises
    ------
    TypeError, ValueError
        net not a post-LN PretrainedNetwork; layer_time not positive; an unknown ff_input.
    """
    _check_post_ln(net)
    if ff_input not in FF_INPUTS:
        raise ValueError(f"ff_input must be one of {FF_INPUTS}, got {ff_input!r}")
    affine = ff_input == "affine"
    if isinstance(layer_time, bool) or not isinstance(layer_time, (int, float)) or not layer_time > 0:
        raise ValueError(f"layer_time must be a positive number, got {layer_time!r}")
    r = math.sqrt(net.dim)
    L = net.num_layers
    layers = list(net.layers)

    def drift(t, x):
        l = min(max(int(math.floor(float(t) / layer_time + 1e-12)), 0), L - 1)
        lw = layers[l]
        return lw.feed_forward(lw.norm1.gain * (r * x) + lw.norm1.bias if affine else r * x) / r

    return drift


def continuous_feedforward(net: PretrainedNetwork, states: torch.Tensor, mask: torch.Tensor, *,
                           dt: float = 0.1, ff_input: str = "sphere") -> torch.Tensor:
    """The rung "continuous + feed-forward" rolled out from the embeddings: one :func:`~transformer_pde.solve`
    of the continuous rung's model with :class:`~transformer_pde.DriftEuler` and :func:`feedforward_drift`.

    Parameters
    ----------
    net : PretrainedNetwork
        a post-LN network.
    states : torch.Tensor
        the real hidden states (L+1, B, n, d) from :func:`transformer_pde.pretrained.hidden_states` (only
        states[0], the embeddings, is read).
    mask : torch.Tensor
        (B, n) bool, True for real tokens (the token weights of the attention).
    dt : float
        the Euler step, 1/N for an integer N (steps per layer), as the ladder's.
    ff_input : str
        what the feed-forward reads, as :func:`feedforward_drift`.

    Returns
    -------
    torch.Tensor
        (L+1, B, n, d) on the sphere of radius √d; entry 0 is the projected embeddings.

    Raises
    ------
    TypeError, ValueError
        a pre-LN network, dt not 1/N, states or mask of the wrong shape, an unknown ff_input.
    """
    _check_post_ln(net)
    L, d = net.num_layers, net.dim
    if not isinstance(states, torch.Tensor) or states.dim() != 4 or states.shape[0] != L + 1 or states.shape[-1] != d:
        raise ValueError(f"states must be (L+1, B, n, d) = ({L + 1}, B, n, {d}) from hidden_states, got "
                         f"{tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != states.shape[1:3]:
        raise ValueError(f"mask must be a bool tensor (B, n) = {tuple(states.shape[1:3])}")
    if not bool(mask.any(-1).all()):
        raise ValueError("every sentence needs at least one real token (a row of mask is all False)")
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not 0 < dt <= 1 \
            or abs(1.0 / dt - round(1.0 / dt)) > 1e-9 * (1.0 / dt):
        raise ValueError(f"dt must be 1/N for an integer N >= 1 (steps per layer), got {dt!r}")
    r = math.sqrt(d)
    steps = round(1.0 / dt)
    process = Layerwise([layer_heads(lw, bias="drop", token_norm=r) for lw in net.layers], layer_time=1.0)
    solver = DriftEuler(feedforward_drift(net, ff_input=ff_input))
    run = dict(t1=float(L), dt=1.0 / steps, saveat=SaveAt(record_every=steps), ledger=LedgerOptions(diagnostics=False),
               progress=False)
    parts = []
    chunk = max(1, _CHUNK_TOKENS // states.shape[-2])
    with torch.no_grad(), kernel_backend("auto"):
        for s in range(0, states.shape[1], chunk):
            m = mask[s:s + chunk]
            w = m.to(states.dtype)
            model = Model(process, normalization="softmax", direction="ascent", layer_norm="none",
                          weights=w / w.sum(-1, keepdim=True), causal=net.causal)
            parts.append(r * solve(model, normalize(states[0, s:s + chunk]), solver, **run).x)
    return torch.cat(parts, 1)
