-- 010: column documentation (visible with \d+ and to any dashboard tool) and the read-only role.
-- Conventions: every timestamp is timestamptz, stored and shown in UTC; "broker time" is the Kafka
-- record's LogAppendTime (the one clock leases and ages use); durations are seconds (double
-- precision) unless the name says otherwise; sizes are bytes. Runs inside whichever schema is
-- being migrated (search_path), so every schema built by a replay carries the same comments and grants.

COMMENT ON TABLE projector_offsets IS 'Next offset each projection will apply, per topic partition; written in the same transaction as the rows';
COMMENT ON COLUMN projector_offsets.projection IS 'Projection name (''main'')';
COMMENT ON COLUMN projector_offsets.topic IS 'Kafka topic, e.g. <prefix>.jobs';
COMMENT ON COLUMN projector_offsets.partition IS 'Kafka partition number (0-based)';
COMMENT ON COLUMN projector_offsets.next_offset IS 'First offset not yet applied; may pass transaction markers (compare with the last stable offset)';
COMMENT ON COLUMN projector_offsets.updated_at IS 'Database time (UTC) of the last advance; wall clock, not broker time';

COMMENT ON TABLE job_state IS 'Current state of each job: a fold of its lifecycle events in log order (one row per job)';
COMMENT ON COLUMN job_state.job_id IS 'uuid5(TAPELINE_NAMESPACE, upload_id), text';
COMMENT ON COLUMN job_state.upload_id IS 'The upload that created the job';
COMMENT ON COLUMN job_state.state IS 'accepted|queued|running|retry_scheduled|completed|rejected|failed|dead_lettered|needs_review|cancelled';
COMMENT ON COLUMN job_state.stage IS 'Current stage: intake|transcode|publish';
COMMENT ON COLUMN job_state.attempt IS 'Current attempt number of stage, 1-based (0 at intake)';
COMMENT ON COLUMN job_state.attempts IS 'Highest attempt number any stage reached (1 for a clean run)';
COMMENT ON COLUMN job_state.claim_token IS 'Claim token of the current attempt; events with another token are superseded evidence';
COMMENT ON COLUMN job_state.worker IS 'Worker (role@instance) holding the current attempt';
COMMENT ON COLUMN job_state.priority IS 'Priority tier: archive|standard|index';
COMMENT ON COLUMN job_state.profile IS 'Output profile name';
COMMENT ON COLUMN job_state.source_key IS 'Object key of the uploaded source in the bucket';
COMMENT ON COLUMN job_state.source_sha256 IS 'Hex sha256 of the source bytes';
COMMENT ON COLUMN job_state.source_size_bytes IS 'Source size, bytes';
COMMENT ON COLUMN job_state.source_duration_s IS 'Source duration, seconds of media (ffprobe at intake)';
COMMENT ON COLUMN job_state.source_width IS 'Source display width, pixels';
COMMENT ON COLUMN job_state.source_height IS 'Source display height, pixels';
COMMENT ON COLUMN job_state.ladder IS 'Planned renditions, JSON [{name,width,height,video_bitrate_kbps}]';
COMMENT ON COLUMN job_state.outputs IS 'Objects of the last successful transcode attempt, JSON [{key,sha256,size_bytes,content_type}]';
COMMENT ON COLUMN job_state.renditions IS 'Published renditions, JSON [{name,width,height,playlist_key,url}]';
COMMENT ON COLUMN job_state.master_url IS 'Public URL of the HLS master playlist once published';
COMMENT ON COLUMN job_state.error_class IS 'docs/design.md error class of the last failure (NULL once completed)';
COMMENT ON COLUMN job_state.reason IS 'Human-readable reason of the last failure, yield, stall or replay';
COMMENT ON COLUMN job_state.lease_s IS 'Lease length of the current attempt, seconds';
COMMENT ON COLUMN job_state.leased_until IS 'Broker time of the last claim or heartbeat + lease_s (UTC)';
COMMENT ON COLUMN job_state.progress_frames IS 'Frames encoded by the current attempt (ffmpeg -progress)';
COMMENT ON COLUMN job_state.progress_out_time_s IS 'Media seconds encoded by the current attempt';
COMMENT ON COLUMN job_state.progress_speed IS 'Encoding speed, media seconds per wall second (x realtime)';
COMMENT ON COLUMN job_state.progress_at IS 'Broker time the progress counters last advanced (UTC)';
COMMENT ON COLUMN job_state.events IS 'Number of events applied to this row (duplicates and superseded events excluded)';
COMMENT ON COLUMN job_state.last_event_type IS 'Type of the last applied event';
COMMENT ON COLUMN job_state.created_at IS 'Broker time of the first applied event (UTC)';
COMMENT ON COLUMN job_state.updated_at IS 'Broker time of the last applied event (UTC)';
COMMENT ON COLUMN job_state.completed_at IS 'Broker time the job reached a terminal state (UTC); NULL while open';

