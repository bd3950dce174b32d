-- 018: lifecycle_evidence.payload is json (the event's fields as JSON text, checked on the way in),
-- no longer jsonb; applied_dedup_keys.dedup_key compares byte by byte (COLLATE "C").
--
-- Why: a replay writes one evidence row per record, and PostgreSQL parsed every payload into jsonb's
-- binary form; that parse was the largest share of the database's time in `tapeline replay`
-- (bench/replay.py, 924k records: the replay went from 30.9k to 38.2k events/s, the plain COPY
-- ceiling of the same rows from 52.4k to 80.5k rows/s). json keeps the text as written (the
-- projector and both replay engines write the same text: pydantic's spelling) and is parsed when a
-- query reads into it (`payload->>'field'` works as before; the jsonb-only operators do not). The
-- dedup keys are only ever compared for equality with values the projector sends; byte order
-- makes the replay's build of their primary key about twice as fast as the database's default
-- collation (no abbreviated keys for a libc locale other than C).
--
-- The four views that read payload (attempts, stage_durations, expected_work_missing,
-- provider_waits) are saved, dropped and made again from their own definitions, with their
-- comments (a column's type cannot change under a view). `grant_reader` grants them again after
-- every migration run.

DO $$
DECLARE
    saved record;
    views text[] := ARRAY['expected_work_missing', 'provider_waits', 'attempts', 'stage_durations'];
    name text;
BEGIN
    CREATE TEMPORARY TABLE saved_views (position integer, name text, definition text, comment text,
                                        column_comments text[][]) ON COMMIT DROP;
    FOR i IN 1 .. array_length(views, 1) LOOP
        name := views[i];
        INSERT INTO saved_views
        SELECT i, name, pg_get_viewdef(to_regclass(name), true), obj_description(to_regclass(name), 'pg_class'),
               coalesce((SELECT array_agg(ARRAY[a.attname::text, d.description])
                           FROM pg_attribute a JOIN pg_description d
                             ON d.objoid = a.attrelid AND d.objsubid = a.attnum AND d.classoid = 'pg_class'::regclass
                          WHERE a.attrelid = to_regclass(name)), '{}');
    END LOOP;
    -- stage_durations reads attempts: drop the dependent first.
    FOR i IN REVERSE array_length(views, 1) .. 1 LOOP
        EXECUTE format('DROP VIEW %I', views[i]);
    END LOOP;

    ALTER TABLE lifecycle_evidence ALTER COLUMN payload TYPE json USING payload::json;
    ALTER TABLE applied_dedup_keys ALTER COLUMN dedup_key TYPE text COLLATE "C";

    FOR saved IN SELECT * FROM saved_views ORDER BY position LOOP
        EXECUTE format('CREATE VIEW %I AS %s', saved.name, saved.definition);
        IF saved.comment IS NOT NULL THEN
            EXECUTE format('COMMENT ON VIEW %I IS %L', saved.name, saved.comment);
        END IF;
        FOR i IN 1 .. coalesce(array_length(saved.column_comments, 1), 0) LOOP
            EXECUTE format('COMMENT ON COLUMN %I.%I IS %L', saved.name, saved.column_comments[i][1],
                           saved.column_comments[i][2]);
        END LOOP;
    END LOOP;
END
$$;

COMMENT ON COLUMN lifecycle_evidence.payload IS
    'The event''s own fields as JSON text (json, not jsonb; timestamps ISO 8601 UTC), with correlation_id: every field of the event that has no column of its own. Event = these columns (event_id, event_type, job_id, stage, attempt, claim_token, occurred_at, recorded_by, causation_id, dedup_key) + payload. Read fields with ->> as before; cast to jsonb for the jsonb-only operators';

-- The breaker trigger hands the row's payload to the jsonb function of 017.
CREATE OR REPLACE FUNCTION provider_state_from_evidence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM apply_provider_breaker_changed(NEW.payload::jsonb, NEW.event_id, NEW.job_id, NEW.occurred_at);
    RETURN NULL;
END
$$;
