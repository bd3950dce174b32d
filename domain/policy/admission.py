"""The HTTP intake's admission: whether one more upload may be stored, decided by pure functions.

`admission` runs before a byte is stored (the rules, in order; the counts are read by the caller
in one PostgreSQL transaction under an advisory lock, so concurrent requests are counted exactly):

1. storage guard: the bucket's bytes at or past `storage_limit_bytes` -> 507 `storage_full`;
2. the tier's load (waiting + running, plus uploads admitted that the projection does not know
   yet) at or past `intake_tier_capacity[tier]` -> 503 `overloaded`;
3. the submitter's share of the tier: its own load in the tier (its jobs of the tier waiting or
   running, plus its admitted uploads of the tier the projection does not know yet) at or past
   `tier_share_cap` (`intake_submitter_tier_share` of the tier's capacity, at least 1) -> 429
   `tier_share`, so one submitter cannot hold a whole tier (issue 44 item 3: 50 trickling index
   uploads from one token kept every other submitter's index uploads at 503);
4. the reserve for higher tiers: the load of every tier together at or past
   `intake_total_capacity - rank x intake_tier_reserve` (rank: archive 0, standard 1, index 2), so
   index is refused first and archive last -> 503 `overloaded`;
5. the submitter's jobs in flight (accepted and not ended, plus admitted uploads not yet decided)
   at or past `intake_max_in_flight_per_submitter` -> 429 `in_flight_cap`.

`Retry-After` (`retry_after`, whole seconds) is the time the recent completion rate needs to end
the jobs over the limit, clamped to [`intake_retry_after_min_s`, `intake_retry_after_max_s`]; with
no recent completion it is the maximum.

Also pure here: `check_request` (the request's parameters, before anything else),
`starting_refusal` (how many of a submitter's bodies may be read before they are moving, held
without a slot but with what they have read in memory) and the Idempotency-Key checks of a request under a key already used (`key_reuse`, `body_reuse`).

The I/O side is `producers/intake_service.py` `IntakeService.admit` (the counts, the claim) and
`producers/http_intake.py` (the answers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from domain.policy.tiers import TIERS

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""A profile or file name: used with `fullmatch` only."""


class AdmissionSettings(Protocol):
    """The settings admission reads (`tapeline.settings.Settings` has them): byte limits, job
    counts per tier and in total, the per-tier reserve (jobs), the submitter cap (jobs), and the
    Retry-After bounds (seconds)."""

    max_upload_bytes: int
    storage_limit_bytes: int | None
    intake_tier_capacity: Mapping[str, int]
    intake_total_capacity: int
    intake_tier_reserve: int
    intake_max_in_flight_per_submitter: int | None
    intake_submitter_tier_share: float
    intake_max_starting_per_submitter: int
    intake_retry_after_min_s: float
    intake_retry_after_max_s: float


class Load(Protocol):
    """One tier's load (`projections.read_model.TierBacklog`): `backlog` (jobs waiting + running),
    `completed_recently` (jobs ended in the last `window_s` seconds)."""

    @property
    def backlog(self) -> int: ...

    @property
    def completed_recently(self) -> int: ...

    @property
    def window_s(self) -> float: ...


