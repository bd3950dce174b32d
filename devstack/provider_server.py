"""A local publish provider: a real HTTP server that records every post it receives.

It stands in for a social/video platform or a CMS webhook in tests, the demo and benchmarks:

- `POST /posts` with an `Idempotency-Key` header and a JSON body creates a post and answers 201
  `{"id": ..., "idempotency_key": ..., "url": ...}`. In `dedupe` mode a repeated key answers 200 with
  the first post (what Stripe-style idempotency keys do); in `nodedupe` mode every request creates
  a new post, so a test proves that Tapeline itself never posts twice.
- `GET /posts/lookup?idempotency_key=K` answers 200 with the first post of that key, or 404.
- `GET /posts` lists every post received, in order (the record a test asserts on); each carries
  `received_at` (UNIX seconds, the server's clock when the request arrived).
- `GET /requests` lists every `POST /posts` request, refused ones included:
  `{"idempotency_key", "status", "received_at"}` (what a test of cooldowns and quotas asserts on).
- `POST /_control` with `{"fail_next": N, "status": 503, "retry_after_s": 2, "lookups": "down"}`
  makes the next N posts fail with that status (and a `Retry-After` header) or every lookup
  answer 503 (`"lookups": "up"` restores them); `{"reply_delay_s": 8}` records each post at once and
  answers it 8 s later (a slow provider: a caller killed meanwhile made a post it never heard of).

Run: `python -m devstack.provider_server --port 18080 --mode nodedupe [--record posts.jsonl]`.
Every post is also appended to the record file (JSON lines), so a test can read what the server
received even after killing it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import typer


@dataclass
class ProviderState:
    """Posts received and the fault settings; guarded by `lock` (the server is threaded)."""

    mode: str = "nodedupe"
    record: Path | None = None
    posts: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    fail_next: int = 0
    fail_status: int = 503
    retry_after_s: float | None = None
    lookups_down: bool = False
    reply_delay_s: float = 0.0  # a post is recorded, then its answer waits this long (a slow provider)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def first_with_key(self, key: str) -> dict[str, Any] | None:
        return next((p for p in self.posts if p["idempotency_key"] == key), None)


def make_handler(state: ProviderState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: tests read the record instead
            pass

        def reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            url = urlsplit(self.path)
            if url.path == "/posts":
                with state.lock:
                    return self.reply(200, list(state.posts))
            if url.path == "/requests":
                with state.lock:
                    return self.reply(200, list(state.requests))
            if url.path == "/posts/lookup":
                key = (parse_qs(url.query).get("idempotency_key") or [""])[0]
                with state.lock:
                    if state.lookups_down:
                        return self.reply(503, {"error": "lookups unavailable"})
                    post = state.first_with_key(key)
                return self.reply(200, post) if post else self.reply(404, {"error": "no post with that key"})
            if url.path == "/health":
                return self.reply(200, {"mode": state.mode})
            self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            if url.path == "/_control":
                change = self.body()
                with state.lock:
                    state.fail_next = int(change.get("fail_next", state.fail_next))
                    state.fail_status = int(change.get("status", state.fail_status))
                    state.retry_after_s = change.get("retry_after_s", state.retry_after_s)
                    if "lookups" in change:
                        state.lookups_down = change["lookups"] == "down"
                    if "mode" in change:
                        state.mode = change["mode"]
                    state.reply_delay_s = float(change.get("reply_delay_s", state.reply_delay_s))
                return self.reply(200, {"ok": True})
            if url.path != "/posts":
                return self.reply(404, {"error": "not found"})
            received_at = time.time()
            key = self.headers.get("Idempotency-Key")
            if not key:
                return self.reply(400, {"error": "Idempotency-Key header required"})
            payload = self.body()
            with state.lock:
                if state.fail_next > 0:
                    state.fail_next -= 1
                    state.requests.append({"idempotency_key": key, "status": state.fail_status,
                                           "received_at": received_at})
                    headers = {"Retry-After": f"{state.retry_after_s:g}"} if state.retry_after_s else {}
                    return self.reply(state.fail_status, {"error": "injected failure"}, headers)
                existing = state.first_with_key(key)
                if state.mode == "dedupe" and existing is not None:
                    state.requests.append({"idempotency_key": key, "status": 200, "received_at": received_at})
                    return self.reply(200, existing)
                state.requests.append({"idempotency_key": key, "status": 201, "received_at": received_at})
                post = {"id": f"post-{len(state.posts) + 1}", "idempotency_key": key, "payload": payload,
                        "url": f"http://provider.local/posts/{len(state.posts) + 1}", "received_at": received_at}
                state.posts.append(post)
                if state.record is not None:
                    with open(state.record, "a") as fh:
                        fh.write(json.dumps(post) + "\n")
                delay = state.reply_delay_s
            if delay > 0:  # the post exists; its caller has not heard so yet
                time.sleep(delay)
            self.reply(201, post)

    return Handler


def serve(host: str, port: int, state: ProviderState) -> ThreadingHTTPServer:
    """Start the server on a background thread; returns it (call `shutdown()` to stop)."""
    server = ThreadingHTTPServer((host, port), make_handler(state))
    threading.Thread(target=server.serve_forever, daemon=True, name="provider-server").start()
    return server


def main(host: str = typer.Option("127.0.0.1", "--host"), port: int = typer.Option(18080, "--port"),
         mode: str = typer.Option("nodedupe", "--mode", help="dedupe | nodedupe"),
         record: Path | None = typer.Option(None, "--record", help="Append every post here (JSON lines)")) -> None:
    """Run the local publish provider in the foreground."""
    if mode not in ("dedupe", "nodedupe"):
        raise typer.BadParameter("mode is dedupe or nodedupe")
    server = ThreadingHTTPServer((host, port), make_handler(ProviderState(mode=mode, record=record)))
    print(f"provider on http://{host}:{port} mode={mode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    typer.run(main)
