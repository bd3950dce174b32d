"""Reading our own MPEG-TS segment files from their packets, without decoding: which streams, how
many frames, and their first and last timestamps (`scan_ts`, pure). Every segment we write has
timestamps of source time + `PTS_ORIGIN_S` (`processors/segments.py` sets `-output_ts_offset`), so a
scan tells a segment's source-time start and duration.
"""

from __future__ import annotations

from dataclasses import dataclass

from domain.errors import TranscodeFailed

TS_OFFSET_S = 10.0
"""`-output_ts_offset`: output timestamps are source time + 10 s (+ the MPEG-TS muxer's own delay)."""
MPEGTS_DELAY_S = 1.4
"""The MPEG-TS muxer adds 2 x its default `max_delay` (0.7 s) to every timestamp."""
PTS_ORIGIN_S = TS_OFFSET_S + MPEGTS_DELAY_S
"""PTS (seconds) of source time 0 in every segment we write."""
ADTS_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350, 0, 0, 0)
"""AAC sampling frequencies by ADTS `sampling_frequency_index`, Hz."""
H264, AAC = 0x1B, 0x0F
"""MPEG-TS stream types of our outputs."""


@dataclass(frozen=True)
class TsScan:
    """What one of our MPEG-TS files holds, read from its packets (no decoding).

    `stream_types`: PMT stream types (0x1B H.264, 0x0F AAC); `frames`: video access units (one PES
    each) or AAC frames (ADTS headers) of the first stream; `first_pts`/`last_pts`: 90 kHz ticks;
    `frame_ticks`: one frame's duration in 90 kHz ticks (video: the most common distance between
    consecutive frame timestamps; AAC: 1024 samples at the ADTS header's sampling rate).
    """

    stream_types: tuple[int, ...]
    frames: int
    first_pts: int | None
    last_pts: int | None
    frame_ticks: int = 0

    def start_s(self) -> float:
        """Source time (s) of the first frame."""
        return (self.first_pts or 0) / 90000 - PTS_ORIGIN_S

    def duration_s(self) -> float:
        """Seconds from the first frame's timestamp to the end of the last frame."""
        if self.first_pts is None or self.last_pts is None:
            return 0.0
        return (self.last_pts - self.first_pts + self.frame_ticks) / 90000


def _pes_pts(payload: bytes) -> int | None:
    if len(payload) < 14 or payload[:3] != b"\x00\x00\x01" or not payload[7] & 0x80:
        return None
    p = payload[9:14]
    return ((p[0] >> 1) & 0x07) << 30 | p[1] << 22 | (p[2] >> 1) << 15 | p[3] << 7 | p[4] >> 1


def scan_ts(data: bytes) -> TsScan:
    """Parse MPEG-TS bytes (188-byte packets): the PMT's streams, and for the first elementary
    stream every PES start (its PTS) and, for AAC, every ADTS frame. Pure.

    Raises `TranscodeFailed` when the bytes are not MPEG-TS (no sync byte) or hold no PMT.
    """
    if len(data) < 188 or data[0] != 0x47:
        raise TranscodeFailed("segment is not MPEG-TS (no sync byte)")
    pmt_pid, streams = None, []
    pes: dict[int, list[bytearray]] = {}
    for offset in range(0, len(data) - 187, 188):
        packet = data[offset:offset + 188]
        if packet[0] != 0x47:
            raise TranscodeFailed(f"segment has no sync byte at {offset}")
        pid = (packet[1] & 0x1F) << 8 | packet[2]
        start = bool(packet[1] & 0x40)
        afc = (packet[3] >> 4) & 0x3
        if not afc & 0x1:
            continue
        body = packet[5 + packet[4]:] if afc == 0x3 else packet[4:]
        if pid == 0 and start:
            section = body[1 + body[0]:]
            pmt_pid = (section[10] & 0x1F) << 8 | section[11]
        elif pid == pmt_pid and start and not streams:
            section = body[1 + body[0]:]
            length = (section[1] & 0x0F) << 8 | section[2]
            info = (section[10] & 0x0F) << 8 | section[11]
            at, end = 12 + info, 3 + length - 4
            while at + 5 <= end:
                streams.append((section[at], (section[at + 1] & 0x1F) << 8 | section[at + 2]))
                at += 5 + ((section[at + 3] & 0x0F) << 8 | section[at + 4])
        elif streams and pid == streams[0][1]:
            if start:
                pes.setdefault(pid, []).append(bytearray(body))
            elif pes.get(pid):
                pes[pid][-1] += body
    if not streams:
        raise TranscodeFailed("segment has no program map (no streams)")
    stream_type, pid = streams[0]
    units = pes.get(pid, [])
    ordered = sorted(s for s in (_pes_pts(bytes(u[:14])) for u in units) if s is not None)
    frames, ticks = len(units), 0
    last = ordered[-1] if ordered else None
    if stream_type == AAC:  # several ADTS frames per PES: count them; the last PES ends after all of its own
        frames, rate, in_unit = 0, 0, 0
        for unit in units:
            at, in_unit = (9 + unit[8] if len(unit) > 9 else len(unit)), 0
            while at + 7 <= len(unit) and unit[at] == 0xFF and unit[at + 1] & 0xF0 == 0xF0:
                rate = rate or ADTS_RATES[(unit[at + 2] >> 2) & 0x0F]
                in_unit += 1
                at += max(7, (unit[at + 3] & 0x03) << 11 | unit[at + 4] << 3 | unit[at + 5] >> 5)
            frames += in_unit
        ticks = round(1024 * 90000 / rate) if rate else 1920
        last_stamp = _pes_pts(bytes(units[-1][:14])) if units else None
        if last_stamp is not None and in_unit:
            last = last_stamp + (in_unit - 1) * ticks  # the last frame's timestamp
    else:
        gaps = [b - a for a, b in zip(ordered, ordered[1:]) if b > a]
        ticks = max(set(gaps), key=gaps.count) if gaps else 3600
    return TsScan(tuple(t for t, _ in streams), frames, ordered[0] if ordered else None, last, ticks)
