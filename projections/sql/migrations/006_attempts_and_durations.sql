-- 006: per-attempt and per-stage views, derived from lifecycle_evidence only (so a replay rebuilds
-- them for free and they can never disagree with the log). Every timestamp is broker time
-- (LogAppendTime) in UTC; durations are seconds. "Log order" of a job is the offset order of its
-- one partition of the lifecycle log.
--
-- An attempt is (job_id, stage, attempt). Its claim is its AttemptStarted (the applied copy, else
-- the first); its events are those carrying its claim token. It ends at the first event, after the
-- claim in log order, that the projection applied and that closes it:
--   its own AttemptSucceeded / AttemptFailed / AttemptYielded      -> succeeded / failed / yielded
--   a StallDetected (lease_expired | no_progress) about it          -> stalled
--   an AttemptStarted with another claim token (a newer attempt)    -> superseded
--   JobFailed / JobDeadLettered / JobCancelled / NeedsReview        -> failed / failed / cancelled / needs_review
-- A claim the projection never applied (it came after a newer attempt, or after the job ended) is
-- superseded at once. Nothing yet: running. Events of the attempt after its end (a zombie's late
-- heartbeats or success) stay superseded evidence and are counted in late_events.

CREATE VIEW attempts AS
WITH claims AS (
    SELECT DISTINCT ON (job_id, stage, attempt)
           topic, partition, "offset", job_id, stage, attempt, claim_token, applied,
           broker_ts AS started_at, payload->>'worker' AS worker,
           (payload->>'lease_s')::double precision AS lease_s
    FROM lifecycle_evidence
    WHERE event_type = 'AttemptStarted'
    ORDER BY job_id, stage, attempt, applied DESC, partition, "offset"
), ended AS (
    SELECT c.*, e.end_event, e.end_error_class,
           CASE WHEN c.applied THEN e.ended_at ELSE c.started_at END AS ended_at,
           CASE WHEN NOT c.applied THEN 'superseded'
                WHEN e.end_event IS NULL THEN 'running'
                WHEN e.end_event = 'AttemptSucceeded' THEN 'succeeded'
                WHEN e.end_event IN ('AttemptFailed', 'JobFailed', 'JobDeadLettered') THEN 'failed'
                WHEN e.end_event = 'AttemptYielded' THEN 'yielded'
                WHEN e.end_event = 'StallDetected' THEN 'stalled'
                WHEN e.end_event = 'AttemptStarted' THEN 'superseded'
                WHEN e.end_event = 'JobCancelled' THEN 'cancelled'
                WHEN e.end_event = 'NeedsReview' THEN 'needs_review'
           END AS outcome
    FROM claims c
    LEFT JOIN LATERAL (
        SELECT x.event_type AS end_event, x.broker_ts AS ended_at,
               CASE WHEN x.event_type = 'StallDetected' THEN 'worker_lost'
                    ELSE x.payload->>'error_class' END AS end_error_class
        FROM lifecycle_evidence x
        WHERE x.job_id = c.job_id AND x.topic = c.topic AND x.partition = c.partition AND x."offset" > c."offset"
          AND x.applied
          AND ((x.claim_token = c.claim_token AND x.stage = c.stage AND x.attempt = c.attempt
                AND x.event_type IN ('AttemptSucceeded', 'AttemptFailed', 'AttemptYielded'))
               OR (x.event_type = 'StallDetected' AND x.stage = c.stage AND x.attempt = c.attempt
                   AND x.payload->>'kind' IN ('lease_expired', 'no_progress'))
               OR (x.event_type = 'AttemptStarted' AND x.claim_token IS DISTINCT FROM c.claim_token)
               OR x.event_type IN ('JobFailed', 'JobDeadLettered', 'JobCancelled', 'NeedsReview'))
        ORDER BY x."offset"
        LIMIT 1
    ) e ON c.applied
)
SELECT d.job_id, d.stage, d.attempt, d.worker, d.claim_token, d.lease_s, d.started_at, d.ended_at, d.outcome,
       CASE WHEN d.outcome IN ('failed', 'stalled') THEN d.end_error_class END AS error_class,
       coalesce(k.heartbeats, 0) AS heartbeats,
       h.progress_frames, h.progress_out_time_s, h.last_heartbeat_at,
       coalesce(k.segments, 0) AS segments,
       coalesce(k.late_events, 0) AS late_events,
       greatest(d.started_at, k.last_event_at) AS last_event_at,
       EXTRACT(EPOCH FROM d.ended_at - d.started_at)::double precision AS duration_s,
       CASE WHEN d.outcome = 'succeeded' THEN 0.0
            WHEN d.outcome = 'running' THEN NULL
            ELSE EXTRACT(EPOCH FROM d.ended_at - d.started_at)::double precision END AS wasted_s,
       d.partition AS log_partition, d."offset" AS claim_offset
