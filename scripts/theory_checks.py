#!/usr/bin/env python
"""Check Pendharkar's multi-head theory (2026) on the full particle system and print a summary table.

Runs the ``theory_*`` experiment configs (``experiments/theory_*.toml``) through the same code path
as ``transformer-pde run``, then prints, for every result, the closed form's agreement with the
particles (or finite differences) and the wall time of the run.

    python scripts/theory_checks.py                    # all six configs (a few minutes on 2 cores)
    python scripts/theory_checks.py --quick            # small versions (about a minute)
    python scripts/theory_checks.py radial rates       # a selection
    python scripts/theory_checks.py --out runs/theory  # where the run directories go (default: runs)

Existing run directories of the same name are refused (as by the CLI); use --out or --suffix.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("energy", "radial", "rates", "relu_softmax", "entropy", "orthogonality")

#: small versions of every config (the ones the test suite runs)
QUICK = {
    "energy": ["n=8", "t1=0.2", "dt=0.02", "flat_t1=0.02", "flat_dt=0.002", "epsilons=[0.05, 0.1]"],
    "radial": ["heads=[1, 2, 3]", "n=[3, 10, 50]", "gammas=[0.05]", "hetero=[0.5, 1.0]", "hetero_n=10"],
    "rates": ["n=4", "t1=4.0", "dt=0.02", "phi_n=[2, 8]", "total=[2.0, 16.0]", "targets=[0.05]"],
    "relu_softmax": ["n=[4, 8, 16]", "d=[16, 256]", "random_n=[8]", "random_d=[16]", "ensemble=2"],
    "entropy": ["n=8", "configs=2", "equi_n=6", "t1=4.0", "dt=0.02"],
    "orthogonality": ["angles=[70.0, 80.0, 90.0]", "n=16", "flat_t1=0.02", "flat_dt=0.001"],
}

#: (metric, what it measures) printed per kind
HEADLINES = {
    "energy": [
        ("sphere_identity_rel_residual", "sphere: |E(t)−E(0) − ∫(1/n)Σ‖ẋ‖²| / gain (Simpson)"),
        ("flat_identity_rel_residual", "flat: same identity"),
        ("defect_asym_max_over_bound", "A ≠ Aᵀ: |defect| / bound (≤ 1)"),
        ("defect_value_max_over_bound", "V ≠ A: |defect| / bound (≤ 1)"),
        ("orth_rate_head1_sphere", "orthogonal heads: dE_1/dt on the sphere (< 0)"),
        ("orth_rate_head1_flat", "orthogonal heads: dE_1/dt in flat space (> 0)"),
    ],
    "radial": [
        ("max_rel_error_token_gamma0", "β*(H, n) formula vs particle margin, max rel. error"),
        ("max_rel_error_pairwise_gamma0", "pairwise margin vs cos² = 1/H formula"),
        ("max_rel_error_token_gamma_extended", "γ > 0 extension vs particle margin"),
        ("largest_relative_shift_from_gamma0_formula", "γ > 0: shift of β* from the γ = 0 formula"),
    ],
    "rates": [
        ("softmax_max_abs_error_particles_vs_ode", "softmax: particles vs γ-ODE, max |Δγ|"),
        ("unnormalized_max_abs_error_particles_vs_ode", "unnormalized: particles vs γ-ODE"),
        ("relu_max_abs_error_particles_vs_ode", "relu: particles vs γ-ODE"),
        ("early_rate_rel_error", "early rate Σφ(λ_h) vs particle slope"),
        ("softmax_late_slope_rel_error", "late slope vs −2Λ (softmax)"),
        ("lambda_star_grid_rel_error", "Lambert-W λ* vs grid argmax of φ"),
    ],
    "relu_softmax": [
        ("softmax_linearized_exponent_in_n_d16", "softmax linearised time ∝ n^…"),
        ("relu_linearized_exponent_in_n_d16", "ReLU linearised time ∝ n^…"),
        ("softmax_ode_exponent_in_n_d16", "softmax nonlinear time ∝ n^…"),
        ("relu_ode_exponent_in_n_d16", "ReLU nonlinear time ∝ n^… (d = 16)"),
        ("softmax_particles_vs_ode_max_rel_error", "softmax particles vs γ-ODE hitting time"),
        ("relu_particles_vs_ode_max_rel_error", "ReLU particles vs γ-ODE hitting time"),
    ],
    "entropy": [
        ("identity_max_rel_error_vs_fd", "dH/dt = −Cov(s, ṡ) vs finite differences"),
        ("equiangular_min_entropy_increment", "equiangular: min increment of H (≥ 0)"),
        ("equiangular_final_gap_to_log_n", "equiangular: ln n − H(t1)"),
        ("random_min_token_entropy_increment", "random tokens: min per-token increment"),
    ],
    "orthogonality": [
        ("max_delta_error_vs_alpha2_cos", "δ = ‖A_h A_k‖ vs α² cos θ"),
        ("max_coupling_over_bound", "|⟨f_h, f_k⟩| / (δ m_h m_k) (≤ 1)"),
        ("min_flat_head_rate", "min_h dE_h/dt, flat"),
        ("min_sphere_head_rate", "min_h dE_h/dt, sphere"),
    ],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kinds", nargs="*", metavar="KIND", help=f"which results, among {', '.join(KINDS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="small versions of the configs")
    p.add_argument("--out", default="runs", help="parent folder of the run directories")
    p.add_argument("--suffix", default="", help="appended to the run names")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    args = p.parse_args(argv)
    from transformer_pde.application.runs import execute

    kinds = args.kinds or list(KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        p.error(f"unknown result {bad[0]!r}; choose among {', '.join(KINDS)}")
    total = time.perf_counter()
    for kind in kinds:
        cfg = ROOT / "experiments" / f"theory_{kind}.toml"
        name = f"theory_{kind}{'_quick' if args.quick else ''}{args.suffix}"
        t0 = time.perf_counter()
        try:
            path = execute(cfg, overrides=QUICK[kind] if args.quick else (), out_dir=args.out, name=name,
                           progress=args.progress)
        except (ValueError, TypeError) as e:
            print(f"theory_checks: {kind}: {e}", file=sys.stderr)
            return 2
        metrics = json.loads((path / "metrics.json").read_text())
        print(f"\n== {kind}  ({time.perf_counter() - t0:.1f} s, {path})")
        for key, what in HEADLINES[kind]:
            val = metrics.get(key, float("nan"))
            txt = f"{val:.3e}" if isinstance(val, float) else str(val)
            print(f"   {txt:>12}  {what}")
    print(f"\ntotal wall time {time.perf_counter() - total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
