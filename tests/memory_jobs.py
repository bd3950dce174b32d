"""An in-memory `JobStore` (tapeline/ports.py) for unit tests. It runs no SQL, so it is explicit: it
answers each named operation from a table the test gives, and checks the rest of the port's contract
as the PostgreSQL adapter (`tapeline/postgres.py` `PostgresJobStore`) keeps it; the contract suite
`tests/contracts/test_job_store.py` runs against both.

- `answers={"operation": rows}`: rows a list of dicts, one dict (one row), None (no row), or a
  callable `(params) -> rows` (it may raise, e.g. `LockTimeout`, to stand for the server's error).
  `all` and `one` of an operation without an answer raise `Unanswered` (a test that forgot one
  fails, rather than reading nothing); `run` needs none.
- An operation name that is no `-- name:` block of projections/sql/*.sql raises what the adapter
  raises for it (`tapeline.postgres.q`: `ConfigurationError`), checked by the same function.
- `calls`: the (name, params) of every operation that took effect; inside `transaction()` they are
  kept when the block ends and dropped when it raises (the exception goes on).
- `wait_applied` is the adapter's own loop (`tapeline.postgres.wait_applied`) over this store's
  answer for `projector_next_offset` (no answer: nothing applied), so it times out and stops with
  the same `ServiceUnavailable`.
- `lose_session()`: the next operation raises `ServiceUnavailable` as the adapter does when the
  server ended its session, once; the call after it works (a new session).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from domain.errors import ServiceUnavailable
from tapeline.postgres import q, wait_applied

Rows = list[dict[str, Any]] | dict[str, Any] | None


class Unanswered(AssertionError):
    """The test gave no answer for a named query that `all` or `one` was asked."""


class _Cursor:
    """What `tapeline.postgres.wait_applied` reads of a connection's `execute`: one row or None."""

    def __init__(self, row: dict[str, Any] | None) -> None:
        self.row = row

    def fetchone(self) -> dict[str, Any] | None:
        return self.row


class _Positions:
    """A connection for `tapeline.postgres.wait_applied` that answers its one query from the store."""

    def __init__(self, store: "InMemoryJobStore") -> None:
        self.store = store

    def execute(self, sql: str, params: dict[str, Any]) -> _Cursor:
        rows = self.store._rows("projector_next_offset", params, required=False)
        return _Cursor(rows[0] if rows else None)


class InMemoryJobStore:
    """The `JobStore` port over `answers` (see the module). There is no leader mode: the adapter's
    leader store (a lost session raises `psycopg.OperationalError` for good) is tested on PostgreSQL
    (tests/integration/test_leader_sessions.py)."""

    def __init__(self, answers: dict[str, Rows | Callable[[dict[str, Any] | None], Rows]] | None = None) -> None:
        for name in answers or {}:
            q(name)  # an answer for an operation that does not exist is the test's mistake
        self.answers = dict(answers or {})
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self._pending: list[list[tuple[str, dict[str, Any] | None]]] = []
        self.session_lost = False
        self.opened = self.closed = 0

    # -- for tests ---------------------------------------------------------------------------------

    def lose_session(self) -> None:
        """The server ends this store's session: the next operation raises `ServiceUnavailable`."""
        self.session_lost = True

    def names(self) -> list[str]:
        """The names of the operations kept in `calls`, in order."""
        return [name for name, _ in self.calls]

    # -- internals ---------------------------------------------------------------------------------

    def _check_session(self, during: str) -> None:
        if self.session_lost:
            self.session_lost = False
            raise ServiceUnavailable(f"PostgreSQL session lost during {during} (a new one opens on the next call): "
                                     "server closed the connection unexpectedly (in memory: `lose_session()`)")

    def _rows(self, name: str, params: dict[str, Any] | None, required: bool) -> list[dict[str, Any]]:
        if name not in self.answers:
            if required:
                raise Unanswered(f"no answer given for {name!r} (InMemoryJobStore(answers={{{name!r}: ...}}))")
            return []
        answer = self.answers[name]
        rows = answer(params) if callable(answer) else answer
        if rows is None:
            return []
        return [dict(rows)] if isinstance(rows, dict) else [dict(row) for row in rows]

    def _call(self, name: str, params: dict[str, Any] | None, required: bool) -> list[dict[str, Any]]:
        q(name)  # raises ConfigurationError for an unknown name, as the adapter does
        self._check_session(name)
        rows = self._rows(name, params, required)
        (self._pending[-1] if self._pending else self.calls).append((name, params))
        return rows

    # -- the port ----------------------------------------------------------------------------------

    def open(self) -> None:
        self.opened += 1

    def all(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The rows of `answers[name]`. Raises `ConfigurationError` for an unknown name, `Unanswered`
        when the test gave no answer, `ServiceUnavailable` once after `lose_session`."""
        return self._call(name, params, required=True)

    def one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The first row of `answers[name]`, or None (errors as `all`)."""
        rows = self._call(name, params, required=True)
        return rows[0] if rows else None

    def run(self, name: str, params: dict[str, Any] | None = None) -> None:
        """Record the statement (a callable answer runs, and may raise)."""
        self._call(name, params, required=False)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Operations inside are kept in `calls` when the block ends, dropped when it raises (the
        exception goes on). Nested blocks are savepoints."""
        self._check_session("a transaction")
        self._pending.append([])
        try:
            yield
        except BaseException:
            self._pending.pop()
            raise
        done = self._pending.pop()
        (self._pending[-1] if self._pending else self.calls).extend(done)

    def wait_applied(self, topic: str, partition: int, target: int, timeout_s: float,
                     stop: threading.Event | None = None) -> None:
        """Until `answers["projector_next_offset"]` reaches `target` (see the module); raises
        `ServiceUnavailable` after `timeout_s` seconds, or at once when `stop` is set."""
        self._check_session("wait_applied")
        wait_applied(_Positions(self), topic, partition, target, timeout_s, stop=stop)

    def close(self) -> None:
        self.closed += 1
        self.session_lost = False  # a closed session is gone; the next call opens a new one
