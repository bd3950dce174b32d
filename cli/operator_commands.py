"""`tapeline dlq`, `review` and `cancel`: the operator's commands over dead letters, jobs in
needs_review and running jobs (registered on the main CLI in `cli/main.py`)."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from domain.errors import NoSuchDeadLetter, TapelineError
from cli.helpers import fail, load_settings, out
from tapeline.rows import attempts_text

dlq_app = typer.Typer(help="Dead letters: jobs out of attempts and records that could not be decoded.",
                      no_args_is_help=True)


def _letter_json(row: dict[str, Any], raw: bool = False) -> dict[str, Any]:
    import base64

    skip = {"key", "value"} if not raw else set()
    data = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items() if k not in skip}
    if raw:
        for name in ("key", "value"):
            data[name] = base64.b64encode(bytes(row[name])).decode() if row.get(name) is not None else None
    return data


def _letter_attempts(row: dict[str, Any]) -> str:
    """The attempts a dead-lettered job started, and those its last budget counted, in the dashboard's
    words (`tapeline/rows.py` `attempts_text`)."""
    return attempts_text(row["attempts"], row.get("budget_attempts"))


@dlq_app.command("list")
def dlq_list(reason: Optional[str] = typer.Option(None, "--reason", help="Only this error class (e.g. worker_lost)"),
             pending: bool = typer.Option(False, "--pending", help="Hide dead letters already replayed or dismissed"),
             limit: int = typer.Option(1000, "--limit", help="At most this many, newest first"),
             as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """List dead letters, newest first: id, kind (job | record | projection), job, error class, why."""
    from projections import read_model as read

    try:
        with read.open_reader(load_settings()) as conn:
            rows = read.dead_letters(conn, reason=reason, pending=pending, limit=limit)
    except TapelineError as exc:
        fail(exc)
    if as_json:
        out.print_json(json.dumps([_letter_json(r) for r in rows]))
        return
    if not rows:
        out.print(("no pending dead letters (replayed, failed or dismissed ones are hidden by --pending)" if pending
                   else "no dead letters") + (f" with reason {reason}" if reason else ""))
        return
    table = Table("kind", "stage", "class", "attempts", "when (UTC)", "replayed / dismissed", "error")
    # The id is what `dlq show` and `dlq replay` take: never shortened, whatever the terminal's width.
    table.columns.insert(0, Column("id (job/attempt)", no_wrap=True, overflow="ignore", min_width=40))
    for r in rows:
        table.add_row(r["id"], r["kind"], r["stage"] or "-", r["error_class"] or "-", _letter_attempts(r),
                      r["broker_ts"].strftime("%Y-%m-%d %H:%M:%S") if r["broker_ts"] else "-",
                      _handled(r),
                      escape((r["error"] or "")[:80]))
    out.print(table)


@dlq_app.command("show")
def dlq_show(dead_letter_id: str = typer.Argument(..., help="Dead letter id from `tapeline dlq list`"),
             as_json: bool = typer.Option(False, "--json", help="Print JSON (key and value base64)")) -> None:
    """One dead letter: its source position, error, evidence pointer, replay record and raw bytes."""
    from projections import read_model as read

    try:
        with read.open_reader(load_settings()) as conn:
            row = read.dead_letter(conn, dead_letter_id)
    except TapelineError as exc:
        fail(exc)
    if row is None:
        fail(TapelineError(f"no dead letter {dead_letter_id!r} (see `tapeline dlq list`)"), 2)
    data = _letter_json(row, raw=True)
    if as_json:
        out.print_json(json.dumps(data))
        return
    for name in ("id", "kind", "job_id", "stage", "attempt", "error_class", "attempts", "error", "topic", "partition",
                 "offset", "broker_ts", "evidence", "seen_by", "replayed_at", "replayed_by", "replay_reason",
                 "dismissed_at", "dismissed_by", "dismiss_reason"):
        out.print(f"{name:>14}: {escape(str(data.get(name)))}", highlight=False)
    if row.get("value") is not None:
        value = bytes(row["value"])
        out.print(f"{'value':>14}: {len(value)} bytes, starts {value[:32].hex()}", highlight=False)


@dlq_app.command("replay")
def dlq_replay(dead_letter_id: Optional[str] = typer.Argument(None, help="Dead letter id (or --all)"),
               replay_all: bool = typer.Option(False, "--all", help="Every pending job dead letter (with --reason)"),
               reason: Optional[str] = typer.Option(None, "--reason", help="With --all: only this error class"),
               why: str = typer.Option(..., "--why", "-m", help="Why you replay it (recorded in JobReplayed)"),
               operator: Optional[str] = typer.Option(None, "--operator", help="Who replays (default user@host)"),
               as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Reopen dead-lettered jobs: `JobReplayed` + the next attempt, with a fresh attempt budget.
    Idempotent: a dead letter already replayed, or a job no longer dead-lettered, is left alone."""
    from processors.operator import default_operator
    from cli.wiring import OperatorService

    settings = load_settings()
    try:
        ids = _chosen_dead_letters(settings, dead_letter_id, replay_all, reason)
        outcomes = OperatorService(settings).replay_dead_letters(ids, operator or default_operator(), why)
    except TapelineError as exc:
        fail(exc, 2 if isinstance(exc, NoSuchDeadLetter) else 1)
    if as_json:
        out.print_json(json.dumps([vars(o) for o in outcomes]))
        return
    if not outcomes:
        out.print("nothing to replay")
    for o in outcomes:
        out.print(f"{o.dead_letter_id}: {'replayed, ' if o.replayed else 'skipped, '}{o.detail}", highlight=False)


