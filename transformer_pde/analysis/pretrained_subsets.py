"""The order-free ladder: every subset of the four ingredients that separate a post-LN network from the
mean-field flow, removed together (docs/pretrained.md).

The ladder of :mod:`transformer_pde.analysis.pretrained` removes the ingredients in one order (feed-forward,
then LayerNorm → sphere, then biases, then discrete time), so the share of the gap it gives each one depends
on that order.  Here each of the 2⁴ = 16 subsets S of :data:`INGREDIENTS` defines one map of the tokens, the
network with the ingredients of S removed:

* "feedforward" removed: the block's second sublayer is its normalisation alone, y = N₂(h);
* "layernorm" removed: every LayerNorm N (mean-centring, variance, gain γ, bias b) is replaced by the
  projection S(x) = √d·x/|x| onto the sphere of radius √d (no affine part), and the block's input is
  projected first;
* "bias" removed: the query, key, value and output biases of the attention are dropped (the feed-forward
  keeps its own);
* "discrete" removed (continuous time): each residual sublayer r ↦ N(r + G(r)) (G the attention or the
  feed-forward) is replaced by ``1/dt`` steps r ← N₀(r + dt·G(r)) followed once by N's affine part, N₀ the
  normalisation without it (LayerNorm with γ = 1, b = 0, or S).  On the sphere the step moves along the
  tangent part of G, r ← S(r + dt·P_r G(r)) (Euler with the retraction: the projected flow
  ẋ = P_x Σ_h f_h(x) of the ladder's "continuous" rung, equal to it to rounding when the other three are
  removed too).  As dt → 0 the sublayer is the flow of ṙ = G(r) on the normalisation's manifold over unit
  time; dt = 1 is the discrete block.

The empty subset is the network (to rounding), {feedforward} the ladder's "no_feedforward" rung,
{feedforward, layernorm} its "sphere" rung, {feedforward, layernorm, bias} its "no_bias" rung.  With the
per-sentence metric v(S) of every subset (W₂ to the real tokens, a clustering statistic), the Shapley value
of ingredient i,

    φ_i = Σ_{S ∌ i} |S|! (4 − |S| − 1)! / 4! · [v(S ∪ {i}) − v(S)],

is its share of v(all) − v(∅) averaged over the 4! orders of removal (:func:`shapley_values`); Σ_i φ_i =
v(all) − v(∅) exactly.  Post-LN networks (the BERT family) only.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, FrozenSet, List, Mapping, Sequence

import torch

from ..model.sphere import normalize
from ..processes.pretrained import PretrainedNetwork
from .pretrained import attention_block

__all__ = ["INGREDIENTS", "SUBSETS", "subset_name", "subset_layer_map", "subset_rollout", "shapley_weights",
           "shapley_values"]

#: the ingredients a subset removes, in the order of the ladder's rungs
INGREDIENTS = ("feedforward", "layernorm", "bias", "discrete")

#: every subset of INGREDIENTS, by size then in ladder order (the empty set first: the network)
SUBSETS: tuple = tuple(frozenset(c) for k in range(len(INGREDIENTS) + 1)
                       for c in itertools.combinations(INGREDIENTS, k))

_SHORT = {"feedforward": "no_ff", "layernorm": "sphere", "bias": "no_bias", "discrete": "continuous"}


def subset_name(removed) -> str:
    """"network" for the empty set, else the removed ingredients' short names joined by "+" in ladder order
    ("no_ff", "sphere", "no_bias", "continuous"), e.g. "no_ff+sphere".

    Parameters
    ----------
    removed : iterable of str
        ingredients of :data:`INGREDIENTS`.

    Returns
    -------
    str
        the name.
    """
    removed = _check_removed(removed)
    return "+".join(_SHORT[i] for i in INGREDIENTS if i in removed) or "network"


def _check_removed(removed) -> FrozenSet[str]:
    if isinstance(removed, str):
        raise TypeError(f"removed must be a collection of ingredients (e.g. {{'feedforward'}}), got the string "
                        f"{removed!r}")
    out = frozenset(removed)
    bad = sorted(out - set(INGREDIENTS))
    if bad:
        raise ValueError(f"unknown ingredients {bad}: choose from {INGREDIENTS}")
    return out


def _check_dt(dt) -> int:
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not 0 < dt <= 1 \
            or abs(1.0 / dt - round(1.0 / dt)) > 1e-9 * (1.0 / dt):
        raise ValueError(f"dt must be 1/N for an integer N >= 1 (steps per sublayer), got {dt!r}")
    return round(1.0 / dt)


def _sphere(x):
    return math.sqrt(x.shape[-1]) * normalize(x)


def _sublayer(r, G, norm, layernorm: bool, steps: int):
    """r ↦ N(r + G(r)) (steps = 1), or ``steps`` normalised Euler steps and N's affine part once."""
    if steps == 1:
        return norm(r + G(r)) if layernorm else _sphere(r + G(r))
    h = 1.0 / steps
    d = r.shape[-1]
    for _ in range(steps):
        g = G(r)
        if layernorm:
            r = torch.nn.functional.layer_norm(r + h * g, (d,), None, None, norm.eps)
        else:  # the tangent part of G at r (|r| = √d): the projected flow, Euler with the retraction
            g = g - (g * r).sum(-1, keepdim=True) * r / d
            r = _sphere(r + h * g)
    return norm.gain * r + norm.bias if layernorm else r


