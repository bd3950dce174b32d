"""Publish: make a job's outputs public at the origin, announce them to the configured provider,
and record `Published` + `JobCompleted` (docs/design.md "Side effects").

Protocol for one publish attempt (reconcile, then act):
  Step 1. `PublishIntended` (origin) in a transaction on the attempt's fenced producer;
  Step 2. the origin: promote exactly the objects the transcode attempt named to `published/{job}/`
          with conditional writes (idempotent by nature: a repeat finds identical bytes), checking
          before each object, before the master playlist and after the last one that the attempt
          still owns the job (`Attempt.check_still_owner`: a cancel or another ending stops it);
  Step 3. with a webhook provider: `PublishIntended(webhook)`, then a claim marker
          `markers/{job}/webhook.json` created with `If-None-Match: *`, holding this attempt's
          claim token;
  Step 4. if the marker already existed (an earlier attempt got this far and then crashed, hung or
          failed), or the log shows an earlier attempt that recorded `PublishIntended` for this
          provider and was lost with its region (a `region_lost` stall: its marker is in the lost
          region's store, docs/regions.md), look the post up by its idempotency key first: found ->
          use it, post nothing;
          not found -> post only if the provider dedupes by idempotency key, otherwise stop with
          `NeedsReview` (the earlier attempt's post may be in flight; never post blindly); a lookup
          that cannot be answered -> `NeedsReview` too;
  Step 5. right before the call, prove ownership: a heartbeat transaction on the fenced producer
          and a projection check (a zombie that wakes up here is fenced and stops);
  Step 6. call the provider with idempotency key = the job's publish dedup key;
  Step 7. `AttemptSucceeded` + `Published` (origin, and the webhook's `provider_ref`) + `JobCompleted`
          in one transaction;
  Step 8. whatever the attempt's end (completed, failed, fenced by a cancel, its completion
          superseded by a cancel committed first), once the projection has caught up: when the job
          ended otherwise than completed, withdraw what is under `published/{job}/` and record
          `OutputsWithdrawn` (`processors/withdraw.py`, rule `domain/policy/withdrawal.py`). The
          operator's cancel withdraws too, once its `JobCancelled` is projected; this step removes
          what the attempt wrote after that (the object it was writing when the cancel landed).
Crash points `publish.*` mark each side-effect boundary (tests only, `tapeline.crashpoints`).
A 429 from the provider (refused before processing, RFC 6585) releases the marker so the retry
starts clean; any other failure keeps it, and the successor reconciles as in step 4.
Steps 3-6 run inside the provider's limits (`processors/provider_guard.py`): an in-flight slot, then
admission by its circuit breaker and quotas, which may defer the attempt (`PublishDeferred`) before
step 3; the call's outcome then feeds the breaker.
"""

from __future__ import annotations

import json
import time

import structlog

from processors.providers import (OriginProvider, promotable, ProviderLimits, ProviderPost, PublishRequest, WebhookProvider,
                                  published_prefix)
from processors.provider_guard import ProviderGuard, deferred_event
from processors.runtime import Outgoing
from processors.worker import Attempt, StageWorker
from domain import events as ev
from processors.withdraw import withdraw, withdrawn_event
from tapeline.crashpoints import crash_point, delay_point, fail_point
from domain.errors import Fenced, ProviderDeferred, ProviderError, ProviderLookupFailed, ServiceUnavailable, StorageError
from tapeline.ports import EventLogError, ObjectStorage

log = structlog.get_logger("tapeline.publish")
PROVIDER = "origin"


def idempotency_key(job_id: str, provider: str) -> str:
    """The job's publish dedup key for `provider`: the idempotency key of its one post there."""
    return ev.dedup_key(job_id, "publish", 0, "Published", None if provider == PROVIDER else provider)


def marker_key(job_id: str, provider: str) -> str:
    """The object-store key of the job's claim marker for `provider` (never under `published/`)."""
    return f"markers/{job_id}/{provider}.json"


class NeedsReviewStop(Exception):
    """Publishing cannot be proven safe: the job goes to needs_review with this reason."""


