-- Named queries of the bulk replay (`projections/bulk.py`): emptying the bulk-loaded tables, the
-- evidence COPY, and dropping the indexes it builds again at the end. `{placeholders}` are filled
-- by `tapeline.postgres.qf`: identifiers quoted with psycopg's `sql.Identifier`, lists composed with
-- `tapeline.postgres.identifiers`, `sql.Literal` where PostgreSQL takes no bind parameter.

-- name: truncate_tables
-- Empty the tables {tables} (in this transaction, so their COPYs may FREEZE).
TRUNCATE {tables};

-- name: set_local_maintenance_work_mem
-- Memory for this transaction's index builds ({memory}: a literal such as '1GB'; SET takes no bind parameter).
SET LOCAL maintenance_work_mem = {memory};

-- name: copy_evidence_binary_freeze
-- The bulk evidence stream: rows of lifecycle_evidence ({columns}) in binary COPY format, frozen.
COPY lifecycle_evidence ({columns}) FROM STDIN (FORMAT binary, FREEZE);

-- name: unique_constraints_of
-- Name and definition of each primary key and unique constraint of table %(table)s.
SELECT c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c
WHERE c.conrelid = to_regclass(%(table)s) AND c.contype IN ('p', 'u');

-- name: plain_indexes_of
-- Name and CREATE INDEX statement of each index of table %(table)s that backs no constraint.
SELECT ic.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = to_regclass(%(table)s)
    AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid);

-- name: drop_constraint
-- Drop constraint {name} of table {table}.
ALTER TABLE {table} DROP CONSTRAINT {name};

-- name: add_constraint
-- Add constraint {name} to table {table}; {definition} is pg_get_constraintdef's text for it.
ALTER TABLE {table} ADD CONSTRAINT {name} {definition};

-- name: drop_index
-- Drop index {name}.
DROP INDEX {name};
