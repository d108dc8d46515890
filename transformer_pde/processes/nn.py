"""Heads Θ_t read from real attention layers (``torch.nn``), for use in training research.

A ``torch.nn.MultiheadAttention`` with embedding dimension d, H heads of size k = d/H and
projections W_Q, W_K, W_V (d×d, head h = rows hk … (h+1)k − 1) and W_O (d×d, head h =
columns hk … (h+1)k − 1) computes, for a query x and keys/values y_j (biases aside),

    MHA(x) = Σ_h W_{O,h} Σ_j softmax_j(⟨W_{Q,h} x, W_{K,h} y_j⟩ / √k) W_{V,h} y_j .

With tokens of norm r (r = 1 on the unit sphere; r = √d after a LayerNorm without affine
parameters) this is exactly the per-head softmax field of docs/model.md#fields for

    A_h = W_{Q,h}ᵀ W_{K,h},   V_h = W_{O,h} W_{V,h},   β = r²/√k,   ω_h = 1 ("sum"),

namely MHA(r x)/r = Σ_h f_h(x) on the uniform empirical measure of the tokens (uniform token
weights cancel in the softmax).  When k < d the factors Q_h = W_{Q,h}, K_h = W_{K,h} (k×d)
are kept (scores ⟨Q_h x, K_h y⟩ at cost O(k)); the value matrix V_h is formed (d×d).

What the model keeps of a transformer block
    per-head scores and values (the output projection folded into V_h); the softmax of each
    head; the heads summed (``head_weights="sum"``, exact) or averaged ("mean": ω_h = 1/H, the
    same flow slowed down by 1/H); the 1/√k scaling and the token norm (in β); layer
    normalisation as the sphere; the residual connection as a time step: one layer
    x ← normalise(x + α·MHA(x)) is one projected-Euler step of length α of the ascent flow
    ẋ = P_x Σ_h f_h(x) (up to O(α²): the block normalises x + α f, the flow moves along P_x f,
    see :func:`residual_attention_step`); depth as time (layer l acts on [t0 + lα, t0 + (l+1)α),
    :func:`layerwise_from_transformer`).

What it drops
    the feed-forward (MLP) sublayer; the biases (the key bias exactly, since it adds ⟨W_Q x, b_K⟩
    to every score of a row and cancels in the softmax; the query bias changes the scores by
    ⟨b_Q, W_K y⟩, a per-key offset the model has no place for; the value and output biases add
    the constant vector Σ_h W_{O,h} b_{V,h} + b_O to every output.  ``bias="warn"``, the default,
    drops non-zero ones with a UserWarning naming them, ``bias="drop"`` drops them silently,
    ``bias="error"`` refuses modules in which any of these is non-zero); the LayerNorm's
    mean-centring and affine γ, β (the sphere replaces it); dropout; attention masks (causal,
    padding: the model is full self-attention over the whole measure); ``add_bias_kv`` and
    ``add_zero_attn`` (extra keys); positional encodings (tokens are just points); pre- vs
    post-norm placement (both become "normalise after each residual step").

Everything here is differentiable: the Heads hold tensors computed from the module's
parameters, so gradients of a simulation flow back into the network (``detach=True`` cuts them).
Because they are computed tensors, heads built once and reused after a ``backward()`` hold a freed
graph (PyTorch's "backward through the graph a second time"): in a training loop build them again
in every forward, or use :class:`transformer_pde.nn.MeanFieldAttention`, which does.

Examples
--------
>>> import torch, transformer_pde as tp
>>> mha = torch.nn.MultiheadAttention(8, num_heads=2, bias=False).double()
>>> heads = tp.Heads.from_multihead_attention(mha)
>>> heads.num_heads, heads.dim, tuple(heads.query.shape)      # factors kept: k = 4 < d = 8
(2, 8, (2, 4, 8))
>>> x = tp.sphere.sample_uniform(5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
>>> out = mha(x, x, x, need_weights=False)[0]                    # (n, d), unbatched
>>> torch.allclose(out, tp.head_outputs(x, heads).sum(-3))
True
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..utils.validation import check_positive, check_tokens
from ..model.field import check_inputs
from ..model.heads import Heads, heads_from_multihead_attention, mha_module
from .weights import Layerwise
from ..model.sphere import normalize

__all__ = [
    "layerwise_from_transformer",
    "attention_modules",
    "attention_matrix",
    "residual_attention_step",
]

def attention_modules(model) -> list:
    """The self-attention modules of a model, in order of depth.

    Accepts a ``torch.nn.TransformerEncoder`` / ``TransformerDecoder`` (its ``.layers``), a
    ``torch.nn.Transformer`` (its encoder), a sequence (list, ``ModuleList``, ``Sequential``) of
    MultiheadAttention modules, layers with ``self_attn`` or dicts, or a single one of these."""
    if isinstance(model, Mapping) or mha_module(model) is not None:
        return [model]
    if isinstance(model, torch.nn.Transformer):
        model = model.encoder
    layers = getattr(model, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        model = layers
    if isinstance(model, (list, tuple, torch.nn.ModuleList, torch.nn.Sequential)):
        out = []
        for i, m in enumerate(model):
            if isinstance(m, Mapping) or mha_module(m) is not None:
                out.append(m)
            else:
                raise TypeError(f"layer {i} is a {type(m).__name__}: not a MultiheadAttention, a layer with .self_attn, or a dict")
        if not out:
            raise ValueError("the model holds no attention layers")
        return out
    raise TypeError(
        f"cannot find attention layers in a {type(model).__name__}; pass a TransformerEncoder, a list of layers, "
        f"MultiheadAttention modules or dicts"
    )


def layerwise_from_transformer(
    model,
    *,
    interpolation: str = "constant",
    layer_time: float = 1.0,
    t0: float = 0.0,
    **kwargs,
) -> Layerwise:
    """Θ_t from a stack of attention layers: layer l holds on [t0 + l·Δ, t0 + (l+1)·Δ), Δ = ``layer_time``.

    ``model``: anything :func:`attention_modules` accepts.  ``interpolation``: "constant"
    (piecewise constant, a residual network) or "linear" (scores, values, head weights and β
    interpolated between the layer starts).  Other keyword arguments go to
    :meth:`~transformer_pde.Heads.from_multihead_attention` (``head_weights``, ``token_norm``, ``dtype``, ...).

    With Δ = α and ``simulate(x0, theta, t1=t0 + Lα, dt=α, method="euler", direction="ascent")``
    each step is one idealised residual block x ← normalise(x + α·MHA(x)) up to O(α²).

    Returns
    -------
    Layerwise
        :class:`~transformer_pde.Layerwise`.
    """
    layers = [heads_from_multihead_attention(m, **kwargs) for m in attention_modules(model)]
    return Layerwise(layers, interpolation=interpolation, layer_time=layer_time, t0=t0)


def attention_matrix(x: torch.Tensor, heads: Heads, weights: Optional[torch.Tensor] = None, *,
                     keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-head attention weights p_ij^h = w_j e^{s_ij^h} / Σ_l w_l e^{s_il^h}, s_ij^h = β⟨x_i, A_h y_j⟩.

    Parameters
    ----------
    x : torch.Tensor
        queries (..., n, d) on the sphere.  keys: (..., m, d), default x.
    heads : Heads
        :class:`~transformer_pde.Heads` (factors used when kept).
    weights : Optional[torch.Tensor]
        key weights (..., m) or None (uniform: the plain softmax of a MultiheadAttention).

    Returns
    -------
    torch.Tensor
        (..., H, n, m), rows summing to 1 (log-sum-exp normalisation).  Compare with
        ``mha(..., need_weights=True, average_attn_weights=False)[1]``.
    """
    y = x if keys is None else keys
    heads = check_inputs(y, heads, weights)
    if keys is not None:
        check_tokens(x, "x")
    beta = heads.beta
    if isinstance(beta, torch.Tensor) and beta.dim() > 0:
        beta = beta[..., None, None, None]
    if heads.score is not None:
        S = (x.unsqueeze(-3) @ heads.score) @ y.unsqueeze(-3).transpose(-1, -2)
    else:
        S = (x.unsqueeze(-3) @ heads.query.transpose(-1, -2)) @ (y.unsqueeze(-3) @ heads.key.transpose(-1, -2)).transpose(-1, -2)
    S = beta * S
    if weights is not None:
        S = S + torch.log(weights).unsqueeze(-2).unsqueeze(-2)
    return torch.softmax(S, dim=-1)


