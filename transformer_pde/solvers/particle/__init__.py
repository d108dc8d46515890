"""The particle solvers: the field evaluation of a solve (:mod:`.evaluator`), the fixed-step and adaptive
runs (:mod:`.fixed_step`, :mod:`.adaptive`), the solver objects and ``tp.simulate`` (:mod:`.methods`), and the
sharded Euler solver with ``simulate_sharded`` (:mod:`.sharded`, ``tp.distributed``)."""
