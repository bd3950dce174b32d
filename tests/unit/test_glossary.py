"""Every term the dashboard shows has a one-line explanation (issue 26 item 6): its headings, states,
stall kinds, attempt outcomes, timeline flags, event types and error classes, and the operator guide
`docs/operating.md` carries the same table."""

from __future__ import annotations

import re
from pathlib import Path

from domain.lifecycle_data import LIFECYCLE
from domain.policy.retry import ERROR_CLASSES
from projections import glossary
from domain.policy.stall import STALL_KINDS as DETECTED_STALL_KINDS

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "projections" / "templates"


def headings() -> set[str]:
    """The static text of every `<th>` in the dashboard's templates (Jinja expressions left out)."""
    found = set()
    for template in TEMPLATES.glob("*.html"):
        for cell in re.findall(r"<th[^>]*>(.*?)</th>", template.read_text(), flags=re.S):
            if "{{" in cell:
                continue
            text = re.sub(r"<[^>]+>", "", cell).strip()
            if text:
                found.add(text)
    return found


def outcomes() -> set[str]:
    """The outcomes the newest `attempts` view can give (its `CASE ... END AS outcome`)."""
    views = sorted((ROOT / "projections" / "sql" / "migrations").glob("*.sql"))
    newest = [v.read_text() for v in views if "CREATE OR REPLACE VIEW attempts" in v.read_text()
              or "CREATE VIEW attempts" in v.read_text()][-1]
    case = newest.split("END AS outcome")[0].rsplit("CASE WHEN NOT c.applied", 1)[1]
    return set(re.findall(r"THEN '(\w+)'", case)) | {"superseded"}


def test_every_term_the_dashboard_shows_is_explained():
    terms = glossary.glossary()
    assert headings() - set(terms) == set()
    assert set(LIFECYCLE.states) - set(terms) == set()
    assert outcomes() - set(glossary.OUTCOMES) == set()
    assert set(DETECTED_STALL_KINDS) <= set(glossary.STALL_KINDS)  # every kind the watchdog counts
    assert set(glossary.EVENTS) == set().union(*LIFECYCLE.events.values())
    assert set(glossary.ERROR_CLASS_HELP) == set(ERROR_CLASSES)
    # the words an operator asked about (issue 26)
    for word in ("log clock", "superseded", "fenced", "ladder", "yield", "lease", "claim token"):
        assert terms[word]
    assert all(text and "\n" not in text and len(text) < 240 for text in terms.values())


def test_states_are_explained_by_the_lifecycle_file_not_restated():
    for state, meaning in LIFECYCLE.state_help.items():
        if state not in glossary.TERMS:
            assert glossary.explain(state) == meaning


def test_the_operator_guide_carries_the_same_glossary():
    doc = (ROOT / "docs" / "operating.md").read_text()
    block = doc.split("<!-- glossary: python -m projections.glossary -->\n", 1)[1].split("\n<!-- /glossary -->", 1)[0]
    assert block == glossary.markdown(), "regenerate the table: python -m projections.glossary"