FROM ended d
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE x.event_type = 'Heartbeat' AND x.applied) AS heartbeats,
           count(*) FILTER (WHERE x.event_type = 'CheckpointRecorded' AND x.applied) AS segments,
           count(*) FILTER (WHERE x.superseded) AS late_events,
           max(x.broker_ts) AS last_event_at
    FROM lifecycle_evidence x
    WHERE x.job_id = d.job_id AND x.claim_token = d.claim_token AND x.stage = d.stage AND x.attempt = d.attempt
      AND NOT x.duplicate
) k ON true
LEFT JOIN LATERAL (
    SELECT (x.payload->>'frames_done')::bigint AS progress_frames,
           (x.payload->>'out_time_s')::double precision AS progress_out_time_s,
           x.broker_ts AS last_heartbeat_at
    FROM lifecycle_evidence x
    WHERE x.job_id = d.job_id AND x.claim_token = d.claim_token AND x.stage = d.stage AND x.attempt = d.attempt
      AND x.event_type = 'Heartbeat' AND x.applied
    ORDER BY x."offset" DESC
    LIMIT 1
) h ON true;

COMMENT ON VIEW attempts IS 'One row per attempt (job_id, stage, attempt), derived from lifecycle_evidence: who ran it, when, how it ended and how much work was thrown away. Broker time, UTC; seconds';
COMMENT ON COLUMN attempts.job_id IS 'Job the attempt belongs to';
COMMENT ON COLUMN attempts.stage IS 'transcode|publish';
COMMENT ON COLUMN attempts.attempt IS 'Attempt number of the stage, 1-based';
COMMENT ON COLUMN attempts.worker IS 'Worker (role@instance) that claimed it, from AttemptStarted';
COMMENT ON COLUMN attempts.claim_token IS 'Claim token of its AttemptStarted (the applied copy when there are several)';
COMMENT ON COLUMN attempts.lease_s IS 'Lease length the claim asked for, seconds';
COMMENT ON COLUMN attempts.started_at IS 'Broker time of the claim (AttemptStarted), UTC';
COMMENT ON COLUMN attempts.ended_at IS 'Broker time of the first applied event that closed it (see outcome), UTC; = started_at for a claim never applied; NULL while running';
COMMENT ON COLUMN attempts.outcome IS 'succeeded|failed|yielded|stalled|superseded (fenced: a newer attempt took over, or the claim was never current)|cancelled|needs_review|running';
COMMENT ON COLUMN attempts.error_class IS 'docs/design.md error class when outcome is failed (from AttemptFailed or the job''s terminal event) or stalled (worker_lost); NULL otherwise';
COMMENT ON COLUMN attempts.heartbeats IS 'Heartbeats of this attempt that the projection applied (each renewed the lease)';
COMMENT ON COLUMN attempts.progress_frames IS 'frames_done of its last applied heartbeat (ffmpeg -progress); NULL without heartbeats';
COMMENT ON COLUMN attempts.progress_out_time_s IS 'Media seconds encoded at its last applied heartbeat; NULL without heartbeats';
COMMENT ON COLUMN attempts.last_heartbeat_at IS 'Broker time of its last applied heartbeat, UTC; NULL without heartbeats';
COMMENT ON COLUMN attempts.segments IS 'CheckpointRecorded events of this attempt that the projection applied (segments it saved)';
COMMENT ON COLUMN attempts.late_events IS 'Events with its claim token the projection rejected as superseded (a zombie writing after it was fenced)';
COMMENT ON COLUMN attempts.last_event_at IS 'Broker time of the last event carrying its claim token, late ones included (>= started_at), UTC';
COMMENT ON COLUMN attempts.duration_s IS 'ended_at - started_at, seconds; NULL while running';
COMMENT ON COLUMN attempts.wasted_s IS 'Seconds of work whose result was thrown away: 0 when succeeded, ended_at - started_at otherwise (checkpointed segments a successor reuses are not subtracted), NULL while running';
COMMENT ON COLUMN attempts.log_partition IS 'Partition of the lifecycle log holding the job';
COMMENT ON COLUMN attempts.claim_offset IS 'Offset of the claim (AttemptStarted) in that partition';

