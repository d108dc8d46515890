"""The kinetic theory of causal attention with positional decay: the retrieval ("soft accuracy") profile and the
lost-in-the-middle threshold of Duerinckx, Geshkovski and Rossi (2026, arXiv 2605.09213), docs/lost_in_the_middle.md.

The model: tokens θ_j on the circle at positions s_j = (j + 1)/n ∈ (0, 1]; token j attends to the earlier tokens
k < j with the positional weights π_jk ∝ e^{−(λ/n)(j − k)} (normalised over the prefix) through the
un-normalised kernel K(θ) = −β sin θ e^{β cos θ} = ∂_θ e^{β cos θ}:

    dθ_j/dt = Σ_{k<j} π_jk K(θ_j − θ_k)

(``tp.KineticDecay(λ, strict=True)`` with the "unnormalized" normalisation, value β·I, direction ascent).  As
n → ∞ the tokens at position s have a law f(t, s, θ); linearised at the uniform law, Fourier mode n of f grows
at the rate

    a_n = n² I_n(β)                                      (:func:`mode_rates`, I_n the modified Bessel function)

and a perturbation of mode n at the source position s reaches the last position s = 1 at time t with the
Green's function (the Volterra series of the prefix operator, summed)

    G_{a t}(s) = λ e^{λ s} / (e^λ − 1) · ψ_{a t}(Y_λ(s)),
    Y_λ(s) = log((e^λ − 1)/(e^{λ s} − 1)),               (:func:`position_map`; λ = 0: log(1/s))
    ψ_c(y) = Σ_{k≥0} c^{k+1} y^k / (k! (k+1)!) = √(c/y) I_1(2√(c y))   (:func:`psi`).

The retrieval profile of one head is the mixture of the first N modes with the weights
ω_{n,M} = exp(−π² n² / (2 M²)) (:func:`mode_weights`):

    S_t(s) = Σ_{n=1}^{N} ω_{n,M} G_{a_n t}(s)            (:func:`retrieval_profile`)

and the common-M multi-head profile is Σ_h c_h S_t^{(β_h, λ_h)}(s) (:func:`mixture_profile`).  For small t the
profile is U-shaped: high at the start (s → 0, where Y_λ → ∞) and at the end (s = 1, the recency of the decay).
Its right-end slope,

    ∂_s S_t(1) = λ² e^λ / (e^λ − 1) · [t S₁ − (t²/2) e^λ/(e^λ − 1) S₂],   S₁ = Σ ω_n a_n,  S₂ = Σ ω_n a_n²,

(:func:`right_end_slope`) changes sign at

    t_crit(β, λ, M, N) = 2 (1 − e^{−λ}) S₁ / S₂            (:func:`critical_time`)

after which the end of the prompt is no longer favoured over its interior.

Everything here is a closed form evaluated in float64 (scipy's exponentially scaled Bessel functions, so
that large β and large c·y do not overflow before the result does); the tests compare it with independent
evaluations (the power series, quadrature, a discretised Volterra equation) and with the paper's numbers.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import numpy as np
import torch

__all__ = ["mode_rates", "mode_weights", "psi", "position_map", "retrieval_profile", "mixture_profile",
           "right_end_slope", "critical_time", "profile_minimum", "DOUBLE_WELL_EXAMPLE"]

#: the common-M multi-head mixture of the paper's data script (t = 1.5, M = 8, 20 modes): heads (c_h, β_h, λ_h)
#: whose profile has two interior wells (docs/lost_in_the_middle.md)
DOUBLE_WELL_EXAMPLE = ((1.0, 0.2, 3.0), (-27.519314453632965, 0.2, 0.25), (-1.5515192155322617, 0.5, 0.25),
                       (3.9262326774050965e-06, 3.0, 2.0))

Array = Union[float, Sequence[float], np.ndarray, torch.Tensor]


# ------------------------------------------------------------------------------------------- input checks
def _real(value, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _beta(beta) -> float:
    beta = _real(beta, "beta")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the attractive kernel e^(β cos θ) of the theory), got {beta}")
    return beta


def _lam(lam) -> float:
    lam = _real(lam, "lam")
    if lam < 0:
        raise ValueError(f"lam must be >= 0 (the positional decay e^(−λ(s − s')), λ = 0: no decay), got {lam}")
    return lam


def _M(M) -> float:
    M = _real(M, "M")
    if M <= 0:
        raise ValueError(f"M must be > 0 (the mode weights exp(−π²n²/(2M²))), got {M}")
    return M


def _modes(modes) -> int:
    if isinstance(modes, bool) or not isinstance(modes, (int, np.integer)):
        raise TypeError(f"modes must be an int (the Fourier truncation N), got {type(modes).__name__} {modes!r}")
    if modes < 1:
        raise ValueError(f"modes must be >= 1, got {modes}")
    return int(modes)


def _array(value: Array, name: str) -> Tuple[np.ndarray, bool]:
    """(float64 array, scalar?) of a number, a sequence, an array or a tensor; NaN and inf refused."""
    scalar = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if isinstance(value, torch.Tensor):
        scalar = value.dim() == 0
        value = value.detach().cpu().double().numpy()
    elif isinstance(value, bool) or isinstance(value, str) or value is None:
        raise TypeError(f"{name} must be a number, a sequence of numbers, an array or a tensor, got "
                        f"{type(value).__name__} {value!r}")
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, a sequence of numbers, an array or a tensor, got {value!r}") from None
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite; found NaN or inf")
    return a, scalar


def _out(a: np.ndarray, scalar: bool):
    return float(a) if scalar else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))


def _positions(s: Array) -> Tuple[np.ndarray, bool]:
    a, scalar = _array(s, "s")
    if a.size and (a.min() <= 0 or a.max() > 1):
        raise ValueError(f"s must lie in (0, 1] (the source position: 1 is the last token), got values in "
                         f"[{a.min():.6g}, {a.max():.6g}]")
    return a, scalar


def _times(t: Array) -> Tuple[np.ndarray, bool]:
    a, scalar = _array(t, "t")
    if a.size and a.min() < 0:
        raise ValueError(f"t must be >= 0, got {a.min():.6g}")
    return a, scalar


# ------------------------------------------------------------------------------------------- the pieces
def mode_rates(beta: float, modes: int = 20) -> torch.Tensor:
    """a_n = n² I_n(β), n = 1, …, N: the growth rates of the Fourier modes of the uniform law (module docstring).

    Parameters
    ----------
    beta : float
        β > 0.
    modes : int
        N >= 1.

    Returns
    -------
    torch.Tensor
        (N,) float64.

    Raises
    ------
    TypeError, ValueError
        β not a finite number > 0, N not an int >= 1.

    Examples
    --------
    >>> import transformer_pde as tp
    >>> [round(float(a), 4) for a in tp.theory.kinetic.mode_rates(1.0, 3)]
    [0.5652, 0.543, 0.1995]
    """
    from scipy.special import ive

    beta, N = _beta(beta), _modes(modes)
    n = np.arange(1, N + 1, dtype=np.float64)
    return torch.from_numpy(n * n * ive(n, beta) * math.exp(beta))


def mode_weights(M: float, modes: int = 20) -> torch.Tensor:
    """ω_{n,M} = exp(−π² n² / (2 M²)), n = 1, …, N (module docstring).

    Parameters
    ----------
    M : float
        M > 0.
    modes : int
        N >= 1.

    Returns
    -------
    torch.Tensor
        (N,) float64.

    Raises
    ------
    TypeError, ValueError
        M not a finite number > 0, N not an int >= 1.
    """
    M, N = _M(M), _modes(modes)
    n = np.arange(1, N + 1, dtype=np.float64)
    return torch.from_numpy(np.exp(-0.5 * (math.pi * n / M) ** 2))


def _psi(c: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ψ_c(y) for c, y >= 0 (broadcast): √(c/y) I_1(2√(cy)) with I_1 exponentially scaled, ψ_c(0) = c."""
    from scipy.special import ive

    c, y = np.broadcast_arrays(np.asarray(c, np.float64), np.asarray(y, np.float64))
    z = 2.0 * np.sqrt(c * y)
    out = np.empty_like(z)
    small = z < 1e-3  # the series' first terms: c (1 + cy/2 + (cy)²/12)
    cy = c * y
    out[small] = (c * (1.0 + cy / 2.0 + cy * cy / 12.0))[small]
    big = ~small
    with np.errstate(over="ignore"):
        out[big] = np.sqrt(c[big] / y[big]) * ive(1, z[big]) * np.exp(z[big])
    return out


