"""The homogenized limit of random layers (docs/homogenized.md): the common-noise SDE on the sphere, and the two-token
diffusion of the inner product ρ = ⟨x₁, x₂⟩ with its exact law by the backward Kolmogorov equation.

Random layers (:class:`transformer_pde.processes.homogenized.RandomLayers`) with value matrices
V_{l,h} = V̄_h + σ_h Z_{l,h}/√Δ and the residual update x ← retract(x + Δ·v) converge in law, as Δ = T/L → 0, to the
Itô SDE on (S^{d−1})^n

    dx_i = [ s·P_{x_i} Σ_h ω_h V̄_h ȳ_h(x_i) − ½ (d − 1) K_ii x_i ] dt + P_{x_i} dM_i,
    dM_i = Σ_h ω_h σ_h dB_h ȳ_h(x_i),    d⟨M_i, M_jᵀ⟩ = K_ij I dt,   K_ij = Σ_h ω_h² σ_h² ⟨ȳ_h(x_i), ȳ_h(x_j)⟩,

with B_h independent d×d Brownian matrices common to all tokens (one per head and path), ȳ_h(x_i) the attention
average of head h at token i (softmax: Σ_j e^{β⟨x_i, A_h x_j⟩} x_j / Σ_j e^{β⟨x_i, A_h x_j⟩}) and s the direction's
sign.  The −½(d−1)K_ii x_i term is the Itô correction of the retraction: ½ K_ii Δ(x/|x|) = −½(d−1)K_ii x on the
sphere.  The attention averages enter at the left point of each layer, so this is the Itô equation; writing it in
Stratonovich form adds terms in the derivatives of ȳ_h (it is P_x∘dB ȳ only at β = 0 or for frozen ȳ).

Two tokens, one head A = I, V̄ = α I, ω = 1: ρ = ⟨x₁, x₂⟩ is a diffusion on [−1, 1]

    dρ = b(ρ) dt + a(ρ) dW,   b = 2sα(1 − p)(1 − ρ²) − (d − 1)K₁₁ρ + (d − 2 + ρ²)K₁₂,   a² = 2(1 − ρ²)(K₁₁ − ρK₁₂),

p = e^β/(e^β + e^{βρ}) (the self weight), K₁₁ = σ²(p² + (1−p)² + 2p(1−p)ρ), K₁₂ = σ²(2p(1−p) + (p² + (1−p)²)ρ).
Its end points ±1 are fixed (b = a = 0 there); linearised there, 1 + ρ (antipodal) and 1 − ρ (clustered) are
geometric Brownian motions with Lyapunov exponents λ_∓ (:func:`boundary_exponents`): an end point is reached with
positive probability iff its exponent is < 0.  At β = 0, α = 0: b = (σ²/2)(1 − ρ²)(d − 2 − ρ), a² = σ²(1 − ρ²)²,
λ₋ = σ²(d − 3), λ₊ = −σ²(d − 1).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ...utils.validation import DEFAULT_DIRECTION, check_int, check_positive, check_real, check_seed_generator
from ...utils.validation import check_tokens, direction_sign
from ...model.field import head_outputs, velocity
from ...model.heads import Heads
from ...processes.homogenized import check_head_sigmas

__all__ = ["homogenized_coefficients", "homogenized_sde", "two_token_coefficients", "two_token_expectation",
           "boundary_exponents", "critical_dimension", "antipodal_probability"]

SCHEMES = ("ito", "projected")


def _sigma_heads(sigma, heads: Heads, like: torch.Tensor) -> torch.Tensor:
    H = heads.num_heads
    if isinstance(sigma, torch.Tensor) and sigma.numel() != 1:
        check_head_sigmas(sigma, H)
        return sigma.to(dtype=like.dtype, device=like.device)
    s = check_positive(sigma, "sigma", allow_zero=True)
    return torch.full((H,), s, dtype=like.dtype, device=like.device)


def _averages(x, heads: Heads, normalization) -> torch.Tensor:
    """ȳ_h(x_i), (..., H, n, d): the per-head outputs with V_h = I."""
    eye = torch.eye(heads.dim, dtype=x.dtype, device=x.device).expand(heads.score_matrix.shape)
    return head_outputs(x, Heads(heads.score_matrix, eye, heads.weights, heads.beta), normalization=normalization)


def homogenized_coefficients(x, heads: Heads, sigma=1.0, *, normalization: str = "softmax",
                             direction: str = DEFAULT_DIRECTION) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Itô coefficients of the homogenized SDE at the tokens x (module docstring).

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) on the unit sphere.
    heads : Heads
        the mean heads (A_h, V̄_h, ω_h, β); centred values: ``Heads(A, torch.zeros_like(A))``.
    sigma : float or torch.Tensor
        σ ≥ 0, or (H,) per head: the value noise of :class:`~transformer_pde.processes.homogenized.RandomLayers`.
    normalization, direction
        as :func:`transformer_pde.velocity` ("softmax", "unnormalized" or "relu": a per-head split is needed).

    Returns
    -------
    tuple of torch.Tensor
        (drift (..., n, d): s·P_x Σ_h ω_h V̄_h ȳ_h − ½(d−1)K_ii x_i; K (..., n, n): the noise covariance kernel;
        ȳ (..., H, n, d): the attention averages).

    Raises
    ------
    ValueError, TypeError
        tokens off the sphere, a σ that is negative or not (H,).
    """
    check_tokens(x, "x")
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}")
    sig = _sigma_heads(sigma, heads, x)
    d = x.shape[-1]
    y = _averages(x, heads, normalization)  # (..., H, n, d)
    c = (heads.weights * sig) ** 2  # (..., H)
    K = torch.einsum("...h,...hid,...hjd->...ij", c.expand(y.shape[:-2]), y, y)
    mean = velocity(x, heads, normalization=normalization, direction=direction)
    drift = mean - 0.5 * (d - 1) * torch.diagonal(K, dim1=-2, dim2=-1)[..., None] * x
    return drift, K, y


