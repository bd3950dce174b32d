"""PostgreSQL over TLS (issue 40 item 2), against a real server of this module's own.

A cluster of the module's own on a free port (`devstack.pgserver.up_own_postgres` with a certificate
of `devstack.tls`), never the shared one. Every connection Tapeline makes is given `database_url`
with libpq's `sslmode=verify-full&sslrootcert=<CA>`: the adapter's sessions, the migrations, the read
API's pool; a wrong CA, a wrong host name and a missing CA file are refused with a message that says
which; clients that ask for no TLS still connect.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from devstack import database as pgstack
from devstack import pgserver, tls
from domain.errors import ServiceUnavailable
from tapeline.home import HomePaths
from tapeline.postgres import PostgresJobStore, connect, migrate
from tapeline.settings import Settings
from tests.conftest import tapeline_cli

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tls_home() -> Iterator[Path]:
    """A directory the `postgres` OS user can reach (pytest's own tmp is root's 0700), removed after."""
    home = Path(tempfile.mkdtemp(prefix="tapeline-tls-"))
    home.chmod(0o755)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def authorities(tls_home: Path) -> tuple[tls.CertificateAuthority, tls.CertificateAuthority]:
    """The stack's CA, and another CA that signed nothing the servers present."""
    return tls.stack_ca(tls_home / "ca"), tls.stack_ca(tls_home / "other-ca", name="Some other CA")


def _verified_url(port: int, ca: Path, host: str = "127.0.0.1", extra: str = "") -> str:
    return (f"postgresql://tapeline:tapeline@{host}:{port}/tapeline?sslmode=verify-full&sslrootcert={ca}"
            f"{extra}")


@pytest.fixture(scope="module")
def pg_paths(tls_home: Path) -> HomePaths:
    """The stack home of this module's PostgreSQL server (its cluster under `postgres/data`)."""
    paths = HomePaths(tls_home / "home")
    paths.home.mkdir(mode=0o755)
    return paths


@pytest.fixture(scope="module")
def tls_postgres(tls_home: Path, authorities, pg_paths: HomePaths, base_settings: Settings) -> Iterator[Settings]:
    """A PostgreSQL server of this module's own with TLS on (client certificates verified by the
    stack's CA); settings whose `database_url` verifies it."""
    ca, _ = authorities
    certificate = tls.server_certificate(ca, tls_home / "pg-tls", "postgres", ["127.0.0.1", "localhost"])
    port = _free_port()
    settings = base_settings.model_copy(update={"database_url": _verified_url(port, ca.cert), "db_schema": "public"})
    paths = pg_paths
    pgserver.up_own_postgres(settings, paths, None, tls=certificate)
    try:
        yield settings
    finally:
        pgserver.down_own_postgres(paths, str(paths.postgres / "data"), None)


