"""`tapeline submit`, `status`, `stalled`, `timeline` and `demo`: a job from the command line, in
and out (registered on the main CLI in `cli/main.py`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from domain.errors import RegionFenced, TapelineError
from domain.policy.tiers import TIERS
from cli.helpers import console, fail, load_settings, out
from projections import presenter
from projections.presenter import timeline_detail
from domain.lifecycle import TERMINAL_STATES
from tapeline.settings import Settings


def _wait_for_job(settings: Settings, job_id: str, timeout_s: float, show_progress: bool) -> dict[str, Any]:
    from projections import read_model as read

    started = time.monotonic()
    deadline, next_cluster_check = started + timeout_s, started + 3.0
    with _reader_once_migrated(settings, deadline) as conn:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                      TimeElapsedColumn(), console=console, disable=not show_progress, transient=False) as bar:
            task = bar.add_task("waiting for intake", total=100)
            while True:
                row = read.job_row(conn, job_id)
                if row is None and time.monotonic() > next_cluster_check:
                    _refuse_other_cluster(settings, conn)  # the projector would never show the job
                    next_cluster_check = time.monotonic() + 15.0
                if row is not None:
                    bar.update(task, completed=presenter.percent_done(row),
                               description=f"{row['stage']} attempt {row['attempt']}: {row['state']}")
                    if row["state"] in TERMINAL_STATES:
                        return presenter.job_summary(row)
                if time.monotonic() > deadline:
                    raise TapelineError(f"job {job_id} did not finish within {timeout_s:.0f} s "
                                        f"(state: {row['state'] if row else 'not yet accepted'}); "
                                        "are the processors running? `tapeline run --role all --detach`")
                time.sleep(0.3)


def _reader_once_migrated(settings: Settings, deadline: float):
    """`read_model.open_reader`, waiting (until `deadline`, monotonic seconds) while the projection
    schema has no tables yet: processors started a moment ago (`make demo`: `run --detach`, then
    the demo at once) migrate it as they start. Raises `ProjectionMissing` after the deadline."""
    from projections import read_model as read

    while True:
        try:
            return read.open_reader(settings)
        except read.ProjectionMissing:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _refuse_other_cluster(settings: Settings, conn) -> None:
    """Raise TapelineError when the projections were built from another Kafka cluster than the
    broker's (the projector then idles, and a job is never shown)."""
    from projections.projector import OTHER_CLUSTER, OTHER_CLUSTER_FIX, other_cluster
    from tapeline import kafka

    client = kafka.consumer(settings, f"{settings.app_name}.cli-check")
    try:
        cluster = client.list_topics(timeout=10).cluster_id
    finally:
        client.close()
    stored = other_cluster(conn, cluster) if cluster else None
    if stored is not None:
        raise TapelineError(f"{OTHER_CLUSTER} (database: {stored}, broker: {cluster}); the projector waits "
                            f"and shows no job. Fix: {OTHER_CLUSTER_FIX}")


