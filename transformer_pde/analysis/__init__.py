"""Analysis of solutions: theory (closed forms, stability, noise), clustering, ensembles, diagnostics."""
