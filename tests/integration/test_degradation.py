"""The degradation ladder against real services (issue 9, item 6): while the index tier's backlog is
above 2, new index jobs get the cheaper ladder (top rendition dropped, a faster x264 preset),
recorded in their events and status; a job submitted after the backlog drained is full quality."""

from __future__ import annotations

import subprocess

import pytest

from projections import read
from tapeline.objectstore import ObjectStore
from tests.conftest import wait_for
from tests.integration.helpers import committed_events
from tests.integration.roles import Roles, all_in_state, submit_upload, tiny_clips

pytestmark = pytest.mark.integration


def x264_options(settings, key: str) -> bytes:
    """The x264 options string (an SEI in the H.264 stream) of a published segment, e.g. b"... subme=1 ..."."""
    done = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", ObjectStore(settings).public_url(key),
                           "-map", "0:v", "-c", "copy", "-f", "h264", "-"], capture_output=True, timeout=60, check=True)
    start = done.stdout.index(b"x264 - core")
    return done.stdout[start:done.stdout.index(b"\x00", start)]


def test_a_burst_degrades_later_index_jobs_and_full_quality_returns_once_drained(isolated, tmp_path):
    settings = isolated.model_copy(update={"degrade_backlog_threshold": 2, "ladder": (90, 48),
                                           "x264_preset": "veryfast", "degraded_x264_preset": "superfast"})
    clips = tiny_clips(tmp_path, 6)
    roles = Roles(settings, tmp_path).start("projector", "intake", "publish", "watchdog")
    try:
        burst = []
        for clip in clips[:5]:  # a burst while no transcode worker runs: the backlog only grows
            burst.append(submit_upload(settings, clip, priority="index"))
            wait_for(lambda: all_in_state(settings, burst, {"queued"}), 60, "the job to be queued")
        roles.start("transcode")
        wait_for(lambda: all_in_state(settings, burst, {"completed"}), 120, "the burst to complete")
        after = submit_upload(settings, clips[5], priority="index")
        wait_for(lambda: all_in_state(settings, [after], {"completed"}), 60, "the job after the drain")
    finally:
        roles.stop()
    accepted = {e.job_id: e for e in committed_events(settings) if e.event_type == "JobAccepted"}
    # Job n saw n jobs of its tier waiting (none could finish): above 2 from the fourth on.
    assert [accepted[j].degraded for j in burst] == [False, False, False, True, True]
    assert [accepted[j].degraded_reason for j in burst[3:]] == [
        f"index backlog {n} > threshold 2: 48p at preset superfast" for n in (3, 4)]
    assert [accepted[j].x264_preset for j in burst] == ["veryfast"] * 3 + ["superfast"] * 2
    with read.open_reader(settings) as conn:
        summaries = {j: read.job_summary(read.job_row(conn, j)) for j in burst + [after]}
    assert [[o["name"] for o in summaries[j]["outputs"]] for j in burst + [after]] == \
        [["90p", "48p"]] * 3 + [["48p"]] * 2 + [["90p", "48p"]]
    assert [summaries[j]["degraded"] for j in burst + [after]] == [False] * 3 + [True] * 2 + [False]
    assert summaries[burst[4]]["degraded_reason"] == accepted[burst[4]].degraded_reason
    assert not accepted[after].degraded and accepted[after].degraded_reason is None
    # The cheaper preset really encoded the degraded job (x264 writes its options into the stream).
    segment = f"published/{burst[4]}/48p/seg_00000.ts"
    assert b"subme=1" in x264_options(settings, segment)  # superfast
    assert b"subme=2" in x264_options(settings, f"published/{after}/48p/seg_00000.ts")  # veryfast
