"""Figures of the OU-vs-oscillating experiments (and of any run that records the same series).

Every function takes plain arrays (numpy or torch, moved to numpy here), builds a
``matplotlib.figure.Figure`` without touching pyplot's global state, and returns it; save it
with :meth:`transformer_pde.application.rundir.RunDir.save_figure` (PNG and PDF, atomic).

* :func:`sphere_snapshots` — tokens at evenly spaced recorded times: 3-D scatter on S²
  (d = 3), points on the circle S¹ (d = 2, with the angle histogram), the Gram matrix
  ⟨x_i, x_j⟩ for d ≥ 4.
* :func:`energy_balance` — the EDI ledger E(t) − E(0), ∫∂ₛE, ∫𝒟, s∫𝒢², M_t and both
  residuals, Monte-Carlo mean ± std, one panel per run.
* :func:`plot_ledger` — the same ledger for a single run (the ``demo`` study).
* :func:`slope_series` — the metric slope 𝒢²(t) for every H (mean, 16–84 % band over paths).
* :func:`slope_scaling` — the time-averaged 𝒢² against H with the fitted a·H^b.

Every figure carries a caption line at the bottom (:func:`add_caption`) that says what the
lines, bands and bars are; :func:`figure_caption` reads it back (studies copy it into
``metrics.json`` under ``figure_captions``).  Legends sit outside the data (right of the axes).

Shapes: ``times (T,)``, per-path series ``(T, P)`` (P = 1 for a deterministic run),
tokens ``(T, n, d)``.
"""

from __future__ import annotations

import textwrap
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["sphere_snapshots", "energy_balance", "plot_ledger", "slope_series", "slope_scaling", "REGIME_COLORS",
           "REGIME_LABELS", "LEDGER_LABELS", "head_colors", "add_caption", "finish_figure", "figure_caption",
           "snapshot_indices", "snapshot_caption", "draw_sphere", "vertex_order"]
# shared with the studies and the animation (named internal API)
__internal__ = ["as_numpy", "figure", "subplots", "panel", "draw_circle", "draw_gram"]

REGIME_COLORS = {"ou": "#27ae60", "oscillating": "#c0392b"}
REGIME_LABELS = {"ou": "OU", "oscillating": "oscillating"}
#: readable names of the ledger keys of a Trajectory (matplotlib mathtext)
LEDGER_LABELS = {
    "dE": r"$\mathcal{E}(t)-\mathcal{E}(0)$",
    "partial": r"$\int_0^t \partial_s\mathcal{E}\,ds$",
    "dissipation": r"$\int_0^t \mathcal{D}_s\,ds$",
    "slope": r"$s\int_0^t \mathscr{G}^2_s\,ds$",
    "martingale": r"$M_t$",
    "residual": r"residual ($\mathcal{D}$-based)",
    "residual_slope": r"residual ($s\,\mathscr{G}^2$-based)",
}
_LEDGER_STYLE = {
    "dE": ("#1f77b4", "-"),
    "partial": ("#27ae60", ":"),
    "dissipation": ("#7d3c98", "--"),
    "slope": ("#8c564b", "-."),
    "martingale": ("#e377c2", "-."),
}
_RESIDUAL_STYLE = {"residual": ("#e67e22", "-", 1.6), "residual_slope": ("#34495e", "--", 1.2)}
_CAPTION_GID = "transformer_pde.caption"


def as_numpy(a) -> np.ndarray:
    """A float numpy array of an array-like or a tensor (detached, on the CPU)."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=float)


def figure(figsize, title: Optional[str] = None):
    """A matplotlib Figure with an Agg canvas (a renderer for the caption placement; no pyplot state) and its
    title when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    if title is not None:
        fig.suptitle(title)
    return fig


def subplots(rows: int, cols: int, figsize, title: Optional[str] = None, **kw):
    """:func:`figure` and its grid of axes (``Figure.subplots(rows, cols, **kw)``); returns (figure, axes)."""
    fig = figure(figsize, title)
    return fig, fig.subplots(rows, cols, **kw)


