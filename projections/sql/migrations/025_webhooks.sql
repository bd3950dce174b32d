-- 025: customer notifications by webhook (issue 23; processors/notify.py, docs/design.md "Notifications").
--
-- webhook_endpoints is not a projection but registration state, like intake_uploads: a submitter's
-- endpoints with their signing secrets (which never go into the log), written by `tapeline webhooks`
-- and the admin API, read by the notifier. A swap copies it; a replay starts without it.
--
-- webhook_deliveries is a projection: one row per (lifecycle event, endpoint), folded from the
-- notifier's NotificationIntended / NotificationDelivered / NotificationFailed /
-- NotificationDeadLettered events by a trigger on lifecycle_evidence (as provider_state is), so
-- every path that writes evidence, a replay included, rebuilds it. The notifier applies the same
-- function to its own events right after committing them. A delivered or dead-lettered row never
-- changes again: the function is idempotent and order-tolerant within a delivery.

CREATE TABLE webhook_endpoints (
    endpoint_id     text PRIMARY KEY,             -- ep_<random>
    submitter       text NOT NULL,                -- the identity of uploads.submitter
    url             text NOT NULL,
    secret          text NOT NULL,                -- whsec_<base64>; shown once at registration, never again
    event_types     text[] NOT NULL,              -- job.completed, job.failed, ...
    enabled         boolean NOT NULL DEFAULT true,
    created_at      timestamptz NOT NULL DEFAULT now(),
    disabled_at     timestamptz,
    disabled_reason text,
    failing_since   timestamptz,                  -- first failure since the last success (null: healthy)
    last_success_at timestamptz
);
CREATE INDEX webhook_endpoints_submitter ON webhook_endpoints (submitter) WHERE enabled;
COMMENT ON TABLE webhook_endpoints IS 'Registration state, not a projection: each submitter''s webhook endpoints (tapeline webhooks add)';
COMMENT ON COLUMN webhook_endpoints.secret IS 'Signing secret (Standard Webhooks whsec_...); never shown after registration';
COMMENT ON COLUMN webhook_endpoints.event_types IS 'Notification types wanted (job.completed, job.rejected, job.failed, job.dead_lettered, job.needs_review, job.replayed, job.cancelled)';
COMMENT ON COLUMN webhook_endpoints.created_at IS 'Only lifecycle events at or after this broker time are notified';
COMMENT ON COLUMN webhook_endpoints.failing_since IS 'When its deliveries started failing without a success since (null: healthy); past notify_disable_after_s it is disabled';
COMMENT ON COLUMN webhook_endpoints.endpoint_id IS 'The endpoint''s id, ep_<random>';
COMMENT ON COLUMN webhook_endpoints.submitter IS 'Whose jobs it hears of: the identity of uploads.submitter';
COMMENT ON COLUMN webhook_endpoints.url IS 'Where notifications are POSTed (checked: no private, loopback or link-local address unless a setting allows it)';
COMMENT ON COLUMN webhook_endpoints.enabled IS 'Whether notifications are sent to it (false: disabled by an operator or after failing too long)';
COMMENT ON COLUMN webhook_endpoints.disabled_at IS 'When it was disabled (null: enabled)';
COMMENT ON COLUMN webhook_endpoints.disabled_reason IS 'Why it was disabled';
COMMENT ON COLUMN webhook_endpoints.last_success_at IS 'When a delivery to it last got a 2xx';

