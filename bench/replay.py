"""Replay benchmark (a script, not a test): how close does a rebuild come to the hardware?

    python -m bench.replay [--events 1000000] [--keep] [--smoke]

(`--smoke`: 5,000 events, for `bench/run.py --smoke`.)

1. Generates about `--events` realistic lifecycle events (jobs with attempts, retries, zombies,
   heartbeats, checkpoints; one upload each) into fresh topics `bench<tag>.*`, with a
   transactional producer, big batches and explicit partitions (`partition_for`).
2. Measures, in one run:
   (a) decode: consume the whole log read_committed and Avro-decode every record, no database;
   (b) replay: `tapeline replay --into bench_<tag>` in a child process (the real CLI: the bulk path
       of `projections/bulk.py`, the default fold engine: native when built), events/s, the peak RSS of its processes (VmHWM, summed) and
       its seconds per phase (read, decode, fold, copy_evidence, write_final_rows, build_indexes),
       and the CPU seconds of its window by who used them: the replay's processes, PostgreSQL, the
       Kafka broker, the rest (`bench.common.cpu_seconds`);
   (b') the same replay with `--engine python` (the reference engine, `projections/native.py`);
   (c) copy: a plain binary `COPY ... FROM STDIN` of the same `lifecycle_evidence` rows, the
       database's own ceiling for the rows a replay writes, the better of two ways: into a table
       with the same indexes, and `COPY ... FREEZE` into an unindexed table then building those
       indexes (what the replay does); then the same rows with other payloads: jsonb holding the
       whole event (the envelope fields too, as before migration 017), jsonb (as before migration
       018), bytea (where the database's ceiling goes: checking and parsing JSON);
3. Prints each rate, the ratios b/a and b/c, and one final line
   `RESULT decode_events_per_s=... replay_events_per_s=... copy_rows_per_s=... replay_vs_decode=...
   replay_vs_copy=... projector_rss_mb=... replay_engine=... replay_python_events_per_s=...
   python_rss_mb=... engine_speedup=...` (b over b').
Services come from the usual `TAPELINE_*` settings (the local stack by default). Topics and schemas
are dropped at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tapeline.kafka import admin_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/replay.py` from the repo root

from bench import lifecycles  # noqa: E402
from bench.common import cpu_delta, cpu_seconds  # noqa: E402
from projections import writes  # noqa: E402
from tapeline import kafka_scan
from tapeline.postgres import connect  # noqa: E402
from domain import events as ev  # noqa: E402
from domain.codec import default_codec  # noqa: E402
from tapeline import kafka  # noqa: E402
import devstack as stack
from tapeline.settings import Settings  # noqa: E402


def generate(settings: Settings, events: int, seed: int = 7) -> tuple[int, float]:
    """Write about `events` lifecycle events (plus one upload per job). Returns (records, seconds)."""
    codec = default_codec()
    producer = _bulk_producer(settings)
    jobs_n, uploads_n = settings.jobs_partitions, settings.uploads_partitions
    written, started, in_txn = 0, time.monotonic(), 0
    per_job = 62  # average lifecycle length with 30 heartbeats and 8 checkpoints
    producer.begin_transaction()
    for job in lifecycles.jobs(seed, max(1, events // per_job)):
        partition = kafka.partition_for(job[0].job_id, jobs_n)
        for event in job:
            producer.produce(settings.jobs_topic, key=event.job_id.encode(), value=codec.encode(event.to_record()),
                             partition=partition)
        upload = lifecycles.upload(job[0].upload_id)
        producer.produce(settings.uploads_topic, key=upload.upload_id.encode(), value=codec.encode(upload.to_record()),
                         partition=kafka.partition_for(upload.upload_id, uploads_n))
        written += len(job) + 1
        in_txn += len(job) + 1
        producer.poll(0)
        if in_txn >= 50_000:
            producer.commit_transaction(120)
            producer.begin_transaction()
            in_txn = 0
            print(f"  generated {written:,} records", file=sys.stderr, end="\r")
    producer.commit_transaction(120)
    print(file=sys.stderr)
    return written, time.monotonic() - started


def _bulk_producer(settings: Settings):
    """A transactional producer that trades latency for throughput (the processors' is the opposite)."""
    from confluent_kafka import Producer

    from tapeline.kafka import client_config

    bulk = Producer({
        **client_config(settings),  # the address and the security settings every client gets
        "transactional.id": f"{settings.app_name}.bench-writer",
        "transaction.timeout.ms": 120_000,  # one transaction per 50,000 records
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 50,  # fill batches: throughput, not latency
        "batch.size": 1_000_000,
        "queue.buffering.max.messages": 500_000,
        "queue.buffering.max.kbytes": 512 * 1024,
    })
    bulk.init_transactions(60)
    return bulk


def wait_until_stable(settings: Settings, timeout_s: float = 60.0) -> None:
    """Wait until every partition's last stable offset (what read_committed readers reach) equals its
    high watermark: `commit_transaction` returns once the coordinator has logged the commit, and
    the markers reach the partitions afterwards, so a reader started at once can stop short of the
    last transaction. Raises SystemExit after `timeout_s`."""
    from confluent_kafka import TopicPartition

    committed = kafka.consumer(settings, f"{settings.app_name}.bench-stable")
    uncommitted = kafka.consumer(settings, f"{settings.app_name}.bench-stable", **{"isolation.level": "read_uncommitted"})
    try:
        partitions = [TopicPartition(topic, p) for topic in (settings.jobs_topic, settings.uploads_topic)
                      for p in range(kafka.partition_count(committed, topic))]
        deadline = time.monotonic() + timeout_s
        while True:
            behind = [tp for tp in partitions if committed.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                      != uncommitted.get_watermark_offsets(tp, timeout=10, cached=False)[1]]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the generated log is not stable after {timeout_s:g} s: {len(behind)} partition(s) "
                                 "have an open transaction")
            time.sleep(0.1)
    finally:
        committed.close()
        uncommitted.close()


