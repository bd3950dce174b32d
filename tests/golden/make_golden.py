"""Write the golden files of old events (run once; the output is committed and never regenerated).

    python -m tests.golden.make_golden

Version 1 of two event schemas is the current one minus one optional field, as it was before the
field was added: `Heartbeat` without `speed`, `JobCompleted` without `media_duration_s`. Both old
versions are registered in `schemas/registered/` (every version that wrote events is kept there).
The golden lifecycle is one job's events, encoded with those v1 schemas where they apply and with
the then-current schemas otherwise, with fixed ids and clocks so the file is reproducible:

- `lifecycle-v1.records.jsonl`: one record per line, `{"n", "event_type", "writer_fingerprint",
  "value_hex"}`; `value_hex` is the exact Kafka record value (Avro single-object encoding).
- `lifecycle-v1.expected.jsonl`: each event as the reading code must see it (`model_dump`, JSON),
  the fields added since v1 at their defaults.

Refuses to overwrite existing golden files: they are history, not output.
"""

from __future__ import annotations

import copy
import io
import json
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import fastavro
from fastavro.schema import expand_schema, parse_schema

from domain import events as ev
from domain.codec import MAGIC, REGISTERED_DIR, Codec, default_codec, schema_fingerprint
from tapeline.clock import system_clock

GOLDEN_DIR = Path(__file__).resolve().parent
RECORDS = GOLDEN_DIR / "lifecycle-v1.records.jsonl"
EXPECTED = GOLDEN_DIR / "lifecycle-v1.expected.jsonl"
FIELDS_ADDED_AFTER_V1 = {"Heartbeat": ("speed", "progress_grace_s", "tool_state"), "JobCompleted": ("media_duration_s",)}
"""Fields each evolved event type gained after the v1 writer schema of the golden records, in order."""
UPLOAD_ID = "golden-upload-v1"
T0 = datetime(2024, 6, 1, 12, 0, tzinfo=timezone.utc)


def v1_schema(event_type: str) -> dict:
    """The v1 writer schema of `event_type`: the current one without the field added later."""
    current = default_codec().schemas[event_type]
    plain = {k: copy.deepcopy(v) for k, v in current.items() if not k.startswith("__")}
    plain["fields"] = [f for f in plain["fields"] if f["name"] not in FIELDS_ADDED_AFTER_V1[event_type]]
    plain["doc"] = f"{plain.get('doc', '')} (v1: before {FIELDS_ADDED_AFTER_V1[event_type][0]} was added)".strip()
    return expand_schema(parse_schema(plain))


