"""Figures of the OU-vs-oscillating experiments (and of any run that records the same series).

Every function takes plain arrays (numpy or torch, moved to numpy here), builds a
``matplotlib.figure.Figure`` without touching pyplot's global state, and returns it; save it
with :meth:`transformer_pde.runs.RunDir.save_figure` (PNG and PDF, atomic).

* :func:`sphere_snapshots` — tokens at a few times: 3-D scatter on S² (d = 3), points on the
  circle S¹ (d = 2, with the angle histogram), the Gram matrix ⟨x_i, x_j⟩ for d ≥ 4.
* :func:`energy_balance` — the EDI ledger E(t) − E(0), ∫∂_sE, ∫𝒟, s∫𝒢², M_t and both
  residuals, Monte-Carlo mean ± std.
* :func:`slope_series` — the metric slope 𝒢²(t) for every H (mean, 16–84 % band over paths).
* :func:`slope_scaling` — the time-averaged 𝒢² against H with the fitted a·H^b.

Shapes: ``times (T,)``, per-path series ``(T, P)`` (P = 1 for a deterministic run),
tokens ``(T, n, d)``.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = ["sphere_snapshots", "energy_balance", "slope_series", "slope_scaling", "REGIME_COLORS", "head_colors"]

REGIME_COLORS = {"ou": "#27ae60", "oscillating": "#c0392b"}
REGIME_LABELS = {"ou": "OU", "oscillating": "oscillating"}
_LEDGER_STYLE = {
    "dE": ("#1f77b4", "-", r"$\mathcal{E}(t)-\mathcal{E}(0)$"),
    "partial": ("#27ae60", ":", r"$\int_0^t \partial_s\mathcal{E}\,ds$"),
    "dissipation": ("#7d3c98", "--", r"$\int_0^t \mathcal{D}_s\,ds$"),
    "slope": ("#8c564b", "-.", r"$s\int_0^t \mathscr{G}^2_s\,ds$"),
    "martingale": ("#e377c2", "-.", r"$M_t$"),
}


def _np(a) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=float)


def _figure(figsize):
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def head_colors(k: int):
    """k distinct colours for the head counts (dark to light)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.1 + 0.75 * i / max(1, k - 1)) for i in range(k)]