def measure_decode(settings: Settings) -> tuple[int, float, float]:
    """(records, seconds for consume + Avro decode, seconds for consume + decode + event models)."""
    codec = default_codec()
    results = []
    for build_models in (False, True):
        consumer = kafka_scan.reader(settings, "bench-decode")
        try:
            span = kafka_scan.bounds(consumer, [settings.jobs_topic, settings.uploads_topic])
            started, count = time.monotonic(), 0
            for piece in kafka_scan.read(consumer, span, batch_size=10_000):
                for message in piece.records:
                    record = codec.decode(message.value())
                    if build_models:
                        ev.Event.from_record(record)
                count += len(piece.records)
            results.append((count, time.monotonic() - started))
        finally:
            consumer.close()
    return results[0][0], results[0][1], results[1][1]


def measure_replay(settings: Settings, schema: str, engine: str = "auto", expected: int | None = None
                   ) -> tuple[dict, float]:
    """Run `tapeline replay --into schema --json --engine engine` as a child; (its summary, its peak RSS in MB).
    Raises SystemExit when it fails, or when it read other than `expected` records (if given)."""
    env = dict(os.environ)
    for name in ("app_name", "kafka_bootstrap", "database_url", "topic_prefix", "uploads_partitions",
                 "jobs_partitions", "work_partitions"):
        env[f"TAPELINE_{name.upper()}"] = str(getattr(settings, name))
    done = subprocess.run([sys.executable, "-m", "cli.main", "replay", "--into", schema, "--json",
                           "--batch-size", os.environ.get("BENCH_BATCH_SIZE", "5000"), "--engine", engine],
                          env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"replay failed ({done.returncode})")
    summary = json.loads(done.stdout)
    if expected is not None and summary["records"] != expected:
        raise SystemExit(f"replay ({engine}) read {summary['records']:,} records of the {expected:,} written")
    # The replay's own figure: each of its processes' VmHWM, summed (`partitioned.peak_rss_mb`; not
    # getrusage(RUSAGE_CHILDREN), which Linux carries over from this big process into its child).
    return summary, summary["rss_mb"]


def cpu_report(cpu: dict[str, float], records: int) -> str:
    """One line: where the CPU of the replay's window went (`bench.common.cpu_seconds` deltas), in
    seconds and in µs per record."""
    other = cpu["machine_busy"] - cpu["children"] - cpu["postgresql"] - cpu["kafka_broker"]
    parts = [("replay processes", cpu["children"]), ("PostgreSQL", cpu["postgresql"]),
             ("Kafka broker", cpu["kafka_broker"]), ("other", other)]
    return ("CPU during (b): " + ", ".join(f"{name} {seconds:.1f} s ({seconds / records * 1e6:.0f} µs/record)"
                                           for name, seconds in parts) +
            f"; busy {cpu['machine_busy']:.1f} s, idle {cpu['machine_idle']:.1f} s on {os.cpu_count()} cores")


