"""Region B of the local stack: Kafka, PostgreSQL and S3 of its own, and the log mirror from region A.

Region B's settings come from region A's by the one rule `Settings.for_region("b")` (ports +10000,
PostgreSQL on 5433, home `<home>/region-b`; docs/regions.md). Its services are the same as region
A's, started by the same code, except PostgreSQL: a server of its own under its home
(devstack/pgserver.py) instead of Debian's cluster. Region A is never started, stopped or
changed here; the mirror only reads it.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from cli import supervisor
from tapeline.settings import Settings

from devstack import up_services
from tapeline.home import StackError, locked, say, home_paths, read_state, update_state, stop_owned
from devstack.s3 import s3_markers
from devstack.kafka_nodes import kafka_nodes, kafka_status
from regions.mirror import down_mirror, mirror_status, up_mirror
from devstack.pgserver import down_own_postgres, up_own_postgres
from regions.replicator_process import down_replicator, replicator_status, up_replicator
from devstack.database import postgres_status
from devstack.s3 import s3_status


def up_region_b(settings: Settings, console: Console | None = None, mirror: bool | None = None) -> dict[str, Any]:
    """Bring up region B for region A's `settings`: its Kafka node, its own PostgreSQL server, its S3
    endpoint and bucket, the topic contract in its Kafka, then (unless `mirror` is False, default
    `settings.region_b_mirror`) MirrorMaker 2 from region A and the media replicator
    (`tapeline region replicate`, regions/replicator_process.py) that follows the mirrored log. Idempotent, like `up`; region A must
    answer for the mirror to start (it is read, never started here). No mirror while region B holds
    the job history; after a switch back to region A, region B's diverged log, projections and
    objects are reset first (`regions/rejoin.py` `rejoin_as_standby`, once per region epoch).

    Returns `region_b_status(settings)`. Raises StackError as `up` does (and see `up_mirror`).
    """
    target = settings.for_region("b")
    paths = home_paths(target)
    with locked(paths):
        up_services(target, paths, console, up_own_postgres, region="b")
        if settings.region_b_mirror if mirror is None else mirror:
            active = _active_region(settings)
            if active == "b":  # after a failover: mirroring A's log into B would mix A's writes into B's history
                say(console, "[bold]mirror[/]: not started: region b holds the job history (failed over); "
                              "region a rejoins as the standby instead (docs/regions.md \"Failback\")")
            elif _reset_needed(settings):  # region B held the job history since its last reset (a failback)
                from cli.wiring import RegionProcesses
                from regions.rejoin import rejoin_as_standby

                say(console, "[bold]region b[/]: held the job history since its last reset: reset as the "
                              "standby before the mirror starts (docs/regions.md \"Failback\")")
                rejoin_as_standby({"a": settings, "b": target}, "b", processes=RegionProcesses(), console=console,
                                  say=lambda line: say(console, f"[bold]rejoin b[/]: {line}"))
            else:
                up_mirror(settings, target, paths, console)
                up_replicator(target, paths, console)
    return region_b_status(settings)


def down_region_b(settings: Settings, console: Console | None = None) -> None:
    """Stop what `up_region_b` started for region A's `settings`: the mirror and the replicator first, then region B's
    Kafka, S3 and own PostgreSQL server, each only if this stack started it. Region A is untouched.

    Raises:
        StackError: `pg_ctl stop` failed.
    """
    target = settings.for_region("b")
    paths = home_paths(target)
    if not paths.home.is_dir():
        return
    with locked(paths):
        if supervisor.stop_detached(target):  # region B's processors, started by a failover
            say(console, "[bold]processors (region b)[/]: stopped")
        down_mirror(paths, console)
        down_replicator(paths, console)
        for name, pid_file, markers in ([("kafka (region b)", n.pid_file, n.markers) for n in kafka_nodes(target, paths)]
                                        + [("s3 (region b)", paths.s3_pid, s3_markers(target))]):
            stop_owned(pid_file, markers, name, console)
        update_state(paths, "kafka", None)
        update_state(paths, "s3", None)
        server = (read_state(paths).get("postgres") or {}).get("server")
        if server:
            down_own_postgres(paths, server, console)


def _reset_needed(settings: Settings) -> bool:
    """Whether region B must be reset before it mirrors region A again (`regions/rejoin.py`
    `needs_reset`): it held the job history since its last reset."""
    from regions.rejoin import needs_reset

    return needs_reset({"a": settings, "b": settings.for_region("b")}, "b")


def _active_region(settings: Settings) -> str:
    """The region that holds the job history, as the region epochs of the regions that answer say."""
    from regions.authority import read_regions

    return read_regions({"a": settings, "b": settings.for_region("b")}).authority.active


def region_b_status(settings: Settings) -> dict[str, Any]:
    """Region B's services for region A's `settings`, shaped like `status()`'s: `{"region": "b",
    "home", "kafka", "postgres", "s3", "mirror", "replicator"}` (`mirror_status`, `replicator_status`).
    Never raises for a down service."""
    target = settings.for_region("b")
    paths = home_paths(target)
    state = read_state(paths)
    return {"region": "b", "home": str(paths.home), "kafka": kafka_status(target, paths),
            "postgres": postgres_status(target, state.get("postgres") or {}), "s3": s3_status(target, paths), "mirror": mirror_status(target, paths, settings.region_b_mirror),
            "replicator": {**replicator_status(paths, "b"), "enabled": settings.region_b_mirror},
            "processors": {"up": supervisor.running_pid(target) is not None, "pid": supervisor.running_pid(target),
                           "log": str(target.home / "logs" / "run.log")}}


def region_a_standby_status(settings: Settings) -> dict[str, Any] | None:
    """The mirror (B -> A) and media replicator into region A whose files are under region A's home
    (`tapeline region rejoin a --as-standby`), shaped like `region_b_status`'s `mirror` and
    `replicator`: `{"mirror", "replicator", "standby"}` (`standby`: the reset recorded in A's stack
    state), or None when neither runs and region A is not a standby. Never raises for a down service."""
    from tapeline.home import read_state

    paths = home_paths(settings)
    standby = read_state(paths).get("standby")
    mirror = mirror_status(settings, paths, True)
    replicator = replicator_status(paths, "a")
    if not (mirror["up"] or replicator["up"]) and (not standby or _active_region(settings) == "a"):
        return None  # region A is not a standby (never was, or holds the job history again)
    return {"mirror": mirror, "replicator": {**replicator, "enabled": True}, "standby": standby}


__all__ = ["up_region_b", "down_region_b", "region_b_status", "region_a_standby_status", "StackError"]
