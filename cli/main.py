"""The `tapeline` command line. Every setting is also a `TAPELINE_*` environment variable.

This module is the entry point (`python -m cli.main`, the `tapeline` console script: `main`) and
builds `app`; the commands live beside it in `run_command.py` (migrate, run, serve),
`job_commands.py` (submit, status, stalled, timeline, demo), `operator_commands.py` (dlq, review,
cancel), `webhook_commands.py` (webhooks), `region_commands.py` (region) and `history_commands.py`
(replay, export), and are registered here in the order `tapeline --help` lists them; plug-in
groups (the dev stack's `stack`) come first, through `add_plugin_commands`.
"""

from __future__ import annotations

import sys

import typer

from cli import job_commands, operator_commands, region_commands, run_command, webhook_commands
from cli.helpers import console
from tapeline.settings import Settings

app = typer.Typer(help="Tapeline: event-sourced media jobs (upload -> transcode -> publish) on Kafka.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


def add_plugin_commands(target: typer.Typer) -> None:
    """Let installed packages add their command groups: each entry point of the group
    `tapeline.commands` names a function `register(app)`. The local dev stack's `stack`
    (devstack/commands.py `register`, declared in pyproject.toml) reaches the command line this way,
    so the product never imports the dev stack. A plugin whose package is missing is left out."""
    from importlib.metadata import entry_points

    for point in entry_points(group="tapeline.commands"):
        try:
            register = point.load()
        except ImportError:  # pragma: no cover - an install without the dev stack
            continue
        register(target)


add_plugin_commands(app)

from cli.history_commands import export, replay  # noqa: E402  (replay --into/--swap, export; see cli/history_commands.py)
app.command()(replay)
app.command()(export)
app.command()(run_command.migrate)
app.command()(run_command.run)
app.command()(job_commands.submit)
app.command()(job_commands.status)
app.command()(job_commands.stalled)
app.command()(job_commands.timeline)
app.add_typer(operator_commands.dlq_app, name="dlq")
app.add_typer(operator_commands.review_app, name="review")
app.add_typer(webhook_commands.webhooks_app, name="webhooks")
app.add_typer(region_commands.region_app, name="region")
app.command()(operator_commands.cancel)
app.command()(run_command.serve)
app.command()(job_commands.demo)


def main() -> None:  # pragma: no cover
    """The `tapeline` command: `app`, with a setting that fails validation reported in one line per
    setting (its environment variable and pydantic's reason), or per broken rule between settings,
    exit code 2, instead of a traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        app()
    except SettingsError as exc:  # a value that is not even JSON: the message names the field only
        console.print(f"[red]error:[/red] invalid settings: {exc}", soft_wrap=True, highlight=False)
        sys.exit(2)
    except ValidationError as exc:
        if exc.title != Settings.__name__:
            raise
        for error in exc.errors():
            if not error["loc"]:  # a rule between settings (Settings._timeouts_fit_inside_the_lease)
                message = error["msg"].removeprefix("Value error, ")
                console.print(f"[red]error:[/red] invalid settings: {message}", soft_wrap=True, highlight=False)
                continue
            if error["loc"][0] in SECRET_SETTINGS:  # a token may be the value, or a key of it (intake_tokens)
                console.print(f"[red]error:[/red] invalid setting TAPELINE_{str(error['loc'][0]).upper()} (its value "
                              f"is not shown: it holds secrets): {error['msg']}", soft_wrap=True, highlight=False)
                continue
            name = "TAPELINE_" + "_".join(str(part) for part in error["loc"]).upper()
            console.print(f"[red]error:[/red] invalid setting {name}={error.get('input')!r}: {error['msg']}",
                          soft_wrap=True, highlight=False)
        sys.exit(2)


SECRET_SETTINGS = frozenset({"intake_tokens", "admin_token", "s3_access_key", "s3_secret_key", "database_url"})
"""Settings whose values (or keys) are secrets: an error about one never prints them (issue 20)."""


if __name__ == "__main__":
    main()
