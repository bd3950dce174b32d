-- 002: lease and stall detection. "now" is the log's own clock per partition of the lifecycle log
-- (the broker's LogAppendTime of the newest record there, advanced by the watchdog's ticks), never
-- a machine's clock, so skewed workers agree and a replay reaches the same decisions.

ALTER TABLE job_state
    ADD COLUMN log_partition      integer,          -- partition of the lifecycle log holding this job
    ADD COLUMN queued_at          timestamptz,      -- broker time the current stage attempt was queued (or last re-driven)
    ADD COLUMN yields             integer NOT NULL DEFAULT 0,  -- graceful yields (they do not use up an attempt)
    ADD COLUMN redrives           integer NOT NULL DEFAULT 0,  -- stalled handoffs re-driven by the watchdog
    ADD COLUMN audio_playlist_key text,             -- audio rendition playlist of the last transcode
    ADD COLUMN last_heartbeat_at  timestamptz;      -- broker time of the last claim or heartbeat

-- The log clock: newest broker timestamp seen per partition of the lifecycle log.
CREATE TABLE log_clock (
    partition  integer PRIMARY KEY,
    now        timestamptz NOT NULL               -- LogAppendTime of the newest record (ticks included)
);

-- Stall thresholds, seconds; written by the watchdog from its settings at start (one row).
CREATE TABLE stall_policy (
    id                    boolean PRIMARY KEY DEFAULT true CHECK (id),
    no_progress_timeout_s double precision NOT NULL DEFAULT 120,  -- progress counters frozen this long = no_progress
    handoff_timeout_s     double precision NOT NULL DEFAULT 120,  -- queued this long without a claim = stalled handoff
    intake_timeout_s      double precision NOT NULL DEFAULT 120,  -- an upload with no job this long = expected work missing
    updated_at            timestamptz NOT NULL DEFAULT now()
);
INSERT INTO stall_policy DEFAULT VALUES;

-- Running attempts that stopped moving. kind: lease_expired (no claim/heartbeat within the lease)
-- or no_progress (heartbeats arrive, counters frozen for no_progress_timeout_s). since_s: seconds
-- on the log clock since the last heartbeat (lease_expired) or the last progress (no_progress).
CREATE VIEW stalled_attempts AS
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
  AND (j.leased_until < c.now OR j.progress_at + make_interval(secs => p.no_progress_timeout_s) < c.now);

-- A stage was queued but no worker claimed it within handoff_timeout_s (log clock).
CREATE VIEW stalled_handoffs AS
SELECT j.job_id, j.stage, j.attempt, j.yields, j.redrives, j.log_partition, c.now AS log_now, j.queued_at,
       EXTRACT(EPOCH FROM c.now - j.queued_at)::double precision AS since_s
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
WHERE j.state = 'queued' AND j.queued_at + make_interval(secs => p.handoff_timeout_s) < c.now;

-- An upload with no job after intake_timeout_s on the newest log clock, not yet reported.
CREATE VIEW expected_work_missing AS
SELECT u.upload_id, u.job_id, u.broker_ts AS uploaded_at, clock.now AS log_now,
       EXTRACT(EPOCH FROM clock.now - u.broker_ts)::double precision AS since_s
FROM uploads u
CROSS JOIN (SELECT max(now) AS now FROM log_clock) clock
CROSS JOIN stall_policy p
WHERE clock.now IS NOT NULL
  AND u.broker_ts + make_interval(secs => p.intake_timeout_s) < clock.now
  AND NOT EXISTS (SELECT 1 FROM job_state j WHERE j.job_id = u.job_id)
  AND NOT EXISTS (SELECT 1 FROM lifecycle_evidence e WHERE e.job_id = u.job_id AND e.event_type = 'StallDetected');