def lifecycle() -> list[ev.Event]:
    """One clean job: accepted, transcoded (three heartbeats), published, completed."""
    job_id = ev.job_id_for(UPLOAD_ID)
    counter = iter(range(1, 100))

    def make(cls, stage, attempt, claim_token=None, sequence=None, **fields):
        n = next(counter)
        event = cls.new(system_clock.stamp(), job_id=job_id, stage=stage, attempt=attempt, recorded_by="golden@v1",
                        correlation_id=UPLOAD_ID, claim_token=claim_token, sequence=sequence,
                        occurred_at=T0 + timedelta(seconds=n), **fields)
        return event.model_copy(update={"event_id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"golden-v1/{n}"))})

    media = ev.SourceMedia(format_name="mov,mp4,m4a,3gp,3g2,mj2", duration_s=5.28, width=1280, height=720,
                           display_width=1280, display_height=720, rotation=0, fps=25.0, frames=132,
                           video_codec="h264", audio_codec="aac", bit_rate_bps=1_200_000)
    ladder = [ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800),
              ev.Rendition(name="360p", width=640, height=360, video_bitrate_kbps=800)]
    outputs = [ev.OutputFile(key=f"work/{job_id}/transcode/1/{r.name}/index.m3u8", sha256=f"{i}" * 64,
                             size_bytes=400 + i, content_type="application/vnd.apple.mpegurl")
               for i, r in enumerate(ladder)]
    master = f"http://127.0.0.1:19000/tapeline-media/published/{job_id}/master.m3u8"
    published = [r.model_copy(update={"playlist_key": f"published/{job_id}/{r.name}/index.m3u8",
                                      "url": f"http://127.0.0.1:19000/tapeline-media/published/{job_id}/{r.name}/index.m3u8"})
                 for r in ladder]
    return [
        make(ev.JobAccepted, "intake", 0, upload_id=UPLOAD_ID, source_key=f"uploads/{UPLOAD_ID}/clip.mp4",
             source_sha256="ab" * 32, source_size_bytes=791_367, priority="standard", profile="default",
             media=media, ladder=ladder),
        make(ev.StageQueued, "transcode", 1, tier="standard", work_topic="tapeline.work.transcode.standard"),
        make(ev.AttemptStarted, "transcode", 1, "golden-token-t1", lease_s=120.0, worker="transcode@golden",
             work_topic="tapeline.work.transcode.standard", work_partition=3, work_offset=17),
        make(ev.Heartbeat, "transcode", 1, "golden-token-t1", sequence=1, frames_done=40, frames_total=132,
             out_time_s=1.6),
        make(ev.Heartbeat, "transcode", 1, "golden-token-t1", sequence=2, frames_done=90, frames_total=132,
             out_time_s=3.6),
        make(ev.Heartbeat, "transcode", 1, "golden-token-t1", sequence=3, frames_done=132, frames_total=132,
             out_time_s=5.28),
        make(ev.AttemptSucceeded, "transcode", 1, "golden-token-t1", outputs=outputs, renditions=ladder,
             audio_playlist_key=f"work/{job_id}/transcode/1/audio/index.m3u8", media_duration_s=5.28, elapsed_s=4.5),
        make(ev.StageQueued, "publish", 1, tier="standard", work_topic="tapeline.work.publish.standard"),
        make(ev.AttemptStarted, "publish", 1, "golden-token-p1", lease_s=120.0, worker="publish@golden",
             work_topic="tapeline.work.publish.standard", work_partition=3, work_offset=5),
        make(ev.PublishIntended, "publish", 1, "golden-token-p1", provider="s3", idempotency_key=f"{job_id}:publish:1"),
        make(ev.AttemptSucceeded, "publish", 1, "golden-token-p1", outputs=outputs, renditions=published,
             elapsed_s=0.4),
        make(ev.Published, "publish", 1, "golden-token-p1", provider="s3", provider_ref=f"published/{job_id}",
             master_key=f"published/{job_id}/master.m3u8", master_url=master, renditions=published),
        make(ev.JobCompleted, "publish", 1, "golden-token-p1", master_url=master),
    ]


def encode_v1(event: ev.Event) -> bytes:
    """The record value as the v1 writer wrote it: the v1 schema for the evolved types, else the current."""
    codec = default_codec()
    if event.event_type not in FIELDS_ADDED_AFTER_V1:
        return codec.encode(event.to_record())
    schema = v1_schema(event.event_type)
    record = event.to_record()
    for name in FIELDS_ADDED_AFTER_V1[event.event_type]:
        record.pop(name)
    buf = io.BytesIO()
    buf.write(MAGIC)
    buf.write(schema_fingerprint(schema))
    fastavro.schemaless_writer(buf, parse_schema(schema), record)
    return buf.getvalue()


def main() -> int:
    if RECORDS.exists() or EXPECTED.exists():
        print(f"refusing to overwrite {RECORDS.name} / {EXPECTED.name}: golden files are history")
        return 1
    for event_type in FIELDS_ADDED_AFTER_V1:
        schema = v1_schema(event_type)
        path = REGISTERED_DIR / f"{event_type}-{schema_fingerprint(schema).hex()}.avsc"
        if not path.exists():
            path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
            print(f"registered {path.name}")
    reader = Codec()  # a fresh codec: it loads the versions registered just now
    with RECORDS.open("w") as records, EXPECTED.open("w") as expected:
        for n, event in enumerate(lifecycle()):
            value = encode_v1(event)
            records.write(json.dumps({"n": n, "event_type": event.event_type, "writer_fingerprint": value[2:10].hex(),
                                      "value_hex": value.hex()}) + "\n")
            read_back = ev.Event.from_record(reader.decode(value))
            expected.write(read_back.model_dump_json() + "\n")
    print(f"wrote {RECORDS.name} and {EXPECTED.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
