"""Butcher tableaux of the explicit Runge–Kutta methods of the fixed-step solvers (docs/model.md#solvers).

``TABLEAUX`` maps a method name to its :class:`ButcherTableau`; ``METHODS`` are the ``method=``
strings of :func:`transformer_pde.simulate` (the tableaux and "adaptive", dopri5).  Every solver
and the solver objects of :mod:`transformer_pde.solvers.particle.methods` read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

__all__ = ["ButcherTableau", "TABLEAUX", "METHODS", "ADAPTIVE_RTOL", "ADAPTIVE_ATOL"]


@dataclass(frozen=True)
class ButcherTableau:
    """Explicit Runge–Kutta coefficients (c, a, b) with the declared order; checked when built."""

    name: str
    order: int
    c: Tuple[float, ...]
    a: Tuple[Tuple[float, ...], ...]
    b: Tuple[float, ...]

    def __post_init__(self):
        s = len(self.b)
        if len(self.c) != s or len(self.a) != s:
            raise ValueError(f"tableau {self.name}: c, a and b must all have {s} stages")
        for i, row in enumerate(self.a):
            if len(row) != i:
                raise ValueError(f"tableau {self.name}: row {i} of a must have {i} entries (explicit scheme)")
            if abs(sum(row) - self.c[i]) > 1e-14:
                raise ValueError(f"tableau {self.name}: c[{i}] must equal the sum of row {i} of a")
        if abs(sum(self.b) - 1) > 1e-14:
            raise ValueError(f"tableau {self.name}: the weights b must sum to 1")
        if self.order >= 2 and abs(sum(bi * ci for bi, ci in zip(self.b, self.c)) - 0.5) > 1e-14:
            raise ValueError(f"tableau {self.name}: order >= 2 needs Σ b_i c_i = 1/2")

    @property
    def stages(self) -> int:
        return len(self.b)


#: the explicit Runge–Kutta tableaux by method name (``simulate(..., method=NAME)``): Butcher tableaux
#: with their order
TABLEAUX = {
    "euler": ButcherTableau("euler", 1, (0.0,), ((),), (1.0,)),
    "heun": ButcherTableau("heun", 2, (0.0, 1.0), ((), (1.0,)), (0.5, 0.5)),
    "rk4": ButcherTableau(
        "rk4", 4, (0.0, 0.5, 0.5, 1.0), ((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)), (1 / 6, 1 / 3, 1 / 3, 1 / 6)
    ),
}
#: the token integrators ``simulate(..., method=...)`` accepts: the tableaux and "adaptive" (dopri5)
METHODS = (*TABLEAUX, "adaptive")
#: the default relative and absolute tolerances of the adaptive solver (``tp.Dopri5()``, ``method="adaptive"`` of
#: :func:`transformer_pde.simulate` and of :class:`transformer_pde.nn.MeanFieldAttention`)
ADAPTIVE_RTOL, ADAPTIVE_ATOL = 1e-7, 1e-9
