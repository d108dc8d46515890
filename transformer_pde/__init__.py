"""transformer_pde: multi-head transformers as time-dependent Wasserstein gradient flows on the sphere.

Tokens are a measure μ on S^{d-1} moved by multi-head attention; the heads Θ_t evolve in
time (depth).  See docs/model.md for the conventions.

    >>> import torch, transformer_pde as tp
    >>> x0 = tp.sphere.octahedral(50, dtype=torch.float64)
    >>> heads = tp.Heads.random(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> traj = tp.simulate(x0, tp.OrnsteinUhlenbeck(heads), t1=1.0, dt=0.01, paths=2, seed=0)
    >>> traj.energy.shape
    torch.Size([101, 2])
"""

from .model import sphere
from .model.attention import HeadStats, relu_statistics, softmax_statistics
from .model.energy import energy, energy_time_derivative, first_variation, head_energies, log_energy
from .model.field import FieldEval, evaluate, head_outputs, radial_shadows, velocity
from .model.heads import Heads
from .model.mobility import dissipation, log_mobility, mobility, slope
from .processes.weights import (
    Constant, Custom, Layerwise, OrnsteinUhlenbeck, Oscillating, Process, WeightPath, oscillating_target,
    sample_path,
)
from .solvers.particle import simulate
from .solvers.tableaux import METHODS, TABLEAUX, ButcherTableau
from .solvers.trajectory import NonFiniteError, Trajectory
from .solvers.layernorm import LAYER_NORMS, NGPT, LayerNorm, PeriLN, PostLN, PreLN, Projected, simuformer_scheme
from .solvers.noise import TokenNoise
from .model.normalization import Effective, Normalization, ReLU, Softmax, Unnormalized
from .solvers.model import Model
from .solvers.methods import (
    EMD, RK4, Dopri5, Euler, EulerianJKO, FixedStep, Heun, Identity, LagrangianJKO, RiemannianLBFGS, ShardedEuler,
    Sinkhorn, Solver, Transport,
)
from .solvers.options import Checkpointing, LedgerOptions, Limits, Progress, SaveAt
from .solvers.solve import solve
from .model import attention, transport
from .analysis import diagnostics, theory
from .solvers import distributed
from .processes import nn
from .model.attention import kernel_backend
from .utils.threads import thread_policy
from .solvers.distributed import distributed_evaluate, simulate_sharded
from .processes.nn import (
    attention_matrix, heads_from_multihead_attention, layerwise_from_transformer, residual_attention_step,
)
from .solvers.jko import JKOConvergenceError, jko, to_grid
from .model.transport import distance, transport_plan
from .analysis import clustering, ensembles
from .analysis.clustering import Staircase, cluster_statistics, detect_plateaus, gram_rank_count, pair_fraction
from .analysis.ensembles import random_heads
from .analysis import pretrained
from .processes.pretrained import layerwise_from_pretrained


def __getattr__(name):
    # `tp.plotting` (matplotlib is imported only when figures are wanted) and the other moved modules
    # under their old attribute names (`tp.field`, `tp.runs`, ...) load on first use
    if name in _MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{_MOVED[name]}")
    raise AttributeError(f"module 'transformer_pde' has no attribute {name!r}")

# ---------------------------------------------------------------------------- moved modules
# The modules moved into the layer sub-packages (ARCHITECTURE.md); the old dotted paths
# (``import transformer_pde.energy``, ``from transformer_pde.theory import ...``,
# ``transformer_pde.cli``) keep working: a finder maps them, on first import, to the module at its
# new place (the same module object, so patches and isinstance checks see one module).
_MOVED = {
    "_validation": "utils.validation",
    "threads": "utils.threads",
    "resources": "utils.resources",
    "sphere": "model.sphere",
    "normalization": "model.normalization",
    "heads": "model.heads",
    "attention": "model.attention",
    "transport": "model.transport",
    "field": "model.field",
    "energy": "model.energy",
    "mobility": "model.mobility",
    "nn": "processes.nn",
    "distributed": "solvers.distributed",
    "theory": "analysis.theory",
    "clustering": "analysis.clustering",
    "ensembles": "analysis.ensembles",
    "diagnostics": "analysis.diagnostics",
    "plotting": "application.plotting",
    "animation": "application.animation",
    "studies": "application.studies",
    "runs": "application.runs",
    "sweep": "application.sweep",
    "cli": "application.cli",
}


class _MovedModules:
    """``sys.meta_path`` finder and loader of the old module paths (:data:`_MOVED`)."""

    @staticmethod
    def _target(fullname):
        if not fullname.startswith(__name__ + "."):
            return None
        rest = fullname[len(__name__) + 1:]
        for old in sorted(_MOVED, key=len, reverse=True):
            if rest == old or rest.startswith(old + "."):
                return f"{__name__}.{_MOVED[old]}{rest[len(old):]}"
        return None

    def find_spec(self, fullname, path=None, target=None):
        new = self._target(fullname)
        if new is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        import importlib

        return importlib.import_module(self._target(spec.name))

    def exec_module(self, module):  # the module ran at its new place
        pass

    def get_code(self, fullname):  # ``python -m transformer_pde.cli``: run the module at its new place
        target = self._target(fullname)
        return compile(f"import runpy\nrunpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{fullname}: moved to {target}>", "exec")

    def is_package(self, fullname):
        return False


def _install_moved_modules():
    import sys

    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())  # before the path finder, which would load a second copy


_install_moved_modules()

__version__ = "0.1.0"

__all__ = [
    "LAYER_NORMS", "LayerNorm", "Projected", "PostLN", "PreLN", "PeriLN", "NGPT", "simuformer_scheme",
    "sphere",
    "plotting",
    "Heads",
    "HeadStats",
    "softmax_statistics",
    "relu_statistics",
    "FieldEval",
    "evaluate",
    "velocity",
    "head_outputs",
    "radial_shadows",
    "energy",
    "log_energy",
    "head_energies",
    "first_variation",
    "energy_time_derivative",
    "mobility",
    "log_mobility",
    "slope",
    "dissipation",
    "Process",
    "Constant",
    "OrnsteinUhlenbeck",
    "Oscillating",
    "Layerwise",
    "Custom",
    "WeightPath",
    "sample_path",
    "oscillating_target",
    "simulate",
    "solve", "Model", "Normalization", "Softmax", "Unnormalized", "ReLU", "Effective",
    "Solver", "FixedStep", "Euler", "Heun", "RK4", "Dopri5", "ShardedEuler", "LagrangianJKO", "EulerianJKO",
    "Transport", "EMD", "Sinkhorn", "Identity", "RiemannianLBFGS",
    "SaveAt", "LedgerOptions", "Checkpointing", "Progress", "Limits",
    "TokenNoise",
    "Trajectory",
    "ButcherTableau",
    "TABLEAUX",
    "METHODS",
    "NonFiniteError",
    "attention",
    "kernel_backend",
    "thread_policy",
    "distributed",
    "distributed_evaluate",
    "simulate_sharded",
    "theory",
    "diagnostics",
    "transport",
    "distance",
    "transport_plan",
    "jko",
    "to_grid",
    "JKOConvergenceError",
    "nn",
    "heads_from_multihead_attention",
    "layerwise_from_transformer",
    "attention_matrix",
    "residual_attention_step",
    "clustering",
    "ensembles",
    "cluster_statistics",
    "gram_rank_count",
    "pair_fraction",
    "detect_plateaus",
    "Staircase",
    "random_heads",
    "pretrained",
    "layerwise_from_pretrained",
]
