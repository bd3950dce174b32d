"""Ports of the web layer: what `projections/api.py` asks of the rest, as small Protocols.

The API never imports the processors or the producers; `cli/wiring.py` builds the adapters
(`processors/operator.py` behind `OperatorActions`, `producers/http_intake.py` behind `Intake`) and
passes them to `create_app`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from fastapi import APIRouter


class ReplayOutcome(Protocol):
    """One dead letter's replay: the job it reopened (None for none), whether it took effect now,
    the next attempt it queued, and a sentence for the operator."""

    job_id: str | None
    replayed: bool
    next_attempt: int | None
    detail: str


class FailOutcome(Protocol):
    """One dead letter's `dlq fail`: the job, whether it was failed now (and refunded), and a sentence."""

    job_id: str | None
    failed: bool
    refunded: bool
    detail: str


class DismissOutcome(Protocol):
    """One dead letter's dismissal: whether it was dismissed now, and a sentence."""

    dead_letter_id: str
    dismissed: bool
    detail: str


class OperatorActions(Protocol):
    """Operator actions; each emits events and never writes a projection.

    Refusals are `domain.errors.NotReplayable` (replay, resolve, dismissing a job's dead letter) and
    `NotCancellable` (cancel); `NoSuchDeadLetter` for an unknown dead letter id.
    """

    def replay_dead_letters(self, ids: Sequence[str], operator: str, reason: str) -> list[ReplayOutcome]: ...

    def fail_dead_letters(self, ids: Sequence[str], operator: str, reason: str, refund: bool) -> list[FailOutcome]: ...

    def dismiss_dead_letters(self, ids: Sequence[str], operator: str, reason: str) -> list[DismissOutcome]: ...

    def cancel_job(self, job_id: str, operator: str, reason: str) -> str: ...

    def resolve_review(self, job_id: str, operator: str, reason: str, posted_ref: str | None) -> str: ...


class WebhookEndpoints(Protocol):
    """A submitter's webhook endpoints (`webhook_endpoints`, written as the login role). Refusals are
    `domain.errors.WebhookRefused`; the secret is returned by `register` only."""

    def register(self, submitter: str, url: str, event_types: Sequence[str], secret: str | None) -> dict: ...

    def endpoints(self, submitter: str | None) -> list[dict]: ...

    def set_enabled(self, endpoint_id: str, enabled: bool, reason: str | None) -> bool: ...

    def remove(self, endpoint_id: str) -> bool: ...


class Intake(Protocol):
    """The HTTP intake (`POST /uploads`): a router, opened with the app and closed with it."""

    router: APIRouter

    def fenced(self) -> dict[str, Any] | None:
        """The JSON problem body every upload gets while this region is fenced (`error`
        `region_fenced`, `reason`, `active_region`, `upload_to`, ...), else None. Blocking: it may read
        the region epochs (at most once per `region_check_interval_s`)."""
        ...

    def open(self) -> None: ...

    def close(self) -> None: ...
