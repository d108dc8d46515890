"""The weight processes Θ_t (:mod:`.weights`: Constant, OU, Oscillating, Layerwise, Custom, WeightPath,
the grid driver WeightDriver, sample_path) and real transformer layers as Θ_t (:mod:`.nn`).

``transformer_pde.processes`` re-exports the names of :mod:`.weights` (public and named internal
API), so code written for the former single module ``transformer_pde.processes`` keeps working."""

from . import weights
from .weights import *  # noqa: F401,F403
from .weights import __all__, __internal__  # noqa: F401
from .weights import WeightDriver, grid_steps, lift_paths, path_bytes  # noqa: F401 (the named internal API)
