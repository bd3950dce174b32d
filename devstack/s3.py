"""The local S3 endpoint: moto behind `devstack.s3server`'s signature gate, with the bucket and its policy."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console

from tapeline.settings import Settings

from tapeline.objectstore import endpoint_answers
from devstack.tls import ServerCertificate
from tapeline.home import StackError, HomePaths, host_port, now_iso, owned_pid, say, spawn, update_state, wait_ready

S3_READY_TIMEOUT_S = 30.0
"""How long `up` waits for a freshly started moto_server to answer HTTP, seconds."""


def s3_markers(settings: Settings) -> tuple[str, ...]:
    """What the command line of the stack's own S3 server holds (its module and port): a pid file is
    trusted only for such a process."""
    _, port = host_port(urlsplit(settings.s3_endpoint).netloc, 80)
    return ("devstack.s3server", str(port))

# --------------------------------------------------------------------------------------------
# S3 (moto behind devstack.s3server's signature gate)


def s3_server_command(host: str, port: int, tls: ServerCertificate | None = None) -> list[str]:
    """The command line of the local object store (`devstack.s3server`) on host:port, run by this
    interpreter (its environment has moto); over HTTPS with `tls` (a certificate for `host`,
    `devstack.tls.server_certificate`), its clients then trusting the CA (`TAPELINE_S3_CA_BUNDLE`)."""
    command = [sys.executable, "-m", "devstack.s3server", "-H", host, "-p", str(port)]
    return command + ["--certfile", str(tls.cert), "--keyfile", str(tls.key)] if tls is not None else command


def s3_server_env(settings: Settings) -> dict[str, str]:
    """The environment of the local object store: this process's, with the credentials it accepts
    and the bucket whose `published/` prefix anonymous GET/HEAD may read taken from `settings` (in the
    environment, never on the command line, where `ps` would show the secret)."""
    if settings.s3_access_key is None or settings.s3_secret_key is None:
        raise StackError("The local object store checks signatures by static keys: set TAPELINE_S3_ACCESS_KEY and "
                         "TAPELINE_S3_SECRET_KEY (the default credential chain is for a real S3)")
    return {**os.environ, "TAPELINE_S3_ACCESS_KEY": settings.s3_access_key,
            "TAPELINE_S3_SECRET_KEY": settings.s3_secret_key, "TAPELINE_S3_BUCKET": settings.s3_bucket}


def s3_client(settings: Settings):
    """The product's S3 client (`tapeline.objectstore.client`: credentials, CA bundle, addressing
    style and timeouts of `settings`), with at most 3 tries per call."""
    from tapeline.objectstore import client

    return client(settings.model_copy(update={"s3_max_attempts": min(3, settings.s3_max_attempts)}))


def public_read_policy(bucket: str, prefix: str = "published/") -> dict[str, Any]:
    """The bucket policy that makes objects under prefix, and only those, anonymously readable."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "PublicReadPublished",
            "Effect": "Allow",
            "Principal": "*",
            "Action": "s3:GetObject",
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        }],
    }


def ensure_bucket(settings: Settings, console: Console | None) -> None:
    """Create `settings.s3_bucket` if missing and give it the published-prefix read policy if it has none."""
    from botocore.exceptions import ClientError

    s3 = s3_client(settings)
    bucket = settings.s3_bucket
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise StackError(f"Checking bucket {bucket} at {settings.s3_endpoint} failed: {exc}") from exc
        extra = ({} if settings.s3_region == "us-east-1"
                 else {"CreateBucketConfiguration": {"LocationConstraint": settings.s3_region}})
        s3.create_bucket(Bucket=bucket, **extra)
        say(console, f"[bold]s3[/]: created bucket {bucket}")
    try:
        s3.get_bucket_policy(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "NoSuchBucketPolicy":
            raise StackError(f"Reading the policy of bucket {bucket} failed: {exc}") from exc
        s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps(public_read_policy(bucket)))
        say(console, f"[bold]s3[/]: {bucket}/published/* is publicly readable; everything else is private")


def up_s3(settings: Settings, paths: HomePaths, console: Console | None, tls: ServerCertificate | None = None) -> None:
    """Make the S3 endpoint answer (reuse, or start `devstack.s3server`, over HTTPS with `tls`: then
    `s3_endpoint` is `https://` and `s3_ca_bundle` the CA that signed it) and ensure the bucket.

    Raises:
        StackError: the server exits, or does not answer within S3_READY_TIMEOUT_S.
    """
    pid = owned_pid(paths.s3_pid, s3_markers(settings))
    proc = None
    if pid is not None:
        say(console, f"[bold]s3[/]: devstack.s3server already running (pid {pid})")
    elif endpoint_answers(settings)[0]:
        say(console, f"[bold]s3[/]: {settings.s3_endpoint} answers; reusing it")
        update_state(paths, "s3", None)
    else:
        parts = urlsplit(settings.s3_endpoint)
        host, port = host_port(parts.netloc, 443 if parts.scheme == "https" else 80)
        paths.s3.mkdir(parents=True, exist_ok=True)
        proc = spawn(s3_server_command(host, port, tls), paths.s3_log, paths.s3_pid, cwd=paths.s3,
                      env=s3_server_env(settings))
        say(console, f"[bold]s3[/]: started devstack.s3server pid {proc.pid} on {settings.s3_endpoint} "
                      "(moto, objects in memory; signed requests only, anonymous reads of published/)")
        update_state(paths, "s3", {"pid": proc.pid, "started_at": now_iso(), "endpoint": settings.s3_endpoint,
                                    "log": str(paths.s3_log)})
    wait_ready(f"devstack.s3server ({settings.s3_endpoint})", lambda: endpoint_answers(settings), proc, paths.s3_log,
                S3_READY_TIMEOUT_S)
    ensure_bucket(settings, console)




def s3_status(settings: Settings, paths: HomePaths) -> dict[str, Any]:
    """`{"address", "bucket", "up", "pid", "started_by_stack", "log"[, "error"]}` of the S3 endpoint
    `settings` names (`pid`: the stack's own server, alive; None otherwise). Never raises."""
    pid = owned_pid(paths.s3_pid, s3_markers(settings))
    up, error = endpoint_answers(settings)
    report = {"address": settings.s3_endpoint, "bucket": settings.s3_bucket, "up": up, "pid": pid,
              "started_by_stack": pid is not None, "log": str(paths.s3_log) if pid else None}
    if error:
        report["error"] = error
    return report
