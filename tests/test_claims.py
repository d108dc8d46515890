"""transformer_pde.application.studies.claims: a claim without a reference carries no verdict, in the code and
in every claims table the docs publish."""

import pathlib
import re

from transformer_pde.application.studies import claims

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def test_a_claim_without_reference_has_no_verdict():
    """holds is None whenever the reference is absent or not finite, whatever the study judged; a claim with a
    reference and a value keeps the study's verdict (so the rule is not a blanket None)."""
    assert claims.claim("x", 1.0, 0.1, 4, reference=None, holds=True)["holds"] is None
    assert claims.claim("x", 1.0, 0.1, 4, reference=None, holds=False)["holds"] is None
    assert claims.claim("x", 1.0, 0.1, 4, reference=float("nan"), holds=True)["holds"] is None
    assert claims.claim("x", 1.0, 0.1, 4, reference=0.0, holds=False)["holds"] is False
    assert claims.claim("x", 1.0, 0.1, 4, reference=2.0, holds=True)["holds"] is True
    table = claims.render_table([claims.claim("x", 1.0, 0.1, 4, holds=True)])
    assert table.splitlines()[-1].endswith("| — | — |"), table


def test_published_claim_tables_give_no_verdict_without_reference():
    """Every row of a claims table in docs/ (claim | value ± error | seeds | reference | holds) whose reference
    is "—" has the verdict "—" as well."""
    row = re.compile(r"^\|[^|\n]*(?:\\\|[^|\n]*)*\| [^|\n]* ± [^|\n]* \| \d+ \| (?P<ref>[^|\n]*) \| (?P<holds>[^|\n]*) \|$",
                     re.M)
    bad, seen = [], 0
    for page in sorted(DOCS.glob("*.md")):
        for m in row.finditer(page.read_text(encoding="utf-8")):
            seen += 1
            if m["ref"].strip() == "—" and m["holds"].strip() != "—":
                bad.append(f"{page.name}: {m.group(0)}")
    assert seen > 20, seen  # the pattern reads the tables (theorems, noisy tokens, ...)
    assert not bad, "\n".join(bad)
