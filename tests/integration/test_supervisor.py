"""`tapeline run --role all`: a child killed with SIGKILL is restarted and the pipeline still works."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tapeline.samples import sample_video
from tests.conftest import tapeline_cli, wait_for

pytestmark = pytest.mark.integration


def children(pid: int) -> dict[str, int]:
    """{role: pid} of the supervisor's live children, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and b"--role" in cmdline:
            found[cmdline[cmdline.index(b"--role") + 1].decode()] = int(entry.name)
    return found


def test_killed_child_is_restarted_and_jobs_still_complete(isolated, pipeline):
    roles = wait_for(lambda: (lambda c: c if len(c) == 4 else None)(children(pipeline.process.pid)), 30,
                     "four children")
    assert set(roles) == {"projector", "intake", "transcode", "publish"}
    os.kill(roles["transcode"], signal.SIGKILL)
    restarted = wait_for(lambda: (lambda c: c if c.get("transcode") not in (None, roles["transcode"]) else None)(
        children(pipeline.process.pid)), 30, "the transcode child to be restarted")
    assert restarted["intake"] == roles["intake"]  # the others were left alone
    assert "child exited; restarting" in pipeline.log_text()
    done = tapeline_cli(isolated, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--timeout", "180")
    assert json.loads(done.stdout)["state"] == "completed", done.stderr
