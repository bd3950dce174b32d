-- 023: the attempts view says what was seen and what was lost (issue 26 items 2 and 3).
--
-- error_class of a stalled attempt is named after its StallDetected kind, as the watchdog now
-- records it (domain/policy/retry.py STALL_ERROR_CLASSES): no_progress (the worker was alive, its
-- ffmpeg stopped advancing) is progress_stalled; lease_expired and worker_exited stay worker_lost.
-- wasted_s is net of reuse: an attempt that ended without finishing its stage wasted only the time
-- after its last checkpoint that a later attempt took over (a checkpoint whose object the job's
-- last successful transcode lists among its outputs); gross_wasted_s keeps the whole run and
-- reused_segments counts the checkpoints taken over. stage_durations sums the net figure.
-- Otherwise the view is migration 021's.

CREATE OR REPLACE VIEW attempts AS
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
               CASE WHEN x.event_type = 'StallDetected' AND x.payload->>'kind' = 'no_progress' THEN 'progress_stalled'
                    WHEN x.event_type = 'StallDetected' THEN 'worker_lost'
                    ELSE x.payload->>'error_class' END AS end_error_class
        FROM lifecycle_evidence x
        WHERE x.job_id = c.job_id AND x.topic = c.topic AND x.partition = c.partition AND x."offset" > c."offset"
          AND x.applied
          AND ((x.claim_token = c.claim_token AND x.stage = c.stage AND x.attempt = c.attempt
                AND x.event_type IN ('AttemptSucceeded', 'AttemptFailed', 'AttemptYielded'))
               OR (x.event_type = 'StallDetected' AND x.stage = c.stage AND x.attempt = c.attempt
                   AND x.payload->>'kind' IN ('lease_expired', 'no_progress', 'worker_exited'))
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
            ELSE greatest(0.0, EXTRACT(EPOCH FROM d.ended_at - greatest(d.started_at, r.kept_until)))::double precision
       END AS wasted_s,
       d.partition AS log_partition, d."offset" AS claim_offset,
       CASE WHEN d.outcome = 'succeeded' THEN 0.0
            WHEN d.outcome = 'running' THEN NULL
            ELSE EXTRACT(EPOCH FROM d.ended_at - d.started_at)::double precision END AS gross_wasted_s,
       coalesce(r.reused_segments, 0) AS reused_segments
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
) h ON true
LEFT JOIN LATERAL (
    -- Checkpoints of this attempt that the job's last successful transcode took as its own outputs.
    SELECT count(*) AS reused_segments, max(x.broker_ts) AS kept_until
    FROM lifecycle_evidence x
    JOIN job_state j ON j.job_id = x.job_id
    WHERE x.job_id = d.job_id AND x.claim_token = d.claim_token AND x.stage = d.stage AND x.attempt = d.attempt
      AND x.event_type = 'CheckpointRecorded' AND x.applied AND NOT x.duplicate
      AND d.outcome NOT IN ('succeeded', 'running')
      AND EXISTS (SELECT 1 FROM jsonb_array_elements(coalesce(j.outputs, '[]'::jsonb)) o
                  WHERE o->>'key' = x.payload->>'object_key')
) r ON true;

COMMENT ON COLUMN attempts.error_class IS 'Error class when the outcome is failed or stalled: the failure''s own, or for a stall progress_stalled (no_progress) or worker_lost (lease_expired, worker_exited)';
COMMENT ON COLUMN attempts.wasted_s IS 'Seconds of the attempt thrown away: 0 when it succeeded, NULL while running, else the time after its last checkpoint that a later attempt reused (the whole run when none was)';
COMMENT ON COLUMN attempts.gross_wasted_s IS 'The whole run of an attempt that did not finish its stage, seconds, reuse not subtracted';
COMMENT ON COLUMN attempts.reused_segments IS 'Checkpoints of this attempt that a later successful transcode took as its outputs';
