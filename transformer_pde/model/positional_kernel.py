"""The block kernel of positional attention (:mod:`transformer_pde.model.positional`): the statistics of the
positional prefix measures μ_i^h = Σ_{j≤i} w_j e^{b_h(p_i,p_j)} δ_{x_j} / Π_i^h of every head at the tokens.

:func:`positional_statistics` runs over blocks of query rows [i0, i1), each against the keys of its own prefix
[0, i1) (memory ~ ``chunk_elements`` scores per block, never n²), the bias block formed inside the block.  A
separable bias (ALiBi, the kinetic decay: b = row_i + col_j) needs no bias block: its key terms are the additive
log-mask of torch's fused CPU flash-attention kernel (``is_causal``), and log Π_i = row_i + log Σ_{j≤i} e^{col_j +
log w_j} is a running log-sum-exp.  Without that kernel (the second moment, another device) the no-grad blocks
exponentiate without a shift where the scores are bounded (a key scale e^{g_j − C} for a separable bias, the
positional weights e^{lw − max} otherwise), else with the row-max shift.

With autograd the forward pass is the no-grad kernel's and the backward pass recomputes one block at a time:
by the closed form of the softmax derivative when only the tokens and the heads need gradients, else by
back-propagating through the recomputed block (slopes, λ, positions, token weights), and through
``torch.utils.checkpoint`` for a kernel whose closure requires grad.  Memory stays O(n·d) plus one block;
second derivatives are not available.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .backends import causal_block_mask, check_chunk, flash_cpu_op, needs_grad, rows_per_chunk, sdpa_available
from .heads import Heads
from .moments import HeadStats
from .positional import PositionalBias, PositionKernel
from .softmax import score_features

__all__ = ["positional_statistics", "PositionalStats"]


@dataclass
class PositionalStats:
    """The statistics of the positional prefix measures (module docstring), batch shape ``...``.

    stats:      :class:`~transformer_pde.model.moments.HeadStats` (softmax kind: log m_h, ȳ_h, optional
                second moment), or None.
    log_prefix: (..., H|1, n) log Π_i^h, the log total positional weight of the prefix (−inf: an empty prefix).
    relu:       (mass (..., H, n), first (..., H, n, d)) of the ReLU kind: Σ_j π_ij ReLU(s_ij) [1, y_j], or None.
    plan:       (..., H, n, d) Σ_j P_ij y_j of a plan kind, or None.
    """

    stats: Optional[HeadStats]
    log_prefix: torch.Tensor
    relu: Optional[tuple] = None
    plan: Optional[torch.Tensor] = None


def _log_token_weights(weights, n, ref):
    if weights is None:
        return torch.full((n,), -math.log(n), dtype=ref.dtype, device=ref.device)
    return torch.log(weights)


@dataclass(frozen=True)
class _Blocks:
    """What every block of query rows shares: the query and key features (..., H, n, k), (..., 1|H, n, k),
    the tokens y (..., n, d), positions (..., n), log token weights (..., n), the bias, n and strictness."""

    qf: torch.Tensor
    kf: torch.Tensor
    y: torch.Tensor
    pos: torch.Tensor
    logw: torch.Tensor
    bias: PositionalBias
    strict: bool
    #: the no-grad kernel's shortcuts: the score bound B (|s_ij| <= B); ½ log(max float) (no overflow of a
    #: sum of e^{s}) and log(eps/tiny) (weights below tiny change a row by less than one ulp); for a separable
    #: bias (row, g, G, L) with g_j = col_j + log w_j, G its running max and L its running log-sum-exp (..., H|1, n)
    bound: float = math.inf
    overflow: float = 0.0
    precision: float = 0.0
    sep: Optional[tuple] = None

    def log_weights(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """Log positional weights of the rows [i0, i1) over the keys [0, m), masked: (..., H|1, r, m)."""
        qpos = self.pos[..., i0:i1].unsqueeze(-1)
        kpos = self.pos[..., :m].unsqueeze(-2)
        qidx = torch.arange(i0, i1, device=self.pos.device)
        mask = causal_block_mask(qidx - 1 if self.strict else qidx, m)  # True: key j > i (strict: j >= i)
        if isinstance(self.bias, PositionKernel):  # a user's kernel sees only pairs of the prefix
            kpos = torch.where(mask, qpos, kpos)
        lw = self.bias.log_weights(qpos, kpos, self.y.shape[-2]) + self.logw[..., :m].unsqueeze(-2).unsqueeze(-3)
        return lw.masked_fill(mask, float("-inf"))

    def scores(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """s_ij of the rows [i0, i1) and the keys [0, m): (..., H, r, m)."""
        return torch.matmul(self.qf[..., i0:i1, :], self.kf[..., :m, :].transpose(-1, -2))

    def gram(self, i0: int, i1: int, m: int) -> torch.Tensor:
        """⟨x_i, x_j⟩ of the rows [i0, i1) and the keys [0, m): (..., 1, r, m)."""
        return (self.y[..., i0:i1, :] @ self.y[..., :m, :].transpose(-1, -2)).unsqueeze(-3)


def _softmax_block(b: _Blocks, i0, i1, m, second):
    """(log m, log Π, ȳ, q or None) of the rows [i0, i1): out of place (autograd)."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    T = b.scores(i0, i1, m) + lw
    lse = torch.logsumexp(T, -1)
    P = torch.exp(T - lse.unsqueeze(-1))
    mean = P @ b.y[..., :m, :].unsqueeze(-3)
    q = (P * b.gram(i0, i1, m).square()).sum(-1) if second else None
    return lse - lp, lp, mean, q


