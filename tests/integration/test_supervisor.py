"""`tapeline run --role all`: a child killed with SIGKILL is restarted and the pipeline still works."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tapeline.samples import sample_video
from cli.supervisor import ROLES
from tests.conftest import tapeline_cli, wait_for

pytestmark = pytest.mark.integration


def test_killed_child_is_restarted_and_jobs_still_complete(isolated, pipeline):
    roles = wait_for(lambda: (lambda c: c if len(c) == len(ROLES) else None)(pipeline.children()), 30,
                     "one child per role")
    assert set(roles) == {"projector", "intake", "transcode", "publish", "watchdog", "notify", "archive", "thumbnails"} == set(ROLES)
    os.kill(roles["transcode"], signal.SIGKILL)
    restarted = wait_for(lambda: (lambda c: c if c.get("transcode") not in (None, roles["transcode"]) else None)(
        pipeline.children()), 30, "the transcode child to be restarted")
    assert restarted["intake"] == roles["intake"]  # the others were left alone
    assert "child exited; restarting" in pipeline.log_text()
    done = tapeline_cli(isolated, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--timeout", "180")
    assert json.loads(done.stdout)["state"] == "completed", done.stderr
