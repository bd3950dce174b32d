-- 016: a grace on the no-progress timeout while ffmpeg decodes silently up to a resume point.
-- A resumed transcode seeks its input to the first segment it encodes; ffmpeg decodes from the
-- keyframe before that point and reports no frames until it gets there, which after a seek into a
-- long GOP (or a source with a single keyframe) can take longer than the no-progress timeout. The
-- worker measures the distance to that keyframe and sends it, as seconds of grace, in its
-- heartbeats until the counters move; the stall view adds it to the timeout.

ALTER TABLE job_state ADD COLUMN progress_grace_s double precision;
COMMENT ON COLUMN job_state.progress_grace_s IS
    'Seconds added to no_progress_timeout_s for the current attempt while ffmpeg decodes silently to a resume point (NULL: none)';

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
WHERE j.state = 'running'
  AND (j.leased_until < c.now
       OR j.progress_at + make_interval(secs => p.no_progress_timeout_s + COALESCE(j.progress_grace_s, 0)) < c.now);
