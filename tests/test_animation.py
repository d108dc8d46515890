"""transformer_pde.application.animation.animate_tokens: GIF files of token flows.

What is checked, and against what:
* the file is a GIF that PIL reads back with exactly the requested number of frames (or the
  number of distinct recorded times when there are fewer), for tokens on S¹, S² and S⁴
  (Gram matrices), from (times, x) pairs and from a Trajectory with Monte-Carlo paths;
* frame k shows the recorded time nearest to the k-th of ``frames`` evenly spaced times
  (read back from the frames' pixels: consecutive frames differ, because the clock text and
  the tokens change);
* a GIF with the documented defaults (two S² panels, 200 tokens, 60 frames) stays under 3 MB
  (slow);
* bad arguments are refused before any work, naming the argument; an existing file is never
  replaced without overwrite=True, and no temporary file is left behind.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import transformer_pde as tp
from transformer_pde.application.animation import animate_tokens, token_groups

PIL = pytest.importorskip("PIL.Image")


def _rotating(T: int, n: int, d: int, *, t1: float = 1.0, omega: float = 2.0, seed: int = 0):
    """Tokens rotating rigidly in the (e1, e2) plane: x(t) = R(ωt) x(0), recorded at T times."""
    g = torch.Generator().manual_seed(seed)
    x0 = tp.sphere.sample_uniform(n, d, generator=g, dtype=torch.float64)
    t = torch.linspace(0, t1, T, dtype=torch.float64)
    c, s = torch.cos(omega * t), torch.sin(omega * t)
    x = x0.expand(T, n, d).clone()
    x[..., 0] = c[:, None] * x0[:, 0] - s[:, None] * x0[:, 1]
    x[..., 1] = s[:, None] * x0[:, 0] + c[:, None] * x0[:, 1]
    return t, x


def _frames(path):
    with PIL.open(path) as im:
        assert im.format == "GIF"
        out = []
        for k in range(im.n_frames):
            im.seek(k)
            out.append(np.asarray(im.convert("RGB"), dtype=np.int16))
        return out


@pytest.mark.parametrize("d", [2, 3, 5])
def test_gif_has_the_requested_frames(tmp_path, d):
    a = _rotating(21, 12, d, seed=1)
    b = _rotating(21, 12, d, seed=2, omega=-1.0)
    path = animate_tokens([a, b], ["left", "right"], tmp_path / "flow.gif", frames=6, dpi=40, panel_size=2.0)
    assert path == tmp_path / "flow.gif" and path.is_file()
    frames = _frames(path)
    assert len(frames) == 6
    # every frame differs from the previous one (new time on the clock, moved tokens)
    assert all(np.abs(f - g).sum() > 0 for f, g in zip(frames, frames[1:]))
    assert path.stat().st_size < 3 * 2 ** 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flow.gif"]  # no temporary file left


def test_fewer_records_than_frames_and_trajectory_input(tmp_path):
    x0 = tp.sphere.sample_uniform(8, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    heads = tp.Heads.random(2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    traj = tp.simulate(x0, tp.OrnsteinUhlenbeck(heads), t1=0.08, dt=0.02, paths=2, seed=0, progress=False)
    assert traj.x.shape[:2] == (5, 2)  # 5 recorded times, 2 paths
    path = animate_tokens([traj], None, tmp_path / "one.gif", frames=50, path_index=1, dpi=40, panel_size=2.0)
    assert len(_frames(path)) == 5  # one frame per distinct recorded time


def test_frame_times_are_evenly_spaced(tmp_path):
    """With a static scene except for one moving token, frame k must show record round(k (T-1)/(F-1))."""
    T, F = 31, 4
    t = torch.linspace(0, 3, T, dtype=torch.float64)
    ang = torch.linspace(0, math.pi, T, dtype=torch.float64)
    x = torch.zeros(T, 2, 2, dtype=torch.float64)
    x[:, 0, 0] = 1.0  # a fixed token at e1
    x[:, 1, 0], x[:, 1, 1] = torch.cos(ang), torch.sin(ang)  # a token moving around the circle
    animate_tokens([(t, x)], ["one"], tmp_path / "a.gif", frames=F, dpi=40, panel_size=2.0)
    # reference: the same animation drawn from exactly the records we expect, one frame each
    want = [round(k * (T - 1) / (F - 1)) for k in range(F)]
    animate_tokens([(t[want], x[want])], ["one"], tmp_path / "b.gif", frames=F, dpi=40, panel_size=2.0)
    fa, fb = _frames(tmp_path / "a.gif"), _frames(tmp_path / "b.gif")
    assert len(fa) == len(fb) == F
    for u, v in zip(fa, fb):
        np.testing.assert_array_equal(u, v)


def test_token_groups_are_the_nearest_vertices():
    x0 = torch.tensor([[0.9, 0.1, 0.0], [-0.2, -0.95, 0.1], [0.0, 0.3, 0.96], [-0.99, 0.0, 0.1]])
    np.testing.assert_array_equal(token_groups(x0), [1, 2, 5, 0])


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    a = _rotating(5, 4, 3)
    with pytest.raises(ValueError, match=r"\.gif or \.mp4"):
        animate_tokens([a], ["a"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="frames"):
        animate_tokens([a], ["a"], tmp_path / "x.gif", frames=1)
    with pytest.raises(ValueError, match="titles"):
        animate_tokens([a, a], ["a"], tmp_path / "x.gif")
    with pytest.raises(ValueError, match="same dimension"):
        animate_tokens([a, _rotating(5, 4, 2)], ["a", "b"], tmp_path / "x.gif")
    with pytest.raises(ValueError, match="shape"):
        animate_tokens([(a[0][:3], a[1])], ["a"], tmp_path / "x.gif")
    with pytest.raises(ValueError, match="path_index"):
        animate_tokens([a], ["a"], tmp_path / "x.gif", path_index=3)
    with pytest.raises(TypeError, match="Trajectory or a pair"):
        animate_tokens([a[1]], ["a"], tmp_path / "x.gif")
    existing = tmp_path / "keep.gif"
    existing.write_bytes(b"not ours")
    with pytest.raises(ValueError, match="overwrite=True"):
        animate_tokens([a], ["a"], existing)
    assert existing.read_bytes() == b"not ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.gif"]


@pytest.mark.slow
def test_default_size_gif_is_small_enough_to_attach(tmp_path):
    a = _rotating(241, 200, 3, t1=6.0, seed=1)
    b = _rotating(241, 200, 3, t1=6.0, seed=2, omega=-0.5)
    path = animate_tokens([a, b], ["OU", "oscillating"], tmp_path / "tokens.gif", suptitle="S², H = 16")
    assert len(_frames(path)) == 60
    assert path.stat().st_size < 3 * 2 ** 20