@dataclass(frozen=True)
class Refusal:
    """An upload refused before anything was stored: HTTP `status`, `error` class, `reason` for a
    person, and `retry_after_s` (whole seconds, None when retrying later does not help)."""

    status: int
    error: str
    reason: str
    retry_after_s: int | None = None
    details: tuple[tuple[str, Any], ...] = ()
    """Further fields of the JSON answer as `(name, value)` pairs (e.g. `region_fenced`'s
    `active_region` and `upload_to`, `domain/regions.py` `intake_refusal`); none for most refusals."""

    def body(self) -> dict[str, Any]:
        """The JSON answer: `{error, reason, retry_after_s}` and the `details` fields."""
        return {"error": self.error, "reason": self.reason, "retry_after_s": self.retry_after_s, **dict(self.details)}

    def headers(self) -> dict[str, str]:
        """`Retry-After` when retrying later helps, else none."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def retry_after(excess: int, completed_recently: int, window_s: float, settings: AdmissionSettings) -> int:
    """Seconds until `excess` jobs end at the recent rate (`completed_recently` per `window_s`),
    rounded up and clamped to [intake_retry_after_min_s, intake_retry_after_max_s]; the maximum when
    nothing completed recently. Pure."""
    low, high = settings.intake_retry_after_min_s, settings.intake_retry_after_max_s
    estimate = high if completed_recently <= 0 else max(1, excess) * window_s / completed_recently
    return math.ceil(min(high, max(low, estimate)))


def tier_share_cap(tier: str, settings: AdmissionSettings) -> int:
    """How many of `tier`'s slots one submitter may hold: `intake_submitter_tier_share` (a
    fraction in (0, 1]) of the tier's capacity (`intake_tier_capacity[tier]`, else the total
    capacity less the tier's reserve), rounded up, at least 1. Pure."""
    capacity = settings.intake_tier_capacity.get(tier)
    if capacity is None:
        capacity = settings.intake_total_capacity - TIERS.index(tier) * settings.intake_tier_reserve
    return max(1, math.ceil(capacity * settings.intake_submitter_tier_share))


def admission(tier: str, backlog: Mapping[str, Load], pending: Mapping[str, int], in_flight: int,
              storage_bytes: int | None, submitter: str, settings: AdmissionSettings,
              held_in_tier: int = 0) -> Refusal | None:
    """Whether one more upload of `tier` from `submitter` may be stored: None, or the `Refusal`.
    Pure. `backlog`: per tier, its load (`tier_backlog` rows); `pending`: per tier, admitted uploads
    the projection does not know yet; `in_flight`: the submitter's jobs not ended (pending
    included); `storage_bytes`: the bucket's measured size (None: not measured); `held_in_tier`: the
    submitter's own load in `tier` (its jobs of the tier not ended plus its pending uploads of the
    tier). The rules are the module docstring's. No clock: every count is taken at the caller's
    `now`. The caller asks only for a body that is already moving (`BodyRate.moving`), so a body
    that never starts holds no slot."""
    limit = settings.storage_limit_bytes
    if limit is not None and storage_bytes is not None and storage_bytes >= limit:
        return Refusal(507, "storage_full", f"object storage holds {storage_bytes} bytes, at or past its limit "
                                            f"storage_limit_bytes = {limit}; new uploads are refused until cleanup "
                                            f"frees space")
    load = {t: backlog[t].backlog + pending.get(t, 0) for t in TIERS}
    done = {t: backlog[t].completed_recently for t in TIERS}
    window = backlog[tier].window_s
    capacity = settings.intake_tier_capacity.get(tier)
    if capacity is not None and load[tier] >= capacity:
        wait = retry_after(load[tier] - capacity + 1, done[tier], window, settings)
        return Refusal(503, "overloaded", f"tier {tier!r} has {load[tier]} jobs waiting or running, at or past its "
                                          f"capacity {capacity}; retry in {wait} s", wait)
    share = tier_share_cap(tier, settings)
    if held_in_tier >= share:
        wait = retry_after(held_in_tier - share + 1, done[tier], window, settings)
        return Refusal(429, "tier_share", f"submitter {submitter!r} holds {held_in_tier} of tier {tier!r}'s slots, at "
                                          f"or past its share {share} (intake_submitter_tier_share = "
                                          f"{settings.intake_submitter_tier_share:g} of the tier); retry in {wait} s",
                       wait)
    total = sum(load.values())
    ceiling = settings.intake_total_capacity - TIERS.index(tier) * settings.intake_tier_reserve
    if total >= ceiling:
        wait = retry_after(total - ceiling + 1, sum(done.values()), window, settings)
        return Refusal(503, "overloaded", f"{total} jobs waiting or running in every tier, at or past the {ceiling} "
                                          f"that tier {tier!r} may use (higher tiers keep a reserve); retry in "
                                          f"{wait} s", wait)
    cap = settings.intake_max_in_flight_per_submitter
    if cap is not None and in_flight >= cap:
        wait = retry_after(in_flight - cap + 1, sum(done.values()), window, settings)
        return Refusal(429, "in_flight_cap", f"submitter {submitter!r} has {in_flight} jobs in flight, at or past "
                                             f"its cap {cap}; retry in {wait} s", wait)
    return None


