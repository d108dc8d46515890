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
from .model.moments import HeadStats
from .model.plans import relu_statistics
from .model.softmax import softmax_statistics
from .model.energy import energy, energy_time_derivative, first_variation, head_energies, log_energy
from .model.field import FieldEval, evaluate, head_outputs, radial_shadows, velocity
from .model.heads import Heads
from .model.scaling import BetaRule, LogScaling, PowerScaling
from .model.mobility import dissipation, log_mobility, mobility, slope
from .processes.driver import sample_path
from .processes.paths import WeightPath
from .processes.homogenized import RandomLayers
from .processes.weights import Constant, Custom, Layerwise, OrnsteinUhlenbeck, Oscillating, Process, oscillating_target
from .solvers.particle.front import simulate
from .solvers.tableaux import METHODS, TABLEAUX, ButcherTableau
from .solvers.trajectory import NonFiniteError, Trajectory
from .dynamics.layernorm import LAYER_NORMS, NGPT, LayerNormScheme, PeriLN, PostLN, PreLN, Projected, simuformer_scheme
from .dynamics.noise import TokenNoise
from .model.normalization import Effective, Hardmax, Normalization, ReLU, SinkhornAttention, Softmax, Unnormalized
from .model.positional import ALiBi, KineticDecay, PositionalBias, PositionKernel
from .dynamics.model import Model
from .solvers.solver import Solver
from .solvers.jko.transport import EMD, Identity, RiemannianLBFGS, SinkhornTransport, TransportTerm
from .solvers.jko.methods import EulerianJKO, LagrangianJKO
from .solvers.particle.methods import RK4, Dopri5, Euler, FixedStep, Heun
from .solvers.particle.sharded import ShardedEuler
from .solvers.particle.drift import DriftEuler
from .solvers.options import Checkpointing, LedgerOptions, Limits, Progress, SaveAt, SolveOptions
from .solvers.solve import solve
from .model import backends, transport
from .analysis import diagnostics, theory
from .solvers.particle import sharded as distributed
from . import nn
from .nn import MeanFieldAttention
from .model.backends import kernel_backend
from .utils.threads import thread_policy
from .solvers.particle.sharded import distributed_evaluate, simulate_sharded
from .processes.nn import (
    attention_matrix, layerwise_from_transformer, residual_attention_step,
)
from .solvers.jko.front import JKOConvergenceError, jko, to_grid
from .model.transport import distance, transport_plan
from .analysis import clustering, ensembles
from .analysis.clustering import Staircase, cluster_statistics, detect_plateaus, gram_rank_count, pair_fraction
from .analysis.ensembles import random_heads
from .analysis import pretrained
from .processes.pretrained import layerwise_from_pretrained


def __getattr__(name):
    # `tp.plotting` imports matplotlib, so it loads on first use (figures only when wanted)
    if name == "plotting":
        import importlib

        return importlib.import_module(f"{__name__}.application.plotting")
    raise AttributeError(f"module 'transformer_pde' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "LAYER_NORMS", "LayerNormScheme", "Projected", "PostLN", "PreLN", "PeriLN", "NGPT", "simuformer_scheme",
    "sphere",
    "plotting",
    "Heads",
    "BetaRule",
    "LogScaling",
    "PowerScaling",
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
    "RandomLayers",
    "Custom",
    "WeightPath",
    "sample_path",
    "oscillating_target",
    "simulate",
    "solve", "Model", "Normalization", "Softmax", "Unnormalized", "ReLU", "Effective", "SinkhornAttention", "Hardmax",
    "Solver", "FixedStep", "Euler", "Heun", "RK4", "Dopri5", "DriftEuler", "ShardedEuler", "LagrangianJKO", "EulerianJKO",
    "TransportTerm", "EMD", "SinkhornTransport", "Identity", "RiemannianLBFGS",
    "SaveAt", "SolveOptions", "LedgerOptions", "Checkpointing", "Progress", "Limits",
    "TokenNoise",
    "Trajectory",
    "ButcherTableau",
    "TABLEAUX",
    "METHODS",
    "NonFiniteError",
    "backends",
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
    "nn", "MeanFieldAttention",
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
    "PositionalBias", "ALiBi", "KineticDecay", "PositionKernel",
]
