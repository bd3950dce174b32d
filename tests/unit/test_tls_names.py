"""PostgreSQL over TLS (issue 40 item 2): the certificates' names and how a TLS refusal is told."""

from __future__ import annotations

import pytest

from devstack.tls import subject_alt_names
from tapeline.postgres import authentication_refusal, tls_refusal


def test_subject_alt_names_tell_addresses_from_names() -> None:
    assert subject_alt_names(["127.0.0.1", "localhost", "::1", "db.example"]) == \
        "IP:127.0.0.1,DNS:localhost,IP:::1,DNS:db.example"
    with pytest.raises(ValueError):
        subject_alt_names([])


@pytest.mark.parametrize(("message", "meaning"), [
    ('connection failed: SSL error: certificate verify failed', "not signed by a CA in sslrootcert"),
    ('server certificate for "localhost" (and 1 other name) does not match host name "db"',
     "does not name the host connected to"),
    ('root certificate file "/nope.crt" does not exist', "sslrootcert names no readable CA file"),
    ("server does not support SSL, but SSL was required", "does not speak TLS"),
    ("SSL error: tlsv1 alert unknown ca", "TLS handshake failed"),
    ('FATAL:  connection requires a valid client certificate', "requires a client certificate"),
    ('FATAL:  certificate authentication failed for user "x"', "does not name the user logging in"),
])
def test_tls_refusals_are_named(message: str, meaning: str) -> None:
    assert meaning in tls_refusal(message)


def test_other_connection_errors_are_not_tls() -> None:
    assert tls_refusal('connection to server at "127.0.0.1", port 5432 failed: Connection refused') is None
    assert tls_refusal('password authentication failed for user "tapeline"') is None


@pytest.mark.parametrize(("message", "meaning"), [
    ('connection to server at "127.0.0.1", port 5432 failed: FATAL:  password authentication failed for user '
     '"tapeline"', "the password is wrong"),
    ('FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "tapeline", database "tapeline", no encryption',
     "pg_hba.conf"),
    ("fe_sendauth: no password supplied", "gives none"),
    ('FATAL:  role "nobody" does not exist', "no such user"),
    ('FATAL:  database "nowhere" does not exist', "no such database"),
])
def test_refused_logins_are_named(message: str, meaning: str) -> None:
    assert meaning in authentication_refusal(message)


def test_unanswered_and_tls_failures_are_no_refused_login() -> None:
    assert authentication_refusal('connection to server at "127.0.0.1", port 5432 failed: Connection refused') is None
    assert authentication_refusal("SSL error: certificate verify failed") is None
    assert authentication_refusal('FATAL:  the database system is starting up') is None


def test_a_refused_connection_shows_no_password() -> None:
    """The message of a failed connection masks the password wherever the URL holds it (user info or
    libpq's `password` parameter); nothing listens on port 1."""
    from domain.errors import ServiceUnavailable
    from tapeline.postgres import connect

    for url in ("postgresql://u:s3cr3t@127.0.0.1:1/d?sslmode=disable",
                "postgresql://u@127.0.0.1:1/d?password=s3cr3t&sslmode=disable"):
        with pytest.raises(ServiceUnavailable) as failed:
            connect(url)
        assert "s3cr3t" not in str(failed.value) and "***" in str(failed.value)


def test_s3_refusals_are_told_from_other_errors() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    from botocore.exceptions import SSLError as BotoSSLError

    from tapeline.objectstore import access_refusal

    def error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code}}, "ListObjectsV2")

    assert access_refusal(error("SignatureDoesNotMatch")).kind == "authentication"
    assert "not known" in str(access_refusal(error("InvalidAccessKeyId")))
    assert access_refusal(NoCredentialsError()).kind == "authentication"
    assert access_refusal(BotoSSLError(endpoint_url="https://s3.example", error="certificate verify failed")).kind == "tls"
    for other in (error("AccessDenied"), error("NoSuchBucket"), error("SlowDown"),
                  EndpointConnectionError(endpoint_url="http://127.0.0.1:1")):
        assert access_refusal(other) is None, other
