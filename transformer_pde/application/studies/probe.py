"""The measurements of the pretrained-network probe (kind ``pretrained_probe``; docs/pretrained.md).

Plain functions of tensors, independent of any network, so that each can be checked against a
closed form:

* :func:`split_sentences`, :func:`topic_sentences`, :func:`select_sentences` — English text that every
  Python installation carries (the help topics of :mod:`pydoc_data.topics`), split into sentences and
  drawn by a seeded permutation;
* :func:`mean_cosine` — the mean over distinct token pairs of a sentence of the cosine of their vectors;
* :func:`fit_effective_beta` — the one-parameter isotropic kernel softmax_j(β⟨x̂_i, x̂_j⟩) closest to a
  layer's attention probabilities in mean Kullback–Leibler divergence, one β per sentence;
* :func:`factored_log_energy` — log E_β of heads given by their factors Q_h, K_h (k × d), in O(n·d·k) per
  token and head instead of the dense d × d scores;
* :func:`top_singular_value` — the local Lipschitz constant ‖J_f(x)‖₂ of a map by power iteration on JᵀJ.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["split_sentences", "topic_sentences", "select_sentences", "mean_cosine", "cloud_statistics",
           "fit_effective_beta",
           "top_singular_value", "standard_error", "factored_log_energy", "sentence_w2"]

_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_PARAGRAPH = re.compile(r"\n\s*\n")


def split_sentences(text: str, *, min_words: int = 5, max_words: int = 60) -> List[str]:
    """The prose sentences of a help text, in order.

    The text is cut into paragraphs at blank lines; a paragraph holding an interactive example
    (``>>>``) is skipped; the lines of a paragraph are joined with single spaces and the result is
    cut after ``.``, ``!`` or ``?`` followed by white space and an upper-case letter, a quote or a
    parenthesis.  A piece is kept when it is ASCII, starts with an upper-case letter, ends with
    ``.``, ``!`` or ``?``, has ``min_words`` to ``max_words`` words and at least 80 % of its
    characters are letters or spaces (which drops code, grammar rules and tables).

    Parameters
    ----------
    text : str
        the text.
    min_words, max_words : int
        the range of word counts kept.

    Returns
    -------
    list of str
        the sentences, white space normalised to single spaces.

    Examples
    --------
    >>> split_sentences("Hello there, this is one. And this is the second one!\\n\\n>>> x = 1")
    ['Hello there, this is one.', 'And this is the second one!']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    out = []
    for para in _PARAGRAPH.split(text):
        if ">>>" in para:
            continue
        for s in _BOUNDARY.split(" ".join(para.split())):
            words = len(s.split())
            if not (min_words <= words <= max_words and s.isascii() and s[:1].isupper() and s[-1:] in ".!?"):
                continue
            if sum(c.isalpha() or c == " " for c in s) >= 0.8 * len(s):
                out.append(s)
    return out


def topic_sentences() -> List[str]:
    """Every sentence of :data:`pydoc_data.topics.topics` (:func:`split_sentences`), the topics taken in sorted
    order, each sentence once (its first occurrence).  The text ships with Python, so the list depends on the
    Python version only."""
    from pydoc_data.topics import topics

    seen: Dict[str, None] = {}
    for key in sorted(topics):
        for s in split_sentences(topics[key]):
            seen.setdefault(s, None)
    return list(seen)


def select_sentences(count: int, seed: int, pool: Optional[Sequence[str]] = None) -> List[str]:
    """``count`` distinct sentences of ``pool`` (default :func:`topic_sentences`): the first ``count`` indices
    of the permutation ``numpy.random.default_rng(seed).permutation(len(pool))``, returned in pool order.

    Raises
    ------
    ValueError
        ``count`` is not in 1..len(pool)."""
    pool = topic_sentences() if pool is None else list(pool)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(pool):
        raise ValueError(f"count = {count!r} sentences requested, the text has {len(pool)}; give 1 <= count <= "
                         f"{len(pool)}")
    idx = np.sort(np.random.default_rng(seed).permutation(len(pool))[:count])
    return [pool[i] for i in idx]


