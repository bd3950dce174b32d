"""One presenter (`projections/presenter.py`): the job page's timeline and `tapeline timeline` show
the same detail for every event type. Events of every registered type are generated (the field
strategies of test_fold_differential.py); the page's timeline partial (`_timeline.html`, included by
job.html) is rendered as the app renders it, and the CLI's `timeline --json` runs over the same rows."""

from __future__ import annotations

import html
import json
import re
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import jinja2
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from typer.testing import CliRunner

from cli.main import app
from domain import events as ev
from projections.api_models import event_json
from projections.presenter import SHOWN, timeline_detail
from projections import read_model as read
from tests.unit.test_fold_differential import ENVELOPE, FIELDS

TEMPLATES = Path(__file__).resolve().parents[2] / "projections" / "templates"
DETAIL = re.compile(r'<td class="detail">(.*?)</td>', re.S)


def timeline_row(event: ev.Event, offset: int) -> dict:
    """A row as `read.timeline` gives it: the envelope's columns and the event's own fields as payload."""
    payload = json.loads(json.dumps({k: v for k, v in event.model_dump().items() if k not in ENVELOPE},
                                    default=lambda v: v.hex() if isinstance(v, bytes) else v.isoformat()))
    return {"broker_ts": datetime(2026, 12, 7, 0, 0, offset % 60, tzinfo=timezone.utc), "event_id": event.event_id,
            "event_type": event.event_type, "stage": event.stage, "attempt": event.attempt,
            "claim_token": event.claim_token, "occurred_at": event.occurred_at, "recorded_by": event.recorded_by,
            "causation_id": event.causation_id, "dedup_key": event.dedup_key, "applied": offset % 3 != 0,
            "superseded": offset % 5 == 0, "duplicate": False, "partition": 0, "offset": offset, "payload": payload}


@st.composite
def rows_of_every_type(draw) -> list[dict]:
    rows = []
    for offset, (kind, cls) in enumerate(sorted(ev.Event.registry.items())):
        fields = draw(FIELDS[kind])
        sequence = "p.1" if kind == "ProviderBreakerChanged" else (1 if "sequence" in cls.model_fields else None)
        event = cls.new(ev.Stamp(datetime(2026, 12, 7, tzinfo=timezone.utc), f"e{offset}"), job_id="job-1",
                        stage="transcode", attempt=1, claim_token="tok", recorded_by="worker@h1", correlation_id="c",
                        causation_id=None, sequence=sequence, **fields)
        rows.append(timeline_row(event, offset))
    return rows


def page_details(rows: list[dict]) -> list[str]:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True)
    rendered = env.get_template("_timeline.html").render(events=[event_json(r) for r in rows])
    return [html.unescape(cell) for cell in DETAIL.findall(rendered)]


