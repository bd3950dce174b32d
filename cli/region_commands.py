"""`tapeline region status` and `region replicate` (docs/regions.md).

`status`: how far region B's copy of the log is behind region A (`regions/mirror_lag.py`: events
behind by counting committed records, seconds behind on A's clock) and how far its copy of the media
is (`regions/object_audit.py`: objects named by B's log against those replicated).
`replicate`: the media replicator in the foreground (`regions/replicator.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional
import signal
import threading

import typer
from rich.table import Table

from domain.errors import TapelineError
from cli.helpers import fail, load_settings, out

region_app = typer.Typer(help="The second region (docs/regions.md): replication lag of the log and the media "
                              "from region A to region B; the media replicator.", no_args_is_help=True)


@region_app.command("status")
def region_status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object: totals, per topic, the mirror, objects."),
    timeout_s: float = typer.Option(30.0, "--timeout", min=1.0, help="Longest the reads of A may take, seconds "
                                    "(past it a partition is reported as an upper bound, exact false)."),
) -> None:
    """Per mirrored topic: committed events in A not yet in B, seconds behind (A's newest record vs the
    newest B holds, on A's clock), copies B holds twice; whether MirrorMaker 2 runs and its newest
    heartbeat's age; and the media objects B's log names: how many (and bytes) are replicated, how many
    pending, the oldest pending one's age in seconds (since its record reached B).

    Exit code 1 when either region's Kafka does not answer.
    """
    from regions.measure import measure_region_lag
    from regions.object_audit import objects_report
    from tapeline.home import home_paths
    from regions.mirror import mirror_status, mirrored_topics

    from tapeline.kafka import cluster_answers

    settings = load_settings()
    if settings.region != "a":
        fail(RuntimeError(f"`region status` takes region A's settings; unset TAPELINE_REGION (it is "
                          f"{settings.region!r})"), code=2)
    from cli.helpers import region_settings

    regions = region_settings()
    for name, region in regions.items():  # a quick answer, not 30 s of client retries
        answers, why = cluster_answers(region)
        if not answers:
            fail(RuntimeError(f"region {name}'s Kafka ({region.kafka_bootstrap_servers}) does not answer: {why}"
                              + ("; start it with `tapeline stack up --region b`" if name == "b" else "")))
    active, standby = mirror_direction(regions)
    source, target = regions[active], regions[standby]
    try:
        lag = measure_region_lag(source, target, mirrored_topics(source), timeout_s=timeout_s)
    except Exception as exc:  # a cluster that does not answer, a topic missing in the active region
        fail(RuntimeError(f"region lag not measured: {type(exc).__name__}: {exc}"))
        return
    mirror = mirror_status(target, home_paths(target), settings.region_b_mirror)
    from regions.replicator_process import replicator_status

    replicator = replicator_status(home_paths(target), standby)
    report = {"active": active, "standby": standby, "direction": f"{active} -> {standby}",
              "source": source.kafka_bootstrap_servers, "target": target.kafka_bootstrap_servers,
              **lag.as_dict(), "mirror": {k: mirror[k] for k in ("up", "pid", "enabled", "heartbeat_age_s", "log")},
              "objects": {**objects_report(target, timeout_s=timeout_s),
                          "replicator": {k: replicator[k] for k in ("up", "pid", "log")}}}
    if as_json:
        typer.echo(json.dumps(report))
        return
    seconds = report["seconds_behind"]
    out.print(f"region {standby} ({report['target']}, the standby) behind region {active} ({report['source']}, "
              f"active), measured at {report['measured_at']}")
    mirror_line = (f"{active} -> {standby} up (pid {mirror['pid']}), newest heartbeat in {standby} "
                   f"{mirror['heartbeat_age_s'] if mirror['heartbeat_age_s'] is not None else '-'} s ago"
                   if mirror["up"] else f"[red]not running[/] ({mirror.get('error', '')})")
    out.print(f"mirror: {mirror_line}")
    out.print(f"events: {report['events_behind']} behind{'' if report['exact'] else ' (at most: not all counted)'}; "
              f"seconds: {'unknown' if seconds is None else seconds} behind; copies twice in {standby}: "
              f"{report['surplus_in_b']}")
    table = Table("topic", "events behind", "seconds behind", f"twice in {standby}", "exact")
    for topic, row in report["topics"].items():
        table.add_row(topic, str(row["events_behind"]), "-" if row["seconds_behind"] is None else str(row["seconds_behind"]),
                      str(row["surplus_in_b"]), "yes" if row["exact"] else "no")
    out.print(table)
    out.print(f"objects: {_objects_line(report['objects'])}")


def mirror_direction(regions: dict) -> tuple[str, str]:
    """(active region, standby region) as the region epochs of the regions that answer say: the
    mirror runs from the active region into the standby (`("a", "b")` before any failover)."""
    from regions.authority import read_regions

    active = read_regions(regions).authority.active
    return active, next(name for name in regions if name != active)


def _objects_line(objects: dict) -> str:
    """The objects line of `region status` (`regions/object_audit.py` `objects_report`)."""
    replicator = objects["replicator"]
    runs = (f"replicator up (pid {replicator['pid']})" if replicator["up"]
            else "[red]replicator not running[/] (tapeline stack up --region b, or tapeline region replicate)")
    if "error" in objects:
        return f"not measured ({objects['error']}); {runs}"
    pending_bytes = f"{objects['pending_bytes']}{'' if objects['pending_bytes_known'] else '+'} bytes"
    age = objects["oldest_pending_age_s"]
    reasons = ", ".join(f"{k} {v}" for k, v in objects["pending_by_reason"].items())
    return (f"{objects['named']} named by b's log, {objects['replicated']} replicated ({objects['replicated_bytes']} "
            f"bytes), {objects['pending']} pending ({pending_bytes}"
            + (f"; {reasons}; oldest {age} s" if objects["pending"] else "") + ")"
            + ("" if objects["exact"] else " (log not read to its end: at least)") + f"; {runs}")


@region_app.command("replicate")
def region_replicate(
    log_format: str = typer.Option("json", "--log-format", envvar="TAPELINE_LOG_FORMAT", help="json | console"),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where copies are spooled on their way from A to "
                                           "B (default <region B home>/replicator)"),
    to: str = typer.Option("b", "--to", help="The standby region the objects are copied into: b (from a), or a "
                           "(from b, after a failover: `region rejoin a --as-standby` starts it)"),
) -> None:
    """Run the media replicator in the foreground until SIGTERM or SIGINT: follow region B's mirrored log
    and copy every object it names from region A's store to region B's, sha256-verified, recording
    each object and the progress per partition in region B's PostgreSQL (docs/regions.md "Media
    replication"). `tapeline stack up --region b` runs it in the background beside the mirror.

    With `replicate_health_port` (TAPELINE_REPLICATE_HEALTH_PORT, default 9490; 0: none) it serves
    /health/live, /health/ready (once it follows the log), /health/deep (with `region_replication`, the
    latest lag measurement) and /metrics (the `tapeline_region_*` gauges) on health_host, and measures
    region B's lag every `replicate_measure_every_s` seconds in a background thread
    (regions/monitor.py). A port already in use is logged and the replicator runs without it.

    With `--to a` it runs the other way (region B's store -> region A's, following region A's log
    mirrored from B, its rows in region A's PostgreSQL): the failback (docs/regions.md "Failback").

    Takes region A's settings (region B's are derived). Exit code 1 when the target's PostgreSQL does not
    answer at start; Kafka and S3 outages are waited out; 2 for an unknown region.
    """
    from domain.errors import TapelineError
    from tapeline import logs
    from regions.replicator import Replicator

    logs.configure(log_format)
    settings = load_settings()
    if settings.region != "a":
        fail(RuntimeError(f"`region replicate` takes region A's settings; unset TAPELINE_REGION (it is "
                          f"{settings.region!r})"), code=2)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if to not in ("a", "b"):
        fail(ValueError(f"unknown region {to!r}: a or b"), code=2)
    from cli.helpers import region_settings

    regions = region_settings()
    target, source = regions[to], regions["b" if to == "a" else "a"]
    ready = threading.Event()
    server = _serve_region_metrics(source, target, stop, ready)
    try:
        Replicator(source, target, workdir=workdir).run(stop, ready)
    except TapelineError as exc:
        fail(exc)
    finally:
        stop.set()
        if server is not None:
            server.stop()


def _serve_region_metrics(settings, target, stop: threading.Event, ready: threading.Event):
    """The replicator's health server and its lag measurement (`region replicate`'s docstring); the
    `HealthServer`, or None when `replicate_health_port` is 0 or the port is taken."""
    import structlog

    from tapeline.health import HealthServer, HealthState
    from regions.monitor import RegionMonitor

    if not settings.replicate_health_port:
        return None
    health = HealthState("replicator")
    try:
        server = HealthServer(health, settings.health_host, settings.replicate_health_port).start()
    except OSError as exc:  # another replicator (waiting on the lock) or another process holds the port
        structlog.get_logger("tapeline.replicator").warning(
            "health and metrics port not served; region lag not measured here",
            address=f"{settings.health_host}:{settings.replicate_health_port}", error=str(exc))
        return None
    RegionMonitor(settings, target, health, every_s=settings.replicate_measure_every_s,
                  timeout_s=settings.replicate_measure_timeout_s).start(stop)

    def mark_ready() -> None:  # ready once the replicator follows every partition
        while not stop.is_set():
            if ready.wait(0.5):
                health.mark_ready()
                return

    threading.Thread(target=mark_ready, name="tapeline-replicator-ready", daemon=True).start()
    return server


@region_app.command("failover")
def region_failover(
    to: str = typer.Option(..., "--to", help="The region that takes over the job history: b (or a, to switch back)"),
    why: str = typer.Option(..., "--why", help="Why, recorded in the failover's event and shown to whoever the "
                            "fence stops"),
    operator: Optional[str] = typer.Option(None, "--operator", help="Who runs it (default user@host)"),
    drain_timeout_s: float = typer.Option(60.0, "--drain-timeout", min=0.0, help="A planned switch (the region "
                                          "left still answers): longest wait, seconds, for the mirror to copy "
                                          "every committed record before it is stopped"),
    no_processors: bool = typer.Option(False, "--no-processors", help="Do not start the target's processors "
                                       "(start them yourself: TAPELINE_REGION=b tapeline run)"),
    as_json: bool = typer.Option(False, "--json", help="The report as one JSON object"),
) -> None:
    """Move the job history to region --to (docs/regions.md "Failover"): fence the region left (a
    `RegionFailedOver` with the next region epoch; its processors stop and write nothing, now or when
    they come back), drain the mirror when the region left still answers, stop the mirror and the media
    replicator, bring the target's projections up to date, queue again every attempt that was running
    in the region left (a `region_lost` stall: it uses no attempt, and resumes from the checkpoints the
    target holds), start the target's processors and wait until its intake accepts uploads. Prints
    each step's seconds from the start.

    Idempotent: run again after an interruption, it goes on from the fence already recorded.
    Exit code 1 when a step fails (the message says which; the steps before it stay done), 2 for an
    unknown region.
    """
    from tapeline import logs
    from cli.helpers import region_settings
    from cli.wiring import RegionProcesses
    from regions.failover import FailoverError, fail_over

    logs.configure("json" if as_json else "console", level="WARNING")  # on stderr: stdout holds the report

    if to not in ("a", "b"):
        fail(ValueError(f"unknown region {to!r}: a or b"), code=2)
    try:
        report = fail_over(region_settings(), to, why, processes=RegionProcesses(), operator=operator, drain_timeout_s=drain_timeout_s,
                           start_processors=not no_processors, say=(lambda _line: None) if as_json else out.print)
    except (FailoverError, ValueError) as exc:
        fail(exc)
        return
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
        return
    lost = ", ".join(f"{a['job_id'][:8]} {a['stage']} #{a['attempt']}" for a in report.lost_attempts) or "none"
    out.print(f"region {report.to_region} holds the job history from epoch {report.epoch} "
              f"(failover {report.failover_id}); attempts lost with region {report.from_region}: {lost}")


@region_app.command("rejoin")
def region_rejoin(
    region: str = typer.Argument(..., help="The region that rejoins as the standby: a (after a failover to b), or b"),
    as_standby: bool = typer.Option(False, "--as-standby", help="Required: the region's log, projections and "
                                    "diverged objects are reset (docs/regions.md \"Failback\")"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: the steps' times and what was reset."),
) -> None:
    """Make a region that was failed over from an empty standby of the active region (docs/regions.md
    "Failback"; regions/rejoin.py): stop its processors and every mirror and media replicator; move
    the objects its old log names that the active region's log does not (with the same sha256) under
    `orphans/region-<R>/epoch-<E>/`; delete and create again its contract topics (the region records
    are kept, the active region's copied in) and the mirror's internal topics; empty its projection
    tables (its schema only); then start MirrorMaker 2 and the media replicator from the active region
    into it, files under its home. Prints each step's seconds from the start; the report is also in
    `<R home>/rejoin/epoch-<E>.json`.

    Refused with exit code 2 (nothing changed) when the region epochs say `region` holds the job
    history, when a region does not answer, or without --as-standby; exit code 1 when a step fails
    (run it again: every step is idempotent). For region b, `tapeline stack up --region b` does the
    same once per region epoch, starting region B's services first.
    """
    from cli.helpers import region_settings
    from tapeline.home import StackError, locked, home_paths
    from cli.wiring import RegionProcesses
    from regions.rejoin import RejoinRefused, rejoin_as_standby

    if region not in ("a", "b"):
        fail(ValueError(f"unknown region {region!r}: a or b"), code=2)
    if not as_standby:
        fail(ValueError("a region rejoins only as the standby, and that resets its log, projections and diverged "
                        "objects: say --as-standby"), code=2)
    regions = region_settings()
    try:
        with locked(home_paths(regions[region])):
            report = rejoin_as_standby(regions, region, processes=RegionProcesses(), say=(lambda _line: None) if as_json else out.print,
                                       console=None if as_json else out)
    except RejoinRefused as exc:
        fail(exc, code=2)
        return
    except (StackError, TapelineError, ValueError) as exc:
        fail(exc)
        return
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
        return
    out.print(f"region {report.region} is the standby of region {report.active} (region epoch {report.epoch}); "
              f"{len(report.set_aside)} object(s) set aside; `tapeline region status` shows the mirror's lag")
