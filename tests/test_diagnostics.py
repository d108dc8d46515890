"""transformer_pde.analysis.diagnostics is the established name of transformer_pde.analysis.theory.particles (the
particle diagnostics, tested in tests/test_theory_particles.py): the same objects under both names,
all of theory.particles' public names exported, and tp.diagnostics the same module."""

import transformer_pde as tp
from transformer_pde import diagnostics
from transformer_pde.analysis.theory import particles


def test_diagnostics_exports_the_particle_diagnostics_themselves():
    assert diagnostics.__all__ == particles.__all__
    assert len(particles.__all__) > 10
    for name in particles.__all__:
        assert getattr(diagnostics, name) is getattr(particles, name), name
    assert tp.diagnostics is diagnostics


def test_every_exported_diagnostic_is_documented():
    for name in particles.__all__:
        obj = getattr(particles, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
