"""Local monitoring for `tapeline stack up --with-monitoring`: Debian's Prometheus and Alertmanager.

Prometheus loads the shipped rules (compose/alerts.yml, or the file `alert_rules_file` names), scrapes the processors' health
ports, the API's /metrics and region B's media replicator from a file_sd target list the stack writes, and sends its alerts to
the local Alertmanager, which routes them with compose/alertmanager.yml. Both listen on 127.0.0.1
only (`settings.prometheus_port`, `settings.alertmanager_port`); their files live under
`<home>/monitoring/`. `monitoring_interval_s` is the scrape and evaluation interval (a test shortens
it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from tapeline.settings import PROJECT_ROOT, Settings
from domain.pipeline import STAGE_NAMES
from cli.supervisor import ROLES

from tapeline.home import StackError, HomePaths, now_iso, owned_pid, say, spawn, update_state, wait_ready, stop_owned

MONITORING_READY_TIMEOUT_S = 30.0
"""How long `up --with-monitoring` waits for Prometheus and Alertmanager to report ready, seconds."""
DEFAULT_HEALTH_PORT_BASE = 9400
"""The processors' health port base scraped when `health_port_base` is unset (README, docker-compose)."""
ALERT_RULES = PROJECT_ROOT / "compose" / "alerts.yml"
"""The shipped alerting rules Prometheus loads (the ones promtool tests)."""


def alert_rules(settings: Settings) -> Path:
    """The rules file the local Prometheus loads: `settings.alert_rules_file`, or the shipped
    compose/alerts.yml when that is empty."""
    return Path(settings.alert_rules_file) if settings.alert_rules_file else ALERT_RULES

ALERTMANAGER_CONFIG = PROJECT_ROOT / "compose" / "alertmanager.yml"
"""Alertmanager's routing, shared with docker-compose."""
PROMETHEUS_BINARY = "prometheus"
ALERTMANAGER_BINARY = "prometheus-alertmanager"  # Debian's name for the alertmanager binary


def monitoring_dir(paths: HomePaths) -> Path:
    """`<home>/monitoring`: configs, targets, data, logs and pid files of both services."""
    return paths.home / "monitoring"


def _files(paths: HomePaths, service: str) -> dict[str, Path]:
    base = monitoring_dir(paths) / service
    return {"dir": base, "data": base / "data", "log": base / f"{service}.log", "pid": base / f"{service}.pid",
            "config": base / f"{service}.yml"}


def _address(settings: Settings, service: str) -> str:
    port = settings.prometheus_port if service == "prometheus" else settings.alertmanager_port
    return f"127.0.0.1:{port}"


def _markers(settings: Settings, service: str) -> tuple[str, ...]:
    binary = PROMETHEUS_BINARY if service == "prometheus" else ALERTMANAGER_BINARY
    return (binary, f"--web.listen-address={_address(settings, service)}")


def _region_b_set_up(settings: Settings) -> bool:
    """Whether `tapeline stack up --region b` has run on this machine (region B's home exists)."""
    try:
        return settings.for_region("b").home.is_dir()
    except ValueError:  # settings of region B itself
        return False


