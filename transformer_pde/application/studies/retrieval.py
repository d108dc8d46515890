"""The retrieval profile of a particle system, measured (docs/lost_in_the_middle.md): the paper's model on the
circle, the per-source estimates of the profile by autograd through :func:`transformer_pde.solve`, the first-order
control variate, the tangent sensitivity of any flow (a network read by ``tp.pretrained`` included) and the
reductions over position bins and the right-end window.  The study ``lost_in_the_middle`` composes them.

The estimator: the response of the last token's state at time t to the initial state of the token at s_k,

    est[k] = n · ∂θ_N(t)/∂θ_k(0) · Σ_{m≤N} ω_{m,M} cos(m (θ_N(t) − θ_k(0))),

whose mean over i.i.d. uniform initial angles estimates the kinetic profile S_t(s_k) of
:func:`transformer_pde.analysis.theory.kinetic.retrieval_profile`.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence

import torch

import transformer_pde as tp
from transformer_pde.analysis.theory import kinetic as kt

__all__ = ["paper_model", "mode_readout", "time_step", "retrieval_estimates", "first_order_control",
           "sensitivity_profile", "network_profile", "token_bins", "window_slope_weights", "binned"]


def paper_model(beta: float, lam: float, *, dtype: torch.dtype = torch.float64) -> tp.Model:
    """The paper's particle system as a :class:`~transformer_pde.Model` on the circle S¹ ⊂ R²:

        dθ_j/dt = Σ_{k<j} π_jk (−β sin(θ_j − θ_k) e^{β cos(θ_j − θ_k)}),  π_jk ∝ e^{−(λ/n)(j − k)} over k < j,

    i.e. score I and value β·I at inverse temperature β, the "unnormalized" normalisation, direction ascent,
    ``causal=tp.KineticDecay(lam, strict=True)``.

    Parameters
    ----------
    beta : float
        β > 0.
    lam : float
        λ >= 0.
    dtype : torch.dtype
        float32 or float64.

    Returns
    -------
    transformer_pde.Model
        the model (tokens (..., n, 2) on the unit circle)."""
    I = torch.eye(2, dtype=dtype).unsqueeze(0)
    return tp.Model(tp.Heads(I, beta * I, beta=beta), normalization="unnormalized", direction="ascent",
                    causal=tp.KineticDecay(lam, strict=True))


def mode_readout(phi: torch.Tensor, M: float, modes: int) -> torch.Tensor:
    """w(φ) = Σ_{m=1}^{N} ω_{m,M} cos(m φ), elementwise (the mode mixture of the profile).

    Parameters
    ----------
    phi : torch.Tensor
        angles.
    M : float
        the mode weights' width parameter.
    modes : int
        N.

    Returns
    -------
    torch.Tensor
        w(φ), phi's shape and dtype."""
    w = kt.mode_weights(M, modes).to(phi)
    m = torch.arange(1, modes + 1, dtype=phi.dtype, device=phi.device)
    return (w * torch.cos(phi.unsqueeze(-1) * m)).sum(-1)


def time_step(beta: float, t1: float, *, dt_max: float, courant: float) -> float:
    """dt = t1 / K with K the fewest steps for which dt <= min(dt_max, courant / (β e^β)).

    Parameters
    ----------
    beta, t1 : float
        β and the horizon.
    dt_max, courant : float
        the largest step and the factor of the force bound β e^β.

    Returns
    -------
    float
        the step."""
    cap = min(dt_max, courant / (beta * math.exp(beta)))
    return t1 / max(1, math.ceil(t1 / cap - 1e-9))