def submit(file: Path = typer.Argument(..., help="Video file to upload"),
           priority: str = typer.Option("standard", "--priority", envvar="TAPELINE_PRIORITY",
                                        help=f"Priority tier: {', '.join(TIERS)}"),
           submitter: str = typer.Option("cli", "--submitter", envvar="TAPELINE_SUBMITTER",
                                         help="Who submits (quotas count per submitter)"),
           profile: str = typer.Option("default", "--profile", envvar="TAPELINE_PROFILE",
                                       help="Output profile name (part of the result-reuse fingerprint)"),
           wait: bool = typer.Option(False, "--wait", help="Show progress until the job ends"),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
           timeout: float = typer.Option(1800.0, "--timeout", help="Seconds --wait waits at most"),
           url: Optional[str] = typer.Option(None, "--url", envvar="TAPELINE_INTAKE_URL",
                                             help="Upload through the HTTP intake at this URL (e.g. "
                                                  "http://127.0.0.1:8400) instead of to S3 and Kafka directly"),
           token: Optional[str] = typer.Option(None, "--token", envvar="TAPELINE_INTAKE_TOKEN",
                                               help="--url: API token (names the submitter; --submitter is ignored)"),
           retries: int = typer.Option(10, "--retries", envvar="TAPELINE_SUBMIT_RETRIES",
                                       help="--url: how many 503/429 answers to wait out (their Retry-After)")) -> None:
    """Upload FILE to object storage and publish UploadCompleted (or, with --url, POST it to the HTTP intake,
    waiting out 503/429 Retry-After); prints the job id. Refused with exit code 3 and nothing uploaded
    while this region does not hold the job history (docs/regions.md): the error names the active region
    and where to submit."""
    from producers.submit import publish, upload

    settings = load_settings()
    if url:
        _submit_http(settings, file, url, token, priority, profile, retries, wait, as_json, timeout)
        return
    _refuse_when_fenced(settings, file)
    try:
        size = file.stat().st_size if file.is_file() else 0
        with Progress(TextColumn("uploading {task.fields[name]}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                      console=console, disable=as_json or size < 8 * 1024**2, transient=True) as bar:
            task = bar.add_task("upload", total=size or 1, name=file.name)
            submission = upload(settings, file, priority=priority, submitter=submitter, profile=profile,
                                on_bytes=lambda n: bar.advance(task, n))
        publish(settings, submission.event)
        if not wait:
            if as_json:
                out.print_json(json.dumps({"job_id": submission.job_id, "upload_id": submission.upload_id,
                                           "state": "submitted"}))
            else:
                out.print(submission.job_id)
            return
        if not as_json:
            console.print(f"job {submission.job_id} submitted ({submission.size_bytes} bytes)")
        summary = _wait_for_job(settings, submission.job_id, timeout, show_progress=not as_json)
    except TapelineError as exc:
        fail(exc)
    _report(summary, as_json)


def _refuse_when_fenced(settings: Settings, file: Path) -> None:
    """Exit with `FENCED_EXIT_CODE` and one error line (who holds the job history, where to submit)
    when `settings`' region is not the active one; return when it is, or when no region's Kafka
    answers (the upload then fails on its own). One read of the region epochs, before anything is
    uploaded (`regions/authority.py` `IntakeFence`)."""
    from cli.wiring import region_pair
    from regions.authority import FENCED_EXIT_CODE, IntakeFence

    refusal = IntakeFence(settings.region, region_pair(settings)).refusal()
    if refusal is None:
        return
    active = dict(refusal.details)["active_region"]
    fail(RuntimeError(f"{refusal.reason}; nothing was uploaded. Submit to region {active}: "
                      f"TAPELINE_REGION={active} tapeline submit {file}"), code=FENCED_EXIT_CODE)


def _report(summary: dict[str, Any], as_json: bool) -> None:
    """Print a finished job's summary (JSON or text); exit 3 unless it completed."""
    if as_json:
        out.print_json(json.dumps(summary))
    else:
        _print_summary(summary)
    if summary["state"] != "completed":
        raise typer.Exit(3)


def _submit_http(settings: Settings, file: Path, url: str, token: str | None, priority: str, profile: str,
                 retries: int, wait: bool, as_json: bool, timeout: float) -> None:
    """`submit --url`: stream FILE to the HTTP intake, showing every Retry-After wait; --wait polls the
    job's status URL (the read API of the same server)."""
    from producers.http_submit import IntakeClient

    def waiting(seconds: float, status: int, body: dict[str, Any]) -> None:
        console.print(f"intake busy ({status} {body.get('error', '')}: {body.get('reason', '')}); "
                      f"retrying in {seconds:.0f} s", highlight=False, soft_wrap=True)
        end = time.monotonic() + seconds
        with console.status("", spinner="clock") as shown:  # a countdown on a terminal; the line above for logs
            while (left := end - time.monotonic()) > 0:
                shown.update(f"retrying in {left:.0f} s")
                time.sleep(min(0.5, left))

    try:
        client = IntakeClient(url, token)
        try:
            accepted = client.upload(file, priority=priority, profile=profile, retries=retries,
                                     on_wait=waiting)
            if not wait:
                if as_json:
                    out.print_json(json.dumps({**accepted, "state": "submitted"}))
                else:
                    out.print(accepted["job_id"])
                return
            if not as_json:
                console.print(f"job {accepted['job_id']} accepted by the intake; status {url.rstrip('/')}"
                              f"{accepted['status_url']}", highlight=False)
            deadline = time.monotonic() + timeout
            while True:
                job = client.job(accepted["status_url"])
                if job is not None and job["state"] in TERMINAL_STATES:
                    summary = job
                    break
                if time.monotonic() > deadline:
                    raise TapelineError(f"job {accepted['job_id']} did not finish within {timeout:.0f} s "
                                        f"(state: {job['state'] if job else 'not yet accepted'})")
                time.sleep(0.5)
        finally:
            client.close()
    except RegionFenced as exc:
        from regions.authority import FENCED_EXIT_CODE

        fail(exc, code=FENCED_EXIT_CODE)
    except TapelineError as exc:
        fail(exc)
    _report(summary, as_json)


def _print_summary(summary: dict[str, Any]) -> None:
    attempts = summary["attempts"]
    how = "with no attempt of its own" if not attempts else f"after {attempts} attempt{'s' if attempts != 1 else ''}"
    out.print(f"job {summary['job_id']}: [bold]{summary['state']}[/bold] {how}")
    if summary["state"] != "completed" and (summary.get("error_class") or summary.get("reason")):
        out.print(f"  {summary.get('error_class') or 'reason'}: {summary.get('reason') or '-'}", highlight=False)
    if summary.get("reused_from"):
        out.print(f"  reused the published outputs of job {summary['reused_from']} (same source and profile; "
                  "no transcode)", highlight=False)
    if summary.get("degraded"):
        out.print(f"  degraded ladder: {summary.get('degraded_reason')}", highlight=False)
    if summary.get("master_url"):
        out.print(f"  master playlist: {summary['master_url']}")
    for rendition in summary.get("outputs", []):
        out.print(f"  {rendition['name']:>6} {rendition['width']}x{rendition['height']}  {rendition['url']}")
    for artifact in summary.get("artifacts", []):  # other stages' published files (thumbnails: poster, storyboard, VTT)
        out.print(f"  {artifact['stage']}: {artifact['name']}  {artifact['where']}",
                  highlight=False)
    for kept in summary.get("archived", []):  # the archive stage's private copy of the source
        out.print(f"  archived: {kept['key']}  sha256 {kept['sha256']}", highlight=False)


def _progress_line(summary: dict[str, Any]) -> str:
    """`tier standard, transcode attempt 2, 11.6 % done; lease until ...; frames 392`: the lease and
    frames only while an attempt runs (a finished job has neither), the stage's own attempt, the
    percent as every view prints it (`presenter.percent_text`)."""
    running = summary["state"] == "running"
    frames = f"; frames {summary['progress_frames']}" if running and summary["progress_frames"] else ""
    lease = f"; lease until {summary['leased_until']}" if running and summary["leased_until"] else ""
    return (f"  tier {summary['priority']}, {summary['stage']} attempt {summary['attempt']}, "
            f"{summary['percent_text']} done{lease}{frames}")


def _print_diagnosis(found: dict[str, Any]) -> None:
    """The diagnosis (domain/diagnosis.py) as an operator reads it: what happened, why, what to do."""
    from rich.markup import escape  # reasons are the writers' words: never read as markup

    out.print(f"  [bold]what happened:[/bold] {escape(found['summary'])}", highlight=False)
    if found["why"]:  # the job page's words (domain/diagnosis.py VERDICTS)
        out.print(f"  [bold]{found['verdict'].lower()}:[/bold] {escape(found['why'])}", highlight=False)
    out.print(f"  [bold]what to do:[/bold] {escape(found['action'])}", highlight=False)
    for other in found["same_source"][:5]:
        out.print(f"  same file: job {other['job_id']} {other['state']}"
                  f"{' (' + other['error_class'] + ')' if other['error_class'] else ''}", highlight=False)


def status(job: Optional[str] = typer.Argument(None, help="Job id; without it, the most recent jobs"),
           as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Show a job's current state, or the most recent jobs, the publish providers (breaker state,
    cooldown, posts against quotas, last wait) and the projection's lag (events and seconds behind the
    log end; --json: {"jobs": [...], "projection_lag": {...}, "providers": [...]})."""
    from projections import read_model as read
    from projections.provider_status import describe as describe_provider
    from projections.provider_status import provider_overview

    settings = load_settings()
    try:
        with read.open_reader(settings) as conn:
            if job:
                row = read.job_row(conn, job)
                if row is None:
                    fail(TapelineError(f"no job {job} in the projections (not submitted, or intake not caught up)"), 2)
                summary = presenter.job_summary(row)
                # The job page's facts (read_model.job_facts): attempts (view attempts), source and its
                # handling note, diagnosis, suspect (issue 45), the tool's state at a stall, checkpoints.
                facts = read.job_facts(conn, row)
                summary["attempt_history"] = facts.pop("attempts")
                summary.update(facts)
                if as_json:
                    out.print_json(json.dumps(summary))
                    return
                _print_summary(summary)
                _print_diagnosis(summary["diagnosis"])
                if summary["source"] and summary["source"]["handling"]:  # the job page's "handling" row
                    out.print(f"  source handling: {summary['source']['handling']}", highlight=False)
                if summary["suspect"]:
                    out.print(f"  suspect: {summary['suspect']['stage']} attempt {summary['suspect']['attempt']}, "
                              f"{summary['suspect']['reason']} ({summary['suspect']['remaining_s']:.0f} s before the "
                              "watchdog's verdict)", highlight=False)
                if summary["stall_evidence"]:
                    found = summary["stall_evidence"]
                    out.print(f"  at the {found['kind']} stall of {found['stage']} attempt {found['attempt']}:",
                              highlight=False)
                    for line in found["lines"]:
                        out.print(f"    {line}", highlight=False)
                out.print(_progress_line(summary), highlight=False)
                for a in summary["attempt_history"]:
                    out.print(f"  {a['stage']} attempt {a['attempt']} by {a['worker']}: {a['outcome']}"
                              f"{' (' + a['error_class'] + ')' if a['error_class'] else ''}, started "
                              f"{a['started_at'][11:19]} UTC, ran {a['duration_s'] if a['duration_s'] is not None else '-'} s, "
                              f"wasted {a['wasted_s'] if a['wasted_s'] is not None else '-'} s"
                              + (f" ({a['reused_segments']} of its segments reused by a later attempt)"
                                 if a["reused_segments"] else ""), highlight=False)
                return
            rows = [presenter.job_summary(r) for r in read.recent_jobs(conn)]
            providers = provider_overview(conn, settings)  # breakers, quota use, last waits (migration 014)
            try:  # events and seconds behind the log end, per partition (tapeline/lag.py)
                lag, lag_error = read.projection_lag(settings, conn).as_dict(), None
            except TapelineError as exc:
                lag, lag_error = None, str(exc)
    except TapelineError as exc:
        fail(exc)
    if as_json:
        out.print_json(json.dumps({"jobs": rows, "projection_lag": lag or {"error": lag_error},
                                   "providers": providers}))
        return
    table = Table("job", "state", "stage", "attempt", "%", "updated (UTC)")  # the dashboard's list, same words
    for r in rows:
        table.add_row(r["job_id"], r["state"], r["stage"], str(r["attempt"]), r["percent_text"], r["updated_at"][:19])
    out.print(table)
    for item in providers:
        out.print(f"provider {describe_provider(item)}", highlight=False)
    if lag is None:
        out.print(f"projection lag: unknown ({lag_error})", highlight=False)
        return
    out.print(f"projection lag: {'' if lag['exact'] else 'at most '}{lag['events']} events, {lag['seconds']:.1f} s "
              f"behind the log end", highlight=False)
    for p in lag["partitions_behind"]:
        out.print(f"  {p['topic']}[{p['partition']}]: {p['events']} events (offsets {p['stored']}..{p['log_end']}), "
                  f"oldest waiting {p['seconds']:.1f} s", highlight=False)


def stalled(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Attempts, handoffs and uploads that stopped moving, retries still waiting for their backoff or a
    worker, and jobs waiting for review, with kind, job, stage, attempt and for how long (seconds on the
    log clock); then attempts suspect before the watchdog's verdict (kind `suspect`: "no progress for
    95 s of the 120 s allowance") and the attempt stalls judged in the last TAPELINE_RECENT_STALLS_S
    seconds with what was done about them (kind `recent_stall`)."""
    from projections import read_model as read

    settings = load_settings()
    try:
        with read.open_reader(settings) as conn:
            rows = read.stall_list(conn, settings.recent_stalls_s)
    except TapelineError as exc:
        fail(exc)
    if as_json:
        out.print_json(json.dumps(rows))
        return
    if not rows:
        out.print(f"nothing is stalled, suspect, or was judged stalled in the last {settings.recent_stalls_s:.0f} s")
        return
    if all(r["kind"] == "recent_stall" for r in rows):
        out.print("nothing is stalled now; judged recently:")
    table = Table("kind", "job", "stage", "attempt", "worker", "last progress (UTC)", "frames", "for (s)", "why")
    for r in rows:
        table.add_row(r["kind"], r["job_id"], r["stage"], str(r["attempt"]), r["worker"] or "-",
                      (r["last_progress_at"] or "-")[11:23], str(r["progress_frames"] or "-"), f"{r['since_s']:.1f}",
                      r.get("reason") or "-")
    out.print(table)


def timeline(job: str = typer.Argument(..., help="Job id"),
             as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Every event of a job in log order, with its attempt and broker timestamp. Checkpoints show their
    rendition, segment and media times; a transcode success shows which segments it reused from earlier attempts."""
    from projections import read_model as read

    try:
        with read.open_reader(load_settings()) as conn:
            rows = read.timeline(conn, job)
    except TapelineError as exc:
        fail(exc)
    if not rows:
        fail(TapelineError(f"no events for job {job}"), 2)
    if as_json:
        out.print_json(json.dumps([{**r, "broker_ts": r["broker_ts"].isoformat(),
                                    "occurred_at": r["occurred_at"].isoformat(), "detail": timeline_detail(r)} for r in rows],
                                  default=str))
        return
    table = Table("broker time (UTC)", "event", "stage", "attempt", "flags", "detail", title=f"job {job}")
    for r in rows:
        flags = ",".join(f for f in ("superseded", "duplicate") if r[f]) or ("" if r["applied"] else "evidence")
        table.add_row(r["broker_ts"].strftime("%H:%M:%S.%f")[:-3], r["event_type"], r["stage"], str(r["attempt"]),
                      flags, timeline_detail(r))
    out.print(table)


def demo(file: Optional[Path] = typer.Option(None, "--file", help="Video to submit (default: the real bigbuckbunny.mp4)"),
         timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the job")) -> None:
    """Submit the real sample video, wait with a progress bar, print its timeline and master URL."""
    from producers.submit import publish, upload
    from tapeline.samples import sample_video

    settings = load_settings()
    try:
        path = file or sample_video("bigbuckbunny.mp4")
        console.print(f"submitting {path}", soft_wrap=True)  # a long path stays one line a user can copy
        submission = upload(settings, path)
        publish(settings, submission.event)
        console.print(f"job {submission.job_id}")
        summary = _wait_for_job(settings, submission.job_id, timeout, show_progress=True)
    except TapelineError as exc:
        fail(exc)
    timeline(submission.job_id, as_json=False)
    _print_summary(summary)
    if summary["state"] != "completed":
        raise typer.Exit(3)
    out.print(f"\nplay it: ffplay {summary['master_url']}\nmore: tapeline submit FILE --wait | tapeline status | make down")
