"""Real pretrained transformers through the mean-field lens: the network's own block as a map, and the
ladder that removes one ingredient at a time on the way to the PDE (docs/pretrained.md).

    import transformer_pde as tp
    net = tp.pretrained.load(tp.pretrained.packaged_minilm())
    states, mask = tp.pretrained.hidden_states(net, ["a sentence", "another one"])
    preds = tp.pretrained.ladder(net, states, mask, mode="rollout")
    tp.pretrained.cloud_distances(preds["continuous"], states, mask)

The rungs, each a map of the tokens through the L layers (``mode="rollout"``: from the embeddings
hidden_states[0]; ``mode="local"``: one layer from the network's own input hidden_states[l]):

* "network": the network's block, exact to rounding.  Post-LN (BERT family):
  h = LN₁(x + MHA(x)), x ← LN₂(h + FF(h)); pre-LN (GPT-2, ViT): h = x + MHA(LN₁(x)),
  x ← h + FF(LN₂(h)) (GPT-2's last hidden state also passes its final LayerNorm).
* "no_feedforward": the same without FF.
* "sphere": every LayerNorm (mean-centring, variance, gain γ, bias b) replaced by the projection
  x ↦ √d·x/|x| onto the sphere of radius √d; attention biases kept.  Post-LN: the map the
  reference simulators iterate, x ← √d·normalise(x̂ + MHA(x̂)), x̂ = √d·normalise(x); pre-LN:
  z ← z + MHA(√d·normalise(z)) (the residual stream keeps its radius).
* "no_bias": "sphere" with the query, key, value and output biases dropped.  For post-LN this is
  one step of :class:`~transformer_pde.PostLN` with :class:`~transformer_pde.Euler`, Δt = 1, on the
  heads of :func:`~transformer_pde.layerwise_from_pretrained` (run through :func:`~transformer_pde.solve`).
* "continuous": Δt → 0 with Θ_t piecewise constant per layer (layer time 1): the projected
  mean-field flow ẋ_i = P_{x_i} Σ_h f_h(x_i) on S^{d−1} with softmax heads, token weights = the
  padding mask, causal for GPT-2, one batched :func:`~transformer_pde.solve` (Euler, step ``dt``).
  For pre-LN networks it also drops the per-token speed 1/r of the residual stream.

Distances (:func:`cloud_distances`): per layer, the tokens of each sentence normalised to the unit
sphere, the exact W₂ between the predicted and the real clouds (POT ``ot.emd2``, uniform weights,
cost |x − y|²), and the mean angle between matched tokens (same position); means over sentences.
"""

from __future__ import annotations

import math
import weakref
from typing import Mapping, Sequence

import torch

from ..model.backends import kernel_backend
from ..model.field import head_outputs
from ..model.heads import Heads
from ..model.sphere import normalize, tangent_projection
from ..processes.model_files import check_texts, check_token_ids, max_positions
from ..processes.pretrained import (
    FAMILIES, MINILM_PIP, MINILM_SHA256, LayerWeights, Norm, PretrainedNetwork, layer_heads, layerwise_from_pretrained,
    load, packaged_minilm,
)
from ..processes.weights import Constant, Layerwise
from ..solvers.particle.methods import Euler
from ..dynamics.model import Model
from ..solvers.options import LedgerOptions, SaveAt
from ..solvers.solve import solve

__all__ = ["RUNGS", "MODES", "FAMILIES", "MINILM_SHA256", "MINILM_PIP", "Norm", "LayerWeights", "PretrainedNetwork",
           "load", "packaged_minilm", "layer_heads", "layerwise_from_pretrained", "hidden_states",
           "attention_probabilities", "attention_block", "layer_map", "ladder", "cloud_distances",
           "homogeneous_outputs", "homogeneous_velocity"]

#: the ladder from the network to the PDE, one ingredient removed per rung (module docstring)
RUNGS = ("network", "no_feedforward", "sphere", "no_bias", "continuous")
MODES = ("rollout", "local")
# tp.solve's kernel for the continuous and post-LN rungs: value-factored heads take the values-first kernel
# (model.values.softmax_values, width k = 32 instead of d = 384); "auto" runs it on torch's fused CPU
# flash-attention op where that applies, else on plain torch
_BACKEND = "auto"


def _check_net(net):
    if not isinstance(net, PretrainedNetwork):
        raise TypeError(f"net must be a PretrainedNetwork from tp.pretrained.load(...), got {type(net).__name__}")


