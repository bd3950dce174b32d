-- Named queries of the projector (`projections/projector.py`). `{placeholders}` are filled by
-- `tapeline.postgres.qf`: identifiers quoted with psycopg's `sql.Identifier`, or composed lists.

-- name: projection_cluster_id
-- The Kafka cluster id projection %(projection)s was built from (no row when none is recorded).
SELECT cluster_id FROM projection_source WHERE projection = %(projection)s;

-- name: try_projector_lock
-- Try to take the session advisory lock (%(key)s, hash of %(name)s, "<schema>:<projection>"): false while another projector holds it.
SELECT pg_try_advisory_lock(%(key)s, hashtext(%(name)s)) AS held;

-- name: upsert_job_state
-- One job's row: {columns} the job_state columns of schemas/lifecycle.json, {values} their parameters, {updates} one upsert_job_state_update per column but job_id.
INSERT INTO job_state ({columns}) VALUES ({values}) ON CONFLICT (job_id) DO UPDATE SET {updates};

-- name: upsert_job_state_update
-- One column of `upsert_job_state`'s update list: {column} takes the proposed row's value.
{column} = EXCLUDED.{column}
