-- 004: which Kafka cluster a projection was built from. Stored offsets mean nothing against another
-- cluster (a recreated local broker, a different environment): the projector refuses to mix them.
CREATE TABLE projection_source (
    projection  text PRIMARY KEY,
    cluster_id  text NOT NULL,                -- Kafka cluster id the offsets belong to
    recorded_at timestamptz NOT NULL DEFAULT now()
);