def homogenized_sde(x0, heads: Heads, sigma=1.0, *, t1: float, dt: float, paths: Optional[int] = None,
                    record_every: int = 1, scheme: str = "ito", seed: Optional[int] = None, generator=None,
                    normalization: str = "softmax", direction: str = DEFAULT_DIRECTION) -> torch.Tensor:
    """Integrate the homogenized SDE for many paths at once (a Brownian matrix per head and path, common to tokens).

    Parameters
    ----------
    x0 : torch.Tensor
        tokens (n, d) (the same start for every path, ``paths`` required) or (P, n, d).
    heads : Heads
        the mean heads (A_h, V̄_h, ω_h, β), unbatched.
    sigma : float or torch.Tensor
        the value noise σ (or (H,) per head).
    t1, dt : float
        the horizon and the step (t1/dt a whole number).
    paths : int or None
        P when x0 is one configuration (n, d).
    record_every : int
        keep every k-th step (and the last).
    scheme : str
        "ito": Euler–Maruyama in R^d of the Itô equation with its coefficients extended radially (evaluated at
        x/|x|), x ← x + drift·dt + P ΔM, no retraction: |x| = 1 is invariant and attracting for that equation
        (d|x|² = (d − 1)K_ii(1 − |x|) dt) only because of the Itô correction, which this scheme uses explicitly
        (weak order 1); "projected": the same step retracted to the sphere, x ← (x + drift·dt + P_x ΔM)/|·|
        (the retraction supplies the correction itself; weak order 1, for long horizons).
    seed, generator
        the random stream (seed None means 0; not both).
    normalization, direction
        as :func:`transformer_pde.velocity`.

    Returns
    -------
    torch.Tensor
        tokens (R, P, n, d) at the recorded times 0, k·dt, ..., t1 (scheme "ito": x/|x|).

    Raises
    ------
    ValueError, TypeError
        tokens off the sphere, a missing or conflicting ``paths``, t1/dt not whole, an unknown scheme.
    """
    check_tokens(x0, "x0")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}")
    if len(heads.batch_shape) != 0:
        raise ValueError(f"heads must be unbatched (H, d, d); got batch shape {tuple(heads.batch_shape)}")
    t1 = check_real(t1, "t1")
    dt = check_positive(dt, "dt")
    K = round(t1 / dt)
    if K < 1 or abs(K * dt - t1) > 1e-9 * max(1.0, abs(t1)):
        raise ValueError(f"t1/dt = {t1 / dt:.6g} must be a whole number >= 1; choose dt = t1/k")
    every = check_int(record_every, "record_every")
    if x0.dim() == 2:
        if paths is None:
            raise ValueError("x0 is one configuration (n, d): give paths=P, or pass x0 as (P, n, d)")
        x = x0.expand(check_int(paths, "paths"), *x0.shape).clone()
    elif x0.dim() == 3:
        if paths is not None and paths != x0.shape[0]:
            raise ValueError(f"paths = {paths} but x0 has {x0.shape[0]} paths (P, n, d); leave paths out")
        x = x0.clone()
    else:
        raise ValueError(f"x0 must be (n, d) or (P, n, d), got shape {tuple(x0.shape)}")
    seed = check_seed_generator(seed, generator)
    if generator is None:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed)
    sig = _sigma_heads(sigma, heads, x)
    P, H, d = x.shape[0], heads.num_heads, x.shape[-1]
    amp = (heads.weights * sig * math.sqrt(dt))[:, None, None]  # (H, 1, 1)
    out = [x]
    for k in range(K):  # the steps of the SDE (sequential in time; paths, heads and tokens are batched)
        xs = x / x.norm(dim=-1, keepdim=True)  # the coefficients extended radially (x itself when projected)
        drift, _, y = homogenized_coefficients(xs, heads, sig, normalization=normalization, direction=direction)
        B = torch.randn((P, H, d, d), generator=generator, dtype=x.dtype, device=x.device) * amp
        dM = torch.einsum("phde,phne->pnd", B, y)
        dM = dM - (dM * xs).sum(-1, keepdim=True) * xs
        x = x + drift * dt + dM
        if scheme == "projected":
            x = x / x.norm(dim=-1, keepdim=True)
        if (k + 1) % every == 0 or k == K - 1:
            out.append(x / x.norm(dim=-1, keepdim=True))
    return torch.stack(out)


