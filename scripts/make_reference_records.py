"""Regenerate tests/data/reference_records.bin: seed-fixed runs of the solvers, saved with torch.save.

tests/test_reference_records.py reruns the same cases and compares every tensor with torch.equal:
refactorings that keep the arithmetic must keep the numbers bit for bit.

The stored file was produced by commit 7d805a9 (before the issue-16 redesign), on CPU with
OMP_NUM_THREADS=1.  Regenerate only when a change of the arithmetic is intended:

    OMP_NUM_THREADS=1 python scripts/make_reference_records.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import transformer_pde as tp

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_records.bin"


def _heads(H, dtype, seed=1):
    return tp.Heads.random(H, 3, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _x0(n, dtype, seed=2):
    return tp.sphere.sample_uniform(n, 3, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _traj_record(traj):
    rec = {"times": traj.times, "x": traj.x}
    for k in ("energy", "slope", "dissipation"):
        if getattr(traj, k) is not None:
            rec[k] = getattr(traj, k)
    for k, v in traj.ledger.items():
        rec["ledger." + k] = v
    for k, v in traj.observables.items():
        rec["obs." + k] = v
    if traj.path is not None:
        rec["path.scores"] = traj.path.scores
    return rec


def cases():
    """name -> zero-argument callable returning a dict of tensors."""
    f64, f32 = torch.float64, torch.float32
    c = {}
    for m in ("euler", "heun", "rk4"):
        c[f"constant_{m}"] = lambda m=m: _traj_record(
            tp.simulate(_x0(12, f64), _heads(2, f64), t1=0.4, dt=0.05, method=m))
    c["adaptive"] = lambda: _traj_record(
        tp.simulate(_x0(12, f64), _heads(2, f64), t1=0.4, dt=0.1, method="adaptive"))
    c["ou_paths"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), tp.OrnsteinUhlenbeck(_heads(2, f64)), t1=0.3, dt=0.05, paths=3, seed=7,
        method="heun", return_path=True))
    c["ou_realised"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), tp.OrnsteinUhlenbeck(_heads(2, f64)), t1=0.3, dt=0.05, paths=2, seed=3,
        quadratic_variation="realised"))
    c["ou_float32"] = lambda: _traj_record(tp.simulate(
        _x0(10, f32), tp.OrnsteinUhlenbeck(_heads(2, f32)), t1=0.3, dt=0.05, paths=2, seed=5,
        method="rk4"))
    c["oscillating"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), tp.Oscillating(_heads(2, f64)), t1=0.4, dt=0.05, method="rk4"))
    c["layerwise_jumps"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), tp.Layerwise([_heads(2, f64, 1), _heads(2, f64, 4)], layer_time=0.2), t1=0.4, dt=0.05))
    for norm in ("effective", "unnormalized", "relu"):
        c[f"norm_{norm}"] = lambda norm=norm: _traj_record(tp.simulate(
            _x0(10, f64), _heads(2, f64),
            t1=0.3, dt=0.05, normalization=norm, method="heun"))
    c["causal_ascent"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), _heads(2, f64), t1=0.3, dt=0.05, causal=True, direction="ascent", record_every=2))
    c["observables_weights"] = lambda: _traj_record(tp.simulate(
        _x0(10, f64), _heads(2, f64), t1=0.3, dt=0.05, weights=torch.linspace(1, 2, 10, dtype=f64) / 15.0,
        observables={"m": lambda x, w: x.mean(-2)}, quadrature="trapezoid"))
    c["float32_constant"] = lambda: _traj_record(tp.simulate(_x0(12, f32), _heads(3, f32), t1=0.3, dt=0.05))

    def jko_case():
        t = tp.jko(_x0(8, f64), _heads(1, f64), tau=0.05, steps=3)
        return _traj_record(t)
    c["jko"] = jko_case

    def flat_case():
        f = tp.diagnostics.flat_flow(_x0(8, f64), tp.Heads.scalar([0.5, 0.3], 3).to(f64), t1=0.1, dt=0.02)
        return {k: v for k, v in vars(f).items() if isinstance(v, torch.Tensor)}
    c["flat_flow"] = flat_case

    def sharded_case():
        t = tp.simulate_sharded(_x0(10, f64), _heads(2, f64), t1=0.2, dt=0.05)
        return _traj_record(t)
    c["sharded"] = sharded_case

    def hitting_case():
        r = tp.diagnostics.clustering_hitting_time(_x0(8, f64), _heads(1, f64), target=0.5, t_max=1.0, dt=0.05)
        return {"r": torch.as_tensor(r if not isinstance(r, tuple) else r[0], dtype=f64)}
    c["hitting_time"] = hitting_case
    return c


def main():
    torch.set_num_threads(1)
    out = {}
    for name, fn in cases().items():
        out[name] = {k: v.detach().clone() for k, v in fn().items()}
        print(name, ", ".join(f"{k}{tuple(v.shape)}" for k, v in out[name].items()), file=sys.stderr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