def measure_copy(settings: Settings, schema: str) -> tuple[int, float, float]:
    """The database's own ceiling for the evidence rows a replay writes, two ways, from a spool of
    them in COPY binary: (rows, seconds into a table with the same indexes, seconds for COPY ...
    FREEZE into an unindexed table then building those indexes: the replay's own strategy)."""
    with connect(settings.database_url, autocommit=True) as conn, tempfile.TemporaryFile() as spool:
        _spool_evidence(conn, schema, "payload", spool)
        timings = []
        for indexed_first in (True, False):
            conn.execute(f"DROP TABLE IF EXISTS {schema}.copy_ceiling")
            conn.execute(f"CREATE TABLE {schema}.copy_ceiling (LIKE {schema}.lifecycle_evidence"
                         f"{' INCLUDING ALL' if indexed_first else ''})")
            timings.append(_timed_copy(conn, schema, "copy_ceiling", spool, build_indexes=not indexed_first))
        rows = conn.execute(f"SELECT count(*) FROM {schema}.copy_ceiling").fetchone()[0]
        conn.execute(f"DROP TABLE {schema}.copy_ceiling")
    return rows, timings[0], timings[1]


PAYLOAD_TYPES = {
    "jsonb holding the whole event (before migration 017)":
        ("jsonb", "payload::jsonb || jsonb_build_object(" + ", ".join(f"'{name}', {name}" for name in
                                                                      sorted(writes.PAYLOAD_OMITS)) + ")"),
    "jsonb (before migration 018)": ("jsonb", "payload::jsonb"),
    "bytea": ("bytea", "convert_to(payload::text, 'UTF8')"),
}
"""Other payloads the evidence rows could have: {label: (column type, SQL expression making it from a
row)}. The first puts back the envelope fields the row has columns for (what every row carried before
migration 017) as jsonb; the second is the same JSON as jsonb (the column's type before migration
018, which made it json); bytea holds the JSON text's bytes unchecked (an Avro body would be about
half as long)."""


