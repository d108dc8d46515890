"""``tp.diagnostics``: the particle diagnostics of the theory (Pendharkar's energies, rates, margins:
:mod:`transformer_pde.analysis.theory.particles`; attention entropy and orthogonal heads:
:mod:`~transformer_pde.analysis.theory.attention_geometry`; the flat flow and hitting times:
:mod:`~transformer_pde.analysis.theory.flows`), under their established name.  Cluster counts are
:func:`transformer_pde.analysis.clustering.cluster_count` (chordal or geodesic radius)."""

from .theory import attention_geometry, flows, particles
from .theory.attention_geometry import *  # noqa: F401,F403
from .theory.flows import *  # noqa: F401,F403
from .theory.particles import *  # noqa: F401,F403

__all__ = [*particles.__all__, *attention_geometry.__all__, *flows.__all__]
