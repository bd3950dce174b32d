-- 001: the walking skeleton's projections. Every timestamp is timestamptz in UTC; "broker time"
-- means the Kafka record's LogAppendTime, the one clock every lease and age is computed from.

-- Where each projection has read up to: the next offset to apply, per topic partition. Written in
-- the same transaction as the rows it accounts for, so a restart neither repeats nor skips.
CREATE TABLE projector_offsets (
    projection   text    NOT NULL,            -- projection name, e.g. 'main'
    topic        text    NOT NULL,
    partition    integer NOT NULL,
    next_offset  bigint  NOT NULL,            -- first offset not yet applied (control markers included)
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (projection, topic, partition)
);

-- Current state of each job: one row per job, a fold over its events in log order.
CREATE TABLE job_state (
    job_id              text PRIMARY KEY,     -- uuid5(namespace, upload_id)
    upload_id           text NOT NULL,
    state               text NOT NULL,        -- accepted|queued|running|retry_scheduled|completed|rejected|failed|dead_lettered|needs_review|cancelled
    stage               text NOT NULL,        -- intake|transcode|publish
    attempt             integer NOT NULL DEFAULT 0,  -- current attempt number of `stage` (1-based)
    attempts            integer NOT NULL DEFAULT 0,  -- highest attempt number any stage reached (1 for a clean run)
    claim_token         text,                 -- claim token of the current attempt; other tokens are superseded
    worker              text,                 -- worker holding the current attempt
    priority            text,                 -- archive|standard|index
    profile             text,
    source_key          text,                 -- object key of the uploaded source
    source_sha256       text,                 -- hex
    source_size_bytes   bigint,
    source_duration_s   double precision,     -- seconds, from ffprobe at intake
    source_width        integer,              -- display width, pixels
    source_height       integer,              -- display height, pixels
    ladder              jsonb,                -- planned renditions [{name,width,height,video_bitrate_kbps}]
    outputs             jsonb,                -- objects the last successful transcode attempt wrote [{key,sha256,size_bytes,content_type}]
    renditions          jsonb,                -- published renditions [{name,width,height,playlist_key,url}]
    master_url          text,                 -- public URL of the HLS master playlist once published
    error_class         text,                 -- docs/design.md error class when the job did not complete
    reason              text,                 -- human-readable reason
    lease_s             double precision,     -- lease length of the current attempt, seconds
    leased_until        timestamptz,          -- broker time of the last claim/heartbeat + lease
    progress_frames     bigint,               -- frames encoded by the current attempt
    progress_out_time_s double precision,     -- media seconds encoded by the current attempt
    progress_speed      double precision,     -- x realtime
    progress_at         timestamptz,          -- broker time the progress counters last advanced
    events              integer NOT NULL DEFAULT 0,  -- events applied to this row
    last_event_type     text,
    created_at          timestamptz NOT NULL, -- broker time of the first applied event
    updated_at          timestamptz NOT NULL, -- broker time of the last applied event
    completed_at        timestamptz           -- broker time the job reached a terminal state
);
CREATE INDEX job_state_state ON job_state (state, updated_at);

-- Every record of the lifecycle log, one row each, applied or not: the evidence.
CREATE TABLE lifecycle_evidence (
    topic          text    NOT NULL,
    partition      integer NOT NULL,
    "offset"       bigint  NOT NULL,
    broker_ts      timestamptz NOT NULL,      -- LogAppendTime
    event_id       text NOT NULL,
    event_type     text NOT NULL,
    job_id         text NOT NULL,
    stage          text NOT NULL,
    attempt        integer NOT NULL,
    claim_token    text,
    dedup_key      text NOT NULL,
    occurred_at    timestamptz NOT NULL,      -- the writer's clock (evidence only)
    recorded_by    text NOT NULL,
    causation_id   text,
    applied        boolean NOT NULL,          -- changed job_state
    superseded     boolean NOT NULL,          -- carried a claim token that was no longer current
    duplicate      boolean NOT NULL,          -- its dedup_key had already been applied
    payload        jsonb NOT NULL,            -- the whole decoded event
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX lifecycle_evidence_job ON lifecycle_evidence (job_id, broker_ts);

-- Dedup keys already applied: a later copy of the same event is kept as evidence only.
CREATE TABLE applied_dedup_keys (
    dedup_key  text PRIMARY KEY
);

-- Uploads seen on <prefix>.uploads (one row per upload_id; copies counted).
CREATE TABLE uploads (
    upload_id     text PRIMARY KEY,
    job_id        text NOT NULL,
    filename      text NOT NULL,
    size_bytes    bigint NOT NULL,
    sha256        text NOT NULL,
    priority      text NOT NULL,
    broker_ts     timestamptz NOT NULL,       -- LogAppendTime of the first copy
    copies        integer NOT NULL DEFAULT 1
);

-- Records the projector could not decode, kept raw with their position and the error.
CREATE TABLE dead_letters (
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    "offset"    bigint  NOT NULL,
    broker_ts   timestamptz,
    key         bytea,
    value       bytea,
    error       text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
