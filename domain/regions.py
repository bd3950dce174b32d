"""Which region holds the job history, and what a failover does to the attempts it finds. Pure.

Regions and epochs (docs/regions.md "Failover"): region `a` holds the job history at epoch 0 without
any record. `tapeline region failover --to R` writes a `RegionFailedOver` with the next epoch to the
`<prefix>.regions` topic of every region that answers; the record with the highest epoch names the
active region. A processor runs only in the active region: one that finds a higher epoch naming
another region stops and writes nothing (`fence_reason`).

Uploads follow the same rule (`intake_refusal`): a region that is not the active one refuses them
before a byte is stored (HTTP 503 `region_fenced` from `tapeline serve`'s intake, exit code 3 from
`tapeline submit`), naming the active region and its intake's address, so no upload is parked in a
log that no longer reaches the active region.

An attempt that was running in the region left behind is lost with it, not by its work: the failover
judges it as a stall of its own kind, `region_lost` (`region_lost_row`), which `processors/watchdog.py`
`run_once` retries at once and which gives its attempt back (`lifecycle.FREE_STALL_KINDS`).

Every job in flight at the failover (`DELAYED_STATES`) is delayed by it, and its submitter is told
once (`delayed_event`: a `JobDelayed` per job and epoch, which the notifier sends as `job.delayed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Mapping

from domain import events as ev
from domain.policy.admission import Refusal
from domain.policy.stall import stalled_row

REGIONS: tuple[str, ...] = ("a", "b")
"""The regions Tapeline knows (`Settings.for_region`)."""

FIRST_ACTIVE = "a"
"""The region that holds the job history at epoch 0, before any failover."""

REGION_EVENT_KEY = "region"
"""The envelope `job_id` and `stage` of a `RegionFailedOver`, and its record key."""


@dataclass(frozen=True)
class Authority:
    """Which region holds the job history: `active` from region epoch `epoch` on, made so by
    `record` (None at epoch 0: no failover yet)."""

    active: str
    epoch: int
    record: ev.RegionFailedOver | None = None


def authority(records: Iterable[ev.RegionFailedOver]) -> Authority:
    """The authority the records say: the one with the highest epoch (on a tie, the later
    `occurred_at`: two failovers that raced from both sides; the later one's operator saw the other's
    region still answering or not at all), else region `a` at epoch 0."""
    best: ev.RegionFailedOver | None = None
    for record in records:
        if best is None or (record.epoch, record.occurred_at) > (best.epoch, best.occurred_at):
            best = record
    if best is None:
        return Authority(FIRST_ACTIVE, 0)
    return Authority(best.to_region, best.epoch, best)


def fence_reason(region: str, current: Authority) -> str | None:
    """Why processors of `region` must not write, or None when `region` is the active one. The
    reason names who took over, when, by whom and why, and what to do (rejoin as the standby)."""
    if current.active == region:
        return None
    record = current.record
    if record is None:  # epoch 0: region a is active; any other region is the standby
        return (f"region {region} is the standby: region {current.active} holds the job history "
                f"(no failover recorded); start region {region}'s processors only after "
                f"`tapeline region failover --to {region}`")
    return (f"region {region} is fenced: region {record.to_region} took over the job history at region epoch "
            f"{record.epoch} ({record.occurred_at:%Y-%m-%d %H:%M:%S} UTC, by {record.operator}: {record.reason}); "
            f"its processors write nothing. To bring region {region} back, rejoin it as the standby "
            f"(docs/regions.md \"Failback\")")


INTAKE_FENCED_ERROR = "region_fenced"
"""The `error` of the intake's refusal while its region is not the active one (`intake_refusal`)."""


