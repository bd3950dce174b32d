-- Named queries of the partitioned replay's applied_dedup_keys built aside (`projections/partitioned.py`,
-- `DedupKeysAside`): reading the table's definition, building the staging table, and putting it in
-- the place of applied_dedup_keys with the old table's comments and grants. `{placeholders}` are
-- filled by `tapeline.postgres.qf`: identifiers quoted with psycopg's `sql.Identifier`;
-- `sql.Literal` for a comment (COMMENT ON takes no bind parameter); `sql.SQL` for text the catalog
-- produced (a column list read with format('%I ...'), pg_get_constraintdef, a quote_ident-ed grantee).

-- name: dedup_keys_columns
-- The current schema and applied_dedup_keys' column list as SQL (names, types, collations other than the type's, NOT NULL).
SELECT current_schema() AS schema, string_agg(format('%I %s%s%s', a.attname,
    format_type(a.atttypid, a.atttypmod),
    CASE WHEN a.attcollation <> t.typcollation THEN ' COLLATE ' || quote_ident(c.collname) ELSE '' END,
    CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END), ', ' ORDER BY a.attnum) AS columns
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation c ON c.oid = a.attcollation
WHERE a.attrelid = to_regclass('applied_dedup_keys') AND a.attnum > 0 AND NOT a.attisdropped;

-- name: dedup_keys_plain_index_count
-- How many indexes of applied_dedup_keys back no constraint.
SELECT count(*) FROM pg_index i WHERE i.indrelid = to_regclass('applied_dedup_keys')
    AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid);

-- name: dedup_keys_unique_constraints
-- Name and definition of each primary key and unique constraint of applied_dedup_keys, by name.
SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
WHERE conrelid = to_regclass('applied_dedup_keys') AND contype IN ('p', 'u') ORDER BY conname;

-- name: create_table_with_columns
-- Create table {table} with {columns}, a column list as SQL (dedup_keys_columns).
CREATE TABLE {table} ({columns});

-- name: dedup_keys_comments
-- The comment of applied_dedup_keys (column NULL) and of each of its columns.
SELECT NULL AS column, obj_description(to_regclass('applied_dedup_keys'), 'pg_class') AS comment
UNION ALL SELECT attname, col_description(attrelid, attnum) FROM pg_attribute
WHERE attrelid = to_regclass('applied_dedup_keys') AND attnum > 0 AND NOT attisdropped;

-- name: dedup_keys_grants
-- Each privilege granted on applied_dedup_keys to another role than its owner: grantee (quoted, or PUBLIC), privilege, grantable.
SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(a.grantee::regrole::text) END AS grantee,
    a.privilege_type, a.is_grantable FROM pg_class c, aclexplode(c.relacl) a
WHERE c.oid = to_regclass('applied_dedup_keys') AND a.grantee <> c.relowner;

-- name: drop_table
-- Drop table {table}.
DROP TABLE {table};

-- name: drop_table_if_exists
-- Drop table {table} if it exists.
DROP TABLE IF EXISTS {table};

-- name: rename_table
-- Rename table {table} to {new_name}.
ALTER TABLE {table} RENAME TO {new_name};

-- name: rename_constraint
-- Rename constraint {name} of table {table} to {new_name}.
ALTER TABLE {table} RENAME CONSTRAINT {name} TO {new_name};

-- name: comment_on_table
-- Set the comment of table {table} ({comment}: a literal).
COMMENT ON TABLE {table} IS {comment};

-- name: comment_on_column
-- Set the comment of column {column} of table {table} ({comment}: a literal).
COMMENT ON COLUMN {table}.{column} IS {comment};

-- name: grant_privilege
-- Grant {privilege} (a privilege name from aclexplode) on table {table} to {grantee} (quoted already, or PUBLIC).
GRANT {privilege} ON {table} TO {grantee};

-- name: grant_privilege_with_grant_option
-- Grant {privilege} on table {table} to {grantee}, who may grant it on.
GRANT {privilege} ON {table} TO {grantee} WITH GRANT OPTION;