def retrieval_estimates(model: tp.Model, theta0: torch.Tensor, times: Sequence[float], *, dt: float, M: float,
                        modes: int, method: str = "heun", callback: Callable = None) -> Dict[str, torch.Tensor]:
    """Per-sample, per-source estimates of the retrieval profile by autograd through the solve (module docstring):

        est[m, r, k] = n · ∂θ_N(t_m)/∂θ_k(0) · w(θ_N(t_m) − θ_k(0)),   k = 0, …, n − 2,

    w = :func:`mode_readout`; the mean over the samples r estimates S_{t_m}(s_k), s_k = (k + 1)/n.

    Parameters
    ----------
    model : transformer_pde.Model
        the dynamics on the circle (:func:`paper_model`).
    theta0 : torch.Tensor
        initial angles (R, n) (R samples).
    times : sequence of float
        measurement times, multiples of ``dt`` (rounded to the step grid).
    dt : float
        the time step.
    M, modes
        the readout's mode weights.
    method : str
        "euler", "heun" or "rk4".
    callback : callable or None
        ``callback(k, t)`` after each forward step k and after each backward pass (k continuing the count).

    Returns
    -------
    dict
        "t" (T,) the times used, "est" (T, R, n − 1), "amplitude" (T, R, 3) the empirical Fourier amplitudes
        |(1/n) Σ_k e^{i m θ_k(t)}|, m = 1, 2, 3.

    Raises
    ------
    ValueError
        times not positive, not on the step grid."""
    if theta0.dim() != 2 or theta0.shape[-1] < 2:
        raise ValueError(f"theta0 must be (R, n) angles with n >= 2, got shape {tuple(theta0.shape)}")
    steps = [round(t / dt) for t in times]
    if any(k < 1 or abs(k * dt - t) > 1e-6 * max(1.0, t) for k, t in zip(steps, times)):
        raise ValueError(f"times {list(times)} must be positive multiples of dt = {dt}")
    K = max(steps)
    n = theta0.shape[-1]
    th0 = theta0.detach().clone().requires_grad_(True)
    x0 = torch.stack([th0.cos(), th0.sin()], -1)
    solver = {"euler": tp.Euler(), "heun": tp.Heun(), "rk4": tp.RK4()}[method]
    progress = tp.Progress(show=False, callback=None if callback is None else (lambda k, t, *_: callback(k, t)))
    traj = tp.solve(model, x0, solver, t1=K * dt, dt=dt, saveat=tp.SaveAt(record_every=1),
                    ledger=tp.LedgerOptions(diagnostics=False), progress=progress)
    est, amp = [], []
    done = K
    m3 = torch.arange(1, 4, dtype=theta0.dtype, device=theta0.device)
    for i, k in enumerate(steps):
        xN = traj.x[k, :, -1]
        thN = torch.atan2(xN[..., 1], xN[..., 0])
        grad, = torch.autograd.grad(thN.sum(), th0, retain_graph=i < len(steps) - 1)
        with torch.no_grad():
            phi = thN.unsqueeze(-1) - th0[:, :-1]
            est.append(n * grad[:, :-1] * mode_readout(phi, M, modes))
            xk = traj.x[k]
            ang = torch.atan2(xk[..., 1], xk[..., 0])
            c = torch.cos(ang.unsqueeze(-1) * m3).mean(-2)
            s = torch.sin(ang.unsqueeze(-1) * m3).mean(-2)
            amp.append(torch.sqrt(c * c + s * s))
        done += k
        if callback is not None:
            callback(done, times[i])
    return {"t": torch.tensor([k * dt for k in steps], dtype=torch.float64), "est": torch.stack(est).double(),
            "amplitude": torch.stack(amp).double()}