def residual_attention_step(module, x: torch.Tensor, *, step: float = 1.0, token_norm: float = 1.0) -> torch.Tensor:
    """The idealised block the model keeps: x ← (x + α·MHA(r x)/r) / |x + α·MHA(r x)/r|.

    Runs the module itself (with its biases, if any) on tokens of norm r = ``token_norm``, adds
    the residual with step α and normalises back to the unit sphere.  With the heads of
    :meth:`~transformer_pde.Heads.from_multihead_attention` (same ``token_norm``, ``head_weights="sum"``) and no
    biases this is x ↦ normalise(x + α Σ_h f_h(x)), one projected-Euler step of the ascent flow
    up to O(α²).

    Parameters
    ----------
    module
        a MultiheadAttention or a layer with ``self_attn`` (only its attention is used).
    x : torch.Tensor
        unit tokens (n, d) or (B, n, d) (the batch layout follows ``module.batch_first``).

    Returns
    -------
    torch.Tensor
        Tokens of the same shape on the unit sphere.
    """
    mha = mha_module(module)
    if mha is None:
        raise TypeError(f"expected a MultiheadAttention or a layer with .self_attn, got {type(module).__name__}")
    check_tokens(x, "x")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be (n, d) or (B, n, d), got shape {tuple(x.shape)}")
    step = check_positive(step, "step", allow_zero=True)
    r = check_positive(token_norm, "token_norm")
    z = r * x
    if x.dim() == 3 and not mha.batch_first:
        z = z.transpose(0, 1)
    out = mha(z, z, z, need_weights=False)[0]
    if x.dim() == 3 and not mha.batch_first:
        out = out.transpose(0, 1)
    return normalize(x + step * out / r)
