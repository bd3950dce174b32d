"""A real local webhook receiver for the notification tests: an HTTP server on 127.0.0.1 that
verifies every POST's Standard Webhooks signature with the endpoint's secret (`standardwebhooks`)
and counts deliveries per `webhook-id`. Each path has a script of answers: an int is a status code,
`("hang", seconds, status)` waits that long before answering; past the script's end the last entry
repeats."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError


class Receiver:
    def __init__(self) -> None:
        self.secrets: dict[str, str] = {}  # path -> secret
        self.scripts: dict[str, list[Any]] = {}
        self.calls: dict[str, int] = defaultdict(int)  # path -> POSTs received
        self.by_id: dict[str, list[dict]] = defaultdict(list)  # webhook-id -> every POST of it
        self.unverified: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                path = self.path
                with receiver.lock:
                    n = receiver.calls[path]
                    receiver.calls[path] += 1
                    script = receiver.scripts.get(path, [200])
                    answer = script[min(n, len(script) - 1)]
                headers = {k.lower(): v for k, v in self.headers.items()}
                record = {"path": path, "headers": headers, "body": body, "at": time.time(), "call": n}
                try:
                    payload = Webhook(receiver.secrets[path]).verify(body, headers)
                    record["payload"] = payload
                    with receiver.lock:
                        receiver.by_id[headers["webhook-id"]].append(record)
                except (WebhookVerificationError, KeyError) as exc:
                    record["error"] = repr(exc)
                    with receiver.lock:
                        receiver.unverified.append(record)
                status = answer
                if isinstance(answer, tuple):
                    _, seconds, status = answer
                    time.sleep(seconds)
                record["status"] = status  # what it answered (a hung answer may never reach the notifier)
                try:
                    self.send_response(status)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the notifier gave up (its timeout) and closed the connection

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "Receiver":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ids_of(self, path: str) -> dict[str, list[dict]]:
        """webhook-id -> verified POSTs, of one path."""
        with self.lock:
            return {i: list(r) for i, r in self.by_id.items() if r and r[0]["path"] == path}


def body_of(record: dict) -> dict:
    return json.loads(record["body"])
