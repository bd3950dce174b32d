-- 029: a StallDetected of kind region_lost (`tapeline region failover`: the attempt ran in the region
-- that was lost) ends its attempt in the attempts view like any other stall, with the error class
-- region_lost (domain/policy/retry.py STALL_ERROR_CLASSES). The view is 024's with that one kind added.

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
                WHEN e.end_event = 'AttemptFailed' THEN 'failed'
                WHEN e.end_event = 'AttemptYielded' THEN 'yielded'
                WHEN e.end_event = 'StallDetected' THEN 'stalled'
                WHEN e.end_event = 'AttemptStarted' THEN 'superseded'
                ELSE e.end_outcome  -- an event that ends the job: lifecycle_ending_events
           END AS outcome
    FROM claims c
    LEFT JOIN LATERAL (
        SELECT x.event_type AS end_event, x.broker_ts AS ended_at,
               CASE WHEN x.event_type = 'StallDetected' AND x.payload->>'kind' = 'no_progress' THEN 'progress_stalled'
                    WHEN x.event_type = 'StallDetected' AND x.payload->>'kind' = 'region_lost' THEN 'region_lost'
                    WHEN x.event_type = 'StallDetected' THEN 'worker_lost'
                    ELSE x.payload->>'error_class' END AS end_error_class,
               ending.attempt_outcome AS end_outcome
        FROM lifecycle_evidence x
        LEFT JOIN lifecycle_ending_events ending
               ON ending.event_type = x.event_type AND ending.attempt_outcome IS NOT NULL
        WHERE x.job_id = c.job_id AND x.topic = c.topic AND x.partition = c.partition AND x."offset" > c."offset"
          AND x.applied
          AND ((x.claim_token = c.claim_token AND x.stage = c.stage AND x.attempt = c.attempt
                AND x.event_type IN ('AttemptSucceeded', 'AttemptFailed', 'AttemptYielded'))
               OR (x.event_type = 'StallDetected' AND x.stage = c.stage AND x.attempt = c.attempt
                   AND x.payload->>'kind' IN ('lease_expired', 'no_progress', 'worker_exited', 'region_lost'))
               OR (x.event_type = 'AttemptStarted' AND x.claim_token IS DISTINCT FROM c.claim_token)
               OR ending.event_type IS NOT NULL)
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

COMMENT ON COLUMN attempts.outcome IS 'succeeded|failed|yielded|stalled|superseded (fenced: a newer attempt took over, or the claim was never current)|running, or the attempt_outcome of the event that ended the job (lifecycle_ending_events: failed, cancelled, needs_review)';
COMMENT ON COLUMN attempts.error_class IS 'Error class when the outcome is failed or stalled: the failure''s own, or for a stall progress_stalled (no_progress), region_lost (region_lost: lost with its region in a failover) or worker_lost (lease_expired, worker_exited)';