def hidden_states(net: PretrainedNetwork, texts_or_batch, *, max_length: int = 64):
    """The network's own hidden states, by its forward pass (no gradients).

    Parameters
    ----------
    net : PretrainedNetwork
        from :func:`load`.
    texts_or_batch
        a string or a list of strings (tokenised with ``net.tokenizer``, padded on the right, truncated to
        ``max_length``), a mapping of model inputs (``input_ids``/``attention_mask``, or ``pixel_values``
        for ViT), or a tensor of input ids (pixel values for ViT).
    max_length : int
        the longest token sequence kept.

    Returns
    -------
    tuple
        states ``(L+1, B, n, d)`` (index 0: the embeddings; GPT-2's last includes its final LayerNorm) and
        mask ``(B, n)`` bool (True for real tokens).

    Raises
    ------
    TypeError, ValueError
        an unknown input type; texts without a tokenizer; an empty list.
    """
    _check_net(net)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    if isinstance(texts_or_batch, str):
        texts_or_batch = [texts_or_batch]
    if isinstance(texts_or_batch, (list, tuple)):
        if not texts_or_batch or not all(isinstance(t, str) for t in texts_or_batch):
            raise ValueError("give a non-empty list of strings (or a mapping of model inputs)")
        if net.tokenizer is None:
            raise ValueError("this network has no tokenizer (the folder had no tokenizer.json); pass token ids or "
                             "load(model, tokenizer=...)")
        check_texts(texts_or_batch)
        tok = net.tokenizer
        if tok.pad_token is None:  # GPT-2's tokenizer has none: pad with end-of-text, masked out anyway
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        batch = dict(tok(list(texts_or_batch), padding=True, truncation=True, max_length=max_length,
                         return_tensors="pt"))
        limit = max_positions(net.model.config)
        if limit is not None and batch["input_ids"].shape[-1] > limit:
            raise ValueError(f"the texts are up to {batch['input_ids'].shape[-1]} tokens long (max_length = "
                             f"{max_length}), beyond the {limit} positions of the network's position embeddings; give "
                             f"max_length <= {limit}")
    elif isinstance(texts_or_batch, Mapping):
        batch = dict(texts_or_batch)
    elif isinstance(texts_or_batch, torch.Tensor):
        batch = {"pixel_values" if net.family == "vit" else "input_ids": texts_or_batch}
    else:
        raise TypeError(f"texts_or_batch must be text(s), a mapping of model inputs or a tensor, got "
                        f"{type(texts_or_batch).__name__}")
    device = next(net.model.parameters()).device
    if "input_ids" in batch:
        check_token_ids(net.model.config, batch["input_ids"])
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    if net.family == "vit" and "pixel_values" in batch:
        batch["pixel_values"] = batch["pixel_values"].to(net.dtype)
    with torch.no_grad():
        out = net.model(**batch, output_hidden_states=True)
    states = torch.stack(tuple(out.hidden_states))
    mask = batch.get("attention_mask")
    mask = (torch.ones(states.shape[1:3], dtype=torch.bool, device=states.device) if mask is None
            else mask.to(device=states.device, dtype=torch.bool))
    return states, mask


