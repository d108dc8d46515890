"""The recorded mutation kill cases stay applicable: each names a file of the tree in which its original text
occurs exactly once (scripts/mutant_kill_check.py applies them; a case whose code moved or changed would be
reported SKIPPED there, and a "killed" verdict would no longer be checked against the code it speaks of).
Verdicts of earlier runs whose code has changed since carry ``"historical": true`` and are not re-checked.
Running the cases themselves (a pytest run per mutant) is the slow check: ``python scripts/mutant_kill_check.py
docs/mutation/*_kill_cases.json docs/mutation/verdicts/*.json``."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "docs" / "mutation").glob("*_kill_cases.json")) + sorted(
    (ROOT / "docs" / "mutation" / "verdicts").glob("*.json"))


def _cases(path):
    """(name, case) of every kill case, and of every "killed" verdict that is not marked historical (a verdict
    of an earlier run whose code has changed since: it records that run, and the re-check skips it)."""
    for i, c in enumerate(json.loads(path.read_text())):
        if isinstance(c, dict):
            if c.get("verdict") == "killed" and "case" in c and not c.get("historical"):
                yield c.get("mutant", str(i)), c["case"]
        else:
            yield str(i), c


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_kill_case_applies_to_the_current_tree(path):
    stale = []
    for name, (file, old, new, tests) in _cases(path):
        target = ROOT / file
        count = target.read_text().count(old) if target.is_file() else -1
        test_file = ROOT / tests.split()[0].split("::")[0]
        if count != 1 or old == new or not test_file.is_file():
            stale.append(f"{name}: {file} holds the original {count} times; test file {tests.split()[0]}")
    assert not stale, "\n".join(stale)