def psi(c: Array, y: Array):
    """ψ_c(y) = Σ_{k≥0} c^{k+1} y^k / (k! (k+1)!) = √(c/y) I_1(2√(c y)) (ψ_c(0) = c), for c, y >= 0.

    Parameters
    ----------
    c, y : float, sequence, array or tensor
        broadcasting against each other; c = a_n t, y = Y_λ(s).

    Returns
    -------
    float or torch.Tensor
        float for scalar inputs, else a float64 tensor of the broadcast shape.

    Raises
    ------
    TypeError, ValueError
        non-numeric input, NaN or inf, negative c or y.
    """
    ca, cs = _array(c, "c")
    ya, ys = _array(y, "y")
    if (ca.size and ca.min() < 0) or (ya.size and ya.min() < 0):
        raise ValueError("psi needs c >= 0 and y >= 0 (c = a_n t, y = Y_λ(s))")
    return _out(_psi(ca, ya), cs and ys)


def _position_map(s: np.ndarray, lam: float) -> np.ndarray:
    if lam == 0.0:
        return -np.log(s)
    # >= 0 exactly at s = 1 too (the two logarithms may round apart by one ulp)
    return np.maximum(math.log(math.expm1(lam)) - np.log(np.expm1(lam * s)), 0.0)


def position_map(s: Array, lam: float = 1.0):
    """Y_λ(s) = log((e^λ − 1)/(e^{λ s} − 1)) (λ = 0: log(1/s)), the positional distance from s to the end.

    Parameters
    ----------
    s : float, sequence, array or tensor
        positions in (0, 1].
    lam : float
        λ >= 0.

    Returns
    -------
    float or torch.Tensor
        Y_λ(s) >= 0, zero at s = 1.

    Raises
    ------
    TypeError, ValueError
        s outside (0, 1], λ < 0, non-finite input.
    """
    sa, scalar = _positions(s)
    return _out(_position_map(sa, _lam(lam)), scalar)


