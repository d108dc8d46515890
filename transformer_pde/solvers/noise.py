"""Token noise: the Brownian part of dX_i = V[μ_t, Θ_t](X_i) dt + √(2T) ∘ dB_i on S^{d−1}.

B_i are independent Brownian motions on the sphere (generator T·Δ_S; T = 1/κ is the temperature,
T = 0 is the deterministic model).  docs/noisy_tokens.md has the derivations.

**Scheme** (weak order 1).  After the deterministic step x̃ = Φ_dt(x) of the chosen Runge–Kutta
method (already on the sphere), one projected Euler–Maruyama increment with the projective
retraction:

    ξ = √(2T) P_x̃ ΔW,   ΔW ~ N(0, dt I_d),      x_new = (x̃ + ξ) / |x̃ + ξ|.

Since |x̃ + ξ|² = 1 + |ξ|² and E|ξ|² = 2T(d−1)dt, the retraction supplies the Itô drift of the
spherical Brownian motion, −(d−1)T x dt, to first order: E[f(x_new)] = f(x̃) + dt·T Δ_S f(x̃) + O(dt²)
(for V = 0 exactly E⟨x_{k+1}, e⟩ = ρ(dt)⟨x_k, e⟩ with ρ = E(1 + 2T dt χ²_{d−1})^{−1/2}
= 1 − (d−1)T dt + O(dt²)).  The splitting (deterministic step, then noise) keeps the order 1 in
the weak sense for every method; the deterministic order is that of the method.

**Random stream.**  The increments come from a torch.Generator of their own on the tokens'
device, seeded by :func:`token_seed` (a fixed derivation from the run's seed, or the seed the
:class:`TokenNoise` carries): the weights' noise and the tokens' noise never share draws.  The
generator's state is part of the solver state, so a checkpoint resumes the same path.

**Energy ledger.**  For the empirical measure μ = Σ_i w_i δ_{x_i}, Itô's formula for E(μ_t, Θ_t) adds

    T Σ_i Δ_{S,i} E dt   (the Itô correction)   and   Σ_i ⟨∇_i E, ξ_i⟩   (the martingale),

∇_i E = w_i ∇_S δE/δμ(x_i).  E = Σ_h ω_h/(2β) Σ_{ij} w_i w_j e^{β s_ij}, s_ij = ⟨x_i, A_h x_j⟩, is a double
sum, so the Laplacian acting on x_i sees the pair terms j ≠ i (x_i in one slot) and the diagonal
term j = i (x_i in both): with Δ_S f = Δf − ⟨x, ∇²f x⟩ − (d−1)⟨x, ∇f⟩ for the ambient extension,

    pair   (i ≠ j):  (Δ_{S,i} + Δ_{S,j}) e^{β s_ij}
                     = e^{β s_ij} [β²(|A x_j|² − s_ij²) + β²(|Aᵀ x_i|² − s_ij²) − 2(d−1)β s_ij]
    diagonal:        Δ_S e^{β⟨x,Ax⟩} = e^{β s_ii} [2β tr S − 2βd s_ii + 4β² (|S x|² − s_ii²)],  S = (A + Aᵀ)/2.

:func:`energy_laplacian` sums them; the diagonal term carries a weight w_i², so it is O(1/N) of the
pair terms for uniform weights, and it is what makes the ledger close for small N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..utils.validation import check_seed
from ..model.heads import Heads
from ..model.moments import second_moment_columns, sym_pairs
from ..model.softmax import softmax_statistics
from ..model.sphere import normalize, tangent_projection

__all__ = ["TokenNoise", "token_noise", "token_seed", "energy_laplacian", "energy_laplacian_moments",
           "noise_martingale"]

#: salt of the token stream's seed derivation (the weights use the run's seed itself)
_TOKEN_STREAM = 0x70CE2


def token_seed(seed: int) -> int:
    """The seed of the token-noise generator for a run seeded with ``seed`` (independent of the weights'
    stream: numpy's SeedSequence with a fixed spawn key)."""
    seed = check_seed(seed)
    ss = np.random.SeedSequence(seed, spawn_key=(_TOKEN_STREAM,))
    return int(ss.generate_state(1, np.uint64)[0])


@dataclass(frozen=True)
class TokenNoise:
    """The token-noise option of :func:`transformer_pde.simulate`: temperature T ≥ 0 (finite), and an
    optional seed of its own (None: :func:`token_seed` of the run's seed).

    ``weak_order`` = 1 (projected Euler–Maruyama with the projective retraction; module docstring)."""

    temperature: float = 0.0
    seed: Optional[int] = None

    weak_order = 1

    def __post_init__(self):
        T = self.temperature
        if isinstance(T, torch.Tensor) and T.numel() == 1:
            T = T.item()
        if isinstance(T, bool) or not isinstance(T, (int, float, np.floating, np.integer)):
            raise TypeError(f"temperature must be a real number >= 0, got {type(T).__name__} {T!r}")
        T = float(T)
        if not math.isfinite(T) or T < 0:
            raise ValueError(f"temperature must be finite and >= 0 (T = 0: no token noise), got {T}")
        object.__setattr__(self, "temperature", T)
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed, "TokenNoise.seed"))

    @property
    def active(self) -> bool:
        return self.temperature > 0

    def generator(self, run_seed: int, device) -> torch.Generator:
        """The token stream's generator on ``device``."""
        g = torch.Generator(device=device)
        g.manual_seed(token_seed(run_seed) if self.seed is None else self.seed)
        return g

    def increment(self, x: torch.Tensor, dt: float, generator: torch.Generator) -> torch.Tensor:
        """ξ = √(2T dt) P_x z, z ~ N(0, I) of the shape of x (every path, ensemble member and token
        independent), on x's device and dtype."""
        z = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        return math.sqrt(2.0 * self.temperature * dt) * tangent_projection(x.detach(), z)

    @staticmethod
    def apply(x: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        """The retraction (x + ξ)/|x + ξ|."""
        return normalize(x + xi)

    def ito_correction(self, x, heads: Heads, weights=None, *, log_scale: float = 0.0, stats=None) -> torch.Tensor:
        """T Σ_i Δ_{S,i} E · e^{−c}, (...,): the expected drift of the energy from the token noise.

        From the softmax statistics with second moments (:func:`energy_laplacian_moments`): ``stats``, the
        caller's statistics of the tokens x under the heads (a solver step's own), or one kernel pass here
        when None or without the second-moment columns; the dense :func:`energy_laplacian` where no kernel
        gives those columns (autograd, the plain-torch kernels)."""
        lap = None if stats is None else energy_laplacian_moments(x, heads, weights, stats, log_scale=log_scale)
        if lap is None and not (torch.is_grad_enabled() and x.requires_grad):
            with torch.no_grad():
                own = softmax_statistics(x, heads, weights, second_moment=True)
            lap = energy_laplacian_moments(x, heads, weights, own, log_scale=log_scale)
        if lap is None:
            lap = energy_laplacian(x, heads, weights, log_scale=log_scale)
        return self.temperature * lap


def token_noise(temperature) -> Optional[TokenNoise]:
    """``simulate(temperature=...)`` as a TokenNoise (a number or a TokenNoise); None when T = 0."""
    noise = temperature if isinstance(temperature, TokenNoise) else TokenNoise(temperature)
    return noise if noise.active else None


def energy_laplacian(x: torch.Tensor, heads: Heads, weights=None, *, log_scale: float = 0.0) -> torch.Tensor:
    """Σ_i Δ_{S,i} E(x_1, …, x_n) · e^{−c} (module docstring), (...,): the sum over tokens of the
    Laplace–Beltrami operator in each token of E = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}.

    Dense: forms the (..., H, n, n) score block (use it for ledgers of moderate n).
    x (..., n, d) on the sphere, weights (..., n) or None (uniform), c = log_scale."""
    A = heads.score_matrix  # (..., H, d, d)
    n, d = x.shape[-2], x.shape[-1]
    beta = heads.beta_tensor().to(x.dtype)
    b = beta.reshape(*beta.shape, 1, 1, 1) if beta.dim() else beta
    xh = x.unsqueeze(-3)  # (..., 1, n, d)
    Ax = xh @ A.transpose(-1, -2)  # rows A x_j   (..., H, n, d)
    Atx = xh @ A  # rows Aᵀ x_i
    s = xh @ Ax.transpose(-1, -2)  # s_ij = ⟨x_i, A x_j⟩  (..., H, n, n)
    K = torch.exp(b * s - log_scale)
    nA = (Ax * Ax).sum(-1)  # |A x_j|²  (..., H, n)
    nAt = (Atx * Atx).sum(-1)  # |Aᵀ x_i|²
    pair = b * b * (nA.unsqueeze(-2) + nAt.unsqueeze(-1) - 2 * s * s) - 2 * (d - 1) * b * s
    w = torch.full(x.shape[:-1], 1.0 / n, dtype=x.dtype, device=x.device) if weights is None else weights
    ww = w.unsqueeze(-1) * w.unsqueeze(-2)  # (..., n, n)
    total = (ww.unsqueeze(-3) * K * pair).sum((-1, -2))  # all ordered pairs, diagonal by the pair formula
    # diagonal: replace the pair formula by the Laplacian of x ↦ e^{β⟨x, A x⟩}
    S = 0.5 * (A + A.transpose(-1, -2))
    sii = s.diagonal(dim1=-2, dim2=-1)  # (..., H, n)
    Sx = xh @ S  # (..., H, n, d)
    trS = S.diagonal(dim1=-2, dim2=-1).sum(-1).unsqueeze(-1)  # (..., H, 1)
    bd = b.squeeze(-1) if beta.dim() else b
    diag_true = 2 * bd * trS - 2 * bd * d * sii + 4 * bd * bd * ((Sx * Sx).sum(-1) - sii * sii)
    diag_pair = pair.diagonal(dim1=-2, dim2=-1)
    Kii = K.diagonal(dim1=-2, dim2=-1)
    total = total + (w * w).unsqueeze(-2).mul(Kii * (diag_true - diag_pair)).sum(-1)
    bh = beta.unsqueeze(-1) if beta.dim() else beta
    return (heads.weights * total / (2 * bh)).sum(-1)


def energy_laplacian_moments(x: torch.Tensor, heads: Heads, weights, stats, *, log_scale: float = 0.0):
    """:func:`energy_laplacian` from the softmax statistics with second moments, (...,), or None where
    ``stats`` lack the fused kernel's second-moment columns for these queries
    (:func:`~transformer_pde.model.moments.second_moment_columns`).

    With p_ij = w_j e^{β s_ij}/m_h(x_i), ȳ_i = Σ_j p_ij x_j, M_i = Σ_j p_ij x_j x_jᵀ and u_i = Aᵀx_i, the
    pair formula summed over j is a kernel average (every j, the diagonal included):

        Σ_j w_j e^{β s_ij} [β²(|A x_j|² + |u_i|² − 2 s_ij²) − 2(d−1)β s_ij]
            = m_h(x_i) [β²(⟨AᵀA, M_i⟩ + |u_i|² − 2 u_iᵀ M_i u_i) − 2(d−1)β ⟨u_i, ȳ_i⟩].

    The bracket is Σ_l G_l(x_i) out_l + G_const(x_i), linear in the kernel's value columns
    out = [ȳ_i, C_i] with coefficients quadratic in x_i: G = [1, x_i, x_i ⊗ x_i] @ W_h
    (:func:`_coefficients`), so every head and token takes one product and one column sum.  The
    diagonal term replaces the pair formula at j = i by its own (module docstring); the difference is
    e^{β s_ii} [2β(tr A − s_ii) + 2β²(x_iᵀ A² x_i − s_ii²)], its quadratic forms from the same product.
    O(n H d³) on top of the statistics.  x (..., n, d) on the sphere (the queries the statistics were
    computed at), weights (..., n) or None (uniform), c = log_scale."""
    cols = second_moment_columns(stats, x, log_scale)
    if cols is None:
        return None
    out, mass, c, trace_free = cols  # (..., n, H, E), (..., n, H)
    A = heads.score_matrix.to(x.dtype)  # (..., H, d, d)
    H, n, d = A.shape[-3], x.shape[-2], x.shape[-1]
    beta = heads.beta if isinstance(heads.beta, float) else heads.beta.to(x.dtype).unsqueeze(-1)  # against (..., H)
    xx = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)  # (..., n, d²): x_c x_e, c-major
    phi = torch.cat([torch.ones_like(x[..., :1]), x, xx], -1)  # (..., n, 1 + d + d²)
    G = (phi @ _coefficients(A, beta, c, trace_free)).unflatten(-1, (H, c + 3))  # (..., n, H, c + 3)
    pair = (G[..., :c] * out[..., :c]).sum(-1) + G[..., c]
    s, sa = G[..., c + 1], G[..., c + 2]  # s_ii = x_iᵀ A x_i, x_iᵀ A² x_i
    b = beta if isinstance(beta, float) else beta.unsqueeze(-2)  # against (..., n, H)
    trA = A.diagonal(dim1=-2, dim2=-1).sum(-1).unsqueeze(-2)  # (..., 1, H)
    diff = torch.exp(b * s - log_scale) * (2 * b * (trA - s) + 2 * b * b * (sa - s * s))
    w = x.new_full((n, 1), 1.0 / n) if weights is None else weights.unsqueeze(-1)  # (..., n, 1)
    per = (w * (mass * pair + w * diff)).sum(-2)  # (..., H)
    return (heads.weights * per / (2 * beta)).sum(-1)