def _check_layer_inputs(net, layer, x, mask):
    _check_net(net)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < net.num_layers:
        raise ValueError(f"layer must be an int in [0, {net.num_layers}), got {layer!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != net.dim:
        raise ValueError(f"x must be a tensor (B, n, {net.dim}), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != net.dtype:
        raise TypeError(f"x is {x.dtype} but the network is {net.dtype}; load(..., dtype={x.dtype}) or convert x")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != x.shape[:2]:
        raise ValueError(f"mask must be a bool tensor (B, n) = {tuple(x.shape[:2])}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if not bool(mask.any(-1).all()):
        raise ValueError("every sequence needs at least one real token (a mask row is all False)")


def _key_weights(mask: torch.Tensor, dtype) -> torch.Tensor:
    w = mask.to(dtype)
    return w / w.sum(-1, keepdim=True)


def _attention_mask(net, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, n|1, n) bool: key j is seen by query i (a real token; j <= i for a causal network)."""
    allowed = mask[:, None, None, :]
    if net.causal:
        n = mask.shape[-1]
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return allowed


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: padded tokens per batch of the discrete rungs (larger batches are split over sentences)
_CHUNK_TOKENS = 2048


def _layer_heads(lw, bias: str, r: float):
    """layer_heads(lw, bias=bias, token_norm=r), built (and validated) once per block, bias and r: the block's
    weights are frozen, and the ladder, the probabilities and the Lipschitz estimate ask for the same heads
    at every call."""
    try:
        cache = _HEADS.setdefault(lw, {})
    except TypeError:  # a block that cannot be referenced weakly: build every time
        return layer_heads(lw, bias=bias, token_norm=r)
    key = (bias, float(r))
    if key not in cache:
        cache[key] = layer_heads(lw, bias=bias, token_norm=r)
    return cache[key]


def _features(u, factors):
    """(F_h u_i) of all heads as one product: u (B, n, d'), factors (H', k, d') → (B, H', n, k)."""
    Hp, k, dp = factors.shape
    return torch.nn.functional.linear(u, factors.reshape(Hp * k, dp)).unflatten(-1, (Hp, k)).transpose(-2, -3)


def _attention(net, layer, z, mask, bias: bool, r: float = 1.0):
    """MHA(z) (B, n, d) of block ``layer`` on the tokens z it reads, from the heads' factors: per head the
    query, key and value features at width k (Q̃_h ũ, K̃_h ũ, W̃_{V,h} ũ; ũ = z/r, or (z/r, 1) with the
    biases), one fused softmax-attention over the real (and, causal, earlier) keys, and the output factors
    of all heads as one product; r: the token norm the heads are built for."""
    heads = _layer_heads(net.layers[layer], "keep" if bias else "drop", r)
    u = z / r
    if bias:
        u = torch.cat([u, torch.ones_like(u[..., :1])], -1)
    q, k, v = (_features(u, f) for f in (heads.query, heads.key, heads.value_in))  # (B, H', n, k) each
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_attention_mask(net, mask),
                                                         scale=float(heads.beta))
    # Σ_h ω_h O_h o_h: the heads' output factors stacked into one (H'·k, d') matrix
    Hp, kk = o.shape[-3], o.shape[-1]
    W = (heads.weights[:, None, None] * heads.value_out).transpose(-1, -2).reshape(Hp * kk, -1)
    out = o.transpose(-2, -3).reshape(*o.shape[:-3], o.shape[-2], Hp * kk) @ W
    return r * out[..., :net.dim]


def _reads(net, layer, x):
    """The tokens the attention of block ``layer`` reads from its input x (pre-LN: LN₁(x))."""
    return net.layers[layer].norm1(x) if net.norm == "pre" else x


def attention_block(net: PretrainedNetwork, layer: int, x: torch.Tensor, mask: torch.Tensor, *,
                    bias: bool = True) -> torch.Tensor:
    """The attention sublayer of block ``layer`` incl. the output projection, before the residual and the
    LayerNorm: MHA(x) (post-LN) or MHA(LN₁(x)) (pre-LN), computed from the heads (module docstring of
    :mod:`transformer_pde.processes.pretrained`), not by the transformers module.

    Parameters
    ----------
    net : PretrainedNetwork
        from :func:`load`.
    layer : int
        the block, 0 ≤ layer < L.
    x : torch.Tensor
        the block's input (B, n, d), e.g. ``hidden_states(net, ...)[0][layer]``.
    mask : torch.Tensor
        (B, n) bool, True for real tokens (padding gets zero attention).
    bias : bool
        keep the query, key, value and output biases (exact) or drop them.

    Returns
    -------
    torch.Tensor
        (B, n, d).
    """
    _check_layer_inputs(net, layer, x, mask)
    return _attention(net, layer, _reads(net, layer, x), mask, bias)


def attention_probabilities(net: PretrainedNetwork, layer: int, x: torch.Tensor, mask: torch.Tensor, *,
                            bias: bool = True) -> torch.Tensor:
    """p^h_ij = w_j e^{s^h_ij} / Σ_l w_l e^{s^h_il}, s^h_ij = β⟨Q̃_h x̃_i, K̃_h x̃_j⟩ from the heads of block
    ``layer`` (bias: homogeneous coordinates x̃ = (x, 1)), w the padding mask, causal for GPT-2.

    Parameters
    ----------
    net, layer, x, mask, bias
        as :func:`attention_block`.

    Returns
    -------
    torch.Tensor
        (B, H, n, n), rows summing to 1; compare with ``output_attentions=True`` of the eager network.
    """
    _check_layer_inputs(net, layer, x, mask)
    heads = _layer_heads(net.layers[layer], "keep" if bias else "drop", 1.0)
    u = _reads(net, layer, x)
    if bias:
        u = torch.cat([u, torch.ones_like(u[..., :1])], -1)
    H = net.num_heads
    qf, kf = _features(u, heads.query[:H]), _features(u, heads.key[:H])  # (B, H, n, k)
    s = heads.beta * (qf @ kf.transpose(-1, -2))
    return torch.softmax(s.masked_fill(~_attention_mask(net, mask), -math.inf), dim=-1)


def _homogeneous(x, heads, weights, causal):
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be tp.Heads (layer_heads(..., bias='keep')), got {type(heads).__name__}")
    if heads.dim != x.shape[-1] + 1:
        raise ValueError(f"the bias-keeping heads act on (x, 1) in R^{{d+1}}: heads of dim {heads.dim} need tokens "
                         f"of dim {heads.dim - 1}, got x of shape {tuple(x.shape)}; pass the tokens without the "
                         f"homogeneous coordinate")
    xt = torch.cat([x, torch.ones_like(x[..., :1])], -1) / math.sqrt(2.0)  # on the unit sphere of R^{d+1}
    # ⟨Q̃ x̃, K̃ x̃⟩ = 2⟨Q̃ x̃/√2, K̃ x̃/√2⟩: β doubled on the scaled tokens; the values are linear in x̃
    out = math.sqrt(2.0) * head_outputs(xt, heads.replace(beta=2 * heads.beta), weights, causal=causal)
    return out[..., :-1]


def homogeneous_outputs(x: torch.Tensor, heads: Heads, weights=None, *, causal: bool = False) -> torch.Tensor:
    """The per-head outputs f_h(x̃_i) of bias-keeping heads (``layer_heads(..., bias="keep")``,
    ``layerwise_from_pretrained(..., bias="keep")``) at the homogeneous tokens x̃ = (x, 1), first d coordinates
    (the last is 0 for every head).  ``tp.head_outputs`` reads tokens on the unit sphere and refuses (x, 1); it
    is called here on x̃/√2 with β doubled, which gives the same scores, and the outputs are scaled back.

    Parameters
    ----------
    x : torch.Tensor
        unit tokens (..., n, d) (z/r of the network's tokens z, r the heads' token norm).
    heads : Heads
        H + 1 heads on R^{d+1}.
    weights : torch.Tensor, optional
        token weights (..., n) (None: uniform), as :func:`transformer_pde.head_outputs`.
    causal : bool
        attend to earlier tokens only (GPT-2).

    Returns
    -------
    torch.Tensor
        (..., H + 1, n, d); summed over heads with ω = 1 it is MHA(r x)/r with the biases.

    Raises
    ------
    TypeError, ValueError
        heads not a Heads, or not of dimension d + 1; what :func:`transformer_pde.head_outputs` refuses.
    """
    return _homogeneous(x, heads, weights, causal)


def homogeneous_velocity(x: torch.Tensor, heads: Heads, weights=None, *, causal: bool = False) -> torch.Tensor:
    """The projected field P_x Σ_h ω_h f_h(x̃) on S^{d−1} of bias-keeping heads (the route ``tp.velocity``
    cannot take for homogeneous tokens: :func:`homogeneous_outputs`, summed over heads with their weights,
    projected on the tangent space of x).

    Parameters
    ----------
    x, heads, weights, causal
        as :func:`homogeneous_outputs`.

    Returns
    -------
    torch.Tensor
        (..., n, d), tangent at x.
    """
    out = _homogeneous(x, heads, weights, causal)
    return tangent_projection(x, (heads.weights[:, None, None].to(out.dtype) * out).sum(-3))


def _sphere(x: torch.Tensor) -> torch.Tensor:
    return math.sqrt(x.shape[-1]) * normalize(x)


def layer_map(net: PretrainedNetwork, layer: int, x: torch.Tensor, mask: torch.Tensor, *,
              rung: str = "network") -> torch.Tensor:
    """One block of a discrete rung ("network", "no_feedforward", "sphere", "no_bias"; module docstring)
    applied to x (B, n, d); returns (B, n, d)."""
    _check_layer_inputs(net, layer, x, mask)
    if rung not in RUNGS[:4]:
        raise ValueError(f"rung must be one of {RUNGS[:4]} for one block (the continuous rung is a flow: ladder), "
                         f"got {rung!r}")
    lw = net.layers[layer]
    last = layer == net.num_layers - 1
    if rung in ("network", "no_feedforward"):
        ff = rung == "network"
        a = _attention(net, layer, _reads(net, layer, x), mask, True)
        if net.norm == "post":
            h = lw.norm1(x + a)
            y = lw.norm2(h + lw.feed_forward(h)) if ff else lw.norm2(h)
        else:
            h = x + a
            y = h + lw.feed_forward(lw.norm2(h)) if ff else h
        return net.final_norm(y) if (last and net.final_norm is not None) else y
    bias = rung == "sphere"
    r = math.sqrt(net.dim)
    if net.norm == "post":
        z = _sphere(x)
        return _sphere(z + _attention(net, layer, z, mask, bias, r))
    y = x + _attention(net, layer, _sphere(x), mask, bias, r)
    return _sphere(y) if (last and net.final_norm is not None) else y


def _check_states(net, states, mask):
    _check_net(net)
    L = net.num_layers
    if not isinstance(states, torch.Tensor) or states.dim() != 4 or states.shape[0] != L + 1 \
            or states.shape[-1] != net.dim:
        raise ValueError(f"states must be (L+1, B, n, d) = ({L + 1}, B, n, {net.dim}) from hidden_states, got "
                         f"{tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__}")
    _check_layer_inputs(net, 0, states[0], mask)
    if not bool(torch.isfinite(states[:, mask]).all()):  # a rung from NaN tokens would be NaN throughout
        raise ValueError("states hold NaN/inf at real tokens; pass the hidden states of hidden_states(...)")


def _continuous(net, states, mask, dt: float, mode: str):
    """The projected mean-field flow with Θ_t piecewise constant per layer (Euler, step dt), (L+1, B, n, d)."""
    L = net.num_layers
    r = math.sqrt(net.dim)
    steps = round(1.0 / dt)
    w = _key_weights(mask, states.dtype)
    layers = [_layer_heads(lw, "drop", r) for lw in net.layers]
    opts = dict(normalization="softmax", direction="ascent", layer_norm="none", weights=w, causal=net.causal)
    run = dict(dt=1.0 / steps, saveat=SaveAt(record_every=steps), ledger=LedgerOptions(diagnostics=False), progress=False)
    with kernel_backend(_BACKEND):
        if mode == "rollout":
            traj = solve(Model(Layerwise(layers, layer_time=1.0), **opts), normalize(states[0]), Euler(),
                         t1=float(L), **run)
            return r * traj.x
        outs = [states[0]]
        for l in range(L):
            traj = solve(Model(Constant(layers[l]), **opts), normalize(states[l]), Euler(), t1=1.0, **run)
            outs.append(r * traj.x[-1])
    return torch.stack(outs)


def _post_no_bias_rollout(net, states, mask):
    """The post-LN "no_bias" rollout through tp.solve: PostLN geometry, Euler, Δt = 1 (one step per layer)."""
    r = math.sqrt(net.dim)
    layers = [_layer_heads(lw, "drop", r) for lw in net.layers]
    model = Model(Layerwise(layers, layer_time=1.0), normalization="softmax", direction="ascent", layer_norm="post",
                  weights=_key_weights(mask, states.dtype), causal=net.causal)
    with kernel_backend(_BACKEND):
        traj = solve(model, normalize(states[0]), Euler(), t1=float(net.num_layers), dt=1.0, saveat=SaveAt(record_every=1),
                     ledger=LedgerOptions(diagnostics=False), progress=False)
    out = r * traj.x
    return torch.cat([states[:1], out[1:]])


def ladder(net: PretrainedNetwork, states: torch.Tensor, mask: torch.Tensor, *, rungs: Sequence[str] = RUNGS,
           dt: float = 0.1, mode: str = "rollout") -> dict:
    """The tokens of each rung of the ladder from the network to the PDE (module docstring).

    Parameters
    ----------
    net : PretrainedNetwork
        from :func:`load`.
    states : torch.Tensor
        the real hidden states (L+1, B, n, d) and mask (B, n) bool, from :func:`hidden_states`.
    mask : torch.Tensor
        (B, n) bool.
    rungs : Sequence[str]
        a subset of :data:`RUNGS`.
    dt : float
        the Euler step of the continuous rung (1/dt an integer number of steps per layer).  The default 1/10
        is converged for the distances: on all-MiniLM-L6-v2 (eight sentences) halving it moves every
        layer's W₂ by < 0.4 % (rollout) and < 0.3 % (local); tests/test_pretrained.py checks < 1 %.
    mode : str
        "rollout" (from hidden_states[0] through all layers) or "local" (entry l+1 is one layer from
        the real hidden_states[l]).

    Returns
    -------
    dict
        rung -> tensor (L+1, B, n, d); entry 0 is hidden_states[0].  The discrete rungs live at the
        network's scale; "sphere", "no_bias" and "continuous" on the sphere of radius √d.

    Raises
    ------
    ValueError
        an unknown rung or mode, dt not of the form 1/integer, states/mask of the wrong shape.
    """
    _check_states(net, states, mask)
    unknown = [r for r in rungs if r not in RUNGS] if not isinstance(rungs, str) else [rungs]
    if unknown:
        raise ValueError(f"unknown rungs {unknown}: choose from {RUNGS} (a list)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not 0 < dt <= 1 \
            or abs(1.0 / dt - round(1.0 / dt)) > 1e-9 * (1.0 / dt):
        raise ValueError(f"dt must be 1/N for an integer N >= 1 (steps per layer), got {dt!r}")
    L = net.num_layers
    out = {}
    with torch.no_grad():
        for rung in rungs:
            # sentences in chunks of about _CHUNK_TOKENS padded tokens: the tensors stay cache-sized
            step = max(1, _CHUNK_TOKENS // states.shape[-2])
            parts = []
            for s in range(0, states.shape[1], step):
                st, m = states[:, s:s + step], mask[s:s + step]
                if rung == "continuous":
                    parts.append(_continuous(net, st, m, dt, mode))
                elif rung == "no_bias" and mode == "rollout" and net.norm == "post":
                    parts.append(_post_no_bias_rollout(net, st, m))
                else:
                    xs = [st[0]]
                    for l in range(L):
                        xs.append(layer_map(net, l, xs[-1] if mode == "rollout" else st[l], m, rung=rung))
                    parts.append(torch.stack(xs))
            out[rung] = torch.cat(parts, 1)
    return out


def cloud_distances(pred: torch.Tensor, real: torch.Tensor, mask: torch.Tensor) -> dict:
    """Per layer, the distance between predicted and real token clouds, each token normalised to the unit sphere.

    W₂(μ̂, μ)² = min over couplings of Σ π_ij |x̂_i − x_j|² (exact, POT ``ot.emd2``, uniform weights on the
    real tokens of each sentence); mean angle = mean_i arccos⟨x̂_i, x_i⟩ over matched tokens (same position).
    Both averaged over the sentences.

    Parameters
    ----------
    pred, real : torch.Tensor
        (L+1, B, n, d).
    mask : torch.Tensor
        (B, n) bool.

    Returns
    -------
    dict
        ``w2`` and ``mean_angle`` (radians): lists of L+1 floats, index 0 = embeddings.
    """
    import ot

    if not (isinstance(pred, torch.Tensor) and isinstance(real, torch.Tensor)) or pred.shape != real.shape \
            or pred.dim() != 4:
        raise ValueError(f"pred and real must be tensors of one shape (L+1, B, n, d), got "
                         f"{getattr(pred, 'shape', type(pred).__name__)} and {getattr(real, 'shape', type(real).__name__)}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != pred.shape[1:3]:
        raise ValueError(f"mask must be a bool tensor (B, n) = {tuple(pred.shape[1:3])}")
    if not bool(mask.any(-1).all()):
        raise ValueError("every sentence needs at least one real token (a row of mask is all False)")
    for name, t in (("pred", pred), ("real", real)):  # a NaN or zero token normalises to nothing: W2 would be 0
        valid = t.detach()[:, mask]  # (L+1, tokens, d)
        bad = ~torch.isfinite(valid).all(-1) | (valid.norm(dim=-1) == 0)
        if bool(bad.any()):
            layer = int(bad.any(-1).nonzero()[0])
            raise ValueError(f"{name} holds a NaN/inf or zero vector at a real token of hidden-state index {layer}: it "
                             f"has no direction on the sphere, so the distances are undefined; mask that token out or "
                             f"check what produced it")
    p = normalize(pred.detach().to(torch.float64))
    q = normalize(real.detach().to(torch.float64))
    w2, ang = [], []
    for l in range(p.shape[0]):
        d_l, a_l = [], []
        for b in range(p.shape[1]):
            m = mask[b]
            x, y = p[l, b][m], q[l, b][m]
            cost = torch.cdist(x, y).pow(2).cpu().numpy()
            u = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=torch.float64).numpy()
            d_l.append(math.sqrt(max(float(ot.emd2(u, u, cost)), 0.0)))
            a_l.append(float(torch.arccos((x * y).sum(-1).clamp(-1.0, 1.0)).mean()))
        w2.append(sum(d_l) / len(d_l))
        ang.append(sum(a_l) / len(a_l))
    return {"w2": w2, "mean_angle": ang}