def _session_tls(conn: psycopg.Connection) -> tuple[bool, str | None]:
    row = conn.execute("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
    return (row["ssl"], row["version"]) if isinstance(row, dict) else (row[0], row[1])


def test_every_connection_verifies_the_server(tls_postgres: Settings) -> None:
    """The migrations, the job store's session and the read API's pool all run over verified TLS."""
    from projections.api import check_reader, reader_pool

    migrate(tls_postgres.database_url)
    with connect(tls_postgres.database_url) as conn:
        assert _session_tls(conn)[0] is True
        assert conn.pgconn.ssl_in_use
    store = PostgresJobStore(tls_postgres)
    try:
        ssl_on, version = _session_tls(store.connection())
        assert ssl_on is True and version in ("TLSv1.2", "TLSv1.3")
    finally:
        store.close()
    check_reader(tls_postgres)
    pool = reader_pool(tls_postgres, max_size=1)
    pool.open(wait=True, timeout=20)
    try:
        with pool.connection() as conn:  # as the reader role, which pg_stat_ssl does not show its session
            assert conn.pgconn.ssl_in_use and conn.execute("SELECT current_user").fetchone()["current_user"] == \
                tls_postgres.reader_role
    finally:
        pool.close()


def test_plain_clients_still_connect(tls_postgres: Settings) -> None:
    """Turning ssl on breaks no client that asks for none: `sslmode=disable` connects in the clear,
    libpq's default `prefer` gets TLS without verifying."""
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    plain = f"postgresql://tapeline:tapeline@127.0.0.1:{port}/tapeline"
    with connect(plain + "?sslmode=disable") as conn:
        assert _session_tls(conn)[0] is False
    with connect(plain + "?sslmode=prefer") as conn:
        assert _session_tls(conn)[0] is True


def test_a_certificate_of_another_ca_is_refused(tls_postgres: Settings, authorities) -> None:
    _, other = authorities
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    wrong = tls_postgres.model_copy(update={"database_url": _verified_url(port, other.cert)})
    with pytest.raises(ServiceUnavailable) as refused:
        connect(wrong.database_url)
    assert "refused over TLS: the server's certificate is not signed by a CA in sslrootcert" in str(refused.value)
    assert "certificate verify failed" in str(refused.value)
    assert "tapeline:***@" in str(refused.value)  # the password stays out of the message
    # what `tapeline stack status` shows for the database
    assert "certificate verify failed" in (pgstack.pg_connect_error(wrong) or "")


def test_the_cli_says_tls_and_stops(tls_postgres: Settings, authorities) -> None:
    """`tapeline migrate` as an operator runs it: with the right CA it works; with another it exits
    at once with the TLS refusal (no hang, no retry loop)."""
    _, other = authorities
    done = tapeline_cli(tls_postgres, "migrate", timeout_s=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "schema public: applied" in done.stdout + done.stderr
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    wrong = tls_postgres.model_copy(update={"database_url": _verified_url(port, other.cert)})
    refused = tapeline_cli(wrong, "migrate", timeout_s=60)
    assert refused.returncode != 0
    assert "refused over TLS: the server's certificate is not signed by a CA in sslrootcert" in \
        " ".join((refused.stdout + refused.stderr).split())


def test_a_certificate_for_another_host_is_refused(tls_postgres: Settings, authorities) -> None:
    """The server's certificate names 127.0.0.1 and localhost; a client that connects to the same
    address under another name (libpq's hostaddr) must not accept it."""
    ca, _ = authorities
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    url = _verified_url(port, ca.cert, host="db.tapeline.invalid", extra="&hostaddr=127.0.0.1")
    with pytest.raises(ServiceUnavailable) as refused:
        connect(url)
    assert "refused over TLS: the server's certificate does not name the host connected to" in str(refused.value)
    assert 'does not match host name "db.tapeline.invalid"' in str(refused.value)
    # the same URL with verify-ca (no name check) connects: the refusal above is the name's
    with connect(url.replace("verify-full", "verify-ca")) as conn:
        assert _session_tls(conn)[0] is True


def test_a_missing_ca_file_is_named(tls_postgres: Settings, tls_home: Path) -> None:
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    with pytest.raises(ServiceUnavailable, match="sslrootcert names no readable CA file"):
        connect(_verified_url(port, tls_home / "no-such-ca.crt"))


def test_a_client_certificate_logs_in(tls_postgres: Settings, pg_paths: HomePaths, authorities,
                                      tls_home: Path) -> None:
    """A role that may log in by a client certificate only: libpq's `sslcert`/`sslkey` in the URL log
    it in; no certificate, one naming another user, and one of another CA are refused, each named."""
    ca, other = authorities
    pgserver.require_client_certificate(tls_postgres, pg_paths, "tapeline_cert")
    port = psycopg.conninfo.conninfo_to_dict(tls_postgres.database_url)["port"]
    base = f"postgresql://tapeline_cert@127.0.0.1:{port}/tapeline?sslmode=verify-full&sslrootcert={ca.cert}"

    def with_certificate(made: tls.ClientCertificate) -> str:
        return f"{base}&sslcert={made.cert}&sslkey={made.key}"

    mine = tls.client_certificate(ca, tls_home / "client", "tapeline_cert", "tapeline_cert")
    with connect(with_certificate(mine)) as conn:
        user, client_dn = conn.execute("SELECT current_user, client_dn FROM pg_stat_ssl "
                                       "WHERE pid = pg_backend_pid()").fetchone()
        assert (user, client_dn) == ("tapeline_cert", "/CN=tapeline_cert")
    with pytest.raises(ServiceUnavailable, match="the server requires a client certificate"):
        connect(base)
    someone = tls.client_certificate(ca, tls_home / "client", "someone", "someone_else")
    with pytest.raises(ServiceUnavailable, match="the client certificate does not name the user logging in"):
        connect(with_certificate(someone))
    foreign = tls.client_certificate(other, tls_home / "client", "foreign", "tapeline_cert")
    with pytest.raises(ServiceUnavailable, match="refused over TLS: the TLS handshake failed") as refused:
        connect(with_certificate(foreign))
    assert "unknown ca" in str(refused.value)


def test_tls_turned_on_by_a_reload(tls_home: Path, authorities, base_settings: Settings) -> None:
    """A running server without TLS (as the shared cluster is) takes it with a reload: a session open
    before it stays, verify-full connects after, plain clients still do."""
    ca, _ = authorities
    port = _free_port()
    plain = base_settings.model_copy(update={"database_url": f"postgresql://tapeline:tapeline@127.0.0.1:{port}/tapeline"})
    paths = HomePaths(tls_home / "plain-home")
    paths.home.mkdir(mode=0o755)
    pgserver.up_own_postgres(plain, paths, None)
    try:
        with connect(plain.database_url + "?sslmode=disable") as before:
            with pytest.raises(ServiceUnavailable, match="the server does not speak TLS"):
                connect(_verified_url(port, ca.cert))
            certificate = tls.server_certificate(ca, tls_home / "reload-tls", "postgres", ["127.0.0.1"])
            verified = plain.model_copy(update={"database_url": _verified_url(port, ca.cert)})
            pgserver.turn_tls_on(verified, certificate, socket_dir=paths.postgres)
            assert before.execute("SELECT 1").fetchone() == (1,)
        with connect(verified.database_url) as conn:
            assert _session_tls(conn)[0] is True
        with connect(plain.database_url + "?sslmode=disable") as conn:
            assert _session_tls(conn)[0] is False
    finally:
        pgserver.down_own_postgres(paths, str(paths.postgres / "data"), None)
