"""Computable constants of the stability theorems (docs/theorems.md).

**Lipschitz bound.**  For heads Θ = (A_h, V_h, ω_h, β) the velocity (x, μ) ↦ V[μ, Θ](x) on the
sphere satisfies, for unit vectors x, y and probability measures μ, ν on S^{d-1},

    |V[μ, Θ](x) − V[ν, Θ](y)| ≤ L_x |x − y| + L_μ W_2(μ, ν)

with a_h = β‖A_h‖₂, v_h = ‖V_h‖₂ (spectral norms) and

    softmax:       L_x = Σ_h ω_h v_h (1 + a_h),              L_μ = Σ_h ω_h v_h e^{a_h} (1 + 2 a_h)
    unnormalized:  L_x = Σ_h ω_h v_h e^{a_h} (1 + a_h),      L_μ = Σ_h ω_h v_h e^{a_h} (1 + a_h)
    relu:          L_x = Σ_h ω_h 2 v_h a_h,                  L_μ = Σ_h ω_h 2 v_h a_h

(the derivations are in docs/theorems.md; the μ-part holds for W_1 as well, with e^{2a_h} in place of
e^{a_h} for softmax).  Along two solutions μ_t, ν_t the pushed-forward optimal coupling gives
Grönwall's estimate W_2(μ_t, ν_t) ≤ W_2(μ_0, ν_0) exp(∫_0^t L(s) ds) with L = L_x + L_μ at Θ_s.

**Fast-weights limit.**  Heads whose value matrices are resampled i.i.d. at every layer of length δ,
V_h = V̄_h + δ^{-1/2} G_h with G_h i.i.d. N(0, s²) entries and the scores A_h fixed, drive the tokens,
as δ → 0, to the Stratonovich SDE with common noise

    dx_i = V[μ, (A, V̄)](x_i) dt + Σ_h ω_h P_{x_i} (s ∘ dW_h) ȳ_h(x_i),
    ȳ_h(x) = ∫ e^{β⟨x,A_h y⟩} y dμ / m_h(x)

(one d×d Brownian matrix W_h per head, shared by all tokens).  :func:`fast_weights_coefficients`
gives its coefficients: the drift b, the Itô correction c = ½ Σ_k (Dg_k) g_k (exact, by automatic
differentiation over the basis of the noise) and the token–token diffusion covariance.
"""

from __future__ import annotations

from typing import Dict

import torch

from ...utils.validation import DEFAULT_DIRECTION
from ...utils.validation import check_choice, check_positive, check_tensor, check_tokens, direction_sign
from ...model.field import head_outputs, velocity
from ...model.heads import Heads
from ...model.normalization import choose as choose_normalization, names

__all__ = ["LIPSCHITZ_NORMALIZATIONS", "lipschitz_constants", "lipschitz_bound", "gronwall_factor",
           "fast_weights_coefficients"]

#: normalisations for which :func:`lipschitz_bound` is derived
#: the normalisations whose per-head Lipschitz constants have a closed form here (softmax, unnormalised, ReLU)
LIPSCHITZ_NORMALIZATIONS = names(lambda n: n.rule in ("softmax", "unnormalized", "relu"))


def _check_heads(heads) -> Heads:
    if not isinstance(heads, Heads):
        raise TypeError(f"heads must be a transformer_pde.Heads, got {type(heads).__name__}")
    return heads


