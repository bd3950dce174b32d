"""What the `tapeline` command's modules share (`cli/main.py` and the command modules
`cli_run.py`, `cli_jobs.py`, `cli_ops.py`): the two consoles, the settings and the one way a command
fails."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from tapeline.settings import Settings

console = Console(stderr=True)
out = Console() if sys.stdout.isatty() else Console(width=160)  # pipes and CI logs get wide tables


def load_settings() -> Settings:
    """The settings from the environment (`TAPELINE_*`) and `.env`: region A's, or with
    `TAPELINE_REGION=b` region B's, derived from them by `Settings.for_region` (the one rule; the
    environment always describes region A). Raises pydantic's ValidationError for a setting that fails
    validation (`cli.main.main` reports it)."""
    return region_settings()[Settings().region]


def region_settings() -> dict[str, Settings]:
    """`{"a": region A's settings, "b": region B's}` from the environment (whatever TAPELINE_REGION says)."""
    a = Settings().model_copy(update={"region": "a"})
    return {"a": a, "b": a.for_region("b")}


def fail(exc: Exception, code: int = 1) -> None:
    """Print `exc` as one red error line on stderr and exit with `code` (raises typer.Exit)."""
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)
