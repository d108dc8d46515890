"""
A parameter sweep
=================

:func:`transformer_pde.application.sweep.run_sweep` runs the cartesian grid of a config's parameters as
independent runs, one ordinary run directory per point, and gathers their metrics in
``results.csv``.  Here: the quick causal-clustering study over β ∈ {0.5, 1, 2} (in-process, in
a temporary folder).  The command line does the same:
``transformer-pde sweep experiments/causal_quick.toml -s 'beta=[0.5,1,2]'``.
"""

import tempfile

import matplotlib.pyplot as plt

from transformer_pde.utils import resources
from transformer_pde.application.sweep import run_sweep

config = resources.find_config("causal_quick")
with tempfile.TemporaryDirectory() as out:
    result = run_sweep(config, {"beta": [0.5, 1.0, 2.0]}, overrides=["figures=false", "paths=1", "t1=2.0"],
                       out_dir=out, name="beta_sweep", figure=False)
    rows = result.rows
print([r["state"] for r in rows])
metric = next(k for k in rows[0] if k.endswith("time_average_pair_fraction") or "pair_fraction" in k)
fig, ax = plt.subplots(figsize=(4.5, 3.3))
ax.plot([float(r["beta"]) for r in rows], [float(r[metric]) for r in rows], "o-")
ax.set_xlabel("β")
ax.set_ylabel(metric.replace("_", " "), fontsize=8)
fig.tight_layout()
