-- name: job_state_by_ids
-- Current rows of the given jobs (the projector folds events onto them).
SELECT * FROM job_state WHERE job_id = ANY(%(job_ids)s);

-- name: applied_dedup_keys_among
-- Which of the given dedup keys were already applied.
SELECT dedup_key FROM applied_dedup_keys WHERE dedup_key = ANY(%(keys)s);

-- name: insert_dedup_key
-- Remember an applied dedup key.
INSERT INTO applied_dedup_keys (dedup_key) VALUES (%(dedup_key)s) ON CONFLICT DO NOTHING;

-- name: insert_evidence
-- One lifecycle record as evidence.
INSERT INTO lifecycle_evidence (topic, partition, "offset", broker_ts, event_id, event_type, job_id, stage,
    attempt, claim_token, dedup_key, occurred_at, recorded_by, causation_id, applied, superseded, duplicate, payload)
VALUES (%(topic)s, %(partition)s, %(offset)s, %(broker_ts)s, %(event_id)s, %(event_type)s, %(job_id)s, %(stage)s,
    %(attempt)s, %(claim_token)s, %(dedup_key)s, %(occurred_at)s, %(recorded_by)s, %(causation_id)s, %(applied)s,
    %(superseded)s, %(duplicate)s, %(payload)s)
ON CONFLICT DO NOTHING;

-- name: upsert_upload
-- An upload record; a repeated copy only bumps the copy count.
INSERT INTO uploads (upload_id, job_id, filename, size_bytes, sha256, priority, broker_ts, submitter)
VALUES (%(upload_id)s, %(job_id)s, %(filename)s, %(size_bytes)s, %(sha256)s, %(priority)s, %(broker_ts)s,
    %(submitter)s)
ON CONFLICT (upload_id) DO UPDATE SET copies = uploads.copies + 1;

-- name: upsert_dead_letter
-- A dead letter (005); a second sighting of the same bad record only adds who saw it.
INSERT INTO dead_letters (id, kind, topic, partition, "offset", broker_ts, key, value, headers, error, job_id, stage,
    attempt, error_class, attempts, evidence, seen_by)
VALUES (%(id)s, %(kind)s, %(topic)s, %(partition)s, %(offset)s, %(broker_ts)s, %(key)s, %(value)s, %(headers)s,
    %(error)s, %(job_id)s, %(stage)s, %(attempt)s, %(error_class)s, %(attempts)s, %(evidence)s, %(seen_by)s)
ON CONFLICT (id) DO UPDATE SET
    seen_by = ARRAY(SELECT DISTINCT unnest(dead_letters.seen_by || EXCLUDED.seen_by) ORDER BY 1),
    kind = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.kind ELSE dead_letters.kind END,
    error = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.error ELSE dead_letters.error END;

-- name: mark_dead_letter_replayed
-- An operator's JobReplayed was applied: the dead letter is replayed (first replay wins).
UPDATE dead_letters SET replayed_at = COALESCE(replayed_at, %(broker_ts)s),
    replayed_by = COALESCE(replayed_by, %(operator)s), replay_reason = COALESCE(replay_reason, %(reason)s)
WHERE id = %(id)s;

-- name: dead_letters_list
-- Dead letters, newest first; `reason` filters on the error class (NULL: all); `pending` hides replayed ones.
SELECT id, kind, job_id, stage, attempt, error_class, attempts, error, topic, partition, "offset", broker_ts,
       seen_by, replayed_at, replayed_by, replay_reason, octet_length(value) AS value_bytes
FROM dead_letters
WHERE (%(reason)s::text IS NULL OR error_class = %(reason)s)
  AND (NOT %(pending)s OR replayed_at IS NULL)
ORDER BY broker_ts DESC NULLS LAST, id
LIMIT %(limit)s;

-- name: dead_letter_by_id
-- One dead letter with its raw bytes.
SELECT * FROM dead_letters WHERE id = %(id)s;

-- name: upsert_offset
-- Advance a projection's position in one partition (never backwards).
INSERT INTO projector_offsets (projection, topic, partition, next_offset)
VALUES (%(projection)s, %(topic)s, %(partition)s, %(next_offset)s)
ON CONFLICT (projection, topic, partition) DO UPDATE
SET next_offset = GREATEST(projector_offsets.next_offset, EXCLUDED.next_offset), updated_at = now();

-- name: offsets_of_projection
-- Stored positions of one projection.
SELECT topic, partition, next_offset FROM projector_offsets WHERE projection = %(projection)s;

-- name: job_status
-- One job's current row.
SELECT * FROM job_state WHERE job_id = %(job_id)s;

-- name: recent_jobs
-- The most recently updated jobs.
SELECT * FROM job_state ORDER BY updated_at DESC LIMIT %(limit)s;