def starting_refusal(submitter: str, starting: int, settings: AdmissionSettings) -> Refusal | None:
    """Whether one more body of `submitter` may be read before admission, with `starting` of its
    bodies already read in this process and not yet moving (`BodyRate.moving`): None, or 429
    `too_many_starting` (Retry-After `intake_retry_after_min_s`: they move or end within the body
    timeout) at or past `intake_max_starting_per_submitter`. Pure. Such a body holds no slot, but it
    holds what it has read (at most `BodyRate.window_bytes` plus one read), so it is counted too."""
    cap = settings.intake_max_starting_per_submitter
    if starting >= cap:
        wait = math.ceil(settings.intake_retry_after_min_s)
        return Refusal(429, "too_many_starting", f"submitter {submitter!r} has {starting} uploads whose bodies have "
                                                 f"not got moving yet, at or past intake_max_starting_per_submitter = "
                                                 f"{cap}; send faster or fewer at once, retry in {wait} s", wait)
    return None


def check_request(priority: str, profile: str, filename: str, content_length: str | None, key: str | None,
                  settings: AdmissionSettings) -> Refusal | None:
    """What is wrong with a `POST /uploads` judged by its parameters alone, or None. Pure. In order:
    an unknown `priority` tier, a `profile` or `filename` that is not 1-128 characters of
    `A-Z a-z 0-9 . _ -` (or is `.` or `..`) -> 422; a `Content-Length` (the header's text, None when
    absent) over `max_upload_bytes` -> 413; an Idempotency-Key (`key`) not 1-255 characters -> 422."""
    if priority not in TIERS:
        return Refusal(422, "invalid_request", f"unknown priority {priority!r}; choose one of {', '.join(TIERS)}")
    for name, value in (("profile", profile), ("filename", filename)):
        if not NAME.fullmatch(value) or value in (".", ".."):  # match + `$` let "a.mp4\n" through
            return Refusal(422, "invalid_request", f"{name} {value!r}: 1-128 characters of A-Z a-z 0-9 . _ -")
    if content_length is not None and content_length.isdigit() and int(content_length) > settings.max_upload_bytes:
        return Refusal(413, "limits_exceeded", f"{content_length} bytes exceeds max_upload_bytes = "
                                               f"{settings.max_upload_bytes}")
    if key is not None and not 1 <= len(key) <= 255:
        return Refusal(422, "invalid_request", "Idempotency-Key must be 1-255 characters")
    return None


def key_reuse(first: Mapping[str, Any], priority: str, profile: str, filename: str) -> Refusal | None:
    """A request under an Idempotency-Key whose `first` request (its `intake_uploads` row) had other
    parameters: 422 `idempotency_key_reused`; the same ones: None. Pure."""
    if (first["priority"], first["profile"], first["filename"]) != (priority, profile, filename):
        return Refusal(422, "idempotency_key_reused",
                       f"Idempotency-Key already used with priority={first['priority']}, profile={first['profile']}, "
                       f"filename={first['filename']}; a key names one request")
    return None


def body_reuse(first_sha256: str, first_size: int, sha256: str, size: int) -> Refusal | None:
    """A request under an Idempotency-Key whose first upload had another body (hex sha256, bytes):
    422 `idempotency_key_reused`; the same body: None. Pure."""
    if (first_sha256, first_size) != (sha256, size):
        return Refusal(422, "idempotency_key_reused", "Idempotency-Key already used with a different body "
                                                      f"(sha256 {first_sha256[:12]}..., {first_size} "
                                                      f"bytes); a key names one upload")
    return None