def cli_details(rows: list[dict], monkeypatch) -> list[str]:
    @contextmanager
    def no_database(_settings):
        yield None

    monkeypatch.setattr(read, "open_reader", no_database)
    monkeypatch.setattr(read, "timeline", lambda _conn, _job: rows)
    result = CliRunner().invoke(app, ["timeline", "job-1", "--json"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return [entry["detail"] for entry in json.loads(result.output)]


@settings(max_examples=8, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows=rows_of_every_type())
def test_the_job_page_and_the_cli_timeline_show_the_same_detail_for_every_event_type(rows, monkeypatch):
    assert len(rows) == len(ev.Event.registry) > 30
    page, cli = page_details(rows), cli_details(rows, monkeypatch)
    assert page == cli == [timeline_detail(r) for r in rows]


def test_who_acted_and_which_dead_letter_are_shown_for_an_operator_event():
    row = {"event_type": "JobReplayed", "stage": "transcode", "attempt": 2,
           "payload": {"operator": "alice", "reason": "fixed S3", "dead_letter_id": "job-1/3"}}
    assert timeline_detail(row) == "reason=fixed S3 operator=alice dead_letter_id=job-1/3"
    assert {"operator", "dead_letter_id", "error_class", "master_url"} <= set(SHOWN)


def test_a_conflicts_timeline_row_names_the_object_in_the_way():
    """Issue 45: no view showed the object that blocked the publish; the timeline row of the dead letter
    names it as the diagnosis does (key, size, sha256, when written)."""
    found = {"key": "published/j/master.m3u8", "sha256": "c" * 64, "size_bytes": 41,
             "written_at": "2026-12-07T11:00:05Z"}
    row = {"event_type": "JobDeadLettered", "stage": "publish", "attempt": 1,
           "payload": {"error_class": "output_conflict", "reason": "exists", "in_the_way": found}}
    assert timeline_detail(row) == ("error_class=output_conflict reason=exists in_the_way=`published/j/master.m3u8` "
                                    f"(41 bytes, sha256 {'c' * 64}, written 2026-12-07 11:00:05 UTC)")


def test_the_cli_timeline_table_shows_who_replayed_a_job_on_a_narrow_terminal(monkeypatch):
    """Issue 45: the CLI timeline hid who replayed a job; the page shows the operator. The text table
    (80 columns, as in a pipe) keeps `operator=` and the dead letter, wrapped but not cut."""
    event = ev.JobReplayed.new(ev.Stamp(datetime(2026, 12, 7, tzinfo=timezone.utc), "e1"), job_id="job-1",
                               stage="transcode", attempt=2, claim_token=None, recorded_by="operator@h1",
                               correlation_id="c", operator="alice.on-call", reason="S3 is back after the outage",
                               dead_letter_id="job-1/1")
    rows = [timeline_row(event, 1)]

    @contextmanager
    def no_database(_settings):
        yield None

    monkeypatch.setattr(read, "open_reader", no_database)
    monkeypatch.setattr(read, "timeline", lambda _conn, _job: rows)
    result = CliRunner().invoke(app, ["timeline", "job-1"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    flat = "".join(result.output.split())  # the table wraps long cells over lines and borders
    cells = "".join("".join(line.split("│")[-2].split()) for line in result.output.splitlines() if line.count("│") > 2)
    assert "operator=alice.on-call" in cells and "dead_letter_id=job-1/1" in cells, result.output
    assert "JobReplayed" in flat and "…" not in result.output


def test_a_heartbeat_that_counted_frames_but_stated_no_time_is_drawn_where_its_frames_are():
    """Issue 45: the progress chart drew a hung attempt flat at 0 although its heartbeats said 392 frames
    were done: ffmpeg had stated no out_time. The chart's value (`media_s`) is the frames' share."""
    from projections.presenter import heartbeat_media_s, with_media_s

    assert heartbeat_media_s({"frames_done": 392, "frames_total": 1000, "out_time_s": 0.0}, 40.0) == 15.68
    assert heartbeat_media_s({"frames_done": 392, "frames_total": 1000, "out_time_s": None}, 40.0) == 15.68
    assert heartbeat_media_s({"frames_done": 392, "frames_total": 1000, "out_time_s": 12.5}, 40.0) == 12.5
    assert heartbeat_media_s({"frames_done": 0, "frames_total": 1000, "out_time_s": 0.0}, 40.0) == 0.0
    assert heartbeat_media_s({"frames_done": 392, "frames_total": None, "out_time_s": 0.0}, 40.0) == 0.0
    assert heartbeat_media_s({"frames_done": 2000, "frames_total": 1000, "out_time_s": 0.0}, 40.0) == 40.0
    series = [{"stage": "transcode", "attempt": 1, "points": [{"frames_done": 392, "frames_total": 1000,
                                                               "out_time_s": 0.0, "t_s": 5.0}]}]
    [drawn] = with_media_s(series, 40.0)
    assert drawn["points"][0]["media_s"] == 15.68 and "media_s" not in series[0]["points"][0]


def test_a_thumbnail_without_a_recorded_url_is_not_called_unpublished():
    """Issue 45: the CLI said thumbnails were "not published yet" while they were publicly readable (publish
    copies them before `Published` records the URLs). Without a URL the words say what is known."""
    from projections.presenter import published_artifacts

    row = {"job_id": "j", "master_url": None, "reused_from": None, "ladder": [], "renditions": [],
           "outputs": [{"key": "work/j/thumbnails/1/thumbnails/poster.jpg", "content_type": "image/jpeg",
                        "sha256": "0" * 64, "size_bytes": 10}]}
    [poster] = published_artifacts(row)
    assert poster["url"] is None and poster["published_key"] == "published/j/thumbnails/poster.jpg"
    assert poster["where"] == "(no public URL recorded; publish copies it to published/j/thumbnails/poster.jpg)"
    assert "not published" not in poster["where"]
    [shown] = published_artifacts({**row, "master_url": "http://cdn.example/published/j/master.m3u8"})
    assert shown["where"] == shown["url"] == "http://cdn.example/published/j/thumbnails/poster.jpg"
