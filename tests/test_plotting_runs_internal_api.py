"""The functions the figure and run-directory modules share (their named internal APIs).

* ``plotting.__internal__``, ``rundir.__internal__`` and ``locks.__internal__`` name public attributes that exist;
* the studies use plotting's figure helpers (one definition, no private copy);
* ``rundir.write_csv`` writes floats exactly (``repr``, numpy scalars as plain floats), None as an
  empty cell, and ``rundir.write_figure`` writes every format and returns the paths in order.
"""

import csv

import numpy as np
import pytest

from transformer_pde.application import locks, plotting, rundir, studies


@pytest.mark.parametrize("module", [plotting, rundir, locks])
def test_internal_api_is_named_and_exists(module):
    assert module.__internal__
    assert all(hasattr(module, n) and not n.startswith("_") for n in module.__internal__)


def test_studies_use_the_plotting_figure_helpers():
    assert studies.subplots is plotting.subplots and studies.panel is plotting.panel
    fig, axes = plotting.subplots(1, 2, (4, 2), "title")
    assert len(axes) == 2 and fig._suptitle.get_text() == "title"
    assert plotting.figure((3, 2))._suptitle is None


def test_write_csv_and_write_figure(tmp_path):
    path = tmp_path / "t.csv"
    rundir.write_csv(path, [["a", "b"], [0.1, None], [np.float64(1 / 3), True]])
    assert list(csv.reader(path.open())) == [["a", "b"], ["0.1", ""], [repr(1 / 3), "True"]]
    fig, ax = plotting.subplots(1, 1, (2, 2))
    ax.plot([0, 1], [1, 0])
    out = rundir.write_figure(fig, tmp_path, "f", formats=("png", "pdf"), dpi=50)
    assert out == [tmp_path / "f.png", tmp_path / "f.pdf"] and all(p.stat().st_size > 0 for p in out)
    assert not list(tmp_path.glob("*.tmp.*"))