class PublishWorker(StageWorker):
    """Claims publish work items and makes their outputs public."""

    stage = "publish"

    def work(self, attempt: Attempt, store: ObjectStorage) -> list[Outgoing]:
        item, identity, jobs = attempt.item, attempt.identity, self.settings.jobs_topic
        started = time.monotonic()
        origin = OriginProvider(store)
        # Step 1
        attempt.record([(jobs, attempt.event(ev.PublishIntended, provider=PROVIDER,
                                           idempotency_key=idempotency_key(identity.job_id, PROVIDER)))])
        # Step 2
        crash_point("publish.before_promote")
        delay_point("publish.before_promote")
        request = PublishRequest(job_id=identity.job_id, outputs=promotable(item.inputs), renditions=list(item.renditions),
                                 audio_playlist_key=item.audio_playlist_key, media_duration_s=item.media_duration_s or 0.0)
        # Objects promoted count as the attempt's progress (frames_done/frames_total of its heartbeats).
        # Before each object the attempt checks it still owns the job: a cancel stops the promotion.
        def promoting(done: int, total: int) -> None:
            delay_point("publish.promote.object")
            attempt.heartbeat(done, 0.0, None, total, point="publish.promote.Heartbeat")
            attempt.check_still_owner()

        post = origin.publish(request, idempotency_key(identity.job_id, PROVIDER), on_progress=promoting)
        crash_point("publish.after_promote")
        delay_point("publish.after_promote")
        fail_point("publish.after_promote")
        attempt.check_still_owner()  # cancelled while the last object was written: no Published, Step 8 withdraws
        out: list[Outgoing] = [
            (jobs, attempt.event(ev.Published, provider=PROVIDER, provider_ref=post.provider_ref,
                                 master_key=post.provider_ref, master_url=post.url, renditions=list(post.renditions)))]
        webhook = WebhookProvider.from_settings(self.settings)
        if webhook is not None:
            try:
                announced = self.announce(attempt, store, webhook, request, post)  # Steps 3-6
            except NeedsReviewStop as stop:
                log.warning("publish needs review", job_id=identity.job_id, reason=str(stop))
                return out + [(jobs, attempt.event(ev.NeedsReview, reason=str(stop)))]
            except ProviderDeferred as deferral:  # the provider was not called: a wait, not a used attempt
                log.info("publish deferred", job_id=identity.job_id, provider=deferral.provider, wait=deferral.wait,
                         until=deferral.until.isoformat())
                attempt.uncounted += 1
                return [(jobs, deferred_event(attempt.event, deferral))] + self.failure_events(
                    attempt, deferral.error_class, str(deferral), cooldown_s=deferral.retry_after_s)
            out.append((jobs, attempt.event(ev.Published, sequence=webhook.name, provider=webhook.name,
                                            provider_ref=announced.provider_ref, master_key=post.provider_ref,
                                            master_url=post.url, renditions=list(post.renditions))))
        log.info("published", job_id=identity.job_id, master_url=post.url, objects=len(post.outputs))
        # Step 7
        audio_key = published_prefix(identity.job_id) + "audio/index.m3u8" if item.audio_playlist_key else None
        return [(jobs, attempt.event(ev.AttemptSucceeded, outputs=list(post.outputs), renditions=list(post.renditions),
                                     audio_playlist_key=audio_key, media_duration_s=item.media_duration_s,
                                     elapsed_s=time.monotonic() - started))] + out + [
            (jobs, attempt.event(ev.JobCompleted, master_url=post.url, media_duration_s=item.media_duration_s))]

    def execute(self, attempt: Attempt, store: ObjectStorage) -> None:
        """Steps 1-7 (`StageWorker.execute`: `work` and its outcome committed), then Step 8."""
        try:
            super().execute(attempt, store)
        finally:
            self.withdraw_if_ended(attempt, store)

    def withdraw_if_ended(self, attempt: Attempt, store: ObjectStorage) -> None:
        """Step 8: once the projection has caught up with the job's partition, withdraw its
        published outputs if it ended otherwise than completed, and record `OutputsWithdrawn` on the
        attempt's writer (evidence: the job has ended). Logs, never raises, when the projection, the
        bucket or the log cannot answer: the operator's own withdrawal has run or runs."""
        identity = attempt.identity
        try:
            row = attempt.runtime.job_row(identity.job_id)
            plan = withdraw(store, identity.job_id, row["state"] if row else None)
            log.info("published outputs checked after the attempt", job_id=identity.job_id, attempt=identity.attempt,
                     state=row["state"] if row else None, withdrawn=len(plan.keys))
            if plan:
                attempt.record([(self.settings.jobs_topic, withdrawn_event(
                    row, plan, f"publish attempt {identity.attempt}", attempt.runtime.recorded_by, clock=self.clock,
                    claim_token=identity.claim_token))], retry_for_s=30.0)
        except (ServiceUnavailable, StorageError, EventLogError, Fenced) as exc:
            log.warning("could not check or withdraw published outputs after the attempt", job_id=identity.job_id,
                        error=str(exc))

    def announce(self, attempt: Attempt, store: ObjectStorage, provider: WebhookProvider, request: PublishRequest,
                 origin_post: ProviderPost) -> ProviderPost:
        """Steps 3-6 for one non-origin provider, inside its limits; returns its post. Raises
        `NeedsReviewStop`, `ProviderDeferred` (an in-flight slot, its quota or its breaker: nothing
        claimed or posted, retried at the deferral's end without using an attempt), `ProviderError`
        (the provider failed; retried at the end of the breaker's cooldown) or `Fenced` (stop,
        commit nothing)."""
        identity = attempt.identity
        key = idempotency_key(identity.job_id, provider.name)
        jobs = self.settings.jobs_topic
        guard = ProviderGuard(attempt.runtime.jobs, provider.name, self.settings, identity.job_id,
                              record=lambda events: attempt.record([(jobs, e) for e in events]), make_event=attempt.event, clock=self.clock)
        # The provider's own limits before any claim: an in-flight slot, then its breaker and quotas
        # (processors/provider_guard.py); a full one raises ProviderDeferred, nothing claimed or posted.
        with ProviderLimits(attempt.runtime.jobs, provider.name, self.settings.webhook_max_in_flight, clock=self.clock):
            ticket = guard.admit(identity.attempt, identity.claim_token)
            try:
                post = self._announce(attempt, store, provider, request, origin_post, key)
            except ProviderError as exc:
                guard.failed(ticket, exc)
                raise
            except BaseException:
                guard.abandoned(ticket)
                raise
            guard.succeeded(ticket)
            return post

    def _announce(self, attempt: Attempt, store: ObjectStorage, provider: WebhookProvider, request: PublishRequest,
                  origin_post: ProviderPost, key: str) -> ProviderPost:
        identity, jobs = attempt.identity, self.settings.jobs_topic
        # Step 3
        attempt.record([(jobs, attempt.event(ev.PublishIntended, sequence=provider.name, provider=provider.name,
                                           idempotency_key=key))])
        marker = marker_key(identity.job_id, provider.name)
        crash_point("publish.before_marker")
        mine = json.dumps({"claim_token": identity.claim_token, "attempt": identity.attempt}).encode()
        existing = store.create_exclusive(marker, mine)
        crash_point("publish.after_marker")
        # Step 4 (the marker, or the log where the marker cannot tell: an earlier attempt that stated its
        # intent and was lost with its region in a failover; its marker is in that region's store)
        lost = None if existing is not None and existing != mine else attempt.runtime.jobs.one(
            "earlier_intent_lost_with_region", {"job_id": identity.job_id, "attempt": identity.attempt, "provider": provider.name})
        if (existing is not None and existing != mine) or lost is not None:
            holder = json.loads(existing or b"{}") if lost is None else {"attempt": lost["attempt"]}
            try:
                found = provider.lookup(key)
            except ProviderLookupFailed as exc:
                raise NeedsReviewStop(f"attempt {holder.get('attempt')} claimed the {provider.name} post and the "
                                      f"provider cannot say whether it was made ({exc}); not posting blindly") from exc
            if found is not None:
                log.info("post found at the provider; not posting again", job_id=identity.job_id,
                         provider=provider.name, provider_ref=found.provider_ref)
                return found
            if not provider.dedupes:
                raise NeedsReviewStop(f"attempt {holder.get('attempt')} claimed the {provider.name} post and "
                                      f"crashed or stopped; the provider has no post under key {key} and does not "
                                      f"dedupe, so a post in flight could be duplicated: a person must check "
                                      f"(`tapeline review resolve`)")
        # Step 5
        attempt.prove_ownership()
        # Step 6
        crash_point("publish.before_provider_call")
        try:
            post = provider.publish(PublishRequest(**{**request.__dict__, "master_url": origin_post.url,
                                                      "renditions": list(origin_post.renditions)}), key)
        except ProviderError as exc:
            if getattr(exc, "sent", True) is False:
                store.delete(marker)  # refused before processing: nothing was posted, the retry starts clean
            raise
        crash_point("publish.after_provider_call")
        return post
