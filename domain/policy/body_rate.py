"""How long a request body may take to arrive, and when it starts to count: slow or stalled clients
hold no intake slot.

The rule (pure, `BodyRate.read_deadline`): the next chunk of a body must arrive

- within `idle_s` of the previous one (or of the start), as nginx's `client_body_timeout` (a
  timeout between two successive reads, 60 s by default there), and
- by `started + timeout_s + received / min_rate_bytes_s`, as Apache httpd's `mod_reqtimeout`
  `body=20,MinRate=500` (a time allowance that grows by one second per `MinRate` bytes received).

A client that sends at `min_rate_bytes_s` or faster and never pauses longer than `idle_s` is never
cut off, however large its body; a client that trickles or stops loses its request (408) within
`max(idle_s, timeout_s)` seconds of falling behind. The defaults (`tapeline/settings.py`:
`intake_body_timeout_s` 20 s as httpd's, `intake_body_min_rate_bytes_s` 64 KiB/s, about half a
megabit per second, for video rather than httpd's 500 bytes/s, `intake_body_idle_timeout_s` 30 s)
suit a phone on a poor mobile link.

A body takes one of its tier's slots (is admitted, `domain/policy/admission.py`) only once it is
moving (`BodyRate.moving`): at least `min_rate_bytes_s x window_s` bytes arrived within one window
of `window_s` seconds (`intake_body_rate_window_s`, 2 s: 128 KiB at the default rate), or the whole
body arrived. Until then it holds no slot and no thread, and the pace rule above still ends it
(408). Issue 44 item 3: 50 index uploads that each sent one byte held the whole index tier (503
for every other submitter) until the body timeout, and 80 such sockets held the intake's threads.

The I/O side (awaiting the chunks) is `producers/intake_body.py` `body_chunks`; the 408 answer is
`producers/http_intake.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BodyRate:
    """The pace a request body must keep. `timeout_s`: seconds allowed before any credit for bytes;
    `min_rate_bytes_s`: bytes per second that each earn one more second (> 0); `idle_s`: longest
    pause between two chunks, seconds; `window_s`: the window over which a body must move at
    `min_rate_bytes_s` before it takes a slot, seconds (> 0)."""

    timeout_s: float
    min_rate_bytes_s: float
    idle_s: float
    window_s: float

    @property
    def window_bytes(self) -> int:
        """Bytes that make a body moving: `min_rate_bytes_s x window_s`, rounded up, at least 1."""
        return max(1, math.ceil(self.min_rate_bytes_s * self.window_s))

    def moving(self, arrivals: Sequence[tuple[float, int]], ended: bool) -> bool:
        """Whether a body counts against its tier's slots yet. Pure. `arrivals`: (time, bytes
        received so far), oldest first, any one clock in seconds: the body's start with 0 bytes, then
        one sample after each chunk; `ended`: the whole body arrived. True when the body ended, or
        when the newest sample is `window_bytes` past the earliest sample at most `window_s` before
        it. The caller asks after every chunk, so every span is judged once, and may drop the
        samples more than `window_s` older than the newest (the work stays constant per chunk)."""
        if ended:
            return True
        if not arrivals:
            return False
        newest_at, received = arrivals[-1]
        base = next(count for at, count in arrivals if at >= newest_at - self.window_s)
        return received - base >= self.window_bytes

    def read_deadline(self, started: float, last_chunk_at: float, received: int) -> float:
        """The time (same clock as the arguments, seconds) by which the next chunk must have arrived,
        given the body `started` at, its last chunk arrived at `last_chunk_at` (`started` before the
        first) and `received` bytes so far. Pure."""
        return min(last_chunk_at + self.idle_s, started + self.timeout_s + received / self.min_rate_bytes_s)

    def explain(self, received: int, elapsed_s: float) -> str:
        """Why a body was cut off, for the 408 answer: what came and what the rule asks."""
        return (f"the request body is too slow: {received} bytes in {elapsed_s:.1f} s; send at least "
                f"{self.min_rate_bytes_s:.0f} bytes/s after the first {self.timeout_s:g} s, with no pause "
                f"over {self.idle_s:g} s")