# ------------------------------------------------------------------------------------------ two tokens
def _two_token(rho, beta: float, d: int, sigma: float, alpha: float, direction: str):
    """(c, m) of dρ = (1 − ρ²)[c dt + σ√(2m) dW] (module docstring), from the self weight p."""
    beta = check_real(beta, "beta")
    d = check_int(d, "d", minimum=2)
    s2 = check_positive(sigma, "sigma", allow_zero=True) ** 2
    alpha = check_real(alpha, "alpha")
    sgn = direction_sign(direction)
    p = torch.sigmoid(beta * (1.0 - rho))  # e^β/(e^β + e^{βρ})
    q = 1.0 - p
    m = p * p + q * q
    return 2 * sgn * alpha * q + s2 * (2 * (d - 2) * p * q - m * rho), m


def two_token_coefficients(rho, beta: float, d: int, sigma: float = 1.0, alpha: float = 0.0,
                           direction: str = DEFAULT_DIRECTION) -> Tuple[torch.Tensor, torch.Tensor]:
    """(b(ρ), a²(ρ)): the drift and squared diffusion of ρ = ⟨x₁, x₂⟩ for two tokens, one head A = I, V̄ = αI.

    From the Itô coefficients of the module docstring (K₁₁ − ρK₁₂ = σ² m (1 − ρ²), m = p² + (1 − p)²):

        b = (1 − ρ²) [2sα(1 − p) + σ² (2(d − 2) p(1 − p) − m ρ)],    a² = 2σ² m (1 − ρ²)²,

    p = e^β/(e^β + e^{βρ}) the self weight, s the direction's sign.

    Parameters
    ----------
    rho : torch.Tensor
        inner products in [−1, 1] (any shape; float dtype).
    beta : float
        β (any sign).
    d : int
        the dimension, >= 2.
    sigma, alpha : float
        the value noise σ >= 0 and the mean value α.
    direction : str
        the sign s of the mean field.

    Returns
    -------
    tuple of torch.Tensor
        (b, a²), each shaped like ρ.

    Raises
    ------
    TypeError, ValueError
        rho not a floating-point tensor, d < 2, σ < 0.
    """
    if not isinstance(rho, torch.Tensor) or not rho.is_floating_point():
        raise TypeError("rho must be a floating-point tensor")
    c, m = _two_token(rho, beta, d, sigma, alpha, direction)
    one = 1.0 - rho * rho
    return one * c, 2 * float(sigma) ** 2 * m * one * one


def boundary_exponents(beta: float, d: int, sigma: float = 1.0, alpha: float = 0.0,
                       direction: str = DEFAULT_DIRECTION) -> Tuple[float, float]:
    """(λ₋, λ₊): the Lyapunov exponents of 1 + ρ at the antipodal end ρ = −1 and of 1 − ρ at the clustered end
    ρ = 1 of the two-token diffusion.

    With u = artanh ρ, du = [c + 2σ² m ρ] dt + σ√(2m) dW (Itô), and log(1 ± ρ) ≈ ±2u near ∓1, so

        λ₋ = 4sα(1 − p₋) + σ² ((d − 1)/cosh²β − 2),   p₋ = e^β/(e^β + e^{−β}),
        λ₊ = −2sα − σ² (d − 1).

    An end point is reached with positive probability iff its exponent is < 0.

    Parameters
    ----------
    beta, d, sigma, alpha, direction
        as :func:`two_token_coefficients`.

    Returns
    -------
    tuple of float
        (λ₋, λ₊).
    """
    beta = check_real(beta, "beta")
    d = check_int(d, "d", minimum=2)
    s2 = check_positive(sigma, "sigma", allow_zero=True) ** 2
    sgn = direction_sign(direction)
    alpha = check_real(alpha, "alpha")
    q = 1.0 / (1.0 + math.exp(2.0 * beta)) if beta < 350 else 0.0
    lam_minus = 4 * sgn * alpha * q + s2 * ((d - 1) / math.cosh(beta) ** 2 - 2.0) if abs(beta) < 350 else \
        4 * sgn * alpha * q - 2.0 * s2
    return lam_minus, -2 * sgn * alpha - s2 * (d - 1)


