-- Named queries of the media replicator from region A to region B (tapeline/replicator.py,
-- tapeline/region_objects.py; tables of migration 028_region_objects.sql, in region B's database).

-- name: replication_lock
-- Take the replicator's session lock without waiting (true: this session is the one replicator).
SELECT pg_try_advisory_lock(%(key)s) AS locked;

-- name: replication_progress
-- Every partition the replicator has recorded progress for: topic, partition, next_offset.
SELECT topic, partition, next_offset FROM region_replication_progress;

-- name: replication_advance
-- Record that every object of the records of topic[partition] before next_offset is in region_objects (never moves back).
INSERT INTO region_replication_progress (topic, partition, next_offset, updated_at)
VALUES (%(topic)s, %(partition)s, %(next_offset)s, now())
ON CONFLICT (topic, partition) DO UPDATE
SET next_offset = GREATEST(region_replication_progress.next_offset, EXCLUDED.next_offset), updated_at = now();

-- name: region_object
-- One recorded object by key: state, expected_sha256, sha256, attempts.
SELECT object_key, state, expected_sha256, sha256, attempts FROM region_objects WHERE object_key = %(key)s;

-- name: region_object_replicated
-- Record an object as copied and verified (first naming kept when the key was recorded before).
INSERT INTO region_objects (object_key, state, expected_sha256, sha256, size_bytes, named_by, named_at, source_topic,
                            source_partition, source_offset, attempts, replicated_at, written)
VALUES (%(key)s, 'replicated', %(expected_sha256)s, %(sha256)s, %(size_bytes)s, %(named_by)s, %(named_at)s, %(topic)s,
        %(partition)s, %(offset)s, 0, %(now)s, %(written)s)
ON CONFLICT (object_key) DO UPDATE
SET state = 'replicated', sha256 = EXCLUDED.sha256, size_bytes = EXCLUDED.size_bytes,
    expected_sha256 = COALESCE(region_objects.expected_sha256, EXCLUDED.expected_sha256),
    failure = NULL, last_error = NULL, next_try_at = NULL, replicated_at = EXCLUDED.replicated_at,
    written = EXCLUDED.written;

-- name: region_object_pending
-- Record a failed copy: the object stays (or becomes) pending with its reason and next try (a replicated row is never demoted).
INSERT INTO region_objects (object_key, state, expected_sha256, size_bytes, named_by, named_at, source_topic,
                            source_partition, source_offset, attempts, failure, last_error, next_try_at)
VALUES (%(key)s, 'pending', %(expected_sha256)s, %(size_bytes)s, %(named_by)s, %(named_at)s, %(topic)s, %(partition)s,
        %(offset)s, %(attempts)s, %(failure)s, %(error)s, %(next_try_at)s)
ON CONFLICT (object_key) DO UPDATE
SET attempts = EXCLUDED.attempts, failure = EXCLUDED.failure, last_error = EXCLUDED.last_error,
    next_try_at = EXCLUDED.next_try_at,
    expected_sha256 = COALESCE(region_objects.expected_sha256, EXCLUDED.expected_sha256)
WHERE region_objects.state = 'pending';

-- name: region_objects_due
-- Pending objects whose next try is due at %(now)s, oldest first (at most %(limit)s).
SELECT object_key, expected_sha256, size_bytes, named_by, named_at, source_topic, source_partition, source_offset,
       attempts
FROM region_objects
WHERE state = 'pending' AND next_try_at <= %(now)s
ORDER BY next_try_at
LIMIT %(limit)s;

-- name: region_objects_all
-- Every recorded object as `region status` counts it: key, state, size_bytes, named_at, failure.
SELECT object_key, state, size_bytes, named_at, failure FROM region_objects;

-- name: standby_tables
-- Every table of the deployment's schema but the kept ones (tapeline/standby.py KEPT_TABLES: the migration
-- ledger, policies, registrations and coordination state): what a standby's reset empties.
SELECT tablename FROM pg_tables WHERE schemaname = %(schema)s AND NOT (tablename = ANY(%(kept)s)) ORDER BY tablename;

-- name: standby_truncate
-- Empty the listed tables at once (identities restarted; CASCADE: tables referencing them are in the list too).
TRUNCATE {tables} RESTART IDENTITY CASCADE;
