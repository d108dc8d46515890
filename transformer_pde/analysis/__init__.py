"""Analysis of solutions: theory (closed forms, stability, noise), clustering, ensembles, diagnostics.

ARCHITECTURE.md has the layers and what each module does."""
