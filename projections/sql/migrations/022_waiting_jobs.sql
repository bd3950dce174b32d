-- 022: a retry or hand-over waiting for its turn stays visible (issue 26 item 4).
--
-- Once the watchdog has acted on a stall (StallDetected + RetryScheduled), the attempt leaves
-- stalled_attempts; its retry then waits for its backoff and for a free worker, and that wait was
-- shown nowhere until the handoff timeout made it a stalled handoff. waiting_jobs lists it from the
-- moment the attempt ended until a worker claims the next one: a job in retry_scheduled, and a later
-- attempt (a retry, a yield's hand-over, a replay) queued and not yet a stalled handoff. A queued job
-- is in exactly one of waiting_jobs and stalled_handoffs (the second's condition, negated).

CREATE VIEW waiting_jobs AS
SELECT j.job_id, j.stage, j.state, j.attempt,
       CASE WHEN j.state = 'retry_scheduled' THEN j.retry_next_attempt ELSE j.attempt END AS next_attempt,
       j.log_partition, c.now AS log_now,
       CASE WHEN j.state = 'retry_scheduled' THEN j.updated_at ELSE j.queued_at END AS waiting_since,
       EXTRACT(EPOCH FROM c.now - CASE WHEN j.state = 'retry_scheduled' THEN j.updated_at ELSE j.queued_at END)
           ::double precision AS since_s,
       j.retry_due_at, j.error_class, j.reason
FROM job_state j
JOIN log_clock c ON c.partition = j.log_partition
CROSS JOIN stall_policy p
WHERE j.state = 'retry_scheduled'
   OR (j.state = 'queued' AND j.attempt > 1
       AND NOT (j.queued_at + make_interval(secs => p.handoff_timeout_s) < c.now OR j.redrives > 0));

COMMENT ON VIEW waiting_jobs IS 'Retries and hand-overs waiting for their backoff or a free worker: jobs in retry_scheduled, and later attempts queued but not yet a stalled handoff (log clock)';
COMMENT ON COLUMN waiting_jobs.job_id IS 'Job id';
COMMENT ON COLUMN waiting_jobs.stage IS 'Stage whose next attempt waits';
COMMENT ON COLUMN waiting_jobs.state IS 'retry_scheduled (waiting for its backoff) or queued (waiting for a worker to claim it)';
COMMENT ON COLUMN waiting_jobs.attempt IS 'Current attempt of the job row: the one that ended (retry_scheduled) or the one queued';
COMMENT ON COLUMN waiting_jobs.next_attempt IS 'Attempt that will run next';
COMMENT ON COLUMN waiting_jobs.log_partition IS 'Partition of the lifecycle log holding the job (its log clock)';
COMMENT ON COLUMN waiting_jobs.log_now IS 'The log clock of that partition: broker time (UTC) of its newest record';
COMMENT ON COLUMN waiting_jobs.waiting_since IS 'Broker time (UTC) the wait began: the RetryScheduled, or the StageQueued of the waiting attempt';
COMMENT ON COLUMN waiting_jobs.since_s IS 'Seconds on the log clock since waiting_since';
COMMENT ON COLUMN waiting_jobs.retry_due_at IS 'Broker time (UTC) a scheduled retry may start (NULL once queued)';
COMMENT ON COLUMN waiting_jobs.error_class IS 'Error class of the failure or stall that ended the previous attempt';
COMMENT ON COLUMN waiting_jobs.reason IS 'Why the previous attempt ended (its failure, stall or yield), as the job row records it';
