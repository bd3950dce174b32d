"""Customer notifications by webhook: the pure rules (processors/notify.py runs them).

- which lifecycle events notify, under which Standard Webhooks type (`NOTIFICATION_TYPES`);
- the `webhook-id` of a delivery (`delivery_id`): derived from the lifecycle event's dedup key and the
  endpoint, so every retry of one notification, through any crash or redeploy, carries the same id;
- which addresses an endpoint may resolve to (`refused_address`): only globally routable ones
  unless private ones are allowed; the POST then goes to the address that was checked
  (`pinned`), so a DNS answer that changes after the check cannot send it elsewhere;
- the retry schedule (`next_try`) and when a failing endpoint is disabled (`should_disable`).
"""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

NOTIFICATION_TYPES: dict[str, str] = {
    "JobCompleted": "job.completed",
    "JobRejected": "job.rejected",
    "JobFailed": "job.failed",
    "JobDeadLettered": "job.dead_lettered",
    "NeedsReview": "job.needs_review",
    "JobReplayed": "job.replayed",
    "JobCancelled": "job.cancelled",
    "JobDelayed": "job.delayed",
}
"""Lifecycle event type -> notification type (the `type` of the delivered JSON)."""

ALL_TYPES: tuple[str, ...] = tuple(NOTIFICATION_TYPES.values())

DELIVERY_NAMESPACE = uuid.UUID("4b0c8f1e-6d0a-5c55-9a43-1d2f6a8e7c10")
"""Namespace of `delivery_id`. Never change it: receivers dedupe on the ids derived from it."""

DEFAULT_RETRY_SCHEDULE_S: tuple[float, ...] = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
"""Waits after the 1st, 2nd, ... failed try (Standard Webhooks' / Svix's schedule: 5 s, 5 min, 30 min,
2 h, 5 h, 10 h, 10 h): eight tries over about 27.6 hours, then the delivery is dead-lettered."""


def delivery_id(source_dedup_key: str, endpoint_id: str) -> str:
    """The `webhook-id` of the notification of one lifecycle event (its dedup key) to one endpoint."""
    return "msg_" + uuid.uuid5(DELIVERY_NAMESPACE, f"{source_dedup_key}|{endpoint_id}").hex


def check_event_types(types: list[str] | tuple[str, ...]) -> list[str]:
    """The wanted types, checked (empty: every type). Raises ValueError naming an unknown one."""
    unknown = [t for t in types if t not in ALL_TYPES]
    if unknown:
        raise ValueError(f"unknown event type(s) {', '.join(unknown)}; choose from {', '.join(ALL_TYPES)}")
    return list(dict.fromkeys(types)) if types else list(ALL_TYPES)


