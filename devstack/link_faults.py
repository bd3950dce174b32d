"""What the link-fault test (`tests/faults/test_network_partitions.py`) and benchmark
(`bench/partitions.py`) share: their timings and how they judge a stall on the committed log.

A stall written while links are slow and lossy is *justified* when the log's own timings call for
it (`justified`); anything else is a false stall. Nothing here runs in production."""

from __future__ import annotations

from domain import events as ev
from domain.codec import default_codec
from devstack.chaos import committed_messages
from tapeline.settings import Settings

PARTITION_TIMING = {"lease_s": 10.0, "heartbeat_interval_s": 1.0, "no_progress_timeout_s": 20.0,
                    "handoff_timeout_s": 15.0, "intake_timeout_s": 60.0, "tick_interval_s": 0.5,
                    "caught_up_timeout_s": 20.0, "x264_preset": "ultrafast", "transaction_timeout_ms": 6000,
                    "kafka_session_timeout_ms": 6000, "webhook_timeout_s": 3.0}
"""Seconds (and ms where named): a lease of 10 s and a no-progress timeout of 20 s, because these
runs put nine processes and a broker on a shared 2-core machine, where the fault tests' 4 s lease
made a working thumbnails attempt (load average 20) look stalled; the transaction and session
timeouts (6 s) stay below the lease, as Settings requires."""

Stamped = list[tuple[float, ev.Event]]
"""(broker time, epoch seconds; event) of committed lifecycle records, in log order."""


def stamped(settings: Settings) -> Stamped:
    """Every committed lifecycle record of `settings`'s log with its broker time."""
    codec = default_codec()
    return [(m.timestamp()[1] / 1000, ev.Event.from_record(codec.decode(m.value()))) for m in committed_messages(settings)]


def lease_gaps(events: Stamped, job_id: str) -> tuple[dict[tuple[str, int], float], list[ev.StallDetected]]:
    """({(stage, attempt): the longest stretch, seconds of broker time, between two records of that
    attempt from its AttemptStarted on, or from its last record to a StallDetected of it}, the job's
    StallDetected events). Pure."""
    mine = [(at, e) for at, e in events if e.job_id == job_id]
    stalls = [e for _, e in mine if isinstance(e, ev.StallDetected)]
    started = {(e.stage, e.attempt): at for at, e in mine if isinstance(e, ev.AttemptStarted)}
    times: dict[tuple[str, int], list[float]] = {}
    for at, e in mine:
        key = (e.stage, e.stalled_attempt) if isinstance(e, ev.StallDetected) else (e.stage, e.attempt)
        if key in started and at >= started[key]:  # from the claim on: a queue wait is no silence
            times.setdefault(key, []).append(at)
    gaps = {key: max((b - a for a, b in zip(sorted(t), sorted(t)[1:])), default=0.0) for key, t in times.items()}
    return gaps, stalls


def justified(stall: ev.StallDetected, events: Stamped, gaps: dict, settings: Settings) -> bool:
    """Whether the timings on the log justify `stall`: a `handoff` re-drive (it costs no attempt) by a
    queued stage unclaimed for `handoff_timeout_s` since its `StageQueued` (`domain/policy/stall.py`
    `handoff_redrive_due`); a `no_progress` stall by heartbeats whose counters (frames, seconds of
    output) had not moved for the stage's no-progress timeout (a CPU-starved ffmpeg is stalled by that
    rule, not by the link); any other kind by a silence of at least one lease from the attempt
    (`gaps`: `lease_gaps`). Pure."""
    at = next(t for t, e in events if e is stall)
    if stall.kind == "handoff":
        queued = [t for t, e in events if isinstance(e, ev.StageQueued) and e.job_id == stall.job_id
                  and e.stage == stall.stage and t <= at]
        return bool(queued) and at - max(queued) >= settings.handoff_timeout_s
    if stall.kind == "no_progress":
        mine = [(t, e) for t, e in events if e.job_id == stall.job_id and e.stage == stall.stage
                and getattr(e, "attempt", None) == stall.stalled_attempt and t <= at]
        moved = [t for t, e in mine if isinstance(e, ev.AttemptStarted)]
        last = (0, 0.0)  # the counters start at zero with the claim: a heartbeat of zeros is no move
        for t, e in mine:
            if isinstance(e, ev.Heartbeat) and (e.frames_done, e.out_time_s) != last:
                moved.append(t)
                last = (e.frames_done, e.out_time_s)
        timeout = settings.stall_thresholds(stall.stage).no_progress_timeout_s
        return bool(moved) and at - max(moved) >= timeout
    return gaps.get((stall.stage, stall.stalled_attempt), 0.0) >= settings.lease_s


def false_stalls(events: Stamped, job_id: str, settings: Settings) -> list[ev.StallDetected]:
    """The job's StallDetected events that `justified` does not justify. Pure."""
    gaps, stalls = lease_gaps(events, job_id)
    return [s for s in stalls if not justified(s, events, gaps, settings)]
