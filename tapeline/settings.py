"""Settings: one frozen pydantic-settings model, read from `TAPELINE_*` environment variables.

Defaults point at the local stack that `tapeline stack up` starts, so a fresh checkout works
without configuration. Build one `Settings()` per process and pass it down; nothing reads the
environment at import time.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from domain import pipeline
from domain.policy.tiers import TIERS
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parent.parent

Stage = Literal[pipeline.STAGE_NAMES]  # type: ignore[valid-type]  # every registered stage (domain/pipeline.py)
Tier = Literal["archive", "standard", "index"]


class Settings(BaseSettings):
    """Every tunable of a Tapeline process. Each field is also `TAPELINE_<FIELD>` in the environment."""

    # No setting is NaN or infinite: `TAPELINE_LEASE_S=inf` would reach every worker's events.
    model_config = SettingsConfigDict(env_prefix="TAPELINE_", frozen=True, extra="ignore", allow_inf_nan=False)

    app_name: str = Field("tapeline", description="Deployment name; part of every transactional.id and group id")
    home: Path = Field(PROJECT_ROOT / ".tapeline", description="Local stack state and logs directory")
    instance_id: str = Field(default_factory=socket.gethostname, description="This process's name in events")

    # Addresses (the local stack's defaults).
    kafka_bootstrap: str = Field("127.0.0.1:19092", description="host:port of a broker, or a comma-separated list")
    kafka_controller_port: int = 19093
    kafka_brokers: int = Field(1, ge=1, le=9, description="Nodes of the local stack's Kafka cluster, each a combined "
                               "broker and controller: node n listens on the bootstrap port + 2(n-1) and the "
                               "controller port + 2(n-1). 1 (the default) replicates nothing; 3 runs topics with "
                               "replication factor 3 and min.insync.replicas 2, as production")
    topic_replication_factor: int | None = Field(None, ge=1, description="Replicas of every topic `ensure_topics` "
                                                 "creates; unset: min(3, kafka_brokers)")
    topic_min_insync_replicas: int | None = Field(None, ge=1, description="min.insync.replicas of every topic; "
                                                  "unset: the replication factor - 1, at least 1")
    # Kafka security (docs/security.md). Every client the factory makes (tapeline/kafka.py) and MirrorMaker 2's
    # properties (regions/mirror.py) take these; the librdkafka names are in brackets.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How clients talk to the brokers (security.protocol): PLAINTEXT (the local "
        "stack), SSL (TLS, mutual TLS with a client certificate), SASL_PLAINTEXT, SASL_SSL (managed Kafka: MSK, "
        "Confluent Cloud, Aiven; `tapeline stack up --secure`)")
    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER"] = Field(
        "SCRAM-SHA-512", description="SASL mechanism (sasl.mechanism) with a SASL_* protocol: SCRAM-SHA-512 or "
        "-256 (MSK, Aiven, the secure local stack), PLAIN (Confluent Cloud API keys), OAUTHBEARER (librdkafka's "
        "OIDC client credentials: sasl.oauthbearer.* in kafka_extra_config)")
    kafka_sasl_username: str | None = Field(None, description="SASL user name of this process's principal (one "
                                            "per role: see kafka_credentials_file)")
    kafka_sasl_password: SecretStr | None = Field(None, description="SASL password of kafka_sasl_username; a "
                                                  "secret: never logged or shown")
    kafka_credentials_file: Path | None = Field(None, description="JSON file of one principal per role, "
                                                "{\"<role>\": {\"username\": ..., \"password\": ...}}: a "
                                                "process running role R uses R's entry (the operator CLI "
                                                "\"operator\", MirrorMaker 2 \"mirror\"); a role without one uses "
                                                "kafka_sasl_username/password. `stack up --secure` writes one")
    kafka_role: str | None = Field(None, description="The role whose principal this process uses; `tapeline run "
                                   "--role R` sets it to R; unset: operator (the CLI)")
    kafka_ssl_ca_location: Path | None = Field(None, description="PEM file of the CA(s) that signed the brokers' "
                                               "certificates (ssl.ca.location); unset: the system's CA store")
    kafka_ssl_certificate_location: Path | None = Field(None, description="PEM client certificate for mutual TLS "
                                                        "(ssl.certificate.location)")
    kafka_ssl_key_location: Path | None = Field(None, description="PEM private key of that certificate "
                                                "(ssl.key.location)")
    kafka_ssl_key_password: SecretStr | None = Field(None, description="Password of an encrypted private key "
                                                     "(ssl.key.password); a secret")
    kafka_extra_config: dict[str, SecretStr] = Field({}, description="More librdkafka settings for every client, JSON "
                                               "(e.g. sasl.oauthbearer.method=oidc and its token endpoint); a key "
                                               "the factory sets itself is refused; values are kept secret")
    database_url: str = "postgresql://tapeline:tapeline@127.0.0.1:5432/tapeline"
    db_schema: str = Field("public", description="PostgreSQL schema of the live projections (the search_path)")
    s3_endpoint: str = Field("http://127.0.0.1:19000", description="S3 endpoint URL: https://s3.<region>.amazonaws.com "
                             "for AWS S3, your provider's https:// URL elsewhere")
    s3_bucket: str = "tapeline-media"
    s3_region: str = "us-east-1"
    public_base_url: str = Field("", description="Base URL clients reach published objects at (a CDN or DNS name in "
                                 "front of every region's bucket): a published URL is this + '/' + the object's key "
                                 "(https://media.example.com/published/<job>/master.m3u8); empty: the S3 endpoint's "
                                 "URL of the object (s3_endpoint, s3_bucket, s3_addressing_style)")
    s3_access_key: str | None = Field("tapeline", description="Static S3 access key id; unset (empty) together with "
                                      "s3_secret_key: the AWS default credential chain (AWS_* environment, shared "
                                      "config and credentials files, web identity, container or instance profile)")
    s3_secret_key: str | None = Field("tapeline-secret", description="Static S3 secret key; unset (empty) with "
                                      "s3_access_key: the AWS default credential chain")
    s3_ca_bundle: Path | None = Field(None, description="PEM file of the CAs that sign the S3 endpoint's certificate "
                                      "(botocore's verify=); unset: botocore's own bundle, or AWS_CA_BUNDLE")
    s3_addressing_style: Literal["path", "virtual", "auto"] = Field(
        "path", description="How a request names the bucket: path (https://host/bucket/key, the local stack, MinIO) "
                            "or virtual (https://bucket.host/key, what AWS S3 recommends); auto: botocore decides")
    s3_sse: Literal["AES256", "aws:kms", "aws:kms:dsse"] | None = Field(
        None, description="Server-side encryption asked on every object Tapeline writes (PutObject, "
                          "CreateMultipartUpload, CopyObject): AES256 (SSE-S3) or aws:kms (SSE-KMS); unset (empty): "
                          "none asked, the bucket's default encryption applies")
    s3_sse_kms_key_id: str | None = Field(None, description="KMS key (id, alias or ARN) of aws:kms encryption; "
                                          "unset: the account's AWS managed key aws/s3")
    s3_connect_timeout_s: float = Field(5.0, description="S3 connect timeout, seconds")
    s3_read_timeout_s: float = Field(30.0, description="S3 read timeout, seconds: a silent endpoint fails the call "
                                                       "(storage_transient, retried by policy) instead of hanging")
    s3_max_attempts: int = Field(4, description="Tries per S3 call, botocore standard retry mode (1 = no retry)")

    # Regions (docs/regions.md). Region A is what every other field describes; region B is derived from
    # it by `Settings.for_region("b")`, the one rule, with each address overridable below.
    region: Literal["a", "b"] = Field("a", description="The region these settings describe. Set by "
                                      "`Settings.for_region`; `a` is the default deployment, `b` the standby that "
                                      "`tapeline stack up --region b` starts (docs/regions.md)")
    region_b_port_offset: int = Field(10000, ge=1, le=40000, description="Region B's Kafka broker and controller "
                                      "ports and its S3 endpoint's port are region A's plus this (19092 -> 29092, "
                                      "19093 -> 29093, 19000 -> 29000)")
    region_b_kafka_bootstrap: str | None = Field(None, description="Region B's Kafka host:port; unset: region A's "
                                                 "first address with its port + region_b_port_offset")
    region_b_kafka_controller_port: int | None = Field(None, description="Region B's KRaft controller port; unset: "
                                                       "kafka_controller_port + region_b_port_offset")
    region_b_database_url: str | None = Field(None, description="Region B's PostgreSQL DSN (its own server); unset: "
                                              "database_url with port region_b_postgres_port")
    region_b_postgres_port: int = Field(5433, description="Port of region B's own PostgreSQL server (a second "
                                        "cluster, data under region B's home) when region_b_database_url is unset")
    region_b_s3_endpoint: str | None = Field(None, description="Region B's S3 endpoint; unset: s3_endpoint with its "
                                             "port + region_b_port_offset")
    region_b_home: Path | None = Field(None, description="Region B's stack home (state, logs, Kafka and PostgreSQL "
                                       "data, the mirror's files); unset: <home>/region-b")
    region_b_health_port_base: int | None = Field(None, ge=0, le=65535, description="Health port base of region "
                                                  "B's `run --role all` (its intake's readiness is how a failover "
                                                  "knows region B accepts uploads); unset: region A's "
                                                  "health_port_base (9400 when 0) + region_b_port_offset")
    intake_public_url: str | None = Field(None, description="Base URL clients reach this region's HTTP intake at "
                                          "(`tapeline serve`; a fenced region's intake names the active region's in "
                                          "its 503); unset: http://<serve_host, 127.0.0.1 for a wildcard>:<serve_port>")
    region_b_intake_public_url: str | None = Field(None, description="Base URL of region B's HTTP intake; unset: "
                                                   "region A's intake address with its port + region_b_port_offset "
                                                   "(http://127.0.0.1:18400)")
    region_check_interval_s: float = Field(5.0, gt=0, description="`tapeline run`: seconds between its checks "
                                           "that its region still holds the job history (a region fenced by a "
                                           "failover stops its processors; docs/regions.md \"Failover\")")
    region_b_mirror: bool = Field(True, description="`stack up --region b` also starts MirrorMaker 2 mirroring "
                                  "region A's topics into region B (false: region B starts empty and independent)")
    replicate_retry_first_s: float = Field(0.5, gt=0, description="`tapeline region replicate`: seconds before the "
                                           "first retry of an object that could not be copied; doubled per failure")
    replicate_retry_max_s: float = Field(30.0, gt=0, description="`tapeline region replicate`: longest wait between "
                                         "two tries of one object (or of a record while a store does not answer), seconds")
    replicate_health_port: int = Field(9490, ge=0, le=65535, description="`tapeline region replicate`: its health "
                                       "and metrics port on health_host (region B's replication lag as Prometheus "
                                       "gauges, /health/deep for the dashboard's Region replication panel); 0: no "
                                       "server, no measurement, no panel")
    replicate_measure_every_s: float = Field(30.0, gt=0, le=3600, description="`tapeline region replicate`: seconds "
                                             "between two measurements of region B's lag (a background thread)")
    replicate_measure_timeout_s: float = Field(20.0, gt=0, le=600, description="`tapeline region replicate`: longest "
                                               "one measurement's reads may take, seconds (past it a partition counts "
                                               "as an upper bound, exact false)")
    kafka_jars: Path | None = Field(None, description="Directory of the Kafka jars (broker and MirrorMaker 2); "
                                    "unset: <home>/kafka/libs. Region B shares region A's")

    # Topics.
    topic_prefix: str = Field("tapeline", description="Topics are <prefix>.uploads, <prefix>.jobs, ...")
    uploads_partitions: int = 6
    jobs_partitions: int = 12
    work_partitions: int = 12

    # Lease protocol (seconds). docs/design.md defaults: lease 120 s, heartbeat lease/4, no-progress 120 s.
    lease_s: float = Field(120.0, gt=0, le=86400, description="Attempt lease, seconds (at most a day)")
    leader_session_timeout_s: float = Field(
        15.0, ge=6, le=3600, description="Seconds within which PostgreSQL ends the session of a watchdog, notifier or "
                                         "projector leader whose host stopped answering (TCP keepalives and "
                                         "tcp_user_timeout on both ends), so a standby takes the leader lock; "
                                         "tapeline/postgres.py dead_peer_settings")
    heartbeat_interval_s: float | None = None
    no_progress_timeout_s: float = 120.0
    seek_decode_min_speed: float = Field(
        1.0, description="Media seconds ffmpeg decodes per wall second at least while it seeks silently to a "
                         "resume point (from the keyframe before it); the no-progress timeout of a resumed "
                         "attempt grows by that distance divided by this speed until frames come out")
    download_min_bytes_per_s: float = Field(
        20 * 1024**2, gt=0, description="Slowest source download (bytes per second) a transcode attempt is allowed "
                                        "before ffmpeg starts: the no-progress timeout grows by the source's size "
                                        "divided by this while it downloads (20 GiB: about 17 minutes)")
    suspect_fraction: float = Field(
        0.5, gt=0, lt=1, description="A running attempt is shown as suspect (before the watchdog's verdict) once its "
                                     "progress counters or heartbeats have been still for more than this fraction "
                                     "of their allowance (domain/policy/stall.py attempt_suspect)")
    recent_stalls_s: float = Field(
        3600.0, ge=0, description="Seconds a judged attempt stall stays listed (tapeline stalled, /api/stalled, the "
                                  "Stalled page) with what was done about it, after the verdict (log clock)")
    handoff_timeout_s: float = Field(120.0, description="A queued stage nobody claims this long is a stalled handoff")
    intake_timeout_s: float = Field(120.0, description="An upload with no job this long is expected work missing")
    tick_interval_s: float | None = Field(None, description="Watchdog tick period, seconds (default: lease / 8, at most 5)")
    restart_backoff_s: tuple[float, ...] = Field((1.0, 2.0, 5.0, 10.0, 30.0), description="`run --role all`: restart "
                                                 "delay after a child's n-th consecutive crash, seconds (last repeats)")
    shutdown_grace_s: float = Field(20.0, description="SIGTERM: how long `run --role all` waits for children to yield, then SIGKILL")
    transaction_timeout_ms: int = Field(10_000, description="Producer transaction.timeout.ms: well below the lease")
    kafka_session_timeout_ms: int = Field(
        10_000, ge=1000, description="Consumer session.timeout.ms: how long the group waits for a member that stopped "
        "heartbeating (a killed process, even one restarted at once) before its partitions move")
    caught_up_timeout_s: float = Field(60.0, description="How long a processor waits for the projector to catch up")

    # Cleanup by the watchdog leader (domain/policy/cleanup.py); times on the log clock.
    cleanup_retention_s: float = Field(3600.0, description="Work objects and claim markers of an ended job are removed "
                                       "this long after it ended; an orphan must be at least this old")
    cleanup_orphans: bool = Field(True, description="Also remove objects of jobs this deployment does not know and "
                                  "sources that never became a job (off when deployments share a bucket)")
    cleanup_max_deletes: int = Field(200, description="At most this many objects removed (and multipart uploads "
                                     "aborted) per watchdog tick; 0 turns cleanup off")
    cleanup_page_keys: int = Field(1000, description="Keys the orphan sweep lists per watchdog tick")
    cleanup_interval_s: float = Field(10.0, description="At most one cleanup step per this many seconds of "
                                      "watchdog ticks (a listing is not free)")
    multipart_stale_s: float = Field(86400.0, description="An unfinished multipart upload this old is aborted, seconds")

    # Media.
    segment_s: float = Field(4.0, description="HLS target segment length, seconds of media")
    x264_preset: str = "veryfast"
    ladder: tuple[int, ...] = Field((1080, 720, 480, 360, 240), description="Rendition heights, largest first")
    # Pre-flight limits on a source (intake refuses a source past one with `limits_exceeded`).
    max_upload_bytes: int = Field(20 * 1024**3, description="Largest source file, bytes")
    max_source_pixels: int = Field(8192 * 4320, description="Largest coded picture, width x height in pixels (8K)")
    max_source_duration_s: float = Field(4 * 3600.0, description="Longest source, seconds of media")
    max_source_bitrate_kbps: int = Field(200_000, description="Highest source bitrate (whole file), kbit/s")
    probe_timeout_s: float = Field(300.0, description="Longest an intake ffprobe (which reads every packet) may run, s")
    intake_record_max_tries: int = Field(4, ge=1, description="Tries of one uploads record that fails (any error, "
                                         "transient ones too) before the intake dead-letters it with its reason")
    intake_record_backoff_s: float = Field(2.0, ge=0, description="Wait before an uploads record's second try, "
                                           "seconds; doubles per try, at most 30 s (processors/intake.py states the "
                                           "bound this gives)")
    ffmpeg_timeout_s: float = Field(600.0, description="Wall-clock limit of one transcode: this many seconds plus ...")
    ffmpeg_timeout_factor: float = Field(10.0, description="... this many seconds per second of source media")
    # Limits of one ffmpeg run (domain/policy/ffmpeg_limits.py, docs/media.md "ffmpeg within limits"): each
    # explicit one is used as it is; unset, it is derived from the source (pixels x frames x rungs).
    ffmpeg_memory_bytes: int | None = Field(None, ge=1, description="Address space of one ffmpeg run (RLIMIT_AS), "
                                            "bytes; unset: base + rungs x (per rung + CPUs x per rung per CPU) + "
                                            "per pixel x (source + rung pixels)")
    ffmpeg_memory_base_bytes: int = Field(512 * 1024**2, ge=0, description="Derived memory limit: fixed part, bytes")
    ffmpeg_memory_per_rung_bytes: int = Field(64 * 1024**2, ge=0, description="Derived memory limit: per rung, bytes")
    ffmpeg_memory_per_rung_per_cpu_bytes: int = Field(32 * 1024**2, ge=0, description="Derived memory limit: per "
                                                      "rung per CPU (encoder threads and their stacks), bytes")
    ffmpeg_memory_per_pixel_bytes: float = Field(96.0, ge=0, description="Derived memory limit: per pixel of the "
                                                 "source's frame and of each rung's, bytes")
    ffmpeg_cpu_s: float | None = Field(None, gt=0, description="CPU time of one ffmpeg run (RLIMIT_CPU, user + "
                                       "system, every thread), seconds, rounded up to whole seconds; unset: base + "
                                       "ns per pixel-frame x frames x (source + rung pixels)")
    ffmpeg_cpu_base_s: float = Field(60.0, ge=0, description="Derived CPU-time limit: fixed part, seconds")
    ffmpeg_cpu_ns_per_pixel_frame: float = Field(200.0, ge=0, description="Derived CPU-time limit: nanoseconds per "
                                                 "pixel of every frame decoded and of every frame encoded per rung")
    ffmpeg_temp_disk_bytes: int | None = Field(None, ge=1, description="Bytes the attempt's temp directory (the "
                                               "source, reused and new segments) may hold while ffmpeg runs, "
                                               "measured; unset: source + base + factor x expected output")
    ffmpeg_temp_disk_base_bytes: int = Field(64 * 1024**2, ge=0, description="Derived temp-disk limit: fixed part, "
                                             "bytes")
    ffmpeg_temp_disk_factor: float = Field(2.0, ge=0, description="Derived temp-disk limit: times the expected "
                                           "output (duration x peak bitrates + MPEG-TS overhead per frame)")
    ffmpeg_file_bytes: int | None = Field(None, ge=1, description="Largest file one ffmpeg run may write "
                                          "(RLIMIT_FSIZE), bytes; unset: the temp-disk limit")
    ffmpeg_open_files: int | None = Field(None, ge=3, description="Descriptors of one ffmpeg run (RLIMIT_NOFILE); "
                                          "unset: base + per rung x rungs")
    ffmpeg_open_files_base: int = Field(64, ge=3, description="Derived open-files limit: fixed part")
    ffmpeg_open_files_per_rung: int = Field(8, ge=0, description="Derived open-files limit: per rung")
    multipart_chunk_bytes: int = 8 * 1024**2

    # Priority tiers (processors/tier_heads.py), result reuse and the degradation ladder (processors/reuse.py).
    tier_starvation_limit: int = Field(4, ge=1, description="A worker passes over a tier with waiting work at most "
                                       "this many claims in a row; then that tier goes first (aging)")
    tier_gather_s: float = Field(0.2, description="A free worker choosing a tier polls until every partition it "
                                 "holds has a head or reported its end, or nothing arrived for this long, seconds")
    reuse_results: bool = Field(True, description="A source whose sha256 and output profile match a completed job "
                                "reuses that job's published outputs (verified to exist) instead of transcoding")
    degrade_backlog_threshold: int | None = Field(100, description="While a tier's backlog (waiting + running jobs) "
                                                  "is above this, its new jobs get the cheaper ladder; unset: never")
    degrade_tiers: tuple[str, ...] = Field(("standard", "index"), description="Tiers the degradation ladder applies "
                                           "to (archive preservation keeps full quality by default)")
    degraded_x264_preset: str = Field("superfast", description="x264 preset of a degraded job (faster than "
                                      "`x264_preset`); a degraded job also drops the top rendition")

    # Publish providers (besides the object-store origin, which is always published to).
    webhook_url: str | None = Field(None, description="Base URL of an HTTP publish provider (POST {url}/posts)")
    webhook_dedupes: bool = Field(False, description="Whether that provider dedupes posts by Idempotency-Key; "
                                                     "if not, an uncertain post goes to needs_review")
    webhook_timeout_s: float = Field(10.0, description="Timeout of one webhook call, seconds")
    webhook_max_in_flight: int = Field(4, description="Posts to the webhook provider in flight at once, across "
                                                      "every publish process (PostgreSQL advisory-lock slots)")
    webhook_quota: int | None = Field(None, description="At most this many posts per `webhook_quota_window_s` "
                                                        "(unset: no quota); past it, provider_throttled until a slot frees")
    webhook_quota_window_s: float = Field(60.0, description="Quota window (the per-minute quota), seconds")
    webhook_daily_quota: int | None = Field(None, description="At most this many posts per `webhook_daily_window_s` "
                                                              "(unset: no daily quota)")
    webhook_daily_window_s: float = Field(86400.0, description="Daily quota window, seconds (a sliding 24 h)")
    webhook_cooldown_s: float = Field(5.0, description="Breaker cooldown after a 5xx or no answer without "
                                                       "Retry-After, seconds; doubles per consecutive failure")
    webhook_cooldown_max_s: float = Field(300.0, description="Longest breaker cooldown, seconds")
    webhook_probe_timeout_s: float = Field(30.0, description="How long a half-open breaker waits for its one "
                                                             "probe post before another attempt may probe, seconds")

    # Customer notifications by webhook (processors/notify.py, the `notify` role).
    notify_allow_private: bool = Field(False, description="Allow webhook endpoints that resolve to private, "
                                                          "link-local or other non-global addresses (loopback included)")
    notify_allow_loopback: bool = Field(False, description="Allow webhook endpoints on loopback addresses only "
                                                           "(tests, a receiver on the same machine)")
    notify_timeout_s: float = Field(10.0, gt=0, le=300, description="Timeout of one webhook POST (connect, write "
                                                                    "and each read), seconds")
    notify_max_in_flight_per_endpoint: int = Field(2, ge=1, description="POSTs in flight at once to one endpoint")
    notify_workers: int = Field(8, ge=1, description="POSTs in flight at once across every endpoint")
    notify_retry_schedule_s: tuple[float, ...] = Field(
        (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0),
        description="Wait after each failed try, seconds (JSON list; Standard Webhooks' schedule: 8 tries over "
                    "about 27.6 h); past its end the delivery is dead-lettered")
    notify_disable_after_s: float = Field(432000.0, gt=0, description="An endpoint failing without a success this "
                                                                      "long (5 days) is disabled")
    notify_lookback_s: float = Field(604800.0, gt=0, description="Lifecycle events appended longer ago than this "
                                                                  "(7 days) are not notified: it bounds the notifier's "
                                                                  "scan (a notifier down longer misses them)")
    notify_poll_s: float = Field(1.0, gt=0, description="How often the notifier looks for new and due deliveries")
    notify_response_limit_bytes: int = Field(4096, ge=0, description="At most this much of an endpoint's answer is "
                                                                     "read (kept in the failure reason)")

    # Per-stage concurrency: worker processes of each stage that `tapeline run --role all` starts.
    transcode_workers: int = Field(1, ge=1, description="`run --role all`: transcode worker processes")
    publish_workers: int = Field(1, ge=1, description="`run --role all`: publish worker processes")
    stage_workers: dict[str, int] = Field(default_factory=dict, description="`run --role all`: worker processes of "
                                          "any other registered stage (stage -> count, default 1 each)")
    stage_options: dict[str, dict[str, float | int | str]] = Field(
        default_factory=dict, description="Options of a registered stage (JSON, stage -> name -> value), read by "
        "its own module with its own defaults, e.g. {\"thumbnails\": {\"interval_s\": 2, \"tile_width\": 160}}")
    worker_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.#-]{1,64}$",
        description="This worker's stable name on its host (`tapeline run --role all` names its children transcode, "
                    "transcode#2, ...; under systemd or Kubernetes give each worker its own). With it, a restarted "
                    "worker rescues at once the attempts an earlier incarnation of the same name held when it died")

    submitter_daily_quota: int | None = Field(None, description="Jobs one submitter may have accepted per 24 h "
                                                                "(log time); past it, JobRejected(quota_exceeded)")

    max_attempts: int = 3
    retry_backoff_s: tuple[float, ...] = Field((60.0, 300.0, 900.0), description="Backoff per retry, seconds (last repeats)")
    retry_jitter: float = Field(0.1, description="Backoff jitter, fraction (0.1 = +-10 %)")
    retry_backoff_by_class: dict[str, tuple[float, ...]] = Field(
        default_factory=dict, description="Backoff per error class (JSON), seconds; the stall classes "
                                          "(worker_lost, progress_stalled) retry at once unless named here")

    # Health and metrics (tapeline/health.py).
    health_host: str = Field("127.0.0.1", description="Address the health and metrics server listens on")
    health_port: int = Field(0, description="Health and metrics port of this process; 0 disables the server")
    health_port_base: int = Field(0, description="run --role all: child i of supervisor.ROLES (projector, intake, "
                                                 "transcode, publish, ...) gets port base + i; 0 disables")

    # Local monitoring (`tapeline stack up --with-monitoring`, devstack/monitoring.py).
    prometheus_port: int = Field(19090, description="Port of the local stack's Prometheus (127.0.0.1)")
    alertmanager_port: int = Field(19091, description="Port of the local stack's Alertmanager (127.0.0.1)")
    monitoring_interval_s: float = Field(15.0, gt=0, le=3600, description="The local Prometheus's scrape and rule "
                                         "evaluation interval, seconds (a test shortens it)")
    alert_rules_file: str = Field("", description="The alert rules the local Prometheus loads (a path); empty: the "
                                  "shipped compose/alerts.yml")

    # The read API and dashboard (`tapeline serve`, projections/api.py).
    serve_host: str = Field("127.0.0.1", description="Address `tapeline serve` listens on (loopback by default)")
    serve_allowed_hosts: list[str] = Field(default_factory=list, description="Host header values `tapeline serve` "
                                           "answers (JSON list; `*.example.com` patterns, `*` any); empty: loopback "
                                           "names when bound to loopback, else any (projections/edge.py)")
    serve_max_body_bytes: int = Field(65536, gt=0, description="Largest request body of any route but POST /uploads "
                                      "(which has max_upload_bytes), bytes; past it 413 before the body is parsed")
    serve_port: int = Field(8400, description="Port of `tapeline serve` (read API, dashboard, /metrics)")
    reader_role: str = Field("tapeline_reader", description="PostgreSQL role the read API switches to (SET ROLE) on "
                                                            "every connection; the login user must be a member")
    admin_token: SecretStr | None = Field(None, description="Bearer token the API's actions (replay, resolve, cancel) "
                                                            "require; unset: every action answers 401")
    lag_cache_s: float = Field(3.0, description="`tapeline serve`: reuse a projection-lag measurement this long, s")

    # The HTTP intake (`POST /uploads` on `tapeline serve`, producers/http_intake.py).
    intake_tokens: dict[str, str] = Field(default_factory=dict, description="HTTP intake API tokens (JSON): "
                                          "{token: submitter name}; empty: every upload answers 401")
    intake_tier_capacity: dict[str, int] = Field(
        default_factory=lambda: {"archive": 200, "standard": 100, "index": 50},
        description="Per tier (JSON): that tier's backlog (waiting + running + admitted uploads not yet decided) "
                    "at which new uploads of the tier get 503 + Retry-After")
    intake_total_capacity: int = Field(300, description="Backlog of every tier together at which archive uploads "
                                       "get 503; each tier below archive is refused `intake_tier_reserve` jobs earlier")
    intake_tier_reserve: int = Field(30, description="Jobs of the total capacity kept for each higher tier: "
                                     "standard is refused at total - reserve, index at total - 2 x reserve")
    intake_max_in_flight_per_submitter: int | None = Field(
        50, description="Jobs one submitter may have accepted and not ended at once; past it 429 + Retry-After "
                        "(unset: no cap)")
    intake_submitter_tier_share: float = Field(
        0.5, gt=0, le=1, description="Fraction of a tier's capacity one submitter may hold (its jobs of the tier "
                                     "waiting or running plus its uploads of the tier not yet decided), rounded up, "
                                     "at least 1; past it 429 tier_share, so one submitter cannot close a tier to "
                                     "the others (domain/policy/admission.py)")
    intake_max_starting_per_submitter: int = Field(
        64, ge=1, description="Uploads of one submitter an intake process reads before their bodies are moving "
                              "(domain/policy/body_rate.py); they hold no slot, but each holds what it has read (at "
                              "most intake_body_min_rate_bytes_s x intake_body_rate_window_s plus one read); past it "
                              "429 too_many_starting")
    intake_retry_after_min_s: float = Field(1.0, description="Smallest Retry-After the intake answers, seconds")
    intake_retry_after_max_s: float = Field(300.0, description="Largest Retry-After; also used when nothing "
                                            "completed recently (no throughput to estimate from), seconds")
    intake_throughput_window_s: float = Field(300.0, description="Recent completions over this many seconds "
                                              "estimate Retry-After")
    intake_idempotency_wait_s: float = Field(600.0, description="How long a request with a reused Idempotency-Key "
                                             "waits for the first request with it to finish, seconds")
    intake_claim_lease_s: float = Field(30.0, gt=0, description="An admitted upload's claim (its intake_uploads "
                                        "row) is renewed every third of this while its request runs; one not renewed "
                                        "this long belongs to an intake that went away: it stops counting against "
                                        "capacity and its Idempotency-Key may be sent again, seconds")
    intake_body_timeout_s: float = Field(20.0, gt=0, description="An upload's body gets this long plus one second "
                                         "per intake_body_min_rate_bytes_s received (domain/policy/body_rate.py), "
                                         "seconds; past it 408 and its slot is released")
    intake_body_min_rate_bytes_s: float = Field(65536.0, gt=0, description="Slowest average pace an upload's body may "
                                                "keep after intake_body_timeout_s, bytes per second")
    intake_body_idle_timeout_s: float = Field(30.0, gt=0, description="Longest pause between two chunks of an "
                                              "upload's body, seconds; past it 408 and its slot is released")
    intake_body_rate_window_s: float = Field(2.0, gt=0, description="An upload takes a slot (is admitted) only once "
                                             "its body has moved intake_body_min_rate_bytes_s x this many bytes "
                                             "(128 KiB by default) or ended, seconds; until then it holds no slot "
                                             "and no thread (domain/policy/body_rate.py)")
    intake_key_retention_s: float = Field(86400.0, gt=0, description="A published upload's Idempotency-Key answers "
                                          "with the first response this long; later the row is deleted, seconds")
    storage_limit_bytes: int | None = Field(None, description="Object storage budget, bytes (the bucket's total): "
                                            "past it new uploads get 507 and cleanup uses storage_pressure_retention_s "
                                            "(unset: no guard)")
    storage_usage_cache_s: float = Field(30.0, description="Reuse one measurement of the bucket's bytes this long, s")
    storage_pressure_retention_s: float = Field(300.0, description="Cleanup retention of ended jobs' work objects "
                                                "and checkpoints while storage is past its limit, seconds")

    @field_validator("public_base_url", "intake_public_url", "region_b_intake_public_url")
    @classmethod
    def _http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A public address is an http(s) URL with a host, kept without its trailing slash; empty
        means unset ("" for `public_base_url`, else None). Raises ValueError for anything else."""
        if value is None or not value.strip():
            return "" if info.field_name == "public_base_url" else None
        value = value.strip().rstrip("/")
        scheme, _, rest = value.partition("://")
        if scheme not in ("http", "https") or not rest:
            raise ValueError(f"{value!r} is not an http:// or https:// URL")
        return value

    @field_validator("s3_access_key", "s3_secret_key", "s3_ca_bundle", "s3_sse", "s3_sse_kms_key_id",
                     mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """An empty (or blank) value of an optional S3 setting means unset: `TAPELINE_S3_ACCESS_KEY=` selects
        the default credential chain, as an environment variable cannot be None."""
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _s3_settings_agree(self) -> "Settings":
        """Reject S3 settings that contradict each other: one static key without the other (botocore
        would take the half from the default chain and sign with a mismatched pair), a KMS key id without
        `s3_sse` aws:kms, a CA bundle that is no file. Raises ValueError naming the settings."""
        if (self.s3_access_key is None) != (self.s3_secret_key is None):
            raise ValueError("TAPELINE_S3_ACCESS_KEY and TAPELINE_S3_SECRET_KEY are set together (static keys) or "
                             "both left empty (the AWS default credential chain), not one of them")
        if self.s3_sse_kms_key_id is not None and self.s3_sse not in ("aws:kms", "aws:kms:dsse"):
            raise ValueError(f"TAPELINE_S3_SSE_KMS_KEY_ID is set but TAPELINE_S3_SSE is {self.s3_sse!r}: a KMS key "
                             "is used only with TAPELINE_S3_SSE=aws:kms")
        if self.s3_ca_bundle is not None and not Path(self.s3_ca_bundle).is_file():
            raise ValueError(f"TAPELINE_S3_CA_BUNDLE {self.s3_ca_bundle} is not a file (a PEM file of CA certificates)")
        return self

    @model_validator(mode="after")
    def _timeouts_fit_inside_the_lease(self) -> "Settings":
        """Reject timings that break the lease protocol, whatever each is alone.

        - A heartbeat interval of the lease or more lets every healthy attempt lapse between two
          heartbeats (docs/design.md: heartbeat every lease/4).
        - `transaction_timeout_ms` must be below the lease: a worker killed inside a transaction blocks
          every `read_committed` reader of its partitions until the broker aborts it (docs/design.md "Open
          transactions block readers").
        - with a webhook, `webhook_timeout_s` must be below the lease: the publish stage does not heartbeat during the
          provider call, so a slower answer would make a healthy attempt look stalled.

        Raises ValueError (pydantic's ValidationError) naming both settings.
        """
        lease = self.lease_s
        if self.heartbeat_interval_s is not None and not 0 < self.heartbeat_interval_s < lease:
            raise ValueError(f"TAPELINE_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g} s) must be more than 0 and "
                             f"less than TAPELINE_LEASE_S ({lease:g} s), or unset for lease / 4: attempts would lapse "
                             "between heartbeats")
        if self.transaction_timeout_ms >= lease * 1000:
            raise ValueError(f"TAPELINE_TRANSACTION_TIMEOUT_MS ({self.transaction_timeout_ms} ms) must be less than "
                             f"TAPELINE_LEASE_S ({lease:g} s): a killed worker's open transaction blocks the "
                             "projections of its partitions until it times out; set it to a fraction of the lease")
        if self.webhook_url and self.webhook_timeout_s >= lease:
            raise ValueError(f"TAPELINE_WEBHOOK_TIMEOUT_S ({self.webhook_timeout_s:g} s) must be less than "
                             f"TAPELINE_LEASE_S ({lease:g} s): the publish stage does not heartbeat during the "
                             "provider call, so a slower call would look like a stalled attempt")
        return self

    def for_region(self, region: str) -> "Settings":
        """These settings for `region`: the one rule that derives a region from region A's settings.

        `"a"` returns region A's settings (these, when they are region A's). `"b"` returns a copy with
        region B's own addresses, each from its `region_b_*` field when set, else derived:

        - Kafka: one node at region A's first bootstrap host, port + `region_b_port_offset` (29092);
          controller port `kafka_controller_port` + offset (29093);
        - PostgreSQL: `database_url` with its port replaced by `region_b_postgres_port` (5433), same
          user, password and database name (a second server, not a second database);
        - S3: `s3_endpoint` with its port + offset (29000), same bucket and credentials;
        - home: `<home>/region-b`; the Kafka jars stay region A's (`kafka_jars`);
        - its processors' health ports from `region_b_health_port_base` (19400: 9400 + offset);
        - its HTTP intake's public address from `region_b_intake_public_url`, else region A's
          `intake_address` with its port + offset (http://127.0.0.1:18400);
        - one Kafka node, so its topics' replicas and `min.insync.replicas` are 1 whatever region A's.

        Topic names, app name and every other setting are kept: the mirror keeps topic names
        (docs/regions.md). Raises ValueError for an unknown region, or when these settings already
        describe region B (derive from region A's, whose addresses the mirror also needs).
        """
        if region not in ("a", "b"):
            raise ValueError(f"unknown region {region!r}: Tapeline knows regions 'a' and 'b'")
        if self.region != "a":
            raise ValueError(f"these settings describe region {self.region!r}; derive regions from region A's")
        if region == "a":
            return self
        offset = self.region_b_port_offset
        first = self.kafka_bootstrap.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        kafka = self.region_b_kafka_bootstrap or f"{host or first}:{(int(port) if host else 9092) + offset}"
        return self.model_copy(update={
            "region": "b",
            "kafka_bootstrap": kafka,
            "kafka_controller_port": self.region_b_kafka_controller_port or self.kafka_controller_port + offset,
            "kafka_brokers": 1,  # one node: replicas and min.insync.replicas follow it (not region A's)
            "topic_replication_factor": None,
            "topic_min_insync_replicas": None,
            "database_url": self.region_b_database_url or _with_port(self.database_url, self.region_b_postgres_port),
            "s3_endpoint": self.region_b_s3_endpoint or _with_port(self.s3_endpoint, offset, relative=True),
            "home": self.region_b_home or Path(self.home) / "region-b",
            "health_port_base": self.region_b_health_port_base if self.region_b_health_port_base is not None
            else (self.health_port_base or 9400) + offset,
            "kafka_jars": self.kafka_jars or Path(self.home) / "kafka" / "libs",
            "intake_public_url": self.region_b_intake_public_url
            or _with_port(self.intake_address, offset, relative=True),
        })

    @property
    def intake_address(self) -> str:
        """Base URL (no trailing slash) clients reach this region's HTTP intake at: `intake_public_url`,
        else `http://<serve_host>:<serve_port>` (127.0.0.1 for a wildcard bind address). Region B's is
        set by `for_region` (`region_b_intake_public_url`, else region A's with its port + offset)."""
        if self.intake_public_url:
            return self.intake_public_url
        host = "127.0.0.1" if self.serve_host in ("0.0.0.0", "::", "") else self.serve_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.serve_port}"

    @property
    def replicator_health_address(self) -> str | None:
        """`host:port` where this machine reaches the media replicator's health and metrics server
        (`health_host`, a wildcard bind address reached at 127.0.0.1, and `replicate_health_port`);
        None when `replicate_health_port` is 0."""
        if not self.replicate_health_port:
            return None
        host = "127.0.0.1" if self.health_host in ("0.0.0.0", "::", "") else self.health_host
        return f"{host}:{self.replicate_health_port}"

    @property
    def kafka_nodes(self) -> list[tuple[int, str, int, int]]:
        """The local stack's Kafka nodes as `(node_id, host, broker_port, controller_port)`, node ids from 1:
        node n at the first bootstrap address's port + 2(n-1) and `kafka_controller_port` + 2(n-1)."""
        first = self.kafka_bootstrap.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        host, broker_port = (host.strip("[]"), int(port)) if host else (first, 9092)
        return [(n, host, broker_port + 2 * (n - 1), self.kafka_controller_port + 2 * (n - 1))
                for n in range(1, self.kafka_brokers + 1)]

    @property
    def kafka_bootstrap_servers(self) -> str:
        """What clients get as `bootstrap.servers`: `kafka_bootstrap` as given when it lists several
        addresses or the stack has one node; else every local node, so a client started while node 1
        is down still finds the cluster."""
        if "," in self.kafka_bootstrap or self.kafka_brokers == 1:
            return self.kafka_bootstrap
        return ",".join(f"{host}:{port}" for _, host, port, _ in self.kafka_nodes)

    @property
    def replication_factor(self) -> int:
        """Replicas of each topic: `topic_replication_factor`, else min(3, kafka_brokers)."""
        return self.topic_replication_factor or min(3, self.kafka_brokers)

    @property
    def min_insync_replicas(self) -> int:
        """`min.insync.replicas` of each topic: `topic_min_insync_replicas`, else the replication factor
        - 1 (at least 1): with 3 replicas a write needs 2, so one broker may be down and none is lost
        (docs/design.md "Production settings")."""
        return self.topic_min_insync_replicas or max(1, self.replication_factor - 1)

    @property
    def heartbeat_s(self) -> float:
        """Heartbeat interval in seconds (default: a quarter of the lease)."""
        return self.heartbeat_interval_s if self.heartbeat_interval_s else self.lease_s / 4

    def retry_policy(self):
        """The retry policy these settings describe (`domain.policy.retry.RetryPolicy`)."""
        from domain.policy.retry import STALL_BACKOFF_S, RetryPolicy

        return RetryPolicy(max_attempts=self.max_attempts, backoff_s=self.retry_backoff_s, jitter=self.retry_jitter,
                           backoff_by_class={**STALL_BACKOFF_S, **self.retry_backoff_by_class})

    def stall_thresholds(self, stage: str | None = None):
        """The stall rule's thresholds these settings give (`domain.policy.stall.StallThresholds`),
        for an attempt of `stage` when given: its declared no-progress timeout if it has one
        (`domain.pipeline.no_progress_timeout`), else `no_progress_timeout_s`."""
        from domain.policy.stall import StallThresholds

        return StallThresholds(no_progress_timeout_s=pipeline.no_progress_timeout(stage, self.no_progress_timeout_s),
                               handoff_timeout_s=self.handoff_timeout_s, intake_timeout_s=self.intake_timeout_s,
                               suspect_fraction=self.suspect_fraction)

    @property
    def tick_s(self) -> float:
        """Watchdog tick period in seconds: how often the log clock advances when nothing else happens."""
        return self.tick_interval_s if self.tick_interval_s else min(5.0, self.lease_s / 8)

    @property
    def uploads_topic(self) -> str:
        return f"{self.topic_prefix}.uploads"

    @property
    def jobs_topic(self) -> str:
        return f"{self.topic_prefix}.jobs"

    @property
    def dlq_topic(self) -> str:
        return f"{self.topic_prefix}.dlq"

    @property
    def regions_topic(self) -> str:
        """`<prefix>.regions`: the region epochs (`RegionFailedOver`), one partition, never mirrored
        (each region's own; docs/regions.md "Failover")."""
        return f"{self.topic_prefix}.regions"

    def workers_of(self, stage: str) -> int:
        """`run --role all`: worker processes of `stage` (`transcode_workers`, `publish_workers`, else
        `stage_workers[stage]`, default 1)."""
        legacy = {"transcode": self.transcode_workers, "publish": self.publish_workers}
        return legacy[stage] if stage in legacy else max(1, self.stage_workers.get(stage, 1))

    def work_topic(self, stage: str, tier: str) -> str:
        """Work topic of one stage and priority tier, e.g. `tapeline.work.transcode.standard`."""
        return f"{self.topic_prefix}.work.{stage}.{tier}"

    def stage_group(self, stage: str) -> str:
        """Consumer group of one stage's workers on its work topics, `<app_name>.<stage>` (e.g.
        `tapeline.transcode`): what their committed offsets, and so the stage's unclaimed work (the lag
        KEDA scales the transcode Deployment on, deploy/helm/tapeline), are measured against."""
        return f"{self.app_name}.{stage}"

    def work_topics(self, stage: str) -> list[str]:
        return [self.work_topic(stage, tier) for tier in TIERS]

    def all_topics(self) -> dict[str, int]:
        """Every topic name with its partition count."""
        topics = {self.uploads_topic: self.uploads_partitions, self.jobs_topic: self.jobs_partitions,
                  self.dlq_topic: self.jobs_partitions, self.regions_topic: 1}
        for stage in pipeline.STAGE_NAMES:
            for topic in self.work_topics(stage):
                topics[topic] = self.work_partitions
        return topics


def _with_port(url: str, port: int, relative: bool = False) -> str:
    """`url` (scheme://[user[:password]@]host[:port]/...) with its port set to `port`, or, with
    `relative`, to its port (the scheme's default when it has none: 80, 443, 5432) plus `port`."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" not in url:
        raise ValueError("cannot derive region B's address from a key=value DSN; set TAPELINE_REGION_B_DATABASE_URL")
    parts = urlsplit(url)
    default = {"http": 80, "https": 443, "postgresql": 5432, "postgres": 5432}.get(parts.scheme, 0)
    new_port = (parts.port or default) + port if relative else port
    userinfo, _, hostport = parts.netloc.rpartition("@")
    host = hostport.rsplit(":", 1)[0] if parts.port is not None else hostport
    netloc = f"{userinfo}@{host}:{new_port}" if userinfo else f"{host}:{new_port}"
    return urlunsplit(parts._replace(netloc=netloc))
