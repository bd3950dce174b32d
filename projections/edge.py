"""The edge of `tapeline serve`: what every HTTP request passes before a handler reads its body.

`EdgeGuard` (a pure ASGI middleware, so nothing is buffered that it does not choose to buffer):

1. **Refusals that need no body.** `refuse(scope)` may answer first, from the method, path and
   headers alone: the read API's admin token is checked here (`projections/api.py`
   `admin_refusal`, with `projections/api_deps.py` `require_admin`), and then that an action's
   body is declared JSON (`not_json`: 415), so an unauthenticated body is never read, let alone parsed (before, a 60 MB JSON body to an action without a token was
   parsed, +180 MB of server memory, then 401).
2. **A size cap on every body.** `body_limit(scope)` gives the route's cap in bytes (None: the
   route reads its own body under its own rules, as `POST /uploads` does with
   `max_upload_bytes` and its body pace). A `Content-Length` past the cap is 413 before a byte is
   read; a body without one is read up to the cap and 413 past it. A body within the cap is handed
   to the handler as it came, unless it is declared JSON and holds what no field can hold (a lone
   surrogate, a number that is not finite: `unholdable_json`, 400).
3. **Security headers on every response** (`SECURITY_HEADERS`, after the OWASP Secure Headers
   Project): no MIME sniffing, no framing (clickjacking of the action forms), no referrer (job
   ids in URLs stay on this site), and a Content-Security-Policy that lets a page load scripts,
   styles and data only from this server (`CONTENT_SECURITY_POLICY`). A response that sets its
   own `Content-Security-Policy` (the OpenAPI page, whose one inline script is allowed by hash)
   keeps it.

The Host check (DNS rebinding) is Starlette's `TrustedHostMiddleware`, given
`allowed_hosts(settings)`. `FlashSigner` signs the outcome a dashboard form redirects with, so a
page shows only outcomes this server wrote.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
from typing import Awaitable, Callable, Mapping
from urllib.parse import urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tapeline.settings import Settings

CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                           "frame-ancestors 'none'; form-action 'self'")
"""Scripts, styles, fetches and images from this server only (images also as data: URIs, which
Swagger UI's stylesheet uses for its icons); no plugins, no <base>, no framing, forms post here."""

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
)
"""Headers added to every response that does not set them itself."""

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""What a browser on the server's own machine sends as Host to a loopback-bound server."""


def allowed_hosts(settings: Settings, bind_host: str | None = None) -> list[str]:
    """Host header values `tapeline serve` answers (Starlette `TrustedHostMiddleware` patterns:
    a name, an IP, `*.example.com`, or `*` for any). `serve_allowed_hosts` when set; else, for a
    server bound to a loopback address (`bind_host`, default `serve_host`), only `LOOPBACK_HOSTS`,
    so a web page elsewhere cannot reach the dashboard through DNS rebinding; else `*` (a server
    on a network address is reached by names only its operator knows: set `serve_allowed_hosts`)."""
    if settings.serve_allowed_hosts:
        return list(settings.serve_allowed_hosts)
    host = bind_host or settings.serve_host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return list(LOOPBACK_HOSTS) if loopback else ["*"]


def script_hashes(html: str) -> list[str]:
    """CSP source expressions (`'sha256-...'`) of every inline `<script>` of `html`, for a page that
    must run its own inline script under `script-src` (the OpenAPI page)."""
    found = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'" for body in found]


def problem(status: int, detail: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """(status, JSON body, headers) of an answer in the read API's error shape `{"detail": ...}`."""
    body = json.dumps({"detail": detail}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return status, body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]


Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]


def not_json(scope: Scope) -> Answer | None:
    """415 for a request whose body is not declared JSON (`Content-Type` other than
    `application/json` or `application/*+json`), None for a JSON body or no body at all
    (`Content-Length: 0`, or neither it nor `Transfer-Encoding`). Decided from the headers alone,
    before the body is read; for the JSON actions: curl's `-d` sends
    `application/x-www-form-urlencoded`, which the body model would refuse with a 422 ("Input should
    be a valid dictionary") that names neither the header nor the fix. Pure."""
    headers = {k.lower(): v for k, v in scope.get("headers", [])}
    length = headers.get(b"content-length", b"").strip()
    if length in (b"", b"0") and b"transfer-encoding" not in headers:
        return None
    media = _media_type(scope)
    if _is_json(media):
        return None
    shown = media.decode("latin-1") or "none"
    return problem(415, f"this action takes a JSON body, sent with Content-Type: application/json (this one was "
                        f"{shown}); with curl: -H 'Content-Type: application/json' -d '{{...}}', or --json '{{...}}'")


def _media_type(scope: Scope) -> bytes:
    """The request's `Content-Type` without parameters, lower case (b"" without one)."""
    headers = {k.lower(): v for k, v in scope.get("headers", [])}
    return headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()


def _is_json(media: bytes) -> bool:
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class _Unholdable(ValueError):
    """A JSON value Python's parser reads that no field of ours can hold (see `unholdable_json`)."""


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _Unholdable(f"the number {text[:40]} is out of range (it is not finite)")
    return number


