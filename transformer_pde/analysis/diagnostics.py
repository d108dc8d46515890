"""``tp.diagnostics``: the particle diagnostics of the theory, :mod:`transformer_pde.analysis.theory.particles`
(Pendharkar's energies, rates, margins, flat flow, hitting times), under their established name."""

from .theory.particles import *  # noqa: F401,F403
from .theory.particles import __all__  # noqa: F401
