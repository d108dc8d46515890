"""The fast paths and closed forms follow the normalisation's declared rule (``Normalization.rule``), not its class:
a subclass of a registered normalisation that keeps the rule keeps them, one that overrides the rule computes its own."""

import pytest
import torch

import transformer_pde as tp
from transformer_pde.model import field as field_module


class KeepsSoftmax(tp.Softmax):
    """A user's subclass that adds nothing to the rule."""


class DoubledSoftmax(tp.Softmax):
    """A user's subclass with a rule of its own: twice the softmax outputs."""

    def outputs(self, kernel):
        return 2 * kernel.value_mean()

    def field(self, kernel):
        f = self.outputs(kernel)
        return kernel.head_sum(f), f


def _problem(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    x = (x / x.norm(dim=-1, keepdim=True)).to(dtype)
    A = torch.randn(2, 3, 3, generator=g, dtype=torch.float64).to(dtype)  # non-symmetric: the pair-block fast path
    return x, tp.Heads(A, 0.5 * A.transpose(-1, -2), beta=1.3)


def _spy(monkeypatch):
    calls = []
    fast = field_module.pair_field

    def spy(*a, **k):
        calls.append(1)
        return fast(*a, **k)
    monkeypatch.setattr(field_module, "pair_field", spy)
    return calls


def test_rules_are_declared_by_the_registered_classes():
    assert tp.Softmax().rule == "softmax" and tp.Softmax().plain_softmax
    assert KeepsSoftmax().rule == "softmax" and KeepsSoftmax().plain_softmax
    assert DoubledSoftmax().rule is None and not DoubledSoftmax().plain_softmax
    assert [tp.model.normalization.normalization(k).rule for k in tp.model.normalization.NORMALIZATIONS] == \
        list(tp.model.normalization.NORMALIZATIONS)
    assert not tp.Unnormalized().plain_softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_subclass_that_keeps_the_rule_keeps_the_fast_path(monkeypatch, dtype):
    x, heads = _problem(dtype)
    calls = _spy(monkeypatch)
    plain = tp.evaluate(x, heads, normalization=tp.Softmax(), diagnostics=False).velocity
    assert len(calls) == 1  # the fast kernel ran for the plain softmax
    sub = tp.evaluate(x, heads, normalization=KeepsSoftmax(), diagnostics=False).velocity
    assert len(calls) == 2  # and for the subclass that keeps its rule
    torch.testing.assert_close(sub, plain, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_subclass_that_overrides_the_rule_gets_its_own_rule(monkeypatch, dtype):
    x, heads = _problem(dtype)
    calls = _spy(monkeypatch)
    plain = tp.evaluate(x, heads, normalization=tp.Softmax(), diagnostics=False).velocity
    n = len(calls)
    doubled = tp.evaluate(x, heads, normalization=DoubledSoftmax(), diagnostics=False).velocity
    assert len(calls) == n  # no fast softmax kernel for a rule of its own
    # its own rule: the projected field is linear in the outputs, so twice the softmax velocity
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(doubled, 2 * plain, rtol=100 * eps, atol=100 * eps)


def test_theory_closed_forms_follow_the_rule():
    """A closed form of the theory takes a subclass that keeps the rule and refuses one that overrides it."""
    lam = [1.0, 2.0]
    a = tp.theory.critical_temperature(2.0, 3, lambdas=lam, normalization="softmax")
    b = tp.theory.critical_temperature(2.0, 3, lambdas=lam, normalization=KeepsSoftmax())
    assert float(a) == float(b)
    with pytest.raises(ValueError, match="not covered"):
        tp.theory.critical_temperature(2.0, 3, lambdas=lam, normalization=DoubledSoftmax())