def _coefficient(s: np.ndarray, lam: float) -> np.ndarray:
    """λ e^{λ s} / (e^λ − 1), the last token's positional density at the source s (1 at λ = 0)."""
    if lam == 0.0:
        return np.ones_like(s)
    return lam * np.exp(lam * s) / math.expm1(lam)


def _profile(s: np.ndarray, t: np.ndarray, beta: float, lam: float, M: float, N: int) -> np.ndarray:
    """S_t(s) on the grid t (T,) × s (S,) -> (T, S) (module docstring)."""
    a = mode_rates(beta, N).numpy()
    w = mode_weights(M, N).numpy()
    y = _position_map(s, lam)
    c = t[:, None, None] * a[None, :, None]  # (T, N, 1)
    G = _psi(c, y[None, None, :])  # (T, N, S)
    return _coefficient(s, lam)[None, :] * np.einsum("n,tns->ts", w, G)


def retrieval_profile(s: Array, t: Array, beta: float, lam: float = 1.0, M: float = 8.0, modes: int = 20):
    """The single-head retrieval profile S_t(s) = Σ_{n≤N} ω_{n,M} λe^{λs}/(e^λ − 1) ψ_{a_n t}(Y_λ(s)) (module
    docstring): the linear response of the last token's law at time t to the initial law at the source s.

    Parameters
    ----------
    s : float, sequence, array or tensor
        source positions in (0, 1].
    t : float, sequence, array or tensor
        times >= 0.
    beta : float
        β > 0.
    lam : float
        λ >= 0.
    M : float
        the width parameter of the mode weights, > 0.
    modes : int
        N, the Fourier truncation.

    Returns
    -------
    float or torch.Tensor
        float for scalar s and t; else float64 (len(t), len(s)) for array t, (len(s),) for scalar t, (len(t),)
        for scalar s.

    Raises
    ------
    TypeError, ValueError
        any argument outside its domain (s in (0, 1], t >= 0, β > 0, λ >= 0, M > 0, N >= 1).

    Examples
    --------
    >>> import transformer_pde as tp
    >>> S = tp.theory.kinetic.retrieval_profile([0.02, 0.25, 1.0], 1.0, beta=1.0)
    >>> bool(S[1] < S[0] and S[1] < S[2])      # U-shaped before t_crit = 2.4575
    True
    """
    sa, ss = _positions(s)
    ta, ts = _times(t)
    out = _profile(np.atleast_1d(sa), np.atleast_1d(ta), _beta(beta), _lam(lam), _M(M), _modes(modes))
    out = out.reshape(ta.shape + sa.shape)
    return _out(out, ss and ts)


def mixture_profile(s: Array, t: Array, heads: Sequence[Tuple[float, float, float]], M: float = 8.0,
                    modes: int = 20):
    """The common-M multi-head profile Σ_h c_h S_t^{(β_h, λ_h)}(s) (module docstring).

    Parameters
    ----------
    s, t
        as :func:`retrieval_profile`.
    heads : sequence of (c_h, β_h, λ_h)
        each head's mixture weight (any real; the paper's double well has negative ones,
        :data:`DOUBLE_WELL_EXAMPLE`), inverse temperature and decay.
    M : float
        the common width parameter, > 0.
    modes : int
        N.

    Returns
    -------
    float or torch.Tensor
        shaped as :func:`retrieval_profile`.

    Raises
    ------
    TypeError, ValueError
        an empty or malformed ``heads``, or an argument outside its domain.
    """
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__len__") or len(heads) == 0:
        raise ValueError("heads must be a non-empty sequence of (weight, beta, lam) triples")
    total = None
    for i, h in enumerate(heads):
        if not hasattr(h, "__len__") or len(h) != 3:
            raise ValueError(f"heads[{i}] must be a (weight, beta, lam) triple, got {h!r}")
        c = _real(h[0], f"heads[{i}] weight")
        part = retrieval_profile(s, t, h[1], h[2], M, modes)
        total = c * part if total is None else total + c * part
    return total


