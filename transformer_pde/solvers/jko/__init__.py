"""The minimizing-movement (JKO) solvers: the steps (:mod:`.lagrangian`: tokens move; :mod:`.eulerian`:
weights on a grid move), Θ_t at the JKO times (:mod:`.theta`), the checked problem (:mod:`.problem`), the run
shared by both variants (:mod:`.run`), the solver objects (:mod:`.methods`), their transport terms and inner
optimiser (:mod:`.transport`, :mod:`.lbfgs`) and the keyword front end ``tp.jko`` (:mod:`.front`)."""
