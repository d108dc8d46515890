"""The inverse temperature β as a rule of the context length n (docs/critical_scaling.md, docs/model.md#heads).

Long-context models multiply the attention scores by a factor that grows with the number of tokens:
β_n = γ log n (YaRN, Qwen; the critical scaling of Chen, Lin, Polyanskiy, Rigollet, arXiv 2510.05554), or
c·n^{2/(d−1)} (the critical scale of i.i.d. uniform keys on S^{d−1}, arXiv 2605.08505).  A :class:`BetaRule`
is such a rule; :class:`~transformer_pde.Heads` take one as ``beta=`` and resolve it once per call or solve
from the number of tokens n (``Heads.at_context``).  Any real β is allowed (β ≤ 0 included).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from ..utils.validation import check_int

__all__ = ["BetaRule", "LogScaling", "PowerScaling"]
#: named internal API (not public): the β checks of the heads and of the theory functions (a finite real of any
#: sign; a rule of n resolved)
__internal__ = ["real_beta", "resolve_beta"]


def real_beta(value, name: str = "beta"):
    """A finite real β (float) or a float tensor of finite values; any sign (β ≤ 0 is allowed)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {value.dtype}; use {name}.double()")
        if not bool(torch.isfinite(value.detach()).all()):
            raise ValueError(f"{name} must be finite, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, a float tensor or a BetaRule, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class BetaRule:
    """β as a rule of the context length: β_n = rule(n), n the number of tokens (keys) of the measure.

    ``rule`` is a callable n ↦ β_n returning a real number or a float tensor (a sweep of β values that
    broadcasts against the heads' batch shape).  :class:`Heads` built with a rule resolve it once per call or
    solve, from the number of tokens n = x.shape[-2] (x0.shape[-2] for a solve), into an ordinary β
    (:meth:`Heads.at_context`); every function that reads β then sees that value.  Token weights do not
    change n: it is the size of the support.

    Parameters
    ----------
    rule : Callable
        n (int >= 1) ↦ β_n (float or float tensor), finite; any sign.
    name : str, optional
        how the rule prints (default: the callable's name).

    Examples
    --------
    >>> import math, transformer_pde as tp
    >>> rule = tp.BetaRule(lambda n: 0.5 * math.sqrt(n), name="sqrt")
    >>> rule(16)
    2.0
    """

    def __init__(self, rule: Optional[Callable] = None, *, name: Optional[str] = None):
        if rule is not None and not callable(rule):
            raise TypeError(f"rule must be a callable n -> beta_n, got {type(rule).__name__}")
        self._rule = rule
        self.name = name or getattr(rule, "__name__", type(self).__name__)

    def formula(self, n: int):
        """β_n before the checks (subclasses define it; the base class calls the rule)."""
        return self._rule(n)

    def __call__(self, n) -> Union[float, torch.Tensor]:
        """β_n for n tokens, checked finite (a float, or a tensor for tensor parameters)."""
        n = check_int(n, "n (the number of tokens)", minimum=1)
        return real_beta(self.formula(n), f"{self!r} at n = {n}")

    @property
    def shape(self) -> torch.Size:
        """The batch shape of β_n (``()`` for scalar parameters)."""
        return torch.Size(())

    @property
    def tensors(self) -> tuple:
        """The tensor parameters of the rule (their dtype and device must match the heads')."""
        return ()

    def __repr__(self) -> str:
        return f"BetaRule({self.name})"


def _parameter(value, name: str):
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {value.dtype}")
        if not bool(torch.isfinite(value.detach()).all()):
            raise ValueError(f"{name} must be finite")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number or a float tensor, got {value!r}")
    return float(value)


def _show(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else f"tensor{tuple(v.shape)}"


class LogScaling(BetaRule):
    """β_n = γ log n: the critical attention scaling of long contexts (docs/critical_scaling.md).

    Chen, Lin, Polyanskiy, Rigollet (arXiv 2510.05554): with scores β_n⟨y_i, y_j⟩ on tokens of pairwise
    inner product ρ, attention collapses the tokens for γ < 1/(1 − ρ) and becomes the identity above it.

    Parameters
    ----------
    gamma : float or torch.Tensor
        γ (any sign); a tensor sweeps γ (β_n gets its shape).

    Examples
    --------
    >>> import math, transformer_pde as tp
    >>> round(tp.LogScaling(2.0)(100), 6) == round(2 * math.log(100), 6)
    True
    """

    def __init__(self, gamma):
        self.gamma = _parameter(gamma, "gamma")
        super().__init__(name="LogScaling")

    def formula(self, n: int):
        return self.gamma * math.log(n)

    @property
    def shape(self) -> torch.Size:
        return self.gamma.shape if isinstance(self.gamma, torch.Tensor) else torch.Size(())

    @property
    def tensors(self) -> tuple:
        return (self.gamma,) if isinstance(self.gamma, torch.Tensor) else ()

    def __repr__(self) -> str:
        return f"LogScaling(gamma={_show(self.gamma)})"


class PowerScaling(BetaRule):
    """β_n = c · n^p; :meth:`uniform_keys` gives p = 2/(d − 1), the critical scale of i.i.d. uniform keys
    on S^{d−1} (arXiv 2605.08505; docs/critical_scaling.md).

    Parameters
    ----------
    c : float or torch.Tensor
        the prefactor (any sign); a tensor sweeps it.
    exponent : float
        p (finite).

    Examples
    --------
    >>> import transformer_pde as tp
    >>> tp.PowerScaling.uniform_keys(3, c=2.0)(10)   # 2 · 10^(2/2)
    20.0
    """

    def __init__(self, c, exponent: float):
        self.c = _parameter(c, "c")
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not math.isfinite(exponent):
            raise TypeError(f"exponent must be a finite real number, got {exponent!r}")
        self.exponent = float(exponent)
        super().__init__(name="PowerScaling")

    @classmethod
    def uniform_keys(cls, d: int, c=1.0) -> "PowerScaling":
        """β_n = c · n^{2/(d−1)} for keys on S^{d−1} (d >= 2)."""
        d = check_int(d, "d", minimum=2)
        return cls(c, 2.0 / (d - 1))

    def formula(self, n: int):
        return self.c * float(n) ** self.exponent

    @property
    def shape(self) -> torch.Size:
        return self.c.shape if isinstance(self.c, torch.Tensor) else torch.Size(())

    @property
    def tensors(self) -> tuple:
        return (self.c,) if isinstance(self.c, torch.Tensor) else ()

    def __repr__(self) -> str:
        return f"PowerScaling(c={_show(self.c)}, exponent={self.exponent:.4g})"


def resolve_beta(beta, n: int):
    """β itself, or β_n when β is a :class:`BetaRule` (or a callable), for the theory functions that take
    (β, n); the value is checked finite (any sign)."""
    if isinstance(beta, BetaRule):
        return beta(n)
    if callable(beta) and not isinstance(beta, torch.Tensor):
        return BetaRule(beta)(n)
    return beta
