"""`tapeline replay` and `tapeline export` (mounted on the main CLI in `cli/main.py`).

    tapeline replay --into SCHEMA [--as-of TS] [--force]   rebuild every projection into SCHEMA
    tapeline replay --swap SCHEMA                          catch SCHEMA up, then make it the live schema
    tapeline export --format avro|jsonl [--since TS] [--until TS] [--job JOB] [--output PATH]

Timestamps are ISO 8601; one without a zone is UTC. Progress bars go to stderr, results to stdout.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from domain.errors import TapelineError

console = Console(stderr=True)
out = Console() if sys.stdout.isatty() else Console(width=160)


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def parse_time(value: Optional[str], option: str = "timestamp") -> Optional[datetime]:
    """An ISO 8601 timestamp as an aware UTC datetime (naive means UTC); None stays None.

    Raises `typer.BadParameter` naming `option` for text that is not one, and for a time before
    1970-01-01 UTC (Kafka timestamps are milliseconds since the Unix epoch; the broker answers an
    offset lookup before it with an error).
    """
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace(" ", "T"))
    except ValueError as exc:
        raise typer.BadParameter(f"{option} {value!r} is not an ISO 8601 timestamp (e.g. 2025-01-31T12:00:00Z)") from exc
    moment = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    if moment < EPOCH:
        raise typer.BadParameter(f"{option} {value!r} is before 1970-01-01T00:00:00Z, where Kafka timestamps start")
    return moment


def _fail(exc: Exception, code: int = 1) -> None:
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


@contextmanager
def progress_bar(description: str, disable: bool = False) -> Iterator[tuple]:
    """A rich progress bar on stderr; yields (on_start(total), on_progress(done)) callbacks."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("offsets"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console, disable=disable, transient=False) as bar:
        task = bar.add_task(description, total=None)
        yield (lambda total: bar.update(task, total=total),
               lambda done: bar.update(task, completed=done))


