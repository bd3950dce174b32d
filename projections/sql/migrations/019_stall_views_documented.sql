-- 019: a re-driven handoff stays in stalled_handoffs until a worker claims it, and every column of
-- every table and view carries its documentation (issue 6: "tables and views documented column by
-- column"; the stall views, the log clock and some later columns had none).
--
-- Before, the watchdog's re-drive (StallDetected(handoff), which resets queued_at) took the job out
-- of stalled_handoffs until handoff_timeout_s had passed again: with no worker for the stage the job
-- was listed for well under a second in each timeout, so a dashboard or `tapeline stalled` hardly
-- ever showed it. Now a queued stage that was re-driven and is still not claimed stays listed;
-- `redrive_due` says whether the timeout has passed again (what the watchdog acts on: the query
-- `handoffs_due`).

CREATE OR REPLACE VIEW stalled_handoffs AS
SELECT j.job_id, j.stage, j.attempt, j.yields, j.redrives, j.log_partition, c.now AS log_now, j.queued_at,
       EXTRACT(EPOCH FROM c.now - j.queued_at)::double precision AS since_s,
       j.queued_at + make_interval(secs => p.handoff_timeout_s) < c.now AS redrive_due
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
WHERE j.state = 'queued'
  AND (j.queued_at + make_interval(secs => p.handoff_timeout_s) < c.now OR j.redrives > 0);

COMMENT ON VIEW stalled_handoffs IS 'Queued stages no worker claimed within stall_policy.handoff_timeout_s (log clock), and those the watchdog already re-drove that are still unclaimed';
COMMENT ON COLUMN stalled_handoffs.job_id IS 'Job id';
COMMENT ON COLUMN stalled_handoffs.stage IS 'Stage waiting for a worker (intake|transcode|publish)';
COMMENT ON COLUMN stalled_handoffs.attempt IS 'Attempt number of the queued stage (1-based)';
COMMENT ON COLUMN stalled_handoffs.yields IS 'Graceful yields of this job so far (they do not use up an attempt)';
COMMENT ON COLUMN stalled_handoffs.redrives IS 'Times the watchdog re-sent this stage''s work item since it was queued';
COMMENT ON COLUMN stalled_handoffs.log_partition IS 'Partition of the lifecycle log holding the job (its log clock)';
COMMENT ON COLUMN stalled_handoffs.log_now IS 'The log clock of that partition: broker time (UTC) of its newest record';
COMMENT ON COLUMN stalled_handoffs.queued_at IS 'Broker time (UTC) the stage was queued, or last re-driven';
COMMENT ON COLUMN stalled_handoffs.since_s IS 'Seconds on the log clock since queued_at';
COMMENT ON COLUMN stalled_handoffs.redrive_due IS 'handoff_timeout_s has passed since queued_at: the watchdog re-drives it on its next tick';

COMMENT ON VIEW stalled_attempts IS 'Running attempts that stopped moving, judged on the log clock: lease expired, or progress counters frozen past stall_policy.no_progress_timeout_s (plus the attempt''s progress grace)';
COMMENT ON COLUMN stalled_attempts.job_id IS 'Job id';
COMMENT ON COLUMN stalled_attempts.stage IS 'Stage of the stalled attempt (transcode|publish|...)';
COMMENT ON COLUMN stalled_attempts.attempt IS 'Attempt number (1-based)';
COMMENT ON COLUMN stalled_attempts.yields IS 'Graceful yields of this job so far';
COMMENT ON COLUMN stalled_attempts.claim_token IS 'Fencing token of the stalled claim';
COMMENT ON COLUMN stalled_attempts.worker IS 'Process that holds the claim (role@instance:pid)';
COMMENT ON COLUMN stalled_attempts.log_partition IS 'Partition of the lifecycle log holding the job (its log clock)';
COMMENT ON COLUMN stalled_attempts.log_now IS 'The log clock of that partition: broker time (UTC) of its newest record';
COMMENT ON COLUMN stalled_attempts.kind IS 'lease_expired (no claim or heartbeat within the lease) or no_progress (heartbeats arrive, counters frozen)';
COMMENT ON COLUMN stalled_attempts.leased_until IS 'Broker time (UTC) the lease ends: last claim or heartbeat + lease_s';
COMMENT ON COLUMN stalled_attempts.last_heartbeat_at IS 'Broker time (UTC) of the last claim or heartbeat';
COMMENT ON COLUMN stalled_attempts.last_progress_at IS 'Broker time (UTC) the progress counters last moved';
COMMENT ON COLUMN stalled_attempts.progress_frames IS 'Frames done at the last heartbeat';
COMMENT ON COLUMN stalled_attempts.progress_out_time_s IS 'Seconds of output encoded at the last heartbeat';
COMMENT ON COLUMN stalled_attempts.since_s IS 'Seconds on the log clock since the last heartbeat (lease_expired) or the last progress (no_progress)';

COMMENT ON VIEW expected_work_missing IS 'Uploads with no job after stall_policy.intake_timeout_s on the newest log clock, not reported yet (no StallDetected of the job)';
COMMENT ON COLUMN expected_work_missing.upload_id IS 'Upload id';
COMMENT ON COLUMN expected_work_missing.job_id IS 'Job id the upload should have become';
COMMENT ON COLUMN expected_work_missing.uploaded_at IS 'Broker time (UTC) of the upload''s first copy';
COMMENT ON COLUMN expected_work_missing.log_now IS 'The newest log clock of all partitions: broker time (UTC)';
COMMENT ON COLUMN expected_work_missing.since_s IS 'Seconds on the log clock since uploaded_at';

COMMENT ON VIEW due_retries IS 'Scheduled retries whose due time has come on their partition''s log clock (the watchdog dispatches them)';
COMMENT ON COLUMN due_retries.job_id IS 'Job id';
COMMENT ON COLUMN due_retries.stage IS 'Stage to retry';
COMMENT ON COLUMN due_retries.attempt IS 'Attempt that failed';
COMMENT ON COLUMN due_retries.retry_next_attempt IS 'Attempt the retry starts';
COMMENT ON COLUMN due_retries.retry_due_at IS 'Broker time (UTC) the retry may start: the failure''s broker time + its backoff';
COMMENT ON COLUMN due_retries.log_partition IS 'Partition of the lifecycle log holding the job (its log clock)';
COMMENT ON COLUMN due_retries.log_now IS 'The log clock of that partition: broker time (UTC) of its newest record';
COMMENT ON COLUMN due_retries.overdue_s IS 'Seconds on the log clock since retry_due_at';

COMMENT ON COLUMN job_state.log_partition IS 'Partition of the lifecycle log holding this job (whose log clock judges its stalls)';
COMMENT ON COLUMN job_state.queued_at IS 'Broker time (UTC) the current stage attempt was queued, or last re-driven by the watchdog';
COMMENT ON COLUMN job_state.yields IS 'Graceful yields (SIGTERM, a deferral); they do not use up an attempt';
COMMENT ON COLUMN job_state.redrives IS 'Times the watchdog re-sent the queued stage''s work item (reset when a stage is queued)';
COMMENT ON COLUMN job_state.audio_playlist_key IS 'Object key of the audio rendition''s playlist from the last transcode (NULL: no audio)';
COMMENT ON COLUMN job_state.last_heartbeat_at IS 'Broker time (UTC) of the current attempt''s last claim or heartbeat';
COMMENT ON COLUMN job_state.retry_next_attempt IS 'Attempt a scheduled retry will start (state retry_scheduled)';
COMMENT ON COLUMN job_state.retry_due_at IS 'Broker time (UTC) a scheduled retry may start (log clock)';

COMMENT ON TABLE log_clock IS 'The log clock: per partition of the lifecycle log, the broker time of the newest record (watchdog ticks included). Stall and retry decisions use it, never a machine''s clock';
COMMENT ON COLUMN log_clock.partition IS 'Partition of the lifecycle topic';
COMMENT ON COLUMN log_clock.now IS 'LogAppendTime (UTC) of the newest record of that partition';

COMMENT ON TABLE stall_policy IS 'Stall thresholds (one row), written by the watchdog from its settings at start';
COMMENT ON COLUMN stall_policy.id IS 'Always true: the table holds one row';
COMMENT ON COLUMN stall_policy.no_progress_timeout_s IS 'Seconds of frozen progress counters after which a running attempt is stalled (no_progress)';
COMMENT ON COLUMN stall_policy.handoff_timeout_s IS 'Seconds a queued stage may wait for a claim before the watchdog re-drives it';
COMMENT ON COLUMN stall_policy.intake_timeout_s IS 'Seconds an upload may stay without a job before it is reported (expected_work_missing)';
COMMENT ON COLUMN stall_policy.updated_at IS 'When the policy was last written (PostgreSQL clock, UTC)';

COMMENT ON TABLE projection_source IS 'The Kafka cluster each projection in this schema was built from: stored offsets mean nothing against another cluster';
COMMENT ON COLUMN projection_source.projection IS 'Projection name (projector_offsets.projection)';
COMMENT ON COLUMN projection_source.cluster_id IS 'Kafka cluster id the offsets belong to';
COMMENT ON COLUMN projection_source.recorded_at IS 'When it was recorded (PostgreSQL clock, UTC)';

COMMENT ON COLUMN applied_dedup_keys.dedup_key IS 'Dedup key of an applied event (job:stage:attempt:type[:sequence]); a later event with the same key is evidence only (duplicate)';

COMMENT ON COLUMN uploads.upload_id IS 'Upload id';
COMMENT ON COLUMN uploads.job_id IS 'Job id the upload becomes (derived from its content and options)';
COMMENT ON COLUMN uploads.filename IS 'File name as submitted';
COMMENT ON COLUMN uploads.priority IS 'Priority tier: archive|standard|index';

COMMENT ON COLUMN provider_calls.id IS 'Reservation id';
COMMENT ON COLUMN provider_calls.provider IS 'Provider name (the webhook''s, or origin)';
COMMENT ON COLUMN provider_calls.job_id IS 'Job whose post it is';
COMMENT ON COLUMN provider_calls.attempt IS 'Publish attempt that made the call';
COMMENT ON COLUMN provider_calls.claim_token IS 'Fencing token of that attempt';

COMMENT ON COLUMN intake_uploads.upload_id IS 'Upload id (becomes uploads.upload_id once published)';
COMMENT ON COLUMN intake_uploads.job_id IS 'Job id the upload becomes';
COMMENT ON COLUMN intake_uploads.submitter IS 'Submitter name of the API token that sent it (TAPELINE_INTAKE_TOKENS)';
COMMENT ON COLUMN intake_uploads.idempotency_key IS 'The request''s Idempotency-Key header (NULL: none); one row per (submitter, key)';
COMMENT ON COLUMN intake_uploads.priority IS 'Priority tier: archive|standard|index';
COMMENT ON COLUMN intake_uploads.profile IS 'Encoding profile asked for (NULL: the default)';
COMMENT ON COLUMN intake_uploads.filename IS 'File name as submitted';
COMMENT ON COLUMN intake_uploads.state IS 'uploading (admitted, bytes arriving) or published (UploadCompleted acknowledged)';
COMMENT ON COLUMN intake_uploads.sha256 IS 'SHA-256 of the bytes, hex (NULL while uploading)';
COMMENT ON COLUMN intake_uploads.size_bytes IS 'Size of the upload, bytes (NULL while uploading)';
COMMENT ON COLUMN intake_uploads.response IS 'The HTTP response body sent for it, replayed to a retry with the same idempotency key';
COMMENT ON COLUMN intake_uploads.created_at IS 'Admission time (PostgreSQL clock, UTC)';
COMMENT ON COLUMN intake_uploads.updated_at IS 'Last change (PostgreSQL clock, UTC)';

COMMENT ON TABLE schema_migrations IS 'Migrations applied to this schema (projections/sql/migrations)';
COMMENT ON COLUMN schema_migrations.version IS 'Migration number';
COMMENT ON COLUMN schema_migrations.name IS 'Migration file name';
COMMENT ON COLUMN schema_migrations.applied_at IS 'When it was applied (PostgreSQL clock, UTC)';
