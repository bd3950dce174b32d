-- 017: an evidence row's payload holds the event's fields that have no column of their own.
-- The envelope fields event_id, event_type, job_id, stage, attempt, claim_token, occurred_at,
-- recorded_by, causation_id and dedup_key are columns of lifecycle_evidence; keeping them in the
-- payload too stored each value twice and made the jsonb the server parses for every row about
-- 2.5 times bigger (half of a replay's database time: bench/replay.py). The projector now leaves
-- them out (projections/writes.py, PAYLOAD_OMITS). Rows written before are stripped here, so a
-- live table still equals a replay of its log row for row.

UPDATE lifecycle_evidence
   SET payload = payload - ARRAY['event_id', 'event_type', 'job_id', 'stage', 'attempt', 'claim_token',
                                 'occurred_at', 'recorded_by', 'causation_id', 'dedup_key']
 WHERE payload ?| ARRAY['event_id', 'event_type', 'job_id', 'stage', 'attempt', 'claim_token',
                        'occurred_at', 'recorded_by', 'causation_id', 'dedup_key'];

COMMENT ON COLUMN lifecycle_evidence.payload IS
    'The event''s own fields as JSON (timestamps ISO 8601 UTC), with correlation_id: every field of the event that has no column of its own. Event = these columns (event_id, event_type, job_id, stage, attempt, claim_token, occurred_at, recorded_by, causation_id, dedup_key) + payload';

-- The breaker change now takes the envelope values it needs from the row's columns. The
-- one-argument form (a whole event's JSON) stays for publish workers of the previous version
-- during a rolling upgrade.
CREATE FUNCTION apply_provider_breaker_changed(p jsonb, change_event_id text, change_job_id text,
                                               change_occurred_at timestamptz)
    RETURNS void LANGUAGE sql AS $$
    INSERT INTO provider_state AS s (provider, state, until, failures, probe_job, reason, http_status, version,
                                     event_id, job_id, changed_at)
    VALUES (p->>'provider', p->>'to_state', (p->>'until')::timestamptz, (p->>'failures')::integer,
            CASE WHEN p->>'to_state' = 'half_open' THEN change_job_id END, p->>'reason',
            (p->>'http_status')::integer, (p->>'version')::integer, change_event_id, change_job_id,
            change_occurred_at)
    ON CONFLICT (provider) DO UPDATE SET
        state = EXCLUDED.state, until = EXCLUDED.until, failures = EXCLUDED.failures,
        probe_job = EXCLUDED.probe_job, reason = EXCLUDED.reason, http_status = EXCLUDED.http_status,
        version = EXCLUDED.version, event_id = EXCLUDED.event_id, job_id = EXCLUDED.job_id,
        changed_at = EXCLUDED.changed_at
    WHERE (EXCLUDED.version, EXCLUDED.event_id) > (s.version, s.event_id)
$$;
COMMENT ON FUNCTION apply_provider_breaker_changed(jsonb, text, text, timestamptz) IS
    'Apply one ProviderBreakerChanged (its evidence payload, event_id, job_id, occurred_at) to provider_state. Idempotent: keeps the change with the highest (version, event_id)';

CREATE OR REPLACE FUNCTION provider_state_from_evidence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM apply_provider_breaker_changed(NEW.payload, NEW.event_id, NEW.job_id, NEW.occurred_at);
    RETURN NULL;
END
$$;