def lipschitz_constants(heads: Heads, normalization: str = "softmax") -> Dict[str, torch.Tensor]:
    """The two constants (L_x, L_μ) of the module docstring, each of shape ``heads.batch_shape``.

    Parameters
    ----------
    heads : Heads
        :class:`Heads` with any batch shape (a batch of times along a weight path, say).
    normalization : str
        "softmax" | "unnormalized" | "relu" ("effective" is not covered: its field
        divides by the harmonic-mean mobility, whose Lipschitz constant is not derived here).

    Returns
    -------
    Dict[str, torch.Tensor]
        {"space": L_x, "measure": L_μ} in the dtype and on the device of the heads.

    Raises
    ------
    TypeError
        heads is not a Heads.  ValueError: unknown or unsupported normalisation.

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> h = tp.Heads.scalar([1.0], 3, beta=0.5).to(torch.float64)
    >>> c = tp.theory.lipschitz_constants(h)
    >>> round(float(c["space"]), 6)  # v (1 + β‖A‖) = 1.5
    1.5
    """
    heads = _check_heads(heads)
    normalization = choose_normalization(normalization, LIPSCHITZ_NORMALIZATIONS)
    A = heads.score_matrix
    V = heads.value_matrix
    beta = heads.beta_tensor().abs()  # the bounds hold with a = |β|‖A‖ for any sign of β
    beta = beta[..., None] if beta.dim() > 0 else beta  # (..., 1) against (..., H)
    a = beta * torch.linalg.matrix_norm(A, ord=2)  # (..., H)
    v = torch.linalg.matrix_norm(V, ord=2)
    w = heads.weights
    if normalization.plain_softmax:
        space = v * (1 + a)
        measure = v * torch.exp(a) * (1 + 2 * a)
    elif normalization.rule == "unnormalized":
        space = v * torch.exp(a) * (1 + a)
        measure = space
    else:  # ReLU (the only other one LIPSCHITZ_NORMALIZATIONS admits)
        space = 2 * v * a
        measure = space
    return {"space": (w * space).sum(-1), "measure": (w * measure).sum(-1)}


def lipschitz_bound(heads: Heads, normalization: str = "softmax", *, part: str = "gronwall") -> torch.Tensor:
    """A Lipschitz constant of (x, μ) ↦ V[μ, Θ](x) on the sphere (W_2 on measures), shape ``heads.batch_shape``.

    part="gronwall": L = L_x + L_μ, the rate of Grönwall's estimate W_2(μ_t, ν_t) ≤ W_2(μ_0, ν_0) e^{∫L};
    part="max": max(L_x, L_μ), so that |V[μ](x) − V[ν](y)| ≤ L (|x − y| + W_2(μ, ν));
    part="space" / "measure": L_x or L_μ alone (see :func:`lipschitz_constants`).

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> h = tp.Heads.random(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    >>> bool(tp.theory.lipschitz_bound(h) > 0)
    True
    """
    check_choice(part, ("gronwall", "max", "space", "measure"), "part")
    c = lipschitz_constants(heads, normalization)
    if part == "gronwall":
        return c["space"] + c["measure"]
    if part == "max":
        return torch.maximum(c["space"], c["measure"])
    return c[part]


def gronwall_factor(times, rates, *, log: bool = False) -> torch.Tensor:
    """exp(∫_{t_0}^{t_k} L(s) ds) on a time grid (trapezoid rule), shape like ``rates``.

    Parameters
    ----------
    times
        (T,) increasing times.  rates: (T, ...) non-negative L(t_k).
    log : bool
        return the exponent ∫L instead (the factor overflows float64 beyond ∫L ≈ 709).

    Examples
    --------
    >>> import torch, transformer_pde as tp
    >>> t = torch.linspace(0, 1, 11, dtype=torch.float64)
    >>> float(tp.theory.gronwall_factor(t, 2 * torch.ones(11, dtype=torch.float64))[-1])  # e²
    7.38905609893065
    """
    check_tensor(times, "times", min_dim=1)
    check_tensor(rates, "rates", min_dim=1)
    if times.dim() != 1 or rates.shape[0] != times.shape[0]:
        raise ValueError(f"times must be (T,) and rates (T, ...), got {tuple(times.shape)} and {tuple(rates.shape)}")
    if times.shape[0] > 1 and not bool((times[1:] > times[:-1]).all()):
        raise ValueError("times must be strictly increasing")
    if bool((rates < 0).any()):
        raise ValueError("rates must be >= 0 (a Lipschitz constant)")
    t = times.to(rates.dtype).reshape(-1, *([1] * (rates.dim() - 1)))
    incr = 0.5 * (rates[1:] + rates[:-1]) * (t[1:] - t[:-1])
    integral = torch.cat([torch.zeros_like(rates[:1]), torch.cumsum(incr, 0)])
    return integral if log else torch.exp(integral)


