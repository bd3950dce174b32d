"""Processors on other hosts across real network faults (issue 40 item 3): Linux network namespaces
made by this module (`devstack.netns.Topology`), one veth pair per host, links cut with
`ip link set ... down` while every process stays alive.

Hosts: the root namespace is the services host (this module's own one-node KRaft broker, bound to
and advertising the service address 10.250.k.1; forwarders from that address to the shared
PostgreSQL and S3, which listen on 127.0.0.1 only) and also runs the projector, intake, thumbnails,
publish and a standby watchdog; hosts `w1` and `w2` each run one transcode worker; host `ops` runs
the leading watchdog. The processors are the same `tapeline run --role X` commands as everywhere,
started with `ip netns exec`.

(a) the worker host holding a transcode attempt is cut off mid-transcode: its lease ends, the
    other host's worker resumes from the checkpoints; after the link heals the cut-off worker (still
    running) changes nothing; one output set and one `JobCompleted`;
(b) both worker hosts' links are slow and lossy (`tc` token bucket, and 1.5 s cuts every 6 s) while
    two jobs run: they complete once, and no `StallDetected` is written without a silence of at
    least a lease from the stalled attempt;
(c) the watchdog's host is cut off: the standby takes over within `TAKEOVER_BOUND_S` and a job
    submitted afterwards completes; the cut-off watchdog writes nothing after the takeover.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import devstack as stack
from domain import events as ev
from devstack import broker_faults
from devstack.chaos import fold_log, committed_messages
from devstack.link_faults import PARTITION_TIMING, false_stalls, lease_gaps, stamped
from devstack.netns import Topology, unavailable
from devstack.tcp_proxy import TcpForwarder
from tapeline.settings import Settings
from tests.conftest import isolated_settings, missing_under_ci, own_database, wait_for
from tests.faults.conftest import OTHER_STAGES, Roles
from tests.faults.test_checkpoint_resume import VIDEO, checkpoints_of_attempt
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration

NET_TIMING = PARTITION_TIMING  # (devstack/link_faults.py: why a 10 s lease here)
KEEPALIVE_S = 3
"""Idle seconds before the forwarders probe a peer (then 3 probes, 1 s apart): a cut-off host's
PostgreSQL session, and so the watchdog leader's advisory lock, ends about 6 s after its last byte."""
TAKEOVER_BOUND_S = KEEPALIVE_S + 3 + NET_TIMING["tick_interval_s"] + 8.5
"""Seconds from the cut to the standby's first tick as leader: the dead session ends (keepalive idle
+ 3 probes of 1 s, 6 s), the standby asks for the lock every tick (0.5 s), then opens its writer
(`init_transactions`, which fences the old leader's) and commits a tick; 8.5 s of slack for that and
for this 2-core machine."""


def _with_host(url: str, host: str) -> str:
    params = conninfo_to_dict(url)
    return f"postgresql://{params['user']}:{params['password']}@{host}:{params.get('port', 5432)}/{params['dbname']}"


@pytest.fixture(scope="module")
def net(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, Topology, Path]]:
    """The topology, the forwarders and the module's broker: (settings every host uses, topology,
    log directory). Everything is deleted or stopped at the end, also after a failure."""
    reason = unavailable()
    if reason is not None:
        missing_under_ci(reason)
    topology = Topology(("w1", "w2", "ops")).open()
    forwarders: list[TcpForwarder] = []
    home = tmp_path_factory.mktemp("netns")
    try:
        svc = topology.service
        pg = conninfo_to_dict(base_settings.database_url)
        s3_port = int(base_settings.s3_endpoint.rsplit(":", 1)[1].strip("/"))
        for port, target in ((int(pg.get("port", 5432)), (pg.get("host", "127.0.0.1"), int(pg.get("port", 5432)))),
                             (s3_port, ("127.0.0.1", s3_port))):
            forwarders.append(TcpForwarder((svc, port), target, keepalive_s=KEEPALIVE_S).start())
        port = broker_faults.free_port_block(size=2)
        tag = uuid.uuid4().hex[:8]
        with own_database(base_settings, tag) as url:
            settings = isolated_settings(base_settings, tag, _with_host(url, svc), home=home / "stack",
                                         kafka_bootstrap=f"{svc}:{port}", kafka_controller_port=port + 1,
                                         kafka_brokers=1, s3_endpoint=f"http://{svc}:{s3_port}", **NET_TIMING)
            try:
                stack.up(settings)
                yield settings, topology, home
            finally:
                stack.down(settings)
    finally:
        for forwarder in forwarders:
            forwarder.stop()
        topology.close()