def _coefficients(A: torch.Tensor, beta, c: int, trace_free: bool) -> torch.Tensor:
    """W (..., F, H·(c + 3)), F = 1 + d + d²: for the token features φ = [1, x, x ⊗ x] and head h, φ @ W_h
    gives the coefficients of the kernel's value columns [ȳ (d), C (c − d)] in the pair bracket of
    :func:`energy_laplacian_moments`, then its constant, then x ᵀA x and x ᵀA² x:

        β²⟨AᵀA, M⟩                → row 1, on M          −2(d−1)β ⟨Aᵀx, ȳ⟩  → rows x_a, on ȳ_b: A_ab
        β²|Aᵀx|²                  → rows x_c x_e, const    −2β² xᵀA M Aᵀx    → rows x_c x_e, on M_ab: A_ca A_eb

    with a coefficient on the full M (d × d) mapped to the columns C_{a≤b} (and, for keys on the sphere,
    C_dd = 1 − Σ_{a<d} C_aa to the constant) by :func:`_column_map`."""
    H, d = A.shape[-3], A.shape[-1]
    At = A.transpose(-1, -2)
    prods = torch.cat([At, A, A], -3) @ torch.cat([A, At, A], -3)  # AᵀA, AAᵀ, A²
    AtA, AAt, A2 = prods[..., :H, :, :], prods[..., H:2 * H, :, :], prods[..., 2 * H:, :, :]
    kron = (A[..., :, None, :, None] * A[..., None, :, None, :]).flatten(-4, -3).flatten(-2)  # [(c,e), (a,b)]
    b2 = beta * beta if isinstance(beta, float) else (beta * beta)[..., None, None]
    onM = torch.cat([AtA.flatten(-2).unsqueeze(-2), -2 * kron], -2) * b2  # rows 1, x⊗x; on M (flat)
    onC = onM @ _column_map(d, c, trace_free, A.device, A.dtype)  # (..., H, 1 + d², c − d + 1): C, const
    batch = onC.shape[:-3]
    W = A.new_zeros(*batch, H, 1 + d + d * d, c + 3)
    W[..., 0, d:c + 1] = onC[..., 0, :]
    W[..., 1 + d:, d:c + 1] = onC[..., 1:, :]
    W[..., 1 + d:, c] += b2.squeeze(-1) * AAt.flatten(-2) if not isinstance(beta, float) else b2 * AAt.flatten(-2)
    b1 = beta if isinstance(beta, float) else beta[..., None, None]
    W[..., 1:1 + d, :d] = (-2 * (d - 1)) * b1 * A
    W[..., 1 + d:, c + 1] = A.flatten(-2)
    W[..., 1 + d:, c + 2] = A2.flatten(-2)
    return W.permute(*range(len(batch)), -2, -3, -1).reshape(*batch, 1 + d + d * d, H * (c + 3))


