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
-- A dead letter (005); a second sighting of the same bad record adds who saw it, and the row keeps
-- the earliest sighting's broker_ts, evidence and headers (ties: the smaller evidence position), and
-- the description (kind, error, error class, job, stage, attempt) of the processor's `DeadLetter`
-- record over the projector's own sighting ('projection'), so the result does not depend on which
-- sighting the projector happened to apply first.
INSERT INTO dead_letters (id, kind, topic, partition, "offset", broker_ts, key, value, headers, error, job_id, stage,
    attempt, error_class, attempts, evidence, seen_by)
VALUES (%(id)s, %(kind)s, %(topic)s, %(partition)s, %(offset)s, %(broker_ts)s, %(key)s, %(value)s, %(headers)s,
    %(error)s, %(job_id)s, %(stage)s, %(attempt)s, %(error_class)s, %(attempts)s, %(evidence)s, %(seen_by)s)
ON CONFLICT (id) DO UPDATE SET
    seen_by = ARRAY(SELECT DISTINCT unnest(dead_letters.seen_by || EXCLUDED.seen_by) ORDER BY 1),
    broker_ts = CASE WHEN (EXCLUDED.broker_ts, EXCLUDED.evidence) < (dead_letters.broker_ts, dead_letters.evidence)
        THEN EXCLUDED.broker_ts ELSE dead_letters.broker_ts END,
    headers = CASE WHEN (EXCLUDED.broker_ts, EXCLUDED.evidence) < (dead_letters.broker_ts, dead_letters.evidence)
        THEN EXCLUDED.headers ELSE dead_letters.headers END,
    evidence = CASE WHEN (EXCLUDED.broker_ts, EXCLUDED.evidence) < (dead_letters.broker_ts, dead_letters.evidence)
        THEN EXCLUDED.evidence ELSE dead_letters.evidence END,
    kind = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.kind ELSE dead_letters.kind END,
    error = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.error ELSE dead_letters.error END,
    error_class = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.error_class ELSE dead_letters.error_class END,
    job_id = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.job_id ELSE dead_letters.job_id END,
    stage = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.stage ELSE dead_letters.stage END,
    attempt = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.attempt ELSE dead_letters.attempt END,
    attempts = CASE WHEN dead_letters.kind = 'projection' THEN EXCLUDED.attempts ELSE dead_letters.attempts END;

-- name: mark_dead_letter_replayed
-- An operator's JobReplayed was applied: the dead letter is replayed (first replay wins).
UPDATE dead_letters SET replayed_at = COALESCE(replayed_at, %(broker_ts)s),
    replayed_by = COALESCE(replayed_by, %(operator)s), replay_reason = COALESCE(replay_reason, %(reason)s)
WHERE id = %(id)s;

-- name: mark_dead_letter_dismissed
-- An operator's DeadLetterDismissed was folded: the dead letter is dismissed (first dismissal wins).
UPDATE dead_letters SET dismissed_at = COALESCE(dismissed_at, %(broker_ts)s),
    dismissed_by = COALESCE(dismissed_by, %(operator)s), dismiss_reason = COALESCE(dismiss_reason, %(reason)s)
WHERE id = %(id)s;

-- name: dead_letters_list
-- Dead letters, newest first; `reason` filters on the error class (NULL: all); `pending` hides replayed
-- and dismissed ones.
SELECT id, kind, job_id, stage, attempt, error_class, attempts, error, topic, partition, "offset", broker_ts,
       seen_by, replayed_at, replayed_by, replay_reason, dismissed_at, dismissed_by, dismiss_reason,
       octet_length(value) AS value_bytes
FROM dead_letters
WHERE (%(reason)s::text IS NULL OR error_class = %(reason)s)
  AND (NOT %(pending)s OR (replayed_at IS NULL AND dismissed_at IS NULL))
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

-- name: projector_next_offset
-- The next offset a projection will apply of one partition (no row: nothing applied yet).
SELECT next_offset FROM projector_offsets WHERE projection = %(projection)s AND topic = %(topic)s AND partition = %(partition)s;

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
SELECT topic, partition, "offset", broker_ts, event_id, event_type, stage, attempt, claim_token, occurred_at,
       recorded_by, causation_id, dedup_key, applied, superseded, duplicate, payload
FROM lifecycle_evidence WHERE job_id = %(job_id)s ORDER BY broker_ts, partition, "offset";

