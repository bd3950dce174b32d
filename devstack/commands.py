"""`tapeline stack up|status|down|topics`."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from tapeline.settings import Settings

from devstack import StackError, down, ensure_topics, status, up
from devstack.second_region import down_region_b, region_b_status, up_region_b

REGION_HELP = ("Region: a (the default deployment) or b (the standby: its own Kafka, PostgreSQL server and S3 on "
               "region A's ports + TAPELINE_REGION_B_PORT_OFFSET, PostgreSQL on 5433, and MirrorMaker 2 from "
               "region A with the media replicator beside it unless TAPELINE_REGION_B_MIRROR=false; docs/regions.md).")

# --------------------------------------------------------------------------------------------
# CLI: `tapeline stack up|status|down|topics`

stack_app = typer.Typer(help="The local stack of real services (Kafka KRaft, PostgreSQL, S3 via moto, "
                             "ffmpeg) without Docker; state and logs under the settings' home directory.",
                        no_args_is_help=True)


def _print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Tapeline local stack ({report['home']})")
    for column in ("service", "up", "address", "started by stack", "detail"):
        table.add_column(column)
    for name in ("kafka", "postgres", "s3", "ffmpeg", "prometheus", "alertmanager"):
        svc = report[name]
        if name in ("kafka", "s3", "prometheus", "alertmanager"):
            started = f"yes (pid {svc['pid']})" if svc["pid"] else "no"
        elif name == "postgres":
            started = f"yes ({svc['cluster']})" if svc["started_by_stack"] else "no"
        else:
            started = "-"
        detail = svc.get("error") or svc.get("client_error") or (f"version {svc['version']}" if name == "ffmpeg"
                                      else f"bucket {svc['bucket']}" if name == "s3" else svc.get("log") or "")
        state = "[green]up[/]" if svc["up"] else "[red]down[/]"
        if name in ("prometheus", "alertmanager") and not svc["up"] and not svc["pid"]:
            # Optional and never started: not a fault (`--json` still has the connection error).
            state, detail = "[dim]off[/]", "optional: tapeline stack up --with-monitoring"
        if name == "kafka" and svc.get("security") and not (svc.get("error") or svc.get("client_error")):
            security = svc["security"]
            detail = "; ".join(part for part in (f"secured: {security['protocol']} ({security['mechanism']}), ACLs per "
                                                 "role", str(detail)) if part)
        if name == "kafka" and len(svc.get("nodes", [])) > 1:
            started = ", ".join(f"{n['node_id']}: pid {n['pid']}" for n in svc["nodes"] if n["pid"]) or "no"
            quorum = svc["quorum"]
            detail = svc.get("error") or (
                f"nodes up {sum(n['up'] for n in svc['nodes'])}/{len(svc['nodes'])}, registered "
                f"{svc['brokers_registered']}, controller leader {quorum['leader']} (epoch {quorum['epoch']}), "
                f"under-replicated partitions {svc['under_replicated_partitions']}")
        table.add_row(name, state, str(svc["address"]), started, str(detail))
    console.print(table)


def _print_region_b(report: dict[str, Any], console: Console) -> None:
    """Region B's services (`region_b_status`) as a table like region A's, with the mirror's and the
    media replicator's rows."""
    table = Table(title=f"Region b ({report['home']})")
    for column in ("service", "up", "address", "started by stack", "detail"):
        table.add_column(column)
    services = ("kafka", "postgres", "s3", "mirror", "replicator")
    never_started = not any(report[name].get("started_by_stack") for name in services)
    for name in services:
        svc = report[name]
        started = (f"yes (pid {svc['pid']})" if svc.get("pid") else
                   f"yes ({svc['cluster']})" if name == "postgres" and svc["started_by_stack"] else "no")
        detail = svc.get("error") or svc.get("log") or ""
        if name == "mirror" and svc["up"]:
            age = svc["heartbeat_age_s"]
            detail = f"newest heartbeat in b {age} s ago" if age is not None else "no heartbeat in b yet"
        elif name in ("mirror", "replicator") and not svc["enabled"]:
            detail = "off (TAPELINE_REGION_B_MIRROR=false)"
        state = "[green]up[/]" if svc["up"] else ("[dim]off[/]" if never_started else "[red]down[/]")
        if never_started and not svc["up"]:
            detail = "not started: tapeline stack up --region b"
        table.add_row(name, state, str(svc["address"]), started, str(detail))
    console.print(table)


