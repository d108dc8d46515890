"""Numerics on the circle for noisy tokens (docs/noisy_tokens.md): a spectral reference solution of the
mean-field Fokker–Planck equation on S¹, exact W2 between measures on S¹, and the temperature calibration
of the particle scheme's noise step.  Pure numpy/scipy, independent of the library's solvers (they serve as
oracles for them).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["calibrated_temperature", "fokker_planck_stable_dt", "fokker_planck_circle", "circle_cell_masses",
           "circle_turns", "circle_quantile", "circle_w2", "MF_MODES", "MF_DT_MAX"]


def calibrated_temperature(T: float, dt: float) -> float:
    """The temperature T' at which the S¹ noise step of ``tp.simulate`` (angle increment atan(√(2T'dt) z),
    z ~ N(0, 1): the projective retraction of docs/noisy_tokens.md) has the variance 2T·dt of the exact
    Brownian increment.  Removes the O(T·dt) lowering of the effective temperature (Gauss–Hermite, 80 nodes).

    Parameters
    ----------
    T : float
        target temperature, > 0.
    dt : float
        time step, > 0.

    Returns
    -------
    float
        T' ≥ T.
    """
    from scipy.optimize import brentq
    z, w = np.polynomial.hermite_e.hermegauss(80)
    w = w / w.sum()

    def gap(tp_):
        return float((w * np.arctan(math.sqrt(2 * tp_ * dt) * z) ** 2).sum()) - 2 * T * dt

    hi = 2 * T
    while gap(hi) < 0:
        if hi > 1e6 * T:
            raise ValueError(f"2·T·dt = {2 * T * dt} is too large for the noise step (its variance is < π²/4); "
                             "take a smaller dt")
        hi *= 2
    return float(brentq(gap, T, hi, xtol=1e-14 * T))


#: Fourier grid of the mean-field Fokker–Planck reference of the hysteresis loop, and its largest step
MF_MODES, MF_DT_MAX = 128, 0.02


def fokker_planck_stable_dt(beta: float, lam: float, modes: int, dt_max: float, safety: float = 0.5) -> float:
    """A step of :func:`fokker_planck_circle` inside the stability region of its RK4 stages.

    The drift is bounded by v_max = (1/β) max_u βλ sin u e^{βλ cos u} = λ sin u* e^{βλ cos u*} with
    cos u* = (√(1 + 4a²) − 1)/(2a), a = βλ (the kernel's derivative is largest there, whatever ρ is), and
    the advection of the highest kept mode k_c = M/3 has eigenvalues up to i k_c v_max; RK4 is stable
    on the imaginary axis up to 2√2.  Returns min(dt_max, safety · 2√2 / (k_c v_max)) (the diffusion is
    integrated exactly by the integrating factor and sets no limit)."""
    a = beta * lam
    cu = (math.sqrt(1 + 4 * a * a) - 1) / (2 * a) if a > 0 else 0.0
    vmax = abs(lam) * math.sqrt(max(0.0, 1 - cu * cu)) * math.exp(a * cu)
    kc = (2 * int(modes)) // 6
    return min(dt_max, safety * 2 * math.sqrt(2) / max(kc * vmax, 1e-300))


# ---------------------------------------------------------------------------- measurement tools on S¹
def circle_turns(x) -> np.ndarray:
    """Angles of points x (n, 2) on S¹ in turns, in [0, 1) (float64 numpy)."""
    x = torch.as_tensor(x).detach().cpu().double().numpy()
    if x.ndim != 2 or x.shape[-1] != 2:
        raise ValueError(f"points on S¹ must have shape (n, 2), got {tuple(x.shape)}")
    return np.mod(np.arctan2(x[:, 1], x[:, 0]) / (2 * math.pi), 1.0)


def circle_quantile(turns, weights=None, *, cells: bool = False):
    """Quantile function of a measure on S¹ = ℝ/ℤ (angles in turns) as knots (t, q), piecewise linear.

    ``cells=False``: atoms of mass ``weights`` at ``turns`` (q is a step function: pairs of knots at
    each jump).  ``cells=True``: a piecewise-constant density, the mass w_k spread uniformly over the
    cell of point k (boundaries halfway between neighbouring points, as on ``tp.sphere.circle_grid``).

    Parameters
    ----------
    turns : array_like
        (n,) angles in turns (any real numbers; taken modulo 1).
    weights : array_like, optional
        (n,) masses ≥ 0 (default uniform); normalised to 1.
    cells : bool
        atoms (False) or cells (True).

    Returns
    -------
    tuple
        (t, q): non-decreasing knots with t[0] = 0, t[-1] = 1, q[-1] − q[0] ≤ 1.

    Raises
    ------
    ValueError
        empty input, mismatched shapes, negative or zero total mass, non-finite values.
    """
    a = np.mod(np.asarray(turns, dtype=np.float64).reshape(-1), 1.0)
    w = np.full(a.shape, 1.0 / max(a.size, 1)) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if a.size == 0 or w.shape != a.shape:
        raise ValueError(f"a measure on S¹ needs n >= 1 angles and n weights, got {a.size} and {w.size}")
    if not (np.isfinite(a).all() and np.isfinite(w).all()) or (w < 0).any() or w.sum() <= 0:
        raise ValueError("the angles and weights must be finite, the weights >= 0 with a positive sum")
    order = np.argsort(a, kind="stable")
    a, w = a[order], w[order] / w.sum()
    W = np.concatenate([[0.0], np.cumsum(w)])
    W[-1] = 1.0
    if not cells:
        return np.repeat(W, 2)[1:-1], np.repeat(a, 2)
    prv = np.insert(a[:-1], 0, a[-1] - 1.0)
    lo = 0.5 * (a + prv)  # cell k = [lo_k, lo_{k+1}]
    return W, np.append(lo, lo[0] + 1.0) if a.size > 1 else np.array([a[0] - 0.5, a[0] + 0.5])


_GL = (0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0))  # 2-point Gauss–Legendre on [0, 1]


def _shift_cost(qa, qb, alpha):
    """∫_0^1 |Q_a(t) − Q_b(t + α)|² dt, Q_b extended by Q_b(s + 1) = Q_b(s) + 1: exact for piecewise-linear Q."""
    ta, va = qa
    tb, vb = qb
    ks = np.arange(math.floor(-alpha) - 1, math.ceil(1 - alpha) + 2)
    tbs = (tb[None, :] + ks[:, None] - alpha).reshape(-1)
    knots = np.unique(np.concatenate([ta, tbs[(tbs > 0) & (tbs < 1)], [0.0, 1.0]]))
    lo, h = knots[:-1], np.diff(knots)
    total = 0.0
    for g in _GL:  # the integrand is quadratic on every merged interval: 2 Gauss points are exact
        t = lo + g * h
        s = t + alpha
        k = np.floor(s)
        diff = np.interp(t, ta, va) - (np.interp(s - k, tb, vb) + k)
        total += 0.5 * float((h * diff * diff).sum())
    return total


def circle_w2(a, b) -> float:
    """Exact W2 (geodesic cost, radians) between two measures on S¹ given by :func:`circle_quantile` knots.

        W2² = (2π)² min_α ∫_0^1 |Q_a(t) − Q_b(t + α)|² dt

    (Delon–Salomon–Sobolevski 2010: on the circle the optimal plan is monotone after a shift of the cut, and
    the cost is convex in the shift α).  The integral is exact for piecewise-linear quantiles (atoms,
    piecewise-constant densities); the convex minimisation in α is bracketed by a scan and refined by Brent.

    Parameters
    ----------
    a, b : tuple
        (t, q) knots from :func:`circle_quantile`.

    Returns
    -------
    float
        W2 in radians (the geodesic distance on the unit circle).
    """
    from scipy.optimize import minimize_scalar  # scipy on first use: `import transformer_pde` stays light
    grid = np.linspace(-1.0, 1.0, 41)
    vals = [_shift_cost(a, b, al) for al in grid]
    i = int(np.argmin(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    res = minimize_scalar(lambda al: _shift_cost(a, b, al), bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-12})
    best = min(float(res.fun), vals[i])
    return 2 * math.pi * math.sqrt(max(best, 0.0))


def fokker_planck_circle(coef0, t_out, *, beta: float, lam: float, T: float, modes: int = 128, dt: float = 1e-3):
    """Reference mean field on S¹: the McKean–Vlasov Fokker–Planck equation of one unnormalised head
    A = V = λI (ascent), ∂_tρ = −∂_θ(ρ v) + T ∂_θ²ρ with v = (1/β) ∂_θ ∫ e^{βλ cos(θ−φ)} ρ(φ) dφ,
    by a Fourier pseudo-spectral method (integrating-factor RK4; the kernel acts on mode k as 2π I_k(βλ)).

    An implementation independent of the library's solvers, used as the reference density.

    Parameters
    ----------
    coef0 : callable or array_like
        ρ0 as a function of θ (radians, numpy array) → density w.r.t. dθ (normalised here), or its
        Fourier coefficients c_k (k = 0..M/2, as returned).
    t_out : Sequence[float]
        output times (> 0, increasing); each must be a multiple of ``dt``.
    beta, lam, T : float
        inverse temperature, head strength, temperature.
    modes : int
        grid points M (Fourier modes 0..M/2).
    dt : float
        time step.

    Returns
    -------
    dict
        {t: complex Fourier coefficients c_k (k = 0..M/2) with ρ(θ) = Σ_k c_k e^{ikθ}, c_0 = 1/(2π)}.
    """
    from scipy.special import ive
    M = int(modes)
    th = 2 * math.pi * np.arange(M) / M
    if callable(coef0):
        rho = np.asarray(coef0(th), dtype=np.float64)
    else:
        c_in = np.zeros(M // 2 + 1, dtype=np.complex128)
        c_given = np.asarray(coef0, dtype=np.complex128).reshape(-1)[:M // 2 + 1]
        c_in[:c_given.size] = c_given
        rho = np.fft.irfft(c_in * M, M)
    rho = rho / (rho.mean() * 2 * math.pi)
    c = np.fft.rfft(rho) / M
    k = np.arange(c.size)
    a = beta * lam
    # v = (1/β) ∂_θ Φ,  Φ_k = 2π I_k(a) c_k
    vmult = 1j * k / beta * 2 * math.pi * ive(k, a) * math.exp(a)
    dmult = 1j * k
    cut = k > (2 * M) // 6  # 2/3 de-aliasing
    L = -T * k.astype(np.float64) ** 2

    def nonlin(c):
        r = np.fft.irfft(c * M, M)
        v = np.fft.irfft(vmult * c * M, M)
        out = -dmult * np.fft.rfft(r * v) / M
        out[cut] = 0.0
        return out

    E, E2 = np.exp(L * dt), np.exp(L * dt / 2)
    out, t, steps_done = {}, 0.0, 0
    for t_target in t_out:
        n = round(t_target / dt)
        if abs(n * dt - t_target) > 1e-9 * max(1.0, t_target) or n < steps_done:
            raise ValueError(f"output time {t_target} must be an increasing multiple of dt = {dt}")
        for _ in range(n - steps_done):
            k1 = nonlin(c)
            k2 = nonlin(E2 * (c + 0.5 * dt * k1))
            k3 = nonlin(E2 * c + 0.5 * dt * k2)
            k4 = nonlin(E * c + dt * E2 * k3)
            c = E * c + dt / 6 * (E * k1 + 2 * E2 * (k2 + k3) + k4)
        steps_done = n
        out[t_target] = c.copy()
    return out


def circle_cell_masses(coef, m: int) -> np.ndarray:
    """Masses of the m equal cells centred at the ``circle_grid(m)`` points (angles 2πb/m) of the density
    ρ(θ) = Σ_k c_k e^{ikθ} (real: c_{−k} = conj c_k), integrated exactly."""
    c = np.asarray(coef)
    h = 2 * math.pi / m
    lo = h * (np.arange(m) - 0.5)
    k = np.arange(1, c.size)
    # ∫_lo^{lo+h} e^{ikθ} dθ = e^{ik lo}(e^{ikh} − 1)/(ik)
    f = np.exp(1j * np.outer(lo, k)) * ((np.exp(1j * k * h) - 1) / (1j * k))
    mass = h * c[0].real + 2 * (f @ c[1:]).real
    return mass