def measure_payload_types(settings: Settings, schema: str) -> dict[str, float]:
    """Where the database's ceiling goes: the same evidence rows COPYed (FREEZE, then the index
    builds) with each payload of `PAYLOAD_TYPES` instead of the replay's. Returns rows/s per label."""
    rates = {}
    with connect(settings.database_url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {schema}.lifecycle_evidence").fetchone()[0]
        for number, (label, (kind, expression)) in enumerate(PAYLOAD_TYPES.items()):
            with tempfile.TemporaryFile() as spool:
                _spool_evidence(conn, schema, expression, spool)
                table = f"copy_ceiling_{number}"
                conn.execute(f"DROP TABLE IF EXISTS {schema}.{table}")
                conn.execute(f"CREATE TABLE {schema}.{table} (LIKE {schema}.lifecycle_evidence)")
                conn.execute(f"ALTER TABLE {schema}.{table} ALTER COLUMN payload TYPE {kind} USING {expression}")
                rates[label] = rows / _timed_copy(conn, schema, table, spool, build_indexes=True)
                conn.execute(f"DROP TABLE {schema}.{table}")
    return rates


def _spool_evidence(conn, schema: str, payload: str, spool) -> None:
    """The replayed evidence rows, in COPY binary, with `payload` (an SQL expression) as the payload."""
    columns = ", ".join(f'"{name}"' for name in writes.EVIDENCE_COLUMNS[:-1])
    with conn.cursor().copy(f"COPY (SELECT {columns}, {payload} FROM {schema}.lifecycle_evidence) "
                            "TO STDOUT (FORMAT binary)") as copy:
        for chunk in copy:
            spool.write(chunk)


def _timed_copy(conn, schema: str, table: str, spool, build_indexes: bool) -> float:
    """Seconds to COPY `spool` into `table` in one transaction; with `build_indexes`, `COPY ...
    FREEZE` and then lifecycle_evidence's own indexes built on `table` (what the replay does)."""
    indexes = [r[0] for r in conn.execute(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = to_regclass(%s)",
        (f"{schema}.lifecycle_evidence",)).fetchall()]
    spool.seek(0)
    started = time.monotonic()
    with conn.transaction():
        if build_indexes:
            conn.execute(f"TRUNCATE {schema}.{table}")
            conn.execute("SET LOCAL maintenance_work_mem = '256MB'")
        options = "FORMAT binary, FREEZE" if build_indexes else "FORMAT binary"
        with conn.cursor().copy(f"COPY {schema}.{table} FROM STDIN ({options})") as copy:
            while chunk := spool.read(1024 * 1024):
                copy.write(chunk)
        if build_indexes:
            for definition in indexes:
                conn.execute(definition.replace(f" ON {schema}.lifecycle_evidence ", f" ON {schema}.{table} ", 1)
                             .replace("CREATE UNIQUE INDEX ", f"CREATE UNIQUE INDEX {table}_", 1)
                             .replace("CREATE INDEX ", f"CREATE INDEX {table}_", 1))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="lifecycle events to generate")
    parser.add_argument("--keep", action="store_true", help="keep the topics and schema afterwards")
    parser.add_argument("--smoke", action="store_true", help="tiny run: --events 5000")
    args = parser.parse_args()
    if args.smoke:
        args.events = 5000
    tag = uuid.uuid4().hex[:8]
    settings = Settings().model_copy(update={"topic_prefix": f"bench{tag}", "app_name": f"bench-{tag}"})
    schema = f"bench_{tag}"
    stack.ensure_topics(settings)
    try:
        records, gen_s = generate(settings, args.events)
        print(f"generated {records:,} records in {gen_s:.1f} s ({records / gen_s:,.0f}/s)")
        wait_until_stable(settings)
        decoded, decode_s, models_s = measure_decode(settings)
        if decoded != records:
            raise SystemExit(f"(a) decoded {decoded:,} records of the {records:,} written")
        decode_rate = decoded / decode_s
        print(f"(a) consume + Avro decode:           {decoded:,} in {decode_s:.1f} s = {decode_rate:,.0f} events/s "
              f"(+ event models: {decoded / models_s:,.0f}/s)")
        cpu_before = cpu_seconds(settings.database_url)
        summary, rss_mb = measure_replay(settings, schema, expected=records)
        cpu = cpu_delta(cpu_before, cpu_seconds(settings.database_url))
        replay_rate = summary["records"] / summary["elapsed_s"]
        print(f"(b) replay into PostgreSQL ({schema}, {summary.get('engine')} engine"
              f"{', ' + summary['engine_note'] if summary.get('engine_note') else ''}): "
              f"{summary['records']:,} in {summary['elapsed_s']:.1f} s = "
              f"{replay_rate:,.0f} events/s with {summary.get('workers', 1)} process(es), peak RSS {rss_mb:.0f} MB "
              f"(all processes; each: {summary.get('rss_mb_by_process') or [round(rss_mb)]} MB); rows {summary['rows']}")
        if summary.get("phases_s"):
            print(f"    seconds per phase: {summary['phases_s']}")
        print("    " + cpu_report(cpu, summary["records"]))
        # (b') the same replay with the Python engine, the reference (`--engine python`), in this run.
        cpu_before = cpu_seconds(settings.database_url)
        py_summary, py_rss_mb = measure_replay(settings, f"{schema}_py", "python", expected=records)
        py_cpu = cpu_delta(cpu_before, cpu_seconds(settings.database_url))
        py_rate = py_summary["records"] / py_summary["elapsed_s"]
        print(f"(b') replay with the Python engine ({schema}_py): {py_summary['records']:,} in "
              f"{py_summary['elapsed_s']:.1f} s = {py_rate:,.0f} events/s, peak RSS {py_rss_mb:.0f} MB "
              f"({py_summary.get('rss_mb_by_process')} MB); rows {py_summary['rows']}")
        if py_summary.get("phases_s"):
            print(f"    seconds per phase: {py_summary['phases_s']}")
        print("    " + cpu_report(py_cpu, py_summary["records"]))
        with connect(settings.database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema}_py CASCADE")
        rows, indexed_s, build_after_s = measure_copy(settings, schema)
        copy_rate = rows / min(indexed_s, build_after_s)
        print(f"(c) plain COPY of the evidence rows:  {rows:,}: into the indexed table {rows / indexed_s:,.0f} rows/s; "
              f"COPY FREEZE then index builds {rows / build_after_s:,.0f} rows/s; ceiling {copy_rate:,.0f} rows/s")
        payload_rates = measure_payload_types(settings, schema)
        print(f"    the same rows (COPY FREEZE then index builds) with the payload as json: {rows / build_after_s:,.0f}"
              " rows/s (above), as " + ", as ".join(f"{label}: {rate:,.0f}" for label, rate in payload_rates.items()))
        print(f"b/a = {replay_rate / decode_rate:.2f}   b/c = {replay_rate / copy_rate:.2f}")
        print(f"RESULT decode_events_per_s={decode_rate:.0f} replay_events_per_s={replay_rate:.0f} "
              f"copy_rows_per_s={copy_rate:.0f} replay_vs_decode={replay_rate / decode_rate:.3f} "
              f"replay_vs_copy={replay_rate / copy_rate:.3f} projector_rss_mb={rss_mb:.0f} "
              f"replay_engine={summary.get('engine')} replay_python_events_per_s={py_rate:.0f} "
              f"python_rss_mb={py_rss_mb:.0f} engine_speedup={replay_rate / py_rate:.2f}")
    finally:
        if not args.keep:
            with connect(settings.database_url, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
                conn.execute(f"DROP SCHEMA IF EXISTS {schema}_py CASCADE")
            admin = admin_client(settings)
            for future in admin.delete_topics(list(settings.all_topics()), operation_timeout=30).values():
                try:
                    future.result()
                except Exception as exc:  # a missing topic is fine; say so and go on
                    print(f"note: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main()
