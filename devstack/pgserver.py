"""A region's own PostgreSQL server (region B): a second cluster with its data under the stack's home.

Region A uses Debian's cluster (`pg_ctlcluster`, devstack/database.py). Region B must not
share it (issue 25: its own server, not another database), and its files belong under region B's
home, so it runs the Debian binaries (`initdb`, `pg_ctl` of the newest `/usr/lib/postgresql/<v>/bin`)
directly as the `postgres` OS user (the server refuses to run as root)::

    <home>/postgres/data/          the cluster (initdb: local peer auth, host scram-sha-256)
    <home>/postgres/postgres.log   the server's log (pg_ctl -l)
    <home>/postgres/.s.PGSQL.<port> its socket (nothing in /var/run/postgresql)

It listens on the DSN's host and port only. The DSN's role (LOGIN, CREATEDB, its password) and
database are created as region A's are (`ensure_role_and_db`, over this server's socket).

With a server certificate (`up_own_postgres(..., tls=...)`, made by `devstack.tls`) it also speaks TLS
(`ssl=on`, `tls_server_options`); clients that ask for none (`sslmode=prefer`, libpq's default, or
`disable`) still connect, so turning it on breaks no plain client. A client with
`sslmode=verify-full&sslrootcert=<the CA>` gets a verified, encrypted session (docs/production.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from rich.console import Console

from tapeline.settings import Settings

from tapeline.home import StackError, HomePaths, now_iso, say, update_state
from devstack.tls import ServerCertificate
from devstack.database import PG_READY_TIMEOUT_S, psql_quote, pg_connect_error, ensure_role_and_db, pg_params, masked_dsn


def pg_binary(name: str) -> Path:
    """The newest installed PostgreSQL server binary `name` (`/usr/lib/postgresql/<version>/bin/<name>`).

    Raises:
        StackError: no PostgreSQL server binaries are installed.
    """
    root = Path("/usr/lib/postgresql")
    versions = sorted((d for d in root.iterdir() if (d / "bin" / name).is_file()),
                      key=lambda d: int(d.name) if d.name.isdigit() else 0) if root.is_dir() else []
    if not versions:
        raise StackError(f"PostgreSQL's {name} is not installed under {root}; `apt-get install -y postgresql`.")
    return versions[-1] / "bin" / name


def _as_postgres(argv: list[str], timeout_s: float = 60.0, input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run argv as the `postgres` OS user (root only), from `/` (the caller's cwd may be unreadable to
    it), `input_text` on its stdin."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        raise StackError("Region B's own PostgreSQL server runs as the `postgres` OS user: run "
                         "`tapeline stack up --region b` as root.")
    return subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True, cwd="/",
                          timeout=timeout_s, input=input_text)


def server_options(host: str, port: str, socket_dir: Path, tls: ServerCertificate | None = None) -> str:
    """The `postgres` options `pg_ctl -o` passes: listen on host:port only, socket in socket_dir, and
    `tls_server_options(tls)` when a certificate is given."""
    options = f"-p {port} -c listen_addresses={host} -c unix_socket_directories={socket_dir}"
    return f"{options} {tls_server_options(tls)}" if tls is not None else options


def tls_server_options(tls: ServerCertificate) -> str:
    """`postgres` options that turn TLS on with `tls` (PostgreSQL 15 manual, 19.9 "Secure TCP/IP
    Connections with SSL"): `ssl=on`, the certificate and key files, TLS 1.2 at least, and the CA
    (`ssl_ca_file`) that client certificates are verified with when `tls.ca` is known (a client
    certificate is then optional, required only where pg_hba.conf says `cert`). The key must belong
    to the server's OS user and be mode 0600 (`own_tls_files`). Paths may hold no space."""
    files = [tls.cert, tls.key] + ([tls.ca] if tls.ca is not None else [])
    for path in files:
        if " " in str(path):
            raise StackError(f"{path}: the server's TLS files may not have a space in their path (pg_ctl -o)")
    options = f"-c ssl=on -c ssl_cert_file={tls.cert} -c ssl_key_file={tls.key} -c ssl_min_protocol_version=TLSv1.2"
    return f"{options} -c ssl_ca_file={tls.ca}" if tls.ca is not None else options


def own_tls_files(tls: ServerCertificate) -> None:
    """Give the `postgres` OS user the certificate and key (0600): the server refuses a key that
    others can read ("private key file has group or world access")."""
    for path in (tls.cert, tls.key):
        shutil.chown(path, "postgres", "postgres")
    tls.key.chmod(0o600)


def up_own_postgres(settings: Settings, paths: HomePaths, console: Console | None,
                    tls: ServerCertificate | None = None) -> None:
    """Make `settings.database_url` answer from a server of the stack's own: reuse one that answers,
    else create the cluster once (`initdb`), start it (`pg_ctl start`, recorded in `stack.json` as
    `postgres.server`) and create the DSN's role and database. With `tls` (a certificate for the
    DSN's host, `devstack.tls.server_certificate`) the server it starts also speaks TLS
    (`tls_server_options`); the files are handed to the `postgres` user first.

    Raises:
        StackError: not root, the DSN is not local, `initdb` or `pg_ctl` fails (the message holds
            their output or the log's tail), or the DSN still fails after PG_READY_TIMEOUT_S seconds.
    """
    if pg_connect_error(settings) is None:
        say(console, f"[bold]postgres[/]: {masked_dsn(settings.database_url)} answers; reusing it")
        return
    params = pg_params(settings)
    if params["host"] not in ("127.0.0.1", "localhost", "::1"):
        raise StackError(f"PostgreSQL at {masked_dsn(settings.database_url)} does not answer and is not on "
                         "127.0.0.1, so the stack does not start it.")
    data, log = paths.postgres / "data", paths.postgres / "postgres.log"
    paths.postgres.mkdir(parents=True, exist_ok=True)
    shutil.chown(paths.postgres, "postgres", "postgres")
    paths.postgres.chmod(0o700)
    if not (data / "PG_VERSION").is_file():
        say(console, f"[bold]postgres[/]: creating region {settings.region}'s own cluster in {data}")
        result = _as_postgres([str(pg_binary("initdb")), "-D", str(data), "-U", "postgres", "-E", "UTF8",
                               "--locale=C", "--auth-local=peer", "--auth-host=scram-sha-256"])
        if result.returncode != 0:
            raise StackError(f"initdb {data} failed (the `postgres` user must be able to reach {paths.home}):\n"
                             f"{(result.stdout + result.stderr).strip()[-2000:]}")
    host = "127.0.0.1" if params["host"] == "localhost" else params["host"]
    if _as_postgres([str(pg_binary("pg_ctl")), "-D", str(data), "status"]).returncode == 0:
        say(console, f"[bold]postgres[/]: region {settings.region}'s server ({data}) runs")
        ensure_role_and_db(params, params["port"], console, socket_dir=str(paths.postgres))
        return
    if tls is not None:
        own_tls_files(tls)
    result = _as_postgres([str(pg_binary("pg_ctl")), "-D", str(data), "-l", str(log), "-w",
                           "-t", str(int(PG_READY_TIMEOUT_S)), "-o",
                           server_options(host, params["port"], paths.postgres, tls),
                           "start"], timeout_s=PG_READY_TIMEOUT_S + 10)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else ""
        raise StackError(f"pg_ctl start ({data}) failed:\n{(result.stdout + result.stderr).strip()}\n{tail}")
    update_state(paths, "postgres", {"server": str(data), "cluster": f"own server {data} port {params['port']}",
                                      "port": int(params["port"]), "log": str(log), "started_at": now_iso()})
    say(console, f"[bold]postgres[/]: started region {settings.region}'s server on {host}:{params['port']}, "
                  f"log {log}")
    ensure_role_and_db(params, params["port"], console, socket_dir=str(paths.postgres))
    error = pg_connect_error(settings)
    if error is not None:
        raise StackError(f"PostgreSQL still refuses {masked_dsn(settings.database_url)}: {error}")


def turn_tls_on(settings: Settings, tls: ServerCertificate, socket_dir: Path | None = None,
                timeout_s: float = 10.0) -> None:
    """Turn TLS on in the running server `settings.database_url` names (its port; over its socket in
    `socket_dir`, else libpq's default directory, as the `postgres` OS user) without a restart:
    `ALTER SYSTEM` sets `ssl=on` and the files of `tls` (`ssl_ca_file` = `tls.ca`, verifying client
    certificates, when known), then `pg_reload_conf()`. Sessions stay; clients that ask for no TLS
    (libpq's default `prefer`, or `disable`) keep connecting, so a cluster others use can take it
    (PostgreSQL 15 manual, 20.1.2: the ssl settings are read again on SIGHUP). Waits until
    `settings.database_url` connects (it should ask for `sslmode=verify-full` against the CA).

    Raises:
        StackError: not root, psql fails, or the URL still does not connect after `timeout_s`
            seconds (a reload that cannot load the files keeps the old ones and logs why).
    """
    import time

    from tapeline.postgres import q

    own_tls_files(tls)
    params = pg_params(settings)
    script = "\n".join([f"\\set cert {psql_quote(str(tls.cert))}", f"\\set key {psql_quote(str(tls.key))}",
                        f"\\set ca {psql_quote(str(tls.ca or ''))}", q("psql_turn_tls_on"), ""])
    done = _as_postgres(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-p", params["port"], "-d", "postgres",
                         *(["-h", str(socket_dir)] if socket_dir else [])], input_text=script)
    if done.returncode != 0:
        raise StackError(f"turning TLS on (port {params['port']}) failed: {done.stderr.strip()}")
    deadline = time.monotonic() + timeout_s
    while (error := pg_connect_error(settings)) is not None:
        if time.monotonic() > deadline:
            raise StackError(f"PostgreSQL still refuses {masked_dsn(settings.database_url)} after turning TLS on: "
                             f"{error} (the server's log says whether it could load the files)")
        time.sleep(0.2)