def scrape_targets(settings: Settings) -> list[dict[str, Any]]:
    """The file_sd target groups of the local Prometheus (pure).

    One group per processor child of `tapeline run --role all` at `health_port_base` (or
    DEFAULT_HEALTH_PORT_BASE) + its index (supervisor.ROLES order, then the extra transcode and publish
    workers), labelled `job=tapeline-processors` and `role`, and one for the API (`tapeline serve` at
    serve_host:serve_port, `job=tapeline-api`), and, while `replicate_health_port` is set and region B
    mirrors region A (`region_b_mirror`) and region B has been set up here (its home exists: `stack up
    --region b` ran; otherwise its down alert would fire for ever), region B's media replicator (`tapeline region replicate` at
    `Settings.replicator_health_address`, `job=tapeline-region-replicator`: the region replication gauges).
    Returns `[{"targets": [...], "labels": {...}}, ...]`.
    """
    base = settings.health_port_base or DEFAULT_HEALTH_PORT_BASE
    groups = [{"targets": [f"127.0.0.1:{base + i}"], "labels": {"job": "tapeline-processors", "role": role}}
              for i, role in enumerate(ROLES)]
    extra = [(name, n) for name in ROLES if name in STAGE_NAMES for n in range(2, settings.workers_of(name) + 1)]
    groups += [{"targets": [f"127.0.0.1:{base + len(ROLES) + i}"],
                "labels": {"job": "tapeline-processors", "role": f"{role}#{n}"}} for i, (role, n) in enumerate(extra)]
    host = "127.0.0.1" if settings.serve_host in ("0.0.0.0", "::", "") else settings.serve_host
    groups.append({"targets": [f"{host}:{settings.serve_port}"], "labels": {"job": "tapeline-api"}})
    if settings.replicator_health_address and settings.region_b_mirror and _region_b_set_up(settings):
        groups.append({"targets": [settings.replicator_health_address], "labels": {"job": "tapeline-region-replicator"}})
    return groups


def dashboard_url(settings: Settings) -> str:
    """Where a browser on this machine reaches `tapeline serve` with these settings (`http://HOST:PORT`,
    no trailing slash; a wildcard bind address is reached at 127.0.0.1)."""
    host = "127.0.0.1" if settings.serve_host in ("0.0.0.0", "::", "") else settings.serve_host
    return f"http://{host}:{settings.serve_port}"


def prometheus_config(settings: Settings, targets_file: Path) -> dict[str, Any]:
    """The local Prometheus's configuration as a dict (pure; written as YAML-compatible JSON).

    Scrape and evaluation every `monitoring_interval_s` seconds, the shipped rules, the local
    Alertmanager, the targets read from `targets_file` (file_sd, re-read when it changes), and the
    external label `tapeline_dashboard` (`tapeline serve`'s address) the alerts' links start with.
    """
    interval = f"{max(1, round(settings.monitoring_interval_s * 1000))}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": f"{max(1, round(min(settings.monitoring_interval_s, 10.0) * 1000))}ms",
                   # the rules' `dashboard` links are this + the page (compose/alerts.yml)
                   "external_labels": {"tapeline_dashboard": dashboard_url(settings)}},
        "rule_files": [str(alert_rules(settings))],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [_address(settings, "alertmanager")]}]}]},
        "scrape_configs": [{"job_name": "tapeline",
                            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "30s"}]}],
    }


def _command(settings: Settings, paths: HomePaths, service: str) -> list[str]:
    files = _files(paths, service)
    if service == "prometheus":
        return [shutil.which(PROMETHEUS_BINARY) or PROMETHEUS_BINARY, f"--config.file={files['config']}",
                f"--storage.tsdb.path={files['data']}", f"--web.listen-address={_address(settings, service)}",
                "--storage.tsdb.retention.time=15d", "--web.enable-lifecycle"]
    return [shutil.which(ALERTMANAGER_BINARY) or ALERTMANAGER_BINARY, f"--config.file={ALERTMANAGER_CONFIG}",
            f"--storage.path={files['data']}", f"--web.listen-address={_address(settings, service)}",
            "--cluster.listen-address="]  # one local Alertmanager: no gossip port


def _ready(settings: Settings, service: str, timeout_s: float = 2.0) -> tuple[bool, str | None]:
    """True if the service's `/-/ready` answers 200."""
    try:
        with urllib.request.urlopen(f"http://{_address(settings, service)}/-/ready", timeout=timeout_s) as resp:
            return resp.status == 200, None
    except urllib.error.HTTPError as exc:
        return False, f"/-/ready answered {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))


