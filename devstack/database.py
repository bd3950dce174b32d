"""The local PostgreSQL: the Debian cluster, the role and database of `database_url`, the reader role."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from typing import Any

from rich.console import Console

from tapeline.settings import Settings

from tapeline.home import StackError, HomePaths, now_iso, say, update_state
from tapeline.postgres import masked_dsn  # noqa: F401 (devstack's callers import it from here)

PG_READY_TIMEOUT_S = 30.0
"""How long `up` waits for PostgreSQL to accept the DSN after starting its cluster, seconds."""

# --------------------------------------------------------------------------------------------
# PostgreSQL


def pg_params(settings: Settings) -> dict[str, str]:
    from psycopg.conninfo import conninfo_to_dict

    params = {key: str(value) for key, value in conninfo_to_dict(settings.database_url).items()}
    params.setdefault("host", "127.0.0.1")
    params.setdefault("port", "5432")
    params.setdefault("user", os.environ.get("USER", "postgres"))
    params.setdefault("dbname", params["user"])
    return params


def pg_connect_error(settings: Settings, timeout_s: int = 3) -> str | None:
    """None if the DSN accepts a connection and `SELECT 1`, else the error text."""
    import psycopg

    from tapeline.postgres import q

    try:
        with psycopg.connect(settings.database_url, connect_timeout=timeout_s) as conn:
            conn.execute(q("ping"))
        return None
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__


def drop_database(admin_url: str, dbname: str, attempts: int = 4) -> None:
    """Drop database `dbname` if it exists, ending its sessions first.

    `admin_url` is a DSN for another database of the same cluster (the drop cannot run inside the
    database it drops). `DROP DATABASE ... WITH (FORCE)` terminates the sessions, but PostgreSQL 15
    and 16 refuse it to a role that is not a superuser while an autovacuum worker is in the database
    (the worker has no role, so "must be a member of the role whose process is being terminated";
    PostgreSQL 17 added `pg_signal_autovacuum_worker` for this). On that error this runs a plain
    `DROP DATABASE`, which stops autovacuum workers itself and waits up to 5 seconds for the other
    sessions to end, up to `attempts` times.

    Raises psycopg.errors.ObjectInUse if sessions that this role may not end stay connected through
    every attempt, and any other psycopg.Error as it comes.
    """
    import psycopg
    from psycopg import errors

    from tapeline.postgres import qf

    with psycopg.connect(admin_url, autocommit=True) as conn:
        try:
            conn.execute(qf("drop_database_force", database=dbname))
            return
        except errors.InsufficientPrivilege:
            pass
        for attempt in range(1, attempts + 1):
            try:
                conn.execute(qf("drop_database", database=dbname))
                return
            except errors.ObjectInUse:
                if attempt == attempts:
                    raise


def _pg_clusters() -> list[dict[str, str]]:
    """Debian's PostgreSQL clusters (`pg_lsclusters`): version, name, port, status."""
    if shutil.which("pg_lsclusters") is None:
        return []
    out = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=True).stdout
    clusters = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            clusters.append({"version": fields[0], "name": fields[1], "port": fields[2], "status": fields[3]})
    return clusters