def first_order_control(theta0: torch.Tensor, times: Sequence[float], beta: float, lam: float, *, M: float,
                        modes: int) -> torch.Tensor:
    """The control variate of the paper's model: the estimator's first-order term minus its exact mean,

        C[m, r, k] = n t_m π_Nk f'(θ_k − θ_N) w(θ_N − θ_k) − n t_m π_Nk Σ_j ω_j a_j     (angles at t = 0),

    f(u) = β e^{β cos u} sin u (the force of one key, f'(u) = β e^{β cos u}(cos u − β sin²u)), π_Nk the last
    token's positional weights, w = :func:`mode_readout`.  Over uniform initial angles E[f'(−φ) w(φ)] = Σ_j ω_j a_j
    (a_j = j² I_j(β)), so E[C] = 0 exactly: ``est − C`` estimates the same profile, with the first-order noise
    removed (the estimate itself is n t π_Nk f' w + O(t²)).

    Parameters
    ----------
    theta0 : torch.Tensor
        initial angles (R, n).
    times : sequence of float
        the measurement times.
    beta, lam : float
        the model's β and λ.
    M, modes
        the readout's mode weights.

    Returns
    -------
    torch.Tensor
        (T, R, n − 1) float64."""
    th = theta0.double()
    n = th.shape[-1]
    k = torch.arange(n - 1, dtype=torch.float64)
    pi = torch.exp(-(lam / n) * (n - 1 - k))
    pi = pi / pi.sum()
    phi = th[:, -1:] - th[:, :-1]
    fprime = beta * torch.exp(beta * torch.cos(phi)) * (torch.cos(phi) - beta * torch.sin(phi) ** 2)
    mean = float((kt.mode_weights(M, modes) * kt.mode_rates(beta, modes)).sum())
    unit = n * pi * (fprime * mode_readout(phi, M, modes) - mean)
    return torch.stack([t * unit for t in times])


def sensitivity_profile(flow: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor) -> torch.Tensor:
    """The tangent sensitivity of the last token to each source, for tokens in any dimension d:

        R(s_k) = n · ‖P_{x_N(T)} ∂x_N(T)/∂x_k(0) P_{x_k(0)}‖_F,   k = 0, …, n − 2,

    by one backward pass per output coordinate (d of them) through ``flow``.  On the circle (d = 2) this is
    n·|∂θ_N(T)/∂θ_k(0)|, the modulus of the Jacobian in :func:`retrieval_estimates`; for a real network read by
    ``tp.pretrained`` it is the same question asked of its attention flow (docs/lost_in_the_middle.md).

    Parameters
    ----------
    flow : callable
        x0 (..., n, d) -> the last token's final state (..., d) (e.g. a ``tp.solve`` of a layerwise model).
    x0 : torch.Tensor
        initial tokens (..., n, d) on the sphere.

    Returns
    -------
    torch.Tensor
        (..., n − 1), x0's dtype.

    Raises
    ------
    ValueError
        flow returns a tensor of another shape than (..., d)."""
    x = x0.detach().clone().requires_grad_(True)
    out = flow(x)
    if out.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(f"flow must return the last token's state of shape {tuple(x.shape[:-2] + x.shape[-1:])}, "
                         f"got {tuple(out.shape)}")
    d, n = x.shape[-1], x.shape[-2]
    u = out / out.norm(dim=-1, keepdim=True)
    P_out = torch.eye(d, dtype=x.dtype, device=x.device) - u.detach().unsqueeze(-1) * u.detach().unsqueeze(-2)
    rows = []
    for a in range(d):  # row a of P_{x_N(T)} ∂x_N(T)/∂x0
        g, = torch.autograd.grad((out * P_out[..., a, :]).sum(), x, retain_graph=a < d - 1)
        rows.append(g)
    J = torch.stack(rows, -2)  # (..., n, d_out, d_in)
    xd = x.detach()
    J = J - (J @ xd.unsqueeze(-1)) * xd.unsqueeze(-2)  # times P_{x_k(0)} on the right
    return n * J[..., :-1, :, :].square().sum((-1, -2)).sqrt()


