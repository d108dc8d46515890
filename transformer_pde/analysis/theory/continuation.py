"""Stationary mean-field branches of noisy tokens, by continuation (docs/noisy_tokens.md).

Model: one unnormalised head A = V = λI, inverse temperature β, direction ascent, temperature T, tokens on
S^{d−1}.  The mean-field Fokker–Planck equation ∂_tρ = −div(ρ V[ρ]) + TΔρ has V = (1/β)∇Φ with
Φ(x) = ∫ e^{βλ⟨x,y⟩} ρ(y) dσ(y), so its stationary densities (w.r.t. the normalised surface measure σ) solve

    ρ = e^{Φ/(βT)} / Z,        Z = ∫ e^{Φ/(βT)} dσ.

For a zonal density ρ(x) = Σ_ℓ b_ℓ P_ℓ(⟨x, e⟩) (P_ℓ the Gegenbauer polynomial of S^{d−1} normalised by
P_ℓ(1) = 1: Chebyshev T_ℓ on S¹, Legendre on S²; b_0 = 1), Funk–Hecke gives Φ = Σ_ℓ κ_ℓ(βλ) b_ℓ P_ℓ with
κ_ℓ = :func:`~transformer_pde.analysis.theory.noise.funk_hecke_exponential`, and the self-consistency is the
algebraic system b_ℓ = G_ℓ(b, T) = ∫ ρ P_ℓ dσ / ∫ P_ℓ² dσ (ℓ = 1..K), evaluated by Gauss–Jacobi quadrature
of the zonal measure (1 − t²)^{(d−3)/2} dt.  The uniform state b = 0 solves it at every T; the clustered
branch bifurcates from it at T_c = κ_1/β (the library's ``critical_temperature(..., normalization=
"unnormalized")``).

**Continuation.**  The branch is parametrised by its order parameter m = ∫⟨x, e⟩ρ dσ = b_1/d (a pseudo-arclength
in which the fold in T is a regular point): for each m Newton's method (analytic Jacobian) solves for
(b_2, …, b_K, T), with a secant predictor from the two previous points.  The fold (spinodal) T_s is the
maximum of T(m) on the branch, refined by Brent's method on m; when the branch bends back (first order, β above
``first_order_beta``), the clustered states with m above the fold's m_s are the stable ones and exist up to
T_s > T_c.  :func:`mean_field_loop` turns the branch into the hysteresis loop of the mean-field limit for a
sweep of T, independently of how long each stage lasts.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from ...utils.validation import check_int, check_positive
from .noise import funk_hecke_exponential

__all__ = ["ZonalSelfConsistency", "stationary_branch", "spinodal", "stable_branch_at", "mean_field_loop"]


class ZonalSelfConsistency:
    """The self-consistency map b ↦ G(b, T) of the module docstring, with its derivatives.

    Parameters
    ----------
    beta, lam : float
        inverse temperature and head strength (> 0).
    d : int
        ambient dimension (tokens on S^{d−1}), ≥ 2.
    modes : int
        K, the highest degree kept (b_1..b_K).
    nodes : int, optional
        quadrature nodes (default 4K + 32).

    Examples
    --------
    >>> import numpy as np
    >>> from transformer_pde.analysis.theory.continuation import ZonalSelfConsistency
    >>> s = ZonalSelfConsistency(1.0, 1.0, 2, 16)
    >>> bool(np.abs(s.residual(np.zeros(16), 0.3)).max() < 1e-14)  # the uniform state is stationary
    True
    """

    def __init__(self, beta: float, lam: float, d: int, modes: int, nodes: int = 0):
        from scipy.special import eval_chebyt, eval_gegenbauer, roots_jacobi
        self.beta = check_positive(beta, "beta")
        self.lam = check_positive(lam, "lam")
        self.d = check_int(d, "d", minimum=2)
        self.K = check_int(modes, "modes", minimum=2)
        Q = check_int(nodes, "nodes", minimum=0) or 4 * self.K + 32
        e = (self.d - 3) / 2
        t, q = roots_jacobi(Q, e, e)
        self.t, self.q = t, q / q.sum()
        ell = np.arange(self.K + 1)
        if self.d == 2:
            P = eval_chebyt(ell[None, :], t[:, None])
        else:
            al = (self.d - 2) / 2
            P = eval_gegenbauer(ell[None, :], al, t[:, None]) / eval_gegenbauer(ell, al, 1.0)[None, :]
        self.P = P  # (Q, K+1)
        self.norms = (self.q[:, None] * P * P).sum(0)  # ∫ P_ℓ² dσ
        self.kappa = funk_hecke_exponential(self.beta * self.lam, self.d, ell)  # (K+1,)

    @property
    def critical_temperature(self) -> float:
        """T_c = κ_1(βλ)/β, where the clustered branch leaves the uniform state."""
        return float(self.kappa[1] / self.beta)

    def _density(self, b, T):
        c = np.concatenate([[1.0], b])
        phi = self.P @ (self.kappa * c) / (self.beta * T)
        g = np.exp(phi - phi.max())
        rho = g / (self.q @ g)
        return c, phi, rho

    def residual(self, b, T: float) -> np.ndarray:
        """R(b, T) = b − G(b, T), shape (K,)."""
        _, _, rho = self._density(np.asarray(b, np.float64), T)
        return np.asarray(b) - (self.P[:, 1:].T @ (self.q * rho)) / self.norms[1:]

    def jacobian(self, b, T: float):
        """(∂R/∂b (K, K), ∂R/∂T (K,)) by differentiating ρ = e^{Φ/(βT)}/Z."""
        _, phi, rho = self._density(np.asarray(b, np.float64), T)
        qr = self.q * rho
        kP = self.P[:, 1:] * self.kappa[1:] / (self.beta * T)  # ∂(Φ/(βT))/∂b_j
        dlog_b = kP - qr @ kP  # ∂ log ρ / ∂b_j
        dlog_T = -(phi - qr @ phi) / T  # ∂ log ρ / ∂T
        Pn = self.P[:, 1:] / self.norms[1:]
        dG_b = Pn.T @ (qr[:, None] * dlog_b)
        dG_T = Pn.T @ (qr * dlog_T)
        return np.eye(self.K) - dG_b, -dG_T

    def order_parameter(self, b) -> float:
        """m = b_1/d (= ∫ t ρ dσ)."""
        return float(b[0]) / self.d

    def solve_at_m(self, m: float, guess_b, guess_T: float, *, tol: float = 1e-12, max_iter: int = 50):
        """Newton for (b_2..b_K, T) with b_1 = d·m fixed; returns (b, T) or raises RuntimeError."""
        b = np.array(guess_b, dtype=np.float64)
        b[0] = self.d * m
        T = float(guess_T)
        for _ in range(max_iter):
            R = self.residual(b, T)
            if np.abs(R).max() < tol:
                return b, T
            Jb, JT = self.jacobian(b, T)
            J = np.concatenate([Jb[:, 1:], JT[:, None]], 1)
            step = np.linalg.solve(J, -R)
            b[1:] += step[:-1]
            T += step[-1]
            if not (T > 0 and np.isfinite(b).all()):
                break
        raise RuntimeError(f"Newton did not converge at m = {m:g} (|R| = {np.abs(R).max():.2e})")

    def solve_at_T(self, T: float, guess_b, *, tol: float = 1e-12, max_iter: int = 50) -> np.ndarray:
        """Newton for b at fixed T; returns b or raises RuntimeError."""
        b = np.array(guess_b, dtype=np.float64)
        for _ in range(max_iter):
            R = self.residual(b, T)
            if np.abs(R).max() < tol:
                return b
            b = b + np.linalg.solve(self.jacobian(b, T)[0], -R)
        raise RuntimeError(f"Newton did not converge at T = {T:g} (|R| = {np.abs(R).max():.2e})")


def stationary_branch(beta: float, d: int, *, lam: float = 1.0, modes: int = 48, m_max: float = 0.9,
                      m_min: float = 1e-3, steps: int = 120) -> Dict[str, np.ndarray]:
    """The clustered stationary branch (m, T(m), coefficients) from the bifurcation (m → 0) to m_max.

    Parameters
    ----------
    beta : float
        inverse temperature (> 0).
    d : int
        tokens on S^{d−1}.
    lam : float
        head strength.
    modes : int
        highest degree K kept.
    m_max, m_min : float
        range of the order parameter (0 < m_min < m_max < 1).
    steps : int
        continuation points (spaced uniformly in m).

    Returns
    -------
    Dict[str, np.ndarray]
        "m" (S,), "T" (S,), "b" (S, K), "Tc" (0-dim), "residual" (S,) the final max |R| of each point.

    Examples
    --------
    >>> from transformer_pde.analysis.theory.continuation import stationary_branch
    >>> br = stationary_branch(1.0, 2, modes=16, steps=20)
    >>> bool(abs(br["T"][0] / br["Tc"] - 1) < 1e-4)  # the branch leaves the uniform state at T_c
    True
    """
    if not 0 < m_min < m_max < 1:
        raise ValueError(f"need 0 < m_min < m_max < 1, got m_min = {m_min}, m_max = {m_max}")
    sc = ZonalSelfConsistency(beta, lam, d, modes)
    ms = np.linspace(m_min, m_max, check_int(steps, "steps", minimum=2))
    bs, Ts, res = [], [], []
    b, T = np.zeros(sc.K), sc.critical_temperature
    for j, m in enumerate(ms):
        if j >= 2:  # secant predictor
            f = (m - ms[j - 1]) / (ms[j - 1] - ms[j - 2])
            b, T = bs[-1] + f * (bs[-1] - bs[-2]), Ts[-1] + f * (Ts[-1] - Ts[-2])
        b, T = sc.solve_at_m(m, b, T)
        bs.append(b.copy())
        Ts.append(T)
        res.append(float(np.abs(sc.residual(b, T)).max()))
    return {"m": ms, "T": np.array(Ts), "b": np.array(bs), "Tc": np.array(sc.critical_temperature),
            "residual": np.array(res)}


def spinodal(beta: float, d: int, *, lam: float = 1.0, modes: int = 48, **branch_kw) -> Dict[str, float]:
    """The fold of the clustered branch: T_s = max_m T(m) and its m_s (Brent's method around the discrete
    maximum).  For a continuous transition the maximum sits at m → 0 and T_s = T_c.

    Returns
    -------
    Dict[str, float]
        {"T": T_s, "m": m_s, "ratio": T_s/T_c, "Tc": T_c, "first_order": T_s > T_c(1 + 1e-9)}.

    Examples
    --------
    >>> from transformer_pde.analysis.theory.continuation import spinodal
    >>> s = spinodal(4.0, 2, modes=32)
    >>> 1.05 < s["ratio"] < 1.07 and s["first_order"]
    True
    """
    from scipy.optimize import minimize_scalar
    br = stationary_branch(beta, d, lam=lam, modes=modes, **branch_kw)
    sc = ZonalSelfConsistency(beta, lam, d, modes)
    i = int(np.argmax(br["T"]))
    Tc = float(br["Tc"])
    if i == 0:
        return {"T": Tc, "m": 0.0, "ratio": 1.0, "Tc": Tc, "first_order": False}
    lo, hi = br["m"][max(i - 1, 0)], br["m"][min(i + 1, len(br["m"]) - 1)]

    def negT(m):
        j = int(np.argmin(np.abs(br["m"] - m)))
        return -sc.solve_at_m(m, br["b"][j], br["T"][j])[1]

    r = minimize_scalar(negT, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    Ts = -float(r.fun)
    return {"T": Ts, "m": float(r.x), "ratio": Ts / Tc, "Tc": Tc, "first_order": bool(Ts > Tc * (1 + 1e-9))}


def stable_branch_at(branch: Dict[str, np.ndarray], ratios: Sequence[float], *, beta: float, d: int,
                     lam: float = 1.0) -> np.ndarray:
    """m of the stable clustered state at T = ratio·T_c (NaN where none exists: above the fold), by
    interpolation on the part of ``branch`` beyond its fold and a Newton solve at fixed T."""
    sc = ZonalSelfConsistency(beta, lam, d, branch["b"].shape[1])
    Tc = float(branch["Tc"])
    i = int(np.argmax(branch["T"]))
    m, T, b = branch["m"][i:], branch["T"][i:], branch["b"][i:]  # T decreasing in m beyond the fold
    out = []
    for r in ratios:
        Tr = r * Tc
        if Tr > T[0] or Tr < T[-1]:
            out.append(float("nan"))
            continue
        j = int(np.searchsorted(-T, -Tr))
        j = min(max(j, 1), len(T) - 1)
        f = (Tr - T[j - 1]) / (T[j] - T[j - 1])
        guess = b[j - 1] + f * (b[j] - b[j - 1])
        out.append(sc.order_parameter(sc.solve_at_T(Tr, guess)))
    return np.array(out)


def mean_field_loop(beta: float, d: int, ratios: Sequence[float], *, lam: float = 1.0, modes: int = 48,
                    m_max: float = 0.95, steps: int = 160) -> Dict[str, object]:
    """The mean-field hysteresis loop of a sweep through the temperatures ratios·T_c (increasing).

    Up (from the clustered state): the stable clustered m while it exists (T ≤ T_s), then 0.  Down (from the
    uniform state): 0 while the uniform state is stable (T > T_c), then the clustered m.  The loop area
    ∫(m_up − m_down) d(T/T_c) is given for the stage grid (trapezoid, as the particle sweeps) and for the
    continuous sweep (∫_1^{T_s/T_c} m_up, on the branch).

    Returns
    -------
    Dict[str, object]
        {"up", "down" (lists per ratio), "area_stages", "area_continuous", "spinodal" (dict of :func:`spinodal`)}.
    """
    ratios = sorted(float(r) for r in ratios)
    br = stationary_branch(beta, d, lam=lam, modes=modes, m_max=m_max, steps=steps)
    sp = spinodal(beta, d, lam=lam, modes=modes, m_max=m_max, steps=steps)
    m_st = stable_branch_at(br, ratios, beta=beta, d=d, lam=lam)
    up = [float(v) if (np.isfinite(v) and r <= sp["ratio"]) else 0.0 for r, v in zip(ratios, m_st)]
    down = [float(v) if (np.isfinite(v) and r < 1.0) else 0.0 for r, v in zip(ratios, m_st)]
    area_st = float(np.trapezoid(np.subtract(up, down), ratios)) if len(ratios) > 1 else 0.0
    # continuous: ∫_1^{r_s} m_up(r) dr along the stable part of the branch (from the fold to T = T_c), with the
    # exact fold and the point where the branch crosses T_c added (the sliver next to T_c is not negligible)
    i = int(np.argmax(br["T"]))
    r_b, m_b = br["T"][i:] / float(br["Tc"]), br["m"][i:]
    area_cont = 0.0
    if sp["first_order"] and r_b[-1] < 1.0:
        k = int(np.argmax(r_b < 1.0))  # first branch point below T_c
        m_1 = m_b[k - 1] + (1.0 - r_b[k - 1]) * (m_b[k] - m_b[k - 1]) / (r_b[k] - r_b[k - 1])
        rr = np.concatenate([[sp["ratio"]], r_b[1:k], [1.0]])
        mm = np.concatenate([[sp["m"]], m_b[1:k], [m_1]])
        keep = np.concatenate([[True], mm[1:-1] > sp["m"], [True]])
        area_cont = float(-np.trapezoid(mm[keep], rr[keep]))
    return {"ratios": ratios, "up": up, "down": down, "area_stages": area_st, "area_continuous": area_cont,
            "spinodal": sp}