def require_client_certificate(settings: Settings, paths: HomePaths, role: str) -> None:
    """Make `role` (created LOGIN, no password, when missing) log in to the stack's own server over
    TCP only by a client certificate whose common name is `role` (`devstack.tls.client_certificate`):
    a `hostssl all <role> ... cert` line first in its pg_hba.conf, then a reload (no restart).
    The server must have been started with a certificate whose `ca` signed the client's.

    Raises:
        StackError: not root, the role cannot be created, or the reload fails.
    """
    if not role.replace("_", "").isalnum() or not role.islower():
        raise StackError(f"role {role!r}: lowercase letters, digits and _ only")
    params = pg_params(settings)
    hba = paths.postgres / "data" / "pg_hba.conf"
    lines = [f"hostssl all {role} 127.0.0.1/32 cert", f"hostssl all {role} ::1/128 cert"]
    current = _as_postgres(["cat", str(hba)])
    if current.returncode != 0:
        raise StackError(f"reading {hba} failed: {current.stderr.strip()}")
    if lines[0] not in current.stdout.splitlines():
        written = _as_postgres(["tee", str(hba)], input_text="\n".join(lines) + "\n" + current.stdout)
        if written.returncode != 0:
            raise StackError(f"writing {hba} failed: {written.stderr.strip()}")
    from tapeline.postgres import q

    script = f"\\set role {psql_quote(role)}\n{q('psql_create_certificate_role')}\n"
    created = _as_postgres(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-p", params["port"], "-h", str(paths.postgres),
                            "-d", "postgres"], input_text=script)
    if created.returncode != 0:
        raise StackError(f"creating role {role} failed: {created.stderr.strip()}")
    reloaded = _as_postgres([str(pg_binary("pg_ctl")), "-D", str(paths.postgres / "data"), "reload"])
    if reloaded.returncode != 0:
        raise StackError(f"pg_ctl reload failed: {(reloaded.stdout + reloaded.stderr).strip()}")


def down_own_postgres(paths: HomePaths, data: str, console: Console | None) -> None:
    """Stop the server whose cluster is `data` (`pg_ctl stop -m fast`); one already stopped is fine.

    Raises:
        StackError: `pg_ctl stop` failed otherwise.
    """
    say(console, f"[bold]postgres[/]: stopping the stack's own server {data}")
    result = _as_postgres([str(pg_binary("pg_ctl")), "-D", data, "-m", "fast", "-w", "stop"])
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0 and "Is server running?" not in output and "No such file" not in output:
        raise StackError(f"pg_ctl stop ({data}) failed:\n{output}")
    update_state(paths, "postgres", None)
