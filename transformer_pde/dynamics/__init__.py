"""What a solve integrates: the :class:`~transformer_pde.Model` (Θ_t, the attention normalisation, the
direction, the layer-norm scheme, the token noise) in :mod:`.model`, the layer-norm schemes (the step's
geometry) in :mod:`.layernorm`, the token-noise term in :mod:`.noise`."""