-- name: job_timeline
-- Every event of a job in log order (broker time), with its flags.
SELECT topic, partition, "offset", broker_ts, event_type, stage, attempt, claim_token, recorded_by,
       applied, superseded, duplicate, payload
FROM lifecycle_evidence WHERE job_id = %(job_id)s ORDER BY broker_ts, partition, "offset";

-- name: count_events_of_type
-- How many committed events of one type a job has (evidence, duplicates included).
SELECT count(*) AS n FROM lifecycle_evidence WHERE job_id = %(job_id)s AND event_type = %(event_type)s;

-- name: advance_log_clock
-- Move one partition's log clock forward (never backwards).
INSERT INTO log_clock (partition, now) VALUES (%(partition)s, %(now)s)
ON CONFLICT (partition) DO UPDATE SET now = GREATEST(log_clock.now, EXCLUDED.now);

-- name: stalled_attempts
-- Running attempts that stopped moving (lease_expired or no_progress), oldest first.
SELECT * FROM stalled_attempts ORDER BY since_s DESC;

-- name: stalled_handoffs
-- Queued stages nobody claimed in time.
SELECT * FROM stalled_handoffs ORDER BY since_s DESC;

-- name: expected_work_missing
-- Uploads that never became jobs.
SELECT * FROM expected_work_missing ORDER BY since_s DESC;

-- name: set_stall_policy
-- The watchdog's thresholds, seconds.
UPDATE stall_policy SET no_progress_timeout_s = %(no_progress_timeout_s)s, handoff_timeout_s = %(handoff_timeout_s)s,
    intake_timeout_s = %(intake_timeout_s)s, updated_at = now();

-- name: log_clock
-- The log clock of every partition.
SELECT partition, now FROM log_clock ORDER BY partition;

-- name: due_retries
-- Scheduled retries that may start now (log clock).
SELECT * FROM due_retries ORDER BY retry_due_at;

-- name: jobs_in_state
-- Jobs in one state, most recently updated first.
SELECT * FROM job_state WHERE state = %(state)s ORDER BY updated_at DESC LIMIT %(limit)s;

-- name: job_attempts
-- A job's attempts in log order (view attempts, migration 006).
SELECT * FROM attempts WHERE job_id = %(job_id)s ORDER BY claim_offset;

-- name: job_stage_durations
-- A job's per-stage queue wait, run time and attempts (view stage_durations, migration 006).
SELECT * FROM stage_durations WHERE job_id = %(job_id)s
ORDER BY queued_at, CASE stage WHEN 'intake' THEN 0 WHEN 'transcode' THEN 1 ELSE 2 END;

-- name: provider_posts_since
-- Posts recorded at one provider (applied `Published` events) since a time, oldest first.
SELECT broker_ts FROM lifecycle_evidence
WHERE event_type = 'Published' AND applied AND payload->>'provider' = %(provider)s AND broker_ts > %(since)s
ORDER BY broker_ts;

-- name: job_checkpoints
-- Checkpoints of a job's stage recorded by attempts that owned the job then (applied; a superseded claim token or a duplicate is never used), log order.
SELECT attempt, payload, broker_ts FROM lifecycle_evidence
WHERE job_id = %(job_id)s AND stage = %(stage)s AND event_type = 'CheckpointRecorded'
  AND applied AND NOT superseded AND NOT duplicate
ORDER BY broker_ts, partition, "offset";

-- name: jobs_page
-- One page of jobs filtered by state, stage, priority and last-event broker time in [since, until) (NULL: any), newest first.
SELECT * FROM job_state
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(stage)s::text IS NULL OR stage = %(stage)s)
  AND (%(priority)s::text IS NULL OR priority = %(priority)s)
  AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR updated_at < %(until)s)
ORDER BY updated_at DESC, job_id
LIMIT %(limit)s OFFSET %(offset)s;

-- name: jobs_count
-- How many jobs match the filters of jobs_page.
SELECT count(*) AS n FROM job_state
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(stage)s::text IS NULL OR stage = %(stage)s)
  AND (%(priority)s::text IS NULL OR priority = %(priority)s)
  AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR updated_at < %(until)s);

-- name: jobs_by_state_and_stage
-- How many jobs are in each (state, stage).
SELECT state, stage, count(*) AS n FROM job_state GROUP BY state, stage ORDER BY state, stage;

-- name: jobs_ended_by_minute
-- Jobs that reached a terminal state per minute of broker time and state, in [since, until).
SELECT date_trunc('minute', completed_at) AS minute, state, count(*) AS n
FROM job_state WHERE completed_at >= %(since)s AND completed_at < %(until)s
GROUP BY 1, 2 ORDER BY 1, 2;

-- name: jobs_created_by_minute
-- Jobs whose first event was applied, per minute of broker time, in [since, until).
SELECT date_trunc('minute', created_at) AS minute, count(*) AS n
FROM job_state WHERE created_at >= %(since)s AND created_at < %(until)s
GROUP BY 1 ORDER BY 1;

