-- 026: a pipeline is data (issue 22). JobAccepted records the pipeline profile a job runs and its
-- stages in order (domain/pipeline.py); the fold orders a job's attempts by their stage's position
-- in those stages. Jobs accepted before profiles existed keep NULL in both: they fold with the old
-- fixed order (intake, transcode, publish), exactly as before.

ALTER TABLE job_state ADD COLUMN pipeline text;
ALTER TABLE job_state ADD COLUMN pipeline_stages jsonb;
COMMENT ON COLUMN job_state.pipeline IS
    'The pipeline profile the job runs (domain/pipeline.py PROFILES; NULL: accepted before profiles, transcode then publish)';
COMMENT ON COLUMN job_state.pipeline_stages IS
    'The job''s stages in order, as recorded by JobAccepted (a JSON array of names; NULL: transcode, publish)';
COMMENT ON COLUMN job_state.stage IS
    'The current stage: intake or a stage of the registry (domain/pipeline.py), e.g. transcode, thumbnails, publish';
