-- 003: retries with backoff. A RetryScheduled event says how long to wait (not_before minus its
-- occurred_at, both the writer's clock); the projector anchors that delay to the broker's clock, so
-- the due time is on the log clock like every other decision.

ALTER TABLE job_state
    ADD COLUMN retry_next_attempt integer,        -- the attempt a scheduled retry will start
    ADD COLUMN retry_due_at       timestamptz;    -- broker time at which it may start (log clock)

-- Scheduled retries whose time has come on their partition's log clock.
CREATE VIEW due_retries AS
SELECT j.job_id, j.stage, j.attempt, j.retry_next_attempt, j.retry_due_at, j.log_partition, c.now AS log_now,
       EXTRACT(EPOCH FROM c.now - j.retry_due_at)::double precision AS overdue_s
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
WHERE j.state = 'retry_scheduled' AND j.retry_due_at <= c.now;
