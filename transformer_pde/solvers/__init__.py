"""Solvers of the transformer PDE: particles (:mod:`.particle`) and JKO (:mod:`.jko`)."""
