"""The weight processes Θ_t (:mod:`.weights`: Constant, OU, Oscillating, Layerwise, Custom; :mod:`.paths`: a
stored WeightPath; :mod:`.driver`: the grid driver WeightDriver and sample_path) and real transformer layers as Θ_t
(:mod:`.nn`).

``transformer_pde.processes`` re-exports the names of :mod:`.weights`, :mod:`.paths` and :mod:`.driver` (public and
named internal API), so code written for the former single module ``transformer_pde.processes`` keeps working."""

from . import driver, homogenized, paths, weights
from .driver import WeightDriver, grid_steps, lift_paths, path_bytes, sample_path  # noqa: F401
from .paths import WeightPath  # noqa: F401
from .homogenized import RandomLayers  # noqa: F401
from .weights import *  # noqa: F401,F403

__all__ = [*weights.__all__, *paths.__all__, *driver.__all__, *homogenized.__all__]
__internal__ = list(driver.__internal__)
