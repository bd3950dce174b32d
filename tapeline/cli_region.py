"""`tapeline region status`: how far region B's copy of the log is behind region A (docs/regions.md).

The figures are `tapeline/region_lag.py`'s (events behind by counting committed records, seconds
behind on A's clock); the media objects are said plainly not to be replicated yet.
"""

from __future__ import annotations

import json

import typer
from rich.table import Table

from tapeline.cli_common import fail, load_settings, out

region_app = typer.Typer(help="The second region (docs/regions.md): replication lag of the log from region A "
                              "to region B.", no_args_is_help=True)


@region_app.command("status")
def region_status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object: totals, per topic, the mirror, objects."),
    timeout_s: float = typer.Option(30.0, "--timeout", min=1.0, help="Longest the reads of A may take, seconds "
                                    "(past it a partition is reported as an upper bound, exact false)."),
) -> None:
    """Per mirrored topic: committed events in A not yet in B, seconds behind (A's newest record vs the
    newest B holds, on A's clock), copies B holds twice; whether MirrorMaker 2 runs and its newest
    heartbeat's age; and that media objects are not replicated yet (issue 25 item 3).

    Exit code 1 when either region's Kafka does not answer.
    """
    from tapeline.region_measure import measure_region_lag
    from tapeline.stack.base import _paths
    from tapeline.stack.mirror import mirror_status, mirrored_topics

    from tapeline.stack.kafka import _kafka_answers

    settings = load_settings()
    if settings.region != "a":
        fail(RuntimeError(f"`region status` takes region A's settings; unset TAPELINE_REGION (it is "
                          f"{settings.region!r})"), code=2)
    target = settings.for_region("b")
    for name, region in (("a", settings), ("b", target)):  # a quick answer, not 30 s of client retries
        answers, why = _kafka_answers(region)
        if not answers:
            fail(RuntimeError(f"region {name}'s Kafka ({region.kafka_bootstrap_servers}) does not answer: {why}"
                              + ("; start it with `tapeline stack up --region b`" if name == "b" else "")))
    try:
        lag = measure_region_lag(settings, target, mirrored_topics(settings), timeout_s=timeout_s)
    except Exception as exc:  # a cluster that does not answer, a topic missing in A
        fail(RuntimeError(f"region lag not measured: {type(exc).__name__}: {exc}"))
        return
    mirror = mirror_status(target, _paths(target), settings.region_b_mirror)
    report = {"source": settings.kafka_bootstrap_servers, "target": target.kafka_bootstrap_servers,
              **lag.as_dict(), "mirror": {k: mirror[k] for k in ("up", "pid", "enabled", "heartbeat_age_s", "log")}}
    if as_json:
        typer.echo(json.dumps(report))
        return
    seconds = report["seconds_behind"]
    out.print(f"region b ({report['target']}) behind region a ({report['source']}), measured at "
              f"{report['measured_at']}")
    mirror_line = (f"up (pid {mirror['pid']}), newest heartbeat in b "
                   f"{mirror['heartbeat_age_s'] if mirror['heartbeat_age_s'] is not None else '-'} s ago"
                   if mirror["up"] else "[red]not running[/] (tapeline stack up --region b)")
    out.print(f"mirror: {mirror_line}")
    out.print(f"events: {report['events_behind']} behind{'' if report['exact'] else ' (at most: not all counted)'}; "
              f"seconds: {'unknown' if seconds is None else seconds} behind; copies twice in b: {report['surplus_in_b']}")
    table = Table("topic", "events behind", "seconds behind", "twice in b", "exact")
    for topic, row in report["topics"].items():
        table.add_row(topic, str(row["events_behind"]), "-" if row["seconds_behind"] is None else str(row["seconds_behind"]),
                      str(row["surplus_in_b"]), "yes" if row["exact"] else "no")
    out.print(table)
    out.print(f"objects: {report['objects']}")