def _write_configs(settings: Settings, paths: HomePaths) -> None:
    prom = _files(paths, "prometheus")
    prom["data"].mkdir(parents=True, exist_ok=True)
    _files(paths, "alertmanager")["data"].mkdir(parents=True, exist_ok=True)
    targets = prom["dir"] / "targets.json"
    for path, body in ((targets, scrape_targets(settings)), (prom["config"], prometheus_config(settings, targets))):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")  # JSON is YAML: Prometheus reads either
        tmp.replace(path)


def up_monitoring(settings: Settings, paths: HomePaths, console: Console | None) -> None:
    """Start (or reuse) Alertmanager, then Prometheus, and wait until both report ready.

    Writes `<home>/monitoring/prometheus/{prometheus.yml,targets.json}` every time; a Prometheus the
    stack already runs is told to reload them (SIGHUP). Something else answering on a port is reused
    as is (its configuration is not ours). Started processes are recorded in `stack.json`.

    Raises:
        StackError: a binary is missing (names the Debian package), a process exits, or it is not
            ready within MONITORING_READY_TIMEOUT_S seconds.
    """
    for binary, package in ((PROMETHEUS_BINARY, "prometheus"), (ALERTMANAGER_BINARY, "prometheus-alertmanager")):
        if shutil.which(binary) is None:
            raise StackError(f"{binary} is missing: apt-get install -y {package} (scripts/bootstrap.sh)")
    _write_configs(settings, paths)
    for service in ("alertmanager", "prometheus"):
        files = _files(paths, service)
        pid = owned_pid(files["pid"], _markers(settings, service))
        proc = None
        if pid is not None:
            say(console, f"[bold]{service}[/]: already running (pid {pid})")
            if service == "prometheus":
                os.kill(pid, signal.SIGHUP)  # re-read prometheus.yml (targets.json is watched anyway)
        elif _ready(settings, service)[0]:
            say(console, f"[bold]{service}[/]: {_address(settings, service)} answers; reusing it")
            update_state(paths, service, None)
        else:
            proc = spawn(_command(settings, paths, service), files["log"], files["pid"], cwd=files["dir"])
            say(console, f"[bold]{service}[/]: started pid {proc.pid} on http://{_address(settings, service)}/")
            update_state(paths, service, {"pid": proc.pid, "started_at": now_iso(),
                                           "address": _address(settings, service), "log": str(files["log"])})
        wait_ready(service, lambda: _ready(settings, service), proc, files["log"], MONITORING_READY_TIMEOUT_S)


def monitoring_status(settings: Settings, paths: HomePaths) -> dict[str, dict[str, Any]]:
    """`{"prometheus": {...}, "alertmanager": {...}}` for `stack status`: each with `address` (URL),
    `up` (its /-/ready answers 200), `pid` (the stack's own live process or None), `started_by_stack`,
    `log`, and `error` when down (not started: `stack up --with-monitoring`). Never raises."""
    report = {}
    for service in ("prometheus", "alertmanager"):
        files = _files(paths, service)
        pid = owned_pid(files["pid"], _markers(settings, service))
        up, error = _ready(settings, service, timeout_s=1.0)
        entry: dict[str, Any] = {"address": f"http://{_address(settings, service)}/", "up": up, "pid": pid,
                                 "started_by_stack": pid is not None, "log": str(files["log"]) if pid else None}
        if service == "prometheus":
            entry["rules"] = str(alert_rules(settings))
            entry["targets"] = str(files["dir"] / "targets.json")
        if not up:
            entry["error"] = (f"{error}; not running (start it with `tapeline stack up --with-monitoring`)"
                              if pid is None else f"{error}; see {files['log']}")
        report[service] = entry
    return report


def down_monitoring(settings: Settings, paths: HomePaths, console: Console | None) -> None:
    """Stop Prometheus, then Alertmanager, if the stack started them (pid file and command line match);
    anything else on their ports is left alone."""
    for service in ("prometheus", "alertmanager"):
        files = _files(paths, service)
        # never started here: nothing to say when monitoring is not used
        if stop_owned(files["pid"], _markers(settings, service), service, console, quiet_when_absent=True):
            update_state(paths, service, None)