def psql_quote(value: str) -> str:
    """A value as a single-quoted psql meta-command argument (`\\set name '...'`)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def reader_role_sql() -> str:
    """psql script: create the read-only role dashboards are granted (migration 010 grants it SELECT on
    every projection) when it is missing."""
    from tapeline.postgres import q

    return q("psql_create_reader_role")


def reader_grant_sql(user: str) -> str:
    """psql script: make the DSN's login role a member of `tapeline_reader`, so `tapeline serve` can
    `SET ROLE tapeline_reader` (a NOLOGIN role is only reachable that way). Idempotent."""
    from tapeline.postgres import q

    return "\n".join([f"\\set login {psql_quote(user)}", q("psql_grant_reader_to_login")])


def _pg_ensure_reader_role(port: str, user: str, console: Console | None) -> None:
    """Create the NOLOGIN role `tapeline_reader` as the `postgres` OS user when it is missing and grant
    it to the DSN's login role `user` (root only; otherwise the migrations and `tapeline serve` say
    how). Failures are reported, not raised."""
    if os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("psql") is None:
        return
    result = subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1",
                             "-p", port, "-d", "postgres"], input=reader_role_sql() + "\n" + reader_grant_sql(user) + "\n",
                            capture_output=True, text=True, cwd="/")
    if result.returncode != 0:
        say(console, f"[yellow]postgres[/]: could not create role tapeline_reader: {result.stderr.strip()}")


def ensure_role_and_db(params: dict[str, str], port: str, console: Console | None,
                           socket_dir: str | None = None) -> None:
    """Create the DSN's role (LOGIN, CREATEDB, its password) and database if missing.

    Runs `psql` as the `postgres` OS user over the local socket (peer authentication; in `socket_dir`
    when given, else libpq's default directory); the server
    refuses to run as root and TCP logins need a password. The values travel on psql's stdin,
    never on a command line. Nothing that already exists is altered.
    """
    if shutil.which("runuser") is None or shutil.which("psql") is None:
        raise StackError("`runuser` and `psql` are needed to create the PostgreSQL role; "
                         "install `postgresql-client` (and run as root).")
    if os.geteuid() != 0:
        raise StackError(f"Creating the PostgreSQL role {params['user']!r} needs root (`runuser -u postgres`); "
                         "run `tapeline stack up` as root once, or create the role and database yourself.")
    from tapeline.postgres import q

    script = "\n".join([
        f"\\set role {psql_quote(params['user'])}",
        f"\\set pw {psql_quote(params.get('password', ''))}",
        f"\\set db {psql_quote(params['dbname'])}",
        q("psql_create_login_role"),
        q("psql_create_database"),
        reader_role_sql(),
        reader_grant_sql(params["user"]),
        "",
    ])
    result = subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1",
                             "-p", port, "-d", "postgres", *(["-h", socket_dir] if socket_dir else [])],
                            input=script, capture_output=True, text=True, cwd="/")
    if result.returncode != 0:
        raise StackError(f"Creating the PostgreSQL role/database failed:\n{result.stderr.strip()}")
    say(console, f"[bold]postgres[/]: role {params['user']!r} (CREATEDB) and database "
                  f"{params['dbname']!r} are present")


def up_postgres(settings: Settings, paths: HomePaths, console: Console | None) -> None:
    """Make `settings.database_url` answer: reuse it, or start the Debian cluster and create the role.

    Raises:
        StackError: PostgreSQL is not installed, no local cluster serves the DSN's port, or the
            DSN still fails after starting the cluster and creating the role and database.
    """
    if pg_connect_error(settings) is None:
        say(console, f"[bold]postgres[/]: {masked_dsn(settings.database_url)} answers; reusing it")
        _warn_if_no_createdb(settings, console)
        params = pg_params(settings)
        if params["host"] in ("127.0.0.1", "localhost", "::1", ""):
            _pg_ensure_reader_role(params["port"], params["user"], console)
        return
    params = pg_params(settings)
    if params["host"] not in ("127.0.0.1", "localhost", "::1", "") and not params["host"].startswith("/"):
        raise StackError(f"PostgreSQL at {masked_dsn(settings.database_url)} does not answer: "
                         f"{pg_connect_error(settings)}. It is not local, so the stack does not manage it.")
    if shutil.which("pg_ctlcluster") is None:
        raise StackError("PostgreSQL is not installed. Install it with `apt-get install -y postgresql`.")
    clusters = [c for c in _pg_clusters() if c["port"] == params["port"]]
    if not clusters:
        raise StackError(f"No PostgreSQL cluster listens on port {params['port']} (see `pg_lsclusters`). "
                         f"Create one with `pg_createcluster <version> main -p {params['port']}`.")
    cluster = clusters[0]
    if not cluster["status"].startswith("online"):
        say(console, f"[bold]postgres[/]: starting cluster {cluster['version']}/{cluster['name']}")
        result = subprocess.run(["pg_ctlcluster", cluster["version"], cluster["name"], "start"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"`pg_ctlcluster {cluster['version']} {cluster['name']} start` failed:\n"
                             f"{(result.stdout + result.stderr).strip()}")
        update_state(paths, "postgres", {"cluster": f"{cluster['version']}/{cluster['name']}",
                                          "port": int(cluster["port"]), "started_at": now_iso()})
    ensure_role_and_db(params, cluster["port"], console)
    deadline = time.monotonic() + PG_READY_TIMEOUT_S
    while (error := pg_connect_error(settings)) is not None:
        if time.monotonic() > deadline:
            raise StackError(f"PostgreSQL still refuses {masked_dsn(settings.database_url)}: {error}")
        time.sleep(0.5)
    say(console, f"[bold]postgres[/]: {masked_dsn(settings.database_url)} answers")


def _warn_if_no_createdb(settings: Settings, console: Console | None) -> None:
    """Warn if the DSN's role cannot CREATE DATABASE (tests create one database per module)."""
    import psycopg

    from tapeline.postgres import q

    with contextlib.suppress(psycopg.Error), psycopg.connect(settings.database_url, connect_timeout=3) as conn:
        row = conn.execute(q("can_create_database")).fetchone()
        if row is not None and not row[0]:
            say(console, "[yellow]postgres[/]: the role cannot CREATE DATABASE; tests that create "
                          "their own database will fail (ALTER ROLE ... CREATEDB)")




def postgres_status(settings: Settings, recorded: dict[str, Any]) -> dict[str, Any]:
    """`{"address" (password masked), "up", "cluster", "started_by_stack", "log"[, "error"]}` of the
    PostgreSQL server `settings.database_url` names; `recorded`: what `stack up` wrote of it in
    stack.json (empty when the stack did not start it). Never raises."""
    error = pg_connect_error(settings)
    report = {"address": masked_dsn(settings.database_url), "up": error is None, "cluster": recorded.get("cluster"),
              "started_by_stack": bool(recorded), "log": recorded.get("log")}
    if error:
        report["error"] = error
    return report