def fast_weights_coefficients(x, heads: Heads, value_std: float, *, direction: str = DEFAULT_DIRECTION,
                              normalization: str = "softmax") -> Dict[str, torch.Tensor]:
    """Coefficients of the fast-weights (homogenised) limit SDE at the tokens x (module docstring).

    The noise field is g(x; G) = s · P_{x_i} Σ_h ω_h G_h ȳ_h(x_i) (linear in the d×d matrices G_h), i.e.
    the velocity of the heads (A_h, V_h = G_h); with G_h = value_std·E_ab (k = (h, a, b) running over the
    H d² entries) it is g_k, and

        drift       b(x) = V[μ, (A, V̄)](x)                               (n, d)
        correction  c(x) = ½ Σ_k Dg_k(x)[g_k(x)]                          (n, d), Itô drift = b + c
        covariance  C_ij = Σ_k g_k(x_i) g_k(x_j)ᵀ                         (n, n, d, d)
                         = s_v² Σ_h ω_h² ⟨ȳ_h(x_i), ȳ_h(x_j)⟩ P_{x_i} P_{x_j}

    (the closed form of C is returned as "covariance"; the tests check it against Σ_k g_k g_kᵀ and both
    against Monte Carlo of one fast layer).  The correction has no closed form here: it is computed exactly
    by forward-mode differentiation (one Jacobian–vector product per noise direction).

    Parameters
    ----------
    x
        tokens (n, d) on the sphere (no batch dims).  heads: the mean heads (A_h, V̄_h, ω_h, β),
        without batch dims.  value_std: s_v > 0, the entrywise standard deviation of the
        diffusive value noise (V_h = V̄_h + s_v ξ/√δ per layer of length δ).
    direction : str
        "ascent" | "descent".  normalization: "softmax" | "unnormalized" | "relu".

    Returns
    -------
    Dict[str, torch.Tensor]
        {"drift", "correction", "covariance", "basis_covariance"} (the last = Σ_k g_k g_kᵀ, (n, n, d, d)).
    """
    heads = _check_heads(heads)
    check_tokens(x, "x")
    heads = heads.at_context(x.shape[-2])  # a rule β_n of the context length, resolved at the tokens' n
    if x.dim() != 2 or len(heads.batch_shape):
        raise ValueError(f"x must be (n, d) and heads unbatched; got x {tuple(x.shape)}, heads batch "
                         f"{tuple(heads.batch_shape)} (loop over batches)")
    value_std = check_positive(value_std, "value_std")
    normalization = choose_normalization(normalization, LIPSCHITZ_NORMALIZATIONS)
    direction_sign(direction)
    A = heads.score_matrix
    H, d = heads.num_heads, heads.dim
    n = x.shape[0]

    def g(z, G):
        # z may leave the sphere slightly under differentiation: evaluate the field on its projection,
        # which is what the retracted flow sees (the projection has derivative P_z on the sphere)
        zn = z / z.norm(dim=-1, keepdim=True)
        return velocity(zn, Heads(A, G, heads.weights, heads.beta), normalization=normalization,
                        direction=direction)

    basis = torch.eye(H * d * d, dtype=x.dtype, device=x.device).reshape(H * d * d, H, d, d) * value_std
    gk = torch.stack([g(x, Gk) for Gk in basis])  # (K, n, d)
    corr = torch.zeros_like(x)
    for Gk, v in zip(basis, gk):
        _, jv = torch.func.jvp(lambda z: g(z, Gk), (x,), (v,))
        corr = corr + 0.5 * jv
    drift = velocity(x, heads, normalization=normalization, direction=direction)
    basis_cov = torch.einsum("kia,kjb->ijab", gk, gk)
    # closed form: ȳ_h from the head outputs of identity values
    eye = torch.eye(d, dtype=x.dtype, device=x.device).expand(H, d, d).clone()
    ybar = head_outputs(x, Heads(A, eye, heads.weights, heads.beta), normalization=normalization)  # (H, n, d)
    P = torch.eye(d, dtype=x.dtype, device=x.device) - x[:, :, None] * x[:, None, :]  # (n, d, d)
    w2 = heads.weights ** 2
    gram = torch.einsum("h,hia,hja->ij", w2, ybar, ybar)
    cov = value_std ** 2 * gram[:, :, None, None] * torch.einsum("iab,jbc->ijac", P, P)
    return {"drift": drift, "correction": corr, "covariance": cov, "basis_covariance": basis_cov}
