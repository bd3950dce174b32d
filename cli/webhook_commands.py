"""`tapeline webhooks`: a submitter's webhook endpoints for customer notifications (registered on
the main CLI in `cli/main.py`; the notifier, `tapeline run --role notify`, delivers to them)."""

from __future__ import annotations

import json
from typing import Any, List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from domain.errors import TapelineError
from domain.policy.webhooks import ALL_TYPES
from cli.helpers import console, fail, load_settings, out

webhooks_app = typer.Typer(help="Customer webhook endpoints: signed notifications of a submitter's jobs "
                                "(Standard Webhooks).", no_args_is_help=True)


def _json(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()}


def _store():
    from tapeline.postgres import PostgresJobStore

    return PostgresJobStore(load_settings())


@webhooks_app.command("add")
def add(url: str = typer.Argument(..., help="Where to POST (http or https; private addresses are refused unless "
                                            "TAPELINE_NOTIFY_ALLOW_PRIVATE=true)"),
        submitter: str = typer.Option(..., "--submitter", help="The submitter whose jobs notify this endpoint "
                                                                "(as `submit --submitter` or an intake token names it)"),
        events: Optional[List[str]] = typer.Option(None, "--event", help=f"A type wanted (repeat; default all): "
                                                                         f"{', '.join(ALL_TYPES)}"),
        secret: Optional[str] = typer.Option(None, "--secret", help="Signing secret whsec_<base64> (default: a new "
                                                                    "one, shown once)"),
        as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """Register an endpoint. Its signing secret is printed this once and never shown again."""
    from tapeline import webhook_endpoints as webhooks

    settings, store = load_settings(), _store()
    try:
        row = webhooks.register(store, settings, submitter, url, events or [], secret=secret)
    except TapelineError as exc:
        fail(exc, 2)
    finally:
        store.close()
    if as_json:
        out.print_json(json.dumps(_json(row)))
        return
    out.print(f"registered {row['endpoint_id']} for submitter {escape(row['submitter'])}: {escape(row['url'])}",
              highlight=False)
    out.print(f"events: {', '.join(row['event_types'])}", highlight=False)
    out.print(f"secret: {row['secret']}", highlight=False)
    console.print("keep the secret now: it is not shown again (verify signatures with it, see docs/operating.md)")
    if row["same_url"]:
        console.print(f"note: {escape(row['submitter'])} already has this URL as {', '.join(row['same_url'])}: each "
                      f"event goes to every one of them, with different webhook-ids and secrets (the receiver "
                      f"cannot dedupe them); remove the old ones (`tapeline webhooks remove ID`) once the "
                      f"receiver uses the new secret")


@webhooks_app.command("list")
def list_(submitter: Optional[str] = typer.Option(None, "--submitter", help="Only this submitter's endpoints"),
          as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """List endpoints (never their secrets) with their delivery counts."""
    from tapeline import webhook_endpoints as webhooks

    store = _store()
    try:
        rows = webhooks.endpoints(store, submitter)
    except TapelineError as exc:
        fail(exc)
    finally:
        store.close()
    if as_json:
        out.print_json(json.dumps([_json(r) for r in rows]))
        return
    if not rows:
        out.print("no webhook endpoints")
        return
    table = Table("id", "submitter", "url", "events", "enabled", "delivered", "pending", "dead", "failing since")
    for r in rows:
        table.add_row(r["endpoint_id"], escape(r["submitter"]), escape(r["url"]),
                      "all" if len(r["event_types"]) == len(ALL_TYPES) else ", ".join(r["event_types"]),
                      "yes" if r["enabled"] else f"no: {escape(r['disabled_reason'] or '')[:60]}",
                      str(r["delivered"]), str(r["pending"]), str(r["dead_lettered"]),
                      r["failing_since"].strftime("%Y-%m-%d %H:%M:%S") if r["failing_since"] else "-")
    out.print(table)


def _set(endpoint_id: str, enabled: bool, why: str | None) -> None:
    from tapeline import webhook_endpoints as webhooks

    store = _store()
    try:
        found = webhooks.set_enabled(store, endpoint_id, enabled, why)
    finally:
        store.close()
    if not found:
        fail(TapelineError(f"no webhook endpoint {endpoint_id!r} (see `tapeline webhooks list`)"), 2)
    out.print(f"{endpoint_id} {'enabled' if enabled else 'disabled'}")


@webhooks_app.command("disable")
def disable(endpoint_id: str = typer.Argument(..., help="Endpoint id from `tapeline webhooks list`"),
            why: str = typer.Option("disabled by an operator", "--why", help="Why (shown by `webhooks list`)")) -> None:
    """Stop delivering to an endpoint (its deliveries wait until it is enabled again)."""
    _set(endpoint_id, False, why)


@webhooks_app.command("enable")
def enable(endpoint_id: str = typer.Argument(..., help="Endpoint id from `tapeline webhooks list`")) -> None:
    """Deliver to a disabled endpoint again (its failure streak starts over)."""
    _set(endpoint_id, True, None)


@webhooks_app.command("remove")
def remove(endpoint_id: str = typer.Argument(..., help="Endpoint id from `tapeline webhooks list`")) -> None:
    """Remove an endpoint: nothing more is sent to it (deliveries not done are dead-lettered)."""
    from tapeline import webhook_endpoints as webhooks

    store = _store()
    try:
        found = webhooks.remove(store, endpoint_id)
    finally:
        store.close()
    if not found:
        fail(TapelineError(f"no webhook endpoint {endpoint_id!r} (see `tapeline webhooks list`)"), 2)
    out.print(f"{endpoint_id} removed")