def mean_cosine(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ρ = Σ_{i≠j valid} cos(x_i, x_j) / (n(n − 1)) per sentence, n its number of valid tokens, (...,).

    Parameters
    ----------
    x
        (..., n, d) vectors (any norm; zero vectors are not allowed at valid positions).
    mask
        (..., n) bool or 0/1, the valid tokens (at least two per sentence)."""
    m = mask.to(x.dtype)
    u = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny) * m.unsqueeze(-1)
    n = m.sum(-1)
    s = u.sum(-2)
    return ((s * s).sum(-1) - (u * u).sum((-1, -2))) / (n * (n - 1))


def cloud_statistics(x: torch.Tensor, mask: torch.Tensor, radius: float) -> Dict[str, torch.Tensor]:
    """Mean cosine, pair fraction and single-linkage cluster count of the normalised tokens of each sentence,
    from one Gram matrix per sentence, (...,) each.

    With x̂ = x/|x| and the valid tokens (n of them) of a sentence: ``mean_cosine`` as :func:`mean_cosine`;
    ``pair_fraction`` the fraction of ordered distinct pairs with |x̂_i − x̂_j| < r (⟨x̂_i, x̂_j⟩ > 1 − r²/2);
    ``clusters`` the number of connected components of that graph (minimum-label propagation with pointer
    jumping, batched over sentences) — the statistics of :func:`transformer_pde.clustering.cluster_statistics`
    with uniform weights on the valid tokens, read off the overlaps instead of the differences (they differ
    only for pairs within rounding of the threshold).

    Parameters
    ----------
    x
        (..., n, d) vectors (non-zero at valid positions).
    mask
        (..., n) bool, broadcastable: the valid tokens (at least two per sentence).
    radius : float
        the chordal radius r in (0, 2].

    Returns
    -------
    dict
        ``mean_cosine``, ``pair_fraction``, ``clusters`` (dtype of x)."""
    m = mask.bool().expand(x.shape[:-1])
    u = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    u = u * m.unsqueeze(-1).to(x.dtype)
    gram = u @ u.transpose(-1, -2)
    n = m.sum(-1).to(x.dtype)
    pairs = n * (n - 1)
    eye = torch.eye(x.shape[-2], dtype=torch.bool, device=x.device)
    both = m.unsqueeze(-1) & m.unsqueeze(-2)
    adj = (gram > 1.0 - 0.5 * radius * radius) & both
    linked = (adj & ~eye).sum((-1, -2)).to(x.dtype)
    idx = torch.arange(x.shape[-2], device=x.device)
    labels = idx.expand(m.shape).clone()
    adj = adj | eye
    big = torch.tensor(x.shape[-2], device=x.device)
    for _ in range(x.shape[-2]):  # rounds of label propagation over all sentences at once, not a loop over tokens
        new = torch.minimum(torch.where(adj, labels.unsqueeze(-2), big).amin(-1), labels)
        new = torch.gather(new, -1, new)
        if bool((new == labels).all()):
            break
        labels = new
    clusters = ((labels == idx) & m).sum(-1).to(x.dtype)
    return {"mean_cosine": (gram.sum((-1, -2)) - n) / pairs, "pair_fraction": linked / pairs, "clusters": clusters}


def sentence_w2(pred: torch.Tensor, real: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """W₂ between the normalised token clouds of each sentence, per leading index: (K, B) float64.

    W₂(μ̂, μ)² = min over couplings π of Σ π_ij |x̂_i − ŷ_j|² with uniform weights on the n valid tokens of the
    sentence — the per-sentence values whose mean over sentences :func:`transformer_pde.pretrained.cloud_distances`
    reports.  Between two uniform clouds of equal size an optimal coupling is a permutation (Birkhoff), so
    W₂² = (1/n) min_σ Σ_i |x̂_i − ŷ_σ(i)|², solved exactly as an assignment problem
    (:func:`scipy.optimize.linear_sum_assignment`).  The cost matrices of all indices and sentences are formed
    in one batched product; only the assignments loop.

    Parameters
    ----------
    pred, real
        (K, B, n, d) token clouds (any norms; normalised here).
    mask
        (B, n) bool: the valid tokens of each sentence (the first ones: right padding).

    Returns
    -------
    torch.Tensor
        (K, B) float64 distances."""
    from scipy.optimize import linear_sum_assignment

    a = pred.detach().to(torch.float64)
    b = real.detach().to(torch.float64)
    a = a / a.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    cost = (2.0 - 2.0 * a @ b.transpose(-1, -2)).clamp_min(0.0).cpu().numpy()  # |x − y|² of unit vectors
    out = np.zeros(cost.shape[:2])
    for s, n in enumerate(mask.sum(-1).tolist()):
        for k in range(cost.shape[0]):
            c = cost[k, s, :n, :n]
            rows, cols = linear_sum_assignment(c)
            out[k, s] = c[rows, cols].sum() / n
    return torch.from_numpy(np.sqrt(out))


def standard_error(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """s/√m over ``dim`` (s the sample standard deviation, m the count); 0 for a single value."""
    m = v.shape[dim]
    return v.std(dim) / math.sqrt(m) if m > 1 else torch.zeros_like(v.mean(dim))


def factored_log_energy(x: torch.Tensor, heads, weights: torch.Tensor) -> torch.Tensor:
    """log E = log Σ_h ω_h (1/(2β)) Σ_{i,j} w_i w_j exp(β⟨Q_h x_i, K_h x_j⟩), (...,), by log-sum-exp.

    The energy of docs/model.md for heads that keep their factors (A_h = Q_hᵀK_h, ``heads.query``,
    ``heads.key`` of shape (H, k, d)) and a scalar β: the scores are formed as (Q_h x_i)·(K_h x_j),
    never as d × d matrices.  Equal to :func:`transformer_pde.log_energy` on the same heads.

    Parameters
    ----------
    x
        (..., n, d) tokens.  heads: a :class:`~transformer_pde.Heads` with factors and batch shape ().
    weights
        (..., n) token weights (zeros allowed: padding).

    Raises
    ------
    ValueError
        heads without factors or with batched factors."""
    Q, K = heads.query, heads.key
    if Q is None or K is None or Q.dim() != 3:
        raise ValueError("factored_log_energy needs heads with unbatched factors query/key (H, k, d); use "
                         "tp.log_energy for dense heads")
    beta = float(heads.beta)
    q = torch.einsum("...nd,hkd->...hnk", x, Q)
    k = torch.einsum("...nd,hkd->...hnk", x, K)
    logw = weights.log()
    s = beta * q @ k.transpose(-1, -2) + logw[..., None, :, None] + logw[..., None, None, :]
    s = s + heads.weights.to(x.dtype).log()[:, None, None]
    return torch.logsumexp(s.flatten(-3), -1) - math.log(2 * beta)


def _row_moments(beta, probs, cos, keys):
    """Per row: E_Q[c], Var_Q[c], KL(P‖Q) of Q = softmax_j(β c_ij) over the valid keys."""
    b = beta.reshape(beta.shape + (1,) * (cos.dim() - beta.dim()))
    logits = torch.where(keys, b * cos, torch.full_like(cos, -math.inf))
    logq = logits - torch.logsumexp(logits, -1, keepdim=True)
    q = logq.exp()
    ec = (q * cos).sum(-1)
    var = (q * cos * cos).sum(-1) - ec * ec
    plogp = torch.where(probs > 0, probs * probs.clamp_min(torch.finfo(probs.dtype).tiny).log(), 0.0)
    kl = (plogp - torch.where(keys, probs * logq, 0.0)).sum(-1)
    return ec, var.clamp_min(0.0), kl


def fit_effective_beta(probs: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor, *, bound: float = 1e3,
                       iterations: int = 60, tol: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """β_eff = argmin_β (1/n) Σ_i KL(p_i ‖ softmax_j(β c_ij)), one β per leading index (per sentence).

    For each valid query token i and the valid keys j of a sentence: p_ij are attention
    probabilities (e.g. averaged over the heads of a layer), c_ij = ⟨x̂_i, x̂_j⟩ the cosines of the
    tokens.  The objective is convex in β; its derivative is Σ_i (E_{q_i}[c] − E_{p_i}[c]) with
    q_i = softmax_j(β c_ij), so β_eff is the inverse temperature at which the kernel's mean cosine under
    attention equals the network's.  Solved by Newton's method (second derivative Σ_i Var_{q_i}[c])
    inside a bisection bracket [−bound, bound].

    Parameters
    ----------
    probs, cos
        (..., n, n) attention probabilities (rows renormalised over the valid keys) and cosines.
    mask
        (..., n) bool, broadcastable: the valid tokens (rows and keys); at least one per sentence.
    bound : float
        the bracket; β_eff = ±bound means no kernel of the cosines is as sharp as the attention.
    iterations, tol
        Newton steps at most, and the relative tolerance on the step (default 100 × the dtype's eps).

    Returns
    -------
    dict
        ``beta`` (...), ``kl`` (...) the mean KL over the valid rows at β_eff, ``kl_uniform`` (...) the
        same at β = 0 (uniform attention over the valid tokens).

    Raises
    ------
    ValueError
        probs and cos of different shapes, or not (..., n, n).

    Examples
    --------
    >>> x = torch.nn.functional.normalize(torch.randn(5, 8, 3, dtype=torch.float64), dim=-1)
    >>> c = x @ x.transpose(-1, -2)
    >>> fit = fit_effective_beta((2.5 * c).softmax(-1), c, torch.ones(5, 8, dtype=torch.bool))
    >>> [round(float(b), 6) for b in fit["beta"]]
    [2.5, 2.5, 2.5, 2.5, 2.5]
    """
    if probs.shape != cos.shape or probs.dim() < 2 or probs.shape[-1] != probs.shape[-2]:
        raise ValueError(f"probs and cos must share a shape (..., n, n); got {tuple(probs.shape)} and "
                         f"{tuple(cos.shape)}")
    dtype = probs.dtype
    tol = 100 * torch.finfo(dtype).eps if tol is None else tol
    rows = mask.bool().expand(probs.shape[:-1])
    keys = rows.unsqueeze(-2).expand(probs.shape)
    p = torch.where(keys, probs, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    ep = (p * cos).sum(-1)
    count = rows.sum(-1).to(dtype)
    shape = probs.shape[:-2]
    lo = torch.full(shape, -bound, dtype=dtype, device=probs.device)
    hi = torch.full(shape, bound, dtype=dtype, device=probs.device)
    beta = torch.zeros(shape, dtype=dtype, device=probs.device)
    for _ in range(iterations):
        ec, var, _ = _row_moments(beta, p, cos, keys)
        g = torch.where(rows, ec - ep, 0.0).sum(-1)
        h = torch.where(rows, var, 0.0).sum(-1)
        lo = torch.where(g < 0, beta, lo)
        hi = torch.where(g > 0, beta, hi)
        step = beta - g / h.clamp_min(torch.finfo(dtype).tiny)
        inside = (step > lo) & (step < hi) & torch.isfinite(step)
        new = torch.where(inside, step, 0.5 * (lo + hi))
        done = bool(((new - beta).abs() <= tol * (1.0 + beta.abs())).all()) or bool(((hi - lo) < tol).all())
        beta = new
        if done:
            break
    kl = torch.where(rows, _row_moments(beta, p, cos, keys)[2], 0.0).sum(-1) / count
    kl0 = torch.where(rows, _row_moments(torch.zeros_like(beta), p, cos, keys)[2], 0.0).sum(-1) / count
    return {"beta": beta, "kl": kl, "kl_uniform": kl0}


def top_singular_value(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, batch_dims: int = 1,
                       mask: Optional[torch.Tensor] = None, iterations: int = 20,
                       generator: Optional[torch.Generator] = None, rtol: Optional[float] = None,
                       full_output: bool = False):
    """σ̂ ≈ ‖J_f(x)‖₂ per batch item, by at most ``iterations`` steps of power iteration on JᵀJ.

    ``fn`` maps ``x`` (*batch, *item) to a tensor of the same shape, each batch item independently (the
    Jacobian is block diagonal over the ``batch_dims`` leading axes).  Each step computes J v by the
    double-backward trick (J v = ∂/∂u ⟨Jᵀu, v⟩) and Jᵀ(Jv) by one vector–Jacobian product, so ``fn`` needs
    only ordinary autograd (``torch.nn.functional.scaled_dot_product_attention`` inside ``fn`` runs on
    PyTorch's math backend here).  The estimate √⟨v, JᵀJ v⟩ (unit v) increases to σ_max; the error after k steps
    is of order (σ₂/σ₁)^{2k}.  With ``rtol`` the iteration stops early, after the first step at which the
    estimate σ̂² of every item changed by less than ``rtol`` relative to its previous value.  With ``mask`` (*batch, n) the map is restricted to the valid tokens
    (rows of the item's second-to-last axis): the direction and the output are zero at invalid ones.

    Parameters
    ----------
    fn
        the map.  x: the point, (*batch, *item).  batch_dims: number of leading batch axes.
    mask
        optional (*batch, n) validity of the tokens of an item (n, d).
    iterations : int
        power steps (>= 1), at most.
    generator
        the random start v₀ ~ N(0, I) (restricted, normalised).
    rtol : float, optional
        the stopping rule's relative change (> 0); None runs all ``iterations`` steps.
    full_output : bool
        also return a dict ``steps`` (the steps taken) and ``converged`` ((*batch,) bool: the item's last
        relative change was below ``rtol``; all False without ``rtol``).

    Returns
    -------
    torch.Tensor or (torch.Tensor, dict)
        (*batch,) the estimates, dtype of x; with ``full_output`` also the dict.

    Raises
    ------
    ValueError
        iterations < 1, rtol <= 0, or fn changes the shape."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0):
        raise ValueError(f"rtol must be a number > 0 (or None: no early stop), got {rtol!r}")
    item = tuple(range(batch_dims, x.dim()))
    keep = None if mask is None else mask.to(x.dtype).unsqueeze(-1)

    def restrict(v):
        return v if keep is None else v * keep

    def unit(v):
        return v / v.pow(2).sum(item, keepdim=True).sqrt().clamp_min(torch.finfo(x.dtype).tiny)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # scaled-dot-product attention inside fn on PyTorch's math backend: the fused kernels have no double backward
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        xg = x.detach().requires_grad_(True)
        y = restrict(fn(xg))
        if y.shape != x.shape:
            raise ValueError(f"fn must map x of shape {tuple(x.shape)} to the same shape, got {tuple(y.shape)}")
        u = torch.zeros_like(y, requires_grad=True)
        (jt_u,) = torch.autograd.grad(y, xg, u, create_graph=True)  # Jᵀu, linear in u
        v = unit(restrict(torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)))
        sigma2 = torch.zeros(x.shape[:batch_dims], dtype=x.dtype, device=x.device)
        converged = torch.zeros(x.shape[:batch_dims], dtype=torch.bool, device=x.device)
        steps = 0
        for steps in range(1, iterations + 1):
            (jv,) = torch.autograd.grad(jt_u, u, v, retain_graph=True)
            (jtjv,) = torch.autograd.grad(y, xg, jv, retain_graph=True)
            jtjv = restrict(jtjv)
            prev, sigma2 = sigma2, (v * jtjv).sum(item)
            v = unit(jtjv)
            if rtol is not None:
                converged = (sigma2 - prev).abs() <= rtol * sigma2.abs()
                if bool(converged.all()):
                    break
    sigma = sigma2.clamp_min(0.0).sqrt().detach()
    return (sigma, {"steps": steps, "converged": converged}) if full_output else sigma