def subset_layer_map(net: PretrainedNetwork, layer: int, x: torch.Tensor, mask: torch.Tensor, removed, *,
                     dt: float = 0.25) -> torch.Tensor:
    """Block ``layer`` of the network with the ingredients ``removed`` taken out (module docstring), (B, n, d).

    Parameters
    ----------
    net : PretrainedNetwork
        a post-LN network (BERT family) from :func:`transformer_pde.pretrained.load`.
    layer : int
        the block, 0 ≤ layer < L.
    x : torch.Tensor
        the block's input (B, n, d).
    mask : torch.Tensor
        (B, n) bool, True for real tokens.
    removed : iterable of str
        a subset of :data:`INGREDIENTS`.
    dt : float
        the step of the continuous sublayers (1/dt whole), used when "discrete" is removed.

    Returns
    -------
    torch.Tensor
        (B, n, d).

    Raises
    ------
    ValueError
        a pre-LN network, an unknown ingredient, dt not 1/N, inputs as :func:`transformer_pde.pretrained.attention_block`.
    """
    removed = _check_removed(removed)
    if not isinstance(net, PretrainedNetwork) or net.norm != "post":
        raise ValueError("the subset ladder covers post-LN networks (the BERT family: BERT, RoBERTa, MiniLM); for "
                         "pre-LN networks use tp.pretrained.ladder")
    steps = _check_dt(dt) if "discrete" in removed else 1
    lw = net.layers[layer]
    layernorm, bias = "layernorm" not in removed, "bias" not in removed

    def attention(z):
        return attention_block(net, layer, z, mask, bias=bias)

    z = x if layernorm else _sphere(x)
    h = _sublayer(z, attention, lw.norm1, layernorm, steps)
    if "feedforward" in removed:
        return lw.norm2(h) if layernorm else h
    return _sublayer(h, lw.feed_forward, lw.norm2, layernorm, steps)


def subset_rollout(net: PretrainedNetwork, x0: torch.Tensor, mask: torch.Tensor, removed, *,
                   dt: float = 0.25) -> torch.Tensor:
    """The tokens of the map with ``removed`` taken out, rolled out from the embeddings x0 through every
    block, (L+1, B, n, d) (entry 0 is x0).

    Parameters
    ----------
    net, mask, removed, dt
        as :func:`subset_layer_map`.
    x0 : torch.Tensor
        the embeddings (B, n, d), hidden_states(...)[0][0].

    Returns
    -------
    torch.Tensor
        (L+1, B, n, d).
    """
    xs = [x0]
    with torch.no_grad():
        for l in range(net.num_layers):
            xs.append(subset_layer_map(net, l, xs[-1], mask, removed, dt=dt))
    return torch.stack(xs)


def shapley_weights(players: Sequence[str] = INGREDIENTS) -> Dict[str, List[tuple]]:
    """For each player i, the (weight, S ∪ {i}, S) of every coalition S not holding i, weight
    |S|!(N − |S| − 1)!/N! (the weights of each player sum to 1).

    Parameters
    ----------
    players : Sequence[str]
        the N players.

    Returns
    -------
    dict
        player → list of (weight, frozenset with i, frozenset without i).
    """
    N = len(players)
    out = {}
    for i in players:
        rest = [p for p in players if p != i]
        rows = []
        for k in range(N):
            w = math.factorial(k) * math.factorial(N - k - 1) / math.factorial(N)
            for c in itertools.combinations(rest, k):
                rows.append((w, frozenset(c) | {i}, frozenset(c)))
        out[i] = rows
    return out


def shapley_values(values: Mapping[FrozenSet[str], torch.Tensor],
                   players: Sequence[str] = INGREDIENTS) -> Dict[str, torch.Tensor]:
    """φ_i = Σ_{S ∌ i} |S|!(N − |S| − 1)!/N! [v(S ∪ {i}) − v(S)] (module docstring), elementwise over the
    tensors' entries (per layer, per sentence, ...); Σ_i φ_i = v(all) − v(∅).

    Parameters
    ----------
    values : Mapping[frozenset, torch.Tensor]
        v(S) for every subset S of ``players`` (tensors of one shape).
    players : Sequence[str]
        the players.

    Returns
    -------
    dict
        player → φ (the tensors' shape).

    Raises
    ------
    ValueError
        a subset missing from ``values``.

    Examples
    --------
    >>> import torch
    >>> v = {frozenset(s): torch.tensor(float(len(s)) ** 2) for s in [(), ("a",), ("b",), ("a", "b")]}
    >>> {k: float(t) for k, t in shapley_values(v, ("a", "b")).items()}
    {'a': 2.0, 'b': 2.0}
    """
    missing = [sorted(c) for k in range(len(players) + 1) for c in itertools.combinations(players, k)
               if frozenset(c) not in values]
    if missing:
        raise ValueError(f"values lacks the subsets {missing[:4]}{' ...' if len(missing) > 4 else ''}: the Shapley "
                         f"values need v(S) of every subset of {tuple(players)}")
    return {i: sum(w * (values[a] - values[b]) for w, a, b in rows) for i, rows in shapley_weights(players).items()}