_MAPS = {}


def _column_map(d: int, c: int, trace_free: bool, device, dtype) -> torch.Tensor:
    """R (d², c − d + 1) with Σ_ab K_ab M_ab = Σ_l (K_flat @ R)_l C_l + (K_flat @ R)_last for a symmetric M
    given by its columns C_{a≤b} (:func:`~transformer_pde.model.moments.sym_pairs` order; without C_dd
    when ``trace_free``: M_dd = 1 − Σ_{a<d} M_aa, whose 1 goes to the last, constant slot)."""
    key = (d, c, trace_free, str(device), dtype)
    if key not in _MAPS:
        (lo, hi), _ = sym_pairs(d, device)
        P = lo.numel()
        pos = torch.empty(d, d, dtype=torch.long, device=device)
        pos[lo, hi] = torch.arange(P, device=device)
        pos[hi, lo] = torch.arange(P, device=device)
        R = torch.nn.functional.one_hot(pos.flatten(), P + 1).to(dtype)  # (d², P + 1), const slot last
        if trace_free:  # K_dd M_dd = K_dd (1 − Σ_{a<d} M_aa)
            dd = R[:, P - 1].clone()
            R[:, pos.diagonal()[:-1]] -= dd.unsqueeze(-1)
            R[:, P] += dd
            R = torch.cat([R[:, :P - 1], R[:, P:]], -1)
        _MAPS[key] = R
    return _MAPS[key]


def noise_martingale(grad_first_variation: torch.Tensor, weights, xi: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i ⟨∇_S δE/δμ(x_i), ξ_i⟩, (...,): the martingale increment of the energy from the token noise
    (``grad_first_variation`` at the step's left end, times e^{−c} like the ledger)."""
    inner = (grad_first_variation * xi).sum(-1)
    return inner.mean(-1) if weights is None else (inner * weights).sum(-1)