def critical_dimension(beta: float) -> float:
    """d_c(β) = 1 + 2cosh²β: centred values (α = 0), the dimension at which λ₋ changes sign.

    Antipodal pairs are reached with positive probability for d < d_c and not for d > d_c (d_c = 3 at β = 0).
    """
    beta = check_real(beta, "beta")
    return 1.0 + 2.0 * math.cosh(beta) ** 2


def antipodal_probability(rho0, beta: float, d: int, sigma: float = 1.0, alpha: float = 0.0, *,
                          direction: str = DEFAULT_DIRECTION, span: float = 40.0, points: int = 40001) -> torch.Tensor:
    """P(ρ_t → −1) from ρ₀: the probability that two tokens end antipodal (else they cluster, ρ_t → 1).

    With u = artanh ρ (drift D(u) = c + 2σ² m ρ, squared diffusion 2σ² m; :func:`boundary_exponents`) and the
    scale density s'(u) = exp(−∫₀ᵘ D/(σ² m)), P = ∫_{u₀}^{∞} s' / ∫_{−∞}^{∞} s'.  It is 0 when λ₋ ≥ 0 (s' is not
    integrable at −∞).  The integrals are trapezoid sums on [−span, span] with the exponential tails added in
    closed form.

    Parameters
    ----------
    rho0 : float or torch.Tensor
        initial inner products in (−1, 1).
    beta, d, sigma, alpha, direction
        as :func:`two_token_coefficients` (σ > 0).
    span, points : float, int
        the u-interval and the number of grid points.

    Returns
    -------
    torch.Tensor
        the probabilities, float64, shaped like rho0.

    Raises
    ------
    ValueError
        σ = 0, or ρ₀ outside (−1, 1).
    """
    if check_positive(sigma, "sigma") <= 0:
        raise ValueError("sigma must be > 0")
    r0 = torch.as_tensor(rho0, dtype=torch.float64)
    if bool((r0.abs() >= 1).any()):
        raise ValueError("rho0 must lie in the open interval (-1, 1)")
    lam_minus, lam_plus = boundary_exponents(beta, d, sigma, alpha, direction)
    if lam_minus >= 0:
        return torch.zeros_like(r0)
    if lam_plus >= 0:
        return torch.ones_like(r0)
    U = check_positive(span, "span")
    n = check_int(points, "points", minimum=101)
    u = torch.linspace(-U, U, n, dtype=torch.float64)
    rho = torch.tanh(u)
    c, m = _two_token(rho, beta, d, sigma, alpha, direction)
    s2 = float(sigma) ** 2
    f = (c + 2 * s2 * m * rho) / (s2 * m)  # 2D/e²
    h = float(u[1] - u[0])
    F = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(0.5 * h * (f[1:] + f[:-1]), 0)])
    F = F - F[n // 2]
    logs = -F
    top = float(logs.max())
    sp = torch.exp(logs - top)
    k_minus, k_plus = float(f[0]), float(f[-1])  # the constant slopes of −log s' at the ends: s' ~ e^{−k u}
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(0.5 * h * (sp[1:] + sp[:-1]), 0)])
    left_tail = float(sp[0]) / (-k_minus)  # k₋ < 0 when λ₋ < 0
    right_tail = float(sp[-1]) / k_plus
    total = left_tail + float(cum[-1]) + right_tail
    u0 = torch.atanh(r0.clamp(-1 + 1e-16, 1 - 1e-16)).clamp(-U, U)
    idx = ((u0 + U) / h).floor().long().clamp(0, n - 2)
    frac = (u0 - u[idx]) / h
    below = left_tail + cum[idx] + frac * h * sp[idx]  # ∫_{−∞}^{u₀} s' to first order inside the cell
    return ((total - below) / total).reshape(r0.shape)


