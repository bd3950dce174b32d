"""`tapeline region rejoin R --as-standby`: make region R an empty standby of the active region
(docs/regions.md "Failback", issue 25 item 6).

A region that held the job history and was failed over from has a log, projections and a bucket of
its own that diverged from the active region's: records written after the last one the mirror
copied, attempts that were lost with it, uploads it accepted that never reached the other region.
It cannot be mirrored into as it is (identity names: its own records would stay mixed with the
copies). `rejoin_as_standby` resets it, then mirrors the active region into it:

1. `checked`: the region epochs say another region holds the job history (else `RejoinRefused`:
   nothing changed); both regions' Kafka, and R's PostgreSQL and S3, answer.
2. `stopped`: R's processors (the detached `run --role all`, fenced anyway), any mirror and media
   replicator into R, and any into the active region (a mirror from R would copy R's diverged writes
   into the history).
3. `objects_set_aside`: every object R's old log names that the active region's log does not name
   with the same sha256 (R's writes that never reached the active region, and R's copies whose key
   the active region wrote with other bytes) is moved under `orphans/region-<R>/epoch-<E>/<key>` in
   R's bucket (server-side copy, then delete), listed in `<R home>/rejoin/epoch-<E>.json`. Nothing
   is deleted for good: an operator decides (an upload R accepted and never mirrored is there). The
   keys the active region's log names are then written only by the replicator's conditional put.
4. `log_reset`: R's contract topics (every mirrored topic) and the mirror's internal topics of the
   flow into R are deleted, and so are the deployment's consumer groups in R; the topics are created
   again (R's own configs); the active region's region records are copied into R's `<prefix>.regions`
   (which is kept: it holds the fence).
5. `projections_reset`: every table of R's schema derived from the log is truncated (`KEPT_TABLES`
   stay: the migration ledger, policies, registrations, coordination state), then
   migrated (a no-op unless the code moved on). R's database is the deployment's database, not the
   server's: other databases and schemas on it are untouched.
6. `mirror_started`, `replicator_started`: MirrorMaker 2 active -> R and the media replicator into R,
   their files under R's home (`regions/mirror.py`, `regions/replicator_process.py`).

Each step is idempotent: a rejoin run again (after a crash, or on a standby already rejoined) does
the same again and ends in the same state. `R`'s stack state records the epoch it was reset at
(`standby`), so `tapeline stack up --region b` resets region B only when B held the job history
since its last reset (`needs_reset`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import structlog

from domain.errors import TapelineError
from domain.regions import FIRST_ACTIVE
from regions.processes import Processes
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.standby")

ORPHANS_PREFIX = "orphans"
"""Where a rejoining region's diverged objects are moved: `orphans/region-<R>/epoch-<E>/<key>`."""


KEPT_TABLES: tuple[str, ...] = (
    "schema_migrations",  # the migration ledger
    "stall_policy", "stage_stall_policy",  # policies the watchdog writes from its settings (a migration seeds one row)
    "lifecycle_states", "lifecycle_ending_events",  # reference data of schemas/lifecycle.json (migrate re-syncs it)
    "webhook_endpoints",  # registrations (`tapeline webhooks add`), not a projection of the log
    "intake_uploads",  # the HTTP intake's idempotency keys: a retried POST must still find its upload
    "provider_calls",  # provider call reservations (quotas): forgetting one could post past a quota
)
"""Tables of the deployment's schema a standby's reset keeps: not projections of the log (their
comments in projections/sql/migrations say so). Every other table is derived from the log and emptied."""


class RejoinRefused(TapelineError):
    """The region cannot rejoin as the standby now (it holds the job history, or a region does not
    answer); nothing was changed. The message says why and what to do."""


@dataclass
class RejoinReport:
    """What a rejoin did: the regions, the epoch it reset at, each step's seconds from its start, the
    objects set aside (`[{key, moved_to, reason}]`), the topics and tables reset."""

    region: str
    active: str
    epoch: int
    steps: dict[str, float] = field(default_factory=dict)
    set_aside: list[dict[str, Any]] = field(default_factory=list)
    topics_reset: list[str] = field(default_factory=list)
    tables_reset: list[str] = field(default_factory=list)
    records_copied: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"region": self.region, "active": self.active, "epoch": self.epoch,
                "steps_s": {name: round(s, 3) for name, s in self.steps.items()},
                "set_aside": self.set_aside, "topics_reset": self.topics_reset,
                "tables_reset": self.tables_reset, "records_copied": self.records_copied}


def needs_reset(regions: dict[str, Settings], name: str) -> bool:
    """Whether region `name`, a standby now, may hold a log of its own that diverged: it held the job
    history at some epoch (region a at epoch 0; any region a `RegionFailedOver` names) and its stack
    state records no reset at the current epoch. False while `name` is the active region."""
    from regions.authority import read_regions
    from tapeline.home import home_paths, read_state

    view = read_regions(regions)
    current = view.authority
    if current.active == name:
        return False
    records = [r for rs in view.records.values() for r in rs]
    held = name == FIRST_ACTIVE or any(r.to_region == name for r in records)
    reset_at = (read_state(home_paths(regions[name])).get("standby") or {}).get("reset_at_epoch")
    return held and reset_at != current.epoch


