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
    block = doc.split("<!-- glossary: python -m projections.doc_tables --write -->\n", 1)[1].split(
        "\n<!-- /glossary -->", 1)[0]
    assert block == glossary.markdown(), "regenerate the tables: python -m projections.doc_tables --write"


def test_the_glossary_is_generated_from_the_stage_registry_and_the_error_table():
    """Every stage (intake and the registry's) and every error class is explained from its one source,
    and the terms an operator asked about in issue 45 are there."""
    from domain import pipeline
    from domain.error_classes import glossary_line

    terms = glossary.glossary()
    assert set(glossary.STAGES) == {pipeline.INTAKE, *pipeline.STAGE_NAMES}
    for spec in pipeline.STAGES:
        assert spec.about and terms[spec.name] == f"stage: {spec.about}"
    assert terms[pipeline.INTAKE] == f"stage: {pipeline.INTAKE_ABOUT}"
    assert all(name in terms["stage"] for name in pipeline.STAGE_NAMES)
    for name, spec in ERROR_CLASSES.items():
        assert glossary.ERROR_CLASS_HELP[name] == glossary_line(spec)
    assert "not retried" in terms["output_conflict"] and "may pass" not in terms["output_conflict"]
    for word in ("gross_wasted_s", "origin", "budget", "claim marker", "degraded", "profile_fingerprint", "LSO"):
        assert terms[word], word


def test_the_docs_list_every_page_of_the_dashboard():
    """`api_pages.PAGES` names every HTML page the dashboard serves (GET routes of its router), and
    `docs/operating.md` carries the list."""
    from projections.api_pages import PAGES, router
    from projections.doc_tables import BLOCKS

    served = {route.path for route in router.routes if "GET" in route.methods}
    assert {path for path, _ in PAGES} == served
    block = next(b for b in BLOCKS if b.name == "dashboard pages")
    listed = block.current((ROOT / "docs" / "operating.md").read_text())
    assert listed == block.render() and all(f"`{path}`" in listed for path in served)