CREATE TABLE webhook_deliveries (
    delivery_id       text PRIMARY KEY,           -- the webhook-id header
    job_id            text NOT NULL,
    endpoint_id       text NOT NULL,
    notification_type text NOT NULL,
    source_event_id   text NOT NULL,
    source_dedup_key  text NOT NULL,
    state             text NOT NULL,              -- pending | retry_scheduled | failed | delivered | dead_lettered
    tries             integer NOT NULL DEFAULT 0,
    last_status       integer,
    last_reason       text,
    next_try_at       timestamptz,
    intended_at       timestamptz NOT NULL,
    delivered_at      timestamptz,
    updated_at        timestamptz NOT NULL
);
CREATE UNIQUE INDEX webhook_deliveries_source ON webhook_deliveries (source_dedup_key, endpoint_id);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_try_at) WHERE state IN ('pending', 'retry_scheduled');
COMMENT ON TABLE webhook_deliveries IS 'One customer notification per (lifecycle event, endpoint), folded from the Notification* events';
COMMENT ON COLUMN webhook_deliveries.delivery_id IS 'The webhook-id header: msg_ + uuid5 of the lifecycle event''s dedup key and the endpoint id, stable across retries';
COMMENT ON COLUMN webhook_deliveries.state IS 'pending | retry_scheduled | failed (dead letter follows) | delivered | dead_lettered';
COMMENT ON COLUMN webhook_deliveries.tries IS 'POSTs recorded so far';
COMMENT ON COLUMN webhook_deliveries.next_try_at IS 'retry_scheduled: when the next POST is due (the notifier''s clock)';
COMMENT ON COLUMN webhook_deliveries.job_id IS 'The job the notification is about';
COMMENT ON COLUMN webhook_deliveries.endpoint_id IS 'The endpoint it goes to (webhook_endpoints)';
COMMENT ON COLUMN webhook_deliveries.notification_type IS 'job.completed, job.failed, ... (the lifecycle event it tells of)';
COMMENT ON COLUMN webhook_deliveries.source_event_id IS 'The event_id of the lifecycle event it tells of';
COMMENT ON COLUMN webhook_deliveries.source_dedup_key IS 'The dedup key of the lifecycle event it tells of (part of the webhook-id)';
COMMENT ON COLUMN webhook_deliveries.last_status IS 'HTTP status of the last POST (null: no answer)';
COMMENT ON COLUMN webhook_deliveries.last_reason IS 'Why the last POST failed';
COMMENT ON COLUMN webhook_deliveries.intended_at IS 'When NotificationIntended was recorded';
COMMENT ON COLUMN webhook_deliveries.delivered_at IS 'When the endpoint answered 2xx (NotificationDelivered)';
COMMENT ON COLUMN webhook_deliveries.updated_at IS 'When the last Notification* event of it was applied';

CREATE FUNCTION apply_webhook_delivery(p jsonb, kind text, change_job_id text, change_occurred_at timestamptz)
    RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF kind = 'NotificationIntended' THEN
        INSERT INTO webhook_deliveries (delivery_id, job_id, endpoint_id, notification_type, source_event_id,
                                        source_dedup_key, state, intended_at, updated_at)
        VALUES (p->>'delivery_id', change_job_id, p->>'endpoint_id', p->>'notification_type',
                p->>'source_event_id', p->>'source_dedup_key', 'pending', change_occurred_at, change_occurred_at)
        ON CONFLICT DO NOTHING;
    ELSIF kind = 'NotificationDelivered' THEN
        UPDATE webhook_deliveries SET state = 'delivered', tries = greatest(tries, (p->>'try_number')::integer),
               last_status = (p->>'http_status')::integer, last_reason = NULL, next_try_at = NULL,
               delivered_at = change_occurred_at, updated_at = change_occurred_at
        WHERE delivery_id = p->>'delivery_id' AND state NOT IN ('delivered', 'dead_lettered');
    ELSIF kind = 'NotificationFailed' THEN
        UPDATE webhook_deliveries SET
               state = CASE WHEN p->>'retry_at' IS NULL THEN 'failed' ELSE 'retry_scheduled' END,
               tries = greatest(tries, (p->>'try_number')::integer), last_status = (p->>'http_status')::integer,
               last_reason = p->>'reason', next_try_at = (p->>'retry_at')::timestamptz,
               updated_at = change_occurred_at
        WHERE delivery_id = p->>'delivery_id' AND state NOT IN ('delivered', 'dead_lettered')
          AND tries < (p->>'try_number')::integer;
    ELSIF kind = 'NotificationDeadLettered' THEN
        UPDATE webhook_deliveries SET state = 'dead_lettered', next_try_at = NULL, last_reason = p->>'reason',
               updated_at = change_occurred_at
        WHERE delivery_id = p->>'delivery_id' AND state NOT IN ('delivered', 'dead_lettered');
    END IF;
END
$$;
COMMENT ON FUNCTION apply_webhook_delivery(jsonb, text, text, timestamptz) IS
    'Apply one Notification* event (its evidence payload, event type, job_id, occurred_at) to webhook_deliveries. Idempotent; delivered and dead_lettered rows never change';

CREATE FUNCTION webhook_deliveries_from_evidence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM apply_webhook_delivery(NEW.payload::jsonb, NEW.event_type, NEW.job_id, NEW.occurred_at);
    RETURN NULL;
END
$$;

CREATE TRIGGER webhook_delivery_changed AFTER INSERT ON lifecycle_evidence
    FOR EACH ROW WHEN (NEW.event_type IN ('NotificationIntended', 'NotificationDelivered', 'NotificationFailed',
                                          'NotificationDeadLettered') AND NOT NEW.duplicate)
    EXECUTE FUNCTION webhook_deliveries_from_evidence();

-- The lifecycle events a customer may be notified of, by time: the notifier's scan for new ones.
CREATE INDEX lifecycle_evidence_notifiable ON lifecycle_evidence (broker_ts)
    WHERE event_type IN ('JobCompleted', 'JobRejected', 'JobFailed', 'JobDeadLettered', 'NeedsReview',
                         'JobReplayed', 'JobCancelled') AND applied;
