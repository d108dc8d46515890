"""Claims a program can read: one entry per number a study quotes (docs/theorems.md, docs/noisy_tokens.md).

Each claim is a dict ``{"name", "value", "error", "seeds", "reference", "holds"}``: the value, its standard
error over ``seeds`` independent seeds (or a bootstrap half-width; 0 only for a deterministic quantity), the
theory value or bound it is compared with (None when there is none) and the study's own verdict, which a claim
without a reference never carries (``holds`` None: a number with nothing to compare it with holds or fails
nothing).  Studies
write the list under ``metrics["claims"]``; ``scripts/render_claims.py`` turns it into a markdown table.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["ensemble", "claim", "bootstrap_interval", "render_table"]


def ensemble(values: Sequence[float]):
    """(mean, standard error, count) of independent per-seed values (NaN error for one value)."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0:
        raise ValueError("an ensemble needs at least one value")
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se, int(v.size)


def bootstrap_interval(values, statistic, *, resamples: int = 2000, seed: int = 0, level: float = 0.95):
    """(statistic of the data, half-width of the percentile bootstrap interval) over the first axis of ``values``."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.shape[0], size=(resamples, v.shape[0]))
    stats = np.array([statistic(v[i]) for i in idx])
    stats = stats[np.isfinite(stats)]
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2]) if stats.size else (np.nan, np.nan)
    return float(statistic(v)), float((hi - lo) / 2)


def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def claim(name: str, value, error, seeds: int, reference=None, holds: Optional[bool] = None, **extra) -> Dict:
    """One claim (module docstring); non-finite numbers become None (JSON null), and a claim whose value or
    reference is undefined or absent has no verdict (``holds`` None, whatever the study judged)."""
    ref = _num(reference)
    verdict = None if holds is None or _num(value) is None or ref is None else bool(holds)
    out = {"name": str(name), "value": _num(value), "error": _num(error), "seeds": int(seeds),
           "reference": ref, "holds": verdict}
    out.update(extra)
    return out


def render_table(claims: List[Dict], digits: int = 4) -> str:
    """A markdown table of claims: name | value ± error | seeds | reference | holds."""
    def f(x):
        if x is None:
            return "—"
        return f"{x:.{digits}g}"

    rows = ["| claim | value ± error | seeds | reference | holds |", "| --- | --- | --- | --- | --- |"]
    for c in claims:
        verdict = {True: "yes", False: "**no**", None: "—"}[c.get("holds")]
        name = c["name"].replace("|", "\\|")  # a literal bar must not split the markdown row
        rows.append(f"| {name} | {f(c['value'])} ± {f(c['error'])} | {c['seeds']} | {f(c['reference'])} | "
                    f"{verdict} |")
    return "\n".join(rows)
