-- Named queries of a replay (`projections/replay.py`): its lock, its session settings and the row
-- counts it reports. `{placeholders}` are identifiers chosen at run time, filled by
-- `tapeline.postgres.qf` (quoted with psycopg's `sql.Identifier`).

-- name: try_replay_lock
-- Try to take the session advisory lock (%(key)s, hash of schema %(schema)s): false when another replay into it holds it.
SELECT pg_try_advisory_lock(%(key)s, hashtext(%(schema)s));

-- name: release_replay_lock
-- Release the session advisory lock (%(key)s, hash of schema %(schema)s).
SELECT pg_advisory_unlock(%(key)s, hashtext(%(schema)s));

-- name: session_skip_commit_flush_wait
-- This session's commits do not wait for the WAL flush (a replay is redone from its stored offsets after a crash).
SET synchronous_commit = off;

-- name: session_client_encoding_utf8
-- This session's client encoding is UTF-8 (rows encoded without a connection are UTF-8).
SET client_encoding = 'UTF8';

-- name: tables_of_schema
-- The name of every table of schema %(schema)s, in name order.
SELECT tablename FROM pg_tables WHERE schemaname = %(schema)s ORDER BY tablename;

-- name: row_count_of
-- Exact row count of {schema}.{table}.
SELECT count(*) AS n FROM {schema}.{table};
