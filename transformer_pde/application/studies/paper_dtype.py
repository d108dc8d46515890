"""Every number the paper study reports, float32 tokens against float64: the difference and the interval.

The paper study (:mod:`transformer_pde.application.studies.paper`) runs its tokens in float32 and steps the
weights in float64 from the float64 run's draws, so a float32 and a float64 run of one configuration differ
by rounding carried along the trajectories.  :func:`dtype_differences` lists every number their
``metrics.json`` report with that difference and the width of the interval the run gives the number
(docs/performance.md; ``scripts/benchmark_paper_dtype.py`` prints the table,
``tests/test_paper.py::test_float32_tokens_change_no_reported_number_beyond_its_interval`` checks it).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Dict, List, Optional

__all__ = ["dtype_differences"]


def _width(lo_hi) -> Optional[float]:
    return None if lo_hi is None or None in lo_hi else float(lo_hi[1] - lo_hi[0])


def dtype_differences(m64: Dict, m32: Dict, level: float = 0.95) -> List[Dict]:
    """Every number the study reports (two ``metrics.json`` of one configuration, tokens in float64 and in
    float32) with its float32 − float64 difference and the width of the interval the run gives it.

    The rows: per regime the fit's a, b (interval: the bootstrap CI over paths, else ±z·s.e. of the OLS fit)
    and the mean of the per-path fits (its Student-t interval); per regime and H the time-averaged 𝒢² (mean
    over paths, interval ±z·std/√P; each path's own value, and |𝒟|/𝒢², without one), the final 𝒟- and
    𝒢²-based residuals (mean over paths, ±z·std/√P; the largest |residual| over the run and the final dE
    without one).  An interval is None where the run has none (one path, one H).

    Parameters
    ----------
    m64, m32 : dict
        the ``metrics.json`` contents of the float64 and the float32 run.
    level : float
        the level of the intervals formed from a standard deviation over paths (z of the normal quantile).

    Returns
    -------
    list of dict
        ``{"name", "float64", "float32", "difference", "interval"}`` per reported number (the difference
        is |float32 − float64|; ``interval``: the width, or None).
    """
    z = NormalDist().inv_cdf(0.5 + level / 2)
    rows: List[Dict] = []

    def add(name, a, b, width=None):
        if a is None or b is None:
            return
        rows.append({"name": name, "float64": float(a), "float32": float(b), "difference": abs(float(b) - float(a)),
                     "interval": width if width is None or width > 0 else None})

    for regime, f in m64["fit"].items():
        g = m32["fit"][regime]
        width = _width(f.get("b_ci"))
        if width is None and f.get("b_se") is not None:
            width = 2 * z * f["b_se"]
        add(f"fit {regime}: b", f["b"], g["b"], width)
        add(f"fit {regime}: a", f["a"], g["a"])
        add(f"fit {regime}: mean of the per-path b", f.get("b_paths_mean"), g.get("b_paths_mean"),
            _width(f.get("b_ci_paths")))
    for regime, per_h in m64["time_average_slope"].items():
        for H, t in per_h.items():
            u = m32["time_average_slope"][regime][H]
            P = len(t["per_path"])
            add(f"{regime} H={H}: time-averaged 𝒢², mean over paths", t["mean"], u["mean"],
                2 * z * t["std"] / math.sqrt(P) if P > 1 else None)
            for i, (a, b) in enumerate(zip(t["per_path"], u["per_path"])):
                add(f"{regime} H={H}: time-averaged 𝒢², path {i}", a, b)
            add(f"{regime} H={H}: |𝒟|/𝒢²", t.get("abs_dissipation_over_slope"), u.get("abs_dissipation_over_slope"))
            r, s = m64["residuals"][regime][H], m32["residuals"][regime][H]
            for key, label in (("residual", "𝒟-based"), ("residual_slope", "𝒢²-based")):
                add(f"{regime} H={H}: final {label} residual, mean over paths", r[key]["final_mean"],
                    s[key]["final_mean"], 2 * z * r[key]["final_std"] / math.sqrt(P) if P > 1 else None)
                add(f"{regime} H={H}: largest |{label} residual|", r[key]["max_abs"], s[key]["max_abs"])
            add(f"{regime} H={H}: final dE, mean over paths", r["dE_final_mean"], s["dE_final_mean"])
    return rows
