"""transformer_pde.analysis.theory.continuation: stationary mean-field branches of the unnormalised noisy head
(docs/noisy_tokens.md).

Independent oracles: the closed-form T_c (Bessel functions, ``critical_temperature``), the Landau coefficient's
sign change (``first_order_beta``, a Bessel-ratio root) against the curvature of the computed branch, and the
time-dependent spectral Fokker–Planck solver (``fokker_planck_circle``) for stationarity and for the spinodal.
"""

import math

import numpy as np
import pytest

import transformer_pde as tp
from transformer_pde.analysis.theory import continuation as tc
from transformer_pde.analysis.theory import noise as tn
from transformer_pde.analysis.theory.circle import fokker_planck_circle, fokker_planck_stable_dt
from transformer_pde.application.studies.noisy_hysteresis import branch_coefficients


@pytest.mark.parametrize("beta, d", [(1.0, 2), (4.0, 2), (1.0, 3), (4.0, 3)])
def test_branch_leaves_the_uniform_state_at_the_closed_form_critical_temperature(beta, d):
    """T(m → 0) from Newton on the quadrature self-consistency equals κ_1(β)/β from Bessel functions to 1e-6
    (a Funk–Hecke coefficient or quadrature weight off by a factor moves it by that factor)."""
    br = tc.stationary_branch(beta, d, modes=24, m_min=1e-4, m_max=0.05, steps=3)
    Tc = tp.theory.critical_temperature(beta, d, lambdas=(1.0,), normalization="unnormalized")
    assert abs(br["T"][0] / Tc - 1) < 1e-6, (br["T"][0], Tc)
    assert float(br["residual"].max()) < 1e-10


@pytest.mark.parametrize("d", [2, 3])
def test_branch_curvature_changes_sign_at_the_landau_threshold(d):
    """The branch bends back (T(m) > T_c at small m: first order) exactly above first_order_beta(d): the root of
    the computed curvature (T(m)/T_c − 1)/m² in β matches the Bessel-ratio root to 1e-3.  This replaces a check
    of landau_coefficient against the same Bessel ratio (circular); a Landau coefficient with a wrong factor
    (e.g. d in place of d − 1) moves the threshold by more than 10 %."""
    from scipy.optimize import brentq

    def curvature(beta):
        br = tc.stationary_branch(beta, d, modes=24, m_min=0.02, m_max=0.03, steps=2)
        return float((br["T"][0] / br["Tc"] - 1) / 0.02 ** 2)

    b_star = tn.first_order_beta(d)
    root = brentq(curvature, 0.7 * b_star, 1.3 * b_star, xtol=1e-6)
    # the curvature at finite m carries an O(m²) correction: compare with the threshold to that accuracy
    assert abs(root / b_star - 1) < 1e-3, (root, b_star)
    assert (tn.landau_coefficient(0.9 * b_star, d) > 0) == (curvature(0.9 * b_star) < 0)
    assert (tn.landau_coefficient(1.1 * b_star, d) < 0) == (curvature(1.1 * b_star) > 0)


def test_branch_is_stationary_for_the_time_dependent_solver():
    """The β = 4 clustered state at T = 1.03 T_c (between T_c and the spinodal) stays put under the spectral
    Fokker–Planck equation: |m| drifts by < 1e-6 over t = 5 (a wrong kernel normalisation in either code moves
    it at a rate O(1))."""
    beta, d = 4.0, 2
    br = tc.stationary_branch(beta, d, modes=48, m_max=0.95, steps=80)
    r = 1.03
    m = tc.stable_branch_at(br, [r], beta=beta, d=d)[0]
    sc = tc.ZonalSelfConsistency(beta, 1.0, d, 48)
    j = int(np.argmin(np.abs(br["m"] - m)))
    b = sc.solve_at_T(r * float(br["Tc"]), br["b"][j])
    dt = fokker_planck_stable_dt(beta, 1.0, 128, 0.02)
    steps = math.ceil(5.0 / dt)
    out = fokker_planck_circle(branch_coefficients(b), [steps * dt], beta=beta, lam=1.0, T=r * float(br["Tc"]),
                               modes=128, dt=steps * dt / steps)
    m_t = 2 * math.pi * abs(out[steps * dt][1])
    assert abs(m_t - m) < 1e-6, (m_t, m)
    assert 0.5 < m < 0.9


@pytest.mark.slow
def test_spinodal_separates_surviving_and_dissolving_clusters():
    """Below the spinodal (1.04 T_c) the cluster of the stable branch survives a long Fokker–Planck run; above it
    (1.09 T_c) the same start dissolves to |m| < 0.05 by t = 150 (the time-dependent solver alone decides)."""
    beta, d = 4.0, 2
    s = tc.spinodal(beta, d, modes=48)
    assert 1.05 < s["ratio"] < 1.07
    br = tc.stationary_branch(beta, d, modes=48, m_max=0.95, steps=80)
    b0 = br["b"][int(np.argmin(np.abs(br["m"] - 0.7)))]
    dt = fokker_planck_stable_dt(beta, 1.0, 64, 0.02)
    t1 = round(150 / dt) * dt
    for r, alive in ((1.04, True), (1.09, False)):
        c = fokker_planck_circle(branch_coefficients(b0), [t1], beta=beta, lam=1.0, T=r * float(br["Tc"]), modes=64,
                                 dt=dt)[t1]
        m = 2 * math.pi * abs(c[1])
        assert (m > 0.4) if alive else (m < 0.05), (r, m)


def test_mean_field_loop_closed_cases():
    """β = 1 (continuous): no loop at all; β = 4: the stage-grid area converges to the continuous area as the
    stages refine, and the up sweep jumps to 0 exactly past the spinodal."""
    flat = tc.mean_field_loop(1.0, 2, [0.8, 0.95, 1.05, 1.2], modes=24, steps=60)
    assert flat["area_stages"] == 0.0 and flat["area_continuous"] == 0.0 and not flat["spinodal"]["first_order"]
    fine = np.linspace(0.9, 1.2, 301).tolist()
    loop = tc.mean_field_loop(4.0, 2, fine, modes=32, steps=120)
    assert abs(loop["area_stages"] / loop["area_continuous"] - 1) < 0.01, loop["area_stages"]
    rs = loop["spinodal"]["ratio"]
    up = np.array(loop["up"])
    assert (up[np.array(fine) > rs] == 0).all() and (up[np.array(fine) <= rs] > 0.5).all()


def test_refusals():
    with pytest.raises(ValueError, match="m_min < m_max"):
        tc.stationary_branch(1.0, 2, m_min=0.5, m_max=0.1)
    with pytest.raises(ValueError, match="beta"):
        tc.ZonalSelfConsistency(0.0, 1.0, 2, 8)
    with pytest.raises(ValueError, match="d must be"):
        tc.ZonalSelfConsistency(1.0, 1.0, 1, 8)