def _no_constant(name: str) -> float:
    raise _Unholdable(f"{name} is not a JSON number")


def unholdable_json(scope: Scope, body: bytes) -> Answer | None:
    """400 for a body declared JSON that Python's parser reads but that nothing downstream can hold:
    a lone surrogate (`"\\ud800"`, in a key or a value: UTF-8 cannot carry one, so the 422 renderer,
    PostgreSQL and Avro fail on it) or a number that is not finite (`1e999` parses as inf, and
    `NaN`, `Infinity`, `-Infinity` are not JSON; the renderer's JSON has no inf). Before, either
    answered 500 on every action (issue 44 item 6). None for any other body: a body not declared
    JSON, an empty one, or malformed JSON (the route's own answer, FastAPI's 422 or 400). Pure;
    `body` is at most the route's cap (`EdgeGuard`)."""
    if not body or not _is_json(_media_type(scope)):
        return None
    try:
        document = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except _Unholdable as exc:
        return problem(400, f"the JSON body cannot be taken: {exc}")
    except (ValueError, RecursionError):
        return None  # malformed JSON: the route answers it as before
    pending = [document]
    while pending:  # a loop, not recursion: the parser's nesting depth is not ours to repeat
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return problem(400, "the JSON body cannot be taken: it holds a lone surrogate escape (\\ud800-"
                                    "\\udfff without its pair), which is not a character")
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


class EdgeGuard:
    """ASGI middleware: refusals before the body, a body cap per route, security headers (see the
    module). `refuse(scope)`: an `Answer` (see `problem`) or None; `body_limit(scope)`: bytes or None."""

    def __init__(self, app: ASGIApp, *, refuse: Callable[[Scope], Answer | None],
                 body_limit: Callable[[Scope], int | None]) -> None:
        self.app, self.refuse, self.body_limit = app, refuse, body_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._with_headers(send)
        refusal = self.refuse(scope)
        if refusal is not None:
            await self._answer(send, refusal)
            return
        limit = self.body_limit(scope)
        if limit is None:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._answer(send, problem(413, f"the body is {int(length)} bytes; this route takes at most {limit}"))
            return
        body, more, ended = bytearray(), True, None
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                ended = message
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await self._answer(send, problem(413, f"the body passed {limit} bytes, the most this route takes"))
                return
        unholdable = unholdable_json(scope, bytes(body))
        if unholdable is not None:
            await self._answer(send, unholdable)
            return
        await self.app(scope, self._replay(bytes(body), ended, receive), send)

    @staticmethod
    def _replay(body: bytes, ended: Message | None, receive: Receive) -> Receive:
        """A `receive` that hands the buffered body over once, then what the client does next."""
        sent = False

        async def replayed() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                if ended is not None:
                    return ended
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replayed

    @staticmethod
    def _with_headers(send: Send) -> Callable[[Message], Awaitable[None]]:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *((k, v) for k, v in SECURITY_HEADERS if k not in present)]}
            await send(message)
        return sending

    @staticmethod
    async def _answer(send: Send, answer: Answer) -> None:
        status, body, headers = answer
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


FLASH_KINDS = ("msg", "err")
"""The query parameters that carry a form action's outcome to the page it redirects to: `msg` a
success, `err` a refusal. `sig` signs whichever is present."""


class FlashSigner:
    """Signs the outcome text a dashboard form redirects with, so a page shows only outcomes this
    server wrote. Before, `?msg=...` was shown verbatim and anyone could send an operator a
    dashboard link saying what they liked (content spoofing, issue 20 item 6).

    The signature is HMAC-SHA256 (RFC 2104) over `kind` and the text, its first 16 bytes in
    URL-safe base64 without padding. `key` (bytes) is derived from the admin token, so every
    replica of `tapeline serve` with the same token accepts the others' links (`for_settings`);
    a server without one has no actions and so no outcomes, and gets a random key.
    """

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def for_settings(cls, settings: Settings) -> "FlashSigner":
        """A signer whose key is HMAC-SHA256(admin token, "tapeline flash"), or random without a token."""
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        key = hmac.new(token.encode(), b"tapeline flash", hashlib.sha256).digest() if token else secrets.token_bytes(32)
        return cls(key)

    def sign(self, kind: str, text: str) -> str:
        """The signature of `text` shown as `kind` (one of FLASH_KINDS); 22 URL-safe characters."""
        mac = hmac.new(self._key, f"{kind}\x00{text}".encode(), hashlib.sha256).digest()[:16]
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def query(self, kind: str, text: str) -> str:
        """The query string (no `?`) that carries `text` as `kind` with its signature."""
        return urlencode({kind: text, "sig": self.sign(kind, text)})

    def shown(self, params: Mapping[str, str]) -> dict[str, str | None]:
        """`{"msg": ..., "err": ...}` from a request's query parameters: each text only when `sig`
        signs it, else None (a crafted or altered link shows nothing)."""
        signature = params.get("sig") or ""
        return {kind: text if (text := params.get(kind)) is not None
                and hmac.compare_digest(self.sign(kind, text), signature) else None
                for kind in FLASH_KINDS}
