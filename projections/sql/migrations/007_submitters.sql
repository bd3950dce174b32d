-- 007: who submitted each upload, for per-submitter quotas at intake (issue 5's quota_exceeded).
ALTER TABLE uploads ADD COLUMN submitter text;
CREATE INDEX uploads_submitter_time ON uploads (submitter, broker_ts);
COMMENT ON COLUMN uploads.submitter IS 'Who submitted the upload (UploadCompleted.submitter); quotas count per submitter';