def replay(into: Optional[str] = typer.Option(None, "--into", help="Schema to rebuild every projection into"),
           swap: Optional[str] = typer.Option(None, "--swap", help="Schema to make the live one (after a replay)"),
           as_of: Optional[str] = typer.Option(None, "--as-of", envvar="TAPELINE_REPLAY_AS_OF",
                                               help="Keep only records with a broker timestamp at or before this"),
           force: bool = typer.Option(False, "--force", help="Drop and rebuild SCHEMA when it exists and is not empty (only a Tapeline projection schema)"),
           catch_up: bool = typer.Option(True, "--catch-up/--no-catch-up",
                                         help="With --swap: first apply what the log gained since the replay"),
           batch_size: int = typer.Option(5000, "--batch-size", envvar="TAPELINE_REPLAY_BATCH_SIZE",
                                          help="Records per PostgreSQL transaction"),
           workers: Optional[int] = typer.Option(None, "--workers", min=1, envvar="TAPELINE_REPLAY_WORKERS",
                                                 help="Processes that decode and fold a fresh replay, the partitions "
                                                      "split among them (default: one per core from 200,000 "
                                                      "offsets; 1: no workers)"),
           engine: str = typer.Option("auto", "--engine", envvar="TAPELINE_REPLAY_ENGINE",
                                      help="Fold engine of a fresh replay: auto (native when built), native "
                                           "(compiled, projections/native.py) or python (the reference)"),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object")) -> None:
    """Rebuild the projections from offset 0 into a fresh schema (--into), or swap one in (--swap).

    A replay reads the log up to where it ends when the replay starts (or up to --as-of), shows
    progress, never produces to Kafka and prints the counts. --swap renames the live schema to
    <live>_retired_<UTC time> and SCHEMA to the live name in one transaction, holding the lock every
    projector batch takes, so the projector pauses for the swap and resumes from SCHEMA's offsets.
    Refusals exit with code 2 and change nothing: --into refuses the live schema, a schema that is
    not a Tapeline projection and (without --force) a non-empty one; --swap refuses the live schema,
    a schema that does not exist, one that is not a Tapeline projection and, with --no-catch-up, one
    whose replay never finished.
    """
    from projections.pgschema import SchemaRefused, check_swappable
    from projections.pgschema import swap as swap_schemas
    from projections.replay import replay as run_replay
    from tapeline.settings import Settings

    from tapeline import logs

    settings = Settings()
    logs.configure("console")  # log lines (e.g. the engine's fallback) to stderr: stdout holds --json
    if (into is None) == (swap is None):
        _fail(typer.BadParameter("give exactly one of --into SCHEMA or --swap SCHEMA"), 2)
    try:
        if into is not None:
            moment = parse_time(as_of, "--as-of")
            try:
                with progress_bar(f"replay into {into}", disable=as_json) as (on_start, on_progress):
                    result = run_replay(settings, into, as_of=moment, force=force, batch_size=batch_size,
                                        workers=workers, on_start=on_start, on_progress=on_progress,
                                        engine=engine)
            except KeyboardInterrupt:
                console.print(f"interrupted: nothing was committed; {into} is left empty (run the same command "
                              "again to redo it)", highlight=False)
                raise typer.Exit(130) from None
            _print_replay(result, as_json)
            if moment is not None and result.records == 0:
                console.print(f"note: the log has no record at or before --as-of {moment.isoformat()}; {into} holds "
                              "empty projections", highlight=False)
            return
        check_swappable(settings.database_url, swap, settings.db_schema)  # before a catch-up writes to it
        if catch_up:
            with progress_bar(f"catching {swap} up", disable=as_json) as (on_start, on_progress):
                result = run_replay(settings, swap, fresh=False, batch_size=batch_size, on_start=on_start,
                                    on_progress=on_progress)
        swapped = swap_schemas(settings.database_url, swap, settings.db_schema)
    except SchemaRefused as exc:
        _fail(exc, 2)
    except TapelineError as exc:
        _fail(exc)
    summary = {"live": swapped.live, "from": swap, "retired": swapped.retired,
               "stall_policy_copied": swapped.stall_policy_copied}
    if as_json:
        out.print_json(json.dumps(summary))
    else:
        out.print(f"{swap} is now the live schema {swapped.live}; the previous one is kept as {swapped.retired} "
                  f"(DROP SCHEMA {swapped.retired} CASCADE when no longer needed)")


def _print_replay(result, as_json: bool) -> None:
    summary = {"schema": result.schema, "records": result.records, "applied": result.applied,
               "duplicates": result.duplicates, "superseded": result.superseded,
               "dead_letters": result.dead_letters, "elapsed_s": round(result.elapsed_s, 3),
               "events_per_s": round(result.events_per_s), "workers": result.workers, "engine": result.engine,
               "engine_note": result.engine_note,
               "rss_mb": round(result.rss_mb, 1), "rss_mb_by_process": result.rss_mb_by_process, "rows": result.rows,
               "phases_s": {name: round(seconds, 3) for name, seconds in result.phases.items()}}
    if as_json:
        out.print_json(json.dumps(summary))
        return
    out.print(f"replayed {result.records} records into {result.schema} in {result.elapsed_s:.1f} s "
              f"({result.events_per_s:,.0f}/s, {result.workers} process{'' if result.workers == 1 else 'es'}, "
              f"{result.engine} engine{' (' + result.engine_note + ')' if result.engine_note else ''}): applied {result.applied}, duplicates {result.duplicates}, "
              f"superseded {result.superseded}, undecodable {result.dead_letters}")
    table = Table("table", "rows", title=f"schema {result.schema}")
    for name, count in result.rows.items():
        table.add_row(name, str(count))
    out.print(table)


def export(fmt: str = typer.Option("jsonl", "--format", envvar="TAPELINE_EXPORT_FORMAT", help="avro | jsonl"),
           since: Optional[str] = typer.Option(None, "--since", help="First broker timestamp (inclusive)"),
           until: Optional[str] = typer.Option(None, "--until", help="Last broker timestamp (exclusive); "
                                               "default: the log end when the export starts"),
           job: Optional[str] = typer.Option(None, "--job", help="Only this job's events"),
           output: Optional[Path] = typer.Option(None, "--output", "-o", help="File to write (default: stdout); "
                                                 "written as PATH.partial and renamed when complete")) -> None:
    """Stream the committed event history of the lifecycle log as Avro (a container file) or JSON lines.

    A reader that closes the pipe early (`tapeline export | head`) ends the export quietly with exit
    code 141 (128 + SIGPIPE, what `yes | head` reports)."""
    from projections.export import FORMATS, export as run_export
    from tapeline.settings import Settings

    if fmt not in FORMATS:
        _fail(typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}"), 2)
    first, end = parse_time(since, "--since"), parse_time(until, "--until")
    if first is not None and end is not None and first >= end:
        _fail(typer.BadParameter(f"--since {since} is not before --until {until}"), 2)
    settings = Settings()
    # A file is written under a temporary name and renamed when complete: a file under the name asked
    # for is always a whole export; an interrupted or failed one is removed (or, after kill -9, left as
    # `<name>.partial`, which says what it is). Anything else (/dev/null, a pipe) is written directly.
    regular = output is not None and (not output.exists() or output.is_file())
    partial = output.with_name(output.name + ".partial") if regular else None
    try:
        target = open(partial if regular else output, "wb") if output is not None else sys.stdout.buffer
    except OSError as exc:
        _fail(TapelineError(f"cannot write {partial or output}: {exc.strerror or exc}"))
    completed = False
    try:
        with progress_bar("export", disable=output is None and not console.is_terminal) as (on_start, on_progress):
            result = run_export(settings, target, fmt, since=first, until=end, job=job,
                                on_start=on_start, on_progress=on_progress)
        if partial is not None:
            target.close()
            try:
                os.replace(partial, output)
            except OSError as exc:  # e.g. a directory of that name
                _fail(TapelineError(f"cannot write {output}: {exc.strerror or exc}"))
        completed = True
    except BrokenPipeError:
        _closed_pipe()
    except TapelineError as exc:
        _fail(exc)
    finally:
        if output is not None:
            try:
                target.close()
            except BrokenPipeError:  # a FIFO whose reader left: its buffered bytes have nowhere to go
                _closed_pipe()
            if partial is not None and not completed:
                partial.unlink(missing_ok=True)
    if job is not None and result.events == 0:
        console.print(f"note: no event of job {job!r} in that range (is the job id right?)", highlight=False)
    skipped = [f"{result.skipped_undecodable} undecodable records"] if result.skipped_undecodable else []
    if result.skipped_other_jobs:
        skipped.append(f"{result.skipped_other_jobs} records of other jobs (or watchdog ticks) in its partition")
    console.print(f"exported {result.events} events" + (f" to {output}" if output else "")
                  + (f"; skipped {', '.join(skipped)}" if skipped else ""), highlight=False)


SIGPIPE_EXIT = 141
"""Exit code of an export whose reader closed the pipe: 128 + SIGPIPE, as a command killed by it reports."""


def _closed_pipe() -> None:
    """The reader of our output went away (`| head`): stop quietly, the Unix way. stdout is pointed
    at /dev/null first, so the interpreter's final flush does not raise (and print) again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise typer.Exit(SIGPIPE_EXIT)
