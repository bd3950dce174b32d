-- 020: an upload with no job stays in expected_work_missing until it has a job (issue 20).
--
-- Before, the view left out every upload whose job had a StallDetected: once the watchdog had
-- reported it (one StallDetected(expected_work_missing)), the stuck upload vanished from
-- `tapeline stalled`, /api/stalled and tapeline_stalls{kind="expected_work_missing"} while it was
-- still stuck. Now it stays listed until the upload becomes a job (accepted or rejected);
-- `reported` says whether the watchdog has reported it (its query `expected_work_unreported`
-- reports each once).

CREATE OR REPLACE VIEW expected_work_missing AS
SELECT u.upload_id, u.job_id, u.broker_ts AS uploaded_at, clock.now AS log_now,
       EXTRACT(EPOCH FROM clock.now - u.broker_ts)::double precision AS since_s,
       EXISTS (SELECT 1 FROM lifecycle_evidence e
               WHERE e.job_id = u.job_id AND e.event_type = 'StallDetected') AS reported
FROM uploads u
CROSS JOIN (SELECT max(now) AS now FROM log_clock) clock
CROSS JOIN stall_policy p
WHERE clock.now IS NOT NULL
  AND u.broker_ts + make_interval(secs => p.intake_timeout_s) < clock.now
  AND NOT EXISTS (SELECT 1 FROM job_state j WHERE j.job_id = u.job_id);

COMMENT ON VIEW expected_work_missing IS 'Uploads with no job after stall_policy.intake_timeout_s on the newest log clock; listed until the upload becomes a job, reported or not';
COMMENT ON COLUMN expected_work_missing.reported IS 'The watchdog already reported it (a StallDetected of the job exists); it stays listed until the job exists';
