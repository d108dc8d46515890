"""The weight processes Θ_t: :mod:`.weights` (Constant, OU, Oscillating, Layerwise, Custom), :mod:`.paths` (a stored
WeightPath), :mod:`.driver` (the grid driver WeightDriver and sample_path), :mod:`.homogenized` (RandomLayers), :mod:`.nn` (real transformer layers as
Θ_t), :mod:`.pretrained` and :mod:`.model_files` (pretrained networks).  Each name is imported from the module that
defines it; the public ones are also ``tp.*`` (``tp.OrnsteinUhlenbeck``, ``tp.WeightPath``, ``tp.sample_path``)."""

from . import driver, homogenized, paths, weights

__all__ = ["driver", "homogenized", "paths", "weights"]
