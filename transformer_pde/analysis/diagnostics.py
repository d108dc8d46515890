"""``tp.diagnostics``: the particle diagnostics of the theory, gathered under one name (Pendharkar's energies,
rates, margins: :mod:`transformer_pde.analysis.theory.particles`; attention entropy and orthogonal heads:
:mod:`~transformer_pde.analysis.theory.attention_geometry`; the flat flow and hitting times:
:mod:`~transformer_pde.analysis.theory.flows`).  Cluster counts are
:func:`transformer_pde.analysis.clustering.cluster_count` (chordal or geodesic radius)."""

from .theory.attention_geometry import (
    approximately_orthogonal_heads, attention_entropy, attention_probabilities, cross_head_coupling, entropy_rate,
    principal_angles,
)
from .theory.flows import FlatTrajectory, clustering_hitting_time, flat_flow
from .theory.particles import (
    EnergyBalance, RadialDecomposition, energy_balance, flat_head_energies, flat_velocity, head_energy_rates,
    mean_overlap, orthogonality_defect, radial_decomposition, radial_dominance_margin, radial_dominance_threshold,
    robust_margin,
)

__all__ = ["EnergyBalance", "RadialDecomposition", "flat_velocity", "flat_head_energies", "head_energy_rates",
           "energy_balance", "radial_decomposition", "radial_dominance_margin", "radial_dominance_threshold",
           "robust_margin", "orthogonality_defect", "mean_overlap",
           "attention_probabilities", "attention_entropy", "entropy_rate", "principal_angles",
           "approximately_orthogonal_heads", "cross_head_coupling",
           "FlatTrajectory", "flat_flow", "clustering_hitting_time"]