-- Per job and stage: how long it waited for a worker, how long it ran, how many attempts it took.
-- Stages with a StageQueued only (transcode, publish); intake is one step with no queue.
CREATE VIEW stage_durations AS
WITH queued AS (
    SELECT job_id, stage, min(broker_ts) AS queued_at, count(*) AS times_queued
    FROM lifecycle_evidence
    WHERE event_type = 'StageQueued' AND applied
    GROUP BY job_id, stage
), runs AS (
    SELECT job_id, stage, min(started_at) AS first_started_at, count(*) AS attempts,
           sum(duration_s) AS run_s, sum(wasted_s) AS wasted_s,
           min(ended_at) FILTER (WHERE outcome = 'succeeded') AS succeeded_at
    FROM attempts
    GROUP BY job_id, stage
)
SELECT q.job_id, q.stage, q.queued_at, r.first_started_at, r.succeeded_at,
       EXTRACT(EPOCH FROM r.first_started_at - q.queued_at)::double precision AS queue_wait_s,
       coalesce(r.run_s, 0.0) AS run_s,
       coalesce(r.wasted_s, 0.0) AS wasted_s,
       EXTRACT(EPOCH FROM r.succeeded_at - q.queued_at)::double precision AS total_s,
       coalesce(r.attempts, 0) AS attempts,
       q.times_queued
FROM queued q
LEFT JOIN runs r ON r.job_id = q.job_id AND r.stage = q.stage;

COMMENT ON VIEW stage_durations IS 'One row per job and queued stage (transcode, publish): queue wait, run time, attempts. Broker time, UTC; seconds';
COMMENT ON COLUMN stage_durations.job_id IS 'Job';
COMMENT ON COLUMN stage_durations.stage IS 'transcode|publish';
COMMENT ON COLUMN stage_durations.queued_at IS 'Broker time of the stage''s first applied StageQueued, UTC';
COMMENT ON COLUMN stage_durations.first_started_at IS 'Broker time of the stage''s first claim (AttemptStarted), UTC; NULL while never claimed';
COMMENT ON COLUMN stage_durations.succeeded_at IS 'Broker time of the AttemptSucceeded that completed the stage, UTC; NULL until then';
COMMENT ON COLUMN stage_durations.queue_wait_s IS 'first_started_at - queued_at, seconds: how long the first attempt waited for a worker';
COMMENT ON COLUMN stage_durations.run_s IS 'Sum of duration_s of the stage''s ended attempts, seconds of worker time (0 before any attempt ended)';
COMMENT ON COLUMN stage_durations.wasted_s IS 'Sum of wasted_s of the stage''s attempts, seconds of work thrown away';
COMMENT ON COLUMN stage_durations.total_s IS 'succeeded_at - queued_at, seconds from first queued to done, retries and backoff included; NULL until succeeded';
COMMENT ON COLUMN stage_durations.attempts IS 'Attempts claimed for the stage (rows in attempts)';
COMMENT ON COLUMN stage_durations.times_queued IS 'Applied StageQueued events of the stage (1 + retries and yields)';

-- Read access: 010 grants every table of a fresh schema to tapeline_reader (and sets default
-- privileges); a schema migrated before this file gets the grant here, when the role exists.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'tapeline_reader') THEN
        GRANT SELECT ON attempts, stage_durations TO tapeline_reader;
    END IF;
END
$$;