def _moments(S, b: _Blocks, i0, i1, m, second, key_scale=None):
    """M = S @ [1, y] (times key_scale (..., H|1, m) on the keys), Z = M[..., 0], ȳ, q (or None)."""
    yk = b.y[..., :m, :]
    cols = torch.cat([torch.ones_like(yk[..., :1]), yk], -1).unsqueeze(-3)
    if key_scale is not None:
        cols = cols * key_scale.unsqueeze(-1)
    M = S @ cols
    Z = M[..., 0]
    mean = M[..., 1:] / Z.unsqueeze(-1)
    q = None
    if second:
        G = b.gram(i0, i1, m).square()
        q = ((S * G) if key_scale is None else (S * G * key_scale.unsqueeze(-2))).sum(-1) / Z
    return Z, mean, q


def _softmax_block_inplace(b: _Blocks, i0, i1, m, second):
    """The same without autograd, in place.  Where the scores are bounded, |s_ij| <= B, with 2B + log m within
    log(eps/tiny) (any positional weight below the dtype's tiny then changes the row by less than one ulp), the
    exp runs without a shift: on a separable bias the keys are reweighted by e^{g_j − C} (g_j = col_j + log w_j,
    C the block's max of g), only the block's diagonal square is masked, and log Π comes from the running
    log-sum-exp of g (O(n), no bias block); on any other bias by the positional weights e^{lw − max} of the block.
    Otherwise the block is shifted by its row max.  The partition and the mean come from one product with the
    columns [1, y]."""
    logm = math.log(max(m, 1))
    if b.bound + logm <= b.overflow and 2 * b.bound + logm <= b.precision:
        S = b.scores(i0, i1, m).exp_()
        qidx = torch.arange(i0, i1, device=S.device)
        if b.sep is not None:
            row, g, G, L = b.sep
            C = G[..., m - 1:m]  # (..., H|1, 1)
            first = i0 - 1 if b.strict else i0  # the last key of the block's first row
            if float((C - G[..., first:first + 1]).max()) + 2 * b.bound + logm <= b.precision:
                mask = causal_block_mask(qidx - i0 - (1 if b.strict else 0), m - i0)
                S[..., i0:m].masked_fill_(mask, 0.0)
                Z, mean, q = _moments(S, b, i0, i1, m, second, torch.exp(g[..., :m] - C))
                # L_i = log Σ_{j ≤ i} e^{g_j} (strict: j < i), so log Π_i = row_i + L_i
                Li = L[..., i0 - 1:i1 - 1] if b.strict else L[..., i0:i1]
                return torch.log(Z) + C - Li, row[..., i0:i1] + Li, mean, q
        lw = b.log_weights(i0, i1, m)
        c = lw.amax(-1, keepdim=True)
        W = torch.exp(lw - c)
        lp = c.squeeze(-1) + torch.log(W.sum(-1))
        S = S.mul_(W) if S.shape == torch.broadcast_shapes(S.shape, W.shape) else S * W
        Z, mean, q = _moments(S, b, i0, i1, m, second)
        return torch.log(Z) + c.squeeze(-1) - lp, lp, mean, q
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    S = b.scores(i0, i1, m)
    S = S.add_(lw) if S.shape == torch.broadcast_shapes(S.shape, lw.shape) else S + lw
    mx = S.amax(-1, keepdim=True)
    S.sub_(mx).exp_()
    Z, mean, q = _moments(S, b, i0, i1, m, second)
    return torch.log(Z) + mx.squeeze(-1) - lp, lp, mean, q


