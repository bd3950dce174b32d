-- 032 (issue 45): an attempt is seen before the watchdog's verdict, a verdict stays in sight after it,
-- and a stall carries what the worker last saw of its tool.
--   suspect_attempts: running attempts not stalled yet whose progress counters (or heartbeats) have
--     been still for more than stall_policy.suspect_fraction of their allowance (domain/policy/stall.py
--     attempt_suspect decides; this view pre-selects the same rows);
--   recent_attempt_stalls: every judged attempt stall with what was done about it (the retry or the
--     dead letter that came in the same transaction) and the job's state now; the readers keep those
--     younger than TAPELINE_RECENT_STALLS_S (query recent_attempt_stalls);
--   stalled_attempts gains tool_state: the ToolState of the attempt's last heartbeat, which the
--     watchdog copies into its StallDetected.

ALTER TABLE stall_policy ADD COLUMN suspect_fraction double precision NOT NULL DEFAULT 0.5;
COMMENT ON COLUMN stall_policy.suspect_fraction IS 'Fraction of an attempt''s no-progress allowance (or lease) after which a still attempt is suspect (view suspect_attempts), before the verdict';

CREATE OR REPLACE VIEW stalled_attempts AS
SELECT j.job_id, j.stage, j.attempt, j.yields, j.claim_token, j.worker, j.log_partition,
       c.now AS log_now,
       CASE WHEN j.leased_until < c.now THEN 'lease_expired' ELSE 'no_progress' END AS kind,
       j.leased_until, j.last_heartbeat_at, j.progress_at AS last_progress_at, j.progress_frames,
       j.progress_out_time_s,
       EXTRACT(EPOCH FROM c.now - CASE WHEN j.leased_until < c.now THEN j.last_heartbeat_at ELSE j.progress_at END)::double precision AS since_s,
       h.tool_state
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
LEFT JOIN stage_stall_policy s ON s.stage = j.stage
LEFT JOIN LATERAL (
    SELECT x.payload->'tool_state' AS tool_state
    FROM lifecycle_evidence x
    WHERE x.job_id = j.job_id AND x.claim_token = j.claim_token AND x.stage = j.stage AND x.attempt = j.attempt
      AND x.event_type = 'Heartbeat' AND x.applied
    ORDER BY x.broker_ts DESC, x."offset" DESC
    LIMIT 1
) h ON true
WHERE j.state = 'running'
  AND (j.leased_until < c.now
       OR j.progress_at + make_interval(secs => COALESCE(s.no_progress_timeout_s, p.no_progress_timeout_s)
                                               + COALESCE(j.progress_grace_s, 0)) < c.now);
COMMENT ON COLUMN stalled_attempts.tool_state IS 'The tool_state (ToolState: process state, CPU seconds over a window, last progress line, last stderr lines) of the attempt''s last heartbeat; NULL when none carried one';

CREATE VIEW suspect_attempts AS
SELECT j.job_id, j.stage, j.attempt, j.worker, j.log_partition, c.now AS log_now,
       j.leased_until, j.last_heartbeat_at, j.progress_at AS last_progress_at, j.progress_frames,
       j.progress_out_time_s, j.progress_grace_s,
       COALESCE(s.no_progress_timeout_s, p.no_progress_timeout_s) AS no_progress_timeout_s,
       p.suspect_fraction,
       h.tool_state
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
LEFT JOIN stage_stall_policy s ON s.stage = j.stage
LEFT JOIN LATERAL (
    SELECT x.payload->'tool_state' AS tool_state
    FROM lifecycle_evidence x
    WHERE x.job_id = j.job_id AND x.claim_token = j.claim_token AND x.stage = j.stage AND x.attempt = j.attempt
      AND x.event_type = 'Heartbeat' AND x.applied
    ORDER BY x.broker_ts DESC, x."offset" DESC
    LIMIT 1
) h ON true
WHERE j.state = 'running'
  AND NOT COALESCE(j.leased_until < c.now, false)
  AND NOT COALESCE(j.progress_at + make_interval(secs => COALESCE(s.no_progress_timeout_s, p.no_progress_timeout_s)
                                                         + COALESCE(j.progress_grace_s, 0)) < c.now, false)
  AND (j.progress_at + make_interval(secs => p.suspect_fraction * (COALESCE(s.no_progress_timeout_s, p.no_progress_timeout_s)
                                                                    + COALESCE(j.progress_grace_s, 0))) < c.now
       OR j.last_heartbeat_at + (j.leased_until - j.last_heartbeat_at) * p.suspect_fraction < c.now);
