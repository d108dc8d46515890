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
from ..model.sphere import normalize, tangent_projection

__all__ = ["TokenNoise", "token_noise", "token_seed", "energy_laplacian", "noise_martingale"]

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

    def ito_correction(self, x, heads: Heads, weights=None, *, log_scale: float = 0.0) -> torch.Tensor:
        """T Σ_i Δ_{S,i} E · e^{−c}, (...,): the expected drift of the energy from the token noise."""
        return self.temperature * energy_laplacian(x, heads, weights, log_scale=log_scale)


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


def noise_martingale(grad_first_variation: torch.Tensor, weights, xi: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i ⟨∇_S δE/δμ(x_i), ξ_i⟩, (...,): the martingale increment of the energy from the token noise
    (``grad_first_variation`` at the step's left end, times e^{−c} like the ledger)."""
    inner = (grad_first_variation * xi).sum(-1)
    return inner.mean(-1) if weights is None else (inner * weights).sum(-1)
