"""The parts shared by the studies of Pendharkar's multi-head theory on the full particle system.

The studies are :mod:`.theory_energy` (items 1–3: the energy and the radial dominance) and
:mod:`.theory_clustering` (items 4–7: clustering rates, ReLU vs softmax, attention entropy, orthogonal heads).
All runs use Pendharkar's conventions: symmetric heads with V_h = A_h, head weights ω_h = 1,
direction "ascent" (tokens cluster), unnormalised heads for the energy results and softmax
scalar heads λ_h I for the quantitative ones.

    theory_energy          items 1–2: total-energy monotonicity (sphere and flat), its defect for
                           broken symmetry / value alignment, per-head energies and radial shadows
    theory_radial          item 3: radial-dominance margin and the critical β*(H, n)
    theory_rates           item 4: equiangular γ-ODE vs particles, early/late rates, Lambert-W
                           maximiser, super-additivity
    theory_relu_softmax    item 5: linearised vs nonlinear clustering times, swept over n and d
    theory_entropy         item 6: attention entropy and dH/dt = −Cov(s, ṡ)
    theory_orthogonality   item 7: approximately orthogonal heads (principal angles 70–90°)

Here: the option checks, the options several kinds share, the ascent run, the small tables and the fits.
"""

from __future__ import annotations

import math
from functools import partial

import torch

import transformer_pde as tp

from . import Option, positive, save_captioned

__all__: list = []

# shared by the theory studies (named internal API)
__internal__ = ["BETA", "HEADS", "RK4_DT", "SEED", "T1", "append_row", "ascent_run", "float_list", "int_list",
                "loglog_slope", "positive_floats", "save_tidy", "scalar_heads", "select_rows", "ls_slope",
                "unit_interval", "cumtrapz", "simpson_residual"]


# ---------------------------------------------------------------------------- option checks
def int_list(minimum):
    def check(v):
        if not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= minimum for t in v):
            return f"must be a non-empty list of ints >= {minimum}"
        return None

    return check


def float_list(lo=None, hi=None, *, open_lo=False):
    def check(v):
        ok = bool(v) and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in v)
        if ok and lo is not None:
            ok = all((t > lo) if open_lo else (t >= lo) for t in v)
        if ok and hi is not None:
            ok = all(t <= hi for t in v)
        if not ok:
            rng = f" in {'(' if open_lo else '['}{lo}, {hi}]" if lo is not None or hi is not None else ""
            return f"must be a non-empty list of finite numbers{rng}"
        return None

    return check


def unit_interval(v):
    return None if 0 <= v < 1 else "must lie in [0, 1)"


positive_floats = float_list(0.0, None, open_lo=True)


# ---------------------------------------------------------------------------- the options of the kinds
# the same option in several kinds
HEADS = Option(3, (int,), "number of heads H", check=positive)
BETA = Option(1.0, (float,), "inverse temperature", check=positive)
T1 = Option(6.0, (float,), "final time", check=positive)
RK4_DT = Option(0.01, (float,), "time step (rk4)", check=positive)
SEED = Option(0, (int,), "seed")


# ---------------------------------------------------------------------------- shared by the kinds
def scalar_heads(lams, d, beta, dtype):
    """Scalar heads λ_h I on R^d, ω_h = 1."""
    return tp.Heads.scalar(torch.tensor(list(lams), dtype=dtype), d, beta=beta,
                           weights=torch.ones(len(lams), dtype=dtype))


def ascent_run(x0, heads, t1, dt, *, sparse=False, normalization="softmax", progress=None):
    """The rk4 run of the ascent flow (tokens cluster); ``sparse``: no diagnostics, a record every ≈ 0.05."""
    every = max(1, round(0.05 / dt)) if sparse else 1
    return tp.solve(tp.Model(heads, normalization=normalization, direction="ascent"), x0, tp.RK4(), t1=t1, dt=dt,
                    saveat=tp.SaveAt(record_every=every), ledger=tp.LedgerOptions(diagnostics=not sparse), progress=progress)


def append_row(rows, *values) -> None:
    """Append one row to the table ``rows`` (a dict of equal-length lists, values in column order)."""
    for k, v in zip(rows, values):
        rows[k].append(v)


def select_rows(rows, cols, **where):
    """The tuples of the columns ``cols`` of the rows of ``rows`` whose columns in ``where`` hold the given values."""
    n = len(rows[cols[0]])
    return [tuple(rows[c][i] for c in cols) for i in range(n) if all(rows[k][i] == v for k, v in where.items())]


def cumtrapz(t, y):
    dt = (t[1:] - t[:-1]).to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))
    return torch.cat([torch.zeros_like(y[:1]), torch.cumsum(0.5 * dt * (y[1:] + y[:-1]), 0)])


def simpson_residual(t, E, K):
    """max_k |E(t_2k) − E(0) − ∫_0^{t_2k} K dt| on a uniform grid, the integral by composite Simpson
    (error O(dt⁴), the order of the rk4 energies), relative to max |E − E(0)|."""
    m = (len(t) - 1) // 2
    if m < 1:
        return float("nan")
    h = float(t[1] - t[0])
    panels = h / 3 * (K[0:2 * m:2] + 4 * K[1:2 * m:2] + K[2:2 * m + 1:2])
    integral = torch.cumsum(panels, 0)
    dE = E[2:2 * m + 1:2] - E[0]
    return float((dE - integral).abs().max() / (E - E[0]).abs().max().clamp_min(1e-300))


def ls_slope(x, y):
    """Least-squares slope of y against x (in float64)."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def loglog_slope(x, y):
    """Least-squares slope of log y against log x (positive entries only)."""
    xs, ys = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    keep = (xs > 0) & (ys > 0) & torch.isfinite(ys)
    if int(keep.sum()) < 2:
        return float("nan")
    return ls_slope(xs[keep].log(), ys[keep].log())


save_tidy = partial(save_captioned, tidy=True)  # legends under the axes, laid out, captioned and saved

