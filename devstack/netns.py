"""Test hosts as Linux network namespaces (root only), for the multi-host fault tests and
`bench/partitions.py`.

The layout (`Topology`), all addresses in 10.250.<k>.0/24 with k picked free at random:

    root namespace ("services host"): 10.250.k.1/32 on `lo` — Kafka, and forwarders to the shared
                                      PostgreSQL and S3 (which listen on 127.0.0.1 only)
    host i (namespace tl<tag>-<name>): one veth pair, 10.250.k.(4i+5)/30 on the root end,
                                      10.250.k.(4i+6)/30 inside, default route via the root end

`shape(name)` makes a host's link slow and lossy (a token bucket that drops what queues too long),
`flap(...)` cuts it briefly and repeatedly; `cut(name)` sets the root end of a host's veth down (processes stay alive; TCP sends no reset, its
connections time out), `heal(name)` sets it up. `close()` deletes the namespaces, the veth pairs
and the address on `lo`, also after a failure (deleting a namespace deletes its veth end and so the
pair). A topology whose process was killed before `close()` (kill -9, a machine restart of the
session) cannot clean up after itself: each topology writes an owner file under `OWNERS_DIR` (its
process id and start time, namespaces, links, address), and `open()` first deletes what every
owner that is no longer running left behind (`sweep_stale`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

OWNERS_DIR = Path("/run/tapeline-netns")
"""One JSON file per open topology (`<tag>.json`): who made it and what it made. Under /run, which a
reboot empties together with the namespaces themselves."""


def unavailable() -> str | None:
    """Why test hosts cannot be made here (not root, or no `ip`), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`)"
    return None


def _started(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot), or None
    when no such process runs: with the pid it names one process, even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_stale() -> list[str]:
    """Delete the namespaces, links and service addresses of every topology whose owner process is
    gone (`OWNERS_DIR`); returns the namespaces deleted. Never raises for what is already gone."""
    deleted: list[str] = []
    for owner_file in sorted(OWNERS_DIR.glob("*.json")) if OWNERS_DIR.is_dir() else []:
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue
        if _started(owner["pid"]) == owner["started"]:
            continue  # still running: its own close() cleans up
        for link in owner["links"]:
            ip("link", "del", link, check=False)
        for namespace in owner["namespaces"]:
            if ip("netns", "del", namespace, check=False).returncode == 0:
                deleted.append(namespace)
        ip("addr", "del", f"{owner['service']}/32", "dev", "lo", check=False)
        owner_file.unlink(missing_ok=True)
    return deleted


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; raises `RuntimeError` with its stderr when `check` and it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(*args: str, check: bool = True) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def _free_block() -> int:
    used = ip("-4", "-o", "addr").stdout
    free = [k for k in range(1, 255) if f" 10.250.{k}." not in used]
    if not free:
        raise RuntimeError("no free 10.250.k.0/24 block for test hosts")
    return random.choice(free)


@dataclass
class Host:
    """One test host: its namespace, the root end of its veth and its own address."""

    name: str
    namespace: str
    root_link: str
    address: str

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass
class Topology:
    """Hosts `names` as namespaces around the root namespace's service address `service`."""

    names: tuple[str, ...]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)
    service: str = ""

    def __post_init__(self) -> None:
        self.block = _free_block()
        self.service = f"10.250.{self.block}.1"

    def open(self) -> "Topology":
        """Delete what killed topologies left (`sweep_stale`), record this one's owner, then make the
        namespaces and links; on failure deletes what it made and raises `RuntimeError`."""
        sweep_stale()
        hosts = [Host(name, f"tl{self.tag}-{name}", f"tl{self.tag}{name}"[:15], f"10.250.{self.block}.{4 * i + 6}")
                 for i, name in enumerate(self.names)]
        OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        self.owner_file.write_text(json.dumps({
            "pid": os.getpid(), "started": _started(os.getpid()), "service": self.service,
            "namespaces": [h.namespace for h in hosts], "links": [h.root_link for h in hosts]}))
        try:
            ip("addr", "add", f"{self.service}/32", "dev", "lo")
            for i, host in enumerate(hosts):
                name = host.name
                gateway = f"10.250.{self.block}.{4 * i + 5}"
                ip("netns", "add", host.namespace)
                self.hosts[name] = host
                ip("link", "add", host.root_link, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
                ip("addr", "add", f"{gateway}/30", "dev", host.root_link)
                ip("link", "set", host.root_link, "up")
                inside = ("-n", host.namespace)
                ip(*inside, "link", "set", "lo", "up")
                ip(*inside, "addr", "add", f"{host.address}/30", "dev", "eth0")
                ip(*inside, "link", "set", "eth0", "up")
                ip(*inside, "route", "add", "default", "via", gateway)
        except Exception:
            self.close()
            raise
        return self

    def cut(self, name: str) -> None:
        """Take host `name` off the network (its link down); its processes keep running."""
        ip("link", "set", self.hosts[name].root_link, "down")

    def heal(self, name: str) -> None:
        """Put host `name` back on the network."""
        ip("link", "set", self.hosts[name].root_link, "up")

    def shape(self, name: str, rate: str = "4mbit", latency_ms: int = 200) -> None:
        """Make host `name`'s link slow and lossy both ways with a token bucket (`tc qdisc tbf`, which
        this kernel has; `netem` it has not): at most `rate` (tc's units, e.g. `4mbit`), and a packet
        that would queue longer than `latency_ms` milliseconds is dropped, so a busy link loses
        packets and TCP retransmits them. Raises `RuntimeError` when tc refuses."""
        host = self.hosts[name]
        shaping = ("root", "tbf", "rate", rate, "burst", "32kbit", "latency", f"{latency_ms}ms")
        _tc("qdisc", "replace", "dev", host.root_link, *shaping)
        _tc("-n", host.namespace, "qdisc", "replace", "dev", "eth0", *shaping)

    def unshape(self, name: str) -> None:
        """Give host `name`'s link its full speed back."""
        host = self.hosts[name]
        _tc("qdisc", "del", "dev", host.root_link, "root", check=False)
        _tc("-n", host.namespace, "qdisc", "del", "dev", "eth0", "root", check=False)

    def flap(self, name: str, down_s: float, every_s: float, stop: threading.Event) -> threading.Thread:
        """Cut host `name`'s link for `down_s` seconds every `every_s` seconds until `stop` is set (a
        thread; it leaves the link up). Each cut loses every packet sent meanwhile."""
        def run() -> None:
            while not stop.wait(every_s - down_s):
                self.cut(name)
                stop.wait(down_s)
                self.heal(name)
            self.heal(name)
        thread = threading.Thread(target=run, name=f"flap-{name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Delete every namespace (and so its veth pair) and the service address; never raises."""
        for host in self.hosts.values():
            ip("link", "del", host.root_link, check=False)
            ip("netns", "del", host.namespace, check=False)
        self.hosts.clear()
        ip("addr", "del", f"{self.service}/32", "dev", "lo", check=False)
        self.owner_file.unlink(missing_ok=True)

    @property
    def owner_file(self) -> Path:
        """This topology's owner record (`sweep_stale` reads it after a kill)."""
        return OWNERS_DIR / f"{self.tag}.json"
