-- 012: the HTTP intake's own record of uploads it admitted (issue 9), written by `tapeline serve`'s
-- POST /uploads, not by the projector (this is intake state, not a projection of events).
-- One row per admitted upload: claimed at admission (state 'uploading', under an advisory lock so
-- capacity checks and claims are serialised), then 'published' with the response once
-- UploadCompleted is acknowledged. A failed upload's row is deleted (nothing was published).
-- The same (submitter, idempotency_key) maps to one row: a second request waits for the first and
-- gets its response.
CREATE TABLE intake_uploads (
    upload_id        text PRIMARY KEY,
    job_id           text NOT NULL,
    submitter        text NOT NULL,
    idempotency_key  text,
    priority         text NOT NULL,
    profile          text,
    filename         text NOT NULL,
    state            text NOT NULL CHECK (state IN ('uploading', 'published')),
    sha256           text,
    size_bytes       bigint,
    response         jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX intake_uploads_key ON intake_uploads (submitter, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX intake_uploads_submitter ON intake_uploads (submitter, created_at);
COMMENT ON TABLE intake_uploads IS 'HTTP intake: uploads admitted by POST /uploads (idempotency keys, in-flight accounting before the projection sees the job)';
-- Admission counts rows still uploading or published recently (intake_pending_by_tier, submitter_in_flight).
CREATE INDEX intake_uploads_uploading ON intake_uploads (priority) WHERE state = 'uploading';
CREATE INDEX intake_uploads_updated ON intake_uploads (updated_at);