def network_profile(net, inputs, *, dt: float = 0.1, causal=None, head_weights: str = "sum") -> torch.Tensor:
    """The sensitivity profile (:func:`sensitivity_profile`) of a network read by ``tp.pretrained``: its continuous
    rung (the projected mean-field flow of its layers' heads, Θ_t piecewise constant per layer, softmax, ascent,
    one layer per unit of time, from the embeddings hidden_states[0] normalised to the unit sphere).

    Parameters
    ----------
    net : tp.pretrained.PretrainedNetwork
        from ``tp.pretrained.load`` (a GPT-2 for a causal network).
    inputs
        what ``tp.pretrained.hidden_states`` takes (token ids (B, n), a mapping, texts); every sequence must have
        the same length (no padding: the last token is the last position).
    dt : float
        the Euler step (1/dt steps per layer).
    causal
        the causal option of the flow (default: the network's own, True for GPT-2); a positional bias
        (``tp.ALiBi(slopes)``) for a network with one.
    head_weights : str
        as ``tp.layerwise_from_pretrained``.

    Returns
    -------
    torch.Tensor
        (B, n − 1) in the network's dtype: n·‖P ∂x_last(L)/∂x_k(0) P‖_F per source position k.

    Raises
    ------
    ValueError
        padded inputs, dt not 1/integer."""
    states, mask = tp.pretrained.hidden_states(net, inputs)
    if not bool(mask.all()):
        raise ValueError("network_profile needs sequences of one length (no padding): the last token must be the "
                         "last position of every sequence")
    steps = round(1.0 / dt)
    if steps < 1 or abs(steps * dt - 1.0) > 1e-9:
        raise ValueError(f"dt must be 1/N for an integer N >= 1 (steps per layer), got {dt!r}")
    L = net.num_layers
    model = tp.Model(tp.layerwise_from_pretrained(net, head_weights=head_weights), normalization="softmax",
                     direction="ascent", causal=net.causal if causal is None else causal)

    def flow(x):
        traj = tp.solve(model, x, tp.Euler(), t1=float(L), dt=1.0 / steps, saveat=tp.SaveAt(record_every=L * steps),
                        ledger=tp.LedgerOptions(diagnostics=False), progress=tp.Progress(show=False))
        return traj.x[-1][..., -1, :]

    return sensitivity_profile(flow, tp.sphere.normalize(states[0]))


# ------------------------------------------------------------------------------------------- reductions
def token_bins(n: int, bins: int) -> torch.Tensor:
    """The bin of each source token k = 0, …, n − 2 (position s_k = (k + 1)/n): floor(bins · k/(n − 1)).

    Parameters
    ----------
    n, bins : int
        tokens and bins.

    Returns
    -------
    torch.Tensor
        (n − 1,) int64 in [0, bins)."""
    k = torch.arange(n - 1)
    return torch.div(k * bins, n - 1, rounding_mode="floor")


def window_slope_weights(n: int, window: float) -> torch.Tensor:
    """Weights c_k (n − 1,) with Σ_k c_k y_k the least-squares slope of the line through (s_k, y_k) over the
    tokens with s_k >= 1 − window (zero elsewhere).

    Parameters
    ----------
    n : int
        tokens.
    window : float
        in (0, 1).

    Returns
    -------
    torch.Tensor
        float64 weights."""
    s = (torch.arange(n - 1, dtype=torch.float64) + 1) / n
    sel = s >= 1 - window - 1e-12
    u = s[sel] - s[sel].mean()
    c = torch.zeros(n - 1, dtype=torch.float64)
    c[sel] = u / u.square().sum()
    return c


def binned(est: torch.Tensor, idx: torch.Tensor, bins: int) -> torch.Tensor:
    """Mean over the tokens of each bin, over the last axis: (..., n − 1) -> (..., bins).

    Parameters
    ----------
    est : torch.Tensor
        per-token values (..., n − 1).
    idx : torch.Tensor
        the bin of each token (:func:`token_bins`).
    bins : int
        the number of bins.

    Returns
    -------
    torch.Tensor
        (..., bins)."""
    out = torch.zeros(*est.shape[:-1], bins, dtype=est.dtype).index_add_(-1, idx, est)
    return out / torch.bincount(idx, minlength=bins).to(est.dtype)
