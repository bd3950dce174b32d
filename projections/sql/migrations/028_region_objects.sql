-- 028: media replication from region A to region B (issue 25 item 3, docs/regions.md "Media replication").
-- Written in region B's database by `tapeline region replicate` (tapeline/replicator.py): every object
-- region B's mirrored log names, whether it was copied to region B's store, and how far the
-- replicator has read each mirrored partition. Region A's database never gets rows here.

CREATE TABLE region_objects (
    object_key text PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('replicated', 'pending')),
    expected_sha256 text,
    sha256 text,
    size_bytes bigint,
    named_by text NOT NULL,
    named_at timestamptz NOT NULL,
    source_topic text NOT NULL,
    source_partition integer NOT NULL,
    source_offset bigint NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    failure text,
    last_error text,
    next_try_at timestamptz,
    replicated_at timestamptz,
    written boolean
);
CREATE INDEX region_objects_pending ON region_objects (next_try_at) WHERE state = 'pending';
COMMENT ON TABLE region_objects IS 'Every object region B''s mirrored log names (domain/replication.py objects_named), one row per key: copied to region B''s store and verified, or still pending';
COMMENT ON COLUMN region_objects.object_key IS 'The object''s key, the same in both regions'' buckets';
COMMENT ON COLUMN region_objects.state IS 'replicated: in region B''s store with the expected sha256; pending: not (yet): see failure, next_try_at';
COMMENT ON COLUMN region_objects.expected_sha256 IS 'Hex sha256 the log recorded; NULL when the naming event records none (Published playlists): the copy is checked against the sha256 region A''s store keeps in the object''s metadata';
COMMENT ON COLUMN region_objects.sha256 IS 'Hex sha256 of the bytes copied to region B (set when replicated)';
COMMENT ON COLUMN region_objects.size_bytes IS 'Bytes: the copied size when replicated, else the size the log states (NULL: unknown)';
COMMENT ON COLUMN region_objects.named_by IS 'Event type of the first record that named the object';
COMMENT ON COLUMN region_objects.named_at IS 'Broker time in region B of that record (its arrival in B): a pending object''s age is measured from it';
COMMENT ON COLUMN region_objects.source_topic IS 'Topic of the first record that named the object';
COMMENT ON COLUMN region_objects.source_partition IS 'Partition of that record';
COMMENT ON COLUMN region_objects.source_offset IS 'Offset of that record in region B';
COMMENT ON COLUMN region_objects.attempts IS 'Failed copies so far (0 when the first copy succeeded)';
COMMENT ON COLUMN region_objects.failure IS 'Why the last copy failed: missing_in_a, sha256_mismatch, conflict_in_b, store_unavailable (domain/replication.py CopyFailure); NULL when replicated';
COMMENT ON COLUMN region_objects.last_error IS 'The last failure''s message, for a person';
COMMENT ON COLUMN region_objects.next_try_at IS 'When a pending object is tried again (replicator clock, UTC)';
COMMENT ON COLUMN region_objects.replicated_at IS 'When the object was verified in region B (replicator clock, UTC)';
COMMENT ON COLUMN region_objects.written IS 'True when this replicator''s copy created the key in B; false when B already held the same bytes (a copy made before a crash, read back and compared)';

CREATE TABLE region_replication_progress (
    topic text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
COMMENT ON TABLE region_replication_progress IS 'How far the media replicator has read each mirrored partition of region B''s log: every object of the records before next_offset is in region_objects';
COMMENT ON COLUMN region_replication_progress.topic IS 'A mirrored topic the replicator follows (<prefix>.jobs, <prefix>.uploads)';
COMMENT ON COLUMN region_replication_progress.partition IS 'Partition of that topic in region B';
COMMENT ON COLUMN region_replication_progress.next_offset IS 'Offset in region B of the next record to read: the objects of every earlier record are replicated or recorded as pending';
COMMENT ON COLUMN region_replication_progress.updated_at IS 'When the row was last written (PostgreSQL clock, UTC)';
