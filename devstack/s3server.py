"""The local object store: moto's S3 in this process behind a signature gate (issue 20, item 2).

`python -m devstack.s3server --host H --port P` serves moto's S3 (objects in memory) with
`SignedOnly` in front of it (over HTTPS with `--certfile` and `--keyfile`, e.g. a certificate of
`devstack.tls`: werkzeug's `ssl_context`), so the endpoint enforces what the README promises:

* a request signed with AWS Signature V4 (`Authorization: AWS4-HMAC-SHA256 ...`) by the
  configured access key (`TAPELINE_S3_ACCESS_KEY` / `TAPELINE_S3_SECRET_KEY`) is passed on;
* an anonymous request is passed on only when it is a GET or HEAD of an object under
  `published/` of the configured bucket, path-style, without a query string (what a player or
  `ffprobe http://HOST:PORT/BUCKET/published/...` sends);
* everything else is refused with 403 (S3's XML error body): an anonymous list, PUT, COPY,
  DELETE, policy call or multipart call, a wrong key or signature, a request whose `X-Amz-Date`
  is more than `MAX_SKEW_S` away, a body that does not hash to its signed `x-amz-content-sha256`,
  presigned URLs and SigV2 (none of the project's clients use them), and moto's own
  `/moto-api/` (its reset and auth switches, and a dump of every object).

Why not moto's own IAM mode (`INITIAL_NO_AUTH_ACTION_COUNT`): moto 5 never consults the bucket
policy for an anonymous request (it needs an `Authorization` header and answers 500 without one, so
`published/` would not be readable), keys must be made through its IAM API (random ids, not our
settings), and `POST /moto-api/reset-auth` lets anyone switch the checks off. A separate
S3-compatible server (MinIO is docker-compose's) is a Go build or a binary download on every
machine; the gate is ~150 lines over botocore's own signer and keeps the local stack pure Python.
The signature is computed exactly as moto's IAM mode computes it (`botocore.auth.S3SigV4Auth`
over the signed headers, the raw path and query), so every botocore client verifies.

Behind the gate, `MultipartInitiated` corrects one thing moto gets wrong: its ListMultipartUploads
answers `Initiated` 2010-11-10T20:48:33Z for every upload (moto 5.2, `s3/responses.py`), so the
watchdog's cleanup took every unfinished upload for a day-old one and aborted uploads in flight
(a `tapeline submit` of a large file failed with UploadPart answering 500 five times).
`TAPELINE_S3SERVER_DEBUG=1` prints each canonical request (it holds no secret) to compare with
botocore's debug log when a client's signature does not match.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import os
import re
from datetime import datetime, timezone
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

PUBLIC_PREFIX = "published/"
MAX_SKEW_S = 900.0
"""Largest difference between a signed request's `X-Amz-Date` and this server's clock, seconds
(S3's own limit is 15 minutes)."""
MAX_SIGNED_BODY_BYTES = 64 * 1024**2
"""Largest body hashed to check a signed `x-amz-content-sha256` (a multipart part is 8-64 MiB)."""
ANONYMOUS_READ = "AWS4-HMAC-SHA256 Credential=anonymous/19700101/us-east-1/s3/aws4_request"
"""The Authorization the gate gives an anonymous read it passes on (never checked by moto)."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Refused(Exception):
    """A request the gate does not pass on: `status`, S3 error `code`, message for a person."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _field(auth: str, name: str) -> str:
    return auth.partition(f"{name}=")[2].partition(",")[0].strip()


def anonymous_allowed(method: str, path: str, query: str, bucket: str) -> bool:
    """Whether an unsigned request may pass: GET or HEAD of `/{bucket}/published/<key>` (path-style,
    decoded path, no `.`/`..` segment, no query string). Pure."""
    if method not in ("GET", "HEAD") or query:
        return False
    head = f"/{bucket}/{PUBLIC_PREFIX}"
    if not path.startswith(head) or len(path) == len(head):
        return False
    return not any(segment in (".", "..") for segment in path.split("/"))


class SignedOnly:
    """WSGI middleware: passes a request to `app` only when `check` allows it, else answers 403.
    `access_key`/`secret_key`: the one credential accepted; `bucket`: whose `published/` prefix
    anonymous GET/HEAD may read; `now`: the clock for `X-Amz-Date` (UTC; a parameter for tests)."""

    def __init__(self, app: Callable, access_key: str, secret_key: str, bucket: str,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.app, self.access_key, self.secret_key, self.bucket, self.now = app, access_key, secret_key, bucket, now

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        try:
            self.check(environ)
        except Refused as refused:
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{refused.code}</Code>'
                    f"<Message>{escape(refused.message)}</Message></Error>").encode()
            start_response(f"{refused.status} Forbidden", [("Content-Type", "application/xml"),
                                                           ("Content-Length", str(len(body)))])
            return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
        return self.app(environ, start_response)

    def check(self, environ: dict[str, Any]) -> None:
        """Return when the request may pass; raise `Refused` otherwise (see the module docstring).
        May replace `environ["wsgi.input"]` with the body it read to check its hash."""
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        if path.startswith("/moto-api"):
            raise Refused(403, "AccessDenied", "moto's management API is not served")
        auth = environ.get("HTTP_AUTHORIZATION")
        if auth is None:
            if "X-Amz-Signature" in query or "Signature=" in query:
                raise Refused(403, "AccessDenied", "presigned URLs are not accepted here; sign the request")
            if anonymous_allowed(method, path, query, self.bucket):
                # Path-style only: moto would take a bucket from a Host of the form <bucket>.<domain>.
                environ["HTTP_HOST"] = f"{environ.get('SERVER_NAME', '127.0.0.1')}:{environ.get('SERVER_PORT', '')}"
                # The gate decided: moto (no IAM mode) treats a request with an Authorization header
                # as authorised; without one it checks s3:HeadObject against the bucket policy, an
                # action real S3 does not have (HEAD needs s3:GetObject), and refuses every HEAD.
                environ["HTTP_AUTHORIZATION"] = ANONYMOUS_READ
                return
            raise Refused(403, "AccessDenied", f"anonymous access is GET/HEAD of {self.bucket}/{PUBLIC_PREFIX}* "
                                               f"only; sign the request (AWS Signature V4)")
        self._check_signature(environ, auth, method, query)

    def _check_signature(self, environ: dict[str, Any], auth: str, method: str, query: str) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        if not auth.startswith("AWS4-HMAC-SHA256 "):
            raise Refused(403, "AccessDenied", "only AWS Signature V4 (AWS4-HMAC-SHA256) is accepted")
        scope = _field(auth, "Credential").split("/")
        if len(scope) != 5 or scope[4] != "aws4_request":
            raise Refused(403, "AuthorizationHeaderMalformed", "the Credential scope is malformed")
        if not hmac.compare_digest(scope[0].encode(), self.access_key.encode()):
            raise Refused(403, "InvalidAccessKeyId", "the access key id is not known here")
        stamp = environ.get("HTTP_X_AMZ_DATE", "")
        try:
            signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
        except ValueError:
            raise Refused(403, "AccessDenied", "X-Amz-Date is missing or malformed") from None
        if abs((self.now() - signed_at).total_seconds()) > MAX_SKEW_S:
            raise Refused(403, "RequestTimeTooSkewed", f"X-Amz-Date is more than {MAX_SKEW_S:.0f} s from now")
        signed = [h for h in _field(auth, "SignedHeaders").split(";") if h]
        if "host" not in signed:
            raise Refused(403, "AccessDenied", "the Host header must be signed")
        headers = {}
        for name in signed:
            key = {"content-type": "CONTENT_TYPE", "content-length": "CONTENT_LENGTH"}.get(
                name, "HTTP_" + name.upper().replace("-", "_"))
            if key in environ:
                headers[name] = environ[key]
        claimed = headers.get("x-amz-content-sha256")
        if claimed is None:
            raise Refused(403, "AccessDenied", "x-amz-content-sha256 must be signed")
        if _HEX64.fullmatch(claimed):  # a signed payload: the body must be the one signed
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length > MAX_SIGNED_BODY_BYTES:
                raise Refused(403, "AccessDenied", f"a signed body larger than {MAX_SIGNED_BODY_BYTES} bytes")
            body = environ["wsgi.input"].read(length) if length else b""
            environ["wsgi.input"] = io.BytesIO(body)
            if hashlib.sha256(body).hexdigest() != claimed:
                raise Refused(403, "XAmzContentSHA256Mismatch", "the body does not match x-amz-content-sha256")
        raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/")
        request = AWSRequest(method=method, url=raw if "?" in raw or not query else f"{raw}?{query}",
                             headers=headers)
        request.context["timestamp"] = stamp
        signer = S3SigV4Auth(Credentials(self.access_key, self.secret_key), scope[3], scope[2])
        canonical = signer.canonical_request(request)
        expected = signer.signature(signer.string_to_sign(request, canonical), request)
        if os.environ.get("TAPELINE_S3SERVER_DEBUG"):
            print(f"canonical request:\n{canonical}", flush=True)
        if not hmac.compare_digest(expected.encode(), _field(auth, "Signature").encode()):
            raise Refused(403, "SignatureDoesNotMatch", "the request signature does not match (wrong secret key?)")


_UPLOAD_ID = re.compile(rb"<UploadId>([^<]+)</UploadId>")
_UPLOAD = re.compile(rb"<Upload>.*?</Upload>", re.S)
_INITIATED = re.compile(rb"<Initiated>[^<]*</Initiated>")


def with_initiated(listing: bytes, initiated: dict[str, str], unknown: str) -> bytes:
    """A ListMultipartUploads XML body with each `<Upload>`'s `<Initiated>` replaced by the time its
    CreateMultipartUpload was answered (`initiated`: upload id -> ISO 8601 UTC), or by `unknown`
    for an id not recorded. Pure; other bytes are kept as they are."""
    def fix(upload: re.Match[bytes]) -> bytes:
        found = _UPLOAD_ID.search(upload.group(0))
        when = initiated.get(found.group(1).decode(), unknown) if found else unknown
        return _INITIATED.sub(f"<Initiated>{when}</Initiated>".encode(), upload.group(0))
    return _UPLOAD.sub(fix, listing)


def _s3_time(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


class MultipartInitiated:
    """WSGI middleware: records when each multipart upload was created (the answer to
    `POST ?uploads`) and puts that time into ListMultipartUploads (`GET ?uploads`) answers, where
    moto writes a fixed date of 2010 (see the module docstring). An upload this server did not see
    created (one started before a restart: moto keeps nothing across one) gets the server's start
    time. Completed and aborted uploads are forgotten. `now`: UTC clock (a parameter for tests)."""

    def __init__(self, app: Callable, now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.app, self.now = app, now
        self.started = _s3_time(now())
        self.initiated: dict[str, str] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        params = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        if "uploadId" in params and method not in ("GET", "HEAD", "PUT"):  # complete (POST) or abort
            self.initiated.pop(params["uploadId"][0], None)
            return self.app(environ, start_response)
        if "uploads" not in params or method not in ("POST", "GET"):
            return self.app(environ, start_response)
        answered = self.now()
        captured: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            captured.update(status=status, headers=headers, exc_info=exc_info)
            return lambda data: None

        chunks = self.app(environ, capture)
        try:
            body = b"".join(chunks)
        finally:
            getattr(chunks, "close", lambda: None)()
        if captured["status"].startswith("200"):
            if method == "POST":
                found = _UPLOAD_ID.search(body)
                if found:
                    self.initiated[found.group(1).decode()] = _s3_time(answered)
            else:
                body = with_initiated(body, self.initiated, self.started)
        headers = [(k, v) for k, v in captured["headers"] if k.lower() != "content-length"]
        start_response(captured["status"], headers + [("Content-Length", str(len(body)))], captured["exc_info"])
        return [body]


def main(argv: list[str] | None = None) -> None:
    """Serve moto's S3 behind `SignedOnly` until SIGTERM. Credentials and bucket come from the
    settings (`TAPELINE_S3_ACCESS_KEY`, `TAPELINE_S3_SECRET_KEY`, `TAPELINE_S3_BUCKET`)."""
    parser = argparse.ArgumentParser(description="moto's S3 behind a signature gate (Tapeline's local object store)")
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    parser.add_argument("--certfile", help="PEM certificate: serve HTTPS (with --keyfile; devstack.tls makes both)")
    parser.add_argument("--keyfile", help="PEM private key of --certfile")
    args = parser.parse_args(argv)
    if (args.certfile is None) != (args.keyfile is None):
        parser.error("--certfile and --keyfile go together")
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    from tapeline.settings import Settings

    settings = Settings()
    os.environ.setdefault("MOTO_PORT", str(args.port))
    app = SignedOnly(MultipartInitiated(DomainDispatcherApplication(create_backend_app)), settings.s3_access_key,
                     settings.s3_secret_key, settings.s3_bucket)
    scheme = "https" if args.certfile else "http"
    print(f"devstack.s3server: S3 on {scheme}://{args.host}:{args.port}, signed requests by "
          f"{settings.s3_access_key!r}; anonymous GET/HEAD of {settings.s3_bucket}/{PUBLIC_PREFIX}* only", flush=True)
    run_simple(args.host, args.port, app, threaded=True,
               ssl_context=(args.certfile, args.keyfile) if args.certfile else None)


if __name__ == "__main__":
    main()
