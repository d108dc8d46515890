"""Which code a published table came from: a fingerprint of the modules a study's numbers depend on.

A study records :func:`code_fingerprint` of its :data:`TABLE_SOURCES` entry in its metrics.json when it runs
(``metrics["code_fingerprint"]``); the script that writes a docs table from the run puts it in a marker
comment above the table (:func:`marker`), and a test recomputes the fingerprint from the working tree and
fails when they differ: the table was made by a run of older code than the modules it depends on now.

The fingerprint hashes each module's syntax tree without its docstrings and import statements (``ast.dump``),
so that a change of comments, docstrings, layout or of where a name is imported from (a module moved) leaves it
alone, while any change of code does not.  The modules listed are the
study's own and those it calls for the numbers it quotes (not the whole library: a solver refactor that keeps
the results equal is checked by the solvers' tests, not by regenerating every table).
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

__all__ = ["TABLE_SOURCES", "code_fingerprint", "marker", "read_markers", "stale_tables", "write_section"]

_ROOT = Path(__file__).resolve().parents[3]  # the repository (or the installed package's parent)

#: the files (relative to the repository root) whose code a study's published tables depend on
TABLE_SOURCES: Dict[str, tuple] = {
    "train_digits": ("transformer_pde/application/studies/training.py", "transformer_pde/nn/modules.py",
                     "experiments/train_digits.toml"),
    "pretrained_probe": ("transformer_pde/application/studies/pretrained.py",
                         "transformer_pde/application/studies/probe.py",
                         "transformer_pde/application/studies/probe_subsets.py",
                         "transformer_pde/analysis/pretrained.py", "transformer_pde/analysis/pretrained_subsets.py",
                         "transformer_pde/processes/pretrained.py", "experiments/pretrained_probe.toml"),
    # the fitted surrogate of docs/pretrained.md: the script's own fit and the probe's sentence draw and W₂
    "probe_surrogate": ("scripts/probe_surrogate.py", "transformer_pde/application/studies/probe.py",
                        "transformer_pde/analysis/pretrained.py", "transformer_pde/processes/pretrained.py"),
    "probe_ff_drift": ("scripts/probe_ff_drift.py", "transformer_pde/analysis/pretrained_drift.py",
                       "transformer_pde/solvers/particle/drift.py", "transformer_pde/processes/pretrained.py",
                       "transformer_pde/analysis/pretrained.py", "transformer_pde/application/studies/probe.py"),
}


def _claims_sources(kind: str, *modules: str) -> tuple:
    """The files of a claims study: its modules, the claims' verdict logic, and every shipped config of the kind
    (``experiments/<kind>*.toml``: the quick and the full config; a change to either marks both tables stale)."""
    configs = tuple(sorted(f"experiments/{p.name}" for p in (_ROOT / "experiments").glob(f"{kind}*.toml")))
    return (*modules, "transformer_pde/application/studies/claims.py") + configs


_STUDIES = "transformer_pde/application/studies/"
_THEORY = "transformer_pde/analysis/theory/"
# the claim tables of docs/theorems.md, docs/noisy_tokens.md and the frontier pages (scripts/render_claims.py)
TABLE_SOURCES.update({
    "theorem_stability_data": _claims_sources("theorem_stability_data", _STUDIES + "theorems_stability.py",
                                              _THEORY + "stability.py", _THEORY + "sensitivity.py"),
    "theorem_stability_weights": _claims_sources("theorem_stability_weights", _STUDIES + "theorems_stability.py",
                                                 _THEORY + "stability.py", _THEORY + "sensitivity.py"),
    "theorem_omega_limit": _claims_sources("theorem_omega_limit", _STUDIES + "theorems.py", _THEORY + "limits.py",
                                           "transformer_pde/analysis/clustering.py"),
    "theorem_fast_weights": _claims_sources("theorem_fast_weights", _STUDIES + "theorems.py", _THEORY + "limits.py",
                                            _THEORY + "sensitivity.py"),
    "noisy_transition": _claims_sources("noisy_transition", _STUDIES + "noisy.py", _STUDIES + "noisy_hysteresis.py",
                                        _THEORY + "noise.py", _THEORY + "circle.py"),
    "critical_scaling": _claims_sources("critical_scaling", _STUDIES + "critical_scaling.py", _THEORY + "scaling.py"),
    "repulsive": _claims_sources("repulsive", _STUDIES + "repulsive.py", _THEORY + "synchronization.py"),
    "homogenized": _claims_sources("homogenized", _STUDIES + "homogenized.py", _THEORY + "homogenized.py",
                                   "transformer_pde/processes/homogenized.py"),
    "lost_in_the_middle": _claims_sources("lost_in_the_middle", _STUDIES + "lost_in_the_middle.py",
                                          _STUDIES + "retrieval.py", _THEORY + "kinetic.py"),
})

_MARKER = re.compile(r"<!-- table-source: kind=(?P<kind>[\w-]+) code=(?P<code>[0-9a-f]+|unknown)"
                     r"(?: run=(?P<run>[^ ]+))? -->")


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):  # import statements first: where a name comes from is not the code's arithmetic
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(isinstance(b, (ast.Import, ast.ImportFrom)) for b in block):
                kept = [b for b in block if not isinstance(b, (ast.Import, ast.ImportFrom))]
                setattr(node, field, kept or ([ast.Pass()] if field == "body" else []))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _normalised(path: Path) -> bytes:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return ast.dump(_strip_docstrings(ast.parse(text))).encode()
    # other files (configs): without comment lines and blank lines
    return "\n".join(line.rstrip() for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")).encode()


def code_fingerprint(kind: str, root: Optional[Path] = None, files: Optional[Sequence[str]] = None) -> str:
    """A 16-hex-digit hash of the code of the files a study's tables depend on (module docstring).

    Parameters
    ----------
    kind : str
        a key of :data:`TABLE_SOURCES`.
    root : Path, optional
        the repository root (default: the one this module lives in).
    files : Sequence[str], optional
        other files than the kind's (relative to ``root``).

    Returns
    -------
    str
        the hash, or "unknown" when a file is missing (an installed package without its experiments/).

    Raises
    ------
    ValueError
        an unknown kind.
    """
    if files is None:
        if kind not in TABLE_SOURCES:
            raise ValueError(f"no table sources for kind {kind!r}; known: {sorted(TABLE_SOURCES)}")
        files = TABLE_SOURCES[kind]
    root = _ROOT if root is None else Path(root)
    h = hashlib.sha256()
    for rel in files:
        path = root / rel
        if not path.is_file():
            return "unknown"
        h.update(rel.encode() + b"\0" + _normalised(path) + b"\0")
    return h.hexdigest()[:16]


def marker(kind: str, code: str, run: str = "") -> str:
    """The comment a docs table carries above it: ``<!-- table-source: kind=K code=HASH run=NAME -->``.

    Parameters
    ----------
    kind : str
        the study kind.
    code : str
        the run's recorded ``code_fingerprint``.
    run : str
        the run directory's name (no spaces).

    Returns
    -------
    str
        the comment.
    """
    tail = f" run={run}" if run and " " not in run else ""
    return f"<!-- table-source: kind={kind} code={code}{tail} -->"


def read_markers(text: str) -> Iterable[dict]:
    """The table-source markers of a page: dicts with kind, code, run (None when absent) and line (1-based).

    Parameters
    ----------
    text : str
        the page.

    Returns
    -------
    list of dict
        one per marker, in page order.
    """
    out = []
    for m in _MARKER.finditer(text):
        out.append({"kind": m["kind"], "code": m["code"], "run": m["run"], "line": text.count("\n", 0, m.start()) + 1})
    return out


def stale_tables(text: str, root: Optional[Path] = None) -> list:
    """The markers of a page whose recorded fingerprint differs from the code of ``root`` now: one line each
    naming the kind, the line, both fingerprints and how to regenerate the table.

    Parameters
    ----------
    text : str
        the page.
    root : Path, optional
        the repository root (default: this module's).

    Returns
    -------
    list of str
        empty when every table's run is of today's code.
    """
    out = []
    for mk in read_markers(text):
        now = code_fingerprint(mk["kind"], root)
        if mk["code"] != now:
            out.append(f"line {mk['line']}: the {mk['kind']} table comes from a run of code {mk['code']}, the code it "
                       f"depends on is now {now} ({', '.join(TABLE_SOURCES.get(mk['kind'], ()))}); rerun the study "
                       f"and regenerate the table with its script")
    return out


def write_section(page, start: str, end: str, text: str) -> None:
    """Replace what stands between the comments ``start`` and ``end`` of a docs page with ``text`` (the scripts
    that regenerate a table write it so; nothing else of the page changes).

    Parameters
    ----------
    page : Path
        the page.
    start, end : str
        the section's opening and closing comments (``start`` is followed by a newline in the page).
    text : str
        the new contents, newline-terminated.

    Raises
    ------
    ValueError
        the page has no ``start`` … ``end`` section.
    """
    page = Path(page)
    doc = page.read_text(encoding="utf-8")
    head, found, rest = doc.partition(start)
    if not found or end not in rest:
        raise ValueError(f"{page} has no '{start}' … '{end}' section to replace")
    tail = rest.split(end, 1)[1]
    page.write_text(f"{head}{start}\n{text}{end}{tail}", encoding="utf-8")