@pytest.fixture(scope="module")
def hosts(net) -> Iterator[Roles]:
    """Every role on its host: the leading watchdog on `ops` (started first and leading before the
    standby starts in the root namespace), one transcode worker on each of `w1` and `w2`."""
    settings, topology, home = net
    roles = Roles(settings, home)
    try:
        leader = roles.start("watchdog", wrapper=topology.hosts["ops"].wrap(), env={"TAPELINE_INSTANCE_ID": "ops"})
        wait_for(lambda: "watchdog is the leader" in _log(home, leader), 60, "the ops host's watchdog to lead")
        for role in ("projector", "intake", *OTHER_STAGES):
            roles.start(role, env={"TAPELINE_INSTANCE_ID": "services"})
        roles.start("watchdog", env={"TAPELINE_INSTANCE_ID": "services"})
        for name in ("w1", "w2"):
            roles.start("transcode", wrapper=topology.hosts[name].wrap(), env={"TAPELINE_INSTANCE_ID": name})
        yield roles
    finally:
        for name in topology.hosts:
            topology.heal(name)
        roles.stop_all()
        print(roles.logs())


def _log(home: Path, process) -> str:
    return "\n".join(p.read_text(errors="replace") for p in home.glob("watchdog-*.log"))


def _evidence(settings: Settings, job_id: str) -> list[dict]:
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT partition, \"offset\", event_type, stage, attempt, recorded_by, applied "
                            "FROM lifecycle_evidence WHERE job_id = %s ORDER BY partition, \"offset\"",
                            (job_id,)).fetchall()


def _projection_equals_fold(settings: Settings, job_id: str) -> None:
    folded = fold_log(committed_messages(settings))[job_id]
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        row = conn.execute("SELECT * FROM job_state WHERE job_id = %s", (job_id,)).fetchone()
    for column in ("state", "stage", "attempt", "claim_token", "master_url"):
        assert row[column] == folded[column], column


def test_a_worker_host_cut_off_mid_transcode_changes_nothing_after_its_lease(net, hosts, long_video):
    settings, topology, _ = net
    job_id = submit(settings, long_video)
    wait_for(lambda: all(checkpoints_of_attempt(settings, job_id, 1).get(r) for r in VIDEO), 180,
             "a checkpoint of every rendition from attempt 1", interval_s=0.1)
    started = of_job(committed_events(settings), job_id, "AttemptStarted")
    cut_host = started[0].worker.split("@")[1].split(":")[0]
    assert cut_host in ("w1", "w2")
    other = "w2" if cut_host == "w1" else "w1"
    worker = next(p for role, p, _ in hosts.processes if role == "transcode" and topology.hosts[cut_host].namespace
                  in " ".join(p.args))
    topology.cut(cut_host)
    cut_at = time.monotonic()

    # Attempt 2 starts on the other host once attempt 1's lease ended; the cut-off worker still runs.
    second = wait_for(lambda: [e for e in of_job(committed_events(settings), job_id, "AttemptStarted")
                               if e.stage == "transcode" and e.attempt == 2], 120, "attempt 2 to start")
    assert second[0].worker.startswith(f"transcode@{other}:")
    assert worker.poll() is None, "the cut-off worker must still be alive: a partition, not a crash"
    first_checkpoints = checkpoints_of_attempt(settings, job_id, 1)
    topology.heal(cut_host)
    healed_at = time.monotonic()

    wait_state(settings, job_id, timeout_s=240)
    time.sleep(settings.lease_s)  # room for the healed worker's late writes to land
    events = assert_completed_once(settings, job_id)
    stalls = of_job(events, job_id, "StallDetected")
    assert [(s.stage, s.stalled_attempt) for s in stalls] == [("transcode", 1)], [
        (s.stage, s.stalled_attempt, s.kind, s.detail) for s in stalls]
    assert stalls[0].kind != "worker_exited"  # judged by the lease, not by a supervisor seeing a death
    succeeded = [e for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "transcode"]
    assert [e.attempt for e in succeeded] == [2]

    # Attempt 2 resumed from attempt 1's checkpoints: it encoded no segment every rendition had.
    second_checkpoints = checkpoints_of_attempt(settings, job_id, 2)
    reused = min(len(first_checkpoints[r]) for r in VIDEO)
    assert reused >= 1
    for rendition in VIDEO:
        assert min(second_checkpoints[rendition]) >= reused, rendition

    # After the heal the cut-off worker's next write is refused: attempt 2's claim bumped the
    # producer epoch of the job's transactional id, so the broker fences it ("fenced: a newer
    # attempt owns the job"), or it stops on its PostgreSQL session, which the forwarder closed while
    # the host was cut off (seen here: "the connection is closed" when it renews its writer). Either
    # way nothing it recorded after the stall was applied.
    log = hosts.log_dir / f"transcode-{next(i for i, t in enumerate(hosts.processes) if t[1] is worker)}.log"
    wait_for(lambda: "fenced: a newer attempt owns the job" in log.read_text(errors="replace")
             or worker.poll() is not None, 90, "the healed worker to be fenced or to stop")
    ending = "fenced" if worker.poll() is None else f"exited {worker.returncode}"
    rows = _evidence(settings, job_id)
    stall = next(r for r in rows if r["event_type"] == "StallDetected")
    late = [r for r in rows if r["recorded_by"].startswith(f"transcode@{cut_host}:") and r["partition"] == stall["partition"]
            and r["offset"] > stall["offset"]]
    assert not [r for r in late if r["applied"]], late
    _projection_equals_fold(settings, job_id)
    print(f"cut {cut_host}; attempt 2 on {other} reused {reused} segments; late attempt-1 records {len(late)} "
          f"(none applied); healed {healed_at - cut_at:.1f} s after the cut; the healed worker {ending}")


