"""Webhook endpoints: registration (`tapeline webhooks`, the admin API) and the address check every
POST repeats (processors/notify.py), over PostgreSQL's `webhook_endpoints` (migration 025).

The secret is returned once, by `register`; nothing else here returns or logs it.
"""

from __future__ import annotations

import base64
import secrets
import socket
from typing import Any, Callable

from domain.errors import WebhookRefused
from domain.policy.webhooks import check_event_types, check_url_shape, refused_address
from tapeline.ports import JobStore
from tapeline.settings import Settings

Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IP literals resolve to themselves)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise WebhookRefused(f"webhook host {host!r} does not resolve: {exc}") from exc
    return list(dict.fromkeys(info[4][0] for info in infos))


def checked_addresses(url: str, settings: Settings, resolver: Resolver = resolve) -> list[str]:
    """The addresses a POST to `url` may use. Raises `WebhookRefused` when the URL is malformed or
    any address it resolves to is refused (one bad address refuses the URL: DNS may answer either)."""
    try:
        host, port = check_url_shape(url)
    except ValueError as exc:
        raise WebhookRefused(str(exc)) from exc
    addresses = resolver(host, port)
    if not addresses:
        raise WebhookRefused(f"webhook host {host!r} has no address")
    for address in addresses:
        why = refused_address(address, allow_private=settings.notify_allow_private,
                              allow_loopback=settings.notify_allow_loopback)
        if why is not None:
            where = why if host == address else f"{host} resolves to {address}, and {why}"
            setting = ("TAPELINE_NOTIFY_ALLOW_LOOPBACK=true or TAPELINE_NOTIFY_ALLOW_PRIVATE=true"
                       if refused_address(address, allow_loopback=True) is None else "TAPELINE_NOTIFY_ALLOW_PRIVATE=true")
            raise WebhookRefused(f"webhook URL {url} refused: {where} (allowed only with {setting})")
    return addresses


def new_secret() -> str:
    """A fresh signing secret in the Standard Webhooks form: `whsec_` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def check_secret(secret: str) -> str:
    """`secret` if the Standard Webhooks library accepts it (`whsec_` + base64, at least 16 bytes)."""
    raw = secret.removeprefix("whsec_")
    try:
        decoded = base64.b64decode(raw + "==", validate=False)
    except ValueError as exc:
        raise WebhookRefused("the secret must be whsec_ followed by base64") from exc
    if len(decoded) < 16:
        raise WebhookRefused("the secret must hold at least 16 bytes (whsec_ + base64)")
    return secret if secret.startswith("whsec_") else "whsec_" + raw


def register(jobs: JobStore, settings: Settings, submitter: str, url: str, event_types: list[str],
             secret: str | None = None, resolver: Resolver = resolve) -> dict[str, Any]:
    """Register an endpoint of `submitter`; returns its row with the secret (the only time it is
    shown) and `same_url`, the ids of the submitter's endpoints already at this URL: each event goes
    to every one of them, each with its own webhook-id and secret, so the receiver cannot dedupe
    them (a second `add` of the same URL is allowed: it is how a secret is rotated, the old endpoint
    removed once the receiver has the new secret). Raises `WebhookRefused` for a refused URL, an
    unknown event type or a bad secret."""
    if not submitter.strip():
        raise WebhookRefused("a webhook endpoint needs a submitter")
    try:
        types = check_event_types(event_types)
    except ValueError as exc:
        raise WebhookRefused(str(exc)) from exc
    checked_addresses(url, settings, resolver)
    secret = check_secret(secret) if secret else new_secret()
    same_url = [e["endpoint_id"] for e in endpoints(jobs, submitter) if e["url"] == url]
    row = jobs.one("webhook_endpoint_insert", {"endpoint_id": "ep_" + secrets.token_hex(8), "submitter": submitter,
                                               "url": url, "secret": secret, "event_types": types})
    return {**row, "secret": secret, "same_url": same_url}


def endpoints(jobs: JobStore, submitter: str | None = None) -> list[dict[str, Any]]:
    """The endpoints (of `submitter`), without secrets, with their delivery counts."""
    return jobs.all("webhook_endpoints_list", {"submitter": submitter})


def set_enabled(jobs: JobStore, endpoint_id: str, enabled: bool, reason: str | None = None, *,
                for_failing: bool = False) -> bool:
    """Disable (with `reason`) or re-enable an endpoint; False when it does not exist. Re-enabling, and
    an operator's disable, end its failure streak; the notifier's disable for failing
    (`for_failing=True`) keeps it, so the endpoint counts as disabled for failing (its alert and the
    dashboard's strip) until someone enables or removes it."""
    return jobs.one("webhook_endpoint_set_enabled", {"endpoint_id": endpoint_id, "enabled": enabled,
                                                     "reason": reason, "for_failing": for_failing}) is not None


def remove(jobs: JobStore, endpoint_id: str) -> bool:
    """Remove an endpoint; False when it does not exist. Its deliveries not yet done are dead-lettered
    by the notifier."""
    return jobs.one("webhook_endpoint_remove", {"endpoint_id": endpoint_id}) is not None
