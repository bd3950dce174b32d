"""Test hosts left by a killed run are deleted by the next one (devstack/netns.py `sweep_stale`): a
process that made a topology is killed with SIGKILL, so its own `close()` never runs; the next
`Topology.open()` deletes its namespace, its veth link and its service address, and only its."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from devstack.netns import OWNERS_DIR, Topology, ip, unavailable
from tests.conftest import missing_under_ci

pytestmark = pytest.mark.integration

MAKE_AND_WAIT = ("from devstack.netns import Topology; t = Topology(('x',)).open(); "
                 "print(t.tag, t.service, flush=True); import time; time.sleep(120)")


def test_the_next_topology_deletes_what_a_killed_one_left(tmp_path):
    reason = unavailable()
    if reason is not None:
        missing_under_ci(reason)
    killed = subprocess.Popen([sys.executable, "-c", MAKE_AND_WAIT], stdout=subprocess.PIPE, text=True)
    tag, service = killed.stdout.readline().split()
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(10)
    left = f"tl{tag}-x"
    assert left in ip("netns", "list").stdout and (OWNERS_DIR / f"{tag}.json").exists()

    live = Topology(("y",)).open()
    try:
        assert left not in ip("netns", "list").stdout, "the killed run's host is gone"
        assert f"tl{tag}x" not in ip("-o", "link").stdout and f" {service}/32" not in ip("-4", "-o", "addr").stdout
        assert not (OWNERS_DIR / f"{tag}.json").exists()
        owner = json.loads(live.owner_file.read_text())
        assert owner["pid"] == os.getpid() and owner["namespaces"] == [f"tl{live.tag}-y"]
        assert live.hosts["y"].namespace in ip("netns", "list").stdout  # a live owner's hosts stay
    finally:
        live.close()
    assert f"tl{live.tag}-y" not in ip("netns", "list").stdout and not live.owner_file.exists()