def right_end_slope(t: Array, beta: float, lam: float = 1.0, M: float = 8.0, modes: int = 20):
    """∂_s S_t(1) = λ² e^λ/(e^λ − 1) [t S₁ − (t²/2) e^λ/(e^λ − 1) S₂] (module docstring; λ > 0).

    Parameters
    ----------
    t : float, sequence, array or tensor
        times >= 0.
    beta, lam, M, modes
        as :func:`retrieval_profile`, with λ > 0 (at λ = 0 the profile has no recency term: its slope at s = 1
        is −(t²/2) S₂ < 0 for every t > 0).

    Returns
    -------
    float or torch.Tensor
        the slope at s = 1, positive before :func:`critical_time`, negative after.

    Raises
    ------
    TypeError, ValueError
        an argument outside its domain, λ = 0.
    """
    ta, ts = _times(t)
    lam = _lam(lam)
    if lam == 0.0:
        raise ValueError("right_end_slope needs lam > 0 (λ = 0: no positional decay, no recency peak)")
    a = mode_rates(beta, modes).numpy()
    w = mode_weights(M, modes).numpy()
    S1, S2 = float((w * a).sum()), float((w * a * a).sum())
    r = math.exp(lam) / math.expm1(lam)
    return _out(lam * lam * r * (ta * S1 - 0.5 * ta * ta * r * S2), ts)


def critical_time(beta: float, lam: float = 1.0, M: float = 8.0, modes: int = 20) -> float:
    """t_crit(β, λ, M, N) = 2 (1 − e^{−λ}) S₁/S₂, S₁ = Σ ω_{n,M} a_n, S₂ = Σ ω_{n,M} a_n² (module docstring):
    the time at which the right-end slope of the profile changes sign (0 at λ = 0).

    Parameters
    ----------
    beta : float
        β > 0.
    lam : float
        λ >= 0.
    M : float
        > 0.
    modes : int
        N >= 1.

    Returns
    -------
    float
        t_crit.

    Raises
    ------
    TypeError, ValueError
        an argument outside its domain.

    Examples
    --------
    >>> import transformer_pde as tp
    >>> [round(tp.theory.kinetic.critical_time(b, 1.0, 8.0, 20), 4) for b in (1.0, 2.0, 3.0)]
    [2.4575, 0.6007, 0.174]
    """
    a = mode_rates(beta, modes).numpy()
    w = mode_weights(M, modes).numpy()
    lam = _lam(lam)
    return float(2.0 * -math.expm1(-lam) * (w * a).sum() / (w * a * a).sum())


def profile_minimum(t: float, beta: float, lam: float = 1.0, M: float = 8.0, modes: int = 20, *,
                    s_min: float = 0.02, grid: int = 801) -> Tuple[float, float]:
    """The interior minimum (s*, S_t(s*)) of the profile on [s_min, 1], refined by a bounded scalar minimiser
    around the best grid point; s* = 1 when the profile decreases to the end (t >= t_crit).

    Parameters
    ----------
    t : float
        time >= 0.
    beta, lam, M, modes
        as :func:`retrieval_profile`.
    s_min : float
        the left end of the search (the profile grows without bound as s → 0), in (0, 1).
    grid : int
        grid points of the first search.

    Returns
    -------
    tuple of float
        (s*, S_t(s*)).

    Raises
    ------
    TypeError, ValueError
        an argument outside its domain.
    """
    from scipy.optimize import minimize_scalar

    s_min = _real(s_min, "s_min")
    if not 0 < s_min < 1:
        raise ValueError(f"s_min must lie in (0, 1), got {s_min}")
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 3:
        raise ValueError(f"grid must be an int >= 3, got {grid!r}")
    t = float(_times(t)[0])
    s = np.linspace(s_min, 1.0, grid)
    vals = _profile(s, np.array([t]), _beta(beta), _lam(lam), _M(M), _modes(modes))[0]
    k = int(np.argmin(vals))
    if k in (0, grid - 1):
        return float(s[k]), float(vals[k])
    res = minimize_scalar(lambda u: float(_profile(np.array([u]), np.array([t]), beta, lam, M, modes)[0, 0]),
                          bounds=(float(s[k - 1]), float(s[k + 1])), method="bounded",
                          options={"xatol": 1e-10})
    return float(res.x), float(res.fun)
