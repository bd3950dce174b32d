"""Reading the committed log and the bucket, for assertions."""

from __future__ import annotations

import json
import re
import socket
import subprocess

from domain import events as ev
from domain.codec import default_codec
from devstack.chaos import committed_messages, keys_under  # re-exported for the tests

__all__ = ["committed_messages", "keys_under", "committed_events", "of_job", "answer_of", "free_ports", "terminate_session"]
from tapeline.settings import Settings


def committed_events(settings: Settings, topic: str | None = None, timeout_s: float = 30.0) -> list[ev.Event]:
    """Every committed event of a topic (default: the lifecycle log), decoded, in partition order."""
    return [ev.Event.from_record(default_codec().decode(m.value())) for m in committed_messages(settings, topic, timeout_s)]


def of_job(events: list[ev.Event], job_id: str, event_type: str | None = None) -> list[ev.Event]:
    return [e for e in events if e.job_id == job_id and (event_type is None or e.event_type == event_type)]


def ffprobe_duration(url_or_path: str, stream: str | None = None) -> float:
    """Duration in seconds by ffprobe (format duration, or one stream's with `stream="v:0"`)."""
    args = ["ffprobe", "-v", "error", "-of", "json"]
    args += ["-select_streams", stream, "-show_entries", "stream=duration"] if stream else ["-show_entries", "format=duration"]
    done = subprocess.run(args + [url_or_path], capture_output=True, text=True, timeout=60, check=True)
    info = json.loads(done.stdout)
    return float(info["streams"][0]["duration"] if stream else info["format"]["duration"])


def decodes(url: str) -> subprocess.CompletedProcess:
    """Decode a whole media URL with ffmpeg (no output); returncode 0 and empty stderr mean clean."""
    return subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", url, "-f", "null", "-"],
                          capture_output=True, text=True, timeout=120)


def answer_of(sock: socket.socket, timeout_s: float) -> str:
    """The whole HTTP response on a raw `sock`: its head, then as many body bytes as its
    Content-Length says (the head and the body may arrive in separate reads), or what arrived before
    `timeout_s` seconds passed or the server closed or reset the connection."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while True:
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
                if length is None or len(body) >= int(length.group(1)):
                    break
            more = sock.recv(4096)
            if not more:
                break
            data += more
    except (socket.timeout, ConnectionResetError):
        pass
    return data.decode(errors="replace")


def free_ports(count: int) -> list[int]:
    """`count` TCP ports nobody listens on now (the kernel's pick)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def terminate_session(store, settings: Settings) -> None:
    """End `store`'s (a `PostgresJobStore`) session from another session, as a server restart or a
    dead link would."""
    from tapeline.postgres import PostgresJobStore

    pid = store.connection().info.backend_pid
    other = PostgresJobStore(settings)
    try:
        other.connection().execute("SELECT pg_terminate_backend(%s)", (pid,))
    finally:
        other.close()
