"""The tables the docs carry that are generated from code, so they cannot drift: each sits between an
opening and a closing HTML comment in its document, and `python -m projections.doc_tables --write`
rewrites them all (`--check` exits 1 naming the stale ones; `tests/unit/test_error_classes.py` and
`tests/unit/test_glossary.py` fail while one is stale).

The blocks (`BLOCKS`): the error-class table (`domain/error_classes.py` `markdown`) in
`docs/design.md` and `docs/operating.md`; the glossary (`projections/glossary.py` `markdown`) and
the dashboard's pages (`projections/api_pages.py` `PAGES`) in `docs/operating.md`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Block:
    """One generated block: its `name` (the marker reads `<!-- NAME: python -m projections.doc_tables
    --write -->` ... `<!-- /NAME -->`), the documents (relative to the repository) and the renderer."""

    name: str
    docs: tuple[str, ...]
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}: python -m projections.doc_tables --write -->"

    @property
    def end(self) -> str:
        return f"<!-- /{self.name} -->"

    def current(self, doc: str) -> str | None:
        """The text between the markers in `doc`, or None when `doc` has no such block."""
        found = re.search(re.escape(self.begin) + r"\n(.*?)\n?" + re.escape(self.end), doc, flags=re.S)
        return found.group(1) if found else None

    def into(self, doc: str) -> str:
        """`doc` with the block's text replaced by a fresh rendering."""
        fresh = self.render()
        return re.sub(re.escape(self.begin) + r"\n.*?\n?" + re.escape(self.end),
                      lambda _: f"{self.begin}\n{fresh}\n{self.end}", doc, flags=re.S)


def _error_classes() -> str:
    from domain.error_classes import markdown

    return markdown()


def _glossary() -> str:
    from projections.glossary import markdown

    return markdown()


def _pages() -> str:
    from projections.api_pages import PAGES

    return "\n".join(["| address | page |", "|---|---|", *(f"| `{path}` | {what} |" for path, what in PAGES)])


BLOCKS: tuple[Block, ...] = (
    Block("error classes", ("docs/design.md", "docs/operating.md"), _error_classes),
    Block("glossary", ("docs/operating.md",), _glossary),
    Block("dashboard pages", ("docs/operating.md",), _pages),
)


def stale(root: Path = ROOT) -> list[str]:
    """`"doc: block"` for every block missing from, or out of date in, its documents."""
    found = []
    for block in BLOCKS:
        for name in block.docs:
            if block.current((root / name).read_text()) != block.render():
                found.append(f"{name}: {block.name}")
    return found


def main(argv: list[str]) -> int:
    """`--write`: rewrite every block; `--check`: exit 1 when one is stale; otherwise print them all."""
    if "--write" in argv:
        for name in sorted({d for b in BLOCKS for d in b.docs}):
            path = ROOT / name
            text = path.read_text()
            for block in BLOCKS:
                if name in block.docs:
                    text = block.into(text)
            path.write_text(text)
    if "--check" in argv or "--write" in argv:
        problems = stale()
        for problem in problems:
            print(f"stale or missing: {problem}", file=sys.stderr)
        return 1 if problems else 0
    for block in BLOCKS:
        print(f"{block.begin}\n{block.render()}\n{block.end}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
