"""Animated token flows: GIF (pillow) or MP4 (ffmpeg) of one or more trajectories side by side.

:func:`animate_tokens` draws each trajectory in its own panel, all at the same times:

* d = 3: the tokens on S² (3-D scatter on a faint wireframe sphere);
* d = 2: the tokens on the circle S¹;
* d ≥ 4: the Gram matrix ⟨x_i, x_j⟩ (tokens ordered by their initial vertex ±e_k).

Tokens are coloured by the group they start in (their nearest vertex ±e_k at the first
frame), so one sees which tokens merge.  Frames are ``frames`` evenly spaced recorded times
from the first to the last common time; ``max_tokens`` evenly spaced tokens are drawn.  The
defaults (≤ 60 frames, ≤ 150 tokens, 96 dpi, two 3.2-inch panels) give a GIF of well under
3 MB, small enough to attach to a message.

Example::

    traj_a = tp.solve(tp.Model(tp.OrnsteinUhlenbeck(heads), direction="descent"), x0, tp.Euler(), t1=6.0, dt=0.01,
                      paths=2)
    traj_b = tp.solve(tp.Model(tp.Oscillating(heads), direction="descent"), x0, tp.Euler(), t1=6.0, dt=0.01)
    from transformer_pde.application.animation import animate_tokens
    animate_tokens([traj_a, traj_b], ["OU (path 0)", "oscillating"], "flows.gif")
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .plotting import as_numpy, draw_circle, draw_gram, draw_sphere, figure, vertex_order

__all__ = ["animate_tokens", "token_groups"]

logger = logging.getLogger(__name__)

_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f"]


def token_groups(x0) -> np.ndarray:
    """Group index of every token: its nearest cross-polytope vertex ±e_k, as 2k (−) or 2k + 1 (+).

    x0: (n, d).  Returns an integer array (n,) with values in [0, 2d)."""
    x0 = as_numpy(x0)
    k = np.abs(x0).argmax(-1)
    s = x0[np.arange(len(x0)), k] > 0
    return 2 * k + s.astype(int)


def _unpack(item, index: int) -> Tuple[np.ndarray, np.ndarray]:
    """A Trajectory (``.times``, ``.x``) or a pair (times, x) -> times (T,), tokens (T, n, d)."""
    if hasattr(item, "times") and hasattr(item, "x"):
        times, x = item.times, item.x
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        times, x = item
    else:
        raise TypeError(f"trajectories: each entry must be a Trajectory or a pair (times, x), got "
                        f"{type(item).__name__}")
    t, x = as_numpy(times).reshape(-1), as_numpy(x)
    if x.ndim < 3 or x.shape[0] != len(t):
        raise ValueError(f"trajectories: tokens must have shape (T, [batch...,] n, d) with T = len(times) = {len(t)}, "
                         f"got {tuple(x.shape)}")
    x = x.reshape(x.shape[0], -1, *x.shape[-2:])
    if not 0 <= index < x.shape[1]:
        raise ValueError(f"path_index = {index} is out of range: the trajectory has {x.shape[1]} paths/batch entries")
    return t, x[:, index]


def _check_arguments(path: Path, trajectories, titles, overwrite: bool, panel_size, **counts) -> List[str]:
    """Refuse bad arguments before any work (``counts``: name=(value, minimum)); returns the titles."""
    from matplotlib import animation

    suffix = path.suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise ValueError(f"path = {str(path)!r}: the animation format follows the suffix, use .gif or .mp4")
    for name, (v, lo) in counts.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not panel_size > 0:
        raise ValueError(f"panel_size must be > 0 inches, got {panel_size!r}")
    if len(trajectories) == 0:
        raise ValueError("trajectories is empty: give at least one Trajectory or (times, x) pair")
    if titles is None:
        titles = [str(i + 1) for i in range(len(trajectories))]
    if len(titles) != len(trajectories):
        raise ValueError(f"titles: got {len(titles)} titles for {len(trajectories)} trajectories")
    if path.exists() and not overwrite:
        raise ValueError(f"path = {str(path)!r} exists; pass overwrite=True to replace it or choose another name")
    if suffix == ".mp4" and not animation.writers.is_available("ffmpeg"):
        raise ValueError(f"path = {str(path)!r}: MP4 needs ffmpeg on the PATH (not found); write a .gif instead")
    return list(titles)


def _panel_tokens(x: np.ndarray, first: int, max_tokens: int) -> Tuple[np.ndarray, List[str]]:
    """At most ``max_tokens`` evenly spaced tokens of x (T, n, d), ordered by their vertex at record ``first``
    for d ≥ 4 (Gram matrices), and their colours (the group they start in)."""
    n = x.shape[1]
    xs = x[:, np.unique(np.linspace(0, n - 1, min(n, max_tokens)).round().astype(int))]
    cols = [_PALETTE[g % len(_PALETTE)] for g in token_groups(xs[first])]
    return (xs[:, vertex_order(xs[first])] if x.shape[-1] >= 4 else xs), cols


def _scatter3d(ax, pts, cols):
    return ax.scatter(pts[:, 0], pts[:, 1], pts[:, 2], c=cols, s=9, depthshade=True, linewidths=0)


def _draw_panel(fig, k: int, j: int, pts, cols, *, elev: float, azim: float):
    """Panel j of k showing the tokens pts (m, d): on S², on S¹ or their Gram matrix; returns (axes, artist)."""
    d = pts.shape[-1]
    if d == 3:
        ax = fig.add_subplot(1, k, j + 1, projection="3d")
        draw_sphere(ax, elev=elev, azim=azim, zoom=1.3)
        return ax, _scatter3d(ax, pts, cols)
    ax = fig.add_subplot(1, k, j + 1)
    if d == 2:
        draw_circle(ax, 1.2)
        return ax, ax.scatter(pts[:, 0], pts[:, 1], c=cols, s=10, zorder=5, linewidths=0)
    return ax, draw_gram(ax, pts)


def _move(ax, art, pts, cols):
    """The panel's artist moved to the tokens pts (m, d); a 3-D scatter (no public offset setter) is redrawn."""
    if pts.shape[-1] == 3:
        art.remove()
        return _scatter3d(ax, pts, cols)
    if pts.shape[-1] == 2:
        art.set_offsets(pts[:, :2])
    else:
        art.set_data(pts @ pts.T)
    return art


