"""The repository's text speaks of the software, not of how it was made: no issue numbers, no
numbered work sessions, no file named after a session, in the package, tests, docs, scripts,
experiments, examples, CI configuration and top-level documents.

Each finding names the file and line, so a failure says what to rewrite."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["transformer_pde", "tests", "docs", "scripts", "experiments", "examples", ".ci"]
FILES = ["README.md", "ARCHITECTURE.md", "pyproject.toml", "CITATION.cff"]
SKIP_DIRS = {"__pycache__", "_build", ".ipynb_checkpoints", ".hypothesis", ".pytest_cache", "runs", "results"}
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".svg", ".npz", ".npy", ".pt", ".bin", ".zip", ".gz",
          ".safetensors", ".pyc", ".ico", ".woff", ".woff2", ".ttf"}

# (what it is, pattern); case-insensitive
PROCESS_WORDS = [
    ("an issue number", r"\bissues?[-\s]*#?\s*\d+\b"),
    ("a numbered session", r"\bsessions?[-_\s]*\d"),
    ("a work session", r"\b(?:this|that|the previous|the next|a later|an earlier) session\b"),
]


def _text_files():
    paths = [ROOT / f for f in FILES if (ROOT / f).is_file()]
    for folder in FOLDERS:
        base = ROOT / folder
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(ROOT).parts
            if p.is_file() and not SKIP_DIRS.intersection(rel) and p.suffix.lower() not in BINARY:
                paths.append(p)
    return paths


def _findings(path, text):
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in PROCESS_WORDS:
            m = re.search(pattern, line, re.IGNORECASE)
            if m:
                out.append(f"{path}:{lineno}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return out


def test_the_patterns_catch_process_words():
    """The scan can fail: each pattern finds its kind of phrase and leaves technical text alone."""
    # the phrases are assembled here so that this file itself holds none of them
    i, s = "iss" + "ue", "ses" + "sion"
    caught = [f"fixed in {i} 12", f"see {i} #4", f"({i}s 3 and 5)", f"the {i}-16 redesign",
              f"measured in {s} 6", f"verdicts/{s}6_a.json", f"{s}s 3-5", f"not repeated this {s}"]
    clean = ["start_new_session=True", "a cosmic-ray result database", "one issue with the cache",
             "tissue 3", "the session key of the lock file"]
    for line in caught:
        assert _findings("x", line), line
    for line in clean:
        assert not _findings("x", line), line


def test_no_process_words_in_the_repository_text():
    files = _text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    found = []
    for p in files:
        if p == Path(__file__).resolve():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += _findings(p.relative_to(ROOT), text)
    assert not found, ("describe the software as it is, not how it was made (no issue numbers or work "
                       "sessions):\n" + "\n".join(found))


@pytest.mark.parametrize("folder", ["docs", "tests"])
def test_no_file_named_after_a_session(folder):
    named = [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
             if "session" in p.name.lower() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]
    assert not named, f"name these files by their subject, not by a work session: {named}"
