-- 014: publish providers' circuit breakers and quota reservations (domain/policy/breaker.py,
-- processors/provider_guard.py).
--
-- provider_state is a projection: one row per provider, the latest ProviderBreakerChanged by
-- (version, event_id). The projector fills it through a trigger on lifecycle_evidence (so every
-- path that writes evidence, a replay included, rebuilds it); a publish worker that changes a
-- breaker applies the same function to its own event right after committing it, under the
-- provider's advisory lock, so the next worker sees the change without waiting for the projector.
-- Both writes are the same pure function of the event, so order and repetition do not matter.
--
-- provider_calls is not a projection but coordination state (like the advisory locks of the
-- in-flight slots): a reservation per provider call, written before the call under the same lock,
-- so a quota counted across processes is never exceeded while the call's Published event is not
-- yet in the log. Quota counts add the projected Published events of jobs without a reservation
-- (a schema rebuilt by a replay starts with no reservations).

CREATE TABLE provider_state (
    provider      text PRIMARY KEY,
    state         text NOT NULL,              -- closed | open | half_open
    until         timestamptz,                -- open: end of cooldown; half_open: probe deadline
    failures      integer NOT NULL,           -- consecutive failures (0 once closed)
    probe_job     text,                       -- half_open: the job whose attempt probes
    reason        text NOT NULL,
    http_status   integer,
    version       integer NOT NULL,
    event_id      text NOT NULL,              -- the ProviderBreakerChanged this row is
    job_id        text NOT NULL,              -- the job whose attempt met the change
    changed_at    timestamptz NOT NULL        -- the event's occurred_at (the writer's clock)
);
COMMENT ON TABLE provider_state IS 'Circuit breaker of each publish provider: its latest ProviderBreakerChanged by (version, event_id)';
COMMENT ON COLUMN provider_state.provider IS 'Provider name (webhook)';
COMMENT ON COLUMN provider_state.state IS 'closed | open | half_open';
COMMENT ON COLUMN provider_state.until IS 'open: end of the cooldown; half_open: deadline of the probe; closed: null (PostgreSQL clock)';
COMMENT ON COLUMN provider_state.failures IS 'Consecutive failures that opened the breaker (0 once closed)';
COMMENT ON COLUMN provider_state.probe_job IS 'half_open: the job whose attempt is the one probe post';
COMMENT ON COLUMN provider_state.reason IS 'Why the breaker changed';
COMMENT ON COLUMN provider_state.http_status IS 'The provider answer that changed it (null: no answer or not a failure)';
COMMENT ON COLUMN provider_state.version IS 'Changes so far; a change applies only over a lower (version, event_id)';
COMMENT ON COLUMN provider_state.event_id IS 'The ProviderBreakerChanged event this row is';
COMMENT ON COLUMN provider_state.job_id IS 'The job whose attempt met the change';
COMMENT ON COLUMN provider_state.changed_at IS 'occurred_at of that event (writer clock)';

-- Apply one ProviderBreakerChanged (its JSON payload, as kept in lifecycle_evidence). Idempotent.
CREATE FUNCTION apply_provider_breaker_changed(p jsonb) RETURNS void LANGUAGE sql AS $$
    INSERT INTO provider_state AS s (provider, state, until, failures, probe_job, reason, http_status, version,
                                     event_id, job_id, changed_at)
    VALUES (p->>'provider', p->>'to_state', (p->>'until')::timestamptz, (p->>'failures')::integer,
            CASE WHEN p->>'to_state' = 'half_open' THEN p->>'job_id' END, p->>'reason',
            (p->>'http_status')::integer, (p->>'version')::integer, p->>'event_id', p->>'job_id',
            (p->>'occurred_at')::timestamptz)
    ON CONFLICT (provider) DO UPDATE SET
        state = EXCLUDED.state, until = EXCLUDED.until, failures = EXCLUDED.failures,
        probe_job = EXCLUDED.probe_job, reason = EXCLUDED.reason, http_status = EXCLUDED.http_status,
        version = EXCLUDED.version, event_id = EXCLUDED.event_id, job_id = EXCLUDED.job_id,
        changed_at = EXCLUDED.changed_at
    WHERE (EXCLUDED.version, EXCLUDED.event_id) > (s.version, s.event_id)
$$;

CREATE FUNCTION provider_state_from_evidence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM apply_provider_breaker_changed(NEW.payload);
    RETURN NULL;
END
$$;

CREATE TRIGGER provider_breaker_changed AFTER INSERT ON lifecycle_evidence
    FOR EACH ROW WHEN (NEW.event_type = 'ProviderBreakerChanged' AND NOT NEW.duplicate)
    EXECUTE FUNCTION provider_state_from_evidence();

CREATE TABLE provider_calls (
    id            bigserial PRIMARY KEY,
    provider      text NOT NULL,
    job_id        text NOT NULL,
    attempt       integer NOT NULL,
    claim_token   text,
    reserved_at   timestamptz NOT NULL,       -- PostgreSQL clock, before the call
    done_at       timestamptz,                -- after the call answered or failed; null: in flight (or its worker died)
    outcome       text                        -- posted | failed | null while in flight
);
CREATE INDEX provider_calls_window ON provider_calls (provider, reserved_at);
COMMENT ON TABLE provider_calls IS 'Coordination state, not a projection: one reservation per provider call, for quotas counted across processes';
COMMENT ON COLUMN provider_calls.reserved_at IS 'When the call was admitted (PostgreSQL clock)';
COMMENT ON COLUMN provider_calls.done_at IS 'When the call ended; a post occupies its quota window until done_at + window';
COMMENT ON COLUMN provider_calls.outcome IS 'posted | failed (the provider may have received it); a refused call (429, no connection) is deleted';

-- Published, PublishDeferred and breaker changes by time: quota counts and the providers section.
CREATE INDEX lifecycle_evidence_provider_events ON lifecycle_evidence (event_type, broker_ts)
    WHERE event_type IN ('Published', 'PublishDeferred', 'ProviderBreakerChanged');

-- The latest PublishDeferred of each provider (what `tapeline status` shows as the last wait).
CREATE VIEW provider_waits AS
SELECT DISTINCT ON (payload->>'provider')
       payload->>'provider' AS provider, payload->>'wait' AS wait, payload->>'window' AS "window",
       (payload->>'limit')::integer AS "limit", (payload->>'used')::integer AS used,
       (payload->>'until')::timestamptz AS until, job_id, broker_ts,
       count(*) OVER (PARTITION BY payload->>'provider') AS deferrals
FROM lifecycle_evidence
WHERE event_type = 'PublishDeferred' AND NOT duplicate
ORDER BY payload->>'provider', broker_ts DESC, partition, "offset";
COMMENT ON VIEW provider_waits IS 'The latest PublishDeferred of each provider, and how many there were';
COMMENT ON COLUMN provider_waits.provider IS 'Provider name';
COMMENT ON COLUMN provider_waits.wait IS 'quota | cooldown | probe | in_flight';
COMMENT ON COLUMN provider_waits."window" IS 'quota: minute | day';
COMMENT ON COLUMN provider_waits."limit" IS 'quota: posts per window; in_flight: slots';
COMMENT ON COLUMN provider_waits.used IS 'quota: posts counted in the window';
COMMENT ON COLUMN provider_waits.until IS 'When the deferred attempt may try the provider again';
COMMENT ON COLUMN provider_waits.job_id IS 'The job that was deferred';
COMMENT ON COLUMN provider_waits.broker_ts IS 'When it was recorded (LogAppendTime)';
COMMENT ON COLUMN provider_waits.deferrals IS 'PublishDeferred events of this provider in the log';