def panel(ax, xlabel=None, ylabel=None, title=None, *, legend=None, title_size=None) -> None:
    """Label one panel: the axis labels and the title that are given, and a legend (``legend``: True or the
    keyword arguments of ``ax.legend``)."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    if legend:
        ax.legend(**({} if legend is True else legend))


def head_colors(k: int):
    """k distinct colours for the head counts (dark to light)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.1 + 0.75 * i / max(1, k - 1)) for i in range(k)]


def _paths(v) -> int:
    """Number of paths P of a (T,) or (T, P) series."""
    v = np.asarray(v)
    return 1 if v.ndim == 1 else int(np.prod(v.shape[1:]))


def _mean_std(v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(T, P) -> mean and (population) std over the paths."""
    v = as_numpy(v)
    if v.ndim == 1:
        return v, np.zeros_like(v)
    v = v.reshape(len(v), -1)
    return v.mean(-1), v.std(-1)


def _band(ax, t, v, color, ls="-", label=None, lw=1.8):
    m, s = _mean_std(v)
    line, = ax.plot(t, m, color=color, ls=ls, lw=lw, label=label)
    if np.any(s > 0):
        ax.fill_between(t, m - s, m + s, color=color, alpha=0.18, linewidth=0)
    return line


def _mathify(text: str) -> str:
    """Unicode script letters (missing from DejaVu Sans) -> mathtext."""
    return text.replace("𝒟", r"$\mathcal{D}$").replace("𝒢", r"$\mathscr{G}$").replace("ℰ", r"$\mathcal{E}$")


# ---------------------------------------------------------------------------- captions
def add_caption(fig, text: str, *, fontsize: float = 7.5) -> None:
    """Write ``text`` as a caption line (wrapped to the figure width) below everything drawn so far.

    The caption is placed under the figure's tight bounding box (axes labels and legends
    included), so add it last; ``RunDir.save_figure`` (``bbox_inches="tight"``) keeps it.
    Unicode 𝒟 / 𝒢 / ℰ are drawn as mathtext.  :func:`figure_caption` returns ``text``.
    """
    canvas = fig.canvas
    if not hasattr(canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(fig)
    width, height = fig.get_size_inches()
    bb = fig.get_tightbbox(canvas.get_renderer())
    y = bb.y0 / height - 0.06 / height  # 0.06 inch below the lowest artist
    x0, x1 = max(0.0, bb.x0 / width), min(1.0, bb.x1 / width)
    chars = max(40, int((x1 - x0) * width * 72 / (0.55 * fontsize)))
    lines = textwrap.wrap(text, chars, break_long_words=False, break_on_hyphens=False)
    fig.text(0.5 * (x0 + x1), y, _mathify("\n".join(lines)), ha="center", va="top", fontsize=fontsize,
             color="#333333", gid=_CAPTION_GID)
    fig._transformer_pde_caption = text  # the plain text, for figure_caption


def finish_figure(fig, caption: str, *, suptitle_space: float = 0.94) -> None:
    """Move every axes legend below its axes (outside the data), thin crowded x ticks, lay out, add the caption.

    For multi-panel figures built with ``plt.subplots``: each legend keeps its handles and
    labels and is placed centred under its axes (below the x label); ``tight_layout`` then
    makes room (the top ``1 − suptitle_space`` of the figure stays free for the suptitle),
    and :func:`add_caption` writes ``caption`` under everything.
    """
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if isinstance(ax.xaxis.get_major_locator(), MaxNLocator) and ax.get_xscale() == "linear":
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))  # long tick labels ("0.0025") must not touch
        leg = ax.get_legend()
        if leg is None:
            continue
        # the legend's own entries, in its order: they may include the lines of a twin axis (twinx), which
        # ax.get_legend_handles_labels() does not list
        shown = [t.get_text() for t in leg.get_texts()]
        found = {}
        for other in [ax] + [a for a in fig.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]:
            for h, lab in zip(*other.get_legend_handles_labels()):
                found.setdefault(lab, h)
        labels = [lab for lab in shown if lab in found]
        handles = [found[lab] for lab in labels]
        leg.remove()
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7.5, frameon=False,
                  ncol=2 if len(labels) > 3 else 1)
    fig.tight_layout(rect=(0, 0, 1, suptitle_space))
    add_caption(fig, caption)


def figure_caption(fig) -> Optional[str]:
    """The caption written by :func:`add_caption` (plain Unicode text), or None."""
    return getattr(fig, "_transformer_pde_caption", None)


# ---------------------------------------------------------------------------- snapshots
def snapshot_indices(times, count: int) -> List[int]:
    """Indices of ``count`` evenly spaced recorded times from the first to the last.

    The targets t_0 + k (t_end − t_0)/(count − 1), k = 0..count−1, are matched to the nearest
    recorded time; repeats (fewer records than ``count``) are dropped.  times: (T,).

    Raises
    ------
    ValueError
        when count < 1 or times is empty.
    """
    t = as_numpy(times).reshape(-1)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"count must be a positive integer (number of snapshot columns), got {count!r}")
    if t.size == 0:
        raise ValueError("times is empty: nothing was recorded")
    targets = np.linspace(t[0], t[-1], count) if count > 1 else np.array([t[0]])
    return list(dict.fromkeys(int(np.argmin(np.abs(t - ts))) for ts in targets))  # nearest records, no repeats


def draw_sphere(ax, elev: float = 18, azim: float = -55, zoom: float = 1.0) -> None:
    """Prepare a 3-D axes for tokens on S²: faint wireframe, equal aspect, no axes box (``zoom`` > 1 enlarges)."""
    u, v = np.mgrid[0:2 * np.pi:20j, 0:np.pi:12j]
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="#dddddd", linewidth=0.25,
                      alpha=0.6)
    ax.set_xlim(-1.05, 1.05)
    ax.set_ylim(-1.05, 1.05)
    ax.set_zlim(-1.05, 1.05)
    ax.set_box_aspect([1, 1, 1], zoom=zoom)
    ax.axis("off")
    ax.view_init(elev=elev, azim=azim)


def draw_circle(ax, lim: float) -> None:
    """Prepare axes for tokens on S¹: the unit circle in light grey, equal aspect, limits ±lim, no axes box."""
    th = np.linspace(0, 2 * np.pi, 200)
    ax.plot(np.cos(th), np.sin(th), color="#cccccc", lw=0.8)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_gram(ax, pts):
    """The Gram matrix ⟨x_i, x_j⟩ of the tokens pts (m, d) (red +1, blue −1), without ticks; returns the image."""
    image = ax.imshow(pts @ pts.T, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    return image


def vertex_order(x0) -> np.ndarray:
    """Token order for Gram-matrix plots: by the nearest cross-polytope vertex ±e_k at t = 0.

    x0: (n, d).  Returns a permutation (n,)."""
    x0 = as_numpy(x0)
    k = np.abs(x0).argmax(-1)
    s = np.sign(x0[np.arange(len(x0)), k])
    return np.lexsort((s, k))


def sphere_snapshots(rows: Sequence[Tuple[str, object]], times, snapshot_times: Union[int, Sequence[float]] = 5, *,
                     title: str = "", colors: Optional[Sequence[str]] = None, caption: Optional[str] = None):
    """Tokens at evenly spaced recorded times, one row per entry of ``rows``.

    Parameters
    ----------
    rows : Sequence[Tuple[str, object]]
        sequence of (label, x) with x of shape (T, n, d), recorded at ``times (T,)``.
    snapshot_times : Union[int, Sequence[float]]
        the number of columns (evenly spaced recorded times from the first to
        the last, :func:`snapshot_indices`), or explicit times (nearest recorded time each).
    title : str
        figure title (reproductions say "descent" here).
    colors : Optional[Sequence[str]]
        one colour per row (the first column is drawn in grey when it is t = t_0).
    caption : Optional[str]
        text of the caption line; None writes one that says what the columns,
        colours and (d = 2) the histogram ticks or (d ≥ 4) the Gram matrices are.
        Prepend what the rows are (which path) in the caller's text.

    d = 3: 3-D scatter on the sphere; d = 2: the points on the unit circle and a histogram of
    their angles; d ≥ 4: the Gram matrix ⟨x_i, x_j⟩ with tokens ordered by their initial vertex.
    Column titles give the recorded time shown.

    Returns
    -------
    result
        matplotlib Figure.

    Raises
    ------
    ValueError
        no rows, or tokens that are not (T, n, d) with T = len(times).
    """
    t = as_numpy(times).reshape(-1)
    rows = [(lab, as_numpy(x)) for lab, x in rows]
    if not rows:
        raise ValueError("sphere_snapshots needs at least one row")
    for lab, x in rows:
        if x.ndim != 3 or x.shape[0] != len(t):
            raise ValueError(f"rows: tokens of row {lab!r} must have shape (T, n, d) with T = len(times) = {len(t)}, "
                             f"got {tuple(x.shape)}; pick one path first, e.g. traj.x[:, 0]")
    d = rows[0][1].shape[-1]
    if isinstance(snapshot_times, (int, np.integer)) and not isinstance(snapshot_times, bool):
        cols = snapshot_indices(t, int(snapshot_times))
    else:
        cols = [int(np.argmin(np.abs(t - ts))) for ts in snapshot_times]
    nr, nc = len(rows), len(cols)
    colors = list(colors) if colors is not None else ["#2980b9"] * nr
    fig = figure((2.7 * nc, 2.6 * nr + 0.5))
    for r, (label, x) in enumerate(rows):
        order = vertex_order(x[0]) if d >= 4 else None
        for c, idx in enumerate(cols):
            pts = x[idx]
            col = "#7f8c8d" if idx == 0 else colors[r]
            pos = r * nc + c + 1
            if d == 3:
                ax = fig.add_subplot(nr, nc, pos, projection="3d")
                draw_sphere(ax, zoom=1.2)
                ax.scatter(pts[:, 0], pts[:, 1], pts[:, 2], color=col, s=10, depthshade=True, edgecolors="white",
                           linewidths=0.2)
            elif d == 2:
                ax = fig.add_subplot(nr, nc, pos)
                draw_circle(ax, 1.6)
                ang = np.arctan2(pts[:, 1], pts[:, 0])
                hist, edges = np.histogram(ang, bins=72, range=(-np.pi, np.pi))
                mid = 0.5 * (edges[1:] + edges[:-1])
                rad = 1.0 + 0.5 * hist / max(1, hist.max())
                for a, rr in zip(mid, rad):
                    if rr > 1.0:
                        ax.plot([np.cos(a), rr * np.cos(a)], [np.sin(a), rr * np.sin(a)], color=col, lw=1.2, alpha=0.6)
                ax.scatter(pts[:, 0], pts[:, 1], color=col, s=10, zorder=5, edgecolors="white", linewidths=0.2)
            else:
                ax = fig.add_subplot(nr, nc, pos)
                draw_gram(ax, pts[order])
            if r == 0:
                ax.set_title(f"t = {t[idx]:.3g}", fontsize=9)
            if c == 0:
                if d == 3:
                    ax.text2D(-0.05, 0.5, label, transform=ax.transAxes, fontsize=8, rotation=90, va="center")
                else:
                    ax.text(-0.08, 0.5, label, transform=ax.transAxes, fontsize=8, rotation=90, va="center",
                            ha="right")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(wspace=0.02, hspace=0.02)
    if caption is None:
        caption = snapshot_caption(d, t[cols])
    add_caption(fig, caption)
    return fig


def snapshot_caption(d: int, shown_times) -> str:
    """The default caption of :func:`sphere_snapshots` for tokens in R^d at the shown times."""
    shown = ", ".join(f"{v:.3g}" for v in np.asarray(shown_times, dtype=float))
    text = f"Columns: recorded times t = {shown} (evenly spaced); grey: the initial tokens."
    if d == 3:
        text += " Points: the tokens on S² (hidden side shaded lighter)."
    elif d == 2:
        text += " Points: the tokens on S¹; ticks outside the circle: histogram of the token angles (72 bins)."
    else:
        text += (f" Each panel: the Gram matrix ⟨x_i, x_j⟩ of the tokens on S^{d - 1} (red +1, blue −1), tokens "
                 f"ordered by their initial vertex ±e_k.")
    return text


# ---------------------------------------------------------------------------- energy balance
def _ledger_axes(fig, spec, t, led, sign, *, title, handles):
    """Draw one ledger (terms on top, residuals below) into the subplot spec; collect legend handles."""
    has_res = [k for k in _RESIDUAL_STYLE if k in led]
    if has_res:
        inner = spec.subgridspec(2, 1, height_ratios=[2.2, 1.0], hspace=0.08)
        ax = fig.add_subplot(inner[0])
        axr = fig.add_subplot(inner[1], sharex=ax)
    else:
        ax, axr = fig.add_subplot(spec), None
    for key, (col, ls) in _LEDGER_STYLE.items():
        if key not in led:
            continue
        v = as_numpy(led[key])
        if key == "slope":
            v = sign * v
        if key == "martingale" and not np.any(v != 0):
            continue
        handles.setdefault(key, _band(ax, t, v, col, ls, LEDGER_LABELS[key]))
    for key in has_res:
        col, ls, lw = _RESIDUAL_STYLE[key]
        handles.setdefault(key, _band(axr, t, led[key], col, ls, LEDGER_LABELS[key], lw=lw))
    ax.set_title(title, fontsize=9)
    for a, ylabel in [(ax, "energy, ledger terms")] + ([(axr, "residual")] if axr is not None else []):
        a.axhline(0, color="#2c3e50", lw=0.8, alpha=0.6)
        a.grid(True, ls=":", alpha=0.3)
        a.set_ylabel(ylabel, fontsize=8)
        a.tick_params(labelsize=7)
    (ax if axr is None else axr).set_xlabel("t", fontsize=8)
    if axr is not None:
        ax.tick_params(labelbottom=False)
        axr.yaxis.get_offset_text().set_fontsize(7)


def _paths_note(P: int) -> str:
    return "one path" if P == 1 else f"mean ± std of {P} paths"


def _ledger_caption(sign: float, Ps: Sequence[int], has_slope: bool) -> str:
    s = "−" if sign < 0 else "+"
    text = ("Top: the terms of the energy balance ℰ(t) − ℰ(0) = ∫∂ₛℰ ds + ∫𝒟 ds + M(t) "
            "(∂ₛℰ with the Itô correction, M the martingale of noisy weights)")
    if has_slope:
        text += f", and {s}∫𝒢² ds (the metric-slope form of the dissipation)"
    text += ". Bottom: residual = ℰ(t) − ℰ(0) − ∫∂ₛℰ − ∫𝒟 − M"
    if has_slope:
        text += (f" and the reference code's check ℰ(t) − ℰ(0) − ∫∂ₛℰ {'+' if sign < 0 else '−'} ∫𝒢² − M "
                 f"(exact only when 𝒟 = {s}𝒢², e.g. H = 1)")
    if max(Ps) > 1:
        text += ". Lines: mean over the Monte-Carlo paths; shaded: ± 1 std over the paths"
        if min(Ps) == 1:
            text += "; single-path (deterministic) panels have no band"
    else:
        text += ". One path (no bands)"
    return text + "."


def energy_balance(panels: Sequence[Tuple[str, Mapping[str, object]]], times, *, sign: float = -1.0,
                   title: str = "", ncols: Optional[int] = None, caption: Optional[str] = None):
    """The energy–dissipation ledger of each run, Monte-Carlo mean ± std (shaded).

    Parameters
    ----------
    panels : Sequence[Tuple[str, Mapping[str, object]]]
        sequence of (label, ledger) with ledger a mapping of the trajectory's ledger
        keys ("dE", "partial", "dissipation", "slope", "martingale", "residual",
        "residual_slope"; any subset) to arrays (T, P) (P = 1 for a deterministic run).
        Each panel title gets "(mean ± std of P paths)" or "(one path)" appended.
    times
        (T,) shared by all panels.
    sign : float
        s = −1 (descent) or +1 (ascent): the 𝒢² term is drawn as s·∫𝒢².
    ncols : Optional[int]
        panels per row (default: all in one row).
    caption : Optional[str]
        caption text; None writes one that says what the terms, residuals and bands are.

    Each panel has two axes: the terms (top) and the residuals (bottom),
    residual = ΔE − ∫∂E − ∫𝒟 − M and residual_slope = ΔE − ∫∂E − s∫𝒢² − M (the reference
    code's check, exact only for H = 1 or normalization="effective").  One legend for all
    panels sits to the right of the figure.

    Returns
    -------
    result
        matplotlib Figure.
    """
    k = len(panels)
    if k == 0:
        raise ValueError("energy_balance needs at least one panel")
    ncols = ncols or k
    nrows = -(-k // ncols)
    fig = figure((4.2 * ncols, 5.2 * nrows))
    default_caption = _ledger_panels(fig, fig.add_gridspec(nrows, ncols, hspace=0.3, wspace=0.34), ncols, panels,
                                     as_numpy(times), sign)
    if title:
        fig.suptitle(title, fontsize=11, y=0.95 if nrows > 1 else 1.0)
    add_caption(fig, caption if caption is not None else default_caption)
    return fig


def _ledger_panels(fig, grid, ncols: int, panels, t, sign: float) -> str:
    """Draw the ledgers [(label, ledger)] into the cells of ``grid`` (label None: the title is only the paths
    note) with one legend right of them; returns the default caption."""
    handles: Dict[str, object] = {}
    Ps = []
    for i, (label, led) in enumerate(panels):
        P = max(_paths(as_numpy(v)) for v in led.values())
        Ps.append(P)
        _ledger_axes(fig, grid[divmod(i, ncols)], t, led, sign, handles=handles,
                     title=_paths_note(P) if label is None else f"{label} ({_paths_note(P)})")
    order = [key for key in LEDGER_LABELS if key in handles]
    fig.legend([handles[key] for key in order], [LEDGER_LABELS[key] for key in order], loc="center left",
               bbox_to_anchor=(0.91, 0.5), fontsize=8, frameon=False)
    return _ledger_caption(sign, Ps, any("slope" in led or "residual_slope" in led for _, led in panels))


def plot_ledger(times, ledger: Mapping[str, object], *, keys: Optional[Sequence[str]] = None, sign: float = -1.0,
                title: str = "", caption: Optional[str] = None):
    """The energy ledger of one run (a Trajectory's ``ledger``), with readable labels.

    Parameters
    ----------
    times
        (T,).  ledger: mapping key -> (T,) or (T, P) (e.g. ``traj.ledger``); keys
        among "dE", "partial", "dissipation", "slope", "martingale", "residual",
        "residual_slope".
    keys : Optional[Sequence[str]]
        which entries to draw (default: all of the above that are present).
    sign : float
        s = −1 (descent) or +1 (ascent), the sign of the 𝒢² term.
    title : str
        axes title.  caption: caption text (None: what the terms and bands are).

    Draws the terms (E(t) − E(0), ∫∂ₛE ds, ∫𝒟 ds, s∫𝒢² ds, M_t) on top and the residuals
    below (mean over the paths, shaded ± 1 std); the legend sits right of the axes.

    Returns
    -------
    result
        matplotlib Figure.

    Raises
    ------
    ValueError
        an unknown key, or no known key in ``ledger``.
    """
    if keys is not None:
        bad = [k for k in keys if k not in LEDGER_LABELS]
        if bad:
            raise ValueError(f"keys: unknown ledger key {bad[0]!r}; allowed: {', '.join(LEDGER_LABELS)}")
        missing = [k for k in keys if k not in ledger]
        if missing:
            raise ValueError(f"keys: {missing[0]!r} is not in the ledger (it has {', '.join(map(str, ledger))})")
    use = [k for k in (keys if keys is not None else LEDGER_LABELS) if k in ledger and k in LEDGER_LABELS]
    if not use:
        raise ValueError(f"ledger has none of the keys {', '.join(LEDGER_LABELS)}")
    fig = figure((6.4, 4.6 if any(k in _RESIDUAL_STYLE for k in use) else 3.4))
    default_caption = _ledger_panels(fig, fig.add_gridspec(1, 1), 1, [(title or None, {k: ledger[k] for k in use})],
                                     as_numpy(times), sign)
    add_caption(fig, caption if caption is not None else default_caption)
    return fig


# ---------------------------------------------------------------------------- metric slope
def slope_series(panels: Sequence[Tuple[str, Mapping[int, object]]], times, *, t_avg: Optional[float] = None,
                 title: str = "", caption: Optional[str] = None):
    """𝒢²(t) for every H, one panel per regime (log scale): the Monte-Carlo mean, and shaded the
    16–84 % quantiles over the paths (a ± std band would cross zero on the log axis).

    Parameters
    ----------
    panels : Sequence[Tuple[str, Mapping[int, object]]]
        sequence of (label, {H: slope (T, P)}); the panel title says "mean of P
        paths" or "one path" from the shape.
    times
        (T,).
    t_avg : Optional[float]
        draw (and explain in the legend) the start of the time-average window.
    caption : Optional[str]
        caption text (None: what lines, bands and the dotted line are).

    Returns
    -------
    result
        matplotlib Figure.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t = as_numpy(times)
    fig = figure((4.6 * len(panels) + 1.6, 3.6))
    heads_all = sorted({H for _, c in panels for H in c})
    colors = dict(zip(heads_all, head_colors(len(heads_all))))
    any_band = False
    for i, (label, curves) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        P = 1
        for H, v in sorted(curves.items()):
            col = colors[H]
            v = as_numpy(v).reshape(len(t), -1)
            P = max(P, v.shape[-1])
            floor = 1e-14
            ax.semilogy(t, np.maximum(v.mean(-1), floor), color=col, lw=1.6)
            if v.shape[-1] > 1:  # 16–84 % quantiles over the paths (± 1σ for a Gaussian), positive on a log axis
                any_band = True
                lo, hi = np.quantile(v, [0.16, 0.84], axis=-1)
                ax.fill_between(t, np.maximum(lo, floor), np.maximum(hi, floor), color=col, alpha=0.18, linewidth=0)
        if t_avg is not None:
            ax.axvline(t_avg, color="#7f8c8d", ls=":", lw=1.0)
        note = "one path" if P == 1 else f"mean of {P} paths, 16–84 % band"
        panel(ax, "t", r"metric slope $\mathscr{G}^2_t$", f"{label} ({note})", title_size=9)
        ax.grid(True, which="both", ls=":", alpha=0.3)
    handles = [Line2D([], [], color=colors[H], lw=1.6, label=f"H = {H}") for H in heads_all]
    if any_band:
        handles.append(Patch(color="#7f8c8d", alpha=0.25, label="16–84 % of paths"))
    if t_avg is not None:
        handles.append(Line2D([], [], color="#7f8c8d", ls=":", lw=1.0, label=f"t = {t_avg:g}: start of\ntime average"))
    fig.subplots_adjust(wspace=0.32, top=0.83, right=1 - 1.6 / fig.get_size_inches()[0])
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1 - 1.5 / fig.get_size_inches()[0], 0.5),
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    if caption is None:
        band = "; shaded: 16–84 % quantiles over the paths (± 1σ for a Gaussian; a ± std band would cross 0)"
        dotted = (f". Dotted: t = {t_avg:g}, where the time average of the scaling figure starts" if t_avg is not None
                  else "")
        caption = ("Metric slope 𝒢² = ∫ b|V|² dμ on a log axis, one colour per head count H. Lines: mean over the "
                   f"Monte-Carlo paths (or the single path of a deterministic run){band if any_band else ''}{dotted}.")
    add_caption(fig, caption)
    return fig


def slope_scaling(entries: Sequence[Dict], *, title: str = "", t_avg: Optional[float] = None,
                  caption: Optional[str] = None):
    """Time-averaged 𝒢² against H (log–log) with the fitted a·H^b, one series per regime.

    Parameters
    ----------
    entries : Sequence[Dict]
        sequence of dicts with keys "label", "color", "heads" (K,), "per_path"
        (list of K arrays of per-path time averages), and "fit" (dict with "a", "b",
        optional "b_ci" (lo, hi) and "level") or None.
    t_avg : Optional[float]
        start of the averaging window (axis label and caption).
    caption : Optional[str]
        caption text (None: what markers, bars, dots and lines are).

    Markers are the Monte-Carlo means with error bars ± std over the paths (single paths
    have none: the legend then says "one path"); the faint dots are the individual paths.
    The H axis is ticked at the head counts.

    Returns
    -------
    result
        matplotlib Figure.
    """
    from matplotlib.ticker import FixedLocator, LogFormatterSciNotation, LogLocator, NullFormatter

    fig = figure((5.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    all_H: List[float] = []
    any_multi = False
    level = None
    for e in entries:
        Hs = np.asarray(e["heads"], dtype=float)
        all_H += list(Hs)
        per = [as_numpy(p).reshape(-1) for p in e["per_path"]]
        means = np.array([p.mean() for p in per])
        stds = np.array([p.std() for p in per])
        P = max(len(p) for p in per)
        any_multi |= P > 1
        for H, p in zip(Hs, per):
            if len(p) > 1:
                ax.scatter(np.full(len(p), H), p, color=e["color"], s=6, alpha=0.35)
        lab = f"{e['label']}: mean ± std of {P} paths" if P > 1 else f"{e['label']}: one path"
        ax.errorbar(Hs, means, yerr=np.where(stds > 0, stds, np.nan), fmt="o", color=e["color"], ms=6, capsize=3,
                    label=lab)
        fit = e.get("fit")
        if fit is not None and fit.get("b") is not None:
            Hf = np.logspace(np.log10(Hs.min()), np.log10(Hs.max()), 100)
            ci = fit.get("b_ci")
            lab = f"{e['label']}: fit ${fit['a']:.3g}\\,H^{{{fit['b']:.3f}}}$"
            if ci is not None:
                level = fit.get("level", level)
                lab += f"\nb ∈ [{ci[0]:.3f}, {ci[1]:.3f}]"
            ax.plot(Hf, fit["a"] * Hf ** fit["b"], color=e["color"], ls="--", lw=1.4, label=lab)
    if any_multi:
        ax.scatter([], [], color="#7f8c8d", s=6, alpha=0.5, label="single paths")
    ax.set_xscale("log")
    ax.set_yscale("log")
    Hu = sorted(set(all_H))
    ax.xaxis.set_major_locator(FixedLocator(Hu))
    ax.set_xticklabels([f"{h:g}" for h in Hu])
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = ax.get_ylim()
    decades = np.log10(hi / lo) if lo > 0 and hi > lo else 3.0
    subs = tuple(range(1, 10)) if decades < 1.0 else (1.0, 2.0, 5.0) if decades < 3.0 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=30))
    # label every major tick (the formatter would otherwise hide some of 1, 2, 5 × 10^k on short ranges)
    ax.yaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(np.inf, np.inf)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", ls=":", alpha=0.3)
    ylab = r"time-averaged $\overline{\mathscr{G}^2}$" + (f" over t ≥ {t_avg:g}" if t_avg is not None else "")
    panel(ax, "number of heads H", ylab, title or None, title_size=10,
          legend={"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "frameon": False})
    if caption is None:
        window = f"over t ≥ {t_avg:g}" if t_avg is not None else "over the run"
        caption = f"Time average of 𝒢² {window} against H (log–log). Markers: mean over the Monte-Carlo paths"
        if any_multi:
            caption += "; error bars: ± 1 std over the paths; faint dots: the individual paths"
        caption += "; a series of one (deterministic) path has no bar. Dashed: least-squares fit a·H^b of the means"
        if level is not None:
            caption += f"; b's interval: {100 * level:g} % percentile bootstrap over the paths"
        caption += "."
    add_caption(fig, caption)
    return fig
