"""A bounded load on the HTTP intake from its own process (tests and `bench/intake.py`).

    python -m bench.intake_load URL TOKEN FILE --uploads N --deadline S [--priority P] [--retry]

Starts N uploads of FILE at once (one thread each, released together), each `POST URL/uploads`
streaming the file in 64 KiB chunks. With `--retry`, an upload answered 503 or 429 waits the
answer's `Retry-After` and tries again until it is accepted or `--deadline` seconds have passed
since the start; without, each upload is tried once. Prints one JSON object on stdout:
`{"uploads": [{"attempts": [{"status", "retry_after", "started", "answered"}], "response"}], ...}`
(times in seconds since the start, `time.monotonic` of this process; `started_epoch` the wall clock
of the start, so latencies can be joined with other processes' clocks).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

CHUNK = 64 * 1024


def chunks(data: bytes) -> Iterator[bytes]:
    for i in range(0, len(data), CHUNK):
        yield data[i:i + CHUNK]


def run(url: str, token: str, data: bytes, uploads: int, deadline_s: float, priority: str = "standard",
        retry: bool = False, filename: str = "clip.mp4") -> dict[str, Any]:
    """The load described in the module docstring; returns the JSON object it prints."""
    barrier = threading.Barrier(uploads)
    results: list[dict[str, Any]] = [{"attempts": [], "response": None} for _ in range(uploads)]
    origin = {"t": 0.0, "epoch": 0.0}
    start_lock = threading.Lock()

    def one(i: int) -> None:
        result = results[i]
        with httpx.Client(base_url=url, timeout=60.0) as client:
            barrier.wait()
            with start_lock:
                if not origin["t"]:
                    origin["t"], origin["epoch"] = time.monotonic(), time.time()
            while True:
                started = time.monotonic() - origin["t"]
                answer = client.post("/uploads", params={"priority": priority, "filename": filename},
                                     content=chunks(data), headers={"Authorization": f"Bearer {token}",
                                                                    "Content-Type": "video/mp4"})
                after = answer.headers.get("retry-after")
                result["attempts"].append({"status": answer.status_code, "retry_after": after, "started": started,
                                           "answered": time.monotonic() - origin["t"],
                                           "started_epoch": origin["epoch"] + started})
                if answer.status_code == 202:
                    result["response"] = answer.json()
                    return
                if not retry or answer.status_code not in (429, 503) or after is None:
                    result["response"] = answer.json()
                    return
                wait = float(after)
                if time.monotonic() - origin["t"] + wait > deadline_s:
                    return
                time.sleep(wait)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(uploads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + 120)
    return {"uploads": results, "started_epoch": origin["epoch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("token")
    parser.add_argument("file", type=Path)
    parser.add_argument("--uploads", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--priority", default="standard")
    parser.add_argument("--retry", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run(args.url, args.token, args.file.read_bytes(), args.uploads, args.deadline, args.priority,
                         args.retry)))


if __name__ == "__main__":
    main()
