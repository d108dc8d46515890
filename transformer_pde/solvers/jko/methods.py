"""The JKO solver objects of :func:`transformer_pde.solve`: :class:`LagrangianJKO` (the tokens move) and
:class:`EulerianJKO` (weights on a fixed grid move), each with its settings and its ``run``.

``run(model, x0, options)`` checks the problem (:func:`~transformer_pde.solvers.jko.problem.check_problem`, before
any work) and starts the run (:class:`~transformer_pde.solvers.jko.run.JKORun`), which the loop of
:mod:`~transformer_pde.solvers.loop` steps (``step``: the proximal step); the maths is in
:mod:`transformer_pde.solvers.jko.front` and docs/model.md#jko.  The transport terms (``EMD``,
``SinkhornTransport``, ``Identity``) and the inner optimiser (``RiemannianLBFGS``) are settings objects of
:mod:`transformer_pde.solvers.jko.transport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, FrozenSet, Mapping, Optional, Tuple, Union

import torch

from ...utils.validation import check_bool, check_int, check_positive
from ...dynamics.model import Model
from ..solver import Solver
from ..options import SolveOptions
from .problem import check_problem
from .run import JKORun
from .transport import EMD, RiemannianLBFGS, TransportTerm

__all__ = ["JKOSolver", "LagrangianJKO", "EulerianJKO"]

#: the options fields the JKO solvers do not implement: the ledger is their own (diagnostics only), they record
#: no observables and always return a sampled noisy path, and their kernel is not chunked
_UNSUPPORTED = {"saveat": ("observables", "path"), "ledger": ("quadrature", "quadratic_variation", "energy_log_scale",
                                                                  "kinetic", "records"),
                "limits": ("chunk_elements",)}


@dataclass(frozen=True)
class JKOSolver(Solver):
    """The minimizing-movement solvers' common part: the checked problem and its run (``init``), the proximal
    step (``step``), the options they take; :class:`LagrangianJKO` and :class:`EulerianJKO` add their settings."""

    accepts: ClassVar[FrozenSet[str]] = frozenset({"saveat", "ledger", "progress", "limits"})
    unsupported: ClassVar[Mapping[str, Tuple[str, ...]]] = _UNSUPPORTED

    def init(self, model: Model, x0: Optional[torch.Tensor], options: SolveOptions) -> JKORun:
        """The JKO solve of ``model`` from ``x0`` at t0 (:func:`transformer_pde.jko`'s docstring);
        ``run`` (the loop) steps it.

        Parameters
        ----------
        model : Model
            Θ_t, the normalisation ("effective", "softmax": mobility b_k; "unnormalized": b ≡ 1), the direction,
            the token weights; the projected, non-causal model without token noise.
        x0 : torch.Tensor or None
            tokens (..., n, d) on the sphere (the Eulerian JKO deposits them on its grid; None with its
            ``grid_weights``).
        options : SolveOptions
            τ = ``dt``, t0, t1, paths, the random stream; ``saveat`` (every / ends), ``ledger`` (diagnostics),
            ``progress``, ``limits`` (max_steps, max_memory).

        Returns
        -------
        JKORun
            the run at t0; ``run`` returns the Trajectory :func:`transformer_pde.jko` returns.
        """
        return JKORun(check_problem(model, x0, self, options), self)

    def step(self, state: JKORun, t: float, dt: float):
        """The proximal step from t to t + dt (τ) of the run ``state`` (:meth:`JKORun.proximal`).

        Parameters
        ----------
        state : JKORun
            the run at t.
        t : float
            the left end.
        dt : float
            τ.

        Returns
        -------
        tuple
            (the minimiser, the inner solve's info: residual, iterations, converged, prox, plan_updates).
        """
        return state.proximal(t + dt)


@dataclass(frozen=True)
class LagrangianJKO(JKOSolver):
    """Minimizing movement of the tokens with step τ = ``dt``:
    μ_{k+1} ∈ argmin s'E(μ, Θ_{t_{k+1}}) + W_{b_k}(μ, μ_k)²/(2τ).

    The mobility follows the model's normalisation ("effective": b_k; "unnormalized": b ≡ 1).
    ``transport``: a :class:`~transformer_pde.TransportTerm` (``EMD()``, ``SinkhornTransport(eps)``, ``Identity()``);
    ``inner``: the inner optimiser; ``path_dt``: the grid of sampled noisy weights (None: τ).
    ``strict``: raise on a step that does not converge.  No checkpoints."""

    transport: TransportTerm = field(default_factory=EMD)
    inner: RiemannianLBFGS = field(default_factory=RiemannianLBFGS)
    path_dt: Optional[float] = None
    strict: bool = False
    #: the JKO variant (tp.jko's ``scheme=``)
    variant: ClassVar[str] = "lagrangian"

    def __post_init__(self):
        if not isinstance(self.transport, TransportTerm) or type(self.transport) is TransportTerm:
            raise TypeError(f"LagrangianJKO.transport must be EMD(), SinkhornTransport(eps) or Identity(), "
                            f"got {type(self.transport).__name__}")
        if not isinstance(self.inner, RiemannianLBFGS):
            raise TypeError(f"LagrangianJKO.inner must be a RiemannianLBFGS, got {type(self.inner).__name__}")
        if self.path_dt is not None:
            object.__setattr__(self, "path_dt", check_positive(self.path_dt, "LagrangianJKO.path_dt"))
        check_bool(self.strict, "LagrangianJKO.strict")


@dataclass(frozen=True)
class EulerianJKO(JKOSolver):
    """Minimizing movement of weights on a fixed grid of the sphere (S¹ or S²), step τ = ``dt``, with
    the entropic transport at blur ``eps`` (ε ≳ grid spacing²).  ``grid``: a tensor (m, d) on the
    sphere or a number of points; ``grid_weights``: the initial weights (..., m) (None: x0
    deposited on the grid with ``bandwidth``).  The model's token noise adds T∫ρ log ρ (the
    Fokker–Planck JKO).  No checkpoints."""

    grid: Union[int, torch.Tensor, None] = None
    grid_weights: Optional[torch.Tensor] = None
    bandwidth: Optional[float] = None
    eps: float = 1e-3
    tol: Optional[float] = None
    max_iter: int = 200
    path_dt: Optional[float] = None
    strict: bool = False
    #: the JKO variant (tp.jko's ``scheme=``)
    variant: ClassVar[str] = "eulerian"

    def __post_init__(self):
        object.__setattr__(self, "eps", check_positive(self.eps, "EulerianJKO.eps"))
        if self.tol is not None:
            object.__setattr__(self, "tol", check_positive(self.tol, "EulerianJKO.tol"))
        object.__setattr__(self, "max_iter", check_int(self.max_iter, "EulerianJKO.max_iter"))
        if self.path_dt is not None:
            object.__setattr__(self, "path_dt", check_positive(self.path_dt, "EulerianJKO.path_dt"))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", check_positive(self.bandwidth, "EulerianJKO.bandwidth"))
        check_bool(self.strict, "EulerianJKO.strict")
        if self.grid is not None and not isinstance(self.grid, (int, torch.Tensor)) or isinstance(self.grid, bool):
            raise TypeError(f"EulerianJKO.grid must be a tensor (m, d) on the sphere or a number of points, got "
                            f"{type(self.grid).__name__}")
