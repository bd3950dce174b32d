-- 013: result reuse and the degradation ladder (issue 9, items 5 and 6).
-- profile_fingerprint: sha256 of everything that determines a job's outputs (processors/reuse.py);
-- a completed job with the same source_sha256 and profile_fingerprint can lend its published outputs.
ALTER TABLE job_state ADD COLUMN profile_fingerprint text;
ALTER TABLE job_state ADD COLUMN degraded boolean;
ALTER TABLE job_state ADD COLUMN degraded_reason text;
ALTER TABLE job_state ADD COLUMN x264_preset text;
ALTER TABLE job_state ADD COLUMN reused_from text;
COMMENT ON COLUMN job_state.profile_fingerprint IS 'sha256 of the output profile (ladder, codec settings, segment length); JobAccepted.profile_fingerprint';
COMMENT ON COLUMN job_state.degraded IS 'true when intake gave the job the cheaper ladder because its tier''s backlog was above the threshold';
COMMENT ON COLUMN job_state.degraded_reason IS 'why the ladder was degraded: tier, backlog, threshold';
COMMENT ON COLUMN job_state.x264_preset IS 'x264 preset of the job''s transcode (NULL: the worker''s setting)';
COMMENT ON COLUMN job_state.reused_from IS 'job whose published outputs this job reused (ResultReused); NULL when it transcoded';

-- Intake's reuse lookup: completed jobs by (source sha256, profile fingerprint), newest first.
CREATE INDEX job_state_reuse ON job_state (source_sha256, profile_fingerprint, completed_at DESC)
    WHERE state = 'completed';