def rejoin_as_standby(regions: dict[str, Settings], name: str, *, processes: Processes,
                      start_replication: bool = True, say: Callable[[str], None] = lambda _line: None,
                      console: Any = None) -> RejoinReport:
    """Reset region `name` and make it the standby of the active region (the module's steps).
    `regions`: `{"a": region A's settings, "b": region B's}`; `processes`: the roof's control of the
    region's background processors (`regions/processes.py`). `say` gets one line per step; `console`
    (rich) gets the mirror's and replicator's start lines. The caller holds `name`'s stack lock when
    it needs one (`tapeline stack up --region b` does).

    Raises `RejoinRefused` when `name` holds the job history or a region does not answer (nothing
    changed), `ValueError` for an unknown region, `StackError` when the mirror or the replicator
    does not start (the reset is done; run again)."""
    from regions.authority import read_regions

    if name not in regions:
        raise ValueError(f"unknown region {name!r}: {', '.join(regions)}")
    started = time.monotonic()
    standby = regions[name]
    view = read_regions(regions)
    current = view.authority
    if current.active == name:
        raise RejoinRefused(f"region {name} holds the job history (epoch {current.epoch}); only a region another "
                            f"region took over from rejoins as the standby. To move the history, "
                            f"`tapeline region failover --to <region> --why ...` first")
    active = regions[current.active]
    if view.unreachable:
        raise RejoinRefused(f"region(s) {', '.join(view.unreachable)} do not answer: a rejoin reads both regions' logs "
                            "(start them: `tapeline stack up [--region b]`)")
    _check_services(standby)
    report = RejoinReport(name, current.active, current.epoch)

    def step(key: str, line: str) -> None:
        report.steps[key] = time.monotonic() - started
        say(f"{report.steps[key]:7.2f} s  {line}")

    step("checked", f"region {current.active} holds the job history (epoch {current.epoch}); region {name} "
                    "answers and rejoins as its standby")
    _stop_everything_of(processes, regions, name, current.active)
    step("stopped", f"region {name}'s processors, the mirrors and media replicators of both directions stopped")
    report.set_aside = set_aside_diverged_objects(standby, active, current.epoch)
    step("objects_set_aside", f"{len(report.set_aside)} object(s) of region {name} that region {current.active}'s "
                              f"log does not name set aside under {ORPHANS_PREFIX}/region-{name}/epoch-{current.epoch}/")
    report.topics_reset, report.records_copied = reset_log(standby, active)
    step("log_reset", f"{len(report.topics_reset)} topics of region {name} deleted and created again; "
                      f"{report.records_copied} region record(s) copied from region {current.active}")
    report.tables_reset = reset_projections(standby)
    step("projections_reset", f"{len(report.tables_reset)} tables of region {name}'s schema {standby.db_schema!r} "
                              "emptied")
    from tapeline.home import home_paths, update_state

    paths = home_paths(standby)
    update_state(paths, "standby", {"reset_at_epoch": current.epoch, "active": current.active,
                                     "reset_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                     "set_aside": len(report.set_aside)})
    _write_report(standby, report)
    if start_replication:
        from regions.mirror import up_mirror
        from regions.replicator_process import up_replicator

        up_mirror(active, standby, paths, console)
        step("mirror_started", f"MirrorMaker 2 {current.active} -> {name} running (files under {paths.mirror})")
        up_replicator(standby, paths, console)
        step("replicator_started", f"media replicator {current.active} -> {name} following region {name}'s log")
    return report


def _check_services(standby: Settings) -> None:
    """Region `standby`'s Kafka, PostgreSQL and S3 answer; else RejoinRefused."""
    from regions.authority import unanswered

    why = unanswered(standby, s3=True)
    if why is not None:
        raise RejoinRefused(why)


def _stop_everything_of(processes: Processes, regions: dict[str, Settings], name: str, active: str) -> None:
    """Stop `name`'s detached processors and the mirror and replicator of both directions (their
    files under each region's home). Each only if it runs."""
    from tapeline.home import home_paths
    from regions.mirror import down_mirror
    from regions.replicator_process import down_replicator

    if processes.stop_all(regions[name]):
        log.warning("the rejoining region's processors were running; stopped", region=name)
    for region in (name, active):
        paths = home_paths(regions[region])
        down_mirror(paths, None)
        down_replicator(paths, None)


def _named_in_log(settings: Settings, timeout_s: float = 120.0) -> dict[str, str | None]:
    """`{key: sha256 or None}` of every object the region's lifecycle and uploads topics name
    (`domain/replication.py` `objects_named`, committed records only, read to their ends). A sha256
    named twice differently keeps the later one. Raises ServiceUnavailable when not read within
    `timeout_s`; an absent topic names nothing."""
    from domain.errors import ServiceUnavailable
    from regions.replicator import named_in
    from tapeline import kafka_scan

    consumer = kafka_scan.committed_reader(settings, "standby-read")
    named: dict[str, str | None] = {}
    try:
        existing = kafka_scan.existing_topics(consumer, 10)
        ranges = kafka_scan.bounds(consumer, [t for t in (settings.jobs_topic, settings.uploads_topic) if t in existing]
                                   ).ranges()

        def take(message: Any) -> bool:
            for obj in named_in(message)[1]:
                named[obj.key] = obj.sha256 or named.get(obj.key)
            return True

        if kafka_scan.scan(consumer, ranges, take, timeout_s) != set(ranges):
            raise ServiceUnavailable(f"region {settings.region}'s log not read within {timeout_s:g} s")
        return named
    finally:
        consumer.close()


def set_aside_diverged_objects(standby: Settings, active: Settings, epoch: int) -> list[dict[str, Any]]:
    """Move every object `standby`'s log names that `active`'s log names not at all (`orphan`: the
    standby's own writes that never reached the active region) or with another sha256 (`diverged`)
    under `orphans/region-<standby>/epoch-<epoch>/<key>` in the standby's bucket; returns
    `[{key, moved_to, reason}]`. Objects named with the same sha256 (or without one on either side:
    the replicator reads them back and compares) stay. An object the log names but the bucket does not
    hold is skipped. Scoped to what the deployment's own logs name: a shared bucket's other objects are
    never touched. Raises StorageError when the bucket does not answer."""
    from tapeline.objectstore import ObjectStore

    mine = _named_in_log(standby)
    if not mine:
        return []
    theirs = _named_in_log(active)
    store = ObjectStore(standby)
    moved = []
    for key, sha in sorted(mine.items()):
        if key.startswith(ORPHANS_PREFIX + "/"):
            continue
        if key in theirs and (sha is None or theirs[key] is None or theirs[key] == sha):
            continue
        if store.head(key) is None:
            continue
        target_key = f"{ORPHANS_PREFIX}/region-{standby.region}/epoch-{epoch}/{key}"
        # server-side copy; the object's metadata (its sha256) goes with it (S3's default directive)
        store.copy(key, target_key)
        store.delete(key)
        moved.append({"key": key, "moved_to": target_key, "reason": "orphan" if key not in theirs else "diverged"})
        log.info("object set aside", key=key, moved_to=target_key)
    return moved


def reset_log(standby: Settings, active: Settings, timeout_s: float = 60.0) -> tuple[list[str], int]:
    """Delete the standby's contract topics (every mirrored topic), the mirror's internal topics of
    the flow from `active` into it and the deployment's consumer groups (`<app>.` and the app name),
    create the contract topics again (`ensure_topics`: the standby's own configs; `<prefix>.regions`
    is kept), and copy `active`'s region records missing from the standby's `<prefix>.regions`.
    Returns (the topics deleted, the records copied). Raises StackError when a topic is not gone
    within `timeout_s` or cannot be created."""
    from regions.authority import read_region_records, write_region_record
    from tapeline.kafka_topics import delete_app_groups, delete_named_topics, ensure_topics
    from tapeline.home import StackError
    from regions.mirror import mirror_internal_topics, mirrored_topics

    for group, refused in delete_app_groups(standby).items():
        if refused is not None:  # a group with members (a processor left running elsewhere)
            log.warning("consumer group not deleted", group=group, error=refused)
    doomed = delete_named_topics(standby, mirrored_topics(standby) + mirror_internal_topics(active.region), timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:  # a topic deleted a moment ago may still be marked for deletion: TOPIC_ALREADY_EXISTS
        try:
            ensure_topics(standby)
            break
        except StackError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    own = {r.event_id for r in (read_region_records(standby) or [])}
    copied = 0
    for record in read_region_records(active) or []:
        if record.event_id not in own:
            write_region_record(standby, record)
            copied += 1
    return doomed, copied


def reset_projections(standby: Settings) -> list[str]:
    """Truncate every table of the standby's schema (`db_schema`) but `KEPT_TABLES` (the projections
    of its old log, the replicator's progress and objects, the projector's offsets), then migrate;
    returns the tables emptied. Other schemas and databases of the server are untouched.
    Raises ServiceUnavailable when its PostgreSQL does not answer."""
    from tapeline.postgres import connect, identifiers, migrate, q, qf

    migrate(standby.database_url, standby.db_schema, standby.reader_role)
    with connect(standby.database_url, schema=standby.db_schema, autocommit=True) as conn:
        tables = [row[0] for row in conn.execute(q("standby_tables"), {"schema": standby.db_schema,
                                                                         "kept": list(KEPT_TABLES)}).fetchall()]
        if tables:
            conn.execute(qf("standby_truncate", tables=identifiers(tables)))
    migrate(standby.database_url, standby.db_schema, standby.reader_role)
    return tables


def _write_report(standby: Settings, report: RejoinReport) -> None:
    """`<home>/rejoin/epoch-<E>.json`: the report, for the operator (the objects set aside above all)."""
    from pathlib import Path

    directory = Path(standby.home).resolve() / "rejoin"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"epoch-{report.epoch}.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