COMMENT ON TABLE lifecycle_evidence IS 'Every decodable record of the lifecycle log, applied or not: the evidence (watchdog ticks excepted)';
COMMENT ON COLUMN lifecycle_evidence.topic IS 'Kafka topic of the record';
COMMENT ON COLUMN lifecycle_evidence.partition IS 'Kafka partition';
COMMENT ON COLUMN lifecycle_evidence."offset" IS 'Kafka offset; (topic, partition, offset) is the record''s identity';
COMMENT ON COLUMN lifecycle_evidence.broker_ts IS 'Broker time: LogAppendTime of the record (UTC, millisecond precision)';
COMMENT ON COLUMN lifecycle_evidence.event_id IS 'uuid4 of the event (a redelivered copy has the same one)';
COMMENT ON COLUMN lifecycle_evidence.event_type IS 'Event type, e.g. AttemptStarted';
COMMENT ON COLUMN lifecycle_evidence.job_id IS 'Job the event belongs to';
COMMENT ON COLUMN lifecycle_evidence.stage IS 'Stage the event is about';
COMMENT ON COLUMN lifecycle_evidence.attempt IS 'Attempt number of that stage the event is about';
COMMENT ON COLUMN lifecycle_evidence.claim_token IS 'Claim token the writer held (NULL for events outside an attempt)';
COMMENT ON COLUMN lifecycle_evidence.dedup_key IS '{job_id}:{stage}:{attempt}:{event_type}[:{sequence}]';
COMMENT ON COLUMN lifecycle_evidence.occurred_at IS 'The writer''s own clock (UTC, microseconds): evidence only, never used for leases';
COMMENT ON COLUMN lifecycle_evidence.recorded_by IS 'Writer, role@instance';
COMMENT ON COLUMN lifecycle_evidence.causation_id IS 'event_id (or work item) that caused this event';
COMMENT ON COLUMN lifecycle_evidence.applied IS 'True when the event changed job_state';
COMMENT ON COLUMN lifecycle_evidence.superseded IS 'True when it belonged to an attempt that was no longer current (fenced in the projection)';
COMMENT ON COLUMN lifecycle_evidence.duplicate IS 'True when its dedup_key had already been applied';
COMMENT ON COLUMN lifecycle_evidence.payload IS 'The whole decoded event as JSON (timestamps ISO 8601 UTC)';

COMMENT ON TABLE applied_dedup_keys IS 'Dedup keys already applied: later copies are evidence only';
COMMENT ON TABLE uploads IS 'Uploads seen on <prefix>.uploads, one row per upload_id';
COMMENT ON COLUMN uploads.size_bytes IS 'Source size, bytes';
COMMENT ON COLUMN uploads.sha256 IS 'Hex sha256 of the uploaded bytes';
COMMENT ON COLUMN uploads.broker_ts IS 'Broker timestamp of the first copy (UTC)';
COMMENT ON COLUMN uploads.copies IS 'How many times the upload was published (1 = no duplicate)';
COMMENT ON TABLE dead_letters IS 'Dead letters: jobs out of attempts and records that could not be decoded (raw), see 005';
COMMENT ON COLUMN dead_letters.broker_ts IS 'Broker timestamp of the record (UTC)';
COMMENT ON COLUMN dead_letters.key IS 'Raw record key bytes';
COMMENT ON COLUMN dead_letters.value IS 'Raw record value bytes';
COMMENT ON COLUMN dead_letters.recorded_at IS 'Database time (UTC) the projector stored it; wall clock';

-- tapeline_reader: a NOLOGIN role for dashboards (grant it to a login role: GRANT tapeline_reader TO grafana).
-- Creating a role needs CREATEROLE; without it the migration only says so, and an administrator runs
-- `CREATE ROLE tapeline_reader NOLOGIN` once, after which `tapeline migrate` (or the next replay) grants.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'tapeline_reader') THEN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolcreaterole OR rolsuper)) THEN
            CREATE ROLE tapeline_reader NOLOGIN;
        ELSE
            RAISE NOTICE 'role tapeline_reader does not exist and % may not create it: no grants', current_user;
            RETURN;
        END IF;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO tapeline_reader', current_schema());
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO tapeline_reader', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO tapeline_reader', current_schema());
END
$$;