def _relu_block(b: _Blocks, i0, i1, m):
    """(Σ_j π_ij ReLU(s_ij), Σ_j π_ij ReLU(s_ij) y_j, log Π) of the rows [i0, i1)."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    R = torch.relu(b.scores(i0, i1, m)) * torch.exp(lw - lp.unsqueeze(-1))
    return R.sum(-1), R @ b.y[..., :m, :].unsqueeze(-3), lp


def _plan_block(b: _Blocks, i0, i1, m, fn, params):
    """(Σ_j P_ij y_j, log Π) for the plan ``fn`` of the masked scores with the key weights π_ij of the rows."""
    lw = b.log_weights(i0, i1, m)
    lp = torch.logsumexp(lw, -1)
    logpi = lw - lp.unsqueeze(-1)
    S = b.scores(i0, i1, m).masked_fill(torch.isneginf(logpi), float("-inf"))
    return fn(S, logpi, None, **params) @ b.y[..., :m, :].unsqueeze(-3), lp


def _flash_separable(x, qf, kf, sep, strict):
    """Softmax statistics of a separable bias by torch's fused CPU flash-attention kernel, (log m, log Π, ȳ):
    the key terms g_j = col_j + log w_j are its additive (..., H|1, 1, n) log-weight mask, ``is_causal`` its
    prefix (strict: the queries 1..n−1 against the keys 0..n−2), and log m = lse − log Σ_{j≤i} e^{g_j}
    (the query term cancels).  O(n) memory, the kernel's online max (any range of g and of the scores);
    None where the kernel refuses the layout."""
    op = flash_cpu_op()
    row, g, _, L = sep
    H, n, k = qf.shape[-3], qf.shape[-2], qf.shape[-1]
    d = x.shape[-1]
    E = max(k, d)
    pad = torch.nn.functional.pad
    lo = 1 if strict else 0
    r = n - lo  # query rows (and keys) of the kernel
    batch = torch.broadcast_shapes(qf.shape[:-3], kf.shape[:-3], x.shape[:-2], g.shape[:-2])
    G = math.prod(batch)
    q = pad(qf[..., lo:, :], (0, E - k)).expand(*batch, H, r, E).reshape(G, H, r, E)
    kk = pad(kf[..., :r, :], (0, E - k)).expand(*batch, H, r, E).reshape(G, H, r, E)
    v = pad(x[..., :r, :], (0, E - d)).unsqueeze(-3).expand(*batch, H, r, E).reshape(G, H, r, E)
    mask = g[..., :r].unsqueeze(-2).expand(*batch, g.shape[-2], 1, r).reshape(G, g.shape[-2], 1, r)
    try:
        out, lse = op(q, kk, v, is_causal=True, attn_mask=mask, scale=1.0)
    except RuntimeError:
        return None
    lse = lse.reshape(*batch, H, r).to(x.dtype)
    Li = L[..., :r]  # log Σ_{j ≤ i − lo} e^{g_j}
    return lse - Li, row[..., lo:] + Li, out.reshape(*batch, H, r, E)[..., :d]


def positional_statistics(
    x: torch.Tensor,
    heads: Heads,
    weights: Optional[torch.Tensor],
    bias: PositionalBias,
    *,
    kind: str = "softmax",
    second_moment: bool = False,
    chunk_elements: Optional[int] = None,
    plan=None,
    plan_params: Optional[dict] = None,
) -> PositionalStats:
    """The statistics of the positional prefix measures μ_i^h of every head at the tokens (module docstring).

        softmax:  log m_h(x_i) = log Σ_j π_ij^h e^{s_ij},  ȳ_h(x_i) = Σ_j p_ij y_j,  p_ij ∝ w_j e^{s_ij + b_h(p_i, p_j)}
        relu:     Σ_j π_ij^h ReLU(s_ij) [1, y_j]
        plan:     Σ_j P_ij y_j, P = plan(scores, log π, None)   (e.g. the hardmax plan weighted by π)

    over j ≤ i (j < i when ``bias.strict``), s_ij = β⟨x_i, A_h x_j⟩.

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) (queries and keys: the sequence).
    heads : Heads
        the heads (batch dims broadcast against x's).
    weights : torch.Tensor or None
        token weights (..., n), None for uniform.
    bias : PositionalBias
        the positional bias.
    kind : str
        "softmax", "relu" or "plan".
    second_moment : bool
        softmax: also q_h(x_i) = Σ_j p_ij ⟨x_i, x_j⟩².
    chunk_elements : int or None
        cap on the scores of one block of query rows (memory ~ this, not n²).
    plan : callable or None
        kind "plan": ``plan(scores, log_key_weights, None, **plan_params)`` -> P (..., H, r, m) row by row.
    plan_params : dict or None
        passed to the plan.

    Returns
    -------
    PositionalStats
        the statistics; the rows of an empty prefix (the first token when strict) have m_h = 0 (log −inf),
        zero means and zero ReLU moments.

    Raises
    ------
    ValueError, TypeError
        a bias that does not fit x or the heads (:meth:`PositionalBias.check`), a bad chunk_elements or kind.
    """
    check_chunk(chunk_elements)
    if not isinstance(bias, PositionalBias):
        raise TypeError(f"bias must be a PositionalBias (ALiBi, KineticDecay, PositionKernel), got {type(bias).__name__}")
    if kind not in ("softmax", "relu", "plan"):
        raise ValueError(f"kind must be 'softmax', 'relu' or 'plan', got {kind!r}")
    bias.check(x, heads)
    n = x.shape[-2]
    left, right = score_features(heads)
    pos = bias.token_positions(n, x)
    named = bias.tensors()
    grad = needs_grad(x, left, right, weights, pos, *named.values())
    hidden = False  # a kernel closing over tensors that require grad: ask it once, on one pair of positions
    if isinstance(bias, PositionKernel) and torch.is_grad_enabled():
        hidden = bias.log_weights(pos[..., :1].unsqueeze(-1), pos[..., :1].unsqueeze(-1), n).requires_grad
    with torch.enable_grad() if (grad or hidden) else torch.no_grad():
        qf = x.unsqueeze(-3) @ left  # (..., H, n, k)
        kf = x.unsqueeze(-3) if right is None else x.unsqueeze(-3) @ right  # (..., 1|H, n, k)
        logw = _log_token_weights(weights, n, x)
    H = qf.shape[-3]
    batch = math.prod(torch.broadcast_shapes(qf.shape[:-3], kf.shape[:-3], pos.shape[:-1], logw.shape[:-1]))
    spec = _Spec(bias, tuple(named), kind, second_moment, rows_per_chunk(batch * H, n, n, chunk_elements), plan,
                 plan_params or {})
    if hidden:  # gradients to tensors the kernel closes over: torch's own checkpoints see them
        return _checkpointed(spec, qf, kf, x, pos, logw)
    if grad:  # the statistics of the no-grad kernels, their gradients from blocks recomputed one at a time
        flat = _PositionalGrad.apply(spec, qf, kf, x, pos, logw, *named.values())
        return _unflatten(spec, flat)
    with torch.no_grad():
        return _statistics(spec, qf, kf, x, pos, logw)


@dataclass(frozen=True)
class _Spec:
    """What a positional pass computes: the bias (and the names of its own tensors), the kind, the second moment,
    the rows of a block, the plan and its parameters."""

    bias: PositionalBias
    names: tuple
    kind: str
    second: bool
    rows: int
    plan: object
    params: dict

    def blocks(self, i0: int, n: int):
        """(i1, m) of the block of query rows starting at i0: its end and the keys of its prefix."""
        i1 = min(n, i0 + self.rows)
        return i1, (i1 - 1 if self.bias.strict else i1)

    def starts(self, n: int) -> range:
        return range(1 if self.bias.strict else 0, n, self.rows)

    def function(self, grad: bool):
        """(block function, its extra arguments)."""
        if self.kind == "softmax":
            return (_softmax_block if grad else _softmax_block_inplace), (self.second,)
        if self.kind == "relu":
            return _relu_block, ()
        return _plan_block, (self.plan, self.params)

    def with_tensors(self, tensors) -> PositionalBias:
        """The bias holding ``tensors`` in place of its own (the leaves of a recomputation)."""
        return dataclasses.replace(self.bias, **dict(zip(self.names, tensors))) if self.names else self.bias


def _statistics(spec: _Spec, qf, kf, x, pos, logw) -> PositionalStats:
    """The statistics without autograd: the flash kernel for a separable bias (softmax, no second moment), else
    the in-place blocks with their shortcuts."""
    bias, n, d = spec.bias, x.shape[-2], x.shape[-1]
    strict = bias.strict
    blocks = _Blocks(qf, kf, x, pos, logw, bias, strict)
    if spec.kind == "softmax":
        fi = torch.finfo(x.dtype)
        sep = bias.separable(pos, n)
        if sep is not None:
            row, col = sep
            g = col + logw.unsqueeze(-2)
            sep = (row, g, torch.cummax(g, -1).values, torch.logcumsumexp(g, -1))
            if not spec.second and n > (1 if strict else 0) and sdpa_available(x.device, x.dtype):
                flash = _flash_separable(x, qf, kf, sep, strict)
                if flash is not None:
                    return _assemble([(*flash, None)], spec.kind, strict, qf, spec.second, d)
        blocks = _Blocks(qf, kf, x, pos, logw, bias, strict,
                         bound=float(qf.norm(dim=-1).amax()) * float(kf.norm(dim=-1).amax()),
                         overflow=0.5 * math.log(fi.max), precision=math.log(fi.eps / fi.tiny), sep=sep)
    fn, args = spec.function(grad=False)
    parts = [fn(blocks, i0, *spec.blocks(i0, n), *args) for i0 in spec.starts(n)]
    return _assemble(parts, spec.kind, strict, qf, spec.second, d)


def _checkpointed(spec: _Spec, qf, kf, x, pos, logw) -> PositionalStats:
    """The out-of-place blocks under ``torch.utils.checkpoint`` (a kernel whose closure requires grad)."""
    from torch.utils.checkpoint import checkpoint

    n = x.shape[-2]
    blocks = _Blocks(qf, kf, x, pos, logw, spec.bias, spec.bias.strict)
    fn, args = spec.function(grad=True)
    parts = [checkpoint(fn, blocks, i0, *spec.blocks(i0, n), *args, use_reentrant=False) for i0 in spec.starts(n)]
    return _assemble(parts, spec.kind, spec.bias.strict, qf, spec.second, x.shape[-1])


#: the outputs of each kind, in order, with the axis of their query rows
_OUTPUTS = {"softmax": ((-1, "log_partition"), (-1, "log_prefix"), (-2, "mean"), (-1, "second")),
            "relu": ((-1, "mass"), (-2, "first"), (-1, "log_prefix")), "plan": ((-2, "mean"), (-1, "log_prefix"))}


def _flatten(spec: _Spec, st: PositionalStats) -> tuple:
    if spec.kind == "softmax":
        return (st.stats.log_partition, st.log_prefix, st.stats.mean) + ((st.stats.second,) if spec.second else ())
    if spec.kind == "relu":
        return (*st.relu, st.log_prefix)
    return st.plan, st.log_prefix


def _unflatten(spec: _Spec, flat) -> PositionalStats:
    if spec.kind == "softmax":
        return PositionalStats(HeadStats(flat[0], flat[2], flat[3] if spec.second else None), flat[1])
    if spec.kind == "relu":
        return PositionalStats(None, flat[2], relu=(flat[0], flat[1]))
    return PositionalStats(None, flat[1], plan=flat[0])


class _PositionalGrad(torch.autograd.Function):
    """The positional statistics with gradients: the forward pass is the no-grad kernel's (the flash path of
    separable biases included), the backward pass recomputes one block of query rows at a time out of place and
    back-propagates through it, so memory stays one block (O(n) per query block) whatever n is."""

    @staticmethod
    def forward(ctx, spec, qf, kf, x, pos, logw, *bias_tensors):
        ctx.spec = spec
        with torch.no_grad():
            flat = _flatten(spec, _statistics(spec, qf, kf, x, pos, logw))
        ctx.save_for_backward(qf, kf, x, pos, logw, *bias_tensors, flat[0], flat[1])
        return flat

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        spec = ctx.spec
        *saved, out0, out1 = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        if spec.kind == "softmax" and not spec.second and not any(need[3:]):
            return (None, *_softmax_backward(spec, *saved[:5], out0 + out1, grads[0], grads[2], need))
        leaves = [t.detach().requires_grad_(bool(r) and t.is_floating_point()) for t, r in zip(saved, need)]
        qf, kf, x, pos, logw, *bt = leaves
        bias = spec.with_tensors(bt)
        n = x.shape[-2]
        blocks = _Blocks(qf, kf, x, pos, logw, bias, bias.strict)
        fn, args = spec.function(grad=True)
        wanted = [t for t in leaves if t.requires_grad]
        total = [None] * len(wanted)
        axes = [a for a, _ in _OUTPUTS[spec.kind]][:len(grads)]
        for i0 in spec.starts(n):
            i1, m = spec.blocks(i0, n)
            if not any(g is not None for g in grads) or not wanted:
                break
            with torch.enable_grad():
                outs = fn(blocks, i0, i1, m, *args)
            pairs = []
            for o, g, axis in zip(outs, grads, axes):
                if o is None or g is None or not o.requires_grad:
                    continue
                gs = g.narrow(axis, i0, i1 - i0)
                pairs.append((o, gs if gs.shape == o.shape else gs.sum_to_size(o.shape)))
            if not pairs:
                continue
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            total = [a if b is None else (b if a is None else a + b) for a, b in zip(total, got)]
        it = iter(total)
        out = [next(it) if t.requires_grad else None for t in leaves]
        return (None, *out)


def _softmax_backward(spec: _Spec, qf, kf, x, pos, logw, lse, g_lse, g_mean, need):
    """The gradients (qf, kf, x, None, None, ...) of the softmax statistics (log m, ȳ) by their closed form, one
    block of query rows at a time (the bias and the token weights carry no gradient here):

        P_ij = e^{s_ij + lw_ij − lse_i},   ∂L/∂s_ij = P_ij (g_i + ⟨G_i, y_j⟩ − ⟨G_i, ȳ_i⟩),   ∂L/∂y_j ∋ Σ_i P_ij G_i,

    with g = ∂L/∂log m, G = ∂L/∂ȳ (autograd materialises the gradient of an unused output as zeros), lse =
    log Σ_j e^{s_ij + lw_ij} (the forward pass's log m + log Π)."""
    n = x.shape[-2]
    b = _Blocks(qf, kf, x, pos, logw, spec.bias, spec.bias.strict)
    dq = torch.zeros_like(qf) if need[0] else None
    dk = torch.zeros_like(kf) if need[1] else None
    dy = torch.zeros_like(x) if need[2] else None
    for i0 in spec.starts(n):
        i1, m = spec.blocks(i0, n)
        P = b.scores(i0, i1, m)
        lw = b.log_weights(i0, i1, m)
        P = P.add_(lw) if P.shape == torch.broadcast_shapes(P.shape, lw.shape) else P + lw
        P = P.sub_(lse[..., i0:i1].unsqueeze(-1)).exp_()  # (..., H, r, m)
        yk = x[..., :m, :].unsqueeze(-3)
        Gm = g_mean[..., i0:i1, :]  # (..., H, r, d)
        dT = Gm @ yk.transpose(-1, -2)  # ⟨G_i, y_j⟩
        D = (P * dT).sum(-1, keepdim=True)  # ⟨G_i, ȳ_i⟩
        dT = (dT - D + g_lse[..., i0:i1].unsqueeze(-1)) * P
        if dy is not None:
            dy[..., :m, :] += (P.transpose(-1, -2) @ Gm).sum(-3).sum_to_size(dy[..., :m, :].shape)
        if dq is not None:
            dq[..., i0:i1, :] += (dT @ kf[..., :m, :]).sum_to_size(dq[..., i0:i1, :].shape)
        if dk is not None:
            dk[..., :m, :] += (dT.transpose(-1, -2) @ qf[..., i0:i1, :]).sum_to_size(dk[..., :m, :].shape)
    return (dq, dk, dy) + (None,) * (len(need) - 3)


def _empty_rows(ref, kind, qf, d, second):
    """The statistics of the first query when strict: an empty prefix (no key to attend to), shaped like one
    row of the block ``ref`` (or, for n = 1, from the query features)."""
    if ref is None:
        lse = torch.full((*qf.shape[:-2], 1), float("-inf"), dtype=qf.dtype, device=qf.device)
        lp = lse[..., :1, :]
        mean = qf.new_zeros(*qf.shape[:-2], 1, d)
        return {"softmax": (lse, lp, mean, torch.zeros_like(lse) if second else None),
                "relu": (torch.zeros_like(lse), mean, lp), "plan": (mean, lp)}[kind]

    if kind == "softmax":
        lse, lp, mean, q = ref
        return (torch.full_like(lse[..., :1], float("-inf")), torch.full_like(lp[..., :1], float("-inf")),
                torch.zeros_like(mean[..., :1, :]), None if q is None else torch.zeros_like(q[..., :1]))
    if kind == "relu":
        mass, first, lp = ref
        return (torch.zeros_like(mass[..., :1]), torch.zeros_like(first[..., :1, :]),
                torch.full_like(lp[..., :1], float("-inf")))
    mean, lp = ref
    return torch.zeros_like(mean[..., :1, :]), torch.full_like(lp[..., :1], float("-inf"))


def _assemble(parts, kind, strict, qf, second, d):
    """Concatenate the blocks' statistics along the query axis (the empty first row when strict)."""
    if strict:
        parts.insert(0, _empty_rows(parts[0] if parts else None, kind, qf, d, second))

    def cat(i, axis):
        ts = [p[i] for p in parts]
        return ts[0] if len(ts) == 1 else torch.cat(ts, axis)

    if kind == "softmax":
        return PositionalStats(HeadStats(cat(0, -1), cat(2, -2), cat(3, -1) if second else None), cat(1, -1))
    if kind == "relu":
        return PositionalStats(None, cat(2, -1), relu=(cat(0, -1), cat(1, -2)))
    return PositionalStats(None, cat(1, -1), plan=cat(0, -2))
