"""The model of :func:`transformer_pde.solve`: what moves the tokens, independent of how it is solved.

    Model(theta, normalization="softmax", direction="ascent", layer_norm="none", temperature=0.0,
          weights=None, causal=False)

* ``theta`` — the weight process Θ_t: :class:`~transformer_pde.Heads` (constant), a
  :class:`~transformer_pde.processes.weights.Process` (OU, oscillating, layerwise, custom) or a stored
  :class:`~transformer_pde.WeightPath`;
* ``normalization`` — a :class:`~transformer_pde.model.normalization.Normalization` (or its name);
* ``direction`` — "ascent" (the default of every public function) or "descent";
* ``layer_norm`` — how tokens stay on the sphere: a :class:`~transformer_pde.dynamics.layernorm.LayerNormScheme`
  (``Projected()`` = "none", the projected flow with retraction, ``PostLN()``, ``PreLN()``, …) or its name;
* ``temperature`` — token noise: a temperature T ≥ 0 (0: none) or a
  :class:`~transformer_pde.dynamics.noise.TokenNoise` (T with a seed of its own); once built,
  ``model.temperature`` is the float T and ``model.noise`` the resolved term (None when T = 0; rebuild with
  ``dataclasses.replace(model, ..., temperature=model.noise or 0.0)`` to keep a TokenNoise's seed);
* ``weights`` — token weights (..., n) or None (uniform);
* ``causal`` — False, True / "mean" or "sum" (docs/model.md#fields).

The fields carry the names of the keywords of :func:`transformer_pde.simulate`.  Every field is checked
when the model is built; the checks that need x0 (shapes, dtype, device) run in :func:`transformer_pde.solve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ..utils.validation import DEFAULT_DIRECTION
from ..utils.validation import DIRECTIONS, check_choice, direction_sign
from ..model.field import check_causal_mode
from ..model.heads import Heads
from ..model.normalization import Normalization, normalization as as_normalization
from ..processes.weights import Constant, Process
from .layernorm import LayerNormScheme, as_geometry
from .noise import TokenNoise, token_noise

__all__ = ["Model"]


@dataclass(frozen=True)
class Model:
    """The tokens' dynamics (module docstring).  Build it once, solve it with any solver."""

    theta: Union[Heads, Process]
    normalization: Union[str, Normalization] = "softmax"
    direction: str = DEFAULT_DIRECTION
    layer_norm: Union[str, LayerNormScheme] = "none"
    temperature: Union[float, TokenNoise] = 0.0
    weights: Optional[torch.Tensor] = None
    causal: Union[bool, str] = False
    #: the token-noise term of ``temperature`` (None when T = 0), resolved when built
    noise: Optional[TokenNoise] = field(init=False, default=None)

    def __post_init__(self):
        theta = self.theta
        if isinstance(theta, Heads):
            theta = Constant(theta)
        elif not isinstance(theta, Process):
            raise TypeError(f"Model.theta must be a Heads, a Process (OrnsteinUhlenbeck, Oscillating, Layerwise, "
                            f"Custom) or a WeightPath, got {type(theta).__name__}")
        object.__setattr__(self, "theta", theta)
        norm = as_normalization(self.normalization, "Model.normalization")
        object.__setattr__(self, "normalization", norm)
        check_choice(self.direction, DIRECTIONS, "Model.direction")
        object.__setattr__(self, "layer_norm", as_geometry(self.layer_norm))
        noise = token_noise(self.temperature)  # None when T = 0
        object.__setattr__(self, "noise", noise)
        object.__setattr__(self, "temperature", 0.0 if noise is None else noise.temperature)
        if self.weights is not None and not isinstance(self.weights, torch.Tensor):
            raise TypeError(f"Model.weights must be a tensor (..., n) or None, got {type(self.weights).__name__}")
        check_causal_mode(self.causal)
        if self.causal and not norm.causal:
            raise ValueError(f"normalization={norm.name!r} has no causal version; use one of 'softmax', "
                             f"'unnormalized', 'relu' with causal=True")
        if noise is not None and not self.layer_norm.projected:
            raise ValueError(f"token noise (temperature = {noise.temperature}) is defined for the projected flow only; "
                             f"layer_norm={self.layer_norm.name!r} with token noise is not implemented: use 'none'")

    @property
    def process(self) -> Process:
        """Θ_t as a Process (a constant Heads is wrapped in :class:`~transformer_pde.Constant`)."""
        return self.theta

    @property
    def sign(self) -> float:
        """The direction's sign s: −1 for "descent" (x ← x − Δt·f, the reference code), +1 for "ascent"."""
        return direction_sign(self.direction)