FLAP_DOWN_S, FLAP_EVERY_S = 1.5, 6.0
"""Each worker host loses its link for 1.5 s every 6 s during the slow-link test: well inside the
lease (10 s) with heartbeats every second, so the lease arithmetic justifies no stall."""


def test_a_slow_lossy_link_to_the_workers_completes_jobs_without_a_false_stall(net, hosts, tmp_path):
    settings, topology, _ = net
    from tests.integration.roles import tiny_clips
    clips = tiny_clips(tmp_path, 2, seconds=8.0, size="640x360")
    stop = threading.Event()
    for name in ("w1", "w2"):
        topology.shape(name, rate="4mbit", latency_ms=200)
    flappers = [topology.flap(name, FLAP_DOWN_S, FLAP_EVERY_S, stop) for name in ("w1", "w2")]
    try:
        jobs = [submit(settings, clip) for clip in clips]
        for job_id in jobs:
            wait_state(settings, job_id, timeout_s=240)
    finally:
        stop.set()
        for thread in flappers:
            thread.join(10)
        for name in ("w1", "w2"):
            topology.unshape(name)
    events = stamped(settings)
    for job_id in jobs:
        assert_completed_once(settings, job_id)
        gaps, stalls = lease_gaps(events, job_id)
        unjustified = false_stalls(events, job_id, settings)
        print(f"{job_id}: longest silence per attempt {gaps}; stalls "
              f"{[(s.kind, s.stage, s.stalled_attempt, round(s.since_s, 1)) for s in stalls]}")
        assert unjustified == [], unjustified


def test_the_watchdog_host_cut_off_a_standby_takes_over_within_the_bound(net, hosts, tmp_path):
    settings, topology, home = net
    topology.cut("ops")
    cut_at = time.time()

    def standby_tick() -> float | None:
        ticks = [at for at, e in stamped(settings) if isinstance(e, ev.WatchdogTick)
                 and e.recorded_by.startswith("watchdog@services:")]
        return min(ticks) if ticks else None

    first = wait_for(standby_tick, TAKEOVER_BOUND_S * 3, "the standby watchdog to tick as leader", interval_s=0.5)
    takeover_s = first - cut_at
    print(f"takeover {takeover_s:.1f} s after the cut (bound {TAKEOVER_BOUND_S:.1f} s)")
    assert 0 < takeover_s <= TAKEOVER_BOUND_S
    topology.heal("ops")
    # The new leader re-drives work: a job submitted now completes.
    from tests.integration.roles import tiny_clips
    clip = tiny_clips(tmp_path, 1, seconds=2.0, size="320x180")[0]
    job_id = submit(settings, clip)
    wait_state(settings, job_id, timeout_s=180)
    assert_completed_once(settings, job_id)
    time.sleep(settings.lease_s / 2)
    # The cut-off watchdog wrote nothing after the takeover (the fixed transactional id fenced it).
    late = [e for at, e in stamped(settings) if e.recorded_by.startswith("watchdog@ops:") and at > first]
    assert late == []
