"""Pendharkar's quantities measured on the full particle system (docs/model.md#theory).

The particle side of :mod:`transformer_pde.analysis.theory` (whose closed forms they are checked against);
re-exported, with :mod:`.attention_geometry` (attention entropy, orthogonal heads) and :mod:`.flows` (the flat
flow, clustering hitting times), as :mod:`transformer_pde.analysis.diagnostics`.  Generic cluster statistics used by
every study (:func:`~transformer_pde.analysis.clustering.mean_overlap`, cluster counts and masses) live in
:mod:`transformer_pde.analysis.clustering`.

Notation.  Tokens x_i (..., n, d) with weights w_i (uniform by default); heads (A_h, V_h, ω_h, β);
scores s_ij^h = β⟨x_i, A_h x_j⟩.  Head outputs f_h(x_i) are the library's (``tp.head_outputs``):
softmax f_h = Σ_j p_ij^h V_h x_j with p_ij^h = w_j e^{s_ij^h}/m_h(x_i), unnormalized
f_h = Σ_j w_j e^{s_ij^h} V_h x_j, relu f_h = Σ_j w_j ReLU(s_ij^h) V_h x_j.  Per-head energies

    E_h = (1/(2β)) Σ_ij w_i w_j e^{s_ij^h},    E = Σ_h ω_h E_h,

so that with uniform weights and ω_h = 1 they are Pendharkar's E_h = (1/(2βn²)) Σ_ij e^{β⟨x_i, M_h x_j⟩}
and his velocity v_i = (1/n) Σ_h f_i^h (his f_i^h = Σ_j e^{…} M_h x_j) is our unnormalized
Σ_h f_h.  The gradient of the first variation of E_h (no ω_h) is

    G_h(x_i) = ∇_x δE_h/δμ (x_i) = ½ Σ_j w_j [e^{s_ij^h} A_h x_j + e^{s_ji^h} A_hᵀ x_j],

equal to the unnormalized output f_h for symmetric heads with V_h = A_h.  "Sphere" dynamics are
ẋ_i = s P_{x_i} Σ_h ω_h f_h(x_i) (the library's field); "flat" dynamics drop the projection,
ẋ_i = s Σ_h ω_h f_h(x_i), and let tokens leave the sphere.  s = +1 ("ascent", Pendharkar's
convention: tokens cluster) unless a function takes ``direction``.  Every function states which
normalisation it uses; the energy identities are for unnormalised heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_choice, check_int, check_positive, check_same, check_tensor, direction_sign
from ...model.softmax import softmax_statistics
from ...model.field import check_inputs, grad_first_variation_terms, head_token_mean, token_mean, evaluate
from ...model.finite_part import over_two_beta, pair_mean_scores
from ...model.heads import Heads
from ...model.normalization import choose as choose_normalization, names
from ..clustering import mean_overlap
from ...model.sphere import equiangular, tangent_projection

__all__ = [
    "EnergyBalance",
    "RadialDecomposition",
    "flat_velocity",
    "flat_head_energies",
    "head_energy_rates",
    "energy_balance",
    "radial_decomposition",
    "radial_dominance_margin",
    "radial_dominance_threshold",
    "robust_margin",
    "orthogonality_defect",
    "mean_overlap",
]

# shared with the other particle diagnostics (named internal API)
__internal__ = ["OUTPUT_NORMALIZATIONS", "beta_factor", "check_any", "dense_scores", "head_outputs_of", "log_weights"]

#: the normalisations with per-head outputs f_h (all but "effective")
OUTPUT_NORMALIZATIONS = names(lambda n: n.head_outputs)


# ---------------------------------------------------------------------------- checks and kernels
def check_any(x, heads, weights, *, on_sphere: bool) -> Heads:
    """The library's checks; with on_sphere=False the tokens may have any non-zero norm (flat dynamics).
    Returns the heads with β resolved at n = x.shape[-2] (a rule of the context length)."""
    return check_inputs(x, heads, weights, on_sphere=on_sphere)


def beta_factor(heads: Heads, extra: int):
    """β shaped to broadcast against (..., [extra trailing dims])."""
    b = heads.beta
    if isinstance(b, torch.Tensor) and b.dim() > 0:
        return b.reshape(*b.shape, *([1] * extra))
    return b


def head_outputs_of(x, heads, weights, normalization):
    """Unprojected per-head outputs f_h(x_i), (..., H, n, d)."""
    return evaluate(x, heads, weights, normalization=normalization, diagnostics=False).outputs


def _gradients(x, heads, weights):
    """G_h(x_i), (..., H, n, d), and the kernel statistics (log m_h at x_i)."""
    stats = softmax_statistics(x, heads, weights)
    terms = grad_first_variation_terms(x, heads, weights, stats)
    G = sum(torch.exp(l).unsqueeze(-1) * u for l, u in terms)
    return G, stats


def dense_scores(x, heads):
    """s_ij^h = β⟨x_i, A_h x_j⟩, (..., H, n, n), for any x (dense; diagnostics only)."""
    A = heads.score_matrix
    xs = x.unsqueeze(-3)
    return beta_factor(heads, 3) * (xs @ A @ xs.transpose(-1, -2))


def log_weights(x, weights):
    n = x.shape[-2]
    if weights is None:
        return torch.full(x.shape[:-1], -math.log(n), dtype=x.dtype, device=x.device)
    return torch.log(weights)


# ---------------------------------------------------------------------------- energies and rates
def flat_velocity(x, heads: Heads, weights=None, *, normalization: str = "unnormalized", direction: str = DEFAULT_DIRECTION):
    """Flat (unprojected) velocity v_i = s Σ_h ω_h f_h(x_i), (..., n, d); tokens may be off the sphere.

    With uniform weights, ω_h = 1 and normalization="unnormalized" this is Pendharkar's
    v_i = (1/n) Σ_h f_i^h."""
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    s = direction_sign(direction)
    heads = check_any(x, heads, weights, on_sphere=False)
    return s * (heads.weights[..., None, None] * head_outputs_of(x, heads, weights, normalization)).sum(-3)


def flat_head_energies(x, heads: Heads, weights=None):
    """E_h = (1/(2β)) Σ_ij w_i w_j e^{β⟨x_i, A_h x_j⟩}, (..., H), for tokens anywhere in R^d
    (``tp.head_energies`` requires unit tokens); at β = 0 its finite part ½ Σ_ij w_i w_j ⟨x_i, A_h x_j⟩."""
    heads = check_any(x, heads, weights, on_sphere=False)
    lse = softmax_statistics(x, heads, weights).log_partition
    b = beta_factor(heads, 1)
    per_head = heads if isinstance(b, float) else heads.replace(beta=b)
    return over_two_beta(head_token_mean(torch.exp(lse), weights), per_head,
                         lambda: 0.5 * pair_mean_scores(x, heads, weights))


def _token_velocity(x, heads, weights, normalization, direction, flat):
    if flat:
        s = direction_sign(direction)
        return s * (heads.weights[..., None, None] * head_outputs_of(x, heads, weights, normalization)).sum(-3)
    s = direction_sign(direction)
    return evaluate(x, heads, weights, normalization=normalization, sign=s, diagnostics=False).velocity


def head_energy_rates(x, heads: Heads, weights=None, *, normalization: str = "unnormalized",
                      direction: str = DEFAULT_DIRECTION, flat: bool = False, velocity: Optional[torch.Tensor] = None):
    """Per-head energy derivatives dE_h/dt = Σ_i w_i ⟨G_h(x_i), ẋ_i⟩, (..., H), heads constant in time.

    ẋ is ``velocity`` when given, else the sphere field s P_x Σ_k ω_k f_k (flat=False) or the flat
    field s Σ_k ω_k f_k (flat=True) of the given normalisation.  Valid for any heads (symmetric
    or not, V_h = A_h or not); E_h carries no ω_h.

    Returns
    -------
    result
        (..., H); Σ_h ω_h dE_h/dt = dE/dt.
    """
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    direction_sign(direction)
    heads = check_any(x, heads, weights, on_sphere=not flat)
    G, _ = _gradients(x, heads, weights)
    if velocity is None:
        velocity = _token_velocity(x, heads, weights, normalization, direction, flat)
    else:
        check_tensor(velocity, "velocity")
        check_same(x, velocity, "x", "velocity")
        if velocity.shape[-2:] != x.shape[-2:]:
            raise ValueError(f"velocity must have the shape (..., n, d) of x, got {tuple(velocity.shape)}")
    return head_token_mean((G * velocity.unsqueeze(-3)).sum(-1), weights)


@dataclass
class EnergyBalance:
    """Energy identity of unnormalised heads, dE/dt = s Σ_i w_i ‖ẋ_i‖² (+ defect), each (...,).

    rate:    dE/dt = Σ_i w_i ⟨Σ_h ω_h G_h(x_i), ẋ_i⟩ (exact, any heads).
    kinetic: Σ_i w_i ‖ẋ_i‖² (Pendharkar's (1/n) Σ_i ‖ẋ_i‖²).
    defect:  rate − s·kinetic; zero when every A_h = A_hᵀ and V_h = A_h.
    bound:   a-priori bound on |defect| (see :func:`energy_balance`).
    """

    rate: torch.Tensor
    kinetic: torch.Tensor
    defect: torch.Tensor
    bound: torch.Tensor


def energy_balance(x, heads: Heads, weights=None, *, flat: bool = False, direction: str = DEFAULT_DIRECTION) -> EnergyBalance:
    """Total-energy monotonicity of unnormalised multi-head attention and its defect.

    For symmetric heads with tied values (A_h = A_hᵀ, V_h = A_h, any ω_h ≥ 0), along the sphere
    dynamics ẋ_i = s P_{x_i} v_i and the flat dynamics ẋ_i = s v_i, v_i = Σ_h ω_h f_h(x_i) unnormalized,

        dE/dt = s Σ_i w_i ‖ẋ_i‖²          (Pendharkar: dE_multi/dt = (1/n) Σ_i ‖ẋ_i‖²).

    Otherwise dE/dt = s Σ_i w_i ‖ẋ_i‖² + defect, defect = Σ_i w_i ⟨Σ_h ω_h G_h(x_i) − v_i, ẋ_i⟩, and

        |defect| ≤ Σ_i w_i ‖ẋ_i‖ · Σ_h ω_h R e^{S_h} ( ‖A_h − V_h‖ + ½(1 + βR²‖A_h‖) ‖A_h − A_hᵀ‖ )

    with R = max_j ‖x_j‖ (1 on the sphere), S_h = max_ij s_ij^h ≤ βR²‖A_h‖ and spectral norms.
    (Per head, G_h − f_h = Σ_j w_j [e^{s_ij}(A − V)x_j + ½(e^{s_ji}Aᵀ − e^{s_ij}A)x_j]; use
    |s_ji − s_ij| ≤ βR²‖A − Aᵀ‖ and |e^a − e^b| ≤ e^{max(a,b)}|a − b|.)

    Returns
    -------
    EnergyBalance
        :class:`EnergyBalance` of (...,) tensors.

    Raises
    ------
    TypeError, ValueError
        for bad tokens (off the sphere unless flat=True), heads or weights.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> x = tp.sphere.sample_uniform(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> heads = tp.Heads.scalar(torch.tensor([1.0, 2.0], dtype=torch.float64), 3, weights=torch.ones(2, dtype=torch.float64))
    >>> eb = tp.diagnostics.energy_balance(x, heads)
    >>> bool(torch.isclose(eb.rate, eb.kinetic)), float(eb.defect) == 0.0 or abs(float(eb.defect)) < 1e-14
    (True, True)
    """
    s = direction_sign(direction)
    heads = check_any(x, heads, weights, on_sphere=not flat)
    G, _ = _gradients(x, heads, weights)
    f = head_outputs_of(x, heads, weights, "unnormalized")
    omega = heads.weights[..., None, None]
    v = (omega * f).sum(-3)
    xdot = s * (v if flat else tangent_projection(x, v))
    rate = token_mean(((omega * G).sum(-3) * xdot).sum(-1), weights)
    speed = xdot.norm(dim=-1)
    kinetic = token_mean(speed.square(), weights)
    A, V = heads.score_matrix, heads.value_matrix
    R = x.norm(dim=-1).amax(-1)  # (...,)
    normA = torch.linalg.matrix_norm(A, ord=2)
    asym = torch.linalg.matrix_norm(A - A.transpose(-1, -2), ord=2)
    mis = torch.linalg.matrix_norm(A - V, ord=2)
    bR2 = abs(beta_factor(heads, 1)) * (R * R).unsqueeze(-1)
    smax = dense_scores(x, heads).amax((-1, -2))  # max_ij s_ij^h ≤ |β|R²‖A_h‖, (..., H)
    per_head = heads.weights * R.unsqueeze(-1) * torch.exp(smax) * (mis + 0.5 * (1 + bR2 * normA) * asym)
    bound = token_mean(speed, weights) * per_head.sum(-1)
    return EnergyBalance(rate, kinetic, rate - s * kinetic, bound)


@dataclass
class RadialDecomposition:
    """Per-head energy rates split into tangential, cross-head and radial-shadow terms (ascent).

    shadows:      (..., H, n) a_i^h = ⟨x_i, f_h(x_i)⟩ of the flow's head outputs.
    grad_shadows: (..., H, n) ⟨x_i, G_h(x_i)⟩ (= shadows for unnormalized tied symmetric heads).
    coupling:     (..., H, H) C_hk = Σ_i w_i ω_k ⟨G_h(x_i), f_k(x_i)⟩  (flat-space coupling).
    shadow:       (..., H, H) S_hk = Σ_i w_i ω_k ⟨x_i, G_h⟩ a_i^k       (radial-shadow coupling).
    flat_rates:   (..., H) dE_h/dt = Σ_k C_hk along the flat dynamics.
    sphere_rates: (..., H) dE_h/dt = Σ_k (C_hk − S_hk) along the sphere dynamics.
    tangential:   (..., H) C_hh − S_hh = ω_h Σ_i w_i ⟨P G_h, f_h⟩ (= ω_h Σ_i w_i ‖P f_h‖² ≥ 0 for
                  unnormalized tied symmetric heads).
    token_rates:  (..., H, n) per-token contributions Σ_k ω_k ⟨P_{x_i} G_h, f_k⟩ (sphere), whose
                  w-weighted sum is sphere_rates.
    flat_token_rates: (..., H, n) Σ_k ω_k ⟨G_h, f_k⟩ (flat), summing to flat_rates.
    """

    shadows: torch.Tensor
    grad_shadows: torch.Tensor
    coupling: torch.Tensor
    shadow: torch.Tensor
    flat_rates: torch.Tensor
    sphere_rates: torch.Tensor
    tangential: torch.Tensor
    token_rates: torch.Tensor
    flat_token_rates: torch.Tensor


def radial_decomposition(x, heads: Heads, weights=None, *, normalization: str = "unnormalized") -> RadialDecomposition:
    """Radial shadows and the per-head energy balance (Pendharkar; unnormalized heads by default).

    With f_k the head outputs of ``normalization`` (the flow ẋ_i = P Σ_k ω_k f_k, ascent), G_h the
    energy gradients and P = I − x xᵀ:

        dE_h/dt |sphere = Σ_i w_i Σ_k ω_k ⟨P G_h, f_k⟩ = Σ_k (C_hk − S_hk),
        dE_h/dt |flat   = Σ_k C_hk,

    C_hk = Σ_i w_i ω_k ⟨G_h, f_k⟩, S_hk = Σ_i w_i ω_k ⟨x_i, G_h⟩ a_i^k.  For exactly orthogonal heads
    (A_h A_k = 0, h ≠ k) and unnormalized tied symmetric heads C_hk = 0 (h ≠ k): every E_h is
    non-decreasing in flat space, while on the sphere the radial-shadow couplings −S_hk remain
    and can make dE_h/dt < 0.  (For descent all rates change sign.)

    Returns
    -------
    RadialDecomposition
        :class:`RadialDecomposition`.
    """
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    heads = check_any(x, heads, weights, on_sphere=True)
    G, _ = _gradients(x, heads, weights)
    f = head_outputs_of(x, heads, weights, normalization)
    xs = x.unsqueeze(-3)
    a = (f * xs).sum(-1)  # (..., H, n)
    aG = (G * xs).sum(-1)
    om = heads.weights.unsqueeze(-2).unsqueeze(-1)  # (..., 1, H, 1): ω_k on the k axis
    # per token, [h, k, i]: ⟨G_h(x_i), f_k(x_i)⟩ and ⟨x_i, G_h⟩ a_i^k, weighted by ω_k
    inner = om * (G.unsqueeze(-3) * f.unsqueeze(-4)).sum(-1)
    sh = om * (aG.unsqueeze(-2) * a.unsqueeze(-3))
    wk = None if weights is None else weights.unsqueeze(-2)  # (..., 1, n): the [h, k, i] values' k axis
    C = head_token_mean(inner, wk)
    S = head_token_mean(sh, wk)
    diag = torch.diagonal(C - S, dim1=-2, dim2=-1)
    return RadialDecomposition(a, aG, C, S, C.sum(-1), (C - S).sum(-1), diag,
                               (inner - sh).sum(-2), inner.sum(-2))


def robust_margin(x, heads: Heads, weights=None, *, flat: bool = False):
    """Lower bound on each token's contribution to dE_h/dt for approximately orthogonal heads, (..., H, n).

    Unnormalized symmetric heads with V_h = A_h and δ_hk = ‖A_h A_k‖₂ (:func:`orthogonality_defect`):

        sphere:  Σ_k ω_k ⟨P f_h, f_k⟩ ≥ ω_h ‖P f_h‖² − Σ_{k≠h} ω_k (a^h a^k + δ_hk m_h m_k)
        flat:    Σ_k ω_k ⟨f_h, f_k⟩   ≥ ω_h ‖f_h‖²   − Σ_{k≠h} ω_k δ_hk m_h m_k

    (|⟨f_h, f_k⟩| ≤ δ_hk m_h m_k, :func:`cross_head_coupling`).  A positive bound for every token
    certifies that E_h increases; δ = 0 recovers the exact orthogonal case (pairwise margin)."""
    heads = check_any(x, heads, weights, on_sphere=True)
    f = head_outputs_of(x, heads, weights, "unnormalized")
    m = torch.exp(softmax_statistics(x, heads, weights).log_partition)  # (..., H, n)
    a = (f * x.unsqueeze(-3)).sum(-1)
    delta = orthogonality_defect(heads)  # (..., H, H)
    om = heads.weights.unsqueeze(-1)  # (..., H, 1)
    wd = delta * heads.weights.unsqueeze(-2)  # δ_hk ω_k
    cross = m * (wd.unsqueeze(-1) * m.unsqueeze(-3)).sum(-2)  # m_h Σ_k ω_k δ_hk m_k  (δ_hh = 0)
    if flat:
        return om * f.square().sum(-1) - cross
    Pf2 = (f.square().sum(-1) - a.square()).clamp_min(0)
    others = (om * a).sum(-2, keepdim=True) - om * a
    return om * Pf2 - a * others - cross


def radial_dominance_margin(x, heads: Heads, weights=None, *, normalization: str = "softmax", form: str = "token"):
    """Per-token radial-dominance margin of every head, (..., H, n).

        form="token"    (Pendharkar):  μ_i^h = ω_h ‖P_{x_i} f_h‖² − ‖f_h‖ Σ_{k≠h} ω_k |a_i^k|
        form="pairwise":               μ_i^h = ω_h ‖P_{x_i} f_h‖² − a_i^h Σ_{k≠h} ω_k a_i^k

    with f_h = f_h(x_i) the head outputs of ``normalization`` (softmax: the scalar-head
    quantitative results) and a_i^k = ⟨x_i, f_k(x_i)⟩.  For orthogonal heads the pairwise form is
    the exact per-token contribution to dE_h/dt; the token form bounds it from below.  A negative
    margin means the radial shadows dominate.  With equal scalar heads αI on orthogonal tokens the
    token form changes sign exactly at ``tp.theory.critical_beta``, the pairwise form at
    cos² ∠(x, f) = 1/H.

    Raises
    ------
    TypeError, ValueError
        for bad tokens, heads or weights, an unknown normalization or form.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> b = tp.theory.critical_beta(2, 10)          # orthogonal tokens, two heads I
    >>> x = torch.eye(10, dtype=torch.float64)
    >>> def heads(beta):
    ...     return tp.Heads.scalar(torch.ones(2, dtype=torch.float64), 10, beta=beta, weights=torch.ones(2, dtype=torch.float64))
    >>> bool((tp.diagnostics.radial_dominance_margin(x, heads(0.99 * b)) > 0).all())
    True
    >>> bool((tp.diagnostics.radial_dominance_margin(x, heads(1.01 * b)) < 0).all())
    True
    """
    normalization = choose_normalization(normalization, OUTPUT_NORMALIZATIONS)
    check_choice(form, ("token", "pairwise"), "form")
    heads = check_any(x, heads, weights, on_sphere=True)
    f = head_outputs_of(x, heads, weights, normalization)
    xs = x.unsqueeze(-3)
    a = (f * xs).sum(-1)
    Pf2 = (f.square().sum(-1) - a.square()).clamp_min(0)
    om = heads.weights.unsqueeze(-1)  # (..., H, 1)
    if form == "token":
        others = (om * a.abs()).sum(-2, keepdim=True) - om * a.abs()
        return om * Pf2 - f.norm(dim=-1) * others
    others = (om * a).sum(-2, keepdim=True) - om * a
    return om * Pf2 - a * others


def radial_dominance_threshold(n: int, lambdas, *, gamma: float = 0.0, form: str = "token",
                               normalization: str = "softmax", tol: float = 1e-12, beta_max: float = 1e4,
                               dtype=torch.float64, device=None) -> torch.Tensor:
    """Inverse temperature at which each head's margin changes sign, located on the particle field.

    Tokens: n equiangular unit vectors with overlap γ in d = max(n, 2) (``tp.sphere.equiangular``);
    heads: scalar heads λ_h I with ω_h = 1 (``tp.Heads.scalar``).  For each head, bisection on β of
    min_i μ_i^h(β) (:func:`radial_dominance_margin`) from the head outputs of the library's field,
    to relative accuracy ``tol``.  All heads are bisected together (one batched field evaluation
    per step).

    Returns
    -------
    torch.Tensor
        (H,) tensor of thresholds β_h: the margin is ≥ 0 below and < 0 above.  ``inf`` when the
        margin stays ≥ 0 up to ``beta_max`` (H = 1), ``-inf`` when it is already negative at
        β → 0⁺ (the closed form is ≤ 0 then).

    Raises
    ------
    OverflowError
        when the margin is not finite before the bracket closes (unnormalized outputs
        grow like e^{λβ}: in float64 from β ≈ 700/λ); the message names β and how to avoid it.
    """
    n = check_int(n, "n", minimum=2)
    check_positive(tol, "tol")
    beta_max = check_positive(beta_max, "beta_max")
    lam = torch.as_tensor(lambdas, dtype=dtype, device=device).reshape(-1)
    if lam.numel() < 1 or not bool(torch.isfinite(lam).all()) or not bool((lam > 0).all()):
        raise ValueError("lambdas must be one or more finite positive head strengths")
    H = lam.numel()
    d = max(n, 2)
    x = equiangular(n, gamma, d, dtype=dtype, device=device)
    ones = torch.ones(H, dtype=dtype, device=device)

    def minmargin(betas):  # betas (B,) -> (B, H)
        heads = Heads.scalar(lam.expand(len(betas), H), d, beta=betas, weights=ones.expand(len(betas), H))
        m = radial_dominance_margin(x, heads, normalization=normalization, form=form)  # (B, H, n)
        if not bool(torch.isfinite(m).all()):  # NaN is neither >= 0 nor < 0: it would end the search there
            bad = betas[~torch.isfinite(m).flatten(1).all(-1)].min().item()
            raise OverflowError(f"radial_dominance_threshold: the {normalization} margin is not finite at "
                                f"beta = {bad:.6g} (the head outputs overflow {dtype}); pass beta_max < {bad:.6g}, "
                                "or use normalization='softmax' or 'effective', whose outputs stay bounded")
        return m.amin(-1)

    tiny = torch.tensor([1e-9], dtype=dtype, device=device)
    out = torch.full((H,), float("nan"), dtype=dtype, device=device)
    m0 = minmargin(tiny)[0]
    out[m0 < 0] = -math.inf
    lo = torch.full((H,), 1e-9, dtype=dtype, device=device)
    hi = torch.full((H,), min(1.0, beta_max), dtype=dtype, device=device)
    open_ = m0 >= 0
    # expand the bracket until every open head has a negative margin at hi (or hi = beta_max)
    while True:
        mh = minmargin(hi).diagonal()
        grow = open_ & (mh >= 0) & (hi < beta_max)
        if not bool(grow.any()):
            break
        lo = torch.where(grow, hi, lo)
        hi = torch.where(grow, (2 * hi).clamp(max=beta_max), hi)
    mh = minmargin(hi).diagonal()
    never = open_ & (mh >= 0)
    out[never] = math.inf
    active = open_ & ~never
    for _ in range(200):
        if not bool(active.any()) or bool(((hi - lo) <= tol * hi)[active].all()):
            break
        mid = 0.5 * (lo + hi)
        mm = minmargin(mid).diagonal()
        neg = mm < 0
        hi = torch.where(active & neg, mid, hi)
        lo = torch.where(active & ~neg, mid, lo)
    out[active] = (0.5 * (lo + hi))[active]
    return out


def orthogonality_defect(heads: Heads) -> torch.Tensor:
    """δ_hk = ‖V_hᵀ V_k‖₂ for h ≠ k (0 on the diagonal), (..., H, H).

    For symmetric heads with tied values this is ‖A_h A_k‖₂; heads are exactly orthogonal when
    δ = max_{h≠k} δ_hk = 0 and approximately orthogonal when δ is small.  It bounds the cross-head
    coupling |⟨f_h(x), f_k(x)⟩| ≤ δ_hk·mass_h(x)·mass_k(x) (:func:`~transformer_pde.analysis.theory.attention_geometry.cross_head_coupling`)."""
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}")
    V = heads.value_matrix
    prod = V.transpose(-1, -2).unsqueeze(-3) @ V.unsqueeze(-4)  # (..., H, H, d, d)
    delta = torch.linalg.matrix_norm(prod, ord=2)
    H = V.shape[-3]
    eye = torch.eye(H, dtype=torch.bool, device=V.device)
    return delta.masked_fill(eye, 0.0)
