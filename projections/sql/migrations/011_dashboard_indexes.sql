-- 011: indexes for the dashboard's throughput over the last hour (`tapeline serve`): jobs ended and
-- jobs created per minute read job_state by completed_at and created_at (broker time, UTC).

CREATE INDEX job_state_completed_at ON job_state (completed_at) WHERE completed_at IS NOT NULL;
CREATE INDEX job_state_created_at ON job_state (created_at);
