-- 005: dead letters an operator can list, inspect and replay (docs/design.md "Retry policy").
-- Three kinds share one table, each row named by a stable id:
--   job        a job out of attempts (`JobDeadLettered` on the lifecycle log); id `{job_id}/{attempt}`
--   record     a record a Kafka processor could not decode (`DeadLetter` on <prefix>.dlq); id
--              `{topic}/{partition}/{offset}` of the bad record
--   projection a record the projector itself could not decode; same id form as `record`, so one bad
--              record seen by a processor and by the projector is one row
-- A job's budget restarts when an operator replays it: attempts used = attempt - budget_base - yields.

ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_pkey;
ALTER TABLE dead_letters
    ADD COLUMN id            text,
    ADD COLUMN kind          text NOT NULL DEFAULT 'projection',
    ADD COLUMN job_id        text,
    ADD COLUMN stage         text,
    ADD COLUMN attempt       integer,
    ADD COLUMN error_class   text,
    ADD COLUMN attempts      integer,
    ADD COLUMN evidence      text,
    ADD COLUMN seen_by       text[] NOT NULL DEFAULT '{}',
    ADD COLUMN headers       jsonb,
    ADD COLUMN replayed_at   timestamptz,
    ADD COLUMN replayed_by   text,
    ADD COLUMN replay_reason text,
    ALTER COLUMN topic DROP NOT NULL,
    ALTER COLUMN partition DROP NOT NULL,
    ALTER COLUMN "offset" DROP NOT NULL;
UPDATE dead_letters SET id = topic || '/' || partition || '/' || "offset", seen_by = '{projector}' WHERE id IS NULL;
ALTER TABLE dead_letters ALTER COLUMN id SET NOT NULL, ADD PRIMARY KEY (id);
CREATE INDEX dead_letters_job ON dead_letters (job_id);

ALTER TABLE job_state ADD COLUMN budget_base integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN job_state.budget_base IS 'Attempt number at the last operator replay: attempts used = attempt - budget_base - yields';
COMMENT ON COLUMN dead_letters.id IS 'Stable id: {job_id}/{attempt} for a job, {topic}/{partition}/{offset} for a record';
COMMENT ON COLUMN dead_letters.kind IS 'job (attempts exhausted) | record (undecodable at a processor) | projection (undecodable at the projector)';
COMMENT ON COLUMN dead_letters.topic IS 'Topic of the bad record (record, projection); the lifecycle log for a job';
COMMENT ON COLUMN dead_letters.partition IS 'Partition of the bad record, or of the JobDeadLettered event';
COMMENT ON COLUMN dead_letters."offset" IS 'Offset of the bad record, or of the JobDeadLettered event';
COMMENT ON COLUMN dead_letters.error IS 'Why: the decode error, or the last attempt''s failure reason';
COMMENT ON COLUMN dead_letters.job_id IS 'The job (kind job); NULL for records, whose job is unknown';
COMMENT ON COLUMN dead_letters.stage IS 'Stage the job was in when it ran out of attempts, or the processor''s stage';
COMMENT ON COLUMN dead_letters.attempt IS 'The last attempt number (kind job)';
COMMENT ON COLUMN dead_letters.error_class IS 'Error class (docs/design.md table): the last failure''s, or invalid_input for undecodable records';
COMMENT ON COLUMN dead_letters.attempts IS 'Attempts used in the budget that ran out (kind job)';
COMMENT ON COLUMN dead_letters.evidence IS 'Where to look: the lifecycle log partition, or the dead-letter topic position';
COMMENT ON COLUMN dead_letters.seen_by IS 'Processors that dead-lettered it (intake, transcode, publish, projector, watchdog)';
COMMENT ON COLUMN dead_letters.headers IS 'Raw record headers as {name: base64 value} (records only)';
COMMENT ON COLUMN dead_letters.replayed_at IS 'Broker time (UTC) of the operator''s JobReplayed; NULL while not replayed';
COMMENT ON COLUMN dead_letters.replayed_by IS 'Operator who replayed it';
COMMENT ON COLUMN dead_letters.replay_reason IS 'The operator''s reason for the replay';