def _mean_std(v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(T, P) -> mean and (population) std over the paths."""
    v = _np(v)
    if v.ndim == 1:
        return v, np.zeros_like(v)
    return v.mean(-1), v.std(-1)


def _band(ax, t, v, color, ls="-", label=None, lw=1.8):
    m, s = _mean_std(v)
    ax.plot(t, m, color=color, ls=ls, lw=lw, label=label)
    if np.any(s > 0):
        ax.fill_between(t, m - s, m + s, color=color, alpha=0.18, linewidth=0)


# ---------------------------------------------------------------------------- snapshots
def _sphere_axis(ax, elev=18, azim=-55):
    u, v = np.mgrid[0:2 * np.pi:20j, 0:np.pi:12j]
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="#dddddd", linewidth=0.25,
                      alpha=0.6)
    ax.set_xlim(-1.05, 1.05)
    ax.set_ylim(-1.05, 1.05)
    ax.set_zlim(-1.05, 1.05)
    ax.set_box_aspect([1, 1, 1])
    ax.axis("off")
    ax.view_init(elev=elev, azim=azim)


def _order_by_vertex(x0: np.ndarray) -> np.ndarray:
    """Token order for Gram-matrix plots: by the nearest cross-polytope vertex ±e_k at t = 0."""
    k = np.abs(x0).argmax(-1)
    s = np.sign(x0[np.arange(len(x0)), k])
    return np.lexsort((s, k))


def sphere_snapshots(rows: Sequence[Tuple[str, object]], times, snapshot_times: Sequence[float], *,
                     title: str = "", colors: Optional[Sequence[str]] = None):
    """Tokens at ``snapshot_times`` (nearest recorded time), one row per entry of ``rows``.

    Args:
        rows: sequence of (label, x) with x of shape (T, n, d), recorded at ``times (T,)``.
        snapshot_times: the columns.
        title: figure title (reproductions say "descent" here).
        colors: one colour per row (the first column is drawn in grey, the initial state).

    d = 3: 3-D scatter on the sphere; d = 2: the points on the unit circle and a histogram of
    their angles; d ≥ 4: the Gram matrix ⟨x_i, x_j⟩ with tokens ordered by their initial vertex.

    Returns:
        matplotlib Figure.
    """
    t = _np(times)
    rows = [(lab, _np(x)) for lab, x in rows]
    if not rows:
        raise ValueError("sphere_snapshots needs at least one row")
    d = rows[0][1].shape[-1]
    nr, nc = len(rows), len(snapshot_times)
    colors = list(colors) if colors is not None else ["#2980b9"] * nr
    size = (2.7 * nc, 2.6 * nr + 0.5)
    fig = _figure(size)
    for r, (label, x) in enumerate(rows):
        order = _order_by_vertex(x[0]) if d >= 4 else None
        for c, ts in enumerate(snapshot_times):
            idx = int(np.argmin(np.abs(t - ts)))
            pts = x[idx]
            col = "#7f8c8d" if idx == 0 else colors[r]
            pos = r * nc + c + 1
            if d == 3:
                ax = fig.add_subplot(nr, nc, pos, projection="3d")
                _sphere_axis(ax)
                ax.scatter(pts[:, 0], pts[:, 1], pts[:, 2], color=col, s=10, depthshade=True, edgecolors="white",
                           linewidths=0.2)
            elif d == 2:
                ax = fig.add_subplot(nr, nc, pos)
                th = np.linspace(0, 2 * np.pi, 200)
                ax.plot(np.cos(th), np.sin(th), color="#cccccc", lw=0.8)
                ang = np.arctan2(pts[:, 1], pts[:, 0])
                hist, edges = np.histogram(ang, bins=72, range=(-np.pi, np.pi))
                mid = 0.5 * (edges[1:] + edges[:-1])
                rad = 1.0 + 0.5 * hist / max(1, hist.max())
                for a, rr in zip(mid, rad):
                    if rr > 1.0:
                        ax.plot([np.cos(a), rr * np.cos(a)], [np.sin(a), rr * np.sin(a)], color=col, lw=1.2, alpha=0.6)
                ax.scatter(pts[:, 0], pts[:, 1], color=col, s=10, zorder=5, edgecolors="white", linewidths=0.2)
                ax.set_xlim(-1.6, 1.6)
                ax.set_ylim(-1.6, 1.6)
                ax.set_aspect("equal")
                ax.axis("off")
            else:
                ax = fig.add_subplot(nr, nc, pos)
                p = pts[order]
                ax.imshow(p @ p.T, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
            if r == 0:
                ax.set_title(f"t = {t[idx]:.3g}", fontsize=9)
            if c == 0:
                if d == 3:
                    ax.text2D(-0.05, 0.5, label, transform=ax.transAxes, fontsize=8, rotation=90, va="center")
                else:
                    ax.text(-0.08, 0.5, label, transform=ax.transAxes, fontsize=8, rotation=90, va="center",
                            ha="right")
    if d >= 4:
        fig.text(0.5, 0.0, r"Gram matrix $\langle x_i, x_j\rangle$ (red +1, blue −1), tokens ordered by initial vertex",
                 ha="center", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(wspace=0.02, hspace=0.08)
    return fig


# ---------------------------------------------------------------------------- energy balance
def energy_balance(panels: Sequence[Tuple[str, Mapping[str, object]]], times, *, sign: float = -1.0,
                   title: str = "", ncols: Optional[int] = None):
    """The energy–dissipation ledger of each run, Monte-Carlo mean ± std (shaded).

    Args:
        panels: sequence of (label, ledger) with ledger a mapping of the trajectory's ledger
            keys ("dE", "partial", "dissipation", "slope", "martingale", "residual",
            "residual_slope") to arrays (T, P) (P = 1 for a deterministic run).
        times: (T,) shared by all panels.
        sign: s = −1 (descent) or +1 (ascent): the 𝒢² term is drawn as s·∫𝒢².
        ncols: panels per row (default: all in one row).

    Each panel has two axes: the terms (top) and the two residuals (bottom),
    residual = ΔE − ∫∂E − ∫𝒟 − M and residual_slope = ΔE − ∫∂E − s∫𝒢² − M (the reference
    code's check, exact only for H = 1 or normalization="effective").

    Returns:
        matplotlib Figure.
    """
    t = _np(times)
    k = len(panels)
    ncols = ncols or k
    nrows = -(-k // ncols)
    fig = _figure((4.2 * ncols, 5.2 * nrows))
    outer = fig.add_gridspec(nrows, ncols, hspace=0.28, wspace=0.28)
    for i, (label, led) in enumerate(panels):
        r, c = divmod(i, ncols)
        inner = outer[r, c].subgridspec(2, 1, height_ratios=[2.2, 1.0], hspace=0.06)
        ax = fig.add_subplot(inner[0])
        axr = fig.add_subplot(inner[1], sharex=ax)
        for key, (col, ls, lab) in _LEDGER_STYLE.items():
            if key not in led:
                continue
            v = _np(led[key])
            if key == "slope":
                v = sign * v
            if key == "martingale" and not np.any(v != 0):
                continue
            _band(ax, t, v, col, ls, lab)
        ax.axhline(0, color="#2c3e50", lw=0.8, alpha=0.6)
        ax.set_title(label, fontsize=9)
        ax.grid(True, ls=":", alpha=0.3)
        ax.tick_params(labelbottom=False, labelsize=7)
        _band(axr, t, led["residual"], "#e67e22", "-", r"residual ($\mathcal{D}$)", lw=1.6)
        _band(axr, t, led["residual_slope"], "#34495e", "--", r"residual ($s\,\mathscr{G}^2$)", lw=1.2)
        axr.axhline(0, color="#2c3e50", lw=0.8, alpha=0.6)
        axr.grid(True, ls=":", alpha=0.3)
        axr.set_xlabel("t", fontsize=8)
        axr.tick_params(labelsize=7)
        axr.yaxis.get_offset_text().set_fontsize(7)
        if i == 0:
            ax.legend(fontsize=7, loc="best")
            axr.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=11, y=0.95 if nrows > 1 else 1.0)
    return fig


# ---------------------------------------------------------------------------- metric slope
def slope_series(panels: Sequence[Tuple[str, Mapping[int, object]]], times, *, t_avg: Optional[float] = None,
                 title: str = ""):
    """𝒢²(t) for every H, one panel per regime (log scale): the Monte-Carlo mean, and shaded the
    16–84 % quantiles over the paths (a ± std band would cross zero on the log axis).

    Args:
        panels: sequence of (label, {H: slope (T, P)}).
        times: (T,).
        t_avg: draw the start of the time-average window.

    Returns:
        matplotlib Figure.
    """
    t = _np(times)
    fig = _figure((5.0 * len(panels), 3.6))
    for i, (label, curves) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        cols = head_colors(len(curves))
        for (H, v), col in zip(sorted(curves.items()), cols):
            v = _np(v).reshape(len(t), -1)
            floor = 1e-14
            ax.semilogy(t, np.maximum(v.mean(-1), floor), color=col, lw=1.6, label=f"H = {H}")
            if v.shape[-1] > 1:  # 16–84 % quantiles over the paths (± 1σ for a Gaussian), positive on a log axis
                lo, hi = np.quantile(v, [0.16, 0.84], axis=-1)
                ax.fill_between(t, np.maximum(lo, floor), np.maximum(hi, floor), color=col, alpha=0.18, linewidth=0)
        if t_avg is not None:
            ax.axvline(t_avg, color="#7f8c8d", ls=":", lw=1.0)
        ax.set_xlabel("t")
        ax.set_ylabel(r"$\mathscr{G}^2_t$")
        ax.set_title(label, fontsize=9)
        ax.grid(True, which="both", ls=":", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(wspace=0.3, top=0.83)
    return fig


def slope_scaling(entries: Sequence[Dict], *, title: str = "", t_avg: Optional[float] = None):
    """Time-averaged 𝒢² against H (log–log) with the fitted a·H^b, one series per regime.

    Args:
        entries: sequence of dicts with keys "label", "color", "heads" (K,), "per_path"
            (list of K arrays of per-path time averages), and "fit" (dict with "a", "b",
            optional "b_ci" (lo, hi)) or None.

    Markers are the Monte-Carlo means with error bars ± std over the paths (single paths
    have none); the faint dots are the individual paths.

    Returns:
        matplotlib Figure.
    """
    fig = _figure((5.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    for e in entries:
        Hs = np.asarray(e["heads"], dtype=float)
        per = [_np(p).reshape(-1) for p in e["per_path"]]
        means = np.array([p.mean() for p in per])
        stds = np.array([p.std() for p in per])
        for H, p in zip(Hs, per):
            if len(p) > 1:
                ax.scatter(np.full(len(p), H), p, color=e["color"], s=6, alpha=0.35)
        ax.errorbar(Hs, means, yerr=np.where(stds > 0, stds, np.nan), fmt="o", color=e["color"], ms=6, capsize=3,
                    label=f"{e['label']}: mean over paths")
        fit = e.get("fit")
        if fit is not None and fit.get("b") is not None:
            Hf = np.logspace(np.log10(Hs.min()), np.log10(Hs.max()), 100)
            ci = fit.get("b_ci")
            lab = f"{e['label']}: ${fit['a']:.3g}\\,H^{{{fit['b']:.3f}}}$"
            if ci is not None:
                lab += f", b ∈ [{ci[0]:.3f}, {ci[1]:.3f}]"
            ax.plot(Hf, fit["a"] * Hf ** fit["b"], color=e["color"], ls="--", lw=1.4, label=lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("H")
    ylab = r"$\overline{\mathscr{G}^2}$" + (f" (time average over t ≥ {t_avg:g})" if t_avg is not None else "")
    ax.set_ylabel(ylab)
    ax.grid(True, which="both", ls=":", alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return fig