-- name: job_source
-- A job's source: the upload (filename, size, sha256, upload time) and what intake's probe found (JobAccepted's media).
SELECT j.job_id, j.upload_id, j.source_key, j.source_sha256, j.source_size_bytes,
       u.filename, u.size_bytes AS upload_size_bytes, u.sha256 AS upload_sha256, u.broker_ts AS uploaded_at,
       a.payload->'media' AS media
FROM job_state j
LEFT JOIN uploads u ON u.upload_id = j.upload_id
LEFT JOIN LATERAL (
    SELECT e.payload FROM lifecycle_evidence e
    WHERE e.job_id = j.job_id AND e.event_type = 'JobAccepted'
    ORDER BY e.applied DESC, e.broker_ts LIMIT 1
) a ON true
WHERE j.job_id = %(job_id)s;

-- name: jobs_with_source
-- Other jobs of the same source bytes (sha256), newest first, with how each ended (index job_state_reuse).
SELECT job_id, state, stage, attempts, error_class, reason, created_at, completed_at
FROM job_state
WHERE source_sha256 = %(sha256)s AND job_id <> %(job_id)s
ORDER BY created_at DESC
LIMIT %(limit)s;

-- name: count_events_of_type
-- How many committed events of one type a job has (evidence, duplicates included).
SELECT count(*) AS n FROM lifecycle_evidence WHERE job_id = %(job_id)s AND event_type = %(event_type)s;

-- name: event_recorded
-- Whether the projection holds the committed event `event_id` of a job (a writer that does not know
-- whether its commit landed asks before it writes the same events again).
SELECT EXISTS (SELECT 1 FROM lifecycle_evidence WHERE job_id = %(job_id)s AND event_id = %(event_id)s) AS recorded;

-- name: set_stage_stall_policy
-- The stages' own no-progress timeouts (domain/pipeline.py `no_progress_s`), seconds: exactly the given stages.
WITH gone AS (DELETE FROM stage_stall_policy WHERE stage <> ALL(%(stages)s::text[]))
INSERT INTO stage_stall_policy (stage, no_progress_timeout_s)
SELECT * FROM unnest(%(stages)s::text[], %(no_progress_s)s::double precision[])
ON CONFLICT (stage) DO UPDATE SET no_progress_timeout_s = EXCLUDED.no_progress_timeout_s, updated_at = now();

-- name: log_clock_newest
-- The newest log clock of all partitions (broker time), or now() before any record was projected.
SELECT coalesce(max(now), now()) AS now FROM log_clock;

-- name: advance_log_clock
-- Move one partition's log clock forward (never backwards).
INSERT INTO log_clock (partition, now) VALUES (%(partition)s, %(now)s)
ON CONFLICT (partition) DO UPDATE SET now = GREATEST(log_clock.now, EXCLUDED.now);

-- name: stalled_attempts
-- Running attempts that stopped moving (lease_expired or no_progress), oldest first.
SELECT * FROM stalled_attempts ORDER BY since_s DESC;

-- name: suspect_attempts
-- Running attempts still for more than the suspect fraction of their allowance, not stalled yet (migration 032).
SELECT * FROM suspect_attempts ORDER BY last_progress_at;

-- name: recent_attempt_stalls
-- Attempt stalls judged at most %(window_s)s seconds ago (log clock), newest first, with what was done (migration 032).
SELECT * FROM recent_attempt_stalls
WHERE detected_at >= (SELECT max(now) FROM log_clock) - make_interval(secs => %(window_s)s)
  AND age_s <= %(window_s)s
ORDER BY detected_at DESC;

-- name: stalled_handoffs
-- Queued stages nobody claimed in time (re-driven or due for it).
SELECT * FROM stalled_handoffs ORDER BY since_s DESC;

-- name: handoffs_due
-- Stalled handoffs whose timeout has passed since they were queued or last re-driven: the watchdog re-drives these.
SELECT * FROM stalled_handoffs WHERE redrive_due ORDER BY since_s DESC;

-- name: waiting_jobs
-- Retries and hand-overs waiting for their backoff or a free worker, longest waiting first.
SELECT * FROM waiting_jobs ORDER BY since_s DESC;

-- name: expected_work_missing
-- Uploads that never became jobs.
SELECT * FROM expected_work_missing ORDER BY since_s DESC;

-- name: expected_work_unreported
-- Uploads that never became jobs and the watchdog has not reported yet: it reports these, once.
SELECT * FROM expected_work_missing WHERE NOT reported ORDER BY since_s DESC;

-- name: set_stall_policy
-- The watchdog's thresholds, seconds.
UPDATE stall_policy SET no_progress_timeout_s = %(no_progress_timeout_s)s, handoff_timeout_s = %(handoff_timeout_s)s,
    intake_timeout_s = %(intake_timeout_s)s, suspect_fraction = %(suspect_fraction)s, updated_at = now();

-- name: log_clock
-- The log clock of every partition.
SELECT partition, now FROM log_clock ORDER BY partition;

-- name: log_clock_latest
-- The newest log clock of any partition (NULL before the first event) and the database's clock: the
-- dashboard's "watchdog not ticking" compares them.
SELECT max(now) AS latest, now() AS db_now FROM log_clock;

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
ORDER BY queued_at,
         -- ties in pipeline order: the stage's place in the job's recorded stages (domain/pipeline.py),
         -- else the fixed order of jobs accepted before profiles (intake, transcode, publish)
         coalesce((SELECT p.i FROM job_state j, jsonb_array_elements_text(j.pipeline_stages) WITH ORDINALITY AS p(name, i)
                   WHERE j.job_id = %(job_id)s AND p.name = stage LIMIT 1),
                  CASE stage WHEN 'intake' THEN 0 WHEN 'transcode' THEN 1 ELSE 2 END);

-- name: provider_gate_lock
-- The provider's check-and-reserve lock (transaction-scoped), and the PostgreSQL clock every quota and cooldown uses.
SELECT pg_advisory_xact_lock(%(lock_class)s, %(lock_id)s), clock_timestamp() AS now;

-- name: provider_breaker
-- One provider's breaker row (migration 014), or nothing while it has never changed (closed).
SELECT * FROM provider_state WHERE provider = %(provider)s;

-- name: apply_provider_breaker_changed
-- Apply one ProviderBreakerChanged (its evidence payload and envelope values) to provider_state, as the
-- projector's trigger does.
SELECT apply_provider_breaker_changed(%(payload)s::jsonb, %(event_id)s, %(job_id)s, %(occurred_at)s);

-- name: provider_call_ends
-- When each call that may still occupy a quota window of one provider ended: reservations (in flight: now; its worker gone after stale_s: reserved_at + stale_s) and, for jobs without a reservation, applied Published events (broker time).
SELECT coalesce(done_at, least(%(now)s::timestamptz, reserved_at + make_interval(secs => %(stale_s)s))) AS ends_at
FROM provider_calls
WHERE provider = %(provider)s AND coalesce(done_at, reserved_at + make_interval(secs => %(stale_s)s)) > %(since)s
UNION ALL
SELECT e.broker_ts FROM lifecycle_evidence e
WHERE e.event_type = 'Published' AND e.applied AND e.payload->>'provider' = %(provider)s AND e.broker_ts > %(since)s
  AND NOT EXISTS (SELECT 1 FROM provider_calls c WHERE c.provider = %(provider)s AND c.job_id = e.job_id);

-- name: reserve_provider_call
-- Reserve one call to a provider (under provider_gate_lock); returns its id.
INSERT INTO provider_calls (provider, job_id, attempt, claim_token, reserved_at)
VALUES (%(provider)s, %(job_id)s, %(attempt)s, %(claim_token)s, %(now)s) RETURNING id;

-- name: finish_provider_call
-- A reserved call ended (posted | failed) at the database's clock.
UPDATE provider_calls SET done_at = clock_timestamp(), outcome = %(outcome)s WHERE id = %(id)s;

-- name: release_provider_call
-- A reserved call that never reached the provider (refused with 429, no connection, or not made): it counts for no quota.
DELETE FROM provider_calls WHERE id = %(id)s;

-- name: forget_provider_calls
-- Reservations that can no longer occupy any quota window.
DELETE FROM provider_calls WHERE provider = %(provider)s AND coalesce(done_at, reserved_at) < %(before)s;

-- name: provider_overview
-- Every provider seen (breaker row, reservation, or deferral) with its breaker, last wait, and posts in the last %(minute_s)s and %(day_s)s seconds (reservations and, for jobs without one, applied Published events).
WITH names AS (
    SELECT provider FROM provider_state UNION SELECT provider FROM provider_calls UNION SELECT provider FROM provider_waits
), posts AS (
    SELECT provider, coalesce(done_at, clock_timestamp()) AS ends_at FROM provider_calls
    UNION ALL
    SELECT e.payload->>'provider', e.broker_ts FROM lifecycle_evidence e
    WHERE e.event_type = 'Published' AND e.applied AND e.broker_ts > clock_timestamp() - make_interval(secs => %(day_s)s)
      AND e.payload->>'provider' IN (SELECT provider FROM names)
      AND NOT EXISTS (SELECT 1 FROM provider_calls c WHERE c.provider = e.payload->>'provider' AND c.job_id = e.job_id)
)
SELECT n.provider, coalesce(s.state, 'closed') AS state, s.until, coalesce(s.failures, 0) AS failures, s.probe_job,
       s.reason, s.http_status, coalesce(s.version, 0) AS version, s.changed_at,
       (SELECT count(*) FROM posts p WHERE p.provider = n.provider
          AND p.ends_at > clock_timestamp() - make_interval(secs => %(minute_s)s)) AS posts_minute,
       (SELECT count(*) FROM posts p WHERE p.provider = n.provider
          AND p.ends_at > clock_timestamp() - make_interval(secs => %(day_s)s)) AS posts_day,
       w.wait AS last_wait, w.until AS last_wait_until, w."window" AS last_wait_window, coalesce(w.deferrals, 0) AS deferrals
FROM names n
LEFT JOIN provider_state s ON s.provider = n.provider
LEFT JOIN provider_waits w ON w.provider = n.provider
ORDER BY n.provider;

-- name: checkpointed_media
-- Media seconds each given job's stages hold in applied checkpoints, per rendition: the end of its furthest segment (a retry resumes after them; projections/presenter.py percent_done counts them as done).
SELECT job_id, stage, payload->>'rendition' AS rendition,
       max((payload->>'media_start_s')::float8 + (payload->>'media_duration_s')::float8) AS done_s
FROM lifecycle_evidence
WHERE job_id = ANY(%(job_ids)s) AND event_type = 'CheckpointRecorded' AND applied AND NOT superseded AND NOT duplicate
GROUP BY job_id, stage, payload->>'rendition';

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
-- Dead letters in total and pending (neither replayed nor dismissed).
SELECT count(*) AS total, count(*) FILTER (WHERE replayed_at IS NULL AND dismissed_at IS NULL) AS pending
FROM dead_letters;

-- name: database_now
-- The database's clock (UTC): the "now" of wall-clock figures such as throughput windows.
SELECT now() AS now;

-- name: submitter_jobs_between
-- Jobs accepted (not rejected) from one submitter's uploads made in [since, until) (broker time), less those an operator failed with a refund (an applied JobFailed with refunded: `tapeline dlq fail --refund`).
SELECT count(*) AS jobs FROM uploads u JOIN job_state j ON j.job_id = u.job_id
WHERE u.submitter = %(submitter)s AND u.broker_ts >= %(since)s AND u.broker_ts < %(until)s AND j.state <> 'rejected'
  AND NOT (j.state = 'failed' AND EXISTS (SELECT 1 FROM lifecycle_evidence f WHERE f.job_id = j.job_id
                                          AND f.event_type = 'JobFailed' AND f.applied
                                          AND (f.payload->>'refunded')::boolean));

-- name: referenced_object_keys
-- Object keys a recorded checkpoint (applied, not superseded, not duplicate) or an applied transcode completion of the given jobs names (the watchdog's cleanup keeps them).
SELECT payload->>'object_key' AS key FROM lifecycle_evidence
WHERE job_id = ANY(%(job_ids)s) AND event_type = 'CheckpointRecorded' AND applied AND NOT superseded AND NOT duplicate
UNION
SELECT o->>'key' FROM lifecycle_evidence e CROSS JOIN LATERAL json_array_elements(COALESCE(e.payload->'outputs', '[]'::json)) o
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

-- name: intake_admission_lock
-- Serialise the HTTP intake's admission decisions (capacity checks and claims) for the current transaction.
SELECT pg_advisory_xact_lock(hashtext('tapeline.intake.admission'));

-- name: intake_upload_by_key
-- The HTTP intake's row of one (submitter, Idempotency-Key), if any; `abandoned`: still uploading but its claim was not renewed for %(lease_s)s seconds (its intake went away); `expired`: published more than %(retention_s)s seconds ago.
SELECT *, (state = 'uploading' AND updated_at < now() - make_interval(secs => %(lease_s)s)) AS abandoned,
       (state = 'published' AND updated_at < now() - make_interval(secs => %(retention_s)s)) AS expired
FROM intake_uploads WHERE submitter = %(submitter)s AND idempotency_key = %(key)s;

-- name: upload_by_id
-- The projected upload (UploadCompleted) of one upload id, if the projection has it.
SELECT upload_id, job_id, sha256, size_bytes FROM uploads WHERE upload_id = %(upload_id)s;

-- name: intake_upload_claim
-- Claim an upload at admission (state uploading); nothing returned when the (submitter, key) is already claimed.
INSERT INTO intake_uploads (upload_id, job_id, submitter, idempotency_key, priority, profile, filename, state)
VALUES (%(upload_id)s, %(job_id)s, %(submitter)s, %(key)s, %(priority)s, %(profile)s, %(filename)s, 'uploading')
ON CONFLICT DO NOTHING
RETURNING upload_id, created_at;

-- name: intake_upload_renew
-- Renew a claim (its request still runs); nothing returned when the claim is gone (released, or taken over after it lapsed).
UPDATE intake_uploads SET updated_at = now()
WHERE upload_id = %(upload_id)s AND created_at = %(claimed_at)s AND state = 'uploading'
RETURNING upload_id;

-- name: intake_uploads_renew
-- Renew many claims at once (one intake's ClaimKeeper); returns the claims still held.
UPDATE intake_uploads AS i SET updated_at = now()
FROM unnest(%(upload_ids)s::text[], %(claimed_ats)s::timestamptz[]) AS c(upload_id, created_at)
WHERE i.upload_id = c.upload_id AND i.created_at = c.created_at AND i.state = 'uploading'
RETURNING i.upload_id, i.created_at;

-- name: intake_uploads_expire
-- Delete abandoned claims (uploading, not renewed for %(lease_s)s seconds) and published rows older than %(retention_s)s seconds; returns what went.
DELETE FROM intake_uploads
WHERE (state = 'uploading' AND updated_at < now() - make_interval(secs => %(lease_s)s))
   OR (state = 'published' AND updated_at < now() - make_interval(secs => %(retention_s)s))
RETURNING state;

-- name: intake_upload_published
-- Record a published upload with the response every replay of its Idempotency-Key gets.
UPDATE intake_uploads SET state = 'published', sha256 = %(sha256)s, size_bytes = %(size_bytes)s,
       response = %(response)s, updated_at = now()
WHERE upload_id = %(upload_id)s AND created_at = %(claimed_at)s;

-- name: intake_upload_release
-- Forget an upload that failed before it was published (its key may be used again); only this claim's row.
DELETE FROM intake_uploads WHERE upload_id = %(upload_id)s AND created_at = %(claimed_at)s AND state = 'uploading';

-- name: intake_pending_by_tier
-- Uploads the HTTP intake admitted whose job the projection does not know yet (uploading with a claim renewed in the last %(lease_s)s seconds, or published in the last %(window_s)s seconds and not yet decided), per tier.
SELECT i.priority AS tier, count(*) AS pending FROM intake_uploads i
WHERE ((i.state = 'uploading' AND i.updated_at >= now() - make_interval(secs => %(lease_s)s))
       OR (i.state = 'published' AND i.updated_at >= now() - make_interval(secs => %(window_s)s)))
  AND NOT EXISTS (SELECT 1 FROM job_state j WHERE j.job_id = i.job_id)
GROUP BY 1;

-- name: submitter_in_flight
-- Jobs of one submitter accepted and not ended (job_state, joined through uploads; %(ended_states)s: the lifecycle's final and reopenable states), plus its HTTP uploads the projection does not know yet.
SELECT (SELECT count(*) FROM uploads u JOIN job_state j ON j.job_id = u.job_id
        WHERE u.submitter = %(submitter)s
          AND j.state <> ALL(%(ended_states)s))
     + (SELECT count(*) FROM intake_uploads i
        WHERE i.submitter = %(submitter)s
          AND ((i.state = 'uploading' AND i.updated_at >= now() - make_interval(secs => %(lease_s)s))
               OR (i.state = 'published' AND i.updated_at >= now() - make_interval(secs => %(window_s)s)))
          AND NOT EXISTS (SELECT 1 FROM job_state j WHERE j.job_id = i.job_id))
       AS in_flight;

-- name: submitter_tier_load
-- One submitter's load in one tier (its share of the tier's slots, domain/policy/admission.py): its jobs of the tier accepted and not ended (%(ended_states)s), plus its HTTP uploads of the tier the projection does not know yet.
SELECT (SELECT count(*) FROM uploads u JOIN job_state j ON j.job_id = u.job_id
        WHERE u.submitter = %(submitter)s AND j.priority = %(tier)s
          AND j.state <> ALL(%(ended_states)s))
     + (SELECT count(*) FROM intake_uploads i
        WHERE i.submitter = %(submitter)s AND i.priority = %(tier)s
          AND ((i.state = 'uploading' AND i.updated_at >= now() - make_interval(secs => %(lease_s)s))
               OR (i.state = 'published' AND i.updated_at >= now() - make_interval(secs => %(window_s)s)))
          AND NOT EXISTS (SELECT 1 FROM job_state j WHERE j.job_id = i.job_id))
       AS held;

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

-- name: transaction_lock_timeout
-- SET LOCAL lock_timeout for the rest of this transaction (`timeout`: text such as '1500ms').
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: provider_slot_try_lock
-- Try to take one of a provider's in-flight slots (a session advisory lock); `got` says whether it was free.
SELECT pg_try_advisory_lock(%(lock_class)s, %(slot)s) AS got;

-- name: provider_slot_unlock
-- Give an in-flight slot back.
SELECT pg_advisory_unlock(%(lock_class)s, %(slot)s);

-- name: watchdog_try_leader
-- Try to become the deployment's watchdog leader (a session advisory lock on the leader's own connection).
SELECT pg_try_advisory_lock(%(lock_class)s, hashtext(%(key)s)) AS got;

-- name: session_alive
-- A round trip that fails when the session (and any advisory lock it holds) is gone.
SELECT 1;

-- name: projection_missing
-- Whether the connection's schema has no projection tables yet.
SELECT to_regclass('job_state') IS NULL AS missing;

-- name: all_job_rows
-- Every job row (the chaos audit compares them with a fold of the log).
SELECT * FROM job_state;

-- name: reader_can_read
-- One read the read-only role must be allowed (tapeline serve checks it before starting).
SELECT 1 FROM job_state LIMIT 1;

-- name: current_role
-- The role the connection acts as.
SELECT current_user AS role;

-- name: set_role
-- Act as {role} for the rest of the session (the read API's pool runs as the read-only role).
SET ROLE {role};

-- name: running_attempt_deadlines
-- Running attempts with what their stall deadline is made of (domain/policy/stall.py attempt_deadline) and their partition's log clock: the watchdog wakes at the earliest.
SELECT j.job_id, j.stage, j.leased_until, j.progress_at, j.progress_grace_s, c.now AS log_now
FROM job_state j JOIN log_clock c ON c.partition = j.log_partition
WHERE j.state = 'running';

-- name: next_retry_due_in
-- Seconds on their partitions' log clocks until the earliest scheduled retry that is not yet due (NULL: none).
SELECT min(EXTRACT(EPOCH FROM j.retry_due_at - c.now))::double precision AS due_in_s
FROM job_state j JOIN log_clock c ON c.partition = j.log_partition
WHERE j.state = 'retry_scheduled' AND j.retry_due_at > c.now;

-- name: webhook_endpoint_insert
-- Register one webhook endpoint (migration 025); returns it without its secret.
INSERT INTO webhook_endpoints (endpoint_id, submitter, url, secret, event_types)
VALUES (%(endpoint_id)s, %(submitter)s, %(url)s, %(secret)s, %(event_types)s)
RETURNING endpoint_id, submitter, url, event_types, enabled, created_at;

-- name: webhook_endpoints_list
-- Webhook endpoints (of one submitter when %(submitter)s is not null), oldest first, with their delivery counts by state; never the secret.
SELECT e.endpoint_id, e.submitter, e.url, e.event_types, e.enabled, e.created_at, e.disabled_at, e.disabled_reason,
       e.failing_since, e.last_success_at,
       count(d.*) FILTER (WHERE d.state = 'delivered') AS delivered,
       count(d.*) FILTER (WHERE d.state IN ('pending', 'retry_scheduled', 'failed')) AS pending,
       count(d.*) FILTER (WHERE d.state = 'dead_lettered') AS dead_lettered
FROM webhook_endpoints e LEFT JOIN webhook_deliveries d ON d.endpoint_id = e.endpoint_id
WHERE %(submitter)s::text IS NULL OR e.submitter = %(submitter)s
GROUP BY e.endpoint_id ORDER BY e.created_at, e.endpoint_id;

-- name: webhook_endpoint_set_enabled
-- Disable (with a reason) or re-enable one endpoint; re-enabling clears its failure streak, and so does an operator's disable (%(for_failing)s false): only the notifier's disable for failing (%(for_failing)s true) keeps it, which is what the TapelineWebhookEndpointDisabled alert and the dashboard's strip count. Returns the endpoint id, or nothing when unknown.
UPDATE webhook_endpoints SET enabled = %(enabled)s,
       disabled_at = CASE WHEN %(enabled)s THEN NULL ELSE coalesce(disabled_at, now()) END,
       disabled_reason = CASE WHEN %(enabled)s THEN NULL ELSE %(reason)s END,
       failing_since = CASE WHEN %(enabled)s OR NOT %(for_failing)s THEN NULL ELSE failing_since END
WHERE endpoint_id = %(endpoint_id)s RETURNING endpoint_id;

-- name: webhook_endpoint_remove
-- Remove one endpoint (its deliveries stay as history; the notifier dead-letters the ones not done). Returns the endpoint id, or nothing when unknown.
DELETE FROM webhook_endpoints WHERE endpoint_id = %(endpoint_id)s RETURNING endpoint_id;

-- name: notify_new_deliveries
-- Lifecycle events a customer wants notified of and not yet intended for that endpoint (a JobReplayed only once an event it caused is projected, and not the one `tapeline dlq fail` writes before its JobFailed): applied events of the types in %(event_types)s (mapped to %(notification_types)s) of jobs whose upload's submitter has an enabled endpoint registered at or before the event, appended at or after %(since)s (the lookback: it bounds the scan), oldest first.
SELECT e.event_id, e.event_type, e.job_id, e.dedup_key, e.broker_ts, m.notification_type, ep.endpoint_id
FROM lifecycle_evidence e
JOIN unnest(%(event_types)s::text[], %(notification_types)s::text[]) AS m(event_type, notification_type)
    ON m.event_type = e.event_type
JOIN uploads u ON u.job_id = e.job_id
JOIN webhook_endpoints ep ON ep.submitter = u.submitter AND ep.enabled AND e.broker_ts >= ep.created_at
    AND m.notification_type = ANY (ep.event_types)
WHERE e.event_type IN ('JobCompleted', 'JobRejected', 'JobFailed', 'JobDeadLettered', 'NeedsReview', 'JobReplayed',
                       'JobCancelled', 'JobDelayed') AND e.applied AND e.broker_ts >= %(since)s
  AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.source_dedup_key = e.dedup_key
                  AND d.endpoint_id = ep.endpoint_id)
  -- A JobReplayed is committed with what it causes (causation_id = its event id): the next StageQueued,
  -- Published + JobCompleted, or the JobFailed of `tapeline dlq fail`, which is notified instead. The
  -- projector may apply one transaction in two batches, so it is notified only once what it caused is
  -- projected too, and never when that is a JobFailed.
  AND (e.event_type <> 'JobReplayed'
       OR (EXISTS (SELECT 1 FROM lifecycle_evidence c WHERE c.job_id = e.job_id AND c.causation_id = e.event_id)
           AND NOT EXISTS (SELECT 1 FROM lifecycle_evidence f WHERE f.job_id = e.job_id AND f.event_type = 'JobFailed'
                           AND f.causation_id = e.event_id)))
ORDER BY e.broker_ts, e.event_id LIMIT %(limit)s;

-- name: notify_due_deliveries
-- Deliveries to send now: pending, or a retry due at or before %(now)s, to enabled endpoints; the oldest %(per_endpoint)s of each endpoint (no more can be in flight to it), so an endpoint with many due deliveries never hides another's; oldest first.
SELECT delivery_id, job_id, endpoint_id, state, tries FROM (
    SELECT d.delivery_id, d.job_id, d.endpoint_id, d.state, d.tries, coalesce(d.next_try_at, d.intended_at) AS due,
           row_number() OVER (PARTITION BY d.endpoint_id
                              ORDER BY coalesce(d.next_try_at, d.intended_at), d.delivery_id) AS nth
    FROM webhook_deliveries d JOIN webhook_endpoints ep ON ep.endpoint_id = d.endpoint_id AND ep.enabled
    WHERE d.state = 'pending' OR (d.state = 'retry_scheduled' AND d.next_try_at <= %(now)s)) due
WHERE nth <= %(per_endpoint)s
ORDER BY due, delivery_id LIMIT %(limit)s;

-- name: notify_orphaned_deliveries
-- Deliveries not done whose endpoint was removed: the notifier dead-letters them.
SELECT d.delivery_id, d.job_id, d.endpoint_id, d.tries FROM webhook_deliveries d
WHERE d.state IN ('pending', 'retry_scheduled', 'failed')
  AND NOT EXISTS (SELECT 1 FROM webhook_endpoints ep WHERE ep.endpoint_id = d.endpoint_id)
LIMIT %(limit)s;

-- name: notify_delivery
-- One delivery with what its POST needs: the endpoint (url, secret, enabled) and the lifecycle event notified (type, broker time, payload).
SELECT d.*, ep.url, ep.secret, ep.enabled, ep.submitter, e.event_type AS source_event_type,
       e.broker_ts AS source_broker_ts, e.payload AS source_payload, e.stage AS source_stage,
       e.attempt AS source_attempt
FROM webhook_deliveries d
LEFT JOIN webhook_endpoints ep ON ep.endpoint_id = d.endpoint_id
LEFT JOIN LATERAL (SELECT * FROM lifecycle_evidence x WHERE x.event_id = d.source_event_id LIMIT 1) e ON true
WHERE d.delivery_id = %(delivery_id)s;

-- name: apply_webhook_delivery
-- Apply one Notification* event (its evidence payload, type and envelope values) to webhook_deliveries, as the projector's trigger does.
SELECT apply_webhook_delivery(%(payload)s::jsonb, %(event_type)s, %(job_id)s, %(occurred_at)s);

-- name: webhook_endpoint_failed
-- Start (or continue) an endpoint's failure streak at %(now)s (not for an endpoint disabled meanwhile: an operator's disable ended it); returns when it began and whether the endpoint is enabled.
UPDATE webhook_endpoints SET failing_since = CASE WHEN enabled THEN coalesce(failing_since, %(now)s) ELSE failing_since END
WHERE endpoint_id = %(endpoint_id)s RETURNING failing_since, enabled, submitter;

-- name: webhook_endpoint_succeeded
-- End an endpoint's failure streak: it answered 2xx at %(now)s.
UPDATE webhook_endpoints SET failing_since = NULL, last_success_at = %(now)s WHERE endpoint_id = %(endpoint_id)s;

-- name: webhook_endpoints_in_trouble
-- Endpoints failing without a success since failing_since (enabled), or disabled while failing (the notifier disables keeping failing_since; an operator's disable clears it), oldest streak first; each with its deliveries not delivered since the streak began and up to %(jobs)s of their job ids, newest first. Never the secret.
SELECT e.endpoint_id, e.submitter, e.enabled, e.failing_since,
       (SELECT count(*) FROM webhook_deliveries d WHERE d.endpoint_id = e.endpoint_id AND d.state <> 'delivered'
          AND d.updated_at >= e.failing_since) AS waiting,
       ARRAY(SELECT j.job_id FROM (SELECT d.job_id, max(d.updated_at) AS at FROM webhook_deliveries d
                                   WHERE d.endpoint_id = e.endpoint_id AND d.state <> 'delivered'
                                     AND d.updated_at >= e.failing_since GROUP BY d.job_id) j
             ORDER BY j.at DESC, j.job_id LIMIT %(jobs)s) AS jobs
FROM webhook_endpoints e WHERE e.failing_since IS NOT NULL
ORDER BY e.failing_since, e.endpoint_id;

-- name: webhook_delivery_states
-- Deliveries by state, and endpoints enabled and failing (for the notifier's gauges).
SELECT (SELECT coalesce(jsonb_object_agg(state, n), '{}'::jsonb)
        FROM (SELECT state, count(*) AS n FROM webhook_deliveries GROUP BY state) s) AS states,
       (SELECT count(*) FROM webhook_endpoints WHERE enabled AND failing_since IS NOT NULL) AS failing_endpoints,
       (SELECT count(*) FROM webhook_endpoints WHERE NOT enabled) AS disabled_endpoints,
       (SELECT count(*) FROM webhook_endpoints WHERE NOT enabled AND failing_since IS NOT NULL) AS disabled_failing_endpoints;

-- name: earlier_intent_lost_with_region
-- The earlier publish attempt of a job that recorded its intent to call `provider` (PublishIntended)
-- and was lost with its region (StallDetected region_lost, `tapeline region failover`): its post may
-- exist, and its claim marker is in the lost region's store (markers are not replicated), so the log
-- is the only witness. NULL when there is none. Within one region the marker is the witness.
SELECT i.attempt
FROM lifecycle_evidence i
JOIN lifecycle_evidence s
  ON s.job_id = i.job_id AND s.event_type = 'StallDetected' AND s.stage = i.stage AND s.attempt = i.attempt
 AND s.applied AND s.payload->>'kind' = 'region_lost'
WHERE i.job_id = %(job_id)s AND i.event_type = 'PublishIntended' AND i.stage = 'publish'
  AND i.attempt < %(attempt)s AND i.payload->>'provider' = %(provider)s
ORDER BY i.attempt DESC
LIMIT 1;
