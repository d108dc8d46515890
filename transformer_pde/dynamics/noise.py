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

The diagonal term carries a weight w_i², so it is O(1/N) of the pair terms for uniform weights, and it is
what makes the ledger close for small N.  Every pair term is a kernel average, so the sum comes from softmax
statistics with second moments (:func:`energy_laplacian_moments`, O(n H d⁴) on top of the kernel): the
solvers book it from the step's own statistics, :func:`energy_laplacian` from one kernel pass of its own (the
dense (H, n, n) block of pair terms only where autograd needs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..utils.validation import check_seed
from ..model.backends import needs_grad
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
        gives those columns (the plain-torch kernels) or autograd is on (tokens, heads or weights require grad)."""
        lap = None if stats is None else energy_laplacian_moments(x, heads, weights, stats, log_scale=log_scale)
        if lap is None and not needs_grad(x, heads.score_matrix, heads.weights, heads.beta, weights):
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

    Every term of the pair sum is a kernel average of 1, s_ij, s_ij² or |A y_j|², so it is taken from one
    pass of the fused kernel with its first and second moments (:func:`energy_laplacian_moments`; O(n)
    memory, O(n H d⁴) on top of the kernel).  The dense (..., H, n, n) block of pair terms is formed only
    where autograd needs it (tokens, heads or weights that require grad: the statistics are constants to
    autograd) or where no kernel gives the second-moment columns.
    x (..., n, d) on the sphere, weights (..., n) or None (uniform), c = log_scale."""
    if not needs_grad(x, heads.score_matrix, heads.weights, heads.beta, weights):
        with torch.no_grad():
            stats = softmax_statistics(x, heads, weights, second_moment=True)
        lap = energy_laplacian_moments(x, heads, weights, stats, log_scale=log_scale)
        if lap is not None:
            return lap
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
    out = [ȳ_i, C_i] with coefficients quadratic in x_i: G = φ(x_i) @ W_h, φ = [1, x] ⊗ [1, x]
    (:func:`_coefficients`), one product for every head and token.  The diagonal term replaces the
    pair formula at j = i by its own (module docstring); the difference is
    e^{β s_ii} [2β(tr A − s_ii) + 2β²(x_iᵀ A² x_i − s_ii²)], whose quadratic forms come from the same
    product.  O(n H d⁴) on top of the statistics ((1 + d)² × (c + 3) per token and head).  x (..., n, d)
    on the sphere (the queries the statistics were computed at), weights (..., n) or None (uniform),
    c = log_scale.  None also when the heads or the token weights require grad (the statistics are constants
    to autograd: the dense sum differentiates through them)."""
    beta = heads.beta if isinstance(heads.beta, torch.Tensor) else None
    if needs_grad(heads.score_matrix, heads.weights, beta, weights):
        return None
    cols = second_moment_columns(stats, x, log_scale)
    if cols is None:
        return None
    out, mass, c, trace_free = cols  # (..., n, H, E), (..., n, H)
    H, n = mass.shape[-1], x.shape[-2]
    W, omega = _coefficients(heads, c, trace_free)  # (..., F, H·(c + 3)), ω_h/(2β) (..., H)
    xe = torch.nn.functional.pad(x, (1, 0), value=1.0)  # [1, x]
    G = ((xe.unsqueeze(-1) * xe.unsqueeze(-2)).flatten(-2) @ W).unflatten(-1, (H, c + 3))  # (..., n, H, c + 3)
    pair = torch.linalg.vecdot(G[..., :c], out[..., :c]) + G[..., c]  # ω/(2β) times the bracket
    bs = G[..., c + 1]  # β s_ii
    diag = torch.exp(bs if log_scale == 0.0 else bs - log_scale) * torch.addcmul(G[..., c + 2], bs, bs, value=-2.0)
    if weights is None:
        return (mass * pair + diag * (omega.unsqueeze(-2) / n)).sum((-1, -2)) / n
    w = weights.unsqueeze(-1)
    return ((mass * pair + diag * (w * omega.unsqueeze(-2))).sum(-1) * weights).sum(-1)


#: the last coefficients W of :func:`_coefficients` and what they were formed from (heads fixed over a run)
_LAST = [None]


def _coefficients(heads: Heads, c: int, trace_free: bool):
    """(W, ω_h/(2β)): W (..., F, H·(c + 3)), F = (1 + d)², such that for the token features
    φ = [1, x] ⊗ [1, x] and head h, φ @ W_h gives, times ω_h/(2β), the coefficients of the kernel's value
    columns [ȳ (d), C (c − d)] in the pair bracket of :func:`energy_laplacian_moments` and its constant,
    then β xᵀA x and 2β(tr A − xᵀA x) + 2β² xᵀA² x (the diagonal term's, unscaled):

        β²⟨AᵀA, M⟩        → row 1, on M                    −2(d−1)β ⟨Aᵀx, ȳ⟩   → row x_a, on ȳ_b: A_ab
        β²|Aᵀx|²          → rows x_c x_e, const: AAᵀ        −2β² xᵀA M Aᵀx      → rows x_c x_e, on M_ab: A_ca A_eb

    A coefficient on the full M (d × d) goes to the columns C_{a≤b} (and, for keys on the sphere,
    C_dd = 1 − Σ_{a<d} C_aa, to the constant) through :func:`_column_map`; one index_add places the
    entries (:func:`_placement`).  Kept for the next call with the same (unchanged) heads."""
    score, beta, om = heads.score_matrix, heads.beta, heads.weights
    key = (c, trace_free, score._version, om._version, beta._version if isinstance(beta, torch.Tensor) else beta)
    last = _LAST[0]
    if last is not None and last[0] is score and last[1] is om and last[2] is beta and last[3] == key:
        return last[4]
    A, H, d = score, score.shape[-3], score.shape[-1]
    if not isinstance(beta, float):
        beta = beta.unsqueeze(-1)  # against (..., H)
    omega = om / (2 * beta)  # E = Σ_h ω_h/(2β) Σ_ij w_i w_j e^{β s_ij}
    b = beta if isinstance(beta, float) else beta.unsqueeze(-1)  # against (..., H, ·)
    batch = torch.broadcast_shapes(A.shape[:-3], omega.shape[:-1])
    A, w = A.expand(*batch, H, d, d), omega.expand(*batch, H).unsqueeze(-1)  # every part carries the whole batch
    At = A.transpose(-1, -2)
    prods = torch.cat([At, A, A], -3) @ torch.cat([A, At, A], -3)  # AᵀA, AAᵀ, A²
    kron = (A[..., :, None, :, None] * A[..., None, :, None, :]).flatten(-4, -3).flatten(-2)  # [(c,e), (a,b)]
    onM = torch.cat([prods[..., :H, :, :].flatten(-2).unsqueeze(-2), -2 * kron], -2)  # rows 1, x ⊗ x; on M
    onC = onM @ _column_map(d, c, trace_free, A.device, A.dtype)  # (..., H, 1 + d², c − d + 1): on C, const
    lin, AAt, A2 = A.flatten(-2), prods[..., H:2 * H, :, :].flatten(-2), prods[..., 2 * H:, :, :].flatten(-2)
    trA = A.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)  # (..., H, 1)
    src = torch.cat([torch.cat([onC.flatten(-2), AAt], -1) * (b * b * w), lin * (-2 * (d - 1) * b * w), b * lin,
                     2 * b * (b * A2 - lin), 2 * b * trA], -1)
    F = (1 + d) ** 2
    W = src.new_zeros(*batch, H, F * (c + 3)).index_add_(-1, _placement(d, c, src.device), src)
    W = W.unflatten(-1, (F, c + 3)).transpose(-2, -3).reshape(*batch, F, H * (c + 3))
    _LAST[0] = (score, om, heads.beta, key, (W, omega))
    return W, omega


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


def _placement(d: int, c: int, device) -> torch.Tensor:
    """The positions in W_h (F × (c + 3), row-major; row p(1 + d) + q of φ = [1, x]_p [1, x]_q) of
    :func:`_coefficients`'s source entries, in order: on C and the constant for rows 1 and x ⊗ x, AAᵀ on
    the constant of rows x ⊗ x, A on ȳ of rows x, then the last two columns: A, and A² − A with tr A on row 1."""
    key = ("place", d, c, str(device))
    if key not in _MAPS:
        w = c + 3
        a = torch.arange(d)
        quad = ((1 + a[:, None]) * (1 + d) + 1 + a).flatten()  # the rows x_c x_e, c-major
        rows = torch.cat([torch.zeros(1, dtype=torch.long), quad])  # row 1, then x ⊗ x
        on_c = (rows[:, None] * w + d + torch.arange(c - d + 1)).flatten()
        on_mean = ((1 + a)[:, None] * w + a).flatten()  # the rows x_a (φ's [1, x_a]), on ȳ_b
        _MAPS[key] = torch.cat([on_c, quad * w + c, on_mean, quad * w + c + 1, quad * w + c + 2,
                                torch.tensor([c + 2])]).to(device)
    return _MAPS[key]


def noise_martingale(grad_first_variation: torch.Tensor, weights, xi: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i ⟨∇_S δE/δμ(x_i), ξ_i⟩, (...,): the martingale increment of the energy from the token noise
    (``grad_first_variation`` at the step's left end, times e^{−c} like the ledger)."""
    inner = (grad_first_variation * xi).sum(-1)
    return inner.mean(-1) if weights is None else (inner * weights).sum(-1)
