"""Bit-identical reference records: refactorings that keep the arithmetic keep the numbers.

tests/data/reference_records.bin holds seed-fixed runs of every solver path (simulate: euler,
heun, rk4, adaptive, OU with paths and a stored path, realised quadratic variation, float32,
oscillating, layerwise with jumps, effective/unnormalized/relu, causal, observables and token
weights; jko; flat_flow; simulate_sharded on one rank; clustering_hitting_time), written by
scripts/make_reference_records.py from the code before the issue-16 redesign.  Each case is
rerun here and every tensor compared with torch.equal (not a tolerance).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "reference_records.bin"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_reference_records", ROOT / "scripts" / "make_reference_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_SCRIPT = _load_script()
_STORED = torch.load(DATA, weights_only=True)


def test_every_case_is_stored():
    assert set(_SCRIPT.cases()) == set(_STORED)


@pytest.mark.parametrize("name", sorted(_STORED))
def test_reference_record_bit_identical(name):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the records were made single-threaded: same reduction order
    try:
        got = _SCRIPT.cases()[name]()
    finally:
        torch.set_num_threads(n)
    want = _STORED[name]
    assert set(got) == set(want), name
    for k, v in want.items():
        g = got[k].detach()
        assert g.dtype == v.dtype and g.shape == v.shape, (name, k)
        bad = ~((g == v) | (g.isnan() & v.isnan()))
        assert not bad.any(), f"{name}.{k}: {int(bad.sum())} entries differ, max |Δ| = {(g - v).abs().max().item():.3g}"