COMMENT ON VIEW suspect_attempts IS 'Running attempts not stalled yet whose progress counters, or heartbeats, have been still for more than stall_policy.suspect_fraction of their allowance (log clock): what the watchdog will judge next (domain/policy/stall.py attempt_suspect)';
COMMENT ON COLUMN suspect_attempts.job_id IS 'Job id';
COMMENT ON COLUMN suspect_attempts.stage IS 'Stage of the attempt';
COMMENT ON COLUMN suspect_attempts.attempt IS 'Attempt number (1-based)';
COMMENT ON COLUMN suspect_attempts.worker IS 'Process that holds the claim (role@instance:pid)';
COMMENT ON COLUMN suspect_attempts.log_partition IS 'Partition of the lifecycle log holding the job (its log clock)';
COMMENT ON COLUMN suspect_attempts.log_now IS 'The log clock of that partition: broker time (UTC) of its newest record';
COMMENT ON COLUMN suspect_attempts.leased_until IS 'Broker time (UTC) the lease ends: last claim or heartbeat + lease_s';
COMMENT ON COLUMN suspect_attempts.last_heartbeat_at IS 'Broker time (UTC) of the last claim or heartbeat';
COMMENT ON COLUMN suspect_attempts.last_progress_at IS 'Broker time (UTC) the progress counters last moved';
COMMENT ON COLUMN suspect_attempts.progress_frames IS 'Frames done at the last heartbeat';
COMMENT ON COLUMN suspect_attempts.progress_out_time_s IS 'Seconds of output encoded at the last heartbeat';
COMMENT ON COLUMN suspect_attempts.progress_grace_s IS 'Seconds the attempt''s no-progress allowance grows by (a download, a silent seek)';
COMMENT ON COLUMN suspect_attempts.no_progress_timeout_s IS 'The stage''s no-progress timeout (stage_stall_policy, else stall_policy), seconds';
COMMENT ON COLUMN suspect_attempts.suspect_fraction IS 'stall_policy.suspect_fraction';
COMMENT ON COLUMN suspect_attempts.tool_state IS 'The tool_state (ToolState) of the attempt''s last heartbeat; NULL when none carried one';

-- Attempt stalls by time: the readers' recent stalls.
CREATE INDEX lifecycle_evidence_stalls ON lifecycle_evidence (broker_ts) WHERE event_type = 'StallDetected' AND applied;

CREATE VIEW recent_attempt_stalls AS
SELECT s.job_id, s.stage, s.attempt, s.payload->>'kind' AS kind, s.broker_ts AS detected_at,
       (s.payload->>'since_s')::double precision AS since_s, s.payload->>'detail' AS detail,
       s.payload->'tool_state' AS tool_state,
       a.event_type AS acted_by, (a.payload->>'next_attempt')::integer AS next_attempt,
       j.state AS job_state, j.stage AS job_stage, j.attempt AS job_attempt,
       EXTRACT(EPOCH FROM c.now - s.broker_ts)::double precision AS age_s
FROM lifecycle_evidence s
JOIN job_state j ON j.job_id = s.job_id
JOIN log_clock c ON c.partition = s.partition
LEFT JOIN LATERAL (
    SELECT x.event_type, x.payload
    FROM lifecycle_evidence x
    WHERE x.job_id = s.job_id AND x.topic = s.topic AND x.partition = s.partition AND x."offset" > s."offset"
      AND x.stage = s.stage AND x.attempt = s.attempt AND x.applied
      AND x.event_type IN ('RetryScheduled', 'JobDeadLettered')
    ORDER BY x."offset"
    LIMIT 1
) a ON true
WHERE s.event_type = 'StallDetected' AND s.applied
  AND s.payload->>'kind' IN ('lease_expired', 'no_progress', 'worker_exited', 'region_lost');
COMMENT ON VIEW recent_attempt_stalls IS 'Every judged attempt stall (StallDetected of an attempt kind) with what was done about it and the job''s state now; the readers list those younger than TAPELINE_RECENT_STALLS_S on the log clock';
COMMENT ON COLUMN recent_attempt_stalls.job_id IS 'Job id';
COMMENT ON COLUMN recent_attempt_stalls.stage IS 'Stage of the stalled attempt';
COMMENT ON COLUMN recent_attempt_stalls.attempt IS 'The stalled attempt';
COMMENT ON COLUMN recent_attempt_stalls.kind IS 'lease_expired, no_progress, worker_exited or region_lost';
COMMENT ON COLUMN recent_attempt_stalls.detected_at IS 'Broker time (UTC) of the StallDetected: the verdict';
COMMENT ON COLUMN recent_attempt_stalls.since_s IS 'Seconds the attempt had been still at the verdict (StallDetected.since_s)';
COMMENT ON COLUMN recent_attempt_stalls.detail IS 'StallDetected.detail';
COMMENT ON COLUMN recent_attempt_stalls.tool_state IS 'StallDetected.tool_state: what the worker last saw of its tool (ToolState); NULL when none was seen';
COMMENT ON COLUMN recent_attempt_stalls.acted_by IS 'RetryScheduled (retried) or JobDeadLettered (out of attempts), recorded with the verdict; NULL when neither';
COMMENT ON COLUMN recent_attempt_stalls.next_attempt IS 'The attempt the retry runs (RetryScheduled.next_attempt)';
COMMENT ON COLUMN recent_attempt_stalls.job_state IS 'The job''s state now';
COMMENT ON COLUMN recent_attempt_stalls.job_stage IS 'The job''s stage now';
COMMENT ON COLUMN recent_attempt_stalls.job_attempt IS 'The job''s attempt now';
COMMENT ON COLUMN recent_attempt_stalls.age_s IS 'Seconds on the log clock of the job''s partition since the verdict';
