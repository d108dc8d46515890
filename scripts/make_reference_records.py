"""Regenerate tests/data/reference_records.bin: seed-fixed runs of the solvers, saved with torch.save.

tests/test_reference_records.py reruns the same cases and compares every tensor at a tolerance
derived from the dtype and the number of steps of the case (:data:`STEPS`; the derivation is in
that test's docstring); with ``TP_BIT_IDENTICAL=1`` it compares bit for bit (same machine, one
thread).

The stored file was produced by commit 7d805a9, on CPU with
OMP_NUM_THREADS=1; the two long cases ``long_euler_f64`` / ``long_euler_f32`` (256 steps, for the
test that a one-ulp-per-step change is caught) were added with ``--add-missing``,
which computes only the cases the file lacks and leaves the stored ones untouched.  Regenerate
everything only when a change of the arithmetic is intended:

    OMP_NUM_THREADS=1 python scripts/make_reference_records.py              # every case
    OMP_NUM_THREADS=1 python scripts/make_reference_records.py --add-missing  # new cases only
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


def _simulate(*args, **kwargs):
    """tp.simulate with the energy ledger (the records hold its terms), descent unless told (as recorded)."""
    kwargs.setdefault("direction", "descent")
    return tp.simulate(*args, ledger=True, **kwargs)


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
            _simulate(_x0(12, f64), _heads(2, f64), t1=0.4, dt=0.05, method=m))
    c["adaptive"] = lambda: _traj_record(
        _simulate(_x0(12, f64), _heads(2, f64), t1=0.4, dt=0.1, method="adaptive"))
    c["ou_paths"] = lambda: _traj_record(_simulate(
        _x0(10, f64), tp.OrnsteinUhlenbeck(_heads(2, f64)), t1=0.3, dt=0.05, paths=3, seed=7,
        method="heun", return_path=True))
    c["ou_realised"] = lambda: _traj_record(_simulate(
        _x0(10, f64), tp.OrnsteinUhlenbeck(_heads(2, f64)), t1=0.3, dt=0.05, paths=2, seed=3,
        quadratic_variation="realised"))
    c["ou_float32"] = lambda: _traj_record(_simulate(
        _x0(10, f32), tp.OrnsteinUhlenbeck(_heads(2, f32)), t1=0.3, dt=0.05, paths=2, seed=5,
        method="rk4"))
    c["oscillating"] = lambda: _traj_record(_simulate(
        _x0(10, f64), tp.Oscillating(_heads(2, f64)), t1=0.4, dt=0.05, method="rk4"))
    c["layerwise_jumps"] = lambda: _traj_record(_simulate(
        _x0(10, f64), tp.Layerwise([_heads(2, f64, 1), _heads(2, f64, 4)], layer_time=0.2), t1=0.4, dt=0.05))
    for norm in ("effective", "unnormalized", "relu"):
        c[f"norm_{norm}"] = lambda norm=norm: _traj_record(_simulate(
            _x0(10, f64), _heads(2, f64),
            t1=0.3, dt=0.05, normalization=norm, method="heun"))
    c["causal_ascent"] = lambda: _traj_record(_simulate(
        _x0(10, f64), _heads(2, f64), t1=0.3, dt=0.05, causal=True, direction="ascent", record_every=2))
    c["observables_weights"] = lambda: _traj_record(_simulate(
        _x0(10, f64), _heads(2, f64), t1=0.3, dt=0.05, weights=torch.linspace(1, 2, 10, dtype=f64) / 15.0,
        observables={"m": lambda x, w: x.mean(-2)}, quadrature="trapezoid"))
    c["float32_constant"] = lambda: _traj_record(_simulate(_x0(12, f32), _heads(3, f32), t1=0.3, dt=0.05))

    def jko_case():
        t = tp.jko(_x0(8, f64), _heads(1, f64), tau=0.05, steps=3, direction="descent")
        return _traj_record(t)
    c["jko"] = jko_case

    def flat_case():
        f = tp.diagnostics.flat_flow(_x0(8, f64), tp.Heads.scalar([0.5, 0.3], 3).to(f64), t1=0.1, dt=0.02)
        return {k: v for k, v in vars(f).items() if isinstance(v, torch.Tensor)}
    c["flat_flow"] = flat_case

    def sharded_case():
        t = tp.simulate_sharded(_x0(10, f64), _heads(2, f64), t1=0.2, dt=0.05, direction="descent")
        return _traj_record(t)
    c["sharded"] = sharded_case

    def hitting_case():
        r = tp.diagnostics.clustering_hitting_time(_x0(8, f64), _heads(1, f64), target=0.5, t_max=1.0, dt=0.05)
        return {"r": torch.as_tensor(r if not isinstance(r, tuple) else r[0], dtype=f64)}
    c["hitting_time"] = hitting_case

    def long_case(dtype):
        return lambda: _traj_record(_simulate(_x0(12, dtype), _heads(2, dtype), t1=1.28, dt=0.005,
                                                record_every=16))
    c["long_euler_f64"], c["long_euler_f32"] = long_case(f64), long_case(f32)
    return c


#: the number of steps of each case (the run length the test's tolerance grows with): t1/dt of the
#: fixed-step cases, the dt grid of "adaptive" (dopri5 takes at least as many steps), the JKO steps,
#: t_max/dt of the hitting time
STEPS = {"constant_euler": 8, "constant_heun": 8, "constant_rk4": 8, "adaptive": 4, "ou_paths": 6, "ou_realised": 6,
         "ou_float32": 6, "oscillating": 8, "layerwise_jumps": 8, "norm_effective": 6, "norm_unnormalized": 6,
         "norm_relu": 6, "causal_ascent": 6, "observables_weights": 6, "float32_constant": 6, "jko": 3,
         "flat_flow": 5, "sharded": 4, "hitting_time": 20, "long_euler_f64": 256, "long_euler_f32": 256}


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--add-missing", action="store_true",
                    help="compute only the cases the stored file lacks; keep the stored ones as they are")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = torch.load(OUT, weights_only=True) if args.add_missing and OUT.exists() else {}
    for name, fn in cases().items():
        if name in out:
            continue
        out[name] = {k: v.detach().clone() for k, v in fn().items()}
        print(name, ", ".join(f"{k}{tuple(v.shape)}" for k, v in out[name].items()), file=sys.stderr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
