"""The shared test helpers of tests/problems.py can fail: a replay check that passed anything would hide a
resume that loses or changes a record."""

import pytest
import torch

from problems import assert_replayed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_assert_replayed_allows_rounding_and_refuses_a_change(dtype):
    eps = torch.finfo(dtype).eps
    x = torch.linspace(-3.0, 5.0, 11, dtype=dtype)
    assert_replayed(x * (1 + 2 * eps), x)  # a reduction rounded in another order
    with pytest.raises(AssertionError):
        assert_replayed(x + 1e3 * eps * 5.0, x)  # far beyond rounding: a different computation
    with pytest.raises(AssertionError):
        assert_replayed(x[:-1], x)  # a lost record
    with pytest.raises(AssertionError):
        assert_replayed(x.to(torch.float16), x)


def test_assert_replayed_walks_trees_and_compares_integers_exactly():
    a = {"x": torch.ones(3, dtype=torch.float64), "k": torch.tensor([1, 2]), "timing": 1.0, "name": "run"}
    assert_replayed({**a, "timing": 9.0}, a)  # timing is not part of a run's records
    with pytest.raises(AssertionError):
        assert_replayed({**a, "k": torch.tensor([1, 3])}, a)
    with pytest.raises(AssertionError):
        assert_replayed({**a, "name": "other"}, a)
    with pytest.raises(AssertionError):
        assert_replayed({"x": a["x"]}, a)  # a missing key