def animate_tokens(trajectories: Sequence, titles: Optional[Sequence[str]], path: Union[str, os.PathLike], *,
                   frames: int = 60, fps: int = 10, max_tokens: int = 150, path_index: int = 0, dpi: int = 96,
                   panel_size: float = 3.2, suptitle: str = "", elev: float = 18, azim: float = -55,
                   overwrite: bool = False) -> Path:
    """Write an animation of the token flows, one panel per trajectory, all at the same times.

    Frame k shows every trajectory at the recorded time nearest to
    t_k = t_0 + k (t_end − t_0)/(frames − 1), with t_end the last time all trajectories
    recorded; repeated times (fewer records than frames) are dropped.

    Parameters
    ----------
    trajectories : Sequence
        Trajectory objects (``.times (T,)``, ``.x (T, [batch...,] n, d)``) or pairs
        (times, x); all with the same d.
    titles : Optional[Sequence[str]]
        one title per panel (None: "1", "2", …).
    path : Union[str, os.PathLike]
        output file, ``.gif`` (pillow) or ``.mp4`` (needs ffmpeg on the PATH).
    frames : int
        number of frames (≥ 2).  fps: frames per second.
    max_tokens : int
        draw at most this many tokens per panel (evenly spaced indices).
    path_index : int
        which path / batch entry of a batched trajectory to draw.
    dpi, panel_size
        resolution and panel width in inches (file size grows like their squares).
    suptitle : str
        a line above the panels (the current time is shown below them).
    elev, azim
        view of the 3-D panels.
    overwrite : bool
        replace an existing file (otherwise refused).

    The file is written to a temporary name and moved into place, so a failure never leaves
    a half-written animation.

    Returns
    -------
    Path
        the Path written.

    Raises
    ------
    ValueError
        bad arguments (named), tokens of different dimensions, an existing file
        without ``overwrite=True``, or ``.mp4`` without ffmpeg.
    TypeError
        an entry of ``trajectories`` that is neither a Trajectory nor a pair.
    """
    from matplotlib import animation

    path = Path(path)
    titles = _check_arguments(path, trajectories, titles, overwrite, panel_size, frames=(frames, 2), fps=(fps, 1),
                              max_tokens=(max_tokens, 1), dpi=(dpi, 10))
    data = [_unpack(item, path_index) for item in trajectories]
    dims = {x.shape[-1] for _, x in data}
    if len(dims) != 1:
        raise ValueError(f"trajectories: all tokens must live in the same dimension, got d = {sorted(dims)}")
    targets = np.linspace(max(t[0] for t, _ in data), min(t[-1] for t, _ in data), frames)
    idx = [[int(np.argmin(np.abs(t - s))) for s in targets] for t, _ in data]  # record shown per trajectory, frame
    keep = [0] + [k for k in range(1, frames) if any(ix[k] != ix[k - 1] for ix in idx)]  # repeats dropped
    idx = [[ix[k] for k in keep] for ix in idx]
    shown = data[0][0][idx[0]]
    panels = [(*_panel_tokens(x, ix[0], max_tokens), ix) for (_, x), ix in zip(data, idx)]
    k = len(panels)
    fig = figure((panel_size * k, panel_size + 0.5))
    axes, artists = [], []
    for j, ((xs, cols, ix), title) in enumerate(zip(panels, titles)):
        ax, art = _draw_panel(fig, k, j, xs[ix[0]], cols, elev=elev, azim=azim)
        ax.set_title(title, fontsize=9)
        axes.append(ax)
        artists.append(art)
    clock = fig.text(0.5, 0.02, "", ha="center", fontsize=9)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.04, top=0.86 if suptitle else 0.92, wspace=0.0)

    def draw(f):
        for j, ((xs, cols, ix), ax) in enumerate(zip(panels, axes)):
            artists[j] = _move(ax, artists[j], xs[ix[f]], cols)
        clock.set_text(f"t = {shown[f]:.2f}")
        return artists + [clock]

    anim = animation.FuncAnimation(fig, draw, frames=len(shown), blit=False)
    suffix = path.suffix.lower()
    writer = animation.PillowWriter(fps=fps) if suffix == ".gif" else animation.FFMpegWriter(fps=fps)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{suffix}")
    try:
        anim.save(str(tmp), writer=writer, dpi=dpi)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    logger.info("animation %s: %d frames, %d panels, %.2f MB", path, len(shown), k, path.stat().st_size / 2 ** 20)
    return path
