-- Named queries of the projection schemas' administration (`projections/pgschema.py`): the swap
-- guard, preparing a schema for a replay, and swapping one in. `{placeholders}` are identifiers
-- chosen at run time, filled by `tapeline.postgres.qf` (quoted with psycopg's `sql.Identifier`).

-- name: current_schema_oid
-- OID of the connection's current schema (no row when its search_path names no existing schema).
SELECT oid FROM pg_namespace WHERE nspname = current_schema();

-- name: schema_oid
-- OID of the schema of that name (no row when it does not exist).
SELECT oid FROM pg_namespace WHERE nspname = %(schema)s;

-- name: relation_count
-- How many tables, views, materialized views, sequences and partitioned tables a schema holds.
SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'v', 'm', 'S', 'p');

-- name: lock_swap_guard_for_batch
-- The projector's batch takes the swap guard {guard} in ROW EXCLUSIVE mode (conflicts with a swap only).
LOCK TABLE {guard} IN ROW EXCLUSIVE MODE;

-- name: lock_swap_guard_for_swap
-- A swap takes the swap guard {guard} in EXCLUSIVE mode: no projector batch is in flight meanwhile.
LOCK TABLE {guard} IN EXCLUSIVE MODE;

-- name: drop_schema_cascade
-- Drop schema {schema} and everything in it (a replay's target, after the checks of prepare_fresh).
DROP SCHEMA {schema} CASCADE;

-- name: relation_exists
-- Whether %(schema)s.%(table)s names an existing relation (either name quoted as needed).
SELECT to_regclass(quote_ident(%(schema)s) || '.' || quote_ident(%(table)s)) IS NOT NULL;

-- name: relation_in_both_schemas
-- Whether table %(table)s exists both in schema %(source)s and in schema %(target)s.
SELECT to_regclass(quote_ident(%(source)s) || '.' || quote_ident(%(table)s)) IS NOT NULL
    AND to_regclass(quote_ident(%(target)s) || '.' || quote_ident(%(table)s)) IS NOT NULL;

-- name: migration_recorded_in
-- How many rows of {schema}.schema_migrations record that migration (version and file name).
SELECT count(*) FROM {schema}.schema_migrations WHERE version = %(version)s AND name = %(name)s;

-- name: schema_migration_version
-- The latest migration applied to schema {schema}.
SELECT max(version) FROM {schema}.schema_migrations;

-- name: tables_present
-- How many of the given table names exist in the schema.
SELECT count(*) FROM pg_tables WHERE schemaname = %(schema)s AND tablename = ANY(%(tables)s);

-- name: projection_holds_rows
-- Whether any projection table of {schema} holds a row (the tables of pgschema.PROJECTION_TABLES).
SELECT EXISTS (SELECT 1 FROM {schema}.projector_offsets) OR EXISTS (SELECT 1 FROM {schema}.lifecycle_evidence)
    OR EXISTS (SELECT 1 FROM {schema}.job_state) OR EXISTS (SELECT 1 FROM {schema}.applied_dedup_keys)
    OR EXISTS (SELECT 1 FROM {schema}.uploads) OR EXISTS (SELECT 1 FROM {schema}.dead_letters)
    OR EXISTS (SELECT 1 FROM {schema}.log_clock) OR EXISTS (SELECT 1 FROM {schema}.provider_calls)
    OR EXISTS (SELECT 1 FROM {schema}.provider_state) OR EXISTS (SELECT 1 FROM {schema}.intake_uploads) AS any_row;

-- name: record_projection_source
-- The Kafka cluster a projection is built from (a row already there is kept).
INSERT INTO projection_source (projection, cluster_id) VALUES (%(projection)s, %(cluster_id)s) ON CONFLICT DO NOTHING;

-- name: replay_finished_in
-- Whether schema {schema} holds a finished projection: a recorded source or any stored offset.
SELECT EXISTS (SELECT 1 FROM {schema}.projection_source WHERE projection = %(projection)s)
    OR EXISTS (SELECT 1 FROM {schema}.projector_offsets WHERE projection = %(projection)s);

-- name: set_local_lock_timeout
-- How long this transaction waits for a lock ({timeout}: a literal such as '30000ms'; SET takes no bind parameter).
SET LOCAL lock_timeout = {timeout};

-- name: rename_schema
-- Rename schema {schema} to {new_name} (a swap, in its transaction).
ALTER SCHEMA {schema} RENAME TO {new_name};

-- name: delete_all_rows_of
-- Empty table {schema}.{table}.
DELETE FROM {schema}.{table};

-- name: copy_rows_between_schemas
-- Every row of {source}.{table} into {target}.{table} (tables of the same definition).
INSERT INTO {target}.{table} SELECT * FROM {source}.{table};
