"""`DedupKeysAside`: the replay by workers' dedup keys table, built on a second connection beside
the replay's one transaction and swapped in before its commit (`projections/partitioned.py` `run`);
`copy_spooled`, the COPY of spooled rows both use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from projections.partition_plan import ReplayFailed
from tapeline.crashpoints import crash_point

if TYPE_CHECKING:
    import psycopg


class DedupKeysAside:
    """`applied_dedup_keys` built on a second connection, in parallel with the replay's transaction.

    At the end of a replay by workers, the replay's one transaction still copies the job rows and
    builds the evidence indexes (single-threaded work for the most part) while a core idles; the
    900k-odd dedup keys and their primary key (about 2 s) need nothing from that transaction. So a
    thread copies the spooled keys into a new table of the target schema, `replay_staging_keys_*`,
    builds its primary key and commits; then, right before its commit, the replay's transaction
    drops its own (empty) `applied_dedup_keys` and renames the staging table, its primary key, the
    comments and the grants into place (`install`). Measured on a 924k-record log: the tail of the
    replay 2 s shorter.

    The staging table commits before the replay does. A replay that fails after that drops it
    (`discard`); one killed at that moment leaves it in the schema, which holds no projection row,
    and the next replay into that schema drops the schema and starts over (`pgschema.prepare_fresh`).
    """

    PREFIX = "replay_staging_keys_"

    @dataclass
    class Definition:
        schema: str
        columns: str
        """The column list of `applied_dedup_keys` (names, types, collations, NOT NULL) as SQL."""
        constraints: list[tuple[str, str]]
        """(name, `pg_get_constraintdef`) of its primary key and unique constraints."""

    @staticmethod
    def definition(conn: psycopg.Connection) -> "DedupKeysAside.Definition | None":
        """`applied_dedup_keys` of `conn`'s schema as the staging table must copy it, read from the
        catalog; None (the replay builds it itself) if it has an index that is not a constraint's."""
        from tapeline.postgres import q

        row = conn.execute(q("dedup_keys_columns")).fetchone()
        values = row if isinstance(row, dict) else {"schema": row[0], "columns": row[1]}
        plain_indexes = conn.execute(q("dedup_keys_plain_index_count")).fetchone()
        if not values["columns"] or next(iter(plain_indexes.values() if isinstance(plain_indexes, dict)
                                              else plain_indexes)):
            return None
        constraints = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in conn.execute(q("dedup_keys_unique_constraints"))]
        return DedupKeysAside.Definition(values["schema"], values["columns"], constraints)

    def __init__(self, database_url: str, definition: "DedupKeysAside.Definition", spool) -> None:
        """Start building from `spool` (text COPY rows of `applied_dedup_keys`, read from its start)."""
        import threading
        import uuid

        self.database_url, self.definition = database_url, definition
        self.name = f"{self.PREFIX}{uuid.uuid4().hex[:12]}"
        self.error: BaseException | None = None
        self._conn = None
        self._thread = threading.Thread(target=self._build, args=(spool,), name="replay-dedup-keys", daemon=True)
        self._thread.start()

    def _constraint_name(self, number: int) -> str:
        return f"{self.name}_c{number}"

    def _build(self, spool) -> None:
        from psycopg import sql as pgsql

        from projections.bulk import INDEX_BUILD_MEMORY
        from tapeline.postgres import connect, q, qf

        try:
            with connect(self.database_url, schema=self.definition.schema, autocommit=True) as conn:
                self._conn = conn
                conn.execute(q("session_skip_commit_flush_wait"))  # as the replay's own connection
                with conn.transaction():
                    conn.execute(qf("set_local_maintenance_work_mem", memory=pgsql.Literal(INDEX_BUILD_MEMORY)))
                    conn.execute(qf("create_table_with_columns", table=self.name,
                                    columns=pgsql.SQL(self.definition.columns)))
                    copy_spooled(conn, self.name, ("dedup_key",), spool)  # FREEZE: created in this transaction
                    for number, (_, constraint) in enumerate(self.definition.constraints):
                        conn.execute(qf("add_constraint", table=self.name, name=self._constraint_name(number),
                                        definition=pgsql.SQL(constraint)))
        except BaseException as exc:  # noqa: BLE001 - reported by install(), which the replay's thread calls
            self.error = exc
        finally:
            self._conn = None

    def install(self, conn: psycopg.Connection) -> None:
        """In the replay's transaction on `conn`: wait for the build, then put the staging table in
        the place of `applied_dedup_keys` with the old table's comments and grants. Raises
        `ReplayFailed` when the build failed."""
        from psycopg import sql as pgsql

        from tapeline.postgres import q, qf

        self._thread.join()
        if self.error is not None:
            raise ReplayFailed(f"building applied_dedup_keys beside the replay failed: {self.error}") from self.error
        crash_point("replay.keys_aside_committed")  # tests: the staging table committed, the replay not
        old = "applied_dedup_keys"
        comments = conn.execute(q("dedup_keys_comments")).fetchall()
        grants = conn.execute(q("dedup_keys_grants")).fetchall()
        conn.execute(qf("drop_table", table=old))
        conn.execute(qf("rename_table", table=self.name, new_name=old))
        for number, (name, _) in enumerate(self.definition.constraints):
            conn.execute(qf("rename_constraint", table=old, name=self._constraint_name(number), new_name=name))
        for row in comments:
            column, comment = (row["column"], row["comment"]) if isinstance(row, dict) else row
            if comment is None:
                continue
            if column is None:
                conn.execute(qf("comment_on_table", table=old, comment=pgsql.Literal(comment)))
            else:
                conn.execute(qf("comment_on_column", table=old, column=column, comment=pgsql.Literal(comment)))
        for row in grants:
            grantee, privilege, grantable = tuple(row.values()) if isinstance(row, dict) else row
            conn.execute(qf("grant_privilege_with_grant_option" if grantable else "grant_privilege",
                            privilege=pgsql.SQL(privilege), table=old, grantee=pgsql.SQL(grantee)))

    def discard(self) -> None:
        """After the replay rolled back: stop the build and drop the staging table if it committed
        (best effort; a table left over is dropped with the schema by the next replay into it)."""
        from tapeline.postgres import connect, qf

        conn = self._conn
        if conn is not None:
            try:
                conn.cancel_safe()
            except Exception:  # noqa: BLE001 - it may have just finished
                pass
        self._thread.join(60)
        try:
            with connect(self.database_url, schema=self.definition.schema, autocommit=True) as conn:
                conn.execute(qf("drop_table_if_exists", table=self.name))
        except Exception as exc:  # noqa: BLE001 - the replay's own error is the one to raise
            import structlog

            structlog.get_logger("tapeline.replay").warning(
                "could not drop the replay's staging table; the next replay into the schema drops it",
                schema=self.definition.schema, table=self.name, error=str(exc))


def copy_spooled(conn: psycopg.Connection, table: str, columns: tuple[str, ...], spool) -> None:
    """COPY the text-format rows spooled in `spool` into `table` (FREEZE: truncated in this transaction)."""
    from tapeline.postgres import identifiers, qf

    spool.seek(0)
    with conn.cursor() as cur, cur.copy(qf("copy_text_freeze", table=table, columns=identifiers(columns))) as copy:
        while chunk := spool.read(1024 * 1024):
            copy.write(chunk)
