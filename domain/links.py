"""Which URLs an event may hand on: the one rule for every URL field of an event (a master
playlist's, a rendition's) before it reaches a page, the JSON API, the CLI or a customer's webhook.

Events are written by services that may be wrong or forged (issue 44 item 6: a `JobCompleted` with
a `javascript:` master URL was rendered as a link, only the CSP stopping it, and would have been
sent to customers). The log keeps what was written, as evidence; what is handed out is `web_url`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

WEB_SCHEMES = ("http", "https")
"""The schemes a handed-out URL may have."""


def web_url(value: str | None) -> str | None:
    """`value` when it is an absolute http(s) URL with a host and no whitespace or control
    character; None for anything else (`javascript:`, `data:`, `file:`, relative or
    scheme-relative URLs, an empty or unparsable one). Pure."""
    if not value or any(ch <= " " or ch == "\x7f" for ch in value):
        return None
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:  # a malformed IPv6 literal or port
        return None
    return value if parts.scheme.lower() in WEB_SCHEMES and host else None
