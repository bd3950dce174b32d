"""`tapeline submit --url`: upload through the HTTP intake instead of writing to S3 and Kafka directly.

The file is streamed as the request body (read in 1 MiB blocks, never whole) with an
`Idempotency-Key` made once per submission, so a retry after a 503/429 or a dropped connection can
never make a second job. 503 and 429 answers are waited out for their `Retry-After` seconds (the
caller's `on_wait` shows it), at most `retries` times; any other refusal is a `SubmitError` carrying
the intake's reason.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from producers.submit import check_file
from domain.errors import RegionFenced, ServiceUnavailable, SubmitError
from domain.regions import INTAKE_FENCED_ERROR

BLOCK = 1 << 20


class IntakeClient:
    """A client of one intake (`url`, e.g. `http://127.0.0.1:8400`) with one API `token`."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 300.0) -> None:
        if not token:
            raise SubmitError("the HTTP intake needs an API token: --token or TAPELINE_INTAKE_TOKEN")
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.http.close()

    @staticmethod
    def _blocks(path: Path, on_bytes: Callable[[int], None] | None) -> Iterator[bytes]:
        with open(path, "rb") as fh:
            while block := fh.read(BLOCK):
                if on_bytes:
                    on_bytes(len(block))
                yield block

    def upload(self, path: Path, priority: str = "standard", profile: str = "default", key: str | None = None,
               retries: int = 10, on_wait: Callable[[float, int, dict[str, Any]], None] | None = None,
               on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
        """POST `path` to `/uploads`; the 202 body `{job_id, upload_id, status_url}`.

        `on_wait(seconds, status, body)` waits out each 503/429 (or unreachable intake, status 0):
        it must return after `seconds`, showing the wait as it likes (default: `time.sleep`).
        Raises `RegionFenced` at once for a 503 `region_fenced` (the intake's region is fenced: its
        `upload_to` names the active region's intake), `SubmitError` for a refusal (4xx, 507) or
        when `retries` waits were not enough, and `ServiceUnavailable` when the intake cannot be
        reached after `retries` attempts."""
        check_file(path)
        key = key or str(uuid.uuid4())
        params = {"priority": priority, "profile": profile, "filename": path.name}
        for attempt in range(retries + 1):
            try:
                answer = self.http.post("/uploads", params=params, content=self._blocks(path, on_bytes),
                                        headers={"Idempotency-Key": key, "Content-Type": "application/octet-stream",
                                                 "Content-Length": str(path.stat().st_size)})
            except httpx.TransportError as exc:
                if attempt == retries:
                    raise ServiceUnavailable(f"the intake at {self.url} did not answer: {exc}") from exc
                wait, status, body = min(30.0, 2.0 ** attempt), 0, {"error": "unreachable", "reason": str(exc)}
            else:
                if answer.status_code == 202:
                    return answer.json()
                body = _json(answer)
                if body.get("error") == INTAKE_FENCED_ERROR:  # waiting does not help: another region takes uploads
                    raise RegionFenced(f"the intake refused the upload: {answer.status_code} {body['error']}: "
                                       f"{body.get('reason')}", active_region=str(body.get("active_region")),
                                       upload_to=body.get("upload_to"))
                after = answer.headers.get("retry-after")
                if answer.status_code not in (429, 503) or after is None or attempt == retries:
                    raise SubmitError(f"the intake refused the upload: {answer.status_code} "
                                      f"{body.get('error', '')}: {body.get('reason') or body.get('detail') or answer.text}")
                wait, status = float(after), answer.status_code
            (on_wait or (lambda seconds, _status, _body: time.sleep(seconds)))(wait, status, body)
        raise SubmitError("unreachable")  # the loop returns or raises

    def job(self, status_url: str) -> dict[str, Any] | None:
        """The job at `status_url` (read API `job` object), or None while the intake has not decided."""
        answer = self.http.get(status_url)
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        return answer.json()["job"]


def _json(answer: httpx.Response) -> dict[str, Any]:
    try:
        body = answer.json()
        return body if isinstance(body, dict) else {"reason": str(body)}
    except ValueError:
        return {"reason": answer.text[:500]}
