"""The HTTP intake: `POST /uploads` on `tapeline serve` (issue 9).

A client streams a source as the request body; the intake streams it on to object storage
(`ObjectStore.upload_stream`: multipart above the chunk size, sha256 while streaming, never the
whole file in memory, stored as `normalised_content_type`), reads the stored object back (its size and
sha256 must be the body's, else 502 `storage_mismatch` and nothing is published), publishes the
same `UploadCompleted` as `tapeline submit`, then answers
202 `{job_id, upload_id, status_url}` with a `Location` header (the job's read-API URL).

    POST /uploads?priority=archive&profile=default&filename=clip.mp4
    Authorization: Bearer <token>          (TAPELINE_INTAKE_TOKENS maps tokens to submitter names)
    Idempotency-Key: <any string, at most 255 characters>   (optional)

A body must keep the pace of `domain/policy/body_rate.py` (`intake_body_*` settings): a client
that trickles or stops gets 408 `body_too_slow` and its slot is released. An upload is admitted
(takes a slot of its tier) only once its body is moving (`BodyRate.moving`: 128 KiB within 2 s by
default, or the whole body), and one submitter holds at most `intake_submitter_tier_share` of a
tier (429 `tier_share`) and has at most `intake_max_starting_per_submitter` bodies read before
they move (429 `too_many_starting`); a body is gathered on the event loop and only whole parts go
to a thread, so no thread waits for a client (issue 44 item 3).

A region that does not hold the job history (fenced by a failover, or the standby) refuses every
upload before its body is read: 503 `region_fenced` with `active_region`, `upload_to` (the active
region's `POST /uploads`) and `Retry-After` (docs/regions.md; the rule is `domain/regions.py`
`intake_refusal`, the cached check `regions/authority.py` `IntakeFence`, passed in as
`IntakeService.fence`).

Admission runs before a byte is stored, in one PostgreSQL transaction under an advisory lock, so
concurrent requests are counted exactly: the pure rules are `domain/policy/admission.py`
(`admission`: storage guard 507, the tier's capacity and the reserve for higher tiers 503, the
submitter's jobs in flight 429, each with `Retry-After` from the recent completion rate;
`check_request`: the parameters, 422 and 413). Every refusal is an answer given before anything was
stored. The daily quota stays with the intake processor (`JobRejected(quota_exceeded)`).

Idempotency: a request with an `Idempotency-Key` gets upload id `uuid5(IDEMPOTENCY_NAMESPACE,
submitter + key)`, so its job id is fixed by the key. Admission claims the row
`intake_uploads(submitter, key)`; a later request with the same key (even while the first is still
streaming) reads its own body through sha256 without storing it, waits for the first to finish and
answers the first's response (202, same body). Different parameters or a different body under the
key -> 422; the first request failed before publishing -> 409 (send again). Claims are leases,
renewed by a `ClaimKeeper` (`producers/intake_claims.py`).

The parts: this module is the route (`intake_router`); `producers/intake_service.py` the process's
state and its PostgreSQL and Kafka calls (`IntakeService`); `producers/intake_body.py` the request
body (streamed to storage, or hashed); `producers/intake_claims.py` the claims; the pure decisions
are `domain/policy/admission.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from domain.errors import ServiceUnavailable, StorageError
from domain.policy.admission import Refusal, body_reuse, check_request, key_reuse, starting_refusal
from producers.intake_body import BodyTooLarge, BodyTooSlow, RequestBody, hash_body, stream_to_store
from producers.intake_claims import Claim, upload_id_for_key
from producers.intake_service import IntakeService
from producers.submit import upload_completed
from tapeline.objectstore import normalised_content_type

log = structlog.get_logger("tapeline.http_intake")

__all__ = ["Claim", "IntakeService", "intake_router", "refusal_response", "upload_id_for_key"]


def refusal_response(refusal: Refusal) -> JSONResponse:
    """The HTTP answer of a `Refusal`: its status, its JSON body and its `Retry-After` header."""
    return JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers())


def _param(request: Request, name: str, default: str | None) -> str | None:
    return request.query_params.get(name) or request.headers.get(f"x-tapeline-{name}") or default


def intake_router(service: IntakeService) -> APIRouter:
    """`POST /uploads` over `service` (see the module docstring)."""
    settings = service.settings
    router = APIRouter(tags=["intake"])

    def submitter_of(request: Request) -> str | None:
        scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return None
        for token, name in settings.intake_tokens.items():
            if hmac.compare_digest(token.encode(), presented.strip().encode()):
                return name
        return None

    def accepted(response: dict[str, Any], replayed: bool = False) -> JSONResponse:
        headers = {"Location": response["status_url"]}
        if replayed:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(response, status_code=202, headers=headers)

    def problem(status: int, error: str, reason: str, retry_after_s: int | None = None) -> JSONResponse:
        return refusal_response(Refusal(status, error, reason, retry_after_s))

    async def replay(body: RequestBody, row: dict[str, Any], priority: str, profile: str, filename: str) -> Response:
        """A request under a key someone already used: the first's response, or why not."""
        reused = key_reuse(row, priority, profile, filename)
        if reused is not None:
            return refusal_response(reused)
        try:
            sha, size = await hash_body(body)
        except ClientDisconnect:
            return problem(400, "client_disconnected", "the request body ended early")
        except BodyTooSlow as exc:
            return problem(408, "body_too_slow", str(exc))
        except BodyTooLarge as exc:
            return problem(413, "limits_exceeded", str(exc))
        deadline = time.monotonic() + settings.intake_idempotency_wait_s
        while row is not None and row["state"] == "uploading" and not row["abandoned"]:
            if time.monotonic() > deadline:
                return problem(409, "idempotency_key_in_use", "the first request with this Idempotency-Key is "
                                                               "still uploading; retry later", 5)
            await asyncio.sleep(0.1)
            row = await service.call(service.row_by_key, row["submitter"], row["idempotency_key"])
        if row is None or row["abandoned"]:
            return problem(409, "idempotency_key_failed", "the first request with this Idempotency-Key failed before "
                                                           "it was published; send the upload again", 1)
        reused = body_reuse(row["sha256"], row["size_bytes"], sha, size)
        if reused is not None:
            return refusal_response(reused)
        return accepted(row["response"], replayed=True)

    @router.post("/uploads", status_code=202, responses={
        202: {"description": "Stored and published: `{job_id, upload_id, status_url}`, `Location` the status URL"},
        401: {"description": "No or unknown API token"}, 409: {"description": "Idempotency-Key's first request failed"},
        408: {"description": "The body came too slowly (intake_body_* settings); the upload's slot was released"},
        413: {"description": "Larger than max_upload_bytes"}, 422: {"description": "Bad parameters or key reuse"},
        502: {"description": "Object storage did not keep the body as sent (size or sha256 read back differ)"},
        429: {"description": "The submitter's jobs in flight are at its cap, it holds its share of the tier, "
                             "or too many of its bodies are not moving yet (Retry-After)"},
        503: {"description": "The tier is over capacity (Retry-After), a service is down, or this region is "
                             "fenced (`region_fenced`: `active_region` and `upload_to` say where to send it)"},
        507: {"description": "Object storage is at its limit"}})
    async def post_upload(request: Request) -> Response:
        """Stream the request body to object storage as a new upload and publish `UploadCompleted`.

        Query parameters (or headers `X-Tapeline-<name>`): `priority` (archive, standard, index;
        default standard), `profile` (default `default`), `filename` (default `source`).

        The source is stored with `normalised_content_type(Content-Type)` (video/audio types kept,
        anything else `application/octet-stream`) and read back before the publish: a stored size
        or sha256 other than the body's is 502 `storage_mismatch`, nothing published."""
        submitter = submitter_of(request)
        if submitter is None:
            return problem(401, "unauthorized", "an API token is required: Authorization: Bearer <token> "
                                                "(one of TAPELINE_INTAKE_TOKENS)")
        fenced = await service.call(service.fenced)  # before a byte of the body is read
        if fenced is not None:
            log.info("upload refused: region fenced", submitter=submitter, error=fenced.error, reason=fenced.reason)
            return refusal_response(fenced)
        priority = _param(request, "priority", "standard")
        profile = _param(request, "profile", "default")
        filename = _param(request, "filename", "source")
        key = request.headers.get("idempotency-key")
        invalid = check_request(priority, profile, filename, request.headers.get("content-length"), key, settings)
        if invalid is not None:
            return refusal_response(invalid)
        body = RequestBody(request, settings)
        if key is not None:
            row = await service.call(service.row_by_key, submitter, key)
            if row is not None and not (row["abandoned"] or row["expired"]):  # `admit` deletes those
                return await replay(body, row, priority, profile, filename)
        # A body takes a slot only once it is moving (domain/policy/body_rate.py): until then it holds
        # no claim, no capacity and no thread, and a body that never gets going is answered here.
        crowded = starting_refusal(submitter, service.starting[submitter], settings)
        if crowded is not None:
            log.info("upload refused", submitter=submitter, priority=priority, status=crowded.status,
                     error=crowded.error)
            return refusal_response(crowded)
        service.starting[submitter] += 1
        try:
            await body.until_moving()
        except BodyTooSlow as exc:
            log.info("upload refused: its body never got moving", submitter=submitter, reason=str(exc))
            return problem(408, "body_too_slow", str(exc))
        except BodyTooLarge as exc:
            return problem(413, "limits_exceeded", str(exc))
        except ClientDisconnect:
            return problem(400, "client_disconnected", "the request body ended early")
        finally:
            service.starting[submitter] -= 1
            if not service.starting[submitter]:
                del service.starting[submitter]
        upload_id = upload_id_for_key(submitter, key) if key is not None else str(uuid.uuid4())
        verdict = await service.call(service.admit, submitter, key, upload_id, priority, profile, filename)
        if verdict is False:  # another request with this key was admitted between our look-up and claim
            row = await service.call(service.row_by_key, submitter, key)
            if row is None:  # ... and released it again (it failed) before we looked: the key is free
                return problem(409, "idempotency_key_failed", "a request with this Idempotency-Key failed just "
                                                               "now before it was published; send the upload again", 1)
            return await replay(body, row, priority, profile, filename)
        if isinstance(verdict, Refusal):
            log.info("upload refused", submitter=submitter, priority=priority, status=verdict.status,
                     error=verdict.error, retry_after_s=verdict.retry_after_s)
            return refusal_response(verdict)
        claim: Claim = verdict
        service.keeper.add(claim)
        try:
            return await store_and_publish(request, body, claim, submitter, priority, profile, filename)
        finally:
            service.keeper.discard(claim)

    async def store_and_publish(request: Request, body: RequestBody, claim: Claim, submitter: str, priority: str,
                                profile: str, filename: str) -> Response:
        """The claimed upload: stream the body to the claim's own key, check the claim is still ours,
        publish `UploadCompleted`, record the response. Any failure before the publish releases the
        claim (its key can be sent again)."""
        upload_id = claim.upload_id
        object_key = f"{claim.object_key_prefix}{filename}"
        content_type = normalised_content_type(request.headers.get("content-type"))
        try:
            sha, size = await stream_to_store(body, object_key, content_type, settings, service.store, service.call)
            if size == 0:
                await service.call(service.store.delete, object_key)
                await service.call(service.release, claim)
                return problem(422, "invalid_input", "the body is empty; send the video's bytes")
            # The event declares what was stored, not what was sent: read the object back first.
            mismatch = await service.call(service.store.stored_mismatch, object_key, size, sha)
            if mismatch is not None:
                await service.call(service.store.delete, object_key)
                await service.call(service.release, claim)
                log.error("stored upload differs from the body sent; nothing published", upload_id=upload_id,
                          key=object_key, mismatch=mismatch)
                return problem(502, "storage_mismatch", f"object storage did not keep the upload as sent "
                                                        f"({mismatch}); nothing was published, send it again")
            # Fencing: renew the claim now; if it lapsed and its row is gone (deleted by an admission,
            # perhaps claimed again by a retry of the key), another request may own the upload: never
            # publish over it. A renewed claim cannot lapse during the publish (the keeper renews it).
            if claim.lost or not await service.call(service.renew, claim):
                raise ServiceUnavailable("this upload's claim lapsed (not renewed for intake_claim_lease_s) and "
                                         "was given up; send it again")
            # A key names one upload for good: once its row has gone (the key's retention passed, or
            # a claim lapsed after its publish), the projection's `uploads` row still knows the body.
            known = await service.call(service.projected_upload, upload_id) if claim.keyed else None
            if known is not None:  # nothing to publish: the job exists; our copy of the body goes
                await service.call(service.store.delete, object_key)
                reused = body_reuse(known["sha256"], known["size_bytes"], sha, size)
                if reused is not None:
                    await service.call(service.release, claim)
                    return refusal_response(reused)
                response = {"job_id": known["job_id"], "upload_id": upload_id,
                            "status_url": f"/api/jobs/{known['job_id']}"}
                service.keeper.discard(claim)
                await service.call(service.published, claim, sha, size, response)
                return accepted(response, replayed=True)
            event = upload_completed(settings, upload_id, object_key, size, sha, filename, priority, submitter,
                                     recorded_by=f"http-intake@{settings.instance_id}", profile=profile)
            await service.call(service.publish, event)
        except BodyTooLarge as exc:
            await service.call(service.release, claim)
            return problem(413, "limits_exceeded", str(exc))
        except BodyTooSlow as exc:
            await service.call(service.release, claim)
            log.info("upload cut off: its body came too slowly", upload_id=upload_id, reason=str(exc))
            return problem(408, "body_too_slow", str(exc))
        except ClientDisconnect:
            await service.call(service.release, claim)
            log.info("client went away mid-upload", upload_id=upload_id)
            return problem(400, "client_disconnected", "the request body ended early")
        except (StorageError, ServiceUnavailable) as exc:
            await service.call(service.release, claim)
            log.warning("upload failed", upload_id=upload_id, error=str(exc))
            return problem(503, "unavailable", str(exc), int(settings.intake_retry_after_min_s) or 1)
        except BaseException:
            await asyncio.shield(service.call(service.release, claim))
            raise
        service.keeper.discard(claim)  # published: its row is no longer a claim to renew
        job_id = event.job_id
        response = {"job_id": job_id, "upload_id": upload_id, "status_url": f"/api/jobs/{job_id}"}
        await service.call(service.published, claim, sha, size, response)
        log.info("upload accepted", job_id=job_id, upload_id=upload_id, submitter=submitter, priority=priority,
                 size_bytes=size)
        return accepted(response)

    return router
