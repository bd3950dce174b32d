"""The HTTP intake's claims: an admitted upload's `intake_uploads` row, held as a lease.

Idempotency: a request with an `Idempotency-Key` gets upload id `uuid5(IDEMPOTENCY_NAMESPACE,
submitter + key)` (`upload_id_for_key`), so its job id is fixed by the key.

Claims are leases: while a request runs, the process's `ClaimKeeper` renews its row every third
of `intake_claim_lease_s` (30 s). An intake killed mid-upload leaves a row in `uploading` that
nobody renews; once the lease has passed it no longer counts against any capacity, a request with
its key is admitted again (same upload id, so the same job id) and admission deletes it. The
claim's identity is its `created_at`: the dead intake's row can only be released or renewed by its
own claim, a request whose claim lapsed does not publish (it renews once more right before, and
gives up when the row is gone), and each claim stores its body under its own object key.
Published rows answer their key for `intake_key_retention_s` (a day), then admission deletes them;
the key still maps to the same upload id, so a later retry is the same job to the pipeline.

Claims are made, renewed once more before the publish, and released by
`producers/intake_service.py` `IntakeService`; the route is `producers/http_intake.py`.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog

from tapeline.postgres import session_options, q
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.http_intake")
IDEMPOTENCY_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "tapeline:intake:idempotency-key")
"""Namespace of the upload ids derived from (submitter, Idempotency-Key)."""


def upload_id_for_key(submitter: str, key: str) -> str:
    """The upload id of (submitter, Idempotency-Key): the same pair always names the same upload."""
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{submitter}\x00{key}"))


@dataclass
class Claim:
    """An admitted upload's `intake_uploads` row: its upload id and `created_at` (the claim's
    identity: a row deleted after it lapsed and claimed again has another). `lost` is set by the
    `ClaimKeeper` when a renewal finds the row gone."""

    upload_id: str
    claimed_at: Any  # datetime, as PostgreSQL returned it (compared exactly)
    keyed: bool = False  # made for an Idempotency-Key (its upload id is derived from the key)
    lost: bool = False

    @property
    def object_key_prefix(self) -> str:
        """`uploads/{upload_id}/{claim}/`: the claim's own place for its source object (`claim` is
        `created_at` in microseconds since the epoch), so a later claim of the same key (after this
        one lapsed, or after the key's retention) never overwrites a source a job was made from."""
        return f"uploads/{self.upload_id}/{round(self.claimed_at.timestamp() * 1_000_000)}/"


class ClaimKeeper:
    """Renews every live claim of one intake process in ONE `UPDATE` every third of
    `intake_claim_lease_s`, on its own thread and its own connection: never queued behind the
    uploads, which hold the request threads for their whole duration (with them, renewals starved
    once ~64 uploads were in flight and healthy claims lapsed). A claim whose row is gone (it
    lapsed and was deleted or taken over) gets `lost`. A failed renewal (the database down) is
    logged and retried at the next tick: a claim lapses only after a whole lease without one.
    `start()` once, `add`/`discard` per upload, `stop()` at shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.claims: dict[tuple[str, Any], Claim] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="intake-claim-keeper", daemon=True)
        self._conn: psycopg.Connection | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def add(self, claim: Claim) -> None:
        with self._lock:
            self.claims[(claim.upload_id, claim.claimed_at)] = claim

    def discard(self, claim: Claim) -> None:
        with self._lock:
            self.claims.pop((claim.upload_id, claim.claimed_at), None)

    def _run(self) -> None:
        interval = self.settings.intake_claim_lease_s / 3
        while not self._stop.wait(interval):
            try:
                self.renew_all()
            except psycopg.Error as exc:
                log.warning("upload claims not renewed", claims=len(self.claims), error=str(exc))
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
        if self._conn is not None:
            self._conn.close()

    def renew_all(self) -> None:
        """Renew every claim held now; mark those whose row is gone `lost` and forget them."""
        with self._lock:
            held = list(self.claims.values())
        if not held:
            return
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.settings.database_url, autocommit=True, connect_timeout=10,
                                         options=session_options(self.settings.db_schema))
        alive = {(row[0], row[1]) for row in self._conn.execute(q("intake_uploads_renew"), {
            "upload_ids": [c.upload_id for c in held], "claimed_ats": [c.claimed_at for c in held]})}
        for claim in held:
            if (claim.upload_id, claim.claimed_at) in alive:
                continue
            with self._lock:  # a claim discarded meanwhile was published or released: not lost
                still_held = self.claims.pop((claim.upload_id, claim.claimed_at), None) is not None
            if still_held:
                claim.lost = True
                log.warning("upload claim lost (it lapsed and its row is gone)", upload_id=claim.upload_id)