-- name: job_heartbeats
-- A job's heartbeats in log order (superseded ones included: a zombie's progress is evidence), duplicates excluded.
SELECT stage, attempt, claim_token, broker_ts, applied, superseded,
       (payload->>'frames_done')::bigint AS frames_done, (payload->>'frames_total')::bigint AS frames_total,
       (payload->>'out_time_s')::double precision AS out_time_s, (payload->>'speed')::double precision AS speed
FROM lifecycle_evidence
WHERE job_id = %(job_id)s AND event_type = 'Heartbeat' AND NOT duplicate
ORDER BY partition, "offset";

-- name: job_checkpoint_evidence
-- A job's CheckpointRecorded evidence in log order (superseded ones too, flagged), duplicates excluded.
SELECT stage, attempt, claim_token, broker_ts, applied, superseded,
       (payload->>'segment_index')::integer AS segment_index, payload->>'rendition' AS rendition,
       payload->>'object_key' AS object_key, payload->>'sha256' AS sha256, (payload->>'frames')::bigint AS frames,
       (payload->>'media_start_s')::double precision AS media_start_s,
       (payload->>'media_duration_s')::double precision AS media_duration_s
FROM lifecycle_evidence
WHERE job_id = %(job_id)s AND event_type = 'CheckpointRecorded' AND NOT duplicate
ORDER BY partition, "offset";

-- name: dead_letter_counts
-- Dead letters in total and not yet replayed.
SELECT count(*) AS total, count(*) FILTER (WHERE replayed_at IS NULL) AS pending FROM dead_letters;

-- name: database_now
-- The database's clock (UTC): the "now" of wall-clock figures such as throughput windows.
SELECT now() AS now;

-- name: submitter_jobs_between
-- Jobs accepted (not rejected) from one submitter's uploads made in [since, until) (broker time).
SELECT count(*) AS jobs FROM uploads u JOIN job_state j ON j.job_id = u.job_id
WHERE u.submitter = %(submitter)s AND u.broker_ts >= %(since)s AND u.broker_ts < %(until)s AND j.state <> 'rejected';

-- name: referenced_object_keys
-- Object keys a recorded checkpoint (applied, not superseded, not duplicate) or an applied transcode completion of the given jobs names (the watchdog's cleanup keeps them).
SELECT payload->>'object_key' AS key FROM lifecycle_evidence
WHERE job_id = ANY(%(job_ids)s) AND event_type = 'CheckpointRecorded' AND applied AND NOT superseded AND NOT duplicate
UNION
SELECT o->>'key' FROM lifecycle_evidence e CROSS JOIN LATERAL jsonb_array_elements(COALESCE(e.payload->'outputs', '[]'::jsonb)) o
WHERE e.job_id = ANY(%(job_ids)s) AND e.event_type = 'AttemptSucceeded' AND e.applied AND NOT e.superseded;

-- name: log_clock_oldest
-- The oldest partition's log clock: every partition has passed it (NULL before the first tick).
SELECT min(now) AS now FROM log_clock;

-- name: tier_backlog
-- Per priority tier: jobs waiting (accepted, queued, retry_scheduled), running, and completed in the last %(window_s)s seconds (database clock).
SELECT COALESCE(priority, 'standard') AS tier,
       count(*) FILTER (WHERE state IN ('accepted', 'queued', 'retry_scheduled')) AS waiting,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'completed' AND completed_at >= now() - make_interval(secs => %(window_s)s)) AS completed_recently
FROM job_state
WHERE state IN ('accepted', 'queued', 'retry_scheduled', 'running')
   OR (state = 'completed' AND completed_at >= now() - make_interval(secs => %(window_s)s))
GROUP BY 1;

-- name: reuse_candidates
-- Completed jobs with this source sha256 and profile fingerprint, newest first, with the job whose published outputs they point at (migration 013).
SELECT job_id, COALESCE(reused_from, job_id) AS origin_job_id, master_url, completed_at FROM job_state
WHERE state = 'completed' AND source_sha256 = %(sha256)s AND profile_fingerprint = %(fingerprint)s
ORDER BY completed_at DESC LIMIT %(limit)s;

-- name: published_result
-- The applied publish success of a job (its published objects and renditions) and its JobCompleted master URL.
SELECT s.payload AS published, c.payload->>'master_url' AS master_url FROM lifecycle_evidence s
JOIN lifecycle_evidence c ON c.job_id = s.job_id AND c.event_type = 'JobCompleted' AND c.applied
WHERE s.job_id = %(job_id)s AND s.event_type = 'AttemptSucceeded' AND s.stage = 'publish' AND s.applied
  AND NOT s.superseded
ORDER BY s.broker_ts DESC LIMIT 1;
