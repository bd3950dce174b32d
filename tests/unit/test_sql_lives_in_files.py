"""SQL lives in `.sql` files (issue 19 item 5): no SQL statement is written as a string in any Python
file of the packages (`SQL_FREE_FILES`; tests and bench may), and the named queries load without a
name defined twice. Python calls a statement by name (`tapeline.postgres.q`, `qf` for run-time
identifiers)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tapeline import postgres

ROOT = Path(__file__).resolve().parents[2]

PACKAGES = ("domain", "processors", "projections", "producers", "tapeline", "cli", "regions", "devstack", "schemas")
SQL_FREE_FILES = tuple(sorted(str(path.relative_to(ROOT)) for package in PACKAGES
                              for path in (ROOT / package).rglob("*.py")))
"""Every Python file of the packages (relative to the repository): none holds an SQL statement
(issue 19 item 5: 0 SQL strings in Python outside tests and bench)."""

STATEMENT = re.compile(
    r"^\s*\(?\s*(SELECT(?!\s+ON\b)|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|GRANT|REVOKE|COMMENT|LOCK|SET|RESET|TRUNCATE|WITH|"
    r"COPY|ANALYZE|VACUUM|REINDEX|EXPLAIN|VALUES|MERGE|DO|BEGIN|COMMIT|ROLLBACK|SHOW|LISTEN|NOTIFY|DECLARE|TABLE)"
    r"(\s|$|\()")
"""A string that starts like an SQL statement (upper-case keywords, as this project writes SQL); not
`SELECT ON x`, how `grant_reader` reports a privilege it granted."""
INSIDE = re.compile(r"\bSELECT\b.*\bFROM\b|\bINSERT INTO\b|\bDELETE FROM\b|\bUPDATE\s+\S+\s+SET\b|\bEXISTS\s*\(\s*SELECT\b"
                    r"|\bON CONFLICT\b|\bWHERE\b.*=\s*(%s|%\(|ANY\()", re.S)
"""SQL further inside a string: a fragment built into a statement (`sql.SQL("EXISTS (SELECT ...")`)."""


def sql_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant or f-string in `source` that looks like SQL; docstrings
    and other bare string expressions (never executed) are skipped."""
    tree = ast.parse(source)
    bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    bare |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if id(node) in bare:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):  # an f-string: its literal parts, the holes as {}
            text = "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        else:
            continue
        if STATEMENT.search(text) or INSIDE.search(text):
            found.append((node.lineno, text))
    return sorted(found)


@pytest.mark.parametrize("relative", SQL_FREE_FILES)
def test_no_sql_string_in_python(relative: str) -> None:
    found = sql_strings((ROOT / relative).read_text())
    assert not found, (f"{relative} writes SQL in Python; move it to a named query in projections/sql/*.sql "
                       "(tapeline.postgres.q, qf for identifiers):\n"
                       + "\n".join(f"  line {line}: {text[:100]!r}" for line, text in found))


def test_scanner_finds_sql_written_in_python() -> None:
    """The check can fail: each way of writing SQL in Python that the moved files used is found."""
    source = '''
"""SELECT in a docstring is prose, not a statement."""
from psycopg import sql
def f(conn, schema, table, names):
    """Update the rows."""
    conn.execute("SELECT oid FROM pg_namespace WHERE nspname = %s", (schema,))
    conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
    conn.execute("INSERT INTO t (a) VALUES (%s)"
                 " ON CONFLICT DO NOTHING", (1,))
    conn.execute(sql.SQL("SELECT {} AS any_row").format(sql.SQL(" OR ").join(
        sql.SQL("EXISTS (SELECT 1 FROM {}.{})").format(sql.Identifier(schema), sql.Identifier(t)) for t in names)))
    cur.copy(f"COPY {table} ({names}) FROM STDIN (FREEZE)")
    conn.execute(f"SET LOCAL maintenance_work_mem = '1GB'")
    conn.execute("  truncate t")  # lower case: not this project's style, not claimed to be found
    message = "schema x exists and is not empty (use --force to drop it)"
'''
    lines = [line for line, _ in sql_strings(source)]
    assert lines == [6, 7, 8, 10, 11, 12, 13], sql_strings(source)


def test_named_queries_load_from_every_file_without_duplicates() -> None:
    names = postgres.queries()
    for path in postgres.query_files():
        for name in re.findall(r"^-- name: (\S+)", path.read_text(), flags=re.M):
            assert names[name].strip(), f"{path.name}: query {name} is empty"
    assert "schema_oid" in names and "job_state_by_ids" in names  # schema_admin.sql and queries.sql


def test_a_name_defined_in_two_files_is_refused(tmp_path, monkeypatch) -> None:
    (tmp_path / "a.sql").write_text("-- name: one\n-- The first.\nSELECT 1;\n")
    (tmp_path / "b.sql").write_text("-- name: two\n-- Another.\nSELECT 2;\n\n-- name: one\n-- Again.\nSELECT 3;\n")
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "001_x.sql").write_text("-- name: one\n-- Not a named query file.\nSELECT 4;\n")
    monkeypatch.setattr(postgres, "SQL_DIR", tmp_path)
    postgres.queries.cache_clear()
    try:
        with pytest.raises(ValueError, match="b.sql defines 'one', already defined in a.sql"):
            postgres.queries()
        (tmp_path / "b.sql").write_text("-- name: two\n-- Another.\nSELECT 2;\n")
        assert postgres.queries() == {"one": "SELECT 1;", "two": "SELECT 2;"}
    finally:
        postgres.queries.cache_clear()


def test_qf_quotes_identifiers_and_keeps_composables() -> None:
    from psycopg import sql

    composed = postgres.qf("replay_finished_in", schema='odd"name')
    assert isinstance(composed, sql.Composed)
    text = composed.as_string(None)
    assert '"odd""name".projection_source' in text and "%(projection)s" in text
    timeout = postgres.qf("set_local_lock_timeout", timeout=sql.Literal("30000ms")).as_string(None)
    assert timeout == "SET LOCAL lock_timeout = '30000ms';"
    assert postgres.identifiers(["a", "b"]).as_string(None) == '"a", "b"'
    with pytest.raises(KeyError):
        postgres.qf("replay_finished_in")