def _handled(letter: dict) -> str:
    """The "replayed" column of `dlq list`: by whom and why it was replayed or dismissed, else "no"."""
    if letter["replayed_at"]:
        return escape(f"by {letter['replayed_by']}: {(letter['replay_reason'] or '')[:60]}")
    if letter.get("dismissed_at"):
        return escape(f"dismissed by {letter['dismissed_by']}: {(letter['dismiss_reason'] or '')[:60]}")
    return "no"


def _chosen_dead_letters(settings, dead_letter_id: str | None, every: bool, reason: str | None) -> list[str]:
    """The dead letter ids a `dlq replay`/`dlq fail` acts on: the one given, or with `every` (--all)
    each pending job dead letter (of error class `reason`, if given). Exits 2 unless exactly one of
    an id and --all is given."""
    from projections import read_model as read

    if (dead_letter_id is None) == (not every):
        fail(TapelineError("give one dead letter id, or --all [--reason CLASS]"), 2)
    if not every:
        return [dead_letter_id]
    with read.open_reader(settings) as conn:
        return [r["id"] for r in read.dead_letters(conn, reason=reason, pending=True) if r["kind"] == "job"]


@dlq_app.command("fail")
def dlq_fail(dead_letter_id: Optional[str] = typer.Argument(None, help="Dead letter id (or --all)"),
             fail_all: bool = typer.Option(False, "--all", help="Every pending job dead letter (with --reason)"),
             reason: Optional[str] = typer.Option(None, "--reason", help="With --all: only this error class"),
             why: str = typer.Option(..., "--why", "-m", help="Why (recorded in JobFailed, told to the customer)"),
             refund: bool = typer.Option(False, "--refund", help="Credit the submitter's daily quota back "
                                                                 "(the job stops counting against it)"),
             operator: Optional[str] = typer.Option(None, "--operator", help="Who fails it (default user@host)"),
             as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """End dead-lettered jobs as failed for good: `JobFailed` with who and why (the customer's
    job.failed webhook), optionally refunding the submitter's quota; the dead letter leaves the
    pending list. Idempotent: a job already failed is left alone and the answer says by whom."""
    from processors.operator import default_operator
    from cli.wiring import OperatorService

    settings = load_settings()
    try:
        ids = _chosen_dead_letters(settings, dead_letter_id, fail_all, reason)
        outcomes = OperatorService(settings).fail_dead_letters(ids, operator or default_operator(), why, refund)
    except TapelineError as exc:
        fail(exc, 2 if isinstance(exc, NoSuchDeadLetter) else 1)
    if as_json:
        out.print_json(json.dumps([vars(o) for o in outcomes]))
        return
    if not outcomes:
        out.print("nothing to fail")
    for o in outcomes:
        out.print(f"{o.dead_letter_id}: {'failed, ' if o.failed else 'unchanged, '}{o.detail}", highlight=False)


@dlq_app.command("dismiss")
def dlq_dismiss(dead_letter_id: str = typer.Argument(..., help="Dead letter id of an undecodable record"),
                why: str = typer.Option(..., "--why", "-m", help="Why (recorded in DeadLetterDismissed)"),
                operator: Optional[str] = typer.Option(None, "--operator", help="Who dismisses it (default user@host)"),
                as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Close the dead letter of an undecodable record (nothing to replay or fail): a
    `DeadLetterDismissed` with who and why; the record and its position stay (`dlq show`), it leaves
    the pending list and the dead-letter alert. A job's dead letter is refused (replay or fail it).
    Idempotent: one already dismissed is left alone and the answer says by whom."""
    from processors.operator import default_operator
    from cli.wiring import OperatorService

    settings = load_settings()
    try:
        outcomes = OperatorService(settings).dismiss_dead_letters([dead_letter_id], operator or default_operator(), why)
    except TapelineError as exc:
        fail(exc, 2 if isinstance(exc, NoSuchDeadLetter) else 1)
    if as_json:
        out.print_json(json.dumps([vars(o) for o in outcomes]))
        return
    for o in outcomes:
        out.print(f"{o.dead_letter_id}: {'dismissed, ' if o.dismissed else 'unchanged, '}{o.detail}", highlight=False)


review_app = typer.Typer(help="Jobs in needs_review: a publish that could not be proven safe.", no_args_is_help=True)


@review_app.command("list")
def review_list(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Jobs waiting for a person, with the reason."""
    from projections import presenter
    from projections import read_model as read

    try:
        with read.open_reader(load_settings()) as conn:
            rows = [presenter.job_summary(r) for r in read.jobs_in_state(conn, "needs_review")]
    except TapelineError as exc:
        fail(exc)
    if as_json:
        out.print_json(json.dumps(rows))
        return
    if not rows:
        out.print("no job needs review")
    for r in rows:
        out.print(f"{r['job_id']}  attempt {r['attempts']}: {escape(r.get('reason') or '')}", highlight=False)


@review_app.command("resolve")
def review_resolve(job: str = typer.Argument(..., help="Job id in needs_review"),
                   posted: Optional[str] = typer.Option(None, "--posted", help="The provider's id of the post you "
                                                        "found: record it and complete the job, posting nothing"),
                   not_posted: bool = typer.Option(False, "--not-posted", help="You checked: the provider has no "
                                                   "post. Release the claim and publish again"),
                   why: str = typer.Option(..., "--why", "-m", help="Why (recorded in JobReplayed)"),
                   operator: Optional[str] = typer.Option(None, "--operator", help="Who (default user@host)")) -> None:
    """Resolve a needs_review job after checking the provider by hand."""
    from processors.operator import default_operator
    from cli.wiring import OperatorService

    if (posted is None) == (not not_posted):
        fail(TapelineError("say what you found: --posted PROVIDER_REF or --not-posted"), 2)
    try:
        done = OperatorService(load_settings()).resolve_review(job, operator or default_operator(), why, posted)
    except TapelineError as exc:
        fail(exc)
    out.print(f"{job}: {done}", highlight=False)


def cancel(job: str = typer.Argument(..., help="Job id"),
           why: str = typer.Option(..., "--why", "-m", help="Why you cancel it (recorded in JobCancelled)"),
           operator: Optional[str] = typer.Option(None, "--operator", help="Who cancels (default user@host)")) -> None:
    """Cancel a job that has not ended: emits `JobCancelled` with who and why (a running attempt stops at its
    next heartbeat). Exit 2 for an unknown job, 1 for one that has already ended."""
    from domain.errors import NoSuchJob
    from processors.operator import default_operator
    from cli.wiring import OperatorService

    try:
        done = OperatorService(load_settings()).cancel_job(job, operator or default_operator(), why)
    except NoSuchJob as exc:
        fail(exc, 2)
    except TapelineError as exc:
        fail(exc)
    out.print(f"{job}: {done}", highlight=False)