def _cheb(N: int):
    """Chebyshev points ξ_j = cos(πj/N) and the differentiation matrix (Trefethen, Spectral Methods in MATLAB)."""
    j = torch.arange(N + 1, dtype=torch.float64)
    x = torch.cos(math.pi * j / N)
    c = torch.ones(N + 1, dtype=torch.float64)
    c[0] = c[-1] = 2.0
    c = c * (-1.0) ** j
    X = x[:, None] - x[None, :]
    D = (c[:, None] / c[None, :]) / (X + torch.eye(N + 1, dtype=torch.float64))
    D = D - torch.diag(D.sum(1))
    return x, D


def two_token_expectation(f: Callable, rho0, t: float, beta: float, d: int, sigma: float = 1.0, alpha: float = 0.0,
                          *, nodes: int = 256, span: Optional[float] = None,
                          direction: str = DEFAULT_DIRECTION) -> torch.Tensor:
    """E f(ρ_t) given ρ₀ for the two-token diffusion, by the backward Kolmogorov equation in u = artanh ρ.

    v(t, u) = E f(tanh u_t) solves v_t = D(u) v' + σ² m(u) v'' (the u-diffusion of :func:`boundary_exponents`);
    in u the solution is smooth (in ρ it has fractional powers of 1 ± ρ at the ends), so Chebyshev collocation on
    [−U, U] with v(t, ±U) = f(±1) converges spectrally; v(t) = exp(tG) f by the matrix exponential.

    Parameters
    ----------
    f : callable
        test function, float64 tensor → tensor (continuous on [−1, 1]).
    rho0 : float or torch.Tensor
        initial inner products in [−1, 1] (±1 are fixed points: f(±1)).
    t : float
        the time, >= 0.
    beta, d, sigma, alpha, direction
        as :func:`two_token_coefficients`.
    nodes : int
        the collocation degree N (compare N and 3N/2 for the discretisation error).
    span : float or None
        U; None: 20 + 3 max|D| t + 6σ√t (the ends move by at most that in time t).

    Returns
    -------
    torch.Tensor
        E f(ρ_t), float64, shaped like rho0.

    Raises
    ------
    TypeError, ValueError
        f not callable, t < 0, ρ₀ outside [−1, 1].
    """
    if not callable(f):
        raise TypeError("f must be a callable tensor -> tensor")
    t = check_real(t, "t")
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    N = check_int(nodes, "nodes", minimum=8)
    r0 = torch.as_tensor(rho0, dtype=torch.float64)
    if bool((r0.abs() > 1 + 1e-12).any()):
        raise ValueError("rho0 must lie in [-1, 1]")
    s2 = check_positive(sigma, "sigma", allow_zero=True) ** 2
    ends = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    c_end, m_end = _two_token(ends, beta, d, sigma, alpha, direction)
    drift_end = (c_end + 2 * s2 * m_end * ends).abs().max()
    U = float(20.0 + 3.0 * float(drift_end) * t + 6.0 * math.sqrt(s2 * t)) if span is None else \
        check_positive(span, "span")
    xi, D = _cheb(N)
    u = U * xi
    Du = D / U
    rho = torch.tanh(u)
    c, m = _two_token(rho, beta, d, sigma, alpha, direction)
    G = (c + 2 * s2 * m * rho)[:, None] * Du + (s2 * m)[:, None] * (Du @ Du)
    G[0] = 0.0  # v(t, ±U) = f(±1)
    G[-1] = 0.0
    f0 = f(rho).to(torch.float64)
    f0[0], f0[-1] = f(ends[1:]).to(torch.float64).reshape(()), f(ends[:1]).to(torch.float64).reshape(())
    v = torch.linalg.matrix_exp(t * G) @ f0
    # barycentric interpolation at u₀ = artanh ρ₀ (Chebyshev points of the second kind)
    w = (-1.0) ** torch.arange(N + 1, dtype=torch.float64)
    w[0] *= 0.5
    w[-1] *= 0.5
    flat = r0.reshape(-1)
    u0 = torch.atanh(flat.clamp(-1.0, 1.0)).clamp(-U, U) / U
    diff = u0[:, None] - xi[None, :]
    exact = diff.abs() < 1e-15
    diff = torch.where(exact, torch.ones_like(diff), diff)
    coef = w[None, :] / diff
    val = (coef * v[None, :]).sum(1) / coef.sum(1)
    hit = exact.any(1)
    if bool(hit.any()):
        val = torch.where(hit, (exact.to(v.dtype) * v[None, :]).sum(1), val)
    return val.reshape(r0.shape)