def check_url_shape(url: str) -> tuple[str, int]:
    """(host, port) of an endpoint URL; raises ValueError unless it is http(s) with a host and no
    credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook URL must be http or https, not {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise ValueError("webhook URL has no host")
    if parts.username or parts.password:
        raise ValueError("webhook URL must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"webhook URL has a bad port: {exc}") from exc
    return parts.hostname, port


@dataclass(frozen=True)
class PinnedTarget:
    """Where a POST to an endpoint goes once its address is checked: `url` names the address itself,
    `host` is the `Host` header (the URL's host and any explicit port) and `sni_hostname` the name
    TLS sends and verifies the certificate against (None for http)."""

    url: str
    host: str
    sni_hostname: str | None


def pinned(url: str, address: str) -> PinnedTarget:
    """`url` rewritten to connect to `address` (an IP literal that `refused_address` allowed) while
    the request still names the URL's host: without it the HTTP client resolves the host again,
    and a DNS answer that changed since the check (DNS rebinding) could send the POST to a private
    address. Raises ValueError for a URL `check_url_shape` refuses. Pure."""
    check_url_shape(url)
    parts = urlsplit(url)
    literal = f"[{address}]" if ":" in address else address
    netloc = f"{literal}:{parts.port}" if parts.port else literal
    host = parts.netloc.rsplit("@", 1)[-1]
    return PinnedTarget(url=urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")), host=host,
                        sni_hostname=parts.hostname if parts.scheme == "https" else None)


IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")
NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
"""IPv6 ranges whose last 32 bits are an IPv4 address the packet is for: IPv4-compatible (RFC 4291,
deprecated; `::` and `::1` excepted), IPv4-translated (RFC 2765) and NAT64's well-known prefix
(RFC 6052). IPv4-mapped (`::ffff:0:0/96`) is `ipv4_mapped`; 6to4 (`2002::/16`, RFC 3056) and
Teredo (`2001::/32`, RFC 4380) carry theirs elsewhere (`sixtofour`, `teredo`)."""


def embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[tuple[ipaddress.IPv4Address, ...], bool]:
    """(the IPv4 addresses `ip` carries, whether `ip` merely translates them). Translations (mapped,
    compatible, translated, NAT64) reach exactly their IPv4 address; 6to4 and Teredo reach it through
    a tunnel (Teredo's server and client both count). ((), False) for any other address. Pure."""
    low = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,), True
    if ip in IPV4_TRANSLATED or ip in NAT64_WELL_KNOWN or (ip in IPV4_COMPATIBLE and int(ip) > 1):
        return (low,), True
    if ip.sixtofour is not None:
        return (ip.sixtofour,), False
    if ip.teredo is not None:
        return ip.teredo, False
    return (), False


def refused_address(address: str, *, allow_private: bool = False, allow_loopback: bool = False) -> str | None:
    """Why an endpoint may not be reached at `address` (an IP literal), or None when it may.

    Only globally routable addresses are allowed: private (10/8, 172.16/12, 192.168/16, fc00::/7),
    loopback, link-local (169.254/16: cloud metadata; fe80::/10), shared (100.64/10), multicast,
    reserved and unspecified ones are refused unless `allow_private` (every non-global address) or,
    for loopback only, `allow_loopback`. An IPv6 address that carries an IPv4 one (`embedded_ipv4`:
    mapped, compatible, translated, NAT64, 6to4, Teredo; issue 44 item 6) is refused when that IPv4
    address is, with the same allowances; a translation is then judged as its IPv4 address alone."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        carried, translation = embedded_ipv4(ip)
        for inner in carried:
            why = _refused_ip(inner, allow_private, allow_loopback)
            if why is not None:
                return why if ip.ipv4_mapped is not None else f"{ip} embeds the IPv4 address {inner}, and {why}"
        if translation:
            return None
    return _refused_ip(ip, allow_private, allow_loopback)


def _refused_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_private: bool,
                allow_loopback: bool) -> str | None:
    """`refused_address`'s judgement of one address by its own range alone."""
    if ip.is_global and not ip.is_multicast and not ip.is_reserved:
        return None
    if allow_private:
        return None
    if ip.is_loopback:
        return None if allow_loopback else f"{ip} is a loopback address"
    kind = ("link-local" if ip.is_link_local else "unspecified" if ip.is_unspecified else "multicast" if ip.is_multicast
            else "private" if ip.is_private else "reserved" if ip.is_reserved else "not globally routable")
    return f"{ip} is a {kind} address"


@dataclass(frozen=True)
class NextTry:
    """After a failed try: retry at `retry_at`, or (None) dead-letter the delivery."""

    retry_at: datetime | None


def next_try(try_number: int, now: datetime, schedule_s: tuple[float, ...]) -> NextTry:
    """After try `try_number` (1-based) failed at `now`: the next one is due `schedule_s[try_number - 1]`
    seconds later; past the schedule's end the delivery is dead-lettered."""
    if try_number - 1 < len(schedule_s):
        return NextTry(now + timedelta(seconds=schedule_s[try_number - 1]))
    return NextTry(None)


def should_disable(failing_since: datetime | None, now: datetime, disable_after_s: float) -> bool:
    """Whether an endpoint failing without a success since `failing_since` is disabled at `now`."""
    return failing_since is not None and (now - failing_since).total_seconds() >= disable_after_s
