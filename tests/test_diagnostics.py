"""transformer_pde.analysis.diagnostics is the established name of the particle diagnostics of the theory
(transformer_pde.analysis.theory.particles, .attention_geometry and .flows, tested in tests/test_theory_particles.py):
the same objects under both names, all of their public names exported, and tp.diagnostics the same module."""

import transformer_pde as tp
from transformer_pde import diagnostics
from transformer_pde.analysis.theory import attention_geometry, flows, particles

MODULES = (particles, attention_geometry, flows)


def test_diagnostics_exports_the_particle_diagnostics_themselves():
    names = [n for m in MODULES for n in m.__all__]
    assert diagnostics.__all__ == names
    assert len(set(names)) == len(names)  # no name in two modules
    assert len(names) > 20
    for m in MODULES:
        for name in m.__all__:
            assert getattr(diagnostics, name) is getattr(m, name), name
    assert tp.diagnostics is diagnostics


def test_every_exported_diagnostic_is_documented():
    for m in MODULES:
        for name in m.__all__:
            obj = getattr(m, name)
            if callable(obj):
                assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