def intake_refusal(region: str, current: Authority, intake_urls: Mapping[str, str],
                   retry_after_s: int) -> Refusal | None:
    """Whether an upload may be accepted in `region` (None: yes) or the refusal: HTTP 503, error
    `region_fenced`, `retry_after_s` (whole seconds, the `Retry-After`) and a JSON body
    `{error, reason, retry_after_s, region, active_region, epoch, failover_id, upload_to}`.

    `current` is the authority the region epochs say (`authority`); `intake_urls` maps a region
    name to the base URL of its HTTP intake as clients reach it (`Settings.intake_address`, e.g.
    `{"a": "https://a.example", "b": "https://b.example"}`). `upload_to` is the active region's
    `<base>/uploads`, None when `intake_urls` does not know it; `failover_id` is the fence record's
    `correlation_id` (None at epoch 0, when `region` is the standby before any failover). The rule is
    `fence_reason`'s: only the active region takes uploads. Pure."""
    if current.active == region:
        return None
    base = intake_urls.get(current.active)
    upload_to = f"{base.rstrip('/')}/uploads" if base else None
    where = (f"send uploads to region {current.active}: {upload_to}" if upload_to
             else f"send uploads to region {current.active}'s intake")
    record = current.record
    if record is None:
        reason = (f"region {region} is the standby: region {current.active} holds the job history (no failover "
                  f"recorded); {where}")
    else:
        reason = (f"region {region} is fenced: failover {record.correlation_id} made region {record.to_region} the "
                  f"active region at region epoch {record.epoch} ({record.occurred_at:%Y-%m-%d %H:%M:%S} UTC); {where}")
    return Refusal(503, INTAKE_FENCED_ERROR, reason, retry_after_s, details=(
        ("region", region), ("active_region", current.active), ("epoch", current.epoch),
        ("failover_id", record.correlation_id if record is not None else None), ("upload_to", upload_to)))


def failover_event(current: Authority, to_region: str, *, reason: str, operator: str, planned: bool,
                   recorded_by: str, failover_id: str, stamp: ev.Stamp) -> ev.RegionFailedOver:
    """The `RegionFailedOver` that makes `to_region` active at the next epoch after `current`.
    Raises ValueError for an unknown region or an empty reason."""
    if to_region not in REGIONS:
        raise ValueError(f"unknown region {to_region!r}: Tapeline knows regions {', '.join(REGIONS)}")
    if not reason.strip():
        raise ValueError("a failover needs a reason (--why)")
    epoch = current.epoch + 1
    return ev.RegionFailedOver.new(stamp, job_id=REGION_EVENT_KEY, stage=REGION_EVENT_KEY, attempt=epoch,
                                   recorded_by=recorded_by, correlation_id=failover_id,
                                   from_region=current.active, to_region=to_region, epoch=epoch,
                                   reason=reason.strip(), operator=operator, planned=planned)


def region_lost_row(job: dict[str, Any], failover: ev.RegionFailedOver, now: datetime) -> dict[str, Any] | None:
    """The stalled-attempt row (`stalled_attempts` shape, kind `region_lost`) that `run_once` judges
    for a job whose attempt was running when its region was lost, or None when the job is not running.
    `since_s`: seconds from the attempt's last progress (else last heartbeat) to `now`, 0 without."""
    if job.get("state") != "running":
        return None
    return stalled_row(job, "region_lost", f"attempt ran in region {failover.from_region}, lost with it: failover to "
                                           f"region {failover.to_region} at epoch {failover.epoch}", now)


DELAYED_STATES: tuple[str, ...] = ("accepted", "queued", "running", "retry_scheduled")
"""The states of a job in flight: a failover delays it. A job ended, or waiting for a person
(dead_lettered, needs_review), is not delayed by the region's change and is not told."""


def delayed_event(job: Mapping[str, Any], failover: ev.RegionFailedOver, *, recorded_by: str,
                  stamp: ev.Stamp) -> ev.JobDelayed | None:
    """The `JobDelayed` that tells the submitter of `job` (a `job_state` row of the target region's
    projection) that `failover` delayed it, or None when the job is not in flight (`DELAYED_STATES`).
    Stage `region`, attempt = the failover's epoch: one dedup key per job and epoch, so running the
    same failover again adds no second notification (the projection drops the duplicate)."""
    if job.get("state") not in DELAYED_STATES:
        return None
    why = failover.reason.strip()
    reason = (f"region {failover.from_region} was left for region {failover.to_region} "
              f"({'planned switch' if failover.planned else 'outage'}{': ' + why if why else ''}); "
              f"the job goes on in region {failover.to_region} from its last checkpoint")
    return ev.JobDelayed.new(stamp, job_id=str(job["job_id"]), stage=REGION_EVENT_KEY, attempt=failover.epoch,
                             recorded_by=recorded_by, correlation_id=failover.correlation_id,
                             causation_id=failover.event_id, reason=reason, serving_region=failover.to_region,
                             from_region=failover.from_region, epoch=failover.epoch, state=str(job["state"]))
