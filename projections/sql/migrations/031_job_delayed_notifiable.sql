-- 031: a failover's JobDelayed (one per job in flight and region epoch) is notified as `job.delayed`
-- (issue 41 item 5): the notifier's scan for new notifiable events takes it too, so its partial index
-- does.

DROP INDEX lifecycle_evidence_notifiable;
CREATE INDEX lifecycle_evidence_notifiable ON lifecycle_evidence (broker_ts)
    WHERE event_type IN ('JobCompleted', 'JobRejected', 'JobFailed', 'JobDeadLettered', 'NeedsReview',
                         'JobReplayed', 'JobCancelled', 'JobDelayed') AND applied;

-- An endpoint registered for every type (the default) wants the new one too.
UPDATE webhook_endpoints SET event_types = event_types || ARRAY['job.delayed']
WHERE event_types @> ARRAY['job.completed', 'job.rejected', 'job.failed', 'job.dead_lettered', 'job.needs_review',
                           'job.replayed', 'job.cancelled']
  AND NOT 'job.delayed' = ANY (event_types);

COMMENT ON COLUMN webhook_endpoints.event_types IS 'Notification types wanted (job.completed, job.rejected, job.failed, job.dead_lettered, job.needs_review, job.replayed, job.cancelled, job.delayed)';
