-- 027: a stage declares its own no-progress timeout (issue 22: domain/pipeline.py StageSpec.no_progress_s).
-- The watchdog writes the declared ones here at its start, beside stall_policy; stalled_attempts
-- judges an attempt by its stage's timeout when it has one, else by stall_policy's.

CREATE TABLE stage_stall_policy (
    stage text PRIMARY KEY,
    no_progress_timeout_s double precision NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE stage_stall_policy IS 'Stages with a no-progress timeout of their own (domain/pipeline.py), written by the watchdog at start';
COMMENT ON COLUMN stage_stall_policy.stage IS 'A stage of the registry';
COMMENT ON COLUMN stage_stall_policy.no_progress_timeout_s IS 'Seconds of frozen progress counters after which an attempt of this stage is stalled (no_progress), instead of stall_policy.no_progress_timeout_s';
COMMENT ON COLUMN stage_stall_policy.updated_at IS 'When the row was last written (PostgreSQL clock, UTC)';

CREATE OR REPLACE VIEW stalled_attempts AS
SELECT j.job_id, j.stage, j.attempt, j.yields, j.claim_token, j.worker, j.log_partition,
       c.now AS log_now,
       CASE WHEN j.leased_until < c.now THEN 'lease_expired' ELSE 'no_progress' END AS kind,
       j.leased_until, j.last_heartbeat_at, j.progress_at AS last_progress_at, j.progress_frames,
       j.progress_out_time_s,
       EXTRACT(EPOCH FROM c.now - CASE WHEN j.leased_until < c.now THEN j.last_heartbeat_at ELSE j.progress_at END)::double precision AS since_s
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
LEFT JOIN stage_stall_policy s ON s.stage = j.stage
WHERE j.state = 'running'
  AND (j.leased_until < c.now
       OR j.progress_at + make_interval(secs => COALESCE(s.no_progress_timeout_s, p.no_progress_timeout_s)
                                               + COALESCE(j.progress_grace_s, 0)) < c.now);
COMMENT ON VIEW stalled_attempts IS 'Running attempts that stopped moving, judged on the log clock: lease expired, or progress counters frozen past their stage''s no-progress timeout (stage_stall_policy, else stall_policy.no_progress_timeout_s) plus the attempt''s progress grace';