@stack_app.command("up")
def up_command(
    with_monitoring: bool = typer.Option(False, "--with-monitoring", help="Also start Prometheus (alerting rules "
                                         "compose/alerts.yml) and Alertmanager on 127.0.0.1 (TAPELINE_PROMETHEUS_PORT, "
                                         "TAPELINE_ALERTMANAGER_PORT)."),
    brokers: int = typer.Option(None, "--brokers", min=1, max=9, help="Kafka nodes (default TAPELINE_KAFKA_BROKERS, "
                                "1). 3: a replicated cluster, topics with replication factor 3 and min.insync.replicas "
                                "2; node n on the bootstrap port + 2(n-1). Export TAPELINE_KAFKA_BROKERS=3 for the "
                                "processors too, so they bootstrap from every node."),
    region: str = typer.Option("a", "--region", help=REGION_HELP),
    secure: bool = typer.Option(False, "--secure", help="Kafka with a SASL_SSL listener instead of PLAINTEXT: a CA "
                                "and broker certificate, one SCRAM-SHA-512 principal per role (passwords in "
                                "<home>/kafka/secure/credentials.json) and ACLs giving each role only its topics "
                                "(docs/security.md). One node; its data apart from the plain node's."),
) -> None:
    """Start (or reuse) Kafka, PostgreSQL and S3, check ffmpeg, create the topics; with
    --with-monitoring also Prometheus and Alertmanager. With --region b, region B's own services and
    the log mirror from region A instead. With --secure, Kafka secured (prints the settings its
    clients need)."""
    err = Console(stderr=True)
    region = _region(region)
    settings = region_a_settings() if brokers is None else region_a_settings(kafka_brokers=brokers)
    if secure:
        from devstack.kafka_secure import client_settings
        from tapeline.home import home_paths

        settings = client_settings(settings, home_paths(settings))
    try:
        if region == "b" and secure:
            raise StackError("region b is not secured (yet): `stack up --secure` secures region A's Kafka")
        if region == "b":
            if with_monitoring or brokers not in (None, 1):
                raise StackError("region b runs one Kafka node and no monitoring of its own (yet)")
            _print_region_b(up_region_b(settings, console=err), Console())
            return
        report = up(settings, console=err, monitoring=with_monitoring)
    except StackError as exc:
        err.print(f"[red]stack up failed:[/] {exc}")
        raise typer.Exit(1) from exc
    _print_table(report, Console())


def _region(region: str) -> str:
    """The `--region` value, checked: `a` or `b` (exit 2 otherwise)."""
    if region not in ("a", "b"):
        raise typer.BadParameter(f"unknown region {region!r}: a or b", param_hint="--region")
    return region


def region_a_settings(**update: Any) -> Settings:
    """The environment's settings, which describe region A (region B is derived from them); exit 2 with
    the reason when TAPELINE_REGION names another region."""
    settings = Settings(**update)
    if settings.region != "a":
        Console(stderr=True).print("[red]error:[/] the stack commands take region A's settings and `--region b`; "
                                   f"unset TAPELINE_REGION (it is {settings.region!r})")
        raise typer.Exit(2)
    return settings


@stack_app.command("status")
def status_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Show each service's address, whether it answers, and whether the stack started it, for region A
    and region B (with the mirror); in `--json`, region B is the key `region_b`. When region A is the
    standby (`tapeline region rejoin a --as-standby`: the mirror B -> A and the media replicator into
    A run from region A's home), they are shown too (`--json`: the key `region_a_standby`).

    The PostgreSQL DSNs are shown with their passwords masked. Exit code 0 either way.
    """
    settings = region_a_settings()
    report = status(settings)
    region_b = region_b_status(settings)
    from devstack.second_region import region_a_standby_status

    into_a = region_a_standby_status(settings)
    if as_json:
        typer.echo(json.dumps({**report, "region_b": region_b,
                               **({"region_a_standby": into_a} if into_a is not None else {})}))
    else:
        _print_table(report, Console())
        if into_a is not None:
            _print_region_a_standby(into_a, Console())
        _print_region_b(region_b, Console())


def _print_region_a_standby(report: dict[str, Any], console: Console) -> None:
    """The mirror and the media replicator into region A (`region_a_standby_status`) as a table."""
    standby = report.get("standby") or {}
    table = Table(title=f"Region a, the standby of region {standby.get('active', 'b')} (reset at region epoch "
                        f"{standby.get('reset_at_epoch', '-')})")
    for column in ("service", "up", "address", "started by stack", "detail"):
        table.add_column(column)
    for name in ("mirror", "replicator"):
        svc = report[name]
        detail = svc.get("error") or svc.get("log") or ""
        if name == "mirror" and svc["up"]:
            age = svc["heartbeat_age_s"]
            detail = f"newest heartbeat in a {age} s ago" if age is not None else "no heartbeat in a yet"
        table.add_row(name, "[green]up[/]" if svc["up"] else "[red]down[/]", str(svc["address"]),
                      f"yes (pid {svc['pid']})" if svc.get("pid") else "no", str(detail))
    console.print(table)


@stack_app.command("down")
def down_command(
    region: str = typer.Option("a", "--region", help=REGION_HELP),
) -> None:
    """Stop only what `stack up` started, monitoring included (Kafka data stays on disk; moto's objects are
    lost). With --region b: region B's mirror and services only."""
    err = Console(stderr=True)
    region = _region(region)
    try:
        if region == "b":
            down_region_b(region_a_settings(), console=err)
            return
        down(Settings(), console=err)
    except StackError as exc:
        err.print(f"[red]stack down failed:[/] {exc}")
        raise typer.Exit(1) from exc


@stack_app.command("topics")
def topics_command() -> None:
    """Create any missing topic (LogAppendTime and unlimited retention where `ensure_topics` says)."""
    settings = Settings()
    try:
        ensure_topics(settings)
    except StackError as exc:
        Console(stderr=True).print(f"[red]creating topics failed:[/] {exc}")
        raise typer.Exit(1) from exc
    for topic, partitions in settings.all_topics().items():
        typer.echo(f"{topic}\t{partitions} partitions")


def register(app: typer.Typer) -> None:
    """Add `stack` to the `tapeline` command (the entry point `tapeline.commands` names this function;
    cli/main.py calls it)."""
    app.add_typer(stack_app, name="stack", help="Start, inspect and stop the local real services (no Docker).")
