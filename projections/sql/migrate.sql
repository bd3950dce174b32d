-- Named queries of the migrator and the reader grants (`tapeline/postgres.py`: `migrate`,
-- `grant_reader`). `{placeholders}` are identifiers chosen at run time, filled by
-- `tapeline.postgres.qf` (quoted with psycopg's `sql.Identifier`).

-- name: advisory_lock
-- Take the session advisory lock %(key)s (one migrator at a time).
SELECT pg_advisory_lock(%(key)s);

-- name: advisory_unlock
-- Release the session advisory lock %(key)s.
SELECT pg_advisory_unlock(%(key)s);

-- name: schema_missing
-- Whether no schema of that name exists.
SELECT to_regnamespace(%(schema)s) IS NULL;

-- name: create_schema_if_missing
-- Create schema {schema} unless it exists.
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_schema_migrations
-- The table of applied migrations, in the connection's current schema.
CREATE TABLE IF NOT EXISTS schema_migrations ( version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());

-- name: applied_migration_versions
-- The version of every migration applied to the current schema.
SELECT version FROM schema_migrations;

-- name: record_migration
-- Record one migration as applied.
INSERT INTO schema_migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: create_swap_guard
-- The swap guard table {schema}.swap_guard (no column: it is only ever locked).
CREATE TABLE IF NOT EXISTS {schema}.swap_guard ();

-- name: role_missing
-- Whether no role of that name exists.
SELECT to_regrole(%(role)s) IS NULL;

-- name: role_has_schema_usage
-- Whether role %(role)s has USAGE on schema %(schema)s.
SELECT has_schema_privilege(%(role)s, %(schema)s, 'USAGE');

-- name: grant_schema_usage
-- Grant USAGE on schema {schema} to role {role}.
GRANT USAGE ON SCHEMA {schema} TO {role};

-- name: relations_not_readable_by
-- Tables, views, materialized views and foreign tables of schema %(schema)s that role %(role)s may not SELECT from.
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s
    AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND NOT has_table_privilege(%(role)s, c.oid, 'SELECT')
    ORDER BY c.relname;

-- name: grant_select_on
-- Grant SELECT on {schema}.{relation} to role {role}.
GRANT SELECT ON {schema}.{relation} TO {role};

-- name: table_select_granted
-- Whether relation %(relation)s exists and role %(role)s has table-level SELECT on it: (present, readable).
SELECT to_regclass(%(relation)s) IS NOT NULL AS present,
       coalesce(has_table_privilege(%(role)s, to_regclass(%(relation)s), 'SELECT'), false) AS readable;

-- name: revoke_select_on
-- Revoke SELECT on {schema}.{relation} (and its column grants) from role {role}.
REVOKE SELECT ON {schema}.{relation} FROM {role};

-- name: columns_not_readable_by
-- Columns of relation %(relation)s, other than %(hidden)s, that role %(role)s may not SELECT, in column order.
SELECT a.attname FROM pg_attribute a WHERE a.attrelid = to_regclass(%(relation)s) AND a.attnum > 0
    AND NOT a.attisdropped AND a.attname <> ALL (%(hidden)s::text[])
    AND NOT has_column_privilege(%(role)s, a.attrelid, a.attnum, 'SELECT')
    ORDER BY a.attnum;

-- name: grant_select_columns_on
-- Grant SELECT on columns {columns} of {schema}.{relation} to role {role}.
GRANT SELECT ({columns}) ON {schema}.{relation} TO {role};

-- name: default_select_granted
-- Whether the current user's default privileges in schema %(schema)s already grant SELECT on new tables to %(role)s.
SELECT EXISTS (SELECT 1 FROM pg_default_acl d JOIN pg_namespace n ON n.oid = d.defaclnamespace,
    aclexplode(d.defaclacl) a WHERE n.nspname = %(schema)s AND d.defaclrole = to_regrole(current_user)
    AND d.defaclobjtype = 'r' AND a.grantee = to_regrole(%(role)s) AND a.privilege_type = 'SELECT');

-- name: grant_default_select
-- Grant SELECT on the tables the current user creates in schema {schema} from now on to role {role}.
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO {role};

-- name: lifecycle_tables_present
-- Whether the current schema has the lifecycle tables (migration 024 made them).
SELECT to_regclass('lifecycle_states') IS NOT NULL AND to_regclass('lifecycle_ending_events') IS NOT NULL;

-- name: lifecycle_state_rows
-- The rows of lifecycle_states, in state order.
SELECT state, meaning, kind FROM lifecycle_states ORDER BY state;

-- name: lifecycle_ending_rows
-- The rows of lifecycle_ending_events, in event type order.
SELECT event_type, state, attempt_outcome FROM lifecycle_ending_events ORDER BY event_type;

-- name: clear_lifecycle_states
-- Empty lifecycle_states (before it is written again from schemas/lifecycle.json).
DELETE FROM lifecycle_states;

-- name: clear_lifecycle_ending_events
-- Empty lifecycle_ending_events (before it is written again from schemas/lifecycle.json).
DELETE FROM lifecycle_ending_events;

-- name: insert_lifecycle_state
-- One job state of schemas/lifecycle.json.
INSERT INTO lifecycle_states (state, meaning, kind) VALUES (%(state)s, %(meaning)s, %(kind)s);

-- name: insert_lifecycle_ending_event
-- One event of schemas/lifecycle.json "events.ending".
INSERT INTO lifecycle_ending_events (event_type, state, attempt_outcome) VALUES (%(event_type)s, %(state)s, %(attempt_outcome)s);
