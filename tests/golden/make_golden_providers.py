"""Write the golden files of the provider events, version 1 (run once; never regenerated):

    python -m tests.golden.make_golden_providers

`providers-v1.records.jsonl` / `providers-v1.expected.jsonl` (format as in make_golden.py): a job's
publish attempt meeting a 429 (breaker opened), another job deferred by the open breaker and by a
full quota window, and the half-open probe closing the breaker; fixed ids and clocks.
"""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime, timedelta, timezone

from domain import events as ev
from domain.codec import default_codec
from tapeline.clock import system_clock
from tests.golden import GOLDEN_DIR

NAME = "providers-v1"
T0 = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)


def events() -> list[ev.Event]:
    counter = iter(range(1, 100))

    def make(cls, job: str, attempt: int, sequence=None, **fields):
        n = next(counter)
        event = cls.new(system_clock.stamp(), job_id=ev.job_id_for(job), stage="publish", attempt=attempt, recorded_by="golden@v1",
                        correlation_id=job, claim_token=f"golden-{job}-{attempt}", sequence=sequence,
                        occurred_at=T0 + timedelta(seconds=n), **fields)
        return event.model_copy(update={"event_id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{NAME}/{n}"))})

    return [
        make(ev.ProviderBreakerChanged, "upload-a", 1, sequence="webhook.1", provider="webhook", from_state="closed",
             to_state="open", until=T0 + timedelta(seconds=3), reason="post failed: webhook answered 429",
             http_status=429, failures=1, version=1),
        make(ev.PublishDeferred, "upload-b", 1, provider="webhook", wait="cooldown", until=T0 + timedelta(seconds=3),
             detail="webhook breaker open until 12:00:03.000000 UTC"),
        make(ev.ProviderBreakerChanged, "upload-a", 2, sequence="webhook.2", provider="webhook", from_state="open",
             to_state="half_open", until=T0 + timedelta(seconds=34), reason="cooldown over: one probe post",
             failures=1, version=2),
        make(ev.ProviderBreakerChanged, "upload-a", 2, sequence="webhook.3", provider="webhook",
             from_state="half_open", to_state="closed", reason="probe succeeded", failures=0, version=3),
        make(ev.PublishDeferred, "upload-b", 2, provider="webhook", wait="quota", until=T0 + timedelta(seconds=65),
             window="minute", window_s=60.0, limit=1, used=1, detail="webhook quota reached"),
    ]


def main() -> int:
    records, expected = GOLDEN_DIR / f"{NAME}.records.jsonl", GOLDEN_DIR / f"{NAME}.expected.jsonl"
    if records.exists() or expected.exists():
        print(f"refusing to overwrite {records.name} / {expected.name}: golden files are history")
        return 1
    codec = default_codec()
    with records.open("w") as rec, expected.open("w") as exp:
        for n, event in enumerate(events()):
            value = codec.encode(event.to_record())
            rec.write(json.dumps({"n": n, "event_type": event.event_type, "writer_fingerprint": value[2:10].hex(),
                                  "value_hex": value.hex()}) + "\n")
            exp.write(ev.Event.from_record(codec.decode(value)).model_dump_json() + "\n")
    print(f"wrote {records.name} and {expected.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
