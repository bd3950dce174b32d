"""Stream processors: intake, transcode, publish. Each is a pure `decide` core and a thin Kafka loop."""
